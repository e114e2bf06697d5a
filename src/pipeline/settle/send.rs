//! The Settler's retry messages: re-sending the recorded next attempt, scheduling a retry
//! (or dead-lettering the key Service Bus refuses), and forwarding a message not yet due.

use std::time::{Duration, SystemTime};

use tracing::Instrument;

use crate::azure::versioned::{compare_and_swap, Change, Start};
use crate::azure::{OutgoingMessage, RetryQueueError};
use crate::clock::{at, ms};
use crate::event::{Deployment, Event};
use crate::ledger::LedgerRecord;

use super::execute::Settling;
use super::{
    ascii, bounded, deployment_properties, plan, MessageId, Position, RetryCopy, RetryMessage,
    Sent, SettleError, Settler, FORWARD_FAST_HOPS, FORWARD_WAIT_MAX, PROPERTY_KEY_LIMIT,
    TRACE_LINKS_LIMIT,
};

impl Settler {
    /// Makes sure the next attempt `rec` records exists on Service Bus (a repeat within the
    /// duplicate-detection window is dropped); returns its due time, or `None` when Service
    /// Bus refused the message and the event was dead-lettered instead. For copies of
    /// attempts the ledger has already recorded.
    pub async fn resend_recorded(
        &self,
        rec: &LedgerRecord,
        traceparents: &[String],
    ) -> Result<Option<SystemTime>, SettleError> {
        let due = rec.next_attempt_at().unwrap_or_else(|| self.clock.now());
        let sent = self
            .schedule(&rec.event, rec.attempts + 1, due, traceparents)
            .await;
        Ok(match self.sent_or_dead_lettered(&rec.key, sent).await? {
            Sent::Scheduled => Some(due),
            Sent::DeadLettered => None,
        })
    }

    /// Schedules attempt `attempt` of `event` for `due`.
    pub async fn schedule(
        &self,
        event: &Event,
        attempt: u32,
        due: SystemTime,
        traceparents: &[String],
    ) -> Result<(), RetryQueueError> {
        self.schedule_as(
            MessageId::retry(&event.identity.idempotency_key, attempt),
            event,
            attempt,
            due,
            traceparents,
        )
        .await
    }

