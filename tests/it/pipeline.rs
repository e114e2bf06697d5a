//! End to end: the pipeline on the emulators with the real SDK crates. Every test ends by
//! checking that no event is lost: each produced event is delivered or dead-lettered.

use std::sync::Arc;
use std::time::Duration;

use hubguard::ledger::State;
use hubguard::policy::DeadLetterReason;

use crate::pipeline_support::*;
use hubguard::pipeline::settle::unqualified;

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn happy_path_writes_no_ledger_and_no_service_bus_and_batches_checkpoints() {
    let bed = Bed::start(2).await;
    let keys: Vec<String> = (0..40).map(|i| format!("ok-{i}")).collect();
    for p in 0..2 {
        let evs: Vec<(&str, &str)> = keys[p * 20..(p + 1) * 20]
            .iter()
            .map(|k| (k.as_str(), "ok"))
            .collect();
        bed.send(p, &evs).await;
    }
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("all delivered", &run.health, LIMIT, || async {
        handler.delivered_keys().len() == 40
    })
    .await;
    wait_for("checkpoints at the end", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(19) && bed.checkpoint_of("1").await == Some(19)
    })
    .await;
    let counters = run.health.snapshot();
    run.stop().await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(sb.sends, 0, "no Service Bus operation on the happy path");
    assert!(
        bed.ledger().keys().await.unwrap().is_empty(),
        "no ledger record on the happy path"
    );
    assert_eq!(counters.delivered, 40);
    assert!(
        counters.checkpoints < 40,
        "checkpoints are batched, not per event: {}",
        counters.checkpoints
    );
    for k in &keys {
        assert_eq!(handler.calls_of(k), vec![1], "{k} handled exactly once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_are_retried_to_delivery_with_the_ledger_history_right() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("a", "ok"), ("flaky", "fail:2"), ("b", "ok")])
        .await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let ledger = bed.ledger();
    wait_for("flaky delivered", &run.health, LIMIT, || async {
        matches!(ledger.record("flaky").await, Ok(Some(r)) if r.state() == State::Delivered)
    })
    .await;
    let rec = ledger.record("flaky").await.unwrap().unwrap();
    assert_eq!(rec.attempts, 3);
    assert_eq!(rec.correlation_id, "flaky");
    assert_eq!(rec.event_type.as_deref(), Some("test.event"));
    let outcomes: Vec<&str> = rec.history.iter().map(|h| h.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        vec!["retry_scheduled", "retry_scheduled", "delivered"]
    );
    assert_eq!(
        rec.history.iter().map(|h| h.attempt).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(rec
        .history
        .iter()
        .all(|h| h.trace_id.as_deref().is_some_and(|t| t.len() == 32)));
    // Every retry ran at or after its scheduled time.
    for w in rec.history.windows(2) {
        let due = w[0].next_attempt_ms.unwrap();
        assert!(
            w[1].started_ms + 1 >= due,
            "attempt {} started before it was due",
            w[1].attempt
        );
    }
    assert_eq!(handler.calls_of("flaky"), vec![1, 2, 3]);
    // The partition was never held back by the retries: b was delivered right away.
    assert_eq!(handler.calls_of("b"), vec![1]);
    wait_for("checkpoint past all three", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(2)
    })
    .await;
    run.stop().await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(
        (sb.sends, sb.duplicates_dropped, sb.completes),
        (2, 0, 2),
        "exactly one retry message per failure"
    );
    assert_eq!(sb.active + sb.scheduled + sb.locked, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failures_are_dead_lettered_at_once_and_exhaustion_by_attempts_and_age() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("perm", "perm"), ("never", "fail:99"), ("ok", "ok")])
        .await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(3), "replica-a"));
    let ledger = bed.ledger();
    wait_for("both dead-lettered", &run.health, LIMIT, || async {
        let a =
            matches!(ledger.record("perm").await, Ok(Some(r)) if r.state() == State::DeadLettered);
        let b =
            matches!(ledger.record("never").await, Ok(Some(r)) if r.state() == State::DeadLettered);
        a && b
    })
    .await;
    let perm = ledger.record("perm").await.unwrap().unwrap();
    assert_eq!(
        (perm.attempts, perm.dead_letter_reason().clone()),
        (1, Some(DeadLetterReason::Permanent))
    );
    let never = ledger.record("never").await.unwrap().unwrap();
    assert_eq!(
        (never.attempts, never.dead_letter_reason().clone()),
        (3, Some(DeadLetterReason::AttemptsExhausted))
    );
    assert_eq!(handler.calls_of("never"), vec![1, 2, 3]);
    let mut dl = ledger.dead_letter_keys().await.unwrap();
    dl.sort();
    assert_eq!(dl, vec!["never", "perm"]);
    run.stop().await;
    assert_eq!(
        bed.sb.counters("retries").unwrap().sends,
        2,
        "no retry message for the permanent failure"
    );

    // By age: a policy whose next attempt would fall outside max_age dead-letters at once.
    let bed = Bed::start(1).await;
    bed.send(0, &[("old", "fail:5")]).await;
    let mut policy = fast_policy(10);
    policy.base_s = 5;
    policy.floor_s = 5;
    policy.max_age_s = Some(2);
    let run = Bed::run(bed.parts(handler.clone(), policy, "replica-a"));
    let ledger = bed.ledger();
    wait_for("old dead-lettered", &run.health, LIMIT, || async {
        matches!(ledger.record("old").await, Ok(Some(r)) if r.dead_letter_reason() == Some(DeadLetterReason::AgeExceeded))
    })
    .await;
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_bus_down_holds_the_partition_and_everything_settles_after_recovery() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("first", "ok")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("first checkpointed", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(0)
    })
    .await;

    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    bed.send(
        0,
        &[("stuck", "fail:1"), ("behind-1", "ok"), ("behind-2", "ok")],
    )
    .await;
    wait_for(
        "partition held on Service Bus",
        &run.health,
        LIMIT,
        || async {
            run.health
                .held()
                .get("0")
                .is_some_and(|h| h.reason.contains("Service Bus") && h.oldest_unsettled == 1)
        },
    )
    .await;
    assert!(!run.health.ready(), "not ready while a partition is held");
    // Held through several checkpoint intervals (its settlement failing 4 more times, in
    // the partition's task): the checkpoint must not pass the event.
    settle_failures(&run.health, 4).await;
    assert_eq!(
        bed.checkpoint_of("0").await,
        Some(0),
        "the checkpoint never passes an unsettled event"
    );
    assert!(
        handler.calls_of("behind-1").is_empty(),
        "nothing behind the held event is processed"
    );

    bed.sb.faults().clear();
    wait_for(
        "all delivered after recovery",
        &run.health,
        LIMIT,
        || async {
            let d = handler.delivered_keys();
            ["first", "stuck", "behind-1", "behind-2"]
                .iter()
                .all(|k| d.contains(*k))
        },
    )
    .await;
    wait_for("checkpoint moves on", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(3)
    })
    .await;
    assert!(run.health.held().is_empty());
    let rec = bed.ledger().record("stuck").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_storage_down_holds_the_partition_and_everything_settles_after_recovery() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("partition claimed", &run.health, LIMIT, || async {
        run.health.owned().contains_key("0")
    })
    .await;
    bed.blob
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("stuck", "fail:1"), ("behind", "ok")]).await;
    wait_for(
        "partition held on blob storage",
        &run.health,
        LIMIT,
        || async {
            run.health
                .held()
                .get("0")
                .is_some_and(|h| h.reason.contains("blob storage"))
        },
    )
    .await;
    assert_eq!(
        bed.sb.counters("retries").unwrap().sends,
        0,
        "no retry is scheduled before the ledger records it"
    );
    bed.blob.faults().clear();
    wait_for(
        "all delivered after recovery",
        &run.health,
        LIMIT,
        || async {
            let d = handler.delivered_keys();
            d.contains("stuck") && d.contains("behind")
        },
    )
    .await;
    wait_for("checkpoint moves on", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(1)
    })
    .await;
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_after_a_crash_never_schedules_a_second_retry_and_continues_the_count() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("crashy", "fail:99")]).await;
    let handler = Arc::new(Scripted::default());
    // Far-off retries so that nothing runs on Service Bus during the test.
    let mut policy = fast_policy(10);
    // (700 s: beyond the 600 s duplicate-detection window, within the 1 h SAS token lifetime
    // that the emulator checks against its advanced clock.)
    policy.base_s = 700;
    policy.floor_s = 700;
    policy.cap_s = 700;
    let mut parts = bed.parts(handler.clone(), policy.clone(), "replica-a");
    parts.checkpoint_store = Arc::new(ShapedStore {
        inner: bed.checkpoint_store(),
        unclaimable: None,
        no_checkpoints: true,
    });
    let run = Bed::run(parts);
    let ledger = bed.ledger();
    wait_for("retry scheduled", &run.health, LIMIT, || async {
        run.health.snapshot().retries_scheduled == 1
    })
    .await;
    run.stop().await;
    assert_eq!(
        bed.checkpoint_of("0").await,
        None,
        "the crashed replica never checkpointed"
    );
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!((sb.sends, sb.scheduled), (1, 1));

    // The next owner replays the event from Event Hubs: the ledger already has attempt 1,
    // so the replay re-sends attempt 2 with the same MessageId and duplicate detection drops it.
    let run = Bed::run(bed.parts(handler.clone(), policy.clone(), "replica-b"));
    wait_for("replayed and checkpointed", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(0)
    })
    .await;
    run.stop().await;
    assert_eq!(
        handler.calls_of("crashy"),
        vec![1, 1],
        "the event was replayed once"
    );
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(
        (sb.sends, sb.duplicates_dropped, sb.scheduled),
        (2, 1, 1),
        "still exactly one retry message"
    );
    let rec = ledger.record("crashy").await.unwrap().unwrap();
    assert_eq!(
        (rec.attempts, rec.state()),
        (1, State::RetryScheduled),
        "a replay does not count a new attempt"
    );

    // A lost retry message: take it off the queue, let the duplicate window pass, replay.
    let q = bed.sb.queue("retries").unwrap();
    bed.sb.clock().advance(Duration::from_secs(701));
    let lost = q
        .try_lock(
            hubguard::emulator::servicebus::broker::Entity::Main,
            bed.sb.clock().now(),
        )
        .unwrap()
        .unwrap();
    q.complete(
        hubguard::emulator::servicebus::broker::Entity::Main,
        &lost.message.sequence_number.to_string(),
        &lost.lock_token,
        bed.sb.clock().now(),
    )
    .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&lost.message.body).unwrap();
    assert_eq!(body["attempt"], 2);
    // Rewind the checkpoint by using a fresh consumer group position: a new store replays from the start.
    let mut parts = bed.parts(handler.clone(), policy, "replica-c");
    parts.checkpoint_store = Arc::new(azure_messaging_eventhubs::InMemoryCheckpointStore::new());
    let run = Bed::run(parts);
    // The replay finds attempt 1 recorded and re-sends attempt 2 (the duplicate window has
    // passed, so it is accepted); its due time has passed on the emulator's clock, so the
    // retry loop runs it at once: as attempt 2, not as a fresh attempt 1.
    wait_for("the re-sent retry runs", &run.health, LIMIT, || async {
        handler.calls_of("crashy").len() >= 4
    })
    .await;
    run.stop().await;
    assert_eq!(
        handler.calls_of("crashy")[..4],
        [1, 1, 1, 2],
        "the attempt count continues from the ledger"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_for_an_event_already_delivered_completes_without_calling_the_handler() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("twice", "fail:1")]).await;
    let handler = Arc::new(Scripted::default());
    let mut policy = fast_policy(5);
    policy.base_s = 3;
    policy.floor_s = 3;
    let run = Bed::run(bed.parts(handler.clone(), policy, "replica-a"));
    let ledger = bed.ledger();
    wait_for("retry scheduled", &run.health, LIMIT, || async {
        run.health.snapshot().retries_scheduled == 1
    })
    .await;
    // Meanwhile the event got delivered (say, by a replay elsewhere): the ledger says so.
    let hubguard::ledger::Versioned {
        value: mut rec,
        etag,
    } = ledger.get("twice").await.unwrap().unwrap();
    // Delivered, its due time left as it was.
    rec.force_state(State::Delivered, rec.next_attempt_ms(), None);
    ledger.put(&rec, Some(&etag)).await.unwrap();
    wait_for("retry message completed", &run.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        c.completes == 1 && c.scheduled == 0 && c.active == 0
    })
    .await;
    run.stop().await;
    assert_eq!(
        handler.calls_of("twice"),
        vec![1],
        "the handler is not called for a delivered event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_partitions_and_one_stopping_mid_stream_loses_nothing() {
    let bed = Bed::start(4).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let b = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-b"));
    wait_for("both replicas own partitions", &a.health, LIMIT, || async {
        !a.health.owned().is_empty() && !b.health.owned().is_empty()
    })
    .await;
    let mut all = Vec::new();
    for p in 0..4 {
        let keys: Vec<String> = (0..25).map(|i| format!("p{p}-{i}")).collect();
        let bodies: Vec<(&str, &str)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), if i % 10 == 3 { "fail:1" } else { "ok" }))
            .collect();
        bed.send(p, &bodies).await;
        all.extend(keys);
    }
    wait_for("some delivered", &a.health, LIMIT, || async {
        handler.delivered_keys().len() >= 20
    })
    .await;
    a.stop().await; // replica A goes away mid-stream and gives its partitions back
    let owners = bed
        .checkpoint_store()
        .list_ownerships(&bed.cs.host, "hub", "$Default")
        .await
        .unwrap();
    assert!(
        owners
            .iter()
            .all(|o| o.owner_id.as_deref() != Some("replica-a")),
        "a graceful stop releases ownership: {owners:?}"
    );
    wait_for(
        "every event delivered",
        &b.health,
        Duration::from_secs(90),
        || async {
            let d = handler.delivered_keys();
            all.iter().all(|k| d.contains(k))
        },
    )
    .await;
    // Retries scheduled before a replay delivered the event still run (at least once) and
    // drain: nothing is left behind on Service Bus.
    wait_for("retry queue drained", &b.health, LIMIT, || async {
        let sb = bed.sb.counters("retries").unwrap();
        sb.active + sb.scheduled + sb.locked == 0
    })
    .await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_pauses_the_partition_defers_without_counting_and_opens_once() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    handler
        .outage
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let mut parts = bed.parts(handler.clone(), fast_policy(10), "replica-a");
    parts.breaker = Some(hubguard::breaker::BreakerConfig {
        enabled: true,
        consecutive_failures: 3,
        failure_ratio: None,
        ratio_window: 20,
        open_ms: 3000,
        spread_ms: 500,
        probe_timeout_ms: 3000,
        // Three new events fail in a row and open it (pacing at the brink would let a due
        // retry make the third failure instead: `recovery` tests that).
        brink_hold_ms: 0,
        ..Default::default()
    });
    let run = Bed::run(parts);
    let keys: Vec<String> = (0..20).map(|i| format!("b-{i:02}")).collect();
    let evs: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "ok")).collect();
    bed.send(0, &evs).await;
    wait_for(
        "partition paused by the breaker",
        &run.health,
        LIMIT,
        || async {
            run.health
                .held()
                .get("0")
                .is_some_and(|h| h.reason.starts_with("downstream breaker open"))
        },
    )
    .await;
    // Three failures opened it; the other 17 events wait in Event Hubs, not on Service Bus.
    let calls_while_open: usize = keys.iter().map(|k| handler.calls_of(k).len()).sum();
    assert_eq!(calls_while_open, 3, "no call while the breaker is open");
    assert_eq!(
        bed.sb.counters("retries").unwrap().sends,
        3,
        "one retry per real failure, none per waiting event"
    );
    // The downstream recovers while the breaker is still open.
    handler
        .outage
        .store(false, std::sync::atomic::Ordering::SeqCst);
    wait_for("every event delivered", &run.health, LIMIT, || async {
        keys.iter().all(|k| handler.delivered_keys().contains(k))
    })
    .await;
    wait_for("retries drained", &run.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        c.active + c.scheduled + c.locked == 0
    })
    .await;
    run.stop().await;
    let record = bed.breaker_record("handler").await.expect("breaker record");
    assert_eq!(
        record.opens, 1,
        "opened once, never re-opened or extended: {record:?}"
    );
    assert_eq!(record.open_until_ms, None, "closed again after the probe");
    // The three failed events ran again as attempt 2: a deferral consumes no attempt.
    let failed: Vec<&String> = keys
        .iter()
        .filter(|k| handler.calls_of(k).first() == Some(&1) && handler.calls_of(k).len() > 1)
        .collect();
    assert_eq!(failed.len(), 3, "{failed:?}");
    for k in failed {
        assert_eq!(handler.calls_of(k), vec![1, 2], "{k}");
        let rec = bed.ledger().record(k).await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_due_while_blob_storage_is_down_is_held_not_burnt_into_the_dead_letter_queue() {
    // Two deliveries and Service Bus dead-letters a message: abandoning on every failed
    // ledger read would lose the retry from hubguard's sight within a second.
    let mut queue = hubguard::emulator::servicebus::QueueSpec::new("retries");
    queue.max_delivery_count = 2;
    let bed = Bed::start_with_queue(1, queue).await;
    bed.send(0, &[("flaky", "fail:1")]).await;
    let handler = Arc::new(Scripted::default());
    // Due 5 s after the failure: Service Bus holds the message (scheduled up to the retry
    // lead early, never before the next whole second) for seconds, time to take the ledger
    // down before it comes due however slow the machine.
    let mut policy = fast_policy(5);
    policy.base_s = 5;
    policy.floor_s = 5;
    let run = Bed::run(bed.parts(handler.clone(), policy, "replica-a"));
    wait_for("the retry is scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == 1
    })
    .await;
    bed.blob
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    let before = run.health.snapshot().settle_failures;
    wait_for(
        "the retry loop retried the ledger several times",
        &run.health,
        LIMIT,
        || async { run.health.snapshot().settle_failures >= before + 5 },
    )
    .await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(
        sb.dead_lettered, 0,
        "held, not dead-lettered by Service Bus: {sb:?}"
    );
    assert_eq!(sb.locked, 1, "the message is held under its lock: {sb:?}");
    assert_eq!(
        handler.calls_of("flaky"),
        vec![1],
        "no attempt while the ledger is down"
    );

    bed.blob.faults().clear();
    wait_for("delivered on attempt 2", &run.health, LIMIT, || async {
        handler.delivered_keys().contains("flaky")
    })
    .await;
    wait_for("the message completed", &run.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        c.locked + c.active + c.scheduled == 0
    })
    .await;
    assert_eq!(bed.sb.counters("retries").unwrap().dead_lettered, 0);
    let rec = bed.ledger().record("flaky").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_service_bus_dead_lettered_are_put_back_and_nothing_else_is_touched() {
    use hubguard::emulator::servicebus::broker::{Entity, NewMessage};
    // One delivery without a settlement and Service Bus dead-letters: what a process that
    // died holding the same retry MaxDeliveryCount times leaves behind.
    let mut queue = hubguard::emulator::servicebus::QueueSpec::new("retries");
    queue.max_delivery_count = 1;
    let bed = Bed::start_with_queue(1, queue).await;
    bed.send(
        0,
        &[("stranded", "fail:1"), ("ran-before-the-crash", "fail:1")],
    )
    .await;
    let handler = Arc::new(Scripted::default());
    let policy = minute_policy();
    let run = Bed::run(bed.parts(handler.clone(), policy.clone(), "replica-a"));
    wait_for("both retries scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == 2
    })
    .await;
    run.stop().await;

    let q = bed.sb.queue("retries").unwrap();
    let clock = bed.clock();
    q.send(
        NewMessage {
            message_id: Some("someone-elses".into()),
            body: b"not a hubguard retry".to_vec(),
            ..Default::default()
        },
        clock.now(),
    )
    .unwrap();
    clock.advance(Duration::from_secs(61));
    for _ in 0..3 {
        let l = q.try_lock(Entity::Main, clock.now()).unwrap().unwrap();
        let seq = l.message.sequence_number.to_string();
        q.abandon(Entity::Main, &seq, &l.lock_token, clock.now())
            .unwrap();
    }
    assert_eq!(bed.sb.counters("retries").unwrap().dead_lettered, 3);
    // One of the two had run and settled before its process died (only the completion of
    // the message was lost).
    let ledger = bed.ledger();
    let hubguard::ledger::Versioned {
        value: mut rec,
        etag,
    } = ledger.get("ran-before-the-crash").await.unwrap().unwrap();
    rec.deliver();
    ledger.put(&rec, Some(&etag)).await.unwrap();

    let run = Bed::run(bed.parts(handler.clone(), policy, "replica-b"));
    wait_for(
        "the stranded retry delivered",
        &run.health,
        LIMIT,
        || async { handler.delivered_keys().contains("stranded") },
    )
    .await;
    wait_for(
        "only the foreign message left dead-lettered",
        &run.health,
        LIMIT,
        || async { bed.sb.counters("retries").unwrap().dead_lettered == 1 },
    )
    .await;
    assert_eq!(run.health.snapshot().rescued, 1);
    run.stop().await;
    assert_eq!(
        handler.calls_of("stranded"),
        vec![1, 2],
        "the same attempt 2"
    );
    let rec = ledger.record("stranded").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
    assert_eq!(
        handler.calls_of("ran-before-the-crash"),
        vec![1],
        "a settled event is not run again"
    );
    let left = q.messages(Entity::DeadLetter);
    assert_eq!(left.len(), 1);
    assert_eq!(
        left[0].body, b"not a hubguard retry",
        "left for an operator"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_the_ledger_records_but_no_message_will_run_is_recovered_by_the_sweep() {
    use hubguard::emulator::servicebus::broker::Entity;
    let bed = Bed::start(1).await;
    bed.sb.queue("retries").unwrap().record_accepted();
    bed.send(0, &[("orphan", "fail:1")]).await;
    let slow = hubguard::policy::RetryPolicy {
        base_s: 60,
        floor_s: 60,
        ..fast_policy(5)
    };
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), slow.clone(), "replica-a"));
    let ledger = bed.ledger();
    wait_for(
        "retry recorded and checkpointed",
        &run.health,
        LIMIT,
        || async {
            matches!(ledger.record("orphan").await, Ok(Some(r)) if r.state() == State::RetryScheduled)
                && bed.checkpoint_of("0").await == Some(0)
        },
    )
    .await;
    run.stop().await;
    // The retry message vanishes (as when Service Bus drops a repeat MessageId after a ledger
    // record was removed and written anew): nothing will ever run the retry.
    let clock = bed.clock();
    clock.advance(Duration::from_secs(61));
    let queue = bed.sb.queue("retries").unwrap();
    let taken = queue.take(Entity::Main, clock.now()).unwrap();
    assert!(taken.is_some_and(|m| unqualified(&m.message_id) == "orphan-attempt-2"));
    clock.advance(Duration::from_secs(10));

    let mut parts = bed.parts(handler.clone(), slow, "replica-a");
    parts.options.overdue_margin = Duration::from_secs(5);
    let run = Bed::run(parts);
    // The sweep counts the recovery after Service Bus took the new message, so on a busy
    // machine the retry can be delivered before the count moves: wait for both.
    wait_for("recovered and delivered", &run.health, LIMIT, || async {
        matches!(ledger.record("orphan").await, Ok(Some(r)) if r.state() == State::Delivered)
            && run.health.snapshot().recovered >= 1
    })
    .await;
    // Attempt numbers that ran (a replica restarting on a loaded machine may replay attempt 1
    // before its checkpoint: at least once, never a new number).
    let mut attempts = handler.calls_of("orphan");
    attempts.sort_unstable();
    attempts.dedup();
    assert_eq!(attempts, vec![1, 2]);
    assert_eq!(run.health.snapshot().recovered, 1);
    run.stop().await;
    let accepted: Vec<String> = queue.accepted().into_iter().map(|(id, _)| id).collect();
    assert_eq!(accepted.len(), 2, "{accepted:?}");
    assert!(
        unqualified(&accepted[1]).starts_with("orphan-attempt-2-recovered-"),
        "{accepted:?}"
    );
    // The pending list answered from the listing's tags: nothing waits any more.
    assert!(ledger.pending().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_lists_what_is_waiting_without_reading_records() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("w-1", "fail:9"), ("w-2", "ok"), ("w-3", "perm")])
        .await;
    let slow = hubguard::policy::RetryPolicy {
        base_s: 600,
        floor_s: 600,
        cap_s: 3600,
        ..fast_policy(5)
    };
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), slow, "replica-a"));
    let ledger = bed.ledger();
    wait_for("settled", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(2)
    })
    .await;
    run.stop().await;
    let pending = ledger.pending().await.unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!((pending[0].key.as_str(), pending[0].attempt), ("w-1", 2));
    assert!(pending[0]
        .last_error
        .as_deref()
        .is_some_and(|e| e.contains("scripted failure 1")));
    let rec = ledger.record("w-1").await.unwrap().unwrap();
    assert_eq!(Some(pending[0].due), rec.next_attempt_at());
}

