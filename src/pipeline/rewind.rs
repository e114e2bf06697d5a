//! An operator's rewind of the consumer group's checkpoints (`hubguard checkpoints rewind`):
//! "re-process everything since 10:00 after the bad deploy".
//!
//! Checkpoints are written in the official layout (`{namespace}/{hub}/{consumer
//! group}/checkpoint/{partition}`, metadata `sequencenumber` and `offset`), so other
//! processors and KEDA's scaler read the rewound position too. A checkpoint is exclusive: a
//! processor resumes *after* the event it names. So to deliver again from sequence number
//! `first`, the checkpoint names `first - 1` with that event's offset; when `first` is the
//! oldest event the hub still retains, the offset is `-1`, the start of the retained stream
//! (the `x-opt-offset > '-1'` filter every SDK sends for "earliest").
//!
//! A checkpoint an owner keeps writing cannot be moved back from outside: the owner would
//! write over the rewind within seconds. So a rewind of a partition a live replica owns is
//! refused unless the partition is paused (`hubguard partitions pause`), and it is applied by
//! the owner itself: the command writes the request into the control record (see
//! [`control`](super::control)); the owner, which reads it within seconds, stops reading,
//! lets what it read settle (delivered, scheduled for retry or dead-lettered, as always),
//! writes the rewind's checkpoint instead of a final one, marks the request applied and gives
//! the partition back, so the processor hands it out again from the rewound position. A
//! partition no replica owns is rewound by the command, under a claim of its ownership (so no
//! replica claims it in between), released right after. Events delivered again are ordinary
//! deliveries: the ledger's records keep attempt counts for the keys it knows.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use azure_messaging_eventhubs::models::Ownership;
use azure_messaging_eventhubs::{CheckpointStore, ConsumerClient, StartLocation};
use serde::Serialize;

use super::control::{self, Pauses, Rewind};
use super::EventHubsTarget;
use crate::azure::RecordStore;

/// Where to rewind to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RewindTo {
    /// Deliver again every event enqueued at or after this time.
    Time(SystemTime),
    /// Deliver again from this sequence number.
    Sequence(i64),
}

impl std::fmt::Display for RewindTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Time(t) => write!(f, "--to {}", crate::clock::rfc3339(*t)),
            Self::Sequence(n) => write!(f, "--sequence {n}"),
        }
    }
}

/// What a partition's rewind came to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Outcome {
    /// `--dry-run`: what would be done.
    WouldRewind,
    /// Applied, by a replica (its owner id) or by the command.
    Applied {
        /// Who applied it.
        by: String,
    },
    /// Written into the control record; its owner applies it once what it read settles.
    Waiting {
        /// The owner that will apply it.
        owner: Option<String>,
    },
    /// Nothing to do.
    Nothing {
        /// Why.
        why: String,
    },
    /// Refused: nothing was written for any partition.
    Refused {
        /// Why.
        why: String,
    },
}

/// One partition's line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionRewind {
    /// The partition.
    pub partition: String,
    /// The checkpoint's sequence number before (none: no checkpoint yet).
    pub checkpoint_before: Option<i64>,
    /// The first sequence number delivered again.
    pub first: Option<i64>,
    /// The sequence number asked for, when it was older than the hub retains.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clamped_from: Option<i64>,
    /// How many events are delivered again (when the checkpoint was known).
    pub events_again: Option<i64>,
    /// What came of it.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// A partition's retained range, as Event Hubs reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retained {
    /// The oldest retained sequence number.
    pub begin: i64,
    /// The last enqueued sequence number.
    pub last: i64,
    /// Nothing is retained.
    pub empty: bool,
}

/// The first event to deliver again, decided from what is retained and the checkpoint:
/// `Ok((first, clamped_from))`, or `Err(why there is nothing to do)`. Sequence numbers
/// beyond the last event are refused by the caller before this.
pub fn plan(
    first: i64,
    retained: Retained,
    checkpoint: Option<i64>,
) -> Result<(i64, Option<i64>), NothingToDo> {
    if retained.empty {
        return Err(NothingToDo::NoEvents);
    }
    let (first, clamped_from) = if first < retained.begin {
        (retained.begin, Some(first))
    } else {
        (first, None)
    };
    match checkpoint {
        Some(c) if first == c + 1 => Err(NothingToDo::AlreadyThere {
            checkpoint: c,
            first,
        }),
        Some(c) if first > c + 1 => Err(NothingToDo::Forward {
            checkpoint: c,
            first,
        }),
        _ => Ok((first, clamped_from)),
    }
}

