//! The HTTP stack under the legacy Service Bus crate: a pooled transport, the redirect to
//! the real endpoint, the error detail the crate drops, and Entra ID bearer tokens.

use super::classify::error_detail;
use async_trait::async_trait;
use azure_core::credentials::AccessToken;
use azure_core::credentials::TokenCredential;
use azure_core_legacy::headers::HeaderValue;
use azure_core_legacy::headers::Headers;
use azure_core_legacy::HttpClient;
use azure_core_legacy::Request;
use azure_core_legacy::Response;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use std::time::SystemTime;
use std::time::UNIX_EPOCH;

/// The legacy crate's transport, with connections kept alive between requests.
///
/// `azure_core` 0.21's own reqwest client turns the connection pool off
/// (`pool_max_idle_per_host(0)`, Azure/azure-sdk-for-rust#1550, a workaround for a hang
/// reported in hyperium/hyper#2312), so every Service Bus request — each receive, complete,
/// renew and send — opened a new TCP (and, on Azure, TLS) connection and closed it after one
/// response. The 1.x `azure_core` turned pooling back on by default for its performance.
/// hubguard puts a deadline on every Service Bus call ([`ServiceBusRetryQueue`](super::ServiceBusRetryQueue)), so a
/// request that hangs on a pooled connection fails at its deadline like any other, and is
/// retried. Response bodies are small (one message, or an error) and read whole.
#[derive(Debug, Clone)]
pub struct PooledHttpClient {
    http: reqwest::Client,
}

impl Default for PooledHttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl PooledHttpClient {
    /// A client with reqwest's default pool (idle connections closed after 90 s).
    pub fn new() -> Self {
        let http = reqwest::Client::builder()
            // Service Bus does not redirect; a 3xx is an answer, as with the crate's client.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Self { http }
    }
}

pub(super) fn transport_error(e: reqwest::Error) -> azure_core_legacy::Error {
    // reqwest's Display hides the cause; keep the chain (never the URL).
    let e = e.without_url();
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    azure_core_legacy::Error::message(azure_core_legacy::error::ErrorKind::Io, msg)
}

#[async_trait]
impl HttpClient for PooledHttpClient {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        use futures::AsyncReadExt as _;
        let other = |m: String| {
            azure_core_legacy::Error::message(azure_core_legacy::error::ErrorKind::Other, m)
        };
        let method = reqwest::Method::from_bytes(request.method().as_ref().as_bytes())
            .map_err(|e| other(format!("bad method: {e}")))?;
        let mut req = self.http.request(method, request.url().as_str());
        for (name, value) in request.headers().iter() {
            req = req.header(name.as_str(), value.as_str());
        }
        let body = match request.body() {
            azure_core_legacy::Body::Bytes(b) => b.clone(),
            azure_core_legacy::Body::SeekableStream(s) => {
                let mut s = s.clone();
                let mut buf = Vec::with_capacity(s.len());
                s.read_to_end(&mut buf)
                    .await
                    .map_err(|e| other(format!("reading the request body: {e}")))?;
                bytes::Bytes::from(buf)
            }
        };
        let resp = req.body(body).send().await.map_err(transport_error)?;
        let status = azure_core_legacy::StatusCode::try_from(resp.status().as_u16())
            .map_err(|_| other(format!("invalid status code {}", resp.status())))?;
        let headers: HashMap<_, _> = resp
            .headers()
            .iter()
            .filter_map(|(k, v)| {
                let v = v.to_str().ok()?;
                let v = if k.as_str() == "brokerproperties" {
                    readable_broker_properties(v)
                } else {
                    v.to_owned()
                };
                Some((
                    azure_core_legacy::headers::HeaderName::from(k.as_str().to_owned()),
                    HeaderValue::from(v),
                ))
            })
            .collect();
        let body = resp.bytes().await.map_err(transport_error)?;
        Ok(Response::new(
            status,
            Headers::from(headers),
            Box::pin(futures::stream::iter([Ok(body)])),
        ))
    }
}

