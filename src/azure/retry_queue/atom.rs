//! The management API's Atom entries and the ISO 8601 durations in them.

use std::time::Duration;

/// What hubguard reads of a queue's `QueueDescription` (the management REST API; the
/// element names are the service's, as the official SDKs' administration clients read them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDescription {
    /// `RequiresDuplicateDetection`.
    pub requires_duplicate_detection: bool,
    /// `DuplicateDetectionHistoryTimeWindow` (an ISO 8601 duration on the wire).
    pub duplicate_detection_history_time_window: Option<Duration>,
    /// `LockDuration`.
    pub lock_duration: Option<Duration>,
    /// `MaxDeliveryCount`.
    pub max_delivery_count: Option<u32>,
    /// `MaxMessageSizeInKilobytes` (absent on older API versions and some tiers).
    pub max_message_size_in_kilobytes: Option<u32>,
}

/// Why a queue description could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptionError {
    /// The document is neither an Atom entry nor a feed.
    #[error("neither an Atom entry nor a feed")]
    NotAtom,
    /// An element holds a value of the wrong form.
    #[error("{element} `{value}` is not {expected}")]
    Value {
        /// The element's name.
        element: String,
        /// Its text.
        value: String,
        /// The form expected.
        expected: &'static str,
    },
}

/// The text of the first element whose local name (without a namespace prefix) is `name`.
pub(super) fn element_text<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = xml;
    while let Some(open) = rest.find('<') {
        let after = &rest[open + 1..];
        let end = after.find('>')?;
        let tag = &after[..end];
        rest = &after[end + 1..];
        if tag.starts_with(['/', '?', '!']) || tag.ends_with('/') {
            continue;
        }
        let qualified = tag.split_whitespace().next().unwrap_or("");
        let local = qualified.rsplit(':').next().unwrap_or(qualified);
        if local == name {
            let close = rest.find("</")?;
            return Some(rest[..close].trim());
        }
    }
    None
}

/// Whether the document has an element whose local name is `name`.
pub(super) fn has_element(xml: &str, name: &str) -> bool {
    xml.split('<').skip(1).any(|t| {
        let qualified = t
            .split(|c: char| c.is_whitespace() || c == '>' || c == '/')
            .next()
            .unwrap_or("");
        qualified.rsplit(':').next() == Some(name)
    })
}

impl QueueDescription {
    /// Reads the Atom entry Service Bus answers to `GET /{queue}`. `Ok(None)` when the
    /// document holds no `QueueDescription` (an empty feed: the queue does not exist).
    pub(crate) fn from_atom(xml: &str) -> Result<Option<Self>, DescriptionError> {
        if !has_element(xml, "QueueDescription") {
            return if has_element(xml, "feed") || has_element(xml, "entry") {
                Ok(None)
            } else {
                Err(DescriptionError::NotAtom)
            };
        }
        let start = xml.find("QueueDescription").unwrap_or(0);
        let body = &xml[start..];
        let bad = |name: &str, value: &str, expected: &'static str| DescriptionError::Value {
            element: name.to_string(),
            value: value.to_string(),
            expected,
        };
        let duration = |name: &str| -> Result<Option<Duration>, DescriptionError> {
            element_text(body, name)
                .map(|t| {
                    parse_iso8601_duration(t).ok_or_else(|| bad(name, t, "an ISO 8601 duration"))
                })
                .transpose()
        };
        let number = |name: &str| -> Result<Option<u32>, DescriptionError> {
            element_text(body, name)
                .map(|t| t.parse::<u32>().map_err(|_| bad(name, t, "a number")))
                .transpose()
        };
        let requires = match element_text(body, "RequiresDuplicateDetection") {
            Some(t) if t.eq_ignore_ascii_case("true") => true,
            Some(t) if t.eq_ignore_ascii_case("false") => false,
            Some(t) => return Err(bad("RequiresDuplicateDetection", t, "a boolean")),
            // The service's default.
            None => false,
        };
        Ok(Some(Self {
            requires_duplicate_detection: requires,
            duplicate_detection_history_time_window: duration(
                "DuplicateDetectionHistoryTimeWindow",
            )?,
            lock_duration: duration("LockDuration")?,
            max_delivery_count: number("MaxDeliveryCount")?,
            max_message_size_in_kilobytes: number("MaxMessageSizeInKilobytes")?,
        }))
    }
}

/// Parses an ISO 8601 duration as .NET writes a `TimeSpan` (`PT10M`, `P7D`, `PT0.5S`,
/// `P10675199DT2H48M5.4775807S` for `TimeSpan.MaxValue`); years and months count as 365 and
/// 30 days. Saturates instead of overflowing.
pub fn parse_iso8601_duration(s: &str) -> Option<Duration> {
    let rest = s.trim().strip_prefix('P')?;
    let (date, time) = match rest.split_once('T') {
        Some((d, t)) => (d, Some(t)),
        None => (rest, None),
    };
    let mut total = Duration::ZERO;
    let mut any = false;
    let mut add = |part: &str, units: &[(char, f64)]| -> Option<()> {
        let mut number = String::new();
        for c in part.chars() {
            if c.is_ascii_digit() || c == '.' || c == ',' {
                number.push(if c == ',' { '.' } else { c });
                continue;
            }
            let secs = units.iter().find(|(u, _)| *u == c)?.1;
            let n: f64 = number.parse().ok()?;
            number.clear();
            total = total
                .saturating_add(Duration::try_from_secs_f64(n * secs).unwrap_or(Duration::MAX));
            any = true;
        }
        number.is_empty().then_some(())
    };
    const DAY: f64 = 86_400.0;
    add(
        date,
        &[
            ('Y', 365.0 * DAY),
            ('M', 30.0 * DAY),
            ('W', 7.0 * DAY),
            ('D', DAY),
        ],
    )?;
    if let Some(t) = time {
        if t.is_empty() {
            return None;
        }
        add(t, &[('H', 3600.0), ('M', 60.0), ('S', 1.0)])?;
    }
    any.then_some(total)
}

