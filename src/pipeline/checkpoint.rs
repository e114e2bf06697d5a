//! The checkpoint store, fenced: the official
//! checkpoint stores write checkpoints unconditionally (last writer wins) and have no timeouts,
//! and a replica that lost its partition learns it only at its next load-balancing cycle (the
//! owner level 0.16 sends stops it *reading*, not a checkpoint it already holds). This
//! wrapper, behind the SDK's public `CheckpointStore` trait:
//! - puts a deadline on every call;
//! - never moves a partition's checkpoint backwards;
//! - refuses checkpoints for partitions whose ownership this replica has not claimed within
//!   the ownership expiration (stale or lost ownership);
//! - claims nothing while another live process uses the same owner id (see
//!   [`owner`](super::owner)): the SDK would take that process's partitions for its own;
//! - asks a live owner to hand a partition over instead of stealing it, and hands its own
//!   over when asked (see [`handover`](super::handover)); claims no more unowned partitions
//!   at once than its share among the live replicas (so replicas starting together do not
//!   each grab every partition and give most back mid-stream); at a graceful stop, releases
//!   each partition as soon as its final checkpoint is written.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use azure_core::error::ErrorKind;
use azure_messaging_eventhubs::models::{Checkpoint, Ownership};
use azure_messaging_eventhubs::CheckpointStore;
use tokio::time::Instant;

use super::handover::{Asked, Handovers, Stage};

/// A fenced wrapper around another checkpoint store.
pub(super) struct FencedCheckpointStore {
    inner: Arc<dyn CheckpointStore + Send + Sync>,
    owner_id: String,
    deadline: Duration,
    expiration: Duration,
    state: Mutex<FenceState>,
    health: Option<Arc<crate::pipeline::health::Health>>,
    lease: Option<super::owner::OwnerLease>,
    handovers: Option<Handovers>,
    /// Held around claims of this replica's partitions and writes that hand one over, so a
    /// renewal and a handover never race on one ownership's ETag.
    claim_lock: tokio::sync::Mutex<()>,
    rate: Option<Arc<crate::ratelimit::limiter::Limiter>>,
    /// The control record as last read: rewinds applied since this store was made lower
    /// the highest checkpoint it lets through (see [`Self::rewind`]).
    control: Option<tokio::sync::watch::Receiver<super::control::Pauses>>,
    /// When this store was made (ms since the epoch): rewinds applied before it are already
    /// in the checkpoints it lists.
    made_ms: i64,
}

#[derive(Default)]
struct FenceState {
    /// Rewinds (by id) this store has taken into `written`.
    rewinds_seen: HashSet<String>,
    /// partition → when this replica last claimed (or renewed) it.
    claimed: HashMap<String, Instant>,
    /// partition → highest sequence number checkpointed.
    written: HashMap<String, i64>,
    /// partition → the ownership as last claimed (with its ETag), for releasing it.
    held: HashMap<String, Ownership>,
    /// The hub's partitions, once known.
    partitions: Vec<String>,
    /// partition → since when no replica has held a live claim on it.
    unowned_since: HashMap<String, Instant>,
    /// partition → its checkpoint blob, when that holds no usable position.
    poisoned: HashMap<String, String>,
    /// partition → its ownership as the last cycle listed it.
    listing: HashMap<String, Ownership>,
    /// partition → this replica's pending handover request: the owner asked, and since when.
    asking: HashMap<String, (String, Instant)>,
    /// partition → another asker's request seen here: its ETag, unchanged since when.
    theirs: HashMap<String, (String, Instant)>,
    /// partition → the replica this one is handing it over to.
    giving: HashMap<String, String>,
    /// Partitions with a partition task reading them, and what tells that task to stop
    /// reading (and finish what it holds).
    reading: HashMap<String, tokio_util::sync::CancellationToken>,
    /// A graceful stop is under way: claim nothing new.
    stopping: bool,
    /// The namespace the processor names checkpoints with, once it listed them.
    namespace: Option<String>,
}

impl std::fmt::Debug for FencedCheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedCheckpointStore")
            .field("owner_id", &self.owner_id)
            .finish_non_exhaustive()
    }
}

fn fence_error(msg: String) -> azure_core::Error {
    azure_core::Error::with_message(ErrorKind::Other, msg)
}

