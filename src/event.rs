//! An event as hubguard handles it, and its identity: the idempotency key, the correlation id
//! and the event type, taken from CloudEvents attributes or configured properties, else
//! derived. Any body — JSON or not, UTF-8 or not — is
//! handled; nothing about an event's content can make hubguard drop it.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use azure_messaging_eventhubs::models::{AmqpSimpleValue, MessageId, ReceivedEventData};
use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// Where an event came from and who it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Stable across redeliveries and retries; handed to the handler (`Idempotency-Key`).
    pub idempotency_key: String,
    /// Links every attempt of the event (from the event, else the idempotency key).
    pub correlation_id: String,
    /// Selects the retry policy (`None`: the default policy).
    pub event_type: Option<String>,
}

/// An event, detached from the SDK: what the handler sees, what a retry message and the
/// ledger carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// The body bytes (base64 in JSON).
    #[serde(with = "b64")]
    pub body: Vec<u8>,
    /// Content type, if the producer set one.
    pub content_type: Option<String>,
    /// Application properties, as text.
    pub properties: BTreeMap<String, String>,
    /// The hub it was read from.
    pub hub: String,
    /// The partition it was read from.
    pub partition_id: String,
    /// Its sequence number in the partition.
    pub sequence_number: i64,
    /// Its offset, if known.
    pub offset: Option<String>,
    /// When Event Hubs enqueued it (ms since the epoch).
    pub enqueued_ms: Option<i64>,
    /// Its partition key, if any.
    pub partition_key: Option<String>,
    /// Its identity.
    pub identity: Identity,
}

mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

/// Which properties carry the identity. The first one present wins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// Properties holding the idempotency key.
    #[serde(default = "default_id_props")]
    pub idempotency_key_properties: Vec<String>,
    /// Properties holding the key's scope: in CloudEvents an `id` is unique only within its
    /// `source` (CloudEvents 1.0, "id"), so when one of these is present the key is
    /// `{source}|{id}` (a `|` or `%` in the source percent-encoded, so the form is
    /// unambiguous). An empty list keys by the id alone.
    #[serde(default = "default_source_props")]
    pub key_source_properties: Vec<String>,
    /// Properties holding the correlation id (the AMQP `correlation-id` is used after them).
    #[serde(default = "default_correlation_props")]
    pub correlation_id_properties: Vec<String>,
    /// Properties holding the event type.
    #[serde(default = "default_type_props")]
    pub event_type_properties: Vec<String>,
}

fn default_id_props() -> Vec<String> {
    vec![
        "ce_id".into(),
        "cloudEvents:id".into(),
        "cloudEvents_id".into(),
    ]
}
fn default_source_props() -> Vec<String> {
    vec![
        "ce_source".into(),
        "cloudEvents:source".into(),
        "cloudEvents_source".into(),
    ]
}
fn default_correlation_props() -> Vec<String> {
    vec!["correlation_id".into(), "ce_correlationid".into()]
}
fn default_type_props() -> Vec<String> {
    vec![
        "ce_type".into(),
        "cloudEvents:type".into(),
        "cloudEvents_type".into(),
    ]
}

impl Default for IdentityConfig {
    fn default() -> Self {
        Self {
            idempotency_key_properties: default_id_props(),
            key_source_properties: default_source_props(),
            correlation_id_properties: default_correlation_props(),
            event_type_properties: default_type_props(),
        }
    }
}

/// A property value as text.
pub fn simple_value_text(v: &AmqpSimpleValue) -> String {
    match v {
        AmqpSimpleValue::String(s) => s.clone(),
        AmqpSimpleValue::Symbol(s) => format!("{s:?}").trim_matches('"').to_string(),
        AmqpSimpleValue::Boolean(b) => b.to_string(),
        AmqpSimpleValue::UByte(n) => n.to_string(),
        AmqpSimpleValue::Byte(n) => n.to_string(),
        AmqpSimpleValue::UShort(n) => n.to_string(),
        AmqpSimpleValue::Short(n) => n.to_string(),
        AmqpSimpleValue::UInt(n) => n.to_string(),
        AmqpSimpleValue::Int(n) => n.to_string(),
        AmqpSimpleValue::ULong(n) => n.to_string(),
        AmqpSimpleValue::Long(n) => n.to_string(),
        AmqpSimpleValue::Float(n) => n.to_string(),
        AmqpSimpleValue::Double(n) => n.to_string(),
        AmqpSimpleValue::Char(c) => c.to_string(),
        AmqpSimpleValue::Uuid(u) => u.to_string(),
        AmqpSimpleValue::Binary(b) => base64::engine::general_purpose::STANDARD.encode(b),
        other => format!("{other:?}"),
    }
}

