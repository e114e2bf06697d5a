//! The checkpoint-guarded pipeline.
//!
//! ```text
//!  Event Hubs ──► EventProcessor (SDK load balancing, fenced blob checkpoints)
//!                   └─► partition task: attempt ─► settle ─► checkpoint window ─► checkpoint
//!                                                   │
//!              ledger (blob, CAS) ◄─────────────────┤
//!              Service Bus (scheduled retry) ◄──────┘
//!  Service Bus ──► retry loop: ledger check ─► attempt ─► settle ─► complete / abandon
//! ```
//!
//! [`Pipeline::run`] runs both halves until cancelled. The SDK's partition streams are
//! `!Send`, so the processor and its partition tasks run on a thread of their own
//! (current-thread runtime + `LocalSet`); the retry loop runs on the caller's runtime.

mod admission;
mod attempt;
mod backoff;
mod checkpoint;
pub mod control;
pub mod dead_letter;
mod handover;
pub mod health;
mod lines;
mod message_id;
mod observe;
pub mod owner;
mod partition;
pub mod readback;
mod recorded;
mod retention;
mod retry;
#[cfg(any(test, feature = "testbed"))]
pub mod rewind;
pub mod settle;

use std::sync::Arc;
use std::time::Duration;

use azure_messaging_eventhubs::models::StartPositions;
use azure_messaging_eventhubs::{
    CheckpointStore, ConsumerClient, EventProcessor, StartLocation, StartPosition,
};
use tokio_util::sync::CancellationToken;

use self::checkpoint::FencedCheckpointStore;
use self::health::Health;
use self::settle::{Policies, Settler};
use crate::azure::{RecordStore, RetryQueue};
use crate::event::IdentityConfig;
use crate::handler::Handler;
use crate::ledger::Ledger;

/// How to reach the Event Hub.
#[derive(Clone)]
pub struct EventHubsTarget {
    /// Namespace as the SDK names it (`ns.servicebus.windows.net`); with a connection string
    /// the SDK takes the endpoint's host instead.
    pub namespace: String,
    /// `amqp://host:port` for an emulator; `None` for the service's TLS endpoint.
    pub custom_endpoint: Option<String>,
    /// The hub.
    pub hub: String,
    /// The consumer group.
    pub consumer_group: String,
    /// How to authenticate (connection string or Entra ID credential).
    pub auth: crate::azure::EventHubsAuth,
}

impl std::fmt::Debug for EventHubsTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventHubsTarget")
            .field("namespace", &self.namespace)
            .field("custom_endpoint", &self.custom_endpoint)
            .field("hub", &self.hub)
            .field("consumer_group", &self.consumer_group)
            .field("auth", &self.auth)
            .finish()
    }
}

/// What keeps events of one partition in order when several run at once. Read from the
/// configuration's spelling (`partition_key`, `property:<name>`, `none`).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum OrderingKey {
    /// The event's partition key (events without one are not ordered against others).
    #[default]
    PartitionKey,
    /// An application property (events without it are not ordered against others).
    Property(String),
    /// No ordering within the partition beyond `max_in_flight`.
    None,
}

impl OrderingKey {
    /// The key of `event` (`None`: not ordered).
    pub fn of<'e>(&self, event: &'e crate::event::Event) -> Option<&'e str> {
        match self {
            Self::PartitionKey => event.partition_key.as_deref(),
            Self::Property(name) => event.properties.get(name).map(String::as_str),
            Self::None => None,
        }
    }
}

/// Not an ordering key's spelling.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected `partition_key`, `property:<name>` or `none`, got {0:?}")]
pub struct BadOrderingKey(pub String);

impl std::str::FromStr for OrderingKey {
    type Err = BadOrderingKey;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "partition_key" => Ok(Self::PartitionKey),
            "none" => Ok(Self::None),
            _ => match s.strip_prefix("property:") {
                Some(p) if !p.trim().is_empty() => Ok(Self::Property(p.trim().to_string())),
                _ => Err(BadOrderingKey(s.to_string())),
            },
        }
    }
}

impl TryFrom<String> for OrderingKey {
    type Error = BadOrderingKey;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl std::fmt::Display for OrderingKey {
    /// The configuration's spelling, which [`FromStr`](std::str::FromStr) reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PartitionKey => f.write_str("partition_key"),
            Self::Property(p) => write!(f, "property:{p}"),
            Self::None => f.write_str("none"),
        }
    }
}

/// Ordered retries (`processor.retry_ordering`): whether an event of an ordering key waiting
/// for a retry holds the later events of its key on its partition in a durable line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RetryOrdering {
    /// Today's behaviour: a retry does not hold the later events of its key.
    #[default]
    Off,
    /// While an event of ordering key K waits for a retry (or is parked), every later event
    /// of K on its partition is parked behind it and delivered, in sequence order, once it
    /// settles; what happens when it is dead-lettered is the value.
    Key(LineOnDeadLetter),
}

