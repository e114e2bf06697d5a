//! The settlement decision, apart from its effects: [`plan`] reads the ledger record (as
//! read, or `None`) and an attempt's [`Report`] and says what settling it takes — nothing,
//! a re-send of the recorded next attempt, a delivery to record, a retry to schedule or a
//! dead letter to write. It does no I/O and reads no clock; the settler executes the plan,
//! and plans again when its write finds the record changed.

use std::time::{Duration, SystemTime};

use rand::Rng;

use super::{Policies, Settled, Source};
use crate::clock::{at, ms};
use crate::event::Event;
use crate::handler::{Failure, Outcome};
use crate::ledger::{AttemptEntry, HistoryOutcome, LedgerRecord, State, Verdict};
use crate::policy::classify::ErrorClass;
use crate::policy::{DeadLetterReason, Decision, FailedAttempt};

/// One attempt's outcome, to settle.
#[derive(Debug, Clone, Copy)]
pub struct Report<'a> {
    /// The event.
    pub event: &'a Event,
    /// The attempt's number (1: the first delivery from Event Hubs).
    pub attempt: u32,
    /// Where the attempt came from.
    pub source: Source,
    /// When the attempt started.
    pub started: SystemTime,
    /// What the handler's call came to.
    pub outcome: &'a Outcome,
    /// The attempt's W3C trace id, for the history.
    pub trace_id: &'a str,
    /// The `traceparent`s of this and the earlier attempts, for the next retry message.
    pub traceparents: &'a [String],
}

/// What settling a report takes, in the order the settler performs it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// Nothing to write: the settlement is this (no record of a delivered event, a final
    /// record, or a delivery from Event Hubs of another event with the record's key).
    Done(Settled),
    /// The ledger already counted this attempt (a replay): re-send the next attempt the
    /// record says waits, and count nothing.
    ResendRecorded(Box<LedgerRecord>),
    /// Write the record, delivered.
    RecordDelivery(Box<LedgerRecord>),
    /// Write the record (the attempt counted, the next one due), then schedule the next
    /// attempt's retry message.
    Schedule {
        /// The record to write.
        record: Box<LedgerRecord>,
        /// The attempt to schedule.
        attempt: u32,
        /// When it is due (in whole seconds when in the future: Service Bus's schedule).
        due: SystemTime,
        /// The downstream's `Retry-After`, when the policy shortened it.
        capped_from: Option<Duration>,
    },
    /// Publish the dead letter, index it, then write the record, dead-lettered.
    DeadLetter {
        /// The record to write.
        record: Box<LedgerRecord>,
        /// Why.
        reason: DeadLetterReason,
    },
}

/// The plan for `report` on `record` (as read; `None`: no record) at `now`. A failure
/// without a record takes the policy for its type from `policies`; one with a record, the
/// policy pinned in it. `rng` draws the backoff's jitter.
pub(crate) fn plan(
    record: Option<&LedgerRecord>,
    report: &Report<'_>,
    policies: &Policies,
    now: SystemTime,
    rng: &mut impl Rng,
) -> Plan {
    let verdict = Verdict::of(record, report.attempt);
    if let Verdict::Final(state) = verdict {
        return Plan::Done(Settled::AlreadyFinal(state));
    }
    match (report.outcome, record) {
        (Outcome::Delivered, None) => Plan::Done(Settled::Delivered),
        (Outcome::Delivered, Some(rec)) => delivery(rec, report, now),
        (Outcome::Failed(_), Some(rec)) if verdict == Verdict::Stale => {
            Plan::ResendRecorded(Box::new(rec.clone()))
        }
        (Outcome::Failed(f), rec) => failure(rec, report, f, policies, now, rng),
    }
}

/// Whether settling `report` on `record` would dead-letter its event (a permanent refusal,
/// or its last attempt): what the storm guard counts as a refusal before the settlement.
pub(crate) fn dead_letters(
    record: Option<&LedgerRecord>,
    report: &Report<'_>,
    policies: &Policies,
    now: SystemTime,
) -> bool {
    matches!(
        plan(record, report, policies, now, &mut rand::thread_rng()),
        Plan::DeadLetter { .. }
    )
}

