//! What the pipeline says about itself: held partitions and why, the retry loop's state, and
//! counters — for `/readyz`, the status API, logs and tests.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Serialize;
use tokio::sync::watch;

use crate::clock::rfc3339;

/// What holds a partition, as a closed set: the `reason` label of
/// `hubguard_partitions_held`, and what callers branch on. [`Held::reason`] says the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldCause {
    /// Service Bus (the retry queue) is unavailable or refuses the request.
    ServiceBus,
    /// Blob storage (the ledger) is unavailable or refuses the request.
    Ledger,
    /// The dead-letter destination is unavailable or refuses the dead letter.
    DeadLetterDestination,
    /// The downstream's circuit breaker is open: Event Hubs holds the backlog.
    BreakerOpen,
    /// The handler cannot deliver yet (a webhook that has not agreed to receive).
    HandlerBlocked,
    /// The partition's checkpoint blob holds no readable position.
    CorruptCheckpoint,
    /// An operator paused the partition (`hubguard partitions pause`).
    Paused,
}

impl HoldCause {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::ServiceBus => "service_bus",
            Self::Ledger => "ledger",
            Self::DeadLetterDestination => "dead_letter_destination",
            Self::BreakerOpen => "breaker_open",
            Self::HandlerBlocked => "handler_blocked",
            Self::CorruptCheckpoint => "corrupt_checkpoint",
            Self::Paused => "paused",
        }
    }
}

/// Why a partition is held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Held {
    /// What holds it.
    pub cause: HoldCause,
    /// Since when (RFC 3339).
    pub since: String,
    /// The dependency that failed and how.
    pub reason: String,
    /// The oldest unsettled sequence number: nothing at or after it is checkpointed.
    pub oldest_unsettled: i64,
}

/// The retry loop's state (three layers of recovery: retry at once with backoff, then a watchdog at a slow pace).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum RetryLoopState {
    /// Not started yet.
    Starting,
    /// Receiving.
    Running,
    /// Receive failed; reconnecting with backoff.
    Reconnecting {
        /// Consecutive failures.
        failures: u32,
        /// The last error.
        error: String,
    },
    /// Reconnects keep failing; the watchdog keeps trying at its slow pace.
    Watchdog {
        /// Consecutive failures.
        failures: u32,
        /// The last error.
        error: String,
    },
    /// Stopped (shutdown).
    Stopped,
}

/// The Event Hubs consumer's state: is this replica reading the hub at all?
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum ConsumerState {
    /// Not connected yet.
    Starting,
    /// The processor runs: partitions are claimed and read.
    Running,
    /// Opening the consumer or running the processor fails; it is rebuilt with backoff.
    Failing {
        /// Since when (RFC 3339).
        since: String,
        /// Consecutive failures.
        failures: u32,
        /// The last error, naming the endpoint.
        error: String,
    },
}

/// A due retry held (its settlement keeps failing) under a renewed lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeldRetry {
    /// The event's idempotency key.
    pub key: String,
    /// Since when (RFC 3339).
    pub since: String,
    /// What failed.
    pub reason: String,
}

/// Counters of the pipeline.
#[derive(Debug, Default)]
pub struct Counters {
    /// Events delivered (any attempt).
    pub delivered: AtomicU64,
    /// Retries scheduled.
    pub retries_scheduled: AtomicU64,
    /// Events dead-lettered.
    pub dead_lettered: AtomicU64,
    /// Settlements that failed (and were retried).
    pub settle_failures: AtomicU64,
    /// Checkpoints written.
    pub checkpoints: AtomicU64,
    /// Handler calls.
    pub attempts: AtomicU64,
    /// Retries taken back from Service Bus's dead-letter sub-queue.
    pub rescued: AtomicU64,
    /// Overdue retries the ledger recorded and nothing ran, scheduled again.
    pub recovered: AtomicU64,
    /// Retries of another deployment handed back to a shared queue.
    pub forwarded: AtomicU64,
    /// Missing ledger records rebuilt from the event read back from Event Hubs.
    pub records_rebuilt: AtomicU64,
    /// Retries dead-lettered as `record_missing`.
    pub records_missing: AtomicU64,
    /// Events parked behind an earlier event of their ordering key (ordered retries).
    pub parked: AtomicU64,
    /// Parked events released from their line (scheduled to run, due now).
    pub released: AtomicU64,
}

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CounterSnapshot {
    /// Events delivered.
    pub delivered: u64,
    /// Retries scheduled.
    pub retries_scheduled: u64,
    /// Events dead-lettered.
    pub dead_lettered: u64,
    /// Failed settlements.
    pub settle_failures: u64,
    /// Checkpoints written.
    pub checkpoints: u64,
    /// Handler calls.
    pub attempts: u64,
    /// Retries taken back from Service Bus's dead-letter sub-queue.
    pub rescued: u64,
    /// Overdue retries the ledger recorded and nothing ran, scheduled again.
    pub recovered: u64,
    /// Retries of another deployment handed back to a shared queue.
    pub forwarded: u64,
    /// Missing ledger records rebuilt from the event read back from Event Hubs.
    pub records_rebuilt: u64,
    /// Retries dead-lettered as `record_missing`.
    pub records_missing: u64,
    /// Events parked behind an earlier event of their ordering key (ordered retries).
    pub parked: u64,
    /// Parked events released from their line.
    pub released: u64,
}

