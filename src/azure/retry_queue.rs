//! The retry queue: hubguard's own view of Azure Service Bus, where retries wait as scheduled
//! messages. [`RetryQueue`] is the trait the pipeline uses; [`ServiceBusRetryQueue`]
//! implements it on `azure_messaging_servicebus` 0.21 (the only published crate; REST based,
//! on the legacy `azure_core` 0.21) and turns what that crate hides into typed errors:
//! its peek-lock answers `Ok` on 401/404/500 (`EMULATOR_NOTES.md` §8), its scheduled times are
//! truncated to whole seconds, and it has no deadlines. Every call here has one.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use azure_core_legacy::headers::Headers;
use azure_core_legacy::{HttpClient, Request, Response};
use azure_messaging_servicebus::service_bus::{
    PeekLockResponse, QueueClient, SendMessageOptions, SettableBrokerProperties,
};

use super::ConnectionString;

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
}

fn detail_suffix(detail: &str) -> String {
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
    /// Builds a received message (for [`RetryQueue`] implementations).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        message_id: String,
        correlation_id: Option<String>,
        label: Option<String>,
        body: String,
        delivery_count: u32,
        sequence_number: i64,
        enqueued_at: Option<SystemTime>,
        locked_until: SystemTime,
        properties: HashMap<String, String>,
        lock: Box<dyn MessageLock>,
    ) -> Self {
        Self {
            message_id,
            correlation_id,
            label,
            body,
            delivery_count,
            sequence_number,
            enqueued_at,
            locked_until,
            properties,
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
}

/// An `HttpClient` for the legacy crate that sends every request (and every lock `Location`)
/// to a fixed endpoint, e.g. the local emulator, instead of `https://{ns}.servicebus.windows.net`.
#[derive(Debug)]
pub struct RedirectingHttpClient {
    scheme: String,
    host: String,
    port: Option<u16>,
    inner: Arc<dyn HttpClient>,
}

impl RedirectingHttpClient {
    /// Sends to `scheme://host[:port]`.
    pub fn new(scheme: &str, host: &str, port: Option<u16>) -> Self {
        Self {
            scheme: scheme.into(),
            host: host.into(),
            port,
            inner: azure_core_legacy::new_http_client(),
        }
    }
}

#[async_trait]
impl HttpClient for RedirectingHttpClient {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        let mut req = request.clone();
        let url = req.url_mut();
        let invalid = |what: &str| {
            azure_core_legacy::Error::message(
                azure_core_legacy::error::ErrorKind::Other,
                format!("cannot redirect the request: bad {what}"),
            )
        };
        url.set_scheme(&self.scheme)
            .map_err(|_| invalid("scheme"))?;
        url.set_host(Some(&self.host))
            .map_err(|_| invalid("host"))?;
        url.set_port(self.port).map_err(|_| invalid("port"))?;
        self.inner.execute_request(&req).await
    }
}

/// Options of [`ServiceBusRetryQueue`].
#[derive(Debug, Clone)]
pub struct ServiceBusOptions {
    /// Deadline of every call (a peek-lock gets its wait on top).
    pub deadline: Duration,
}

impl Default for ServiceBusOptions {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(10),
        }
    }
}

/// [`RetryQueue`] on a Service Bus queue.
pub struct ServiceBusRetryQueue {
    client: QueueClient,
    /// The same queue's `$DeadLetterQueue`.
    dead_letters: QueueClient,
    queue: String,
    options: ServiceBusOptions,
    clock: Arc<crate::clock::Clock>,
}

