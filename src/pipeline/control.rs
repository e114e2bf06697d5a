//! An operator's pause: one control record per deployment in the container the replicas
//! already share (`control/{hub}/{consumer group}/pause`), written by `hubguard partitions
//! pause|resume` with compare-and-swap and read by every replica every
//! [`PAUSE_POLL`]. A paused partition stops reading from Event Hubs — it keeps its
//! ownership (holding a partition by not polling is safe, and the processor keeps refreshing
//! the claim), finishes and settles what it had accepted, and checkpoints only over settled
//! events, as always. The retry loop keeps draining: retries are events already read and
//! settled into Service Bus, and pausing them would only let them pile up past their due
//! times — unless the operator pauses them too: `hubguard retries pause` adds a
//! [`RetryPause`] to the same record (by key, event type, error text or all), and a paused
//! retry that comes due is deferred, without counting an attempt and without holding any
//! partition, and looked at again every `retry.pause_recheck_ms`. Readiness and `/v1/status`
//! list a paused partition as held, with who paused it and since when; `/v1/status` and
//! `hubguard status KEY` name a retry's pause the same way; resuming needs no restart.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::azure::versioned::{
    compare_and_swap, Change, Conflicts, Contended, Json, Start, Versioned,
};
use crate::azure::{RecordStore, StoreError};

/// How often every replica reads the control record.
pub const PAUSE_POLL: Duration = Duration::from_secs(2);

/// Who paused, since when, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pause {
    /// Who (`--by`, else the user name).
    pub by: String,
    /// Since when (ms since the epoch).
    pub since_ms: i64,
    /// Why (`--reason`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// An operator's rewind of one partition's checkpoint (`hubguard checkpoints rewind`),
/// applied by the partition's owner once the partition is paused and what it had read has
/// settled (so no checkpoint of its own lands after it), or by the command itself when no
/// replica owns the partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rewind {
    /// Unique per request: a replica applies each request once.
    pub id: String,
    /// The checkpoint's sequence number: the event *before* the first one delivered again
    /// (checkpoints are exclusive); `first - 1`.
    pub sequence_number: i64,
    /// The checkpoint's offset: that event's, or `-1` (the start of the partition's
    /// retained stream) when the first event delivered again is the oldest retained.
    pub offset: String,
    /// The first sequence number delivered again.
    pub first: i64,
    /// What the operator asked for (`--to T` or `--sequence N`).
    pub asked: String,
    /// Who (`--by`, else the user name).
    pub by: String,
    /// When it was asked (ms since the epoch).
    pub since_ms: i64,
    /// Who applied it and when; `None` while it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<Applied>,
}

/// Who applied a [`Rewind`], and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// The owner id of the replica that applied it, or `hubguard checkpoints rewind`.
    pub by: String,
    /// When (ms since the epoch).
    pub at_ms: i64,
}

impl Rewind {
    /// The checkpoint it writes, as the SDK's processor resumes from it (exclusive).
    pub fn checkpoint(
        &self,
        namespace: &str,
        hub: &str,
        consumer_group: &str,
        partition: &str,
    ) -> azure_messaging_eventhubs::models::Checkpoint {
        azure_messaging_eventhubs::models::Checkpoint {
            fully_qualified_namespace: namespace.into(),
            event_hub_name: hub.into(),
            consumer_group: consumer_group.into(),
            partition_id: partition.into(),
            offset: Some(self.offset.clone()),
            sequence_number: Some(self.sequence_number),
        }
    }
}

/// Which retries a [`RetryPause`] holds: every criterion given must match; none given:
/// every retry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryFilter {
    /// The event's idempotency key, exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The event's type, exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// A text the last attempt's error contains (ASCII case-insensitive), e.g. `503` or
    /// `timed out`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl RetryFilter {
    /// Whether it holds a retry of `key`, of `event_type`, whose last error was `last_error`.
    pub fn matches(&self, key: &str, event_type: Option<&str>, last_error: Option<&str>) -> bool {
        self.key.as_deref().is_none_or(|k| k == key)
            && self
                .event_type
                .as_deref()
                .is_none_or(|t| event_type == Some(t))
            && self.error.as_deref().is_none_or(|e| {
                last_error.is_some_and(|l| l.to_ascii_lowercase().contains(&e.to_ascii_lowercase()))
            })
    }

    /// Whether it holds every retry.
    pub fn is_all(&self) -> bool {
        self.key.is_none() && self.event_type.is_none() && self.error.is_none()
    }
}

