//! Ordered retries (`processor.retry_ordering = "key"`): while an event of ordering key `K`
//! waits for a retry, the later events of `K` on its partition are *parked* in a durable line
//! behind it and delivered, in sequence order, once it settles. The storage is in
//! [`crate::ledger::lines`]: a small head pointer per line, one parked record per event.
//!
//! **Who does what.** Only the partition's owner opens a line (when an event fails on its
//! first attempt, *before* its failure is settled, so the pointer exists before any retry
//! message can run and end it) and parks events (a parked record, then a compare-and-swap of
//! the pointer). Whoever settles the head for good — the retry loop on any replica, the
//! partition for a head replayed from Event Hubs, or the sweep for a line left behind by a
//! crash — *advances* the line ([`advance`]): the next parked event (lowest sequence number)
//! gets an ordinary ledger record (attempt 1 due now), the pointer names it as the new head
//! (compare-and-swap), its retry message goes to Service Bus, and its parked record goes. So a
//! line drains through the same durable, claimable path as every retry, on whichever replica
//! takes the message; one that fails becomes the head with its own schedule. When nothing
//! is parked, the line ends: the pointer becomes a tombstone (`If-Match`) naming the last
//! event the line settled, so a replay of an event it settled (a crash before the checkpoint
//! passed it) is checked against its ledger record and not delivered again; the partition's
//! owner deletes the tombstone once its checkpoint has passed that event.
//!
//! **The race.** A partition parking event `E` while a retry loop ends the line: the
//! partition writes `E`'s parked record, then rewrites the pointer `If-Match` the ETag it
//! read; the retry loop reads the pointer, lists the parked records, and writes the tombstone
//! `If-Match` the ETag it read. If the partition's rewrite lands first, the end fails and the
//! retry loop lists again (finding `E`); if the end lands first, the rewrite fails, the
//! partition finds the line ended, removes `E`'s parked record and delivers `E` itself; and a
//! listing that found `E` releases it instead of ending the line. List Blobs is strongly
//! consistent (see `pipeline::recorded`), so exactly one of them takes `E`.
//!
//! **What the partition knows.** At claim it lists its lines' pointers (one listing, tags
//! only); from then on it opens every line of its partition itself, so a key it does not know
//! to have a line has none, and its events cost nothing extra (no ledger or Service Bus
//! operation). A key it knows to have a line may have lost it meanwhile (the head settled on
//! another replica): its next event reads the pointer once, finds it gone, and is delivered.
//! Until a listing has succeeded, each event with a key reads its pointer. The one case this
//! cannot rule out is the one `pipeline::recorded` names: a previous owner still reading the
//! partition during a rebalance, which may deliver an event of a key before the line the
//! other opened is known.
//!
//! **Where it plugs in.** The partition's event path and the retry path call one hook,
//! [`LineHook`] (hook.rs), around an attempt — before it (deliver, park, or settle a replay),
//! after a failed first attempt (open the line), after the settlement (advance) — and a
//! no-op with `retry_ordering = "off"`; neither path names a line step itself.
//!
//! **Replays.** A parked record is named by its event's sequence number, so a replay after a
//! crash parks nothing twice. An event at or before its line's head was parked and released
//! before (or settled before the line opened): it is delivered again, a duplicate of the kind
//! at-least-once allows, after its first delivery, never before an earlier event of its key.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::azure::versioned::{Change, Start};
use crate::azure::StoreError;
use crate::clock::ms;
use crate::event::Event;
use crate::ledger::{Ledger, LedgerError, LedgerRecord, Line, Opened, Parked, State, Versioned};

use super::settle::{SettleError, Settler};
use super::LineOnDeadLetter;

mod advance;
mod drain;
mod hook;
#[cfg(any(test, feature = "cli"))]
mod replay;

pub(crate) use advance::advance;
pub(crate) use hook::{Advanced, LineHook, LineStep, Place, StepFuture, UntilDone};
#[cfg(any(test, feature = "cli"))]
pub(crate) use replay::replay_line;

/// Heads one advance moves a line past before it reports contention (each head's step is one
/// compare-and-swap on the pointer, with its own bound: `azure::versioned::ROUNDS`).
const ROUNDS: usize = 64;

