//! The SDK's `CheckpointStore` trait, fenced.

use async_trait::async_trait;
use azure_messaging_eventhubs::models::{Checkpoint, Ownership};
use azure_messaging_eventhubs::CheckpointStore;
use tokio::time::Instant;

use super::{fence_error, FenceState, FencedCheckpointStore};

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
        let wanted = self.wanted_claims(ownerships, mine, asked_at).await?;
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let guard = self.claim_lock.lock().await;
        let claimed = self
            .deadline("claim_ownership", self.inner.claim_ownership(&wanted))
            .await?;
        let outcome = {
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
            Self::sort_claimed(&mut st, claimed)
        };
        drop(guard);
        Ok(self.after_claim(outcome).await)
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

/// This replica's own claims after the store's answer (see
/// [`FencedCheckpointStore::sort_claimed`]).
struct Claimed {
    /// What the processor is told it owns.
    shown: Vec<Ownership>,
    /// Partitions to hand over now.
    hand_now: Vec<String>,
    /// Partitions this replica asked for and now holds: its requests are withdrawn.
    got: Vec<String>,
}

impl FencedCheckpointStore {
    /// The claims to put to the store: another process's pass through unchanged; this
    /// replica's are none while stopping (those still being finished are renewed, hidden
    /// from the processor) or while another live process uses its owner id, and otherwise
    /// those whose checkpoint is readable, as [`cooperate`](Self::cooperate) decides.
    async fn wanted_claims(
        &self,
        ownerships: &[Ownership],
        mine: bool,
        asked_at: Instant,
    ) -> azure_core::Result<Vec<Ownership>> {
        // A partition whose checkpoint cannot be read is not claimed: the processor would
        // start it from the default position.
        let wanted: Vec<Ownership> = match ownerships.first() {
            Some(o) if mine => {
                if self.state().stopping {
                    self.renew_while_stopping(ownerships, asked_at).await?;
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
        Ok(wanted)
    }

    /// Stopping: renew only what is still being finished, hidden from the processor; claim
    /// nothing.
    async fn renew_while_stopping(
        &self,
        ownerships: &[Ownership],
        asked_at: Instant,
    ) -> azure_core::Result<()> {
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
        Ok(())
    }

    /// A partition being handed over stays renewed but is hidden from the processor, which
    /// stops its reading (a revocation); one nobody reads is handed over now.
    fn sort_claimed(st: &mut FenceState, claimed: Vec<Ownership>) -> Claimed {
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
        Claimed {
            shown,
            hand_now,
            got,
        }
    }

    /// Hands over what is due, withdraws the requests answered, tells the rate limiter
    /// this replica's partitions; returns what the processor is told it owns.
    async fn after_claim(&self, claimed: Claimed) -> Vec<Ownership> {
        let Claimed {
            shown,
            hand_now,
            got,
        } = claimed;
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
        shown
    }
}
