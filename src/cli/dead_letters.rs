//! `hubguard dead-letters list|replay|purge`.

use clap::Subcommand;

use crate::config::Config;
use crate::ledger::Ledger;
use crate::pipeline::settle::{ReplayFilter, ReplayReport, ReplayStep, Settler};
use crate::redact::{redact, redacted};
use tokio_util::sync::CancellationToken;

use super::{ledger_of, load_config, parse_ago, settler_of, shutdown_signal, ConfigArg};

/// `hubguard dead-letters …`
#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead-lettered events.
    List {
        /// The configuration.
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Schedule dead-lettered events again (a fresh attempt budget, due now): one KEY, or
    /// --all, or those the filters match (filters combine). Resumable: run the same command
    /// again with the --until the first run printed, and it replays what is left, never an
    /// event it replayed that was dead-lettered again since. With ordered retries
    /// (`processor.retry_ordering = "key"`), the matched dead letters of one partition and
    /// ordering key are re-driven in order: the first replayed, the others parked behind
    /// it. Exit 1 if any failed.
    Replay {
        /// The configuration.
        #[command(flatten)]
        config: ConfigArg,
        /// The idempotency key to replay.
        #[arg(
            required_unless_present_any = ["all", "event_type", "reason", "error_contains", "since", "until", "key_prefix", "status"],
            conflicts_with_all = ["all", "event_type", "reason", "error_contains", "since", "until", "key_prefix", "status"]
        )]
        key: Option<String>,
        /// Replay every dead-lettered event.
        #[arg(long)]
        all: bool,
        /// Only events of this type.
        #[arg(long = "type", value_name = "TYPE")]
        event_type: Option<String>,
        /// Only this dead-letter reason: permanent, attempts_exhausted, age_exceeded,
        /// schedule_exhausted, retry_refused, corrupt_record, record_missing, cancelled,
        /// line_dead_lettered.
        #[arg(long, value_parser = ["permanent", "attempts_exhausted", "age_exceeded", "schedule_exhausted", "retry_refused", "corrupt_record", "record_missing", "cancelled", "line_dead_lettered"])]
        reason: Option<String>,
        /// Only those whose last error contains this text.
        #[arg(long, value_name = "TEXT")]
        error_contains: Option<String>,
        /// Only those dead-lettered since T: RFC 3339, or a duration ago (`90s`, `10m`,
        /// `12h`, `1d`).
        #[arg(long, value_name = "T")]
        since: Option<String>,
        /// Only those dead-lettered until T (RFC 3339, `now`, or a duration ago); default:
        /// now, printed at the end so a resumed run takes the same set.
        #[arg(long, value_name = "T")]
        until: Option<String>,
        /// Only keys starting with this.
        #[arg(long, value_name = "PREFIX")]
        key_prefix: Option<String>,
        /// Only those whose last error has this status class: an HTTP status (`503`),
        /// `timeout`, `connection`, `other` or `none` (as the console groups them).
        #[arg(long, value_name = "STATUS")]
        status: Option<String>,
        /// At most this many replays a second (`N/s`, or `N`).
        #[arg(long, default_value = "10/s", value_name = "N/s")]
        rate: String,
        /// List what would be replayed; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON lines: one per dead letter (`key`, `result`), then the counts.
        #[arg(long)]
        json: bool,
    },
    /// Delete dead-lettered records last written before a time, with their dead-letter index
    /// entries and quarantined bytes (dead letters are kept until replayed or purged).
    Purge {
        /// The configuration.
        #[command(flatten)]
        config: ConfigArg,
        /// RFC 3339 time, or an age (`30d`, `12h`): records dead-lettered before it go.
        #[arg(long)]
        before: String,
        /// Say what would go, delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
}