/// What a partition task knows of its keys' lines.
#[derive(Debug, Default)]
pub(crate) struct Known {
    inner: Mutex<KnownInner>,
}

#[derive(Debug, Default)]
struct KnownInner {
    /// Whether a listing succeeded.
    listed: bool,
    /// Ordering key → its line as last seen. Lines this task opens are kept from the start,
    /// before any listing, so a listing that started before one opened cannot drop it.
    lines: HashMap<String, KeyState>,
}

/// What a partition knows of a key's line before it delivers an event of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyState {
    /// No listing yet: read the pointer.
    Unknown,
    /// No line.
    Free,
    /// A line whose head was this event (or a later one: heads only move forward).
    Line(i64),
    /// A line that ended having settled the events up to this one (its tombstone).
    Ended(i64),
}

impl Known {
    fn inner(&self) -> std::sync::MutexGuard<'_, KnownInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes in a listing of the partition's lines and tombstones. What the task learnt
    /// meanwhile stays: a line it opened is kept; one it saw end may come back from a listing
    /// that started before, which only costs a pointer read.
    pub(crate) fn set_listing(&self, lines: Vec<Line>) {
        let mut k = self.inner();
        for l in lines {
            let state = if l.ended {
                KeyState::Ended(l.last_seq())
            } else {
                KeyState::Line(l.head_seq)
            };
            k.lines.entry(l.ordering_key).or_insert(state);
        }
        k.listed = true;
    }

    /// Whether a listing has succeeded.
    pub(crate) fn is_listed(&self) -> bool {
        self.inner().listed
    }

    /// What is known of `key`'s line.
    pub(crate) fn state(&self, key: &str) -> KeyState {
        let k = self.inner();
        match k.lines.get(key) {
            Some(s) => *s,
            None if k.listed => KeyState::Free,
            None => KeyState::Unknown,
        }
    }

    /// `key` has a line headed by `seq` (or later).
    pub(crate) fn line(&self, key: &str, seq: i64) {
        self.inner()
            .lines
            .insert(key.to_string(), KeyState::Line(seq));
    }

    /// `key`'s line ended, having settled the events up to `last` (`None`: not known, its
    /// tombstone is gone).
    pub(crate) fn ended(&self, key: &str, last: Option<i64>) {
        let mut k = self.inner();
        match last {
            Some(x) => k.lines.insert(key.to_string(), KeyState::Ended(x)),
            None => k.lines.remove(key),
        };
    }

    /// Sets what is known of `key` (from [`remove_tombstone`]).
    pub(crate) fn set(&self, key: &str, state: KeyState) {
        let mut k = self.inner();
        match state {
            KeyState::Free | KeyState::Unknown => k.lines.remove(key),
            s => k.lines.insert(key.to_string(), s),
        };
    }

    /// Tombstones the checkpoint has passed (at `checkpoint`): their events are never read
    /// again, so they can go.
    pub(crate) fn passed(&self, checkpoint: i64) -> Vec<String> {
        self.inner()
            .lines
            .iter()
            .filter(|(_, s)| matches!(s, KeyState::Ended(x) if *x <= checkpoint))
            .map(|(k, _)| k.clone())
            .collect()
    }
}

