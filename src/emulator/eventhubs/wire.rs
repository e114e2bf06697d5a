//! The socket under the AMQP acceptor. It sits between fe2o3-amqp and the TCP stream and
//! makes the server's frames acceptable to every official client:
//!
//! - **Full-length performatives.** serde_amqp drops trailing null fields; the Python SDK
//!   indexes performative fields by position and fails on a short list. Every outgoing
//!   performative is re-encoded with its full field count (AMQP 1.0 §1.4 allows the short form).
//! - **Held-back `detach` and `disposition` frames.** The Rust SDK's AMQP client (fe2o3 0.14)
//!   loses a disposition that arrives before it has recorded the transfer as unsettled, and
//!   tears its connection down when a detach reply beats its own bookkeeping. On loopback both
//!   happen; holding those frames a few milliseconds (order preserved) removes the races (§6).
//!   The client's window is tiny, but a thread preempted inside it on a loaded machine
//!   reopens it: 2 ms still let one producer hang in a full test run on two busy cores, so
//!   dispositions are held 10 ms (batch sends pay it once per batch).
//! - **Frames never exceed the peer's `max-frame-size`** (AMQP 1.0 §2.7.1 `open`: the peer
//!   "MUST NOT send frames larger than" the announced value; §2.4 / §2.6.14 / §2.7.5: a larger
//!   delivery is split over transfer frames with `more = true`). fe2o3 splits deliveries so
//!   that each frame is *exactly* at the peer's limit, and padding a transfer to 11 fields
//!   then made it a few bytes too big (65,537 bytes against a 65,536 limit: the Rust SDK's
//!   decoder refused it and rebuilt its consumer forever). So the peer's `open` is read on its
//!   way in, fe2o3 is shown a limit [`FRAME_HEADROOM`] bytes smaller (it splits with room
//!   for the padding), and a re-encoded frame that would still exceed the real limit is sent
//!   unpadded instead.
//! - **`max-message-size` on receiving links** (AMQP 1.0 §2.7.3 `attach`): attaches in
//!   which the emulator is the receiver advertise at most [`MAX_MESSAGE_SIZE`] (1 MiB, the
//!   Event Hubs publication limit), while fe2o3 itself is configured with a larger hard cap,
//!   so a bigger delivery reaches the emulator, which rejects it the way the service does
//!   (see the module docs of `eventhubs`).
//! - **`TCP_QUICKACK` re-armed after every read**, because the client does not set
//!   `TCP_NODELAY`: Nagle against delayed ACKs would add ~40 ms to each round trip.
//! - **Latency per round trip:** what the client sends (each read from its socket: an
//!   attach, a CBS `put-token`, a management request, a `flow` granting credit, a batch of
//!   sends) is handed to the AMQP engine after the service's latency plus the `delay` fault
//!   ([`Faults::round_trip`]), order preserved. The service's frames go out as soon as they
//!   are written, so transfers streamed on credit already granted are not slowed one by one:
//!   a prefetching receiver pays the latency once per `flow`, as on Azure.
//! - **Faults:** a cancellation token that kills the connection (reads and writes fail) when
//!   the emulator is told to drop connections.

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

use super::server::MAX_MESSAGE_SIZE;
use crate::emulator::Faults;

/// How long an outgoing `detach` is held back.
pub const DETACH_HOLD: Duration = Duration::from_millis(5);
/// How long an outgoing `disposition` is held back.
pub const DISPOSITION_HOLD: Duration = Duration::from_millis(10);
/// Stop accepting writes from the AMQP engine while this much is queued.
const MAX_QUEUED: usize = 4 << 20;

/// How much smaller than the peer's announced `max-frame-size` fe2o3 is told it is: room
/// for what re-encoding adds to a frame fe2o3 filled to the limit (a transfer padded from
/// one field to eleven adds 10 bytes, a list8 header growing into a list32 header 6 more).
pub const FRAME_HEADROOM: u32 = 32;
/// The smallest `max-frame-size` AMQP allows (§2.7.1 open: `MIN-MAX-FRAME-SIZE` 512).
const MIN_MAX_FRAME_SIZE: u32 = 512;

