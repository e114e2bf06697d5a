//! The `hubguard` command line: `run` (the service), `status`, `retries` and `dead-letters`
//! (the ledger's answers), `emulator` (the emulators standalone), `bench` (performance
//! figures through the real SDK), and `completions` and `man` (generated from this
//! definition).
//!
//! Exit codes: [`EXIT_OK`], [`EXIT_FAILURE`], [`EXIT_USAGE`], [`EXIT_UNKNOWN_KEY`].

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};

use crate::azure::SasKey;
use crate::config::{Config, HandlerSection};
use crate::emulator::blob::DEFAULT_CONTAINER;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::servicebus::QueueSpec;
use crate::emulator::{Emulators, EmulatorsConfig, DEFAULT_KEY, DEFAULT_KEY_NAME};
use crate::handler::webhook::WebhookHandler;
use crate::ledger::Ledger;
use crate::pipeline::settle::{Policies, Settler};
use crate::pipeline::Pipeline;
use crate::redact::{redact, redacted};
use crate::wiring::{StorageAccess, Wiring};
use tokio_util::sync::CancellationToken;

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

/// hubguard: Azure Event Hubs consumption with a checkpoint guard.
#[derive(Debug, Parser)]
#[command(
    name = "hubguard",
    version,
    about,
    long_about = None,
    after_help = "Exit status: 0 success; 1 failure (configuration, an unreachable dependency, \
a demo that lost an event); 2 usage error; 3 `status`: the ledger has no record of the key."
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
    /// The ledger's answer to "when will this retry?" for an idempotency key.
    Status(StatusArgs),
    /// List or replay dead-lettered events.
    #[command(name = "dead-letters", subcommand)]
    DeadLetters(DeadLettersCommand),
    /// What is waiting to retry: pending retries from the ledger.
    #[command(subcommand)]
    Retries(RetriesCommand),
    /// Everything in one process on the embedded emulators, with failures, outages and
    /// crashes; verifies that nothing was lost (exit status 1 if something was).
    Demo(crate::demo::DemoArgs),
    /// Run the local emulators in the foreground until Ctrl-C or SIGTERM.
    Emulator(EmulatorArgs),
    /// Measure throughput through the real Azure SDK against the in-process emulator.
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
}

/// `--config FILE`.
#[derive(Debug, Args)]
pub struct ConfigArg {
    /// The TOML configuration (see hubguard.example.toml).
    #[arg(long, env = "HUBGUARD_CONFIG")]
    config: PathBuf,
}

/// Options of `hubguard status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// The event's idempotency key.
    key: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

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
    /// Schedule dead-lettered events again (a fresh attempt budget, due now).
    Replay {
        /// The configuration.
        #[command(flatten)]
        config: ConfigArg,
        /// The idempotency key to replay.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        key: Option<String>,
        /// Replay every dead-lettered event.
        #[arg(long)]
        all: bool,
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

/// Options of `hubguard emulator`.
#[derive(Debug, Args)]
pub struct EmulatorArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Run only these services (comma separated: eventhubs, servicebus, blob, webhook).
    #[arg(long, value_delimiter = ',', value_parser = ["eventhubs", "servicebus", "blob", "webhook"])]
    only: Vec<String>,
    /// Event Hubs (AMQP) port; 0 picks a free one.
    #[arg(long, default_value_t = 5672)]
    eventhubs_port: u16,
    /// Service Bus (HTTP) port; 0 picks a free one.
    #[arg(long, default_value_t = 5380)]
    servicebus_port: u16,
    /// Blob storage (HTTP) port; 0 picks a free one.
    #[arg(long, default_value_t = 10000)]
    blob_port: u16,
    /// Local webhook receiver port (the downstream for `hubguard run`); 0 picks a free one.
    #[arg(long, default_value_t = 9000)]
    webhook_port: u16,
    /// Admin endpoint (faults, counters) port; 0 picks a free one.
    #[arg(long, default_value_t = 5390)]
    admin_port: u16,
    /// A hub as NAME:PARTITIONS[:CONSUMER_GROUP,…] (repeatable; default `hub:4`).
    /// `$Default` always exists.
    #[arg(long = "hub", value_name = "NAME:PARTITIONS")]
    hubs: Vec<HubSpec>,
    /// A Service Bus queue (repeatable; default `retries`), optionally with its
    /// duplicate-detection window in seconds or `off` (default 600).
    #[arg(long = "queue", value_name = "NAME[:DEDUP_S|off]")]
    queues: Vec<QueueSpec>,
    /// A blob container created at start (repeatable; default `hubguard`).
    #[arg(long = "container", value_name = "NAME")]
    containers: Vec<String>,
    /// Keep state here so it survives a restart (memory only when absent).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// SAS key name clients must sign with.
    #[arg(long, default_value = DEFAULT_KEY_NAME, env = "HUBGUARD_EMULATOR_KEY_NAME")]
    key_name: String,
    /// SAS key clients must sign with (a well-known development value by default).
    #[arg(long, default_value = DEFAULT_KEY, env = "HUBGUARD_EMULATOR_KEY", hide_default_value = true)]
    key: String,
    /// Accept any non-empty Entra ID token (Event Hubs `jwt` tokens; `Authorization: Bearer` on
    /// Service Bus and blob storage), which the emulators cannot verify. Without it they
    /// take SAS only (and blob storage anonymous requests), and refuse a bearer token with 401.
    /// Event Hubs SAS tokens are verified either way, and only under the CBS type
    /// `servicebus.windows.net:sastoken`, as Azure does; a SAS string is never taken as a `jwt`.
    #[arg(long)]
    accept_any_token: bool,
}

