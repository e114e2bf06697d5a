//! The clock policy time runs on: retry due times, breaker expiry, deferrals, lock renewal.
//!
//! In production it is the wall clock. Tests share one [`Clock`] between the pipeline and the
//! Service Bus emulator and [`advance`](Clock::advance) it, so a 15-minute outage plays out in
//! seconds without a real sleep: every wait in policy time ([`sleep`](Clock::sleep),
//! [`sleep_until`](Clock::sleep_until)) wakes as soon as the clock is moved past its end.
//! Deadlines on network calls are not policy time and stay on tokio's timer. Waits run on
//! tokio's monotonic timer plus the advances, so a step of the wall clock does not change a
//! wait already begun.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

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
        SystemTime::now() + *self.offset.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How far this clock runs ahead of the wall clock.
    pub fn offset(&self) -> Duration {
        *self.offset.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves time forward by `by` and wakes everything waiting on it.
    pub fn advance(&self, by: Duration) {
        *self.offset.lock().unwrap_or_else(|p| p.into_inner()) += by;
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