const AMQP_FRAME: u8 = 0x00;
const OPEN: u64 = 0x10;
const ATTACH: u64 = 0x12;
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

/// Where the AMQP value starting at `at` ends (its constructor and data), by the format
/// code's width category (AMQP 1.0 §1.6 / types.xml: 0x4_ no data, 0x5_ 1 byte, … 0xA_/0xC_/0xE_
/// a one-byte size, 0xB_/0xD_/0xF_ a four-byte size; 0x00 a described value).
fn skip_value(b: &[u8], at: usize) -> Option<usize> {
    let code = *b.get(at)?;
    if code == 0x00 {
        let value_at = skip_value(b, at + 1)?;
        return skip_value(b, value_at);
    }
    let end = match code >> 4 {
        0x4 => at + 1,
        0x5 => at + 2,
        0x6 => at + 3,
        0x7 => at + 5,
        0x8 => at + 9,
        0x9 => at + 17,
        0xa | 0xc | 0xe => at + 2 + usize::from(*b.get(at + 1)?),
        0xb | 0xd | 0xf => {
            let n = u32::from_be_bytes(b.get(at + 1..at + 5)?.try_into().ok()?);
            at + 5 + n as usize
        }
        _ => return None,
    };
    (end <= b.len()).then_some(end)
}

/// The byte ranges of the encoded fields in a list's content.
fn field_ranges(content: &[u8], count: usize) -> Option<Vec<std::ops::Range<usize>>> {
    let mut ranges = Vec::with_capacity(count);
    let mut at = 0;
    for _ in 0..count {
        let end = skip_value(content, at)?;
        ranges.push(at..end);
        at = end;
    }
    Some(ranges)
}

/// In an attach whose role is receiver (the emulator receives: producers, CBS and
/// management requests), caps `max-message-size` (field 10) at [`MAX_MESSAGE_SIZE`]; null and
/// 0 mean "no limit" (§2.7.3) and are capped too. `content` holds all 14 fields.
fn cap_receiver_max_message_size(content: Vec<u8>) -> Vec<u8> {
    let Some(fields) = field_ranges(&content, 14) else {
        return content;
    };
    if content[fields[2].start] != 0x41 {
        return content; // role false: the emulator sends on this link
    }
    let f = fields[10].clone();
    let current = match content[f.start] {
        0x44 => Some(0),
        0x53 => content.get(f.start + 1).map(|b| u64::from(*b)),
        0x80 => content
            .get(f.start + 1..f.start + 9)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_be_bytes),
        _ => None,
    };
    if current.is_some_and(|v| v != 0 && v <= MAX_MESSAGE_SIZE) {
        return content;
    }
    let mut out = Vec::with_capacity(content.len() + 9);
    out.extend_from_slice(&content[..f.start]);
    out.push(0x80);
    out.extend_from_slice(&MAX_MESSAGE_SIZE.to_be_bytes());
    out.extend_from_slice(&content[f.end..]);
    out
}

/// Re-encodes a frame's performative list at its full length (explicit nulls for the
/// trailing fields serde_amqp left off) and caps a receiving link's `max-message-size`.
/// Frames it does not understand pass unchanged.
pub fn pad_performative(frame: Vec<u8>) -> Vec<u8> {
    rewrite_performative(&frame).unwrap_or(frame)
}

/// The re-encoded frame, or `None` when it stays as it is (see [`pad_performative`]).
fn rewrite_performative(frame: &[u8]) -> Option<Vec<u8>> {
    let (code, doff, list_at) = performative(frame)?;
    let full = full_field_count(code)?;
    let body = &frame[doff..];
    let (count, content_at, end) = match body.get(list_at) {
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
    }?;
    if end > body.len() || content_at > end || count > usize::from(full) {
        return None;
    }
    let mut content = body[content_at..end].to_vec();
    content.resize(content.len() + usize::from(full) - count, 0x40);
    if code == ATTACH {
        content = cap_receiver_max_message_size(content);
    }
    if count == usize::from(full) && content[..] == body[content_at..end] {
        return None;
    }
    let mut out = Vec::with_capacity(frame.len() + 32);
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
    Some(out)
}

