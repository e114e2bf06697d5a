//! `hubguard storm-guard status|release|accept|hold`: the operator's side of the dead-letter
//! storm guard, each change one compare-and-swap on the guard's shared record, written with
//! the operator's name and logged (the audit trail; every replica logs it too when it sees
//! the change).

use std::time::{Duration, SystemTime};

use clap::{Args, Subcommand};

use crate::breaker::storm::{self, StormChange, StormRecord};
use crate::config::HandlerSection;
use crate::wiring::StorageAccess;

use super::{load_config, operator, parse_ago, ConfigArg, EXIT_OK, EXIT_REFUSED};

/// `hubguard storm-guard …`
#[derive(Debug, Subcommand)]
pub enum StormGuardCommand {
    /// Show the guard: whether it holds and why, the window's counts, the next trial.
    Status(StormArgs),
    /// Release a holding guard: held events are attempted again (a receiver that still
    /// refuses trips it again after `min_refusals`).
    Release(StormArgs),
    /// Accept the refusals as real for a while (--for): the guard releases, and refusals are
    /// dead-lettered without tripping it until then.
    Accept(StormArgs),
    /// Hold by hand until released: nothing is dead-lettered, new events wait, no trial
    /// releases it.
    Hold(StormArgs),
}

/// What the `storm-guard` commands take.
#[derive(Debug, Args)]
pub struct StormArgs {
    /// The configuration.
    #[command(flatten)]
    pub(super) config: ConfigArg,
    /// The downstream (default: the configured webhook's host and port, as the breaker
    /// names it).
    #[arg(long)]
    downstream: Option<String>,
    /// The guard of this event type (one with thresholds of its own under
    /// `[storm_guard.event_types."T"]`; default: the downstream's).
    #[arg(long = "event-type", value_name = "TYPE")]
    event_type: Option<String>,
    /// Why (recorded with the change).
    #[arg(long)]
    reason: Option<String>,
    /// Who (recorded); default: $USER.
    #[arg(long)]
    by: Option<String>,
    /// `accept`: for how long refusals are dead-lettered without tripping it (`30m`, `2h`).
    #[arg(long = "for", value_name = "DURATION", default_value = "1h")]
    for_: String,
    /// Print the record as JSON.
    #[arg(long)]
    json: bool,
}

impl StormGuardCommand {
    /// The arguments of any of them.
    pub(super) fn args(&self) -> &StormArgs {
        match self {
            Self::Status(a) | Self::Release(a) | Self::Accept(a) | Self::Hold(a) => a,
        }
    }
}

/// Runs a `storm-guard` command.
pub(super) async fn storm_guard(cmd: StormGuardCommand) -> anyhow::Result<u8> {
    let args = cmd.args();
    let config = load_config(&args.config)?;
    let deadline = Duration::from_millis(config.retry.call_deadline_ms);
    let store = StorageAccess::from_config(&config)?.record_store(deadline)?;
    let downstream = args.downstream.clone().unwrap_or_else(|| {
        let HandlerSection::Webhook(w) = &config.handler;
        crate::handler::webhook::downstream_of(&w.url)
    });
    let now = SystemTime::now();
    let by = operator(args.by.clone());
    let reason = args.reason.clone();
    let change = match &cmd {
        StormGuardCommand::Status(_) => None,
        StormGuardCommand::Release(_) => Some(StormChange::Release { by, reason }),
        StormGuardCommand::Hold(_) => Some(StormChange::Hold { by, reason }),
        StormGuardCommand::Accept(_) => {
            let since = parse_ago(&args.for_, now)
                .map_err(|e| anyhow::anyhow!("--for {}: {e}", args.for_))?;
            let span = now.duration_since(since).unwrap_or_default();
            if span.is_zero() {
                anyhow::bail!("--for must be a positive duration such as 30m or 2h");
            }
            Some(StormChange::Accept {
                by,
                until: now + span,
                reason,
            })
        }
    };
    let guard = &config.storm_guard;
    let lane = args.event_type.as_deref();
    if let Some(t) = lane.filter(|t| guard.lane_of(Some(t)).is_none()) {
        anyhow::bail!(
            "--event-type {t}: [storm_guard.event_types.\"{t}\"] gives it no thresholds of its own, so its events are counted and held by the downstream's guard (leave --event-type out)"
        );
    }
    let (record, changed) = match &change {
        None => (
            storm::read_lane(&store, &downstream, lane)
                .await?
                .unwrap_or_default(),
            false,
        ),
        Some(c) => storm::operate(&store, &downstream, lane, c.clone(), guard, now).await?,
    };
    if let (Some(c), true) = (&change, changed) {
        tracing::warn!(target: "hubguard::storm_guard", downstream = %downstream, event_type = lane.unwrap_or(""), change = ?c, "storm guard changed by an operator");
    }
    print(
        &record,
        (&downstream, lane),
        &guard.lane(lane),
        change.is_some(),
        changed,
        args.json,
    )?;
    if lane.is_none() && change.is_none() && !args.json {
        for t in guard.own_types() {
            let r = storm::read_lane(&store, &downstream, Some(t))
                .await?
                .unwrap_or_default();
            println!(
                "event type {t} (a guard of its own; --event-type {t}): {:?}",
                r.state(now)
            );
        }
    }
    Ok(if change.is_some() && !changed {
        EXIT_REFUSED
    } else {
        EXIT_OK
    })
}

/// Prints the guard of `(downstream, event type)` (the type's guard of its own, if one).
fn print(
    record: &StormRecord,
    (downstream, lane): (&str, Option<&str>),
    config: &storm::StormGuardConfig,
    asked: bool,
    changed: bool,
    json: bool,
) -> anyhow::Result<()> {
    let now = SystemTime::now();
    if json {
        let mut v = serde_json::to_value(record)?;
        v["downstream"] = downstream.into();
        if let Some(t) = lane {
            v["event_type"] = t.into();
        }
        v["state"] = serde_json::to_value(record.state(now))?;
        v["changed"] = changed.into();
        println!("{v}");
        return Ok(());
    }
    if asked {
        println!(
            "{}",
            if changed {
                "changed; every replica follows within a second"
            } else {
                "nothing to change (the guard is not holding)"
            }
        );
    }
    let of_type = lane
        .map(|t| format!(" (event type {t})"))
        .unwrap_or_default();
    println!("downstream {downstream}{of_type}: {:?}", record.state(now));
    if let Some(w) = storm::waiting(record, config) {
        println!("{w}");
    }
    let (attempts, refusals) = record.totals(now, config);
    println!(
        "window: {refusals} refusals of {attempts} attempts; held instead of dead-lettered so far: {}; holds: {}",
        record.held_refusals, record.holds
    );
    if let Some(u) = record.accepted_until_ms.filter(|_| record.accepted(now)) {
        println!(
            "refusals accepted as real until {}",
            crate::clock::rfc3339(crate::clock::at(u))
        );
    }
    if let Some(a) = &record.last_action {
        println!(
            "last change: {} by {} at {}{}",
            a.action,
            a.by,
            crate::clock::rfc3339(crate::clock::at(a.at_ms)),
            a.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        );
    }
    Ok(())
}
