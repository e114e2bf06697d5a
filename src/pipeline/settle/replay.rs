//! `hubguard dead-letters replay`: a dead-lettered event scheduled again with a fresh attempt
//! budget, and a run over the dead letters a filter takes, paced and resumable.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::clock::{at, ms};
use crate::ledger::{Change, LedgerRecord, State, Versioned};
use crate::pipeline::OrderingKey;
use crate::policy::DeadLetterReason;

use super::{MessageId, RetryCopy, SettleError, Settler};

impl Settler {
    /// Replays a dead-lettered event: schedules its next attempt now with a fresh attempt
    /// budget, and takes it off the dead-letter index.
    #[cfg(any(test, feature = "cli"))]
    pub async fn replay(&self, key: &str) -> Result<Option<u32>, SettleError> {
        self.replay_if(key, |_| true).await
    }

    /// [`replay`](Self::replay), if the dead-lettered record still matches `matches` when
    /// it is replayed (under the compare-and-swap): `Ok(None)` when it does not, or is no
    /// longer dead-lettered.
    #[cfg(any(test, feature = "cli"))]
    pub async fn replay_if(
        &self,
        key: &str,
        matches: impl Fn(&LedgerRecord) -> bool,
    ) -> Result<Option<u32>, SettleError> {
        match self.replay_record_if(key, matches).await? {
            Some(rec) => self.send_replayed(&rec).await.map(Some),
            None => Ok(None),
        }
    }

    /// The first half of [`replay_if`](Self::replay_if): the dead-lettered record becomes a
    /// retry due now (a fresh attempt budget), its message not yet sent. `Ok(None)` when it
    /// no longer matches or is no longer dead-lettered. Until [`send_replayed`](Self::send_replayed)
    /// sends it, the retry loop's overdue sweep would send it (the record is due).
    #[cfg(any(test, feature = "cli"))]
    pub(crate) async fn replay_record_if(
        &self,
        key: &str,
        matches: impl Fn(&LedgerRecord) -> bool,
    ) -> Result<Option<LedgerRecord>, SettleError> {
        let now = self.clock.now();
        self.ledger
            .update(key, |rec| match rec {
                Some(rec) if rec.state() == State::DeadLettered && !matches(&rec) => {
                    Change::Keep(Ok(None))
                }
                Some(rec) if rec.state() == State::DeadLettered && rec.event_unknown => {
                    Change::Keep(Err(SettleError::EventUnknown {
                        key: key.to_string(),
                        quarantined: rec.quarantined.clone().unwrap_or_default(),
                    }))
                }
                Some(mut rec) if rec.state() == State::DeadLettered => {
                    rec.schedule_retry(ms(now));
                    rec.attempt_base = rec.attempts;
                    rec.first_failure_ms = ms(now);
                    rec.updated_ms = ms(now);
                    // The replayed attempt runs from the copy sent now only: a copy of it
                    // sent before (a cancelled retry's) stands down when it arrives.
                    rec.run_now = Some(crate::ledger::RunNow {
                        attempt: rec.attempts + 1,
                        at_ms: ms(now),
                        by: "replay".into(),
                        previous_due_ms: None,
                    });
                    Change::Write(Box::new(rec.clone()), Ok(Some(rec)))
                }
                _ => Change::Keep(Ok(None)),
            })
            .await?
    }

    /// The second half of [`replay_if`](Self::replay_if): sends the replayed record's
    /// message; the attempt it runs.
    #[cfg(any(test, feature = "cli"))]
    pub(crate) async fn send_replayed(&self, rec: &LedgerRecord) -> Result<u32, SettleError> {
        let key = rec.key.as_str();
        let marked = rec.run_now.as_ref().map_or(rec.updated_ms, |r| r.at_ms);
        // A MessageId of its own: the attempt's plain one may still be in the
        // duplicate-detection window (a cancelled retry's), and would be dropped.
        // Off the dead-letter index before the copy is sent: an attempt that dead-letters
        // it again at once indexes it again, and must not be undone by this.
        self.ledger.unindex_dead_letter(key).await?;
        let attempt = rec.attempts + 1;
        let id = MessageId::retry(key, attempt).copy(RetryCopy::Replayed { at_ms: marked });
        if let Err(e) = self
            .schedule_marked(id, &rec.event, attempt, at(marked), &[], Some(marked))
            .await
        {
            if e.is_refusal_of_request() {
                // Refused again: it stays a dead letter, with Service Bus's reason.
                self.dead_letter_refused(key, &e).await?;
            }
            return Err(e.into());
        }
        Ok(attempt)
    }
}

