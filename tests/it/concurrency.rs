//! Concurrency within a partition (`max_in_flight`): events run at once, events sharing an
//! ordering key run one after another in sequence order, and no checkpoint ever covers an
//! event that had not settled when the checkpoint was written — checked against the blob
//! emulator's write history and the Service Bus emulator's accepted sends.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
use azure_messaging_eventhubs::EventDataBatchOptions;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Failure, Handler, Outcome};
use hubguard::ledger::State;
use hubguard::pipeline::OrderingKey;

use crate::common::*;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// What one handler call saw.
#[derive(Debug, Clone)]
struct Call {
    key: String,
    order: String,
    seq: i64,
    attempt: u32,
    started: SystemTime,
    ended: SystemTime,
}

/// A slow downstream: every call takes `delay`; bodies script failures as in [`Scripted`].
/// It records every call, the most calls it saw at once, and first attempts (the partition's
/// side) that overlapped another first attempt with the same ordering key.
struct Slow {
    delay: Duration,
    calls: Mutex<Vec<Call>>,
    running: Mutex<HashMap<String, u32>>,
    now: std::sync::atomic::AtomicU32,
    max_at_once: std::sync::atomic::AtomicU32,
    same_key_overlaps: std::sync::atomic::AtomicU32,
}

impl Slow {
    fn new(delay: Duration) -> Self {
        Self {
            delay,
            calls: Mutex::default(),
            running: Mutex::default(),
            now: 0.into(),
            max_at_once: 0.into(),
            same_key_overlaps: 0.into(),
        }
    }
}

#[async_trait]
impl Handler for Slow {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        use std::sync::atomic::Ordering::SeqCst;
        // Order holds within the partition (attempt 1); retries run from Service Bus and
        // are not ordered by key, so they are not counted here.
        let order = match attempt.number {
            1 => event.properties.get("order").cloned().unwrap_or_default(),
            n => format!("retry-{}-{n}", event.identity.idempotency_key),
        };
        {
            let mut r = self.running.lock().unwrap();
            let n = r.entry(order.clone()).or_default();
            *n += 1;
            if *n > 1 {
                self.same_key_overlaps.fetch_add(1, SeqCst);
            }
        }
        let now = self.now.fetch_add(1, SeqCst) + 1;
        self.max_at_once.fetch_max(now, SeqCst);
        let started = SystemTime::now();
        tokio::time::sleep(self.delay).await; // simulated work: the handler call takes `delay`
        let key = event.identity.idempotency_key.clone();
        let before = self
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.key == key)
            .count() as u32;
        let body = String::from_utf8_lossy(&event.body).to_string();
        let outcome = match body.strip_prefix("fail:") {
            Some(k) if before < k.parse::<u32>().unwrap_or(0) => {
                Outcome::Failed(Failure::transient("scripted failure"))
            }
            _ if body == "perm" => Outcome::Failed(Failure::permanent("scripted permanent")),
            _ => Outcome::Delivered,
        };
        self.now.fetch_sub(1, SeqCst);
        *self.running.lock().unwrap().get_mut(&order).unwrap() -= 1;
        self.calls.lock().unwrap().push(Call {
            key,
            order: event.properties.get("order").cloned().unwrap_or_default(),
            seq: event.sequence_number,
            attempt: attempt.number,
            started,
            ended: SystemTime::now(),
        });
        outcome
    }
}

/// Sends `(key, order, body)` events to partition 0 in one batch.
async fn send(bed: &Bed, events: &[(String, String, String)]) {
    let prod = producer(&bed.cs, "hub").await;
    for chunk in events.chunks(100) {
        let batch = within(
            "batch",
            prod.create_batch(Some(EventDataBatchOptions {
                partition_id: Some("0".into()),
                ..Default::default()
            })),
        )
        .await
        .unwrap();
        for (key, order, body) in chunk {
            let ev = EventData::builder()
                .with_body(body.as_bytes().to_vec())
                .add_property("ce_id".into(), AmqpSimpleValue::String(key.clone()))
                .add_property("order".into(), AmqpSimpleValue::String(order.clone()))
                .build();
            assert!(batch.try_add_event_data(ev, None).unwrap());
        }
        within("send", prod.send_batch(batch, None)).await.unwrap();
    }
    within("close producer", prod.close()).await.unwrap();
}

