//! The circuit breaker: one per downstream, its state shared by every replica in
//! blob storage with compare-and-swap.
//!
//! - Opened **once**, on the transition from closed, when a replica sees
//!   `consecutive_failures` transient failures in a row; its expiry is never extended by work
//!   that lands on it while it is open.
//! - Work that meets an open breaker is **deferred** to after the expiry, spread over a
//!   window (jitter) so that it does not come back all at once; deferral counts no attempt
//!   and does not touch the breaker.
//! - After the expiry the breaker is half-open and runs a **trial**: it lets through
//!   `half_open_calls` calls cluster-wide (each permit is taken with compare-and-swap on the
//!   shared record, so replicas together never exceed it), and judges their results, as
//!   Resilience4j's `permittedNumberOfCallsInHalfOpenState` does: once
//!   `ceil(half_open_success_ratio × half_open_calls)` of them succeeded it closes; as soon as
//!   so many failed that the ratio can no longer be reached it re-opens, once, with a fresh
//!   expiry. One event's own failure (a first attempt that fails by itself) therefore does not
//!   keep a healthy downstream closed off. With `half_open_calls = 1` this is the classic
//!   single probe. A trial whose calls do not all report back within `probe_timeout` is
//!   judged on the results it has (none: a fresh trial begins).
//! - Closed or half-open, a replica **paces new events at the brink**: when one more failure
//!   would trip it (failures in a row plus new events' calls in flight), a new event waits up to
//!   `brink_hold_ms` for any call to succeed first ([`Shared::admit_new`]); retries are never
//!   held. A success (a due retry the downstream serves) lets it go on; a downstream that is
//!   down still trips the breaker, at most that much later.
//!
//! The permits bound: per trial, at most `half_open_calls` calls are admitted cluster-wide
//! (each is a compare-and-swap increment on the one record). A trial that runs out of time
//! is followed by a fresh one, so across trials the bound is `half_open_calls` per
//! `probe_timeout_ms` of half-open time; a replica whose storage calls fail admits its calls
//! (the breaker must not become an outage of its own), which the bound does not cover.
//!
//! [`decide`] and [`on_result`] are pure functions of the record and the time; [`Shared`]
//! keeps the record in a [`RecordStore`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::azure::{RecordStore, StoreError};
use crate::clock::{at, ms, rfc3339};

/// Breaker settings. It trips on `consecutive_failures` transient failures in a row, or (when
/// `failure_ratio` is set) when that share of the last `ratio_window` calls failed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Whether the breaker is used at all.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Consecutive transient failures that open it.
    #[serde(default = "d5")]
    pub consecutive_failures: u32,
    /// Trip also when this share (0–1) of the last `ratio_window` calls failed.
    #[serde(default)]
    pub failure_ratio: Option<f64>,
    /// Calls the failure ratio is computed over.
    #[serde(default = "d20")]
    pub ratio_window: u32,
    /// How long it stays open (ms).
    #[serde(default = "d30000")]
    pub open_ms: u64,
    /// Deferred work returns spread over this window after the expiry (ms).
    #[serde(default = "d10000")]
    pub spread_ms: u64,
    /// A half-open trial whose calls do not all report back within this is judged on what
    /// did report (ms).
    #[serde(default = "d30000")]
    pub probe_timeout_ms: u64,
    /// Calls a half-open breaker lets through, cluster-wide, to judge the downstream.
    #[serde(default = "d10")]
    pub half_open_calls: u32,
    /// The share (0–1] of those calls that must succeed for it to close.
    #[serde(default = "half")]
    pub half_open_success_ratio: f64,
    /// At the brink — one failure short of `consecutive_failures` in a row, counting new
    /// events' calls in flight — a new event from a partition waits up to this long (ms) for a
    /// call to succeed before it makes the call that may trip the breaker (0: never waits).
    #[serde(default = "d10000")]
    pub brink_hold_ms: u64,
}

fn yes() -> bool {
    true
}

fn d20() -> u32 {
    20
}

fn d10() -> u32 {
    10
}

fn half() -> f64 {
    0.5
}

fn d5() -> u32 {
    5
}
fn d30000() -> u64 {
    30_000
}
fn d10000() -> u64 {
    10_000
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            consecutive_failures: 5,
            failure_ratio: None,
            ratio_window: 20,
            open_ms: 30_000,
            spread_ms: 10_000,
            probe_timeout_ms: 30_000,
            half_open_calls: 10,
            half_open_success_ratio: 0.5,
            brink_hold_ms: 10_000,
        }
    }
}

impl BreakerConfig {
    /// Successes of a half-open trial that close the breaker: at least one, at most all.
    pub fn successes_to_close(&self) -> u32 {
        let n = self.half_open_calls.max(1);
        ((self.half_open_success_ratio * f64::from(n)).ceil() as u32).clamp(1, n)
    }

