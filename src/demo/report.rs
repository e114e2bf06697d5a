//! The demo's report: the progress drawn once a second, the [`Report`] with its counts and
//! independent checks ([`super::verify`]) read from the bed once the script ended, the
//! table, and the operator story (one retried event as support staff would look it up).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bed::{Bed, HUB, QUEUE};
use super::{verify, DemoArgs};
use crate::ledger::{LedgerRecord, State};
use crate::pipeline::health::{Health, HoldCause};

/// What the demo found.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// Events the producer sent.
    pub events: usize,
    /// Events the receiver accepted at least once.
    pub delivered: usize,
    /// Events the ledger records as dead-lettered (and never delivered).
    pub dead_lettered: usize,
    /// Events neither delivered nor dead-lettered.
    pub lost: usize,
    /// Deliveries beyond the first (at-least-once duplicates).
    pub duplicate_deliveries: usize,
    /// Retry messages Service Bus accepted (duplicates dropped by detection excluded).
    pub retries_scheduled: u64,
    /// The highest attempt number any event reached.
    pub max_attempt: u32,
    /// How often the downstream's circuit breaker opened from closed.
    pub breaker_opens: u64,
    /// How often a failed half-open probe re-opened it.
    pub breaker_reopens: u64,
    /// Checkpoints written by all replicas.
    pub checkpoint_writes: u64,
    /// Replica crashes.
    pub crashes: usize,
    /// Duplicate deliveries per event.
    pub duplicate_ratio: f64,
    /// The independent checks (checkpoints, attempts, doubles, unsettled partitions).
    #[serde(flatten)]
    pub checks: verify::Verdict,
    /// `max_in_flight` of every replica.
    pub max_in_flight: usize,
    /// Wall time.
    pub elapsed_ms: u64,
}

impl Report {
    /// Whether nothing was lost and every check passed.
    pub fn clean(&self) -> bool {
        self.lost == 0 && self.checks.clean()
    }
}

/// One second of the script, as the progress line shows it.
pub(super) struct Tick {
    /// Since the demo started.
    pub(super) t: Duration,
    /// Events the receiver accepted.
    pub(super) delivered: usize,
    /// Events produced (all of them, or the number asked for while the producer runs).
    pub(super) events: usize,
    /// Retry messages in Service Bus (scheduled, visible or locked).
    pub(super) retrying: u64,
    /// Events the ledger records as dead-lettered.
    pub(super) dead_lettered: usize,
    /// Held partitions of the running replicas, and why.
    pub(super) held: BTreeMap<String, HoldCause>,
}

/// Draws the progress: a bar redrawn in place on a terminal (unless `--json`), else one line
/// a second through `progress`.
pub(super) struct Progress {
    bar: bool,
    events: usize,
}

impl Progress {
    pub(super) fn new(args: &DemoArgs) -> Self {
        Self {
            bar: std::io::stderr().is_terminal() && !args.json,
            events: args.events,
        }
    }

