//! Operators in control: `retries retry-now` and `retries cancel` against running replicas
//! on the emulators, including their races with the retry loop (an attempt running, a copy
//! scheduled before, a breaker deferral).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Handler, Outcome};
use hubguard::ledger::State;
use hubguard::pipeline::settle::{ActionOutcome, Settler};
use hubguard::policy::{DeadLetterReason, RetryPolicy};

use crate::common::within;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A policy whose retries wait `wait_s`.
fn waiting(wait_s: u64) -> RetryPolicy {
    RetryPolicy {
        base_s: wait_s,
        floor_s: wait_s,
        cap_s: wait_s.max(60),
        ..fast_policy(5)
    }
}

/// The settler the command line builds: the replicas' ledger, queue, deployment and clock.
fn operator(bed: &Bed, policy: RetryPolicy) -> Settler {
    bed.settler(policy)
        .with_deployment(bed.wiring("operator").deployment())
        .with_clock(bed.clock())
}

async fn record(bed: &Bed, key: &str) -> Option<hubguard::ledger::LedgerRecord> {
    bed.ledger().record(key).await.unwrap()
}

async fn drained(bed: &Bed) -> bool {
    let c = bed.sb.counters("retries").unwrap();
    c.active + c.scheduled + c.locked == 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_now_runs_a_distant_retry_once_and_the_copy_scheduled_before_stands_down() {
    let bed = Bed::start(1).await;
    let policy = waiting(120);
    bed.send(0, &[("rn-1", "fail:1")]).await;
    let gated = Arc::new(Gated {
        inner: Scripted::default(),
        gated: "rn-1",
        running: tokio::sync::Notify::new(),
        release: tokio::sync::Notify::new(),
    });
    let handler = &gated.inner;
    let a = Bed::run(bed.parts(gated.clone(), policy.clone(), "replica-a"));
    wait_for("attempt 2 scheduled", &a.health, LIMIT, || async {
        record(&bed, "rn-1")
            .await
            .is_some_and(|r| r.state() == State::RetryScheduled && r.attempts == 1)
    })
    .await;
    a.stop().await;
    let before = record(&bed, "rn-1").await.unwrap();
    let ops = operator(&bed, policy.clone());
    // A dry run says what would happen and changes nothing.
    assert_eq!(
        ops.retry_now("rn-1", "alice", true).await.unwrap(),
        ActionOutcome::Done {
            attempt: 2,
            previous_due_ms: before.next_attempt_ms()
        }
    );
    assert_eq!(record(&bed, "rn-1").await.unwrap(), before);
    assert_eq!(
        ops.retry_now("rn-1", "alice", false).await.unwrap(),
        ActionOutcome::Done {
            attempt: 2,
            previous_due_ms: before.next_attempt_ms()
        }
    );
    // Idempotent: a repeat changes nothing; it re-sends the pulled copy, which duplicate
    // detection drops.
    let dropped = bed.sb.counters("retries").unwrap().duplicates_dropped;
    assert_eq!(
        ops.retry_now("rn-1", "alice", false).await.unwrap(),
        ActionOutcome::AlreadyDone { attempt: 2 }
    );
    let c = bed.sb.counters("retries").unwrap();
    assert_eq!(c.duplicates_dropped, dropped + 1);
    assert_eq!(
        c.scheduled + c.active,
        2,
        "the copy scheduled before, and the pulled one"
    );
    let pulled = record(&bed, "rn-1").await.unwrap();
    let pull = pulled.run_now.clone().expect("the pull is recorded");
    assert_eq!((pull.attempt, pull.by.as_str()), (2, "alice"));
    // Both copies due at once (the one scheduled before too): only the pulled one runs.
    // (Less than the sweep's overdue margin: the pulled copy is not taken for lost.)
    bed.clock().advance(Duration::from_secs(121));
    let b = Bed::run(bed.parts(gated.clone(), policy, "replica-b"));
    let c = Bed::run(bed.parts(gated.clone(), waiting(120), "replica-c"));
    // The pulled attempt runs (and waits): meanwhile the copy scheduled before is completed
    // without a call — had it run, it would be waiting beside it, holding its lock.
    within("attempt 2 runs", gated.running.notified()).await;
    wait_for(
        "the copy scheduled before stood down",
        &b.health,
        LIMIT,
        || async {
            let c = bed.sb.counters("retries").unwrap();
            c.active + c.scheduled == 0 && c.locked == 1
        },
    )
    .await;
    gated.release.notify_one();
    wait_for(
        "delivered, both copies completed",
        &b.health,
        LIMIT,
        || async { handler.delivered_keys().contains("rn-1") && drained(&bed).await },
    )
    .await;
    b.stop().await;
    c.stop().await;
    // Attempt 2 ran once. (Attempt 1 may be read again from Event Hubs by the new owners if
    // the stopped replica's final checkpoint did not land: at-least-once, as designed.)
    let calls = handler.calls_of("rn-1");
    assert_eq!(
        calls.iter().filter(|&&n| n == 2).count(),
        1,
        "attempt 2 ran once: {calls:?}"
    );
    let done = record(&bed, "rn-1").await.unwrap();
    assert_eq!((done.state(), done.attempts), (State::Delivered, 2));
    // Nothing waits any more: both actions say so.
    let ops = operator(&bed, fast_policy(5));
    assert_eq!(
        ops.retry_now("rn-1", "alice", false).await.unwrap(),
        ActionOutcome::NotPending {
            state: State::Delivered
        }
    );
    assert_eq!(
        ops.cancel("nobody", "x", "alice", false).await.unwrap(),
        ActionOutcome::Unknown
    );
}

/// [`Scripted`], except that attempt 2 of `gated` waits for `release` after saying it runs.
struct Gated {
    inner: Scripted,
    gated: &'static str,
    running: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

#[async_trait]
impl Handler for Gated {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        if event.identity.idempotency_key == self.gated && attempt.number == 2 {
            self.running.notify_one();
            self.release.notified().await;
        }
        self.inner.handle(event, attempt).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_racing_a_running_attempt_is_left_to_the_attempt() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("busy", "fail:1")]).await;
    let handler = Arc::new(Gated {
        inner: Scripted::default(),
        gated: "busy",
        running: tokio::sync::Notify::new(),
        release: tokio::sync::Notify::new(),
    });
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let b = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-b"));
    within("attempt 2 runs", handler.running.notified()).await;
    let ops = operator(&bed, fast_policy(5));
    let due = record(&bed, "busy").await.unwrap().next_attempt_ms();
    for outcome in [
        ops.retry_now("busy", "alice", false).await.unwrap(),
        ops.cancel("busy", "stop it", "alice", false).await.unwrap(),
    ] {
        assert_eq!(
            outcome,
            ActionOutcome::Due {
                attempt: 2,
                due_ms: due
            }
        );
    }
    let rec = record(&bed, "busy").await.unwrap();
    assert_eq!((rec.state(), rec.run_now), (State::RetryScheduled, None));
    handler.release.notify_one();
    wait_for("delivered", &a.health, LIMIT, || async {
        handler.inner.delivered_keys().contains("busy") && drained(&bed).await
    })
    .await;
    a.stop().await;
    b.stop().await;
    assert_eq!(handler.inner.calls_of("busy"), vec![1, 2]);
    let rec = record(&bed, "busy").await.unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_during_a_breaker_deferral_dead_letters_once_and_a_replay_brings_it_back() {
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
        open_ms: 60_000,
        spread_ms: 500,
        probe_timeout_ms: 3000,
        // The classic breaker: its three first attempts trip it (no pacing at the brink).
        half_open_calls: 1,
        half_open_success_ratio: 1.0,
        brink_hold_ms: 0,
    });
    let a = Bed::run(parts);
    let keys = ["c-0", "c-1", "c-2"];
    bed.send(0, &keys.map(|k| (k, "ok"))).await;
    let now = || hubguard::clock::ms(bed.clock().now());
    // Attempt 2 of c-0 met the open breaker: deferred past its expiry, no attempt counted.
    wait_for("c-0's retry deferred", &a.health, LIMIT, || async {
        record(&bed, "c-0").await.is_some_and(|r| {
            r.attempts == 1 && r.next_attempt_ms().is_some_and(|d| d > now() + 30_000)
        })
    })
    .await;
    let ops = operator(&bed, fast_policy(10));
    assert!(matches!(
        ops.cancel("c-0", "the order was withdrawn", "alice", true)
            .await
            .unwrap(),
        ActionOutcome::Done { attempt: 2, .. }
    ));
    assert_eq!(
        record(&bed, "c-0").await.unwrap().state(),
        State::RetryScheduled
    );
    assert!(matches!(
        ops.cancel("c-0", "the order was withdrawn", "alice", false)
            .await
            .unwrap(),
        ActionOutcome::Done { attempt: 2, .. }
    ));
    assert_eq!(
        ops.cancel("c-0", "again", "alice", false).await.unwrap(),
        ActionOutcome::AlreadyDone { attempt: 2 }
    );
    let rec = record(&bed, "c-0").await.unwrap();
    assert_eq!(rec.state(), State::DeadLettered);
    assert_eq!(rec.dead_letter_reason(), Some(DeadLetterReason::Cancelled));
    assert_eq!(
        rec.last_error.as_deref(),
        Some("cancelled by alice: the order was withdrawn")
    );
    assert!(bed
        .ledger()
        .dead_letter_keys()
        .await
        .unwrap()
        .contains(&"c-0".to_string()));
    // The downstream recovers and the breaker's expiry passes: the deferred copies come due.
    handler
        .outage
        .store(false, std::sync::atomic::Ordering::SeqCst);
    bed.clock().advance(Duration::from_secs(61));
    wait_for(
        "the others delivered, c-0's copy completed",
        &a.health,
        LIMIT,
        || async {
            ["c-1", "c-2"]
                .iter()
                .all(|k| handler.delivered_keys().contains(*k))
                && drained(&bed).await
        },
    )
    .await;
    assert_eq!(
        handler.calls_of("c-0"),
        vec![1],
        "no attempt after the cancel"
    );
    assert_eq!(
        record(&bed, "c-0").await.unwrap().state(),
        State::DeadLettered
    );
    // Replayable later: it runs again, under a MessageId its cancelled copy never used.
    assert_eq!(ops.replay("c-0").await.unwrap(), Some(2));
    wait_for(
        "c-0 delivered after the replay",
        &a.health,
        LIMIT,
        || async { handler.delivered_keys().contains("c-0") && drained(&bed).await },
    )
    .await;
    a.stop().await;
    assert_eq!(handler.calls_of("c-0"), vec![1, 2]);
    let rec = record(&bed, "c-0").await.unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_by_filter_is_paced_and_resumes_without_replaying_twice() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(1), "replica-a"));
    let perm = ["p-0", "p-1", "p-2", "p-3"];
    let mut evs: Vec<(&str, &str)> = perm.iter().map(|k| (*k, "perm")).collect();
    // Other dead letters the filters leave alone: another reason, another prefix.
    evs.extend([("p-x", "fail:9"), ("q-0", "perm")]);
    bed.send(0, &evs).await;
    let dead = |keys: Vec<&'static str>, after: i64| {
        let bed = &bed;
        async move {
            for k in keys {
                match record(bed, k).await {
                    Some(r) if r.state() == State::DeadLettered && r.updated_ms > after => {}
                    _ => return false,
                }
            }
            true
        }
    };
    let all = vec!["p-0", "p-1", "p-2", "p-3", "p-x", "q-0"];
    wait_for("all dead-lettered", &a.health, LIMIT, || {
        dead(all.clone(), 0)
    })
    .await;
    let ops = operator(&bed, fast_policy(1));
    let until = hubguard::clock::ms(bed.clock().now());
    let filter = hubguard::pipeline::settle::ReplayFilter {
        reason: Some("permanent".into()),
        error_contains: Some("permanent".into()),
        key_prefix: Some("p-".into()),
        until_ms: until,
        ..Default::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    // A dry run lists the four and changes nothing.
    let dry = ops
        .replay_matching(&filter, 100.0, true, &stop, |_, _, _| {})
        .await
        .unwrap();
    assert_eq!((dry.listed, dry.matched, dry.replayed), (5, 4, 4));
    assert!(dry.skipped + dry.failed == 0 && !dry.interrupted);
    // Interrupted after two replays.
    let mut first = Vec::new();
    let report = ops
        .replay_matching(&filter, 100.0, false, &stop, |step, _, _| {
            if let hubguard::pipeline::settle::ReplayStep::Replayed { key, .. } = step {
                first.push(key.clone());
                if first.len() == 2 {
                    stop.cancel();
                }
            }
        })
        .await
        .unwrap();
    assert_eq!((report.replayed, report.interrupted), (2, true));
    // The two replayed fail again (permanently) and are dead letters again, after `until`.
    let again: Vec<&'static str> = perm
        .iter()
        .copied()
        .filter(|k| first.iter().any(|f| f == k))
        .collect();
    wait_for("replayed ones dead again", &a.health, LIMIT, || {
        dead(again.clone(), until)
    })
    .await;
    // Resumed with the same filters and `until`: the other two, paced at 2 a second; the
    // first two are skipped, not replayed twice.
    let started = std::time::Instant::now();
    let report = ops
        .replay_matching(
            &filter,
            2.0,
            false,
            &tokio_util::sync::CancellationToken::new(),
            |_, _, _| {},
        )
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "two replays at 2/s take half a second"
    );
    assert_eq!(
        (
            report.replayed,
            report.skipped,
            report.failed,
            report.interrupted
        ),
        (2, 2, 0, false),
        "{report:?}"
    );
    wait_for("every replayed one settled", &a.health, LIMIT, || async {
        dead(perm.to_vec(), until).await && drained(&bed).await
    })
    .await;
    a.stop().await;
    for k in perm {
        assert_eq!(handler.calls_of(k), vec![1, 2], "{k} replayed exactly once");
    }
    assert_eq!(handler.calls_of("p-x"), vec![1], "another reason");
    assert_eq!(handler.calls_of("q-0"), vec![1], "another prefix");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_say_what_happened_in_their_exit_status() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), waiting(600), "replica-a"));
    bed.send(0, &[("cli-wait", "fail:1"), ("cli-perm", "perm")])
        .await;
    wait_for("both recorded", &a.health, LIMIT, || async {
        record(&bed, "cli-wait")
            .await
            .is_some_and(|r| r.state() == State::RetryScheduled)
            && record(&bed, "cli-perm")
                .await
                .is_some_and(|r| r.state() == State::DeadLettered)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hubguard.toml");
    std::fs::write(
        &config,
        format!(
            "[eventhubs]\nconnection_string = \"{}\"\nhub = \"hub\"\n[servicebus]\nconnection_string = \"{}\"\n[storage]\ncontainer_url = \"{}\"\n[handler]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/events\"\n",
            bed.eh.connection_string(),
            bed.sb.connection_string(),
            bed.blob.container_url("hubguard"),
        ),
    )
    .unwrap();
    let run = move |args: Vec<&'static str>| {
        let config = config.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
                    .args(&args)
                    .arg("--config")
                    .arg(&config)
                    .env("NO_COLOR", "1")
                    .output()
                    .unwrap();
                (
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout).to_string(),
                )
            })
            .await
            .unwrap()
        }
    };
    let (code, out) = run(vec!["retries", "retry-now", "nobody", "--json"]).await;
    assert_eq!(code, Some(3), "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (v["result"].as_str(), v["key"].as_str()),
        (Some("unknown"), Some("nobody"))
    );
    let (code, out) = run(vec!["retries", "cancel", "cli-perm", "--reason", "x"]).await;
    assert_eq!(code, Some(4), "dead-lettered, not pending: {out}");
    let (code, out) = run(vec![
        "retries",
        "cancel",
        "cli-wait",
        "--reason",
        "no",
        "--dry-run",
    ])
    .await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("would be cancelled"), "{out}");
    assert_eq!(
        record(&bed, "cli-wait").await.unwrap().state(),
        State::RetryScheduled
    );
    let (code, out) = run(vec!["retries", "cancel", "cli-wait"]).await;
    assert_eq!(code, Some(2), "--reason is required: {out}");
    let (code, out) = run(vec!["retries", "retry-now", "cli-wait", "--by", "bob"]).await;
    assert_eq!(code, Some(0), "{out}");
    wait_for("cli-wait delivered", &a.health, LIMIT, || async {
        handler.delivered_keys().contains("cli-wait")
    })
    .await;
    let (code, out) = run(vec![
        "dead-letters",
        "replay",
        "--reason",
        "permanent",
        "--dry-run",
        "--json",
    ])
    .await;
    assert_eq!(code, Some(0), "{out}");
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(
        (last["replayed"].as_u64(), last["dry_run"].as_bool()),
        (Some(1), Some(true)),
        "{out}"
    );
    let (code, _) = run(vec!["dead-letters", "replay", "--all", "--rate", "0/s"]).await;
    assert_eq!(code, Some(1), "a rate of zero is refused");
    a.stop().await;
    assert_eq!(handler.calls_of("cli-wait"), vec![1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_partition_stops_reading_on_every_replica_and_resumes_without_a_restart() {
    use hubguard::pipeline::control::{self, Pause, Pauses};
    let bed = Bed::start(2).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let b = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-b"));
    bed.send(0, &[("before-0", "ok")]).await;
    bed.send(1, &[("before-1", "ok")]).await;
    wait_for("both partitions read", &a.health, LIMIT, || async {
        handler.delivered_keys().len() == 2
    })
    .await;
    let store = bed.records();
    let name = control::record_name("hub", "$Default");
    let (_, written) = control::change(store.as_ref(), &name, |p: &Pauses| {
        let mut p = p.clone();
        p.partitions.insert(
            "0".into(),
            Pause {
                by: "alice".into(),
                since_ms: 1_700_000_000_000,
                reason: Some("receiver migration".into()),
            },
        );
        Some(p)
    })
    .await
    .unwrap();
    assert!(written);
    let paused = |h: &hubguard::pipeline::health::Health| {
        h.held().get(&control::held_name("0")).is_some_and(|x| {
            x.reason == "paused by alice since 2023-11-14T22:13:20Z: receiver migration"
        })
    };
    wait_for(
        "the owner of partition 0 says paused",
        &a.health,
        LIMIT,
        || async { paused(&a.health) || paused(&b.health) },
    )
    .await;
    let checkpoint = bed.checkpoint_of("0").await;
    bed.send(0, &[("during-0", "ok")]).await;
    bed.send(1, &[("during-1", "ok")]).await;
    wait_for("partition 1 reads on", &a.health, LIMIT, || async {
        handler.delivered_keys().contains("during-1")
    })
    .await;
    // Partition 1 read an event produced after partition 0's: partition 0 read nothing.
    assert!(handler.calls_of("during-0").is_empty(), "paused: not read");
    assert_eq!(bed.checkpoint_of("0").await, checkpoint);
    control::change(store.as_ref(), &name, |_| Some(Pauses::default()))
        .await
        .unwrap();
    wait_for("partition 0 resumed", &a.health, LIMIT, || async {
        handler.delivered_keys().contains("during-0") && !paused(&a.health) && !paused(&b.health)
    })
    .await;
    a.stop().await;
    b.stop().await;
    assert_eq!(handler.calls_of("during-0"), vec![1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_during_a_service_bus_outage_keeps_the_held_event_and_reads_nothing_after_it() {
    use hubguard::pipeline::control::{self, Pause, Pauses};
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    bed.send(0, &[("first", "ok")]).await;
    wait_for("first delivered", &a.health, LIMIT, || async {
        handler.delivered_keys().contains("first")
    })
    .await;
    // Service Bus down: the failed event cannot be settled, so its partition holds.
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("stuck", "fail:1")]).await;
    wait_for("held for Service Bus", &a.health, LIMIT, || async {
        a.health
            .held()
            .get("0")
            .is_some_and(|h| h.cause == hubguard::pipeline::health::HoldCause::ServiceBus)
    })
    .await;
    let store = bed.records();
    let name = control::record_name("hub", "$Default");
    control::change(store.as_ref(), &name, |_| {
        Some(Pauses {
            all: Some(Pause {
                by: "alice".into(),
                since_ms: 1_700_000_000_000,
                reason: None,
            }),
            ..Default::default()
        })
    })
    .await
    .unwrap();
    wait_for(
        "paused beside the Service Bus hold",
        &a.health,
        LIMIT,
        || async {
            let held = a.health.held();
            held.contains_key(&control::held_name("0"))
                && held
                    .get("0")
                    .is_some_and(|h| h.cause == hubguard::pipeline::health::HoldCause::ServiceBus)
        },
    )
    .await;
    let checkpoint = bed.checkpoint_of("0").await;
    bed.send(0, &[("after", "ok")]).await;
    // Service Bus returns: the held event settles (its retry scheduled); nothing new is read.
    bed.sb.faults().clear();
    wait_for("the held event settled", &a.health, LIMIT, || async {
        !a.health.held().contains_key("0")
            && record(&bed, "stuck")
                .await
                .is_some_and(|r| r.state() == State::Delivered)
    })
    .await;
    // Evidence the partition went on after the settlement (what was accepted still
    // checkpoints while paused): its checkpoint names the settled event, written at a later
    // tick, so a read of `after` would have started by now.
    wait_for(
        "the settled event checkpointed",
        &a.health,
        LIMIT,
        || async { bed.checkpoint_of("0").await >= Some(1) },
    )
    .await;
    assert!(handler.calls_of("after").is_empty(), "paused: not read");
    assert!(bed.checkpoint_of("0").await >= checkpoint);
    control::change(store.as_ref(), &name, |_| Some(Pauses::default()))
        .await
        .unwrap();
    wait_for("resumed", &a.health, LIMIT, || async {
        handler.delivered_keys().contains("after") && a.health.held().is_empty()
    })
    .await;
    a.stop().await;
    assert_eq!(
        handler.calls_of("stuck"),
        vec![1, 2],
        "its retry ran while paused"
    );
}
