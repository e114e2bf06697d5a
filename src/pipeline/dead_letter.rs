//! The dead-letter destination: a Service Bus queue operators subscribe to (as Event Grid
//! dead-letters to a container, Spring to a `-dlt` topic, Dapr to a `deadLetterTopic`).
//!
//! Every event hubguard dead-letters is also sent there *before* the ledger marks it
//! dead-lettered, under the MessageId `{key}-deadletter-{attempts}` (the key's readable or
//! digest form, [`message_id_base`]): a crash between the two, or a compare-and-swap round
//! that runs again, re-sends the same MessageId, which duplicate detection drops — so a dead
//! letter is never left unpublished, and a repeat is harmless. A failure to publish fails the
//! settlement: the partition is held (or the retry message kept) until it goes through.
//!
//! The message carries the original body and properties, plus `hubguard-dead-letter-reason`,
//! `hubguard-last-error`, `hubguard-attempts`, `hubguard-correlation-id` (also the
//! CorrelationId), `hubguard-idempotency-key` and where the event was read. Service Bus
//! Standard refuses messages over 256 KB while Event Hubs accepts events up to 1 MB, so a
//! body that would not fit `max_message_kb` — or that the queue refuses as too large — is
//! left out and the message becomes a *claim check*: `hubguard-body: omitted` with the
//! body's size, and the ledger record (which keeps the event) is where to read it
//! (`hubguard status KEY --json`). A dead letter never waits on the size of its event.
//!
//! At start-up [`DeadLetterDestination::probe`] proves the queue exists and takes messages
//! (one message labelled [`PROBE_LABEL`], living 1 s); `hubguard run` refuses to start if it
//! does not, naming the queue and Service Bus's answer.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine as _;

use super::settle::message_id_base;
use crate::azure::{OutgoingMessage, RetryQueue, RetryQueueError};
use crate::ledger::LedgerRecord;

/// The Label of the start-up probe message (subscribers ignore it).
pub const PROBE_LABEL: &str = "hubguard.dead_letter.probe";

/// Longest value copied into a property (bytes): Service Bus allows 32 KB per property and
/// 64 KB of headers in all.
const PROPERTY_VALUE_LIMIT: usize = 4096;
/// Room for all properties (bytes).
const PROPERTIES_BUDGET: usize = 48 * 1024;

/// Where dead letters go.
pub struct DeadLetterDestination {
    queue: Arc<dyn RetryQueue>,
    name: String,
    max_message_bytes: usize,
    /// Whose dead letters these are (a queue several deployments share).
    deployment: Option<crate::event::Deployment>,
}

impl std::fmt::Debug for DeadLetterDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterDestination")
            .field("queue", &self.name)
            .field("max_message_bytes", &self.max_message_bytes)
            .finish_non_exhaustive()
    }
}

/// A dead letter could not be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dead-letter destination: queue `{queue}`: {error}")]
pub struct PublishError {
    /// The queue's name.
    pub queue: String,
    /// What Service Bus said.
    pub error: RetryQueueError,
}

/// The MessageId of the dead letter of `key` after `attempts` attempts: within Service
/// Bus's 128 characters for any key (the base is at most 67, and the deployment id the
/// destination puts before it 13).
pub fn message_id(key: &str, attempts: u32) -> String {
    format!("{}-deadletter-{attempts}", message_id_base(key))
}

/// A header-safe copy of `value`: printable ASCII kept, anything else percent-encoded, at
/// most `limit` bytes.
fn ascii_value(value: &str, limit: usize) -> String {
    let mut out = String::new();
    for c in value.chars() {
        let piece = if (' '..='~').contains(&c) && c != '%' {
            c.to_string()
        } else {
            let mut b = [0u8; 4];
            c.encode_utf8(&mut b)
                .bytes()
                .map(|x| format!("%{x:02X}"))
                .collect()
        };
        if out.len() + piece.len() > limit {
            break;
        }
        out.push_str(&piece);
    }
    out
}

fn token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$&'*+-.^_`|~".contains(&b))
}

impl DeadLetterDestination {
    /// Dead letters go to `queue` (named `name`); messages at most `max_message_kb` KB.
    pub fn new(queue: Arc<dyn RetryQueue>, name: &str, max_message_kb: u32) -> Self {
        Self {
            queue,
            name: name.to_string(),
            max_message_bytes: max_message_kb as usize * 1024,
            deployment: None,
        }
    }

