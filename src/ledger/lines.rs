//! Ordered retries' storage (`processor.retry_ordering = "key"`): one *line* per ordering key
//! of a partition while an event of that key waits for a retry.
//!
//! - The line's **head pointer**, `lines/{hub}/{consumer group}/{partition}/{key}`: which
//!   event is the head (its idempotency key and sequence number), the highest sequence number
//!   parked behind it, how many were parked, and when the oldest still parked was parked.
//!   Every change is a compare-and-swap (`If-None-Match: *` to open the line, `If-Match` to
//!   park, release or end it), so of a partition parking an event and a retry loop ending the
//!   line at the same moment exactly one sees the other. An ended line's pointer stays as a
//!   tombstone (see [`Line::ended`]) until its partition's checkpoint passes what it settled. Its tags
//!   carry the same facts, so a listing answers "which keys have a line?" without reading a
//!   pointer.
//! - One **parked record** per parked event,
//!   `parked/{hub}/{consumer group}/{partition}/{key}/{sequence number, 20 digits}`, holding
//!   the event: a line that grows for days while a downstream is broken is many small blobs
//!   listed in sequence order, never one blob that grows. A parked record is removed once its
//!   event is released (it then has an ordinary ledger record, under the ledger's retention
//!   rules) or dead-lettered with the line.
//!
//! `{key}` is the ordering key in base64url, or its digest when the name would pass the
//! 1,024 characters Azure allows ("Naming and referencing containers, blobs, and metadata",
//! learn.microsoft.com).

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::{encode_key, Ledger, LedgerError, BLOB_NAME_LIMIT};
use crate::azure::record_store::Tags;
use crate::azure::versioned::{
    compare_and_swap, Change, Contended, RecordKind, Start, Swapped, Versioned,
};
use crate::azure::StoreError;
use crate::event::Event;

/// The head pointer of one line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// The ordering key.
    pub ordering_key: String,
    /// The Event Hubs partition.
    pub partition: String,
    /// The head's idempotency key.
    pub head_key: String,
    /// The head's sequence number.
    pub head_seq: i64,
    /// The highest sequence number parked behind the line (`None`: none yet).
    #[serde(default)]
    pub tail_seq: Option<i64>,
    /// Events parked behind it and not yet released (kept by the compare-and-swaps).
    #[serde(default)]
    pub parked: u64,
    /// When the line opened (ms since the epoch).
    pub opened_ms: i64,
    /// When the oldest event still parked was parked (ms since the epoch).
    #[serde(default)]
    pub oldest_parked_ms: Option<i64>,
    /// The line ended: nothing is parked and its last head settled. The pointer stays as a
    /// *tombstone* saying which events the line settled (up to `tail_seq`), so a replay of
    /// one of them from Event Hubs (a crash before the checkpoint passed it) is recognised
    /// and not delivered again; the partition's owner removes it once its checkpoint passes
    /// `tail_seq`, and opening a new line of the key replaces it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ended: bool,
    /// The W3C `traceparent` of the head's failing attempt, when the line opened on it (not
    /// known for a head released from the line until it runs): the span of an event parked
    /// behind it links to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_traceparent: Option<String>,
    /// For a head released from the line and not yet run: the `traceparent` of the attempt
    /// it waited behind, which its first attempt links to — whichever step sends that
    /// attempt's message (the release, or a step that finds the release made and makes
    /// sure of the message: duplicate detection keeps the first one sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_behind: Option<String>,
    /// A drain in batches under way (a released line's events handed to the handler in
    /// order, many per call, by whoever settled its head): while its lease is live, nobody
    /// else moves the line on (see `pipeline::lines::drain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainLease>,
}

/// Who drains a line in batches, and until when (ms since the epoch, on the services'
/// clock); renewed by each batch's write of the pointer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainLease {
    /// The drain's id (one per drain).
    pub by: String,
    /// Until when it holds.
    pub until_ms: i64,
}

