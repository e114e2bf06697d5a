//! The circuit breaker: one per downstream, its state shared by every replica in
//! blob storage with compare-and-swap.
//!
//! - Opened **once**, on the transition from closed, when a replica sees
//!   `consecutive_failures` transient failures in a row; its expiry is never extended by work
//!   that lands on it while it is open.
//! - Work that meets an open breaker is **deferred** to after the expiry, spread over a
//!   window (jitter) so that it does not come back all at once; deferral counts no attempt
//!   and does not touch the breaker.
//! - After the expiry the breaker is half-open: exactly **one probe** cluster-wide (the
//!   replica that wins the CAS); success closes it, failure re-opens it once with a fresh
//!   expiry. A probe that never reports back is given up after `probe_timeout`.
//!
//! [`decide`] and [`on_result`] are pure functions of the record and the time; [`Shared`]
//! keeps the record in a [`RecordStore`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::azure::{RecordStore, StoreError};
use crate::clock::{at, ms};

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
    /// A probe that does not report back within this is given up (ms).
    #[serde(default = "d30000")]
    pub probe_timeout_ms: u64,
}

fn yes() -> bool {
    true
}

fn d20() -> u32 {
    20
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
        }
    }
}

/// The shared record of one downstream's breaker.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BreakerRecord {
    /// `None`: closed. `Some`: open (or half-open once `now >= open_until_ms`).
    pub open_until_ms: Option<i64>,
    /// When it opened (for its age).
    pub opened_at_ms: Option<i64>,
    /// The replica probing, and since when.
    pub probe: Option<(String, i64)>,
    /// How many times it opened from closed.
    pub opens: u64,
    /// How many times a failed probe re-opened it.
    #[serde(default)]
    pub reopens: u64,
}

/// What to do with work for the downstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Call the downstream.
    Allow,
    /// Call it as the half-open probe (report the result!).
    Probe,
    /// Do not call it; come back at this time.
    Defer(SystemTime),
}

/// A change to make to the shared record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Open until this time (only from closed, or re-open after a failed probe).
    Open(SystemTime),
    /// Close.
    Close,
    /// Take the probe.
    TakeProbe,
}

/// What `who` may do at `now` given `record`; `jitter` in [0, 1) spreads deferrals.
pub fn decide(
    record: &BreakerRecord,
    who: &str,
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
    // Half-open: one probe at a time, cluster-wide.
    match &record.probe {
        Some((owner, since))
            if owner == who
                && now < at(*since) + Duration::from_millis(config.probe_timeout_ms) =>
        {
            (
                Admission::Defer(now + Duration::from_millis(config.probe_timeout_ms) + spread),
                None,
            )
        }
        Some((_, since)) if now < at(*since) + Duration::from_millis(config.probe_timeout_ms) => (
            Admission::Defer(at(*since) + Duration::from_millis(config.probe_timeout_ms) + spread),
            None,
        ),
        _ => (Admission::Probe, Some(Change::TakeProbe)),
    }
}

/// The change a result calls for: `consecutive` is the caller's count of transient failures
/// in a row (this one included), `probe` whether this call was the probe.
pub fn on_result(
    record: &BreakerRecord,
    success: bool,
    probe: bool,
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
    match (record.open_until_ms, success, probe) {
        (_, true, true) => Some(Change::Close),
        (Some(_), false, true) => Some(Change::Open(now + open)),
        // Open only on the transition from closed: never extend an open breaker.
        (None, false, false) if consecutive >= config.consecutive_failures || ratio_trips => {
            Some(Change::Open(now + open))
        }
        _ => None,
    }
}

/// Applies `change` to `record` (by `who` at `now`); `None` if it no longer applies.
pub fn apply(
    record: &BreakerRecord,
    change: &Change,
    who: &str,
    now: SystemTime,
    config: &BreakerConfig,
) -> Option<BreakerRecord> {
    let mut r = record.clone();
    match change {
        Change::Open(until) => {
            // From closed, or from half-open after the probe failed; never while open.
            if r.open_until_ms.is_some_and(|u| now < at(u)) {
                return None;
            }
            if r.open_until_ms.is_some() {
                r.reopens += 1; // a failed probe: the breaker was half-open
            } else {
                r.opens += 1;
                r.opened_at_ms = Some(ms(now));
            }
            r.open_until_ms = Some(ms(*until));
            r.probe = None;
        }
        Change::Close => {
            r.open_until_ms?;
            r.open_until_ms = None;
            r.opened_at_ms = None;
            r.probe = None;
        }
        Change::TakeProbe => {
            let until = r.open_until_ms?;
            if now < at(until) {
                return None; // still open
            }
            if let Some((_, since)) = &r.probe {
                if now < at(*since) + Duration::from_millis(config.probe_timeout_ms) {
                    return None; // one probe at a time, cluster-wide
                }
            }
            r.probe = Some((who.to_string(), ms(now)));
        }
    }
    Some(r)
}

/// One downstream's breaker as one replica sees it.
pub struct Shared {
    store: Arc<dyn RecordStore>,
    key: String,
    who: String,
    config: BreakerConfig,
    consecutive: Mutex<u32>,
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

