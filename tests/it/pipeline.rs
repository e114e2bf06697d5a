//! End to end: the pipeline on the emulators with the real SDK crates. Every test ends by
//! checking that no event is lost: each produced event is delivered or dead-lettered.

use std::sync::Arc;
use std::time::Duration;

use hubguard::ledger::State;
use hubguard::policy::DeadLetterReason;

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn happy_path_writes_no_ledger_and_no_service_bus_and_batches_checkpoints() {
    let bed = Bed::start(2).await;
    let keys: Vec<String> = (0..40).map(|i| format!("ok-{i}")).collect();
    for p in 0..2 {
        let evs: Vec<(&str, &str)> = keys[p * 20..(p + 1) * 20].iter().map(|k| (k.as_str(), "ok")).collect();
        bed.send(p, &evs).await;
    }
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("all delivered", &run.health, LIMIT, || async { handler.delivered_keys().len() == 40 }).await;
    wait_for("checkpoints at the end", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(19) && bed.checkpoint_of("1").await == Some(19)
    })
    .await;
    let counters = run.health.snapshot();
    run.stop().await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!(sb.sends, 0, "no Service Bus operation on the happy path");
    assert!(bed.ledger().keys().await.unwrap().is_empty(), "no ledger record on the happy path");
    assert_eq!(counters.delivered, 40);
    assert!(counters.checkpoints < 40, "checkpoints are batched, not per event: {}", counters.checkpoints);
    for k in &keys {
        assert_eq!(handler.calls_of(k), vec![1], "{k} handled exactly once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_are_retried_to_delivery_with_the_ledger_history_right() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("a", "ok"), ("flaky", "fail:2"), ("b", "ok")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let ledger = bed.ledger();
    wait_for("flaky delivered", &run.health, LIMIT, || async {
        matches!(ledger.get("flaky").await, Ok(Some((r, _))) if r.state == State::Delivered)
    })
    .await;
    let (rec, _) = ledger.get("flaky").await.unwrap().unwrap();
    assert_eq!(rec.attempts, 3);
    assert_eq!(rec.correlation_id, "flaky");
    assert_eq!(rec.event_type.as_deref(), Some("test.event"));
    let outcomes: Vec<&str> = rec.history.iter().map(|h| h.outcome.as_str()).collect();
    assert_eq!(outcomes, vec!["retry_scheduled", "retry_scheduled", "delivered"]);
    assert_eq!(rec.history.iter().map(|h| h.attempt).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(rec.history.iter().all(|h| h.trace_id.as_deref().is_some_and(|t| t.len() == 32)));
    // Every retry ran at or after its scheduled time.
    for w in rec.history.windows(2) {
        let due = w[0].next_attempt_ms.unwrap();
        assert!(w[1].started_ms + 1 >= due, "attempt {} started before it was due", w[1].attempt);
    }
    assert_eq!(handler.calls_of("flaky"), vec![1, 2, 3]);
    // The partition was never held back by the retries: b was delivered right away.
    assert_eq!(handler.calls_of("b"), vec![1]);
    wait_for("checkpoint past all three", &run.health, LIMIT, || async { bed.checkpoint_of("0").await == Some(2) }).await;
    run.stop().await;
    let sb = bed.sb.counters("retries").unwrap();
    assert_eq!((sb.sends, sb.duplicates_dropped, sb.completes), (2, 0, 2), "exactly one retry message per failure");
    assert_eq!(sb.active + sb.scheduled + sb.locked, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failures_are_dead_lettered_at_once_and_exhaustion_by_attempts_and_age() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("perm", "perm"), ("never", "fail:99"), ("ok", "ok")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(3), "replica-a"));
    let ledger = bed.ledger();
    wait_for("both dead-lettered", &run.health, LIMIT, || async {
        let a = matches!(ledger.get("perm").await, Ok(Some((r, _))) if r.state == State::DeadLettered);
        let b = matches!(ledger.get("never").await, Ok(Some((r, _))) if r.state == State::DeadLettered);
        a && b
    })
    .await;
    let (perm, _) = ledger.get("perm").await.unwrap().unwrap();
    assert_eq!((perm.attempts, perm.dead_letter_reason.clone()), (1, Some(DeadLetterReason::Permanent)));
    let (never, _) = ledger.get("never").await.unwrap().unwrap();
    assert_eq!((never.attempts, never.dead_letter_reason.clone()), (3, Some(DeadLetterReason::AttemptsExhausted)));
    assert_eq!(handler.calls_of("never"), vec![1, 2, 3]);
    let mut dl = ledger.dead_letter_keys().await.unwrap();
    dl.sort();
    assert_eq!(dl, vec!["never", "perm"]);
    run.stop().await;
    assert_eq!(bed.sb.counters("retries").unwrap().sends, 2, "no retry message for the permanent failure");

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
        matches!(ledger.get("old").await, Ok(Some((r, _))) if r.dead_letter_reason == Some(DeadLetterReason::AgeExceeded))
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
    wait_for("first checkpointed", &run.health, LIMIT, || async { bed.checkpoint_of("0").await == Some(0) }).await;

    bed.sb.faults().error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("stuck", "fail:1"), ("behind-1", "ok"), ("behind-2", "ok")]).await;
    wait_for("partition held on Service Bus", &run.health, LIMIT, || async {
        run.health.held().get("0").is_some_and(|h| h.reason.contains("Service Bus") && h.oldest_unsettled == 1)
    })
    .await;
    assert!(!run.health.ready(), "not ready while a partition is held");
    // Hold long enough for several checkpoint ticks: the checkpoint must not pass the event.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(bed.checkpoint_of("0").await, Some(0), "the checkpoint never passes an unsettled event");
    assert!(handler.calls_of("behind-1").is_empty(), "nothing behind the held event is processed");

    bed.sb.faults().clear();
    wait_for("all delivered after recovery", &run.health, LIMIT, || async {
        let d = handler.delivered_keys();
        ["first", "stuck", "behind-1", "behind-2"].iter().all(|k| d.contains(*k))
    })
    .await;
    wait_for("checkpoint moves on", &run.health, LIMIT, || async { bed.checkpoint_of("0").await == Some(3) }).await;
    assert!(run.health.held().is_empty());
    let (rec, _) = bed.ledger().get("stuck").await.unwrap().unwrap();
    assert_eq!((rec.state, rec.attempts), (State::Delivered, 2));
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_storage_down_holds_the_partition_and_everything_settles_after_recovery() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("partition claimed", &run.health, LIMIT, || async { run.health.owned().contains_key("0") }).await;
    bed.blob.faults().error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("stuck", "fail:1"), ("behind", "ok")]).await;
    wait_for("partition held on blob storage", &run.health, LIMIT, || async {
        run.health.held().get("0").is_some_and(|h| h.reason.contains("blob storage"))
    })
    .await;
    assert_eq!(bed.sb.counters("retries").unwrap().sends, 0, "no retry is scheduled before the ledger records it");
    bed.blob.faults().clear();
    wait_for("all delivered after recovery", &run.health, LIMIT, || async {
        let d = handler.delivered_keys();
        d.contains("stuck") && d.contains("behind")
    })
    .await;
    wait_for("checkpoint moves on", &run.health, LIMIT, || async { bed.checkpoint_of("0").await == Some(1) }).await;
    run.stop().await;
}
