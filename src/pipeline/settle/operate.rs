//! An operator's actions on one pending retry: `hubguard retries retry-now` and `hubguard
//! retries cancel`. Each is one compare-and-swap on the event's ledger record (the same
//! `If-Match` every settlement writes with), so a race with the retry loop ends one way:
//!
//! - Either action is refused while the attempt is due (within [`OPERATOR_MARGIN`]) or
//!   running: a retry message runs its handler only after its due time and after reading the
//!   record, so a record changed more than the margin before the due time is seen by every
//!   copy of the attempt, and an attempt already past its due time is left to finish.
//! - `retry-now` moves the due time to now, records the pull ([`RunNow`]) and schedules a
//!   copy of the attempt, due now, under a MessageId of its own and carrying the pull's mark.
//!   The retry loop runs only that copy; the one scheduled before stands down when it comes
//!   due. The attempt's outcome continues the pinned schedule as usual.
//! - `cancel` dead-letters the event (reason `cancelled`, the operator's text as its last
//!   error, published to the dead-letter destination like any other); every copy still on
//!   Service Bus finds the event final and is completed without a call. `dead-letters replay`
//!   brings it back.

use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::execute::Settling;
use super::{MessageId, RetryCopy, SettleError, Settler};
use crate::azure::versioned::{compare_and_swap, Change, Start, Swapped};
use crate::clock::ms;
use crate::ledger::{AttemptEntry, HistoryOutcome, LedgerRecord, RunNow, State};
use crate::policy::DeadLetterReason;

/// How close to its due time a retry is taken as running: an operator's action on it is
/// refused (exit status 5 on the command line), and left to the attempt. It covers the time
/// between reading the record and starting the handler, and clock differences between the
/// operator's machine and the replicas.
pub const OPERATOR_MARGIN: Duration = Duration::from_secs(5);

/// An operator's action on a pending retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run the pending attempt now.
    RetryNow,
    /// No further attempt: dead-letter it as `cancelled`.
    Cancel,
}

/// What an action found, or did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ActionOutcome {
    /// Done (with `--dry-run`: would be done) for attempt `attempt`, which was due at
    /// `previous_due_ms`.
    Done {
        /// The attempt acted on.
        attempt: u32,
        /// When it was due before.
        previous_due_ms: Option<i64>,
    },
    /// Done before (the action is idempotent): nothing changed.
    AlreadyDone {
        /// The attempt acted on.
        attempt: u32,
    },
    /// The ledger has no record of the key.
    Unknown,
    /// The event is not waiting for a retry.
    NotPending {
        /// Where it stands.
        state: State,
    },
    /// The attempt is due now or running: the race goes to the attempt.
    Due {
        /// The attempt.
        attempt: u32,
        /// When it is due.
        due_ms: Option<i64>,
    },
}

/// The decision, on the record as read: a pure function (both the action and its
/// `--dry-run` use it).
pub(crate) fn plan(action: Action, rec: Option<&LedgerRecord>, now: SystemTime) -> ActionOutcome {
    let Some(rec) = rec else {
        return ActionOutcome::Unknown;
    };
    let attempt = rec.attempts + 1;
    if action == Action::Cancel
        && rec.state() == State::DeadLettered
        && rec.dead_letter_reason() == Some(DeadLetterReason::Cancelled)
    {
        return ActionOutcome::AlreadyDone { attempt };
    }
    if rec.state() != State::RetryScheduled {
        return ActionOutcome::NotPending { state: rec.state() };
    }
    if action == Action::RetryNow && rec.run_now_mark(attempt).is_some() {
        return ActionOutcome::AlreadyDone { attempt };
    }
    let busy = rec
        .next_attempt_ms()
        .is_none_or(|due| due <= ms(now + OPERATOR_MARGIN));
    if busy {
        return ActionOutcome::Due {
            attempt,
            due_ms: rec.next_attempt_ms(),
        };
    }
    ActionOutcome::Done {
        attempt,
        previous_due_ms: rec.next_attempt_ms(),
    }
}

impl Settler {
    /// `hubguard retries retry-now`: the pending attempt of `key` runs now (see the module
    /// documentation). A repeat finds it done, and makes sure its copy is on Service Bus.
    pub async fn retry_now(
        &self,
        key: &str,
        by: &str,
        dry_run: bool,
    ) -> Result<ActionOutcome, SettleError> {
        let now = self.clock.now();
        let record = Settling::new(self, key);
        let pulling = compare_and_swap(&record, Start::Read, |current| {
            let outcome = plan(Action::RetryNow, current.as_ref(), now);
            match (&outcome, current) {
                (ActionOutcome::Done { .. }, Some(mut rec)) if !dry_run => {
                    rec.run_now = Some(RunNow {
                        attempt: rec.attempts + 1,
                        at_ms: ms(now),
                        by: by.to_string(),
                        previous_due_ms: rec.next_attempt_ms(),
                    });
                    rec.schedule_retry(ms(now));
                    rec.updated_ms = ms(now);
                    Change::Write(
                        Box::new(rec),
                        Pulled {
                            outcome,
                            resend: None,
                        },
                    )
                }
                // Not deferred since: the copy sent for the pull is re-sent (duplicate
                // detection drops it if it is there), so a repeat repairs a pull whose
                // message was never sent.
                (ActionOutcome::AlreadyDone { .. }, Some(rec)) if !dry_run => {
                    let resend = rec
                        .run_now
                        .as_ref()
                        .filter(|p| {
                            rec.next_attempt_ms() == Some(p.at_ms) && p.attempt == rec.attempts + 1
                        })
                        .map(|p| p.at_ms);
                    let resend = resend.map(|at_ms| (Box::new(rec), at_ms));
                    Change::Keep(Pulled { outcome, resend })
                }
                _ => Change::Keep(Pulled {
                    outcome,
                    resend: None,
                }),
            }
        });
        let Swapped { value, written } = pulling.await?;
        // Recorded first: if this send fails, a repeat of the command (or the retry loop's
        // sweep of overdue retries) sends the pulled copy.
        if let Some(rec) = written {
            self.send_pulled(&rec.value, ms(now), now).await?;
        } else if let Some((rec, at_ms)) = value.resend {
            self.send_pulled(&rec, at_ms, now).await?;
        }
        Ok(value.outcome)
    }

