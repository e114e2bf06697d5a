//! The test bed's subcommands: `hubguard demo` and `hubguard emulator` (the emulators in the
//! foreground); `hubguard bench` is `crate::bench::run`. Only with the feature `testbed`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;

use crate::azure::SasKey;
use crate::emulator::blob::DEFAULT_CONTAINER;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::servicebus::QueueSpec;
use crate::emulator::{Emulators, EmulatorsConfig, DEFAULT_KEY, DEFAULT_KEY_NAME};

use super::{demo_log_path, shutdown_signal};

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
    /// Event Hubs's REST port (`GET /{hub}`, answers dated on its clock: what
    /// `hubguard check` reads Event Hubs's clock from); 0 picks a free one.
    #[arg(long, default_value_t = 5673)]
    eventhubs_rest_port: u16,
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

pub(super) async fn run_emulator(args: EmulatorArgs) -> anyhow::Result<()> {
    let wants = |svc: &str| args.only.is_empty() || args.only.iter().any(|o| o == svc);
    let config = EmulatorsConfig {
        host: args.host,
        eventhubs_port: wants("eventhubs").then_some(args.eventhubs_port),
        eventhubs_rest_port: args.eventhubs_rest_port,
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

pub(super) async fn demo(args: crate::demo::DemoArgs) -> anyhow::Result<()> {
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
