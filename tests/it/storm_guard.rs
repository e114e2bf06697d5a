//! The dead-letter storm guard, end to end: the real pipeline (real Azure SDK clients, the
//! real webhook handler) against the emulators and a webhook receiver that turns to 400 for
//! everything and back. What it holds the guard to (issue 41): a receiver refusing
//! everything dead-letters fewer than the guard's minimum, cluster-wide; the held events
//! keep their partitions (no checkpoint passes them); once the receiver is fixed a trial
//! releases the guard and every held event is delivered, in order per partition; one bad
//! event among good ones is dead-lettered at once; an operator's acceptance dead-letters the
//! held ones; a replica killed while the guard holds loses nothing; and Service Bus down
//! while retries are held loses nothing either.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hubguard::breaker::storm::{self, StormGuardConfig, StormRecord};
use hubguard::emulator::webhook::WebhookReceiver;
use hubguard::handler::webhook::{WebhookConfig, WebhookHandler};
use hubguard::handler::Handler;
use hubguard::pipeline::health::Health;
use hubguard::pipeline::Pipeline;
use tokio_util::sync::CancellationToken;

use crate::common::{eventually, seen};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);
const PARTITIONS: usize = 4;
/// The guard's minimum: at most one fewer refusals are dead-lettered before it holds.
const MIN: u32 = 5;
const HOUR: Duration = Duration::from_secs(3600);

fn guard_config() -> StormGuardConfig {
    StormGuardConfig {
        min_refusals: MIN,
        share: 0.5,
        window_ms: 60_000,
        trial_every_ms: 1_000,
        // Held retries back off with the hold's age, at most this: scaled down with the
        // trials, so a retry held while Service Bus was down comes back within seconds.
        held_retry_defer_max_ms: 4_000,
        ..Default::default()
    }
}

struct Replica {
    health: Arc<Health>,
    cancel: CancellationToken,
    crash: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _log: crate::test_log::TestLog,
}

impl Replica {
    async fn stop(self) {
        self.cancel.cancel();
        crate::common::within("pipeline stops", self.task)
            .await
            .unwrap();
    }
}

fn replica(bed: &Bed, owner: &str, handler: Arc<dyn Handler>) -> Replica {
    let mut wiring = bed.wiring(owner).policy(fast_policy(50));
    let o = wiring.options_mut();
    o.max_in_flight = 1;
    o.retry_concurrency = 4;
    o.storm_guard = Some(guard_config());
    let pipeline = Pipeline::new(wiring.parts(handler).unwrap());
    let health = pipeline.health();
    let (cancel, crash) = (CancellationToken::new(), CancellationToken::new());
    let (c, k) = (cancel.clone(), crash.clone());
    let task = tokio::spawn(async move { pipeline.run_until(c, k).await.unwrap() });
    Replica {
        health,
        cancel,
        crash,
        task,
        _log: crate::test_log::TestLog::in_process(),
    }
}

fn webhook(receiver: &WebhookReceiver) -> Arc<dyn Handler> {
    Arc::new(WebhookHandler::new(WebhookConfig::new(receiver.url())).unwrap())
}

fn downstream(receiver: &WebhookReceiver) -> String {
    webhook(receiver).downstream()
}

async fn record(bed: &Bed, receiver: &WebhookReceiver) -> StormRecord {
    storm::read(bed.records().as_ref(), &downstream(receiver))
        .await
        .unwrap()
        .unwrap_or_default()
}

