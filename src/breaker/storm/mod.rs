//! The dead-letter storm guard: one per downstream, its state shared by every replica in
//! blob storage with compare-and-swap, beside the downstream's circuit breaker.
//!
//! A receiver that refuses everything for good (a bad deploy answering 400, 410 or 422 to
//! every event) does not trip the breaker — a permanent refusal is an answer, not an outage —
//! so without the guard every event would be dead-lettered as fast as it is read. The guard
//! counts, per replica and over `window_ms`, the attempts that would end in a dead letter
//! (permanent refusals and exhausted retries) among the attempts that end their event
//! (delivered or refused; a transient failure is the breaker's business, and one counted
//! here would dilute the refusals of a receiver that was down before its bad deploy came
//! up); each such *refusal* is
//! reported through the shared record before its dead letter is written. Once the refusals
//! counted cluster-wide within the window reach `min_refusals` and make up at least `share`
//! of the attempts, the guard **holds**: the refusal that tripped it and every later one are
//! not dead-lettered but wait (a partition waits where it is, as with an open breaker, and
//! nothing checkpoints past it; a due retry is deferred without counting an attempt), and new
//! events are not attempted. So at most `min_refusals - 1` refusals are dead-lettered before
//! the guard holds, whatever the number of replicas (each report is a compare-and-swap on the
//! one record, counted before its verdict).
//!
//! Held, the guard lets **one trial** event through every `trial_every_ms`, cluster-wide (a
//! permit taken with compare-and-swap): delivered, the guard releases itself and everything
//! held is attempted again; refused again, it stays held until the next trial. An operator
//! can release it (`hubguard storm-guard release`: attempt again, counting afresh), accept
//! the refusals as real for a while (`storm-guard accept --for 30m`: refusals are
//! dead-lettered and never trip it meanwhile) or hold it by hand (`storm-guard hold`: no trial
//! releases it); every such change is written with the operator's name and logged.
//!
//! [`decide`], [`on_refusal`] and [`apply`] are pure functions of the record, the time and
//! the settings; [`Guard`] keeps the record in a [`RecordStore`](crate::azure::RecordStore).

mod config;
mod shared;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::clock::{at, ms, rfc3339};

pub use config::{StormGuardConfig, StormGuardConfigError, StormGuardType};
#[allow(unused_imports)]
pub use shared::{
    lane_record_name, operate, read, read_lane, record_name, Counted, Guard, StormGate,
    StormVerdict,
};

/// One replica's counts over the window, as it last reported them with a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Counts {
    /// Attempts that ended their event within the window (delivered or refused).
    pub attempts: u32,
    /// Of those, refusals: attempts whose settlement would dead-letter the event.
    pub refusals: u32,
    /// When the replica counted them.
    pub at_ms: i64,
}

/// Why and since when the guard holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    /// Since when.
    pub since_ms: i64,
    /// Refusals counted cluster-wide within the window when it tripped.
    pub refusals: u32,
    /// Attempts counted cluster-wide within the window when it tripped.
    pub attempts: u32,
    /// The operator who held it by hand (`None`: the refusals tripped it). A hold by hand is
    /// never released by a trial.
    #[serde(default)]
    pub by: Option<String>,
    /// The operator's reason, for a hold by hand.
    #[serde(default)]
    pub reason: Option<String>,
}

/// The last change an operator made, as the record keeps it (the audit trail's latest line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    /// `release`, `accept` or `hold`.
    pub action: String,
    /// Who.
    pub by: String,
    /// When.
    pub at_ms: i64,
    /// Why, if they said.
    #[serde(default)]
    pub reason: Option<String>,
}

/// The shared record of one downstream's storm guard.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StormRecord {
    /// Per replica: its counts over the window, as last reported.
    #[serde(default)]
    pub counts: BTreeMap<String, Counts>,
    /// `Some`: the guard holds.
    #[serde(default)]
    pub holding: Option<Holding>,
    /// The current trial: when its one event was let through (`None`: none under way).
    #[serde(default)]
    pub trial_ms: Option<i64>,
    /// Until when an operator accepted the refusals as real (dead-lettered, never tripping).
    #[serde(default)]
    pub accepted_until_ms: Option<i64>,
    /// How many times it began holding.
    #[serde(default)]
    pub holds: u64,
    /// Refusals held instead of dead-lettered, cluster-wide.
    #[serde(default)]
    pub held_refusals: u64,
    /// The last operator's change.
    #[serde(default)]
    pub last_action: Option<Audit>,
}

/// Where a guard is, as the status API shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StormState {
    /// Refusals are dead-lettered; the guard counts them.
    Watching,
    /// Refusals and new work wait; trials decide.
    Holding,
    /// An operator accepted the refusals as real: dead-lettered, never tripping.
    Accepted,
}

impl StormRecord {
    /// The state this record puts the guard in at `now`.
    pub fn state(&self, now: SystemTime) -> StormState {
        if self.holding.is_some() {
            StormState::Holding
        } else if self.accepted(now) {
            StormState::Accepted
        } else {
            StormState::Watching
        }
    }

