//! Scaling out and in on a backlog: a replica that joins asks the owner for its share, and
//! the owner hands partitions over (stops reading, finishes, checkpoints, writes the
//! ownership over) instead of having them stolen mid-stream. Nothing is lost, nothing is
//! replayed past the last checkpoint; an event whose settlement waits on a Service Bus outage
//! holds the handover (the checkpoint never passes it) instead of being skipped.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Handler, Outcome};

use crate::common::within;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);

/// The scripted handler, answering after `delay` (a downstream that takes a moment), so a
/// backlog is still flowing when a replica joins.
struct Slow {
    inner: Scripted,
    delay: Duration,
}

#[async_trait]
impl Handler for Slow {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        tokio::time::sleep(self.delay).await; // simulated work: a downstream that takes a moment
        self.inner.handle(event, attempt).await
    }
}

fn slow(ms: u64) -> Arc<Slow> {
    Arc::new(Slow {
        inner: Scripted::default(),
        delay: Duration::from_millis(ms),
    })
}

fn duplicates(all: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    all.iter()
        .filter(|k| !seen.insert(k.as_str()))
        .cloned()
        .collect()
}

async fn backlog(bed: &Bed, partitions: usize, per: usize, tag: &str) -> Vec<String> {
    let mut keys = Vec::new();
    for p in 0..partitions {
        let batch: Vec<String> = (0..per).map(|i| format!("{tag}{p}-{i}")).collect();
        for chunk in batch.chunks(100) {
            let evs: Vec<(&str, &str)> = chunk.iter().map(|k| (k.as_str(), "ok")).collect();
            bed.send(p, &evs).await;
        }
        keys.extend(batch);
    }
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_joining_under_load_is_handed_its_share_with_nothing_lost_and_nothing_replayed() {
    let bed = Bed::start(4).await;
    let keys = backlog(&bed, 4, 300, "j").await;
    let (ha, hb) = (slow(4), slow(4));
    let a = Bed::run(bed.parts(ha.clone(), fast_policy(5), "replica-a"));
    wait_for("a reads every partition", &a.health, LIMIT, || async {
        a.health.owned().len() == 4 && ha.inner.delivered.lock().unwrap().len() >= 40
    })
    .await;
    // b joins mid-backlog: it asks a for two partitions; a hands them over.
    let b = Bed::run(bed.parts(hb.clone(), fast_policy(5), "replica-b"));
    wait_for("b is handed its share", &b.health, LIMIT, || async {
        b.health.owned().len() == 2 && a.health.owned().len() == 2
    })
    .await;
    let at_handover = ha.inner.delivered.lock().unwrap().len();
    assert!(
        at_handover < keys.len(),
        "the handover happened under load ({at_handover} of {} delivered)",
        keys.len()
    );
    wait_for("the backlog delivered", &a.health, LIMIT, || async {
        let mut d = ha.inner.delivered_keys();
        d.extend(hb.inner.delivered_keys());
        keys.iter().all(|k| d.contains(k))
    })
    .await;
    b.stop().await;
    a.stop().await;
    let mut all = ha.inner.delivered.lock().unwrap().clone();
    let from_b = hb.inner.delivered.lock().unwrap().clone();
    assert!(!from_b.is_empty(), "b delivered its partitions' rest");
    all.extend(from_b);
    // The owner checkpointed everything it delivered before writing the ownership over:
    // the new owner starts right after it.
    assert_eq!(duplicates(&all), Vec::<String>::new(), "no event twice");
    assert_eq!(all.len(), keys.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_during_a_service_bus_outage_waits_for_the_held_event_and_skips_nothing() {
    let bed = Bed::start(2).await;
    let ha = slow(0);
    let a = Bed::run(bed.parts(ha.clone(), fast_policy(5), "replica-a"));
    wait_for("a owns both partitions", &a.health, LIMIT, || async {
        a.health.owned().len() == 2
    })
    .await;
    // Service Bus is down: an event that fails once cannot have its retry scheduled, so it
    // is held unsettled on each partition, with events behind it.
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    let mut keys = Vec::new();
    for p in 0..2 {
        let (k0, k1, held, k3) = (
            format!("o{p}-0"),
            format!("o{p}-1"),
            format!("o{p}-held"),
            format!("o{p}-3"),
        );
        bed.send(
            p,
            &[
                (k0.as_str(), "ok"),
                (k1.as_str(), "ok"),
                (held.as_str(), "fail:1"),
                (k3.as_str(), "ok"),
            ],
        )
        .await;
        keys.extend([k0, k1, held, k3]);
    }
    wait_for("both partitions held", &a.health, LIMIT, || async {
        a.health.held().len() == 2
    })
    .await;
    for p in ["0", "1"] {
        wait_for(
            "the checkpoint before the held event",
            &a.health,
            LIMIT,
            || async { bed.checkpoint_of(p).await == Some(1) },
        )
        .await;
    }
    // b joins and asks for one of them; a answers: it stops reading and waits for the
    // held event, renewing the partition meanwhile.
    let hb = slow(0);
    let b = Bed::run(bed.parts(hb.clone(), fast_policy(5), "replica-b"));
    let records = bed.records();
    let asked = std::sync::Mutex::new(None::<String>);
    wait_for("b's request acknowledged", &a.health, LIMIT, || async {
        for l in records.list("handovers/hub/$default/").await.unwrap() {
            let r = records.read(&l.key).await.unwrap().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            if v["asker"] == "replica-b" && v["stage"] == "releasing" {
                *asked.lock().unwrap() = v["partition"].as_str().map(str::to_string);
                return true;
            }
        }
        false
    })
    .await;
    let asked = asked.into_inner().unwrap().unwrap();
    // Longer than an ownership expiration (3 s) in the store's time, and several cycles: a
    // keeps renewing the partition it finishes (Last-Modified, in whole seconds, moves on by
    // more than an expiration), the checkpoint stays before the held event, b reads nothing
    // of that partition.
    let store = bed.checkpoint_store();
    let ownership = || async {
        store
            .list_ownerships(&bed.cs.host, "hub", "$Default")
            .await
            .unwrap()
            .into_iter()
            .find(|o| o.partition_id == asked)
            .expect("the partition is owned")
    };
    let acknowledged = ownership().await.last_modified_time.unwrap();
    wait_for(
        "an ownership expiration of waiting",
        &a.health,
        LIMIT,
        || async {
            assert_eq!(
                bed.checkpoint_of(&asked).await,
                Some(1),
                "never past the held event"
            );
            assert!(
                !b.health.owned().contains_key(&asked),
                "b does not read the partition while a finishes it"
            );
            let o = ownership().await;
            o.owner_id.as_deref() == Some("replica-a")
                && o.last_modified_time
                    .is_some_and(|t| t >= acknowledged + Duration::from_secs(4))
        },
    )
    .await;
    // Service Bus is back: the held event settles (its retry scheduled), a checkpoints
    // past it and writes the ownership over; b reads on from there.
    bed.sb.faults().clear();
    wait_for(
        "b owns the partition it asked for",
        &b.health,
        LIMIT,
        || async { b.health.owned().contains_key(&asked) },
    )
    .await;
    wait_for("every event delivered", &a.health, LIMIT, || async {
        let mut d = ha.inner.delivered_keys();
        d.extend(hb.inner.delivered_keys());
        keys.iter().all(|k| d.contains(k))
    })
    .await;
    b.stop().await;
    a.stop().await;
    let mut all = ha.inner.delivered.lock().unwrap().clone();
    all.extend(hb.inner.delivered.lock().unwrap().iter().cloned());
    assert_eq!(duplicates(&all), Vec::<String>::new(), "no event twice");
    assert_eq!(all.len(), keys.len(), "nothing skipped: {all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopping_gracefully_hands_its_partitions_over_without_waiting_for_expiry() {
    let bed = Bed::start(4).await;
    let keys = backlog(&bed, 4, 200, "s").await;
    let (ha, hb) = (slow(4), slow(4));
    let a = Bed::run(bed.parts(ha.clone(), fast_policy(5), "replica-a"));
    wait_for("a reads every partition", &a.health, LIMIT, || async {
        a.health.owned().len() == 4
    })
    .await;
    let b = Bed::run(bed.parts(hb.clone(), fast_policy(5), "replica-b"));
    wait_for("shared", &b.health, LIMIT, || async {
        b.health.owned().len() == 2 && a.health.owned().len() == 2
    })
    .await;
    // a leaves (SIGTERM): it finishes, checkpoints and releases each partition, so b need
    // not wait for the 3 s expiration — once a has stopped, no ownership names it.
    a.stop().await;
    let owners = bed
        .checkpoint_store()
        .list_ownerships(&bed.cs.host, "hub", "$Default")
        .await
        .unwrap();
    assert!(
        owners
            .iter()
            .all(|o| o.owner_id.as_deref() != Some("replica-a")),
        "a stopped without releasing its partitions: {owners:?}"
    );
    wait_for("b took a's partitions", &b.health, LIMIT, || async {
        b.health.owned().len() == 4
    })
    .await;
    wait_for("the backlog delivered", &b.health, LIMIT, || async {
        let mut d = ha.inner.delivered_keys();
        d.extend(hb.inner.delivered_keys());
        keys.iter().all(|k| d.contains(k))
    })
    .await;
    b.stop().await;
    let mut all = ha.inner.delivered.lock().unwrap().clone();
    all.extend(hb.inner.delivered.lock().unwrap().iter().cloned());
    assert_eq!(duplicates(&all), Vec::<String>::new(), "no event twice");
    assert_eq!(all.len(), keys.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_never_answers_the_request_loses_the_partition_at_expiry() {
    use azure_messaging_eventhubs::models::Ownership;
    let bed = Bed::start(2).await;
    // A live owner that does not speak the handover (another SDK's processor, a hung one):
    // it renews both ownerships every 0.5 s and never reads requests.
    let store = bed.checkpoint_store();
    let mut held: Vec<Ownership> = (0..2)
        .map(|p| Ownership {
            fully_qualified_namespace: bed.cs.host.clone(),
            event_hub_name: "hub".into(),
            consumer_group: "$Default".into(),
            partition_id: p.to_string(),
            owner_id: Some("silent".into()),
            ..Default::default()
        })
        .collect();
    held = store.claim_ownership(&held).await.unwrap();
    assert_eq!(held.len(), 2);
    let (renewing, stop) = (store.clone(), tokio_util::sync::CancellationToken::new());
    let stopped = stop.clone();
    let silent = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = stopped.cancelled() => break,
                _ = tick.tick() => {
                    // A lost renewal (412) leaves the partition out: it was taken.
                    held = renewing.claim_ownership(&held).await.unwrap();
                }
            }
        }
        held
    });

    let ha = slow(0);
    // Timed from before the replica starts: it asks at some moment after this, and the
    // product takes the partition only once its own request is an ownership expiration
    // old — so the time from here is at least the expiration, however late this test
    // itself sees the request on a loaded machine.
    let started = tokio::time::Instant::now();
    let a = Bed::run(bed.parts(ha.clone(), fast_policy(5), "replica-a"));
    let records = bed.records();
    let asked_for = std::sync::Mutex::new(None::<String>);
    wait_for("a asks for a partition", &a.health, LIMIT, || async {
        let listed = records.list("handovers/hub/$default/").await.unwrap();
        *asked_for.lock().unwrap() = listed
            .first()
            .and_then(|l| l.key.rsplit('/').next().map(str::to_string));
        !listed.is_empty()
    })
    .await;
    let asked_seen = tokio::time::Instant::now();
    let asked_for = asked_for.into_inner().unwrap().unwrap();
    assert!(a.health.owned().is_empty(), "asked, not stolen");
    wait_for("a takes the partition", &a.health, LIMIT, || async {
        a.health.owned().contains_key(&asked_for)
    })
    .await;
    // The ownership expiration of the bed is 3 s, the load-balancing interval 0.5 s: taken
    // after the expiration, never before, and not stuck behind the silent owner's renewals
    // (a loose upper bound: taken at all, within a few expirations of being seen asked).
    let (from_start, from_seen) = (started.elapsed(), asked_seen.elapsed());
    assert!(
        from_start >= Duration::from_secs(3),
        "taken {from_start:?} after the replica started: before the expiration"
    );
    assert!(
        from_seen < Duration::from_secs(30),
        "taken {from_seen:?} after the request was seen: not at the expiration"
    );
    let owners = store
        .list_ownerships(&bed.cs.host, "hub", "$Default")
        .await
        .unwrap();
    for o in owners {
        let expected = if o.partition_id == asked_for {
            "replica-a"
        } else {
            "silent"
        };
        assert_eq!(o.owner_id.as_deref(), Some(expected), "{o:?}");
    }
    stop.cancel();
    within("the silent owner stops", silent).await.unwrap();
    a.stop().await;
}
