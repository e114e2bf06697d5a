//! Operational events (issue 41): CloudEvents about hubguard itself, here "retries
//! exhausted" (dead letters) to a webhook — signed as deliveries are, once per suppression
//! window with the suppressed ones counted into the next — and a destination that is down
//! or hangs: counted (failed, dropped), readiness and delivery untouched; the breaker's
//! opened/closed events end to end to a Service Bus queue from two replicas (one message
//! each, by duplicate detection), and a Service Bus destination that refuses; the storm
//! guard's holding/released; a partition held past the bound, under its id;
//! the rate limit lowered by a throttling receiver, once per window.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::routing::post;
use axum::Router;
use hubguard::emulator::servicebus::QueueSpec;
use hubguard::handler::signing::SigningKeys;
use hubguard::opsevents::send::{ServiceBusDestination, WebhookDestination};
use hubguard::opsevents::{OpsEvents, OpsEventsSettings};
use hubguard::SecretSource;

use serde_json::json;

use crate::common::{eventually, seen};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

type Received = Arc<Mutex<Vec<(HeaderMap, String)>>>;

/// A webhook receiver on port 0 that keeps every request.
async fn receiver() -> (String, Received) {
    let got: Received = Default::default();
    let g = got.clone();
    let app = Router::new().route(
        "/ops",
        post(move |headers: HeaderMap, body: String| {
            let g = g.clone();
            async move {
                g.lock().unwrap().push((headers, body));
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/ops"), got)
}

fn settings(suppression: Duration, queue_size: usize) -> OpsEventsSettings {
    OpsEventsSettings {
        suppression,
        held_longer_than: Duration::from_secs(3600),
        queue_size,
        poll: Duration::from_millis(50),
    }
}

fn run_with(bed: &Bed, events: Arc<OpsEvents>, handler: Arc<Scripted>, owner: &str) -> Running {
    let mut wiring = bed.wiring(owner).policy(fast_policy(3));
    wiring.options_mut().ops_events = Some(events);
    Bed::run(wiring.parts(handler).unwrap())
}

async fn dead_lettered(run: &Running, n: u64) {
    wait_for("dead-lettered", &run.health, LIMIT, || async {
        run.health.snapshot().dead_lettered >= n
    })
    .await;
}

/// One "retries exhausted" event per suppression window: the first dead letter is reported
/// at once, the next two within the window are suppressed, and once the window is over the
/// next event carries them (`dead_lettered: 2`, `suppressed` ≥ 1). Each request is a
/// structured CloudEvent signed with Standard Webhooks headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_exhausted_is_sent_once_per_suppression_window_and_signed() {
    let bed = Bed::start(1).await;
    let (url, got) = receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("ops-secret");
    std::fs::write(&secret, SECRET).unwrap();
    let dest = WebhookDestination::new(
        url.parse().unwrap(),
        Duration::from_secs(5),
        Some(&SecretSource::file(&secret)),
    )
    .unwrap();
    let events = Arc::new(OpsEvents::new(
        settings(Duration::from_secs(60), 16),
        Arc::new(dest),
        bed.clock(),
    ));
    let handler = Arc::new(Scripted::default());
    let run = run_with(&bed, events.clone(), handler.clone(), "replica-ops");

    bed.send(0, &[("perm-1", "perm")]).await;
    dead_lettered(&run, 1).await;
    eventually("the first event", LIMIT, || async {
        seen(got.lock().unwrap().len(), |n| *n == 1)
    })
    .await;
    bed.send(0, &[("perm-2", "perm"), ("perm-3", "perm"), ("ok-1", "ok")])
        .await;
    dead_lettered(&run, 3).await;
    eventually("the rest suppressed", LIMIT, || async {
        seen(events.counts(), |c| c.suppressed >= 1)
    })
    .await;
    assert_eq!(got.lock().unwrap().len(), 1, "one event per window");

    // The window ends: the next look sends what was held back.
    bed.clock().advance(Duration::from_secs(61));
    eventually("the second event", LIMIT, || async {
        seen(got.lock().unwrap().len(), |n| *n == 2)
    })
    .await;
    let got = got.lock().unwrap().clone();
    let (h1, b1) = &got[0];
    let first: serde_json::Value = serde_json::from_str(b1).unwrap();
    let (_, b2) = &got[1];
    let second: serde_json::Value = serde_json::from_str(b2).unwrap();
    assert_eq!(first["specversion"], "1.0", "{first}");
    assert_eq!(first["type"], "com.hubguard.retries.exhausted", "{first}");
    assert_eq!(first["source"], "/hubguard/hub/$Default", "{first}");
    assert_eq!(first["subject"], "handler", "{first}");
    assert_eq!(first["data"]["dead_lettered"], 1, "{first}");
    assert_eq!(first["data"]["suppressed"], 0, "{first}");
    assert_eq!(first["data"]["replica"], "replica-ops", "{first}");
    assert_eq!(second["data"]["dead_lettered"], 2, "{second}");
    assert_eq!(second["data"]["dead_lettered_total"], 3, "{second}");
    assert!(second["data"]["suppressed"].as_u64() >= Some(1), "{second}");
    assert_ne!(first["id"], second["id"]);
    // Signed as deliveries are: webhook-id is the CloudEvent's id.
    assert!(h1["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/cloudevents+json"));
    assert_eq!(
        h1["webhook-id"].to_str().unwrap(),
        first["id"].as_str().unwrap()
    );
    let ts: i64 = h1["webhook-timestamp"].to_str().unwrap().parse().unwrap();
    let keys = SigningKeys::parse("test", SECRET).unwrap();
    assert_eq!(
        h1["webhook-signature"].to_str().unwrap(),
        keys.sign(first["id"].as_str().unwrap(), ts, b1.as_bytes())
    );
    assert!(handler.delivered_keys().contains("ok-1"));
    assert_eq!(events.counts().sent, 2);
    assert_eq!(events.counts().failed, 0);
    run.stop().await;
}

/// A destination that refuses connections: every event counted as failed, nothing sent;
/// readiness untouched and every event delivered. A destination that accepts and never
/// answers, behind a channel of one: the events behind it are dropped and counted, and
/// delivery does not wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_down_or_hanging_is_counted_and_delivery_goes_on() {
    let bed = Bed::start(1).await;
    // Nothing listens here any more.
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let down = Arc::new(OpsEvents::new(
        settings(Duration::from_secs(1), 16),
        Arc::new(
            WebhookDestination::new(
                format!("http://{closed}/ops").parse().unwrap(),
                Duration::from_secs(2),
                None,
            )
            .unwrap(),
        ),
        bed.clock(),
    ));
    let handler = Arc::new(Scripted::default());
    let run = run_with(&bed, down.clone(), handler.clone(), "replica-down");
    bed.send(0, &[("d-perm", "perm"), ("d-ok-1", "ok"), ("d-ok-2", "ok")])
        .await;
    dead_lettered(&run, 1).await;
    eventually("the failure counted", LIMIT, || async {
        seen(down.counts(), |c| c.failed >= 1)
    })
    .await;
    wait_for("delivered and ready", &run.health, LIMIT, || async {
        handler.delivered_keys().len() == 2 && run.health.ready()
    })
    .await;
    assert_eq!(down.counts().sent, 0);
    run.stop().await;

    // A destination that never answers, and room for one event waiting.
    let hanging = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hanging.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let h = held.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = hanging.accept().await {
            h.lock().unwrap().push(socket); // accepted, never answered
        }
    });
    let slow = Arc::new(OpsEvents::new(
        settings(Duration::from_secs(1), 1),
        Arc::new(
            WebhookDestination::new(
                format!("http://{addr}/ops").parse().unwrap(),
                Duration::from_secs(600),
                None,
            )
            .unwrap(),
        ),
        bed.clock(),
    ));
    let handler = Arc::new(Scripted::default());
    let run = run_with(&bed, slow.clone(), handler.clone(), "replica-slow");
    // Three dead letters, each in a window of its own: the first is being sent (forever),
    // the second waits in the channel, the third finds it full.
    for i in 0..3u64 {
        bed.send(0, &[(&format!("s-perm-{i}"), "perm")]).await;
        dead_lettered(&run, i + 1).await;
        eventually("the watcher saw it", LIMIT, || async {
            seen(slow.counts(), |c| c.queued + c.dropped == i + 1)
        })
        .await;
        bed.clock().advance(Duration::from_secs(2));
    }
    let c = slow.counts();
    assert_eq!((c.queued, c.dropped, c.sent), (2, 1, 0), "{c:?}");
    assert_eq!(
        held.lock().unwrap().len(),
        1,
        "the sender is stuck on the first"
    );
    let keys: Vec<String> = (0..20).map(|i| format!("s-ok-{i}")).collect();
    bed.send(
        0,
        &keys.iter().map(|k| (k.as_str(), "ok")).collect::<Vec<_>>(),
    )
    .await;
    wait_for("delivery goes on", &run.health, LIMIT, || async {
        handler.delivered_keys().len() == 20 && run.health.ready()
    })
    .await;
    assert_eq!(slow.counts().sent, 0);
    run.stop().await;
}

