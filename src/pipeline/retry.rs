//! The retry loop: receive due retry messages from Service Bus, run the attempt, settle it,
//! then *complete* the message (never abandon after scheduling the next attempt, which would
//! make a second copy); if settling fails, *abandon* so Service Bus redelivers it.
//! The ledger decides: a message for an event already delivered or dead-lettered is completed
//! without calling the handler, and a stale message (its attempt already recorded) only
//! re-sends the recorded next attempt.
//!
//! The loop never dies silently (seed 000's three layers): receive errors are retried at
//! once with backoff, then by a watchdog at a slow pace; the state shows in readiness.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::Semaphore;

use crate::breaker::Admission;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::health::RetryLoopState;
use super::settle::{RetryMessage, Source};
use super::{attempt, Shared};
use crate::azure::ReceivedMessage;
use crate::ledger::{at, State};

/// Consecutive receive failures before the watchdog takes over.
const RECONNECTS_BEFORE_WATCHDOG: u32 = 3;

/// Runs until `cancel` fires.
pub(crate) async fn run(shared: Arc<Shared>, cancel: CancellationToken) {
    let slots = Arc::new(Semaphore::new(shared.options.retry_concurrency.max(1)));
    let mut failures = 0u32;
    shared.health.set_retry_loop(RetryLoopState::Running);
    loop {
        let permit = tokio::select! {
            _ = cancel.cancelled() => break,
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let received = tokio::select! {
            _ = cancel.cancelled() => break,
            r = shared.queue.receive(shared.options.retry_receive_wait) => r,
        };
        match received {
            Ok(Some(msg)) => {
                if failures > 0 {
                    tracing::info!(failures, "retry loop recovered");
                    failures = 0;
                    shared.health.set_retry_loop(RetryLoopState::Running);
                }
                let shared = shared.clone();
                tokio::spawn(async move {
                    process(msg, &shared).await;
                    drop(permit);
                });
            }
            Ok(None) => {
                if failures > 0 {
                    failures = 0;
                    shared.health.set_retry_loop(RetryLoopState::Running);
                }
            }
            Err(e) => {
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
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
    // Let in-flight attempts finish and settle.
    let _ = slots
        .acquire_many(shared.options.retry_concurrency.max(1) as u32)
        .await;
    shared.health.set_retry_loop(RetryLoopState::Stopped);
}

async fn settle_message(msg: &ReceivedMessage, complete: bool) {
    let r = if complete {
        msg.complete().await
    } else {
        msg.abandon().await
    };
    if let Err(e) = r {
        tracing::warn!(message_id = %msg.message_id, error = %e, complete, "could not settle the retry message; Service Bus will redeliver it");
    }
}

async fn process(mut msg: ReceivedMessage, shared: &Shared) {
    let body: RetryMessage = match serde_json::from_str(&msg.body) {
        Ok(b) => b,
        Err(e) => {
            // Never drop it: abandon, and Service Bus dead-letters it at its delivery limit.
            tracing::error!(message_id = %msg.message_id, error = %e, "retry message is not hubguard's format; abandoning");
            settle_message(&msg, false).await;
            return;
        }
    };
    let event = body.event.clone();
    let key = &event.identity.idempotency_key;
    let lateness = SystemTime::now()
        .duration_since(at(body.due_ms))
        .unwrap_or_default();
    tracing::debug!(key = %key, attempt = body.attempt, lateness_ms = lateness.as_millis() as u64, "retry due");
    match shared.settler.ledger.get(key).await {
        Err(e) => {
            tracing::warn!(key = %key, error = %e, "ledger unavailable; abandoning the retry message for redelivery");
            settle_message(&msg, false).await;
            return;
        }
        Ok(Some((rec, _))) if rec.state != State::RetryScheduled => {
            tracing::info!(key = %key, state = ?rec.state, "event already final; completing the retry without calling the handler");
            settle_message(&msg, true).await;
            return;
        }
        Ok(Some((rec, _))) if rec.attempts >= body.attempt => {
            // Stale: attempt `body.attempt` already ran. Make sure the recorded next one exists.
            let due = rec.next_attempt_at().unwrap_or_else(SystemTime::now);
            match shared
                .settler
                .schedule(&rec.event, rec.attempts + 1, due, &body.traceparents)
                .await
            {
                Ok(()) => settle_message(&msg, true).await,
                Err(_) => settle_message(&msg, false).await,
            }
            return;
        }
        Ok(_) => {}
    }
    // An open breaker defers the attempt past its expiry, without counting it.
    let mut probe = false;
    if let Some(b) = &shared.breaker {
        match b.admit(rand::random::<f64>()).await {
            Admission::Allow => {}
            Admission::Probe => probe = true,
            Admission::Defer(until) => {
                shared.metrics.deferred.add(
                    1,
                    &crate::telemetry::type_label(event.identity.event_type.as_deref()),
                );
                match shared
                    .settler
                    .defer(&event, body.attempt, until, &body.traceparents)
                    .await
                {
                    Ok(()) => settle_message(&msg, true).await,
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "deferring failed; abandoning for redelivery");
                        settle_message(&msg, false).await;
                    }
                }
                return;
            }
        }
    }
    shared.health.count(&shared.health.counters.attempts);
    // Lateness: how long after its due time the retry actually starts.
    shared.metrics.retry_lateness.record(
        SystemTime::now()
            .duration_since(at(body.due_ms))
            .unwrap_or_default()
            .as_secs_f64(),
        &crate::telemetry::type_label(event.identity.event_type.as_deref()),
    );
    // The policy in force is the one pinned in the ledger at the first failure.
    let pinned = match shared.settler.ledger.get(key).await {
        Ok(Some((rec, _))) => rec.policy,
        _ => shared
            .settler
            .policies()
            .for_type(event.identity.event_type.as_deref())
            .clone(),
    };
    let cx = attempt::Context {
        consumer_group: &shared.consumer_group,
        source: Source::Retry,
        policy: &pinned.name,
        max_attempts: pinned.max_attempts,
    };
    // Keep the lock while the handler runs.
    let attempted = {
        let run = attempt::run(
            &shared.handler,
            &event,
            body.attempt,
            &body.traceparents,
            cx,
        );
        futures::pin_mut!(run);
        loop {
            let renew_in = msg
                .locked_until
                .duration_since(SystemTime::now())
                .unwrap_or_default()
                / 2;
            tokio::select! {
                a = &mut run => break a,
                _ = tokio::time::sleep(renew_in.max(Duration::from_millis(500))) => {
                    if let Err(e) = msg.renew().await {
                        tracing::warn!(key = %key, error = %e, "lock renewal failed");
                    }
                }
            }
        }
    };
    if let Some(b) = &shared.breaker {
        b.report(
            !super::partition::transient_failure(&attempted.outcome),
            probe,
        )
        .await;
    }
    shared.metrics.handler_duration.record(
        attempted.duration.as_secs_f64(),
        &crate::telemetry::type_label(event.identity.event_type.as_deref()),
    );
    let mut trail = body.traceparents.clone();
    trail.push(attempted.traceparent.clone());
    let settled = shared
        .settler
        .settle(
            &event,
            body.attempt,
            Source::Retry,
            attempted.started,
            &attempted.outcome,
            &attempted.trace_id,
            &trail,
        )
        .instrument(attempted.span.clone())
        .await;
    attempt::finish(&attempted, settled.as_ref());
    match settled {
        Ok(s) => {
            shared.count_settled(&s, event.identity.event_type.as_deref());
            settle_message(&msg, true).await;
        }
        Err(e) => {
            shared.settle_failed(&e);
            tracing::warn!(key = %key, error = %e, "settling the retry failed; abandoning so Service Bus redelivers it");
            settle_message(&msg, false).await;
        }
    }
}
