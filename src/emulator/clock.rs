//! The emulators' clock: wall time plus an offset that tests may advance, so scheduled
//! messages, lock expiry and duplicate-detection windows can be tested without real waits.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use time::format_description::well_known::Rfc2822;
use time::macros::format_description;
use time::OffsetDateTime;
use tokio::sync::Notify;

/// Wall time with a test-controlled offset.
#[derive(Debug, Default)]
pub struct Clock {
    offset: Mutex<Duration>,
    advanced: Notify,
}

impl Clock {
    /// The emulator's current time.
    pub fn now(&self) -> SystemTime {
        SystemTime::now() + *self.offset.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the emulator's time forward by `by` and wakes everything waiting on time.
    pub fn advance(&self, by: Duration) {
        *self.offset.lock().unwrap_or_else(|p| p.into_inner()) += by;
        self.advanced.notify_waiters();
    }

    /// Resolves when the clock is advanced.
    pub async fn advanced(&self) {
        self.advanced.notified().await
    }

    /// Real time until the emulator's clock reaches `at` (zero if it already has).
    pub fn until(&self, at: SystemTime) -> Duration {
        at.duration_since(self.now()).unwrap_or_default()
    }
}

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

    #[test]
    fn dates_round_trip_in_both_zone_forms() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_404_264_807);
        assert_eq!(http_date(t), "Wed, 02 Jul 2014 01:33:27 GMT");
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 01:33:27 GMT"), Some(t));
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 01:33:27 +0000"), Some(t));
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 03:33:27 +0200"), Some(t));
        assert_eq!(parse_http_date("2014-07-02T01:33:27Z"), None);
    }

    #[tokio::test]
    async fn advancing_moves_now_and_wakes_waiters() {
        let c = std::sync::Arc::new(Clock::default());
        let before = c.now();
        let waiter = {
            let c = c.clone();
            tokio::spawn(async move { c.advanced().await })
        };
        tokio::task::yield_now().await;
        c.advance(Duration::from_secs(600));
        waiter.await.unwrap();
        assert!(c.now().duration_since(before).unwrap() >= Duration::from_secs(600));
    }
}
