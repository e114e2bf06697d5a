//! A process frozen past its ownership's expiration (a stopped container, a paused VM, a long
//! GC pause) delivers nothing of the partitions it lost when it wakes: before each delivery
//! the partition's last confirmed ownership is checked on the monotonic clock, and a stale
//! one makes the event stand down (unsettled, nothing checkpointed past it) until the next
//! confirmation — which, when another replica took the partition meanwhile, never comes.

use std::collections::BTreeSet;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Handler, Outcome};

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A handler whose first call of the key `freeze` freezes the whole consumer of its replica:
/// it blocks the thread its runtime runs on (with `partition_threads = 1` the partition
/// tasks and the processor's load balancing share it), as SIGSTOP would, until the test
/// wakes it. Records every key
/// delivered, and which were delivered after the wake.
struct Freezer {
    frozen: Mutex<Option<mpsc::Sender<()>>>,
    wake: Mutex<mpsc::Receiver<()>>,
    woken: std::sync::atomic::AtomicBool,
    delivered: Mutex<Vec<String>>,
    after_wake: Mutex<Vec<String>>,
}

#[async_trait]
impl Handler for Freezer {
    async fn handle(&self, event: &Event, _attempt: &Attempt) -> Outcome {
        let key = event.identity.idempotency_key.clone();
        let freeze = self.frozen.lock().unwrap().take();
        if key == "freeze" {
            if let Some(frozen) = freeze {
                let _ = frozen.send(());
                // Blocks the thread, not the task: the replica's consumer stands still.
                let _ = self.wake.lock().unwrap().recv();
                self.woken.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        } else if self.woken.load(std::sync::atomic::Ordering::SeqCst) {
            self.after_wake.lock().unwrap().push(key.clone());
        } else {
            // Put back: only the key `freeze` freezes.
            *self.frozen.lock().unwrap() = freeze;
        }
        self.delivered.lock().unwrap().push(key);
        Outcome::Delivered
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_frozen_past_its_ownership_delivers_nothing_of_the_partition_it_lost() {
    crate::otlp::telemetry();
    let bed = Bed::start(1).await;
    let (frozen_tx, frozen_rx) = mpsc::channel();
    let (wake_tx, wake_rx) = mpsc::channel();
    let freezer = Arc::new(Freezer {
        frozen: Mutex::new(Some(frozen_tx)),
        wake: Mutex::new(wake_rx),
        woken: Default::default(),
        delivered: Mutex::default(),
        after_wake: Mutex::default(),
    });
    let mut parts = bed.parts(freezer.clone(), fast_policy(5), "replica-a");
    // One thread for the whole consumer, so blocking it freezes the load balancing too.
    parts.options.partition_threads = 1;
    let a = Bed::run(parts);
    wait_for("replica-a owns the partition", &a.health, LIMIT, || async {
        a.health.owned().contains_key("0")
    })
    .await;
    let keys: Vec<String> = std::iter::once("freeze".to_string())
        .chain((1..=20).map(|i| format!("e{i}")))
        .collect();
    let events: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "ok")).collect();
    bed.send(0, &events).await;
    tokio::task::spawn_blocking(move || frozen_rx.recv_timeout(LIMIT))
        .await
        .unwrap()
        .expect("replica-a froze in its first delivery");
    let froze = std::time::Instant::now();

    // While replica-a is frozen, replica-b takes the partition (replica-a's ownership
    // expires unrenewed) and delivers everything from the checkpoint.
    let handler_b = Arc::new(Scripted::default());
    let b = Bed::run(bed.parts(handler_b.clone(), fast_policy(5), "replica-b"));
    let all: BTreeSet<String> = keys.iter().cloned().collect();
    // Frozen for longer than twice the ownership expiration (3 s in the test bed).
    wait_for(
        "replica-b delivered every event, replica-a frozen for 7 s",
        &b.health,
        LIMIT,
        || async { handler_b.delivered_keys() == all && froze.elapsed() > Duration::from_secs(7) },
    )
    .await;

    // Woken, replica-a finds its ownership stale and stands down: its partition task ends
    // without delivering anything more.
    wake_tx.send(()).unwrap();
    wait_for(
        "replica-a gave the partition up",
        &a.health,
        LIMIT,
        || async { !a.health.owned().contains_key("0") },
    )
    .await;
    let after: Vec<String> = freezer.after_wake.lock().unwrap().clone();
    assert!(
        after.is_empty(),
        "replica-a delivered {} event(s) of a partition it had lost, after waking: {after:?}",
        after.len()
    );
    a.stop().await;
    b.stop().await;
}
