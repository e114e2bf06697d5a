//! Protocol cases the Rust SDK 0.15 never exercises, driven with a plain AMQP 1.0 client
//! (fe2o3-amqp 0.18): owner-level (epoch) arbitration, which other SDKs send as
//! `com.microsoft:epoch`, and malformed batches rejected with a condition. Also a frame tap
//! (a TCP relay that decodes every frame it forwards) to check the emulator's framing
//! against what each client announced in its `open`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::definitions::Fields;
use fe2o3_amqp::types::messaging::{
    AmqpValue, ApplicationProperties, Body, Data, Message, Properties, Source,
};
use fe2o3_amqp::types::primitives::{Binary, SimpleValue, Symbol, Value};
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use hubguard::azure::SasKey;
use hubguard::emulator::eventhubs::EventHubsEmulator;
use serde_amqp::described::Described;
use serde_amqp::descriptor::Descriptor;

use crate::common::*;

const SELECTOR: u64 = 0x0000_468C_0000_0004;

struct Client {
    connection: ConnectionHandle<()>,
    session: SessionHandle<()>,
}

/// Connects with SASL ANONYMOUS and puts a SAS token for `audience` through CBS; returns
/// the client and the CBS status code.
async fn connect(
    emu: &EventHubsEmulator,
    audience: &str,
    key: &hubguard::azure::SasKey,
) -> (Client, i64) {
    connect_via(emu, emu.local_addr(), None, audience, key).await
}

/// Puts `token` as `token_type` for `audience` on a fresh connection; the CBS status.
async fn put_token(
    emu: &EventHubsEmulator,
    audience: &str,
    token_type: &str,
    token: String,
) -> i64 {
    let (client, status) =
        connect_raw(emu, emu.local_addr(), None, audience, token_type, token).await;
    close(client).await;
    status
}

/// Like [`connect`], but dialling `addr` (the emulator or a tap in front of it) and
/// announcing `max_frame_size` in the `open` when given.
async fn connect_via(
    emu: &EventHubsEmulator,
    addr: SocketAddr,
    max_frame_size: Option<u32>,
    audience: &str,
    key: &hubguard::azure::SasKey,
) -> (Client, i64) {
    let expiry = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let token = key.token(&format!("sb://{}/hub", emu.local_addr()), expiry);
    connect_raw(emu, addr, max_frame_size, audience, SAS_TYPE, token).await
}

const SAS_TYPE: &str = "servicebus.windows.net:sastoken";

async fn connect_raw(
    _emu: &EventHubsEmulator,
    addr: SocketAddr,
    max_frame_size: Option<u32>,
    audience: &str,
    token_type: &str,
    token: String,
) -> (Client, i64) {
    let url = format!("amqp://{addr}");
    let mut builder = Connection::builder()
        .container_id("epoch-test")
        .sasl_profile(SaslProfile::Anonymous);
    if let Some(m) = max_frame_size {
        builder = builder.max_frame_size(m);
    }
    let mut connection = within("connect", builder.open(url.as_str()))
        .await
        .expect("connection opens");
    let mut session = within("begin", Session::begin(&mut connection))
        .await
        .unwrap();
    let mut cbs_out = within(
        "cbs sender",
        Sender::attach(&mut session, "cbs-out", "$cbs"),
    )
    .await
    .unwrap();
    let mut cbs_in = within(
        "cbs receiver",
        Receiver::builder()
            .name("cbs-in")
            .source("$cbs")
            .target("cbs-reply")
            .attach(&mut session),
    )
    .await
    .unwrap();
    let request = Message::builder()
        .properties(Properties {
            message_id: Some(7u64.into()),
            reply_to: Some("cbs-reply".into()),
            ..Default::default()
        })
        .application_properties(
            ApplicationProperties::builder()
                .insert("operation", SimpleValue::String("put-token".into()))
                .insert("type", SimpleValue::String(token_type.into()))
                .insert("name", SimpleValue::String(audience.into()))
                .build(),
        )
        .body(Body::Value(AmqpValue(Value::String(token))))
        .build();
    within("put-token", cbs_out.send(request)).await.unwrap();
    let reply = within("cbs reply", cbs_in.recv::<Body<Value>>())
        .await
        .unwrap();
    cbs_in.accept(&reply).await.unwrap();
    let msg = reply.into_message();
    let corr = msg
        .properties
        .as_ref()
        .and_then(|p| p.correlation_id.clone());
    assert_eq!(
        corr,
        Some(7u64.into()),
        "correlation-id echoes the request's message-id"
    );
    let status = match msg
        .application_properties
        .as_ref()
        .and_then(|a| a.0.get("status-code"))
    {
        Some(SimpleValue::Int(s)) => i64::from(*s),
        other => panic!("status-code missing: {other:?}"),
    };
    let _ = cbs_out.close().await;
    let _ = cbs_in.close().await;
    (
        Client {
            connection,
            session,
        },
        status,
    )
}

