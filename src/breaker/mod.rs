//! The circuit breaker: one per downstream, its state shared by every replica in
//! blob storage with compare-and-swap.
//!
//! - Opened **once**, on the transition from closed, when a replica sees
//!   `consecutive_failures` transient failures in a row; its expiry is never extended by work
//!   that lands on it while it is open.
//! - Work that meets an open breaker is **deferred** to after the expiry, spread over a
//!   window (jitter) so that it does not come back all at once; deferral counts no attempt
//!   and does not touch the breaker.
//! - After the expiry the breaker is half-open and runs a **trial**: it lets through
//!   `half_open_calls` calls cluster-wide (each permit is taken with compare-and-swap on the
//!   shared record, so replicas together never exceed it), and judges their results, as
//!   Resilience4j's `permittedNumberOfCallsInHalfOpenState` does: once
//!   `ceil(half_open_success_ratio × half_open_calls)` of them succeeded it closes; as soon as
//!   so many failed that the ratio can no longer be reached it re-opens, once, with a fresh
//!   expiry. One event's own failure (a first attempt that fails by itself) therefore does not
//!   keep a healthy downstream closed off. With `half_open_calls = 1` this is the classic
//!   single probe. A trial whose calls do not all report back within `probe_timeout` is
//!   judged on the results it has (none: a fresh trial begins).
//! - Closed or half-open, a replica **paces new events at the brink**: when one more failure
//!   would trip it (failures in a row plus new events' calls in flight), a new event waits up to
//!   `brink_hold_ms` for any call to succeed first ([`Shared::admit_new`]); retries are never
//!   held. A success (a due retry the downstream serves) lets it go on; a downstream that is
//!   down still trips the breaker, at most that much later.
//!
//! The permits bound: per trial, at most `half_open_calls` calls are admitted cluster-wide
//! (each is a compare-and-swap increment on the one record). A trial that runs out of time
//! is followed by a fresh one, so across trials the bound is `half_open_calls` per
//! `probe_timeout_ms` of half-open time; a replica whose storage calls fail admits its calls
//! (the breaker must not become an outage of its own), which the bound does not cover.
//!
//! [`decide`] and [`on_result`] are pure functions of the record and the time; [`Shared`]
//! keeps the record in a [`RecordStore`](crate::azure::RecordStore).

mod config;
mod machine;
mod shared;
pub mod storm;

