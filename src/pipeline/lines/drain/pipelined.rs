//! The drain pipelined: a batch the handler answered all delivered is settled (its records,
//! its parked records' removal, the pointer's move) while the next batch is in the handler.
//!
//! The next call starts only after the one before answered with every event delivered, so a
//! receiver still gets a key's events in sequence order, one request after the other; only
//! the writes overlap. The next batch is settled once the one before is (its pointer write's
//! result is the base of the next: a stale base only costs a read). When the writes of the
//! batch before fail, or find the line moved on (the lease lapsed), the next batch's events
//! were delivered but are not recorded: they stay parked, their attempts end as
//! `settle_failed`, and they go again after — duplicates in sequence order, never an event
//! before an earlier one of its key. A drain calls this way only once it has moved the line
//! on once (its first batch settled first), holding a fresh lease (half of it left), with the
//! next batch admitted as any batch is (breaker, storm guard, rate limit).

use crate::event::Event;
use crate::ledger::{Line, Versioned};
use crate::pipeline::attempt;
use crate::pipeline::settle::SettleError;
use crate::sync::LockExt;

use super::{Called, Drain, Drained};

impl Drain<'_> {
    /// Settles `called`, the batch the last step left pending behind `head`, calling the
    /// next meanwhile.
    pub(super) async fn settle_pending(
        &self,
        head: &Event,
        called: Called,
    ) -> Result<Drained, SettleError> {
        match self.current(head).await {
            Ok(Some(read)) => self.overlapped(head, read, called).await,
            Ok(None) => {
                self.forget(&called, &self.moved_on());
                Ok(Drained::Waits)
            }
            Err(e) => {
                self.forget(&called, &e);
                self.reset();
                Err(e)
            }
        }
    }

    /// Settles `called` (delivered in full, behind `head`; `read`: the pointer naming
    /// `head`) while the next batch is called; leaves that one pending when it too was
    /// delivered in full, or settles it after.
    pub(super) async fn overlapped(
        &self,
        head: &Event,
        read: Versioned<Line>,
        called: Called,
    ) -> Result<Drained, SettleError> {
        let fresh = self.fresh(&read.value);
        let last = called.parked.last().map(|p| p.event.clone());
        let next = async {
            match (fresh, &last) {
                (true, Some(last)) => self.call_next(last).await,
                _ => None,
            }
        };
        let (settled, next) = futures::join!(self.settle(head, read, &called), next);
        let Some(next) = next else {
            if settled.is_err() {
                self.reset();
            }
            return settled;
        };
        let moved_to = match settled {
            Ok(Drained::Moved(to)) => to,
            Ok(other) => {
                self.forget(&next, &self.moved_on());
                return Ok(other);
            }
            Err(e) => {
                self.forget(&next, &e);
                self.reset();
                return Err(e);
            }
        };
        if next.all_delivered() {
            *self.pending.locked() = Some(next);
            return Ok(Drained::Moved(moved_to));
        }
        // A failure in the next batch: settled now, after the one before.
        match self.current(&moved_to).await {
            Ok(Some(read)) => self.settle(&moved_to, read, &next).await,
            Ok(None) => {
                self.forget(&next, &self.moved_on());
                Ok(Drained::Waits)
            }
            Err(e) => {
                self.forget(&next, &e);
                self.reset();
                Err(e)
            }
        }
    }

    /// The batch after `last` (the last event of the batch being settled), called if it is
    /// admitted. `None`: nothing to call now (the next step looks again).
    async fn call_next(&self, last: &Event) -> Option<Called> {
        let batch = match self.batch(&last.partition_id, last.sequence_number).await {
            Ok(b) => b?,
            Err(e) => {
                tracing::debug!(partition = %last.partition_id, ordering_key = %self.key, error = %e, "reading the next batch of a drained line failed; the next step reads it again");
                return None;
            }
        };
        let admitted = self.admit(&batch).await?;
        Some(self.call(batch, admitted).await)
    }

    /// The pointer as this drain last wrote it, or read; `None` when the line no longer
    /// names `head` (or has gone).
    async fn current(&self, head: &Event) -> Result<Option<Versioned<Line>>, SettleError> {
        let kept = self.pointer.locked().take();
        let read = match kept {
            Some(v) => Some(v),
            None => {
                let ledger = &self.shared.settler.ledger;
                ledger.line(&head.partition_id, self.key).await?
            }
        };
        Ok(read.filter(|r| self.still_heads(&r.value, head)))
    }

    /// Ends the attempts of `called`'s delivered events, which are not recorded (`why`):
    /// they stay parked and go again.
    fn forget(&self, called: &Called, why: &SettleError) {
        tracing::debug!(ordering_key = %self.key, events = called.delivered, error = %why, "a pipelined batch of a drained line was delivered but not recorded; its events stay parked and go again");
        for a in &called.attempted {
            attempt::finish(a, Err(why));
        }
    }

    /// Forgets what this drain listed and read ahead: after a failed step the next reads the
    /// line again from its pointer's head.
    fn reset(&self) {
        self.listed.locked().clear();
        self.prefetched.locked().clear();
        *self.pointer.locked() = None;
    }

    /// Why a pipelined batch is not recorded when the line moved on meanwhile.
    fn moved_on(&self) -> SettleError {
        SettleError::Contended(format!("the line of ordering key {}", self.key))
    }
}
