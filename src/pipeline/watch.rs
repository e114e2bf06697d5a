//! Watchers that show in readiness why every event waits: the handler's block (a webhook
//! that has not agreed to receive) and a long pause of the downstream (a 429's
//! `Retry-After`).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::health::Health;

/// Shows in readiness why the handler cannot deliver (a webhook that has not agreed to
/// receive): held under `handler {downstream}` until the reason clears.
pub(super) async fn blocked(
    health: Arc<Health>,
    downstream: String,
    mut blocked: tokio::sync::watch::Receiver<Option<String>>,
    cancel: CancellationToken,
    crash: CancellationToken,
) {
    let subject = super::health::HoldSubject::Handler(downstream);
    loop {
        let reason = blocked.borrow_and_update().clone();
        match reason {
            Some(r) => health.hold(
                subject.clone(),
                None,
                super::health::HoldCause::HandlerBlocked,
                r,
            ),
            None => health.release(&subject, None),
        }
        tokio::select! {
            changed = blocked.changed() => if changed.is_err() { break },
            _ = cancel.cancelled() => break,
            _ = crash.cancelled() => break,
        }
    }
    health.release(&subject, None);
}

/// Shows in readiness a pause of the downstream (a 429's `Retry-After`) longer than
/// [`PAUSE_SHOWN_AFTER`]: every event waits on it, not on its own schedule. Held under
/// `rate limit {downstream}` until the pause ends; shorter pauses are the rate limit's
/// ordinary work.
pub(super) async fn paused(
    health: Arc<Health>,
    limiter: Arc<crate::ratelimit::limiter::Limiter>,
    clock: Arc<crate::clock::Clock>,
    cancel: CancellationToken,
    crash: CancellationToken,
) {
    let mut changes = limiter.subscribe();
    let subject = super::health::HoldSubject::RateLimit(limiter.snapshot().downstream);
    loop {
        let until = limiter.paused_until();
        match until {
            Some(u) if clock.until(u) > PAUSE_SHOWN_AFTER => {
                health.hold(
                    subject.clone(),
                    None,
                    super::health::HoldCause::HandlerBlocked,
                    format!(
                        "the downstream answered 429 with Retry-After: every replica waits until {} before calling it (handler.rate_limit)",
                        crate::clock::rfc3339(u)
                    ),
                );
                tokio::select! {
                    _ = clock.sleep_until(u) => {}
                    changed = changes.changed() => if changed.is_err() { break },
                    _ = cancel.cancelled() => break,
                    _ = crash.cancelled() => break,
                }
            }
            _ => {
                health.release(&subject, None);
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { break },
                    _ = cancel.cancelled() => break,
                    _ = crash.cancelled() => break,
                }
            }
        }
    }
    health.release(&subject, None);
}

/// A pause of the downstream longer than this shows in readiness.
const PAUSE_SHOWN_AFTER: Duration = Duration::from_secs(10);