    /// Schedules the copy of `rec`'s pending attempt an operator pulled forward at `at_ms`.
    async fn send_pulled(
        &self,
        rec: &LedgerRecord,
        at_ms: i64,
        now: SystemTime,
    ) -> Result<(), SettleError> {
        let attempt = rec.attempts + 1;
        let id = MessageId::retry(&rec.key, attempt).copy(RetryCopy::Pulled { at_ms });
        let due = crate::clock::at(at_ms).max(now);
        let sent = self
            .schedule_marked(id, &rec.event, attempt, due, &[], Some(at_ms))
            .await;
        self.sent_or_dead_lettered(&rec.key, sent).await.map(drop)
    }

    /// `hubguard retries cancel`: no further attempt of `key`; it is dead-lettered with
    /// reason `cancelled` and `"cancelled by {by}: {reason}"` as its last error.
    pub async fn cancel(
        &self,
        key: &str,
        reason: &str,
        by: &str,
        dry_run: bool,
    ) -> Result<ActionOutcome, SettleError> {
        let now = self.clock.now();
        let text = format!("cancelled by {by}: {reason}");
        // As every dead letter: published, indexed, then recorded (a conflict means the
        // retry loop wrote first: decide again on what it wrote).
        let record = Settling::new(self, key);
        let cancelling = compare_and_swap(&record, Start::Read, |current| {
            let outcome = plan(Action::Cancel, current.as_ref(), now);
            let mut rec = match (&outcome, current) {
                (ActionOutcome::Done { .. }, Some(rec)) if !dry_run => rec,
                _ => return Change::Keep(outcome),
            };
            rec.push_history(AttemptEntry {
                attempt: rec.attempts + 1,
                started_ms: ms(now),
                finished_ms: ms(now),
                outcome: HistoryOutcome::Cancelled,
                error: Some(text.clone()),
                next_attempt_ms: None,
                trace_id: None,
                retry_after_capped_from_s: None,
            });
            rec.dead_letter(DeadLetterReason::Cancelled);
            rec.last_error = Some(text.clone());
            rec.run_now = None;
            rec.updated_ms = ms(now);
            Change::Write(Box::new(rec), outcome)
        });
        Ok(cancelling.await?.value)
    }
}

/// What `retry-now` decided: its outcome, and a pull recorded before whose copy is sent
/// again (the record, and the pull's time).
struct Pulled {
    outcome: ActionOutcome,
    resend: Option<(Box<LedgerRecord>, i64)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, Identity};
    use crate::policy::RetryPolicy;

    fn pending(attempts: u32, due_ms: i64) -> LedgerRecord {
        let event = Event {
            body: Vec::new(),
            content_type: None,
            properties: Default::default(),
            hub: "hub".into(),
            partition_id: "0".into(),
            sequence_number: 1,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: Identity {
                idempotency_key: "k".into(),
                correlation_id: "k".into(),
                event_type: None,
            },
        };
        let mut rec =
            LedgerRecord::first_failure(&event, RetryPolicy::seed_fibonacci(), crate::clock::at(0));
        rec.attempts = attempts;
        rec.schedule_retry(due_ms);
        rec
    }

    #[test]
    fn an_action_on_an_attempt_due_or_running_is_left_to_the_attempt() {
        let now = crate::clock::at(1_000_000);
        let margin = OPERATOR_MARGIN.as_millis() as i64;
        for action in [Action::RetryNow, Action::Cancel] {
            assert_eq!(
                plan(action, Some(&pending(1, 1_000_000 + margin)), now),
                ActionOutcome::Due {
                    attempt: 2,
                    due_ms: Some(1_000_000 + margin)
                }
            );
            assert_eq!(
                plan(action, Some(&pending(1, 1_000_000 + margin + 1)), now),
                ActionOutcome::Done {
                    attempt: 2,
                    previous_due_ms: Some(1_000_000 + margin + 1)
                }
            );
            assert_eq!(plan(action, None, now), ActionOutcome::Unknown);
            let mut delivered = pending(2, 0);
            delivered.deliver();
            assert_eq!(
                plan(action, Some(&delivered), now),
                ActionOutcome::NotPending {
                    state: State::Delivered
                }
            );
        }
    }

    #[test]
    fn only_the_copy_sent_for_a_pull_runs_the_pulled_attempt() {
        let mut rec = pending(1, 5_000_000);
        assert!(!rec.superseded_copy(2, None));
        rec.run_now = Some(RunNow {
            attempt: 2,
            at_ms: 42,
            by: "op".into(),
            previous_due_ms: Some(5_000_000),
        });
        assert!(rec.superseded_copy(2, None), "the copy scheduled before");
        assert!(rec.superseded_copy(2, Some(41)), "an earlier pull's copy");
        assert!(!rec.superseded_copy(2, Some(42)), "the pulled copy");
        assert!(!rec.superseded_copy(3, None), "later attempts run as usual");
        // A repeat is idempotent.
        assert_eq!(
            plan(Action::RetryNow, Some(&rec), crate::clock::at(0)),
            ActionOutcome::AlreadyDone { attempt: 2 }
        );
    }
}
