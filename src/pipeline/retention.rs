//! Retention: DELIVERED ledger records are deleted `retention` after their last write, so
//! the ledger holds what is waiting, what was given up, and a bounded window of history —
//! not every event that ever failed. Dead-lettered records and quarantined blobs stay until
//! an operator replays or purges them. A record is only deleted once its event is settled
//! on its partition (at or before the partition's checkpoint), so an event that can still be
//! read again always finds its record saying it was delivered.
//!
//! The default, 7 days, is the longest an Event Hubs Standard namespace retains an event
//! ("Azure Event Hubs quotas and limits", learn.microsoft.com/azure/event-hubs/
//! event-hubs-quotas: retention 1–7 days on Standard) and the longest Service Bus detects a
//! duplicate MessageId ("Duplicate detection", learn.microsoft.com/azure/service-bus-messaging/
//! duplicate-detection: the window is at most 7 days): a record is not deleted while its
//! event may be replayed from a Standard hub or while a MessageId of its retries may still be
//! remembered. Premium and Dedicated hubs retain up to 90 days: set `ledger.retention_days`
//! to the hub's retention there.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::checkpoint::FencedCheckpointStore;
use super::Shared;

/// Runs retention every `retention_sweep` until cancelled.
pub(super) async fn run(
    shared: Arc<Shared>,
    checkpoints: Arc<FencedCheckpointStore>,
    keep: Duration,
    cancel: CancellationToken,
    crash: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = crash.cancelled() => return,
            _ = shared.clock().sleep(shared.options.retention_sweep) => {}
        }
        once(&shared, &checkpoints, keep).await;
    }
}

/// One pass: the checkpoints as stored now, then the ledger's expired records.
async fn once(shared: &Shared, checkpoints: &FencedCheckpointStore, keep: Duration) {
    let Some(before) = shared.clock().now().checked_sub(keep) else {
        return;
    };
    let Some(positions) = checkpoints
        .settled_positions(&shared.origin.hub, &shared.origin.consumer_group)
        .await
    else {
        tracing::debug!("the checkpoints are not known yet; retention waits for its next pass");
        return;
    };
    let settled =
        move |partition: &str, seq: i64| positions.get(partition).is_some_and(|c| seq <= *c);
    let expiring = tokio::time::timeout(
        shared.options.deadline * 20,
        shared.settler.ledger.expire(before, &settled),
    )
    .await;
    match expiring {
        Ok(Ok(e)) => {
            if e.deleted > 0 || e.kept_unsettled > 0 {
                tracing::info!(
                    deleted = e.deleted,
                    kept_unsettled = e.kept_unsettled,
                    "ledger retention: delivered records past retention deleted"
                );
            }
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "ledger retention could not run; trying again at its next pass")
        }
        Err(_) => tracing::warn!("ledger retention took too long; trying again at its next pass"),
    }
}
