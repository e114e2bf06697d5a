//! Moving a line on once its head settled for good: the next parked event released (or
//! dead-lettered with the line), or the line ended.

use std::sync::Mutex;
use std::time::SystemTime;

use crate::azure::versioned::{compare_and_swap, Change, Contended, RecordKind, Start};
use crate::azure::StoreError;
use crate::clock::{ms, rfc3339};
use crate::event::Event;
use crate::ledger::{
    at, AttemptEntry, HistoryOutcome, LedgerError, LedgerRecord, Line, Parked, ParkedEntry, State,
    Versioned,
};
use crate::pipeline::observe::Observer;
use crate::pipeline::settle::plan::first_failure;
use crate::pipeline::settle::{SettleError, Settler};
use crate::pipeline::LineOnDeadLetter;
use crate::policy::DeadLetterReason;

use super::ROUNDS;

/// The ledger record a parked event gets when it is released: attempt 1 due now, under the
/// policy in force for its type, its history saying where it waited.
pub(super) fn released_record(
    settler: &Settler,
    parked: &Parked,
    line: &Line,
    now: SystemTime,
) -> LedgerRecord {
    let e = &parked.event;
    let note = format!(
        "parked behind {} (sequence number {}) since {}; released when it settled",
        line.head_key,
        line.head_seq,
        rfc3339(at(parked.parked_ms))
    );
    let mut history = parked.history.clone();
    history.push(AttemptEntry {
        attempt: parked.attempts,
        started_ms: parked.parked_ms,
        finished_ms: ms(now),
        outcome: HistoryOutcome::Parked,
        error: Some(note),
        next_attempt_ms: Some(ms(now)),
        trace_id: None,
        retry_after_capped_from_s: None,
    });
    let mut rec = first_failure(e, settler.policies(), now);
    rec.attempts = parked.attempts;
    rec.attempt_base = parked.attempts;
    rec.history = history;
    rec.schedule_retry(ms(now));
    rec
}

/// The dead letter of an event parked behind a head that was dead-lettered
/// (`line_on_dead_letter = "dead_letter_line"`), under the policy in force for its type.
pub(super) fn line_dead_letter(
    settler: &Settler,
    parked: &Parked,
    line: &Line,
    now: SystemTime,
) -> LedgerRecord {
    let error = format!(
        "parked behind {} (sequence number {}), which was dead-lettered; the line followed it",
        line.head_key, line.head_seq
    );
    let mut history = parked.history.clone();
    history.push(AttemptEntry {
        attempt: parked.attempts,
        started_ms: parked.parked_ms,
        finished_ms: ms(now),
        outcome: HistoryOutcome::DeadLettered,
        error: Some(error.clone()),
        next_attempt_ms: None,
        trace_id: None,
        retry_after_capped_from_s: None,
    });
    let mut rec = first_failure(&parked.event, settler.policies(), now);
    rec.attempts = parked.attempts;
    rec.attempt_base = parked.attempts;
    rec.last_error = Some(error);
    rec.history = history;
    rec.dead_letter(DeadLetterReason::LineDeadLettered);
    rec
}

/// Writes `rec` (a released or line-dead-lettered record) unless the ledger holds a record of
/// this very event already (a replay settled it, or an earlier round of this release wrote
/// it): the record as it stands is returned. With `over_release` (a drain's attempt on a
/// parked event that had made that many attempts), a record of this event released and not
/// attempted since is replaced: a release whose pointer write lost to the drain's lease left
/// it (it was never sent), and the drain's attempt is the event's next.
pub(super) async fn write_new(
    settler: &Settler,
    rec: LedgerRecord,
    over_release: Option<u32>,
) -> Result<LedgerRecord, SettleError> {
    let kind = Releasing {
        settler,
        key: &rec.key,
    };
    let written = compare_and_swap(&kind, Start::From(None), |current| {
        let Some(existing) = current else {
            return Change::Write(Box::new(rec.clone()), rec.clone());
        };
        let same = existing.event.partition_id == rec.event.partition_id
            && existing.event.sequence_number == rec.event.sequence_number;
        let unattempted_release = same
            && existing.state() == State::RetryScheduled
            && over_release == Some(existing.attempts);
        if unattempted_release {
            let mut rec = rec.clone();
            rec.indexed = existing.indexed;
            return Change::Write(Box::new(rec.clone()), rec);
        }
        if same || existing.state() == State::RetryScheduled {
            // This event's own record, or another event's retry under the same idempotency
            // key (left as it is: that one is owed its delivery too).
            return Change::Keep(existing);
        }
        // A final record of another event with the same key: this event's record replaces it.
        let mut rec = rec.clone();
        rec.indexed = existing.indexed;
        Change::Write(Box::new(rec.clone()), rec)
    });
    Ok(written.await?.value)
}