impl RetryOrdering {
    /// What a line does when its head is dead-lettered, when lines are on.
    pub fn lines(&self) -> Option<LineOnDeadLetter> {
        match self {
            Self::Off => None,
            Self::Key(d) => Some(*d),
        }
    }
}

/// What a line does when its head is dead-lettered (`processor.line_on_dead_letter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LineOnDeadLetter {
    /// The line moves on: the next parked event is delivered.
    #[default]
    Release,
    /// The parked events follow the head into the dead letters, with reason
    /// `line_dead_lettered`.
    DeadLetterLine,
}

/// Not a [`LineOnDeadLetter`]'s spelling.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected `release` or `dead_letter_line`, got {0:?}")]
pub struct BadLineOnDeadLetter(pub String);

impl std::str::FromStr for LineOnDeadLetter {
    type Err = BadLineOnDeadLetter;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "release" => Ok(Self::Release),
            "dead_letter_line" => Ok(Self::DeadLetterLine),
            _ => Err(BadLineOnDeadLetter(s.to_string())),
        }
    }
}

impl std::fmt::Display for LineOnDeadLetter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Release => "release",
            Self::DeadLetterLine => "dead_letter_line",
        })
    }
}

/// Tunables.
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    /// This replica's owner id (unique per live replica).
    pub owner_id: String,
    /// The processor's load-balancing interval.
    pub update_interval: Duration,
    /// Ownership expires after this without renewal.
    pub ownership_expiration: Duration,
    /// Checkpoint after this many settled events…
    pub checkpoint_every_events: u64,
    /// …or this long, whichever comes first…
    pub checkpoint_every: Duration,
    /// …but never more often than this per partition, so checkpoint writes are bounded by
    /// time, not by the event rate.
    pub checkpoint_min_interval: Duration,
    /// Events of one partition handled at once (1: one by one, in order).
    pub max_in_flight: usize,
    /// What keeps events in order when `max_in_flight` > 1.
    pub ordering: OrderingKey,
    /// Whether a key's retry holds its later events (ordered retries; off by default). The
    /// key is `ordering`'s: events without one are never parked.
    pub retry_ordering: RetryOrdering,
    /// Most events of a partition read past its oldest unsettled event (at least
    /// `max_in_flight`, which it is by default): settled events waiting behind a slow one
    /// stay here instead of holding a slot, so the slots stay busy while it settles. An
    /// event that cannot settle stops the partition after this many.
    pub window: usize,
    /// Events prefetched per partition.
    pub prefetch: u32,
    /// Start partitions without a checkpoint at the latest event instead of the earliest.
    pub start_at_latest: bool,
    /// Deadline of every SDK and storage call.
    pub deadline: Duration,
    /// Longest wait between settlement retries of a held partition.
    pub settle_backoff_max: Duration,
    /// Retry attempts at once: calls to the downstream in flight (each holds its slot until
    /// the breaker has its outcome), and the most retry-queue receivers polling at once (one
    /// while the queue is idle, more while receives keep returning messages).
    pub retry_concurrency: usize,
    /// Retry messages are scheduled this long before their due time (never before the next
    /// whole second, so they stay scheduled messages): the retry loop receives each early,
    /// reads its ledger record, and at the due time re-validates the record with a
    /// conditional read and starts the attempt. Service Bus still holds the wait; a process
    /// that dies holding one leaves it to its lock's expiry. Zero: received when due.
    pub retry_lead: Duration,
    /// Retry messages in hand at most (received and not yet settled: waiting for their due
    /// time, or running). Each holds its ledger record, which holds its event.
    pub retry_prefetch: usize,
    /// Long-poll wait of each retry-queue receive.
    pub retry_receive_wait: Duration,
    /// First reconnect delay of the retry loop (then 2×, 3×).
    pub reconnect_base: Duration,
    /// The watchdog's pace once reconnects keep failing.
    pub watchdog_interval: Duration,
    /// How often the retry queue's dead-letter sub-queue is swept for retries Service Bus
    /// gave up on (also once at start).
    pub dead_letter_sweep: Duration,
    /// A retry the ledger says was due longer ago than this, with no retry message having
    /// run it, is scheduled again (checked by the same sweep).
    pub overdue_margin: Duration,
    /// DELIVERED ledger records are deleted this long after their last write, once their
    /// event is settled on its partition (`None`: kept forever); checked every
    /// `retention_sweep`.
    pub retention: Option<Duration>,
    /// How often retention runs.
    pub retention_sweep: Duration,
    /// Liveness: `/healthz` fails once the Event Hubs consumer has failed without a break
    /// for this long (`None`: never).
    pub unhealthy_after: Option<Duration>,
    /// The clock policy time runs on: due times, breaker expiry, deferrals, backoff. The wall
    /// clock; tests share one with the Service Bus emulator and advance it.
    pub clock: Arc<crate::clock::Clock>,
    /// Where dead letters are also published (before the ledger records them); checked at
    /// start: [`Pipeline::run`] fails if it is missing or refuses messages.
    pub dead_letters: Option<Arc<dead_letter::DeadLetterDestination>>,
    /// Move partitions between live replicas by asking the owner to hand them over (it
    /// stops reading, settles, checkpoints and writes the ownership over) instead of
    /// stealing them; `false` balances as the SDK alone does (the bench's comparison).
    pub handover: bool,
    /// The downstream's rate limit for the whole deployment (`handler.rate_limit`); the
    /// handler's granted rate (a webhook's `WebHook-Allowed-Rate`) caps it too.
    pub rate_limit: crate::ratelimit::RateLimitConfig,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        Self {
            owner_id: uuid::Uuid::new_v4().to_string(),
            update_interval: Duration::from_secs(5),
            ownership_expiration: Duration::from_secs(20),
            checkpoint_every_events: 100,
            checkpoint_every: Duration::from_secs(1),
            checkpoint_min_interval: Duration::from_millis(200),
            max_in_flight: 1,
            ordering: OrderingKey::PartitionKey,
            retry_ordering: RetryOrdering::Off,
            window: 0,
            prefetch: 300,
            start_at_latest: false,
            deadline: Duration::from_secs(10),
            settle_backoff_max: Duration::from_secs(10),
            retry_concurrency: 8,
            retry_lead: Duration::from_secs(2),
            retry_prefetch: 1024,
            retry_receive_wait: Duration::from_secs(5),
            reconnect_base: Duration::from_secs(1),
            watchdog_interval: Duration::from_secs(30),
            dead_letter_sweep: Duration::from_secs(60),
            overdue_margin: Duration::from_secs(300),
            retention: Some(DEFAULT_RETENTION),
            retention_sweep: Duration::from_secs(3_600),
            unhealthy_after: Some(Duration::from_secs(900)),
            clock: Arc::default(),
            dead_letters: None,
            handover: true,
            rate_limit: crate::ratelimit::RateLimitConfig::default(),
        }
    }
}

