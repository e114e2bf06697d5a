//! One downstream's storm guard as one replica sees it: the record kept in a [`RecordStore`]
//! and changed with compare-and-swap, and the replica's own counts over the window.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::{
    apply, decide, on_refusal, waiting, Counts, RefusalVerdict, StormAdmission, StormChange,
    StormGuardConfig, StormRecord,
};
use crate::azure::versioned::{
    compare_and_swap, Change as Versioning, Conflicts, Contended, Json, RecordKind, Start,
    Versioned,
};
use crate::azure::{RecordStore, StoreError};
use crate::clock::ms;
use crate::sync::LockExt;

/// Where the storm guard of `downstream` is kept in the record store.
pub fn record_name(downstream: &str) -> String {
    format!("stormguard/{downstream}")
}

/// Where the guard of `lane` (an event type with a guard of its own; `None`: the
/// downstream's) is kept: the type's name digested, so any type name fits a blob name.
pub fn lane_record_name(downstream: &str, lane: Option<&str>) -> String {
    match lane {
        None => record_name(downstream),
        Some(t) => format!(
            "{}/types/{}",
            record_name(downstream),
            crate::event::key_digest(t).trim_start_matches('~')
        ),
    }
}

/// What the guard says about an attempt that wants to run now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StormGate {
    /// Run it; `trial` when it is the held guard's trial.
    Run {
        /// The trial it is.
        trial: Option<i64>,
    },
    /// The guard holds: ask again at this time (work waits, uncounted).
    Wait(SystemTime),
}

/// What an attempt's outcome comes to under the guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StormVerdict {
    /// Settle it as usual.
    Settle,
    /// The guard holds: do not dead-letter it; it waits and is attempted again.
    Hold,
}

/// An attempt's outcome as the guard counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Delivered.
    Delivered,
    /// Failed, and its settlement would not dead-letter it (a retry is scheduled).
    Failed,
    /// Failed, and its settlement would dead-letter it: a permanent refusal or the last
    /// attempt.
    Refused,
}

/// One downstream's storm guard as one replica sees it: the downstream's guard and one for
/// each event type with thresholds of its own (a *lane* each, its own record, counts,
/// holding and trials).
pub struct Guard {
    downstream: String,
    config: StormGuardConfig,
    /// The downstream's lane first, then the types' in name order.
    lanes: Vec<Lane>,
}

/// One guard: the downstream's, or one event type's.
struct Lane {
    /// The event type it is for (`None`: the downstream's).
    event_type: Option<String>,
    store: Arc<dyn RecordStore>,
    key: String,
    who: String,
    /// The lane's settings (the type's thresholds over the downstream's).
    config: StormGuardConfig,
    /// How logs and readiness name it: the downstream, and the type for a type's lane.
    label: String,
    /// This replica's outcomes within the window: when, and whether a refusal.
    recent: Mutex<VecDeque<(SystemTime, bool)>>,
    /// The record, its ETag (`None`: no record yet) and when it was read.
    cached: Mutex<Option<(StormRecord, Option<String>, SystemTime)>>,
    refresh: Duration,
    clock: Arc<crate::clock::Clock>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StormGuard")
            .field("downstream", &self.downstream)
            .field("lanes", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

/// The record as the one compare-and-swap reads and writes it: every read refreshes what
/// the replica last saw.
struct Kept<'a>(&'a Lane);

#[async_trait::async_trait]
impl RecordKind for Kept<'_> {
    type Value = StormRecord;
    type Error = StoreError;

    fn name(&self) -> String {
        self.0.key.clone()
    }

    async fn read(&self) -> Result<Option<Versioned<StormRecord>>, StoreError> {
        let (record, etag) = self.0.load(true).await?;
        Ok(etag.map(|etag| Versioned::new(record, etag)))
    }

    async fn write(&self, value: &StormRecord, etag: Option<&str>) -> Result<String, StoreError> {
        Json::<StormRecord>::lenient(self.0.store.as_ref(), &self.0.key)
            .write(value, etag)
            .await
    }

    fn lost(&self, e: &StoreError) -> bool {
        e.is_conflict()
    }

