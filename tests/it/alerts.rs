//! A real Prometheus (Debian's `prometheus` package) scrapes `hubguard run` on the emulators
//! through a downstream outage and a Service Bus outage, with `dashboards/prometheus/alerts.yaml`
//! loaded (its `for:` durations shortened). Every PromQL expression of the Grafana dashboard,
//! of `dashboards/README.md` and of the alert rules is evaluated through Prometheus's HTTP API
//! without error and returns series where the scenario makes them exist; the breaker-age and
//! held-partition alerts fire. Skipped with a note where Prometheus is not installed;
//! `.ci/run` sets `HUBGUARD_REQUIRE_PROMETHEUS=1`, which turns a missing Prometheus into a
//! failure.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{within, Wait};
use crate::pipeline_support::Bed;
use crate::test_log::TestLog;

/// How long one phase of the scenario may take.
const PHASE: Duration = Duration::from_secs(90);

fn prometheus_or_skip() -> bool {
    let installed = std::process::Command::new("prometheus")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if installed {
        return true;
    }
    assert!(
        std::env::var("HUBGUARD_REQUIRE_PROMETHEUS").is_err(),
        "HUBGUARD_REQUIRE_PROMETHEUS is set but the prometheus binary is missing (apt-get install prometheus)"
    );
    eprintln!("skipped: Prometheus is not installed (apt-get install prometheus)");
    false
}

/// The webhook receiver: 503 during an outage, `perm` → 400, `fail:N` → 503 for the first N
/// calls of a key, else 200.
#[derive(Default)]
struct Receiver {
    outage: AtomicBool,
    calls: Mutex<HashMap<String, u32>>,
    delivered: Mutex<BTreeSet<String>>,
}

async fn receive(
    State(r): State<Arc<Receiver>>,
    headers: axum::http::HeaderMap,
    body: String,
) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let n = {
        let mut calls = r.calls.lock().unwrap();
        let n = calls.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    if r.outage.load(Ordering::SeqCst) {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    if body == "perm" {
        return StatusCode::BAD_REQUEST;
    }
    if let Some(k) = body.strip_prefix("fail:") {
        if n <= k.parse().unwrap_or(0) {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
    }
    r.delivered.lock().unwrap().insert(key);
    StatusCode::OK
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET path` on Prometheus: `None` while it does not answer (starting).
async fn get(prom: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(prom).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {prom}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut resp = String::new();
    within("Prometheus answers", s.read_to_string(&mut resp))
        .await
        .ok()?;
    let code = resp.split_whitespace().nth(1)?.parse().ok()?;
    let (head, body) = resp.split_once("\r\n\r\n")?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Some((code, body))
}

/// The body of a chunked HTTP/1.1 response.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Evaluates `expr` now: `Ok(result)` (the vector's series), or Prometheus's error.
async fn query(prom: &str, expr: &str) -> Result<Vec<Value>, String> {
    let (code, body) = get(prom, &format!("/api/v1/query?query={}", encode(expr)))
        .await
        .ok_or("Prometheus does not answer")?;
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{code}: {e}: {body}"))?;
    if v["status"] != "success" {
        return Err(format!("{code}: {body}"));
    }
    Ok(match &v["data"]["result"] {
        Value::Array(a) => a.clone(),
        // A scalar or string result: one value.
        other => vec![other.clone()],
    })
}

/// The first value of `expr` now, if it has one.
async fn value(prom: &str, expr: &str) -> Option<f64> {
    let r = query(prom, expr).await.ok()?;
    r.first()?["value"][1].as_str()?.parse().ok()
}

/// The alerts in `state` now.
async fn alerts(prom: &str, state: &str) -> Vec<Value> {
    let (_, body) = get(prom, "/api/v1/alerts").await.unwrap_or_default();
    let v: Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["alerts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a["state"] == state)
        .collect()
}

/// Polls `cond` every 200 ms (Prometheus evaluates every second) until it holds; panics
/// naming `what` after [`PHASE`].
async fn until<F, Fut>(what: &str, cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    Wait::new(what, PHASE)
        .every(Duration::from_millis(200))
        .until(cond)
        .await
}

/// The rule file with every `for:` shortened to 2 s (evaluated every second).
fn rules_for_the_test(rules: &str) -> String {
    rules
        .lines()
        .map(|l| match l.split_once("for: ") {
            Some((indent, _)) if indent.trim().is_empty() => format!("{indent}for: 2s"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every PromQL expression of the Grafana dashboard.
fn dashboard_exprs(root: &Path) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => out.push(e.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("dashboards/grafana/hubguard.json")).unwrap(),
    )
    .unwrap();
    let mut out = Vec::new();
    walk(&dash, &mut out);
    out
}

/// Every PromQL expression of `dashboards/README.md`: the inline code naming a metric in
/// Prometheus's spelling.
fn readme_exprs(root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root.join("dashboards/README.md")).unwrap();
    let mut out = BTreeSet::new();
    for (i, span) in text.split('`').enumerate() {
        if i % 2 == 1 && span.contains("hubguard_") && !span.contains('\n') {
            out.insert(span.trim().to_string());
        }
    }
    out.into_iter().collect()
}

/// Whether `expr` is a condition (it returns series only while it holds).
fn is_condition(expr: &str) -> bool {
    [" > ", " < ", " == ", " != ", ">=", "<=", "absent("]
        .iter()
        .any(|op| expr.contains(op))
}

/// The metric names (`hubguard_…`) an expression reads.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in expr.match_indices("hubguard_") {
        let boundary = i == 0 || !expr.as_bytes()[i - 1].is_ascii_alphanumeric();
        if boundary {
            let name: String = expr[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            out.insert(name);
        }
    }
    out
}

