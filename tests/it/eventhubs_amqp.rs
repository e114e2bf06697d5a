//! Protocol cases the Rust SDK 0.15 never exercises, driven with a plain AMQP 1.0 client
//! (fe2o3-amqp 0.18): owner-level (epoch) arbitration, which other SDKs send as
//! `com.microsoft:epoch`, and malformed batches rejected with a condition.

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
    let url = format!("amqp://{}", emu.local_addr());
    let mut connection = within(
        "connect",
        Connection::builder()
            .container_id("epoch-test")
            .sasl_profile(SaslProfile::Anonymous)
            .open(url.as_str()),
    )
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
    let expiry = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let token = key.token(&format!("sb://{}/hub", emu.local_addr()), expiry);
    let request = Message::builder()
        .properties(Properties {
            message_id: Some(7u64.into()),
            reply_to: Some("cbs-reply".into()),
            ..Default::default()
        })
        .application_properties(
            ApplicationProperties::builder()
                .insert("operation", SimpleValue::String("put-token".into()))
                .insert(
                    "type",
                    SimpleValue::String("servicebus.windows.net:sastoken".into()),
                )
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