fn message_id_text(m: &MessageId) -> String {
    match m {
        MessageId::String(s) => s.clone(),
        MessageId::Uuid(u) => u.to_string(),
        MessageId::Ulong(n) => n.to_string(),
        MessageId::Binary(b) => base64::engine::general_purpose::STANDARD.encode(b),
    }
}

impl IdentityConfig {
    fn first(&self, names: &[String], props: &BTreeMap<String, String>) -> Option<String> {
        names
            .iter()
            .find_map(|n| props.get(n))
            .filter(|v| !v.trim().is_empty())
            .cloned()
    }

    /// The identity of an event at (`hub`, `partition`, `sequence`).
    pub fn identify(
        &self,
        props: &BTreeMap<String, String>,
        amqp_correlation_id: Option<String>,
        hub: &str,
        partition: &str,
        sequence: i64,
    ) -> Identity {
        let idempotency_key = match self.first(&self.idempotency_key_properties, props) {
            Some(id) => match self.first(&self.key_source_properties, props) {
                Some(source) => format!("{}|{id}", source.replace('%', "%25").replace('|', "%7C")),
                None => id,
            },
            None => format!("{hub}/{partition}/{sequence}"),
        };
        let correlation_id = self
            .first(&self.correlation_id_properties, props)
            .or(amqp_correlation_id.filter(|c| !c.is_empty()))
            .unwrap_or_else(|| idempotency_key.clone());
        Identity {
            idempotency_key,
            correlation_id,
            event_type: self.first(&self.event_type_properties, props),
        }
    }

    /// Converts an event received from Event Hubs.
    pub fn event(&self, hub: &str, partition: &str, received: &ReceivedEventData) -> Event {
        let data = received.event_data();
        let properties: BTreeMap<String, String> = data
            .properties()
            .map(|p| {
                p.iter()
                    .map(|(k, v)| (k.clone(), simple_value_text(v)))
                    .collect()
            })
            .unwrap_or_default();
        let sequence_number = received.sequence_number().unwrap_or(-1);
        let identity = self.identify(
            &properties,
            data.correlation_id().map(message_id_text),
            hub,
            partition,
            sequence_number,
        );
        Event {
            body: data.body().map(<[u8]>::to_vec).unwrap_or_default(),
            content_type: data.content_type().map(String::from),
            properties,
            hub: hub.to_string(),
            partition_id: partition.to_string(),
            sequence_number,
            offset: received.offset().clone(),
            enqueued_ms: received
                .enqueued_time()
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as i64),
            partition_key: received.partition_key().clone(),
            identity,
        }
    }
}

/// A stable, collision-resistant stand-in for a key that does not fit a name with a length
/// limit (a Service Bus MessageId, 128 characters; a blob name, 1,024): `~` followed by the
/// hex SHA-256 of the key (65 characters). `~` starts no readable form — base64url names
/// never contain it, and readable MessageIds are only used for keys that do not start with
/// it — so a digest never equals a readable name. The readable key stays in the ledger
/// record, the status API, the CLI and the traces.
pub fn key_digest(key: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(key.as_bytes());
    let mut out = String::with_capacity(65);
    out.push('~');
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

impl Event {
    /// When Event Hubs enqueued it.
    pub fn enqueued_at(&self) -> Option<SystemTime> {
        self.enqueued_ms
            .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64))
    }
}

/// Who a deployment is: one consumer group of one hub in one namespace. Its messages and
/// records carry it, so deployments that share a retry queue, a dead-letter queue or a
/// container never run or drop each other's work ("Deployments never meet").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployment {
    /// A short, stable digest of the three names (see [`Deployment::new`]): what MessageIds
    /// carry.
    pub id: String,
    /// The Event Hubs namespace (the endpoint's host).
    pub namespace: String,
    /// The hub.
    pub hub: String,
    /// The consumer group.
    pub consumer_group: String,
}

/// Hex digits of a deployment id (48 bits of SHA-256: a collision between two deployments
/// that share one queue is a one-in-10^14 chance).
pub const DEPLOYMENT_ID_LEN: usize = 12;

