//! The rest of a waiting event's pinned schedule, as the console shows it: when each later
//! attempt would run if every attempt failed at its due time, and when and why it would be
//! dead-lettered. Pure: the record's pinned policy and its times, no clock and no I/O.

use std::time::Duration;

use rand::RngCore;
use serde::Serialize;

use crate::ledger::{LedgerRecord, State};
use crate::policy::{DeadLetterReason, RetryPolicy};

/// Later attempts listed at most (a long explicit schedule ends in "…").
const MAX_STEPS: usize = 24;

/// One attempt of the rest of the schedule: due between `earliest_ms` and `latest_ms` (the
/// same for curves without jitter).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Step {
    /// The attempt number.
    pub attempt: u32,
    /// Due at the earliest (ms since the epoch).
    pub earliest_ms: i64,
    /// Due at the latest.
    pub latest_ms: i64,
}

/// When the event is dead-lettered if every attempt fails.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GivesUp {
    /// After this attempt fails.
    pub after_attempt: u32,
    /// Which is due between these times.
    pub earliest_ms: i64,
    /// …and this.
    pub latest_ms: i64,
    /// With this reason.
    pub reason: DeadLetterReason,
}

/// The projection of a waiting record's schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Projection {
    /// The waiting attempt first, then each later one.
    pub steps: Vec<Step>,
    /// Whether the list stops before the end.
    pub truncated: bool,
    /// When it gives up.
    pub gives_up: Option<GivesUp>,
    /// The curve draws at random (jitter): times are ranges.
    pub jitter: bool,
}

/// An RNG that always draws its lowest (`false`) or highest (`true`) value: a jittered
/// delay's bounds from the policy's own function.
struct Extreme(bool);

