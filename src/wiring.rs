//! Wiring: from where the services are (connection strings, a container URL, Entra ID
//! credentials) to the clients, stores and [`PipelineParts`] the pipeline runs on. One home,
//! used by `hubguard run` (through [`Wiring::from_config`]), the demo, the bench and the
//! tests (through [`Wiring::new`] and its setters), so the parts cannot be assembled five
//! different ways.
//!
//! [`config`](crate::config) only reads and validates; nothing there opens a client.

use std::sync::Arc;
use std::time::Duration;

use azure_core::credentials::TokenCredential;
use azure_messaging_eventhubs::CheckpointStore;

use crate::azure::retry_queue::{prove_queue, QueueNeeds, ServiceBusOptions};
use crate::azure::{
    BlobCheckpointStore, BlobRecordStore, ConnectionString, EventHubsAuth, RecordStore, RetryQueue,
    ServiceBusRetryQueue,
};
use crate::breaker::BreakerConfig;
use crate::config::{Access, Config, CredentialKind};
use crate::event::IdentityConfig;
use crate::handler::Handler;
#[cfg(any(test, feature = "cli"))]
use crate::ledger::Ledger;
use crate::pipeline::dead_letter::DeadLetterDestination;
use crate::pipeline::settle::Policies;
#[cfg(any(test, feature = "cli"))]
use crate::pipeline::settle::Settler;
use crate::pipeline::{EventHubsTarget, PipelineOptions, PipelineParts};
use crate::policy::RetryPolicy;

/// What could not be wired. Every message names the configuration key it came from, never a
/// secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WiringError {
    /// An Entra ID credential could not be created (`what`: which one, as the user knows it).
    #[error("configuration: {what}: {reason}")]
    Credential {
        /// The credential's kind.
        kind: CredentialKind,
        /// Its name in messages (`managed identity`, `client_secret credential`, …).
        what: String,
        /// Why.
        reason: String,
    },
    /// A client could not be built from the value at `key` (a URL, a connection string, a
    /// namespace).
    #[error("configuration: {key}: {reason}")]
    Client {
        /// The configuration key (`storage.container_url`, `servicebus`, …).
        key: String,
        /// Why.
        reason: String,
    },
    /// The retry queue exists but cannot keep hubguard's promise (its description names the
    /// property and the value needed).
    #[error("configuration: servicebus.queue: {0}")]
    QueueRefused(#[from] crate::azure::retry_queue::QueueRefusal),
}

impl WiringError {
    /// A section that does not say how to reach its namespace (see [`Access`]).
    fn config(e: crate::config::ConfigError) -> Self {
        let key = e.key().unwrap_or("configuration").to_string();
        match e {
            crate::config::ConfigError::Invalid { message, .. } => Self::Client {
                key,
                reason: message,
            },
            other => Self::client(&key, other),
        }
    }

    fn client(key: &str, reason: impl std::fmt::Display) -> Self {
        Self::Client {
            key: key.into(),
            reason: reason.to_string(),
        }
    }
}

/// The Entra ID credential of `kind`. A user-assigned managed identity is chosen by
/// `AZURE_CLIENT_ID`, as `DefaultAzureCredential` does in every SDK.
pub fn credential(kind: CredentialKind) -> Result<Arc<dyn TokenCredential>, WiringError> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let failed = |what: &str, e: &dyn std::fmt::Display| WiringError::Credential {
        kind,
        what: what.into(),
        reason: e.to_string(),
    };
    let c: Arc<dyn TokenCredential> = match kind {
        CredentialKind::ManagedIdentity => azure_identity::ManagedIdentityCredential::new(Some(
            azure_identity::ManagedIdentityCredentialOptions {
                user_assigned_id: env("AZURE_CLIENT_ID")
                    .map(azure_identity::UserAssignedId::ClientId),
                ..Default::default()
            },
        ))
        .map_err(|e| failed("managed identity", &e))?,
        CredentialKind::WorkloadIdentity => azure_identity::WorkloadIdentityCredential::new(None)
            .map_err(|e| failed("workload identity", &e))?,
        CredentialKind::AzureCli => {
            azure_identity::AzureCliCredential::new(None).map_err(|e| failed("azure cli", &e))?
        }
        CredentialKind::DeveloperTools => azure_identity::DeveloperToolsCredential::new(None)
            .map_err(|e| failed("developer tools", &e))?,
        CredentialKind::ClientSecret => {
            let var = |name: &str| {
                std::env::var(name).map_err(|_| WiringError::Credential {
                    kind,
                    what: "client_secret credential".into(),
                    reason: format!("{name} is not set"),
                })
            };
            azure_identity::ClientSecretCredential::new(
                &var("AZURE_TENANT_ID")?,
                var("AZURE_CLIENT_ID")?,
                var("AZURE_CLIENT_SECRET")?.into(),
                None,
            )
            .map_err(|e| failed("client secret", &e))?
        }
    };
    Ok(c)
}

