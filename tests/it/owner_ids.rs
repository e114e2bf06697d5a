//! An owner id is one process's: a second live process started with the same
//! `processor.owner_id` (a copy-pasted deployment) claims nothing, says why in its
//! readiness, and delivers nothing twice; once the first is gone it takes over.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Handler, Outcome};
use hubguard::pipeline::health::Health;
use hubguard::pipeline::{Pipeline, PipelineParts};
use tokio_util::sync::CancellationToken;

use crate::common::within;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);

/// The scripted handler behind a gate: calls wait until the test opens it.
struct Gated {
    inner: Scripted,
    open: tokio::sync::watch::Sender<bool>,
}

impl Gated {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: Scripted::default(),
            open: tokio::sync::watch::channel(false).0,
        })
    }
}

#[async_trait]
impl Handler for Gated {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|o| *o).await;
        self.inner.handle(event, attempt).await
    }
}

struct Replica {
    health: Arc<Health>,
    cancel: CancellationToken,
    crash: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

fn start(parts: PipelineParts) -> Replica {
    let pipeline = Pipeline::new(parts);
    let health = pipeline.health();
    let (cancel, crash) = (CancellationToken::new(), CancellationToken::new());
    let (c, k) = (cancel.clone(), crash.clone());
    let task = tokio::spawn(async move { pipeline.run_until(c, k).await.unwrap() });
    Replica {
        health,
        cancel,
        crash,
        task,
    }
}

fn duplicates(delivered: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    delivered
        .iter()
        .filter(|k| !seen.insert(k.as_str()))
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_with_the_same_owner_id_claims_nothing_names_the_conflict_and_takes_over_once_the_first_is_gone(
) {
    let bed = Bed::start(4).await;
    let (ha, hb) = (Gated::new(), Gated::new());
    let a = start(bed.parts(ha.clone(), fast_policy(5), "copy-pasted"));
    wait_for(
        "the first owns every partition",
        &a.health,
        LIMIT,
        || async { a.health.owned().len() == 4 },
    )
    .await;

    // A backlog the first has not delivered yet (its handler waits), and a second process
    // with the same owner id.
    let mut keys = Vec::new();
    for p in 0..4 {
        let batch: Vec<String> = (0..50).map(|i| format!("p{p}-{i}")).collect();
        let evs: Vec<(&str, &str)> = batch.iter().map(|k| (k.as_str(), "ok")).collect();
        bed.send(p, &evs).await;
        keys.extend(batch);
    }
    let b = start(bed.parts(hb.clone(), fast_policy(5), "copy-pasted"));
    wait_for(
        "the second refuses the id, or takes partitions",
        &b.health,
        LIMIT,
        || async {
            !b.health.owned().is_empty()
                || b.health
                    .not_ready_reasons()
                    .iter()
                    .any(|r| r.contains("owner id `copy-pasted`"))
        },
    )
    .await;
    assert!(
        b.health.owned().is_empty(),
        "the second claims nothing: {:?}",
        b.health.owned()
    );
    assert!(!b.health.ready(), "/readyz is not 200 on the second");
    // Its readiness names the other instance, as the first process's owner record (beside
    // the ledger) says it.
    let record = bed
        .records()
        .read("owners/hub/$default/copy-pasted")
        .await
        .unwrap()
        .expect("the first process's owner record");
    let first: serde_json::Value = serde_json::from_slice(&record.body).unwrap();
    let first = first["instance"].as_str().unwrap().to_string();
    let reasons = b.health.not_ready_reasons().join("; ");
    assert!(reasons.contains(&first), "{reasons}");

    // The backlog flows: every event once, all by the first.
    ha.open.send_replace(true);
    hb.open.send_replace(true);
    wait_for("the backlog delivered", &a.health, LIMIT, || async {
        let d = ha.inner.delivered_keys();
        keys.iter().all(|k| d.contains(k))
    })
    .await;
    for p in 0..4 {
        let p = p.to_string();
        wait_for("checkpoints at the end", &a.health, LIMIT, || async {
            bed.checkpoint_of(&p).await == Some(49)
        })
        .await;
    }
    assert!(a.health.ready(), "{:?}", a.health.not_ready_reasons());
    assert!(
        hb.inner.delivered.lock().unwrap().is_empty(),
        "the second delivered nothing"
    );
    assert!(b.health.owned().is_empty());

    // The first dies without a word (no release): the second takes over once the first's
    // record and ownerships expire, and reads on from the checkpoints.
    a.crash.cancel();
    within("the first stops", a.task).await.unwrap();
    let mut later = Vec::new();
    for p in 0..4 {
        let key = format!("later-{p}");
        bed.send(p, &[(key.as_str(), "ok")]).await;
        later.push(key);
    }
    wait_for("the second took over", &b.health, LIMIT, || async {
        let d = hb.inner.delivered_keys();
        later.iter().all(|k| d.contains(k))
    })
    .await;
    wait_for("the second is ready", &b.health, LIMIT, || async {
        b.health.ready()
    })
    .await;
    b.cancel.cancel();
    within("the second stops", b.task).await.unwrap();
    drop(b.crash);
    drop(a.cancel);

    let mut all: Vec<String> = ha.inner.delivered.lock().unwrap().clone();
    all.extend(hb.inner.delivered.lock().unwrap().iter().cloned());
    assert_eq!(duplicates(&all), Vec::<String>::new(), "no event twice");
    assert_eq!(all.len(), keys.len() + later.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_started_at_once_with_one_owner_id_deliver_a_backlog_once() {
    let bed = Bed::start(4).await;
    let mut keys = Vec::new();
    for p in 0..4 {
        let batch: Vec<String> = (0..50).map(|i| format!("q{p}-{i}")).collect();
        let evs: Vec<(&str, &str)> = batch.iter().map(|k| (k.as_str(), "ok")).collect();
        bed.send(p, &evs).await;
        keys.extend(batch);
    }
    // A Deployment's two pods, the same fixed id, started together on a backlog.
    let (ha, hb) = (Gated::new(), Gated::new());
    ha.open.send_replace(true);
    hb.open.send_replace(true);
    let a = start(bed.parts(ha.clone(), fast_policy(5), "same-id"));
    let b = start(bed.parts(hb.clone(), fast_policy(5), "same-id"));
    wait_for("the backlog delivered", &a.health, LIMIT, || async {
        let mut d = ha.inner.delivered_keys();
        d.extend(hb.inner.delivered_keys());
        keys.iter().all(|k| d.contains(k))
    })
    .await;
    // Exactly one of them works; the other names the conflict.
    let (worker, idle) = if a.health.owned().is_empty() {
        (&b, &a)
    } else {
        (&a, &b)
    };
    wait_for(
        "the idle one names the conflict",
        &idle.health,
        LIMIT,
        || async {
            idle.health
                .not_ready_reasons()
                .iter()
                .any(|r| r.contains("owner id `same-id`"))
        },
    )
    .await;
    assert_eq!(worker.health.owned().len(), 4);
    assert!(idle.health.owned().is_empty());
    for r in [a, b] {
        r.cancel.cancel();
        within("stops", r.task).await.unwrap();
    }
    let mut all: Vec<String> = ha.inner.delivered.lock().unwrap().clone();
    all.extend(hb.inner.delivered.lock().unwrap().iter().cloned());
    assert_eq!(duplicates(&all), Vec::<String>::new(), "no event twice");
    assert_eq!(all.len(), keys.len());
}
