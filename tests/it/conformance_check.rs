//! `hubguard check` on the emulators, with each precondition it proves broken in turn: all
//! pass on a well-made bed; a missing container, storage refusing requests, a missing
//! consumer group and a queue without duplicate detection each fail with the fix named
//! (issue 43).

use std::time::Duration;

use hubguard::emulator::servicebus::QueueSpec;

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
    let path = dir.join("hubguard.toml");
    std::fs::write(
        &path,
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
url = "{hook_url}"
{more}
"#,
            eh = bed.eh.connection_string(),
            sb = bed.sb.connection_string(),
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
        "pass  servicebus: queue retries",
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
