//! What the pipeline is configured with: the Event Hub to read, the ordering key, the
//! retry ordering, what a dead-lettered line does, and [`PipelineOptions`] with its defaults.

use std::sync::Arc;
use std::time::Duration;

use super::dead_letter;

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

/// What a line does when its head is dead-lettered (`processor.line_on_dead_letter`). Read
/// from the configuration's spelling (`release`, `dead_letter_line`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(try_from = "String")]
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

impl TryFrom<String> for LineOnDeadLetter {
    type Error = BadLineOnDeadLetter;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
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
    /// Events of one partition in their handler call at once (1: one by one, in order);
    /// as many more may be settling, their calls ended.
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
    /// Threads the replica's consumer runs on: its partitions spread over them, the event
    /// processor on the first (0: one per core this process may use, its container's CPU
    /// limit included). The SDK's partition streams are not `Send`, so one partition never
    /// uses more than one; 1 runs everything on one thread.
    pub partition_threads: usize,
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
    /// A retry that comes due while an operator paused it (`hubguard retries pause`) is
    /// deferred this long, uncounted, and looked at again then: how soon after a resume it
    /// runs, and how often each paused retry costs a ledger write and a message.
    pub retry_pause_recheck: Duration,
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
    /// start: [`Pipeline::run`](super::Pipeline::run) fails if it is missing or refuses messages.
    pub dead_letters: Option<Arc<dead_letter::DeadLetterDestination>>,
    /// Move partitions between live replicas by asking the owner to hand them over (it
    /// stops reading, settles, checkpoints and writes the ownership over) instead of
    /// stealing them; `false` balances as the SDK alone does (the bench's comparison).
    pub handover: bool,
    /// The downstream's rate limit for the whole deployment (`handler.rate_limit`); the
    /// handler's granted rate (a webhook's `WebHook-Allowed-Rate`) caps it too.
    pub rate_limit: crate::ratelimit::RateLimitConfig,
    /// How often the backlog (`hubguard.backlog.events`, `GET /v1/backlog`: unread events,
    /// retries due, parked events) is sampled: one partition-properties call per partition,
    /// one checkpoint listing and one ledger listing each time.
    pub backlog_every: Duration,
    /// Operational events (breaker, held partitions, dead letters, rate limit) and where they
    /// go (`None`: none).
    pub ops_events: Option<Arc<crate::opsevents::OpsEvents>>,
    /// Readiness fails while this host's clock is measured further than this from Service
    /// Bus's (`status.max_clock_skew_ms`; docs/clocks.md).
    pub max_clock_skew: Duration,
    /// The dead-letter storm guard for the downstream (`[storm_guard]`; `None`: off, every
    /// refusal dead-lettered at once). The configuration file turns it on by default.
    pub storm_guard: Option<crate::breaker::storm::StormGuardConfig>,
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
            partition_threads: 0,
            start_at_latest: false,
            deadline: Duration::from_secs(10),
            settle_backoff_max: Duration::from_secs(10),
            retry_concurrency: 8,
            retry_lead: Duration::from_secs(2),
            retry_prefetch: 1024,
            retry_receive_wait: Duration::from_secs(5),
            retry_pause_recheck: Duration::from_secs(60),
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
            storm_guard: None,
            backlog_every: Duration::from_secs(30),
            ops_events: None,
            max_clock_skew: DEFAULT_MAX_CLOCK_SKEW,
        }
    }
}

/// How far this host's clock may be from Service Bus's before readiness says so: a tenth of
/// the 15 minutes Azure Storage allows a request's time to be off, and well under any
/// ownership expiration or retry wait worth configuring (docs/clocks.md).
pub(crate) const DEFAULT_MAX_CLOCK_SKEW: Duration = Duration::from_secs(30);

/// How long a DELIVERED ledger record is kept by default (see `pipeline::retention` for
/// why 7 days).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3_600);

impl PipelineOptions {
    /// [`partition_threads`](Self::partition_threads), 0 resolved: one per core this
    /// process may use.
    pub(crate) fn partition_threads(&self) -> usize {
        match self.partition_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

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
