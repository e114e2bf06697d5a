//! The status API and the ledger's answer to "when will this retry?", shared by the HTTP
//! endpoints and `hubguard status`.
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /healthz` | 200 while the process runs |
//! | `GET /readyz` | 200 when no partition is held and the retry loop runs, else 503; JSON report |
//! | `GET /v1/status` | the JSON report (held partitions with reasons, retry loop, counters) |
//! | `GET /v1/events/{key}` | the event's ledger record as JSON; 404 if the ledger has none |

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;

use crate::ledger::{at, Ledger, LedgerRecord, State as LedgerState};
use crate::pipeline::health::Health;

/// RFC 3339 with milliseconds.
pub use crate::clock::rfc3339;

/// The record as support staff read it (times in RFC 3339).
pub fn record_view(rec: &LedgerRecord) -> serde_json::Value {
    json!({
        "key": rec.key,
        "correlation_id": rec.correlation_id,
        "event_type": rec.event_type,
        "state": rec.state,
        "attempts": rec.attempts,
        "max_attempts": rec.policy.max_attempts + rec.attempt_base,
        "next_attempt_at": rec.next_attempt_ms.map(|m| rfc3339(at(m))),
        "last_error": rec.last_error,
        "dead_letter_reason": rec.dead_letter_reason,
        "policy": rec.policy.name,
        "first_failure_at": rfc3339(at(rec.first_failure_ms)),
        "updated_at": rfc3339(at(rec.updated_ms)),
        "partition": rec.event.partition_id,
        "sequence_number": rec.event.sequence_number,
        "trace_ids": rec.history.iter().filter_map(|h| h.trace_id.clone()).collect::<Vec<_>>(),
        "history": rec.history.iter().map(|h| json!({
            "attempt": h.attempt,
            "started_at": rfc3339(at(h.started_ms)),
            "finished_at": rfc3339(at(h.finished_ms)),
            "outcome": h.outcome,
            "error": h.error,
            "next_attempt_at": h.next_attempt_ms.map(|m| rfc3339(at(m))),
            "trace_id": h.trace_id,
        })).collect::<Vec<_>>(),
    })
}

/// The record as text, for `hubguard status`.
pub fn record_text(rec: &LedgerRecord) -> String {
    let mut out = String::new();
    let state = match rec.state {
        LedgerState::RetryScheduled => "RETRY_SCHEDULED",
        LedgerState::Delivered => "DELIVERED",
        LedgerState::DeadLettered => "DEAD_LETTERED",
    };
    out.push_str(&format!("key:             {}\n", rec.key));
    out.push_str(&format!("state:           {state}\n"));
    out.push_str(&format!(
        "attempts:        {} of {} ({} policy)\n",
        rec.attempts,
        rec.policy.max_attempts + rec.attempt_base,
        rec.policy.name
    ));
    if let Some(n) = rec.next_attempt_ms {
        out.push_str(&format!("next attempt at: {}\n", rfc3339(at(n))));
    }
    if let Some(r) = &rec.dead_letter_reason {
        out.push_str(&format!("dead-lettered:   {r}\n"));
    }
    if let Some(e) = &rec.last_error {
        out.push_str(&format!("last error:      {e}\n"));
    }
    out.push_str(&format!("correlation id:  {}\n", rec.correlation_id));
    if let Some(t) = &rec.event_type {
        out.push_str(&format!("event type:      {t}\n"));
    }
    out.push_str(&format!(
        "event:           partition {} sequence number {}\n",
        rec.event.partition_id, rec.event.sequence_number
    ));
    out.push_str("history:\n");
    for h in &rec.history {
        out.push_str(&format!(
            "  #{:<3} {}  {:<16} {}{}  trace {}\n",
            h.attempt,
            rfc3339(at(h.started_ms)),
            h.outcome,
            h.error.as_deref().unwrap_or(""),
            h.next_attempt_ms
                .map(|m| format!(" → next at {}", rfc3339(at(m))))
                .unwrap_or_default(),
            h.trace_id.as_deref().unwrap_or("-"),
        ));
    }
    out
}

#[derive(Clone)]
struct AppState {
    health: Arc<Health>,
    ledger: Ledger,
    breaker: Option<Arc<crate::breaker::Shared>>,
}

impl AppState {
    fn report(&self) -> serde_json::Value {
        let mut r = self.health.report();
        if let (Some(b), Some(obj)) = (&self.breaker, r.as_object_mut()) {
            let rec = b.cached().unwrap_or_default();
            obj.insert(
                "breaker".into(),
                json!({
                    "downstream": b.downstream(),
                    "state": match rec.open_until_ms {
                        None => "closed",
                        Some(u) if at(u) > SystemTime::now() => "open",
                        Some(_) => "half_open",
                    },
                    "open_until": rec.open_until_ms.map(|u| rfc3339(at(u))),
                    "opened_at": rec.opened_at_ms.map(|u| rfc3339(at(u))),
                    "opens": rec.opens,
                    "reopens": rec.reopens,
                }),
            );
        }
        r
    }
}

/// The status router (`breaker`: the pipeline's circuit breaker, shown in the report).
pub fn router(
    health: Arc<Health>,
    ledger: Ledger,
    breaker: Option<Arc<crate::breaker::Shared>>,
) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/v1/status", get(report))
        .route("/v1/events/{key}", get(event))
        .with_state(AppState {
            health,
            ledger,
            breaker,
        })
}

async fn readyz(State(s): State<AppState>) -> Response {
    let code = if s.health.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(s.report())).into_response()
}

async fn report(State(s): State<AppState>) -> Json<serde_json::Value> {
    Json(s.report())
}

async fn event(State(s): State<AppState>, Path(key): Path<String>) -> Response {
    match s.ledger.get(&key).await {
        Ok(Some((rec, _))) => Json(record_view(&rec)).into_response(),
        Ok(None) => (
            StatusCode::NOT_FOUND,
            Json(json!({ "key": key, "state": "UNKNOWN", "detail": "the ledger has no record: the event never failed (delivered on its first attempt) or was never read" })),
        )
            .into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "error": e.to_string() }))).into_response(),
    }
}
