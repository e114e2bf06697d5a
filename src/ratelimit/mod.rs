//! One downstream rate limit for the whole deployment (`handler.rate_limit`), adapted from
//! what the receiver says.
//!
//! - **Shared out by owned partitions.** Each replica takes `limit × owned ÷ partitions`,
//!   read from the ownership blobs the processor lists every load-balancing cycle — no
//!   coordinator on the hot path. A partition that leaves a replica leaves its share at once;
//!   one taken from another live owner adds to the taker's share only after two update
//!   intervals, by when the old owner's own listing has shown it gone: the shares never add
//!   up to more than the limit, through any rebalance ([`Shares`]).
//! - **Adapted (AIMD).** A 429, a 503 or a timeout lowers the deployment's rate
//!   multiplicatively (at most once a second, deployment-wide); while the receiver succeeds
//!   the rate climbs back additively — quickly up to just under the rate that failed, slowly
//!   above it — and never above the limit ([`rate_at`], [`decrease`]). The decrease lives in
//!   a blob record beside the breaker's (`ratelimits/{downstream}`), so one replica's 429s
//!   slow every replica: each computes the same rate from the same record.
//! - **Paused by `Retry-After`.** A 429 with `Retry-After` pauses the downstream for every
//!   replica until then (bounded by the event's policy cap), through the same record.
//! - **Paced, not burst** ([`Gcra`]): requests are spaced `1 / rate` apart per replica (at
//!   [`PACING_HEADROOM`] of the rate, for the receiver's jitter), so a one-second window holds
//!   at most `rate + 1` of them.
//!
//! Everything here is pure (times are arguments); [`limiter::Limiter`] keeps the state,
//! the record and the clock.

pub mod limiter;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::clock::{at, ms};

/// The deployment's rate limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimitConfig {
    /// Requests per second for the whole deployment (first deliveries and retries); `None`:
    /// only the webhook's `WebHook-Allowed-Rate`, when it grants one, limits.
    pub per_s: Option<f64>,
    /// Lower the rate on 429, 503 and timeouts, pause on a 429's `Retry-After`.
    pub adaptive: bool,
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        Self {
            per_s: None,
            adaptive: true,
        }
    }
}

impl RateLimitConfig {
    /// A limit of `per_s` requests a second, adaptive.
    pub fn per_second(per_s: f64) -> Self {
        Self {
            per_s: Some(per_s),
            adaptive: true,
        }
    }
}

/// A configured limit that is not a positive, finite number of requests per second.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("must be a positive number of requests per second for the whole deployment, not {0}")]
pub struct BadLimit(pub f64);

/// Checks a configured limit: a positive, finite number of requests per second.
pub fn validate_limit(per_s: f64) -> Result<(), BadLimit> {
    if per_s.is_finite() && per_s > 0.0 {
        Ok(())
    } else {
        Err(BadLimit(per_s))
    }
}

/// How the rate adapts (fixed; chosen for receivers that answer within a second).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptation {
    /// A decrease multiplies the rate by this.
    pub decrease: f64,
    /// Additive increase: this share of the limit per second of success…
    pub increase: f64,
    /// …up to this share of the rate that last failed; above it, `slow` times as fast.
    pub plateau: f64,
    /// The increase factor above the plateau.
    pub slow: f64,
    /// At most one decrease per this, deployment-wide (requests sent before a decrease
    /// still come back throttled for a while).
    pub cooldown: Duration,
    /// The rate never falls below this share of the limit.
    pub floor: f64,
}

impl Default for Adaptation {
    fn default() -> Self {
        Self {
            decrease: 0.5,
            increase: 0.02,
            plateau: 0.9,
            slow: 0.1,
            cooldown: Duration::from_secs(1),
            floor: 0.01,
        }
    }
}

/// Why the rate was lowered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecreaseReason {
    /// The receiver answered 429 Too Many Requests.
    Throttled,
    /// The receiver answered 503 Service Unavailable.
    Unavailable,
    /// The receiver did not answer in time.
    Timeout,
}

impl DecreaseReason {
    /// The reason's label (status API, gauge attribute).
    pub fn label(self) -> &'static str {
        match self {
            Self::Throttled => "throttled_429",
            Self::Unavailable => "unavailable_503",
            Self::Timeout => "timeout",
        }
    }
}