async fn dead_letters(bed: &Bed) -> BTreeSet<String> {
    bed.ledger()
        .dead_letter_keys()
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Sends `per` events to each partition, keyed `{prefix}-{partition}-{i:04}` (the i-th event
/// of its partition, in sequence order).
async fn backlog(bed: &Bed, prefix: &str, per: usize) -> Vec<String> {
    let mut keys = Vec::new();
    for p in 0..PARTITIONS {
        let ks: Vec<String> = (0..per).map(|i| format!("{prefix}-{p}-{i:04}")).collect();
        let evs: Vec<(&str, &str)> = ks.iter().map(|k| (k.as_str(), "x")).collect();
        bed.send(p, &evs).await;
        keys.extend(ks);
    }
    keys
}

/// Waits until the guard holds and every given replica's readiness says why.
async fn holding(bed: &Bed, receiver: &WebhookReceiver, replicas: &[&Health]) -> StormRecord {
    let r = eventually("the storm guard holds", LIMIT, || async {
        seen(record(bed, receiver).await, |r| r.holding.is_some())
    })
    .await;
    for h in replicas {
        eventually("readiness says the storm guard holds", LIMIT, || async {
            seen(h.not_ready_reasons(), |r| {
                r.iter().any(|l| l.contains("storm guard holding"))
            })
        })
        .await;
    }
    r
}

/// Every key either delivered or dead-lettered; returns the dead letters.
async fn all_settled(bed: &Bed, receiver: &WebhookReceiver, keys: &[String]) -> BTreeSet<String> {
    eventually("every event delivered or dead-lettered", LIMIT, || async {
        let dead = dead_letters(bed).await;
        let delivered = receiver.deliveries();
        let missing: Vec<&String> = keys
            .iter()
            .filter(|k| !dead.contains(*k) && !delivered.contains_key(*k))
            .collect();
        if missing.is_empty() {
            Ok(dead)
        } else {
            Err(format!(
                "{} missing, e.g. {:?}",
                missing.len(),
                &missing[..missing.len().min(5)]
            ))
        }
    })
    .await
}

/// The i-th event of each partition (the key's last part).
fn index(key: &str) -> (String, usize) {
    let mut parts = key.rsplitn(2, '-');
    let i = parts.next().unwrap().parse().unwrap();
    let p = parts
        .next()
        .unwrap()
        .rsplit('-')
        .next()
        .unwrap()
        .to_string();
    (p, i)
}

/// Per partition, the first deliveries came in sequence order.
fn assert_in_order(receiver: &WebhookReceiver, keys: &[String]) {
    let first = receiver.first_deliveries();
    let mut by_partition: BTreeMap<String, Vec<(SystemTime, usize)>> = BTreeMap::new();
    for k in keys {
        if let Some(t) = first.get(k) {
            let (p, i) = index(k);
            by_partition.entry(p).or_default().push((*t, i));
        }
    }
    for (p, mut ds) in by_partition {
        ds.sort();
        let order: Vec<usize> = ds.iter().map(|(_, i)| *i).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(
            order, sorted,
            "partition {p}: first deliveries out of order"
        );
    }
}

/// No partition's checkpoint passes its first event that is neither delivered nor
/// dead-lettered.
async fn assert_checkpoints_wait(bed: &Bed, receiver: &WebhookReceiver, keys: &[String]) {
    let dead = dead_letters(bed).await;
    let delivered = receiver.deliveries();
    for p in 0..PARTITIONS {
        let held = keys
            .iter()
            .map(|k| index(k))
            .filter(|(q, _)| *q == p.to_string())
            .map(|(_, i)| i)
            .find(|i| {
                let k = keys
                    .iter()
                    .find(|k| index(k) == (p.to_string(), *i))
                    .unwrap();
                !dead.contains(k) && !delivered.contains_key(k)
            });
        if let Some(first_held) = held {
            let cp = bed.checkpoint_of(&p.to_string()).await.unwrap_or(-1);
            assert!(
                cp < first_held as i64,
                "partition {p}: checkpoint {cp} passed held event {first_held}"
            );
        }
    }
}

/// The scenario scaled down, on two replicas: a backlog of 4 × 40 events and a
/// receiver answering 400 to everything, then fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_refusing_everything_dead_letters_under_the_minimum_then_all_is_delivered_in_order(
) {
    let bed = Bed::start(PARTITIONS).await;
    let receiver = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    receiver.faults().error_status_for(400, HOUR);
    let keys = backlog(&bed, "bad-deploy", 40).await;
    let a = replica(&bed, "replica-a", webhook(&receiver));
    let b = replica(&bed, "replica-b", webhook(&receiver));
    let held = holding(&bed, &receiver, &[&a.health, &b.health]).await;
    assert!(held.holding.as_ref().unwrap().refusals >= MIN);
    // Trials come and are refused: still holding, nothing more dead-lettered.
    let trials = held.trial_ms;
    eventually("two more trials, refused", LIMIT, || async {
        seen(record(&bed, &receiver).await, |r| {
            r.trial_ms.is_some()
                && r.trial_ms != trials
                && r.held_refusals >= held.held_refusals + 2
        })
    })
    .await;
    let dead = dead_letters(&bed).await;
    assert!(
        dead.len() < MIN as usize,
        "{} dead-lettered: {dead:?}",
        dead.len()
    );
    assert!(receiver.deliveries().is_empty());
    assert_checkpoints_wait(&bed, &receiver, &keys).await;

    receiver.faults().clear();
    let dead = all_settled(&bed, &receiver, &keys).await;
    assert!(
        dead.len() < MIN as usize,
        "{} dead-lettered after the fix: {dead:?}",
        dead.len()
    );
    let released = eventually("released by a trial", LIMIT, || async {
        seen(record(&bed, &receiver).await, |r| r.holding.is_none())
    })
    .await;
    assert_eq!(released.holds, 1, "{released:?}");
    assert_eq!(
        released.last_action, None,
        "released by its trial, not an operator"
    );
    assert_in_order(&receiver, &keys);
    for h in [&a.health, &b.health] {
        eventually("readiness no longer names the guard", LIMIT, || async {
            seen(h.not_ready_reasons(), |r| {
                !r.iter().any(|l| l.contains("storm guard"))
            })
        })
        .await;
    }
    a.stop().await;
    b.stop().await;
}

/// An ordinary day: a few refusals among many deliveries (more than the minimum, far under
/// the share) are each dead-lettered at once, and the guard never holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_bad_events_among_good_ones_are_dead_lettered_at_once() {
    let bed = Bed::start(1).await;
    let mut events: Vec<(String, &str)> = (0..120).map(|i| (format!("day-{i:04}"), "ok")).collect();
    let bad: Vec<String> = [7usize, 30, 55, 81, 82, 110]
        .iter()
        .map(|i| {
            events[*i].1 = "perm";
            events[*i].0.clone()
        })
        .collect();
    let evs: Vec<(&str, &str)> = events.iter().map(|(k, b)| (k.as_str(), *b)).collect();
    bed.send(0, &evs).await;
    let handler = Arc::new(Scripted::default());
    let r = replica(&bed, "replica-day", handler.clone());
    eventually("every good event delivered", LIMIT, || async {
        seen(handler.delivered_keys().len(), |n| *n == 120 - bad.len())
    })
    .await;
    let dead = eventually("every bad event dead-lettered", LIMIT, || async {
        seen(dead_letters(&bed).await, |d| d.len() == bad.len())
    })
    .await;
    assert_eq!(dead, bad.iter().cloned().collect());
    let rec = storm::read(bed.records().as_ref(), "handler")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((rec.holds, rec.holding.clone()), (0, None), "{rec:?}");
    // Each was attempted once: no refusal waited for the guard.
    for k in &bad {
        assert_eq!(handler.calls_of(k), vec![1], "{k}");
    }
    r.stop().await;
}

