//! Which events of a partition the ledger may hold a pending retry for: what lets a first
//! delivery from Event Hubs settle with no ledger or Service Bus operation (the happy path),
//! and still never leave a record saying RETRY_SCHEDULED behind for an event it delivered.
//!
//! When a partition task starts, it lists the ledger's pending index (one listing of one
//! entry per waiting record, whose metadata names the partition and sequence number, see
//! [`Ledger::pending`](crate::ledger::Ledger::pending)) and keeps those of its own partition.
//! Every write that makes a record RETRY_SCHEDULED writes its index entry first
//! ([`Ledger::put`](crate::ledger::Ledger::put)), and an entry is removed only after its
//! record settled, so the index holds an entry for every waiting record (and may hold
//! stale ones, which only cost a ledger read). A delivery on attempt 1 of an
//! event in that set is settled through the ledger (its record becomes DELIVERED, so the
//! retry message, the overdue sweep and `status` all see it delivered); any other delivery
//! writes nothing. Until a listing has succeeded, every delivery asks the ledger.
//!
//! Why skipping the ledger is safe for an event `E` (key `K`, partition `P`, sequence number
//! `s`) outside the set, delivered by this task on attempt 1. Suppose a RETRY_SCHEDULED record
//! of `E` existed at that moment. Blob storage is strongly consistent in its primary region:
//! a listing shows every write acknowledged before it (Calder et al., "Windows Azure
//! Storage: A Highly Available Cloud Storage Service with Strong Consistency", SOSP 2011,
//! the design Azure Storage is built on). So the record was not
//! RETRY_SCHEDULED when the listing ran — its index entry, written before it, would be in
//! the set (an entry whose metadata does not
//! name its partition or sequence number counts for every event of every partition) — and
//! something made it so afterwards. Only these writes make a record RETRY_SCHEDULED:
//! 1. A failed first attempt of `E` read from Event Hubs (it creates the record). Not this
//!    task: a task reads each sequence number once (its stream is deduplicated by sequence
//!    number, and a stream that skips ends the task), and its attempt of `E` is the one that
//!    just succeeded — so the records this task writes itself are for events it never reads
//!    again, and need not be in its set. Another reader of `P` at the same time: only while
//!    ownership of `P` overlaps (the SDK puts no epoch on the wire, so an old owner reads on
//!    until its next load-balancing cycle notices the loss, and the fenced checkpoint store
//!    refuses its checkpoints once its claim is stale). In that window both readers attempt `E` anyway — the
//!    duplicates the at-least-once contract declares — and the old owner's retry then runs
//!    once more: a duplicate of the same kind, never a loss.
//! 2. A failed retry of `E`: the record was RETRY_SCHEDULED before, hence (by induction on
//!    the writes) created by case 1.
//! 3. An operator's `dead-letters replay`: an explicit request to deliver the event again,
//!    which it then does.
//! 4. A retry whose record was removed by hand, its record rebuilt from the event read back
//!    from Event Hubs (`Settler::rebuild_missing`). The removal already erased what the
//!    ledger knew: a replay of `E` delivered while the record is missing has nothing to
//!    settle, and one delivered after the rebuild by a task whose listing predates it skips
//!    the ledger; either way the rebuilt retry then runs once more — a duplicate of the same
//!    kind, never a loss, and only after a record was removed by hand.
//!
//! The overdue sweep, deferrals and rescues only move records that are already
//! RETRY_SCHEDULED, and stop at a final one, so none of them can resurrect a delivery recorded
//! here.

use crate::sync::LockExt;
use std::collections::HashMap;
use std::sync::Mutex;

use crate::event::Event;
use crate::ledger::Pending;

/// What a partition task knows of its events' ledger records.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    /// `None` until a listing succeeded; then key → the sequence number of the recorded event
    /// (`None`: the listing did not say, so any event with the key).
    listed: Mutex<Option<HashMap<String, Option<i64>>>>,
}

impl Recorded {
    /// Takes in a listing of the ledger's pending retries, keeping those of `partition`.
    pub(crate) fn set_listing(&self, pending: Vec<Pending>, partition: &str) {
        let mine = pending
            .into_iter()
            .filter(|p| p.partition.as_deref().is_none_or(|q| q == partition))
            .map(|p| {
                let seq = p.partition.as_ref().and(p.sequence_number);
                (p.key, seq)
            })
            .collect();
        *self.listed.locked() = Some(mine);
    }

    /// Whether a listing has succeeded.
    pub(crate) fn is_listed(&self) -> bool {
        self.listed.locked().is_some()
    }

    /// Whether the ledger may hold a pending retry of `event` (see the module's argument):
    /// `false` only when a listing says it does not.
    pub(crate) fn may_have_record(&self, event: &Event) -> bool {
        match &*self.listed.locked() {
            None => true,
            Some(keys) => keys
                .get(&event.identity.idempotency_key)
                .is_some_and(|seq| seq.is_none_or(|s| s == event.sequence_number)),
        }
    }

    /// The event settled through the ledger: its entry is no longer needed (this task never
    /// reads it again).
    pub(crate) fn forget(&self, event: &Event) {
        if let Some(keys) = &mut *self.listed.locked() {
            keys.remove(&event.identity.idempotency_key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(key: &str, seq: i64) -> Event {
        Event {
            body: Vec::new(),
            content_type: None,
            properties: Default::default(),
            hub: "hub".into(),
            partition_id: "0".into(),
            sequence_number: seq,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: crate::event::Identity {
                idempotency_key: key.into(),
                correlation_id: key.into(),
                event_type: None,
            },
        }
    }

    fn pending(key: &str, partition: Option<&str>, seq: Option<i64>) -> Pending {
        Pending {
            key: key.into(),
            attempt: 2,
            due: std::time::SystemTime::UNIX_EPOCH,
            last_error: None,
            partition: partition.map(Into::into),
            sequence_number: seq,
            event_type: None,
            correlation_id: None,
        }
    }

    #[test]
    fn only_a_listing_clears_an_event_and_only_of_its_own_partition() {
        let r = Recorded::default();
        assert!(
            r.may_have_record(&event("a", 1)),
            "not listed: ask the ledger"
        );
        r.set_listing(
            vec![
                pending("mine", Some("0"), Some(7)),
                pending("other", Some("1"), Some(7)),
                pending("untagged", None, None),
            ],
            "0",
        );
        assert!(r.is_listed());
        assert!(r.may_have_record(&event("mine", 7)));
        assert!(
            !r.may_have_record(&event("mine", 8)),
            "another event with the key"
        );
        assert!(!r.may_have_record(&event("other", 7)));
        assert!(r.may_have_record(&event("untagged", 3)), "any event");
        assert!(!r.may_have_record(&event("new", 1)));
        r.forget(&event("mine", 7));
        assert!(!r.may_have_record(&event("mine", 7)));
    }
}