    fn contended(&self, _: Contended) -> StoreError {
        StoreError::Conflict
    }
}

impl Guard {
    /// The guard of `downstream`, shared through `store`, seen by replica `who`: the
    /// downstream's lane and one per event type with thresholds of its own.
    pub fn new(
        store: Arc<dyn RecordStore>,
        downstream: &str,
        who: &str,
        config: StormGuardConfig,
    ) -> Self {
        let types = config.own_types().map(|t| Some(t.to_string()));
        let lanes = std::iter::once(None)
            .chain(types)
            .map(|event_type| Lane {
                store: store.clone(),
                key: lane_record_name(downstream, event_type.as_deref()),
                who: who.into(),
                config: config.lane(event_type.as_deref()),
                label: match &event_type {
                    None => downstream.to_string(),
                    Some(t) => format!("{downstream} (event type {t})"),
                },
                event_type,
                recent: Mutex::default(),
                cached: Mutex::new(None),
                refresh: Duration::from_millis(500),
                clock: Arc::default(),
            })
            .collect();
        Self {
            downstream: downstream.into(),
            config,
            lanes,
        }
    }

    /// Reads windows, trials and waits on `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Arc<crate::clock::Clock>) -> Self {
        for l in &mut self.lanes {
            l.clock = clock.clone();
        }
        self
    }

    /// The lane that counts and holds events of `event_type`.
    fn lane(&self, event_type: Option<&str>) -> &Lane {
        let lane = self.config.lane_of(event_type);
        self.lanes
            .iter()
            .find(|l| l.event_type.as_deref() == lane)
            .unwrap_or(&self.lanes[0])
    }

    /// Reads every lane's record again now and then until `stop`, so that a replica with no
    /// work for the downstream (no partition, nothing due) still shows the guard as it is in
    /// its readiness, status, gauges and operational events.
    pub async fn watch(
        self: Arc<Self>,
        every: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            for l in &self.lanes {
                let _ = l.load(false).await;
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.lanes[0].clock.sleep(every) => {}
            }
        }
    }

    /// Whether an attempt of an event of `event_type` may run now (its lane decides; a type
    /// left out always runs). Storage trouble lets it run on what was last seen (the guard
    /// must not become an outage of its own).
    pub async fn admit(&self, event_type: Option<&str>, jitter: f64) -> StormGate {
        if !self.config.covers(event_type) {
            return StormGate::Run { trial: None };
        }
        self.lane(event_type).admit(jitter).await
    }

    /// Counts an attempt's outcome (of an event of `event_type`, admitted as `trial`) in its
    /// lane and says what becomes of it: a refusal is reported through the lane's shared
    /// record before its verdict, so replicas together never dead-letter more than the
    /// lane's threshold allows.
    pub async fn counted(
        &self,
        event_type: Option<&str>,
        outcome: Counted,
        trial: Option<i64>,
    ) -> StormVerdict {
        if !self.config.covers(event_type) {
            return StormVerdict::Settle;
        }
        self.lane(event_type).counted(outcome, trial).await
    }

    /// Until when a held retry of an event of `event_type` is deferred
    /// ([`held_retry_until`](super::held_retry_until) on its lane as last seen).
    pub fn held_retry_until(&self, event_type: Option<&str>, jitter: f64) -> SystemTime {
        let lane = self.lane(event_type);
        let record = lane.cached().unwrap_or_default();
        super::held_retry_until(&record, lane.clock.now(), &lane.config, jitter)
    }

    /// Why work waits on the guard now, as last seen (every lane that holds); `None` when
    /// nothing does.
    pub fn waiting(&self) -> Option<String> {
        let why: Vec<String> = self.lanes.iter().filter_map(Lane::waiting).collect();
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Why an event of `event_type` waits on its guard now, as last seen; `None` when it
    /// does not.
    pub fn waiting_for(&self, event_type: Option<&str>) -> Option<String> {
        self.lane(event_type).waiting()
    }

    /// The downstream's name.
    pub fn downstream(&self) -> &str {
        &self.downstream
    }

    /// Every lane as last seen — the downstream's first, then each event type's own — for
    /// the operational events: (its event type, how it is named, its record, its settings).
    pub fn lanes_cached(
        &self,
    ) -> Vec<(Option<&str>, &str, Option<StormRecord>, &StormGuardConfig)> {
        self.lanes
            .iter()
            .map(|l| {
                (
                    l.event_type.as_deref(),
                    l.label.as_str(),
                    l.cached(),
                    &l.config,
                )
            })
            .collect()
    }

    /// The guard as the status API shows it: the downstream's lane, and each event type's
    /// own under `event_types`.
    pub fn report(&self) -> serde_json::Value {
        let mut v = self.lanes[0].report();
        v["downstream"] = self.downstream.clone().into();
        let types: serde_json::Map<String, serde_json::Value> = self.lanes[1..]
            .iter()
            .map(|l| (l.event_type.clone().unwrap_or_default(), l.report()))
            .collect();
        if !types.is_empty() {
            v["event_types"] = types.into();
        }
        v
    }
}

