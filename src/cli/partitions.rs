//! `hubguard partitions pause|resume` and `hubguard checkpoints rewind`.

use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};

use crate::redact::redact;
use crate::wiring::{StorageAccess, Wiring};

use super::{load_config, operator, parse_ago, ConfigArg, EXIT_OK, EXIT_REFUSED, EXIT_WAITING};

/// `hubguard partitions …`
#[derive(Debug, Subcommand)]
pub enum PartitionsCommand {
    /// Stop reading these partitions (all, without --partition) on every replica within
    /// seconds; what was read still settles, and checkpoints pass only settled events.
    /// Retries keep running.
    Pause(PauseArgs),
    /// Read them again (every paused partition, without --partition); no restart needed.
    Resume(PauseArgs),
}

/// `hubguard checkpoints …`
#[derive(Debug, Subcommand)]
pub enum CheckpointsCommand {
    /// Move checkpoints back (official layout: other processors and KEDA read it too), so
    /// events are delivered again from a time or a sequence number. Refused (exit 6) for a
    /// partition a live replica owns unless it is paused first (`partitions pause`); the owner
    /// applies it once what it read settles, then reads again from there when resumed.
    /// Exit 7: not applied within --wait (it still will be).
    Rewind(RewindArgs),
}

/// What `checkpoints rewind` takes.
#[derive(Debug, Args)]
pub struct RewindArgs {
    /// The configuration.
    #[command(flatten)]
    pub(super) config: ConfigArg,
    /// Deliver again every event enqueued at or after T: RFC 3339, or a duration ago
    /// (`90s`, `10m`, `2h`, `1d`).
    #[arg(
        long,
        value_name = "T",
        required_unless_present = "sequence",
        conflicts_with = "sequence"
    )]
    to: Option<String>,
    /// Deliver again from this sequence number (with --partition, usually); one older than
    /// the hub retains starts at the oldest retained, and says so.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(0..))]
    sequence: Option<i64>,
    /// A partition id (repeatable); none: every partition.
    #[arg(long = "partition", value_name = "P")]
    partitions: Vec<String>,
    /// Who (recorded in the control record); default: $USER.
    #[arg(long)]
    by: Option<String>,
    /// How long to wait for owners to apply it, in seconds.
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    wait: u64,
    /// Say what would be rewound; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What `partitions pause|resume` take.
#[derive(Debug, Args)]
pub struct PauseArgs {
    /// The configuration.
    #[command(flatten)]
    pub(super) config: ConfigArg,
    /// A partition id (repeatable); none: every partition.
    #[arg(long = "partition", value_name = "P")]
    partitions: Vec<String>,
    /// Why (shown by readiness and /v1/status).
    #[arg(long)]
    reason: Option<String>,
    /// Who (recorded); default: $USER.
    #[arg(long)]
    by: Option<String>,
    /// Say what would change; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the control record as JSON.
    #[arg(long)]
    json: bool,
}

/// `partitions pause|resume`: one compare-and-swap on the control record.
pub(super) async fn partitions(cmd: PartitionsCommand) -> anyhow::Result<u8> {
    use crate::pipeline::control::{self, Pause, Pauses};
    let (pause, args) = match cmd {
        PartitionsCommand::Pause(a) => (true, a),
        PartitionsCommand::Resume(a) => (false, a),
    };
    let config = load_config(&args.config)?;
    let (store, name) = super::control_of(&config)?;
    let entry = Pause {
        by: operator(args.by),
        since_ms: crate::clock::ms(std::time::SystemTime::now()),
        reason: args.reason,
    };
    // The one implementation the console's pause and resume call too.
    let control::PauseResult {
        record,
        changed: written,
    } = control::pause_or_resume(
        &store,
        &name,
        pause,
        &args.partitions,
        entry,
        args.dry_run,
    )
    .await
    .map_err(|e| match e {
        control::ControlError::AllPaused(why) => anyhow::anyhow!(
            "every partition is paused ({why}); `partitions resume` without --partition resumes them"
        ),
        e => e.into(),
    })?;
    if args.json {
        let mut v = serde_json::to_value(&record)?;
        v["changed"] = written.into();
        v["dry_run"] = args.dry_run.into();
        println!("{v}");
    } else {
        let verb = match (written, args.dry_run) {
            (false, _) => "nothing to change",
            (true, true) => "would change",
            (true, false) => "changed; every replica follows within seconds",
        };
        println!("{verb}");
        if let Some(all) = &record.all {
            println!("all partitions: {}", Pauses::reason(all));
        }
        for (p, e) in &record.partitions {
            println!("partition {p}: {}", Pauses::reason(e));
        }
        if record.is_empty() {
            println!("no partition is paused");
        }
    }
    Ok(EXIT_OK)
}

