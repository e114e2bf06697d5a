//! One replica's rate limiter: its share of the deployment's limit (from the replicas'
//! demands: [`crate::ratelimit::demand`], kept by its tick), the deployment's adapted rate and pause (a record in the record store, the
//! breaker's neighbour: `ratelimits/{downstream}`), the webhook's granted rate, and the pacer
//! every attempt — first delivery or retry — waits on before it calls the downstream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use std::collections::BTreeSet;

use azure_messaging_eventhubs::models::Ownership;
use serde::Serialize;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::demand::Demand;
use super::{
    decrease, pause, rate_at, Adaptation, AdaptedRecord, DecreaseReason, Gcra, RateLimitConfig,
    Signal,
};
use crate::azure::versioned::{
    compare_and_swap, Change as Versioning, Conflicts, Contended, Json, RecordKind, Start, Swapped,
    Versioned,
};
use crate::azure::{IfChanged, RecordStore, StoreError};
use crate::clock::{at, rfc3339, Clock};
use crate::sync::LockExt;

mod tick;

/// Where the adapted rate of `downstream` is kept in the record store.
pub fn record_name(downstream: &str) -> String {
    format!("ratelimits/{downstream}")
}

/// What the limiter says, for `/v1/status`, the gauges and tests.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct RateSnapshot {
    /// The downstream.
    pub downstream: String,
    /// `handler.rate_limit` (requests/s, the whole deployment).
    pub configured_per_s: Option<f64>,
    /// The webhook's `WebHook-Allowed-Rate`, per second.
    pub allowed_per_s: Option<f64>,
    /// The limit in force: the smaller of the two (`None`: no limit).
    pub limit_per_s: Option<f64>,
    /// The deployment's adapted rate now (≤ the limit).
    pub deployment_rate_per_s: Option<f64>,
    /// This replica's share of it (0..=1: from the replicas' demands, see
    /// [`crate::ratelimit::demand`]).
    pub share: f64,
    /// Whether this replica has a backlog (its attempts waited for the limiter most of the
    /// last tick): it asks for as much of the rate as it can get.
    pub backlog: bool,
    /// Replicas in the shares record as last read.
    pub replicas: usize,
    /// Partitions this replica owns (as the last listing and claim showed).
    pub owned_partitions: usize,
    /// The hub's partitions.
    pub partitions: usize,
    /// This replica's rate now (`deployment_rate × share`).
    pub rate_per_s: Option<f64>,
    /// Why the rate was last lowered.
    pub last_decrease_reason: Option<&'static str>,
    /// When (RFC 3339).
    pub last_decrease_at: Option<String>,
    /// Decreases so far (deployment-wide).
    pub decreases: u64,
    /// The downstream is paused until then (a 429's `Retry-After`), RFC 3339.
    pub paused_until: Option<String>,
}

/// What an attempt got from the limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// Go: the attempt waited this long.
    Go(Duration),
    /// This replica has no share of the rate now (it has just started, or its share lapsed):
    /// leave the work to the replicas that have one.
    NoShare,
}

struct State {
    split: tick::Split,
    owned: BTreeSet<String>,
    partitions: usize,
    gcra: Gcra,
    record: AdaptedRecord,
    etag: Option<String>,
    read_at: Option<Instant>,
    epoch: u64,
}