impl DrainLease {
    /// Whether it still holds at `now`.
    pub fn live(&self, now: std::time::SystemTime) -> bool {
        crate::clock::ms(now) < self.until_ms
    }
}

impl Line {
    /// The last event of its partition the line settled: its highest parked, or its head.
    pub fn last_seq(&self) -> i64 {
        self.tail_seq
            .map_or(self.head_seq, |t| t.max(self.head_seq))
    }
}

/// A parked event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parked {
    /// The event.
    pub event: Event,
    /// When it was parked (ms since the epoch).
    pub parked_ms: i64,
    /// The head it was parked behind (idempotency key).
    pub behind_key: String,
    /// The head's sequence number.
    pub behind_seq: i64,
    /// The `traceparent` of the head's failing attempt, when the line knew it: the parked
    /// event's first attempt, once released, links to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behind_traceparent: Option<String>,
    /// Attempts made before it was parked (a dead letter re-driven in order by `dead-letters
    /// replay`: its count goes on from there once released, never back to 1).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempts: u32,
    /// Its ledger history before it was parked (the same dead letter's), kept for `status`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<super::AttemptEntry>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A parked record as a listing shows it (no body read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedEntry {
    /// The blob's name.
    pub name: String,
    /// The partition.
    pub partition: String,
    /// The parked event's sequence number.
    pub seq: i64,
    /// The parked event's idempotency key, when the tags carry it.
    pub key: Option<String>,
    /// When it was parked (ms since the epoch), when the tags say.
    pub parked_ms: Option<i64>,
}

const TAG_KEY: &str = "hubguard_key";
/// The idempotency key in base64url, when it is not printable ASCII (a metadata value is an
/// HTTP header value).
const TAG_KEY_B64: &str = "hubguard_key_b64";
const TAG_HEAD: &str = "hubguard_head_key";
const TAG_HEAD_SEQ: &str = "hubguard_head_seq";
const TAG_PARKED: &str = "hubguard_parked";
const TAG_OLDEST: &str = "hubguard_oldest_parked_ms";
const TAG_ORDERING: &str = "hubguard_ordering_key";
const TAG_PARKED_MS: &str = "hubguard_parked_ms";
const TAG_TAIL_SEQ: &str = "hubguard_tail_seq";
const TAG_ENDED: &str = "hubguard_ended";

/// Printable ASCII of at most 512 bytes, exactly as given (a tag value carries it as is).
fn taggable(s: &str) -> bool {
    s.len() <= 512 && s.trim() == s && s.chars().all(|c| (' '..='~').contains(&c))
}

/// A parked record's idempotency key from its listing's tags, when they carry it.
fn tagged_key(tags: &Tags) -> Option<String> {
    tags.get(TAG_KEY)
        .cloned()
        .or_else(|| tags.get(TAG_KEY_B64).and_then(|k| super::decode_key(k)))
}

fn line_tags(line: &Line) -> Tags {
    let mut t = Tags::new();
    if taggable(&line.ordering_key) {
        t.insert(TAG_ORDERING.into(), line.ordering_key.clone());
    }
    if taggable(&line.head_key) {
        t.insert(TAG_HEAD.into(), line.head_key.clone());
    }
    t.insert(TAG_HEAD_SEQ.into(), line.head_seq.to_string());
    t.insert(TAG_PARKED.into(), line.parked.to_string());
    if let Some(o) = line.oldest_parked_ms {
        t.insert(TAG_OLDEST.into(), o.to_string());
    }
    if let Some(tail) = line.tail_seq {
        t.insert(TAG_TAIL_SEQ.into(), tail.to_string());
    }
    if line.ended {
        t.insert(TAG_ENDED.into(), "1".into());
    }
    t
}

fn corrupt(key: &str, e: impl std::fmt::Display) -> LedgerError {
    LedgerError::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    }
}

/// What [`Ledger::open_line`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// The line is open with the event as its head (new, or opened before for it).
    Head,
    /// Another line of the key is open: the pointer as it is.
    Other(Box<Line>),
}