/// What an attempt's answer says about the receiver's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// It took the request.
    Success,
    /// Too much: lower the rate (and pause until `retry_after` when a 429 carried one).
    Slow {
        /// Why.
        reason: DecreaseReason,
        /// The 429's `Retry-After`, already bounded.
        retry_after: Option<Duration>,
    },
    /// Says nothing about capacity (a permanent error, a connection refused, …).
    Neutral,
}

/// The deployment's adapted state, shared by every replica in a blob record.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AdaptedRecord {
    /// The rate set by the last decrease (requests/s, the whole deployment).
    #[serde(default)]
    pub rate_per_s: Option<f64>,
    /// The rate that failed (before the last decrease).
    #[serde(default)]
    pub failed_at_per_s: Option<f64>,
    /// When the last decrease happened (epoch ms).
    #[serde(default)]
    pub decreased_at_ms: Option<i64>,
    /// Why.
    #[serde(default)]
    pub reason: Option<DecreaseReason>,
    /// No request until then (epoch ms): a 429's `Retry-After`.
    #[serde(default)]
    pub paused_until_ms: Option<i64>,
    /// Decreases so far.
    #[serde(default)]
    pub decreases: u64,
}

/// The deployment's rate at `now`: the limit, or since the last decrease an additive climb
/// back towards it — `increase × limit` per second up to `plateau ×` the rate that failed,
/// `slow` times that above — never above `limit`, never below `floor × limit`.
pub fn rate_at(rec: &AdaptedRecord, limit: f64, now: SystemTime, a: &Adaptation) -> f64 {
    let (Some(base), Some(t)) = (rec.rate_per_s, rec.decreased_at_ms) else {
        return limit;
    };
    let floor = limit * a.floor;
    let base = base.clamp(floor, limit);
    let elapsed = now.duration_since(at(t)).unwrap_or_default().as_secs_f64();
    let step = limit * a.increase;
    let plateau = rec
        .failed_at_per_s
        .map_or(limit, |f| f * a.plateau)
        .min(limit);
    let rate = if base >= plateau {
        base + step * a.slow * elapsed
    } else {
        let to_plateau = (plateau - base) / step;
        if elapsed <= to_plateau {
            base + step * elapsed
        } else {
            plateau + step * a.slow * (elapsed - to_plateau)
        }
    };
    rate.clamp(floor, limit)
}

/// The record after a decrease for `reason` at `now`; `None` when another decrease happened
/// within the cooldown (one per cooldown, deployment-wide).
pub fn decrease(
    rec: &AdaptedRecord,
    limit: f64,
    now: SystemTime,
    reason: DecreaseReason,
    a: &Adaptation,
) -> Option<AdaptedRecord> {
    if let Some(t) = rec.decreased_at_ms {
        if now.duration_since(at(t)).unwrap_or_default() < a.cooldown {
            return None;
        }
    }
    let current = rate_at(rec, limit, now, a);
    let mut next = rec.clone();
    next.rate_per_s = Some((current * a.decrease).max(limit * a.floor));
    next.failed_at_per_s = Some(current);
    next.decreased_at_ms = Some(ms(now));
    next.reason = Some(reason);
    next.decreases += 1;
    Some(next)
}

/// The record with the downstream paused until `until`; `None` when it already is, as long.
pub fn pause(rec: &AdaptedRecord, until: SystemTime) -> Option<AdaptedRecord> {
    if rec.paused_until_ms.is_some_and(|p| p >= ms(until)) {
        return None;
    }
    let mut next = rec.clone();
    next.paused_until_ms = Some(ms(until));
    Some(next)
}

/// Requests are paced at this share of the rate: spaced `1 / rate` apart, a one-second
/// window of the sender's clock holds up to `rate + 1`, and the receiver's clock sees each
/// request a little early or late (network and scheduling jitter); the headroom keeps the
/// receiver's own one-second count at the rate.
pub const PACING_HEADROOM: f64 = 0.97;

/// Generic cell rate pacing (GCRA, no burst): each request gets the next slot `1 / rate`
/// after the previous one, so any one-second window holds at most `rate + 1` requests.
#[derive(Debug, Clone, Default)]
pub struct Gcra {
    /// The next free slot.
    tat: Option<Instant>,
}

impl Gcra {
    /// Reserves the next slot at or after `now` for `rate` requests a second: how long to
    /// wait for it.
    pub fn reserve(&mut self, now: Instant, rate: f64) -> Duration {
        let slot = self.tat.map_or(now, |t| t.max(now));
        let interval = Duration::from_secs_f64(1.0 / rate.max(1e-6)).min(Duration::from_secs(3600));
        self.tat = Some(slot + interval);
        slot - now
    }

