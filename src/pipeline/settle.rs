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
use tracing::Instrument;

use crate::azure::{OutgoingMessage, RetryQueue, RetryQueueError, StoreError};
use crate::clock::{at, ms};
use crate::event::{Deployment, Event};
use crate::handler::Outcome;
use crate::ledger::{
    AttemptEntry, Change, Claim, HistoryOutcome, Ledger, LedgerError, LedgerRecord, State, Verdict,
};
use crate::policy::{DeadLetterReason, RetryPolicy};

/// The history outcome of a delivery by a replay from Event Hubs (attempt 1 again) of an
/// event whose record had counted later attempts.
#[cfg(any(test, feature = "testbed"))]
pub const DELIVERED_ON_REPLAY: &str = "delivered_on_replay";

/// Compare-and-swap rounds before giving up on a contended record.
const CAS_ROUNDS: usize = 16;

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
    Mine(Box<(LedgerRecord, String)>),
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
    #[cfg_attr(not(feature = "testbed"), allow(dead_code))]
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

    /// Publishes `rec` (about to be written dead-lettered) to the destination, if any.
    pub(crate) async fn publish_dead_letter(&self, rec: &LedgerRecord) -> Result<(), SettleError> {
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

    /// Defers attempt `attempt` of `event` to `until` (an open circuit breaker): the same
    /// attempt is scheduled again, no attempt is counted, and the ledger's next attempt time
    /// follows so `status` stays right.
    pub async fn defer(
        &self,
        event: &Event,
        attempt: u32,
        until: SystemTime,
        traceparents: &[String],
    ) -> Result<(), SettleError> {
        let until = crate::clock::ceil_to_second(until);
        let key = &event.identity.idempotency_key;
        // A copy of a superseded attempt (its lock lapsed while another receiver ran it) is
        // not deferred: make sure the recorded next attempt exists instead.
        let mut mark = None;
        if let Some((rec, _)) = self.ledger.get(key).await? {
            match Verdict::of(Some(&rec), attempt) {
                Verdict::Final(_) => return Ok(()),
                Verdict::Stale => {
                    self.resend_recorded(&rec, traceparents).await?;
                    return Ok(());
                }
                Verdict::Current | Verdict::Unrecorded => {}
            }
            // The deferred copy of an attempt an operator pulled forward is still that copy.
            mark = rec.run_now_mark(attempt);
        }
        let id = MessageId::retry(key, attempt).copy(RetryCopy::Deferred {
            until_ms: ms(until),
        });
        let sent = self
            .schedule_marked(id, event, attempt, until, traceparents, mark)
            .await;
        if self.sent_or_dead_lettered(key, sent).await? == Sent::DeadLettered {
            return Ok(());
        }
        // The ledger's next attempt time follows, if the record still waits for it.
        self.ledger
            .update(key, |rec| match rec {
                Some(mut rec)
                    if rec.state == State::RetryScheduled && rec.attempts + 1 == attempt =>
                {
                    rec.next_attempt_ms = Some(ms(until));
                    rec.claim = None;
                    Change::Write(Box::new(rec), ())
                }
                _ => Change::Keep(()),
            })
            .await?;
        Ok(())
    }

    /// Puts back a retry that Service Bus dead-lettered (its sequence number there is
    /// `dead_letter_seq`) for the event `rec` records: the same attempt, due when it was (or
    /// now), under a MessageId of its own so duplicate detection cannot drop it, and a second
    /// rescue of the same copy (after a crash before it was completed) can.
    pub async fn rescue(
        &self,
        rec: &LedgerRecord,
        message: &RetryMessage,
        dead_letter_seq: i64,
    ) -> Result<(), SettleError> {
        let id = MessageId::retry(&rec.key, message.attempt)
            .copy(RetryCopy::Rescued { dead_letter_seq });
        let due = at(message.due_ms).max(self.clock.now());
        let sent = self
            .schedule_marked(
                id,
                &rec.event,
                message.attempt,
                due,
                &message.traceparents,
                message.run_now,
            )
            .await;
        self.sent_or_dead_lettered(&rec.key, sent).await?;
        Ok(())
    }

    /// Schedules again, due now and under a fresh MessageId, the retry `key`'s record says is
    /// waiting, if it is still waiting and was due before `overdue_before`. The record's due
    /// time moves to now first (compare-and-swap: one sweeper wins). `Ok(true)` when it was
    /// recovered.
    pub async fn recover(
        &self,
        key: &str,
        overdue_before: SystemTime,
    ) -> Result<bool, SettleError> {
        let now = self.clock.now();
        let recovering = self
            .ledger
            .update(key, |rec| match rec {
                Some(mut rec)
                    if rec.state == State::RetryScheduled
                        && rec
                            .next_attempt_at()
                            .is_some_and(|due| due < overdue_before)
                        // Not while a retry loop runs it (a live claim).
                        && rec.claim.as_ref().is_none_or(|c| !c.live(now)) =>
                {
                    rec.next_attempt_ms = Some(ms(now));
                    rec.updated_ms = ms(now);
                    Change::Write(Box::new(rec.clone()), Some(rec))
                }
                _ => Change::Keep(None),
            })
            .await?;
        let Some(rec) = recovering else {
            return Ok(false);
        };
        let attempt = rec.attempts + 1;
        let id = MessageId::retry(key, attempt).copy(RetryCopy::Recovered { at_ms: ms(now) });
        let mark = rec.run_now_mark(attempt);
        let sent = self
            .schedule_marked(id, &rec.event, attempt, now, &[], mark)
            .await;
        Ok(self.sent_or_dead_lettered(key, sent).await? == Sent::Scheduled)
    }

    /// Claims attempt `attempt` of `key` for the copy of its retry message in hand, before
    /// the handler is called (see [`Claim`](crate::ledger::Claim) for the rule): a
    /// compare-and-swap over `read` (the record read at the due time, with its ETag), so of
    /// two copies that read the same record one claims it and the other reads again. A live
    /// claim of another process makes this copy wait ([`Claimed::Busy`]); an expired one, or
    /// one of this same `instance` (whose copy is no longer in hand), is taken over.
    pub async fn claim(
        &self,
        key: &str,
        attempt: u32,
        mut read: Option<(LedgerRecord, String)>,
        owner: &str,
        instance: &str,
    ) -> Result<Claimed, SettleError> {
        for _ in 0..CAS_ROUNDS {
            let current = match read.take() {
                Some(known) => Some(known),
                None => match self.ledger.get(key).await {
                    Err(LedgerError::Corrupt { reason, .. }) => {
                        self.ledger
                            .quarantine(key, None, &reason, self.clock.now())
                            .await?;
                        return Ok(Claimed::Changed(Verdict::Final(State::DeadLettered), None));
                    }
                    other => other?,
                },
            };
            let Some((mut rec, etag)) = current else {
                return Ok(Claimed::Changed(Verdict::Unrecorded, None));
            };
            let verdict = Verdict::of(Some(&rec), attempt);
            if verdict != Verdict::Current {
                return Ok(Claimed::Changed(verdict, Some(Box::new(rec))));
            }
            let now = self.clock.now();
            if let Some(c) = &rec.claim {
                if c.attempt == attempt && c.instance != instance && c.live(now) {
                    return Ok(Claimed::Busy(at(c.until_ms)));
                }
            }
            rec.claim = Some(Claim {
                attempt,
                owner: owner.to_string(),
                instance: instance.to_string(),
                until_ms: ms(now + CLAIM_LEASE),
            });
            match self.ledger.put(&rec, Some(&etag)).await {
                Ok(etag) => return Ok(Claimed::Mine(Box::new((rec, etag)))),
                Err(LedgerError::Store(StoreError::Conflict)) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(SettleError::Contended(key.to_string()))
    }

    /// Extends the claim `claimed` holds by another [`CLAIM_LEASE`] (while a call runs long),
    /// keeping its record and ETag current. A conflict means the claim was taken over (it had
    /// lapsed): the settlement then decides on what the record says.
    pub async fn renew_claim(
        &self,
        claimed: &mut (LedgerRecord, String),
    ) -> Result<(), SettleError> {
        let (rec, etag) = claimed;
        let mut renewed = rec.clone();
        match &mut renewed.claim {
            Some(c) => c.until_ms = ms(self.clock.now() + CLAIM_LEASE),
            None => return Ok(()),
        }
        let new_etag = self.ledger.put(&renewed, Some(etag)).await?;
        *claimed = (renewed, new_etag);
        Ok(())
    }

    /// Gives up the claim `claimed` holds without running the attempt (its lock lapsed
    /// before the call): best effort, as an expired claim is taken over anyway.
    pub async fn release_claim(&self, claimed: (LedgerRecord, String)) {
        let (mut rec, etag) = claimed;
        rec.claim = None;
        if let Err(e) = self.ledger.put(&rec, Some(&etag)).await {
            tracing::debug!(key = %rec.key, error = %e, "could not release a claim; it expires by itself");
        }
    }

    /// Makes sure the next attempt `rec` records exists on Service Bus (a repeat within the
    /// duplicate-detection window is dropped); returns its due time, or `None` when Service
    /// Bus refused the message and the event was dead-lettered instead. For copies of
    /// attempts the ledger has already recorded.
    pub async fn resend_recorded(
        &self,
        rec: &LedgerRecord,
        traceparents: &[String],
    ) -> Result<Option<SystemTime>, SettleError> {
        let due = rec.next_attempt_at().unwrap_or_else(|| self.clock.now());
        let sent = self
            .schedule(&rec.event, rec.attempts + 1, due, traceparents)
            .await;
        Ok(match self.sent_or_dead_lettered(&rec.key, sent).await? {
            Sent::Scheduled => Some(due),
            Sent::DeadLettered => None,
        })
    }

    /// Schedules attempt `attempt` of `event` for `due`.
    pub async fn schedule(
        &self,
        event: &Event,
        attempt: u32,
        due: SystemTime,
        traceparents: &[String],
    ) -> Result<(), RetryQueueError> {
        self.schedule_as(
            MessageId::retry(&event.identity.idempotency_key, attempt),
            event,
            attempt,
            due,
            traceparents,
        )
        .await
    }

    /// [`Sent::Scheduled`] when the retry message was sent. When Service Bus refused that
    /// one message for what it is (it would refuse it every time), holding the event would
    /// hold its partition forever: the event is dead-lettered instead, with reason
    /// [`DeadLetterReason::RetryRefused`] and Service Bus's words as its last error
    /// ([`Sent::DeadLettered`]). Any other failure is returned: the caller holds and tries
    /// again.
    async fn sent_or_dead_lettered(
        &self,
        key: &str,
        sent: Result<(), RetryQueueError>,
    ) -> Result<Sent, SettleError> {
        match sent {
            Ok(()) => Ok(Sent::Scheduled),
            Err(e) if e.is_refusal_of_request() => {
                tracing::error!(key = %key, error = %e, "Service Bus refused the retry message; dead-lettering the event (`hubguard dead-letters replay` sends it again once the cause is fixed)");
                self.dead_letter_refused(key, &e).await?;
                Ok(Sent::DeadLettered)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Marks `key`'s record dead-lettered because Service Bus refused its retry message
    /// (see [`plan::refusal`]), planning again on a conflict.
    async fn dead_letter_refused(&self, key: &str, e: &RetryQueueError) -> Result<(), SettleError> {
        let error = e.to_string();
        for _ in 0..CAS_ROUNDS {
            let Some((rec, etag)) = self.ledger.get(key).await? else {
                return Ok(());
            };
            let Some(dead) = plan::refusal(&rec, &error, self.clock.now()) else {
                return Ok(());
            };
            if self.dead_letter_written(&dead, Some(&etag)).await? {
                return Ok(());
            }
        }
        Err(SettleError::Contended(key.to_string()))
    }

    async fn schedule_as(
        &self,
        id: MessageId<'_>,
        event: &Event,
        attempt: u32,
        due: SystemTime,
        traceparents: &[String],
    ) -> Result<(), RetryQueueError> {
        self.schedule_marked(id, event, attempt, due, traceparents, None)
            .await
    }

    /// [`schedule_as`](Self::schedule_as), the copy carrying an operator's pull `mark`.
    async fn schedule_marked(
        &self,
        id: MessageId<'_>,
        event: &Event,
        attempt: u32,
        due: SystemTime,
        traceparents: &[String],
        mark: Option<i64>,
    ) -> Result<(), RetryQueueError> {
        let identity = &event.identity;
        let links = traceparents.len().saturating_sub(TRACE_LINKS_LIMIT);
        let body = RetryMessage {
            v: 2,
            attempt,
            due_ms: ms(due),
            key: identity.idempotency_key.clone(),
            event: None,
            traceparents: traceparents[links..].to_vec(),
            deployment: self.deployment.clone(),
            origin: Position::of(event),
            run_now: mark,
        };
        let mut properties = vec![("hubguard-attempt".to_string(), attempt.to_string())];
        properties.extend(deployment_properties(self.deployment.as_ref()));
        // A readable copy for operators browsing the queue, when it is a header value Service
        // Bus takes (printable ASCII; a property is at most 32 KB, all headers 64 KB).
        if ascii(&identity.idempotency_key) && identity.idempotency_key.len() <= PROPERTY_KEY_LIMIT
        {
            properties.push((
                "hubguard-idempotency-key".into(),
                identity.idempotency_key.clone(),
            ));
        }
        let span = tracing::info_span!(target: "hubguard::attempt", "schedule", otel.name = crate::telemetry::names::span::SCHEDULE, attempt);
        self.queue
            .schedule(OutgoingMessage {
                message_id: id.qualified(self.deployment.as_ref()),
                correlation_id: Some(bounded(&identity.correlation_id)),
                label: identity.event_type.as_deref().map(bounded),
                body: serde_json::to_string(&body)
                    .map_err(|e| RetryQueueError::Protocol(e.to_string()))?,
                content_type: Some("application/json".into()),
                due: self.visible_at(due),
                time_to_live: None,
                properties,
            })
            .instrument(span)
            .await
    }

    /// When Service Bus should hand over a message due at `due`. The body carries the due
    /// time; Service Bus hands the message over up to `lead` earlier, but never before the
    /// next whole second: it stays a scheduled message, as without a lead.
    fn visible_at(&self, due: SystemTime) -> SystemTime {
        due.checked_sub(self.lead)
            .unwrap_or(due)
            .max(crate::clock::ceil_to_second(
                self.clock.now() + Duration::from_millis(1),
            ))
            .min(due)
    }

    /// Hands a retry message of another deployment (received from a queue the two share)
    /// back to the queue for its own deployment, unchanged: the same body, due when it was,
    /// under a MessageId of its own — `{its deployment}.{key}-attempt-{n}-fwd-{sequence
    /// number of this copy}` — so duplicate detection drops a second forward of the same copy
    /// (a crash before it was completed) and nothing else. `forwards` counts the hops so far:
    /// after [`FORWARD_FAST_HOPS`] a copy waits a little longer each time (up to
    /// [`FORWARD_WAIT_MAX`]), so a deployment that no longer runs costs the others little.
    pub async fn forward(
        &self,
        raw_body: &str,
        message: &RetryMessage,
        theirs: &Deployment,
        sequence_number: i64,
        forwards: u32,
    ) -> Result<(), RetryQueueError> {
        let id = MessageId::retry(message.key(), message.attempt)
            .copy(RetryCopy::Forwarded { sequence_number })
            .qualified(Some(theirs));
        let mut visible = self.visible_at(at(message.due_ms));
        if let Some(extra) = forwards.checked_sub(FORWARD_FAST_HOPS) {
            let wait = Duration::from_secs(1u64 << extra.min(6)).min(FORWARD_WAIT_MAX);
            visible = visible.max(crate::clock::ceil_to_second(self.clock.now() + wait));
        }
        let mut properties = vec![
            ("hubguard-attempt".to_string(), message.attempt.to_string()),
            ("hubguard-forwards".to_string(), (forwards + 1).to_string()),
        ];
        properties.extend(deployment_properties(Some(theirs)));
        self.queue
            .schedule(OutgoingMessage {
                message_id: id,
                correlation_id: None,
                label: None,
                body: raw_body.to_string(),
                content_type: Some("application/json".into()),
                due: visible,
                time_to_live: None,
                properties,
            })
            .await
    }

    /// Rebuilds the ledger record of `event` (read back from Event Hubs because its record
    /// is missing) as the retry `message` expects it: attempt `message.attempt - 1` failed
    /// and attempt `message.attempt` is due when the message says, under the policy in force
    /// for its type. Created with `If-None-Match: *`: if a record appeared meanwhile, that
    /// one is returned.
    pub async fn rebuild_missing(
        &self,
        event: &Event,
        message: &RetryMessage,
        origin: &Position,
    ) -> Result<(LedgerRecord, String), SettleError> {
        let key = &event.identity.idempotency_key;
        let now = self.clock.now();
        let error = format!(
            "the ledger record was missing while attempt {} waited; rebuilt from Event Hubs (partition {}, sequence number {})",
            message.attempt, origin.partition, origin.sequence_number
        );
        let rec = LedgerRecord {
            attempts: message.attempt.saturating_sub(1),
            next_attempt_ms: Some(message.due_ms),
            last_error: Some(error),
            ..plan::first_failure(event, &self.policies, now)
        };
        match self.ledger.put(&rec, None).await {
            Ok(etag) => Ok((rec, etag)),
            Err(LedgerError::Store(StoreError::Conflict)) => self
                .ledger
                .get(key)
                .await?
                .ok_or_else(|| SettleError::Contended(key.clone())),
            Err(e) => Err(e.into()),
        }
    }

    /// Dead-letters the event of a retry `message` whose ledger record is missing and whose
    /// event cannot be read back (past the hub's retention, another event at its position,
    /// or an older message that does not say where it was): reason
    /// [`DeadLetterReason::RecordMissing`], `why` as its last error, the key in the
    /// dead-letter index (`hubguard dead-letters list`). The event itself is unknown: the
    /// record is a stand-in marked `event_unknown`, and a replay says so.
    pub async fn dead_letter_missing(
        &self,
        message: &RetryMessage,
        why: &str,
    ) -> Result<(), SettleError> {
        let key = message.key().to_string();
        let now = ms(self.clock.now());
        let origin = message.origin.clone();
        let error = format!(
            "the ledger record was missing while attempt {} waited, and the event could not be read back from Event Hubs: {why}",
            message.attempt
        );
        let rec = LedgerRecord {
            key: key.clone(),
            correlation_id: key.clone(),
            event_type: None,
            state: State::DeadLettered,
            attempts: message.attempt.saturating_sub(1),
            next_attempt_ms: None,
            first_failure_ms: now,
            updated_ms: now,
            last_error: Some(error.clone()),
            dead_letter_reason: Some(DeadLetterReason::RecordMissing),
            last_delay_ms: None,
            policy: self.policies.default.clone(),
            attempt_base: 0,
            history: vec![AttemptEntry {
                attempt: message.attempt,
                started_ms: now,
                finished_ms: now,
                outcome: HistoryOutcome::DeadLettered,
                error: Some(error),
                next_attempt_ms: None,
                trace_id: None,
                retry_after_capped_from_s: None,
            }],
            event: Event {
                body: Vec::new(),
                content_type: None,
                properties: Default::default(),
                hub: self
                    .deployment
                    .as_ref()
                    .map(|d| d.hub.clone())
                    .unwrap_or_default(),
                partition_id: origin
                    .as_ref()
                    .map(|o| o.partition.clone())
                    .unwrap_or_default(),
                sequence_number: origin.as_ref().map_or(-1, |o| o.sequence_number),
                offset: origin.and_then(|o| o.offset),
                enqueued_ms: None,
                partition_key: None,
                identity: crate::event::Identity {
                    idempotency_key: key.clone(),
                    correlation_id: key.clone(),
                    event_type: None,
                },
            },
            quarantined: None,
            event_unknown: true,
            claim: None,
            run_now: None,
            indexed: None,
        };
        self.publish_dead_letter(&rec).await?;
        self.ledger.index_dead_letter(&key).await?;
        match self.ledger.put(&rec, None).await {
            // A record appeared meanwhile (a replay from Event Hubs wrote it): it holds the
            // event, and the ledger's sweep runs what it says is waiting.
            Ok(_) | Err(LedgerError::Store(StoreError::Conflict)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Settles the outcome `report` carries.
    pub async fn settle(&self, report: &Report<'_>) -> Result<Settled, SettleError> {
        self.settle_from(None, report).await
    }

    /// [`settle`](Self::settle), starting from the ledger record (and its ETag) the caller
    /// read to decide that this attempt was the current one: the retry loop's one read of a
    /// retry. The write's `If-Match` proves nobody wrote since; if somebody did, the record is
    /// read again and the decision made again.
    pub async fn settle_from(
        &self,
        read: Option<(LedgerRecord, String)>,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        // Also a first attempt from Event Hubs that was delivered: whether its event may have
        // a record is the partition's knowledge (see `pipeline::recorded`), which skips this
        // call when it provably has none. Here the ledger is asked.
        match self.execute_plans(read, report).await {
            // A record that cannot be parsed would hold the event (and its partition) forever:
            // set it aside and dead-letter the event, which is in hand.
            Err(SettleError::Ledger(LedgerError::Corrupt { reason, .. })) => {
                let event = report.event;
                self.ledger
                    .quarantine(
                        &event.identity.idempotency_key,
                        Some(event),
                        &reason,
                        self.clock.now(),
                    )
                    .await?;
                Ok(Settled::DeadLettered(DeadLetterReason::CorruptRecord))
            }
            other => other,
        }
    }

    /// Plans the settlement of `report` on the record (the caller's `read` first, then a
    /// fresh read after each conflict) and executes the plan; a write that finds the record
    /// changed (412) plans again on what it now says.
    async fn execute_plans(
        &self,
        mut read: Option<(LedgerRecord, String)>,
        report: &Report<'_>,
    ) -> Result<Settled, SettleError> {
        let key = &report.event.identity.idempotency_key;
        for _ in 0..CAS_ROUNDS {
            let current = match read.take() {
                Some(known) => Some(known),
                None => self.ledger.get(key).await?,
            };
            let (record, etag) = match current {
                Some((r, e)) => (Some(r), Some(e)),
                None => (None, None),
            };
            let plan = plan(
                record.as_ref(),
                report,
                &self.policies,
                self.clock.now(),
                &mut rand::thread_rng(),
            );
            if let Some(settled) = self.execute(plan, etag.as_deref(), report).await? {
                return Ok(settled);
            }
        }
        Err(match report.outcome {
            Outcome::Delivered => SettleError::Ledger(LedgerError::Contended { key: key.clone() }),
            Outcome::Failed(_) => SettleError::Contended(key.clone()),
        })
    }

    /// Performs `plan`'s effects in the order the invariant needs, writing the record with
    /// `If-Match: etag` (`If-None-Match: *` without one). `None` when that write found the
    /// record changed: nothing after it was done, and the caller plans again.
    async fn execute(
        &self,
        plan: Plan,
        etag: Option<&str>,
        report: &Report<'_>,
    ) -> Result<Option<Settled>, SettleError> {
        let key = &report.event.identity.idempotency_key;
        match plan {
            Plan::Done(settled) => Ok(Some(settled)),
            Plan::RecordDelivery(record) => Ok(self
                .written(&record, etag)
                .await?
                .then_some(Settled::Delivered)),
            Plan::ResendRecorded(record) => {
                // This attempt is already recorded (a replay): make sure the recorded next
                // attempt exists on Service Bus (a repeat is dropped by duplicate detection).
                super::attempt::mark_replay(&tracing::Span::current());
                Ok(Some(
                    match self.resend_recorded(&record, report.traceparents).await? {
                        Some(due) => Settled::RetryScheduled {
                            attempt: record.attempts + 1,
                            due,
                        },
                        None => Settled::DeadLettered(DeadLetterReason::RetryRefused),
                    },
                ))
            }
            Plan::Schedule {
                record,
                attempt,
                due,
                capped_from,
            } => {
                // Ledger first: if Service Bus then fails, the replay (or the redelivered
                // retry message) finds the attempt recorded and re-sends the same message.
                if !self.written(&record, etag).await? {
                    return Ok(None);
                }
                super::attempt::mark_retry_after_capped(&tracing::Span::current(), capped_from);
                let sent = self
                    .schedule(report.event, attempt, due, report.traceparents)
                    .await;
                Ok(Some(match self.sent_or_dead_lettered(key, sent).await? {
                    Sent::Scheduled => Settled::RetryScheduled { attempt, due },
                    Sent::DeadLettered => Settled::DeadLettered(DeadLetterReason::RetryRefused),
                }))
            }
            Plan::DeadLetter { record, reason } => Ok(self
                .dead_letter_written(&record, etag)
                .await?
                .then_some(Settled::DeadLettered(reason))),
        }
    }

    /// Writes `record` over the version `etag` names; `false` when it changed since (412).
    async fn written(
        &self,
        record: &LedgerRecord,
        etag: Option<&str>,
    ) -> Result<bool, SettleError> {
        match self.ledger.put(record, etag).await {
            Ok(_) => Ok(true),
            Err(LedgerError::Store(StoreError::Conflict)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// A dead letter's effects, in their order: published to the destination (if any),
    /// indexed, then `record` (dead-lettered) written over the version `etag` names; `false`
    /// when it changed since (412).
    async fn dead_letter_written(
        &self,
        record: &LedgerRecord,
        etag: Option<&str>,
    ) -> Result<bool, SettleError> {
        self.publish_dead_letter(record).await?;
        self.ledger.index_dead_letter(&record.key).await?;
        self.written(record, etag).await
    }

    /// Replays a dead-lettered event: schedules its next attempt now with a fresh attempt
    /// budget, and takes it off the dead-letter index.
    #[cfg(any(test, feature = "testbed"))]
    pub async fn replay(&self, key: &str) -> Result<Option<u32>, SettleError> {
        self.replay_if(key, |_| true).await
    }

    /// [`replay`](Self::replay), if the dead-lettered record still matches `matches` when
    /// it is replayed (under the compare-and-swap): `Ok(None)` when it does not, or is no
    /// longer dead-lettered.
    #[cfg(any(test, feature = "testbed"))]
    pub async fn replay_if(
        &self,
        key: &str,
        matches: impl Fn(&LedgerRecord) -> bool,
    ) -> Result<Option<u32>, SettleError> {
        match self.replay_record_if(key, matches).await? {
            Some(rec) => self.send_replayed(&rec).await.map(Some),
            None => Ok(None),
        }
    }

    /// The first half of [`replay_if`](Self::replay_if): the dead-lettered record becomes a
    /// retry due now (a fresh attempt budget), its message not yet sent. `Ok(None)` when it
    /// no longer matches or is no longer dead-lettered. Until [`send_replayed`](Self::send_replayed)
    /// sends it, the retry loop's overdue sweep would send it (the record is due).
    #[cfg(any(test, feature = "testbed"))]
    pub(crate) async fn replay_record_if(
        &self,
        key: &str,
        matches: impl Fn(&LedgerRecord) -> bool,
    ) -> Result<Option<LedgerRecord>, SettleError> {
        let now = self.clock.now();
        self.ledger
            .update(key, |rec| match rec {
                Some(rec) if rec.state == State::DeadLettered && !matches(&rec) => {
                    Change::Keep(Ok(None))
                }
                Some(rec) if rec.state == State::DeadLettered && rec.event_unknown => {
                    Change::Keep(Err(SettleError::EventUnknown {
                        key: key.to_string(),
                        quarantined: rec.quarantined.clone().unwrap_or_default(),
                    }))
                }
                Some(mut rec) if rec.state == State::DeadLettered => {
                    rec.state = State::RetryScheduled;
                    rec.attempt_base = rec.attempts;
                    rec.first_failure_ms = ms(now);
                    rec.next_attempt_ms = Some(ms(now));
                    rec.dead_letter_reason = None;
                    rec.updated_ms = ms(now);
                    // The replayed attempt runs from the copy sent now only: a copy of it
                    // sent before (a cancelled retry's) stands down when it arrives.
                    rec.run_now = Some(crate::ledger::RunNow {
                        attempt: rec.attempts + 1,
                        at_ms: ms(now),
                        by: "replay".into(),
                        previous_due_ms: None,
                    });
                    Change::Write(Box::new(rec.clone()), Ok(Some(rec)))
                }
                _ => Change::Keep(Ok(None)),
            })
            .await?
    }

    /// The second half of [`replay_if`](Self::replay_if): sends the replayed record's
    /// message; the attempt it runs.
    #[cfg(any(test, feature = "testbed"))]
    pub(crate) async fn send_replayed(&self, rec: &LedgerRecord) -> Result<u32, SettleError> {
        let key = rec.key.as_str();
        let marked = rec.run_now.as_ref().map_or(rec.updated_ms, |r| r.at_ms);
        // A MessageId of its own: the attempt's plain one may still be in the
        // duplicate-detection window (a cancelled retry's), and would be dropped.
        // Off the dead-letter index before the copy is sent: an attempt that dead-letters
        // it again at once indexes it again, and must not be undone by this.
        self.ledger.unindex_dead_letter(key).await?;
        let attempt = rec.attempts + 1;
        let id = MessageId::retry(key, attempt).copy(RetryCopy::Replayed { at_ms: marked });
        if let Err(e) = self
            .schedule_marked(id, &rec.event, attempt, at(marked), &[], Some(marked))
            .await
        {
            if e.is_refusal_of_request() {
                // Refused again: it stays a dead letter, with Service Bus's reason.
                self.dead_letter_refused(key, &e).await?;
            }
            return Err(e.into());
        }
        Ok(attempt)
    }
}

pub use super::message_id::{MessageId, RetryCopy};
#[cfg(any(test, feature = "testbed"))]
pub use super::message_id::{qualified, unqualified};

#[cfg(any(test, feature = "testbed"))]
mod operate;
pub(crate) mod plan;
#[cfg(any(test, feature = "testbed"))]
pub use operate::{
    reason_name, Action, ActionOutcome, ReplayFilter, ReplayReport, ReplayStep, OPERATOR_MARGIN,
};
pub use plan::Report;
use plan::{plan, Plan};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::azure::memory::{MemoryRecordStore, MemoryRetryQueue};
    use crate::azure::RecordStore;
    use crate::clock::Clock;
    use crate::event::{Event, Identity};
    use crate::handler::Failure;
    use crate::policy::{Curve, RetryPolicy};

    fn event(key: &str) -> Event {
        Event {
            body: b"payload".to_vec(),
            content_type: None,
            properties: Default::default(),
            hub: "hub".into(),
            partition_id: "0".into(),
            sequence_number: 7,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: Identity {
                idempotency_key: key.into(),
                correlation_id: key.into(),
                event_type: None,
            },
        }
    }

    struct Bed {
        clock: Arc<Clock>,
        records: Arc<MemoryRecordStore>,
        queue: Arc<MemoryRetryQueue>,
        settler: Settler,
    }

    fn bed_with(queue: Option<Arc<dyn RetryQueue>>) -> Bed {
        let clock = Arc::new(Clock::default());
        let records = Arc::new(MemoryRecordStore::new());
        let memory = Arc::new(MemoryRetryQueue::new(clock.clone()));
        let ledger = Ledger::new(records.clone(), "hub", "$Default");
        let policy = RetryPolicy {
            name: "test".into(),
            curve: Curve::Fixed,
            base_s: 10,
            floor_s: 10,
            cap_s: 60,
            max_attempts: 3,
            max_age_s: None,
        };
        let settler = Settler::new(
            ledger,
            queue.unwrap_or_else(|| memory.clone()),
            Policies {
                default: policy,
                by_type: HashMap::new(),
            },
        )
        .with_clock(clock.clone());
        Bed {
            clock,
            records,
            queue: memory,
            settler,
        }
    }

    fn bed() -> Bed {
        bed_with(None)
    }

    async fn fail(
        b: &Bed,
        key: &str,
        attempt: u32,
        source: Source,
    ) -> Result<Settled, SettleError> {
        b.settler
            .settle(&Report {
                event: &event(key),
                attempt,
                source,
                started: b.clock.now(),
                outcome: &Outcome::Failed(Failure::transient("boom")),
                trace_id: "0af7651916cd43dd8448eb211c80319c",
                traceparents: &[],
            })
            .await
    }

    #[tokio::test]
    async fn a_failure_records_the_attempt_then_schedules_a_claim_check() {
        let b = bed();
        let s = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        assert!(
            matches!(s, Settled::RetryScheduled { attempt: 2, .. }),
            "{s:?}"
        );
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        assert_eq!((rec.state, rec.attempts), (State::RetryScheduled, 1));
        assert_eq!(b.queue.accepted(), vec!["k-attempt-2"]);
        let body: RetryMessage = serde_json::from_str(&b.queue.bodies()[0]).unwrap();
        assert_eq!((body.v, body.key.as_str(), body.attempt), (2, "k", 2));
        assert!(body.event.is_none(), "the event stays in the ledger");
        assert_eq!(Some(at(body.due_ms)), rec.next_attempt_at());
    }

    #[tokio::test]
    async fn settling_from_the_record_in_hand_reads_nothing_unless_someone_wrote_since() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        let read = b.settler.ledger.get("k").await.unwrap().unwrap();
        let k = event("k");
        let report = Report {
            event: &k,
            attempt: 2,
            source: Source::Retry,
            started: b.clock.now(),
            outcome: &Outcome::Delivered,
            trace_id: "0af7651916cd43dd8448eb211c80319c",
            traceparents: &[],
        };
        let delivered = |read| b.settler.settle_from(read, &report);
        // Nobody wrote since the read: the write's If-Match proves it, no second read.
        let before = b.records.reads();
        assert_eq!(delivered(Some(read)).await.unwrap(), Settled::Delivered);
        assert_eq!(b.records.reads(), before, "one read per retry");
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        assert_eq!((rec.state, rec.attempts), (State::Delivered, 2));

        // Somebody wrote after the read (attempt 2 failed elsewhere): the conflict reads the
        // record again and decides on what it says now.
        fail(&b, "j", 1, Source::EventHubs).await.unwrap();
        let stale = b.settler.ledger.get("j").await.unwrap().unwrap();
        fail(&b, "j", 2, Source::Retry).await.unwrap();
        let messages = b.queue.len();
        let failed = b
            .settler
            .settle_from(
                Some(stale),
                &Report {
                    event: &event("j"),
                    attempt: 2,
                    source: Source::Retry,
                    started: b.clock.now(),
                    outcome: &Outcome::Failed(Failure::transient("boom")),
                    trace_id: "0af7651916cd43dd8448eb211c80319c",
                    traceparents: &[],
                },
            )
            .await
            .unwrap();
        assert!(
            matches!(failed, Settled::RetryScheduled { attempt: 3, .. }),
            "{failed:?}"
        );
        let (rec, _) = b.settler.ledger.get("j").await.unwrap().unwrap();
        assert_eq!(rec.attempts, 2, "attempt 2 recorded once");
        assert_eq!(
            b.queue.len(),
            messages,
            "no second retry message for attempt 3"
        );
    }

    #[tokio::test]
    async fn a_record_read_early_is_revalidated_by_its_etag() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        let ledger = &b.settler.ledger;
        let (_, etag) = ledger.get("k").await.unwrap().unwrap();
        assert!(ledger.get_if_changed("k", &etag).await.unwrap().is_none());
        fail(&b, "k", 2, Source::Retry).await.unwrap();
        let (rec, now) = ledger
            .get_if_changed("k", &etag)
            .await
            .unwrap()
            .expect("changed")
            .expect("still there");
        assert_eq!(rec.attempts, 2);
        assert_ne!(now, etag);
        assert!(ledger.get_if_changed("k", &now).await.unwrap().is_none());
        assert_eq!(
            ledger.get_if_changed("gone", &now).await.unwrap(),
            Some(None)
        );
    }

    #[tokio::test]
    async fn a_replayed_attempt_resends_the_recorded_retry_and_counts_nothing() {
        let b = bed();
        let first = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        b.clock.advance(Duration::from_secs(3));
        let replay = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        assert_eq!(first, replay, "the same attempt and due time");
        assert_eq!(
            b.queue.accepted(),
            vec!["k-attempt-2"],
            "the repeat was dropped"
        );
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        assert_eq!(rec.attempts, 1);
        assert_eq!(rec.history.len(), 1);
    }

    #[tokio::test]
    async fn a_final_record_wins_over_late_attempts() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        let delivered = b
            .settler
            .settle(&Report {
                event: &event("k"),
                attempt: 2,
                source: Source::Retry,
                started: b.clock.now(),
                outcome: &Outcome::Delivered,
                trace_id: "t",
                traceparents: &[],
            })
            .await
            .unwrap();
        assert_eq!(delivered, Settled::Delivered);
        let late = fail(&b, "k", 2, Source::Retry).await.unwrap();
        assert_eq!(late, Settled::AlreadyFinal(State::Delivered));
    }

    struct Refusing;

    #[async_trait::async_trait]
    impl RetryQueue for Refusing {
        async fn schedule(&self, _: OutgoingMessage) -> Result<(), RetryQueueError> {
            Err(RetryQueueError::Refused {
                status: 400,
                detail: "The message was refused.".into(),
            })
        }
        async fn receive(
            &self,
            _: Duration,
        ) -> Result<Option<crate::azure::ReceivedMessage>, RetryQueueError> {
            Ok(None)
        }
    }

    #[tokio::test]
    async fn a_retry_message_service_bus_refuses_dead_letters_the_event() {
        let b = bed_with(Some(Arc::new(Refusing)));
        let s = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        assert_eq!(s, Settled::DeadLettered(DeadLetterReason::RetryRefused));
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        assert_eq!(rec.state, State::DeadLettered);
        assert!(rec.last_error.unwrap().contains("refused"));
        assert_eq!(
            b.settler.ledger.dead_letter_keys().await.unwrap(),
            vec!["k"]
        );
    }

    #[tokio::test]
    async fn a_corrupt_record_is_set_aside_and_the_event_dead_lettered() {
        let b = bed();
        let name = b.settler.ledger.record_name("k");
        b.records
            .overwrite(&name, bytes::Bytes::from_static(b"{oops"));
        let s = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        assert_eq!(s, Settled::DeadLettered(DeadLetterReason::CorruptRecord));
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        let aside = rec.quarantined.unwrap();
        assert_eq!(
            b.records.read(&aside).await.unwrap().unwrap().body,
            bytes::Bytes::from_static(b"{oops")
        );
        assert_eq!(
            rec.event,
            event("k"),
            "the event in hand is kept for a replay"
        );
    }

    #[tokio::test]
    async fn one_copy_claims_an_attempt_and_a_claim_left_behind_expires() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        let read = b.settler.ledger.get("k").await.unwrap().unwrap();
        let ledger = &b.settler.ledger;
        // Two copies read the same record; the first claims it.
        let mine = b
            .settler
            .claim("k", 2, Some(read.clone()), "replica-a", "instance-a")
            .await
            .unwrap();
        let Claimed::Mine(claimed) = mine else {
            panic!("{mine:?}")
        };
        assert_eq!(claimed.0.claim.as_ref().map(|c| c.attempt), Some(2));
        // The second one's compare-and-swap fails; it reads again and finds the live claim.
        let busy = b
            .settler
            .claim("k", 2, Some(read), "replica-b", "instance-b")
            .await
            .unwrap();
        let Claimed::Busy(until) = busy else {
            panic!("{busy:?}")
        };
        assert_eq!(until, b.clock.now().max(until));
        // The same process may take its own claim back (its copy is no longer in hand).
        assert!(matches!(
            b.settler
                .claim("k", 2, None, "replica-a", "instance-a")
                .await
                .unwrap(),
            Claimed::Mine(_)
        ));
        // A claim whose process died expires, and another copy takes it over.
        b.clock.advance(CLAIM_LEASE + Duration::from_secs(1));
        let taken = b
            .settler
            .claim("k", 2, None, "replica-b", "instance-b")
            .await
            .unwrap();
        let Claimed::Mine(taken) = taken else {
            panic!("{taken:?}")
        };
        // Its settlement clears the claim, and later copies find the attempt done.
        let delivered = b
            .settler
            .settle_from(
                Some(*taken),
                &Report {
                    event: &event("k"),
                    attempt: 2,
                    source: Source::Retry,
                    started: b.clock.now(),
                    outcome: &Outcome::Delivered,
                    trace_id: "t",
                    traceparents: &[],
                },
            )
            .await
            .unwrap();
        assert_eq!(delivered, Settled::Delivered);
        let (rec, _) = ledger.get("k").await.unwrap().unwrap();
        assert_eq!((rec.state, rec.claim), (State::Delivered, None));
        assert!(matches!(
            b.settler
                .claim("k", 2, None, "replica-a", "instance-a")
                .await
                .unwrap(),
            Claimed::Changed(Verdict::Final(State::Delivered), _)
        ));
    }

    #[tokio::test]
    async fn the_sweep_leaves_a_claimed_attempt_alone() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        b.clock.advance(Duration::from_secs(600));
        let claimed = b
            .settler
            .claim("k", 2, None, "replica-a", "instance-a")
            .await
            .unwrap();
        assert!(matches!(claimed, Claimed::Mine(_)));
        let overdue_before = b.clock.now() - Duration::from_secs(300);
        assert!(!b.settler.recover("k", overdue_before).await.unwrap());
        assert_eq!(b.queue.accepted(), vec!["k-attempt-2"]);
    }

    #[tokio::test]
    async fn a_replay_from_event_hubs_settles_only_the_record_of_its_own_event() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        let b = &b;
        let delivered = |e: Event| async move {
            b.settler
                .settle(&Report {
                    event: &e,
                    attempt: 1,
                    source: Source::EventHubs,
                    started: b.clock.now(),
                    outcome: &Outcome::Delivered,
                    trace_id: "t",
                    traceparents: &[],
                })
                .await
                .unwrap()
        };
        // Another event that carries the same key: the record's retry is still owed.
        let mut other = event("k");
        other.sequence_number += 1;
        assert_eq!(delivered(other).await, Settled::Delivered);
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        assert_eq!(rec.state, State::RetryScheduled);
        // The recorded event itself, replayed and delivered: the record says so.
        assert_eq!(delivered(event("k")).await, Settled::Delivered);
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        assert_eq!(
            (rec.state, rec.attempts, rec.next_attempt_ms),
            (State::Delivered, 1, None)
        );
    }

    #[tokio::test]
    async fn a_replay_after_later_attempts_is_recorded_as_a_replay_and_ends_the_retries() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        fail(&b, "k", 2, Source::Retry).await.unwrap();
        let settled = b
            .settler
            .settle(&Report {
                event: &event("k"),
                attempt: 1,
                source: Source::EventHubs,
                started: b.clock.now(),
                outcome: &Outcome::Delivered,
                trace_id: "t",
                traceparents: &[],
            })
            .await
            .unwrap();
        assert_eq!(settled, Settled::Delivered);
        let (rec, _) = b.settler.ledger.get("k").await.unwrap().unwrap();
        assert_eq!((rec.state, rec.attempts), (State::Delivered, 2));
        let last = rec.history.last().unwrap();
        assert_eq!(
            (last.attempt, last.outcome.as_str()),
            (1, DELIVERED_ON_REPLAY)
        );
        // The retry scheduled for attempt 3 finds the event final and runs nothing.
        assert_eq!(Verdict::of(Some(&rec), 3), Verdict::Final(State::Delivered));
    }

    #[tokio::test]
    async fn an_overdue_retry_is_recovered_once_under_a_fresh_message_id() {
        let b = bed();
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        b.clock.advance(Duration::from_secs(600));
        let overdue_before = b.clock.now() - Duration::from_secs(300);
        assert!(b.settler.recover("k", overdue_before).await.unwrap());
        assert!(
            !b.settler.recover("k", overdue_before).await.unwrap(),
            "due time moved to now"
        );
        let accepted = b.queue.accepted();
        assert_eq!(accepted.len(), 2);
        assert!(
            accepted[1].starts_with("k-attempt-2-recovered-"),
            "{accepted:?}"
        );
        let pending = b.settler.ledger.pending().await.unwrap();
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].due, b.clock.now().min(pending[0].due));
    }
    #[test]
    fn every_message_id_names_its_deployment_within_128_characters_for_any_key() {
        let d = Deployment::new("ns.servicebus.windows.net", "hub", "$Default");
        let readable = "k".repeat(super::super::message_id::READABLE_KEY_LIMIT);
        for key in [readable.as_str(), &"é".repeat(300), "~x", "a b"] {
            let retry = MessageId::retry(key, u32::MAX);
            for id in [
                retry.copy(RetryCopy::Rescued {
                    dead_letter_seq: i64::MAX,
                }),
                // Times in ms since the epoch: 13 digits until the year 2286.
                retry.copy(RetryCopy::Deferred {
                    until_ms: 9_999_999_999_999,
                }),
                retry.copy(RetryCopy::Recovered {
                    at_ms: 9_999_999_999_999,
                }),
                retry.copy(RetryCopy::Forwarded {
                    sequence_number: i64::MAX,
                }),
                retry.copy(RetryCopy::Pulled {
                    at_ms: 9_999_999_999_999,
                }),
                retry.copy(RetryCopy::Replayed {
                    at_ms: 9_999_999_999_999,
                }),
                MessageId::DeadLetter {
                    key,
                    attempts: u32::MAX,
                },
            ] {
                let q = id.qualified(Some(&d));
                assert!(q.chars().count() <= 128, "{q}");
                assert!(q.starts_with(&format!("{}.", d.id)), "{q}");
            }
        }
        assert_eq!(
            qualified(Some(&d), &message_id("order-42", 2)),
            format!("{}.order-42-attempt-2", d.id)
        );
        assert_ne!(
            d.id,
            Deployment::new("ns.servicebus.windows.net", "hub", "cg2").id,
            "another consumer group is another deployment"
        );
        assert_eq!(
            d.id,
            Deployment::new("NS.servicebus.windows.net", "HUB", "$default").id,
            "names compared without case, as Event Hubs compares them"
        );
    }

    #[test]
    fn a_retry_message_without_deployment_or_origin_still_reads() {
        let old: RetryMessage =
            serde_json::from_str(r#"{"v":2,"attempt":3,"due_ms":5,"key":"k","traceparents":[]}"#)
                .unwrap();
        assert_eq!((old.key(), old.attempt), ("k", 3));
        assert_eq!((old.deployment, old.origin), (None, None));
    }

    #[tokio::test]
    async fn a_retry_message_carries_its_deployment_and_where_its_event_sits() {
        let d = Deployment::new("ns", "hub", "$Default");
        let mut b = bed();
        b.settler = Settler::new(
            b.settler.ledger.clone(),
            b.queue.clone(),
            b.settler.policies.clone(),
        )
        .with_clock(b.clock.clone())
        .with_deployment(d.clone());
        fail(&b, "k", 1, Source::EventHubs).await.unwrap();
        assert_eq!(b.queue.accepted(), vec![format!("{}.k-attempt-2", d.id)]);
        let body: RetryMessage = serde_json::from_str(&b.queue.bodies()[0]).unwrap();
        assert_eq!(body.deployment, Some(d));
        let e = event("k");
        assert_eq!(
            body.origin,
            Some(Position {
                partition: e.partition_id,
                sequence_number: e.sequence_number,
                offset: e.offset,
            })
        );
    }
}
