//! The pipeline's observable gauges: what `/metrics` and OTLP read from the pipeline's
//! health and the downstream's breaker at each collection, under the names in [`metric`].
//! The pipeline and the breaker implement the readings; this module knows only the readings,
//! so telemetry depends on neither.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::ObservableGauge;
use opentelemetry::KeyValue;

use super::names::{metric, metric_attr};

/// What the pipeline's gauges read from its health.
pub trait PipelineReadings: Send + Sync + 'static {
    /// Held partitions (and handler blocks), counted by the hold's bounded label.
    fn held_by_reason(&self) -> BTreeMap<&'static str, u64>;
    /// The retry loop's state: 1 running, 2 reconnecting, 3 watchdog, 0 stopped.
    fn retry_loop_code(&self) -> u64;
    /// Per partition: events received but not covered by the checkpoint, and the age in
    /// seconds of the oldest of them.
    fn checkpoint_lag(&self) -> BTreeMap<String, (u64, f64)>;
}

/// What the breaker gauges read from the downstream's circuit breaker.
pub trait BreakerReadings: Send + Sync + 'static {
    /// The downstream's name (the `downstream` attribute).
    fn downstream_name(&self) -> String;
    /// How long the breaker has been open (zero when closed).
    fn open_for(&self) -> Duration;
    /// How many times it opened.
    fn opens(&self) -> u64;
}

/// The gauges, registered while this lives.
pub struct PipelineGauges {
    _held: ObservableGauge<u64>,
    _retry_loop: ObservableGauge<u64>,
    _lag_events: ObservableGauge<u64>,
    _lag_seconds: ObservableGauge<f64>,
    _breaker_age: ObservableGauge<f64>,
    _breaker_opens: ObservableGauge<u64>,
}

impl std::fmt::Debug for PipelineGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineGauges").finish_non_exhaustive()
    }
}

impl PipelineGauges {
    /// Registers the gauges on the global meter.
    pub fn register(
        pipeline: Arc<dyn PipelineReadings>,
        breaker: Option<Arc<dyn BreakerReadings>>,
    ) -> Self {
        let meter = super::meter();
        let p = pipeline.clone();
        let held = meter
            .u64_observable_gauge(metric::PARTITIONS_HELD)
            .with_description("Partitions whose settlement is failing (held), by reason")
            .with_callback(move |o| {
                let by_reason = p.held_by_reason();
                if by_reason.is_empty() {
                    o.observe(0, &[]);
                }
                for (reason, n) in by_reason {
                    o.observe(n, &[KeyValue::new(metric_attr::REASON, reason)]);
                }
            })
            .build();
        let p = pipeline.clone();
        let retry_loop = meter
            .u64_observable_gauge(metric::RETRY_LOOP_STATE)
            .with_description("Retry loop: 1 running, 2 reconnecting, 3 watchdog, 0 stopped")
            .with_callback(move |o| o.observe(p.retry_loop_code(), &[]))
            .build();
        let p = pipeline.clone();
        let lag_events = meter
            .u64_observable_gauge(metric::CHECKPOINT_LAG_EVENTS)
            .with_description("Events received but not covered by the checkpoint")
            .with_callback(move |o| {
                for (partition, (events, _)) in p.checkpoint_lag() {
                    o.observe(events, &[KeyValue::new(metric_attr::PARTITION, partition)]);
                }
            })
            .build();
        let p = pipeline;
        let lag_seconds = meter
            .f64_observable_gauge(metric::CHECKPOINT_LAG_SECONDS)
            .with_unit("s")
            .with_description("Age of the oldest event not covered by the checkpoint")
            .with_callback(move |o| {
                for (partition, (_, secs)) in p.checkpoint_lag() {
                    o.observe(secs, &[KeyValue::new(metric_attr::PARTITION, partition)]);
                }
            })
            .build();
        let b = breaker.clone();
        let breaker_age = meter
            .f64_observable_gauge(metric::BREAKER_AGE)
            .with_unit("s")
            .with_description("How long the downstream's breaker has been open (0 when closed)")
            .with_callback(move |o| {
                if let Some(b) = &b {
                    o.observe(
                        b.open_for().as_secs_f64(),
                        &[KeyValue::new(metric_attr::DOWNSTREAM, b.downstream_name())],
                    );
                }
            })
            .build();
        let b = breaker;
        let breaker_opens = meter
            .u64_observable_gauge(metric::BREAKER_OPENS)
            .with_description("How many times the downstream's breaker opened")
            .with_callback(move |o| {
                if let Some(b) = &b {
                    o.observe(
                        b.opens(),
                        &[KeyValue::new(metric_attr::DOWNSTREAM, b.downstream_name())],
                    );
                }
            })
            .build();
        Self {
            _held: held,
            _retry_loop: retry_loop,
            _lag_events: lag_events,
            _lag_seconds: lag_seconds,
            _breaker_age: breaker_age,
            _breaker_opens: breaker_opens,
        }
    }
}