impl FencedCheckpointStore {
    /// Wraps `inner` for the replica `owner_id`.
    pub(super) fn new(
        inner: Arc<dyn CheckpointStore + Send + Sync>,
        owner_id: String,
        deadline: Duration,
        expiration: Duration,
    ) -> Self {
        Self {
            inner,
            owner_id,
            deadline,
            expiration,
            state: Mutex::default(),
            health: None,
            lease: None,
            handovers: None,
            claim_lock: tokio::sync::Mutex::new(()),
            rate: None,
            control: None,
            made_ms: crate::clock::ms(std::time::SystemTime::now()),
        }
    }

    /// Follows the operator's control record, so a rewind applied by any replica (or by
    /// `hubguard checkpoints rewind`) lowers the checkpoint this store lets through.
    pub(super) fn with_control(
        mut self,
        control: tokio::sync::watch::Receiver<super::control::Pauses>,
    ) -> Self {
        self.control = Some(control);
        self
    }

    /// Takes rewinds applied since this store was made into `written`: a checkpoint is never
    /// moved backwards except by an operator's rewind.
    fn take_rewinds(&self, st: &mut FenceState) {
        let Some(control) = &self.control else {
            return;
        };
        let control = control.borrow();
        for (pid, r) in &control.rewinds {
            let applied_since = r.applied.as_ref().is_some_and(|a| a.at_ms >= self.made_ms);
            if applied_since && st.rewinds_seen.insert(r.id.clone()) {
                st.written.insert(pid.clone(), r.sequence_number);
            }
        }
    }

    /// Whether this replica has already applied (or taken in) the rewind `id`: the control
    /// record it last read may not say so yet.
    pub(super) fn rewind_done(&self, id: &str) -> bool {
        self.state().rewinds_seen.contains(id)
    }

    /// Applies an operator's rewind of `partition`, which this replica owns: writes the
    /// rewind's checkpoint (backwards, the one write that may) after the partition's task has
    /// stopped reading and settled everything it read, so no checkpoint of its own follows.
    pub(super) async fn rewind(
        &self,
        partition: &str,
        rewind: &super::control::Rewind,
    ) -> Result<(), String> {
        let checkpoint = {
            let st = self.state();
            let fresh = st
                .claimed
                .get(partition)
                .is_some_and(|t| t.elapsed() < self.expiration);
            let held = st.held.get(partition).filter(|_| fresh).ok_or_else(|| {
                format!("this replica's ownership of partition {partition} is stale or lost")
            })?;
            rewind.checkpoint(
                &held.fully_qualified_namespace,
                &held.event_hub_name,
                &held.consumer_group,
                partition,
            )
        };
        self.deadline(
            "update_checkpoint (rewind)",
            self.inner.update_checkpoint(checkpoint),
        )
        .await
        .map_err(|e| e.to_string())?;
        let mut st = self.state();
        st.written
            .insert(partition.to_string(), rewind.sequence_number);
        st.rewinds_seen.insert(rewind.id.clone());
        Ok(())
    }

    /// Hands partitions over cooperatively (see [`handover`](super::handover)) through
    /// `handovers`.
    pub(super) fn with_handovers(mut self, handovers: Handovers) -> Self {
        self.handovers = Some(handovers);
        self
    }

    /// Claims partitions only while this process holds its owner id (`lease`, renewed at
    /// every listing of ownerships, that is every load-balancing cycle).
    pub(super) fn with_lease(mut self, lease: super::owner::OwnerLease) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Whether this process may claim partitions (it holds its owner id).
    fn may_claim(&self) -> bool {
        self.lease.as_ref().is_none_or(|l| l.holds())
    }

    /// Tells `rate` this replica's owned partitions at every listing and claim: its share of
    /// the deployment's rate limit.
    pub(super) fn with_rate_limiter(
        mut self,
        rate: Option<Arc<crate::ratelimit::limiter::Limiter>>,
    ) -> Self {
        self.rate = rate;
        self
    }

    /// Reports partitions that no replica owns to `health` (see
    /// [`set_partitions`](Self::set_partitions)).
    pub(super) fn with_health(mut self, health: Arc<crate::pipeline::health::Health>) -> Self {
        self.health = Some(health);
        self
    }

