//! The checkpoint guard's pure core: which position a partition may checkpoint.
//!
//! Events are dispatched in partition order and settle in any order; the checkpoint may only
//! move to the last event of the *contiguous settled prefix* — never past an unsettled event.
//!
//! [`Dispatcher`] adds concurrency within a partition on top of the window: up to
//! `max_in_flight` events are in their handler call at once (and as many settling), events
//! that share an ordering key start strictly one after another in sequence order, and the
//! checkpoint still only covers the contiguous settled prefix.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// Tracks dispatched and settled events of one partition.
#[derive(Debug, Default, Clone)]
pub struct CheckpointWindow {
    /// Dispatched, in sequence order: settled or not.
    pending: BTreeMap<i64, bool>,
    /// The last event of the settled prefix that left the window.
    settled_through: Option<i64>,
    /// Dispatched events not settled yet.
    unsettled: usize,
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
        if self.pending.insert(seq, false).is_none() {
            self.unsettled += 1;
        }
    }

    /// Records that `seq` settled; returns the new checkpoint position if it moved.
    pub fn settled(&mut self, seq: i64) -> Option<i64> {
        if let Some(s) = self.pending.get_mut(&seq) {
            if !*s {
                self.unsettled -= 1;
            }
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
    #[cfg(test)]
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

    /// Events dispatched and not settled.
    pub fn unsettled(&self) -> usize {
        self.unsettled
    }

    /// Whether `seq` was dispatched and has not settled.
    pub fn is_unsettled(&self, seq: i64) -> bool {
        self.pending.get(&seq) == Some(&false)
    }
}

/// Decides which events of one partition may start, given `max_in_flight` and ordering keys.
///
/// An event holds one of `max_in_flight` slots from [`accept`](Self::accept) until its
/// handler call ends ([`answered`](Self::answered)), then one of `max_in_flight` settling
/// places until it settles; it stays in the window until it leaves the checkpoint window
/// (settled events behind an unsettled one still count). So a partition whose oldest event
/// cannot settle stops reading after at most `window` events, and one whose settlements all
/// hold after `2 × max_in_flight` (memory stays bounded and the backlog waits in Event
/// Hubs). An event whose key has an earlier event in flight waits for it: same-key events
/// start in sequence order, one at a time. Events without a key are not ordered against
/// anything.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    max_in_flight: usize,
    /// Most events in the window (settled ones behind an unsettled one included).
    window_limit: usize,
    window: CheckpointWindow,
    /// Events whose handler call ended and that are still settling (see
    /// [`answered`](Self::answered)).
    settling: BTreeSet<i64>,
    /// Keys with an event running → the events waiting behind it, in sequence order.
    busy: HashMap<String, VecDeque<i64>>,
    /// The key of every accepted, unsettled event.
    keys: HashMap<i64, String>,
}

impl Dispatcher {
    /// A dispatcher allowing `max_in_flight` (at least 1) events out at once.
    #[cfg(test)]
    pub fn new(max_in_flight: usize) -> Self {
        Self::with_window(max_in_flight, max_in_flight)
    }

    /// A dispatcher allowing `max_in_flight` (at least 1) unsettled events at once, and at
    /// most `window` (at least `max_in_flight`) events read past the oldest unsettled one.
    /// A window wider than `max_in_flight` keeps the slots busy while a slow event (one
    /// scheduling a retry, say) settles: events behind it that settled wait in the window,
    /// not in a slot. An event that cannot settle still stops reading after `window` events.
    pub fn with_window(max_in_flight: usize, window: usize) -> Self {
        let max_in_flight = max_in_flight.max(1);
        Self {
            max_in_flight,
            window_limit: window.max(max_in_flight),
            window: CheckpointWindow::new(),
            settling: BTreeSet::new(),
            busy: HashMap::new(),
            keys: HashMap::new(),
        }
    }

    /// Whether another event may be read now: fewer than `max_in_flight` events before or in
    /// their handler call, fewer than `max_in_flight` settling, and room in the window.
    pub fn has_room(&self) -> bool {
        let settling = self.settling.len();
        self.window.unsettled() - settling < self.max_in_flight
            && settling < self.max_in_flight
            && self.window.in_flight() < self.window_limit
    }

    /// Records that `seq`'s handler call ended: while it settles (a retry scheduled, say, a
    /// ledger write and a Service Bus send) its slot goes to the next event, so a failure's
    /// settlement does not idle a slot the downstream could use. At most `max_in_flight`
    /// events settle at once, so a settlement that holds (Service Bus down) still stops the
    /// reading, after twice as many events. A `seq` already settled is ignored.
    pub fn answered(&mut self, seq: i64) {
        if self.window.is_unsettled(seq) {
            self.settling.insert(seq);
        }
    }

    /// Events accepted and not settled (running, or waiting behind their key).
    #[cfg(test)]
    pub fn unsettled(&self) -> usize {
        self.window.unsettled()
    }

