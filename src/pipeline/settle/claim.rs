//! The Settler's claims and deferrals: deferring an attempt, rescuing and recovering a
//! record, and claiming, renewing and releasing a record's lease.

use std::time::SystemTime;

use crate::azure::versioned::{compare_and_swap, Change, Swapped};
use crate::clock::{at, ms};
use crate::event::Event;
use crate::ledger::{Claim, LedgerError, LedgerRecord, State, Verdict, Versioned};

use super::execute::Settling;
use super::{Claimed, MessageId, RetryCopy, RetryMessage, Sent, SettleError, Settler, CLAIM_LEASE};

impl Settler {
    /// Defers attempt `attempt` of `event` to `until` (an open circuit breaker): the same
    /// attempt is scheduled again, no attempt is counted, and the ledger's next attempt time
    /// follows so `status` stays right.
    pub async fn defer(
        &self,
        event: &Event,
        attempt: u32,
        until: SystemTime,
        traceparents: &[String],
    ) -> Result<(), SettleError> {
        let until = crate::clock::ceil_to_second(until);
        let key = &event.identity.idempotency_key;
        // A copy of a superseded attempt (its lock lapsed while another receiver ran it) is
        // not deferred: make sure the recorded next attempt exists instead.
        let mut mark = None;
        if let Some(rec) = self.ledger.record(key).await? {
            match Verdict::of(Some(&rec), attempt) {
                Verdict::Final(_) => return Ok(()),
                Verdict::Stale => {
                    self.resend_recorded(&rec, traceparents).await?;
                    return Ok(());
                }
                Verdict::Current | Verdict::Unrecorded => {}
            }
            // The deferred copy of an attempt an operator pulled forward is still that copy.
            mark = rec.run_now_mark(attempt);
        }
        let id = MessageId::retry(key, attempt).copy(RetryCopy::Deferred {
            until_ms: ms(until),
        });
        let sent = self
            .schedule_marked(id, event, attempt, until, traceparents, mark)
            .await;
        if self.sent_or_dead_lettered(key, sent).await? == Sent::DeadLettered {
            return Ok(());
        }
        // The ledger's next attempt time follows, if the record still waits for it.
        self.ledger
            .update(key, |rec| match rec {
                Some(mut rec)
                    if rec.state() == State::RetryScheduled && rec.attempts + 1 == attempt =>
                {
                    rec.schedule_retry(ms(until));
                    rec.claim = None;
                    Change::Write(Box::new(rec), ())
                }
                _ => Change::Keep(()),
            })
            .await?;
        Ok(())
    }

    /// Puts back a retry that Service Bus dead-lettered (its sequence number there is
    /// `dead_letter_seq`) for the event `rec` records: the same attempt, due when it was (or
    /// now), under a MessageId of its own so duplicate detection cannot drop it, and a second
    /// rescue of the same copy (after a crash before it was completed) can.
    pub async fn rescue(
        &self,
        rec: &LedgerRecord,
        message: &RetryMessage,
        dead_letter_seq: i64,
    ) -> Result<(), SettleError> {
        let id = MessageId::retry(&rec.key, message.attempt)
            .copy(RetryCopy::Rescued { dead_letter_seq });
        let due = at(message.due_ms).max(self.clock.now());
        let sent = self
            .schedule_marked(
                id,
                &rec.event,
                message.attempt,
                due,
                &message.traceparents,
                message.run_now,
            )
            .await;
        self.sent_or_dead_lettered(&rec.key, sent).await?;
        Ok(())
    }

    /// Schedules again, due now and under a fresh MessageId, the retry `key`'s record says is
    /// waiting, if it is still waiting and was due before `overdue_before`. The record's due
    /// time moves to now first (compare-and-swap: one sweeper wins). `Ok(true)` when it was
    /// recovered.
    pub async fn recover(
        &self,
        key: &str,
        overdue_before: SystemTime,
    ) -> Result<bool, SettleError> {
        let now = self.clock.now();
        let recovering = self
            .ledger
            .update(key, |rec| match rec {
                Some(mut rec)
                    if rec.state() == State::RetryScheduled
                        && rec
                            .next_attempt_at()
                            .is_some_and(|due| due < overdue_before)
                        // Not while a retry loop runs it (a live claim).
                        && rec.claim.as_ref().is_none_or(|c| !c.live(now)) =>
                {
                    rec.schedule_retry(ms(now));
                    rec.updated_ms = ms(now);
                    Change::Write(Box::new(rec.clone()), Some(rec))
                }
                _ => Change::Keep(None),
            })
            .await?;
        let Some(rec) = recovering else {
            return Ok(false);
        };
        let attempt = rec.attempts + 1;
        let id = MessageId::retry(key, attempt).copy(RetryCopy::Recovered { at_ms: ms(now) });
        let mark = rec.run_now_mark(attempt);
        let sent = self
            .schedule_marked(id, &rec.event, attempt, now, &[], mark)
            .await;
        Ok(self.sent_or_dead_lettered(key, sent).await? == Sent::Scheduled)
    }

