//! The record: one idempotency key's state, attempts, history, claim and operator pull, and
//! the verdict a copy of a retry message reads from it.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::event::Event;
use crate::policy::{DeadLetterReason, RetryPolicy};

use super::{at, ms, IndexMark, HISTORY_LIMIT};

/// Where an event stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum State {
    /// A retry is scheduled on Service Bus for `next_attempt_at`.
    RetryScheduled,
    /// The handler succeeded.
    Delivered,
    /// Given up: see `dead_letter_reason`.
    DeadLettered,
}

/// What one attempt in a record's history came to. On the wire (the record's JSON) it is
/// the same lower-case string as always, so records of earlier and later versions read.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
// Reachable without the test bed only through `impl From<HistoryOutcome> for String`, which
// an embedder cannot call without naming it.
#[allow(unnameable_types)]
pub enum HistoryOutcome {
    /// `delivered`: the handler succeeded.
    Delivered,
    /// `delivered_on_replay`: a replay from Event Hubs (attempt 1 again) of an event whose
    /// record had counted later attempts was delivered.
    DeliveredOnReplay,
    /// `retry_scheduled`: failed; the next attempt is scheduled.
    RetryScheduled,
    /// `dead_lettered`: failed for good.
    DeadLettered,
    /// `cancelled`: an operator cancelled the waiting retry.
    Cancelled,
    /// `parked`: parked behind the head of its ordering key's line (ordered retries).
    Parked,
    /// An outcome this version does not know (written by a later one): kept as it was.
    Other(String),
}

impl HistoryOutcome {
    /// The outcome as the record's JSON spells it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Delivered => "delivered",
            Self::DeliveredOnReplay => "delivered_on_replay",
            Self::RetryScheduled => "retry_scheduled",
            Self::DeadLettered => "dead_lettered",
            Self::Cancelled => "cancelled",
            Self::Parked => crate::telemetry::names::outcome::PARKED,
            Self::Other(s) => s,
        }
    }
}

impl From<String> for HistoryOutcome {
    fn from(s: String) -> Self {
        match s.as_str() {
            "delivered" => Self::Delivered,
            "delivered_on_replay" => Self::DeliveredOnReplay,
            "retry_scheduled" => Self::RetryScheduled,
            "dead_lettered" => Self::DeadLettered,
            "cancelled" => Self::Cancelled,
            crate::telemetry::names::outcome::PARKED => Self::Parked,
            _ => Self::Other(s),
        }
    }
}

impl From<HistoryOutcome> for String {
    fn from(o: HistoryOutcome) -> Self {
        match o {
            HistoryOutcome::Other(s) => s,
            known => known.as_str().to_string(),
        }
    }
}

impl std::fmt::Display for HistoryOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl PartialEq<&str> for HistoryOutcome {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// One attempt in the history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptEntry {
    /// Attempt number (1 = the first delivery from Event Hubs).
    pub attempt: u32,
    /// When it started (ms since the epoch).
    pub started_ms: i64,
    /// When it ended.
    pub finished_ms: i64,
    /// What the attempt came to.
    pub outcome: HistoryOutcome,
    /// The error, for a failed attempt.
    pub error: Option<String>,
    /// When the next attempt is due, when one was scheduled.
    pub next_attempt_ms: Option<i64>,
    /// W3C trace id of the attempt.
    pub trace_id: Option<String>,
    /// The downstream's `Retry-After` (seconds) when it was longer than the policy allows and
    /// the retry was scheduled at the policy's limit instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_capped_from_s: Option<u64>,
}