    /// Forgets reservations (after a rate change: the next request re-reserves).
    pub fn reset(&mut self, now: Instant) {
        if self.tat.is_some_and(|t| t > now) {
            self.tat = Some(now);
        }
    }
}

/// One partition as a listing of the ownership blobs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owned {
    /// The partition.
    pub partition: String,
    /// Its owner, when the claim is live (not expired, owner id not empty).
    pub live_owner: Option<String>,
}

/// This replica's share of the limit: the partitions it owns, from each listing of the
/// ownership blobs. A partition counts at once when it was nobody's (or already this
/// replica's); one taken from another live owner counts only after `delay`, by when that
/// owner's own listing has shown it gone (each replica lists every update interval). A
/// partition no listing or claim has confirmed for `fresh` (the ownership expiration) stops
/// counting: by then other replicas see the claim expired and may take it.
#[derive(Debug, Clone)]
pub struct Shares {
    me: String,
    delay: Duration,
    fresh: Duration,
    /// partition → since when it counts for this replica, and when it was last confirmed.
    mine: HashMap<String, (Instant, Instant)>,
    /// The last listing: partition → live owner.
    last: HashMap<String, Option<String>>,
    /// partition → the listing that first showed it no longer another replica's: that
    /// replica lost it by then, and its own listing shows it so within an update interval.
    left_other: HashMap<String, Instant>,
    total: usize,
}

impl Shares {
    /// Shares for replica `me`; takeovers count after `delay`; a partition counts while a
    /// listing or a claim confirmed it within `fresh`.
    pub fn new(me: &str, delay: Duration, fresh: Duration) -> Self {
        Self {
            me: me.into(),
            delay,
            fresh,
            mine: HashMap::new(),
            last: HashMap::new(),
            left_other: HashMap::new(),
            total: 0,
        }
    }

    /// The hub's partition count (from its properties; a listing may name fewer).
    pub fn set_total(&mut self, total: usize) {
        self.total = total;
    }

    fn counts_from(&self, partition: &str, now: Instant) -> Instant {
        match self.last.get(partition) {
            Some(Some(owner)) if *owner != self.me => now + self.delay,
            _ => self
                .left_other
                .get(partition)
                .map_or(now, |left| now.max(*left + self.delay)),
        }
    }

    /// A listing of every ownership blob at `now`.
    pub fn listed(&mut self, now: Instant, owners: &[Owned]) {
        let live: HashSet<&str> = owners
            .iter()
            .filter(|o| o.live_owner.as_deref() == Some(self.me.as_str()))
            .map(|o| o.partition.as_str())
            .collect();
        self.mine.retain(|p, _| live.contains(p.as_str()));
        for p in live {
            match self.mine.get_mut(p) {
                Some((_, confirmed)) => *confirmed = now,
                None => {
                    let from = self.counts_from(p, now);
                    self.mine.insert(p.to_string(), (from, now));
                }
            }
        }
        for o in owners {
            let was_other =
                matches!(self.last.get(&o.partition), Some(Some(owner)) if *owner != self.me);
            let is_other = o
                .live_owner
                .as_deref()
                .is_some_and(|owner| owner != self.me);
            if was_other && !is_other {
                self.left_other.insert(o.partition.clone(), now);
            }
        }
        self.last = owners
            .iter()
            .map(|o| (o.partition.clone(), o.live_owner.clone()))
            .collect();
        self.total = self.total.max(owners.len());
    }

    /// Partitions this replica has just claimed at `now` (before the next listing shows them).
    pub fn claimed(&mut self, now: Instant, partitions: &[String]) {
        for p in partitions {
            match self.mine.get_mut(p) {
                Some((_, confirmed)) => *confirmed = now,
                None => {
                    let from = self.counts_from(p, now);
                    self.mine.insert(p.clone(), (from, now));
                }
            }
        }
    }

    /// Partitions that count for this replica at `now`, and the hub's partition count.
    pub fn owned(&self, now: Instant) -> (usize, usize) {
        let n = self
            .mine
            .values()
            .filter(|(from, confirmed)| *from <= now && now.duration_since(*confirmed) < self.fresh)
            .count();
        (n, self.total.max(n))
    }

    /// This replica's share of the limit at `now` (0 until it owns a partition).
    pub fn share(&self, now: Instant) -> f64 {
        let (n, total) = self.owned(now);
        if total == 0 {
            0.0
        } else {
            n as f64 / total as f64
        }
    }