impl std::fmt::Display for RetryFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_all() {
            return f.write_str("every retry");
        }
        let mut parts = Vec::new();
        if let Some(k) = &self.key {
            parts.push(format!("key {}", k.escape_debug()));
        }
        if let Some(t) = &self.event_type {
            parts.push(format!("event type {}", t.escape_debug()));
        }
        if let Some(e) = &self.error {
            parts.push(format!("last error containing \"{}\"", e.escape_debug()));
        }
        write!(f, "retries of {}", parts.join(" and "))
    }
}

/// An operator's pause of retries (`hubguard retries pause`): the retries it holds, and
/// who paused them, since when and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPause {
    /// Which retries.
    pub filter: RetryFilter,
    /// Who, since when, why.
    #[serde(flatten)]
    pub pause: Pause,
}

/// The control record: the operator's pauses, and the checkpoint rewinds asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pauses {
    /// Every partition is paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all: Option<Pause>,
    /// These partitions are paused.
    #[serde(default)]
    pub partitions: BTreeMap<String, Pause>,
    /// partition → its latest rewind (waiting or applied).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rewinds: BTreeMap<String, Rewind>,
    /// The operator's pauses of retries, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retries: Vec<RetryPause>,
}

impl Pauses {
    /// The pause that holds partition `pid`, if any.
    pub fn of(&self, pid: &str) -> Option<&Pause> {
        self.partitions.get(pid).or(self.all.as_ref())
    }

    /// The rewind of `pid` that waits to be applied, if any.
    pub fn waiting_rewind(&self, pid: &str) -> Option<&Rewind> {
        self.rewinds.get(pid).filter(|r| r.applied.is_none())
    }

    /// The first pause that holds a retry of `key`, of `event_type`, whose last error was
    /// `last_error`.
    pub fn retry_pause(
        &self,
        key: &str,
        event_type: Option<&str>,
        last_error: Option<&str>,
    ) -> Option<&RetryPause> {
        self.retries
            .iter()
            .find(|p| p.filter.matches(key, event_type, last_error))
    }

    /// The same record with no partition paused (rewinds and retry pauses kept).
    #[cfg(any(test, feature = "cli"))]
    pub fn resumed(&self) -> Self {
        Self {
            all: None,
            partitions: BTreeMap::new(),
            ..self.clone()
        }
    }

    /// Whether no partition is paused.
    #[cfg(any(test, feature = "cli"))]
    pub fn is_empty(&self) -> bool {
        self.all.is_none() && self.partitions.is_empty()
    }

    /// The text readiness gives for a paused partition.
    pub fn reason(p: &Pause) -> String {
        format!(
            "paused by {} since {}{}",
            p.by,
            crate::clock::rfc3339(crate::clock::at(p.since_ms)),
            p.reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        )
    }
}

/// The name a paused partition is held under in readiness and `/v1/status`.
#[cfg(any(test, feature = "testbed"))]
pub fn held_name(pid: &str) -> String {
    super::health::HoldSubject::PausedPartition(pid.to_string()).to_string()
}

/// The control record's name for a deployment (consumer group lower-cased, as the ledger's).
pub fn record_name(hub: &str, consumer_group: &str) -> String {
    crate::ledger::control_record_name(hub, consumer_group)
}

/// An unreadable control record: named, never taken as "nothing paused" silently.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Blob storage failed.
    #[error("the pause control record: {0}")]
    Store(#[from] StoreError),
    /// The record is not hubguard's format.
    #[error("the pause control record {name} cannot be parsed: {reason}")]
    Corrupt {
        /// Its blob name.
        name: String,
        /// The parser's words.
        reason: String,
    },
    /// Too many writers at once.
    #[error("the pause control record {0} kept changing; try again")]
    Contended(String),
    /// Single partitions cannot be resumed while every partition is paused.
    #[cfg(any(test, feature = "cli"))]
    #[error("every partition is paused ({0}); resume without naming partitions to resume them")]
    AllPaused(String),
}

impl From<Contended> for ControlError {
    fn from(c: Contended) -> Self {
        ControlError::Contended(c.record)
    }
}

