//! This host's clock against the services': the offsets the status API reports, and the
//! readiness reason when the host is further from Service Bus than the bound.
//!
//! hubguard corrects for the offset either way (policy time is Service Bus's, ownership times
//! are translated with blob storage's: [`crate::clock`]); the reason is there because a host
//! that far off has lost its time synchronisation, which other software on it (and hubguard's
//! correction, should the services stop answering) depends on. docs/clocks.md.

use std::time::Duration;

use serde::Serialize;

use crate::clock::{Clock, Service};

/// One service's clock as this replica measures it (`/v1/status`: `clocks`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClockOffset {
    /// `servicebus` or `blob`.
    pub service: &'static str,
    /// The service's time minus this host's, in ms (`null` before any response).
    pub offset_ms: Option<i64>,
    /// How far the true offset may be from `offset_ms`, in ms.
    pub within_ms: Option<i64>,
    /// How many responses it rests on.
    pub samples: usize,
    /// Whether it is beyond the bound (`status.max_clock_skew_ms`); only Service Bus's is a
    /// readiness reason (see [`reason`]).
    pub beyond_bound: bool,
}

/// Both services' offsets, Service Bus's first.
pub(crate) fn offsets(clock: &Clock, bound: Duration) -> Vec<ClockOffset> {
    Service::ALL
        .iter()
        .map(|&service| offset(clock, service, bound))
        .collect()
}

/// One service's offset, held to `bound` (`hubguard check` holds Event Hubs's so too).
pub(crate) fn offset(clock: &Clock, service: Service, bound: Duration) -> ClockOffset {
    let skew = clock.skew(service);
    ClockOffset {
        service: service.name(),
        offset_ms: skew.map(|s| s.offset_ms),
        within_ms: skew.map(|s| s.within_ms),
        samples: skew.map_or(0, |s| s.samples),
        beyond_bound: skew.is_some_and(|s| beyond(s.offset_ms, bound)),
    }
}

fn beyond(offset_ms: i64, bound: Duration) -> bool {
    u128::from(offset_ms.unsigned_abs()) > bound.as_millis()
}

/// The readiness reason, if this host's clock is further from Service Bus's (the clock policy
/// time follows) than `bound`. Blob storage's offset is reported but not a reason: its times
/// are translated with its own offset, and the two services disagreeing is not this host's
/// fault.
pub(super) fn reason(clock: &Clock, bound: Duration) -> Option<String> {
    let s = clock.skew(Service::ServiceBus)?;
    if !beyond(s.offset_ms, bound) {
        return None;
    }
    let secs = s.offset_ms.unsigned_abs() as f64 / 1000.0;
    let way = if s.offset_ms > 0 {
        "behind"
    } else {
        "ahead of"
    };
    Some(format!(
        "clock skew: this host's clock is {secs:.1} s {way} Service Bus's (measured from {} responses, ± {:.1} s; bound {} s, status.max_clock_skew_ms): hubguard runs on Service Bus's time, but fix this host's time synchronisation (docs/clocks.md)",
        s.samples,
        s.within_ms as f64 / 1000.0,
        bound.as_secs()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::http_date;

    /// A clock that has heard from Service Bus `responses` times, Service Bus being `ahead_s`
    /// seconds ahead of the host.
    fn clock_hearing(ahead_s: i64, responses: usize) -> Clock {
        let c = Clock::default();
        for _ in 0..responses {
            let sent = c.sent();
            let service = c.host_now() + Duration::from_secs(600);
            let service = service - Duration::from_secs((600 - ahead_s) as u64);
            c.observe(Service::ServiceBus, sent, &http_date(service));
        }
        c
    }

    #[test]
    fn a_host_ninety_seconds_behind_is_named_with_its_offset() {
        let c = clock_hearing(90, 3);
        let r = reason(&c, Duration::from_secs(30)).unwrap();
        assert!(r.contains("clock skew"), "{r}");
        assert!(r.contains("s behind Service Bus's"), "{r}");
        assert!(r.contains("89.") || r.contains("90."), "{r}");
        let o = offsets(&c, Duration::from_secs(30));
        assert_eq!(o[0].service, "servicebus");
        assert!(o[0].beyond_bound);
        assert_eq!((o[1].service, o[1].offset_ms), ("blob", None));
    }

    #[test]
    fn a_host_within_the_bound_or_unmeasured_is_no_reason() {
        assert_eq!(reason(&Clock::default(), Duration::from_secs(30)), None);
        let c = clock_hearing(0, 3);
        assert_eq!(reason(&c, Duration::from_secs(30)), None);
        let c = clock_hearing(-20, 3);
        assert_eq!(reason(&c, Duration::from_secs(30)), None);
        let c = clock_hearing(-40, 3);
        assert!(reason(&c, Duration::from_secs(30))
            .unwrap()
            .contains("s ahead of Service Bus's"));
    }
}
