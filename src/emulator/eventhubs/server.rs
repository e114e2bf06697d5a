//! The AMQP side of the Event Hubs emulator: connections, sessions and the four kinds of link
//! a client attaches — CBS (`$cbs`), management (`$management`), producers (to a hub or a
//! partition) and consumers (from a consumer group's partition).
//!
//! Each link's work is in a child module: `requests` answers the `$cbs` and `$management`
//! nodes, `links` serves producers and consumers.

mod links;
mod requests;

use crate::sync::LockExt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fe2o3_amqp::acceptor::{
    ConnectionAcceptor, LinkAcceptor, LinkEndpoint, ListenerSessionHandle, SaslAnonymousMechanism,
    SessionAcceptor, SupportedReceiverSettleModes, SupportedSenderSettleModes,
};
use fe2o3_amqp::types::definitions::{
    AmqpError, Error as AmqpErrorBody, ErrorCondition, Fields, LinkError, ReceiverSettleMode, Role,
    SenderSettleMode,
};
use fe2o3_amqp::types::messaging::{Source, Target, TargetArchetype};
use fe2o3_amqp::types::performatives::Attach;
use fe2o3_amqp::types::primitives::{Symbol, Value};
use fe2o3_amqp::{Sendable, Sender};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Mutex, Notify};
use tokio_util::sync::CancellationToken;

use self::links::{serve_consumer, serve_producer};
use self::requests::serve_requests;
use super::store::Msg;
use super::wire::Wire;
use super::Shared;
use crate::emulator::sas::audience_covers;

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
        let mut g = self.grants.locked();
        g.retain(|(a, _)| *a != audience);
        g.push((audience, expiry));
    }

    fn covers(&self, address: &str) -> bool {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let g = self.grants.locked();
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
