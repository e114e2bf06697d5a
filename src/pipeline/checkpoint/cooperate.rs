//! The replica's half of the cooperative handover: which wanted claims go to the store,
//! which partitions are asked for instead, and the requests this replica answers.

use std::collections::HashSet;

use azure_messaging_eventhubs::models::Ownership;
use tokio::time::Instant;

use super::super::handover::{Asked, Handovers, Stage};
use super::FencedCheckpointStore;

impl FencedCheckpointStore {
    /// The owner of `o` if it is another replica whose ownership has not expired (as the
    /// processor's load balancing judges it: last modified within the expiration).
    fn live_other(&self, o: &Ownership, now: time::OffsetDateTime) -> Option<String> {
        let owner = o.owner_id.as_deref().filter(|id| !id.is_empty())?;
        if owner == self.owner_id {
            return None;
        }
        if o.last_modified_time
            .is_some_and(|t| t + self.expiration < now)
        {
            return None;
        }
        Some(owner.to_string())
    }

    /// This replica's share of unowned partitions: all of them divided among the live
    /// replicas (those in the listing, and those whose owner records were renewed within
    /// the expiration, which every replica writes before its first claim), rounded up.
    async fn share(&self, namespace_partitions: usize) -> usize {
        let mut owners: HashSet<String> = HashSet::from([self.owner_id.clone()]);
        let now = time::OffsetDateTime::now_utc();
        {
            let st = self.state();
            for o in st.listing.values() {
                if let Some(id) = self.live_other(o, now) {
                    owners.insert(id);
                }
            }
        }
        let mut n = owners.len();
        if let Some(lease) = &self.lease {
            if let Ok(Ok(live)) =
                tokio::time::timeout(self.deadline, lease.live_instances(self.expiration)).await
            {
                n = n.max(live);
            }
        }
        namespace_partitions.div_ceil(n.max(1))
    }

    /// Decides, for this replica's wanted claims, which go to the store: renewals and
    /// unowned or expired partitions (within this replica's share) do; a partition a live
    /// replica owns is asked for instead, and taken only if its owner does not answer
    /// within the ownership expiration.
    pub(super) async fn cooperate(&self, wanted: Vec<Ownership>) -> Vec<Ownership> {
        let Some(h) = &self.handovers else {
            return wanted;
        };
        let now = time::OffsetDateTime::now_utc();
        let Sorted {
            mut pass,
            steals,
            fresh,
            partitions,
            mine,
        } = self.sort_wanted(wanted, now);
        let fresh = self.within_share(fresh, partitions, mine).await;
        pass.extend(fresh);
        if steals.is_empty() {
            return pass;
        }
        // Requests still pending count against what this cycle wants (the processor picks
        // the partitions to steal at random each cycle): one request per partition it would
        // steal, not one per cycle.
        let pending = self.pending_requests(now);
        let mut budget = steals.len().saturating_sub(pending);
        for (o, owner) in steals {
            if let Some(o) = self.ask_or_take(h, o, owner, &mut budget).await {
                pass.push(o);
            }
        }
        pass
    }

