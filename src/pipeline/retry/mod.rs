//! The retry loop: receive due retry messages from Service Bus, run the attempt, settle it,
//! then *complete* the message (never abandon after scheduling the next attempt, which would
//! make a second copy). If a dependency fails on the way (the ledger, Service Bus itself),
//! the message is *held*: its lock is renewed and the step retried with backoff until it
//! succeeds. Abandoning at once would hand the message straight back, and a few seconds of
//! outage would burn its delivery count until Service Bus dead-lettered it out of
//! hubguard's sight. If the process stops or dies while holding, the lock lapses and Service
//! Bus redelivers the message: one delivery counted, nothing lost.
//! The ledger decides: a message for an event already delivered or dead-lettered is completed
//! without calling the handler, and a stale message (its attempt already recorded) only
//! re-sends the recorded next attempt.
//! A probe message of `hubguard check` (the `hubguard-probe` property) is not work: it is
//! completed as it arrives, before the ledger or the handler, here and in the dead-letter
//! sweep ([`crate::azure::retry_queue::probe`]).
//!
//! Service Bus dead-letters a message it delivered `MaxDeliveryCount` times without a
//! settlement: a process that died holding the same retry again and again. Such a retry
//! would wait where nothing reads it while the ledger promises a next attempt, so a sweep
//! of the dead-letter sub-queue (at start, then every `dead_letter_sweep`) puts it back.
//!
//! The loop never dies silently (three layers): receive errors are retried at
//! once with backoff, then by a watchdog at a slow pace; the state shows in readiness.
//!
//! Service Bus's REST API hands out one message per receive, so one receiver drains a burst
//! of due retries one round trip at a time. While the loop is healthy and receives keep
//! returning messages, more receivers join (up to `retry_concurrency` in all) and stop again
//! when a receive comes back empty; failures are the primary receiver's business.
//!
//! Retry messages are scheduled `retry_lead` before their due time (never before the next
//! whole second), so the loop has a burst in hand before it comes due: it reads each one's
//! ledger record when the message arrives, waits under the lock until the due time its body
//! carries, then claims the attempt with a write conditioned on that read's ETag (`If-Match`:
//! a record changed meanwhile fails the claim, which reads it afresh and decides on what it
//! says; storage down means no attempt, as before) and starts the attempt. At most
//! `retry_prefetch` messages are in hand.
//!
//! Admission is rationed: `retry_concurrency` slots, one per attempt, taken once the
//! attempt is claimed in the ledger and before the breaker is asked, and held until the
//! breaker has been told the attempt's outcome. However many held messages come due in one
//! instant, at most that many calls reach the downstream before a failure can trip the
//! breaker; the ledger's round trips before the call and settling the attempt after it do
//! not hold a slot, so the slots bound the downstream calls in flight (`retry_concurrency` ÷
//! the handler's latency is the drain's limit). A message waiting for a slot keeps its lock
//! renewed, and receivers pause while twice as many due messages as there are slots already
//! wait for one (a busy replica leaves the backlog to the others; one per slot would leave
//! slots idle while the next message is still in its ledger round trips, see
//! [`limits::DUE_PER_SLOT`]).
//!
//! One attempt per (key, attempt) at a time, whatever the copies: Service Bus hands a message
//! out again once its lock lapses, even while the first copy waits here for its due time.
//! Copies in hand are told apart by MessageId and sequence number ([`InHand`]): a newer
//! delivery of a message supersedes the older copy, which stands down before it claims
//! anything; another copy of the same attempt waits for the one that may run it. Across
//! replicas, the attempt is claimed in the ledger with compare-and-swap right before the
//! call ([`crate::ledger::Claim`]); the lock is checked before and after the claim.
//!
//! Settling (a ledger write and a complete) yields to the attempts due no later than its own
//! until they have started, at most [`SETTLE_YIELD_MAX`]: a burst that comes due in one
//! instant starts first and settles after, instead of every start queueing behind the
//! settlements of the ones before it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use tokio_util::sync::CancellationToken;

use super::health::RetryLoopState;
use super::Shared;
use crate::azure::ReceivedMessage;

mod limits;
mod locked;
mod recovery;
mod steps;

use limits::{DueWaiting, Limits};
use recovery::sweep_dead_letters;
use steps::process;

/// Consecutive receive failures before the watchdog takes over.
const RECONNECTS_BEFORE_WATCHDOG: u32 = 3;

/// What receivers hand the loop.
enum Work {
    /// A message to process, with its place among the messages in hand, counted as due
    /// and waiting until it is known to be early.
    Process(Box<ReceivedMessage>, OwnedSemaphorePermit, DueWaiting),
    /// Receives keep returning messages: start one more receiver.
    Grow,
}

