//! The console's actions — pause and resume partitions or retries, retry now, cancel, replay
//! one dead letter or a group — through the operations the command line calls (one
//! implementation: `pipeline::control::pause_or_resume`,
//! `pipeline::control::pause_or_resume_retries`, `Settler::retry_now`, `Settler::cancel`,
//! `Settler::replay`, `Settler::replay_matching_ordered`, `pipeline::rewind::rewind`), each
//! refused without the operator
//! role or from another site, and each written to the audit trail (`audit.rs`: a record the
//! replicas share; the log carries it under the target `hubguard::audit`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::audit::AuditEntry;
use super::read::{refusal, unavailable};
use super::Console;
use crate::clock::{ms, rfc3339};
use crate::pipeline::settle::{ReplayFilter, ReplayReport, ReplayStep};
use crate::redact::redacted;
use crate::sync::LockExt;

/// Replay jobs kept (finished ones beyond this are forgotten, oldest first).
const JOBS_KEPT: usize = 50;

/// Steps a job keeps to show (the latest).
const STEPS_SHOWN: usize = 20;

/// A replay job as the page follows it.
#[derive(Debug, Clone, Serialize)]
pub struct JobState {
    /// Its number.
    pub id: u64,
    /// Who started it.
    pub by: String,
    /// A dry run.
    pub dry_run: bool,
    /// The filter (with `until`: the same filter and `until` resume it).
    pub filter: Value,
    /// Replays a second at most.
    pub per_second: f64,
    /// Replays at most (then it stops; the same filter resumes).
    pub limit: Option<usize>,
    /// Dead letters looked at, of `total` listed.
    pub done: usize,
    /// Listed.
    pub total: usize,
    /// Replayed (or would be).
    pub replayed: usize,
    /// Skipped.
    pub skipped: usize,
    /// Failed.
    pub failed: usize,
    /// The latest steps.
    pub recent: VecDeque<ReplayStep>,
    /// Finished (or stopped).
    pub finished: bool,
    /// Stopped at `limit`.
    pub bounded: bool,
    /// The counts, once finished.
    pub report: Option<ReplayReport>,
    /// What failed, if the run could not start or went wrong.
    pub error: Option<String>,
}

/// The replay jobs of this process.
#[derive(Default)]
pub(crate) struct Jobs {
    next: AtomicU64,
    jobs: std::sync::Mutex<BTreeMap<u64, (JobState, CancellationToken)>>,
}

impl Jobs {
    /// A replay job heard of one more dead letter: counted, kept among the latest, and the
    /// job stopped once it has replayed its bound.
    fn step(&self, id: u64, step: &ReplayStep, done: usize, total: usize) {
        let mut jobs = self.jobs.locked();
        let Some((j, stop)) = jobs.get_mut(&id) else {
            return;
        };
        j.done = done;
        j.total = total;
        match step {
            ReplayStep::Skipped { .. } => j.skipped += 1,
            ReplayStep::Failed { .. } => j.failed += 1,
            _ => j.replayed += 1,
        }
        j.recent.push_front(step.clone());
        j.recent.truncate(STEPS_SHOWN);
        if j.limit.is_some_and(|l| j.replayed >= l) {
            j.bounded = true;
            stop.cancel();
        }
    }

    /// A replay job ended: its counts or its error, and what the audit trail says of it
    /// (the text and the filter).
    fn finish(
        &self,
        id: u64,
        result: Result<ReplayReport, crate::pipeline::settle::SettleError>,
        dry_run: bool,
    ) -> Option<(String, Value)> {
        let mut jobs = self.jobs.locked();
        let (j, _) = jobs.get_mut(&id)?;
        j.finished = true;
        Some(match result {
            Ok(r) => {
                let text = format!(
                    "job {id}: {} {}, {} skipped, {} failed (of {} matched){}",
                    r.replayed,
                    if dry_run {
                        "would be replayed"
                    } else {
                        "replayed"
                    },
                    r.skipped,
                    r.failed,
                    r.matched,
                    if j.bounded {
                        "; stopped at the bound: the same filter resumes"
                    } else if r.interrupted {
                        "; stopped: the same filter resumes"
                    } else {
                        ""
                    }
                );
                j.report = Some(r);
                (text, j.filter.clone())
            }
            Err(e) => {
                let text = redacted(&e.to_string());
                j.error = Some(text.clone());
                (format!("job {id} failed: {text}"), j.filter.clone())
            }
        })
    }
}

