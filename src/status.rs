//! The status API and the ledger's answer to "when will this retry?", shared by the HTTP
//! endpoints and `hubguard status`.
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /healthz` | 200 while the process runs |
//! | `GET /readyz` | 200 when no partition is held and the retry loop runs, else 503; JSON report |
//! | `GET /v1/status` | the JSON report (held partitions with reasons, retry loop, counters) |
//! | `GET /v1/events/{key}` | the event's ledger record as JSON; 404 if the ledger has none |
//! | `GET /v1/retries[?due_before=T]` | retries waiting (key, attempt, due time, last error), soonest first, from the ledger's listing |
//! | `GET /metrics` | every instrument in the Prometheus text format |

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;

use crate::ledger::{at, Ledger, LedgerRecord, Pending, State as LedgerState};
use crate::pipeline::health::Health;
use crate::redact::{redact, redact_json, redacted};

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
        "last_error": rec.last_error.as_deref().map(redacted),
        "dead_letter_reason": rec.dead_letter_reason,
        // An operator's `retries retry-now` (or a replay) of the attempt waiting.
        "run_now": rec.run_now.as_ref().filter(|p| rec.state == LedgerState::RetryScheduled && p.attempt == rec.attempts + 1).map(|p| json!({
            "attempt": p.attempt,
            "at": rfc3339(at(p.at_ms)),
            "by": p.by,
            "previous_due_at": p.previous_due_ms.map(|m| rfc3339(at(m))),
        })),
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
            "error": h.error.as_deref().map(redacted),
            "next_attempt_at": h.next_attempt_ms.map(|m| rfc3339(at(m))),
            "retry_after_capped_from_s": h.retry_after_capped_from_s,
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
    if let Some(p) = rec
        .run_now
        .as_ref()
        .filter(|p| rec.state == LedgerState::RetryScheduled && p.attempt == rec.attempts + 1)
    {
        out.push_str(&format!(
            "run now:         attempt {} by {} at {}\n",
            p.attempt,
            p.by,
            rfc3339(at(p.at_ms))
        ));
    }
    if let Some(r) = &rec.dead_letter_reason {
        out.push_str(&format!("dead-lettered:   {r}\n"));
    }
    if let Some(e) = &rec.last_error {
        out.push_str(&format!("last error:      {}\n", redact(e)));
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
            redact(h.error.as_deref().unwrap_or("")),
            h.next_attempt_ms
                .map(|m| format!(" → next at {}", rfc3339(at(m))))
                .unwrap_or_default()
                + &h.retry_after_capped_from_s
                    .map(|s| format!(" (Retry-After {s} s shortened to the policy's limit)"))
                    .unwrap_or_default(),
            h.trace_id.as_deref().unwrap_or("-"),
        ));
    }
    out
}

/// Parses `--due-before` / `?due_before=`: an RFC 3339 time, `now`, or a duration from
/// `now` (`90s`, `10m`, `2h`, `1d`).
pub fn parse_due_before(text: &str, now: SystemTime) -> Result<SystemTime, String> {
    let t = text.trim();
    if t == "now" {
        return Ok(now);
    }
    if let Ok(when) = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
    {
        return Ok(when.into());
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let unit_s = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => 0,
    };
    match n.parse::<u64>() {
        Ok(n) if unit_s > 0 => Ok(now + std::time::Duration::from_secs(n * unit_s)),
        _ => Err(format!(
            "`{t}` is not a time: give RFC 3339 (2026-11-30T03:47:33Z), `now`, or a duration from now (90s, 10m, 2h, 1d)"
        )),
    }
}

/// Retries waiting (from [`Ledger::pending`]: a listing, no record read), due before
/// `due_before` if given, soonest first.
pub async fn pending_retries(
    ledger: &Ledger,
    due_before: Option<SystemTime>,
) -> Result<Vec<Pending>, crate::ledger::LedgerError> {
    let mut all = ledger.pending().await?;
    if let Some(t) = due_before {
        all.retain(|p| p.due < t);
    }
    Ok(all)
}

/// A pending retry as JSON (`key`, `attempt`, `due`, `last_error`).
pub fn pending_view(p: &Pending) -> serde_json::Value {
    json!({
        "key": p.key,
        "attempt": p.attempt,
        "due": rfc3339(p.due),
        "last_error": p.last_error.as_deref().map(redacted),
    })
}

/// Pending retries as a text table, for `hubguard retries list`.
pub fn pending_text(pending: &[Pending]) -> String {
    let mut out = format!(
        "{} retr{} waiting\n",
        pending.len(),
        if pending.len() == 1 { "y" } else { "ies" }
    );
    if !pending.is_empty() {
        out.push_str(&format!(
            "{:<30} {:>7}  {:<32} LAST ERROR\n",
            "DUE", "ATTEMPT", "KEY"
        ));
    }
    for p in pending {
        out.push_str(&format!(
            "{:<30} {:>7}  {:<32} {}\n",
            rfc3339(p.due),
            p.attempt,
            p.key,
            redact(p.last_error.as_deref().unwrap_or(""))
        ));
    }
    out
}

/// The `hubguard.retries.pending` and `hubguard.retries.overdue` gauges, from the ledger's
/// listing refreshed every `every` — the answer to "what
/// is waiting?" for dashboards and alerts. Every replica lists the same ledger: aggregate
/// with `max`, not `sum`. Stops when dropped.
pub struct PendingGauges {
    dues: Arc<std::sync::Mutex<Option<Vec<SystemTime>>>>,
    task: tokio::task::JoinHandle<()>,
    _pending: opentelemetry::metrics::ObservableGauge<u64>,
    _overdue: opentelemetry::metrics::ObservableGauge<u64>,
}

impl std::fmt::Debug for PendingGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingGauges")
    }
}

impl Drop for PendingGauges {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PendingGauges {
    /// Registers the gauges and starts refreshing them from `ledger` every `every` (on the
    /// current Tokio runtime). Overdue is against the wall clock.
    pub fn start(ledger: Ledger, every: std::time::Duration) -> Self {
        use crate::telemetry::names::metric;
        let dues: Arc<std::sync::Mutex<Option<Vec<SystemTime>>>> = Default::default();
        let meter = crate::telemetry::meter();
        let d = dues.clone();
        let pending = meter
            .u64_observable_gauge(metric::RETRIES_PENDING)
            .with_description("Retries the ledger says are waiting (from its listing)")
            .with_callback(move |o| {
                if let Some(dues) = &*d.lock().unwrap_or_else(|e| e.into_inner()) {
                    o.observe(dues.len() as u64, &[]);
                }
            })
            .build();
        let d = dues.clone();
        let overdue = meter
            .u64_observable_gauge(metric::RETRIES_OVERDUE)
            .with_description("Retries waiting past their due time")
            .with_callback(move |o| {
                if let Some(dues) = &*d.lock().unwrap_or_else(|e| e.into_inner()) {
                    let now = SystemTime::now();
                    o.observe(dues.partition_point(|due| *due < now) as u64, &[]);
                }
            })
            .build();
        let d = dues.clone();
        let task = tokio::spawn(async move {
            loop {
                match ledger.pending().await {
                    Ok(p) => Self::store(&d, &p),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot list pending retries for the gauges")
                    }
                }
                tokio::time::sleep(every).await;
            }
        });
        PendingGauges {
            dues,
            task,
            _pending: pending,
            _overdue: overdue,
        }
    }

    fn store(dues: &std::sync::Mutex<Option<Vec<SystemTime>>>, pending: &[Pending]) {
        let mut v: Vec<SystemTime> = pending.iter().map(|p| p.due).collect();
        v.sort();
        *dues.lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
    }

    /// Updates the gauges from a complete listing just read.
    pub fn update(&self, pending: &[Pending]) {
        Self::store(&self.dues, pending);
    }
}

#[derive(Clone)]
struct AppState {
    health: Arc<Health>,
    ledger: Ledger,
    breaker: Option<Arc<crate::breaker::Shared>>,
    rate_limit: Option<Arc<crate::ratelimit::limiter::Limiter>>,
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
                    "trial": rec.trial,
                }),
            );
        }
        if let (Some(l), Some(obj)) = (&self.rate_limit, r.as_object_mut()) {
            obj.insert(
                "rate_limit".into(),
                serde_json::to_value(l.snapshot()).unwrap_or_default(),
            );
        }
        // Reasons quote what dependencies answered: the one rule masks any credential.
        redact_json(&mut r);
        r
    }
}

/// The status router (`breaker`: the pipeline's circuit breaker, shown in the report).
pub fn router(
    health: Arc<Health>,
    ledger: Ledger,
    breaker: Option<Arc<crate::breaker::Shared>>,
) -> Router {
    router_with_rate_limit(health, ledger, breaker, None)
}

/// The status router, with the downstream's rate limiter shown in the report under
/// `rate_limit` (the configured limit, the current rate, the last decrease's reason).
pub fn router_with_rate_limit(
    health: Arc<Health>,
    ledger: Ledger,
    breaker: Option<Arc<crate::breaker::Shared>>,
    rate_limit: Option<Arc<crate::ratelimit::limiter::Limiter>>,
) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/status", get(report))
        .route("/v1/events/{key}", get(event))
        .route("/v1/retries", get(retries))
        .route("/v1/control", get(control))
        .route("/metrics", get(metrics))
        .with_state(AppState {
            health,
            ledger,
            breaker,
            rate_limit,
        })
}

async fn healthz(State(s): State<AppState>) -> Response {
    match s.health.live() {
        Ok(()) => "ok".into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "live": false, "reason": redacted(&reason) })),
        )
            .into_response(),
    }
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
            Json(s.ledger.no_record(&key, SystemTime::now())),
        )
            .into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": redacted(&e.to_string()) })),
        )
            .into_response(),
    }
}

/// The operator's control record, read now: which partitions are paused (by whom, since
/// when, why) and the checkpoint rewinds asked for (waiting, or applied by whom and when).
/// Read-only: the actions stay on the command line.
async fn control(State(s): State<AppState>) -> Response {
    let name = s.ledger.control_record_name();
    match crate::pipeline::control::read(s.ledger.store().as_ref(), &name).await {
        Ok(record) => {
            let (record, etag) = record.map_or((Default::default(), None), |(p, e)| (p, Some(e)));
            let mut v = serde_json::to_value::<crate::pipeline::control::Pauses>(record)
                .unwrap_or_default();
            v["record"] = name.into();
            v["exists"] = etag.is_some().into();
            crate::redact::redact_json(&mut v);
            Json(v).into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "record": name, "error": redacted(&e.to_string()) })),
        )
            .into_response(),
    }
}

async fn metrics() -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::telemetry::prometheus::CONTENT_TYPE,
        )],
        redacted(&crate::telemetry::prometheus::scrape()),
    )
        .into_response()
}

#[derive(serde::Deserialize)]
struct RetriesQuery {
    due_before: Option<String>,
}

async fn retries(
    State(s): State<AppState>,
    axum::extract::Query(q): axum::extract::Query<RetriesQuery>,
) -> Response {
    let due_before = match q
        .due_before
        .as_deref()
        .map(|t| parse_due_before(t, SystemTime::now()))
    {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => {
            return (StatusCode::BAD_REQUEST, Json(json!({ "error": e }))).into_response()
        }
    };
    match pending_retries(&s.ledger, due_before).await {
        Ok(p) => Json(json!({
            "count": p.len(),
            "due_before": due_before.map(rfc3339),
            "retries": p.iter().map(pending_view).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": redacted(&e.to_string()) })),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    #[test]
    fn due_before_takes_times_and_durations() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let p = |t| super::parse_due_before(t, now);
        assert_eq!(p("now"), Ok(now));
        assert_eq!(p("10m"), Ok(now + Duration::from_secs(600)));
        assert_eq!(p("1d"), Ok(now + Duration::from_secs(86_400)));
        assert_eq!(
            p("1970-01-12T13:46:40Z"),
            Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000))
        );
        assert!(p("soon").is_err());
        assert!(p("10").is_err());
    }
}
