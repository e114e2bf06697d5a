//! The `hubguard` binary as a user runs it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use azure_messaging_eventhubs::StartLocation;
use hubguard::azure::ConnectionString;

use crate::common::*;

#[tokio::test]
async fn emulator_command_prints_a_working_connection_string_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args([
            "emulator",
            "--eventhubs-port",
            "0",
            "--hub",
            "orders:2",
            "--hub",
            "audit:1:ops",
            "--data-dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("hubguard runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let cs_text = line
        .trim()
        .strip_prefix("eventhubs: ")
        .expect("eventhubs line first")
        .to_string();
    assert!(cs_text.starts_with("Endpoint=sb://127.0.0.1:"), "{cs_text}");
    assert!(
        cs_text.ends_with(";UseDevelopmentEmulator=true"),
        "{cs_text}"
    );
    let cs: ConnectionString = cs_text.parse().unwrap();

    let prod = producer(&cs, "orders").await;
    within(
        "send",
        prod.send_event(
            azure_messaging_eventhubs::models::EventData::builder()
                .with_body(b"hello".to_vec())
                .build(),
            Some(azure_messaging_eventhubs::SendEventOptions {
                partition_id: Some("1".into()),
            }),
        ),
    )
    .await
    .unwrap();
    within("close", prod.close()).await.unwrap();
    let c = consumer_in(&cs, "audit", Some("ops")).await;
    let props = within("props", c.get_eventhub_properties()).await.unwrap();
    assert_eq!(props.partition_ids, vec!["0"]);
    within("close", c.close()).await.unwrap();
    let c = consumer(&cs, "orders").await;
    let r = receiver(&c, "1", StartLocation::Earliest, false).await;
    assert_eq!(body(&take(&r, 1).await[0]), "hello");
    within("close receiver", r.close()).await.unwrap();
    within("close", c.close()).await.unwrap();

    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = within(
        "exit on SIGTERM",
        tokio::task::spawn_blocking(move || child.wait()),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(status.success(), "clean exit: {status:?}");
    assert!(dir.path().join("eventhubs/orders/1.log").exists());
}

#[test]
fn bad_hub_spec_is_refused_with_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["emulator", "--eventhubs-port", "0", "--hub", "orders:zero"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--hub") && err.contains("partition count"),
        "{err}"
    );
}
