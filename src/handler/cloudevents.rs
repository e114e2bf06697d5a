//! The CloudEvents HTTP protocol binding (CloudEvents 1.0, "HTTP Protocol Binding") for the
//! webhook: the attributes an event carries in its Event Hubs properties — the AMQP binding's
//! `cloudEvents:` / `cloudEvents_` prefixes or the Kafka binding's `ce_` — become
//!
//! - **binary** content mode (the default): one `ce-{name}` header per attribute (values
//!   percent-encoded as §3.1.3.2 asks: space, `"`, `%` and anything outside printable
//!   ASCII), `datacontenttype` as `Content-Type`, the body untouched;
//! - **structured** content mode: `Content-Type: application/cloudevents+json` and the
//!   JSON event format as the body (`data` for JSON and text, `data_base64` for other bytes).
//!
//! An event is a CloudEvent when it carries `id`, `source` and `type`; `specversion` is
//! `1.0` when it does not say. An event without them goes out as before (its body, its
//! content type, `ce-type` when hubguard knows its type), in either mode.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::Deserialize;

use crate::event::Event;

/// How a CloudEvent is put on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentMode {
    /// Attributes as `ce-*` headers, the body as it is.
    #[default]
    Binary,
    /// The whole event as `application/cloudevents+json`.
    Structured,
}

/// Property name prefixes that carry CloudEvents attributes, in order of preference: the
/// AMQP binding (`cloudEvents:`; `cloudEvents_` where `:` cannot be used) and the Kafka
/// binding's `ce_`.
pub const PREFIXES: &[&str] = &["cloudEvents:", "cloudEvents_", "ce_"];

/// The CloudEvents attributes of `event`: attribute name → value. Names are what follows a
/// prefix, kept only when they are valid attribute names (lower-case letters and digits).
pub fn attributes(event: &Event) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for prefix in PREFIXES {
        for (k, v) in &event.properties {
            let Some(name) = k.strip_prefix(prefix) else {
                continue;
            };
            let valid = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
            if valid && !v.is_empty() {
                out.entry(name.to_string()).or_insert_with(|| v.clone());
            }
        }
    }
    out
}

/// Whether `attrs` make a CloudEvent (the required `id`, `source` and `type`).
pub fn is_cloudevent(attrs: &BTreeMap<String, String>) -> bool {
    ["id", "source", "type"]
        .iter()
        .all(|a| attrs.contains_key(*a))
}

/// The `datacontenttype` of `event`: the attribute, else the AMQP content type.
pub fn data_content_type<'e>(
    attrs: &'e BTreeMap<String, String>,
    event: &'e Event,
) -> Option<&'e str> {
    attrs
        .get("datacontenttype")
        .map(String::as_str)
        .or(event.content_type.as_deref())
}

/// Percent-encodes a header value as the HTTP binding asks (§3.1.3.2): printable ASCII
/// stays, except space, `"` and `%`; every other byte of the UTF-8 form becomes `%XX`.
pub fn header_value(value: &str) -> String {
    /// Controls (and DEL), space, `"` and `%`; bytes outside ASCII are always encoded.
    const ENCODED: &percent_encoding::AsciiSet =
        &percent_encoding::CONTROLS.add(b' ').add(b'"').add(b'%');
    super::percent_encode(value, ENCODED)
}

/// What to send: headers (besides hubguard's own) and the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// `Content-Type`.
    pub content_type: String,
    /// `ce-*` headers (binary mode), names lower-case, values encoded.
    pub headers: Vec<(String, String)>,
    /// The request body.
    pub body: Vec<u8>,
}

fn is_json(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|ct| {
        let media = ct
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        media == "application/json" || media.ends_with("+json") || media == "text/json"
    })
}

/// A structured CloudEvent's data (JSON event format, §3.1).
pub(crate) enum Data<'a> {
    /// `data` as JSON: the content type says JSON and the body parses.
    Json(serde_json::Value),
    /// `data` as a string: text or XML that is UTF-8.
    Text(&'a str),
    /// `data_base64`: any other bytes.
    Base64(&'a [u8]),
}

/// How a structured CloudEvent with `content_type` carries `body`.
pub(crate) fn structured_data<'a>(content_type: &str, body: &'a [u8]) -> Data<'a> {
    if is_json(Some(content_type)) {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
            return Data::Json(v);
        }
    }
    match std::str::from_utf8(body) {
        Ok(text) if content_type.starts_with("text/") || content_type.contains("xml") => {
            Data::Text(text)
        }
        _ => Data::Base64(body),
    }
}