fn write_config(path: &Path, bed: &Bed, hook: std::net::SocketAddr) {
    std::fs::write(
        path,
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
owner_id = "alerts-replica"
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
max_attempts = 20
[breaker]
consecutive_failures = 3
open_ms = 4000
spread_ms = 200
probe_timeout_ms = 2000
[status]
listen = "127.0.0.1:0"
"#,
            eh = bed.eh.connection_string(),
            sb = bed.sb.connection_string(),
            blob = bed.blob.container_url("hubguard"),
        ),
    )
    .unwrap();
}

fn firing_with<'a>(alerts: &'a [Value], name: &str, label: (&str, &str)) -> Option<&'a Value> {
    alerts
        .iter()
        .find(|a| a["labels"]["alertname"] == name && a["labels"][label.0] == label.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_evaluates_every_query_and_the_alerts_fire_through_outages() {
    if !prometheus_or_skip() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let _in_process = TestLog::in_process();

    // hubguard on the emulators, delivering to a receiver the test steers.
    let bed = Bed::start(2).await;
    let receiver = Arc::new(Receiver::default());
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_addr = hook.local_addr().unwrap();
    let app = Router::new()
        .route("/events", post(receive))
        .with_state(receiver.clone());
    tokio::spawn(async move { axum::serve(hook, app).await.unwrap() });
    let config = dir.path().join("hubguard.toml");
    write_config(&config, &bed, hook_addr);
    let hubguard_log = TestLog::file("alerts-hubguard");
    let mut hubguard = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["run", "--config"])
        .arg(&config)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(hubguard_log.stdio())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(hubguard.stdout.take().unwrap()).lines();
    let first = within("hubguard starts", out.next_line())
        .await
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "hubguard exited; its log: {}",
                hubguard_log.path().display()
            )
        });
    let status = first
        .split("status on http://")
        .nth(1)
        .unwrap_or_else(|| panic!("{first}"))
        // The address alone: the line goes on with the console's URL.
        .split([';', ' '])
        .next()
        .unwrap_or_default()
        .to_string();

    // Prometheus scraping it every second, evaluating the rules every second.
    let rules = dir.path().join("alerts.yaml");
    std::fs::write(
        &rules,
        rules_for_the_test(
            &std::fs::read_to_string(root.join("dashboards/prometheus/alerts.yaml")).unwrap(),
        ),
    )
    .unwrap();
    let prom_config = dir.path().join("prometheus.yml");
    std::fs::write(
        &prom_config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: hubguard\n    static_configs:\n      - targets: ['{status}']\n",
            rules.display()
        ),
    )
    .unwrap();
    let prom = format!("127.0.0.1:{}", free_port());
    let prom_log = TestLog::file("alerts-prometheus");
    let _prometheus = tokio::process::Command::new("prometheus")
        .arg(format!("--config.file={}", prom_config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={prom}"))
        .stdout(prom_log.stdio())
        .stderr(prom_log.stdio())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    until("Prometheus scrapes hubguard", || async {
        value(&prom, "up{job=\"hubguard\"}").await == Some(1.0)
            && value(&prom, "max(hubguard_consumer_state)").await == Some(1.0)
    })
    .await;

    // Healthy: deliveries, two retries, a dead letter.
    bed.send(
        0,
        &[("ok-1", "ok"), ("flaky-1", "fail:1"), ("perm-1", "perm")],
    )
    .await;
    bed.send(1, &[("ok-2", "ok"), ("flaky-2", "fail:1")]).await;
    until("the healthy phase scraped", || async {
        value(&prom, "sum(hubguard_events_delivered_total)").await >= Some(4.0)
            && value(&prom, "sum(hubguard_retry_lateness_seconds_count)").await >= Some(2.0)
            && value(&prom, "sum(hubguard_events_dead_lettered_total)").await >= Some(1.0)
    })
    .await;
    // Retries on time read as on time (the lateness histogram's buckets are in seconds).
    let p50 = value(
        &prom,
        "histogram_quantile(0.5, sum by (le) (hubguard_retry_lateness_seconds_bucket))",
    )
    .await
    .unwrap();
    assert!(p50 < 2.0, "retry lateness p50 {p50} s on a healthy run");

    // A downstream outage: the breaker opens and stays open (its probe keeps failing), the
    // partitions pause — held with reason breaker_open — for as long as events wait (each
    // probe settles one event, then the next one meets the breaker again).
    receiver.outage.store(true, Ordering::SeqCst);
    let outage_keys: Vec<String> = (0..24).map(|i| format!("outage-{i}")).collect();
    for (i, k) in outage_keys.iter().enumerate() {
        bed.send(i % 2, &[(k.as_str(), "ok")]).await;
    }
    until("the breaker-age and held alerts fire", || async {
        let firing = alerts(&prom, "firing").await;
        firing_with(
            &firing,
            "HubguardBreakerOpenTooLong",
            ("downstream", &hook_addr.to_string()),
        )
        .is_some()
            && firing_with(&firing, "HubguardPartitionHeld", ("reason", "breaker_open"))
                .is_some_and(|a| {
                    a["labels"]["partition"]
                        .as_str()
                        .is_some_and(|p| !p.is_empty())
                })
    })
    .await;
    let firing = alerts(&prom, "firing").await;
    let breaker = firing_with(
        &firing,
        "HubguardBreakerOpenTooLong",
        ("downstream", &hook_addr.to_string()),
    )
    .unwrap();
    assert_eq!(breaker["labels"]["severity"], "critical", "{breaker}");
    let summary = breaker["annotations"]["summary"].as_str().unwrap();
    assert!(summary.contains(&hook_addr.to_string()), "{summary}");
    assert!(
        breaker["annotations"]["runbook_url"]
            .as_str()
            .is_some_and(|u| u.contains("#runbook-")),
        "{breaker}"
    );
    receiver.outage.store(false, Ordering::SeqCst);
    until(
        "the downstream back: breaker closed, nothing held",
        || async {
            let delivered = receiver.delivered.lock().unwrap().clone();
            outage_keys.iter().all(|k| delivered.contains(k))
                && value(&prom, "max(hubguard_breaker_age_seconds)").await == Some(0.0)
                && value(&prom, "sum(hubguard_partitions_held)").await == Some(0.0)
        },
    )
    .await;

    // A Service Bus outage: a failed event cannot be scheduled for retry, so its partition
    // is held with reason service_bus.
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("sb-flaky-1", "fail:1")]).await;
    until("the held alert fires for Service Bus", || async {
        let firing = alerts(&prom, "firing").await;
        firing_with(&firing, "HubguardPartitionHeld", ("reason", "service_bus"))
            .is_some_and(|a| a["labels"]["partition"] == "0")
    })
    .await;
    let held_since = value(
        &prom,
        "max(hubguard_partition_held_seconds{reason=\"service_bus\"})",
    )
    .await
    .unwrap();
    assert!(held_since > 0.0, "{held_since}");
    bed.sb.faults().clear();
    until(
        "Service Bus back: the event delivered, nothing held",
        || async {
            receiver.delivered.lock().unwrap().contains("sb-flaky-1")
                && value(&prom, "sum(hubguard_partitions_held)").await == Some(0.0)
        },
    )
    .await;

    // Every expression evaluates; what the scenario makes exist returns series.
    let mut checked = 0;
    let mut exprs: Vec<(String, String)> = Vec::new();
    exprs.extend(
        dashboard_exprs(root)
            .into_iter()
            .map(|e| ("dashboards/grafana/hubguard.json".to_string(), e)),
    );
    exprs.extend(
        readme_exprs(root)
            .into_iter()
            .map(|e| ("dashboards/README.md".to_string(), e)),
    );
    let (_, body) = get(&prom, "/api/v1/rules").await.unwrap();
    let loaded: Value = serde_json::from_str(&body).unwrap();
    let rules: Vec<Value> = loaded["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect();
    assert!(rules.len() >= 17, "the alert rules are loaded: {loaded}");
    for r in &rules {
        assert_eq!(
            r["health"], "ok",
            "rule {} evaluates without error: {r}",
            r["name"]
        );
        exprs.push((
            format!("alert {}", r["name"].as_str().unwrap()),
            r["query"].as_str().unwrap().to_string(),
        ));
    }
    assert!(exprs.len() >= 40, "{exprs:?}");
    for (from, expr) in &exprs {
        let result = query(&prom, expr)
            .await
            .unwrap_or_else(|e| panic!("{from}: `{expr}` does not evaluate: {e}"));
        if !is_condition(expr) {
            // A bare histogram name is read through its buckets.
            let result = if result.is_empty() && !expr.contains('(') {
                query(&prom, &format!("{expr}_bucket")).await.unwrap()
            } else {
                result
            };
            assert!(!result.is_empty(), "{from}: `{expr}` returns no series");
        }
        for name in metric_names(expr) {
            let series = query(&prom, &format!("{{__name__=~\"{name}|{name}_bucket\"}}"))
                .await
                .unwrap();
            assert!(
                !series.is_empty(),
                "{from}: `{expr}` reads {name}, which has no series"
            );
        }
        checked += 1;
    }
    assert!(checked >= 40, "{checked}");

    let pid = hubguard.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let exit = within("hubguard exits", hubguard.wait()).await.unwrap();
    assert!(exit.success(), "{exit:?}");
}

