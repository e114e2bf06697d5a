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
//!   [`owner`](super::owner)): the SDK would take that process's partitions for its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use azure_core::error::ErrorKind;
use azure_messaging_eventhubs::models::{Checkpoint, Ownership};
use azure_messaging_eventhubs::CheckpointStore;
use tokio::time::Instant;

/// A fenced wrapper around another checkpoint store.
pub(super) struct FencedCheckpointStore {
    inner: Arc<dyn CheckpointStore + Send + Sync>,
    owner_id: String,
    deadline: Duration,
    expiration: Duration,
    state: Mutex<FenceState>,
    health: Option<Arc<crate::pipeline::health::Health>>,
    lease: Option<super::owner::OwnerLease>,
}

#[derive(Default)]
struct FenceState {
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
        }
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
            st.held.drain().map(|(_, o)| o).collect()
        };
        for mut o in held {
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
        if let Some(lease) = &self.lease {
            lease.release().await;
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
                    &p,
                    crate::pipeline::health::HoldCause::CorruptCheckpoint,
                    format!("checkpoint blob {blob} holds no readable position (sequencenumber/offset): the partition is not read until the blob is repaired or deleted"),
                    POISONED_SEQ,
                );
            }
            for p in healed {
                health.release(&p, POISONED_SEQ);
            }
        }
        Ok(cps)
    }
}

/// The sequence number a poisoned checkpoint is held under in [`Health`](crate::pipeline::health::Health).
const POISONED_SEQ: i64 = -1;

#[async_trait]
impl CheckpointStore for FencedCheckpointStore {
    async fn claim_ownership(
        &self,
        ownerships: &[Ownership],
    ) -> azure_core::Result<Vec<Ownership>> {
        let asked_at = Instant::now();
        // A partition whose checkpoint cannot be read is not claimed: the processor would
        // start it from the default position.
        let wanted: Vec<Ownership> = match ownerships.first() {
            Some(o) if o.owner_id.as_deref() == Some(self.owner_id.as_str()) => {
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
                let st = self.state();
                ownerships
                    .iter()
                    .filter(|o| !st.poisoned.contains_key(&o.partition_id))
                    .cloned()
                    .collect()
            }
            _ => ownerships.to_vec(),
        };
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let claimed = self
            .deadline("claim_ownership", self.inner.claim_ownership(&wanted))
            .await?;
        let mut st = self.state();
        for o in &claimed {
            if o.owner_id.as_deref() == Some(self.owner_id.as_str()) {
                st.claimed.insert(o.partition_id.clone(), asked_at);
                st.held.insert(o.partition_id.clone(), o.clone());
            }
        }
        Ok(claimed)
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
        let mut st = self.state();
        for o in &owners {
            if o.owner_id.as_deref() != Some(self.owner_id.as_str()) {
                // Someone else owns it now: our claim is lost.
                st.claimed.remove(&o.partition_id);
                st.held.remove(&o.partition_id);
            }
        }
        Ok(owners)
    }

    async fn update_checkpoint(&self, checkpoint: Checkpoint) -> azure_core::Result<()> {
        let pid = checkpoint.partition_id.clone();
        let seq = checkpoint.sequence_number;
        {
            let st = self.state();
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
}
