//! The requests a client sends on the `$cbs` and `$management` nodes: CBS `put-token` (the
//! token checked as Azure checks it, the audience granted to the connection) and the
//! management `READ` of a hub or a partition; each answered on the session's reply link.

use std::sync::Arc;
use std::time::SystemTime;

use fe2o3_amqp::types::messaging::{AmqpValue, ApplicationProperties, Body, Message, Properties};
use fe2o3_amqp::types::primitives::{Array, OrderedMap, SimpleValue, Timestamp, Value};
use fe2o3_amqp::Receiver;

use super::super::store::Msg;
use super::super::Shared;
use super::{ConnectionAuth, ReplyLinks, CBS};
use crate::emulator::sas::Verify as _;

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
const SAS_TOKEN_TYPE: &str = "servicebus.windows.net:sastoken";
/// The CBS token type of an Entra ID (JWT) token.
const JWT_TOKEN_TYPE: &str = "jwt";

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

pub(super) fn reply(request: &Msg, status: i32, description: &str, body: Value) -> Msg {
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

pub(super) async fn serve_requests(
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
