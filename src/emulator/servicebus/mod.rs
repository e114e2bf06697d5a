//! Service Bus emulator: the REST API exactly as `azure_messaging_servicebus` 0.21 uses it
//! (learn.microsoft.com/rest/api/servicebus), with the service's semantics from [`broker`].
//!
//! | request | answer |
//! |---|---|
//! | `POST /{queue}/messages` | 201 (a duplicate MessageId inside the window: 201, dropped) |
//! | `POST /{queue}/messages`, `Content-Type: application/vnd.microsoft.servicebus.json` | Send Message Batch: a JSON array of `{Body, BrokerProperties, UserProperties}`; 201 for the whole batch, or one refusal for all of it |
//! | `POST /{entity}/messages/head?timeout=N` | peek-lock: 201 + message, 204 when none arrives in N s |
//! | `DELETE /{entity}/messages/head` | receive-and-delete: 200 + message, 204 |
//! | `DELETE /{entity}/messages/{seq}/{lock}` | complete: 200; stale lock 404 |
//! | `PUT /{entity}/messages/{seq}/{lock}` | abandon: 200; stale lock 404 |
//! | `POST /{entity}/messages/{seq}/{lock}` | renew: 200; stale lock 404 |
//!
//! | `GET /{queue}?api-version=2021-05` | the queue's description: an Atom entry holding a `QueueDescription` (Manage right); an empty feed for a queue that does not exist |
//!
//! `{entity}` is a queue or `{queue}/$DeadLetterQueue`.
//!
//! Authentication is Azure's: every request carries `Authorization`, either a SAS signed
//! with the configured key (a rule with Manage, Send and Listen) or with the optional
//! send-and-listen key (no Manage: reading a description answers 401 "Manage,EntityRead
//! claims required for this operation", as Service Bus does), or an Entra ID
//! `Bearer` token. The emulator cannot verify an Entra ID token, so it accepts one only when
//! started with `accept_any_token` (`--accept-any-token`), with every right; otherwise a
//! bearer token gets 401 with a detail saying so. Sources: "Service Bus authentication and
//! authorization" and "Service Bus access control with Shared Access Signatures"
//! (learn.microsoft.com): SAS rules carry Send, Listen and Manage rights; Entra ID requests
//! carry `Authorization: Bearer` for `https://servicebus.azure.net/.default`.
//!
//! What Azure refuses, this refuses the same way (status and an XML `<Error>` whose
//! `<Detail>` says why), so hubguard's handling of each refusal is tested here:
//!
//! | rule | answer | source |
//! |---|---|---|
//! | the queue does not exist | 410 | REST reference: Send Message, Peek-Lock Message, Unlock/Delete Message ("specified queue or topic doesn't exist") |
//! | MessageId over 128 characters | 400 | "Service Bus quotas": MessageId, SessionId, PartitionKey at most 128 characters |
//! | `TimeToLive` not positive | 400 | `BrokerProperties` reference: a TimeSpan greater than zero |
//! | one custom property over 32 KB, all headers over 64 KB | 403, message too large | "Service Bus quotas": message property size, header size |
//! | more than 255 custom properties (headers) | 400, too many properties | "Service Bus quotas": "Maximum number of header properties in property bag: byte/int.MaxValue" (the stricter reading, `byte.MaxValue`) |
//! | body and headers over the queue's maximum message size (256 KB on Standard; 1 MB to 100 MB on Premium, per queue) | 403, message too large | "Service Bus quotas": message size; Send Message: "403 quota exceeded or message too large" |
//! | a batch that is not a non-empty JSON array of messages each with a string `Body`, or whose `Content-Type` has parameters | 400 | Send Message Batch: "a JSON array of messages. Each message contains a Body string"; "`application/vnd.microsoft.servicebus.json`, without parameters" |
//! | a batch over the queue's maximum message size (the request body) | 403, message too large | "Service Bus quotas": a batch may not exceed the maximum message size; Send Message Batch: "403 Quota exceeded or message too large" |
//! | one message of a batch refused (any rule above) | the whole batch refused, nothing enqueued | Send Message Batch: one status code for the request |
//! | a throttled namespace (fault kind `throttle`) | 503 (or 429) "server busy", `Retry-After` | "Service Bus messaging exceptions": ServerBusy; "Throttling operations on Azure Service Bus" |
//! | a queue configured outside Azure's ranges (lock 5 s–5 min, duplicate detection 20 s–7 days, message size) | the emulator refuses to start | "Service Bus quotas"; `QueueDescription` |