/// The namespace as the SDK's processor names checkpoints: the host of `amqps://{namespace}`.
pub fn checkpoint_namespace(namespace: &str) -> String {
    url::Url::parse(&format!("amqps://{namespace}/"))
        .ok()
        .and_then(|u| u.host_str().map(str::to_string))
        .unwrap_or_else(|| namespace.to_string())
}

/// What the rewind needs.
pub struct RewindJob {
    /// The hub and consumer group.
    pub target: EventHubsTarget,
    /// The checkpoint store (official layout; not the replicas' fenced one).
    pub checkpoints: Arc<dyn CheckpointStore + Send + Sync>,
    /// The container's record store (the control record).
    pub records: Arc<dyn RecordStore>,
    /// The ownership expiration: an ownership renewed within it is live.
    pub expiration: Duration,
    /// Each call's deadline.
    pub deadline: Duration,
    /// Where to.
    pub to: RewindTo,
    /// Only these partitions (none: all).
    pub partitions: Vec<String>,
    /// Who asks.
    pub by: String,
    /// Decide, write nothing.
    pub dry_run: bool,
    /// How long to wait for owners to apply it.
    pub wait: Duration,
}

fn live(o: &Ownership, expiration: Duration, now: SystemTime) -> bool {
    o.owner_id.as_deref().is_some_and(|id| !id.is_empty())
        && o.last_modified_time.is_some_and(|t| {
            now.duration_since(SystemTime::from(t)).unwrap_or_default() < expiration
        })
}

async fn timed<T, E: std::fmt::Display>(
    deadline: Duration,
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    tokio::time::timeout(deadline, f)
        .await
        .map_err(|_| format!("{what} timed out after {deadline:?}"))?
        .map_err(|e| format!("{what}: {e}"))
}

/// The first event of `partition` at `location` (inclusive): its sequence number and offset
/// (read as the read-back of a retry's event reads, owner level 0 when a replica holds it).
async fn first_event(
    consumer: &ConsumerClient,
    partition: &str,
    location: StartLocation,
    deadline: Duration,
) -> Result<(i64, String), String> {
    let e = super::readback::first_event_at(consumer, partition, location, deadline)
        .await
        .map_err(|e| format!("reading partition {partition}: {e}"))?;
    let seq = e
        .sequence_number()
        .ok_or("the event carries no sequence number")?;
    let offset = e.offset().clone().ok_or("the event carries no offset")?;
    Ok((seq, offset))
}

/// Why a partition's rewind has nothing to do ([`plan`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NothingToDo {
    /// The partition retains no events.
    #[error("the partition retains no events")]
    NoEvents,
    /// The checkpoint is where the rewind would put it.
    #[error("the checkpoint is already at {checkpoint}: the next event read is {first}")]
    AlreadyThere {
        /// The checkpoint's sequence number.
        checkpoint: i64,
        /// The first event to deliver again.
        first: i64,
    },
    /// The rewind would move the checkpoint forward.
    #[error("the checkpoint is at {checkpoint}, before {first}: a rewind never moves a checkpoint forward")]
    Forward {
        /// The checkpoint's sequence number.
        checkpoint: i64,
        /// The first event asked for.
        first: i64,
    },
}

/// Why a rewind stopped (the message says what it was doing: reading a partition, waiting
/// for an owner, writing the record or a checkpoint).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RewindError(String);

impl From<String> for RewindError {
    fn from(message: String) -> Self {
        Self(message)
    }
}

/// Runs the rewind; `progress` hears what it waits for.
pub async fn rewind(
    job: &RewindJob,
    mut progress: impl FnMut(&str),
) -> Result<Vec<PartitionRewind>, RewindError> {
    let t = &job.target;
    let namespace = checkpoint_namespace(&t.namespace);
    let name = control::record_name(&t.hub, &t.consumer_group);
    let mut builder = ConsumerClient::builder()
        .with_application_id(format!("hubguard-rewind-{}", std::process::id()))
        .with_consumer_group(t.consumer_group.clone());
    if let Some(e) = &t.custom_endpoint {
        builder = builder.with_custom_endpoint(e.clone());
    }
    let consumer = timed(
        job.deadline,
        "opening the Event Hubs consumer",
        t.auth.open_consumer(builder, &t.namespace, &t.hub),
    )
    .await?;
    let result = plan_and_apply(job, &consumer, &namespace, &name, &mut progress).await;
    let _ = tokio::time::timeout(job.deadline, consumer.close()).await;
    Ok(result?)
}