/// Which dead letters `hubguard dead-letters replay` takes. `until_ms` is required: with
/// it, a run is a fixed set (what was dead-lettered by then), so the same command run again
/// after an interruption replays what is left and never an event a first run replayed that
/// was dead-lettered again since (its dead-letter time is later).
#[derive(Debug, Clone, Default)]
pub struct ReplayFilter {
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this dead-letter reason (its name: `permanent`, `attempts_exhausted`,
    /// `cancelled`, …).
    pub reason: Option<String>,
    /// Only those whose last error contains this text.
    pub error_contains: Option<String>,
    /// Only those dead-lettered at or after this time (ms since the epoch).
    pub since_ms: Option<i64>,
    /// Only those dead-lettered at or before this time.
    pub until_ms: i64,
    /// Only keys starting with this.
    pub key_prefix: Option<String>,
    /// Only those whose last error has this status class ([`status_class`]: `503`,
    /// `timeout`, `connection`, `other`, `none`).
    pub status: Option<String>,
}

/// The class of a dead letter's last error the console groups by: the HTTP status of a
/// webhook's answer (`HTTP 503 from the webhook…` → `503`), `timeout`, `connection`,
/// `other`, or `none` without an error.
pub fn status_class(last_error: Option<&str>) -> String {
    let Some(e) = last_error else {
        return "none".into();
    };
    if let Some(code) = e
        .strip_prefix("HTTP ")
        .and_then(|r| r.get(..3))
        .filter(|c| c.bytes().all(|b| b.is_ascii_digit()))
    {
        return code.to_string();
    }
    let lower = e.to_ascii_lowercase();
    if lower.contains("timed out") || lower.contains("timeout") || lower.contains("deadline") {
        "timeout".into()
    } else if lower.contains("connect") {
        "connection".into()
    } else {
        "other".into()
    }
}

/// The name a dead-letter reason has in records, the API and `--reason`.
pub fn reason_name(reason: &DeadLetterReason) -> String {
    serde_json::to_value(reason)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

impl ReplayFilter {
    /// Whether `key` can match (read no record for one that cannot).
    pub fn matches_key(&self, key: &str) -> bool {
        self.key_prefix
            .as_deref()
            .is_none_or(|p| key.starts_with(p))
    }

    /// Whether `rec` matches everything but the time window.
    fn matches_what(&self, rec: &LedgerRecord) -> bool {
        self.matches_key(&rec.key)
            // An empty type takes the events without one.
            && self
                .event_type
                .as_deref()
                .is_none_or(|t| rec.event_type.as_deref().unwrap_or("") == t)
            && self
                .status
                .as_deref()
                .is_none_or(|s| status_class(rec.last_error.as_deref()) == s)
            && self.reason.as_deref().is_none_or(|r| {
                rec.dead_letter_reason()
                    .as_ref()
                    .is_some_and(|d| reason_name(d) == r)
            })
            && self
                .error_contains
                .as_deref()
                .is_none_or(|e| rec.last_error.as_deref().is_some_and(|l| l.contains(e)))
    }

    /// Whether the dead-lettered `rec` is one this run replays. Its dead-letter time is its
    /// last update (a dead-lettered record is not written again until it is replayed).
    pub fn matches(&self, rec: &LedgerRecord) -> bool {
        rec.state() == State::DeadLettered
            && self.matches_what(rec)
            && self.since_ms.is_none_or(|s| rec.updated_ms >= s)
            && rec.updated_ms <= self.until_ms
    }
}

/// What one dead letter came to in a replay run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ReplayStep {
    /// Scheduled again: attempt `attempt` runs now.
    Replayed {
        /// The key.
        key: String,
        /// The attempt scheduled.
        attempt: u32,
    },
    /// `--dry-run`: would be replayed.
    WouldReplay {
        /// The key.
        key: String,
    },
    /// Matched, but not replayed: `why`.
    Skipped {
        /// The key.
        key: String,
        /// Why.
        why: String,
    },
    /// Ordered retries: parked behind `behind`, the first replayed event of its line, and
    /// released after it in sequence order.
    Parked {
        /// The key.
        key: String,
        /// The line's head.
        behind: String,
    },
    /// `--dry-run` with ordered retries: would be parked behind `behind`.
    WouldPark {
        /// The key.
        key: String,
        /// The line's head.
        behind: String,
    },
    /// Could not be replayed: `error`.
    Failed {
        /// The key.
        key: String,
        /// The cause.
        error: String,
    },
}

/// The counts of a replay run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplayReport {
    /// Dead letters listed (after `--key-prefix`).
    pub listed: usize,
    /// Of those, the ones the filters matched.
    pub matched: usize,
    /// Scheduled again (with `--dry-run`: would be).
    pub replayed: usize,
    /// Matched but not replayed (dead-lettered again after `until`, or no longer
    /// dead-lettered).
    pub skipped: usize,
    /// Could not be replayed.
    pub failed: usize,
    /// Stopped before the end (the same command resumes).
    pub interrupted: bool,
}