/// The operational events' Service Bus queue on the bed's namespace, with duplicate
/// detection (as docs/telemetry.md advises: the ids are derived from the shared records,
/// so every replica's copy of one event has the same MessageId).
fn ops_queue() -> hubguard::emulator::servicebus::QueueSpec {
    let mut q = hubguard::emulator::servicebus::QueueSpec::new("ops");
    q.duplicate_detection_window = Some(Duration::from_secs(600));
    q
}

fn to_service_bus(bed: &Bed, queue: &str) -> Arc<OpsEvents> {
    let cs: hubguard::azure::ConnectionString = bed.sb.connection_string().parse().unwrap();
    let entity = hubguard::azure::ServiceBusRetryQueue::new(
        &cs,
        queue,
        hubguard::azure::retry_queue::ServiceBusOptions::default(),
    )
    .unwrap()
    .without_batching();
    Arc::new(OpsEvents::new(
        settings(Duration::from_secs(60), 16),
        Arc::new(ServiceBusDestination::new(
            Arc::new(entity),
            queue,
            Duration::from_secs(5),
        )),
        bed.clock(),
    ))
}

/// The CloudEvents on the `ops` queue, with their MessageId and Label, in send order.
fn on_queue(bed: &Bed) -> Vec<(String, Option<String>, serde_json::Value)> {
    let mut messages = bed
        .sb
        .queue("ops")
        .unwrap()
        .messages(hubguard::emulator::servicebus::broker::Entity::Main);
    messages.sort_by_key(|m| m.sequence_number);
    messages
        .into_iter()
        .map(|m| {
            assert!(
                m.content_type
                    .as_deref()
                    .is_some_and(|c| c.starts_with("application/cloudevents+json")),
                "{:?}",
                m.content_type
            );
            (
                m.message_id,
                m.label,
                serde_json::from_slice(&m.body).unwrap(),
            )
        })
        .collect()
}

