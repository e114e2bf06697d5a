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
//! renewed, and receivers pause while as many due messages as there are slots already wait
//! for one (a busy replica leaves the backlog to the others).
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
use std::time::{Duration, SystemTime};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::admission::Gate;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::backoff::{until_settled, Hold};
use super::health::RetryLoopState;
use super::settle::{Report, RetryMessage, Settled, Source};
use super::{attempt, Shared};
use crate::azure::{ReceivedMessage, RetryQueueError};
use crate::clock::at;
use crate::event::Deployment;
use crate::ledger::{LedgerError, Verdict};

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

/// The loop's limits, shared by its receivers and attempts.
struct Limits {
    /// Messages in hand (waiting for their due time, or running): `retry_prefetch`.
    held: Arc<Semaphore>,
    /// Attempts at once, each until the breaker has its outcome: `retry_concurrency`.
    attempts: Semaphore,
    /// Receivers polling now, and at most.
    receivers: AtomicUsize,
    max_receivers: usize,
    /// Messages past their due time waiting for an attempt slot (see [`DueWaiting`]).
    due_waiting: AtomicUsize,
    slot_taken: tokio::sync::Notify,
    /// Messages past their due time whose attempt has not started yet, by due time (ms):
    /// see [`Starting`].
    starting: std::sync::Mutex<std::collections::BTreeMap<i64, usize>>,
    started: tokio::sync::Notify,
    /// The copies of retry messages in hand, by (key, attempt): see [`Copy`].
    in_hand: Arc<InHand>,
    /// This process, in the claims it writes ([`crate::ledger::Claim`]).
    instance: String,
}

/// The copies of retry messages in hand, by the attempt they would run. Service Bus hands a
/// message out again once its lock lapses ("Message transfers, locks, and settlement":
/// peek-lock, learn.microsoft.com/azure/service-bus-messaging/message-transfers-locks-settlement),
/// even while the first copy still waits here for its due time; the same attempt can also
/// arrive under another MessageId (a recovered, rescued or deferred copy). Copies in hand are
/// told apart by MessageId and sequence number, and one attempt runs at a time: a copy waits
/// until every earlier copy of its attempt that could still run it is gone, and a copy that
/// a newer delivery of the same message superseded (its lock is gone) stands down before
/// claiming.
#[derive(Default)]
struct InHand {
    copies: std::sync::Mutex<std::collections::HashMap<(String, u32), Vec<CopyEntry>>>,
    next: std::sync::atomic::AtomicU64,
    gone: tokio::sync::Notify,
}

struct CopyEntry {
    id: u64,
    /// The message: its MessageId and its sequence number in the queue (a redelivery of a
    /// message keeps both; a message sent anew under the same MessageId, once the duplicate
    /// detection window has passed, is another message).
    message: (String, i64),
    /// Past the point of standing down: claiming or running the attempt.
    committed: bool,
}

