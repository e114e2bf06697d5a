//! What to claim, decided apart from doing it: a pure planner over the listed ownerships,
//! this replica's id and its handover requests, the live replicas and the time (as the
//! Azure SDK keeps `load_balancer.rs` apart from its checkpoint store). The fenced store
//! (see [`checkpoint`](super::super::checkpoint)) asks it once per cycle and only does
//! what it says: claims, asks, reads a request it is told to.
//!
//! A cycle's claims go through three gates, in order:
//! - the [`Gate`]: a replica that is stopping only renews what it still finishes; one that
//!   does not hold its owner id (see [`owner`](super::owner)) claims nothing;
//! - the [`sort`]: each wanted claim is a renewal of this replica's own (claimed), a
//!   partition a live replica owns (asked for, see [`handover`](super::handover)), or an
//!   unowned or expired one;
//! - the [`Sorted::plan`]: unowned partitions only up to this replica's share among the
//!   live replicas, one request per partition it would steal (pending ones count), and a
//!   partition asked for longer than the expiration ago taken unless its owner answered.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use azure_messaging_eventhubs::models::Ownership;

/// What a cycle may claim, by the replica's own condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pipeline) enum Gate {
    /// A graceful stop is under way: renew only the partitions a task still finishes,
    /// hidden from the processor; claim nothing new.
    RenewFinishing,
    /// Another live process uses this owner id: claim (and renew) nothing, and drop every
    /// claim, so the processor revokes what it still reads.
    Nothing,
    /// Claim: the store's readable partitions, as [`sort`] and [`Sorted::plan`] decide.
    Claim,
}

impl Gate {
    /// The gate of a replica that is `stopping` or not, and holds its owner id or not.
    pub(in crate::pipeline) fn of(stopping: bool, holds_owner_id: bool) -> Self {
        if stopping {
            Self::RenewFinishing
        } else if !holds_owner_id {
            Self::Nothing
        } else {
            Self::Claim
        }
    }
}

/// This replica's memory of the handover requests of one partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(in crate::pipeline) struct Requests {
    /// Its own request: the owner it asked, and how long ago.
    pub(in crate::pipeline) mine: Option<(String, Duration)>,
    /// Another asker's request seen here: its ETag, and how long it has been unchanged.
    pub(in crate::pipeline) theirs: Option<(String, Duration)>,
}

/// What the planner reads: one cycle's listing and this replica's view of it.
#[derive(Debug, Clone)]
pub(in crate::pipeline) struct View {
    /// This replica's owner id.
    pub(in crate::pipeline) me: String,
    /// The ownerships as the cycle listed them.
    pub(in crate::pipeline) listed: Vec<Ownership>,
    /// The hub's partitions, as known (0 until known).
    pub(in crate::pipeline) hub_partitions: usize,
    /// The service's time now: an ownership last modified longer than `expiration` before
    /// it has expired (as the processor's load balancing judges it).
    pub(in crate::pipeline) now: time::OffsetDateTime,
    /// The ownership expiration.
    pub(in crate::pipeline) expiration: Duration,
    /// partition → this replica's memory of its handover requests.
    pub(in crate::pipeline) requests: HashMap<String, Requests>,
}

impl View {
    /// The listing by partition (a partition listed twice: the last one).
    fn by_partition(&self) -> HashMap<&str, &Ownership> {
        self.listed
            .iter()
            .map(|o| (o.partition_id.as_str(), o))
            .collect()
    }

    /// The owner of `o` if it is another replica whose ownership has not expired.
    pub(in crate::pipeline) fn live_other(&self, o: &Ownership) -> Option<String> {
        let owner = o.owner_id.as_deref().filter(|id| !id.is_empty())?;
        if owner == self.me {
            return None;
        }
        if o.last_modified_time
            .is_some_and(|t| t + self.expiration < self.now)
        {
            return None;
        }
        Some(owner.to_string())
    }

    fn mine(&self, o: &Ownership) -> bool {
        o.owner_id.as_deref() == Some(self.me.as_str())
    }
}

/// The wanted claims, sorted by the listing (see [`sort`]).
#[derive(Debug, Clone)]
pub(in crate::pipeline) struct Sorted {
    /// Renewals of this replica's own.
    pass: Vec<Ownership>,
    /// Partitions a live replica owns, with that owner.
    steals: Vec<(Ownership, String)>,
    /// Unowned or expired partitions.
    fresh: Vec<Ownership>,
    /// The hub's partitions (as known, or as listed).
    partitions: usize,
    /// The partitions this replica owns in the listing.
    mine: usize,
}