    /// Checks the settings; the error names the key and what is allowed.
    pub fn validate(&self) -> Result<(), BreakerConfigError> {
        if self.half_open_calls == 0 {
            return Err(BreakerConfigError::NoTrialCalls);
        }
        if !(self.half_open_success_ratio > 0.0 && self.half_open_success_ratio <= 1.0) {
            return Err(BreakerConfigError::SuccessRatio(
                self.half_open_success_ratio,
            ));
        }
        Ok(())
    }
}

/// A breaker setting out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BreakerConfigError {
    /// A half-open trial lets no call through.
    #[error("breaker.half_open_calls must be at least 1")]
    NoTrialCalls,
    /// The share of a trial's calls that must succeed is not in (0, 1].
    #[error("breaker.half_open_success_ratio must be above 0 and at most 1, got {0}")]
    SuccessRatio(f64),
}

impl BreakerConfigError {
    /// The configuration key of the setting.
    pub fn key(&self) -> &'static str {
        match self {
            Self::NoTrialCalls => "breaker.half_open_calls",
            Self::SuccessRatio(_) => "breaker.half_open_success_ratio",
        }
    }
}

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
    #[cfg_attr(not(feature = "testbed"), allow(dead_code))]
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

/// One downstream's breaker as one replica sees it.
pub struct Shared {
    store: Arc<dyn RecordStore>,
    key: String,
    who: String,
    config: BreakerConfig,
    consecutive: Mutex<u32>,
    /// New events' calls started and not reported yet ([`Shared::admit_new`]).
    new_in_flight: Mutex<u32>,
    /// A new event waited at the brink and no new event's call has succeeded since: a
    /// success of something else (a due retry) then releases only as many new events as
    /// cannot make a run of failures, not every one that waits.
    pacing: std::sync::atomic::AtomicBool,
    /// Woken by every success and every change this replica makes to the record.
    succeeded: tokio::sync::Notify,
    recent: Mutex<std::collections::VecDeque<bool>>,
    /// The record, its ETag (`None`: no record yet, i.e. closed) and when it was read.
    cached: Mutex<Option<(BreakerRecord, Option<String>, SystemTime)>>,
    refresh: Duration,
    clock: Arc<crate::clock::Clock>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// Where the breaker of `downstream` is kept in the record store.
pub fn record_name(downstream: &str) -> String {
    format!("breakers/{downstream}")
}

/// The breaker record of `downstream` as kept in `store` (`None`: it never opened). A body
/// that does not parse reads as a closed breaker, as [`Shared`] reads it.
#[cfg(any(test, feature = "testbed"))]
pub async fn read(
    store: &dyn RecordStore,
    downstream: &str,
) -> Result<Option<BreakerRecord>, StoreError> {
    Ok(store
        .read(&record_name(downstream))
        .await?
        .map(|r| serde_json::from_slice(&r.body).unwrap_or_default()))
}

impl Shared {
    /// The breaker of `downstream`, shared through `store`, seen by replica `who`.
    pub fn new(
        store: Arc<dyn RecordStore>,
        downstream: &str,
        who: &str,
        config: BreakerConfig,
    ) -> Self {
        Self {
            store,
            key: record_name(downstream),
            who: who.into(),
            config,
            consecutive: Mutex::new(0),
            new_in_flight: Mutex::new(0),
            pacing: std::sync::atomic::AtomicBool::new(false),
            succeeded: tokio::sync::Notify::new(),
            recent: Mutex::default(),
            cached: Mutex::new(None),
            refresh: Duration::from_millis(500),
            clock: Arc::default(),
        }
    }

    /// Reads expiry, probe age and jittered deferrals on `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Arc<crate::clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    async fn load(&self, fresh: bool) -> Result<(BreakerRecord, Option<String>), StoreError> {
        if !fresh {
            if let Some((r, e, t)) = self
                .cached
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
            {
                if self.clock.now().duration_since(t).unwrap_or_default() < self.refresh {
                    return Ok((r, e));
                }
            }
        }
        match self.store.read(&self.key).await? {
            Some(rec) => {
                let r: BreakerRecord = serde_json::from_slice(&rec.body).unwrap_or_default();
                *self.cached.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((r.clone(), Some(rec.etag.clone()), self.clock.now()));
                Ok((r, Some(rec.etag)))
            }
            None => {
                // Never opened: remember that too, or every call would read storage.
                *self.cached.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((BreakerRecord::default(), None, self.clock.now()));
                Ok((BreakerRecord::default(), None))
            }
        }
    }

