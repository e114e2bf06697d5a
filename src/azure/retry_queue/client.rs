//! [`ServiceBusRetryQueue`]: the [`RetryQueue`](super::RetryQueue) on `azure_messaging_servicebus` 0.21.

use super::atom::QueueDescription;
use super::classify::classify;
use super::classify::lock_error;
use super::classify::status_error;
use super::endpoint::ServiceBusEndpoint;
use super::error::RetryQueueError;
use super::http::BearerTokenHttpClient;
use super::http::DetailedErrors;
use super::http::MeasuredHttpClient;
use super::MessageLock;
use super::OutgoingMessage;
use super::ReceivedMessage;
use super::RetryQueue;
use crate::azure::ConnectionString;
use crate::azure::SasKey;
use crate::clock::ceil_to_second;
use async_trait::async_trait;
use azure_core::credentials::TokenCredential;
use azure_core_legacy::headers::HeaderValue;
use azure_core_legacy::headers::Headers;
use azure_core_legacy::HttpClient;
use azure_core_legacy::Request;
use azure_messaging_servicebus::service_bus::PeekLockResponse;
use azure_messaging_servicebus::service_bus::QueueClient;
use azure_messaging_servicebus::service_bus::SendMessageOptions;
use azure_messaging_servicebus::service_bus::SettableBrokerProperties;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use std::time::SystemTime;
use std::time::UNIX_EPOCH;

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
    /// The clock the HTTP stack reports each response's `Date` to (set by `with_clock`).
    measured: Arc<std::sync::OnceLock<Arc<crate::clock::Clock>>>,
    /// Concurrent sends coalesced into Send Message Batch ([`super::batch`]), unless off.
    batcher: super::batch::Batcher,
    batching: bool,
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
    /// authenticated with an Entra ID token from `credential` for [`SERVICE_BUS_SCOPE`](super::SERVICE_BUS_SCOPE)
    /// (roles: Azure Service Bus Data Sender and Data Receiver; Data Owner to read the
    /// queue's description).
    pub fn with_token_credential(
        namespace: &str,
        credential: Arc<dyn TokenCredential>,
        queue: &str,
        options: ServiceBusOptions,
    ) -> Result<Self, RetryQueueError> {
        let endpoint = ServiceBusEndpoint::parse(namespace)
            .map_err(|e| RetryQueueError::Protocol(e.to_string()))?;
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
        let measured = Arc::new(std::sync::OnceLock::new());
        let authenticated: Arc<dyn HttpClient> =
            Arc::new(MeasuredHttpClient::new(authenticated, measured.clone()));
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
            measured,
            batcher: Default::default(),
            batching: true,
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
            let request = self.signed(&url, azure_core_legacy::Method::Get)?;
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
    /// Sends every message alone (Send Message), never in a batch: for a queue whose readers
    /// need each message's content type (a batch carries one `Content-Type` for the
    /// request, none per message), such as the dead letters published for other consumers.
    pub fn without_batching(mut self) -> Self {
        self.batching = false;
        self
    }

    /// A request to `url` the crate does not make itself, signed as its own are: with the SAS
    /// key (an hour's token), or by the bearer token the HTTP stack adds.
    fn signed(
        &self,
        url: &str,
        method: azure_core_legacy::Method,
    ) -> Result<Request, RetryQueueError> {
        let url = azure_core_legacy::Url::parse(url)
            .map_err(|e| RetryQueueError::Protocol(format!("bad queue URL: {e}")))?;
        let mut request = Request::new(url, method);
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
        Ok(request)
    }

    /// Reads due times and lock expiry on `clock` (the one the pipeline and, in tests, the
    /// emulator share) instead of the wall clock.
    /// The `Date` of every response is reported to it (Service Bus's time is measured so).
    pub fn with_clock(mut self, clock: Arc<crate::clock::Clock>) -> Self {
        let _ = self.measured.set(clock.clone());
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

/// The due time a message is sent with: `None` (at once) for a time not in the future,
/// else rounded up to the whole second the protocol carries.
fn scheduled_at(due: SystemTime, now: SystemTime) -> Option<SystemTime> {
    (due > now).then(|| ceil_to_second(due))
}

impl ServiceBusRetryQueue {
    /// `message` as an element of Send Message Batch's JSON array: `Body`, its
    /// `BrokerProperties` (what a single send carries in the `BrokerProperties` header) and
    /// its custom properties as `UserProperties`. A message's content type is its request's
    /// `Content-Type` header, which a batch cannot give each message: a message whose
    /// content type matters to its reader goes alone ([`ServiceBusRetryQueue::without_batching`]).
    fn batch_element(&self, message: &OutgoingMessage) -> Result<String, RetryQueueError> {
        let mut broker = serde_json::Map::new();
        let mut put = |k: &str, v: serde_json::Value| {
            broker.insert(k.to_string(), v);
        };
        put("MessageId", message.message_id.clone().into());
        if let Some(c) = &message.correlation_id {
            put("CorrelationId", c.clone().into());
        }
        if let Some(l) = &message.label {
            put("Label", l.clone().into());
        }
        if let Some(t) = message.time_to_live {
            put("TimeToLive", t.as_secs_f64().into());
        }
        if let Some(at) = scheduled_at(message.due, self.clock.now()) {
            put(
                "ScheduledEnqueueTimeUtc",
                crate::clock::http_date(at).into(),
            );
        }
        let user: serde_json::Map<String, serde_json::Value> = message
            .properties
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into()))
            .collect();
        let mut element = serde_json::Map::new();
        element.insert("Body".into(), message.body.clone().into());
        element.insert("BrokerProperties".into(), broker.into());
        if !user.is_empty() {
            element.insert("UserProperties".into(), user.into());
        }
        serde_json::to_string(&element).map_err(|e| RetryQueueError::Protocol(e.to_string()))
    }
}

#[async_trait]
impl super::batch::Send for ServiceBusRetryQueue {
    async fn send_one(&self, message: OutgoingMessage) -> Result<(), RetryQueueError> {
        // A due time in the past means "now": send unscheduled rather than rounding it up.
        let scheduled = scheduled_at(message.due, self.clock.now()).map(time::OffsetDateTime::from);
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

    /// Send Message Batch: `POST {queue}/messages`, `Content-Type:
    /// application/vnd.microsoft.servicebus.json`, signed as every request (a SAS, or the
    /// bearer token the HTTP stack adds).
    async fn send_batch(&self, body: String) -> Result<(), RetryQueueError> {
        self.deadline(Duration::ZERO, async {
            let url = format!("{}/messages", self.entity_url);
            let mut request = self.signed(&url, azure_core_legacy::Method::Post)?;
            request.insert_header(
                azure_core_legacy::headers::CONTENT_TYPE,
                HeaderValue::from_static("application/vnd.microsoft.servicebus.json"),
            );
            request.set_body(body);
            self.http
                .execute_request(&request)
                .await
                .map(|_| ())
                .map_err(|e| classify(&e))
        })
        .await
    }
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
        if !self.batching {
            return super::batch::Send::send_one(self, message).await;
        }
        let json = self.batch_element(&message)?;
        self.batcher.send(self, message, json).await
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
            let secs = crate::clock::ceil_secs(wait);
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