/// A line's head pointer, as the one compare-and-swap reads and writes it (its tags in the
/// same write). A pointer removed meanwhile lost the race as a changed one does.
struct Pointer<'a> {
    ledger: &'a Ledger,
    name: String,
}

#[async_trait::async_trait]
impl RecordKind for Pointer<'_> {
    type Value = Line;
    type Error = LedgerError;

    fn name(&self) -> String {
        self.name.clone()
    }

    async fn read(&self) -> Result<Option<Versioned<Line>>, LedgerError> {
        let Some(r) = self.ledger.store.read(&self.name).await? else {
            return Ok(None);
        };
        let line = serde_json::from_slice(&r.body).map_err(|e| corrupt(&self.name, e))?;
        Ok(Some(Versioned::new(line, r.etag)))
    }

    async fn write(&self, line: &Line, etag: Option<&str>) -> Result<String, LedgerError> {
        let body = serde_json::to_vec(line).map_err(|e| corrupt(&self.name, e))?;
        Ok(self
            .ledger
            .store
            .write_tagged(&self.name, Bytes::from(body), etag, &line_tags(line))
            .await?)
    }

    fn lost(&self, e: &LedgerError) -> bool {
        matches!(
            e,
            LedgerError::Store(StoreError::Conflict | StoreError::NotFound)
        )
    }

    fn contended(&self, lost: Contended) -> LedgerError {
        lost.into()
    }
}

impl Ledger {
    fn line_segment(&self, area: &str, partition: &str, ordering_key: &str) -> String {
        let readable = format!(
            "{area}/{}{partition}/{}",
            self.prefix,
            encode_key(ordering_key)
        );
        // Room for the parked record's `/{20 digits}` after it.
        if readable.len() + 21 <= BLOB_NAME_LIMIT {
            readable
        } else {
            format!(
                "{area}/{}{partition}/{}",
                self.prefix,
                crate::event::key_digest(ordering_key)
            )
        }
    }

    /// The blob name of the head pointer of `ordering_key`'s line in `partition`.
    pub fn line_name(&self, partition: &str, ordering_key: &str) -> String {
        self.line_segment("lines", partition, ordering_key)
    }

    fn parked_prefix(&self, partition: &str, ordering_key: &str) -> String {
        format!("{}/", self.line_segment("parked", partition, ordering_key))
    }

    fn parked_name(&self, partition: &str, ordering_key: &str, seq: i64) -> String {
        format!("{}{seq:020}", self.parked_prefix(partition, ordering_key))
    }

    /// The head pointer of `ordering_key`'s line in `partition`, with its ETag.
    pub async fn line(
        &self,
        partition: &str,
        ordering_key: &str,
    ) -> Result<Option<Versioned<Line>>, LedgerError> {
        let pointer = Pointer {
            ledger: self,
            name: self.line_name(partition, ordering_key),
        };
        pointer.read().await
    }

    /// Changes the head pointer of `ordering_key`'s line in `partition` by the one
    /// compare-and-swap, from `start`: `decide` sees the pointer as it is (`None`: there is
    /// none); a write that finds it changed or removed reads it and decides again.
    pub(crate) async fn change_line<R>(
        &self,
        partition: &str,
        ordering_key: &str,
        start: Start<Line>,
        decide: impl FnMut(Option<Line>) -> Change<Line, R>,
    ) -> Result<Swapped<Line, R>, LedgerError> {
        let pointer = Pointer {
            ledger: self,
            name: self.line_name(partition, ordering_key),
        };
        compare_and_swap(&pointer, start, decide).await
    }

