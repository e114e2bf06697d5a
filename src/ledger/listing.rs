//! The pending index as last listed, kept in memory for the console's pages (when the ledger
//! is asked to keep it): one listing shared by every view, replaced by each later listing
//! (the overdue sweep lists every `dead_letter_sweep`; a view that finds it old asks for one
//! in the background), with this replica's own changes to the index applied as it writes
//! them — so a page answers from memory, in time that follows the rows it shows rather than
//! the retries waiting, and still shows at once what this replica scheduled or settled.
//!
//! A listing and this replica's writes may cross: a write acknowledged after a listing
//! started may be missing from it. So changes are numbered, and a listing installed applies
//! the changes made since it started on top of what it listed (applying one it already
//! holds changes nothing).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
#[cfg(any(test, feature = "cli"))]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

use tokio::time::Instant;

use super::Pending;
#[cfg(any(test, feature = "cli"))]
use super::{Ledger, LedgerError};
use crate::sync::LockExt;
#[cfg(any(test, feature = "cli"))]
use std::{sync::Arc, time::Duration};

/// Changes remembered for listings in flight; beyond this, those listings are not installed
/// (the kept one, with every change applied, stays until the next listing).
const CHANGES_KEPT: usize = 100_000;

/// A change this replica made to the pending index.
#[derive(Debug, Clone)]
enum Change {
    /// An entry written (created or moved).
    Wrote(Pending),
    /// `key`'s entry removed if it pointed at an attempt up to `ran` (as
    /// `Ledger::remove_entry` removes it).
    Removed { key: String, ran: u32 },
}

/// One listing with the changes since applied: each entry by key, and the keys soonest first.
#[derive(Debug, Default)]
struct Kept {
    entries: HashMap<String, Pending>,
    order: BTreeSet<(SystemTime, String)>,
    /// When the listing started (the monotonic clock).
    listed: Option<Instant>,
}

impl Kept {
    fn of(listed: &[Pending], started: Instant) -> Self {
        let mut k = Self {
            listed: Some(started),
            ..Self::default()
        };
        for p in listed {
            k.put(p.clone());
        }
        k
    }

    fn put(&mut self, p: Pending) {
        if let Some(old) = self.entries.remove(&p.key) {
            self.order.remove(&(old.due, old.key));
        }
        self.order.insert((p.due, p.key.clone()));
        self.entries.insert(p.key.clone(), p);
    }

    fn apply(&mut self, c: &Change) {
        match c {
            Change::Wrote(p) => self.put(p.clone()),
            Change::Removed { key, ran } => {
                if self.entries.get(key).is_some_and(|e| e.attempt <= *ran) {
                    if let Some(old) = self.entries.remove(key) {
                        self.order.remove(&(old.due, old.key));
                    }
                }
            }
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Listings are kept ([`Ledger::keep_pending_listing`]).
    keeping: bool,
    kept: Option<Kept>,
    /// Changes numbered so far.
    changes: u64,
    /// Changes made while a listing was in flight, with their numbers.
    log: VecDeque<(u64, Change)>,
    /// Listings in flight: their ticket → the number of changes when they started, or
    /// `None` once the log overflowed under them.
    in_flight: BTreeMap<u64, Option<u64>>,
}

impl State {
    fn change(&mut self, c: Change) {
        if !self.keeping {
            return;
        }
        self.changes += 1;
        if let Some(k) = &mut self.kept {
            k.apply(&c);
        }
        if !self.in_flight.is_empty() {
            self.log.push_back((self.changes, c));
            if self.log.len() > CHANGES_KEPT {
                self.log.clear();
                self.in_flight.values_mut().for_each(|s| *s = None);
            }
        }
    }

    /// Drops the changes no listing in flight needs.
    fn trim(&mut self) {
        match self.in_flight.values().flatten().min() {
            Some(&oldest) => self.log.retain(|(n, _)| *n > oldest),
            None => self.log.clear(),
        }
    }
}

/// The kept listing of one ledger (shared by its clones).
#[derive(Debug, Default)]
pub(super) struct Listing {
    state: Mutex<State>,
    tickets: AtomicU64,
    /// One listing at a time on behalf of the pages.
    #[cfg(any(test, feature = "cli"))]
    refresh: tokio::sync::Mutex<()>,
    /// A background refresh is under way.
    #[cfg(any(test, feature = "cli"))]
    refreshing: AtomicBool,
}

/// A listing in flight (dropped unfinished: forgotten).
pub(super) struct Ticket<'a> {
    listing: &'a Listing,
    id: u64,
    started: Instant,
}

impl Listing {
    /// A listing starts: `None` when listings are not kept.
    pub(super) fn start(&self) -> Option<Ticket<'_>> {
        let mut s = self.state.locked();
        if !s.keeping {
            return None;
        }
        let id = self.tickets.fetch_add(1, Ordering::Relaxed);
        let at = s.changes;
        s.in_flight.insert(id, Some(at));
        Some(Ticket {
            listing: self,
            id,
            started: Instant::now(),
        })
    }

