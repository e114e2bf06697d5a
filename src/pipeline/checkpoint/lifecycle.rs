//! One partition as this replica's fence knows it: one value per partition (a map of
//! structs, not a struct of maps), whose [`Hold`] says in one place whether this replica
//! holds it, asks for it, or is giving it away.
//!
//! - `Free` → `Asking { owner, since }`: this replica asked the live owner for it;
//! - `Free` or `Asking` → `Claimed(claim)`: claimed — unowned, expired, handed over, or
//!   taken from an owner that left the request unanswered for the expiration;
//! - `Claimed` → `Giving { to, claim }`: the replica `to` asked for it;
//! - `Giving` → `Free`: written over to `to` once no task reads it;
//! - `Claimed` or `Giving` → `Free`: another owner is listed, or it is released at a stop;
//! - `Claimed` → `Reopening`: its task ended while this replica still holds it, and the
//!   processor may still count its client as reading (a client whose `close()` failed stays
//!   in the SDK's map, which then never hands the partition out again): it is hidden from the
//!   processor for one cycle (renewed, so no other replica takes it), which makes the SDK drop
//!   the client, and shown again at the next, which makes it hand the partition out afresh;
//! - `Reopening` → `Claimed`: the cycle after it was hidden.
//!
//! The task reading a partition is beside the hold, not in it: the processor starts and
//! ends it, and it may outlive this replica's claim (another owner listed, or the owner id
//! lost: its checkpoints are refused from then on) until its stream ends.

use azure_messaging_eventhubs::models::Ownership;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// This replica's claim on a partition.
#[derive(Debug, Clone)]
pub(super) struct Claim {
    /// When this replica last claimed (or renewed) it.
    pub(super) at: Instant,
    /// The ownership as claimed (with its ETag): what releasing or handing it over writes.
    pub(super) ownership: Ownership,
}

/// This replica's hold on one partition.
#[derive(Debug, Default)]
pub(super) enum Hold {
    /// Neither held nor asked for by this replica.
    #[default]
    Free,
    /// This replica asked `owner` to hand it over, at `since`; not held.
    Asking {
        /// The owner asked.
        owner: String,
        /// When.
        since: Instant,
    },
    /// Held: the processor may read it.
    Claimed(Claim),
    /// Held, and to be handed out to a new task: hidden from the processor at the next claim
    /// (`hidden` from then), shown again at the one after.
    Reopening {
        /// The claim.
        claim: Claim,
        /// Hidden from the processor at the last claim: shown (claimed) at the next.
        hidden: bool,
    },
    /// Promised to the replica `to`, which asked for it: hidden from the processor, renewed
    /// while its task finishes, then written over to `to` with the claim's ETag. The claim is
    /// `None` while this process does not hold its owner id: the promise stands and is kept
    /// if the partition is claimed again.
    Giving {
        /// The asker.
        to: String,
        /// The claim, when held.
        claim: Option<Claim>,
    },
}

impl Hold {
    /// The claim, when this replica holds the partition.
    pub(super) fn claim(&self) -> Option<&Claim> {
        match self {
            Self::Claimed(c)
            | Self::Reopening { claim: c, .. }
            | Self::Giving { claim: Some(c), .. } => Some(c),
            _ => None,
        }
    }

    /// The claim, if it was renewed within `expiration`: only then are checkpoints let
    /// through.
    pub(super) fn fresh(&self, expiration: std::time::Duration) -> Option<&Claim> {
        self.claim().filter(|c| c.at.elapsed() < expiration)
    }

    /// Whether the partition is promised to another replica.
    pub(super) fn giving(&self) -> bool {
        matches!(self, Self::Giving { .. })
    }

    /// Whether the processor is not told this replica owns it (though it does): promised to
    /// another replica, or hidden for one cycle to be handed out afresh.
    pub(super) fn hidden(&self) -> bool {
        matches!(
            self,
            Self::Giving { .. } | Self::Reopening { hidden: true, .. }
        )
    }

    /// Its task ended while this replica holds it: handed out afresh (see [`Hold::Reopening`]),
    /// hidden from the processor from the next claim on, or from this one (`now`: the
    /// claim of this cycle is already renewed).
    pub(super) fn reopen(&mut self, now: bool) {
        if !matches!(self, Self::Claimed(_)) {
            return;
        }
        if let Self::Claimed(claim) = std::mem::take(self) {
            *self = Self::Reopening { claim, hidden: now };
        }
    }

