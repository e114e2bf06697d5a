//! The attempt ledger: one record per idempotency key in blob storage, written with
//! compare-and-swap, authoritative for the attempt number (attempt counts survive restarts
//! and redeliveries). It holds the state, the attempt count, the next attempt time, the last
//! error, a bounded history, the policy pinned at the first failure, and the event itself (so
//! a dead letter can be replayed, and a retry message need only carry the key). The happy
//! path never touches it.

use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::azure::{RecordStore, StoreError};
use crate::event::Event;
use crate::policy::{DeadLetterReason, RetryPolicy};

/// Longest blob name Azure Storage accepts.
pub const BLOB_NAME_LIMIT: usize = 1024;

/// History entries kept per record (older ones are dropped, the count stays right).
pub const HISTORY_LIMIT: usize = 50;

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
#[cfg_attr(not(feature = "testbed"), allow(unnameable_types))]
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
    /// Where it stands.
    pub state: State,
    /// Attempts finished so far.
    pub attempts: u32,
    /// When the next attempt is due (ms since the epoch).
    pub next_attempt_ms: Option<i64>,
    /// The first failure (ms since the epoch): the age budget counts from here.
    pub first_failure_ms: i64,
    /// Last update.
    pub updated_ms: i64,
    /// The last error.
    pub last_error: Option<String>,
    /// Why it was dead-lettered.
    pub dead_letter_reason: Option<DeadLetterReason>,
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

/// The due time and attempt a pending-index entry was written with: a writer that finds
/// them unchanged (a claim, a renewal) writes no entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexMark {
    /// The attempt that waits.
    pub attempt: u32,
    /// When it is due (ms since the epoch).
    pub due_ms: i64,
}

impl IndexMark {
    /// The entry `record` needs: `Some` while a retry waits.
    pub fn of(record: &LedgerRecord) -> Option<Self> {
        match (record.state, record.next_attempt_ms) {
            (State::RetryScheduled, Some(due_ms)) => Some(Self {
                attempt: record.attempts + 1,
                due_ms,
            }),
            // A waiting record always has a due time; one without is listed as due at once.
            (State::RetryScheduled, None) => Some(Self {
                attempt: record.attempts + 1,
                due_ms: 0,
            }),
            _ => None,
        }
    }
}

/// The body of a pending-index entry: the key (a digest name does not carry it) and the
/// attempt it points at (so a settlement removes only an entry for an attempt that ran).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct IndexEntry {
    key: String,
    attempt: u32,
}

/// What [`Ledger::expire`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expired {
    /// Delivered records deleted.
    pub deleted: u64,
    /// Delivered records past retention kept because their event is not settled on its
    /// partition yet (or the record does not say where its event is).
    pub kept_unsettled: u64,
}

/// What [`Ledger::repair_pending`] found for a listed entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// The entry says what the record says.
    Accurate,
    /// The record no longer waits (or is gone): the entry was removed.
    Removed,
    /// The record waits for another attempt or time: the entry was written anew.
    Rewritten,
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

pub use crate::clock::{at, ms};

pub mod lines;
pub use lines::{Line, Opened, Parked};
#[cfg(any(test, feature = "testbed"))]
pub use lines::ParkedEntry;

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

/// A retry waiting on Service Bus, as [`Ledger::pending`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pending {
    /// The idempotency key.
    pub key: String,
    /// The attempt that is waiting.
    pub attempt: u32,
    /// When it is due.
    #[serde(with = "crate::ledger::rfc3339")]
    pub due: SystemTime,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// The Event Hubs partition the event came from; `None` when the listing does not say
    /// (a record written before the tag existed): it may be any partition's.
    #[serde(skip)]
    pub partition: Option<String>,
    /// The event's sequence number in that partition, when the listing says.
    #[serde(skip)]
    pub sequence_number: Option<i64>,
}

/// Tag names beside a ledger record (blob metadata names: C# identifiers).
const TAG_STATE: &str = "hubguard_state";
const TAG_DUE: &str = "hubguard_due_ms";
const TAG_NEXT: &str = "hubguard_next_attempt";
const TAG_KEY: &str = "hubguard_key";
const TAG_ERROR: &str = "hubguard_last_error";
const TAG_PARTITION: &str = "hubguard_partition";
const TAG_SEQUENCE: &str = "hubguard_sequence_number";
const STATE_RETRY_SCHEDULED: &str = "RETRY_SCHEDULED";
/// The blob index tag every ledger record carries when `ledger.lifecycle_tags` is on (sent
/// with the record's own Put Blob, `x-ms-tags`: no extra call): the record's state, for a
/// lifecycle management policy that deletes only DELIVERED records (`deploy/azure/
/// lifecycle-policy.json`). Index tag names and values allow a-z A-Z 0-9 space `+ - . / : =
/// _` ("Manage and find Azure Blob data with blob index tags", learn.microsoft.com/azure/
/// storage/blobs/storage-manage-find-blobs).
pub const STATE_INDEX_TAG: &str = "hubguard-state";

/// The value of [`STATE_INDEX_TAG`] for a record in `state`.
pub fn state_index_value(state: State) -> &'static str {
    match state {
        State::RetryScheduled => "retry-scheduled",
        State::Delivered => "delivered",
        State::DeadLettered => "dead-lettered",
    }
}

/// Longest key, and longest error, copied into a tag (all tags stay far under 8 KB).
const TAG_TEXT_LIMIT: usize = 512;

/// What a listing needs to answer "what is waiting?" without reading the record. Values are
/// header values: printable ASCII only (other characters become `?`).
fn tags_of(record: &LedgerRecord) -> crate::azure::record_store::Tags {
    let ascii = |s: &str| -> String {
        s.chars()
            .take(TAG_TEXT_LIMIT)
            .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
            .collect()
    };
    let mut tags = crate::azure::record_store::Tags::new();
    let state = match record.state {
        State::RetryScheduled => STATE_RETRY_SCHEDULED,
        State::Delivered => "DELIVERED",
        State::DeadLettered => "DEAD_LETTERED",
    };
    tags.insert(TAG_STATE.into(), state.into());
    if let Some(due) = record.next_attempt_ms {
        tags.insert(TAG_DUE.into(), due.to_string());
        tags.insert(TAG_NEXT.into(), (record.attempts + 1).to_string());
    }
    // Only a key the tag carries exactly (printable ASCII, short): others are read.
    if record.key.len() <= TAG_TEXT_LIMIT
        && record.key.trim() == record.key
        && record.key.chars().all(|c| (' '..='~').contains(&c))
    {
        tags.insert(TAG_KEY.into(), record.key.clone());
    }
    if let Some(e) = &record.last_error {
        tags.insert(TAG_ERROR.into(), ascii(e));
    }
    // Which partition's event it is, so a partition can list the records of its own events
    // (an Event Hubs partition id is a short decimal string).
    if !record.event.partition_id.is_empty()
        && ascii(&record.event.partition_id) == record.event.partition_id
    {
        tags.insert(TAG_PARTITION.into(), record.event.partition_id.clone());
        tags.insert(
            TAG_SEQUENCE.into(),
            record.event.sequence_number.to_string(),
        );
    }
    tags
}

