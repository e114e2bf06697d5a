//! `hubguard run`'s configuration: TOML, then `HUBGUARD_*` environment overrides, then
//! validation. A bad value stops start-up with an error that names the key and what is
//! allowed; no error ever quotes a secret (connection strings are never echoed).
//!
//! Environment overrides use `__` between levels: `HUBGUARD_EVENTHUBS__CONNECTION_STRING`,
//! `HUBGUARD_POLICY__DEFAULT__MAX_ATTEMPTS`, `HUBGUARD_STATUS__LISTEN`. Values are read as
//! TOML (numbers, booleans, arrays) and otherwise as strings.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::azure::ConnectionString;
use crate::event::IdentityConfig;
use crate::handler::webhook::WebhookConfig;
use crate::pipeline::{OrderingKey, PipelineOptions};
use crate::policy::RetryPolicy;

/// A configuration problem: where (the file, a key, an environment variable) and why. No
/// variant ever carries a secret's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("configuration: cannot read {}: {reason}", path.display())]
    Unreadable {
        /// The file.
        path: std::path::PathBuf,
        /// Why (the operating system's words).
        reason: String,
    },
    /// The text is not TOML: the line, and what the parser says (never the line itself).
    #[error("configuration: {0}")]
    Syntax(String),
    /// A `HUBGUARD_*` variable that is not a configuration key, or cannot be placed.
    #[error("configuration: environment variable {var}: {reason}")]
    Environment {
        /// The variable's name.
        var: String,
        /// Why.
        reason: String,
    },
    /// A value of the wrong type or shape, or an unknown key, at `key` (set by `env_var` when
    /// an environment override wrote it).
    #[error("configuration: {}", match env_var {
        Some(var) => format!("environment variable {var} ({key}): {message}"),
        None => format!("{key}: {message}"),
    })]
    Value {
        /// The key's dotted path (`retry.concurrency`).
        key: String,
        /// The environment variable that set it, if one did.
        env_var: Option<String>,
        /// What is wrong (not the value when the key holds a secret).
        message: String,
    },
    /// A value hubguard cannot run with (checked after parsing); `message` names the key and
    /// what is allowed.
    #[error("configuration: {message}")]
    Invalid {
        /// The key (or section) at fault.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
    },
}

impl ConfigError {
    /// The key at fault, when the problem is one key's.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Value { key, .. } | Self::Invalid { key, .. } => Some(key),
            _ => None,
        }
    }
}

fn invalid(key: impl Into<String>, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.to_string(),
    }
}

/// A Service Bus entity name as Service Bus compares it: entity names are case-insensitive
/// ("Resource and resource group names are case-insensitive unless specifically noted …
/// Always perform a case-insensitive comparison of names",
/// <https://learn.microsoft.com/azure/azure-resource-manager/management/resource-name-rules#microsoftservicebus>),
/// and a path's leading or trailing `/` names the same entity.
fn entity_key(name: &str) -> String {
    name.trim().trim_matches('/').to_ascii_lowercase()
}

/// `dead_letters.queue` must be another queue than the retry queue, compared as Service Bus
/// compares entity names: not `servicebus.queue` in any case, not its `$DeadLetterQueue`
/// sub-queue (which Service Bus fills itself and nobody may send to), and not an address
/// (the queue lives in the `[servicebus]` namespace; an address could spell that namespace
/// differently — host names are case-insensitive — and still be the retry queue).
fn dead_letter_queue_is_not_the_retry_queue(dead: &str, retry: &str) -> Result<(), ConfigError> {
    let key = "dead_letters.queue";
    let (d, r) = (entity_key(dead), entity_key(retry));
    if d.is_empty() {
        return Err(invalid(
            key,
            "dead_letters.queue must name a queue (it is empty)",
        ));
    }
    if d.contains("://") {
        return Err(invalid(key, format!(
            "dead_letters.queue ({dead:?}) must be a queue name in the [servicebus] namespace, not an address"
        )));
    }
    if d == r {
        return Err(invalid(key, format!(
            "dead_letters.queue ({dead:?}) is servicebus.queue ({retry:?}): Service Bus entity names are case-insensitive; name a queue other than the retry queue"
        )));
    }
    if d.ends_with("/$deadletterqueue") || d.contains("$") {
        let whose = if d.strip_suffix("/$deadletterqueue") == Some(r.as_str()) {
            format!("the dead-letter sub-queue of servicebus.queue ({retry:?})")
        } else {
            "a Service Bus system sub-queue".to_string()
        };
        return Err(invalid(key, format!(
            "dead_letters.queue ({dead:?}) is {whose}: Service Bus fills it itself and nothing may be sent to it; name a queue of its own"
        )));
    }
    Ok(())
}

/// Which Entra ID credential to use where no connection string is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CredentialKind {
    /// Managed identity (App Service, VMs, AKS pod identity).
    ManagedIdentity,
    /// Workload identity federation (AKS).
    WorkloadIdentity,
    /// The Azure CLI's login (development).
    AzureCli,
    /// Developer tools (Azure CLI, then azd).
    DeveloperTools,
    /// A service principal's client secret, from `AZURE_TENANT_ID`, `AZURE_CLIENT_ID` and
    /// `AZURE_CLIENT_SECRET` in the environment.
    ClientSecret,
}

/// The credential kinds, as the configuration spells them.
const CREDENTIAL_KINDS: &str =
    "managed_identity, workload_identity, azure_cli, developer_tools, client_secret";

/// How a section reaches its namespace: the one rule of `[eventhubs]` and `[servicebus]`,
/// which wiring follows to create the clients.
#[derive(Clone)]
pub enum Access {
    /// A namespace connection string (SAS), parsed.
    ConnectionString(ConnectionString),
    /// A namespace and an Entra ID credential.
    Entra {
        /// The namespace as configured.
        namespace: String,
        /// The credential's kind.
        credential: CredentialKind,
    },
}

impl std::fmt::Debug for Access {
    /// The endpoint only: a connection string's key is never shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ConnectionString(cs) => write!(f, "ConnectionString({})", cs.namespace()),
            Self::Entra {
                namespace,
                credential,
            } => write!(f, "Entra({namespace}, {credential:?})"),
        }
    }
}

/// Either `connection_string`, or `namespace` and `credential`, of `section`.
fn access(
    section: &str,
    connection_string: Option<&str>,
    namespace: Option<&str>,
    credential: Option<CredentialKind>,
) -> Result<Access, ConfigError> {
    match (connection_string, namespace, credential) {
        (Some(cs), None, None) => cs.parse().map(Access::ConnectionString).map_err(|e| {
            let key = format!("{section}.connection_string");
            invalid(&key, format!("{key}: {e}"))
        }),
        (None, Some(ns), Some(credential)) => Ok(Access::Entra {
            namespace: ns.to_string(),
            credential,
        }),
        _ => Err(invalid(
            section,
            format!(
                "{section}: give either connection_string, or namespace and credential ({CREDENTIAL_KINDS})"
            ),
        )),
    }
}

/// Where partitions without a checkpoint start (`processor.start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartPosition {
    /// The oldest event the hub retains.
    Earliest,
    /// Only events enqueued from now on.
    Latest,
}

/// `[eventhubs]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventHubsSection {
    /// `Endpoint=sb://…;SharedAccessKeyName=…;SharedAccessKey=…[;UseDevelopmentEmulator=true]`.
    pub connection_string: Option<String>,
    /// Namespace host for Entra ID (`myns.servicebus.windows.net`).
    pub namespace: Option<String>,
    /// Entra ID credential (with `namespace`).
    pub credential: Option<CredentialKind>,
    /// The hub.
    pub hub: String,
    /// The consumer group.
    #[serde(default = "default_cg")]
    pub consumer_group: String,
    /// The hub's retention, as configured on the service (hours), for start-up checks.
    #[serde(default = "default_retention")]
    pub retention_hours: u64,
}