fn breaker_config() -> hubguard::breaker::BreakerConfig {
    hubguard::breaker::BreakerConfig {
        enabled: true,
        consecutive_failures: 3,
        failure_ratio: None,
        ratio_window: 20,
        open_ms: 3000,
        spread_ms: 500,
        probe_timeout_ms: 3000,
        brink_hold_ms: 0,
        ..Default::default()
    }
}

/// The breaker's operational events end to end, to a Service Bus queue: a downstream down
/// opens the breaker and two replicas sharing it each send `breaker.opened` — one message
/// on the queue, because both derive the id from the shared record and the queue's
/// duplicate detection drops the second; the downstream back, the breaker closes and
/// `breaker.closed` follows, naming how long it was open. Each message's MessageId is the
/// CloudEvent's id and its Label the type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opening_and_closing_reach_a_service_bus_queue_once() {
    let bed = Bed::start_with_queues(2, vec![QueueSpec::new("retries"), ops_queue()]).await;
    let handler = Arc::new(Scripted::default());
    handler.outage.store(true, Ordering::SeqCst);
    let replicas: Vec<(Arc<OpsEvents>, Running)> = ["replica-a", "replica-b"]
        .into_iter()
        .map(|owner| {
            let events = to_service_bus(&bed, "ops");
            let mut wiring = bed.wiring(owner).policy(fast_policy(10));
            wiring.options_mut().ops_events = Some(events.clone());
            let mut parts = wiring.parts(handler.clone()).unwrap();
            parts.breaker = Some(breaker_config());
            (events, Bed::run(parts))
        })
        .collect();
    let keys: Vec<String> = (0..12).map(|i| format!("br-{i:02}")).collect();
    for p in 0..2 {
        let evs: Vec<(&str, &str)> = keys[p * 6..p * 6 + 6]
            .iter()
            .map(|k| (k.as_str(), "ok"))
            .collect();
        bed.send(p, &evs).await;
    }
    eventually("breaker.opened on the queue", LIMIT, || async {
        seen(on_queue(&bed), |q| {
            q.iter()
                .any(|(_, _, e)| e["type"] == "com.hubguard.breaker.opened")
        })
    })
    .await;
    // Both replicas saw the same open breaker and sent its event.
    eventually("both replicas sent it", LIMIT, || async {
        seen(
            replicas
                .iter()
                .map(|(e, _)| e.counts().sent)
                .collect::<Vec<_>>(),
            |s| s.iter().all(|n| *n >= 1),
        )
    })
    .await;
    handler.outage.store(false, Ordering::SeqCst);
    eventually("every event delivered", LIMIT, || async {
        seen(handler.delivered_keys(), |d| {
            keys.iter().all(|k| d.contains(k))
        })
    })
    .await;
    eventually("breaker.closed on the queue", LIMIT, || async {
        seen(on_queue(&bed), |q| {
            q.iter()
                .any(|(_, _, e)| e["type"] == "com.hubguard.breaker.closed")
        })
    })
    .await;
    for (_, run) in replicas {
        run.stop().await;
    }
    let record = bed.breaker_record("handler").await.expect("breaker record");
    let q = on_queue(&bed);
    let opened: Vec<_> = q
        .iter()
        .filter(|(_, _, e)| e["type"] == "com.hubguard.breaker.opened")
        .collect();
    assert_eq!(
        opened.len() as u64,
        record.opens,
        "one message per opening, whichever replicas saw it: {q:#?}"
    );
    for (id, label, e) in &q {
        assert_eq!(e["specversion"], "1.0", "{e}");
        assert_eq!(e["subject"], "handler", "{e}");
        assert_eq!(e["source"], "/hubguard/hub/$Default", "{e}");
        assert_eq!(Some(id.as_str()), e["id"].as_str(), "MessageId is the id");
        assert_eq!(label.as_deref(), e["type"].as_str(), "Label is the type");
    }
    let (_, _, first) = opened[0];
    assert_eq!(first["data"]["downstream"], "handler", "{first}");
    assert!(first["data"]["opened_at"].is_string(), "{first}");
    let closed = q
        .iter()
        .find(|(_, _, e)| e["type"] == "com.hubguard.breaker.closed")
        .unwrap();
    assert_eq!(closed.2["data"]["downstream"], "handler", "{}", closed.2);
}

