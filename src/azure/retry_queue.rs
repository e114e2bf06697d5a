//! The retry queue: hubguard's own view of Azure Service Bus, where retries wait as scheduled
//! messages. [`RetryQueue`] is the trait the pipeline uses; [`ServiceBusRetryQueue`]
//! implements it on `azure_messaging_servicebus` 0.21 (the only published crate; REST based,
//! on the legacy `azure_core` 0.21) and turns what that crate hides into typed errors:
//! its peek-lock answers `Ok` on 401/404/500 (read in its source), its scheduled times are
//! truncated to whole seconds, and it has no deadlines. Every call here has one.
//!
//! It authenticates with the SAS key of a connection string (the crate signs every request)
//! or with an Entra ID [`TokenCredential`] ([`BearerTokenHttpClient`] replaces the crate's
//! signature with `Authorization: Bearer`, scope [`SERVICE_BUS_SCOPE`]), and reads the queue's
//! description through the management REST API ([`ServiceBusRetryQueue::describe`]) so
//! `hubguard run` can prove at start that the queue keeps hubguard's promise
//! ([`prove_queue`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use azure_core::credentials::{AccessToken, TokenCredential};
use azure_core_legacy::headers::{HeaderValue, Headers};
use azure_core_legacy::{HttpClient, Request, Response};
use azure_messaging_servicebus::service_bus::{
    PeekLockResponse, QueueClient, SendMessageOptions, SettableBrokerProperties,
};

use super::{ConnectionString, SasKey};

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
    /// Reads the queue's description (duplicate detection, lock duration, …) for the
    /// start-up proof ([`prove_queue`]). `EntityNotFound` when the queue does not exist.
    async fn describe(&self) -> Result<QueueDescription, RetryQueueError> {
        Err(RetryQueueError::Protocol(
            "this retry queue cannot describe itself".into(),
        ))
    }
}

/// The legacy crate's transport, with connections kept alive between requests.
///
/// `azure_core` 0.21's own reqwest client turns the connection pool off
/// (`pool_max_idle_per_host(0)`, Azure/azure-sdk-for-rust#1550, a workaround for a hang
/// reported in hyperium/hyper#2312), so every Service Bus request — each receive, complete,
/// renew and send — opened a new TCP (and, on Azure, TLS) connection and closed it after one
/// response. The 1.x `azure_core` turned pooling back on by default for its performance.
/// hubguard puts a deadline on every Service Bus call ([`ServiceBusRetryQueue`]), so a
/// request that hangs on a pooled connection fails at its deadline like any other, and is
/// retried. Response bodies are small (one message, or an error) and read whole.
#[derive(Debug, Clone)]
pub struct PooledHttpClient {
    http: reqwest::Client,
}

impl Default for PooledHttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl PooledHttpClient {
    /// A client with reqwest's default pool (idle connections closed after 90 s).
    pub fn new() -> Self {
        let http = reqwest::Client::builder()
            // Service Bus does not redirect; a 3xx is an answer, as with the crate's client.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Self { http }
    }
}

fn transport_error(e: reqwest::Error) -> azure_core_legacy::Error {
    // reqwest's Display hides the cause; keep the chain (never the URL).
    let e = e.without_url();
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    azure_core_legacy::Error::message(azure_core_legacy::error::ErrorKind::Io, msg)
}

#[async_trait]
impl HttpClient for PooledHttpClient {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        use futures::AsyncReadExt as _;
        let other = |m: String| {
            azure_core_legacy::Error::message(azure_core_legacy::error::ErrorKind::Other, m)
        };
        let method = reqwest::Method::from_bytes(request.method().as_ref().as_bytes())
            .map_err(|e| other(format!("bad method: {e}")))?;
        let mut req = self.http.request(method, request.url().as_str());
        for (name, value) in request.headers().iter() {
            req = req.header(name.as_str(), value.as_str());
        }
        let body = match request.body() {
            azure_core_legacy::Body::Bytes(b) => b.clone(),
            azure_core_legacy::Body::SeekableStream(s) => {
                let mut s = s.clone();
                let mut buf = Vec::with_capacity(s.len());
                s.read_to_end(&mut buf)
                    .await
                    .map_err(|e| other(format!("reading the request body: {e}")))?;
                bytes::Bytes::from(buf)
            }
        };
        let resp = req.body(body).send().await.map_err(transport_error)?;
        let status = azure_core_legacy::StatusCode::try_from(resp.status().as_u16())
            .map_err(|_| other(format!("invalid status code {}", resp.status())))?;
        let headers: HashMap<_, _> = resp
            .headers()
            .iter()
            .filter_map(|(k, v)| {
                Some((
                    azure_core_legacy::headers::HeaderName::from(k.as_str().to_owned()),
                    HeaderValue::from(v.to_str().ok()?.to_owned()),
                ))
            })
            .collect();
        let body = resp.bytes().await.map_err(transport_error)?;
        Ok(Response::new(
            status,
            Headers::from(headers),
            Box::pin(futures::stream::iter([Ok(body)])),
        ))
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
            inner: Arc::new(PooledHttpClient::new()),
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
    /// The HTTP stack every request goes through (redirect, bearer token, error details).
    http: Arc<dyn HttpClient>,
    /// `https://{namespace}.servicebus.windows.net/{queue}` as the crate names it (the stack
    /// redirects it to the real endpoint).
    entity_url: String,
    /// The key to sign management requests with (`None` with a token credential).
    sas: Option<SasKey>,
    options: ServiceBusOptions,
    clock: Arc<crate::clock::Clock>,
}

