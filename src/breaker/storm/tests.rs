//! The storm guard's pure logic, with an injected clock, and the shared guard on an in-memory
//! store.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proptest::prelude::*;

use super::*;
use crate::azure::memory::MemoryRecordStore;

fn cfg() -> StormGuardConfig {
    StormGuardConfig {
        min_refusals: 5,
        share: 0.5,
        window_ms: 60_000,
        trial_every_ms: 10_000,
        ..Default::default()
    }
}

fn t(ms_: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000) + Duration::from_millis(ms_)
}

fn refused(who: &str, attempts: u32, refusals: u32, now: SystemTime) -> StormChange {
    StormChange::Refused {
        who: who.into(),
        counts: Counts {
            attempts,
            refusals,
            at_ms: ms(now),
        },
        trial: None,
    }
}

#[test]
fn trips_at_the_minimum_when_the_share_is_reached_and_not_before() {
    let c = cfg();
    let mut r = StormRecord::default();
    for n in 1..5 {
        r = apply(&r, &refused("a", n, n, t(n as u64)), t(n as u64), &c).unwrap();
        assert_eq!(
            on_refusal(&r, t(n as u64)),
            RefusalVerdict::DeadLetter,
            "{n}"
        );
    }
    r = apply(&r, &refused("a", 5, 5, t(5)), t(5), &c).unwrap();
    assert_eq!(
        on_refusal(&r, t(5)),
        RefusalVerdict::Hold,
        "the fifth trips it"
    );
    let h = r.holding.clone().unwrap();
    assert_eq!((h.refusals, h.attempts, r.holds), (5, 5, 1));
    assert!(waiting(&r, &c).is_some_and(|w| w.contains("5 of 5 attempts")));
}

#[test]
fn an_ordinary_share_of_refusals_never_trips_it() {
    // 2 % refusals among many deliveries: 200 refusals in 10,000 attempts.
    let c = cfg();
    let mut r = StormRecord::default();
    for n in 1..=200u32 {
        let now = t(u64::from(n));
        r = apply(&r, &refused("a", n * 50, n, now), now, &c).unwrap();
        assert_eq!(on_refusal(&r, now), RefusalVerdict::DeadLetter);
    }
    assert_eq!(r.holds, 0);
}

#[test]
fn replicas_counts_add_up_and_old_ones_leave_the_window() {
    let c = cfg();
    let mut r = StormRecord::default();
    r = apply(&r, &refused("a", 2, 2, t(0)), t(0), &c).unwrap();
    r = apply(&r, &refused("b", 2, 2, t(1)), t(1), &c).unwrap();
    assert_eq!(r.totals(t(1), &c), (4, 4));
    assert!(r.holding.is_none());
    // a's counts are older than the window by now: not counted, and dropped.
    let later = t(61_000);
    r = apply(&r, &refused("b", 3, 3, later), later, &c).unwrap();
    assert_eq!(r.totals(later, &c), (3, 3));
    assert!(r.holding.is_none() && !r.counts.contains_key("a"));
    r = apply(&r, &refused("c", 2, 2, later), later, &c).unwrap();
    assert!(r.holding.is_some(), "3 + 2 within the window");
}

#[test]
fn held_work_waits_for_one_trial_per_interval_and_a_delivery_releases() {
    let c = cfg();
    let held = apply(&StormRecord::default(), &refused("a", 5, 5, t(0)), t(0), &c).unwrap();
    let (a, ch) = decide(&held, t(1000), &c, 0.0);
    assert_eq!((a, ch), (StormAdmission::Wait(t(10_000)), None));
    let (_, ch) = decide(&held, t(10_000), &c, 0.0);
    assert_eq!(ch, Some(StormChange::TakeTrial));
    let trial = apply(&held, &StormChange::TakeTrial, t(10_000), &c).unwrap();
    assert_eq!(trial.trial_ms, Some(ms(t(10_000))));
    assert_eq!(
        apply(&trial, &StormChange::TakeTrial, t(10_001), &c),
        None,
        "one trial at a time"
    );
    assert!(
        matches!(decide(&trial, t(10_001), &c, 0.0).0, StormAdmission::Wait(w) if w >= t(20_000))
    );
    // Refused again: still held, the next trial an interval later.
    let again = StormChange::Refused {
        who: "a".into(),
        counts: Counts {
            attempts: 6,
            refusals: 6,
            at_ms: ms(t(10_500)),
        },
        trial: Some(ms(t(10_000))),
    };
    let still = apply(&trial, &again, t(10_500), &c).unwrap();
    assert_eq!(on_refusal(&still, t(10_500)), RefusalVerdict::Hold);
    assert_eq!(still.next_trial(&c), Some(t(20_500)));
    // A late delivery of the old trial changes nothing; the new trial's delivery releases.
    let t2 = apply(&still, &StormChange::TakeTrial, t(20_500), &c).unwrap();
    assert_eq!(
        apply(
            &t2,
            &StormChange::Delivered {
                trial: ms(t(10_000))
            },
            t(20_600),
            &c
        ),
        None
    );
    let released = apply(
        &t2,
        &StormChange::Delivered {
            trial: ms(t(20_500)),
        },
        t(20_600),
        &c,
    )
    .unwrap();
    assert_eq!(released.holding, None);
    assert_eq!(released.totals(t(20_600), &c), (0, 0), "counted afresh");
    assert_eq!(
        decide(&released, t(20_600), &c, 0.0).0,
        StormAdmission::Allow
    );
}