/// What an action's body may say.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActBody {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    partitions: Vec<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    filter: Option<FilterBody>,
    #[serde(default)]
    rate: Option<f64>,
    #[serde(default)]
    limit: Option<usize>,
    /// A rewind's time: RFC 3339, or a duration ago (`10m`).
    #[serde(default)]
    to: Option<String>,
    /// A rewind's sequence number.
    #[serde(default)]
    sequence: Option<i64>,
    /// `pause-retries` / `resume-retries`: which retries (`{}`: every retry).
    #[serde(default)]
    retries: Option<RetryFilterBody>,
    /// `resume-retries`: every pause of retries.
    #[serde(default)]
    all: bool,
}

/// A pause's filter as the page sends it: strict, so that a misspelt criterion is refused
/// instead of read as "every retry", and a blank one is refused instead of matching nothing.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RetryFilterBody {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    event_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

impl RetryFilterBody {
    fn filter(&self) -> Result<crate::pipeline::control::RetryFilter, String> {
        for (name, v) in [
            ("key", &self.key),
            ("event_type", &self.event_type),
            ("error", &self.error),
        ] {
            if v.as_deref().is_some_and(|v| v.trim().is_empty()) {
                return Err(format!(
                    "retries.{name} is blank: leave it out to match any"
                ));
            }
        }
        Ok(crate::pipeline::control::RetryFilter {
            key: self.key.clone(),
            event_type: self.event_type.clone(),
            error: self.error.clone(),
        })
    }
}

/// A replay's filter as the page sends it (times RFC 3339).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct FilterBody {
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    event_type: Option<String>,
    #[serde(default)]
    error_contains: Option<String>,
    #[serde(default)]
    key_prefix: Option<String>,
    #[serde(default)]
    since: Option<String>,
    #[serde(default)]
    until: Option<String>,
}

fn bad(text: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({ "error": text.into() })),
    )
        .into_response()
}

fn parse_time(field: &str, t: &str) -> Result<i64, (String, Box<Response>)> {
    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .map(|t| ms(t.into()))
        .map_err(|_| {
            let text = format!("{field}: `{t}` is not an RFC 3339 time");
            (format!("refused: {text}"), Box::new(bad(text)))
        })
}

impl Console {
    fn entry(
        &self,
        who: &str,
        action: &str,
        target: Value,
        dry_run: bool,
        outcome: &str,
    ) -> AuditEntry {
        AuditEntry {
            at: rfc3339(self.0.health.clock().now()),
            who: who.to_string(),
            action: action.to_string(),
            target,
            dry_run,
            outcome: outcome.to_string(),
            replica: self.0.settings.owner.clone(),
        }
    }

    async fn audit(&self, who: &str, action: &str, target: Value, dry_run: bool, outcome: &str) {
        let entry = self.entry(who, action, target, dry_run, outcome);
        self.0.audit.record(entry).await;
    }

    /// A request refused access, audited (see [`super::audit::Audit::refused`]).
    async fn audit_refused(
        &self,
        who: &str,
        action: &str,
        target: Value,
        e: &super::auth::Refused,
    ) {
        let entry = self.entry(who, action, target, false, &format!("refused: {e}"));
        self.0.audit.refused(entry).await;
    }
}

