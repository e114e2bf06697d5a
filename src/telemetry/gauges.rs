//! The pipeline's observable gauges: what `/metrics` and OTLP read from the pipeline's
//! health and the downstream's breaker at each collection, under the names in [`metric`].
//! The pipeline and the breaker implement the readings; this module knows only the readings,
//! so telemetry depends on neither.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::{Meter, ObservableGauge};
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
    /// Per held partition: the hold's bounded label and how long (s) it has been held.
    fn held_for(&self) -> BTreeMap<String, (&'static str, f64)>;
    /// How many partitions this replica owns.
    fn owned_count(&self) -> u64;
    /// The partitions of the hub no replica owns.
    fn unowned(&self) -> Vec<String>;
    /// Whether the replica is ready (what `/readyz` answers).
    fn ready(&self) -> bool;
    /// The Event Hubs consumer's state: 1 running, 2 failing, 0 starting.
    fn consumer_code(&self) -> u64;
    /// Per measured service (`servicebus`, `blob`): its clock minus this host's, in seconds.
    fn clock_offsets(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
}

/// What the breaker gauges read from the downstream's circuit breaker.
pub trait BreakerReadings: Send + Sync + 'static {
    /// The downstream's name (the `downstream` attribute).
    fn downstream_name(&self) -> String;
    /// How long the breaker has been open (zero when closed).
    fn open_for(&self) -> Duration;
    /// How many times it opened.
    fn opens(&self) -> u64;
    /// How long it stays open once opened (`breaker.open_ms`).
    fn open_duration(&self) -> Duration;
}

/// The gauges, registered while this lives.
pub struct PipelineGauges {
    _held: ObservableGauge<u64>,
    _retry_loop: ObservableGauge<u64>,
    _lag_events: ObservableGauge<u64>,
    _lag_seconds: ObservableGauge<f64>,
    _breaker_age: ObservableGauge<f64>,
    _breaker_opens: ObservableGauge<u64>,
    _breaker_open_duration: ObservableGauge<f64>,
    _held_for: ObservableGauge<f64>,
    _owned: ObservableGauge<u64>,
    _unowned: ObservableGauge<u64>,
    _ready: ObservableGauge<u64>,
    _consumer: ObservableGauge<u64>,
    _clock_offset: ObservableGauge<f64>,
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
        let held = held_gauge(&meter, pipeline.clone());
        let retry_loop = pipeline_u64_gauge(
            &meter,
            metric::RETRY_LOOP_STATE,
            "Retry loop: 1 running, 2 reconnecting, 3 watchdog, 0 stopped",
            pipeline.clone(),
            |p| p.retry_loop_code(),
        );
        let lag_events = lag_events_gauge(&meter, pipeline.clone());
        let held_for = held_for_gauge(&meter, pipeline.clone());
        let owned = pipeline_u64_gauge(
            &meter,
            metric::PARTITIONS_OWNED,
            "Partitions this replica owns",
            pipeline.clone(),
            |p| p.owned_count(),
        );
        let unowned = unowned_gauge(&meter, pipeline.clone());
        let ready = pipeline_u64_gauge(
            &meter,
            metric::READY,
            "1 when the replica is ready (/readyz answers 200), else 0",
            pipeline.clone(),
            |p| u64::from(p.ready()),
        );
        let consumer = pipeline_u64_gauge(
            &meter,
            metric::CONSUMER_STATE,
            "Event Hubs consumer: 1 running, 2 failing, 0 starting",
            pipeline.clone(),
            |p| p.consumer_code(),
        );
        let clock_offset = clock_offset_gauge(&meter, pipeline.clone());
        let lag_seconds = lag_seconds_gauge(&meter, pipeline);
        let breaker_age = breaker_seconds_gauge(
            &meter,
            metric::BREAKER_AGE,
            "How long the downstream's breaker has been open (0 when closed)",
            breaker.clone(),
            |b| b.open_for(),
        );
        let breaker_open_duration = breaker_seconds_gauge(
            &meter,
            metric::BREAKER_OPEN_DURATION,
            "How long the downstream's breaker stays open once opened (breaker.open_ms)",
            breaker.clone(),
            |b| b.open_duration(),
        );
        let breaker_opens = breaker_opens_gauge(&meter, breaker);
        Self {
            _held: held,
            _retry_loop: retry_loop,
            _lag_events: lag_events,
            _lag_seconds: lag_seconds,
            _breaker_age: breaker_age,
            _breaker_opens: breaker_opens,
            _breaker_open_duration: breaker_open_duration,
            _held_for: held_for,
            _owned: owned,
            _unowned: unowned,
            _ready: ready,
            _consumer: consumer,
            _clock_offset: clock_offset,
        }
    }
}