impl Lane {
    async fn load(&self, fresh: bool) -> Result<(StormRecord, Option<String>), StoreError> {
        if !fresh {
            if let Some((r, e, t)) = self.cached.locked().clone() {
                if self.clock.now().duration_since(t).unwrap_or_default() < self.refresh {
                    return Ok((r, e));
                }
            }
        }
        let read = self.store.read(&self.key).await?;
        let (r, e) = match read {
            Some(rec) => (
                serde_json::from_slice(&rec.body).unwrap_or_default(),
                Some(rec.etag),
            ),
            None => (StormRecord::default(), None),
        };
        self.seen(&r, e.clone(), self.clock.now());
        Ok((r, e))
    }

    /// Remembers the record as read or written, logging what changed since last seen.
    fn seen(&self, r: &StormRecord, etag: Option<String>, at: SystemTime) {
        let before = self
            .cached
            .locked()
            .replace((r.clone(), etag, at))
            .map(|(b, _, _)| b);
        let was = before.as_ref().map(|b| b.holding.is_some());
        match (was, &r.holding) {
            (Some(false) | None, Some(h)) => tracing::warn!(
                target: "hubguard::storm_guard",
                downstream = %self.label,
                by = h.by.as_deref().unwrap_or("refusals"),
                refusals = h.refusals,
                attempts = h.attempts,
                "storm guard holding: refusals are not dead-lettered, new events wait"
            ),
            (Some(true), None) => {
                // Released: this replica counts afresh, as the record does.
                self.recent.locked().clear();
                tracing::warn!(
                target: "hubguard::storm_guard",
                downstream = %self.label,
                action = r.last_action.as_ref().map_or("trial delivered", |a| a.action.as_str()),
                "storm guard released"
                );
            }
            _ => {}
        }
        if let (Some(a), Some(b)) = (&r.last_action, before.as_ref()) {
            if b.last_action.as_ref() != Some(a) {
                tracing::warn!(target: "hubguard::storm_guard", downstream = %self.label, action = %a.action, by = %a.by, reason = a.reason.as_deref().unwrap_or(""), "storm guard changed by an operator");
            }
        }
    }

    /// Applies `change` with compare-and-swap: the record after it, and whether it was
    /// written (`false`: it no longer applied).
    async fn change(
        &self,
        change: impl Fn() -> StormChange,
    ) -> Result<(StormRecord, bool), StoreError> {
        let mut decided_at = self.clock.now();
        let swapped = compare_and_swap(&Kept(self), Start::Read, |current| {
            let current = current.unwrap_or_default();
            decided_at = self.clock.now();
            match apply(&current, &change(), decided_at, &self.config) {
                Some(next) => Versioning::Write(Box::new(next.clone()), next),
                None => Versioning::Keep(current),
            }
        })
        .await?;
        let Some(written) = swapped.written else {
            return Ok((swapped.value, false));
        };
        self.seen(&written.value, Some(written.etag), decided_at);
        Ok((swapped.value, true))
    }