async fn epoch_receiver(
    client: &mut Client,
    name: &str,
    emu: &EventHubsEmulator,
    epoch: Option<i64>,
) -> Receiver {
    let address = format!(
        "amqps://{}/hub/ConsumerGroups/$Default/Partitions/0",
        emu.local_addr()
    );
    let selector = Some(Described {
        descriptor: Descriptor::Code(SELECTOR),
        value: Value::String("amqp.annotation.x-opt-offset > '-1'".into()),
    });
    let source = Source::builder()
        .address(address)
        .add_to_filter(Symbol::from("apache.org:selector-filter:string"), selector)
        .build();
    let mut props = Fields::new();
    if let Some(e) = epoch {
        props.insert(Symbol::from("com.microsoft:epoch"), Value::Long(e));
    }
    within(
        "attach receiver",
        Receiver::builder()
            .name(name)
            .source(source)
            .target(format!("{name}-target"))
            .properties(props)
            .attach(&mut client.session),
    )
    .await
    .expect("attach is answered")
}

async fn first_error(r: &mut Receiver) -> String {
    match within("recv", r.recv::<Body<Value>>()).await {
        Ok(d) => panic!(
            "expected the link to be closed, got a delivery {:?}",
            d.message()
        ),
        Err(e) => format!("{e:?}"),
    }
}

async fn close(client: Client) {
    let Client {
        mut connection,
        mut session,
    } = client;
    let _ = within("end", session.end()).await;
    let _ = within("close", connection.close()).await;
}

