//! The webhook handler: HTTP POST of the event to a URL, as Event Grid delivers (seed 002).
//! 2xx within the timeout is delivered; 408, 429, 5xx, timeouts and connection errors are
//! transient; other 4xx permanent (409 configurable); a `Retry-After` is honoured.
//!
//! A redirect is not a delivery: hubguard never follows one (an HTTP client following a 301
//! or 302 turns the POST into a GET without the body, which the new URL may well answer
//! 200). The attempt fails as transient — the receiver moved, and the URL in the
//! configuration must follow it — with the status and the `Location` in the error.

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
            .redirect(reqwest::redirect::Policy::none())
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
            Ok(resp) if resp.status().is_redirection() => {
                let status = resp.status().as_u16();
                let location = resp
                    .headers()
                    .get("location")
                    .map(|v| location_for_log(&String::from_utf8_lossy(v.as_bytes())))
                    .unwrap_or_else(|| "none".into());
                Outcome::Failed(Failure::transient(format!(
                    "HTTP {status} redirect from the webhook (Location: {location}); hubguard does not follow redirects: point handler.url at the new location"
                )))
            }
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

/// The error text without the URL (which may carry credentials in its query), followed by
/// its causes ("error sending request: … connection reset by peer").
fn without_url(e: &reqwest::Error) -> String {
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
    text
}

/// A `Location` fit for an error message: without its query and fragment (which may carry
/// credentials), control characters removed, at most 200 characters.
fn location_for_log(location: &str) -> String {
    let cut = location.find(['?', '#']).unwrap_or(location.len());
    location[..cut]
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_location_is_logged_without_its_query() {
        assert_eq!(
            location_for_log("https://new.example/hook?sig=secret#x"),
            "https://new.example/hook"
        );
        assert_eq!(location_for_log("/moved\r\nX: y"), "/movedX: y");
    }
}