impl Conflicts for ControlError {
    fn is_conflict(&self) -> bool {
        matches!(self, ControlError::Store(StoreError::Conflict))
    }
}

/// The control record `name` in `store`, as the one compare-and-swap reads and writes it.
fn record<'a>(store: &'a dyn RecordStore, name: &'a str) -> Json<'a, Pauses, ControlError> {
    Json::new(store, name, |name, e| {
        Err(ControlError::Corrupt {
            name: name.into(),
            reason: e.to_string(),
        })
    })
}

/// Reads the control record (with its ETag).
pub async fn read(
    store: &dyn RecordStore,
    name: &str,
) -> Result<Option<Versioned<Pauses>>, ControlError> {
    record(store, name).read().await
}

/// The control record as it stands (empty when none was ever written).
#[cfg(any(test, feature = "cli"))]
pub async fn current(store: &dyn RecordStore, name: &str) -> Result<Pauses, ControlError> {
    Ok(read(store, name)
        .await?
        .map(|p| p.value)
        .unwrap_or_default())
}

/// Changes the control record with compare-and-swap: `change` gets what is there and says
/// what should be (`None`: nothing to change). Returns the record as it stands, and whether
/// it was written.
pub async fn change(
    store: &dyn RecordStore,
    name: &str,
    change: impl Fn(&Pauses) -> Option<Pauses>,
) -> Result<(Pauses, bool), ControlError> {
    let swapped = compare_and_swap(&record(store, name), Start::Read, |now| {
        let now = now.unwrap_or_default();
        match change(&now) {
            Some(next) => Change::Write(Box::new(next.clone()), next),
            None => Change::Keep(now),
        }
    })
    .await?;
    Ok((swapped.value, swapped.written.is_some()))
}

/// What `partitions pause|resume` (and the console's pause and resume) did: the record as
/// it stands, and whether it changed (with `dry_run`: would change).
#[cfg(any(test, feature = "cli"))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PauseResult {
    /// The control record after the change (with `dry_run`: as it would be).
    pub record: Pauses,
    /// Whether it changed.
    pub changed: bool,
}

/// The one implementation of `partitions pause|resume` and the console's pause and resume:
/// pauses (`pause`) or resumes `partitions` (none: every partition) with one
/// compare-and-swap on the control record `name`, as `entry` says who and why. Resuming
/// single partitions while every partition is paused is refused ([`ControlError::AllPaused`]),
/// nothing written.
#[cfg(any(test, feature = "cli"))]
pub async fn pause_or_resume(
    store: &dyn RecordStore,
    name: &str,
    pause: bool,
    partitions: &[String],
    entry: Pause,
    dry_run: bool,
) -> Result<PauseResult, ControlError> {
    let wanted = |now: &Pauses| -> Option<Pauses> {
        let mut next = now.clone();
        match (pause, partitions.is_empty()) {
            (true, true) if now.all.is_none() => next.all = Some(entry.clone()),
            (true, false) => {
                for p in partitions {
                    next.partitions
                        .entry(p.clone())
                        .or_insert_with(|| entry.clone());
                }
            }
            (false, true) => next = now.resumed(),
            // Every partition is paused: refused below, nothing written.
            (false, false) if now.all.is_some() => return None,
            (false, false) => {
                for p in partitions {
                    next.partitions.remove(p);
                }
            }
            (true, true) => {}
        }
        (next != *now).then_some(next)
    };
    let (record, changed) = if dry_run {
        let now = current(store, name).await?;
        let next = wanted(&now);
        let changes = next.is_some();
        (next.unwrap_or(now), changes)
    } else {
        change(store, name, wanted).await?
    };
    if !pause && !partitions.is_empty() {
        if let Some(all) = &record.all {
            return Err(ControlError::AllPaused(Pauses::reason(all)));
        }
    }
    Ok(PauseResult { record, changed })
}

/// What `retries resume` resumes.
#[cfg(any(test, feature = "cli"))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The pause with exactly this filter.
    Filter(RetryFilter),
    /// Every pause of retries.
    Everything,
}

