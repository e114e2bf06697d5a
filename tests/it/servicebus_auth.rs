//! Service Bus authentication as Azure does it, and the start-up proof of the retry queue:
//! hubguard's retry queue with an Entra ID token credential (a fake one: the emulator runs
//! with `accept_any_token`, as `hubguard emulator --accept-any-token` does) through the whole
//! pipeline; a bearer token refused without the flag (Service Bus and blob storage); the
//! queue's description served by the emulator and read by hubguard; `hubguard run` refusing
//! to start on a queue without duplicate detection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use azure_core::credentials::{AccessToken, TokenCredential, TokenRequestOptions};
use hubguard::azure::retry_queue::{ServiceBusOptions, SERVICE_BUS_SCOPE};
use hubguard::azure::{
    ConnectionString, OutgoingMessage, RetryQueue, RetryQueueError, SasKey, ServiceBusRetryQueue,
};
use hubguard::config::Config;
use hubguard::emulator::blob::{BlobConfig, BlobEmulator};
use hubguard::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use hubguard::ledger::State;

use crate::common::{conn, within};
use crate::pipeline_support::*;

/// A stand-in for an Entra ID credential: hands out a fixed opaque token, valid for an hour,
/// and counts how often it was asked (hubguard must cache it).
#[derive(Debug, Default)]
struct FakeCredential {
    calls: AtomicUsize,
}

/// What the fake credential hands out; it must never appear in an error or log line.
const FAKE_TOKEN: &str = "eyJ0eXAiOiJKV1QifQ.fake-entra-token.SECRET";

#[async_trait]
impl TokenCredential for FakeCredential {
    async fn get_token(
        &self,
        scopes: &[&str],
        _options: Option<TokenRequestOptions<'_>>,
    ) -> azure_core::Result<AccessToken> {
        assert_eq!(scopes, [SERVICE_BUS_SCOPE], "Service Bus's scope");
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(AccessToken::new(
            FAKE_TOKEN,
            azure_core::time::OffsetDateTime::now_utc() + azure_core::time::Duration::hours(1),
        ))
    }
}

fn options() -> ServiceBusOptions {
    ServiceBusOptions {
        deadline: Duration::from_secs(5),
    }
}

async fn sb_emulator(config: ServiceBusConfig) -> ServiceBusEmulator {
    ServiceBusEmulator::start(config)
        .await
        .expect("service bus emulator starts")
}

fn token_queue(emu: &ServiceBusEmulator, cred: Arc<FakeCredential>) -> ServiceBusRetryQueue {
    ServiceBusRetryQueue::with_token_credential(
        &format!("http://{}", emu.local_addr()),
        cred,
        "retries",
        options(),
    )
    .expect("queue client")
}

fn sas_queue(emu: &ServiceBusEmulator, queue: &str) -> ServiceBusRetryQueue {
    let cs: ConnectionString = emu.connection_string().parse().unwrap();
    ServiceBusRetryQueue::new(&cs, queue, options()).unwrap()
}

fn message(id: &str) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.into(),
        correlation_id: None,
        label: None,
        body: "{}".into(),
        content_type: Some("application/json".into()),
        due: SystemTime::now(),
        time_to_live: None,
        properties: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipeline_schedules_and_runs_retries_through_an_entra_id_token() {
    let eh = EventHubsEmulator::start(EventHubsConfig {
        hubs: vec![HubSpec::new("hub", 1)],
        ..Default::default()
    })
    .await
    .unwrap();
    let sb = sb_emulator(ServiceBusConfig {
        accept_any_token: true,
        ..Default::default()
    })
    .await;
    let blob = BlobEmulator::start(BlobConfig::default()).await.unwrap();
    let cs = conn(&eh);
    let bed = Bed { eh, sb, blob, cs };
    bed.send(
        0,
        &[
            ("tok-ok", "ok"),
            ("tok-flaky", "fail:2"),
            ("tok-ok-2", "ok"),
        ],
    )
    .await;
    let cred = Arc::new(FakeCredential::default());
    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "entra-replica");
    parts.queue = Arc::new(token_queue(&bed.sb, cred.clone()).with_clock(bed.clock()));
    let run = Bed::run(parts);
    let ledger = bed.ledger();
    wait_for(
        "flaky delivered on its third attempt",
        &run.health,
        Duration::from_secs(60),
        || async {
            matches!(ledger.record("tok-flaky").await, Ok(Some(r)) if r.state() == State::Delivered)
        },
    )
    .await;
    wait_for(
        "checkpoint past all three",
        &run.health,
        Duration::from_secs(60),
        || async { bed.checkpoint_of("0").await == Some(2) },
    )
    .await;
    run.stop().await;
    assert_eq!(handler.calls_of("tok-flaky"), vec![1, 2, 3]);
    let c = bed.sb.counters("retries").unwrap();
    assert_eq!(c.sends, 2, "two retries scheduled with the bearer token");
    assert_eq!(c.completes, 2, "and received and completed with it");
    assert_eq!(
        cred.calls.load(Ordering::SeqCst),
        1,
        "one token, cached for every request"
    );
}