    /// Names every dead letter after `deployment`: its MessageId starts with the deployment
    /// id (duplicate detection must never drop another deployment's dead letter of the same
    /// key), and `hubguard-deployment`, `hubguard-namespace` and `hubguard-consumer-group`
    /// say whose it is.
    pub fn with_deployment(mut self, deployment: crate::event::Deployment) -> Self {
        self.deployment = Some(deployment);
        self
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Proves the queue exists and takes messages: sends one message labelled
    /// [`PROBE_LABEL`] that lives one second.
    pub async fn probe(&self) -> Result<(), PublishError> {
        self.queue
            .schedule(OutgoingMessage {
                message_id: format!("hubguard-probe-{}", uuid::Uuid::new_v4()),
                correlation_id: None,
                label: Some(PROBE_LABEL.into()),
                body: "hubguard start-up probe: proves this dead-letter destination exists and is writable; ignore it".into(),
                content_type: Some("text/plain".into()),
                due: SystemTime::UNIX_EPOCH,
                time_to_live: Some(Duration::from_secs(1)),
                properties: vec![("hubguard-probe".into(), "true".into())],
            })
            .await
            .map_err(|error| PublishError {
                queue: self.name.clone(),
                error,
            })
    }

    /// Publishes the dead letter of `rec` (its state, reason, last error and attempts
    /// already set as they are about to be written). A body too large for the queue is
    /// replaced by a claim check (see the module's documentation).
    pub async fn publish(&self, rec: &LedgerRecord) -> Result<(), PublishError> {
        let full = self.message(rec, true);
        let fits = full.body.len() + 8 * 1024 <= self.max_message_bytes;
        let message = if fits { full } else { self.message(rec, false) };
        let with_body = fits;
        match self.queue.schedule(message).await {
            Err(e) if with_body && e.is_refusal_of_request() => {
                tracing::warn!(key = %rec.key, queue = %self.name, error = %e, "the dead-letter destination refused the message with its body; sending a claim check instead");
                self.queue.schedule(self.message(rec, false)).await
            }
            other => other,
        }
        .map_err(|error| PublishError {
            queue: self.name.clone(),
            error,
        })
    }

    fn message(&self, rec: &LedgerRecord, with_body: bool) -> OutgoingMessage {
        let event = &rec.event;
        let mut properties: Vec<(String, String)> = Vec::new();
        let push = |props: &mut Vec<(String, String)>, k: &str, v: &str| {
            props.push((k.to_string(), ascii_value(v, PROPERTY_VALUE_LIMIT)));
        };
        // The reason as a code (`permanent`, `attempts_exhausted`, …) and in words.
        if let Some(r) = &rec.dead_letter_reason {
            let code = serde_json::to_value(r)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default();
            push(&mut properties, "hubguard-dead-letter-reason", &code);
            push(
                &mut properties,
                "hubguard-dead-letter-description",
                &r.to_string(),
            );
        }
        push(
            &mut properties,
            "hubguard-last-error",
            rec.last_error.as_deref().unwrap_or(""),
        );
        push(
            &mut properties,
            "hubguard-attempts",
            &rec.attempts.to_string(),
        );
        push(
            &mut properties,
            "hubguard-correlation-id",
            &rec.correlation_id,
        );
        push(&mut properties, "hubguard-idempotency-key", &rec.key);
        push(&mut properties, "hubguard-hub", &event.hub);
        for (k, v) in super::settle::deployment_properties(self.deployment.as_ref()) {
            if k != "hubguard-hub" {
                push(&mut properties, &k, &v);
            }
        }
        push(&mut properties, "hubguard-partition", &event.partition_id);
        push(
            &mut properties,
            "hubguard-sequence-number",
            &event.sequence_number.to_string(),
        );
        if let Some(t) = &rec.event_type {
            push(&mut properties, "hubguard-event-type", t);
        }
        let (body, encoding) = match std::str::from_utf8(&event.body) {
            Ok(text) => (text.to_string(), None),
            Err(_) => (
                base64::engine::general_purpose::STANDARD.encode(&event.body),
                Some("base64"),
            ),
        };
        let body = if with_body {
            if let Some(enc) = encoding {
                push(&mut properties, "hubguard-body-encoding", enc);
            }
            body
        } else {
            push(&mut properties, "hubguard-body", "omitted");
            push(
                &mut properties,
                "hubguard-body-bytes",
                &event.body.len().to_string(),
            );
            push(
                &mut properties,
                "hubguard-claim-check",
                &format!(
                    "the ledger record of this key holds the event: hubguard status {} --json",
                    rec.key
                ),
            );
            String::new()
        };
        // The event's own properties, as they are where Service Bus can carry them (a header
        // name must be a token), within the headers budget; the rest are counted.
        let mut used: usize = properties.iter().map(|(k, v)| k.len() + v.len()).sum();
        let mut left_out = 0usize;
        for (k, v) in &event.properties {
            let v = ascii_value(v, PROPERTY_VALUE_LIMIT);
            if !token(k)
                || k.starts_with("hubguard-")
                || used + k.len() + v.len() > PROPERTIES_BUDGET
            {
                left_out += 1;
                continue;
            }
            used += k.len() + v.len();
            properties.push((k.clone(), v));
        }
        if left_out > 0 {
            properties.push(("hubguard-properties-omitted".into(), left_out.to_string()));
        }
        let bounded = |v: &str| {
            if v.chars().count() <= 128 {
                v.to_string()
            } else {
                crate::event::key_digest(v)
            }
        };
        OutgoingMessage {
            message_id: super::settle::qualified(
                self.deployment.as_ref(),
                &message_id(&rec.key, rec.attempts),
            ),
            correlation_id: Some(bounded(&rec.correlation_id)),
            label: rec.event_type.as_deref().map(bounded),
            body,
            content_type: if with_body {
                event.content_type.clone()
            } else {
                None
            },
            due: SystemTime::UNIX_EPOCH,
            time_to_live: None,
            properties,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_stay_within_service_bus_limits() {
        let long = "k".repeat(5000);
        assert!(message_id(&long, u32::MAX).len() <= 128);
        assert_eq!(message_id("order-42", 3), "order-42-deadletter-3");
        assert_eq!(ascii_value("é x%", 100), "%C3%A9 x%25");
        assert_eq!(ascii_value("abcdef", 3), "abc");
    }
}
