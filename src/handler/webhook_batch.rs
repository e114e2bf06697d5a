//! The webhook's batches (`handler.batch_max` > 1): one POST carrying several events, one
//! outcome per event, in the format docs/webhook.md documents.
//!
//! **The request** is the CloudEvents JSON batch format (`application/cloudevents-batch+json`,
//! <https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/formats/json-format.md#4-json-batch-format>):
//! a JSON array of structured CloudEvents, one per event. An event that is not a CloudEvent
//! is given the attributes a CloudEvent needs (`id`: its idempotency key; `source`:
//! `/{hub}/partitions/{partition}`; `type`: its event type or `eventhubs.event`). Every element
//! carries the event's own attempt as extension attributes (`hubguardattempt`,
//! `hubguardkey`, `hubguardcorrelation`, `hubguardpartition`, `hubguardsequence`) and its
//! attempt's `traceparent` (the CloudEvents distributed-tracing extension); the request's own
//! `traceparent` header is the batch call's span. Signed as single deliveries are (Standard
//! Webhooks over the whole body; `webhook-id` names the batch: the same events on the same
//! attempts give the same id).
//!
//! **The answer**: a 2xx with an empty body (or `{}`, or an empty list) delivers every event;
//! a 2xx with `{"failures": [{"id": …, "kind": "transient" | "permanent",
//! "retry_after_s": …, "error": …}]}` fails the events it names by CloudEvents `id` (every
//! event of the batch carrying that id) and delivers the rest. An id not in the batch is
//! ignored and logged; a second entry for an id is ignored. A 2xx body that is not that
//! answer fails every event transiently — never assumed delivered. A non-2xx, a timeout or no
//! answer fails every event as a single call's would fail; a 413 splits the batch in two and
//! sends each half (one event answered 413 is a permanent failure, as a single call's).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use opentelemetry::trace::TraceContextExt;
use sha2::Digest as _;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::batch::{BatchHandler, Item};
use super::cloudevents;
use super::webhook::{body_excerpt, sanitise, signed, WebhookHandler};
use super::{Failure, Handler, Outcome};

/// The media type of a CloudEvents JSON batch.
pub const BATCH_CONTENT_TYPE: &str = "application/cloudevents-batch+json; charset=utf-8";

/// The CloudEvents `type` of an event that has none (and is not a CloudEvent).
pub const DEFAULT_TYPE: &str = "eventhubs.event";

/// The largest answer body read (bytes): a longer one is not a batch answer.
const ANSWER_LIMIT: usize = 1 << 20;

