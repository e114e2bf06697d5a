//! The AMQP side of the Event Hubs emulator: connections, sessions and the four kinds of link
//! a client attaches — CBS (`$cbs`), management (`$management`), producers (to a hub or a
//! partition) and consumers (from a consumer group's partition).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fe2o3_amqp::acceptor::{
    ConnectionAcceptor, LinkAcceptor, LinkEndpoint, ListenerSessionHandle, SaslAnonymousMechanism,
    SessionAcceptor, SupportedReceiverSettleModes, SupportedSenderSettleModes,
};
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::types::definitions::{
    AmqpError, Error as AmqpErrorBody, ErrorCondition, Fields, LinkError, ReceiverSettleMode, Role,
    SenderSettleMode,
};
use fe2o3_amqp::types::messaging::{
    AmqpValue, ApplicationProperties, Body, Message, Properties, Source, Target, TargetArchetype,
};
use fe2o3_amqp::types::performatives::Attach;
use fe2o3_amqp::types::primitives::{Array, OrderedMap, SimpleValue, Symbol, Timestamp, Value};
use fe2o3_amqp::{Receiver, Sendable, Sender};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Mutex, Notify};
use tokio_util::sync::CancellationToken;

use super::selector::{self, StartPosition};
use super::store::{self, Hub, Msg};
use super::wire::Wire;
use super::Shared;
use crate::azure::sas::{audience_covers, path_segments};

/// Batch message format (`0x80013700`): the body's data sections are whole encoded events.
const BATCH_FORMAT: u32 = 0x8001_3700;
/// Largest publication (one event or one batch) a producer may send, 1 MiB: the Event Hubs
/// limit on Standard, Premium and Dedicated (learn.microsoft.com, "Azure Event Hubs quotas and
/// limits", *Maximum size of Event Hubs publication*; Basic's 256 KB is not emulated). It is
/// advertised as `max-message-size` on every link the emulator receives on (AMQP 1.0 §2.7.3;
/// the wire shim writes it) and enforced per delivery with a rejected outcome.
pub const MAX_MESSAGE_SIZE: u64 = 1_048_576;
/// The size fe2o3 itself enforces on every link (it detaches with
/// `amqp:link:message-size-exceeded` beyond it): only a memory guard, far above
/// [`MAX_MESSAGE_SIZE`], so deliveries between the two reach the emulator and are rejected
/// the way the service rejects them instead of costing the client its link.
const DELIVERY_HARD_CAP: u64 = 16 * 1_048_576;
/// The condition a throttled namespace answers with (Service Bus / Event Hubs AMQP error
/// conditions, "AMQP errors in Azure Service Bus": `com.microsoft:server-busy`).
const SERVER_BUSY: &str = "com.microsoft:server-busy";
const CBS: &str = "$cbs";
const MANAGEMENT: &str = "$management";
/// How long a request waits for its reply link to attach (the client attaches the pair
/// back to back, so the request can arrive first).
const REPLY_LINK_WAIT: Duration = Duration::from_secs(5);
/// Events handed to a consumer link per read of the log.
const DELIVERY_CHUNK: usize = 256;

fn error(condition: impl Into<ErrorCondition>, description: impl Into<String>) -> AmqpErrorBody {
    // Python's client reads error fields by position: always send description and info.
    AmqpErrorBody::new(condition, Some(description.into()), Some(Fields::new()))
}

fn custom(condition: &str) -> ErrorCondition {
    ErrorCondition::Custom(Symbol::from(condition))
}

/// The error a throttled namespace answers with (the service's wording for its throttling
/// error 50002).
fn server_busy() -> AmqpErrorBody {
    error(
        custom(SERVER_BUSY),
        "The request was terminated because the entity is being throttled. Error code : 50002. \
         Sub error : 102. Please wait 4 seconds and try again. (hubguard emulator: server-busy fault)",
    )
}

/// The refusal of a delivery over [`MAX_MESSAGE_SIZE`], worded as the service words it
/// (a settled `rejected` outcome; the link stays attached).
fn message_size_exceeded(delivery_id: u32, size: usize) -> AmqpErrorBody {
    error(
        LinkError::MessageSizeExceeded,
        format!(
            "The received message (delivery-id:{delivery_id}, size:{size} bytes) exceeds the limit \
             ({MAX_MESSAGE_SIZE} bytes) currently allowed on the link."
        ),
    )
}