    /// This replica's pending request: the owner asked, and since when.
    pub(super) fn asking(&self) -> Option<(&str, Instant)> {
        match self {
            Self::Asking { owner, since } => Some((owner, *since)),
            _ => None,
        }
    }

    /// Claimed (or renewed) with `claim`; `true` if this replica had asked for it (its
    /// request is answered).
    pub(super) fn claimed(&mut self, claim: Claim) -> bool {
        match self {
            Self::Giving { claim: held, .. } => {
                *held = Some(claim);
                false
            }
            Self::Asking { .. } => {
                *self = Self::Claimed(claim);
                true
            }
            Self::Reopening { hidden: false, .. } => {
                *self = Self::Reopening {
                    claim,
                    hidden: true,
                };
                false
            }
            Self::Free | Self::Claimed(_) | Self::Reopening { hidden: true, .. } => {
                *self = Self::Claimed(claim);
                false
            }
        }
    }

    /// Renewed with `claim` while stopping: only a partition still held.
    pub(super) fn renewed(&mut self, claim: Claim) {
        match self {
            Self::Claimed(c)
            | Self::Reopening { claim: c, .. }
            | Self::Giving { claim: Some(c), .. } => *c = claim,
            _ => {}
        }
    }

    /// This process does not hold its owner id: the claim is dropped (a promise stands).
    pub(super) fn drop_claim(&mut self) {
        match self {
            Self::Claimed(_) | Self::Reopening { .. } => *self = Self::Free,
            Self::Giving { claim, .. } => *claim = None,
            Self::Free | Self::Asking { .. } => {}
        }
    }

    /// Another owner is listed: the claim, and any promise, are lost (a request stands).
    pub(super) fn lost(&mut self) {
        if matches!(
            self,
            Self::Claimed(_) | Self::Reopening { .. } | Self::Giving { .. }
        ) {
            *self = Self::Free;
        }
    }

    /// Asked for by `to`: promised to it.
    pub(super) fn promise(&mut self, to: String) {
        let claim = match std::mem::take(self) {
            Self::Claimed(c) | Self::Reopening { claim: c, .. } => Some(c),
            Self::Giving { claim, .. } => claim,
            Self::Free | Self::Asking { .. } => None,
        };
        *self = Self::Giving { to, claim };
    }

    /// This replica asked `owner` for it, now (it does not hold it).
    pub(super) fn ask(&mut self, owner: String) {
        if matches!(self, Self::Free | Self::Asking { .. }) {
            *self = Self::Asking {
                owner,
                since: Instant::now(),
            };
        }
    }

    /// Its request is given up (the partition is taken instead).
    pub(super) fn stop_asking(&mut self) {
        if matches!(self, Self::Asking { .. }) {
            *self = Self::Free;
        }
    }

    /// To hand over now: the claimed ownership and the asker, if promised and held; the
    /// partition is no longer this replica's either way.
    pub(super) fn take_handover(&mut self) -> Option<(Ownership, String)> {
        match std::mem::take(self) {
            Self::Giving { to, claim } => claim.map(|c| (c.ownership, to)),
            Self::Claimed(_) | Self::Reopening { .. } => None,
            other => {
                *self = other;
                None
            }
        }
    }

    /// To release: the claimed ownership, if held and not promised.
    pub(super) fn take_release(&mut self) -> Option<Ownership> {
        match std::mem::take(self) {
            Self::Claimed(c) | Self::Reopening { claim: c, .. } => Some(c.ownership),
            other => {
                *self = other;
                None
            }
        }
    }

    /// Everything given up at shutdown: the claimed ownership, if held (a request stands).
    pub(super) fn take_all(&mut self) -> Option<Ownership> {
        match std::mem::take(self) {
            Self::Claimed(c)
            | Self::Reopening { claim: c, .. }
            | Self::Giving { claim: Some(c), .. } => Some(c.ownership),
            Self::Giving { claim: None, .. } => None,
            other => {
                *self = other;
                None
            }
        }
    }
}

/// One partition, as this replica knows it.
#[derive(Debug, Default)]
pub(super) struct Partition {
    /// This replica's hold on it.
    pub(super) hold: Hold,
    /// The task reading it, if any: what tells that task to stop reading (and finish).
    pub(super) reader: Option<CancellationToken>,
    /// The highest sequence number checkpointed (by any replica, as listed, or here).
    pub(super) written: Option<i64>,
    /// Another asker's handover request seen here: its ETag, unchanged since when.
    pub(super) theirs: Option<(String, Instant)>,
    /// Since when no replica has held a live claim on it (the listing says).
    pub(super) unowned_since: Option<Instant>,
    /// Its checkpoint blob, when that holds no usable position (not claimed until repaired).
    pub(super) poisoned: Option<String>,
    /// Since when it has been held and shown to the processor with no task reading it.
    pub(super) unread_since: Option<Instant>,
}

