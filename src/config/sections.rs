//! The raw schema: one struct per TOML section as serde reads it, with its defaults, and
//! the credential choice each Azure section makes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::azure::ConnectionString;
use crate::handler::webhook::WebhookConfig;
use crate::pipeline::{OrderingKey, PipelineOptions};
use crate::policy::RetryPolicy;

use super::{checks::dead_letter_queue_is_not_the_retry_queue, invalid, ConfigError};

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
            .field("rest_endpoint", &self.rest_endpoint)
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

/// Ordered retries on or off (`processor.retry_ordering`); with `key`, the pipeline's
/// [`RetryOrdering`](crate::pipeline::RetryOrdering) also takes `processor.line_on_dead_letter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryOrderingKind {
    /// A retry does not hold the later events of its key (the default).
    #[default]
    Off,
    /// The later events of a key waiting for a retry are parked behind it.
    Key,
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
    /// The namespace's REST endpoint, whose answers' `Date` is Event Hubs's clock for
    /// `hubguard check`. Unset: `https://{namespace host}/` (what Azure serves, port 443);
    /// set it only for an emulator (`hubguard emulator` prints its `eventhubs-rest:` URL).
    #[serde(default)]
    pub rest_endpoint: Option<String>,
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
    pub(super) fn validate(&self, retry_queue: &str) -> Result<(), ConfigError> {
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
    /// Events of one partition in their handler call at once (1: strictly one by one);
    /// as many more may be settling (see `docs/guarantee.md`).
    pub max_in_flight: usize,
    /// What keeps events in order when `max_in_flight` > 1: `partition_key`,
    /// `property:<name>` or `none`.
    pub ordering_key: OrderingKey,
    /// Ordered retries: `off` (default) or `key` — while an event of an ordering key waits
    /// for a retry, the later events of that key on its partition are parked behind it.
    pub retry_ordering: RetryOrderingKind,
    /// With `retry_ordering = "key"`, what a line does when its head is dead-lettered:
    /// `release` (the next parked event runs) or `dead_letter_line` (the parked events
    /// follow it into the dead letters).
    pub line_on_dead_letter: crate::pipeline::LineOnDeadLetter,
    /// Most events read past the partition's oldest unsettled one (at least
    /// `max_in_flight`): settled events behind a slow one wait here, not in a slot.
    /// Unset: [`window_for`] `max_in_flight`.
    pub window: Option<usize>,
    /// Threads the consumer runs on, partitions spread over them; 0: one per core.
    pub threads: usize,
}

/// `processor.max_in_flight` when the file does not say: sized for a downstream at web
/// latencies. Events of one partition at once ÷ handler latency bounds a partition's rate:
/// 64 ÷ 50 ms = 1,280 events/s, above the 1,000 events/s a Standard partition takes in
/// ("Event Hubs quotas and limits", https://learn.microsoft.com/azure/event-hubs/event-hubs-quotas).
/// Events sharing an ordering key still run one after another.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;

/// `processor.window` when the file does not say, for `max_in_flight` slots: four times
/// them (at most [`MAX_WINDOW`]; 256 for the default 64), so a few events slow to settle
/// (each failure writes the ledger and sends to Service Bus) do not leave the slots idle
/// behind them. Raising `max_in_flight` (for batches, say) raises it too.
pub(crate) const fn window_for(max_in_flight: usize) -> usize {
    let w = max_in_flight.saturating_mul(4);
    if w > MAX_WINDOW {
        MAX_WINDOW
    } else {
        w
    }
}

/// The largest `processor.window`: each event in it is held in memory.
pub(crate) const MAX_WINDOW: usize = 100_000;

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
            threads: o.partition_threads,
            ordering_key: o.ordering,
            retry_ordering: RetryOrderingKind::Off,
            line_on_dead_letter: crate::pipeline::LineOnDeadLetter::default(),
            window: None,
        }
    }
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