    /// Whether an operator's acceptance is in force at `now`.
    pub fn accepted(&self, now: SystemTime) -> bool {
        self.accepted_until_ms.is_some_and(|u| now < at(u))
    }

    /// The counts of every replica that reported within the window, summed.
    pub fn totals(&self, now: SystemTime, config: &StormGuardConfig) -> (u32, u32) {
        let oldest = ms(now) - config.window_ms as i64;
        self.counts
            .values()
            .filter(|c| c.at_ms >= oldest)
            .fold((0, 0), |(a, r), c| (a + c.attempts, r + c.refusals))
    }

    /// When the next trial may begin (`None`: not holding, or held by hand).
    pub fn next_trial(&self, config: &StormGuardConfig) -> Option<SystemTime> {
        let h = self.holding.as_ref().filter(|h| h.by.is_none())?;
        let from = self.trial_ms.unwrap_or(h.since_ms).max(h.since_ms);
        Some(at(from) + Duration::from_millis(config.trial_every_ms))
    }
}

/// What work for the downstream may do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StormAdmission {
    /// Go on.
    Allow,
    /// Wait: ask again at this time (or when the record changes). With a
    /// [`StormChange::TakeTrial`] beside it: take the trial's permit, and go on as the trial
    /// if it is won.
    Wait(SystemTime),
}

/// A change to the shared record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StormChange {
    /// A replica reports a refusal with its counts over the window; trips the guard when the
    /// totals pass the threshold.
    Refused {
        /// The replica.
        who: String,
        /// Its counts, this refusal included.
        counts: Counts,
        /// The trial the refused event was, if it was one.
        trial: Option<i64>,
    },
    /// Take the trial's permit (the one event let through).
    TakeTrial,
    /// The trial's event was delivered: release.
    Delivered {
        /// The trial.
        trial: i64,
    },
    /// An operator releases the guard: held work is attempted again, counted afresh.
    // Made by the operator's command line (`hubguard storm-guard`) and tests.
    #[cfg_attr(not(any(test, feature = "cli")), allow(dead_code))]
    Release {
        /// Who.
        by: String,
        /// Why.
        reason: Option<String>,
    },
    /// An operator accepts the refusals as real until then: released, and refusals are
    /// dead-lettered without tripping it.
    // Made by the operator's command line (`hubguard storm-guard`) and tests.
    #[cfg_attr(not(any(test, feature = "cli")), allow(dead_code))]
    Accept {
        /// Who.
        by: String,
        /// Until when.
        until: SystemTime,
        /// Why.
        reason: Option<String>,
    },
    /// An operator holds the guard by hand until released.
    // Made by the operator's command line (`hubguard storm-guard`) and tests.
    #[cfg_attr(not(any(test, feature = "cli")), allow(dead_code))]
    Hold {
        /// Who.
        by: String,
        /// Why.
        reason: Option<String>,
    },
}

/// What becomes of a refusal once reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalVerdict {
    /// Dead-letter it, as always.
    DeadLetter,
    /// Hold it: the guard holds.
    Hold,
}

/// What work may do at `now` given `record`; `jitter` in [0, 1) spreads the waits of held
/// work over a second so it does not ask all at once.
pub fn decide(
    record: &StormRecord,
    now: SystemTime,
    config: &StormGuardConfig,
    jitter: f64,
) -> (StormAdmission, Option<StormChange>) {
    if record.holding.is_none() {
        return (StormAdmission::Allow, None);
    }
    let spread = Duration::from_millis((jitter.clamp(0.0, 1.0) * 1000.0) as u64);
    match record.next_trial(config) {
        Some(next) if now >= next => (StormAdmission::Wait(now), Some(StormChange::TakeTrial)),
        Some(next) => (StormAdmission::Wait(next + spread), None),
        // Held by hand: look again now and then (an operator's release comes any time).
        None => (
            StormAdmission::Wait(now + Duration::from_millis(config.trial_every_ms) + spread),
            None,
        ),
    }
}

/// Until when a held retry is deferred at `now` (refused while the guard holds, or meeting
/// it): past the next trial, and by as long as the guard has held so far — at least one trial
/// interval, at most `held_retry_defer_max_ms` — scaled by `jitter` in [0, 1) to 75–100 % so
/// the held retries do not all come back at once. So a retry held for an hour is sent back a
/// few dozen times (15, 30, 60, 120 s, then every 2 minutes by default), not once per trial,
/// and is attempted at most `held_retry_defer_max_ms` after the guard releases. Never counts
/// an attempt (the caller defers, it does not settle).
pub fn held_retry_until(
    record: &StormRecord,
    now: SystemTime,
    config: &StormGuardConfig,
    jitter: f64,
) -> SystemTime {
    let every = Duration::from_millis(config.trial_every_ms);
    let cap = Duration::from_millis(config.held_retry_defer_max_ms).max(every);
    let held_for = record
        .holding
        .as_ref()
        .map(|h| now.duration_since(at(h.since_ms)).unwrap_or_default())
        .unwrap_or_default();
    let grown = held_for.clamp(every, cap);
    let spread = grown.mul_f64(0.75 + 0.25 * jitter.clamp(0.0, 1.0));
    let next_trial = record.next_trial(config).unwrap_or(now).min(now + cap);
    (now + spread).max(next_trial)
}

