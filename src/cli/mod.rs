//! The `hubguard` command line (the feature `cli`): `run` (the service), `status`, `retries`
//! and `dead-letters` (the ledger's answers and the operator's actions on them), `partitions`
//! and `checkpoints` (pause, resume, rewind), and `completions` and `man` (generated from this
//! definition); with the test bed (the feature `testbed`) also `demo`, `emulator` (the
//! emulators standalone) and `bench` (performance figures through the real SDK).
//!
//! Exit codes: [`EXIT_OK`], [`EXIT_FAILURE`], [`EXIT_USAGE`], [`EXIT_UNKNOWN_KEY`].

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};

use crate::config::Config;
use crate::ledger::Ledger;
use crate::pipeline::settle::Settler;
use crate::redact::{redact, redacted};
use crate::status::parse_ago;
use crate::wiring::{StorageAccess, Wiring};

#[cfg(feature = "testbed")]
mod bed;
mod check;
mod dead_letters;
mod partitions;
mod retries;
mod run;
mod storm;

#[cfg(feature = "testbed")]
pub use bed::EmulatorArgs;
#[cfg(feature = "testbed")]
use bed::{demo, run_emulator};
use dead_letters::dead_letters;
pub use dead_letters::DeadLettersCommand;
use partitions::{partitions, rewind};
pub use partitions::{CheckpointsCommand, PartitionsCommand, PauseArgs, RewindArgs};
use retries::{retries, status};
pub use retries::{ActionArgs, PauseRetriesArgs, RetriesCommand, StatusArgs};
use run::run_pipeline;
pub use storm::{StormArgs, StormGuardCommand};

/// Success.
pub const EXIT_OK: u8 = 0;
/// A failure: bad configuration, a dependency unreachable, the demo lost an event or a check
/// failed.
pub const EXIT_FAILURE: u8 = 1;
/// The command line is wrong (clap's code for usage errors).
pub const EXIT_USAGE: u8 = 2;
/// `hubguard status KEY`: the ledger has no record of the key (delivered on its first
/// attempt, or never seen: hubguard cannot tell which).
pub const EXIT_UNKNOWN_KEY: u8 = 3;
/// `retries retry-now|cancel`: the event is not waiting for a retry (delivered, or
/// dead-lettered): nothing was changed.
pub const EXIT_NOT_PENDING: u8 = 4;
/// `retries retry-now|cancel`: the attempt is due now or running; it was left to finish
/// (run the command again once `hubguard status` shows it settled).
pub const EXIT_BUSY: u8 = 5;
/// `checkpoints rewind`: refused, nothing written (a partition a live replica owns is not
/// paused).
pub const EXIT_REFUSED: u8 = 6;
/// `checkpoints rewind`: written, but an owner had not applied it within `--wait` (it will,
/// once what it read settles; `hubguard partitions status` shows when).
pub const EXIT_WAITING: u8 = 7;

