//! The dead-letter destination: a Service Bus queue operators subscribe to (as Event Grid
//! dead-letters to a container, Spring to a `-dlt` topic, Dapr to a `deadLetterTopic`).
//!
//! Every event hubguard dead-letters is also sent there *before* the ledger marks it
//! dead-lettered, under the MessageId `{key}-deadletter-{attempts}` (the key's readable or
//! digest form, [`MessageId`]): a crash between the two, or a compare-and-swap round
//! that runs again, re-sends the same MessageId, which duplicate detection drops — so a dead
//! letter is never left unpublished, and a repeat is harmless. A failure that concerns every
//! request (Service Bus unreachable, credentials, a missing or full queue, throttling) fails
//! the settlement: the partition is held (or the retry message kept) until it goes through.
//! A refusal of *this message* for what it is never holds anything (see below).
//!
//! The message carries the original body and properties, plus `hubguard-dead-letter-reason`,
//! `hubguard-last-error`, `hubguard-attempts`, `hubguard-correlation-id` (also the
//! CorrelationId), `hubguard-idempotency-key` and where the event was read. Over REST every
//! property is an HTTP header, and Service Bus allows 32 KB per property, 64 KB of headers
//! and at most 255 properties ("Service Bus quotas",
//! https://learn.microsoft.com/azure/service-bus-messaging/service-bus-quotas), while an
//! Event Hubs event may carry far more: the event's properties are copied as far as those
//! limits allow, and `hubguard-properties-omitted` counts the rest. Service Bus Standard
//! refuses messages over 256 KB while Event Hubs accepts events up to 1 MB, so a body that
//! would not fit `max_message_kb` — or a message the queue refuses for what it is (too
//! large, too many properties, a header it will not take) — is sent again as a *claim
//! check*: `hubguard-body: omitted` with the body's size, none of the event's properties,
//! and the ledger record (which keeps the event) is where to read it (`hubguard status KEY
//! --json`). A claim check is small and bounded whatever the event; should Service Bus
//! refuse even that for what it is, the ledger record alone is the dead letter and the
//! refusal is logged. A dead letter never waits on the shape of its event.
//!
//! At start-up [`DeadLetterDestination::probe`] proves the queue exists and takes messages
//! (one message labelled [`PROBE_LABEL`], living 1 s); `hubguard run` refuses to start if it
//! does not, naming the queue and Service Bus's answer.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine as _;

use super::message_id::MessageId;
use crate::azure::{OutgoingMessage, RetryQueue, RetryQueueError};
use crate::ledger::LedgerRecord;

/// The Label of the start-up probe message (subscribers ignore it).
pub const PROBE_LABEL: &str = "hubguard.dead_letter.probe";

/// Longest value copied into a property (bytes): Service Bus allows 32 KB per property and
/// 64 KB of headers in all.
const PROPERTY_VALUE_LIMIT: usize = 4096;
/// Room for all properties (bytes).
const PROPERTIES_BUDGET: usize = 48 * 1024;
/// Most custom properties in one message: "Maximum number of header properties in property
/// bag: byte/int.MaxValue", read strictly as `byte.MaxValue`
/// (https://learn.microsoft.com/azure/service-bus-messaging/service-bus-quotas); over REST
/// each is one HTTP header.
const PROPERTY_COUNT_LIMIT: usize = u8::MAX as usize;
/// Most of the event's own properties copied: a subscriber reading over REST gets each as a
/// response header, and common HTTP clients refuse a response with more than 100 headers
/// (hyper's `max_headers` default, under the Rust SDKs' reqwest:
/// https://docs.rs/hyper/1/hyper/client/conn/http1/struct.Builder.html#method.max_headers),
/// so a dead letter stays readable with room for hubguard's own and the service's headers.
const EVENT_PROPERTY_LIMIT: usize = 64;

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

