//! One downstream rate limit for the whole deployment (`handler.rate_limit`), adapted from
//! what the receiver says.
//!
//! - **Shared out by demand** ([`demand`]). Each replica paces at `rate × share`, and the
//!   shares follow what the replicas can use, not the partitions they own: every replica
//!   publishes its demand (a backlog, or the part of the rate it used lately) and its share
//!   in one compare-and-swap record (`ratelimit-shares/{downstream}`), read and written on a
//!   background tick — no coordinator on the hot path. A share goes down at once and up only
//!   into what the others' committed shares leave free, so the shares never add up to more
//!   than the whole, through any join, leave or change of demand; a replica that stops
//!   renewing its entry (killed, frozen, cut off from storage) stops pacing before the
//!   others take its share.
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

pub mod demand;
pub mod limiter;

use std::collections::VecDeque;
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
/// after the previous one, so any one-second window holds at most `rate + 1` requests — also
/// across a [`reset`](Gcra::reset) (the rate changed: the slots not yet reached are given up
/// and asked for again), since the next slot is still spaced from the last one reached.
#[derive(Debug, Clone, Default)]
pub struct Gcra {
    /// The next free slot (`None` after a reset).
    tat: Option<Instant>,
    /// The latest slot reached.
    reached: Option<Instant>,
    /// Slots reserved and not yet reached (one per waiting request).
    ahead: VecDeque<Instant>,
}

impl Gcra {
    fn reach(&mut self, now: Instant) {
        while self.ahead.front().is_some_and(|s| *s <= now) {
            self.reached = self.ahead.pop_front();
        }
    }

    /// Reserves the next slot at or after `now` for `rate` requests a second: how long to
    /// wait for it.
    pub fn reserve(&mut self, now: Instant, rate: f64) -> Duration {
        self.reach(now);
        let interval = Duration::from_secs_f64(1.0 / rate.max(1e-6)).min(Duration::from_secs(3600));
        let slot = match (self.tat, self.reached) {
            (Some(t), _) => t.max(now),
            (None, Some(r)) => (r + interval).max(now),
            (None, None) => now,
        };
        self.tat = Some(slot + interval);
        self.ahead.push_back(slot);
        slot - now
    }

    /// Gives up the slots not reached by `now` (after a rate change: their requests reserve
    /// again, at the new rate, spaced from the last slot reached).
    pub fn reset(&mut self, now: Instant) {
        self.reach(now);
        self.ahead.clear();
        self.tat = None;
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
        fn a_reset_and_a_new_rate_never_let_a_second_hold_more_than_the_higher_rate_plus_one(
            steps in proptest::collection::vec((0u64..400, 0u8..4, 1.0f64..100.0), 1..300),
        ) {
            // Each step: time passes, then a request reserves (and takes its slot unless a
            // reset comes first: then it reserves again), or the rate changes with a reset.
            let t0 = Instant::from_std(std::time::Instant::now());
            let mut now = t0;
            let mut g = Gcra::default();
            let mut rate = 50.0f64;
            let mut top = rate;
            let mut waiting: Vec<Instant> = Vec::new();
            let mut starts: Vec<Instant> = Vec::new();
            for (gap, what, r) in steps {
                now += Duration::from_millis(gap);
                starts.extend(waiting.iter().filter(|s| **s <= now));
                waiting.retain(|s| *s > now);
                let gave_up = waiting.len();
                if what == 0 {
                    rate = r;
                    top = top.max(rate);
                    g.reset(now);
                    // Those still waiting reserve again.
                    waiting = (0..gave_up).map(|_| now + g.reserve(now, rate)).collect();
                } else {
                    waiting.push(now + g.reserve(now, rate));
                }
            }
            starts.extend(waiting);
            starts.sort();
            for (i, s) in starts.iter().enumerate() {
                let in_window = starts[i..].iter().take_while(|x| **x < *s + Duration::from_secs(1)).count();
                prop_assert!(in_window as f64 <= top + 1.0, "{in_window} in one second, at most {top}/s");
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
    }
}
