//! A refusal of one request never holds a partition: an event whose dead letter Service Bus
//! cannot take as it is (100 application properties, properties far over Service Bus's
//! header limits) is still dead-lettered, the partition checkpoints past it and readiness
//! recovers; a retry message refused with 431 dead-letters its event. And the Service Bus
//! emulator refuses custom properties exactly as the quotas say (at most 255, 32 KB each,
//! 64 KB of headers), never with its HTTP server's own 431.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
use hubguard::azure::{
    ConnectionString, OutgoingMessage, ReceivedMessage, RetryQueue, RetryQueueError,
    ServiceBusRetryQueue,
};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use hubguard::ledger::State;
use hubguard::pipeline::dead_letter::{DeadLetterDestination, PROBE_LABEL};
use hubguard::policy::DeadLetterReason;

use crate::common::{producer, within};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);

fn sb_queue(sb: &ServiceBusEmulator, name: &str) -> ServiceBusRetryQueue {
    let cs: ConnectionString = sb.connection_string().parse().unwrap();
    ServiceBusRetryQueue::new(
        &cs,
        name,
        hubguard::azure::retry_queue::ServiceBusOptions {
            deadline: Duration::from_secs(5),
        },
    )
    .unwrap()
}

fn message(id: &str, properties: Vec<(String, String)>) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.into(),
        correlation_id: None,
        label: None,
        body: "body".into(),
        content_type: None,
        due: SystemTime::UNIX_EPOCH,
        time_to_live: None,
        properties,
    }
}