/// The one implementation of `retries pause|resume` (and the console's, when it has them):
/// with one compare-and-swap on the control record `name`, `Some(filter)` adds a pause of
/// the retries `filter` holds (as `entry` says who and why; a pause with the same filter is
/// kept as it is), `None` with `resume` removes pauses. `changed` says whether the record
/// changed (with `dry_run`: would).
#[cfg(any(test, feature = "cli"))]
pub async fn pause_or_resume_retries(
    store: &dyn RecordStore,
    name: &str,
    pause: Option<(RetryFilter, Pause)>,
    resume: Option<Resume>,
    dry_run: bool,
) -> Result<PauseResult, ControlError> {
    let wanted = |now: &Pauses| -> Option<Pauses> {
        let mut next = now.clone();
        if let Some((filter, entry)) = &pause {
            if !now.retries.iter().any(|p| p.filter == *filter) {
                next.retries.push(RetryPause {
                    filter: filter.clone(),
                    pause: entry.clone(),
                });
            }
        }
        match &resume {
            Some(Resume::Filter(f)) => next.retries.retain(|p| p.filter != *f),
            Some(Resume::Everything) => next.retries.clear(),
            None => {}
        }
        (next != *now).then_some(next)
    };
    let (record, changed) = if dry_run {
        let now = current(store, name).await?;
        let next = wanted(&now);
        let changes = next.is_some();
        (next.unwrap_or(now), changes)
    } else {
        change(store, name, wanted).await?
    };
    Ok(PauseResult { record, changed })
}

/// Adds `paused` to a waiting retry's `view` when an operator's pause of retries
/// (`hubguard retries pause`) holds it: which pause, who, since when, why. A control record
/// that cannot be read is said (`paused_unknown`), never taken as "not paused".
pub async fn add_retry_pause(
    ledger: &crate::ledger::Ledger,
    rec: &crate::ledger::LedgerRecord,
    view: &mut serde_json::Value,
) {
    if rec.state() != crate::ledger::State::RetryScheduled {
        return;
    }
    let name = ledger.control_record_name();
    match read(ledger.store().as_ref(), &name).await {
        Ok(record) => {
            let pauses = record.map(|p| p.value).unwrap_or_default();
            if let Some(p) = pauses.retry_pause(
                &rec.key,
                rec.event_type.as_deref(),
                rec.last_error.as_deref(),
            ) {
                let mut paused = serde_json::to_value(p).unwrap_or_default();
                paused["what"] = p.filter.to_string().into();
                paused["reason_text"] = Pauses::reason(&p.pause).into();
                view["paused"] = paused;
            }
        }
        Err(e) => view["paused_unknown"] = crate::redact::redacted(&e.to_string()).into(),
    }
    crate::redact::redact_json(view);
}

/// Marks `pid`'s rewind `id` applied by `by` (compare-and-swap; a newer request for the
/// partition is left alone).
pub async fn mark_applied(
    store: &dyn RecordStore,
    name: &str,
    pid: &str,
    id: &str,
    by: &str,
) -> Result<(), ControlError> {
    let at_ms = crate::clock::ms(std::time::SystemTime::now());
    change(store, name, |now| {
        let r = now.rewinds.get(pid)?;
        if r.id != id || r.applied.is_some() {
            return None;
        }
        let mut next = now.clone();
        next.rewinds.get_mut(pid).expect("present").applied = Some(Applied {
            by: by.into(),
            at_ms,
        });
        Some(next)
    })
    .await
    .map(|_| ())
}

/// Reads the control record every `poll` until `cancel`, publishing each change. While it
/// cannot be read, what was last read stays in force (a blob outage neither pauses nor
/// resumes anything) and a warning names the cause.
pub(crate) async fn watch(
    store: Arc<dyn RecordStore>,
    name: String,
    tx: tokio::sync::watch::Sender<Pauses>,
    poll: Duration,
    clock: Arc<crate::clock::Clock>,
    cancel: CancellationToken,
) {
    loop {
        match read(store.as_ref(), &name).await {
            Ok(read) => {
                let now = read.map(|p| p.value).unwrap_or_default();
                tx.send_if_modified(|p| {
                    let changed = *p != now;
                    if changed {
                        tracing::info!(pauses = ?now, "the operator's pause record changed");
                        *p = now.clone();
                    }
                    changed
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the pause control record; keeping what was last read")
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = clock.sleep(poll) => {}
        }
    }
}
