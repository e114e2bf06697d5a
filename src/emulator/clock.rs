//! The emulators' clock (the pipeline's [`crate::clock::Clock`], which tests advance so
//! scheduled messages, lock expiry and duplicate-detection windows need no real waits) and
//! the HTTP date format.

use std::time::SystemTime;

use time::format_description::well_known::Rfc2822;
use time::macros::format_description;
use time::OffsetDateTime;

/// The clock the emulators and the pipeline share ([`crate::clock::Clock`]).
pub use crate::clock::Clock;

/// `Wed, 02 Jul 2014 01:33:27 GMT` (RFC 1123, the form every Azure REST API returns).
pub fn http_date(t: SystemTime) -> String {
    let fmt = format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    OffsetDateTime::from(t)
        .format(&fmt)
        .unwrap_or_else(|_| "Thu, 01 Jan 1970 00:00:00 GMT".into())
}

/// Parses RFC 2822 / RFC 1123 dates with a numeric offset or `GMT`/`UTC`.
pub fn parse_http_date(s: &str) -> Option<SystemTime> {
    let s = s.trim();
    let normalised = s
        .strip_suffix(" GMT")
        .or_else(|| s.strip_suffix(" UTC"))
        .or_else(|| s.strip_suffix(" UT"))
        .map(|head| format!("{head} +0000"))
        .unwrap_or_else(|| s.to_string());
    OffsetDateTime::parse(&normalised, &Rfc2822)
        .ok()
        .map(SystemTime::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_round_trip_in_both_zone_forms() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_404_264_807);
        assert_eq!(http_date(t), "Wed, 02 Jul 2014 01:33:27 GMT");
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 01:33:27 GMT"), Some(t));
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 01:33:27 +0000"), Some(t));
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 03:33:27 +0200"), Some(t));
        assert_eq!(parse_http_date("2014-07-02T01:33:27Z"), None);
    }
}