/// How a dead letter went out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// With the event's body and properties.
    Full,
    /// As a claim check (the body was too large for the queue, or Service Bus refused the
    /// full message for what it is: `refused`).
    ClaimCheck {
        /// Why the full message was refused, if it was sent and refused.
        refused: Option<RetryQueueError>,
    },
    /// Service Bus refused even the claim check for what it is: the ledger record is the
    /// only dead letter.
    Unpublishable(RetryQueueError),
}

/// The shape of a dead-letter message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Body and properties of the event.
    Full,
    /// hubguard's own properties only.
    ClaimCheck,
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

    testbed_pub! {
    /// Names every dead letter after `deployment`: its MessageId starts with the deployment
    /// id (duplicate detection must never drop another deployment's dead letter of the same
    /// key), and `hubguard-deployment`, `hubguard-namespace` and `hubguard-consumer-group`
    /// say whose it is.
    pub fn with_deployment(mut self, deployment: crate::event::Deployment) -> Self {
        self.deployment = Some(deployment);
        self
    }
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Proves the queue exists and takes messages: sends one message labelled
    /// [`PROBE_LABEL`] that lives one second.
    pub(crate) async fn probe(&self) -> Result<(), PublishError> {
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

    testbed_pub! {
    /// Publishes the dead letter of `rec` (its state, reason, last error and attempts
    /// already set as they are about to be written), in the most complete shape Service Bus
    /// takes (see the module's documentation):
    ///
    /// 1. the event's body and properties, when the body fits `max_message_kb`;
    /// 2. else, or when Service Bus refuses that message for what it is (too large, too many
    ///    properties, a header it will not take: [`RetryQueueError::is_refusal_of_request`]),
    ///    a claim check: hubguard's own bounded properties only, no body and none of the
    ///    event's properties (the ledger record holds them);
    /// 3. if even the claim check is refused for what it is, nothing more can be sent: the
    ///    ledger record (and the dead-letter index `hubguard dead-letters` lists) is the dead
    ///    letter, and the refusal is logged as an error naming the key. A refusal of one
    ///    message never holds the partition.
    ///
    /// What concerns every request (unreachable, credentials, a missing or full queue,
    /// throttling) is returned: the caller holds the work and tries again.
    pub async fn publish(&self, rec: &LedgerRecord) -> Result<Published, PublishError> {
        let full = self.message(rec, Shape::Full);
        let fits = full.body.len() + 8 * 1024 <= self.max_message_bytes;
        let mut refused = None;
        if fits {
            match self.queue.schedule(full).await {
                Ok(()) => return Ok(Published::Full),
                Err(e) if e.is_refusal_of_request() => {
                    tracing::warn!(key = %rec.key, queue = %self.name, error = %e, "the dead-letter destination refused the message with the event's body and properties; sending a claim check instead");
                    refused = Some(e);
                }
                Err(error) => return Err(self.failed(error)),
            }
        }
        match self
            .queue
            .schedule(self.message(rec, Shape::ClaimCheck))
            .await
        {
            Ok(()) => Ok(Published::ClaimCheck { refused }),
            Err(e) if e.is_refusal_of_request() => {
                tracing::error!(key = %rec.key, queue = %self.name, error = %e, "the dead-letter destination refused even the claim check of this dead letter: it is recorded in the ledger only (`hubguard dead-letters` lists it, `hubguard status KEY --json` shows it)");
                Ok(Published::Unpublishable(e))
            }
            Err(error) => Err(self.failed(error)),
        }
    }
    }

    fn failed(&self, error: RetryQueueError) -> PublishError {
        PublishError {
            queue: self.name.clone(),
            error,
        }
    }

    fn message(&self, rec: &LedgerRecord, shape: Shape) -> OutgoingMessage {
        let with_body = shape == Shape::Full;
        let event = &rec.event;
        let mut properties = self.record_properties(rec);
        let body = body(rec, shape, &mut properties);
        copy_event_properties(event, shape, &mut properties);
        let bounded = |v: &str| {
            if v.chars().count() <= 128 {
                v.to_string()
            } else {
                crate::event::key_digest(v)
            }
        };
        OutgoingMessage {
            message_id: MessageId::DeadLetter {
                key: &rec.key,
                attempts: rec.attempts,
            }
            .qualified(self.deployment.as_ref()),
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

    /// The properties that say what the dead letter is: its reason, last error, attempts,
    /// identity, deployment and place in the hub.
    fn record_properties(&self, rec: &LedgerRecord) -> Vec<(String, String)> {
        let event = &rec.event;
        let mut properties: Vec<(String, String)> = Vec::new();
        let push = push_property;
        // The reason as a code (`permanent`, `attempts_exhausted`, …) and in words.
        if let Some(r) = &rec.dead_letter_reason() {
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
            &crate::redact::redact(rec.last_error.as_deref().unwrap_or("")),
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
        properties
    }
}

/// Adds property `k` with value `v`, made ASCII and bounded.
fn push_property(props: &mut Vec<(String, String)>, k: &str, v: &str) {
    props.push((k.to_string(), ascii_value(v, PROPERTY_VALUE_LIMIT)));
}

/// The message body: the event's body (base64 when it is not UTF-8, and said so), or none
/// with a claim check.
fn body(rec: &LedgerRecord, shape: Shape, properties: &mut Vec<(String, String)>) -> String {
    let with_body = shape == Shape::Full;
    let event = &rec.event;
    let push = push_property;
    let (body, encoding) = match std::str::from_utf8(&event.body) {
        Ok(text) => (text.to_string(), None),
        Err(_) => (
            base64::engine::general_purpose::STANDARD.encode(&event.body),
            Some("base64"),
        ),
    };
    if with_body {
        if let Some(enc) = encoding {
            push(properties, "hubguard-body-encoding", enc);
        }
        body
    } else {
        push(properties, "hubguard-body", "omitted");
        push(
            properties,
            "hubguard-body-bytes",
            &event.body.len().to_string(),
        );
        push(
            properties,
            "hubguard-claim-check",
            &format!(
                "the ledger record of this key holds the event: hubguard status {} --json",
                rec.key
            ),
        );
        String::new()
    }
}

/// Copies the event's own properties into `properties`.
fn copy_event_properties(
    event: &crate::event::Event,
    shape: Shape,
    properties: &mut Vec<(String, String)>,
) {
    // The event's own properties, as they are where Service Bus can carry them (a header
    // name must be a token), within the headers budget and the number of properties a
    // message may have; the rest are counted. A claim check carries none of them.
    let mut used: usize = properties.iter().map(|(k, v)| k.len() + v.len()).sum();
    // One left for `hubguard-properties-omitted`.
    let room = PROPERTY_COUNT_LIMIT
        .saturating_sub(properties.len() + 1)
        .min(EVENT_PROPERTY_LIMIT);
    let mut copied = 0usize;
    let mut left_out = 0usize;
    for (k, v) in &event.properties {
        let v = ascii_value(v, PROPERTY_VALUE_LIMIT);
        if shape == Shape::ClaimCheck
            || !crate::handler::is_field_name(k)
            || k.starts_with("hubguard-")
            || copied >= room
            || used + k.len() + v.len() > PROPERTIES_BUDGET
        {
            left_out += 1;
            continue;
        }
        used += k.len() + v.len();
        copied += 1;
        properties.push((k.clone(), v));
    }
    if left_out > 0 {
        properties.push(("hubguard-properties-omitted".into(), left_out.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A destination that answers each message with what `answer` says.
    struct Answering {
        answer: fn(&OutgoingMessage) -> Result<(), RetryQueueError>,
        sent: Mutex<Vec<OutgoingMessage>>,
    }

    #[async_trait::async_trait]
    impl RetryQueue for Answering {
        async fn schedule(&self, m: OutgoingMessage) -> Result<(), RetryQueueError> {
            let answer = (self.answer)(&m);
            self.sent.lock().unwrap().push(m);
            answer
        }
        async fn receive(
            &self,
            _: Duration,
        ) -> Result<Option<crate::azure::ReceivedMessage>, RetryQueueError> {
            Ok(None)
        }
    }

    fn record(properties: usize) -> LedgerRecord {
        let event = crate::event::Event {
            body: b"perm".to_vec(),
            content_type: None,
            properties: (0..properties)
                .map(|i| (format!("p{i}"), format!("v{i}")))
                .collect(),
            hub: "hub".into(),
            partition_id: "3".into(),
            sequence_number: 7,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: crate::event::Identity {
                idempotency_key: "k".into(),
                correlation_id: "k".into(),
                event_type: None,
            },
        };
        let policy = crate::policy::RetryPolicy {
            name: "t".into(),
            curve: crate::policy::Curve::Fixed,
            base_s: 1,
            floor_s: 1,
            cap_s: 1,
            max_attempts: 1,
            max_age_s: None,
        };
        let mut rec = LedgerRecord::first_failure(&event, policy, crate::clock::at(0));
        rec.attempts = 1;
        rec.last_error = Some("refused".into());
        rec.dead_letter(crate::policy::DeadLetterReason::Permanent);
        rec
    }

    fn destination(
        answer: fn(&OutgoingMessage) -> Result<(), RetryQueueError>,
    ) -> (Arc<Answering>, DeadLetterDestination) {
        let q = Arc::new(Answering {
            answer,
            sent: Mutex::default(),
        });
        (q.clone(), DeadLetterDestination::new(q, "dl", 256))
    }

    fn refused(status: u16) -> RetryQueueError {
        RetryQueueError::Refused {
            status,
            detail: "Request Header Fields Too Large".into(),
        }
    }

    #[tokio::test]
    async fn a_message_refused_for_what_it_is_goes_as_a_claim_check_and_never_holds() {
        // The full message is refused (a front end's 431): the claim check goes out, with
        // none of the event's properties and a bounded number of headers.
        let (q, dl) = destination(|m| {
            if m.body.is_empty() {
                Ok(())
            } else {
                Err(refused(431))
            }
        });
        let out = dl.publish(&record(300)).await.unwrap();
        assert!(
            matches!(out, Published::ClaimCheck { refused: Some(_) }),
            "{out:?}"
        );
        {
            let sent = q.sent.lock().unwrap();
            let full = &sent[0];
            assert!(full.properties.len() <= PROPERTY_COUNT_LIMIT);
            assert!(
                full.properties.len() <= EVENT_PROPERTY_LIMIT + 16,
                "{}",
                full.properties.len()
            );
            let check = &sent[1];
            assert!(check
                .properties
                .iter()
                .all(|(k, _)| k.starts_with("hubguard-")));
            assert!(check
                .properties
                .contains(&("hubguard-properties-omitted".into(), "300".into())));
        }

        // Refused whatever its shape: the ledger alone is the dead letter; nothing holds.
        let (_, dl) = destination(|_| Err(refused(400)));
        assert!(matches!(
            dl.publish(&record(3)).await.unwrap(),
            Published::Unpublishable(RetryQueueError::Refused { status: 400, .. })
        ));

        // What concerns every request is returned: the caller holds and tries again.
        let (_, dl) = destination(|_| {
            Err(RetryQueueError::Unavailable {
                status: 503,
                detail: String::new(),
            })
        });
        assert!(dl.publish(&record(3)).await.is_err());
    }

    #[test]
    fn message_ids_stay_within_service_bus_limits() {
        let long = "k".repeat(5000);
        let dead_letter = |key, attempts| MessageId::DeadLetter { key, attempts }.to_string();
        assert!(dead_letter(&long, u32::MAX).len() <= 128);
        assert_eq!(dead_letter("order-42", 3), "order-42-deadletter-3");
        assert_eq!(ascii_value("é x%", 100), "%C3%A9 x%25");
        assert_eq!(ascii_value("abcdef", 3), "abc");
    }
}