impl Deployment {
    /// The deployment of `consumer_group` of `hub` in `namespace`. Its id is the first
    /// `DEPLOYMENT_ID_LEN` (12) hex digits of the SHA-256 of the three names, lower-cased:
    /// Event Hubs compares entity and consumer group names without case, and the official
    /// checkpoint stores lower-case them too.
    pub fn new(namespace: &str, hub: &str, consumer_group: &str) -> Self {
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(
            format!(
                "{}\n{}\n{}",
                namespace.to_ascii_lowercase(),
                hub.to_ascii_lowercase(),
                consumer_group.to_ascii_lowercase()
            )
            .as_bytes(),
        );
        let id: String = digest
            .iter()
            .take(DEPLOYMENT_ID_LEN / 2)
            .map(|b| format!("{b:02x}"))
            .collect();
        Self {
            id,
            namespace: namespace.to_string(),
            hub: hub.to_string(),
            consumer_group: consumer_group.to_string(),
        }
    }
}

impl std::fmt::Display for Deployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "consumer group {} of hub {} in {} (deployment {})",
            self.consumer_group, self.hub, self.namespace, self.id
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_key_is_scoped_by_the_cloudevents_source() {
        let c = IdentityConfig::default();
        let key = |kv: &[(&str, &str)]| c.identify(&props(kv), None, "h", "0", 1).idempotency_key;
        assert_eq!(key(&[("ce_id", "dup-2"), ("ce_source", "/a")]), "/a|dup-2");
        assert_ne!(
            key(&[("ce_id", "dup-2"), ("ce_source", "/a")]),
            key(&[("ce_id", "dup-2"), ("ce_source", "/b")])
        );
        // No source: the id alone, as before.
        assert_eq!(key(&[("ce_id", "dup-2")]), "dup-2");
        // Unambiguous even for a source that is not a valid URI.
        assert_ne!(
            key(&[("ce_id", "c"), ("ce_source", "a|b")]),
            key(&[("ce_id", "b|c"), ("ce_source", "a")])
        );
        let unscoped = IdentityConfig {
            key_source_properties: Vec::new(),
            ..IdentityConfig::default()
        };
        assert_eq!(
            unscoped
                .identify(
                    &props(&[("ce_id", "x"), ("ce_source", "/a")]),
                    None,
                    "h",
                    "0",
                    1
                )
                .idempotency_key,
            "x"
        );
    }

    #[test]
    fn cloudevents_attributes_win() {
        let c = IdentityConfig::default();
        let id = c.identify(
            &props(&[("ce_id", "order-42"), ("ce_type", "order.created")]),
            Some("amqp-corr".into()),
            "hub",
            "3",
            17,
        );
        assert_eq!(id.idempotency_key, "order-42");
        assert_eq!(id.correlation_id, "amqp-corr");
        assert_eq!(id.event_type.as_deref(), Some("order.created"));
        let id = c.identify(
            &props(&[("cloudEvents:id", "x"), ("correlation_id", "c-1")]),
            None,
            "hub",
            "3",
            17,
        );
        assert_eq!(
            (id.idempotency_key.as_str(), id.correlation_id.as_str()),
            ("x", "c-1")
        );
    }

    #[test]
    fn missing_properties_fall_back_to_the_position() {
        let id = IdentityConfig::default().identify(&BTreeMap::new(), None, "orders", "0", 99);
        assert_eq!(id.idempotency_key, "orders/0/99");
        assert_eq!(id.correlation_id, "orders/0/99");
        assert_eq!(id.event_type, None);
        // An empty attribute is as good as none.
        let id =
            IdentityConfig::default().identify(&props(&[("ce_id", " ")]), None, "orders", "0", 5);
        assert_eq!(id.idempotency_key, "orders/0/5");
    }

    #[test]
    fn binary_bodies_round_trip_through_json() {
        let e = Event {
            body: vec![0, 159, 146, 150, 255],
            content_type: None,
            properties: BTreeMap::new(),
            hub: "h".into(),
            partition_id: "0".into(),
            sequence_number: 1,
            offset: Some("10".into()),
            enqueued_ms: Some(5),
            partition_key: None,
            identity: IdentityConfig::default().identify(&BTreeMap::new(), None, "h", "0", 1),
        };
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<Event>(&json).unwrap(), e);
    }
}
