//! No credential in any output. `hubguard run` (the binary, two replicas: text logs and JSON
//! logs) on the emulators, with a secret in every place a user can put one — the Event Hubs
//! and Service Bus connection strings' keys, a SAS in the container URL, a password in the
//! webhook URL's userinfo and a token in its query (one replica gets the URL from a
//! `HUBGUARD_*` override), the `Authorization` value, the signing secret, the OTLP headers and
//! an OTLP endpoint with a password — and a receiver that refuses the handshake, fails,
//! redirects, refuses for good and echoes the credentials it was sent. Then every output is
//! searched for every secret: the logs, `/readyz`, `/v1/status`, `/v1/events/{key}`,
//! `/v1/retries`, `/metrics`, every blob (bodies and metadata: the ledger, checkpoints,
//! ownership), every message left on Service Bus (the dead-letter destination), the exported
//! spans and metrics, and what `status`, `retries list` and `dead-letters list` print.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use axum::Router;
use base64::Engine as _;
use hubguard::azure::SasKey;
use hubguard::emulator::blob::{BlobConfig, BlobEmulator};
use hubguard::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use hubguard::emulator::servicebus::broker::Entity;
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

use crate::common::{conn, eventually, http_get, seen, within, Wait, STEP};
use crate::pipeline_support::Bed;

const EH_KEY: &str = "EhSasKeyZq9x1";
const SB_KEY: &str = "SbSasKeyZq9x2";
const BLOB_SIG: &str = "BlobSigZq9x3";
const HOOK_PASS: &str = "HookPassZq9x4";
const HOOK_CODE: &str = "HookCodeZq9x5";
const AUTHZ: &str = "AuthzTokZq9x6";
const SIGNING: &str = "SigningSecretZq9x7xxxx"; // 22 bytes, base64 below
const OTLP_TOKEN: &str = "OtlpTokZq9x8";
const OTLP_PASS: &str = "OtlpPassZq9x9";
const MOVED_PASS: &str = "MovedPassZq9y0";
const MOVED_SIG: &str = "MovedSigZq9y1";
const CLIENT_SECRET: &str = "ClientSecretZq9y2";

fn signing_b64() -> String {
    base64::engine::general_purpose::STANDARD.encode(SIGNING)
}

fn basic_b64() -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("hookuser:{HOOK_PASS}"))
}