/// A received message's `BrokerProperties` as the legacy crate can read them: the crate
/// requires an `EnqueuedTimeUtc` field (its `Option` has no serde default), which Azure's
/// answers have not always carried (the Node.js SDK's recordings of 2013, replayed in
/// tests/it/conformance_clients.rs, lack it), so a missing one is written as `null`, which
/// the crate reads as absent — hubguard's `enqueued_at` is `None` then, as it is optional.
/// Any other value passes unchanged.
fn readable_broker_properties(raw: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(serde_json::Value::Object(mut m)) if !m.contains_key("EnqueuedTimeUtc") => {
            m.insert("EnqueuedTimeUtc".into(), serde_json::Value::Null);
            serde_json::Value::Object(m).to_string()
        }
        _ => raw.to_owned(),
    }
}

/// An `HttpClient` for the legacy crate that sends every request (and every lock `Location`)
/// to a fixed endpoint, e.g. the local emulator, instead of `https://{ns}.servicebus.windows.net`.
#[derive(Debug)]
pub struct RedirectingHttpClient {
    scheme: String,
    host: String,
    port: Option<u16>,
    inner: Arc<dyn HttpClient>,
}

impl RedirectingHttpClient {
    /// Sends to `scheme://host[:port]`.
    pub fn new(scheme: &str, host: &str, port: Option<u16>) -> Self {
        Self {
            scheme: scheme.into(),
            host: host.into(),
            port,
            inner: Arc::new(PooledHttpClient::new()),
        }
    }
}

#[async_trait]
impl HttpClient for RedirectingHttpClient {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        let mut req = request.clone();
        let url = req.url_mut();
        let invalid = |what: &str| {
            azure_core_legacy::Error::message(
                azure_core_legacy::error::ErrorKind::Other,
                format!("cannot redirect the request: bad {what}"),
            )
        };
        url.set_scheme(&self.scheme)
            .map_err(|_| invalid("scheme"))?;
        url.set_host(Some(&self.host))
            .map_err(|_| invalid("host"))?;
        url.set_port(self.port).map_err(|_| invalid("port"))?;
        self.inner.execute_request(&req).await
    }
}

/// An `HttpClient` for the legacy crate that reports the `Date` of every Service Bus response
/// to the pipeline's clock (once it is given one), which measures Service Bus's time from them.
#[derive(Debug)]
pub(super) struct MeasuredHttpClient {
    inner: Arc<dyn HttpClient>,
    clock: Arc<std::sync::OnceLock<Arc<crate::clock::Clock>>>,
}

impl MeasuredHttpClient {
    /// Wraps `inner`; responses are measured on the clock `clock` holds when they arrive.
    pub(super) fn new(
        inner: Arc<dyn HttpClient>,
        clock: Arc<std::sync::OnceLock<Arc<crate::clock::Clock>>>,
    ) -> Self {
        Self { inner, clock }
    }
}

#[async_trait]
impl HttpClient for MeasuredHttpClient {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        let sent = self.clock.get().map(|c| c.sent());
        let response = self.inner.execute_request(request).await?;
        if let (Some(clock), Some(sent)) = (self.clock.get(), sent) {
            if let Some(date) = response
                .headers()
                .get_optional_str(&azure_core_legacy::headers::DATE)
            {
                clock.observe(crate::clock::Service::ServiceBus, sent, date);
            }
        }
        Ok(response)
    }
}

/// An `HttpClient` for the legacy crate that keeps what the service says about an error.
/// The crate drops the body of an error response (it looks for a JSON `code`; Service Bus
/// answers XML with a `<Detail>`), and that detail is the only way to tell "message too
/// large" from "quota exceeded" (both 403). Every error status becomes an
/// `HttpResponse` error carrying the detail as its error code.
#[derive(Debug)]
pub struct DetailedErrors {
    inner: Arc<dyn HttpClient>,
}

impl DetailedErrors {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn HttpClient>) -> Self {
        Self { inner }
    }
}

#[async_trait]
impl HttpClient for DetailedErrors {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        let response = self.inner.execute_request(request).await?;
        if u16::from(response.status()) < 400 {
            return Ok(response);
        }
        let (status, _headers, body) = response.deconstruct();
        let body = body.collect().await.unwrap_or_default();
        let detail = error_detail(&body);
        Err(azure_core_legacy::Error::message(
            azure_core_legacy::error::ErrorKind::HttpResponse {
                status,
                error_code: Some(detail),
            },
            format!("Service Bus answered {}", u16::from(status)),
        ))
    }
}

