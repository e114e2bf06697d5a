//! The console's JSON API over HTTP against a running pipeline on the emulators: a key's
//! story (schedule, why it waits, trace links), the retries and dead-letter groups, and
//! actions refused without the operator role, from another origin or without the page's
//! token, and audited either way.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hubguard::console::rewind::RewindParts;
use hubguard::console::{Access, Console, Secret, Settings};
use hubguard::event::Event;
use hubguard::handler::{Attempt, Failure, Handler, Outcome};
use hubguard::ledger::State;
use hubguard::pipeline::Pipeline;
use hubguard::policy::{Curve, RetryPolicy};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::pipeline_support::*;

pub(crate) const LIMIT: Duration = Duration::from_secs(60);
pub(crate) const OPERATOR_TOKEN: &str = "console-operator-token-1";
pub(crate) const TRACE: &str = "http://tempo.example/trace/{trace_id}";

/// The scripted handler, and permanent failures of `d-…` keys while `refuse` is set (a
/// downstream that refused them, then was fixed).
#[derive(Default)]
pub(crate) struct Switch {
    pub inner: Scripted,
    pub refuse: AtomicBool,
}

#[async_trait]
impl Handler for Switch {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        if event.identity.idempotency_key.starts_with("d-") && self.refuse.load(Ordering::SeqCst) {
            return Outcome::Failed(Failure::permanent("HTTP 422 from the webhook: bad order"));
        }
        self.inner.handle(event, attempt).await
    }
}

/// A pipeline with its status router and console on a port of its own.
pub(crate) struct ConsoleBed {
    pub bed: Bed,
    pub handler: Arc<Switch>,
    pub addr: String,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    server: tokio::task::JoinHandle<()>,
    _log: crate::test_log::TestLog,
}

impl ConsoleBed {
    /// Retries wait 120 s (a fixed curve; 4 attempts): the test moves the clock.
    pub(crate) async fn start() -> Self {
        let bed = Bed::start(2).await;
        let handler = Arc::new(Switch {
            refuse: AtomicBool::new(true),
            ..Default::default()
        });
        let policy = RetryPolicy {
            name: "test".into(),
            curve: Curve::Fixed,
            base_s: 120,
            floor_s: 0,
            cap_s: 600,
            max_attempts: 4,
            max_age_s: None,
        };
        let parts = bed
            .wiring("replica-a")
            .policy(policy)
            .parts(handler.clone())
            .unwrap();
        let rewind = RewindParts::of(&parts);
        let pipeline = Pipeline::new(parts);
        let settings = Settings {
            access: Access {
                operator_token: Secret::new(OPERATOR_TOKEN),
                ..Default::default()
            },
            trace_url: Some(TRACE.into()),
            ordering: None,
            owner: "replica-a".into(),
            rewind: Some(rewind),
        };
        let router = hubguard::status::pipeline_router(&pipeline)
            .merge(Console::new(&pipeline, settings).router());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        let cancel = CancellationToken::new();
        let c = cancel.clone();
        let task = tokio::spawn(async move { pipeline.run(c).await.unwrap() });
        Self {
            bed,
            handler,
            addr,
            cancel,
            task,
            server,
            _log: crate::test_log::TestLog::in_process(),
        }
    }

    pub(crate) async fn stop(self) {
        self.cancel.cancel();
        within("pipeline stops", self.task).await.unwrap();
        self.server.abort();
    }

    pub(crate) async fn state_of(&self, key: &str) -> Option<State> {
        self.bed
            .ledger()
            .record(key)
            .await
            .unwrap()
            .map(|r| r.state())
    }

    pub(crate) async fn until_state(&self, key: &str, want: State) {
        eventually(&format!("{key} is {want:?}"), LIMIT, || async {
            seen(self.state_of(key).await, |s| *s == Some(want))
        })
        .await;
    }
}