/// A released (or line-dead-lettered) record, as [`write_new`]'s compare-and-swap writes it:
/// created as a settlement writes its record, and replacing another event's final record
/// with a plain conditional put.
struct Releasing<'a> {
    settler: &'a Settler,
    key: &'a str,
}

#[async_trait::async_trait]
impl RecordKind for Releasing<'_> {
    type Value = LedgerRecord;
    type Error = SettleError;

    fn name(&self) -> String {
        self.key.to_string()
    }

    async fn read(&self) -> Result<Option<Versioned<LedgerRecord>>, SettleError> {
        Ok(self.settler.ledger.get(self.key).await?)
    }

    async fn write(&self, rec: &LedgerRecord, etag: Option<&str>) -> Result<String, SettleError> {
        match etag {
            None => self.settler.write_settled(rec, None).await,
            Some(etag) => Ok(self.settler.ledger.put(rec, Some(etag)).await?),
        }
    }

    fn lost(&self, e: &SettleError) -> bool {
        matches!(
            e,
            SettleError::Ledger(LedgerError::Store(StoreError::Conflict))
        )
    }

    fn contended(&self, lost: Contended) -> SettleError {
        lost.into()
    }
}

/// The line of `key` after `head` settled for good (delivered or dead-lettered): releases the
/// next parked event (or, with `dead_letter_line` after a dead letter, dead-letters the
/// parked events one by one), or ends the line when nothing is parked. Idempotent: a copy
/// that finds the line moved past `head` only makes sure the current head's first attempt was
/// sent (a crash between the pointer's write and the send). `Ok(true)` when the line ended.
///
/// Each head's step is one compare-and-swap on the line's pointer ([`Stepping`]); a head
/// that was final already when released is followed by the next, at most [`ROUNDS`] heads.
pub(crate) async fn advance(
    settler: &Settler,
    head: &Event,
    key: &str,
    on_dead_letter: LineOnDeadLetter,
    observe: Option<&Observer>,
) -> Result<bool, SettleError> {
    let step = Advance {
        settler,
        partition: head.partition_id.as_str(),
        key,
        on_dead_letter,
        observe,
    };
    let name = settler.ledger.line_name(step.partition, key);
    let mut current = (head.identity.idempotency_key.clone(), head.sequence_number);
    for _ in 0..ROUNDS {
        let stepping = Stepping {
            step: &step,
            head: &current,
            name: &name,
            released: Mutex::new(None),
        };
        let stepped = compare_and_swap(&stepping, Start::Read, |seen| match seen {
            None | Some(Seen::Ended) => Change::Keep(Then::Done(true)),
            Some(Seen::Other(line)) => Change::Keep(Then::Other(Box::new(line))),
            Some(Seen::Waiting) => Change::Keep(Then::Done(false)),
            Some(Seen::End(mut line)) => {
                line.tail_seq = Some(line.last_seq());
                line.ended = true;
                line.parked = 0;
                line.oldest_parked_ms = None;
                line.drain = None;
                Change::Write(Box::new(Seen::End(line)), Then::Ended)
            }
            Some(seen) => Change::Write(Box::new(seen), Then::Released),
        })
        .await
        .map_err(|e| e.into_settle(&name))?;
        let released = match stepped.value {
            Then::Done(ended) => return Ok(ended),
            Then::Other(line) => {
                if line.head_seq > current.1 {
                    ensure_sent(settler, &line).await?;
                }
                return Ok(false);
            }
            Then::Ended => {
                tracing::debug!(partition = %step.partition, ordering_key = %key, "line ended");
                return Ok(true);
            }
            Then::Released => stepping
                .released
                .into_inner()
                .unwrap_or_else(|p| p.into_inner()),
        };
        let Some(released) = released else {
            return Err(SettleError::Contended(name));
        };
        match step.after_release(released).await? {
            Some(head) => current = head,
            None => return Ok(false),
        }
    }
    Err(SettleError::Contended(name))
}

/// One line's advance: what every step of it needs.
struct Advance<'a> {
    settler: &'a Settler,
    partition: &'a str,
    key: &'a str,
    on_dead_letter: LineOnDeadLetter,
    observe: Option<&'a Observer>,
}

