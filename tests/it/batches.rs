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
    for i in 0..3 {
        let k = format!("perm-{i}");
        assert!(
            s.attempts[&k].iter().all(|a| *a == 1),
            "{k}: permanent: never retried: {:?}",
            s.attempts[&k]
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