    /// When the next pending partition starts to count, if one is pending.
    pub fn next_change(&self, now: Instant) -> Option<Instant> {
        self.mine
            .values()
            .map(|(from, _)| *from)
            .filter(|from| *from > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(s: f64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000) + Duration::from_secs_f64(s)
    }

    #[test]
    fn a_limit_must_be_positive() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(validate_limit(bad).is_err(), "{bad}");
        }
        assert!(validate_limit(0.5).is_ok());
    }

    #[test]
    fn a_decrease_halves_once_per_cooldown_and_the_rate_climbs_back_additively() {
        let a = Adaptation::default();
        let fresh = AdaptedRecord::default();
        assert_eq!(rate_at(&fresh, 100.0, t(0.0), &a), 100.0);
        let d = decrease(&fresh, 100.0, t(0.0), DecreaseReason::Throttled, &a).unwrap();
        assert_eq!(d.rate_per_s, Some(50.0));
        assert_eq!(d.reason, Some(DecreaseReason::Throttled));
        assert_eq!(
            decrease(&d, 100.0, t(0.5), DecreaseReason::Timeout, &a),
            None,
            "one decrease per cooldown"
        );
        // Two per second up to 90 (0.9 × the 100 that failed), then a tenth of that.
        assert!((rate_at(&d, 100.0, t(10.0), &a) - 70.0).abs() < 1e-9);
        assert!((rate_at(&d, 100.0, t(20.0), &a) - 90.0).abs() < 1e-9);
        assert!((rate_at(&d, 100.0, t(30.0), &a) - 92.0).abs() < 1e-9);
        assert_eq!(
            rate_at(&d, 100.0, t(1e6), &a),
            100.0,
            "never above the limit"
        );
        let d2 = decrease(&d, 100.0, t(10.0), DecreaseReason::Unavailable, &a).unwrap();
        assert!((d2.rate_per_s.unwrap() - 35.0).abs() < 1e-9);
        assert_eq!(d2.decreases, 2);
    }

    #[test]
    fn a_pause_only_lengthens() {
        let r = pause(&AdaptedRecord::default(), t(5.0)).unwrap();
        assert_eq!(pause(&r, t(3.0)), None);
        assert_eq!(pause(&r, t(7.0)).unwrap().paused_until_ms, Some(ms(t(7.0))));
    }

    #[tokio::test(start_paused = true)]
    async fn pacing_spaces_requests_by_the_rate() {
        let mut g = Gcra::default();
        let t0 = Instant::now();
        assert_eq!(g.reserve(t0, 4.0), Duration::ZERO);
        assert_eq!(g.reserve(t0, 4.0), Duration::from_millis(250));
        assert_eq!(g.reserve(t0, 4.0), Duration::from_millis(500));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            g.reserve(Instant::now(), 4.0),
            Duration::ZERO,
            "no burst saved up"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn shares_follow_ownership_and_takeovers_wait_for_the_old_owner() {
        let owned = |v: &[(&str, Option<&str>)]| -> Vec<Owned> {
            v.iter()
                .map(|(p, o)| Owned {
                    partition: p.to_string(),
                    live_owner: o.map(str::to_string),
                })
                .collect()
        };
        let delay = Duration::from_secs(2);
        let mut b = Shares::new("b", delay, Duration::from_secs(10));
        b.set_total(4);
        let now = Instant::now();
        assert_eq!(b.share(now), 0.0);
        // b claims two of a's partitions and one nobody held.
        b.listed(
            now,
            &owned(&[
                ("0", Some("a")),
                ("1", Some("a")),
                ("2", None),
                ("3", Some("a")),
            ]),
        );
        b.claimed(now, &["0".into(), "1".into(), "2".into()]);
        assert_eq!(b.owned(now), (1, 4), "the unowned one counts at once");
        assert_eq!(b.next_change(now), Some(now + delay));
        assert_eq!(b.owned(now + delay), (3, 4));
        // Lost one: it stops counting at once.
        b.listed(
            now + delay,
            &owned(&[
                ("0", Some("b")),
                ("1", Some("c")),
                ("2", Some("b")),
                ("3", Some("a")),
            ]),
        );
        assert_eq!(b.owned(now + delay), (2, 4));
        // Nothing confirms them (blob storage unreachable): they stop counting at expiry.
        assert_eq!(b.owned(now + delay + Duration::from_secs(10)), (0, 4));
    }

    proptest! {
        #[test]
        fn the_adapted_rate_stays_within_floor_and_limit(
            limit in 0.1f64..10_000.0,
            events in proptest::collection::vec((0u32..3, 0.0f64..5.0), 0..40),
            probe in 0.0f64..1000.0,
        ) {
            let a = Adaptation::default();
            let mut rec = AdaptedRecord::default();
            let mut now = 0.0;
            for (kind, gap) in events {
                now += gap;
                let reason = [DecreaseReason::Throttled, DecreaseReason::Unavailable, DecreaseReason::Timeout][kind as usize];
                let before = rate_at(&rec, limit, t(now), &a);
                if let Some(next) = decrease(&rec, limit, t(now), reason, &a) {
                    let after = rate_at(&next, limit, t(now), &a);
                    prop_assert!(after <= before + 1e-9, "a decrease never raises the rate");
                    rec = next;
                }
                let r = rate_at(&rec, limit, t(now + probe), &a);
                prop_assert!(r <= limit + 1e-9 && r >= limit * a.floor - 1e-9, "{r} outside [floor, {limit}]");
                // Monotone climb between decreases.
                prop_assert!(rate_at(&rec, limit, t(now + probe + 1.0), &a) + 1e-9 >= r);
            }
        }

        #[test]
        fn pacing_never_lets_a_second_hold_more_than_rate_plus_one(
            rate in 0.5f64..500.0,
            arrivals in proptest::collection::vec(0u64..2000, 1..300),
        ) {
            // Requests arrive at arbitrary times (ms); each starts at its reserved slot.
            let mut arrivals = arrivals;
            arrivals.sort_unstable();
            let base = std::time::Instant::now();
            let t0 = Instant::from_std(base);
            let mut g = Gcra::default();
            let mut starts: Vec<Duration> = arrivals
                .iter()
                .map(|ms| {
                    let now = t0 + Duration::from_millis(*ms);
                    now + g.reserve(now, rate) - t0
                })
                .collect();
            starts.sort();
            for (i, s) in starts.iter().enumerate() {
                let in_window = starts[i..].iter().take_while(|x| **x < *s + Duration::from_secs(1)).count();
                prop_assert!(in_window as f64 <= rate + 1.0, "{in_window} in one second at {rate}/s");
            }
        }

        #[test]
        fn shares_of_replicas_never_add_up_to_more_than_the_whole(
            // Each step: which partition moves to which replica (or is dropped), then which
            // replicas list.
            steps in proptest::collection::vec((0usize..6, 0usize..4, proptest::collection::vec(any::<bool>(), 3)), 1..60),
        ) {
            let names = ["r0", "r1", "r2"];
            let delay = Duration::from_millis(2000);
            let interval = Duration::from_millis(1000); // every replica lists at least this often
            let mut shares: Vec<Shares> = names.iter().map(|n| { let mut s = Shares::new(n, delay, Duration::from_secs(3600)); s.set_total(6); s }).collect();
            let mut owner: Vec<Option<usize>> = vec![None; 6];
            let mut listed_at = [Duration::ZERO; 3];
            let start = Instant::from_std(std::time::Instant::now());
            let mut now = Duration::ZERO;
            let listing = |owner: &Vec<Option<usize>>| -> Vec<Owned> {
                owner.iter().enumerate().map(|(p, o)| Owned { partition: p.to_string(), live_owner: o.map(|r| names[r].to_string()) }).collect()
            };
            for (p, to, lists) in steps {
                now += Duration::from_millis(250);
                // A replica claims partition p (listing first, as the processor does), or p
                // is given back.
                if to < 3 {
                    let l = listing(&owner);
                    shares[to].listed(start + now, &l);
                    listed_at[to] = now;
                    owner[p] = Some(to);
                    shares[to].claimed(start + now, &[p.to_string()]);
                } else if let Some(old) = owner[p].take() {
                    // Given back (or its claim expired, which its owner's own view of it
                    // does too: see `fresh`): the old owner no longer counts it.
                    let l = listing(&owner);
                    shares[old].listed(start + now, &l);
                    listed_at[old] = now;
                }
                let l = listing(&owner);
                for (r, s) in shares.iter_mut().enumerate() {
                    if lists[r] || now - listed_at[r] >= interval {
                        s.listed(start + now, &l);
                        listed_at[r] = now;
                    }
                }
                let sum: f64 = shares.iter().map(|s| s.share(start + now)).sum();
                prop_assert!(sum <= 1.0 + 1e-9, "shares add up to {sum}");
            }
        }
    }
}
