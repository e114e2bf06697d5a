//! The webhook handler: HTTP POST of the event to a URL, as Event Grid delivers (seed 002).
//! 2xx within the timeout is delivered; 408, 429, 5xx, timeouts and connection errors are
//! transient; other 4xx permanent (409 configurable); a `Retry-After` is honoured.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use super::{Attempt, Failure, Handler, Outcome};
use crate::event::Event;
use crate::policy::classify::{self, ErrorClass};

/// Webhook settings.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
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
}

fn default_timeout_ms() -> u64 {
    10_000
}
fn yes() -> bool {
    true
}

/// POSTs events to a URL.
#[derive(Debug, Clone)]
pub struct WebhookHandler {
    client: reqwest::Client,
    config: WebhookConfig,
}

impl WebhookHandler {
    /// A handler for `config`.
    pub fn new(config: WebhookConfig) -> Result<Self, String> {
        let url = reqwest::Url::parse(&config.url)
            .map_err(|e| format!("handler.url is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err("handler.url must be an http or https URL".into());
        }
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(config.timeout_ms))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Self { client, config })
    }
}

/// Header names must be tokens and values visible ASCII; anything else is left out.
fn header_safe(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && value.bytes().all(|b| (0x20..0x7f).contains(&b))
}

#[async_trait]
impl Handler for WebhookHandler {
    /// The breaker's name for a webhook: its host (and port).
    fn downstream(&self) -> String {
        reqwest::Url::parse(&self.config.url)
            .ok()
            .map(|u| match (u.host_str(), u.port()) {
                (Some(h), Some(p)) => format!("{h}:{p}"),
                (Some(h), None) => h.to_string(),
                _ => "webhook".into(),
            })
            .unwrap_or_else(|| "webhook".into())
    }

    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let mut req = self
            .client
            .post(&self.config.url)
            .header(
                "content-type",
                event
                    .content_type
                    .as_deref()
                    .unwrap_or("application/octet-stream"),
            )
            .header("traceparent", &attempt.traceparent)
            .header("x-hubguard-attempt", attempt.number.to_string())
            .header("x-hubguard-partition", &event.partition_id)
            .header(
                "x-hubguard-sequence-number",
                event.sequence_number.to_string(),
            );
        for (name, value) in [
            ("idempotency-key", &event.identity.idempotency_key),
            ("x-hubguard-correlation-id", &event.identity.correlation_id),
        ] {
            if header_safe(name, value) {
                req = req.header(name, value);
            } else {
                // Keys with characters a header cannot carry go percent-encoded.
                req = req.header(
                    name,
                    percent_encoding::utf8_percent_encode(
                        value,
                        percent_encoding::NON_ALPHANUMERIC,
                    )
                    .to_string(),
                );
            }
        }
        if let Some(t) = &event.identity.event_type {
            if header_safe("ce-type", t) {
                req = req.header("ce-type", t);
            }
        }
        match req.body(event.body.clone()).send().await {
            Ok(resp) if resp.status().is_success() => Outcome::Delivered,
            Ok(resp) => {
                let status = resp.status().as_u16();
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| classify::retry_after(v, SystemTime::now()));
                let class = classify::http_status(status, self.config.conflict_is_permanent);
                Outcome::Failed(Failure {
                    class,
                    error: format!("HTTP {status} from the webhook"),
                    retry_after,
                })
            }
            Err(e) if e.is_timeout() => Outcome::Failed(Failure::transient(format!(
                "the webhook did not answer within {} ms",
                self.config.timeout_ms
            ))),
            Err(e) => Outcome::Failed(Failure {
                class: ErrorClass::Transient,
                error: format!("webhook unreachable: {}", without_url(&e)),
                retry_after: None,
            }),
        }
    }
}

/// The error text without the URL (which may carry credentials in its query).
fn without_url(e: &reqwest::Error) -> String {
    let mut e = e.to_string();
    if let Some(i) = e.find(" for url (") {
        e.truncate(i);
    }
    e
}