/// hubguard: Azure Event Hubs consumption with a checkpoint guard.
#[derive(Debug, Parser)]
#[command(
    name = "hubguard",
    version,
    about,
    long_about = None,
    after_help = "Exit status: 0 success; 1 failure (configuration, an unreachable dependency, \
a demo that lost an event); 2 usage error; 3 the ledger has no record of the key; 4 `retries \
retry-now|cancel`: not waiting for a retry; 5 `retries retry-now|cancel`: the attempt is due or \
running, left to finish; 6 `checkpoints rewind`: refused (a partition is owned and not paused), \
nothing written; 7 `checkpoints rewind`: an owner had not applied it within --wait."
)]
pub struct Cli {
    /// Log format: `text` (human-readable; coloured only on a terminal, never with
    /// NO_COLOR) or `json` (one object per line). Default: the configuration's
    /// `[log] format` (HUBGUARD_LOG__FORMAT), else text. Logs go to stderr (the demo's to a
    /// file); RUST_LOG adds filter directives.
    #[arg(long, global = true, value_enum)]
    log_format: Option<crate::telemetry::logs::LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the checkpoint-guarded pipeline from a TOML config (HUBGUARD_* overrides).
    Run(ConfigArg),
    /// Preflight against the configured account and namespace: each resource reachable,
    /// each permission proven by a harmless operation, the retry queue's settings, the clock
    /// offset; each failure with its fix. Exit 1 when any fails.
    Check(ConfigArg),
    /// The ledger's answer to "when will this retry?" for an idempotency key.
    Status(StatusArgs),
    /// List or replay dead-lettered events.
    #[command(name = "dead-letters", subcommand)]
    DeadLetters(DeadLettersCommand),
    /// What is waiting to retry: pending retries from the ledger; run one now, or cancel it.
    #[command(subcommand)]
    Retries(RetriesCommand),
    /// Pause or resume reading partitions: every replica follows within seconds.
    #[command(subcommand)]
    Partitions(PartitionsCommand),
    /// Move the consumer group's checkpoints back, to deliver events again.
    #[command(subcommand)]
    Checkpoints(CheckpointsCommand),
    /// The dead-letter storm guard: status, release, accept the refusals, hold by hand.
    #[command(name = "storm-guard", subcommand)]
    StormGuard(StormGuardCommand),
    /// Everything in one process on the embedded emulators, with failures, outages and
    /// crashes; verifies that nothing was lost (exit status 1 if something was).
    #[cfg(feature = "testbed")]
    Demo(crate::demo::DemoArgs),
    /// Run the local emulators in the foreground until Ctrl-C or SIGTERM.
    #[cfg(feature = "testbed")]
    Emulator(EmulatorArgs),
    /// Measure throughput through the real Azure SDK against the in-process emulator.
    #[cfg(feature = "testbed")]
    Bench(crate::bench::BenchArgs),
    /// Print a shell completion script (e.g. `hubguard completions bash >
    /// /etc/bash_completion.d/hubguard`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff) to stdout, or write one page per command into --dir
    /// (`hubguard man | man -l -`).
    Man {
        /// Write hubguard.1, hubguard-run.1, … into this directory.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// `--config FILE`.
#[derive(Debug, Args)]
pub struct ConfigArg {
    /// The TOML configuration (see hubguard.example.toml).
    #[arg(long, env = "HUBGUARD_CONFIG")]
    config: PathBuf,
}

impl Command {
    fn config_path(&self) -> Option<&std::path::Path> {
        match self {
            Command::Run(c) | Command::Check(c) => Some(&c.config),
            Command::Status(s) => Some(&s.config.config),
            Command::DeadLetters(
                DeadLettersCommand::List { config, .. }
                | DeadLettersCommand::Replay { config, .. }
                | DeadLettersCommand::Purge { config, .. },
            ) => Some(&config.config),
            Command::Retries(
                RetriesCommand::List { config, .. } | RetriesCommand::Paused { config, .. },
            ) => Some(&config.config),
            Command::Retries(RetriesCommand::Pause(a) | RetriesCommand::Resume(a)) => {
                Some(&a.config.config)
            }
            Command::Retries(
                RetriesCommand::RetryNow(a) | RetriesCommand::Cancel { action: a, .. },
            ) => Some(&a.config.config),
            Command::Partitions(PartitionsCommand::Pause(a) | PartitionsCommand::Resume(a)) => {
                Some(&a.config.config)
            }
            Command::Checkpoints(CheckpointsCommand::Rewind(a)) => Some(&a.config.config),
            Command::StormGuard(c) => Some(&c.args().config.config),
            _ => None,
        }
    }
}

/// The demo's log file: its logs stay out of the story it tells on screen.
#[cfg(feature = "testbed")]
fn demo_log_path() -> PathBuf {
    std::env::temp_dir().join(format!("hubguard-demo-{}.log", std::process::id()))
}

fn telemetry_options(cli: &Cli) -> crate::telemetry::Options {
    use crate::telemetry::logs::{format_from_config, LogWriter};
    let format = cli
        .log_format
        .or_else(|| format_from_config(cli.command.config_path(), std::env::vars()))
        .unwrap_or_default();
    let writer = match &cli.command {
        #[cfg(feature = "testbed")]
        Command::Demo(_) => LogWriter::File(demo_log_path()),
        _ => LogWriter::Stderr,
    };
    crate::telemetry::Options {
        format,
        writer,
        export: crate::telemetry::export_from_env(),
        ..Default::default()
    }
}

fn generated(command: &Command) -> Option<anyhow::Result<()>> {
    use clap::CommandFactory as _;
    use std::io::Write as _;
    match command {
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "hubguard", &mut out);
            Some(std::io::stdout().write_all(&out).map_err(Into::into))
        }
        Command::Man { dir: None } => {
            let mut out = Vec::new();
            Some(
                clap_mangen::Man::new(Cli::command())
                    .render(&mut out)
                    .and_then(|()| std::io::stdout().write_all(&out))
                    .map_err(Into::into),
            )
        }
        Command::Man { dir: Some(dir) } => Some(
            std::fs::create_dir_all(dir)
                .and_then(|()| clap_mangen::generate_to(Cli::command(), dir))
                .with_context(|| format!("cannot write man pages to {}", dir.display())),
        ),
        _ => None,
    }
}