impl InHand {
    fn copies(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<(String, u32), Vec<CopyEntry>>> {
        self.copies.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Copy {
    /// Counts a copy of attempt `attempt` of `key` in hand: `message` is its MessageId and
    /// sequence number.
    fn register(hand: &Arc<InHand>, key: &str, attempt: u32, message: (String, i64)) -> Self {
        let id = hand.next.fetch_add(1, Ordering::AcqRel);
        let slot = (key.to_string(), attempt);
        hand.copies()
            .entry(slot.clone())
            .or_default()
            .push(CopyEntry {
                id,
                message,
                committed: false,
            });
        Self {
            hand: hand.clone(),
            slot,
            id,
        }
    }
}

/// One copy of a retry message in hand (see [`InHand`]), until its task ends.
struct Copy {
    hand: Arc<InHand>,
    slot: (String, u32),
    id: u64,
}

impl Copy {
    /// Waits until no earlier copy of this attempt may still run it: one committed to it, or
    /// one of another message (with a lock of its own). An earlier delivery of this same
    /// message that has not committed never will (it is superseded), so it is not waited for.
    async fn earlier_gone(&self) {
        let hand = &self.hand;
        loop {
            let gone = hand.gone.notified();
            {
                let copies = hand.copies();
                let mine = copies.get(&self.slot).and_then(|v| {
                    v.iter()
                        .find(|c| c.id == self.id)
                        .map(|c| c.message.clone())
                });
                let blocking = copies.get(&self.slot).is_some_and(|v| {
                    v.iter().any(|c| {
                        c.id < self.id && (c.committed || Some(&c.message) != mine.as_ref())
                    })
                });
                if !blocking {
                    return;
                }
            }
            gone.await;
        }
    }

    /// Commits this copy to claiming and running its attempt; `false` when a newer delivery
    /// of the same message superseded it (Service Bus handed the message out again: this
    /// copy's lock is gone), and it must stand down.
    fn commit(&self) -> bool {
        let mut copies = self.hand.copies();
        let Some(v) = copies.get_mut(&self.slot) else {
            return false;
        };
        let Some(mine) = v.iter().position(|c| c.id == self.id) else {
            return false;
        };
        if v[mine].committed {
            return true;
        }
        let superseded = v
            .iter()
            .any(|c| c.id > self.id && c.message == v[mine].message);
        if superseded {
            return false;
        }
        v[mine].committed = true;
        true
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        let hand = &self.hand;
        {
            let mut copies = hand.copies();
            if let Some(v) = copies.get_mut(&self.slot) {
                v.retain(|c| c.id != self.id);
                if v.is_empty() {
                    copies.remove(&self.slot);
                }
            }
        }
        hand.gone.notify_waiters();
    }
}

/// Settling an attempt waits at most this long for due attempts to start first.
const SETTLE_YIELD_MAX: Duration = Duration::from_millis(250);

impl Limits {
    fn starting(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<i64, usize>> {
        self.starting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets the attempts due no later than this one (`due_ms`) start before its settlement
    /// (a ledger write and a complete) takes its share of the machine: when a burst comes
    /// due in one instant, every attempt of it starts first, then they settle. Attempts due
    /// later never hold it up, and it waits at most [`SETTLE_YIELD_MAX`]; the message stays
    /// locked meanwhile.
    async fn yield_to_starts(&self, due_ms: i64) {
        let wait = tokio::time::sleep(SETTLE_YIELD_MAX);
        tokio::pin!(wait);
        loop {
            let started = self.started.notified();
            if self
                .starting()
                .first_key_value()
                .is_none_or(|(d, _)| *d > due_ms)
            {
                return;
            }
            tokio::select! {
                _ = started => {}
                _ = &mut wait => return,
            }
        }
    }
}

/// One message past its due time whose attempt has not started: counted from the due time
/// until the attempt starts or the message leaves without one.
struct Starting<'a>(&'a Limits, i64);

impl<'a> Starting<'a> {
    fn new(limits: &'a Limits, due_ms: i64) -> Self {
        *limits.starting().entry(due_ms).or_default() += 1;
        Self(limits, due_ms)
    }
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        let mut starting = self.0.starting();
        let Some(n) = starting.get_mut(&self.1) else {
            return;
        };
        *n -= 1;
        // Waiters only care when every attempt due at some instant has started.
        if *n == 0 {
            starting.remove(&self.1);
            drop(starting);
            self.0.started.notify_waiters();
        }
    }
}

/// One message counted among the due ones waiting for an attempt slot: from the moment a
/// receiver has it in hand (so the next `room_for_due` sees it however late its task
/// starts), until its task finds it early (counted again at its due time) or takes a slot.
struct DueWaiting(Arc<Limits>);

impl DueWaiting {
    fn new(limits: Arc<Limits>) -> Self {
        limits.due_waiting.fetch_add(1, Ordering::AcqRel);
        Self(limits)
    }
}

impl Drop for DueWaiting {
    fn drop(&mut self) {
        self.0.due_waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.slot_taken.notify_waiters();
    }
}

impl Limits {
    /// Waits while as many messages as there are attempt slots are already due and waiting
    /// for one: taking more would only hold them locked here while other replicas, or this
    /// one's slots later, could run them. Messages that arrive early are not held back
    /// (`retry_prefetch` bounds those). `false` if `cancel` fires.
    async fn room_for_due(&self, cancel: &CancellationToken) -> bool {
        loop {
            let taken = self.slot_taken.notified();
            if self.due_waiting.load(Ordering::Acquire) < self.max_receivers {
                return true;
            }
            tokio::select! {
                _ = cancel.cancelled() => return false,
                _ = taken => {}
            }
        }
    }
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

/// Sweeps the dead-letter sub-queue at start and then every `dead_letter_sweep`, and with it
/// the ledger for overdue retries.
async fn sweep_dead_letters(shared: Arc<Shared>, cancel: CancellationToken) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = recover_overdue(&shared) => {}
        }
        loop {
            let received = tokio::select! {
                _ = cancel.cancelled() => return,
                r = shared.queue.receive_dead_lettered(Duration::ZERO) => r,
            };
            match received {
                Ok(Some(msg)) => rescue(msg, &shared).await,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the retry queue's dead-letter sub-queue; trying again at the next sweep");
                    break;
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = shared.clock().sleep(shared.options.dead_letter_sweep) => {}
        }
    }
}

/// The ledger is authoritative: a retry it records as RETRY_SCHEDULED whose due time passed
/// more than `overdue_margin` ago has no message that will run it — Service Bus dropped it
/// (a repeat MessageId after a ledger record was removed and written anew), or it was lost
/// some other way. Each is scheduled again, due now, under a fresh MessageId. The ledger's
/// due time moves to now first (compare-and-swap, so of several replicas sweeping only one
/// recovers it); a copy that still arrives is stale by then and only re-sends the recorded
/// attempt. Reads one listing of the pending index (the retries waiting, not the ledger's
/// history), and repairs the entries its records contradict.
async fn recover_overdue(shared: &Shared) {
    let ledger = &shared.settler.ledger;
    let pending = match ledger.pending().await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the ledger's pending retries; trying again at the next sweep");
            return;
        }
    };
    // Ordered retries: lines whose head settled for good while nobody advanced them (a head
    // still in the pending index is waiting: its record is not read). Also with ordering off
    // (one listing, empty unless it was on): lines left open when it was switched off still
    // drain, one event per sweep, instead of stranding what they parked.
    {
        let waiting: std::collections::HashSet<&str> =
            pending.iter().map(|p| p.key.as_str()).collect();
        let on_dead_letter = shared.options.retry_ordering.lines().unwrap_or_default();
        match super::lines::sweep(
            &shared.settler,
            on_dead_letter,
            Some(&shared.observe),
            &waiting,
        )
        .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(lines = n, "advanced lines whose head had settled"),
            Err(e) => {
                tracing::warn!(error = %e, "could not sweep the lines of ordered retries; trying again at the next sweep")
            }
        }
    }
    let now = shared.clock().now();
    let Some(overdue_before) = now.checked_sub(shared.options.overdue_margin) else {
        return;
    };
    for p in pending.into_iter().take_while(|p| p.due < overdue_before) {
        match shared.settler.recover(&p.key, overdue_before).await {
            Ok(true) => {
                tracing::warn!(key = %p.key, attempt = p.attempt, due = ?p.due, "a retry the ledger records was overdue with no message to run it; scheduled it again");
                shared.observe.count_recovered();
            }
            // Not overdue by its record, or no longer waiting: the index entry may be stale
            // (a crash between the record's write and the entry's); the record decides.
            Ok(false) => match ledger.repair_pending(&p).await {
                Ok(crate::ledger::Repair::Accurate) => {}
                Ok(repair) => {
                    tracing::info!(key = %p.key, ?repair, "repaired a stale pending index entry")
                }
                Err(e) => {
                    tracing::warn!(key = %p.key, error = %e, "could not check a pending index entry against its record; trying again at the next sweep")
                }
            },
            Err(e) => {
                tracing::warn!(key = %p.key, error = %e, "could not recover an overdue retry; trying again at the next sweep");
            }
        }
    }
}