/// Encodes `event` for `mode`. An event that is not a CloudEvent is sent as it is, with
/// `ce-type` when hubguard knows its type (as before).
pub fn encode(event: &Event, mode: ContentMode) -> Encoded {
    let mut attrs = attributes(event);
    let content_type = data_content_type(&attrs, event)
        .unwrap_or("application/octet-stream")
        .to_string();
    if !is_cloudevent(&attrs) {
        let mut headers = Vec::new();
        if let Some(t) = &event.identity.event_type {
            attrs.entry("type".into()).or_insert_with(|| t.clone());
        }
        // Whatever attributes it has still go as headers (a partial CloudEvent).
        for (name, value) in &attrs {
            if name != "datacontenttype" {
                headers.push((format!("ce-{name}"), header_value(value)));
            }
        }
        return Encoded {
            content_type,
            headers,
            body: event.body.clone(),
        };
    }
    attrs
        .entry("specversion".into())
        .or_insert_with(|| "1.0".into());
    match mode {
        ContentMode::Binary => Encoded {
            content_type,
            headers: attrs
                .iter()
                .filter(|(n, _)| n.as_str() != "datacontenttype")
                .map(|(n, v)| (format!("ce-{n}"), header_value(v)))
                .collect(),
            body: event.body.clone(),
        },
        ContentMode::Structured => {
            let mut obj = serde_json::Map::new();
            for (n, v) in &attrs {
                obj.insert(n.clone(), serde_json::Value::String(v.clone()));
            }
            obj.insert(
                "datacontenttype".into(),
                serde_json::Value::String(content_type.clone()),
            );
            match structured_data(&content_type, &event.body) {
                Data::Json(v) => obj.insert("data".into(), v),
                Data::Text(t) => obj.insert("data".into(), t.into()),
                Data::Base64(b) => obj.insert(
                    "data_base64".into(),
                    base64::engine::general_purpose::STANDARD.encode(b).into(),
                ),
            };
            Encoded {
                content_type: "application/cloudevents+json; charset=utf-8".into(),
                headers: Vec::new(),
                body: serde_json::to_vec(&serde_json::Value::Object(obj)).unwrap_or_default(),
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::event::Identity;

    /// An event with these properties, body and content type (the rest plain).
    pub(in crate::handler) fn event(
        props: &[(&str, &str)],
        body: &[u8],
        ct: Option<&str>,
    ) -> Event {
        Event {
            body: body.to_vec(),
            content_type: ct.map(String::from),
            properties: props
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            hub: "h".into(),
            partition_id: "0".into(),
            sequence_number: 1,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: Identity {
                idempotency_key: "k".into(),
                correlation_id: "k".into(),
                event_type: None,
            },
        }
    }

    #[test]
    fn every_binding_prefix_is_read_and_only_valid_names_kept() {
        let e = event(
            &[
                ("cloudEvents:id", "1"),
                ("ce_id", "ignored: the AMQP form wins"),
                ("cloudEvents_source", "/s"),
                ("ce_type", "t"),
                ("ce_Bad-Name", "x"),
                ("ce_traceparent", "00-abc"),
                ("other", "y"),
            ],
            b"",
            None,
        );
        let a = attributes(&e);
        assert_eq!(a.get("id").map(String::as_str), Some("1"));
        assert_eq!(a.get("source").map(String::as_str), Some("/s"));
        assert!(a.contains_key("traceparent"));
        assert!(!a.keys().any(|k| k.contains("Bad")));
        assert!(is_cloudevent(&a));
    }

    #[test]
    fn binary_mode_headers_are_percent_encoded() {
        let e = event(
            &[
                ("ce_id", "1"),
                ("ce_source", "/s"),
                ("ce_type", "t"),
                ("ce_subject", "a b\"%é"),
                ("ce_datacontenttype", "application/json"),
            ],
            b"{}",
            None,
        );
        let enc = encode(&e, ContentMode::Binary);
        assert_eq!(enc.content_type, "application/json");
        let h: BTreeMap<_, _> = enc.headers.into_iter().collect();
        assert_eq!(h["ce-subject"], "a%20b%22%25%C3%A9");
        assert_eq!(h["ce-specversion"], "1.0");
        assert!(!h.contains_key("ce-datacontenttype"));
    }

    #[test]
    fn structured_mode_carries_json_text_and_bytes() {
        let attrs = [("ce_id", "1"), ("ce_source", "/s"), ("ce_type", "t")];
        let enc = encode(
            &event(&attrs, br#"{"a":1}"#, Some("application/json")),
            ContentMode::Structured,
        );
        let v: serde_json::Value = serde_json::from_slice(&enc.body).unwrap();
        assert_eq!(v["data"]["a"], 1);
        assert_eq!(v["specversion"], "1.0");
        let enc = encode(
            &event(&attrs, &[0, 255], Some("application/octet-stream")),
            ContentMode::Structured,
        );
        let v: serde_json::Value = serde_json::from_slice(&enc.body).unwrap();
        assert_eq!(v["data_base64"], "AP8=");
        // Not a CloudEvent: as it is.
        let plain = event(&[], b"raw", Some("text/plain"));
        let enc = encode(&plain, ContentMode::Structured);
        assert_eq!(
            (enc.body.as_slice(), enc.content_type.as_str()),
            (&b"raw"[..], "text/plain")
        );
        assert!(enc.headers.is_empty());
    }
}
