//! Event Hubs / Service Bus connection strings:
//! `Endpoint=sb://HOST[:PORT][/];SharedAccessKeyName=NAME;SharedAccessKey=KEY[;EntityPath=HUB][;UseDevelopmentEmulator=true]`.
//!
//! Keys are case-insensitive, as in every official SDK. `Debug` never shows the key, and no
//! error message quotes the input.

use std::fmt;
use std::str::FromStr;

use super::sas::SasKey;

/// Why a connection string was refused. Never includes the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectionStringError {
    /// A required key is absent.
    #[error("connection string has no {0}")]
    Missing(&'static str),
    /// A segment is not `Key=Value`.
    #[error("connection string segment {0} is not of the form Key=Value")]
    Malformed(usize),
    /// The endpoint is not an `sb://host[:port]` URL.
    #[error("connection string Endpoint must look like sb://host[:port]: {0}")]
    BadEndpoint(String),
}

/// A parsed connection string.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnectionString {
    /// Host name of the namespace (`ns.servicebus.windows.net`, `127.0.0.1`).
    pub host: String,
    /// Port given in the endpoint, if any.
    pub port: Option<u16>,
    /// `EntityPath` (the hub or queue), if given.
    pub entity_path: Option<String>,
    /// The shared access key.
    pub key: SasKey,
    /// `UseDevelopmentEmulator=true`: plain AMQP (no TLS) to the endpoint's port.
    pub use_development_emulator: bool,
}

impl fmt::Debug for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionString")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("entity_path", &self.entity_path)
            .field("key", &self.key)
            .field("use_development_emulator", &self.use_development_emulator)
            .finish()
    }
}

impl FromStr for ConnectionString {
    type Err = ConnectionStringError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (mut endpoint, mut key_name, mut key, mut entity, mut emulator) =
            (None, None, None, None, false);
        for (i, segment) in s.split(';').enumerate() {
            let segment = segment.trim();
            if segment.is_empty() {
                continue;
            }
            let (k, v) = segment
                .split_once('=')
                .ok_or(ConnectionStringError::Malformed(i + 1))?;
            let v = v.trim();
            match k.trim().to_ascii_lowercase().as_str() {
                "endpoint" => endpoint = Some(v.to_string()),
                "sharedaccesskeyname" => key_name = Some(v.to_string()),
                "sharedaccesskey" => key = Some(v.to_string()),
                "entitypath" => entity = Some(v.to_string()).filter(|e| !e.is_empty()),
                "usedevelopmentemulator" => emulator = v.eq_ignore_ascii_case("true"),
                _ => {}
            }
        }
        let endpoint = endpoint.ok_or(ConnectionStringError::Missing("Endpoint"))?;
        // The endpoint is quoted in errors only through the one redaction rule.
        let bad = || ConnectionStringError::BadEndpoint(crate::redact::redacted(&endpoint));
        let rest = endpoint.split_once("://").map(|(_, r)| r).ok_or_else(bad)?;
        let authority = rest.split('/').next().unwrap_or("");
        // `sb://host`: a user name or password has no place in it (the key is the
        // SharedAccessKey), and would be shown wherever the namespace is named.
        if authority.contains('@') {
            return Err(bad());
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p.parse::<u16>().map_err(|_| bad())?)),
            None => (authority.to_string(), None),
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            host,
            port,
            entity_path: entity,
            key: SasKey::new(
                key_name.ok_or(ConnectionStringError::Missing("SharedAccessKeyName"))?,
                key.ok_or(ConnectionStringError::Missing("SharedAccessKey"))?,
            ),
            use_development_emulator: emulator,
        })
    }
}

impl ConnectionString {
    /// `host[:port]`, the namespace as the Event Hubs clients name it in link addresses.
    pub fn namespace(&self) -> String {
        match self.port {
            Some(p) => format!("{}:{p}", self.host),
            None => self.host.clone(),
        }
    }

    /// The AMQP endpoint to dial: plain `amqp://` for the development emulator (port 5672 when
    /// none is given), else `None` (the SDK's default TLS endpoint for the namespace).
    pub fn custom_endpoint(&self) -> Option<String> {
        self.use_development_emulator
            .then(|| format!("amqp://{}:{}", self.host, self.port.unwrap_or(5672)))
    }

