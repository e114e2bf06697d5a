//! The webhook as receivers expect it (issue 16): the CloudEvents HTTP binding read by the
//! official CloudEvents SDK, Standard Webhooks signatures verified by the reference library
//! (both Python, run when installed; `.ci/run` installs them and sets
//! `HUBGUARD_REQUIRE_INTEROP=1`), the abuse-protection handshake gating delivery with the
//! reason in readiness, credentials that never leak, errors support staff can act on, and
//! the dead-letter destination.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use base64::Engine as _;
use hubguard::azure::{
    ConnectionString, OutgoingMessage, ReceivedMessage, RetryQueue, RetryQueueError,
    ServiceBusRetryQueue,
};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use hubguard::emulator::webhook::{HandshakeAnswer, WebhookReceiver};
use hubguard::event::{Event, Identity};
use hubguard::handler::cloudevents::ContentMode;
use hubguard::handler::handshake::HandshakeConfig;
use hubguard::handler::secret::SecretSource;
use hubguard::handler::webhook::{TlsConfig, WebhookConfig, WebhookHandler};
use hubguard::handler::{Attempt, Handler, Outcome};
use hubguard::ledger::State;
use hubguard::pipeline::dead_letter::DeadLetterDestination;
use hubguard::pipeline::settle::{Policies, Settler};
use hubguard::policy::classify::ErrorClass;

use crate::common::{eventually, within};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);
const OLD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NEW_SECRET: &str = "whsec_c2Vjb25kLXNlY3JldC1rZXktMTIzNDU2Nzg5MA==";

fn attempt(n: u32) -> Attempt {
    Attempt {
        number: n,
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        last: false,
    }
}

fn event(key: &str, props: &[(&str, &str)], body: &[u8], content_type: Option<&str>) -> Event {
    Event {
        body: body.to_vec(),
        content_type: content_type.map(String::from),
        properties: props
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        hub: "hub".into(),
        partition_id: "0".into(),
        sequence_number: 7,
        offset: None,
        enqueued_ms: None,
        partition_key: None,
        identity: Identity {
            idempotency_key: key.into(),
            correlation_id: format!("corr-{key}"),
            event_type: props
                .iter()
                .find(|(k, _)| *k == "ce_type")
                .map(|(_, v)| v.to_string()),
        },
    }
}

