//! What the console's page reads: a key's story, the retries waiting, the dead letters
//! grouped by cause, and the overview (partitions, breaker, rate limit, readiness). Each
//! answer comes from an index hubguard keeps (the pending index as last listed, kept in
//! memory: `ledger::listing`; one listing of the dead-letter index) or from one record: no
//! answer lists every record.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::{Caller, Refused, Role};
use super::Console;
use crate::clock::{at, ms, rfc3339};
use crate::ledger::{LedgerRecord, Pending, PendingPage, State as LedgerState};
use crate::redact::{redact_json, redacted};
use crate::sync::LockExt;

/// Dead letters read concurrently when grouping.
const READS_AT_ONCE: usize = 32;

/// Retries returned at most per answer (the count says how many matched).
const MAX_ROWS: usize = 1_000;

/// A refusal as the page sees it: 401 without a credential, 403 without the role.
pub(crate) fn refusal(e: &Refused) -> Response {
    let code = match e {
        Refused::Unauthenticated => StatusCode::UNAUTHORIZED,
        _ => StatusCode::FORBIDDEN,
    };
    (code, Json(json!({ "error": e.to_string() }))).into_response()
}

/// A dependency failed: 503 with what it said (redacted).
pub(crate) fn unavailable(e: impl std::fmt::Display) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "error": redacted(&e.to_string()) })),
    )
        .into_response()
}

impl Console {
    /// The caller, who must at least read.
    pub(crate) fn reader(&self, headers: &HeaderMap) -> Result<Caller, Box<Response>> {
        self.0
            .settings
            .access
            .caller(headers)
            .map_err(|e| Box::new(refusal(&e)))
    }

    fn now(&self) -> SystemTime {
        self.0.health.clock().now()
    }
}

/// `GET /console/api/session`: who the caller is, whether they may act, and (for an
/// operator) the anti-forgery token the page sends with every action.
pub(crate) async fn session(State(c): State<Console>, headers: HeaderMap) -> Response {
    let caller = match c.reader(&headers) {
        Ok(caller) => caller,
        Err(r) => return *r,
    };
    let operator = caller.role == Role::Operator;
    Json(json!({
        "who": caller.who,
        "role": caller.role,
        "can_act": operator,
        "anyone_can_act": c.0.settings.access.can_anyone_act(),
        "csrf": operator.then(|| c.0.csrf.token(&caller.who)),
        "trace_links": c.0.settings.trace_url.is_some(),
        "owner": c.0.settings.owner,
        "now": rfc3339(c.now()),
    }))
    .into_response()
}

#[derive(Deserialize)]
pub(crate) struct LookupQuery {
    q: String,
}

/// What a lookup found.
enum Found {
    Record(Box<LedgerRecord>),
    Parked(Value),
    Candidates(Vec<String>),
    Nothing,
}

/// `GET /console/api/lookup?q=`: an idempotency key, a CloudEvents id (a key is
/// `{source}|{id}`) or a correlation id → the event's story.
pub(crate) async fn lookup(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(q): Query<LookupQuery>,
) -> Response {
    if let Err(r) = c.reader(&headers) {
        return *r;
    }
    let q = q.q.trim();
    if q.is_empty() {
        let e = json!({ "error": "give a key, a CloudEvents id or a correlation id" });
        return (StatusCode::BAD_REQUEST, Json(e)).into_response();
    }
    match find(&c, q).await {
        Ok(Found::Record(rec)) => {
            let mut v = story(&c, &rec);
            // An operator's pause of retries (`hubguard retries pause`) that holds it: by whom.
            crate::pipeline::control::add_retry_pause(&c.0.ledger, &rec, &mut v).await;
            if let (Some(what), Some(why)) = (
                v["paused"]["what"].as_str().map(str::to_string),
                v["paused"]["reason_text"].as_str().map(str::to_string),
            ) {
                let line = format!("an operator paused {what}: {why} — its next attempt waits, uncounted, until `hubguard retries resume`");
                if let Some(w) = v["waiting_because"].as_array_mut() {
                    w.insert(0, line.into());
                }
            }
            Json(v).into_response()
        }
        Ok(Found::Parked(mut v)) => {
            redact_json(&mut v);
            v["now"] = rfc3339(c.now()).into();
            Json(v).into_response()
        }
        Ok(Found::Candidates(keys)) => Json(json!({
            "query": q,
            "state": "AMBIGUOUS",
            "candidates": keys,
        }))
        .into_response(),
        Ok(Found::Nothing) => (
            StatusCode::NOT_FOUND,
            Json(c.0.ledger.no_record(q, c.now())),
        )
            .into_response(),
        Err(e) => unavailable(e),
    }
}

