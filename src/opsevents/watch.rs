//! The watcher: reads what the pipeline already reports (its health, the breaker's record as
//! last seen, the rate limiter's readings) every `poll`, off the event path, and emits an
//! operational event for each change worth one. It never touches delivery: a slow or failing
//! destination only fills (then overflows, counted) the channel.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{OpsEvent, OpsEventKind, OpsEvents};
use crate::breaker::BreakerState;
use crate::clock::{at, rfc3339};
use crate::telemetry::gauges::RateLimitReadings;

/// What the watcher reads from the pipeline.
pub trait Observed: Send + Sync + 'static {
    /// Events dead-lettered by this replica so far.
    fn dead_lettered(&self) -> u64;
    /// Per held partition: the hold's bounded label and how long (s) it has been held.
    fn held_for(&self) -> BTreeMap<String, (&'static str, f64)>;
}

/// What the watcher watches.
pub struct Watched {
    /// The pipeline's health.
    pub observed: Arc<dyn Observed>,
    /// The downstream's name.
    pub downstream: String,
    /// Its breaker, if any.
    pub breaker: Option<Arc<crate::breaker::Shared>>,
    /// Its rate limiter, if any.
    pub limiter: Option<Arc<dyn RateLimitReadings>>,
    /// Its dead-letter storm guard, if any.
    pub storm: Option<Arc<crate::breaker::storm::Guard>>,
}

/// What the watcher saw last.
#[derive(Default)]
struct Seen {
    breaker_open: bool,
    opened_at_ms: Option<i64>,
    dead_lettered: u64,
    decreases: Option<u64>,
    held: BTreeSet<String>,
    /// Per guard (`None`: the downstream's; a type's own by its type), when its hold began,
    /// as last seen (`None`: it was not holding).
    storm_since_ms: BTreeMap<Option<String>, Option<i64>>,
}

/// Watches until `stop` fires.
pub async fn run(events: Arc<OpsEvents>, watched: Watched, stop: CancellationToken) {
    let mut seen = Seen {
        dead_lettered: watched.observed.dead_lettered(),
        decreases: watched.limiter.as_ref().map(|l| l.decreases()),
        ..Default::default()
    };
    loop {
        look(&events, &watched, &mut seen);
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(events.poll) => {}
        }
    }
}

fn look(events: &OpsEvents, w: &Watched, seen: &mut Seen) {
    breaker(events, w, seen);
    storm_guard(events, w, seen);
    dead_letters(events, w, seen);
    held(events, w, seen);
    rate_limit(events, w, seen);
}

fn event(
    kind: OpsEventKind,
    subject: &str,
    id: Option<String>,
    events: &OpsEvents,
    data: serde_json::Value,
) -> OpsEvent {
    OpsEvent {
        kind,
        subject: subject.to_string(),
        id,
        time: events.now(),
        data,
    }
}

/// Opened: a record with a new `opened_at`; closed: the breaker closed after being open.
/// Every replica sees the same record, so the ids are derived from it (receivers drop
/// the repeats by `source` + `id`).
fn breaker(events: &OpsEvents, w: &Watched, seen: &mut Seen) {
    let Some(b) = &w.breaker else { return };
    let Some(rec) = b.cached() else { return };
    let state = rec.state(events.now());
    let open = state != BreakerState::Closed;
    if open && rec.opened_at_ms.is_some() && rec.opened_at_ms != seen.opened_at_ms {
        let opened = rec.opened_at_ms.unwrap_or_default();
        events.emit(event(
            OpsEventKind::BreakerOpened,
            &w.downstream,
            Some(format!("breaker.opened/{}/{opened}", w.downstream)),
            events,
            json!({
                "downstream": w.downstream,
                "opened_at": rfc3339(at(opened)),
                "open_until": rec.open_until_ms.map(|u| rfc3339(at(u))),
                "opens": rec.opens,
                "reopens": rec.reopens,
            }),
        ));
        seen.opened_at_ms = rec.opened_at_ms;
    }
    if seen.breaker_open && !open {
        let opened = seen.opened_at_ms.unwrap_or_default();
        events.emit(event(
            OpsEventKind::BreakerClosed,
            &w.downstream,
            Some(format!("breaker.closed/{}/{opened}", w.downstream)),
            events,
            json!({
                "downstream": w.downstream,
                "opened_at": rfc3339(at(opened)),
                "open_for_s": events.now().duration_since(at(opened)).map_or(0.0, |d| d.as_secs_f64()),
            }),
        ));
    }
    seen.breaker_open = open;
}

