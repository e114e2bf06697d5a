//! Deployments never meet: two consumer groups of one hub share a retry queue and a
//! container, and each runs its own retries only — and a retry whose ledger record was
//! removed by hand is recovered from Event Hubs, or dead-lettered as `record_missing`.

use std::sync::Arc;
use std::time::Duration;

use hubguard::emulator::blob::{BlobConfig, BlobEmulator};
use hubguard::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use hubguard::event::Deployment;
use hubguard::ledger::{Ledger, State};
use hubguard::pipeline::Pipeline;
use hubguard::policy::DeadLetterReason;
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A hub with two consumer groups (`$Default` and `cg2`), one queue, one container.
async fn two_group_bed(partitions: usize) -> Bed {
    let mut hub = HubSpec::new("hub", partitions);
    hub.consumer_groups = vec!["cg2".into()];
    let eh = EventHubsEmulator::start(EventHubsConfig {
        hubs: vec![hub],
        ..Default::default()
    })
    .await
    .unwrap();
    let sb = ServiceBusEmulator::start(ServiceBusConfig {
        queues: vec![QueueSpec::new("retries")],
        ..Default::default()
    })
    .await
    .unwrap();
    let blob = BlobEmulator::start(BlobConfig::default()).await.unwrap();
    let cs = conn(&eh);
    Bed { eh, sb, blob, cs }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumer_groups_sharing_a_queue_and_a_container_each_retry_every_event_once() {
    let bed = two_group_bed(2).await;
    bed.sb.queue("retries").unwrap().record_accepted();
    let keys: Vec<String> = (0..8).map(|i| format!("shared-{i}")).collect();
    for p in 0..2 {
        let evs: Vec<(&str, &str)> = keys[p * 4..(p + 1) * 4]
            .iter()
            .map(|k| (k.as_str(), "fail:1"))
            .collect();
        bed.send(p, &evs).await;
    }
    let first = Arc::new(Scripted::default());
    let second = Arc::new(Scripted::default());
    let run_first = Bed::run(
        bed.wiring("replica-default")
            .policy(fast_policy(5))
            .parts(first.clone())
            .unwrap(),
    );
    let run_second = Bed::run(
        bed.wiring_in("replica-cg2", "cg2")
            .policy(fast_policy(5))
            .parts(second.clone())
            .unwrap(),
    );
    let ledgers = [
        Ledger::new(bed.records(), "hub", "$Default"),
        Ledger::new(bed.records(), "hub", "cg2"),
    ];
    // One-second retries: each group delivers all eight well within the limit (on a shared
    // queue where MessageIds did not name the deployment, one group's retries were dropped as
    // duplicates of the other's, and its events waited for the five-minute overdue sweep).
    for (ledger, run) in ledgers.iter().zip([&run_first, &run_second]) {
        wait_for(
            "every event delivered in its own group",
            &run.health,
            Duration::from_secs(30),
            || async {
                let mut all = true;
                for k in &keys {
                    all &= matches!(ledger.record(k).await, Ok(Some(r)) if r.state() == State::Delivered);
                }
                all
            },
        )
        .await;
    }
    for (name, handler) in [("$Default", &first), ("cg2", &second)] {
        for k in &keys {
            assert_eq!(
                handler.calls_of(k),
                vec![1, 2],
                "{name}: {k} failed once and was retried once, by its own group"
            );
        }
    }
    for (ledger, name) in ledgers.iter().zip(["$Default", "cg2"]) {
        for k in &keys {
            let rec = ledger.record(k).await.unwrap().unwrap();
            assert_eq!(
                rec.history.iter().map(|h| h.attempt).collect::<Vec<_>>(),
                vec![1, 2],
                "{name}: {k}'s own ledger saw both of its attempts"
            );
        }
    }
    let forwarded = run_first.health.snapshot().forwarded + run_second.health.snapshot().forwarded;
    run_first.stop().await;
    run_second.stop().await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(
        sb.duplicates_dropped, 0,
        "no group's retry dropped as another's"
    );
    assert_eq!(
        sb.sends,
        16 + forwarded,
        "one retry per event per group, plus the hand-backs"
    );
    assert_eq!(
        sb.active + sb.scheduled + sb.locked,
        0,
        "nothing left behind"
    );
    // Every MessageId names its deployment.
    let ids = [
        Deployment::new(&bed.cs.namespace(), "hub", "$Default").id,
        Deployment::new(&bed.cs.namespace(), "hub", "cg2").id,
    ];
    assert_ne!(ids[0], ids[1]);
    for (id, _) in bed.sb.queue("retries").unwrap().accepted() {
        assert!(
            ids.iter().any(|d| id.starts_with(&format!("{d}."))),
            "{id} names its deployment"
        );
        assert!(id.chars().count() <= 128, "{id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_hands_another_deployments_retries_back_and_never_runs_them() {
    let bed = two_group_bed(1).await;
    let keys: Vec<String> = (0..8).map(|i| format!("theirs-{i}")).collect();
    let evs: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "ok")).collect();
    bed.send(0, &evs).await;
    let slow = hubguard::policy::RetryPolicy {
        base_s: 60,
        floor_s: 60,
        ..fast_policy(5)
    };
    // cg2's downstream is down: every event waits for a retry a minute later. Then it stops.
    let second = Arc::new(Scripted::default());
    second
        .outage
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let cg2 = Ledger::new(bed.records(), "hub", "cg2");
    let run = Bed::run(
        bed.wiring_in("replica-cg2", "cg2")
            .policy(slow.clone())
            .parts(second.clone())
            .unwrap(),
    );
    wait_for("cg2's retries scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == 8
    })
    .await;
    run.stop().await;
    bed.clock().advance(Duration::from_secs(61));
    // Only $Default runs while cg2's retries come due: it gets every one of them.
    let first = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(first.clone(), fast_policy(5), "replica-default"));
    wait_for(
        "$Default delivered its own and handed cg2's back",
        &run.health,
        LIMIT,
        || async { first.delivered_keys().len() == 8 && run.health.snapshot().forwarded >= 8 },
    )
    .await;
    let report = run.health.report().to_string();
    assert!(report.contains("consumer group cg2 of hub hub"), "{report}");
    run.stop().await;
    for k in &keys {
        assert_eq!(
            first.calls_of(k),
            vec![1],
            "$Default never ran cg2's retry of {k}"
        );
    }
    assert!(
        Ledger::new(bed.records(), "hub", "$Default")
            .keys()
            .await
            .unwrap()
            .is_empty(),
        "nothing of cg2's written to $Default's ledger"
    );
    // cg2 comes back: every retry is there, whole, and runs once.
    second
        .outage
        .store(false, std::sync::atomic::Ordering::SeqCst);
    bed.clock().advance(Duration::from_secs(61));
    let run = Bed::run(
        bed.wiring_in("replica-cg2", "cg2")
            .policy(slow)
            .parts(second.clone())
            .unwrap(),
    );
    wait_for("cg2 delivered every event", &run.health, LIMIT, || async {
        let mut all = true;
        for k in &keys {
            all &= matches!(cg2.record(k).await, Ok(Some(r)) if r.state() == State::Delivered);
        }
        all
    })
    .await;
    run.stop().await;
    for k in &keys {
        assert_eq!(second.calls_of(k), vec![1, 2], "cg2 ran {k}'s retry once");
    }
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(sb.duplicates_dropped, 0);
    assert_eq!(
        sb.dead_lettered, 0,
        "nothing burnt into Service Bus's dead-letter queue"
    );
    assert_eq!(
        sb.active + sb.scheduled + sb.locked,
        0,
        "nothing left behind"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_another_namespace_claimed_in_a_shared_container_refuses_the_start_naming_both() {
    let bed = Bed::start(1).await;
    let other = Deployment::new("other.servicebus.windows.net", "hub", "$Default");
    assert_eq!(bed.ledger().claim(&other).await.unwrap(), None);
    let pipeline = Pipeline::new(bed.parts(Arc::new(Scripted::default()), fast_policy(5), "a"));
    let err = within("refused at start", pipeline.run(CancellationToken::new()))
        .await
        .expect_err("refused");
    let text = err.to_string();
    assert!(text.contains("other.servicebus.windows.net"), "{text}");
    assert!(text.contains(&bed.cs.namespace()), "{text}");
    assert!(text.contains("storage.container_url"), "{text}");
    // The same namespace again (a restart, another replica) is its own.
    let me = Deployment::new(&bed.cs.namespace(), "hub", "cg2");
    let ledger = Ledger::new(bed.records(), "hub", "cg2");
    assert_eq!(ledger.claim(&me).await.unwrap(), None);
    assert_eq!(ledger.claim(&me).await.unwrap(), None);
}

/// A pending retry of `key` (failed once, next attempt a minute away), then its ledger
/// record removed by hand; returns the running pipeline.
async fn retry_pending_without_its_record(bed: &Bed, key: &str, handler: Arc<Scripted>) -> Running {
    bed.send(0, &[(key, "fail:1")]).await;
    let slow = hubguard::policy::RetryPolicy {
        base_s: 60,
        floor_s: 60,
        ..fast_policy(5)
    };
    let run = Bed::run(bed.parts(handler, slow, "replica-a"));
    let ledger = bed.ledger();
    wait_for(
        "retry recorded and checkpointed",
        &run.health,
        LIMIT,
        || async {
            matches!(ledger.record(key).await, Ok(Some(r)) if r.state() == State::RetryScheduled)
                && bed.checkpoint_of("0").await == Some(0)
        },
    )
    .await;
    bed.container()
        .delete_blob(&ledger.record_name(key), None)
        .await
        .unwrap();
    assert!(ledger.get(key).await.unwrap().is_none());
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_record_was_removed_by_hand_is_rebuilt_from_event_hubs_and_delivered() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let run = retry_pending_without_its_record(&bed, "removed", handler.clone()).await;
    bed.clock().advance(Duration::from_secs(61));
    let ledger = bed.ledger();
    wait_for("delivered after all", &run.health, LIMIT, || async {
        matches!(ledger.record("removed").await, Ok(Some(r)) if r.state() == State::Delivered)
    })
    .await;
    // Reading the event back may have taken the partition from the processor for a moment
    // (its receivers carry owner level 0): it comes back and carries on.
    bed.send(0, &[("after", "ok")]).await;
    wait_for("the partition reads on", &run.health, LIMIT, || async {
        handler.delivered_keys().contains("after")
    })
    .await;
    // Attempt 1 may replay (at least once), attempt 2 runs exactly once.
    let attempts = handler.calls_of("removed");
    assert_eq!(
        attempts.iter().filter(|a| **a == 2).count(),
        1,
        "attempt 2 ran once, from the event read back: {attempts:?}"
    );
    assert!(attempts.iter().all(|a| *a <= 2), "{attempts:?}");
    let rec = ledger.record("removed").await.unwrap().unwrap();
    assert_eq!(
        rec.event.body, b"fail:1",
        "the event itself, read back from Event Hubs"
    );
    assert_eq!(rec.attempts, 2);
    assert_eq!(run.health.snapshot().records_rebuilt, 1);
    assert_eq!(run.health.snapshot().records_missing, 0);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_record_and_event_are_gone_is_dead_lettered_record_missing_and_counted() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let run = retry_pending_without_its_record(&bed, "vanished", handler.clone()).await;
    // Past the hub's retention: Event Hubs no longer has it either.
    bed.eh.store().hub("hub").unwrap().partitions[0].expire_through(0);
    bed.clock().advance(Duration::from_secs(61));
    let ledger = bed.ledger();
    wait_for(
        "dead-lettered as record_missing",
        &run.health,
        LIMIT,
        || async {
            matches!(ledger.record("vanished").await, Ok(Some(r)) if r.state() == State::DeadLettered)
        },
    )
    .await;
    let rec = ledger.record("vanished").await.unwrap().unwrap();
    assert_eq!(
        rec.dead_letter_reason(),
        Some(DeadLetterReason::RecordMissing)
    );
    assert!(rec.event_unknown);
    let error = rec.last_error.clone().unwrap_or_default();
    assert!(error.contains("retention"), "{error}");
    assert_eq!(
        ledger.dead_letter_keys().await.unwrap(),
        vec!["vanished".to_string()]
    );
    assert_eq!(run.health.snapshot().records_missing, 1);
    let reasons = run.health.not_ready_reasons().join("\n");
    assert!(
        reasons.contains("record_missing") && reasons.contains("vanished"),
        "{reasons}"
    );
    let mut attempts = handler.calls_of("vanished");
    attempts.dedup();
    assert_eq!(attempts, vec![1], "nothing ran without the event");
    run.stop().await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(
        sb.active + sb.scheduled + sb.locked,
        0,
        "the message was settled"
    );
    assert_eq!(
        sb.dead_lettered, 0,
        "not abandoned into Service Bus's dead-letter queue"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_retry_service_bus_dead_lettered_without_its_record_is_reported_not_left() {
    use hubguard::emulator::servicebus::broker::{Entity, NewMessage};
    // What an older hubguard left behind: a retry without a record, abandoned until Service
    // Bus dead-lettered it, in the format before messages said where their event was.
    let mut queue = QueueSpec::new("retries");
    queue.max_delivery_count = 1;
    let bed = Bed::start_with_queue(1, queue).await;
    let q = bed.sb.queue("retries").unwrap();
    let clock = bed.clock();
    q.send(
        NewMessage {
            message_id: Some("stranded-attempt-2".into()),
            body: br#"{"v":2,"attempt":2,"due_ms":0,"key":"stranded","traceparents":[]}"#.to_vec(),
            ..Default::default()
        },
        clock.now(),
    )
    .unwrap();
    let l = q.try_lock(Entity::Main, clock.now()).unwrap().unwrap();
    let seq = l.message.sequence_number.to_string();
    q.abandon(Entity::Main, &seq, &l.lock_token, clock.now())
        .unwrap();
    assert_eq!(bed.sb.counters("retries").unwrap().dead_lettered, 1);

    let run = Bed::run(bed.parts(Arc::new(Scripted::default()), fast_policy(5), "a"));
    let ledger = bed.ledger();
    wait_for("reported as record_missing", &run.health, LIMIT, || async {
        matches!(ledger.record("stranded").await, Ok(Some(r)) if r.state() == State::DeadLettered)
            && bed.sb.counters("retries").unwrap().dead_lettered == 0
    })
    .await;
    let rec = ledger.record("stranded").await.unwrap().unwrap();
    assert_eq!(
        rec.dead_letter_reason(),
        Some(DeadLetterReason::RecordMissing)
    );
    let error = rec.last_error.unwrap_or_default();
    assert!(error.contains("cannot be read back"), "{error}");
    assert_eq!(run.health.snapshot().records_missing, 1);
    run.stop().await;
}

/// A retry of another deployment names that deployment as its message says, and what its
/// message says is not this one's to trust: `/v1/status` lists it under
/// `other_deployments_seen` with any credential masked (the map is keyed by the name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_deployments_name_in_the_status_report_passes_the_redaction_rule() {
    use hubguard::emulator::servicebus::broker::NewMessage;
    let bed = Bed::start(1).await;
    let q = bed.sb.queue("retries").unwrap();
    let secret = "Forw4rdedPa55word";
    let body = serde_json::json!({
        "v": 2, "attempt": 2, "due_ms": 0, "key": "theirs", "traceparents": [],
        "deployment": {
            "id": "0123456789ab",
            "namespace": format!("sb://admin:{secret}@elsewhere.example"),
            "hub": "hub",
            "consumer_group": "cg9",
        },
    });
    q.send(
        NewMessage {
            message_id: Some("0123456789ab.theirs-attempt-2".into()),
            body: body.to_string().into_bytes(),
            ..Default::default()
        },
        bed.clock().now(),
    )
    .unwrap();
    let run = Bed::run(bed.parts(Arc::new(Scripted::default()), fast_policy(5), "a"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let router = hubguard::status::router(run.health.clone(), bed.ledger(), None);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    wait_for("handed back", &run.health, LIMIT, || async {
        run.health.snapshot().forwarded >= 1
    })
    .await;
    let (code, report) = http_get(&addr, "/v1/status").await;
    run.stop().await;
    assert!(code == 200 || code == 503, "{code} {report}");
    assert!(!report.contains(secret), "{report}");
    assert!(
        report.contains("consumer group cg9 of hub hub in sb://***@elsewhere.example"),
        "the other deployment is still named: {report}"
    );
}

/// A retry of another deployment that Service Bus refuses to take back for what it is (here
/// a deployment id no hubguard writes, making the hand-back's MessageId longer than the 128
/// characters Service Bus allows) is not held for ever: abandoned, it reaches the queue's
/// dead-letter sub-queue, and readiness says nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_deployments_retry_service_bus_refuses_to_take_back_is_not_held_for_ever() {
    use hubguard::emulator::servicebus::broker::NewMessage;
    let mut queue = QueueSpec::new("retries");
    queue.max_delivery_count = 1;
    let bed = Bed::start_with_queue(1, queue).await;
    let q = bed.sb.queue("retries").unwrap();
    let id = "f".repeat(120);
    let body = serde_json::json!({
        "v": 2, "attempt": 2, "due_ms": 0, "key": "theirs", "traceparents": [],
        "deployment": { "id": id, "namespace": "elsewhere", "hub": "hub", "consumer_group": "cg9" },
    });
    q.send(
        NewMessage {
            message_id: Some("theirs-attempt-2".into()),
            body: body.to_string().into_bytes(),
            ..Default::default()
        },
        bed.clock().now(),
    )
    .unwrap();
    let run = Bed::run(bed.parts(Arc::new(Scripted::default()), fast_policy(5), "a"));
    wait_for(
        "in the dead-letter sub-queue, nothing held",
        &run.health,
        LIMIT,
        || async {
            bed.sb.counters("retries").unwrap().dead_lettered == 1
                && run.health.held_retries().is_empty()
                && run.health.ready()
        },
    )
    .await;
    assert_eq!(run.health.snapshot().forwarded, 0);
    run.stop().await;
}