    /// Draws one second.
    pub(super) fn tick(&self, tick: &Tick, progress: &mut impl FnMut(&str)) {
        let line = format!(
            "t={:>3}s  delivered {}/{}  retrying {}  dead-lettered {}  held partitions {}{}",
            tick.t.as_secs(),
            tick.delivered,
            tick.events,
            tick.retrying,
            tick.dead_lettered,
            tick.held.len(),
            if tick.held.is_empty() {
                String::new()
            } else {
                format!(
                    " ({})",
                    tick.held
                        .values()
                        .map(|c| c.label().replace('_', " "))
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        if self.bar {
            let done = tick.delivered + tick.dead_lettered;
            let width = 30;
            let filled = (done * width / self.events.max(1)).min(width);
            eprint!(
                "\r[{}{}] {line}   ",
                "#".repeat(filled),
                ".".repeat(width - filled)
            );
            let _ = std::io::stderr().flush();
        } else {
            progress(&line);
        }
    }

    /// Ends the bar's line.
    pub(super) fn finish(&self) {
        if self.bar {
            eprintln!();
        }
    }
}

/// Reads the outcome from the bed once the script ended (the replicas stopped) and runs the
/// independent checks: `keys` are the events produced, `replicas` the health of every replica
/// that ran, `started` when the demo started. Returns the report and the ledger's records by
/// key.
pub(super) async fn gather(
    bed: &Bed,
    args: &DemoArgs,
    keys: &[String],
    crashes: usize,
    replicas: &[Arc<Health>],
    started: Instant,
) -> anyhow::Result<(Report, HashMap<String, LedgerRecord>)> {
    let ledger = bed.ledger()?;
    let delivered = bed.hook.deliveries();
    let dead: BTreeSet<String> = ledger.dead_letter_keys().await?.into_iter().collect();
    let produced: BTreeSet<&String> = keys.iter().collect();
    let delivered_n = produced
        .iter()
        .filter(|k| delivered.contains_key(**k))
        .count();
    let dead_n = produced
        .iter()
        .filter(|k| !delivered.contains_key(**k) && dead.contains(**k))
        .count();
    let mut ledger_records: HashMap<String, LedgerRecord> = Default::default();
    for key in ledger.keys().await? {
        if let Some(rec) = ledger.record(&key).await? {
            ledger_records.insert(key, rec);
        }
    }
    let max_attempt = ledger_records
        .values()
        .map(|r| r.attempts)
        .max()
        .unwrap_or(1)
        .max(1);
    let blob_writes = bed.blob.store().writes();
    let accepted = bed
        .sb
        .queue(QUEUE)
        .map(|q| q.accepted())
        .unwrap_or_default();
    let first_delivered = bed.hook.first_deliveries();
    let attempts_seen = bed.hook.attempts_seen();
    let verdict = verify::verify(&verify::Evidence {
        eventhubs: &bed.eh,
        hub: HUB,
        blob_writes: &blob_writes,
        accepted: &accepted,
        first_delivered: &first_delivered,
        attempts_seen: &attempts_seen,
        ledger: &ledger,
        records: &ledger_records,
    });
    let sb = bed.sb.counters(QUEUE).unwrap_or_default();
    let (breaker_opens, breaker_reopens) = bed
        .breaker()
        .await?
        .map_or((0, 0), |b| (b.opens, b.reopens));
    let duplicates = delivered.values().map(|n| *n as usize).sum::<usize>() - delivered.len();
    let report = Report {
        events: keys.len(),
        delivered: delivered_n,
        dead_lettered: dead_n,
        lost: keys.len() - delivered_n - dead_n,
        duplicate_deliveries: duplicates,
        retries_scheduled: sb.sends - sb.duplicates_dropped,
        max_attempt,
        breaker_opens,
        breaker_reopens,
        checkpoint_writes: replicas.iter().map(|h| h.snapshot().checkpoints).sum(),
        crashes,
        duplicate_ratio: duplicates as f64 / keys.len().max(1) as f64,
        checks: verdict,
        max_in_flight: args.max_in_flight,
        elapsed_ms: started.elapsed().as_millis() as u64,
    };
    Ok((report, ledger_records))
}

/// The operator story: the delivered event with the most attempts (the first by key among
/// equals), as `hubguard status` shows it, and the trace query that finds its attempts.
pub(super) fn tell_one_retry(
    records: &HashMap<String, LedgerRecord>,
    progress: &mut impl FnMut(&str),
) {
    let mut best: Option<&LedgerRecord> = None;
    let mut keys: Vec<&String> = records.keys().collect();
    keys.sort();
    for key in keys {
        let rec = &records[key];
        if rec.state() == State::Delivered && best.is_none_or(|b| rec.attempts > b.attempts) {
            best = Some(rec);
        }
    }
    let Some(rec) = best else {
        return;
    };
    progress("");
    progress(&format!(
        "One retried event, as `hubguard status {}` shows it:",
        rec.key
    ));
    for l in crate::status::record_text(rec).lines() {
        progress(&format!("  {l}"));
    }
    progress("The trace query that finds every attempt (Grafana Tempo):");
    // Built from the names the spans are emitted with, so it cannot go stale.
    use crate::telemetry::names::{attr, span};
    progress(&format!(
        "  {{ name = \"{}\" && span.{} = \"{}\" }} | select(span.{}, span.{}, span.{})",
        span::ATTEMPT,
        attr::CONVERSATION_ID,
        rec.correlation_id,
        attr::ATTEMPT,
        attr::OUTCOME,
        attr::NEXT_ATTEMPT_AT
    ));
}

/// Prints the report as a table.
pub fn print_table(r: &Report) {
    let row = |label: &str, value: &dyn std::fmt::Display| println!("{label:<24} {value:>10}");
    println!();
    row("events produced", &r.events);
    row("delivered", &r.delivered);
    row("dead-lettered", &r.dead_lettered);
    row("LOST", &r.lost);
    row("duplicate deliveries", &r.duplicate_deliveries);
    row("retries scheduled", &r.retries_scheduled);
    row("highest attempt", &r.max_attempt);
    row("breaker opens", &r.breaker_opens);
    row("failed probes (reopens)", &r.breaker_reopens);
    row("checkpoint writes", &r.checkpoint_writes);
    row("replica crashes", &r.crashes);
    row("duplicates per event", &format!("{:.4}", r.duplicate_ratio));
    row("checkpoints checked", &r.checks.checkpoint_writes_checked);
    row("ckpt past unsettled", &r.checks.checkpoint_violations);
    row("attempts went back", &r.checks.attempt_regressions);
    row("retry scheduled twice", &r.checks.double_scheduled);
    for p in &r.checks.problems {
        println!("  problem: {p}");
    }
    for (p, (n, first, cp)) in &r.checks.unsettled {
        println!(
            "  partition {p}: {n} event(s) never settled, from sequence number {first}; last checkpoint {}",
            cp.map_or("none".to_string(), |c| c.to_string())
        );
    }
    println!("{:<24} {:>9.1}s", "elapsed", r.elapsed_ms as f64 / 1000.0);
    if r.clean() {
        println!("\nNothing lost: every event was delivered or dead-lettered, and no checkpoint ever passed an unsettled event.");
    }
}