/// `checkpoints rewind`: see [`crate::pipeline::rewind`].
pub(super) async fn rewind(args: RewindArgs) -> anyhow::Result<u8> {
    use crate::pipeline::rewind::{self, Outcome, RewindJob, RewindTo};
    let config = load_config(&args.config)?;
    let to = match (&args.to, args.sequence) {
        (_, Some(n)) => RewindTo::Sequence(n),
        (Some(t), None) => RewindTo::Time(
            parse_ago(t, std::time::SystemTime::now()).map_err(|e| anyhow::anyhow!("--to: {e}"))?,
        ),
        (None, None) => anyhow::bail!("give --to T or --sequence N"),
    };
    let deadline = Duration::from_millis(config.retry.call_deadline_ms);
    let wiring = Wiring::from_config(&config)?;
    let blob = StorageAccess::from_config(&config)?.record_store(deadline)?;
    let checkpoints = crate::azure::BlobCheckpointStore::new(blob.container());
    let job = RewindJob {
        target: wiring.eventhubs().clone(),
        checkpoints,
        records: Arc::new(blob),
        expiration: Duration::from_millis(config.processor.ownership_expiration_ms),
        deadline,
        to,
        partitions: args.partitions,
        by: operator(args.by),
        dry_run: args.dry_run,
        wait: Duration::from_secs(args.wait),
    };
    let json = args.json;
    let report = rewind::rewind(&job, |line| {
        if !json {
            eprintln!("{line}");
        }
    })
    .await
    .map_err(|e| anyhow::anyhow!(redact(&e.to_string()).to_string()))?;
    let count = |f: fn(&Outcome) -> bool| report.iter().filter(|l| f(&l.outcome)).count();
    let refused = count(|o| matches!(o, Outcome::Refused { .. }));
    let waiting = count(|o| matches!(o, Outcome::Waiting { .. }));
    let applied = count(|o| matches!(o, Outcome::Applied { .. }));
    if json {
        println!(
            "{}",
            serde_json::json!({
                "to": job.to.to_string(),
                "dry_run": args.dry_run,
                "partitions": report,
                "applied": applied,
                "waiting": waiting,
                "refused": refused,
            })
        );
    } else {
        for l in &report {
            let from = l
                .checkpoint_before
                .map_or("no checkpoint".to_string(), |c| format!("checkpoint {c}"));
            let what = match &l.outcome {
                Outcome::WouldRewind => "would be rewound".to_string(),
                Outcome::Applied { by } => format!("rewound (applied by {by})"),
                Outcome::Waiting { owner: Some(o) } => {
                    format!("waiting for its owner {o} to apply it")
                }
                Outcome::Waiting { owner: None } => "waiting to be applied".to_string(),
                Outcome::Nothing { why } => format!("nothing to do: {why}"),
                Outcome::Refused { why } => format!("refused: {why}"),
            };
            let first = l.first.map_or(String::new(), |f| {
                format!(
                    "; delivered again from sequence number {f}{}{}",
                    l.events_again
                        .map_or(String::new(), |n| format!(" ({n} events)")),
                    l.clamped_from.map_or(String::new(), |c| format!(
                        "; {c} is older than the hub retains"
                    ))
                )
            });
            println!("partition {}: {from}{first}: {what}", l.partition);
        }
        if refused > 0 {
            println!("nothing was written");
        } else if waiting > 0 {
            println!(
                "{waiting} partition(s) still waiting: their owners apply the rewind once what they read settles"
            );
        } else if applied > 0 {
            println!(
                "resume the partitions (`hubguard partitions resume`) to deliver the events again"
            );
        }
    }
    Ok(if refused > 0 {
        EXIT_REFUSED
    } else if waiting > 0 {
        EXIT_WAITING
    } else {
        EXIT_OK
    })
}