/// How long a DELIVERED ledger record is kept by default (see `pipeline::retention` for
/// why 7 days).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3_600);

impl PipelineOptions {
    /// The longest time from Service Bus accepting a retry message to a replay of its event
    /// re-sending the same MessageId, which the retry queue's duplicate-detection window must
    /// cover: see [`replay_gap`].
    pub fn replay_gap(&self) -> Duration {
        replay_gap(
            self.checkpoint_every,
            self.ownership_expiration,
            self.deadline,
        )
    }
}

/// A replica schedules a retry, then dies before its checkpoint passes the event: the
/// checkpoint was due within `checkpoint_every`; the partition stays with the dead owner
/// until `ownership_expiration` runs out; the next owner claims it, reads from the
/// checkpoint and reaches the event through a few calls (ownership, ledger read, the send
/// itself: 4 × the call `deadline`); a minute of margin covers the settle backoff and clock
/// skew between replicas. (A partition *held* before the event — an outage — can stretch
/// this without bound; so can a replay by hand.)
pub fn replay_gap(
    checkpoint_every: Duration,
    ownership_expiration: Duration,
    deadline: Duration,
) -> Duration {
    checkpoint_every + ownership_expiration + deadline * 4 + Duration::from_secs(60)
}

/// What the pipeline is built from (`wiring::Wiring` builds it).
pub struct PipelineParts {
    /// The Event Hub.
    pub eventhubs: EventHubsTarget,
    /// The checkpoint and ownership store (the official blob store, usually).
    pub checkpoint_store: Arc<dyn CheckpointStore + Send + Sync>,
    /// Records for the ledger.
    pub records: Arc<dyn RecordStore>,
    /// The retry queue.
    pub queue: Arc<dyn RetryQueue>,
    /// The handler.
    pub handler: Arc<dyn Handler>,
    /// Retry policies.
    pub policies: Policies,
    /// Where the identity comes from.
    pub identity: IdentityConfig,
    /// Tunables.
    pub options: PipelineOptions,
    /// The circuit breaker for the handler's downstream (`None`: no breaker).
    pub breaker: Option<crate::breaker::BreakerConfig>,
}

