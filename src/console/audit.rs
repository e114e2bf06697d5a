//! The console's audit trail, shared by the replicas: every action (refused ones included)
//! is appended, newest first, to one blob record beside the control record
//! (`audit/{hub}/{consumer group}/console`) with the one compare-and-swap every record kind
//! uses, keeping the latest [`KEPT`]; every action is also in the log (target
//! `hubguard::audit`) and in this replica's memory — what the audit page shows when the
//! shared record cannot be read or written.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Json, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::Console;
use crate::azure::versioned::{
    compare_and_swap, Change, Conflicts, Contended, Json as Record, Start,
};
use crate::azure::{RecordStore, StoreError};
use crate::redact::redacted;
use crate::sync::LockExt;

/// Actions the shared record keeps (the latest), and this replica's memory.
pub const KEPT: usize = 500;

/// Longest outcome kept (characters; the log has it whole).
const OUTCOME_LIMIT: usize = 1_000;

/// Longest action name kept (it comes from the request's path).
const ACTION_LIMIT: usize = 64;

/// Requests refused access are written to the shared record at most this often per replica
/// (the log and the replica's memory have every one): a stranger's requests cannot make the
/// replicas write blobs at their pace.
const REFUSALS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// One action, as the audit trail records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When (RFC 3339).
    pub at: String,
    /// Who (the proxy's user, or the token's role; `unknown` for a refused stranger).
    pub who: String,
    /// What: `pause`, `resume`, `retry-now`, `cancel`, `replay`, `replay-job`, `stop-job`,
    /// `rewind`.
    pub action: String,
    /// On what: the key, the partitions, or the replay's filter.
    pub target: Value,
    /// A dry run.
    pub dry_run: bool,
    /// What came of it (or why it was refused).
    pub outcome: String,
    /// The replica whose console it was (its owner id).
    #[serde(default)]
    pub replica: String,
}

/// The shared record: the latest actions, newest first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AuditTrail {
    /// Newest first, at most [`KEPT`].
    pub entries: VecDeque<AuditEntry>,
}

impl AuditTrail {
    /// This trail with `entry` added first, the oldest dropped beyond `keep`. Pure.
    pub fn appended(&self, entry: AuditEntry, keep: usize) -> Self {
        let mut next = self.clone();
        next.entries.push_front(entry);
        next.entries.truncate(keep);
        next
    }
}

/// Why the shared record could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// Storage failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Too many writers at once.
    #[error("the audit record {0} kept changing")]
    Contended(String),
    /// The record is not an audit trail (it is left as it is).
    #[error("the audit record {name} cannot be read: {reason}")]
    Corrupt {
        /// Its blob name.
        name: String,
        /// The parser's words.
        reason: String,
    },
}

impl From<Contended> for AuditError {
    fn from(c: Contended) -> Self {
        Self::Contended(c.record)
    }
}

impl Conflicts for AuditError {
    fn is_conflict(&self) -> bool {
        matches!(self, Self::Store(StoreError::Conflict))
    }
}

fn record<'a>(store: &'a dyn RecordStore, name: &'a str) -> Record<'a, AuditTrail, AuditError> {
    Record::new(store, name, |name, e| {
        Err(AuditError::Corrupt {
            name: name.into(),
            reason: e.to_string(),
        })
    })
}

/// Appends `entry` to the shared record `name` (compare-and-swap).
pub async fn append(
    store: &dyn RecordStore,
    name: &str,
    entry: AuditEntry,
) -> Result<(), AuditError> {
    compare_and_swap(&record(store, name), Start::Read, |now| {
        let next = now.unwrap_or_default().appended(entry.clone(), KEPT);
        Change::Write(Box::new(next), ())
    })
    .await?;
    Ok(())
}

/// The shared record as it stands (empty when no action was ever taken).
pub async fn read(store: &dyn RecordStore, name: &str) -> Result<AuditTrail, AuditError> {
    Ok(record(store, name)
        .read()
        .await?
        .map(|v| v.value)
        .unwrap_or_default())
}

