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
//!   [`owner`](super::ownership::owner)): the SDK would take that process's partitions
//!   for its own;
//! - asks a live owner to hand a partition over instead of stealing it, and hands its own
//!   over when asked (see [`handover`](super::ownership::handover)); claims no more unowned
//!   partitions at once than its share among the live replicas (so replicas starting
//!   together do not each grab every partition and give most back mid-stream); at a
//!   graceful stop, releases each partition as soon as its final checkpoint is written.
//!
//! What to claim, ask for or take is decided by the pure planner beside it
//! ([`plan`](super::ownership::plan)); this store does what the plan says, and fences.
//! Each partition's state is one [`Partition`](lifecycle::Partition) value, whose hold is
//! one [`Hold`](lifecycle::Hold) (free, asking, claimed, giving): see [`lifecycle`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use azure_core::error::ErrorKind;
use azure_messaging_eventhubs::models::{Checkpoint, Ownership};
use azure_messaging_eventhubs::CheckpointStore;
use tokio::time::Instant;

use self::lifecycle::Partition;
use super::ownership::handover::Handovers;

/// A fenced wrapper around another checkpoint store.
pub(super) struct FencedCheckpointStore {
    inner: Arc<dyn CheckpointStore + Send + Sync>,
    owner_id: String,
    deadline: Duration,
    expiration: Duration,
    state: Mutex<FenceState>,
    health: Option<Arc<crate::pipeline::health::Health>>,
    lease: Option<super::ownership::owner::OwnerLease>,
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
    /// Woken at every claim and listing: a task standing down until its partition's ownership
    /// is confirmed again (see [`Self::confirmed`]) looks again.
    cycled: tokio::sync::Notify,
}

#[derive(Default)]
struct FenceState {
    /// partition → what this replica knows of it (its hold, its task, its checkpoint).
    partitions: HashMap<String, Partition>,
    /// Rewinds (by id) this store has taken into the checkpoints it lets through.
    rewinds_seen: HashSet<String>,
    /// The hub's partition ids, once known.
    ids: Vec<String>,
    /// The ownerships as the last cycle listed them.
    listing: Vec<Ownership>,
    /// A graceful stop is under way: claim nothing new.
    stopping: bool,
    /// The namespace the processor names checkpoints with, once it listed them.
    namespace: Option<String>,
}

impl FenceState {
    /// `partition`'s state (a fresh one if nothing is known of it yet).
    fn at(&mut self, partition: &str) -> &mut Partition {
        self.partitions.entry(partition.to_string()).or_default()
    }

    /// This replica's claim on `partition`, if renewed within `expiration`.
    fn fresh(&self, partition: &str, expiration: Duration) -> Option<&lifecycle::Claim> {
        self.partitions.get(partition)?.hold.fresh(expiration)
    }