/// A line's pointer as one step of its advance reads it, with what the step decides on.
enum Seen {
    /// The line ended.
    Ended,
    /// The pointer names another head than the settled one (moved on already).
    Other(Line),
    /// The head waits for a retry: its own settlement advances the line.
    Waiting,
    /// The head settled and nothing is parked: the line ends (written: the tombstone).
    End(Line),
    /// The head settled and `next` is the first event parked behind it.
    Release {
        line: Line,
        next: ParkedEntry,
        parked: Box<Parked>,
        /// When the event parked after `next` was parked, if one was.
        after: Option<Option<i64>>,
        /// The head was dead-lettered.
        dead: bool,
    },
    /// The first parked record went between its listing and its read: someone moved the
    /// line on, so read it again.
    Vanished,
}

/// What a step's compare-and-swap decided.
enum Then {
    /// Nothing to write: `true` when the line ended.
    Done(bool),
    /// The pointer names another head (this one).
    Other(Box<Line>),
    /// The tombstone was written (or the pointer was gone).
    Ended,
    /// The next event was released (see [`Stepping::released`]).
    Released,
}

/// What a release wrote, for what follows the pointer's write.
struct Released {
    rec: LedgerRecord,
    line: Line,
    next: String,
    behind_traceparent: Option<String>,
    follow: bool,
}

/// Why a step's read or write failed: it lost to another write of the pointer, or failed.
enum StepError {
    Lost,
    Failed(SettleError),
}

impl StepError {
    fn into_settle(self, name: &str) -> SettleError {
        match self {
            StepError::Lost => SettleError::Contended(name.to_string()),
            StepError::Failed(e) => e,
        }
    }
}

impl From<SettleError> for StepError {
    fn from(e: SettleError) -> Self {
        StepError::Failed(e)
    }
}

impl From<LedgerError> for StepError {
    fn from(e: LedgerError) -> Self {
        StepError::Failed(e.into())
    }
}

/// One step of an advance from the settled head `head`, as the one compare-and-swap runs it
/// on the line's pointer: reading it also gathers what the step decides on (what the head
/// came to, what is parked behind it); writing a release writes the released record first,
/// then the pointer naming it (whoever reads the pointer finds the record). The pointer
/// written `If-Match` like any change, so a parking that came first makes it fail.
struct Stepping<'a> {
    step: &'a Advance<'a>,
    head: &'a (String, i64),
    name: &'a str,
    /// What the release wrote.
    released: Mutex<Option<Released>>,
}

#[async_trait::async_trait]
impl RecordKind for Stepping<'_> {
    type Value = Seen;
    type Error = StepError;

    fn name(&self) -> String {
        self.name.to_string()
    }

    async fn read(&self) -> Result<Option<Versioned<Seen>>, StepError> {
        let ledger = &self.step.settler.ledger;
        let Some(Versioned { value: line, etag }) =
            ledger.line(self.step.partition, self.step.key).await?
        else {
            return Ok(None);
        };
        Ok(Some(Versioned::new(
            self.step.see(line, self.head).await?,
            etag,
        )))
    }

    async fn write(&self, seen: &Seen, etag: Option<&str>) -> Result<String, StepError> {
        let ledger = &self.step.settler.ledger;
        match (seen, etag) {
            (Seen::End(line), Some(etag)) => match ledger.write_line(line, etag).await {
                Ok(etag) => Ok(etag),
                // Removed meanwhile: ended all the same.
                Err(LedgerError::Store(StoreError::NotFound)) => Ok(String::new()),
                // Something was parked meanwhile: list again.
                Err(LedgerError::Store(StoreError::Conflict)) => Err(StepError::Lost),
                Err(e) => Err(e.into()),
            },
            (
                Seen::Release {
                    line,
                    next,
                    parked,
                    after,
                    dead,
                },
                Some(etag),
            ) => {
                let (etag, released) = self
                    .step
                    .release(line.clone(), etag, next, parked, *after, *dead)
                    .await?;
                *self.released.lock().unwrap_or_else(|p| p.into_inner()) = Some(released);
                Ok(etag)
            }
            // Nothing else is written: a vanished parked record reads the line again.
            _ => Err(StepError::Lost),
        }
    }

    fn lost(&self, e: &StepError) -> bool {
        matches!(e, StepError::Lost)
    }

    fn contended(&self, lost: Contended) -> StepError {
        StepError::Failed(lost.into())
    }
}

