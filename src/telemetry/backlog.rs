//! The backlog: work not yet done, for autoscaling — events no replica has settled yet
//! (`unread`: per partition, the last enqueued sequence number minus the checkpoint), retries
//! due now (`retries_due`: the ledger's pending retries whose due time has passed) and events
//! parked behind an earlier event of their ordering key (`parked`, ordered retries).
//!
//! hubguard checkpoints past an event once its retry is scheduled on Service Bus, so the
//! checkpoint lag alone says 0 during a retry storm; the backlog counts those retries too.
//! The pipeline samples it (`pipeline::backlog`) into a [`BacklogCell`]; this module serves
//! the sample as the `hubguard.backlog.events` gauge (labelled `kind`) and as
//! `GET /v1/backlog` (JSON, what KEDA's `metrics-api` scaler reads). Every replica samples
//! the whole deployment (every partition, the shared ledger), so any replica's answer is the
//! deployment's: aggregate with `max`, never `sum`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use opentelemetry::metrics::ObservableGauge;
use opentelemetry::KeyValue;
use serde_json::json;

use super::names::{backlog_kind, metric, metric_attr};
use crate::sync::LockExt as _;

/// One sample of the backlog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backlog {
    /// Per partition: events enqueued past its checkpoint.
    pub unread_by_partition: BTreeMap<String, u64>,
    /// Retries whose due time has passed (on the pipeline's clock) and that still wait.
    pub retries_due: u64,
    /// Retries scheduled for later (not counted in [`total`](Self::total)).
    pub retries_waiting: u64,
    /// Events parked behind an earlier event of their ordering key.
    pub parked: u64,
    /// When the sample was taken (the pipeline's clock).
    pub sampled_at: SystemTime,
}

impl Backlog {
    /// Unread events over every partition.
    pub fn unread(&self) -> u64 {
        self.unread_by_partition.values().sum()
    }

    /// The work not yet done: unread events, retries due now and parked events.
    pub fn total(&self) -> u64 {
        self.unread()
            .saturating_add(self.retries_due)
            .saturating_add(self.parked)
    }

    /// The JSON `GET /v1/backlog` answers.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "total": self.total(),
            "unread": self.unread(),
            "retries_due": self.retries_due,
            "retries_waiting": self.retries_waiting,
            "parked": self.parked,
            "unread_by_partition": self.unread_by_partition,
            "sampled_at": crate::clock::rfc3339(self.sampled_at),
        })
    }
}

/// Unread events of one partition: the last enqueued sequence number minus the checkpoint's
/// (the checkpoint names the last event processed, so reading resumes after it). Without a
/// checkpoint, a processor starting at the earliest event reads the whole retained
/// partition; one starting at the latest reads only what comes later (0 now).
pub fn unread(
    beginning: i64,
    last_enqueued: i64,
    is_empty: bool,
    checkpoint: Option<i64>,
    start_at_latest: bool,
) -> u64 {
    if is_empty {
        return 0;
    }
    let resume_from = match checkpoint {
        // A checkpoint older than the retention resumes at the beginning.
        Some(c) => (c + 1).max(beginning),
        None if start_at_latest => return 0,
        None => beginning,
    };
    u64::try_from(last_enqueued - resume_from + 1).unwrap_or(0)
}

/// The latest sample, shared by the sampler, the gauge and `GET /v1/backlog` (`None` before
/// the first sample).
#[derive(Debug, Clone, Default)]
pub struct BacklogCell(Arc<Mutex<Option<Backlog>>>);

impl BacklogCell {
    /// The latest sample.
    pub fn get(&self) -> Option<Backlog> {
        self.0.locked().clone()
    }

    /// Replaces the sample.
    pub fn set(&self, backlog: Backlog) {
        *self.0.locked() = Some(backlog);
    }
}

/// [`metric::BACKLOG_EVENTS`], registered while this lives.
pub struct BacklogGauge {
    _gauge: ObservableGauge<u64>,
}

impl std::fmt::Debug for BacklogGauge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BacklogGauge").finish_non_exhaustive()
    }
}

impl BacklogGauge {
    /// Registers the gauge on the global meter, reading `cell` at each collection (nothing
    /// before the first sample).
    pub fn register(cell: BacklogCell) -> Self {
        let gauge = super::meter()
            .u64_observable_gauge(metric::BACKLOG_EVENTS)
            .with_description(
                "Work not yet done, by kind: unread (last enqueued sequence number minus the checkpoint, all partitions), retries_due (due now, still waiting), parked (ordered retries); the whole deployment's, from any replica",
            )
            .with_callback(move |o| {
                if let Some(b) = cell.get() {
                    for (kind, n) in [
                        (backlog_kind::UNREAD, b.unread()),
                        (backlog_kind::RETRIES_DUE, b.retries_due),
                        (backlog_kind::PARKED, b.parked),
                    ] {
                        o.observe(n, &[KeyValue::new(metric_attr::KIND, kind)]);
                    }
                }
            })
            .build();
        Self { _gauge: gauge }
    }
}

/// `GET /v1/backlog`: the latest sample as JSON (`total` is what KEDA's `metrics-api`
/// scaler reads), or 503 before the first sample.
pub fn router(cell: BacklogCell) -> Router {
    Router::new()
        .route("/v1/backlog", get(serve))
        .with_state(cell)
}

async fn serve(State(cell): State<BacklogCell>) -> Response {
    match cell.get() {
        Some(b) => Json(b.to_json()).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": "the backlog has not been sampled yet" })),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unread_is_the_last_enqueued_minus_the_checkpoint() {
        assert_eq!(unread(0, 99, false, Some(89), false), 10);
        assert_eq!(unread(0, 99, false, Some(99), false), 0);
        // Without a checkpoint: the whole retained partition, or nothing at the latest.
        assert_eq!(unread(0, 99, false, None, false), 100);
        assert_eq!(unread(50, 99, false, None, false), 50);
        assert_eq!(unread(0, 99, false, None, true), 0);
        // A checkpoint behind the retention resumes at the beginning.
        assert_eq!(unread(50, 99, false, Some(10), false), 50);
        // An empty partition, and a checkpoint ahead of what the partition says.
        assert_eq!(unread(0, -1, true, None, false), 0);
        assert_eq!(unread(0, 5, false, Some(9), false), 0);
    }

    #[test]
    fn the_total_counts_due_retries_and_parked_events_not_waiting_ones() {
        let b = Backlog {
            unread_by_partition: [("0".to_string(), 3), ("1".to_string(), 4)].into(),
            retries_due: 5,
            retries_waiting: 100,
            parked: 2,
            sampled_at: SystemTime::UNIX_EPOCH,
        };
        assert_eq!(b.unread(), 7);
        assert_eq!(b.total(), 14);
        let j = b.to_json();
        assert_eq!(j["total"], 14);
        assert_eq!(j["unread_by_partition"]["1"], 4);
        assert!(j["sampled_at"]
            .as_str()
            .is_some_and(|t| t.starts_with("1970-01-01T00:00:00")));
    }
}