fn props(n: usize, value_len: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| (format!("p{i}"), "v".repeat(value_len)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_bus_takes_up_to_255_custom_properties_and_refuses_more_as_azure_does() {
    let sb = ServiceBusEmulator::start(ServiceBusConfig::default())
        .await
        .unwrap();
    let q = sb_queue(&sb, "retries");
    // 100 and 255 properties are within Azure's quotas: accepted (not the HTTP server's 431).
    q.schedule(message("hundred", props(100, 8))).await.unwrap();
    q.schedule(message("max", props(255, 8))).await.unwrap();
    // 256: refused for what the message is, and said so.
    let too_many = q.schedule(message("too-many", props(256, 8))).await;
    match &too_many {
        Err(
            e @ RetryQueueError::Refused {
                status: 400,
                detail,
            },
        ) => {
            assert!(detail.contains("too many properties"), "{detail}");
            assert!(e.is_refusal_of_request());
        }
        other => panic!("expected 400 too many properties, got {other:?}"),
    }
    // One property over 32 KB, and 64 KB of headers in all: 403 "message too large", a
    // refusal of that message too.
    for (id, p) in [
        ("huge-one", props(1, 33 * 1024)),
        ("huge-all", props(20, 4 * 1024)),
    ] {
        match q.schedule(message(id, p)).await {
            Err(e @ RetryQueueError::Refused { status: 403, .. }) => {
                assert!(e.is_refusal_of_request(), "{e}")
            }
            other => panic!("{id}: expected 403 too large, got {other:?}"),
        }
    }
    let c = sb.counters("retries").unwrap();
    assert_eq!(c.sends, 2, "only the two messages within the quotas");
}

/// Sends one event whose properties are `properties` (plus `ce_id`/`ce_type`).
async fn send_with_properties(bed: &Bed, key: &str, body: &str, properties: &[(String, String)]) {
    let prod = producer(&bed.cs, "hub").await;
    let mut ev = EventData::builder()
        .with_body(body.as_bytes().to_vec())
        .add_property("ce_id".into(), AmqpSimpleValue::String(key.into()))
        .add_property(
            "ce_type".into(),
            AmqpSimpleValue::String("test.event".into()),
        );
    for (k, v) in properties {
        ev = ev.add_property(k.clone(), AmqpSimpleValue::String(v.clone()));
    }
    within(
        "send",
        prod.send_event(
            ev.build(),
            Some(azure_messaging_eventhubs::SendEventOptions {
                partition_id: Some("0".into()),
            }),
        ),
    )
    .await
    .unwrap();
    within("close producer", prod.close()).await.unwrap();
}

async fn dead_letters(q: &ServiceBusRetryQueue, n: usize) -> HashMap<String, ReceivedMessage> {
    let mut out = HashMap::new();
    within("dead letters arrive", async {
        while out.len() < n {
            if let Some(m) = q.receive(Duration::from_millis(500)).await.unwrap() {
                if m.label.as_deref() != Some(PROBE_LABEL) {
                    out.insert(m.message_id.clone(), m);
                }
            }
        }
    })
    .await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_with_100_properties_or_huge_ones_refused_for_good_are_dead_lettered_and_the_partition_moves_on(
) {
    let mut bed = Bed::start(1).await;
    bed.sb = ServiceBusEmulator::start(ServiceBusConfig {
        queues: vec![QueueSpec::new("retries"), QueueSpec::new("dead-letters")],
        ..Default::default()
    })
    .await
    .unwrap();
    let dl = Arc::new(DeadLetterDestination::new(
        Arc::new(sb_queue(&bed.sb, "dead-letters")),
        "dead-letters",
        256,
    ));
    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-props");
    parts.options.dead_letters = Some(dl);
    let run = Bed::run(parts);

    // 100 application properties: each one a header of the dead-letter message.
    let hundred: Vec<(String, String)> = (0..100)
        .map(|i| (format!("app{i}"), format!("value-{i}")))
        .collect();
    send_with_properties(&bed, "many-props", "perm", &hundred).await;
    // Properties far beyond what a Service Bus message may carry (one of 40 KB, 30 of 3 KB:
    // Event Hubs takes them, up to 1 MB an event).
    let mut huge: Vec<(String, String)> = (0..30)
        .map(|i| (format!("big{i}"), format!("{i}-{}", "b".repeat(3000))))
        .collect();
    huge.push(("giant".into(), "g".repeat(40 * 1024)));
    send_with_properties(&bed, "huge-props", "perm", &huge).await;
    bed.send(0, &[("after", "ok")]).await;

    let ledger = bed.ledger();
    wait_for(
        "both dead-lettered, the partition checkpointed past them",
        &run.health,
        LIMIT,
        || async {
            let keys = ledger.dead_letter_keys().await.unwrap_or_default();
            keys.contains(&"many-props".to_string())
                && keys.contains(&"huge-props".to_string())
                && handler.delivered_keys().contains("after")
                && bed.checkpoint_of("0").await == Some(2)
        },
    )
    .await;
    for key in ["many-props", "huge-props"] {
        let rec = ledger.record(key).await.unwrap().unwrap();
        assert_eq!(rec.state(), State::DeadLettered, "{key}");
        assert_eq!(rec.dead_letter_reason(), Some(DeadLetterReason::Permanent));
    }
    wait_for("ready (/readyz 200) after", &run.health, LIMIT, || async {
        run.health.ready()
    })
    .await;
    assert!(run.health.held().is_empty(), "{:?}", run.health.held());

    // Both dead letters were published to the destination.
    let q = sb_queue(&bed.sb, "dead-letters");
    let got = dead_letters(&q, 2).await;
    let many = &got["many-props-deadletter-1"];
    assert_eq!(many.body, "perm", "the body fits: the full message");
    assert_eq!(many.properties["hubguard-dead-letter-reason"], "permanent");
    let rec = ledger.record("many-props").await.unwrap().unwrap();
    assert_eq!(rec.event.properties.len(), 102, "the ledger keeps them all");
    let copied: Vec<&String> = many
        .properties
        .keys()
        .filter(|k| rec.event.properties.contains_key(*k))
        .collect();
    assert!(copied.len() >= 50, "{copied:?}");
    for k in &copied {
        assert_eq!(many.properties[*k], rec.event.properties[*k], "{k}");
    }
    let omitted: usize = many.properties["hubguard-properties-omitted"]
        .parse()
        .unwrap();
    assert_eq!(
        copied.len() + omitted,
        102,
        "every property copied or counted"
    );
    let huge_msg = &got["huge-props-deadletter-1"];
    assert_eq!(
        huge_msg.properties["hubguard-dead-letter-reason"],
        "permanent"
    );
    assert!(
        huge_msg
            .properties
            .contains_key("hubguard-properties-omitted"),
        "what did not fit is counted: {:?}",
        huge_msg.properties.keys()
    );
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_message_refused_with_431_dead_letters_its_event_instead_of_holding() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-431"));
    bed.send(0, &[("warm", "ok")]).await;
    wait_for("warmed up", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(0)
    })
    .await;
    // Whatever in front of Service Bus answers 431 (Request Header Fields Too Large): it
    // concerns that request, not the service.
    bed.sb
        .faults()
        .error_status_for(431, Duration::from_secs(3600));
    bed.send(0, &[("refused-431", "fail:1"), ("behind", "ok")])
        .await;
    let ledger = bed.ledger();
    wait_for(
        "dead-lettered, and the partition moves on",
        &run.health,
        LIMIT,
        || async {
            matches!(ledger.record("refused-431").await, Ok(Some(r)) if r.state() == State::DeadLettered)
                && handler.delivered_keys().contains("behind")
                && bed.checkpoint_of("0").await == Some(2)
        },
    )
    .await;
    let rec = ledger.record("refused-431").await.unwrap().unwrap();
    assert_eq!(
        rec.dead_letter_reason(),
        Some(DeadLetterReason::RetryRefused)
    );
    assert!(
        rec.last_error.unwrap_or_default().contains("431"),
        "the reason names the status"
    );
    assert!(run.health.held().is_empty(), "{:?}", run.health.held());
    bed.sb.faults().clear();
    run.stop().await;
}
