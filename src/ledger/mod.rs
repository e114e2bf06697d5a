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

use crate::azure::versioned::{compare_and_swap, Conflicts, Contended, RecordKind};
use crate::azure::{RecordStore, StoreError};

mod dead_letters;
mod index;
mod listing;
mod record;
mod retention;

use index::{redacted_errors, tags_of};
pub use index::{state_index_value, STATE_INDEX_TAG};
pub use index::{IndexMark, Pending, Repair};
#[cfg(any(test, feature = "cli"))]
pub use listing::PendingPage;
#[cfg(any(test, feature = "cli"))]
pub use record::RunNow;
pub use record::{AttemptEntry, Claim, HistoryOutcome, LedgerRecord, State, Verdict};
#[cfg(test)]
pub use retention::Expired;

/// Longest blob name Azure Storage accepts.
pub const BLOB_NAME_LIMIT: usize = 1024;

/// History entries kept per record (older ones are dropped, the count stays right).
pub const HISTORY_LIMIT: usize = 50;

pub use crate::azure::versioned::Versioned;
pub use crate::clock::{at, ms};

pub mod lines;
pub use lines::{DrainLease, Line, Opened, Parked, ParkedEntry};

/// RFC 3339 (UTC, milliseconds) for serde.
pub(crate) mod rfc3339 {
    use std::time::SystemTime;

    /// Serialises `t` as RFC 3339.
    pub(crate) fn serialize<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::clock::rfc3339(*t))
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
    /// The pending index as last listed, when kept (see [`Ledger::pending_page`]).
    listing: Arc<listing::Listing>,
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

/// What an [`update`](Ledger::update) does with the record it was shown: write a record
/// (create it if there was none) and return the value, or keep it and return the value.
pub type Change<T> = crate::azure::versioned::Change<LedgerRecord, T>;

impl From<Contended> for LedgerError {
    fn from(c: Contended) -> Self {
        LedgerError::Contended { key: c.record }
    }
}

impl Conflicts for LedgerError {
    fn is_conflict(&self) -> bool {
        matches!(self, LedgerError::Store(StoreError::Conflict))
    }
}

/// `key`'s record, as the one compare-and-swap reads and writes it ([`Ledger::get`],
/// [`Ledger::put`]).
struct Entry<'a> {
    ledger: &'a Ledger,
    key: &'a str,
}

#[async_trait::async_trait]
impl RecordKind for Entry<'_> {
    type Value = LedgerRecord;
    type Error = LedgerError;

    fn name(&self) -> String {
        self.key.to_string()
    }

    async fn read(&self) -> Result<Option<Versioned<LedgerRecord>>, LedgerError> {
        self.ledger.get(self.key).await
    }

    async fn write(&self, value: &LedgerRecord, etag: Option<&str>) -> Result<String, LedgerError> {
        self.ledger.put(value, etag).await
    }

    fn lost(&self, e: &LedgerError) -> bool {
        e.is_conflict()
    }

    fn contended(&self, lost: Contended) -> LedgerError {
        lost.into()
    }
}

/// `key`'s record decoded from `body`.
fn decode(key: &str, body: &[u8]) -> Result<LedgerRecord, LedgerError> {
    serde_json::from_slice(body).map_err(|e| LedgerError::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

/// `{hub}/{consumer group, lower-cased}/`: where one deployment's records are kept in each
/// area of the container.
fn deployment_prefix(hub: &str, consumer_group: &str) -> String {
    format!("{hub}/{}/", consumer_group.to_ascii_lowercase())
}

/// The operator's control record of the deployment of `hub` and `consumer_group` (pauses,
/// rewinds; `pipeline::control`), beside its ledger: `control/{hub}/{consumer group}/pause`.
pub fn control_record_name(hub: &str, consumer_group: &str) -> String {
    control_record(&deployment_prefix(hub, consumer_group))
}

/// The control record's name under a deployment's `prefix`: the one place it is spelled.
fn control_record(prefix: &str) -> String {
    format!("control/{prefix}pause")
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
            prefix: deployment_prefix(hub, consumer_group),
            indexed: Arc::default(),
            retention: None,
            listing: Arc::default(),
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
    /// the ledger (see [`control_record_name`]).
    pub fn control_record_name(&self) -> String {
        control_record(&self.prefix)
    }

    /// The console's audit trail of this ledger's deployment, beside the control record:
    /// `audit/{hub}/{consumer group}/console`.
    #[cfg(any(test, feature = "cli"))]
    pub fn audit_record_name(&self) -> String {
        format!("audit/{}console", self.prefix)
    }

    /// The store the records live in (the container the replicas share).
    pub fn store(&self) -> &Arc<dyn RecordStore> {
        &self.store
    }

    /// The blob name of `key`'s record.
    pub fn record_name(&self, key: &str) -> String {
        self.blob_name("ledger", key)
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
    #[cfg(any(test, feature = "cli"))]
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
    pub async fn get(&self, key: &str) -> Result<Option<Versioned<LedgerRecord>>, LedgerError> {
        let Some(r) = self.store.read(&self.record_name(key)).await? else {
            return Ok(None);
        };
        Ok(Some(Versioned::new(decode(key, &r.body)?, r.etag)))
    }

    /// The record of `key`, without its ETag (a reader that will not write it).
    pub async fn record(&self, key: &str) -> Result<Option<LedgerRecord>, LedgerError> {
        Ok(self.get(key).await?.map(|r| r.value))
    }

    /// Re-validates `key`'s record read earlier with `etag`: `Ok(None)` when it is unchanged
    /// (blob storage answers 304 without the body), else the record as it is now (`Some(None)`
    /// when it no longer exists).
    #[cfg(test)]
    pub async fn get_if_changed(
        &self,
        key: &str,
        etag: &str,
    ) -> Result<Option<Option<Versioned<LedgerRecord>>>, LedgerError> {
        let r = match self
            .store
            .read_if_changed(&self.record_name(key), etag)
            .await?
        {
            crate::azure::IfChanged::Unchanged => return Ok(None),
            crate::azure::IfChanged::Missing => return Ok(Some(None)),
            crate::azure::IfChanged::Changed(r) => r,
        };
        Ok(Some(Some(Versioned::new(decode(key, &r.body)?, r.etag))))
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
                    State::Delivered => {
                        let removed = self.store.remove(&self.entry_name(&record.key)).await;
                        if removed.is_ok() {
                            self.listing.removed(&record.key, u32::MAX);
                        }
                        removed.map_err(LedgerError::from)
                    }
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
        read: Option<Versioned<LedgerRecord>>,
        decide: impl FnMut(Option<LedgerRecord>) -> Change<T>,
    ) -> Result<T, LedgerError> {
        let entry = Entry { ledger: self, key };
        Ok(compare_and_swap(&entry, read.into(), decide).await?.value)
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
mod tests;
