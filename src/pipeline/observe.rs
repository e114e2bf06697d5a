//! What both loops report to: the health readiness reads (counters included) and the
//! OpenTelemetry instruments, counted together so the two never disagree, with the gauges
//! that read the health kept alive beside them.

use std::sync::Arc;
use std::time::Duration;

use super::health::Health;
use super::settle::{SettleError, Settled};
use crate::telemetry::gauges::{BreakerReadings, PipelineGauges};
use crate::telemetry::names::metric_attr;
use crate::telemetry::{type_label, Metrics};

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
        self.health.count(&self.health.counters.recovered);
        self.metrics.recovered.add(1, &[]);
    }

    /// Counts a retry of another deployment handed back to a shared queue.
    pub(crate) fn count_forwarded(&self) {
        self.health.count(&self.health.counters.forwarded);
        self.metrics.forwarded.add(1, &[]);
    }

    /// Counts a missing ledger record rebuilt from the event read back from Event Hubs.
    pub(crate) fn count_record_rebuilt(&self) {
        self.health.count(&self.health.counters.records_rebuilt);
        self.metrics.records_rebuilt.add(1, &[]);
    }

    /// Counts a retry dead-lettered as `record_missing` (its record and its event gone), and
    /// remembers the key for readiness.
    pub(crate) fn count_record_missing(&self, key: &str) {
        self.health.record_missing(key);
        self.metrics.records_missing.add(1, &[]);
    }

    /// Counts a retry taken back from Service Bus's dead-letter sub-queue.
    pub(crate) fn count_rescued(&self) {
        self.health.count(&self.health.counters.rescued);
        self.metrics.rescued.add(1, &[]);
    }

    /// Counts an attempt deferred by an open breaker.
    pub(crate) fn count_deferred(&self, event_type: Option<&str>) {
        self.metrics.deferred.add(1, &type_label(event_type));
    }

    /// Counts a settlement.
    pub(crate) fn count_settled(&self, s: &Settled, event_type: Option<&str>) {
        let c = &self.health.counters;
        let m = &self.metrics;
        let labels = type_label(event_type);
        match s {
            Settled::Delivered => {
                self.health.count(&c.delivered);
                m.delivered.add(1, &labels);
            }
            Settled::RetryScheduled { .. } => {
                self.health.count(&c.retries_scheduled);
                m.retries_scheduled.add(1, &labels);
            }
            Settled::DeadLettered(_) => {
                self.health.count(&c.dead_lettered);
                m.dead_lettered.add(1, &labels);
            }
            Settled::AlreadyFinal(_) => {}
            Settled::Parked { .. } => self.health.count(&c.parked),
        }
    }

    /// Counts a failed settlement.
    pub(crate) fn settle_failed(&self, e: &SettleError) {
        self.health.count(&self.health.counters.settle_failures);
        self.settle_failed_metric(e);
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