#[tokio::test]
async fn a_bearer_token_is_refused_without_accept_any_token() {
    // Service Bus: the same token the test above uses gets 401, with a detail that says why.
    let sb = sb_emulator(ServiceBusConfig::default()).await;
    let cred = Arc::new(FakeCredential::default());
    let q = token_queue(&sb, cred);
    let e = within("send with a bearer token", q.schedule(message("m1")))
        .await
        .unwrap_err();
    match &e {
        RetryQueueError::Unauthorized {
            status: 401,
            detail,
        } => {
            assert!(detail.contains("--accept-any-token"), "{detail}")
        }
        other => panic!("expected 401, got {other:?}"),
    }
    assert!(!e.to_string().contains("SECRET"), "{e}");
    assert!(!format!("{q:?}").contains("SECRET"));
    let e = within("receive with a bearer token", q.receive(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::Unauthorized { status: 401, .. }),
        "{e:?}"
    );
    assert_eq!(sb.counters("retries").unwrap().sends, 0);
    // SAS still works on the same emulator.
    within(
        "send with SAS",
        sas_queue(&sb, "retries").schedule(message("m2")),
    )
    .await
    .unwrap();

    // Blob storage: anonymous stays accepted; a bearer token only with the flag.
    let http = reqwest::Client::new();
    for accept in [false, true] {
        let blob = BlobEmulator::start(BlobConfig {
            accept_any_token: accept,
            ..Default::default()
        })
        .await
        .unwrap();
        let url = format!("{}/tok-{accept}", blob.container_url("hubguard"));
        let put = |auth: Option<&str>| {
            let mut r = http
                .put(&url)
                .header("x-ms-blob-type", "BlockBlob")
                .header("x-ms-version", "2025-01-05")
                .body("x");
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            r.send()
        };
        let r = within(
            "put with a bearer token",
            put(Some(&format!("Bearer {FAKE_TOKEN}"))),
        )
        .await
        .unwrap();
        if accept {
            assert_eq!(r.status(), 201, "accepted with --accept-any-token");
        } else {
            assert_eq!(r.status(), 401);
            assert_eq!(
                r.headers()["x-ms-error-code"].to_str().unwrap(),
                "InvalidAuthenticationInfo"
            );
            assert!(r.headers().contains_key("www-authenticate"));
            let body = r.text().await.unwrap();
            assert!(body.contains("--accept-any-token"), "{body}");
        }
        let r = within("anonymous put", put(None)).await.unwrap();
        assert_eq!(r.status(), 201, "anonymous requests are accepted as before");
    }
}

#[tokio::test]
async fn the_queue_description_round_trips_and_needs_the_manage_right() {
    let mut premium = QueueSpec::new("premium");
    premium.lock_duration = Duration::from_secs(90);
    premium.max_delivery_count = 7;
    premium.duplicate_detection_window = Some(Duration::from_secs(2 * 3600 + 30));
    premium.max_message_size_kb = 1024;
    let mut plain = QueueSpec::new("plain");
    plain.duplicate_detection_window = None;
    let send_listen = SasKey::new("app", "APP_KEY_SECRET");
    let sb = sb_emulator(ServiceBusConfig {
        queues: vec![QueueSpec::new("retries"), premium, plain],
        send_listen_key: Some(send_listen.clone()),
        accept_any_token: true,
        ..Default::default()
    })
    .await;

    let d = within("describe premium", sas_queue(&sb, "premium").describe())
        .await
        .unwrap();
    assert!(d.requires_duplicate_detection);
    assert_eq!(
        d.duplicate_detection_history_time_window,
        Some(Duration::from_secs(7230))
    );
    assert_eq!(d.lock_duration, Some(Duration::from_secs(90)));
    assert_eq!(d.max_delivery_count, Some(7));
    assert_eq!(d.max_message_size_in_kilobytes, Some(1024));

    let d = within(
        "describe the default queue",
        sas_queue(&sb, "retries").describe(),
    )
    .await
    .unwrap();
    assert!(d.requires_duplicate_detection);
    assert_eq!(
        d.duplicate_detection_history_time_window,
        Some(Duration::from_secs(600))
    );
    assert_eq!(d.lock_duration, Some(Duration::from_secs(60)));
    assert_eq!(d.max_delivery_count, Some(10));
    assert_eq!(d.max_message_size_in_kilobytes, Some(256));

    let d = within("describe plain", sas_queue(&sb, "plain").describe())
        .await
        .unwrap();
    assert!(!d.requires_duplicate_detection);

    // Through the trait, with a bearer token.
    let q: Arc<dyn RetryQueue> = Arc::new(token_queue(&sb, Arc::new(FakeCredential::default())));
    let d = within("describe with a token", q.describe()).await.unwrap();
    assert!(d.requires_duplicate_detection);

    // A queue that does not exist: an empty feed, read as "not found".
    let e = within("describe missing", sas_queue(&sb, "missing").describe())
        .await
        .unwrap_err();
    assert!(matches!(e, RetryQueueError::EntityNotFound { .. }), "{e:?}");

    // A send-and-listen rule may send, but not read the description (401, as Azure).
    let cs: ConnectionString = format!(
        "Endpoint=sb://{};SharedAccessKeyName=app;SharedAccessKey={};UseDevelopmentEmulator=true",
        sb.local_addr(),
        send_listen.secret()
    )
    .parse()
    .unwrap();
    let app = ServiceBusRetryQueue::new(&cs, "retries", options()).unwrap();
    within("send with send/listen", app.schedule(message("app-1")))
        .await
        .unwrap();
    let e = within("describe with send/listen", app.describe())
        .await
        .unwrap_err();
    match &e {
        RetryQueueError::Unauthorized {
            status: 401,
            detail,
        } => {
            assert!(detail.contains("Manage"), "{detail}")
        }
        other => panic!("expected 401, got {other:?}"),
    }
}

