//! `hubguard check` on the emulators, with each precondition it proves broken in turn: all
//! pass on a well-made bed; a missing container, storage refusing requests, a missing
//! consumer group, a queue without duplicate detection, a SAS rule without Send or without
//! Listen and a Service Bus or Event Hubs clock beyond `status.max_clock_skew_ms` each fail
//! with the fix named, an Event Hubs clock that cannot be read says so; a replica running beside check completes check's probe message and never takes it
//! for work (issue 43).

use std::time::Duration;

use hubguard::azure::SasKey;
use hubguard::emulator::servicebus::{QueueSpec, SasRule, ServiceBusConfig, ServiceBusEmulator};

use crate::pipeline_support::Bed;

fn config(dir: &std::path::Path, bed: &Bed, container: &str) -> std::path::PathBuf {
    config_with_hook(dir, bed, container, &hook_addr())
}

/// A port that accepts connections for the test's length (the webhook's host, reached).
fn hook_addr() -> String {
    static HOOK: std::sync::OnceLock<(std::net::TcpListener, String)> = std::sync::OnceLock::new();
    HOOK.get_or_init(|| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        (l, a)
    })
    .1
    .clone()
}

fn config_with_hook(
    dir: &std::path::Path,
    bed: &Bed,
    container: &str,
    hook: &str,
) -> std::path::PathBuf {
    config_full(dir, bed, container, &format!("http://{hook}/events"), "")
}

fn config_full(
    dir: &std::path::Path,
    bed: &Bed,
    container: &str,
    hook_url: &str,
    more: &str,
) -> std::path::PathBuf {
    config_signed(
        dir,
        bed,
        &bed.sb.connection_string(),
        container,
        hook_url,
        more,
    )
}

/// The configuration with Service Bus reached through `sb` (a connection string of another
/// SAS rule).
fn config_signed(
    dir: &std::path::Path,
    bed: &Bed,
    sb: &str,
    container: &str,
    hook_url: &str,
    more: &str,
) -> std::path::PathBuf {
    config_rest(dir, bed, sb, container, hook_url, more, None)
}

/// The configuration with Event Hubs's REST endpoint `rest` (the bed's when `None`).
fn config_rest(
    dir: &std::path::Path,
    bed: &Bed,
    sb: &str,
    container: &str,
    hook_url: &str,
    more: &str,
    rest: Option<&str>,
) -> std::path::PathBuf {
    let path = dir.join("hubguard.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[eventhubs]
connection_string = "{eh}"
hub = "hub"
rest_endpoint = "{eh_rest}"
[servicebus]
connection_string = "{sb}"
[storage]
container_url = "{blob}"
[handler]
kind = "webhook"
url = "{hook_url}"
{more}
"#,
            eh = bed.eh.connection_string(),
            eh_rest = rest.unwrap_or(&bed.eh.rest_endpoint().unwrap()),
            blob = bed.blob.container_url(container),
        ),
    )
    .unwrap();
    path
}

/// Runs `hubguard check` (off the test's runtime: the emulators answer meanwhile).
async fn check(config: std::path::PathBuf) -> (i32, String) {
    check_with(config, &[]).await
}