/// One replica's limiter for one downstream.
pub struct Limiter {
    config: RateLimitConfig,
    adaptation: Adaptation,
    downstream: String,
    key: String,
    shares_key: String,
    owner: String,
    lease: Duration,
    store: Arc<dyn RecordStore>,
    clock: Arc<Clock>,
    allowed: Mutex<Option<watch::Receiver<Option<f64>>>>,
    state: Mutex<State>,
    refreshing: AtomicBool,
    refresh: Duration,
    bumped: Notify,
    snapshot: watch::Sender<RateSnapshot>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("downstream", &self.downstream)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Limiter {
    /// The limiter of replica `owner` for `downstream`, its adapted state and its share
    /// agreed through `store`; its share holds for `lease` after each renewal (its
    /// [`run`](Self::run) renews it), and another replica's share that went unrenewed for
    /// longer goes to the live ones.
    pub fn new(
        config: RateLimitConfig,
        store: Arc<dyn RecordStore>,
        downstream: &str,
        owner: &str,
        lease: Duration,
        clock: Arc<Clock>,
    ) -> Self {
        let limiter = Self {
            config,
            adaptation: Adaptation::default(),
            downstream: downstream.into(),
            key: record_name(downstream),
            shares_key: super::demand::record_name(downstream),
            owner: owner.into(),
            lease,
            store,
            clock,
            allowed: Mutex::new(None),
            state: Mutex::new(State {
                split: tick::Split::new(Instant::now()),
                owned: BTreeSet::new(),
                partitions: 0,
                gcra: Gcra::default(),
                record: AdaptedRecord::default(),
                etag: None,
                read_at: None,
                epoch: 0,
            }),
            refreshing: AtomicBool::new(false),
            refresh: Duration::from_millis(500),
            bumped: Notify::new(),
            snapshot: watch::channel(RateSnapshot::default()).0,
        };
        limiter.publish();
        limiter
    }

    /// Caps the limit by the rate the webhook granted (`WebHook-Allowed-Rate`, per second).
    pub fn with_allowed_rate(self, allowed: watch::Receiver<Option<f64>>) -> Self {
        *self.allowed.locked() = Some(allowed);
        self.publish();
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    fn allowed_per_s(&self) -> Option<f64> {
        self.allowed
            .locked()
            .as_ref()
            .and_then(|a| *a.borrow())
            .filter(|r| r.is_finite() && *r > 0.0)
    }

    /// The limit in force: `handler.rate_limit` and the granted rate, the smaller.
    pub fn limit(&self) -> Option<f64> {
        match (self.config.per_s, self.allowed_per_s()) {
            (Some(c), Some(a)) => Some(c.min(a)),
            (c, a) => c.or(a),
        }
    }

    /// Until when the downstream is paused (a 429's `Retry-After`), if it is now.
    pub fn paused_until(&self) -> Option<SystemTime> {
        let now = self.clock.now();
        self.state()
            .record
            .paused_until_ms
            .map(at)
            .filter(|p| *p > now)
    }

    /// Whether it adapts to the receiver now: adaptive, with a limit in force.
    pub fn adapts(&self) -> bool {
        self.config.adaptive && self.limit().is_some()
    }

    /// The state as it is now, and every change to it.
    pub fn subscribe(&self) -> watch::Receiver<RateSnapshot> {
        self.snapshot.subscribe()
    }

    /// The state as it is now.
    pub fn snapshot(&self) -> RateSnapshot {
        let st = self.state();
        self.snapshot_of(&st)
    }

    fn snapshot_of(&self, st: &State) -> RateSnapshot {
        let limit = self.limit();
        let now = self.clock.now();
        let deployment = limit.map(|l| rate_at(&st.record, l, now, &self.adaptation));
        let share = st.split.share(Instant::now(), self.lease);
        RateSnapshot {
            downstream: self.downstream.clone(),
            configured_per_s: self.config.per_s,
            allowed_per_s: self.allowed_per_s(),
            limit_per_s: limit,
            deployment_rate_per_s: deployment,
            share,
            backlog: st.split.demand == Demand::Backlog,
            replicas: st.split.replicas,
            owned_partitions: st.owned.len(),
            partitions: st.partitions.max(st.owned.len()),
            rate_per_s: deployment.map(|d| d * share),
            last_decrease_reason: st.record.reason.map(DecreaseReason::label),
            last_decrease_at: st.record.decreased_at_ms.map(|t| rfc3339(at(t))),
            decreases: st.record.decreases,
            paused_until: st
                .record
                .paused_until_ms
                .filter(|p| at(*p) > now)
                .map(|p| rfc3339(at(p))),
        }
    }

    fn publish(&self) {
        let snap = self.snapshot();
        self.snapshot.send_if_modified(|s| {
            let changed = *s != snap;
            *s = snap;
            changed
        });
    }

    fn bump(&self, st: &mut State) {
        st.epoch += 1;
        st.gcra.reset(Instant::now());
        self.bumped.notify_waiters();
    }

    /// The hub's partition count (reported beside the share).
    pub fn set_partitions(&self, total: usize) {
        self.state().partitions = total;
        self.publish();
    }

    /// A listing of the ownership blobs (every load-balancing cycle): the partitions this
    /// replica owns, reported beside its share (a claim older than `expiration` is
    /// nobody's). The share itself follows demand, not partitions.
    pub fn listed(&self, owners: &[Ownership], expiration: Duration) {
        let now = time::OffsetDateTime::now_utc();
        let mine: BTreeSet<String> = owners
            .iter()
            .filter(|o| o.owner_id.as_deref() == Some(self.owner.as_str()))
            .filter(|o| o.last_modified_time.is_some_and(|t| now - t < expiration))
            .map(|o| o.partition_id.clone())
            .collect();
        {
            let mut st = self.state();
            st.partitions = st.partitions.max(owners.len());
            st.owned = mine;
        }
        self.publish();
    }

    /// Partitions this replica has just claimed.
    pub fn claimed(&self, partitions: &[String]) {
        self.state().owned.extend(partitions.iter().cloned());
        self.publish();
    }

    /// Reads the shared record again when the copy is older than the refresh interval (one
    /// caller reads; the others go on with the copy). Storage trouble keeps the copy.
    async fn refresh_if_stale(&self) {
        let (stale, etag) = {
            let st = self.state();
            (
                st.read_at.is_none_or(|t| t.elapsed() >= self.refresh),
                st.etag.clone(),
            )
        };
        if !stale || self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let read = match &etag {
            Some(e) => self.store.read_if_changed(&self.key, e).await,
            None => self.store.read(&self.key).await.map(|r| match r {
                Some(r) => IfChanged::Changed(r),
                None => IfChanged::Missing,
            }),
        };
        {
            let mut st = self.state();
            st.read_at = Some(Instant::now());
            match read {
                Ok(IfChanged::Changed(r)) => {
                    let rec: AdaptedRecord = serde_json::from_slice(&r.body).unwrap_or_default();
                    st.etag = Some(r.etag);
                    if rec != st.record {
                        st.record = rec;
                        self.bump(&mut st);
                    }
                }
                Ok(IfChanged::Missing) => st.etag = None,
                Ok(IfChanged::Unchanged) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "rate limit record not read; going on with the copy")
                }
            }
        }
        self.refreshing.store(false, Ordering::Release);
        self.publish();
    }