#[test]
fn operators_release_accept_and_hold_and_each_is_audited() {
    let c = cfg();
    let held = apply(&StormRecord::default(), &refused("a", 5, 5, t(0)), t(0), &c).unwrap();
    let released = apply(
        &held,
        &StormChange::Release {
            by: "ana".into(),
            reason: None,
        },
        t(1),
        &c,
    )
    .unwrap();
    assert_eq!(released.holding, None);
    assert_eq!(
        released
            .last_action
            .as_ref()
            .map(|a| (a.action.as_str(), a.by.as_str())),
        Some(("release", "ana"))
    );
    assert_eq!(
        apply(
            &released,
            &StormChange::Release {
                by: "ana".into(),
                reason: None
            },
            t(2),
            &c
        ),
        None,
        "nothing to release"
    );
    // Accepted: refusals are dead-lettered and never trip it, until the acceptance ends.
    let accepted = apply(
        &held,
        &StormChange::Accept {
            by: "bo".into(),
            until: t(30_000),
            reason: Some("schema change".into()),
        },
        t(1),
        &c,
    )
    .unwrap();
    assert_eq!(accepted.state(t(2)), StormState::Accepted);
    let mut r = accepted;
    for n in 1..=50u32 {
        r = apply(
            &r,
            &refused("a", n, n, t(u64::from(n))),
            t(u64::from(n)),
            &c,
        )
        .unwrap();
        assert_eq!(on_refusal(&r, t(u64::from(n))), RefusalVerdict::DeadLetter);
    }
    let after = t(30_001);
    r = apply(&r, &refused("a", 51, 51, after), after, &c).unwrap();
    assert_eq!(
        on_refusal(&r, after),
        RefusalVerdict::Hold,
        "the acceptance ended"
    );
    // Held by hand: no trial releases it.
    let by_hand = apply(
        &StormRecord::default(),
        &StormChange::Hold {
            by: "cy".into(),
            reason: Some("bad deploy".into()),
        },
        t(0),
        &c,
    )
    .unwrap();
    assert_eq!(by_hand.next_trial(&c), None);
    assert!(matches!(
        decide(&by_hand, t(100_000), &c, 0.0),
        (StormAdmission::Wait(_), None)
    ));
    assert!(
        waiting(&by_hand, &c).is_some_and(|w| w.contains("held by cy") && w.contains("bad deploy"))
    );
}

#[test]
fn config_names_the_key_and_types_can_be_left_out() {
    assert_eq!(StormGuardConfig::default().validate(), Ok(()));
    for (bad, key) in [
        (
            StormGuardConfig {
                share: 0.0,
                ..cfg()
            },
            "storm_guard.share",
        ),
        (
            StormGuardConfig {
                share: 1.5,
                ..cfg()
            },
            "storm_guard.share",
        ),
        (
            StormGuardConfig {
                min_refusals: 1,
                ..cfg()
            },
            "storm_guard.min_refusals",
        ),
        (
            StormGuardConfig {
                window_ms: 10,
                ..cfg()
            },
            "storm_guard.window_ms",
        ),
        (
            StormGuardConfig {
                trial_every_ms: 10,
                ..cfg()
            },
            "storm_guard.trial_every_ms",
        ),
    ] {
        assert_eq!(bad.validate().unwrap_err().key(), key);
    }
    let mut c = cfg();
    c.event_types
        .insert("audit".into(), StormGuardType::exempt());
    assert!(c.covers(None) && c.covers(Some("order")) && !c.covers(Some("audit")));
    c.enabled = false;
    assert!(!c.covers(Some("order")));
}