async fn check_with(config: std::path::PathBuf, env: &[(&str, &str)]) -> (i32, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["check", "--config"])
        .arg(&config)
        .envs(env.iter().copied())
        .output();
    let out = crate::common::within("hubguard check", out).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_on_a_well_made_bed_and_names_each_broken_precondition() {
    let bed = Bed::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = check(config(dir.path(), &bed, "hubguard")).await;
    assert_eq!(code, 0, "{out}");
    for line in [
        "pass  storage: list",
        "pass  storage: write, delete",
        "pass  clock offset to blob storage",
        "pass  clock offset to Service Bus",
        "pass  clock offset to Event Hubs: ",
        "pass  servicebus: queue retries",
        "pass  servicebus: send to retries",
        "pass  servicebus: receive from retries: the probe received back (peek-lock) and completed",
        "pass  eventhubs: hub ($Default): hub: 1 partitions",
        "pass  eventhubs: hub ($Default): consumer group",
        "pass  webhook: ",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    assert!(
        bed.blob
            .store()
            .list("hubguard", "hubguard-check/", None, 10)
            .unwrap()
            .0
            .is_empty(),
        "the probe blob is deleted"
    );

    // The container does not exist.
    let (code, out) = check(config(dir.path(), &bed, "no-such-container")).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  storage: list"), "{out}");
    assert!(
        out.contains(
            "az storage container create --account-name devstoreaccount1 --name no-such-container"
        ),
        "{out}"
    );

    // Storage refuses every request (as a missing role assignment is answered).
    bed.blob
        .faults()
        .error_status_for(403, Duration::from_secs(60));
    let (code, out) = check(config(dir.path(), &bed, "hubguard")).await;
    bed.blob.faults().clear();
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("grant Storage Blob Data Contributor"), "{out}");

    // The webhook's host refuses connections.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (code, out) = check(config_with_hook(dir.path(), &bed, "hubguard", &closed)).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  webhook"), "{out}");
    assert!(out.contains(&format!("make {closed} reachable")), "{out}");

    // The consumer group does not exist.
    let (code, out) = check_with(
        config(dir.path(), &bed, "hubguard"),
        &[("HUBGUARD_EVENTHUBS__CONSUMER_GROUP", "missing-cg")],
    )
    .await;
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL  eventhubs: hub (missing-cg): consumer group"),
        "{out}"
    );
    assert!(
        out.contains("az eventhubs eventhub consumer-group create --resource-group <rg> --namespace-name <namespace> --eventhub-name hub --name missing-cg"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_queue_without_duplicate_detection() {
    let mut queue = QueueSpec::new("retries");
    queue.duplicate_detection_window = None;
    let bed = Bed::start_with_queue(1, queue).await;
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = check(config(dir.path(), &bed, "hubguard")).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  servicebus: queue retries"), "{out}");
    assert!(out.contains("set RequiresDuplicateDetection"), "{out}");
    assert!(out.contains("az servicebus queue create"), "{out}");
    assert!(out.contains("pass  storage: write, delete"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_makes_the_webhooks_handshake() {
    use hubguard::emulator::webhook::{HandshakeAnswer, WebhookReceiver};
    let bed = Bed::start(1).await;
    let receiver = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let handshake = "[handler.handshake]\nenabled = true\norigin = \"hubguard.example\"";
    let path = config_full(dir.path(), &bed, "hubguard", &receiver.url(), handshake);
    let (code, out) = check(path.clone()).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("pass  webhook: ") && out.contains("agreed to receive"),
        "{out}"
    );

    receiver.set_handshake(HandshakeAnswer::Refuse);
    let (code, out) = check(path).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  webhook"), "{out}");
    assert!(out.contains("abuse-protection handshake"), "{out}");
}

/// A connection string of the bed's Service Bus signed with `key` (another SAS rule).
fn signed_with(bed: &Bed, key: &SasKey) -> String {
    format!(
        "Endpoint=sb://{};SharedAccessKeyName={};SharedAccessKey={};UseDevelopmentEmulator=true",
        bed.sb.local_addr(),
        key.name(),
        key.secret()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_proves_send_and_listen_and_names_the_role_a_missing_one_needs() {
    let mut bed = Bed::start(1).await;
    let sender = SasKey::new("sender", "SENDER_KEY_SECRET");
    let receiver = SasKey::new("receiver", "RECEIVER_KEY_SECRET");
    bed.sb = ServiceBusEmulator::start(ServiceBusConfig {
        rules: vec![
            SasRule {
                key: sender.clone(),
                send: true,
                listen: false,
            },
            SasRule {
                key: receiver.clone(),
                send: false,
                listen: true,
            },
        ],
        ..Default::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hook = format!("http://{}/events", hook_addr());
    let counters = |bed: &Bed| bed.sb.counters("retries").unwrap();

    // Every right: the probe goes out and comes back, and nothing is left in the queue.
    let path = config_signed(
        dir.path(),
        &bed,
        &bed.sb.connection_string(),
        "hubguard",
        &hook,
        "",
    );
    let (code, out) = check(path).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("pass  servicebus: receive from retries: the probe received back"),
        "{out}"
    );
    let c = counters(&bed);
    assert_eq!(
        (c.sends, c.completes, c.abandons, c.active, c.locked),
        (1, 1, 0, 0, 0),
        "{c:?}"
    );

    // Send without Listen: the probe is sent, the receive refused with Azure's words.
    let path = config_signed(
        dir.path(),
        &bed,
        &signed_with(&bed, &sender),
        "hubguard",
        &hook,
        "",
    );
    let (code, out) = check(path).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("pass  servicebus: send to retries"), "{out}");
    assert!(
        out.contains("FAIL  servicebus: receive from retries"),
        "{out}"
    );
    assert!(
        out.contains("'Listen' claim(s) are required to perform this operation"),
        "{out}"
    );
    assert!(
        out.contains("grant Azure Service Bus Data Receiver on the queue"),
        "{out}"
    );
    assert!(out.contains("use a SAS policy with Listen"), "{out}");
    assert!(!out.contains("Data Sender"), "{out}");
    assert_eq!(counters(&bed).active, 1, "the probe waits in the queue");

    // Listen without Send: the send refused; the receive allowed, and the probe the last
    // check left behind is taken and completed as any hubguard receiver does.
    let path = config_signed(
        dir.path(),
        &bed,
        &signed_with(&bed, &receiver),
        "hubguard",
        &hook,
        "",
    );
    let (code, out) = check(path).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  servicebus: send to retries"), "{out}");
    assert!(
        out.contains("'Send' claim(s) are required to perform this operation"),
        "{out}"
    );
    assert!(
        out.contains("grant Azure Service Bus Data Sender on the queue"),
        "{out}"
    );
    assert!(
        out.contains("pass  servicebus: receive from retries"),
        "{out}"
    );
    assert!(!out.contains("Data Receiver"), "{out}");
    let c = counters(&bed);
    assert_eq!(
        (c.sends, c.completes, c.abandons, c.active, c.locked),
        (2, 2, 0, 0, 0),
        "{c:?}"
    );
    // Neither rule has Manage: the queue's settings cannot be read, and the line says so.
    assert!(out.contains("FAIL  servicebus: queue retries"), "{out}");
}

/// The line of `out` that starts with `prefix`.
fn line_of<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in:\n{out}"))
}

/// How far the offset a clock line reports (`…: +120345 ms (± 412 ms, …`) is from `truth`
/// ms, less the ± it gives (the estimator's promise: the truth lies within it).
fn beyond_its_bounds(line: &str, truth: i64) -> i64 {
    let number = |after: &str| -> i64 {
        line.split(after)
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.trim_start_matches('+').parse().ok())
            .unwrap_or_else(|| panic!("no number after {after:?} in {line}"))
    };
    (number(": ") - truth).abs() - number("(± ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_holds_each_services_clock_to_the_bound() {
    let bed = Bed::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    // Service Bus's and Event Hubs's clocks two minutes ahead of this host's (the bound is
    // 30 s by default); blob storage's agrees with it.
    bed.sb.clock().advance(Duration::from_secs(120));
    bed.eh.clock().advance(Duration::from_secs(120));
    let (code, out) = check(config(dir.path(), &bed, "hubguard")).await;
    assert_eq!(code, 1, "{out}");
    let line = line_of(&out, "FAIL  clock offset to Event Hubs: +");
    // Measured on the pipeline's estimator: the true 120 s lies within the ± it reports
    // (50 ms for the rounding to ms and the monotonic and wall clocks' drift).
    assert!(beyond_its_bounds(line, 120_000) <= 50, "{line}");
    assert!(
        line.contains("bound 30000 ms, status.max_clock_skew_ms") && line.contains("status 401"),
        "{line}"
    );
    let line = line_of(&out, "FAIL  clock offset to Service Bus: +");
    assert!(
        line.contains("bound 30000 ms, status.max_clock_skew_ms"),
        "{line}"
    );
    let fixes = out
        .lines()
        .filter(|l| l.contains("fix: synchronise this host's clock (chrony"))
        .count();
    assert_eq!(fixes, 2, "a fix under each failed clock line:\n{out}");
    assert!(out.contains("pass  clock offset to blob storage"), "{out}");

    // A looser bound lets the same offsets pass.
    let path = config_full(
        dir.path(),
        &bed,
        "hubguard",
        &format!("http://{}/events", hook_addr()),
        "[status]\nmax_clock_skew_ms = 600000",
    );
    let (code, out) = check(path).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("pass  clock offset to Service Bus: +1"),
        "{out}"
    );
    let line = line_of(&out, "pass  clock offset to Event Hubs: +");
    assert!(beyond_its_bounds(line, 120_000) <= 50, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_says_when_event_hubs_clock_cannot_be_measured() {
    let bed = Bed::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on Event Hubs's REST endpoint.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/", l.local_addr().unwrap())
    };
    let hook = format!("http://{}/events", hook_addr());
    let path = config_rest(
        dir.path(),
        &bed,
        &bed.sb.connection_string(),
        "hubguard",
        &hook,
        "",
        Some(&closed),
    );
    let (code, out) = check(path).await;
    assert_eq!(code, 1, "{out}");
    let line = line_of(
        &out,
        "FAIL  clock offset to Event Hubs: could not measure: GET ",
    );
    assert!(line.contains(&closed), "{line}");
    assert!(
        out.contains("fix: make the namespace's HTTPS endpoint reachable from this host (port 443"),
        "{out}"
    );
    // Everything else still holds, and the other clocks were measured.
    assert!(out.contains("pass  clock offset to Service Bus: "), "{out}");
    assert!(
        out.contains("pass  eventhubs: hub ($Default): consumer group"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_beside_check_completes_its_probe_and_never_takes_it_for_work() {
    use hubguard::azure::retry_queue::{probe_message, ServiceBusOptions, ServiceBusRetryQueue};
    use hubguard::azure::{ConnectionString, RetryQueue};
    use std::sync::Arc;

    // One delivery and Service Bus gives a message up to the dead-letter sub-queue.
    let mut spec = QueueSpec::new("retries");
    spec.max_delivery_count = 1;
    let bed = Bed::start_with_queue(1, spec).await;
    let counters = || async { bed.sb.counters("retries").unwrap() };
    let cs: ConnectionString = bed.sb.connection_string().parse().unwrap();
    let queue = ServiceBusRetryQueue::new(&cs, "retries", ServiceBusOptions::default()).unwrap();

    // A probe nobody completed, dead-lettered before the replica starts: its sweep (at
    // start) completes it rather than leave it for an operator or put it back as a retry.
    crate::common::within("send a probe", queue.schedule(probe_message("given-up")))
        .await
        .unwrap();
    let m = crate::common::within("lock it", queue.receive(Duration::from_secs(5)))
        .await
        .unwrap()
        .expect("the probe");
    crate::common::within("abandon it", m.abandon())
        .await
        .unwrap();
    assert_eq!(counters().await.dead_lettered, 1);
    let handler = Arc::new(crate::pipeline_support::Scripted::default());
    let replica = Bed::run(bed.parts(
        handler.clone(),
        crate::pipeline_support::fast_policy(3),
        "replica",
    ));
    crate::common::eventually(
        "the replica's sweep completes the dead-lettered probe",
        Duration::from_secs(60),
        || async {
            crate::common::seen(counters().await, |c| {
                c.completes == 1 && c.dead_lettered == 0
            })
        },
    )
    .await;

    // A probe in the queue with nobody but the replica receiving: the replica completes it.
    crate::common::within("send a probe", queue.schedule(probe_message("by-hand")))
        .await
        .unwrap();
    crate::common::eventually(
        "the replica completes the probe",
        Duration::from_secs(60),
        || async {
            crate::common::seen(counters().await, |c| {
                c.completes == 2 && c.active + c.locked == 0
            })
        },
    )
    .await;

    // check beside the replica: whoever takes check's probe, both rights are proven.
    let dir = tempfile::tempdir().unwrap();
    let (_, out) = check(config(dir.path(), &bed, "hubguard")).await;
    assert!(out.contains("pass  servicebus: send to retries"), "{out}");
    assert!(
        out.contains("pass  servicebus: receive from retries"),
        "{out}"
    );
    crate::common::eventually(
        "check's probe is completed too",
        Duration::from_secs(60),
        || async {
            crate::common::seen(counters().await, |c| {
                c.completes == 3 && c.active + c.locked == 0
            })
        },
    )
    .await;

    // No probe was work: no handler call, nothing in the ledger, nothing abandoned
    // or dead-lettered, and the retry loop still running.
    let c = counters().await;
    assert_eq!(
        (c.abandons, c.dead_lettered),
        (1, 0),
        "only the test's own abandon: {c:?}"
    );
    assert!(
        handler.calls.lock().unwrap().is_empty(),
        "the handler was called"
    );
    let pending = bed.ledger().pending().await.unwrap();
    assert!(pending.is_empty(), "ledger entries: {pending:?}");
    let listed = bed.container().list_blobs("", false).await.unwrap();
    assert!(
        listed.iter().all(|b| !b.name.contains("probe")),
        "a probe reached storage: {:?}",
        listed.iter().map(|b| &b.name).collect::<Vec<_>>()
    );
    assert_eq!(
        replica.health.retry_loop(),
        hubguard::pipeline::health::RetryLoopState::Running
    );
    replica.stop().await;
}
