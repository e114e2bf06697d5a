//! Where a namespace's REST API is.

use super::http::PooledHttpClient;
use super::http::RedirectingHttpClient;
use crate::azure::ConnectionString;
use azure_core_legacy::HttpClient;
use std::sync::Arc;

/// Why a configured namespace is not one hubguard can reach.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// A scheme other than `https`, `sb` or `http`.
    #[error(
        "unsupported scheme `{0}` (use a host name, or http://127.0.0.1:PORT for a local emulator)"
    )]
    Scheme(String),
    /// A user name or password (never quoted).
    #[error("a namespace is a host name, without a user name or password")]
    Credentials,
    /// Not a host.
    #[error("not a namespace host: {0}")]
    NotAHost(String),
    /// No host at all.
    #[error("no host")]
    NoHost,
    /// Plain `http` to a host that is not loopback.
    #[error("plain http is only for a local emulator (a loopback host, not {0}): use the namespace's host name")]
    PlainHttp(String),
}

/// Where a namespace's REST API is: `https://{namespace host}` for Azure, or plain
/// `http://host:port` for a local emulator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceBusEndpoint {
    /// `https`, or `http` for an emulator.
    pub scheme: String,
    /// The namespace's host (`myns.servicebus.windows.net`, `127.0.0.1`).
    pub host: String,
    /// The port, when not the scheme's default.
    pub port: Option<u16>,
}

impl ServiceBusEndpoint {
    /// Parses a namespace as configured: `myns.servicebus.windows.net` (also with `sb://` or
    /// `https://` and a trailing `/`), or `http://127.0.0.1:5380` for a local emulator. Plain
    /// `http` is allowed only to a loopback host: a bearer token must not cross a network
    /// unencrypted.
    pub fn parse(namespace: &str) -> Result<Self, EndpointError> {
        let s = namespace.trim();
        let (scheme, rest) = match s.split_once("://") {
            Some((sch, rest)) => (sch.to_ascii_lowercase(), rest),
            None => ("https".to_string(), s),
        };
        let scheme = match scheme.as_str() {
            "https" | "sb" => "https",
            "http" => "http",
            other => return Err(EndpointError::Scheme(other.to_string())),
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        // A host name: a user name or password has no place in it (and is never quoted).
        if authority.contains('@') {
            return Err(EndpointError::Credentials);
        }
        let url = url::Url::parse(&format!("{scheme}://{authority}"))
            .map_err(|e| EndpointError::NotAHost(e.to_string()))?;
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or(EndpointError::NoHost)?
            .to_string();
        if scheme == "http" {
            let loopback = host == "localhost"
                || host
                    .trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(EndpointError::PlainHttp(host));
            }
        }
        Ok(Self {
            scheme: scheme.into(),
            host,
            port: url.port(),
        })
    }

    pub(super) fn of_connection_string(connection: &ConnectionString) -> Self {
        Self {
            scheme: if connection.use_development_emulator {
                "http"
            } else {
                "https"
            }
            .into(),
            host: connection.host.clone(),
            port: connection.port,
        }
    }

    /// The namespace name the legacy crate builds `https://{name}.servicebus.windows.net`
    /// URLs from, and the HTTP client that sends them here. Only an Azure public-cloud
    /// namespace is reached without a redirect.
    pub(super) fn legacy_client(&self) -> (String, Arc<dyn HttpClient>) {
        match self.host.strip_suffix(".servicebus.windows.net") {
            Some(ns) if self.scheme == "https" && self.port.is_none() => {
                (ns.to_string(), Arc::new(PooledHttpClient::new()))
            }
            _ => (
                "emulator".into(),
                Arc::new(RedirectingHttpClient::new(
                    &self.scheme,
                    &self.host,
                    self.port,
                )),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_parse_and_plain_http_stays_local() {
        let e = ServiceBusEndpoint::parse("myns.servicebus.windows.net").unwrap();
        assert_eq!(
            (e.scheme.as_str(), e.host.as_str(), e.port),
            ("https", "myns.servicebus.windows.net", None)
        );
        let e = ServiceBusEndpoint::parse("sb://myns.servicebus.windows.net/").unwrap();
        assert_eq!(e.host, "myns.servicebus.windows.net");
        let e = ServiceBusEndpoint::parse("http://127.0.0.1:5380").unwrap();
        assert_eq!((e.scheme.as_str(), e.port), ("http", Some(5380)));
        assert!(ServiceBusEndpoint::parse("http://myns.servicebus.windows.net").is_err());
        assert!(ServiceBusEndpoint::parse("ftp://x").is_err());
        let e = ServiceBusEndpoint::parse("http://user:pa55word@127.0.0.1:5380")
            .unwrap_err()
            .to_string();
        assert!(e.contains("user name") && !e.contains("pa55word"), "{e}");
        assert!(ServiceBusEndpoint::parse("").is_err());
    }
}
