//! A released line of ordered retries drained in ordered batches (a handler taking batches,
//! `retry_ordering = "key"`), on the emulators through the real SDK clients: once a line's
//! head is delivered, the events parked behind it go to the handler in sequence order, many
//! per call; a failure in a batch heads the line and everything after it waits for it; a
//! crash mid-drain loses nothing. Checked from what the receiver saw and the ledger.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use hubguard::emulator::faults::{Faults, Held};
use hubguard::handler::{Failure, Handler, Outcome};
use hubguard::ledger::State;
use hubguard::pipeline::LineOnDeadLetter;
use hubguard::{BatchHandler, BatchLimits, Batched, Item};

use crate::ordered_retries::{ev, policy, send, start, Replica};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(120);

/// One event as the receiver saw it in a call.
#[derive(Debug, Clone)]
struct Seen {
    key: String,
    order: String,
    seq: i64,
    attempt: u32,
    delivered: bool,
}

/// A receiver of batches that keeps each ordering key in order: bodies script the outcome
/// (`ok`; `fail:N`, the first N calls of the event fail transiently); within a call, once an
/// event of a key failed, the later events of that key are not processed (answered as
/// transient failures). While `hang_on` names a key, a call carrying it never answers. The
/// second call carrying more than one event holds, before it answers, every later write of a
/// line pointer on the blob emulator whose faults `hold_at` names (`held`).
#[derive(Default)]
struct Receiver {
    calls: Mutex<Vec<Vec<Seen>>>,
    hang_on: Mutex<Option<String>>,
    hung: tokio::sync::Notify,
    hanging: AtomicBool,
    hold_at: Mutex<Option<Arc<Faults>>>,
    held: Mutex<Option<Arc<Held>>>,
}

impl Receiver {
    fn calls(&self) -> Vec<Vec<Seen>> {
        self.calls.lock().unwrap().clone()
    }

    /// Successful deliveries of `key`.
    fn deliveries_of(&self, key: &str) -> usize {
        self.calls()
            .iter()
            .flatten()
            .filter(|s| s.delivered && s.key == key)
            .count()
    }

    /// Whether every one of `keys` was delivered.
    fn delivered_all(&self, keys: &[String]) -> bool {
        keys.iter().all(|k| self.deliveries_of(k) > 0)
    }

    /// Calls that carried more than one event of ordering key `order`.
    fn batches_of(&self, order: &str) -> Vec<Vec<String>> {
        self.calls()
            .into_iter()
            .map(|c| {
                c.into_iter()
                    .filter(|s| s.order == order)
                    .map(|s| s.key)
                    .collect::<Vec<_>>()
            })
            .filter(|c| c.len() > 1)
            .collect()
    }

    /// The hold armed by the second call of more than one event.
    fn held(&self) -> Option<Arc<Held>> {
        self.held.lock().unwrap().clone()
    }

    /// The keys of each call that carried more than one event, in order.
    fn multi_calls(&self) -> Vec<Vec<String>> {
        self.calls()
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|c| c.into_iter().map(|s| s.key).collect())
            .collect()
    }

    /// Asserts that the deliveries of ordering key `order` (keys `{order}-N`, N its place in
    /// the line) went one after the other, each the next event of the line after the one
    /// before, or a step back: a duplicate only as a re-run, in sequence order, of a suffix.
    fn assert_reruns_in_order(&self, order: &str) {
        let delivered: Vec<usize> = self
            .calls()
            .into_iter()
            .flatten()
            .filter(|s| s.delivered && s.order == order)
            .map(|s| s.key.rsplit('-').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(delivered.first(), Some(&0), "{delivered:?}");
        for w in delivered.windows(2) {
            assert!(
                w[1] == w[0] + 1 || w[1] <= w[0],
                "{} delivered right after {}: {delivered:?}",
                w[1],
                w[0]
            );
        }
    }

    /// Asserts that each key's first successful deliveries came in sequence order.
    fn assert_in_order(&self) {
        let mut last: BTreeMap<String, i64> = BTreeMap::new();
        let mut firsts = std::collections::BTreeSet::new();
        for s in self.calls().into_iter().flatten() {
            if !s.delivered || !firsts.insert(s.key.clone()) {
                continue;
            }
            if let Some(prev) = last.get(&s.order) {
                assert!(
                    s.seq > *prev,
                    "{} (sequence number {}) first delivered after sequence number {prev} of key {}: {:?}",
                    s.key,
                    s.seq,
                    s.order,
                    self.calls()
                );
            }
            last.insert(s.order.clone(), s.seq);
        }
    }
}