    /// The connection string as `azure_messaging_eventhubs` parses it (`Endpoint`, key name
    /// and key; hubguard's own keys left out). A secret: never log it.
    pub fn sdk_connection_string(&self) -> String {
        format!(
            "Endpoint=sb://{}/;SharedAccessKeyName={};SharedAccessKey={}",
            self.namespace(),
            self.key.name(),
            self.key.secret()
        )
    }

    /// Opens a consumer for `hub` with the SDK's own connection-string credential, which
    /// presents its SAS tokens as `servicebus.windows.net:sastoken` (what Azure requires), to
    /// the emulator's endpoint when `UseDevelopmentEmulator=true`. The SDK names the namespace
    /// by the endpoint's host (no port).
    pub async fn open_consumer(
        &self,
        builder: azure_messaging_eventhubs::builders::ConsumerClientBuilder,
        hub: &str,
    ) -> azure_messaging_eventhubs::Result<azure_messaging_eventhubs::ConsumerClient> {
        super::install_crypto_provider();
        let builder = match self.custom_endpoint() {
            Some(e) => builder.with_custom_endpoint(e),
            None => builder,
        };
        builder
            .open_with_connection_string(&self.sdk_connection_string(), Some(hub))
            .await
    }

    /// Opens a producer for `hub`, as [`open_consumer`](Self::open_consumer) does.
    pub async fn open_producer(
        &self,
        builder: azure_messaging_eventhubs::builders::ProducerClientBuilder,
        hub: &str,
    ) -> azure_messaging_eventhubs::Result<azure_messaging_eventhubs::ProducerClient> {
        super::install_crypto_provider();
        let builder = match self.custom_endpoint() {
            Some(e) => builder.with_custom_endpoint(e),
            None => builder,
        };
        builder
            .open_with_connection_string(&self.sdk_connection_string(), Some(hub))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_emulator_form() {
        let cs: ConnectionString = "Endpoint=sb://127.0.0.1:5673;SharedAccessKeyName=k;SharedAccessKey=s3cret;UseDevelopmentEmulator=true"
            .parse()
            .unwrap();
        assert_eq!(cs.host, "127.0.0.1");
        assert_eq!(cs.port, Some(5673));
        assert_eq!(
            cs.custom_endpoint().as_deref(),
            Some("amqp://127.0.0.1:5673")
        );
        assert_eq!(cs.namespace(), "127.0.0.1:5673");
        assert!(!format!("{cs:?}").contains("s3cret"));
    }

    #[test]
    fn keys_are_case_insensitive_and_entity_path_is_kept() {
        let cs: ConnectionString = "endpoint=sb://ns.servicebus.windows.net/;sharedaccesskeyname=k;sharedaccesskey=v;EntityPath=orders"
            .parse()
            .unwrap();
        assert_eq!(cs.host, "ns.servicebus.windows.net");
        assert_eq!(cs.port, None);
        assert_eq!(cs.entity_path.as_deref(), Some("orders"));
        assert_eq!(cs.custom_endpoint(), None);
    }

    #[test]
    fn errors_name_the_problem_without_the_secret() {
        let e = "Endpoint=sb://h;SharedAccessKeyName=k"
            .parse::<ConnectionString>()
            .unwrap_err();
        assert_eq!(e, ConnectionStringError::Missing("SharedAccessKey"));
        let e = "SharedAccessKey=topsecret;Endpoint=h"
            .parse::<ConnectionString>()
            .unwrap_err();
        assert!(matches!(e, ConnectionStringError::BadEndpoint(_)));
        assert!(!e.to_string().contains("topsecret"));
        let e = "Endpoint=sb://h;garbage"
            .parse::<ConnectionString>()
            .unwrap_err();
        assert_eq!(e, ConnectionStringError::Malformed(2));
    }

    #[test]
    fn an_endpoint_with_a_password_is_refused_without_quoting_it() {
        for cs in [
            "Endpoint=sb://user:pa55word@127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=v",
            "Endpoint=sb://pa55word@ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=v",
            "Endpoint=sb://u:pa55word@h:notaport;SharedAccessKeyName=k;SharedAccessKey=v",
        ] {
            let e = cs.parse::<ConnectionString>().unwrap_err();
            assert!(matches!(e, ConnectionStringError::BadEndpoint(_)), "{cs}");
            assert!(!e.to_string().contains("pa55word"), "{e}");
        }
    }
}
