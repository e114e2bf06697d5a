//! A retry message in hand under its lock: renewed in one place, held while a dependency
//! fails, and disposed of once.

use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::azure::{ReceivedMessage, RetryQueueError};
use crate::pipeline::backoff::{until_settled, Hold};
use crate::pipeline::Shared;

/// What becomes of a retry message in hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Disposition {
    /// Completed: its attempt is settled (or it had nothing left to do).
    Complete,
    /// Abandoned: Service Bus hands it out again at once (counting a delivery).
    Abandon,
}

/// Completes or abandons `msg`; a failure only means Service Bus redelivers it.
pub(super) async fn dispose(msg: &ReceivedMessage, disposition: Disposition) {
    let complete = disposition == Disposition::Complete;
    let r = match disposition {
        Disposition::Complete => msg.complete().await,
        Disposition::Abandon => msg.abandon().await,
    };
    if let Err(e) = r {
        tracing::warn!(message_id = %msg.message_id, error = %e, complete, "could not settle the retry message; Service Bus will redeliver it");
    }
}

/// A retry message in hand under its peek-lock: the one place its lock is renewed (half-way
/// to its expiry, at most every 500 ms) while anything waits on it. A message left without a
/// disposition (its lock lost or lapsed) goes to its next receiver when the lock expires.
pub(super) struct LockedMessage<'s> {
    pub(super) msg: ReceivedMessage,
    pub(super) shared: &'s Shared,
    pub(super) cancel: &'s CancellationToken,
    /// When the lock lapses on the monotonic clock, which keeps counting while the process is
    /// stopped: a process frozen past its lock finds it lapsed on waking even if the wall
    /// clock was stepped back meanwhile.
    lock_deadline: std::time::Instant,
}

/// How a wait under the lock is renewed when Service Bus says the lock is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnLockLost {
    /// Stop waiting: another receiver has the message.
    Stop,
    /// Keep going (the wait's outcome still counts: a settlement holding, a running call).
    Continue,
}

impl<'s> LockedMessage<'s> {
    pub(super) fn new(
        msg: ReceivedMessage,
        shared: &'s Shared,
        cancel: &'s CancellationToken,
    ) -> Self {
        let lock_deadline = std::time::Instant::now() + shared.clock().until(msg.locked_until);
        Self {
            msg,
            shared,
            cancel,
            lock_deadline,
        }
    }

    /// Completes or abandons the message.
    pub(super) async fn dispose(&self, disposition: Disposition) {
        dispose(&self.msg, disposition).await;
    }

    /// How long until the lock should be renewed.
    fn renew_in(&self) -> Duration {
        (self.shared.clock().until(self.msg.locked_until) / 2).max(Duration::from_millis(500))
    }

    /// Renews the lock; `false` when it is lost and `on_lost` says to stop.
    async fn renew(&mut self, on_lost: OnLockLost) -> bool {
        let asked = std::time::Instant::now();
        match self.msg.renew().await {
            Ok(()) => {
                // Counted from the request: the renewal may have taken a while to answer.
                self.lock_deadline = asked + self.shared.clock().until(self.msg.locked_until);
                true
            }
            Err(RetryQueueError::LockLost) if on_lost == OnLockLost::Stop => {
                tracing::warn!(message_id = %self.msg.message_id, "lost the lock on a retry waiting to start; Service Bus hands it to another receiver");
                false
            }
            Err(e) => {
                tracing::warn!(message_id = %self.msg.message_id, error = %e, "lock renewal failed");
                true
            }
        }
    }

    /// Whether the lock still holds, on the policy clock and on the monotonic one; says so
    /// when it lapsed.
    pub(super) fn lock_held(&self) -> bool {
        let held = self.shared.clock().now() < self.msg.locked_until
            && std::time::Instant::now() < self.lock_deadline;
        if !held {
            tracing::warn!(message_id = %self.msg.message_id, "the lock on a retry waiting to start lapsed; leaving it to its next receiver");
        }
        held
    }