/// What partition tasks and the retry loop share, by concern.
pub(crate) struct Shared {
    /// Where events come from and how their identity is read.
    pub(crate) origin: Origin,
    /// The handler and its circuit breaker (asked and told in [`admission`]).
    pub(crate) downstream: Downstream,
    /// Settlement: the ledger, the retry queue and the policies.
    pub(crate) settler: Arc<Settler>,
    /// The retry queue the retry loop receives from.
    pub(crate) queue: Arc<dyn RetryQueue>,
    /// Readiness and liveness.
    pub(crate) health: Arc<Health>,
    /// Counters, instruments and gauges.
    pub(crate) observe: observe::Observer,
    /// Tunables and the clock.
    pub(crate) options: PipelineOptions,
    /// Reads an event back from Event Hubs when a retry's ledger record is missing.
    pub(crate) reader: Arc<dyn readback::EventReader>,
    /// The operator's pauses, as last read from the control record ([`control`]).
    pub(crate) pauses: tokio::sync::watch::Sender<control::Pauses>,
}

/// The hub and consumer group events come from, and the rules for their identity.
pub(crate) struct Origin {
    pub(crate) hub: String,
    pub(crate) consumer_group: String,
    pub(crate) identity: IdentityConfig,
}

/// The handler, and the circuit breaker for its downstream (`None`: no breaker).
pub(crate) struct Downstream {
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) breaker: Option<Arc<crate::breaker::Shared>>,
    /// The deployment-wide rate limit (`None`: neither configured nor grantable).
    pub(crate) limiter: Option<Arc<crate::ratelimit::limiter::Limiter>>,
    _rate_gauges: Option<crate::telemetry::gauges::RateLimitGauges>,
}

impl Shared {
    /// The clock policy time runs on.
    pub(crate) fn clock(&self) -> &crate::clock::Clock {
        &self.options.clock
    }
}

/// A pipeline, ready to run.
pub struct Pipeline {
    shared: Arc<Shared>,
    eventhubs: EventHubsTarget,
    checkpoints: Arc<FencedCheckpointStore>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("eventhubs", &self.eventhubs)
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// Assembles a pipeline.
    pub fn new(parts: PipelineParts) -> Self {
        let breaker = parts.breaker.clone().filter(|b| b.enabled).map(|b| {
            Arc::new(
                crate::breaker::Shared::new(
                    parts.records.clone(),
                    &parts.handler.downstream(),
                    &parts.options.owner_id,
                    b,
                )
                .with_clock(parts.options.clock.clone()),
            )
        });
        let records = parts.records.clone();
        let limiter = rate_limiter(&parts);
        let ledger = Ledger::new(
            parts.records,
            &parts.eventhubs.hub,
            &parts.eventhubs.consumer_group,
        )
        .with_retention(parts.options.retention);
        let deployment = crate::event::Deployment::new(
            &parts.eventhubs.namespace,
            &parts.eventhubs.hub,
            &parts.eventhubs.consumer_group,
        );
        let reader = Arc::new(readback::SdkEventReader {
            target: parts.eventhubs.clone(),
            identity: parts.identity.clone(),
            deadline: parts.options.deadline,
            application_id: format!("{}-readback", parts.options.owner_id),
        });
        let settler = Arc::new(
            Settler::new(ledger, parts.queue.clone(), parts.policies)
                .with_deployment(deployment)
                .with_clock(parts.options.clock.clone())
                .with_dead_letters(parts.options.dead_letters.clone())
                .with_schedule_lead(parts.options.retry_lead),
        );
        let health = Arc::new(Health::new(parts.options.clock.clone()));
        health.set_unhealthy_after(parts.options.unhealthy_after);
        if let Some(b) = &breaker {
            health.watch(b.clone());
        }
        let pauses = tokio::sync::watch::Sender::new(control::Pauses::default());
        let mut fenced = FencedCheckpointStore::new(
            parts.checkpoint_store,
            parts.options.owner_id.clone(),
            parts.options.deadline,
            parts.options.ownership_expiration,
        )
        .with_health(health.clone())
        .with_control(pauses.subscribe())
        .with_rate_limiter(limiter.clone())
        .with_lease(owner::OwnerLease::new(
            records.clone(),
            &parts.eventhubs.hub,
            &parts.eventhubs.consumer_group,
            &parts.options.owner_id,
            parts.options.ownership_expiration,
            health.clone(),
        ));
        if parts.options.handover {
            fenced = fenced.with_handovers(handover::Handovers::new(
                records,
                &parts.eventhubs.hub,
                &parts.eventhubs.consumer_group,
                &parts.options.owner_id,
            ));
        }
        let checkpoints = Arc::new(fenced);
        Self {
            shared: Arc::new(Shared {
                origin: Origin {
                    hub: parts.eventhubs.hub.clone(),
                    consumer_group: parts.eventhubs.consumer_group.clone(),
                    identity: parts.identity,
                },
                observe: observe::Observer::new(
                    health.clone(),
                    breaker
                        .clone()
                        .map(|b| b as Arc<dyn crate::telemetry::gauges::BreakerReadings>),
                ),
                downstream: Downstream {
                    handler: parts.handler,
                    breaker,
                    _rate_gauges: limiter.clone().map(|l| {
                        crate::telemetry::gauges::RateLimitGauges::register(
                            l as Arc<dyn crate::telemetry::gauges::RateLimitReadings>,
                        )
                    }),
                    limiter,
                },
                settler,
                queue: parts.queue,
                health,
                options: parts.options,
                reader,
                pauses,
            }),
            eventhubs: parts.eventhubs,
            checkpoints,
        }
    }