impl Command {
    fn config_path(&self) -> Option<&std::path::Path> {
        match self {
            Command::Run(c) => Some(&c.config),
            Command::Status(s) => Some(&s.config.config),
            Command::DeadLetters(
                DeadLettersCommand::List { config, .. }
                | DeadLettersCommand::Replay { config, .. }
                | DeadLettersCommand::Purge { config, .. },
            ) => Some(&config.config),
            Command::Retries(RetriesCommand::List { config, .. }) => Some(&config.config),
            _ => None,
        }
    }
}

/// The demo's log file: its logs stay out of the story it tells on screen.
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
            Command::Emulator(args) => ok(run_emulator(args).await),
            Command::Run(args) => ok(run_pipeline(args).await),
            Command::Demo(args) => ok(demo(args).await),
            Command::Status(args) => status(args).await,
            Command::DeadLetters(cmd) => ok(dead_letters(cmd).await),
            Command::Retries(cmd) => ok(retries(cmd).await),
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

async fn run_emulator(args: EmulatorArgs) -> anyhow::Result<()> {
    let wants = |svc: &str| args.only.is_empty() || args.only.iter().any(|o| o == svc);
    let config = EmulatorsConfig {
        host: args.host,
        eventhubs_port: wants("eventhubs").then_some(args.eventhubs_port),
        servicebus_port: wants("servicebus").then_some(args.servicebus_port),
        blob_port: wants("blob").then_some(args.blob_port),
        webhook_port: wants("webhook").then_some(args.webhook_port),
        hubs: if args.hubs.is_empty() {
            vec![HubSpec::new("hub", 4)]
        } else {
            args.hubs
        },
        queues: if args.queues.is_empty() {
            vec![QueueSpec::new("retries")]
        } else {
            args.queues
        },
        containers: if args.containers.is_empty() {
            vec![DEFAULT_CONTAINER.to_string()]
        } else {
            args.containers
        },
        data_dir: args.data_dir,
        key: SasKey::new(args.key_name, args.key),
        accept_any_token: args.accept_any_token,
    };
    let emulators = Arc::new(
        Emulators::start(config)
            .await
            .context("cannot start the emulators")?,
    );
    let admin = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.admin_port))
        .await
        .with_context(|| {
            format!(
                "cannot bind the admin endpoint on {}:{}",
                args.host, args.admin_port
            )
        })?;
    let admin_addr = admin.local_addr()?;
    let router = crate::emulator::admin::router(emulators.clone());
    let admin_task = tokio::spawn(async move {
        let _ = axum::serve(admin, router).await;
    });
    for line in emulators.lines() {
        println!("{line}");
    }
    println!("admin: http://{admin_addr}");
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    shutdown_signal().await;
    eprintln!("shutting down");
    admin_task.abort();
    let _ = admin_task.await;
    if let Ok(e) = Arc::try_unwrap(emulators) {
        e.shutdown().await;
    }
    Ok(())
}

