//! The demo's (and the chaos soak's) independent checks, from what the emulators recorded —
//! never from hubguard's own counters:
//!
//! - **No checkpoint passed an unsettled event.** Every checkpoint write the blob emulator
//!   applied, at time t up to sequence s, is checked against when each event at or before s
//!   first settled: its first 2xx at the receiver, the first retry message Service Bus
//!   accepted for it, or (dead-lettered on its first attempt) the first write of its ledger
//!   record. All of these come before hubguard can know the event settled, so the check is
//!   strict.
//! - **No attempt number went backwards**: in each ledger record's history (the count hubguard
//!   persists), and in the retries the downstream saw per event (attempts 2, 3, … in arrival
//!   order). A replay from Event Hubs after a crash calls attempt 1 again: that is an
//!   at-least-once duplicate, counted as such, not a retry.
//! - **No retry message was scheduled twice for the same attempt**: each
//!   `{key}-attempt-{n}` MessageId was accepted at most once (breaker deferrals carry
//!   `-deferred-{ms}` and re-schedule the same attempt by design).

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use serde::Serialize;

use crate::emulator::blob::store::BlobWrite;
use crate::emulator::eventhubs::store::Hub;
use crate::emulator::eventhubs::EventHubsEmulator;
use crate::ledger::{Ledger, LedgerRecord, State};

/// What the checks found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Checkpoint writes checked.
    pub checkpoint_writes_checked: usize,
    /// Checkpoint writes that covered an event not yet settled at the time.
    pub checkpoint_violations: usize,
    /// Ledger histories or retry sequences whose attempt number decreased.
    pub attempt_regressions: usize,
    /// `{key}-attempt-{n}` messages Service Bus accepted more than once.
    pub double_scheduled: usize,
    /// The first few problems, for the report.
    pub problems: Vec<String>,
    /// Partitions with events that never settled: (how many, the first one's sequence number,
    /// the last checkpoint written).
    pub unsettled: BTreeMap<String, (usize, i64, Option<i64>)>,
}

impl Verdict {
    /// Whether every check passed.
    pub fn clean(&self) -> bool {
        self.checkpoint_violations == 0
            && self.attempt_regressions == 0
            && self.double_scheduled == 0
    }

    fn problem(&mut self, p: String) {
        if self.problems.len() < 10 {
            self.problems.push(p);
        }
    }
}

/// Splits a retry MessageId into (key, attempt, deferred).
pub fn parse_message_id(id: &str) -> Option<(&str, u32, bool)> {
    let id = crate::pipeline::settle::unqualified(id);
    let at = id.rfind("-attempt-")?;
    let (key, rest) = (&id[..at], &id[at + "-attempt-".len()..]);
    match rest.split_once("-deferred-") {
        Some((n, _)) => Some((key, n.parse().ok()?, true)),
        None => Some((key, rest.parse().ok()?, false)),
    }
}

/// Everything the checks read.
pub struct Evidence<'a> {
    /// The Event Hubs emulator (which event sits at which sequence number).
    pub eventhubs: &'a EventHubsEmulator,
    /// The hub.
    pub hub: &'a str,
    /// The blob emulator's write history.
    pub blob_writes: &'a [BlobWrite],
    /// Service Bus's accepted sends: MessageId and time.
    pub accepted: &'a [(String, SystemTime)],
    /// The receiver's first 2xx per key.
    pub first_delivered: &'a BTreeMap<String, SystemTime>,
    /// The attempt numbers the downstream saw per key, in arrival order.
    pub attempts_seen: &'a BTreeMap<String, Vec<u32>>,
    /// The ledger, and every record in it.
    pub ledger: &'a Ledger,
    /// The ledger's records by key.
    pub records: &'a HashMap<String, LedgerRecord>,
}

/// Runs the checks.
pub fn verify(e: &Evidence<'_>) -> Verdict {
    let mut v = Verdict::default();
    let first_accept = check_retry_messages(e, &mut v);
    check_downstream_attempts(e, &mut v);
    check_ledger_histories(e, &mut v);
    let settlements = Settlements {
        e,
        first_accept,
        first_ledger_write: first_ledger_writes(e),
    };
    // Per partition: the latest settlement among events 0..=s (None: one never settled).
    let Some(hub) = e.eventhubs.store().hub(e.hub) else {
        v.problem(format!("hub {} not found", e.hub));
        return v;
    };
    let partitions = settle_partitions(e, &hub, &settlements, &mut v);
    check_checkpoints(e, &hub, &partitions, &mut v);
    v
}

