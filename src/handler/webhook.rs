//! The webhook handler: HTTP POST of the event to a URL, as Event Grid delivers
//! (learn.microsoft.com, "Event Grid message delivery and retry").
//! 2xx within the timeout is delivered; 408, 429, 5xx, timeouts and connection errors are
//! transient; other 4xx permanent (409 configurable); a `Retry-After` is honoured.
//!
//! A redirect is not a delivery: hubguard never follows one (an HTTP client following a 301
//! or 302 turns the POST into a GET without the body, which the new URL may well answer
//! 200). The attempt fails as transient — the receiver moved, and the URL in the
//! configuration must follow it — with the status and the `Location` in the error.
//!
//! What receivers already speak, each a per-webhook setting:
//! - the CloudEvents HTTP binding, binary or structured ([`super::cloudevents`]);
//! - Standard Webhooks signatures (`[handler.signing]`, [`super::signing`]);
//! - the abuse-protection handshake (`[handler.handshake]`, [`super::handshake`]);
//! - an `Authorization` value (`[handler.authorization]`) and a TLS client certificate
//!   (`[handler.tls]`), read from the environment or files, never from the configuration
//!   text, and never in an error, a log line or `Debug` output.
//!
//! A failed attempt's error keeps what support staff need: the status, `Retry-After` and the
//! first [`BODY_EXCERPT`] bytes of the response body, sanitised (control characters
//! dropped, invalid UTF-8 replaced).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use reqwest::header::HeaderValue;

use super::cloudevents::{self, ContentMode};
use super::handshake::{Handshake, HandshakeConfig};
use super::secret::{Live, SecretSource};
use super::signing::SigningKeys;
use super::{Attempt, Failure, Handler, Outcome};
use crate::event::Event;
use crate::policy::classify;

/// How much of a failed response's body an error keeps (bytes).
pub const BODY_EXCERPT: usize = 300;

/// `[handler.tls]`: a client certificate for receivers that require mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate (chain) file.
    pub client_cert_file: PathBuf,
    /// PEM private key file (PKCS#8, PKCS#1 or SEC1).
    pub client_key_file: PathBuf,
}

/// Webhook settings. `Debug` shows the URL through the redaction rule (`crate::redact`).
#[derive(Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Where to POST.
    pub url: String,
    /// The whole request must answer within this (default 10 s).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Treat 409 Conflict as permanent (default) or transient.
    #[serde(default = "yes")]
    pub conflict_is_permanent: bool,
    /// CloudEvents content mode for events that are CloudEvents: `binary` (default) or
    /// `structured`.
    #[serde(default)]
    pub content_mode: ContentMode,
    /// Standard Webhooks signing secrets (`whsec_…`, several for a rotation): where they are.
    #[serde(default)]
    pub signing: Option<SecretSource>,
    /// The `Authorization` header value (e.g. `Bearer …`): where it is.
    #[serde(default)]
    pub authorization: Option<SecretSource>,
    /// A TLS client certificate (mutual TLS).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// The CloudEvents abuse-protection handshake.
    #[serde(default)]
    pub handshake: HandshakeConfig,
    /// The longest `Retry-After` honoured (seconds; default: the policy's `cap_s`, which
    /// bounds it in any case). A longer one is shortened to this, and the attempt says so.
    #[serde(default)]
    pub retry_after_max_s: Option<u64>,
    /// Requests per second to the webhook for the whole deployment (every replica, first
    /// deliveries and retries together); `None`: no limit but the handshake's granted rate.
    #[serde(default)]
    pub rate_limit: Option<f64>,
    /// Lower the rate on 429, 503 and timeouts and pause on a 429's `Retry-After` (default
    /// on); off: `rate_limit` is a fixed cap.
    #[serde(default = "yes")]
    pub rate_limit_adaptive: bool,
    /// Events per request (default 1: each event alone). Above 1, the events in flight at
    /// once go out together as a CloudEvents JSON batch, each with its own outcome (see
    /// [`super::webhook_batch`]); `processor.max_in_flight` bounds how many are in flight.
    #[serde(default = "one")]
    pub batch_max: usize,
    /// Bytes per batch request, as the batch's JSON (default 1 MiB, Event Grid's batch
    /// bound); an event larger than this goes alone.
    #[serde(default = "default_batch_max_bytes")]
    pub batch_max_bytes: usize,
    /// How long an event waits for a batch to fill (ms; default 0: only the events already
    /// in hand go together). Only with `batch_max` above 1.
    #[serde(default)]
    pub batch_wait_ms: u64,
}