/// `--rate`: `N/s` or `N`, a positive number of replays a second.
fn parse_rate(text: &str) -> Result<f64, String> {
    let n = text.trim().strip_suffix("/s").unwrap_or(text.trim());
    match n.parse::<f64>() {
        Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
        _ => Err(format!(
            "--rate `{text}`: give a positive number of replays a second, such as `10/s`"
        )),
    }
}

/// `hubguard dead-letters purge`: every dead-lettered record last written before
/// `--before` is deleted (compare-and-swap: one replayed meanwhile stays), then its index
/// entry and its quarantined bytes.
async fn purge_dead_letters(
    config: &ConfigArg,
    before: &str,
    dry_run: bool,
    json: bool,
) -> anyhow::Result<()> {
    let now = std::time::SystemTime::now();
    let before = parse_before(before, now).map_err(anyhow::Error::msg)?;
    let config = load_config(config)?;
    let ledger = ledger_of(&config)?;
    let mut purged = 0usize;
    for key in ledger.dead_letter_keys().await? {
        let outcome = ledger.purge_dead_letter(&key, before, dry_run).await?;
        let Some(quarantined) = outcome else {
            continue;
        };
        purged += 1;
        if json {
            println!(
                "{}",
                serde_json::json!({ "key": key, "purged": !dry_run, "quarantined": quarantined })
            );
        } else {
            println!(
                "{}\t{}",
                key.escape_debug(),
                if dry_run { "would be purged" } else { "purged" }
            );
        }
    }
    if !json {
        println!(
            "{purged} dead letter(s) {} before {}",
            if dry_run { "would be purged" } else { "purged" },
            crate::clock::rfc3339(before)
        );
    }
    Ok(())
}

/// `--before`: an RFC 3339 time, or an age back from `now` (`30d`, `12h`, `90m`, `60s`).
fn parse_before(text: &str, now: std::time::SystemTime) -> Result<std::time::SystemTime, String> {
    let t = text.trim();
    if let Ok(when) = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
    {
        return Ok(when.into());
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let unit_s: u64 = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => 0,
    };
    match n.parse::<u64>() {
        Ok(n) if unit_s > 0 => now
            .checked_sub(std::time::Duration::from_secs(n.saturating_mul(unit_s)))
            .ok_or_else(|| format!("--before {t}: before the epoch")),
        _ => Err(format!(
            "--before {t}: expected an RFC 3339 time (2026-01-31T00:00:00Z) or an age such as 30d, 12h, 90m"
        )),
    }
}

pub(super) async fn dead_letters(cmd: DeadLettersCommand) -> anyhow::Result<()> {
    match cmd {
        DeadLettersCommand::Purge {
            config,
            before,
            dry_run,
            json,
        } => purge_dead_letters(&config, &before, dry_run, json).await?,
        DeadLettersCommand::List { config, json } => list_dead_letters(&config, json).await?,
        DeadLettersCommand::Replay {
            config,
            key,
            all,
            event_type,
            reason,
            error_contains,
            since,
            until,
            key_prefix,
            status,
            rate,
            dry_run,
            json,
        } => {
            let now = std::time::SystemTime::now();
            let per_second = parse_rate(&rate).map_err(|e| anyhow::anyhow!(e))?;
            let since = parse_bound("--since", since, now)?;
            let until = parse_bound("--until", until, now)?.unwrap_or(now);
            let config = load_config(&config)?;
            // A replay Service Bus refuses is dead-lettered again: published like any other.
            let settler = settler_of(&config)?;
            if let Some(key) = key {
                let _ = all;
                return replay_one(&settler, &key, dry_run).await;
            }
            let filter = ReplayFilter {
                event_type,
                reason,
                error_contains,
                since_ms: since.map(crate::clock::ms),
                until_ms: crate::clock::ms(until),
                key_prefix,
                status,
            };
            replay_filtered(&config, &settler, &filter, until, per_second, dry_run, json).await?;
        }
    }
    Ok(())
}