/// `record` with its errors passed through the one redaction rule ([`crate::redact`]), or
/// `None` when they hold nothing to mask.
fn redacted_errors(record: &LedgerRecord) -> Option<LedgerRecord> {
    let masks = |e: &Option<String>| {
        e.as_deref()
            .is_some_and(|e| matches!(crate::redact::redact(e), std::borrow::Cow::Owned(_)))
    };
    if !masks(&record.last_error) && !record.history.iter().any(|h| masks(&h.error)) {
        return None;
    }
    let mut r = record.clone();
    let mask = |e: &mut Option<String>| {
        if let Some(t) = e {
            *t = crate::redact::redacted(t);
        }
    };
    mask(&mut r.last_error);
    r.history.iter_mut().for_each(|h| mask(&mut h.error));
    Some(r)
}

/// RFC 3339 (UTC, milliseconds) for serde.
pub(crate) mod rfc3339 {
    use std::time::SystemTime;

    /// Serialises `t` as RFC 3339.
    pub(crate) fn serialize<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::clock::rfc3339(*t))
    }
}

impl LedgerRecord {
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

/// The ledger of one (hub, consumer group).
#[derive(Clone)]
pub struct Ledger {
    store: Arc<dyn RecordStore>,
    prefix: String,
    /// Set once the pending index is known to cover every waiting record (see
    /// [`Ledger::pending`]).
    indexed: Arc<tokio::sync::OnceCell<()>>,
    /// How long DELIVERED records are kept (`ledger.retention_days`), when the owner says:
    /// `Some(None)` for ever, `None` not known here.
    retention: Option<Option<std::time::Duration>>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// A failed ledger operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// Storage failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A record could not be decoded.
    #[error("ledger record for {key} is corrupt: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// The decoding error.
        reason: String,
    },
    /// The record kept changing under an [`update`](Ledger::update).
    #[error("ledger record for {key} is contended")]
    Contended {
        /// The key.
        key: String,
    },
}

/// Compare-and-swap rounds of an [`update`](Ledger::update) before it gives up.
const CAS_ROUNDS: usize = 16;

/// What an [`update`](Ledger::update) does with the record it was shown.
#[derive(Debug)]
pub enum Change<T> {
    /// Write this record (create it if there was none), then return the value.
    Write(Box<LedgerRecord>, T),
    /// Write nothing; return the value.
    Keep(T),
}

fn encode_key(key: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key.as_bytes())
}

fn decode_key(encoded: &str) -> Option<String> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
}

impl Ledger {
    /// The ledger of `hub`/`consumer_group` in `store`.
    pub fn new(store: Arc<dyn RecordStore>, hub: &str, consumer_group: &str) -> Self {
        Self {
            store,
            prefix: format!("{hub}/{}/", consumer_group.to_ascii_lowercase()),
            indexed: Arc::default(),
            retention: None,
        }
    }

    /// This ledger, knowing that DELIVERED records are deleted `keep` after their last write
    /// (`None`: kept for ever), so [`no_record`](Self::no_record) can say so.
    pub fn with_retention(mut self, keep: Option<std::time::Duration>) -> Self {
        self.retention = Some(keep);
        self
    }

    /// What to say of `key` when the ledger has no record of it (the status API): state
    /// `UNKNOWN`, why that can be, and — when the retention is known — how long delivered
    /// records are kept (`delivered_records_kept_days`, `null` for ever) and since when a
    /// delivered record would still be there (`records_kept_since`).
    pub fn no_record(&self, key: &str, now: SystemTime) -> serde_json::Value {
        let (kept, since, why) = match self.retention {
            Some(Some(keep)) => {
                let since = now.checked_sub(keep).map(crate::clock::rfc3339);
                let days = keep.as_secs() / 86_400;
                let why = format!("delivered on a retry before {} (delivered records are kept {days} days after delivery, ledger.retention_days, and then deleted)", since.as_deref().unwrap_or("the epoch"));
                (serde_json::json!(days), serde_json::json!(since), why)
            }
            Some(None) => (
                serde_json::Value::Null,
                serde_json::Value::Null,
                "(delivered records are kept for ever here: ledger.retention_days = 0)".into(),
            ),
            None => (
                serde_json::Value::Null,
                serde_json::Value::Null,
                "delivered on a retry longer ago than ledger.retention_days".into(),
            ),
        };
        let detail = if self.retention == Some(None) {
            format!("the ledger has no record of this key. hubguard writes one at an event's first failure and never for a delivery on the first attempt, so this means either that: delivered on its first attempt, or never seen by hubguard (not read yet, another key, or a record removed by hand) {why}; it cannot tell which")
        } else {
            format!("the ledger has no record of this key. hubguard writes one at an event's first failure and never for a delivery on the first attempt, so this means either that: delivered on its first attempt, {why}, or never seen by hubguard (not read yet, another key, or a record removed by hand); it cannot tell which")
        };
        serde_json::json!({
            "key": key,
            "state": "UNKNOWN",
            "detail": detail,
            "delivered_records_kept_days": kept,
            "records_kept_since": since,
        })
    }

    /// The operator's control record of this ledger's deployment (pauses, rewinds), beside
    /// the ledger: `control/{hub}/{consumer group}/pause`.
    pub fn control_record_name(&self) -> String {
        format!("control/{}pause", self.prefix)
    }

    /// The store the records live in (the container the replicas share).
    pub fn store(&self) -> &Arc<dyn RecordStore> {
        &self.store
    }

    /// The blob name of `key`'s entry in the pending index.
    pub fn entry_name(&self, key: &str) -> String {
        self.blob_name("pending", key)
    }

    /// The marker saying the pending index covers every waiting record: written once the
    /// first start of a version with the index has indexed the records written before it.
    pub fn index_marker(&self) -> String {
        format!("indexes/{}pending-v1", self.prefix)
    }

    /// The blob name of `key`'s record.
    pub fn record_name(&self, key: &str) -> String {
        self.blob_name("ledger", key)
    }

    /// The blob name of `key`'s entry in the dead-letter index.
    pub fn dead_letter_name(&self, key: &str) -> String {
        self.blob_name("deadletters", key)
    }

    /// `{area}/{hub}/{consumer group}/{base64url of key}`, or with the key's
    /// [`key_digest`](crate::event::key_digest) in place of the base64 when that would make
    /// the name longer than Azure allows (1,024 characters: "Naming and referencing
    /// containers, blobs, and metadata", learn.microsoft.com). Names that fit keep the form
    /// they always had, so records written before stay where they are.
    fn blob_name(&self, area: &str, key: &str) -> String {
        let readable = format!("{area}/{}{}", self.prefix, encode_key(key));
        if readable.len() <= BLOB_NAME_LIMIT {
            readable
        } else {
            format!("{area}/{}{}", self.prefix, crate::event::key_digest(key))
        }
    }