/// A Service Bus destination that cannot take the events (its queue does not exist:
/// Service Bus answers 404): each event is counted as failed, readiness stays true and
/// every event is delivered — the destination is not the pipeline's dependency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_bus_destination_that_refuses_is_counted_and_delivery_goes_on() {
    let bed = Bed::start(1).await;
    let events = to_service_bus(&bed, "no-such-queue");
    let handler = Arc::new(Scripted::default());
    let run = run_with(&bed, events.clone(), handler.clone(), "replica-sb-down");
    bed.send(0, &[("q-perm", "perm"), ("q-ok-1", "ok"), ("q-ok-2", "ok")])
        .await;
    dead_lettered(&run, 1).await;
    eventually("the failure counted", LIMIT, || async {
        seen(events.counts(), |c| c.failed >= 1)
    })
    .await;
    wait_for("delivered and ready", &run.health, LIMIT, || async {
        handler.delivered_keys().len() == 2 && run.health.ready()
    })
    .await;
    assert_eq!(events.counts().sent, 0);
    run.stop().await;
}

/// Refuses every event for good (a receiver's bad deploy) while `refuse` is set.
#[derive(Default)]
struct Refusing {
    refuse: std::sync::atomic::AtomicBool,
    delivered: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl hubguard::handler::Handler for Refusing {
    async fn handle(
        &self,
        event: &hubguard::event::Event,
        _: &hubguard::handler::Attempt,
    ) -> hubguard::handler::Outcome {
        use hubguard::handler::{Failure, Outcome};
        if self.refuse.load(Ordering::SeqCst) {
            return Outcome::Failed(Failure::permanent("HTTP 400 from the receiver"));
        }
        let key = event.identity.idempotency_key.clone();
        self.delivered.lock().unwrap().push(key);
        Outcome::Delivered
    }
}

fn of_type(got: &Received, kind: &str) -> Vec<serde_json::Value> {
    got.lock()
        .unwrap()
        .iter()
        .map(|(_, b)| serde_json::from_str::<serde_json::Value>(b).unwrap())
        .filter(|e| e["type"] == kind)
        .collect()
}

/// The storm guard's events end to end: a receiver refusing everything trips the guard
/// (`stormguard.holding`, with the counts that tripped it); fixed, a trial releases it
/// (`stormguard.released`) and every held event is delivered. The dead letters before the
/// guard held are reported as `retries.exhausted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_storm_guard_holding_and_releasing_reach_the_webhook() {
    storm_events(false).await;
}

