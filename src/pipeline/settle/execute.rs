//! The Settler's settlement: planning an attempt's outcome and executing the plan's effects
//! in order, re-planning on a conflict.

use crate::azure::StoreError;
use crate::handler::Outcome;
use crate::ledger::{LedgerError, LedgerRecord};
use crate::policy::DeadLetterReason;

use super::{plan, Plan, Report, Sent, SettleError, Settled, Settler, CAS_ROUNDS};

impl Settler {
    /// Settles the outcome `report` carries.
    pub async fn settle(&self, report: &Report<'_>) -> Result<Settled, SettleError> {
        self.settle_from(None, report).await
    }

    /// [`settle`](Self::settle), starting from the ledger record (and its ETag) the caller
    /// read to decide that this attempt was the current one: the retry loop's one read of a
    /// retry. The write's `If-Match` proves nobody wrote since; if somebody did, the record is
    /// read again and the decision made again.
    pub async fn settle_from(
        &self,
        read: Option<(LedgerRecord, String)>,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        // Also a first attempt from Event Hubs that was delivered: whether its event may have
        // a record is the partition's knowledge (see `pipeline::recorded`), which skips this
        // call when it provably has none. Here the ledger is asked.
        match self.execute_plans(read, report).await {
            // A record that cannot be parsed would hold the event (and its partition) forever:
            // set it aside and dead-letter the event, which is in hand.
            Err(SettleError::Ledger(LedgerError::Corrupt { reason, .. })) => {
                let event = report.event;
                self.ledger
                    .quarantine(
                        &event.identity.idempotency_key,
                        Some(event),
                        &reason,
                        self.clock.now(),
                    )
                    .await?;
                Ok(Settled::DeadLettered(DeadLetterReason::CorruptRecord))
            }
            other => other,
        }
    }

    /// Plans the settlement of `report` on the record (the caller's `read` first, then a
    /// fresh read after each conflict) and executes the plan; a write that finds the record
    /// changed (412) plans again on what it now says.
    async fn execute_plans(
        &self,
        mut read: Option<(LedgerRecord, String)>,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        let key = &report.event.identity.idempotency_key;
        for _ in 0..CAS_ROUNDS {
            let current = match read.take() {
                Some(known) => Some(known),
                None => self.ledger.get(key).await?,
            };
            let (record, etag) = match current {
                Some((r, e)) => (Some(r), Some(e)),
                None => (None, None),
            };
            let plan = plan(
                record.as_ref(),
                report,
                &self.policies,
                self.clock.now(),
                &mut rand::thread_rng(),
            );
            if let Some(settled) = self.execute(plan, etag.as_deref(), report).await? {
                return Ok(settled);
            }
        }
        Err(match report.outcome {
            Outcome::Delivered => SettleError::Ledger(LedgerError::Contended { key: key.clone() }),
            Outcome::Failed(_) => SettleError::Contended(key.clone()),
        })
    }

    /// Performs `plan`'s effects in the order the invariant needs, writing the record with
    /// `If-Match: etag` (`If-None-Match: *` without one). `None` when that write found the
    /// record changed: nothing after it was done, and the caller plans again.
    async fn execute(
        &self,
        plan: Plan,
        etag: Option<&str>,
        report: &Report<'_>,
    ) -> Result<Option<Settled>, SettleError> {
        let key = &report.event.identity.idempotency_key;
        match plan {
            Plan::Done(settled) => Ok(Some(settled)),
            Plan::RecordDelivery(record) => Ok(self
                .written(&record, etag)
                .await?
                .then_some(Settled::Delivered)),
            Plan::ResendRecorded(record) => {
                // This attempt is already recorded (a replay): make sure the recorded next
                // attempt exists on Service Bus (a repeat is dropped by duplicate detection).
                super::super::attempt::mark_replay(&tracing::Span::current());
                Ok(Some(
                    match self.resend_recorded(&record, report.traceparents).await? {
                        Some(due) => Settled::RetryScheduled {
                            attempt: record.attempts + 1,
                            due,
                        },
                        None => Settled::DeadLettered(DeadLetterReason::RetryRefused),
                    },
                ))
            }
            Plan::Schedule {
                record,
                attempt,
                due,
                capped_from,
            } => {
                // Ledger first: if Service Bus then fails, the replay (or the redelivered
                // retry message) finds the attempt recorded and re-sends the same message.
                if !self.written(&record, etag).await? {
                    return Ok(None);
                }
                super::super::attempt::mark_retry_after_capped(
                    &tracing::Span::current(),
                    capped_from,
                );
                let sent = self
                    .schedule(report.event, attempt, due, report.traceparents)
                    .await;
                Ok(Some(match self.sent_or_dead_lettered(key, sent).await? {
                    Sent::Scheduled => Settled::RetryScheduled { attempt, due },
                    Sent::DeadLettered => Settled::DeadLettered(DeadLetterReason::RetryRefused),
                }))
            }
            Plan::DeadLetter { record, reason } => Ok(self
                .dead_letter_written(&record, etag)
                .await?
                .then_some(Settled::DeadLettered(reason))),
        }
    }

    /// Writes `record` over the version `etag` names; `false` when it changed since (412).
    async fn written(
        &self,
        record: &LedgerRecord,
        etag: Option<&str>,
    ) -> Result<bool, SettleError> {
        match self.ledger.put(record, etag).await {
            Ok(_) => Ok(true),
            Err(LedgerError::Store(StoreError::Conflict)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// A dead letter's effects, in their order: published to the destination (if any),
    /// indexed, then `record` (dead-lettered) written over the version `etag` names; `false`
    /// when it changed since (412).
    pub(super) async fn dead_letter_written(
        &self,
        record: &LedgerRecord,
        etag: Option<&str>,
    ) -> Result<bool, SettleError> {
        self.publish_dead_letter(record).await?;
        self.ledger.index_dead_letter(&record.key).await?;
        self.written(record, etag).await
    }
}