/// Holding: a record with a new hold; released: the hold seen before is gone — for the
/// downstream's guard and each event type's own (subject: the guard's name, so one type's
/// events are not suppressed by another's). Ids derive from the record, as the breaker's do.
fn storm_guard(events: &OpsEvents, w: &Watched, seen: &mut Seen) {
    let Some(g) = &w.storm else { return };
    for (event_type, label, rec, config) in g.lanes_cached() {
        let Some(rec) = rec else { continue };
        let lane = event_type.map(str::to_string);
        let id = |what: &str, since: i64| match event_type {
            None => format!("stormguard.{what}/{}/{since}", w.downstream),
            Some(t) => format!("stormguard.{what}/{}/types/{t}/{since}", w.downstream),
        };
        let was = seen.storm_since_ms.get(&lane).copied().flatten();
        let since = rec.holding.as_ref().map(|h| h.since_ms);
        if let (Some(h), true) = (&rec.holding, since != was) {
            events.emit(event(
                OpsEventKind::StormGuardHolding,
                label,
                Some(id("holding", h.since_ms)),
                events,
                json!({
                    "downstream": w.downstream,
                    "event_type": event_type,
                    "holding_since": rfc3339(at(h.since_ms)),
                    "refusals": h.refusals,
                    "attempts": h.attempts,
                    "held_by": h.by,
                    "reason": crate::breaker::storm::waiting(&rec, config),
                }),
            ));
        }
        if let (Some(was), None) = (was, since) {
            events.emit(event(
                OpsEventKind::StormGuardReleased,
                label,
                Some(id("released", was)),
                events,
                json!({
                    "downstream": w.downstream,
                    "event_type": event_type,
                    "holding_since": rfc3339(at(was)),
                    "held_refusals": rec.held_refusals,
                    "released_by": rec.last_action.as_ref().filter(|a| a.at_ms >= was).map(|a| a.by.clone()),
                    "accepted_until": rec.accepted_until_ms.map(|u| rfc3339(at(u))),
                }),
            ));
        }
        seen.storm_since_ms.insert(lane, since);
    }
}

/// Dead letters since the last event sent: a suppressed occurrence leaves them counted
/// into the next one.
fn dead_letters(events: &OpsEvents, w: &Watched, seen: &mut Seen) {
    let now = w.observed.dead_lettered();
    if now <= seen.dead_lettered {
        return;
    }
    let data = json!({
        "downstream": w.downstream,
        "dead_lettered": now - seen.dead_lettered,
        "dead_lettered_total": now,
    });
    if events.emit(event(
        OpsEventKind::RetriesExhausted,
        &w.downstream,
        None,
        events,
        data,
    )) {
        seen.dead_lettered = now;
    }
}

/// A partition held past the bound: once per hold (until it is released).
fn held(events: &OpsEvents, w: &Watched, seen: &mut Seen) {
    let held = w.observed.held_for();
    seen.held.retain(|p| held.contains_key(p));
    let bound = events.held_longer_than.as_secs_f64();
    for (partition, (reason, secs)) in held {
        if secs < bound || seen.held.contains(&partition) {
            continue;
        }
        events.emit(event(
            OpsEventKind::PartitionHeld,
            &partition,
            None,
            events,
            json!({
                "partition": partition,
                "reason": reason,
                "held_for_s": secs,
                "bound_s": bound,
            }),
        ));
        seen.held.insert(partition);
    }
}