/// The same for an event type's own guard (`[storm_guard.event_types."test.event"]` with
/// thresholds of its own; the downstream's would never trip): its events name the type, and
/// their subject is that guard's, so the downstream's suppression window never hides them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_types_own_storm_guard_sends_its_own_events() {
    storm_events(true).await;
}

async fn storm_events(own_type: bool) {
    use hubguard::breaker::storm::{StormGuardConfig, StormGuardType};
    let bed = Bed::start(1).await;
    let (url, got) = receiver().await;
    let dest = WebhookDestination::new(url.parse().unwrap(), Duration::from_secs(5), None).unwrap();
    let events = Arc::new(OpsEvents::new(
        settings(Duration::from_secs(60), 16),
        Arc::new(dest),
        bed.clock(),
    ));
    let handler = Arc::new(Refusing::default());
    handler.refuse.store(true, Ordering::SeqCst);
    let mut config = StormGuardConfig {
        min_refusals: 3,
        share: 0.5,
        window_ms: 60_000,
        trial_every_ms: 1_000,
        // Held retries come back within seconds of the release.
        held_retry_defer_max_ms: 4_000,
        ..Default::default()
    };
    let (subject, event_type) = if own_type {
        config.min_refusals = 1_000;
        let own = StormGuardType {
            min_refusals: Some(3),
            ..Default::default()
        };
        config.event_types.insert("test.event".into(), own);
        ("handler (event type test.event)", json!("test.event"))
    } else {
        ("handler", serde_json::Value::Null)
    };
    let mut wiring = bed.wiring("replica-storm").policy(fast_policy(50));
    let o = wiring.options_mut();
    o.ops_events = Some(events.clone());
    o.storm_guard = Some(config);
    let run = Bed::run(wiring.parts(handler.clone()).unwrap());
    let keys: Vec<String> = (0..10).map(|i| format!("sg-{i:02}")).collect();
    bed.send(
        0,
        &keys.iter().map(|k| (k.as_str(), "x")).collect::<Vec<_>>(),
    )
    .await;
    eventually("stormguard.holding sent", LIMIT, || async {
        seen(of_type(&got, "com.hubguard.stormguard.holding"), |v| {
            !v.is_empty()
        })
    })
    .await;
    handler.refuse.store(false, Ordering::SeqCst);
    eventually("stormguard.released sent", LIMIT, || async {
        seen(of_type(&got, "com.hubguard.stormguard.released"), |v| {
            !v.is_empty()
        })
    })
    .await;
    let dead = run.health.snapshot().dead_lettered;
    eventually("every held event delivered", LIMIT, || async {
        seen(handler.delivered.lock().unwrap().len() as u64, |n| {
            *n + dead >= keys.len() as u64
        })
    })
    .await;
    run.stop().await;
    assert!(dead < 3, "fewer than the minimum dead-lettered: {dead}");
    let holding = &of_type(&got, "com.hubguard.stormguard.holding")[0];
    assert_eq!(holding["subject"], subject, "{holding}");
    assert_eq!(holding["data"]["downstream"], "handler", "{holding}");
    assert_eq!(holding["data"]["event_type"], event_type, "{holding}");
    assert!(
        holding["data"]["refusals"].as_u64() >= Some(3),
        "the counts that tripped it: {holding}"
    );
    assert!(holding["data"]["reason"].is_string(), "{holding}");
    let released = &of_type(&got, "com.hubguard.stormguard.released")[0];
    assert_eq!(released["subject"], subject, "{released}");
    assert_eq!(
        released["data"]["holding_since"], holding["data"]["holding_since"],
        "{released}"
    );
    assert!(
        of_type(&got, "com.hubguard.stormguard.holding").len() == 1,
        "one guard held, once"
    );
    // The dead letters before it held: the first reported at once (later ones within the
    // 60 s window wait for the next event).
    let exhausted = of_type(&got, "com.hubguard.retries.exhausted");
    assert_eq!(exhausted.is_empty(), dead == 0, "{exhausted:?}");
    for e in &exhausted {
        assert!(
            e["data"]["dead_lettered_total"].as_u64() <= Some(dead),
            "{e}"
        );
    }
}

