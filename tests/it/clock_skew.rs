//! Replicas whose host clocks are wrong (issue 39): each replica's pipeline runs on a clock of
//! its own whose host reading is off by a chosen amount (`Clock::set_host_error`), while the
//! emulators keep true time. hubguard measures each service's clock from its responses and
//! runs on Service Bus's time; ownership times go to the SDK's load balancer translated into
//! this process's terms (`Clock::to_process`), so a host's error reaches the SDK exactly as it
//! would on a host whose clock is wrong, and the correction must undo it. Checked: nothing
//! lost, every retry started within 5 s of its due time as Service Bus counts it, at most two
//! owner changes per partition, at most 1 % duplicates, and readiness naming the skew.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use azure_messaging_eventhubs::models::{Checkpoint, Ownership};
use azure_messaging_eventhubs::CheckpointStore;
use hubguard::clock::Clock;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Handler, Outcome};
use hubguard::policy::{Curve, RetryPolicy};

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);
/// The retry policy's wait: a refused event comes again 3 s later.
const WAIT_S: u64 = 3;
/// How late (or early) a retry may start against its due time: room for a loaded machine,
/// far inside the skews tried (90 s and more), which a retry timed by a host clock shows.
const SLACK: Duration = Duration::from_secs(20);
/// Events per partition (a fifth refused once).
const PER_PARTITION: usize = 40;

/// The scripted handler, noting when (on Service Bus's clock: the bed's) each attempt began.
struct Timed {
    inner: Scripted,
    service: Arc<Clock>,
    starts: Mutex<HashMap<(String, u32), SystemTime>>,
}

#[async_trait]
impl Handler for Timed {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let key = (event.identity.idempotency_key.clone(), attempt.number);
        self.starts
            .lock()
            .unwrap()
            .entry(key)
            .or_insert_with(|| self.service.now());
        self.inner.handle(event, attempt).await
    }
}

/// Every partition's owner changes, across all the replicas whose stores share it.
#[derive(Default)]
struct Owners {
    /// partition → (owner now, how many times it changed hands).
    by_partition: Mutex<HashMap<String, (String, u32)>>,
}

impl Owners {
    fn claimed(&self, owned: &[Ownership]) {
        let mut m = self.by_partition.lock().unwrap();
        for o in owned {
            let Some(owner) = o.owner_id.clone().filter(|id| !id.is_empty()) else {
                continue;
            };
            let e = m
                .entry(o.partition_id.clone())
                .or_insert_with(|| (owner.clone(), 0));
            if e.0 != owner {
                *e = (owner, e.1 + 1);
            }
        }
    }

    fn changes(&self) -> HashMap<String, u32> {
        let m = self.by_partition.lock().unwrap();
        m.iter().map(|(p, (_, n))| (p.clone(), *n)).collect()
    }
}

/// The bed's checkpoint store for one replica, noting every claim that succeeded.
struct Recording {
    inner: Arc<dyn CheckpointStore + Send + Sync>,
    owners: Arc<Owners>,
}

#[async_trait]
impl CheckpointStore for Recording {
    async fn claim_ownership(&self, o: &[Ownership]) -> azure_core::Result<Vec<Ownership>> {
        let got = self.inner.claim_ownership(o).await?;
        self.owners.claimed(&got);
        Ok(got)
    }
    async fn list_checkpoints(
        &self,
        n: &str,
        h: &str,
        c: &str,
    ) -> azure_core::Result<Vec<Checkpoint>> {
        self.inner.list_checkpoints(n, h, c).await
    }
    async fn list_ownerships(
        &self,
        n: &str,
        h: &str,
        c: &str,
    ) -> azure_core::Result<Vec<Ownership>> {
        self.inner.list_ownerships(n, h, c).await
    }
    async fn update_checkpoint(&self, c: Checkpoint) -> azure_core::Result<()> {
        self.inner.update_checkpoint(c).await
    }
}

fn policy() -> RetryPolicy {
    RetryPolicy {
        name: "skew".into(),
        curve: Curve::Fixed,
        base_s: WAIT_S,
        floor_s: WAIT_S,
        cap_s: 60,
        max_attempts: 5,
        max_age_s: None,
    }
}