impl fmt::Debug for ServiceBusRetryQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceBusRetryQueue")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl ServiceBusRetryQueue {
    /// A retry queue on `queue` of the namespace in `connection`. With
    /// `UseDevelopmentEmulator=true` requests go over plain HTTP to the endpoint's host and
    /// port; otherwise to `https://{namespace}.servicebus.windows.net`.
    pub fn new(
        connection: &ConnectionString,
        queue: &str,
        options: ServiceBusOptions,
    ) -> Result<Self, RetryQueueError> {
        let (namespace, http): (String, Arc<dyn HttpClient>) =
            if connection.use_development_emulator {
                (
                    "emulator".into(),
                    Arc::new(DetailedErrors::new(Arc::new(RedirectingHttpClient::new(
                        "http",
                        &connection.host,
                        connection.port,
                    )))),
                )
            } else {
                let ns = connection
                    .host
                    .strip_suffix(".servicebus.windows.net")
                    .ok_or_else(|| {
                        RetryQueueError::Protocol(format!(
                            "{} is not a *.servicebus.windows.net namespace",
                            connection.host
                        ))
                    })?;
                (
                    ns.to_string(),
                    Arc::new(DetailedErrors::new(azure_core_legacy::new_http_client())),
                )
            };
        let client = |entity: &str| {
            QueueClient::new(
                http.clone(),
                namespace.clone(),
                entity,
                connection.key.name(),
                connection.key.secret().to_string(),
            )
            .map_err(|e| RetryQueueError::Protocol(e.to_string()))
        };
        Ok(Self {
            client: client(queue)?,
            dead_letters: client(&format!("{queue}/$DeadLetterQueue"))?,
            queue: queue.into(),
            options,
            clock: Arc::default(),
        })
    }

    /// Reads due times and lock expiry on `clock` (the one the pipeline and, in tests, the
    /// emulator share) instead of the wall clock.
    pub fn with_clock(mut self, clock: Arc<crate::clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    async fn deadline<T>(
        &self,
        extra: Duration,
        f: impl std::future::Future<Output = Result<T, RetryQueueError>>,
    ) -> Result<T, RetryQueueError> {
        let limit = self.options.deadline + extra;
        tokio::time::timeout(limit, f)
            .await
            .unwrap_or(Err(RetryQueueError::Timeout(limit)))
    }
}

/// Maps a status and the service's error detail to a typed error (see [`RetryQueueError`]).
fn status_error(status: u16, detail: &str) -> RetryQueueError {
    let detail = detail.to_string();
    let lower = detail.to_ascii_lowercase();
    match status {
        400 | 413 => RetryQueueError::Refused { status, detail },
        401 => RetryQueueError::Unauthorized { status, detail },
        // 403 is "quota exceeded or message too large": the detail tells which. A message
        // too large is refused for what it is; anything else at 403 concerns every request.
        403 if lower.contains("size")
            && (lower.contains("exceed") || lower.contains("large"))
            && !lower.contains("entity size") =>
        {
            RetryQueueError::Refused { status, detail }
        }
        403 if lower.contains("quota") || lower.contains("entity size") => {
            RetryQueueError::QuotaExceeded(detail)
        }
        403 => RetryQueueError::Unauthorized { status, detail },
        404 | 410 => RetryQueueError::EntityNotFound { status, detail },
        429 => RetryQueueError::Throttled { status, detail },
        503 if lower.contains("busy") || lower.contains("throttl") => {
            RetryQueueError::Throttled { status, detail }
        }
        _ => RetryQueueError::Unavailable { status, detail },
    }
}

fn classify(e: &azure_core_legacy::Error) -> RetryQueueError {
    match e.kind() {
        azure_core_legacy::error::ErrorKind::HttpResponse { status, error_code } => {
            status_error(u16::from(*status), error_code.as_deref().unwrap_or(""))
        }
        azure_core_legacy::error::ErrorKind::Io => RetryQueueError::Transport(e.to_string()),
        _ => {
            // Connection failures surface as wrapped reqwest errors.
            RetryQueueError::Transport(e.to_string())
        }
    }
}

fn lock_error(e: &azure_core_legacy::Error) -> RetryQueueError {
    match classify(e) {
        // 404 on a lock: the lock (not the queue, which answers 410) is gone.
        RetryQueueError::EntityNotFound { status: 404, .. } => RetryQueueError::LockLost,
        other => other,
    }
}

/// Longest error detail kept from a response body.
const DETAIL_LIMIT: usize = 300;

/// The `<Detail>` (else `<Message>`) of a Service Bus error body, unescaped, with control
/// characters removed and cut to [`DETAIL_LIMIT`] characters: what the service said about a
/// refusal, fit for a log line, a ledger record and `hubguard status`.
pub fn error_detail(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let inner = |tag: &str| {
        let open = format!("<{tag}>");
        let start = text.find(&open)? + open.len();
        let end = text[start..].find(&format!("</{tag}>"))? + start;
        Some(text[start..end].to_string())
    };
    let raw = inner("Detail")
        .or_else(|| inner("Message"))
        .unwrap_or_else(|| text.to_string());
    let unescaped = raw
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&");
    let mut out: String = unescaped
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(DETAIL_LIMIT)
        .collect();
    if unescaped.chars().count() > DETAIL_LIMIT {
        out.push('…');
    }
    out.trim().to_string()
}

