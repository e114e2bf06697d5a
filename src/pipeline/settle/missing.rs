//! The Settler's answers to a retry message whose ledger record is missing: rebuilding the
//! record, or dead-lettering the event.

use crate::azure::StoreError;
use crate::clock::ms;
use crate::event::Event;
use crate::ledger::{AttemptEntry, HistoryOutcome, LedgerError, LedgerRecord, State};
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
    ) -> Result<(LedgerRecord, String), SettleError> {
        let key = &event.identity.idempotency_key;
        let now = self.clock.now();
        let error = format!(
            "the ledger record was missing while attempt {} waited; rebuilt from Event Hubs (partition {}, sequence number {})",
            message.attempt, origin.partition, origin.sequence_number
        );
        let rec = LedgerRecord {
            attempts: message.attempt.saturating_sub(1),
            next_attempt_ms: Some(message.due_ms),
            last_error: Some(error),
            ..plan::first_failure(event, &self.policies, now)
        };
        match self.ledger.put(&rec, None).await {
            Ok(etag) => Ok((rec, etag)),
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
        let now = ms(self.clock.now());
        let origin = message.origin.clone();
        let error = format!(
            "the ledger record was missing while attempt {} waited, and the event could not be read back from Event Hubs: {why}",
            message.attempt
        );
        let rec = LedgerRecord {
            key: key.clone(),
            correlation_id: key.clone(),
            event_type: None,
            state: State::DeadLettered,
            attempts: message.attempt.saturating_sub(1),
            next_attempt_ms: None,
            first_failure_ms: now,
            updated_ms: now,
            last_error: Some(error.clone()),
            dead_letter_reason: Some(DeadLetterReason::RecordMissing),
            last_delay_ms: None,
            policy: self.policies.default.clone(),
            attempt_base: 0,
            history: vec![AttemptEntry {
                attempt: message.attempt,
                started_ms: now,
                finished_ms: now,
                outcome: HistoryOutcome::DeadLettered,
                error: Some(error),
                next_attempt_ms: None,
                trace_id: None,
                retry_after_capped_from_s: None,
            }],
            event: Event {
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
            },
            quarantined: None,
            event_unknown: true,
            claim: None,
            run_now: None,
            indexed: None,
        };
        self.publish_dead_letter(&rec).await?;
        self.ledger.index_dead_letter(&key).await?;
        match self.ledger.put(&rec, None).await {
            // A record appeared meanwhile (a replay from Event Hubs wrote it): it holds the
            // event, and the ledger's sweep runs what it says is waiting.
            Ok(_) | Err(LedgerError::Store(StoreError::Conflict)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