/// `hubguard dead-letters list`: one line per dead letter, then an error if any could not
/// be read.
async fn list_dead_letters(config: &ConfigArg, json: bool) -> anyhow::Result<()> {
    let config = load_config(config)?;
    let ledger = ledger_of(&config)?;
    let keys = ledger.dead_letter_keys().await?;
    if !json {
        println!("{} dead-lettered event(s)", keys.len());
    }
    // One bad record is reported and the listing carries on; the exit status says
    // whether every record could be read.
    let mut unreadable = 0;
    for key in keys {
        if !show_dead_letter(&ledger, key, json).await {
            unreadable += 1;
        }
    }
    if unreadable > 0 {
        anyhow::bail!("{unreadable} dead-lettered record(s) could not be read (listed above)");
    }
    Ok(())
}

/// Prints the dead letter `key` as a table row or a JSON line; false if its record could
/// not be read.
async fn show_dead_letter(ledger: &Ledger, key: String, json: bool) -> bool {
    // Keys and errors are printed escaped: a tab or newline in one cannot break
    // the table.
    let shown = key.escape_debug().to_string();
    match ledger.record(&key).await {
        Ok(Some(rec)) if json => println!("{}", crate::status::record_view(&rec)),
        Ok(Some(rec)) => println!(
            "{shown}\t{}\tattempts {}\t{}\tpartition {} seq {}",
            rec.dead_letter_reason()
                .map(|r| r.to_string())
                .unwrap_or_default(),
            rec.attempts,
            redact(&rec.last_error.unwrap_or_default()).escape_debug(),
            rec.event.partition_id,
            rec.event.sequence_number
        ),
        Ok(None) if json => println!(
            "{}",
            serde_json::json!({ "key": key, "error": "the ledger record is missing" })
        ),
        Ok(None) => println!("{shown}\t(ledger record missing)"),
        Err(e) => {
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "key": key, "error": redacted(&e.to_string()) })
                );
            } else {
                println!(
                    "{shown}\t(cannot be read: {})",
                    redact(&e.to_string()).escape_debug()
                );
            }
            return false;
        }
    }
    true
}

/// `--since` / `--until` (named `flag` in the error): a time, or a duration ago, if given.
fn parse_bound(
    flag: &str,
    text: Option<String>,
    now: std::time::SystemTime,
) -> anyhow::Result<Option<std::time::SystemTime>> {
    text.map(|t| parse_ago(&t, now))
        .transpose()
        .map_err(|e| anyhow::anyhow!("{flag}: {e}"))
}

/// `hubguard dead-letters replay KEY`: replays one dead letter (with `--dry-run`, says
/// whether it would be).
async fn replay_one(settler: &Settler, key: &str, dry_run: bool) -> anyhow::Result<()> {
    let shown = key.escape_debug().to_string();
    if dry_run {
        let state = settler.ledger.record(key).await?.map(|r| r.state());
        println!(
            "{shown}: {}",
            match state {
                Some(crate::ledger::State::DeadLettered) => "would be replayed",
                Some(_) => "not dead-lettered; nothing to replay",
                None => "the ledger has no record of this key",
            }
        );
        return Ok(());
    }
    match settler.replay(key).await {
        Ok(Some(attempt)) => println!("{shown}: attempt {attempt} scheduled now"),
        Ok(None) => println!("{shown}: not dead-lettered; nothing to replay"),
        Err(e) => anyhow::bail!(
            "{shown}: not replayed: {}",
            redact(&e.to_string()).escape_debug()
        ),
    }
    Ok(())
}

/// `hubguard dead-letters replay` by filter: replays what `filter` takes, prints the counts
/// (and the `--until` that resumes), then an error if any failed or the run was interrupted.
async fn replay_filtered(
    config: &Config,
    settler: &Settler,
    filter: &ReplayFilter,
    until: std::time::SystemTime,
    per_second: f64,
    dry_run: bool,
    json: bool,
) -> anyhow::Result<()> {
    let report = replay_matching(config, settler, filter, per_second, dry_run, json).await?;
    let until_text = crate::clock::rfc3339(until);
    print_replay_report(&report, &until_text, dry_run, json)?;
    if report.failed > 0 {
        anyhow::bail!(
            "{} dead-lettered event(s) could not be replayed (listed above)",
            report.failed
        );
    }
    if report.interrupted {
        anyhow::bail!("interrupted; run the same command with --until {until_text} to resume");
    }
    Ok(())
}