/// An HTTP call to the console: (status, JSON body).
async fn call(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Value) {
    let client = reqwest::Client::new();
    let url = format!("http://{addr}{path}");
    let mut req = client.request(method.parse().unwrap(), url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    let res = within(path, req.send()).await.unwrap();
    let status = res.status().as_u16();
    let text = res.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_api_tells_a_keys_story_and_guards_every_action() {
    let cb = ConsoleBed::start().await;
    let addr = cb.addr.clone();
    cb.bed.send(0, &[("c-1", "fail:1")]).await;
    cb.bed.send(1, &[("d-1", "ok"), ("d-2", "ok")]).await;
    cb.until_state("c-1", State::RetryScheduled).await;
    cb.until_state("d-2", State::DeadLettered).await;

    // The page and its answers carry the strict policy.
    let page = reqwest::get(format!("http://{addr}/console/"))
        .await
        .unwrap();
    let csp = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("script-src 'self'") && csp.contains("default-src 'none'"));

    // A key's story: the next attempt, the rest of the schedule, why, a trace link.
    let (code, v) = call(&addr, "GET", "/console/api/lookup?q=c-1", &[], None).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["state"], "RETRY_SCHEDULED");
    let steps = v["schedule"]["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 3, "attempts 2, 3 and 4: {v}");
    assert_eq!(v["schedule"]["gives_up"]["after_attempt"], 4);
    assert_eq!(v["schedule"]["gives_up"]["reason"], "attempts_exhausted");
    assert!(v["waiting_because"][0]
        .as_str()
        .unwrap()
        .starts_with("its own schedule: attempt 2 of 4"));
    let link = v["history"][0]["trace_url"].as_str().unwrap();
    let id = v["history"][0]["trace_id"].as_str().unwrap();
    assert_eq!(link, TRACE.replace("{trace_id}", id));
    // An operator's pause of its retries (`hubguard retries pause`) says who paused it.
    use hubguard::pipeline::control::{self, Pause, Resume, RetryFilter};
    let (store, name) = (cb.bed.records(), control::record_name("hub", "$Default"));
    let filter = RetryFilter {
        key: Some("c-1".into()),
        ..Default::default()
    };
    let pause = Pause {
        by: "ops".into(),
        since_ms: hubguard::clock::ms(std::time::SystemTime::now()),
        reason: Some("receiver fix".into()),
    };
    control::pause_or_resume_retries(
        store.as_ref(),
        &name,
        Some((filter.clone(), pause)),
        None,
        false,
    )
    .await
    .unwrap();
    let (_, v) = call(&addr, "GET", "/console/api/lookup?q=c-1", &[], None).await;
    let first = v["waiting_because"][0].as_str().unwrap();
    assert!(
        first.starts_with("an operator paused retries of key c-1: paused by ops since")
            && first.contains("receiver fix"),
        "{v}"
    );
    assert_eq!(v["paused"]["by"], "ops", "{v}");
    control::pause_or_resume_retries(
        store.as_ref(),
        &name,
        None,
        Some(Resume::Filter(filter)),
        false,
    )
    .await
    .unwrap();
    // Not found: the ledger's answer and a 404.
    let (code, v) = call(&addr, "GET", "/console/api/lookup?q=nope", &[], None).await;
    assert_eq!((code, v["state"].as_str()), (404, Some("UNKNOWN")));

    // Retries waiting, filtered by type from the pending index's listing.
    let (_, v) = call(&addr, "GET", "/console/api/retries", &[], None).await;
    assert_eq!(v["retries"][0]["key"], "c-1");
    assert_eq!(v["retries"][0]["event_type"], "test.event");
    let (_, v) = call(
        &addr,
        "GET",
        "/console/api/retries?event_type=other",
        &[],
        None,
    )
    .await;
    assert_eq!(
        (v["waiting"].as_u64(), v["matched"].as_u64()),
        (Some(1), Some(0))
    );

    // Dead letters by cause.
    let (_, v) = call(&addr, "GET", "/console/api/dead-letters", &[], None).await;
    let g = &v["groups"][0];
    assert_eq!(
        (&g["reason"], &g["status"], &g["event_type"], &g["count"]),
        (
            &json!("permanent"),
            &json!("422"),
            &json!("test.event"),
            &json!(2)
        ),
        "{v}"
    );

    // Actions: refused without the role, from another origin, without the page's token.
    let body = json!({ "key": "c-1", "dry_run": true });
    let path = "/console/api/act/retry-now";
    let origin = format!("http://{addr}");
    let bearer = format!("Bearer {OPERATOR_TOKEN}");
    let (code, _) = call(
        &addr,
        "POST",
        path,
        &[("origin", &origin)],
        Some(body.clone()),
    )
    .await;
    assert_eq!(code, 403, "an anonymous reader may not act");
    let (_, session) = call(
        &addr,
        "GET",
        "/console/api/session",
        &[("authorization", &bearer)],
        None,
    )
    .await;
    assert_eq!(session["role"], "operator");
    let csrf = session["csrf"].as_str().unwrap().to_string();
    let forged = [
        ("authorization", bearer.as_str()),
        ("origin", "http://evil.example"),
        ("x-hubguard-csrf", csrf.as_str()),
    ];
    let (code, v) = call(&addr, "POST", path, &forged, Some(body.clone())).await;
    assert_eq!(code, 403, "{v}");
    let (code, _) = call(&addr, "POST", path, &forged[..1], Some(body.clone())).await;
    assert_eq!(code, 403, "without the page's token");
    let good = [
        ("authorization", bearer.as_str()),
        ("origin", origin.as_str()),
        ("x-hubguard-csrf", csrf.as_str()),
    ];
    let (code, v) = call(&addr, "POST", path, &good, Some(body)).await;
    assert_eq!(
        (code, &v["outcome"]["result"]),
        (200, &json!("done")),
        "{v}"
    );
    assert_eq!(
        cb.state_of("c-1").await,
        Some(State::RetryScheduled),
        "a dry run changes nothing"
    );

    // A group replayed: a dry run, then a bound of one.
    cb.handler.refuse.store(false, Ordering::SeqCst);
    let filter = json!({ "reason": "permanent", "status": "422", "event_type": "test.event" });
    let job = |dry_run: bool, limit: u64| json!({ "filter": filter, "dry_run": dry_run, "rate": 50, "limit": limit });
    for (dry_run, limit, replayed) in [(true, 10, 2), (false, 1, 1), (false, 10, 1)] {
        let (code, v) = call(
            &addr,
            "POST",
            "/console/api/act/replay",
            &good,
            Some(job(dry_run, limit)),
        )
        .await;
        assert_eq!(code, 200, "{v}");
        let id = v["job"].as_u64().unwrap();
        let done = eventually("the job finishes", LIMIT, || {
            let addr = addr.clone();
            async move {
                let (_, j) =
                    call(&addr, "GET", &format!("/console/api/jobs/{id}"), &[], None).await;
                seen(j, |j| j["finished"] == true)
            }
        })
        .await;
        assert_eq!(done["replayed"], replayed, "{done}");
    }
    cb.until_state("d-1", State::Delivered).await;
    cb.until_state("d-2", State::Delivered).await;

    // Pause and resume a partition: the control record says who.
    let pause = json!({ "partitions": ["1"], "reason": "maintenance" });
    let (code, v) = call(&addr, "POST", "/console/api/act/pause", &good, Some(pause)).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["control"]["partitions"]["1"]["by"], "operator (token)");
    let (_, v) = call(&addr, "GET", "/console/api/overview", &[], None).await;
    assert_eq!(v["control"]["partitions"]["1"]["reason"], "maintenance");
    let (code, v) = call(
        &addr,
        "POST",
        "/console/api/act/resume",
        &good,
        Some(json!({ "partitions": ["1"] })),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert!(v["control"]["partitions"].as_object().unwrap().is_empty());

    // Pause retries by event type from the retries page: the page lists the pause and names
    // it on each row it holds; resuming that filter lifts it; asking for neither is refused.
    let by_type = json!({ "retries": { "event_type": "test.event" }, "reason": "receiver fix" });
    let (code, v) = call(
        &addr,
        "POST",
        "/console/api/act/pause-retries",
        &good,
        Some(by_type),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["control"]["retries"][0]["by"], "operator (token)", "{v}");
    let (_, v) = call(&addr, "GET", "/console/api/retries", &[], None).await;
    assert_eq!(
        v["pauses"][0]["what"], "retries of event type test.event",
        "{v}"
    );
    assert_eq!(v["pauses"][0]["reason"], "receiver fix", "{v}");
    assert_eq!(v["retries"][0]["key"], "c-1", "{v}");
    assert_eq!(v["retries"][0]["paused"]["by"], "operator (token)", "{v}");
    let (_, v) = call(&addr, "GET", "/console/api/lookup?q=c-1", &[], None).await;
    assert_eq!(
        v["paused"]["what"], "retries of event type test.event",
        "{v}"
    );
    let resume = json!({ "retries": { "event_type": "test.event" } });
    let (code, v) = call(
        &addr,
        "POST",
        "/console/api/act/resume-retries",
        &good,
        Some(resume),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert!(v["control"]["retries"].is_null(), "{v}");
    let (_, v) = call(&addr, "GET", "/console/api/retries", &[], None).await;
    assert_eq!(v["pauses"], json!([]), "{v}");
    assert!(v["retries"][0]["paused"].is_null(), "{v}");
    let (code, _) = call(
        &addr,
        "POST",
        "/console/api/act/resume-retries",
        &good,
        Some(json!({})),
    )
    .await;
    assert_eq!(code, 400, "neither a filter nor all");
    // A misspelt criterion is refused, not read as "every retry"; a blank one too.
    for body in [
        json!({ "retries": { "eventtype": "test.event" } }),
        json!({ "retries": { "key": " " } }),
    ] {
        let (code, v) = call(
            &addr,
            "POST",
            "/console/api/act/pause-retries",
            &good,
            Some(body.clone()),
        )
        .await;
        assert_eq!(code, 400, "{body} → {v}");
    }
    let (_, v) = call(&addr, "GET", "/console/api/retries", &[], None).await;
    assert_eq!(v["pauses"], json!([]), "nothing paused: {v}");

    // The audit trail: who, what, the outcome — refusals included.
    let (_, v) = call(&addr, "GET", "/console/api/audit", &[], None).await;
    let entries = v["entries"].as_array().unwrap();
    let refused = entries
        .iter()
        .filter(|e| e["outcome"].as_str().unwrap().starts_with("refused"))
        .count();
    assert_eq!(
        refused, 5,
        "three refused for access, one resume naming nothing, one blank key (a body that does not parse is answered 400 before the audit): {v:#}"
    );
    assert!(entries
        .iter()
        .any(|e| e["action"] == "pause" && e["who"] == "operator (token)"));
    assert!(entries.iter().any(|e| e["action"] == "replay-job"));
    assert!(entries.iter().any(|e| e["action"] == "pause-retries"
        && e["target"]["retries"]["event_type"] == "test.event"
        && e["outcome"].as_str().unwrap().starts_with("changed")));
    let text = v.to_string();
    assert!(!text.contains(OPERATOR_TOKEN), "the token never shows");
    cb.stop().await;
}

/// Sends `key` to partition 0 with the correlation id `correlation` (the `correlation_id`
/// application property hubguard reads first).
async fn send_correlated(bed: &Bed, key: &str, correlation: &str) {
    use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
    let prod = producer(&bed.cs, "hub").await;
    let ev = EventData::builder()
        .with_body(b"ok".to_vec())
        .add_property("ce_id".into(), AmqpSimpleValue::String(key.into()))
        .add_property(
            "ce_type".into(),
            AmqpSimpleValue::String("test.event".into()),
        )
        .add_property(
            "correlation_id".into(),
            AmqpSimpleValue::String(correlation.into()),
        )
        .build();
    within(
        "send",
        prod.send_event(
            ev,
            Some(azure_messaging_eventhubs::SendEventOptions {
                partition_id: Some("0".into()),
            }),
        ),
    )
    .await
    .unwrap();
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_found_by_its_correlation_id_and_a_rewind_of_an_owned_partition_is_refused(
) {
    let cb = ConsoleBed::start().await;
    let addr = cb.addr.clone();
    send_correlated(&cb.bed, "d-7", "order-7-correlation").await;
    cb.until_state("d-7", State::DeadLettered).await;

    // The correlation id of a dead letter finds it, and its group shows it beside the key.
    let (code, v) = call(
        &addr,
        "GET",
        "/console/api/lookup?q=order-7-correlation",
        &[],
        None,
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (&v["key"], &v["state"], &v["correlation_id"]),
        (
            &json!("d-7"),
            &json!("DEAD_LETTERED"),
            &json!("order-7-correlation")
        )
    );
    let (_, v) = call(&addr, "GET", "/console/api/dead-letters", &[], None).await;
    let g = &v["groups"][0];
    assert_eq!(
        (&g["keys"], &g["correlation_ids"]),
        (&json!(["d-7"]), &json!(["order-7-correlation"])),
        "{v}"
    );

    // A rewind goes through the command line's checks: a partition a live replica owns is
    // refused unless paused, and nothing is written.
    let bearer = format!("Bearer {OPERATOR_TOKEN}");
    let (_, session) = call(
        &addr,
        "GET",
        "/console/api/session",
        &[("authorization", &bearer)],
        None,
    )
    .await;
    let csrf = session["csrf"].as_str().unwrap().to_string();
    let origin = format!("http://{addr}");
    let good = [
        ("authorization", bearer.as_str()),
        ("origin", origin.as_str()),
        ("x-hubguard-csrf", csrf.as_str()),
    ];
    eventually("replica-a owns partition 0", LIMIT, || {
        let addr = addr.clone();
        async move {
            let (_, v) = call(&addr, "GET", "/console/api/overview", &[], None).await;
            seen(v, |v| !v["report"]["owned_partitions"]["0"].is_null())
        }
    })
    .await;
    let rewind = json!({ "partitions": ["0"], "to": "1h" });
    let (code, v) = call(
        &addr,
        "POST",
        "/console/api/act/rewind",
        &good,
        Some(rewind),
    )
    .await;
    assert_eq!((code, &v["refused"]), (200, &json!(1)), "{v}");
    let why = v["partitions"][0]["why"].as_str().unwrap();
    assert!(
        why.contains("replica-a") && why.contains("not paused"),
        "{v}"
    );
    let (_, v) = call(&addr, "GET", "/console/api/overview", &[], None).await;
    assert!(v["control"]["rewinds"].is_null(), "nothing written: {v}");
    // Bad input says what is wrong.
    let both = json!({ "partitions": ["0"], "to": "1h", "sequence": 3 });
    let (code, v) = call(&addr, "POST", "/console/api/act/rewind", &good, Some(both)).await;
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("not both"), "{v}");
    let (_, v) = call(&addr, "GET", "/console/api/audit", &[], None).await;
    let rewinds: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "rewind")
        .map(|e| e["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(rewinds.len(), 2, "{v:#}");
    assert!(
        rewinds.iter().all(|o| o.starts_with("refused")),
        "{rewinds:?}"
    );

    // The audit trail is shared: another replica's console shows these actions.
    let settler = Arc::new(hubguard::pipeline::settle::Settler::new(
        cb.bed.ledger(),
        Arc::new(hubguard::MemoryRetryQueue::new(Arc::default())),
        hubguard::pipeline::settle::Policies {
            default: RetryPolicy::event_grid(),
            by_type: Default::default(),
        },
    ));
    let other = Console::from_parts(
        Arc::default(),
        settler,
        Settings {
            owner: "replica-b".into(),
            ..Default::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other_addr = listener.local_addr().unwrap().to_string();
    let other_server = tokio::spawn(async move {
        axum::serve(listener, other.router()).await.unwrap();
    });
    let (_, v) = call(&other_addr, "GET", "/console/api/audit", &[], None).await;
    assert_eq!(v["shared"], true, "{v}");
    let seen_there: Vec<(&str, &str)> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap(),
                e["replica"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen_there,
        [("rewind", "replica-a"), ("rewind", "replica-a")],
        "{v:#}"
    );
    other_server.abort();
    cb.stop().await;
}