    /// Opens a line with `line` as its pointer (`If-None-Match: *`). A line already open for
    /// the same head is [`Opened::Head`]; one for another head is returned as it is.
    pub async fn open_line(&self, line: &Line) -> Result<Opened, LedgerError> {
        let pointer = Pointer {
            ledger: self,
            name: self.line_name(&line.partition, &line.ordering_key),
        };
        let opened = compare_and_swap(&pointer, Start::From(None), |current| match current {
            None => Change::Write(Box::new(line.clone()), Opened::Head),
            Some(l) if l.head_key == line.head_key && l.head_seq == line.head_seq => {
                Change::Keep(Opened::Head)
            }
            // A line that ended: the new one replaces its tombstone (the new head is later
            // than anything it settled, so replays of those still meet a line).
            Some(l) if l.ended && l.last_seq() < line.head_seq => {
                Change::Write(Box::new(line.clone()), Opened::Head)
            }
            Some(l) => Change::Keep(Opened::Other(Box::new(l))),
        });
        Ok(opened.await?.value)
    }

    /// Replaces the pointer if it still has `etag`: [`StoreError::Conflict`] (or `NotFound`)
    /// when it changed or the line ended meanwhile.
    pub async fn write_line(&self, line: &Line, etag: &str) -> Result<String, LedgerError> {
        let name = self.line_name(&line.partition, &line.ordering_key);
        let body = serde_json::to_vec(line).map_err(|e| corrupt(&name, e))?;
        Ok(self
            .store
            .write_tagged(&name, Bytes::from(body), Some(etag), &line_tags(line))
            .await?)
    }

    /// Ends the line if its pointer still has `etag`.
    pub async fn end_line(
        &self,
        partition: &str,
        ordering_key: &str,
        etag: &str,
    ) -> Result<(), LedgerError> {
        Ok(self
            .store
            .delete(&self.line_name(partition, ordering_key), etag)
            .await?)
    }

    /// Writes the parked record of `parked` (idempotent: `false` when it was already there,
    /// a replay parking the same event again).
    pub async fn park(&self, ordering_key: &str, parked: &Parked) -> Result<bool, LedgerError> {
        let e = &parked.event;
        let name = self.parked_name(&e.partition_id, ordering_key, e.sequence_number);
        let body = serde_json::to_vec(parked).map_err(|err| corrupt(&name, err))?;
        let mut tags = Tags::new();
        if taggable(&e.identity.idempotency_key) {
            tags.insert(TAG_KEY.into(), e.identity.idempotency_key.clone());
        } else {
            let encoded = encode_key(&e.identity.idempotency_key);
            if encoded.len() <= 512 {
                tags.insert(TAG_KEY_B64.into(), encoded);
            }
        }
        if taggable(ordering_key) {
            tags.insert(TAG_ORDERING.into(), ordering_key.to_string());
        }
        tags.insert(TAG_PARKED_MS.into(), parked.parked_ms.to_string());
        if taggable(&parked.behind_key) {
            tags.insert(TAG_HEAD.into(), parked.behind_key.clone());
        }
        match self
            .store
            .write_tagged(&name, Bytes::from(body), None, &tags)
            .await
        {
            Ok(_) => Ok(true),
            Err(StoreError::Conflict) => Ok(false),
            Err(err) => Err(err.into()),
        }
    }

    /// The parked records of one line, lowest sequence number first (one listing).
    pub async fn parked_in(
        &self,
        partition: &str,
        ordering_key: &str,
    ) -> Result<Vec<ParkedEntry>, LedgerError> {
        let prefix = self.parked_prefix(partition, ordering_key);
        let mut out: Vec<ParkedEntry> = self
            .store
            .list(&prefix)
            .await?
            .into_iter()
            .filter_map(|l| {
                let seq = l.key.strip_prefix(&prefix)?.parse::<i64>().ok()?;
                Some(ParkedEntry {
                    partition: partition.to_string(),
                    seq,
                    key: tagged_key(&l.tags),
                    parked_ms: l.tags.get(TAG_PARKED_MS).and_then(|m| m.parse().ok()),
                    name: l.key,
                })
            })
            .collect();
        out.sort_by_key(|p| p.seq);
        Ok(out)
    }

