//! The limiter's background tick: what this replica used since the last one becomes its
//! demand, and one compare-and-swap of the shares record (`ratelimit-shares/{downstream}`)
//! takes its [`step`] — lowering its pacing before the write, raising it only after.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Limiter;
use crate::azure::versioned::{
    compare_and_swap, Change, Conflicts, Contended, Json, RecordKind, Start, Swapped, Versioned,
};
use crate::azure::{IfChanged, StoreError};
use crate::ratelimit::demand::{demand_of, step, withdraw, Demand, Seen, SharesRecord, Tick};
use crate::ratelimit::rate_at;
use crate::sync::LockExt;

/// How often a replica reads the shares record (a conditional read: 304 while nothing
/// changed) and publishes its demand when it moved: a share freed by one replica is taken by
/// the others within about two ticks.
pub(super) const TICK: Duration = Duration::from_millis(250);

/// This replica's part of the split, and what it used since the last tick.
#[derive(Debug)]
pub(super) struct Split {
    /// The share it paces at while its lease holds (never above what the record commits).
    pacing: f64,
    /// When its last successful write of the record was sent: the lease runs from then.
    sent: Option<Instant>,
    /// The record as last read, and its ETag.
    read: Option<Versioned<SharesRecord>>,
    seen: Seen,
    /// The demand last published.
    pub(super) demand: Demand,
    /// Live replicas in the record as last read.
    pub(super) replicas: usize,
    /// Attempts waiting in the limiter now, since when one has been, and the time one was
    /// this tick.
    waiting: usize,
    waiting_since: Option<Instant>,
    waited: Duration,
    /// Attempts let through this tick, and whether one was turned away for lack of a share.
    granted: u64,
    turned_away: bool,
    since: Instant,
}

impl Split {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            pacing: 0.0,
            sent: None,
            read: None,
            seen: Seen::default(),
            demand: Demand::UpTo(0.0),
            replicas: 0,
            waiting: 0,
            waiting_since: None,
            waited: Duration::ZERO,
            granted: 0,
            turned_away: false,
            since: now,
        }
    }

    /// The share this replica may pace at `now`: none once its lease ran out.
    pub(super) fn share(&self, now: Instant, lease: Duration) -> f64 {
        match self.sent {
            Some(s) if now.saturating_duration_since(s) < lease => self.pacing,
            _ => 0.0,
        }
    }

    /// An attempt starts waiting for the limiter.
    pub(super) fn enter(&mut self, now: Instant) {
        if self.waiting == 0 {
            self.waiting_since = Some(now);
        }
        self.waiting += 1;
    }

    /// An attempt stops waiting (let through, turned away or cancelled).
    pub(super) fn leave(&mut self, now: Instant) {
        self.waiting = self.waiting.saturating_sub(1);
        if self.waiting == 0 {
            if let Some(s) = self.waiting_since.take() {
                self.waited += now.saturating_duration_since(s.max(self.since));
            }
        }
    }

    pub(super) fn granted(&mut self) {
        self.granted += 1;
    }

    pub(super) fn turned_away(&mut self) {
        self.turned_away = true;
    }

    /// What was used since the last tick, as a demand; starts the next tick's count.
    fn demand(&mut self, now: Instant, rate_per_s: f64) -> Demand {
        let span = now.saturating_duration_since(self.since);
        let mut waited = self.waited;
        if let Some(s) = self.waiting_since {
            waited += now.saturating_duration_since(s.max(self.since));
        }
        let secs = span.as_secs_f64().max(1e-3);
        let used = self.granted as f64 / secs / rate_per_s.max(1e-9);
        let d = demand_of(waited.as_secs_f64() / secs, self.turned_away, used);
        self.since = now;
        self.waited = Duration::ZERO;
        self.granted = 0;
        self.turned_away = false;
        d
    }
}

/// The shares record as this replica's compare-and-swap reads and writes it: every read is
/// seen (beats), every write's sending time kept (the lease runs from it).
struct SharesKind<'a> {
    limiter: &'a Limiter,
    sending: Mutex<Option<Instant>>,
}