/// Grants of one connection: audiences authorised through CBS and until when.
#[derive(Debug, Default)]
struct ConnectionAuth {
    grants: std::sync::Mutex<Vec<(String, u64)>>,
}

impl ConnectionAuth {
    fn grant(&self, audience: String, expiry: u64) {
        let mut g = self.grants.lock().unwrap_or_else(|p| p.into_inner());
        g.retain(|(a, _)| *a != audience);
        g.push((audience, expiry));
    }

    fn covers(&self, address: &str) -> bool {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let g = self.grants.lock().unwrap_or_else(|p| p.into_inner());
        g.iter()
            .any(|(aud, exp)| *exp > now && audience_covers(aud, address))
    }
}

/// Reply links of one session, for CBS and management responses.
#[derive(Default)]
struct ReplyLinks {
    links: Mutex<Vec<ReplyLink>>,
    changed: Notify,
}

struct ReplyLink {
    node: String,
    address: String,
    tx: mpsc::UnboundedSender<Msg>,
}

impl ReplyLinks {
    /// The reply link for a request to `node`: the one whose target is the request's
    /// `reply-to` (Rust, .NET, Java), else the one whose source is the node (Python sends no
    /// `reply-to`).
    async fn find(&self, node: &str, reply_to: Option<&str>) -> Option<mpsc::UnboundedSender<Msg>> {
        let deadline = tokio::time::Instant::now() + REPLY_LINK_WAIT;
        loop {
            let changed = self.changed.notified();
            {
                let links = self.links.lock().await;
                let found = links
                    .iter()
                    .filter(|l| !l.tx.is_closed())
                    .find(|l| match reply_to {
                        Some(r) => l.address == r,
                        None => l.node.eq_ignore_ascii_case(node),
                    })
                    .or_else(|| {
                        links
                            .iter()
                            .find(|l| l.node.eq_ignore_ascii_case(node) && !l.tx.is_closed())
                    });
                if let Some(l) = found {
                    return Some(l.tx.clone());
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return None;
            }
        }
    }
}

/// Serves one TCP connection until the client closes it or it is dropped by a fault.
pub(super) async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    let token = shared.faults.connection_token();
    let _ = stream.set_nodelay(true);
    let acceptor = ConnectionAcceptor::builder()
        .container_id("hubguard-eventhubs-emulator")
        .max_frame_size(65_536u32)
        .sasl_acceptor(SaslAnonymousMechanism::new())
        .build();
    let io = Wire::new(stream, shared.faults.clone(), token.clone());
    let mut conn = match acceptor.accept(io).await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(error = ?e, "eventhubs emulator: connection not opened");
            return;
        }
    };
    let auth = Arc::new(ConnectionAuth::default());
    let sessions = SessionAcceptor::builder()
        .incoming_window(u32::MAX)
        .outgoing_window(u32::MAX)
        .handle_max(65_535u32)
        .build();
    loop {
        tokio::select! {
            incoming = conn.next_incoming_session() => {
                let Some(incoming) = incoming else { break };
                match sessions.accept_incoming_session(incoming, &mut conn).await {
                    Ok(session) => {
                        tokio::spawn(serve_session(session, shared.clone(), auth.clone(), token.clone()));
                    }
                    Err(e) => tracing::debug!(error = ?e, "eventhubs emulator: session not accepted"),
                }
            }
            _ = token.cancelled() => {
                tracing::debug!("eventhubs emulator: connection dropped");
                return;
            }
        }
    }
    let _ = conn.close().await;
}

/// The link acceptor type with no dynamic-node handlers.
type Links = LinkAcceptor<fn(Source) -> Option<Source>, fn(Target) -> Option<Target>>;

fn link_acceptor() -> Links {
    // Settle modes that serve every SDK: Rust asks mixed/first and gets them echoed; Python
    // asks unsettled (receivers) and second (producers) and gets settled/first.
    LinkAcceptor::builder()
        .max_message_size(DELIVERY_HARD_CAP)
        .supported_sender_settle_modes(SupportedSenderSettleModes::SettledAndMixed)
        .fallback_sender_settle_mode(SenderSettleMode::Settled)
        .supported_receiver_settle_modes(SupportedReceiverSettleModes::First)
        .fallback_receiver_settle_mode(ReceiverSettleMode::First)
        .build()
}