/// The audit trail of one console: where the shared record is, and this replica's memory.
pub(crate) struct Audit {
    store: Arc<dyn RecordStore>,
    name: String,
    kept: std::sync::Mutex<VecDeque<AuditEntry>>,
    /// Of those, the ones not in the shared record (refusals beyond one a second, appends
    /// that failed): the page shows them beside it.
    unshared: std::sync::Mutex<VecDeque<AuditEntry>>,
    /// When a refusal of access was last written to the shared record.
    last_refusal: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Audit {
    pub(crate) fn new(store: Arc<dyn RecordStore>, name: String) -> Self {
        Self {
            store,
            name,
            kept: Default::default(),
            unshared: Default::default(),
            last_refusal: Default::default(),
        }
    }

    /// Logs `entry`, keeps it in memory and appends it to the shared record (a failure is
    /// logged: the log and the memory still have it).
    pub(crate) async fn record(&self, entry: AuditEntry) {
        self.keep(entry, true).await;
    }

    /// [`record`](Self::record) for a request refused access (no operator role, another
    /// site, no page token): written to the shared record unless one was within
    /// [`REFUSALS_EVERY`].
    pub(crate) async fn refused(&self, entry: AuditEntry) {
        let share = {
            let mut last = self.last_refusal.locked();
            let now = tokio::time::Instant::now();
            let due = last.is_none_or(|l| now.duration_since(l) >= REFUSALS_EVERY);
            if due {
                *last = Some(now);
            }
            due
        };
        self.keep(entry, share).await;
    }

    async fn keep(&self, mut entry: AuditEntry, share: bool) {
        entry.action = entry.action.chars().take(ACTION_LIMIT).collect();
        entry.outcome = redacted(&entry.outcome);
        tracing::info!(
            target: "hubguard::audit",
            who = %entry.who,
            action = %entry.action,
            target_of = %entry.target,
            dry_run = entry.dry_run,
            outcome = %entry.outcome,
            shared = share,
            "console action"
        );
        entry.outcome = entry.outcome.chars().take(OUTCOME_LIMIT).collect();
        {
            let mut kept = self.kept.locked();
            kept.push_front(entry.clone());
            kept.truncate(KEPT);
        }
        let shared = match share {
            true => append(self.store.as_ref(), &self.name, entry.clone()).await,
            false => Ok(()),
        };
        if !share || shared.is_err() {
            let mut unshared = self.unshared.locked();
            unshared.push_front(entry);
            unshared.truncate(KEPT);
        }
        if let Err(e) = shared {
            tracing::warn!(target: "hubguard::audit", record = %self.name, error = %redacted(&e.to_string()), "could not append a console action to the shared audit record; the log and this replica's audit page have it");
        }
    }

    fn in_memory(&self) -> Vec<AuditEntry> {
        self.kept.locked().iter().cloned().collect()
    }

    /// The shared record's entries with this replica's unshared ones among them (marked
    /// `only_here`), newest first, at most [`KEPT`].
    fn with_unshared(&self, trail: AuditTrail) -> Vec<Value> {
        let unshared: Vec<AuditEntry> = self.unshared.locked().iter().cloned().collect();
        merged(trail.entries.into_iter().collect(), unshared)
    }
}

/// `shared` and `here` (each newest first) as one list, newest first (RFC 3339 times in one
/// form sort as text), at most [`KEPT`]; `here`'s entries marked `only_here`. Pure.
fn merged(shared: Vec<AuditEntry>, here: Vec<AuditEntry>) -> Vec<Value> {
    let mut all: Vec<(AuditEntry, bool)> = shared
        .into_iter()
        .map(|e| (e, false))
        .chain(here.into_iter().map(|e| (e, true)))
        .collect();
    all.sort_by(|a, b| b.0.at.cmp(&a.0.at));
    all.into_iter()
        .take(KEPT)
        .map(|(e, only_here)| {
            let mut v = serde_json::to_value(e).unwrap_or_default();
            if only_here {
                v["only_here"] = true.into();
            }
            v
        })
        .collect()
}

/// `GET /console/api/audit`: the latest actions of every replica, newest first (the shared
/// record), or — when it cannot be read — this replica's, saying so.
pub(crate) async fn audit(State(c): State<Console>, headers: HeaderMap) -> Response {
    if let Err(r) = c.reader(&headers) {
        return *r;
    }
    let a = &c.0.audit;
    let mut v = match read(a.store.as_ref(), &a.name).await {
        Ok(trail) => json!({ "entries": a.with_unshared(trail), "shared": true }),
        Err(e) => json!({
            "entries": a.in_memory(),
            "shared": false,
            "error": format!("this replica's actions only: {}", redacted(&e.to_string())),
        }),
    };
    crate::redact::redact_json(&mut v);
    Json(v).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(n: usize) -> AuditEntry {
        AuditEntry {
            at: format!("2026-12-05T10:00:{:02}Z", n % 60),
            who: "alice".into(),
            action: "pause".into(),
            target: json!({ "partitions": [n.to_string()] }),
            dry_run: false,
            outcome: "changed".into(),
            replica: format!("replica-{}", n % 2),
        }
    }

    #[tokio::test]
    async fn every_replica_appends_to_one_record_newest_first_and_it_stays_bounded() {
        let store = crate::azure::memory::MemoryRecordStore::new();
        let name = "audit/hub/$default/console";
        assert!(read(&store, name).await.unwrap().entries.is_empty());
        for n in 0..KEPT + 5 {
            append(&store, name, entry(n)).await.unwrap();
        }
        let trail = read(&store, name).await.unwrap();
        assert_eq!(trail.entries.len(), KEPT);
        assert_eq!(trail.entries[0], entry(KEPT + 4), "newest first");
        assert_eq!(trail.entries[KEPT - 1], entry(5), "the oldest dropped");
        // Two replicas appending at once: both kept (compare-and-swap).
        let (a, b) = tokio::join!(
            append(&store, name, entry(1_000)),
            append(&store, name, entry(1_001))
        );
        a.unwrap();
        b.unwrap();
        let trail = read(&store, name).await.unwrap();
        let first: Vec<&AuditEntry> = trail.entries.iter().take(2).collect();
        assert!(first.contains(&&entry(1_000)) && first.contains(&&entry(1_001)));
        assert_eq!(trail.entries.len(), KEPT);
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_of_access_reach_the_shared_record_at_most_once_a_second_and_show_here() {
        let store = Arc::new(crate::azure::memory::MemoryRecordStore::new());
        let name = "audit/hub/$default/console";
        let audit = Audit::new(store.clone(), name.into());
        let refused = |n: usize| AuditEntry {
            outcome: "refused: another site".into(),
            at: format!("2026-12-05T10:00:0{n}Z"),
            ..entry(n)
        };
        audit.refused(refused(1)).await;
        audit.refused(refused(2)).await;
        audit.record(entry(3)).await; // an operator's action is always shared
        let shared = read(store.as_ref(), name).await.unwrap();
        assert_eq!(
            shared.entries.iter().map(|e| &e.at).collect::<Vec<_>>(),
            [&entry(3).at, &refused(1).at]
        );
        tokio::time::advance(REFUSALS_EVERY).await;
        audit.refused(refused(4)).await;
        assert_eq!(read(store.as_ref(), name).await.unwrap().entries.len(), 3);
        // This replica's page shows every one, the unshared one marked.
        let page = audit.with_unshared(read(store.as_ref(), name).await.unwrap());
        let times: Vec<&str> = page.iter().map(|v| v["at"].as_str().unwrap()).collect();
        assert_eq!(times.len(), 4);
        assert!(
            times.windows(2).all(|w| w[0] >= w[1]),
            "newest first: {times:?}"
        );
        let here: Vec<&Value> = page.iter().filter(|v| v["only_here"] == true).collect();
        assert_eq!((here.len(), &here[0]["at"]), (1, &json!(refused(2).at)));
    }

    #[tokio::test]
    async fn a_record_that_is_no_audit_trail_is_named_and_left_alone() {
        let store = crate::azure::memory::MemoryRecordStore::new();
        let name = "audit/hub/$default/console";
        store
            .create(name, bytes::Bytes::from_static(b"not json"))
            .await
            .unwrap();
        let e = append(&store, name, entry(1)).await.unwrap_err();
        assert!(e.to_string().contains(name), "{e}");
        let body = store.read(name).await.unwrap().unwrap().body;
        assert_eq!(&body[..], b"not json");
    }
}