impl Default for RetrySection {
    fn default() -> Self {
        let o = PipelineOptions::default();
        Self {
            concurrency: DEFAULT_RETRY_CONCURRENCY,
            lead_ms: ms_of(o.retry_lead),
            prefetch: o.retry_prefetch,
            receive_wait_ms: ms_of(o.retry_receive_wait),
            pause_recheck_ms: ms_of(o.retry_pause_recheck),
            call_deadline_ms: ms_of(o.deadline),
            dead_letter_sweep_ms: ms_of(o.dead_letter_sweep),
            overdue_margin_ms: ms_of(o.overdue_margin),
        }
    }
}

impl Default for StatusSection {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            unhealthy_after_ms: PipelineOptions::default().unhealthy_after.map_or(0, ms_of),
            backlog_every_ms: ms_of(PipelineOptions::default().backlog_every),
            max_clock_skew_ms: ms_of(PipelineOptions::default().max_clock_skew),
        }
    }
}

impl Default for PolicySection {
    fn default() -> Self {
        Self {
            default: RetryPolicy::seed_fibonacci(),
            types: HashMap::new(),
        }
    }
}

impl Default for LedgerSection {
    fn default() -> Self {
        Self {
            retention_days: crate::pipeline::DEFAULT_RETENTION.as_secs() / 86_400,
            lifecycle_tags: false,
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
    /// A retry due while an operator paused it (`hubguard retries pause`) is deferred this
    /// long (ms), without counting an attempt, and looked at again.
    pub pause_recheck_ms: u64,
    /// Deadline of every call to Service Bus, blob storage and Event Hubs (ms).
    pub call_deadline_ms: u64,
    /// How often the queue's dead-letter sub-queue is swept for retries Service Bus gave up
    /// on (ms; also once at start).
    pub dead_letter_sweep_ms: u64,
    /// A retry the ledger says was due this long ago (ms), with no retry message arriving,
    /// is scheduled again under a fresh MessageId by the same sweep.
    pub overdue_margin_ms: u64,
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
    /// How often the backlog (`GET /v1/backlog`, `hubguard.backlog.events`) is sampled (ms).
    pub backlog_every_ms: u64,
    /// `/readyz` answers 503 while this host's clock is measured further than this (ms) from
    /// Service Bus's (docs/clocks.md); hubguard corrects for it either way. `hubguard check`
    /// fails a service's clock line beyond it.
    pub max_clock_skew_ms: u64,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
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

/// `[operational_events]`: CloudEvents about hubguard itself (the breaker opening and closing,
/// a partition held too long, dead letters, the rate limit lowered; docs/telemetry.md) to a
/// webhook (`url`) or a Service Bus queue or topic (`queue`, in the `[servicebus]` namespace).
/// Absent: none.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationalEventsSection {
    /// The webhook (`https://…`) the events are POSTed to (or `queue`).
    pub url: Option<String>,
    /// The Service Bus queue or topic the events are sent to (or `url`).
    pub queue: Option<String>,
    /// Standard Webhooks signing secrets for the webhook (`whsec_…`): where they are.
    pub signing: Option<crate::handler::secret::SecretSource>,
    /// Each send's deadline (ms).
    #[serde(default = "ops_timeout_ms")]
    pub timeout_ms: u64,
    /// Per type and subject, at most one event in this window (ms); later ones are counted
    /// into the next (`data.suppressed`).
    #[serde(default = "ops_window_ms")]
    pub suppression_ms: u64,
    /// A partition held longer than this (ms) is reported.
    #[serde(default = "ops_window_ms")]
    pub held_longer_than_ms: u64,
    /// Events waiting for the destination at most; more are dropped (counted).
    #[serde(default = "ops_queue_size")]
    pub queue_size: usize,
}

fn ops_timeout_ms() -> u64 {
    5_000
}

fn ops_window_ms() -> u64 {
    ms_of(crate::opsevents::OpsEventsSettings::default().suppression)
}

fn ops_queue_size() -> usize {
    crate::opsevents::OpsEventsSettings::default().queue_size
}

impl OperationalEventsSection {
    /// Exactly one destination, a URL that is one, a queue that is not the retry queue, and
    /// windows and sizes that make sense.
    pub(super) fn validate(&self, retry_queue: &str) -> Result<(), ConfigError> {
        match (&self.url, &self.queue) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(invalid(
                    "operational_events",
                    "operational_events: set `url` (a webhook) or `queue` (a Service Bus queue or topic), exactly one",
                ))
            }
            (Some(url), None) => {
                let ok = reqwest::Url::parse(url)
                    .is_ok_and(|u| matches!(u.scheme(), "https" | "http") && u.host().is_some());
                if !ok {
                    return Err(invalid(
                        "operational_events.url",
                        format!(
                            "operational_events.url must be an http(s) URL, got {}",
                            crate::redact::redact(url)
                        ),
                    ));
                }
            }
            (None, Some(q)) => {
                let (k, r) = (super::entity_key(q), super::entity_key(retry_queue));
                if k.is_empty() || k == r || k.contains('$') || k.contains("://") {
                    return Err(invalid("operational_events.queue", format!(
                        "operational_events.queue ({q:?}) must name a queue or topic of its own in the [servicebus] namespace: not empty, not servicebus.queue, not a system sub-queue, not an address"
                    )));
                }
                if self.signing.is_some() {
                    return Err(invalid(
                        "operational_events.signing",
                        "operational_events.signing signs webhook requests; with `queue` Service Bus authenticates the sender",
                    ));
                }
            }
        }
        for (key, value, min) in [
            ("operational_events.timeout_ms", self.timeout_ms, 100),
            (
                "operational_events.suppression_ms",
                self.suppression_ms,
                1_000,
            ),
            (
                "operational_events.held_longer_than_ms",
                self.held_longer_than_ms,
                1_000,
            ),
            ("operational_events.queue_size", self.queue_size as u64, 1),
        ] {
            if value < min {
                return Err(invalid(
                    key,
                    format!("{key} must be at least {min} (got {value})"),
                ));
            }
        }
        if self.queue_size > 65_536 {
            return Err(invalid(
                "operational_events.queue_size",
                "operational_events.queue_size must be at most 65536",
            ));
        }
        Ok(())
    }