fn default_cg() -> String {
    "$Default".into()
}
fn default_retention() -> u64 {
    24
}

/// `[servicebus]`: a connection string (SAS), or `namespace` and an Entra ID `credential`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceBusSection {
    /// Connection string of the namespace.
    pub connection_string: Option<String>,
    /// Namespace host for Entra ID (`myns.servicebus.windows.net`; `http://127.0.0.1:PORT`
    /// for a local emulator started with `--accept-any-token`).
    pub namespace: Option<String>,
    /// Entra ID credential (with `namespace`).
    pub credential: Option<CredentialKind>,
    /// The retry queue.
    #[serde(default = "default_queue")]
    pub queue: String,
    /// The queue's duplicate-detection window (seconds), as configured on the service.
    #[serde(default = "default_dedup")]
    pub duplicate_detection_window_s: u64,
}

impl EventHubsSection {
    /// How the hub's namespace is reached. A namespace must be a host name: a user name or
    /// password has no place in it, and would be shown wherever the namespace is named.
    pub fn access(&self) -> Result<Access, ConfigError> {
        let a = access(
            "eventhubs",
            self.connection_string.as_deref(),
            self.namespace.as_deref(),
            self.credential,
        )?;
        if let Access::Entra { namespace, .. } = &a {
            if namespace.contains('@') {
                return Err(invalid("eventhubs.namespace", "eventhubs.namespace must be the namespace's host name (myns.servicebus.windows.net), without a user name or password"));
            }
        }
        Ok(a)
    }
}

impl ServiceBusSection {
    /// How the retry queue's namespace is reached; a namespace must parse as a
    /// [`ServiceBusEndpoint`](crate::azure::retry_queue::ServiceBusEndpoint).
    pub fn access(&self) -> Result<Access, ConfigError> {
        let a = access(
            "servicebus",
            self.connection_string.as_deref(),
            self.namespace.as_deref(),
            self.credential,
        )?;
        if let Access::Entra { namespace, .. } = &a {
            crate::azure::retry_queue::ServiceBusEndpoint::parse(namespace).map_err(|e| {
                invalid("servicebus.namespace", format!("servicebus.namespace: {e}"))
            })?;
        }
        Ok(a)
    }
}

fn default_queue() -> String {
    "retries".into()
}
fn default_dedup() -> u64 {
    600
}

/// `[storage]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageSection {
    /// Container URL for checkpoints, ownership and the ledger (a SAS in the query is fine).
    pub container_url: String,
    /// Entra ID credential (https URLs only); none for a SAS or the emulator.
    pub credential: Option<CredentialKind>,
}

/// A connection string for display: the endpoint only.
fn redact_connection_string(cs: &str) -> String {
    match cs.parse::<ConnectionString>() {
        Ok(c) => format!("Endpoint=sb://{};<key redacted>", c.namespace()),
        Err(_) => "<unparsable, redacted>".into(),
    }
}

/// A URL for display: its userinfo and query values masked ([`crate::redact`]).
fn redact_url(u: &str) -> String {
    match url::Url::parse(u) {
        Ok(u) => crate::redact::redacted(u.as_str()),
        Err(_) => "<unparsable, redacted>".into(),
    }
}

impl std::fmt::Debug for EventHubsSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventHubsSection")
            .field(
                "connection_string",
                &self
                    .connection_string
                    .as_deref()
                    .map(redact_connection_string),
            )
            .field("namespace", &self.namespace)
            .field("credential", &self.credential)
            .field("hub", &self.hub)
            .field("consumer_group", &self.consumer_group)
            .field("retention_hours", &self.retention_hours)
            .finish()
    }
}

impl std::fmt::Debug for ServiceBusSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceBusSection")
            .field(
                "connection_string",
                &self
                    .connection_string
                    .as_deref()
                    .map(redact_connection_string),
            )
            .field("namespace", &self.namespace)
            .field("credential", &self.credential)
            .field("queue", &self.queue)
            .field(
                "duplicate_detection_window_s",
                &self.duplicate_detection_window_s,
            )
            .finish()
    }
}

impl std::fmt::Debug for StorageSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageSection")
            .field("container_url", &redact_url(&self.container_url))
            .field("credential", &self.credential)
            .finish()
    }
}

/// `[dead_letters]`: every dead letter is also published to this Service Bus queue (in the
/// `[servicebus]` namespace), before the ledger records it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLettersSection {
    /// The queue operators subscribe to (not the retry queue).
    pub queue: String,
    /// The largest message the queue takes (KB): 256 on Standard, up to 102400 on Premium.
    /// A body that would not fit goes as a claim check (the ledger keeps the event).
    #[serde(default = "d256")]
    pub max_message_kb: u32,
}

impl DeadLettersSection {
    /// Another queue than the retry queue `retry_queue`, and a size Service Bus allows.
    fn validate(&self, retry_queue: &str) -> Result<(), ConfigError> {
        dead_letter_queue_is_not_the_retry_queue(&self.queue, retry_queue)?;
        if !(1..=102_400).contains(&self.max_message_kb) {
            return Err(invalid("dead_letters.max_message_kb", format!(
                "dead_letters.max_message_kb must be 1 to 102400 (256 on Service Bus Standard), got {}",
                self.max_message_kb
            )));
        }
        Ok(())
    }
}

fn d256() -> u32 {
    256
}

/// `[handler]`
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum HandlerSection {
    /// POST each event to a URL.
    Webhook(WebhookConfig),
}

/// Milliseconds of a default duration.
fn ms_of(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `[processor]`. Defaults: [`PipelineOptions::default`], the one source of the pipeline's
/// defaults (the sections' `Default` impls read it; a missing key takes the section's default).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProcessorSection {
    /// Unique per live replica; default: a random id per process.
    pub owner_id: Option<String>,
    /// Load-balancing interval (ms).
    pub update_interval_ms: u64,
    /// Ownership expiration (ms); must exceed the update interval.
    pub ownership_expiration_ms: u64,
    /// Prefetch per partition.
    pub prefetch: u32,
    /// Where partitions without a checkpoint start: `earliest` or `latest`.
    pub start: StartPosition,
    /// Events of one partition handled at once (1: strictly one by one).
    pub max_in_flight: usize,
    /// What keeps events in order when `max_in_flight` > 1: `partition_key`,
    /// `property:<name>` or `none`.
    pub ordering_key: OrderingKey,
    /// Ordered retries: `off` (default) or `key` — while an event of an ordering key waits
    /// for a retry, the later events of that key on its partition are parked behind it.
    pub retry_ordering: String,
    /// With `retry_ordering = "key"`, what a line does when its head is dead-lettered:
    /// `release` (the next parked event runs) or `dead_letter_line` (the parked events
    /// follow it into the dead letters).
    pub line_on_dead_letter: String,
    /// Most events read past the partition's oldest unsettled one (at least
    /// `max_in_flight`): settled events behind a slow one wait here, not in a slot.
    pub window: usize,
}

/// `processor.max_in_flight` when the file does not say: sized for a downstream at web
/// latencies. Events of one partition at once ÷ handler latency bounds a partition's rate:
/// 64 ÷ 50 ms = 1,280 events/s, above the 1,000 events/s a Standard partition takes in
/// ("Event Hubs quotas and limits", https://learn.microsoft.com/azure/event-hubs/event-hubs-quotas).
/// Events sharing an ordering key still run one after another.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;