fn load_config(arg: &ConfigArg) -> anyhow::Result<Config> {
    let config = Config::load(&arg.config, std::env::vars())?;
    for w in config.warnings() {
        tracing::warn!("{w}");
    }
    Ok(config)
}

fn ledger_of(config: &Config) -> anyhow::Result<Ledger> {
    let deadline = Duration::from_millis(config.retry.call_deadline_ms);
    Ok(Ledger::new(
        Arc::new(StorageAccess::from_config(config)?.record_store(deadline)?),
        &config.eventhubs.hub,
        &config.eventhubs.consumer_group,
    ))
}

async fn run_pipeline(args: ConfigArg) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    // Start-up proof: the retry queue must keep hubguard's promise (duplicate detection on,
    // its window long enough for this configuration), or hubguard does not start.
    let wiring = Wiring::from_config(&config)?;
    for w in wiring.prove_retry_queue().await? {
        tracing::warn!("{w}");
    }
    let HandlerSection::Webhook(w) = &config.handler;
    let handler = Arc::new(WebhookHandler::new(w.clone()).map_err(|e| anyhow::anyhow!(e))?);
    let parts = wiring.parts(handler)?;
    let owner = parts.options.owner_id.clone();
    let pipeline = Pipeline::new(parts);
    let health = pipeline.health();
    let status = tokio::net::TcpListener::bind(config.status.listen)
        .await
        .with_context(|| format!("cannot bind status.listen {}", config.status.listen))?;
    let status_addr = status.local_addr()?;
    let router = crate::status::router(
        health.clone(),
        pipeline.settler().ledger.clone(),
        pipeline.breaker(),
    );
    let status_task = tokio::spawn(async move {
        let _ = axum::serve(status, router).await;
    });
    // What is waiting, for /metrics: the ledger's listing once a minute.
    let _pending_gauges = crate::status::PendingGauges::start(
        pipeline.settler().ledger.clone(),
        std::time::Duration::from_secs(60),
    );
    // The figures alerts compare readings with (retention headroom).
    let _config_gauges = crate::telemetry::gauges::ConfigGauges::register(
        std::time::Duration::from_secs(config.eventhubs.retention_hours * 3600),
    );
    tracing::info!(hub = %config.eventhubs.hub, consumer_group = %config.eventhubs.consumer_group, owner_id = %owner, status = %status_addr, "hubguard running");
    println!(
        "hubguard: consuming {} ({}) as {owner}; status on http://{status_addr}",
        config.eventhubs.hub, config.eventhubs.consumer_group
    );
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down: finishing in-flight events, writing final checkpoints");
        c.cancel();
    });
    pipeline.run(cancel).await?;
    status_task.abort();
    println!(
        "hubguard: stopped; {}",
        serde_json::to_string(&health.snapshot())?
    );
    Ok(())
}

async fn demo(args: crate::demo::DemoArgs) -> anyhow::Result<()> {
    let json = args.json;
    if !json {
        eprintln!(
            "hubguard demo: logs in {} (the story below; warnings and details there)",
            demo_log_path().display()
        );
        eprintln!(
            "hubguard demo: {} events over {} partitions, {} replicas (max_in_flight {}); downstream outage {}, Service Bus outage {}, blob outage {}, crashes {}",
            args.events,
            args.partitions,
            args.replicas,
            args.max_in_flight,
            args.downstream_outage,
            crate::demo::windows_text(&args.servicebus_outage),
            crate::demo::windows_text(&args.blob_outage),
            args.crash_every
        );
    }
    let report = crate::demo::run(&args, |line| {
        if !json {
            eprintln!("{line}");
        }
    })
    .await?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        crate::demo::print_table(&report);
    }
    if report.lost > 0 {
        anyhow::bail!("{} event(s) lost", report.lost);
    }
    if !report.clean() {
        anyhow::bail!(
            "checks failed: {} checkpoint(s) past an unsettled event, {} attempt regression(s), {} retry message(s) scheduled twice: {:?}",
            report.checks.checkpoint_violations,
            report.checks.attempt_regressions,
            report.checks.double_scheduled,
            report.checks.problems
        );
    }
    Ok(())
}

