//! Settlement: making an attempt's outcome durable, so the checkpoint may pass the event.
//!
//! - Delivered on the first attempt from Event Hubs: nothing to write (the happy path) —
//!   unless the ledger holds a record of that very event (a replay after a failure whose
//!   retry never went out, say): then the delivery is recorded, so no retry runs it again.
//!   The partition knows which of its events may have a record (`pipeline::recorded`) and
//!   asks the ledger only for those.
//! - Delivered on a retry: the ledger records it.
//! - Failed: the pinned policy decides; a retry is settled only when the ledger records the
//!   attempt *and* Service Bus accepted the scheduled message (MessageId
//!   `{deployment}.{key}-attempt-{n+1}`, so a repeat is dropped by duplicate detection and
//!   another deployment's message of the same key is not); a dead letter when
//!   the index and the ledger record are written.
//! - A replayed attempt the ledger already has (a crash between scheduling and
//!   checkpointing, a lost retry message) re-sends the recorded next attempt instead of
//!   counting again: the ledger is authoritative for the attempt number.
//!
//! Any storage or Service Bus failure is returned, never swallowed: the caller holds the
//! partition (or abandons the retry message) and tries the settlement again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::azure::{RetryQueue, RetryQueueError};
use crate::event::{Deployment, Event};
use crate::ledger::{Ledger, LedgerError, LedgerRecord, State, Verdict};
use crate::policy::{DeadLetterReason, RetryPolicy};

/// The history outcome of a delivery by a replay from Event Hubs (attempt 1 again) of an
/// event whose record had counted later attempts.
#[cfg(any(test, feature = "testbed"))]
pub const DELIVERED_ON_REPLAY: &str = "delivered_on_replay";

/// Retry policies by event type, with a default.
#[derive(Debug, Clone)]
pub struct Policies {
    /// For events without a type, or with a type not listed.
    pub default: RetryPolicy,
    /// By event type.
    pub by_type: HashMap<String, RetryPolicy>,
}

impl Policies {
    /// The policy for `event_type`.
    pub fn for_type(&self, event_type: Option<&str>) -> &RetryPolicy {
        event_type
            .and_then(|t| self.by_type.get(t))
            .unwrap_or(&self.default)
    }
}

/// Where an attempt came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Read from Event Hubs (attempt 1, or a replay of it).
    EventHubs,
    /// A retry message from Service Bus.
    Retry,
}

/// What a settlement achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Delivered.
    Delivered,
    /// Attempt `attempt` is scheduled for `due`.
    RetryScheduled {
        /// The scheduled attempt's number.
        attempt: u32,
        /// When it is due.
        due: SystemTime,
    },
    /// Dead-lettered.
    DeadLettered(DeadLetterReason),
    /// The ledger already had a final state for the event (a duplicate delivery).
    AlreadyFinal(State),
    /// Parked behind the head of its ordering key's line (ordered retries): the event is
    /// recorded there and runs once the head settles.
    Parked {
        /// The head's idempotency key.
        behind: String,
        /// The head's sequence number.
        behind_seq: i64,
    },
}

/// Where a retry message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    /// Service Bus accepted it.
    Scheduled,
    /// Service Bus refused it for what it is, and the event was dead-lettered instead.
    DeadLettered,
}

/// How long a claim on an attempt holds ([`Settler::claim`]) unless renewed: a call that runs
/// longer renews it at half this time, so a claim outlives its process by at most this.
pub const CLAIM_LEASE: Duration = Duration::from_secs(60);

/// What [`Settler::claim`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Claimed {
    /// This copy holds the claim: run the attempt, and settle from this record and ETag.
    Mine(Box<crate::ledger::Versioned<LedgerRecord>>),
    /// Another process holds a live claim on the attempt until then: wait, then claim again.
    Busy(SystemTime),
    /// The record changed since it was read and this attempt is no longer the one it waits
    /// for: act on the verdict (with the record as it is now, when there is one).
    Changed(Verdict, Option<Box<LedgerRecord>>),
}

