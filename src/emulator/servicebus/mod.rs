//! Service Bus emulator: the REST API exactly as `azure_messaging_servicebus` 0.21 uses it
//! (learn.microsoft.com/rest/api/servicebus), with the service's semantics from [`broker`].
//!
//! | request | answer |
//! |---|---|
//! | `POST /{queue}/messages` | 201 (a duplicate MessageId inside the window: 201, dropped) |
//! | `POST /{queue}/messages`, `Content-Type: application/vnd.microsoft.servicebus.json` | Send Message Batch: a JSON array of `{Body, BrokerProperties, UserProperties}`; 201 for the whole batch, or one refusal for all of it |
//! | `POST /{entity}/messages/head?timeout=N` | peek-lock: 201 + message, 204 when none arrives in N s |
//! | `DELETE /{entity}/messages/head` | receive-and-delete: 200 + message (no lock fields; the delivery counts), 204 |
//! | `DELETE /{entity}/messages/{seq}/{lock}` | complete: 200; stale lock 404 |
//! | `PUT /{entity}/messages/{seq}/{lock}` | abandon: 200; stale lock 404 |
//! | `POST /{entity}/messages/{seq}/{lock}` | renew: 200; stale lock 404 |
//!
//! | `GET /{queue}?api-version=2021-05` | the queue's description: an Atom entry holding a `QueueDescription` (Manage right); an empty feed for a queue that does not exist |
//!
//! `{entity}` is a queue or `{queue}/$DeadLetterQueue`. An accepted send or settlement has an
//! empty `application/xml; charset=utf-8` body, and a received message carries the
//! `Content-Type` it was sent with, or none — as Azure answered the REST calls recorded in
//! `tests/data/azure-recordings` (held by tests/it/conformance_servicebus.rs; the rules that
//! stand on the documentation alone are listed in docs/conformance.md).
//!
//! Authentication is Azure's: every request carries `Authorization`, either a SAS signed
//! with the configured key (a rule with Manage, Send and Listen) or with the optional
//! send-and-listen key (no Manage: reading a description answers 401 "Manage,EntityRead
//! claims required for this operation", as Service Bus does), or with further rules of
//! Send only or Listen only ([`SasRule`]: a send without Send, or a receive, complete, abandon
//! or renew without Listen, answers 401 "Unauthorized access. 'Send' claim(s) are required
//! to perform this operation. Resource: 'sb://…'", as Service Bus words it), or an Entra ID
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
//!
//! This module starts the server, authenticates and routes each request and long-polls a
//! peek-lock; `send` takes and checks sends, `describe` answers a queue's description,
//! `response` writes errors and received messages, and [`broker`] keeps the queues.

pub mod broker;
mod describe;
mod response;
mod send;

use crate::sync::LockExt;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::Deserialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::broker::{Broker, BrokerError, Entity, Queue};
pub use self::broker::{Counters, QueueSpec};
use self::describe::describe;
use self::response::{broker_error, error, message_response};
use self::send::{is_batch, send, send_batch};
use crate::azure::SasKey;
use crate::emulator::clock::Clock;
use crate::emulator::sas::Verify as _;
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
    /// More SAS rules without Manage, each with the rights it names (a rule with Send
    /// only, or Listen only): a request its rule lacks the claim for is refused with 401.
    pub rules: Vec<SasRule>,
}

/// A SAS authorization rule without Manage ("Service Bus access control with Shared Access
/// Signatures": a rule carries Send, Listen and Manage rights, Manage only with both others).
#[derive(Debug, Clone)]
pub struct SasRule {
    /// Its name and key.
    pub key: SasKey,
    /// May send.
    pub send: bool,
    /// May receive, complete, abandon and renew.
    pub listen: bool,
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
            rules: Vec::new(),
        }
    }
}