impl EventHubsTarget {
    /// The hub `hub`, read as `consumer_group`, in the namespace of a connection string (an
    /// emulator's `UseDevelopmentEmulator=true` string dials its plain AMQP endpoint).
    pub fn with_connection_string(cs: &ConnectionString, hub: &str, consumer_group: &str) -> Self {
        Self {
            namespace: cs.namespace(),
            custom_endpoint: cs.custom_endpoint(),
            hub: hub.into(),
            consumer_group: consumer_group.into(),
            auth: EventHubsAuth::ConnectionString(cs.clone()),
        }
    }

    /// The hub in `namespace` (`myns.servicebus.windows.net`), with an Entra ID credential.
    pub fn with_credential(
        namespace: &str,
        credential: Arc<dyn TokenCredential>,
        hub: &str,
        consumer_group: &str,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            custom_endpoint: None,
            hub: hub.into(),
            consumer_group: consumer_group.into(),
            auth: EventHubsAuth::Credential(credential),
        }
    }
}

/// How the Service Bus namespace (the retry queue, the dead-letter queue) is reached.
#[derive(Clone)]
pub enum ServiceBusAccess {
    /// A namespace connection string (SAS).
    ConnectionString(ConnectionString),
    /// A namespace (read as `ServiceBusEndpoint::parse` reads it) and an Entra ID
    /// credential.
    Credential {
        /// The namespace.
        namespace: String,
        /// The credential.
        credential: Arc<dyn TokenCredential>,
    },
}

impl std::fmt::Debug for ServiceBusAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ConnectionString(cs) => write!(f, "ConnectionString({})", cs.namespace()),
            Self::Credential { namespace, .. } => write!(f, "Credential({namespace})"),
        }
    }
}

impl ServiceBusAccess {
    /// The `[servicebus]` section's namespace and credential.
    pub fn from_config(c: &Config) -> Result<Self, WiringError> {
        match c.servicebus.access().map_err(WiringError::config)? {
            Access::ConnectionString(cs) => Ok(Self::ConnectionString(cs)),
            Access::Entra {
                namespace,
                credential: kind,
            } => Ok(Self::Credential {
                namespace,
                credential: credential(kind)?,
            }),
        }
    }

    testbed_pub! {
    /// A client of `queue` in this namespace; every call has `deadline`.
    pub fn queue(
        &self,
        queue: &str,
        deadline: Duration,
    ) -> Result<ServiceBusRetryQueue, crate::azure::RetryQueueError> {
        let options = ServiceBusOptions { deadline };
        match self {
            Self::ConnectionString(cs) => ServiceBusRetryQueue::new(cs, queue, options),
            Self::Credential {
                namespace,
                credential,
            } => ServiceBusRetryQueue::with_token_credential(
                namespace,
                credential.clone(),
                queue,
                options,
            ),
        }
    }
    }
}

/// Where checkpoints, ownership, the ledger and the breaker live: one blob container.
#[derive(Clone)]
pub struct StorageAccess {
    /// The container's URL (a SAS in its query is fine; it is never shown).
    pub container_url: String,
    /// An Entra ID credential (https only), or none for a SAS or an emulator.
    pub credential: Option<Arc<dyn TokenCredential>>,
    /// Whether ledger records carry their state as a blob index tag (`ledger.lifecycle_tags`).
    pub index_tags: bool,
}