fn guard(
    store: Arc<dyn crate::azure::RecordStore>,
    who: &str,
    clock: Arc<crate::clock::Clock>,
) -> Guard {
    Guard::new(store, "api", who, cfg()).with_clock(clock)
}

#[tokio::test]
async fn replicas_together_dead_letter_fewer_than_the_minimum_before_it_holds() {
    let store: Arc<dyn crate::azure::RecordStore> = Arc::new(MemoryRecordStore::new());
    let clock = Arc::new(crate::clock::Clock::default());
    let replicas: Vec<Arc<Guard>> = ["a", "b", "c"]
        .into_iter()
        .map(|w| Arc::new(guard(store.clone(), w, clock.clone())))
        .collect();
    let calls: Vec<_> = (0..30)
        .map(|i| {
            let g = replicas[i % 3].clone();
            tokio::spawn(async move { g.counted(None, Counted::Refused, None).await })
        })
        .collect();
    let mut dead = 0;
    for c in calls {
        if c.await.unwrap() == StormVerdict::Settle {
            dead += 1;
        }
    }
    assert_eq!(dead, 4, "min_refusals - 1 dead-lettered, cluster-wide");
    let r = read(store.as_ref(), "api").await.unwrap().unwrap();
    assert_eq!(r.held_refusals, 26);
    // Every replica now makes new work wait, and one trial goes through once due.
    for g in &replicas {
        assert!(matches!(g.admit(None, 0.0).await, StormGate::Wait(_)));
    }
    clock.advance(Duration::from_secs(11));
    let gates = futures::future::join_all(replicas.iter().map(|g| g.admit(None, 0.0))).await;
    let trials: Vec<i64> = gates
        .iter()
        .filter_map(|g| match g {
            StormGate::Run { trial } => *trial,
            _ => None,
        })
        .collect();
    assert_eq!(trials.len(), 1, "{gates:?}");
    assert_eq!(
        replicas[0]
            .counted(None, Counted::Delivered, Some(trials[0]))
            .await,
        StormVerdict::Settle
    );
    assert_eq!(
        read(store.as_ref(), "api").await.unwrap().unwrap().holding,
        None
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        replicas[1].admit(None, 0.0).await,
        StormGate::Run { trial: None }
    );
    // A type left out is never held.
    let mut c = cfg();
    c.event_types
        .insert("audit".into(), StormGuardType::exempt());
    let g = Guard::new(store.clone(), "api", "d", c).with_clock(clock.clone());
    for _ in 0..10 {
        assert_eq!(
            g.counted(Some("audit"), Counted::Refused, None).await,
            StormVerdict::Settle
        );
    }
}

/// What replicas do to the record, in any interleaving.
#[derive(Debug, Clone)]
enum Step {
    Advance(u64),
    Refuse(u8, bool),
    Deliver(u8),
    Ask,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u64..20_000).prop_map(Step::Advance),
        (0u8..3, any::<bool>()).prop_map(|(w, t)| Step::Refuse(w, t)),
        (0u8..3).prop_map(Step::Deliver),
        Just(Step::Ask),
    ]
}

