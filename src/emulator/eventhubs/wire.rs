//! The socket under the AMQP acceptor. It sits between fe2o3-amqp and the TCP stream and
//! makes the server's frames acceptable to every official client:
//!
//! - **Full-length performatives.** serde_amqp drops trailing null fields; the Python SDK
//!   indexes performative fields by position and fails on a short list. Every outgoing
//!   performative is re-encoded with its full field count (`EMULATOR_NOTES.md` §9.0).
//! - **Held-back `detach` and `disposition` frames.** The Rust SDK's AMQP client (fe2o3 0.14)
//!   loses a disposition that arrives before it has recorded the transfer as unsettled, and
//!   tears its connection down when a detach reply beats its own bookkeeping. On loopback both
//!   happen; holding those frames a few milliseconds (order preserved) removes the races (§6).
//!   The client's window is tiny, but a thread preempted inside it on a loaded machine
//!   reopens it: 2 ms still let one producer hang in a full test run on two busy cores, so
//!   dispositions are held 10 ms (batch sends pay it once per batch).
//! - **`TCP_QUICKACK` re-armed after every read**, because the client does not set
//!   `TCP_NODELAY`: Nagle against delayed ACKs would add ~40 ms to each round trip.
//! - **Faults:** added latency on every outgoing frame, and a cancellation token that kills
//!   the connection (reads and writes fail) when the emulator is told to drop connections.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::emulator::Faults;

/// How long an outgoing `detach` is held back.
pub const DETACH_HOLD: Duration = Duration::from_millis(5);
/// How long an outgoing `disposition` is held back.
pub const DISPOSITION_HOLD: Duration = Duration::from_millis(10);
/// Stop accepting writes from the AMQP engine while this much is queued.
const MAX_QUEUED: usize = 4 << 20;

const AMQP_FRAME: u8 = 0x00;
const DETACH: u64 = 0x16;
const DISPOSITION: u64 = 0x15;

/// The full field count of each AMQP 1.0 performative, by descriptor code.
fn full_field_count(code: u64) -> Option<u8> {
    Some(match code {
        0x10 => 10, // open
        0x11 => 8,  // begin
        0x12 => 14, // attach
        0x13 => 11, // flow
        0x14 => 11, // transfer
        0x15 => 6,  // disposition
        0x16 => 3,  // detach
        0x17 => 1,  // end
        0x18 => 1,  // close
        _ => return None,
    })
}

/// The performative's descriptor code and where its field list starts, for an AMQP frame.
fn performative(frame: &[u8]) -> Option<(u64, usize, usize)> {
    if frame.len() <= 8 || frame[5] != AMQP_FRAME {
        return None;
    }
    let doff = usize::from(frame[4]) * 4;
    let body = frame.get(doff..)?;
    if *body.first()? != 0x00 {
        return None;
    }
    match *body.get(1)? {
        0x53 => Some((u64::from(*body.get(2)?), doff, 3)),
        0x80 => {
            let code = u64::from_be_bytes(body.get(2..10)?.try_into().ok()?);
            Some((code, doff, 10))
        }
        _ => None,
    }
}

/// Re-encodes a frame's performative list at its full length (explicit nulls for the
/// trailing fields serde_amqp left off). Frames it does not understand pass unchanged.
pub fn pad_performative(frame: Vec<u8>) -> Vec<u8> {
    let Some((code, doff, list_at)) = performative(&frame) else {
        return frame;
    };
    let Some(full) = full_field_count(code) else {
        return frame;
    };
    let body = &frame[doff..];
    let parsed = match body.get(list_at) {
        Some(0x45) => Some((0usize, list_at + 1, list_at + 1)),
        Some(0xc0) => body.get(list_at + 1..list_at + 3).map(|b| {
            let (size, count) = (usize::from(b[0]), usize::from(b[1]));
            (count, list_at + 3, list_at + 2 + size)
        }),
        Some(0xd0) => body.get(list_at + 1..list_at + 9).map(|b| {
            let size = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
            let count = u32::from_be_bytes([b[4], b[5], b[6], b[7]]) as usize;
            (count, list_at + 9, list_at + 5 + size)
        }),
        _ => None,
    };
    let Some((count, content_at, end)) = parsed else {
        return frame;
    };
    if count >= usize::from(full) || end > body.len() || content_at > end {
        return frame;
    }
    let mut content = body[content_at..end].to_vec();
    content.resize(content.len() + usize::from(full) - count, 0x40);
    let mut out = Vec::with_capacity(frame.len() + 16);
    out.extend_from_slice(&frame[..doff]);
    out.extend_from_slice(&body[..list_at]);
    if content.len() < 255 {
        out.push(0xc0);
        out.push((content.len() + 1) as u8);
        out.push(full);
    } else {
        out.push(0xd0);
        out.extend_from_slice(&((content.len() + 4) as u32).to_be_bytes());
        out.extend_from_slice(&u32::from(full).to_be_bytes());
    }
    out.extend_from_slice(&content);
    out.extend_from_slice(&body[end..]);
    let size = out.len() as u32;
    out[..4].copy_from_slice(&size.to_be_bytes());
    out
}

struct Outgoing {
    bytes: Vec<u8>,
    written: usize,
    not_before: Instant,
}

/// The AMQP acceptor's transport: a TCP stream with the shims described in the module docs.
pub struct Wire {
    inner: TcpStream,
    faults: Arc<Faults>,
    killed: Pin<Box<WaitForCancellationFutureOwned>>,
    token: CancellationToken,
    pending: Vec<u8>,
    queue: VecDeque<Outgoing>,
    queued: usize,
    last_not_before: Instant,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl fmt::Debug for Wire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wire")
            .field("peer", &self.inner.peer_addr().ok())
            .field("queued", &self.queued)
            .finish()
    }
}

