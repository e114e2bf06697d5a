//! The clock lines of `hubguard check`: how far this host is from Service Bus and from blob
//! storage, measured as the pipeline measures them (the one estimator of
//! [`crate::clock`], fed by the `Date` of every response check's calls got), each held to
//! `status.max_clock_skew_ms` as `/readyz` holds Service Bus's (docs/clocks.md); and Event
//! Hubs's, bounded from one side by the enqueued times it stamped.

use std::time::{Duration, SystemTime};

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

/// The least this host is behind Event Hubs, in ms, from `(enqueued, read)` pairs: an
/// event's enqueued time was stamped by Event Hubs before this host read it at `read`, so
/// Event Hubs's time minus this host's is at least `enqueued − read`. `None` without events.
pub(super) fn least_behind_ms(readings: &[(SystemTime, SystemTime)]) -> Option<i64> {
    readings
        .iter()
        .map(|(enqueued, read)| crate::clock::ms(*enqueued) - crate::clock::ms(*read))
        .max()
}

/// Event Hubs's clock, bounded from the one side its AMQP answers allow: they carry no
/// reading of its clock (no `Date`), only the enqueued time of the last event in each
/// partition, which Event Hubs stamped in the past. An event enqueued in this host's future
/// proves the host behind by at least that much; a host ahead of Event Hubs cannot show here
/// (Service Bus's line measures both ways). Reads each partition's properties (no event
/// is received).
pub(super) async fn eventhubs_clock_line(
    consumer: &azure_messaging_eventhubs::ConsumerClient,
    partitions: &[String],
    deadline: Duration,
    bound: Duration,
) -> CheckLine {
    let what = "clock offset to Event Hubs";
    let mut readings = Vec::new();
    for p in partitions {
        let props = tokio::time::timeout(deadline, consumer.get_partition_properties(p)).await;
        let read = SystemTime::now();
        if let Ok(Ok(props)) = props {
            if let Some(enqueued) = props.last_enqueued_time_utc.filter(|_| !props.is_empty) {
                readings.push((enqueued, read));
            }
        }
    }
    let Some(behind) = least_behind_ms(&readings) else {
        return CheckLine::pass(
            what,
            "nothing to measure: no partition holds an event (Event Hubs's AMQP answers carry no clock reading)",
        );
    };
    if u128::from(behind.max(0).unsigned_abs()) > bound.as_millis() {
        return CheckLine::fail(
            what,
            format!(
                "this host is at least {behind} ms behind Event Hubs: an event was enqueued that far in its future (bound {} ms, status.max_clock_skew_ms)",
                bound.as_millis()
            ),
            FIX,
        );
    }
    CheckLine::pass(
        what,
        format!(
            "no event enqueued in this host's future beyond the bound (the latest of {} partitions {:+} ms from its read; bound {} ms); one-sided: Event Hubs's AMQP answers carry no clock reading, so a host ahead of it shows only in Service Bus's line",
            readings.len(),
            behind,
            bound.as_millis()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{http_date, Service};

    #[test]
    fn each_service_is_held_to_the_bound() {
        let clock = Clock::default();
        let lines = clock_lines(&clock, Duration::from_secs(30));
        assert_eq!(lines.len(), 2);
        assert!(lines
            .iter()
            .all(|l| !l.passed && l.detail.contains("not measured")));
        for _ in 0..3 {
            let sent = clock.sent();
            clock.observe(
                Service::ServiceBus,
                sent,
                &http_date(SystemTime::now() + Duration::from_secs(90)),
            );
            let sent = clock.sent();
            clock.observe(Service::BlobStorage, sent, &http_date(SystemTime::now()));
        }
        let lines = clock_lines(&clock, Duration::from_secs(30));
        assert!(!lines[0].passed, "{}", lines[0]);
        assert!(
            lines[0].what.contains("Service Bus")
                && lines[0].fix.as_deref().unwrap().contains("chrony")
        );
        assert!(lines[1].passed, "{}", lines[1]);
        assert!(lines[1].detail.contains("bound 30000 ms"), "{}", lines[1]);
    }

    #[test]
    fn an_event_enqueued_in_the_future_bounds_how_far_behind_this_host_is() {
        let t = crate::clock::at;
        assert_eq!(least_behind_ms(&[]), None);
        // Enqueued 5 s before the read, and another 70 s after it: at least 70 s behind.
        let readings = [(t(95_000), t(100_000)), (t(170_000), t(100_000))];
        assert_eq!(least_behind_ms(&readings), Some(70_000));
        assert_eq!(least_behind_ms(&readings[..1]), Some(-5_000));
    }
}