    /// Claims attempt `attempt` of `key` for the copy of its retry message in hand, before
    /// the handler is called (see [`Claim`](crate::ledger::Claim) for the rule): a
    /// compare-and-swap over `read` (the record read at the due time, with its ETag), so of
    /// two copies that read the same record one claims it and the other reads again. A live
    /// claim of another process makes this copy wait ([`Claimed::Busy`]); an expired one, or
    /// one of this same `instance` (whose copy is no longer in hand), is taken over.
    pub async fn claim(
        &self,
        key: &str,
        attempt: u32,
        read: Option<Versioned<LedgerRecord>>,
        owner: &str,
        instance: &str,
    ) -> Result<Claimed, SettleError> {
        let record = Settling::new(self, key);
        let claiming = compare_and_swap(&record, read.into(), |current| {
            let Some(mut rec) = current else {
                return Change::Keep(Some(Claimed::Changed(Verdict::Unrecorded, None)));
            };
            let verdict = Verdict::of(Some(&rec), attempt);
            if verdict != Verdict::Current {
                return Change::Keep(Some(Claimed::Changed(verdict, Some(Box::new(rec)))));
            }
            let now = self.clock.now();
            if let Some(c) = &rec.claim {
                if c.attempt == attempt && c.instance != instance && c.live(now) {
                    return Change::Keep(Some(Claimed::Busy(at(c.until_ms))));
                }
            }
            rec.claim = Some(Claim {
                attempt,
                owner: owner.to_string(),
                instance: instance.to_string(),
                until_ms: ms(now + CLAIM_LEASE),
            });
            // Mine: the record as written, with its new ETag.
            Change::Write(Box::new(rec), None)
        });
        let Swapped { value, written } = match claiming.await {
            Err(SettleError::Ledger(LedgerError::Corrupt { reason, .. })) => {
                self.ledger
                    .quarantine(key, None, &reason, self.clock.now())
                    .await?;
                return Ok(Claimed::Changed(Verdict::Final(State::DeadLettered), None));
            }
            other => other?,
        };
        Ok(match (written, value) {
            (Some(mine), _) => Claimed::Mine(Box::new(mine)),
            (None, Some(found)) => found,
            (None, None) => unreachable!("a decision that keeps the record says what it found"),
        })
    }

    /// Extends the claim `claimed` holds by another [`CLAIM_LEASE`] (while a call runs long),
    /// keeping its record and ETag current. A conflict means the claim was taken over (it had
    /// lapsed): the settlement then decides on what the record says.
    pub async fn renew_claim(
        &self,
        claimed: &mut Versioned<LedgerRecord>,
    ) -> Result<(), SettleError> {
        let mut renewed = claimed.value.clone();
        match &mut renewed.claim {
            Some(c) => c.until_ms = ms(self.clock.now() + CLAIM_LEASE),
            None => return Ok(()),
        }
        let etag = self.ledger.put(&renewed, Some(&claimed.etag)).await?;
        *claimed = Versioned::new(renewed, etag);
        Ok(())
    }

    /// Gives up the claim `claimed` holds without running the attempt (its lock lapsed
    /// before the call): best effort, as an expired claim is taken over anyway.
    pub async fn release_claim(&self, claimed: Versioned<LedgerRecord>) {
        let Versioned {
            value: mut rec,
            etag,
        } = claimed;
        rec.claim = None;
        if let Err(e) = self.ledger.put(&rec, Some(&etag)).await {
            tracing::debug!(key = %rec.key, error = %e, "could not release a claim; it expires by itself");
        }
    }
}
