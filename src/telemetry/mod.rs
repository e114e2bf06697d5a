//! Telemetry: logs ([`logs`]: text or JSON lines), `tracing` spans exported as
//! OpenTelemetry traces, and OpenTelemetry metrics — pulled at `GET /metrics`
//! ([`prometheus`]) and, like traces, pushed by OTLP when the standard `OTEL_*` variables
//! say where
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL` = `grpc` or
//! `http/protobuf`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, …). Without an endpoint
//! nothing is exported and nothing breaks: spans still give every attempt a W3C trace context.
//!
//! Every name lives in [`names`].

pub mod backlog;
pub mod gauges;
pub mod logs;
pub mod names;
pub mod prometheus;

use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter};
use opentelemetry::trace::{
    SpanContext, SpanId, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Where to export (for tests and embedders; the binary reads `OTEL_*`). `Debug` masks the
/// endpoint's userinfo and query (`crate::redact`).
#[derive(Clone)]
pub struct Export {
    /// OTLP endpoint (`http://host:4317` for gRPC, `http://host:4318` for HTTP).
    pub endpoint: String,
    /// `grpc` or `http/protobuf`.
    pub protocol: Protocol,
    /// How often metrics are exported.
    pub metric_interval: Duration,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("endpoint", &crate::redact::redact(&self.endpoint))
            .field("protocol", &self.protocol)
            .field("metric_interval", &self.metric_interval)
            .finish()
    }
}

/// Keeps the exporters alive; flushes and shuts them down when dropped.
#[derive(Debug, Default)]
pub struct Guard {
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
}

impl Guard {
    /// Exports everything buffered now.
    pub fn flush(&self) {
        if let Some(t) = &self.tracer {
            let _ = t.force_flush();
        }
        if let Some(m) = &self.meter {
            let _ = m.force_flush();
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.flush();
        if let Some(t) = self.tracer.take() {
            let _ = t.shutdown();
        }
        if let Some(m) = self.meter.take() {
            let _ = m.shutdown();
        }
    }
}

fn protocol_from_env() -> Protocol {
    match std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").as_deref() {
        Ok("grpc") => Protocol::Grpc,
        _ => Protocol::HttpBinary,
    }
}

/// The export the `OTEL_*` environment asks for, if any.
pub fn export_from_env() -> Option<Export> {
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())?;
    let interval = std::env::var("OTEL_METRIC_EXPORT_INTERVAL")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(60));
    Some(Export {
        endpoint,
        protocol: protocol_from_env(),
        metric_interval: interval,
    })
}

fn resource() -> Resource {
    Resource::builder()
        .with_service_name(std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "hubguard".into()))
        .build()
}