    /// Applies `change` with compare-and-swap: the record after it, and whether this call's
    /// change was written (`false`: it no longer applied to the record as it now is).
    async fn change(&self, change: Change, who: &str) -> Result<(BreakerRecord, bool), StoreError> {
        for _ in 0..8 {
            let (current, etag) = self.load(true).await?;
            let now = self.clock.now();
            let Some(next) = apply(&current, &change, who, now, &self.config) else {
                return Ok((current, false));
            };
            let body = Bytes::from(serde_json::to_vec(&next).unwrap_or_default());
            let written = match &etag {
                None => self.store.create(&self.key, body).await,
                Some(e) => self.store.update(&self.key, body, e).await,
            };
            match written {
                Ok(e) => {
                    *self.cached.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some((next.clone(), Some(e), now));
                    // New events held at the brink look again (an open breaker decides).
                    self.succeeded.notify_waiters();
                    return Ok((next, true));
                }
                Err(StoreError::Conflict) => continue,
                Err(err) => return Err(err),
            }
        }
        Err(StoreError::Conflict)
    }

    /// Whether work may call the downstream now. Storage trouble admits the call (the
    /// breaker protects the downstream; it must not become an outage of its own).
    pub async fn admit(&self, jitter: f64) -> Admission {
        let Ok((mut record, _)) = self.load(false).await else {
            return Admission::Allow;
        };
        // A few rounds: concluding a timed-out trial, or losing a permit to another caller,
        // is followed by a decision on the record as it now is.
        for _ in 0..4 {
            let now = self.clock.now();
            let (admission, change) = decide(&record, &self.who, now, &self.config, jitter);
            let Some(c) = change else {
                return admission;
            };
            let taking = c == Change::TakeProbe;
            match self.change(c, &self.who).await {
                // Won a permit of the trial: report the result with the trial it belongs to.
                Ok((r, true)) if taking => {
                    return match &r.trial {
                        Some(t) => Admission::Probe { trial: t.since_ms },
                        None => Admission::Allow,
                    }
                }
                Ok((r, _)) => record = r,
                // Contended: others are changing the record (taking permits); ask again.
                Err(StoreError::Conflict) => match self.load(true).await {
                    Ok((r, _)) => record = r,
                    Err(_) => return Admission::Allow,
                },
                Err(_) => return Admission::Allow,
            }
        }
        // Still contended: wait for the trial's verdict.
        Admission::Defer(self.clock.now() + Duration::from_millis(self.config.probe_timeout_ms))
    }

    /// Counts a new event's call in flight unless it could make `consecutive_failures`
    /// failures in a row (the failures so far plus new events' calls still in flight) on a
    /// closed breaker; `false` (nothing counted) at the brink. Checked and counted under one
    /// lock, so of new events released together only as many go as cannot trip it.
    fn enter_unless_at_brink(&self) -> bool {
        // Closed or half-open (a trial's permits are better spent on work with a chance of
        // success than on new events behind a run of failures); open, the breaker decides.
        let open = self
            .cached()
            .and_then(|r| r.open_until_ms)
            .is_some_and(|u| self.clock.now() < at(u));
        let mut in_flight = self.new_in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let consecutive = *self.consecutive.lock().unwrap_or_else(|p| p.into_inner());
        // Behind a run of failures, or pacing since one (a success of a retry resets the run,
        // while new events, released together, may each fail once more).
        let run = consecutive > 0 || self.pacing.load(std::sync::atomic::Ordering::SeqCst);
        let brink =
            !open && run && consecutive + *in_flight + 1 >= self.config.consecutive_failures;
        if !brink {
            *in_flight += 1;
        }
        !brink
    }

    /// [`admit`](Self::admit) for a new event (a first attempt from a partition): at the brink
    /// it first waits, up to `brink_hold_ms`, for a call to succeed — a due retry that
    /// succeeds proves the downstream serves, and new events go on at the pace successes
    /// come — then asks the breaker. A downstream that refuses each new key once but serves
    /// its retries is paced, not shut off; one that is down trips the breaker as before, at
    /// most `brink_hold_ms` later. Report the result with `new = true`.
    pub async fn admit_new(&self, jitter: f64) -> Admission {
        let hold = Duration::from_millis(self.config.brink_hold_ms);
        let held = self.clock.sleep(hold);
        tokio::pin!(held);
        loop {
            let notified = self.succeeded.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if hold.is_zero() {
                *self.new_in_flight.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                break;
            }
            if self.enter_unless_at_brink() {
                break;
            }
            self.pacing.store(true, std::sync::atomic::Ordering::SeqCst);
            tokio::select! {
                _ = notified => {}
                _ = &mut held => {
                    *self.new_in_flight.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                    break;
                }
            }
        }
        let admission = self.admit(jitter).await;
        if matches!(admission, Admission::Defer(_)) {
            self.new_call_done();
        }
        admission
    }