impl fmt::Debug for ServiceBusRetryQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceBusRetryQueue")
            .field("queue", &self.queue)
            .field("entity_url", &self.entity_url)
            .field(
                "auth",
                &if self.sas.is_some() {
                    "sas"
                } else {
                    "entra id"
                },
            )
            .finish_non_exhaustive()
    }
}

/// Where a namespace's REST API is: `https://{namespace host}` for Azure, or plain
/// `http://host:port` for a local emulator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceBusEndpoint {
    /// `https`, or `http` for an emulator.
    pub scheme: String,
    /// The namespace's host (`myns.servicebus.windows.net`, `127.0.0.1`).
    pub host: String,
    /// The port, when not the scheme's default.
    pub port: Option<u16>,
}

impl ServiceBusEndpoint {
    /// Parses a namespace as configured: `myns.servicebus.windows.net` (also with `sb://` or
    /// `https://` and a trailing `/`), or `http://127.0.0.1:5380` for a local emulator. Plain
    /// `http` is allowed only to a loopback host: a bearer token must not cross a network
    /// unencrypted.
    pub fn parse(namespace: &str) -> Result<Self, String> {
        let s = namespace.trim();
        let (scheme, rest) = match s.split_once("://") {
            Some((sch, rest)) => (sch.to_ascii_lowercase(), rest),
            None => ("https".to_string(), s),
        };
        let scheme = match scheme.as_str() {
            "https" | "sb" => "https",
            "http" => "http",
            other => return Err(format!("unsupported scheme `{other}` (use a host name, or http://127.0.0.1:PORT for a local emulator)")),
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        // A host name: a user name or password has no place in it (and is never quoted).
        if authority.contains('@') {
            return Err("a namespace is a host name, without a user name or password".into());
        }
        let url = url::Url::parse(&format!("{scheme}://{authority}"))
            .map_err(|e| format!("not a namespace host: {e}"))?;
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or("no host")?
            .to_string();
        if scheme == "http" {
            let loopback = host == "localhost"
                || host
                    .trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(format!(
                    "plain http is only for a local emulator (a loopback host, not {host}): use the namespace's host name"
                ));
            }
        }
        Ok(Self {
            scheme: scheme.into(),
            host,
            port: url.port(),
        })
    }

    fn of_connection_string(connection: &ConnectionString) -> Self {
        Self {
            scheme: if connection.use_development_emulator {
                "http"
            } else {
                "https"
            }
            .into(),
            host: connection.host.clone(),
            port: connection.port,
        }
    }

    /// The namespace name the legacy crate builds `https://{name}.servicebus.windows.net`
    /// URLs from, and the HTTP client that sends them here. Only an Azure public-cloud
    /// namespace is reached without a redirect.
    fn legacy_client(&self) -> (String, Arc<dyn HttpClient>) {
        match self.host.strip_suffix(".servicebus.windows.net") {
            Some(ns) if self.scheme == "https" && self.port.is_none() => {
                (ns.to_string(), Arc::new(PooledHttpClient::new()))
            }
            _ => (
                "emulator".into(),
                Arc::new(RedirectingHttpClient::new(
                    &self.scheme,
                    &self.host,
                    self.port,
                )),
            ),
        }
    }
}

/// The API version of the management (entity description) requests, as the official SDKs'
/// administration clients send it.
pub const MANAGEMENT_API_VERSION: &str = "2021-05";