    /// Waits until the downstream may be called; `None` if `cancel` fired first. With no
    /// share (this replica has none yet, or its lease lapsed), `wait_for_share` decides: wait
    /// for one, or answer [`Acquired::NoShare`] at once. The time attempts spend waiting here
    /// is this replica's demand ([`crate::ratelimit::demand::demand_of`]).
    pub async fn acquire(
        &self,
        cancel: &CancellationToken,
        wait_for_share: bool,
    ) -> Option<Acquired> {
        let started = Instant::now();
        let _waiting = Waiting::new(self);
        loop {
            let Some(limit) = self.limit() else {
                return Some(Acquired::Go(started.elapsed()));
            };
            self.refresh_if_stale().await;
            let notified = self.bumped.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            enum Next {
                Paused(SystemTime),
                Pace(Duration, u64),
                NoShare,
            }
            let next = {
                let mut st = self.state();
                let now = self.clock.now();
                let share = st.split.share(Instant::now(), self.lease);
                match st.record.paused_until_ms.map(at) {
                    Some(p) if p > now => Next::Paused(p),
                    _ if share <= 0.0 => Next::NoShare,
                    _ => {
                        let rate = rate_at(&st.record, limit, now, &self.adaptation)
                            * share
                            * super::PACING_HEADROOM;
                        let epoch = st.epoch;
                        Next::Pace(st.gcra.reserve(Instant::now(), rate), epoch)
                    }
                }
            };
            match next {
                Next::Pace(wait, _) if wait.is_zero() => return Some(self.go(started)),
                Next::Pace(wait, epoch) => {
                    tokio::select! {
                        _ = cancel.cancelled() => return None,
                        _ = tokio::time::sleep(wait) => {
                            // The slot stands unless the rate changed meanwhile (or the
                            // share lapsed: then the loop finds none).
                            let stands = {
                                let st = self.state();
                                st.epoch == epoch && st.split.share(Instant::now(), self.lease) > 0.0
                            };
                            if stands {
                                return Some(self.go(started));
                            }
                        }
                        _ = &mut notified => {}
                    }
                }
                Next::Paused(until) => {
                    tokio::select! {
                        _ = cancel.cancelled() => return None,
                        _ = self.clock.sleep_until(until) => {}
                        _ = &mut notified => {}
                    }
                }
                Next::NoShare if !wait_for_share => {
                    self.state().split.turned_away();
                    return Some(Acquired::NoShare);
                }
                Next::NoShare => {
                    tokio::select! {
                        _ = cancel.cancelled() => return None,
                        _ = tokio::time::sleep(tick::TICK) => {}
                        _ = &mut notified => {}
                    }
                }
            }
        }
    }