/// Every checkpoint write recorded by the blob emulator, for `partition`: (time, sequence).
fn checkpoint_writes(bed: &Bed, partition: &str) -> Vec<(SystemTime, i64)> {
    let suffix = format!("/checkpoint/{partition}");
    bed.blob
        .store()
        .writes()
        .into_iter()
        .filter(|w| w.name.ends_with(&suffix))
        .filter_map(|w| {
            let seq = w.metadata.get("sequencenumber")?.parse().ok()?;
            Some((w.at, seq))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_run_at_once_same_keys_stay_in_order_and_checkpoints_never_pass_unsettled() {
    let bed = Bed::start(1).await;
    bed.blob.store().record_writes();
    bed.sb.queue("retries").unwrap().record_accepted();
    // 8 ordering keys; every 7th event fails once, every 29th is refused for good.
    let events: Vec<(String, String, String)> = (0..160)
        .map(|i| {
            let body = if i % 29 == 5 {
                "perm".to_string()
            } else if i % 7 == 3 {
                "fail:1".to_string()
            } else {
                "ok".to_string()
            };
            (format!("ev-{i:03}"), format!("order-{}", i % 8), body)
        })
        .collect();
    send(&bed, &events).await;
    let handler = Arc::new(Slow::new(Duration::from_millis(15)));
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.max_in_flight = 16;
    parts.options.ordering = OrderingKey::Property("order".into());
    parts.options.checkpoint_every_events = 5;
    parts.options.checkpoint_min_interval = Duration::from_millis(20);
    parts.options.checkpoint_every = Duration::from_millis(50);
    let run = Bed::run(parts);
    let ledger = bed.ledger();
    let perm: Vec<&String> = events
        .iter()
        .filter(|e| e.2 == "perm")
        .map(|e| &e.0)
        .collect();
    wait_for("every event settled", &run.health, LIMIT, || async {
        let calls = handler.calls.lock().unwrap().clone();
        let delivered = events.iter().filter(|e| e.2 != "perm").all(|e| {
            calls
                .iter()
                .any(|c| c.key == e.0 && c.attempt >= 1 && (e.2 == "ok" || c.attempt == 2))
        });
        delivered && ledger.dead_letter_keys().await.unwrap().len() == perm.len()
    })
    .await;
    wait_for(
        "the checkpoint covers the partition",
        &run.health,
        LIMIT,
        || async { bed.checkpoint_of("0").await == Some(159) },
    )
    .await;
    run.stop().await;

    use std::sync::atomic::Ordering::SeqCst;
    let calls = handler.calls.lock().unwrap().clone();
    assert!(
        handler.max_at_once.load(SeqCst) >= 2,
        "events of one partition ran at once (most at once: {})",
        handler.max_at_once.load(SeqCst)
    );
    assert!(
        handler.max_at_once.load(SeqCst) <= 16,
        "never more than max_in_flight"
    );
    assert_eq!(
        handler.same_key_overlaps.load(SeqCst),
        0,
        "two events with one ordering key never run at once"
    );
    // First attempts of same-key events happen in sequence order, one after the other.
    let mut by_order: BTreeMap<String, Vec<&Call>> = BTreeMap::new();
    for c in calls.iter().filter(|c| c.attempt == 1) {
        by_order.entry(c.order.clone()).or_default().push(c);
    }
    for (order, cs) in &by_order {
        for w in cs.windows(2) {
            assert!(
                w[0].seq < w[1].seq,
                "{order}: {} ran before {}",
                w[1].seq,
                w[0].seq
            );
            assert!(
                w[0].ended <= w[1].started,
                "{order}: {} overlapped {}",
                w[0].seq,
                w[1].seq
            );
        }
        assert_eq!(
            cs.len(),
            20,
            "{order}: every event attempted once from Event Hubs"
        );
    }
    // Nothing lost: every event delivered, or dead-lettered when refused.
    for (key, _, body) in &events {
        let rec = ledger.record(key).await.unwrap();
        match body.as_str() {
            "perm" => assert_eq!(rec.unwrap().state(), State::DeadLettered, "{key}"),
            "fail:1" => assert_eq!(rec.unwrap().state(), State::Delivered, "{key}"),
            _ => assert!(
                rec.is_none(),
                "{key}: the happy path writes no ledger record"
            ),
        }
    }
    // When each event settled: delivered on attempt 1 when the handler returned; a failure
    // when Service Bus accepted its retry or the ledger wrote its dead letter.
    let accepted = bed.sb.queue("retries").unwrap().accepted();
    let writes = bed.blob.store().writes();
    let settled_at = |seq: i64| -> SystemTime {
        let (key, _, body) = &events[seq as usize];
        match body.as_str() {
            "ok" => calls.iter().find(|c| &c.key == key).unwrap().ended,
            "fail:1" => {
                accepted
                    .iter()
                    .find(|(id, _)| {
                        hubguard::pipeline::settle::unqualified(id) == format!("{key}-attempt-2")
                    })
                    .unwrap_or_else(|| panic!("{key}: its retry was accepted"))
                    .1
            }
            _ => {
                writes
                    .iter()
                    .find(|w| w.name == ledger.record_name(key))
                    .unwrap_or_else(|| panic!("{key}: its dead letter was written"))
                    .at
            }
        }
    };
    let cps = checkpoint_writes(&bed, "0");
    assert!(
        cps.len() >= 3,
        "checkpoints were written along the way: {cps:?}"
    );
    for w in cps.windows(2) {
        assert!(
            w[0].1 <= w[1].1,
            "the checkpoint never moved backwards: {cps:?}"
        );
    }
    for (at, seq) in &cps {
        for s in 0..=*seq {
            assert!(
                settled_at(s) <= *at,
                "the checkpoint to {seq} was written before event {s} settled"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_service_bus_down_concurrent_failures_hold_the_partition_until_the_last_settles() {
    let bed = Bed::start(1).await;
    // Events 0..16 over 4 keys (i % 4); 2, 5 and 9 fail once, and cannot be scheduled while
    // Service Bus is down.
    let events: Vec<(String, String, String)> = (0..16)
        .map(|i| {
            let body = if [2, 5, 9].contains(&i) {
                "fail:1"
            } else {
                "ok"
            };
            (
                format!("held-{i:02}"),
                format!("order-{}", i % 4),
                body.to_string(),
            )
        })
        .collect();
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    send(&bed, &events).await;
    let handler = Arc::new(Slow::new(Duration::from_millis(5)));
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.max_in_flight = 8;
    parts.options.ordering = OrderingKey::Property("order".into());
    let run = Bed::run(parts);
    // 2 and 5 fail and hold; 6 waits behind 2 and 9 behind 5 (same keys); 8 runs (its key
    // is free). The window is then full: 2..=9 is eight events.
    wait_for(
        "two events held, the window full",
        &run.health,
        LIMIT,
        || async {
            let calls = handler.calls.lock().unwrap().clone();
            let ran = |k: &str| calls.iter().any(|c| c.key == k);
            ran("held-02")
                && ran("held-05")
                && ran("held-08")
                && run
                    .health
                    .held()
                    .get("0")
                    .is_some_and(|h| h.reason.contains("Service Bus") && h.oldest_unsettled == 2)
        },
    )
    .await;
    assert!(!run.health.ready(), "not ready while events are held");
    // Held through several checkpoint intervals (6 more settlement failures of the two held
    // events: one of them failed 3 times, in the partition's task): nothing overtakes a held
    // event with its key, and nothing beyond the window is read.
    settle_failures(&run.health, 6).await;
    let calls = handler.calls.lock().unwrap().clone();
    for k in ["held-06", "held-09"] {
        assert!(
            !calls.iter().any(|c| c.key == k),
            "{k} never overtakes the held event with its key"
        );
    }
    assert!(
        calls.iter().all(|c| c.seq <= 9),
        "at most max_in_flight events past the checkpoint are read: {:?}",
        calls.iter().map(|c| c.seq).collect::<Vec<_>>()
    );
    let cp = bed.checkpoint_of("0").await;
    assert!(
        cp.is_none_or(|c| c < 2),
        "the checkpoint stays before the oldest held event: {cp:?}"
    );

    bed.sb.faults().clear();
    wait_for("everything settles", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(15)
    })
    .await;
    assert!(run.health.held().is_empty(), "released once all settled");
    let ledger = bed.ledger();
    for k in ["held-02", "held-05", "held-09"] {
        wait_for("the retry delivered", &run.health, LIMIT, || async {
            ledger
                .record(k)
                .await
                .unwrap()
                .is_some_and(|r| r.state() == State::Delivered && r.attempts == 2)
        })
        .await;
    }
    run.stop().await;
    let calls = handler.calls.lock().unwrap().clone();
    for (key, _, _) in &events {
        assert!(
            calls.iter().any(|c| &c.key == key && c.attempt >= 1),
            "{key} was handled"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_event_hubs_connections_mid_stream_never_let_the_checkpoint_pass_an_unseen_event() {
    let bed = Bed::start(1).await;
    bed.blob.store().record_writes();
    let events: Vec<(String, String, String)> = (0..300)
        .map(|i| {
            (
                format!("drop-{i:03}"),
                format!("order-{}", i % 4),
                "ok".to_string(),
            )
        })
        .collect();
    send(&bed, &events).await;
    // A slow handler keeps events waiting in the client's prefetch when the connection drops.
    let handler = Arc::new(Slow::new(Duration::from_millis(4)));
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.max_in_flight = 4;
    parts.options.prefetch = 100;
    parts.options.checkpoint_every_events = 10;
    parts.options.checkpoint_min_interval = Duration::from_millis(20);
    parts.options.checkpoint_every = Duration::from_millis(50);
    let run = Bed::run(parts);
    let ran = |n: usize| {
        let h = handler.clone();
        move || {
            let h = h.clone();
            async move { h.calls.lock().unwrap().len() >= n }
        }
    };
    for n in [40, 120, 200] {
        wait_for("events handled", &run.health, LIMIT, ran(n)).await;
        bed.eh.faults().drop_connections();
    }
    wait_for("every event delivered", &run.health, LIMIT, || async {
        let calls = handler.calls.lock().unwrap().clone();
        events.iter().all(|e| calls.iter().any(|c| c.key == e.0))
    })
    .await;
    wait_for(
        "the checkpoint covers the partition",
        &run.health,
        LIMIT,
        || async { bed.checkpoint_of("0").await == Some(299) },
    )
    .await;
    run.stop().await;
    let calls = handler.calls.lock().unwrap().clone();
    let handled_at = |seq: i64| -> Option<SystemTime> {
        calls.iter().filter(|c| c.seq == seq).map(|c| c.ended).min()
    };
    for (at, seq) in checkpoint_writes(&bed, "0") {
        for s in 0..=seq {
            let t = handled_at(s);
            assert!(
                t.is_some_and(|t| t <= at),
                "the checkpoint to {seq} was written before event {s} was handled ({t:?})"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failures_settlement_leaves_its_slot_to_the_next_event_and_the_checkpoint_waits() {
    let bed = Bed::start(1).await;
    // Two slots. Event 0 fails once and its retry cannot be scheduled (Service Bus down): its
    // settlement holds. Its call has ended, so both slots go on calling events 1..=6, two at
    // once; the checkpoint stays before event 0 until it settles. (Had the settlement kept
    // its slot, one call at a time would run beside it.)
    let events: Vec<(String, String, String)> = (0..7)
        .map(|i| {
            let body = if i == 0 { "fail:1" } else { "ok" };
            (format!("slot-{i}"), String::new(), body.to_string())
        })
        .collect();
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    send(&bed, &events).await;
    let handler = Arc::new(Slow::new(Duration::from_millis(40)));
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.max_in_flight = 2;
    parts.options.window = 16;
    parts.options.ordering = OrderingKey::None;
    let run = Bed::run(parts);
    wait_for(
        "events 1..=6 called while event 0 settles",
        &run.health,
        LIMIT,
        || async {
            let calls = handler.calls.lock().unwrap().clone();
            (1..7).all(|i| calls.iter().any(|c| c.seq == i))
        },
    )
    .await;
    let calls = handler.calls.lock().unwrap().clone();
    let first = |seq: i64| calls.iter().find(|c| c.seq == seq).unwrap().clone();
    let zero_ended = first(0).ended;
    let after: Vec<Call> = (1..7)
        .map(first)
        .filter(|c| c.started >= zero_ended)
        .collect();
    let overlapping = after.iter().any(|a| {
        after
            .iter()
            .any(|b| a.seq < b.seq && b.started < a.ended && a.started < b.ended)
    });
    assert!(
        overlapping,
        "two calls at once after event 0's call ended, its settlement holding no slot: {calls:?}"
    );
    assert!(
        handler
            .max_at_once
            .load(std::sync::atomic::Ordering::SeqCst)
            <= 2,
        "never more calls at once than the slots"
    );
    assert!(
        run.health
            .held()
            .get("0")
            .is_some_and(|h| h.oldest_unsettled == 0),
        "event 0 is still held: {}",
        run.health.report()
    );
    let cp = bed.checkpoint_of("0").await;
    assert!(cp.is_none(), "no checkpoint past the held event 0: {cp:?}");

    bed.sb.faults().clear();
    wait_for("everything settles", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(6)
    })
    .await;
    let ledger = bed.ledger();
    wait_for("event 0's retry delivered", &run.health, LIMIT, || async {
        ledger
            .record("slot-0")
            .await
            .unwrap()
            .is_some_and(|r| r.state() == State::Delivered && r.attempts == 2)
    })
    .await;
    run.stop().await;
}
