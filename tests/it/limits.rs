//! hubguard handles every event the hub accepts and every key a producer sends, on emulators
//! that refuse what Azure refuses: a 1 MB event fails and is retried through a small claim-check
//! message, a 300-character key stays within Service Bus's 128-character MessageIds, a message
//! Service Bus refuses dead-letters its event instead of holding the partition forever, and
//! throttling holds and backs off without dead-lettering anything.

use std::sync::Arc;
use std::time::Duration;

use hubguard::ledger::State;
use hubguard::policy::DeadLetterReason;

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);

/// A body of exactly `len` bytes that the scripted handler reads as `instruction`.
fn padded(instruction: &str, len: usize) -> String {
    let mut b = format!("{instruction}#");
    b.push_str(&"x".repeat(len - b.len()));
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_byte_event_is_delivered_first_time_and_after_a_failure() {
    let bed = Bed::start(1).await;
    bed.sb.queue("retries").unwrap().record_accepted();
    bed.send_one(0, "big-ok", &padded("ok", 1_000_000)).await;
    bed.send_one(0, "big-flaky", &padded("fail:1", 1_000_000))
        .await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("both delivered", &run.health, LIMIT, || async {
        let d = handler.delivered_keys();
        d.contains("big-ok")
            && d.contains("big-flaky")
            && recorded_delivered(&bed, &["big-flaky"]).await
    })
    .await;
    // Which attempts ran (a partition that changes hands on a loaded machine may replay an
    // attempt before its checkpoint: at least once, never a new attempt number).
    let attempts = |key: &str| {
        let mut a = handler.calls_of(key);
        a.sort_unstable();
        a.dedup();
        a
    };
    assert_eq!(attempts("big-ok"), vec![1]);
    assert_eq!(attempts("big-flaky"), vec![1, 2]);
    let rec = bed.ledger().record("big-flaky").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
    assert_eq!(
        rec.event.body.len(),
        1_000_000,
        "the ledger holds the event"
    );
    wait_for("checkpoint past both", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(1)
    })
    .await;
    run.stop().await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(sb.sends, 1);
    assert!(
        sb.largest_body < 4 * 1024,
        "the retry message is a claim check, not the event: {} bytes",
        sb.largest_body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_300_character_key_that_fails_once_is_retried_under_a_bounded_message_id() {
    let bed = Bed::start(1).await;
    bed.sb.queue("retries").unwrap().record_accepted();
    let long = format!("order/{}", "é-long-key-".repeat(27));
    assert!(long.chars().count() >= 300);
    bed.send(0, &[(&long, "fail:1"), ("after", "ok")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("long key delivered", &run.health, LIMIT, || async {
        handler.delivered_keys().contains(&long) && recorded_delivered(&bed, &[&long]).await
    })
    .await;
    assert_eq!(handler.calls_of(&long), vec![1, 2]);
    let rec = bed.ledger().record(&long).await.unwrap().unwrap();
    assert_eq!(rec.key, long, "the readable key stays in the ledger");
    assert_eq!(rec.state(), State::Delivered);
    run.stop().await;
    let accepted = bed.sb.queue("retries").unwrap().accepted();
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    let (id, _) = &accepted[0];
    assert!(id.chars().count() <= 128, "{id}");
    assert_eq!(
        hubguard::pipeline::settle::unqualified(id),
        hubguard::pipeline::settle::message_id(&long, 2)
    );
    assert_eq!(bed.ledger().keys().await.unwrap(), vec![long]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_message_service_bus_refuses_dead_letters_its_event_and_the_partition_moves_on() {
    let bed = Bed::start(1).await;
    bed.sb.refuse_messages_containing("refused-one");
    bed.send(0, &[("refused-one", "fail:1"), ("after", "ok")])
        .await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let ledger = bed.ledger();
    wait_for("refused event dead-lettered", &run.health, LIMIT, || async {
        matches!(ledger.record("refused-one").await, Ok(Some(r)) if r.state() == State::DeadLettered)
    })
    .await;
    let rec = ledger.record("refused-one").await.unwrap().unwrap();
    assert_eq!(
        rec.dead_letter_reason(),
        Some(DeadLetterReason::RetryRefused)
    );
    let error = rec.last_error.unwrap_or_default();
    assert!(
        error.contains("400") && error.contains("refused"),
        "the reason says what Azure refused: {error}"
    );
    assert_eq!(
        ledger.dead_letter_keys().await.unwrap(),
        vec!["refused-one".to_string()]
    );
    wait_for("the partition moves on", &run.health, LIMIT, || async {
        handler.delivered_keys().contains("after") && bed.checkpoint_of("0").await == Some(1)
    })
    .await;
    assert!(run.health.held().is_empty(), "{:?}", run.health.held());
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_from_service_bus_or_blob_storage_holds_and_backs_off_and_dead_letters_nothing()
{
    let bed = Bed::start(2).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    bed.send(0, &[("warm-0", "ok")]).await;
    bed.send(1, &[("warm-1", "ok")]).await;
    wait_for("warmed up", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(0) && bed.checkpoint_of("1").await == Some(0)
    })
    .await;

    // Service Bus throttles: the failed event cannot be scheduled, so its partition holds.
    bed.sb.faults().server_busy_for(Duration::from_secs(3600));
    bed.send(0, &[("sb-throttled", "fail:1"), ("sb-behind", "ok")])
        .await;
    wait_for(
        "held on Service Bus throttling",
        &run.health,
        LIMIT,
        || async {
            run.health
                .held()
                .get("0")
                .is_some_and(|h| h.reason.contains("throttling"))
        },
    )
    .await;
    assert!(!run.health.ready());
    bed.sb.faults().clear();

    // Blob storage throttles: the ledger cannot record the failure, and the processor cannot
    // list or renew ownerships. Whichever meets the throttling first, readiness names it:
    // the partition held on the ledger's write, or the consumer failing on the listing (its
    // partitions then unowned, read again once it recovers). Either way nothing passes.
    bed.blob.faults().server_busy_for(Duration::from_secs(3600));
    bed.send(1, &[("blob-throttled", "fail:1")]).await;
    wait_for("blob throttling named", &run.health, LIMIT, || async {
        let held = run
            .health
            .held()
            .get("1")
            .is_some_and(|h| h.reason.contains("ServerBusy"));
        let not_ready = run.health.not_ready_reasons();
        held || not_ready.iter().any(|r| r.contains("ServerBusy"))
    })
    .await;
    assert!(!run.health.ready());
    bed.blob.faults().clear();

    wait_for("everything delivered after", &run.health, LIMIT, || async {
        let d = handler.delivered_keys();
        ["sb-throttled", "sb-behind", "blob-throttled"]
            .iter()
            .all(|k| d.contains(*k))
            && recorded_delivered(&bed, &["sb-throttled"]).await
            && matches!(
                bed.ledger()
                    .record("blob-throttled")
                    .await
                    .map(|r| r.map(|r| r.state())),
                Ok(None | Some(State::Delivered))
            )
    })
    .await;
    let ledger = bed.ledger();
    let rec = ledger.record("sb-throttled").await.unwrap().unwrap();
    assert_eq!(rec.state(), State::Delivered);
    // blob-throttled's failure was recorded once blob storage answered (then its record says
    // delivered) — or never, when the throttled processor gave its partitions up before the
    // ledger answered: the event was then read again from the checkpoint and delivered as a
    // first attempt, which leaves no record (a delivery costs no ledger write).
    let calls = handler.calls_of("blob-throttled");
    match ledger.record("blob-throttled").await.unwrap() {
        Some(rec) => assert_eq!(rec.state(), State::Delivered, "{calls:?}"),
        None => assert!(
            calls.len() >= 2 && calls.iter().all(|a| *a == 1),
            "read again from its start, as a first attempt: {calls:?}"
        ),
    }
    assert!(ledger.dead_letter_keys().await.unwrap().is_empty());
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_retry_queue_holds_the_partition_and_readiness_names_it() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    let sb_cs: hubguard::azure::ConnectionString = bed.sb.connection_string().parse().unwrap();
    parts.queue = Arc::new(
        hubguard::azure::ServiceBusRetryQueue::new(
            &sb_cs,
            "no-such-queue",
            hubguard::azure::retry_queue::ServiceBusOptions {
                deadline: Duration::from_secs(3),
            },
        )
        .unwrap()
        .with_clock(bed.clock()),
    );
    let run = Bed::run(parts);
    bed.send(0, &[("needs-a-retry", "fail:1"), ("behind", "ok")])
        .await;
    wait_for("held, naming the queue", &run.health, LIMIT, || async {
        run.health.held().get("0").is_some_and(|h| {
            h.reason.contains("Service Bus refuses the request")
                && h.reason.contains("410")
                && h.reason.contains("no-such-queue")
        })
    })
    .await;
    assert!(!run.health.ready());
    assert!(
        handler.calls_of("behind").is_empty(),
        "nothing passes the held event"
    );
    assert_eq!(bed.checkpoint_of("0").await, None);
    let rec = bed.ledger().record("needs-a-retry").await.unwrap().unwrap();
    assert_eq!(rec.state(), State::RetryScheduled, "not dead-lettered");
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_cloudevents_id_from_two_sources_is_two_events_each_retried_on_its_own() {
    use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
    let bed = Bed::start(2).await;
    let prod = crate::common::producer(&bed.cs, "hub").await;
    for (partition, source) in [("0", "/a"), ("1", "/b")] {
        let ev = EventData::builder()
            .with_body(b"fail:1".to_vec())
            .add_property("ce_id".into(), AmqpSimpleValue::String("dup-2".into()))
            .add_property("ce_source".into(), AmqpSimpleValue::String(source.into()))
            .build();
        crate::common::within(
            "send",
            prod.send_event(
                ev,
                Some(azure_messaging_eventhubs::SendEventOptions {
                    partition_id: Some(partition.into()),
                }),
            ),
        )
        .await
        .unwrap();
    }
    crate::common::within("close", prod.close()).await.unwrap();
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("both delivered", &run.health, LIMIT, || async {
        let d = handler.delivered_keys();
        d.contains("/a|dup-2")
            && d.contains("/b|dup-2")
            && recorded_delivered(&bed, &["/a|dup-2", "/b|dup-2"]).await
    })
    .await;
    assert_eq!(handler.calls_of("/a|dup-2"), vec![1, 2]);
    assert_eq!(handler.calls_of("/b|dup-2"), vec![1, 2]);
    let ledger = bed.ledger();
    for (key, partition) in [("/a|dup-2", "0"), ("/b|dup-2", "1")] {
        let rec = ledger.record(key).await.unwrap().unwrap();
        assert_eq!(rec.state(), State::Delivered, "{key}");
        assert_eq!(rec.event.partition_id, partition, "{key}");
    }
    run.stop().await;
}

/// Whether the ledger records each of `keys` delivered: a retry's delivery is written once
/// the handler has answered, so the handler's word alone comes a moment early.
async fn recorded_delivered(bed: &Bed, keys: &[&str]) -> bool {
    let ledger = bed.ledger();
    for k in keys {
        match ledger.record(k).await {
            Ok(Some(r)) if r.state() == State::Delivered => {}
            _ => return false,
        }
    }
    true
}
