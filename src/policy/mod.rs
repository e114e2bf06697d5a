//! Retry policies: the backoff curve, its floor and cap, the attempt and age budgets — data,
//! with the decision a pure function of (policy, attempt, times, error). No I/O, no clock:
//! callers pass `now` and a random source.
//!
//! - [`Curve`]: fibonacci, exponential, full jitter, equal jitter, decorrelated jitter, fixed,
//!   or an explicit schedule with an optional repeating last step (Event Grid's preset).
//! - [`RetryPolicy::decide`]: retry at a time, or dead-letter with a reason.
//! - [`classify`]: HTTP answers and handler errors to transient / permanent.

pub mod classify;

use std::time::{Duration, SystemTime};

use rand::Rng;
use serde::{Deserialize, Serialize};

/// Service Bus refuses to hold a scheduled message longer than its maximum TTL (14 days);
/// hubguard never schedules further than 7 days ahead.
pub const MAX_SCHEDULE_AHEAD: Duration = Duration::from_secs(7 * 24 * 3600);

/// How the wait grows with the attempt number.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "curve", rename_all = "snake_case")]
pub enum Curve {
    /// `fib(n) × base` (1, 1, 2, 3, 5, 8, …), the classic Fibonacci backoff.
    Fibonacci,
    /// `base × 2^(n−1)`.
    Exponential,
    /// Uniform in `[0, base × 2^(n−1)]` (AWS "full jitter"): spreads a burst of failures.
    FullJitter,
    /// Half fixed, half random: `e/2 + uniform[0, e/2]` with `e = base × 2^(n−1)`.
    EqualJitter,
    /// `min(cap, uniform[base, previous × 3])` (AWS "decorrelated jitter").
    DecorrelatedJitter,
    /// Always `base`.
    Fixed,
    /// Explicit delays (seconds) for attempts 1, 2, …; past the end, `repeat_last` repeats
    /// the last step, otherwise the schedule is exhausted.
    Schedule {
        /// Delays in seconds.
        delays_s: Vec<u64>,
        /// Keep using the last delay after the list ends.
        #[serde(default)]
        repeat_last: bool,
    },
}

/// A retry policy for one event type.
///
/// (Unknown keys in a policy table are reported by the configuration loader: serde cannot
/// deny them through the flattened curve.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// A name for status output and telemetry.
    #[serde(default = "default_name")]
    pub name: String,
    /// The curve.
    #[serde(flatten)]
    pub curve: Curve,
    /// Base delay in seconds.
    #[serde(default = "default_base")]
    pub base_s: u64,
    /// No wait shorter than this (seconds).
    #[serde(default)]
    pub floor_s: u64,
    /// No wait longer than this (seconds; at most 7 days).
    #[serde(default = "default_cap")]
    pub cap_s: u64,
    /// Attempts in all, the first delivery included; then dead-letter.
    pub max_attempts: u32,
    /// Dead-letter once the next attempt would start later than this after the first
    /// failure (seconds); `None`: no age limit.
    #[serde(default)]
    pub max_age_s: Option<u64>,
}

fn default_name() -> String {
    "default".into()
}
fn default_base() -> u64 {
    10
}
fn default_cap() -> u64 {
    MAX_SCHEDULE_AHEAD.as_secs()
}

/// The facts about a failed attempt that a decision depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedAttempt {
    /// The attempt's number within the policy's budget (1-based).
    pub attempt: u32,
    /// When the event first failed (the age budget counts from here).
    pub first_failure: SystemTime,
    /// Now.
    pub now: SystemTime,
    /// The error is permanent.
    pub permanent: bool,
    /// The downstream's `Retry-After`.
    pub retry_after: Option<Duration>,
    /// The longest `Retry-After` honoured (the handler's `retry_after_max_s`); the policy's
    /// cap bounds it in any case.
    pub retry_after_max: Option<Duration>,
    /// The wait before this attempt (decorrelated jitter grows from it).
    pub previous_delay: Option<Duration>,
}

impl FailedAttempt {
    /// A transient failure of `attempt` at `now`, first failing at `first_failure`.
    #[cfg(test)]
    pub fn transient(attempt: u32, first_failure: SystemTime, now: SystemTime) -> Self {
        Self {
            attempt,
            first_failure,
            now,
            permanent: false,
            retry_after: None,
            retry_after_max: None,
            previous_delay: None,
        }
    }
}

