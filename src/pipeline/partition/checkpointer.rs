//! The partition's checkpoint writer: which settled event the next checkpoint names, when a
//! write is due (every N events or T milliseconds, never more often than the minimum
//! interval), and the write itself — in the background, so a blob write's round trip (about
//! 8 ms at the median on Azure, tens at the tail) never stops the partition from starting
//! and settling events. One write at a time; a write names an event that has settled (the
//! contiguous settled prefix's last), so it can only ever move the checkpoint over settled
//! events, whenever it lands.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use azure_messaging_eventhubs::models::ReceivedEventData;
use azure_messaging_eventhubs::processor::PartitionClient;

use super::super::Shared;

/// A checkpoint write in flight.
pub(super) type Writing = Pin<
    Box<
        dyn Future<
                Output = Result<azure_messaging_eventhubs::Result<()>, tokio::time::error::Elapsed>,
            > + Send,
    >,
>;

/// What the write in flight covers, so its success takes off only that.
struct Covers {
    seq: Option<i64>,
    since: u64,
    uncovered: u64,
    /// The enqueued time of the first event received while it was in flight.
    oldest_after: Option<SystemTime>,
}

#[derive(Default)]
pub(super) struct Checkpointer {
    /// The last event of the contiguous settled prefix: what the next checkpoint names.
    pub(super) last_settled: Option<Arc<ReceivedEventData>>,
    /// The sequence number the last successful write named.
    pub(super) written: Option<i64>,
    written_at: Option<Instant>,
    /// Events settled since the last write.
    since: u64,
    /// Events received since the last checkpoint write, and when the oldest was enqueued.
    pub(super) uncovered: u64,
    pub(super) oldest_uncovered: Option<SystemTime>,
    in_flight: Option<Covers>,
}

/// The lag of `events` uncovered events, the oldest enqueued at `oldest`, on the
/// pipeline's clock.
pub(super) fn lag(
    shared: &Shared,
    events: u64,
    oldest: Option<SystemTime>,
) -> super::super::health::Lag {
    let now = shared.clock().now();
    super::super::health::Lag {
        events,
        seconds: oldest
            .and_then(|t| now.duration_since(t).ok())
            .map_or(0.0, |d| d.as_secs_f64()),
    }
}

impl Checkpointer {
    pub(super) fn publish_lag(&self, pid: &str, shared: &Shared) {
        shared
            .health
            .set_lag(pid, lag(shared, self.uncovered, self.oldest_uncovered));
    }

    /// An event was received (enqueued at `enqueued`).
    pub(super) fn received(&mut self, enqueued: SystemTime) {
        self.uncovered += 1;
        self.oldest_uncovered.get_or_insert(enqueued);
        if let Some(c) = self.in_flight.as_mut() {
            c.oldest_after.get_or_insert(enqueued);
        }
    }

    /// The settled prefix moved to `event` (or one more event settled behind a hole).
    pub(super) fn settled(&mut self, moved_to: Option<ReceivedEventData>) {
        if let Some(e) = moved_to {
            self.last_settled = Some(Arc::new(e));
        }
        self.since += 1;
    }

    fn dirty(&self) -> bool {
        self.last_settled.as_ref().and_then(|e| e.sequence_number()) != self.written
            && self.last_settled.is_some()
    }

    /// Whether the count trigger may write now: enough events, and not within the minimum
    /// interval of the last write.
    pub(super) fn count_due(&self, shared: &Shared) -> bool {
        self.since >= shared.options.checkpoint_every_events && self.interval_passed(shared)
    }

    pub(super) fn interval_passed(&self, shared: &Shared) -> bool {
        self.written_at
            .is_none_or(|t| t.elapsed() >= shared.options.checkpoint_min_interval)
    }

    /// Starts a write of the settled prefix if there is something new to name and no write
    /// is in flight; the caller polls it and hands its result to [`Checkpointer::finish`].
    pub(super) fn begin(&mut self, pc: &Arc<PartitionClient>, shared: &Shared) -> Option<Writing> {
        if self.in_flight.is_some() || !self.dirty() {
            return None;
        }
        let ev = self.last_settled.clone()?;
        self.in_flight = Some(Covers {
            seq: ev.sequence_number(),
            since: self.since,
            uncovered: self.uncovered,
            oldest_after: None,
        });
        let (pc, deadline) = (pc.clone(), shared.options.deadline);
        Some(Box::pin(async move {
            tokio::time::timeout(deadline, pc.update_checkpoint(&ev)).await
        }))
    }

    /// The write in flight ended with `result`.
    pub(super) fn finish(
        &mut self,
        result: Result<azure_messaging_eventhubs::Result<()>, tokio::time::error::Elapsed>,
        pid: &str,
        shared: &Shared,
    ) {
        let Some(c) = self.in_flight.take() else {
            return;
        };
        match result {
            Ok(Ok(())) => {
                self.written = c.seq;
                self.written_at = Some(Instant::now());
                self.since = self.since.saturating_sub(c.since);
                self.uncovered = self.uncovered.saturating_sub(c.uncovered);
                self.oldest_uncovered = if self.uncovered > 0 {
                    c.oldest_after
                } else {
                    None
                };
                shared.observe.count_checkpoint();
                shared.health.set_owned(pid, c.seq);
            }
            Ok(Err(e)) => {
                tracing::warn!(partition = pid, error = %e, "checkpoint not written; will try again")
            }
            Err(_) => tracing::warn!(partition = pid, "checkpoint timed out; will try again"),
        }
    }

    /// The last write: waits for the one in flight, then names the settled prefix if it moved
    /// since (the partition stops here; nothing settles any more).
    pub(super) async fn flush(
        &mut self,
        writing: Option<Writing>,
        pc: &Arc<PartitionClient>,
        shared: &Shared,
    ) {
        let pid = pc.get_partition_id().to_string();
        if let Some(w) = writing {
            let r = w.await;
            self.finish(r, &pid, shared);
        }
        if let Some(w) = self.begin(pc, shared) {
            let r = w.await;
            self.finish(r, &pid, shared);
        }
    }
}
