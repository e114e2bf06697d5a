//! A replica's consumer runs on a pool of threads (`processor.threads`): its partitions
//! spread over them, the processor counting as one task on the first, and a partition stays
//! on one thread from its claim to its release (the SDK's partition streams are not `Send`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Handler, Outcome};

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Records the thread (name and id) each partition's events were handled on.
#[derive(Default)]
struct Where {
    seen: Mutex<BTreeMap<String, BTreeSet<(String, String)>>>,
    delivered: Mutex<BTreeSet<String>>,
}

#[async_trait]
impl Handler for Where {
    async fn handle(&self, event: &Event, _attempt: &Attempt) -> Outcome {
        let here = std::thread::current();
        let name = here.name().unwrap_or("").to_string();
        self.seen
            .lock()
            .unwrap()
            .entry(event.partition_id.clone())
            .or_default()
            .insert((name, format!("{:?}", here.id())));
        self.delivered
            .lock()
            .unwrap()
            .insert(event.identity.idempotency_key.clone());
        Outcome::Delivered
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_partitions_spread_over_its_threads_and_each_stays_on_one() {
    let bed = Bed::start(4).await;
    let handler = Arc::new(Where::default());
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.partition_threads = 2;
    let run = Bed::run(parts);
    wait_for(
        "replica-a owns every partition",
        &run.health,
        LIMIT,
        || async { run.health.owned().len() == 4 },
    )
    .await;
    let mut all = BTreeSet::new();
    for p in 0..4 {
        let keys: Vec<String> = (0..5).map(|i| format!("p{p}-e{i}")).collect();
        let events: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "ok")).collect();
        bed.send(p, &events).await;
        all.extend(keys);
    }
    wait_for("every event delivered", &run.health, LIMIT, || async {
        *handler.delivered.lock().unwrap() == all
    })
    .await;
    run.stop().await;

    let seen = handler.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 4, "every partition delivered: {seen:?}");
    let mut per_thread: BTreeMap<String, usize> = BTreeMap::new();
    for (partition, threads) in &seen {
        assert_eq!(
            threads.len(),
            1,
            "partition {partition} ran on one thread: {threads:?}"
        );
        let (name, id) = threads.iter().next().unwrap();
        assert_eq!(
            name, "hubguard-partitions",
            "the consumer's threads are named"
        );
        *per_thread.entry(id.clone()).or_default() += 1;
    }
    // Two threads, two partitions each: the processor counts as one task on the first, so
    // the first partition claimed goes to the second thread, and so on in turn.
    assert_eq!(
        per_thread.values().copied().collect::<Vec<_>>(),
        vec![2, 2],
        "{seen:?}"
    );
}