/// The tracer and meter providers: always a tracer (attempt spans get real trace ids that
/// logs, the ledger and the webhook's `traceparent` share) and a meter read by `GET /metrics`;
/// with `export`, both also push by OTLP.
fn providers(export: Option<&Export>) -> Result<(SdkTracerProvider, SdkMeterProvider), String> {
    let resource = resource();
    let mut tracer = SdkTracerProvider::builder().with_resource(resource.clone());
    let mut meter = SdkMeterProvider::builder().with_resource(resource);
    if let Some(r) = prometheus::reader() {
        meter = meter.with_reader(r);
    }
    let Some(export) = export else {
        return Ok((tracer.build(), meter.build()));
    };
    let (spans, metrics) = match export.protocol {
        Protocol::Grpc => (
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(&export.endpoint)
                .build(),
            opentelemetry_otlp::MetricExporter::builder()
                .with_tonic()
                .with_endpoint(&export.endpoint)
                .build(),
        ),
        protocol => {
            let base = export.endpoint.trim_end_matches('/');
            (
                opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(protocol)
                    .with_endpoint(format!("{base}/v1/traces"))
                    .build(),
                opentelemetry_otlp::MetricExporter::builder()
                    .with_http()
                    .with_protocol(protocol)
                    .with_endpoint(format!("{base}/v1/metrics"))
                    .build(),
            )
        }
    };
    let spans = RedactingExporter(spans.map_err(|e| format!("OTLP span exporter: {e}"))?);
    let metrics = metrics.map_err(|e| format!("OTLP metric exporter: {e}"))?;
    // The exporters are async (tonic, reqwest): run them on the caller's Tokio runtime.
    let processor =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            spans,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    tracer = tracer.with_span_processor(processor);
    let reader =
        opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader::builder(
            metrics,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_interval(export.metric_interval)
        .build();
    meter = meter.with_reader(reader);
    Ok((tracer.build(), meter.build()))
}

/// Passes every exported span through the one redaction rule ([`crate::redact`]): string
/// attributes, events (log lines inside a span become span events) and the status
/// description. Spans carry error texts, and those can quote what a dependency answered.
#[derive(Debug)]
struct RedactingExporter<E>(E);

fn redact_kv(kv: &mut KeyValue) {
    use opentelemetry::{Array, StringValue, Value};
    let redact = |s: &StringValue| match crate::redact::redact(s.as_str()) {
        std::borrow::Cow::Owned(r) => Some(StringValue::from(r)),
        std::borrow::Cow::Borrowed(_) => None,
    };
    match &mut kv.value {
        Value::String(s) => {
            if let Some(r) = redact(s) {
                *s = r;
            }
        }
        Value::Array(Array::String(v)) => {
            for s in v.iter_mut() {
                if let Some(r) = redact(s) {
                    *s = r;
                }
            }
        }
        _ => {}
    }
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for RedactingExporter<E>
{
    fn export(
        &self,
        mut batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> impl std::future::Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send {
        for span in &mut batch {
            span.attributes.iter_mut().for_each(redact_kv);
            for event in span.events.events.iter_mut() {
                if let std::borrow::Cow::Owned(r) = crate::redact::redact(&event.name) {
                    event.name = r.into();
                }
                event.attributes.iter_mut().for_each(redact_kv);
            }
            if let opentelemetry::trace::Status::Error { description } = &mut span.status {
                if let std::borrow::Cow::Owned(r) = crate::redact::redact(description) {
                    *description = r.into();
                }
            }
        }
        self.0.export(batch)
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.force_flush()
    }
    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// How [`init_with`] sets up logs and telemetry.
#[derive(Debug, Clone)]
pub struct Options {
    /// Filter directives under `RUST_LOG` (see `logs::DEFAULT_FILTER`).
    pub default_filter: String,
    /// Text or JSON lines.
    pub format: logs::LogFormat,
    /// Standard error or a file.
    pub writer: logs::LogWriter,
    /// OTLP export, if any (`GET /metrics` is served either way).
    pub export: Option<Export>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            default_filter: logs::DEFAULT_FILTER.into(),
            format: logs::LogFormat::Text,
            writer: logs::LogWriter::Stderr,
            export: None,
        }
    }
}

type BoxedLayer = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// Every log line, whoever wrote it (hubguard or a crate beneath it), passes the one
/// redaction rule ([`crate::redact`]) on its way out.
fn log_layer(options: &Options) -> BoxedLayer {
    use crate::redact::Redacting;
    use tracing_subscriber::fmt;
    let filter = logs::filter(&options.default_filter);
    let file = match &options.writer {
        logs::LogWriter::Stderr => None,
        logs::LogWriter::File(path) => match std::fs::File::create(path) {
            Ok(f) => Some(std::sync::Mutex::new(f)),
            Err(e) => {
                eprintln!(
                    "cannot write logs to {}: {e}; logging to stderr",
                    path.display()
                );
                None
            }
        },
    };
    let colour = file.is_none() && logs::stderr_colour();
    match (options.format, file) {
        (logs::LogFormat::Text, None) => fmt::layer()
            .with_writer(Redacting(std::io::stderr))
            .with_ansi(colour)
            .with_filter(filter)
            .boxed(),
        (logs::LogFormat::Text, Some(f)) => fmt::layer()
            .with_writer(Redacting(f))
            .with_ansi(false)
            .with_filter(filter)
            .boxed(),
        (logs::LogFormat::Json, None) => fmt::layer()
            .event_format(logs::JsonFormat)
            .with_writer(Redacting(std::io::stderr))
            .with_ansi(false)
            .with_filter(filter)
            .boxed(),
        (logs::LogFormat::Json, Some(f)) => fmt::layer()
            .event_format(logs::JsonFormat)
            .with_writer(Redacting(f))
            .with_ansi(false)
            .with_filter(filter)
            .boxed(),
    }
}

/// Installs logging as `options` say, and the tracer and meter providers: every hubguard
/// span becomes an OpenTelemetry span (only the attributes hubguard sets: none of tracing's
/// own — code location, thread, busy/idle times, level, target), metrics are served by
/// `prometheus::scrape` (`GET /metrics`) and, with `options.export`, pushed by OTLP. Call once per process,
/// inside a Tokio runtime (the exporters run on it); later calls return an empty guard.
pub fn init_with(options: Options) -> Guard {
    let logs = log_layer(&options);
    let (tracer, meter) = match providers(options.export.as_ref()) {
        Ok(p) => p,
        Err(e) => {
            let _ = tracing_subscriber::registry().with(logs).try_init();
            tracing::warn!(error = %e, "telemetry export disabled");
            return Guard::default();
        }
    };
    // Spans at info and above from hubguard only, whatever RUST_LOG says about logs.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer.tracer("hubguard"))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        // Nothing here reads OpenTelemetry's current context (every parent and link comes
        // from the tracing span tree): activating it on every poll of an instrumented future
        // was the largest cost of the partition thread's spans.
        .with_context_activation(false)
        .with_level(false)
        .with_target(false)
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target().starts_with("hubguard") && *m.level() <= tracing::Level::INFO
        }));
    let installed = tracing_subscriber::registry()
        .with(logs)
        .with(otel)
        .try_init()
        .is_ok();
    if !installed {
        return Guard::default();
    }
    opentelemetry::global::set_meter_provider(meter.clone());
    opentelemetry::global::set_tracer_provider(tracer.clone());
    Guard {
        tracer: Some(tracer),
        meter: Some(meter),
    }
}

