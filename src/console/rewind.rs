//! The console's rewind of the consumer group's checkpoints, through the command line's own
//! [`pipeline::rewind::rewind`](crate::pipeline::rewind::rewind) (`hubguard checkpoints
//! rewind`): the same plan, the same refusals (a partition a live replica owns is refused
//! unless it is paused), the same request in the control record that the owner applies once
//! what it read settles. The console does not wait for the owners: it answers with each
//! partition's line as it stands, and the partitions page follows the request in the control
//! record until it is applied.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use azure_messaging_eventhubs::CheckpointStore;
use serde_json::{json, Value};

use crate::pipeline::rewind::{self, Outcome, RewindJob, RewindTo};
use crate::pipeline::{EventHubsTarget, PipelineParts};

/// What a rewind needs beyond the console's ledger: what `hubguard checkpoints rewind`
/// builds from the configuration.
#[derive(Clone)]
pub struct RewindParts {
    /// The hub and consumer group (a consumer reads the partitions' properties and the
    /// event at the time asked for).
    pub target: EventHubsTarget,
    /// The checkpoint store in the official layout (not the replicas' fenced one).
    pub checkpoints: Arc<dyn CheckpointStore + Send + Sync>,
    /// An ownership renewed within this is live.
    pub expiration: Duration,
    /// Each call's deadline.
    pub deadline: Duration,
}

impl std::fmt::Debug for RewindParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewindParts")
            .field("hub", &self.target.hub)
            .field("consumer_group", &self.target.consumer_group)
            .finish_non_exhaustive()
    }
}

impl RewindParts {
    /// From the parts a pipeline is built from (before it is built).
    pub fn of(parts: &PipelineParts) -> Self {
        Self {
            target: parts.eventhubs.clone(),
            checkpoints: parts.checkpoint_store.clone(),
            expiration: parts.options.ownership_expiration,
            deadline: parts.options.deadline,
        }
    }
}

/// Where to rewind to, from the action's `to` (RFC 3339, `now`, or a duration ago: `10m`)
/// or `sequence`: exactly one of them.
pub(crate) fn target(
    to: Option<&str>,
    sequence: Option<i64>,
    now: SystemTime,
) -> Result<RewindTo, String> {
    match (to.map(str::trim).filter(|t| !t.is_empty()), sequence) {
        (Some(_), Some(_)) => Err("give `to` or `sequence`, not both".into()),
        (None, None) => Err("give `to` (a time, or a duration ago: 10m) or `sequence`".into()),
        (None, Some(n)) if n < 0 => Err(format!("sequence: {n} is negative")),
        (None, Some(n)) => Ok(RewindTo::Sequence(n)),
        (Some(t), None) => crate::status::parse_ago(t, now)
            .map(RewindTo::Time)
            .map_err(|e| format!("to: {e}")),
    }
}

/// Runs the rewind as `hubguard checkpoints rewind --wait 0` does: `(the audit's outcome,
/// the answer)`, or why it could not run.
pub(crate) async fn run(
    parts: &RewindParts,
    records: Arc<dyn crate::azure::RecordStore>,
    to: RewindTo,
    partitions: Vec<String>,
    by: &str,
    dry_run: bool,
) -> Result<(String, Value), rewind::RewindError> {
    let job = RewindJob {
        target: parts.target.clone(),
        checkpoints: parts.checkpoints.clone(),
        records,
        expiration: parts.expiration,
        deadline: parts.deadline,
        to,
        partitions,
        by: by.to_string(),
        dry_run,
        wait: Duration::ZERO,
    };
    let report = rewind::rewind(&job, |_| {}).await?;
    let count = |f: fn(&Outcome) -> bool| report.iter().filter(|l| f(&l.outcome)).count();
    let refused = count(|o| matches!(o, Outcome::Refused { .. }));
    let waiting = count(|o| matches!(o, Outcome::Waiting { .. }));
    let applied = count(|o| matches!(o, Outcome::Applied { .. }));
    let would = count(|o| matches!(o, Outcome::WouldRewind));
    let outcome = if refused > 0 {
        let why: Vec<String> = report
            .iter()
            .filter_map(|l| match &l.outcome {
                Outcome::Refused { why } => Some(format!("partition {}: {why}", l.partition)),
                _ => None,
            })
            .collect();
        format!("refused, nothing written: {}", why.join("; "))
    } else if dry_run {
        format!("{would} partition(s) would be rewound")
    } else {
        format!(
            "{applied} partition(s) rewound, {waiting} waiting for their owner to apply it{}",
            if applied + waiting > 0 {
                "; resume them to deliver the events again"
            } else {
                ""
            }
        )
    };
    let v = json!({
        "outcome": outcome,
        "to": job.to.to_string(),
        "dry_run": dry_run,
        "refused": refused,
        "waiting": waiting,
        "applied": applied,
        "partitions": report,
    });
    Ok((outcome, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewind_takes_a_time_a_duration_ago_or_a_sequence_number_and_says_what_is_wrong() {
        let now = crate::clock::at(1_700_000_000_000);
        assert_eq!(
            target(Some("10m"), None, now),
            Ok(RewindTo::Time(now - Duration::from_secs(600)))
        );
        assert_eq!(
            target(Some("2023-11-14T22:00:00Z"), None, now),
            Ok(RewindTo::Time(crate::clock::at(
                1_700_000_000_000 - 800_000
            )))
        );
        assert_eq!(target(None, Some(7), now), Ok(RewindTo::Sequence(7)));
        assert!(target(Some("10m"), Some(7), now)
            .unwrap_err()
            .contains("not both"));
        assert!(target(Some(" "), None, now)
            .unwrap_err()
            .starts_with("give `to`"));
        assert!(target(None, Some(-1), now)
            .unwrap_err()
            .contains("negative"));
        assert!(target(Some("yesterday"), None, now)
            .unwrap_err()
            .starts_with("to: "));
    }
}
