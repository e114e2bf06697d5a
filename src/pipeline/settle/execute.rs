//! The Settler's settlement: planning an attempt's outcome and executing the plan's effects
//! in order, re-planning on a conflict.

use crate::azure::versioned::{compare_and_swap, Change, Contended, RecordKind, Start, Versioned};
use crate::azure::StoreError;
use crate::handler::Outcome;
use crate::ledger::{LedgerError, LedgerRecord, State};
use crate::policy::DeadLetterReason;

use super::{plan, Plan, Report, Sent, SettleError, Settled, Settler};

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
        read: Option<Versioned<LedgerRecord>>,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        self.settle_starting(read.into(), report).await
    }

    /// [`settle`](Self::settle) of a first attempt from Event Hubs; `may_have_record`: what
    /// its partition knows (see `pipeline::recorded`). A transient failure of an event the
    /// ledger provably holds no pending record of is [`settle_unrecorded`](Self::settle_unrecorded);
    /// anything else reads first — a permanent failure too, because a dead letter is
    /// published before its record is written, and must not be for an event recorded
    /// delivered before.
    pub(crate) async fn settle_first(
        &self,
        report: &Report<'_>,
        may_have_record: bool,
    ) -> Result<Settled, SettleError> {
        if crate::pipeline::partition::transient_failure(report.outcome) && !may_have_record {
            self.settle_unrecorded(report).await
        } else {
            self.settle(report).await
        }
    }

    /// [`settle`](Self::settle) of an event whose partition knows the ledger holds no
    /// pending record of it (see `pipeline::recorded`): the first write creates the record
    /// (`If-None-Match: *`) without reading it first. A record there after all (delivered or
    /// dead-lettered before, or written meanwhile) fails that write, and the settlement reads
    /// it and decides again, as after any conflict.
    pub(crate) async fn settle_unrecorded(
        &self,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        self.settle_starting(Start::From(None), report).await
    }

    async fn settle_starting(
        &self,
        start: Start<LedgerRecord>,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        // Also a first attempt from Event Hubs that was delivered: whether its event may have
        // a record is the partition's knowledge (see `pipeline::recorded`), which skips this
        // call when it provably has none. Here the ledger is asked.
        match self.execute_plans(start, report).await {
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
    /// fresh read after each conflict) and executes the plan: its write, in the one
    /// compare-and-swap, then what follows the write. A write that finds the record changed
    /// (412) plans again on what it now says.
    async fn execute_plans(
        &self,
        start: Start<LedgerRecord>,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        let key = &report.event.identity.idempotency_key;
        let planned = compare_and_swap(&Settling::new(self, key), start, |record| {
            let plan = plan(
                record.as_ref(),
                report,
                &self.policies,
                self.clock.now(),
                &mut rand::thread_rng(),
            );
            match plan {
                Plan::Done(settled) => Change::Keep(Then::Done(settled)),
                Plan::RecordDelivery(record) => {
                    Change::Write(record, Then::Done(Settled::Delivered))
                }
                Plan::ResendRecorded(record) => Change::Keep(Then::Resend(record)),
                Plan::Schedule {
                    record,
                    attempt,
                    due,
                    capped_from,
                } => Change::Write(
                    record,
                    Then::Schedule {
                        attempt,
                        due,
                        capped_from,
                    },
                ),
                // Published and indexed before the record is written (see `Settling`).
                Plan::DeadLetter { record, reason } => {
                    Change::Write(record, Then::Done(Settled::DeadLettered(reason)))
                }
            }
        })
        .await;
        let then = match planned {
            Ok(swapped) => swapped.value,
            Err(SettleError::Contended(key)) if matches!(report.outcome, Outcome::Delivered) => {
                return Err(SettleError::Ledger(LedgerError::Contended { key }))
            }
            Err(e) => return Err(e),
        };
        self.then(then, report).await
    }

    /// What follows a settlement's write (or its plan, when nothing was written).
    async fn then(&self, then: Then, report: &Report<'_>) -> Result<Settled, SettleError> {
        let key = &report.event.identity.idempotency_key;
        match then {
            Then::Done(settled) => Ok(settled),
            Then::Resend(record) => {
                // This attempt is already recorded (a replay): make sure the recorded next
                // attempt exists on Service Bus (a repeat is dropped by duplicate detection).
                super::super::attempt::mark_replay(&tracing::Span::current());
                Ok(
                    match self.resend_recorded(&record, report.traceparents).await? {
                        Some(due) => Settled::RetryScheduled {
                            attempt: record.attempts + 1,
                            due,
                        },
                        None => Settled::DeadLettered(DeadLetterReason::RetryRefused),
                    },
                )
            }
            Then::Schedule {
                attempt,
                due,
                capped_from,
            } => {
                // Ledger first (written): if Service Bus now fails, the replay (or the
                // redelivered retry message) finds the attempt recorded and re-sends the same
                // message.
                super::super::attempt::mark_retry_after_capped(
                    &tracing::Span::current(),
                    capped_from,
                );
                let sent = self
                    .schedule(report.event, attempt, due, report.traceparents)
                    .await;
                Ok(match self.sent_or_dead_lettered(key, sent).await? {
                    Sent::Scheduled => Settled::RetryScheduled { attempt, due },
                    Sent::DeadLettered => Settled::DeadLettered(DeadLetterReason::RetryRefused),
                })
            }
        }
    }

    /// Writes `record` over the version `etag` names (`None`: creates it), returning its new
    /// ETag; [`StoreError::Conflict`] when it changed since (412). A record written
    /// dead-lettered is first published to the destination (if any) and indexed: a dead
    /// letter's effects, in their order, in this one place.
    pub(crate) async fn write_settled(
        &self,
        record: &LedgerRecord,
        etag: Option<&str>,
    ) -> Result<String, SettleError> {
        if record.state() == State::DeadLettered {
            self.publish_dead_letter(record).await?;
            self.ledger.index_dead_letter(&record.key).await?;
        }
        Ok(self.ledger.put(record, etag).await?)
    }
}

/// What follows a settlement's write.
enum Then {
    /// Nothing: settled so.
    Done(Settled),
    /// The attempt was recorded before (a replay): re-send the recorded next attempt.
    Resend(Box<LedgerRecord>),
    /// The next attempt is recorded: schedule its retry message.
    Schedule {
        attempt: u32,
        due: std::time::SystemTime,
        capped_from: Option<std::time::Duration>,
    },
}

/// `key`'s ledger record as settlements read and write it, in the one compare-and-swap:
/// every write through [`Settler::write_settled`].
pub(super) struct Settling<'a> {
    settler: &'a Settler,
    key: &'a str,
}

impl<'a> Settling<'a> {
    /// `key`'s record, settled by `settler`.
    pub(super) fn new(settler: &'a Settler, key: &'a str) -> Self {
        Self { settler, key }
    }
}

#[async_trait::async_trait]
impl RecordKind for Settling<'_> {
    type Value = LedgerRecord;
    type Error = SettleError;

    fn name(&self) -> String {
        self.key.to_string()
    }

    async fn read(&self) -> Result<Option<Versioned<LedgerRecord>>, SettleError> {
        Ok(self.settler.ledger.get(self.key).await?)
    }

    async fn write(&self, value: &LedgerRecord, etag: Option<&str>) -> Result<String, SettleError> {
        self.settler.write_settled(value, etag).await
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

impl From<Contended> for SettleError {
    fn from(c: Contended) -> Self {
        SettleError::Contended(c.record)
    }
}