/// A value of a batch element, as it is written.
enum Piece<'a> {
    Text(&'a str),
    Number(i64),
    Json(&'a serde_json::Value),
    Base64(&'a [u8]),
}

/// One event of a batch as a structured CloudEvent with hubguard's extension attributes,
/// written into `out` (straight into the request body: no JSON tree of the element is built
/// and read back); returns its CloudEvents `id`.
fn write_element(out: &mut Vec<u8>, item: &Item<'_>) -> String {
    let event = item.event;
    let attrs = cloudevents::attributes(event);
    let content_type =
        cloudevents::data_content_type(&attrs, event).unwrap_or("application/octet-stream");
    // What the element's values borrow from, set by the branch that needs it.
    let (data, carried, source);
    let mut obj: BTreeMap<&str, Piece<'_>> = BTreeMap::new();
    if cloudevents::is_cloudevent(&attrs) {
        obj.extend(attrs.iter().map(|(n, v)| (n.as_str(), Piece::Text(v))));
        obj.entry("specversion").or_insert(Piece::Text("1.0"));
        obj.insert("datacontenttype", Piece::Text(content_type));
        data = cloudevents::structured_data(content_type, &event.body);
        match &data {
            cloudevents::Data::Json(v) => obj.insert("data", Piece::Json(v)),
            cloudevents::Data::Text(t) => obj.insert("data", Piece::Text(t)),
            cloudevents::Data::Base64(b) => obj.insert("data_base64", Piece::Base64(b)),
        };
    } else {
        let structured = content_type.contains("cloudevents");
        let json_data = event
            .content_type
            .as_deref()
            .is_some_and(|c| c.contains("json"));
        carried = (structured || json_data)
            .then(|| serde_json::from_slice::<serde_json::Value>(&event.body).ok())
            .flatten();
        match &carried {
            // A structured CloudEvent as the body: the element is that object.
            Some(serde_json::Value::Object(o)) if structured => {
                obj.extend(o.iter().map(|(k, v)| (k.as_str(), Piece::Json(v))));
            }
            // Not a CloudEvent: the attributes one needs, and the data as it is.
            _ => {
                source = format!("/{}/partitions/{}", event.hub, event.partition_id);
                obj.insert("specversion", Piece::Text("1.0"));
                obj.insert("id", Piece::Text(&event.identity.idempotency_key));
                obj.insert("source", Piece::Text(&source));
                let t = event.identity.event_type.as_deref();
                obj.insert("type", Piece::Text(t.unwrap_or(DEFAULT_TYPE)));
                if let Some(ct) = &event.content_type {
                    obj.insert("datacontenttype", Piece::Text(ct));
                }
                match carried.as_ref().filter(|_| json_data) {
                    Some(v) => obj.insert("data", Piece::Json(v)),
                    None => obj.insert("data_base64", Piece::Base64(&event.body)),
                };
            }
        }
    }
    obj.insert("hubguardattempt", Piece::Number(item.attempt.number.into()));
    obj.insert("hubguardkey", Piece::Text(&event.identity.idempotency_key));
    obj.insert(
        "hubguardcorrelation",
        Piece::Text(&event.identity.correlation_id),
    );
    obj.insert("hubguardpartition", Piece::Text(&event.partition_id));
    obj.insert("hubguardsequence", Piece::Number(event.sequence_number));
    obj.insert("traceparent", Piece::Text(&item.attempt.traceparent));
    let id = match obj.get("id") {
        Some(Piece::Text(s)) => s.to_string(),
        Some(Piece::Json(serde_json::Value::String(s))) => s.clone(),
        _ => String::new(),
    };
    write_object(out, &obj);
    id
}

/// Writes `obj` as a JSON object (keys in order, strings escaped as `serde_json` escapes
/// them; base64 needs no escaping).
fn write_object(out: &mut Vec<u8>, obj: &BTreeMap<&str, Piece<'_>>) {
    fn json(out: &mut Vec<u8>, v: &(impl serde::Serialize + ?Sized)) {
        // Writing into memory cannot fail, and these values (strings, numbers, parsed JSON)
        // always serialize.
        let _ = serde_json::to_writer(&mut *out, v);
    }
    out.push(b'{');
    for (i, (name, value)) in obj.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        json(out, name);
        out.push(b':');
        match value {
            Piece::Text(s) => json(out, s),
            Piece::Number(n) => json(out, n),
            Piece::Json(v) => json(out, v),
            Piece::Base64(bytes) => {
                out.push(b'"');
                let start = out.len();
                let len = base64::encoded_len(bytes.len(), true).unwrap_or(0);
                out.resize(start + len, 0);
                let written = base64::engine::general_purpose::STANDARD
                    .encode_slice(bytes, &mut out[start..])
                    .unwrap_or(0);
                out.truncate(start + written);
                out.push(b'"');
            }
        }
    }
    out.push(b'}');
}

/// About the bytes of `event`'s element: its body (base64 at worst) and the attributes
/// around it.
fn element_size(event: &crate::event::Event) -> usize {
    event.body.len() * 4 / 3 + 512
}

/// The batch's JSON array (the CloudEvents JSON batch format) and the `id` of each element.
fn batch_body(items: &[Item<'_>]) -> (Vec<u8>, Vec<String>) {
    let size = items.iter().map(|i| element_size(i.event)).sum();
    let mut body = Vec::with_capacity(size);
    body.push(b'[');
    let mut ids = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        ids.push(write_element(&mut body, item));
    }
    body.push(b']');
    (body, ids)
}

/// The batch's Standard Webhooks id: the same events on the same attempts, the same id.
fn batch_id(items: &[Item<'_>]) -> String {
    let mut h = sha2::Sha256::new();
    for i in items {
        h.update(i.event.identity.idempotency_key.as_bytes());
        h.update([0]);
        h.update(i.attempt.number.to_be_bytes());
    }
    let d = h.finalize();
    let hex: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("batch_{hex}")
}

/// The batch call's `traceparent`: its span's, else the first event's attempt's.
fn batch_traceparent(items: &[Item<'_>]) -> String {
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    if sc.is_valid() {
        crate::telemetry::format_traceparent(&sc)
    } else {
        items
            .first()
            .map(|i| i.attempt.traceparent.clone())
            .unwrap_or_default()
    }
}

/// One entry of a batch answer's `failures`.
#[derive(Debug, serde::Deserialize)]
struct Failed {
    id: String,
    kind: Kind,
    #[serde(default)]
    retry_after_s: Option<f64>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Debug, Clone, Copy, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Transient,
    Permanent,
}

#[derive(Debug, Default, serde::Deserialize)]
struct Answer {
    #[serde(default)]
    failures: Vec<Failed>,
}

impl WebhookHandler {
    /// Sends `items` as one batch; halves it on 413.
    fn send_batch<'a>(
        &'a self,
        items: &'a [Item<'a>],
    ) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let (body, ids) = batch_body(items);
            let authorization = self.authorization.as_ref().map(|a| a.get());
            if let Err(f) = self.ensure_handshake(authorization.as_deref()).await {
                return vec![Outcome::Failed(f); items.len()];
            }
            let mut req = self
                .client
                .post(&self.config.url)
                .header("content-type", BATCH_CONTENT_TYPE)
                .header("traceparent", batch_traceparent(items))
                .header("x-hubguard-batch-size", items.len().to_string());
            if let Some(keys) = &self.signing {
                req = signed(req, keys, &batch_id(items), &body);
            }
            if let Some(a) = authorization.as_deref() {
                req = req.header(reqwest::header::AUTHORIZATION, a.clone());
            }
            let sent = req.body(body).send().await;
            match sent {
                Ok(mut resp) if resp.status().is_success() => {
                    let (bytes, more) = body_excerpt(&mut resp, ANSWER_LIMIT).await;
                    answered(&ids, &bytes, more, self.config.retry_after_max_s)
                }
                Ok(resp) if resp.status().as_u16() == 413 && items.len() > 1 => {
                    tracing::info!(
                        events = items.len(),
                        "the webhook refused the batch as too large (413): sending it in two halves"
                    );
                    let (a, b) = items.split_at(items.len() / 2);
                    let mut out = self.send_batch(a).await;
                    out.extend(self.send_batch(b).await);
                    out
                }
                other => {
                    let outcome = self.outcome(other).await;
                    vec![outcome; items.len()]
                }
            }
        })
    }
}

