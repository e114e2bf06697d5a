//! The Service Bus emulator through hubguard's retry queue, which drives the real
//! `azure_messaging_servicebus` 0.21 crate over HTTP. The emulator's clock is advanced
//! instead of sleeping for due times, lock expiry and duplicate windows.

use std::time::{Duration, SystemTime};

use hubguard::azure::retry_queue::ServiceBusOptions;
use hubguard::azure::{
    ConnectionString, OutgoingMessage, RetryQueue, RetryQueueError, ServiceBusRetryQueue,
};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};

use crate::common::within;

async fn emulator_with(
    queues: Vec<QueueSpec>,
    data_dir: Option<std::path::PathBuf>,
) -> ServiceBusEmulator {
    ServiceBusEmulator::start(ServiceBusConfig {
        queues,
        data_dir,
        ..Default::default()
    })
    .await
    .expect("service bus emulator starts")
}

fn queue_client(emu: &ServiceBusEmulator, queue: &str) -> ServiceBusRetryQueue {
    let cs: ConnectionString = emu.connection_string().parse().unwrap();
    ServiceBusRetryQueue::new(
        &cs,
        queue,
        ServiceBusOptions {
            deadline: Duration::from_secs(5),
        },
    )
    .unwrap()
}

fn message(id: &str, due: SystemTime) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.into(),
        correlation_id: Some(format!("corr-{id}")),
        label: Some("order.created".into()),
        body: format!("{{\"id\":\"{id}\",\"text\":\"grüße\"}}"),
        content_type: Some("application/json".into()),
        due,
        time_to_live: None,
        properties: vec![
            ("attempt".into(), "2".into()),
            ("idempotency-key".into(), id.into()),
        ],
    }
}

#[tokio::test]
async fn scheduled_message_is_invisible_before_due_and_delivered_after() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    let due = SystemTime::now() + Duration::from_secs(30);
    within("schedule", q.schedule(message("m1", due)))
        .await
        .unwrap();
    assert_eq!(emu.counters("retries").unwrap().scheduled, 1);
    assert!(within("receive before due", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .is_none());

    emu.clock().advance(Duration::from_secs(31));
    let m = within("receive after due", q.receive(Duration::from_secs(2)))
        .await
        .unwrap()
        .expect("due message");
    assert_eq!(m.message_id, "m1");
    assert_eq!(m.correlation_id.as_deref(), Some("corr-m1"));
    assert_eq!(m.label.as_deref(), Some("order.created"));
    assert_eq!(m.body, "{\"id\":\"m1\",\"text\":\"grüße\"}");
    assert_eq!(m.delivery_count, 1);
    assert_eq!(m.properties.get("attempt").map(String::as_str), Some("2"));
    assert_eq!(
        m.properties.get("idempotency-key").map(String::as_str),
        Some("m1")
    );
    let enqueued = m.enqueued_at.expect("enqueued time");
    assert!(
        enqueued >= due - Duration::from_millis(1),
        "never delivered before its due time"
    );
    assert!(
        enqueued <= due + Duration::from_secs(1),
        "scheduled time kept to the second"
    );
    within("complete", m.complete()).await.unwrap();
    let c = emu.counters("retries").unwrap();
    assert_eq!((c.active, c.scheduled, c.locked, c.completes), (0, 0, 0, 1));
}

#[tokio::test]
async fn a_long_poll_wakes_for_a_message_that_comes_due() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    let due = SystemTime::now() + Duration::from_millis(1500);
    within("schedule", q.schedule(message("soon", due)))
        .await
        .unwrap();
    let m = within("long poll", q.receive(Duration::from_secs(10)))
        .await
        .unwrap()
        .expect("arrives while polling");
    assert!(
        SystemTime::now() >= due,
        "not before its (rounded-up) due time"
    );
    within("complete", m.complete()).await.unwrap();
}

