//! Transient or permanent: how an attempt's failure is classified.
//! HTTP 408, 429 and 5xx, timeouts and connection errors are transient; other 4xx are
//! permanent, with 409 configurable; a `Retry-After` is carried along.

use std::time::{Duration, SystemTime};

/// How a failure is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Try again later.
    Transient,
    /// Trying again cannot help: dead-letter.
    Permanent,
}

/// Classifies an HTTP status (2xx are not failures and are not passed here).
pub fn http_status(status: u16, conflict_is_permanent: bool) -> ErrorClass {
    match status {
        408 | 429 => ErrorClass::Transient,
        409 if !conflict_is_permanent => ErrorClass::Transient,
        400..=499 => ErrorClass::Permanent,
        _ => ErrorClass::Transient,
    }
}

/// Parses a `Retry-After` header: seconds, or an HTTP date (relative to `now`).
pub fn retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    // More digits than a u64 holds is still a (very long) number of seconds: the policy's
    // limit shortens it, rather than the value being ignored as garbage.
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(u64::MAX));
    }
    let at = crate::clock::parse_http_date(v)?;
    Some(at.duration_since(now).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(http_status(408, true), ErrorClass::Transient);
        assert_eq!(http_status(429, true), ErrorClass::Transient);
        assert_eq!(http_status(500, true), ErrorClass::Transient);
        assert_eq!(http_status(503, true), ErrorClass::Transient);
        assert_eq!(http_status(400, true), ErrorClass::Permanent);
        assert_eq!(http_status(404, true), ErrorClass::Permanent);
        assert_eq!(http_status(409, true), ErrorClass::Permanent);
        assert_eq!(http_status(409, false), ErrorClass::Transient);
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_404_264_807);
        assert_eq!(retry_after("120", now), Some(Duration::from_secs(120)));
        assert_eq!(
            retry_after("Wed, 02 Jul 2014 01:34:27 GMT", now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(retry_after("soon", now), None);
        assert_eq!(
            retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX)),
            "a number too long for u64 is long, not garbage"
        );
        assert_eq!(retry_after("-5", now), None);
        assert!(retry_after("Fri, 31 Dec 9999 23:59:59 GMT", now)
            .is_some_and(|d| d > Duration::from_secs(7 * 86_400)));
    }
}
