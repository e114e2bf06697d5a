//! The clock lines of `hubguard check`: how far this host is from Service Bus and from blob
//! storage, measured as the pipeline measures them (the one estimator of
//! [`crate::clock`], fed by the `Date` of every response check's calls got), each held to
//! `status.max_clock_skew_ms` as `/readyz` holds Service Bus's (docs/clocks.md); and Event
//! Hubs's, from the `Date` of its namespace's REST answers, on the same estimator and rule.

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

/// How many answers Event Hubs's line reads (each narrows the interval the others allow).
const EVENTHUBS_SAMPLES: usize = 4;

/// Where check reads Event Hubs's clock: `GET {endpoint}{hub}?api-version=2014-01` ("Get
/// Event Hub"), with `endpoint` `eventhubs.rest_endpoint` or, unset, the namespace's HTTPS
/// endpoint (`https://{namespace host}/`, port 443, as Azure serves it).
pub(super) fn eventhubs_rest_url(
    rest_endpoint: Option<&str>,
    namespace: &str,
    hub: &str,
) -> Result<url::Url, String> {
    let base = match rest_endpoint {
        Some(e) => e.to_string(),
        None => {
            let host = namespace
                .split_once("://")
                .map_or(namespace, |(_, rest)| rest)
                .split(['/', ':'])
                .next()
                .unwrap_or_default();
            format!("https://{host}/")
        }
    };
    let base = url::Url::parse(&base).map_err(|e| format!("{base:?}: {e}"))?;
    let mut url = base.join(hub).map_err(|e| e.to_string())?;
    url.set_query(Some("api-version=2014-01"));
    Ok(url)
}

/// Event Hubs's clock, measured both ways as Service Bus's and blob storage's are: its
/// namespace answers REST on the same host as AMQP, and every answer carries a `Date`, even
/// the 401 a request without a token gets (so no permission is needed, and none is sent).
/// Each answer is timed on `clock` (the pipeline's estimator, under
/// [`Service::EventHubs`](crate::clock::Service::EventHubs)) and the offset held to `bound`
/// with the same rule and fix as the other lines. `emulator`: the connection string names
/// an emulator (whose REST endpoint cannot be derived: the fix names the key).
pub(super) async fn eventhubs_clock_line(
    url: Result<url::Url, String>,
    emulator: bool,
    clock: &Clock,
    deadline: Duration,
    bound: Duration,
) -> CheckLine {
    let what = "clock offset to Event Hubs";
    let reach = if emulator {
        "set eventhubs.rest_endpoint to the emulator's REST URL (`hubguard emulator` prints it as eventhubs-rest:)".to_string()
    } else {
        "make the namespace's HTTPS endpoint reachable from this host (port 443: DNS, firewall, private endpoint), or set eventhubs.rest_endpoint".to_string()
    };
    let url = match url {
        Ok(u) => u,
        Err(e) => {
            return CheckLine::fail(
                what,
                format!("could not measure: no REST endpoint ({e})"),
                reach,
            )
        }
    };
    let client = match reqwest::Client::builder().timeout(deadline).build() {
        Ok(c) => c,
        Err(e) => return CheckLine::fail(what, format!("could not measure: {e}"), reach),
    };
    let mut statuses = Vec::new();
    let mut problem = None;
    for _ in 0..EVENTHUBS_SAMPLES {
        let sent = clock.sent();
        match client.get(url.clone()).send().await {
            Ok(r) => {
                statuses.push(r.status().as_u16());
                match r.headers().get("date").and_then(|d| d.to_str().ok()) {
                    Some(date) => clock.observe(crate::clock::Service::EventHubs, sent, date),
                    None => problem = Some(format!("{} answered without a Date", r.status())),
                }
            }
            Err(e) => {
                problem = Some(crate::redact::redact_owned(error_chain(&e)));
                break;
            }
        }
    }
    let o = crate::pipeline::health::clock_offset(clock, crate::clock::Service::EventHubs, bound);
    let url = crate::redact::redact(url.as_str());
    let (Some(offset), Some(within)) = (o.offset_ms, o.within_ms) else {
        return CheckLine::fail(
            what,
            format!(
                "could not measure: GET {url}: {}",
                problem.unwrap_or_else(|| "no answer carried a Date".into())
            ),
            reach,
        );
    };
    statuses.dedup();
    let statuses: Vec<String> = statuses.iter().map(u16::to_string).collect();
    let detail = format!(
        "{offset:+} ms (± {within} ms, from {} answers of GET {url}, status {}; bound {} ms, status.max_clock_skew_ms)",
        o.samples,
        statuses.join("/"),
        bound.as_millis()
    );
    if o.beyond_bound {
        CheckLine::fail(what, detail, FIX)
    } else {
        CheckLine::pass(what, detail)
    }
}

/// An error with its causes (reqwest's own message hides the connection's).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
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
    fn event_hubs_is_read_at_the_namespace_host_or_the_configured_endpoint() {
        let url = |e, ns| eventhubs_rest_url(e, ns, "hub").unwrap().to_string();
        assert_eq!(
            url(None, "myns.servicebus.windows.net"),
            "https://myns.servicebus.windows.net/hub?api-version=2014-01"
        );
        assert_eq!(
            url(None, "sb://myns.servicebus.windows.net:5671/"),
            "https://myns.servicebus.windows.net/hub?api-version=2014-01"
        );
        assert_eq!(
            url(Some("http://127.0.0.1:5673/"), "127.0.0.1:5672"),
            "http://127.0.0.1:5673/hub?api-version=2014-01"
        );
        assert!(eventhubs_rest_url(Some("not a url"), "ns", "hub").is_err());
    }
}