impl Advance<'_> {
    /// The line `line` as a step from the settled head `head` sees it.
    async fn see(&self, line: Line, head: &(String, i64)) -> Result<Seen, SettleError> {
        let ledger = &self.settler.ledger;
        if line.ended {
            return Ok(Seen::Ended);
        }
        // A drain in batches moves it on (see `super::drain`) while its lease holds.
        if line
            .drain
            .as_ref()
            .is_some_and(|l| l.live(self.settler.clock().now()))
        {
            return Ok(Seen::Waiting);
        }
        if line.head_key != head.0 || line.head_seq != head.1 {
            return Ok(Seen::Other(line));
        }
        let Some(dead) = self.head_came_to(&line).await? else {
            return Ok(Seen::Waiting);
        };
        let parked = ledger.parked_in(self.partition, self.key).await?;
        // Records at or before the head were released already (a crash before their removal).
        for stale in parked.iter().filter(|e| e.seq <= line.head_seq) {
            ledger.remove_parked(&stale.name).await?;
        }
        let head_seq = line.head_seq;
        let mut rest = parked.iter().filter(|e| e.seq > head_seq);
        let Some(next) = rest.next() else {
            return Ok(Seen::End(line));
        };
        let after = rest.next().map(|n| n.parked_ms);
        Ok(match ledger.read_parked(&next.name).await? {
            None => Seen::Vanished,
            Some(parked) => Seen::Release {
                line,
                next: next.clone(),
                parked: Box::new(parked),
                after,
                dead,
            },
        })
    }

    /// What the line's head came to: `Some(true)` dead-lettered, `Some(false)` delivered,
    /// `None` still waiting for a retry. No record of it: it was delivered on a replay of its
    /// first attempt before its failure was ever recorded.
    async fn head_came_to(&self, line: &Line) -> Result<Option<bool>, SettleError> {
        Ok(match self.settler.ledger.record(&line.head_key).await? {
            Some(r)
                if r.event.partition_id == self.partition
                    && r.event.sequence_number == line.head_seq =>
            {
                match r.state() {
                    State::RetryScheduled => None,
                    State::Delivered => Some(false),
                    State::DeadLettered => Some(true),
                }
            }
            _ => Some(false),
        })
    }

    /// Releases `next`, the first event parked behind the line's head (or dead-letters it
    /// after a `dead` head, with `dead_letter_line`): its record first, then the pointer
    /// naming it (`If-Match` `etag`; a lost write is [`StepError::Lost`]). `after`: when the
    /// event parked after it was parked, if one was.
    async fn release(
        &self,
        mut line: Line,
        etag: &str,
        next: &ParkedEntry,
        parked_event: &Parked,
        after: Option<Option<i64>>,
        dead: bool,
    ) -> Result<(String, Released), StepError> {
        let (settler, ledger) = (self.settler, &self.settler.ledger);
        let now = settler.clock().now();
        let follow = dead && self.on_dead_letter == LineOnDeadLetter::DeadLetterLine;
        let e = &parked_event.event;
        let new = if follow {
            line_dead_letter(settler, parked_event, &line, now)
        } else {
            released_record(settler, parked_event, &line, now)
        };
        let rec = write_new(settler, new, None).await?;
        line.head_key = e.identity.idempotency_key.clone();
        line.head_seq = e.sequence_number;
        // Not known until the released head runs (and fails, if it does).
        line.head_traceparent = None;
        line.released_behind = parked_event.behind_traceparent.clone();
        line.drain = None;
        line.parked = line.parked.saturating_sub(1);
        line.oldest_parked_ms = after.map(|parked_ms| parked_ms.unwrap_or(ms(now)));
        let etag = match ledger.write_line(&line, etag).await {
            Ok(etag) => etag,
            Err(LedgerError::Store(StoreError::Conflict | StoreError::NotFound)) => {
                return Err(StepError::Lost)
            }
            Err(e) => return Err(e.into()),
        };
        let released = Released {
            rec,
            line,
            next: next.name.clone(),
            behind_traceparent: parked_event.behind_traceparent.clone(),
            follow,
        };
        Ok((etag, released))
    }

    /// What follows a release's pointer write: the released event's first attempt's message,
    /// then its parked record goes. The next head to move on from (`None`: the line waits).
    async fn after_release(
        &self,
        released: Released,
    ) -> Result<Option<(String, i64)>, SettleError> {
        let (settler, ledger) = (self.settler, &self.settler.ledger);
        let Released {
            rec,
            line,
            next,
            behind_traceparent,
            follow,
        } = released;
        let head = (line.head_key.clone(), line.head_seq);
        if rec.state() == State::RetryScheduled && rec.attempts == rec.attempt_base {
            if let Some(o) = self.observe {
                o.count_released();
            }
            tracing::info!(partition = %self.partition, ordering_key = %self.key, key = %rec.key, sequence_number = line.head_seq, "a parked event is released: its first attempt is due now");
            // Its first attempt links to the attempt of the head it waited behind.
            let waited_behind: Vec<String> = behind_traceparent.into_iter().collect();
            let sent = settler.resend_recorded(&rec, &waited_behind).await?;
            ledger.remove_parked(&next).await?;
            if sent.is_some() {
                return Ok(None);
            }
            // Service Bus refused its message: it was dead-lettered, and the line moves on.
            return Ok(Some(head));
        }
        if let (true, Some(o)) = (follow, self.observe) {
            o.count_dead_lettered(rec.event.identity.event_type.as_deref());
        }
        ledger.remove_parked(&next).await?;
        if rec.state() == State::RetryScheduled {
            // Another event's retry under the same key holds the record (see `write_new`):
            // this event is owed a delivery the record cannot give. Left to that retry; the
            // line waits on it as on any head.
            return Ok(None);
        }
        // Final already (dead-lettered with the line, or settled by a replay): on to the next.
        Ok(Some(head))
    }
}