/// A downstream that counts the calls in flight and holds every retry until the test lets
/// it go; first attempts fail at once.
struct Gated {
    clock: Arc<hubguard::clock::Clock>,
    in_flight: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
    gate: tokio::sync::Semaphore,
    retries: std::sync::Mutex<Vec<(String, std::time::SystemTime)>>,
}

#[async_trait::async_trait]
impl hubguard::handler::Handler for Gated {
    async fn handle(
        &self,
        event: &hubguard::event::Event,
        attempt: &hubguard::handler::Attempt,
    ) -> hubguard::handler::Outcome {
        use std::sync::atomic::Ordering::SeqCst;
        if attempt.number == 1 {
            return hubguard::handler::Outcome::Failed(hubguard::handler::Failure::transient(
                "first attempt fails",
            ));
        }
        self.retries
            .lock()
            .unwrap()
            .push((event.identity.idempotency_key.clone(), self.clock.now()));
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(now, SeqCst);
        self.gate.acquire().await.unwrap().forget();
        self.in_flight.fetch_sub(1, SeqCst);
        hubguard::handler::Outcome::Delivered
    }
}

impl Gated {
    /// A gated downstream on `clock` that lets `permits` retries through.
    fn new(clock: &Arc<hubguard::clock::Clock>, permits: usize) -> Arc<Self> {
        Arc::new(Self {
            clock: clock.clone(),
            in_flight: Default::default(),
            most: Default::default(),
            gate: tokio::sync::Semaphore::new(permits),
            retries: Default::default(),
        })
    }
}

