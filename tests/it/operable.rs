//! hubguard as an operator runs it (issue 17): `GET /metrics` in the Prometheus text format
//! with every name the dashboards query, JSON log lines that join their traces, "what is
//! waiting?" (`GET /v1/retries`, `hubguard retries list`), a replayed attempt that says so,
//! and the CLI's conventions (exit codes, completions, man page).

use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use hubguard::telemetry::names::{attr, span};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

use crate::common::{eventually, http_get, seen, within, Text, STEP};
use crate::otlp::telemetry;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

async fn json_get(addr: &str, path: &str) -> (u16, serde_json::Value) {
    let (code, body) = http_get(addr, path).await;
    (code, serde_json::from_str(&body).unwrap_or_default())
}

fn keys_of(retries: &serde_json::Value) -> Vec<String> {
    retries["retries"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r["key"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A replay (the same event read again from Event Hubs while the ledger holds its retry)
/// is marked on its span; the retry waiting an hour is listed by `GET /v1/retries`, and
/// `/metrics` serves the counters and the pending gauge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_says_so_and_what_waits_is_listed_and_scraped() {
    let t = telemetry();
    let bed = Bed::start(1).await;
    bed.send(0, &[("op-ok", "ok"), ("op-wait", "fail:9")]).await;
    let handler = Arc::new(Scripted::default());
    let mut policy = fast_policy(5);
    (policy.base_s, policy.floor_s, policy.cap_s) = (3600, 3600, 7200);
    let run = Bed::run(bed.parts(handler.clone(), policy, "replica-operable"));
    let ledger = bed.ledger();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let router = hubguard::status::router(run.health.clone(), ledger.clone(), None);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let _gauges =
        hubguard::status::PendingGauges::start(ledger.clone(), Duration::from_millis(100));

    wait_for("op-wait waiting", &run.health, LIMIT, || async {
        keys_of(&json_get(&addr, "/v1/retries").await.1).contains(&"op-wait".to_string())
    })
    .await;
    let (code, all) = json_get(&addr, "/v1/retries").await;
    assert_eq!(code, 200, "{all}");
    let wait = all["retries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == "op-wait")
        .unwrap()
        .clone();
    assert_eq!(wait["attempt"], 2, "{all}");
    assert_eq!(wait["last_error"], "scripted failure 1", "{all}");
    assert!(
        wait["due"].as_str().is_some_and(|d| d.ends_with('Z')),
        "{all}"
    );
    let (_, soon) = json_get(&addr, "/v1/retries?due_before=10m").await;
    assert!(!keys_of(&soon).contains(&"op-wait".to_string()), "{soon}");
    let (_, later) = json_get(&addr, "/v1/retries?due_before=2h").await;
    assert!(keys_of(&later).contains(&"op-wait".to_string()), "{later}");
    assert_eq!(http_get(&addr, "/v1/retries?due_before=soon").await.0, 400);

    // The same event again from Event Hubs: the ledger already records its attempt 1.
    bed.send(0, &[("op-wait", "fail:9")]).await;
    wait_for("replayed", &run.health, LIMIT, || async {
        handler.calls_of("op-wait").len() >= 2
    })
    .await;

    // /metrics: the Prometheus text format, with the pending gauge.
    eventually("pending gauge", STEP, || async {
        let (code, text) = http_get(&addr, "/metrics").await;
        assert_eq!(code, 200);
        let names = crate::dashboards::served_names(&text);
        seen(Text(text), |Text(text)| {
            names.contains("hubguard_events_delivered_total")
                && names.contains("hubguard_retries_scheduled_total")
                && text
                    .lines()
                    .any(|l| l.starts_with("hubguard_retries_pending") && !l.ends_with(" 0"))
        })
    })
    .await;
    run.stop().await;

    // Two attempt-1 spans from Event Hubs; the second says it is a replay.
    let spans = eventually("spans", STEP, || async {
        t.flush().await;
        let spans: Vec<_> = t
            .collected
            .lock()
            .unwrap()
            .spans
            .iter()
            .filter(|s| {
                s.name == span::ATTEMPT
                    && s.attributes.get(attr::CONVERSATION_ID).map(String::as_str)
                        == Some("op-wait")
            })
            .cloned()
            .collect();
        seen(spans, |s| s.len() >= 2)
    })
    .await;
    let mut spans = spans;
    spans.sort_by_key(|s| s.start_ns);
    for s in &spans {
        assert_eq!(s.attributes[attr::ATTEMPT], "1", "{s:?}");
        assert_eq!(s.attributes[attr::MESSAGING_SYSTEM], "eventhubs", "{s:?}");
        assert_eq!(s.attributes[attr::MESSAGE_ID], "op-wait", "{s:?}");
        assert_eq!(s.attribute_count, s.attributes.len(), "a duplicate: {s:?}");
        for k in s.attributes.keys() {
            assert!(
                hubguard::telemetry::names::all().contains(&k.as_str()),
                "undocumented attribute {k}: {s:?}"
            );
        }
    }
    assert!(
        !spans[0].attributes.contains_key(attr::REPLAY),
        "{:?}",
        spans[0]
    );
    assert_eq!(spans[1].attributes[attr::REPLAY], "true", "{:?}", spans[1]);
}

/// The webhook receiver of the binary test: `fail:1` fails once (a retry runs 1 s later),
/// `wait` answers 503 with `Retry-After: 3600` (a retry waits an hour), anything else 200.
async fn start_hook() -> std::net::SocketAddr {
    let seen = Arc::new(std::sync::Mutex::new(BTreeSet::<String>::new()));
    let app = Router::new().route(
        "/events",
        post(move |headers: HeaderMap, body: String| {
            let seen = seen.clone();
            async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                let first = seen.lock().unwrap().insert(key);
                match body.as_str() {
                    "fail:1" if first => (StatusCode::SERVICE_UNAVAILABLE, HeaderMap::new()),
                    "wait" => {
                        let mut h = HeaderMap::new();
                        h.insert("retry-after", "3600".parse().unwrap());
                        (StatusCode::SERVICE_UNAVAILABLE, h)
                    }
                    _ => (StatusCode::OK, HeaderMap::new()),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn hubguard_cmd(args: &[&str], config: &std::path::Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// `hubguard run` with `HUBGUARD_LOG__FORMAT=json`: JSON lines on stderr (no ANSI) whose
/// attempt lines carry the trace id the ledger records; `/metrics` serves every metric the
/// dashboards and the READMEs query; `retries list`; `status` of an unknown key exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_logs_json_serves_metrics_and_lists_retries() {
    let bed = Bed::start(1).await;
    let hook = start_hook().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hubguard.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[eventhubs]
connection_string = "{eh}"
hub = "hub"
[servicebus]
connection_string = "{sb}"
[storage]
container_url = "{blob}"
[handler]
kind = "webhook"
url = "http://{hook}/events"
timeout_ms = 2000
# A fixed cap far above what the test sends: the rate-limit gauges are served (every
# dashboard query has a series) without changing what the test measures.
rate_limit = 1000
rate_limit_adaptive = false
[processor]
owner_id = "operable"
update_interval_ms = 500
ownership_expiration_ms = 3000
[checkpoint]
every_ms = 200
[retry]
receive_wait_ms = 1000
call_deadline_ms = 3000
[policy.default]
curve = "fixed"
base_s = 1
floor_s = 1
cap_s = 7200
max_attempts = 4
[status]
listen = "127.0.0.1:0"
"#,
            eh = bed.eh.connection_string(),
            sb = bed.sb.connection_string(),
            blob = bed.blob.container_url("hubguard"),
        ),
    )
    .unwrap();
    bed.send(
        0,
        &[
            ("json-ok", "ok"),
            ("json-flaky", "fail:1"),
            ("json-wait", "wait"),
        ],
    )
    .await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["run", "--config"])
        .arg(&config)
        .env("HUBGUARD_LOG__FORMAT", "json")
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let logs = tokio::spawn(async move {
        let mut all = String::new();
        let _ = stderr.read_to_string(&mut all).await;
        all
    });
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = within("run starts", out.next_line())
        .await
        .unwrap()
        .unwrap();
    let addr = first
        .split("status on http://")
        .nth(1)
        .unwrap_or_else(|| panic!("{first}"))
        // The address alone: the line goes on with the console's URL.
        .split([';', ' '])
        .next()
        .unwrap_or_default()
        .to_string();

    eventually(
        "json-wait waiting and json-flaky delivered",
        STEP,
        || async {
            let (_, r) = json_get(&addr, "/v1/retries").await;
            let (_, flaky) = json_get(&addr, "/v1/events/json-flaky").await;
            seen((keys_of(&r), flaky["state"].clone()), |(waiting, flaky)| {
                waiting.contains(&"json-wait".to_string()) && flaky == "DELIVERED"
            })
        },
    )
    .await;

    // Every metric the dashboards and READMEs query is served (the retry lateness histogram
    // needs json-flaky's retry; the breaker's gauges the default breaker).
    let (code, text) = http_get(&addr, "/metrics").await;
    assert_eq!(code, 200);
    let names = crate::dashboards::served_names(&text);
    let queried = crate::dashboards::promql_names();
    assert!(queried.len() >= 15, "{queried:?}");
    let missing: Vec<_> = queried
        .iter()
        .filter(|q| !crate::dashboards::served(q, &names))
        .collect();
    assert!(
        missing.is_empty(),
        "queried but not served: {missing:?}\n{text}"
    );

    // `hubguard retries list`: text, JSON lines, and the due-time filter.
    let list = hubguard_cmd(&["retries", "list"], &config);
    let listed = String::from_utf8_lossy(&list.stdout);
    assert!(list.status.success(), "{listed}");
    assert!(
        listed.contains("1 retry waiting") && listed.contains("json-wait"),
        "{listed}"
    );
    let list = hubguard_cmd(&["retries", "list", "--json"], &config);
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["key"], "json-wait");
    assert_eq!(lines[0]["attempt"], 2);
    assert!(
        lines[0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("503") && e.contains("Retry-After: 3600")),
        "{lines:?}"
    );
    let soon = hubguard_cmd(&["retries", "list", "--due-before", "10m"], &config);
    assert!(
        String::from_utf8_lossy(&soon.stdout).contains("0 retries waiting"),
        "{soon:?}"
    );

    // `status`: a key with a record exits 0, one without exits 3.
    let known = hubguard_cmd(&["status", "json-wait", "--json"], &config);
    assert_eq!(known.status.code(), Some(0), "{known:?}");
    let record: serde_json::Value = serde_json::from_slice(&known.stdout).unwrap();
    let trace_id = record["trace_ids"][0].as_str().unwrap().to_string();
    let unknown = hubguard_cmd(&["status", "no-such-key"], &config);
    assert_eq!(unknown.status.code(), Some(3), "{unknown:?}");

    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = within("exits", child.wait()).await.unwrap();
    assert!(status.success(), "{status:?}");
    let logs = logs.await.unwrap();

    // One JSON object per line, no ANSI escapes; the failed attempt's line carries the trace
    // id the ledger recorded for it.
    assert!(!logs.contains('\u{1b}'), "{logs}");
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty());
    for l in &lines {
        for k in ["time", "level", "target", "message", "fields"] {
            assert!(l.get(k).is_some(), "no {k}: {l}");
        }
    }
    let failed = lines
        .iter()
        .find(|l| {
            l["message"] == "attempt failed"
                && l["fields"]["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("Retry-After: 3600"))
        })
        .unwrap_or_else(|| panic!("no attempt line for json-wait: {logs}"));
    assert_eq!(failed["trace_id"], trace_id.as_str(), "{failed}");
    assert!(
        failed["span_id"].as_str().is_some_and(|s| s.len() == 16),
        "{failed}"
    );
    // The Azure SDK's info chatter stays out by default.
    assert!(
        !lines.iter().any(|l| l["level"] == "INFO"
            && l["target"].as_str().is_some_and(|t| t.starts_with("azure"))),
        "{logs}"
    );
}

#[test]
fn completions_and_the_man_page_come_from_the_cli() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let bash = run(&["completions", "bash"]);
    assert!(
        bash.contains("_hubguard()") && bash.contains("retries"),
        "{bash}"
    );
    assert!(run(&["completions", "zsh"]).contains("#compdef hubguard"));
    let man = run(&["man"]);
    assert!(
        man.contains(".TH hubguard 1") && man.contains("dead\\-letters"),
        "{man}"
    );
    let dir = tempfile::tempdir().unwrap();
    run(&["man", "--dir", dir.path().to_str().unwrap()]);
    for page in ["hubguard.1", "hubguard-run.1", "hubguard-retries-list.1"] {
        assert!(dir.path().join(page).is_file(), "{page}");
    }
    // A usage error exits 2.
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["retries", "list", "--no-such-flag"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}