/// Reads the `max-frame-size` of an incoming `open` frame and lowers it by
/// [`FRAME_HEADROOM`] in place (a `uint` keeps its four bytes). Returns the value the peer
/// announced: null or absent means no limit (§2.7.1: default 4294967295).
fn lower_open_max_frame_size(frame: &mut [u8]) -> Option<u32> {
    let (code, doff, list_at) = performative(frame)?;
    if code != OPEN {
        return None;
    }
    let body = &frame[doff..];
    let (count, content_at) = match *body.get(list_at)? {
        0x45 => (0, list_at + 1),
        0xc0 => (usize::from(*body.get(list_at + 2)?), list_at + 3),
        0xd0 => {
            let b = body.get(list_at + 5..list_at + 9)?;
            (u32::from_be_bytes(b.try_into().ok()?) as usize, list_at + 9)
        }
        _ => return None,
    };
    if count < 3 {
        return Some(u32::MAX);
    }
    let fields = field_ranges(&body[content_at..], 3)?;
    let at = doff + content_at + fields[2].start;
    let announced = match frame[at] {
        0x40 => return Some(u32::MAX),
        0x43 => 0,
        0x52 => u32::from(frame[at + 1]),
        0x70 => u32::from_be_bytes(frame[at + 1..at + 5].try_into().ok()?),
        _ => return None,
    };
    if frame[at] == 0x70 && announced >= MIN_MAX_FRAME_SIZE + FRAME_HEADROOM {
        frame[at + 1..at + 5].copy_from_slice(&(announced - FRAME_HEADROOM).to_be_bytes());
    }
    Some(announced)
}

/// The read side until the peer's `open` has gone by: whole units (protocol headers and
/// frames) are held until complete so the `open` can be read and its `max-frame-size`
/// lowered; afterwards bytes pass straight through.
#[derive(Default)]
struct OpenScan {
    done: bool,
    held: Vec<u8>,
    ready: VecDeque<u8>,
}

impl OpenScan {
    /// Moves complete units from `held` to `ready`; returns the peer's `max-frame-size`
    /// once its `open` has gone by.
    fn process(&mut self) -> Option<u32> {
        let mut announced = None;
        while !self.done {
            if self.held.len() >= 8 && &self.held[..4] == b"AMQP" {
                self.ready.extend(self.held.drain(..8));
                continue;
            }
            if self.held.len() < 8 {
                break;
            }
            let size = u32::from_be_bytes(self.held[..4].try_into().expect("4 bytes")) as usize;
            if size < 8 {
                // Not a frame fe2o3 will accept: stop looking and let it fail as it would.
                self.done = true;
                break;
            }
            if self.held.len() < size {
                break;
            }
            let mut frame: Vec<u8> = self.held.drain(..size).collect();
            if let Some(max) = lower_open_max_frame_size(&mut frame) {
                announced = Some(max);
                self.done = true;
            }
            self.ready.extend(frame);
        }
        if self.done {
            self.ready.extend(self.held.drain(..));
        }
        announced
    }
}

struct Inbound {
    at: Instant,
    bytes: Vec<u8>,
    read: usize,
}