#[tokio::test]
async fn the_retry_queue_keeps_its_connections_alive() {
    // azure_core 0.21's own transport opens a connection per request; hubguard's keeps them
    // (a receive, a complete, a send: each one round trip on a live connection).
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    let before = emu.faults().accepted();
    for i in 0..10 {
        within(
            "schedule",
            q.schedule(message(&format!("m{i}"), SystemTime::now())),
        )
        .await
        .unwrap();
        let m = within("receive", q.receive(Duration::from_secs(5)))
            .await
            .unwrap()
            .expect("due now");
        within("complete", m.complete()).await.unwrap();
    }
    let opened = emu.faults().accepted() - before;
    assert!(
        opened <= 2,
        "30 requests one after another opened {opened} connections"
    );
    // A dropped connection is replaced. A request already on its way over the dead
    // connection fails as a transient transport error (the caller retries it, as any other);
    // the next one opens a new connection.
    emu.faults().drop_connections();
    let mut failures = 0;
    while let Err(e) = within(
        "after a drop",
        q.schedule(message("after", SystemTime::now())),
    )
    .await
    {
        assert!(e.is_transient(), "{e:?}");
        failures += 1;
        assert!(failures < 3, "still failing after a drop: {e:?}");
    }
}

#[tokio::test]
async fn duplicate_message_ids_are_dropped_inside_the_window_only() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    let now = SystemTime::now();
    within("first", q.schedule(message("dup", now)))
        .await
        .unwrap();
    within("duplicate", q.schedule(message("dup", now)))
        .await
        .unwrap();
    let c = emu.counters("retries").unwrap();
    assert_eq!((c.sends, c.duplicates_dropped, c.active), (2, 1, 1));
    emu.clock().advance(Duration::from_secs(601));
    within("after the window", q.schedule(message("dup", now)))
        .await
        .unwrap();
    assert_eq!(emu.counters("retries").unwrap().active, 2);
}

#[tokio::test]
async fn peek_lock_complete_abandon_renew_expiry_and_dead_lettering() {
    let mut spec = QueueSpec::new("retries");
    spec.max_delivery_count = 3;
    let emu = emulator_with(vec![spec], None).await;
    let q = queue_client(&emu, "retries");
    let now = SystemTime::now();
    within("send", q.schedule(message("a", now))).await.unwrap();

    // Abandon: delivered again with a higher delivery count.
    let m1 = within("lock 1", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .unwrap();
    assert!(within("locked: nothing else", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .is_none());
    within("abandon", m1.abandon()).await.unwrap();
    let mut m2 = within("lock 2", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m2.delivery_count, 2);
    // The first lock is stale now.
    assert_eq!(
        within("stale complete", m1.complete()).await,
        Err(RetryQueueError::LockLost)
    );
    within("renew", m2.renew()).await.unwrap();

    // Lock expiry makes it visible again; the expired lock cannot complete.
    emu.clock().advance(Duration::from_secs(61));
    let m3 = within("lock 3", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m3.delivery_count, 3);
    assert_eq!(
        within("expired complete", m2.complete()).await,
        Err(RetryQueueError::LockLost)
    );

    // The third delivery was the last: abandoning dead-letters it with a reason.
    within("abandon at max", m3.abandon()).await.unwrap();
    assert!(within("gone", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .is_none());
    let c = emu.counters("retries").unwrap();
    assert_eq!((c.dead_lettered, c.abandons), (1, 2));
    let dlq = queue_client(&emu, "retries/$DeadLetterQueue");
    let d = within("dead letter", dlq.receive(Duration::ZERO))
        .await
        .unwrap()
        .expect("dead-lettered message");
    assert_eq!(d.message_id, "a");
    assert_eq!(d.properties.get("attempt").map(String::as_str), Some("2"));
    within("complete dead letter", d.complete()).await.unwrap();
    assert_eq!(emu.counters("retries").unwrap().dead_lettered, 0);
}

#[tokio::test]
async fn wrong_key_and_unknown_queue_are_typed_errors() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let mut cs: ConnectionString = emu.connection_string().parse().unwrap();
    cs.key = hubguard::azure::SasKey::new(cs.key.name(), "wrong-key");
    let bad = ServiceBusRetryQueue::new(&cs, "retries", ServiceBusOptions::default()).unwrap();
    let e = within("send", bad.schedule(message("x", SystemTime::now())))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::Unauthorized { status: 401, .. }),
        "{e:?}"
    );
    assert!(!e.to_string().contains("wrong-key"));
    let e = within("receive", bad.receive(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::Unauthorized { status: 401, .. }),
        "{e:?}"
    );
    assert_eq!(emu.counters("retries").unwrap().sends, 0);

    // Azure answers 410 Gone for a queue that does not exist (Send Message, Peek-Lock).
    let missing = queue_client(&emu, "nope");
    let e = within("send", missing.schedule(message("x", SystemTime::now())))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::EntityNotFound { status: 410, .. }),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("nope"),
        "the detail names the queue: {e}"
    );
    let e = within("receive", missing.receive(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::EntityNotFound { status: 410, .. }),
        "{e:?}"
    );
}

