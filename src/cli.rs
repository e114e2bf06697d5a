//! The `hubguard` command line: `emulator` (the emulators standalone) and `bench`
//! (performance figures through the real SDK).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};

use crate::azure::SasKey;
use crate::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use crate::emulator::{DEFAULT_KEY, DEFAULT_KEY_NAME};

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
    /// Event Hubs (AMQP) port; 0 picks a free one.
    #[arg(long, default_value_t = 5672)]
    eventhubs_port: u16,
    /// A hub as NAME:PARTITIONS[:CONSUMER_GROUP,…] (repeatable; default `hub:4`).
    /// `$Default` always exists.
    #[arg(long = "hub", value_name = "NAME:PARTITIONS")]
    hubs: Vec<HubSpec>,
    /// Keep events here so they survive a restart (memory only when absent).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// SAS key name clients must sign with.
    #[arg(long, default_value = DEFAULT_KEY_NAME, env = "HUBGUARD_EMULATOR_KEY_NAME")]
    key_name: String,
    /// SAS key clients must sign with (a well-known development value by default).
    #[arg(long, default_value = DEFAULT_KEY, env = "HUBGUARD_EMULATOR_KEY", hide_default_value = true)]
    key: String,
    /// Accept any non-empty token (e.g. Entra ID JWTs) instead of verifying SAS signatures.
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
    let hubs = if args.hubs.is_empty() {
        vec![HubSpec::new("hub", 4)]
    } else {
        args.hubs
    };
    let config = EventHubsConfig {
        listen: SocketAddr::new(args.host, args.eventhubs_port),
        hubs: hubs.clone(),
        data_dir: args.data_dir,
        key: SasKey::new(args.key_name, args.key),
        accept_any_token: args.accept_any_token,
    };
    let eventhubs = EventHubsEmulator::start(config).await.with_context(|| {
        format!(
            "cannot start the Event Hubs emulator on {}:{}",
            args.host, args.eventhubs_port
        )
    })?;
    println!("eventhubs: {}", eventhubs.connection_string());
    for hub in &hubs {
        let mut groups = vec!["$Default".to_string()];
        groups.extend(hub.consumer_groups.iter().cloned());
        tracing::info!(hub = %hub.name, partitions = hub.partitions, consumer_groups = ?groups, "serving hub");
    }
    shutdown_signal().await;
    eprintln!("shutting down");
    eventhubs.shutdown().await;
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
