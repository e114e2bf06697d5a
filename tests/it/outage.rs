//! A 15-minute downstream outage with thousands of retries pending, end to end, on the clock
//! the pipeline and the Service Bus emulator share. Simulated time passes in one-second
//! steps; each step waits until the retry loops are idle (nothing due or locked on Service
//! Bus), so the quarter of an hour costs no real waiting and every step is deterministic.
//!
//! What it holds the breaker to (seed 003): opened once; its expiry never extended by the
//! work that lands on it; one probe per half-open window across two replicas; deferral
//! spends no attempt; the backlog comes back spread out, not as a stampede; and nothing is
//! lost — including events that arrive during the outage, which wait in Event Hubs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use hubguard::breaker::{BreakerConfig, BreakerRecord};
use hubguard::clock::Clock;
use hubguard::event::Event;
use hubguard::handler::{Attempt, Failure, Handler, Outcome};
use hubguard::ledger::State;

use crate::common::Wait;
use crate::pipeline_support::*;

/// Retries pending on Service Bus when the breaker first sees the outage.
const PENDING: usize = 2000;
/// Events produced while the breaker is open; Event Hubs must hold them.
const DURING: usize = 200;
const PARTITIONS: usize = 4;
const OUTAGE: Duration = Duration::from_secs(15 * 60);
const STEP: Duration = Duration::from_secs(1);
/// Real-time bound on any one wait (a hang fails the test instead of stalling it).
const LIMIT: Duration = Duration::from_secs(120);

const OPEN_MS: u64 = 120_000;
const SPREAD_MS: u64 = 60_000;
const CONSECUTIVE: u32 = 5;
const RETRY_CONCURRENCY: usize = 4;

/// The downstream: records every call on the shared clock; fails transiently while down.
struct Downstream {
    clock: Arc<Clock>,
    down: AtomicBool,
    calls: Mutex<Vec<(String, u32, SystemTime)>>,
}

#[async_trait]
impl Handler for Downstream {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let key = event.identity.idempotency_key.clone();
        self.calls
            .lock()
            .unwrap()
            .push((key, attempt.number, self.clock.now()));
        if self.down.load(Ordering::SeqCst) {
            Outcome::Failed(Failure::transient("503 Service Unavailable"))
        } else {
            Outcome::Delivered
        }
    }

    fn downstream(&self) -> String {
        "orders-api".into()
    }
}

impl Downstream {
    fn calls(&self) -> Vec<(String, u32, SystemTime)> {
        self.calls.lock().unwrap().clone()
    }
}

async fn breaker(bed: &Bed) -> BreakerRecord {
    bed.breaker_record("orders-api").await.unwrap_or_default()
}

/// Waits until nothing is due on Service Bus: every retry the last step made due has been
/// received and settled (deferred, attempted, completed). A message the retry loop took
/// early (`retry_lead`) and holds until its due time, still ahead, waits on the clock.
pub(crate) async fn idle(bed: &Bed, what: &str) {
    let queue = bed.sb.queue("retries").unwrap();
    let clock = bed.clock();
    let waiting_early = |m: &hubguard::emulator::servicebus::broker::StoredMessage| {
        m.locked_until().is_some()
            && serde_json::from_slice::<serde_json::Value>(&m.body)
                .ok()
                .and_then(|b| b["due_ms"].as_i64())
                .is_some_and(|due| due > ms(clock.now()))
    };
    Wait::new(&format!("{what}: Service Bus idle"), LIMIT)
        .every(Duration::from_millis(2))
        .until(|| async {
            let c = bed.sb.counters("retries").unwrap();
            let idle = c.active == 0
                && (c.locked == 0
                    || queue
                        .messages(hubguard::emulator::servicebus::broker::Entity::Main)
                        .iter()
                        .filter(|m| m.locked_until().is_some())
                        .all(waiting_early));
            if idle {
                Ok(())
            } else {
                Err(c)
            }
        })
        .await
}

/// Sends `n` events spread evenly over the partitions, keyed `{prefix}-{partition}-{i}`.
pub(crate) async fn send_spread(bed: &Bed, prefix: &str, n: usize) -> Vec<String> {
    let mut keys = Vec::new();
    for p in 0..PARTITIONS {
        let ks: Vec<String> = (0..n / PARTITIONS)
            .map(|i| format!("{prefix}-{p}-{i:04}"))
            .collect();
        let evs: Vec<(&str, &str)> = ks.iter().map(|k| (k.as_str(), "")).collect();
        bed.send(p, &evs).await;
        keys.extend(ks);
    }
    keys
}