impl Partition {
    /// Whether a partition task may start reading it, unless the replica is stopping: held
    /// and not promised to another replica.
    pub(super) fn may_read(&self) -> bool {
        matches!(self.hold, Hold::Claimed(_))
    }

    /// Another owner is listed: the hold is lost, and its task told to stop reading (the
    /// processor's revocation does the same, unless closing the receiver fails, which leaves
    /// the stream waiting for good).
    pub(super) fn lost(&mut self) {
        if self.hold.claim().is_some() || self.hold.giving() {
            self.stop_reader();
        }
        self.hold.lost();
    }

    /// This process does not hold its owner id: the claim is dropped and its task told to
    /// stop reading (a promise stands).
    pub(super) fn drop_claim(&mut self) {
        if self.hold.claim().is_some() {
            self.stop_reader();
        }
        self.hold.drop_claim();
    }

    fn stop_reader(&self) {
        if let Some(r) = &self.reader {
            r.cancel();
        }
    }

    /// Raises the checkpoint floor to `seq` (never lowers it).
    pub(super) fn wrote(&mut self, seq: i64) {
        self.written = Some(self.written.map_or(seq, |w| w.max(seq)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(etag: &str) -> Claim {
        Claim {
            at: Instant::now(),
            ownership: Ownership {
                partition_id: "0".into(),
                etag: Some(etag.into()),
                ..Default::default()
            },
        }
    }

    fn etag(o: Option<Ownership>) -> Option<String> {
        o.and_then(|o| o.etag.map(|e| e.to_string()))
    }

    #[tokio::test(start_paused = true)]
    async fn asked_then_claimed_then_promised_then_written_over() {
        let mut h = Hold::default();
        assert!(h.claim().is_none() && h.asking().is_none());
        h.ask("o".into());
        assert_eq!(h.asking().map(|(o, _)| o), Some("o"));
        assert!(h.claimed(claim("1")), "the request is answered");
        assert!(h.asking().is_none() && !h.giving());
        assert!(!h.claimed(claim("2")), "a renewal answers nothing");
        // A replica holding it asks nothing.
        h.ask("x".into());
        assert!(h.asking().is_none());
        h.promise("b".into());
        assert!(h.giving() && h.claim().is_some());
        // Renewed while it finishes, still promised.
        h.claimed(claim("3"));
        assert!(h.giving());
        assert_eq!(
            h.take_handover().map(|(o, to)| (etag(Some(o)), to)),
            Some((Some("3".into()), "b".into()))
        );
        assert!(matches!(h, Hold::Free));
    }

    #[tokio::test(start_paused = true)]
    async fn a_promise_outlives_the_owner_id_but_not_another_owner() {
        let mut h = Hold::Claimed(claim("1"));
        h.promise("b".into());
        h.drop_claim();
        assert!(h.giving() && h.claim().is_none(), "the promise stands");
        h.renewed(claim("2"));
        assert!(h.claim().is_none(), "only a held partition is renewed");
        h.claimed(claim("3"));
        assert_eq!(etag(h.take_all()), Some("3".into()));
        let mut h = Hold::Giving {
            to: "b".into(),
            claim: Some(claim("1")),
        };
        h.lost();
        assert!(matches!(h, Hold::Free));
        let mut h = Hold::Asking {
            owner: "o".into(),
            since: Instant::now(),
        };
        h.lost();
        h.drop_claim();
        assert!(h.asking().is_some(), "a request stands");
        assert!(h.take_all().is_none() && h.asking().is_some());
        h.stop_asking();
        assert!(matches!(h, Hold::Free));
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_is_fresh_within_the_expiration_and_only_a_claimed_one_is_read() {
        let expiration = std::time::Duration::from_secs(30);
        let mut p = Partition::default();
        assert!(!p.may_read());
        p.hold.claimed(claim("1"));
        assert!(p.may_read() && p.hold.fresh(expiration).is_some());
        tokio::time::advance(expiration).await;
        assert!(p.hold.fresh(expiration).is_none());
        assert_eq!(etag(p.hold.take_release()), Some("1".into()));
        p.hold.promise("b".into());
        assert!(!p.may_read() && p.hold.take_release().is_none() && p.hold.giving());
        p.wrote(5);
        p.wrote(3);
        assert_eq!(p.written, Some(5));
    }
}