/// The wait after a failed attempt once the downstream's `Retry-After` is weighed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// How long to wait.
    pub delay: Duration,
    /// The `Retry-After` the downstream asked for, when it was longer than `limit` and was
    /// shortened to it (`None`: honoured as asked, or not asked for).
    pub retry_after_capped_from: Option<Duration>,
}

/// Retry-After, curve and cap in one place: the curve's `delay`, or the downstream's
/// `retry_after` when that is longer — but never beyond `limit` (the policy's cap, or the
/// handler's `retry_after_max_s` when lower). A hostile or broken `Retry-After`
/// (`999999999`, a date in year 9999) cannot park an event beyond what its policy allows; a
/// shortened one is reported so the attempt's span and `status` can say so. `limit` bounds
/// only the `Retry-After`: a curve's own delay (already within the cap) stands.
pub fn honour_retry_after(delay: Duration, retry_after: Option<Duration>, limit: Duration) -> Wait {
    match retry_after {
        Some(ra) if ra > delay && ra > limit => Wait {
            delay: limit.max(delay),
            retry_after_capped_from: Some(ra),
        },
        Some(ra) if ra > delay => Wait {
            delay: ra,
            retry_after_capped_from: None,
        },
        _ => Wait {
            delay,
            retry_after_capped_from: None,
        },
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Schedule the next attempt at this time.
    RetryAt(SystemTime),
    /// Stop: dead-letter with this reason.
    DeadLetter(DeadLetterReason),
}

/// Why an event was dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterReason {
    /// The error is permanent (e.g. HTTP 400).
    Permanent,
    /// `max_attempts` attempts failed.
    AttemptsExhausted,
    /// The next attempt would be later than `max_age` after the first failure.
    AgeExceeded,
    /// The explicit schedule has no more steps.
    ScheduleExhausted,
    /// Service Bus refused the retry message for what it is (too large, a bad property): it
    /// would refuse it every time, so the event cannot wait there. The last error says what
    /// was refused.
    RetryRefused,
    /// The event's ledger record could not be parsed: it was set aside (see the record's
    /// `quarantined` blob) and the event dead-lettered rather than held forever.
    CorruptRecord,
    /// A retry came due whose ledger record was gone (removed by hand) and whose event could
    /// not be read back from Event Hubs (past the hub's retention, or another event at its
    /// position): the key is all that is known.
    RecordMissing,
    /// An operator cancelled the pending retry (`hubguard retries cancel`); the last error
    /// holds their reason. Replayable like any dead letter.
    Cancelled,
    /// Parked behind an event of its ordering key that was dead-lettered, with
    /// `processor.line_on_dead_letter = "dead_letter_line"`: the line followed its head into
    /// the dead letters. Replayable like any dead letter.
    LineDeadLettered,
}

impl std::fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Permanent => "permanent error",
            Self::AttemptsExhausted => "attempts exhausted",
            Self::AgeExceeded => "maximum age exceeded",
            Self::ScheduleExhausted => "retry schedule exhausted",
            Self::RetryRefused => "Service Bus refused the retry message",
            Self::CorruptRecord => "corrupt ledger record",
            Self::RecordMissing => "ledger record missing and the event gone from Event Hubs",
            Self::Cancelled => "cancelled",
            Self::LineDeadLettered => "parked behind a dead-lettered event of its ordering key",
        })
    }
}

fn fibonacci(n: u32) -> u64 {
    let (mut a, mut b) = (0u64, 1u64);
    for _ in 0..n {
        let next = a.saturating_add(b);
        a = b;
        b = next;
    }
    a
}

impl RetryPolicy {
    /// The default policy: Fibonacci × 10 s, floor 10 s, cap 7 days, 29 attempts.
    pub fn seed_fibonacci() -> Self {
        Self {
            name: "fibonacci".into(),
            curve: Curve::Fibonacci,
            base_s: 10,
            floor_s: 10,
            cap_s: MAX_SCHEDULE_AHEAD.as_secs(),
            max_attempts: 29,
            max_age_s: None,
        }
    }