fn target_address(attach: &Attach) -> String {
    attach
        .target
        .as_ref()
        .and_then(|t| match t.as_ref() {
            TargetArchetype::Target(t) => t.address.clone(),
            #[allow(unreachable_patterns)]
            _ => None,
        })
        .unwrap_or_default()
}

fn source_address(attach: &Attach) -> String {
    attach
        .source
        .as_ref()
        .and_then(|s| s.address.clone())
        .unwrap_or_default()
}

fn selector_expression(attach: &Attach) -> Option<String> {
    let filter = attach.source.as_ref()?.filter.as_ref()?;
    filter.iter().find_map(|(k, v)| {
        if !k.0.contains("selector-filter") {
            return None;
        }
        match v {
            Value::Described(d) => match &d.value {
                Value::String(s) => Some(s.clone()),
                _ => None,
            },
            Value::String(s) => Some(s.clone()),
            _ => None,
        }
    })
}

fn epoch_of(attach: &Attach) -> Option<i64> {
    attach.properties.as_ref().and_then(|p| {
        p.iter().find_map(|(k, v)| {
            (k.0 == "com.microsoft:epoch").then(|| match v {
                Value::Long(e) => Some(*e),
                Value::Int(e) => Some(i64::from(*e)),
                Value::Ulong(e) => i64::try_from(*e).ok(),
                Value::Uint(e) => Some(i64::from(*e)),
                _ => None,
            })?
        })
    })
}

/// A consumer link address: `…/{hub}/ConsumerGroups/{cg}/Partitions/{id}`.
struct ConsumerAddress {
    hub: Arc<Hub>,
    consumer_group: String,
    partition: usize,
}

/// A producer link address: `…/{hub}` or `…/{hub}/Partitions/{id}`.
struct ProducerAddress {
    hub: Arc<Hub>,
    partition: Option<usize>,
}

fn original_segments(address: &str) -> Vec<String> {
    // Like `path_segments`, but keeps case (consumer group names are reported as given).
    let lower = path_segments(address);
    let without_scheme = address.split_once("://").map_or(address, |(_, r)| r);
    let path = if address.contains("://") {
        without_scheme.split_once('/').map_or("", |(_, p)| p)
    } else {
        without_scheme
    };
    let orig: Vec<String> = path
        .split(['?', '#'])
        .next()
        .unwrap_or("")
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        })
        .collect();
    if orig.len() == lower.len() {
        orig
    } else {
        lower
    }
}

fn parse_consumer(shared: &Shared, address: &str) -> Result<ConsumerAddress, String> {
    let segs = original_segments(address);
    let [hub, cgs, cg, parts, pid] = segs.as_slice() else {
        return Err(format!(
            "'{address}' is not a partition of a consumer group"
        ));
    };
    if !cgs.eq_ignore_ascii_case("consumergroups") || !parts.eq_ignore_ascii_case("partitions") {
        return Err(format!(
            "'{address}' is not a partition of a consumer group"
        ));
    }
    let hub = shared
        .store
        .hub(hub)
        .ok_or_else(|| format!("The messaging entity '{hub}' could not be found."))?;
    if !hub.has_consumer_group(cg) {
        return Err(format!(
            "The consumer group '{cg}' of entity '{}' could not be found.",
            hub.name
        ));
    }
    let partition = hub.partition_index(pid).ok_or_else(|| {
        format!(
            "Partition '{pid}' of entity '{}' could not be found (it has {} partitions).",
            hub.name,
            hub.partitions.len()
        )
    })?;
    Ok(ConsumerAddress {
        hub,
        consumer_group: cg.clone(),
        partition,
    })
}

fn parse_producer(shared: &Shared, address: &str) -> Result<ProducerAddress, String> {
    let segs = original_segments(address);
    let (hub, pid) = match segs.as_slice() {
        [hub] => (hub, None),
        [hub, parts, pid] if parts.eq_ignore_ascii_case("partitions") => (hub, Some(pid)),
        _ => {
            return Err(format!(
                "'{address}' is not an event hub or one of its partitions"
            ))
        }
    };
    let hub = shared
        .store
        .hub(hub)
        .ok_or_else(|| format!("The messaging entity '{hub}' could not be found."))?;
    let partition = match pid {
        None => None,
        Some(pid) => Some(hub.partition_index(pid).ok_or_else(|| {
            format!(
                "Partition '{pid}' of entity '{}' could not be found.",
                hub.name
            )
        })?),
    };
    Ok(ProducerAddress { hub, partition })
}

