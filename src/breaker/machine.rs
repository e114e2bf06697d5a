//! The breaker's pure state machine: the shared record, what work may do given it
//! ([`decide`]), the change a call's result calls for ([`on_result`]), how a change applies to
//! the record ([`apply`]) and why work waits ([`waiting`]) — functions of the record, the time
//! and the settings alone.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::BreakerConfig;
use crate::clock::{at, ms, rfc3339};

/// A half-open trial: the calls let through to judge the downstream, and their results.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Trial {
    /// When it began (its first call was admitted): the trial's identity.
    pub since_ms: i64,
    /// Calls admitted so far (never more than `half_open_calls`).
    pub admitted: u32,
    /// Of those, calls that succeeded.
    pub successes: u32,
    /// Of those, calls that failed transiently.
    pub failures: u32,
}

/// The shared record of one downstream's breaker.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BreakerRecord {
    /// `None`: closed. `Some`: open (or half-open once `now >= open_until_ms`).
    pub open_until_ms: Option<i64>,
    /// When it opened (for its age).
    pub opened_at_ms: Option<i64>,
    /// The half-open trial under way, if any.
    #[serde(default)]
    pub trial: Option<Trial>,
    /// How many times it opened from closed.
    pub opens: u64,
    /// How many times a failed trial re-opened it.
    #[serde(default)]
    pub reopens: u64,
}

/// Where a breaker is, as the status API shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are deferred until `open_until_ms`.
    Open,
    /// Past `open_until_ms`: a trial decides whether it closes.
    HalfOpen,
}

impl BreakerRecord {
    /// The state this record puts the breaker in at `now`.
    pub fn state(&self, now: SystemTime) -> BreakerState {
        match self.open_until_ms {
            None => BreakerState::Closed,
            Some(u) if at(u) > now => BreakerState::Open,
            Some(_) => BreakerState::HalfOpen,
        }
    }
}

/// What to do with work for the downstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Call the downstream.
    Allow,
    /// Call it as one of the half-open trial's calls (report the result with the trial!).
    Probe {
        /// The trial it belongs to ([`Trial::since_ms`]).
        trial: i64,
    },
    /// Do not call it; come back at this time.
    Defer(SystemTime),
}

/// A change to make to the shared record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Open until this time (only from closed, or re-open after a failed trial).
    Open(SystemTime),
    /// Close.
    // No decision of the product's makes it (a trial closes the breaker through `Judge`);
    // `apply` keeps its meaning for callers of the test bed's public `breaker` module.
    #[cfg_attr(not(test), allow(dead_code))]
    Close,
    /// Take one of the half-open trial's permits (beginning a trial if none runs).
    TakeProbe,
    /// Count a trial call's result; closes or re-opens the breaker once the trial is decided.
    Judge {
        /// The trial the call belonged to (a result for an older trial is ignored).
        trial: i64,
        /// Whether the call succeeded.
        success: bool,
    },
    /// Judge a trial that ran out of time on the results it has.
    Conclude {
        /// The trial.
        trial: i64,
    },
}

fn trial_ends(t: &Trial, config: &BreakerConfig) -> SystemTime {
    at(t.since_ms) + Duration::from_millis(config.probe_timeout_ms)
}

/// What `who` may do at `now` given `record`; `jitter` in [0, 1) spreads deferrals.
pub fn decide(
    record: &BreakerRecord,
    _who: &str,
    now: SystemTime,
    config: &BreakerConfig,
    jitter: f64,
) -> (Admission, Option<Change>) {
    let Some(until_ms) = record.open_until_ms else {
        return (Admission::Allow, None);
    };
    let until = at(until_ms);
    let spread = Duration::from_millis((config.spread_ms as f64 * jitter.clamp(0.0, 1.0)) as u64);
    if now < until {
        return (
            Admission::Defer(until + spread + Duration::from_millis(1)),
            None,
        );
    }
    // Half-open: a trial of `half_open_calls` calls, cluster-wide.
    match &record.trial {
        Some(t) if now < trial_ends(t, config) => {
            if t.admitted < config.half_open_calls.max(1) {
                (
                    Admission::Probe { trial: t.since_ms },
                    Some(Change::TakeProbe),
                )
            } else {
                // Every permit is out: wait for the verdict (or the trial's end).
                (
                    Admission::Defer(trial_ends(t, config) + spread + Duration::from_millis(1)),
                    None,
                )
            }
        }
        Some(t) if t.successes + t.failures > 0 => {
            // Out of time with results: judge on them first (the caller asks again).
            (
                Admission::Defer(now),
                Some(Change::Conclude { trial: t.since_ms }),
            )
        }
        _ => (Admission::Probe { trial: ms(now) }, Some(Change::TakeProbe)),
    }
}