#[async_trait]
impl BatchHandler for Receiver {
    async fn handle_batch(&self, items: &[Item<'_>]) -> Vec<Outcome> {
        let hang = self.hang_on.lock().unwrap().clone();
        if let Some(h) = hang {
            if items.iter().any(|i| i.event.identity.idempotency_key == h) {
                self.hanging.store(true, Ordering::SeqCst);
                self.hung.notify_one();
                std::future::pending::<()>().await;
            }
        }
        let mut calls = self.calls.lock().unwrap();
        let mut failed_orders = std::collections::BTreeSet::new();
        let mut call = Vec::new();
        let mut out = Vec::new();
        for i in items {
            let e = i.event;
            let key = e.identity.idempotency_key.clone();
            let order = e.properties.get("order").cloned().unwrap_or_default();
            let before = calls.iter().flatten().filter(|s| s.key == key).count() as u32;
            let body = String::from_utf8_lossy(&e.body).to_string();
            let outcome = if failed_orders.contains(&order) {
                Outcome::Failed(Failure::transient(
                    "not processed: an earlier event of its key failed",
                ))
            } else {
                match body.strip_prefix("fail:") {
                    Some(n) if before < n.parse::<u32>().unwrap_or(0) => {
                        Outcome::Failed(Failure::transient("scripted failure"))
                    }
                    _ => Outcome::Delivered,
                }
            };
            if outcome != Outcome::Delivered {
                failed_orders.insert(order.clone());
            }
            call.push(Seen {
                key,
                order,
                seq: e.sequence_number,
                attempt: i.attempt.number,
                delivered: outcome == Outcome::Delivered,
            });
            out.push(outcome);
        }
        calls.push(call);
        if calls.iter().filter(|c| c.len() > 1).count() == 2 {
            if let Some(faults) = self.hold_at.lock().unwrap().take() {
                *self.held.lock().unwrap() = Some(faults.hold_requests("PUT", "/lines/"));
            }
        }
        out
    }
}

fn handler(receiver: &Arc<Receiver>, max: usize) -> Arc<dyn Handler> {
    Arc::new(Batched::shared(
        receiver.clone(),
        BatchLimits {
            max_events: max,
            max_bytes: 1 << 20,
            wait: Duration::ZERO,
        },
    ))
}

/// `n` events of key `k` behind a head that fails once (`k-0`), bodies by `body`.
fn line(n: usize, body: impl Fn(usize) -> &'static str) -> Vec<(String, String, String)> {
    let mut events = vec![ev("k-0", "k", "fail:1")];
    events.extend((1..=n).map(|i| ev(&format!("k-{i}"), "k", body(i))));
    events
}

fn keys(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("k-{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_line_drains_in_order_in_batches_each_event_once() {
    let bed = Bed::start(1).await;
    let clock = bed.clock();
    let receiver = Arc::new(Receiver::default());
    send(&bed, 0, &line(40, |_| "ok")).await;
    let r = start(
        &bed,
        "replica-a",
        handler(&receiver, 10),
        policy(60, 5),
        LineOnDeadLetter::Release,
        |_| {},
    );
    let ledger = bed.ledger();
    wait_for("40 events parked behind k-0", &r.health, LIMIT, || async {
        ledger.all_parked().await.unwrap().len() == 40
    })
    .await;
    assert_eq!(receiver.deliveries_of("k-1"), 0, "parked, not delivered");
    clock.advance(Duration::from_secs(61));
    let all = keys(40);
    wait_for("the line drained", &r.health, LIMIT, || async {
        receiver.delivered_all(&all) && ledger.lines(None).await.unwrap().is_empty()
    })
    .await;
    receiver.assert_in_order();
    for k in &all {
        assert_eq!(receiver.deliveries_of(k), 1, "{k} delivered once");
        let rec = ledger.record(k).await.unwrap().expect("its ledger record");
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 1), "{k}");
    }
    let batches = receiver.batches_of("k");
    assert!(
        batches.iter().any(|b| b.len() > 1),
        "the line went out in batches: {:?}",
        receiver.calls()
    );
    assert!(batches.iter().all(|b| b.len() <= 10), "{batches:?}");
    assert!(ledger.all_parked().await.unwrap().is_empty());
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_mid_batch_heads_the_line_and_nothing_after_it_counts_before_it() {
    let bed = Bed::start(1).await;
    let clock = bed.clock();
    let receiver = Arc::new(Receiver::default());
    send(&bed, 0, &line(20, |i| if i == 7 { "fail:1" } else { "ok" })).await;
    let r = start(
        &bed,
        "replica-a",
        handler(&receiver, 10),
        policy(60, 5),
        LineOnDeadLetter::Release,
        |_| {},
    );
    let ledger = bed.ledger();
    wait_for("20 events parked behind k-0", &r.health, LIMIT, || async {
        ledger.all_parked().await.unwrap().len() == 20
    })
    .await;
    clock.advance(Duration::from_secs(61));
    wait_for(
        "k-7 failed and heads the line",
        &r.health,
        LIMIT,
        || async {
            let lines = ledger.lines(None).await.unwrap();
            let rec = ledger.record("k-7").await.unwrap();
            lines.len() == 1
                && lines[0].head_key == "k-7"
                && rec.is_some_and(|r| r.state() == State::RetryScheduled && r.attempts == 1)
        },
    )
    .await;
    // k-7 went in a batch with later events of its key: none of them counts as delivered,
    // none has a record (not attempted), all still wait parked behind k-7.
    let with_k7: Vec<Vec<String>> = receiver
        .batches_of("k")
        .into_iter()
        .filter(|b| b.contains(&"k-7".to_string()))
        .collect();
    assert!(
        with_k7.iter().any(|b| b.contains(&"k-8".to_string())),
        "k-7 and k-8 in one batch: {:?}",
        receiver.calls()
    );
    for i in 8..=20 {
        let k = format!("k-{i}");
        assert_eq!(receiver.deliveries_of(&k), 0, "{k} waits behind k-7");
        assert!(
            ledger.record(&k).await.unwrap().is_none(),
            "{k} not attempted"
        );
    }
    assert_eq!(ledger.all_parked().await.unwrap().len(), 13);
    for i in 1..=6 {
        assert_eq!(receiver.deliveries_of(&format!("k-{i}")), 1);
    }
    clock.advance(Duration::from_secs(61));
    let all = keys(20);
    wait_for("the line drained", &r.health, LIMIT, || async {
        receiver.delivered_all(&all) && ledger.lines(None).await.unwrap().is_empty()
    })
    .await;
    receiver.assert_in_order();
    for k in &all {
        assert_eq!(receiver.deliveries_of(k), 1, "{k} delivered once");
    }
    let k7 = ledger.record("k-7").await.unwrap().unwrap();
    assert_eq!((k7.state(), k7.attempts), (State::Delivered, 2));
    // k-8 went twice (with k-7's failure, then after it), and counted one attempt.
    let k8 = ledger.record("k-8").await.unwrap().unwrap();
    assert_eq!((k8.state(), k8.attempts), (State::Delivered, 1));
    let k8_calls: Vec<u32> = receiver
        .calls()
        .into_iter()
        .flatten()
        .filter(|s| s.key == "k-8")
        .map(|s| s.attempt)
        .collect();
    assert_eq!(
        k8_calls,
        vec![1, 1],
        "not attempted the first time: the same attempt again"
    );
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_drain_loses_nothing_and_the_next_keeps_the_order() {
    let bed = Bed::start(1).await;
    let clock = bed.clock();
    let receiver = Arc::new(Receiver::default());
    *receiver.hang_on.lock().unwrap() = Some("k-11".into());
    send(&bed, 0, &line(30, |_| "ok")).await;
    let a = start(
        &bed,
        "replica-a",
        handler(&receiver, 10),
        policy(60, 5),
        LineOnDeadLetter::Release,
        |_| {},
    );
    let ledger = bed.ledger();
    wait_for("30 events parked behind k-0", &a.health, LIMIT, || async {
        ledger.all_parked().await.unwrap().len() == 30
    })
    .await;
    clock.advance(Duration::from_secs(61));
    crate::common::within(
        "the second batch of the drain hangs",
        receiver.hung.notified(),
    )
    .await;
    assert!(receiver.hanging.load(Ordering::SeqCst));
    // What was answered before the hang: the line's first events, in order, each once — the
    // first batch of ten (recorded before the second is called), or, when the sweep
    // released `k-1` one by one just before the drain took its lease, `k-1` alone.
    let answered: Vec<String> = receiver
        .calls()
        .into_iter()
        .flatten()
        .filter(|s| s.delivered && s.key != "k-0")
        .map(|s| s.key)
        .collect();
    let prefix: Vec<String> = (1..=answered.len()).map(|i| format!("k-{i}")).collect();
    assert!(!answered.is_empty() && answered == prefix, "{answered:?}");
    a.kill().await;
    // The dead drain's lease lapses; replica-b's sweep moves the line on.
    *receiver.hang_on.lock().unwrap() = None;
    clock.advance(Duration::from_secs(61));
    let b = start(
        &bed,
        "replica-b",
        handler(&receiver, 10),
        policy(60, 5),
        LineOnDeadLetter::Release,
        |_| {},
    );
    let all = keys(30);
    wait_for("replica-b drains the rest", &b.health, LIMIT, || async {
        receiver.delivered_all(&all) && ledger.lines(None).await.unwrap().is_empty()
    })
    .await;
    receiver.assert_in_order();
    for k in &answered {
        assert_eq!(
            receiver.deliveries_of(k),
            1,
            "{k}: recorded before the kill"
        );
    }
    assert!(ledger.all_parked().await.unwrap().is_empty());
    b.stop().await;
}

/// Starts a replica draining a line of 30 events behind `k-0` in batches of 10, every write
/// of the line's pointer held from the second batch's call on (the first batch settles
/// before the second is called); returns once a third batch was in the handler while the
/// second one's pointer write is held, with the keys of the three batches.
async fn drain_with_the_pointer_held(
    bed: &Bed,
    receiver: &Arc<Receiver>,
) -> (Replica, Arc<Held>, Vec<Vec<String>>) {
    *receiver.hold_at.lock().unwrap() = Some(bed.blob.faults().clone());
    send(bed, 0, &line(30, |_| "ok")).await;
    let r = start(
        bed,
        "replica-a",
        handler(receiver, 10),
        policy(60, 5),
        LineOnDeadLetter::Release,
        // A held write must outlast the test's look at it, not time out.
        |o| o.deadline = LIMIT,
    );
    let ledger = bed.ledger();
    wait_for("30 events parked behind k-0", &r.health, LIMIT, || async {
        ledger.all_parked().await.unwrap().len() == 30
    })
    .await;
    bed.clock().advance(Duration::from_secs(61));
    wait_for(
        "a third batch in the handler while the second one's pointer write is held",
        &r.health,
        LIMIT,
        || async {
            receiver.multi_calls().len() >= 3 && receiver.held().is_some_and(|h| h.arrived() > 0)
        },
    )
    .await;
    let held = receiver.held().unwrap();
    let batches = receiver.multi_calls();
    (r, held, batches)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_calls_the_next_batch_while_the_batch_before_is_written() {
    let bed = Bed::start(1).await;
    let receiver = Arc::new(Receiver::default());
    let (r, held, batches) = drain_with_the_pointer_held(&bed, &receiver).await;
    // The second batch is not settled (the pointer still names the first one's last event)
    // and the third went to the handler already.
    let ledger = bed.ledger();
    let lines = ledger.lines(None).await.unwrap();
    assert_eq!(lines.len(), 1);
    assert_eq!(
        Some(&lines[0].head_key),
        batches[0].last(),
        "the second batch's pointer write is held: {batches:?}"
    );
    held.release();
    let all = keys(30);
    wait_for("the line drained", &r.health, LIMIT, || async {
        receiver.delivered_all(&all) && ledger.lines(None).await.unwrap().is_empty()
    })
    .await;
    receiver.assert_in_order();
    for k in &all {
        assert_eq!(receiver.deliveries_of(k), 1, "{k} delivered once");
        let rec = ledger.record(k).await.unwrap().expect("its ledger record");
        assert_eq!((rec.state(), rec.attempts), (State::Delivered, 1), "{k}");
    }
    let batches = receiver.batches_of("k");
    assert!(batches.iter().all(|b| b.len() <= 10), "{batches:?}");
    assert!(ledger.all_parked().await.unwrap().is_empty());
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pointer_write_under_a_pipelined_batch_loses_nothing_and_keeps_the_order() {
    let bed = Bed::start(1).await;
    let receiver = Arc::new(Receiver::default());
    let (r, held, batches) = drain_with_the_pointer_held(&bed, &receiver).await;
    // Blob storage fails the second batch's pointer write while the third was delivered on
    // top of it.
    held.fail(500);
    let ledger = bed.ledger();
    let all = keys(30);
    wait_for("the line drained", &r.health, LIMIT, || async {
        receiver.delivered_all(&all) && ledger.lines(None).await.unwrap().is_empty()
    })
    .await;
    receiver.assert_in_order();
    receiver.assert_reruns_in_order("k");
    // Delivered but not recorded when the write before them failed: they went again.
    for k in &all {
        let times = if batches[2].contains(k) { 2 } else { 1 };
        assert_eq!(receiver.deliveries_of(k), times, "{k}: {batches:?}");
    }
    for k in &all {
        let rec = ledger.record(k).await.unwrap().expect("its ledger record");
        assert_eq!(rec.state(), State::Delivered, "{k}");
    }
    assert!(ledger.all_parked().await.unwrap().is_empty());
    r.stop().await;
}