    /// The hub's partitions: each listing of ownerships (every processor cycle) then checks
    /// that each has a live owner. One that has had none for longer than an ownership takes
    /// to expire and be claimed again (twice the expiration) is reported: nothing reads it.
    pub(super) fn set_partitions(&self, partitions: Vec<String>) {
        if let Some(r) = &self.rate {
            r.set_partitions(partitions.len());
        }
        self.state().partitions = partitions;
    }

    fn note_owners(&self, owners: &[Ownership]) {
        let Some(health) = &self.health else {
            return;
        };
        let now = time::OffsetDateTime::now_utc();
        let live: std::collections::HashSet<&str> = owners
            .iter()
            .filter(|o| o.owner_id.as_deref().is_some_and(|id| !id.is_empty()))
            .filter(|o| {
                o.last_modified_time
                    .is_some_and(|t| now - t < self.expiration)
            })
            .map(|o| o.partition_id.as_str())
            .collect();
        let unowned = {
            let mut st = self.state();
            let st = &mut *st;
            let partitions = st.partitions.clone();
            st.unowned_since.retain(|p, _| !live.contains(p.as_str()));
            let mut unowned = Vec::new();
            for p in partitions.iter().filter(|p| !live.contains(p.as_str())) {
                let since = *st
                    .unowned_since
                    .entry(p.clone())
                    .or_insert_with(Instant::now);
                if since.elapsed() > self.expiration * 2 {
                    unowned.push(p.clone());
                }
            }
            unowned
        };
        health.set_unowned(unowned);
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FenceState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn deadline<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = azure_core::Result<T>>,
    ) -> azure_core::Result<T> {
        tokio::time::timeout(self.deadline, f)
            .await
            .unwrap_or_else(|_| {
                Err(fence_error(format!(
                    "checkpoint store: {what} did not answer within {:?}",
                    self.deadline
                )))
            })
    }

    /// Gives up every partition this replica holds (owner id cleared, with the claim's ETag),
    /// so other replicas take them at their next cycle instead of waiting for expiry. Call
    /// after the processor has stopped, at shutdown.
    pub(super) async fn release_all(&self) {
        let held: Vec<Ownership> = {
            let mut st = self.state();
            st.claimed.clear();
            st.giving.clear();
            st.reading.clear();
            st.held.drain().map(|(_, o)| o).collect()
        };
        for o in held {
            self.release(o).await;
        }
        if let Some(lease) = &self.lease {
            lease.release().await;
        }
    }

    async fn release(&self, mut o: Ownership) {
        o.owner_id = None;
        let pid = o.partition_id.clone();
        match self
            .deadline("release ownership", self.inner.claim_ownership(&[o]))
            .await
        {
            Ok(_) => tracing::info!(partition = %pid, "ownership released"),
            Err(e) => {
                tracing::warn!(partition = %pid, error = %e, "could not release ownership; it will expire")
            }
        }
    }

    /// The processor is being torn down (a graceful stop, or a rebuild after a failure):
    /// claim nothing new, keep renewing the partitions still being finished (hidden from the
    /// processor), and release each once its task has ended.
    pub(super) fn stop_claiming(&self) {
        self.state().stopping = true;
    }

    /// A new processor starts (the first, or one rebuilt after a failure): claim again.
    pub(super) fn resume_claiming(&self) {
        self.state().stopping = false;
    }

    /// A partition task is about to read `partition`: `false` if it must not (the partition
    /// is being handed over, was handed over meanwhile, or the replica is stopping).
    /// `stop_reading` tells the task to stop reading and finish (a handover).
    pub(super) fn partition_started(
        &self,
        partition: &str,
        stop_reading: tokio_util::sync::CancellationToken,
    ) -> bool {
        let mut st = self.state();
        if st.stopping || st.giving.contains_key(partition) || !st.claimed.contains_key(partition) {
            return false;
        }
        st.reading.insert(partition.to_string(), stop_reading);
        true
    }

    /// The task reading `partition` has ended (its final checkpoint written): hand the
    /// partition over if asked to, release it if stopping.
    pub(super) async fn partition_ended(&self, partition: &str) {
        let (give, release) = {
            let mut st = self.state();
            st.reading.remove(partition);
            let give = st.giving.contains_key(partition);
            let release = (!give && st.stopping)
                .then(|| {
                    st.claimed.remove(partition);
                    st.held.remove(partition)
                })
                .flatten();
            (give, release)
        };
        if give {
            self.hand_over(partition).await;
        } else if let Some(o) = release {
            let _guard = self.claim_lock.lock().await;
            self.release(o).await;
        }
    }

