//! The checkpoint guard's pure core: which position a partition may checkpoint.
//!
//! Events are dispatched in partition order and settle in any order; the checkpoint may only
//! move to the last event of the *contiguous settled prefix* — never past an unsettled event.

use std::collections::BTreeMap;

/// Tracks dispatched and settled events of one partition.
#[derive(Debug, Default, Clone)]
pub struct CheckpointWindow {
    /// Dispatched, in sequence order: settled or not.
    pending: BTreeMap<i64, bool>,
    /// The last event of the settled prefix that left the window.
    settled_through: Option<i64>,
}

impl CheckpointWindow {
    /// An empty window.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `seq` was dispatched. Sequence numbers must increase.
    pub fn dispatched(&mut self, seq: i64) {
        debug_assert!(self
            .pending
            .keys()
            .next_back()
            .is_none_or(|last| *last < seq));
        self.pending.insert(seq, false);
    }

    /// Records that `seq` settled; returns the new checkpoint position if it moved.
    pub fn settled(&mut self, seq: i64) -> Option<i64> {
        if let Some(s) = self.pending.get_mut(&seq) {
            *s = true;
        }
        let mut moved = None;
        while let Some((&first, &done)) = self.pending.iter().next() {
            if !done {
                break;
            }
            self.pending.remove(&first);
            self.settled_through = Some(first);
            moved = Some(first);
        }
        moved
    }

    /// The last event the checkpoint may cover.
    pub fn checkpoint(&self) -> Option<i64> {
        self.settled_through
    }

    /// The oldest unsettled event, if any.
    pub fn oldest_unsettled(&self) -> Option<i64> {
        self.pending
            .iter()
            .find(|(_, done)| !**done)
            .map(|(s, _)| *s)
    }

    /// Events dispatched and not yet out of the window.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn checkpoint_waits_for_the_gap() {
        let mut w = CheckpointWindow::new();
        for s in 10..15 {
            w.dispatched(s);
        }
        assert_eq!(w.settled(11), None);
        assert_eq!(w.settled(12), None);
        assert_eq!(w.checkpoint(), None);
        assert_eq!(w.oldest_unsettled(), Some(10));
        assert_eq!(w.settled(10), Some(12));
        assert_eq!(w.settled(14), None);
        assert_eq!(w.checkpoint(), Some(12));
        assert_eq!(w.settled(13), Some(14));
        assert_eq!(w.in_flight(), 0);
    }

    proptest! {
        /// Against a plain model: the checkpoint is the largest s such that every dispatched
        /// event ≤ s settled.
        #[test]
        fn matches_the_reference_model(n in 1usize..60, order in proptest::collection::vec(any::<prop::sample::Index>(), 1..120)) {
            let seqs: Vec<i64> = (0..n as i64).map(|i| 100 + i * 3).collect();
            let mut w = CheckpointWindow::new();
            for s in &seqs { w.dispatched(*s); }
            let mut settled = vec![false; n];
            for idx in order {
                let i = idx.index(n);
                settled[i] = true;
                w.settled(seqs[i]);
                let model = settled.iter().take_while(|d| **d).count();
                let expected = if model == 0 { None } else { Some(seqs[model - 1]) };
                prop_assert_eq!(w.checkpoint(), expected);
                let unsettled = settled.iter().position(|d| !*d).map(|i| seqs[i]);
                prop_assert_eq!(w.oldest_unsettled(), unsettled);
            }
        }
    }
}