    fn go(&self, started: Instant) -> Acquired {
        self.state().split.granted();
        Acquired::Go(started.elapsed())
    }

    /// Waits until this replica has a share of the rate (at once when no limit is in force);
    /// `false` if `cancel` fired first.
    pub async fn has_share(&self, cancel: &CancellationToken) -> bool {
        loop {
            let notified = self.bumped.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.limit().is_none() || self.state().split.share(Instant::now(), self.lease) > 0.0
            {
                return true;
            }
            tokio::select! {
                _ = cancel.cancelled() => return false,
                _ = tokio::time::sleep(tick::TICK) => {}
                _ = &mut notified => {}
            }
        }
    }

    /// What an attempt's answer says: a 429, 503 or timeout lowers the deployment's rate
    /// (once per cooldown), a 429's `Retry-After` pauses the downstream for every replica.
    /// The change is kept here at once and written to the shared record.
    pub async fn observe(&self, signal: Signal) {
        let Signal::Slow {
            reason,
            retry_after,
        } = signal
        else {
            return;
        };
        if !self.config.adaptive {
            return;
        }
        let Some(limit) = self.limit() else {
            return;
        };
        let change = |rec: &AdaptedRecord, now: SystemTime| -> Option<AdaptedRecord> {
            let decreased = decrease(rec, limit, now, reason, &self.adaptation);
            let base = decreased.clone().unwrap_or_else(|| rec.clone());
            let paused = match (reason, retry_after) {
                (DecreaseReason::Throttled, Some(ra)) if !ra.is_zero() => pause(&base, now + ra),
                _ => None,
            };
            paused.or(decreased)
        };
        // Here first, so this replica slows down whatever storage does.
        let (record, etag) = {
            let mut st = self.state();
            let Some(next) = change(&st.record, self.clock.now()) else {
                return;
            };
            if let (Some(r), None) = (next.reason, retry_after) {
                tracing::info!(downstream = %self.downstream, reason = r.label(), rate_per_s = next.rate_per_s, "downstream rate lowered");
            }
            st.record = next;
            self.bump(&mut st);
            (st.record.clone(), st.etag.clone())
        };
        self.publish();
        if let Some(ra) = retry_after {
            tracing::info!(downstream = %self.downstream, retry_after_s = ra.as_secs_f64(), "downstream paused for every replica (429 with Retry-After)");
        }
        // Then the shared record: written over the version this replica last read; when
        // another replica changed it meanwhile, from theirs.
        let mut decided = Some(record);
        let swapped = compare_and_swap(
            &Kept(self),
            Start::From(etag.map(|e| Versioned::new(AdaptedRecord::default(), e))),
            |current| {
                if let Some(record) = decided.take() {
                    return Versioning::Write(Box::new(record), None);
                }
                let current = current.unwrap_or_default();
                match change(&current, self.clock.now()) {
                    // Theirs already says as much: take it.
                    None => Versioning::Keep(Some(current)),
                    Some(next) => {
                        self.state().record = next.clone();
                        Versioning::Write(Box::new(next), None)
                    }
                }
            },
        )
        .await;
        match swapped {
            Ok(Swapped {
                written: Some(written),
                ..
            }) => {
                let mut st = self.state();
                st.etag = Some(written.etag);
                st.read_at = Some(Instant::now());
            }
            Ok(Swapped {
                value: Some(theirs),
                ..
            }) => {
                let mut st = self.state();
                if st.record != theirs {
                    st.record = theirs;
                    self.bump(&mut st);
                }
                drop(st);
                self.publish();
            }
            Ok(_) | Err(StoreError::Conflict) => {}
            Err(e) => {
                tracing::warn!(downstream = %self.downstream, error = %e, "the lowered rate could not be shared; this replica keeps it");
            }
        }
    }
}