/// Retry messages: counts and reports each attempt Service Bus accepted twice; returns each
/// key's first acceptance.
fn check_retry_messages<'a>(e: &Evidence<'a>, v: &mut Verdict) -> HashMap<&'a str, SystemTime> {
    let mut first_accept: HashMap<&str, SystemTime> = HashMap::new();
    let mut seen: HashMap<(&str, u32), u32> = HashMap::new();
    for (id, at) in e.accepted {
        let Some((key, n, deferred)) = parse_message_id(id) else {
            continue;
        };
        first_accept.entry(key).or_insert(*at);
        if !deferred {
            let c = seen.entry((key, n)).or_default();
            *c += 1;
            if *c == 2 {
                v.double_scheduled += 1;
                v.problem(format!("{id} was accepted twice"));
            }
        }
    }
    first_accept
}

/// Attempt order: counts and reports a key whose retries reached the downstream with a
/// decreasing attempt number.
fn check_downstream_attempts(e: &Evidence<'_>, v: &mut Verdict) {
    for (key, seen) in e.attempts_seen {
        let retries: Vec<u32> = seen.iter().copied().filter(|n| *n >= 2).collect();
        if let Some(w) = retries.windows(2).find(|w| w[1] < w[0]) {
            v.attempt_regressions += 1;
            v.problem(format!(
                "{key}: the downstream saw attempt {} after attempt {}",
                w[1], w[0]
            ));
        }
    }
}

/// Ledger histories: counts and reports a record whose attempt numbers go backwards.
fn check_ledger_histories(e: &Evidence<'_>, v: &mut Verdict) {
    for (key, rec) in e.records {
        // A replay from Event Hubs delivering the event again as attempt 1 is recorded as
        // such; the retries' numbers around it must still never go backwards.
        let numbered: Vec<u32> = rec
            .history
            .iter()
            .filter(|h| h.outcome != crate::pipeline::settle::DELIVERED_ON_REPLAY)
            .map(|h| h.attempt)
            .collect();
        if numbered.windows(2).any(|w| w[1] < w[0]) {
            v.attempt_regressions += 1;
            v.problem(format!("{key}: ledger history goes backwards"));
        }
    }
}

/// When the blob emulator first applied a write to each key's ledger record.
fn first_ledger_writes<'a>(e: &Evidence<'a>) -> HashMap<&'a str, SystemTime> {
    let mut m = HashMap::new();
    let by_name: HashMap<String, &str> = e
        .records
        .keys()
        .map(|k| (e.ledger.record_name(k), k.as_str()))
        .collect();
    for w in e.blob_writes {
        if let Some(k) = by_name.get(&w.name) {
            m.entry(*k).or_insert(w.at);
        }
    }
    m
}

/// What tells when each event first settled.
struct Settlements<'a, 'e> {
    e: &'e Evidence<'a>,
    first_accept: HashMap<&'a str, SystemTime>,
    first_ledger_write: HashMap<&'a str, SystemTime>,
}

impl Settlements<'_, '_> {
    /// When the event `key` first settled: the earliest of its first 2xx, its first accepted
    /// retry message, and (dead-lettered on its first attempt) its ledger record's first
    /// write; `None` if it never did.
    fn at(&self, key: &str) -> Option<SystemTime> {
        let mut t: Option<SystemTime> = None;
        let mut take = |x: Option<SystemTime>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        take(self.e.first_delivered.get(key).copied());
        take(self.first_accept.get(key).copied());
        if let Some(rec) = self.e.records.get(key) {
            let dead_at_first = rec.state() == State::DeadLettered
                && rec
                    .history
                    .iter()
                    .any(|h| h.attempt == 1 && h.outcome == "dead_lettered");
            if dead_at_first {
                take(self.first_ledger_write.get(key).copied());
            }
        }
        t
    }
}

/// One partition's events, in order: each one's key and settlement, and the latest settlement
/// among the events up to it (`None` once one never settled).
struct SettledPartition {
    prefix_settled: Vec<Option<SystemTime>>,
    detail: Vec<(String, Option<SystemTime>)>,
}