async fn plan_and_apply(
    job: &RewindJob,
    consumer: &ConsumerClient,
    namespace: &str,
    name: &str,
    progress: &mut impl FnMut(&str),
) -> Result<Vec<PartitionRewind>, String> {
    let t = &job.target;
    let hub = timed(
        job.deadline,
        "reading the hub's properties",
        consumer.get_eventhub_properties(),
    )
    .await?;
    let partitions = selected(job, &hub.partition_ids)?;
    let control_now = control::current(job.records.as_ref(), name)
        .await
        .map_err(|e| e.to_string())?;
    let owners = list_owners(job, namespace).await?;
    let checkpoints: BTreeMap<String, Option<i64>> = timed(
        job.deadline,
        "listing the checkpoints",
        job.checkpoints
            .list_checkpoints(namespace, &t.hub, &t.consumer_group),
    )
    .await?
    .into_iter()
    .map(|c| (c.partition_id, c.sequence_number))
    .collect();
    let now = SystemTime::now();
    // Refused as a whole while a live replica reads any of them.
    let refusals = refusals(job, &partitions, &owners, &control_now, &checkpoints, now);
    if !refusals.is_empty() {
        return Ok(refusals);
    }
    let mut report = Vec::new();
    let mut requests: BTreeMap<String, Rewind> = BTreeMap::new();
    let since_ms = crate::clock::ms(now);
    for p in &partitions {
        let before = checkpoints.get(p).copied().flatten();
        let (line, request) = plan_partition(job, consumer, p, before, since_ms).await?;
        if let Some(request) = request {
            requests.insert(p.clone(), request);
        }
        report.push(line);
    }
    if job.dry_run || requests.is_empty() {
        return Ok(report);
    }
    control::change(job.records.as_ref(), name, |now: &Pauses| {
        let mut next = now.clone();
        next.rewinds.extend(requests.clone());
        Some(next)
    })
    .await
    .map_err(|e| e.to_string())?;
    wait_applied(job, namespace, name, &requests, report, progress).await
}

/// The partitions the job names (all of the hub's when it names none), in the hub's order;
/// an error for one the hub does not have.
fn selected(job: &RewindJob, partition_ids: &[String]) -> Result<Vec<String>, String> {
    for p in &job.partitions {
        if !partition_ids.contains(p) {
            return Err(format!(
                "the hub {} has no partition {p} (it has {})",
                job.target.hub,
                partition_ids.join(", ")
            ));
        }
    }
    Ok(if job.partitions.is_empty() {
        partition_ids.to_vec()
    } else {
        partition_ids
            .iter()
            .filter(|p| job.partitions.contains(p))
            .cloned()
            .collect()
    })
}

/// The partitions a live replica reads without the operator's pause: the rewind is refused
/// for them.
fn refusals(
    job: &RewindJob,
    partitions: &[String],
    owners: &BTreeMap<String, Ownership>,
    control_now: &Pauses,
    checkpoints: &BTreeMap<String, Option<i64>>,
    now: SystemTime,
) -> Vec<PartitionRewind> {
    partitions
        .iter()
        .filter_map(|p| {
            let o = owners.get(p).filter(|o| live(o, job.expiration, now))?;
            control_now.of(p).is_none().then(|| PartitionRewind {
                partition: p.clone(),
                checkpoint_before: checkpoints.get(p).copied().flatten(),
                first: None,
                clamped_from: None,
                events_again: None,
                outcome: Outcome::Refused {
                    why: format!(
                        "owned by {} and not paused: run `hubguard partitions pause --partition {p}` first",
                        o.owner_id.as_deref().unwrap_or_default()
                    ),
                },
            })
        })
        .collect()
}