/// Runs `hubguard storm-guard …` (the real binary) with a configuration pointing at the bed
/// and the receiver: its exit status and what it printed.
async fn storm_cli(
    bed: &Bed,
    receiver: &WebhookReceiver,
    dir: &std::path::Path,
    args: &[&str],
) -> (Option<i32>, String) {
    let config = dir.join("hubguard.toml");
    std::fs::write(
        &config,
        format!(
            "[eventhubs]\nconnection_string = \"{}\"\nhub = \"hub\"\n[servicebus]\nconnection_string = \"{}\"\n[storage]\ncontainer_url = \"{}\"\n[handler]\nkind = \"webhook\"\nurl = \"{}\"\n",
            bed.eh.connection_string(),
            bed.sb.connection_string(),
            bed.blob.container_url("hubguard"),
            receiver.url(),
        ),
    )
    .unwrap();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
            .arg("storm-guard")
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

/// An operator releases the guard with the command line (the receiver still refuses: it
/// trips again, again under the minimum), then accepts the refusals as real: the held events
/// are dead-lettered. Each change carries who and why; a release with nothing held changes
/// nothing and says so in its exit status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_release_trips_again_and_an_acceptance_dead_letters_the_held_events() {
    let bed = Bed::start(PARTITIONS).await;
    let receiver = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    receiver.faults().error_status_for(400, HOUR);
    let keys = backlog(&bed, "accept", 15).await;
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = storm_cli(&bed, &receiver, dir.path(), &["release", "--by", "ana"]).await;
    assert_eq!(code, Some(6), "nothing held yet: {out}");
    let r = replica(&bed, "replica-op", webhook(&receiver));
    holding(&bed, &receiver, &[&r.health]).await;
    let (code, out) = storm_cli(&bed, &receiver, dir.path(), &["status", "--json"]).await;
    assert_eq!(code, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["state"], "holding", "{v}");
    let args = ["release", "--by", "ana", "--reason", "deploy rolled back?"];
    let (code, out) = storm_cli(&bed, &receiver, dir.path(), &args).await;
    assert_eq!(code, Some(0), "{out}");
    let again = eventually("holding again", LIMIT, || async {
        seen(record(&bed, &receiver).await, |r| {
            r.holds == 2 && r.holding.is_some()
        })
    })
    .await;
    let audit = again.last_action.clone().unwrap();
    assert_eq!(
        (
            audit.action.as_str(),
            audit.by.as_str(),
            audit.reason.as_deref()
        ),
        ("release", "ana", Some("deploy rolled back?"))
    );
    let dead = dead_letters(&bed).await;
    assert!(
        dead.len() < 2 * MIN as usize,
        "{} dead-lettered",
        dead.len()
    );
    let args = [
        "accept",
        "--for",
        "1h",
        "--by",
        "bo",
        "--reason",
        "the schema change is real",
    ];
    let (code, out) = storm_cli(&bed, &receiver, dir.path(), &args).await;
    assert_eq!(code, Some(0), "{out}");
    let dead = all_settled(&bed, &receiver, &keys).await;
    assert_eq!(dead.len(), keys.len(), "every refused event dead-lettered");
    assert!(receiver.deliveries().is_empty());
    let rec = record(&bed, &receiver).await;
    assert_eq!(rec.holds, 2, "an acceptance never trips: {rec:?}");
    assert_eq!(
        rec.last_action.map(|a| (a.action, a.by)),
        Some(("accept".into(), "bo".into()))
    );
    let (_, out) = storm_cli(&bed, &receiver, dir.path(), &["status"]).await;
    assert!(
        out.contains("Accepted") && out.contains("accepted as real until"),
        "{out}"
    );
    r.stop().await;
}

