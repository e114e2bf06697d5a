//! The [`Handler`] trait — what library users implement — and the built-in
//! [`webhook::WebhookHandler`] that makes `hubguard run` useful with no Rust code, with the
//! conventions receivers already speak: the CloudEvents HTTP binding ([`cloudevents`]),
//! Standard Webhooks signatures ([`signing`]), the CloudEvents abuse-protection handshake
//! ([`handshake`]) and credentials read from the environment or files ([`secret`]).

pub mod batch;
pub mod cloudevents;
pub mod handshake;
pub mod secret;
pub mod signing;
pub mod webhook;
pub mod webhook_batch;

use std::time::Duration;

use async_trait::async_trait;

use crate::event::Event;
use crate::policy::classify::ErrorClass;

/// Percent-encodes `value` for a header: every byte of its UTF-8 form outside ASCII, and the
/// ASCII characters in `set` (uppercase hex, RFC 3986 §2.1). The one encoder of header
/// values; each caller's set says what else it escapes.
pub(crate) fn percent_encode(value: &str, set: &'static percent_encoding::AsciiSet) -> String {
    percent_encoding::utf8_percent_encode(value, set).to_string()
}

/// Whether `name` can be an HTTP field name: a token (RFC 9110 §5.6.2, `tchar`).
pub(crate) fn is_field_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// What the handler is told about the attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first delivery from Event Hubs, then 2, 3, … for retries.
    pub number: u32,
    /// W3C `traceparent` of this attempt (pass it on to downstream calls).
    pub traceparent: String,
    /// The last attempt its retry policy allows: a failure dead-letters it (a batch sends
    /// it alone, see [`batch`]).
    pub last: bool,
}

/// Why an attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Transient (retry) or permanent (dead-letter now).
    pub class: ErrorClass,
    /// What went wrong, for the ledger and the logs.
    pub error: String,
    /// The downstream asked to wait at least this long.
    pub retry_after: Option<Duration>,
    /// The HTTP status the downstream answered, when it answered (for the attempt's span).
    pub http_status: Option<u16>,
    /// The longest `retry_after` the handler honours (the webhook's `retry_after_max_s`);
    /// the policy's cap bounds it in any case.
    pub retry_after_max: Option<Duration>,
    /// The downstream did not answer in time (the rate limiter slows down on it).
    pub timed_out: bool,
}

impl Failure {
    /// A transient failure.
    pub fn transient(error: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Transient,
            error: crate::redact::redact_owned(error.into()),
            retry_after: None,
            http_status: None,
            retry_after_max: None,
            timed_out: false,
        }
    }

    /// A transient failure because the downstream did not answer in time.
    pub fn timeout(error: impl Into<String>) -> Self {
        Self {
            timed_out: true,
            ..Self::transient(error)
        }
    }

    /// A permanent failure.
    pub fn permanent(error: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Permanent,
            error: crate::redact::redact_owned(error.into()),
            retry_after: None,
            http_status: None,
            retry_after_max: None,
            timed_out: false,
        }
    }

    /// With a `Retry-After`.
    pub fn with_retry_after(mut self, d: Option<Duration>) -> Self {
        self.retry_after = d;
        self
    }

    /// With the longest `Retry-After` the handler honours (below the policy's cap).
    pub fn with_retry_after_max(mut self, d: Option<Duration>) -> Self {
        self.retry_after_max = d;
        self
    }

    /// With the HTTP status the downstream answered.
    pub fn with_http_status(mut self, status: u16) -> Self {
        self.http_status = Some(status);
        self
    }
}

/// The outcome of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Delivered: done.
    Delivered,
    /// Failed: retry or dead-letter, as the policy and the class say.
    Failed(Failure),
}

/// Handles one event. Called at least once per event (replays and retries may repeat it):
/// use [`Event::identity`]'s idempotency key to make the effect idempotent.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Handles `event`; never panics on bad input — return a permanent failure instead.
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome;

    /// The downstream this handler calls, for the circuit breaker (one breaker per name).
    fn downstream(&self) -> String {
        "handler".into()
    }

    /// Why the handler cannot deliver anything at the moment (`Some(reason)`), watched by
    /// the pipeline and shown in readiness until it clears — e.g. a webhook that has not
    /// agreed to receive (the abuse-protection handshake). `None`: nothing to watch.
    fn blocked(&self) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        None
    }

    /// The request rate the downstream granted (requests per second, `None` while it has
    /// granted none), as it changes — e.g. a webhook's `WebHook-Allowed-Rate`. The pipeline's
    /// rate limiter holds the whole deployment to it. `None`: nothing to watch.
    fn allowed_rate(&self) -> Option<tokio::sync::watch::Receiver<Option<f64>>> {
        None
    }

    /// How many events of one ordering key a released line of ordered retries may hand to
    /// one call of [`Handler::handle_in_order`]. 1 (the default): a released line's events go
    /// one by one, each through its own retry message, as a handler without batches wants.
    fn in_order_max(&self) -> usize {
        1
    }

    /// Handles `items` — events of one ordering key released from their line, in sequence
    /// order — in one call, answering one outcome per item in their order. Everything after
    /// the first item that did not succeed counts as not attempted, whatever its outcome
    /// says: it is delivered again after that item, so a receiver keeping order stops at its
    /// first failure. An item without an outcome (fewer outcomes than items) is a transient
    /// failure. The default hands the items to [`Handler::handle`] one at a time and stops
    /// at the first failure.
    async fn handle_in_order(&self, items: &[batch::Item<'_>]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(items.len());
        for item in items {
            let outcome = self.handle(item.event, item.attempt).await;
            let failed = outcome != Outcome::Delivered;
            outcomes.push(outcome);
            if failed {
                break;
            }
        }
        outcomes
    }
}