    /// Event Grid's documented schedule: 10 s, 30 s, 1 m, 5 m, 10 m, 30 m, 1 h, 3 h, 6 h,
    /// then every 12 h, for up to 24 hours and 30 attempts.
    pub fn event_grid() -> Self {
        Self {
            name: "event_grid".into(),
            curve: Curve::Schedule {
                delays_s: vec![10, 30, 60, 300, 600, 1800, 3600, 10_800, 21_600, 43_200],
                repeat_last: true,
            },
            base_s: 10,
            floor_s: 0,
            cap_s: MAX_SCHEDULE_AHEAD.as_secs(),
            max_attempts: 30,
            max_age_s: Some(24 * 3600),
        }
    }

    /// The wait after failed attempt `attempt` (1-based), before floor and cap; `None` when an
    /// explicit schedule has no step for it. `previous` is the last wait (decorrelated jitter).
    fn raw_delay(
        &self,
        attempt: u32,
        previous: Option<Duration>,
        rng: &mut impl Rng,
    ) -> Option<f64> {
        let base = self.base_s as f64;
        let exp = base * 2f64.powi(attempt.saturating_sub(1).min(60) as i32);
        Some(match &self.curve {
            Curve::Fibonacci => fibonacci(attempt) as f64 * base,
            Curve::Exponential => exp,
            Curve::FullJitter => rng.gen_range(0.0..=exp),
            Curve::EqualJitter => exp / 2.0 + rng.gen_range(0.0..=exp / 2.0),
            Curve::DecorrelatedJitter => {
                let prev = previous.map_or(base, |p| p.as_secs_f64()).max(base);
                rng.gen_range(base..=prev * 3.0)
            }
            Curve::Fixed => base,
            Curve::Schedule {
                delays_s,
                repeat_last,
            } => {
                let i = attempt.saturating_sub(1) as usize;
                match delays_s.get(i) {
                    Some(d) => *d as f64,
                    None if *repeat_last => *delays_s.last()? as f64,
                    None => return None,
                }
            }
        })
    }

    /// The wait after failed attempt `attempt`, within floor and cap (and never more than
    /// [`MAX_SCHEDULE_AHEAD`]); `None` when the schedule is exhausted.
    pub(crate) fn delay(
        &self,
        attempt: u32,
        previous: Option<Duration>,
        rng: &mut impl Rng,
    ) -> Option<Duration> {
        let raw = self.raw_delay(attempt, previous, rng)?;
        let cap = self.cap_s.min(MAX_SCHEDULE_AHEAD.as_secs()) as f64;
        let secs = raw.max(self.floor_s as f64).min(cap).max(0.0);
        Some(Duration::from_secs_f64(secs))
    }

    /// Decides what follows a failed attempt: dead-letter when the error is permanent or a
    /// budget is spent, else retry at `now + max(delay, retry_after)`.
    #[cfg(test)]
    pub(crate) fn decide(&self, f: &FailedAttempt, rng: &mut impl Rng) -> Decision {
        self.decision(f, rng).0
    }

    /// [`decide`](Self::decide), and the `Retry-After` it shortened to the policy's limit
    /// (see [`honour_retry_after`]), if it did.
    pub(crate) fn decision(
        &self,
        f: &FailedAttempt,
        rng: &mut impl Rng,
    ) -> (Decision, Option<Duration>) {
        if f.permanent {
            return (Decision::DeadLetter(DeadLetterReason::Permanent), None);
        }
        if f.attempt >= self.max_attempts {
            return (
                Decision::DeadLetter(DeadLetterReason::AttemptsExhausted),
                None,
            );
        }
        let Some(delay) = self.delay(f.attempt, f.previous_delay, rng) else {
            return (
                Decision::DeadLetter(DeadLetterReason::ScheduleExhausted),
                None,
            );
        };
        // A downstream's Retry-After is honoured when it is longer than the curve, up to the
        // policy's cap (or the handler's lower limit), never beyond.
        let cap = self.longest_wait();
        let limit = f.retry_after_max.map_or(cap, |m| m.min(cap));
        let wait = honour_retry_after(delay, f.retry_after, limit);
        let Some(at) = f.now.checked_add(wait.delay) else {
            return (Decision::DeadLetter(DeadLetterReason::AgeExceeded), None);
        };
        if let Some(max_age) = self.max_age_s {
            if at.duration_since(f.first_failure).unwrap_or_default() > Duration::from_secs(max_age)
            {
                return (
                    Decision::DeadLetter(DeadLetterReason::AgeExceeded),
                    wait.retry_after_capped_from,
                );
            }
        }
        (Decision::RetryAt(at), wait.retry_after_capped_from)
    }