/// A settlement that could not be made durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    /// The ledger (blob storage) failed.
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
    /// Service Bus refused or could not be reached.
    #[error("service bus: {0}")]
    Queue(#[from] RetryQueueError),
    /// The record kept changing under us.
    #[error("ledger record for {0} is contended")]
    Contended(String),
    /// A dead letter whose event is not known (its record was corrupt and set aside): only
    /// an operator can restore it from the quarantined bytes.
    #[error("the event of {key} is not known: its ledger record was corrupt; its bytes are in blob {quarantined}")]
    // Only a replay (an operator command, in the test bed) meets it.
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    EventUnknown {
        /// The key.
        key: String,
        /// The quarantine blob.
        quarantined: String,
    },
    /// The dead-letter destination refused the dead letter or could not be reached.
    #[error("{0}")]
    DeadLetters(#[from] super::dead_letter::PublishError),
}

impl SettleError {
    /// Why the work is held, for readiness and the status API: the dependency, whether it is
    /// unavailable (it may pass) or refusing (credentials, rights, a missing queue or a full
    /// one: someone must act), and what it said.
    pub fn held_reason(&self) -> String {
        let refusing = match self {
            SettleError::Queue(q) => !q.is_transient(),
            SettleError::Ledger(LedgerError::Store(s)) => !s.is_transient(),
            SettleError::Ledger(LedgerError::Corrupt { .. } | LedgerError::Contended { .. })
            | SettleError::Contended(_) => false,
            SettleError::EventUnknown { .. } => true,
            SettleError::DeadLetters(p) => !p.error.is_transient(),
        };
        let how = if refusing {
            "refuses the request"
        } else {
            "unavailable"
        };
        format!("{} {how}: {self}", self.dependency())
    }

    /// What holds the partition.
    pub fn hold_cause(&self) -> super::health::HoldCause {
        use super::health::HoldCause;
        match self {
            SettleError::Ledger(_)
            | SettleError::Contended(_)
            | SettleError::EventUnknown { .. } => HoldCause::Ledger,
            SettleError::Queue(_) => HoldCause::ServiceBus,
            SettleError::DeadLetters(_) => HoldCause::DeadLetterDestination,
        }
    }

    /// The dependency at fault, for the held reason.
    pub fn dependency(&self) -> &'static str {
        match self {
            SettleError::Ledger(_)
            | SettleError::Contended(_)
            | SettleError::EventUnknown { .. } => "blob storage (ledger)",
            SettleError::Queue(_) => "Service Bus",
            SettleError::DeadLetters(_) => "Service Bus (dead-letter destination)",
        }
    }
}

/// The body of a retry message: a claim check. The event itself is in the ledger record,
/// written before the message is sent, so the message carries only the event's identity, the
/// attempt, its due time and the trace context, and stays a few kilobytes whatever the
/// event's size (Event Hubs accepts events up to 1 MB; Service Bus Standard refuses messages
/// over 256 KB, "Service Bus quotas" on learn.microsoft.com).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryMessage {
    /// Format version: 2 (claim check); 1 carried the whole event.
    pub v: u32,
    /// The attempt this message triggers.
    pub attempt: u32,
    /// When it is due (ms since the epoch).
    pub due_ms: i64,
    /// The idempotency key: where the ledger keeps the event (version 2).
    #[serde(default)]
    pub key: String,
    /// The event, in version-1 messages only (sent before the claim check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<Event>,
    /// `traceparent`s of the earlier attempts (the last [`TRACE_LINKS_LIMIT`]).
    #[serde(default)]
    pub traceparents: Vec<String>,
    /// The deployment the retry belongs to. Absent in messages sent before deployments were
    /// named: those are taken as the receiving deployment's own (a queue had one then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<Deployment>,
    /// Where the event sits in Event Hubs, so a ledger record removed by hand can be rebuilt
    /// by reading the event back while the hub's retention keeps it. Absent in older
    /// messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Position>,
    /// The mark of an operator's pull (see [`crate::ledger::RunNow`]): set on the copy sent
    /// for it and on its deferred, recovered and rescued copies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_now: Option<i64>,
}

/// An event's place in Event Hubs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    /// The partition.
    pub partition: String,
    /// The sequence number.
    pub sequence_number: i64,
    /// The offset, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<String>,
}

impl Position {
    /// Where `event` was read from; `None` for a stand-in that was never read.
    pub fn of(event: &Event) -> Option<Self> {
        (event.sequence_number >= 0 && !event.partition_id.is_empty()).then(|| Self {
            partition: event.partition_id.clone(),
            sequence_number: event.sequence_number,
            offset: event.offset.clone(),
        })
    }
}

impl RetryMessage {
    /// The idempotency key of the event it retries.
    pub fn key(&self) -> &str {
        match &self.event {
            Some(e) if self.key.is_empty() => &e.identity.idempotency_key,
            _ => &self.key,
        }
    }
}

/// Earlier attempts' trace contexts a retry message carries (55 bytes each): the most recent
/// ones, so a message stays small however many attempts an event takes.
pub const TRACE_LINKS_LIMIT: usize = 32;

/// The Service Bus MessageId of attempt `attempt` of `key`, without the deployment:
/// [`MessageId::retry`]'s `{key}-attempt-{n}`.
#[cfg(any(test, feature = "testbed"))]
pub fn message_id(key: &str, attempt: u32) -> String {
    MessageId::retry(key, attempt).to_string()
}

/// Forwards of another deployment's retry that go back to the queue at once; later ones
/// wait longer each time (see [`Settler::forward`]). Competing receivers take messages in no
/// particular order, and the replica that hands a message back is often the one polling
/// when it reappears: a live owner gets its message within a few hops, and dozens in a row
/// mean the owner is not receiving.
pub const FORWARD_FAST_HOPS: u32 = 64;

/// The longest a handed-back copy waits before Service Bus shows it again.
pub const FORWARD_WAIT_MAX: Duration = Duration::from_secs(30);