/// Makes sure the line's head, released but not yet attempted, has its first attempt on
/// Service Bus (duplicate detection drops a repeat), linked like the release's own send to
/// the attempt it waited behind (whichever is sent first is the one that runs).
async fn ensure_sent(settler: &Settler, line: &Line) -> Result<(), SettleError> {
    if let Some(rec) = settler.ledger.record(&line.head_key).await? {
        if rec.state() == State::RetryScheduled
            && rec.attempts == rec.attempt_base
            && rec.event.sequence_number == line.head_seq
        {
            let waited_behind: Vec<String> = line.released_behind.iter().cloned().collect();
            settler.resend_recorded(&rec, &waited_behind).await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use super::*;
    use crate::azure::memory::{MemoryRecordStore, MemoryRetryQueue};
    use crate::clock::Clock;
    use crate::ledger::Ledger;
    use crate::pipeline::settle::Policies;
    use crate::policy::{Curve, RetryPolicy};

    fn settler() -> Settler {
        let clock = Arc::new(Clock::default());
        let policy = RetryPolicy {
            name: "test".into(),
            curve: Curve::Fixed,
            base_s: 10,
            floor_s: 10,
            cap_s: 60,
            max_attempts: 5,
            max_age_s: None,
        };
        Settler::new(
            Ledger::new(Arc::new(MemoryRecordStore::new()), "hub", "$Default"),
            Arc::new(MemoryRetryQueue::new(clock.clone())),
            Policies {
                default: policy,
                by_type: HashMap::new(),
            },
        )
        .with_clock(clock)
    }

    fn parked(key: &str, seq: i64, attempts: u32) -> Parked {
        Parked {
            event: crate::pipeline::lines::tests::event(key, seq),
            parked_ms: 10,
            behind_key: "h".into(),
            behind_seq: 1,
            behind_traceparent: None,
            attempts,
            history: Vec::new(),
        }
    }

    fn line() -> Line {
        super::super::tests::line_of("h")
    }

    /// A release whose pointer write lost to a drain's lease leaves the event's released
    /// record behind: the drain's attempt replaces it; a record the event made an attempt
    /// on (a drain again after a crash) stays, and so does any record for the one-by-one path.
    #[tokio::test]
    async fn a_drains_record_replaces_only_an_unattempted_release_of_its_event() {
        let s = settler();
        let now = s.clock().now();
        let pk = parked("e", 2, 1);
        let released = released_record(&s, &pk, &line(), now);
        write_new(&s, released.clone(), None).await.unwrap();
        let mut delivered = released.clone();
        delivered.attempts += 1;
        delivered.deliver();
        // One by one: the release stands.
        let kept = write_new(&s, delivered.clone(), None).await.unwrap();
        assert_eq!((kept.state(), kept.attempts), (State::RetryScheduled, 1));
        // A drain's attempt on the event that had made one attempt: replaced.
        let written = write_new(&s, delivered.clone(), Some(1)).await.unwrap();
        assert_eq!((written.state(), written.attempts), (State::Delivered, 2));
        let stored = s.ledger.record("e").await.unwrap().unwrap();
        assert_eq!((stored.state(), stored.attempts), (State::Delivered, 2));
        // Written already (a drain again after a crash): it stays as it is.
        let mut again = released;
        again.attempts = 2;
        let kept = write_new(&s, again, Some(1)).await.unwrap();
        assert_eq!((kept.state(), kept.attempts), (State::Delivered, 2));
    }
}