/// The deployment `body` belongs to, when it is not this one. A message without one was sent
/// before deployments were named, when a queue served one deployment: this one's.
fn foreign<'b>(body: &'b RetryMessage, shared: &Shared) -> Option<&'b crate::event::Deployment> {
    let theirs = body.deployment.as_ref()?;
    let ours = shared.settler.deployment()?;
    (theirs.id != ours.id).then_some(theirs)
}

/// A retry whose ledger record is missing: the event read back from Event Hubs at the
/// position the message carries, and its record rebuilt (`Some`), or — when it is gone or
/// the message does not say where it was — the event dead-lettered as `record_missing`
/// (`None`). `Err` when Event Hubs or the ledger could not be asked: held and tried again.
async fn recover_missing(
    shared: &Shared,
    body: &RetryMessage,
) -> Result<Option<(crate::ledger::LedgerRecord, String)>, String> {
    let key = body.key();
    let gone = match &body.origin {
        None => "the retry message predates hubguard recording where events sit in Event Hubs, so the event cannot be read back".to_string(),
        Some(origin) => match shared
            .reader
            .read(&origin.partition, origin.sequence_number)
            .await?
        {
            super::readback::ReadBack::Found(event) if event.identity.idempotency_key == key => {
                return shared
                    .settler
                    .rebuild_missing(&event, body, origin)
                    .await
                    .map(Some)
                    .map_err(|e| e.to_string());
            }
            super::readback::ReadBack::Found(event) => format!(
                "partition {} sequence number {} holds another event now (key {})",
                origin.partition, origin.sequence_number, event.identity.idempotency_key
            ),
            super::readback::ReadBack::Gone(why) => why,
        },
    };
    tracing::error!(key = %key, attempt = body.attempt, reason = %gone, "a retry's ledger record is missing and its event cannot be read back from Event Hubs; dead-lettering it as record_missing");
    shared
        .settler
        .dead_letter_missing(body, &gone)
        .await
        .map_err(|e| e.to_string())?;
    Ok(None)
}

/// Takes one retry back from the dead-letter sub-queue. Whatever fails leaves it there,
/// locked until its lock lapses, for the next sweep: it is never dropped.
async fn rescue(msg: ReceivedMessage, shared: &Shared) {
    let Ok(body) = serde_json::from_str::<RetryMessage>(&msg.body) else {
        tracing::warn!(message_id = %msg.message_id, "a message in the retry queue's dead-letter sub-queue is not hubguard's; leaving it for an operator");
        return;
    };
    if foreign(&body, shared).is_some() {
        // Another deployment's: its own sweep puts it back. Left locked until the lock lapses.
        return;
    }
    let key = body.key();
    let put_back = match shared.settler.ledger.get(key).await {
        Err(e) => {
            tracing::warn!(key = %key, error = %e, "cannot read the ledger for a dead-lettered retry; leaving it for the next sweep");
            return;
        }
        // The ledger held the event (the message is a claim check) and its record is gone:
        // read the event back from Event Hubs and put the retry back, or dead-letter it as
        // `record_missing`. Anything failing leaves it for the next sweep.
        Ok(None) => match recover_missing(shared, &body).await {
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "a dead-lettered retry has no ledger record and recovering it failed; leaving it for the next sweep");
                return;
            }
            Ok(None) => {
                shared.observe.count_record_missing(key);
                Ok(())
            }
            Ok(Some((rec, _))) => {
                shared.observe.count_record_rebuilt();
                shared.observe.count_rescued();
                shared
                    .settler
                    .rescue(&rec, &body, msg.sequence_number)
                    .await
            }
        },
        Ok(Some((rec, _))) => match Verdict::of(Some(&rec), body.attempt) {
            Verdict::Final(_) | Verdict::Unrecorded => Ok(()),
            // Superseded: only the recorded next attempt matters (dropped if it exists).
            Verdict::Stale => shared
                .settler
                .resend_recorded(&rec, &body.traceparents)
                .await
                .map(drop),
            Verdict::Current => {
                tracing::warn!(key = %key, attempt = body.attempt, deliveries = msg.delivery_count, "Service Bus dead-lettered a retry; putting it back");
                shared.observe.count_rescued();
                shared
                    .settler
                    .rescue(&rec, &body, msg.sequence_number)
                    .await
            }
        },
    };
    match put_back {
        Ok(()) => dispose(&msg, Disposition::Complete).await,
        Err(e) => {
            tracing::warn!(key = %key, error = %e, "could not put a dead-lettered retry back; leaving it for the next sweep");
        }
    }
}

/// What becomes of a retry message in hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Disposition {
    /// Completed: its attempt is settled (or it had nothing left to do).
    Complete,
    /// Abandoned: Service Bus hands it out again at once (counting a delivery).
    Abandon,
}

