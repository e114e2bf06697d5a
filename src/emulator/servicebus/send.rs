//! Sending: Send Message (one message, its custom properties in headers) and Send Message
//! Batch (a JSON array), each message checked against Azure's limits (the module table of
//! `emulator::servicebus`) before anything is enqueued.

use crate::sync::LockExt;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;

use super::broker::{BrokerError, NewMessage, Queue};
use crate::emulator::clock::parse_http_date;

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
/// Refuses a send that breaks one of Azure's limits on a message (see the module's table).
fn check_limits(
    queue: &Queue,
    name: &str,
    headers: &HeaderMap,
    props: &SentBrokerProperties,
    body_len: usize,
) -> Result<(), BrokerError> {
    use super::broker::limits;
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
pub(super) fn is_batch(headers: &HeaderMap) -> bool {
    headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(BATCH_CONTENT_TYPE))
}

/// Send Message Batch: every message checked as [`send`] checks one (its `UserProperties`
/// are its custom properties), the batch as a whole against the queue's maximum message
/// size; one refusal refuses the whole batch and nothing is enqueued.
pub(super) fn send_batch(
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
        let refused = refused.locked();
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

pub(super) fn send(
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
