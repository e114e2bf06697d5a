//! How far a service's clock is from this process's, measured from the `Date` of its
//! responses (pure: the caller supplies every reading).
//!
//! A response's `Date` (RFC 9110 §6.6.1: the time the origin server generated the message)
//! was stamped by the service at some moment between this process sending the request and
//! receiving the answer, and carries whole seconds. So one response proves that
//! `service − local` lies in `[date − received, date + 1 s − sent]`, where `local` is this
//! process's monotonic reading. A slow request only widens its interval; a fast one narrows
//! it; the intersection of the recent intervals is what every one of them allows, and it
//! narrows below the `Date`'s one-second resolution as responses land at different
//! fractions of a second. When a new interval is disjoint from what the earlier ones allow,
//! one of the clocks stepped (an NTP step, a VM restored, a service's correction): the
//! earlier samples are dropped and the new one stands alone.
//!
//! Intervals are kept against the monotonic clock, not the wall clock, so a step of this
//! host's wall clock changes nothing measured: service time stays right across it.

use std::collections::VecDeque;

/// The most samples kept.
const WINDOW: usize = 64;
/// Samples older than this (µs of the monotonic clock) are forgotten: the monotonic clock and
/// the service's may drift apart by a few parts per million.
const MAX_AGE_US: i64 = 600_000_000;
/// One second in µs: the resolution of an HTTP date.
const SECOND_US: i64 = 1_000_000;

/// A service whose clock hubguard measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Service {
    /// Azure Service Bus: its clock rules policy time (due times, locks, claims).
    ServiceBus,
    /// Azure Blob Storage: its clock stamps ownership and owner records (`Last-Modified`).
    BlobStorage,
    /// Azure Event Hubs: measured by `hubguard check` from the `Date` of its namespace's
    /// REST answers (its AMQP answers carry no clock); the pipeline does not measure it.
    EventHubs,
}

impl Service {
    /// The two the pipeline measures, in the order they are reported (status, metrics).
    pub const ALL: [Service; 2] = [Service::ServiceBus, Service::BlobStorage];

    /// The name in status, metrics and readiness (`servicebus`, `blob`; `eventhubs`).
    pub fn name(self) -> &'static str {
        match self {
            Service::ServiceBus => "servicebus",
            Service::BlobStorage => "blob",
            Service::EventHubs => "eventhubs",
        }
    }

    pub(super) fn index(self) -> usize {
        match self {
            Service::ServiceBus => 0,
            Service::BlobStorage => 1,
            Service::EventHubs => 2,
        }
    }
}

/// One response: `service − local` lies in `[lo, hi]` (µs), seen at local time `at`.
#[derive(Debug, Clone, Copy)]
struct Sample {
    lo: i64,
    hi: i64,
    at: i64,
}

/// The samples of one service and what they allow together.
#[derive(Debug, Default)]
pub(crate) struct Estimator {
    /// Newest first.
    samples: VecDeque<Sample>,
    /// The intersection of `samples`: `service − local` in µs.
    range: Option<(i64, i64)>,
}

impl Estimator {
    /// A response sent at local `sent` and received at local `received` (µs of the monotonic
    /// clock) whose `Date` says `date_s` seconds since the epoch.
    pub(crate) fn observe(&mut self, sent: i64, received: i64, date_s: i64) {
        if received < sent {
            return;
        }
        let date = date_s.saturating_mul(SECOND_US);
        self.samples.push_front(Sample {
            lo: date - received,
            hi: date + SECOND_US - sent,
            at: received,
        });
        self.samples
            .retain(|s| received.saturating_sub(s.at) <= MAX_AGE_US);
        self.samples.truncate(WINDOW);
        let mut range: Option<(i64, i64)> = None;
        let mut kept = 0;
        for s in &self.samples {
            let next = match range {
                None => (s.lo, s.hi),
                Some((lo, hi)) => (lo.max(s.lo), hi.min(s.hi)),
            };
            if next.0 > next.1 {
                // This sample and everything older disagree with the newer ones: a clock
                // stepped in between.
                break;
            }
            range = Some(next);
            kept += 1;
        }
        self.samples.truncate(kept);
        self.range = range;
    }

