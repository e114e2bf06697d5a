//! The retry queue: hubguard's own view of Azure Service Bus, where retries wait as scheduled
//! messages. [`RetryQueue`] is the trait the pipeline uses; [`ServiceBusRetryQueue`]
//! implements it on `azure_messaging_servicebus` 0.21 (the only published crate; REST based,
//! on the legacy `azure_core` 0.21) and turns what that crate hides into typed errors:
//! its peek-lock answers `Ok` on 401/404/500 (read in its source), its scheduled times are
//! truncated to whole seconds, and it has no deadlines. Every call here has one.
//!
//! It authenticates with the SAS key of a connection string (the crate signs every request)
//! or with an Entra ID [`TokenCredential`](azure_core::credentials::TokenCredential) ([`BearerTokenHttpClient`] replaces the crate's
//! signature with `Authorization: Bearer`, scope [`SERVICE_BUS_SCOPE`]), and reads the queue's
//! description through the management REST API ([`ServiceBusRetryQueue::describe`]) so
//! `hubguard run` can prove at start that the queue keeps hubguard's promise
//! ([`prove_queue`]).
//!
//! By concern: this file holds the trait and the messages; `error` the typed errors;
//! `classify` how a status and the service's error detail become one (a 403 is a quota or a
//! message too large); `http` the HTTP stack under the crate (pooling, the redirect to the
//! real endpoint, error details, bearer tokens); `endpoint` where a namespace's REST API is;
//! `atom` the management API's queue description and its ISO 8601 durations; `proof` the
//! start-up proof; `probe` the message `hubguard check` proves Send and Listen with; `client` the Service Bus implementation itself.

mod atom;
mod batch;
mod classify;
mod client;
mod endpoint;
mod error;
mod http;
pub(crate) mod probe;
mod proof;

pub use self::atom::QueueDescription;
pub use self::client::{ServiceBusOptions, ServiceBusRetryQueue};
pub use self::endpoint::ServiceBusEndpoint;
pub use self::error::RetryQueueError;
pub use self::proof::{prove_queue, QueueNeeds, QueueRefusal};
/// The client's parts the test bed reaches for (and that keep its `pub` items reachable).
#[cfg(any(test, feature = "testbed"))]
pub use self::{
    atom::{iso8601, parse_iso8601_duration, DescriptionError},
    classify::error_detail,
    client::MANAGEMENT_API_VERSION,
    endpoint::EndpointError,
    http::{
        BearerTokenHttpClient, DetailedErrors, PooledHttpClient, RedirectingHttpClient,
        SERVICE_BUS_SCOPE,
    },
    probe::{probe_id, probe_message, PROBE_PROPERTY},
    proof::QueueProof,
};

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

/// A message to schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct OutgoingMessage {
    /// MessageId (Service Bus drops a repeat inside the duplicate-detection window).
    pub message_id: String,
    /// CorrelationId.
    pub correlation_id: Option<String>,
    /// Label (subject).
    pub label: Option<String>,
    /// Body text (binary payloads are the caller's to encode).
    pub body: String,
    /// Content type of the body.
    pub content_type: Option<String>,
    /// When the message becomes visible (a time in the past: at once). Rounded *up* to a
    /// whole second, because the protocol carries whole seconds: a retry never comes due early.
    pub due: SystemTime,
    /// Time to live.
    pub time_to_live: Option<Duration>,
    /// Custom properties (names are lower-cased on the wire; values ASCII).
    pub properties: Vec<(String, String)>,
}

/// A received, locked message.
pub struct ReceivedMessage {
    /// MessageId.
    pub message_id: String,
    /// CorrelationId.
    pub correlation_id: Option<String>,
    /// Label.
    pub label: Option<String>,
    /// Body text.
    pub body: String,
    /// Deliveries so far, this one included.
    pub delivery_count: u32,
    /// Sequence number in the queue.
    pub sequence_number: i64,
    /// When it was enqueued (for a scheduled message: its scheduled time).
    pub enqueued_at: Option<SystemTime>,
    /// Until when the lock holds.
    pub locked_until: SystemTime,
    /// Custom properties (lower-cased names).
    pub properties: HashMap<String, String>,
    lock: Box<dyn MessageLock>,
}