/// Completes or abandons `msg`; a failure only means Service Bus redelivers it.
async fn dispose(msg: &ReceivedMessage, disposition: Disposition) {
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
struct LockedMessage<'s> {
    msg: ReceivedMessage,
    shared: &'s Shared,
    cancel: &'s CancellationToken,
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
    fn new(msg: ReceivedMessage, shared: &'s Shared, cancel: &'s CancellationToken) -> Self {
        Self {
            msg,
            shared,
            cancel,
        }
    }

    /// Completes or abandons the message.
    async fn dispose(&self, disposition: Disposition) {
        dispose(&self.msg, disposition).await;
    }

    /// How long until the lock should be renewed.
    fn renew_in(&self) -> Duration {
        (self.shared.clock().until(self.msg.locked_until) / 2).max(Duration::from_millis(500))
    }

    /// Renews the lock; `false` when it is lost and `on_lost` says to stop.
    async fn renew(&mut self, on_lost: OnLockLost) -> bool {
        match self.msg.renew().await {
            Ok(()) => true,
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

    /// Whether the lock still holds on the clock; says so when it lapsed.
    fn lock_held(&self) -> bool {
        let held = self.shared.clock().now() < self.msg.locked_until;
        if !held {
            tracing::warn!(message_id = %self.msg.message_id, "the lock on a retry waiting to start lapsed; leaving it to its next receiver");
        }
        held
    }

    /// Waits for `fut` under the lock, renewing it meanwhile. `None` if the loop stops first
    /// (the message abandoned, so Service Bus hands it to another replica at once), or if the
    /// lock is lost or lapsed (a stalled process, a step of the clock): Service Bus hands the
    /// message to another receiver, and running it here too would be a second attempt.
    async fn under_lock<T>(&mut self, fut: impl std::future::Future<Output = T>) -> Option<T> {
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
    /// half [`CLAIM_LEASE`](super::settle::CLAIM_LEASE), the attempt's `claimed` ledger claim.
    async fn running<T>(
        &mut self,
        claimed: &mut (crate::ledger::LedgerRecord, String),
        fut: impl std::future::Future<Output = T>,
    ) -> T {
        futures::pin_mut!(fut);
        let mut claim_renewal = self.shared.clock().now() + super::settle::CLAIM_LEASE / 2;
        loop {
            let renew_in = self.renew_in();
            tokio::select! {
                v = &mut fut => return v,
                _ = self.shared.clock().sleep(renew_in) => {
                    self.renew(OnLockLost::Continue).await;
                }
                _ = self.shared.clock().sleep_until(claim_renewal) => {
                    if let Err(e) = self.shared.settler.renew_claim(claimed).await {
                        tracing::warn!(key = %claimed.0.key, error = %e, "renewing the claim on a running attempt failed");
                    }
                    claim_renewal = self.shared.clock().now() + super::settle::CLAIM_LEASE / 2;
                }
            }
        }
    }

    /// Runs `op` until it succeeds, with backoff, holding the message (its lock renewed)
    /// meanwhile; readiness shows the hold while it lasts. `None` if the loop stops first
    /// (the message is abandoned then, so Service Bus redelivers it).
    async fn holding<T, E, F, Fut>(&mut self, key: &str, what: &str, op: F) -> Option<T>
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
    fn lateness(&self, due: SystemTime) -> Duration {
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

/// Hands a retry of another deployment (`theirs`, from a queue the two share) back to the
/// queue for its own deployment's receivers, unchanged: never run against this one's
/// ledger, never dropped.
async fn hand_back(msg: &mut LockedMessage<'_>, body: &RetryMessage, theirs: &Deployment) {
    let shared = msg.shared;
    let key = body.key();
    let forwards = msg
        .properties
        .get("hubguard-forwards")
        .and_then(|f| f.parse().ok())
        .unwrap_or(0u32);
    let raw = msg.body.clone();
    let seq = msg.sequence_number;
    // A hand-back Service Bus refuses for what it is (a MessageId past 128 characters
    // from a deployment id no hubguard writes, say) would be refused for ever: it does not
    // hold the message. Abandoned, it reaches the queue's dead-letter sub-queue at its
    // MaxDeliveryCount, where its own deployment's sweep takes it back ("Overview of
    // Service Bus dead-letter queues", https://learn.microsoft.com/azure/service-bus-messaging/service-bus-dead-letter-queues).
    let forwarded = msg
        .holding(
            key,
            "handing another deployment's retry back to the queue",
            || async {
                match shared
                    .settler
                    .forward(&raw, body, theirs, seq, forwards)
                    .await
                {
                    Err(e) if e.is_refusal_of_request() => Ok(Err(e)),
                    other => other.map(Ok),
                }
            },
        )
        .await;
    if let Some(Err(e)) = &forwarded {
        tracing::error!(key = %key, deployment = %theirs, error = %e, "Service Bus refused to take another deployment's retry back for what the message is; abandoning it, so Service Bus dead-letters it at the queue's MaxDeliveryCount and its deployment's sweep takes it from there");
        msg.dispose(Disposition::Abandon).await;
        return;
    }
    if forwarded.is_some() {
        shared.observe.count_forwarded();
        shared.health.saw_foreign(&theirs.to_string());
        if forwards + 1 == super::settle::FORWARD_FAST_HOPS {
            tracing::warn!(key = %key, deployment = %theirs, ours = ?shared.settler.deployment().map(ToString::to_string), "a retry of another deployment keeps coming back to this one: is that deployment running? its copies now wait longer between hand-backs");
        } else {
            tracing::debug!(key = %key, deployment = %theirs, "handed another deployment's retry back to the shared queue");
        }
        msg.dispose(Disposition::Complete).await;
    }
}

/// One retry message from its arrival to its settlement, as steps: [`due`] (its copy
/// registered, the record read early, the due time reached), [`validated`] (the record at
/// the due time decides), [`slotted`] (claimed, with an attempt slot), [`admitted`] (the
/// breaker and the rate limit), [`attempt_retry`] and [`settle_retry`]. Each step returns
/// the next one's value; the guards a step no longer needs (its place among the due ones
/// waiting, among the starting attempts, its slot) go when it returns.
async fn process(
    msg: ReceivedMessage,
    shared: &Shared,
    cancel: &CancellationToken,
    limits: &Arc<Limits>,
    waiting: DueWaiting,
) {
    let mut msg = LockedMessage::new(msg, shared, cancel);
    let body: RetryMessage = match serde_json::from_str(&msg.body) {
        Ok(b) => b,
        Err(e) => {
            // Never drop it: abandon, and Service Bus dead-letters it at its delivery limit.
            tracing::error!(message_id = %msg.message_id, error = %e, "retry message is not hubguard's format; abandoning");
            msg.dispose(Disposition::Abandon).await;
            return;
        }
    };
    // Another deployment's retry (a queue two deployments share): never run against this
    // one's ledger, never dropped. It goes back to the queue, unchanged, for its own
    // deployment's receivers.
    if let Some(theirs) = foreign(&body, shared) {
        drop(waiting);
        return hand_back(&mut msg, &body, theirs).await;
    }
    let Some(due) = due(&mut msg, limits, &body, waiting).await else {
        return;
    };
    let Due {
        copy,
        early,
        starting,
        waiting,
        due,
    } = due;
    let (rec, starting) = match validated(&mut msg, &body, early, starting).await {
        Ok(run) => run,
        Err(then) => return stand_down(&mut msg, &body, then).await,
    };
    let slotted = match slotted(&mut msg, limits, &copy, &body, rec, starting, waiting).await {
        Ok(s) => s,
        Err(Unclaimed::Gone) => return,
        Err(Unclaimed::Release(claimed)) => return shared.settler.release_claim(claimed).await,
        Err(Unclaimed::Superseded(claimed)) => {
            shared.settler.release_claim(claimed).await;
            tracing::info!(key = %body.key(), attempt = body.attempt, "an operator ran this attempt now; the copy scheduled before stands down");
            return msg.dispose(Disposition::Complete).await;
        }
    };
    let event = slotted.claimed.0.event.clone();
    let event_type = event.identity.event_type.as_deref();
    let ready = match admitted(&mut msg, slotted).await {
        Ok(ready) => ready,
        Err(NotAdmitted::Stopped) => return,
        Err(NotAdmitted::BreakerOpen(until)) => {
            shared.observe.count_deferred(event_type);
            return defer(&mut msg, &body, &event, until).await;
        }
        Err(NotAdmitted::NoShare) => {
            let until = shared.clock().now()
                + Duration::from_millis(1000 + u64::from(rand::random::<u16>() % 1000));
            return defer(&mut msg, &body, &event, until).await;
        }
    };
    shared.observe.count_attempt();
    // Lateness: how long after its due time the retry actually starts.
    shared.observe.retry_lateness(msg.lateness(due), event_type);
    let (attempted, claimed) = attempt_retry(&mut msg, &body, &event, ready).await;
    // The breaker knows the outcome and the slot is let go: the next attempt may ask it.
    limits.yield_to_starts(body.due_ms).await;
    settle_retry(&mut msg, &body, &event, &attempted, claimed).await;
}

/// A copy of a retry message at its due time, still in hand: its registration among the
/// copies in hand, the record read early, its place among the starting attempts and among
/// the due ones waiting for a slot.
struct Due<'l> {
    copy: Copy,
    early: Option<(crate::ledger::LedgerRecord, String)>,
    starting: Starting<'l>,
    waiting: DueWaiting,
    due: SystemTime,
}

/// Waits, under the message's lock, until no earlier copy of the attempt may run it and the
/// attempt is due. `None`: the lock was lost or the loop stopped.
async fn due<'l>(
    msg: &mut LockedMessage<'_>,
    limits: &'l Arc<Limits>,
    body: &RetryMessage,
    waiting: DueWaiting,
) -> Option<Due<'l>> {
    let shared = msg.shared;
    let key = body.key();
    let due = at(body.due_ms);
    // One attempt per (key, attempt) at a time among the copies in hand (see [`InHand`]).
    let copy = Copy::register(
        &limits.in_hand,
        key,
        body.attempt,
        (msg.message_id.clone(), msg.sequence_number),
    );
    msg.under_lock(copy.earlier_gone()).await?;
    // Received early (`retry_lead`): read the ledger now, while there is time, and wait for
    // the due time under the lock. What decides the attempt is still the ledger at the due
    // time: the record is re-validated then (a conditional read, no body while unchanged).
    // A failed or unreadable early read only means the full read happens at the due time.
    // Not due yet: it does not hold receivers back while it waits (`waiting` is let go).
    let waiting = (shared.clock().now() >= due).then_some(waiting);
    let early = match waiting {
        None => shared.settler.ledger.get(key).await.ok().flatten(),
        Some(_) => None,
    };
    msg.under_lock(shared.clock().sleep_until(due)).await?;
    let starting = Starting::new(limits, body.due_ms);
    let waiting = waiting.unwrap_or_else(|| DueWaiting::new(limits.clone()));
    let lateness = msg.lateness(due);
    tracing::debug!(key = %key, attempt = body.attempt, lateness_ms = lateness.as_millis() as u64, early = early.is_some(), "retry due");
    Some(Due {
        copy,
        early,
        starting,
        waiting,
        due,
    })
}

/// A claimed attempt with its attempt slot, held until the breaker knows the outcome (or no
/// call is made); `starting` until the attempt starts or is deferred.
struct Slotted<'l> {
    claimed: (crate::ledger::LedgerRecord, String),
    slot: tokio::sync::SemaphorePermit<'l>,
    starting: Option<Starting<'l>>,
}

/// Why a copy that validated does not go on to its attempt.
enum Unclaimed {
    /// Done without a claim to give back: it stood down, was settled as the record says, or
    /// the loop stopped.
    Gone,
    /// The lock was lost or the loop stopped after the claim: give the claim back.
    Release((crate::ledger::LedgerRecord, String)),
    /// An operator ran this attempt now: give the claim back and complete this copy.
    Superseded((crate::ledger::LedgerRecord, String)),
}

/// Claims the attempt, then takes its slot. The attempt is claimed in the ledger before the
/// call, so a copy of the message in another replica stands down; a lapsed lock or a newer
/// delivery of this message is noticed before the claim, and again before the call. The
/// copy stops counting among the due ones waiting for a slot (`waiting`) once it has one.
async fn slotted<'l>(
    msg: &mut LockedMessage<'_>,
    limits: &'l Limits,
    copy: &Copy,
    body: &RetryMessage,
    rec: (crate::ledger::LedgerRecord, String),
    starting: Starting<'l>,
    _waiting: DueWaiting,
) -> Result<Slotted<'l>, Unclaimed> {
    let mut starting = Some(starting);
    let Some(mut claimed) = claim(msg, limits, copy, body, rec, &mut starting).await else {
        return Err(Unclaimed::Gone);
    };
    if !msg.lock_held() {
        return Err(Unclaimed::Release(claimed));
    }
    if claimed.0.superseded_copy(body.attempt, body.run_now) {
        return Err(Unclaimed::Superseded(claimed));
    }
    // The attempt's slot, taken once the attempt is claimed (the claim renewed while it
    // waits), and held until the breaker knows the outcome (or no call is made): it bounds
    // the downstream calls in flight, not the ledger's round trips before them.
    let Some(slot) = slot_keeping_claim(msg, limits, &mut claimed).await else {
        return Err(Unclaimed::Release(claimed));
    };
    // `_waiting` goes on return: the copy has its slot.
    Ok(Slotted {
        claimed,
        slot,
        starting,
    })
}