impl std::fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookConfig")
            .field("url", &crate::redact::redact(&self.url))
            .field("timeout_ms", &self.timeout_ms)
            .field("conflict_is_permanent", &self.conflict_is_permanent)
            .field("content_mode", &self.content_mode)
            .field("signing", &self.signing)
            .field("authorization", &self.authorization)
            .field("tls", &self.tls)
            .field("handshake", &self.handshake)
            .field("retry_after_max_s", &self.retry_after_max_s)
            .field("rate_limit", &self.rate_limit)
            .field("rate_limit_adaptive", &self.rate_limit_adaptive)
            .field("batch_max", &self.batch_max)
            .field("batch_max_bytes", &self.batch_max_bytes)
            .field("batch_wait_ms", &self.batch_wait_ms)
            .finish()
    }
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            timeout_ms: default_timeout_ms(),
            conflict_is_permanent: true,
            content_mode: ContentMode::default(),
            signing: None,
            authorization: None,
            tls: None,
            handshake: HandshakeConfig::default(),
            retry_after_max_s: None,
            rate_limit: None,
            rate_limit_adaptive: true,
            batch_max: 1,
            batch_max_bytes: default_batch_max_bytes(),
            batch_wait_ms: 0,
        }
    }
}

impl WebhookConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }
}

fn default_timeout_ms() -> u64 {
    10_000
}
fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn default_batch_max_bytes() -> usize {
    1 << 20
}

/// POSTs events to a URL.
#[derive(Debug, Clone)]
pub struct WebhookHandler {
    pub(super) client: reqwest::Client,
    pub(super) config: WebhookConfig,
    pub(super) signing: Option<Arc<Live<SigningKeys>>>,
    pub(super) authorization: Option<Arc<Live<HeaderValue>>>,
    handshake: Option<Arc<Handshake>>,
    /// The clock a `Retry-After` date is read against.
    pub(super) clock: Arc<crate::clock::Clock>,
}

/// What is wrong with a webhook's configuration: the configuration key it is about
/// (`handler.url`, `handler.tls`, `handler.signing`, …) and a message that names the key and
/// the file, never a secret's text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct WebhookConfigError {
    key: &'static str,
    message: String,
}

impl WebhookConfigError {
    fn new(key: &'static str, message: impl Into<String>) -> Self {
        Self {
            key,
            message: message.into(),
        }
    }

    /// The configuration key the problem is in.
    pub fn key(&self) -> &'static str {
        self.key
    }
}

fn parse_authorization(key: &str, text: &str) -> Result<HeaderValue, String> {
    let mut v = HeaderValue::from_str(text).map_err(|_| {
        format!("{key}: the value is not a valid header value (visible ASCII only)")
    })?;
    v.set_sensitive(true);
    Ok(v)
}

fn client_identity(tls: &TlsConfig) -> Result<reqwest::Identity, WebhookConfigError> {
    let read = |what: &str, p: &PathBuf| {
        std::fs::read(p).map_err(|e| {
            WebhookConfigError::new(
                "handler.tls",
                format!(
                    "handler.tls.{what}: cannot read {}: {}",
                    p.display(),
                    e.kind()
                ),
            )
        })
    };
    let mut pem = read("client_cert_file", &tls.client_cert_file)?;
    pem.push(b'\n');
    pem.extend(read("client_key_file", &tls.client_key_file)?);
    // The library's error could describe the key material: it is not passed on.
    reqwest::Identity::from_pem(&pem).map_err(|_| {
        WebhookConfigError::new(
            "handler.tls",
            format!(
                "handler.tls: {} and {} are not a PEM certificate and a PEM private key",
                tls.client_cert_file.display(),
                tls.client_key_file.display()
            ),
        )
    })
}

