//! Batches over the webhook (`handler.batch_max` > 1), end to end on the emulators: one
//! request carries several events, each event gets its own outcome, and each failure its own
//! ledger record, retry and dead letter while the checkpoint passes the rest.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use hubguard::handler::webhook::{WebhookConfig, WebhookHandler};
use hubguard::ledger::State;

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// What the receiver saw.
#[derive(Default)]
struct Seen {
    /// Every request's keys (in the order of the batch), and its content type.
    requests: Vec<(String, Vec<String>)>,
    /// key → attempt numbers delivered to it, in order.
    attempts: BTreeMap<String, Vec<u64>>,
    /// keys answered delivered.
    delivered: BTreeSet<String>,
    /// keys of the batch answered with a malformed body (whichever events it held: which
    /// go out alone and which together depends on timing).
    malformed: BTreeSet<String>,
}

/// A receiver of batches: keys `fail-…` fail once (transient, retry after 1 s), `perm-…`
/// always (permanent); the first batch request is answered with a 2xx body that is not a
/// batch answer (nothing in it may be taken as delivered); the rest delivered.
async fn receiver(seen: Arc<Mutex<Seen>>) -> String {
    let app = axum::Router::new().fallback(move |headers: HeaderMap, body: axum::body::Bytes| {
        let seen = seen.clone();
        async move {
            let ct = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let mut s = seen.lock().unwrap();
            if !ct.starts_with("application/cloudevents-batch+json") {
                // Alone: a single delivery, keyed by its header.
                let key = headers["idempotency-key"].to_str().unwrap().to_string();
                let attempt: u64 = headers["x-hubguard-attempt"].to_str().unwrap().parse().unwrap();
                s.requests.push((ct, vec![key.clone()]));
                s.attempts.entry(key.clone()).or_default().push(attempt);
                if key.starts_with("perm-") {
                    return (StatusCode::BAD_REQUEST, String::new());
                }
                if key.starts_with("fail-") && attempt == 1 {
                    return (StatusCode::SERVICE_UNAVAILABLE, String::new());
                }
                s.delivered.insert(key);
                return (StatusCode::OK, String::new());
            }
            let elements: Vec<serde_json::Value> = serde_json::from_slice(&body).unwrap();
            let keys: Vec<String> = elements
                .iter()
                .map(|e| e["hubguardkey"].as_str().unwrap().to_string())
                .collect();
            let first_batch = !s.requests.iter().any(|(c, _)| c.starts_with("application/cloudevents-batch"));
            s.requests.push((ct, keys.clone()));
            if first_batch {
                s.malformed.extend(keys);
                return (StatusCode::OK, "OK".to_string());
            }
            let mut failures = Vec::new();
            for e in &elements {
                let key = e["hubguardkey"].as_str().unwrap().to_string();
                let attempt = e["hubguardattempt"].as_u64().unwrap();
                s.attempts.entry(key.clone()).or_default().push(attempt);
                let id = e["id"].as_str().unwrap();
                if key.starts_with("perm-") {
                    failures.push(serde_json::json!({"id": id, "kind": "permanent", "error": "no such order"}));
                } else if key.starts_with("fail-") && attempt == 1 {
                    failures.push(serde_json::json!({"id": id, "kind": "transient", "retry_after_s": 1}));
                } else {
                    s.delivered.insert(key);
                }
            }
            // One id the batch never held: ignored.
            failures.push(serde_json::json!({"id": "not-in-this-batch", "kind": "permanent"}));
            (StatusCode::OK, serde_json::json!({ "failures": failures }).to_string())
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/events")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_settles_each_event_on_its_own_through_partial_failures_and_a_malformed_answer() {
    let bed = Bed::start(1).await;
    let mut keys: Vec<String> = (0..40).map(|i| format!("ok-{i}")).collect();
    keys.extend((0..4).map(|i| format!("fail-{i}")));
    keys.extend((0..3).map(|i| format!("perm-{i}")));
    let events: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "x")).collect();
    bed.send(0, &events).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let url = receiver(seen.clone()).await;
    let handler = WebhookHandler::new(WebhookConfig {
        batch_max: 10,
        ..WebhookConfig::new(url)
    })
    .unwrap()
    .into_handler();
    let mut wiring = bed.wiring("replica-a").policy(fast_policy(3));
    wiring.options_mut().max_in_flight = 64;
    let run = Bed::run(wiring.parts(handler).unwrap());
    let ledger = bed.ledger();
    let expected: BTreeSet<String> = keys
        .iter()
        .filter(|k| !k.starts_with("perm-"))
        .cloned()
        .collect();
    wait_for(
        "every event delivered or dead-lettered, the checkpoint past them all",
        &run.health,
        LIMIT,
        || async {
            let delivered = seen.lock().unwrap().delivered.clone();
            let mut dead = 0;
            for i in 0..3 {
                if matches!(ledger.record(&format!("perm-{i}")).await, Ok(Some(r)) if r.state() == State::DeadLettered) {
                    dead += 1;
                }
            }
            delivered == expected && dead == 3 && bed.checkpoint_of("0").await == Some(46)
        },
    )
    .await;
    run.stop().await;
    let s = seen.lock().unwrap();
    let batches: Vec<&Vec<String>> = s
        .requests
        .iter()
        .filter(|(ct, _)| ct.starts_with("application/cloudevents-batch+json"))
        .map(|(_, k)| k)
        .collect();
    assert!(!batches.is_empty(), "events went out in batches");
    assert!(
        batches.iter().all(|b| b.len() <= 10 && b.len() > 1),
        "within batch_max: {batches:?}"
    );
    // Each failing event failed once and was delivered on its own retry; the permanent ones
    // were dead-lettered at once, each on its own.
    for i in 0..4 {
        let k = format!("fail-{i}");
        let a = &s.attempts[&k];
        assert_eq!(a.last(), Some(&2), "{k}: delivered on attempt 2: {a:?}");
        let rec = futures::executor::block_on(ledger.record(&k))
            .unwrap()
            .unwrap();
        assert_eq!(rec.state(), State::Delivered, "{k}");
    }
    // (An event in the malformed answer's batch failed its attempt 1 there, unrecorded
    // here, and met the permanent answer on attempt 2.)
    for i in 0..3 {
        let k = format!("perm-{i}");
        let first_answered = if s.malformed.contains(&k) { 2 } else { 1 };
        assert_eq!(
            s.attempts[&k],
            vec![first_answered],
            "{k}: permanent: never retried after its permanent answer"
        );
    }
    // Delivered events wrote no ledger record (the happy path is free, batch or not).
    let recorded = futures::executor::block_on(ledger.keys()).unwrap();
    assert!(
        recorded.iter().all(|k| !k.starts_with("ok-")
            || s.requests.iter().filter(|(_, ks)| ks.contains(k)).count() > 1),
        "only the failures and the events of the malformed answer have records: {recorded:?}"
    );
}

/// A receiver that answers 413 to a batch of more than `max` events and records each
/// request's size, or answers every batch with `status`.
async fn picky(max: usize, status: u16, sizes: Arc<Mutex<Vec<usize>>>) -> String {
    let app = axum::Router::new().fallback(move |headers: HeaderMap, body: axum::body::Bytes| {
        let sizes = sizes.clone();
        async move {
            let batch = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|c| c.starts_with("application/cloudevents-batch+json"));
            let n = if batch {
                serde_json::from_slice::<Vec<serde_json::Value>>(&body)
                    .unwrap()
                    .len()
            } else {
                1
            };
            sizes.lock().unwrap().push(n);
            if n > max {
                return StatusCode::PAYLOAD_TOO_LARGE;
            }
            StatusCode::from_u16(status).unwrap()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/events")
}

fn event(key: &str) -> hubguard::event::Event {
    hubguard::event::Event {
        body: key.as_bytes().to_vec(),
        content_type: Some("text/plain".into()),
        properties: Default::default(),
        hub: "hub".into(),
        partition_id: "0".into(),
        sequence_number: 1,
        offset: None,
        enqueued_ms: None,
        partition_key: None,
        identity: hubguard::event::Identity {
            idempotency_key: key.into(),
            correlation_id: key.into(),
            event_type: None,
        },
    }
}

/// Sends `n` events at once through a batching webhook handler for `url`.
async fn at_once(url: String, n: usize) -> Vec<hubguard::handler::Outcome> {
    let handler = WebhookHandler::new(WebhookConfig {
        batch_max: 100,
        ..WebhookConfig::new(url)
    })
    .unwrap()
    .into_handler();
    let calls = (0..n).map(|i| {
        let handler = handler.clone();
        async move {
            let e = event(&format!("k{i}"));
            let a = hubguard::handler::Attempt {
                number: 1,
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                last: false,
            };
            handler.handle(&e, &a).await
        }
    });
    futures::future::join_all(calls).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_too_large_is_sent_in_halves_and_a_refused_batch_fails_each_event() {
    // 413 above 3 events: 10 → 5 + 5 → 2 + 3 + 2 + 3, all delivered, each event once.
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let url = picky(3, 200, sizes.clone()).await;
    let out = at_once(url, 10).await;
    assert!(
        out.iter()
            .all(|o| *o == hubguard::handler::Outcome::Delivered),
        "{out:?}"
    );
    let sizes = sizes.lock().unwrap().clone();
    let delivered: usize = sizes.iter().filter(|n| **n <= 3).sum();
    assert_eq!(delivered, 10, "each event delivered once: {sizes:?}");
    assert_eq!(sizes[0], 10, "{sizes:?}");
    // A 503 to the batch: every event fails as a single delivery's 503 would (transient).
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let url = picky(100, 503, sizes.clone()).await;
    let out = at_once(url, 5).await;
    assert!(
        out.iter()
            .all(|o| matches!(o, hubguard::handler::Outcome::Failed(f)
            if f.class == hubguard::policy::classify::ErrorClass::Transient
            && f.http_status == Some(503))),
        "{out:?}"
    );
    assert_eq!(sizes.lock().unwrap().clone(), vec![5], "one request");
}

/// Every batch request's elements as (key, sequence number, attempt), and the keys answered
/// delivered in the order they were.
#[derive(Default)]
struct Ordered {
    batches: Vec<Vec<(String, i64, u64)>>,
    delivered: Vec<(String, i64)>,
    failed_once: BTreeSet<String>,
}

/// A batch receiver for keys `{order}-{n}`: an event whose key is in `fail` fails once
/// (transient, retry after 1 s); the rest are delivered.
async fn ordered_receiver(state: Arc<Mutex<Ordered>>, fail: BTreeSet<String>) -> String {
    let app = axum::Router::new().fallback(move |headers: HeaderMap, body: axum::body::Bytes| {
        let (state, fail) = (state.clone(), fail.clone());
        async move {
            let mut s = state.lock().unwrap();
            let batch = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|c| c.starts_with("application/cloudevents-batch+json"));
            let elements: Vec<(String, i64, u64, String)> = if batch {
                serde_json::from_slice::<Vec<serde_json::Value>>(&body)
                    .unwrap()
                    .iter()
                    .map(|e| {
                        (
                            e["hubguardkey"].as_str().unwrap().to_string(),
                            e["hubguardsequence"].as_i64().unwrap(),
                            e["hubguardattempt"].as_u64().unwrap(),
                            e["id"].as_str().unwrap().to_string(),
                        )
                    })
                    .collect()
            } else {
                let h = |n: &str| headers[n].to_str().unwrap().to_string();
                vec![(
                    h("idempotency-key"),
                    h("x-hubguard-sequence-number").parse().unwrap(),
                    h("x-hubguard-attempt").parse().unwrap(),
                    h("idempotency-key"),
                )]
            };
            s.batches.push(
                elements
                    .iter()
                    .map(|(k, q, a, _)| (k.clone(), *q, *a))
                    .collect(),
            );
            let mut failures = Vec::new();
            for (key, seq, _, id) in &elements {
                if fail.contains(key) && s.failed_once.insert(key.clone()) {
                    failures.push(
                        serde_json::json!({"id": id, "kind": "transient", "retry_after_s": 1}),
                    );
                } else {
                    s.delivered.push((key.clone(), *seq));
                }
            }
            if !batch {
                let status = if failures.is_empty() {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                return (status, String::new());
            }
            (
                StatusCode::OK,
                serde_json::json!({ "failures": failures }).to_string(),
            )
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/events")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ordered_retries_a_batch_carries_a_keys_events_only_in_order_and_keeps_each_key_in_order(
) {
    use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
    let bed = Bed::start(1).await;
    // 6 orders × 6 events, interleaved; the second event of three orders fails once.
    let mut events = Vec::new();
    for n in 0..6 {
        for o in 0..6 {
            events.push((format!("o{o}-{n}"), format!("o{o}")));
        }
    }
    let fail: BTreeSet<String> = ["o0-1", "o2-1", "o4-1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let prod = crate::common::producer(&bed.cs, "hub").await;
    let batch = prod
        .create_batch(Some(azure_messaging_eventhubs::EventDataBatchOptions {
            partition_id: Some("0".into()),
            ..Default::default()
        }))
        .await
        .unwrap();
    for (key, order) in &events {
        let ev = EventData::builder()
            .with_body(b"x".to_vec())
            .add_property("ce_id".into(), AmqpSimpleValue::String(key.clone()))
            .add_property("order".into(), AmqpSimpleValue::String(order.clone()))
            .build();
        assert!(batch.try_add_event_data(ev, None).unwrap());
    }
    prod.send_batch(batch, None).await.unwrap();
    prod.close().await.unwrap();
    let state = Arc::new(Mutex::new(Ordered::default()));
    let url = ordered_receiver(state.clone(), fail).await;
    let handler = WebhookHandler::new(WebhookConfig {
        batch_max: 10,
        ..WebhookConfig::new(url)
    })
    .unwrap()
    .into_handler();
    let mut wiring = bed.wiring("replica-a").policy(fast_policy(5));
    let o = wiring.options_mut();
    o.max_in_flight = 32;
    o.ordering = hubguard::pipeline::OrderingKey::Property("order".into());
    o.retry_ordering =
        hubguard::pipeline::RetryOrdering::Key(hubguard::pipeline::LineOnDeadLetter::Release);
    let run = Bed::run(wiring.parts(handler).unwrap());
    wait_for("all 36 delivered", &run.health, LIMIT, || async {
        let keys: BTreeSet<String> = state
            .lock()
            .unwrap()
            .delivered
            .iter()
            .map(|(k, _)| k.clone())
            .collect();
        keys.len() == 36
    })
    .await;
    run.stop().await;
    let s = state.lock().unwrap();
    let order_of = |k: &str| k.split('-').next().unwrap().to_string();
    assert!(s.batches.iter().any(|b| b.len() > 1), "batches were sent");
    // A first delivery's batch holds one event per key; a released line's drain hands a
    // key's parked events over together, in sequence order.
    for b in &s.batches {
        let mut last: BTreeMap<String, i64> = BTreeMap::new();
        for (k, seq, _) in b {
            if let Some(prev) = last.insert(order_of(k), *seq) {
                assert!(prev < *seq, "a key's events out of order in a batch: {b:?}");
            }
        }
    }
    // Each order's first deliveries in sequence order, the failed one before the rest.
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (k, seq) in &s.delivered {
        if !seen.insert(k.clone()) {
            continue;
        }
        let o = order_of(k);
        if let Some(prev) = last.get(&o) {
            assert!(
                seq > prev,
                "{k} (seq {seq}) delivered after seq {prev} of {o}: {:?}",
                s.delivered
            );
        }
        last.insert(o, *seq);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_with_a_batch_in_flight_loses_nothing() {
    let bed = Bed::start(1).await;
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    let events: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "x")).collect();
    bed.send(0, &events).await;
    // The receiver takes no answer to the first replica's batches: they hang until it dies.
    let hang = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let hung = Arc::new(tokio::sync::Notify::new());
    let delivered = Arc::new(Mutex::new(BTreeSet::new()));
    let app = {
        let (hang, hung, delivered) = (hang.clone(), hung.clone(), delivered.clone());
        axum::Router::new().fallback(move |headers: HeaderMap, body: axum::body::Bytes| {
            let (hang, hung, delivered) = (hang.clone(), hung.clone(), delivered.clone());
            async move {
                if hang.load(std::sync::atomic::Ordering::SeqCst) {
                    hung.notify_one();
                    std::future::pending::<()>().await;
                }
                let mut d = delivered.lock().unwrap();
                match serde_json::from_slice::<Vec<serde_json::Value>>(&body) {
                    Ok(elements) => {
                        for e in elements {
                            d.insert(e["hubguardkey"].as_str().unwrap().to_string());
                        }
                    }
                    // Alone: a single delivery, keyed by its header.
                    Err(_) => {
                        d.insert(headers["idempotency-key"].to_str().unwrap().to_string());
                    }
                }
                StatusCode::OK
            }
        })
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/events", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let start = |owner: &str| {
        let handler = WebhookHandler::new(WebhookConfig {
            batch_max: 10,
            timeout_ms: 60_000,
            ..WebhookConfig::new(url.clone())
        })
        .unwrap()
        .into_handler();
        let mut wiring = bed.wiring(owner).policy(fast_policy(5));
        wiring.options_mut().max_in_flight = 30;
        let pipeline = hubguard::pipeline::Pipeline::new(wiring.parts(handler).unwrap());
        let health = pipeline.health();
        let (cancel, crash) = (
            tokio_util::sync::CancellationToken::new(),
            tokio_util::sync::CancellationToken::new(),
        );
        let (c, k) = (cancel.clone(), crash.clone());
        let task = tokio::spawn(async move { pipeline.run_until(c, k).await.unwrap() });
        (health, cancel, crash, task)
    };
    let (_a_health, _a_cancel, a_crash, a_task) = start("replica-a");
    crate::common::within("a batch call hangs", hung.notified()).await;
    a_crash.cancel();
    crate::common::within("replica-a dies", a_task)
        .await
        .unwrap();
    assert_eq!(
        bed.checkpoint_of("0").await,
        None,
        "nothing checkpointed past the hung batch"
    );
    hang.store(false, std::sync::atomic::Ordering::SeqCst);
    let (b_health, b_cancel, _b_crash, b_task) = start("replica-b");
    let all: BTreeSet<String> = keys.iter().cloned().collect();
    wait_for(
        "replica-b delivers every event",
        &b_health,
        LIMIT,
        || async { *delivered.lock().unwrap() == all && bed.checkpoint_of("0").await == Some(29) },
    )
    .await;
    b_cancel.cancel();
    crate::common::within("replica-b stops", b_task)
        .await
        .unwrap();
}