#[tokio::test]
async fn every_fault_kind_surfaces_as_the_right_error() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    let now = SystemTime::now();

    emu.faults()
        .error_status_for(503, Duration::from_secs(3600));
    let e = within("503", q.schedule(message("a", now)))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::Unavailable { status: 503, .. }),
        "{e:?}"
    );
    let e = within("503 receive", q.receive(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::Unavailable { status: 503, .. }),
        "{e:?}"
    );
    emu.faults().clear();

    emu.faults()
        .refuse_connections_for(Duration::from_secs(3600));
    emu.faults().drop_connections(); // close the pooled keep-alive connections too
    let e = within("refused", q.schedule(message("b", now)))
        .await
        .unwrap_err();
    assert!(matches!(e, RetryQueueError::Transport(_)), "{e:?}");
    assert!(e.is_transient());
    emu.faults().clear();

    let slow = ServiceBusRetryQueue::new(
        &emu.connection_string().parse().unwrap(),
        "retries",
        ServiceBusOptions {
            deadline: Duration::from_millis(300),
        },
    )
    .unwrap();
    emu.faults().set_delay(Duration::from_secs(5));
    assert_eq!(
        within("slow", slow.schedule(message("c", now)))
            .await
            .unwrap_err(),
        RetryQueueError::Timeout(Duration::from_millis(300))
    );
    emu.faults().clear();

    // After the faults, everything works and nothing was half-accepted.
    within("healthy", q.schedule(message("d", now)))
        .await
        .unwrap();
    let ids: Vec<String> = emu
        .queue("retries")
        .unwrap()
        .messages(hubguard::emulator::servicebus::broker::Entity::Main)
        .into_iter()
        .map(|m| m.message_id)
        .collect();
    assert!(ids.contains(&"d".to_string()));
    assert!(!ids.contains(&"a".to_string()) && !ids.contains(&"b".to_string()));
}

#[tokio::test]
async fn restart_on_the_same_data_dir_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let emu = emulator_with(
        vec![QueueSpec::new("retries")],
        Some(dir.path().to_path_buf()),
    )
    .await;
    let q = queue_client(&emu, "retries");
    let later = SystemTime::now() + Duration::from_secs(3600);
    for i in 0..5 {
        within("schedule", q.schedule(message(&format!("r{i}"), later)))
            .await
            .unwrap();
    }
    within("send now", q.schedule(message("now", SystemTime::now())))
        .await
        .unwrap();
    emu.shutdown().await;

    let emu = emulator_with(
        vec![QueueSpec::new("retries")],
        Some(dir.path().to_path_buf()),
    )
    .await;
    let c = emu.counters("retries").unwrap();
    assert_eq!((c.scheduled, c.active), (5, 1));
    let q = queue_client(&emu, "retries");
    // Duplicate detection survives too.
    within("duplicate after restart", q.schedule(message("r0", later)))
        .await
        .unwrap();
    assert_eq!(emu.counters("retries").unwrap().scheduled, 5);
    let m = within("receive", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.message_id, "now");
    within("complete", m.complete()).await.unwrap();
}

// ---- What Azure refuses (the emulator's table in `hubguard::emulator::servicebus`). ----

#[tokio::test]
async fn a_message_id_over_128_characters_is_refused_as_azure_does() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    let now = SystemTime::now();
    within("128", q.schedule(message(&"m".repeat(128), now)))
        .await
        .expect("128 characters are allowed");
    let e = within("129", q.schedule(message(&"m".repeat(129), now)))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, RetryQueueError::Refused { status: 400, detail } if detail.contains("MessageId")),
        "{e:?}"
    );
    assert!(e.is_refusal_of_request() && !e.is_transient());
    assert_eq!(emu.counters("retries").unwrap().sends, 1);
}

#[tokio::test]
async fn a_message_over_the_queues_size_is_refused_with_403_too_large() {
    let mut premium = QueueSpec::new("premium");
    premium.max_message_size_kb = 1024;
    let emu = emulator_with(vec![QueueSpec::new("retries"), premium], None).await;
    let now = SystemTime::now();
    let mut big = message("big", now);
    big.body = "x".repeat(300 * 1024);

    // Standard: 256 KB, headers included.
    let e = within(
        "300 KB",
        queue_client(&emu, "retries").schedule(big.clone()),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&e, RetryQueueError::Refused { status: 403, detail } if detail.contains("exceeds the maximum message size")),
        "{e:?}"
    );
    let mut fits = message("fits", now);
    fits.body = "x".repeat(250 * 1024);
    within("250 KB", queue_client(&emu, "retries").schedule(fits))
        .await
        .expect("250 KB fits a Standard queue");
    // A queue configured for Premium's 1 MB takes it.
    within("premium", queue_client(&emu, "premium").schedule(big))
        .await
        .expect("a Premium-sized queue takes 300 KB");
}