/// Plans partition `p`'s rewind from its checkpoint `before`: its report line, and the
/// request to write (`None` when there is nothing to rewind).
async fn plan_partition(
    job: &RewindJob,
    consumer: &ConsumerClient,
    p: &String,
    before: Option<i64>,
    since_ms: i64,
) -> Result<(PartitionRewind, Option<Rewind>), String> {
    let props = timed(
        job.deadline,
        &format!("reading partition {p}'s properties"),
        consumer.get_partition_properties(p),
    )
    .await?;
    let retained = Retained {
        begin: props.beginning_sequence_number,
        last: props.last_enqueued_sequence_number,
        empty: props.is_empty,
    };
    let mut line = PartitionRewind {
        partition: p.clone(),
        checkpoint_before: before,
        first: None,
        clamped_from: None,
        events_again: None,
        outcome: Outcome::WouldRewind,
    };
    let asked_first = match job.to {
        RewindTo::Sequence(n) if !retained.empty && n > retained.last + 1 => {
            return Err(format!(
                "partition {p}'s last event is {}; --sequence {n} is beyond it",
                retained.last
            ));
        }
        RewindTo::Sequence(n) => n,
        RewindTo::Time(_) if retained.empty => retained.last + 1,
        RewindTo::Time(when) => {
            if props.last_enqueued_time_utc.is_some_and(|l| l < when) {
                retained.last + 1
            } else {
                first_event(consumer, p, StartLocation::EnqueuedTime(when), job.deadline)
                    .await?
                    .0
            }
        }
    };
    let (first, clamped_from) = match plan(asked_first, retained, before) {
        Ok(x) => x,
        Err(why) => {
            line.outcome = Outcome::Nothing {
                why: why.to_string(),
            };
            return Ok((line, None));
        }
    };
    let offset = if first == retained.begin {
        "-1".to_string()
    } else if first == retained.last + 1 {
        props.last_enqueued_offset.clone()
    } else {
        let (seq, offset) = first_event(
            consumer,
            p,
            StartLocation::SequenceNumber(first - 1),
            job.deadline,
        )
        .await?;
        if seq != first - 1 {
            return Err(format!(
                "partition {p}: asked for event {} and Event Hubs gave {seq} (retention moved on meanwhile?); try again",
                first - 1
            ));
        }
        offset
    };
    line.first = Some(first);
    line.clamped_from = clamped_from;
    line.events_again = before.map(|c| c - first + 1);
    let request = Rewind {
        id: format!("{since_ms:x}-{}-{p}", std::process::id()),
        sequence_number: first - 1,
        offset,
        first,
        asked: job.to.to_string(),
        by: job.by.clone(),
        since_ms,
        applied: None,
    };
    Ok((line, Some(request)))
}