    async fn change(&self, change: Change, who: &str) -> Result<BreakerRecord, StoreError> {
        for _ in 0..8 {
            let (current, etag) = self.load(true).await?;
            let now = self.clock.now();
            let Some(next) = apply(&current, &change, who, now, &self.config) else {
                return Ok(current);
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
                    return Ok(next);
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
        let Ok((record, _)) = self.load(false).await else {
            return Admission::Allow;
        };
        let (admission, change) =
            decide(&record, &self.who, self.clock.now(), &self.config, jitter);
        if let Some(c) = change {
            // Each call is its own candidate prober: concurrent work in one replica must not
            // all believe it holds the probe.
            let token = format!("{}#{}", self.who, uuid::Uuid::new_v4().simple());
            // Win the probe, or learn who did.
            return match self.change(c, &token).await {
                Ok(r) if r.probe.as_ref().is_some_and(|(w, _)| *w == token) => Admission::Probe,
                Ok(r) => match decide(&r, &token, self.clock.now(), &self.config, jitter).0 {
                    // Lost the race for the probe: wait for the winner's result.
                    Admission::Probe => Admission::Defer(
                        self.clock.now() + Duration::from_millis(self.config.probe_timeout_ms),
                    ),
                    other => other,
                },
                Err(_) => Admission::Allow,
            };
        }
        admission
    }

    /// Reports a call's result (`transient_failure` false for a success; permanent errors are
    /// the event's fault, not the downstream's: do not report them).
    pub async fn report(&self, success: bool, probe: bool) -> Option<BreakerRecord> {
        let consecutive = {
            let mut c = self.consecutive.lock().unwrap_or_else(|p| p.into_inner());
            *c = if success { 0 } else { *c + 1 };
            *c
        };
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
            probe,
            consecutive,
            window,
            self.clock.now(),
            &self.config,
        )?;
        let who = self.who.clone();
        let r = self.change(change, &who).await.ok()?;
        if success {
            *self.consecutive.lock().unwrap_or_else(|p| p.into_inner()) = 0;
        }
        Some(r)
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

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            consecutive_failures: 3,
            failure_ratio: None,
            ratio_window: 20,
            open_ms: 60_000,
            spread_ms: 10_000,
            probe_timeout_ms: 5_000,
        }
    }

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    #[test]
    fn opens_once_on_the_threshold_and_never_extends() {
        let c = cfg();
        let closed = BreakerRecord::default();
        assert_eq!(on_result(&closed, false, false, 2, (0, 0), t(0), &c), None);
        let Some(change) = on_result(&closed, false, false, 3, (0, 0), t(0), &c) else {
            panic!("opens")
        };
        let open = apply(&closed, &change, "a", t(0), &c).unwrap();
        assert_eq!((open.open_until_ms, open.opens), (Some(ms(t(60))), 1));
        // Failures landing on the open breaker (or another replica's threshold) change nothing.
        assert_eq!(on_result(&open, false, false, 9, (0, 0), t(30), &c), None);
        assert_eq!(
            apply(&open, &Change::Open(t(90)), "b", t(30), &c),
            None,
            "never extended while open"
        );
    }

    #[test]
    fn open_defers_past_the_expiry_with_spread_and_one_probe_after() {
        let c = cfg();
        let open = apply(
            &BreakerRecord::default(),
            &Change::Open(t(60)),
            "a",
            t(0),
            &c,
        )
        .unwrap();
        let (a, ch) = decide(&open, "x", t(10), &c, 0.5);
        assert_eq!(a, Admission::Defer(t(65) + Duration::from_millis(1)));
        assert_eq!(ch, None, "deferral does not touch the breaker");
        let (a0, _) = decide(&open, "x", t(10), &c, 0.0);
        let (a1, _) = decide(&open, "x", t(10), &c, 0.999);
        assert!(
            matches!((a0, a1), (Admission::Defer(x), Admission::Defer(y)) if x >= t(60) && y > x),
            "spread"
        );
        // Half-open: the first to ask takes the probe; everyone else waits for it.
        let (a, ch) = decide(&open, "x", t(61), &c, 0.0);
        assert_eq!((a, ch.clone()), (Admission::Probe, Some(Change::TakeProbe)));
        let probing = apply(&open, &ch.unwrap(), "x", t(61), &c).unwrap();
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
        // A probe that never reports back is given up.
        assert_eq!(decide(&probing, "y", t(67), &c, 0.0).0, Admission::Probe);
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
            on_result(&closed, false, false, 1, (4, 9), t(0), &c),
            None,
            "window not full"
        );
        assert!(matches!(
            on_result(&closed, false, false, 1, (5, 10), t(0), &c),
            Some(Change::Open(_))
        ));
        assert_eq!(on_result(&closed, false, false, 1, (4, 10), t(0), &c), None);
        assert_eq!(
            on_result(&closed, false, false, 1, (9, 10), t(0), &cfg()),
            None,
            "off unless configured"
        );
    }

    #[test]
    fn probe_success_closes_failure_reopens_once() {
        let c = cfg();
        let open = apply(
            &BreakerRecord::default(),
            &Change::Open(t(60)),
            "a",
            t(0),
            &c,
        )
        .unwrap();
        let probing = apply(&open, &Change::TakeProbe, "x", t(61), &c).unwrap();
        let closed = apply(
            &probing,
            &on_result(&probing, true, true, 0, (0, 0), t(62), &c).unwrap(),
            "x",
            t(62),
            &c,
        )
        .unwrap();
        assert_eq!(closed.open_until_ms, None);
        let reopened = apply(
            &probing,
            &on_result(&probing, false, true, 1, (0, 0), t(62), &c).unwrap(),
            "x",
            t(62),
            &c,
        )
        .unwrap();
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
}
