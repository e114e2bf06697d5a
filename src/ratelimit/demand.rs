//! Shares that follow demand: each replica's part of the deployment's rate, from what every
//! replica says it can use, agreed through one compare-and-swap record
//! (`ratelimit-shares/{downstream}`) and never adding up to more than the whole.
//!
//! Every replica keeps one [`Entry`] in the [`SharesRecord`]: the share it has *committed*
//! to (it never paces faster than that) and its demand — a backlog (it could use every
//! request it gets) or the part of the rate it used lately, with a little room to grow. At
//! each tick a replica reads the record and takes one [`step`]:
//!
//! - Its target is the max-min fair split of the whole over the live replicas' demands
//!   ([`fair`]): a replica that needs less than an equal part gets what it needs, the rest is
//!   split among those with a backlog; what nobody asks for is split evenly.
//! - **Down at once, up only into what is free.** A lower share is used from the moment it
//!   is decided (before it is written); a higher one only after the compare-and-swap that
//!   raises it committed, and only up to `1 − Σ` the others' committed shares. The record
//!   is changed only by compare-and-swap, so at every instant the committed shares add up to
//!   at most 1 and every replica paces at or below its committed share: no coordinator, and
//!   no second above the limit, through any join, leave or change of demand.
//! - **Leases on the monotonic clock.** Every write bumps the entry's `beat`. A replica paces
//!   on its share only while its last successful write was *sent* less than the lease ago;
//!   another replica drops an entry whose `beat` it has seen unchanged for longer than the
//!   lease and a tick (it first saw that beat after the write was sent), so a share is
//!   taken over only once its holder has stopped using it — whatever the hosts' wall clocks
//!   say, and also when the holder was frozen. A replica stopping cleanly withdraws its
//!   entry at once.
//!
//! Everything here is pure: times are arguments (the tokio clock, which tests pause).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Where the shares of `downstream` are agreed in the record store.
pub fn record_name(downstream: &str) -> String {
    format!("ratelimit-shares/{downstream}")
}

/// What a replica can use of the deployment's rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Demand {
    /// A backlog: it could use all of it.
    Backlog,
    /// About this share of the deployment's rate (0..=1), no more.
    UpTo(f64),
}

impl Demand {
    fn cap(self) -> f64 {
        match self {
            Self::Backlog => f64::INFINITY,
            Self::UpTo(d) => d.clamp(0.0, 1.0),
        }
    }
}

/// A replica's entry in the shares record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The share of the deployment's rate it may pace at (0..=1).
    pub share: f64,
    /// What it can use: `null` for a backlog, else a share of the rate.
    pub demand: Option<f64>,
    /// Changed by every write of this entry (random at its creation, then one up): the
    /// others see it alive by seeing it change.
    pub beat: u64,
}

impl Entry {
    /// Its demand.
    pub fn demand(&self) -> Demand {
        self.demand.map_or(Demand::Backlog, Demand::UpTo)
    }
}

/// Every replica's entry (owner id → entry).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SharesRecord {
    /// The replicas.
    #[serde(default)]
    pub replicas: BTreeMap<String, Entry>,
}

/// Shares are kept in millionths, rounded down, so that sums stay exact enough.
fn floor6(x: f64) -> f64 {
    (x.clamp(0.0, 1.0) * 1e6).floor() / 1e6
}

/// The max-min fair split of 1 over `demands` (water filling): each gets its demand if it is
/// below an equal part of what is left, the rest share what remains; what no demand takes
/// is split evenly over all. Sums to at most 1.
pub fn fair(demands: &[Demand]) -> Vec<f64> {
    let n = demands.len();
    let mut out = vec![0.0; n];
    if n == 0 {
        return out;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|a, b| demands[*a].cap().total_cmp(&demands[*b].cap()));
    let mut left = 1.0f64;
    for (i, idx) in order.iter().enumerate() {
        let part = left / (n - i) as f64;
        let got = demands[*idx].cap().min(part);
        out[*idx] = got;
        left -= got;
    }
    let extra = left.max(0.0) / n as f64;
    out.iter_mut().for_each(|s| *s = floor6(*s + extra));
    out
}

/// Which beat of each replica's entry this replica has seen, and since when.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    beats: HashMap<String, (u64, Instant)>,
}

impl Seen {
    /// The record as read at `now`.
    pub fn observe(&mut self, record: &SharesRecord, now: Instant) {
        self.beats.retain(|k, _| record.replicas.contains_key(k));
        for (name, e) in &record.replicas {
            match self.beats.get_mut(name) {
                Some((beat, _)) if *beat == e.beat => {}
                _ => {
                    self.beats.insert(name.clone(), (e.beat, now));
                }
            }
        }
    }