    /// Sorts the wanted claims by the listing: renewals of this replica's own (`pass`),
    /// partitions a live replica owns (`steals`, with that owner), and the rest (`fresh`).
    fn sort_wanted(&self, wanted: Vec<Ownership>, now: time::OffsetDateTime) -> Sorted {
        let (mut pass, mut steals, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
        let st = self.state();
        for o in wanted {
            let listed = st.listing.get(&o.partition_id);
            match listed.and_then(|l| self.live_other(l, now)) {
                Some(owner) => steals.push((o, owner)),
                None if listed
                    .and_then(|l| l.owner_id.as_deref())
                    .is_some_and(|id| id == self.owner_id) =>
                {
                    pass.push(o)
                }
                None => fresh.push(o),
            }
        }
        let mine = st
            .listing
            .values()
            .filter(|o| o.owner_id.as_deref() == Some(self.owner_id.as_str()))
            .count();
        Sorted {
            pass,
            steals,
            fresh,
            partitions: st.partitions.len().max(st.listing.len()),
            mine,
        }
    }

    /// No more unowned partitions than this replica's share, less the `mine` it holds.
    async fn within_share(
        &self,
        mut fresh: Vec<Ownership>,
        partitions: usize,
        mine: usize,
    ) -> Vec<Ownership> {
        if !fresh.is_empty() && partitions > 0 {
            let room = self.share(partitions).await.saturating_sub(mine);
            if fresh.len() > room {
                tracing::debug!(
                    wanted = fresh.len(),
                    room,
                    "claiming only this replica's share of the unowned partitions"
                );
                fresh.truncate(room);
            }
        }
        fresh
    }

    /// This replica's handover requests still pending with a live owner.
    fn pending_requests(&self, now: time::OffsetDateTime) -> usize {
        let st = self.state();
        st.asking
            .iter()
            .filter(|(p, (owner, _))| {
                st.listing
                    .get(*p)
                    .and_then(|l| self.live_other(l, now))
                    .is_some_and(|o| &o == owner)
            })
            .count()
    }

    /// A partition `owner` holds: taken (returned) if this replica asked for it longer
    /// than the expiration ago and the owner did not answer; otherwise asked for, if
    /// `budget` allows and no request is pending.
    async fn ask_or_take(
        &self,
        h: &Handovers,
        o: Ownership,
        owner: String,
        budget: &mut usize,
    ) -> Option<Ownership> {
        let p = o.partition_id.clone();
        let asked = self
            .state()
            .asking
            .get(&p)
            .filter(|(to, _)| *to == owner)
            .map(|(_, since)| *since);
        if let Some(since) = asked {
            if since.elapsed() < self.expiration {
                return None;
            }
            match tokio::time::timeout(self.deadline, h.read(&p)).await {
                Ok(Ok(Some((r, _))))
                    if r.asker == h.me() && r.owner == owner && r.stage == Stage::Releasing =>
                {
                    // The owner answered and is finishing what it holds: wait for it.
                    return None;
                }
                _ => {
                    tracing::warn!(partition = %p, owner = %owner, "the owner did not answer the handover request within the ownership expiration ({:?}): taking the partition", self.expiration);
                    self.state().asking.remove(&p);
                    return Some(o);
                }
            }
        }
        if *budget == 0 {
            return None;
        }
        *budget -= 1;
        self.ask(h, p, owner).await;
        None
    }

    /// Asks `owner` to hand `p` over (or notes that another replica asked first).
    async fn ask(&self, h: &Handovers, p: String, owner: String) {
        let stale = self
            .state()
            .theirs
            .get(&p)
            .filter(|(_, since)| since.elapsed() >= self.expiration)
            .map(|(etag, _)| etag.clone());
        match tokio::time::timeout(self.deadline * 2, h.ask(&p, &owner, stale.as_deref())).await {
            Ok(Ok(Asked::Mine)) => {
                tracing::info!(partition = %p, owner = %owner, "asked the owner to hand the partition over");
                let mut st = self.state();
                st.asking.insert(p.clone(), (owner, Instant::now()));
                st.theirs.remove(&p);
            }
            Ok(Ok(Asked::Theirs(etag))) => {
                tracing::debug!(partition = %p, "another replica asked for this partition first");
                let mut st = self.state();
                let seen = st
                    .theirs
                    .get(&p)
                    .filter(|(e, _)| *e == etag)
                    .map(|(_, t)| *t);
                st.theirs
                    .insert(p, (etag, seen.unwrap_or_else(Instant::now)));
            }
            Ok(Err(e)) => {
                tracing::warn!(partition = %p, error = %e, "could not ask for a handover; not claiming the partition this cycle")
            }
            Err(_) => {
                tracing::warn!(partition = %p, "asking for a handover timed out; not claiming the partition this cycle")
            }
        }
    }

    /// The owner's half, once per cycle: the requests addressed to this replica for the
    /// partitions it holds are acknowledged, and those partitions are handed over.
    pub(super) async fn answer_requests(&self) {
        let Some(h) = &self.handovers else {
            return;
        };
        let held: Vec<String> = {
            let st = self.state();
            if st.stopping {
                return;
            }
            st.held
                .keys()
                .filter(|p| !st.giving.contains_key(*p))
                .cloned()
                .collect()
        };
        if held.is_empty() {
            return;
        }
        let requests = match tokio::time::timeout(self.deadline * 2, h.addressed_to_me(&held)).await
        {
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
            let mut st = self.state();
            if let Some(stop) = st.reading.get(&r.partition) {
                stop.cancel();
            }
            st.giving.insert(r.partition, r.asker);
        }
    }

    /// Whether this replica holds a fresh claim on `partition` (what the tests check).
    #[cfg(test)]
    pub(in crate::pipeline) fn owns(&self, partition: &str) -> bool {
        self.state()
            .claimed
            .get(partition)
            .is_some_and(|t| t.elapsed() < self.expiration)
    }
}

/// The wanted claims, sorted (see [`FencedCheckpointStore::sort_wanted`]).
struct Sorted {
    pass: Vec<Ownership>,
    steals: Vec<(Ownership, String)>,
    fresh: Vec<Ownership>,
    /// The hub's partitions (as known, or as listed).
    partitions: usize,
    /// The partitions this replica owns in the listing.
    mine: usize,
}