#[tokio::test]
async fn oversized_properties_and_a_zero_ttl_are_refused() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    let now = SystemTime::now();
    let mut m = message("prop", now);
    m.properties.push(("big".into(), "p".repeat(33 * 1024)));
    let e = within("property", q.schedule(m)).await.unwrap_err();
    assert!(
        matches!(&e, RetryQueueError::Refused { status: 403, detail } if detail.contains("property")),
        "{e:?}"
    );
    let mut m = message("headers", now);
    for i in 0..3 {
        m.properties.push((format!("p{i}"), "h".repeat(30 * 1024)));
    }
    let e = within("headers", q.schedule(m)).await.unwrap_err();
    assert!(
        matches!(&e, RetryQueueError::Refused { status: 403, detail } if detail.contains("headers")),
        "{e:?}"
    );
    let mut m = message("ttl", now);
    m.time_to_live = Some(Duration::ZERO);
    let e = within("ttl", q.schedule(m)).await.unwrap_err();
    assert!(
        matches!(&e, RetryQueueError::Refused { status: 400, detail } if detail.contains("TimeToLive")),
        "{e:?}"
    );
    assert_eq!(emu.counters("retries").unwrap().sends, 0);
}

#[tokio::test]
async fn a_throttled_namespace_answers_server_busy_and_the_client_backs_off() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = queue_client(&emu, "retries");
    emu.faults().server_busy_for(Duration::from_secs(3600));
    let e = within("busy send", q.schedule(message("a", SystemTime::now())))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RetryQueueError::Throttled { status: 503, .. }),
        "{e:?}"
    );
    assert!(e.is_transient() && !e.is_refusal_of_request());
    let e = within("busy receive", q.receive(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(matches!(e, RetryQueueError::Throttled { .. }), "{e:?}");
    emu.faults().clear();
    within("after", q.schedule(message("a", SystemTime::now())))
        .await
        .unwrap();
}

#[tokio::test]
async fn queues_configured_outside_azures_ranges_are_refused_at_start() {
    type Change = fn(&mut QueueSpec);
    let cases: Vec<(Change, &str)> = vec![
        (
            |q| q.lock_duration = Duration::from_secs(301),
            "LockDuration",
        ),
        (|q| q.lock_duration = Duration::from_secs(4), "LockDuration"),
        (
            |q| q.duplicate_detection_window = Some(Duration::from_secs(10)),
            "DuplicateDetectionHistoryTimeWindow",
        ),
        (
            |q| q.duplicate_detection_window = Some(Duration::from_secs(8 * 24 * 3600)),
            "DuplicateDetectionHistoryTimeWindow",
        ),
        (|q| q.max_message_size_kb = 512, "MaxMessageSizeInKilobytes"),
        (|q| q.max_delivery_count = 0, "MaxDeliveryCount"),
    ];
    for (change, named) in cases {
        let mut spec = QueueSpec::new("retries");
        change(&mut spec);
        let e = ServiceBusEmulator::start(ServiceBusConfig {
            queues: vec![spec],
            ..Default::default()
        })
        .await
        .expect_err(named);
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains(named), "{e}");
    }
}

// ---- Send Message Batch: concurrent sends coalesced into one request. ----