    /// The pipeline's health (held partitions, retry loop, counters).
    pub fn health(&self) -> Arc<Health> {
        self.shared.health.clone()
    }

    testbed_pub! {
        /// The downstream's circuit breaker, if enabled.
        pub fn breaker(&self) -> Option<Arc<crate::breaker::Shared>> {
            self.shared.downstream.breaker.clone()
        }
    }

    testbed_pub! {
        /// The downstream's rate limiter, when a limit is configured or the handler can grant
        /// one (a webhook with the handshake).
        pub fn rate_limiter(&self) -> Option<Arc<crate::ratelimit::limiter::Limiter>> {
            self.shared.downstream.limiter.clone()
        }
    }

    testbed_pub! {
        /// The settler (ledger reads, dead-letter replay).
        pub fn settler(&self) -> Arc<Settler> {
            self.shared.settler.clone()
        }
    }

    /// Runs until `cancel` fires, then shuts down gracefully: stop taking events, settle what
    /// is in flight, write final checkpoints, close partition clients.
    pub async fn run(self, cancel: CancellationToken) -> Result<(), RunError> {
        self.run_until(cancel, CancellationToken::new()).await
    }

    testbed_pub! {
    /// Like [`run`](Self::run), but `crash` stops everything at once, as a killed process
    /// would: no final checkpoint, no ownership release, in-flight attempts and retry-message
    /// locks abandoned. The demo and the chaos tests use it.
    pub async fn run_until(
        self,
        cancel: CancellationToken,
        crash: CancellationToken,
    ) -> Result<(), RunError> {
        if let Some(dl) = self.shared.settler.dead_letters() {
            dl.probe().await?;
        }
        self.claim_ledger().await?;
        // The operator's pauses: read by every replica, every few seconds.
        tokio::spawn(control::watch(
            self.shared.settler.ledger.store().clone(),
            control::record_name(&self.shared.origin.hub, &self.shared.origin.consumer_group),
            self.shared.pauses.clone(),
            control::PAUSE_POLL,
            self.shared.options.clock.clone(),
            {
                let stop = CancellationToken::new();
                let (c, k, s) = (cancel.clone(), crash.clone(), stop.clone());
                tokio::spawn(async move {
                    tokio::select! { _ = c.cancelled() => {}, _ = k.cancelled() => {} }
                    s.cancel();
                });
                stop
            },
        ));
        if let Some(blocked) = self.shared.downstream.handler.blocked() {
            tokio::spawn(watch_blocked(
                self.shared.health.clone(),
                self.shared.downstream.handler.downstream(),
                blocked,
                cancel.clone(),
                crash.clone(),
            ));
        }
        if let Some(limiter) = self.shared.downstream.limiter.clone() {
            tokio::spawn(watch_paused(
                self.shared.health.clone(),
                limiter,
                self.shared.options.clock.clone(),
                cancel.clone(),
                crash.clone(),
            ));
        }
        let retry = {
            let (shared, cancel) = (self.shared.clone(), cancel.clone());
            let crash = crash.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = retry::run(shared, cancel) => {}
                    _ = crash.cancelled() => {}
                }
            })
        };
        if let Some(keep) = self.shared.options.retention {
            tokio::spawn(retention::run(
                self.shared.clone(),
                self.checkpoints.clone(),
                keep,
                cancel.clone(),
                crash.clone(),
            ));
        }
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let shared = self.shared.clone();
        let target = self.eventhubs.clone();
        let checkpoints = self.checkpoints.clone();
        let processor_cancel = cancel.clone();
        std::thread::Builder::new()
            .name("hubguard-partitions".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match rt {
                    Ok(rt) => {
                        let local = tokio::task::LocalSet::new();
                        local.block_on(&rt, async move {
                            tokio::select! {
                                _ = supervise(shared, target, checkpoints, processor_cancel) => {}
                                _ = crash.cancelled() => {}
                            }
                        });
                        // Dropping the runtime drops every task: nothing is closed or written.
                        rt.shutdown_background();
                    }
                    Err(e) => tracing::error!(error = %e, "cannot start the partition runtime"),
                }
                let _ = done_tx.send(());
            })
            .map_err(RunError::Thread)?;
        let _ = done_rx.await;
        let _ = retry.await;
        Ok(())
    }
    }
}