/// What a [`WebhookConfig`] loads before a handler can be built: the TLS identity and the
/// secrets, each read and parsed once.
struct Loaded {
    identity: Option<reqwest::Identity>,
    signing: Option<Arc<Live<SigningKeys>>>,
    authorization: Option<Arc<Live<HeaderValue>>>,
}

impl WebhookConfig {
    /// Checks what [`WebhookHandler::new`] would refuse, without building the handler: the
    /// URL, the TLS certificate and key, the secrets (read and parsed), the handshake's
    /// origin. Configuration validation calls it; wiring builds.
    pub fn check(&self) -> Result<(), WebhookConfigError> {
        self.load().map(drop)
    }

    fn load(&self) -> Result<Loaded, WebhookConfigError> {
        let url = reqwest::Url::parse(&self.url).map_err(|e| {
            WebhookConfigError::new("handler.url", format!("handler.url is not a URL: {e}"))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(WebhookConfigError::new(
                "handler.url",
                "handler.url must be an http or https URL",
            ));
        }
        let identity = self.tls.as_ref().map(client_identity).transpose()?;
        let signing = self
            .signing
            .as_ref()
            .map(|s| {
                Live::load("handler.signing", s, |key, text| {
                    SigningKeys::parse(key, text).map_err(|e| e.to_string())
                })
                .map(Arc::new)
                .map_err(|e| WebhookConfigError::new("handler.signing", e.to_string()))
            })
            .transpose()?;
        let authorization = self
            .authorization
            .as_ref()
            .map(|s| {
                Live::load("handler.authorization", s, parse_authorization)
                    .map(Arc::new)
                    .map_err(|e| WebhookConfigError::new("handler.authorization", e.to_string()))
            })
            .transpose()?;
        if !(1..=1000).contains(&self.batch_max) {
            return Err(WebhookConfigError::new(
                "handler.batch_max",
                "handler.batch_max must be between 1 and 1000 (1: each event alone)",
            ));
        }
        if self.batch_max_bytes < 1024 {
            return Err(WebhookConfigError::new(
                "handler.batch_max_bytes",
                "handler.batch_max_bytes must be at least 1024",
            ));
        }
        if self.batch_wait_ms > 10_000 {
            return Err(WebhookConfigError::new(
                "handler.batch_wait_ms",
                "handler.batch_wait_ms must be at most 10000",
            ));
        }
        if self.handshake.enabled && self.handshake.origin.trim().is_empty() {
            return Err(WebhookConfigError::new(
                "handler.handshake.origin",
                "handler.handshake.origin must not be empty",
            ));
        }
        Ok(Loaded {
            identity,
            signing,
            authorization,
        })
    }
}

impl WebhookHandler {
    /// A handler for `config`.
    pub fn new(config: WebhookConfig) -> Result<Self, WebhookConfigError> {
        let loaded = config.load()?;
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_millis(config.timeout_ms))
            .redirect(reqwest::redirect::Policy::none());
        if let Some(identity) = loaded.identity {
            builder = builder.identity(identity);
        }
        let client = builder.build().map_err(|e| match &config.tls {
            // The client reads the certificate and key here; its error could describe them.
            Some(tls) => WebhookConfigError::new(
                "handler.tls",
                format!(
                    "handler.tls: cannot use {} and {} as a client certificate and key",
                    tls.client_cert_file.display(),
                    tls.client_key_file.display()
                ),
            ),
            None => {
                WebhookConfigError::new("handler", format!("cannot build the HTTP client: {e}"))
            }
        })?;
        let handshake = config
            .handshake
            .enabled
            .then(|| Arc::new(Handshake::new(config.handshake.clone())));
        Ok(Self {
            client,
            config,
            signing: loaded.signing,
            authorization: loaded.authorization,
            handshake,
            clock: Arc::default(),
        })
    }

