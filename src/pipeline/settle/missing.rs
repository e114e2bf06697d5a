//! The Settler's answers to a retry message whose ledger record is missing: rebuilding the
//! record, or dead-lettering the event.

use crate::azure::StoreError;
use crate::clock::ms;
use crate::event::Event;
use crate::ledger::{AttemptEntry, HistoryOutcome, LedgerError, LedgerRecord, Versioned};
use crate::policy::DeadLetterReason;

use super::{plan, Position, RetryMessage, SettleError, Settler};

impl Settler {
    /// Rebuilds the ledger record of `event` (read back from Event Hubs because its record
    /// is missing) as the retry `message` expects it: attempt `message.attempt - 1` failed
    /// and attempt `message.attempt` is due when the message says, under the policy in force
    /// for its type. Created with `If-None-Match: *`: if a record appeared meanwhile, that
    /// one is returned.
    pub async fn rebuild_missing(
        &self,
        event: &Event,
        message: &RetryMessage,
        origin: &Position,
    ) -> Result<Versioned<LedgerRecord>, SettleError> {
        let key = &event.identity.idempotency_key;
        let now = self.clock.now();
        let error = format!(
            "the ledger record was missing while attempt {} waited; rebuilt from Event Hubs (partition {}, sequence number {})",
            message.attempt, origin.partition, origin.sequence_number
        );
        let mut rec = plan::first_failure(event, &self.policies, now);
        rec.attempts = message.attempt.saturating_sub(1);
        rec.schedule_retry(message.due_ms);
        rec.last_error = Some(error);
        match self.ledger.put(&rec, None).await {
            Ok(etag) => Ok(Versioned::new(rec, etag)),
            Err(LedgerError::Store(StoreError::Conflict)) => self
                .ledger
                .get(key)
                .await?
                .ok_or_else(|| SettleError::Contended(key.clone())),
            Err(e) => Err(e.into()),
        }
    }

    /// Dead-letters the event of a retry `message` whose ledger record is missing and whose
    /// event cannot be read back (past the hub's retention, another event at its position,
    /// or an older message that does not say where it was): reason
    /// [`DeadLetterReason::RecordMissing`], `why` as its last error, the key in the
    /// dead-letter index (`hubguard dead-letters list`). The event itself is unknown: the
    /// record is a stand-in marked `event_unknown`, and a replay says so.
    pub async fn dead_letter_missing(
        &self,
        message: &RetryMessage,
        why: &str,
    ) -> Result<(), SettleError> {
        let key = message.key().to_string();
        let now = self.clock.now();
        let origin = message.origin.clone();
        let error = format!(
            "the ledger record was missing while attempt {} waited, and the event could not be read back from Event Hubs: {why}",
            message.attempt
        );
        // The event itself is unknown: a stand-in says where it was, under its key.
        let unknown = Event {
            body: Vec::new(),
            content_type: None,
            properties: Default::default(),
            hub: self
                .deployment
                .as_ref()
                .map(|d| d.hub.clone())
                .unwrap_or_default(),
            partition_id: origin
                .as_ref()
                .map(|o| o.partition.clone())
                .unwrap_or_default(),
            sequence_number: origin.as_ref().map_or(-1, |o| o.sequence_number),
            offset: origin.and_then(|o| o.offset),
            enqueued_ms: None,
            partition_key: None,
            identity: crate::event::Identity {
                idempotency_key: key.clone(),
                correlation_id: key.clone(),
                event_type: None,
            },
        };
        let mut rec = plan::first_failure(&unknown, &self.policies, now);
        rec.event_unknown = true;
        rec.attempts = message.attempt.saturating_sub(1);
        rec.last_error = Some(error.clone());
        rec.push_history(AttemptEntry {
            attempt: message.attempt,
            started_ms: ms(now),
            finished_ms: ms(now),
            outcome: HistoryOutcome::DeadLettered,
            error: Some(error),
            next_attempt_ms: None,
            trace_id: None,
            retry_after_capped_from_s: None,
        });
        rec.dead_letter(DeadLetterReason::RecordMissing);
        match self.write_settled(&rec, None).await {
            // A record appeared meanwhile (a replay from Event Hubs wrote it): it holds the
            // event, and the ledger's sweep runs what it says is waiting.
            Ok(_) | Err(SettleError::Ledger(LedgerError::Store(StoreError::Conflict))) => Ok(()),
            Err(e) => Err(e),
        }
    }
}