impl fmt::Debug for ReceivedMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceivedMessage")
            .field("message_id", &self.message_id)
            .field("sequence_number", &self.sequence_number)
            .field("delivery_count", &self.delivery_count)
            .finish_non_exhaustive()
    }
}

/// Settles a received message.
#[async_trait]
pub trait MessageLock: Send + Sync {
    /// Removes the message.
    async fn complete(&self) -> Result<(), RetryQueueError>;
    /// Releases the lock; the message is delivered again (or dead-lettered at the limit).
    async fn abandon(&self) -> Result<(), RetryQueueError>;
    /// Extends the lock; returns the new expiry.
    async fn renew(&self) -> Result<SystemTime, RetryQueueError>;
}

impl ReceivedMessage {
    /// Builds a received message (for [`RetryQueue`] implementations): its id, body and
    /// lock; the other fields start empty (a first delivery, sequence number 0, no
    /// correlation id, label, enqueued time or properties) and are set by name.
    pub fn new(
        message_id: String,
        body: String,
        locked_until: SystemTime,
        lock: Box<dyn MessageLock>,
    ) -> Self {
        Self {
            message_id,
            correlation_id: None,
            label: None,
            body,
            delivery_count: 1,
            sequence_number: 0,
            enqueued_at: None,
            locked_until,
            properties: HashMap::new(),
            lock,
        }
    }

    /// Removes the message from the queue.
    pub async fn complete(&self) -> Result<(), RetryQueueError> {
        self.lock.complete().await
    }

    /// Releases the lock so Service Bus delivers the message again.
    pub async fn abandon(&self) -> Result<(), RetryQueueError> {
        self.lock.abandon().await
    }

    /// Extends the lock; updates [`locked_until`](Self::locked_until).
    pub async fn renew(&mut self) -> Result<(), RetryQueueError> {
        self.locked_until = self.lock.renew().await?;
        Ok(())
    }
}

/// The retry queue the pipeline uses.
#[async_trait]
pub trait RetryQueue: Send + Sync {
    /// Schedules `message` for its due time. `Ok` means Service Bus accepted it durably.
    async fn schedule(&self, message: OutgoingMessage) -> Result<(), RetryQueueError>;
    /// Waits up to `wait` for a visible message and locks it.
    async fn receive(&self, wait: Duration) -> Result<Option<ReceivedMessage>, RetryQueueError>;
    /// Waits up to `wait` for a message in the queue's dead-letter sub-queue and locks it:
    /// retries Service Bus gave up on (`MaxDeliveryCountExceeded`), for hubguard to take
    /// back. `Ok(None)` when there is none (the default: a queue without a sub-queue).
    async fn receive_dead_lettered(
        &self,
        wait: Duration,
    ) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        let _ = wait;
        Ok(None)
    }
    /// Reads the queue's description (duplicate detection, lock duration, …) for the
    /// start-up proof (`prove_queue`). `EntityNotFound` when the queue does not exist.
    async fn describe(&self) -> Result<QueueDescription, RetryQueueError> {
        Err(RetryQueueError::Protocol(
            "this retry queue cannot describe itself".into(),
        ))
    }
}

#[cfg(test)]
pub use crate::clock::ceil_to_second;

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    #[test]
    fn due_times_round_up_never_down() {
        let t = UNIX_EPOCH + Duration::from_millis(1_700_000_000_001);
        assert_eq!(
            ceil_to_second(t),
            UNIX_EPOCH + Duration::from_secs(1_700_000_001)
        );
        let whole = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(ceil_to_second(whole), whole);
    }
}