pub mod broker;

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::Deserialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::broker::{Broker, BrokerError, Entity, Locked, NewMessage, Queue, StoredMessage};
pub use self::broker::{Counters, QueueSpec};
use crate::azure::SasKey;
use crate::emulator::clock::{http_date, parse_http_date, Clock};
use crate::emulator::Faults;

/// How to run the Service Bus emulator.
#[derive(Debug, Clone)]
pub struct ServiceBusConfig {
    /// Address to listen on; port 0 picks a free one.
    pub listen: SocketAddr,
    /// The queues.
    pub queues: Vec<QueueSpec>,
    /// Where to keep queue journals; `None` keeps them in memory.
    pub data_dir: Option<PathBuf>,
    /// The SAS key requests must be signed with.
    pub key: SasKey,
    /// How long a peek-lock without `timeout` waits (the service waits 60 s; 0 answers at once).
    pub default_receive_wait: Duration,
    /// Accept any non-empty `Authorization: Bearer` token (Entra ID tokens cannot be verified
    /// here); without it a bearer token is refused with 401.
    pub accept_any_token: bool,
    /// A second SAS rule with Send and Listen but not Manage, as applications are usually
    /// given: it may send and receive, not read a queue's description.
    pub send_listen_key: Option<SasKey>,
}

impl Default for ServiceBusConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            queues: vec![QueueSpec::new("retries")],
            data_dir: None,
            key: SasKey::new(super::DEFAULT_KEY_NAME, super::DEFAULT_KEY),
            default_receive_wait: Duration::ZERO,
            accept_any_token: false,
            send_listen_key: None,
        }
    }
}

#[derive(Debug)]
struct Shared {
    broker: Broker,
    key: SasKey,
    send_listen_key: Option<SasKey>,
    accept_any_token: bool,
    default_receive_wait: Duration,
    /// MessageId fragments whose sends are refused with 400 (a test's stand-in for a message
    /// Azure refuses for what it is).
    refused: std::sync::Mutex<Vec<String>>,
    /// Send Message Batch requests accepted.
    batches: std::sync::atomic::AtomicU64,
}