    /// Writes the ownership of `partition` over to the replica that asked for it, with this
    /// replica's claim's ETag: it never passes through "unowned", so no third replica takes
    /// it in between.
    async fn hand_over(&self, partition: &str) {
        let _guard = self.claim_lock.lock().await;
        let (held, to) = {
            let mut st = self.state();
            st.claimed.remove(partition);
            (st.held.remove(partition), st.giving.remove(partition))
        };
        let (Some(mut o), Some(to)) = (held, to) else {
            return;
        };
        o.owner_id = Some(to.clone());
        match self
            .deadline("hand over ownership", self.inner.claim_ownership(&[o]))
            .await
        {
            Ok(c) if !c.is_empty() => {
                tracing::info!(partition, to = %to, "partition handed over")
            }
            Ok(_) => {
                tracing::warn!(partition, to = %to, "handover not written: the ownership changed meanwhile")
            }
            Err(e) => {
                tracing::warn!(partition, to = %to, error = %e, "could not write the ownership over; it will expire")
            }
        }
    }

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
    async fn cooperate(&self, wanted: Vec<Ownership>) -> Vec<Ownership> {
        let Some(h) = &self.handovers else {
            return wanted;
        };
        let now = time::OffsetDateTime::now_utc();
        let (mut pass, mut steals, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
        let (partitions, mine) = {
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
            (st.partitions.len().max(st.listing.len()), mine)
        };
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
        pass.extend(fresh);
        if steals.is_empty() {
            return pass;
        }
        // Requests still pending count against what this cycle wants (the processor picks
        // the partitions to steal at random each cycle): one request per partition it would
        // steal, not one per cycle.
        let pending = {
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
        };
        let mut budget = steals.len().saturating_sub(pending);
        for (o, owner) in steals {
            let p = o.partition_id.clone();
            let asked = self
                .state()
                .asking
                .get(&p)
                .filter(|(to, _)| *to == owner)
                .map(|(_, since)| *since);
            if let Some(since) = asked {
                if since.elapsed() < self.expiration {
                    continue;
                }
                match tokio::time::timeout(self.deadline, h.read(&p)).await {
                    Ok(Ok(Some((r, _))))
                        if r.asker == h.me() && r.owner == owner && r.stage == Stage::Releasing =>
                    {
                        // The owner answered and is finishing what it holds: wait for it.
                        continue;
                    }
                    _ => {
                        tracing::warn!(partition = %p, owner = %owner, "the owner did not answer the handover request within the ownership expiration ({:?}): taking the partition", self.expiration);
                        self.state().asking.remove(&p);
                        pass.push(o);
                        continue;
                    }
                }
            }
            if budget == 0 {
                continue;
            }
            budget -= 1;
            let stale = self
                .state()
                .theirs
                .get(&p)
                .filter(|(_, since)| since.elapsed() >= self.expiration)
                .map(|(etag, _)| etag.clone());
            match tokio::time::timeout(self.deadline * 2, h.ask(&p, &owner, stale.as_deref())).await
            {
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
        pass
    }

    /// The owner's half, once per cycle: the requests addressed to this replica for the
    /// partitions it holds are acknowledged, and those partitions are handed over.
    async fn answer_requests(&self) {
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
    pub(super) fn owns(&self, partition: &str) -> bool {
        self.state()
            .claimed
            .get(partition)
            .is_some_and(|t| t.elapsed() < self.expiration)
    }
}

impl FencedCheckpointStore {
    /// partition → the sequence number of its checkpoint, as stored now (every replica's,
    /// not only this one's); `None` until the processor has listed checkpoints once (the
    /// namespace they are named with is known then) or when they cannot be read. An event
    /// at or before its partition's checkpoint is settled: no replica reads it again.
    pub(super) async fn settled_positions(
        &self,
        hub: &str,
        cg: &str,
    ) -> Option<HashMap<String, i64>> {
        let namespace = self.state().namespace.clone()?;
        let cps = self
            .deadline(
                "list_checkpoints",
                self.inner.list_checkpoints(&namespace, hub, cg),
            )
            .await
            .ok()?;
        Some(
            cps.into_iter()
                .filter_map(|c| c.sequence_number.map(|s| (c.partition_id, s)))
                .collect(),
        )
    }

    /// Reads the checkpoints and notes the partitions whose checkpoint holds no usable
    /// position (the store returns one with neither a sequence number nor an offset for a
    /// blob it cannot read): those are held — not claimed, not read from a guessed position —
    /// with a reason naming the blob, until someone repairs or deletes it. Returns the
    /// readable checkpoints.
    async fn checked_checkpoints(
        &self,
        namespace: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<Checkpoint>> {
        self.state().namespace = Some(namespace.to_string());
        let mut cps = self
            .deadline(
                "list_checkpoints",
                self.inner.list_checkpoints(namespace, hub, cg),
            )
            .await?;
        let bad: HashMap<String, String> = cps
            .iter()
            .filter(|c| c.sequence_number.is_none() && c.offset.is_none())
            .map(|c| {
                let blob = format!(
                    "{}{}",
                    crate::azure::checkpoint_store::blob_prefix(namespace, hub, cg, "checkpoint"),
                    c.partition_id.to_lowercase()
                );
                (c.partition_id.clone(), blob)
            })
            .collect();
        cps.retain(|c| !bad.contains_key(&c.partition_id));
        let (newly, healed) = {
            let mut st = self.state();
            let newly: Vec<(String, String)> = bad
                .iter()
                .filter(|(p, _)| !st.poisoned.contains_key(*p))
                .map(|(p, b)| (p.clone(), b.clone()))
                .collect();
            let healed: Vec<String> = st
                .poisoned
                .keys()
                .filter(|p| !bad.contains_key(*p))
                .cloned()
                .collect();
            st.poisoned = bad;
            (newly, healed)
        };
        if let Some(health) = &self.health {
            for (p, blob) in newly {
                health.hold(
                    crate::pipeline::health::HoldSubject::Partition(p),
                    None,
                    crate::pipeline::health::HoldCause::CorruptCheckpoint,
                    format!("checkpoint blob {blob} holds no readable position (sequencenumber/offset): the partition is not read until the blob is repaired or deleted"),
                );
            }
            for p in healed {
                health.release(&crate::pipeline::health::HoldSubject::Partition(p), None);
            }
        }
        Ok(cps)
    }
}

#[async_trait]
impl CheckpointStore for FencedCheckpointStore {
    async fn claim_ownership(
        &self,
        ownerships: &[Ownership],
    ) -> azure_core::Result<Vec<Ownership>> {
        let asked_at = Instant::now();
        let mine = ownerships
            .first()
            .is_some_and(|o| o.owner_id.as_deref() == Some(self.owner_id.as_str()));
        // A partition whose checkpoint cannot be read is not claimed: the processor would
        // start it from the default position.
        let wanted: Vec<Ownership> = match ownerships.first() {
            Some(o) if mine => {
                if self.state().stopping {
                    // Stopping: renew only what is still being finished, hidden from the
                    // processor; claim nothing.
                    let still: Vec<Ownership> = {
                        let st = self.state();
                        ownerships
                            .iter()
                            .filter(|o| st.reading.contains_key(&o.partition_id))
                            .cloned()
                            .collect()
                    };
                    if !still.is_empty() {
                        let _guard = self.claim_lock.lock().await;
                        let renewed = self
                            .deadline("claim_ownership", self.inner.claim_ownership(&still))
                            .await?;
                        let mut st = self.state();
                        for o in renewed {
                            if st.held.contains_key(&o.partition_id) {
                                st.claimed.insert(o.partition_id.clone(), asked_at);
                                st.held.insert(o.partition_id.clone(), o);
                            }
                        }
                    }
                    return Ok(Vec::new());
                }
                if !self.may_claim() {
                    // Another live process uses this owner id: claim (and renew) nothing, so
                    // the processor revokes any partition it still reads.
                    let mut st = self.state();
                    st.claimed.clear();
                    st.held.clear();
                    return Ok(Vec::new());
                }
                self.checked_checkpoints(
                    &o.fully_qualified_namespace,
                    &o.event_hub_name,
                    &o.consumer_group,
                )
                .await?;
                let wanted: Vec<Ownership> = {
                    let st = self.state();
                    ownerships
                        .iter()
                        .filter(|o| !st.poisoned.contains_key(&o.partition_id))
                        .cloned()
                        .collect()
                };
                self.cooperate(wanted).await
            }
            _ => ownerships.to_vec(),
        };
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let guard = self.claim_lock.lock().await;
        let claimed = self
            .deadline("claim_ownership", self.inner.claim_ownership(&wanted))
            .await?;
        let (shown, hand_now, got) = {
            let mut st = self.state();
            for o in &claimed {
                if o.owner_id.as_deref() == Some(self.owner_id.as_str()) {
                    st.claimed.insert(o.partition_id.clone(), asked_at);
                    st.held.insert(o.partition_id.clone(), o.clone());
                }
            }
            if !mine {
                return Ok(claimed);
            }
            // A partition being handed over stays renewed but is hidden from the processor,
            // which stops its reading (a revocation); one nobody reads is handed over now.
            let shown: Vec<Ownership> = claimed
                .into_iter()
                .filter(|o| !st.giving.contains_key(&o.partition_id))
                .collect();
            let hand_now: Vec<String> = st
                .giving
                .keys()
                .filter(|p| !st.reading.contains_key(*p))
                .cloned()
                .collect();
            let got: Vec<String> = shown
                .iter()
                .filter_map(|o| {
                    st.asking
                        .remove(&o.partition_id)
                        .map(|_| o.partition_id.clone())
                })
                .collect();
            (shown, hand_now, got)
        };
        drop(guard);
        for p in hand_now {
            self.hand_over(&p).await;
        }
        if let Some(h) = &self.handovers {
            for p in got {
                h.withdraw(&p).await;
            }
        }
        if let Some(r) = &self.rate {
            let mine: Vec<String> = shown
                .iter()
                .filter(|o| o.owner_id.as_deref() == Some(self.owner_id.as_str()))
                .map(|o| o.partition_id.clone())
                .collect();
            r.claimed(&mine);
        }
        Ok(shown)
    }

    async fn list_checkpoints(
        &self,
        namespace: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<Checkpoint>> {
        let cps = self.checked_checkpoints(namespace, hub, cg).await?;
        let mut st = self.state();
        for c in &cps {
            if let Some(seq) = c.sequence_number {
                let e = st.written.entry(c.partition_id.clone()).or_insert(seq);
                *e = (*e).max(seq);
            }
        }
        Ok(cps)
    }

    async fn list_ownerships(
        &self,
        namespace: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<Ownership>> {
        // Every load-balancing cycle starts here: renew (or check) the hold on the owner id
        // before the processor decides what to claim.
        if let Some(lease) = &self.lease {
            // At most three record calls (renew; read; create or take over), each with the
            // record store's own deadline; a check past them all keeps the last verdict.
            let holds = tokio::time::timeout(self.deadline * 3, lease.check())
                .await
                .unwrap_or_else(|_| lease.holds());
            if !holds {
                let mut st = self.state();
                st.claimed.clear();
                st.held.clear();
            }
        }
        let owners = self
            .deadline(
                "list_ownerships",
                self.inner.list_ownerships(namespace, hub, cg),
            )
            .await?;
        self.note_owners(&owners);
        if let Some(r) = &self.rate {
            r.listed(&owners, self.expiration);
        }
        {
            let mut st = self.state();
            for o in &owners {
                if o.owner_id.as_deref() != Some(self.owner_id.as_str()) {
                    // Someone else owns it now: our claim is lost.
                    st.claimed.remove(&o.partition_id);
                    st.held.remove(&o.partition_id);
                    st.giving.remove(&o.partition_id);
                }
            }
            st.listing = owners
                .iter()
                .map(|o| (o.partition_id.clone(), o.clone()))
                .collect();
        }
        self.answer_requests().await;
        Ok(owners)
    }

    async fn update_checkpoint(&self, checkpoint: Checkpoint) -> azure_core::Result<()> {
        let pid = checkpoint.partition_id.clone();
        let seq = checkpoint.sequence_number;
        {
            let mut st = self.state();
            self.take_rewinds(&mut st);
            let fresh = st
                .claimed
                .get(&pid)
                .is_some_and(|t| t.elapsed() < self.expiration);
            if !fresh {
                return Err(fence_error(format!(
                    "checkpoint of partition {pid} refused: this replica's ownership is stale or lost"
                )));
            }
            if let (Some(seq), Some(prev)) = (seq, st.written.get(&pid)) {
                if seq < *prev {
                    return Err(fence_error(format!(
                        "checkpoint of partition {pid} refused: {seq} would move it back from {prev}"
                    )));
                }
            }
        }
        self.deadline(
            "update_checkpoint",
            self.inner.update_checkpoint(checkpoint),
        )
        .await?;
        if let Some(seq) = seq {
            let mut st = self.state();
            let e = st.written.entry(pid).or_insert(seq);
            *e = (*e).max(seq);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use azure_messaging_eventhubs::InMemoryCheckpointStore;

    fn ownership(pid: &str, owner: &str) -> Ownership {
        Ownership {
            fully_qualified_namespace: "ns".into(),
            event_hub_name: "hub".into(),
            consumer_group: "$Default".into(),
            partition_id: pid.into(),
            owner_id: Some(owner.into()),
            ..Default::default()
        }
    }

    fn checkpoint(pid: &str, seq: i64) -> Checkpoint {
        Checkpoint {
            fully_qualified_namespace: "ns".into(),
            event_hub_name: "hub".into(),
            consumer_group: "$Default".into(),
            partition_id: pid.into(),
            offset: Some((seq * 100).to_string()),
            sequence_number: Some(seq),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn fences_by_ownership_and_never_moves_back() {
        let inner = Arc::new(InMemoryCheckpointStore::new());
        let store = FencedCheckpointStore::new(
            inner.clone(),
            "me".into(),
            Duration::from_secs(5),
            Duration::from_secs(30),
        );
        // Not claimed: refused.
        assert!(store.update_checkpoint(checkpoint("0", 5)).await.is_err());
        let won = store
            .claim_ownership(&[ownership("0", "me")])
            .await
            .unwrap();
        store.update_checkpoint(checkpoint("0", 5)).await.unwrap();
        // Backwards: refused; the stored checkpoint stays.
        assert!(store.update_checkpoint(checkpoint("0", 3)).await.is_err());
        let cps = inner
            .list_checkpoints("ns", "hub", "$Default")
            .await
            .unwrap();
        assert_eq!(cps[0].sequence_number, Some(5));
        // Stale after the expiration without a renewed claim.
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(store.update_checkpoint(checkpoint("0", 9)).await.is_err());
        // The renewal rotates the ETag (0.16's in-memory store, like blob storage): keep it.
        let won = store.claim_ownership(&won).await.unwrap();
        store.update_checkpoint(checkpoint("0", 9)).await.unwrap();
        // Another owner seen in the listing: lost.
        let mut stolen = won[0].clone();
        stolen.owner_id = Some("other".into());
        inner.update_ownership(&stolen).unwrap();
        store
            .list_ownerships("ns", "hub", "$Default")
            .await
            .unwrap();
        assert!(!store.owns("0"));
        assert!(store.update_checkpoint(checkpoint("0", 12)).await.is_err());
    }

    fn with_handovers(
        inner: &Arc<InMemoryCheckpointStore>,
        records: &Arc<crate::azure::memory::MemoryRecordStore>,
        id: &str,
    ) -> FencedCheckpointStore {
        let store = FencedCheckpointStore::new(
            inner.clone(),
            id.into(),
            Duration::from_secs(5),
            Duration::from_secs(30),
        )
        .with_handovers(Handovers::new(records.clone(), "hub", "$Default", id));
        store.set_partitions(vec!["0".into(), "1".into()]);
        store
    }

    async fn cycle(store: &FencedCheckpointStore, want: &[(&str, &str)]) -> Vec<String> {
        // What the processor's load balancing does each cycle: list, then claim its own
        // partitions and the ones it wants (with the ETags listed).
        let listed = store
            .list_ownerships("ns", "hub", "$Default")
            .await
            .unwrap();
        let mut claims: Vec<Ownership> = listed
            .iter()
            .filter(|o| o.owner_id.as_deref() == Some(store.owner_id.as_str()))
            .cloned()
            .collect();
        for (p, _) in want {
            let mut o = listed
                .iter()
                .find(|o| o.partition_id == *p)
                .cloned()
                .unwrap_or_else(|| ownership(p, ""));
            o.owner_id = Some(store.owner_id.clone());
            claims.retain(|c| c.partition_id != *p);
            claims.insert(0, o);
        }
        if claims.is_empty() {
            return Vec::new();
        }
        let mut got: Vec<String> = store
            .claim_ownership(&claims)
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.partition_id)
            .collect();
        got.sort();
        got
    }

    #[tokio::test(start_paused = true)]
    async fn two_askers_for_one_partition_the_first_gets_it_handed_over_the_second_nothing() {
        let inner = Arc::new(InMemoryCheckpointStore::new());
        let records = Arc::new(crate::azure::memory::MemoryRecordStore::new());
        let (a, b, c) = (
            with_handovers(&inner, &records, "a"),
            with_handovers(&inner, &records, "b"),
            with_handovers(&inner, &records, "c"),
        );
        assert_eq!(cycle(&a, &[("0", "")]).await, vec!["0"]);
        // b and c both want it while a owns it: they ask (one of them), neither takes it.
        assert!(
            cycle(&b, &[("0", "")]).await.is_empty(),
            "b asks, not steals"
        );
        assert!(
            cycle(&c, &[("0", "")]).await.is_empty(),
            "c leaves b's request"
        );
        let (request, _) = Handovers::new(records.clone(), "hub", "$Default", "x")
            .read("0")
            .await
            .unwrap()
            .expect("a request");
        assert_eq!((request.asker.as_str(), request.owner.as_str()), ("b", "a"));
        assert!(a.owns("0"), "still a's");
        // a's next cycle answers: nothing reads the partition here, so it goes at once —
        // written over to b, never unowned.
        assert!(cycle(&a, &[]).await.is_empty());
        assert!(!a.owns("0"));
        let listed = inner
            .list_ownerships("ns", "hub", "$Default")
            .await
            .unwrap();
        assert_eq!(listed[0].owner_id.as_deref(), Some("b"));
        assert!(
            a.update_checkpoint(checkpoint("0", 1)).await.is_err(),
            "a is fenced"
        );
        assert_eq!(cycle(&b, &[]).await, vec!["0"]);
        b.update_checkpoint(checkpoint("0", 1)).await.unwrap();
        assert!(
            Handovers::new(records.clone(), "hub", "$Default", "x")
                .read("0")
                .await
                .unwrap()
                .is_none(),
            "the request is withdrawn once b owns the partition"
        );
        // c, still wanting it, now asks b; it never owned it meanwhile.
        assert!(cycle(&c, &[("0", "")]).await.is_empty());
        assert!(!c.owns("0"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_owner_that_never_answers_loses_the_partition_at_expiry_one_that_is_finishing_keeps_it(
    ) {
        let inner = Arc::new(InMemoryCheckpointStore::new());
        let records = Arc::new(crate::azure::memory::MemoryRecordStore::new());
        let (a, b) = (
            with_handovers(&inner, &records, "a"),
            with_handovers(&inner, &records, "b"),
        );
        assert_eq!(cycle(&a, &[("0", ""), ("1", "")]).await, vec!["0", "1"]);
        assert!(
            a.partition_started("1", tokio_util::sync::CancellationToken::new()),
            "a reads partition 1"
        );
        // b asks for partition 0; a never looks (a silent owner: its ownership is renewed
        // by whatever runs it, as a hung processor's would be).
        assert!(cycle(&b, &[("0", "")]).await.is_empty());
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(
            cycle(&b, &[("0", "")]).await.is_empty(),
            "not before the expiration"
        );
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(
            cycle(&b, &[("0", "")]).await,
            vec!["0"],
            "taken once the owner left the request unanswered for the expiration"
        );
        // Partition 1: b asks, a answers and is still finishing (an event it cannot settle
        // yet): b waits past the expiration, a keeps renewing and checkpointing.
        assert!(cycle(&b, &[("1", "")]).await.iter().all(|p| p != "1"));
        assert!(
            cycle(&a, &[]).await.is_empty(),
            "hidden from a's processor: it stops reading"
        );
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(cycle(&a, &[]).await.is_empty());
        a.update_checkpoint(checkpoint("1", 7)).await.unwrap();
        assert!(
            cycle(&b, &[("1", "")]).await.iter().all(|p| p != "1"),
            "b waits"
        );
        assert!(a.owns("1"));
        // a's task ends (final checkpoint written): the partition is written over to b.
        a.partition_ended("1").await;
        assert!(!a.owns("1"));
        assert!(cycle(&b, &[]).await.contains(&"1".to_string()));
    }
}
