//! `hubguard run`, `status` and `dead-letters` as an operator uses them: the binary, a TOML
//! config with an environment override, the webhook handler against a local receiver, the
//! status endpoint, and a clean stop on SIGTERM.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{eventually, http_get, seen, within, STEP};
use crate::pipeline_support::Bed;
use crate::test_log::TestLog;

#[derive(Default)]
struct Receiver {
    /// Idempotency-Key → (attempt header, traceparent) of every call.
    calls: Mutex<HashMap<String, Vec<(String, String)>>>,
}

async fn receive(State(r): State<Arc<Receiver>>, headers: HeaderMap, body: String) -> StatusCode {
    let h = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let key = h("idempotency-key");
    let n = {
        let mut calls = r.calls.lock().unwrap();
        let v = calls.entry(key).or_default();
        v.push((h("x-hubguard-attempt"), h("traceparent")));
        v.len()
    };
    if let Some(k) = body.strip_prefix("fail:") {
        if n <= k.parse().unwrap_or(0) {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
    }
    if body == "perm" {
        return StatusCode::BAD_REQUEST;
    }
    StatusCode::OK
}

/// The local webhook receiver the tests point hubguard at.
async fn start_receiver() -> (Arc<Receiver>, std::net::SocketAddr) {
    let receiver = Arc::new(Receiver::default());
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_addr = hook.local_addr().unwrap();
    let app = Router::new()
        .route("/events", post(receive))
        .with_state(receiver.clone());
    tokio::spawn(async move { axum::serve(hook, app).await.unwrap() });
    (receiver, hook_addr)
}

fn write_config(
    path: &std::path::Path,
    bed: &Bed,
    hook: std::net::SocketAddr,
    owner: &str,
    status_port: u16,
) {
    std::fs::write(
        path,
        format!(
            r#"
[eventhubs]
connection_string = "{eh}"
hub = "not-the-hub"   # overridden from the environment
[servicebus]
connection_string = "{sb}"
[storage]
container_url = "{blob}"
[handler]
kind = "webhook"
url = "http://{hook}/events"
timeout_ms = 2000
[processor]
owner_id = "{owner}"
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
max_attempts = 4
[status]
listen = "127.0.0.1:{status_port}"
"#,
            eh = bed.eh.connection_string(),
            sb = bed.sb.connection_string(),
            blob = bed.blob.container_url("hubguard"),
        ),
    )
    .unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn_run(config: &std::path::Path, log: &TestLog) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["run", "--config"])
        .arg(config)
        .env("HUBGUARD_EVENTHUBS__HUB", "hub")
        .stdout(log.stdio())
        .stderr(log.stdio())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_stream_loses_nothing() {
    // A killed replica's peek-locks lapse only after the queue's lock duration: 5 s here
    // (60 s by default), so the retries it held go to the other replica within the wait.
    let mut queue = hubguard::emulator::servicebus::QueueSpec::new("retries");
    queue.lock_duration = std::time::Duration::from_secs(5);
    let bed = Bed::start_with_queue(4, queue).await;
    let (receiver, hook_addr) = start_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let (c1, c2) = (dir.path().join("r1.toml"), dir.path().join("r2.toml"));
    write_config(&c1, &bed, hook_addr, "replica-1", free_port());
    write_config(&c2, &bed, hook_addr, "replica-2", free_port());
    let (log1, log2) = (
        TestLog::file("run_command-killed-replica-1"),
        TestLog::file("run_command-killed-replica-2"),
    );
    let mut r1 = spawn_run(&c1, &log1);
    let mut r2 = spawn_run(&c2, &log2);
    let mut keys = Vec::new();
    for p in 0..4 {
        let ks: Vec<String> = (0..50).map(|i| format!("kill-{p}-{i}")).collect();
        let evs: Vec<(&str, &str)> = ks
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), if i % 7 == 0 { "fail:1" } else { "ok" }))
            .collect();
        bed.send(p, &evs).await;
        keys.extend(ks);
    }
    let delivered = |r: &Receiver| r.calls.lock().unwrap().len();
    eventually("some delivered", STEP, || async {
        seen(delivered(&receiver), |n| *n >= 40)
    })
    .await;
    // SIGKILL: no final checkpoint, no ownership release, in-flight work lost with the process.
    r1.start_kill().unwrap();
    let _ = r1.wait().await;
    // Delivered = answered 200: an `ok` event on its first call, a `fail:1` event on its second.
    let fails_once = |k: &str| {
        k.rsplit('-')
            .next()
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i % 7 == 0)
    };
    eventually("every event delivered after the kill", STEP, || async {
        let calls = receiver.calls.lock().unwrap().clone();
        let lost: Vec<&String> = keys
            .iter()
            .filter(|k| calls.get(*k).map_or(0, Vec::len) < if fails_once(k) { 2 } else { 1 })
            .collect();
        if lost.is_empty() {
            Ok(())
        } else {
            Err(lost)
        }
    })
    .await;
    eventually("retry queue drained", STEP, || async {
        seen(bed.sb.counters("retries").unwrap(), |c| {
            c.active + c.scheduled + c.locked == 0
        })
    })
    .await;
    r2.start_kill().unwrap();
    let _ = r2.wait().await;
}