/// Why a pipeline stopped before it ran.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The dead-letter destination refused the start-up probe: dead letters could not be
    /// published.
    #[error(transparent)]
    DeadLetters(#[from] dead_letter::PublishError),
    /// The ledger in this container belongs to another deployment of the same hub and
    /// consumer group (see [`Ledger::claim`](crate::ledger::Ledger::claim)).
    #[error("the ledger of hub {} consumer group {} in this container belongs to {other}; this is {me}. Their records would be one another's: give one of them a container of its own (storage.container_url)", me.hub, me.consumer_group)]
    LedgerTaken {
        /// This deployment.
        me: crate::event::Deployment,
        /// The deployment that claimed the ledger.
        other: crate::event::Deployment,
    },
    /// The partitions' thread could not be started.
    #[error(transparent)]
    Thread(std::io::Error),
}

/// Why the Event Hubs consumer (or its processor) failed; each names the endpoint where it
/// has one. Health shows it while the consumer is rebuilt.
#[derive(Debug, thiserror::Error)]
enum ConsumerError {
    /// A step did not answer within the call deadline.
    #[error("{step} at {endpoint} timed out after {deadline:?}")]
    TimedOut {
        step: &'static str,
        endpoint: String,
        deadline: Duration,
    },
    /// A step failed.
    #[error("{step} at {endpoint}: {error}")]
    Failed {
        step: &'static str,
        endpoint: String,
        error: azure_messaging_eventhubs::EventHubsError,
    },
    /// An interval the SDK cannot represent.
    #[error("bad {0}")]
    Interval(&'static str),
    /// Building the processor did not answer within the call deadline.
    #[error("building the event processor timed out")]
    BuildTimedOut,
    /// Building the processor failed.
    #[error("building the event processor: {0}")]
    Build(azure_messaging_eventhubs::EventHubsError),
    /// The processor's `run()` ended on its own.
    #[error("processor run() ended: {0}")]
    RunEnded(String),
    /// Two partition clients in a row failed without an event.
    #[error("partition streams fail as soon as they open: the Event Hubs connection is gone")]
    ConnectionGone,
    /// The processor could not hand out a partition client.
    #[error("next_partition_client: {0}")]
    NextPartition(azure_messaging_eventhubs::EventHubsError),
}

/// The downstream's rate limiter: when `rate_limit` is configured or the handler can grant a
/// rate. Partitions taken over from a live owner count after two update intervals (the old
/// owner lists at least once meanwhile); one unconfirmed for an ownership expiration stops
/// counting.
fn rate_limiter(parts: &PipelineParts) -> Option<Arc<crate::ratelimit::limiter::Limiter>> {
    let allowed = parts.handler.allowed_rate();
    if parts.options.rate_limit.per_s.is_none() && allowed.is_none() {
        return None;
    }
    let o = &parts.options;
    let limiter = crate::ratelimit::limiter::Limiter::new(
        o.rate_limit,
        parts.records.clone(),
        &parts.handler.downstream(),
        &o.owner_id,
        o.update_interval * 2,
        o.ownership_expiration,
        o.clock.clone(),
    );
    Some(Arc::new(match allowed {
        Some(a) => limiter.with_allowed_rate(a),
        None => limiter,
    }))
}

impl Pipeline {
    /// Refuses to start on a ledger another namespace's deployment of the same hub and
    /// consumer group names already uses in this container (see [`Ledger::claim`]). Storage
    /// down at start is not a refusal: the partitions hold on it as on any outage.
    async fn claim_ledger(&self) -> Result<(), RunError> {
        let Some(me) = self.shared.settler.deployment() else {
            return Ok(());
        };
        let claimed = tokio::time::timeout(
            self.shared.options.deadline,
            self.shared.settler.ledger.claim(me),
        )
        .await;
        match claimed {
            Ok(Ok(None)) => Ok(()),
            Ok(Ok(Some(other))) => Err(RunError::LedgerTaken {
                me: me.clone(),
                other,
            }),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not check that this deployment's ledger is its own; starting");
                Ok(())
            }
            Err(_) => {
                tracing::warn!(
                    "checking that this deployment's ledger is its own timed out; starting"
                );
                Ok(())
            }
        }
    }
}

