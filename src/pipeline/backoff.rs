//! Backing off until settled: the one loop behind every "hold and try again" in the
//! pipeline (a partition holding an event whose settlement fails, a retry message held while
//! the ledger or Service Bus fails). The wait doubles from 200 ms up to a ceiling
//! (`settle_backoff_max`); what a failure shows (readiness, telemetry) and how the wait
//! holds (a partition just waits; a retry message keeps its lock renewed) is the caller's
//! [`Hold`].

use std::future::Future;
use std::time::Duration;

/// The first wait after a failure.
const FIRST_WAIT: Duration = Duration::from_millis(200);

/// What holding work means to its caller.
pub(super) trait Hold<E> {
    /// The operation failed with `error`: show that the work is held.
    fn failed(&mut self, error: &E);

    /// Waits `wait` while the work is held; `false` when the loop stops first.
    async fn pause(&mut self, wait: Duration) -> bool;
}

/// Runs `op` until it succeeds, telling `hold` of each failure and pausing with backoff
/// (doubling from 200 ms up to `max`) in between. `Err` with the last failure when `hold`
/// stops the loop.
pub(super) async fn until_settled<T, E, F, Fut>(
    hold: &mut impl Hold<E>,
    max: Duration,
    mut op: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut backoff = FIRST_WAIT;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                hold.failed(&e);
                if !hold.pause(backoff).await {
                    return Err(e);
                }
                backoff = (backoff * 2).min(max);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the waits; stops after `stop_after` of them.
    struct Recorder {
        failures: Vec<u32>,
        waits: Vec<Duration>,
        stop_after: usize,
    }

    impl Hold<u32> for Recorder {
        fn failed(&mut self, error: &u32) {
            self.failures.push(*error);
        }

        async fn pause(&mut self, wait: Duration) -> bool {
            self.waits.push(wait);
            self.waits.len() < self.stop_after
        }
    }

    #[tokio::test]
    async fn the_wait_doubles_up_to_its_ceiling_until_the_operation_succeeds() {
        let mut hold = Recorder {
            failures: Vec::new(),
            waits: Vec::new(),
            stop_after: usize::MAX,
        };
        let mut calls = 0u32;
        let done = until_settled(&mut hold, Duration::from_millis(1000), || {
            calls += 1;
            let n = calls;
            async move {
                if n < 6 {
                    Err(n)
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(done, Ok(6));
        assert_eq!(hold.failures, [1, 2, 3, 4, 5]);
        let ms: Vec<u128> = hold.waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [200, 400, 800, 1000, 1000]);
    }

    #[tokio::test]
    async fn a_stop_returns_the_last_failure() {
        let mut hold = Recorder {
            failures: Vec::new(),
            waits: Vec::new(),
            stop_after: 2,
        };
        let mut calls = 0u32;
        let stopped: Result<(), u32> = until_settled(&mut hold, Duration::from_secs(30), || {
            calls += 1;
            let n = calls;
            async move { Err(n) }
        })
        .await;
        assert_eq!(stopped, Err(2));
        assert_eq!(hold.failures, [1, 2]);
    }
}