fn rate_limit(events: &OpsEvents, w: &Watched, seen: &mut Seen) {
    let Some(l) = &w.limiter else { return };
    let now = l.decreases();
    let before = seen.decreases.replace(now).unwrap_or(now);
    if now <= before {
        return;
    }
    events.emit(event(
        OpsEventKind::RateLimitLowered,
        &w.downstream,
        None,
        events,
        json!({
            "downstream": w.downstream,
            "reason": l.last_decrease(),
            "deployment_rate": l.deployment(),
            "replica_rate": l.current(),
            "limit": l.configured(),
            "decreases": now - before,
            "decreases_total": now,
        }),
    ));
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::clock::Clock;
    use crate::opsevents::send::{OpsEventsDestination, OpsEventsError};
    use crate::opsevents::OpsEventsSettings;

    struct Nowhere;

    #[async_trait::async_trait]
    impl OpsEventsDestination for Nowhere {
        async fn send(&self, _: &serde_json::Value) -> Result<(), OpsEventsError> {
            Ok(())
        }
        fn describe(&self) -> String {
            "nowhere".into()
        }
    }

    #[derive(Default)]
    struct Fake {
        dead: AtomicU64,
        held: Mutex<BTreeMap<String, (&'static str, f64)>>,
        decreases: AtomicU64,
    }

    impl Observed for Fake {
        fn dead_lettered(&self) -> u64 {
            self.dead.load(Ordering::SeqCst)
        }
        fn held_for(&self) -> BTreeMap<String, (&'static str, f64)> {
            self.held.lock().unwrap().clone()
        }
    }

    impl RateLimitReadings for Fake {
        fn downstream_name(&self) -> String {
            "orders".into()
        }
        fn configured(&self) -> Option<f64> {
            Some(100.0)
        }
        fn current(&self) -> Option<f64> {
            Some(25.0)
        }
        fn deployment(&self) -> Option<f64> {
            Some(50.0)
        }
        fn last_decrease(&self) -> Option<&'static str> {
            Some("429")
        }
        fn decreases(&self) -> u64 {
            self.decreases.load(Ordering::SeqCst)
        }
    }

    fn drain(events: &OpsEvents) -> Vec<OpsEvent> {
        let mut rx = events.rx.lock().unwrap();
        let rx = rx.as_mut().unwrap();
        let mut out = Vec::new();
        while let Ok((e, _)) = rx.try_recv() {
            out.push(e);
        }
        out
    }

    #[test]
    fn holds_past_the_bound_once_per_hold_dead_letters_carry_over_and_decreases_are_reported() {
        let clock = Arc::new(Clock::default());
        let events = OpsEvents::new(
            OpsEventsSettings {
                suppression: Duration::from_secs(60),
                held_longer_than: Duration::from_secs(300),
                ..Default::default()
            },
            Arc::new(Nowhere),
            clock.clone(),
        );
        let fake = Arc::new(Fake::default());
        let w = Watched {
            observed: fake.clone(),
            downstream: "orders".into(),
            breaker: None,
            limiter: Some(fake.clone()),
            storm: None,
        };
        let mut seen = Seen {
            decreases: Some(0),
            ..Default::default()
        };
        look(&events, &w, &mut seen);
        assert!(drain(&events).is_empty(), "nothing happened");

        fake.held
            .lock()
            .unwrap()
            .insert("3".into(), ("servicebus", 100.0));
        look(&events, &w, &mut seen);
        assert!(drain(&events).is_empty(), "held, but not for long");
        fake.held
            .lock()
            .unwrap()
            .insert("3".into(), ("servicebus", 301.0));
        look(&events, &w, &mut seen);
        look(&events, &w, &mut seen);
        let got = drain(&events);
        assert_eq!(got.len(), 1, "once per hold: {got:?}");
        assert_eq!(got[0].kind, OpsEventKind::PartitionHeld);
        assert_eq!(got[0].subject, "3");
        assert_eq!(got[0].data["reason"], "servicebus");

        fake.dead.store(2, Ordering::SeqCst);
        fake.decreases.store(1, Ordering::SeqCst);
        look(&events, &w, &mut seen);
        fake.dead.store(5, Ordering::SeqCst);
        look(&events, &w, &mut seen); // suppressed: within the window
        let got = drain(&events);
        assert_eq!(got.len(), 2, "{got:?}");
        let dl = got
            .iter()
            .find(|e| e.kind == OpsEventKind::RetriesExhausted)
            .unwrap();
        assert_eq!(dl.data["dead_lettered"], 2);
        let rl = got
            .iter()
            .find(|e| e.kind == OpsEventKind::RateLimitLowered)
            .unwrap();
        assert_eq!(rl.data["reason"], "429");
        assert_eq!(rl.data["deployment_rate"], 50.0);

        clock.advance(Duration::from_secs(61));
        look(&events, &w, &mut seen);
        let got = drain(&events);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(
            got[0].data["dead_lettered"], 3,
            "the suppressed ones carried over"
        );
        assert_eq!(events.counts().suppressed, 1);

        // Released, then held again past the bound: a new hold, a new event.
        fake.held.lock().unwrap().clear();
        look(&events, &w, &mut seen);
        fake.held
            .lock()
            .unwrap()
            .insert("3".into(), ("servicebus", 400.0));
        clock.advance(Duration::from_secs(61));
        look(&events, &w, &mut seen);
        assert_eq!(drain(&events).len(), 1);
    }
}
