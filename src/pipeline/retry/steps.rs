//! One retry message from its arrival to its settlement, as typed steps.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::azure::ReceivedMessage;
use crate::clock::at;
use crate::event::Deployment;
use crate::ledger::{LedgerError, LedgerRecord, Verdict, Versioned};
use crate::pipeline::admission::Gate;
use crate::pipeline::lines::{Advanced, LineHook, StepFuture, UntilDone};
use crate::pipeline::settle::{Report, RetryMessage, Settled, Source};
use crate::pipeline::{attempt, Shared};

use super::{
    limits::{Copy, DueWaiting, Limits, Starting},
    locked::{Disposition, LockedMessage},
    recovery::recover_missing,
};

/// The deployment `body` belongs to, when it is not this one. A message without one was sent
/// before deployments were named, when a queue served one deployment: this one's.
pub(super) fn foreign<'b>(
    body: &'b RetryMessage,
    shared: &Shared,
) -> Option<&'b crate::event::Deployment> {
    let theirs = body.deployment.as_ref()?;
    let ours = shared.settler.deployment()?;
    (theirs.id != ours.id).then_some(theirs)
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
        if forwards + 1 == crate::pipeline::settle::FORWARD_FAST_HOPS {
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
pub(super) async fn process(
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
    let event = slotted.claimed.value.event.clone();
    let event_type = event.identity.event_type.as_deref();
    let ready = match admitted(&mut msg, slotted).await {
        Ok(ready) => ready,
        Err(NotAdmitted::Stopped) => return,
        Err(NotAdmitted::BreakerOpen(until)) => {
            shared.observe.count_deferred(event_type);
            return defer(&mut msg, &body, &event, until).await;
        }
        Err(NotAdmitted::Paused(p)) => {
            // An operator's pause: looked at again after the recheck, never counted as an
            // attempt; the partition it came from is long checkpointed and not held.
            let until = shared.clock().now() + shared.options.retry_pause_recheck;
            tracing::info!(key = %body.key(), attempt = body.attempt, paused_by = %p.pause.by, pause = %p.filter, "retry paused by an operator; deferred without counting an attempt");
            shared.observe.count_paused(event_type);
            return defer(&mut msg, &body, &event, until).await;
        }
        Err(NotAdmitted::StormHeld(until)) => {
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
    let trial = ready.trial;
    let (attempted, claimed) = attempt_retry(&mut msg, &body, &event, ready).await;
    // The breaker knows the outcome and the slot is let go: the next attempt may ask it.
    limits.yield_to_starts(body.due_ms).await;
    if storm_held(&msg, &body, &event, &attempted, &claimed, trial).await {
        // Refused (or out of attempts) while the storm guard holds: not dead-lettered, but
        // deferred past the guard's next trial without counting the attempt.
        let until = shared.storm_resume_at(event_type);
        return defer(&mut msg, &body, &event, until).await;
    }
    settle_retry(&mut msg, &body, &event, &attempted, claimed).await;
}

/// A copy of a retry message at its due time, still in hand: its registration among the
/// copies in hand, the record read early, its place among the starting attempts and among
/// the due ones waiting for a slot.
struct Due<'l> {
    copy: Copy,
    early: Option<Versioned<LedgerRecord>>,
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
    claimed: Versioned<LedgerRecord>,
    slot: tokio::sync::SemaphorePermit<'l>,
    starting: Option<Starting<'l>>,
}

/// Why a copy that validated does not go on to its attempt.
enum Unclaimed {
    /// Done without a claim to give back: it stood down, was settled as the record says, or
    /// the loop stopped.
    Gone,
    /// The lock was lost or the loop stopped after the claim: give the claim back.
    Release(Versioned<LedgerRecord>),
    /// An operator ran this attempt now: give the claim back and complete this copy.
    Superseded(Versioned<LedgerRecord>),
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
    rec: Versioned<LedgerRecord>,
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
    if claimed.value.superseded_copy(body.attempt, body.run_now) {
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
    claimed: Versioned<LedgerRecord>,
    slot: tokio::sync::SemaphorePermit<'l>,
    gate: Gate,
    waited: Duration,
    /// The storm guard's trial this attempt is, if one.
    trial: Option<i64>,
}

/// Why the breaker or the rate limit does not let a slotted attempt run. The slot and the
/// copy's place among the starting attempts go before the deferral is written.
enum NotAdmitted {
    /// The breaker is open until then: deferred past it (the deferral gives the claim up in
    /// the same write).
    BreakerOpen(SystemTime),
    /// An operator paused it (`hubguard retries pause`): deferred by the recheck interval.
    Paused(crate::pipeline::control::RetryPause),
    /// The storm guard holds until then: deferred past it, uncounted.
    StormHeld(SystemTime),
    /// This replica has lost its share of the rate: deferred a second or two.
    NoShare,
    /// The lock was lost or the loop stopped.
    Stopped,
}

/// An operator's pause of the retry defers it (by `retry.pause_recheck_ms`), and an open
/// breaker past its expiry, neither counting an attempt. The rate limit:
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
    let rec = &claimed.value;
    let paused = shared
        .pauses
        .borrow()
        .retry_pause(
            &rec.key,
            rec.event_type.as_deref(),
            rec.last_error.as_deref(),
        )
        .cloned();
    if let Some(p) = paused {
        return Err(NotAdmitted::Paused(p));
    }
    let gate = shared.admit().await;
    if let Gate::Defer(until) = gate {
        return Err(NotAdmitted::BreakerOpen(until));
    }
    let trial = match shared.storm_admit(&claimed.value.event).await {
        crate::breaker::storm::StormGate::Run { trial } => trial,
        crate::breaker::storm::StormGate::Wait(_) => {
            let event_type = claimed.value.event.identity.event_type.as_deref();
            return Err(NotAdmitted::StormHeld(shared.storm_resume_at(event_type)));
        }
    };
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
        trial,
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

/// Whether the storm guard holds this retry's outcome instead of letting it dead-letter.
async fn storm_held(
    msg: &LockedMessage<'_>,
    body: &RetryMessage,
    event: &crate::event::Event,
    attempted: &attempt::Attempted,
    claimed: &Versioned<LedgerRecord>,
    trial: Option<i64>,
) -> bool {
    let report = Report {
        event,
        attempt: body.attempt,
        source: Source::Retry,
        started: attempted.started,
        outcome: &attempted.outcome,
        trace_id: &attempted.trace_id,
        traceparents: &body.traceparents,
    };
    msg.shared
        .storm_verdict(&report, Some(&claimed.value), trial)
        .await
        == crate::breaker::storm::StormVerdict::Hold
}

/// Runs the attempt under the message's lock, keeping the claim while the handler runs, and
/// tells the breaker its outcome; the slot goes when this returns. Returns the attempt and
/// the claimed record.
async fn attempt_retry(
    msg: &mut LockedMessage<'_>,
    body: &RetryMessage,
    event: &crate::event::Event,
    ready: Ready<'_>,
) -> (attempt::Attempted, Versioned<LedgerRecord>) {
    let shared = msg.shared;
    let Ready {
        mut claimed,
        slot: _slot,
        gate,
        waited,
        trial: _,
    } = ready;
    // The policy in force is the one pinned in the ledger at the first failure.
    let pinned = claimed.value.policy.clone();
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
    read: Versioned<LedgerRecord>,
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
    let settled = match settle(Some(read)).await {
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
        if advance_line(msg, event, &s).await == Advanced::Stopped {
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
    /// The event is final (its record): advance its ordering key's line, then complete.
    AdvanceLine(Box<crate::ledger::LedgerRecord>),
    /// The attempt already ran: make sure the recorded next attempt exists, then complete.
    Resend(Box<crate::ledger::LedgerRecord>),
}

/// The due step: the ledger record at the due time decides whether this copy runs its
/// attempt. `Ok` with the record and its ETag (and `starting`, still held) when it runs;
/// else what to do instead, with `starting` released on the way out.
async fn validated<'l>(
    msg: &mut LockedMessage<'_>,
    body: &RetryMessage,
    early: Option<Versioned<LedgerRecord>>,
    starting: Starting<'l>,
) -> Result<(Versioned<LedgerRecord>, Starting<'l>), StandDown> {
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
    let verdict = Verdict::of(current.as_ref().map(|r| &r.value), body.attempt);
    let rec = match current {
        Some(Versioned { value: rec, .. }) if matches!(verdict, Verdict::Final(_)) => {
            tracing::info!(key = %key, state = ?rec.state(), "event already final; completing the retry without calling the handler");
            // A copy after a crash between the settlement and the line's advance.
            return Err(StandDown::AdvanceLine(Box::new(rec)));
        }
        // Stale: attempt `body.attempt` already ran. Make sure the recorded next one exists.
        Some(Versioned { value: rec, .. }) if verdict == Verdict::Stale => {
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
                Some(read) if Verdict::of(Some(&read.value), body.attempt) == Verdict::Current => {
                    tracing::warn!(key = %key, attempt = body.attempt, "a retry's ledger record was missing; rebuilt it from the event read back from Event Hubs");
                    shared.observe.count_record_rebuilt();
                    read
                }
                // A record appeared meanwhile (a replay from Event Hubs) and says this attempt
                // is not the one waiting: final, or superseded (its recorded next attempt is
                // made sure of, as for any stale copy).
                Some(Versioned { value: rec, .. }) => {
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
    if rec.value.superseded_copy(body.attempt, body.run_now) {
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
        StandDown::AdvanceLine(rec) => {
            advance_line(msg, &rec.event, &Settled::AlreadyFinal(rec.state())).await
                == Advanced::Done
        }
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

/// Ordered retries' hook after a retry of `event` settled as `settled` (see
/// `pipeline::lines`): settled for good, it moves its key's line on, holding the message
/// while blob storage or Service Bus fails. `Stopped` if the loop stopped first (the message
/// is left to its next receiver).
async fn advance_line(
    msg: &mut LockedMessage<'_>,
    event: &crate::event::Event,
    settled: &Settled,
) -> Advanced {
    let lines = LineHook::for_retries(msg.shared);
    let place = lines.retry_place(event);
    let mut hold = HoldMessage {
        msg,
        key: &event.identity.idempotency_key,
    };
    lines.after_settled(event, place, settled, &mut hold).await
}

/// The retry message held while a line step for `key` fails.
struct HoldMessage<'m, 's> {
    msg: &'m mut LockedMessage<'s>,
    key: &'m str,
}

impl UntilDone for HoldMessage<'_, '_> {
    async fn until_done<'f, T: Send>(
        &'f mut self,
        what: &'static str,
        op: &'f mut (dyn FnMut() -> StepFuture<'f, T> + Send + 'f),
    ) -> Option<T> {
        self.msg.holding(self.key, what, op).await
    }
}

/// Takes an attempt slot for a claimed attempt, under the message's lock, renewing the claim
/// every half lease while it waits (a burst larger than the slots waits here, claimed, so
/// another replica's copy stands down instead of running it). `None`: the lock was lost or
/// the loop stopped.
async fn slot_keeping_claim<'l>(
    msg: &mut LockedMessage<'_>,
    limits: &'l Limits,
    claimed: &mut Versioned<LedgerRecord>,
) -> Option<tokio::sync::SemaphorePermit<'l>> {
    let shared = msg.shared;
    loop {
        let renew_at = shared.clock().now() + crate::pipeline::settle::CLAIM_LEASE / 2;
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
                    tracing::warn!(key = %claimed.value.key, error = %e, "renewing the claim of a retry waiting for an attempt slot failed");
                }
            }
        }
    }
}

/// Claims attempt `body.attempt` for this copy ([`Settler::claim`](crate::pipeline::settle::Settler::claim)),
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
    read: Versioned<LedgerRecord>,
    starting: &mut Option<Starting<'l>>,
) -> Option<Versioned<LedgerRecord>> {
    use crate::pipeline::settle::Claimed;
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