    /// Whether an attempt of an event of the lane may run now. Storage trouble lets it
    /// run on what was last seen (the guard must not become an outage of its own).
    async fn admit(&self, jitter: f64) -> StormGate {
        let record = match self.load(false).await {
            Ok((r, _)) => r,
            Err(_) => self.cached().unwrap_or_default(),
        };
        let now = self.clock.now();
        match decide(&record, now, &self.config, jitter) {
            (StormAdmission::Allow, _) => StormGate::Run { trial: None },
            (StormAdmission::Wait(until), None) => StormGate::Wait(until),
            (StormAdmission::Wait(until), Some(c)) => match self.change(|| c.clone()).await {
                Ok((r, true)) => StormGate::Run { trial: r.trial_ms },
                _ => StormGate::Wait(until + Duration::from_millis(self.config.trial_every_ms)),
            },
        }
    }

    /// Counts an attempt's outcome (of an event of the lane, admitted as `trial`) and
    /// says what becomes of it: a refusal is reported through the shared record before its
    /// verdict, so replicas together never dead-letter more than the threshold allows.
    async fn counted(&self, outcome: Counted, trial: Option<i64>) -> StormVerdict {
        // The share is of the attempts that ended their event (delivered or refused): a
        // transient failure is the breaker's business, and a receiver that was down before
        // its bad deploy must not dilute the refusals that follow.
        match outcome {
            Counted::Delivered => self.push(false),
            Counted::Refused => self.push(true),
            Counted::Failed => {}
        }
        match (outcome, trial) {
            (Counted::Delivered, Some(trial)) => {
                let _ = self.change(|| StormChange::Delivered { trial }).await;
                StormVerdict::Settle
            }
            (Counted::Refused, trial) => {
                let who = self.who.clone();
                let report = || StormChange::Refused {
                    who: who.clone(),
                    counts: self.counts(),
                    trial,
                };
                let now = self.clock.now();
                let verdict = match self.change(report).await {
                    Ok((after, _)) => on_refusal(&after, now),
                    // Storage is down: the dead letter cannot be written either (the ledger is
                    // in the same container); judge on what was last seen.
                    Err(_) => on_refusal(&self.cached().unwrap_or_default(), now),
                };
                match verdict {
                    RefusalVerdict::Hold => StormVerdict::Hold,
                    RefusalVerdict::DeadLetter => StormVerdict::Settle,
                }
            }
            _ => StormVerdict::Settle,
        }
    }

    fn push(&self, refused: bool) {
        let now = self.clock.now();
        let mut recent = self.recent.locked();
        recent.push_back((now, refused));
        let window = Duration::from_millis(self.config.window_ms);
        while recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t).unwrap_or_default() > window)
        {
            recent.pop_front();
        }
    }

    /// This replica's counts over the window now.
    fn counts(&self) -> Counts {
        let now = self.clock.now();
        let window = Duration::from_millis(self.config.window_ms);
        let recent = self.recent.locked();
        let within = recent
            .iter()
            .filter(|(t, _)| now.duration_since(*t).unwrap_or_default() <= window);
        let (attempts, refusals) = within.fold((0, 0), |(a, r), (_, refused)| {
            (a + 1, r + u32::from(*refused))
        });
        Counts {
            attempts,
            refusals,
            at_ms: ms(now),
        }
    }

    /// Why work of the lane waits on it now, as last seen; `None` when nothing does.
    fn waiting(&self) -> Option<String> {
        let record = self.cached()?;
        waiting(&record, &self.config).map(|w| format!("downstream {} {w}", self.label))
    }

    /// The record as last seen.
    fn cached(&self) -> Option<StormRecord> {
        self.cached.locked().as_ref().map(|(r, _, _)| r.clone())
    }

    /// The guard as the status API shows it.
    fn report(&self) -> serde_json::Value {
        let r = self.cached().unwrap_or_default();
        let now = self.clock.now();
        let (attempts, refusals) = r.totals(now, &self.config);
        serde_json::json!({
            "downstream": self.label,
            "state": r.state(now),
            "reason": waiting(&r, &self.config),
            "holding_since": r.holding.as_ref().map(|h| crate::clock::rfc3339(crate::clock::at(h.since_ms))),
            "held_by": r.holding.as_ref().and_then(|h| h.by.clone()),
            "window_attempts": attempts,
            "window_refusals": refusals,
            "held_refusals": r.held_refusals,
            "holds": r.holds,
            "next_trial": r.next_trial(&self.config).map(crate::clock::rfc3339),
            "accepted_until": r.accepted_until_ms.filter(|_| r.accepted(now)).map(|u| crate::clock::rfc3339(crate::clock::at(u))),
            "last_action": r.last_action,
        })
    }
}