/// The key itself; else a parked event; else, from the pending and dead-letter indexes'
/// listings, keys ending in `|{q}` (a CloudEvents id with its source) or waiting events
/// whose correlation id is `q`; else dead letters whose correlation id is `q`.
async fn find(c: &Console, q: &str) -> Result<Found, crate::ledger::LedgerError> {
    let ledger = &c.0.ledger;
    if let Some(rec) = ledger.record(q).await? {
        return Ok(Found::Record(Box::new(rec)));
    }
    if let Some(v) = crate::status::parked_view(ledger, q).await? {
        return Ok(Found::Parked(v));
    }
    let suffix = format!("|{q}");
    let waiting = |p: &Pending| p.key.ends_with(&suffix) || p.correlation_id.as_deref() == Some(q);
    let mut page = pending_page(c, waiting, MAX_ROWS).await?;
    if page.matched == 0 && page.age >= FRESH {
        // Not in a listing of a while ago: perhaps waiting since (another replica's).
        ledger.refresh_pending(FRESH).await?;
        page = pending_page(c, waiting, MAX_ROWS).await?;
    }
    let mut keys: Vec<String> = page.soonest.into_iter().map(|p| p.key).collect();
    keys.extend(
        ledger
            .dead_letter_entries()
            .await?
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| k.ends_with(&suffix)),
    );
    if keys.is_empty() {
        // The correlation id of a dead letter: from the dead letters' summaries (each read
        // once, then kept while its index entry stands, as the groups page keeps them).
        let (dead, _) = dead_summaries(c).await?;
        keys.extend(
            dead.into_iter()
                .filter(|(_, s)| s.correlation_id.as_deref() == Some(q))
                .map(|(k, _)| k),
        );
    }
    keys.sort();
    keys.dedup();
    Ok(match keys.as_slice() {
        [] => Found::Nothing,
        [one] => match ledger.record(one).await? {
            Some(rec) => Found::Record(Box::new(rec)),
            None => Found::Nothing,
        },
        _ => Found::Candidates(keys),
    })
}

/// A record as the key page shows it: the status API's view, the rest of the schedule,
/// why it waits, and a trace link per attempt.
fn story(c: &Console, rec: &LedgerRecord) -> Value {
    let now = c.now();
    let mut v = crate::status::record_view(rec);
    if let Some(p) = super::schedule::project(rec) {
        v["schedule"] = json!({
            "jitter": p.jitter,
            "truncated": p.truncated,
            "steps": p.steps.iter().map(|s| json!({
                "attempt": s.attempt,
                "earliest": rfc3339(at(s.earliest_ms)),
                "latest": rfc3339(at(s.latest_ms)),
            })).collect::<Vec<_>>(),
            "gives_up": p.gives_up.map(|g| json!({
                "after_attempt": g.after_attempt,
                "earliest": rfc3339(at(g.earliest_ms)),
                "latest": rfc3339(at(g.latest_ms)),
                "reason": crate::pipeline::settle::reason_name(&g.reason),
            })),
        });
    }
    let report = c.report();
    v["waiting_because"] = waiting_reasons(rec, &report, now).into();
    if let Some(t) = &c.0.settings.trace_url {
        for h in v["history"].as_array_mut().into_iter().flatten() {
            if let Some(id) = h["trace_id"].as_str() {
                h["trace_url"] = trace_link(t, id, rec).into();
            }
        }
    }
    v["now"] = rfc3339(now).into();
    redact_json(&mut v);
    v
}

