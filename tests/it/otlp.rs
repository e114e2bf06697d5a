//! An in-process OTLP/HTTP collector (protobuf over `POST /v1/traces` and `/v1/metrics`),
//! and the process-wide telemetry the test binary installs once, exporting to it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;

/// A received span.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub start_ns: u64,
    pub attributes: BTreeMap<String, String>,
    /// How many attributes arrived (more than `attributes.len()`: a key was sent twice).
    pub attribute_count: usize,
    /// (trace id, span id) of each link.
    pub links: Vec<(String, String)>,
    pub status_code: i32,
}

/// A received metric data point: name → value (sum / histogram count).
#[derive(Debug, Default)]
pub(crate) struct Collected {
    pub spans: Vec<Span>,
    pub metrics: BTreeMap<String, f64>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attrs(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(AnyValue::IntValue(i)) => i.to_string(),
                Some(AnyValue::BoolValue(b)) => b.to_string(),
                Some(AnyValue::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

async fn traces(State(c): State<Arc<Mutex<Collected>>>, body: Bytes) -> Vec<u8> {
    if let Ok(req) = ExportTraceServiceRequest::decode(body) {
        let mut c = c.lock().unwrap();
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                for s in ss.spans {
                    c.spans.push(Span {
                        name: s.name.clone(),
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        start_ns: s.start_time_unix_nano,
                        attributes: attrs(&s.attributes),
                        attribute_count: s.attributes.len(),
                        links: s
                            .links
                            .iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                            .collect(),
                        status_code: s.status.as_ref().map_or(0, |st| st.code),
                    });
                }
            }
        }
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

async fn metrics(State(c): State<Arc<Mutex<Collected>>>, body: Bytes) -> Vec<u8> {
    use opentelemetry_proto::tonic::metrics::v1::metric::Data;
    use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value;
    if let Ok(req) = ExportMetricsServiceRequest::decode(body) {
        let mut c = c.lock().unwrap();
        for rm in req.resource_metrics {
            for sm in rm.scope_metrics {
                for m in sm.metrics {
                    let v = match &m.data {
                        Some(Data::Sum(s)) => s
                            .data_points
                            .iter()
                            .map(|p| match p.value {
                                Some(Value::AsInt(i)) => i as f64,
                                Some(Value::AsDouble(d)) => d,
                                None => 0.0,
                            })
                            .sum(),
                        Some(Data::Histogram(h)) => {
                            h.data_points.iter().map(|p| p.count as f64).sum()
                        }
                        Some(Data::Gauge(g)) => g
                            .data_points
                            .iter()
                            .map(|p| match p.value {
                                Some(Value::AsInt(i)) => i as f64,
                                Some(Value::AsDouble(d)) => d,
                                None => 0.0,
                            })
                            .sum(),
                        _ => 0.0,
                    };
                    c.metrics.insert(m.name.clone(), v);
                }
            }
        }
    }
    ExportMetricsServiceResponse::default().encode_to_vec()
}

pub(crate) struct Telemetry {
    pub collected: Arc<Mutex<Collected>>,
    guard: hubguard::telemetry::Guard,
    /// Keeps the exporters' runtime alive for the whole test binary.
    _runtime: tokio::runtime::Runtime,
}

impl Telemetry {
    /// Exports what is buffered (from a blocking thread: the exporters run on our runtime).
    pub(crate) async fn flush(&'static self) {
        tokio::task::spawn_blocking(move || self.guard.flush())
            .await
            .unwrap();
    }
}

/// The process-wide telemetry and its collector, started once on a runtime of its own (the
/// exporters must outlive every test's runtime).
pub(crate) fn telemetry() -> &'static Telemetry {
    static T: OnceLock<Telemetry> = OnceLock::new();
    T.get_or_init(|| {
        std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let collected = Arc::new(Mutex::new(Collected::default()));
            let guard = runtime.block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                let app = Router::new()
                    .route("/v1/traces", post(traces))
                    .route("/v1/metrics", post(metrics))
                    .with_state(collected.clone());
                tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
                // Logs go to a file (printed when a test fails), not to the terminal.
                hubguard::telemetry::init_with(hubguard::telemetry::Options {
                    default_filter: "warn,hubguard=info".into(),
                    writer: hubguard::telemetry::logs::LogWriter::File(
                        crate::test_log::in_process_path(),
                    ),
                    export: Some(hubguard::telemetry::Export {
                        endpoint: format!("http://{addr}"),
                        protocol: opentelemetry_otlp::Protocol::HttpBinary,
                        metric_interval: Duration::from_millis(300),
                    }),
                    ..Default::default()
                })
            });
            Telemetry {
                collected,
                guard,
                _runtime: runtime,
            }
        })
        .join()
        .unwrap()
    })
}
