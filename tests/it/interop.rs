//! Other official SDKs against the emulator: the service's protocol, not only what the Rust
//! crate checks. Runs the official Python Event Hubs SDK (`tests/interop/python_eventhubs.py`)
//! when it is installed; `.ci/run` installs it and sets `HUBGUARD_REQUIRE_INTEROP=1`, which
//! turns a missing SDK into a failure.

use std::time::Duration;

use azure_messaging_eventhubs::StartLocation;

use crate::common::*;

fn python_sdk_available() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import azure.eventhub"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// `false` (and a note) when the official Python SDK is missing and CI does not require it;
/// with `HUBGUARD_REQUIRE_INTEROP` set, a missing SDK fails the test.
fn python_sdk_or_skip() -> bool {
    if python_sdk_available() {
        return true;
    }
    assert!(
        std::env::var("HUBGUARD_REQUIRE_INTEROP").is_err(),
        "HUBGUARD_REQUIRE_INTEROP is set but the Python SDK is missing (pip install azure-eventhub==5.15.1)"
    );
    eprintln!("skipped: the official Python Event Hubs SDK is not installed (pip install azure-eventhub==5.15.1)");
    false
}

/// Runs `tests/interop/{script}` against the emulator's hub and asserts it printed `ok`.
async fn run_python(script: &str, connection_string: String, hub: &str, ok: &str) {
    let script = format!("{}/tests/interop/{script}", env!("CARGO_MANIFEST_DIR"));
    let run = tokio::process::Command::new("python3")
        .arg(script)
        .arg(connection_string)
        .arg(hub)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the Python SDK finishes within 120 s")
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(ok),
        "python SDK failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_sdk_produces_and_consumes() {
    if !python_sdk_or_skip() {
        return;
    }
    let emu = emulator(&[("pyhub", 2)]).await;
    run_python(
        "python_eventhubs.py",
        emu.connection_string(),
        "pyhub",
        "PYTHON INTEROP OK",
    )
    .await;

    // What Python produced, the Rust SDK reads back identically.
    let cs = conn(&emu);
    let c = consumer(&cs, "pyhub").await;
    let r = receiver(&c, "0", StartLocation::Earliest, false).await;
    let got = take(&r, 21).await;
    assert_eq!(body(&got[0]), "py-single");
    assert_eq!(body(&got[20]), "py-batch-19");
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_sdk_round_trips_a_one_megabyte_event() {
    if !python_sdk_or_skip() {
        return;
    }
    let emu = emulator(&[("bighub", 1)]).await;
    run_python(
        "python_large_event.py",
        emu.connection_string(),
        "bighub",
        "PYTHON LARGE OK",
    )
    .await;
    // Only the 1,000,000-byte event was stored, intact.
    let stored = emu.store().hub("bighub").unwrap().partitions[0].events_from(0, 10);
    assert_eq!(stored.len(), 1);
    match &stored[0].message.body {
        fe2o3_amqp::types::messaging::Body::Data(d) => {
            assert_eq!(d.iter().map(|s| s.0.len()).sum::<usize>(), 1_000_000)
        }
        other => panic!("unexpected body {other:?}"),
    }
}