/// A delivery, on a record that is not final: recorded whatever attempt it was.
fn delivery(rec: &LedgerRecord, report: &Report<'_>, now: SystemTime) -> Plan {
    let event = report.event;
    // From Event Hubs, only a replay of the recorded event settles its record: another
    // event that happens to carry the same key leaves the record's retry alone (it is a
    // different event, still owed its delivery).
    if report.source == Source::EventHubs
        && (rec.event.partition_id != event.partition_id
            || rec.event.sequence_number != event.sequence_number)
    {
        return Plan::Done(Settled::Delivered);
    }
    let mut rec = rec.clone();
    rec.deliver();
    rec.claim = None;
    rec.attempts = rec.attempts.max(report.attempt);
    rec.updated_ms = ms(now);
    // A replay from Event Hubs runs as attempt 1 although the record counted more (the
    // retry it had scheduled never ran, or has not yet): recorded as what it was, a replay,
    // so the history's retries still never go backwards.
    let replayed = report.source == Source::EventHubs && report.attempt < rec.attempts;
    rec.push_history(AttemptEntry {
        attempt: report.attempt,
        started_ms: ms(report.started),
        finished_ms: ms(now),
        outcome: if replayed {
            HistoryOutcome::DeliveredOnReplay
        } else {
            HistoryOutcome::Delivered
        },
        error: None,
        next_attempt_ms: None,
        trace_id: Some(report.trace_id.to_string()),
        retry_after_capped_from_s: None,
    });
    Plan::RecordDelivery(Box::new(rec))
}

/// A failure of the attempt the record waits for (or of an event without a record): the
/// pinned policy decides between the next attempt and a dead letter.
fn failure(
    current: Option<&LedgerRecord>,
    report: &Report<'_>,
    failure: &Failure,
    policies: &Policies,
    now: SystemTime,
    rng: &mut impl Rng,
) -> Plan {
    let (event, attempt) = (report.event, report.attempt);
    let (mut rec, first_failed) = match current {
        Some(rec) => (rec.clone(), at(rec.first_failure_ms)),
        None => (first_failure(event, policies, now), now),
    };
    let (decision, capped_from) = rec.policy.decision(
        &FailedAttempt {
            attempt: attempt.saturating_sub(rec.attempt_base).max(1),
            first_failure: first_failed,
            now,
            permanent: failure.class == ErrorClass::Permanent,
            retry_after: failure.retry_after,
            retry_after_max: failure.retry_after_max,
            previous_delay: rec.last_delay_ms.map(Duration::from_millis),
        },
        rng,
    );
    rec.attempts = attempt;
    rec.claim = None;
    rec.updated_ms = ms(now);
    rec.last_error = Some(failure.error.clone());
    let mut entry = AttemptEntry {
        attempt,
        started_ms: ms(report.started),
        finished_ms: ms(now),
        outcome: HistoryOutcome::DeadLettered,
        error: Some(failure.error.clone()),
        next_attempt_ms: None,
        trace_id: Some(report.trace_id.to_string()),
        retry_after_capped_from_s: None,
    };
    match decision {
        Decision::RetryAt(due) => {
            // Service Bus schedules in whole seconds: record the time it will use, so the
            // ledger (and `hubguard status`) tells when the retry really runs.
            let due = if due > now {
                crate::clock::ceil_to_second(due)
            } else {
                due
            };
            rec.schedule_retry(ms(due));
            rec.last_delay_ms =
                Some(due.duration_since(now).unwrap_or_default().as_millis() as u64);
            entry.outcome = HistoryOutcome::RetryScheduled;
            entry.next_attempt_ms = Some(ms(due));
            entry.retry_after_capped_from_s = capped_from.map(|d| d.as_secs());
            rec.push_history(entry);
            Plan::Schedule {
                record: Box::new(rec),
                attempt: attempt + 1,
                due,
                capped_from,
            }
        }
        Decision::DeadLetter(reason) => {
            rec.dead_letter(reason.clone());
            rec.push_history(entry);
            Plan::DeadLetter {
                record: Box::new(rec),
                reason,
            }
        }
    }
}

/// The record an event's first failure starts from: nothing counted yet, the policy for its
/// type pinned, the age budget counting from `now`.
pub(crate) fn first_failure(event: &Event, policies: &Policies, now: SystemTime) -> LedgerRecord {
    let policy = policies.for_type(event.identity.event_type.as_deref());
    LedgerRecord::first_failure(event, policy.clone(), now)
}