#[tokio::test]
async fn owner_levels_evict_lower_and_refuse_stale_receivers() {
    let emu = emulator(&[("hub", 1)]).await;
    let key = conn(&emu).key;
    let prod = producer(&conn(&emu), "hub").await;
    within(
        "send",
        prod.send_event(
            azure_messaging_eventhubs::models::EventData::builder()
                .with_body(b"e".to_vec())
                .build(),
            None,
        ),
    )
    .await
    .unwrap();
    let audience = format!(
        "amqps://{}/hub/ConsumerGroups/$Default/Partitions/0",
        emu.local_addr()
    );
    let (mut a, status) = connect(&emu, &audience, &key).await;
    assert_eq!(status, 202);
    let (mut b, _) = connect(&emu, &audience, &key).await;

    // A plain receiver reads; an epoch-1 receiver takes over and the plain one is stolen.
    let mut plain = epoch_receiver(&mut a, "plain", &emu, None).await;
    let d = within("plain reads", plain.recv::<Body<Value>>())
        .await
        .unwrap();
    assert!(matches!(d.message().body, Body::Data(_)));
    let mut e1 = epoch_receiver(&mut b, "e1", &emu, Some(1)).await;
    within("epoch 1 reads", e1.recv::<Body<Value>>())
        .await
        .unwrap();
    assert!(
        first_error(&mut plain)
            .await
            .to_lowercase()
            .contains("stolen"),
        "plain receiver is stolen"
    );

    // A lower epoch is refused, a non-epoch receiver is refused while an epoch one exists.
    let mut e0 = epoch_receiver(&mut a, "e0", &emu, Some(0)).await;
    assert!(first_error(&mut e0).await.to_lowercase().contains("stolen"));
    let mut plain2 = epoch_receiver(&mut a, "plain2", &emu, None).await;
    assert!(first_error(&mut plain2)
        .await
        .to_lowercase()
        .contains("stolen"));

    // An equal or higher epoch steals from the current owner.
    let mut e2 = epoch_receiver(&mut a, "e2", &emu, Some(2)).await;
    within("epoch 2 reads", e2.recv::<Body<Value>>())
        .await
        .unwrap();
    assert!(first_error(&mut e1).await.to_lowercase().contains("stolen"));
    assert_eq!(
        emu.store()
            .hub("hub")
            .unwrap()
            .receiver_count("$Default", 0),
        1
    );
    let _ = e2.close().await;
    close(a).await;
    close(b).await;
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn cbs_refuses_a_token_signed_with_another_key() {
    let emu = emulator(&[("hub", 1)]).await;
    let audience = format!("amqps://{}/hub", emu.local_addr());
    let wrong = hubguard::azure::SasKey::new(conn(&emu).key.name(), "wrong");
    let (mut client, status) = connect(&emu, &audience, &wrong).await;
    assert_eq!(status, 401);
    // Without a granted token, attaching a receiver is refused.
    let mut r = epoch_receiver(&mut client, "r", &emu, None).await;
    assert!(first_error(&mut r)
        .await
        .to_lowercase()
        .contains("unauthorized"));
    close(client).await;
}

#[tokio::test]
async fn malformed_batch_is_rejected_with_a_condition_and_stores_nothing() {
    let emu = emulator(&[("hub", 1)]).await;
    let key = conn(&emu).key;
    let audience = format!("amqps://{}/hub", emu.local_addr());
    let (mut client, status) = connect(&emu, &audience, &key).await;
    assert_eq!(status, 202);
    let mut sender = within(
        "attach sender",
        Sender::attach(
            &mut client.session,
            "p",
            format!("amqps://{}/hub/Partitions/0", emu.local_addr()),
        ),
    )
    .await
    .unwrap();
    let batch = Message::builder()
        .body(Body::<Value>::Data(
            vec![Data(Binary::from(vec![0xde, 0xad, 0xbe, 0xef]))].into(),
        ))
        .build();
    let sendable = fe2o3_amqp::Sendable::builder()
        .message(batch)
        .message_format(0x8001_3700)
        .build();
    let outcome = within("send batch", sender.send(sendable)).await;
    let text = format!("{outcome:?}");
    assert!(text.contains("Rejected"), "{text}");
    assert!(
        text.contains("decode-error") || text.contains("DecodeError"),
        "{text}"
    );
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 0);
    let _ = sender.close().await;
    close(client).await;
}

/// One frame the tap forwarded.
#[derive(Debug, Clone)]
struct SeenFrame {
    size: usize,
    /// `Some(more)` for a transfer.
    transfer_more: Option<bool>,
}

/// What the tap saw on one connection, per direction.
#[derive(Debug, Default)]
struct SeenConnection {
    client_max_frame_size: Option<u32>,
    server_max_frame_size: Option<u32>,
    to_client: Vec<SeenFrame>,
    to_server: Vec<SeenFrame>,
}