/// A replica whose host clock is `error_s` seconds off (its own clock: the emulators' stays
/// true).
fn replica(
    bed: &Bed,
    owner: &str,
    clock: &Arc<Clock>,
    handler: &Arc<Timed>,
    owners: &Arc<Owners>,
) -> Running {
    let container = bed.container();
    container.measure_on(clock.clone());
    let store = hubguard::azure::BlobCheckpointStore::new(Arc::new(container));
    let parts = bed
        .wiring_on(owner, clock.clone())
        .with_checkpoint_store(Arc::new(Recording {
            inner: store,
            owners: owners.clone(),
        }))
        .policy(policy())
        .parts(handler.clone())
        .unwrap();
    Bed::run(parts)
}

fn host_off(error_s: i64) -> Arc<Clock> {
    let c = Arc::new(Clock::default());
    c.set_host_error(error_s * 1000);
    c
}

/// Sends the events: per partition, every fifth refused once.
async fn send_events(bed: &Bed, tag: &str) -> Vec<String> {
    let mut keys = Vec::new();
    for p in 0..4 {
        let batch: Vec<(String, &str)> = (0..PER_PARTITION)
            .map(|i| {
                let body = if i % 5 == 0 { "fail:1" } else { "ok" };
                (format!("{tag}-{p}-{i}"), body)
            })
            .collect();
        let evs: Vec<(&str, &str)> = batch.iter().map(|(k, b)| (k.as_str(), *b)).collect();
        bed.send(p, &evs).await;
        keys.extend(batch.into_iter().map(|(k, _)| k));
    }
    keys
}

/// What a run must show once every event is delivered.
fn check(handler: &Timed, owners: &Owners, keys: &[String]) {
    let delivered = handler.inner.delivered.lock().unwrap().clone();
    let set: std::collections::BTreeSet<&String> = delivered.iter().collect();
    let lost: Vec<&String> = keys.iter().filter(|k| !set.contains(k)).collect();
    assert!(lost.is_empty(), "lost: {lost:?}");
    let duplicates = delivered.len() - set.len();
    assert!(
        duplicates * 100 <= keys.len(),
        "{duplicates} duplicate deliveries of {} events",
        keys.len()
    );
    let starts = handler.starts.lock().unwrap();
    let mut retried = 0;
    for ((key, n), at) in starts.iter().filter(|((_, n), _)| *n > 1) {
        let first = starts[&(key.clone(), n - 1)];
        let due = first + Duration::from_secs(WAIT_S);
        let off = at.duration_since(due).unwrap_or_else(|e| e.duration());
        assert!(
            off <= SLACK,
            "attempt {n} of {key} started {off:?} off its due time (Service Bus's clock)"
        );
        retried += 1;
    }
    assert!(
        retried >= keys.len() / 5,
        "every refused event was retried: {retried}"
    );
    for (p, n) in owners.changes() {
        assert!(n <= 2, "partition {p} changed owner {n} times");
    }
}

/// Waits until `run`'s readiness names the clock skew with its measured value (seconds).
async fn names_the_skew(run: &Running, error_s: i64) {
    let value = format!("{}.", error_s.unsigned_abs());
    let close = format!("{}.", error_s.unsigned_abs() - 1);
    wait_for("readiness names the skew", &run.health, LIMIT, || async {
        run.health
            .not_ready_reasons()
            .iter()
            .any(|r| r.contains("clock skew") && (r.contains(&value) || r.contains(&close)))
    })
    .await;
}

fn names_no_skew(run: &Running) {
    let reasons = run.health.not_ready_reasons();
    assert!(
        !reasons.iter().any(|r| r.contains("clock skew")),
        "{reasons:?}"
    );
}

fn timed(bed: &Bed) -> Arc<Timed> {
    Arc::new(Timed {
        inner: Scripted::default(),
        service: bed.clock(),
        starts: Mutex::default(),
    })
}

