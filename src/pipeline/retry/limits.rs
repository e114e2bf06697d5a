//! The loop's limits: attempt slots, the copies in hand (one attempt per key and attempt at
//! a time), the attempts due and not yet started, and the due messages waiting for a slot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// The loop's limits, shared by its receivers and attempts.
pub(super) struct Limits {
    /// Messages in hand (waiting for their due time, or running): `retry_prefetch`.
    pub(super) held: Arc<Semaphore>,
    /// Attempts at once, each until the breaker has its outcome: `retry_concurrency`.
    pub(super) attempts: Semaphore,
    /// Receivers polling now, and at most.
    pub(super) receivers: AtomicUsize,
    pub(super) max_receivers: usize,
    /// Messages past their due time waiting for an attempt slot (see [`DueWaiting`]).
    pub(super) due_waiting: AtomicUsize,
    /// Due messages waiting at most before receivers pause: [`DUE_PER_SLOT`] per slot.
    pub(super) due_cap: usize,
    pub(super) slot_taken: tokio::sync::Notify,
    /// Messages past their due time whose attempt has not started yet, by due time (ms):
    /// see [`Starting`].
    pub(super) starting: std::sync::Mutex<std::collections::BTreeMap<i64, usize>>,
    pub(super) started: tokio::sync::Notify,
    /// The copies of retry messages in hand, by (key, attempt): see [`Copy`].
    pub(super) in_hand: Arc<InHand>,
    /// This process, in the claims it writes ([`crate::ledger::Claim`]).
    pub(super) instance: String,
}

/// The copies of retry messages in hand, by the attempt they would run. Service Bus hands a
/// message out again once its lock lapses ("Message transfers, locks, and settlement":
/// peek-lock, learn.microsoft.com/azure/service-bus-messaging/message-transfers-locks-settlement),
/// even while the first copy still waits here for its due time; the same attempt can also
/// arrive under another MessageId (a recovered, rescued or deferred copy). Copies in hand are
/// told apart by MessageId and sequence number, and one attempt runs at a time: a copy waits
/// until every earlier copy of its attempt that could still run it is gone, and a copy that
/// a newer delivery of the same message superseded (its lock is gone) stands down before
/// claiming.
#[derive(Default)]
pub(super) struct InHand {
    copies: std::sync::Mutex<std::collections::HashMap<(String, u32), Vec<CopyEntry>>>,
    next: std::sync::atomic::AtomicU64,
    gone: tokio::sync::Notify,
}

struct CopyEntry {
    id: u64,
    /// The message: its MessageId and its sequence number in the queue (a redelivery of a
    /// message keeps both; a message sent anew under the same MessageId, once the duplicate
    /// detection window has passed, is another message).
    message: (String, i64),
    /// Past the point of standing down: claiming or running the attempt.
    committed: bool,
}