/// `processor.window` when the file does not say: four times the slots, so a few events
/// slow to settle (each failure writes the ledger and sends to Service Bus) do not leave
/// the slots idle behind them.
pub const DEFAULT_WINDOW: usize = 4 * DEFAULT_MAX_IN_FLIGHT;

/// `retry.concurrency` when the file does not say: retries at once, 64 ÷ 50 ms = 1,280
/// retries/s.
pub const DEFAULT_RETRY_CONCURRENCY: usize = 64;

impl Default for ProcessorSection {
    fn default() -> Self {
        let o = PipelineOptions::default();
        Self {
            owner_id: None,
            update_interval_ms: ms_of(o.update_interval),
            ownership_expiration_ms: ms_of(o.ownership_expiration),
            prefetch: o.prefetch,
            start: if o.start_at_latest {
                StartPosition::Latest
            } else {
                StartPosition::Earliest
            },
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            ordering_key: o.ordering,
            retry_ordering: "off".into(),
            line_on_dead_letter: crate::pipeline::LineOnDeadLetter::default().to_string(),
            window: DEFAULT_WINDOW,
        }
    }
}

/// `[checkpoint]` (defaults: [`PipelineOptions::default`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Checkpoint after this many settled events…
    pub every_events: u64,
    /// …or this many milliseconds…
    pub every_ms: u64,
    /// …but never more often than this per partition (ms): writes are bounded by time.
    pub min_interval_ms: u64,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        let o = PipelineOptions::default();
        Self {
            every_events: o.checkpoint_every_events,
            every_ms: ms_of(o.checkpoint_every),
            min_interval_ms: ms_of(o.checkpoint_min_interval),
        }
    }
}

/// `[retry]` (defaults: [`PipelineOptions::default`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetrySection {
    /// Retry attempts at once (calls to the downstream in flight), and the most receivers.
    pub concurrency: usize,
    /// Retry messages are scheduled this long before their due time (ms; never before the
    /// next whole second), received early and started at the due time; 0: received when due.
    pub lead_ms: u64,
    /// Retry messages in hand at most (waiting for their due time, or running).
    pub prefetch: usize,
    /// Long-poll wait per receive (ms).
    pub receive_wait_ms: u64,
    /// Deadline of every call to Service Bus, blob storage and Event Hubs (ms).
    pub call_deadline_ms: u64,
    /// How often the queue's dead-letter sub-queue is swept for retries Service Bus gave up
    /// on (ms; also once at start).
    pub dead_letter_sweep_ms: u64,
    /// A retry the ledger says was due this long ago (ms), with no retry message arriving,
    /// is scheduled again under a fresh MessageId by the same sweep.
    pub overdue_margin_ms: u64,
}

impl Default for RetrySection {
    fn default() -> Self {
        let o = PipelineOptions::default();
        Self {
            concurrency: DEFAULT_RETRY_CONCURRENCY,
            lead_ms: ms_of(o.retry_lead),
            prefetch: o.retry_prefetch,
            receive_wait_ms: ms_of(o.retry_receive_wait),
            call_deadline_ms: ms_of(o.deadline),
            dead_letter_sweep_ms: ms_of(o.dead_letter_sweep),
            overdue_margin_ms: ms_of(o.overdue_margin),
        }
    }
}

/// `[status]`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StatusSection {
    /// Where `/healthz`, `/readyz` and `/v1/events/{key}` are served.
    pub listen: SocketAddr,
    /// `/healthz` answers 503 once the Event Hubs consumer has failed without a break for
    /// this long (ms), so an orchestrator restarts the process; 0 never.
    pub unhealthy_after_ms: u64,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}

impl Default for StatusSection {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            unhealthy_after_ms: PipelineOptions::default().unhealthy_after.map_or(0, ms_of),
        }
    }
}

/// `[policy]`: `default` and per-type `types."<event type>"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySection {
    /// The default policy.
    #[serde(default = "RetryPolicy::seed_fibonacci")]
    pub default: RetryPolicy,
    /// By event type.
    #[serde(default)]
    pub types: HashMap<String, RetryPolicy>,
}

