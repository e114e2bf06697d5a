//! The CloudEvents abuse-protection handshake ("HTTP 1.1 Web Hooks for Event Delivery",
//! §4; the validation Event Grid performs): before the first delivery to an endpoint, and
//! again whenever the URL changes, hubguard sends `OPTIONS` with `WebHook-Request-Origin`;
//! it delivers only once the endpoint answers 2xx with `WebHook-Allowed-Origin` naming that
//! origin (or `*`), and then no faster than the `WebHook-Allowed-Rate` it granted (requests
//! per minute; `*` or absent: no limit).
//!
//! Until the endpoint agrees, every attempt fails as transient with the reason — the event
//! is retried on its policy (or paused by the breaker), never lost — the handshake is tried
//! again at most every `retry_ms`, and [`Handshake::blocked`] carries the reason for
//! readiness.

use std::time::Duration;

use serde::Deserialize;
use tokio::sync::{watch, Mutex};
use tokio::time::Instant;

use super::Failure;

/// `[handler.handshake]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandshakeConfig {
    /// Validate the endpoint before delivering (default off).
    #[serde(default)]
    pub enabled: bool,
    /// The `WebHook-Request-Origin` sent: the DNS name receivers allow (default `hubguard`).
    #[serde(default = "default_origin")]
    pub origin: String,
    /// How often a refused handshake is tried again (ms, default 10 s).
    #[serde(default = "default_retry_ms")]
    pub retry_ms: u64,
}

fn default_origin() -> String {
    "hubguard".into()
}
fn default_retry_ms() -> u64 {
    10_000
}

impl Default for HandshakeConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            origin: default_origin(),
            retry_ms: default_retry_ms(),
        }
    }
}

/// Spaces requests to at most `per_minute`.
#[derive(Debug, Clone)]
pub struct Pacer {
    interval: Duration,
    next: Option<Instant>,
}

impl Pacer {
    /// A pacer for `per_minute` requests a minute.
    pub fn new(per_minute: u32) -> Self {
        Self {
            interval: Duration::from_secs(60) / per_minute.max(1),
            next: None,
        }
    }

    /// Reserves the next slot at or after `now`, unless it is more than `max_wait` away:
    /// `Ok(wait)` then, else `Err(wait)` and nothing is reserved.
    pub fn reserve(&mut self, now: Instant, max_wait: Duration) -> Result<Duration, Duration> {
        let slot = self.next.map_or(now, |n| n.max(now));
        let wait = slot - now;
        if wait > max_wait {
            return Err(wait);
        }
        self.next = Some(slot + self.interval);
        Ok(wait)
    }
}

enum Agreement {
    Allowed {
        url: String,
        pacer: Option<Pacer>,
    },
    Refused {
        url: String,
        reason: String,
        at: Instant,
    },
}

impl std::fmt::Debug for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Allowed { url, pacer } => f
                .debug_struct("Allowed")
                .field("url", &crate::redact::redact(url))
                .field("pacer", pacer)
                .finish(),
            Self::Refused { url, reason, at } => f
                .debug_struct("Refused")
                .field("url", &crate::redact::redact(url))
                .field("reason", reason)
                .field("at", at)
                .finish(),
        }
    }
}

/// The handshake state of one webhook.
#[derive(Debug)]
pub struct Handshake {
    config: HandshakeConfig,
    state: Mutex<Option<Agreement>>,
    blocked: watch::Sender<Option<String>>,
    allowed_rate: watch::Sender<Option<f64>>,
}

impl Handshake {
    /// A handshake that has not run yet.
    pub fn new(config: HandshakeConfig) -> Self {
        Self {
            config,
            state: Mutex::new(None),
            blocked: watch::channel(None).0,
            allowed_rate: watch::channel(None).0,
        }
    }

    /// The rate the endpoint granted (`WebHook-Allowed-Rate`, per second; `None` while it
    /// granted none), as it changes: the pipeline holds the whole deployment to it.
    pub fn allowed_rate(&self) -> watch::Receiver<Option<f64>> {
        self.allowed_rate.subscribe()
    }

    /// Why deliveries are blocked (`None`: they are not), as it changes.
    pub fn blocked(&self) -> watch::Receiver<Option<String>> {
        self.blocked.subscribe()
    }