    /// What the samples allow for `service − local` (µs), once there is one.
    pub(crate) fn range(&self) -> Option<(i64, i64)> {
        self.range
    }

    /// How many samples stand behind [`range`](Self::range).
    pub(crate) fn samples(&self) -> usize {
        self.samples.len()
    }
}

/// `x` moved into `[lo, hi]` by as little as possible.
pub(crate) fn clamp(x: i64, (lo, hi): (i64, i64)) -> i64 {
    x.max(lo).min(hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A service `offset` µs ahead of the local clock answers a request sent at `sent` after
    /// `rtt` µs, stamping it `stamp` µs after the send.
    fn answer(e: &mut Estimator, offset: i64, sent: i64, rtt: i64, stamp: i64) {
        let service_at_stamp = sent + stamp + offset;
        e.observe(sent, sent + rtt, service_at_stamp.div_euclid(SECOND_US));
    }

    #[test]
    fn one_response_bounds_the_offset_within_a_second_and_its_round_trip() {
        let mut e = Estimator::default();
        assert_eq!(e.range(), None);
        answer(&mut e, -90_000_000, 5_300_000, 20_000, 10_000);
        let (lo, hi) = e.range().unwrap();
        assert!(lo <= -90_000_000 && -90_000_000 <= hi, "{lo}..{hi}");
        assert!(hi - lo <= SECOND_US + 20_000);
    }

    #[test]
    fn responses_at_different_fractions_narrow_it_below_a_second() {
        let mut e = Estimator::default();
        let offset = 600_123_456;
        for i in 0..40 {
            answer(&mut e, offset, i * 1_370_000, 4_000, 2_000);
        }
        let (lo, hi) = e.range().unwrap();
        assert!(lo <= offset && offset <= hi);
        assert!(hi - lo < 100_000, "narrowed to {} µs", hi - lo);
    }

    #[test]
    fn a_slow_response_widens_nothing() {
        let mut e = Estimator::default();
        for i in 0..20 {
            answer(&mut e, 0, i * 1_370_000, 4_000, 2_000);
        }
        let before = e.range().unwrap();
        // 20 s round trip, stamped anywhere in it.
        answer(&mut e, 0, 30_000_000, 20_000_000, 19_000_000);
        assert_eq!(e.range().unwrap(), before);
    }

    #[test]
    fn a_clock_step_drops_what_came_before_it() {
        let mut e = Estimator::default();
        for i in 0..20 {
            answer(&mut e, 0, i * 1_370_000, 4_000, 2_000);
        }
        answer(&mut e, 600_000_000, 40_000_000, 4_000, 2_000);
        let (lo, hi) = e.range().unwrap();
        assert!(lo <= 600_000_000 && 600_000_000 <= hi, "{lo}..{hi}");
        assert_eq!(e.samples(), 1);
    }

    #[test]
    fn old_samples_are_forgotten() {
        let mut e = Estimator::default();
        answer(&mut e, 0, 0, 4_000, 2_000);
        answer(&mut e, 0, MAX_AGE_US + 10_000_000, 4_000, 2_000);
        assert_eq!(e.samples(), 1);
    }

    proptest! {
        /// Honest responses, however slow: the true offset is always allowed, and the range
        /// is never wider than the fastest response's second.
        #[test]
        fn the_true_offset_is_always_in_range(
            offset in -1_000_000_000i64..1_000_000_000,
            reqs in proptest::collection::vec((0i64..3_000_000, 1i64..5_000_000, 0u32..1000), 1..50),
        ) {
            let mut e = Estimator::default();
            let mut t = 0;
            let mut narrowest = i64::MAX;
            for (gap, rtt, frac) in reqs {
                t += gap;
                let stamp = rtt * i64::from(frac) / 1000;
                answer(&mut e, offset, t, rtt, stamp);
                t += rtt;
                narrowest = narrowest.min(rtt + SECOND_US);
                let (lo, hi) = e.range().unwrap();
                prop_assert!(lo <= offset && offset <= hi, "{} not in {}..{}", offset, lo, hi);
            }
            let (lo, hi) = e.range().unwrap();
            prop_assert!(hi - lo <= narrowest);
        }
    }
}