impl ServiceBusRetryQueue {
    /// A retry queue on `queue` of the namespace in `connection`, authenticated with its SAS
    /// key. With `UseDevelopmentEmulator=true` requests go over plain HTTP to the endpoint's
    /// host and port; otherwise to `https://{namespace}.servicebus.windows.net`.
    pub fn new(
        connection: &ConnectionString,
        queue: &str,
        options: ServiceBusOptions,
    ) -> Result<Self, RetryQueueError> {
        let endpoint = ServiceBusEndpoint::of_connection_string(connection);
        if !connection.use_development_emulator
            && !connection.host.ends_with(".servicebus.windows.net")
        {
            return Err(RetryQueueError::Protocol(format!(
                "{} is not a *.servicebus.windows.net namespace",
                connection.host
            )));
        }
        Self::build(
            &endpoint,
            Some(connection.key.clone()),
            None,
            queue,
            options,
        )
    }

    /// A retry queue on `queue` of `namespace` (see [`ServiceBusEndpoint::parse`]),
    /// authenticated with an Entra ID token from `credential` for [`SERVICE_BUS_SCOPE`]
    /// (roles: Azure Service Bus Data Sender and Data Receiver; Data Owner to read the
    /// queue's description).
    pub fn with_token_credential(
        namespace: &str,
        credential: Arc<dyn TokenCredential>,
        queue: &str,
        options: ServiceBusOptions,
    ) -> Result<Self, RetryQueueError> {
        let endpoint = ServiceBusEndpoint::parse(namespace).map_err(RetryQueueError::Protocol)?;
        Self::build(&endpoint, None, Some(credential), queue, options)
    }

    fn build(
        endpoint: &ServiceBusEndpoint,
        sas: Option<SasKey>,
        credential: Option<Arc<dyn TokenCredential>>,
        queue: &str,
        options: ServiceBusOptions,
    ) -> Result<Self, RetryQueueError> {
        let (namespace, transport) = endpoint.legacy_client();
        let authenticated: Arc<dyn HttpClient> = match credential {
            Some(c) => Arc::new(BearerTokenHttpClient::new(transport, c)),
            None => transport,
        };
        let http: Arc<dyn HttpClient> = Arc::new(DetailedErrors::new(authenticated));
        // With a token credential the crate still signs a SAS (it cannot do otherwise); the
        // bearer client replaces it, so the key is a placeholder that never leaves here.
        let (key_name, key) = match &sas {
            Some(k) => (k.name().to_string(), k.secret().to_string()),
            None => ("entra-id".to_string(), "unused".to_string()),
        };
        let client = |entity: &str| {
            QueueClient::new(
                http.clone(),
                namespace.clone(),
                entity,
                key_name.clone(),
                key.clone(),
            )
            .map_err(|e| RetryQueueError::Protocol(e.to_string()))
        };
        Ok(Self {
            client: client(queue)?,
            dead_letters: client(&format!("{queue}/$DeadLetterQueue"))?,
            queue: queue.into(),
            entity_url: format!("https://{namespace}.servicebus.windows.net/{queue}"),
            http,
            sas,
            options,
            clock: Arc::default(),
        })
    }