/// A gauge of one unlabelled number the pipeline reports (`read`).
fn pipeline_u64_gauge(
    meter: &Meter,
    name: &'static str,
    description: &'static str,
    p: Arc<dyn PipelineReadings>,
    read: fn(&dyn PipelineReadings) -> u64,
) -> ObservableGauge<u64> {
    meter
        .u64_observable_gauge(name)
        .with_description(description)
        .with_callback(move |o| o.observe(read(p.as_ref()), &[]))
        .build()
}

/// [`metric::PARTITIONS_HELD`]: held partitions by reason (0, unlabelled, when none).
fn held_gauge(meter: &Meter, p: Arc<dyn PipelineReadings>) -> ObservableGauge<u64> {
    meter
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
        .build()
}

/// [`metric::CHECKPOINT_LAG_EVENTS`]: per partition, the events the checkpoint does not cover.
fn lag_events_gauge(meter: &Meter, p: Arc<dyn PipelineReadings>) -> ObservableGauge<u64> {
    meter
        .u64_observable_gauge(metric::CHECKPOINT_LAG_EVENTS)
        .with_description("Events received but not covered by the checkpoint")
        .with_callback(move |o| {
            for (partition, (events, _)) in p.checkpoint_lag() {
                o.observe(events, &[KeyValue::new(metric_attr::PARTITION, partition)]);
            }
        })
        .build()
}

/// [`metric::PARTITION_HELD_SECONDS`]: per held partition and reason, how long it has been
/// held (0, unlabelled, when none).
fn held_for_gauge(meter: &Meter, p: Arc<dyn PipelineReadings>) -> ObservableGauge<f64> {
    meter
        .f64_observable_gauge(metric::PARTITION_HELD_SECONDS)
        .with_unit("s")
        .with_description("How long each held partition has been held, by partition and reason")
        .with_callback(move |o| {
            let held = p.held_for();
            if held.is_empty() {
                o.observe(0.0, &[]);
            }
            for (partition, (reason, secs)) in held {
                o.observe(
                    secs,
                    &[
                        KeyValue::new(metric_attr::PARTITION, partition),
                        KeyValue::new(metric_attr::REASON, reason),
                    ],
                );
            }
        })
        .build()
}

/// [`metric::CLOCK_OFFSET`]: per measured service, its clock minus this host's.
fn clock_offset_gauge(meter: &Meter, p: Arc<dyn PipelineReadings>) -> ObservableGauge<f64> {
    meter
        .f64_observable_gauge(metric::CLOCK_OFFSET)
        .with_unit("s")
        .with_description("Each service's clock minus this host's, measured from response Date headers, by service")
        .with_callback(move |o| {
            for (service, secs) in p.clock_offsets() {
                o.observe(secs, &[KeyValue::new(metric_attr::SERVICE, service)]);
            }
        })
        .build()
}

/// [`metric::PARTITIONS_UNOWNED`]: 1 per partition no replica owns (0, unlabelled, when none).
fn unowned_gauge(meter: &Meter, p: Arc<dyn PipelineReadings>) -> ObservableGauge<u64> {
    meter
        .u64_observable_gauge(metric::PARTITIONS_UNOWNED)
        .with_description("1 per partition of the hub no replica owns")
        .with_callback(move |o| {
            let unowned = p.unowned();
            if unowned.is_empty() {
                o.observe(0, &[]);
            }
            for partition in unowned {
                o.observe(1, &[KeyValue::new(metric_attr::PARTITION, partition)]);
            }
        })
        .build()
}