/// `template` with `{trace_id}`, `{key}` and `{correlation_id}` replaced, percent-encoded.
pub fn trace_link(template: &str, trace_id: &str, rec: &LedgerRecord) -> String {
    use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
    let enc = |s: &str| utf8_percent_encode(s, NON_ALPHANUMERIC).to_string();
    template
        .replace("{trace_id}", &enc(trace_id))
        .replace("{key}", &enc(&rec.key))
        .replace("{correlation_id}", &enc(&rec.correlation_id))
}

/// Why a waiting event waits, in words: its own schedule (or an operator's pull), past
/// due with the retry loop's state, an open breaker, the rate limit, a hold.
pub fn waiting_reasons(rec: &LedgerRecord, report: &Value, now: SystemTime) -> Vec<String> {
    let mut out = Vec::new();
    if rec.state() != LedgerState::RetryScheduled {
        return out;
    }
    let next = rec.attempts + 1;
    let due = rec.next_attempt_ms();
    let when = |m: Option<i64>| m.map_or("now".to_string(), |m| rfc3339(at(m)));
    match rec.run_now.as_ref().filter(|p| p.attempt == next) {
        Some(p) => out.push(format!(
            "pulled forward by {} at {} (it was due {}): attempt {next} runs now",
            p.by,
            rfc3339(at(p.at_ms)),
            when(p.previous_due_ms)
        )),
        None => out.push(format!(
            "its own schedule: attempt {next} of {} ({} policy) is due at {}",
            rec.policy.max_attempts + rec.attempt_base,
            rec.policy.name,
            when(due)
        )),
    }
    if due.is_some_and(|d| d < ms(now)) {
        let state = report["retry_loop"]["state"]
            .as_str()
            .or(report["retry_loop"].as_str())
            .unwrap_or("unknown");
        out.push(format!(
            "past its due time: the retry loop ({state}) runs it when its message arrives, or its overdue sweep sends it again"
        ));
    }
    let b = &report["breaker"];
    if matches!(b["state"].as_str(), Some("open" | "half_open")) {
        out.push(format!(
            "the circuit breaker for {} is {} until {}: a retry due before then waits until after it, without counting an attempt",
            b["downstream"].as_str().unwrap_or("the downstream"),
            b["state"].as_str().unwrap_or(""),
            b["open_until"].as_str().unwrap_or("its expiry")
        ));
    }
    let r = &report["rate_limit"];
    if let (Some(rate), Some(limit)) = (r["rate_per_s"].as_f64(), r["limit_per_s"].as_f64()) {
        if rate < limit {
            out.push(format!(
                "the rate limit paces calls to {}: {rate:.1}/s now of {limit:.1}/s{}",
                r["downstream"].as_str().unwrap_or("the downstream"),
                r["last_decrease_reason"]
                    .as_str()
                    .map(|why| format!(" (slowed: {why})"))
                    .unwrap_or_default()
            ));
        }
    }
    if let Some(h) = report["held_retries"].get(&rec.key) {
        out.push(format!(
            "held since {}: {}",
            h["since"].as_str().unwrap_or(""),
            h["reason"].as_str().unwrap_or("")
        ));
    }
    out
}

#[derive(Deserialize)]
pub(crate) struct RetriesQuery {
    #[serde(default)]
    event_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
    /// Due before: RFC 3339, `now`, or a duration from now (`10m`).
    #[serde(default)]
    due_before: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
}

