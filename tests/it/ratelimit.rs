//! The deployment-wide rate limit (`handler.rate_limit`) on the emulators, through the real
//! SDK clients: shares out by demand through rebalances (all of the limit used, uneven
//! partitions), a 429 storm slowing
//! every replica, a `Retry-After` pausing them all, and the checkpoint never passing an
//! event that waits for the limiter.

use std::sync::Arc;
use std::time::Duration;

use hubguard::breaker::BreakerConfig;
use hubguard::emulator::capped::CappedReceiver;
use hubguard::handler::webhook::{WebhookConfig, WebhookHandler};
use hubguard::handler::Handler;
use hubguard::pipeline::Pipeline;
use hubguard::ratelimit::limiter::Limiter;
use hubguard::ratelimit::RateLimitConfig;
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::pipeline_support::*;

/// How long any step of these tests may take on a loaded machine.
const LIMIT: Duration = Duration::from_secs(90);

/// A replica run for these tests: its limiter, and the tokens that stop it cleanly or kill it.
struct Replica {
    limiter: Arc<Limiter>,
    health: Arc<hubguard::pipeline::health::Health>,
    breaker: Option<Arc<hubguard::breaker::Shared>>,
    cancel: CancellationToken,
    crash: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _log: crate::test_log::TestLog,
}

impl Replica {
    async fn stop(self) {
        self.cancel.cancel();
        within("replica stops", self.task).await.unwrap();
    }
    /// Killed: no final checkpoint, no ownership released.
    async fn kill(self) -> Arc<Limiter> {
        self.crash.cancel();
        within("replica dies", self.task).await.unwrap();
        self.limiter
    }
}

fn start(bed: &Bed, owner: &str, handler: Arc<dyn Handler>, limit: f64, breaker: bool) -> Replica {
    start_with(bed, owner, handler, limit, breaker, 4)
}

/// [`start`] with `in_flight` attempts at once per partition.
fn start_with(
    bed: &Bed,
    owner: &str,
    handler: Arc<dyn Handler>,
    limit: f64,
    breaker: bool,
    in_flight: usize,
) -> Replica {
    let mut wiring = bed.wiring(owner).policy(fast_policy(20));
    wiring.options_mut().rate_limit = RateLimitConfig::per_second(limit);
    wiring.options_mut().max_in_flight = in_flight;
    if breaker {
        wiring = wiring.breaker(BreakerConfig::default());
    }
    let pipeline = Pipeline::new(wiring.parts(handler).unwrap());
    let limiter = pipeline.rate_limiter().expect("a limit is configured");
    let breaker = pipeline.breaker();
    let health = pipeline.health();
    let (cancel, crash) = (CancellationToken::new(), CancellationToken::new());
    let (c, k) = (cancel.clone(), crash.clone());
    let task = tokio::spawn(async move { pipeline.run_until(c, k).await.unwrap() });
    Replica {
        limiter,
        health,
        breaker,
        cancel,
        crash,
        task,
        _log: crate::test_log::TestLog::in_process(),
    }
}

fn webhook(url: String) -> Arc<dyn Handler> {
    Arc::new(
        WebhookHandler::new(WebhookConfig {
            timeout_ms: 3000,
            ..WebhookConfig::new(url)
        })
        .unwrap(),
    )
}

/// Waits (bounded) until `cond` holds over the replicas' limiters, checking `invariant` on
/// every change any of them publishes (and every 20 ms, since a takeover starts counting
/// on time alone).
async fn watch_until(
    what: &str,
    limiters: &[&Arc<Limiter>],
    limit: Duration,
    invariant: &mut dyn FnMut(&[hubguard::ratelimit::limiter::RateSnapshot]),
    cond: &dyn Fn(&[hubguard::ratelimit::limiter::RateSnapshot]) -> bool,
) {
    let changed =
        futures::stream::select_all(limiters.iter().map(|l| Box::pin(changes(l.subscribe()))));
    Wait::new(what, limit)
        .woken_by(changed)
        .until(|| {
            let snaps: Vec<_> = limiters.iter().map(|l| l.snapshot()).collect();
            invariant(&snaps);
            std::future::ready(seen(snaps, |s| cond(s)))
        })
        .await;
}