fn hubguard(args: &[&str], config: &std::path::Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env("HUBGUARD_EVENTHUBS__HUB", "hub")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_status_and_dead_letters_from_the_command_line() {
    let bed = Bed::start(2).await;
    let (receiver, hook_addr) = start_receiver().await;

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hubguard.toml");
    let status_port = free_port();
    write_config(&config, &bed, hook_addr, "cli-replica", status_port);

    bed.send(
        0,
        &[
            ("cli-ok", "ok"),
            ("cli-flaky", "fail:1"),
            ("cli-perm", "perm"),
        ],
    )
    .await;
    bed.send(1, &[("cli-ok-2", "ok")]).await;

    let log = TestLog::file("run_command-cli-replica");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["run", "--config"])
        .arg(&config)
        .env("HUBGUARD_EVENTHUBS__HUB", "hub")
        .stdout(Stdio::piped())
        .stderr(log.stdio())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = within("run starts", out.next_line())
        .await
        .unwrap()
        .unwrap();
    assert!(
        first.contains("consuming hub ($Default) as cli-replica"),
        "{first}"
    );
    let status_addr = format!("127.0.0.1:{status_port}");

    // Wait (bounded) for the flaky event to be delivered on its second attempt.
    eventually("flaky delivered", STEP, || async {
        seen(
            http_get(&status_addr, "/v1/events/cli-flaky").await,
            |(code, body)| *code == 200 && body.contains("\"DELIVERED\""),
        )
    })
    .await;
    let (code, _) = http_get(&status_addr, "/healthz").await;
    assert_eq!(code, 200);
    eventually("ready", STEP, || async {
        seen(http_get(&status_addr, "/readyz").await, |(code, _)| {
            *code == 200
        })
    })
    .await;
    let (_, report) = http_get(&status_addr, "/v1/status").await;
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(
        report["breaker"]["downstream"],
        hook_addr.to_string(),
        "{report}"
    );
    assert_eq!(report["breaker"]["state"], "closed", "{report}");
    let (code, body) = http_get(&status_addr, "/v1/events/cli-ok").await;
    assert_eq!(code, 404, "{body}");
    // No record is not a delivery seen: it says what it knows and claims neither.
    assert!(
        body.contains("no record") && body.contains("never seen") && !body.contains("never failed"),
        "{body}"
    );

    // The webhook got the idempotency key, the attempt number and a W3C traceparent.
    let calls = receiver
        .calls
        .lock()
        .unwrap()
        .get("cli-flaky")
        .cloned()
        .unwrap();
    assert_eq!(
        calls.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        vec!["1", "2"]
    );
    assert!(
        calls
            .iter()
            .all(|c| c.1.starts_with("00-") && c.1.len() == 55),
        "{calls:?}"
    );

    // `hubguard status` answers from the ledger.
    let out_status = hubguard(&["status", "cli-flaky"], &config);
    let text = String::from_utf8_lossy(&out_status.stdout);
    assert!(out_status.status.success(), "{text}");
    assert!(
        text.contains("state:           DELIVERED") && text.contains("attempts:        2 of 4"),
        "{text}"
    );
    assert!(text.contains("HTTP 503 from the webhook"), "{text}");
    let json = hubguard(&["status", "cli-flaky", "--json"], &config);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["trace_ids"].as_array().unwrap().len(), 2);

    // The permanent failure is listed as a dead letter, and replay schedules it again.
    let list = hubguard(&["dead-letters", "list"], &config);
    let text = String::from_utf8_lossy(&list.stdout);
    assert!(
        text.contains("1 dead-lettered event(s)")
            && text.contains("cli-perm")
            && text.contains("HTTP 400"),
        "{text}"
    );
    let replay = hubguard(&["dead-letters", "replay", "cli-perm"], &config);
    let text = String::from_utf8_lossy(&replay.stdout);
    assert!(text.contains("cli-perm: attempt 2 scheduled now"), "{text}");
    eventually("replayed attempt runs", STEP, || async {
        let n = receiver
            .calls
            .lock()
            .unwrap()
            .get("cli-perm")
            .map_or(0, |v| v.len());
        seen(n, |n| *n >= 2)
    })
    .await;

    // SIGTERM: a clean stop.
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = within("exits", child.wait()).await.unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(bed.checkpoint_of("0").await, Some(2));
    assert_eq!(bed.checkpoint_of("1").await, Some(0));
}

#[test]
fn a_bad_config_stops_start_up_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.toml");
    std::fs::write(
        &config,
        "[eventhubs]\nconnection_string = \"Endpoint=sb://h;SharedAccessKeyName=k;SharedAccessKey=SECRET\"\nhub = \"h\"\n[servicebus]\nconnection_string = \"nonsense\"\n[storage]\ncontainer_url = \"http://x/y/z\"\n[handler]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:1/\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["run", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("servicebus.connection_string"), "{err}");
    assert!(!err.contains("SECRET"), "{err}");
}