/// A TCP relay in front of the emulator that forwards bytes unchanged and decodes every AMQP
/// frame on the way (with serde_amqp, independently of the emulator's own wire code).
struct FrameTap {
    addr: SocketAddr,
    /// Set: attaches from the emulator reach the client without `max-message-size`, so the
    /// client does not refuse an oversized message itself and the emulator's refusal shows.
    hide_max_message_size: bool,
    connections: Arc<Mutex<Vec<Arc<Mutex<SeenConnection>>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FrameTap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FrameTap {
    async fn start(upstream: SocketAddr) -> Self {
        Self::start_with(upstream, false).await
    }

    async fn start_with(upstream: SocketAddr, hide_max_message_size: bool) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections: Arc<Mutex<Vec<Arc<Mutex<SeenConnection>>>>> = Arc::default();
        let all = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let seen = Arc::new(Mutex::new(SeenConnection::default()));
                all.lock().unwrap().push(seen.clone());
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(relay(cr, sw, seen.clone(), true, false));
                tokio::spawn(relay(sr, cw, seen, false, hide_max_message_size));
            }
        });
        Self {
            addr,
            hide_max_message_size,
            connections,
            task,
        }
    }

    fn seen(&self) -> Vec<Arc<Mutex<SeenConnection>>> {
        self.connections.lock().unwrap().clone()
    }
}

