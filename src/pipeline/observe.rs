//! What both loops report to: the health readiness reads (counters included) and the
//! OpenTelemetry instruments, counted together so the two never disagree, with the gauges
//! that read the health kept alive beside them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::health::{CounterSnapshot, Health};
use super::settle::{SettleError, Settled};
use crate::telemetry::gauges::{BreakerReadings, PipelineGauges};
use crate::telemetry::names::metric_attr;
use crate::telemetry::{type_label, Metrics};

/// The pipeline's counters, kept in [`Health`] and bumped only by [`Observer`] (their fields
/// are private to this module), beside the matching instrument where there is one.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    delivered: AtomicU64,
    retries_scheduled: AtomicU64,
    dead_lettered: AtomicU64,
    settle_failures: AtomicU64,
    checkpoints: AtomicU64,
    attempts: AtomicU64,
    rescued: AtomicU64,
    recovered: AtomicU64,
    forwarded: AtomicU64,
    records_rebuilt: AtomicU64,
    records_missing: AtomicU64,
    parked: AtomicU64,
    released: AtomicU64,
}

/// Adds one (counters do not wake `Health::subscribe`rs: they change on every event, and
/// waking on each would cost the hot path).
fn add(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// The counters now.
    pub(crate) fn snapshot(&self) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            delivered: get(&self.delivered),
            retries_scheduled: get(&self.retries_scheduled),
            dead_lettered: get(&self.dead_lettered),
            settle_failures: get(&self.settle_failures),
            checkpoints: get(&self.checkpoints),
            attempts: get(&self.attempts),
            rescued: get(&self.rescued),
            recovered: get(&self.recovered),
            forwarded: get(&self.forwarded),
            records_rebuilt: get(&self.records_rebuilt),
            records_missing: get(&self.records_missing),
            parked: get(&self.parked),
            released: get(&self.released),
        }
    }
}

/// The pipeline's counters and instruments.
pub(crate) struct Observer {
    health: Arc<Health>,
    metrics: Metrics,
    _gauges: PipelineGauges,
}

impl Observer {
    /// Instruments on the global meter, and gauges reading `health` and `breaker`.
    pub(crate) fn new(health: Arc<Health>, breaker: Option<Arc<dyn BreakerReadings>>) -> Self {
        Self {
            _gauges: PipelineGauges::register(health.clone(), breaker),
            health,
            metrics: Metrics::new(),
        }
    }

    /// Counts an overdue retry scheduled again.
    pub(crate) fn count_recovered(&self) {
        add(&self.health.counters().recovered);
        self.metrics.recovered.add(1, &[]);
    }

    /// Counts a retry of another deployment handed back to a shared queue.
    pub(crate) fn count_forwarded(&self) {
        add(&self.health.counters().forwarded);
        self.metrics.forwarded.add(1, &[]);
    }

    /// Counts a missing ledger record rebuilt from the event read back from Event Hubs.
    pub(crate) fn count_record_rebuilt(&self) {
        add(&self.health.counters().records_rebuilt);
        self.metrics.records_rebuilt.add(1, &[]);
    }

    /// Counts a retry dead-lettered as `record_missing` (its record and its event gone), and
    /// remembers the key for readiness.
    pub(crate) fn count_record_missing(&self, key: &str) {
        add(&self.health.counters().records_missing);
        self.health.record_missing(key);
        self.metrics.records_missing.add(1, &[]);
    }

    /// Counts a retry taken back from Service Bus's dead-letter sub-queue.
    pub(crate) fn count_rescued(&self) {
        add(&self.health.counters().rescued);
        self.metrics.rescued.add(1, &[]);
    }

    /// Counts an attempt deferred by an open breaker.
    pub(crate) fn count_deferred(&self, event_type: Option<&str>) {
        self.metrics.deferred.add(1, &type_label(event_type));
    }

    /// Counts a retry due while an operator paused it.
    pub(crate) fn count_paused(&self, event_type: Option<&str>) {
        self.metrics.paused.add(1, &type_label(event_type));
    }

    /// Exports the storm guard's held counter at 0 before anything is held (a series to
    /// alert and graph on from the start).
    pub(crate) fn storm_held_series(&self) {
        self.metrics.storm_held.add(0, &type_label(None));
    }

    /// Counts a refusal the storm guard held instead of dead-lettering.
    pub(crate) fn count_storm_held(&self, event_type: Option<&str>) {
        self.metrics.storm_held.add(1, &type_label(event_type));
    }

    /// Counts a settlement.
    pub(crate) fn count_settled(&self, s: &Settled, event_type: Option<&str>) {
        let c = self.health.counters();
        let m = &self.metrics;
        let labels = type_label(event_type);
        match s {
            Settled::Delivered => {
                add(&c.delivered);
                m.delivered.add(1, &labels);
            }
            Settled::RetryScheduled { .. } => {
                add(&c.retries_scheduled);
                m.retries_scheduled.add(1, &labels);
            }
            Settled::DeadLettered(_) => self.count_dead_lettered(event_type),
            Settled::AlreadyFinal(_) => {}
            Settled::Parked { .. } => add(&c.parked),
        }
    }

    /// Counts a failed settlement.
    pub(crate) fn settle_failed(&self, e: &SettleError) {
        add(&self.health.counters().settle_failures);
        self.settle_failed_metric(e);
    }

    /// Counts a failed step of a retry held under its lock (reading its record, resending
    /// it …) in the health counters; a failed settlement among them is also recorded in the
    /// metrics, with its dependency, by [`settle_failed_metric`](Self::settle_failed_metric).
    pub(crate) fn held_retry_failed(&self) {
        add(&self.health.counters().settle_failures);
    }

    /// Counts an event dead-lettered outside a settlement (a retry whose record is corrupt
    /// or missing, a parked event dead-lettered with its line): health and metrics alike.
    pub(crate) fn count_dead_lettered(&self, event_type: Option<&str>) {
        add(&self.health.counters().dead_lettered);
        self.metrics.dead_lettered.add(1, &type_label(event_type));
    }

    /// Counts a handler call.
    pub(crate) fn count_attempt(&self) {
        add(&self.health.counters().attempts);
    }

    /// Counts a checkpoint written.
    pub(crate) fn count_checkpoint(&self) {
        add(&self.health.counters().checkpoints);
    }

    /// Counts a parked event released from its line (ordered retries).
    pub(crate) fn count_released(&self) {
        add(&self.health.counters().released);
    }

    /// Records a failed settlement in the metrics only.
    pub(crate) fn settle_failed_metric(&self, e: &SettleError) {
        self.metrics.settle_failures.add(
            1,
            &[opentelemetry::KeyValue::new(
                metric_attr::REASON,
                e.dependency(),
            )],
        );
    }

    /// Records how long a handler call took.
    pub(crate) fn handler_duration(&self, took: Duration, event_type: Option<&str>) {
        self.metrics
            .handler_duration
            .record(took.as_secs_f64(), &type_label(event_type));
    }

    /// Records how long after its due time a retry started.
    pub(crate) fn retry_lateness(&self, late: Duration, event_type: Option<&str>) {
        self.metrics
            .retry_lateness
            .record(late.as_secs_f64(), &type_label(event_type));
    }
}