/// The properties that name a deployment on a message, for operators browsing a queue and
/// for subscribers of a shared dead-letter queue (header values: printable ASCII only).
pub fn deployment_properties(deployment: Option<&Deployment>) -> Vec<(String, String)> {
    let Some(d) = deployment else {
        return Vec::new();
    };
    let mut p = vec![("hubguard-deployment".to_string(), d.id.clone())];
    for (name, value) in [
        ("hubguard-namespace", &d.namespace),
        ("hubguard-hub", &d.hub),
        ("hubguard-consumer-group", &d.consumer_group),
    ] {
        if ascii(value) && value.len() <= PROPERTY_KEY_LIMIT {
            p.push((name.to_string(), value.clone()));
        }
    }
    p
}

/// Makes outcomes durable.
pub struct Settler {
    /// The ledger.
    pub ledger: Ledger,
    queue: Arc<dyn RetryQueue>,
    policies: Policies,
    clock: Arc<crate::clock::Clock>,
    dead_letters: Option<Arc<super::dead_letter::DeadLetterDestination>>,
    /// Retry messages are scheduled this long before their due time, so the retry loop has
    /// them (and their ledger record) in hand when they come due; it starts them at the due
    /// time the message carries.
    lead: Duration,
    /// Whose retries these are: in every MessageId and message (`None`: unnamed, as before).
    deployment: Option<Deployment>,
}

impl std::fmt::Debug for Settler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settler")
            .field("ledger", &self.ledger)
            .finish_non_exhaustive()
    }
}

fn ascii(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// Longest key copied into the `hubguard-idempotency-key` property.
const PROPERTY_KEY_LIMIT: usize = 1024;

/// A CorrelationId or Label for Service Bus: at most 128 characters ("Service Bus quotas"
/// limits the system properties that identify a message), else the value's digest. The
/// readable value stays in the ledger and the traces.
fn bounded(value: &str) -> String {
    if value.chars().count() <= 128 {
        value.to_string()
    } else {
        crate::event::key_digest(value)
    }
}

impl Settler {
    /// A settler writing to `ledger` and `queue`.
    pub fn new(ledger: Ledger, queue: Arc<dyn RetryQueue>, policies: Policies) -> Self {
        Self {
            ledger,
            queue,
            policies,
            clock: Arc::default(),
            dead_letters: None,
            lead: Duration::ZERO,
            deployment: None,
        }
    }

    /// Names every message after `deployment`: MessageIds start with its id (so duplicate
    /// detection never drops another deployment's message of the same key and attempt), and
    /// each message carries it (so a replica of another deployment never runs it).
    pub fn with_deployment(mut self, deployment: Deployment) -> Self {
        self.deployment = Some(deployment);
        self
    }

    /// The deployment messages are named after.
    pub fn deployment(&self) -> Option<&Deployment> {
        self.deployment.as_ref()
    }

    /// Also publishes every dead letter to `destination`, before the ledger records it.
    pub fn with_dead_letters(
        mut self,
        destination: Option<Arc<super::dead_letter::DeadLetterDestination>>,
    ) -> Self {
        self.dead_letters = destination;
        self
    }

    /// The dead-letter destination, if one is configured.
    pub fn dead_letters(&self) -> Option<&Arc<super::dead_letter::DeadLetterDestination>> {
        self.dead_letters.as_ref()
    }

    /// Publishes `rec` (about to be written dead-lettered) to the destination, if any: only
    /// as the first step of the dead-letter sequence, [`Settler::write_settled`].
    async fn publish_dead_letter(&self, rec: &LedgerRecord) -> Result<(), SettleError> {
        if let Some(d) = &self.dead_letters {
            d.publish(rec).await?;
        }
        Ok(())
    }

    /// Computes due times and records times on `clock` instead of the wall clock.
    pub fn with_clock(mut self, clock: Arc<crate::clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Schedules retry messages `lead` before their due time (see the retry loop).
    pub fn with_schedule_lead(mut self, lead: Duration) -> Self {
        self.lead = lead;
        self
    }

    /// The clock due times are computed on.
    pub fn clock(&self) -> &Arc<crate::clock::Clock> {
        &self.clock
    }

    /// The policies in force (for new failures).
    pub fn policies(&self) -> &Policies {
        &self.policies
    }
}

#[cfg(any(test, feature = "testbed"))]
pub use super::message_id::{qualified, unqualified};
pub use super::message_id::{MessageId, RetryCopy};

mod claim;
mod execute;
mod missing;
#[cfg(any(test, feature = "cli"))]
mod operate;
pub(crate) mod plan;
#[cfg(any(test, feature = "cli"))]
mod replay;
mod send;
#[cfg(any(test, feature = "cli"))]
#[allow(unused_imports)]
pub use operate::{Action, ActionOutcome, OPERATOR_MARGIN};
pub use plan::Report;
use plan::{plan, Plan};
#[cfg(any(test, feature = "cli"))]
#[allow(unused_imports)]
pub use replay::{reason_name, status_class, ReplayFilter, ReplayReport, ReplayStep};

#[cfg(test)]
mod tests;