/// A replica killed (no final checkpoint, no release) while the guard holds: its partitions
/// move to the other replica, which finds the guard holding; once the receiver is fixed
/// every event is delivered and fewer than the minimum were dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_while_the_guard_holds_loses_nothing() {
    let bed = Bed::start(PARTITIONS).await;
    let receiver = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    receiver.faults().error_status_for(400, HOUR);
    let keys = backlog(&bed, "killed", 20).await;
    let a = replica(&bed, "replica-killed", webhook(&receiver));
    let b = replica(&bed, "replica-survivor", webhook(&receiver));
    holding(&bed, &receiver, &[&a.health, &b.health]).await;
    a.crash.cancel();
    crate::common::within("the killed replica ends", a.task)
        .await
        .unwrap();
    // The survivor takes every partition over and holds them at the guard too.
    eventually("the survivor owns every partition", LIMIT, || async {
        seen(b.health.owned().len(), |n| *n == PARTITIONS)
    })
    .await;
    assert_checkpoints_wait(&bed, &receiver, &keys).await;
    receiver.faults().clear();
    let dead = all_settled(&bed, &receiver, &keys).await;
    assert!(
        dead.len() < MIN as usize,
        "{} dead-lettered: {dead:?}",
        dead.len()
    );
    b.stop().await;
}

/// Retries held while Service Bus is down: the receiver first fails transiently (503), so
/// every event waits on Service Bus as a retry; then it refuses everything (400) and the
/// guard holds the due retries (deferred, uncounted); Service Bus goes down; the receiver is
/// fixed; Service Bus comes back. Nothing is lost and fewer than the minimum dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_held_while_service_bus_is_down_lose_nothing() {
    let bed = Bed::start(PARTITIONS).await;
    let receiver = WebhookReceiver::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    receiver.faults().error_status_for(503, HOUR);
    let keys = backlog(&bed, "sb-down", 8).await;
    let r = replica(&bed, "replica-sb", webhook(&receiver));
    let ledger = bed.ledger();
    eventually("every event's retry scheduled", LIMIT, || async {
        let mut scheduled = 0;
        for k in &keys {
            if ledger.record(k).await.ok().flatten().is_some() {
                scheduled += 1;
            }
        }
        seen(scheduled, |n| *n == keys.len())
    })
    .await;
    receiver.faults().error_status_for(400, HOUR);
    holding(&bed, &receiver, &[&r.health]).await;
    bed.sb.faults().error_status_for(503, HOUR);
    // The held retries meet Service Bus down: the replica says so, and the guard still
    // holds.
    eventually("readiness names Service Bus", LIMIT, || async {
        seen(r.health.not_ready_reasons(), |rs| {
            rs.iter()
                .any(|l| l.contains("retry loop") || l.contains("Service Bus"))
        })
    })
    .await;
    assert!(record(&bed, &receiver).await.holding.is_some());
    let dead = dead_letters(&bed).await;
    let mut why = Vec::new();
    for k in &dead {
        why.push(format!(
            "{k}: {:?}",
            ledger
                .record(k)
                .await
                .unwrap()
                .map(|r| (r.attempts, r.last_error, r.history))
        ));
    }
    assert!(dead.len() < MIN as usize, "{why:#?}");
    receiver.faults().clear();
    bed.sb.faults().clear();
    let dead = all_settled(&bed, &receiver, &keys).await;
    assert!(
        dead.len() < MIN as usize,
        "{} dead-lettered: {dead:?}",
        dead.len()
    );
    r.stop().await;
}