/// Runs the paced replay, printing each step as it goes (with a progress bar on a
/// terminal's stderr) until the end or Ctrl-C.
async fn replay_matching(
    config: &Config,
    settler: &Settler,
    filter: &ReplayFilter,
    per_second: f64,
    dry_run: bool,
    json: bool,
) -> anyhow::Result<ReplayReport> {
    // Ctrl-C stops between two replays: the same command resumes.
    let stop = CancellationToken::new();
    let s = stop.clone();
    let signal = tokio::spawn(async move {
        shutdown_signal().await;
        s.cancel();
    });
    use std::io::IsTerminal as _;
    let bar = !json && std::io::stderr().is_terminal();
    // Ordered retries: a line's dead letters are replayed in order, as a line.
    let options = config.pipeline_options()?;
    let ordering = options
        .retry_ordering
        .lines()
        .is_some()
        .then_some(&options.ordering);
    let report = settler
        .replay_matching_ordered(
            filter,
            per_second,
            dry_run,
            ordering,
            &stop,
            |step, done, total| {
                if bar {
                    eprint!("\r\x1b[2K");
                }
                print_replay_step(step, json);
                if bar {
                    print_progress_bar(done, total);
                }
            },
        )
        .await;
    signal.abort();
    if bar {
        eprintln!();
    }
    Ok(report?)
}

/// Prints what one dead letter came to: a JSON line, or a line of text.
fn print_replay_step(step: &ReplayStep, json: bool) {
    use ReplayStep as S;
    if json {
        println!("{}", serde_json::to_string(step).unwrap_or_default());
        return;
    }
    match step {
        S::Replayed { key, attempt } => {
            println!("{}: attempt {attempt} scheduled now", key.escape_debug())
        }
        S::WouldReplay { key } => println!("{}: would be replayed", key.escape_debug()),
        S::Parked { key, behind } => println!(
            "{}: parked behind {} (released after it, in order)",
            key.escape_debug(),
            behind.escape_debug()
        ),
        S::WouldPark { key, behind } => println!(
            "{}: would be parked behind {}",
            key.escape_debug(),
            behind.escape_debug()
        ),
        S::Skipped { key, why } => println!("{}: skipped: {why}", key.escape_debug()),
        S::Failed { key, error } => println!(
            "{}: not replayed: {}",
            key.escape_debug(),
            error.escape_debug()
        ),
    }
}

/// Draws the progress bar on stderr: `done` of `total` listed.
fn print_progress_bar(done: usize, total: usize) {
    let width = 30;
    let filled = done * width / total.max(1);
    eprint!(
        "[{}{}] {done}/{total}",
        "=".repeat(filled),
        " ".repeat(width - filled)
    );
}

/// Prints the counts of a replay run: a JSON line, or a sentence with the `--until` that
/// resumes it.
fn print_replay_report(
    report: &ReplayReport,
    until_text: &str,
    dry_run: bool,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        let mut v = serde_json::to_value(report)?;
        v["until"] = until_text.into();
        v["dry_run"] = dry_run.into();
        println!("{v}");
    } else {
        println!(
            "{} {}, {} skipped, {} failed (of {} matched, {} listed); --until {until_text}{}",
            report.replayed,
            if dry_run {
                "would be replayed"
            } else {
                "replayed"
            },
            report.skipped,
            report.failed,
            report.matched,
            report.listed,
            if report.interrupted {
                "; interrupted: run the same command with this --until to resume"
            } else {
                ""
            }
        );
    }
    Ok(())
}