/// A slotted attempt the breaker and the rate limit let run: what it waited for the rate.
struct Ready<'l> {
    claimed: (crate::ledger::LedgerRecord, String),
    slot: tokio::sync::SemaphorePermit<'l>,
    gate: Gate,
    waited: Duration,
}

/// Why the breaker or the rate limit does not let a slotted attempt run. The slot and the
/// copy's place among the starting attempts go before the deferral is written.
enum NotAdmitted {
    /// The breaker is open until then: deferred past it (the deferral gives the claim up in
    /// the same write).
    BreakerOpen(SystemTime),
    /// This replica has lost its share of the rate: deferred a second or two.
    NoShare,
    /// The lock was lost or the loop stopped.
    Stopped,
}

/// An open breaker defers the attempt past its expiry, without counting it. The rate limit:
/// the retry waits under its lock, uncounted; a replica that has lost its share of the rate
/// meanwhile defers it (a second or two) for the others, uncounted.
async fn admitted<'l>(
    msg: &mut LockedMessage<'_>,
    slotted: Slotted<'l>,
) -> Result<Ready<'l>, NotAdmitted> {
    let shared = msg.shared;
    let Slotted {
        claimed,
        slot,
        starting: _starting,
    } = slotted;
    let gate = shared.admit().await;
    if let Gate::Defer(until) = gate {
        return Err(NotAdmitted::BreakerOpen(until));
    }
    let cancel = msg.cancel;
    let waited = match msg.under_lock(shared.pace(cancel, false)).await {
        None | Some(None) => return Err(NotAdmitted::Stopped),
        Some(Some(crate::ratelimit::limiter::Acquired::NoShare)) => {
            return Err(NotAdmitted::NoShare)
        }
        Some(Some(crate::ratelimit::limiter::Acquired::Go(w))) => w,
    };
    // `_starting` goes on return: the attempt starts.
    Ok(Ready {
        claimed,
        slot,
        gate,
        waited,
    })
}