/// The ledger record of one event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerRecord {
    /// The idempotency key.
    pub key: String,
    /// The correlation id (stable across attempts).
    pub correlation_id: String,
    /// The event type.
    pub event_type: Option<String>,
    /// Where it stands. This and the two fields below change only through the record's
    /// transitions ([`schedule_retry`](Self::schedule_retry), [`deliver`](Self::deliver),
    /// [`dead_letter`](Self::dead_letter)), which keep them in step; read them with the
    /// accessors of the same names.
    pub(super) state: State,
    /// Attempts finished so far.
    pub attempts: u32,
    /// When the next attempt is due (ms since the epoch).
    pub(super) next_attempt_ms: Option<i64>,
    /// The first failure (ms since the epoch): the age budget counts from here.
    pub first_failure_ms: i64,
    /// Last update.
    pub updated_ms: i64,
    /// The last error.
    pub last_error: Option<String>,
    /// Why it was dead-lettered.
    pub(super) dead_letter_reason: Option<DeadLetterReason>,
    /// The wait before the scheduled attempt (decorrelated jitter needs it).
    pub last_delay_ms: Option<u64>,
    /// The policy pinned at the first failure.
    pub policy: RetryPolicy,
    /// Attempts that count against the policy start after this one (raised by a replay).
    #[serde(default)]
    pub attempt_base: u32,
    /// Bounded history of attempts, oldest first.
    pub history: Vec<AttemptEntry>,
    /// The event.
    pub event: Event,
    /// Where the bytes of a record that could not be parsed were set aside
    /// ([`Ledger::quarantine`]); with `event_unknown`, the event itself is only there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantined: Option<String>,
    /// The event could not be recovered (its record was corrupt and the retry message only
    /// carries its key): `event` is a stand-in with an empty body, and a replay is refused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub event_unknown: bool,
    /// The attempt a retry loop is running now ([`Claim`]): written with compare-and-swap
    /// before the handler is called, cleared by the attempt's settlement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,
    /// An operator's `retries retry-now` (or a replay) for the attempt waiting: only the
    /// copy of that attempt sent for it runs; earlier copies stand down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_now: Option<RunNow>,
    /// What this record's entry in the pending index was last written with (see
    /// [`Ledger::pending`]); `None` when the writer left none, or did not know of one.
    /// [`Ledger::put`] keeps it: callers copy it along with the record they read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexed: Option<IndexMark>,
}

/// A retry loop's claim on one attempt of an event: whoever holds a live claim runs the
/// attempt, every other copy of its retry message stands down. Written with ETag `If-Match`
/// over the record read at the due time, so of two copies that read the same record only
/// one claims it ("Managing concurrency in Blob storage", learn.microsoft.com: a write with
/// `If-Match` fails with 412 once the blob changed).
///
/// The rule for a claim left behind (its process died between the claim and the
/// settlement): it holds until `until_ms`; a copy that finds a live claim of another
/// instance waits under its message lock until then and reads the record again — by then
/// the attempt is recorded (the copy only re-sends the recorded next attempt) or the claim
/// has expired (the copy takes it over). A claim of this very instance whose copy is no
/// longer in hand is dead at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The attempt claimed.
    pub attempt: u32,
    /// The replica's owner id (for operators).
    pub owner: String,
    /// The claiming process: a nonce drawn when its pipeline was built.
    pub instance: String,
    /// Until when the claim holds (ms since the epoch).
    pub until_ms: i64,
}

impl Claim {
    /// Whether the claim still holds at `now`.
    pub fn live(&self, now: SystemTime) -> bool {
        ms(now) < self.until_ms
    }
}

/// An operator pulled attempt `attempt` forward (`hubguard retries retry-now`, or a replay):
/// a copy of it was scheduled for `at_ms` carrying `at_ms` as its mark, and it is the only
/// copy of that attempt the retry loop runs. The copy scheduled before (its due time was
/// `previous_due_ms`) stands down when it arrives, so the attempt runs once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunNow {
    /// The attempt pulled forward.
    pub attempt: u32,
    /// When (ms since the epoch): the mark the accepted copy carries.
    pub at_ms: i64,
    /// Who asked for it (`--by`, else the user name).
    pub by: String,
    /// When the attempt was due before.
    pub previous_due_ms: Option<i64>,
}

impl LedgerRecord {
    /// Whether a retry message of attempt `attempt` carrying `mark` (its `run_now`) must
    /// stand down: an operator pulled that attempt forward and this is not the copy sent for
    /// it. Any other attempt, or a record with no pull, runs as the verdict says.
    pub fn superseded_copy(&self, attempt: u32, mark: Option<i64>) -> bool {
        self.run_now
            .as_ref()
            .is_some_and(|p| p.attempt == attempt && mark != Some(p.at_ms))
    }

    /// The mark a new copy of attempt `attempt` carries (see [`RunNow`]).
    pub fn run_now_mark(&self, attempt: u32) -> Option<i64> {
        self.run_now
            .as_ref()
            .filter(|p| p.attempt == attempt)
            .map(|p| p.at_ms)
    }
}

