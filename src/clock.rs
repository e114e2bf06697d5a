//! The clock policy time runs on: retry due times, breaker expiry, deferrals, lock renewal.
//!
//! In production it is the wall clock. Tests share one [`Clock`] between the pipeline and the
//! Service Bus emulator and [`advance`](Clock::advance) it, so a 15-minute outage plays out in
//! seconds without a real sleep: every wait in policy time ([`sleep`](Clock::sleep),
//! [`sleep_until`](Clock::sleep_until)) wakes as soon as the clock is moved past its end.
//! Deadlines on network calls are not policy time and stay on tokio's timer. Waits run on
//! tokio's monotonic timer plus the advances, so a step of the wall clock does not change a
//! wait already begun.
//!
//! Time's formats live here too, one home for each: milliseconds since the epoch ([`ms`],
//! [`at`]) for records, RFC 3339 ([`rfc3339`]) for people and JSON, the HTTP date
//! ([`http_date`], [`parse_http_date`]) for the REST APIs, and [`ceil_to_second`] for Service
//! Bus's scheduled times.

use crate::sync::LockExt;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use time::format_description::well_known::{Rfc2822, Rfc3339};
use time::macros::format_description;
use time::OffsetDateTime;

/// Milliseconds since the epoch (0 before it).
pub fn ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The time at `ms` milliseconds since the epoch.
pub fn at(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// RFC 3339 in UTC (`2026-12-01T15:04:05.123Z`).
pub fn rfc3339(t: SystemTime) -> String {
    OffsetDateTime::from(t).format(&Rfc3339).unwrap_or_default()
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

/// Rounds up to the next whole second (Service Bus's scheduled times carry no fractions):
/// the time Service Bus will actually enqueue a message scheduled for `t`.
pub fn ceil_to_second(t: SystemTime) -> SystemTime {
    SystemTime::UNIX_EPOCH + ceil_secs(t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default())
}

/// `d` rounded up to whole seconds: Service Bus takes times and waits in whole seconds
/// (scheduled enqueue times, a peek-lock's timeout), and rounding up keeps a short wait a
/// wait and a due time never early.
pub fn ceil_secs(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

use tokio::sync::Notify;

/// Wall time plus an offset that only moves forward.
#[derive(Debug, Default)]
pub struct Clock {
    offset: Mutex<Duration>,
    advanced: Notify,
}

impl Clock {
    /// The current time.
    pub fn now(&self) -> SystemTime {
        SystemTime::now() + *self.offset.locked()
    }

    /// How far this clock runs ahead of the wall clock.
    pub fn offset(&self) -> Duration {
        *self.offset.locked()
    }

    /// Moves time forward by `by` and wakes everything waiting on it.
    pub fn advance(&self, by: Duration) {
        *self.offset.locked() += by;
        self.advanced.notify_waiters();
    }

    /// Resolves when the clock is next advanced.
    pub async fn advanced(&self) {
        self.advanced.notified().await
    }

    /// Real time until this clock reaches `at` (zero if it already has).
    pub fn until(&self, at: SystemTime) -> Duration {
        at.duration_since(self.now()).unwrap_or_default()
    }

    /// Waits until this clock reaches `at`. The remainder is taken once and then waited on
    /// tokio's monotonic timer, so a step of the wall clock (NTP) neither stretches nor cuts
    /// a wait already begun; advances of this clock still cut it short.
    pub async fn sleep_until(&self, at: SystemTime) {
        self.sleep(self.until(at)).await
    }

    /// Waits `d` of this clock's time: tokio's time passing plus any advance meanwhile.
    pub async fn sleep(&self, d: Duration) {
        let started = tokio::time::Instant::now();
        let offset = self.offset();
        loop {
            // Created before the offset is read: an advance in between still wakes it
            // (`notify_waiters` reaches every `Notified` that exists when it is called).
            let advanced = self.advanced.notified();
            let passed = started.elapsed() + self.offset().saturating_sub(offset);
            let left = d.saturating_sub(passed);
            if left.is_zero() {
                return;
            }
            tokio::select! {
                _ = advanced => {}
                _ = tokio::time::sleep(left) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates_round_trip_in_both_zone_forms() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_404_264_807);
        assert_eq!(http_date(t), "Wed, 02 Jul 2014 01:33:27 GMT");
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 01:33:27 GMT"), Some(t));
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 01:33:27 +0000"), Some(t));
        assert_eq!(parse_http_date("Wed, 02 Jul 2014 03:33:27 +0200"), Some(t));
        assert_eq!(parse_http_date("2014-07-02T01:33:27Z"), None);
    }

    #[test]
    fn epoch_ms_rfc3339_and_whole_seconds() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_001);
        assert_eq!(at(ms(t)), t);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.001Z");
        assert_eq!(
            ceil_to_second(t),
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_001)
        );
        let whole = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(ceil_to_second(whole), whole);
        assert_eq!(ms(SystemTime::UNIX_EPOCH - Duration::from_secs(1)), 0);
    }
    use std::sync::Arc;

    #[tokio::test]
    async fn advancing_moves_now_and_wakes_waiters() {
        let c = Arc::new(Clock::default());
        let before = c.now();
        let waiter = {
            let c = c.clone();
            tokio::spawn(async move { c.advanced().await })
        };
        tokio::task::yield_now().await;
        c.advance(Duration::from_secs(600));
        waiter.await.unwrap();
        assert!(c.now().duration_since(before).unwrap() >= Duration::from_secs(600));
        assert_eq!(c.offset(), Duration::from_secs(600));
    }

    #[tokio::test(start_paused = true)]
    async fn a_policy_sleep_ends_when_the_clock_passes_it_not_before() {
        let c = Arc::new(Clock::default());
        let sleeper = {
            let c = c.clone();
            tokio::spawn(async move { c.sleep(Duration::from_secs(900)).await })
        };
        tokio::task::yield_now().await;
        c.advance(Duration::from_secs(600));
        tokio::task::yield_now().await;
        assert!(!sleeper.is_finished(), "600 s of a 900 s wait have passed");
        c.advance(Duration::from_secs(300));
        sleeper.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn without_advances_a_policy_sleep_is_a_tokio_sleep() {
        let c = Clock::default();
        let t0 = tokio::time::Instant::now();
        c.sleep(Duration::from_secs(5)).await;
        assert_eq!(tokio::time::Instant::now() - t0, Duration::from_secs(5));
        // Paused time: the wall clock stood still, and the wait still ended on tokio's timer.
        let t1 = tokio::time::Instant::now();
        c.sleep_until(SystemTime::now() + Duration::from_secs(2))
            .await;
        assert!(tokio::time::Instant::now() - t1 <= Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_time_already_reached_does_not_wait() {
        let c = Clock::default();
        c.advance(Duration::from_secs(60));
        // Reached by the advance alone: no real waiting (the test would hang otherwise).
        c.sleep_until(SystemTime::now() + Duration::from_secs(30))
            .await;
        c.sleep(Duration::ZERO).await;
    }
}