fn ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifteen_minute_outage_with_thousands_pending_opens_once_probes_once_per_window_and_recovers_without_a_stampede(
) {
    let bed = Bed::start(PARTITIONS).await;
    let clock = bed.clock();
    // The SAS tokens the clients sign last an hour of wall time and the emulator checks them
    // on this clock: the whole test must stay well inside that hour of simulated time.
    let downstream = Arc::new(Downstream {
        clock: clock.clone(),
        down: AtomicBool::new(true),
        calls: Mutex::default(),
    });
    let mut policy = fast_policy(30);
    policy.base_s = 60;
    policy.floor_s = 60;

    // Before the breaker: PENDING events fail once each and wait on Service Bus, due in 60 s.
    let keys;
    {
        let mut parts = bed.parts(downstream.clone(), policy.clone(), "replica-a");
        parts.options.max_in_flight = 16;
        let run = Bed::run(parts);
        keys = send_spread(&bed, "order", PENDING).await;
        wait_for("the backlog is pending", &run.health, LIMIT, || async {
            bed.sb.counters("retries").unwrap().scheduled == PENDING as u64
        })
        .await;
        run.stop().await;
    }
    assert_eq!(downstream.calls().len(), PENDING, "one failed call each");
    let sends_before = bed.sb.counters("retries").unwrap().sends;

    // The outage goes on, now with two replicas sharing the breaker.
    let config = BreakerConfig {
        enabled: true,
        consecutive_failures: CONSECUTIVE,
        failure_ratio: None,
        ratio_window: 20,
        open_ms: OPEN_MS,
        spread_ms: SPREAD_MS,
        probe_timeout_ms: 30_000,
        // The classic single probe per half-open window, which this test holds to seed 003
        // (`recovery` tests the trial of several calls).
        half_open_calls: 1,
        half_open_success_ratio: 1.0,
        brink_hold_ms: 10_000,
    };
    let replicas: Vec<Running> = ["replica-b", "replica-c"]
        .into_iter()
        .map(|owner| {
            let mut parts = bed.parts(downstream.clone(), policy.clone(), owner);
            parts.breaker = Some(config.clone());
            parts.options.retry_concurrency = RETRY_CONCURRENCY;
            Bed::run(parts)
        })
        .collect();
    let started = clock.now();
    let recovered_at = started + OUTAGE;
    // Every distinct expiry the breaker had, with the reopen count it came with.
    let mut expiries: BTreeMap<i64, u64> = BTreeMap::new();
    let mut opens_seen = BTreeSet::new();
    let mut during = Vec::new();
    let mut step = 0u32;
    while clock.now() < recovered_at {
        clock.advance(STEP);
        step += 1;
        idle(&bed, &format!("outage step {step}")).await;
        let r = breaker(&bed).await;
        opens_seen.insert(r.opens);
        if let Some(u) = r.open_until_ms {
            let reopens = *expiries.entry(u).or_insert(r.reopens);
            assert_eq!(
                reopens, r.reopens,
                "the expiry {u} stayed while the breaker re-opened: {r:?}"
            );
        }
        if step == 300 {
            // Five minutes in, new events arrive: outage mode leaves them in Event Hubs.
            during = send_spread(&bed, "late", DURING).await;
        }
    }
    let at_recovery = breaker(&bed).await;
    let outage_calls = downstream.calls();
    let held = replicas
        .iter()
        .flat_map(|r| r.health.held().into_values())
        .map(|h| h.reason)
        .collect::<Vec<_>>();

    // Recovery: the downstream is back; time goes on until everything has settled.
    downstream.down.store(false, Ordering::SeqCst);
    let all: BTreeSet<String> = keys.iter().chain(&during).cloned().collect();
    let mut recovery_steps = 0;
    loop {
        let delivered: BTreeSet<String> = downstream
            .calls()
            .into_iter()
            .filter(|(_, _, t)| *t >= recovered_at)
            .map(|(k, _, _)| k)
            .collect();
        let c = bed.sb.counters("retries").unwrap();
        if delivered == all && c.active + c.scheduled + c.locked == 0 {
            break;
        }
        assert!(
            recovery_steps < 900,
            "not recovered 15 simulated minutes after the downstream came back: \
             {} of {} delivered, {c:?}",
            delivered.len(),
            all.len()
        );
        clock.advance(STEP);
        recovery_steps += 1;
        idle(&bed, &format!("recovery step {recovery_steps}")).await;
        let r = breaker(&bed).await;
        opens_seen.insert(r.opens);
    }
    for r in replicas {
        r.stop().await;
    }
    let calls = downstream.calls();
    let end = breaker(&bed).await;
    let sb = bed.sb.counters("retries").unwrap();

    // Opened once, from closed, and never again.
    assert_eq!(at_recovery.opens, 1, "{at_recovery:?}");
    assert_eq!(opens_seen, BTreeSet::from([0, 1]), "opens observed");
    assert_eq!(end.open_until_ms, None, "closed after recovery: {end:?}");
    // Its expiry changed only when a failed probe re-opened it, each time a full window on.
    assert_eq!(
        expiries.len() as u64,
        at_recovery.reopens + 1,
        "one expiry per open or re-open: {expiries:?}"
    );
    let us: Vec<i64> = expiries.keys().copied().collect();
    for w in us.windows(2) {
        assert!(
            w[1] - w[0] >= OPEN_MS as i64,
            "re-opened before a window had passed: {us:?}"
        );
    }

    // One probe per half-open window: after the trip, every call to the down downstream is
    // a probe, a full open window after the previous one, and each failed probe re-opened it.
    // The trip: the calls that failed until each replica saw it open, all in the step in
    // which the first retries came due (a few seconds of slack for a loaded machine: the
    // bound on their number below still holds them to the in-flight calls).
    let opened_at = at_recovery.opened_at_ms.expect("opened");
    let trip_step = opened_at + 5000;
    let before_open = outage_calls[PENDING..]
        .iter()
        .filter(|(_, _, t)| ms(*t) < trip_step)
        .count();
    let mut probes: Vec<i64> = outage_calls[PENDING..]
        .iter()
        .map(|(_, _, t)| ms(*t))
        .filter(|t| *t >= trip_step)
        .collect();
    probes.sort();
    // Each replica trips on its own CONSECUTIVE-th failure (or sees the other's trip when its
    // cached view refreshes); on top come the calls its other slots had started or start
    // while that trip's storage round trip is under way.
    assert!(
        before_open <= 2 * (CONSECUTIVE as usize + 2 * RETRY_CONCURRENCY),
        "{before_open} calls before the breaker opened"
    );
    // Sub-second slack: the probe's call is timed just before its failure re-opens the breaker.
    for w in std::iter::once(&opened_at)
        .chain(&probes)
        .copied()
        .collect::<Vec<_>>()
        .windows(2)
    {
        assert!(
            w[1] - w[0] >= OPEN_MS as i64 - 1000,
            "two calls within one open window during the outage: {probes:?}"
        );
    }
    assert!(
        (at_recovery.reopens..=at_recovery.reopens + 1).contains(&(probes.len() as u64)),
        "{} probes, {} re-opens: {probes:?}",
        probes.len(),
        at_recovery.reopens
    );
    let windows = OUTAGE.as_millis() as u64 / (OPEN_MS + SPREAD_MS);
    assert!(
        at_recovery.reopens >= windows,
        "the breaker probed and re-opened through the outage: {at_recovery:?}"
    );

    // Outage mode: the events that arrived during the outage waited in Event Hubs.
    let late_calls = outage_calls
        .iter()
        .filter(|(k, _, _)| k.starts_with("late-"))
        .count();
    assert!(
        late_calls <= probes.len(),
        "{late_calls} calls for events that arrived during the outage"
    );
    assert!(
        !held.is_empty()
            && held
                .iter()
                .all(|r| r.starts_with("downstream breaker open")),
        "partitions paused with the reason: {held:?}"
    );

    // Deferral spends no attempt: every attempt the ledger counts is a call that happened.
    let deferrals = sb.sends - sends_before;
    assert!(
        deferrals >= 3 * PENDING as u64,
        "the backlog was deferred again at every window: {deferrals} sends"
    );
    let ledger = bed.ledger();
    let mut by_key: BTreeMap<&str, u32> = BTreeMap::new();
    for (k, _, _) in &calls {
        *by_key.entry(k.as_str()).or_default() += 1;
    }
    let mut unspent = 0;
    for k in &keys {
        let rec = ledger.record(k).await.unwrap().unwrap();
        assert_eq!(rec.state(), State::Delivered, "{k}");
        assert_eq!(
            rec.attempts,
            by_key[k.as_str()],
            "{k}: every attempt is a call"
        );
        if rec.attempts == 2 {
            unspent += 1;
        }
    }
    assert!(
        unspent >= PENDING - probes.len() - before_open,
        "waiting out the outage cost {} events an attempt",
        PENDING - unspent
    );
    for k in &during {
        assert!(by_key.contains_key(k.as_str()), "{k} never called");
    }

    // No stampede: the backlog came back spread over the deferral window.
    let mut per_second: BTreeMap<i64, usize> = BTreeMap::new();
    for (_, _, t) in calls.iter().filter(|(_, _, t)| *t >= recovered_at) {
        *per_second.entry(ms(*t) / 1000).or_default() += 1;
    }
    let busiest = per_second.values().copied().max().unwrap_or(0);
    assert!(
        busiest <= PENDING / 10,
        "{busiest} calls in one second to the recovering downstream: {per_second:?}"
    );
    let span = per_second.keys().last().unwrap() - per_second.keys().next().unwrap();
    assert!(
        span * 1000 >= SPREAD_MS as i64 / 2,
        "the backlog came back within {span} s"
    );

    // Nothing lost.
    assert_eq!(sb.dead_lettered, 0, "{sb:?}");
    for k in &all {
        assert!(
            calls.iter().any(|(c, _, t)| c == k && *t >= recovered_at),
            "{k} never delivered"
        );
    }
    println!(
        "outage: {PENDING} pending + {DURING} during; {step} + {recovery_steps} steps; \
         {before_open} calls before it opened, {} probes, {} re-opens, {deferrals} deferrals; \
         busiest recovery second {busiest} calls over {span} s",
        probes.len(),
        at_recovery.reopens
    );
}