// The operator's command line (`hubguard storm-guard`) and tests make these changes.
#[cfg_attr(not(any(test, feature = "cli")), allow(dead_code))]
/// An operator's change to the guard of `downstream` in `store` (its lane of `lane`, an event
/// type with a guard of its own; `None`: the downstream's), through the one compare-and-swap:
/// the record after it and whether it changed. `config`: the whole `[storm_guard]`.
pub async fn operate(
    store: &dyn RecordStore,
    downstream: &str,
    lane: Option<&str>,
    change: StormChange,
    config: &StormGuardConfig,
    now: SystemTime,
) -> Result<(StormRecord, bool), StoreError> {
    let name = lane_record_name(downstream, lane);
    let config = &config.lane(lane);
    let swapped = compare_and_swap(&Lenient { store, name: &name }, Start::Read, |current| {
        let current = current.unwrap_or_default();
        match apply(&current, &change, now, config) {
            Some(next) => Versioning::Write(Box::new(next.clone()), next),
            None => Versioning::Keep(current),
        }
    })
    .await?;
    let changed = swapped.written.is_some();
    Ok((swapped.value, changed))
}

/// The record as plain JSON (a body that does not parse reads as never held), its lost
/// rounds reported as a conflict.
struct Lenient<'a> {
    store: &'a dyn RecordStore,
    name: &'a str,
}

#[async_trait::async_trait]
impl RecordKind for Lenient<'_> {
    type Value = StormRecord;
    type Error = StoreError;

    fn name(&self) -> String {
        self.name.to_string()
    }

    async fn read(&self) -> Result<Option<Versioned<StormRecord>>, StoreError> {
        Json::<StormRecord>::lenient(self.store, self.name)
            .read()
            .await
    }

    async fn write(&self, value: &StormRecord, etag: Option<&str>) -> Result<String, StoreError> {
        Json::<StormRecord>::lenient(self.store, self.name)
            .write(value, etag)
            .await
    }

    fn lost(&self, e: &StoreError) -> bool {
        e.is_conflict()
    }

    fn contended(&self, _: Contended) -> StoreError {
        StoreError::Conflict
    }
}

// Tests read the downstream's guard (the command line reads a lane: `read_lane`).
#[allow(dead_code)]
/// The record of `downstream`'s guard as kept in `store` (`None`: it never held).
pub async fn read(
    store: &dyn RecordStore,
    downstream: &str,
) -> Result<Option<StormRecord>, StoreError> {
    read_lane(store, downstream, None).await
}

#[cfg_attr(not(any(test, feature = "cli")), allow(dead_code))]
/// The record of the guard of `downstream`'s lane `lane` (an event type with a guard of its
/// own; `None`: the downstream's) as kept in `store` (`None`: it never held).
pub async fn read_lane(
    store: &dyn RecordStore,
    downstream: &str,
    lane: Option<&str>,
) -> Result<Option<StormRecord>, StoreError> {
    Ok(store
        .read(&lane_record_name(downstream, lane))
        .await?
        .map(|r| serde_json::from_slice(&r.body).unwrap_or_default()))
}

impl crate::telemetry::gauges::StormGuardReadings for Guard {
    fn downstream_name(&self) -> String {
        self.downstream().to_string()
    }

    /// The longest any lane (the downstream's or an event type's) has held.
    fn holding_for(&self) -> Option<Duration> {
        self.lanes
            .iter()
            .filter_map(|l| {
                let h = l.cached()?.holding?;
                Some(
                    l.clock
                        .now()
                        .duration_since(crate::clock::at(h.since_ms))
                        .unwrap_or_default(),
                )
            })
            .max()
    }
}