/// An `HttpClient` for the legacy crate that keeps what the service says about an error.
/// The crate drops the body of an error response (it looks for a JSON `code`; Service Bus
/// answers XML with a `<Detail>`), and that detail is the only way to tell "message too
/// large" from "quota exceeded" (both 403). Every error status becomes an
/// `HttpResponse` error carrying the detail as its error code.
#[derive(Debug)]
pub struct DetailedErrors {
    inner: Arc<dyn HttpClient>,
}

impl DetailedErrors {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn HttpClient>) -> Self {
        Self { inner }
    }
}

#[async_trait]
impl HttpClient for DetailedErrors {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        let response = self.inner.execute_request(request).await?;
        if u16::from(response.status()) < 400 {
            return Ok(response);
        }
        let (status, _headers, body) = response.deconstruct();
        let body = body.collect().await.unwrap_or_default();
        let detail = error_detail(&body);
        Err(azure_core_legacy::Error::message(
            azure_core_legacy::error::ErrorKind::HttpResponse {
                status,
                error_code: Some(detail),
            },
            format!("Service Bus answered {}", u16::from(status)),
        ))
    }
}

/// Rounds up to the next whole second (the wire format has no fractions): the time Service
/// Bus will actually enqueue a message scheduled for `t`.
pub fn ceil_to_second(t: SystemTime) -> SystemTime {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = if d.subsec_nanos() > 0 {
        d.as_secs() + 1
    } else {
        d.as_secs()
    };
    UNIX_EPOCH + Duration::from_secs(secs)
}

/// Every response header, kept for parsing the raw `brokerproperties` and custom properties.
struct RawHeaders(Vec<(String, String)>);

impl From<Headers> for RawHeaders {
    fn from(h: Headers) -> Self {
        Self(
            h.iter()
                .map(|(k, v)| (k.as_str().to_string(), v.as_str().to_string()))
                .collect(),
        )
    }
}

/// The fields of `BrokerProperties` the legacy crate does not expose.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ExtraBrokerProperties {
    correlation_id: Option<String>,
    label: Option<String>,
}

const PLUMBING: &[&str] = &[
    "brokerproperties",
    "location",
    "content-type",
    "content-length",
    "date",
    "server",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "strict-transport-security",
    "deadletterreason",
    "deadlettererrordescription",
];

struct ServiceBusLock {
    response: PeekLockResponse,
    lock_duration_hint: Duration,
    deadline: Duration,
    clock: Arc<crate::clock::Clock>,
}

#[async_trait]
impl MessageLock for ServiceBusLock {
    async fn complete(&self) -> Result<(), RetryQueueError> {
        match tokio::time::timeout(self.deadline, self.response.delete_message()).await {
            Err(_) => Err(RetryQueueError::Timeout(self.deadline)),
            Ok(Err(e)) => Err(lock_error(&e)),
            Ok(Ok(_)) => Ok(()),
        }
    }

    async fn abandon(&self) -> Result<(), RetryQueueError> {
        match tokio::time::timeout(self.deadline, self.response.unlock_message()).await {
            Err(_) => Err(RetryQueueError::Timeout(self.deadline)),
            Ok(Err(e)) => Err(lock_error(&e)),
            Ok(Ok(())) => Ok(()),
        }
    }

    async fn renew(&self) -> Result<SystemTime, RetryQueueError> {
        let started = self.clock.now();
        match tokio::time::timeout(self.deadline, self.response.renew_message_lock()).await {
            Err(_) => Err(RetryQueueError::Timeout(self.deadline)),
            Ok(Err(e)) => Err(lock_error(&e)),
            // The crate does not return the new expiry: count from before the request.
            Ok(Ok(())) => Ok(started + self.lock_duration_hint),
        }
    }
}

#[async_trait]
impl RetryQueue for ServiceBusRetryQueue {
    async fn schedule(&self, message: OutgoingMessage) -> Result<(), RetryQueueError> {
        // A due time in the past means "now": send unscheduled rather than rounding it up.
        let scheduled = (message.due > self.clock.now())
            .then(|| time::OffsetDateTime::from(ceil_to_second(message.due)));
        let options = SendMessageOptions {
            content_type: message.content_type,
            broker_properties: Some(SettableBrokerProperties {
                message_id: Some(message.message_id),
                correlation_id: message.correlation_id,
                label: message.label,
                time_to_live: message.time_to_live,
                scheduled_enqueue_time_utc: scheduled,
                ..Default::default()
            }),
            custom_properties: (!message.properties.is_empty())
                .then(|| message.properties.into_iter().collect()),
        };
        self.deadline(Duration::ZERO, async {
            self.client
                .send_message(&message.body, Some(options))
                .await
                .map_err(|e| classify(&e))
        })
        .await
    }