/// Each partition's [`SettledPartition`], in the hub's order; counts the events that never
/// settled in `v.unsettled`.
fn settle_partitions(
    e: &Evidence<'_>,
    hub: &Hub,
    settlements: &Settlements<'_, '_>,
    v: &mut Verdict,
) -> Vec<SettledPartition> {
    let mut partitions = Vec::new();
    for p in &hub.partitions {
        let mut d = Vec::new();
        let events = p.events_from(0, usize::MAX);
        let mut acc: Option<SystemTime> = Some(SystemTime::UNIX_EPOCH);
        let mut col = Vec::with_capacity(events.len());
        for ev in events {
            let key = ev
                .string_property("ce_id")
                .unwrap_or_else(|| format!("{}/{}/{}", e.hub, p.id, ev.sequence_number));
            let settled = settlements.at(&key);
            d.push((key.clone(), settled));
            if settled.is_none() {
                let u = v
                    .unsettled
                    .entry(p.id.clone())
                    .or_insert((0, ev.sequence_number, None));
                u.0 += 1;
            }
            acc = match (acc, settled) {
                (Some(a), Some(s)) => Some(a.max(s)),
                _ => None,
            };
            col.push(acc);
        }
        partitions.push(SettledPartition {
            prefix_settled: col,
            detail: d,
        });
    }
    partitions
}

/// Checkpoints: each checkpoint write to the hub is counted, noted as its partition's last
/// checkpoint if that partition has unsettled events, and reported if it passed an event not
/// yet settled.
fn check_checkpoints(
    e: &Evidence<'_>,
    hub: &Hub,
    partitions: &[SettledPartition],
    v: &mut Verdict,
) {
    let marker = format!("/{}/", e.hub.to_ascii_lowercase());
    for w in e.blob_writes {
        let Some((_, partition)) = w.name.rsplit_once("/checkpoint/") else {
            continue;
        };
        if !w.name.to_ascii_lowercase().contains(&marker) {
            continue;
        }
        let Some(seq) = w
            .metadata
            .get("sequencenumber")
            .and_then(|s| s.parse::<i64>().ok())
        else {
            continue;
        };
        let Some(pi) = hub.partition_index(partition) else {
            continue;
        };
        let Some(col) = partitions.get(pi).map(|p| &p.prefix_settled) else {
            continue;
        };
        v.checkpoint_writes_checked += 1;
        if let Some(u) = v.unsettled.get_mut(partition) {
            u.2 = Some(u.2.map_or(seq, |c: i64| c.max(seq)));
        }
        let ok = usize::try_from(seq)
            .ok()
            .and_then(|i| col.get(i).copied().flatten())
            .is_some_and(|settled| settled <= w.at);
        if !ok {
            v.checkpoint_violations += 1;
            let why = why_early(&partitions[pi].detail, seq, w.at);
            v.problem(format!(
                "partition {partition}: checkpoint to {seq} written before every event up to it had settled: {why}"
            ));
        }
    }
}

/// Why a checkpoint to `seq` written at `at` was early: the first event up to it that had
/// not settled by then, and when it did.
fn why_early(detail: &[(String, Option<SystemTime>)], seq: i64, at: SystemTime) -> String {
    let late = detail
        .iter()
        .take(usize::try_from(seq).unwrap_or(0) + 1)
        .enumerate()
        .find(|(_, (_, t))| t.is_none_or(|t| t > at));
    match late {
        Some((i, (key, t))) => format!(
            "event {i} ({key}) settled {}",
            t.map_or("never".to_string(), |t| match t.duration_since(at) {
                Ok(d) => format!("{} ms after the write", d.as_millis()),
                Err(_) => "before".into(),
            })
        ),
        None => "unknown".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_parse() {
        assert_eq!(
            parse_message_id("0123456789ab.demo-00012-attempt-3"),
            Some(("demo-00012", 3, false))
        );
        assert_eq!(
            parse_message_id("demo-00012-attempt-3"),
            Some(("demo-00012", 3, false))
        );
        assert_eq!(
            parse_message_id("a-attempt-b-attempt-2-deferred-1700000000000"),
            Some(("a-attempt-b", 2, true))
        );
        assert_eq!(parse_message_id("no-attempt-here"), None);
        assert_eq!(parse_message_id("plain"), None);
    }
}
