//! The admin endpoint of `hubguard emulator`: lets an operator, or a test in another process,
//! inject faults and read counters over HTTP.
//!
//! | request | effect |
//! |---|---|
//! | `GET /health` | `ok` |
//! | `GET /status` | JSON: partitions' event counts, queues' counters, containers |
//! | `POST /faults/{eventhubs\|servicebus\|blob\|all}` | JSON body: `{"kind":"error","status":503,"seconds":30}`, `{"kind":"refuse","seconds":30}`, `{"kind":"delay","ms":200}` (per HTTP request; per AMQP round trip on Event Hubs, not per streamed transfer; on top of the `--latency` profile, which `clear` keeps), `{"kind":"drop"}`, `{"kind":"server-busy","seconds":30}` (Event Hubs: links and sends refused with `com.microsoft:server-busy`; `seconds` 0 ends it) or `{"kind":"clear"}` |
//! | `POST /clock/advance` | JSON `{"seconds":N}`: move the Service Bus clock forward |
//! | `POST /send/{hub}` | JSON `{"count":N,"body":"…","partition":"0","type":"order.created"}`: append N test events (CloudEvents `ce_id` `{hub}-{seq}`, `ce_type`) |

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::json;

use super::Emulators;

/// A fault to inject.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum FaultRequest {
    /// Answer every request with `status` for `seconds`.
    Error {
        /// The HTTP (or AMQP management) status.
        status: u16,
        /// For how long.
        seconds: u64,
    },
    /// Close new connections at once for `seconds`.
    Refuse {
        /// For how long.
        seconds: u64,
    },
    /// Add `ms` of latency to every round trip (each HTTP request; on Event Hubs each batch
    /// of frames the client sends, so a prefetching receiver is not slowed per transfer).
    Delay {
        /// Milliseconds.
        ms: u64,
    },
    /// Drop every live connection.
    Drop,
    /// Answer as a throttled namespace for `seconds` (0 ends it): Event Hubs refuses links
    /// and rejects sends with `com.microsoft:server-busy`.
    #[serde(rename = "server-busy", alias = "serverbusy")]
    ServerBusy {
        /// For how long.
        seconds: u64,
    },
    /// Remove every fault.
    Clear,
}

impl FaultRequest {
    /// Applies the fault to `faults`.
    pub fn apply(&self, faults: &super::Faults) {
        match *self {
            FaultRequest::Error { status, seconds } => {
                faults.error_status_for(status, Duration::from_secs(seconds))
            }
            FaultRequest::Refuse { seconds } => {
                faults.refuse_connections_for(Duration::from_secs(seconds));
                faults.drop_connections();
            }
            FaultRequest::Delay { ms } => faults.set_delay(Duration::from_millis(ms)),
            FaultRequest::Drop => faults.drop_connections(),
            FaultRequest::ServerBusy { seconds } => {
                faults.server_busy_for(Duration::from_secs(seconds))
            }
            FaultRequest::Clear => faults.clear(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct Advance {
    seconds: u64,
}

/// The admin router over running emulators.
pub fn router(emulators: Arc<Emulators>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/status", get(status))
        .route("/faults/{service}", post(fault))
        .route("/clock/advance", post(advance))
        .route("/send/{hub}", post(send))
        .with_state(emulators)
}

async fn status(State(e): State<Arc<Emulators>>) -> Json<serde_json::Value> {
    Json(e.status())
}

async fn fault(
    State(e): State<Arc<Emulators>>,
    Path(service): Path<String>,
    Json(req): Json<FaultRequest>,
) -> Response {
    let targets = e.faults_for(&service);
    if targets.is_empty() {
        return (
            StatusCode::NOT_FOUND,
            format!("no running service '{service}' (eventhubs, servicebus, blob, all)"),
        )
            .into_response();
    }
    for f in targets {
        req.apply(f);
    }
    (
        StatusCode::OK,
        Json(json!({ "service": service, "applied": format!("{req:?}") })),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
struct Send {
    #[serde(default = "one")]
    count: usize,
    #[serde(default)]
    body: String,
    partition: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
}

fn one() -> usize {
    1
}

async fn send(
    State(e): State<Arc<Emulators>>,
    Path(hub): Path<String>,
    Json(s): Json<Send>,
) -> Response {
    use fe2o3_amqp_types::messaging::{ApplicationProperties, Body, Data, Message};
    use fe2o3_amqp_types::primitives::SimpleValue;
    let Some(hub) = e.eventhubs.as_ref().and_then(|eh| eh.store().hub(&hub)) else {
        return (StatusCode::NOT_FOUND, format!("no hub '{hub}'")).into_response();
    };
    let mut sent = 0;
    for i in 0..s.count {
        let p = match &s.partition {
            Some(p) => match hub.partition_index(p) {
                Some(i) => i,
                None => {
                    return (StatusCode::NOT_FOUND, format!("no partition '{p}'")).into_response()
                }
            },
            None => hub.route(None),
        };
        let seq = hub.partitions[p].len();
        let mut props = ApplicationProperties::builder().insert(
            "ce_id",
            SimpleValue::String(format!("{}-{p}-{seq}", hub.name)),
        );
        if let Some(t) = &s.event_type {
            props = props.insert("ce_type", SimpleValue::String(t.clone()));
        }
        let body = if s.body.is_empty() {
            format!("{{\"n\":{i}}}")
        } else {
            s.body.clone()
        };
        let msg = Message::builder()
            .application_properties(props.build())
            .body(Body::Data(vec![Data(body.into_bytes().into())].into()))
            .build();
        if let Err(err) = hub.partitions[p].append(vec![msg], None) {
            return (StatusCode::INTERNAL_SERVER_ERROR, err.to_string()).into_response();
        }
        sent += 1;
    }
    (StatusCode::OK, Json(json!({ "sent": sent }))).into_response()
}

async fn advance(State(e): State<Arc<Emulators>>, Json(a): Json<Advance>) -> Response {
    match &e.servicebus {
        Some(sb) => {
            sb.clock().advance(Duration::from_secs(a.seconds));
            (StatusCode::OK, "advanced").into_response()
        }
        None => (StatusCode::NOT_FOUND, "service bus is not running").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_busy_fault_parses_and_applies() {
        let req: FaultRequest =
            serde_json::from_str(r#"{"kind":"server-busy","seconds":30}"#).unwrap();
        assert_eq!(req, FaultRequest::ServerBusy { seconds: 30 });
        let faults = super::super::Faults::new(tokio_util::sync::CancellationToken::new());
        req.apply(&faults);
        assert!(faults.server_busy());
        FaultRequest::ServerBusy { seconds: 0 }.apply(&faults);
        assert!(!faults.server_busy());
    }
}