    /// Accepts event `seq` (sequence numbers increase) with its ordering key; `true` if it may
    /// start now, `false` if it waits behind an earlier event with the same key (it is
    /// returned by [`settled`](Self::settled) when its turn comes).
    pub fn accept(&mut self, seq: i64, key: Option<&str>) -> bool {
        self.window.dispatched(seq);
        let Some(key) = key else {
            return true;
        };
        self.keys.insert(seq, key.to_string());
        match self.busy.get_mut(key) {
            Some(waiting) => {
                waiting.push_back(seq);
                false
            }
            None => {
                self.busy.insert(key.to_string(), VecDeque::new());
                true
            }
        }
    }

    /// Records that `seq` settled. Returns the event that may start now (the next one with
    /// the same key, if any) and the new checkpoint position if it moved.
    pub fn settled(&mut self, seq: i64) -> (Option<i64>, Option<i64>) {
        self.settling.remove(&seq);
        let mut next = None;
        if let Some(key) = self.keys.remove(&seq) {
            if let Some(waiting) = self.busy.get_mut(&key) {
                next = waiting.pop_front();
                if next.is_none() {
                    self.busy.remove(&key);
                }
            }
        }
        (next, self.window.settled(seq))
    }

    /// The last event the checkpoint may cover.
    #[cfg(test)]
    pub fn checkpoint(&self) -> Option<i64> {
        self.window.checkpoint()
    }

    /// The oldest unsettled event.
    pub fn oldest_unsettled(&self) -> Option<i64> {
        self.window.oldest_unsettled()
    }

    /// Events answered and not settled.
    #[cfg(test)]
    pub fn settling(&self) -> usize {
        self.settling.len()
    }

    /// Events accepted and not yet out of the window.
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.window.in_flight()
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

    /// Drives a dispatcher with a random arrival of keyed events and a random completion
    /// order; checks against a model that (1) same-key events start in sequence order and
    /// never two at once, (2) never more than `max` events are in the window, (3) the
    /// checkpoint is always the contiguous settled prefix, and (4) everything finishes.
    fn drive(
        max: usize,
        keys: &[Option<u8>],
        picks: &[prop::sample::Index],
    ) -> Result<(), TestCaseError> {
        drive_windowed(max, max, keys, picks)
    }

    /// [`drive`] with a window wider than `max`: never more than `max` unsettled, never more
    /// than `window` in the window.
    fn drive_windowed(
        max: usize,
        window: usize,
        keys: &[Option<u8>],
        picks: &[prop::sample::Index],
    ) -> Result<(), TestCaseError> {
        let mut d = Dispatcher::with_window(max, window);
        let n = keys.len();
        let key = |i: usize| keys[i].map(|k| format!("k{k}"));
        let mut next_to_read = 0usize;
        let mut running: Vec<usize> = Vec::new();
        let mut settled = vec![false; n];
        let mut started: Vec<usize> = Vec::new();
        let mut answered = std::collections::HashSet::new();
        let mut picks = picks.iter().cycle();
        let mut steps = 0;
        while settled.iter().any(|s| !s) {
            steps += 1;
            prop_assert!(steps < 20 * n + 20, "no progress");
            let pick = picks.next().map(|p| p.index(1000)).unwrap_or(0);
            // Read when there is room and (by the pick) or when nothing runs.
            if next_to_read < n && d.has_room() && (pick.is_multiple_of(2) || running.is_empty()) {
                let i = next_to_read;
                next_to_read += 1;
                if d.accept(i as i64, key(i).as_deref()) {
                    running.push(i);
                    started.push(i);
                }
                // Read only with a slot free and a settling place free.
                prop_assert!(d.unsettled() - d.settling() <= max);
                prop_assert!(d.settling() <= max);
                prop_assert!(d.unsettled() <= 2 * max);
                prop_assert!(d.in_flight() <= window.max(max));
                continue;
            }
            prop_assert!(!running.is_empty(), "stalled with nothing running");
            // Some handler calls end before their event settles: the slot goes, the settling
            // place is taken (an answer after the settlement is ignored).
            let unanswered = running.iter().find(|r| !answered.contains(*r)).copied();
            if let Some(i) = unanswered.filter(|_| pick % 3 == 1) {
                answered.insert(i);
                d.answered(i as i64);
                prop_assert!(d.unsettled() <= 2 * max);
                continue;
            }
            let i = running.remove(pick % running.len());
            settled[i] = true;
            let (next, _) = d.settled(i as i64);
            if let Some(j) = next {
                let j = j as usize;
                prop_assert_eq!(key(j), key(i));
                running.push(j);
                started.push(j);
            }
            // Never two running events with one key.
            let mut seen = std::collections::HashSet::new();
            for r in &running {
                if let Some(k) = key(*r) {
                    prop_assert!(seen.insert(k), "two events with one key at once");
                }
            }
            let prefix = settled.iter().take_while(|s| **s).count();
            let expected = if prefix == 0 {
                None
            } else {
                Some(prefix as i64 - 1)
            };
            prop_assert_eq!(d.checkpoint(), expected);
        }
        // Same-key events started in sequence order.
        for k in 0..=255u8 {
            let order: Vec<usize> = started
                .iter()
                .copied()
                .filter(|i| keys[*i] == Some(k))
                .collect();
            prop_assert!(
                order.windows(2).all(|w| w[0] < w[1]),
                "key {} out of order: {:?}",
                k,
                order
            );
        }
        prop_assert_eq!(started.len(), n);
        prop_assert_eq!(d.checkpoint(), Some(n as i64 - 1));
        prop_assert_eq!(d.in_flight(), 0);
        Ok(())
    }