    /// The settings of [`crate::opsevents::OpsEvents`].
    pub fn settings(&self) -> crate::opsevents::OpsEventsSettings {
        crate::opsevents::OpsEventsSettings {
            suppression: Duration::from_millis(self.suppression_ms),
            held_longer_than: Duration::from_millis(self.held_longer_than_ms),
            queue_size: self.queue_size,
            ..Default::default()
        }
    }
}

/// `[console]`: the web console `hubguard run` serves on `status.listen` (docs/console.md).
/// Reading needs no credential unless `reader_token` is set; acting always needs the
/// operator role (`operator_token`, or a user named in `operators` behind a trusted
/// authenticating proxy).
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsoleSection {
    /// Serve the console at `/console` (and `/` redirects there). On by default.
    pub enabled: bool,
    /// A link to an attempt's trace: `{trace_id}` (and `{key}`, `{correlation_id}`) are
    /// replaced, percent-encoded; `http://` or `https://` only. None: no link.
    pub trace_url: Option<String>,
    /// A token that grants reading (`Authorization: Bearer …`); none: reading is open, as
    /// `/v1/*` is. Prefer `reader_token_file` or `HUBGUARD_CONSOLE__READER_TOKEN`.
    pub reader_token: Option<String>,
    /// A file holding the reader token (its first line).
    pub reader_token_file: Option<std::path::PathBuf>,
    /// A token that grants acting (and reading); none: actions need the proxy's user.
    pub operator_token: Option<String>,
    /// A file holding the operator token (its first line).
    pub operator_token_file: Option<std::path::PathBuf>,
    /// The header an authenticating proxy in front sets to the user (`X-Auth-Request-User`,
    /// `X-Auth-Request-Email` for oauth2-proxy, or `X-Forwarded-User`); trusted only when
    /// set here. Every user it names may read.
    pub trusted_user_header: Option<String>,
    /// Users (as the trusted header names them) who may act.
    pub operators: Vec<String>,
    /// Origins besides the console's own (`https://console.example.com`) whose pages may
    /// act: the console behind a proxy on another host name.
    pub allowed_origins: Vec<String>,
}