async fn serve_session(
    mut session: ListenerSessionHandle,
    shared: Arc<Shared>,
    auth: Arc<ConnectionAuth>,
    token: CancellationToken,
) {
    let replies = Arc::new(ReplyLinks::default());
    let acceptor = link_acceptor();
    loop {
        let attach = tokio::select! {
            a = session.next_incoming_attach() => match a { Some(a) => a, None => break },
            _ = token.cancelled() => return,
        };
        let (source, target) = (source_address(&attach), target_address(&attach));
        let role = attach.role.clone();
        let selector = selector_expression(&attach);
        let epoch = epoch_of(&attach);
        let link = match acceptor.accept_incoming_attach(attach, &mut session).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = ?e, "eventhubs emulator: link not accepted");
                continue;
            }
        };
        match (role, link) {
            (Role::Sender, LinkEndpoint::Receiver(r)) => {
                if target == CBS || target == MANAGEMENT {
                    tokio::spawn(serve_requests(
                        r,
                        target,
                        replies.clone(),
                        shared.clone(),
                        auth.clone(),
                    ));
                } else {
                    tokio::spawn(serve_producer(r, target, shared.clone(), auth.clone()));
                }
            }
            (Role::Receiver, LinkEndpoint::Sender(s)) => {
                if source == CBS || source == MANAGEMENT {
                    let (tx, rx) = mpsc::unbounded_channel();
                    replies.links.lock().await.push(ReplyLink {
                        node: source,
                        address: target,
                        tx,
                    });
                    replies.changed.notify_waiters();
                    tokio::spawn(serve_replies(s, rx));
                } else {
                    tokio::spawn(serve_consumer(
                        s,
                        source,
                        selector,
                        epoch,
                        shared.clone(),
                        auth.clone(),
                    ));
                }
            }
            (_, LinkEndpoint::Sender(s)) => {
                let _ = s
                    .close_with_error(error(AmqpError::NotAllowed, "unexpected link role"))
                    .await;
            }
            (_, LinkEndpoint::Receiver(r)) => {
                let _ = r
                    .close_with_error(error(AmqpError::NotAllowed, "unexpected link role"))
                    .await;
            }
        }
    }
    let _ = session.end().await;
}

async fn serve_replies(mut sender: Sender, mut rx: mpsc::UnboundedReceiver<Msg>) {
    loop {
        tokio::select! {
            m = rx.recv() => {
                let Some(m) = m else { break };
                let sendable = Sendable::builder().message(m).settled(true).build();
                if sender.send(sendable).await.is_err() {
                    break;
                }
            }
            _ = sender.on_detach() => break,
        }
    }
    let _ = sender.close().await;
}

fn string_prop(msg: &Msg, key: &str) -> Option<String> {
    msg.application_properties
        .as_ref()
        .and_then(|a| match a.0.get(key) {
            Some(SimpleValue::String(s)) => Some(s.clone()),
            Some(SimpleValue::Symbol(s)) => Some(s.0.clone()),
            _ => None,
        })
}

fn expiration_prop(msg: &Msg) -> Option<u64> {
    msg.application_properties
        .as_ref()
        .and_then(|a| match a.0.get("expiration") {
            Some(SimpleValue::Timestamp(t)) => u64::try_from(t.milliseconds() / 1000).ok(),
            Some(SimpleValue::Long(s)) => u64::try_from(*s).ok(),
            Some(SimpleValue::Ulong(s)) => Some(*s),
            _ => None,
        })
}

fn token_body(msg: &Msg) -> Option<String> {
    match &msg.body {
        Body::Value(AmqpValue(Value::String(s))) => Some(s.clone()),
        _ => None,
    }
}

/// The CBS token type of a SAS token. Azure's broker takes a SAS token under this type only
/// (azure-sdk-for-rust pull request #4587; the Service Bus AMQP guide, "claims-based
/// authorization").
pub(super) const SAS_TOKEN_TYPE: &str = "servicebus.windows.net:sastoken";
/// The CBS token type of an Entra ID (JWT) token.
pub(super) const JWT_TOKEN_TYPE: &str = "jwt";