/// A configuration for `hubguard run` whose Service Bus is `sb` (the rest is never reached:
/// the start-up proof comes first).
fn config_text(servicebus: &str) -> String {
    format!(
        r#"
[eventhubs]
connection_string = "Endpoint=sb://127.0.0.1:1;SharedAccessKeyName=k;SharedAccessKey=EH_SECRET;UseDevelopmentEmulator=true"
hub = "hub"
[servicebus]
{servicebus}
[storage]
container_url = "http://127.0.0.1:1/devstoreaccount1/hubguard"
[handler]
kind = "webhook"
url = "http://127.0.0.1:1/events"
[status]
listen = "127.0.0.1:0"
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hubguard_run_refuses_a_queue_without_duplicate_detection() {
    let mut spec = QueueSpec::new("retries");
    spec.duplicate_detection_window = None;
    let sb = sb_emulator(ServiceBusConfig {
        queues: vec![spec],
        ..Default::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hubguard.toml");
    std::fs::write(
        &path,
        config_text(&format!(
            "connection_string = \"{}\"",
            sb.connection_string()
        )),
    )
    .unwrap();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["run", "--config"])
        .arg(&path)
        .kill_on_drop(true)
        .output();
    let out = within("hubguard run exits", child).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("servicebus.queue")
            && stderr.contains("RequiresDuplicateDetection = false")
            && stderr.contains("DuplicateDetectionHistoryTimeWindow at least PT2M40S (160 s)"),
        "{stderr}"
    );
    assert!(!stderr.contains("SAS_KEY_VALUE"), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "",
        "it never started consuming"
    );
}

#[tokio::test]
async fn the_start_up_proof_weighs_the_window_against_the_configuration() {
    let mut short = QueueSpec::new("short");
    short.duplicate_detection_window = Some(Duration::from_secs(120));
    short.lock_duration = Duration::from_secs(30);
    let send_listen = SasKey::new("app", "APP_KEY_SECRET");
    let sb = sb_emulator(ServiceBusConfig {
        queues: vec![QueueSpec::new("retries"), short],
        send_listen_key: Some(send_listen.clone()),
        ..Default::default()
    })
    .await;
    let config = |servicebus: String, extra: &str| {
        let config =
            Config::parse(&format!("{}{extra}", config_text(&servicebus)), Vec::new()).unwrap();
        hubguard::wiring::Wiring::from_config(&config).unwrap()
    };
    let root = format!(
        "connection_string = \"{}\"\nqueue = \"short\"",
        sb.connection_string()
    );
    // Defaults need 130 s (LockDuration 30 s + 4 × 10 s + 60 s): a 2-minute window is short.
    let e = config(root.clone(), "")
        .prove_retry_queue()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("DuplicateDetectionHistoryTimeWindow = PT2M (120 s)")
            && e.contains("at least PT2M10S (130 s)"),
        "{e}"
    );
    assert!(!e.contains("SAS_KEY_VALUE"), "{e}");
    // Shorter deadlines need less (102 s): the same queue is enough.
    let warnings = config(root, "[retry]\ncall_deadline_ms = 3000\n")
        .prove_retry_queue()
        .await
        .unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    // A longer ownership expiration needs more than the queue's 10 minutes.
    let e = config(
        format!(
            "connection_string = \"{}\"\nduplicate_detection_window_s = 3600",
            sb.connection_string()
        ),
        "[processor]\nownership_expiration_ms = 900000\n",
    )
    .prove_retry_queue()
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("at least PT16M41S (1001 s)"), "{e}");
    // Without the Manage right: a warning naming it, and hubguard starts.
    let app = format!(
        "connection_string = \"Endpoint=sb://{};SharedAccessKeyName=app;SharedAccessKey={};UseDevelopmentEmulator=true\"",
        sb.local_addr(),
        send_listen.secret()
    );
    let warnings = config(app, "").prove_retry_queue().await.unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("Manage right")
            && warnings[0].contains("Azure Service Bus Data Owner")
            && !warnings[0].contains("APP_KEY_SECRET"),
        "{warnings:?}"
    );
}

