//! Telemetry: `tracing` spans exported as OpenTelemetry traces, and OpenTelemetry metrics,
//! both by OTLP, configured by the standard `OTEL_*` variables
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL` = `grpc` or
//! `http/protobuf`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, …). Without an endpoint
//! nothing is exported and nothing breaks: spans still give every attempt a W3C trace context.
//!
//! Every name lives in [`names`].

pub mod names;

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

/// Where to export (for tests and embedders; the binary reads `OTEL_*`).
#[derive(Debug, Clone)]
pub struct Export {
    /// OTLP endpoint (`http://host:4317` for gRPC, `http://host:4318` for HTTP).
    pub endpoint: String,
    /// `grpc` or `http/protobuf`.
    pub protocol: Protocol,
    /// How often metrics are exported.
    pub metric_interval: Duration,
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

fn providers(export: &Export) -> Result<(SdkTracerProvider, SdkMeterProvider), String> {
    let resource = Resource::builder().with_service_name(
        std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "hubguard".into()),
    );
    let resource = resource.build();
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
    let spans = spans.map_err(|e| format!("OTLP span exporter: {e}"))?;
    let metrics = metrics.map_err(|e| format!("OTLP metric exporter: {e}"))?;
    // The exporters are async (tonic, reqwest): run them on the caller's Tokio runtime.
    let processor =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            spans,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let tracer = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource.clone())
        .build();
    let reader =
        opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader::builder(
            metrics,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_interval(export.metric_interval)
        .build();
    let meter = SdkMeterProvider::builder()
        .with_reader(reader)
        .with_resource(resource)
        .build();
    Ok((tracer, meter))
}

/// Installs logging (to stderr, `RUST_LOG` or `default_filter`) and, when `export` is
/// given, OTLP traces and metrics. Call once per process, inside a Tokio runtime (the
/// exporters run on it); later calls return an empty guard.
pub fn init(default_filter: &str, export: Option<Export>) -> Guard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let Some(export) = export else {
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .try_init();
        return Guard::default();
    };
    match providers(&export) {
        Ok((tracer, meter)) => {
            let otel = tracing_opentelemetry::layer()
                .with_tracer(tracer.tracer("hubguard"))
                .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                    m.target().starts_with("hubguard")
                }));
            let installed = tracing_subscriber::registry()
                .with(filter)
                .with(fmt)
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
        Err(e) => {
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(fmt)
                .try_init();
            tracing::warn!(error = %e, "telemetry export disabled");
            Guard::default()
        }
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
    /// Retries taken back from Service Bus's dead-letter sub-queue.
    pub rescued: Counter<u64>,
    /// Overdue retries the ledger recorded and nothing ran, scheduled again.
    pub recovered: Counter<u64>,
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

/// The meter hubguard's instruments come from.
pub fn meter() -> Meter {
    opentelemetry::global::meter("hubguard")
}

impl Metrics {
    /// The instruments, from the meter provider installed now (create them after
    /// [`init`]; each pipeline creates its own).
    pub fn new() -> Self {
        use names::metric as m;
        let meter = meter();
        Metrics {
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
            settle_failures: meter
                .u64_counter(m::SETTLE_FAILURES)
                .with_description("Settlements that failed and were retried")
                .build(),
            handler_duration: meter
                .f64_histogram(m::HANDLER_DURATION)
                .with_unit("s")
                .with_description("Handler call duration")
                .build(),
            retry_lateness: meter
                .f64_histogram(m::RETRY_LATENESS)
                .with_unit("s")
                .with_description("Retry start minus its scheduled time")
                .build(),
        }
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

    #[test]
    fn names_are_unique() {
        let all = names::all();
        let set: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(set.len(), all.len());
    }
}