    /// Reads the queue's description: `GET https://{namespace}/{queue}?api-version=2021-05`,
    /// an Atom entry holding a `QueueDescription`. It needs the Manage right (a SAS policy
    /// with Manage, or the Azure Service Bus Data Owner role); without it Service Bus answers
    /// 401 ("Manage,EntityRead claims required for this operation"). A queue that does not
    /// exist comes back as an empty feed (status 200): `EntityNotFound`.
    pub async fn describe(&self) -> Result<QueueDescription, RetryQueueError> {
        self.deadline(Duration::ZERO, async {
            let url = format!("{}?api-version={MANAGEMENT_API_VERSION}", self.entity_url);
            let url = azure_core_legacy::Url::parse(&url)
                .map_err(|e| RetryQueueError::Protocol(format!("bad queue URL: {e}")))?;
            let mut request = Request::new(url, azure_core_legacy::Method::Get);
            if let Some(key) = &self.sas {
                let expiry = self
                    .clock
                    .now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs()
                    + 3600;
                request.insert_header(
                    azure_core_legacy::headers::AUTHORIZATION,
                    HeaderValue::from(key.token(&self.entity_url, expiry)),
                );
            }
            let response = self
                .http
                .execute_request(&request)
                .await
                .map_err(|e| classify(&e))?;
            let (_status, _headers, body) = response.deconstruct();
            let body = body
                .collect()
                .await
                .map_err(|e| RetryQueueError::Transport(e.to_string()))?;
            match QueueDescription::from_atom(&String::from_utf8_lossy(&body)) {
                Ok(Some(d)) => Ok(d),
                Ok(None) => Err(RetryQueueError::EntityNotFound {
                    status: 404,
                    detail: format!(
                        "the namespace has no queue named '{}' (its description is an empty feed)",
                        self.queue
                    ),
                }),
                Err(e) => Err(RetryQueueError::Protocol(format!(
                    "the queue's description cannot be read: {e}"
                ))),
            }
        })
        .await
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
    // What the request is, not what the service is: too large, too many properties or
    // headers, malformed. The same request gets the same answer every time, so it must not
    // hold anything (HTTP semantics, RFC 9110 §15.5.1, §15.5.14, §15.5.15; 431: RFC 6585
    // §5), whatever front end said it.
    let about_the_request = lower.contains("too large")
        || lower.contains("too many properties")
        || lower.contains("too many headers");
    match status {
        400 | 413 | 414 | 431 => RetryQueueError::Refused { status, detail },
        403 if about_the_request => RetryQueueError::Refused { status, detail },
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
        azure_core_legacy::error::ErrorKind::Credential => {
            RetryQueueError::Credential(e.to_string())
        }
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
/// characters removed and cut to `DETAIL_LIMIT` (300) characters: what the service said about a
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

/// The scope of an Entra ID token for Service Bus's data plane ("Authenticate and authorize
/// an application with Microsoft Entra ID to access Azure Service Bus entities",
/// learn.microsoft.com).
pub const SERVICE_BUS_SCOPE: &str = "https://servicebus.azure.net/.default";

/// A cached token is replaced this long before it expires.
const TOKEN_REFRESH_MARGIN: Duration = Duration::from_secs(300);

/// An `HttpClient` for the legacy crate that authenticates every request with an Entra ID
/// token (`Authorization: Bearer …` for [`SERVICE_BUS_SCOPE`]) instead of the SAS the crate
/// signs. The token is cached until `TOKEN_REFRESH_MARGIN` before it expires; one request
/// fetches it while the others wait. `Debug` never shows it, and a credential failure
/// becomes [`RetryQueueError::Credential`].
pub struct BearerTokenHttpClient {
    inner: Arc<dyn HttpClient>,
    credential: Arc<dyn TokenCredential>,
    cached: tokio::sync::Mutex<Option<AccessToken>>,
}

impl fmt::Debug for BearerTokenHttpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BearerTokenHttpClient")
            .field("inner", &self.inner)
            .field("scope", &SERVICE_BUS_SCOPE)
            .finish_non_exhaustive()
    }
}

impl BearerTokenHttpClient {
    /// Sends through `inner` with tokens from `credential`.
    pub fn new(inner: Arc<dyn HttpClient>, credential: Arc<dyn TokenCredential>) -> Self {
        Self {
            inner,
            credential,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    async fn authorization(&self) -> azure_core_legacy::Result<String> {
        let mut cached = self.cached.lock().await;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs() as i64;
        let fresh_enough = |t: &AccessToken| {
            t.expires_on.unix_timestamp() - TOKEN_REFRESH_MARGIN.as_secs() as i64 > now
        };
        if let Some(t) = cached.as_ref().filter(|t| fresh_enough(t)) {
            return Ok(format!("Bearer {}", t.token.secret()));
        }
        let token = self
            .credential
            .get_token(&[SERVICE_BUS_SCOPE], None)
            .await
            .map_err(|e| {
                azure_core_legacy::Error::message(
                    azure_core_legacy::error::ErrorKind::Credential,
                    format!("the credential could not get a token for {SERVICE_BUS_SCOPE}: {e}"),
                )
            })?;
        let header = format!("Bearer {}", token.token.secret());
        *cached = Some(token);
        Ok(header)
    }
}

#[async_trait]
impl HttpClient for BearerTokenHttpClient {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        let authorization = self.authorization().await?;
        let mut req = request.clone();
        req.insert_header(
            azure_core_legacy::headers::AUTHORIZATION,
            HeaderValue::from(authorization),
        );
        self.inner.execute_request(&req).await
    }
}

/// What hubguard reads of a queue's `QueueDescription` (the management REST API; the
/// element names are the service's, as the official SDKs' administration clients read them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDescription {
    /// `RequiresDuplicateDetection`.
    pub requires_duplicate_detection: bool,
    /// `DuplicateDetectionHistoryTimeWindow` (an ISO 8601 duration on the wire).
    pub duplicate_detection_history_time_window: Option<Duration>,
    /// `LockDuration`.
    pub lock_duration: Option<Duration>,
    /// `MaxDeliveryCount`.
    pub max_delivery_count: Option<u32>,
    /// `MaxMessageSizeInKilobytes` (absent on older API versions and some tiers).
    pub max_message_size_in_kilobytes: Option<u32>,
}

/// The text of the first element whose local name (without a namespace prefix) is `name`.
fn element_text<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = xml;
    while let Some(open) = rest.find('<') {
        let after = &rest[open + 1..];
        let end = after.find('>')?;
        let tag = &after[..end];
        rest = &after[end + 1..];
        if tag.starts_with(['/', '?', '!']) || tag.ends_with('/') {
            continue;
        }
        let qualified = tag.split_whitespace().next().unwrap_or("");
        let local = qualified.rsplit(':').next().unwrap_or(qualified);
        if local == name {
            let close = rest.find("</")?;
            return Some(rest[..close].trim());
        }
    }
    None
}