impl Wire {
    /// Wraps `inner`; the connection dies when `token` is cancelled.
    pub fn new(inner: TcpStream, faults: Arc<Faults>, token: CancellationToken) -> Self {
        Self {
            inner,
            faults,
            killed: Box::pin(token.clone().cancelled_owned()),
            token,
            pending: Vec::new(),
            queue: VecDeque::new(),
            queued: 0,
            last_not_before: Instant::now(),
            sleep: None,
        }
    }

    fn aborted() -> io::Error {
        io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "connection dropped by the emulator",
        )
    }

    /// Splits what the engine wrote into frames and queues them with their release times.
    fn frame_pending(&mut self) {
        loop {
            if self.pending.len() >= 8 && &self.pending[..4] == b"AMQP" {
                let header: Vec<u8> = self.pending.drain(..8).collect();
                self.push(header, Duration::ZERO);
                continue;
            }
            if self.pending.len() < 8 {
                return;
            }
            let size = u32::from_be_bytes([
                self.pending[0],
                self.pending[1],
                self.pending[2],
                self.pending[3],
            ]) as usize;
            let size = size.max(8);
            if self.pending.len() < size {
                return;
            }
            let frame: Vec<u8> = self.pending.drain(..size).collect();
            let hold = match performative(&frame) {
                Some((DETACH, ..)) => DETACH_HOLD,
                Some((DISPOSITION, ..)) => DISPOSITION_HOLD,
                _ => Duration::ZERO,
            };
            self.push(pad_performative(frame), hold);
        }
    }

    fn push(&mut self, bytes: Vec<u8>, hold: Duration) {
        let now = Instant::now();
        let not_before = (now + hold + self.faults.delay()).max(self.last_not_before);
        self.last_not_before = not_before;
        self.queued += bytes.len();
        self.queue.push_back(Outgoing {
            bytes,
            written: 0,
            not_before,
        });
    }

    /// Writes queued frames whose time has come; `Ready(Ok)` once the queue is empty.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(front) = self.queue.front_mut() {
            if front.written == 0 && Instant::now() < front.not_before {
                let deadline = front.not_before;
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if sleep.deadline() != deadline {
                    sleep.as_mut().reset(deadline);
                }
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            while front.written < front.bytes.len() {
                match Pin::new(&mut self.inner).poll_write(cx, &front.bytes[front.written..]) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => front.written += n,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            self.queued -= front.bytes.len();
            self.queue.pop_front();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Wire {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.killed.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(Self::aborted()));
        }
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            // Best effort: an error only means the ACK may be delayed.
            let _ = SockRef::from(&this.inner).set_quickack(true);
        }
        r
    }
}

impl AsyncWrite for Wire {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.token.is_cancelled() {
            return Poll::Ready(Err(Self::aborted()));
        }
        if this.queued >= MAX_QUEUED {
            match this.poll_drain(cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                _ if this.queued >= MAX_QUEUED => return Poll::Pending,
                _ => {}
            }
        }
        this.pending.extend_from_slice(buf);
        this.frame_pending();
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.token.is_cancelled() {
            return Poll::Ready(Err(Self::aborted()));
        }
        match this.poll_drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.inner).poll_flush(cx),
            other => other,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.token.is_cancelled() && this.poll_drain(cx).is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut f = vec![0, 0, 0, 0, 2, AMQP_FRAME, 0, 0];
        f.extend_from_slice(body);
        let n = f.len() as u32;
        f[..4].copy_from_slice(&n.to_be_bytes());
        f
    }

    #[test]
    fn short_detach_is_padded_to_three_fields() {
        // detach(handle=1) encoded as list8 with one field.
        let f = frame(&[0x00, 0x53, 0x16, 0xc0, 0x03, 0x01, 0x52, 0x01]);
        let padded = pad_performative(f);
        assert_eq!(
            &padded[8..],
            &[0x00, 0x53, 0x16, 0xc0, 0x05, 0x03, 0x52, 0x01, 0x40, 0x40]
        );
        assert_eq!(
            u32::from_be_bytes(padded[..4].try_into().unwrap()) as usize,
            padded.len()
        );
    }

    #[test]
    fn empty_list_end_is_padded_and_payload_kept() {
        let f = frame(&[0x00, 0x53, 0x17, 0x45, 0xAA, 0xBB]);
        let padded = pad_performative(f);
        assert_eq!(
            &padded[8..],
            &[0x00, 0x53, 0x17, 0xc0, 0x02, 0x01, 0x40, 0xAA, 0xBB]
        );
    }

    #[test]
    fn full_or_unknown_frames_pass_unchanged() {
        let full = frame(&[0x00, 0x53, 0x17, 0xc0, 0x02, 0x01, 0x40]);
        assert_eq!(pad_performative(full.clone()), full);
        let sasl = {
            let mut f = frame(&[0x00, 0x53, 0x44, 0x45]);
            f[5] = 0x01;
            f
        };
        assert_eq!(pad_performative(sasl.clone()), sasl);
        let heartbeat = vec![0, 0, 0, 8, 2, 0, 0, 0];
        assert_eq!(pad_performative(heartbeat.clone()), heartbeat);
        let truncated = frame(&[0x00, 0x53, 0x16, 0xc0, 0x09, 0x01]);
        assert_eq!(pad_performative(truncated.clone()), truncated);
    }
}