impl std::fmt::Debug for StorageAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageAccess")
            .field("credential", &self.credential.is_some())
            .finish_non_exhaustive()
    }
}

impl StorageAccess {
    /// The `[storage]` section's container and credential.
    pub fn from_config(c: &Config) -> Result<Self, WiringError> {
        Ok(Self {
            container_url: c.storage.container_url.clone(),
            credential: c.storage.credential.map(credential).transpose()?,
            index_tags: c.ledger.lifecycle_tags,
        })
    }

    /// The container at `url`, with no credential (a SAS in the URL, or an emulator).
    pub fn url(url: &str) -> Self {
        Self {
            container_url: url.into(),
            credential: None,
            index_tags: false,
        }
    }

    testbed_pub! {
        /// The record store (the ledger's and the breaker's blobs); every call has `deadline`.
        pub fn record_store(&self, deadline: Duration) -> Result<BlobRecordStore, WiringError> {
            BlobRecordStore::new(&self.container_url, self.credential.clone(), deadline)
                .map(|s| s.with_index_tags(self.index_tags))
                .map_err(|e| WiringError::client("storage.container_url", e))
        }
    }

    /// The attempt ledger of `hub` and `consumer_group` in this container, every call with
    /// `deadline` (no retention: the operator commands' ledger, which expires nothing).
    #[cfg(any(test, feature = "cli"))]
    pub(crate) fn ledger(
        &self,
        hub: &str,
        consumer_group: &str,
        deadline: Duration,
    ) -> Result<Ledger, WiringError> {
        Ok(Ledger::new(
            Arc::new(self.record_store(deadline)?),
            hub,
            consumer_group,
        ))
    }
}

/// The one builder of [`PipelineParts`]: where the services are, plus the handler's
/// policies, identity, breaker and tunables. Call deadlines of the blob and Service Bus
/// clients are `options.deadline`; the retry queue runs on `options.clock`.
#[derive(Clone)]
pub struct Wiring {
    eventhubs: EventHubsTarget,
    storage: StorageAccess,
    servicebus: ServiceBusAccess,
    queue: String,
    dead_letters: Option<(String, u32)>,
    policies: Policies,
    identity: IdentityConfig,
    breaker: Option<BreakerConfig>,
    options: PipelineOptions,
    records: Option<Arc<dyn RecordStore>>,
    checkpoint_store: Option<Arc<dyn CheckpointStore + Send + Sync>>,
    retry_queue: Option<Arc<dyn RetryQueue>>,
}