/// The scope of an Entra ID token for Service Bus's data plane ("Authenticate and authorize
/// an application with Microsoft Entra ID to access Azure Service Bus entities",
/// learn.microsoft.com).
pub const SERVICE_BUS_SCOPE: &str = "https://servicebus.azure.net/.default";

/// A cached token is replaced this long before it expires.
pub(super) const TOKEN_REFRESH_MARGIN: Duration = Duration::from_secs(300);

/// An `HttpClient` for the legacy crate that authenticates every request with an Entra ID
/// token (`Authorization: Bearer …` for [`SERVICE_BUS_SCOPE`]) instead of the SAS the crate
/// signs. The token is cached until `TOKEN_REFRESH_MARGIN` before it expires; one request
/// fetches it while the others wait. `Debug` never shows it, and a credential failure
/// becomes [`RetryQueueError::Credential`](super::RetryQueueError::Credential).
pub struct BearerTokenHttpClient {
    inner: Arc<dyn HttpClient>,
    credential: Arc<dyn TokenCredential>,
    cached: tokio::sync::Mutex<Option<AccessToken>>,
}

impl fmt::Debug for BearerTokenHttpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BearerTokenHttpClient")
            .field("inner", &self.inner)
            .field("scope", &SERVICE_BUS_SCOPE)
            .finish_non_exhaustive()
    }
}

impl BearerTokenHttpClient {
    /// Sends through `inner` with tokens from `credential`.
    pub fn new(inner: Arc<dyn HttpClient>, credential: Arc<dyn TokenCredential>) -> Self {
        Self {
            inner,
            credential,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    async fn authorization(&self) -> azure_core_legacy::Result<String> {
        let mut cached = self.cached.lock().await;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs() as i64;
        let fresh_enough = |t: &AccessToken| {
            t.expires_on.unix_timestamp() - TOKEN_REFRESH_MARGIN.as_secs() as i64 > now
        };
        if let Some(t) = cached.as_ref().filter(|t| fresh_enough(t)) {
            return Ok(format!("Bearer {}", t.token.secret()));
        }
        let token = self
            .credential
            .get_token(&[SERVICE_BUS_SCOPE], None)
            .await
            .map_err(|e| {
                azure_core_legacy::Error::message(
                    azure_core_legacy::error::ErrorKind::Credential,
                    format!("the credential could not get a token for {SERVICE_BUS_SCOPE}: {e}"),
                )
            })?;
        let header = format!("Bearer {}", token.token.secret());
        *cached = Some(token);
        Ok(header)
    }
}

#[async_trait]
impl HttpClient for BearerTokenHttpClient {
    async fn execute_request(&self, request: &Request) -> azure_core_legacy::Result<Response> {
        let authorization = self.authorization().await?;
        let mut req = request.clone();
        req.insert_header(
            azure_core_legacy::headers::AUTHORIZATION,
            HeaderValue::from(authorization),
        );
        self.inner.execute_request(&req).await
    }
}

#[cfg(test)]
mod broker_properties_tests {
    use super::readable_broker_properties;

    #[test]
    fn a_missing_enqueued_time_is_written_as_null_and_nothing_else_changes() {
        let azure_2013 = r#"{"DeliveryCount":1,"LockToken":"7165bfeb-2fab-4369-8293-ba71d1854282","SequenceNumber":1}"#;
        let v: serde_json::Value =
            serde_json::from_str(&readable_broker_properties(azure_2013)).unwrap();
        assert_eq!(v["EnqueuedTimeUtc"], serde_json::Value::Null);
        assert_eq!(v["SequenceNumber"], 1);
        let today = r#"{"DeliveryCount":1,"EnqueuedTimeUtc":"Wed, 02 Jul 2014 01:32:27 GMT"}"#;
        assert_eq!(readable_broker_properties(today), today);
        assert_eq!(readable_broker_properties("not json"), "not json");
    }
}