/// `GET /console/api/retries`: retries waiting, soonest first, from one listing of the
/// pending index; filtered by event type, error text and due window.
pub(crate) async fn retries(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(q): Query<RetriesQuery>,
) -> Response {
    if let Err(r) = c.reader(&headers) {
        return *r;
    }
    let blank = |o: Option<String>| o.filter(|s| !s.trim().is_empty());
    let due_before = match blank(q.due_before)
        .map(|t| crate::status::parse_due_before(&t, c.now()))
        .transpose()
    {
        Ok(t) => t,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({ "error": e.to_string() })),
            )
                .into_response()
        }
    };
    let (event_type, error) = (blank(q.event_type), blank(q.error));
    let limit = q.limit.unwrap_or(200).min(MAX_ROWS);
    let keep = |p: &Pending| {
        due_before.is_none_or(|t| p.due < t)
            && event_type
                .as_deref()
                .is_none_or(|t| p.event_type.as_deref() == Some(t))
            && error
                .as_deref()
                .is_none_or(|e| p.last_error.as_deref().is_some_and(|l| l.contains(e)))
    };
    let page = match pending_page(&c, keep, limit).await {
        Ok(p) => p,
        Err(e) => return unavailable(e),
    };
    // The operators' pauses of retries (`hubguard retries pause`): listed, and named on
    // each row they hold. A control record that cannot be read is said, never taken as
    // "nothing paused".
    let name = c.0.ledger.control_record_name();
    let control = crate::pipeline::control::read(c.0.ledger.store().as_ref(), &name).await;
    let pauses = match &control {
        Ok(r) => r.as_ref().map(|p| p.value.clone()).unwrap_or_default(),
        Err(_) => Default::default(),
    };
    let now = ms(c.now());
    let rows: Vec<Value> = page
        .soonest
        .iter()
        .map(|p| {
            let mut v = crate::status::pending_view(p);
            v["event_type"] = p.event_type.clone().into();
            v["partition"] = p.partition.clone().into();
            v["overdue"] = (ms(p.due) < now).into();
            if let Some(held) =
                pauses.retry_pause(&p.key, p.event_type.as_deref(), p.last_error.as_deref())
            {
                v["paused"] = retry_pause_view(held);
            }
            v
        })
        .collect();
    let listed_at = c
        .now()
        .checked_sub(page.age)
        .unwrap_or(std::time::UNIX_EPOCH);
    let mut v = json!({
        "waiting": page.waiting,
        "matched": page.matched,
        "shown": rows.len(),
        "retries": rows,
        "listed_at": rfc3339(listed_at),
        "listed_ago_ms": page.age.as_millis() as u64,
        "now": rfc3339(c.now()),
        "pauses": pauses.retries.iter().map(retry_pause_view).collect::<Vec<_>>(),
    });
    if let Err(e) = control {
        v["pauses_unknown"] = redacted(&e.to_string()).into();
    }
    redact_json(&mut v);
    Json(v).into_response()
}

/// An operator's pause of retries as the page shows it: its filter, what it holds in
/// words, who, since when, why.
fn retry_pause_view(p: &crate::pipeline::control::RetryPause) -> Value {
    let mut v = serde_json::to_value(p).unwrap_or_default();
    v["what"] = p.filter.to_string().into();
    v["since"] = rfc3339(at(p.pause.since_ms)).into();
    v
}

/// A listing younger than this answers a page as it is.
pub(crate) const FRESH: Duration = Duration::from_secs(5);

/// A listing younger than this answers a page at once while a newer one is asked for in the
/// background; an older one (or none) is replaced before the page answers. Every replica's
/// overdue sweep lists the pending index every `dead_letter_sweep` (60 s by default), so a
/// running replica always has one younger than this.
pub(crate) const STALE_OK: Duration = Duration::from_secs(120);

/// What a page does with the kept listing of the pending index, by its age.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UseListing {
    /// Answer from it.
    Answer,
    /// Answer from it, and ask for a newer one in the background.
    AnswerAndRefresh,
    /// List first, then answer.
    ListFirst,
}

/// The choice for a kept listing of `age` (`None`: none kept yet). Pure.
pub(crate) fn use_listing(age: Option<Duration>) -> UseListing {
    match age {
        Some(a) if a < FRESH => UseListing::Answer,
        Some(a) if a < STALE_OK => UseListing::AnswerAndRefresh,
        _ => UseListing::ListFirst,
    }
}

