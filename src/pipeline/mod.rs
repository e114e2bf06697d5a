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
//! `!Send`, so the processor and its partition tasks run on a pool of threads of their own,
//! one per core by default, each a current-thread runtime + `LocalSet` (`threads`): a
//! partition stays on one from its claim to its release. The retry loop runs on the
//! caller's runtime.
//!
//! # The tasks, and what each owns
//!
//! - **The consumer** (`run_processor`, on the pool's first thread): the SDK's
//!   `EventProcessor`, which claims partitions through the fenced checkpoint store, and one
//!   **partition task** per partition it hands out (`partition::run`). A partition task owns
//!   its events from read to checkpoint: the checkpoint window (`guard`), the event path
//!   (`partition/event.rs`: admit → pace → attempt → settle) and the background checkpoint
//!   writer (`partition/checkpointer.rs`).
//! - **The fenced checkpoint store** (`checkpoint/`): shared by the processor and the partition
//!   tasks. It owns one value per partition (`checkpoint::lifecycle::Partition`: whether this
//!   replica holds, asks for or is giving the partition, the task reading it, its checkpoint
//!   floor) and fences every checkpoint against it. What to claim, ask for or take is decided
//!   by a pure planner (`ownership::plan`); owner ids, handover requests and their calls are
//!   `ownership/`.
//! - **The retry loop** (`retry/`): receives scheduled retries from Service Bus and takes each
//!   through `due → validated → slotted → admitted → attempt → settle`; its recovery
//!   (`retry/recovery.rs`) finds retries outside the receive path: the dead-letter
//!   sub-queue's, overdue ones the ledger lists, and those whose ledger record is missing.
//! - **The settler** (`settle/`, shared by both paths): a pure `plan` and its `execute`; every
//!   record change goes through the one compare-and-swap (`azure::versioned`), every dead
//!   letter through `write_settled`.
//! - **The downstream's guards** (`downstream`): breaker, dead-letter storm guard, rate limiter.
//! - **Watchers** spawned by `run_until`: the operator's control record (`control::watch`:
//!   pauses and rewinds), the handshake's block and the rate limit's pause (`watch`), and
//!   retention.
//!
//! # Where a feature plugs in
//!
//! - Around one attempt, on both paths: the breaker's admission (`admission`), the dead-letter
//!   storm guard's (`admission`: wait while it holds; a refusal while it holds waits, or is
//!   deferred, instead of being dead-lettered), the rate limit's
//!   pace, and ordered retries through one hook (`lines::LineHook`: before the attempt it says
//!   deliver, park or settle a replay; after settlement it opens or advances the key's line; a
//!   no-op when `retry_ordering = "off"`).
//! - A partition's lifecycle: a new reason to stop reading or to hand a partition back is a
//!   state of `checkpoint::lifecycle::Hold` and a transition on it, read by the fence and the
//!   partition task alike; a new claim policy is a change to the pure planner
//!   (`ownership::plan`), property-tested there.
//! - A new record kind: a `RecordKind` for `azure::versioned::compare_and_swap`, never a loop
//!   of its own.

mod admission;
mod attempt;
mod backlog;
mod backoff;
mod checkpoint;
pub mod control;
pub mod dead_letter;
mod downstream;
pub mod health;
mod lines;
mod message_id;
mod observe;
mod ops;
mod options;
pub mod ownership;
mod partition;
pub mod readback;
mod recorded;
mod retention;
mod retry;
#[cfg(any(test, feature = "cli"))]
pub mod rewind;
pub mod settle;
mod threads;
mod watch;

use std::sync::Arc;
use std::time::Duration;

use azure_messaging_eventhubs::models::StartPositions;
use azure_messaging_eventhubs::{
    CheckpointStore, ConsumerClient, EventProcessor, StartLocation, StartPosition,
};
use tokio_util::sync::CancellationToken;

use self::checkpoint::FencedCheckpointStore;
use self::downstream::{breaker, health, rate_limiter, storm_guard};
use self::health::Health;
use self::settle::{Policies, Settler};
use crate::azure::{RecordStore, RetryQueue};
use crate::event::IdentityConfig;
use crate::handler::Handler;
use crate::ledger::Ledger;