impl std::fmt::Debug for Wiring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wiring")
            .field("eventhubs", &self.eventhubs)
            .field("servicebus", &self.servicebus)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl Wiring {
    /// The services; everything else at its default: the queue `retries`, the default
    /// (Fibonacci) policy, no breaker, [`PipelineOptions::default`].
    pub fn new(
        eventhubs: EventHubsTarget,
        storage: StorageAccess,
        servicebus: ServiceBusAccess,
    ) -> Self {
        Self {
            eventhubs,
            storage,
            servicebus,
            queue: "retries".into(),
            dead_letters: None,
            policies: Policies {
                default: RetryPolicy::seed_fibonacci(),
                by_type: Default::default(),
            },
            identity: IdentityConfig::default(),
            breaker: None,
            options: PipelineOptions::default(),
            records: None,
            checkpoint_store: None,
            retry_queue: None,
        }
    }

    /// What `hubguard run`'s configuration names (validated by [`Config::parse`]):
    /// credentials are created once per section.
    pub fn from_config(c: &Config) -> Result<Self, WiringError> {
        let eh = &c.eventhubs;
        let eventhubs = match eh.access().map_err(WiringError::config)? {
            Access::ConnectionString(cs) => {
                EventHubsTarget::with_connection_string(&cs, &eh.hub, &eh.consumer_group)
            }
            Access::Entra {
                namespace,
                credential: kind,
            } => EventHubsTarget::with_credential(
                &namespace,
                credential(kind)?,
                &eh.hub,
                &eh.consumer_group,
            ),
        };
        let storage = StorageAccess::from_config(c)?;
        let servicebus = ServiceBusAccess::from_config(c)?;
        let mut w = Self::new(eventhubs, storage, servicebus)
            .queue(&c.servicebus.queue)
            .policies(Policies {
                default: c.policy.default.clone(),
                by_type: c.policy.types.clone(),
            })
            .identity(c.identity.clone())
            .breaker(c.breaker.clone())
            .options(
                c.pipeline_options()
                    .map_err(|e| WiringError::client("processor", e))?,
            );
        if let Some(d) = &c.dead_letters {
            w = w.dead_letters(&d.queue, d.max_message_kb);
        }
        if let Some(o) = &c.operational_events {
            w.options.ops_events = Some(w.ops_events(o)?);
        }
        Ok(w)
    }

    /// The retry queue's name (default `retries`).
    pub fn queue(mut self, name: &str) -> Self {
        self.queue = name.into();
        self
    }

    /// Dead letters are also published to `queue` of the same namespace, whose messages
    /// take at most `max_message_kb`.
    pub fn dead_letters(mut self, queue: &str, max_message_kb: u32) -> Self {
        self.dead_letters = Some((queue.into(), max_message_kb));
        self
    }

    /// The retry policies.
    pub fn policies(mut self, policies: Policies) -> Self {
        self.policies = policies;
        self
    }

    /// One retry policy for every event type.
    pub fn policy(self, policy: RetryPolicy) -> Self {
        self.policies(Policies {
            default: policy,
            by_type: Default::default(),
        })
    }

    /// Where events' identity comes from.
    pub fn identity(mut self, identity: IdentityConfig) -> Self {
        self.identity = identity;
        self
    }

    /// The downstream's circuit breaker (none unless set; `enabled = false` also turns it
    /// off).
    pub fn breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = Some(breaker);
        self
    }

    /// The tunables.
    pub fn options(mut self, options: PipelineOptions) -> Self {
        self.options = options;
        self
    }

    /// The tunables as set so far.
    pub fn options_mut(&mut self) -> &mut PipelineOptions {
        &mut self.options
    }

    /// Keeps the ledger in `records` instead of the container's blobs (tests shape it).
    pub fn with_records(mut self, records: Arc<dyn RecordStore>) -> Self {
        self.records = Some(records);
        self
    }

    /// Keeps checkpoints and ownership in `store` instead of the container's blobs.
    pub fn with_checkpoint_store(mut self, store: Arc<dyn CheckpointStore + Send + Sync>) -> Self {
        self.checkpoint_store = Some(store);
        self
    }

    /// Schedules retries on `queue` instead of the Service Bus queue.
    pub fn with_retry_queue(mut self, queue: Arc<dyn RetryQueue>) -> Self {
        self.retry_queue = Some(queue);
        self
    }

    testbed_pub! {
    /// Who this deployment is (namespace, hub, consumer group): what its messages carry.
    pub fn deployment(&self) -> crate::event::Deployment {
        crate::event::Deployment::new(
            &self.eventhubs.namespace,
            &self.eventhubs.hub,
            &self.eventhubs.consumer_group,
        )
    }
    }

    /// The Event Hub.
    pub fn eventhubs(&self) -> &EventHubsTarget {
        &self.eventhubs
    }

    /// The record store (the ledger and the breaker) in the container.
    #[cfg(any(test, feature = "testbed"))]
    pub fn record_store(&self) -> Result<BlobRecordStore, WiringError> {
        self.storage.record_store(self.options.deadline)
    }

    /// The retry queue's Service Bus client, on the pipeline's clock.
    pub(crate) fn retry_queue(&self) -> Result<ServiceBusRetryQueue, WiringError> {
        Ok(self
            .servicebus
            .queue(&self.queue, self.options.deadline)
            .map_err(|e| WiringError::client("servicebus", e))?
            .with_clock(self.options.clock.clone()))
    }

    /// Operational events to the destination `[operational_events]` names, on the options'
    /// clock.
    fn ops_events(
        &self,
        o: &crate::config::OperationalEventsSection,
    ) -> Result<Arc<crate::opsevents::OpsEvents>, WiringError> {
        use crate::opsevents::send::{
            OpsEventsDestination, ServiceBusDestination, WebhookDestination,
        };
        let timeout = Duration::from_millis(o.timeout_ms);
        let destination: Arc<dyn OpsEventsDestination> = match (&o.url, &o.queue) {
            (Some(url), _) => {
                let url = reqwest::Url::parse(url)
                    .map_err(|e| WiringError::client("operational_events.url", e.to_string()))?;
                Arc::new(
                    WebhookDestination::new(url, timeout, o.signing.as_ref())
                        .map_err(|e| WiringError::client("operational_events", e.0))?,
                )
            }
            (None, Some(q)) => {
                let entity = self.servicebus.queue(q, timeout).map_err(|e| {
                    WiringError::client("operational_events.queue", format!("servicebus: {e}"))
                })?;
                Arc::new(ServiceBusDestination::new(
                    Arc::new(entity.without_batching()),
                    q,
                    timeout,
                ))
            }
            (None, None) => {
                return Err(WiringError::client(
                    "operational_events",
                    "set `url` or `queue`".to_string(),
                ))
            }
        };
        Ok(Arc::new(crate::opsevents::OpsEvents::new(
            o.settings(),
            destination,
            self.options.clock.clone(),
        )))
    }

    /// The dead-letter destination, if one is set: a queue of the same namespace.
    pub fn dead_letter_destination(
        &self,
    ) -> Result<Option<Arc<DeadLetterDestination>>, WiringError> {
        let Some((name, max_kb)) = &self.dead_letters else {
            return Ok(None);
        };
        let queue = self
            .servicebus
            .queue(name, self.options.deadline)
            .map_err(|e| WiringError::client("dead_letters.queue", format!("servicebus: {e}")))?
            // Its readers are the user's consumers: each message keeps its content type.
            .without_batching();
        Ok(Some(Arc::new(
            DeadLetterDestination::new(Arc::new(queue), name, *max_kb)
                .with_deployment(self.deployment()),
        )))
    }

    /// The start-up proof of the retry queue: reads its description and refuses (naming the
    /// property and the value needed) when it cannot keep hubguard's promise; returns warnings
    /// (e.g. no Manage right to read the description). The gap its duplicate detection must
    /// cover is [`PipelineOptions::replay_gap`]. See `prove_queue`.
    pub async fn prove_retry_queue(&self) -> Result<Vec<String>, WiringError> {
        let queue = self.retry_queue()?;
        let needs = QueueNeeds {
            replay_gap: self.options.replay_gap(),
            call_deadline: self.options.deadline,
        };
        match prove_queue(&self.queue, queue.describe().await, &needs) {
            Ok(proof) => {
                tracing::info!("{}", proof.summary);
                Ok(proof.warnings)
            }
            Err(refusal) => Err(WiringError::QueueRefused(refusal)),
        }
    }

    /// A settler as the replicas run it, for the operator commands: this wiring's ledger
    /// (without retention), retry queue, policies, dead-letter destination and deployment.
    #[cfg(any(test, feature = "cli"))]
    pub(crate) fn settler(&self) -> Result<Settler, WiringError> {
        let records: Arc<dyn RecordStore> = match &self.records {
            Some(r) => r.clone(),
            None => Arc::new(self.storage.record_store(self.options.deadline)?),
        };
        let ledger = Ledger::new(records, &self.eventhubs.hub, &self.eventhubs.consumer_group);
        let queue: Arc<dyn RetryQueue> = match &self.retry_queue {
            Some(q) => q.clone(),
            None => Arc::new(self.retry_queue()?),
        };
        Ok(Settler::new(ledger, queue, self.policies.clone())
            .with_dead_letters(self.dead_letter_destination()?)
            .with_deployment(self.deployment()))
    }

    /// Everything the pipeline needs, with `handler`.
    pub fn parts(&self, handler: Arc<dyn Handler>) -> Result<PipelineParts, WiringError> {
        let deadline = self.options.deadline;
        let (records, checkpoint_store) = match (&self.records, &self.checkpoint_store) {
            (Some(r), Some(c)) => (r.clone(), c.clone()),
            (records, checkpoints) => {
                let blob = self.storage.record_store(deadline)?;
                // Blob storage's time is measured from the responses to the pipeline's calls.
                blob.container().measure_on(self.options.clock.clone());
                let checkpoints = checkpoints
                    .clone()
                    .unwrap_or_else(|| BlobCheckpointStore::new(blob.container()));
                let records: Arc<dyn RecordStore> =
                    records.clone().unwrap_or_else(|| Arc::new(blob));
                (records, checkpoints)
            }
        };
        let queue = match &self.retry_queue {
            Some(q) => q.clone(),
            None => Arc::new(self.retry_queue()?),
        };
        let mut options = self.options.clone();
        if options.dead_letters.is_none() {
            options.dead_letters = self.dead_letter_destination()?;
        }
        Ok(PipelineParts {
            eventhubs: self.eventhubs.clone(),
            checkpoint_store,
            records,
            queue,
            handler,
            policies: self.policies.clone(),
            identity: self.identity.clone(),
            options,
            breaker: self.breaker.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;
    #[async_trait::async_trait]
    impl Handler for Nothing {
        async fn handle(
            &self,
            _: &crate::event::Event,
            _: &crate::handler::Attempt,
        ) -> crate::handler::Outcome {
            crate::handler::Outcome::Delivered
        }
    }

    const CONFIG: &str = r#"
[eventhubs]
connection_string = "Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
hub = "orders"
consumer_group = "billing"
[servicebus]
connection_string = "Endpoint=sb://127.0.0.1:5380;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
queue = "order-retries"
[storage]
container_url = "http://127.0.0.1:10000/devstoreaccount1/hubguard"
[handler]
kind = "webhook"
url = "http://127.0.0.1:9000/events"
[retry]
call_deadline_ms = 4000
[processor]
owner_id = "replica-a"
[dead_letters]
queue = "order-dead-letters"
"#;

    #[test]
    fn a_configuration_wires_every_part_without_connecting() {
        let config = Config::parse(CONFIG, Vec::new()).unwrap();
        let wiring = Wiring::from_config(&config).unwrap();
        assert_eq!(wiring.eventhubs().hub, "orders");
        assert_eq!(wiring.eventhubs().consumer_group, "billing");
        assert_eq!(
            wiring.eventhubs().custom_endpoint.as_deref(),
            Some("amqp://127.0.0.1:5672")
        );
        assert_eq!(
            wiring.options.replay_gap(),
            config.replay_gap(),
            "one rule for the gap"
        );
        let parts = wiring.parts(Arc::new(Nothing)).unwrap();
        assert_eq!(parts.options.owner_id, "replica-a");
        assert_eq!(parts.options.deadline, Duration::from_secs(4));
        assert_eq!(
            parts.options.dead_letters.as_ref().map(|d| d.name()),
            Some("order-dead-letters")
        );
        assert!(parts.breaker.is_some());
        // Nothing in what can be shown carries the key.
        assert!(!format!("{wiring:?}").contains("TOPSECRET"));
    }

    #[test]
    fn a_bad_container_url_names_its_key() {
        let wiring = Wiring::new(
            EventHubsTarget::with_connection_string(
                &"Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
                    .parse()
                    .unwrap(),
                "hub",
                "$Default",
            ),
            StorageAccess::url("not a url"),
            ServiceBusAccess::ConnectionString(
                "Endpoint=sb://127.0.0.1:5380;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
                    .parse()
                    .unwrap(),
            ),
        );
        let Err(e) = wiring.parts(Arc::new(Nothing)) else {
            panic!("a container URL that is not a URL wired");
        };
        assert!(
            matches!(&e, WiringError::Client { key, .. } if key == "storage.container_url"),
            "{e:?}"
        );
        assert!(!e.to_string().contains("TOPSECRET"), "{e}");
    }
}