/// One page of the retries waiting, from the pending index's kept listing (see
/// `ledger::listing`): from memory while the listing is young enough, else after one
/// listing shared with every other page asking at once.
pub(crate) async fn pending_page(
    c: &Console,
    keep: impl Fn(&Pending) -> bool,
    limit: usize,
) -> Result<PendingPage, crate::ledger::LedgerError> {
    let ledger = &c.0.ledger;
    let page = ledger.pending_page(&keep, limit);
    match (use_listing(page.as_ref().map(|p| p.age)), page) {
        (UseListing::Answer, Some(p)) => Ok(p),
        (UseListing::AnswerAndRefresh, Some(p)) => {
            ledger.refresh_pending_soon(FRESH);
            Ok(p)
        }
        _ => {
            ledger.refresh_pending(FRESH).await?;
            ledger.pending_page(&keep, limit).ok_or_else(|| {
                crate::ledger::LedgerError::Store(crate::azure::StoreError::Unavailable(
                    "the pending index's listing is not kept".into(),
                ))
            })
        }
    }
}

/// What grouping needs of one dead letter.
#[derive(Debug, Clone)]
pub(crate) struct DeadSummary {
    /// The event's correlation id, when it differs from its key.
    correlation_id: Option<String>,
    reason: String,
    status: String,
    event_type: String,
    updated_ms: i64,
    error: Option<String>,
}

/// Dead letters read before, by key: (the index entry's ETag, what was read). A key
/// replayed and dead-lettered again has a new entry, so a new ETag, and is read again.
pub(crate) type DeadCache = std::sync::Mutex<HashMap<String, (String, DeadSummary)>>;

fn summary(rec: &LedgerRecord) -> DeadSummary {
    DeadSummary {
        correlation_id: (rec.correlation_id != rec.key).then(|| rec.correlation_id.clone()),
        reason: rec
            .dead_letter_reason()
            .map(|r| crate::pipeline::settle::reason_name(&r))
            .unwrap_or_else(|| "unknown".into()),
        status: crate::pipeline::settle::status_class(rec.last_error.as_deref()),
        event_type: rec.event_type.clone().unwrap_or_default(),
        updated_ms: rec.updated_ms,
        error: rec
            .last_error
            .as_deref()
            .map(|e| redacted(e).chars().take(300).collect()),
    }
}

/// `GET /console/api/dead-letters`: the dead letters grouped by cause (reason × status ×
/// event type), with counts, first and last seen, the latest error and keys. One listing
/// of the dead-letter index; records not read before are read, 32 at a time.
pub(crate) async fn dead_letters(State(c): State<Console>, headers: HeaderMap) -> Response {
    if let Err(r) = c.reader(&headers) {
        return *r;
    }
    let (summaries, unreadable) = match dead_summaries(&c).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let mut v = json!({
        "dead_letters": summaries.len(),
        "unreadable": unreadable,
        "groups": groups(summaries),
        "now": rfc3339(c.now()),
    });
    redact_json(&mut v);
    Json(v).into_response()
}

/// Every dead letter's summary, by key, and how many could not be read: one listing of the
/// dead-letter index; records not read before (or dead-lettered again since) are read, 32
/// at a time, and kept while their index entry stands.
async fn dead_summaries(
    c: &Console,
) -> Result<(Vec<(String, DeadSummary)>, usize), crate::ledger::LedgerError> {
    let entries = c.0.ledger.dead_letter_entries().await?;
    let missing: Vec<(String, String)> = {
        let cache = c.0.dead_cache.locked();
        entries
            .iter()
            .filter(|(k, etag)| cache.get(k).is_none_or(|(e, _)| e != etag))
            .cloned()
            .collect()
    };
    let ledger = c.0.ledger.clone();
    let read: Vec<_> = futures::stream::iter(missing)
        .map(|(key, etag)| {
            let ledger = ledger.clone();
            async move {
                let rec = ledger.record(&key).await;
                (key, etag, rec)
            }
        })
        .buffer_unordered(READS_AT_ONCE)
        .collect()
        .await;
    let mut unreadable = 0usize;
    let mut cache = c.0.dead_cache.locked();
    for (key, etag, rec) in read {
        match rec {
            Ok(Some(rec)) if rec.state() == LedgerState::DeadLettered => {
                cache.insert(key, (etag, summary(&rec)));
            }
            // Replayed since it was listed, or gone: not a dead letter now.
            Ok(_) => {}
            Err(_) => unreadable += 1,
        }
    }
    let listed: std::collections::HashSet<&String> = entries.iter().map(|(k, _)| k).collect();
    cache.retain(|k, _| listed.contains(k));
    let summaries = cache
        .iter()
        .map(|(k, (_, s))| (k.clone(), s.clone()))
        .collect();
    Ok((summaries, unreadable))
}