fn python_libraries_available() -> bool {
    std::process::Command::new("python3")
        .args([
            "-c",
            "import cloudevents.core.bindings.http, standardwebhooks",
        ])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Runs the Python script on the recorded requests: one JSON value per request.
async fn parse_with_python(
    requests: &[hubguard::emulator::webhook::Recorded],
    secrets: &[&str],
) -> Option<Vec<serde_json::Value>> {
    if !python_libraries_available() {
        assert!(
            std::env::var("HUBGUARD_REQUIRE_INTEROP").is_err(),
            "HUBGUARD_REQUIRE_INTEROP is set but the Python libraries are missing (pip install cloudevents==2.2.0 standardwebhooks==1.1.0)"
        );
        eprintln!(
            "skipped the Python checks: pip install cloudevents==2.2.0 standardwebhooks==1.1.0"
        );
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.json");
    let json: Vec<serde_json::Value> = requests
        .iter()
        .map(|r| {
            let headers: serde_json::Map<String, serde_json::Value> = r
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect();
            serde_json::json!({
                "headers": headers,
                "body_b64": base64::engine::general_purpose::STANDARD.encode(&r.body),
            })
        })
        .collect();
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/interop/python_webhook_conventions.py"
    );
    let run = tokio::process::Command::new("python3")
        .arg(script)
        .arg(&path)
        .args(secrets)
        .kill_on_drop(true)
        .output();
    let out = within("python parses", run).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("PYTHON WEBHOOK CONVENTIONS OK"),
        "python failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(
        stdout
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_parse_with_the_official_sdk_and_signatures_verify_with_standard_webhooks() {
    let receiver = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    receiver.record_requests();
    let dir = tempfile::tempdir().unwrap();
    // Two secrets active at once (a rotation): from a file, never from the configuration.
    let secrets = dir.path().join("webhook-secrets");
    std::fs::write(&secrets, format!("{OLD_SECRET}\n{NEW_SECRET}\n")).unwrap();
    let handler = |mode| {
        WebhookHandler::new(WebhookConfig {
            content_mode: mode,
            signing: Some(SecretSource::file(&secrets)),
            ..WebhookConfig::new(receiver.url())
        })
        .unwrap()
    };
    let ce = event(
        "/orders|order-42",
        &[
            ("ce_id", "order-42"),
            ("ce_source", "/orders"),
            ("ce_specversion", "1.0"),
            ("ce_type", "order.created"),
            ("ce_subject", "customer 7 \"vip\" 100% é"),
            ("ce_time", "2024-05-01T12:00:00Z"),
            ("ce_dataschema", "https://schemas.example/order.json"),
            ("ce_datacontenttype", "application/json"),
            ("ce_tenant", "contoso"),
            ("unrelated", "not an attribute"),
        ],
        br#"{"order":42}"#,
        None,
    );
    // The AMQP binding's spelling, a binary body, no specversion (1.0 is sent).
    let amqp = event(
        "bin-1",
        &[
            ("cloudEvents:id", "bin-1"),
            ("cloudEvents:source", "/sensors"),
            ("cloudEvents:type", "reading"),
        ],
        &[0, 159, 146, 150, 255],
        Some("application/octet-stream"),
    );
    let plain = event("plain-1", &[], b"just bytes", Some("text/plain"));
    let binary = handler(ContentMode::Binary);
    let structured = handler(ContentMode::Structured);
    for (h, e) in [
        (&binary, &ce),
        (&binary, &amqp),
        (&binary, &plain),
        (&structured, &ce),
        (&structured, &amqp),
    ] {
        assert_eq!(
            within("deliver", h.handle(e, &attempt(1))).await,
            Outcome::Delivered
        );
    }
    let requests = receiver.requests();
    assert_eq!(requests.len(), 5);
    // Binary mode on the wire: ce-* headers, datacontenttype as Content-Type.
    let r0 = &requests[0];
    assert_eq!(r0.header("ce-id"), Some("order-42"));
    assert_eq!(r0.header("ce-tenant"), Some("contoso"));
    assert_eq!(r0.header("content-type"), Some("application/json"));
    assert_eq!(r0.body, br#"{"order":42}"#);
    assert!(r0.header("ce-unrelated").is_none() && r0.header("ce-datacontenttype").is_none());
    // An event without CloudEvents attributes goes out as before.
    let r2 = &requests[2];
    assert!(
        r2.headers.iter().all(|(n, _)| !n.starts_with("ce-")),
        "{r2:?}"
    );
    assert_eq!(r2.header("content-type"), Some("text/plain"));
    assert_eq!(r2.body, b"just bytes");
    // Standard Webhooks headers: the id is the idempotency key (percent-encoded), stable.
    assert_eq!(r0.header("webhook-id"), Some("/orders|order-42"));
    assert_eq!(
        r0.header("webhook-signature").unwrap().split(' ').count(),
        2,
        "one signature per active secret"
    );
    assert!(r0
        .header("webhook-timestamp")
        .unwrap()
        .parse::<i64>()
        .is_ok());

    let Some(parsed) = parse_with_python(&requests, &[OLD_SECRET, NEW_SECRET]).await else {
        return;
    };
    assert_eq!(parsed.len(), 5);
    for p in &parsed {
        // The reference library reads the body as UTF-8; the script checks the other bodies
        // by the specification's own recipe (HMAC-SHA256 over the raw bytes).
        let verified = if p["index"] == 1 {
            &p["verified_raw"]
        } else {
            &p["verified"]
        };
        assert_eq!(
            verified,
            &serde_json::json!([true, true]),
            "each secret verifies every request: {p}"
        );
    }
    for i in [0, 3] {
        let ce = &parsed[i]["cloudevent"];
        assert_eq!(ce["id"], "order-42", "{}", parsed[i]);
        assert_eq!(ce["source"], "/orders");
        assert_eq!(ce["type"], "order.created");
        assert_eq!(ce["specversion"], "1.0");
        assert_eq!(
            ce["subject"], "customer 7 \"vip\" 100% é",
            "decoded exactly"
        );
        assert_eq!(ce["dataschema"], "https://schemas.example/order.json");
        assert_eq!(ce["tenant"], "contoso");
        assert!(ce["time"]
            .as_str()
            .unwrap()
            .starts_with("2024-05-01T12:00:00"));
        assert_eq!(ce["datacontenttype"], "application/json");
        assert_eq!(parsed[i]["data"], serde_json::json!({"order": 42}));
    }
    for i in [1, 4] {
        let ce = &parsed[i]["cloudevent"];
        assert_eq!(
            (ce["id"].as_str(), ce["specversion"].as_str()),
            (Some("bin-1"), Some("1.0")),
            "{}",
            parsed[i]
        );
        assert_eq!(
            parsed[i]["data"]["bytes_b64"],
            base64::engine::general_purpose::STANDARD.encode([0u8, 159, 146, 150, 255]),
            "{}",
            parsed[i]
        );
    }
    assert!(parsed[2].get("cloudevent").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handshake_gates_delivery_and_readiness_names_the_reason() {
    let bed = Bed::start(1).await;
    let receiver = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    receiver.set_handshake(HandshakeAnswer::Refuse);
    let handler = Arc::new(
        WebhookHandler::new(WebhookConfig {
            timeout_ms: 2000,
            handshake: HandshakeConfig {
                enabled: true,
                origin: "hubguard.example".into(),
                retry_ms: 200,
            },
            ..WebhookConfig::new(receiver.url())
        })
        .unwrap(),
    );
    let run = Bed::run(bed.parts(handler, fast_policy(30), "replica-handshake"));
    bed.send(0, &[("hs-1", "ok")]).await;
    wait_for(
        "readiness names the handshake",
        &run.health,
        LIMIT,
        || async {
            run.health.report()["held_partitions"]
                .as_object()
                .is_some_and(|h| {
                    h.iter().any(|(k, v)| {
                        k.starts_with("handler")
                            && v["reason"].as_str().is_some_and(|r| {
                                r.contains("abuse-protection handshake") && r.contains("403")
                            })
                    })
                })
        },
    )
    .await;
    assert!(!run.health.ready());
    assert!(
        receiver.calls().is_empty(),
        "nothing delivered before the endpoint agreed"
    );
    assert!(receiver
        .handshakes()
        .iter()
        .all(|o| o == "hubguard.example"));
    // The endpoint agrees: the event arrives, readiness clears.
    receiver.set_handshake(HandshakeAnswer::Allow { rate: None });
    wait_for("delivered once agreed", &run.health, LIMIT, || async {
        receiver.deliveries().contains_key("hs-1")
            && !run.health.report()["held_partitions"]
                .as_object()
                .is_some_and(|h| h.keys().any(|k| k.starts_with("handler")))
    })
    .await;
    run.stop().await;

    // WebHook-Allowed-Rate is honoured: 600 a minute is one request per 100 ms.
    let paced = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    paced.set_handshake(HandshakeAnswer::Allow { rate: Some(600) });
    let h = WebhookHandler::new(WebhookConfig {
        handshake: HandshakeConfig {
            enabled: true,
            ..Default::default()
        },
        ..WebhookConfig::new(paced.url())
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    for i in 0..5 {
        let e = event(&format!("paced-{i}"), &[], b"x", None);
        assert_eq!(h.handle(&e, &attempt(1)).await, Outcome::Delivered);
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "5 requests at 600/min take at least 400 ms, took {:?}",
        t0.elapsed()
    );
    assert_eq!(paced.handshakes().len(), 1, "one handshake per endpoint");
}

/// A receiver that wants `Authorization: Bearer {token}` and otherwise answers 401; with the
/// right token it answers 503 with `Retry-After: 7` and a long, dirty body.
async fn demanding(token: &'static str) -> String {
    let app = axum::Router::new().fallback(move |headers: HeaderMap| async move {
        if headers.get("authorization").and_then(|v| v.to_str().ok())
            != Some(&format!("Bearer {token}"))
        {
            return (StatusCode::UNAUTHORIZED, "who are you?").into_response();
        }
        let mut body = b"{\"error\":\"overloaded\",\x1b[31m\"detail\":\"".to_vec();
        body.extend([0xff, 0xfe]);
        body.extend(std::iter::repeat_n(b'x', 2000));
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [("retry-after", "7")],
            body,
        )
            .into_response()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/hook")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_never_leak_and_errors_keep_status_body_and_retry_after() {
    const TOKEN: &str = "TOPSECRET-token-4711";
    let url = demanding(TOKEN).await;
    // Not HUBGUARD_*: those are configuration overrides (and the test binary shares its
    // environment with the `hubguard run` it starts).
    let var = "WEBHOOK_CONVENTIONS_TEST_AUTHORIZATION";
    std::env::set_var(var, format!("Bearer {TOKEN}"));
    let handler = WebhookHandler::new(WebhookConfig {
        authorization: Some(SecretSource::env(var)),
        ..WebhookConfig::new(url.clone())
    })
    .unwrap();
    let Outcome::Failed(f) = handler
        .handle(&event("k-1", &[], b"{}", None), &attempt(1))
        .await
    else {
        panic!("a 503 is not a delivery");
    };
    assert_eq!(f.class, ErrorClass::Transient);
    assert_eq!(f.http_status, Some(503));
    assert_eq!(f.retry_after, Some(Duration::from_secs(7)));
    assert!(
        f.error.starts_with(
            "HTTP 503 from the webhook; Retry-After: 7; body: {\"error\":\"overloaded\""
        ),
        "{}",
        f.error
    );
    assert!(
        !f.error.chars().any(char::is_control),
        "sanitised: {:?}",
        f.error
    );
    assert!(
        f.error.contains('\u{fffd}'),
        "invalid UTF-8 replaced: {}",
        f.error
    );
    assert!(
        f.error.len() < 400,
        "only the start of the body: {}",
        f.error.len()
    );
    for text in [f.error.clone(), format!("{handler:?}"), format!("{f:?}")] {
        assert!(!text.contains(TOKEN), "the credential leaked: {text}");
    }
    // Without the credential the receiver says so, and that is what the error keeps.
    let anonymous = WebhookHandler::new(WebhookConfig::new(url.clone())).unwrap();
    let Outcome::Failed(f) = anonymous
        .handle(&event("k-2", &[], b"{}", None), &attempt(1))
        .await
    else {
        panic!("401 is not a delivery");
    };
    assert_eq!(f.error, "HTTP 401 from the webhook; body: who are you?");
    assert_eq!(f.class, ErrorClass::Permanent);

    // Credential files that are missing or wrong: errors name the key and the file only.
    let dir = tempfile::tempdir().unwrap();
    let e = WebhookHandler::new(WebhookConfig {
        authorization: Some(SecretSource::file(dir.path().join("absent"))),
        ..WebhookConfig::new(url.clone())
    })
    .unwrap_err();
    assert_eq!(e.key(), "handler.authorization");
    let e = e.to_string();
    assert!(
        e.contains("handler.authorization") && e.contains("absent"),
        "{e}"
    );
    let (cert, key) = (dir.path().join("client.crt"), dir.path().join("client.key"));
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nTOPSECRETPEM\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(
        &key,
        "-----BEGIN PRIVATE KEY-----\nTOPSECRETPEM\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let tls = TlsConfig {
        client_cert_file: cert.clone(),
        client_key_file: key.clone(),
    };
    let e = WebhookHandler::new(WebhookConfig {
        tls: Some(tls.clone()),
        ..WebhookConfig::new(url.clone())
    })
    .unwrap_err();
    assert_eq!(e.key(), "handler.tls");
    let e = e.to_string();
    assert!(e.contains("handler.tls") && !e.contains("TOPSECRET"), "{e}");
    // A real certificate and key (made by openssl, when it is installed) build a client.
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=hubguard-client",
            "-keyout",
        ])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output();
    if made.is_ok_and(|o| o.status.success()) {
        let h = WebhookHandler::new(WebhookConfig {
            tls: Some(tls),
            ..WebhookConfig::new(url)
        })
        .unwrap();
        let key_text = std::fs::read_to_string(&key).unwrap();
        let secret_line = key_text.lines().nth(1).unwrap();
        assert!(!format!("{h:?}").contains(secret_line));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempts_details_show_in_status_and_on_the_span() {
    let t = crate::otlp::telemetry();
    let bed = Bed::start(1).await;
    // 400 with a body: permanent, dead-lettered; the ledger keeps the details.
    let app = axum::Router::new().fallback(|| async {
        (
            StatusCode::BAD_REQUEST,
            [("retry-after", "3")],
            "{\"error\":\"order 42 has no customer\"}\n",
        )
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let handler =
        Arc::new(WebhookHandler::new(WebhookConfig::new(format!("http://{addr}/hook"))).unwrap());
    let run = Bed::run(bed.parts(handler, fast_policy(3), "replica-errors"));
    bed.send(0, &[("err-1", "x")]).await;
    let ledger = bed.ledger();
    wait_for("dead-lettered", &run.health, LIMIT, || async {
        matches!(ledger.record("err-1").await, Ok(Some(r)) if r.state() == State::DeadLettered)
    })
    .await;
    run.stop().await;
    let rec = ledger.record("err-1").await.unwrap().unwrap();
    let expected =
        "HTTP 400 from the webhook; Retry-After: 3; body: {\"error\":\"order 42 has no customer\"}";
    assert_eq!(rec.last_error.as_deref(), Some(expected));
    assert_eq!(rec.history.last().unwrap().error.as_deref(), Some(expected));
    let text = hubguard::status::record_text(&rec);
    assert!(text.contains(expected), "{text}");

    use hubguard::telemetry::names::attr;
    let s = eventually("the attempt span", LIMIT, || async {
        t.flush().await;
        let spans = t.collected.lock().unwrap().spans.clone();
        let found = spans.iter().find(|s| {
            s.name == hubguard::telemetry::names::span::ATTEMPT
                && s.attributes.get(attr::ERROR_MESSAGE).map(String::as_str) == Some(expected)
        });
        found.cloned().ok_or(spans.len())
    })
    .await;
    assert_eq!(s.attributes[attr::HTTP_STATUS], "400");
    assert_eq!(s.attributes[attr::RETRY_AFTER], "3");
}

/// A queue that refuses while `down` is set (Service Bus unavailable), else passes through.
struct Switchable {
    inner: ServiceBusRetryQueue,
    down: AtomicBool,
}

#[async_trait]
impl RetryQueue for Switchable {
    async fn schedule(&self, message: OutgoingMessage) -> Result<(), RetryQueueError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(RetryQueueError::Unavailable {
                status: 503,
                detail: "switched off by the test".into(),
            });
        }
        self.inner.schedule(message).await
    }
    async fn receive(&self, wait: Duration) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        self.inner.receive(wait).await
    }
}

fn sb_queue(sb: &ServiceBusEmulator, name: &str) -> ServiceBusRetryQueue {
    let cs: ConnectionString = sb.connection_string().parse().unwrap();
    ServiceBusRetryQueue::new(
        &cs,
        name,
        hubguard::azure::retry_queue::ServiceBusOptions {
            deadline: Duration::from_secs(3),
        },
    )
    .unwrap()
}

async fn receive_all(q: &ServiceBusRetryQueue, n: usize) -> Vec<ReceivedMessage> {
    let mut out = Vec::new();
    within("dead letters arrive", async {
        while out.len() < n {
            if let Some(m) = q.receive(Duration::from_millis(500)).await.unwrap() {
                // The start-up probe (it lives a second) is not a dead letter.
                if m.label.as_deref() != Some(hubguard::pipeline::dead_letter::PROBE_LABEL) {
                    out.push(m);
                }
            }
        }
    })
    .await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_go_to_the_destination_before_the_ledger_and_large_bodies_as_claim_checks() {
    let mut bed = Bed::start(1).await;
    bed.sb = ServiceBusEmulator::start(ServiceBusConfig {
        queues: vec![QueueSpec::new("retries"), QueueSpec::new("dead-letters")],
        ..Default::default()
    })
    .await
    .unwrap();
    let destination = Arc::new(Switchable {
        inner: sb_queue(&bed.sb, "dead-letters"),
        down: AtomicBool::new(false),
    });
    let dl = Arc::new(DeadLetterDestination::new(
        destination.clone(),
        "dead-letters",
        256,
    ));
    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-dlq");
    parts.options.dead_letters = Some(dl.clone());
    let run = Bed::run(parts);
    let ledger = bed.ledger();
    // The start-up proof has passed once the retry loop runs.
    wait_for("started", &run.health, LIMIT, || async {
        run.health.retry_loop() == hubguard::pipeline::health::RetryLoopState::Running
    })
    .await;

    // While the destination is down, the dead letter waits: the ledger does not record it and
    // the partition is held, with the destination named.
    destination.down.store(true, Ordering::SeqCst);
    bed.send(0, &[("dl-perm", "perm")]).await;
    wait_for("held on the destination", &run.health, LIMIT, || async {
        run.health.report()["held_partitions"]["0"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("dead-letter destination") && r.contains("dead-letters"))
    })
    .await;
    let rec = ledger.record("dl-perm").await.unwrap();
    assert!(
        rec.as_ref()
            .is_none_or(|r| r.state() != State::DeadLettered),
        "the ledger must not mark it dead-lettered before it is published"
    );
    destination.down.store(false, Ordering::SeqCst);
    // A body over Service Bus Standard's 256 KB goes as a claim check.
    let big = format!("perm#{}", "p".repeat(300 * 1024));
    bed.send_one(0, "dl-big", &big).await;
    wait_for("both dead-lettered", &run.health, LIMIT, || async {
        let keys = ledger.dead_letter_keys().await.unwrap_or_default();
        keys.contains(&"dl-perm".to_string()) && keys.contains(&"dl-big".to_string())
    })
    .await;

    let q = sb_queue(&bed.sb, "dead-letters");
    let mut got: HashMap<String, ReceivedMessage> = receive_all(&q, 2)
        .await
        .into_iter()
        .map(|m| (m.message_id.clone(), m))
        .collect();
    let m = got
        .remove("dl-perm-deadletter-1")
        .expect("MessageId from the key and the attempts");
    assert_eq!(m.body, "perm");
    assert_eq!(m.correlation_id.as_deref(), Some("dl-perm"));
    assert_eq!(m.properties["hubguard-dead-letter-reason"], "permanent");
    assert_eq!(
        m.properties["hubguard-last-error"],
        "scripted permanent failure"
    );
    assert_eq!(m.properties["hubguard-attempts"], "1");
    assert_eq!(m.properties["hubguard-correlation-id"], "dl-perm");
    assert_eq!(
        m.properties["ce_id"], "dl-perm",
        "the event's own properties"
    );
    assert_eq!(m.properties["ce_type"], "test.event");
    let big_msg = got.remove("dl-big-deadletter-1").unwrap();
    assert_eq!(big_msg.body, "");
    assert_eq!(big_msg.properties["hubguard-body"], "omitted");
    assert_eq!(
        big_msg.properties["hubguard-body-bytes"],
        big.len().to_string()
    );
    assert!(big_msg.properties["hubguard-claim-check"].contains("hubguard status dl-big"));
    // The claim check's pointer: the ledger keeps the whole event.
    let rec = ledger.record("dl-big").await.unwrap().unwrap();
    assert_eq!(rec.event.body.len(), big.len());

    // Publishing again (a crash before the ledger write, then a replay) is harmless: same
    // MessageId, dropped by duplicate detection.
    let rec = ledger.record("dl-perm").await.unwrap().unwrap();
    dl.publish(&rec).await.unwrap();
    assert!(q
        .receive(Duration::from_millis(300))
        .await
        .unwrap()
        .is_none());

    // `dead-letters replay` keeps working: the event runs again, fails again, and its second
    // dead letter is a new message.
    let settler = Settler::new(
        ledger.clone(),
        Arc::new(sb_queue(&bed.sb, "retries").with_clock(bed.clock())),
        Policies {
            default: fast_policy(5),
            by_type: Default::default(),
        },
    );
    assert_eq!(settler.replay("dl-perm").await.unwrap(), Some(2));
    let again = receive_all(&q, 1).await;
    assert_eq!(again[0].message_id, "dl-perm-deadletter-2");
    assert_eq!(again[0].properties["hubguard-attempts"], "2");
    assert_eq!(handler.calls_of("dl-perm"), vec![1, 2]);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_to_start_without_a_writable_dead_letter_destination() {
    let bed = Bed::start(1).await;
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
url = "http://127.0.0.1:9/events"
[status]
listen = "127.0.0.1:0"
[dead_letters]
queue = "no-such-queue"
"#,
            eh = bed.eh.connection_string(),
            sb = bed.sb.connection_string(),
            blob = bed.blob.container_url("hubguard"),
        ),
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["run", "--config"])
        .arg(&config)
        .kill_on_drop(true)
        .output();
    let out = within("run gives up", out).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("no-such-queue") && stderr.contains("does not exist"),
        "{stderr}"
    );
    assert!(!stderr.contains("SAS_KEY_VALUE"), "{stderr}");
    // Nothing was consumed: no checkpoint.
    assert_eq!(bed.checkpoint_of("0").await, None);
}

#[test]
fn the_configuration_names_where_secrets_are_and_checks_the_destination() {
    let dir = tempfile::tempdir().unwrap();
    let (secrets, token) = (dir.path().join("secrets"), dir.path().join("token"));
    std::fs::write(&secrets, format!("{OLD_SECRET} {NEW_SECRET}")).unwrap();
    std::fs::write(&token, "Bearer TOPSECRET-token").unwrap();
    let base = r#"
[eventhubs]
connection_string = "Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
hub = "hub"
[servicebus]
connection_string = "Endpoint=sb://127.0.0.1:5380;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
[storage]
container_url = "http://127.0.0.1:10000/devstoreaccount1/hubguard"
[handler]
kind = "webhook"
url = "http://127.0.0.1:9000/events"
content_mode = "structured"
[handler.signing]
file = "SECRETS"
[handler.authorization]
file = "TOKEN"
[handler.handshake]
enabled = true
origin = "hubguard.contoso.com"
"#
    .replace("SECRETS", secrets.to_str().unwrap())
    .replace("TOKEN", token.to_str().unwrap());
    let base = base.as_str();
    let c = hubguard::config::Config::parse(base, Vec::new()).unwrap();
    let hubguard::config::HandlerSection::Webhook(w) = &c.handler;
    assert_eq!(w.content_mode, ContentMode::Structured);
    assert_eq!(w.signing, Some(SecretSource::file(&secrets)));
    assert!(!format!("{c:?}").contains("TOPSECRET"));
    // A variable that is not set stops start-up, naming the key and the variable.
    let e = hubguard::config::Config::parse(
        &base.replace(
            &format!("file = \"{}\"", secrets.display()),
            "env = \"WEBHOOK_CONVENTIONS_UNSET\"",
        ),
        Vec::new(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("handler.signing") && e.contains("WEBHOOK_CONVENTIONS_UNSET"),
        "{e}"
    );
    assert!(w.handshake.enabled);
    assert!(c.dead_letters.is_none());
    let with = |extra: &str| hubguard::config::Config::parse(&format!("{base}{extra}"), Vec::new());
    let c = with("[dead_letters]\nqueue = \"dlq\"\n").unwrap();
    assert_eq!(c.dead_letters.as_ref().unwrap().max_message_kb, 256);
    let e = with("[dead_letters]\nqueue = \"retries\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("dead_letters.queue"), "{e}");
    let e = with("[dead_letters]\nqueue = \"dlq\"\nmax_message_kb = 0\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("dead_letters.max_message_kb"), "{e}");
    // The example configuration turns the handshake on.
    let example =
        hubguard::config::Config::parse(include_str!("../../hubguard.example.toml"), Vec::new())
            .unwrap();
    let hubguard::config::HandlerSection::Webhook(w) = &example.handler;
    assert!(w.handshake.enabled);
}
