//! The serialized report types: what holds a partition, the retry loop's and the
//! consumer's states, the counters and lag, and the [`HealthReport`] the status API serves.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use serde::{Serialize, Serializer};

use crate::clock::rfc3339;

/// Serialises a time as RFC 3339 (the status API's form).
fn as_rfc3339<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*t))
}

/// What holds a partition, as a closed set: the `reason` label of
/// `hubguard_partitions_held`, and what callers branch on. [`Held::reason`] says the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldCause {
    /// Service Bus (the retry queue) is unavailable or refuses the request.
    ServiceBus,
    /// Blob storage (the ledger) is unavailable or refuses the request.
    Ledger,
    /// The dead-letter destination is unavailable or refuses the dead letter.
    DeadLetterDestination,
    /// The downstream's circuit breaker is open: Event Hubs holds the backlog.
    BreakerOpen,
    /// The downstream's dead-letter storm guard holds: it refuses nearly everything for
    /// good, so nothing is dead-lettered and new events wait.
    StormGuard,
    /// The handler cannot deliver yet (a webhook that has not agreed to receive).
    HandlerBlocked,
    /// The partition's checkpoint blob holds no readable position.
    CorruptCheckpoint,
    /// An operator paused the partition (`hubguard partitions pause`).
    Paused,
    /// This replica's ownership of the partition is not what reading it needs: owned but not
    /// read, or not confirmed within the expiration (a frozen or stalled process).
    Ownership,
}

impl HoldCause {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::ServiceBus => "service_bus",
            Self::Ledger => "ledger",
            Self::DeadLetterDestination => "dead_letter_destination",
            Self::BreakerOpen => "breaker_open",
            Self::StormGuard => "storm_guard",
            Self::HandlerBlocked => "handler_blocked",
            Self::CorruptCheckpoint => "corrupt_checkpoint",
            Self::Paused => "paused",
            Self::Ownership => "ownership",
        }
    }
}

/// What a hold is on. Its [`Display`](fmt::Display) is the name readiness and the status
/// API list it under (`held_partitions`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HoldSubject {
    /// A partition: one of its events cannot settle, or the partition cannot be read at all
    /// (a corrupt checkpoint). Listed under the partition's id.
    Partition(String),
    /// A partition an operator paused, held beside the partition's own holds (an event
    /// that cannot settle stays in view under the partition's id). Listed as `{id} (paused)`.
    PausedPartition(String),
    /// The handler for a downstream cannot deliver yet. Listed as `handler {downstream}`.
    Handler(String),
    /// The downstream asked every replica to pause (a long `Retry-After`). Listed as
    /// `rate limit {downstream}`.
    RateLimit(String),
}

impl HoldSubject {
    /// The partition `id`.
    pub fn partition(id: &str) -> Self {
        Self::Partition(id.to_string())
    }

    /// What the status API shows as `oldest_unsettled` for a hold on no event: `-1` for a
    /// partition (before any sequence number), `0` for the handler and the rate limit — the
    /// values it has always shown (docs/status-api.md).
    pub(super) fn no_event_wire(&self) -> i64 {
        match self {
            Self::Partition(_) | Self::PausedPartition(_) => -1,
            Self::Handler(_) | Self::RateLimit(_) => 0,
        }
    }
}

impl fmt::Display for HoldSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Partition(id) => f.write_str(id),
            Self::PausedPartition(id) => write!(f, "{id} (paused)"),
            Self::Handler(downstream) => write!(f, "handler {downstream}"),
            Self::RateLimit(downstream) => write!(f, "rate limit {downstream}"),
        }
    }
}

/// Why a partition (or the handler) is held, as readiness and the status API show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Held {
    /// What holds it.
    pub cause: HoldCause,
    /// Since when.
    #[serde(serialize_with = "as_rfc3339")]
    pub since: SystemTime,
    /// The dependency that failed and how.
    pub reason: String,
    /// The oldest unsettled sequence number: nothing at or after it is checkpointed. A hold
    /// on no event shows `-1` for a partition and `0` for the handler, as the status API
    /// always has; [`event`](Self::event) says which.
    pub oldest_unsettled: i64,
    /// The held event's sequence number; `None` when the hold is on no one event (a paused
    /// partition, a corrupt checkpoint, the handler).
    #[serde(skip)]
    pub event: Option<i64>,
}
/// The retry loop's state (three layers of recovery: retry at once with backoff, then a watchdog at a slow pace).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum RetryLoopState {
    /// Not started yet.
    Starting,
    /// Receiving.
    Running,
    /// Receive failed; reconnecting with backoff.
    Reconnecting {
        /// Consecutive failures.
        failures: u32,
        /// The last error.
        error: String,
    },
    /// Reconnects keep failing; the watchdog keeps trying at its slow pace.
    Watchdog {
        /// Consecutive failures.
        failures: u32,
        /// The last error.
        error: String,
    },
    /// Stopped (shutdown).
    Stopped,
}

