//! Service Bus emulator: the REST API exactly as `azure_messaging_servicebus` 0.21 uses it
//! (`EMULATOR_NOTES.md` §2 and §8), with the service's semantics from [`broker`].
//!
//! | request | answer |
//! |---|---|
//! | `POST /{queue}/messages` | 201 (a duplicate MessageId inside the window: 201, dropped) |
//! | `POST /{entity}/messages/head?timeout=N` | peek-lock: 201 + message, 204 when none arrives in N s |
//! | `DELETE /{entity}/messages/head` | receive-and-delete: 200 + message, 204 |
//! | `DELETE /{entity}/messages/{seq}/{lock}` | complete: 200; stale lock 404 |
//! | `PUT /{entity}/messages/{seq}/{lock}` | abandon: 200; stale lock 404 |
//! | `POST /{entity}/messages/{seq}/{lock}` | renew: 200; stale lock 404 |
//!
//! `{entity}` is a queue or `{queue}/$DeadLetterQueue`. Every request must carry a SAS
//! `Authorization` signed with the configured key (401 otherwise).
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
//! | body and headers over the queue's maximum message size (256 KB on Standard; 1 MB to 100 MB on Premium, per queue) | 403, message too large | "Service Bus quotas": message size; Send Message: "403 quota exceeded or message too large" |
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
}

impl Default for ServiceBusConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            queues: vec![QueueSpec::new("retries")],
            data_dir: None,
            key: SasKey::new(super::DEFAULT_KEY_NAME, super::DEFAULT_KEY),
            default_receive_wait: Duration::ZERO,
        }
    }
}

#[derive(Debug)]
struct Shared {
    broker: Broker,
    key: SasKey,
    default_receive_wait: Duration,
    /// MessageId fragments whose sends are refused with 400 (a test's stand-in for a message
    /// Azure refuses for what it is).
    refused: std::sync::Mutex<Vec<String>>,
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
            default_receive_wait: config.default_receive_wait,
            refused: std::sync::Mutex::default(),
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

/// `Some(401 response)` when the request's SAS does not verify.
fn refuse_unauthorised(shared: &Shared, headers: &HeaderMap, uri: &Uri) -> Option<Response> {
    let Some(token) = headers.get("authorization").and_then(|v| v.to_str().ok()) else {
        return Some(error(
            StatusCode::UNAUTHORIZED,
            "40100",
            "Unauthorized: the request carries no Authorization header",
        ));
    };
    shared
        .key
        .verify(token, uri.path(), shared.broker.clock.now())
        .err()
        .map(|e| {
            error(
                StatusCode::UNAUTHORIZED,
                "40100",
                format!("Unauthorized: {e}"),
            )
        })
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    Query(query): Query<ReceiveQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refusal) = refuse_unauthorised(&shared, &headers, &uri) {
        return refusal;
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
    check_limits(queue, name, headers, &props, body.len())?;
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
