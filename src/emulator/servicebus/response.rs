//! Writing a Service Bus answer: the XML `<Error>` for a refusal (and which status each
//! broker error gets) and a received message with its `BrokerProperties` and custom
//! properties as headers.

use std::time::{Duration, SystemTime};

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::broker::{BrokerError, Locked, StoredMessage};
use crate::emulator::clock::http_date;

pub(super) fn error(status: StatusCode, code: &str, detail: impl Into<String>) -> Response {
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

pub(super) fn xml_escape(s: &str) -> String {
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
pub(super) fn broker_error(e: BrokerError) -> Response {
    match e {
        BrokerError::EntityNotFound(_) => error(StatusCode::GONE, "41000", e.to_string()),
        BrokerError::BadRequest(_) => error(StatusCode::BAD_REQUEST, "40000", e.to_string()),
        BrokerError::MessageTooLarge(_) => error(StatusCode::FORBIDDEN, "40300", e.to_string()),
        BrokerError::LockLost => error(StatusCode::NOT_FOUND, "40400", e.to_string()),
        BrokerError::NotAllowed(_) => error(StatusCode::BAD_REQUEST, "40000", e.to_string()),
        BrokerError::Storage(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "50000", e.to_string()),
    }
}
pub(super) fn message_response(
    status: StatusCode,
    m: &StoredMessage,
    locked: Option<&Locked>,
    location: Option<String>,
) -> Response {
    let mut bp = serde_json::json!({
        "DeliveryCount": m.delivery_count,
        // The sequence number a message had where it was first enqueued, when it was
        // forwarded; 0 for one sent here, as Azure answers (the emulator forwards nothing).
        "EnqueuedSequenceNumber": 0,
        "EnqueuedTimeUtc": http_date(SystemTime::UNIX_EPOCH + Duration::from_millis(m.enqueued_at_ms.max(0) as u64)),
        "MessageId": m.message_id,
        "SequenceNumber": m.sequence_number,
        "State": if locked.is_some() || !m.scheduled { "Active" } else { "Scheduled" },
        "TimeToLive": m.time_to_live.unwrap_or(922_337_203_685.477_5),
    });
    let obj = bp.as_object_mut().expect("object");
    // A message received and deleted holds no lock, and Azure names none.
    if let Some(l) = locked {
        obj.insert("LockToken".into(), l.lock_token.clone().into());
        obj.insert("LockedUntilUtc".into(), http_date(l.locked_until).into());
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
    let mut response = (status, headers, m.body.clone()).into_response();
    if m.content_type.is_none() {
        // A message sent without a content type is received without one (the framework
        // would call its bytes `application/octet-stream`).
        response
            .headers_mut()
            .remove(axum::http::header::CONTENT_TYPE);
    }
    response
}

/// An accepted send or settlement: no body, Azure's content type for it.
pub(super) fn accepted(status: StatusCode) -> Response {
    (status, [("content-type", "application/xml; charset=utf-8")]).into_response()
}
