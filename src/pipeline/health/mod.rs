//! What the pipeline says about itself: held partitions and why, the retry loop's state, and
//! counters — for `/readyz`, the status API, logs and tests.
//!
//! One state behind one lock; times are [`SystemTime`]s of the pipeline's [`Clock`] and
//! become RFC 3339 only in the [`HealthReport`] the status API serves. The mutators are
//! crate-private: the pipeline's loops change health, and its counters change only through
//! the `Observer` that records the matching metric, so an embedder reads health and cannot
//! falsify it.

use crate::sync::LockExt;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use super::observe::Counters;
use crate::clock::{rfc3339, Clock};
mod report;
mod skew;

/// Each service's offset as `/v1/status` reports it (`hubguard check` prints the same).
#[cfg(feature = "cli")]
pub(crate) use skew::offset as clock_offset;
#[cfg(feature = "cli")]
pub(crate) use skew::offsets as clock_offsets;
pub use skew::ClockOffset;

pub use report::{
    ConsumerState, CounterSnapshot, HealthReport, Held, HeldRetry, HoldCause, HoldSubject, Lag,
    NotLive, RetryLoopState,
};

/// One hold as recorded: on one event of its subject, or on none.
#[derive(Debug, Clone)]
struct Hold {
    cause: HoldCause,
    since: SystemTime,
    reason: String,
}

/// How long a `record_missing` dead letter keeps readiness at 503: long enough for an alert
/// on readiness to fire and an operator to see the key, short enough not to stall a rollout.
pub const RECORD_MISSING_READINESS: Duration = Duration::from_secs(900);
/// Something work can wait on besides its own schedule and the partitions' holds (the
/// downstream's circuit breaker): why it does now, or `None`. Read by [`Health::ready`].
pub trait WaitingOn: std::fmt::Debug + Send + Sync + 'static {
    /// Why work waits on it now (`None`: it does not).
    fn waiting(&self) -> Option<String>;
}

/// The last retry dead-lettered as `record_missing`.
#[derive(Debug, Clone)]
struct RecordMissing {
    key: String,
    at: SystemTime,
}

/// Everything health records, behind [`Health`]'s one lock.
#[derive(Debug)]
struct State {
    waits: Vec<Arc<dyn WaitingOn>>,
    /// The downstream's storm guard, shown in the report.
    storm: Option<Arc<crate::breaker::storm::Guard>>,
    /// Holds by subject, then by event (`None`: on the subject as a whole, listed first).
    holds: BTreeMap<HoldSubject, BTreeMap<Option<i64>, Hold>>,
    /// Owned partitions and their last checkpoint.
    owned: BTreeMap<String, Option<i64>>,
    retry_loop: RetryLoopState,
    consumer: ConsumerState,
    held_retries: BTreeMap<String, HeldRetry>,
    unowned: Vec<String>,
    unhealthy_after: Option<Duration>,
    lag: BTreeMap<String, Lag>,
    owner_conflict: Option<String>,
    record_missing: Option<RecordMissing>,
    foreign: BTreeMap<String, u64>,
}

impl Default for State {
    fn default() -> Self {
        Self {
            waits: Vec::new(),
            storm: None,
            holds: BTreeMap::new(),
            owned: BTreeMap::new(),
            retry_loop: RetryLoopState::Starting,
            consumer: ConsumerState::Starting,
            held_retries: BTreeMap::new(),
            unowned: Vec::new(),
            unhealthy_after: None,
            lag: BTreeMap::new(),
            owner_conflict: None,
            record_missing: None,
            foreign: BTreeMap::new(),
        }
    }
}

impl State {
    /// Held subjects: for each, the oldest held event's reason and sequence number, since
    /// the earliest hold began.
    fn held(&self) -> BTreeMap<String, Held> {
        self.held_subjects()
            .into_iter()
            .map(|(subject, h)| (subject.to_string(), h))
            .collect()
    }