#[async_trait::async_trait]
impl RecordKind for SharesKind<'_> {
    type Value = SharesRecord;
    type Error = StoreError;

    fn name(&self) -> String {
        self.limiter.shares_key.clone()
    }

    async fn read(&self) -> Result<Option<Versioned<SharesRecord>>, StoreError> {
        let l = self.limiter;
        let read = Json::<SharesRecord>::lenient(l.store.as_ref(), &l.shares_key)
            .read()
            .await?;
        l.saw(read.clone());
        Ok(read)
    }

    async fn write(&self, value: &SharesRecord, etag: Option<&str>) -> Result<String, StoreError> {
        *self.sending.locked() = Some(Instant::now());
        Json::<SharesRecord>::lenient(self.limiter.store.as_ref(), &self.limiter.shares_key)
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

impl Limiter {
    /// Keeps this replica's share of the rate until `cancel` (then withdraws it, so the
    /// others take it at once) or `crash` (then it lapses with the lease, as after a kill).
    pub async fn run(
        self: std::sync::Arc<Self>,
        cancel: CancellationToken,
        crash: CancellationToken,
    ) {
        loop {
            // A tick has a deadline like every call (half a lease): one that runs out has
            // only ever lowered this replica's pacing, never raised it.
            if self.limit().is_some()
                && tokio::time::timeout(self.lease / 2, self.tick())
                    .await
                    .is_err()
            {
                tracing::debug!(downstream = %self.downstream, "rate limit tick past its deadline");
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = crash.cancelled() => return,
                _ = tokio::time::sleep(TICK) => {}
            }
        }
        let _ = tokio::time::timeout(self.lease / 2, self.withdraw()).await;
    }

    /// Keeps what a read of the shares record showed.
    fn saw(&self, read: Option<Versioned<SharesRecord>>) {
        let mut st = self.state();
        let now = Instant::now();
        let empty = SharesRecord::default();
        st.split
            .seen
            .observe(read.as_ref().map_or(&empty, |r| &r.value), now);
        st.split.read = read;
    }

    /// Reads the shares record if it changed (else the copy stands).
    async fn read_shares(&self) -> Result<(), StoreError> {
        let etag = self.state().split.read.as_ref().map(|r| r.etag.clone());
        let read = match etag {
            Some(e) => self.store.read_if_changed(&self.shares_key, &e).await?,
            None => match self.store.read(&self.shares_key).await? {
                Some(r) => IfChanged::Changed(r),
                None => IfChanged::Missing,
            },
        };
        match read {
            IfChanged::Changed(r) => {
                let value: SharesRecord = serde_json::from_slice(&r.body).unwrap_or_default();
                self.saw(Some(Versioned::new(value, r.etag)));
            }
            IfChanged::Missing => self.saw(None),
            IfChanged::Unchanged => {
                let read = self.state().split.read.clone();
                self.saw(read);
            }
        }
        Ok(())
    }

    /// One tick: publish what this replica can use and take its share (see [`step`]).
    /// Storage trouble leaves the share as it is until the lease lapses.
    pub(crate) async fn tick(&self) {
        let Some(limit) = self.limit() else {
            return;
        };
        if let Err(e) = self.read_shares().await {
            tracing::debug!(error = %e, "rate limit shares not read; the share stands until its lease lapses");
            return;
        }
        let (demand, start) = {
            let mut st = self.state();
            let rate = rate_at(&st.record, limit, self.clock.now(), &self.adaptation);
            let d = st.split.demand(Instant::now(), rate);
            st.split.demand = d;
            (d, st.split.read.clone())
        };
        let kind = SharesKind {
            limiter: self,
            sending: Mutex::new(None),
        };
        let swapped = compare_and_swap(&kind, Start::From(start), |current| {
            let current = current.unwrap_or_default();
            let now = Instant::now();
            let mut st = self.state();
            let renew = st
                .split
                .sent
                .is_none_or(|s| now.saturating_duration_since(s) >= self.lease / 4);
            let decided = step(
                &current,
                &st.split.seen,
                Tick {
                    me: &self.owner,
                    demand,
                    now,
                    drop_after: self.lease + TICK * 2,
                    renew,
                    first_beat: uuid::Uuid::new_v4().as_u64_pair().0,
                },
            );
            st.split.replicas = current.replicas.len();
            // Down at once, before anything is written.
            if decided.now_at_most < st.split.pacing {
                st.split.pacing = decided.now_at_most;
                self.bump(&mut st);
            }
            match decided.write {
                Some(next) => Change::Write(Box::new(next), decided.share),
                None => Change::Keep(decided.share),
            }
        })
        .await;
        let sent = kind.sending.locked().take();
        {
            let mut st = self.state();
            match swapped {
                Ok(Swapped {
                    written: Some(written),
                    value: share,
                }) => {
                    st.split.replicas = written.value.replicas.len();
                    st.split.read = Some(written);
                    st.split.sent = sent.or(st.split.sent);
                    self.set_pacing(&mut st, share);
                }
                // Nothing to change: the record commits this share to this replica.
                Ok(Swapped { value: share, .. }) => self.set_pacing(&mut st, share),
                Err(e) => {
                    tracing::debug!(error = %e, "rate limit share not written; it stands until its lease lapses")
                }
            }
        }
        self.publish();
    }

    fn set_pacing(&self, st: &mut super::State, share: f64) {
        if share != st.split.pacing {
            st.split.pacing = share;
            self.bump(st);
        }
    }

    /// A clean stop: pace no more, and take this replica's entry out of the record so the
    /// others take its share at once.
    pub(super) async fn withdraw(&self) {
        {
            let mut st = self.state();
            st.split.pacing = 0.0;
            st.split.sent = None;
            self.bump(&mut st);
        }
        self.publish();
        let kind = SharesKind {
            limiter: self,
            sending: Mutex::new(None),
        };
        let start = self.state().split.read.clone();
        let withdrawn = compare_and_swap(&kind, Start::From(start), |current| {
            match withdraw(&current.unwrap_or_default(), &self.owner) {
                Some(next) => Change::Write(Box::new(next), ()),
                None => Change::Keep(()),
            }
        })
        .await;
        if let Err(e) = withdrawn {
            tracing::debug!(error = %e, "rate limit share not withdrawn; the others take it when its lease lapses");
        }
    }
}