proptest! {
    /// Whatever the interleaving: refusals dead-lettered while it watches never reach the
    /// minimum within one window, a trial is taken at most once per interval, and the guard
    /// releases only through a delivered trial.
    #[test]
    fn dead_letters_stay_under_the_minimum_and_trials_are_paced(
        steps in proptest::collection::vec(step(), 1..300),
    ) {
        let c = cfg();
        let mut now = t(0);
        let mut r = StormRecord::default();
        let mut local: Vec<Vec<(SystemTime, bool)>> = vec![Vec::new(); 3];
        let mut dead: Vec<SystemTime> = Vec::new();
        let mut last_trial: Option<SystemTime> = None;
        let mut delivered = false;
        for s in steps {
            let before = r.clone();
            match s {
                Step::Advance(d) => now += Duration::from_millis(d),
                Step::Refuse(w, as_trial) => {
                    let l = &mut local[w as usize];
                    l.push((now, true));
                    let within: Vec<_> = l.iter().filter(|(x, _)| now.duration_since(*x).unwrap_or_default() <= Duration::from_millis(c.window_ms)).collect();
                    let counts = Counts { attempts: within.len() as u32, refusals: within.iter().filter(|(_, x)| *x).count() as u32, at_ms: ms(now) };
                    let trial = if as_trial { r.trial_ms } else { None };
                    r = apply(&r, &StormChange::Refused { who: w.to_string(), counts, trial }, now, &c).unwrap();
                    if on_refusal(&r, now) == RefusalVerdict::DeadLetter {
                        // Dead-lettered only below the threshold, as the totals stand.
                        let (attempts, refusals) = r.totals(now, &c);
                        prop_assert!(refusals < c.min_refusals || f64::from(refusals) < c.share * f64::from(attempts));
                        dead.push(now);
                        // A receiver refusing everything: fewer than the minimum per window.
                        if !delivered {
                            let in_window = dead.iter().filter(|x| now.duration_since(**x).unwrap_or_default() <= Duration::from_millis(c.window_ms)).count();
                            prop_assert!(in_window < c.min_refusals as usize, "{in_window} dead letters within a window");
                        }
                    }
                }
                Step::Deliver(w) => {
                    delivered = true;
                    local[w as usize].push((now, false));
                    if let Some(trial) = r.trial_ms {
                        if let Some(next) = apply(&r, &StormChange::Delivered { trial }, now, &c) { r = next; }
                    }
                }
                Step::Ask => {
                    if let (_, Some(ch)) = decide(&r, now, &c, 0.5) {
                        if let Some(next) = apply(&r, &ch, now, &c) {
                            if let Some(prev) = last_trial {
                                prop_assert!(now.duration_since(prev).unwrap_or_default() >= Duration::from_millis(c.trial_every_ms));
                            }
                            last_trial = Some(now);
                            r = next;
                        }
                    }
                }
            }
            if before.holding.is_some() && r.holding.is_none() {
                prop_assert!(before.trial_ms.is_some(), "released without a trial");
                dead.clear();
            }
        }
    }
}

/// `[storm_guard.event_types."bulk"]` with thresholds of its own.
fn with_bulk() -> StormGuardConfig {
    let mut c = cfg();
    c.event_types.insert(
        "bulk".into(),
        StormGuardType {
            min_refusals: Some(8),
            share: Some(0.9),
            ..StormGuardType::default()
        },
    );
    c.event_types
        .insert("audit".into(), StormGuardType::exempt());
    c
}

#[test]
fn a_type_with_thresholds_of_its_own_has_its_own_lane_and_bad_values_name_their_key() {
    let c = with_bulk();
    assert_eq!(c.validate(), Ok(()));
    assert_eq!(c.lane_of(Some("bulk")), Some("bulk"));
    assert_eq!(c.lane_of(Some("audit")), None, "left out, not a lane");
    assert_eq!(c.lane_of(Some("order")), None);
    let bulk = c.lane(Some("bulk"));
    assert_eq!(
        (
            bulk.min_refusals,
            bulk.share,
            bulk.window_ms,
            bulk.trial_every_ms
        ),
        (8, 0.9, 60_000, 10_000),
        "its own thresholds over the downstream's"
    );
    assert!(bulk.event_types.is_empty());
    assert_eq!(c.lane(None).min_refusals, 5);
    assert_eq!(c.own_types().collect::<Vec<_>>(), vec!["bulk"]);
    let typed = |t: StormGuardType| {
        let mut c = cfg();
        c.event_types.insert("bulk".into(), t);
        c.validate().unwrap_err()
    };
    for (bad, key, says) in [
        (
            typed(StormGuardType {
                share: Some(0.0),
                ..Default::default()
            }),
            "storm_guard.event_types.\"bulk\".share",
            "storm_guard.event_types.\"bulk\".share must be above 0",
        ),
        (
            typed(StormGuardType {
                min_refusals: Some(1),
                ..Default::default()
            }),
            "storm_guard.event_types.\"bulk\".min_refusals",
            "must be at least 2",
        ),
        (
            typed(StormGuardType {
                window_ms: Some(5),
                ..Default::default()
            }),
            "storm_guard.event_types.\"bulk\".window_ms",
            "at least 1000, got 5",
        ),
        (
            typed(StormGuardType {
                enabled: false,
                min_refusals: Some(50),
                ..Default::default()
            }),
            "storm_guard.event_types.\"bulk\".enabled",
            "takes no thresholds",
        ),
        (
            StormGuardConfig {
                held_retry_defer_max_ms: 5_000,
                ..cfg()
            }
            .validate()
            .unwrap_err(),
            "storm_guard.held_retry_defer_max_ms",
            "at least storm_guard.trial_every_ms (10000)",
        ),
    ] {
        assert_eq!(bad.key(), key, "{bad}");
        assert!(bad.to_string().contains(says), "{bad}");
    }
    let mut c = cfg();
    c.event_types.insert(" ".into(), StormGuardType::default());
    assert_eq!(c.validate().unwrap_err().key(), "storm_guard.event_types");
}