/// Forwards `from` to `to`, recording each complete frame before it is forwarded (so a
/// client that has a delivery has had all its frames recorded).
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    seen: Arc<Mutex<SeenConnection>>,
    client_to_server: bool,
    hide_max_message_size: bool,
) {
    use fe2o3_amqp::types::performatives::Performative;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        let mut out: Vec<u8> = Vec::new();
        loop {
            if pending.len() >= 8 && &pending[..4] == b"AMQP" {
                out.extend(pending.drain(..8));
                continue;
            }
            if pending.len() < 8 {
                break;
            }
            let size = u32::from_be_bytes(pending[..4].try_into().unwrap()) as usize;
            assert!(size >= 8, "a frame shorter than its header");
            if pending.len() < size {
                break;
            }
            let mut frame: Vec<u8> = pending.drain(..size).collect();
            let doff = usize::from(frame[4]) * 4;
            let mut transfer_more = None;
            let mut s = seen.lock().unwrap();
            let mut rewritten = None;
            if frame[5] == 0x00 && frame.len() > doff {
                match serde_amqp::from_slice::<Performative>(&frame[doff..]) {
                    Ok(Performative::Open(open)) => {
                        let max = Some(open.max_frame_size.0);
                        if client_to_server {
                            s.client_max_frame_size = max;
                        } else {
                            s.server_max_frame_size = max;
                        }
                    }
                    Ok(Performative::Transfer(t)) => transfer_more = Some(t.more),
                    Ok(Performative::Attach(mut a)) if hide_max_message_size => {
                        a.max_message_size = None;
                        let mut f = frame[..doff].to_vec();
                        f.extend(serde_amqp::to_vec(&Performative::Attach(a)).unwrap());
                        let len = f.len() as u32;
                        f[..4].copy_from_slice(&len.to_be_bytes());
                        rewritten = Some(f);
                    }
                    Ok(_) => {}
                    Err(e) => panic!("undecodable performative ({size} bytes): {e:?}"),
                }
            }
            let record = SeenFrame {
                size,
                transfer_more,
            };
            if client_to_server {
                s.to_server.push(record);
            } else {
                s.to_client.push(record);
            }
            if let Some(f) = rewritten {
                frame = f;
            }
            out.extend(frame);
        }
        if to.write_all(&out).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Checks every connection the tap saw: no frame above what its receiver announced.
/// Returns the transfer frames sent to clients with `more = true` and those sent to the
/// server with `more = true`.
fn check_frames(tap: &FrameTap) -> (usize, usize) {
    let (mut to_client_more, mut to_server_more) = (0, 0);
    for c in tap.seen() {
        let c = c.lock().unwrap();
        let client_max = c.client_max_frame_size.expect("the client sent an open") as usize;
        let server_max = c.server_max_frame_size.expect("the emulator sent an open") as usize;
        for f in &c.to_client {
            assert!(
                f.size <= client_max,
                "a {}-byte frame was sent to a client that announced max-frame-size {client_max}",
                f.size
            );
        }
        for f in &c.to_server {
            assert!(f.size <= server_max, "{} > {server_max}", f.size);
        }
        to_client_more += c
            .to_client
            .iter()
            .filter(|f| f.transfer_more == Some(true))
            .count();
        to_server_more += c
            .to_server
            .iter()
            .filter(|f| f.transfer_more == Some(true))
            .count();
    }
    (to_client_more, to_server_more)
}

fn big_body(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

#[tokio::test]
async fn sdk_frames_never_exceed_the_max_frame_size_each_peer_announced() {
    let emu = emulator(&[("hub", 1)]).await;
    let tap = FrameTap::start(emu.local_addr()).await;
    let key = conn(&emu).key;
    // The SDK clients dial the tap (it announces max-frame-size 65,536 in its open).
    let cs: hubguard::azure::ConnectionString =
        hubguard::emulator::eventhubs::connection_string(tap.addr, &key)
            .parse()
            .unwrap();
    let body = big_body(1_000_000);
    let prod = producer(&cs, "hub").await;
    within(
        "send 1 MB",
        prod.send_event(
            azure_messaging_eventhubs::models::EventData::builder()
                .with_body(body.clone())
                .build(),
            None,
        ),
    )
    .await
    .expect("a 1,000,000-byte event is accepted");
    let c = consumer(&cs, "hub").await;
    let r = receiver(
        &c,
        "0",
        azure_messaging_eventhubs::StartLocation::Earliest,
        false,
    )
    .await;
    let got = take(&r, 1).await;
    assert_eq!(got[0].event_data().body(), Some(&body[..]));
    let (to_client_more, to_server_more) = check_frames(&tap);
    // 1,000,000 bytes over 65,536-byte frames: at least 15 frames with `more` each way.
    assert!(
        to_client_more >= 15,
        "{to_client_more} continued transfers to the consumer"
    );
    assert!(
        to_server_more >= 15,
        "{to_server_more} continued transfers from the producer"
    );
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn a_client_announcing_a_small_max_frame_size_gets_only_frames_that_fit() {
    let emu = emulator(&[("hub", 1)]).await;
    let tap = FrameTap::start(emu.local_addr()).await;
    let key = conn(&emu).key;
    let body = big_body(100_000);
    let prod = producer(&conn(&emu), "hub").await;
    within(
        "send",
        prod.send_event(
            azure_messaging_eventhubs::models::EventData::builder()
                .with_body(body.clone())
                .build(),
            None,
        ),
    )
    .await
    .unwrap();
    let audience = format!(
        "amqps://{}/hub/ConsumerGroups/$Default/Partitions/0",
        emu.local_addr()
    );
    // 2,048 bytes: the emulator's padded performatives must still fit.
    let (mut client, status) = connect_via(&emu, tap.addr, Some(2048), &audience, &key).await;
    assert_eq!(status, 202);
    let mut r = epoch_receiver(&mut client, "small-frames", &emu, None).await;
    let d = within("read", r.recv::<Body<Value>>()).await.unwrap();
    match &d.message().body {
        Body::Data(sections) => assert_eq!(sections[0].0.as_ref(), &body[..]),
        other => panic!("unexpected body {other:?}"),
    }
    let (to_client_more, _) = check_frames(&tap);
    assert!(to_client_more >= 48, "{to_client_more} continued transfers");
    let _ = r.close().await;
    close(client).await;
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn a_delivery_over_one_mebibyte_is_rejected_with_message_size_exceeded() {
    let emu = emulator(&[("hub", 1)]).await;
    // The tap hides the advertised limit, so the client sends what the emulator must refuse
    // (as a client that ignores `max-message-size` would).
    let tap = FrameTap::start_with(emu.local_addr(), true).await;
    assert!(tap.hide_max_message_size);
    let key = conn(&emu).key;
    let audience = format!("amqps://{}/hub", emu.local_addr());
    let (mut client, status) = connect_via(&emu, tap.addr, None, &audience, &key).await;
    assert_eq!(status, 202);
    let mut sender = within(
        "attach sender",
        Sender::attach(
            &mut client.session,
            "p",
            format!("amqps://{}/hub/Partitions/0", emu.local_addr()),
        ),
    )
    .await
    .unwrap();
    let message = |len: usize| {
        Message::builder()
            .body(Body::<Value>::Data(
                vec![Data(Binary::from(big_body(len)))].into(),
            ))
            .build()
    };
    let outcome = within("send 1 MiB + 1", sender.send(message(1_048_577))).await;
    let text = format!("{outcome:?}");
    assert!(text.contains("Rejected"), "{text}");
    assert!(
        text.contains("message-size-exceeded") || text.contains("MessageSizeExceeded"),
        "{text}"
    );
    assert!(text.contains("exceeds the limit (1048576 bytes)"), "{text}");
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 0);
    // The link stays attached (a rejected outcome, not a detach): a 1,000,000-byte event
    // on it is accepted.
    let outcome = within("send 1 MB", sender.send(message(1_000_000))).await;
    assert!(outcome.is_ok(), "{outcome:?}");
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 1);
    let (_, to_server_more) = check_frames(&tap);
    assert!(
        to_server_more >= 30,
        "multi-frame deliveries from the producer"
    );
    let _ = sender.close().await;
    close(client).await;
}

/// Azure's broker takes a SAS token only under `servicebus.windows.net:sastoken` and answers
/// 401 otherwise (azure-sdk-for-rust #4587); Entra ID tokens come as `jwt`, which the
/// emulator accepts only with `--accept-any-token` (it cannot verify them).
#[tokio::test]
async fn cbs_token_types_and_audiences_are_checked_as_azure_does() {
    let strict = emulator(&[("hub", 1)]).await;
    let key = conn(&strict).key;
    let expiry = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let audience = |emu: &EventHubsEmulator| {
        format!(
            "amqps://{}/hub/ConsumerGroups/$Default/Partitions/0",
            emu.local_addr()
        )
    };
    let sas = key.token("sb://ns.servicebus.windows.net/hub", expiry);
    let other_hub = key.token("sb://ns.servicebus.windows.net/otherhub", expiry);
    let jwt =
        "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJodHRwczovL2V2ZW50aHVicy5henVyZS5uZXQifQ.c2ln".to_string();
    let aud = audience(&strict);
    assert_eq!(put_token(&strict, &aud, SAS_TYPE, sas.clone()).await, 202);
    assert_eq!(
        put_token(&strict, &aud, "jwt", sas.clone()).await,
        401,
        "a SAS token presented as jwt (what azure_messaging_eventhubs 0.15 sent) is refused"
    );
    assert_eq!(put_token(&strict, &aud, SAS_TYPE, other_hub).await, 401);
    assert_eq!(
        put_token(&strict, &aud, "jwt", jwt.clone()).await,
        401,
        "without --accept-any-token no jwt is taken"
    );
    assert_eq!(
        put_token(&strict, &aud, "unknown:type", sas.clone()).await,
        401
    );

    let lenient = emulator_with(hubguard::emulator::eventhubs::EventHubsConfig {
        accept_any_token: true,
        ..Default::default()
    })
    .await;
    let aud = audience(&lenient);
    assert_eq!(put_token(&lenient, &aud, "jwt", jwt).await, 202);
    assert_eq!(
        put_token(&lenient, &aud, "jwt", sas.clone()).await,
        401,
        "a SAS string is no jwt, whatever the flag"
    );
    assert_eq!(put_token(&lenient, &aud, SAS_TYPE, sas).await, 202);
    let forged = SasKey::new(key.name(), "not-the-key").token("sb://x/hub", expiry);
    assert_eq!(
        put_token(&lenient, &aud, SAS_TYPE, forged).await,
        401,
        "SAS signatures are verified even with --accept-any-token"
    );
}