/// Shows in readiness why the handler cannot deliver (a webhook that has not agreed to
/// receive): held under `handler {downstream}` until the reason clears.
async fn watch_blocked(
    health: Arc<Health>,
    downstream: String,
    mut blocked: tokio::sync::watch::Receiver<Option<String>>,
    cancel: CancellationToken,
    crash: CancellationToken,
) {
    let subject = self::health::HoldSubject::Handler(downstream);
    loop {
        let reason = blocked.borrow_and_update().clone();
        match reason {
            Some(r) => health.hold(
                subject.clone(),
                None,
                self::health::HoldCause::HandlerBlocked,
                r,
            ),
            None => health.release(&subject, None),
        }
        tokio::select! {
            changed = blocked.changed() => if changed.is_err() { break },
            _ = cancel.cancelled() => break,
            _ = crash.cancelled() => break,
        }
    }
    health.release(&subject, None);
}

/// Shows in readiness a pause of the downstream (a 429's `Retry-After`) longer than
/// [`PAUSE_SHOWN_AFTER`]: every event waits on it, not on its own schedule. Held under
/// `rate limit {downstream}` until the pause ends; shorter pauses are the rate limit's
/// ordinary work.
async fn watch_paused(
    health: Arc<Health>,
    limiter: Arc<crate::ratelimit::limiter::Limiter>,
    clock: Arc<crate::clock::Clock>,
    cancel: CancellationToken,
    crash: CancellationToken,
) {
    let mut changes = limiter.subscribe();
    let subject = self::health::HoldSubject::RateLimit(limiter.snapshot().downstream);
    loop {
        let until = limiter.paused_until();
        match until {
            Some(u) if clock.until(u) > PAUSE_SHOWN_AFTER => {
                health.hold(
                    subject.clone(),
                    None,
                    self::health::HoldCause::HandlerBlocked,
                    format!(
                        "the downstream answered 429 with Retry-After: every replica waits until {} before calling it (handler.rate_limit)",
                        crate::clock::rfc3339(u)
                    ),
                );
                tokio::select! {
                    _ = clock.sleep_until(u) => {}
                    changed = changes.changed() => if changed.is_err() { break },
                    _ = cancel.cancelled() => break,
                    _ = crash.cancelled() => break,
                }
            }
            _ => {
                health.release(&subject, None);
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { break },
                    _ = cancel.cancelled() => break,
                    _ = crash.cancelled() => break,
                }
            }
        }
    }
    health.release(&subject, None);
}

/// A pause of the downstream longer than this shows in readiness.
const PAUSE_SHOWN_AFTER: Duration = Duration::from_secs(10);