    /// The keys behind listed names: decoded from the name, or — for a digest name — read
    /// from the blob itself with `key_of`.
    #[cfg(any(test, feature = "testbed"))]
    async fn listed_keys(
        &self,
        prefix: &str,
        key_of: impl Fn(&[u8]) -> Option<String>,
    ) -> Result<Vec<String>, LedgerError> {
        let listed = self.store.list(prefix).await?;
        let mut keys = Vec::with_capacity(listed.len());
        for l in listed {
            let Some(encoded) = l.key.strip_prefix(prefix) else {
                continue;
            };
            if encoded.starts_with('~') {
                if let Some(r) = self.store.read(&l.key).await? {
                    keys.extend(key_of(&r.body));
                }
            } else {
                keys.extend(decode_key(encoded));
            }
        }
        Ok(keys)
    }

    /// The record of `key` and its ETag.
    pub async fn get(&self, key: &str) -> Result<Option<(LedgerRecord, String)>, LedgerError> {
        let Some(r) = self.store.read(&self.record_name(key)).await? else {
            return Ok(None);
        };
        let record = serde_json::from_slice(&r.body).map_err(|e| LedgerError::Corrupt {
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        Ok(Some((record, r.etag)))
    }

    /// Re-validates `key`'s record read earlier with `etag`: `Ok(None)` when it is unchanged
    /// (blob storage answers 304 without the body), else the record as it is now (`Some(None)`
    /// when it no longer exists).
    #[allow(clippy::type_complexity)]
    #[cfg(any(test, feature = "testbed"))]
    pub async fn get_if_changed(
        &self,
        key: &str,
        etag: &str,
    ) -> Result<Option<Option<(LedgerRecord, String)>>, LedgerError> {
        let r = match self
            .store
            .read_if_changed(&self.record_name(key), etag)
            .await?
        {
            crate::azure::IfChanged::Unchanged => return Ok(None),
            crate::azure::IfChanged::Missing => return Ok(Some(None)),
            crate::azure::IfChanged::Changed(r) => r,
        };
        let record = serde_json::from_slice(&r.body).map_err(|e| LedgerError::Corrupt {
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        Ok(Some(Some((record, r.etag))))
    }

    /// Writes `record`: creates it when `etag` is `None`, else replaces it if unchanged.
    /// [`StoreError::Conflict`] means someone else wrote first: read and decide again.
    pub async fn put(
        &self,
        record: &LedgerRecord,
        etag: Option<&str>,
    ) -> Result<String, LedgerError> {
        // Errors quote what dependencies answered: no credential reaches the record, its
        // metadata, or anything that reads them (status, dead letters).
        let mut record = redacted_errors(record).unwrap_or_else(|| record.clone());
        // The pending index: an entry exists whenever the record waits (written before the
        // record turns RETRY_SCHEDULED), so listing the index alone finds every waiting
        // retry. A change of due time or attempt is written after the record, and the
        // entry of a settled record removed after it: a crash in between leaves an entry
        // that says too much or too early, which the sweep repairs ([`Self::repair_pending`]),
        // never a waiting record without one.
        let had = record.indexed;
        let want = IndexMark::of(&record);
        record.indexed = want;
        let record = &record;
        if want.is_some() && had.is_none() {
            self.write_entry(record).await?;
        }
        let body = Bytes::from(
            serde_json::to_vec(record).map_err(|e| LedgerError::Corrupt {
                key: record.key.clone(),
                reason: e.to_string(),
            })?,
        );
        let name = self.record_name(&record.key);
        let tags = tags_of(record);
        let span = tracing::info_span!(target: "hubguard::attempt", "ledger", otel.name = crate::telemetry::names::span::LEDGER_WRITE);
        let index = crate::azure::record_store::Tags::from([(
            STATE_INDEX_TAG.to_string(),
            state_index_value(record.state).to_string(),
        )]);
        let write = async {
            self.store
                .write_indexed(&name, body, etag, &tags, &index)
                .await
        };
        let written: String = tracing::Instrument::instrument(write, span).await?;
        match (had, want) {
            (Some(h), Some(w)) if h != w => {
                if let Err(e) = self.write_entry(record).await {
                    tracing::warn!(key = %record.key, error = %e, "the pending index entry still names the previous attempt; the overdue sweep repairs it");
                }
            }
            (Some(_), None) => {
                // A delivered record never waits again: its entry goes without a look. A
                // dead-lettered one may be replayed at once, and the replay writes an entry
                // for a later attempt first: only an entry for an attempt that ran goes.
                let removed = match record.state {
                    State::Delivered => self
                        .store
                        .remove(&self.entry_name(&record.key))
                        .await
                        .map_err(LedgerError::from),
                    _ => self.remove_entry(&record.key, record.attempts).await,
                };
                if let Err(e) = removed {
                    tracing::warn!(key = %record.key, error = %e, "the pending index entry of a settled record stays; the overdue sweep removes it");
                }
            }
            _ => {}
        }
        Ok(written)
    }

    /// Writes `record`'s entry in the pending index (its tags say what
    /// [`pending`](Self::pending) lists; its body names the key and the attempt).
    async fn write_entry(&self, record: &LedgerRecord) -> Result<(), LedgerError> {
        let mark = IndexMark::of(record).unwrap_or(IndexMark {
            attempt: record.attempts + 1,
            due_ms: 0,
        });
        let body = serde_json::to_vec(&IndexEntry {
            key: record.key.clone(),
            attempt: mark.attempt,
        })
        .map_err(|e| LedgerError::Corrupt {
            key: record.key.clone(),
            reason: e.to_string(),
        })?;
        let mut tags = tags_of(record);
        tags.insert(TAG_STATE.into(), STATE_RETRY_SCHEDULED.into());
        tags.insert(TAG_DUE.into(), mark.due_ms.to_string());
        tags.insert(TAG_NEXT.into(), mark.attempt.to_string());
        self.store
            .put_tagged(&self.entry_name(&record.key), Bytes::from(body), &tags)
            .await?;
        Ok(())
    }

    /// Removes `key`'s pending-index entry if it points at an attempt that already ran (at
    /// most `ran`): an entry a replay wrote since, for a later attempt, stays.
    async fn remove_entry(&self, key: &str, ran: u32) -> Result<(), LedgerError> {
        let name = self.entry_name(key);
        let Some(r) = self.store.read(&name).await? else {
            return Ok(());
        };
        let points_at = serde_json::from_slice::<IndexEntry>(&r.body)
            .map(|e| e.attempt)
            .unwrap_or(0);
        if points_at > ran {
            return Ok(());
        }
        match self.store.delete(&name, &r.etag).await {
            Ok(()) | Err(StoreError::NotFound) | Err(StoreError::Conflict) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Checks a listed pending-index entry against its record, which is authoritative: an
    /// entry left behind by a crash between a record's write and the entry's (a settled
    /// record's entry, a due time that moved) is removed or written anew. The overdue sweep
    /// calls it for entries past due that it did not recover, so a stale entry costs one
    /// read per sweep until repaired, and is never trusted.
    pub async fn repair_pending(&self, listed: &Pending) -> Result<Repair, LedgerError> {
        let record = match self.get(&listed.key).await {
            Ok(r) => r.map(|(r, _)| r),
            // A corrupt record is quarantined by whoever runs it next; leave its entry.
            Err(LedgerError::Corrupt { .. }) => return Ok(Repair::Accurate),
            Err(e) => return Err(e),
        };
        match record {
            Some(r) => match IndexMark::of(&r) {
                Some(mark) if mark.attempt == listed.attempt && at(mark.due_ms) == listed.due => {
                    Ok(Repair::Accurate)
                }
                Some(_) => {
                    self.write_entry(&r).await?;
                    Ok(Repair::Rewritten)
                }
                None => {
                    self.remove_entry(&listed.key, r.attempts.max(listed.attempt))
                        .await?;
                    Ok(Repair::Removed)
                }
            },
            None => {
                self.remove_entry(&listed.key, u32::MAX).await?;
                Ok(Repair::Removed)
            }
        }
    }

    /// Makes sure the pending index covers every waiting record: once per ledger (a marker
    /// blob says it was done), the records written before the index existed are listed
    /// once and each waiting one gets its entry. Later calls cost nothing.
    async fn ensure_indexed(&self) -> Result<(), LedgerError> {
        self.indexed
            .get_or_try_init(|| async {
                let marker = self.index_marker();
                if self.store.read(&marker).await?.is_some() {
                    return Ok(());
                }
                let prefix = format!("ledger/{}", self.prefix);
                let mut indexed = 0usize;
                for l in self.store.list(&prefix).await? {
                    // Tagged records say their state; untagged (older) ones are read.
                    if l
                        .tags
                        .get(TAG_STATE)
                        .is_some_and(|s| s != STATE_RETRY_SCHEDULED)
                    {
                        continue;
                    }
                    let Some(r) = self.store.read(&l.key).await? else {
                        continue;
                    };
                    match serde_json::from_slice::<LedgerRecord>(&r.body) {
                        Ok(rec) if rec.state == State::RetryScheduled => {
                            self.write_entry(&rec).await?;
                            indexed += 1;
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::warn!(blob = %l.key, error = %e, "a ledger record cannot be parsed; leaving it out of the pending index");
                        }
                    }
                }
                let body = format!("{{\"indexed\":{indexed}}}");
                match self.store.create(&marker, Bytes::from(body)).await {
                    Ok(_) | Err(StoreError::Conflict) => {}
                    Err(e) => return Err(LedgerError::from(e)),
                }
                tracing::info!(indexed, "the ledger's pending index now covers the records written before it");
                Ok(())
            })
            .await
            .map(|_| ())
    }

    /// Sets aside a record that cannot be parsed, so it never holds its event forever: its
    /// bytes are copied to `quarantine/{hub}/{consumer group}/{name}-{ms}` for an operator,
    /// and the record is replaced (if it is still the same bytes) by a DEAD_LETTERED one with
    /// reason [`DeadLetterReason::CorruptRecord`] — for `event` when the caller has it (read
    /// from Event Hubs), else for a stand-in marked `event_unknown`. Returns the quarantine
    /// blob's name; [`StoreError::Conflict`] means the record changed meanwhile: read again.
    pub async fn quarantine(
        &self,
        key: &str,
        event: Option<&Event>,
        reason: &str,
        now: SystemTime,
    ) -> Result<String, LedgerError> {
        let name = self.record_name(key);
        let Some(raw) = self.store.read(&name).await? else {
            return Err(LedgerError::Store(StoreError::Conflict));
        };
        if serde_json::from_slice::<LedgerRecord>(&raw.body).is_ok() {
            return Err(LedgerError::Store(StoreError::Conflict)); // repaired meanwhile
        }
        let aside = format!(
            "quarantine/{}{}-{}",
            self.prefix,
            name.rsplit('/').next().unwrap_or_default(),
            ms(now)
        );
        match self.store.create(&aside, raw.body.clone()).await {
            Ok(_) | Err(StoreError::Conflict) => {}
            Err(e) => return Err(e.into()),
        }
        let stand_in = || Event {
            body: Vec::new(),
            content_type: None,
            properties: Default::default(),
            hub: String::new(),
            partition_id: String::new(),
            sequence_number: -1,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: crate::event::Identity {
                idempotency_key: key.to_string(),
                correlation_id: key.to_string(),
                event_type: None,
            },
        };
        let error = format!(
            "the ledger record could not be parsed ({reason}); its bytes are kept in blob {aside}"
        );
        let record = LedgerRecord {
            key: key.to_string(),
            correlation_id: event
                .map_or_else(|| key.to_string(), |e| e.identity.correlation_id.clone()),
            event_type: event.and_then(|e| e.identity.event_type.clone()),
            state: State::DeadLettered,
            attempts: 0,
            next_attempt_ms: None,
            first_failure_ms: ms(now),
            updated_ms: ms(now),
            last_error: Some(error),
            dead_letter_reason: Some(DeadLetterReason::CorruptRecord),
            last_delay_ms: None,
            policy: RetryPolicy::seed_fibonacci(),
            attempt_base: 0,
            history: Vec::new(),
            event: event.cloned().unwrap_or_else(stand_in),
            quarantined: Some(aside.clone()),
            event_unknown: event.is_none(),
            claim: None,
            run_now: None,
            indexed: None,
        };
        self.index_dead_letter(key).await?;
        self.put(&record, Some(&raw.etag)).await?;
        tracing::error!(key = %key, quarantine = %aside, %reason, "a ledger record could not be parsed: set aside and its event dead-lettered");
        Ok(aside)
    }

    /// Reads `key`'s record, lets `decide` choose what to do with it, and writes the choice
    /// with compare-and-swap (`If-None-Match: *` when there was no record, `If-Match` with the
    /// ETag it was read with otherwise). When someone else wrote first, reads and decides again.
    pub async fn update<T>(
        &self,
        key: &str,
        decide: impl FnMut(Option<LedgerRecord>) -> Change<T>,
    ) -> Result<T, LedgerError> {
        self.update_from(key, None, decide).await
    }

    /// [`update`](Self::update), starting from a record the caller already read with its
    /// ETag (no read when nobody wrote since: the write's `If-Match` proves it; a conflict
    /// reads and decides again).
    pub async fn update_from<T>(
        &self,
        key: &str,
        mut read: Option<(LedgerRecord, String)>,
        mut decide: impl FnMut(Option<LedgerRecord>) -> Change<T>,
    ) -> Result<T, LedgerError> {
        for _ in 0..CAS_ROUNDS {
            let current = match read.take() {
                Some(known) => Some(known),
                None => self.get(key).await?,
            };
            let (record, etag) = match current {
                Some((r, e)) => (Some(r), Some(e)),
                None => (None, None),
            };
            match decide(record) {
                Change::Keep(value) => return Ok(value),
                Change::Write(record, value) => match self.put(&record, etag.as_deref()).await {
                    Ok(_) => return Ok(value),
                    Err(LedgerError::Store(StoreError::Conflict)) => continue,
                    Err(e) => return Err(e),
                },
            }
        }
        Err(LedgerError::Contended {
            key: key.to_string(),
        })
    }

    /// Marks `key` dead-lettered in the index (idempotent), before the record says so.
    pub async fn index_dead_letter(&self, key: &str) -> Result<(), LedgerError> {
        match self
            .store
            .create(
                &self.dead_letter_name(key),
                Bytes::from(key.as_bytes().to_vec()),
            )
            .await
        {
            Ok(_) | Err(StoreError::Conflict) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes `key` from the dead-letter index (after a replay).
    #[cfg(any(test, feature = "testbed"))]
    pub async fn unindex_dead_letter(&self, key: &str) -> Result<(), LedgerError> {
        let name = self.dead_letter_name(key);
        let Some(r) = self.store.read(&name).await? else {
            return Ok(());
        };
        match self.store.delete(&name, &r.etag).await {
            Ok(()) | Err(StoreError::NotFound) | Err(StoreError::Conflict) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes `key`'s dead-lettered record if it still has `etag`, then its index entry
    /// (its event lives on elsewhere: an ordered replay parked it). `false` when it changed
    /// meanwhile (nothing removed).
    #[cfg(any(test, feature = "testbed"))]
    pub async fn remove_dead_letter(&self, key: &str, etag: &str) -> Result<bool, LedgerError> {
        match self.store.delete(&self.record_name(key), etag).await {
            Ok(()) | Err(StoreError::NotFound) => {}
            Err(StoreError::Conflict) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        self.unindex_dead_letter(key).await?;
        Ok(true)
    }

    /// Purges `key`'s dead letter when it was last written before `before`: the record
    /// (with its ETag, so one replayed meanwhile stays), then its dead-letter index entry and
    /// its quarantined bytes. `Some(quarantine blob)` when it was (or, with `dry_run`, would
    /// be) purged; `None` when the record is no dead letter or is newer. An index entry
    /// whose record is gone is removed too.
    #[cfg(any(test, feature = "testbed"))]
    pub async fn purge_dead_letter(
        &self,
        key: &str,
        before: SystemTime,
        dry_run: bool,
    ) -> Result<Option<Option<String>>, LedgerError> {
        let (record, etag) = match self.get(key).await? {
            Some(found) => found,
            None => {
                if !dry_run {
                    self.unindex_dead_letter(key).await?;
                }
                return Ok(Some(None));
            }
        };
        if record.state != State::DeadLettered || at(record.updated_ms) >= before {
            return Ok(None);
        }
        if dry_run {
            return Ok(Some(record.quarantined));
        }
        match self.store.delete(&self.record_name(key), &etag).await {
            Ok(()) | Err(StoreError::NotFound) => {}
            Err(StoreError::Conflict) => return Ok(None), // changed meanwhile (a replay)
            Err(e) => return Err(e.into()),
        }
        self.unindex_dead_letter(key).await?;
        if let Some(aside) = &record.quarantined {
            self.store.remove(aside).await?;
        }
        Ok(Some(record.quarantined))
    }

    /// Keys in the dead-letter index.
    #[cfg(any(test, feature = "testbed"))]
    pub async fn dead_letter_keys(&self) -> Result<Vec<String>, LedgerError> {
        let prefix = format!("deadletters/{}", self.prefix);
        // An index entry's body is its key.
        self.listed_keys(&prefix, |body| String::from_utf8(body.to_vec()).ok())
            .await
    }

    /// Every retry the ledger says is waiting (state RETRY_SCHEDULED), soonest first, read
    /// from one listing of the pending index — `pending/{hub}/{consumer group}/`, one small
    /// blob per waiting record whose metadata holds the due time, the attempt, the last
    /// error, the partition and the sequence number — so neither settled records nor record
    /// bodies are read: the cost follows the retries waiting, not the ledger's history.
    ///
    /// Why a prefix rather than blob index tags (Find Blobs by Tags): List Blobs is strongly
    /// consistent (a listing shows every write acknowledged before it), which the
    /// happy path relies on (see `pipeline::recorded`), while the tag index "is
    /// eventually consistent" and may lag writes by minutes ("Manage and find Azure Blob
    /// data with blob index tags", learn.microsoft.com/azure/storage/blobs/
    /// storage-manage-find-blobs); tags are also not available on accounts with a
    /// hierarchical namespace, and are billed per tag per month.
    ///
    /// An entry may be stale after a crash (see [`put`](Self::put)): the sweep checks the
    /// entries it finds overdue against their records ([`repair_pending`](Self::repair_pending)).
    pub async fn pending(&self) -> Result<Vec<Pending>, LedgerError> {
        self.ensure_indexed().await?;
        let prefix = format!("pending/{}", self.prefix);
        let mut out = Vec::new();
        for l in self.store.list(&prefix).await? {
            let due = l.tags.get(TAG_DUE).and_then(|d| d.parse::<i64>().ok());
            let attempt = l.tags.get(TAG_NEXT).and_then(|n| n.parse::<u32>().ok());
            let key = match l.tags.get(TAG_KEY) {
                Some(k) => Some(k.clone()),
                // A key the tags cannot carry: the entry's body names it.
                None => match self.store.read(&l.key).await? {
                    Some(r) => serde_json::from_slice::<IndexEntry>(&r.body)
                        .ok()
                        .map(|e| e.key),
                    None => continue,
                },
            };
            let (Some(due), Some(attempt), Some(key)) = (due, attempt, key) else {
                tracing::warn!(blob = %l.key, "a pending index entry cannot be read; leaving it out");
                continue;
            };
            out.push(Pending {
                key,
                attempt,
                due: at(due),
                last_error: l.tags.get(TAG_ERROR).cloned(),
                partition: l.tags.get(TAG_PARTITION).cloned(),
                sequence_number: l.tags.get(TAG_SEQUENCE).and_then(|s| s.parse().ok()),
            });
        }
        out.sort_by(|a, b| a.due.cmp(&b.due).then_with(|| a.key.cmp(&b.key)));
        Ok(out)
    }

    /// Claims this ledger (`{hub}/{consumer group}` in the container) for `me`. Ledger blob
    /// names carry the hub and the consumer group, so deployments of other hubs or consumer
    /// groups sharing a container never meet; they do not carry the namespace, so two
    /// namespaces with the same hub and consumer group names would share records. The first
    /// deployment to start writes `deployments/{hub}/{consumer group}/claim` (`If-None-Match:
    /// *`); `Ok(Some(other))` when the claim names another namespace, and the caller refuses
    /// to start. A ledger written before claims existed is claimed by its first start: no
    /// record moves.
    pub async fn claim(
        &self,
        me: &crate::event::Deployment,
    ) -> Result<Option<crate::event::Deployment>, LedgerError> {
        let name = format!("deployments/{}claim", self.prefix);
        let body = serde_json::to_vec(me).map_err(|e| LedgerError::Corrupt {
            key: name.clone(),
            reason: e.to_string(),
        })?;
        match self.store.create(&name, Bytes::from(body)).await {
            Ok(_) => return Ok(None),
            Err(StoreError::Conflict) => {}
            Err(e) => return Err(e.into()),
        }
        let Some(r) = self.store.read(&name).await? else {
            return Ok(None);
        };
        let holder: crate::event::Deployment =
            serde_json::from_slice(&r.body).map_err(|e| LedgerError::Corrupt {
                key: name.clone(),
                reason: e.to_string(),
            })?;
        Ok((!holder.namespace.eq_ignore_ascii_case(&me.namespace)).then_some(holder))
    }

    /// Deletes the DELIVERED records last written before `before` whose event is settled on
    /// its partition (`settled(partition, sequence number)`: at or before the partition's
    /// checkpoint, so no replica reads it again and needs the record to know it was
    /// delivered). A record that waits (RETRY_SCHEDULED) or is dead-lettered is never
    /// deleted here — a dead letter stays until it is replayed or purged — nor one whose
    /// metadata does not name its state, partition and sequence number, nor one written
    /// since the listing (the delete carries the listed ETag, `If-Match`). Deletion is free
    /// on Azure ("Azure Blob Storage pricing", azure.microsoft.com/pricing/details/storage/
    /// blobs: "Delete operations are free"); one listing of the ledger, which retention
    /// itself bounds.
    pub async fn expire(
        &self,
        before: SystemTime,
        settled: &(dyn Fn(&str, i64) -> bool + Send + Sync),
    ) -> Result<Expired, LedgerError> {
        let prefix = format!("ledger/{}", self.prefix);
        let mut out = Expired::default();
        // Page by page (one List Blobs call of at most 5,000 each): a replica holds one page,
        // however many records retention keeps.
        let mut marker: Option<String> = None;
        loop {
            let (page, next) = self.store.list_page(&prefix, marker.as_deref()).await?;
            self.expire_page(page, before, settled, &mut out).await?;
            match next {
                Some(n) => marker = Some(n),
                None => break,
            }
        }
        Ok(out)
    }

    /// [`expire`](Self::expire) over one listed page.
    async fn expire_page(
        &self,
        page: Vec<crate::azure::record_store::Listed>,
        before: SystemTime,
        settled: &(dyn Fn(&str, i64) -> bool + Send + Sync),
        out: &mut Expired,
    ) -> Result<(), LedgerError> {
        for l in page {
            if l.tags.get(TAG_STATE).map(String::as_str) != Some("DELIVERED")
                || l.last_modified.is_none_or(|t| t >= before)
            {
                continue;
            }
            let position = l
                .tags
                .get(TAG_PARTITION)
                .zip(l.tags.get(TAG_SEQUENCE).and_then(|s| s.parse::<i64>().ok()));
            match position {
                Some((p, seq)) if settled(p, seq) => {}
                _ => {
                    out.kept_unsettled += 1;
                    continue;
                }
            }
            match self.store.delete(&l.key, &l.etag).await {
                Ok(()) => out.deleted += 1,
                Err(StoreError::NotFound) | Err(StoreError::Conflict) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Keys of every record (for tests and the demo's verification).
    #[cfg(any(test, feature = "testbed"))]
    pub async fn keys(&self) -> Result<Vec<String>, LedgerError> {
        let prefix = format!("ledger/{}", self.prefix);
        self.listed_keys(&prefix, |body| {
            serde_json::from_slice::<LedgerRecord>(body)
                .ok()
                .map(|r| r.key)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records as this version and the ones before it write them (waiting, dead-lettered,
    /// delivered on a replay): each reads, and writes back byte for byte.
    const RECORDS_ON_THE_WIRE: [&str; 3] = [
        r#"{"key":"k","correlation_id":"c","event_type":"order.created","state":"RETRY_SCHEDULED","attempts":2,"next_attempt_ms":1700000030000,"first_failure_ms":1700000000000,"updated_ms":1700000020000,"last_error":"503","dead_letter_reason":null,"last_delay_ms":10000,"policy":{"name":"fibonacci","curve":"fibonacci","base_s":10,"floor_s":10,"cap_s":604800,"max_attempts":29,"max_age_s":null},"attempt_base":0,"history":[{"attempt":1,"started_ms":1700000000000,"finished_ms":1700000000100,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000010000,"trace_id":"t1"},{"attempt":2,"started_ms":1700000010000,"finished_ms":1700000020000,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000030000,"trace_id":"t2","retry_after_capped_from_s":600}],"event":{"body":"eyJuIjoxfQ==","content_type":"application/json","properties":{},"hub":"h","partition_id":"0","sequence_number":7,"offset":"1024","enqueued_ms":1000,"partition_key":null,"identity":{"idempotency_key":"k","correlation_id":"c","event_type":"order.created"}},"indexed":{"attempt":3,"due_ms":1700000030000}}"#,
        r#"{"key":"k","correlation_id":"c","event_type":"order.created","state":"DEAD_LETTERED","attempts":2,"next_attempt_ms":null,"first_failure_ms":1700000000000,"updated_ms":1700000020000,"last_error":"503","dead_letter_reason":"attempts_exhausted","last_delay_ms":10000,"policy":{"name":"fibonacci","curve":"fibonacci","base_s":10,"floor_s":10,"cap_s":604800,"max_attempts":29,"max_age_s":null},"attempt_base":0,"history":[{"attempt":1,"started_ms":1700000000000,"finished_ms":1700000000100,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000010000,"trace_id":"t1"},{"attempt":2,"started_ms":1700000010000,"finished_ms":1700000020000,"outcome":"dead_lettered","error":"503","next_attempt_ms":null,"trace_id":"t2"}],"event":{"body":"eyJuIjoxfQ==","content_type":"application/json","properties":{},"hub":"h","partition_id":"0","sequence_number":7,"offset":"1024","enqueued_ms":1000,"partition_key":null,"identity":{"idempotency_key":"k","correlation_id":"c","event_type":"order.created"}}}"#,
        r#"{"key":"k","correlation_id":"c","event_type":"order.created","state":"DELIVERED","attempts":2,"next_attempt_ms":null,"first_failure_ms":1700000000000,"updated_ms":1700000020000,"last_error":"503","dead_letter_reason":null,"last_delay_ms":10000,"policy":{"name":"fibonacci","curve":"fibonacci","base_s":10,"floor_s":10,"cap_s":604800,"max_attempts":29,"max_age_s":null},"attempt_base":0,"history":[{"attempt":1,"started_ms":1700000000000,"finished_ms":1700000000100,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000010000,"trace_id":"t1"},{"attempt":2,"started_ms":1700000010000,"finished_ms":1700000020000,"outcome":"delivered_on_replay","error":null,"next_attempt_ms":null,"trace_id":"t2"}],"event":{"body":"eyJuIjoxfQ==","content_type":"application/json","properties":{},"hub":"h","partition_id":"0","sequence_number":7,"offset":"1024","enqueued_ms":1000,"partition_key":null,"identity":{"idempotency_key":"k","correlation_id":"c","event_type":"order.created"}}}"#,
    ];

    #[test]
    fn records_on_the_wire_read_and_write_back_byte_for_byte() {
        let outcomes = |rec: &LedgerRecord| -> Vec<HistoryOutcome> {
            rec.history.iter().map(|h| h.outcome.clone()).collect()
        };
        let read: Vec<LedgerRecord> = RECORDS_ON_THE_WIRE
            .iter()
            .map(|json| serde_json::from_str(json).unwrap())
            .collect();
        for (rec, json) in read.iter().zip(RECORDS_ON_THE_WIRE) {
            assert_eq!(serde_json::to_string(rec).unwrap(), json);
        }
        use HistoryOutcome::*;
        assert_eq!(
            (read[0].state, read[0].next_attempt_ms, outcomes(&read[0])),
            (
                State::RetryScheduled,
                Some(1_700_000_030_000),
                vec![RetryScheduled, RetryScheduled]
            )
        );
        assert_eq!(
            (
                read[1].state,
                &read[1].dead_letter_reason,
                outcomes(&read[1])
            ),
            (
                State::DeadLettered,
                &Some(DeadLetterReason::AttemptsExhausted),
                vec![RetryScheduled, DeadLettered]
            )
        );
        assert_eq!(
            (read[2].state, outcomes(&read[2])),
            (State::Delivered, vec![RetryScheduled, DeliveredOnReplay])
        );
    }

    #[test]
    fn history_outcomes_keep_their_strings_and_an_unknown_one_survives() {
        for (outcome, text) in [
            (HistoryOutcome::Delivered, "delivered"),
            (HistoryOutcome::DeliveredOnReplay, "delivered_on_replay"),
            (HistoryOutcome::RetryScheduled, "retry_scheduled"),
            (HistoryOutcome::DeadLettered, "dead_lettered"),
            (HistoryOutcome::Cancelled, "cancelled"),
            (HistoryOutcome::Parked, "parked"),
            (HistoryOutcome::Other("rerouted".into()), "rerouted"),
        ] {
            let json = format!("\"{text}\"");
            assert_eq!(serde_json::to_string(&outcome).unwrap(), json);
            assert_eq!(
                serde_json::from_str::<HistoryOutcome>(&json).unwrap(),
                outcome
            );
            assert_eq!(outcome, text);
            assert_eq!(format!("{outcome:<10}|"), format!("{text:<10}|"));
        }
    }

    #[test]
    fn the_verdict_follows_the_record() {
        let event = crate::event::Event {
            body: Vec::new(),
            content_type: None,
            properties: Default::default(),
            hub: "h".into(),
            partition_id: "0".into(),
            sequence_number: 1,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: crate::event::Identity {
                idempotency_key: "k".into(),
                correlation_id: "k".into(),
                event_type: None,
            },
        };
        let mut rec = LedgerRecord {
            key: "k".into(),
            correlation_id: "k".into(),
            event_type: None,
            state: State::RetryScheduled,
            attempts: 2,
            next_attempt_ms: Some(0),
            first_failure_ms: 0,
            updated_ms: 0,
            last_error: None,
            dead_letter_reason: None,
            last_delay_ms: None,
            policy: RetryPolicy::seed_fibonacci(),
            attempt_base: 0,
            history: Vec::new(),
            event,
            quarantined: None,
            event_unknown: false,
            claim: None,
            run_now: None,
            indexed: None,
        };
        assert_eq!(Verdict::of(None, 1), Verdict::Unrecorded);
        assert_eq!(Verdict::of(Some(&rec), 1), Verdict::Stale);
        assert_eq!(Verdict::of(Some(&rec), 2), Verdict::Stale);
        assert_eq!(Verdict::of(Some(&rec), 3), Verdict::Current);
        rec.state = State::Delivered;
        assert_eq!(Verdict::of(Some(&rec), 3), Verdict::Final(State::Delivered));
    }

    #[test]
    fn blob_names_stay_within_azures_limit_for_any_key() {
        struct Nothing;
        #[async_trait::async_trait]
        impl RecordStore for Nothing {
            async fn read(&self, _: &str) -> Result<Option<crate::azure::Record>, StoreError> {
                Ok(None)
            }
            async fn create(&self, _: &str, _: Bytes) -> Result<String, StoreError> {
                Ok(String::new())
            }
            async fn update(&self, _: &str, _: Bytes, _: &str) -> Result<String, StoreError> {
                Ok(String::new())
            }
            async fn delete(&self, _: &str, _: &str) -> Result<(), StoreError> {
                Ok(())
            }
            async fn list(
                &self,
                _: &str,
            ) -> Result<Vec<crate::azure::record_store::Listed>, StoreError> {
                Ok(Vec::new())
            }
        }
        let ledger = Ledger::new(Arc::new(Nothing), "hub", "$Default");
        // A short key keeps its readable (base64) name.
        assert_eq!(
            ledger.record_name("a/b"),
            format!("ledger/hub/$default/{}", encode_key("a/b"))
        );
        for len in [300, 760, 800, 5_000, 1_000_000] {
            let key = "k".repeat(len);
            let name = ledger.record_name(&key);
            assert!(name.len() <= BLOB_NAME_LIMIT, "{len}: {}", name.len());
            assert_eq!(name, ledger.record_name(&key), "stable");
            assert_ne!(name, ledger.record_name(&format!("{key}x")), "distinct");
        }
        assert!(ledger.dead_letter_name(&"é".repeat(2_000)).len() <= BLOB_NAME_LIMIT);
    }

    fn waiting(key: &str, attempts: u32, due_ms: i64) -> LedgerRecord {
        LedgerRecord {
            key: key.into(),
            correlation_id: key.into(),
            event_type: None,
            state: State::RetryScheduled,
            attempts,
            next_attempt_ms: Some(due_ms),
            first_failure_ms: 0,
            updated_ms: 0,
            last_error: Some("boom".into()),
            dead_letter_reason: None,
            last_delay_ms: None,
            policy: RetryPolicy::seed_fibonacci(),
            attempt_base: 0,
            history: Vec::new(),
            event: Event {
                body: Vec::new(),
                content_type: None,
                properties: Default::default(),
                hub: "hub".into(),
                partition_id: "3".into(),
                sequence_number: 9,
                offset: None,
                enqueued_ms: None,
                partition_key: None,
                identity: crate::event::Identity {
                    idempotency_key: key.into(),
                    correlation_id: key.into(),
                    event_type: None,
                },
            },
            quarantined: None,
            event_unknown: false,
            claim: None,
            indexed: None,
            run_now: None,
        }
    }

    fn memory() -> (Arc<crate::azure::memory::MemoryRecordStore>, Ledger) {
        let store = Arc::new(crate::azure::memory::MemoryRecordStore::new());
        let ledger = Ledger::new(store.clone(), "hub", "$Default");
        (store, ledger)
    }

    /// The record written as a crash would leave it: without the ledger's index step.
    async fn write_raw(store: &dyn RecordStore, ledger: &Ledger, rec: &LedgerRecord) {
        let name = ledger.record_name(&rec.key);
        let etag = store.read(&name).await.unwrap().map(|r| r.etag);
        store
            .write_tagged(
                &name,
                Bytes::from(serde_json::to_vec(rec).unwrap()),
                etag.as_deref(),
                &tags_of(rec),
            )
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn the_index_follows_the_record_and_claims_write_no_entry() {
        let (store, ledger) = memory();
        ledger.put(&waiting("k", 1, 1_000), None).await.unwrap();
        let p = ledger.pending().await.unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(
            (p[0].attempt, p[0].due, p[0].partition.as_deref()),
            (2, at(1_000), Some("3"))
        );
        assert_eq!(p[0].sequence_number, Some(9));
        // A claim changes neither due time nor attempt: no entry write (the mark says so).
        let (mut rec, etag) = ledger.get("k").await.unwrap().unwrap();
        assert_eq!(
            rec.indexed,
            Some(IndexMark {
                attempt: 2,
                due_ms: 1_000
            })
        );
        let entry = store.read(&ledger.entry_name("k")).await.unwrap().unwrap();
        rec.claim = Some(Claim {
            attempt: 2,
            owner: "o".into(),
            instance: "i".into(),
            until_ms: 5_000,
        });
        let etag = ledger.put(&rec, Some(&etag)).await.unwrap();
        let same = store.read(&ledger.entry_name("k")).await.unwrap().unwrap();
        assert_eq!(entry.etag, same.etag, "no entry write for a claim");
        // The retry failed again: the entry moves with the record.
        rec.attempts = 2;
        rec.next_attempt_ms = Some(9_000);
        rec.claim = None;
        let etag = ledger.put(&rec, Some(&etag)).await.unwrap();
        let p = ledger.pending().await.unwrap();
        assert_eq!((p[0].attempt, p[0].due), (3, at(9_000)));
        // Delivered: the entry is gone.
        let (mut rec, _) = ledger.get("k").await.unwrap().unwrap();
        rec.state = State::Delivered;
        rec.attempts = 3;
        rec.next_attempt_ms = None;
        ledger.put(&rec, Some(&etag)).await.unwrap();
        assert!(ledger.pending().await.unwrap().is_empty());
        assert!(store.read(&ledger.entry_name("k")).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_stale_entry_is_repaired_against_its_record_not_trusted() {
        let (store, ledger) = memory();
        assert!(ledger.pending().await.unwrap().is_empty(), "a new ledger");
        for k in ["moved", "settled", "gone", "true"] {
            ledger.put(&waiting(k, 1, 1_000), None).await.unwrap();
        }
        // Crashes between a record's write and its entry's: a due time that moved later,
        // a record delivered, a record removed.
        let (mut moved, _) = ledger.get("moved").await.unwrap().unwrap();
        moved.attempts = 2;
        moved.next_attempt_ms = Some(60_000);
        write_raw(store.as_ref(), &ledger, &moved).await;
        let (mut settled, _) = ledger.get("settled").await.unwrap().unwrap();
        settled.state = State::Delivered;
        settled.next_attempt_ms = None;
        write_raw(store.as_ref(), &ledger, &settled).await;
        let name = ledger.record_name("gone");
        let etag = store.read(&name).await.unwrap().unwrap().etag;
        store.delete(&name, &etag).await.unwrap();

        let listed = ledger.pending().await.unwrap();
        assert_eq!(listed.len(), 4, "stale entries are listed until repaired");
        let mut repairs = std::collections::BTreeMap::new();
        for p in &listed {
            repairs.insert(p.key.clone(), ledger.repair_pending(p).await.unwrap());
        }
        assert_eq!(repairs["moved"], Repair::Rewritten);
        assert_eq!(repairs["settled"], Repair::Removed);
        assert_eq!(repairs["gone"], Repair::Removed);
        assert_eq!(repairs["true"], Repair::Accurate);
        let after = ledger.pending().await.unwrap();
        let keys: Vec<_> = after
            .iter()
            .map(|p| (p.key.as_str(), p.attempt, p.due))
            .collect();
        assert_eq!(keys, vec![("true", 2, at(1_000)), ("moved", 3, at(60_000))]);
    }

    #[tokio::test]
    async fn a_late_removal_leaves_the_entry_of_a_replay_alone() {
        let (store, ledger) = memory();
        ledger.put(&waiting("k", 1, 1_000), None).await.unwrap();
        // A replay wrote an entry for attempt 4 after this record was dead-lettered at
        // attempt 1 ran; the dead letter's late removal finds an entry for a later attempt.
        let replayed = waiting("k", 3, 2_000);
        ledger.write_entry(&replayed).await.unwrap();
        ledger.remove_entry("k", 1).await.unwrap();
        assert!(store.read(&ledger.entry_name("k")).await.unwrap().is_some());
        ledger.remove_entry("k", 4).await.unwrap();
        assert!(store.read(&ledger.entry_name("k")).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn records_written_before_the_index_are_indexed_once() {
        let (store, ledger) = memory();
        // An older version wrote records with no index: one waiting, one delivered.
        write_raw(store.as_ref(), &ledger, &waiting("old", 1, 1_000)).await;
        let mut done = waiting("done", 1, 1_000);
        done.state = State::Delivered;
        write_raw(store.as_ref(), &ledger, &done).await;
        let p = ledger.pending().await.unwrap();
        assert_eq!(
            p.iter().map(|p| p.key.as_str()).collect::<Vec<_>>(),
            vec!["old"]
        );
        assert!(store.read(&ledger.index_marker()).await.unwrap().is_some());
        // Another replica (a new Ledger) reads the marker and lists the index alone.
        let again = Ledger::new(store.clone(), "hub", "$Default");
        let reads = store.reads();
        assert_eq!(again.pending().await.unwrap().len(), 1);
        assert_eq!(store.reads() - reads, 1, "the marker only");
    }

    #[test]
    fn a_key_without_a_record_says_how_long_delivered_records_are_kept() {
        use std::time::Duration;
        let store = Arc::new(crate::azure::memory::MemoryRecordStore::new());
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(30 * 86_400);
        let week = Ledger::new(store.clone(), "hub", "$Default")
            .with_retention(Some(Duration::from_secs(7 * 86_400)))
            .no_record("k", now);
        assert_eq!(week["state"], "UNKNOWN");
        assert_eq!(week["delivered_records_kept_days"], 7);
        let since =
            crate::clock::rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(23 * 86_400));
        assert_eq!(week["records_kept_since"], since.as_str());
        assert!(week["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("delivered on a retry before {since}")));
        let forever = Ledger::new(store.clone(), "hub", "$Default")
            .with_retention(None)
            .no_record("k", now);
        assert!(forever["records_kept_since"].is_null());
        assert!(forever["detail"]
            .as_str()
            .unwrap()
            .contains("kept for ever"));
        let unknown = Ledger::new(store, "hub", "$Default").no_record("k", now);
        assert!(unknown["delivered_records_kept_days"].is_null());
    }

    #[test]
    fn keys_survive_any_characters() {
        for k in ["a/b/c", "order 42 é", "%2F", "hub/0/17"] {
            assert_eq!(decode_key(&encode_key(k)).as_deref(), Some(k));
            assert!(!encode_key(k).contains('/'));
        }
    }
}