/// Every secret, as it could appear.
fn secrets() -> Vec<String> {
    let mut s: Vec<String> = [
        EH_KEY,
        SB_KEY,
        BLOB_SIG,
        HOOK_PASS,
        HOOK_CODE,
        AUTHZ,
        SIGNING,
        OTLP_TOKEN,
        OTLP_PASS,
        MOVED_PASS,
        MOVED_SIG,
        CLIENT_SECRET,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    s.push(signing_b64());
    s.push(basic_b64());
    s
}

#[derive(Default)]
struct Receiver {
    refuse_handshake: AtomicBool,
    calls: Mutex<HashMap<String, u32>>,
    delivered: Mutex<Vec<String>>,
    /// Every `Authorization` value received.
    authorizations: Mutex<Vec<String>>,
    handshakes: Mutex<u32>,
}

async fn hook(
    State(r): State<Arc<Receiver>>,
    method: Method,
    headers: HeaderMap,
    body: String,
) -> Response {
    let auths: Vec<String> = headers
        .get_all("authorization")
        .iter()
        .filter_map(|v| v.to_str().ok().map(String::from))
        .collect();
    r.authorizations.lock().unwrap().extend(auths.clone());
    // A careless receiver that echoes the credentials it was sent.
    let echo = auths.join(", ");
    if method == Method::OPTIONS {
        *r.handshakes.lock().unwrap() += 1;
        if r.refuse_handshake.load(Ordering::SeqCst) {
            return (
                StatusCode::FORBIDDEN,
                format!("origin not allowed; you sent {echo}"),
            )
                .into_response();
        }
        return (StatusCode::OK, [("WebHook-Allowed-Origin", "*")], "").into_response();
    }
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
    if let Some(k) = body.strip_prefix("fail:") {
        if n <= k.parse().unwrap_or(0) {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{{\"error\":\"busy\",\"you_sent\":\"{echo}\"}}"),
            )
                .into_response();
        }
    }
    match body.as_str() {
        "perm" => (
            StatusCode::BAD_REQUEST,
            format!("rejected; you sent {echo}"),
        )
            .into_response(),
        "moved" => (
            StatusCode::TEMPORARY_REDIRECT,
            [(
                "Location",
                format!("http://mover:{MOVED_PASS}@127.0.0.1:1/new?sig={MOVED_SIG}"),
            )],
            "",
        )
            .into_response(),
        _ => {
            r.delivered.lock().unwrap().push(key);
            StatusCode::OK.into_response()
        }
    }
}

/// An OTLP/HTTP collector keeping the raw bodies (protobuf keeps strings as they are) and
/// the `Authorization` values it got.
#[derive(Default)]
struct Collector {
    bodies: Mutex<Vec<(String, Bytes)>>,
    authorizations: Mutex<Vec<String>>,
}

async fn collect(
    State(c): State<Arc<Collector>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Vec<u8> {
    if let Some(a) = headers.get("authorization").and_then(|v| v.to_str().ok()) {
        c.authorizations.lock().unwrap().push(a.to_string());
    }
    c.bodies
        .lock()
        .unwrap()
        .push((uri.path().to_string(), body));
    Vec::new() // an empty Export…ServiceResponse
}

fn drain(reader: impl AsyncRead + Unpin + Send + 'static, into: Arc<Mutex<String>>) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(reader).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            let mut s = into.lock().unwrap();
            s.push_str(&l);
            s.push('\n');
        }
    });
}

struct Replica {
    child: tokio::process::Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    status: String,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn hook_url(hook: std::net::SocketAddr) -> String {
    format!("http://hookuser:{HOOK_PASS}@{hook}/events?code={HOOK_CODE}")
}

fn config(
    bed: &Bed,
    container_url: &str,
    hook: std::net::SocketAddr,
    owner: &str,
    status: u16,
) -> String {
    format!(
        r#"
[eventhubs]
connection_string = "{eh}"
hub = "hub"
[servicebus]
connection_string = "{sb}"
[storage]
container_url = "{container_url}"
[dead_letters]
queue = "dead-letters"
[handler]
kind = "webhook"
url = "{url}"
timeout_ms = 2000
[handler.signing]
env = "SECRETS_TEST_SIGNING"
[handler.authorization]
env = "SECRETS_TEST_AUTHZ"
[handler.handshake]
enabled = true
origin = "hubguard.test"
retry_ms = 300
[breaker]
enabled = false
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
max_attempts = 5
[status]
listen = "127.0.0.1:{status}"
"#,
        eh = bed.eh.connection_string(),
        sb = bed.sb.connection_string(),
        url = hook_url(hook),
    )
}

/// `hubguard <args> --config <config>` with the secrets its configuration names.
fn command(args: &[&str], config: &std::path::Path) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"));
    c.args(args)
        .arg("--config")
        .arg(config)
        .env("SECRETS_TEST_SIGNING", format!("whsec_{}", signing_b64()))
        .env("SECRETS_TEST_AUTHZ", format!("Bearer {AUTHZ}"))
        .env("AZURE_CLIENT_SECRET", CLIENT_SECRET)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("HUBGUARD_LOG__FORMAT")
        .env_remove("RUST_LOG");
    c
}

fn spawn(mut cmd: tokio::process::Command, status: u16) -> Replica {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (stdout, stderr) = (Arc::default(), Arc::default());
    drain(child.stdout.take().unwrap(), Arc::clone(&stdout));
    drain(child.stderr.take().unwrap(), Arc::clone(&stderr));
    Replica {
        child,
        stdout,
        stderr,
        status: format!("127.0.0.1:{status}"),
    }
}