/// Keys shown per group (the latest).
const KEYS_PER_GROUP: usize = 20;

fn groups(summaries: Vec<(String, DeadSummary)>) -> Vec<Value> {
    let mut by: BTreeMap<(String, String, String), Vec<(String, DeadSummary)>> = BTreeMap::new();
    for (k, s) in summaries {
        by.entry((s.reason.clone(), s.status.clone(), s.event_type.clone()))
            .or_default()
            .push((k, s));
    }
    let mut out: Vec<(usize, Value)> = by
        .into_iter()
        .map(|((reason, status, event_type), mut items)| {
            items.sort_by(|a, b| b.1.updated_ms.cmp(&a.1.updated_ms).then(a.0.cmp(&b.0)));
            let first = items.iter().map(|i| i.1.updated_ms).min().unwrap_or(0);
            let last = items.first().map_or(0, |i| i.1.updated_ms);
            let n = items.len();
            (
                n,
                json!({
                    "reason": reason,
                    "status": status,
                    "event_type": event_type,
                    "count": n,
                    "first_seen": rfc3339(at(first)),
                    "last_seen": rfc3339(at(last)),
                    "latest_error": items.first().and_then(|i| i.1.error.clone()),
                    "keys": items.iter().take(KEYS_PER_GROUP).map(|i| i.0.clone()).collect::<Vec<_>>(),
                    "correlation_ids": items.iter().take(KEYS_PER_GROUP).map(|i| i.1.correlation_id.clone()).collect::<Vec<_>>(),
                }),
            )
        })
        .collect();
    out.sort_by_key(|a| std::cmp::Reverse(a.0));
    out.into_iter().map(|(_, v)| v).collect()
}

/// `GET /console/api/overview`: the status report (readiness reasons, partitions owned,
/// held and their lag, the breaker, the rate limit, the retry loop) and the operator's
/// control record (who paused what).
pub(crate) async fn overview(State(c): State<Console>, headers: HeaderMap) -> Response {
    if let Err(r) = c.reader(&headers) {
        return *r;
    }
    let name = c.0.ledger.control_record_name();
    let control = match crate::pipeline::control::current(c.0.ledger.store().as_ref(), &name).await
    {
        Ok(p) => serde_json::to_value(p).unwrap_or_default(),
        Err(e) => json!({ "error": redacted(&e.to_string()) }),
    };
    let mut v = json!({
        "report": c.report(),
        "control": control,
        "owner": c.0.settings.owner,
        "now": rfc3339(c.now()),
    });
    redact_json(&mut v);
    Json(v).into_response()
}

impl Console {
    /// The status report (as `/v1/status` answers).
    pub(crate) fn report(&self) -> Value {
        crate::status::report_of(
            &self.0.health,
            self.0.breaker.as_ref(),
            self.0.rate_limit.as_ref(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_answers_from_a_young_listing_refreshes_an_older_one_and_lists_past_its_bound() {
        let s = Duration::from_secs;
        assert_eq!(use_listing(None), UseListing::ListFirst);
        assert_eq!(use_listing(Some(Duration::ZERO)), UseListing::Answer);
        assert_eq!(
            use_listing(Some(FRESH - Duration::from_millis(1))),
            UseListing::Answer
        );
        assert_eq!(use_listing(Some(FRESH)), UseListing::AnswerAndRefresh);
        // The overdue sweep lists every 60 s by default: its listing is never past the bound.
        assert_eq!(use_listing(Some(s(61))), UseListing::AnswerAndRefresh);
        assert_eq!(use_listing(Some(STALE_OK)), UseListing::ListFirst);
        assert_eq!(use_listing(Some(Duration::MAX)), UseListing::ListFirst);
    }
}