fn total_share(snaps: &[hubguard::ratelimit::limiter::RateSnapshot]) -> f64 {
    snaps.iter().map(|s| s.share).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shares_add_up_to_the_limit_through_a_rebalance_a_replica_killed_and_one_added() {
    let bed = Bed::start(4).await;
    let handler: Arc<dyn Handler> = Arc::new(Scripted::default());
    let limit = 90.0;
    let mut most = 0.0f64;
    let mut check = |snaps: &[hubguard::ratelimit::limiter::RateSnapshot]| {
        let rates: f64 = snaps.iter().filter_map(|s| s.rate_per_s).sum();
        most = most.max(rates);
        assert!(
            rates <= limit + 1e-6,
            "the replicas' rates add up to {rates} > {limit}: {snaps:#?}"
        );
    };
    let whole = |snaps: &[hubguard::ratelimit::limiter::RateSnapshot]| {
        // Shares are kept in millionths, rounded down.
        (total_share(snaps) - 1.0).abs() < 1e-5 && snaps.iter().all(|s| s.share > 0.0)
    };
    let a = start(&bed, "a", handler.clone(), limit, false);
    // Alone, it gets all of it.
    watch_until(
        "a alone has the whole limit",
        &[&a.limiter],
        Duration::from_secs(20),
        &mut check,
        &whole,
    )
    .await;
    assert_eq!(a.limiter.snapshot().rate_per_s, Some(limit));
    let b = start(&bed, "b", handler.clone(), limit, false);
    let c = start(&bed, "c", handler.clone(), limit, false);
    watch_until(
        "three replicas share the whole limit",
        &[&a.limiter, &b.limiter, &c.limiter],
        Duration::from_secs(40),
        &mut check,
        &whole,
    )
    .await;
    // c is killed: its partitions expire and the others take them (and its share).
    let _dead = c.kill().await;
    watch_until(
        "two replicas share the whole limit after one died",
        &[&a.limiter, &b.limiter],
        Duration::from_secs(40),
        &mut check,
        &whole,
    )
    .await;
    // d joins and takes its share from the live owners.
    let d = start(&bed, "d", handler.clone(), limit, false);
    watch_until(
        "three replicas share the whole limit after one joined",
        &[&a.limiter, &b.limiter, &d.limiter],
        Duration::from_secs(40),
        &mut check,
        &whole,
    )
    .await;
    assert!(
        (most - limit).abs() < 1e-3,
        "the whole limit was in use: {most}"
    );
    for r in [a, b, d] {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_429_storm_lowers_every_replicas_rate_without_opening_the_breaker_or_losing_an_event() {
    let bed = Bed::start(4).await;
    // The receiver takes 15 requests a second; the deployment may send 60.
    let receiver = CappedReceiver::start("127.0.0.1:0".parse().unwrap(), Some(15), None)
        .await
        .unwrap();
    let a = start(&bed, "a", webhook(receiver.url()), 60.0, true);
    let b = start(&bed, "b", webhook(receiver.url()), 60.0, true);
    watch_until(
        "both replicas own partitions",
        &[&a.limiter, &b.limiter],
        Duration::from_secs(30),
        &mut |_| {},
        &|s| s.iter().all(|s| s.share > 0.0) && (total_share(s) - 1.0).abs() < 1e-5,
    )
    .await;
    let keys: Vec<String> = (0..120).map(|i| format!("storm-{i}")).collect();
    for p in 0..4 {
        let events: Vec<(&str, &str)> = keys
            .iter()
            .skip(p)
            .step_by(4)
            .map(|k| (k.as_str(), "ok"))
            .collect();
        bed.send(p, &events).await;
    }
    watch_until(
        "every replica's rate went down",
        &[&a.limiter, &b.limiter],
        Duration::from_secs(30),
        &mut |_| {},
        &|s| {
            s.iter().all(|s| {
                s.last_decrease_reason == Some("throttled_429")
                    && s.deployment_rate_per_s.is_some_and(|r| r < 60.0 * 0.75)
                    && s.rate_per_s
                        .is_some_and(|r| r < 60.0 * 0.75 * s.share + 1e-9)
            })
        },
    )
    .await;
    assert!(receiver.throttled() > 0);
    // Everything arrives (the throttled ones retried), nothing dead-lettered.
    eventually("every key delivered", Duration::from_secs(90), || async {
        let delivered = receiver.delivered();
        if keys.iter().all(|k| delivered.contains_key(k)) {
            Ok(())
        } else {
            Err(format!("{} of {} delivered", delivered.len(), keys.len()))
        }
    })
    .await;
    for r in [&a, &b] {
        let opens = r.breaker.as_ref().unwrap().cached().map_or(0, |r| r.opens);
        assert_eq!(
            opens, 0,
            "a 429 is the limiter's business, not the breaker's"
        );
    }
    let ledger = bed.ledger();
    for k in &keys {
        if let Some(rec) = ledger.record(k).await.unwrap() {
            assert_ne!(
                rec.state(),
                hubguard::ledger::State::DeadLettered,
                "{k} dead-lettered"
            );
        }
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_after_on_a_429_pauses_the_downstream_for_every_replica() {
    let bed = Bed::start(2).await;
    let receiver = CappedReceiver::start("127.0.0.1:0".parse().unwrap(), Some(1), Some(3))
        .await
        .unwrap();
    let a = start(&bed, "a", webhook(receiver.url()), 50.0, true);
    let b = start(&bed, "b", webhook(receiver.url()), 50.0, true);
    watch_until(
        "both replicas own a partition",
        &[&a.limiter, &b.limiter],
        Duration::from_secs(30),
        &mut |_| {},
        &|s| s.iter().all(|s| s.share > 0.0),
    )
    .await;
    bed.send(0, &[("p-0", "ok"), ("p-1", "ok"), ("p-2", "ok")])
        .await;
    bed.send(1, &[("p-3", "ok"), ("p-4", "ok"), ("p-5", "ok")])
        .await;
    // The receiver answers 429 with a Retry-After: every replica must stay away for it. A
    // replica's snapshot shows the pause only while it lasts, and one that reads the shared
    // record late may never show it, so the proof is the receiver's log below, not a sample.
    eventually("a 429 answered", Duration::from_secs(30), || async {
        seen(receiver.log(), |l| l.iter().any(|l| l.status == 429))
    })
    .await;
    let log = receiver.log();
    let first_429 = log.iter().find(|l| l.status == 429).unwrap().at;
    eventually("all six delivered", Duration::from_secs(60), || async {
        seen(receiver.delivered(), |d| d.len() >= 6)
    })
    .await;
    let log = receiver.log();
    let calls_in_pause = log
        .iter()
        .filter(|l| {
            l.at > first_429 + Duration::from_millis(1000)
                && l.at < first_429 + Duration::from_millis(2500)
        })
        .count();
    assert_eq!(
        calls_in_pause, 0,
        "no replica called during the pause: {log:?}"
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_limiter_never_lets_the_checkpoint_pass_an_event_waiting_for_it() {
    let bed = Bed::start(1).await;
    let scripted = Arc::new(Scripted::default());
    // 4 a second, 4 in flight: events wait for the limiter inside the partition.
    let r = start(&bed, "a", scripted.clone(), 4.0, false);
    let keys: Vec<String> = (0..12).map(|i| format!("slow-{i}")).collect();
    let events: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "ok")).collect();
    bed.send(0, &events).await;
    let seen_partial = std::sync::atomic::AtomicBool::new(false);
    eventually("everything delivered and checkpointed", Duration::from_secs(60), || async {
        // The checkpoint first, then what was delivered: a checkpoint read before a
        // delivery can only be behind it.
        let cp = bed.checkpoint_of("0").await;
        let delivered = scripted.delivered_keys();
        let first_waiting = keys.iter().position(|k| !delivered.contains(k));
        if let (Some(cp), Some(w)) = (cp, first_waiting) {
            assert!(
                (cp as usize) < w,
                "checkpoint {cp} passed event {w}, which has not been delivered (waiting for the limiter)"
            );
            if cp >= 0 {
                seen_partial.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        if first_waiting.is_none() && cp == Some(11) {
            Ok(())
        } else {
            Err(format!("checkpoint {cp:?}, delivered {delivered:?}"))
        }
    })
    .await;
    let seen_partial = seen_partial.into_inner();
    assert!(
        seen_partial,
        "the checkpoint moved while later events waited for the limiter"
    );
    r.stop().await;
}

#[test]
fn a_limit_of_zero_or_less_is_refused_naming_the_key() {
    let base = |extra: &str| {
        format!(
            r#"
[eventhubs]
connection_string = "Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=K;UseDevelopmentEmulator=true"
hub = "hub"
[servicebus]
connection_string = "Endpoint=sb://127.0.0.1:5380;SharedAccessKeyName=k;SharedAccessKey=K;UseDevelopmentEmulator=true"
[storage]
container_url = "http://127.0.0.1:10000/devstoreaccount1/hubguard"
[handler]
kind = "webhook"
url = "http://127.0.0.1:9000/events"
{extra}
"#
        )
    };
    for bad in [
        "rate_limit = 0",
        "rate_limit = -1",
        "rate_limit = 0.0",
        "rate_limit = -0.5",
    ] {
        let e = hubguard::config::Config::parse(&base(bad), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("handler.rate_limit"), "{bad}: {e}");
        assert!(e.contains("positive"), "{bad}: {e}");
    }
    let ok = hubguard::config::Config::parse(&base("rate_limit = 100"), Vec::new()).unwrap();
    assert_eq!(ok.pipeline_options().unwrap().rate_limit.per_s, Some(100.0));
}

/// The `rate_limit` bench scenario (`hubguard bench --only rate_limit`) from the test
/// binary, with its figures printed: about two minutes, so only by hand
/// (`cargo test --test it rate_limit_bench -- --ignored --nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long: the bench scenario, run by hand"]
async fn rate_limit_bench_holds_the_cap_and_converges() {
    let events = |var: &str, default: usize| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let f = hubguard::bench::ratelimit::rate_limit(
        100.0,
        50,
        events("HUBGUARD_RATE_EVENTS", 1500),
        events("HUBGUARD_ADAPTIVE_EVENTS", 2400),
    )
    .await
    .unwrap();
    println!("{f:#?}");
    assert!(
        f.cap.max_per_s as f64 <= 1.05 * f.cap.limit,
        "{} in one second",
        f.cap.max_per_s
    );
    assert_eq!(f.adaptive.dead_lettered, 0);
    assert_eq!(f.adaptive.breaker_opens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_attempt_span_says_how_long_it_waited_for_the_limiter() {
    use hubguard::telemetry::names::{attr, span};
    let t = crate::otlp::telemetry();
    let bed = Bed::start(1).await;
    let scripted = Arc::new(Scripted::default());
    // 2 a second, 4 in flight: the later events of the burst wait for their slots.
    let r = start(&bed, "a", scripted.clone(), 2.0, false);
    let keys = ["span-wait-0", "span-wait-1", "span-wait-2", "span-wait-3"];
    bed.send(0, &keys.map(|k| (k, "ok"))).await;
    eventually("the burst delivered", Duration::from_secs(60), || async {
        seen(scripted.delivered_keys(), |d| d.len() >= keys.len())
    })
    .await;
    r.stop().await;
    let waits: Vec<f64> = eventually(
        "an attempt span for each",
        Duration::from_secs(60),
        || async {
            t.flush().await;
            let spans = t.collected.lock().unwrap().spans.clone();
            let waits: Vec<f64> = spans
                .iter()
                .filter(|s| {
                    s.name == span::ATTEMPT
                        && s.attributes
                            .get(attr::MESSAGE_ID)
                            .is_some_and(|k| keys.contains(&k.as_str()))
                })
                .filter_map(|s| s.attributes.get(attr::RATE_LIMIT_WAIT)?.parse().ok())
                .collect();
            seen(waits, |w| w.len() >= keys.len())
        },
    )
    .await;
    // Paced 2/s (at the headroom): the last of the four waited about 1.5 s for its slot.
    let longest = waits.iter().cloned().fold(0.0, f64::max);
    assert!(longest > 1.0, "{waits:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_pause_shows_in_readiness_until_it_ends() {
    let bed = Bed::start(1).await;
    let receiver = CappedReceiver::start("127.0.0.1:0".parse().unwrap(), Some(1), Some(60))
        .await
        .unwrap();
    let r = start(&bed, "a", webhook(receiver.url()), 20.0, true);
    bed.send(0, &[("long-0", "ok"), ("long-1", "ok"), ("long-2", "ok")])
        .await;
    wait_for(
        "readiness names the pause",
        &r.health,
        Duration::from_secs(30),
        || async {
            r.health.report()["not_ready"]
                .to_string()
                .contains("Retry-After")
        },
    )
    .await;
    assert!(!r.health.ready());
    // The throttled event waits as a retry (due after its Retry-After), the one behind it
    // in its partition, unattempted; the receiver recovers, and the pause runs on the
    // policy clock: move it past the minute.
    wait_for(
        "the retry scheduled",
        &r.health,
        Duration::from_secs(30),
        || async { r.health.snapshot().retries_scheduled == 1 },
    )
    .await;
    assert_eq!(receiver.log().len(), 2, "nothing called during the pause");
    receiver.set_cap(None);
    bed.clock().advance(Duration::from_secs(61));
    wait_for(
        "everything delivered and ready again",
        &r.health,
        Duration::from_secs(60),
        || async { receiver.delivered().len() == 3 && r.health.ready() },
    )
    .await;
    r.stop().await;
}

/// What the receiver saw of a run: requests per whole second from the first request, the
/// average rate from the first request to the last, and the busiest sliding second.
#[derive(Debug)]
struct Used {
    per_second: Vec<u32>,
    average_per_s: f64,
    max_in_any_second: usize,
}

fn used(receiver: &CappedReceiver) -> Used {
    let log = receiver.log();
    let first = log.first().map(|l| l.at).unwrap_or_default();
    let log: Vec<_> = log
        .into_iter()
        .map(|l| hubguard::emulator::capped::Logged {
            at: l.at - first,
            status: l.status,
        })
        .collect();
    let span = log.last().map_or(0.0, |l| l.at.as_secs_f64());
    Used {
        per_second: hubguard::emulator::capped::per_second(&log),
        average_per_s: log.len().saturating_sub(1) as f64 / span.max(1e-9),
        max_in_any_second: hubguard::emulator::capped::max_in_any_second(&log, Duration::ZERO),
    }
}

/// Issue 39: the limit is used, not split by owned partitions. Three replicas, four
/// partitions with most of the backlog in one; the first replica runs alone for a while,
/// the other two join mid-run (a rebalance). From the first request to the last (a backlog
/// waits all along) the receiver must see ≥ 90 % of the limit on average, no sliding
/// second above 105 % and no whole second without a request. (Before shares followed
/// demand they followed owned partitions, and the replica holding the big partition kept a
/// quarter or half: 62–66 % of the limit here.) A measurement of throughput, so only by
/// hand on a quiet machine (`cargo test --test it unused_share_flows -- --ignored
/// --nocapture`); the behaviour is held by
/// `the_share_follows_the_backlog_from_one_replica_to_both` below.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "timed: a throughput measurement, run by hand on a quiet machine"]
async fn unused_share_flows_to_the_replicas_with_a_backlog_through_a_rebalance() {
    let limit = 100.0;
    let bed = Bed::start(4).await;
    let receiver = CappedReceiver::start("127.0.0.1:0".parse().unwrap(), None, None)
        .await
        .unwrap();
    // 1,500 events: 900 in partition 0, 250, 200 and 150 in the others.
    let mut keys = Vec::new();
    for (p, n) in [(0usize, 900usize), (1, 250), (2, 200), (3, 150)] {
        let batch: Vec<String> = (0..n).map(|i| format!("uneven-{p}-{i}")).collect();
        let events: Vec<(&str, &str)> = batch.iter().map(|k| (k.as_str(), "ok")).collect();
        bed.send(p, &events).await;
        keys.extend(batch);
    }
    // Enough in flight that one partition can take the whole limit: the limiter, not the
    // partition's concurrency, is what holds each replica back.
    let a = start_with(&bed, "a", webhook(receiver.url()), limit, false, 32);
    eventually("a alone delivers", Duration::from_secs(60), || async {
        seen(receiver.delivered().len(), |n| *n >= 200)
    })
    .await;
    let b = start_with(&bed, "b", webhook(receiver.url()), limit, false, 32);
    let c = start_with(&bed, "c", webhook(receiver.url()), limit, false, 32);
    eventually(
        "every event delivered",
        Duration::from_secs(120),
        || async {
            let delivered = receiver.delivered();
            seen(
                keys.iter().filter(|k| delivered.contains_key(*k)).count(),
                |n| *n == keys.len(),
            )
        },
    )
    .await;
    let u = used(&receiver);
    for r in [a, b, c] {
        r.stop().await;
    }
    println!("{u:?}");
    assert!(
        u.max_in_any_second as f64 <= 1.05 * limit,
        "{} requests in one second, limit {limit}: {u:?}",
        u.max_in_any_second
    );
    // The last whole second may be partial; every earlier one had requests.
    let whole = &u.per_second[..u.per_second.len().saturating_sub(1)];
    assert!(
        whole.iter().all(|n| *n > 0),
        "a whole second without a request: {u:?}"
    );
    assert!(
        u.average_per_s >= 0.9 * limit,
        "{:.1}/s on average, {:.0} % of the limit {limit}: {u:?}",
        u.average_per_s,
        100.0 * u.average_per_s / limit
    );
}

/// Issue 39, as behaviour: the share follows demand. Two replicas own two partitions each;
/// a backlog waits in the partitions of one of them only, and that replica's share grows
/// to nearly all of the limit (the idle one keeps a sliver to grow into); once the other
/// has a backlog too they split it evenly. At every change the shares add up to at most
/// the whole. The limit is low (20/s) so the backlogs outlast every step on any machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_share_follows_the_backlog_from_one_replica_to_both() {
    let limit = 20.0;
    let bed = Bed::start(4).await;
    let receiver = CappedReceiver::start("127.0.0.1:0".parse().unwrap(), None, None)
        .await
        .unwrap();
    let a = start_with(&bed, "a", webhook(receiver.url()), limit, false, 32);
    wait_for("a owns every partition", &a.health, LIMIT, || async {
        a.health.owned().len() == 4
    })
    .await;
    let b = start_with(&bed, "b", webhook(receiver.url()), limit, false, 32);
    wait_for("b is handed half", &b.health, LIMIT, || async {
        a.health.owned().len() == 2 && b.health.owned().len() == 2
    })
    .await;
    let mut check = |snaps: &[hubguard::ratelimit::limiter::RateSnapshot]| {
        assert!(
            total_share(snaps) <= 1.0 + 1e-9,
            "the shares add up to more than the whole: {snaps:#?}"
        );
    };
    let backlog = |health: &hubguard::pipeline::health::Health, tag: &str| {
        let owned: Vec<String> = health.owned().keys().cloned().collect();
        let bed = &bed;
        let tag = tag.to_string();
        async move {
            for p in owned {
                let keys: Vec<String> = (0..600).map(|i| format!("{tag}-{p}-{i}")).collect();
                for chunk in keys.chunks(100) {
                    let evs: Vec<(&str, &str)> = chunk.iter().map(|k| (k.as_str(), "ok")).collect();
                    bed.send(p.parse().unwrap(), &evs).await;
                }
            }
        }
    };
    backlog(&a.health, "a").await;
    watch_until(
        "the replica with the backlog takes nearly all of the limit",
        &[&a.limiter, &b.limiter],
        LIMIT,
        &mut check,
        &|s| s[0].backlog && !s[1].backlog && s[0].share >= 0.9,
    )
    .await;
    backlog(&b.health, "b").await;
    watch_until(
        "both with a backlog split the limit",
        &[&a.limiter, &b.limiter],
        LIMIT,
        &mut check,
        &|s| s[0].backlog && s[1].backlog && s.iter().all(|x| x.share >= 0.45),
    )
    .await;
    a.stop().await;
    b.stop().await;
}