impl Default for ConsoleSection {
    fn default() -> Self {
        Self {
            enabled: true,
            trace_url: None,
            reader_token: None,
            reader_token_file: None,
            operator_token: None,
            operator_token_file: None,
            trusted_user_header: None,
            operators: Vec::new(),
            allowed_origins: Vec::new(),
        }
    }
}

impl std::fmt::Debug for ConsoleSection {
    /// Whether a token is set, never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |t: &Option<String>| t.as_ref().map(|_| "<set>");
        f.debug_struct("ConsoleSection")
            .field("enabled", &self.enabled)
            .field("trace_url", &self.trace_url)
            .field("reader_token", &set(&self.reader_token))
            .field("reader_token_file", &self.reader_token_file)
            .field("operator_token", &set(&self.operator_token))
            .field("operator_token_file", &self.operator_token_file)
            .field("trusted_user_header", &self.trusted_user_header)
            .field("operators", &self.operators)
            .field("allowed_origins", &self.allowed_origins)
            .finish()
    }
}

/// The proxy headers `console.trusted_user_header` may name (lower case).
pub(super) const CONSOLE_USER_HEADERS: &[&str] = &[
    "x-auth-request-user",
    "x-auth-request-email",
    "x-forwarded-user",
];

impl ConsoleSection {
    /// The checks serde cannot make: the trace template's scheme and placeholder, the
    /// header's name, a token given twice, the origins' form.
    pub fn check(&self) -> Result<(), ConfigError> {
        if let Some(t) = &self.trace_url {
            if !(t.starts_with("http://") || t.starts_with("https://")) || !t.contains("{trace_id}")
            {
                return Err(invalid("console.trace_url", format!(
                    "console.trace_url ({t:?}) must be an http:// or https:// URL containing {{trace_id}}, such as \"http://localhost:16686/trace/{{trace_id}}\""
                )));
            }
        }
        if let Some(h) = &self.trusted_user_header {
            if !CONSOLE_USER_HEADERS.contains(&h.to_ascii_lowercase().as_str()) {
                return Err(invalid("console.trusted_user_header", format!(
                    "console.trusted_user_header ({h:?}) must be one of X-Auth-Request-User, X-Auth-Request-Email, X-Forwarded-User"
                )));
            }
        }
        if !self.operators.is_empty() && self.trusted_user_header.is_none() {
            return Err(invalid(
                "console.operators",
                "console.operators names proxy users: set console.trusted_user_header too",
            ));
        }
        for (token, file, role) in [
            (&self.reader_token, &self.reader_token_file, "reader"),
            (&self.operator_token, &self.operator_token_file, "operator"),
        ] {
            if token.is_some() && file.is_some() {
                return Err(invalid(
                    format!("console.{role}_token"),
                    format!("give console.{role}_token or console.{role}_token_file, not both"),
                ));
            }
        }
        for o in &self.allowed_origins {
            let ok = url::Url::parse(o).is_ok_and(|u| {
                matches!(u.scheme(), "http" | "https") && u.path() == "/" && !o.ends_with('/')
            });
            if !ok {
                return Err(invalid("console.allowed_origins", format!(
                    "console.allowed_origins: {o:?} is not an origin (scheme://host[:port], no path)"
                )));
            }
        }
        Ok(())
    }
}