    fn new_call_done(&self) {
        let mut n = self.new_in_flight.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
    }

    /// [`report`](Self::report) for a call admitted by [`admit_new`](Self::admit_new).
    pub async fn report_new(&self, success: bool, trial: Option<i64>) -> Option<BreakerRecord> {
        // Counted as in flight until its failure (if it is one) is counted: never neither.
        let r = self.report(success, trial).await;
        self.new_call_done();
        if success {
            // New events are served again: pacing ends.
            self.pacing
                .store(false, std::sync::atomic::Ordering::SeqCst);
            self.succeeded.notify_waiters();
        }
        r
    }

    /// Reports a call's result (`success` false for a transient failure; permanent errors are
    /// the event's fault, not the downstream's: do not report them). `trial`: the half-open
    /// trial the call was admitted to ([`Admission::Probe`]).
    pub async fn report(&self, success: bool, trial: Option<i64>) -> Option<BreakerRecord> {
        let consecutive = {
            let mut c = self.consecutive.lock().unwrap_or_else(|p| p.into_inner());
            *c = if success { 0 } else { *c + 1 };
            *c
        };
        if success {
            // New events held at the brink may go on.
            self.succeeded.notify_waiters();
        }
        let (record, _) = self.load(false).await.ok()?;
        let window = {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            recent.push_back(!success);
            while recent.len() > self.config.ratio_window.max(1) as usize {
                recent.pop_front();
            }
            (
                recent.iter().filter(|f| **f).count() as u32,
                recent.len() as u32,
            )
        };
        let change = on_result(
            &record,
            success,
            trial,
            consecutive,
            window,
            self.clock.now(),
            &self.config,
        )?;
        let who = self.who.clone();
        let (r, _) = self.change(change, &who).await.ok()?;
        if success {
            *self.consecutive.lock().unwrap_or_else(|p| p.into_inner()) = 0;
        }
        Some(r)
    }

    /// Why work waits on this breaker now, as last seen (see [`waiting`]); `None` when
    /// nothing does.
    pub fn waiting(&self) -> Option<String> {
        let record = self.cached()?;
        waiting(&record, self.clock.now(), &self.config)
            .map(|w| format!("downstream {} breaker {w}", self.downstream()))
    }

    /// The downstream's name.
    pub fn downstream(&self) -> &str {
        self.key.trim_start_matches(&record_name(""))
    }

    /// How long the breaker has been open, as last seen (zero when closed).
    pub fn open_for(&self) -> Duration {
        self.cached()
            .and_then(|r| r.opened_at_ms)
            .and_then(|t| self.clock.now().duration_since(at(t)).ok())
            .unwrap_or_default()
    }

    /// The breaker's state now (on its clock), as last seen.
    pub fn state(&self) -> BreakerState {
        self.cached().unwrap_or_default().state(self.clock.now())
    }

    /// The record as last seen.
    pub fn cached(&self) -> Option<BreakerRecord> {
        self.cached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(r, _, _)| r.clone())
    }
}

impl crate::telemetry::gauges::BreakerReadings for Shared {
    fn downstream_name(&self) -> String {
        self.downstream().to_string()
    }

    fn open_for(&self) -> Duration {
        Shared::open_for(self)
    }

    fn opens(&self) -> u64 {
        self.cached().map_or(0, |r| r.opens)
    }

    fn open_duration(&self) -> Duration {
        Duration::from_millis(self.config.open_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            consecutive_failures: 3,
            failure_ratio: None,
            ratio_window: 20,
            open_ms: 60_000,
            spread_ms: 10_000,
            probe_timeout_ms: 5_000,
            half_open_calls: 1,
            half_open_success_ratio: 1.0,
            brink_hold_ms: 10_000,
        }
    }

    fn trial(n: u32, ratio: f64) -> BreakerConfig {
        BreakerConfig {
            half_open_calls: n,
            half_open_success_ratio: ratio,
            ..cfg()
        }
    }

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn open_at_0(c: &BreakerConfig) -> BreakerRecord {
        apply(
            &BreakerRecord::default(),
            &Change::Open(t(60)),
            "a",
            t(0),
            c,
        )
        .unwrap()
    }

    /// Takes a permit at `now` the way [`Shared::admit`] does: decide, then apply.
    fn take(r: &BreakerRecord, now: SystemTime, c: &BreakerConfig) -> Option<(BreakerRecord, i64)> {
        match decide(r, "x", now, c, 0.0) {
            (Admission::Probe { .. }, Some(ch)) => {
                let next = apply(r, &ch, "x", now, c)?;
                let id = next.trial.as_ref()?.since_ms;
                Some((next, id))
            }
            _ => None,
        }
    }