/// Defers the attempt of `event` until `until`, uncounted; the message is completed once
/// the deferral is written.
async fn defer(
    msg: &mut LockedMessage<'_>,
    body: &RetryMessage,
    event: &crate::event::Event,
    until: SystemTime,
) {
    let shared = msg.shared;
    let deferred = msg
        .holding(body.key(), "deferring the retry", || {
            shared
                .settler
                .defer(event, body.attempt, until, &body.traceparents)
        })
        .await;
    if deferred.is_some() {
        msg.dispose(Disposition::Complete).await;
    }
}

/// Runs the attempt under the message's lock, keeping the claim while the handler runs, and
/// tells the breaker its outcome; the slot goes when this returns. Returns the attempt and
/// the claimed record.
async fn attempt_retry(
    msg: &mut LockedMessage<'_>,
    body: &RetryMessage,
    event: &crate::event::Event,
    ready: Ready<'_>,
) -> (attempt::Attempted, (crate::ledger::LedgerRecord, String)) {
    let shared = msg.shared;
    let Ready {
        mut claimed,
        slot: _slot,
        gate,
        waited,
    } = ready;
    // The policy in force is the one pinned in the ledger at the first failure.
    let pinned = claimed.0.policy.clone();
    let cx = attempt::Context {
        consumer_group: &shared.origin.consumer_group,
        source: Source::Retry,
        policy: &pinned.name,
        max_attempts: pinned.max_attempts,
        clock: shared.clock(),
        rate_limit_wait: shared.downstream.limiter.as_ref().map(|_| waited),
    };
    // Keep the lock, and the claim, while the handler runs.
    let run = attempt::run(
        &shared.downstream.handler,
        event,
        body.attempt,
        &body.traceparents,
        cx,
    );
    let attempted = msg.running(&mut claimed, run).await;
    let event_type = event.identity.event_type.as_deref();
    shared.attempted(&attempted, gate, event_type).await;
    // The breaker knows the outcome: the next attempt may ask it (`slot` goes on return).
    (attempted, claimed)
}

/// Settles the attempt, starting from the record read at the due time, holding the message
/// while a settlement fails; completes the message once settled (a head of an ordered line
/// settled for good moves its line on first).
async fn settle_retry(
    msg: &mut LockedMessage<'_>,
    body: &RetryMessage,
    event: &crate::event::Event,
    attempted: &attempt::Attempted,
    (rec, etag): (crate::ledger::LedgerRecord, String),
) {
    let shared = msg.shared;
    let key = body.key();
    let mut trail = body.traceparents.clone();
    trail.push(attempted.traceparent.clone());
    let report = Report {
        event,
        attempt: body.attempt,
        source: Source::Retry,
        started: attempted.started,
        outcome: &attempted.outcome,
        trace_id: &attempted.trace_id,
        traceparents: &trail,
    };
    let settle = |read| {
        shared
            .settler
            .settle_from(read, &report)
            .instrument(attempted.span.clone())
    };
    // The first settlement starts from the record read at the due time (one read per
    // retry); one tried again after a failure reads afresh.
    let settled = match settle(Some((rec, etag))).await {
        Ok(s) => Ok(s),
        Err(e) => {
            shared.observe.settle_failed(&e);
            tracing::warn!(key = %key, error = %e, "settling the retry failed; holding it until it settles");
            match msg
                .holding(key, "settling the retry", || async {
                    settle(None)
                        .await
                        .inspect_err(|e| shared.observe.settle_failed_metric(e))
                })
                .await
            {
                Some(s) => Ok(s),
                None => Err(e),
            }
        }
    };
    attempt::finish(attempted, settled.as_ref());
    if let Ok(s) = settled {
        shared
            .observe
            .count_settled(&s, event.identity.event_type.as_deref());
        // Ordered retries: a head settled for good lets its line move on, before the message
        // is completed (a crash in between leaves a copy, whose `Final` verdict advances it).
        let settled_for_good = matches!(
            s,
            Settled::Delivered | Settled::DeadLettered(_) | Settled::AlreadyFinal(_)
        );
        if settled_for_good && !advance_line(msg, event).await {
            return;
        }
        msg.dispose(Disposition::Complete).await;
    }
}