impl Default for PolicySection {
    fn default() -> Self {
        Self {
            default: RetryPolicy::seed_fibonacci(),
            types: HashMap::new(),
        }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[eventhubs]`
    pub eventhubs: EventHubsSection,
    /// `[servicebus]`
    pub servicebus: ServiceBusSection,
    /// `[storage]`
    pub storage: StorageSection,
    /// `[handler]`
    pub handler: HandlerSection,
    /// `[processor]`
    #[serde(default)]
    pub processor: ProcessorSection,
    /// `[checkpoint]`
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// `[retry]`
    #[serde(default)]
    pub retry: RetrySection,
    /// `[policy]`
    #[serde(default)]
    pub policy: PolicySection,
    /// `[identity]`
    #[serde(default)]
    pub identity: IdentityConfig,
    /// `[status]`
    #[serde(default)]
    pub status: StatusSection,
    /// `[log]`: the log format (read before the rest, so start-up logs follow it).
    #[serde(default)]
    pub log: crate::telemetry::logs::LogSection,
    /// `[breaker]`: the circuit breaker for the handler's downstream.
    #[serde(default)]
    pub breaker: crate::breaker::BreakerConfig,
    /// `[dead_letters]`: where dead letters are also published (none by default).
    #[serde(default)]
    pub dead_letters: Option<DeadLettersSection>,
    /// `[ledger]`: how long delivered records are kept.
    #[serde(default)]
    pub ledger: LedgerSection,
}

/// `[ledger]`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerSection {
    /// DELIVERED records are deleted this many days after their last write, once their
    /// event is settled on its partition (0: kept forever). Dead letters stay until replayed
    /// or purged.
    pub retention_days: u64,
    /// Tags each record with its state as a blob index tag (`hubguard-state`, on the
    /// record's own write: no extra call), for the lifecycle management policy in
    /// `deploy/azure/`. Off by default: it needs the `tags/write` permission (Storage Blob
    /// Data Owner, or a SAS with `t`) and an account without a hierarchical namespace.
    pub lifecycle_tags: bool,
}

impl Default for LedgerSection {
    fn default() -> Self {
        Self {
            retention_days: crate::pipeline::DEFAULT_RETENTION.as_secs() / 86_400,
            lifecycle_tags: false,
        }
    }
}

const POLICY_KEYS: &[&str] = &[
    "name",
    "curve",
    "base_s",
    "floor_s",
    "cap_s",
    "max_attempts",
    "max_age_s",
    "delays_s",
    "repeat_last",
];

/// `SERVICE_HOST`, `SERVICE_PORT…`, `PORT`, `PORT_…`: what Kubernetes sets for a Service
/// (its "service links"), after the Service's upper-cased name.
fn is_service_link(rest: &str) -> bool {
    rest.ends_with("SERVICE_HOST")
        || rest.contains("SERVICE_PORT")
        || rest == "PORT"
        || rest.ends_with("_PORT")
        || rest.starts_with("PORT_")
        || rest.contains("_PORT_")
}

/// Keys whose values are (or may carry) secrets, never quoted in an error: connection
/// strings, a container URL (its query may hold a SAS), and anything named like a secret.
/// Matched on the key's last segment, so `processor.ordering_key` or
/// `identity.idempotency_key_properties` keep their helpful messages.
fn is_secret_path(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path).to_ascii_lowercase();
    matches!(
        last.as_str(),
        "connection_string" | "container_url" | "key" | "sas"
    ) || ["secret", "token", "password", "authorization"]
        .iter()
        .any(|s| last.contains(s))
}

/// Describes a TOML error by position and message, never by quoting the source line.
fn describe(e: &toml::de::Error, source: &str) -> String {
    let line = e
        .span()
        .map(|s| source[..s.start.min(source.len())].lines().count().max(1));
    match line {
        Some(l) => format!("line {l}: {}", e.message()),
        None => e.message().to_string(),
    }
}

fn set_path(root: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, parents) = path
        .split_last()
        .ok_or_else(|| "empty environment override".to_string())?;
    let mut table = root;
    for p in parents {
        let entry = table
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry
            .as_table_mut()
            .ok_or_else(|| format!("environment override: `{p}` is not a table"))?;
    }
    table.insert(last.clone(), value);
    Ok(())
}

fn env_value(raw: &str) -> toml::Value {
    match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    }
}

impl Config {
    /// Reads `path`, applies `HUBGUARD_*` overrides from `env`, and validates.
    pub fn load(
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let source = std::fs::read_to_string(path).map_err(|e| ConfigError::Unreadable {
            path: path.into(),
            reason: e.to_string(),
        })?;
        Self::parse(&source, env)
    }

    /// Parses TOML text, applies overrides, validates.
    pub fn parse(
        source: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut table: toml::Table = source
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Syntax(describe(&e, source)))?;
        // Overrides of single policy fields apply on top of the default policy.
        let policy = table
            .entry("policy")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(p) = policy {
            if !p.contains_key("default") {
                let seed = toml::Value::try_from(RetryPolicy::seed_fibonacci())
                    .map_err(|e| invalid("policy.default", e))?;
                p.insert("default".into(), seed);
            }
        }
        // Which environment variable set each key, so an error names what the user wrote.
        let mut from_env: std::collections::HashMap<String, String> =
            std::collections::HashMap::new();
        for (k, v) in env {
            let Some(rest) = k.strip_prefix("HUBGUARD_") else {
                continue;
            };
            if rest.starts_with("EMULATOR_")
                || rest == "CONFIG"
                || rest.starts_with("REQUIRE_")
                || rest.starts_with("AZURITE")
            {
                continue; // settings of other commands and of the test suite
            }
            if !rest.contains("__") {
                // Every key lives in a section (`HUBGUARD_SECTION__KEY`). Kubernetes adds
                // `HUBGUARD_SERVICE_HOST`, `HUBGUARD_PORT_8080_TCP`, … for a Service named
                // `hubguard`: those are not ours. Anything else is a mistyped override.
                if is_service_link(rest) {
                    continue;
                }
                return Err(ConfigError::Environment {
                    var: k,
                    reason: "not a configuration key; overrides are HUBGUARD_SECTION__KEY, with two underscores between levels (HUBGUARD_RETRY__CONCURRENCY)".into(),
                });
            }
            let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
            from_env.insert(path.join("."), k.clone());
            set_path(&mut table, &path, env_value(&v)).map_err(|reason| {
                ConfigError::Environment {
                    var: k.clone(),
                    reason,
                }
            })?;
        }
        if let Some(toml::Value::Table(policy)) = table.get("policy") {
            let mut tables: Vec<(String, &toml::Table)> = Vec::new();
            if let Some(toml::Value::Table(d)) = policy.get("default") {
                tables.push(("policy.default".into(), d));
            }
            if let Some(toml::Value::Table(types)) = policy.get("types") {
                for (name, t) in types {
                    if let toml::Value::Table(t) = t {
                        tables.push((format!("policy.types.\"{name}\""), t));
                    }
                }
            }
            for (where_, t) in tables {
                if let Some(k) = t.keys().find(|k| !POLICY_KEYS.contains(&k.as_str())) {
                    return Err(ConfigError::Value {
                        message: format!("unknown key `{k}` (allowed: {})", POLICY_KEYS.join(", ")),
                        key: where_,
                        env_var: None,
                    });
                }
            }
        }
        // `[handler]` is an internally tagged enum, whose errors serde reports at `handler`:
        // deserialise its body alone to find the key inside.
        let handler_body = table.get("handler").and_then(|h| h.as_table()).map(|h| {
            let mut h = h.clone();
            h.remove("kind");
            h
        });
        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let mut path = e.path().to_string();
                // A policy's curve is a flattened tagged enum: serde names its table only.
                if path.starts_with("policy.")
                    && !path.ends_with(".curve")
                    && e.inner().message().starts_with("unknown variant")
                {
                    path.push_str(".curve");
                }
                if path == "handler" {
                    if let Some(Err(inner)) = handler_body.clone().map(|b| {
                        serde_path_to_error::deserialize::<_, WebhookConfig>(toml::Value::Table(b))
                    }) {
                        path = format!("handler.{}", inner.path());
                    }
                }
                let message = if is_secret_path(&path) {
                    // A misplaced value could be a secret: name the key, not the value.
                    "invalid value (not shown: this key holds a secret)".to_string()
                } else {
                    e.inner().message().to_string()
                };
                ConfigError::Value {
                    env_var: from_env.get(&path).cloned(),
                    key: path,
                    message,
                }
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks values serde cannot, section by section (the first problem found is reported).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.eventhubs.access()?;
        if self.eventhubs.hub.trim().is_empty() {
            return Err(invalid("eventhubs.hub", "eventhubs.hub must not be empty"));
        }
        self.servicebus.access()?;
        self.validate_storage()?;
        self.validate_handler()?;
        self.validate_minimums()?;
        self.validate_processor()?;
        self.validate_retry()?;
        self.validate_checkpoint()?;
        self.validate_policies()?;
        self.validate_duplicate_window()?;
        self.validate_breaker()?;
        if let Some(d) = &self.dead_letters {
            d.validate(&self.servicebus.queue)?;
        }
        if self.eventhubs.retention_hours == 0 {
            return Err(invalid(
                "eventhubs.retention_hours",
                "eventhubs.retention_hours must be positive",
            ));
        }
        Ok(())
    }

    fn validate_storage(&self) -> Result<(), ConfigError> {
        let url = url::Url::parse(&self.storage.container_url).map_err(|e| {
            invalid(
                "storage.container_url",
                format!("storage.container_url is not a URL: {e}"),
            )
        })?;
        // Azure Storage authorizes a request by Shared Key, a SAS in the query, Entra ID or
        // anonymous read access — never by a user name and password in the URL
        // (https://learn.microsoft.com/en-us/rest/api/storageservices/authorize-requests-to-azure-storage).
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid(
                "storage.container_url",
                "storage.container_url must not carry a user name or password (Azure Storage takes a SAS in the query, or storage.credential)",
            ));
        }
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid(
                "storage.container_url",
                format!(
                    "storage.container_url must be an https (or, for an emulator, http) URL, not {}:",
                    url.scheme()
                ),
            ));
        }
        let loopback = matches!(url.host_str(), Some("127.0.0.1" | "localhost" | "[::1]"));
        if self.storage.credential.is_some() && url.scheme() != "https" && !loopback {
            return Err(invalid("storage.credential",
                "storage.credential needs an https storage.container_url (Azure takes bearer tokens over TLS only)",
            ));
        }
        Ok(())
    }

    /// The webhook's settings, its secrets and TLS files read and checked (wiring builds the
    /// handler).
    fn validate_handler(&self) -> Result<(), ConfigError> {
        let HandlerSection::Webhook(w) = &self.handler;
        if w.timeout_ms == 0 {
            return Err(invalid("handler.timeout_ms",
                "handler.timeout_ms must be positive: a webhook call with no time to answer fails every event",
            ));
        }
        w.check().map_err(|e| invalid(e.key(), e))?;
        if let Some(limit) = w.rate_limit {
            crate::ratelimit::validate_limit(limit)
                .map_err(|e| invalid("handler.rate_limit", format!("handler.rate_limit {e}")))?;
        }
        Ok(())
    }

    /// Values below which nothing would run.
    fn validate_minimums(&self) -> Result<(), ConfigError> {
        for (key, value, min) in [
            ("retry.call_deadline_ms", self.retry.call_deadline_ms, 100),
            ("retry.receive_wait_ms", self.retry.receive_wait_ms, 1),
            ("retry.concurrency", self.retry.concurrency as u64, 1),
            ("retry.prefetch", self.retry.prefetch as u64, 1),
            (
                "processor.update_interval_ms",
                self.processor.update_interval_ms,
                100,
            ),
            ("processor.prefetch", u64::from(self.processor.prefetch), 1),
        ] {
            if value < min {
                let why = match key {
                    "retry.call_deadline_ms" => "every call to Azure would time out before it is sent, and nothing would ever be consumed",
                    "retry.receive_wait_ms" => "the retry loop would poll Service Bus without pause",
                    "processor.prefetch" => "a partition with no prefetch receives nothing",
                    _ => "nothing would run",
                };
                return Err(invalid(
                    key,
                    format!("{key} must be at least {min} (got {value}): {why}"),
                ));
            }
        }
        Ok(())
    }

    fn validate_processor(&self) -> Result<(), ConfigError> {
        if self.processor.ownership_expiration_ms <= self.processor.update_interval_ms {
            return Err(invalid("processor.ownership_expiration_ms", "processor.ownership_expiration_ms must be greater than processor.update_interval_ms"));
        }
        if !(1..=10_000).contains(&self.processor.max_in_flight) {
            return Err(invalid(
                "processor.max_in_flight",
                "processor.max_in_flight must be between 1 and 10000",
            ));
        }
        if self.processor.window > 100_000 {
            return Err(invalid(
                "processor.window",
                "processor.window must be at most 100000 (each event in it is held in memory)",
            ));
        }
        self.retry_ordering().map(drop)
    }

    fn validate_retry(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            (
                "retry.dead_letter_sweep_ms",
                self.retry.dead_letter_sweep_ms,
            ),
            ("retry.overdue_margin_ms", self.retry.overdue_margin_ms),
        ] {
            if value < 1000 {
                return Err(invalid(
                    key,
                    format!("{key} must be at least 1000 (got {value})"),
                ));
            }
        }
        Ok(())
    }

    fn validate_checkpoint(&self) -> Result<(), ConfigError> {
        if self.checkpoint.every_events == 0 || self.checkpoint.every_ms == 0 {
            return Err(invalid(
                "checkpoint.every_events",
                "checkpoint.every_events and checkpoint.every_ms must be positive",
            ));
        }
        if self.checkpoint.min_interval_ms > self.checkpoint.every_ms {
            return Err(invalid(
                "checkpoint.min_interval_ms",
                "checkpoint.min_interval_ms must not exceed checkpoint.every_ms",
            ));
        }
        Ok(())
    }

    fn validate_policies(&self) -> Result<(), ConfigError> {
        self.policy
            .default
            .validate()
            .map_err(|e| invalid("policy.default", format!("policy.default: {e}")))?;
        for (t, p) in &self.policy.types {
            p.validate().map_err(|e| {
                invalid(
                    format!("policy.types.\"{t}\""),
                    format!("policy.types.\"{t}\": {e}"),
                )
            })?;
        }
        Ok(())
    }

    /// A replay re-sends a retry message with the same MessageId, and so does a redelivered
    /// retry message; if either can happen after the duplicate-detection window, a second
    /// retry message would be created. The window needed is [`QueueNeeds::window`]'s (the
    /// start-up proof's), with the queue's lock duration unknown here (Service Bus's
    /// default, 60 s, as there).
    ///
    /// [`QueueNeeds::window`]: crate::azure::retry_queue::QueueNeeds::window
    fn validate_duplicate_window(&self) -> Result<(), ConfigError> {
        let needs = self.queue_needs();
        let need = needs.window(None);
        let window = self.servicebus.duplicate_detection_window_s;
        if Duration::from_secs(window) < need {
            return Err(invalid("servicebus.duplicate_detection_window_s", format!(
                "servicebus.duplicate_detection_window_s ({window}) is shorter than this configuration needs ({} s: the longer of the schedule-to-replay gap, {} s, and the re-send of a retry message redelivered after its lock lapsed): a replay or a redelivery could schedule a second retry. Raise the window on the queue (and here) or checkpoint more often",
                need.as_secs_f64().ceil(),
                needs.replay_gap.as_secs_f64().ceil()
            )));
        }
        Ok(())
    }

    fn validate_breaker(&self) -> Result<(), ConfigError> {
        if !self.breaker.enabled {
            return Ok(());
        }
        if self.breaker.consecutive_failures == 0 || self.breaker.open_ms == 0 {
            return Err(invalid("breaker", "breaker.consecutive_failures and breaker.open_ms must be positive (or set breaker.enabled = false)"));
        }
        self.breaker
            .validate()
            .map_err(|e| invalid(e.key(), e))?;
        if Duration::from_millis(self.breaker.open_ms + self.breaker.probe_timeout_ms)
            >= Duration::from_secs(self.eventhubs.retention_hours * 3600)
        {
            return Err(invalid("breaker.open_ms", format!(
                "breaker.open_ms + breaker.probe_timeout_ms reaches eventhubs.retention_hours ({} h): a partition paused by the breaker would lose events to retention",
                self.eventhubs.retention_hours
            )));
        }
        Ok(())
    }

    /// What the retry queue must offer for this configuration: the start-up proof checks the
    /// queue's description against it, and validation the configured window.
    pub(crate) fn queue_needs(&self) -> crate::azure::retry_queue::QueueNeeds {
        crate::azure::retry_queue::QueueNeeds {
            replay_gap: self.replay_gap(),
            call_deadline: Duration::from_millis(self.retry.call_deadline_ms),
        }
    }

    /// Warnings about configurations that are allowed but risky.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        let retention = Duration::from_secs(self.eventhubs.retention_hours * 3600);
        if retention < Duration::from_secs(24 * 3600) {
            w.push(format!(
                "eventhubs.retention_hours is {}: a partition held longer than that (Service Bus or blob storage down) loses its oldest events to retention",
                self.eventhubs.retention_hours
            ));
        }
        w
    }

    /// The longest time from Service Bus accepting a retry message to a replay of its event
    /// re-sending the same MessageId, which the queue's duplicate-detection window must cover
    /// ([`crate::pipeline::replay_gap`], from `checkpoint.every_ms`,
    /// `processor.ownership_expiration_ms` and `retry.call_deadline_ms`).
    pub fn replay_gap(&self) -> Duration {
        crate::pipeline::replay_gap(
            Duration::from_millis(self.checkpoint.every_ms),
            Duration::from_millis(self.processor.ownership_expiration_ms),
            Duration::from_millis(self.retry.call_deadline_ms),
        )
    }

    /// `processor.retry_ordering` and `processor.line_on_dead_letter`, read.
    fn retry_ordering(&self) -> Result<crate::pipeline::RetryOrdering, ConfigError> {
        let on_dead_letter = self
            .processor
            .line_on_dead_letter
            .parse::<crate::pipeline::LineOnDeadLetter>()
            .map_err(|e| {
                invalid(
                    "processor.line_on_dead_letter",
                    format!("processor.line_on_dead_letter: {e}"),
                )
            })?;
        match self.processor.retry_ordering.as_str() {
            "off" => Ok(crate::pipeline::RetryOrdering::Off),
            "key" => {
                if self.processor.ordering_key == OrderingKey::None {
                    return Err(invalid(
                        "processor.retry_ordering",
                        "processor.retry_ordering = \"key\" needs an ordering key: processor.ordering_key is `none`",
                    ));
                }
                Ok(crate::pipeline::RetryOrdering::Key(on_dead_letter))
            }
            other => Err(invalid(
                "processor.retry_ordering",
                format!("processor.retry_ordering: expected `off` or `key`, got {other:?}"),
            )),
        }
    }

    /// The tunables this configuration sets (the rest at their defaults).
    pub fn pipeline_options(&self) -> Result<PipelineOptions, ConfigError> {
        Ok(PipelineOptions {
            owner_id: self
                .processor
                .owner_id
                .clone()
                .filter(|o| !o.is_empty())
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            update_interval: Duration::from_millis(self.processor.update_interval_ms),
            ownership_expiration: Duration::from_millis(self.processor.ownership_expiration_ms),
            checkpoint_every_events: self.checkpoint.every_events,
            checkpoint_every: Duration::from_millis(self.checkpoint.every_ms),
            checkpoint_min_interval: Duration::from_millis(self.checkpoint.min_interval_ms),
            max_in_flight: self.processor.max_in_flight,
            window: self.processor.window,
            ordering: self.processor.ordering_key.clone(),
            retry_ordering: self.retry_ordering()?,
            prefetch: self.processor.prefetch,
            start_at_latest: self.processor.start == StartPosition::Latest,
            deadline: Duration::from_millis(self.retry.call_deadline_ms),
            retry_concurrency: self.retry.concurrency,
            retry_lead: Duration::from_millis(self.retry.lead_ms),
            retry_prefetch: self.retry.prefetch,
            retry_receive_wait: Duration::from_millis(self.retry.receive_wait_ms),
            dead_letter_sweep: Duration::from_millis(self.retry.dead_letter_sweep_ms),
            overdue_margin: Duration::from_millis(self.retry.overdue_margin_ms),
            retention: (self.ledger.retention_days > 0)
                .then(|| Duration::from_secs(self.ledger.retention_days.saturating_mul(86_400))),
            unhealthy_after: (self.status.unhealthy_after_ms > 0)
                .then(|| Duration::from_millis(self.status.unhealthy_after_ms)),
            rate_limit: {
                let HandlerSection::Webhook(w) = &self.handler;
                crate::ratelimit::RateLimitConfig {
                    per_s: w.rate_limit,
                    adaptive: w.rate_limit_adaptive,
                }
            },
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[eventhubs]
connection_string = "Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
hub = "hub"
[servicebus]
connection_string = "Endpoint=sb://127.0.0.1:5380;SharedAccessKeyName=k;SharedAccessKey=TOPSECRET;UseDevelopmentEmulator=true"
[storage]
container_url = "http://127.0.0.1:10000/devstoreaccount1/hubguard"
[handler]
kind = "webhook"
url = "http://127.0.0.1:9000/events"
"#;

    fn none() -> Vec<(String, String)> {
        Vec::new()
    }

    #[test]
    fn a_webhook_problem_names_its_key() {
        let err = |url: &str| {
            Config::parse(&BASE.replace("http://127.0.0.1:9000/events", url), none()).unwrap_err()
        };
        let e = err("ftp://127.0.0.1/events");
        assert_eq!(e.key(), Some("handler.url"), "{e}");
        assert!(e.to_string().contains("http or https"), "{e}");
        let e = Config::parse(
            &format!("{BASE}[handler.handshake]\nenabled = true\norigin = \" \"\n"),
            none(),
        )
        .unwrap_err();
        assert_eq!(e.key(), Some("handler.handshake.origin"), "{e}");
    }

    #[test]
    fn the_example_file_parses() {
        let c = Config::parse(include_str!("../hubguard.example.toml"), none()).unwrap();
        assert_eq!(c.eventhubs.hub, "hub");
        assert!(c.policy.types.contains_key("order.created"));
    }

    #[test]
    fn the_dead_letter_queue_is_never_the_retry_queue_as_service_bus_compares_names() {
        let with = |retry: &str, dead: &str| {
            Config::parse(
                &format!(
                    "{}[dead_letters]\nqueue = {dead:?}\n",
                    BASE.replace("[storage]", &format!("queue = {retry:?}\n[storage]"))
                ),
                none(),
            )
        };
        // Different queues are fine, in any case.
        assert!(with("retries", "Dead-Letters").is_ok());
        assert!(with("orders/retries", "orders/dead-letters").is_ok());
        for (retry, dead) in [
            ("retries", "RETRIES"),
            ("Retries", "retries"),
            ("retries", " retries "),
            ("retries", "/retries/"),
            ("retries", "retries/$DeadLetterQueue"),
            ("retries", "RETRIES/$deadletterqueue"),
            ("orders/retries", "Orders/Retries/$DeadLetterQueue"),
            ("retries", "other/$DeadLetterQueue"),
            ("retries", "sb://NS.servicebus.windows.net/retries"),
            ("retries", ""),
        ] {
            let e = with(retry, dead).unwrap_err();
            let ConfigError::Invalid { key, message } = &e else {
                panic!("{retry} / {dead}: {e}")
            };
            assert_eq!(key, "dead_letters.queue", "{retry} / {dead}: {e}");
            assert!(message.contains("dead_letters.queue"), "{message}");
            assert!(!message.contains("TOPSECRET"), "{message}");
        }
    }

    #[test]
    fn the_example_configuration_allows_a_thousand_events_per_s_per_partition_at_50_ms() {
        for text in [include_str!("../hubguard.example.toml"), BASE] {
            let o = Config::parse(text, none())
                .unwrap()
                .pipeline_options()
                .unwrap();
            let handler = 0.050;
            assert!(
                o.max_in_flight as f64 / handler >= 1000.0,
                "max_in_flight {} with a 50 ms handler allows {} events/s",
                o.max_in_flight,
                o.max_in_flight as f64 / handler
            );
            assert_eq!(o.ordering, crate::pipeline::OrderingKey::PartitionKey);
            assert!(o.retry_concurrency as f64 / handler >= 1000.0);
            assert!(
                o.prefetch as usize >= o.max_in_flight,
                "prefetch keeps the slots fed"
            );
            assert!(
                o.window > o.max_in_flight,
                "settled events wait in the window, not in a slot"
            );
        }
        let o = Config::parse(&format!("{BASE}[processor]\nwindow = 512\n"), none())
            .unwrap()
            .pipeline_options()
            .unwrap();
        assert_eq!(o.window, 512);
        let e = Config::parse(&format!("{BASE}[processor]\nwindow = 1000000\n"), none())
            .unwrap_err()
            .to_string();
        assert!(e.contains("processor.window"), "{e}");
    }

    #[test]
    fn defaults_and_env_overrides() {
        let c = Config::parse(BASE, none()).unwrap();
        assert_eq!(c.servicebus.queue, "retries");
        assert_eq!(c.policy.default, RetryPolicy::seed_fibonacci());
        let env = vec![
            ("HUBGUARD_EVENTHUBS__HUB".to_string(), "orders".to_string()),
            (
                "HUBGUARD_POLICY__DEFAULT__MAX_ATTEMPTS".to_string(),
                "5".to_string(),
            ),
            (
                "HUBGUARD_CHECKPOINT__EVERY_MS".to_string(),
                "250".to_string(),
            ),
            ("HUBGUARD_EMULATOR_KEY".to_string(), "ignored".to_string()),
        ];
        let c = Config::parse(BASE, env).unwrap();
        assert_eq!(c.eventhubs.hub, "orders");
        assert_eq!(c.policy.default.max_attempts, 5);
        assert_eq!(c.checkpoint.every_ms, 250);
    }

    #[test]
    fn errors_are_typed_by_where_the_problem_is() {
        let parse = |extra: &str, env: Vec<(String, String)>| {
            Config::parse(&format!("{BASE}{extra}"), env).unwrap_err()
        };
        let var = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        assert!(matches!(
            Config::parse("[eventhubs\n", none()).unwrap_err(),
            ConfigError::Syntax(_)
        ));
        assert!(matches!(
            parse("", var("HUBGUARD_RETRY_CONCURRENCY", "4")),
            ConfigError::Environment { var, .. } if var == "HUBGUARD_RETRY_CONCURRENCY"
        ));
        let e = parse("", var("HUBGUARD_CHECKPOINT__EVERY_EVENTS", "abc"));
        assert_eq!(e.key(), Some("checkpoint.every_events"));
        assert!(matches!(
            &e,
            ConfigError::Value { env_var: Some(v), .. } if v == "HUBGUARD_CHECKPOINT__EVERY_EVENTS"
        ));
        let e = parse("[retry]\ncall_deadline_ms = 0\n", none());
        assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
        assert_eq!(e.key(), Some("retry.call_deadline_ms"));
        let e = Config::load(Path::new("/nonexistent/hubguard.toml"), none()).unwrap_err();
        assert!(matches!(e, ConfigError::Unreadable { .. }), "{e:?}");
        assert!(e.to_string().contains("/nonexistent/hubguard.toml"), "{e}");
    }

    #[test]
    fn type_errors_and_impossible_values_name_the_key_or_the_variable() {
        let bad = |extra: &str, env: Vec<(String, String)>| {
            Config::parse(&format!("{BASE}{extra}"), env)
                .unwrap_err()
                .to_string()
        };
        let var = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        for (extra, env, named) in [
            ("[checkpoint]\nevery_events = \"100\"\n", none(), "checkpoint.every_events"),
            ("", var("HUBGUARD_CHECKPOINT__EVERY_EVENTS", "abc"), "HUBGUARD_CHECKPOINT__EVERY_EVENTS"),
            ("timeout_ms = -5\n", none(), "timeout_ms"),
            (
                "[policy.default]\ncurve = \"fibonaci\"\nbase_s = 1\nfloor_s = 1\ncap_s = 9\nmax_attempts = 3\n",
                none(),
                "policy.default.curve",
            ),
            ("[status]\nlisten = \"localhost:eighty\"\n", none(), "status.listen"),
            ("timeout_ms = 0\n", none(), "handler.timeout_ms"),
            ("rate_limit = 0\n", none(), "handler.rate_limit"),
            ("rate_limit = -5.5\n", none(), "handler.rate_limit"),
            ("rate_limit = \"fast\"\n", none(), "handler.rate_limit"),
            ("", var("HUBGUARD_HANDLER__RATE_LIMIT", "0"), "handler.rate_limit"),
            ("[retry]\ncall_deadline_ms = 0\n", none(), "retry.call_deadline_ms"),
            ("[processor]\nprefetch = 0\n", none(), "processor.prefetch"),
            (
                "[policy.default]\ncurve = \"fixed\"\nbase_s = \"ten\"\nfloor_s = 1\ncap_s = 9\nmax_attempts = 3\n",
                none(),
                "base_s",
            ),
            ("[processor]\nupdate_interval_ms = 0\n", none(), "processor.update_interval_ms"),
            ("", var("HUBGUARD_RETRY_CONCURRENCY", "4"), "HUBGUARD_RETRY_CONCURRENCY"),
        ] {
            let e = bad(extra, env);
            assert!(e.contains(named), "{named}: {e}");
        }
        let ftp = Config::parse(
            &BASE.replace("http://127.0.0.1:10000", "ftp://127.0.0.1:10000"),
            none(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            ftp.contains("storage.container_url") && ftp.contains("ftp"),
            "{ftp}"
        );
        // A number where the connection string goes names the key, never a value.
        let e = bad("", var("HUBGUARD_SERVICEBUS__CONNECTION_STRING", "12"));
        assert!(
            e.contains("HUBGUARD_SERVICEBUS__CONNECTION_STRING") && !e.contains("12"),
            "{e}"
        );
    }

    #[test]
    fn secret_keys_are_redacted_and_others_keep_their_message() {
        assert!(is_secret_path("eventhubs.connection_string"));
        assert!(is_secret_path("storage.container_url"));
        assert!(is_secret_path("handler.signing.secret"));
        assert!(!is_secret_path("processor.ordering_key"));
        assert!(!is_secret_path("identity.idempotency_key_properties"));
        let e = Config::parse(&format!("{BASE}[processor]\nordering_key = 5\n"), none())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("processor.ordering_key") && e.contains("expected"),
            "{e}"
        );
    }

    #[test]
    fn kubernetes_service_links_are_not_taken_for_overrides() {
        let env = vec![
            ("HUBGUARD_SERVICE_HOST".to_string(), "10.0.0.1".to_string()),
            ("HUBGUARD_SERVICE_PORT".to_string(), "8080".to_string()),
            (
                "HUBGUARD_SERVICE_PORT_STATUS".to_string(),
                "8080".to_string(),
            ),
            (
                "HUBGUARD_PORT".to_string(),
                "tcp://10.0.0.1:8080".to_string(),
            ),
            (
                "HUBGUARD_PORT_8080_TCP".to_string(),
                "tcp://10.0.0.1:8080".to_string(),
            ),
            (
                "HUBGUARD_PORT_8080_TCP_ADDR".to_string(),
                "10.0.0.1".to_string(),
            ),
        ];
        Config::parse(BASE, env).expect("service links are ignored");
    }

    #[test]
    fn errors_name_the_key_and_never_the_secret() {
        let bad = |extra: &str| {
            Config::parse(&format!("{BASE}{extra}"), none())
                .unwrap_err()
                .to_string()
        };
        let e = bad("[checkpoint]\nevry_ms = 5\n");
        assert!(e.contains("evry_ms"), "{e}");
        let e = bad("[policy.default]\ncurve = \"fibonacci\"\nmax_attempts = 0\n");
        assert!(
            e.contains("policy.default") && e.contains("max_attempts"),
            "{e}"
        );
        let e = bad("[policy.types.\"x\"]\ncurve = \"fixed\"\nmax_attempts = 3\nbase = 4\n");
        assert!(
            e.contains("policy.types.\"x\"") && e.contains("`base`"),
            "{e}"
        );
        let e = bad("[processor]\nownership_expiration_ms = 100\nupdate_interval_ms = 200\n");
        assert!(e.contains("ownership_expiration_ms"), "{e}");
        let e = Config::parse(&BASE.replace("SharedAccessKeyName=k;", ""), none())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("eventhubs.connection_string") && e.contains("SharedAccessKeyName"),
            "{e}"
        );
        assert!(!e.contains("TOPSECRET"));
        let e = Config::parse(
            &BASE.replace("hub = \"hub\"", "hub = \"hub\"\nhub = \"x\""),
            none(),
        )
        .unwrap_err()
        .to_string();
        assert!(!e.contains("TOPSECRET"), "{e}");
        let e = bad("[servicebus_extra]\n");
        assert!(e.contains("servicebus_extra"), "{e}");
        // Debug output (which may reach a log or a panic) redacts the secrets too.
        let c = Config::parse(BASE, none()).unwrap();
        assert!(!format!("{c:?}").contains("TOPSECRET"));
    }

    #[test]
    fn a_breaker_open_longer_than_retention_is_refused() {
        let c = format!("{BASE}[breaker]\nopen_ms = 90000000\n");
        let e = Config::parse(&c, none()).unwrap_err().to_string();
        assert!(
            e.contains("breaker.open_ms") && e.contains("retention"),
            "{e}"
        );
        let off = format!("{BASE}[breaker]\nenabled = false\nopen_ms = 90000000\n");
        assert!(Config::parse(&off, none()).is_ok());
    }

    #[test]
    fn a_short_duplicate_window_is_refused() {
        let c = BASE.replace("[storage]", "duplicate_detection_window_s = 30\n[storage]");
        let e = Config::parse(&c, none()).unwrap_err().to_string();
        assert!(e.contains("duplicate_detection_window_s"), "{e}");
    }
    #[test]
    fn the_duplicate_window_covers_a_redelivered_retry_as_the_queue_proof_does() {
        // A short replay gap (1 s + 10 s + 4 × 10 s + 60 s = 111 s), shorter than a
        // redelivered retry's re-send (60 s lock + 4 × 10 s + 60 s = 160 s): the window must
        // cover the longer, as `QueueNeeds::window` requires at start-up.
        let with_window = |s: u64| {
            BASE.replace(
                "[storage]",
                &format!("duplicate_detection_window_s = {s}\n[storage]"),
            ) + "[checkpoint]\nevery_ms = 1000\nmin_interval_ms = 500\n[processor]\nupdate_interval_ms = 2000\nownership_expiration_ms = 10000\n[retry]\ncall_deadline_ms = 10000\n"
        };
        let c = Config::parse(&with_window(160), none()).unwrap();
        assert_eq!(c.replay_gap(), Duration::from_secs(111));
        assert_eq!(c.queue_needs().window(None), Duration::from_secs(160));
        let e = Config::parse(&with_window(120), none()).unwrap_err();
        assert_eq!(e.key(), Some("servicebus.duplicate_detection_window_s"));
        let e = e.to_string();
        assert!(e.contains("(120)") && e.contains("needs (160 s"), "{e}");
    }

    #[test]
    fn start_and_ordering_key_are_read_once_into_their_types() {
        let c = Config::parse(
            &(BASE.to_string()
                + "[processor]\nstart = \"latest\"\nordering_key = \"property:order\"\n"),
            none(),
        )
        .unwrap();
        assert_eq!(c.processor.start, StartPosition::Latest);
        assert_eq!(
            c.processor.ordering_key,
            OrderingKey::Property("order".into())
        );
        let o = c.pipeline_options().unwrap();
        assert!(o.start_at_latest);
        assert_eq!(o.ordering, OrderingKey::Property("order".into()));
        let e = Config::parse(
            &(BASE.to_string() + "[processor]\nordering_key = \"colour\"\n"),
            none(),
        )
        .unwrap_err();
        assert_eq!(e.key(), Some("processor.ordering_key"));
        assert!(e.to_string().contains("property:<name>"), "{e}");
        let e = Config::parse(
            &(BASE.to_string() + "[processor]\nstart = \"middle\"\n"),
            none(),
        )
        .unwrap_err();
        assert_eq!(e.key(), Some("processor.start"));
        assert!(e.to_string().contains("earliest"), "{e}");
    }

    #[test]
    fn ordered_retries_are_off_unless_asked_for_and_checked() {
        use crate::pipeline::{LineOnDeadLetter, RetryOrdering};
        let o = Config::parse(BASE, none())
            .unwrap()
            .pipeline_options()
            .unwrap();
        assert_eq!(o.retry_ordering, RetryOrdering::Off, "today's behaviour");
        let on = |extra: &str| {
            Config::parse(&format!("{BASE}[processor]\n{extra}"), none())
                .and_then(|c| c.pipeline_options())
        };
        assert_eq!(
            on("retry_ordering = \"key\"\n").unwrap().retry_ordering,
            RetryOrdering::Key(LineOnDeadLetter::Release)
        );
        assert_eq!(
            on("retry_ordering = \"key\"\nline_on_dead_letter = \"dead_letter_line\"\n")
                .unwrap()
                .retry_ordering,
            RetryOrdering::Key(LineOnDeadLetter::DeadLetterLine)
        );
        let e = on("retry_ordering = \"strict\"\n").unwrap_err().to_string();
        assert!(
            e.contains("processor.retry_ordering") && e.contains("`key`"),
            "{e}"
        );
        let e = on("retry_ordering = \"key\"\nline_on_dead_letter = \"drop\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("processor.line_on_dead_letter"), "{e}");
        let e = on("retry_ordering = \"key\"\nordering_key = \"none\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("processor.ordering_key is `none`"), "{e}");
    }

    #[test]
    fn concurrency_and_checkpoint_pacing_are_configured_and_checked() {
        let c = Config::parse(
            &format!("{BASE}[processor]\nmax_in_flight = 32\nordering_key = \"property:order_id\"\n[checkpoint]\nmin_interval_ms = 250\n"),
            none(),
        )
        .unwrap();
        let o = c.pipeline_options().unwrap();
        assert_eq!(o.max_in_flight, 32);
        assert_eq!(
            o.ordering,
            crate::pipeline::OrderingKey::Property("order_id".into())
        );
        assert_eq!(o.checkpoint_min_interval, Duration::from_millis(250));
        let defaults = Config::parse(BASE, none()).unwrap();
        assert_eq!(
            defaults.processor.max_in_flight, DEFAULT_MAX_IN_FLIGHT,
            "sized for a web downstream unless told"
        );
        let bad = |extra: &str| {
            Config::parse(&format!("{BASE}{extra}"), none())
                .unwrap_err()
                .to_string()
        };
        let e = bad("[processor]\nmax_in_flight = 0\n");
        assert!(e.contains("processor.max_in_flight"), "{e}");
        let e = bad("[processor]\nordering_key = \"customer\"\n");
        assert!(
            e.contains("processor.ordering_key") && e.contains("property:<name>"),
            "{e}"
        );
        let e = bad("[checkpoint]\nevery_ms = 100\nmin_interval_ms = 500\n");
        assert!(e.contains("checkpoint.min_interval_ms"), "{e}");
        let e = bad("[retry]\ndead_letter_sweep_ms = 0\n");
        assert!(e.contains("retry.dead_letter_sweep_ms"), "{e}");
        let e = bad("[retry]\nprefetch = 0\n");
        assert!(e.contains("retry.prefetch"), "{e}");
        let o = Config::parse(
            &format!("{BASE}[retry]\nlead_ms = 0\nprefetch = 64\n"),
            none(),
        )
        .unwrap()
        .pipeline_options()
        .unwrap();
        assert_eq!((o.retry_lead, o.retry_prefetch), (Duration::ZERO, 64));
        let o = defaults.pipeline_options().unwrap();
        let d = PipelineOptions::default();
        assert_eq!(
            (o.retry_lead, o.retry_prefetch),
            (d.retry_lead, d.retry_prefetch)
        );
        let e = Config::parse(
            BASE,
            vec![("HUBGUARD_PROCESSOR__MAX_IN_FLIGHT".into(), "8".into())],
        )
        .unwrap();
        assert_eq!(e.processor.max_in_flight, 8, "environment override");
    }
}