    #[test]
    fn opens_once_on_the_threshold_and_never_extends() {
        let c = cfg();
        let closed = BreakerRecord::default();
        assert_eq!(on_result(&closed, false, None, 2, (0, 0), t(0), &c), None);
        let Some(change) = on_result(&closed, false, None, 3, (0, 0), t(0), &c) else {
            panic!("opens")
        };
        let open = apply(&closed, &change, "a", t(0), &c).unwrap();
        assert_eq!((open.open_until_ms, open.opens), (Some(ms(t(60))), 1));
        // Failures landing on the open breaker (or another replica's threshold) change nothing.
        assert_eq!(on_result(&open, false, None, 9, (0, 0), t(30), &c), None);
        assert_eq!(
            apply(&open, &Change::Open(t(90)), "b", t(30), &c),
            None,
            "never extended while open"
        );
    }

    #[test]
    fn open_defers_past_the_expiry_with_spread_and_one_probe_after() {
        let c = cfg();
        let open = open_at_0(&c);
        let (a, ch) = decide(&open, "x", t(10), &c, 0.5);
        assert_eq!(a, Admission::Defer(t(65) + Duration::from_millis(1)));
        assert_eq!(ch, None, "deferral does not touch the breaker");
        let (a0, _) = decide(&open, "x", t(10), &c, 0.0);
        let (a1, _) = decide(&open, "x", t(10), &c, 0.999);
        assert!(
            matches!((a0, a1), (Admission::Defer(x), Admission::Defer(y)) if x >= t(60) && y > x),
            "spread"
        );
        // Half-open with one permitted call: the first to ask takes it; everyone else waits.
        let (probing, id) = take(&open, t(61), &c).expect("the probe");
        assert_eq!(id, ms(t(61)));
        assert!(matches!(
            decide(&probing, "y", t(62), &c, 0.0).0,
            Admission::Defer(_)
        ));
        assert_eq!(
            apply(&probing, &Change::TakeProbe, "y", t(62), &c),
            None,
            "one probe at a time"
        );
        assert_eq!(
            apply(&open, &Change::TakeProbe, "y", t(30), &c),
            None,
            "no probe while open"
        );
        // A probe that never reports back is given up: a fresh trial.
        let (_, later) = take(&probing, t(67), &c).expect("a fresh trial");
        assert_eq!(later, ms(t(67)));
    }

    #[test]
    fn a_failure_ratio_over_the_window_trips_it_too() {
        let c = BreakerConfig {
            failure_ratio: Some(0.5),
            ratio_window: 10,
            ..cfg()
        };
        let closed = BreakerRecord::default();
        // Alternating failures never make 3 in a row, but half of the last 10 failed.
        assert_eq!(
            on_result(&closed, false, None, 1, (4, 9), t(0), &c),
            None,
            "window not full"
        );
        assert!(matches!(
            on_result(&closed, false, None, 1, (5, 10), t(0), &c),
            Some(Change::Open(_))
        ));
        assert_eq!(on_result(&closed, false, None, 1, (4, 10), t(0), &c), None);
        assert_eq!(
            on_result(&closed, false, None, 1, (9, 10), t(0), &cfg()),
            None,
            "off unless configured"
        );
    }

    #[test]
    fn probe_success_closes_failure_reopens_once() {
        let c = cfg();
        let open = open_at_0(&c);
        let (probing, id) = take(&open, t(61), &c).unwrap();
        let judge = |success| on_result(&probing, success, Some(id), 0, (0, 0), t(62), &c).unwrap();
        let closed = apply(&probing, &judge(true), "x", t(62), &c).unwrap();
        assert_eq!(closed.open_until_ms, None);
        let reopened = apply(&probing, &judge(false), "x", t(62), &c).unwrap();
        assert_eq!(
            (reopened.open_until_ms, reopened.opens, reopened.reopens),
            (Some(ms(t(122))), 1, 1)
        );
        assert_eq!(
            reopened.opened_at_ms,
            Some(ms(t(0))),
            "the age counts from the first opening"
        );
    }