/// How long a `record_missing` dead letter keeps readiness at 503: long enough for an alert
/// on readiness to fire and an operator to see the key, short enough not to stall a rollout.
pub const RECORD_MISSING_READINESS: std::time::Duration = std::time::Duration::from_secs(900);
/// Something work can wait on besides its own schedule and the partitions' holds (the
/// downstream's circuit breaker): why it does now, or `None`. Read by [`Health::ready`].
pub trait WaitingOn: std::fmt::Debug + Send + Sync + 'static {
    /// Why work waits on it now (`None`: it does not).
    fn waiting(&self) -> Option<String>;
}

/// Shared health of one pipeline.
#[derive(Debug)]
pub struct Health {
    waits: Mutex<Vec<std::sync::Arc<dyn WaitingOn>>>,
    held: Mutex<BTreeMap<String, BTreeMap<i64, Held>>>,
    owned: Mutex<BTreeMap<String, i64>>,
    retry_loop: Mutex<RetryLoopState>,
    consumer: Mutex<(ConsumerState, Option<std::time::Instant>)>,
    held_retries: Mutex<BTreeMap<String, HeldRetry>>,
    unowned: Mutex<Vec<String>>,
    unhealthy_after: Mutex<Option<std::time::Duration>>,
    lag: Mutex<BTreeMap<String, (u64, f64)>>,
    owner_conflict: Mutex<Option<String>>,
    /// The last `record_missing` dead letter: its key, when (RFC 3339), and when (monotonic).
    record_missing: Mutex<Option<(String, String, std::time::Instant)>>,
    /// Other deployments whose retries came from the shared queue: name → how many.
    foreign: Mutex<BTreeMap<String, u64>>,
    /// Counters.
    pub counters: Counters,
    changed: watch::Sender<u64>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            waits: Mutex::default(),
            held: Mutex::default(),
            owned: Mutex::default(),
            retry_loop: Mutex::new(RetryLoopState::Starting),
            consumer: Mutex::new((ConsumerState::Starting, None)),
            held_retries: Mutex::default(),
            unowned: Mutex::default(),
            unhealthy_after: Mutex::default(),
            lag: Mutex::default(),
            owner_conflict: Mutex::default(),
            record_missing: Mutex::default(),
            foreign: Mutex::default(),
            counters: Counters::default(),
            changed: watch::channel(0).0,
        }
    }
}

impl Health {
    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Resolves whenever something changes (for tests that wait on conditions).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Records that event `seq` of `partition` is held (its settlement is failing). With
    /// `max_in_flight` above 1 several events of a partition can hold at once; the partition
    /// is reported held until the last of them settles, with the oldest one's reason.
    pub fn hold(&self, partition: &str, cause: HoldCause, reason: String, seq: i64) {
        let mut h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let events = h.entry(partition.to_string()).or_default();
        let since = events
            .get(&seq)
            .map(|x| x.since.clone())
            .unwrap_or_else(|| rfc3339(SystemTime::now()));
        if events.get(&seq).map(|x| &x.reason) != Some(&reason) {
            tracing::warn!(partition, %reason, oldest_unsettled = seq, "partition held: its checkpoint will not pass the unsettled event");
        }
        events.insert(
            seq,
            Held {
                cause,
                since,
                reason,
                oldest_unsettled: seq,
            },
        );
        drop(h);
        self.bump();
    }

    /// Records that event `seq` of `partition` is no longer held.
    pub fn release(&self, partition: &str, seq: i64) {
        let mut h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let Some(events) = h.get_mut(partition) else {
            return;
        };
        let removed = events.remove(&seq);
        let now_free = events.is_empty();
        if now_free {
            h.remove(partition);
        }
        drop(h);
        if let Some(held) = removed {
            if now_free {
                tracing::info!(partition, since = %held.since, "partition released: settlement succeeded");
            }
            self.bump();
        }
    }

