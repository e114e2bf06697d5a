//! The SDK's `CheckpointStore` trait, fenced: checkpoints let through only under a fresh
//! claim and never backwards; claims put to the store as the
//! [`plan`](super::super::ownership::plan) says, and their outcome kept in each partition's
//! [`Hold`](super::lifecycle::Hold).

use async_trait::async_trait;
use azure_messaging_eventhubs::models::{Checkpoint, Ownership};
use azure_messaging_eventhubs::CheckpointStore;
use tokio::time::Instant;

use super::lifecycle::Claim;
use super::{fence_error, FenceState, FencedCheckpointStore};
use crate::pipeline::ownership::handover::{Asked, Handovers};
use crate::pipeline::ownership::{cooperate, plan};

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
        // Held around the claim and its record here: a renewal and a handover never race on
        // one ownership's ETag.
        let outcome = {
            let _claiming = self.claim_lock.lock().await;
            let mut claimed = self
                .deadline("claim_ownership", self.inner.claim_ownership(&wanted))
                .await?;
            self.in_process_time(&mut claimed);
            let mut st = self.state();
            let mut got = Vec::new();
            for o in &claimed {
                if o.owner_id.as_deref() == Some(self.owner_id.as_str()) {
                    let claim = Claim {
                        at: asked_at,
                        ownership: o.clone(),
                    };
                    if st.at(&o.partition_id).hold.claimed(claim) {
                        got.push(o.partition_id.clone());
                    }
                }
            }
            if !mine {
                return Ok(claimed);
            }
            let unread = self.unread(&mut st);
            (Self::sort_claimed(&st, claimed, got), unread)
        };
        self.cycled.notify_waiters();
        let (outcome, unread) = outcome;
        for (p, for_) in unread {
            self.unread_reported(&p, Some(for_));
        }
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
                st.at(&c.partition_id).wrote(seq);
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
                self.state().drop_claims();
            }
        }
        let mut owners = self
            .deadline(
                "list_ownerships",
                self.inner.list_ownerships(namespace, hub, cg),
            )
            .await?;
        self.in_process_time(&mut owners);
        self.note_owners(&owners);
        if let Some(r) = &self.rate {
            r.listed(&owners, self.expiration);
        }
        {
            let mut st = self.state();
            for o in &owners {
                if o.owner_id.as_deref() != Some(self.owner_id.as_str()) {
                    // Someone else owns it now: our claim is lost.
                    if let Some(p) = st.partitions.get_mut(&o.partition_id) {
                        p.lost();
                    }
                }
            }
            st.listing = owners.clone();
        }
        self.cycled.notify_waiters();
        self.answer_requests().await;
        Ok(owners)
    }

    async fn update_checkpoint(&self, checkpoint: Checkpoint) -> azure_core::Result<()> {
        let pid = checkpoint.partition_id.clone();
        let seq = checkpoint.sequence_number;
        {
            let mut st = self.state();
            self.take_rewinds(&mut st);
            if st.fresh(&pid, self.expiration).is_none() {
                return Err(fence_error(format!(
                    "checkpoint of partition {pid} refused: this replica's ownership is stale or lost"
                )));
            }
            let prev = st.partitions.get(&pid).and_then(|p| p.written);
            if let (Some(seq), Some(prev)) = (seq, prev) {
                if seq < prev {
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
            self.state().at(&pid).wrote(seq);
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
    /// replica's as the [`Gate`](plan::Gate) lets them (renewals of what is still being
    /// finished while stopping, nothing without the owner id), and otherwise those whose
    /// checkpoint is readable, as [`cooperate`](Self::cooperate) decides.
    async fn wanted_claims(
        &self,
        ownerships: &[Ownership],
        mine: bool,
        asked_at: Instant,
    ) -> azure_core::Result<Vec<Ownership>> {
        let Some(o) = ownerships.first().filter(|_| mine) else {
            return Ok(ownerships.to_vec());
        };
        let stopping = self.state().stopping;
        match plan::Gate::of(stopping, self.may_claim()) {
            plan::Gate::RenewFinishing => {
                self.renew_while_stopping(ownerships, asked_at).await?;
                return Ok(Vec::new());
            }
            plan::Gate::Nothing => {
                // Another live process uses this owner id: claim (and renew) nothing, so
                // the processor revokes any partition it still reads.
                self.state().drop_claims();
                return Ok(Vec::new());
            }
            plan::Gate::Claim => {}
        }
        // A partition whose checkpoint cannot be read is not claimed: the processor would
        // start it from the default position.
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
                .filter(|o| {
                    st.partitions
                        .get(&o.partition_id)
                        .is_none_or(|p| p.poisoned.is_none())
                })
                .cloned()
                .collect()
        };
        Ok(self.cooperate(wanted).await)
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
                .filter(|o| {
                    st.partitions
                        .get(&o.partition_id)
                        .is_some_and(|p| p.reader.is_some())
                })
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
                if let Some(p) = st.partitions.get_mut(&o.partition_id) {
                    p.hold.renewed(Claim {
                        at: asked_at,
                        ownership: o,
                    });
                }
            }
        }
        Ok(())
    }

    /// A partition being handed over, or handed out afresh, stays renewed but is hidden from
    /// the processor, which stops its reading (a revocation) and forgets its client; one
    /// promised that nobody reads is handed over now.
    fn sort_claimed(st: &FenceState, claimed: Vec<Ownership>, got: Vec<String>) -> Claimed {
        let hidden = |p: &str| st.partitions.get(p).is_some_and(|p| p.hold.hidden());
        let shown: Vec<Ownership> = claimed
            .into_iter()
            .filter(|o| !hidden(&o.partition_id))
            .collect();
        let hand_now: Vec<String> = st
            .partitions
            .iter()
            .filter(|(_, p)| p.hold.giving() && p.reader.is_none())
            .map(|(id, _)| id.clone())
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

impl FencedCheckpointStore {
    /// Ownership times in this process's terms: blob storage stamps `Last-Modified` on its
    /// own clock, and the SDK's load balancer (like this store's planner, the rate limit's
    /// shares and the unowned check) compares them with this host's `SystemTime::now()`, so
    /// a host minutes off would find every other replica's ownership expired (and take it)
    /// or its own never expiring. Translated with blob storage's measured offset
    /// ([`Clock::to_process`](crate::clock::Clock::to_process); docs/clocks.md).
    fn in_process_time(&self, owners: &mut [Ownership]) {
        let Some(clock) = self.health.as_ref().map(|h| h.clock()) else {
            return;
        };
        for o in owners {
            if let Some(t) = o.last_modified_time {
                let t = clock.to_process(crate::clock::Service::BlobStorage, t.into());
                o.last_modified_time = Some(t.into());
            }
        }
    }

    /// What the planner reads this cycle: the listing, and this replica's requests.
    fn view(&self) -> plan::View {
        let st = self.state();
        let requests = st
            .partitions
            .iter()
            .map(|(id, p)| {
                let requests = plan::Requests {
                    mine: p
                        .hold
                        .asking()
                        .map(|(owner, since)| (owner.to_string(), since.elapsed())),
                    theirs: p
                        .theirs
                        .as_ref()
                        .map(|(etag, since)| (etag.clone(), since.elapsed())),
                };
                (id.clone(), requests)
            })
            .filter(|(_, r)| r.mine.is_some() || r.theirs.is_some())
            .collect();
        plan::View {
            me: self.owner_id.clone(),
            listed: st.listing.clone(),
            hub_partitions: st.ids.len(),
            now: time::OffsetDateTime::now_utc(),
            expiration: self.expiration,
            requests,
        }
    }

    /// How many processes renewed owner records within the expiration, if it can be read.
    async fn live_instances(&self) -> Option<usize> {
        let lease = self.lease.as_ref()?;
        match tokio::time::timeout(self.deadline, lease.live_instances(self.expiration)).await {
            Ok(Ok(live)) => Some(live),
            _ => None,
        }
    }

    /// Decides, for this replica's wanted claims, which go to the store, as the
    /// [`plan`] says: renewals and unowned or expired partitions (within this replica's
    /// share) do; a partition a live replica owns is asked for instead, and taken only if
    /// its owner does not answer within the ownership expiration.
    async fn cooperate(&self, wanted: Vec<Ownership>) -> Vec<Ownership> {
        let Some(h) = &self.handovers else {
            return wanted;
        };
        let view = self.view();
        let sorted = plan::sort(&view, wanted);
        let live = if sorted.needs_share() {
            self.live_instances().await
        } else {
            None
        };
        let plan = sorted.plan(&view, live);
        if let Some(cut) = plan.cut {
            tracing::debug!(
                wanted = cut.wanted,
                room = cut.room,
                "claiming only this replica's share of the unowned partitions"
            );
        }
        let mut claims = plan.claim;
        for steal in plan.steals {
            if let Some(o) = self.steal(h, steal).await {
                claims.push(o);
            }
        }
        claims
    }

    /// Carries out one [`Steal`](plan::Steal) of the plan: the claim to put to the store,
    /// if the partition is taken.
    async fn steal(&self, h: &Handovers, steal: plan::Steal) -> Option<Ownership> {
        match steal {
            plan::Steal::Overdue { ownership, owner } => {
                let p = ownership.partition_id.clone();
                if cooperate::owner_finishing(h, &p, &owner, self.deadline).await {
                    // The owner answered and is finishing what it holds: wait for it.
                    return None;
                }
                tracing::warn!(partition = %p, owner = %owner, "the owner did not answer the handover request within the ownership expiration ({:?}): taking the partition", self.expiration);
                self.state().at(&p).hold.stop_asking();
                Some(ownership)
            }
            plan::Steal::Ask {
                partition,
                owner,
                stale,
            } => {
                let asked =
                    cooperate::ask(h, &partition, &owner, stale.as_deref(), self.deadline).await;
                let mut st = self.state();
                let p = st.at(&partition);
                match asked {
                    Some(Asked::Mine) => {
                        p.hold.ask(owner);
                        p.theirs = None;
                    }
                    Some(Asked::Theirs(etag)) => {
                        let seen = p
                            .theirs
                            .as_ref()
                            .filter(|(e, _)| *e == etag)
                            .map(|(_, t)| *t);
                        p.theirs = Some((etag, seen.unwrap_or_else(Instant::now)));
                    }
                    None => {}
                }
                None
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
            st.partitions
                .iter()
                .filter(|(_, p)| p.may_read())
                .map(|(id, _)| id.clone())
                .collect()
        };
        if held.is_empty() {
            return;
        }
        cooperate::answer(h, &held, self.deadline, |r| {
            let mut st = self.state();
            let p = st.at(&r.partition);
            if let Some(stop) = &p.reader {
                stop.cancel();
            }
            p.hold.promise(r.asker);
        })
        .await;
    }

    /// Whether this replica holds a fresh claim on `partition` (what the tests check).
    #[cfg(test)]
    pub(in crate::pipeline) fn owns(&self, partition: &str) -> bool {
        self.state().fresh(partition, self.expiration).is_some()
    }
}