use tracing_subscriber::Layer as _;

/// Parses a W3C `traceparent` (`00-<trace>-<span>-<flags>`).
pub fn parse_traceparent(tp: &str) -> Option<SpanContext> {
    let mut parts = tp.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    ))
}

/// Formats a span context as a W3C `traceparent`.
pub fn format_traceparent(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// The metric instruments (no-ops until a meter provider is installed).
pub struct Metrics {
    /// Events delivered.
    pub delivered: Counter<u64>,
    /// Retries scheduled.
    pub retries_scheduled: Counter<u64>,
    /// Events dead-lettered.
    pub dead_lettered: Counter<u64>,
    /// Attempts deferred by an open breaker.
    pub deferred: Counter<u64>,
    /// Retries due while an operator paused them, deferred uncounted.
    pub paused: Counter<u64>,
    /// Refusals the storm guard held instead of dead-lettering.
    pub storm_held: Counter<u64>,
    /// Retries taken back from Service Bus's dead-letter sub-queue.
    pub rescued: Counter<u64>,
    /// Overdue retries the ledger recorded and nothing ran, scheduled again.
    pub recovered: Counter<u64>,
    /// Retries of another deployment handed back to a shared queue.
    pub forwarded: Counter<u64>,
    /// Missing ledger records rebuilt from Event Hubs.
    pub records_rebuilt: Counter<u64>,
    /// Retries dead-lettered as `record_missing`.
    pub records_missing: Counter<u64>,
    /// Failed settlements.
    pub settle_failures: Counter<u64>,
    /// Handler duration (s).
    pub handler_duration: Histogram<f64>,
    /// Retry lateness (s).
    pub retry_lateness: Histogram<f64>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// Bucket boundaries (s) of the duration histograms. The SDK's default boundaries are made
/// for milliseconds (0, 5, 10, 25, …, 10000): in seconds every retry on time and every webhook
/// call would land in one bucket, (0, 5], and `histogram_quantile(0.99, …)` would read about
/// 4.95 s whatever happened. These follow OpenTelemetry's advice for durations in seconds
/// (https://opentelemetry.io/docs/specs/semconv/http/http-metrics/#metric-httpserverrequestduration:
/// 0.005 … 10), extended to an hour for retries that wait out an outage.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
    300.0, 600.0, 1800.0, 3600.0,
];

/// The meter hubguard's instruments come from.
pub fn meter() -> Meter {
    opentelemetry::global::meter("hubguard")
}

impl Metrics {
    /// The instruments, from the meter provider installed now (create them after
    /// [`init_with`]; each pipeline creates its own).
    pub fn new() -> Self {
        Self::with_meter(&meter())
    }

    /// The instruments, from `meter`.
    pub fn with_meter(meter: &Meter) -> Self {
        use names::metric as m;
        let metrics = Metrics {
            delivered: meter
                .u64_counter(m::DELIVERED)
                .with_description("Events delivered")
                .build(),
            retries_scheduled: meter
                .u64_counter(m::RETRIES_SCHEDULED)
                .with_description("Retries scheduled on Service Bus")
                .build(),
            dead_lettered: meter
                .u64_counter(m::DEAD_LETTERED)
                .with_description("Events dead-lettered")
                .build(),
            deferred: meter
                .u64_counter(m::DEFERRED)
                .with_description("Attempts deferred by an open circuit breaker")
                .build(),
            paused: meter
                .u64_counter(m::PAUSED)
                .with_description(
                    "Retries due while an operator paused them, deferred without an attempt",
                )
                .build(),
            storm_held: meter
                .u64_counter(m::STORM_GUARD_HELD)
                .with_description(
                    "Refusals for good the dead-letter storm guard held instead of dead-lettering",
                )
                .build(),
            rescued: meter
                .u64_counter(m::RESCUED)
                .with_description("Retries Service Bus dead-lettered, put back on the queue")
                .build(),
            recovered: meter
                .u64_counter(m::RECOVERED)
                .with_description(
                    "Retries the ledger recorded that were overdue with no message to run them, scheduled again",
                )
                .build(),
            forwarded: meter
                .u64_counter(m::FORWARDED)
                .with_description(
                    "Retries of another deployment received from a shared queue and handed back to it",
                )
                .build(),
            records_rebuilt: meter
                .u64_counter(m::RECORDS_REBUILT)
                .with_description(
                    "Retries whose ledger record was missing, rebuilt from the event read back from Event Hubs",
                )
                .build(),
            records_missing: meter
                .u64_counter(m::RECORDS_MISSING)
                .with_description(
                    "Retries whose ledger record was missing and whose event was gone from Event Hubs, dead-lettered as record_missing",
                )
                .build(),
            settle_failures: meter
                .u64_counter(m::SETTLE_FAILURES)
                .with_description("Settlements that failed and were retried")
                .build(),
            handler_duration: meter
                .f64_histogram(m::HANDLER_DURATION)
                .with_unit("s")
                .with_description("Handler call duration")
                .with_boundaries(SECONDS_BUCKETS.to_vec())
                .build(),
            retry_lateness: meter
                .f64_histogram(m::RETRY_LATENESS)
                .with_unit("s")
                .with_description("Retry start minus its scheduled time")
                .with_boundaries(SECONDS_BUCKETS.to_vec())
                .build(),
        };
        // Every counter starts at 0, so `/metrics` and `rate()` see it from the first scrape.
        for c in [
            &metrics.delivered,
            &metrics.retries_scheduled,
            &metrics.dead_lettered,
            &metrics.deferred,
            &metrics.paused,
            &metrics.rescued,
            &metrics.recovered,
            &metrics.forwarded,
            &metrics.records_rebuilt,
            &metrics.records_missing,
            &metrics.settle_failures,
        ] {
            c.add(0, &[]);
        }
        metrics
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Attributes for an event-type label.
pub fn type_label(event_type: Option<&str>) -> [KeyValue; 1] {
    [KeyValue::new(
        names::metric_attr::EVENT_TYPE,
        event_type.unwrap_or("").to_string(),
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exported_string_attributes_pass_the_redaction_rule() {
        let mut kv = KeyValue::new(
            "hubguard.error.message",
            "GET http://u:pw1@h/x?sig=s1 failed",
        );
        redact_kv(&mut kv);
        assert_eq!(kv.value.as_str(), "GET http://***@h/x?sig=*** failed");
        let mut kv = KeyValue::new(
            "a",
            opentelemetry::Value::Array(
                vec![opentelemetry::StringValue::from("Bearer Tok3n")].into(),
            ),
        );
        redact_kv(&mut kv);
        assert!(!format!("{:?}", kv.value).contains("Tok3n"));
        let mut kv = KeyValue::new("n", 5_i64);
        redact_kv(&mut kv);
        assert_eq!(kv.value, opentelemetry::Value::I64(5));
    }

    #[test]
    fn traceparents_round_trip_and_reject_garbage() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = parse_traceparent(tp).unwrap();
        assert_eq!(format_traceparent(&sc), tp);
        assert!(
            parse_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none()
        );
        assert!(parse_traceparent("garbage").is_none());
        assert!(
            parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7").is_none()
        );
    }

    /// A retry 50 ms late and a webhook call of 30 ms read as such: the quantiles the
    /// dashboard and the lateness alert compute come out in the right bucket, not in (0, 5].
    #[test]
    fn duration_histograms_have_buckets_in_seconds() {
        let registry = ::prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .build()
            .unwrap();
        let provider = SdkMeterProvider::builder().with_reader(exporter).build();
        let metrics = Metrics::with_meter(&opentelemetry::metrics::MeterProvider::meter(
            &provider, "hubguard",
        ));
        metrics.retry_lateness.record(0.05, &type_label(None));
        metrics.handler_duration.record(0.03, &type_label(None));
        for name in [
            "hubguard_retry_lateness_seconds",
            "hubguard_handler_duration_seconds",
        ] {
            let family = registry
                .gather()
                .into_iter()
                .find(|f| f.name() == name)
                .unwrap_or_else(|| panic!("{name} not gathered"));
            let h = family.get_metric()[0].get_histogram();
            let bounds: Vec<f64> = h.get_bucket().iter().map(|b| b.upper_bound()).collect();
            assert_eq!(bounds, SECONDS_BUCKETS, "{name}");
            // The one observation is in the bucket up to 0.05 s, not only in (0, 5].
            let le_005 = h
                .get_bucket()
                .iter()
                .find(|b| b.upper_bound() == 0.05)
                .unwrap();
            assert_eq!(le_005.cumulative_count(), 1, "{name}");
        }
    }

    #[test]
    fn names_are_unique() {
        let all = names::all();
        let set: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(set.len(), all.len());
    }
}