/// Whether the document has an element whose local name is `name`.
fn has_element(xml: &str, name: &str) -> bool {
    xml.split('<').skip(1).any(|t| {
        let qualified = t
            .split(|c: char| c.is_whitespace() || c == '>' || c == '/')
            .next()
            .unwrap_or("");
        qualified.rsplit(':').next() == Some(name)
    })
}

impl QueueDescription {
    /// Reads the Atom entry Service Bus answers to `GET /{queue}`. `Ok(None)` when the
    /// document holds no `QueueDescription` (an empty feed: the queue does not exist).
    pub fn from_atom(xml: &str) -> Result<Option<Self>, String> {
        if !has_element(xml, "QueueDescription") {
            return if has_element(xml, "feed") || has_element(xml, "entry") {
                Ok(None)
            } else {
                Err("neither an Atom entry nor a feed".into())
            };
        }
        let start = xml.find("QueueDescription").unwrap_or(0);
        let body = &xml[start..];
        let duration = |name: &str| -> Result<Option<Duration>, String> {
            element_text(body, name)
                .map(|t| {
                    parse_iso8601_duration(t)
                        .ok_or(format!("{name} `{t}` is not an ISO 8601 duration"))
                })
                .transpose()
        };
        let number = |name: &str| -> Result<Option<u32>, String> {
            element_text(body, name)
                .map(|t| {
                    t.parse::<u32>()
                        .map_err(|_| format!("{name} `{t}` is not a number"))
                })
                .transpose()
        };
        let requires = match element_text(body, "RequiresDuplicateDetection") {
            Some(t) if t.eq_ignore_ascii_case("true") => true,
            Some(t) if t.eq_ignore_ascii_case("false") => false,
            Some(t) => return Err(format!("RequiresDuplicateDetection `{t}` is not a boolean")),
            // The service's default.
            None => false,
        };
        Ok(Some(Self {
            requires_duplicate_detection: requires,
            duplicate_detection_history_time_window: duration(
                "DuplicateDetectionHistoryTimeWindow",
            )?,
            lock_duration: duration("LockDuration")?,
            max_delivery_count: number("MaxDeliveryCount")?,
            max_message_size_in_kilobytes: number("MaxMessageSizeInKilobytes")?,
        }))
    }
}

/// Parses an ISO 8601 duration as .NET writes a `TimeSpan` (`PT10M`, `P7D`, `PT0.5S`,
/// `P10675199DT2H48M5.4775807S` for `TimeSpan.MaxValue`); years and months count as 365 and
/// 30 days. Saturates instead of overflowing.
pub fn parse_iso8601_duration(s: &str) -> Option<Duration> {
    let rest = s.trim().strip_prefix('P')?;
    let (date, time) = match rest.split_once('T') {
        Some((d, t)) => (d, Some(t)),
        None => (rest, None),
    };
    let mut total = Duration::ZERO;
    let mut any = false;
    let mut add = |part: &str, units: &[(char, f64)]| -> Option<()> {
        let mut number = String::new();
        for c in part.chars() {
            if c.is_ascii_digit() || c == '.' || c == ',' {
                number.push(if c == ',' { '.' } else { c });
                continue;
            }
            let secs = units.iter().find(|(u, _)| *u == c)?.1;
            let n: f64 = number.parse().ok()?;
            number.clear();
            total = total
                .saturating_add(Duration::try_from_secs_f64(n * secs).unwrap_or(Duration::MAX));
            any = true;
        }
        number.is_empty().then_some(())
    };
    const DAY: f64 = 86_400.0;
    add(
        date,
        &[
            ('Y', 365.0 * DAY),
            ('M', 30.0 * DAY),
            ('W', 7.0 * DAY),
            ('D', DAY),
        ],
    )?;
    if let Some(t) = time {
        if t.is_empty() {
            return None;
        }
        add(t, &[('H', 3600.0), ('M', 60.0), ('S', 1.0)])?;
    }
    any.then_some(total)
}

