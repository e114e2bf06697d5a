//! Retries found outside the receive path: the dead-letter sub-queue's, overdue ones the
//! ledger lists, and those whose ledger record is missing.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::azure::ReceivedMessage;
use crate::ledger::Verdict;
use crate::pipeline::settle::RetryMessage;
use crate::pipeline::Shared;

use super::{
    locked::{dispose, Disposition},
    steps::foreign,
};

/// Sweeps the dead-letter sub-queue at start and then every `dead_letter_sweep`, and with it
/// the ledger for overdue retries.
pub(super) async fn sweep_dead_letters(shared: Arc<Shared>, cancel: CancellationToken) {
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
pub(super) async fn recover_overdue(shared: &Shared) {
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
        match crate::pipeline::lines::sweep(
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

/// A retry whose ledger record is missing: the event read back from Event Hubs at the
/// position the message carries, and its record rebuilt (`Some`), or — when it is gone or
/// the message does not say where it was — the event dead-lettered as `record_missing`
/// (`None`). `Err` when Event Hubs or the ledger could not be asked: held and tried again.
pub(super) async fn recover_missing(
    shared: &Shared,
    body: &RetryMessage,
) -> Result<Option<crate::ledger::Versioned<crate::ledger::LedgerRecord>>, String> {
    let key = body.key();
    let gone = match &body.origin {
        None => "the retry message predates hubguard recording where events sit in Event Hubs, so the event cannot be read back".to_string(),
        Some(origin) => match shared
            .reader
            .read(&origin.partition, origin.sequence_number)
            .await?
        {
            crate::pipeline::readback::ReadBack::Found(event) if event.identity.idempotency_key == key => {
                return shared
                    .settler
                    .rebuild_missing(&event, body, origin)
                    .await
                    .map(Some)
                    .map_err(|e| e.to_string());
            }
            crate::pipeline::readback::ReadBack::Found(event) => format!(
                "partition {} sequence number {} holds another event now (key {})",
                origin.partition, origin.sequence_number, event.identity.idempotency_key
            ),
            crate::pipeline::readback::ReadBack::Gone(why) => why,
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
    // A probe of `hubguard check` that expired into the sub-queue: nothing to put back.
    if crate::azure::retry_queue::probe::probe_id(&msg).is_some() {
        return dispose(&msg, Disposition::Complete).await;
    }
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
            Ok(Some(rebuilt)) => {
                let rec = rebuilt.value;
                shared.observe.count_record_rebuilt();
                shared.observe.count_rescued();
                shared
                    .settler
                    .rescue(&rec, &body, msg.sequence_number)
                    .await
            }
        },
        Ok(Some(read)) => match Verdict::of(Some(&read.value), body.attempt) {
            Verdict::Final(_) | Verdict::Unrecorded => Ok(()),
            // Superseded: only the recorded next attempt matters (dropped if it exists).
            Verdict::Stale => shared
                .settler
                .resend_recorded(&read.value, &body.traceparents)
                .await
                .map(drop),
            Verdict::Current => {
                tracing::warn!(key = %key, attempt = body.attempt, deliveries = msg.delivery_count, "Service Bus dead-lettered a retry; putting it back");
                shared.observe.count_rescued();
                shared
                    .settler
                    .rescue(&read.value, &body, msg.sequence_number)
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
