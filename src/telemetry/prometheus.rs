//! `GET /metrics`: the same instruments the OTLP exporter pushes, pulled in the Prometheus
//! text format (`opentelemetry-prometheus` reads the SDK's meter provider at each scrape).
//!
//! Names follow the exporter's translation — dots become underscores, counters end in
//! `_total`, the unit is appended (`s` → `_seconds`) — except that a name already ending in
//! its unit does not get it twice (`hubguard.checkpoint.lag.seconds` is
//! `hubguard_checkpoint_lag_seconds`, as the OpenTelemetry Collector's Prometheus exporter
//! spells it too).

use std::sync::OnceLock;

use prometheus::Encoder as _;

static REGISTRY: OnceLock<prometheus::Registry> = OnceLock::new();

/// A Prometheus reader for the meter provider, registering into the process's registry.
/// `None` after the first call (one meter provider per process serves `/metrics`).
pub(crate) fn reader() -> Option<opentelemetry_prometheus::PrometheusExporter> {
    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .build()
        .ok()?;
    REGISTRY.set(registry).ok()?;
    Some(exporter)
}

/// The Prometheus text exposition format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every instrument now, in the Prometheus text format (empty before telemetry is
/// initialised).
pub fn scrape() -> String {
    let Some(registry) = REGISTRY.get() else {
        return String::new();
    };
    let mut families = registry.gather();
    for f in &mut families {
        let name = single_unit(f.name());
        if name != f.name() {
            f.set_name(name);
        }
    }
    let mut out = Vec::new();
    if prometheus::TextEncoder::new()
        .encode(&families, &mut out)
        .is_err()
    {
        return String::new();
    }
    String::from_utf8(out).unwrap_or_default()
}

/// `x_seconds_seconds` → `x_seconds` (likewise before `_total`/`_bucket`… are added: the
/// encoder adds those from the family's type).
fn single_unit(name: &str) -> String {
    for unit in ["seconds", "bytes", "milliseconds"] {
        let twice = format!("_{unit}_{unit}");
        if let Some(stem) = name.strip_suffix(&twice) {
            return format!("{stem}_{unit}");
        }
    }
    name.to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_unit_is_not_appended_twice() {
        assert_eq!(
            super::single_unit("hubguard_checkpoint_lag_seconds_seconds"),
            "hubguard_checkpoint_lag_seconds"
        );
        assert_eq!(
            super::single_unit("hubguard_breaker_age_seconds"),
            "hubguard_breaker_age_seconds"
        );
    }
}
