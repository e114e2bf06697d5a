//! Where operational events go: a webhook (an HTTP POST of the CloudEvent in structured mode,
//! signed with Standard Webhooks headers as deliveries are) or a Service Bus queue or topic
//! (one message per event, its MessageId the event's id, so a repeat within the
//! duplicate-detection window is dropped). Each send has a deadline.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::azure::{OutgoingMessage, RetryQueue};
use crate::handler::secret::{Live, SecretSource};
use crate::handler::signing::SigningKeys;

/// Why an operational event was not sent, or a destination not built (never a secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OpsEventsError(pub String);

impl From<String> for OpsEventsError {
    fn from(message: String) -> Self {
        Self(message)
    }
}

/// The content type of a CloudEvent in structured mode, JSON format (CloudEvents HTTP
/// binding §3.2, <https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/bindings/http-protocol-binding.md>).
pub const CONTENT_TYPE: &str = "application/cloudevents+json; charset=utf-8";

/// A destination for operational events.
#[async_trait]
pub trait OpsEventsDestination: Send + Sync + 'static {
    /// Sends one CloudEvent; the error says why (never a secret).
    async fn send(&self, event: &serde_json::Value) -> Result<(), OpsEventsError>;
    /// Where it goes, for logs (no credentials).
    fn describe(&self) -> String;
}

/// A webhook.
pub struct WebhookDestination {
    url: reqwest::Url,
    client: reqwest::Client,
    signing: Option<Arc<Live<SigningKeys>>>,
}

impl WebhookDestination {
    /// POSTs to `url` within `timeout`, signed with the Standard Webhooks secrets at
    /// `signing` when given (`whsec_…`, as `handler.signing`).
    pub fn new(
        url: reqwest::Url,
        timeout: Duration,
        signing: Option<&SecretSource>,
    ) -> Result<Self, OpsEventsError> {
        let signing = signing
            .map(|s| {
                Live::load("operational_events.signing", s, |key, text| {
                    SigningKeys::parse(key, text).map_err(|e| e.to_string())
                })
                .map(Arc::new)
                .map_err(|e| OpsEventsError(e.to_string()))
            })
            .transpose()?;
        crate::azure::install_crypto_provider();
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| {
                OpsEventsError(format!(
                    "operational_events.url: cannot build the HTTP client: {e}"
                ))
            })?;
        Ok(Self {
            url,
            client,
            signing,
        })
    }
}

#[async_trait]
impl OpsEventsDestination for WebhookDestination {
    async fn send(&self, event: &serde_json::Value) -> Result<(), OpsEventsError> {
        let body = serde_json::to_vec(event).map_err(|e| OpsEventsError(e.to_string()))?;
        let mut req = self
            .client
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, CONTENT_TYPE);
        if let Some(keys) = &self.signing {
            let id = event["id"].as_str().unwrap_or_default();
            req = crate::handler::webhook::signed(req, keys, id, &body);
        }
        let resp = req.body(body).send().await.map_err(|e| {
            OpsEventsError(if e.is_timeout() {
                "no answer in time".to_string()
            } else {
                format!("cannot reach it: {}", crate::redact::redact(&e.to_string()))
            })
        })?;
        let status = resp.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(OpsEventsError(format!("HTTP {}", status.as_u16())))
        }
    }

    fn describe(&self) -> String {
        crate::redact::redact(self.url.as_str()).into_owned()
    }
}

/// A Service Bus queue or topic.
pub struct ServiceBusDestination {
    entity: Arc<dyn RetryQueue>,
    name: String,
    deadline: Duration,
}

impl ServiceBusDestination {
    /// Sends to `entity` (named `name`), each send within `deadline`.
    pub fn new(entity: Arc<dyn RetryQueue>, name: &str, deadline: Duration) -> Self {
        Self {
            entity,
            name: name.to_string(),
            deadline,
        }
    }
}

#[async_trait]
impl OpsEventsDestination for ServiceBusDestination {
    async fn send(&self, event: &serde_json::Value) -> Result<(), OpsEventsError> {
        let message = OutgoingMessage {
            message_id: event["id"].as_str().unwrap_or_default().to_string(),
            correlation_id: None,
            label: event["type"].as_str().map(str::to_string),
            body: event.to_string(),
            content_type: Some(CONTENT_TYPE.to_string()),
            due: SystemTime::UNIX_EPOCH,
            time_to_live: None,
            properties: vec![],
        };
        tokio::time::timeout(self.deadline, self.entity.schedule(message))
            .await
            .map_err(|_| OpsEventsError(format!("no answer within {:?}", self.deadline)))?
            .map_err(|e| OpsEventsError(e.to_string()))
    }

    fn describe(&self) -> String {
        format!("Service Bus entity {}", self.name)
    }
}
