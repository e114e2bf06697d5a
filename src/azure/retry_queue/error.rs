//! Why a retry-queue call failed.

use std::time::Duration;

/// Why a retry-queue call failed. Callers branch on it: a refusal of *one request*
/// ([`Refused`](Self::Refused)) is final for that message and must not hold anything; the
/// others concern every request (credentials, the queue, its quota) or are transient, and
/// hold the work until they clear.
///
/// Service Bus's REST status codes do not map one-to-one onto these (the Send Message
/// reference, learn.microsoft.com/rest/api/servicebus/send-message-to-queue): 403 means both
/// "quota exceeded" and "message too large", so the error detail the service returns tells
/// them apart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetryQueueError {
    /// The credentials were refused or lack the right (401, or a 403 that is not a quota).
    #[error("Service Bus refused the credentials (status {status}{})", detail_suffix(.detail))]
    Unauthorized {
        /// The status.
        status: u16,
        /// What the service said, sanitised.
        detail: String,
    },
    /// The queue does not exist (410 on every operation; 404 outside a lock).
    #[error("the Service Bus queue does not exist (status {status}{})", detail_suffix(.detail))]
    EntityNotFound {
        /// The status.
        status: u16,
        /// What the service said, sanitised.
        detail: String,
    },
    /// The queue or namespace is full (403 "quota exceeded"): every send fails until it drains.
    #[error("the Service Bus queue's quota is exceeded (status 403{})", detail_suffix(.0))]
    QuotaExceeded(String),
    /// This request, for what it is (too large, a bad MessageId or property), was refused:
    /// sending it again gets the same answer.
    #[error("Service Bus refused the message (status {status}{})", detail_suffix(.detail))]
    Refused {
        /// The status (400, or 403 for a message too large).
        status: u16,
        /// What the service said, sanitised.
        detail: String,
    },
    /// The namespace is throttling (429, or 503 "server busy"): back off and try again.
    #[error("Service Bus is throttling requests (status {status}{})", detail_suffix(.detail))]
    Throttled {
        /// The status.
        status: u16,
        /// What the service said, sanitised.
        detail: String,
    },
    /// The lock was lost: it expired, or the message was settled already (404 on a lock).
    #[error("the message lock was lost (expired or already settled)")]
    LockLost,
    /// Service Bus answered with another error status (5xx, …).
    #[error("Service Bus is unavailable (status {status}{})", detail_suffix(.detail))]
    Unavailable {
        /// The status.
        status: u16,
        /// What the service said, sanitised.
        detail: String,
    },
    /// The connection failed.
    #[error("Service Bus could not be reached: {0}")]
    Transport(String),
    /// No answer within the deadline.
    #[error("Service Bus did not answer within {0:?}")]
    Timeout(Duration),
    /// The answer could not be understood.
    #[error("Service Bus answered something unexpected: {0}")]
    Protocol(String),
    /// The Entra ID credential could not get a token (not signed in, no managed identity, a
    /// refused client secret, …): every request fails until someone acts.
    #[error("no Entra ID token for Service Bus: {0}")]
    Credential(String),
}

pub(super) fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(": {detail}")
    }
}

impl RetryQueueError {
    /// Whether trying again later may succeed without anyone acting.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Unavailable { .. }
                | Self::Throttled { .. }
                | Self::Transport(_)
                | Self::Timeout(_)
        )
    }

    /// Whether Service Bus refused this one request for what it is: the same request will
    /// be refused every time, so the caller settles the work another way (dead-letters it)
    /// instead of holding it.
    pub fn is_refusal_of_request(&self) -> bool {
        matches!(self, Self::Refused { .. })
    }
}
