//! One downstream's breaker as one replica sees it: the record kept in a [`RecordStore`] and
//! changed with compare-and-swap, the replica's own counts, and the pacing of new events at
//! the brink.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::{
    apply, decide, on_result, waiting, Admission, BreakerConfig, BreakerRecord, BreakerState,
    Change,
};
use crate::azure::versioned::{
    compare_and_swap, Change as Versioning, Conflicts, Contended, Json, RecordKind, Start,
    Versioned,
};
use crate::azure::{RecordStore, StoreError};
use crate::clock::at;
use crate::sync::LockExt;

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
    /// New events waiting at the brink now (for tests and diagnostics).
    at_brink: std::sync::atomic::AtomicUsize,
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

/// A replica's breaker record as the one compare-and-swap reads and writes it: every read
/// refreshes what the replica last saw.
struct Kept<'a>(&'a Shared);

#[async_trait::async_trait]
impl RecordKind for Kept<'_> {
    type Value = BreakerRecord;
    type Error = StoreError;

    fn name(&self) -> String {
        self.0.key.clone()
    }

    async fn read(&self) -> Result<Option<Versioned<BreakerRecord>>, StoreError> {
        let (record, etag) = self.0.load(true).await?;
        Ok(etag.map(|etag| Versioned::new(record, etag)))
    }

    async fn write(&self, value: &BreakerRecord, etag: Option<&str>) -> Result<String, StoreError> {
        Json::<BreakerRecord>::lenient(self.0.store.as_ref(), &self.0.key)
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
            at_brink: std::sync::atomic::AtomicUsize::new(0),
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
            if let Some((r, e, t)) = self.cached.locked().clone() {
                if self.clock.now().duration_since(t).unwrap_or_default() < self.refresh {
                    return Ok((r, e));
                }
            }
        }
        match self.store.read(&self.key).await? {
            Some(rec) => {
                let r: BreakerRecord = serde_json::from_slice(&rec.body).unwrap_or_default();
                *self.cached.locked() = Some((r.clone(), Some(rec.etag.clone()), self.clock.now()));
                Ok((r, Some(rec.etag)))
            }
            None => {
                // Never opened: remember that too, or every call would read storage.
                *self.cached.locked() = Some((BreakerRecord::default(), None, self.clock.now()));
                Ok((BreakerRecord::default(), None))
            }
        }
    }

    /// Applies `change` with compare-and-swap: the record after it, and whether this call's
    /// change was written (`false`: it no longer applied to the record as it now is).
    async fn change(&self, change: Change, who: &str) -> Result<(BreakerRecord, bool), StoreError> {
        let mut decided_at = self.clock.now();
        let swapped = compare_and_swap(&Kept(self), Start::Read, |current| {
            let current = current.unwrap_or_default();
            decided_at = self.clock.now();
            match apply(&current, &change, who, decided_at, &self.config) {
                Some(next) => Versioning::Write(Box::new(next.clone()), next),
                None => Versioning::Keep(current),
            }
        })
        .await?;
        let Some(written) = swapped.written else {
            return Ok((swapped.value, false));
        };
        *self.cached.locked() = Some((written.value, Some(written.etag), decided_at));
        // New events held at the brink look again (an open breaker decides).
        self.succeeded.notify_waiters();
        Ok((swapped.value, true))
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
        let mut in_flight = self.new_in_flight.locked();
        let consecutive = *self.consecutive.locked();
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
                *self.new_in_flight.locked() += 1;
                break;
            }
            if self.enter_unless_at_brink() {
                break;
            }
            self.pacing.store(true, std::sync::atomic::Ordering::SeqCst);
            let _waiting = AtBrink::enter(&self.at_brink);
            tokio::select! {
                _ = notified => {}
                _ = &mut held => {
                    *self.new_in_flight.locked() += 1;
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

    /// How many new events wait at the brink now (each for at most `brink_hold_ms` on the
    /// pipeline's clock, or until a call succeeds); `/v1/status` shows it.
    pub fn waiting_at_brink(&self) -> usize {
        self.at_brink.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn new_call_done(&self) {
        let mut n = self.new_in_flight.locked();
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
            let mut c = self.consecutive.locked();
            *c = if success { 0 } else { *c + 1 };
            *c
        };
        if success {
            // New events held at the brink may go on.
            self.succeeded.notify_waiters();
        }
        let (record, _) = self.load(false).await.ok()?;
        let window = {
            let mut recent = self.recent.locked();
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
            *self.consecutive.locked() = 0;
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
        self.cached.locked().as_ref().map(|(r, _, _)| r.clone())
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

/// Counts a new event waiting at the brink while it lives (dropped on every way out,
/// cancellation included).
struct AtBrink<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> AtBrink<'a> {
    fn enter(n: &'a std::sync::atomic::AtomicUsize) -> Self {
        n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(n)
    }
}

impl Drop for AtBrink<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}