    /// Reads a `Retry-After` date against `clock` (the pipeline's) instead of the wall clock.
    pub fn with_clock(mut self, clock: Arc<crate::clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The handler the pipeline calls: this one, or with `batch_max` above 1 this one
    /// sending the events in flight at once in batches ([`super::batch::Batched`]).
    pub fn into_handler(self) -> Arc<dyn Handler> {
        if self.config.batch_max <= 1 {
            return Arc::new(self);
        }
        let limits = super::batch::BatchLimits {
            max_events: self.config.batch_max,
            max_bytes: self.config.batch_max_bytes,
            wait: Duration::from_millis(self.config.batch_wait_ms),
        };
        Arc::new(super::batch::Batched::new(self, limits))
    }
}

/// Keeps the first `limit` bytes of `bytes` as text fit for an error: invalid UTF-8
/// replaced, line breaks and tabs as spaces, other control characters dropped, `…` when cut.
pub fn sanitise(bytes: &[u8], limit: usize) -> String {
    let cut = bytes.len() > limit;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(limit)]);
    let mut out: String = text
        .chars()
        .filter_map(|c| match c {
            '\n' | '\r' | '\t' => Some(' '),
            c if c.is_control() => None,
            c => Some(c),
        })
        .collect();
    out = out.trim().to_string();
    if cut {
        out.push('…');
    }
    out
}

/// Reads at most `limit` bytes of a response body (the rest is not downloaded).
pub(super) async fn body_excerpt(resp: &mut reqwest::Response, limit: usize) -> (Vec<u8>, bool) {
    let mut buf = Vec::new();
    while buf.len() <= limit {
        match resp.chunk().await {
            Ok(Some(c)) => buf.extend_from_slice(&c),
            _ => return (buf, false),
        }
    }
    (buf, true)
}

/// The error of a failed (non-2xx, non-redirect) answer: status, `Retry-After` and the
/// start of the body, e.g. `HTTP 503 from the webhook; Retry-After: 30; body: {"error":…}`.
async fn failure_text(
    status: u16,
    retry_after: Option<&str>,
    resp: &mut reqwest::Response,
) -> String {
    let mut text = format!("HTTP {status} from the webhook");
    if let Some(ra) = retry_after {
        text.push_str(&format!("; Retry-After: {}", sanitise(ra.as_bytes(), 64)));
    }
    let (body, more) = body_excerpt(resp, BODY_EXCERPT).await;
    if !body.is_empty() {
        let mut excerpt = sanitise(&body, BODY_EXCERPT);
        if more && !excerpt.ends_with('…') {
            excerpt.push('…');
        }
        text.push_str(&format!("; body: {excerpt}"));
    }
    // A receiver may echo what it was sent (an Authorization value, a URL's query).
    crate::redact::redact_owned(text)
}

/// Characters a key header value carries percent-encoded: controls, space (a header value's
/// edges are trimmed), `%` itself — so an encoded key never equals a literal one — and every
/// non-ASCII byte (always encoded).
const KEY_ENCODED: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b' ').add(b'%');

/// A key as a header value: as it is when it is printable ASCII without spaces or `%`, else
/// percent-encoded (RFC 3986 style, UTF-8). Unambiguous: `café` goes as `caf%C3%A9`, and a
/// literal `caf%C3%A9` as `caf%25C3%25A9`; a `-` stays a `-`.
fn key_header_value(value: &str) -> String {
    super::percent_encode(value, KEY_ENCODED)
}

/// Header names must be tokens and values visible ASCII; anything else is left out.
/// The downstream's name for a webhook URL (the breaker's and the storm guard's): its host
/// (and port).
pub(crate) fn downstream_of(url: &str) -> String {
    reqwest::Url::parse(url)
        .ok()
        .map(|u| match (u.host_str(), u.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            _ => "webhook".into(),
        })
        .unwrap_or_else(|| "webhook".into())
}

fn header_safe(name: &str, value: &str) -> bool {
    super::is_field_name(name) && value.bytes().all(|b| (0x20..0x7f).contains(&b))
}

#[async_trait]
impl Handler for WebhookHandler {
    /// The breaker's name for a webhook: its host (and port).
    fn downstream(&self) -> String {
        downstream_of(&self.config.url)
    }

