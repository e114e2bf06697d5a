//! The `hubguard` binary as a user runs it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use azure_messaging_eventhubs::StartLocation;
use hubguard::azure::{
    BlobRecordStore, ConnectionString, OutgoingMessage, RecordStore, RetryQueue, RetryQueueError,
    ServiceBusRetryQueue,
};

use crate::common::*;

#[tokio::test]
async fn emulator_command_prints_a_working_connection_string_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args([
            "emulator",
            "--eventhubs-port",
            "0",
            "--eventhubs-rest-port",
            "0",
            "--servicebus-port",
            "0",
            "--blob-port",
            "0",
            "--webhook-port",
            "0",
            "--admin-port",
            "0",
            "--hub",
            "orders:2",
            "--hub",
            "audit:1:ops",
            "--queue",
            "retries",
            "--queue",
            "other",
            "--data-dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("hubguard runs");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    for _ in 0..6 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        lines.push(line.trim().to_string());
    }
    let value = |prefix: &str| {
        lines
            .iter()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no '{prefix}' line in {lines:?}"))
            .to_string()
    };
    assert!(
        lines[0].starts_with("eventhubs: "),
        "Event Hubs first: {lines:?}"
    );
    let cs_text = value("eventhubs: ");
    assert!(cs_text.starts_with("Endpoint=sb://127.0.0.1:"), "{cs_text}");
    assert!(
        cs_text.ends_with(";UseDevelopmentEmulator=true"),
        "{cs_text}"
    );
    let cs: ConnectionString = cs_text.parse().unwrap();
    // Event Hubs's REST endpoint: each answer dated (check reads Event Hubs's clock there).
    let rest = value("eventhubs-rest: ");
    let answer = within(
        "GET the hub",
        reqwest::get(format!("{rest}orders?api-version=2014-01")),
    )
    .await
    .unwrap();
    assert_eq!(answer.status().as_u16(), 401, "no token");
    assert!(answer.headers().contains_key("date"), "{answer:?}");

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

    // Service Bus from its printed connection string.
    let sb_cs: ConnectionString = value("servicebus: ").parse().unwrap();
    let q = ServiceBusRetryQueue::new(&sb_cs, "other", Default::default()).unwrap();
    let msg = OutgoingMessage {
        message_id: "m".into(),
        correlation_id: None,
        label: None,
        body: "b".into(),
        content_type: None,
        due: std::time::SystemTime::now(),
        time_to_live: None,
        properties: vec![],
    };
    within("schedule", q.schedule(msg.clone())).await.unwrap();
    // Blob from its printed account URL (+ the default container).
    let blob = format!("{}/hubguard", value("blob: "));
    let store = BlobRecordStore::new(&blob, None, std::time::Duration::from_secs(5)).unwrap();
    within(
        "blob create",
        store.create("k", azure_core::Bytes::from_static(b"v")),
    )
    .await
    .unwrap();

    // The admin endpoint injects faults and reports counters.
    let admin = value("admin: ");
    let admin = admin.strip_prefix("http://").unwrap().to_string();
    let (status, body) = http(
        &admin,
        "POST",
        "/faults/servicebus",
        r#"{"kind":"error","status":503,"seconds":600}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let e = within("503", q.schedule(msg.clone())).await.unwrap_err();
    assert!(
        matches!(e, RetryQueueError::Unavailable { status: 503, .. }),
        "{e:?}"
    );
    let (status, _) = http(&admin, "POST", "/faults/servicebus", r#"{"kind":"clear"}"#).await;
    assert_eq!(status, 200);
    let (status, body) = http(&admin, "GET", "/status", "").await;
    assert_eq!(status, 200);
    let status_json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        status_json["servicebus"]["queues"]["other"]["active"], 1,
        "{body}"
    );
    assert_eq!(
        status_json["eventhubs"]["hubs"][1]["partition_events"],
        serde_json::json!([0, 1]),
        "{body}"
    );
    let (status, body) = http(
        &admin,
        "POST",
        "/send/audit",
        r#"{"count":3,"type":"audit.entry"}"#,
    )
    .await;
    assert_eq!((status, body.as_str()), (200, r#"{"sent":3}"#));
    let (_, body) = http(&admin, "GET", "/status", "").await;
    let status_json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        status_json["eventhubs"]["hubs"][0]["partition_events"],
        serde_json::json!([3]),
        "{body}"
    );
    assert!(value("webhook: ").ends_with("/events"));
    let (status, _) = http(&admin, "POST", "/faults/nosuch", r#"{"kind":"clear"}"#).await;
    assert_eq!(status, 404);

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
    assert!(dir.path().join("servicebus/other.journal").exists());
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