/// `POST /console/api/act/{action}`: `pause`, `resume`, `pause-retries`, `resume-retries`,
/// `retry-now`, `cancel`, `replay`, `rewind`.
pub(crate) async fn act(
    State(c): State<Console>,
    Path(action): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let caller = match c.0.settings.access.may_act(&headers, &c.0.csrf) {
        Ok(caller) => caller,
        Err(e) => {
            let who =
                c.0.settings
                    .access
                    .caller(&headers)
                    .map_or("unknown".to_string(), |c| c.who);
            c.audit_refused(&who, &action, Value::Null, &e).await;
            return refusal(&e);
        }
    };
    let body: ActBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return bad(format!("the action's body: {e}")),
    };
    let who = caller.who.as_str();
    let (target, dry_run) = (action_target(&body), body.dry_run);
    let result = match action.as_str() {
        "pause" | "resume" => pause(&c, action == "pause", who, &body).await,
        "pause-retries" | "resume-retries" => {
            pause_retries(&c, action == "pause-retries", who, &body).await
        }
        "retry-now" | "cancel" => on_retry(&c, &action, who, &body).await,
        "replay" => replay(&c, who, body).await,
        "rewind" => rewind(&c, who, body).await,
        _ => {
            return (
                StatusCode::NOT_FOUND,
                Json(json!({ "error": format!("no action {action}") })),
            )
                .into_response()
        }
    };
    match result {
        Ok((outcome, v)) => {
            c.audit(who, &action, target, dry_run, &outcome).await;
            Json(v).into_response()
        }
        Err((outcome, response)) => {
            c.audit(who, &action, target, dry_run, &outcome).await;
            *response
        }
    }
}

type Acted = Result<(String, Value), (String, Box<Response>)>;

fn action_target(b: &ActBody) -> Value {
    if let Some(f) = &b.retries {
        return json!({ "retries": f, "reason": b.reason });
    }
    if b.all {
        return json!({ "retries": "all" });
    }
    if let Some(k) = &b.key {
        return json!({ "key": k });
    }
    if let Some(f) = &b.filter {
        return json!({ "filter": f, "rate": b.rate, "limit": b.limit });
    }
    if b.to.is_some() || b.sequence.is_some() {
        return json!({ "partitions": b.partitions, "to": b.to, "sequence": b.sequence });
    }
    json!({ "partitions": b.partitions, "reason": b.reason })
}

/// A rewind through the command line's code ([`super::rewind`]).
async fn rewind(c: &Console, who: &str, b: ActBody) -> Acted {
    let Some(parts) = c.0.settings.rewind.as_ref() else {
        let text = "this console cannot rewind (it was started without the hub's parts)";
        return Err((format!("refused: {text}"), Box::new(bad(text))));
    };
    let to = match super::rewind::target(b.to.as_deref(), b.sequence, c.0.health.clock().now()) {
        Ok(t) => t,
        Err(text) => return Err((format!("refused: {text}"), Box::new(bad(text)))),
    };
    let records = c.0.ledger.store().clone();
    match super::rewind::run(parts, records, to, b.partitions, who, b.dry_run).await {
        Ok(done) => Ok(done),
        // A partition the hub does not have, a sequence number beyond the last event.
        Err(e) => {
            let text = redacted(&e.to_string());
            Err((format!("failed: {text}"), Box::new(bad(text))))
        }
    }
}

fn failed(e: impl std::fmt::Display) -> (String, Box<Response>) {
    (
        format!("failed: {}", redacted(&e.to_string())),
        Box::new(unavailable(e)),
    )
}

async fn pause(c: &Console, pause: bool, who: &str, b: &ActBody) -> Acted {
    use crate::pipeline::control::{pause_or_resume, ControlError, Pause};
    let entry = Pause {
        by: who.to_string(),
        since_ms: ms(c.0.health.clock().now()),
        reason: b.reason.clone().filter(|r| !r.trim().is_empty()),
    };
    let store = c.0.ledger.store().clone();
    let name = c.0.ledger.control_record_name();
    match pause_or_resume(
        store.as_ref(),
        &name,
        pause,
        &b.partitions,
        entry,
        b.dry_run,
    )
    .await
    {
        Ok(r) => {
            let outcome = match (r.changed, b.dry_run) {
                (false, _) => "nothing to change",
                (true, true) => "would change",
                (true, false) => "changed; every replica follows within seconds",
            };
            let v = json!({ "outcome": outcome, "control": r.record });
            Ok((outcome.to_string(), v))
        }
        Err(e @ ControlError::AllPaused(_)) => {
            let text = e.to_string();
            Err((format!("refused: {text}"), Box::new(bad(text))))
        }
        Err(e) => Err(failed(e)),
    }
}