    /// Every parked record of the deployment (one listing; for `status`, `retries list` and
    /// the gauges).
    pub async fn all_parked(&self) -> Result<Vec<ParkedEntry>, LedgerError> {
        let prefix = format!("parked/{}", self.prefix);
        Ok(self
            .store
            .list(&prefix)
            .await?
            .into_iter()
            .filter_map(|l| {
                let rest = l.key.strip_prefix(&prefix)?;
                let mut parts = rest.rsplitn(2, '/');
                let seq = parts.next()?.parse::<i64>().ok()?;
                let partition = parts.next()?.split('/').next()?.to_string();
                Some(ParkedEntry {
                    partition,
                    seq,
                    key: tagged_key(&l.tags),
                    parked_ms: l.tags.get(TAG_PARKED_MS).and_then(|m| m.parse().ok()),
                    name: l.key,
                })
            })
            .collect())
    }

    /// Reads a parked record (`None`: removed meanwhile).
    pub async fn read_parked(&self, name: &str) -> Result<Option<Parked>, LedgerError> {
        let Some(r) = self.store.read(name).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&r.body)
            .map(Some)
            .map_err(|e| corrupt(name, e))
    }

    /// Removes a parked record (a missing one is no error).
    pub async fn remove_parked(&self, name: &str) -> Result<(), LedgerError> {
        Ok(self.store.remove(name).await?)
    }

    /// Removes the parked record of event `seq` of the line, if any.
    pub async fn unpark(
        &self,
        partition: &str,
        ordering_key: &str,
        seq: i64,
    ) -> Result<(), LedgerError> {
        self.remove_parked(&self.parked_name(partition, ordering_key, seq))
            .await
    }

    /// The open lines: of `partition`, or of every partition. From one listing of the
    /// pointers' tags (a pointer whose tags cannot carry its keys is read); a line read from
    /// its tags alone leaves `opened_ms` unknown (0). Lines that ended are left out.
    pub async fn lines(&self, partition: Option<&str>) -> Result<Vec<Line>, LedgerError> {
        let mut all = self.lines_and_ends(partition).await?;
        all.retain(|l| !l.ended);
        Ok(all)
    }

    /// [`lines`](Self::lines), and the tombstones of lines that ended (see [`Line::ended`]).
    pub async fn lines_and_ends(&self, partition: Option<&str>) -> Result<Vec<Line>, LedgerError> {
        let prefix = match partition {
            Some(p) => format!("lines/{}{p}/", self.prefix),
            None => format!("lines/{}", self.prefix),
        };
        let mut out = Vec::new();
        for l in self.store.list(&prefix).await? {
            let Some(rest) = l.key.strip_prefix(&format!("lines/{}", self.prefix)) else {
                continue;
            };
            let Some((p, encoded)) = rest.split_once('/') else {
                continue;
            };
            let tagged = (
                l.tags.get(TAG_ORDERING),
                l.tags.get(TAG_HEAD),
                l.tags.get(TAG_HEAD_SEQ).and_then(|s| s.parse::<i64>().ok()),
            );
            let decoded = super::decode_key(encoded);
            match tagged {
                (Some(k), Some(h), Some(seq)) if decoded.as_deref() == Some(k.as_str()) => out
                    .push(Line {
                        ordering_key: k.clone(),
                        partition: p.to_string(),
                        head_key: h.clone(),
                        head_seq: seq,
                        tail_seq: l.tags.get(TAG_TAIL_SEQ).and_then(|n| n.parse().ok()),
                        parked: l
                            .tags
                            .get(TAG_PARKED)
                            .and_then(|n| n.parse().ok())
                            .unwrap_or(0),
                        opened_ms: 0,
                        oldest_parked_ms: l.tags.get(TAG_OLDEST).and_then(|n| n.parse().ok()),
                        ended: l.tags.contains_key(TAG_ENDED),
                        head_traceparent: None,
                        released_behind: None,
                        drain: None,
                    }),
                _ => {
                    if let Some(r) = self.store.read(&l.key).await? {
                        match serde_json::from_slice::<Line>(&r.body) {
                            Ok(line) => out.push(line),
                            Err(e) => {
                                tracing::warn!(blob = %l.key, error = %e, "a line's head pointer cannot be read; leaving it out")
                            }
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}