/// Retries a minute after the failure: they sit scheduled until the test moves the clock.
fn minute_policy() -> hubguard::policy::RetryPolicy {
    let mut policy = fast_policy(5);
    policy.base_s = 60;
    policy.floor_s = 60;
    policy
}

/// Sends one event per key, bodies empty, to partition 0.
async fn send_keys(bed: &Bed, keys: &[String]) {
    let events: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "")).collect();
    bed.send(0, &events).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_taken_early_start_at_their_due_time_at_most_retry_concurrency_at_once() {
    use std::sync::atomic::Ordering::SeqCst;
    const N: usize = 24;
    const SLOTS: usize = 3;
    let bed = Bed::start(1).await;
    let clock = bed.clock();
    let keys: Vec<String> = (0..N).map(|i| format!("burst-{i:02}")).collect();
    send_keys(&bed, &keys).await;
    let handler = Gated::new(&clock, 0);
    let policy = minute_policy();
    let mut parts = bed.parts(handler.clone(), policy, "replica-a");
    parts.options.retry_concurrency = SLOTS;
    parts.options.retry_lead = Duration::from_secs(10);
    let run = Bed::run(parts);
    wait_for("every retry is scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == N as u64
    })
    .await;
    let ledger = bed.ledger();
    let mut due = std::collections::BTreeMap::new();
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        due.insert(k.clone(), rec.next_attempt_at().unwrap());
    }
    let last = *due.values().max().unwrap();

    // Ten seconds before they come due, Service Bus hands them over; the loop takes them all
    // in hand and starts none.
    clock.advance(last.duration_since(clock.now()).unwrap() - Duration::from_secs(10));
    wait_for("every retry is in hand", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().locked == N as u64
    })
    .await;
    assert!(
        handler.retries.lock().unwrap().is_empty(),
        "none before its due time"
    );

    // They come due in one instant: the attempts start, at most SLOTS at once.
    clock.advance(last.duration_since(clock.now()).unwrap_or_default());
    wait_for("the slots fill", &run.health, LIMIT, || async {
        handler.in_flight.load(SeqCst) == SLOTS
    })
    .await;
    handler.gate.add_permits(N);
    wait_for("every retry delivered", &run.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        handler.retries.lock().unwrap().len() == N && c.active + c.locked + c.scheduled == 0
    })
    .await;
    assert_eq!(handler.most.load(SeqCst), SLOTS, "calls in flight at most");
    for (k, started) in handler.retries.lock().unwrap().iter() {
        assert!(*started >= due[k], "{k} started before its due time");
    }
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2), "{k}");
    }
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_while_holding_retries_early_leaves_them_to_their_lock_expiry() {
    const N: usize = 8;
    let bed = Bed::start(1).await;
    let clock = bed.clock();
    let keys: Vec<String> = (0..N).map(|i| format!("held-{i}")).collect();
    send_keys(&bed, &keys).await;
    let handler = Gated::new(&clock, 1000);
    let policy = minute_policy();
    let replica = |owner: &str| {
        let mut parts = bed.parts(handler.clone(), policy.clone(), owner);
        parts.options.retry_lead = Duration::from_secs(10);
        parts
    };
    // replica-a runs until a crash: its futures are dropped, nothing is closed or settled.
    let pipeline = hubguard::pipeline::Pipeline::new(replica("replica-a"));
    let health = pipeline.health();
    let crash = tokio_util::sync::CancellationToken::new();
    let crashed =
        tokio::spawn(pipeline.run_until(tokio_util::sync::CancellationToken::new(), crash.clone()));
    wait_for("every retry is scheduled", &health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == N as u64
    })
    .await;
    let ledger = bed.ledger();
    let mut last = clock.now();
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        last = last.max(rec.next_attempt_at().unwrap());
    }
    clock.advance(last.duration_since(clock.now()).unwrap() - Duration::from_secs(10));
    wait_for("every retry is in hand", &health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().locked == N as u64
    })
    .await;

    // The process dies holding them: nothing is abandoned; their locks run out.
    crash.cancel();
    crate::common::within("crashed", crashed)
        .await
        .unwrap()
        .unwrap();
    let c = bed.sb.counters("retries").unwrap();
    assert_eq!((c.locked, c.abandons), (N as u64, 0), "{c:?}");
    assert!(handler.retries.lock().unwrap().is_empty());
    // The dead process's receives in flight end at their timeout (`retry_receive_wait`);
    // until then a message whose lock lapses would be locked again for them, and wait out a
    // second lock that nobody renews or settles.
    crate::common::eventually(
        "the crashed replica's receives end",
        crate::common::STEP,
        || async { crate::common::seen(bed.sb.counters("retries").unwrap(), |c| c.receiving == 0) },
    )
    .await;
    clock.advance(Duration::from_secs(61));

    // Another replica takes them once the locks lapse: each runs once, nothing is lost.
    let run = Bed::run(replica("replica-b"));
    wait_for("every retry delivered", &run.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        handler.retries.lock().unwrap().len() >= N && c.active + c.locked + c.scheduled == 0
    })
    .await;
    let mut ran: Vec<String> = handler
        .retries
        .lock()
        .unwrap()
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    ran.sort();
    assert_eq!(ran, keys, "each retry ran exactly once");
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2), "{k}");
    }
    assert_eq!(bed.sb.counters("retries").unwrap().dead_lettered, 0);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_lock_lapsed_while_held_runs_once_by_its_new_receiver() {
    const N: usize = 8;
    let bed = Bed::start(1).await;
    let clock = bed.clock();
    let keys: Vec<String> = (0..N).map(|i| format!("lapsed-{i}")).collect();
    send_keys(&bed, &keys).await;
    let handler = Gated::new(&clock, 1000);
    let policy = minute_policy();
    let mut parts = bed.parts(handler.clone(), policy, "replica-a");
    parts.options.retry_lead = Duration::from_secs(10);
    let run = Bed::run(parts);
    wait_for("every retry is scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == N as u64
    })
    .await;
    let ledger = bed.ledger();
    let mut last = clock.now();
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        last = last.max(rec.next_attempt_at().unwrap());
    }
    clock.advance(last.duration_since(clock.now()).unwrap() - Duration::from_secs(10));
    wait_for("every retry is in hand", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().locked == N as u64
    })
    .await;
    // Time jumps past the locks' expiry (a paused process): Service Bus hands the messages
    // out again, and the holder, whose renewal now fails, lets them go.
    clock.advance(Duration::from_secs(61));
    wait_for("every retry delivered", &run.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        handler.retries.lock().unwrap().len() >= N && c.active + c.locked + c.scheduled == 0
    })
    .await;
    let mut ran: Vec<String> = handler
        .retries
        .lock()
        .unwrap()
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    ran.sort();
    assert_eq!(ran, keys, "each retry ran exactly once");
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2), "{k}");
    }
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_busy_slots_leaves_due_retries_to_the_others() {
    const N: usize = 30;
    const SLOTS: usize = 3;
    let bed = Bed::start(1).await;
    let clock = bed.clock();
    let keys: Vec<String> = (0..N).map(|i| format!("backlog-{i:02}")).collect();
    send_keys(&bed, &keys).await;
    let (slow, quick) = (Gated::new(&clock, 0), Gated::new(&clock, 1000));
    let policy = minute_policy();
    let replica = |handler: Arc<Gated>, owner: &str| {
        let mut parts = bed.parts(handler, policy.clone(), owner);
        parts.options.retry_concurrency = SLOTS;
        parts.options.retry_lead = Duration::ZERO;
        parts
    };
    let a = Bed::run(replica(slow.clone(), "replica-a"));
    wait_for("every retry is scheduled", &a.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == N as u64
    })
    .await;
    // All come due while replica-a's downstream hangs on its first calls.
    clock.advance(Duration::from_secs(61));
    wait_for("replica-a's slots fill", &a.health, LIMIT, || async {
        slow.in_flight.load(std::sync::atomic::Ordering::SeqCst) == SLOTS
    })
    .await;
    // replica-a holds its calls and a few waiting for a slot (two per slot, and what its
    // receivers had in flight when it stopped taking more), not the backlog: replica-b runs
    // the rest meanwhile.
    let b = Bed::run(replica(quick.clone(), "replica-b"));
    wait_for("replica-b runs the backlog", &b.health, LIMIT, || async {
        quick.retries.lock().unwrap().len() >= N - 4 * SLOTS
    })
    .await;
    slow.gate.add_permits(N);
    wait_for("every retry delivered", &a.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        c.active + c.locked + c.scheduled == 0
    })
    .await;
    let ledger = bed.ledger();
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2), "{k}");
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_delivered_after_service_bus_refused_its_retry_settles_the_record_and_nothing_runs_again(
) {
    // Service Bus is down when the first attempt fails: the ledger records attempt 1 and its
    // retry, the message never goes out, and the partition is held. The process stops; the
    // next one replays the event from Event Hubs and delivers it on attempt 1.
    let bed = Bed::start(1).await;
    bed.sb.queue("retries").unwrap().record_accepted();
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("replayed", "fail:1")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let ledger = bed.ledger();
    wait_for("held on Service Bus", &run.health, LIMIT, || async {
        run.health
            .held()
            .get("0")
            .is_some_and(|h| h.reason.contains("Service Bus"))
    })
    .await;
    let rec = ledger.record("replayed").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::RetryScheduled, 1));
    run.stop().await;
    assert_eq!(
        bed.checkpoint_of("0").await,
        None,
        "the held event stays after the checkpoint"
    );

    bed.sb.faults().clear();
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.overdue_margin = Duration::from_secs(5);
    parts.options.dead_letter_sweep = Duration::from_millis(200);
    let run = Bed::run(parts);
    wait_for("the replay is delivered", &run.health, LIMIT, || async {
        handler.delivered_keys().contains("replayed") && bed.checkpoint_of("0").await == Some(0)
    })
    .await;
    // The ledger says what happened: delivered (and so does `status`).
    wait_for("the record says delivered", &run.health, LIMIT, || async {
        matches!(ledger.record("replayed").await, Ok(Some(r)) if r.state() == State::Delivered)
    })
    .await;
    let rec = ledger.record("replayed").await.unwrap().unwrap();
    assert_eq!(rec.next_attempt_ms(), None);
    assert!(
        hubguard::status::record_text(&rec).contains("state:           DELIVERED"),
        "{}",
        hubguard::status::record_text(&rec)
    );
    assert!(!ledger
        .pending()
        .await
        .unwrap()
        .iter()
        .any(|p| p.key == "replayed"));

    // Past the overdue margin the sweep runs over the ledger: a canary retry that is really
    // overdue (its record due after the delivered one's, so the sweep reaches it second) is
    // recovered — and the delivered event is not.
    let mut canary = rec.clone();
    canary.key = "canary".into();
    canary.event.identity.idempotency_key = "canary".into();
    canary.event.sequence_number = 99;
    canary.event.body = b"ok".to_vec();
    canary.history.clear();
    canary.schedule_retry(rec.updated_ms + 1_000);
    ledger.put(&canary, None).await.unwrap();
    bed.clock().advance(Duration::from_secs(30));
    wait_for(
        "the sweep recovered the canary",
        &run.health,
        LIMIT,
        || async {
            run.health.snapshot().recovered >= 1 && handler.delivered_keys().contains("canary")
        },
    )
    .await;
    run.stop().await;
    assert_eq!(
        handler.calls_of("replayed"),
        vec![1, 1],
        "the failure and the replay; no attempt 2"
    );
    let accepted: Vec<String> = bed
        .sb
        .queue("retries")
        .unwrap()
        .accepted()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert!(
        !accepted.iter().any(|id| id.starts_with("replayed-")),
        "no retry of the delivered event was ever sent: {accepted:?}"
    );
    let rec = ledger.record("replayed").await.unwrap().unwrap();
    assert_eq!(rec.state(), State::Delivered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_retries_whose_lock_lapses_at_service_bus_run_each_attempt_once() {
    const N: usize = 8;
    let bed = Bed::start(1).await;
    let sb_clock = bed.clock();
    // The pipeline on a clock of its own, stepped with Service Bus's except for one jump of
    // Service Bus's alone: what a step of its clock does, or lock renewals failing for a lock
    // duration.
    let clock = Arc::new(hubguard::clock::Clock::default());
    // Service Bus's jump alone is the point here: the pipeline must not follow Service Bus's
    // measured time (the correction of docs/clocks.md), or, depending on how soon it has
    // measured enough responses, it would jump too and run the copies early.
    clock.set_corrected(false);
    let step = |by: Duration| {
        clock.advance(by);
        sb_clock.advance(by);
    };
    let keys: Vec<String> = (0..N).map(|i| format!("twice-{i}")).collect();
    send_keys(&bed, &keys).await;
    let handler = Gated::new(&clock, 1000);
    let mut parts = bed
        .wiring_on("replica-a", clock.clone())
        .policy(minute_policy())
        .parts(handler.clone())
        .unwrap();
    parts.options.retry_lead = Duration::from_secs(10);
    // Room for every copy at once: nothing but the guard keeps two copies apart.
    parts.options.retry_concurrency = 2 * N;
    let run = Bed::run(parts);
    wait_for("every retry is scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == N as u64
    })
    .await;
    let ledger = bed.ledger();
    let mut last = clock.now();
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        last = last.max(rec.next_attempt_at().unwrap());
    }
    step(last.duration_since(clock.now()).unwrap() - Duration::from_secs(10));
    wait_for("every retry is in hand", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().locked == N as u64
    })
    .await;
    // Service Bus's clock alone passes the locks' expiry: it hands every message out again,
    // while the first copies still wait here for their due time, their locks good as far as
    // this process can tell.
    sb_clock.advance(Duration::from_secs(61));
    wait_for(
        "the second copies are in hand",
        &run.health,
        LIMIT,
        || async {
            let c = bed.sb.counters("retries").unwrap();
            c.locked == N as u64 && c.active == 0
        },
    )
    .await;
    // Both copies of every message come due at once.
    step(Duration::from_secs(10));
    wait_for("every retry delivered", &run.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        handler.retries.lock().unwrap().len() >= N && c.active + c.locked + c.scheduled == 0
    })
    .await;
    run.stop().await;
    let mut calls = std::collections::BTreeMap::<String, usize>::new();
    for (k, _) in handler.retries.lock().unwrap().iter() {
        *calls.entry(k.clone()).or_default() += 1;
    }
    let once: std::collections::BTreeMap<String, usize> =
        keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(calls, once, "attempt 2 of each key ran exactly once");
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2), "{k}");
    }
    assert_eq!(bed.sb.counters("retries").unwrap().dead_lettered, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_handed_to_another_replica_stands_down_on_the_ledger_claim() {
    const N: usize = 8;
    let bed = Bed::start(1).await;
    let sb_clock = bed.clock();
    // Both replicas on a pipeline clock of their own (see the test above).
    let clock = Arc::new(hubguard::clock::Clock::default());
    // Service Bus's jump alone is the point here: the pipeline must not follow Service Bus's
    // measured time (the correction of docs/clocks.md), or, depending on how soon it has
    // measured enough responses, it would jump too and run the copies early.
    clock.set_corrected(false);
    let step = |by: Duration| {
        clock.advance(by);
        sb_clock.advance(by);
    };
    let keys: Vec<String> = (0..N).map(|i| format!("across-{i}")).collect();
    send_keys(&bed, &keys).await;
    let handler = Gated::new(&clock, 1000);
    let replica = |owner: &str, prefetch: usize| {
        let mut parts = bed
            .wiring_on(owner, clock.clone())
            .policy(minute_policy())
            .parts(handler.clone())
            .unwrap();
        parts.options.retry_lead = Duration::from_secs(10);
        parts.options.retry_prefetch = prefetch;
        parts
    };
    // replica-a takes no more than the N first copies in hand.
    let a = Bed::run(replica("replica-a", N));
    wait_for(
        "every retry is scheduled and checkpointed",
        &a.health,
        LIMIT,
        || async {
            bed.sb.counters("retries").unwrap().scheduled == N as u64
                && bed.checkpoint_of("0").await == Some(N as i64 - 1)
        },
    )
    .await;
    let ledger = bed.ledger();
    let mut last = clock.now();
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        last = last.max(rec.next_attempt_at().unwrap());
    }
    step(last.duration_since(clock.now()).unwrap() - Duration::from_secs(10));
    wait_for("replica-a holds every retry", &a.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().locked == N as u64
    })
    .await;
    let b = Bed::run(replica("replica-b", 1024));
    // Service Bus's clock alone passes the locks' expiry: the second copies can only go to
    // replica-b, while replica-a's first copies wait for their due time.
    sb_clock.advance(Duration::from_secs(61));
    wait_for(
        "replica-b holds the second copies",
        &b.health,
        LIMIT,
        || async {
            let c = bed.sb.counters("retries").unwrap();
            c.locked == N as u64 && c.active == 0
        },
    )
    .await;
    // Both copies of every message come due at once, one in each replica: one claims the
    // attempt and runs it, the other finds the claim and waits.
    step(Duration::from_secs(10));
    wait_for(
        "every attempt ran and settled",
        &a.health,
        LIMIT,
        || async {
            if handler.retries.lock().unwrap().len() < N {
                return false;
            }
            for k in &keys {
                match ledger.record(k).await {
                    Ok(Some(r)) if r.state() == State::Delivered => {}
                    _ => return false,
                }
            }
            true
        },
    )
    .await;
    // Once the claims have expired (the clocks agree again), the waiting copies read the
    // record, find the event delivered and complete their message.
    clock.advance(Duration::from_secs(61));
    wait_for("every message completed", &a.health, LIMIT, || async {
        let c = bed.sb.counters("retries").unwrap();
        c.active + c.locked + c.scheduled == 0
    })
    .await;
    a.stop().await;
    b.stop().await;
    let mut calls = std::collections::BTreeMap::<String, usize>::new();
    for (k, _) in handler.retries.lock().unwrap().iter() {
        *calls.entry(k.clone()).or_default() += 1;
    }
    let once: std::collections::BTreeMap<String, usize> =
        keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(calls, once, "attempt 2 of each key ran exactly once");
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2), "{k}");
    }
    assert_eq!(bed.sb.counters("retries").unwrap().dead_lettered, 0);
}