/// A duration as ISO 8601 (`PT2M40S`), for messages that name a queue property's value.
pub fn iso8601(d: Duration) -> String {
    let secs = d.as_secs();
    let (days, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let mut out = String::from("P");
    if days > 0 {
        out.push_str(&format!("{days}D"));
    }
    if h + m + s > 0 || days == 0 {
        out.push('T');
        if h > 0 {
            out.push_str(&format!("{h}H"));
        }
        if m > 0 {
            out.push_str(&format!("{m}M"));
        }
        if s > 0 || (h == 0 && m == 0) {
            out.push_str(&format!("{s}S"));
        }
    }
    out
}

/// What the retry queue must offer for this configuration (see [`prove_queue`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueNeeds {
    /// The longest time from Service Bus accepting a retry message to a replay of its event
    /// from Event Hubs re-sending the same MessageId (`Config::replay_gap`).
    pub replay_gap: Duration,
    /// The deadline of every call (`retry.call_deadline_ms`).
    pub call_deadline: Duration,
}

impl QueueNeeds {
    /// The duplicate-detection window needed with a queue whose locks last `lock`: the
    /// longer of the Event Hubs replay gap and the retry loop's own re-send path (a process
    /// dies after sending attempt n+1 but before completing the message of attempt n; the
    /// lock lapses, Service Bus redelivers it, and the next receiver re-sends attempt n+1
    /// after reading the ledger: the lock, plus a few calls, plus a minute of margin).
    pub fn window(&self, lock: Option<Duration>) -> Duration {
        let redelivery = lock.unwrap_or(Duration::from_secs(60))
            + self.call_deadline * 4
            + Duration::from_secs(60);
        self.replay_gap.max(redelivery)
    }
}

/// What the start-up proof found: a summary for the log and warnings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueProof {
    /// One line with the properties read (or why they could not be).
    pub summary: String,
    /// Allowed but risky, or not verifiable.
    pub warnings: Vec<String>,
}

/// Checks `queue`'s description against what the configuration needs. `Err` when the queue
/// cannot keep hubguard's promise (it does not exist, duplicate detection is off, or its
/// window is shorter than [`QueueNeeds::window`]): the message names the property and the
/// value needed. When the description cannot be read (no Manage right: 401/403; Service
/// Bus unreachable) the proof is a warning, not a refusal: sending and receiving need no
/// Manage right, and least privilege should not stop hubguard.
pub fn prove_queue(
    queue: &str,
    described: Result<QueueDescription, RetryQueueError>,
    needs: &QueueNeeds,
) -> Result<QueueProof, String> {
    let d = match described {
        Ok(d) => d,
        Err(RetryQueueError::EntityNotFound { detail, .. }) => {
            let need = needs.window(None);
            return Err(format!(
                "the retry queue '{queue}' does not exist ({detail}): create it with RequiresDuplicateDetection = true and DuplicateDetectionHistoryTimeWindow at least {} ({} s)",
                iso8601(need),
                need.as_secs()
            ));
        }
        Err(e @ RetryQueueError::Unauthorized { .. }) => {
            let need = needs.window(None);
            let w = format!(
                "cannot read the retry queue '{queue}''s description ({e}): the credential lacks the Manage right (a SAS policy with Manage, or the Azure Service Bus Data Owner role); sending and receiving work without it, but duplicate detection is not verified: make sure the queue has RequiresDuplicateDetection = true and DuplicateDetectionHistoryTimeWindow at least {} ({} s)",
                iso8601(need),
                need.as_secs()
            );
            return Ok(QueueProof {
                summary: format!(
                    "retry queue '{queue}': description not readable (no Manage right)"
                ),
                warnings: vec![w],
            });
        }
        Err(e) => {
            return Ok(QueueProof {
                summary: format!("retry queue '{queue}': description not read"),
                warnings: vec![format!(
                    "cannot read the retry queue '{queue}''s description ({e}): duplicate detection is not verified"
                )],
            });
        }
    };
    let need = needs.window(d.lock_duration);
    if !d.requires_duplicate_detection {
        return Err(format!(
            "the retry queue '{queue}' has RequiresDuplicateDetection = false; hubguard needs true, with DuplicateDetectionHistoryTimeWindow at least {} ({} s): a replayed event re-sends its retry under the same MessageId, and without duplicate detection it would be retried twice. Duplicate detection can only be chosen when a queue is created: create a queue with it and set servicebus.queue",
            iso8601(need),
            need.as_secs()
        ));
    }
    let window = d
        .duplicate_detection_history_time_window
        .unwrap_or(Duration::from_secs(600));
    if window < need {
        return Err(format!(
            "the retry queue '{queue}' has DuplicateDetectionHistoryTimeWindow = {} ({} s); this configuration needs at least {} ({} s): the longest time from scheduling a retry to a replay re-sending the same MessageId (checkpoint.every_ms + processor.ownership_expiration_ms + 4 × retry.call_deadline_ms + 60 s, or the queue's LockDuration + 4 × retry.call_deadline_ms + 60 s). Raise the window on the queue, or checkpoint more often",
            iso8601(window),
            window.as_secs(),
            iso8601(need),
            need.as_secs()
        ));
    }
    let mut warnings = Vec::new();
    if let Some(lock) = d.lock_duration {
        if lock < needs.call_deadline * 2 {
            warnings.push(format!(
                "the retry queue '{queue}' has LockDuration = {} ({} s), less than twice retry.call_deadline_ms: a held retry's lock is renewed at half its time, and a slow renewal may let it lapse (Service Bus then delivers the message again)",
                iso8601(lock),
                lock.as_secs()
            ));
        }
    }
    let opt = |v: Option<String>| v.unwrap_or_else(|| "not given".into());
    Ok(QueueProof {
        summary: format!(
            "retry queue '{queue}': RequiresDuplicateDetection true, DuplicateDetectionHistoryTimeWindow {} (needs {}), LockDuration {}, MaxDeliveryCount {}, MaxMessageSizeInKilobytes {}",
            iso8601(window),
            iso8601(need),
            opt(d.lock_duration.map(iso8601)),
            opt(d.max_delivery_count.map(|n| n.to_string())),
            opt(d.max_message_size_in_kilobytes.map(|n| n.to_string())),
        ),
        warnings,
    })
}