/// The dead letter of a record whose retry message Service Bus refused for what it is
/// (reason [`DeadLetterReason::RetryRefused`], Service Bus's words `error` as its last
/// error); `None` when the record no longer waits for a retry.
pub(crate) fn refusal(rec: &LedgerRecord, error: &str, now: SystemTime) -> Option<LedgerRecord> {
    if rec.state() != State::RetryScheduled {
        return None;
    }
    let now = ms(now);
    let mut rec = rec.clone();
    rec.dead_letter(DeadLetterReason::RetryRefused);
    rec.last_error = Some(error.to_string());
    rec.updated_ms = now;
    rec.push_history(AttemptEntry {
        attempt: rec.attempts,
        started_ms: now,
        finished_ms: now,
        outcome: HistoryOutcome::DeadLettered,
        error: Some(error.to_string()),
        next_attempt_ms: None,
        trace_id: None,
        retry_after_capped_from_s: None,
    });
    Some(rec)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use crate::event::Identity;
    use crate::ledger::Claim;
    use crate::policy::{Curve, RetryPolicy};

    /// 1,000,000.25 s after the epoch: a time between two whole seconds.
    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(1_000_000_250)
    }

    fn policy(name: &str, max_attempts: u32) -> RetryPolicy {
        RetryPolicy {
            name: name.into(),
            curve: Curve::Fixed,
            base_s: 10,
            floor_s: 10,
            cap_s: 60,
            max_attempts,
            max_age_s: None,
        }
    }

    fn policies() -> Policies {
        Policies {
            default: policy("default", 3),
            by_type: HashMap::new(),
        }
    }

    fn event(seq: i64) -> Event {
        Event {
            body: b"payload".to_vec(),
            content_type: None,
            properties: Default::default(),
            hub: "hub".into(),
            partition_id: "0".into(),
            sequence_number: seq,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: Identity {
                idempotency_key: "k".into(),
                correlation_id: "c".into(),
                event_type: None,
            },
        }
    }

    /// The record of event 7 after `attempts` failed, the next one due at `now() + 10 s`,
    /// claimed by a retry loop.
    fn waiting(attempts: u32) -> LedgerRecord {
        let mut rec = first_failure(&event(7), &policies(), now());
        rec.attempts = attempts;
        rec.schedule_retry(ms(now()) + 10_000);
        rec.last_delay_ms = Some(10_000);
        rec.claim = Some(Claim {
            attempt: attempts + 1,
            owner: "o".into(),
            instance: "i".into(),
            until_ms: ms(now()) + 60_000,
        });
        rec
    }

    fn report<'a>(
        event: &'a Event,
        attempt: u32,
        source: Source,
        outcome: &'a Outcome,
    ) -> Report<'a> {
        Report {
            event,
            attempt,
            source,
            started: now() - Duration::from_secs(1),
            outcome,
            trace_id: "t",
            traceparents: &[],
        }
    }

    fn plan_of(record: Option<&LedgerRecord>, report: &Report<'_>) -> Plan {
        plan(
            record,
            report,
            &policies(),
            now(),
            &mut StdRng::seed_from_u64(7),
        )
    }

    fn boom() -> Outcome {
        Outcome::Failed(Failure::transient("boom"))
    }

    #[test]
    fn a_delivery_without_a_record_writes_nothing() {
        let (e, ok) = (event(7), Outcome::Delivered);
        let r = report(&e, 1, Source::EventHubs, &ok);
        assert_eq!(plan_of(None, &r), Plan::Done(Settled::Delivered));
    }

    #[test]
    fn a_final_record_wins_over_any_report() {
        let e = event(7);
        for (state, outcome) in [
            (State::Delivered, boom()),
            (State::DeadLettered, Outcome::Delivered),
            (State::Delivered, Outcome::Delivered),
        ] {
            let mut rec = waiting(1);
            rec.force_state(state, rec.next_attempt_ms(), rec.dead_letter_reason());
            let r = report(&e, 2, Source::Retry, &outcome);
            assert_eq!(
                plan_of(Some(&rec), &r),
                Plan::Done(Settled::AlreadyFinal(state))
            );
        }
    }

    #[test]
    fn a_delivery_from_event_hubs_of_another_event_with_the_key_leaves_the_record() {
        let (other, ok) = (event(8), Outcome::Delivered);
        let r = report(&other, 1, Source::EventHubs, &ok);
        assert_eq!(
            plan_of(Some(&waiting(1)), &r),
            Plan::Done(Settled::Delivered)
        );
    }

    #[test]
    fn a_delivered_retry_is_recorded_delivered() {
        let (e, ok) = (event(7), Outcome::Delivered);
        let r = report(&e, 2, Source::Retry, &ok);
        let Plan::RecordDelivery(rec) = plan_of(Some(&waiting(1)), &r) else {
            panic!("a delivery to record");
        };
        assert_eq!(rec.state(), State::Delivered);
        assert_eq!((rec.attempts, rec.next_attempt_ms()), (2, None));
        assert_eq!((rec.claim.as_ref(), rec.updated_ms), (None, ms(now())));
        let last = rec.history.last().unwrap();
        assert_eq!(last.outcome, HistoryOutcome::Delivered);
        assert_eq!((last.attempt, last.trace_id.as_deref()), (2, Some("t")));
        assert_eq!(last.started_ms, ms(now()) - 1000);
    }

    #[test]
    fn a_replay_from_event_hubs_after_later_attempts_is_recorded_as_a_replay() {
        let (e, ok) = (event(7), Outcome::Delivered);
        let r = report(&e, 1, Source::EventHubs, &ok);
        let Plan::RecordDelivery(rec) = plan_of(Some(&waiting(2)), &r) else {
            panic!("a delivery to record");
        };
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
        let last = rec.history.last().unwrap();
        assert_eq!(
            (last.attempt, &last.outcome),
            (1, &HistoryOutcome::DeliveredOnReplay)
        );
    }

    #[test]
    fn a_failure_the_ledger_already_counted_resends_the_recorded_attempt() {
        let (e, failed) = (event(7), boom());
        let rec = waiting(2);
        for attempt in [1, 2] {
            let r = report(&e, attempt, Source::Retry, &failed);
            assert_eq!(
                plan_of(Some(&rec), &r),
                Plan::ResendRecorded(Box::new(rec.clone()))
            );
        }
    }

    #[test]
    fn a_first_failure_pins_the_policy_and_schedules_attempt_two_on_a_whole_second() {
        let (e, failed) = (event(7), boom());
        let r = report(&e, 1, Source::EventHubs, &failed);
        let Plan::Schedule {
            record,
            attempt,
            due,
            capped_from,
        } = plan_of(None, &r)
        else {
            panic!("a retry to schedule");
        };
        // 10 s after now, rounded up to Service Bus's whole second.
        let expected = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_011);
        assert_eq!((attempt, due, capped_from), (2, expected, None));
        assert_eq!(record.state(), State::RetryScheduled);
        assert_eq!(record.attempts, 1);
        assert_eq!(record.next_attempt_ms(), Some(ms(expected)));
        assert_eq!(record.last_delay_ms, Some(10_750));
        assert_eq!(record.first_failure_ms, ms(now()));
        assert_eq!(record.policy.name, "default");
        assert_eq!(record.last_error.as_deref(), Some("boom"));
        assert_eq!(record.event, e);
        let last = record.history.last().unwrap();
        assert_eq!(last.outcome, HistoryOutcome::RetryScheduled);
        assert_eq!(last.next_attempt_ms, Some(ms(expected)));
    }

    #[test]
    fn a_failure_follows_the_policy_pinned_in_the_record() {
        let (e, failed) = (event(7), boom());
        let mut rec = waiting(1);
        rec.policy = policy("pinned", 2);
        let r = report(&e, 2, Source::Retry, &failed);
        let Plan::DeadLetter { record, reason } = plan_of(Some(&rec), &r) else {
            panic!("a dead letter: the pinned policy allows two attempts");
        };
        assert_eq!(reason, DeadLetterReason::AttemptsExhausted);
        assert_eq!((record.state(), record.attempts), (State::DeadLettered, 2));
        assert_eq!(record.next_attempt_ms(), None);
        assert_eq!(record.claim, None);
        assert_eq!(record.dead_letter_reason(), Some(reason));
        let last = record.history.last().unwrap();
        assert_eq!(
            (last.attempt, &last.outcome),
            (2, &HistoryOutcome::DeadLettered)
        );
    }

    #[test]
    fn a_permanent_failure_is_dead_lettered_at_once() {
        let e = event(7);
        let failed = Outcome::Failed(Failure::permanent("400"));
        let r = report(&e, 1, Source::EventHubs, &failed);
        let Plan::DeadLetter { record, reason } = plan_of(None, &r) else {
            panic!("a dead letter");
        };
        assert_eq!(reason, DeadLetterReason::Permanent);
        assert_eq!(
            (record.attempts, record.last_error.as_deref()),
            (1, Some("400"))
        );
    }

    #[test]
    fn a_retry_after_longer_than_the_policy_allows_is_shortened_and_recorded() {
        let e = event(7);
        let failed = Outcome::Failed(
            Failure::transient("429").with_retry_after(Some(Duration::from_secs(600))),
        );
        let r = report(&e, 2, Source::Retry, &failed);
        let Plan::Schedule {
            record,
            capped_from,
            ..
        } = plan_of(Some(&waiting(1)), &r)
        else {
            panic!("a retry to schedule");
        };
        assert_eq!(capped_from, Some(Duration::from_secs(600)));
        let last = record.history.last().unwrap();
        assert_eq!(last.retry_after_capped_from_s, Some(600));
    }

    #[test]
    fn a_refused_retry_message_dead_letters_only_a_waiting_record() {
        let rec = waiting(1);
        let dead = refusal(&rec, "403 from Service Bus", now()).unwrap();
        assert_eq!(dead.state(), State::DeadLettered);
        assert_eq!(
            dead.dead_letter_reason(),
            Some(DeadLetterReason::RetryRefused)
        );
        assert_eq!(dead.next_attempt_ms(), None);
        assert_eq!(dead.last_error.as_deref(), Some("403 from Service Bus"));
        let last = dead.history.last().unwrap();
        assert_eq!(
            (last.attempt, &last.outcome),
            (1, &HistoryOutcome::DeadLettered)
        );
        assert_eq!(refusal(&dead, "again", now()), None);
    }
}
