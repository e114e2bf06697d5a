//! The clock lines of `hubguard check`: how far this host is from Service Bus and from blob
//! storage, measured as the pipeline measures them (the one estimator of
//! [`crate::clock`], fed by the `Date` of every response check's calls got), each held to
//! `status.max_clock_skew_ms` as `/readyz` holds Service Bus's (docs/clocks.md).

use std::time::Duration;

use super::CheckLine;
use crate::clock::Clock;

/// What to do about a clock beyond the bound.
const FIX: &str = "synchronise this host's clock (chrony or systemd-timesyncd with time.windows.com or your NTP source; Azure VMs and AKS nodes sync with their host by default); hubguard runs on the services' time either way, but /readyz reports the skew while it lasts (docs/clocks.md)";

/// One line per service the pipeline measures (Service Bus first, then blob storage).
pub(super) fn clock_lines(clock: &Clock, bound: Duration) -> Vec<CheckLine> {
    crate::pipeline::health::clock_offsets(clock, bound)
        .into_iter()
        .map(|o| {
            let service = match o.service {
                "servicebus" => "Service Bus",
                _ => "blob storage",
            };
            let what = format!("clock offset to {service}");
            let (Some(offset), Some(within)) = (o.offset_ms, o.within_ms) else {
                return CheckLine::fail(
                    &what,
                    "not measured: no answer carried a Date",
                    format!("make {service} reachable first (see its lines above)"),
                );
            };
            let detail = format!(
                "{offset:+} ms (± {within} ms, from {} responses; bound {} ms, status.max_clock_skew_ms)",
                o.samples,
                bound.as_millis()
            );
            if o.beyond_bound {
                CheckLine::fail(&what, detail, FIX)
            } else {
                CheckLine::pass(&what, detail)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{http_date, Service};
    use std::time::SystemTime;

    #[test]
    fn each_service_is_held_to_the_bound() {
        let clock = Clock::default();
        let lines = clock_lines(&clock, Duration::from_secs(30));
        assert_eq!(lines.len(), 2);
        assert!(lines.iter().all(|l| !l.passed && l.detail.contains("not measured")));
        for _ in 0..3 {
            let sent = clock.sent();
            clock.observe(Service::ServiceBus, sent, &http_date(SystemTime::now() + Duration::from_secs(90)));
            let sent = clock.sent();
            clock.observe(Service::BlobStorage, sent, &http_date(SystemTime::now()));
        }
        let lines = clock_lines(&clock, Duration::from_secs(30));
        assert!(!lines[0].passed, "{}", lines[0]);
        assert!(lines[0].what.contains("Service Bus") && lines[0].fix.as_deref().unwrap().contains("chrony"));
        assert!(lines[1].passed, "{}", lines[1]);
        assert!(lines[1].detail.contains("bound 30000 ms"), "{}", lines[1]);
    }
}