#[tokio::test]
async fn a_type_with_its_own_lane_neither_trips_the_guard_for_the_others_nor_hides_behind_them() {
    let store: Arc<dyn crate::azure::RecordStore> = Arc::new(MemoryRecordStore::new());
    let clock = Arc::new(crate::clock::Clock::default());
    let g = Guard::new(store.clone(), "api", "a", with_bulk()).with_clock(clock.clone());
    // "bulk" legitimately refuses 7 of every 10: far over the downstream's 50 %, under its
    // own 90 %. Its refusals are dead-lettered; the others are delivered and never wait.
    let mut dead = 0;
    for i in 0..40 {
        let outcome = if i % 10 < 7 {
            Counted::Refused
        } else {
            Counted::Delivered
        };
        if g.counted(Some("bulk"), outcome, None).await == StormVerdict::Settle
            && outcome == Counted::Refused
        {
            dead += 1;
        }
        g.counted(Some("order"), Counted::Delivered, None).await;
    }
    assert_eq!(dead, 28, "every bulk refusal dead-lettered at once");
    assert_eq!(
        g.admit(Some("order"), 0.0).await,
        StormGate::Run { trial: None }
    );
    assert_eq!(
        g.admit(Some("bulk"), 0.0).await,
        StormGate::Run { trial: None }
    );
    let downstream = read(store.as_ref(), "api")
        .await
        .unwrap()
        .unwrap_or_default();
    assert_eq!(downstream.holding, None);
    assert_eq!(
        downstream.totals(clock.now(), &cfg()),
        (0, 0),
        "bulk not counted there"
    );
    // A minute later the receiver refuses every "order": the downstream's lane trips at its
    // minimum, while bulk goes on.
    clock.advance(Duration::from_secs(61));
    let mut dead = 0;
    for _ in 0..10 {
        if g.counted(Some("order"), Counted::Refused, None).await == StormVerdict::Settle {
            dead += 1;
        }
    }
    assert!(dead < 5, "{dead}");
    assert!(matches!(
        g.admit(Some("order"), 0.0).await,
        StormGate::Wait(_)
    ));
    assert!(matches!(g.admit(None, 0.0).await, StormGate::Wait(_)));
    assert_eq!(
        g.admit(Some("bulk"), 0.0).await,
        StormGate::Run { trial: None }
    );
    assert_eq!(
        g.admit(Some("audit"), 0.0).await,
        StormGate::Run { trial: None }
    );
    // Bulk refusing everything trips its own lane, at its own minimum (8), not hidden behind
    // the deliveries of other types.
    clock.advance(Duration::from_secs(61));
    let mut dead = 0;
    for _ in 0..20 {
        if g.counted(Some("bulk"), Counted::Refused, None).await == StormVerdict::Settle {
            dead += 1;
        }
    }
    assert_eq!(dead, 7, "its own min_refusals - 1");
    let bulk = read_lane(store.as_ref(), "api", Some("bulk"))
        .await
        .unwrap()
        .unwrap();
    assert!(bulk.holding.is_some());
    assert!(matches!(
        g.admit(Some("bulk"), 0.0).await,
        StormGate::Wait(_)
    ));
    let why = g.waiting().unwrap();
    assert!(why.contains("downstream api storm guard holding"), "{why}");
    assert!(
        why.contains("downstream api (event type bulk) storm guard holding"),
        "{why}"
    );
    let bulk_why = g.waiting_for(Some("bulk")).unwrap();
    assert!(
        bulk_why.starts_with("downstream api (event type bulk) storm guard holding"),
        "{bulk_why}"
    );
    let order_why = g.waiting_for(Some("order")).unwrap();
    assert!(!order_why.contains("event type bulk"), "{order_why}");
    let report = g.report();
    assert_eq!(report["state"], "holding", "{report}");
    assert_eq!(
        report["event_types"]["bulk"]["state"], "holding",
        "{report}"
    );
    // An operator releases the bulk lane alone.
    let (after, changed) = operate(
        store.as_ref(),
        "api",
        Some("bulk"),
        StormChange::Release {
            by: "ana".into(),
            reason: None,
        },
        &with_bulk(),
        clock.now(),
    )
    .await
    .unwrap();
    assert!(changed && after.holding.is_none());
    assert!(read(store.as_ref(), "api")
        .await
        .unwrap()
        .unwrap()
        .holding
        .is_some());
}