    async fn receive(&self, wait: Duration) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        self.receive_from(&self.client, wait).await
    }

    async fn receive_dead_lettered(
        &self,
        wait: Duration,
    ) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        self.receive_from(&self.dead_letters, wait).await
    }
}

impl ServiceBusRetryQueue {
    async fn receive_from(
        &self,
        client: &QueueClient,
        wait: Duration,
    ) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        let deadline = self.options.deadline;
        let clock = self.clock.clone();
        self.deadline(wait, async {
            // The protocol's timeout is in whole seconds; round up so short waits still wait.
            let secs = Duration::from_secs(wait.as_secs() + u64::from(wait.subsec_nanos() > 0));
            let response = client
                .peek_lock_message2(Some(secs))
                .await
                .map_err(|e| classify(&e))?;
            let status = u16::from(*response.status());
            match status {
                204 => return Ok(None),
                200 | 201 => {}
                other => return Err(status_error(other, "")),
            }
            let bp = response.broker_properties().ok_or_else(|| {
                RetryQueueError::Protocol("a locked message without BrokerProperties".into())
            })?;
            let RawHeaders(headers) = response
                .custom_properties::<RawHeaders>()
                .unwrap_or_else(|never| match never {});
            let extra: ExtraBrokerProperties = headers
                .iter()
                .find(|(k, _)| k == "brokerproperties")
                .and_then(|(_, v)| serde_json::from_str(v).ok())
                .unwrap_or_default();
            let properties = headers
                .into_iter()
                .filter(|(k, _)| !PLUMBING.contains(&k.as_str()))
                .collect();
            let locked_until = SystemTime::from(bp.locked_until_utc);
            let lock_duration_hint = locked_until
                .duration_since(clock.now())
                .unwrap_or(Duration::from_secs(30));
            Ok(Some(ReceivedMessage {
                message_id: bp.message_id.clone(),
                correlation_id: extra.correlation_id,
                label: extra.label,
                body: response.body(),
                delivery_count: u32::try_from(bp.delivery_count).unwrap_or(0),
                sequence_number: bp.sequence_number,
                enqueued_at: bp.enqueued_time_utc.map(SystemTime::from),
                locked_until,
                properties,
                lock: Box::new(ServiceBusLock {
                    response,
                    lock_duration_hint,
                    deadline,
                    clock,
                }),
            }))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn statuses_map_to_typed_errors() {
        assert!(matches!(
            status_error(401, ""),
            RetryQueueError::Unauthorized { status: 401, .. }
        ));
        assert!(matches!(
            status_error(410, "gone"),
            RetryQueueError::EntityNotFound { status: 410, .. }
        ));
        assert!(status_error(503, "").is_transient());
        assert!(status_error(429, "").is_transient());
        assert!(!status_error(401, "").is_transient());
        assert!(status_error(400, "bad MessageId").is_refusal_of_request());
    }

    #[test]
    fn a_403_is_told_apart_by_its_detail() {
        let too_large = status_error(
            403,
            "The message of 300000 bytes exceeds the maximum message size of 262144 bytes",
        );
        assert!(too_large.is_refusal_of_request(), "{too_large:?}");
        let full = status_error(
            403,
            "The maximum entity size has been reached or exceeded for Queue: 'retries'.",
        );
        assert!(
            matches!(full, RetryQueueError::QuotaExceeded(_)),
            "{full:?}"
        );
        assert!(!full.is_refusal_of_request());
        let rights = status_error(403, "Unauthorized access. 'Send' claim(s) are required");
        assert!(matches!(rights, RetryQueueError::Unauthorized { .. }));
        let busy = status_error(503, "SubCode=50009. The entity is being throttled.");
        assert!(matches!(busy, RetryQueueError::Throttled { .. }));
    }

    #[test]
    fn error_details_are_read_from_the_xml_body_and_sanitised() {
        let body = b"<Error><Code>400</Code><Detail>Bad &lt;id&gt;\r\nline</Detail></Error>";
        assert_eq!(error_detail(body), "Bad <id>  line");
        let long = format!("<Error><Detail>{}</Detail></Error>", "x".repeat(1000));
        assert!(error_detail(long.as_bytes()).chars().count() <= DETAIL_LIMIT + 1);
    }
}