/// Removes the tombstone of `key`'s line in `partition` if it still is one and the checkpoint
/// (at `checkpoint`) has passed what it settled; a new line opened meanwhile stays. Returns
/// what the partition should know of the key now (`None`: unchanged, try again later).
pub(crate) async fn remove_tombstone(
    settler: &Settler,
    partition: &str,
    key: &str,
    checkpoint: i64,
) -> Result<Option<KeyState>, LedgerError> {
    let Some(Versioned { value: line, etag }) = settler.ledger.line(partition, key).await? else {
        return Ok(Some(KeyState::Free));
    };
    if !line.ended {
        return Ok(Some(KeyState::Line(line.head_seq)));
    }
    if line.last_seq() > checkpoint {
        return Ok(Some(KeyState::Ended(line.last_seq())));
    }
    match settler.ledger.end_line(partition, key, &etag).await {
        Ok(()) | Err(LedgerError::Store(StoreError::NotFound)) => Ok(Some(KeyState::Free)),
        Err(LedgerError::Store(StoreError::Conflict)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// What [`park`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Park {
    /// Parked behind the head (or already released from the line since): settled.
    Parked {
        /// The head's idempotency key.
        behind: String,
        /// The head's sequence number.
        behind_seq: i64,
        /// The `traceparent` of the head's failing attempt, when the line knows it.
        behind_traceparent: Option<String>,
    },
    /// Deliver it: the line ended (`head` `None`), or the event is the line's head or before
    /// it (a replay).
    Deliver {
        /// The line's head's sequence number, when there is a line.
        head: Option<i64>,
        /// When the line ended: the last event it settled (its tombstone's), if it says.
        ended_at: Option<i64>,
    },
}

/// Parks `event` (ordering key `key`) behind its line, if the line is still there; `before`:
/// its dead-lettered record, when `dead-letters replay` re-drives it in order.
pub(crate) async fn park(
    settler: &Settler,
    event: &Event,
    key: &str,
    before: Option<&LedgerRecord>,
) -> Result<Park, LedgerError> {
    let ledger = &settler.ledger;
    let (p, seq) = (event.partition_id.as_str(), event.sequence_number);
    let read = ledger.line(p, key).await?;
    let Some(line) = read.as_ref().map(|l| &l.value).filter(|l| !l.ended) else {
        return unparked(ledger, p, key, seq).await;
    };
    if seq <= line.head_seq {
        return Ok(Park::Deliver {
            head: Some(line.head_seq),
            ended_at: None,
        });
    }
    let now = settler.clock().now();
    ledger
        .park(
            key,
            &Parked {
                event: event.clone(),
                parked_ms: ms(now),
                behind_key: line.head_key.clone(),
                behind_seq: line.head_seq,
                behind_traceparent: line.head_traceparent.clone(),
                attempts: before.map_or(0, |r| r.attempts),
                history: before.map(|r| r.history.clone()).unwrap_or_default(),
            },
        )
        .await?;
    // The pointer counts it, from the line just read (the parked record's write proves
    // nothing about it): rewritten even when a replay finds itself counted already, as the
    // new ETag is what makes a concurrent end of the line fail and list again.
    let mut first = Some(now);
    let counted = ledger.change_line(p, key, Start::From(read), |current| {
        let Some(mut line) = current.filter(|l| !l.ended) else {
            return Change::Keep(None);
        };
        let parked = Park::Parked {
            behind: line.head_key.clone(),
            behind_seq: line.head_seq,
            behind_traceparent: line.head_traceparent.clone(),
        };
        if seq <= line.head_seq {
            // Released meanwhile (it is the head now, or was).
            return Change::Keep(Some(parked));
        }
        let now = first.take().unwrap_or_else(|| settler.clock().now());
        if line.tail_seq.is_none_or(|t| t < seq) {
            line.tail_seq = Some(seq);
            line.parked += 1;
        }
        line.oldest_parked_ms.get_or_insert(ms(now));
        Change::Write(Box::new(line), Some(parked))
    });
    match counted.await?.value {
        Some(parked) => Ok(parked),
        None => unparked(ledger, p, key, seq).await,
    }
}

/// The line of `key` ended before `seq` was parked behind it: a parked record of this event
/// (written by [`park`] before the end, or by an earlier owner) was seen by nobody and goes.
async fn unparked(ledger: &Ledger, p: &str, key: &str, seq: i64) -> Result<Park, LedgerError> {
    ledger.unpark(p, key, seq).await?;
    let ended_at = ledger.line(p, key).await?.map(|l| l.value.last_seq());
    Ok(Park::Deliver {
        head: None,
        ended_at,
    })
}

/// What [`open`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Open {
    /// The event heads its key's line.
    Head,
    /// A line of the key with an earlier head is open (what the partition knew was stale):
    /// the event must be parked behind it instead.
    Behind,
    /// A line with a later head is open: the event is a replay of one settled before it.
    Older,
}

/// Opens `key`'s line with `event` (which just failed on its first attempt, `traceparent`)
/// as its head, before the failure is settled.
pub(crate) async fn open(
    settler: &Settler,
    event: &Event,
    key: &str,
    traceparent: &str,
) -> Result<Open, LedgerError> {
    let line = Line {
        ordering_key: key.to_string(),
        partition: event.partition_id.clone(),
        head_key: event.identity.idempotency_key.clone(),
        head_seq: event.sequence_number,
        tail_seq: None,
        parked: 0,
        opened_ms: ms(settler.clock().now()),
        oldest_parked_ms: None,
        ended: false,
        head_traceparent: Some(traceparent.to_string()),
        released_behind: None,
        drain: None,
    };
    Ok(match settler.ledger.open_line(&line).await? {
        Opened::Head => Open::Head,
        // The tombstone of a line that settled this very event: a replay of it.
        Opened::Other(l) if l.ended => Open::Older,
        Opened::Other(l) if l.head_seq < event.sequence_number => Open::Behind,
        Opened::Other(_) => Open::Older,
    })
}

/// The backstop for a line whose head settled for good while nobody advanced it (a process
/// died between the head's settlement and the line's advance, an operator cancelled the
/// head): every open line whose head's record is final is advanced. One listing, plus one
/// record read per open line whose head is not in `waiting` (the keys the pending index
/// lists: a waiting record always has an entry there); run by the retry loop's periodic
/// sweep. Returns the lines advanced.
pub(crate) async fn sweep(
    settler: &Settler,
    on_dead_letter: LineOnDeadLetter,
    observe: Option<&super::observe::Observer>,
    waiting: &std::collections::HashSet<&str>,
) -> Result<usize, SettleError> {
    let mut advanced = 0;
    for line in settler.ledger.lines(None).await? {
        if waiting.contains(line.head_key.as_str()) {
            continue;
        }
        // No record yet: the partition opened the line and is settling its head's failure.
        let Some(rec) = settler.ledger.record(&line.head_key).await? else {
            continue;
        };
        if rec.state() == State::RetryScheduled
            || rec.event.partition_id != line.partition
            || rec.event.sequence_number != line.head_seq
        {
            continue;
        }
        advance(
            settler,
            &rec.event,
            &line.ordering_key,
            on_dead_letter,
            observe,
        )
        .await?;
        advanced += 1;
    }
    Ok(advanced)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use super::advance::{line_dead_letter, released_record};
    use super::*;
    use crate::azure::memory::{MemoryRecordStore, MemoryRetryQueue};
    use crate::ledger::{at, AttemptEntry};
    use crate::policy::DeadLetterReason;

    /// Key K's line on partition 0: head `head_key` at sequence 1, one event parked behind it.
    pub(crate) fn line_of(head_key: &str) -> Line {
        Line {
            ordering_key: "K".into(),
            partition: "0".into(),
            head_key: head_key.into(),
            head_seq: 1,
            tail_seq: Some(2),
            parked: 1,
            opened_ms: 0,
            oldest_parked_ms: Some(10),
            ended: false,
            head_traceparent: None,
            released_behind: None,
            drain: None,
        }
    }

    /// The traceparent of a head's failing attempt.
    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    use crate::clock::Clock;
    use crate::event::Identity;
    use crate::handler::{Failure, Outcome};
    use crate::ledger::Ledger;
    use crate::pipeline::settle::{Policies, Settled, Source};
    use crate::policy::{Curve, RetryPolicy};

    pub(super) fn event(key: &str, seq: i64) -> Event {
        Event {
            body: b"payload".to_vec(),
            content_type: None,
            properties: Default::default(),
            hub: "hub".into(),
            partition_id: "0".into(),
            sequence_number: seq,
            offset: None,
            enqueued_ms: None,
            partition_key: Some("K".into()),
            identity: Identity {
                idempotency_key: key.into(),
                correlation_id: key.into(),
                event_type: None,
            },
        }
    }

    fn bed() -> (Settler, Arc<MemoryRetryQueue>) {
        let clock = Arc::new(Clock::default());
        let queue = Arc::new(MemoryRetryQueue::new(clock.clone()));
        let ledger = Ledger::new(Arc::new(MemoryRecordStore::new()), "hub", "$Default");
        let policy = RetryPolicy {
            name: "test".into(),
            curve: Curve::Fixed,
            base_s: 10,
            floor_s: 10,
            cap_s: 60,
            max_attempts: 2,
            max_age_s: None,
        };
        let settler = Settler::new(
            ledger,
            queue.clone(),
            Policies {
                default: policy,
                by_type: HashMap::new(),
            },
        )
        .with_clock(clock);
        (settler, queue)
    }

    async fn settle(s: &Settler, e: &Event, attempt: u32, outcome: Outcome) -> Settled {
        s.settle(&crate::pipeline::settle::Report {
            event: e,
            attempt,
            source: if attempt == 1 && outcome != Outcome::Delivered {
                Source::EventHubs
            } else {
                Source::Retry
            },
            started: s.clock().now(),
            outcome: &outcome,
            trace_id: "0af7651916cd43dd8448eb211c80319c",
            traceparents: &[],
        })
        .await
        .unwrap()
    }

    fn parked_seqs(p: &[crate::ledger::ParkedEntry]) -> Vec<i64> {
        p.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn a_line_opened_before_the_listing_is_kept_and_an_unlisted_key_is_unknown() {
        let k = Known::default();
        assert_eq!(k.state("a"), KeyState::Unknown);
        k.line("a", 3); // opened while the listing ran
        let listed = Line {
            ordering_key: "b".into(),
            partition: "0".into(),
            head_key: "b-1".into(),
            head_seq: 1,
            tail_seq: None,
            parked: 0,
            opened_ms: 0,
            oldest_parked_ms: None,
            ended: false,
            head_traceparent: None,
            released_behind: None,
            drain: None,
        };
        k.set_listing(vec![listed]);
        assert_eq!(k.state("a"), KeyState::Line(3));
        assert_eq!(k.state("b"), KeyState::Line(1));
        assert_eq!(k.state("c"), KeyState::Free);
        k.ended("a", Some(7));
        assert_eq!(k.state("a"), KeyState::Ended(7));
        assert_eq!(k.passed(6), Vec::<String>::new());
        assert_eq!(k.passed(7), vec!["a".to_string()]);
        k.ended("a", None);
        assert_eq!(k.state("a"), KeyState::Free);
    }

    #[test]
    fn a_re_driven_dead_letter_keeps_its_count_and_history_when_released_or_dead_lettered() {
        let (s, _) = bed();
        let before = AttemptEntry {
            attempt: 3,
            started_ms: 1,
            finished_ms: 2,
            outcome: crate::ledger::HistoryOutcome::DeadLettered,
            error: Some("attempts exhausted".into()),
            next_attempt_ms: None,
            trace_id: None,
            retry_after_capped_from_s: None,
        };
        let parked = Parked {
            event: event("e2", 2),
            parked_ms: 10,
            behind_key: "e1".into(),
            behind_seq: 1,
            behind_traceparent: None,
            attempts: 3,
            history: vec![before.clone()],
        };
        let line = line_of("e1");
        let now = at(20);
        let released = released_record(&s, &parked, &line, now);
        // Attempt 4 comes next, under a fresh budget: released, not yet attempted.
        assert_eq!((released.attempts, released.attempt_base), (3, 3));
        assert_eq!(released.history[0], before);
        assert_eq!(released.history[1].outcome, "parked");
        let dead = line_dead_letter(&s, &parked, &line, now);
        assert_eq!((dead.attempts, dead.attempt_base), (3, 3));
        assert_eq!(dead.history.len(), 2);
        assert_eq!(dead.history[0], before);
    }

    #[tokio::test]
    async fn a_line_parks_once_releases_in_order_through_service_bus_and_ends() {
        let (s, queue) = bed();
        let (h, e1, e2) = (event("h", 1), event("e1", 4), event("e2", 9));
        assert_eq!(open(&s, &h, "K", TP).await.unwrap(), Open::Head);
        assert_eq!(
            open(&s, &h, "K", TP).await.unwrap(),
            Open::Head,
            "idempotent"
        );
        assert!(matches!(
            settle(&s, &h, 1, Outcome::Failed(Failure::transient("x"))).await,
            Settled::RetryScheduled { .. }
        ));
        for e in [&e1, &e2, &e1] {
            assert!(matches!(
                park(&s, e, "K", None).await.unwrap(),
                Park::Parked { behind_seq: 1, .. }
            ));
        }
        let line = s.ledger.line("0", "K").await.unwrap().unwrap().value;
        assert_eq!(
            (line.parked, line.tail_seq),
            (2, Some(9)),
            "parked once each"
        );
        assert_eq!(
            parked_seqs(&s.ledger.parked_in("0", "K").await.unwrap()),
            [4, 9]
        );
        // The head's own event, or one before it, is delivered, not parked.
        assert_eq!(
            park(&s, &h, "K", None).await.unwrap(),
            Park::Deliver {
                head: Some(1),
                ended_at: None
            }
        );
        // An event behind a waiting head opens no line of its own.
        assert_eq!(
            open(&s, &event("late", 12), "K", TP).await.unwrap(),
            Open::Behind
        );
        // Not final yet: nothing moves.
        assert!(!advance(&s, &h, "K", LineOnDeadLetter::Release, None)
            .await
            .unwrap());
        assert_eq!(
            s.ledger
                .line("0", "K")
                .await
                .unwrap()
                .unwrap()
                .value
                .head_key,
            "h"
        );

        settle(&s, &h, 2, Outcome::Delivered).await;
        assert!(!advance(&s, &h, "K", LineOnDeadLetter::Release, None)
            .await
            .unwrap());
        let line = s.ledger.line("0", "K").await.unwrap().unwrap().value;
        assert_eq!((line.head_key.as_str(), line.head_seq), ("e1", 4));
        let rec = s.ledger.record("e1").await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::RetryScheduled, 0));
        assert!(queue.accepted().contains(&"e1-attempt-1".to_string()));
        assert_eq!(
            parked_seqs(&s.ledger.parked_in("0", "K").await.unwrap()),
            [9]
        );
        // A copy of the head's settlement (a crash before its message was completed) moves
        // nothing further and sends nothing new.
        let sent = queue.len();
        assert!(!advance(&s, &h, "K", LineOnDeadLetter::Release, None)
            .await
            .unwrap());
        assert_eq!(
            s.ledger
                .line("0", "K")
                .await
                .unwrap()
                .unwrap()
                .value
                .head_key,
            "e1"
        );
        assert_eq!(queue.len(), sent, "duplicate detection drops the re-send");

        settle(&s, &e1, 1, Outcome::Delivered).await;
        advance(&s, &e1, "K", LineOnDeadLetter::Release, None)
            .await
            .unwrap();
        assert_eq!(
            s.ledger
                .line("0", "K")
                .await
                .unwrap()
                .unwrap()
                .value
                .head_key,
            "e2"
        );
        settle(&s, &e2, 1, Outcome::Delivered).await;
        assert!(advance(&s, &e2, "K", LineOnDeadLetter::Release, None)
            .await
            .unwrap());
        let open_lines = s.ledger.lines(None).await.unwrap();
        assert!(open_lines.is_empty(), "the line ended: {open_lines:?}");
        let tomb = s.ledger.line("0", "K").await.unwrap().unwrap().value;
        assert!(tomb.ended, "its tombstone says what it settled");
        assert_eq!(tomb.last_seq(), 9);
        // A replay of an event the line settled meets the tombstone.
        assert_eq!(open(&s, &e1, "K", TP).await.unwrap(), Open::Older);
        assert!(s.ledger.all_parked().await.unwrap().is_empty());
        // After the end, the key's next event is delivered, and leaves no parked record.
        assert_eq!(
            park(&s, &event("e3", 15), "K", None).await.unwrap(),
            Park::Deliver {
                head: None,
                ended_at: Some(9)
            }
        );
        assert!(s.ledger.all_parked().await.unwrap().is_empty());
        // A new line replaces the tombstone; once the checkpoint passes a tombstone, it goes.
        assert_eq!(
            open(&s, &event("e4", 20), "K", TP).await.unwrap(),
            Open::Head
        );
        assert_eq!(
            remove_tombstone(&s, "0", "K", 30).await.unwrap(),
            Some(KeyState::Line(20)),
            "not a tombstone any more"
        );
        settle(&s, &event("e4", 20), 1, Outcome::Delivered).await;
        assert!(
            advance(&s, &event("e4", 20), "K", LineOnDeadLetter::Release, None)
                .await
                .unwrap()
        );
        assert_eq!(
            remove_tombstone(&s, "0", "K", 19).await.unwrap(),
            Some(KeyState::Ended(20)),
            "the checkpoint has not passed it"
        );
        assert_eq!(
            remove_tombstone(&s, "0", "K", 20).await.unwrap(),
            Some(KeyState::Free)
        );
        assert!(s.ledger.line("0", "K").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_dead_lettered_head_takes_its_line_along_or_releases_it() {
        for (mode, key) in [
            (LineOnDeadLetter::DeadLetterLine, "A"),
            (LineOnDeadLetter::Release, "B"),
        ] {
            let (s, _queue) = bed();
            let h = event(&format!("{key}-h"), 1);
            let parked = [event(&format!("{key}-1"), 2), event(&format!("{key}-2"), 3)];
            open(&s, &h, key, TP).await.unwrap();
            settle(&s, &h, 1, Outcome::Failed(Failure::transient("x"))).await;
            for e in &parked {
                park(&s, e, key, None).await.unwrap();
            }
            assert!(matches!(
                settle(&s, &h, 2, Outcome::Failed(Failure::transient("x"))).await,
                Settled::DeadLettered(_)
            ));
            let ended = advance(&s, &h, key, mode, None).await.unwrap();
            let states: Vec<Option<(State, Option<DeadLetterReason>)>> = {
                let mut v = Vec::new();
                for e in &parked {
                    let r = s.ledger.record(&e.identity.idempotency_key).await.unwrap();
                    v.push(r.map(|r| (r.state(), r.dead_letter_reason())));
                }
                v
            };
            match mode {
                LineOnDeadLetter::DeadLetterLine => {
                    assert!(ended, "the whole line followed its head");
                    assert_eq!(
                        states,
                        vec![
                            Some((
                                State::DeadLettered,
                                Some(DeadLetterReason::LineDeadLettered)
                            ));
                            2
                        ]
                    );
                    assert_eq!(s.ledger.dead_letter_keys().await.unwrap().len(), 3);
                }
                LineOnDeadLetter::Release => {
                    assert!(!ended);
                    assert_eq!(states[0], Some((State::RetryScheduled, None)), "released");
                    assert_eq!(states[1], None, "still parked: no record");
                    assert_eq!(
                        s.ledger.parked_in("0", key).await.unwrap().len(),
                        1,
                        "the rest stay parked"
                    );
                }
            }
        }
    }

    /// A record store that runs `hook` once, right before the first call matching `when`
    /// goes through: a second party acting between two steps of the first.
    struct Interleave {
        inner: Arc<MemoryRecordStore>,
        when: fn(&str, &str) -> bool,
        #[allow(clippy::type_complexity)]
        hook: std::sync::Mutex<
            Option<Box<dyn FnOnce() -> futures::future::BoxFuture<'static, ()> + Send>>,
        >,
    }

    impl Interleave {
        async fn maybe(&self, op: &str, key: &str) {
            if !(self.when)(op, key) {
                return;
            }
            let hook = self.hook.lock().unwrap().take();
            if let Some(h) = hook {
                h().await;
            }
        }
    }

    #[async_trait::async_trait]
    impl crate::azure::RecordStore for Interleave {
        async fn read(&self, key: &str) -> Result<Option<crate::azure::Record>, StoreError> {
            self.inner.read(key).await
        }
        async fn create(&self, key: &str, body: bytes::Bytes) -> Result<String, StoreError> {
            self.inner.create(key, body).await
        }
        async fn update(
            &self,
            key: &str,
            body: bytes::Bytes,
            etag: &str,
        ) -> Result<String, StoreError> {
            self.maybe("update", key).await;
            self.inner.update(key, body, etag).await
        }
        async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
            self.maybe("delete", key).await;
            self.inner.delete(key, etag).await
        }
        async fn remove(&self, key: &str) -> Result<(), StoreError> {
            self.inner.remove(key).await
        }
        async fn list(
            &self,
            prefix: &str,
        ) -> Result<Vec<crate::azure::record_store::Listed>, StoreError> {
            self.inner.list(prefix).await
        }
        async fn write_tagged(
            &self,
            key: &str,
            body: bytes::Bytes,
            etag: Option<&str>,
            tags: &crate::azure::record_store::Tags,
        ) -> Result<String, StoreError> {
            if etag.is_some() {
                self.maybe("update", key).await;
            }
            self.inner.write_tagged(key, body, etag, tags).await
        }
    }

    fn interleaved(when: fn(&str, &str) -> bool) -> (Arc<Settler>, Arc<Interleave>) {
        let clock = Arc::new(Clock::default());
        let queue = Arc::new(MemoryRetryQueue::new(clock.clone()));
        let store = Arc::new(Interleave {
            inner: Arc::new(MemoryRecordStore::new()),
            when,
            hook: std::sync::Mutex::new(None),
        });
        let settler = Settler::new(
            Ledger::new(store.clone(), "hub", "$Default"),
            queue,
            Policies {
                default: RetryPolicy::seed_fibonacci(),
                by_type: HashMap::new(),
            },
        )
        .with_clock(clock);
        (Arc::new(settler), store)
    }

    #[tokio::test]
    async fn when_the_line_ends_between_parking_and_the_pointer_the_partition_delivers_the_event_itself(
    ) {
        // The parker has written its parked record and is about to rewrite the pointer; the
        // head settles elsewhere, an advance lists nothing (the listing came first) and ends
        // the line (its tombstone). The parker's rewrite fails, it finds the line ended,
        // removes its record and delivers the event itself.
        let (s, store) = interleaved(|op, key| op == "update" && key.starts_with("lines/"));
        let h = event("h", 1);
        open(&s, &h, "K", TP).await.unwrap();
        let line_name = s.ledger.line_name("0", "K");
        let inner = store.inner.clone();
        *store.hook.lock().unwrap() = Some(Box::new(move || {
            Box::pin(async move {
                use crate::azure::RecordStore;
                let r = inner.read(&line_name).await.unwrap().unwrap();
                let mut line: Line = serde_json::from_slice(&r.body).unwrap();
                line.ended = true;
                let body = bytes::Bytes::from(serde_json::to_vec(&line).unwrap());
                inner.update(&line_name, body, &r.etag).await.unwrap();
            })
        }));
        assert_eq!(
            park(&s, &event("e", 5), "K", None).await.unwrap(),
            Park::Deliver {
                head: None,
                ended_at: Some(1)
            }
        );
        assert!(
            s.ledger.all_parked().await.unwrap().is_empty(),
            "nothing left behind"
        );
    }

    #[tokio::test]
    async fn when_an_event_is_parked_before_the_line_ends_the_end_fails_and_releases_it() {
        // The head settled and its advance listed nothing parked; before it ends the line
        // (its tombstone's write), the partition parks an event (record, then the pointer's
        // rewrite). The end fails on the pointer's new ETag, the advance lists again and
        // releases the event.
        let (s, store) = interleaved(|op, key| op == "update" && key.starts_with("lines/"));
        let h = event("h", 1);
        open(&s, &h, "K", TP).await.unwrap();
        let (parker, e) = (s.clone(), event("e", 5));
        *store.hook.lock().unwrap() = Some(Box::new(move || {
            Box::pin(async move {
                assert!(matches!(
                    park(&parker, &e, "K", None).await.unwrap(),
                    Park::Parked { .. }
                ));
            })
        }));
        assert!(!advance(&s, &h, "K", LineOnDeadLetter::Release, None)
            .await
            .unwrap());
        let line = s.ledger.line("0", "K").await.unwrap().unwrap().value;
        assert_eq!(line.head_key, "e", "released, not lost");
        let rec = s.ledger.record("e").await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::RetryScheduled, 0));
    }
}