    /// No listing in flight and no change remembered for one.
    #[cfg(test)]
    pub(super) fn idle(&self) -> bool {
        let s = self.state.locked();
        s.in_flight.is_empty() && s.log.is_empty()
    }

    /// This replica wrote `p`'s entry.
    pub(super) fn wrote(&self, p: Pending) {
        self.state.locked().change(Change::Wrote(p));
    }

    /// This replica removed `key`'s entry (one pointing at an attempt up to `ran`).
    pub(super) fn removed(&self, key: &str, ran: u32) {
        self.state.locked().change(Change::Removed {
            key: key.to_string(),
            ran,
        });
    }
}

impl Ticket<'_> {
    /// The listing finished with `listed`: it replaces the kept one unless a listing that
    /// started later was installed first, with the changes made since it started applied.
    pub(super) fn install(self, listed: &[Pending]) {
        // Built, and the one it replaces dropped, outside the lock: a page (or a write)
        // waits only for the changes to be applied.
        let mut kept = Kept::of(listed, self.started);
        let replaced = {
            let mut s = self.listing.state.locked();
            let Some(Some(at)) = s.in_flight.get(&self.id).copied() else {
                return; // the log overflowed under it: the kept one is more complete
            };
            if s.kept
                .as_ref()
                .and_then(|k| k.listed)
                .is_some_and(|l| l > self.started)
            {
                return;
            }
            for (_, c) in s.log.iter().filter(|(n, _)| *n > at) {
                kept.apply(c);
            }
            s.kept.replace(kept)
        };
        drop(replaced);
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut s = self.listing.state.locked();
        s.in_flight.remove(&self.id);
        s.trim();
    }
}

/// One page of the pending index as last listed ([`Ledger::pending_page`]).
#[cfg(any(test, feature = "cli"))]
#[derive(Debug, Clone)]
pub struct PendingPage {
    /// How long ago the listing it comes from started.
    pub age: Duration,
    /// Retries waiting.
    pub waiting: usize,
    /// Of those, how many the filter kept.
    pub matched: usize,
    /// The soonest due of those (at most the limit asked for), soonest first.
    pub soonest: Vec<Pending>,
}

#[cfg(any(test, feature = "cli"))]
impl Ledger {
    /// Keeps every later listing of the pending index in memory, with this replica's own
    /// changes to the index applied as it writes them, for [`pending_page`](Self::pending_page)
    /// (the console's pages). Costs the memory of one listing (the retries waiting, each
    /// with its key, last error excerpt and tags).
    pub fn keep_pending_listing(&self) {
        self.listing.state.locked().keeping = true;
    }

    /// One page of the pending index as last listed — the retries `keep` keeps, soonest
    /// first, at most `limit` — with the listing's age; from memory, no call. `None` before
    /// the first listing kept. Pages that must not be older than some age look at
    /// [`PendingPage::age`] and [`refresh_pending`](Self::refresh_pending).
    pub fn pending_page(
        &self,
        keep: impl Fn(&Pending) -> bool,
        limit: usize,
    ) -> Option<PendingPage> {
        let s = self.listing.state.locked();
        let k = s.kept.as_ref()?;
        let mut matched = 0usize;
        let mut soonest = Vec::new();
        for (_, key) in &k.order {
            let Some(p) = k.entries.get(key) else {
                continue;
            };
            if keep(p) {
                matched += 1;
                if soonest.len() < limit {
                    soonest.push(p.clone());
                }
            }
        }
        Some(PendingPage {
            age: k.listed.map_or(Duration::MAX, |l| l.elapsed()),
            waiting: k.entries.len(),
            matched,
            soonest,
        })
    }

    /// Lists the pending index unless the kept listing is younger than `fresh` (callers at
    /// once share one listing: the later ones find it fresh).
    pub async fn refresh_pending(&self, fresh: Duration) -> Result<(), LedgerError> {
        let _one = self.listing.refresh.lock().await;
        let age = {
            let s = self.listing.state.locked();
            s.kept.as_ref().and_then(|k| k.listed).map(|l| l.elapsed())
        };
        if age.is_some_and(|a| a < fresh) {
            return Ok(());
        }
        self.pending().await.map(|_| ())
    }

    /// [`refresh_pending`](Self::refresh_pending) on a task of its own, unless one is under
    /// way; a failure is logged (the kept listing stays, and its age says how old it is).
    pub fn refresh_pending_soon(&self, fresh: Duration) {
        if self.listing.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        /// Clears the flag however the task ends.
        struct Done(Arc<Listing>);
        impl Drop for Done {
            fn drop(&mut self) {
                self.0.refreshing.store(false, Ordering::Release);
            }
        }
        let ledger = self.clone();
        let done = Done(Arc::clone(&self.listing));
        tokio::spawn(async move {
            let _done = done;
            if let Err(e) = ledger.refresh_pending(fresh).await {
                tracing::warn!(error = %e, "could not list the pending index for the console; its pages show the listing before, with its age");
            }
        });
    }
}