#[derive(Debug)]
struct Shared {
    broker: Broker,
    key: SasKey,
    send_listen_key: Option<SasKey>,
    rules: Vec<SasRule>,
    accept_any_token: bool,
    default_receive_wait: Duration,
    /// MessageId fragments whose sends are refused with 400 (a test's stand-in for a message
    /// Azure refuses for what it is).
    refused: std::sync::Mutex<Vec<String>>,
    /// Send Message Batch requests accepted.
    batches: std::sync::atomic::AtomicU64,
    /// When the queues were created (a description's `CreatedAt`, `UpdatedAt` and `ETag`).
    created: std::time::SystemTime,
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
        let created = clock.now();
        let broker = Broker::open(&config.queues, config.data_dir.as_deref(), clock)?;
        let shared = Arc::new(Shared {
            created,
            broker,
            key: config.key,
            send_listen_key: config.send_listen_key,
            rules: config.rules,
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
        self.shared.refused.locked().push(fragment.into());
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

/// The rights (claims) a request's credential carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rights {
    manage: bool,
    send: bool,
    listen: bool,
}

impl Rights {
    /// Manage, Send and Listen (the configured key, or an accepted bearer token).
    const ALL: Rights = Rights {
        manage: true,
        send: true,
        listen: true,
    };
}

/// The claim an operation needs ("Rights required for Service Bus operations", in "Service
/// Bus access control with Shared Access Signatures", learn.microsoft.com: Send to send,
/// Listen to receive, complete, abandon and renew a lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    Send,
    Listen,
}

/// The 401 when `rights` lack `claim` on `queue`, in Service Bus's words: "Unauthorized access.
/// 'Listen' claim(s) are required to perform this operation. Resource: 'sb://…'" (as the
/// service answers: Azure/azure-sdk-for-java#39677, Azure/azure-service-bus-java#110).
fn require(rights: Rights, claim: Claim, host: &str, queue: &str) -> Option<Response> {
    let (held, name) = match claim {
        Claim::Send => (rights.send, "Send"),
        Claim::Listen => (rights.listen, "Listen"),
    };
    (!held).then(|| {
        error(
            StatusCode::UNAUTHORIZED,
            "40100",
            format!("Unauthorized access. '{name}' claim(s) are required to perform this operation. Resource: 'sb://{host}/{queue}'."),
        )
    })
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
            Ok(Rights::ALL)
        };
    }
    let now = shared.broker.clock.now();
    let e = match shared.key.verify(token, uri.path(), now) {
        Ok(_) => return Ok(Rights::ALL),
        Err(e) => e,
    };
    let send_listen = shared.send_listen_key.iter().map(|k| (k, true, true));
    let rules = shared.rules.iter().map(|r| (&r.key, r.send, r.listen));
    send_listen
        .chain(rules)
        .find(|(k, _, _)| k.verify(token, uri.path(), now).is_ok())
        .map(|(_, send, listen)| Rights {
            manage: false,
            send,
            listen,
        })
        .ok_or_else(|| format!("Unauthorized: {e}"))
}

/// Every response dated on the emulator's clock, as Service Bus dates its own (RFC 9110
/// §6.6.1; otherwise the HTTP server would date it on the wall clock, and a test that moves
/// this clock would see two).
async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    query: Query<ReceiveQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let now = shared.broker.clock.now();
    let mut response = respond(State(shared), method, uri, query, headers, body).await;
    if let Ok(v) = axum::http::HeaderValue::from_str(&crate::clock::http_date(now)) {
        response.headers_mut().insert("date", v);
    }
    response
}

async fn respond(
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
            if !rights.manage {
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
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost")
        .to_string();
    let claim = if method == Method::POST && rest.is_empty() {
        Claim::Send
    } else {
        Claim::Listen
    };
    if let Some(refused) = require(rights, claim, &host, &name) {
        return refused;
    }
    let Some(queue) = shared.broker.queue(&name) else {
        return broker_error(BrokerError::EntityNotFound(name));
    };
    let now = shared.broker.clock.now();
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
        Ok(status) => response::accepted(status),
        Err(e) => broker_error(e),
    }
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