/// Keeps an `EventProcessor` running: if `run()` fails, tear everything down and rebuild.
async fn supervise(
    shared: Arc<Shared>,
    target: EventHubsTarget,
    checkpoints: Arc<FencedCheckpointStore>,
    cancel: CancellationToken,
) {
    let mut backoff = Duration::from_millis(500);
    while !cancel.is_cancelled() {
        match run_processor(&shared, &target, &checkpoints, &cancel).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(error = %e, "event processor stopped; rebuilding");
                shared.health.consumer_failed(e.to_string());
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = shared.clock().sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

async fn run_processor(
    shared: &Arc<Shared>,
    target: &EventHubsTarget,
    checkpoints: &Arc<FencedCheckpointStore>,
    cancel: &CancellationToken,
) -> Result<(), ConsumerError> {
    let o = &shared.options;
    let (consumer, partition_ids) = open_consumer(o, target).await?;
    checkpoints.set_partitions(partition_ids);
    checkpoints.resume_claiming();
    let store: Arc<dyn CheckpointStore + Send + Sync> = checkpoints.clone();
    let processor = build_processor(o, consumer, store).await?;
    shared.health.consumer_running();

    let mut run = {
        let p = processor.clone();
        tokio::task::spawn_local(async move { p.run().await })
    };
    let mut run_done = false;
    let partitions = cancel.child_token();
    let mut tasks = Vec::new();
    // The SDK does not recover a dropped connection: every partition client it hands out
    // afterwards fails at once. Two in a row that fail without an event mean a dead
    // connection: rebuild the consumer and the processor.
    let (ended_tx, mut ended_rx) = tokio::sync::mpsc::unbounded_channel::<partition::Ended>();
    let mut dead_in_a_row = 0u32;
    let result = loop {
        tokio::select! {
            _ = cancel.cancelled() => break Ok(()),
            r = &mut run => {
                run_done = true;
                break Err(ConsumerError::RunEnded(format!("{r:?}")));
            }
            Some(ended) = ended_rx.recv() => {
                if ended.failed && ended.received == 0 {
                    dead_in_a_row += 1;
                    if dead_in_a_row >= 2 {
                        break Err(ConsumerError::ConnectionGone);
                    }
                } else if ended.received > 0 {
                    dead_in_a_row = 0;
                }
            }
            pc = processor.next_partition_client() => match pc {
                Ok(pc) => {
                    let pid = pc.get_partition_id().to_string();
                    let stop_reading = partitions.child_token();
                    if !checkpoints.partition_started(&pid, stop_reading.clone()) {
                        // Handed over (or stopping) since the processor dispatched it.
                        if let Ok(pc) = Arc::try_unwrap(pc) {
                            let _ = tokio::time::timeout(o.deadline, pc.close()).await;
                        }
                        continue;
                    }
                    let (shared, cancel, tx) = (shared.clone(), partitions.clone(), ended_tx.clone());
                    let checkpoints = checkpoints.clone();
                    tasks.push(tokio::task::spawn_local(async move {
                        let ended = partition::run(pc, shared, cancel, stop_reading, &checkpoints).await;
                        checkpoints.partition_ended(&pid).await;
                        let _ = tx.send(ended);
                    }));
                }
                Err(e) => break Err(ConsumerError::NextPartition(e)),
            },
        }
    };
    // Teardown, in the order that releases everything (measured: the processor never gives
    // ownership back, and a partition client dropped without `close()` stalls its partition).
    checkpoints.stop_claiming();
    partitions.cancel();
    for t in tasks {
        let _ = tokio::time::timeout(o.deadline * 3, t).await;
    }
    let _ = tokio::time::timeout(o.deadline, processor.shutdown()).await;
    if !run_done {
        let _ = tokio::time::timeout(o.update_interval * 2 + o.deadline, &mut run).await;
    }
    // The SDK never gives ownership back; do it, so other replicas need not wait for expiry.
    checkpoints.release_all().await;
    match Arc::try_unwrap(processor) {
        Ok(p) => {
            let _ = tokio::time::timeout(o.deadline, p.close()).await;
        }
        Err(_) => tracing::warn!("event processor still shared at shutdown"),
    }
    result
}

/// Opens the Event Hubs consumer of `target` and reads the hub's partition ids, each step
/// within the deadline; errors name the endpoint (never the credential).
async fn open_consumer(
    o: &PipelineOptions,
    target: &EventHubsTarget,
) -> Result<(ConsumerClient, Vec<String>), ConsumerError> {
    let mut builder = ConsumerClient::builder()
        .with_application_id(o.owner_id.clone())
        .with_consumer_group(target.consumer_group.clone());
    if let Some(e) = &target.custom_endpoint {
        builder = builder.with_custom_endpoint(e.clone());
    }
    // Errors name the endpoint (never the credential).
    let endpoint = match &target.custom_endpoint {
        Some(e) => format!("{} (via {e}), hub {}", target.namespace, target.hub),
        None => format!("{}, hub {}", target.namespace, target.hub),
    };
    let consumer = tokio::time::timeout(
        o.deadline,
        target
            .auth
            .open_consumer(builder, &target.namespace, &target.hub),
    )
    .await
    .map_err(|_| ConsumerError::TimedOut {
        step: "opening the Event Hubs consumer",
        endpoint: endpoint.clone(),
        deadline: o.deadline,
    })?
    .map_err(|error| ConsumerError::Failed {
        step: "opening the Event Hubs consumer",
        endpoint: endpoint.clone(),
        error,
    })?;
    let properties = tokio::time::timeout(o.deadline, consumer.get_eventhub_properties())
        .await
        .map_err(|_| ConsumerError::TimedOut {
            step: "reading the hub's properties",
            endpoint: endpoint.clone(),
            deadline: o.deadline,
        })?
        .map_err(|error| ConsumerError::Failed {
            step: "reading the hub's properties",
            endpoint: endpoint.clone(),
            error,
        })?;
    Ok((consumer, properties.partition_ids))
}

/// Builds the SDK's event processor over `consumer`, checkpointing into `store`.
async fn build_processor(
    o: &PipelineOptions,
    consumer: ConsumerClient,
    store: Arc<dyn CheckpointStore + Send + Sync>,
) -> Result<Arc<EventProcessor>, ConsumerError> {
    let location = if o.start_at_latest {
        StartLocation::Latest
    } else {
        StartLocation::Earliest
    };
    let processor = tokio::time::timeout(
        o.deadline,
        EventProcessor::builder()
            .with_update_interval(
                o.update_interval
                    .try_into()
                    .map_err(|_| ConsumerError::Interval("update interval"))?,
            )
            .with_partition_expiration_duration(
                o.ownership_expiration
                    .try_into()
                    .map_err(|_| ConsumerError::Interval("ownership expiration"))?,
            )
            .with_prefetch(o.prefetch)
            .with_start_positions(StartPositions {
                default: StartPosition {
                    location,
                    inclusive: false,
                },
                ..Default::default()
            })
            .build(consumer, store),
    )
    .await
    .map_err(|_| ConsumerError::BuildTimedOut)?
    .map_err(ConsumerError::Build)?;
    Ok(processor)
}