impl Settler {
    /// `hubguard dead-letters replay` by filter: at most `per_second` replays a second,
    /// until the end or `stop`. `step` hears about every matched dead letter (with the
    /// position in the listing, and the listing's length).
    #[cfg(feature = "testbed")]
    pub async fn replay_matching(
        &self,
        filter: &ReplayFilter,
        per_second: f64,
        dry_run: bool,
        stop: &tokio_util::sync::CancellationToken,
        step: impl FnMut(&ReplayStep, usize, usize),
    ) -> Result<ReplayReport, SettleError> {
        self.replay_matching_ordered(filter, per_second, dry_run, None, stop, step)
            .await
    }

    /// [`replay_matching`](Self::replay_matching); with `ordering` (ordered retries on), the
    /// dead letters that have an ordering key are replayed line by line: those of one
    /// partition and key in sequence order, the first as a retry due now and the others
    /// parked behind it (see `pipeline::lines::replay_line`), after the rest.
    pub async fn replay_matching_ordered(
        &self,
        filter: &ReplayFilter,
        per_second: f64,
        dry_run: bool,
        ordering: Option<&OrderingKey>,
        stop: &CancellationToken,
        step: impl FnMut(&ReplayStep, usize, usize),
    ) -> Result<ReplayReport, SettleError> {
        let keys: Vec<String> = self
            .ledger
            .dead_letter_keys()
            .await?
            .into_iter()
            .filter(|k| filter.matches_key(k))
            .collect();
        let mut run = ReplayRun::new(keys.len(), per_second, stop, step);
        // Ordered: (partition, ordering key) → its dead letters, replayed after the loop.
        let mut lines: BTreeMap<(String, String), Vec<Versioned<LedgerRecord>>> = BTreeMap::new();
        for key in keys {
            if stop.is_cancelled() {
                run.report.interrupted = true;
                break;
            }
            let outcome = match self.sort_dead_letter(&key, filter, ordering).await {
                Sorted::Unmatched => continue,
                Sorted::Done(outcome) => outcome,
                Sorted::Line(line, rec) => {
                    lines.entry(line).or_default().push(*rec);
                    continue;
                }
                Sorted::Replay if dry_run => ReplayStep::WouldReplay { key },
                Sorted::Replay => {
                    if !run.paced(1).await {
                        break;
                    }
                    self.replay_one(key, filter).await
                }
            };
            run.count(&outcome);
        }
        for ((_, ordering_key), group) in lines {
            if run.report.interrupted || stop.is_cancelled() {
                run.report.interrupted = true;
                break;
            }
            if !self
                .replay_group(&mut run, filter, dry_run, &ordering_key, group)
                .await
            {
                break;
            }
        }
        Ok(run.report)
    }

    /// What a run does with the dead letter `key`, read now.
    async fn sort_dead_letter(
        &self,
        key: &str,
        filter: &ReplayFilter,
        ordering: Option<&OrderingKey>,
    ) -> Sorted {
        let skipped = |why: &str| {
            Sorted::Done(ReplayStep::Skipped {
                key: key.to_string(),
                why: why.into(),
            })
        };
        match self.ledger.get(key).await {
            Err(e) => Sorted::Done(ReplayStep::Failed {
                key: key.to_string(),
                error: crate::redact::redacted(&e.to_string()),
            }),
            Ok(None) => Sorted::Unmatched,
            Ok(Some(read)) => match &read.value {
                rec if !filter.matches_what(rec) => Sorted::Unmatched,
                rec if rec.state() != State::DeadLettered => skipped("no longer dead-lettered"),
                rec if rec.updated_ms > filter.until_ms => {
                    skipped("dead-lettered again after --until (a replay of this run, or later)")
                }
                rec if !filter.matches(rec) => Sorted::Unmatched,
                rec => match ordering.and_then(|o| o.of(&rec.event)) {
                    Some(ordering_key) => {
                        let line = (rec.event.partition_id.clone(), ordering_key.to_string());
                        Sorted::Line(line, Box::new(read))
                    }
                    None => Sorted::Replay,
                },
            },
        }
    }