/// Pauses retries matching `b.retries`, or resumes the pause with exactly that filter (or
/// every pause, with `all`), through `retries pause|resume`'s one implementation.
async fn pause_retries(c: &Console, pause: bool, who: &str, b: &ActBody) -> Acted {
    use crate::pipeline::control::{pause_or_resume_retries, Pause, Resume};
    let refused = |text: &str| Err((format!("refused: {text}"), Box::new(bad(text))));
    let filter = match b.retries.as_ref().map(RetryFilterBody::filter).transpose() {
        Ok(f) => f,
        Err(text) => return refused(&text),
    };
    let (pausing, resume) = match (pause, &filter, b.all) {
        (true, Some(f), false) => {
            let entry = Pause {
                by: who.to_string(),
                since_ms: ms(c.0.health.clock().now()),
                reason: b.reason.clone().filter(|r| !r.trim().is_empty()),
            };
            (Some((f.clone(), entry)), None)
        }
        (false, Some(f), false) => (None, Some(Resume::Filter(f.clone()))),
        (false, None, true) => (None, Some(Resume::Everything)),
        (true, _, _) => return refused("give `retries`: the filter of the retries to pause"),
        _ => return refused("give `retries` (the pause's filter) or `all: true`, not both"),
    };
    let store = c.0.ledger.store().clone();
    let name = c.0.ledger.control_record_name();
    match pause_or_resume_retries(store.as_ref(), &name, pausing, resume, b.dry_run).await {
        Ok(r) => {
            let outcome = match (r.changed, b.dry_run) {
                (false, _) => "nothing to change",
                (true, true) => "would change",
                (true, false) => "changed; every replica follows within seconds",
            };
            let v = json!({ "outcome": outcome, "control": r.record });
            Ok((outcome.to_string(), v))
        }
        Err(e) => Err(failed(e)),
    }
}

async fn on_retry(c: &Console, action: &str, who: &str, b: &ActBody) -> Acted {
    let Some(key) = b.key.as_deref() else {
        return Err(("refused: no key".into(), Box::new(bad("give the key"))));
    };
    let s = &c.0.settler;
    let outcome = if action == "retry-now" {
        s.retry_now(key, who, b.dry_run).await
    } else {
        let Some(reason) = b.reason.as_deref().filter(|r| !r.trim().is_empty()) else {
            return Err((
                "refused: no reason".into(),
                Box::new(bad("say why it is cancelled")),
            ));
        };
        s.cancel(key, reason, who, b.dry_run).await
    };
    match outcome {
        Ok(o) => {
            let v = serde_json::to_value(&o).unwrap_or_default();
            let text = v["result"].as_str().unwrap_or("done").to_string();
            Ok((text, json!({ "outcome": v })))
        }
        Err(e) => Err(failed(e)),
    }
}

async fn replay(c: &Console, who: &str, b: ActBody) -> Acted {
    if let Some(key) = b.key.as_deref() {
        let s = &c.0.settler;
        if b.dry_run {
            let text = match s.ledger.record(key).await {
                Ok(Some(r)) if r.state() == crate::ledger::State::DeadLettered => {
                    "would be replayed"
                }
                Ok(Some(_)) => "not dead-lettered; nothing to replay",
                Ok(None) => "the ledger has no record of this key",
                Err(e) => return Err(failed(e)),
            };
            return Ok((text.into(), json!({ "outcome": text })));
        }
        return match s.replay(key).await {
            Ok(Some(n)) => {
                let text = format!("attempt {n} scheduled now");
                Ok((text.clone(), json!({ "outcome": text })))
            }
            Ok(None) => {
                let text = "not dead-lettered; nothing to replay";
                Ok((text.into(), json!({ "outcome": text })))
            }
            Err(e) => Err(failed(e)),
        };
    }
    let Some(f) = b.filter.clone() else {
        return Err((
            "refused: no key or filter".into(),
            Box::new(bad("give a key or a filter")),
        ));
    };
    let per_second = b.rate.unwrap_or(10.0);
    if !(per_second > 0.0 && per_second.is_finite()) {
        return Err((
            "refused: bad rate".into(),
            Box::new(bad("rate: a positive number of replays a second")),
        ));
    }
    let now = ms(c.0.health.clock().now());
    let until_ms = match f.until.as_deref() {
        Some(t) => parse_time("until", t)?,
        None => now,
    };
    let since_ms = match f.since.as_deref() {
        Some(t) => Some(parse_time("since", t)?),
        None => None,
    };
    let filter = ReplayFilter {
        event_type: f.event_type.clone(),
        reason: f.reason.clone(),
        error_contains: f.error_contains.clone().filter(|e| !e.is_empty()),
        since_ms,
        until_ms,
        key_prefix: f.key_prefix.clone().filter(|p| !p.is_empty()),
        status: f.status.clone(),
    };
    let mut shown = serde_json::to_value(&f).unwrap_or_default();
    shown["until"] = rfc3339(crate::clock::at(until_ms)).into();
    let id = start_job(c, who, filter, shown, per_second, b.limit, b.dry_run);
    let text = format!("job {id} started");
    Ok((text, json!({ "job": id })))
}