/// [`metric::CHECKPOINT_LAG_SECONDS`]: per partition, the age of the oldest event the
/// checkpoint does not cover.
fn lag_seconds_gauge(meter: &Meter, p: Arc<dyn PipelineReadings>) -> ObservableGauge<f64> {
    meter
        .f64_observable_gauge(metric::CHECKPOINT_LAG_SECONDS)
        .with_unit("s")
        .with_description("Age of the oldest event not covered by the checkpoint")
        .with_callback(move |o| {
            for (partition, (_, secs)) in p.checkpoint_lag() {
                o.observe(secs, &[KeyValue::new(metric_attr::PARTITION, partition)]);
            }
        })
        .build()
}

/// A breaker duration (`read`) in seconds, labelled with the downstream (nothing without a
/// breaker).
fn breaker_seconds_gauge(
    meter: &Meter,
    name: &'static str,
    description: &'static str,
    b: Option<Arc<dyn BreakerReadings>>,
    read: fn(&dyn BreakerReadings) -> Duration,
) -> ObservableGauge<f64> {
    meter
        .f64_observable_gauge(name)
        .with_unit("s")
        .with_description(description)
        .with_callback(move |o| {
            if let Some(b) = &b {
                o.observe(
                    read(b.as_ref()).as_secs_f64(),
                    &[KeyValue::new(metric_attr::DOWNSTREAM, b.downstream_name())],
                );
            }
        })
        .build()
}

/// [`metric::BREAKER_OPENS`]: how many times the breaker opened (nothing without a breaker).
fn breaker_opens_gauge(meter: &Meter, b: Option<Arc<dyn BreakerReadings>>) -> ObservableGauge<u64> {
    meter
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
        .build()
}

/// The configuration's own figures that alerts compare readings with, registered while this
/// lives (one per process: the binary registers it for its configuration).
#[cfg(any(test, feature = "cli"))]
pub struct ConfigGauges {
    _retention: ObservableGauge<f64>,
}

#[cfg(any(test, feature = "cli"))]
impl std::fmt::Debug for ConfigGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigGauges").finish_non_exhaustive()
    }
}

#[cfg(any(test, feature = "cli"))]
impl ConfigGauges {
    /// Registers [`metric::RETENTION`] (the hub's retention) on the global meter.
    pub fn register(retention: Duration) -> Self {
        let secs = retention.as_secs_f64();
        let retention = super::meter()
            .f64_observable_gauge(metric::RETENTION)
            .with_unit("s")
            .with_description("The hub's retention as configured (eventhubs.retention_hours)")
            .with_callback(move |o| o.observe(secs, &[]))
            .build();
        Self {
            _retention: retention,
        }
    }
}

/// What the rate-limit gauges read from the downstream's rate limiter.
pub trait RateLimitReadings: Send + Sync + 'static {
    /// The downstream's name (the `downstream` attribute).
    fn downstream_name(&self) -> String;
    /// The limit in force for the whole deployment (requests/s; `None`: none).
    fn configured(&self) -> Option<f64>;
    /// This replica's rate now (its share of the adapted deployment rate).
    fn current(&self) -> Option<f64>;
    /// The deployment's adapted rate now.
    fn deployment(&self) -> Option<f64>;
    /// Why the rate was last lowered (a bounded label).
    fn last_decrease(&self) -> Option<&'static str>;
    /// Decreases so far, deployment-wide.
    fn decreases(&self) -> u64;
}

/// The rate limiter's gauges, registered while this lives.
pub struct RateLimitGauges {
    _limit: ObservableGauge<f64>,
    _rate: ObservableGauge<f64>,
    _deployment: ObservableGauge<f64>,
    _decreases: ObservableGauge<u64>,
}

impl std::fmt::Debug for RateLimitGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitGauges").finish_non_exhaustive()
    }
}