#[test]
fn the_test_rules_shorten_every_for_and_only_that() {
    let rules = "      - alert: A\n        expr: x > 0\n        for: 10m\n        labels:\n          summary: \"held for: long\"\n";
    let short = rules_for_the_test(rules);
    assert!(short.contains("        for: 2s\n"), "{short}");
    assert!(!short.contains("10m"), "{short}");
    assert!(short.contains("held for: long"), "{short}");
    assert_eq!(
        metric_names("max by (le) (rate(hubguard_a_bucket[5m])) > 2 * hubguard_b"),
        ["hubguard_a_bucket".to_string(), "hubguard_b".to_string()].into()
    );
    assert!(is_condition("hubguard_x != 1") && !is_condition("max(hubguard_x)"));
}

/// Every alert names a runbook entry that exists.
#[test]
fn every_alert_links_a_runbook_entry_that_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = std::fs::read_to_string(root.join("dashboards/prometheus/alerts.yaml")).unwrap();
    let readme = std::fs::read_to_string(root.join("dashboards/README.md")).unwrap();
    let alerts = rules.matches("- alert: ").count();
    let links: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("runbook_url: "))
        .collect();
    assert_eq!(links.len(), alerts, "one runbook_url per alert");
    for link in links {
        let anchor = link
            .trim_matches('"')
            .strip_prefix("dashboards/README.md#")
            .unwrap_or_else(|| panic!("{link} points into dashboards/README.md"));
        assert!(
            readme.contains(&format!("<a id=\"{anchor}\"></a>")),
            "{link}: no such entry in dashboards/README.md"
        );
    }
    for l in rules
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert: "))
    {
        let name = l.trim_start().trim_start_matches("- alert: ");
        assert!(readme.contains(name), "{name} is not in the runbook");
    }
}