/// The bed's records, with listings refused (blob storage failing only those).
struct Unlistable(Arc<dyn hubguard::azure::RecordStore>);

#[async_trait::async_trait]
impl hubguard::azure::RecordStore for Unlistable {
    async fn read(
        &self,
        key: &str,
    ) -> Result<Option<hubguard::azure::Record>, hubguard::azure::StoreError> {
        self.0.read(key).await
    }
    async fn create(
        &self,
        key: &str,
        body: bytes::Bytes,
    ) -> Result<String, hubguard::azure::StoreError> {
        self.0.create(key, body).await
    }
    async fn update(
        &self,
        key: &str,
        body: bytes::Bytes,
        etag: &str,
    ) -> Result<String, hubguard::azure::StoreError> {
        self.0.update(key, body, etag).await
    }
    async fn delete(&self, key: &str, etag: &str) -> Result<(), hubguard::azure::StoreError> {
        self.0.delete(key, etag).await
    }
    async fn list(
        &self,
        _: &str,
    ) -> Result<Vec<hubguard::azure::record_store::Listed>, hubguard::azure::StoreError> {
        Err(hubguard::azure::StoreError::Unavailable(
            "listing refused".into(),
        ))
    }
    async fn write_tagged(
        &self,
        key: &str,
        body: bytes::Bytes,
        etag: Option<&str>,
        tags: &hubguard::azure::record_store::Tags,
    ) -> Result<String, hubguard::azure::StoreError> {
        self.0.write_tagged(key, body, etag, tags).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_that_cannot_list_the_ledger_asks_it_on_every_delivery() {
    let bed = Bed::start(1).await;
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("unlisted", "fail:1")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("held on Service Bus", &run.health, LIMIT, || async {
        run.health
            .held()
            .get("0")
            .is_some_and(|h| h.reason.contains("Service Bus"))
    })
    .await;
    run.stop().await;
    bed.sb.faults().clear();
    bed.send(0, &[("fresh", "ok")]).await;
    // The next owner cannot list the ledger's pending retries: it does not know which of
    // its events have a record, so each delivery asks the ledger.
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.records = Arc::new(Unlistable(parts.records.clone()));
    let run = Bed::run(parts);
    let ledger = bed.ledger();
    wait_for(
        "both delivered and checkpointed",
        &run.health,
        LIMIT,
        || async { bed.checkpoint_of("0").await == Some(1) },
    )
    .await;
    run.stop().await;
    let rec = ledger.record("unlisted").await.unwrap().unwrap();
    assert_eq!(
        rec.state(),
        State::Delivered,
        "the replay's delivery is recorded"
    );
    assert_eq!(handler.calls_of("unlisted"), vec![1, 1]);
    assert_eq!(handler.calls_of("fresh"), vec![1]);
    assert!(
        ledger.get("fresh").await.unwrap().is_none(),
        "a delivery without a record writes none"
    );
}