    #[test]
    fn a_trial_judges_several_calls_so_one_events_own_failure_does_not_reopen_it() {
        // Resilience4j's defaults: 10 calls, half of them must succeed.
        let c = trial(10, 0.5);
        assert_eq!(c.successes_to_close(), 5);
        let mut r = open_at_0(&c);
        let mut ids = Vec::new();
        for i in 0..10 {
            let (next, id) = take(&r, t(61) + Duration::from_millis(i), &c).expect("a permit");
            r = next;
            ids.push(id);
        }
        assert!(ids.iter().all(|i| *i == ids[0]), "one trial: {ids:?}");
        assert_eq!(take(&r, t(62), &c), None, "ten permits, no more");
        assert!(matches!(
            decide(&r, "y", t(62), &c, 0.0).0,
            Admission::Defer(_)
        ));
        // Four first attempts fail by themselves: still half-open.
        let judge = |r: &BreakerRecord, ok: bool| {
            apply(
                r,
                &Change::Judge {
                    trial: ids[0],
                    success: ok,
                },
                "x",
                t(63),
                &c,
            )
            .unwrap()
        };
        for _ in 0..4 {
            r = judge(&r, false);
        }
        assert!(r.open_until_ms.is_some() && r.trial.is_some(), "{r:?}");
        assert_eq!(r.reopens, 0);
        // Five successes close it.
        for i in 0..5 {
            assert!(r.open_until_ms.is_some(), "closed after {i}");
            r = judge(&r, true);
        }
        assert_eq!((r.open_until_ms, r.trial.clone()), (None, None), "closed");
        assert_eq!(r.opens, 1);
        // A late result of the finished trial changes nothing.
        assert_eq!(
            apply(
                &r,
                &Change::Judge {
                    trial: ids[0],
                    success: false
                },
                "x",
                t(64),
                &c
            ),
            None
        );
    }

    #[test]
    fn a_trial_reopens_once_as_soon_as_the_ratio_cannot_be_reached() {
        let c = trial(10, 0.5);
        let mut r = open_at_0(&c);
        let mut id = 0;
        for _ in 0..10 {
            (r, id) = take(&r, t(61), &c).unwrap();
        }
        for i in 0..6 {
            assert!(r.trial.is_some(), "decided after {i} failures");
            r = apply(
                &r,
                &Change::Judge {
                    trial: id,
                    success: false,
                },
                "x",
                t(62),
                &c,
            )
            .unwrap();
        }
        assert_eq!(
            (r.open_until_ms, r.reopens, r.trial.clone()),
            (Some(ms(t(122))), 1, None),
            "six of ten failed: five successes are out of reach"
        );
        // The other four results arrive after: ignored, the expiry stays.
        assert_eq!(
            apply(
                &r,
                &Change::Judge {
                    trial: id,
                    success: false
                },
                "x",
                t(63),
                &c
            ),
            None
        );
    }

    #[test]
    fn a_trial_out_of_time_is_judged_on_what_reported() {
        let c = trial(10, 0.5);
        let (r, id) = take(&open_at_0(&c), t(61), &c).unwrap();
        let r = apply(
            &r,
            &Change::Judge {
                trial: id,
                success: true,
            },
            "x",
            t(62),
            &c,
        )
        .unwrap();
        assert!(r.open_until_ms.is_some(), "one success of five needed");
        // Light traffic: nothing more came within the trial's time. The next call concludes
        // the trial on its one success and is let through on a closed breaker.
        let late = t(61) + Duration::from_millis(c.probe_timeout_ms);
        let (a, ch) = decide(&r, "y", late, &c, 0.0);
        assert_eq!(ch, Some(Change::Conclude { trial: id }));
        assert_eq!(a, Admission::Defer(late));
        let closed = apply(&r, &ch.unwrap(), "y", late, &c).unwrap();
        assert_eq!(closed.open_until_ms, None);
        assert_eq!(decide(&closed, "y", late, &c, 0.0).0, Admission::Allow);
        // No result at all: a fresh trial, the breaker still half-open.
        let (silent, _) = take(&open_at_0(&c), t(61), &c).unwrap();
        let (a, _) = decide(&silent, "y", late, &c, 0.0);
        assert_eq!(a, Admission::Probe { trial: ms(late) });
    }

    #[test]
    fn waiting_says_why_until_deferred_work_is_back() {
        let c = trial(10, 0.5);
        assert_eq!(waiting(&BreakerRecord::default(), t(0), &c), None, "closed");
        let open = open_at_0(&c);
        assert!(waiting(&open, t(30), &c).is_some_and(|w| w.starts_with("open since")));
        // Half-open, deferred work still coming back (expiry + spread + trial time).
        assert!(waiting(&open, t(61), &c).is_some_and(|w| w.contains("half-open")));
        let (probing, _) = take(&open, t(70), &c).unwrap();
        assert!(waiting(&probing, t(71), &c).is_some_and(|w| w.contains("judging 1 of 10")));
        // Long after, with no trial under way: nothing waits on it.
        assert_eq!(waiting(&open, t(60 + 10 + 5 + 1), &c), None);
    }