/// Checks a token presented as `token_type` for `audience`, as Azure does: a SAS token only
/// under [`SAS_TOKEN_TYPE`] (signature, expiry and audience verified); a `jwt` only when the
/// emulator accepts any token (it cannot verify Entra ID signatures), and never a SAS string
/// posing as one; any other type is refused. `Ok(expiry)` or the refusal's description.
fn check_token(
    shared: &Shared,
    token_type: &str,
    token: &str,
    audience: &str,
    requested_expiry: Option<u64>,
) -> Result<u64, String> {
    if token.is_empty() {
        return Err("Unauthorized: empty token".into());
    }
    let is_sas = token.trim_start().starts_with("SharedAccessSignature ");
    match token_type {
        SAS_TOKEN_TYPE => shared
            .key
            .verify(token, audience, SystemTime::now())
            .map_err(|e| format!("Unauthorized: {e}")),
        JWT_TOKEN_TYPE if is_sas => Err(format!(
            "Unauthorized: a SharedAccessSignature token was presented as type '{JWT_TOKEN_TYPE}'; SAS tokens must use type '{SAS_TOKEN_TYPE}'"
        )),
        JWT_TOKEN_TYPE if shared.accept_any_token => {
            let default = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
                + 3600;
            Ok(requested_expiry.unwrap_or(default))
        }
        JWT_TOKEN_TYPE => Err(
            "Unauthorized: this emulator cannot verify Entra ID tokens; start it with --accept-any-token to accept any 'jwt'".into(),
        ),
        other => Err(format!("Unauthorized: unsupported token type '{other}'")),
    }
}

fn reply(request: &Msg, status: i32, description: &str, body: Value) -> Msg {
    let props = Properties {
        correlation_id: request
            .properties
            .as_ref()
            .and_then(|p| p.message_id.clone()),
        ..Default::default()
    };
    Message::builder()
        .properties(props)
        .application_properties(
            ApplicationProperties::builder()
                .insert("status-code", SimpleValue::Int(status))
                .insert(
                    "status-description",
                    SimpleValue::String(description.into()),
                )
                .build(),
        )
        .body(Body::Value(AmqpValue(body)))
        .build()
}

async fn serve_requests(
    mut receiver: Receiver,
    node: String,
    replies: Arc<ReplyLinks>,
    shared: Arc<Shared>,
    auth: Arc<ConnectionAuth>,
) {
    loop {
        let delivery = match receiver.recv::<Body<Value>>().await {
            Ok(d) => d,
            Err(_) => break,
        };
        if receiver.accept(&delivery).await.is_err() {
            break;
        }
        let request = delivery.into_message();
        let response = if let Some(status) = shared.faults.error_status() {
            reply(&request, i32::from(status), "injected fault", Value::Null)
        } else if node == CBS {
            handle_put_token(&shared, &auth, &request)
        } else {
            handle_management(&shared, &auth, &request)
        };
        let reply_to = request.properties.as_ref().and_then(|p| p.reply_to.clone());
        match replies.find(&node, reply_to.as_deref()).await {
            Some(tx) => {
                let _ = tx.send(response);
            }
            None => tracing::warn!(node, "eventhubs emulator: request without a reply link"),
        }
    }
    let _ = receiver.close().await;
}

fn handle_put_token(shared: &Shared, auth: &ConnectionAuth, request: &Msg) -> Msg {
    if string_prop(request, "operation").as_deref() != Some("put-token") {
        return reply(request, 400, "unsupported CBS operation", Value::Null);
    }
    let (Some(audience), Some(token)) = (string_prop(request, "name"), token_body(request)) else {
        return reply(
            request,
            400,
            "put-token needs a name and a token",
            Value::Null,
        );
    };
    // A put-token without a type is taken as `jwt`, the AMQP CBS draft's default.
    let token_type = string_prop(request, "type").unwrap_or_else(|| JWT_TOKEN_TYPE.into());
    match check_token(
        shared,
        &token_type,
        &token,
        &audience,
        expiration_prop(request),
    ) {
        Ok(expiry) => {
            auth.grant(audience, expiry);
            reply(request, 202, "Accepted", Value::Null)
        }
        Err(why) => {
            tracing::info!(audience, reason = %why, "eventhubs emulator: token refused");
            reply(request, 401, &why, Value::Null)
        }
    }
}