/// `hubguard status`: exits [`EXIT_UNKNOWN_KEY`] when the ledger has no record of the key.
async fn status(args: StatusArgs) -> anyhow::Result<u8> {
    let config = load_config(&args.config)?;
    let ledger = ledger_of(&config)?;
    match ledger.get(&args.key).await? {
        Some((rec, _)) if args.json => println!("{}", crate::status::record_view(&rec)),
        Some((rec, _)) => print!("{}", crate::status::record_text(&rec)),
        None if args.json => {
            println!(
                "{}",
                serde_json::json!({ "key": args.key, "state": "UNKNOWN", "delivered_records_kept_days": config.ledger.retention_days })
            );
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

async fn retries(cmd: RetriesCommand) -> anyhow::Result<()> {
    let RetriesCommand::List {
        config,
        due_before,
        json,
    } = cmd;
    let due_before = due_before
        .map(|t| crate::status::parse_due_before(&t, std::time::SystemTime::now()))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--due-before: {e}"))?;
    let config = load_config(&config)?;
    let ledger = ledger_of(&config)?;
    let pending = crate::status::pending_retries(&ledger, due_before).await?;
    if json {
        for p in &pending {
            println!("{}", crate::status::pending_view(p));
        }
    } else {
        print!("{}", crate::status::pending_text(&pending));
    }
    Ok(())
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

async fn dead_letters(cmd: DeadLettersCommand) -> anyhow::Result<()> {
    match cmd {
        DeadLettersCommand::Purge {
            config,
            before,
            dry_run,
            json,
        } => purge_dead_letters(&config, &before, dry_run, json).await?,
        DeadLettersCommand::List { config, json } => {
            let config = load_config(&config)?;
            let ledger = ledger_of(&config)?;
            let keys = ledger.dead_letter_keys().await?;
            if !json {
                println!("{} dead-lettered event(s)", keys.len());
            }
            // One bad record is reported and the listing carries on; the exit status says
            // whether every record could be read.
            let mut unreadable = 0;
            for key in keys {
                // Keys and errors are printed escaped: a tab or newline in one cannot break
                // the table.
                let shown = key.escape_debug().to_string();
                match ledger.get(&key).await {
                    Ok(Some((rec, _))) if json => println!("{}", crate::status::record_view(&rec)),
                    Ok(Some((rec, _))) => println!(
                        "{shown}\t{}\tattempts {}\t{}\tpartition {} seq {}",
                        rec.dead_letter_reason
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
                        unreadable += 1;
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
                    }
                }
            }
            if unreadable > 0 {
                anyhow::bail!(
                    "{unreadable} dead-lettered record(s) could not be read (listed above)"
                );
            }
        }
        DeadLettersCommand::Replay { config, key, all } => {
            let config = load_config(&config)?;
            let ledger = ledger_of(&config)?;
            let wiring = Wiring::from_config(&config)?;
            let queue: Arc<dyn crate::azure::RetryQueue> = Arc::new(wiring.retry_queue()?);
            // A replay Service Bus refuses is dead-lettered again: published like any other.
            let settler = Settler::new(
                ledger.clone(),
                queue,
                Policies {
                    default: config.policy.default.clone(),
                    by_type: config.policy.types.clone(),
                },
            )
            .with_dead_letters(wiring.dead_letter_destination()?)
            .with_deployment(wiring.deployment());
            let keys = if all {
                ledger.dead_letter_keys().await?
            } else {
                key.into_iter().collect()
            };
            // Each key on its own: one that fails is reported and the others go on.
            let (mut replayed, mut failed) = (0, 0);
            for key in keys {
                let shown = key.escape_debug().to_string();
                match settler.replay(&key).await {
                    Ok(Some(attempt)) => {
                        replayed += 1;
                        println!("{shown}: attempt {attempt} scheduled now");
                    }
                    Ok(None) => println!("{shown}: not dead-lettered; nothing to replay"),
                    Err(e) => {
                        failed += 1;
                        println!(
                            "{shown}: not replayed: {}",
                            redact(&e.to_string()).escape_debug()
                        );
                    }
                }
            }
            println!("{replayed} replayed");
            if failed > 0 {
                anyhow::bail!(
                    "{failed} dead-lettered event(s) could not be replayed (listed above)"
                );
            }
        }
    }
    Ok(())
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