/// A duration as ISO 8601 (`PT2M40S`), for messages that name a queue property's value.
pub fn iso8601(d: Duration) -> String {
    let secs = d.as_secs();
    let (days, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let mut out = String::from("P");
    if days > 0 {
        out.push_str(&format!("{days}D"));
    }
    if h + m + s > 0 || days == 0 {
        out.push('T');
        if h > 0 {
            out.push_str(&format!("{h}H"));
        }
        if m > 0 {
            out.push_str(&format!("{m}M"));
        }
        if s > 0 || (h == 0 && m == 0) {
            out.push_str(&format!("{s}S"));
        }
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn iso8601_durations_as_dotnet_writes_them() {
        let p = |s: &str| parse_iso8601_duration(s);
        assert_eq!(p("PT10M"), Some(Duration::from_secs(600)));
        assert_eq!(p("PT1M30S"), Some(Duration::from_secs(90)));
        assert_eq!(p("P7D"), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(p("P1DT2H"), Some(Duration::from_secs(93_600)));
        assert_eq!(p("PT0.5S"), Some(Duration::from_millis(500)));
        let max = p("P10675199DT2H48M5.4775807S").unwrap();
        assert!(max > Duration::from_secs(10_675_199 * 86_400));
        for bad in ["", "P", "PT", "10M", "PT10X", "PT10", "P1H"] {
            assert_eq!(p(bad), None, "{bad}");
        }
        for secs in [
            1,
            20,
            59,
            60,
            90,
            600,
            3600,
            3661,
            86_400,
            7 * 86_400,
            90_061,
        ] {
            let d = Duration::from_secs(secs);
            assert_eq!(p(&iso8601(d)), Some(d), "{}", iso8601(d));
        }
        assert_eq!(iso8601(Duration::from_secs(160)), "PT2M40S");
        assert_eq!(iso8601(Duration::ZERO), "PT0S");
    }

    /// The shape Service Bus answers (the Get Queue reference on learn.microsoft.com), with
    /// prefixes and the runtime counters the service adds.
    pub(in crate::azure::retry_queue) const ENTRY: &str = r#"<entry xmlns="http://www.w3.org/2005/Atom"><id>https://ns.servicebus.windows.net/retries?api-version=2021-05</id><title type="text">retries</title><content type="application/xml"><QueueDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect" xmlns:i="http://www.w3.org/2001/XMLSchema-instance"><LockDuration>PT1M</LockDuration><MaxSizeInMegabytes>1024</MaxSizeInMegabytes><RequiresDuplicateDetection>true</RequiresDuplicateDetection><RequiresSession>false</RequiresSession><DefaultMessageTimeToLive>P10675199DT2H48M5.4775807S</DefaultMessageTimeToLive><DeadLetteringOnMessageExpiration>false</DeadLetteringOnMessageExpiration><DuplicateDetectionHistoryTimeWindow>PT10M</DuplicateDetectionHistoryTimeWindow><MaxDeliveryCount>10</MaxDeliveryCount><AuthorizationRules/><CountDetails xmlns:d2p1="http://schemas.microsoft.com/netservices/2011/06/servicebus"><d2p1:ActiveMessageCount>0</d2p1:ActiveMessageCount></CountDetails><MaxMessageSizeInKilobytes>256</MaxMessageSizeInKilobytes></QueueDescription></content></entry>"#;

    #[test]
    fn a_queue_description_is_read_from_its_atom_entry() {
        let d = QueueDescription::from_atom(ENTRY).unwrap().unwrap();
        assert_eq!(
            d,
            QueueDescription {
                requires_duplicate_detection: true,
                duplicate_detection_history_time_window: Some(Duration::from_secs(600)),
                lock_duration: Some(Duration::from_secs(60)),
                max_delivery_count: Some(10),
                max_message_size_in_kilobytes: Some(256),
            }
        );
        let feed = r#"<feed xmlns="http://www.w3.org/2005/Atom"><title type="text">Publicly Listed Services</title><id>uuid:1</id><updated>2024-01-01T00:00:00Z</updated><generator>Service Bus 1.1</generator></feed>"#;
        assert_eq!(QueueDescription::from_atom(feed), Ok(None));
        assert!(QueueDescription::from_atom("not xml").is_err());
        let bad = ENTRY.replace("PT10M", "ten minutes");
        let e = QueueDescription::from_atom(&bad).unwrap_err().to_string();
        assert!(e.contains("DuplicateDetectionHistoryTimeWindow"), "{e}");
    }
}