/// Sorts `wanted` by the listing: renewals of this replica's own, partitions a live
/// replica owns, and the rest.
pub(in crate::pipeline) fn sort(view: &View, wanted: Vec<Ownership>) -> Sorted {
    let listing = view.by_partition();
    let (mut pass, mut steals, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
    for o in wanted {
        let listed = listing.get(o.partition_id.as_str());
        match listed.and_then(|l| view.live_other(l)) {
            Some(owner) => steals.push((o, owner)),
            None if listed.is_some_and(|l| view.mine(l)) => pass.push(o),
            None => fresh.push(o),
        }
    }
    Sorted {
        pass,
        steals,
        fresh,
        partitions: view.hub_partitions.max(listing.len()),
        mine: listing.values().filter(|o| view.mine(o)).count(),
    }
}

/// What to do about a partition a live replica owns.
#[derive(Debug, Clone)]
pub(in crate::pipeline) enum Steal {
    /// Ask `owner` to hand `partition` over; `stale` is another asker's request seen
    /// unchanged for the expiration (its asker is gone), to replace.
    Ask {
        /// The partition.
        partition: String,
        /// Its live owner.
        owner: String,
        /// The ETag of a stale request of another asker.
        stale: Option<String>,
    },
    /// Asked for longer than the expiration ago: claim it unless `owner` answered and is
    /// finishing (its request reads [`Stage::Releasing`](super::handover::Stage)).
    Overdue {
        /// The claim to put to the store.
        ownership: Ownership,
        /// The owner asked.
        owner: String,
    },
}

/// Unowned partitions wanted beyond this replica's share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pipeline) struct ShareCut {
    /// How many were wanted.
    pub(in crate::pipeline) wanted: usize,
    /// How many fit in the share (those claimed).
    pub(in crate::pipeline) room: usize,
}

/// A cycle's plan.
#[derive(Debug, Clone)]
pub(in crate::pipeline) struct Plan {
    /// Claims to put to the store: renewals, and unowned partitions within the share.
    pub(in crate::pipeline) claim: Vec<Ownership>,
    /// Unowned partitions wanted beyond this replica's share (not claimed), if any.
    pub(in crate::pipeline) cut: Option<ShareCut>,
    /// Partitions live replicas own, in the order wanted: asks, and overdue requests.
    pub(in crate::pipeline) steals: Vec<Steal>,
}

impl Sorted {
    /// Whether the plan needs the count of live replicas (unowned partitions are wanted).
    pub(in crate::pipeline) fn needs_share(&self) -> bool {
        !self.fresh.is_empty() && self.partitions > 0
    }

    /// The plan, `live` being how many replicas renewed their owner records within the
    /// expiration (if known).
    pub(in crate::pipeline) fn plan(self, view: &View, live: Option<usize>) -> Plan {
        let Sorted {
            mut pass,
            steals,
            mut fresh,
            partitions,
            mine,
        } = self;
        let mut cut = None;
        if !fresh.is_empty() && partitions > 0 {
            let room = share(view, partitions, live).saturating_sub(mine);
            if fresh.len() > room {
                cut = Some(ShareCut {
                    wanted: fresh.len(),
                    room,
                });
                fresh.truncate(room);
            }
        }
        pass.extend(fresh);
        Plan {
            claim: pass,
            cut,
            steals: plan_steals(view, steals),
        }
    }
}

/// This replica's share of `partitions`: divided among the live replicas (the live owners
/// listed and this one, or `live` if more), rounded up.
fn share(view: &View, partitions: usize, live: Option<usize>) -> usize {
    let mut owners: HashSet<String> = HashSet::from([view.me.clone()]);
    owners.extend(
        view.by_partition()
            .values()
            .filter_map(|o| view.live_other(o)),
    );
    let n = owners.len().max(live.unwrap_or(0));
    partitions.div_ceil(n.max(1))
}

/// One request per partition this cycle would steal (those still pending with a live
/// owner count against it, as the processor picks the partitions to steal at random each
/// cycle); an old request whose owner did not answer is overdue.
fn plan_steals(view: &View, steals: Vec<(Ownership, String)>) -> Vec<Steal> {
    if steals.is_empty() {
        return Vec::new();
    }
    let listing = view.by_partition();
    let pending = view
        .requests
        .iter()
        .filter_map(|(p, r)| Some((p, r.mine.as_ref()?)))
        .filter(|(p, (owner, _))| {
            listing
                .get(p.as_str())
                .and_then(|l| view.live_other(l))
                .is_some_and(|o| &o == owner)
        })
        .count();
    let mut budget = steals.len().saturating_sub(pending);
    let mut out = Vec::new();
    for (ownership, owner) in steals {
        let requests = view.requests.get(&ownership.partition_id);
        let asked = requests
            .and_then(|r| r.mine.as_ref())
            .filter(|(to, _)| *to == owner)
            .map(|(_, age)| *age);
        if let Some(age) = asked {
            if age >= view.expiration {
                out.push(Steal::Overdue { ownership, owner });
            }
            continue;
        }
        if budget == 0 {
            continue;
        }
        budget -= 1;
        let stale = requests
            .and_then(|r| r.theirs.as_ref())
            .filter(|(_, age)| *age >= view.expiration)
            .map(|(etag, _)| etag.clone());
        out.push(Steal::Ask {
            partition: ownership.partition_id,
            owner,
            stale,
        });
    }
    out
}

/// Whether an overdue request's owner answered and is finishing: the request, as read now,
/// is `asker`'s to `owner` and reads `Releasing` (then the asker waits instead of taking).
pub(in crate::pipeline) fn owner_is_finishing(
    request: Option<&super::handover::Request>,
    asker: &str,
    owner: &str,
) -> bool {
    request.is_some_and(|r| {
        r.asker == asker && r.owner == owner && r.stage == super::handover::Stage::Releasing
    })
}

#[cfg(test)]
mod tests;