/// One replica with a true clock owns everything; one whose host is `error_s` off joins;
/// events flow through both.
async fn two_replicas(error_s: i64) {
    let bed = Bed::start(4).await;
    let handler = timed(&bed);
    let owners = Arc::new(Owners::default());
    let a = replica(&bed, "replica-a", &host_off(0), &handler, &owners);
    wait_for("a owns every partition", &a.health, LIMIT, || async {
        a.health.owned().len() == 4
    })
    .await;
    let b = replica(&bed, "replica-b", &host_off(error_s), &handler, &owners);
    wait_for("b has its share", &b.health, LIMIT, || async {
        b.health.owned().len() == 2 && a.health.owned().len() == 2
    })
    .await;
    let keys = send_events(&bed, &format!("skew{error_s}")).await;
    wait_for("every event delivered", &b.health, LIMIT, || async {
        handler.inner.delivered_keys().len() == keys.len()
    })
    .await;
    names_the_skew(&b, error_s).await;
    names_no_skew(&a);
    a.stop().await;
    b.stop().await;
    check(&handler, &owners, &keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_ten_minutes_behind_loses_nothing_and_says_so() {
    two_replicas(-600).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_ninety_seconds_behind_loses_nothing_and_says_so() {
    two_replicas(-90).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_ninety_seconds_ahead_steals_nothing_and_says_so() {
    two_replicas(90).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_ten_minutes_ahead_steals_nothing_and_says_so() {
    two_replicas(600).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_three_clocks_share_the_partitions_and_every_retry() {
    let bed = Bed::start(4).await;
    let handler = timed(&bed);
    let owners = Arc::new(Owners::default());
    let a = replica(&bed, "replica-a", &host_off(90), &handler, &owners);
    wait_for("a owns every partition", &a.health, LIMIT, || async {
        a.health.owned().len() == 4
    })
    .await;
    let b = replica(&bed, "replica-b", &host_off(-600), &handler, &owners);
    let c = replica(&bed, "replica-c", &host_off(600), &handler, &owners);
    wait_for("the partitions are shared", &c.health, LIMIT, || async {
        let n = [&a, &b, &c].map(|r| r.health.owned().len());
        n.iter().sum::<usize>() == 4 && n.iter().all(|&k| k >= 1)
    })
    .await;
    let keys = send_events(&bed, "three").await;
    wait_for("every event delivered", &a.health, LIMIT, || async {
        handler.inner.delivered_keys().len() == keys.len()
    })
    .await;
    names_the_skew(&a, 90).await;
    names_the_skew(&b, -600).await;
    names_the_skew(&c, 600).await;
    // Checked before the replicas leave: each graceful stop hands its partitions to those
    // still running, which are changes of owner too (a → b → c in the stops alone).
    check(&handler, &owners, &keys);
    for r in [a, b, c] {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_clock_that_jumps_ten_minutes_mid_run_changes_nothing() {
    let bed = Bed::start(4).await;
    let handler = timed(&bed);
    let owners = Arc::new(Owners::default());
    let a = replica(&bed, "replica-a", &host_off(0), &handler, &owners);
    let b_clock = host_off(0);
    let b = replica(&bed, "replica-b", &b_clock, &handler, &owners);
    wait_for("the partitions are shared", &b.health, LIMIT, || async {
        b.health.owned().len() == 2 && a.health.owned().len() == 2
    })
    .await;
    names_no_skew(&b);
    let mut keys = send_events(&bed, "before").await;
    // b's host clock steps ten minutes ahead while the first retries wait.
    b_clock.set_host_error(600_000);
    keys.extend(send_events(&bed, "after").await);
    wait_for("every event delivered", &b.health, LIMIT, || async {
        handler.inner.delivered_keys().len() == keys.len()
    })
    .await;
    names_the_skew(&b, 600).await;
    a.stop().await;
    b.stop().await;
    check(&handler, &owners, &keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_bus_ten_minutes_off_storage_rules_due_times_and_storage_rules_ownership() {
    let bed = Bed::start(4).await;
    // Service Bus's clock (the bed's) ten minutes ahead of blob storage's and the hosts'.
    bed.clock().advance(Duration::from_secs(600));
    let handler = timed(&bed);
    let owners = Arc::new(Owners::default());
    let a = replica(&bed, "replica-a", &host_off(0), &handler, &owners);
    wait_for("a owns every partition", &a.health, LIMIT, || async {
        a.health.owned().len() == 4
    })
    .await;
    let b = replica(&bed, "replica-b", &host_off(0), &handler, &owners);
    wait_for("b has its share", &b.health, LIMIT, || async {
        b.health.owned().len() == 2 && a.health.owned().len() == 2
    })
    .await;
    let keys = send_events(&bed, "sb-off").await;
    wait_for("every event delivered", &b.health, LIMIT, || async {
        handler.inner.delivered_keys().len() == keys.len()
    })
    .await;
    // Both hosts are ten minutes behind the clock policy time follows: each says so.
    names_the_skew(&a, -600).await;
    names_the_skew(&b, -600).await;
    let blob = b
        .health
        .clock_offsets()
        .into_iter()
        .find(|c| c.service == "blob")
        .unwrap();
    assert!(
        blob.offset_ms.is_some_and(|ms| ms.abs() < 2_000) && !blob.beyond_bound,
        "blob storage agrees with the hosts: {blob:?}"
    );
    a.stop().await;
    b.stop().await;
    check(&handler, &owners, &keys);
}