/// Copies as much of `ready` as fits into `buf`.
fn take_ready(ready: &mut VecDeque<u8>, buf: &mut ReadBuf<'_>) {
    let n = ready.len().min(buf.remaining());
    let (a, b) = ready.as_slices();
    let from_a = n.min(a.len());
    buf.put_slice(&a[..from_a]);
    buf.put_slice(&b[..n - from_a]);
    ready.drain(..n);
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
    /// What the client sent, each read with the time it reaches the engine.
    inbound: VecDeque<Inbound>,
    /// The release time of the latest read (releases keep the order they arrived in).
    last_release: Instant,
    read_sleep: Option<Pin<Box<Sleep>>>,
    /// The socket's end: `Some(None)` end of stream, `Some(Some(e))` a read error; handed
    /// to the engine once everything before it is released.
    read_end: Option<Option<io::Error>>,
    scan: OpenScan,
    /// The `max-frame-size` the peer announced in its `open` (`u32::MAX` until then).
    peer_max_frame_size: u32,
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
            inbound: VecDeque::new(),
            last_release: Instant::now(),
            read_sleep: None,
            read_end: None,
            scan: OpenScan::default(),
            peer_max_frame_size: u32::MAX,
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
            let frame = match rewrite_performative(&frame) {
                Some(padded) if padded.len() <= self.peer_max_frame_size as usize => padded,
                Some(padded) => {
                    tracing::warn!(
                        size = padded.len(),
                        limit = self.peer_max_frame_size,
                        "eventhubs emulator: a padded frame would exceed the peer's max-frame-size; sent unpadded"
                    );
                    frame
                }
                None => frame,
            };
            self.push(frame, hold);
        }
    }

    fn push(&mut self, bytes: Vec<u8>, hold: Duration) {
        let now = Instant::now();
        let not_before = (now + hold).max(self.last_not_before);
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
        // Take everything the socket has now, stamped with when it reaches the engine.
        for _ in 0..32 {
            if this.read_end.is_some() {
                break;
            }
            let mut tmp = [0u8; 8192];
            let mut tmp_buf = ReadBuf::new(&mut tmp);
            match Pin::new(&mut this.inner).poll_read(cx, &mut tmp_buf) {
                Poll::Ready(Ok(())) => {
                    // Best effort: an error only means the ACK may be delayed.
                    let _ = SockRef::from(&this.inner).set_quickack(true);
                    if tmp_buf.filled().is_empty() {
                        this.read_end = Some(None);
                        break;
                    }
                    let at = (Instant::now() + this.faults.round_trip()).max(this.last_release);
                    this.last_release = at;
                    this.inbound.push_back(Inbound {
                        at,
                        bytes: tmp_buf.filled().to_vec(),
                        read: 0,
                    });
                }
                Poll::Ready(Err(e)) => this.read_end = Some(Some(e)),
                Poll::Pending => break,
            }
        }
        // Hand over what is due, through the scan for the peer's `open` until it is found.
        loop {
            if !this.scan.ready.is_empty() {
                take_ready(&mut this.scan.ready, buf);
                return Poll::Ready(Ok(()));
            }
            let Some(front) = this.inbound.front_mut() else {
                break;
            };
            if Instant::now() < front.at {
                let deadline = front.at;
                let sleep = this
                    .read_sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if sleep.deadline() != deadline {
                    sleep.as_mut().reset(deadline);
                }
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                continue;
            }
            if this.scan.done {
                let n = (front.bytes.len() - front.read).min(buf.remaining());
                buf.put_slice(&front.bytes[front.read..front.read + n]);
                front.read += n;
                if front.read == front.bytes.len() {
                    this.inbound.pop_front();
                }
                return Poll::Ready(Ok(()));
            }
            let chunk = this.inbound.pop_front().expect("a front chunk");
            this.scan.held.extend_from_slice(&chunk.bytes[chunk.read..]);
            if let Some(max) = this.scan.process() {
                this.peer_max_frame_size = max;
            }
        }
        match this.read_end.take() {
            None => Poll::Pending,
            Some(Some(e)) => Poll::Ready(Err(e)),
            Some(None) => {
                this.read_end = Some(None);
                if !this.scan.done {
                    // End of stream: hand over what is held, then report the end.
                    this.scan.done = true;
                    this.scan.ready.extend(this.scan.held.drain(..));
                    take_ready(&mut this.scan.ready, buf);
                }
                Poll::Ready(Ok(()))
            }
        }
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

    /// An open with container-id "c", no hostname and max-frame-size `max` (a uint).
    fn open_frame(max: u32) -> Vec<u8> {
        let mut body = vec![
            0x00, 0x53, 0x10, 0xc0, 0x0a, 0x03, 0xa1, 0x01, b'c', 0x40, 0x70,
        ];
        body.extend_from_slice(&max.to_be_bytes());
        frame(&body)
    }

    #[test]
    fn the_peers_open_is_read_and_its_max_frame_size_lowered_by_the_headroom() {
        let mut f = open_frame(65_536);
        assert_eq!(lower_open_max_frame_size(&mut f), Some(65_536));
        assert_eq!(&f[f.len() - 4..], &(65_536 - FRAME_HEADROOM).to_be_bytes());
        // At the protocol minimum there is nothing to take away.
        let mut f = open_frame(512);
        assert_eq!(lower_open_max_frame_size(&mut f), Some(512));
        assert_eq!(&f[f.len() - 4..], &512u32.to_be_bytes());
        // No max-frame-size field: no limit.
        let mut f = frame(&[0x00, 0x53, 0x10, 0xc0, 0x04, 0x01, 0xa1, 0x01, b'c']);
        assert_eq!(lower_open_max_frame_size(&mut f), Some(u32::MAX));
    }

    #[test]
    fn the_open_scan_finds_the_open_across_split_reads_and_keeps_the_bytes() {
        let mut input = b"AMQP\x00\x01\x00\x00".to_vec();
        input.extend(open_frame(65_536));
        input.extend_from_slice(&[0, 0, 0, 8, 2, 0, 0, 0]);
        let mut scan = OpenScan::default();
        let mut announced = None;
        for chunk in input.chunks(5) {
            scan.held.extend_from_slice(chunk);
            if let Some(m) = scan.process() {
                announced = Some(m);
            }
        }
        assert_eq!(announced, Some(65_536));
        assert!(scan.done);
        let out: Vec<u8> = scan.ready.into_iter().collect();
        assert_eq!(out.len(), input.len());
        assert_eq!(&out[..8], &input[..8]);
        let lowered = 8 + open_frame(65_536).len() - 4;
        assert_eq!(
            &out[lowered..lowered + 4],
            &(65_536 - FRAME_HEADROOM).to_be_bytes()
        );
    }

    #[test]
    fn padding_a_transfer_adds_at_most_the_headroom() {
        // transfer(handle 0) with only one field and a payload: the worst case.
        let mut body = vec![0x00, 0x53, 0x14, 0xc0, 0x02, 0x01, 0x43];
        body.extend_from_slice(&[0xAB; 1000]);
        let f = frame(&body);
        let padded = pad_performative(f.clone());
        assert_eq!(padded.len(), f.len() + 10);
        assert!(padded.len() - f.len() <= FRAME_HEADROOM as usize);
        assert_eq!(&padded[padded.len() - 1000..], &[0xAB; 1000][..]);
    }

    /// An attach with 14 fields: name "l", handle 0, `role`, and max-message-size `mms`.
    fn attach_frame(role: u8, mms: &[u8]) -> Vec<u8> {
        let mut content = vec![0xa1, 0x01, b'l', 0x43, role];
        content.extend_from_slice(&[0x40; 7]); // fields 3..=9
        content.extend_from_slice(mms); // field 10
        content.extend_from_slice(&[0x40; 3]); // fields 11..=13
        let mut body = vec![0x00, 0x53, 0x12, 0xc0, (content.len() + 1) as u8, 14];
        body.extend(content);
        frame(&body)
    }

    #[test]
    fn receiving_links_advertise_at_most_one_mebibyte() {
        let mut cap = vec![0x80];
        cap.extend_from_slice(&(16u64 << 20).to_be_bytes());
        let padded = pad_performative(attach_frame(0x41, &cap));
        let mut want = vec![0x80];
        want.extend_from_slice(&MAX_MESSAGE_SIZE.to_be_bytes());
        assert_eq!(padded, attach_frame(0x41, &want));
        // Unlimited (null) is capped too; a smaller limit is kept.
        assert_eq!(
            pad_performative(attach_frame(0x41, &[0x40])),
            attach_frame(0x41, &want)
        );
        let small = attach_frame(0x41, &[0x53, 0x80]);
        assert_eq!(pad_performative(small.clone()), small);
        // Sending links (role false) are left alone.
        let sender = attach_frame(0x42, &cap);
        assert_eq!(pad_performative(sender.clone()), sender);
    }
}