    #[test]
    fn same_key_waits_and_other_keys_run() {
        let mut d = Dispatcher::new(4);
        assert!(d.accept(0, Some("a")));
        assert!(!d.accept(1, Some("a")));
        assert!(d.accept(2, Some("b")));
        assert!(d.accept(3, None));
        assert!(!d.has_room());
        assert_eq!(d.settled(2), (None, None));
        assert_eq!(d.settled(3), (None, None));
        assert_eq!(d.settled(0), (Some(1), Some(0)));
        assert_eq!(d.oldest_unsettled(), Some(1));
        assert_eq!(d.settled(1), (None, Some(3)));
        assert_eq!(d.in_flight(), 0);
        assert!(d.accept(4, Some("a")), "the key is free again");
    }

    proptest! {
        #[test]
        fn keyed_dispatch_keeps_order_bounds_and_the_prefix(
            max in 1usize..12,
            keys in proptest::collection::vec(proptest::option::weighted(0.8, 0u8..5), 1..80),
            picks in proptest::collection::vec(any::<prop::sample::Index>(), 1..200),
        ) {
            drive(max, &keys, &picks)?;
        }

        #[test]
        fn a_wider_window_keeps_order_bounds_and_the_prefix(
            max in 1usize..12,
            extra in 0usize..30,
            keys in proptest::collection::vec(proptest::option::weighted(0.8, 0u8..5), 1..80),
            picks in proptest::collection::vec(any::<prop::sample::Index>(), 1..200),
        ) {
            drive_windowed(max, max + extra, &keys, &picks)?;
        }
    }

    #[test]
    fn an_answered_event_leaves_its_slot_while_it_settles() {
        // Four slots, all in their handler call: no room.
        let mut d = Dispatcher::with_window(4, 16);
        for s in 0..4 {
            assert!(d.accept(s, None));
        }
        assert!(!d.has_room());
        // Two calls end (their retries being scheduled): their slots go to the next two.
        d.answered(1);
        d.answered(2);
        d.answered(2);
        assert_eq!(d.settling(), 2);
        assert!(d.has_room());
        assert!(d.accept(4, None));
        assert!(d.accept(5, None));
        assert!(!d.has_room());
        // Settling places are bounded too: settlements that all hold (Service Bus down)
        // stop the reading after twice the slots.
        for s in [0, 3, 4, 5] {
            d.answered(s);
        }
        assert_eq!(d.settling(), 6);
        assert!(
            !d.has_room(),
            "four slots free, but four settling already at most"
        );
        assert_eq!(d.checkpoint(), None, "never past an unsettled event");
        d.settled(1);
        d.settled(2);
        assert!(!d.has_room(), "no call in flight, but four settling");
        d.settled(4);
        assert!(d.has_room());
        // An answer for an event settled already (its settlement raced the message) is
        // ignored.
        d.answered(1);
        assert_eq!(d.settling(), 3);
        for s in [0, 3, 5] {
            d.settled(s);
        }
        assert_eq!(
            (d.settling(), d.unsettled(), d.checkpoint()),
            (0, 0, Some(5))
        );
    }

    #[test]
    fn a_slow_oldest_event_does_not_take_the_slots_of_settled_ones_behind_it() {
        // The oldest event is slow to settle (a retry being scheduled); the 3 behind it
        // settle at once. With the window only as wide as the slots, they keep their slots
        // until the oldest settles; with a wider window the slots are free again.
        let mut narrow = Dispatcher::new(4);
        let mut wide = Dispatcher::with_window(4, 16);
        for d in [&mut narrow, &mut wide] {
            for s in 0..4 {
                assert!(d.accept(s, None));
            }
            for s in 1..4 {
                d.settled(s);
            }
            assert_eq!(d.unsettled(), 1);
            assert_eq!(d.checkpoint(), None, "never past the unsettled oldest");
        }
        assert!(!narrow.has_room());
        assert!(wide.has_room());
        // The wide window still stops reading once `window` events wait behind the oldest.
        let mut s = 4;
        while wide.has_room() {
            wide.accept(s, None);
            wide.settled(s);
            s += 1;
        }
        assert_eq!(wide.in_flight(), 16);
        wide.settled(0);
        assert_eq!(wide.checkpoint(), Some(s - 1));
        assert!(wide.has_room());
    }
}