fn handle_management(shared: &Shared, auth: &ConnectionAuth, request: &Msg) -> Msg {
    let operation = string_prop(request, "operation").unwrap_or_default();
    if operation != "READ" {
        return reply(
            request,
            400,
            "unsupported management operation",
            Value::Null,
        );
    }
    let name = string_prop(request, "name").unwrap_or_default();
    let Some(hub) = shared.store.hub(&name) else {
        return reply(
            request,
            404,
            &format!("The messaging entity '{name}' could not be found."),
            Value::Null,
        );
    };
    let audience = format!("amqps://emulator/{}/$management", hub.name);
    let authorised = match string_prop(request, "security_token") {
        Some(t) => {
            let token_type = if t.starts_with("SharedAccessSignature ") {
                SAS_TOKEN_TYPE
            } else {
                JWT_TOKEN_TYPE
            };
            check_token(shared, token_type, &t, &audience, None).is_ok()
        }
        None => auth.covers(&audience),
    };
    if !authorised {
        return reply(
            request,
            401,
            "Unauthorized: no valid token for the entity",
            Value::Null,
        );
    }
    let s = |x: &str| Value::String(x.to_string());
    let mut m: OrderedMap<Value, Value> = OrderedMap::new();
    match string_prop(request, "type").as_deref() {
        Some("com.microsoft:eventhub") => {
            let ids: Vec<Value> = hub.partitions.iter().map(|p| s(&p.id)).collect();
            m.insert(s("name"), s(&hub.name));
            m.insert(s("type"), s("com.microsoft:eventhub"));
            m.insert(
                s("created_at"),
                Value::Timestamp(Timestamp::from_milliseconds(hub.created_ms)),
            );
            m.insert(
                s("partition_count"),
                Value::Int(hub.partitions.len() as i32),
            );
            m.insert(s("partition_ids"), Value::Array(Array::from(ids)));
        }
        Some("com.microsoft:partition") => {
            let pid = string_prop(request, "partition").unwrap_or_default();
            let Some(index) = hub.partition_index(&pid) else {
                return reply(
                    request,
                    404,
                    &format!(
                        "Partition '{pid}' of entity '{}' could not be found.",
                        hub.name
                    ),
                    Value::Null,
                );
            };
            let info = hub.partitions[index].info();
            m.insert(s("name"), s(&hub.name));
            m.insert(s("type"), s("com.microsoft:partition"));
            m.insert(s("partition"), s(&pid));
            m.insert(
                s("begin_sequence_number"),
                Value::Long(info.begin_sequence_number),
            );
            m.insert(
                s("last_enqueued_sequence_number"),
                Value::Long(info.last_sequence_number),
            );
            m.insert(s("last_enqueued_sequence_number_epoch"), Value::Long(0));
            m.insert(s("last_enqueued_offset"), s(&info.last_offset));
            m.insert(
                s("last_enqueued_time_utc"),
                Value::Timestamp(Timestamp::from_milliseconds(info.last_enqueued_ms)),
            );
            m.insert(s("is_partition_empty"), Value::Bool(info.is_empty));
        }
        _ => return reply(request, 400, "unknown entity type", Value::Null),
    }
    reply(request, 200, "OK", Value::Map(m))
}

/// The events of one transfer: a single event, or the inner events of a batch.
fn events_of(format: Option<u32>, envelope: Msg) -> Result<(Vec<Msg>, Option<String>), String> {
    let envelope_key = store::partition_key_of(&envelope);
    if format != Some(BATCH_FORMAT) {
        return Ok((vec![envelope], envelope_key));
    }
    let Body::Data(sections) = envelope.body else {
        return Err("a batch (format 0x80013700) must carry data sections".into());
    };
    let mut events = Vec::new();
    for (i, data) in sections.into_iter().enumerate() {
        let event = store::decode(&data.0)
            .map_err(|e| format!("batch section {i} is not an AMQP message: {e}"))?;
        events.push(event);
    }
    let key = envelope_key.or_else(|| events.first().and_then(store::partition_key_of));
    Ok((events, key))
}