#[test]
fn entra_id_is_configured_with_namespace_and_credential() {
    let ok = |sb: &str| Config::parse(&config_text(sb), Vec::new());
    let c = ok("namespace = \"myns.servicebus.windows.net\"\ncredential = \"managed_identity\"")
        .unwrap();
    assert_eq!(
        c.servicebus.namespace.as_deref(),
        Some("myns.servicebus.windows.net")
    );
    ok("namespace = \"http://127.0.0.1:5380\"\ncredential = \"developer_tools\"").unwrap();
    let e = ok("namespace = \"http://10.1.2.3:5380\"\ncredential = \"azure_cli\"")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("servicebus.namespace") && e.contains("loopback"),
        "{e}"
    );
    let e = ok("namespace = \"myns.servicebus.windows.net\"")
        .unwrap_err()
        .to_string();
    assert!(e.contains("servicebus") && e.contains("credential"), "{e}");
    let e = ok("connection_string = \"Endpoint=sb://x;SharedAccessKeyName=k;SharedAccessKey=SB_SECRET\"\nnamespace = \"x\"\ncredential = \"azure_cli\"")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("either connection_string") && !e.contains("SB_SECRET"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hubguard_emulator_takes_accept_any_token_and_per_queue_duplicate_detection() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args([
            "emulator",
            "--only",
            "servicebus",
            "--servicebus-port",
            "0",
            "--admin-port",
            "0",
            "--queue",
            "retries",
            "--queue",
            "plain:off",
            "--queue",
            "day:86400",
            "--accept-any-token",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = within("emulator starts", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    let cs: ConnectionString = first
        .strip_prefix("servicebus: ")
        .unwrap_or_else(|| panic!("{first}"))
        .parse()
        .unwrap();
    let sas = |queue: &str| ServiceBusRetryQueue::new(&cs, queue, options()).unwrap();
    let plain = within("describe plain", sas("plain").describe())
        .await
        .unwrap();
    assert!(!plain.requires_duplicate_detection);
    let day = within("describe day", sas("day").describe()).await.unwrap();
    assert_eq!(
        day.duplicate_detection_history_time_window,
        Some(Duration::from_secs(86_400))
    );
    let token = ServiceBusRetryQueue::with_token_credential(
        &format!("http://{}:{}", cs.host, cs.port.unwrap()),
        Arc::new(FakeCredential::default()),
        "retries",
        options(),
    )
    .unwrap();
    within("send with a token", token.schedule(message("cli-token")))
        .await
        .unwrap();
    let m = within(
        "receive with a token",
        token.receive(Duration::from_secs(1)),
    )
    .await
    .unwrap()
    .expect("the message");
    within("complete", m.complete()).await.unwrap();
    child.start_kill().unwrap();
    let _ = child.wait().await;
}

/// A credential that cannot get a token (not signed in, no managed identity here).
#[derive(Debug)]
struct NoToken;

#[async_trait]
impl TokenCredential for NoToken {
    async fn get_token(
        &self,
        _scopes: &[&str],
        _options: Option<TokenRequestOptions<'_>>,
    ) -> azure_core::Result<AccessToken> {
        Err(azure_core::Error::with_message(
            azure_core::error::ErrorKind::Credential,
            "no managed identity endpoint here",
        ))
    }
}

#[tokio::test]
async fn a_credential_without_a_token_is_a_typed_error_that_holds_nothing_silently() {
    let sb = sb_emulator(ServiceBusConfig {
        accept_any_token: true,
        ..Default::default()
    })
    .await;
    let q = ServiceBusRetryQueue::with_token_credential(
        &format!("http://{}", sb.local_addr()),
        Arc::new(NoToken),
        "retries",
        options(),
    )
    .unwrap();
    let e = within("send without a token", q.schedule(message("m")))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, RetryQueueError::Credential(m) if m.contains("no managed identity endpoint here")),
        "{e:?}"
    );
    assert!(
        !e.is_transient() && !e.is_refusal_of_request(),
        "held, not dead-lettered"
    );
    assert_eq!(sb.counters("retries").unwrap().sends, 0);
}