fn holding_since(since: SystemTime) -> StormRecord {
    StormRecord {
        holding: Some(Holding {
            since_ms: ms(since),
            refusals: 5,
            attempts: 5,
            by: None,
            reason: None,
        }),
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A held retry is deferred past the next trial, by no more than the cap, and by longer
    /// the longer the guard has held.
    #[test]
    fn a_held_retry_waits_past_the_next_trial_longer_the_longer_it_holds_and_never_past_the_cap(
        held_ms in 0u64..20_000_000,
        trial_ago in proptest::option::of(0u64..30_000),
        more_ms in 0u64..5_000_000,
        jitter in 0.0f64..1.0,
    ) {
        let c = cfg();
        let now = t(20_000_000);
        let mut r = holding_since(now - Duration::from_millis(held_ms));
        r.trial_ms = trial_ago
            .map(|a| ms(now) - a.min(held_ms) as i64);
        let until = held_retry_until(&r, now, &c, jitter);
        let cap = Duration::from_millis(c.held_retry_defer_max_ms);
        prop_assert!(until >= now + Duration::from_millis(c.trial_every_ms).mul_f64(0.75));
        prop_assert!(until <= now + cap);
        if let Some(next) = r.next_trial(&c) {
            prop_assert!(until >= next.min(now + cap), "before the next trial");
        }
        // Deferred by at least 3/4 of how long it has held so far (within the interval and
        // the cap): held longer, deferred longer.
        let every = Duration::from_millis(c.trial_every_ms);
        let grown = Duration::from_millis(held_ms).clamp(every, cap);
        prop_assert!(until.duration_since(now).unwrap() >= grown.mul_f64(0.75));
        let later = now + Duration::from_millis(more_ms);
        let until_later = held_retry_until(&r, later, &c, jitter);
        let grown_later = Duration::from_millis(held_ms + more_ms).clamp(every, cap);
        prop_assert!(until_later.duration_since(later).unwrap() >= grown_later.mul_f64(0.75));
        prop_assert!(grown_later >= grown);
    }
}

/// A retry held for an hour with trials every 15 s (the defaults) is sent back to Service Bus
/// a few dozen times, not 240; once released, it is attempted within the cap.
#[test]
fn an_hour_held_costs_a_few_dozen_deferrals_and_release_waits_at_most_the_cap() {
    let c = StormGuardConfig::default();
    let start = t(0);
    let release = start + Duration::from_secs(3600);
    for jitter in [0.0, 0.5, 0.999] {
        let mut rounds = 0;
        let mut now = start;
        let mut trial = ms(start);
        loop {
            // A trial is refused every interval while it holds (the event path's trials).
            while at(trial) + Duration::from_millis(c.trial_every_ms) <= now {
                trial += c.trial_every_ms as i64;
            }
            let mut r = holding_since(start);
            r.trial_ms = Some(trial);
            let until = held_retry_until(&r, now, &c, jitter);
            assert!(until > now);
            rounds += 1;
            now = until;
            if now >= release {
                break;
            }
        }
        assert!(
            rounds <= 50,
            "{rounds} deferrals in an hour (jitter {jitter})"
        );
        assert!(
            now <= release + Duration::from_millis(c.held_retry_defer_max_ms),
            "attempted {:?} after the release",
            now.duration_since(release)
        );
    }
    // The old rule (once per trial) would have been 240 rounds.
    assert_eq!(
        3600 * 1000 / StormGuardConfig::default().trial_every_ms,
        240
    );
}