pub use crate::clock::ceil_to_second;

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

    async fn describe(&self) -> Result<QueueDescription, RetryQueueError> {
        ServiceBusRetryQueue::describe(self).await
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
        // Whatever the front end: a request too large or with too many headers concerns
        // that request only.
        for status in [413, 414, 431] {
            let e = status_error(status, "");
            assert!(e.is_refusal_of_request() && !e.is_transient(), "{e:?}");
        }
        let many = status_error(403, "The message has too many properties: 300");
        assert!(many.is_refusal_of_request(), "{many:?}");
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
    #[test]
    fn iso8601_durations_as_dotnet_writes_them() {
        let p = |s: &str| parse_iso8601_duration(s);
        assert_eq!(p("PT10M"), Some(Duration::from_secs(600)));
        assert_eq!(p("PT1M30S"), Some(Duration::from_secs(90)));
        assert_eq!(p("P7D"), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(p("P1DT2H"), Some(Duration::from_secs(93_600)));
        assert_eq!(p("PT0.5S"), Some(Duration::from_millis(500)));
        let max = p("P10675199DT2H48M5.4775807S").unwrap();
        assert!(max > Duration::from_secs(10_675_199 * 86_400));
        for bad in ["", "P", "PT", "10M", "PT10X", "PT10", "P1H"] {
            assert_eq!(p(bad), None, "{bad}");
        }
        for secs in [
            1,
            20,
            59,
            60,
            90,
            600,
            3600,
            3661,
            86_400,
            7 * 86_400,
            90_061,
        ] {
            let d = Duration::from_secs(secs);
            assert_eq!(p(&iso8601(d)), Some(d), "{}", iso8601(d));
        }
        assert_eq!(iso8601(Duration::from_secs(160)), "PT2M40S");
        assert_eq!(iso8601(Duration::ZERO), "PT0S");
    }

    /// The shape Service Bus answers (the Get Queue reference on learn.microsoft.com), with
    /// prefixes and the runtime counters the service adds.
    const ENTRY: &str = r#"<entry xmlns="http://www.w3.org/2005/Atom"><id>https://ns.servicebus.windows.net/retries?api-version=2021-05</id><title type="text">retries</title><content type="application/xml"><QueueDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect" xmlns:i="http://www.w3.org/2001/XMLSchema-instance"><LockDuration>PT1M</LockDuration><MaxSizeInMegabytes>1024</MaxSizeInMegabytes><RequiresDuplicateDetection>true</RequiresDuplicateDetection><RequiresSession>false</RequiresSession><DefaultMessageTimeToLive>P10675199DT2H48M5.4775807S</DefaultMessageTimeToLive><DeadLetteringOnMessageExpiration>false</DeadLetteringOnMessageExpiration><DuplicateDetectionHistoryTimeWindow>PT10M</DuplicateDetectionHistoryTimeWindow><MaxDeliveryCount>10</MaxDeliveryCount><AuthorizationRules/><CountDetails xmlns:d2p1="http://schemas.microsoft.com/netservices/2011/06/servicebus"><d2p1:ActiveMessageCount>0</d2p1:ActiveMessageCount></CountDetails><MaxMessageSizeInKilobytes>256</MaxMessageSizeInKilobytes></QueueDescription></content></entry>"#;

    #[test]
    fn a_queue_description_is_read_from_its_atom_entry() {
        let d = QueueDescription::from_atom(ENTRY).unwrap().unwrap();
        assert_eq!(
            d,
            QueueDescription {
                requires_duplicate_detection: true,
                duplicate_detection_history_time_window: Some(Duration::from_secs(600)),
                lock_duration: Some(Duration::from_secs(60)),
                max_delivery_count: Some(10),
                max_message_size_in_kilobytes: Some(256),
            }
        );
        let feed = r#"<feed xmlns="http://www.w3.org/2005/Atom"><title type="text">Publicly Listed Services</title><id>uuid:1</id><updated>2024-01-01T00:00:00Z</updated><generator>Service Bus 1.1</generator></feed>"#;
        assert_eq!(QueueDescription::from_atom(feed), Ok(None));
        assert!(QueueDescription::from_atom("not xml").is_err());
        let bad = ENTRY.replace("PT10M", "ten minutes");
        let e = QueueDescription::from_atom(&bad).unwrap_err();
        assert!(e.contains("DuplicateDetectionHistoryTimeWindow"), "{e}");
    }

    #[test]
    fn the_proof_refuses_naming_the_property_and_the_value_needed() {
        let needs = QueueNeeds {
            replay_gap: Duration::from_secs(121),
            call_deadline: Duration::from_secs(10),
        };
        let good = QueueDescription::from_atom(ENTRY).unwrap().unwrap();
        let proof = prove_queue("retries", Ok(good.clone()), &needs).unwrap();
        assert!(proof.warnings.is_empty(), "{proof:?}");
        assert!(proof.summary.contains("needs PT2M40S"), "{}", proof.summary);
        let off = QueueDescription {
            requires_duplicate_detection: false,
            ..good.clone()
        };
        let e = prove_queue("retries", Ok(off), &needs).unwrap_err();
        assert!(
            e.contains("RequiresDuplicateDetection = false") && e.contains("PT2M40S (160 s)"),
            "{e}"
        );
        let short = QueueDescription {
            duplicate_detection_history_time_window: Some(Duration::from_secs(60)),
            ..good.clone()
        };
        let e = prove_queue("retries", Ok(short), &needs).unwrap_err();
        assert!(
            e.contains("DuplicateDetectionHistoryTimeWindow = PT1M (60 s)")
                && e.contains("at least PT2M40S (160 s)"),
            "{e}"
        );
        let no_manage = RetryQueueError::Unauthorized {
            status: 401,
            detail: "Manage,EntityRead claims required for this operation.".into(),
        };
        let proof = prove_queue("retries", Err(no_manage), &needs).unwrap();
        assert!(proof.warnings[0].contains("Manage right"), "{proof:?}");
        let missing = RetryQueueError::EntityNotFound {
            status: 404,
            detail: String::new(),
        };
        assert!(prove_queue("retries", Err(missing), &needs)
            .unwrap_err()
            .contains("does not exist"));
        let short_lock = QueueDescription {
            lock_duration: Some(Duration::from_secs(5)),
            ..good
        };
        let proof = prove_queue("retries", Ok(short_lock), &needs).unwrap();
        assert!(
            proof.warnings[0].contains("LockDuration = PT5S"),
            "{proof:?}"
        );
    }

    #[test]
    fn namespaces_parse_and_plain_http_stays_local() {
        let e = ServiceBusEndpoint::parse("myns.servicebus.windows.net").unwrap();
        assert_eq!(
            (e.scheme.as_str(), e.host.as_str(), e.port),
            ("https", "myns.servicebus.windows.net", None)
        );
        let e = ServiceBusEndpoint::parse("sb://myns.servicebus.windows.net/").unwrap();
        assert_eq!(e.host, "myns.servicebus.windows.net");
        let e = ServiceBusEndpoint::parse("http://127.0.0.1:5380").unwrap();
        assert_eq!((e.scheme.as_str(), e.port), ("http", Some(5380)));
        assert!(ServiceBusEndpoint::parse("http://myns.servicebus.windows.net").is_err());
        assert!(ServiceBusEndpoint::parse("ftp://x").is_err());
        let e = ServiceBusEndpoint::parse("http://user:pa55word@127.0.0.1:5380").unwrap_err();
        assert!(e.contains("user name") && !e.contains("pa55word"), "{e}");
        assert!(ServiceBusEndpoint::parse("").is_err());
    }
}