/// Follows the written `requests` until each is applied (by its partition's owner, or by the
/// command for a partition nobody owns), replaced, or `job.wait` has passed.
async fn wait_applied(
    job: &RewindJob,
    namespace: &str,
    name: &str,
    requests: &BTreeMap<String, Rewind>,
    mut report: Vec<PartitionRewind>,
    progress: &mut impl FnMut(&str),
) -> Result<Vec<PartitionRewind>, String> {
    let until = tokio::time::Instant::now() + job.wait;
    let mut told: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let control_now = control::current(job.records.as_ref(), name)
            .await
            .map_err(|e| e.to_string())?;
        let owners = list_owners(job, namespace).await?;
        let now = SystemTime::now();
        let mut waiting = 0;
        for line in report.iter_mut() {
            let Some(asked) = requests.get(&line.partition) else {
                continue;
            };
            let current = control_now.rewinds.get(&line.partition);
            match current {
                Some(r) if r.id == asked.id => {
                    if let Some(a) = &r.applied {
                        line.outcome = Outcome::Applied { by: a.by.clone() };
                        continue;
                    }
                }
                _ => {
                    line.outcome = Outcome::Nothing {
                        why: "a newer rewind of this partition replaced this one".into(),
                    };
                    continue;
                }
            }
            let owner = owners
                .get(&line.partition)
                .filter(|o| live(o, job.expiration, now));
            match owner {
                Some(o) => {
                    let id = o.owner_id.clone().unwrap_or_default();
                    if told.get(&line.partition) != Some(&id) {
                        progress(&format!(
                            "partition {}: waiting for its owner {id} to settle what it read and apply the rewind",
                            line.partition
                        ));
                        told.insert(line.partition.clone(), id.clone());
                    }
                    line.outcome = Outcome::Waiting { owner: Some(id) };
                    waiting += 1;
                }
                None => {
                    match apply_unowned(
                        job,
                        namespace,
                        name,
                        &line.partition,
                        asked,
                        owners.get(&line.partition),
                    )
                    .await
                    {
                        Ok(true) => {
                            line.outcome = Outcome::Applied {
                                by: APPLIED_BY_COMMAND.into(),
                            }
                        }
                        Ok(false) => {
                            line.outcome = Outcome::Waiting { owner: None };
                            waiting += 1;
                        }
                        Err(e) => {
                            progress(&format!("partition {}: {e}; trying again", line.partition));
                            line.outcome = Outcome::Waiting { owner: None };
                            waiting += 1;
                        }
                    }
                }
            }
        }
        if waiting == 0 || tokio::time::Instant::now() >= until {
            return Ok(report);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Who a rewind applied by the command itself is recorded as.
pub const APPLIED_BY_COMMAND: &str = "hubguard checkpoints rewind";

async fn list_owners(
    job: &RewindJob,
    namespace: &str,
) -> Result<BTreeMap<String, Ownership>, String> {
    let t = &job.target;
    Ok(timed(
        job.deadline,
        "listing the ownerships",
        job.checkpoints
            .list_ownerships(namespace, &t.hub, &t.consumer_group),
    )
    .await?
    .into_iter()
    .map(|o| (o.partition_id.clone(), o))
    .collect())
}

/// Rewinds a partition no replica owns: claims its ownership (so no replica claims it in
/// between), writes the checkpoint, marks the request applied, releases the ownership.
/// `Ok(false)`: another claim came first; try again.
async fn apply_unowned(
    job: &RewindJob,
    namespace: &str,
    name: &str,
    partition: &str,
    rewind: &Rewind,
    listed: Option<&Ownership>,
) -> Result<bool, String> {
    let t = &job.target;
    let mine = Ownership {
        fully_qualified_namespace: namespace.into(),
        event_hub_name: t.hub.clone(),
        consumer_group: t.consumer_group.clone(),
        partition_id: partition.into(),
        owner_id: Some(format!("hubguard-rewind-{}", rewind.id)),
        etag: listed.and_then(|o| o.etag.clone()),
        last_modified_time: None,
    };
    let claimed = timed(
        job.deadline,
        "claiming the partition's ownership",
        job.checkpoints.claim_ownership(std::slice::from_ref(&mine)),
    )
    .await?;
    let Some(held) = claimed.into_iter().next() else {
        return Ok(false);
    };
    let written = async {
        timed(
            job.deadline,
            "writing the checkpoint",
            job.checkpoints.update_checkpoint(rewind.checkpoint(
                namespace,
                &t.hub,
                &t.consumer_group,
                partition,
            )),
        )
        .await?;
        control::mark_applied(
            job.records.as_ref(),
            name,
            partition,
            &rewind.id,
            APPLIED_BY_COMMAND,
        )
        .await
        .map_err(|e| e.to_string())
    }
    .await;
    // Released whatever happened: an empty owner id, as the official stores release.
    let released = Ownership {
        owner_id: Some(String::new()),
        ..held
    };
    if let Err(e) = timed(
        job.deadline,
        "releasing the partition's ownership",
        job.checkpoints
            .claim_ownership(std::slice::from_ref(&released)),
    )
    .await
    {
        tracing::warn!(partition, error = %e, "the rewind's claim of the ownership was not released; it expires on its own");
    }
    written.map(|()| true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Retained = Retained {
        begin: 10,
        last: 99,
        empty: false,
    };

    #[test]
    fn a_rewind_delivers_again_from_first_and_never_moves_a_checkpoint_forward() {
        assert_eq!(plan(50, R, Some(80)), Ok((50, None)));
        assert_eq!(plan(50, R, None), Ok((50, None)));
        assert!(plan(81, R, Some(80))
            .unwrap_err()
            .to_string()
            .contains("already at 80"));
        assert!(plan(90, R, Some(80))
            .unwrap_err()
            .to_string()
            .contains("never moves"));
    }

    #[test]
    fn a_rewind_past_retention_starts_at_the_oldest_retained_event_and_says_so() {
        assert_eq!(plan(0, R, Some(80)), Ok((10, Some(0))));
        assert_eq!(plan(-5, R, Some(80)), Ok((10, Some(-5))));
    }

    #[test]
    fn an_empty_partition_has_nothing_to_rewind() {
        let empty = Retained {
            begin: 0,
            last: -1,
            empty: true,
        };
        assert!(plan(0, empty, None).is_err());
    }

    #[test]
    fn the_checkpoint_namespace_is_the_host_the_sdk_names_it_by() {
        assert_eq!(
            checkpoint_namespace("ns.servicebus.windows.net"),
            "ns.servicebus.windows.net"
        );
        assert_eq!(checkpoint_namespace("127.0.0.1:5672"), "127.0.0.1");
        assert_eq!(checkpoint_namespace("localhost"), "localhost");
    }
}
