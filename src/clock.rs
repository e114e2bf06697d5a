//! The clock policy time runs on: retry due times, breaker expiry, deferrals, lock renewal.
//!
//! Policy time is **the services' time**: whatever two replicas compare (due times, ledger
//! claims, lock lapses, breaker expiry) must be judged on a clock they share, and a host's
//! own clock can be minutes off (Azure Storage itself accepts requests up to 15 minutes off).
//! Each [`Clock`] measures how far its host is from each [`Service`] from the `Date` of that
//! service's responses ([`observe`](Clock::observe); see [`service`] for how), and
//! [`now`](Clock::now) reads Service Bus's time: this host's wall clock while it agrees with
//! every measurement, otherwise the nearest time the measurements allow. Blob storage's
//! times (`Last-Modified` of ownership and owner records) are translated with blob storage's
//! own offset ([`to_process`](Clock::to_process)), so the SDK's load balancer, which compares
//! them with `SystemTime::now()`, sees them in this host's terms. docs/clocks.md has the rules.
//!
//! Tests share one [`Clock`] between the pipeline and the Service Bus emulator and
//! [`advance`](Clock::advance) it, so a 15-minute outage plays out in seconds without a real
//! sleep: every wait in policy time ([`sleep`](Clock::sleep),
//! [`sleep_until`](Clock::sleep_until)) wakes as soon as the clock is moved past its end.
//! Deadlines on network calls are not policy time and stay on tokio's timer. Waits run on
//! tokio's monotonic timer plus the advances, so a step of the wall clock does not change a
//! wait already begun. A test makes a replica's host clock wrong with
//! [`set_host_error`](Clock::set_host_error).
//!
//! Time's formats live here too, one home for each: milliseconds since the epoch ([`ms`],
//! [`at`]) for records, RFC 3339 ([`rfc3339`]) for people and JSON, the HTTP date
//! ([`http_date`], [`parse_http_date`]) for the REST APIs, and [`ceil_to_second`] for Service
//! Bus's scheduled times.

mod service;

pub use self::service::Service;
use self::service::{clamp, Estimator};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

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

/// Service time, measured against this host's clock plus an offset that only moves forward
/// (a test's [`advance`](Clock::advance)).
#[derive(Debug)]
pub struct Clock {
    offset: Mutex<Duration>,
    advanced: Notify,
    /// How far this host's wall clock is off (ms; a test's injected error, 0 otherwise).
    host_error_ms: AtomicI64,
    /// Whether readings follow the services' measured time (on unless a test turns it off).
    corrected: AtomicBool,
    /// The monotonic clock's zero.
    origin: std::time::Instant,
    /// Per [`Service`], what its responses said.
    services: Mutex<[Estimator; 3]>,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            offset: Mutex::default(),
            advanced: Notify::new(),
            host_error_ms: AtomicI64::new(0),
            corrected: AtomicBool::new(true),
            origin: std::time::Instant::now(),
            services: Mutex::default(),
        }
    }
}

/// A reading of the monotonic clock taken before a request: pass it to
/// [`Clock::observe`] with the response.
#[derive(Debug, Clone, Copy)]
pub struct Sent(i64);

/// How far a service's clock is from this host's, as measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Skew {
    /// The service.
    pub service: Service,
    /// Service time minus this host's time, in ms (the middle of what was measured).
    pub offset_ms: i64,
    /// How far the true offset may be from `offset_ms`, in ms.
    pub within_ms: i64,
    /// How many responses stand behind it.
    pub samples: usize,
}

impl std::fmt::Display for Skew {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:+.3} s (± {:.3} s, {} responses)",
            self.service.name(),
            self.offset_ms as f64 / 1000.0,
            self.within_ms as f64 / 1000.0,
            self.samples
        )
    }
}

/// `t` moved by `us` µs (either way).
fn shift(t: SystemTime, us: i64) -> SystemTime {
    let d = Duration::from_micros(us.unsigned_abs());
    if us >= 0 {
        t + d
    } else {
        t.checked_sub(d).unwrap_or(SystemTime::UNIX_EPOCH)
    }
}

/// µs since the epoch (negative before it).
fn epoch_us(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_micros() as i64,
        Err(e) => -(e.duration().as_micros() as i64),
    }
}

impl Clock {
    /// The current time: Service Bus's, as measured (this host's until it is).
    pub fn now(&self) -> SystemTime {
        self.service_now(Service::ServiceBus)
    }

    /// What this host's wall clock reads (plus the advances): the time every reading starts
    /// from before it is corrected.
    pub fn host_now(&self) -> SystemTime {
        shift(
            SystemTime::now() + self.offset(),
            self.host_error_ms
                .load(Ordering::Relaxed)
                .saturating_mul(1000),
        )
    }