async fn serve_producer(
    mut receiver: Receiver,
    address: String,
    shared: Arc<Shared>,
    auth: Arc<ConnectionAuth>,
) {
    let target = match parse_producer(&shared, &address) {
        Ok(t) => t,
        Err(why) => {
            let _ = receiver
                .close_with_error(error(AmqpError::NotFound, why))
                .await;
            return;
        }
    };
    if !auth.covers(&address) {
        let _ = receiver
            .close_with_error(error(
                AmqpError::UnauthorizedAccess,
                format!("Unauthorized access to '{address}': put a token first"),
            ))
            .await;
        return;
    }
    if shared.faults.server_busy() {
        let _ = receiver.close_with_error(server_busy()).await;
        return;
    }
    loop {
        let delivery = match receiver.recv::<Body<Value>>().await {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(error = ?e, address, "eventhubs emulator: producer link ended");
                break;
            }
        };
        let format = *delivery.message_format();
        let info = DeliveryInfo::from(&delivery);
        if shared.faults.server_busy() {
            if receiver.reject(info, server_busy()).await.is_err() {
                break;
            }
            continue;
        }
        let size = store::encoded_size(delivery.message());
        if size as u64 > MAX_MESSAGE_SIZE {
            tracing::info!(
                address,
                size,
                "eventhubs emulator: delivery over the size limit rejected"
            );
            let refusal = message_size_exceeded(*delivery.delivery_id(), size);
            if receiver.reject(info, refusal).await.is_err() {
                break;
            }
            continue;
        }
        let outcome = events_of(format, delivery.into_message()).and_then(|(events, key)| {
            let partition = target
                .partition
                .unwrap_or_else(|| target.hub.route(key.as_deref()));
            target.hub.partitions[partition]
                .append(events, key.as_deref())
                .map_err(|e| format!("the event could not be stored: {e}"))
        });
        let disposed = match outcome {
            Ok(()) => receiver.accept(info).await,
            Err(why) => {
                tracing::info!(address, reason = %why, "eventhubs emulator: event rejected");
                receiver
                    .reject(info, error(AmqpError::DecodeError, why))
                    .await
            }
        };
        if disposed.is_err() {
            break;
        }
    }
    let _ = receiver.close().await;
}

async fn serve_consumer(
    mut sender: Sender,
    address: String,
    selector_expr: Option<String>,
    epoch: Option<i64>,
    shared: Arc<Shared>,
    auth: Arc<ConnectionAuth>,
) {
    let source = match parse_consumer(&shared, &address) {
        Ok(s) => s,
        Err(why) => {
            let _ = sender
                .close_with_error(error(AmqpError::NotFound, why))
                .await;
            return;
        }
    };
    if !auth.covers(&address) {
        let _ = sender
            .close_with_error(error(
                AmqpError::UnauthorizedAccess,
                format!("Unauthorized access to '{address}': put a token first"),
            ))
            .await;
        return;
    }
    if shared.faults.server_busy() {
        let _ = sender.close_with_error(server_busy()).await;
        return;
    }
    let start = match selector_expr.as_deref().map(selector::parse) {
        None => StartPosition::Latest,
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            let _ = sender
                .close_with_error(error(custom("com.microsoft:argument-error"), e.to_string()))
                .await;
            return;
        }
    };
    let (_lease, mut evicted) =
        match source
            .hub
            .admit_receiver(&source.consumer_group, source.partition, epoch)
        {
            Ok(x) => x,
            Err(stolen) => {
                let _ = sender
                    .close_with_error(error(LinkError::Stolen, stolen.0))
                    .await;
                return;
            }
        };
    let partition = &source.hub.partitions[source.partition];
    let mut tail = partition.subscribe();
    let mut next = partition.start_index(start);
    loop {
        let chunk = partition.events_from(next, DELIVERY_CHUNK);
        if chunk.is_empty() {
            tokio::select! {
                changed = tail.changed() => if changed.is_err() { break },
                stolen = &mut evicted => {
                    let why = stolen.map(|s| s.0).unwrap_or_else(|_| "receiver evicted".into());
                    let _ = sender.close_with_error(error(LinkError::Stolen, why)).await;
                    return;
                }
                _ = sender.on_detach() => break,
            }
            continue;
        }
        for event in chunk {
            let sendable = Sendable::builder()
                .message(Msg::clone(&event.message))
                .settled(true)
                .build();
            tokio::select! {
                sent = sender.send(sendable) => if sent.is_err() { let _ = sender.close().await; return },
                stolen = &mut evicted => {
                    let why = stolen.map(|s| s.0).unwrap_or_else(|_| "receiver evicted".into());
                    let _ = sender.close_with_error(error(LinkError::Stolen, why)).await;
                    return;
                }
            }
            next += 1;
        }
    }
    let _ = sender.close().await;
}