/// The verdict on a refusal given the record after its report was applied.
pub fn on_refusal(after: &StormRecord, now: SystemTime) -> RefusalVerdict {
    if after.holding.is_some() && !after.accepted(now) {
        RefusalVerdict::Hold
    } else {
        RefusalVerdict::DeadLetter
    }
}

/// `record` with `change` made by `who` at `now`; `None` when it does not apply (a trial
/// permit already taken, a late result of an earlier trial, nothing to release).
pub fn apply(
    record: &StormRecord,
    change: &StormChange,
    now: SystemTime,
    config: &StormGuardConfig,
) -> Option<StormRecord> {
    let mut r = record.clone();
    let oldest = ms(now) - config.window_ms as i64;
    r.counts.retain(|_, c| c.at_ms >= oldest);
    if r.accepted_until_ms.is_some() && !r.accepted(now) {
        r.accepted_until_ms = None;
    }
    match change {
        StormChange::Refused { who, counts, trial } => {
            r.counts.insert(who.clone(), *counts);
            if r.holding.is_some() {
                if trial.is_some() && *trial == r.trial_ms {
                    // The trial's event was refused again: the next trial in `trial_every_ms`.
                    r.trial_ms = Some(ms(now));
                }
                r.held_refusals += 1;
                return Some(r);
            }
            let (attempts, refusals) = r.totals(now, config);
            let trips = !r.accepted(now)
                && refusals >= config.min_refusals
                && f64::from(refusals) >= config.share * f64::from(attempts.max(1));
            if trips {
                r.holding = Some(Holding {
                    since_ms: ms(now),
                    refusals,
                    attempts,
                    by: None,
                    reason: None,
                });
                r.trial_ms = None;
                r.holds += 1;
                r.held_refusals += 1;
            }
            Some(r)
        }
        StormChange::TakeTrial => {
            let next = r.next_trial(config)?;
            if now < next {
                return None;
            }
            r.trial_ms = Some(ms(now));
            Some(r)
        }
        StormChange::Delivered { trial } => {
            if r.holding.as_ref().is_none_or(|h| h.by.is_some()) || r.trial_ms != Some(*trial) {
                return None;
            }
            r.holding = None;
            r.trial_ms = None;
            r.counts.clear();
            Some(r)
        }
        StormChange::Release { by, reason } => {
            r.holding.as_ref()?;
            r.holding = None;
            r.trial_ms = None;
            r.counts.clear();
            r.last_action = Some(audit("release", by, now, reason));
            Some(r)
        }
        StormChange::Accept { by, until, reason } => {
            r.holding = None;
            r.trial_ms = None;
            r.counts.clear();
            r.accepted_until_ms = Some(ms(*until));
            r.last_action = Some(audit("accept", by, now, reason));
            Some(r)
        }
        StormChange::Hold { by, reason } => {
            let (attempts, refusals) = r.totals(now, config);
            r.holding = Some(Holding {
                since_ms: ms(now),
                refusals,
                attempts,
                by: Some(by.clone()),
                reason: reason.clone(),
            });
            r.trial_ms = None;
            r.accepted_until_ms = None;
            r.holds += 1;
            r.last_action = Some(audit("hold", by, now, reason));
            Some(r)
        }
    }
}

fn audit(action: &str, by: &str, now: SystemTime, reason: &Option<String>) -> Audit {
    Audit {
        action: action.into(),
        by: by.into(),
        at_ms: ms(now),
        reason: reason.clone(),
    }
}

/// Why work waits on the guard now (`None`: it does not), for readiness and the status API.
pub fn waiting(record: &StormRecord, config: &StormGuardConfig) -> Option<String> {
    let h = record.holding.as_ref()?;
    let since = rfc3339(at(h.since_ms));
    Some(match (&h.by, record.next_trial(config)) {
        (Some(by), _) => format!(
            "storm guard held by {by} since {since}{}: nothing is dead-lettered, new events wait (hubguard storm-guard release|accept)",
            h.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        ),
        (None, next) => format!(
            "storm guard holding since {since}: {} of {} attempts within {} s were refused for good (at least {} and {:.0} % trip it); {} refusals held instead of dead-lettered, new events wait; next trial at {} (hubguard storm-guard release|accept)",
            h.refusals,
            h.attempts,
            config.window_ms / 1000,
            config.min_refusals,
            config.share * 100.0,
            record.held_refusals,
            next.map(rfc3339).unwrap_or_default(),
        ),
    })
}