    /// Waits for `fut` under the lock, renewing it meanwhile. `None` if the loop stops first
    /// (the message abandoned, so Service Bus hands it to another replica at once), or if the
    /// lock is lost or lapsed (a stalled process, a step of the clock): Service Bus hands the
    /// message to another receiver, and running it here too would be a second attempt.
    pub(super) async fn under_lock<T>(
        &mut self,
        fut: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        tokio::pin!(fut);
        loop {
            if !self.lock_held() {
                return None;
            }
            let renew_in = self.renew_in();
            tokio::select! {
                _ = self.cancel.cancelled() => {
                    self.dispose(Disposition::Abandon).await;
                    return None;
                }
                v = &mut fut => return self.lock_held().then_some(v),
                _ = self.shared.clock().sleep(renew_in) => {
                    if !self.renew(OnLockLost::Stop).await {
                        return None;
                    }
                }
            }
        }
    }

    /// Runs `fut` to its end under the lock (a handler's call), renewing the lock and, every
    /// half [`CLAIM_LEASE`](crate::pipeline::settle::CLAIM_LEASE), the attempt's `claimed` ledger claim.
    pub(super) async fn running<T>(
        &mut self,
        claimed: &mut crate::ledger::Versioned<crate::ledger::LedgerRecord>,
        fut: impl std::future::Future<Output = T>,
    ) -> T {
        futures::pin_mut!(fut);
        let mut claim_renewal =
            self.shared.clock().now() + crate::pipeline::settle::CLAIM_LEASE / 2;
        loop {
            let renew_in = self.renew_in();
            tokio::select! {
                v = &mut fut => return v,
                _ = self.shared.clock().sleep(renew_in) => {
                    self.renew(OnLockLost::Continue).await;
                }
                _ = self.shared.clock().sleep_until(claim_renewal) => {
                    if let Err(e) = self.shared.settler.renew_claim(claimed).await {
                        tracing::warn!(key = %claimed.value.key, error = %e, "renewing the claim on a running attempt failed");
                    }
                    claim_renewal = self.shared.clock().now() + crate::pipeline::settle::CLAIM_LEASE / 2;
                }
            }
        }
    }

    /// Runs `op` until it succeeds, with backoff, holding the message (its lock renewed)
    /// meanwhile; readiness shows the hold while it lasts. `None` if the loop stops first
    /// (the message is abandoned then, so Service Bus redelivers it).
    pub(super) async fn holding<T, E, F, Fut>(&mut self, key: &str, what: &str, op: F) -> Option<T>
    where
        E: std::fmt::Display,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        let max = self.shared.options.settle_backoff_max;
        let done = until_settled(
            &mut Holding {
                msg: self,
                key,
                what,
            },
            max,
            op,
        )
        .await;
        if done.is_ok() {
            self.shared.health.release_retry(&self.msg.message_id);
        }
        done.ok()
    }

    /// How long after `due` it is now.
    pub(super) fn lateness(&self, due: SystemTime) -> Duration {
        self.shared
            .clock()
            .now()
            .duration_since(due)
            .unwrap_or_default()
    }
}

/// A retry message held while `what` fails for `key`: readiness shows it, the lock is
/// renewed through each wait, and a stop abandons the message.
struct Holding<'m, 's> {
    msg: &'m mut LockedMessage<'s>,
    key: &'m str,
    what: &'m str,
}

impl<E: std::fmt::Display> Hold<E> for Holding<'_, '_> {
    fn failed(&mut self, e: &E) {
        let (shared, id, what) = (self.msg.shared, &self.msg.msg.message_id, self.what);
        shared.observe.held_retry_failed();
        tracing::warn!(message_id = %id, error = %e, "{what} failed; holding the retry message and trying again");
        // Readiness says so while it lasts.
        shared
            .health
            .hold_retry(id, self.key, format!("{what} failed: {e}"));
    }

    async fn pause(&mut self, wait: Duration) -> bool {
        let msg = &mut *self.msg;
        let (shared, cancel) = (msg.shared, msg.cancel);
        let wait = shared.clock().sleep(wait);
        tokio::pin!(wait);
        loop {
            let renew_in = msg.renew_in();
            tokio::select! {
                _ = cancel.cancelled() => {
                    shared.health.release_retry(&msg.msg.message_id);
                    msg.dispose(Disposition::Abandon).await;
                    return false;
                }
                _ = &mut wait => return true,
                _ = shared.clock().sleep(renew_in) => {
                    msg.renew(OnLockLost::Continue).await;
                }
            }
        }
    }
}

impl std::ops::Deref for LockedMessage<'_> {
    type Target = ReceivedMessage;

    fn deref(&self) -> &ReceivedMessage {
        &self.msg
    }
}