    /// [`held`](Self::held), by subject.
    fn held_subjects(&self) -> Vec<(&HoldSubject, Held)> {
        self.holds
            .iter()
            .filter_map(|(subject, events)| {
                let (event, oldest) = events.iter().next()?;
                let since = events.values().map(|e| e.since).min()?;
                Some((
                    subject,
                    Held {
                        cause: oldest.cause,
                        since,
                        reason: oldest.reason.clone(),
                        oldest_unsettled: event.unwrap_or_else(|| subject.no_event_wire()),
                        event: *event,
                    },
                ))
            })
            .collect()
    }
}

/// Shared health of one pipeline.
#[derive(Debug)]
pub struct Health {
    state: Mutex<State>,
    counters: Counters,
    clock: Arc<Clock>,
    /// Readiness fails while this host is further than this from Service Bus's clock.
    max_skew: Duration,
    changed: watch::Sender<u64>,
}

impl Default for Health {
    /// Health on the wall clock.
    fn default() -> Self {
        Self::new(Arc::new(Clock::default()))
    }
}

impl Health {
    /// Health whose times come from `clock` (the pipeline's).
    pub(crate) fn new(clock: Arc<Clock>) -> Self {
        Self {
            state: Mutex::default(),
            counters: Counters::default(),
            clock,
            max_skew: crate::pipeline::options::DEFAULT_MAX_CLOCK_SKEW,
            changed: watch::channel(0).0,
        }
    }

    /// Readiness fails while this host's clock is further than `bound` from Service Bus's.
    pub(crate) fn with_max_skew(mut self, bound: Duration) -> Self {
        self.max_skew = bound;
        self
    }