    /// [`Sent::Scheduled`] when the retry message was sent. When Service Bus refused that
    /// one message for what it is (it would refuse it every time), holding the event would
    /// hold its partition forever: the event is dead-lettered instead, with reason
    /// [`DeadLetterReason::RetryRefused`] and Service Bus's words as its last error
    /// ([`Sent::DeadLettered`]). Any other failure is returned: the caller holds and tries
    /// again.
    pub(super) async fn sent_or_dead_lettered(
        &self,
        key: &str,
        sent: Result<(), RetryQueueError>,
    ) -> Result<Sent, SettleError> {
        match sent {
            Ok(()) => Ok(Sent::Scheduled),
            Err(e) if e.is_refusal_of_request() => {
                tracing::error!(key = %key, error = %e, "Service Bus refused the retry message; dead-lettering the event (`hubguard dead-letters replay` sends it again once the cause is fixed)");
                self.dead_letter_refused(key, &e).await?;
                Ok(Sent::DeadLettered)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Marks `key`'s record dead-lettered because Service Bus refused its retry message
    /// (see [`plan::refusal`]), planning again on a conflict.
    pub(super) async fn dead_letter_refused(
        &self,
        key: &str,
        e: &RetryQueueError,
    ) -> Result<(), SettleError> {
        let error = e.to_string();
        let record = Settling::new(self, key);
        let refused = compare_and_swap(&record, Start::Read, |rec| {
            match rec.and_then(|rec| plan::refusal(&rec, &error, self.clock.now())) {
                Some(dead) => Change::Write(Box::new(dead), ()),
                None => Change::Keep(()),
            }
        });
        refused.await.map(drop)
    }

    async fn schedule_as(
        &self,
        id: MessageId<'_>,
        event: &Event,
        attempt: u32,
        due: SystemTime,
        traceparents: &[String],
    ) -> Result<(), RetryQueueError> {
        self.schedule_marked(id, event, attempt, due, traceparents, None)
            .await
    }

    /// [`schedule_as`](Self::schedule_as), the copy carrying an operator's pull `mark`.
    pub(super) async fn schedule_marked(
        &self,
        id: MessageId<'_>,
        event: &Event,
        attempt: u32,
        due: SystemTime,
        traceparents: &[String],
        mark: Option<i64>,
    ) -> Result<(), RetryQueueError> {
        let identity = &event.identity;
        let links = traceparents.len().saturating_sub(TRACE_LINKS_LIMIT);
        let body = RetryMessage {
            v: 2,
            attempt,
            due_ms: ms(due),
            key: identity.idempotency_key.clone(),
            event: None,
            traceparents: traceparents[links..].to_vec(),
            deployment: self.deployment.clone(),
            origin: Position::of(event),
            run_now: mark,
        };
        let mut properties = vec![("hubguard-attempt".to_string(), attempt.to_string())];
        properties.extend(deployment_properties(self.deployment.as_ref()));
        // A readable copy for operators browsing the queue, when it is a header value Service
        // Bus takes (printable ASCII; a property is at most 32 KB, all headers 64 KB).
        if ascii(&identity.idempotency_key) && identity.idempotency_key.len() <= PROPERTY_KEY_LIMIT
        {
            properties.push((
                "hubguard-idempotency-key".into(),
                identity.idempotency_key.clone(),
            ));
        }
        let span = tracing::info_span!(target: "hubguard::attempt", "schedule", otel.name = crate::telemetry::names::span::SCHEDULE, attempt);
        self.queue
            .schedule(OutgoingMessage {
                message_id: id.qualified(self.deployment.as_ref()),
                correlation_id: Some(bounded(&identity.correlation_id)),
                label: identity.event_type.as_deref().map(bounded),
                body: serde_json::to_string(&body)
                    .map_err(|e| RetryQueueError::Protocol(e.to_string()))?,
                content_type: Some("application/json".into()),
                due: self.visible_at(due),
                time_to_live: None,
                properties,
            })
            .instrument(span)
            .await
    }

    /// When Service Bus should hand over a message due at `due`. The body carries the due
    /// time; Service Bus hands the message over up to `lead` earlier, but never before the
    /// next whole second: it stays a scheduled message, as without a lead.
    fn visible_at(&self, due: SystemTime) -> SystemTime {
        due.checked_sub(self.lead)
            .unwrap_or(due)
            .max(crate::clock::ceil_to_second(
                self.clock.now() + Duration::from_millis(1),
            ))
            .min(due)
    }

    /// Hands a retry message of another deployment (received from a queue the two share)
    /// back to the queue for its own deployment, unchanged: the same body, due when it was,
    /// under a MessageId of its own — `{its deployment}.{key}-attempt-{n}-fwd-{sequence
    /// number of this copy}` — so duplicate detection drops a second forward of the same copy
    /// (a crash before it was completed) and nothing else. `forwards` counts the hops so far:
    /// after [`FORWARD_FAST_HOPS`] a copy waits a little longer each time (up to
    /// [`FORWARD_WAIT_MAX`]), so a deployment that no longer runs costs the others little.
    pub async fn forward(
        &self,
        raw_body: &str,
        message: &RetryMessage,
        theirs: &Deployment,
        sequence_number: i64,
        forwards: u32,
    ) -> Result<(), RetryQueueError> {
        let id = MessageId::retry(message.key(), message.attempt)
            .copy(RetryCopy::Forwarded { sequence_number })
            .qualified(Some(theirs));
        let mut visible = self.visible_at(at(message.due_ms));
        if let Some(extra) = forwards.checked_sub(FORWARD_FAST_HOPS) {
            let wait = Duration::from_secs(1u64 << extra.min(6)).min(FORWARD_WAIT_MAX);
            visible = visible.max(crate::clock::ceil_to_second(self.clock.now() + wait));
        }
        let mut properties = vec![
            ("hubguard-attempt".to_string(), message.attempt.to_string()),
            ("hubguard-forwards".to_string(), (forwards + 1).to_string()),
        ];
        properties.extend(deployment_properties(Some(theirs)));
        self.queue
            .schedule(OutgoingMessage {
                message_id: id,
                correlation_id: None,
                label: None,
                body: raw_body.to_string(),
                content_type: Some("application/json".into()),
                due: visible,
                time_to_live: None,
                properties,
            })
            .await
    }
}
