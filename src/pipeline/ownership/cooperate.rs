//! The replica's half of the cooperative handover, as calls on the handover records within
//! a deadline: asking an owner, checking an overdue request, answering the requests
//! addressed to this replica. What to ask for is the [`plan`](super::plan)'s; what the
//! answers change is the fenced store's.

use std::time::Duration;

use super::handover::{Asked, Handovers, Request};

/// Asks `owner` to hand `partition` over (or learns that another replica asked first),
/// replacing another asker's `stale` request; `None` if the request could not be written
/// (the partition is not claimed this cycle).
pub(in crate::pipeline) async fn ask(
    h: &Handovers,
    partition: &str,
    owner: &str,
    stale: Option<&str>,
    deadline: Duration,
) -> Option<Asked> {
    match tokio::time::timeout(deadline * 2, h.ask(partition, owner, stale)).await {
        Ok(Ok(asked)) => {
            match &asked {
                Asked::Mine => {
                    tracing::info!(
                        partition,
                        owner,
                        "asked the owner to hand the partition over"
                    )
                }
                Asked::Theirs(_) => {
                    tracing::debug!(partition, "another replica asked for this partition first")
                }
            }
            Some(asked)
        }
        Ok(Err(e)) => {
            tracing::warn!(partition, error = %e, "could not ask for a handover; not claiming the partition this cycle");
            None
        }
        Err(_) => {
            tracing::warn!(
                partition,
                "asking for a handover timed out; not claiming the partition this cycle"
            );
            None
        }
    }
}

/// Whether the owner of this replica's overdue request for `partition` answered and is
/// finishing what it holds (then this replica waits for it); a request that cannot be read
/// within `deadline` counts as unanswered.
pub(in crate::pipeline) async fn owner_finishing(
    h: &Handovers,
    partition: &str,
    owner: &str,
    deadline: Duration,
) -> bool {
    match tokio::time::timeout(deadline, h.read(partition)).await {
        Ok(Ok(read)) => {
            super::plan::owner_is_finishing(read.map(|(r, _)| r).as_ref(), h.me(), owner)
        }
        _ => false,
    }
}

/// The owner's half, once per cycle: the requests addressed to this replica for the
/// partitions it `held` are acknowledged, each then passed to `answered` (which stops the
/// partition's reading and promises it to the asker).
pub(in crate::pipeline) async fn answer(
    h: &Handovers,
    held: &[String],
    deadline: Duration,
    mut answered: impl FnMut(Request),
) {
    let requests = match tokio::time::timeout(deadline * 2, h.addressed_to_me(held)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "handover requests not read this cycle");
            return;
        }
        Err(_) => {
            tracing::debug!("reading the handover requests timed out this cycle");
            return;
        }
    };
    for (r, etag) in requests {
        tracing::info!(partition = %r.partition, to = %r.asker, "asked for a partition: stop reading it, finish what is in flight, checkpoint, hand it over");
        if let Err(e) = h.acknowledge(&r, &etag).await {
            tracing::debug!(partition = %r.partition, error = %e, "handover request not acknowledged");
        }
        answered(r);
    }
}
