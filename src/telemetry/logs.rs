//! Logs: human text (the default) or one JSON object per line, to stderr or a file; colour only
//! on a terminal and never with `NO_COLOR`; default filter directives that keep the Azure SDK
//! quiet at `info`, under `RUST_LOG`.
//!
//! A JSON line carries `time` (RFC 3339, UTC), `level`, `target`, `message`, `fields` (the
//! event's own), `span` (the innermost span's name) and, inside an attempt, the attempt
//! span's `trace_id` and `span_id` — the ids its trace is exported under, so a log line joins
//! its trace.

use std::fmt;
use std::io::IsTerminal as _;
#[cfg(any(test, feature = "cli"))]
use std::path::Path;
use std::path::PathBuf;

use opentelemetry::trace::TraceContextExt as _;
use serde::Deserialize;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// How log lines are written (`--log-format`, `[log] format`, `HUBGUARD_LOG__FORMAT`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[log]` in the configuration.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSection {
    /// `text` (default) or `json`. `--log-format` wins over it.
    #[serde(default)]
    pub format: LogFormat,
}

/// Where log lines go.
#[derive(Debug, Clone, Default)]
pub enum LogWriter {
    /// Standard error (coloured only when it is a terminal and `NO_COLOR` is unset).
    #[default]
    Stderr,
    /// A file (created or truncated; never coloured).
    File(PathBuf),
}

/// Filter directives under `RUST_LOG`: hubguard at `info`, everything else at `warn` — the
/// Azure SDK crates log their load balancing and connection handling at `info` (about eight
/// lines per processor update interval), which says nothing an operator acts on. `RUST_LOG`
/// adds to these and wins for the targets it names (`RUST_LOG=info` lifts hubguard and
/// others to info but leaves the SDK crates at warn; `RUST_LOG=azure_messaging_eventhubs=info`
/// brings the SDK's lines back).
pub const DEFAULT_FILTER: &str = "warn,hubguard=info,azure_core=warn,azure_core_amqp=warn,azure_identity=warn,azure_messaging_eventhubs=warn,azure_messaging_eventhubs_checkpointstore_blob=warn,azure_storage_blob=warn,azure_messaging_servicebus=warn,fe2o3_amqp=warn";

/// The filter: `defaults`, then `RUST_LOG`'s directives on top (a bad `RUST_LOG` directive
/// is skipped, as `EnvFilter` does).
pub fn filter(defaults: &str) -> tracing_subscriber::EnvFilter {
    filter_from(defaults, std::env::var("RUST_LOG").ok().as_deref())
}

fn filter_from(defaults: &str, rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    let spec = match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        Some(env) => format!("{defaults},{env}"),
        None => defaults.to_string(),
    };
    tracing_subscriber::EnvFilter::builder().parse_lossy(spec)
}

/// Whether text logs to stderr are coloured: only on a terminal, and never when `NO_COLOR`
/// is set to anything non-empty (<https://no-color.org>).
pub fn stderr_colour() -> bool {
    colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// The log format a configuration file asks for (`[log] format`, or `HUBGUARD_LOG__FORMAT`
/// from `env` over it), read before logging starts; `None` when neither says (or the file
/// does not parse: loading it reports that).
#[cfg(any(test, feature = "cli"))]
pub fn format_from_config(
    path: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Option<LogFormat> {
    let parse = |s: &str| {
        LogFormat::deserialize(serde::de::value::StrDeserializer::<serde::de::value::Error>::new(s))
            .ok()
    };
    if let Some((_, v)) = env.into_iter().find(|(k, _)| k == "HUBGUARD_LOG__FORMAT") {
        return parse(v.trim().trim_matches('"'));
    }
    let text = std::fs::read_to_string(path?).ok()?;
    let table: toml::Table = text.parse().ok()?;
    parse(table.get("log")?.get("format")?.as_str()?)
}

/// Formats an event as one JSON object per line (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct JsonFormat;

struct Fields<'a> {
    message: &'a mut Option<String>,
    fields: &'a mut serde_json::Map<String, serde_json::Value>,
}

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
}

impl Fields<'_> {
    fn put(&mut self, field: &Field, mut value: serde_json::Value) {
        // The writer masks the whole line too; masking the value first keeps JSON escaping
        // out of the rule's way.
        crate::redact::redact_json(&mut value);
        if field.name() == "message" {
            *self.message = Some(match value {
                serde_json::Value::String(s) => s,
                v => v.to_string(),
            });
        } else if !field.name().starts_with("log.") {
            self.fields.insert(field.name().to_string(), value);
        }
    }
}

/// The OpenTelemetry span context of span `id`, if the OpenTelemetry layer tracks it.
fn otel_ids(id: &tracing::span::Id) -> Option<(String, String)> {
    tracing::dispatcher::get_default(|d| tracing_opentelemetry::get_otel_context(id, d)).and_then(
        |cx| {
            let span = cx.span();
            let sc = span.span_context();
            sc.is_valid()
                .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
        },
    )
}

impl<S, N> FormatEvent<S, N> for JsonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut message = None;
        let mut fields = serde_json::Map::new();
        event.record(&mut Fields {
            message: &mut message,
            fields: &mut fields,
        });
        let mut line = serde_json::Map::new();
        let now = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        line.insert("time".into(), now.into());
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        line.insert("message".into(), message.unwrap_or_default().into());
        line.insert("fields".into(), fields.into());
        if let Some(scope) = ctx.event_scope() {
            let spans: Vec<_> = scope.collect();
            if let Some(leaf) = spans.first() {
                line.insert("span".into(), leaf.name().into());
            }
            // The attempt's span if the event is inside one, else the innermost traced span.
            let ids = spans
                .iter()
                .find(|s| s.name() == "attempt" && s.metadata().target() == "hubguard::attempt")
                .and_then(|s| otel_ids(&s.id()))
                .or_else(|| spans.iter().find_map(|s| otel_ids(&s.id())));
            if let Some((trace_id, span_id)) = ids {
                line.insert("trace_id".into(), trace_id.into());
                line.insert("span_id".into(), span_id.into());
            }
        }
        writeln!(writer, "{}", serde_json::Value::Object(line))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(colour(true, None));
        assert!(colour(true, Some(OsStr::new(""))));
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(!colour(false, None));
    }

    #[test]
    fn the_sdk_stays_at_warn_under_rust_log_info_unless_named() {
        let f = filter_from(DEFAULT_FILTER, Some("info")).to_string();
        assert!(f.contains("azure_messaging_eventhubs=warn"), "{f}");
        assert!(f.contains("info"), "{f}");
        let f = filter_from(DEFAULT_FILTER, Some("azure_messaging_eventhubs=debug")).to_string();
        assert!(f.contains("azure_messaging_eventhubs=debug"), "{f}");
        assert!(!f.contains("azure_messaging_eventhubs=warn"), "{f}");
    }

    #[test]
    fn the_format_comes_from_the_environment_over_the_file() {
        let dir = std::env::temp_dir().join(format!("hubguard-logfmt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(&file, "[log]\nformat = \"json\"\n").unwrap();
        assert_eq!(format_from_config(Some(&file), []), Some(LogFormat::Json));
        let env = [("HUBGUARD_LOG__FORMAT".to_string(), "text".to_string())];
        assert_eq!(format_from_config(Some(&file), env), Some(LogFormat::Text));
        assert_eq!(format_from_config(None, []), None);
        let _ = std::fs::remove_dir_all(dir);
    }
}
