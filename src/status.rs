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

#[cfg(any(test, feature = "cli"))]
use crate::sync::LockExt;
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
#[cfg(any(test, feature = "cli"))]
use crate::redact::redact;
use crate::redact::{redact_json, redacted};

/// RFC 3339 with milliseconds.
pub use crate::clock::rfc3339;

/// The record as support staff read it (times in RFC 3339).
pub fn record_view(rec: &LedgerRecord) -> serde_json::Value {
    json!({
        "key": rec.key,
        "correlation_id": rec.correlation_id,
        "event_type": rec.event_type,
        "state": rec.state(),
        "attempts": rec.attempts,
        "max_attempts": rec.policy.max_attempts + rec.attempt_base,
        "next_attempt_at": rec.next_attempt_ms().map(|m| rfc3339(at(m))),
        "last_error": rec.last_error.as_deref().map(redacted),
        "dead_letter_reason": rec.dead_letter_reason(),
        // An operator's `retries retry-now` (or a replay) of the attempt waiting.
        "run_now": rec.run_now.as_ref().filter(|p| rec.state() == LedgerState::RetryScheduled && p.attempt == rec.attempts + 1).map(|p| json!({
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
#[cfg(any(test, feature = "cli"))]
pub fn record_text(rec: &LedgerRecord) -> String {
    let mut out = String::new();
    let state = match rec.state() {
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
    if let Some(n) = rec.next_attempt_ms() {
        out.push_str(&format!("next attempt at: {}\n", rfc3339(at(n))));
    }
    if let Some(p) = rec
        .run_now
        .as_ref()
        .filter(|p| rec.state() == LedgerState::RetryScheduled && p.attempt == rec.attempts + 1)
    {
        out.push_str(&format!(
            "run now:         attempt {} by {} at {}\n",
            p.attempt,
            p.by,
            rfc3339(at(p.at_ms))
        ));
    }
    if let Some(r) = &rec.dead_letter_reason() {
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

/// A `--due-before` / `?due_before=` that is not a time (the text as given, trimmed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a time: give RFC 3339 (2026-11-30T03:47:33Z), `now`, or a duration from now (90s, 10m, 2h, 1d)")]
pub struct NotATime(pub String);

/// `T` for `--since`/`--until`, `checkpoints rewind --to` and the console's rewind: RFC
/// 3339, `now`, or a duration before `now` (`90s`, `10m`, `2h`, `1d`).
#[cfg(any(test, feature = "cli"))]
pub(crate) fn parse_ago(text: &str, now: SystemTime) -> Result<SystemTime, String> {
    let t = text.trim();
    let when = parse_due_before(t, now).map_err(|e| e.to_string())?;
    let duration = t.starts_with(|c: char| c.is_ascii_digit())
        && t.ends_with(['s', 'm', 'h', 'd'])
        && t[..t.len() - 1].bytes().all(|b| b.is_ascii_digit());
    if duration && when > now {
        // A duration: before now, not after.
        Ok(now - when.duration_since(now).unwrap_or_default())
    } else {
        Ok(when)
    }
}

/// Parses `--due-before` / `?due_before=`: an RFC 3339 time, `now`, or a duration from
/// `now` (`90s`, `10m`, `2h`, `1d`).
pub fn parse_due_before(text: &str, now: SystemTime) -> Result<SystemTime, NotATime> {
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
        _ => Err(NotATime(t.to_string())),
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
#[cfg(any(test, feature = "cli"))]
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

/// An event parked behind the head of its ordering key's line (ordered retries), as `status
/// KEY` shows it: what it waits behind (the head's key, attempt and due time), its place in
/// the line. `None` when no parked event has the key. One listing of the parked records,
/// then the record, the line's pointer and the head's ledger record.
pub async fn parked_view(
    ledger: &Ledger,
    key: &str,
) -> Result<Option<serde_json::Value>, crate::ledger::LedgerError> {
    let all = ledger.all_parked().await?;
    let found = match all.iter().find(|p| p.key.as_deref() == Some(key)) {
        Some(entry) => ledger
            .read_parked(&entry.name)
            .await?
            .map(|parked| (entry, parked)),
        None => {
            // A key too long for the listing's tags to carry: read those records.
            let mut found = None;
            for entry in all.iter().filter(|p| p.key.is_none()) {
                if let Some(parked) = ledger.read_parked(&entry.name).await? {
                    if parked.event.identity.idempotency_key == key {
                        found = Some((entry, parked));
                        break;
                    }
                }
            }
            found
        }
    };
    let Some((entry, parked)) = found else {
        return Ok(None);
    };
    let e = &parked.event;
    let in_line: Vec<i64> = {
        let prefix = entry.name.rsplit_once('/').map_or("", |(p, _)| p);
        let mut v: Vec<i64> = all
            .iter()
            .filter(|p| p.name.rsplit_once('/').is_some_and(|(q, _)| q == prefix))
            .map(|p| p.seq)
            .collect();
        v.sort();
        v
    };
    // The ordering key is the line's: read from the pointer beside it.
    let line = ledger
        .lines(Some(&e.partition_id))
        .await?
        .into_iter()
        .find(|l| {
            ledger
                .line_name(&l.partition, &l.ordering_key)
                .rsplit('/')
                .next()
                == entry.name.rsplit('/').nth(1)
        });
    let head = match &line {
        Some(l) => ledger.record(&l.head_key).await?,
        None => None,
    };
    Ok(Some(json!({
        "key": key,
        "state": "PARKED",
        "partition": e.partition_id,
        "sequence_number": e.sequence_number,
        "ordering_key": line.as_ref().map(|l| l.ordering_key.clone()),
        "parked_at": rfc3339(at(parked.parked_ms)),
        "position": in_line.iter().position(|s| *s == e.sequence_number).map(|p| p + 1),
        "line_length": in_line.len(),
        "waits_behind": line.as_ref().map(|l| json!({
            "key": l.head_key,
            "sequence_number": l.head_seq,
            "state": head.as_ref().map(|h| h.state()),
            "next_attempt": head.as_ref().filter(|h| h.state() == LedgerState::RetryScheduled).map(|h| h.attempts + 1),
            "next_attempt_at": head.as_ref().and_then(|h| h.next_attempt_ms()).map(|m| rfc3339(at(m))),
            "last_error": head.as_ref().and_then(|h| h.last_error.as_deref()).map(redacted),
        })),
    })))
}

/// [`parked_view`] as text, for `hubguard status`.
#[cfg(any(test, feature = "cli"))]
pub fn parked_text(v: &serde_json::Value) -> String {
    let s = |k: &str| v[k].as_str().unwrap_or("").to_string();
    let mut out = String::new();
    out.push_str(&format!(
        "key:             {}
",
        s("key")
    ));
    out.push_str("state:           PARKED (ordered retries: waits behind an earlier event of its ordering key)
");
    out.push_str(&format!(
        "event:           partition {} sequence number {}
",
        s("partition"),
        v["sequence_number"]
    ));
    out.push_str(&format!(
        "ordering key:    {}
",
        s("ordering_key")
    ));
    out.push_str(&format!(
        "parked at:       {}
",
        s("parked_at")
    ));
    out.push_str(&format!(
        "place in line:   {} of {}
",
        v["position"], v["line_length"]
    ));
    let w = &v["waits_behind"];
    if w.is_object() {
        out.push_str(&format!(
            "waits behind:    {} (sequence number {}), {}",
            w["key"].as_str().unwrap_or(""),
            w["sequence_number"],
            w["state"].as_str().unwrap_or("no record yet")
        ));
        if let (Some(n), Some(t)) = (w["next_attempt"].as_u64(), w["next_attempt_at"].as_str()) {
            out.push_str(&format!(", attempt {n} at {t}"));
        }
        out.push('\n');
        if let Some(e) = w["last_error"].as_str() {
            out.push_str(&format!("head's error:    {}\n", redact(e)));
        }
    }
    out
}

/// The open lines of ordered retries, as `/v1/retries` and `retries list` show them.
pub fn line_view(l: &crate::ledger::Line) -> serde_json::Value {
    json!({
        "partition": l.partition,
        "ordering_key": l.ordering_key,
        "head": l.head_key,
        "head_sequence_number": l.head_seq,
        "parked": l.parked,
        "oldest_parked_at": l.oldest_parked_ms.map(|m| rfc3339(at(m))),
    })
}

/// Open lines as a text table, for `hubguard retries list`.
#[cfg(any(test, feature = "cli"))]
pub fn lines_text(lines: &[crate::ledger::Line]) -> String {
    if lines.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "{} line{} of parked events (ordered retries)\n{:<10} {:<24} {:<32} {:>7}  OLDEST PARKED\n",
        lines.len(),
        if lines.len() == 1 { "" } else { "s" },
        "PARTITION",
        "ORDERING KEY",
        "HEAD",
        "PARKED"
    );
    for l in lines {
        out.push_str(&format!(
            "{:<10} {:<24} {:<32} {:>7}  {}\n",
            l.partition,
            l.ordering_key,
            l.head_key,
            l.parked,
            l.oldest_parked_ms
                .map(|m| rfc3339(at(m)))
                .unwrap_or_default()
        ));
    }
    out
}

/// The `hubguard.retries.pending` and `hubguard.retries.overdue` gauges, from the ledger's
/// listing refreshed every `every` — the answer to "what
/// is waiting?" for dashboards and alerts. Every replica lists the same ledger: aggregate
/// with `max`, not `sum`. Stops when dropped.
#[cfg(any(test, feature = "cli"))]
pub struct PendingGauges {
    task: tokio::task::JoinHandle<()>,
    _pending: opentelemetry::metrics::ObservableGauge<u64>,
    _overdue: opentelemetry::metrics::ObservableGauge<u64>,
    _parked: Option<[opentelemetry::metrics::ObservableGauge<f64>; 2]>,
}

/// Parked events and when the oldest was parked (ordered retries), as last listed.
#[cfg(any(test, feature = "cli"))]
type ParkedReading = Arc<std::sync::Mutex<Option<(u64, Option<SystemTime>)>>>;

#[cfg(any(test, feature = "cli"))]
impl std::fmt::Debug for PendingGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingGauges")
    }
}

#[cfg(any(test, feature = "cli"))]
impl Drop for PendingGauges {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(any(test, feature = "cli"))]
impl PendingGauges {
    /// As `start` (the test bed's), but overdue and ages against `clock` (the pipeline's), and with
    /// `lines` (ordered retries on) the `hubguard.lines.parked` and
    /// `hubguard.lines.oldest_parked_age` gauges from a listing of the parked records at each
    /// refresh.
    pub fn start_with_lines(
        ledger: Ledger,
        every: std::time::Duration,
        lines: bool,
        clock: Arc<crate::clock::Clock>,
    ) -> Self {
        use crate::telemetry::names::metric;
        let parked_reading: ParkedReading = Default::default();
        let parked = lines.then(|| {
            let meter = crate::telemetry::meter();
            let r = parked_reading.clone();
            let count = meter
                .f64_observable_gauge(metric::LINES_PARKED)
                .with_description("Events parked behind an earlier event of their ordering key (from the ledger's listing)")
                .with_callback(move |o| {
                    if let Some((n, _)) = &*r.locked() {
                        o.observe(*n as f64, &[]);
                    }
                })
                .build();
            let r = parked_reading.clone();
            let clock = clock.clone();
            let age = meter
                .f64_observable_gauge(metric::LINES_OLDEST_PARKED_AGE)
                .with_description("Seconds the oldest parked event has waited")
                .with_unit("s")
                .with_callback(move |o| {
                    if let Some((_, oldest)) = &*r.locked() {
                        let age = oldest
                            .and_then(|t| clock.now().duration_since(t).ok())
                            .map_or(0.0, |d| d.as_secs_f64());
                        o.observe(age, &[]);
                    }
                })
                .build();
            [count, age]
        });
        let dues: Arc<std::sync::Mutex<Option<Vec<SystemTime>>>> = Default::default();
        let meter = crate::telemetry::meter();
        let d = dues.clone();
        let pending = meter
            .u64_observable_gauge(metric::RETRIES_PENDING)
            .with_description("Retries the ledger says are waiting (from its listing)")
            .with_callback(move |o| {
                if let Some(dues) = &*d.locked() {
                    o.observe(dues.len() as u64, &[]);
                }
            })
            .build();
        let d = dues.clone();
        let overdue_clock = clock.clone();
        let overdue = meter
            .u64_observable_gauge(metric::RETRIES_OVERDUE)
            .with_description("Retries waiting past their due time")
            .with_callback(move |o| {
                if let Some(dues) = &*d.locked() {
                    let now = overdue_clock.now();
                    o.observe(dues.partition_point(|due| *due < now) as u64, &[]);
                }
            })
            .build();
        let d = dues.clone();
        let pr = parked_reading.clone();
        let task = tokio::spawn(async move {
            loop {
                match ledger.pending().await {
                    Ok(p) => Self::store(&d, &p),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot list pending retries for the gauges")
                    }
                }
                if lines {
                    match ledger.all_parked().await {
                        Ok(p) => {
                            let oldest = p.iter().filter_map(|e| e.parked_ms).min().map(at);
                            *pr.locked() = Some((p.len() as u64, oldest));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot list parked events for the gauges")
                        }
                    }
                }
                tokio::time::sleep(every).await;
            }
        });
        PendingGauges {
            task,
            _pending: pending,
            _overdue: overdue,
            _parked: parked,
        }
    }

    fn store(dues: &std::sync::Mutex<Option<Vec<SystemTime>>>, pending: &[Pending]) {
        let mut v: Vec<SystemTime> = pending.iter().map(|p| p.due).collect();
        v.sort();
        *dues.locked() = Some(v);
    }
}

/// The gauges without ordered retries, on the wall clock: what the tests start.
#[cfg(any(test, feature = "testbed"))]
impl PendingGauges {
    /// Registers the gauges and starts refreshing them from `ledger` every `every` (on the
    /// current Tokio runtime). Overdue is against the wall clock.
    pub fn start(ledger: Ledger, every: std::time::Duration) -> Self {
        Self::start_with_lines(ledger, every, false, Arc::default())
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
        report_of(
            &self.health,
            self.breaker.as_ref(),
            self.rate_limit.as_ref(),
        )
    }
}

/// The JSON report `/v1/status` and `/readyz` answer (and the console's overview shows):
/// the health report, the circuit breaker and the rate limit, redacted.
pub fn report_of(
    health: &Health,
    breaker: Option<&Arc<crate::breaker::Shared>>,
    rate_limit: Option<&Arc<crate::ratelimit::limiter::Limiter>>,
) -> serde_json::Value {
    let mut r = health.report();
    if let (Some(b), Some(obj)) = (breaker, r.as_object_mut()) {
        let rec = b.cached().unwrap_or_default();
        obj.insert(
            "breaker".into(),
            json!({
                "downstream": b.downstream(),
                "state": b.state(),
                "open_until": rec.open_until_ms.map(|u| rfc3339(at(u))),
                "opened_at": rec.opened_at_ms.map(|u| rfc3339(at(u))),
                "opens": rec.opens,
                "reopens": rec.reopens,
                "trial": rec.trial,
                "new_events_at_brink": b.waiting_at_brink(),
            }),
        );
    }
    if let (Some(l), Some(obj)) = (rate_limit, r.as_object_mut()) {
        obj.insert(
            "rate_limit".into(),
            serde_json::to_value(l.snapshot()).unwrap_or_default(),
        );
    }
    // Reasons quote what dependencies answered: the one rule masks any credential.
    redact_json(&mut r);
    r
}

/// The status router of `pipeline`, as `hubguard run` serves it on `status.listen`:
/// `/healthz`, `/readyz`, `/v1/status`, `/v1/events/{key}`, `/v1/retries`, `/v1/control` and
/// `/metrics`, over the pipeline's health, ledger, circuit breaker and rate limiter.
pub fn pipeline_router(pipeline: &crate::pipeline::Pipeline) -> Router {
    router_with_rate_limit(
        pipeline.health(),
        pipeline.settler().ledger.clone(),
        pipeline.breaker(),
        pipeline.rate_limiter(),
    )
}

/// The status router (`breaker`: the pipeline's circuit breaker, shown in the report).
#[cfg(any(test, feature = "testbed"))]
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
            Json(json!({ "live": false, "reason": redacted(&reason.to_string()) })),
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
    match s.ledger.record(&key).await {
        Ok(Some(rec)) => {
            let mut v = record_view(&rec);
            crate::pipeline::control::add_retry_pause(&s.ledger, &rec, &mut v).await;
            Json(v).into_response()
        }
        Ok(None) => match parked_view(&s.ledger, &key).await {
            // Ordered retries: a parked event has no ledger record yet, only its parked one.
            Ok(Some(mut v)) => {
                redact_json(&mut v);
                Json(v).into_response()
            }
            _ => (
                StatusCode::NOT_FOUND,
                Json(s.ledger.no_record(&key, s.health.clock().now())),
            )
                .into_response(),
        },
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
            let (record, etag) =
                record.map_or((Default::default(), None), |p| (p.value, Some(p.etag)));
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
        .map(|t| parse_due_before(t, s.health.clock().now()))
    {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({ "error": e.to_string() })),
            )
                .into_response()
        }
    };
    let listed = async {
        let p = pending_retries(&s.ledger, due_before).await?;
        let lines = s.ledger.lines(None).await?;
        Ok::<_, crate::ledger::LedgerError>((p, lines))
    };
    match listed.await {
        Ok((p, lines)) => Json(json!({
            "count": p.len(),
            "due_before": due_before.map(rfc3339),
            "retries": p.iter().map(pending_view).collect::<Vec<_>>(),
            // Ordered retries: each open line, its head and how many wait behind it.
            "lines": lines.iter().map(line_view).collect::<Vec<_>>(),
            "parked": lines.iter().map(|l| l.parked).sum::<u64>(),
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