/// Runs until `cancel` fires.
pub(crate) async fn run(shared: Arc<Shared>, cancel: CancellationToken) {
    let o = &shared.options;
    let limits = Arc::new(Limits {
        held: Arc::new(Semaphore::new(o.retry_prefetch.max(1))),
        attempts: Semaphore::new(o.retry_concurrency.max(1)),
        receivers: AtomicUsize::new(1),
        max_receivers: o.retry_concurrency.max(1),
        due_waiting: AtomicUsize::new(0),
        due_cap: limits::DUE_PER_SLOT * o.retry_concurrency.max(1),
        slot_taken: tokio::sync::Notify::new(),
        starting: Default::default(),
        started: tokio::sync::Notify::new(),
        in_hand: Arc::default(),
        instance: uuid::Uuid::new_v4().to_string(),
    });
    shared.health.set_retry_loop(RetryLoopState::Running);
    // Owned here: if this future is dropped (a crash), every receiver and attempt goes with it.
    let mut tasks = tokio::task::JoinSet::new();
    let (work_tx, mut work_rx) = tokio::sync::mpsc::unbounded_channel::<Work>();
    // Receivers hold the senders: the channel ends when the last one stops.
    let weak = work_tx.downgrade();
    tasks.spawn(receiver(
        shared.clone(),
        limits.clone(),
        cancel.clone(),
        work_tx,
        true,
    ));
    tasks.spawn(sweep_dead_letters(shared.clone(), cancel.clone()));
    loop {
        tokio::select! {
            work = work_rx.recv() => match work {
                Some(Work::Process(msg, held, waiting)) => {
                    let (shared, cancel, limits) = (shared.clone(), cancel.clone(), limits.clone());
                    tasks.spawn(async move {
                        process(*msg, &shared, &cancel, &limits, waiting).await;
                        drop(held);
                    });
                }
                Some(Work::Grow) => {
                    if let Some(tx) = weak.upgrade() {
                        tasks.spawn(receiver(shared.clone(), limits.clone(), cancel.clone(), tx, false));
                    } else {
                        limits.receivers.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                None => break,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    // Let in-flight attempts finish and settle; receivers stopped on `cancel`.
    while tasks.join_next().await.is_some() {}
    shared.health.set_retry_loop(RetryLoopState::Stopped);
}

/// Asks for one more receiver if the limit allows.
fn grow(limits: &Limits, work: &tokio::sync::mpsc::UnboundedSender<Work>) {
    let more = limits
        .receivers
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < limits.max_receivers).then_some(n + 1)
        })
        .is_ok();
    if more && work.send(Work::Grow).is_err() {
        limits.receivers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A receiver. The first (`primary`) runs until `cancel` and owns the loop's state: its
/// receive failures are retried with backoff, then by the watchdog. The others run while
/// receives return messages and the queue is healthy.
async fn receiver(
    shared: Arc<Shared>,
    limits: Arc<Limits>,
    cancel: CancellationToken,
    work: tokio::sync::mpsc::UnboundedSender<Work>,
    primary: bool,
) {
    let mut failures = 0u32;
    loop {
        if !primary && shared.health.retry_loop() != RetryLoopState::Running {
            break;
        }
        if !limits.room_for_due(&cancel).await {
            break;
        }
        // A replica with no share of the rate limit (it owns no partition) leaves the
        // retries to the replicas that have one.
        if let Some(l) = &shared.downstream.limiter {
            if !l.has_share(&cancel).await {
                break;
            }
        }
        let held = tokio::select! {
            _ = cancel.cancelled() => break,
            p = limits.held.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let received = tokio::select! {
            _ = cancel.cancelled() => break,
            r = shared.queue.receive(shared.options.retry_receive_wait) => r,
        };
        match received {
            Ok(Some(msg)) => {
                if primary && failures > 0 {
                    tracing::info!(failures, "retry loop recovered");
                    failures = 0;
                    shared.health.set_retry_loop(RetryLoopState::Running);
                }
                // `hubguard check`'s probe of the Send and Listen rights: not work. Completed
                // as it arrives, before anything reads the ledger or asks the handler.
                if let Some(id) = crate::azure::retry_queue::probe::probe_id(&msg) {
                    tracing::debug!(probe = %id, "completing a probe message of hubguard check (not a retry)");
                    locked::dispose(&msg, locked::Disposition::Complete).await;
                    continue;
                }
                let waiting = DueWaiting::new(limits.clone());
                if work
                    .send(Work::Process(Box::new(msg), held, waiting))
                    .is_err()
                {
                    break;
                }
                grow(&limits, &work);
            }
            Ok(None) => {
                if !primary {
                    break;
                }
                if failures > 0 {
                    failures = 0;
                    shared.health.set_retry_loop(RetryLoopState::Running);
                }
            }
            // The primary sees the same failure and changes the state.
            Err(_) if !primary => break,
            Err(e) => {
                drop(held);
                failures += 1;
                let error = e.to_string();
                let (state, wait) = if failures <= RECONNECTS_BEFORE_WATCHDOG {
                    (
                        RetryLoopState::Reconnecting { failures, error },
                        shared.options.reconnect_base * failures,
                    )
                } else {
                    (
                        RetryLoopState::Watchdog { failures, error },
                        shared.options.watchdog_interval,
                    )
                };
                tracing::warn!(failures, error = %e, "retry queue receive failed");
                shared.health.set_retry_loop(state);
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = shared.clock().sleep(wait) => {}
                }
            }
        }
    }
    if !primary {
        limits.receivers.fetch_sub(1, Ordering::AcqRel);
    }
}