    /// Makes sure `url` agreed to receive, validating it first when needed, then waits for
    /// a slot under the granted rate (at most `max_wait`). `Err` is the failure to report.
    pub async fn ensure(
        &self,
        client: &reqwest::Client,
        url: &str,
        authorization: Option<&reqwest::header::HeaderValue>,
        max_wait: Duration,
    ) -> Result<(), Failure> {
        let wait = {
            let mut st = self.state.lock().await;
            let fresh = match &*st {
                Some(Agreement::Allowed { url: u, .. }) => u != url,
                Some(Agreement::Refused { url: u, reason, at }) if u == url => {
                    if at.elapsed() < Duration::from_millis(self.config.retry_ms) {
                        return Err(Failure::transient(reason.clone()));
                    }
                    true
                }
                _ => true,
            };
            if fresh {
                match self.validate(client, url, authorization).await {
                    Ok(rate) => {
                        tracing::info!(url = %crate::redact::redact(url), origin = %self.config.origin, rate = ?rate, "webhook agreed to receive (abuse-protection handshake)");
                        *st = Some(Agreement::Allowed {
                            url: url.to_string(),
                            pacer: rate.map(Pacer::new),
                        });
                        self.blocked.send_replace(None);
                        self.allowed_rate
                            .send_replace(rate.map(|per_minute| f64::from(per_minute) / 60.0));
                    }
                    Err(reason) => {
                        tracing::warn!(%reason, "webhook refused the abuse-protection handshake; not delivering");
                        *st = Some(Agreement::Refused {
                            url: url.to_string(),
                            reason: reason.clone(),
                            at: Instant::now(),
                        });
                        self.blocked.send_replace(Some(reason.clone()));
                        return Err(Failure::transient(reason));
                    }
                }
            }
            match &mut *st {
                Some(Agreement::Allowed { pacer: Some(p), .. }) => {
                    p.reserve(Instant::now(), max_wait).map_err(|wait| {
                        Failure::transient(format!(
                            "the webhook's WebHook-Allowed-Rate leaves no slot for {} ms",
                            wait.as_millis()
                        ))
                        .with_retry_after(Some(wait))
                    })?
                }
                _ => Duration::ZERO,
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        Ok(())
    }

    /// Sends the validation request: `Ok(rate per minute)` when the endpoint agreed.
    async fn validate(
        &self,
        client: &reqwest::Client,
        url: &str,
        authorization: Option<&reqwest::header::HeaderValue>,
    ) -> Result<Option<u32>, String> {
        let origin = &self.config.origin;
        let what = format!(
            "the webhook {} has not agreed to receive events from {origin} (CloudEvents abuse-protection handshake)",
            crate::redact::redact(url)
        );
        let mut req = client
            .request(reqwest::Method::OPTIONS, url)
            .header("WebHook-Request-Origin", origin.as_str());
        if let Some(a) = authorization {
            req = req.header(reqwest::header::AUTHORIZATION, a.clone());
        }
        let resp = req.send().await.map_err(|e| {
            format!(
                "{what}: OPTIONS failed: {}",
                super::webhook::without_url(&e)
            )
        })?;
        let status = resp.status().as_u16();
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_string())
        };
        let allowed = header("webhook-allowed-origin");
        let rate = header("webhook-allowed-rate");
        let ok = resp.status().is_success()
            && allowed
                .as_deref()
                .is_some_and(|a| a == "*" || a.eq_ignore_ascii_case(origin));
        if ok {
            return Ok(rate
                .as_deref()
                .and_then(|r| r.parse::<u32>().ok())
                .filter(|r| *r > 0));
        }
        let answer = match allowed {
            Some(a) => format!(
                "WebHook-Allowed-Origin: {}",
                super::webhook::sanitise(a.as_bytes(), 100)
            ),
            None => "no WebHook-Allowed-Origin".into(),
        };
        let body = resp.bytes().await.unwrap_or_default();
        let mut reason = format!("{what}: OPTIONS answered HTTP {status} with {answer}");
        if !body.is_empty() {
            reason.push_str(&format!(
                "; body: {}",
                super::webhook::sanitise(&body, super::webhook::BODY_EXCERPT)
            ));
        }
        Err(crate::redact::redact_owned(reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_pacer_spaces_requests_and_refuses_long_waits() {
        let mut p = Pacer::new(120); // one per 500 ms
        let t0 = Instant::now();
        let max = Duration::from_secs(1);
        assert_eq!(p.reserve(t0, max), Ok(Duration::ZERO));
        assert_eq!(p.reserve(t0, max), Ok(Duration::from_millis(500)));
        assert_eq!(p.reserve(t0, max), Ok(Duration::from_millis(1000)));
        assert_eq!(p.reserve(t0, max), Err(Duration::from_millis(1500)));
        // Nothing was reserved by the refusal.
        let later = t0 + Duration::from_millis(600);
        assert_eq!(p.reserve(later, max), Ok(Duration::from_millis(900)));
    }
}