/// What a due copy that does not run its attempt does instead. By the time it is done, the
/// copy's place among the starting attempts ([`Starting`]) is given up.
enum StandDown {
    /// Nothing more: the loop stopped (the message is abandoned) or the lock is gone.
    Leave,
    /// Complete the message.
    Complete,
    /// The event is final: advance its ordering key's line, then complete.
    AdvanceLine(Box<crate::event::Event>),
    /// The attempt already ran: make sure the recorded next attempt exists, then complete.
    Resend(Box<crate::ledger::LedgerRecord>),
}

/// The due step: the ledger record at the due time decides whether this copy runs its
/// attempt. `Ok` with the record and its ETag (and `starting`, still held) when it runs;
/// else what to do instead, with `starting` released on the way out.
async fn validated<'l>(
    msg: &mut LockedMessage<'_>,
    body: &RetryMessage,
    early: Option<(crate::ledger::LedgerRecord, String)>,
    starting: Starting<'l>,
) -> Result<((crate::ledger::LedgerRecord, String), Starting<'l>), StandDown> {
    let shared = msg.shared;
    let key = body.key();
    // The record at the due time. Read early, it is not read again: the claim below writes
    // with `If-Match` on its ETag, so a record changed since (an operator's action, another
    // copy's attempt) fails the claim, which reads it afresh and decides on what it says.
    // A record that cannot be parsed is set aside and its event dead-lettered (the message
    // carries only the key), never held forever.
    let current = match early {
        Some(read) => Some(read),
        None => {
            let Some(read) = msg
                .holding(key, "reading the ledger", || async {
                    match shared.settler.ledger.get(key).await {
                        Err(LedgerError::Corrupt { reason, .. }) => shared
                            .settler
                            .ledger
                            .quarantine(key, None, &reason, shared.clock().now())
                            .await
                            .map(|_| None),
                        other => other.map(Some),
                    }
                })
                .await
            else {
                return Err(StandDown::Leave);
            };
            let Some(read) = read else {
                shared.observe.count_dead_lettered(None);
                return Err(StandDown::Complete);
            };
            read
        }
    };
    let verdict = Verdict::of(current.as_ref().map(|(r, _)| r), body.attempt);
    let rec = match current {
        Some((rec, _)) if matches!(verdict, Verdict::Final(_)) => {
            tracing::info!(key = %key, state = ?rec.state, "event already final; completing the retry without calling the handler");
            // A copy after a crash between the settlement and the line's advance.
            return Err(StandDown::AdvanceLine(Box::new(rec.event)));
        }
        // Stale: attempt `body.attempt` already ran. Make sure the recorded next one exists.
        Some((rec, _)) if verdict == Verdict::Stale => {
            return Err(StandDown::Resend(Box::new(rec)))
        }
        Some(read) => read,
        None => {
            // The ledger is written before any retry message is sent, and the event lives
            // there (the message is a claim check): a message without a record means the
            // record was removed by hand. The message says where the event sits in Event
            // Hubs: read it back and rebuild the record, or, if it is gone, dead-letter it
            // as `record_missing` — never drop it silently.
            let Some(recovered) = msg
                .holding(
                    key,
                    "recovering the missing ledger record from Event Hubs",
                    || recover_missing(shared, body),
                )
                .await
            else {
                return Err(StandDown::Leave);
            };
            match recovered {
                Some(read) if Verdict::of(Some(&read.0), body.attempt) == Verdict::Current => {
                    tracing::warn!(key = %key, attempt = body.attempt, "a retry's ledger record was missing; rebuilt it from the event read back from Event Hubs");
                    shared.observe.count_record_rebuilt();
                    read
                }
                // A record appeared meanwhile (a replay from Event Hubs) and says this attempt
                // is not the one waiting: final, or superseded (its recorded next attempt is
                // made sure of, as for any stale copy).
                Some((rec, _)) => {
                    return Err(match Verdict::of(Some(&rec), body.attempt) {
                        Verdict::Stale => StandDown::Resend(Box::new(rec)),
                        _ => StandDown::Complete,
                    });
                }
                None => {
                    shared.observe.count_record_missing(key);
                    shared.observe.count_dead_lettered(None);
                    return Err(StandDown::Complete);
                }
            }
        }
    };
    // An operator ran this attempt now (`retries retry-now`, or a replay): this is a copy
    // scheduled before, and the copy sent for the pull is the one that runs.
    if rec.0.superseded_copy(body.attempt, body.run_now) {
        tracing::info!(key = %key, attempt = body.attempt, "an operator ran this attempt now; the copy scheduled before stands down");
        return Err(StandDown::Complete);
    }
    Ok((rec, starting))
}

/// Does what a copy that stands down does instead of its attempt.
async fn stand_down(msg: &mut LockedMessage<'_>, body: &RetryMessage, then: StandDown) {
    let shared = msg.shared;
    let done = match then {
        StandDown::Leave => false,
        StandDown::Complete => true,
        StandDown::AdvanceLine(event) => advance_line(msg, &event).await,
        StandDown::Resend(rec) => msg
            .holding(body.key(), "re-sending the recorded retry", || {
                shared.settler.resend_recorded(&rec, &body.traceparents)
            })
            .await
            .is_some(),
    };
    if done {
        msg.dispose(Disposition::Complete).await;
    }
}