/// `n` sends at once through one client; each one's answer by MessageId. The sends are
/// polled together in one task (not spawned), so every one of them has reached the client
/// before any request can be answered: the sends that find every request slot taken wait,
/// and go as batches, however loaded the machine is.
async fn send_at_once(
    q: std::sync::Arc<ServiceBusRetryQueue>,
    ids: Vec<String>,
    due: SystemTime,
) -> Vec<(String, Result<(), RetryQueueError>)> {
    let sends = ids.into_iter().map(|id| {
        let q = q.clone();
        async move {
            let r = q.schedule(message(&id, due)).await;
            (id, r)
        }
    });
    within("the sends", futures::future::join_all(sends)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_at_once_go_as_batches_and_every_message_arrives_once_intact() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let q = std::sync::Arc::new(queue_client(&emu, "retries"));
    let due = SystemTime::now() + Duration::from_secs(30);
    let ids: Vec<String> = (0..400).map(|i| format!("batched-{i:03}")).collect();
    let answers = send_at_once(q.clone(), ids.clone(), due).await;
    assert!(answers.iter().all(|(_, r)| r.is_ok()), "{answers:?}");
    let c = emu.counters("retries").unwrap();
    assert_eq!(c.scheduled, 400, "each message once: {c:?}");
    assert!(
        emu.batches_accepted() > 0,
        "400 sends at once went as batches"
    );
    // A batched message keeps what a single send carries: its due time (invisible before),
    // MessageId, CorrelationId, Label, content type, custom properties and body.
    assert!(within("nothing due", q.receive(Duration::ZERO))
        .await
        .unwrap()
        .is_none());
    emu.clock().advance(Duration::from_secs(31));
    let mut seen = std::collections::BTreeSet::new();
    while let Some(m) = within("receive", q.receive(Duration::ZERO)).await.unwrap() {
        let id = m.message_id.clone();
        assert_eq!(
            m.correlation_id.as_deref(),
            Some(format!("corr-{id}").as_str())
        );
        assert_eq!(m.label.as_deref(), Some("order.created"));
        assert_eq!(m.body, format!("{{\"id\":\"{id}\",\"text\":\"grüße\"}}"));
        assert_eq!(m.properties.get("attempt").map(String::as_str), Some("2"));
        assert_eq!(
            m.properties.get("idempotency-key").map(String::as_str),
            Some(id.as_str())
        );
        within("complete", m.complete()).await.unwrap();
        assert!(seen.insert(id), "delivered once");
    }
    assert_eq!(seen.len(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_holding_a_refused_message_is_refused_whole_and_only_that_message_fails() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    emu.refuse_messages_containing("poison-077");
    let q = std::sync::Arc::new(queue_client(&emu, "retries"));
    let ids: Vec<String> = (0..200).map(|i| format!("poison-{i:03}")).collect();
    let answers = send_at_once(q, ids, SystemTime::now()).await;
    for (id, r) in &answers {
        if id == "poison-077" {
            assert!(
                matches!(r, Err(RetryQueueError::Refused { status: 400, .. })),
                "{r:?}"
            );
        } else {
            assert!(r.is_ok(), "{id}: {r:?}");
        }
    }
    let c = emu.counters("retries").unwrap();
    assert_eq!(c.active, 199, "{c:?}");
}

#[tokio::test]
async fn a_malformed_or_oversized_batch_is_refused_as_azure_does() {
    let emu = emulator_with(vec![QueueSpec::new("retries")], None).await;
    let cs: ConnectionString = emu.connection_string().parse().unwrap();
    let url = format!("http://{}/retries/messages", emu.local_addr());
    let expiry = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let token = cs
        .key
        .token(&format!("https://{}/retries", cs.host), expiry);
    let http = reqwest::Client::new();
    let post = |content_type: &'static str, body: String| {
        http.post(&url)
            .header("authorization", token.clone())
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    const BATCH: &str = "application/vnd.microsoft.servicebus.json";
    let ok = within(
        "a batch",
        post(BATCH, r#"[{"Body":"a"},{"Body":"b"}]"#.into()),
    )
    .await
    .unwrap();
    assert_eq!(ok.status().as_u16(), 201);
    for (what, content_type, body, status) in [
        (
            "with a charset",
            "application/vnd.microsoft.servicebus.json; charset=utf-8",
            r#"[{"Body":"a"}]"#.to_string(),
            400,
        ),
        ("empty", BATCH, "[]".to_string(), 400),
        ("not an array", BATCH, r#"{"Body":"a"}"#.to_string(), 400),
        (
            "a Body that is not a string",
            BATCH,
            r#"[{"Body":7}]"#.to_string(),
            400,
        ),
        (
            "over 256 KB",
            BATCH,
            format!(
                r#"[{{"Body":"{}"}},{{"Body":"{}"}}]"#,
                "x".repeat(130 * 1024),
                "y".repeat(130 * 1024)
            ),
            403,
        ),
    ] {
        let r = within(what, post(content_type, body)).await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{what}");
    }
    // Nothing of a refused batch was enqueued.
    assert_eq!(emu.counters("retries").unwrap().active, 2);
}