/// Starts a replay job on the runtime; its state is read with `GET /console/api/jobs/{id}`.
fn start_job(
    c: &Console,
    who: &str,
    filter: ReplayFilter,
    shown: Value,
    per_second: f64,
    limit: Option<usize>,
    dry_run: bool,
) -> u64 {
    let id = c.0.jobs.next.fetch_add(1, Ordering::Relaxed) + 1;
    let stop = CancellationToken::new();
    let state = JobState {
        id,
        by: who.to_string(),
        dry_run,
        filter: shown,
        per_second,
        limit,
        done: 0,
        total: 0,
        replayed: 0,
        skipped: 0,
        failed: 0,
        recent: VecDeque::new(),
        finished: false,
        bounded: false,
        report: None,
        error: None,
    };
    {
        let mut jobs = c.0.jobs.jobs.locked();
        jobs.insert(id, (state, stop.clone()));
        while jobs.len() > JOBS_KEPT {
            let Some(oldest) = jobs.iter().find(|(_, (j, _))| j.finished).map(|(k, _)| *k) else {
                break;
            };
            jobs.remove(&oldest);
        }
    }
    let c = c.clone();
    let who = who.to_string();
    tokio::spawn(async move {
        let ordering = c.0.settings.ordering.clone();
        let run = c.0.settler.replay_matching_ordered(
            &filter,
            per_second,
            dry_run,
            ordering.as_ref(),
            &stop,
            |step, done, total| c.0.jobs.step(id, step, done, total),
        );
        let result = run.await;
        if let Some((text, filter)) = c.0.jobs.finish(id, result, dry_run) {
            c.audit(&who, "replay-job", filter, dry_run, &text).await;
        }
    });
    id
}

/// `GET /console/api/jobs/{id}`: a replay job's progress.
pub(crate) async fn job(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> Response {
    if let Err(r) = c.reader(&headers) {
        return *r;
    }
    match c.0.jobs.jobs.locked().get(&id) {
        Some((j, _)) => Json(serde_json::to_value(j).unwrap_or_default()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": format!("no job {id}") })),
        )
            .into_response(),
    }
}

/// `POST /console/api/jobs/{id}/stop`: stops a replay job between two replays.
pub(crate) async fn stop_job(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> Response {
    let caller = match c.0.settings.access.may_act(&headers, &c.0.csrf) {
        Ok(caller) => caller,
        Err(e) => {
            c.audit_refused("unknown", "stop-job", json!({ "job": id }), &e)
                .await;
            return refusal(&e);
        }
    };
    let found = c.0.jobs.jobs.locked().get(&id).map(|(_, s)| s.clone());
    let outcome = match found {
        Some(stop) => {
            stop.cancel();
            "stopping"
        }
        None => "no such job",
    };
    c.audit(
        &caller.who,
        "stop-job",
        json!({ "job": id }),
        false,
        outcome,
    )
    .await;
    Json(json!({ "outcome": outcome })).into_response()
}