    /// Drops every claim: this process does not hold its owner id.
    fn drop_claims(&mut self) {
        for p in self.partitions.values_mut() {
            p.drop_claim();
        }
    }
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
            cycled: tokio::sync::Notify::new(),
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
                st.at(pid).written = Some(r.sequence_number);
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
            let held = st
                .fresh(partition, self.expiration)
                .map(|c| &c.ownership)
                .ok_or_else(|| {
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
        st.at(partition).written = Some(rewind.sequence_number);
        st.rewinds_seen.insert(rewind.id.clone());
        Ok(())
    }

    /// Hands partitions over cooperatively (see [`handover`](super::ownership::handover)) through
    /// `handovers`.
    pub(super) fn with_handovers(mut self, handovers: Handovers) -> Self {
        self.handovers = Some(handovers);
        self
    }

    /// Claims partitions only while this process holds its owner id (`lease`, renewed at
    /// every listing of ownerships, that is every load-balancing cycle).
    pub(super) fn with_lease(mut self, lease: super::ownership::owner::OwnerLease) -> Self {
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
        self.state().ids = partitions;
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
            let ids = st.ids.clone();
            for (_, p) in st
                .partitions
                .iter_mut()
                .filter(|(p, _)| live.contains(p.as_str()))
            {
                p.unowned_since = None;
            }
            let mut unowned = Vec::new();
            for p in ids.iter().filter(|p| !live.contains(p.as_str())) {
                let since = *st.at(p).unowned_since.get_or_insert_with(Instant::now);
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
        {
            // Taken under the claim lock: a renewal in flight lands first, so the release
            // writes with the ETag it left.
            let _claiming = self.claim_lock.lock().await;
            let held: Vec<Ownership> = {
                let mut st = self.state();
                st.partitions
                    .values_mut()
                    .filter_map(|p| {
                        p.reader = None;
                        p.hold.take_all()
                    })
                    .collect()
            };
            for o in held {
                self.release(o).await;
            }
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
        let started = {
            let mut st = self.state();
            let stopping = st.stopping;
            match st.partitions.get_mut(partition) {
                Some(p) if !stopping && p.may_read() => {
                    p.reader = Some(stop_reading);
                    p.unread_since = None;
                    true
                }
                _ => false,
            }
        };
        if started {
            self.unread_reported(partition, None);
        }
        started
    }

    /// The task reading `partition` has ended (its final checkpoint written): hand the
    /// partition over if asked to, release it if stopping; if this replica still holds it
    /// and the task could not give its client back (`closed` false: the SDK would never hand
    /// the partition out again), have it handed out afresh (see
    /// [`Hold::Reopening`](lifecycle::Hold::Reopening)).
    pub(super) async fn partition_ended(&self, partition: &str, closed: bool) {
        let _guard = self.claim_lock.lock().await;
        let (give, release) = {
            let mut st = self.state();
            let stopping = st.stopping;
            let p = st.at(partition);
            p.reader = None;
            let give = p.hold.giving();
            let release = (!give && stopping).then(|| p.hold.take_release()).flatten();
            if !give && !stopping && !closed {
                tracing::warn!(partition, "the partition's client was not given back cleanly: hiding the partition from the processor for one cycle so it is handed out afresh");
                p.hold.reopen(false);
            }
            (give, release)
        };
        if give {
            self.hand_over_locked(partition).await;
        } else if let Some(o) = release {
            self.release(o).await;
        }
    }

    /// Partitions this replica holds and shows to the processor that no task has read for
    /// longer than half the ownership expiration (the processor hands a claimed partition out
    /// within a cycle): handed out afresh, and reported to readiness as not read.
    /// Only with readiness to report to (the pipeline always has it).
    fn unread(&self, st: &mut FenceState) -> Vec<(String, std::time::Duration)> {
        if self.health.is_none() {
            return Vec::new();
        }
        let bound = self.expiration / 2;
        let stopping = st.stopping;
        let mut unread = Vec::new();
        for (id, p) in st.partitions.iter_mut() {
            if stopping || !p.may_read() || p.reader.is_some() {
                p.unread_since = None;
                continue;
            }
            let since = *p.unread_since.get_or_insert_with(Instant::now);
            if since.elapsed() > bound {
                // This cycle's claim is renewed already: hidden from it on.
                p.hold.reopen(true);
                p.unread_since = None;
                unread.push((id.clone(), since.elapsed()));
            }
        }
        unread
    }

    /// Tells readiness that `partition`, which this replica owns, has not been read for
    /// `for_` (or, with `None`, that it is read again).
    fn unread_reported(&self, partition: &str, for_: Option<std::time::Duration>) {
        let Some(health) = &self.health else {
            return;
        };
        let subject = crate::pipeline::health::HoldSubject::Partition(partition.to_string());
        match for_ {
            Some(d) => {
                tracing::warn!(partition, unread_s = d.as_secs(), "this replica owns the partition but no task has read it: handing it out afresh");
                health.hold(
                    subject,
                    None,
                    crate::pipeline::health::HoldCause::Ownership,
                    format!("owned by this replica but not read for {} s: the processor is made to hand it out afresh", d.as_secs()),
                );
            }
            None => health.release(&subject, None),
        }
    }

    /// Waits until this replica's claim on `partition` is confirmed: renewed within the
    /// ownership expiration, as measured on the monotonic clock — a process frozen (a stopped
    /// container, a VM paused, a long GC) past the expiration finds its claim stale on waking
    /// and acts on nothing until its next claim confirms it. `false` if the claim is lost
    /// (another owner is listed, the owner id is not held) or `cancel` fires first: the event
    /// stays unsettled, and nothing is checkpointed past it.
    pub(super) async fn confirmed(
        &self,
        partition: &str,
        cancel: &tokio_util::sync::CancellationToken,
    ) -> bool {
        let mut told = false;
        loop {
            let cycled = self.cycled.notified();
            tokio::pin!(cycled);
            cycled.as_mut().enable();
            let held = {
                let st = self.state();
                let Some(p) = st.partitions.get(partition) else {
                    return false;
                };
                match p.hold.claim() {
                    None => return false,
                    Some(c) if c.at.elapsed() < self.expiration => return true,
                    Some(c) => c.at.elapsed(),
                }
            };
            if !told {
                told = true;
                tracing::warn!(partition, unconfirmed_s = held.as_secs(), "this replica's ownership of the partition was last confirmed longer ago than the expiration (a frozen or stalled process?): standing down until it is confirmed again");
            }
            tokio::select! {
                _ = cancel.cancelled() => return false,
                _ = &mut cycled => {}
                _ = tokio::time::sleep(self.deadline) => {}
            }
        }
    }

    /// Writes the ownership of `partition` over to the replica that asked for it, with this
    /// replica's claim's ETag: it never passes through "unowned", so no third replica takes
    /// it in between.
    async fn hand_over(&self, partition: &str) {
        let _guard = self.claim_lock.lock().await;
        self.hand_over_locked(partition).await
    }

    /// [`Self::hand_over`], under the claim lock already held.
    async fn hand_over_locked(&self, partition: &str) {
        let taken = self.state().at(partition).hold.take_handover();
        let Some((mut o, to)) = taken else {
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
                .filter(|(p, _)| st.partitions.get(*p).is_none_or(|p| p.poisoned.is_none()))
                .map(|(p, b)| (p.clone(), b.clone()))
                .collect();
            let mut healed = Vec::new();
            for (id, p) in &mut st.partitions {
                if p.poisoned.take().is_some() && !bad.contains_key(id) {
                    healed.push(id.clone());
                }
            }
            for (id, blob) in bad {
                st.at(&id).poisoned = Some(blob);
            }
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

mod lifecycle;
mod store;

#[cfg(test)]
mod tests;