/// A partition held past the bound (here an operator's pause, bound 5 s on the bed's
/// clock): `partition.held` names the partition by its id (not the hold's readiness name
/// `0 (paused)`) and why. Once per hold is the watcher's unit test
/// (`holds_past_the_bound_once_per_hold…`): here a second hold could begin before the
/// watcher's next look saw the first end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_held_past_the_bound_is_sent_under_its_id() {
    use hubguard::pipeline::control::{self, Pause};
    let bed = Bed::start(1).await;
    let (url, got) = receiver().await;
    let dest = WebhookDestination::new(url.parse().unwrap(), Duration::from_secs(5), None).unwrap();
    let mut s = settings(Duration::from_secs(1), 16);
    s.held_longer_than = Duration::from_secs(5);
    let events = Arc::new(OpsEvents::new(s, Arc::new(dest), bed.clock()));
    let handler = Arc::new(Scripted::default());
    let run = run_with(&bed, events.clone(), handler.clone(), "replica-held");
    let (store, name) = (bed.records(), control::record_name("hub", "$Default"));
    let entry = Pause {
        by: "ops".into(),
        since_ms: hubguard::clock::ms(bed.clock().now()),
        reason: Some("maintenance".into()),
    };
    control::pause_or_resume(store.as_ref(), &name, true, &["0".into()], entry, false)
        .await
        .unwrap();
    wait_for("partition 0 paused", &run.health, LIMIT, || async {
        run.health.held().contains_key(&control::held_name("0"))
    })
    .await;
    bed.clock().advance(Duration::from_secs(6));
    eventually("partition.held sent", LIMIT, || async {
        seen(of_type(&got, "com.hubguard.partition.held").len(), |n| {
            *n >= 1
        })
    })
    .await;
    run.stop().await;
    let held = &of_type(&got, "com.hubguard.partition.held")[0];
    assert_eq!(held["subject"], "0", "{held}");
    assert_eq!(held["data"]["partition"], "0", "{held}");
    assert_eq!(held["data"]["reason"], "paused", "{held}");
    assert!(held["data"]["held_for_s"].as_f64() >= Some(5.0), "{held}");
}

