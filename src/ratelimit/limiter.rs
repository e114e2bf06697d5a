//! One replica's rate limiter: its share of the deployment's limit (from the ownership
//! listings), the deployment's adapted rate and pause (a record in the record store, the
//! breaker's neighbour: `ratelimits/{downstream}`), the webhook's granted rate, and the pacer
//! every attempt — first delivery or retry — waits on before it calls the downstream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use azure_messaging_eventhubs::models::Ownership;
use serde::Serialize;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    decrease, pause, rate_at, Adaptation, AdaptedRecord, DecreaseReason, Gcra, Owned,
    RateLimitConfig, Shares, Signal,
};
use crate::azure::versioned::{
    compare_and_swap, Change as Versioning, Conflicts, Contended, Json, RecordKind, Start, Swapped,
    Versioned,
};
use crate::azure::{IfChanged, RecordStore, StoreError};
use crate::clock::{at, rfc3339, Clock};
use crate::sync::LockExt;

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
    /// This replica's share of it (owned partitions ÷ the hub's partitions).
    pub share: f64,
    /// Partitions counted for this replica.
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
    /// This replica has no share of the rate now (it owns no partition): leave the work to
    /// the replicas that do.
    NoShare,
}

struct State {
    shares: Shares,
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
    /// The limiter of replica `owner` for `downstream`, its adapted state shared through
    /// `store`; a partition taken over from a live owner counts after `takeover_delay`, and
    /// one no listing confirmed for `fresh` stops counting.
    pub fn new(
        config: RateLimitConfig,
        store: Arc<dyn RecordStore>,
        downstream: &str,
        owner: &str,
        takeover_delay: Duration,
        fresh: Duration,
        clock: Arc<Clock>,
    ) -> Self {
        let limiter = Self {
            config,
            adaptation: Adaptation::default(),
            downstream: downstream.into(),
            key: record_name(downstream),
            store,
            clock,
            allowed: Mutex::new(None),
            state: Mutex::new(State {
                shares: Shares::new(owner, takeover_delay, fresh),
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
        let (owned, partitions) = st.shares.owned(Instant::now());
        let share = st.shares.share(Instant::now());
        RateSnapshot {
            downstream: self.downstream.clone(),
            configured_per_s: self.config.per_s,
            allowed_per_s: self.allowed_per_s(),
            limit_per_s: limit,
            deployment_rate_per_s: deployment,
            share,
            owned_partitions: owned,
            partitions,
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

    /// The hub's partition count.
    pub fn set_partitions(&self, total: usize) {
        self.state().shares.set_total(total);
        self.publish();
    }

    /// A listing of the ownership blobs (every load-balancing cycle): this replica's share.
    /// A claim older than `expiration` is nobody's.
    pub fn listed(&self, owners: &[Ownership], expiration: Duration) {
        let now = time::OffsetDateTime::now_utc();
        let owned: Vec<Owned> = owners
            .iter()
            .map(|o| Owned {
                partition: o.partition_id.clone(),
                live_owner: o
                    .owner_id
                    .clone()
                    .filter(|id| !id.is_empty())
                    .filter(|_| o.last_modified_time.is_some_and(|t| now - t < expiration)),
            })
            .collect();
        {
            let mut st = self.state();
            let before = st.shares.owned(Instant::now());
            st.shares.listed(Instant::now(), &owned);
            if st.shares.owned(Instant::now()) != before {
                self.bump(&mut st);
            }
        }
        self.publish();
    }

    /// Partitions this replica has just claimed.
    pub fn claimed(&self, partitions: &[String]) {
        {
            let mut st = self.state();
            let before = st.shares.owned(Instant::now());
            st.shares.claimed(Instant::now(), partitions);
            if st.shares.owned(Instant::now()) != before {
                self.bump(&mut st);
            }
        }
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
    /// share (this replica owns no partition), `wait_for_share` decides: wait for one, or
    /// answer [`Acquired::NoShare`] at once.
    pub async fn acquire(
        &self,
        cancel: &CancellationToken,
        wait_for_share: bool,
    ) -> Option<Acquired> {
        let started = Instant::now();
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
                NoShare(Option<Instant>),
            }
            let next = {
                let mut st = self.state();
                let now = self.clock.now();
                let share = st.shares.share(Instant::now());
                match st.record.paused_until_ms.map(at) {
                    Some(p) if p > now => Next::Paused(p),
                    _ if share <= 0.0 => Next::NoShare(st.shares.next_change(Instant::now())),
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
                Next::Pace(wait, _) if wait.is_zero() => {
                    return Some(Acquired::Go(started.elapsed()))
                }
                Next::Pace(wait, epoch) => {
                    tokio::select! {
                        _ = cancel.cancelled() => return None,
                        _ = tokio::time::sleep(wait) => {
                            // The slot stands unless the rate changed meanwhile.
                            if self.state().epoch == epoch {
                                return Some(Acquired::Go(started.elapsed()));
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
                Next::NoShare(_) if !wait_for_share => return Some(Acquired::NoShare),
                Next::NoShare(change) => {
                    let wake = change.unwrap_or_else(|| Instant::now() + self.refresh);
                    tokio::select! {
                        _ = cancel.cancelled() => return None,
                        _ = tokio::time::sleep_until(wake) => {}
                        _ = &mut notified => {}
                    }
                }
            }
        }
    }

    /// Waits until this replica has a share of the rate (at once when no limit is in force);
    /// `false` if `cancel` fired first.
    pub async fn has_share(&self, cancel: &CancellationToken) -> bool {
        loop {
            let notified = self.bumped.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let change = {
                let st = self.state();
                if self.limit().is_none() || st.shares.share(Instant::now()) > 0.0 {
                    return true;
                }
                st.shares.next_change(Instant::now())
            };
            let wake = change.unwrap_or_else(|| Instant::now() + self.refresh);
            tokio::select! {
                _ = cancel.cancelled() => return false,
                _ = tokio::time::sleep_until(wake) => {}
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
mod tests {
    use super::*;
    use crate::azure::memory::MemoryRecordStore;

    fn limiter(store: Arc<dyn RecordStore>, owner: &str, per_s: f64, clock: Arc<Clock>) -> Limiter {
        let l = Limiter::new(
            RateLimitConfig::per_second(per_s),
            store,
            "receiver:80",
            owner,
            Duration::from_secs(2),
            Duration::from_secs(60),
            clock,
        );
        l.set_partitions(2);
        l.claimed(&["0".into(), "1".into()]);
        l
    }

    #[tokio::test(start_paused = true)]
    async fn attempts_are_paced_at_the_replicas_share_and_the_wait_is_reported() {
        let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
        let l = limiter(store, "a", 10.0, Arc::default());
        let cancel = CancellationToken::new();
        let t0 = Instant::now();
        let mut waits = Vec::new();
        for _ in 0..5 {
            match l.acquire(&cancel, true).await {
                Some(Acquired::Go(w)) => waits.push(w),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(waits[0], Duration::ZERO);
        // 10/s, paced with the headroom: 103 ms apart.
        let gap = Duration::from_secs_f64(1.0 / (10.0 * crate::ratelimit::PACING_HEADROOM));
        let close = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_millis(2);
        assert!(close(t0.elapsed(), gap * 4), "{:?}", t0.elapsed());
        assert!(close(waits[4], gap), "{:?}", waits[4]);
        assert_eq!(l.snapshot().rate_per_s, Some(10.0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_lowers_the_rate_of_every_replica_and_its_retry_after_pauses_them_all() {
        let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
        let clock: Arc<Clock> = Arc::default();
        let a = limiter(store.clone(), "a", 100.0, clock.clone());
        let b = limiter(store.clone(), "b", 100.0, clock.clone());
        let cancel = CancellationToken::new();
        assert!(matches!(
            b.acquire(&cancel, true).await,
            Some(Acquired::Go(_))
        ));
        a.observe(Signal::Slow {
            reason: DecreaseReason::Throttled,
            retry_after: None,
        })
        .await;
        let rate = a.snapshot().deployment_rate_per_s.unwrap();
        assert!(rate < 51.0, "{rate}");
        assert_eq!(a.snapshot().last_decrease_reason, Some("throttled_429"));
        // b reads the shared record at its next refresh.
        tokio::time::advance(Duration::from_millis(600)).await;
        assert!(matches!(
            b.acquire(&cancel, true).await,
            Some(Acquired::Go(_))
        ));
        let rb = b.snapshot().deployment_rate_per_s.unwrap();
        assert!(rb < 52.0, "b lowered too: {rb}");
        // A Retry-After pauses b as well, on the policy clock.
        clock.advance(Duration::from_secs(2));
        a.observe(Signal::Slow {
            reason: DecreaseReason::Throttled,
            retry_after: Some(Duration::from_secs(30)),
        })
        .await;
        tokio::time::advance(Duration::from_millis(600)).await;
        let waiting = b.acquire(&cancel, true);
        tokio::pin!(waiting);
        tokio::select! {
            _ = &mut waiting => panic!("b must wait out the pause"),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        assert!(b.snapshot().paused_until.is_some());
        clock.advance(Duration::from_secs(31));
        assert!(matches!(waiting.await, Some(Acquired::Go(w)) if w >= Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_share_retries_are_left_to_others_and_partitions_wait() {
        let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
        let l = Limiter::new(
            RateLimitConfig::per_second(10.0),
            store,
            "d",
            "a",
            Duration::from_secs(2),
            Duration::from_secs(60),
            Arc::default(),
        );
        l.set_partitions(4);
        let cancel = CancellationToken::new();
        assert_eq!(l.acquire(&cancel, false).await, Some(Acquired::NoShare));
        let waiting = l.acquire(&cancel, true);
        tokio::pin!(waiting);
        tokio::select! {
            _ = &mut waiting => panic!("no share: it waits"),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        l.claimed(&["3".into()]);
        assert!(matches!(waiting.await, Some(Acquired::Go(_))));
        assert_eq!(l.snapshot().rate_per_s, Some(2.5));
    }

    #[test]
    fn signals_from_outcomes() {
        use crate::handler::{Failure, Outcome};
        let cap = Duration::from_secs(60);
        let f = |s: u16| Outcome::Failed(Failure::transient("x").with_http_status(s));
        assert!(matches!(
            signal_of(&f(429), cap),
            Signal::Slow {
                reason: DecreaseReason::Throttled,
                retry_after: None
            }
        ));
        let long = Outcome::Failed(
            Failure::transient("x")
                .with_http_status(429)
                .with_retry_after(Some(Duration::from_secs(999_999))),
        );
        assert_eq!(
            signal_of(&long, cap),
            Signal::Slow {
                reason: DecreaseReason::Throttled,
                retry_after: Some(cap)
            },
            "bounded"
        );
        assert!(matches!(
            signal_of(&f(503), cap),
            Signal::Slow {
                reason: DecreaseReason::Unavailable,
                ..
            }
        ));
        assert!(matches!(
            signal_of(&Outcome::Failed(Failure::timeout("slow")), cap),
            Signal::Slow {
                reason: DecreaseReason::Timeout,
                ..
            }
        ));
        assert_eq!(signal_of(&f(400), cap), Signal::Neutral);
        assert_eq!(signal_of(&Outcome::Delivered, cap), Signal::Success);
    }
}
