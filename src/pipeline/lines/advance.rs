//! Moving a line on once its head settled for good: the next parked event released (or
//! dead-lettered with the line), or the line ended.

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
/// it): the record as it stands is returned.
async fn write_new(settler: &Settler, rec: LedgerRecord) -> Result<LedgerRecord, SettleError> {
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
pub(crate) async fn advance(
    settler: &Settler,
    head: &Event,
    key: &str,
    on_dead_letter: LineOnDeadLetter,
    observe: Option<&Observer>,
) -> Result<bool, SettleError> {
    let ledger = &settler.ledger;
    let step = Advance {
        settler,
        partition: head.partition_id.as_str(),
        key,
        on_dead_letter,
        observe,
    };
    let mut current = (head.identity.idempotency_key.clone(), head.sequence_number);
    for _ in 0..ROUNDS {
        let Some(Versioned { value: line, etag }) = ledger.line(step.partition, key).await? else {
            return Ok(true);
        };
        if line.ended {
            return Ok(true);
        }
        if line.head_key != current.0 || line.head_seq != current.1 {
            if line.head_seq > current.1 {
                ensure_sent(settler, &line).await?;
            }
            return Ok(false);
        }
        let Some(dead) = step.head_came_to(&line).await? else {
            return Ok(false); // its own settlement advances it
        };
        let parked = ledger.parked_in(step.partition, key).await?;
        // Records at or before the head were released already (a crash before their removal).
        for stale in parked.iter().filter(|e| e.seq <= line.head_seq) {
            ledger.remove_parked(&stale.name).await?;
        }
        let head_seq = line.head_seq;
        let mut rest = parked.iter().filter(|e| e.seq > head_seq);
        let moved = match rest.next() {
            None => step.end(line, &etag).await?,
            Some(next) => {
                let after = rest.next().map(|n| n.parked_ms);
                step.release(line, &etag, next, after, dead).await?
            }
        };
        match moved {
            Moved::Ended => return Ok(true),
            Moved::Raced => {}
            Moved::Waiting => return Ok(false),
            Moved::Next(head) => current = head,
        }
    }
    Err(SettleError::Contended(
        ledger.line_name(step.partition, key),
    ))
}

/// One line's advance: what every step of it needs.
struct Advance<'a> {
    settler: &'a Settler,
    partition: &'a str,
    key: &'a str,
    on_dead_letter: LineOnDeadLetter,
    observe: Option<&'a Observer>,
}

/// Where a step of an advance left the line.
enum Moved {
    /// The line ended.
    Ended,
    /// The pointer or a parked record changed under the step: read the line again.
    Raced,
    /// The line waits on its head's retry.
    Waiting,
    /// The line's head is now this one (idempotency key, sequence number), settled already:
    /// on to the next.
    Next((String, i64)),
}

impl Advance<'_> {
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

    /// Nothing is parked: the line ends, its pointer becoming a tombstone (see
    /// `Line::ended`), written `If-Match` like any change, so a parking that came first makes
    /// it fail.
    async fn end(&self, mut line: Line, etag: &str) -> Result<Moved, SettleError> {
        line.tail_seq = Some(line.last_seq());
        line.ended = true;
        line.parked = 0;
        line.oldest_parked_ms = None;
        match self.settler.ledger.write_line(&line, etag).await {
            Ok(_) | Err(LedgerError::Store(StoreError::NotFound)) => {
                tracing::debug!(partition = %self.partition, ordering_key = %self.key, "line ended");
                Ok(Moved::Ended)
            }
            // Something was parked meanwhile: list again.
            Err(LedgerError::Store(StoreError::Conflict)) => Ok(Moved::Raced),
            Err(e) => Err(e.into()),
        }
    }

    /// Releases `next`, the first event parked behind the line's head (or dead-letters it
    /// after a `dead` head, with `dead_letter_line`): its record first, then the pointer
    /// naming it (whoever reads the pointer finds the record), then its first attempt's
    /// message, then its parked record goes. `after`: when the event parked after it was
    /// parked, if one was.
    async fn release(
        &self,
        mut line: Line,
        etag: &str,
        next: &ParkedEntry,
        after: Option<Option<i64>>,
        dead: bool,
    ) -> Result<Moved, SettleError> {
        let (settler, ledger) = (self.settler, &self.settler.ledger);
        let Some(parked_event) = ledger.read_parked(&next.name).await? else {
            return Ok(Moved::Raced);
        };
        let now = settler.clock().now();
        let follow = dead && self.on_dead_letter == LineOnDeadLetter::DeadLetterLine;
        let e = &parked_event.event;
        let new = if follow {
            line_dead_letter(settler, &parked_event, &line, now)
        } else {
            released_record(settler, &parked_event, &line, now)
        };
        let rec = write_new(settler, new).await?;
        line.head_key = e.identity.idempotency_key.clone();
        line.head_seq = e.sequence_number;
        // Not known until the released head runs (and fails, if it does).
        line.head_traceparent = None;
        line.parked = line.parked.saturating_sub(1);
        line.oldest_parked_ms = after.map(|parked_ms| parked_ms.unwrap_or(ms(now)));
        match ledger.write_line(&line, etag).await {
            Ok(_) => {}
            Err(LedgerError::Store(StoreError::Conflict | StoreError::NotFound)) => {
                return Ok(Moved::Raced)
            }
            Err(e) => return Err(e.into()),
        }
        let head = (line.head_key.clone(), line.head_seq);
        if rec.state() == State::RetryScheduled && rec.attempts == rec.attempt_base {
            if let Some(o) = self.observe {
                o.count_released();
            }
            tracing::info!(partition = %self.partition, ordering_key = %self.key, key = %rec.key, sequence_number = line.head_seq, "a parked event is released: its first attempt is due now");
            // Its first attempt links to the attempt of the head it waited behind.
            let waited_behind: Vec<String> =
                parked_event.behind_traceparent.iter().cloned().collect();
            let sent = settler.resend_recorded(&rec, &waited_behind).await?;
            ledger.remove_parked(&next.name).await?;
            if sent.is_some() {
                return Ok(Moved::Waiting);
            }
            // Service Bus refused its message: it was dead-lettered, and the line moves on.
            return Ok(Moved::Next(head));
        }
        if let (true, Some(o)) = (follow, self.observe) {
            o.count_dead_lettered(rec.event.identity.event_type.as_deref());
        }
        ledger.remove_parked(&next.name).await?;
        if rec.state() == State::RetryScheduled {
            // Another event's retry under the same key holds the record (see `write_new`):
            // this event is owed a delivery the record cannot give. Left to that retry; the
            // line waits on it as on any head.
            return Ok(Moved::Waiting);
        }
        // Final already (dead-lettered with the line, or settled by a replay): on to the next.
        Ok(Moved::Next(head))
    }
}

/// Makes sure the line's head, released but not yet attempted, has its first attempt on
/// Service Bus (duplicate detection drops a repeat).
async fn ensure_sent(settler: &Settler, line: &Line) -> Result<(), SettleError> {
    if let Some(rec) = settler.ledger.record(&line.head_key).await? {
        if rec.state() == State::RetryScheduled
            && rec.attempts == rec.attempt_base
            && rec.event.sequence_number == line.head_seq
        {
            settler.resend_recorded(&rec, &[]).await?;
        }
    }
    Ok(())
}