/// A running Service Bus emulator. Dropping it stops it.
#[derive(Debug)]
pub struct ServiceBusEmulator {
    addr: SocketAddr,
    shared: Arc<Shared>,
    faults: Arc<Faults>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl ServiceBusEmulator {
    /// Opens the queues and starts listening.
    pub async fn start(config: ServiceBusConfig) -> io::Result<Self> {
        Self::start_with_clock(config, Arc::new(Clock::default())).await
    }

    /// Like [`start`](Self::start), on a shared clock.
    pub async fn start_with_clock(config: ServiceBusConfig, clock: Arc<Clock>) -> io::Result<Self> {
        let broker = Broker::open(&config.queues, config.data_dir.as_deref(), clock)?;
        let shared = Arc::new(Shared {
            broker,
            key: config.key,
            send_listen_key: config.send_listen_key,
            accept_any_token: config.accept_any_token,
            default_receive_wait: config.default_receive_wait,
            refused: std::sync::Mutex::default(),
            batches: Default::default(),
        });
        let shutdown = CancellationToken::new();
        let faults = Arc::new(Faults::new(shutdown.clone()));
        let router = Router::new().fallback(handle).with_state(shared.clone());
        let (addr, task) =
            super::http::serve(config.listen, router, faults.clone(), shutdown.clone()).await?;
        Ok(Self {
            addr,
            shared,
            faults,
            shutdown,
            task: Some(task),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `Endpoint=sb://HOST:PORT;SharedAccessKeyName=…;SharedAccessKey=…;UseDevelopmentEmulator=true`.
    pub fn connection_string(&self) -> String {
        format!(
            "Endpoint=sb://{};SharedAccessKeyName={};SharedAccessKey={};UseDevelopmentEmulator=true",
            self.addr,
            self.shared.key.name(),
            self.shared.key.secret()
        )
    }

    /// The fault injection handle.
    pub fn faults(&self) -> &Arc<Faults> {
        &self.faults
    }

    /// Refuses, with 400 Bad Request, every send whose MessageId contains `fragment`: a
    /// refusal of one message, as Azure answers a message it refuses for what it is.
    pub fn refuse_messages_containing(&self, fragment: impl Into<String>) {
        self.shared
            .refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(fragment.into());
    }

    /// The emulator's clock (tests advance it instead of sleeping).
    pub fn clock(&self) -> &Arc<Clock> {
        &self.shared.broker.clock
    }

    /// A queue, for counters and inspection.
    pub fn queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.shared.broker.queue(name)
    }

    /// Send Message Batch requests accepted so far (every queue).
    pub fn batches_accepted(&self) -> u64 {
        self.shared
            .batches
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counters of a queue.
    pub fn counters(&self, name: &str) -> Option<Counters> {
        let now = self.shared.broker.clock.now();
        self.queue(name).map(|q| q.counters(now))
    }

    /// All queue names.
    pub fn queue_names(&self) -> Vec<String> {
        self.shared.broker.queue_names()
    }

    /// Stops listening and drops every connection.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ServiceBusEmulator {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

#[derive(Debug, Deserialize)]
struct ReceiveQuery {
    timeout: Option<u64>,
}

/// BrokerProperties a sender may set (PascalCase JSON).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SentBrokerProperties {
    message_id: Option<String>,
    correlation_id: Option<String>,
    label: Option<String>,
    time_to_live: Option<f64>,
    scheduled_enqueue_time_utc: Option<String>,
}

/// The content type of Send Message Batch's body (REST reference, "Send Message Batch").
const BATCH_CONTENT_TYPE: &str = "application/vnd.microsoft.servicebus.json";

/// One message of a Send Message Batch body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct BatchedMessage {
    body: String,
    #[serde(default)]
    broker_properties: Option<SentBrokerProperties>,
    #[serde(default)]
    user_properties: Option<serde_json::Map<String, serde_json::Value>>,
}

fn error(status: StatusCode, code: &str, detail: impl Into<String>) -> Response {
    let detail = detail.into();
    (
        status,
        [("content-type", "application/xml; charset=utf-8")],
        format!(
            "<Error><Code>{}</Code><Detail>{code}: {}</Detail></Error>",
            status.as_u16(),
            xml_escape(&detail)
        ),
    )
        .into_response()
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// JSON with every non-ASCII character escaped, because the legacy client drops response
/// headers that are not ASCII.
fn ascii_json(value: &serde_json::Value) -> String {
    let raw = value.to_string();
    let mut out = String::with_capacity(raw.len());
    for c in raw.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// Headers that are HTTP plumbing, not custom message properties.
fn is_plumbing(name: &str) -> bool {
    matches!(
        name,
        "authorization"
            | "content-length"
            | "content-type"
            | "brokerproperties"
            | "host"
            | "user-agent"
            | "accept"
            | "accept-encoding"
            | "connection"
            | "transfer-encoding"
            | "x-ms-version"
            | "x-ms-client-request-id"
            | "traceparent"
            | "expect"
    )
}

fn parse_entity(path: &str) -> Option<(String, Entity, Vec<String>)> {
    let segs: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        })
        .collect();
    let messages = segs
        .iter()
        .position(|s| s.eq_ignore_ascii_case("messages"))?;
    let entity = &segs[..messages];
    let rest = segs[messages + 1..].to_vec();
    match entity {
        [q] => Some((q.clone(), Entity::Main, rest)),
        [q, dlq] if dlq.eq_ignore_ascii_case("$DeadLetterQueue") => {
            Some((q.clone(), Entity::DeadLetter, rest))
        }
        _ => None,
    }
}

/// The rights a request's credential carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rights {
    /// Manage, Send and Listen (the configured key, or an accepted bearer token).
    All,
    /// Send and Listen only.
    SendListen,
}

/// The request's rights, or why its `Authorization` does not verify (answered with 401).
fn authenticate(shared: &Shared, headers: &HeaderMap, uri: &Uri) -> Result<Rights, String> {
    let Some(token) = headers.get("authorization").and_then(|v| v.to_str().ok()) else {
        return Err("Unauthorized: the request carries no Authorization header".into());
    };
    if let Some(bearer) = token
        .strip_prefix("Bearer ")
        .or_else(|| token.strip_prefix("bearer "))
    {
        return if !shared.accept_any_token {
            Err("Unauthorized: this emulator cannot verify Entra ID (Bearer) tokens and accepts them only when started with --accept-any-token; sign with the SAS key instead".into())
        } else if bearer.trim().is_empty() {
            Err("Unauthorized: the Bearer token is empty".into())
        } else {
            Ok(Rights::All)
        };
    }
    let now = shared.broker.clock.now();
    match shared.key.verify(token, uri.path(), now) {
        Ok(_) => Ok(Rights::All),
        Err(e) => match &shared.send_listen_key {
            Some(k) if k.verify(token, uri.path(), now).is_ok() => Ok(Rights::SendListen),
            _ => Err(format!("Unauthorized: {e}")),
        },
    }
}

/// `GET /{queue}`: the queue's description, as the management REST API answers it.
fn describe(shared: &Shared, name: &str, host: &str) -> Response {
    let atom = [(
        "content-type",
        "application/atom+xml;type=entry;charset=utf-8",
    )];
    let Some(queue) = shared.broker.queue(name) else {
        // Service Bus answers a missing entity with an empty feed, not an error (the
        // official administration clients turn it into "does not exist").
        return (
            StatusCode::OK,
            [("content-type", "application/atom+xml;type=feed;charset=utf-8")],
            format!(
                "<feed xmlns=\"http://www.w3.org/2005/Atom\"><title type=\"text\">Publicly Listed Services</title><subtitle type=\"text\">This is the list of publicly-listed services currently available.</subtitle><id>uuid:{}</id><updated>{}</updated><generator>Service Bus 1.1</generator></feed>",
                uuid::Uuid::new_v4(),
                atom_time(shared.broker.clock.now())
            ),
        )
            .into_response();
    };
    (
        StatusCode::OK,
        atom,
        queue_entry(&queue.spec(), host, shared.broker.clock.now()),
    )
        .into_response()
}

fn atom_time(t: SystemTime) -> String {
    time::OffsetDateTime::from(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// A duration as .NET writes a `TimeSpan` in XML (`PT1M`, `P7D`, `PT0.5S`).
fn xml_timespan(d: Duration) -> String {
    let secs = d.as_secs();
    let (days, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let nanos = d.subsec_nanos();
    let mut time = String::new();
    if h > 0 {
        time += &format!("{h}H");
    }
    if m > 0 {
        time += &format!("{m}M");
    }
    if s > 0 || nanos > 0 {
        if nanos > 0 {
            let frac = format!("{:07}", nanos / 100);
            time += &format!("{s}.{}S", frac.trim_end_matches('0'));
        } else {
            time += &format!("{s}S");
        }
    }
    match (days, time.is_empty()) {
        (0, true) => "PT0S".into(),
        (0, false) => format!("PT{time}"),
        (d, true) => format!("P{d}D"),
        (d, false) => format!("P{d}DT{time}"),
    }
}

/// .NET's `TimeSpan.MaxValue`, the default time to live and auto-delete interval.
const TIMESPAN_MAX: &str = "P10675199DT2H48M5.4775807S";

/// The Atom entry of a queue, in the shape of the Get Queue reference (the management REST
/// API, api-version 2021-05), from its [`QueueSpec`].
fn queue_entry(spec: &QueueSpec, host: &str, now: SystemTime) -> String {
    let url = format!("https://{host}/{}?api-version=2021-05", spec.name);
    let window = spec
        .duplicate_detection_window
        .unwrap_or(Duration::from_secs(600));
    let ttl = spec
        .default_ttl
        .map(xml_timespan)
        .unwrap_or_else(|| TIMESPAN_MAX.into());
    let t = atom_time(now);
    format!(
        "<entry xmlns=\"http://www.w3.org/2005/Atom\"><id>{url}</id><title type=\"text\">{name}</title><published>{t}</published><updated>{t}</updated><author><name>emulator</name></author><link rel=\"self\" href=\"{url}\"/><content type=\"application/xml\"><QueueDescription xmlns=\"http://schemas.microsoft.com/netservices/2010/10/servicebus/connect\" xmlns:i=\"http://www.w3.org/2001/XMLSchema-instance\"><LockDuration>{lock}</LockDuration><MaxSizeInMegabytes>1024</MaxSizeInMegabytes><RequiresDuplicateDetection>{requires}</RequiresDuplicateDetection><RequiresSession>false</RequiresSession><DefaultMessageTimeToLive>{ttl}</DefaultMessageTimeToLive><DeadLetteringOnMessageExpiration>{dlq}</DeadLetteringOnMessageExpiration><DuplicateDetectionHistoryTimeWindow>{window}</DuplicateDetectionHistoryTimeWindow><MaxDeliveryCount>{mdc}</MaxDeliveryCount><EnableBatchedOperations>true</EnableBatchedOperations><SizeInBytes>0</SizeInBytes><MessageCount>0</MessageCount><IsAnonymousAccessible>false</IsAnonymousAccessible><AuthorizationRules/><Status>Active</Status><CreatedAt>{t}</CreatedAt><UpdatedAt>{t}</UpdatedAt><AccessedAt>{t}</AccessedAt><SupportOrdering>true</SupportOrdering><AutoDeleteOnIdle>{max}</AutoDeleteOnIdle><EnablePartitioning>false</EnablePartitioning><EntityAvailabilityStatus>Available</EntityAvailabilityStatus><EnableExpress>false</EnableExpress><MaxMessageSizeInKilobytes>{kb}</MaxMessageSizeInKilobytes></QueueDescription></content></entry>",
        name = xml_escape(&spec.name),
        lock = xml_timespan(spec.lock_duration),
        requires = spec.duplicate_detection_window.is_some(),
        dlq = spec.dead_letter_on_expiration,
        window = xml_timespan(window),
        mdc = spec.max_delivery_count,
        max = TIMESPAN_MAX,
        kb = spec.max_message_size_kb,
    )
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    Query(query): Query<ReceiveQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let rights = match authenticate(&shared, &headers, &uri) {
        Ok(r) => r,
        Err(detail) => return error(StatusCode::UNAUTHORIZED, "40100", detail),
    };
    if method == Method::GET && !uri.path().to_ascii_lowercase().contains("/messages") {
        let segs: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
        if let [name] = segs.as_slice() {
            if rights != Rights::All {
                return error(
                    StatusCode::UNAUTHORIZED,
                    "40100",
                    "Unauthorized: Manage,EntityRead claims required for this operation.",
                );
            }
            let name = percent_encoding::percent_decode_str(name).decode_utf8_lossy();
            let host = headers
                .get("host")
                .and_then(|h| h.to_str().ok())
                .unwrap_or("localhost");
            return describe(&shared, &name, host);
        }
    }
    let Some((name, entity, rest)) = parse_entity(uri.path()) else {
        return error(
            StatusCode::NOT_FOUND,
            "40400",
            format!("No such endpoint: {}", uri.path()),
        );
    };
    let Some(queue) = shared.broker.queue(&name) else {
        return broker_error(BrokerError::EntityNotFound(name));
    };
    let now = shared.broker.clock.now();
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost")
        .to_string();
    let result = match (method.clone(), rest.as_slice()) {
        (Method::POST, []) if entity == Entity::Main && is_batch(&headers) => {
            send_batch(&queue, &shared.refused, &name, &headers, body, now).inspect(|_| {
                shared
                    .batches
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
        }
        (Method::POST, []) if entity == Entity::Main => {
            send(&queue, &shared.refused, &name, &headers, body, now)
        }
        (Method::POST, [head]) if head.eq_ignore_ascii_case("head") => {
            let wait = query
                .timeout
                .map(Duration::from_secs)
                .unwrap_or(shared.default_receive_wait);
            return peek_lock(&shared, &queue, entity, wait, &host, &name).await;
        }
        (Method::DELETE, [head]) if head.eq_ignore_ascii_case("head") => {
            return match queue.take(entity, now) {
                Ok(Some(m)) => message_response(StatusCode::OK, &m, None, None),
                Ok(None) => StatusCode::NO_CONTENT.into_response(),
                Err(e) => broker_error(e),
            };
        }
        (Method::DELETE, [id, token]) => queue
            .complete(entity, id, token, now)
            .map(|_| StatusCode::OK),
        (Method::PUT, [id, token]) => queue
            .abandon(entity, id, token, now)
            .map(|_| StatusCode::OK),
        (Method::POST, [id, token]) => queue.renew(entity, id, token, now).map(|_| StatusCode::OK),
        _ => Err(BrokerError::NotAllowed(
            "operation not supported on this entity",
        )),
    };
    match result {
        Ok(status) => status.into_response(),
        Err(e) => broker_error(e),
    }
}

fn broker_error(e: BrokerError) -> Response {
    match e {
        BrokerError::EntityNotFound(_) => error(StatusCode::GONE, "41000", e.to_string()),
        BrokerError::BadRequest(_) => error(StatusCode::BAD_REQUEST, "40000", e.to_string()),
        BrokerError::MessageTooLarge(_) => error(StatusCode::FORBIDDEN, "40300", e.to_string()),
        BrokerError::LockLost => error(StatusCode::NOT_FOUND, "40400", e.to_string()),
        BrokerError::NotAllowed(_) => error(StatusCode::BAD_REQUEST, "40000", e.to_string()),
        BrokerError::Storage(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "50000", e.to_string()),
    }
}

/// Refuses a send that breaks one of Azure's limits on a message (see the module's table).
fn check_limits(
    queue: &Queue,
    name: &str,
    headers: &HeaderMap,
    props: &SentBrokerProperties,
    body_len: usize,
) -> Result<(), BrokerError> {
    use self::broker::limits;
    if let Some(id) = &props.message_id {
        let chars = id.chars().count();
        if chars > limits::MESSAGE_ID_CHARS {
            return Err(BrokerError::BadRequest(format!(
                "The value supplied for MessageId is {chars} characters long; the maximum length is {}.",
                limits::MESSAGE_ID_CHARS
            )));
        }
    }
    if let Some(ttl) = props.time_to_live {
        if ttl.is_nan() || ttl <= 0.0 {
            return Err(BrokerError::BadRequest(format!(
                "The value supplied for TimeToLive ({ttl}) must be a positive TimeSpan."
            )));
        }
    }
    // Each custom property is one header ("Send Message", REST reference); Azure counts
    // them in the message's property bag, at most `byte.MaxValue` of them
    // (https://learn.microsoft.com/azure/service-bus-messaging/service-bus-quotas).
    let custom = headers.keys().filter(|n| !is_plumbing(n.as_str())).count();
    if custom > limits::CUSTOM_PROPERTIES {
        return Err(BrokerError::BadRequest(format!(
            "The message has too many properties: {custom} custom properties, while at most {} are allowed in a message's property bag.",
            limits::CUSTOM_PROPERTIES
        )));
    }
    let mut header_bytes = 0;
    for (n, v) in headers {
        let size = n.as_str().len() + v.as_bytes().len();
        if n == "brokerproperties" || !is_plumbing(n.as_str()) {
            header_bytes += size;
        }
        if !is_plumbing(n.as_str()) && size > limits::PROPERTY_BYTES {
            return Err(BrokerError::MessageTooLarge(format!(
                "The message property '{}' is {size} bytes, which exceeds the maximum size of {} bytes allowed for a property.",
                n.as_str(),
                limits::PROPERTY_BYTES
            )));
        }
    }
    if header_bytes > limits::HEADER_BYTES {
        return Err(BrokerError::MessageTooLarge(format!(
            "The message headers are {header_bytes} bytes, which exceeds the maximum size of {} bytes allowed for headers.",
            limits::HEADER_BYTES
        )));
    }
    let max = queue.max_message_bytes();
    let size = body_len + header_bytes;
    if size > max {
        return Err(BrokerError::MessageTooLarge(format!(
            "The message of {size} bytes exceeds the maximum message size of {max} bytes allowed on the entity '{name}'."
        )));
    }
    Ok(())
}

/// Whether a send is a Send Message Batch (its content type, parameters or not: a batch
/// with parameters is refused by [`send_batch`], not taken for one message).
fn is_batch(headers: &HeaderMap) -> bool {
    headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(BATCH_CONTENT_TYPE))
}

/// Send Message Batch: every message checked as [`send`] checks one (its `UserProperties`
/// are its custom properties), the batch as a whole against the queue's maximum message
/// size; one refusal refuses the whole batch and nothing is enqueued.
fn send_batch(
    queue: &Queue,
    refused: &std::sync::Mutex<Vec<String>>,
    name: &str,
    headers: &HeaderMap,
    body: Bytes,
    now: SystemTime,
) -> Result<StatusCode, BrokerError> {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if content_type.contains(';') {
        return Err(BrokerError::BadRequest(format!(
            "The Content-Type of a batch must be {BATCH_CONTENT_TYPE} without parameters, not '{content_type}'."
        )));
    }
    let max = queue.max_message_bytes();
    if body.len() > max {
        return Err(BrokerError::MessageTooLarge(format!(
            "The batch of {} bytes exceeds the maximum message size of {max} bytes allowed on the entity '{name}'.",
            body.len()
        )));
    }
    let batch: Vec<BatchedMessage> = serde_json::from_slice(&body).map_err(|e| {
        BrokerError::BadRequest(format!(
            "The batch is not a JSON array of messages with a Body string: {e}"
        ))
    })?;
    if batch.is_empty() {
        return Err(BrokerError::BadRequest("The batch has no messages.".into()));
    }
    let mut messages = Vec::with_capacity(batch.len());
    for m in batch {
        let props = m.broker_properties.unwrap_or_default();
        // Its custom properties as the headers a single send would carry them in, so one
        // set of checks applies to both.
        let mut own = HeaderMap::new();
        let mut properties = Vec::new();
        for (k, v) in m.user_properties.unwrap_or_default() {
            let value = match v {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            let (Ok(n), Ok(hv)) = (
                axum::http::HeaderName::from_bytes(k.as_bytes()),
                axum::http::HeaderValue::from_str(&value),
            ) else {
                return Err(BrokerError::BadRequest(format!(
                    "The property '{k}' of a batched message is not a valid property name and value."
                )));
            };
            own.append(n, hv);
            properties.push((k.to_ascii_lowercase(), value));
        }
        let scheduled = admit(queue, refused, name, &own, &props, m.body.len())?;
        messages.push(NewMessage {
            message_id: props.message_id,
            body: m.body.into_bytes(),
            // A message's ContentType is its request's Content-Type header, not a broker
            // property ("Message headers and properties": properties not listed are
            // ignored): a batched message has none.
            content_type: None,
            correlation_id: props.correlation_id,
            label: props.label,
            time_to_live: props.time_to_live,
            scheduled_enqueue_time: scheduled,
            properties,
        });
    }
    for m in messages {
        queue.send(m, now)?;
    }
    Ok(StatusCode::CREATED)
}

/// One message's checks before it is enqueued (Azure's limits, a test's injected refusal),
/// and its scheduled enqueue time, if any.
fn admit(
    queue: &Queue,
    refused: &std::sync::Mutex<Vec<String>>,
    name: &str,
    headers: &HeaderMap,
    props: &SentBrokerProperties,
    body_len: usize,
) -> Result<Option<SystemTime>, BrokerError> {
    check_limits(queue, name, headers, props, body_len)?;
    if let Some(id) = &props.message_id {
        let refused = refused.lock().unwrap_or_else(|p| p.into_inner());
        if refused.iter().any(|f| id.contains(f.as_str())) {
            return Err(BrokerError::BadRequest(format!(
                "The message '{id}' was refused (injected refusal)."
            )));
        }
    }
    let scheduled = match props.scheduled_enqueue_time_utc.as_deref() {
        Some(s) => Some(parse_http_date(s).ok_or(BrokerError::NotAllowed(
            "ScheduledEnqueueTimeUtc is not an RFC 2822 date",
        ))?),
        None => None,
    };
    Ok(scheduled)
}

fn send(
    queue: &Queue,
    refused: &std::sync::Mutex<Vec<String>>,
    name: &str,
    headers: &HeaderMap,
    body: Bytes,
    now: SystemTime,
) -> Result<StatusCode, BrokerError> {
    let props: SentBrokerProperties = match headers.get("brokerproperties") {
        Some(v) => serde_json::from_slice(v.as_bytes())
            .map_err(|_| BrokerError::NotAllowed("BrokerProperties is not valid JSON"))?,
        None => SentBrokerProperties::default(),
    };
    let scheduled = admit(queue, refused, name, headers, &props, body.len())?;
    let properties = headers
        .iter()
        .filter(|(n, _)| !is_plumbing(n.as_str()))
        .map(|(n, v)| {
            let raw = String::from_utf8_lossy(v.as_bytes()).into_owned();
            let value = raw
                .strip_prefix('"')
                .and_then(|r| r.strip_suffix('"'))
                .map(String::from)
                .unwrap_or(raw);
            (n.as_str().to_string(), value)
        })
        .collect();
    queue.send(
        NewMessage {
            message_id: props.message_id,
            body: body.to_vec(),
            content_type: headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(String::from),
            correlation_id: props.correlation_id,
            label: props.label,
            time_to_live: props.time_to_live,
            scheduled_enqueue_time: scheduled,
            properties,
        },
        now,
    )?;
    Ok(StatusCode::CREATED)
}

async fn peek_lock(
    shared: &Shared,
    queue: &Arc<Queue>,
    entity: Entity,
    wait: Duration,
    host: &str,
    name: &str,
) -> Response {
    let clock = &shared.broker.clock;
    let deadline = tokio::time::Instant::now() + wait;
    let _receiving = queue.receiving();
    loop {
        // Register for wake-ups before looking, so a send in between is not missed.
        let changed = queue.changed();
        let advanced = clock.advanced();
        match queue.try_lock(entity, clock.now()) {
            Ok(Some(locked)) => {
                let entity_path = match entity {
                    Entity::Main => name.to_string(),
                    Entity::DeadLetter => format!("{name}/$DeadLetterQueue"),
                };
                let location = format!(
                    "http://{host}/{entity_path}/messages/{}/{}",
                    locked.message.sequence_number, locked.lock_token
                );
                return message_response(
                    StatusCode::CREATED,
                    &locked.message,
                    Some(&locked),
                    Some(location),
                );
            }
            Ok(None) => {}
            Err(e) => return broker_error(e),
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return StatusCode::NO_CONTENT.into_response();
        }
        let mut until = deadline;
        if let Some(t) = queue.next_change(entity) {
            until = until.min(now + clock.until(t) + Duration::from_millis(1));
        }
        tokio::select! {
            _ = changed => {}
            _ = advanced => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

fn message_response(
    status: StatusCode,
    m: &StoredMessage,
    locked: Option<&Locked>,
    location: Option<String>,
) -> Response {
    let mut bp = serde_json::json!({
        "DeliveryCount": m.delivery_count,
        "EnqueuedSequenceNumber": m.sequence_number.min(i64::from(i32::MAX)),
        "EnqueuedTimeUtc": http_date(SystemTime::UNIX_EPOCH + Duration::from_millis(m.enqueued_at_ms.max(0) as u64)),
        "MessageId": m.message_id,
        "SequenceNumber": m.sequence_number,
        "State": if locked.is_some() || !m.scheduled { "Active" } else { "Scheduled" },
        "TimeToLive": m.time_to_live.unwrap_or(922_337_203_685.477_5),
    });
    let obj = bp.as_object_mut().expect("object");
    if let Some(l) = locked {
        obj.insert("LockToken".into(), l.lock_token.clone().into());
        obj.insert("LockedUntilUtc".into(), http_date(l.locked_until).into());
    } else {
        obj.insert(
            "LockToken".into(),
            "00000000-0000-0000-0000-000000000000".into(),
        );
        obj.insert(
            "LockedUntilUtc".into(),
            http_date(SystemTime::UNIX_EPOCH).into(),
        );
    }
    if let Some(c) = &m.correlation_id {
        obj.insert("CorrelationId".into(), c.clone().into());
    }
    if let Some(l) = &m.label {
        obj.insert("Label".into(), l.clone().into());
    }
    if m.scheduled {
        obj.insert(
            "ScheduledEnqueueTimeUtc".into(),
            http_date(
                SystemTime::UNIX_EPOCH + Duration::from_millis(m.enqueued_at_ms.max(0) as u64),
            )
            .into(),
        );
    }
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(&ascii_json(&bp)) {
        headers.insert("brokerproperties", v);
    }
    if let Some(loc) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        headers.insert("location", loc);
    }
    if let Some(ct) = m
        .content_type
        .as_deref()
        .and_then(|c| HeaderValue::from_str(c).ok())
    {
        headers.insert("content-type", ct);
    }
    for (k, v) in &m.properties {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            if v.to_str().is_ok() {
                headers.insert(n, v);
            }
        }
    }
    if let Some((reason, description)) = &m.dead_letter {
        if let Ok(v) = HeaderValue::from_str(reason) {
            headers.insert("deadletterreason", v);
        }
        if let Ok(v) = HeaderValue::from_str(description) {
            headers.insert("deadlettererrordescription", v);
        }
    }
    (status, headers, m.body.clone()).into_response()
}