    /// Whether `name`'s entry has shown the same beat for `after` or longer at `now`.
    pub fn stale(&self, name: &str, now: Instant, after: Duration) -> bool {
        self.beats
            .get(name)
            .is_some_and(|(_, since)| now.saturating_duration_since(*since) >= after)
    }
}

/// What one replica decided at one tick.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Pace at most at this share from now on, before anything is written: the lower of
    /// what the record holds for this replica and the new share.
    pub now_at_most: f64,
    /// The record to write (`None`: nothing to change); once written, pace at `share`.
    pub write: Option<SharesRecord>,
    /// This replica's share once the write committed (or as it stands without one).
    pub share: f64,
}

/// The tick's inputs besides the record.
#[derive(Debug, Clone, Copy)]
pub struct Tick<'a> {
    /// This replica.
    pub me: &'a str,
    /// What it can use now.
    pub demand: Demand,
    /// When (the monotonic clock).
    pub now: Instant,
    /// Another replica's entry whose beat stayed the same this long is dropped.
    pub drop_after: Duration,
    /// Write even when nothing changed (the lease is due for renewal).
    pub renew: bool,
    /// The beat of a new entry: a fresh random number, so that another replica that saw an
    /// entry of this name before it was withdrawn never takes the new one for the old.
    pub first_beat: u64,
}

/// Whether two demands differ enough to be worth a write.
fn moved(a: Option<Demand>, b: Demand) -> bool {
    match (a, b) {
        (Some(Demand::Backlog), Demand::Backlog) => false,
        (Some(Demand::UpTo(x)), Demand::UpTo(y)) => (x - y).abs() > 0.05,
        _ => true,
    }
}

/// One replica's tick over the record as read (see the module's rules).
pub fn step(current: &SharesRecord, seen: &Seen, t: Tick<'_>) -> Step {
    let mine = current.replicas.get(t.me);
    let committed = mine.map_or(0.0, |e| e.share);
    let live: Vec<(&String, &Entry)> = current
        .replicas
        .iter()
        .filter(|(name, _)| *name == t.me || !seen.stale(name, t.now, t.drop_after))
        .collect();
    let dropped = live.len() < current.replicas.len();
    let mut names: Vec<&str> = live.iter().map(|(n, _)| n.as_str()).collect();
    let mut demands: Vec<Demand> = live.iter().map(|(_, e)| e.demand()).collect();
    match names.iter().position(|n| *n == t.me) {
        Some(i) => demands[i] = t.demand,
        None => {
            names.push(t.me);
            demands.push(t.demand);
        }
    }
    let me = names.iter().position(|n| *n == t.me).unwrap_or_default();
    let target = fair(&demands)[me];
    let others: f64 = live
        .iter()
        .filter(|(n, _)| *n != t.me)
        .map(|(_, e)| e.share)
        .sum();
    let share = floor6(target.min(1.0 - others));
    let changed =
        mine.is_none() || share != committed || dropped || moved(mine.map(Entry::demand), t.demand);
    let write = (changed || t.renew).then(|| {
        let mut next = SharesRecord {
            replicas: live
                .iter()
                .map(|(n, e)| ((*n).clone(), (*e).clone()))
                .collect(),
        };
        next.replicas.insert(
            t.me.to_string(),
            Entry {
                share,
                demand: match t.demand {
                    Demand::Backlog => None,
                    Demand::UpTo(d) => Some(d.clamp(0.0, 1.0)),
                },
                beat: mine.map_or(t.first_beat, |e| e.beat.wrapping_add(1)),
            },
        );
        next
    });
    Step {
        now_at_most: committed.min(share),
        share: if write.is_some() { share } else { committed },
        write,
    }
}

/// The record without `me` (a clean stop).
pub fn withdraw(current: &SharesRecord, me: &str) -> Option<SharesRecord> {
    current.replicas.contains_key(me).then(|| {
        let mut next = current.clone();
        next.replicas.remove(me);
        next
    })
}

/// How a replica's recent use becomes its demand: a backlog when attempts waited for the
/// limiter most of the tick (or one was turned away for lack of a share); else what it used
/// (a share of the deployment's rate) with a fifth more and a sliver, so it can grow.
pub fn demand_of(waiting_part: f64, turned_away: bool, used_share: f64) -> Demand {
    if turned_away || waiting_part >= 0.5 {
        Demand::Backlog
    } else {
        Demand::UpTo((used_share.max(0.0) * 1.2 + 0.02).min(1.0))
    }
}

#[cfg(test)]
mod tests;
