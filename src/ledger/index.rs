//! The pending index: one entry per waiting retry, blob index tags a listing filters on, and
//! the repair of entries that disagree with their record; the retry loop's claim.

use std::time::SystemTime;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::azure::StoreError;

use super::{at, Ledger, LedgerError, LedgerRecord, State};

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
    /// The event's type, when the listing says (records written since the tag exists).
    #[serde(skip)]
    pub event_type: Option<String>,
    /// The event's correlation id, when the listing says and it differs from the key.
    #[serde(skip)]
    pub correlation_id: Option<String>,
}

/// Tag names beside a ledger record (blob metadata names: C# identifiers).
pub(super) const TAG_STATE: &str = "hubguard_state";

const TAG_DUE: &str = "hubguard_due_ms";

const TAG_NEXT: &str = "hubguard_next_attempt";

const TAG_KEY: &str = "hubguard_key";

const TAG_ERROR: &str = "hubguard_last_error";

const TAG_TYPE: &str = "hubguard_event_type";

const TAG_CORRELATION: &str = "hubguard_correlation_id";

pub(super) const TAG_PARTITION: &str = "hubguard_partition";

pub(super) const TAG_SEQUENCE: &str = "hubguard_sequence_number";

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
pub(super) fn tags_of(record: &LedgerRecord) -> crate::azure::record_store::Tags {
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
    let exact = |t: &str| {
        t.len() <= TAG_TEXT_LIMIT && t.trim() == t && t.chars().all(|c| (' '..='~').contains(&c))
    };
    if exact(&record.key) {
        tags.insert(TAG_KEY.into(), record.key.clone());
    }
    // What the console filters and finds retries by without reading records.
    if let Some(t) = record.event_type.as_deref().filter(|t| exact(t)) {
        tags.insert(TAG_TYPE.into(), t.to_string());
    }
    if record.correlation_id != record.key && exact(&record.correlation_id) {
        tags.insert(TAG_CORRELATION.into(), record.correlation_id.clone());
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

/// A pending-index entry as [`Ledger::pending`] lists it: `key` and the entry's tags (taken,
/// not copied); `None` when they lack the due time or the attempt.
fn pending_of(key: String, mut tags: crate::azure::record_store::Tags) -> Option<Pending> {
    let due = tags.get(TAG_DUE).and_then(|d| d.parse::<i64>().ok())?;
    let attempt = tags.get(TAG_NEXT).and_then(|n| n.parse::<u32>().ok())?;
    Some(Pending {
        key,
        attempt,
        due: at(due),
        last_error: tags.remove(TAG_ERROR),
        sequence_number: tags.get(TAG_SEQUENCE).and_then(|s| s.parse().ok()),
        partition: tags.remove(TAG_PARTITION),
        event_type: tags.remove(TAG_TYPE),
        correlation_id: tags.remove(TAG_CORRELATION),
    })
}

/// `record` with its errors passed through the one redaction rule ([`crate::redact`]), or
/// `None` when they hold nothing to mask.
pub(super) fn redacted_errors(record: &LedgerRecord) -> Option<LedgerRecord> {
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

impl Ledger {
    /// The blob name of `key`'s entry in the pending index.
    pub fn entry_name(&self, key: &str) -> String {
        self.blob_name("pending", key)
    }

    /// The marker saying the pending index covers every waiting record: written once the
    /// first start of a version with the index has indexed the records written before it.
    pub fn index_marker(&self) -> String {
        format!("indexes/{}pending-v1", self.prefix)
    }

    /// Writes `record`'s entry in the pending index (its tags say what
    /// [`pending`](Self::pending) lists; its body names the key and the attempt).
    pub(super) async fn write_entry(&self, record: &LedgerRecord) -> Result<(), LedgerError> {
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
        if let Some(p) = pending_of(record.key.clone(), tags) {
            self.listing.wrote(p);
        }
        Ok(())
    }

    /// Removes `key`'s pending-index entry if it points at an attempt that already ran (at
    /// most `ran`): an entry a replay wrote since, for a later attempt, stays.
    pub(super) async fn remove_entry(&self, key: &str, ran: u32) -> Result<(), LedgerError> {
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
            Ok(()) | Err(StoreError::NotFound) => {
                self.listing.removed(key, ran);
                Ok(())
            }
            Err(StoreError::Conflict) => Ok(()),
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
            Ok(r) => r.map(|r| r.value),
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
    ///
    /// When the ledger keeps its listing ([`keep_pending_listing`](Self::keep_pending_listing)),
    /// each listing also replaces the one kept (see [`pending_page`](Self::pending_page)).
    pub async fn pending(&self) -> Result<Vec<Pending>, LedgerError> {
        let ticket = self.listing.start();
        let out = self.list_pending().await?;
        if let Some(t) = ticket {
            t.install(&out);
        }
        Ok(out)
    }

    /// One listing of the pending index, soonest first.
    async fn list_pending(&self) -> Result<Vec<Pending>, LedgerError> {
        self.ensure_indexed().await?;
        let prefix = format!("pending/{}", self.prefix);
        let mut out = Vec::new();
        for l in self.store.list(&prefix).await? {
            let mut tags = l.tags;
            let key = match tags.remove(TAG_KEY) {
                Some(k) => Some(k),
                // A key the tags cannot carry: the entry's body names it.
                None => match self.store.read(&l.key).await? {
                    Some(r) => serde_json::from_slice::<IndexEntry>(&r.body)
                        .ok()
                        .map(|e| e.key),
                    None => continue,
                },
            };
            let Some(p) = key.and_then(|key| pending_of(key, tags)) else {
                tracing::warn!(blob = %l.key, "a pending index entry cannot be read; leaving it out");
                continue;
            };
            out.push(p);
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
}