    /// One dead letter replayed on its own, if it still matches.
    async fn replay_one(&self, key: String, filter: &ReplayFilter) -> ReplayStep {
        match self.replay_if(&key, |r| filter.matches(r)).await {
            Ok(Some(attempt)) => ReplayStep::Replayed { key, attempt },
            Ok(None) => ReplayStep::Skipped {
                key,
                why: "changed while it was being replayed".into(),
            },
            Err(e) => ReplayStep::Failed {
                key,
                error: crate::redact::redacted(&e.to_string()),
            },
        }
    }

    /// One partition's dead letters of `ordering_key`, replayed as a line (or, with
    /// `dry_run`, what would be). `false` when the run was stopped before it.
    async fn replay_group<S: FnMut(&ReplayStep, usize, usize)>(
        &self,
        run: &mut ReplayRun<'_, S>,
        filter: &ReplayFilter,
        dry_run: bool,
        ordering_key: &str,
        mut group: Vec<Versioned<LedgerRecord>>,
    ) -> bool {
        group.sort_by_key(|r| r.value.event.sequence_number);
        if dry_run {
            let head = group[0].value.key.clone();
            for (i, r) in group.iter().map(|r| &r.value).enumerate() {
                let outcome = if i == 0 {
                    ReplayStep::WouldReplay { key: r.key.clone() }
                } else {
                    ReplayStep::WouldPark {
                        key: r.key.clone(),
                        behind: head.clone(),
                    }
                };
                run.count(&outcome);
            }
            return true;
        }
        // One tick per event of the line: its operations are the rate's to pace.
        if !run.paced(group.len()).await {
            return false;
        }
        let matches = |r: &LedgerRecord| filter.matches(r);
        for outcome in
            crate::pipeline::lines::replay_line(self, ordering_key, group, &matches).await
        {
            run.count(&outcome);
        }
        true
    }
}

/// What a replay run does with one dead letter it listed.
enum Sorted {
    /// Not one the filter takes: not counted.
    Unmatched,
    /// Counted as it is (skipped, or its record could not be read).
    Done(ReplayStep),
    /// Ordered retries: replayed with the others of its line (partition, ordering key) after
    /// the rest.
    Line((String, String), Box<Versioned<LedgerRecord>>),
    /// Replayed on its own.
    Replay,
}

/// One replay run's pace, stop and tally.
struct ReplayRun<'a, S> {
    pace: tokio::time::Interval,
    stop: &'a CancellationToken,
    report: ReplayReport,
    total: usize,
    done: usize,
    step: S,
}

impl<'a, S: FnMut(&ReplayStep, usize, usize)> ReplayRun<'a, S> {
    fn new(listed: usize, per_second: f64, stop: &'a CancellationToken, step: S) -> Self {
        let mut pace = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second.max(0.001)));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            pace,
            stop,
            report: ReplayReport {
                listed,
                ..Default::default()
            },
            total: listed,
            done: 0,
            step,
        }
    }

    /// Counts a matched dead letter's outcome, and tells the caller's `step`.
    fn count(&mut self, outcome: &ReplayStep) {
        let report = &mut self.report;
        report.matched += 1;
        match outcome {
            ReplayStep::Replayed { .. }
            | ReplayStep::WouldReplay { .. }
            | ReplayStep::Parked { .. }
            | ReplayStep::WouldPark { .. } => report.replayed += 1,
            ReplayStep::Skipped { .. } => report.skipped += 1,
            ReplayStep::Failed { .. } => report.failed += 1,
        }
        self.done += 1;
        (self.step)(outcome, self.done, self.total);
    }

    /// Waits for `ticks` ticks of the pace: `false` (the run interrupted) when stopped first.
    async fn paced(&mut self, ticks: usize) -> bool {
        let stop = self.stop;
        for _ in 0..ticks {
            tokio::select! {
                _ = self.pace.tick() => {}
                _ = stop.cancelled() => {
                    self.report.interrupted = true;
                    return false;
                }
            }
        }
        true
    }
}