// Every item at the path it had before the split; without the test bed, which reaches them
// all, the product itself uses only some of them.
pub use config::{BreakerConfig, BreakerConfigError};
#[allow(unused_imports)]
pub use machine::{
    apply, decide, on_result, waiting, Admission, BreakerRecord, BreakerState, Change, Trial,
};
#[cfg(any(test, feature = "testbed"))]
pub use shared::read;
#[allow(unused_imports)]
pub use shared::{record_name, Shared};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use crate::azure::RecordStore;
    use crate::clock::{at, ms};

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            consecutive_failures: 3,
            failure_ratio: None,
            ratio_window: 20,
            open_ms: 60_000,
            spread_ms: 10_000,
            probe_timeout_ms: 5_000,
            half_open_calls: 1,
            half_open_success_ratio: 1.0,
            brink_hold_ms: 10_000,
        }
    }

    fn trial(n: u32, ratio: f64) -> BreakerConfig {
        BreakerConfig {
            half_open_calls: n,
            half_open_success_ratio: ratio,
            ..cfg()
        }
    }

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn open_at_0(c: &BreakerConfig) -> BreakerRecord {
        apply(
            &BreakerRecord::default(),
            &Change::Open(t(60)),
            "a",
            t(0),
            c,
        )
        .unwrap()
    }

    /// Takes a permit at `now` the way [`Shared::admit`] does: decide, then apply.
    fn take(r: &BreakerRecord, now: SystemTime, c: &BreakerConfig) -> Option<(BreakerRecord, i64)> {
        match decide(r, "x", now, c, 0.0) {
            (Admission::Probe { .. }, Some(ch)) => {
                let next = apply(r, &ch, "x", now, c)?;
                let id = next.trial.as_ref()?.since_ms;
                Some((next, id))
            }
            _ => None,
        }
    }

    #[test]
    fn opens_once_on_the_threshold_and_never_extends() {
        let c = cfg();
        let closed = BreakerRecord::default();
        assert_eq!(on_result(&closed, false, None, 2, (0, 0), t(0), &c), None);
        let Some(change) = on_result(&closed, false, None, 3, (0, 0), t(0), &c) else {
            panic!("opens")
        };
        let open = apply(&closed, &change, "a", t(0), &c).unwrap();
        assert_eq!((open.open_until_ms, open.opens), (Some(ms(t(60))), 1));
        // Failures landing on the open breaker (or another replica's threshold) change nothing.
        assert_eq!(on_result(&open, false, None, 9, (0, 0), t(30), &c), None);
        assert_eq!(
            apply(&open, &Change::Open(t(90)), "b", t(30), &c),
            None,
            "never extended while open"
        );
    }

    #[test]
    fn open_defers_past_the_expiry_with_spread_and_one_probe_after() {
        let c = cfg();
        let open = open_at_0(&c);
        let (a, ch) = decide(&open, "x", t(10), &c, 0.5);
        assert_eq!(a, Admission::Defer(t(65) + Duration::from_millis(1)));
        assert_eq!(ch, None, "deferral does not touch the breaker");
        let (a0, _) = decide(&open, "x", t(10), &c, 0.0);
        let (a1, _) = decide(&open, "x", t(10), &c, 0.999);
        assert!(
            matches!((a0, a1), (Admission::Defer(x), Admission::Defer(y)) if x >= t(60) && y > x),
            "spread"
        );
        // Half-open with one permitted call: the first to ask takes it; everyone else waits.
        let (probing, id) = take(&open, t(61), &c).expect("the probe");
        assert_eq!(id, ms(t(61)));
        assert!(matches!(
            decide(&probing, "y", t(62), &c, 0.0).0,
            Admission::Defer(_)
        ));
        assert_eq!(
            apply(&probing, &Change::TakeProbe, "y", t(62), &c),
            None,
            "one probe at a time"
        );
        assert_eq!(
            apply(&open, &Change::TakeProbe, "y", t(30), &c),
            None,
            "no probe while open"
        );
        // A probe that never reports back is given up: a fresh trial.
        let (_, later) = take(&probing, t(67), &c).expect("a fresh trial");
        assert_eq!(later, ms(t(67)));
    }

    #[test]
    fn a_failure_ratio_over_the_window_trips_it_too() {
        let c = BreakerConfig {
            failure_ratio: Some(0.5),
            ratio_window: 10,
            ..cfg()
        };
        let closed = BreakerRecord::default();
        // Alternating failures never make 3 in a row, but half of the last 10 failed.
        assert_eq!(
            on_result(&closed, false, None, 1, (4, 9), t(0), &c),
            None,
            "window not full"
        );
        assert!(matches!(
            on_result(&closed, false, None, 1, (5, 10), t(0), &c),
            Some(Change::Open(_))
        ));
        assert_eq!(on_result(&closed, false, None, 1, (4, 10), t(0), &c), None);
        assert_eq!(
            on_result(&closed, false, None, 1, (9, 10), t(0), &cfg()),
            None,
            "off unless configured"
        );
    }

    #[test]
    fn probe_success_closes_failure_reopens_once() {
        let c = cfg();
        let open = open_at_0(&c);
        let (probing, id) = take(&open, t(61), &c).unwrap();
        let judge = |success| on_result(&probing, success, Some(id), 0, (0, 0), t(62), &c).unwrap();
        let closed = apply(&probing, &judge(true), "x", t(62), &c).unwrap();
        assert_eq!(closed.open_until_ms, None);
        let reopened = apply(&probing, &judge(false), "x", t(62), &c).unwrap();
        assert_eq!(
            (reopened.open_until_ms, reopened.opens, reopened.reopens),
            (Some(ms(t(122))), 1, 1)
        );
        assert_eq!(
            reopened.opened_at_ms,
            Some(ms(t(0))),
            "the age counts from the first opening"
        );
    }

    #[test]
    fn a_trial_judges_several_calls_so_one_events_own_failure_does_not_reopen_it() {
        // Resilience4j's defaults: 10 calls, half of them must succeed.
        let c = trial(10, 0.5);
        assert_eq!(c.successes_to_close(), 5);
        let mut r = open_at_0(&c);
        let mut ids = Vec::new();
        for i in 0..10 {
            let (next, id) = take(&r, t(61) + Duration::from_millis(i), &c).expect("a permit");
            r = next;
            ids.push(id);
        }
        assert!(ids.iter().all(|i| *i == ids[0]), "one trial: {ids:?}");
        assert_eq!(take(&r, t(62), &c), None, "ten permits, no more");
        assert!(matches!(
            decide(&r, "y", t(62), &c, 0.0).0,
            Admission::Defer(_)
        ));
        // Four first attempts fail by themselves: still half-open.
        let judge = |r: &BreakerRecord, ok: bool| {
            apply(
                r,
                &Change::Judge {
                    trial: ids[0],
                    success: ok,
                },
                "x",
                t(63),
                &c,
            )
            .unwrap()
        };
        for _ in 0..4 {
            r = judge(&r, false);
        }
        assert!(r.open_until_ms.is_some() && r.trial.is_some(), "{r:?}");
        assert_eq!(r.reopens, 0);
        // Five successes close it.
        for i in 0..5 {
            assert!(r.open_until_ms.is_some(), "closed after {i}");
            r = judge(&r, true);
        }
        assert_eq!((r.open_until_ms, r.trial.clone()), (None, None), "closed");
        assert_eq!(r.opens, 1);
        // A late result of the finished trial changes nothing.
        assert_eq!(
            apply(
                &r,
                &Change::Judge {
                    trial: ids[0],
                    success: false
                },
                "x",
                t(64),
                &c
            ),
            None
        );
    }

    #[test]
    fn a_trial_reopens_once_as_soon_as_the_ratio_cannot_be_reached() {
        let c = trial(10, 0.5);
        let mut r = open_at_0(&c);
        let mut id = 0;
        for _ in 0..10 {
            (r, id) = take(&r, t(61), &c).unwrap();
        }
        for i in 0..6 {
            assert!(r.trial.is_some(), "decided after {i} failures");
            r = apply(
                &r,
                &Change::Judge {
                    trial: id,
                    success: false,
                },
                "x",
                t(62),
                &c,
            )
            .unwrap();
        }
        assert_eq!(
            (r.open_until_ms, r.reopens, r.trial.clone()),
            (Some(ms(t(122))), 1, None),
            "six of ten failed: five successes are out of reach"
        );
        // The other four results arrive after: ignored, the expiry stays.
        assert_eq!(
            apply(
                &r,
                &Change::Judge {
                    trial: id,
                    success: false
                },
                "x",
                t(63),
                &c
            ),
            None
        );
    }

    #[test]
    fn a_trial_out_of_time_is_judged_on_what_reported() {
        let c = trial(10, 0.5);
        let (r, id) = take(&open_at_0(&c), t(61), &c).unwrap();
        let r = apply(
            &r,
            &Change::Judge {
                trial: id,
                success: true,
            },
            "x",
            t(62),
            &c,
        )
        .unwrap();
        assert!(r.open_until_ms.is_some(), "one success of five needed");
        // Light traffic: nothing more came within the trial's time. The next call concludes
        // the trial on its one success and is let through on a closed breaker.
        let late = t(61) + Duration::from_millis(c.probe_timeout_ms);
        let (a, ch) = decide(&r, "y", late, &c, 0.0);
        assert_eq!(ch, Some(Change::Conclude { trial: id }));
        assert_eq!(a, Admission::Defer(late));
        let closed = apply(&r, &ch.unwrap(), "y", late, &c).unwrap();
        assert_eq!(closed.open_until_ms, None);
        assert_eq!(decide(&closed, "y", late, &c, 0.0).0, Admission::Allow);
        // No result at all: a fresh trial, the breaker still half-open.
        let (silent, _) = take(&open_at_0(&c), t(61), &c).unwrap();
        let (a, _) = decide(&silent, "y", late, &c, 0.0);
        assert_eq!(a, Admission::Probe { trial: ms(late) });
    }

    #[test]
    fn waiting_says_why_until_deferred_work_is_back() {
        let c = trial(10, 0.5);
        assert_eq!(waiting(&BreakerRecord::default(), t(0), &c), None, "closed");
        let open = open_at_0(&c);
        assert!(waiting(&open, t(30), &c).is_some_and(|w| w.starts_with("open since")));
        // Half-open, deferred work still coming back (expiry + spread + trial time).
        assert!(waiting(&open, t(61), &c).is_some_and(|w| w.contains("half-open")));
        let (probing, _) = take(&open, t(70), &c).unwrap();
        assert!(waiting(&probing, t(71), &c).is_some_and(|w| w.contains("judging 1 of 10")));
        // Long after, with no trial under way: nothing waits on it.
        assert_eq!(waiting(&open, t(60 + 10 + 5 + 1), &c), None);
    }

    #[test]
    fn config_names_the_key_of_a_bad_trial() {
        assert_eq!(BreakerConfig::default().validate(), Ok(()));
        assert_eq!(
            trial(0, 0.5).validate().unwrap_err().key(),
            "breaker.half_open_calls"
        );
        for bad in [0.0, -1.0, 1.5, f64::NAN] {
            assert_eq!(
                trial(10, bad).validate().unwrap_err().key(),
                "breaker.half_open_success_ratio"
            );
        }
        assert_eq!(trial(1, 0.01).successes_to_close(), 1);
        assert_eq!(trial(10, 1.0).successes_to_close(), 10);
        assert_eq!(trial(10, 0.55).successes_to_close(), 6);
    }

    fn shared(brink_hold_ms: u64) -> Arc<Shared> {
        Arc::new(Shared::new(
            Arc::new(crate::azure::memory::MemoryRecordStore::new()),
            "api",
            "replica-a",
            BreakerConfig {
                brink_hold_ms,
                ..cfg()
            },
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_event_at_the_brink_waits_for_a_success_then_goes_on() {
        let b = shared(10_000);
        // Two of three failures: the next new event could trip the breaker.
        for _ in 0..2 {
            assert_eq!(b.admit_new(0.0).await, Admission::Allow);
            b.report_new(false, None).await;
        }
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.admit_new(0.0).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "held at the brink");
        // A due retry (not a new event) succeeds: the downstream serves; it goes on at once.
        assert_eq!(b.admit(0.0).await, Admission::Allow);
        b.report(true, None).await;
        assert_eq!(waiting.await.unwrap(), Admission::Allow);
        assert_eq!(b.cached().unwrap_or_default().opens, 0, "never opened");
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_lets_only_as_many_held_new_events_go_as_cannot_trip_the_breaker() {
        // Several new events wait at the brink at once (partitions, `max_in_flight` > 1).
        let b = shared(10_000);
        for _ in 0..2 {
            b.admit_new(0.0).await;
            b.report_new(false, None).await;
        }
        let waiting: Vec<_> = (0..4)
            .map(|_| {
                let b = b.clone();
                tokio::spawn(async move { b.admit_new(0.0).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(waiting.iter().all(|w| !w.is_finished()), "all held");
        // A due retry succeeds: one more failure in a row is two away, so two go, not four.
        assert_eq!(b.admit(0.0).await, Admission::Allow);
        b.report(true, None).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let gone = waiting.iter().filter(|w| w.is_finished()).count();
        assert_eq!(gone, 2, "as many as cannot make three failures in a row");
        // Those two are refused (each new key once): the breaker has not opened, and the
        // others still wait for a success.
        for _ in 0..2 {
            b.report_new(false, None).await;
        }
        assert_eq!(b.cached().unwrap_or_default().opens, 0, "never opened");
        assert_eq!(waiting.iter().filter(|w| w.is_finished()).count(), 2);
        // Another success: the other two go.
        b.admit(0.0).await;
        b.report(true, None).await;
        for w in waiting {
            assert_eq!(w.await.unwrap(), Admission::Allow);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_event_at_the_brink_goes_on_after_the_hold_and_a_down_downstream_still_trips() {
        let b = shared(10_000);
        for _ in 0..2 {
            b.admit_new(0.0).await;
            b.report_new(false, None).await;
        }
        let started = tokio::time::Instant::now();
        assert_eq!(b.admit_new(0.0).await, Admission::Allow);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(10),
            "held for brink_hold_ms"
        );
        let r = b.report_new(false, None).await.expect("opened");
        assert_eq!(r.opens, 1);
        assert!(matches!(b.admit_new(0.0).await, Admission::Defer(_)));
        // Two new events in flight count as failures to come: the third waits.
        let b = shared(10_000);
        b.admit_new(0.0).await;
        b.report_new(false, None).await;
        assert_eq!(b.admit_new(0.0).await, Admission::Allow);
        let third = tokio::spawn({
            let b = b.clone();
            async move { b.admit_new(0.0).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !third.is_finished(),
            "one failure and one call in flight: at the brink"
        );
        b.report_new(true, None).await;
        assert_eq!(third.await.unwrap(), Admission::Allow);
        // Off: never waits.
        let b = shared(0);
        for _ in 0..2 {
            b.admit_new(0.0).await;
            b.report_new(false, None).await;
        }
        let started = tokio::time::Instant::now();
        b.admit_new(0.0).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_together_never_admit_more_than_the_trials_permits() {
        let store: Arc<dyn RecordStore> = Arc::new(crate::azure::memory::MemoryRecordStore::new());
        let c = trial(10, 0.5);
        // Open since long ago, expired: half-open, no trial yet.
        let open = BreakerRecord {
            open_until_ms: Some(ms(SystemTime::now()) - 1000),
            opened_at_ms: Some(ms(SystemTime::now()) - 60_000),
            opens: 1,
            ..Default::default()
        };
        store
            .create(
                &record_name("api"),
                serde_json::to_vec(&open).unwrap().into(),
            )
            .await
            .unwrap();
        let replicas: Vec<Arc<Shared>> = ["a", "b", "c"]
            .into_iter()
            .map(|who| Arc::new(Shared::new(store.clone(), "api", who, c.clone())))
            .collect();
        let asks: Vec<_> = (0..90)
            .map(|i| {
                let r = replicas[i % 3].clone();
                tokio::spawn(async move { r.admit(0.5).await })
            })
            .collect();
        let mut probes = 0;
        for a in asks {
            match a.await.unwrap() {
                Admission::Probe { .. } => probes += 1,
                Admission::Defer(_) => {}
                Admission::Allow => panic!("allowed on a half-open breaker"),
            }
        }
        assert_eq!(probes, 10, "exactly the trial's permits, cluster-wide");
        let r = read(store.as_ref(), "api").await.unwrap().unwrap();
        assert_eq!(r.trial.map(|t| t.admitted), Some(10));
    }

    /// What every caller of the model does to the record, in any interleaving.
    #[derive(Debug, Clone)]
    enum Step {
        Advance(u64),
        Ask,
        Report { call: usize, success: bool },
        Fail,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u64..20_000).prop_map(Step::Advance),
            Just(Step::Ask),
            (0usize..64, any::<bool>()).prop_map(|(call, success)| Step::Report { call, success }),
            Just(Step::Fail),
        ]
    }

    fn report(
        r: &mut BreakerRecord,
        trial: Option<i64>,
        success: bool,
        consecutive: &mut u32,
        now: SystemTime,
        c: &BreakerConfig,
    ) {
        *consecutive = if success { 0 } else { *consecutive + 1 };
        if let Some(ch) = on_result(r, success, trial, *consecutive, (0, 0), now, c) {
            if let Some(next) = apply(r, &ch, "x", now, c) {
                *r = next;
            }
        }
    }

    proptest! {
        /// The rules hold whatever the interleaving: never more trial calls than permitted
        /// per trial; opened once from closed; never extended while open; a trial decides
        /// only by its own results.
        #[test]
        fn trials_never_exceed_their_permits_and_the_rules_hold(
            n in 1u32..12,
            ratio in 0.05f64..=1.0,
            steps in proptest::collection::vec(step(), 1..300),
        ) {
            let c = BreakerConfig { half_open_calls: n, half_open_success_ratio: ratio, ..cfg() };
            let mut now = t(0);
            let mut r = BreakerRecord::default();
            let mut calls: Vec<Option<i64>> = Vec::new();
            let mut per_trial: std::collections::BTreeMap<i64, u32> = Default::default();
            let mut consecutive = 0;
            for s in steps {
                let before = r.clone();
                match s {
                    Step::Advance(d) => now += Duration::from_millis(d),
                    Step::Ask => match decide(&r, "x", now, &c, 0.5) {
                        (Admission::Allow, None) => calls.push(None),
                        (Admission::Probe { .. }, Some(ch)) => {
                            if let Some(next) = apply(&r, &ch, "x", now, &c) {
                                let id = next.trial.as_ref().unwrap().since_ms;
                                *per_trial.entry(id).or_default() += 1;
                                prop_assert!(per_trial[&id] <= n, "{} calls in trial {id}", per_trial[&id]);
                                r = next;
                                calls.push(Some(id));
                            }
                        }
                        (Admission::Defer(until), ch) => {
                            prop_assert!(until >= now);
                            if let Some(ch) = ch {
                                if let Some(next) = apply(&r, &ch, "x", now, &c) { r = next; }
                            }
                        }
                        other => prop_assert!(false, "{other:?}"),
                    },
                    Step::Report { call, success } => {
                        if !calls.is_empty() {
                            let trial = calls.remove(call % calls.len());
                            report(&mut r, trial, success, &mut consecutive, now, &c);
                        }
                    }
                    Step::Fail => report(&mut r, None, false, &mut consecutive, now, &c),
                }
                // Never extended while open; opened only from closed.
                if let Some(u) = before.open_until_ms {
                    if now < at(u) {
                        prop_assert_eq!(r.open_until_ms, Some(u), "extended or closed while open");
                    }
                }
                prop_assert!(r.opens <= before.opens + 1);
                if r.opens > before.opens {
                    prop_assert_eq!(before.open_until_ms, None, "opened while not closed");
                }
                if let Some(tr) = &r.trial {
                    prop_assert!(tr.admitted <= n);
                    prop_assert!(tr.successes + tr.failures <= tr.admitted);
                }
            }
        }
    }
}