    /// Makes readiness also say no while `source` has work waiting on it.
    pub fn watch(&self, source: std::sync::Arc<dyn WaitingOn>) {
        self.waits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(source);
    }

    /// Held partitions: for each, the oldest held event's reason and sequence number, since
    /// the earliest hold began.
    pub fn held(&self) -> BTreeMap<String, Held> {
        let h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        h.iter()
            .filter_map(|(p, events)| {
                let (_, oldest) = events.iter().next()?;
                let since = events.values().map(|e| e.since.as_str()).min()?;
                Some((
                    p.clone(),
                    Held {
                        since: since.to_string(),
                        ..oldest.clone()
                    },
                ))
            })
            .collect()
    }

    /// Records that this replica processes `partition` (and its last checkpoint).
    pub fn set_owned(&self, partition: &str, checkpoint: Option<i64>) {
        self.owned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(partition.into(), checkpoint.unwrap_or(-1));
        self.bump();
    }

    /// Records that this replica gave `partition` up.
    pub fn unset_owned(&self, partition: &str) {
        self.owned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(partition);
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(partition);
        self.bump();
    }

    /// Partitions this replica processes, with their last checkpointed sequence number.
    pub fn owned(&self) -> BTreeMap<String, i64> {
        self.owned.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records a partition's checkpoint lag: events received but not covered by the
    /// checkpoint, and the age in seconds of the oldest of them.
    pub fn set_lag(&self, partition: &str, events: u64, seconds: f64) {
        self.lag
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(partition.into(), (events, seconds));
    }

    /// Checkpoint lag per partition: (events, seconds).
    pub fn lag(&self) -> BTreeMap<String, (u64, f64)> {
        self.lag.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The retry loop's state as a number (1 running, 2 reconnecting, 3 watchdog, 0 otherwise).
    pub fn retry_loop_code(&self) -> u64 {
        match self.retry_loop() {
            RetryLoopState::Running => 1,
            RetryLoopState::Reconnecting { .. } => 2,
            RetryLoopState::Watchdog { .. } => 3,
            RetryLoopState::Starting | RetryLoopState::Stopped => 0,
        }
    }

    /// Sets the retry loop's state.
    pub fn set_retry_loop(&self, s: RetryLoopState) {
        *self.retry_loop.lock().unwrap_or_else(|p| p.into_inner()) = s;
        self.bump();
    }

    /// The retry loop's state.
    pub fn retry_loop(&self) -> RetryLoopState {
        self.retry_loop
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The consumer is running (the processor was built and runs).
    pub fn consumer_running(&self) {
        let mut c = self.consumer.lock().unwrap_or_else(|p| p.into_inner());
        if c.0 != ConsumerState::Running {
            if matches!(c.0, ConsumerState::Failing { .. }) {
                tracing::info!("the Event Hubs consumer recovered");
            }
            *c = (ConsumerState::Running, None);
            drop(c);
            self.bump();
        }
    }

    /// The consumer failed with `error` (and is being rebuilt).
    pub fn consumer_failed(&self, error: String) {
        let mut c = self.consumer.lock().unwrap_or_else(|p| p.into_inner());
        let (since, failures, started) = match (&c.0, c.1) {
            (
                ConsumerState::Failing {
                    since, failures, ..
                },
                Some(t),
            ) => (since.clone(), failures + 1, t),
            _ => (rfc3339(SystemTime::now()), 1, std::time::Instant::now()),
        };
        *c = (
            ConsumerState::Failing {
                since,
                failures,
                error,
            },
            Some(started),
        );
        drop(c);
        self.bump();
    }

    /// The consumer's state.
    pub fn consumer(&self) -> ConsumerState {
        self.consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// How long the consumer has been failing without a break, if it is.
    pub fn consumer_failing_for(&self) -> Option<std::time::Duration> {
        self.consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .map(|t| t.elapsed())
    }

    /// Records that the due retry `message_id` (of `key`) is held: `reason` keeps failing.
    pub fn hold_retry(&self, message_id: &str, key: &str, reason: String) {
        let mut h = self.held_retries.lock().unwrap_or_else(|p| p.into_inner());
        let since = h
            .get(message_id)
            .map(|x| x.since.clone())
            .unwrap_or_else(|| rfc3339(SystemTime::now()));
        h.insert(
            message_id.to_string(),
            HeldRetry {
                key: key.to_string(),
                since,
                reason,
            },
        );
        drop(h);
        self.bump();
    }

    /// Records that the retry `message_id` is no longer held.
    pub fn release_retry(&self, message_id: &str) {
        let removed = self
            .held_retries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(message_id);
        if removed.is_some() {
            self.bump();
        }
    }

    /// Records a retry dead-lettered as `record_missing` (see [`RECORD_MISSING_READINESS`]).
    pub fn record_missing(&self, key: &str) {
        self.count(&self.counters.records_missing);
        *self
            .record_missing
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((
            key.to_string(),
            crate::clock::rfc3339(std::time::SystemTime::now()),
            std::time::Instant::now(),
        ));
        self.bump();
    }

    /// Records a retry of `deployment` (another one) received from the shared queue.
    pub fn saw_foreign(&self, deployment: &str) {
        *self
            .foreign
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(deployment.to_string())
            .or_default() += 1;
    }

    /// Due retries held now, by MessageId.
    pub fn held_retries(&self) -> BTreeMap<String, HeldRetry> {
        self.held_retries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sets the partitions of the hub that no replica has owned for longer than ownership
    /// takes to expire and be claimed again.
    pub fn set_unowned(&self, partitions: Vec<String>) {
        let mut u = self.unowned.lock().unwrap_or_else(|p| p.into_inner());
        if *u != partitions {
            if !partitions.is_empty() {
                tracing::warn!(
                    ?partitions,
                    "partitions of the hub are owned by no replica: nothing reads them"
                );
            }
            *u = partitions;
            drop(u);
            self.bump();
        }
    }

    /// Sets how long the consumer may fail without a break before [`live`](Self::live) says no.
    pub fn set_unhealthy_after(&self, limit: Option<std::time::Duration>) {
        *self
            .unhealthy_after
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = limit;
    }

    /// Liveness (`/healthz`): `Err(reason)` once the Event Hubs consumer has failed without a
    /// break for longer than the limit. hubguard never exits on a failing dependency by itself
    /// — everything it must not lose is durable, and it rebuilds the consumer with backoff —
    /// but a process that has not read the hub for that long is better restarted by its
    /// orchestrator with fresh connections. Everything else (a held partition, a retry loop
    /// in its watchdog) is readiness, not liveness: a restart would not mend a dependency.
    pub fn live(&self) -> Result<(), String> {
        let limit = *self
            .unhealthy_after
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match (limit, self.consumer_failing_for()) {
            (Some(limit), Some(failing)) if failing >= limit => Err(format!(
                "the Event Hubs consumer has failed without a break for {}s (limit {}s): {}",
                failing.as_secs(),
                limit.as_secs(),
                match self.consumer() {
                    ConsumerState::Failing { error, .. } => error,
                    _ => String::new(),
                }
            )),
            _ => Ok(()),
        }
    }

    /// Partitions no replica owns.
    pub fn unowned(&self) -> Vec<String> {
        self.unowned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Why this replica is not making the progress it should, one line per cause; empty when
    /// ready. `/readyz` answers 503 with these.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        let mut r = Vec::new();
        match self.consumer() {
            ConsumerState::Running => {}
            ConsumerState::Starting => r.push("Event Hubs consumer starting".to_string()),
            ConsumerState::Failing {
                since,
                failures,
                error,
            } => r.push(format!(
                "Event Hubs consumer failing since {since} ({failures} attempts): {error}"
            )),
        }
        if let Some(conflict) = self.owner_conflict() {
            r.push(conflict);
        }
        let unowned = self.unowned();
        if !unowned.is_empty() {
            r.push(format!(
                "partitions {} are owned by no replica",
                unowned.join(", ")
            ));
        }
        for (p, h) in self.held() {
            r.push(format!(
                "partition {p} held since {}: {}; oldest unsettled sequence number {}",
                h.since, h.reason, h.oldest_unsettled
            ));
        }
        for (id, h) in self.held_retries() {
            r.push(format!(
                "retry {id} (key {}) held since {}: {}",
                h.key, h.since, h.reason
            ));
        }
        if let Some((key, at, when)) = self
            .record_missing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .filter(|(_, _, when)| when.elapsed() < RECORD_MISSING_READINESS)
        {
            let _ = when;
            r.push(format!(
                "{} retries found no ledger record and their event gone from Event Hubs; dead-lettered as record_missing, the latest key {key:?} at {at} (hubguard dead-letters list)",
                self.counters.records_missing.load(Ordering::Relaxed)
            ));
        }
        // Work deferred past a breaker's expiry waits in Service Bus while no partition
        // holds anything: the breaker itself says so.
        let waits = self.waits.lock().unwrap_or_else(|p| p.into_inner()).clone();
        r.extend(waits.iter().filter_map(|w| w.waiting()));
        match self.retry_loop() {
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
    pub fn set_owner_conflict(&self, reason: Option<String>) {
        let mut c = self
            .owner_conflict
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if *c != reason {
            *c = reason;
            drop(c);
            self.bump();
        }
    }

    /// Why this process may not use its owner id, if it may not.
    pub fn owner_conflict(&self) -> Option<String> {
        self.owner_conflict
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Ready: the consumer runs, every partition has an owner, nothing is held and the retry
    /// loop runs.
    pub fn ready(&self) -> bool {
        self.not_ready_reasons().is_empty()
    }

    /// Adds one to a counter (counters do not wake [`subscribe`](Self::subscribe)rs: they
    /// change on every event, and waking on each would cost the hot path).
    pub fn count(&self, c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> CounterSnapshot {
        let c = &self.counters;
        CounterSnapshot {
            delivered: c.delivered.load(Ordering::Relaxed),
            retries_scheduled: c.retries_scheduled.load(Ordering::Relaxed),
            dead_lettered: c.dead_lettered.load(Ordering::Relaxed),
            settle_failures: c.settle_failures.load(Ordering::Relaxed),
            checkpoints: c.checkpoints.load(Ordering::Relaxed),
            attempts: c.attempts.load(Ordering::Relaxed),
            rescued: c.rescued.load(Ordering::Relaxed),
            recovered: c.recovered.load(Ordering::Relaxed),
            forwarded: c.forwarded.load(Ordering::Relaxed),
            records_rebuilt: c.records_rebuilt.load(Ordering::Relaxed),
            records_missing: c.records_missing.load(Ordering::Relaxed),
            parked: c.parked.load(Ordering::Relaxed),
            released: c.released.load(Ordering::Relaxed),
        }
    }

    /// Everything, as JSON.
    pub fn report(&self) -> serde_json::Value {
        serde_json::json!({
            "ready": self.ready(),
            "not_ready": self.not_ready_reasons(),
            "consumer": self.consumer(),
            "unowned_partitions": self.unowned(),
            "held_retries": self.held_retries(),
            "held_partitions": self.held(),
            "owned_partitions": self.owned(),
            "retry_loop": self.retry_loop(),
            "checkpoint_lag": self.lag().into_iter().map(|(p, (e, s))| (p, serde_json::json!({ "events": e, "seconds": s }))).collect::<serde_json::Map<_, _>>(),
            "counters": self.snapshot(),
            "other_deployments_seen": self.foreign.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        })
    }
}

impl crate::telemetry::gauges::PipelineReadings for Health {
    fn held_by_reason(&self) -> BTreeMap<&'static str, u64> {
        let mut by_reason = BTreeMap::new();
        for held in self.held().values() {
            *by_reason.entry(held.cause.label()).or_default() += 1;
        }
        by_reason
    }

    fn retry_loop_code(&self) -> u64 {
        Health::retry_loop_code(self)
    }

    fn checkpoint_lag(&self) -> BTreeMap<String, (u64, f64)> {
        self.lag()
    }

    fn held_for(&self) -> BTreeMap<String, (&'static str, f64)> {
        let now = time::OffsetDateTime::now_utc();
        self.held()
            .into_iter()
            .map(|(p, h)| {
                let since = time::OffsetDateTime::parse(
                    &h.since,
                    &time::format_description::well_known::Rfc3339,
                )
                .map_or(0.0, |t| (now - t).as_seconds_f64().max(0.0));
                (p, (h.cause.label(), since))
            })
            .collect()
    }

    fn owned_count(&self) -> u64 {
        self.owned().len() as u64
    }

    fn unowned(&self) -> Vec<String> {
        Health::unowned(self)
    }

    fn ready(&self) -> bool {
        Health::ready(self)
    }

    fn consumer_code(&self) -> u64 {
        match self.consumer() {
            ConsumerState::Running => 1,
            ConsumerState::Failing { .. } => 2,
            ConsumerState::Starting => 0,
        }
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
        let e = h.live().unwrap_err();
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
        h.hold(
            "1",
            HoldCause::ServiceBus,
            "Service Bus unavailable".into(),
            7,
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
        h.hold(
            "3",
            HoldCause::ServiceBus,
            "Service Bus unavailable: down".into(),
            42,
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
        h.release("3", 42);
        h.release_retry("k-attempt-2");
        h.set_unowned(Vec::new());
        assert!(h.ready());
    }
}