/// A receiver throttling with 429s lowers the deployment's rate: `ratelimit.lowered` names
/// the downstream, why (`throttled_429`), the rates and the configured limit — once per
/// suppression window however many decreases follow — and every event is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_lowered_reaches_the_webhook_once_per_window() {
    use hubguard::emulator::capped::CappedReceiver;
    use hubguard::handler::webhook::{WebhookConfig, WebhookHandler};
    let bed = Bed::start(1).await;
    let (url, got) = receiver().await;
    let dest = WebhookDestination::new(url.parse().unwrap(), Duration::from_secs(5), None).unwrap();
    let events = Arc::new(OpsEvents::new(
        settings(Duration::from_secs(600), 16),
        Arc::new(dest),
        bed.clock(),
    ));
    // The receiver takes 5 requests a second; the deployment may send 40.
    let capped = CappedReceiver::start("127.0.0.1:0".parse().unwrap(), Some(5), None)
        .await
        .unwrap();
    let handler: Arc<dyn hubguard::handler::Handler> = Arc::new(
        WebhookHandler::new(WebhookConfig {
            timeout_ms: 3000,
            ..WebhookConfig::new(capped.url())
        })
        .unwrap(),
    );
    let downstream = handler.downstream();
    let mut wiring = bed.wiring("replica-rate").policy(fast_policy(20));
    let o = wiring.options_mut();
    o.ops_events = Some(events.clone());
    o.rate_limit = hubguard::ratelimit::RateLimitConfig::per_second(40.0);
    o.max_in_flight = 8;
    let run = Bed::run(wiring.parts(handler).unwrap());
    let keys: Vec<String> = (0..60).map(|i| format!("rl-{i:02}")).collect();
    bed.send(
        0,
        &keys.iter().map(|k| (k.as_str(), "ok")).collect::<Vec<_>>(),
    )
    .await;
    eventually("ratelimit.lowered sent", LIMIT, || async {
        seen(of_type(&got, "com.hubguard.ratelimit.lowered"), |v| {
            !v.is_empty()
        })
    })
    .await;
    eventually("every key delivered", Duration::from_secs(120), || async {
        let delivered = capped.delivered();
        seen(
            keys.iter().filter(|k| delivered.contains_key(*k)).count(),
            |n| *n == keys.len(),
        )
    })
    .await;
    run.stop().await;
    assert!(capped.throttled() > 0);
    let lowered = of_type(&got, "com.hubguard.ratelimit.lowered");
    assert_eq!(lowered.len(), 1, "one per window: {lowered:?}");
    let e = &lowered[0];
    assert_eq!(e["subject"], downstream.as_str(), "{e}");
    assert_eq!(e["data"]["downstream"], downstream.as_str(), "{e}");
    assert_eq!(e["data"]["reason"], "throttled_429", "{e}");
    assert_eq!(e["data"]["limit"], 40.0, "{e}");
    assert!(e["data"]["deployment_rate"].as_f64() < Some(40.0), "{e}");
    assert!(e["data"]["decreases"].as_u64() >= Some(1), "{e}");
    assert!(e["data"]["decreases_total"].as_u64() >= e["data"]["decreases"].as_u64());
}