    /// The longest time this policy may keep an event between attempts (for start-up checks).
    pub fn longest_wait(&self) -> Duration {
        Duration::from_secs(self.cap_s.min(MAX_SCHEDULE_AHEAD.as_secs()))
    }

    /// Checks the policy; the error names the field and what is allowed.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.max_attempts == 0 {
            return Err(PolicyError::NoAttempts);
        }
        if self.floor_s > self.cap_s {
            return Err(PolicyError::FloorAboveCap {
                floor_s: self.floor_s,
                cap_s: self.cap_s,
            });
        }
        if self.cap_s > MAX_SCHEDULE_AHEAD.as_secs() {
            return Err(PolicyError::CapBeyondSchedule { cap_s: self.cap_s });
        }
        if let Curve::Schedule { delays_s, .. } = &self.curve {
            if delays_s.is_empty() {
                return Err(PolicyError::EmptySchedule);
            }
        }
        if matches!(
            self.curve,
            Curve::Exponential
                | Curve::FullJitter
                | Curve::EqualJitter
                | Curve::DecorrelatedJitter
                | Curve::Fixed
                | Curve::Fibonacci
        ) && self.base_s == 0
        {
            return Err(PolicyError::NoBase);
        }
        Ok(())
    }
}

/// Why a retry policy cannot run; each names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// `max_attempts` is 0.
    #[error("max_attempts must be at least 1")]
    NoAttempts,
    /// `floor_s` exceeds `cap_s`.
    #[error("floor_s ({floor_s}) must not exceed cap_s ({cap_s})")]
    FloorAboveCap {
        /// The floor.
        floor_s: u64,
        /// The cap.
        cap_s: u64,
    },
    /// `cap_s` exceeds what Service Bus can schedule ahead (`MAX_SCHEDULE_AHEAD`, 7 days).
    #[error("cap_s ({cap_s}) exceeds what Service Bus can schedule ({} s, 7 days)", MAX_SCHEDULE_AHEAD.as_secs())]
    CapBeyondSchedule {
        /// The cap.
        cap_s: u64,
    },
    /// A schedule curve without delays.
    #[error("a schedule curve needs at least one delay in delays_s")]
    EmptySchedule,
    /// A curve that needs `base_s` has 0.
    #[error("base_s must be at least 1 second")]
    NoBase,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn rng() -> StdRng {
        StdRng::seed_from_u64(7)
    }

    #[test]
    fn seed_fibonacci_table() {
        let p = RetryPolicy::seed_fibonacci();
        let got: Vec<u64> = (1..=10)
            .map(|n| p.delay(n, None, &mut rng()).unwrap().as_secs())
            .collect();
        assert_eq!(got, vec![10, 10, 20, 30, 50, 80, 130, 210, 340, 550]);
        // The cap: 7 days, never more.
        assert_eq!(p.delay(29, None, &mut rng()).unwrap(), MAX_SCHEDULE_AHEAD);
        assert_eq!(p.delay(50, None, &mut rng()).unwrap(), MAX_SCHEDULE_AHEAD);
    }

    #[test]
    fn event_grid_schedule_and_the_every_30_minutes_variant() {
        let p = RetryPolicy::event_grid();
        let got: Vec<u64> = (1..=12)
            .map(|n| p.delay(n, None, &mut rng()).unwrap().as_secs())
            .collect();
        assert_eq!(
            got,
            vec![10, 30, 60, 300, 600, 1800, 3600, 10_800, 21_600, 43_200, 43_200, 43_200]
        );
        // The variant some Event Grid documentation describes: then every 30 minutes.
        let variant = RetryPolicy {
            curve: Curve::Schedule {
                delays_s: vec![10, 30, 60, 300, 600, 1800],
                repeat_last: true,
            },
            ..RetryPolicy::event_grid()
        };
        assert_eq!(variant.delay(20, None, &mut rng()).unwrap().as_secs(), 1800);
        let finite = RetryPolicy {
            curve: Curve::Schedule {
                delays_s: vec![5, 6],
                repeat_last: false,
            },
            ..variant
        };
        assert_eq!(finite.delay(3, None, &mut rng()), None);
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(
            finite.decide(&FailedAttempt::transient(3, t, t), &mut rng()),
            Decision::DeadLetter(DeadLetterReason::ScheduleExhausted)
        );
    }

    #[test]
    fn decisions_follow_budgets_and_retry_after() {
        let p = RetryPolicy {
            max_attempts: 3,
            max_age_s: Some(100),
            ..RetryPolicy::seed_fibonacci()
        };
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let first = FailedAttempt::transient(1, t0, t0);
        assert_eq!(
            p.decide(&first, &mut rng()),
            Decision::RetryAt(t0 + Duration::from_secs(10))
        );
        let perm = FailedAttempt {
            permanent: true,
            ..first.clone()
        };
        assert_eq!(
            p.decide(&perm, &mut rng()),
            Decision::DeadLetter(DeadLetterReason::Permanent)
        );
        assert_eq!(
            p.decide(&FailedAttempt::transient(3, t0, t0), &mut rng()),
            Decision::DeadLetter(DeadLetterReason::AttemptsExhausted)
        );
        // Retry-After longer than the curve wins; shorter does not.
        let long = FailedAttempt {
            retry_after: Some(Duration::from_secs(60)),
            ..first.clone()
        };
        assert_eq!(
            p.decide(&long, &mut rng()),
            Decision::RetryAt(t0 + Duration::from_secs(60))
        );
        let short = FailedAttempt {
            retry_after: Some(Duration::from_secs(1)),
            ..first.clone()
        };
        assert_eq!(
            p.decide(&short, &mut rng()),
            Decision::RetryAt(t0 + Duration::from_secs(10))
        );
        // Age: the next attempt would start 95 + 10 s after the first failure.
        let late = FailedAttempt::transient(2, t0, t0 + Duration::from_secs(95));
        assert_eq!(
            p.decide(&late, &mut rng()),
            Decision::DeadLetter(DeadLetterReason::AgeExceeded)
        );
    }

    #[test]
    fn a_retry_after_is_honoured_up_to_the_limit_and_never_beyond() {
        let s = Duration::from_secs;
        // Longer than the curve and within the limit: as asked.
        assert_eq!(
            honour_retry_after(s(10), Some(s(60)), s(3600)),
            Wait {
                delay: s(60),
                retry_after_capped_from: None
            }
        );
        // Shorter than the curve: the curve.
        assert_eq!(
            honour_retry_after(s(10), Some(s(1)), s(3600)),
            Wait {
                delay: s(10),
                retry_after_capped_from: None
            }
        );
        assert_eq!(
            honour_retry_after(s(10), None, s(3600)),
            Wait {
                delay: s(10),
                retry_after_capped_from: None
            }
        );
        // Beyond the limit: the limit, and it says from what.
        assert_eq!(
            honour_retry_after(s(10), Some(s(999_999_999)), s(3600)),
            Wait {
                delay: s(3600),
                retry_after_capped_from: Some(s(999_999_999))
            }
        );
        // The limit shortens only the Retry-After: a curve longer than it stands.
        assert_eq!(
            honour_retry_after(s(7200), Some(s(9000)), s(3600)),
            Wait {
                delay: s(7200),
                retry_after_capped_from: Some(s(9000))
            }
        );
        assert_eq!(
            honour_retry_after(s(10), Some(Duration::MAX), s(3600)).delay,
            s(3600)
        );
    }

    #[test]
    fn a_hostile_retry_after_is_held_to_the_policy_cap_or_the_handler_limit() {
        let p = RetryPolicy {
            cap_s: 3600,
            ..RetryPolicy::seed_fibonacci()
        };
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let year_9999 = crate::clock::parse_http_date("Fri, 31 Dec 9999 23:59:59 GMT").unwrap();
        for asked in [
            Duration::from_secs(999_999_999),
            year_9999.duration_since(t0).unwrap(),
            Duration::MAX,
        ] {
            let f = FailedAttempt {
                retry_after: Some(asked),
                ..FailedAttempt::transient(1, t0, t0)
            };
            assert_eq!(
                p.decision(&f, &mut rng()),
                (
                    Decision::RetryAt(t0 + Duration::from_secs(3600)),
                    Some(asked)
                ),
                "{asked:?}"
            );
            // The handler's lower limit.
            let limited = FailedAttempt {
                retry_after_max: Some(Duration::from_secs(120)),
                ..f.clone()
            };
            assert_eq!(
                p.decision(&limited, &mut rng()),
                (
                    Decision::RetryAt(t0 + Duration::from_secs(120)),
                    Some(asked)
                )
            );
            // A handler limit above the policy's cap does not lift it.
            let lifted = FailedAttempt {
                retry_after_max: Some(Duration::from_secs(30 * 24 * 3600)),
                ..f.clone()
            };
            assert_eq!(
                p.decision(&lifted, &mut rng()).0,
                Decision::RetryAt(t0 + Duration::from_secs(3600))
            );
        }
        // Within the limit: honoured, nothing shortened.
        let f = FailedAttempt {
            retry_after: Some(Duration::from_secs(600)),
            ..FailedAttempt::transient(1, t0, t0)
        };
        assert_eq!(
            p.decision(&f, &mut rng()),
            (Decision::RetryAt(t0 + Duration::from_secs(600)), None)
        );
    }

    proptest! {
        #[test]
        fn no_retry_after_waits_beyond_the_cap(asked in any::<u64>(), cap in 1u64..700_000, limit in proptest::option::of(0u64..1_000_000), attempt in 1u32..40) {
            let p = RetryPolicy { cap_s: cap, floor_s: 0, max_attempts: 1000, max_age_s: None, ..RetryPolicy::seed_fibonacci() };
            let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
            let f = FailedAttempt {
                retry_after: Some(Duration::from_secs(asked)),
                retry_after_max: limit.map(Duration::from_secs),
                ..FailedAttempt::transient(attempt, t0, t0)
            };
            let (d, capped) = p.decision(&f, &mut rng());
            let Decision::RetryAt(at) = d else { panic!("{d:?}") };
            let wait = at.duration_since(t0).unwrap();
            prop_assert!(wait <= Duration::from_secs(cap));
            prop_assert_eq!(capped.is_some(), wait < Duration::from_secs(asked));
        }
    }

    #[test]
    fn policies_round_trip_through_json_with_their_curve() {
        for p in [RetryPolicy::seed_fibonacci(), RetryPolicy::event_grid()] {
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_json::from_str::<RetryPolicy>(&json).unwrap(), p);
        }
    }

    #[test]
    fn validation_names_the_problem() {
        let mut p = RetryPolicy::seed_fibonacci();
        p.max_attempts = 0;
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_attempts"));
        let mut p = RetryPolicy::seed_fibonacci();
        p.cap_s = 30 * 24 * 3600;
        assert!(p.validate().unwrap_err().to_string().contains("cap_s"));
        assert!(RetryPolicy::event_grid().validate().is_ok());
    }

    proptest! {
        #[test]
        fn every_curve_stays_within_floor_and_cap(attempt in 1u32..200, base in 1u64..1000, floor in 0u64..100, cap in 100u64..2_000_000, seed in any::<u64>(), prev in 0u64..10_000) {
            let mut r = StdRng::seed_from_u64(seed);
            for curve in [Curve::Fibonacci, Curve::Exponential, Curve::FullJitter, Curve::EqualJitter, Curve::DecorrelatedJitter, Curve::Fixed] {
                let p = RetryPolicy { name: "p".into(), curve, base_s: base, floor_s: floor, cap_s: cap, max_attempts: 1000, max_age_s: None };
                let d = p.delay(attempt, Some(Duration::from_secs(prev)), &mut r).unwrap();
                prop_assert!(d >= Duration::from_secs(floor.min(cap).min(MAX_SCHEDULE_AHEAD.as_secs())));
                prop_assert!(d <= Duration::from_secs(cap.min(MAX_SCHEDULE_AHEAD.as_secs())));
            }
        }

        #[test]
        fn fibonacci_and_exponential_never_shrink(attempt in 1u32..100) {
            let fib = RetryPolicy::seed_fibonacci();
            let exp = RetryPolicy { curve: Curve::Exponential, ..RetryPolicy::seed_fibonacci() };
            for p in [fib, exp] {
                let a = p.delay(attempt, None, &mut rng()).unwrap();
                let b = p.delay(attempt + 1, None, &mut rng()).unwrap();
                prop_assert!(b >= a);
            }
        }
    }
}