/// Ordered retries: advances the line of `event`'s ordering key after `event` settled for good
/// (see `pipeline::lines`), holding the message while blob storage or Service Bus fails.
/// `false` if the loop stopped first (the message is left to its next receiver).
async fn advance_line(msg: &mut LockedMessage<'_>, event: &crate::event::Event) -> bool {
    let shared = msg.shared;
    let Some(on_dead_letter) = shared.options.retry_ordering.lines() else {
        return true;
    };
    let Some(ordering_key) = shared.options.ordering.of(event) else {
        return true;
    };
    msg.holding(
        &event.identity.idempotency_key,
        "advancing the line of the event's ordering key",
        || {
            super::lines::advance(
                &shared.settler,
                event,
                ordering_key,
                on_dead_letter,
                Some(&shared.observe),
            )
        },
    )
    .await
    .is_some()
}

/// Takes an attempt slot for a claimed attempt, under the message's lock, renewing the claim
/// every half lease while it waits (a burst larger than the slots waits here, claimed, so
/// another replica's copy stands down instead of running it). `None`: the lock was lost or
/// the loop stopped.
async fn slot_keeping_claim<'l>(
    msg: &mut LockedMessage<'_>,
    limits: &'l Limits,
    claimed: &mut (crate::ledger::LedgerRecord, String),
) -> Option<tokio::sync::SemaphorePermit<'l>> {
    let shared = msg.shared;
    loop {
        let renew_at = shared.clock().now() + super::settle::CLAIM_LEASE / 2;
        let got = msg
            .under_lock(async {
                tokio::select! {
                    s = limits.attempts.acquire() => Some(s),
                    _ = shared.clock().sleep_until(renew_at) => None,
                }
            })
            .await?;
        match got {
            Some(s) => return s.ok(),
            None => {
                if let Err(e) = shared.settler.renew_claim(claimed).await {
                    tracing::warn!(key = %claimed.0.key, error = %e, "renewing the claim of a retry waiting for an attempt slot failed");
                }
            }
        }
    }
}

/// Claims attempt `body.attempt` for this copy ([`Settler::claim`](super::settle::Settler::claim)),
/// starting from the record `read` at the due time. `Some` with the claimed record and its
/// ETag when this copy runs the attempt; `None` when it is done without running it: it stood
/// down (superseded, or its lock lapsed), the record no longer waits for this attempt (the
/// message is settled as the record says), or the loop stopped. While another process holds
/// a live claim, the copy waits under its lock — without an attempt slot — until the claim
/// expires, then claims again.
async fn claim<'l>(
    msg: &mut LockedMessage<'_>,
    limits: &'l Limits,
    copy: &Copy,
    body: &RetryMessage,
    read: (crate::ledger::LedgerRecord, String),
    starting: &mut Option<Starting<'l>>,
) -> Option<(crate::ledger::LedgerRecord, String)> {
    use super::settle::Claimed;
    let shared = msg.shared;
    let key = body.key();
    let mut read = Some(read);
    loop {
        if !msg.lock_held() {
            return None;
        }
        if !copy.commit() {
            tracing::info!(key = %key, attempt = body.attempt, message_id = %msg.message_id, "Service Bus handed this retry out again (its lock lapsed); the newer copy runs the attempt");
            return None;
        }
        let claimed = msg
            .holding(key, "claiming the attempt", || {
                shared.settler.claim(
                    key,
                    body.attempt,
                    read.take(),
                    &shared.options.owner_id,
                    &limits.instance,
                )
            })
            .await?;
        match claimed {
            Claimed::Mine(claimed) => return Some(*claimed),
            Claimed::Busy(until) => {
                drop(starting.take());
                tracing::info!(key = %key, attempt = body.attempt, until = %crate::clock::rfc3339(until), "another replica runs this attempt; waiting for its claim to settle or expire");
                msg.under_lock(shared.clock().sleep_until(until)).await?;
            }
            Claimed::Changed(verdict, rec) => {
                drop(starting.take());
                match (verdict, rec) {
                    (Verdict::Final(_), _) => msg.dispose(Disposition::Complete).await,
                    (Verdict::Stale, Some(rec)) => {
                        let scheduled = msg
                            .holding(key, "re-sending the recorded retry", || {
                                shared.settler.resend_recorded(&rec, &body.traceparents)
                            })
                            .await;
                        if scheduled.is_some() {
                            msg.dispose(Disposition::Complete).await;
                        }
                    }
                    _ => {
                        tracing::error!(key = %key, message_id = %msg.message_id, "the ledger record of a retry vanished before its attempt; abandoning it to Service Bus's dead-letter sub-queue");
                        msg.dispose(Disposition::Abandon).await;
                    }
                }
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(hand: &Arc<InHand>, id: &str, seq: i64) -> Copy {
        Copy::register(hand, "k", 2, (id.to_string(), seq))
    }

    async fn waits(c: &Copy) -> bool {
        tokio::time::timeout(Duration::from_millis(1), c.earlier_gone())
            .await
            .is_err()
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_supersedes_the_copy_it_replaces_and_other_copies_take_turns() {
        let hand = Arc::new(InHand::default());
        // Service Bus hands the same message out again: the first copy, not yet committed,
        // stands down, and the new one need not wait for it.
        let first = copy(&hand, "k-attempt-2", 7);
        let again = copy(&hand, "k-attempt-2", 7);
        assert!(!waits(&again).await);
        assert!(!first.commit(), "superseded");
        assert!(again.commit());
        // Another message for the same attempt (a recovered copy) waits while one is
        // committed, and goes once it is gone.
        let recovered = copy(&hand, "k-attempt-2-recovered-1", 9);
        assert!(waits(&recovered).await);
        drop(first);
        assert!(
            waits(&recovered).await,
            "the committed copy is still in hand"
        );
        drop(again);
        assert!(!waits(&recovered).await);
        assert!(recovered.commit());
        // A redelivery of a committed copy waits for it (the attempt runs once).
        let late = copy(&hand, "k-attempt-2-recovered-1", 9);
        assert!(waits(&late).await);
        assert!(recovered.commit(), "committed stays committed");
        drop(recovered);
        assert!(!waits(&late).await);
        // A message sent anew under the same MessageId is another message: it waits.
        let anew = copy(&hand, "k-attempt-2-recovered-1", 12);
        assert!(late.commit(), "not superseded by another message");
        assert!(waits(&anew).await);
        drop((late, anew));
        assert!(hand.copies().is_empty());
    }
}