    #[test]
    fn config_names_the_key_of_a_bad_trial() {
        assert_eq!(BreakerConfig::default().validate(), Ok(()));
        assert_eq!(
            trial(0, 0.5).validate().unwrap_err().key(),
            "breaker.half_open_calls"
        );
        for bad in [0.0, -1.0, 1.5, f64::NAN] {
            assert_eq!(
                trial(10, bad).validate().unwrap_err().key(),
                "breaker.half_open_success_ratio"
            );
        }
        assert_eq!(trial(1, 0.01).successes_to_close(), 1);
        assert_eq!(trial(10, 1.0).successes_to_close(), 10);
        assert_eq!(trial(10, 0.55).successes_to_close(), 6);
    }

    fn shared(brink_hold_ms: u64) -> Arc<Shared> {
        Arc::new(Shared::new(
            Arc::new(crate::azure::memory::MemoryRecordStore::new()),
            "api",
            "replica-a",
            BreakerConfig {
                brink_hold_ms,
                ..cfg()
            },
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_event_at_the_brink_waits_for_a_success_then_goes_on() {
        let b = shared(10_000);
        // Two of three failures: the next new event could trip the breaker.
        for _ in 0..2 {
            assert_eq!(b.admit_new(0.0).await, Admission::Allow);
            b.report_new(false, None).await;
        }
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.admit_new(0.0).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "held at the brink");
        // A due retry (not a new event) succeeds: the downstream serves; it goes on at once.
        assert_eq!(b.admit(0.0).await, Admission::Allow);
        b.report(true, None).await;
        assert_eq!(waiting.await.unwrap(), Admission::Allow);
        assert_eq!(b.cached().unwrap_or_default().opens, 0, "never opened");
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_lets_only_as_many_held_new_events_go_as_cannot_trip_the_breaker() {
        // Several new events wait at the brink at once (partitions, `max_in_flight` > 1).
        let b = shared(10_000);
        for _ in 0..2 {
            b.admit_new(0.0).await;
            b.report_new(false, None).await;
        }
        let waiting: Vec<_> = (0..4)
            .map(|_| {
                let b = b.clone();
                tokio::spawn(async move { b.admit_new(0.0).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(waiting.iter().all(|w| !w.is_finished()), "all held");
        // A due retry succeeds: one more failure in a row is two away, so two go, not four.
        assert_eq!(b.admit(0.0).await, Admission::Allow);
        b.report(true, None).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let gone = waiting.iter().filter(|w| w.is_finished()).count();
        assert_eq!(gone, 2, "as many as cannot make three failures in a row");
        // Those two are refused (each new key once): the breaker has not opened, and the
        // others still wait for a success.
        for _ in 0..2 {
            b.report_new(false, None).await;
        }
        assert_eq!(b.cached().unwrap_or_default().opens, 0, "never opened");
        assert_eq!(waiting.iter().filter(|w| w.is_finished()).count(), 2);
        // Another success: the other two go.
        b.admit(0.0).await;
        b.report(true, None).await;
        for w in waiting {
            assert_eq!(w.await.unwrap(), Admission::Allow);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_event_at_the_brink_goes_on_after_the_hold_and_a_down_downstream_still_trips() {
        let b = shared(10_000);
        for _ in 0..2 {
            b.admit_new(0.0).await;
            b.report_new(false, None).await;
        }
        let started = tokio::time::Instant::now();
        assert_eq!(b.admit_new(0.0).await, Admission::Allow);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(10),
            "held for brink_hold_ms"
        );
        let r = b.report_new(false, None).await.expect("opened");
        assert_eq!(r.opens, 1);
        assert!(matches!(b.admit_new(0.0).await, Admission::Defer(_)));
        // Two new events in flight count as failures to come: the third waits.
        let b = shared(10_000);
        b.admit_new(0.0).await;
        b.report_new(false, None).await;
        assert_eq!(b.admit_new(0.0).await, Admission::Allow);
        let third = tokio::spawn({
            let b = b.clone();
            async move { b.admit_new(0.0).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !third.is_finished(),
            "one failure and one call in flight: at the brink"
        );
        b.report_new(true, None).await;
        assert_eq!(third.await.unwrap(), Admission::Allow);
        // Off: never waits.
        let b = shared(0);
        for _ in 0..2 {
            b.admit_new(0.0).await;
            b.report_new(false, None).await;
        }
        let started = tokio::time::Instant::now();
        b.admit_new(0.0).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_together_never_admit_more_than_the_trials_permits() {
        let store: Arc<dyn RecordStore> = Arc::new(crate::azure::memory::MemoryRecordStore::new());
        let c = trial(10, 0.5);
        // Open since long ago, expired: half-open, no trial yet.
        let open = BreakerRecord {
            open_until_ms: Some(ms(SystemTime::now()) - 1000),
            opened_at_ms: Some(ms(SystemTime::now()) - 60_000),
            opens: 1,
            ..Default::default()
        };
        store
            .create(
                &record_name("api"),
                serde_json::to_vec(&open).unwrap().into(),
            )
            .await
            .unwrap();
        let replicas: Vec<Arc<Shared>> = ["a", "b", "c"]
            .into_iter()
            .map(|who| Arc::new(Shared::new(store.clone(), "api", who, c.clone())))
            .collect();
        let asks: Vec<_> = (0..90)
            .map(|i| {
                let r = replicas[i % 3].clone();
                tokio::spawn(async move { r.admit(0.5).await })
            })
            .collect();
        let mut probes = 0;
        for a in asks {
            match a.await.unwrap() {
                Admission::Probe { .. } => probes += 1,
                Admission::Defer(_) => {}
                Admission::Allow => panic!("allowed on a half-open breaker"),
            }
        }
        assert_eq!(probes, 10, "exactly the trial's permits, cluster-wide");
        let r = read(store.as_ref(), "api").await.unwrap().unwrap();
        assert_eq!(r.trial.map(|t| t.admitted), Some(10));
    }

    /// What every caller of the model does to the record, in any interleaving.
    #[derive(Debug, Clone)]
    enum Step {
        Advance(u64),
        Ask,
        Report { call: usize, success: bool },
        Fail,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u64..20_000).prop_map(Step::Advance),
            Just(Step::Ask),
            (0usize..64, any::<bool>()).prop_map(|(call, success)| Step::Report { call, success }),
            Just(Step::Fail),
        ]
    }

    fn report(
        r: &mut BreakerRecord,
        trial: Option<i64>,
        success: bool,
        consecutive: &mut u32,
        now: SystemTime,
        c: &BreakerConfig,
    ) {
        *consecutive = if success { 0 } else { *consecutive + 1 };
        if let Some(ch) = on_result(r, success, trial, *consecutive, (0, 0), now, c) {
            if let Some(next) = apply(r, &ch, "x", now, c) {
                *r = next;
            }
        }
    }

    proptest! {
        /// The rules hold whatever the interleaving: never more trial calls than permitted
        /// per trial; opened once from closed; never extended while open; a trial decides
        /// only by its own results.
        #[test]
        fn trials_never_exceed_their_permits_and_the_rules_hold(
            n in 1u32..12,
            ratio in 0.05f64..=1.0,
            steps in proptest::collection::vec(step(), 1..300),
        ) {
            let c = BreakerConfig { half_open_calls: n, half_open_success_ratio: ratio, ..cfg() };
            let mut now = t(0);
            let mut r = BreakerRecord::default();
            let mut calls: Vec<Option<i64>> = Vec::new();
            let mut per_trial: std::collections::BTreeMap<i64, u32> = Default::default();
            let mut consecutive = 0;
            for s in steps {
                let before = r.clone();
                match s {
                    Step::Advance(d) => now += Duration::from_millis(d),
                    Step::Ask => match decide(&r, "x", now, &c, 0.5) {
                        (Admission::Allow, None) => calls.push(None),
                        (Admission::Probe { .. }, Some(ch)) => {
                            if let Some(next) = apply(&r, &ch, "x", now, &c) {
                                let id = next.trial.as_ref().unwrap().since_ms;
                                *per_trial.entry(id).or_default() += 1;
                                prop_assert!(per_trial[&id] <= n, "{} calls in trial {id}", per_trial[&id]);
                                r = next;
                                calls.push(Some(id));
                            }
                        }
                        (Admission::Defer(until), ch) => {
                            prop_assert!(until >= now);
                            if let Some(ch) = ch {
                                if let Some(next) = apply(&r, &ch, "x", now, &c) { r = next; }
                            }
                        }
                        other => prop_assert!(false, "{other:?}"),
                    },
                    Step::Report { call, success } => {
                        if !calls.is_empty() {
                            let trial = calls.remove(call % calls.len());
                            report(&mut r, trial, success, &mut consecutive, now, &c);
                        }
                    }
                    Step::Fail => report(&mut r, None, false, &mut consecutive, now, &c),
                }
                // Never extended while open; opened only from closed.
                if let Some(u) = before.open_until_ms {
                    if now < at(u) {
                        prop_assert_eq!(r.open_until_ms, Some(u), "extended or closed while open");
                    }
                }
                prop_assert!(r.opens <= before.opens + 1);
                if r.opens > before.opens {
                    prop_assert_eq!(before.open_until_ms, None, "opened while not closed");
                }
                if let Some(tr) = &r.trial {
                    prop_assert!(tr.admitted <= n);
                    prop_assert!(tr.successes + tr.failures <= tr.admitted);
                }
            }
        }
    }
}