/// The outcomes a 2xx answer `bytes` gives the batch's events, whose CloudEvents ids are
/// `ids` (`more`: the body went on past what was read).
fn answered(
    ids: &[String],
    bytes: &[u8],
    more: bool,
    retry_after_max_s: Option<u64>,
) -> Vec<Outcome> {
    let text = String::from_utf8_lossy(bytes);
    let answer: Result<Answer, String> = if more {
        Err(format!("longer than {ANSWER_LIMIT} bytes"))
    } else if text.trim().is_empty() {
        Ok(Answer::default())
    } else {
        serde_json::from_str::<Answer>(text.trim_start_matches('\u{feff}'))
            .map_err(|e| e.to_string())
    };
    let answer = match answer {
        Ok(a) => a,
        Err(e) => {
            let why = format!(
                "the webhook answered the batch 2xx with a body that is not a batch answer ({e}; body: {}); nothing in it is taken as delivered",
                sanitise(bytes, 200)
            );
            return vec![Outcome::Failed(Failure::transient(why)); ids.len()];
        }
    };
    let mut failed: HashMap<String, Failure> = HashMap::new();
    let mut unknown = BTreeMap::new();
    for f in answer.failures {
        if !ids.contains(&f.id) {
            *unknown.entry(sanitise(f.id.as_bytes(), 80)).or_insert(0) += 1;
            continue;
        }
        failed
            .entry(f.id.clone())
            .or_insert_with(|| failure_of(&f, retry_after_max_s));
    }
    if !unknown.is_empty() {
        tracing::warn!(ids = ?unknown, "the webhook's batch answer names events that were not in the batch: ignored");
    }
    ids.iter()
        .map(|id| match failed.get(id) {
            Some(f) => Outcome::Failed(f.clone()),
            None => Outcome::Delivered,
        })
        .collect()
}

fn failure_of(f: &Failed, retry_after_max_s: Option<u64>) -> Failure {
    let error = format!(
        "the webhook failed this event of a batch: {}",
        f.error
            .as_deref()
            .map(|e| sanitise(e.as_bytes(), super::webhook::BODY_EXCERPT))
            .unwrap_or_else(|| "no reason given".into())
    );
    let base = match f.kind {
        Kind::Transient => Failure::transient(error),
        Kind::Permanent => Failure::permanent(error),
    };
    let retry_after = f
        .retry_after_s
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| Duration::from_secs_f64(s.min(86_400.0 * 30.0)));
    base.with_retry_after(retry_after)
        .with_retry_after_max(retry_after_max_s.map(Duration::from_secs))
}