/// The Event Hubs consumer's state: is this replica reading the hub at all?
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum ConsumerState {
    /// Not connected yet.
    Starting,
    /// The processor runs: partitions are claimed and read.
    Running,
    /// Opening the consumer or running the processor fails; it is rebuilt with backoff.
    Failing {
        /// Since when.
        #[serde(serialize_with = "as_rfc3339")]
        since: SystemTime,
        /// Consecutive failures.
        failures: u32,
        /// The last error, naming the endpoint.
        error: String,
    },
}

/// A due retry held (its settlement keeps failing) under a renewed lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeldRetry {
    /// The event's idempotency key.
    pub key: String,
    /// Since when.
    #[serde(serialize_with = "as_rfc3339")]
    pub since: SystemTime,
    /// What failed.
    pub reason: String,
}

/// A partition's checkpoint lag.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Lag {
    /// Events received but not covered by the checkpoint.
    pub events: u64,
    /// The age in seconds of the oldest of them.
    pub seconds: f64,
}

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CounterSnapshot {
    /// Events delivered.
    pub delivered: u64,
    /// Retries scheduled.
    pub retries_scheduled: u64,
    /// Events dead-lettered.
    pub dead_lettered: u64,
    /// Failed settlements.
    pub settle_failures: u64,
    /// Checkpoints written.
    pub checkpoints: u64,
    /// Handler calls.
    pub attempts: u64,
    /// Retries taken back from Service Bus's dead-letter sub-queue.
    pub rescued: u64,
    /// Overdue retries the ledger recorded and nothing ran, scheduled again.
    pub recovered: u64,
    /// Retries of another deployment handed back to a shared queue.
    pub forwarded: u64,
    /// Missing ledger records rebuilt from the event read back from Event Hubs.
    pub records_rebuilt: u64,
    /// Retries dead-lettered as `record_missing`.
    pub records_missing: u64,
    /// Events parked behind an earlier event of their ordering key (ordered retries).
    pub parked: u64,
    /// Parked events released from their line.
    pub released: u64,
}

/// Everything health knows, as `/readyz` and `/v1/status` serve it (before the status API
/// adds the breaker and the rate limit).
#[derive(Debug, Clone, Serialize)]
pub struct HealthReport {
    /// Whether the replica is ready: `not_ready` is empty.
    pub ready: bool,
    /// Why it is not, one line per cause.
    pub not_ready: Vec<String>,
    /// The Event Hubs consumer.
    pub consumer: ConsumerState,
    /// Partitions of the hub no replica owns.
    pub unowned_partitions: Vec<String>,
    /// Due retries held, by MessageId.
    pub held_retries: BTreeMap<String, HeldRetry>,
    /// Holds, by the name of what is held ([`HoldSubject`]'s display).
    pub held_partitions: BTreeMap<String, Held>,
    /// Partitions this replica processes, with their last checkpointed sequence number
    /// (`-1`: none yet).
    pub owned_partitions: BTreeMap<String, i64>,
    /// The retry loop.
    pub retry_loop: RetryLoopState,
    /// Checkpoint lag per partition.
    pub checkpoint_lag: BTreeMap<String, Lag>,
    /// The counters.
    pub counters: CounterSnapshot,
    /// Other deployments whose retries came from the shared queue: name → how many.
    pub other_deployments_seen: BTreeMap<String, u64>,
    /// Each service's clock against this host's (docs/clocks.md).
    pub clocks: Vec<super::ClockOffset>,
    /// The downstream's dead-letter storm guard (absent when it is off): its state, why it
    /// holds, the window's counts, the next trial and the last operator's change.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub storm_guard: Option<serde_json::Value>,
}

/// Liveness refused: the Event Hubs consumer has failed without a break for too long.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the Event Hubs consumer has failed without a break for {}s (limit {}s): {error}",
    failing_for.as_secs(),
    limit.as_secs()
)]
pub struct NotLive {
    /// How long it has been failing.
    pub failing_for: Duration,
    /// `status.unhealthy_after_ms`.
    pub limit: Duration,
    /// The last error, naming the endpoint.
    pub error: String,
}

impl RetryLoopState {
    /// The `hubguard_retry_loop_state` gauge's value: 1 running, 2 reconnecting, 3 watchdog,
    /// 0 otherwise.
    pub fn gauge_value(&self) -> u64 {
        match self {
            Self::Running => 1,
            Self::Reconnecting { .. } => 2,
            Self::Watchdog { .. } => 3,
            Self::Starting | Self::Stopped => 0,
        }
    }
}

impl ConsumerState {
    /// The consumer state gauge's value: 1 running, 2 failing, 0 starting.
    pub fn gauge_value(&self) -> u64 {
        match self {
            Self::Running => 1,
            Self::Failing { .. } => 2,
            Self::Starting => 0,
        }
    }
}