impl InHand {
    fn copies(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<(String, u32), Vec<CopyEntry>>> {
        self.copies.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Copy {
    /// Counts a copy of attempt `attempt` of `key` in hand: `message` is its MessageId and
    /// sequence number.
    pub(super) fn register(
        hand: &Arc<InHand>,
        key: &str,
        attempt: u32,
        message: (String, i64),
    ) -> Self {
        let id = hand.next.fetch_add(1, Ordering::AcqRel);
        let slot = (key.to_string(), attempt);
        hand.copies()
            .entry(slot.clone())
            .or_default()
            .push(CopyEntry {
                id,
                message,
                committed: false,
            });
        Self {
            hand: hand.clone(),
            slot,
            id,
        }
    }
}

impl Copy {
    /// Waits until no earlier copy of this attempt may still run it: one committed to it, or
    /// one of another message (with a lock of its own). An earlier delivery of this same
    /// message that has not committed never will (it is superseded), so it is not waited for.
    pub(super) async fn earlier_gone(&self) {
        let hand = &self.hand;
        loop {
            let gone = hand.gone.notified();
            {
                let copies = hand.copies();
                let mine = copies.get(&self.slot).and_then(|v| {
                    v.iter()
                        .find(|c| c.id == self.id)
                        .map(|c| c.message.clone())
                });
                let blocking = copies.get(&self.slot).is_some_and(|v| {
                    v.iter().any(|c| {
                        c.id < self.id && (c.committed || Some(&c.message) != mine.as_ref())
                    })
                });
                if !blocking {
                    return;
                }
            }
            gone.await;
        }
    }

    /// Commits this copy to claiming and running its attempt; `false` when a newer delivery
    /// of the same message superseded it (Service Bus handed the message out again: this
    /// copy's lock is gone), and it must stand down.
    pub(super) fn commit(&self) -> bool {
        let mut copies = self.hand.copies();
        let Some(v) = copies.get_mut(&self.slot) else {
            return false;
        };
        let Some(mine) = v.iter().position(|c| c.id == self.id) else {
            return false;
        };
        if v[mine].committed {
            return true;
        }
        let superseded = v
            .iter()
            .any(|c| c.id > self.id && c.message == v[mine].message);
        if superseded {
            return false;
        }
        v[mine].committed = true;
        true
    }
}

/// One copy of a retry message in hand (see [`InHand`]), until its task ends.
pub(super) struct Copy {
    hand: Arc<InHand>,
    slot: (String, u32),
    id: u64,
}

impl Drop for Copy {
    fn drop(&mut self) {
        let hand = &self.hand;
        {
            let mut copies = hand.copies();
            if let Some(v) = copies.get_mut(&self.slot) {
                v.retain(|c| c.id != self.id);
                if v.is_empty() {
                    copies.remove(&self.slot);
                }
            }
        }
        hand.gone.notify_waiters();
    }
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        let mut starting = self.0.starting();
        let Some(n) = starting.get_mut(&self.1) else {
            return;
        };
        *n -= 1;
        // Waiters only care when every attempt due at some instant has started.
        if *n == 0 {
            starting.remove(&self.1);
            drop(starting);
            self.0.started.notify_waiters();
        }
    }
}

impl Drop for DueWaiting {
    fn drop(&mut self) {
        self.0.due_waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.slot_taken.notify_waiters();
    }
}

/// Due messages per attempt slot before receivers pause. A due message spends two ledger
/// round trips before it can take a slot (the conditional re-read at its due time and the
/// claim: about 16 ms at Azure's median, 80 ms at its tail), so the slots stay busy only
/// if, while one call runs, the next message for its slot is already through them: one
/// waiting per slot and one in its ledger steps.
pub(super) const DUE_PER_SLOT: usize = 2;

/// Settling an attempt waits at most this long for due attempts to start first.
const SETTLE_YIELD_MAX: Duration = Duration::from_millis(250);

impl Limits {
    pub(super) fn starting(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<i64, usize>> {
        self.starting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets the attempts due no later than this one (`due_ms`) start before its settlement
    /// (a ledger write and a complete) takes its share of the machine: when a burst comes
    /// due in one instant, every attempt of it starts first, then they settle. Attempts due
    /// later never hold it up, and it waits at most [`SETTLE_YIELD_MAX`]; the message stays
    /// locked meanwhile.
    pub(super) async fn yield_to_starts(&self, due_ms: i64) {
        let wait = tokio::time::sleep(SETTLE_YIELD_MAX);
        tokio::pin!(wait);
        loop {
            let started = self.started.notified();
            if self
                .starting()
                .first_key_value()
                .is_none_or(|(d, _)| *d > due_ms)
            {
                return;
            }
            tokio::select! {
                _ = started => {}
                _ = &mut wait => return,
            }
        }
    }
}

impl Limits {
    /// Waits while [`DUE_PER_SLOT`] messages per attempt slot are already due and waiting
    /// for one: taking more would only hold them locked here while other replicas, or this
    /// one's slots later, could run them. Messages that arrive early are not held back
    /// (`retry_prefetch` bounds those). `false` if `cancel` fires.
    pub(super) async fn room_for_due(&self, cancel: &CancellationToken) -> bool {
        loop {
            let taken = self.slot_taken.notified();
            if self.due_waiting.load(Ordering::Acquire) < self.due_cap {
                return true;
            }
            tokio::select! {
                _ = cancel.cancelled() => return false,
                _ = taken => {}
            }
        }
    }
}

/// One message past its due time whose attempt has not started: counted from the due time
/// until the attempt starts or the message leaves without one.
pub(super) struct Starting<'a>(&'a Limits, i64);

impl<'a> Starting<'a> {
    pub(super) fn new(limits: &'a Limits, due_ms: i64) -> Self {
        *limits.starting().entry(due_ms).or_default() += 1;
        Self(limits, due_ms)
    }
}

/// One message counted among the due ones waiting for an attempt slot: from the moment a
/// receiver has it in hand (so the next `room_for_due` sees it however late its task
/// starts), until its task finds it early (counted again at its due time) or takes a slot.
pub(super) struct DueWaiting(Arc<Limits>);

impl DueWaiting {
    pub(super) fn new(limits: Arc<Limits>) -> Self {
        limits.due_waiting.fetch_add(1, Ordering::AcqRel);
        Self(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(hand: &Arc<InHand>, id: &str, seq: i64) -> Copy {
        Copy::register(hand, "k", 2, (id.to_string(), seq))
    }

    async fn waits(c: &Copy) -> bool {
        tokio::time::timeout(Duration::from_millis(1), c.earlier_gone())
            .await
            .is_err()
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_supersedes_the_copy_it_replaces_and_other_copies_take_turns() {
        let hand = Arc::new(InHand::default());
        // Service Bus hands the same message out again: the first copy, not yet committed,
        // stands down, and the new one need not wait for it.
        let first = copy(&hand, "k-attempt-2", 7);
        let again = copy(&hand, "k-attempt-2", 7);
        assert!(!waits(&again).await);
        assert!(!first.commit(), "superseded");
        assert!(again.commit());
        // Another message for the same attempt (a recovered copy) waits while one is
        // committed, and goes once it is gone.
        let recovered = copy(&hand, "k-attempt-2-recovered-1", 9);
        assert!(waits(&recovered).await);
        drop(first);
        assert!(
            waits(&recovered).await,
            "the committed copy is still in hand"
        );
        drop(again);
        assert!(!waits(&recovered).await);
        assert!(recovered.commit());
        // A redelivery of a committed copy waits for it (the attempt runs once).
        let late = copy(&hand, "k-attempt-2-recovered-1", 9);
        assert!(waits(&late).await);
        assert!(recovered.commit(), "committed stays committed");
        drop(recovered);
        assert!(!waits(&late).await);
        // A message sent anew under the same MessageId is another message: it waits.
        let anew = copy(&hand, "k-attempt-2-recovered-1", 12);
        assert!(late.commit(), "not superseded by another message");
        assert!(waits(&anew).await);
        drop((late, anew));
        assert!(hand.copies().is_empty());
    }
}