#[async_trait]
impl BatchHandler for WebhookHandler {
    async fn handle_batch(&self, items: &[Item<'_>]) -> Vec<Outcome> {
        if let [one] = items {
            // Alone: exactly a single delivery (its encoding, its headers).
            return vec![self.handle(one.event, one.attempt).await];
        }
        self.send_batch(items).await
    }

    fn downstream(&self) -> String {
        Handler::downstream(self)
    }

    fn blocked(&self) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        Handler::blocked(self)
    }

    fn allowed_rate(&self) -> Option<tokio::sync::watch::Receiver<Option<f64>>> {
        Handler::allowed_rate(self)
    }

    fn size_of(&self, event: &crate::event::Event) -> usize {
        element_size(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::Attempt;
    use crate::policy::classify::ErrorClass;

    fn elements(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|i| i.to_string()).collect()
    }

    /// An element as it was built before it was written directly: the structured encoding
    /// parsed back into a JSON tree, the attributes a CloudEvent needs added when it is not
    /// one, then hubguard's extension attributes.
    fn reference(item: &Item<'_>) -> serde_json::Value {
        let event = item.event;
        let encoded = cloudevents::encode(event, cloudevents::ContentMode::Structured);
        let mut obj = match serde_json::from_slice::<serde_json::Value>(&encoded.body) {
            Ok(serde_json::Value::Object(o)) if encoded.content_type.contains("cloudevents") => o,
            _ => {
                let mut o = serde_json::Map::new();
                o.insert("specversion".into(), "1.0".into());
                o.insert("id".into(), event.identity.idempotency_key.clone().into());
                let source = format!("/{}/partitions/{}", event.hub, event.partition_id);
                o.insert("source".into(), source.into());
                let t = event.identity.event_type.clone();
                o.insert(
                    "type".into(),
                    t.unwrap_or_else(|| DEFAULT_TYPE.into()).into(),
                );
                let ct = event.content_type.clone();
                let json = ct
                    .as_deref()
                    .is_some_and(|c| c.contains("json"))
                    .then(|| serde_json::from_slice::<serde_json::Value>(&event.body).ok())
                    .flatten();
                if let Some(ct) = ct {
                    o.insert("datacontenttype".into(), ct.into());
                }
                match json {
                    Some(v) => o.insert("data".into(), v),
                    None => {
                        let b = base64::engine::general_purpose::STANDARD.encode(&event.body);
                        o.insert("data_base64".into(), b.into())
                    }
                };
                o
            }
        };
        let id = &event.identity;
        obj.insert("hubguardattempt".into(), item.attempt.number.into());
        obj.insert("hubguardkey".into(), id.idempotency_key.clone().into());
        obj.insert(
            "hubguardcorrelation".into(),
            id.correlation_id.clone().into(),
        );
        obj.insert(
            "hubguardpartition".into(),
            event.partition_id.clone().into(),
        );
        obj.insert("hubguardsequence".into(), event.sequence_number.into());
        obj.insert(
            "traceparent".into(),
            item.attempt.traceparent.clone().into(),
        );
        serde_json::Value::Object(obj)
    }

    /// An event with odd values to escape: quotes and a control character in the key and
    /// the hub, a negative sequence number.
    fn event_of(props: &[(&str, &str)], body: &[u8], ct: Option<&str>) -> crate::event::Event {
        crate::event::Event {
            hub: "hub \"q\"".into(),
            partition_id: "3".into(),
            sequence_number: -7,
            identity: crate::event::Identity {
                idempotency_key: "k\u{1}\"é".into(),
                correlation_id: "c/1".into(),
                event_type: Some("order.created".into()),
            },
            ..crate::handler::cloudevents::tests::event(props, body, ct)
        }
    }

    #[test]
    fn an_element_is_written_byte_for_byte_as_its_json_tree_would_be() {
        let ce: &[(&str, &str)] = &[("ce_id", "e-1"), ("ce_source", "/s"), ("ce_type", "t")];
        let ce_json: &[(&str, &str)] = &[
            ("cloudEvents:id", "e-2"),
            ("cloudEvents:source", "/s"),
            ("cloudEvents:type", "t"),
            ("cloudEvents:datacontenttype", "application/json"),
            ("cloudEvents:hubguardkey", "overridden"),
        ];
        let structured =
            br#"{"specversion":"1.0","id":7,"source":"/x","type":"y","data":{"a":[1,2.5,null]}}"#;
        let cases: Vec<crate::event::Event> = vec![
            event_of(&[], &[b'x'; 1024], None),
            event_of(
                &[],
                b"\x00\xff\xfe binary",
                Some("application/octet-stream"),
            ),
            event_of(
                &[],
                br#"{"order": 1, "note": "\u00e9\n"}"#,
                Some("application/json"),
            ),
            event_of(&[], b"{not json", Some("application/json")),
            event_of(&[], b"[1,2]", None),
            event_of(&[], structured, Some("application/cloudevents+json")),
            event_of(&[], b"[1]", Some("application/cloudevents+json")),
            event_of(
                &[("ce_datacontenttype", "application/cloudevents+json")],
                b"[1]",
                None,
            ),
            event_of(ce, b"plain text \"quoted\"", Some("text/plain")),
            event_of(ce, b"<a>xml</a>", Some("application/xml")),
            event_of(ce, b"\xff not utf-8", Some("text/plain")),
            event_of(ce, b"bytes", None),
            event_of(ce_json, br#"{"nested":{"deep":true}}"#, None),
            event_of(ce_json, b"not json at all", None),
            event_of(&[], b"", None),
        ];
        for (n, event) in cases.iter().enumerate() {
            let attempt = Attempt {
                number: 3,
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                last: false,
            };
            let item = Item {
                event,
                attempt: &attempt,
            };
            let mut written = Vec::new();
            let id = write_element(&mut written, &item);
            let expected = reference(&item);
            assert_eq!(
                String::from_utf8(written).unwrap(),
                serde_json::to_string(&expected).unwrap(),
                "case {n}"
            );
            assert_eq!(id, expected["id"].as_str().unwrap_or_default(), "case {n}");
        }
        let items: Vec<Attempt> = (1..=3)
            .map(|number| Attempt {
                number,
                traceparent: String::new(),
                last: false,
            })
            .collect();
        let batch: Vec<Item<'_>> = cases
            .iter()
            .zip(items.iter().cycle())
            .map(|(event, attempt)| Item { event, attempt })
            .collect();
        let (body, ids) = batch_body(&batch);
        let parsed: Vec<serde_json::Value> = serde_json::from_slice(&body).unwrap();
        assert_eq!(parsed, batch.iter().map(reference).collect::<Vec<_>>());
        assert_eq!(ids.len(), cases.len());
    }

    #[test]
    fn an_empty_2xx_delivers_everything_and_a_list_fails_only_what_it_names() {
        let e = elements(&["a", "b", "c"]);
        assert!(answered(&e, b"", false, None)
            .iter()
            .all(|o| *o == Outcome::Delivered));
        assert!(answered(&e, b"{}", false, None)
            .iter()
            .all(|o| *o == Outcome::Delivered));
        let out = answered(
            &e,
            br#"{"failures":[{"id":"b","kind":"permanent","error":"no such order"},{"id":"c","kind":"transient","retry_after_s":30}]}"#,
            false,
            None,
        );
        assert_eq!(out[0], Outcome::Delivered);
        let Outcome::Failed(b) = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!(b.class, ErrorClass::Permanent);
        assert!(b.error.contains("no such order"), "{}", b.error);
        let Outcome::Failed(c) = &out[2] else {
            panic!("{out:?}")
        };
        assert_eq!(
            (c.class, c.retry_after),
            (ErrorClass::Transient, Some(Duration::from_secs(30)))
        );
    }

    #[test]
    fn unknown_and_duplicate_ids_are_ignored_and_a_malformed_answer_delivers_nothing() {
        let e = elements(&["a", "b"]);
        let out = answered(
            &e,
            br#"{"failures":[{"id":"zzz","kind":"permanent"},{"id":"a","kind":"transient"},{"id":"a","kind":"permanent"}]}"#,
            false,
            None,
        );
        assert!(
            matches!(&out[0], Outcome::Failed(f) if f.class == ErrorClass::Transient),
            "the first entry for an id wins: {out:?}"
        );
        assert_eq!(out[1], Outcome::Delivered);
        for body in [
            &b"OK"[..],
            br#"{"failures":"none"}"#,
            br#"{"failures":[{"id":"a"}]}"#,
            br#"[1,2]"#,
        ] {
            let out = answered(&e, body, false, None);
            assert!(
                out.iter()
                    .all(|o| matches!(o, Outcome::Failed(f) if f.class == ErrorClass::Transient)),
                "{}: {out:?}",
                String::from_utf8_lossy(body)
            );
        }
        let out = answered(&e, b"{}", true, None);
        assert!(out.iter().all(|o| matches!(o, Outcome::Failed(_))));
        // A byte-order mark before the JSON is still JSON.
        let out = answered(&e, "\u{feff}{}".as_bytes(), false, None);
        assert!(out.iter().all(|o| *o == Outcome::Delivered));
    }
}