impl RngCore for Extreme {
    fn next_u32(&mut self) -> u32 {
        if self.0 {
            u32::MAX
        } else {
            0
        }
    }
    fn next_u64(&mut self) -> u64 {
        if self.0 {
            u64::MAX
        } else {
            0
        }
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        dest.fill(if self.0 { 0xff } else { 0 });
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

/// Each attempt's due time, and the attempt after which it gives up (its due time, why).
type Walked = (Vec<(u32, i64)>, Option<(u32, i64, DeadLetterReason)>);

/// One bound of the schedule: the due time of each attempt from `attempt` on, and the
/// attempt after which it gives up, with the reason.
fn walk(
    policy: &RetryPolicy,
    base: u32,
    mut attempt: u32,
    mut due_ms: i64,
    first_failure_ms: i64,
    mut previous: Option<Duration>,
    high: bool,
) -> Walked {
    let mut rng = Extreme(high);
    let mut out = vec![(attempt, due_ms)];
    for _ in 0..MAX_STEPS + 1 {
        let budget = attempt.saturating_sub(base);
        if budget >= policy.max_attempts {
            return (
                out,
                Some((attempt, due_ms, DeadLetterReason::AttemptsExhausted)),
            );
        }
        let Some(delay) = policy.delay(budget, previous, &mut rng) else {
            return (
                out,
                Some((attempt, due_ms, DeadLetterReason::ScheduleExhausted)),
            );
        };
        let next = due_ms.saturating_add(delay.as_millis() as i64);
        if let Some(max_age) = policy.max_age_s {
            if next.saturating_sub(first_failure_ms) > (max_age as i64).saturating_mul(1000) {
                return (out, Some((attempt, due_ms, DeadLetterReason::AgeExceeded)));
            }
        }
        previous = Some(delay);
        attempt += 1;
        due_ms = next;
        out.push((attempt, due_ms));
    }
    (out, None)
}

/// The rest of `rec`'s schedule; `None` unless it waits for a retry.
pub fn project(rec: &LedgerRecord) -> Option<Projection> {
    if rec.state() != State::RetryScheduled {
        return None;
    }
    let due = rec.next_attempt_ms()?;
    let previous = rec.last_delay_ms.map(Duration::from_millis);
    let run = |high| {
        walk(
            &rec.policy,
            rec.attempt_base,
            rec.attempts + 1,
            due,
            rec.first_failure_ms,
            previous,
            high,
        )
    };
    let (low, low_end) = run(false);
    let (high, high_end) = run(true);
    let jitter = low != high;
    let steps: Vec<Step> = low
        .iter()
        .zip(high.iter())
        .take(MAX_STEPS)
        .map(|(l, h)| Step {
            attempt: l.0,
            earliest_ms: l.1,
            latest_ms: h.1.max(l.1),
        })
        .collect();
    let truncated = low.len() > MAX_STEPS || low_end.is_none();
    // Jitter can end the two bounds differently (an age limit met by one only): the
    // earliest end is shown, its latest time from the other bound when both end alike.
    let gives_up = low_end.map(|(after_attempt, earliest_ms, reason)| {
        let latest_ms = match high_end {
            Some((a, t, _)) if a == after_attempt => t.max(earliest_ms),
            _ => earliest_ms,
        };
        GivesUp {
            after_attempt,
            earliest_ms,
            latest_ms,
            reason,
        }
    });
    Some(Projection {
        steps,
        truncated,
        gives_up,
        jitter,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, Identity};
    use crate::policy::Curve;

    fn waiting(policy: RetryPolicy, attempts: u32, due_ms: i64) -> LedgerRecord {
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
        let mut rec = LedgerRecord::first_failure(&event, policy, crate::clock::at(0));
        rec.attempts = attempts;
        rec.schedule_retry(due_ms);
        rec
    }

    #[test]
    fn an_explicit_schedule_runs_to_its_last_attempt() {
        let policy = RetryPolicy {
            name: "grid".into(),
            curve: Curve::Schedule {
                delays_s: vec![10, 30, 60],
                repeat_last: false,
            },
            base_s: 1,
            floor_s: 0,
            cap_s: 3600,
            max_attempts: 10,
            max_age_s: None,
        };
        // Attempt 1 failed; attempt 2 is due at 10 s.
        let p = project(&waiting(policy, 1, 10_000)).unwrap();
        let at: Vec<(u32, i64)> = p.steps.iter().map(|s| (s.attempt, s.earliest_ms)).collect();
        assert_eq!(at, [(2, 10_000), (3, 40_000), (4, 100_000)]);
        assert!(!p.jitter);
        let end = p.gives_up.unwrap();
        assert_eq!(
            (end.after_attempt, end.earliest_ms, end.reason),
            (4, 100_000, DeadLetterReason::ScheduleExhausted)
        );
    }

    #[test]
    fn attempts_and_age_budgets_end_the_schedule() {
        let fixed = |max_attempts, max_age_s| RetryPolicy {
            name: "fixed".into(),
            curve: Curve::Fixed,
            base_s: 60,
            floor_s: 0,
            cap_s: 3600,
            max_attempts,
            max_age_s,
        };
        let p = project(&waiting(fixed(3, None), 1, 60_000)).unwrap();
        assert_eq!(p.steps.len(), 2);
        assert_eq!(
            p.gives_up.unwrap().reason,
            DeadLetterReason::AttemptsExhausted
        );
        let p = project(&waiting(fixed(100, Some(150)), 1, 60_000)).unwrap();
        let end = p.gives_up.unwrap();
        // 60 s, 120 s; the next (180 s) would be past the age of 150 s.
        assert_eq!(
            (end.after_attempt, end.earliest_ms, end.reason),
            (3, 120_000, DeadLetterReason::AgeExceeded)
        );
    }

    #[test]
    fn jitter_gives_ranges_within_the_curve() {
        let policy = RetryPolicy {
            name: "jitter".into(),
            curve: Curve::FullJitter,
            base_s: 10,
            floor_s: 0,
            cap_s: 3600,
            max_attempts: 4,
            max_age_s: None,
        };
        let p = project(&waiting(policy, 1, 5_000)).unwrap();
        assert!(p.jitter);
        let third = &p.steps[1];
        // After attempt 2 (budget 2): uniform in [0, 20 s].
        assert_eq!(third.earliest_ms, 5_000);
        assert!((24_000..=25_000).contains(&third.latest_ms), "{third:?}");
        let mut delivered = waiting(RetryPolicy::seed_fibonacci(), 1, 5_000);
        delivered.deliver();
        assert!(project(&delivered).is_none());
    }
}
