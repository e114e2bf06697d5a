//! The `hubguard` command line: `emulator` (the emulators standalone) and `bench`
//! (performance figures through the real SDK).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};

use crate::azure::SasKey;
use crate::emulator::blob::DEFAULT_CONTAINER;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::servicebus::QueueSpec;
use crate::emulator::{Emulators, EmulatorsConfig, DEFAULT_KEY, DEFAULT_KEY_NAME};

/// hubguard: Azure Event Hubs consumption with a checkpoint guard.
#[derive(Debug, Parser)]
#[command(name = "hubguard", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the local emulators in the foreground until Ctrl-C or SIGTERM.
    Emulator(EmulatorArgs),
    /// Measure throughput through the real Azure SDK against the in-process emulator.
    Bench(crate::bench::BenchArgs),
}

/// Options of `hubguard emulator`.
#[derive(Debug, Args)]
pub struct EmulatorArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Run only these services (comma separated: eventhubs, servicebus, blob).
    #[arg(long, value_delimiter = ',', value_parser = ["eventhubs", "servicebus", "blob"])]
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
    /// Admin endpoint (faults, counters) port; 0 picks a free one.
    #[arg(long, default_value_t = 5390)]
    admin_port: u16,
    /// A hub as NAME:PARTITIONS[:CONSUMER_GROUP,…] (repeatable; default `hub:4`).
    /// `$Default` always exists.
    #[arg(long = "hub", value_name = "NAME:PARTITIONS")]
    hubs: Vec<HubSpec>,
    /// A Service Bus queue (repeatable; default `retries`).
    #[arg(long = "queue", value_name = "NAME")]
    queues: Vec<String>,
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
    /// Accept any non-empty Event Hubs token (e.g. Entra ID JWTs) instead of verifying SAS signatures.
    #[arg(long)]
    accept_any_token: bool,
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Emulator(args) => run_emulator(args).await,
            Command::Bench(args) => crate::bench::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,hubguard=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

async fn run_emulator(args: EmulatorArgs) -> anyhow::Result<()> {
    let wants = |svc: &str| args.only.is_empty() || args.only.iter().any(|o| o == svc);
    let config = EmulatorsConfig {
        host: args.host,
        eventhubs_port: wants("eventhubs").then_some(args.eventhubs_port),
        servicebus_port: wants("servicebus").then_some(args.servicebus_port),
        blob_port: wants("blob").then_some(args.blob_port),
        hubs: if args.hubs.is_empty() {
            vec![HubSpec::new("hub", 4)]
        } else {
            args.hubs
        },
        queues: if args.queues.is_empty() {
            vec![QueueSpec::new("retries")]
        } else {
            args.queues.iter().map(QueueSpec::new).collect()
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