/// `hubguard <args> --config <config>`: its stdout and stderr.
async fn cli(config: &std::path::Path, args: &[&str]) -> String {
    let out = within("cli", command(args, config).output()).await.unwrap();
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

async fn get(addr: &str, path: &str) -> String {
    let (code, body) = http_get(addr, path).await;
    format!("{code} {body}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_credential_reaches_any_output() {
    // Emulators whose keys are the secrets.
    let eh = EventHubsEmulator::start(EventHubsConfig {
        hubs: vec![HubSpec::new("hub", 2)],
        key: SasKey::new("RootManageSharedAccessKey", EH_KEY),
        ..Default::default()
    })
    .await
    .unwrap();
    let sb = ServiceBusEmulator::start(ServiceBusConfig {
        queues: vec![QueueSpec::new("retries"), QueueSpec::new("dead-letters")],
        key: SasKey::new("RootManageSharedAccessKey", SB_KEY),
        ..Default::default()
    })
    .await
    .unwrap();
    let blob = BlobEmulator::start(BlobConfig::default()).await.unwrap();
    let cs = conn(&eh);
    let bed = Bed { eh, sb, blob, cs };
    let container_url = format!(
        "{}?sv=2022-11-02&sp=racwdl&sr=c&sig={BLOB_SIG}",
        bed.blob.container_url("hubguard")
    );

    let receiver = Arc::new(Receiver::default());
    receiver.refuse_handshake.store(true, Ordering::SeqCst);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_addr = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/events", any(hook))
        .with_state(receiver.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let collector = Arc::new(Collector::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/v1/traces", post(collect))
        .route("/v1/metrics", post(collect))
        .with_state(collector.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    let (status_a, status_b) = (free_port(), free_port());
    let config_a = dir.path().join("a.toml");
    std::fs::write(
        &config_a,
        config(&bed, &container_url, hook_addr, "replica-a", status_a),
    )
    .unwrap();
    // Replica b's file has a harmless URL; the secret one comes from the environment.
    let config_b = dir.path().join("b.toml");
    let harmless = config(&bed, &container_url, hook_addr, "replica-b", status_b)
        .replace(&hook_url(hook_addr), "http://127.0.0.1:1/not-this-one");
    std::fs::write(&config_b, harmless).unwrap();

    let otlp_env = |c: &mut tokio::process::Command, endpoint: String| {
        c.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
            .env("OTEL_METRIC_EXPORT_INTERVAL", "500")
            .env("OTEL_BSP_SCHEDULE_DELAY", "200");
    };
    let mut a_cmd = command(&["run"], &config_a);
    otlp_env(&mut a_cmd, format!("http://{otlp}"));
    a_cmd.env(
        "OTEL_EXPORTER_OTLP_HEADERS",
        format!("authorization=Bearer {OTLP_TOKEN}"),
    );
    let mut b_cmd = command(&["run"], &config_b);
    otlp_env(&mut b_cmd, format!("http://otlpuser:{OTLP_PASS}@{otlp}"));
    b_cmd
        .env("HUBGUARD_HANDLER__URL", hook_url(hook_addr))
        .env("HUBGUARD_LOG__FORMAT", "json");
    let mut ra = spawn(a_cmd, status_a);
    let mut rb = spawn(b_cmd, status_b);

    let keys = [
        "sec-ok",
        "sec-flaky",
        "sec-perm",
        "sec-moved",
        "sec-ok-2",
        "sec-flaky-2",
    ];
    bed.send(
        0,
        &[
            ("sec-ok", "ok"),
            ("sec-flaky", "fail:1"),
            ("sec-perm", "perm"),
            ("sec-moved", "moved"),
        ],
    )
    .await;
    bed.send(1, &[("sec-ok-2", "ok"), ("sec-flaky-2", "fail:2")])
        .await;

    // Both replicas start (the status listener is up once this line is printed).
    for r in [&ra, &rb] {
        eventually("replica starts", STEP, || async {
            r.stdout.lock().unwrap().contains("consuming hub")
        })
        .await;
    }

    // Outputs collected along the way, named for the report.
    let mut outputs: Vec<(String, String)> = Vec::new();

    // The handshake is refused: both replicas hold and say why (the reason names the URL).
    for r in [&ra, &rb] {
        let s = r.status.clone();
        let (_, body) = eventually("readiness names the refused handshake", STEP, || async {
            seen(http_get(&s, "/readyz").await, |(code, body)| {
                *code == 503 && body.contains("has not agreed")
            })
        })
        .await;
        assert!(body.contains(&hook_addr.to_string()), "{body}");
        outputs.push((format!("{s} /readyz (handshake refused)"), body));
        outputs.push((
            format!("{s} /v1/status (handshake refused)"),
            get(&s, "/v1/status").await,
        ));
    }
    // A failed attempt is recorded with the handshake's reason.
    eventually(
        "a retry recorded with the handshake's reason",
        STEP,
        || async {
            seen(
                http_get(&ra.status, "/v1/events/sec-ok").await,
                |(code, body)| *code == 200 && body.contains("has not agreed"),
            )
        },
    )
    .await;
    outputs.push((
        "/v1/retries (handshake refused)".into(),
        get(&ra.status, "/v1/retries").await,
    ));
    // Blob storage (with its SAS) answers 503 for a while: what is held names the container.
    bed.blob
        .faults()
        .error_status_for(503, Duration::from_secs(60));
    let (_, body) = eventually("readiness names the storage outage", STEP, || async {
        seen(http_get(&ra.status, "/readyz").await, |(code, body)| {
            *code == 503 && body.contains("blob storage is unavailable")
        })
    })
    .await;
    assert!(body.contains("devstoreaccount1/hubguard"), "{body}");
    outputs.push(("/readyz (blob storage down)".into(), body));
    outputs.push((
        "/v1/status (blob storage down)".into(),
        get(&ra.status, "/v1/status").await,
    ));
    bed.blob.faults().clear();
    receiver.refuse_handshake.store(false, Ordering::SeqCst);

    // Delivered, dead-lettered for good (400) and after its attempts (a redirect each time).
    let settled = |body: &str, state: &str| body.contains(&format!("\"state\":\"{state}\""));
    Wait::new("every event settles", STEP)
        .every(Duration::from_millis(200))
        .until(|| async {
            let mut unsettled = Vec::new();
            for (k, state) in [
                ("sec-ok", "DELIVERED"),
                ("sec-flaky", "DELIVERED"),
                ("sec-ok-2", "DELIVERED"),
                ("sec-flaky-2", "DELIVERED"),
                ("sec-perm", "DEAD_LETTERED"),
                ("sec-moved", "DEAD_LETTERED"),
            ] {
                let (_, body) = http_get(&ra.status, &format!("/v1/events/{k}")).await;
                if !settled(&body, state) {
                    unsettled.push(k);
                }
            }
            if unsettled.is_empty() {
                Ok(())
            } else {
                Err(unsettled)
            }
        })
        .await;

    for r in [&ra, &rb] {
        let s = &r.status;
        for path in ["/readyz", "/v1/status", "/v1/retries", "/metrics"] {
            outputs.push((format!("{s} {path}"), get(s, path).await));
        }
        for k in keys {
            outputs.push((
                format!("{s} /v1/events/{k}"),
                get(s, &format!("/v1/events/{k}")).await,
            ));
        }
    }
    for args in [
        &["status", "sec-moved"][..],
        &["status", "sec-perm", "--json"],
        &["status", "sec-flaky"],
        &["retries", "list"],
        &["dead-letters", "list"],
        &["dead-letters", "list", "--json"],
    ] {
        outputs.push((
            format!("hubguard {}", args.join(" ")),
            cli(&config_a, args).await,
        ));
    }

    // SIGTERM: a clean stop (final checkpoints, telemetry flushed).
    for r in [&mut ra, &mut rb] {
        let pid = r.child.id().unwrap().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        within("replica exits", r.child.wait()).await.unwrap();
    }
    // The pipes close with the process; give the drains a moment to read the last lines.
    eventually("logs drained", STEP, || async {
        ra.stdout.lock().unwrap().contains("stopped")
            && rb.stdout.lock().unwrap().contains("stopped")
    })
    .await;
    let logs_a = ra.stderr.lock().unwrap().clone();
    let logs_b = rb.stderr.lock().unwrap().clone();
    outputs.push(("replica a logs (text)".into(), logs_a.clone()));
    outputs.push(("replica b logs (JSON)".into(), logs_b.clone()));
    outputs.push(("replica a stdout".into(), ra.stdout.lock().unwrap().clone()));
    outputs.push(("replica b stdout".into(), rb.stdout.lock().unwrap().clone()));

    // Every blob: the ledger records (bodies and metadata), checkpoints, ownership.
    let store = bed.blob.store();
    let mut ledger_errors = 0;
    for c in store.container_names() {
        let (blobs, _) = store.list(&c, "", None, 100_000).unwrap();
        for (name, b) in blobs {
            let body = String::from_utf8_lossy(&b.content).to_string();
            ledger_errors +=
                usize::from(body.contains("\"last_error\":\"") && name.contains("ledger"));
            outputs.push((
                format!("blob {c}/{name}"),
                format!("{name} {body} {:?}", b.metadata),
            ));
        }
    }
    // Every message left on Service Bus: the dead letters, anything in a queue.
    let mut dead_letters = Vec::new();
    for q in ["retries", "dead-letters"] {
        for entity in [Entity::Main, Entity::DeadLetter] {
            for m in bed.sb.queue(q).unwrap().messages(entity) {
                let text = format!("{m:?} {}", String::from_utf8_lossy(&m.body));
                if q == "dead-letters" && m.label.as_deref() != Some("hubguard.dead_letter.probe") {
                    dead_letters.push(text.clone());
                }
                outputs.push((format!("Service Bus {q} {entity:?} {}", m.message_id), text));
            }
        }
    }
    // What was exported: spans (attributes, events) and metrics.
    let exported: Vec<(String, Bytes)> = collector.bodies.lock().unwrap().clone();
    for (path, body) in &exported {
        outputs.push((
            format!("OTLP {path}"),
            String::from_utf8_lossy(body).to_string(),
        ));
    }

    // The run did what it should, so the search below searches something.
    let auths = receiver.authorizations.lock().unwrap().clone();
    assert!(
        auths.iter().any(|a| a == &format!("Bearer {AUTHZ}")),
        "{auths:?}"
    );
    assert!(
        auths.iter().any(|a| a == &format!("Basic {}", basic_b64())),
        "the URL's userinfo is used: {auths:?}"
    );
    assert!(logs_a.contains("webhook agreed to receive"), "{logs_a}");
    assert!(
        logs_b.contains("webhook agreed to receive") && logs_b.starts_with('{'),
        "{logs_b}"
    );
    assert!(
        ledger_errors >= 4,
        "ledger records with errors: {ledger_errors}"
    );
    assert!(
        dead_letters.len() >= 2 && dead_letters.iter().any(|m| m.contains("redirect")),
        "{dead_letters:?}"
    );
    assert!(
        exported.iter().any(|(p, b)| p == "/v1/traces"
            && String::from_utf8_lossy(b).contains("hubguard.error.message")),
        "spans with errors were exported"
    );
    assert!(
        collector
            .authorizations
            .lock()
            .unwrap()
            .iter()
            .any(|a| a.contains(OTLP_TOKEN)),
        "the OTLP headers are used"
    );

    let mut leaks = Vec::new();
    for (what, text) in &outputs {
        for s in secrets() {
            if let Some(i) = text.find(&s) {
                let from = text[..i].char_indices().rev().nth(80).map_or(0, |(j, _)| j);
                let to = (i + s.len() + 40).min(text.len());
                let to = (to..=text.len())
                    .find(|&j| text.is_char_boundary(j))
                    .unwrap_or(text.len());
                leaks.push(format!("{s} in {what}: …{}…", &text[from..to]));
            }
        }
    }
    assert!(
        leaks.is_empty(),
        "{} leak(s):\n{}",
        leaks.len(),
        leaks.join("\n")
    );
}

/// Where a configuration can carry a secret by mistake: a password in a connection string's
/// endpoint or a container URL (from the file or a `HUBGUARD_*` override), a URL in a key of
/// another type. Each stops start-up naming the key, and no error quotes the secret.
#[test]
fn a_refused_configuration_never_quotes_a_secret() {
    let dir = tempfile::tempdir().unwrap();
    let base = |eh: &str, container: &str, extra: &str| {
        format!(
            "[eventhubs]\nconnection_string = \"{eh}\"\nhub = \"h\"\n[servicebus]\nconnection_string = \"Endpoint=sb://127.0.0.1:1;SharedAccessKeyName=k;SharedAccessKey={SB_KEY}\"\n[storage]\ncontainer_url = \"{container}\"\n[handler]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:1/\"\n{extra}"
        )
    };
    let good_eh =
        format!("Endpoint=sb://127.0.0.1:1;SharedAccessKeyName=k;SharedAccessKey={EH_KEY}");
    let good_container = "http://127.0.0.1:1/devstoreaccount1/c";
    // (the key the error must name, the file, the environment)
    type Case<'a> = (&'a str, String, Vec<(&'a str, String)>);
    let cases: Vec<Case> = vec![
        (
            "eventhubs.connection_string",
            base(
                &format!("Endpoint=sb://user:{HOOK_PASS}@127.0.0.1:1;SharedAccessKeyName=k;SharedAccessKey={EH_KEY}"),
                good_container,
                "",
            ),
            vec![],
        ),
        (
            "storage.container_url",
            base(&good_eh, &format!("http://user:{HOOK_PASS}@127.0.0.1:1/devstoreaccount1/c?sig={BLOB_SIG}"), ""),
            vec![],
        ),
        (
            "servicebus.namespace",
            base(&good_eh, good_container, "")
                .replace(
                    &format!("connection_string = \"Endpoint=sb://127.0.0.1:1;SharedAccessKeyName=k;SharedAccessKey={SB_KEY}\""),
                    &format!("namespace = \"http://user:{HOOK_PASS}@127.0.0.1:1\"\ncredential = \"developer_tools\""),
                ),
            vec![],
        ),
        (
            "eventhubs.namespace",
            base(&good_eh, good_container, "").replace(
                &format!("connection_string = \"{good_eh}\""),
                &format!("namespace = \"user:{HOOK_PASS}@ns.servicebus.windows.net\"\ncredential = \"developer_tools\""),
            ),
            vec![],
        ),
        (
            // Validation names the key (the override wrote it).
            "storage.container_url",
            base(&good_eh, good_container, ""),
            vec![(
                "HUBGUARD_STORAGE__CONTAINER_URL",
                format!("http://user:{HOOK_PASS}@127.0.0.1:1/devstoreaccount1/c"),
            )],
        ),
        (
            "HUBGUARD_HANDLER__TIMEOUT_MS",
            base(&good_eh, good_container, ""),
            vec![(
                "HUBGUARD_HANDLER__TIMEOUT_MS",
                format!("\"http://user:{HOOK_PASS}@h/?sig={BLOB_SIG}\""),
            )],
        ),
    ];
    for (key, text, env) in cases {
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        for format in ["text", "json"] {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
                .args(["run", "--config"])
                .arg(&path)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .env("HUBGUARD_LOG__FORMAT", format)
                .output()
                .unwrap();
            assert!(!out.status.success(), "{key}");
            let all = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(all.contains(key), "{key}: {all}");
            for s in secrets() {
                assert!(!all.contains(&s), "{key} ({format}): {s} in {all}");
            }
        }
    }
}