    /// The monotonic clock plus the advances (µs).
    fn mono(&self) -> i64 {
        (self.origin.elapsed() + self.offset()).as_micros() as i64
    }

    /// `service`'s current time as measured: this host's time if the measurements allow it,
    /// else the nearest time they allow; this host's time before any measurement.
    pub fn service_now(&self, service: Service) -> SystemTime {
        let host = self.host_now();
        let range = self.services.locked()[service.index()].range();
        match range.filter(|_| self.corrected.load(Ordering::Relaxed)) {
            None => host,
            Some((lo, hi)) => {
                let mono = self.mono();
                let t = clamp(epoch_us(host), (mono + lo, mono + hi));
                shift(SystemTime::UNIX_EPOCH, t)
            }
        }
    }

    /// A time `t` of `service`'s clock in the terms of this process's `SystemTime::now()`,
    /// which is what code outside hubguard compares times with (the Event Hubs SDK's load
    /// balancer judges ownership expiry so).
    pub fn to_process(&self, service: Service, t: SystemTime) -> SystemTime {
        let now = SystemTime::now();
        shift(t, epoch_us(now) - epoch_us(self.service_now(service)))
    }

    /// A reading to take just before sending a request whose response's `Date` is then given
    /// to [`observe`](Self::observe).
    pub fn sent(&self) -> Sent {
        Sent(self.mono())
    }

    /// A response of `service` to a request sent at `sent`, carrying `date` (its `Date`
    /// header, RFC 1123); an unreadable date is ignored.
    pub fn observe(&self, service: Service, sent: Sent, date: &str) {
        let received = self.mono();
        if let Some(d) = parse_http_date(date) {
            let secs = epoch_us(d).div_euclid(1_000_000);
            self.services.locked()[service.index()].observe(sent.0, received, secs);
        }
    }

    /// What was measured of `service`, once anything was.
    pub fn skew(&self, service: Service) -> Option<Skew> {
        let (range, samples) = {
            let s = self.services.locked();
            let e = &s[service.index()];
            (e.range()?, e.samples())
        };
        let (lo, hi) = range;
        let offset_us = self.mono() + (lo + hi) / 2 - epoch_us(self.host_now());
        Some(Skew {
            service,
            offset_ms: offset_us / 1000,
            within_ms: (hi - lo) / 2000,
            samples,
        })
    }

    /// Makes this host's wall clock read `ms` off (a test's fault: a host whose time is
    /// wrong, or one whose clock steps during a run).
    pub fn set_host_error(&self, ms: i64) {
        self.host_error_ms.store(ms, Ordering::Relaxed);
    }

    /// Turns the correction by measured service time off (`false`) or on: with it off, every
    /// reading is this host's clock, whatever the services say (to show what a wrong clock
    /// does without it).
    pub fn set_corrected(&self, on: bool) {
        self.corrected.store(on, Ordering::Relaxed);
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

    /// How far apart two times are, either way.
    fn apart(a: SystemTime, b: SystemTime) -> Duration {
        a.duration_since(b).unwrap_or_else(|e| e.duration())
    }

    #[test]
    fn a_wrong_host_clock_reads_the_services_time_once_measured_and_across_a_step() {
        let c = Clock::default();
        c.set_host_error(90_000);
        // Before any response: the host's (wrong) time.
        assert!(apart(c.now(), SystemTime::now()) > Duration::from_secs(89));
        for _ in 0..5 {
            let sent = c.sent();
            let date = http_date(SystemTime::now());
            c.observe(Service::ServiceBus, sent, &date);
            c.observe(Service::BlobStorage, sent, &date);
        }
        let second = Duration::from_millis(1500);
        assert!(apart(c.now(), SystemTime::now()) < second);
        let skew = c.skew(Service::ServiceBus).unwrap();
        assert!((skew.offset_ms + 90_000).abs() < 1_500, "{skew}");
        // The host's clock steps 11 minutes back: no response needed to stay right.
        c.set_host_error(-600_000);
        assert!(apart(c.now(), SystemTime::now()) < second);
        // Blob storage's times, as this process's SystemTime counts them (true here).
        let t = SystemTime::now() - Duration::from_secs(30);
        assert!(apart(c.to_process(Service::BlobStorage, t), t) < second);
        // Without the correction, what a host 10 minutes behind would see: 10 minutes later.
        c.set_corrected(false);
        let seen = c.to_process(Service::BlobStorage, t);
        assert!(apart(seen, t + Duration::from_secs(600)) < second);
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
