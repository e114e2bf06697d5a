//! The `hubguard` command line: `run` (the service), `status`, `retries` and `dead-letters`
//! (the ledger's answers and the operator's actions on them), `partitions` and `checkpoints`
//! (pause, resume, rewind), `emulator` (the emulators standalone), `bench` (performance
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
use crate::pipeline::settle::Settler;
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
}

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
    config: ConfigArg,
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
    config: ConfigArg,
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

/// What `retries retry-now` and `retries cancel` take.
#[derive(Debug, Args)]
pub struct ActionArgs {
    /// The configuration.
    #[command(flatten)]
    config: ConfigArg,
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
            required_unless_present_any = ["all", "event_type", "reason", "error_contains", "since", "until", "key_prefix"],
            conflicts_with_all = ["all", "event_type", "reason", "error_contains", "since", "until", "key_prefix"]
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

/// `T` for `--since`/`--until`: RFC 3339, `now`, or a duration before `now`.
fn parse_ago(text: &str, now: std::time::SystemTime) -> Result<std::time::SystemTime, String> {
    let t = text.trim();
    let when = crate::status::parse_due_before(t, now)?;
    let duration = t.starts_with(|c: char| c.is_ascii_digit())
        && t.ends_with(['s', 'm', 'h', 'd'])
        && t[..t.len() - 1].bytes().all(|b| b.is_ascii_digit());
    if duration && when > now {
        // A duration: before now, not after.
        Ok(now - when.duration_since(now).unwrap_or_default())
    } else {
        Ok(when)
    }
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
    /// Latency per request (blob storage, Service Bus, the webhook) and per AMQP round trip
    /// (Event Hubs): `azure` (blob 8ms:40ms, Service Bus 15ms:80ms, Event Hubs 5ms:20ms,
    /// median:p99), or `blob=8ms:40ms,servicebus=15ms:80ms,eventhubs=5ms:20ms,webhook=50ms`.
    /// None by default.
    #[arg(long, value_name = "PROFILE")]
    latency: Option<crate::emulator::latency::LatencyProfile>,
    /// How the webhook receiver fails, by a hash of each event's key: e.g.
    /// `transient=0.1:1,refused=0.01` (10 % fail once with 503, 1 % are refused for good with
    /// 400; `seed=N` picks others). Every call succeeds by default.
    #[arg(long, value_name = "MIX")]
    webhook_failures: Option<crate::emulator::webhook::FailureMix>,
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
            Command::Retries(
                RetriesCommand::RetryNow(a) | RetriesCommand::Cancel { action: a, .. },
            ) => Some(&a.config.config),
            Command::Partitions(PartitionsCommand::Pause(a) | PartitionsCommand::Resume(a)) => {
                Some(&a.config.config)
            }
            Command::Checkpoints(CheckpointsCommand::Rewind(a)) => Some(&a.config.config),
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
            Command::Retries(cmd) => retries(cmd).await,
            Command::Partitions(cmd) => partitions(cmd).await,
            Command::Checkpoints(CheckpointsCommand::Rewind(args)) => rewind(args).await,
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
        latency: args.latency.unwrap_or_default(),
        webhook_failures: args.webhook_failures.unwrap_or_default(),
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

/// The ledger the configuration names. Only the storage section is wired: the commands that
/// read the ledger alone need no Event Hubs or Service Bus credentials.
fn ledger_of(config: &Config) -> anyhow::Result<Ledger> {
    Ok(StorageAccess::from_config(config)?.ledger(
        &config.eventhubs.hub,
        &config.eventhubs.consumer_group,
        Duration::from_millis(config.retry.call_deadline_ms),
    )?)
}

async fn run_pipeline(args: ConfigArg) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    // Start-up proof: the retry queue must keep hubguard's promise (duplicate detection on,
    // its window long enough for this configuration), or hubguard does not start.
    let mut wiring = Wiring::from_config(&config)?;
    for w in wiring.prove_retry_queue().await? {
        tracing::warn!("{w}");
    }
    let HandlerSection::Webhook(w) = &config.handler;
    let clock = wiring.options_mut().clock.clone();
    let handler = WebhookHandler::new(w.clone()).map_err(|e| anyhow::anyhow!(e))?;
    let parts = wiring.parts(Arc::new(handler.with_clock(clock)))?;
    let owner = parts.options.owner_id.clone();
    let pipeline = Pipeline::new(parts);
    let health = pipeline.health();
    let status = tokio::net::TcpListener::bind(config.status.listen)
        .await
        .with_context(|| format!("cannot bind status.listen {}", config.status.listen))?;
    let status_addr = status.local_addr()?;
    let router = crate::status::router_with_rate_limit(
        health.clone(),
        pipeline.settler().ledger.clone(),
        pipeline.breaker(),
        pipeline.rate_limiter(),
    );
    let status_task = tokio::spawn(async move {
        let _ = axum::serve(status, router).await;
    });
    // What is waiting, for /metrics: the ledger's listing once a minute.
    let _pending_gauges = crate::status::PendingGauges::start_with_lines(
        pipeline.settler().ledger.clone(),
        std::time::Duration::from_secs(60),
        config.pipeline_options()?.retry_ordering.lines().is_some(),
        pipeline.settler().clock().clone(),
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
    match ledger.get(&args.key).await? {
        Some((rec, _)) if args.json => println!("{}", crate::status::record_view(&rec)),
        Some((rec, _)) => print!("{}", crate::status::record_text(&rec)),
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

async fn retries(cmd: RetriesCommand) -> anyhow::Result<u8> {
    let (config, due_before, json) = match cmd {
        RetriesCommand::List {
            config,
            due_before,
            json,
        } => (config, due_before, json),
        RetriesCommand::RetryNow(a) => return act(a, None).await,
        RetriesCommand::Cancel { action, reason } => return act(action, Some(reason)).await,
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

/// A settler as the replicas run it: the configuration's ledger, retry queue, policies,
/// dead-letter destination and deployment.
fn settler_of(config: &Config) -> anyhow::Result<Settler> {
    Ok(Wiring::from_config(config)?.settler()?)
}

/// `partitions pause|resume`: one compare-and-swap on the control record.
async fn partitions(cmd: PartitionsCommand) -> anyhow::Result<u8> {
    use crate::pipeline::control::{self, Pause, Pauses};
    let (pause, args) = match cmd {
        PartitionsCommand::Pause(a) => (true, a),
        PartitionsCommand::Resume(a) => (false, a),
    };
    let config = load_config(&args.config)?;
    let deadline = Duration::from_millis(config.retry.call_deadline_ms);
    let store = StorageAccess::from_config(&config)?.record_store(deadline)?;
    let name = control::record_name(&config.eventhubs.hub, &config.eventhubs.consumer_group);
    let entry = Pause {
        by: operator(args.by),
        since_ms: crate::clock::ms(std::time::SystemTime::now()),
        reason: args.reason,
    };
    let wanted = |now: &Pauses| -> Option<Pauses> {
        let mut next = now.clone();
        match (pause, args.partitions.is_empty()) {
            (true, true) if now.all.is_none() => next.all = Some(entry.clone()),
            (true, false) => {
                for p in &args.partitions {
                    next.partitions
                        .entry(p.clone())
                        .or_insert_with(|| entry.clone());
                }
            }
            (false, true) => next = now.resumed(),
            // Every partition is paused: refused below, nothing written.
            (false, false) if now.all.is_some() => return None,
            (false, false) => {
                for p in &args.partitions {
                    next.partitions.remove(p);
                }
            }
            (true, true) => {}
        }
        (next != *now).then_some(next)
    };
    let (record, written) = if args.dry_run {
        let now = control::current(&store, &name).await?;
        let next = wanted(&now);
        let changes = next.is_some();
        (next.unwrap_or(now), changes)
    } else {
        control::change(&store, &name, wanted).await?
    };
    if !pause && !args.partitions.is_empty() {
        if let Some(all) = &record.all {
            anyhow::bail!(
                "every partition is paused ({}); `partitions resume` without --partition resumes them",
                Pauses::reason(all)
            );
        }
    }
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
async fn rewind(args: RewindArgs) -> anyhow::Result<u8> {
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
    .map_err(|e| anyhow::anyhow!(redact(&e).to_string()))?;
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

/// Who acts: `--by`, else the user name.
fn operator(by: Option<String>) -> String {
    by.or_else(|| std::env::var("USER").ok())
        .or_else(|| std::env::var("USERNAME").ok())
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "operator".into())
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
            rate,
            dry_run,
            json,
        } => {
            let now = std::time::SystemTime::now();
            let per_second = parse_rate(&rate).map_err(|e| anyhow::anyhow!(e))?;
            let since = since
                .map(|t| parse_ago(&t, now))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--since: {e}"))?;
            let until = until
                .map(|t| parse_ago(&t, now))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--until: {e}"))?
                .unwrap_or(now);
            let config = load_config(&config)?;
            // A replay Service Bus refuses is dead-lettered again: published like any other.
            let settler = settler_of(&config)?;
            if let Some(key) = key {
                let _ = all;
                let shown = key.escape_debug().to_string();
                if dry_run {
                    let state = settler.ledger.get(&key).await?.map(|(r, _)| r.state);
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
                match settler.replay(&key).await {
                    Ok(Some(attempt)) => println!("{shown}: attempt {attempt} scheduled now"),
                    Ok(None) => println!("{shown}: not dead-lettered; nothing to replay"),
                    Err(e) => anyhow::bail!(
                        "{shown}: not replayed: {}",
                        redact(&e.to_string()).escape_debug()
                    ),
                }
                return Ok(());
            }
            let filter = crate::pipeline::settle::ReplayFilter {
                event_type,
                reason,
                error_contains,
                since_ms: since.map(crate::clock::ms),
                until_ms: crate::clock::ms(until),
                key_prefix,
            };
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
                    &filter,
                    per_second,
                    dry_run,
                    ordering,
                    &stop,
                    |step, done, total| {
                        use crate::pipeline::settle::ReplayStep as S;
                        if bar {
                            eprint!("\r\x1b[2K");
                        }
                        if json {
                            println!("{}", serde_json::to_string(step).unwrap_or_default());
                        } else {
                            match step {
                                S::Replayed { key, attempt } => {
                                    println!(
                                        "{}: attempt {attempt} scheduled now",
                                        key.escape_debug()
                                    )
                                }
                                S::WouldReplay { key } => {
                                    println!("{}: would be replayed", key.escape_debug())
                                }
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
                                S::Skipped { key, why } => {
                                    println!("{}: skipped: {why}", key.escape_debug())
                                }
                                S::Failed { key, error } => println!(
                                    "{}: not replayed: {}",
                                    key.escape_debug(),
                                    error.escape_debug()
                                ),
                            }
                        }
                        if bar {
                            let width = 30;
                            let filled = done * width / total.max(1);
                            eprint!(
                                "[{}{}] {done}/{total}",
                                "=".repeat(filled),
                                " ".repeat(width - filled)
                            );
                        }
                    },
                )
                .await;
            signal.abort();
            if bar {
                eprintln!();
            }
            let report = report?;
            let until_text = crate::clock::rfc3339(until);
            if json {
                let mut v = serde_json::to_value(&report)?;
                v["until"] = until_text.clone().into();
                v["dry_run"] = dry_run.into();
                println!("{v}");
            } else {
                println!(
                    "{} {}, {} skipped, {} failed (of {} matched, {} listed); --until {until_text}{}",
                    report.replayed,
                    if dry_run { "would be replayed" } else { "replayed" },
                    report.skipped,
                    report.failed,
                    report.matched,
                    report.listed,
                    if report.interrupted { "; interrupted: run the same command with this --until to resume" } else { "" }
                );
            }
            if report.failed > 0 {
                anyhow::bail!(
                    "{} dead-lettered event(s) could not be replayed (listed above)",
                    report.failed
                );
            }
            if report.interrupted {
                anyhow::bail!(
                    "interrupted; run the same command with --until {until_text} to resume"
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