/// An attempt waiting in [`Limiter::acquire`], counted while it lives.
struct Waiting<'a>(&'a Limiter);

impl<'a> Waiting<'a> {
    fn new(l: &'a Limiter) -> Self {
        l.state().split.enter(Instant::now());
        Self(l)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state().split.leave(Instant::now());
    }
}

/// A downstream's shared rate record as the one compare-and-swap reads and writes it:
/// every read is what this replica last saw of it.
struct Kept<'a>(&'a Limiter);

#[async_trait::async_trait]
impl RecordKind for Kept<'_> {
    type Value = AdaptedRecord;
    type Error = StoreError;

    fn name(&self) -> String {
        self.0.key.clone()
    }

    async fn read(&self) -> Result<Option<Versioned<AdaptedRecord>>, StoreError> {
        let read = Json::<AdaptedRecord>::lenient(self.0.store.as_ref(), &self.0.key)
            .read()
            .await?;
        let mut st = self.0.state();
        st.read_at = Some(Instant::now());
        st.etag = read.as_ref().map(|r| r.etag.clone());
        Ok(read)
    }

    async fn write(&self, value: &AdaptedRecord, etag: Option<&str>) -> Result<String, StoreError> {
        Json::<AdaptedRecord>::lenient(self.0.store.as_ref(), &self.0.key)
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

impl crate::telemetry::gauges::RateLimitReadings for Limiter {
    fn downstream_name(&self) -> String {
        self.downstream.clone()
    }

    fn configured(&self) -> Option<f64> {
        self.limit()
    }

    fn current(&self) -> Option<f64> {
        self.snapshot().rate_per_s
    }

    fn deployment(&self) -> Option<f64> {
        self.snapshot().deployment_rate_per_s
    }

    fn last_decrease(&self) -> Option<&'static str> {
        self.state().record.reason.map(DecreaseReason::label)
    }

    fn decreases(&self) -> u64 {
        self.state().record.decreases
    }
}

/// What an attempt's outcome says about the receiver's capacity: a 429 or 503 (with its
/// `Retry-After` for a 429, bounded by `max_pause`) or a timeout says "slower"; a success
/// says nothing more than that the rate may keep climbing.
///
/// 429 is "the user has sent too many requests in a given amount of time", with an optional
/// `Retry-After` saying how long to wait (RFC 6585 §4,
/// <https://www.rfc-editor.org/rfc/rfc6585#section-4>); 503 is a server "unable to handle the
/// request due to a temporary overload" (RFC 9110 §15.6.4,
/// <https://www.rfc-editor.org/rfc/rfc9110#section-15.6.4>). Event Grid likewise delays
/// deliveries to an endpoint that "appears to be overwhelmed"
/// (<https://learn.microsoft.com/azure/event-grid/delivery-and-retry>).
pub fn signal_of(outcome: &crate::handler::Outcome, max_pause: Duration) -> Signal {
    match outcome {
        crate::handler::Outcome::Delivered => Signal::Success,
        crate::handler::Outcome::Failed(f) => match f.http_status {
            Some(429) => Signal::Slow {
                reason: DecreaseReason::Throttled,
                retry_after: f.retry_after.map(|r| r.min(max_pause)),
            },
            Some(503) => Signal::Slow {
                reason: DecreaseReason::Unavailable,
                retry_after: None,
            },
            Some(408 | 504) => Signal::Slow {
                reason: DecreaseReason::Timeout,
                retry_after: None,
            },
            None if f.timed_out => Signal::Slow {
                reason: DecreaseReason::Timeout,
                retry_after: None,
            },
            _ => Signal::Neutral,
        },
    }
}

/// A shared limiter handle.
#[cfg(test)]
pub type SharedLimiter = Arc<Limiter>;

#[cfg(test)]
mod tests;
