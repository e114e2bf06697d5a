//! `hubguard status` and `hubguard retries …`: the ledger's answer for a key, what waits to
//! retry, and the operator's retry-now and cancel.

use clap::{Args, Subcommand};

use super::{
    control_of, ledger_of, load_config, operator, settler_of, ConfigArg, EXIT_BUSY,
    EXIT_NOT_PENDING, EXIT_OK, EXIT_UNKNOWN_KEY,
};

/// Options of `hubguard status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub(super) config: ConfigArg,
    /// The event's idempotency key.
    key: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `hubguard retries …`
#[derive(Debug, Subcommand)]
pub enum RetriesCommand {
    /// List retries waiting (key, attempt, due time, last error), soonest first, from the
    /// ledger's listing (no record is read).
    List {
        /// The configuration.
        #[command(flatten)]
        config: ConfigArg,
        /// Only those due before this time: RFC 3339, `now` (the overdue ones), or a
        /// duration from now (`90s`, `10m`, `2h`, `1d`).
        #[arg(long, value_name = "T")]
        due_before: Option<String>,
        /// Print JSON lines (`key`, `attempt`, `due`, `last_error`).
        #[arg(long)]
        json: bool,
    },
    /// Run the pending retry of KEY now (its pinned schedule continues after it). The copy
    /// scheduled before stands down when it comes due. Exit 3: unknown key; 4: not waiting
    /// for a retry; 5: the attempt is due or running (left to finish).
    RetryNow(ActionArgs),
    /// No further attempt of KEY: dead-lettered with reason `cancelled` and the reason text
    /// (replayable with `dead-letters replay`). Exit codes as for retry-now.
    Cancel {
        /// The key and the options.
        #[command(flatten)]
        action: ActionArgs,
        /// Why (recorded as the dead letter's last error, with --by).
        #[arg(long)]
        reason: String,
    },
    /// Pause retries: each one that comes due is deferred, without counting an attempt and
    /// without holding any partition, and looked at again every `retry.pause_recheck_ms`
    /// until `retries resume`. Criteria given together must all match; `--all` pauses every
    /// retry. Every replica follows within seconds.
    Pause(PauseRetriesArgs),
    /// Resume the pause with exactly these criteria, or with `--all` every pause of
    /// retries. Paused retries run at their next look (within `retry.pause_recheck_ms`).
    Resume(PauseRetriesArgs),
    /// The operator's pauses of retries: what each holds, who paused it, since when, why.
    Paused {
        /// The configuration.
        #[command(flatten)]
        config: ConfigArg,
        /// Print the pauses as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// What `retries pause` and `retries resume` take.
#[derive(Debug, Args)]
pub struct PauseRetriesArgs {
    /// The configuration.
    #[command(flatten)]
    pub(super) config: ConfigArg,
    /// Retries of this idempotency key.
    #[arg(long)]
    key: Option<String>,
    /// Retries of events of this type (the CloudEvents `type`).
    #[arg(long)]
    event_type: Option<String>,
    /// Retries whose last error contains this text (case-insensitive), e.g. `503`.
    #[arg(long)]
    error: Option<String>,
    /// Every retry (pause), or every pause of retries (resume).
    #[arg(long, conflicts_with_all = ["key", "event_type", "error"])]
    all: bool,
    /// Who acts (recorded in the control record and the audit log); default: $USER.
    #[arg(long)]
    by: Option<String>,
    /// Why (recorded beside the pause).
    #[arg(long)]
    reason: Option<String>,
    /// Say what would change; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the pauses of retries as JSON.
    #[arg(long)]
    json: bool,
}

/// What `retries retry-now` and `retries cancel` take.
#[derive(Debug, Args)]
pub struct ActionArgs {
    /// The configuration.
    #[command(flatten)]
    pub(super) config: ConfigArg,
    /// The event's idempotency key.
    key: String,
    /// Who acts (recorded in the ledger); default: $USER.
    #[arg(long)]
    by: Option<String>,
    /// Say what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// `hubguard status`: exits [`EXIT_UNKNOWN_KEY`] when the ledger has no record of the key.
pub(super) async fn status(args: StatusArgs) -> anyhow::Result<u8> {
    let config = load_config(&args.config)?;
    let ledger = ledger_of(&config)?;
    let parked = match ledger.get(&args.key).await? {
        Some(_) => None,
        // Ordered retries: a parked event has no ledger record yet, only its parked one.
        None => crate::status::parked_view(&ledger, &args.key).await?,
    };
    if let Some(mut v) = parked {
        crate::redact::redact_json(&mut v);
        if args.json {
            println!("{v}");
        } else {
            print!("{}", crate::status::parked_text(&v));
        }
        return Ok(EXIT_OK);
    }
    match ledger.record(&args.key).await? {
        Some(rec) => {
            let mut v = crate::status::record_view(&rec);
            crate::pipeline::control::add_retry_pause(&ledger, &rec, &mut v).await;
            if args.json {
                println!("{v}");
            } else {
                print!("{}", crate::status::record_text(&rec));
                if let Some(why) = v["paused"]["reason_text"].as_str() {
                    println!(
                        "paused: {} — {why}; its next attempt waits, uncounted, until `hubguard retries resume`",
                        v["paused"]["what"].as_str().unwrap_or("")
                    );
                }
            }
        }
        None if args.json => {
            // The status API's answer: why, how long delivered records are kept, since when.
            let keep = (config.ledger.retention_days > 0).then(|| {
                std::time::Duration::from_secs(config.ledger.retention_days.saturating_mul(86_400))
            });
            let view = ledger
                .with_retention(keep)
                .no_record(&args.key, std::time::SystemTime::now());
            println!("{view}");
            return Ok(EXIT_UNKNOWN_KEY);
        }
        None => {
            let kept = match config.ledger.retention_days {
                0 => "delivered records are kept forever (ledger.retention_days = 0)".to_string(),
                d => format!("delivered records are kept {d} days after delivery (ledger.retention_days), so one delivered on a retry before {} has expired", std::time::SystemTime::now().checked_sub(std::time::Duration::from_secs(d.saturating_mul(86_400))).map_or_else(|| "the epoch".to_string(), crate::clock::rfc3339)),
            };
            println!(
                "key:   {}\nstate: UNKNOWN — the ledger has no record of this key. hubguard writes one at an event's first failure and never for a delivery on the first attempt, so this means either that: delivered on its first attempt, delivered on a retry longer ago than retention ({kept}), or never seen by hubguard (not read yet, another key, or a record removed by hand); it cannot tell which",
                args.key
            );
            return Ok(EXIT_UNKNOWN_KEY);
        }
    }
    Ok(EXIT_OK)
}

pub(super) async fn retries(cmd: RetriesCommand) -> anyhow::Result<u8> {
    let (config, due_before, json) = match cmd {
        RetriesCommand::List {
            config,
            due_before,
            json,
        } => (config, due_before, json),
        RetriesCommand::RetryNow(a) => return act(a, None).await,
        RetriesCommand::Cancel { action, reason } => return act(action, Some(reason)).await,
        RetriesCommand::Pause(a) => return pause_or_resume(a, true).await,
        RetriesCommand::Resume(a) => return pause_or_resume(a, false).await,
        RetriesCommand::Paused { config, json } => return paused(config, json).await,
    };
    let due_before = due_before
        .map(|t| crate::status::parse_due_before(&t, std::time::SystemTime::now()))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--due-before: {e}"))?;
    let config = load_config(&config)?;
    let ledger = ledger_of(&config)?;
    let pending = crate::status::pending_retries(&ledger, due_before).await?;
    let lines = ledger.lines(None).await?;
    if json {
        for p in &pending {
            println!("{}", crate::status::pending_view(p));
        }
        for l in &lines {
            let mut v = crate::status::line_view(l);
            v["line"] = true.into();
            println!("{v}");
        }
    } else {
        print!("{}", crate::status::pending_text(&pending));
        print!("{}", crate::status::lines_text(&lines));
    }
    Ok(EXIT_OK)
}

/// `retries retry-now` (no reason) and `retries cancel` (a reason).
async fn act(args: ActionArgs, reason: Option<String>) -> anyhow::Result<u8> {
    use crate::pipeline::settle::ActionOutcome as O;
    let config = load_config(&args.config)?;
    let settler = settler_of(&config)?;
    let by = operator(args.by);
    let (verb, outcome) = match &reason {
        None => (
            "retry-now",
            settler.retry_now(&args.key, &by, args.dry_run).await?,
        ),
        Some(r) => (
            "cancel",
            settler.cancel(&args.key, r, &by, args.dry_run).await?,
        ),
    };
    let when = |t: Option<i64>| {
        t.map(|t| crate::clock::rfc3339(crate::clock::at(t)))
            .unwrap_or_else(|| "-".into())
    };
    let shown = args.key.escape_debug().to_string();
    let (code, text) = match &outcome {
        O::Done {
            attempt,
            previous_due_ms,
        } => {
            let did = match (&reason, args.dry_run) {
                (None, false) => "runs now",
                (None, true) => "would run now",
                (Some(_), false) => "cancelled: dead-lettered as `cancelled`",
                (Some(_), true) => "would be cancelled",
            };
            (
                EXIT_OK,
                format!(
                    "{shown}: attempt {attempt} (was due {}) {did}",
                    when(*previous_due_ms)
                ),
            )
        }
        O::AlreadyDone { attempt } => (
            EXIT_OK,
            format!("{shown}: attempt {attempt}: already done ({verb}); nothing changed"),
        ),
        O::Unknown => (
            EXIT_UNKNOWN_KEY,
            format!("{shown}: the ledger has no record of this key; nothing changed"),
        ),
        O::NotPending { state } => (
            EXIT_NOT_PENDING,
            format!("{shown}: not waiting for a retry ({state:?}); nothing changed"),
        ),
        O::Due { attempt, due_ms } => (
            EXIT_BUSY,
            format!(
                "{shown}: attempt {attempt} is due ({}) or running; left to finish — run again once `hubguard status` shows it settled",
                when(*due_ms)
            ),
        ),
    };
    if args.json {
        let mut v = serde_json::to_value(&outcome)?;
        v["key"] = args.key.clone().into();
        v["action"] = verb.into();
        v["dry_run"] = args.dry_run.into();
        println!("{v}");
    } else {
        println!("{text}");
    }
    Ok(code)
}

/// `retries pause` (`pause`) and `retries resume`: one compare-and-swap on the control
/// record the replicas read every few seconds.
async fn pause_or_resume(args: PauseRetriesArgs, pause: bool) -> anyhow::Result<u8> {
    use crate::pipeline::control::{self, Pause, Resume, RetryFilter};
    let filter = RetryFilter {
        key: args.key,
        event_type: args.event_type,
        error: args.error,
    };
    if filter.is_all() && !args.all {
        anyhow::bail!(
            "name the retries to {}: --key, --event-type, --error (together: all must match), or --all",
            if pause { "pause" } else { "resume" }
        );
    }
    if [&filter.key, &filter.event_type, &filter.error]
        .iter()
        .any(|c| c.as_deref().is_some_and(|c| c.trim().is_empty()))
    {
        anyhow::bail!("an empty --key, --event-type or --error would match nothing useful");
    }
    let config = load_config(&args.config)?;
    let (store, name) = control_of(&config)?;
    let by = operator(args.by);
    let (to_pause, to_resume) = match (pause, args.all) {
        (true, _) => (
            Some((
                filter.clone(),
                Pause {
                    by: by.clone(),
                    since_ms: crate::clock::ms(std::time::SystemTime::now()),
                    reason: args.reason.clone(),
                },
            )),
            None,
        ),
        (false, true) => (None, Some(Resume::Everything)),
        (false, false) => (None, Some(Resume::Filter(filter.clone()))),
    };
    let control::PauseResult { record, changed } =
        control::pause_or_resume_retries(&store, &name, to_pause, to_resume, args.dry_run).await?;
    let verb = if pause { "pause" } else { "resume" };
    if changed && !args.dry_run {
        tracing::info!(target: "hubguard::audit", action = %format!("retries {verb}"), by = %by, what = %filter, reason = args.reason.as_deref().unwrap_or(""), "operator action");
    }
    if args.json {
        let v = serde_json::json!({
            "retries": record.retries,
            "changed": changed,
            "dry_run": args.dry_run,
        });
        println!("{v}");
    } else {
        let said = match (changed, args.dry_run) {
            (false, _) if pause => "already paused; nothing changed".to_string(),
            (false, _) => "no pause of retries matches; nothing changed".to_string(),
            (true, true) => format!("would {verb}"),
            (true, false) => format!("{verb}d; every replica follows within seconds"),
        };
        println!("{said}");
        print!("{}", pauses_text(&record.retries));
    }
    Ok(EXIT_OK)
}

/// `retries paused`.
async fn paused(config: ConfigArg, json: bool) -> anyhow::Result<u8> {
    let config = load_config(&config)?;
    let (store, name) = control_of(&config)?;
    let record = crate::pipeline::control::current(&store, &name).await?;
    if json {
        println!("{}", serde_json::json!({ "retries": record.retries }));
    } else {
        print!("{}", pauses_text(&record.retries));
    }
    Ok(EXIT_OK)
}

/// The pauses of retries, one line each (or that there are none).
pub(crate) fn pauses_text(pauses: &[crate::pipeline::control::RetryPause]) -> String {
    if pauses.is_empty() {
        return "no retries are paused\n".into();
    }
    pauses
        .iter()
        .map(|p| {
            format!(
                "paused: {} — {}\n",
                p.filter,
                crate::pipeline::control::Pauses::reason(&p.pause)
            )
        })
        .collect()
}