    fn blocked(&self) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        self.handshake.as_ref().map(|h| h.blocked())
    }

    fn allowed_rate(&self) -> Option<tokio::sync::watch::Receiver<Option<f64>>> {
        self.handshake.as_ref().map(|h| h.allowed_rate())
    }

    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let authorization = self.authorization.as_ref().map(|a| a.get());
        if let Err(f) = self.ensure_handshake(authorization.as_deref()).await {
            return Outcome::Failed(f);
        }
        let req = self.request(event, attempt, authorization.as_deref());
        self.outcome(req.send().await).await
    }
}

impl WebhookHandler {
    /// The abuse-protection handshake alone, as `hubguard check` proves it before any
    /// delivery: `Ok(false)` when the handshake is off, `Err` with why the webhook refused.
    #[cfg(feature = "cli")]
    pub(crate) async fn handshake_now(&self) -> Result<bool, String> {
        if self.handshake.is_none() {
            return Ok(false);
        }
        let authorization = self.authorization.as_ref().map(|a| a.get());
        self.ensure_handshake(authorization.as_deref())
            .await
            .map(|()| true)
            .map_err(|f| f.error)
    }

    /// With the handshake on, waits until the webhook has agreed to take deliveries (or
    /// fails the attempt).
    pub(super) async fn ensure_handshake(
        &self,
        authorization: Option<&HeaderValue>,
    ) -> Result<(), Failure> {
        if let Some(h) = &self.handshake {
            h.ensure(
                &self.client,
                &self.config.url,
                authorization,
                Duration::from_millis(self.config.timeout_ms),
            )
            .await?;
        }
        Ok(())
    }

    /// The POST that delivers `event`: its CloudEvents encoding, hubguard's headers, the
    /// keys, the signature and the authorization.
    fn request(
        &self,
        event: &Event,
        attempt: &Attempt,
        authorization: Option<&HeaderValue>,
    ) -> reqwest::RequestBuilder {
        let encoded = cloudevents::encode(event, self.config.content_mode);
        let mut req = self
            .client
            .post(&self.config.url)
            .header("content-type", &encoded.content_type)
            .header("traceparent", &attempt.traceparent)
            .header("x-hubguard-attempt", attempt.number.to_string())
            .header("x-hubguard-partition", &event.partition_id)
            .header(
                "x-hubguard-sequence-number",
                event.sequence_number.to_string(),
            );
        let mut webhook_id = String::new();
        for (name, value) in [
            ("idempotency-key", &event.identity.idempotency_key),
            ("x-hubguard-correlation-id", &event.identity.correlation_id),
        ] {
            let value = key_header_value(value);
            if name == "idempotency-key" {
                webhook_id = value.clone();
            }
            req = req.header(name, value);
        }
        for (name, value) in &encoded.headers {
            if header_safe(name, value) {
                req = req.header(name.as_str(), value.as_str());
            }
        }
        if let Some(keys) = &self.signing {
            req = signed(req, keys, &webhook_id, &encoded.body);
        }
        if let Some(a) = authorization {
            req = req.header(reqwest::header::AUTHORIZATION, HeaderValue::clone(a));
        }
        req.body(encoded.body)
    }

    /// What the webhook's answer (or the failure to get one) comes to.
    pub(super) async fn outcome(&self, sent: Result<reqwest::Response, reqwest::Error>) -> Outcome {
        match sent {
            Ok(resp) if resp.status().is_success() => Outcome::Delivered,
            Ok(resp) if resp.status().is_redirection() => Outcome::Failed(redirect_failure(&resp)),
            Ok(resp) => Outcome::Failed(self.refusal(resp).await),
            Err(e) if e.is_timeout() => Outcome::Failed(Failure::timeout(format!(
                "the webhook did not answer within {} ms",
                self.config.timeout_ms
            ))),
            Err(e) => Outcome::Failed(Failure::transient(format!(
                "webhook unreachable: {}",
                without_url(&e)
            ))),
        }
    }