// Where a record stands is three fields, `state`, `next_attempt_ms` and
// `dead_letter_reason` (the record's JSON in blob storage keeps them apart, so records of
// earlier and later versions read alike); every change of state goes through one of the
// three transitions below, which keep them in step: a scheduled retry has a due time and no
// reason, a final record neither a due time nor (delivered) a reason.
impl LedgerRecord {
    /// Where it stands.
    pub fn state(&self) -> State {
        self.state
    }

    /// When the next attempt is due (ms since the epoch; `None` when none is).
    pub fn next_attempt_ms(&self) -> Option<i64> {
        self.next_attempt_ms
    }

    /// Why it was dead-lettered (`None` unless it was).
    pub fn dead_letter_reason(&self) -> Option<DeadLetterReason> {
        self.dead_letter_reason.clone()
    }

    /// A test's door to a record in any state, in step or not (a record written by hand, an
    /// older version's): sets the three fields as given, bypassing the transitions.
    #[cfg(any(test, feature = "testbed"))]
    pub fn force_state(
        &mut self,
        state: State,
        next_attempt_ms: Option<i64>,
        dead_letter_reason: Option<DeadLetterReason>,
    ) {
        self.state = state;
        self.next_attempt_ms = next_attempt_ms;
        self.dead_letter_reason = dead_letter_reason;
    }

    /// The record an event's first failure starts from: nothing counted yet, no attempt
    /// due, `policy` pinned, the age budget counting from `now`.
    pub fn first_failure(event: &Event, policy: RetryPolicy, now: SystemTime) -> Self {
        LedgerRecord {
            key: event.identity.idempotency_key.clone(),
            correlation_id: event.identity.correlation_id.clone(),
            event_type: event.identity.event_type.clone(),
            state: State::RetryScheduled,
            attempts: 0,
            next_attempt_ms: None,
            first_failure_ms: ms(now),
            updated_ms: ms(now),
            last_error: None,
            dead_letter_reason: None,
            last_delay_ms: None,
            policy,
            attempt_base: 0,
            history: Vec::new(),
            event: event.clone(),
            quarantined: None,
            event_unknown: false,
            claim: None,
            run_now: None,
            indexed: None,
        }
    }

    /// A retry is scheduled, due at `due_ms` (ms since the epoch): a failure's next attempt,
    /// an operator's `retry-now`, a replay, or a due time moved by a claim or the overdue
    /// sweep. The wait before it (`last_delay_ms`) is the caller's to set when it draws one.
    pub fn schedule_retry(&mut self, due_ms: i64) {
        self.state = State::RetryScheduled;
        self.next_attempt_ms = Some(due_ms);
        self.dead_letter_reason = None;
    }

    /// Delivered: nothing more is due.
    pub fn deliver(&mut self) {
        self.state = State::Delivered;
        self.next_attempt_ms = None;
        self.dead_letter_reason = None;
    }

    /// Dead-lettered for `reason`: nothing more is due.
    pub fn dead_letter(&mut self, reason: DeadLetterReason) {
        self.state = State::DeadLettered;
        self.next_attempt_ms = None;
        self.dead_letter_reason = Some(reason);
    }

    /// Appends to the history, keeping it bounded.
    pub fn push_history(&mut self, entry: AttemptEntry) {
        self.history.push(entry);
        if self.history.len() > HISTORY_LIMIT {
            let excess = self.history.len() - HISTORY_LIMIT;
            self.history.drain(..excess);
        }
    }

    /// When the next attempt is due.
    pub fn next_attempt_at(&self) -> Option<SystemTime> {
        self.next_attempt_ms.map(at)
    }
}

/// What the ledger says about running attempt `attempt` of an event: the one rule the
/// settlement, the retry loop, deferrals and the dead-letter sweep all follow. The ledger is
/// authoritative for the attempt number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No record: the event never failed (or its record was removed).
    Unrecorded,
    /// The event is delivered or dead-lettered: nothing more to do.
    Final(State),
    /// This attempt already ran and is recorded (a replay from Event Hubs, or a copy of a
    /// retry whose lock lapsed): only the recorded next attempt may be re-sent.
    Stale,
    /// This is the attempt the ledger waits for.
    Current,
}

impl Verdict {
    /// The verdict of `record` on attempt `attempt`.
    pub fn of(record: Option<&LedgerRecord>, attempt: u32) -> Self {
        match record {
            None => Self::Unrecorded,
            Some(r) if r.state != State::RetryScheduled => Self::Final(r.state),
            Some(r) if r.attempts >= attempt => Self::Stale,
            Some(_) => Self::Current,
        }
    }
}
