//! The backlog for scaling (issue 41): `GET /v1/backlog` and `hubguard_backlog_events` count
//! work not yet done — unread events (last enqueued sequence number minus the checkpoint),
//! retries due now and parked events — so a retry storm with nothing new arriving is
//! visible to KEDA although the checkpoint lag says 0.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Failure, Handler, Outcome};
use hubguard::pipeline::{Pipeline, PipelineParts};
use hubguard::telemetry::gauges::PipelineReadings as _;
use tokio::sync::watch;

use crate::common::{eventually, http_get, seen, Text, STEP};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A downstream whose calls wait until the test opens its gate: on the first attempt only
/// (`first_fails`: the first attempt fails at once, retries wait) or on every attempt.
struct Gated {
    open: watch::Receiver<bool>,
    first_fails: bool,
    delivered: std::sync::Mutex<Vec<String>>,
    waiting: std::sync::atomic::AtomicU64,
}

#[async_trait]
impl Handler for Gated {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        if self.first_fails && attempt.number == 1 {
            return Outcome::Failed(Failure::transient("503 during the storm"));
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.clone();
        let _ = open.wait_for(|o| *o).await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.delivered
            .lock()
            .unwrap()
            .push(event.identity.idempotency_key.clone());
        Outcome::Delivered
    }
}

fn gated(first_fails: bool) -> (Arc<Gated>, watch::Sender<bool>) {
    let (tx, rx) = watch::channel(false);
    let h = Arc::new(Gated {
        open: rx,
        first_fails,
        delivered: Default::default(),
        waiting: Default::default(),
    });
    (h, tx)
}

/// Runs a pipeline with its status API (the backlog route merged as `hubguard run` does).
struct Served {
    run: Running,
    addr: String,
}

async fn serve(bed: &Bed, parts: PipelineParts) -> Served {
    let pipeline = Pipeline::new(parts);
    let router = hubguard::status::router(pipeline.health(), bed.ledger(), None)
        .merge(hubguard::telemetry::backlog::router(pipeline.backlog()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Served {
        run: Bed::run_pipeline(pipeline),
        addr,
    }
}

fn parts_with(bed: &Bed, handler: Arc<dyn Handler>, owner: &str) -> PipelineParts {
    let mut wiring = bed.wiring(owner).policy(fast_policy(5));
    wiring.options_mut().backlog_every = Duration::from_millis(200);
    wiring.options_mut().retry_concurrency = 4;
    wiring.parts(handler).unwrap()
}

async fn backlog(addr: &str) -> serde_json::Value {
    let (code, body) = http_get(addr, "/v1/backlog").await;
    if code != 200 {
        return serde_json::Value::Null;
    }
    serde_json::from_str(&body).unwrap()
}

/// A retry storm with nothing new arriving: every event is checkpointed (its retry scheduled
/// on Service Bus) and the checkpoint lag is 0, while the backlog counts the retries due —
/// those the slow downstream holds and those still waiting for a slot. Once the downstream
/// recovers the backlog drains to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_storm_is_backlog_while_the_checkpoint_lag_says_zero() {
    // /metrics serves the process's meter provider: set it up before the gauge registers.
    let _ = crate::otlp::telemetry();
    let bed = Bed::start(1).await;
    let keys: Vec<String> = (0..12).map(|i| format!("storm-{i}")).collect();
    let events: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "x")).collect();
    bed.send(0, &events).await;
    let (handler, gate) = gated(true);
    let s = serve(&bed, parts_with(&bed, handler.clone(), "replica-storm")).await;

    let b = eventually("every retry due, nothing unread", LIMIT, || async {
        seen(backlog(&s.addr).await, |b| {
            b["retries_due"] == 12 && b["unread"] == 0 && b["total"] == 12
        })
    })
    .await;
    assert_eq!(b["parked"], 0, "{b}");
    assert_eq!(b["unread_by_partition"]["0"], 0, "{b}");
    // The checkpoint says nothing is left: it covers all twelve events.
    assert_eq!(bed.checkpoint_of("0").await, Some(11));
    let lag = s.run.health.checkpoint_lag();
    assert!(
        lag.values().all(|(events, _)| *events == 0),
        "checkpoint lag {lag:?}"
    );
    // The slow downstream holds at most the retry loop's concurrency; the rest still wait.
    assert!(handler.waiting.load(Ordering::SeqCst) <= 4);

    // /metrics: the gauge by kind, in the Prometheus spelling KEDA's prometheus scaler reads.
    eventually("the gauge by kind", STEP, || async {
        let (code, text) = http_get(&s.addr, "/metrics").await;
        assert_eq!(code, 200);
        seen(Text(text), |Text(t)| {
            ["unread", "retries_due", "parked"].iter().all(|k| {
                t.lines()
                    .any(|l| l.starts_with(&format!("hubguard_backlog_events{{kind=\"{k}\"")))
            })
        })
    })
    .await;

    gate.send(true).unwrap();
    let b = eventually("the storm drained", LIMIT, || async {
        seen(backlog(&s.addr).await, |b| b["total"] == 0)
    })
    .await;
    assert_eq!(b["retries_waiting"], 0, "{b}");
    assert_eq!(handler.delivered.lock().unwrap().len(), 12);
    s.run.stop().await;
}

/// A backlog of unread events on two partitions, the downstream holding the first event of
/// each: the backlog counts every event past the checkpoints (none yet), and 0 once all are
/// delivered and checkpointed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_events_are_backlog_until_checkpointed() {
    let bed = Bed::start(2).await;
    let p0: Vec<String> = (0..7).map(|i| format!("a-{i}")).collect();
    let p1: Vec<String> = (0..5).map(|i| format!("b-{i}")).collect();
    bed.send(0, &p0.iter().map(|k| (k.as_str(), "x")).collect::<Vec<_>>())
        .await;
    bed.send(1, &p1.iter().map(|k| (k.as_str(), "x")).collect::<Vec<_>>())
        .await;
    let (handler, gate) = gated(false);
    let s = serve(&bed, parts_with(&bed, handler.clone(), "replica-unread")).await;

    let b = eventually("every event unread", LIMIT, || async {
        seen(backlog(&s.addr).await, |b| {
            b["unread"] == 12 && handler.waiting.load(Ordering::SeqCst) >= 2
        })
    })
    .await;
    assert_eq!(b["unread_by_partition"]["0"], 7, "{b}");
    assert_eq!(b["unread_by_partition"]["1"], 5, "{b}");
    assert_eq!(b["retries_due"], 0, "{b}");
    assert_eq!(b["total"], 12, "{b}");

    gate.send(true).unwrap();
    let done = AtomicBool::new(false);
    eventually("all read and checkpointed", LIMIT, || async {
        let b = backlog(&s.addr).await;
        let cp = (bed.checkpoint_of("0").await, bed.checkpoint_of("1").await);
        done.store(cp == (Some(6), Some(4)), Ordering::SeqCst);
        seen(b, |b| b["total"] == 0 && done.load(Ordering::SeqCst))
    })
    .await;
    s.run.stop().await;
}

/// Before its first sample the backlog is not a number: 503, so KEDA keeps its last value
/// rather than scaling on a made-up zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sample_yet_is_503_not_zero() {
    let cell = hubguard::telemetry::backlog::BacklogCell::default();
    let router = hubguard::telemetry::backlog::router(cell);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let (code, body) = http_get(&addr, "/v1/backlog").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("not been sampled"), "{body}");
}