/// The change a result calls for: `consecutive` is the caller's count of transient failures
/// in a row (this one included), `trial` the half-open trial the call was admitted to.
pub fn on_result(
    record: &BreakerRecord,
    success: bool,
    trial: Option<i64>,
    consecutive: u32,
    window: (u32, u32),
    now: SystemTime,
    config: &BreakerConfig,
) -> Option<Change> {
    let open = Duration::from_millis(config.open_ms);
    let (failures, calls) = window;
    let ratio_trips = config.failure_ratio.is_some_and(|r| {
        calls >= config.ratio_window.max(1) && f64::from(failures) >= r * f64::from(calls)
    });
    if let Some(trial) = trial {
        return Some(Change::Judge { trial, success });
    }
    match (record.open_until_ms, success) {
        // Open only on the transition from closed: never extend an open breaker.
        (None, false) if consecutive >= config.consecutive_failures || ratio_trips => {
            Some(Change::Open(now + open))
        }
        _ => None,
    }
}

/// The verdict on a trial's results: `Some(true)` close, `Some(false)` re-open, `None` not
/// yet. `final_` when no more results will come (the trial ran out of time).
fn verdict(t: &Trial, config: &BreakerConfig, final_: bool) -> Option<bool> {
    let n = config.half_open_calls.max(1);
    let needed = config.successes_to_close();
    if t.successes >= needed {
        return Some(true);
    }
    if t.failures > n - needed {
        return Some(false);
    }
    if final_ && t.successes + t.failures > 0 {
        let ratio = f64::from(t.successes) / f64::from(t.successes + t.failures);
        return Some(ratio >= config.half_open_success_ratio);
    }
    None
}

/// Applies `change` to `record` (by `who` at `now`); `None` if it no longer applies.
pub fn apply(
    record: &BreakerRecord,
    change: &Change,
    _who: &str,
    now: SystemTime,
    config: &BreakerConfig,
) -> Option<BreakerRecord> {
    let mut r = record.clone();
    let reopen = |r: &mut BreakerRecord| {
        r.reopens += 1;
        r.open_until_ms = Some(ms(now + Duration::from_millis(config.open_ms)));
        r.trial = None;
    };
    let close = |r: &mut BreakerRecord| {
        r.open_until_ms = None;
        r.opened_at_ms = None;
        r.trial = None;
    };
    match change {
        Change::Open(until) => {
            // From closed, or from half-open after a trial failed; never while open.
            if r.open_until_ms.is_some_and(|u| now < at(u)) {
                return None;
            }
            if r.open_until_ms.is_some() {
                r.reopens += 1; // a failed trial: the breaker was half-open
            } else {
                r.opens += 1;
                r.opened_at_ms = Some(ms(now));
            }
            r.open_until_ms = Some(ms(*until));
            r.trial = None;
        }
        Change::Close => {
            r.open_until_ms?;
            close(&mut r);
        }
        Change::TakeProbe => {
            let until = r.open_until_ms?;
            if now < at(until) {
                return None; // still open
            }
            match &mut r.trial {
                Some(t) if now < trial_ends(t, config) => {
                    if t.admitted >= config.half_open_calls.max(1) {
                        return None; // every permit is out, cluster-wide
                    }
                    t.admitted += 1;
                }
                Some(t) if t.successes + t.failures > 0 => return None, // conclude it first
                _ => {
                    r.trial = Some(Trial {
                        since_ms: ms(now),
                        admitted: 1,
                        successes: 0,
                        failures: 0,
                    })
                }
            }
        }
        Change::Judge { trial, success } => {
            r.open_until_ms?;
            let t = r.trial.as_mut().filter(|t| t.since_ms == *trial)?;
            if *success {
                t.successes += 1;
            } else {
                t.failures += 1;
            }
            let t = t.clone();
            match verdict(&t, config, false) {
                Some(true) => close(&mut r),
                Some(false) => reopen(&mut r),
                None => {}
            }
        }
        Change::Conclude { trial } => {
            r.open_until_ms?;
            let t = r.trial.clone().filter(|t| t.since_ms == *trial)?;
            if now < trial_ends(&t, config) {
                return None;
            }
            match verdict(&t, config, true) {
                Some(true) => close(&mut r),
                Some(false) => reopen(&mut r),
                None => r.trial = None,
            }
        }
    }
    Some(r)
}

/// Why work waits on the breaker at `now`, if it does: open, or half-open while its trial
/// runs or deferred work is still due back (the expiry plus the spread and the trial's time).
/// A half-open breaker past that with no trial under way holds nothing back: the next call
/// begins a trial.
pub fn waiting(record: &BreakerRecord, now: SystemTime, config: &BreakerConfig) -> Option<String> {
    let until = at(record.open_until_ms?);
    let since = record
        .opened_at_ms
        .map(|t| format!(" since {}", rfc3339(at(t))))
        .unwrap_or_default();
    if now < until {
        return Some(format!(
            "open{since} until {} ({} re-opens): work for it is deferred",
            rfc3339(until),
            record.reopens
        ));
    }
    let back_by = until + Duration::from_millis(config.spread_ms + config.probe_timeout_ms);
    match &record.trial {
        Some(t) if now < trial_ends(t, config) => Some(format!(
            "half-open{since}: judging {} of {} trial calls ({} succeeded, {} failed; {} successes close it)",
            t.admitted,
            config.half_open_calls.max(1),
            t.successes,
            t.failures,
            config.successes_to_close()
        )),
        _ if now < back_by => Some(format!(
            "half-open{since}: deferred work is due back by {}",
            rfc3339(back_by)
        )),
        _ => None,
    }
}