    /// The failure for an error status: classified by status, with the webhook's
    /// `Retry-After` and (the start of) its body.
    async fn refusal(&self, mut resp: reqwest::Response) -> Failure {
        let status = resp.status().as_u16();
        let retry_after_raw = resp
            .headers()
            .get("retry-after")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).to_string());
        let retry_after = retry_after_raw
            .as_deref()
            .and_then(|v| classify::retry_after(v, self.clock.now()));
        let class = classify::http_status(status, self.config.conflict_is_permanent);
        let error = failure_text(status, retry_after_raw.as_deref(), &mut resp).await;
        Failure {
            class,
            error,
            retry_after,
            http_status: Some(status),
            retry_after_max: self.config.retry_after_max_s.map(Duration::from_secs),
            timed_out: false,
        }
    }
}

/// Adds the Standard Webhooks signature headers for `body` to `req` (batches and operational
/// events are signed the same way).
pub(crate) fn signed(
    req: reqwest::RequestBuilder,
    keys: &Live<SigningKeys>,
    webhook_id: &str,
    body: &[u8],
) -> reqwest::RequestBuilder {
    // Standard Webhooks: the id is stable across retries (the idempotency key).
    let timestamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default();
    let signature = keys.get().sign(webhook_id, timestamp, body);
    req.header("webhook-id", webhook_id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
}

/// A redirect is not followed: a transient failure that names where it points.
fn redirect_failure(resp: &reqwest::Response) -> Failure {
    let status = resp.status().as_u16();
    let location = resp
        .headers()
        .get("location")
        .map(|v| location_for_log(&String::from_utf8_lossy(v.as_bytes())))
        .unwrap_or_else(|| "none".into());
    Failure::transient(format!(
        "HTTP {status} redirect from the webhook (Location: {location}); hubguard does not follow redirects: point handler.url at the new location"
    ))
    .with_http_status(status)
}

/// The error text without the URL, followed by its causes ("error sending request: …
/// connection reset by peer"), through the one redaction rule ([`crate::redact`]): a cause
/// can quote a URL too.
pub(crate) fn without_url(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(i) = text.find(" for url (") {
        text.truncate(i);
    }
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text.push_str(": ");
            text.push_str(&c_text);
        }
        cause = c.source();
    }
    crate::redact::redact_owned(text)
}

/// A `Location` fit for an error message: its userinfo and the values of its query and
/// fragment masked ([`crate::redact`]: they may carry credentials), control characters
/// removed, at most 200 characters.
fn location_for_log(location: &str) -> String {
    let clean: String = location.chars().filter(|c| !c.is_control()).collect();
    crate::redact::redact(&clean).chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_settings_out_of_bounds_are_refused_naming_the_key() {
        let ok = WebhookConfig::new("http://127.0.0.1:9/e");
        assert!(ok.check().is_ok());
        for (bad, key) in [
            (
                WebhookConfig {
                    batch_max: 0,
                    ..ok.clone()
                },
                "handler.batch_max",
            ),
            (
                WebhookConfig {
                    batch_max: 1001,
                    ..ok.clone()
                },
                "handler.batch_max",
            ),
            (
                WebhookConfig {
                    batch_max_bytes: 10,
                    ..ok.clone()
                },
                "handler.batch_max_bytes",
            ),
            (
                WebhookConfig {
                    batch_wait_ms: 60_000,
                    ..ok.clone()
                },
                "handler.batch_wait_ms",
            ),
        ] {
            let e = bad.check().unwrap_err();
            assert_eq!(e.key(), key);
            assert!(e.to_string().contains(key), "{e}");
        }
    }

    #[test]
    fn keys_in_headers_are_unambiguous() {
        assert_eq!(key_header_value("order-42"), "order-42");
        assert_eq!(key_header_value("café"), "caf%C3%A9");
        assert_eq!(key_header_value("caf%C3%A9"), "caf%25C3%25A9");
        assert_ne!(key_header_value(" a"), key_header_value("a"));
        assert_eq!(key_header_value("/a|dup-2"), "/a|dup-2");
    }

    #[test]
    fn a_location_is_logged_without_its_credentials() {
        assert_eq!(
            location_for_log("https://user:pw@new.example/hook?sig=secret#x"),
            "https://***@new.example/hook?sig=***"
        );
        assert_eq!(location_for_log("/moved\r\nX: y"), "/movedX: y");
    }
}