impl RateLimitGauges {
    /// Registers [`metric::RATE_LIMIT`], [`metric::RATE_CURRENT`],
    /// [`metric::RATE_DEPLOYMENT`] and [`metric::RATE_DECREASES`] on the global meter.
    pub fn register(limiter: Arc<dyn RateLimitReadings>) -> Self {
        let meter = super::meter();
        let l = limiter.clone();
        let limit = meter
            .f64_observable_gauge(metric::RATE_LIMIT)
            .with_description(
                "The downstream's rate limit for the whole deployment (requests/s): handler.rate_limit, capped by the webhook's WebHook-Allowed-Rate",
            )
            .with_callback(move |o| {
                if let Some(v) = l.configured() {
                    o.observe(v, &[KeyValue::new(metric_attr::DOWNSTREAM, l.downstream_name())]);
                }
            })
            .build();
        let l = limiter.clone();
        let rate = meter
            .f64_observable_gauge(metric::RATE_CURRENT)
            .with_description(
                "This replica's rate to the downstream now (requests/s): its share of the adapted deployment rate; labelled with the last decrease's reason",
            )
            .with_callback(move |o| {
                if let Some(v) = l.current() {
                    o.observe(
                        v,
                        &[
                            KeyValue::new(metric_attr::DOWNSTREAM, l.downstream_name()),
                            KeyValue::new(
                                metric_attr::REASON,
                                l.last_decrease().unwrap_or("none"),
                            ),
                        ],
                    );
                }
            })
            .build();
        let l = limiter.clone();
        let deployment = meter
            .f64_observable_gauge(metric::RATE_DEPLOYMENT)
            .with_description(
                "The deployment's adapted rate to the downstream now (requests/s, every replica together)",
            )
            .with_callback(move |o| {
                if let Some(v) = l.deployment() {
                    o.observe(v, &[KeyValue::new(metric_attr::DOWNSTREAM, l.downstream_name())]);
                }
            })
            .build();
        let l = limiter;
        let decreases = meter
            .u64_observable_gauge(metric::RATE_DECREASES)
            .with_description(
                "How many times the deployment's rate to the downstream was lowered (429, 503, timeouts)",
            )
            .with_callback(move |o| {
                if l.configured().is_some() {
                    o.observe(
                        l.decreases(),
                        &[KeyValue::new(metric_attr::DOWNSTREAM, l.downstream_name())],
                    );
                }
            })
            .build();
        Self {
            _limit: limit,
            _rate: rate,
            _deployment: deployment,
            _decreases: decreases,
        }
    }
}

/// What the storm-guard gauges read from the downstream's dead-letter storm guard.
pub trait StormGuardReadings: Send + Sync + 'static {
    /// The downstream's name (the `downstream` attribute).
    fn downstream_name(&self) -> String;
    /// How long it has been holding, as last seen (`None`: it does not hold).
    fn holding_for(&self) -> Option<Duration>;
}

/// The storm guard's gauges, registered while this lives.
pub struct StormGuardGauges {
    _holding: ObservableGauge<u64>,
    _age: ObservableGauge<f64>,
}

impl std::fmt::Debug for StormGuardGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StormGuardGauges").finish_non_exhaustive()
    }
}

impl StormGuardGauges {
    /// Registers [`metric::STORM_GUARD_HOLDING`] and [`metric::STORM_GUARD_AGE`] on the
    /// global meter.
    pub fn register(guard: Arc<dyn StormGuardReadings>) -> Self {
        let meter = super::meter();
        let g = guard.clone();
        let holding = meter
            .u64_observable_gauge(metric::STORM_GUARD_HOLDING)
            .with_description(
                "1 while the downstream's dead-letter storm guard holds (refusals are not dead-lettered, new events wait), else 0",
            )
            .with_callback(move |o| {
                let v = u64::from(g.holding_for().is_some());
                o.observe(v, &[KeyValue::new(metric_attr::DOWNSTREAM, g.downstream_name())]);
            })
            .build();
        let g = guard;
        let age = meter
            .f64_observable_gauge(metric::STORM_GUARD_AGE)
            .with_unit("s")
            .with_description(
                "How long the downstream's storm guard has been holding (0 when it does not)",
            )
            .with_callback(move |o| {
                let v = g.holding_for().unwrap_or_default().as_secs_f64();
                o.observe(
                    v,
                    &[KeyValue::new(metric_attr::DOWNSTREAM, g.downstream_name())],
                );
            })
            .build();
        Self {
            _holding: holding,
            _age: age,
        }
    }
}