/// A panic's message reaches stderr without the log layer (the handler's panics are caught,
/// but the hook prints them first): it passes the redaction rule too.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "Box<dyn Any>".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_default();
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        eprintln!("thread '{name}' panicked{at}:\n{}", redact(&message));
        let trace = std::backtrace::Backtrace::capture();
        if trace.status() == std::backtrace::BacktraceStatus::Captured {
            eprintln!("{}", redact(&trace.to_string()));
        }
    }));
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    install_panic_hook();
    let cli = Cli::parse();
    if let Some(done) = generated(&cli.command) {
        return match done {
            Ok(()) => ExitCode::from(EXIT_OK),
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(EXIT_FAILURE)
            }
        };
    }
    crate::azure::install_crypto_provider();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let options = telemetry_options(&cli);
    let json_logs = options.format == crate::telemetry::logs::LogFormat::Json;
    let result = runtime.block_on(async move {
        let _telemetry = crate::telemetry::init_with(options);
        let ok = |r: anyhow::Result<()>| r.map(|()| EXIT_OK);
        match cli.command {
            #[cfg(feature = "testbed")]
            Command::Emulator(args) => ok(run_emulator(args).await),
            Command::Run(args) => ok(run_pipeline(args).await),
            Command::Check(args) => check::check(args).await,
            #[cfg(feature = "testbed")]
            Command::Demo(args) => ok(demo(args).await),
            Command::Status(args) => status(args).await,
            Command::DeadLetters(cmd) => ok(dead_letters(cmd).await),
            Command::Retries(cmd) => retries(cmd).await,
            Command::Partitions(cmd) => partitions(cmd).await,
            Command::Checkpoints(CheckpointsCommand::Rewind(args)) => rewind(args).await,
            Command::StormGuard(cmd) => storm::storm_guard(cmd).await,
            #[cfg(feature = "testbed")]
            Command::Bench(args) => ok(crate::bench::run(args).await),
            Command::Completions { .. } | Command::Man { .. } => Ok(EXIT_OK),
        }
    });
    match result {
        Ok(code) => ExitCode::from(code),
        // With JSON logs, the last word is a JSON line too (a collector reads every line).
        Err(e) if json_logs => {
            let now = time::OffsetDateTime::now_utc()
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default();
            eprintln!(
                "{}",
                serde_json::json!({"time": now, "level": "ERROR", "target": "hubguard", "message": redacted(&format!("{e:#}")), "fields": {}})
            );
            ExitCode::from(EXIT_FAILURE)
        }
        Err(e) => {
            eprintln!("error: {}", redact(&format!("{e:#}")));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn load_config(arg: &ConfigArg) -> anyhow::Result<Config> {
    let config = Config::load(&arg.config, std::env::vars())?;
    for w in config.warnings() {
        tracing::warn!("{w}");
    }
    Ok(config)
}

/// The ledger the configuration names. Only the storage section is wired: the commands that
/// read the ledger alone need no Event Hubs or Service Bus credentials.
fn ledger_of(config: &Config) -> anyhow::Result<Ledger> {
    Ok(StorageAccess::from_config(config)?.ledger(
        &config.eventhubs.hub,
        &config.eventhubs.consumer_group,
        Duration::from_millis(config.retry.call_deadline_ms),
    )?)
}

/// A settler as the replicas run it: the configuration's ledger, retry queue, policies,
/// dead-letter destination and deployment.
fn settler_of(config: &Config) -> anyhow::Result<Settler> {
    Ok(Wiring::from_config(config)?.settler()?)
}

/// Who acts: `--by`, else the user name.
/// The control record's store and name for `config`.
pub(super) fn control_of(
    config: &crate::config::Config,
) -> anyhow::Result<(impl crate::azure::RecordStore, String)> {
    let deadline = std::time::Duration::from_millis(config.retry.call_deadline_ms);
    let store = crate::wiring::StorageAccess::from_config(config)?.record_store(deadline)?;
    let name = crate::pipeline::control::record_name(
        &config.eventhubs.hub,
        &config.eventhubs.consumer_group,
    );
    Ok((store, name))
}

fn operator(by: Option<String>) -> String {
    by.or_else(|| std::env::var("USER").ok())
        .or_else(|| std::env::var("USERNAME").ok())
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "operator".into())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    #[test]
    fn a_time_is_taken_as_written_and_a_duration_as_that_long_ago() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let later = crate::clock::rfc3339(now + Duration::from_secs(3600));
        // A time after now stays after now (it was once mirrored into the past: it ends in a
        // letter, `Z`, like a duration).
        assert_eq!(
            parse_ago(&later, now).unwrap(),
            now + Duration::from_secs(3600)
        );
        let earlier = crate::clock::rfc3339(now - Duration::from_secs(60));
        assert_eq!(
            parse_ago(&earlier, now).unwrap(),
            now - Duration::from_secs(60)
        );
        assert_eq!(
            parse_ago("12h", now).unwrap(),
            now - Duration::from_secs(12 * 3600)
        );
        assert_eq!(
            parse_ago(" 90s ", now).unwrap(),
            now - Duration::from_secs(90)
        );
        assert_eq!(parse_ago("now", now).unwrap(), now);
        assert!(parse_ago("yesterday", now).is_err());
    }
}