pub use self::options::{
    replay_gap, BadLineOnDeadLetter, BadOrderingKey, EventHubsTarget, LineOnDeadLetter,
    OrderingKey, PipelineOptions, RetryOrdering, DEFAULT_RETENTION,
};

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
    /// The dead-letter storm guard for the downstream (`None`: off).
    pub(crate) storm: Option<Arc<crate::breaker::storm::Guard>>,
    _storm_gauges: Option<crate::telemetry::gauges::StormGuardGauges>,
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
    /// The backlog sampler (started by `run_until`) and its latest sample.
    backlog: backlog::Sampler,
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
        let breaker = breaker(&parts);
        let storm = storm_guard(&parts);
        let health = health(&parts, breaker.as_ref(), storm.as_ref());
        let records = parts.records.clone();
        let backlog = backlog::Sampler::new(&parts);
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
        .with_lease(ownership::owner::OwnerLease::new(
            records.clone(),
            &parts.eventhubs.hub,
            &parts.eventhubs.consumer_group,
            &parts.options.owner_id,
            parts.options.ownership_expiration,
            health.clone(),
        ));
        if parts.options.handover {
            fenced = fenced.with_handovers(ownership::handover::Handovers::new(
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
                downstream: Downstream::new(parts.handler, breaker, storm, limiter),
                settler,
                queue: parts.queue,
                health,
                options: parts.options,
                reader,
                pauses,
            }),
            eventhubs: parts.eventhubs,
            checkpoints,
            backlog,
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

    /// The latest sample of the backlog (`GET /v1/backlog`, `hubguard.backlog.events`), taken
    /// while the pipeline runs.
    pub fn backlog(&self) -> crate::telemetry::backlog::BacklogCell {
        self.backlog.cell.clone()
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
            tokio::spawn(watch::blocked(
                self.shared.health.clone(),
                self.shared.downstream.handler.downstream(),
                blocked,
                cancel.clone(),
                crash.clone(),
            ));
        }
        if let Some(limiter) = self.shared.downstream.limiter.clone() {
            tokio::spawn(limiter.clone().run(cancel.clone(), crash.clone()));
            tokio::spawn(watch::paused(
                self.shared.health.clone(),
                limiter,
                self.shared.options.clock.clone(),
                cancel.clone(),
                crash.clone(),
            ));
        }
        ops::start(&self.shared, backlog::either(&cancel, &crash));
        tokio::spawn(self.backlog.run(backlog::either(&cancel, &crash)));
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
        // The consumer runs on a pool of threads (see `threads`): the processor and the Event
        // Hubs connection on the first, each partition on the thread with the fewest tasks.
        let pool = Arc::new(
            threads::PartitionThreads::start(
                self.shared.options.partition_threads(),
                PARTITION_THREAD,
                crash,
            )
            .map_err(RunError::Thread)?,
        );
        let processor = {
            let (shared, target) = (self.shared.clone(), self.eventhubs.clone());
            let (checkpoints, on) = (self.checkpoints.clone(), pool.clone());
            pool.spawn_first(move || async move {
                supervise(shared, target, checkpoints, &on, cancel).await;
            })
        };
        // Answered when the processor has stopped; dropped unanswered by a crash, which
        // drops every task on the pool at once: nothing is closed or written.
        let _ = processor.await;
        pool.close().await;
        let _ = retry.await;
        Ok(())
    }
    }
}

/// The name of the threads a pipeline's consumer runs on: its partitions are read and
/// settled there (the SDK's partition streams are not `Send`: see `threads`).
pub(crate) const PARTITION_THREAD: &str = "hubguard-partitions";

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
    /// The consumer's threads could not be started.
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

/// Keeps an `EventProcessor` running: if `run()` fails, tear everything down and rebuild.
async fn supervise(
    shared: Arc<Shared>,
    target: EventHubsTarget,
    checkpoints: Arc<FencedCheckpointStore>,
    partitions: &threads::PartitionThreads,
    cancel: CancellationToken,
) {
    let mut backoff = Duration::from_millis(500);
    while !cancel.is_cancelled() {
        match run_processor(&shared, &target, &checkpoints, partitions, &cancel).await {
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
    threads: &threads::PartitionThreads,
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
                    tasks.push(threads.spawn(move || async move {
                        let ended = partition::run(pc, shared, cancel, stop_reading, &checkpoints).await;
                        checkpoints.partition_ended(&pid, ended.closed).await;
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