    /// Each service's clock against this host's, as measured.
    pub fn clock_offsets(&self) -> Vec<ClockOffset> {
        skew::offsets(&self.clock, self.max_skew)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Changes the state under its lock with `change`, and publishes the change (see
    /// [`subscribe`](Self::subscribe)) after the lock is released, if `change` says it made one.
    fn change(&self, change: impl FnOnce(&mut State) -> bool) {
        let changed = change(&mut self.state());
        if changed {
            self.bump();
        }
    }

    /// The clock health's times come from (the pipeline's).
    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The counters, for the `Observer` that bumps them beside the metrics.
    pub(super) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Resolves whenever something changes (for tests that wait on conditions).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Records that `subject` is held, on its event `event` (its settlement is failing) or
    /// on none. With `max_in_flight` above 1 several events of a partition can hold at once;
    /// the partition is reported held until the last of them settles, with the oldest one's
    /// reason.
    pub(crate) fn hold(
        &self,
        subject: HoldSubject,
        event: Option<i64>,
        cause: HoldCause,
        reason: String,
    ) {
        let now = self.clock.now();
        self.change(|st| {
            let events = st.holds.entry(subject.clone()).or_default();
            let previous = events.get(&event);
            let since = previous.map_or(now, |x| x.since);
            if previous.map(|x| &x.reason) != Some(&reason) {
                tracing::warn!(partition = %subject, %reason, oldest_unsettled = ?event, "partition held: its checkpoint will not pass the unsettled event");
            }
            events.insert(
                event,
                Hold {
                    cause,
                    since,
                    reason,
                },
            );
            true
        });
    }

    /// Records that event `seq` of `partition` is held (see [`hold`](Self::hold)).
    pub(crate) fn hold_event(&self, partition: &str, seq: i64, cause: HoldCause, reason: String) {
        self.hold(HoldSubject::partition(partition), Some(seq), cause, reason)
    }

    /// Records that `subject` is no longer held on `event` (or on none).
    pub(crate) fn release(&self, subject: &HoldSubject, event: Option<i64>) {
        self.change(|st| {
            let Some(events) = st.holds.get_mut(subject) else {
                return false;
            };
            let removed = events.remove(&event);
            let now_free = events.is_empty();
            if now_free {
                st.holds.remove(subject);
            }
            let Some(held) = removed else {
                return false;
            };
            if now_free {
                tracing::info!(partition = %subject, since = %rfc3339(held.since), "partition released: settlement succeeded");
            }
            true
        });
    }

    /// Records that event `seq` of `partition` is no longer held.
    pub(crate) fn release_event(&self, partition: &str, seq: i64) {
        self.release(&HoldSubject::partition(partition), Some(seq))
    }

    /// Makes readiness also say no while `source` has work waiting on it.
    pub(crate) fn watch(&self, source: Arc<dyn WaitingOn>) {
        self.state().waits.push(source);
    }

    /// Shows the downstream's storm guard in the report (`storm_guard`).
    pub(crate) fn set_storm_guard(&self, guard: Arc<crate::breaker::storm::Guard>) {
        self.state().storm = Some(guard);
    }

    /// Held partitions (and the handler, a pause, the rate limit), by the name readiness
    /// lists them under: for each, the oldest held event's reason and sequence number, since
    /// the earliest hold began.
    pub fn held(&self) -> BTreeMap<String, Held> {
        self.state().held()
    }

    /// How long each hold has lasted and its label, by what it holds: a partition's own holds
    /// and an operator's pause of it under the partition's id (the longest), the handler's
    /// and the rate limit's under the names readiness lists them by. For the operational
    /// event `partition.held`, whose subject is the partition.
    pub(crate) fn held_by_partition(&self) -> BTreeMap<String, (&'static str, f64)> {
        let now = self.clock.now();
        let st = self.state();
        let mut out: BTreeMap<String, (&'static str, f64)> = BTreeMap::new();
        for (subject, h) in st.held_subjects() {
            let name = match subject {
                HoldSubject::Partition(id) | HoldSubject::PausedPartition(id) => id.clone(),
                other => other.to_string(),
            };
            let secs = now
                .duration_since(h.since)
                .unwrap_or_default()
                .as_secs_f64();
            let longer = out.get(&name).is_none_or(|(_, s)| secs > *s);
            if longer {
                out.insert(name, (h.cause.label(), secs));
            }
        }
        out
    }

    /// Records that this replica processes `partition` (and its last checkpoint).
    pub(crate) fn set_owned(&self, partition: &str, checkpoint: Option<i64>) {
        self.state().owned.insert(partition.into(), checkpoint);
        self.bump();
    }

    /// Records that this replica gave `partition` up (which ends the partition's holds).
    pub(crate) fn unset_owned(&self, partition: &str) {
        self.change(|st| {
            st.owned.remove(partition);
            st.holds.remove(&HoldSubject::partition(partition));
            true
        });
    }

    /// Partitions this replica processes, with their last checkpointed sequence number
    /// (`None`: no checkpoint yet).
    pub fn owned(&self) -> BTreeMap<String, Option<i64>> {
        self.state().owned.clone()
    }

    /// Records a partition's checkpoint lag: events received but not covered by the
    /// checkpoint, and the age in seconds of the oldest of them.
    pub(crate) fn set_lag(&self, partition: &str, lag: Lag) {
        self.state().lag.insert(partition.into(), lag);
    }

    /// Checkpoint lag per partition.
    pub fn lag(&self) -> BTreeMap<String, Lag> {
        self.state().lag.clone()
    }

    /// Sets the retry loop's state.
    pub(crate) fn set_retry_loop(&self, s: RetryLoopState) {
        self.state().retry_loop = s;
        self.bump();
    }

    /// The retry loop's state.
    pub fn retry_loop(&self) -> RetryLoopState {
        self.state().retry_loop.clone()
    }

    /// The consumer is running (the processor was built and runs).
    pub(crate) fn consumer_running(&self) {
        self.change(|st| {
            if st.consumer == ConsumerState::Running {
                return false;
            }
            if matches!(st.consumer, ConsumerState::Failing { .. }) {
                tracing::info!("the Event Hubs consumer recovered");
            }
            st.consumer = ConsumerState::Running;
            true
        });
    }

    /// The consumer failed with `error` (and is being rebuilt).
    pub(crate) fn consumer_failed(&self, error: String) {
        let now = self.clock.now();
        self.change(|st| {
            let (since, failures) = match &st.consumer {
                ConsumerState::Failing {
                    since, failures, ..
                } => (*since, failures + 1),
                _ => (now, 1),
            };
            st.consumer = ConsumerState::Failing {
                since,
                failures,
                error,
            };
            true
        });
    }

    /// The consumer's state.
    pub fn consumer(&self) -> ConsumerState {
        self.state().consumer.clone()
    }

    /// How long the consumer has been failing without a break, if it is.
    pub fn consumer_failing_for(&self) -> Option<Duration> {
        match self.state().consumer {
            ConsumerState::Failing { since, .. } => {
                Some(self.clock.now().duration_since(since).unwrap_or_default())
            }
            _ => None,
        }
    }

    /// Records that the due retry `message_id` (of `key`) is held: `reason` keeps failing.
    pub(crate) fn hold_retry(&self, message_id: &str, key: &str, reason: String) {
        let now = self.clock.now();
        self.change(|st| {
            let since = st.held_retries.get(message_id).map_or(now, |x| x.since);
            st.held_retries.insert(
                message_id.to_string(),
                HeldRetry {
                    key: key.to_string(),
                    since,
                    reason,
                },
            );
            true
        });
    }

    /// Records that the retry `message_id` is no longer held.
    pub(crate) fn release_retry(&self, message_id: &str) {
        let removed = self.state().held_retries.remove(message_id);
        if removed.is_some() {
            self.bump();
        }
    }

    /// Remembers the latest retry dead-lettered as `record_missing`, for readiness (see
    /// [`RECORD_MISSING_READINESS`]); the `Observer` counts it.
    pub(super) fn record_missing(&self, key: &str) {
        let at = self.clock.now();
        self.state().record_missing = Some(RecordMissing {
            key: key.to_string(),
            at,
        });
        self.bump();
    }

    /// Records a retry of `deployment` (another one) received from the shared queue.
    pub(crate) fn saw_foreign(&self, deployment: &str) {
        *self
            .state()
            .foreign
            .entry(deployment.to_string())
            .or_default() += 1;
    }

    /// Due retries held now, by MessageId.
    pub fn held_retries(&self) -> BTreeMap<String, HeldRetry> {
        self.state().held_retries.clone()
    }

    /// Sets the partitions of the hub that no replica has owned for longer than ownership
    /// takes to expire and be claimed again.
    pub(crate) fn set_unowned(&self, partitions: Vec<String>) {
        self.change(|st| {
            if st.unowned == partitions {
                return false;
            }
            if !partitions.is_empty() {
                tracing::warn!(
                    ?partitions,
                    "partitions of the hub are owned by no replica: nothing reads them"
                );
            }
            st.unowned = partitions;
            true
        });
    }

    /// Sets how long the consumer may fail without a break before [`live`](Self::live) says no.
    pub(crate) fn set_unhealthy_after(&self, limit: Option<Duration>) {
        self.state().unhealthy_after = limit;
    }

    /// Liveness (`/healthz`): refused once the Event Hubs consumer has failed without a
    /// break for longer than the limit. hubguard never exits on a failing dependency by itself
    /// — everything it must not lose is durable, and it rebuilds the consumer with backoff —
    /// but a process that has not read the hub for that long is better restarted by its
    /// orchestrator with fresh connections. Everything else (a held partition, a retry loop
    /// in its watchdog) is readiness, not liveness: a restart would not mend a dependency.
    pub fn live(&self) -> Result<(), NotLive> {
        let now = self.clock.now();
        let st = self.state();
        match (st.unhealthy_after, &st.consumer) {
            (Some(limit), ConsumerState::Failing { since, error, .. }) => {
                let failing_for = now.duration_since(*since).unwrap_or_default();
                if failing_for >= limit {
                    return Err(NotLive {
                        failing_for,
                        limit,
                        error: error.clone(),
                    });
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Partitions no replica owns.
    pub fn unowned(&self) -> Vec<String> {
        self.state().unowned.clone()
    }

    /// Why this replica is not making the progress it should, one line per cause; empty when
    /// ready. `/readyz` answers 503 with these.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        let now = self.clock.now();
        let records_missing = self.counters.snapshot().records_missing;
        // Work deferred past a breaker's expiry waits in Service Bus while no partition
        // holds anything: the breaker itself says so. Asked outside the lock (it reads its
        // own state), as the retry loop's state is read after it.
        let (mut r, retry_loop, waits) = {
            let st = self.state();
            let mut r = Vec::new();
            match &st.consumer {
                ConsumerState::Running => {}
                ConsumerState::Starting => r.push("Event Hubs consumer starting".to_string()),
                ConsumerState::Failing {
                    since,
                    failures,
                    error,
                } => r.push(format!(
                    "Event Hubs consumer failing since {} ({failures} attempts): {error}",
                    rfc3339(*since)
                )),
            }
            if let Some(conflict) = &st.owner_conflict {
                r.push(conflict.clone());
            }
            if !st.unowned.is_empty() {
                r.push(format!(
                    "partitions {} are owned by no replica",
                    st.unowned.join(", ")
                ));
            }
            for (p, h) in st.held() {
                r.push(format!(
                    "partition {p} held since {}: {}; oldest unsettled sequence number {}",
                    rfc3339(h.since),
                    h.reason,
                    h.oldest_unsettled
                ));
            }
            for (id, h) in &st.held_retries {
                r.push(format!(
                    "retry {id} (key {}) held since {}: {}",
                    h.key,
                    rfc3339(h.since),
                    h.reason
                ));
            }
            if let Some(m) = st
                .record_missing
                .as_ref()
                .filter(|m| now.duration_since(m.at).unwrap_or_default() < RECORD_MISSING_READINESS)
            {
                r.push(format!(
                    "{records_missing} retries found no ledger record and their event gone from Event Hubs; dead-lettered as record_missing, the latest key {:?} at {} (hubguard dead-letters list)",
                    m.key,
                    rfc3339(m.at)
                ));
            }
            (r, st.retry_loop.clone(), st.waits.clone())
        };
        r.extend(waits.iter().filter_map(|w| w.waiting()));
        r.extend(skew::reason(&self.clock, self.max_skew));
        match retry_loop {
            RetryLoopState::Running => {}
            RetryLoopState::Starting => r.push("retry loop starting".into()),
            RetryLoopState::Stopped => r.push("retry loop stopped".into()),
            RetryLoopState::Reconnecting { failures, error } => r.push(format!(
                "retry loop reconnecting after {failures} failed receive(s): {error}"
            )),
            RetryLoopState::Watchdog { failures, error } => r.push(format!(
                "retry loop in its watchdog after {failures} failed receives: {error}"
            )),
        }
        r
    }

    /// Records why this process may not use its owner id (another live process holds it),
    /// or that it may (`None`).
    pub(crate) fn set_owner_conflict(&self, reason: Option<String>) {
        self.change(|st| {
            let changed = st.owner_conflict != reason;
            st.owner_conflict = reason;
            changed
        });
    }

    /// Why this process may not use its owner id, if it may not.
    pub fn owner_conflict(&self) -> Option<String> {
        self.state().owner_conflict.clone()
    }

    /// Ready: the consumer runs, every partition has an owner, nothing is held and the retry
    /// loop runs.
    pub fn ready(&self) -> bool {
        self.not_ready_reasons().is_empty()
    }

    /// The counters now.
    pub fn snapshot(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    /// Everything, as a typed report.
    pub fn status(&self) -> HealthReport {
        let not_ready = self.not_ready_reasons();
        let counters = self.snapshot();
        let storm = self.state().storm.clone();
        let storm_guard = storm.map(|g| g.report());
        let st = self.state();
        HealthReport {
            storm_guard,
            ready: not_ready.is_empty(),
            not_ready,
            consumer: st.consumer.clone(),
            unowned_partitions: st.unowned.clone(),
            held_retries: st.held_retries.clone(),
            held_partitions: st.held(),
            owned_partitions: st
                .owned
                .iter()
                .map(|(p, cp)| (p.clone(), cp.unwrap_or(-1)))
                .collect(),
            retry_loop: st.retry_loop.clone(),
            checkpoint_lag: st.lag.clone(),
            counters,
            other_deployments_seen: st.foreign.clone(),
            clocks: self.clock_offsets(),
        }
    }

    /// Everything, as JSON ([`status`](Self::status) serialised).
    pub fn report(&self) -> serde_json::Value {
        serde_json::to_value(self.status()).unwrap_or_default()
    }
}

impl crate::telemetry::gauges::PipelineReadings for Health {
    fn clock_offsets(&self) -> Vec<(&'static str, f64)> {
        self.clock_offsets()
            .into_iter()
            .filter_map(|c| Some((c.service, c.offset_ms? as f64 / 1000.0)))
            .collect()
    }

    fn held_by_reason(&self) -> BTreeMap<&'static str, u64> {
        let mut by_reason = BTreeMap::new();
        for held in self.held().values() {
            *by_reason.entry(held.cause.label()).or_default() += 1;
        }
        by_reason
    }

    fn retry_loop_code(&self) -> u64 {
        self.retry_loop().gauge_value()
    }

    fn checkpoint_lag(&self) -> BTreeMap<String, (u64, f64)> {
        self.lag()
            .into_iter()
            .map(|(p, l)| (p, (l.events, l.seconds)))
            .collect()
    }

    fn held_for(&self) -> BTreeMap<String, (&'static str, f64)> {
        let now = self.clock.now();
        self.held()
            .into_iter()
            .map(|(p, h)| {
                let since = now.duration_since(h.since).unwrap_or_default();
                (p, (h.cause.label(), since.as_secs_f64()))
            })
            .collect()
    }

    fn owned_count(&self) -> u64 {
        self.state().owned.len() as u64
    }

    fn unowned(&self) -> Vec<String> {
        Health::unowned(self)
    }

    fn ready(&self) -> bool {
        Health::ready(self)
    }

    fn consumer_code(&self) -> u64 {
        self.consumer().gauge_value()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_fails_only_after_the_consumer_failed_for_the_limit() {
        let h = Health::default();
        h.set_unhealthy_after(Some(std::time::Duration::ZERO));
        assert!(h.live().is_ok(), "starting is not a failure");
        h.consumer_failed("opening the Event Hubs consumer at ns: refused".into());
        let e = h.live().unwrap_err().to_string();
        assert!(e.contains("refused"), "{e}");
        h.consumer_running();
        assert!(h.live().is_ok());
        h.consumer_failed("again".into());
        h.set_unhealthy_after(Some(std::time::Duration::from_secs(3600)));
        assert!(h.live().is_ok(), "not for long enough");
        h.set_unhealthy_after(None);
        assert!(h.live().is_ok(), "disabled");
    }

    #[test]
    fn the_gauges_read_held_time_ownership_readiness_and_the_consumer() {
        use crate::telemetry::gauges::PipelineReadings;
        let h = Health::default();
        assert_eq!(h.consumer_code(), 0, "starting");
        assert!(!PipelineReadings::ready(&h));
        h.consumer_running();
        h.set_retry_loop(RetryLoopState::Running);
        assert_eq!(h.consumer_code(), 1);
        assert!(PipelineReadings::ready(&h));
        assert!(h.held_for().is_empty());
        h.set_owned("0", Some(4));
        h.set_owned("1", None);
        assert_eq!(h.owned_count(), 2);
        h.hold_event(
            "1",
            7,
            HoldCause::ServiceBus,
            "Service Bus unavailable".into(),
        );
        let held = h.held_for();
        let (reason, secs) = held["1"];
        assert_eq!(reason, "service_bus");
        assert!((0.0..60.0).contains(&secs), "{secs}");
        assert!(!PipelineReadings::ready(&h));
        h.set_unowned(vec!["3".into()]);
        assert_eq!(PipelineReadings::unowned(&h), vec!["3".to_string()]);
        h.consumer_failed("refused".into());
        assert_eq!(h.consumer_code(), 2);
        h.unset_owned("1");
        assert_eq!(h.owned_count(), 1);
        assert!(
            h.held_for().is_empty(),
            "giving a partition up ends its hold"
        );
    }

    #[test]
    fn readiness_names_every_cause() {
        let h = Health::default();
        h.consumer_running();
        h.set_retry_loop(RetryLoopState::Running);
        assert!(h.ready(), "{:?}", h.not_ready_reasons());
        h.hold_event(
            "3",
            42,
            HoldCause::ServiceBus,
            "Service Bus unavailable: down".into(),
        );
        h.hold_retry("k-attempt-2", "k", "reading the ledger failed: x".into());
        h.set_unowned(vec!["5".into()]);
        let reasons = h.not_ready_reasons().join("\n");
        for needle in [
            "partition 3 held",
            "Service Bus unavailable",
            "retry k-attempt-2",
            "partitions 5",
        ] {
            assert!(reasons.contains(needle), "{needle}: {reasons}");
        }
        h.release_event("3", 42);
        h.release_retry("k-attempt-2");
        h.set_unowned(Vec::new());
        assert!(h.ready());
    }

    #[test]
    fn times_come_from_the_clock_and_holds_on_no_event_keep_their_wire_values() {
        use crate::telemetry::gauges::PipelineReadings;
        let clock = Arc::new(Clock::default());
        let h = Health::new(clock.clone());
        h.hold_event("0", 5, HoldCause::Ledger, "blob storage down".into());
        h.hold(
            HoldSubject::Handler("https://example.test".into()),
            None,
            HoldCause::HandlerBlocked,
            "handshake not agreed".into(),
        );
        h.hold(
            HoldSubject::PausedPartition("1".into()),
            None,
            HoldCause::Paused,
            "paused by ops".into(),
        );
        clock.advance(Duration::from_secs(600));
        let held_for = h.held_for();
        assert!(held_for["0"].1 >= 600.0, "{held_for:?}");
        let report = h.report();
        let held = &report["held_partitions"];
        assert_eq!(held["0"]["oldest_unsettled"], 5);
        assert_eq!(held["handler https://example.test"]["oldest_unsettled"], 0);
        assert_eq!(held["1 (paused)"]["oldest_unsettled"], -1);
        assert_eq!(held["1 (paused)"]["cause"], "paused");
        let since = held["0"]["since"].as_str().unwrap();
        assert!(
            time::OffsetDateTime::parse(since, &time::format_description::well_known::Rfc3339)
                .is_ok(),
            "{since}"
        );
        assert!(held["0"].get("event").is_none(), "not on the wire");
        assert_eq!(h.held()["1 (paused)"].event, None);
        assert_eq!(h.held()["0"].event, Some(5));

        // A hold on the partition as a whole (a corrupt checkpoint) comes first.
        h.hold(
            HoldSubject::partition("0"),
            None,
            HoldCause::CorruptCheckpoint,
            "unreadable".into(),
        );
        assert_eq!(h.held()["0"].cause, HoldCause::CorruptCheckpoint);
        assert_eq!(h.report()["held_partitions"]["0"]["oldest_unsettled"], -1);
        h.release(&HoldSubject::partition("0"), None);
        assert_eq!(h.held()["0"].cause, HoldCause::Ledger);
    }

    #[test]
    fn the_report_keeps_its_field_names() {
        let h = Health::default();
        h.set_owned("0", None);
        h.set_owned("1", Some(9));
        h.set_lag(
            "1",
            Lag {
                events: 3,
                seconds: 1.5,
            },
        );
        h.consumer_failed("refused".into());
        let r = h.report();
        let mut keys: Vec<_> = r.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "checkpoint_lag",
                "clocks",
                "consumer",
                "counters",
                "held_partitions",
                "held_retries",
                "not_ready",
                "other_deployments_seen",
                "owned_partitions",
                "ready",
                "retry_loop",
                "unowned_partitions",
            ]
        );
        assert_eq!(r["owned_partitions"]["0"], -1);
        assert_eq!(r["owned_partitions"]["1"], 9);
        assert_eq!(
            r["checkpoint_lag"]["1"],
            serde_json::json!({ "events": 3, "seconds": 1.5 })
        );
        assert_eq!(r["consumer"]["state"], "failing");
        assert_eq!(r["consumer"]["failures"], 1);
        assert!(r["consumer"]["since"].is_string());
        assert_eq!(r["retry_loop"]["state"], "starting");
        assert_eq!(r["ready"], false);
    }

    #[test]
    fn liveness_runs_on_the_clock() {
        let clock = Arc::new(Clock::default());
        let h = Health::new(clock.clone());
        h.set_unhealthy_after(Some(Duration::from_secs(900)));
        h.consumer_failed("refused".into());
        assert!(h.live().is_ok());
        clock.advance(Duration::from_secs(901));
        let e = h.live().unwrap_err();
        assert_eq!(e.limit, Duration::from_secs(900));
        assert!(e.to_string().contains("limit 900s): refused"), "{e}");
    }
}
