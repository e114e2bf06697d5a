//! `hubguard bench`: performance figures measured through the real Azure SDK against the
//! in-process emulators, printed as a table or (with `--json`) one JSON line.
//!
//! - The Event Hubs emulator itself: produce and consume throughput of 1 KB events in
//!   batches, over 1 and 4 partitions, through `azure_messaging_eventhubs`.
//! - The guard's cost: a bare SDK consumer loop and `hubguard`'s pipeline with a no-op
//!   handler reading the same events side by side, their events/s and ratio, checkpoint
//!   writes per second, and Service Bus and ledger operations per event on the happy path.
//! - A handler that waits 20 ms per event, with `max_in_flight` 1 and 32 ([`pipelines`]).
//! - The retry path: failure to Service Bus acceptance, due time to actual start.
//! - Resident memory of `hubguard run` with no retries and with many pending ([`memory`]).
//! - `--profile azure`: hubguard at Azure's latencies, with a 50 ms downstream ([`azure`]).
//! - With `--only cost` (not in the default run): Azure operations per event on each path
//!   (happy, first failure, retry, dead letter), counted from the pipeline's calls ([`cost`]).
//! - With `--only rate_limit` (not in the default run): three replicas under one
//!   `handler.rate_limit`, to a receiver that takes everything and to one that answers 429
//!   above its capacity ([`ratelimit`]).

pub mod azure;
pub mod cost;
pub mod cpu;
mod ledger;
pub mod lines;
pub mod memory;
pub mod pipelines;
pub mod ratelimit;
pub mod scale;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use azure_messaging_eventhubs::{
    ConsumerClient, OpenReceiverOptions, StartLocation, StartPosition,
};
use clap::Args;
use futures::StreamExt;

use crate::azure::ConnectionString;
use crate::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use crate::emulator::producer::{self, Outgoing, Plan};

/// Options of `hubguard bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Events per scenario.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Body size of each event in bytes.
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Partition counts to measure (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    partitions: Vec<usize>,
    /// Print one JSON line instead of a table.
    #[arg(long)]
    json: bool,
    /// Scenarios to run (comma separated): eventhubs, guard, concurrency, retries, memory,
    /// scale (not run by default: replicas joining and leaving on a backlog).
    /// rate_limit (not run unless named).
    /// ledger (not run by default).
    /// cpu (not run by default): CPU per event, hubguard against a bare consumer, with the
    /// emulators in a child process (`--cpu-latency`).
    /// cost (not run by default: Azure operations per event on each path).
    /// lines (not run by default): ordered retries at the azure latency profile, free keys
    /// beside long lines and a released line's drain (`--lines`, `--line-length`,
    /// `--handler-ms`; `--events` free events).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "eventhubs,guard,concurrency,retries,memory"
    )]
    only: Vec<String>,
    /// The slow handler's wait per event (ms).
    #[arg(long, default_value_t = 20)]
    delay_ms: u64,
    /// `max_in_flight` of the slow handler's concurrent run.
    #[arg(long, default_value_t = 32)]
    max_in_flight: usize,
    /// Events through the slow handler with concurrency (one by one reads an eighth).
    #[arg(long, default_value_t = 2000)]
    slow_events: usize,
    /// Events that fail once, for the retry timing.
    #[arg(long, default_value_t = 500)]
    retries: usize,
    /// Retries pending in Service Bus for the memory reading.
    #[arg(long, default_value_t = 100_000)]
    pending: usize,
    /// `local`: the emulators answer at once, every scenario of `--only`. `azure`: the
    /// emulators answer at Azure's latencies (`--latency azure`) and a downstream answers
    /// after `--handler-ms`: first-pass rate and its limit, with 10 % failing once, and the
    /// retry drain.
    #[arg(long, default_value = "local", value_parser = ["local", "azure"])]
    profile: String,
    /// `--profile azure`: the downstream's latency (ms).
    #[arg(long, default_value_t = 50)]
    handler_ms: u64,
    /// `--profile azure`: partitions of the hub.
    #[arg(long, default_value_t = 2)]
    azure_partitions: usize,
    /// `--profile azure`: events of each first-pass run.
    #[arg(long, default_value_t = 10_000)]
    azure_events: usize,
    /// `--profile azure`: events failing once, all due in the same 10 s, for the drain.
    #[arg(long, default_value_t = 10_000)]
    azure_retries: usize,
    /// Backlog per partition (4 partitions) of each scale scenario.
    #[arg(long, default_value_t = 600)]
    scale_events: usize,
    /// The handler's wait per event in the scale scenarios (ms; 0: answers at once).
    #[arg(long, default_value_t = 0)]
    scale_delay_ms: u64,
    /// `rate_limit`: the deployment's limit (requests/s, three replicas).
    #[arg(long, default_value_t = 100.0)]
    rate_limit: f64,
    /// `rate_limit`: the receiver's capacity in the adaptive run (429 above it).
    #[arg(long, default_value_t = 50)]
    receiver_cap: u32,
    /// `rate_limit`: events through the cap run (a receiver that takes everything).
    #[arg(long, default_value_t = 1500)]
    rate_events: usize,
    /// `rate_limit`: events through the adaptive run.
    #[arg(long, default_value_t = 2400)]
    adaptive_events: usize,
    /// `cpu`: the emulators' latency profile in their process (`none`, `azure`, or
    /// `service=median:p99,…`, as `hubguard emulator --latency`).
    #[arg(long, default_value = "none")]
    cpu_latency: String,
    /// Settled ledger records for the ledger scenario.
    #[arg(long, default_value_t = 200_000)]
    ledger_settled: usize,
    /// Waiting ledger records for the ledger scenario.
    #[arg(long, default_value_t = 1_000)]
    ledger_pending: usize,
    /// Events through the cost scenario (a fifth on each scripted path).
    #[arg(long, default_value_t = 200)]
    cost_events: usize,
    /// `lines`: keys whose head waits for a retry (spread over 4 partitions).
    #[arg(long, default_value_t = 16)]
    lines: usize,
    /// `lines`: events parked behind each.
    #[arg(long, default_value_t = 25)]
    line_length: usize,
}

/// One measured scenario.
#[derive(Debug, Clone)]
pub struct Throughput {
    /// Partitions of the hub.
    pub partitions: usize,
    /// Events sent and received.
    pub events: usize,
    /// Events per second sent by the producer (batches, one partition after another).
    pub produce_per_s: f64,
    /// Events per second received by one consumer per partition, all partitions at once.
    pub consume_per_s: f64,
}

/// Everything one `hubguard bench` run measured.
#[derive(Debug, Default)]
struct Figures {
    eventhubs: Vec<Throughput>,
    guard: Vec<GuardFigures>,
    concurrency: Option<pipelines::Concurrency>,
    retries: Option<pipelines::RetryTiming>,
    memory: Option<memory::Memory>,
    azure: Option<azure::AzureFigures>,
    scale: Vec<scale::ScaleRun>,
    rate_limit: Option<ratelimit::RateLimitFigures>,
    ledger: Option<ledger::LedgerFigures>,
    cpu: Option<cpu::CpuFigures>,
    cost: Option<cost::CostFigures>,
    lines: Option<lines::LinesFigures>,
}

/// Runs the benchmark and prints it.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.events == 0 || args.partitions.contains(&0) {
        bail!("--events and --partitions must be positive");
    }
    const KNOWN: [&str; 11] = [
        "cpu",
        "lines",
        "eventhubs",
        "guard",
        "concurrency",
        "retries",
        "memory",
        "scale",
        "rate_limit",
        "ledger",
        "cost",
    ];
    if let Some(bad) = args.only.iter().find(|o| !KNOWN.contains(&o.as_str())) {
        bail!(
            "--only: unknown scenario {bad:?} (known: {})",
            KNOWN.join(", ")
        );
    }
    if args.max_in_flight == 0 || args.slow_events == 0 || args.retries == 0 || args.pending == 0 {
        bail!("--max-in-flight, --slow-events, --retries and --pending must be positive");
    }
    let mut f = Figures::default();
    if args.profile == "azure" {
        if args.handler_ms == 0
            || args.azure_partitions == 0
            || args.azure_events == 0
            || args.azure_retries == 0
        {
            bail!("--handler-ms, --azure-partitions, --azure-events and --azure-retries must be positive");
        }
        f.azure = Some(
            azure::azure(
                args.azure_partitions,
                args.azure_events,
                Duration::from_millis(args.handler_ms),
                args.azure_retries,
            )
            .await?,
        );
        f.cpu = Some(cpu::cpu(args.azure_partitions, args.azure_events, 1024, "azure").await?);
        if args.json {
            println!("{}", json_line(&args, &f));
        } else {
            print_tables(&args, &f);
        }
        return Ok(());
    }
    let on = |s: &str| args.only.iter().any(|o| o == s);
    for &p in &args.partitions {
        if on("eventhubs") {
            f.eventhubs
                .push(eventhubs_throughput(p, args.events, args.size).await?);
        }
        if on("guard") {
            f.guard
                .push(guard_vs_bare(p, args.events, args.size).await?);
        }
    }
    if on("concurrency") {
        f.concurrency = Some(
            pipelines::concurrency(
                args.slow_events,
                Duration::from_millis(args.delay_ms),
                args.max_in_flight,
            )
            .await?,
        );
    }
    if on("retries") {
        f.retries = Some(pipelines::retry_timing(args.retries, 4).await?);
    }
    if on("memory") {
        f.memory = Some(memory::memory(args.pending, args.pending, 4).await?);
    }
    if on("scale") {
        f.scale = scale::scale(
            args.scale_events.max(1),
            Duration::from_millis(args.scale_delay_ms),
            args.max_in_flight,
        )
        .await?;
    }
    if on("rate_limit") {
        crate::ratelimit::validate_limit(args.rate_limit)
            .map_err(|e| anyhow::anyhow!("--rate-limit {e}"))?;
        if args.receiver_cap == 0 || args.rate_events == 0 || args.adaptive_events == 0 {
            bail!("--receiver-cap, --rate-events and --adaptive-events must be positive");
        }
        f.rate_limit = Some(
            ratelimit::rate_limit(
                args.rate_limit,
                args.receiver_cap,
                args.rate_events,
                args.adaptive_events,
            )
            .await?,
        );
    }
    if on("cpu") {
        f.cpu = Some(cpu::cpu(4, args.events, args.size, &args.cpu_latency).await?);
    }
    if on("ledger") {
        f.ledger = Some(ledger::ledger(args.ledger_settled, args.ledger_pending).await?);
    }
    if on("cost") {
        if args.cost_events < 5 {
            bail!("--cost-events must be at least 5 (one event on each path)");
        }
        f.cost = Some(cost::cost(args.cost_events).await?);
    }
    if on("lines") {
        f.lines = Some(
            lines::lines(
                4,
                args.lines,
                args.line_length,
                args.events,
                Duration::from_millis(args.handler_ms),
            )
            .await?,
        );
    }
    if args.json {
        println!("{}", json_line(&args, &f));
    } else {
        print_tables(&args, &f);
    }
    Ok(())
}

fn json_line(args: &BenchArgs, f: &Figures) -> String {
    let mut fields = vec![
        format!("\"events\":{}", args.events),
        format!("\"event_bytes\":{}", args.size),
    ];
    for r in &f.eventhubs {
        fields.push(format!(
            "\"eventhubs_produce_per_s_p{}\":{:.0}",
            r.partitions, r.produce_per_s
        ));
        fields.push(format!(
            "\"eventhubs_consume_per_s_p{}\":{:.0}",
            r.partitions, r.consume_per_s
        ));
    }
    for g in &f.guard {
        fields.push(format!(
            "\"bare_per_s_p{}\":{:.0}",
            g.partitions, g.bare_per_s
        ));
        fields.push(format!(
            "\"guard_per_s_p{}\":{:.0}",
            g.partitions, g.guard_per_s
        ));
        fields.push(format!(
            "\"guard_vs_bare_ratio_p{}\":{:.3}",
            g.partitions,
            g.guard_per_s / g.bare_per_s
        ));
    }
    if let Some(g) = f.guard.last() {
        fields.push(format!(
            "\"guard_vs_bare_ratio\":{:.3}",
            g.guard_per_s / g.bare_per_s
        ));
        fields.push(format!(
            "\"checkpoint_writes_per_s\":{:.2}",
            g.checkpoint_writes_per_s
        ));
        fields.push(format!(
            "\"checkpoint_writes_bound_per_s\":{:.2}",
            g.checkpoint_writes_bound_per_s
        ));
        fields.push(format!(
            "\"happy_path_ops_per_event\":{:.4}",
            g.happy_path_ops_per_event
        ));
    }
    if let Some(c) = &f.concurrency {
        fields.push(format!("\"slow_handler_ms\":{}", c.delay.as_millis()));
        fields.push(format!("\"slow_per_s_in_flight_1\":{:.1}", c.one_per_s));
        fields.push(format!(
            "\"slow_per_s_in_flight_{}\":{:.1}",
            c.wide, c.wide_per_s
        ));
        fields.push(format!(
            "\"concurrency_speedup\":{:.2}",
            c.wide_per_s / c.one_per_s
        ));
    }
    if let Some(r) = &f.retries {
        fields.push(format!("\"retries_measured\":{}", r.retries));
        fields.push(format!(
            "\"schedule_latency_p50_ms\":{:.1}",
            r.schedule_ms.0
        ));
        fields.push(format!(
            "\"schedule_latency_p99_ms\":{:.1}",
            r.schedule_ms.1
        ));
        fields.push(format!("\"lateness_p50_ms\":{:.1}", r.lateness_ms.0));
        fields.push(format!("\"lateness_p99_ms\":{:.1}", r.lateness_ms.1));
    }
    if let Some(m) = &f.memory {
        fields.push(format!("\"pending_retries\":{}", m.pending));
        fields.push(format!("\"rss_mb_0_pending\":{:.1}", m.rss_idle_mb));
        fields.push(format!("\"rss_mb_warm\":{:.1}", m.rss_warm_mb));
        fields.push(format!("\"warm_pending_retries\":{}", m.warm_pending));
        fields.push(format!("\"rss_mb_pending\":{:.1}", m.rss_pending_mb));
        fields.push(format!(
            "\"rss_failure_path_fixed_mb\":{:.1}",
            m.rss_warm_mb - m.rss_idle_mb
        ));
        // Named after the default size; `pending_retries` says what was measured.
        fields.push(format!(
            "\"rss_growth_mb_100k_pending\":{:.1}",
            m.growth_per_pending_mb()
        ));
        let (lo, hi) = m.growth_range_mb();
        fields.push(format!("\"rss_growth_min_mb\":{lo:.1}"));
        fields.push(format!("\"rss_growth_max_mb\":{hi:.1}"));
        fields.push(format!(
            "\"rss_growth_readings\":{}",
            m.growth_readings_mb.len()
        ));
    }
    if let Some(a) = &f.azure {
        fields.push("\"profile\":\"azure\"".into());
        fields.push(format!("\"azure_partitions\":{}", a.partitions));
        fields.push(format!("\"azure_events\":{}", a.events));
        fields.push(format!("\"azure_handler_ms\":{}", a.handler.as_millis()));
        fields.push(format!("\"azure_max_in_flight\":{}", a.max_in_flight));
        fields.push(format!(
            "\"azure_retry_concurrency\":{}",
            a.retry_concurrency
        ));
        fields.push(format!(
            "\"azure_events_per_s_per_partition\":{:.0}",
            a.events_per_s_per_partition
        ));
        fields.push(format!(
            "\"azure_limit_per_s_per_partition\":{:.0}",
            a.limit_per_s()
        ));
        fields.push(format!("\"azure_limit_ratio\":{:.3}", a.limit_ratio()));
        fields.push(format!(
            "\"azure_failing_events_per_s_per_partition\":{:.0}",
            a.failing_events_per_s_per_partition
        ));
        fields.push(format!("\"azure_failure_ratio\":{:.3}", a.failure_ratio()));
        fields.push(format!("\"azure_retries\":{}", a.retries));
        fields.push(format!(
            "\"azure_retry_drain_per_s\":{:.0}",
            a.retry_drain_per_s
        ));
        fields.push(format!(
            "\"azure_retry_span_per_s\":{:.0}",
            a.retry_span_per_s
        ));
        fields.push(format!(
            "\"azure_retry_drain_ratio\":{:.3}",
            a.retry_drain_ratio()
        ));
        fields.push(format!(
            "\"azure_retry_lateness_p50_ms\":{:.0}",
            a.retry_lateness_ms.0
        ));
        fields.push(format!(
            "\"azure_retry_lateness_p99_ms\":{:.0}",
            a.retry_lateness_ms.1
        ));
    }
    for r in &f.scale {
        let name = format!(
            "scale_{}_{}",
            r.scenario.replace(' ', "_"),
            if r.handover { "handover" } else { "sdk" }
        );
        fields.push(format!("\"{name}_duplicates\":{}", r.duplicates));
        fields.push(format!("\"{name}_duplicate_pct\":{:.2}", r.duplicate_pct()));
        fields.push(format!("\"{name}_moves\":{}", r.moves));
        fields.push(format!("\"{name}_max_unread_ms\":{}", r.max_unread_ms));
    }
    if let Some(r) = &f.rate_limit {
        let (c, a) = (&r.cap, &r.adaptive);
        fields.push(format!("\"rate_limit_per_s\":{:.1}", c.limit));
        fields.push(format!("\"rate_limit_max_per_s\":{}", c.max_per_s));
        fields.push(format!(
            "\"rate_limit_max_ratio\":{:.3}",
            c.max_per_s as f64 / c.limit
        ));
        fields.push(format!(
            "\"rate_limit_events_per_s\":{:.1}",
            c.events as f64 / c.seconds.max(1e-9)
        ));
        fields.push(format!("\"adaptive_receiver_cap\":{}", a.cap.unwrap_or(0)));
        fields.push(format!("\"adaptive_max_per_s\":{}", a.max_per_s));
        fields.push(format!(
            "\"adaptive_max_per_s_after_30s\":{}",
            a.max_per_s_after_30s
        ));
        fields.push(format!(
            "\"adaptive_converged_at_s\":{}",
            a.converged_at_s.map_or("null".into(), |s| s.to_string())
        ));
        fields.push(format!(
            "\"adaptive_seconds_above_cap_after_30s\":{}",
            a.seconds_above_cap_after_30s
        ));
        fields.push(format!("\"adaptive_throttled\":{}", a.throttled));
        fields.push(format!("\"adaptive_dead_lettered\":{}", a.dead_lettered));
        fields.push(format!("\"adaptive_breaker_opens\":{}", a.breaker_opens));
        fields.push(format!("\"adaptive_decreases\":{}", a.decreases));
        fields.push(format!(
            "\"adaptive_events_per_s\":{:.1}",
            a.events as f64 / a.seconds.max(1e-9)
        ));
    }
    if let Some(c) = &f.cpu {
        fields.push(format!("\"cpu_us_per_event_guard\":{:.1}", c.guard_us));
        fields.push(format!("\"cpu_us_per_event_bare\":{:.1}", c.bare_us));
        fields.push(format!("\"cpu_per_event_ratio\":{:.3}", c.ratio()));
    }
    if let Some(l) = &f.ledger {
        fields.push(format!("\"ledger_settled\":{}", l.settled));
        fields.push(format!("\"ledger_pending\":{}", l.pending));
        fields.push(format!(
            "\"ledger_sweep_calls_settled\":{}",
            l.sweep_calls_settled
        ));
        fields.push(format!(
            "\"ledger_sweep_calls_empty\":{}",
            l.sweep_calls_empty
        ));
        fields.push(format!(
            "\"ledger_sweep_listed_settled\":{}",
            l.sweep_listed_settled
        ));
        fields.push(format!("\"retries_list_ms\":{:.1}", l.retries_list_ms));
        fields.push(format!(
            "\"retries_list_empty_ms\":{:.1}",
            l.retries_list_empty_ms
        ));
        let mb = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.1}"));
        fields.push(format!(
            "\"ledger_sweep_peak_mb_settled\":{}",
            mb(l.sweep_peak_mb.0)
        ));
        fields.push(format!(
            "\"ledger_sweep_peak_mb_empty\":{}",
            mb(l.sweep_peak_mb.1)
        ));
        fields.push(format!(
            "\"ledger_retention_peak_mb_settled\":{}",
            mb(l.retention_peak_mb.0)
        ));
        fields.push(format!(
            "\"ledger_retention_peak_mb_empty\":{}",
            mb(l.retention_peak_mb.1)
        ));
    }
    if let Some(l) = &f.lines {
        fields.push(l.json());
    }
    if let Some(c) = &f.cost {
        for (name, _, ops) in c.paths() {
            fields.push(format!("\"{name}\":{}", ops.json()));
        }
        fields.push(format!("\"cost_lock_s\":{}", c.lock_s));
        fields.push(format!(
            "\"cost_renewed_attempt_s\":{}",
            c.retry_long_attempt_s
        ));
        let background: Vec<String> = c
            .background
            .iter()
            .map(|(k, n)| format!("\"{}\":{n}", k.name()))
            .collect();
        fields.push(format!(
            "\"cost_background\":{{\"seconds\":{:.1},{}}}",
            c.seconds,
            background.join(",")
        ));
    }
    format!("{{{}}}", fields.join(","))
}

/// The cost table: operations per event on each path, by service and kind.
fn print_cost(c: &cost::CostFigures) {
    println!("Azure operations per event on each path (counted from the pipeline's calls; means)");
    let short = |k: cost::Kind| match k {
        cost::Kind::BlobWrite => "write",
        cost::Kind::BlobRead => "read",
        cost::Kind::BlobList => "list",
        cost::Kind::BlobOther => "delete",
        cost::Kind::SbSend => "send",
        cost::Kind::SbReceive => "receive",
        cost::Kind::SbComplete => "complete",
        cost::Kind::SbAbandon => "abandon",
        cost::Kind::SbRenew => "renew",
    };
    print!("{:>34} {:>6} {:>6}", "", "blob", "sb");
    for k in cost::KINDS {
        print!(" {:>8}", short(k));
    }
    println!();
    for (_, label, ops) in c.paths() {
        print!("{label:>34} {:>6.2} {:>6.2}", ops.blob(), ops.servicebus());
        for k in cost::KINDS {
            print!(" {:>8.2}", ops.of(k));
        }
        println!();
    }
    println!(
        "(blob: write = Put Blob, read = Get Blob, list = List Blobs page, delete is free; sb: each is one billed operation. The renewed retry's attempt took {:.2} s on a {:.0} s lock.)",
        c.retry_long_attempt_s, c.lock_s
    );
    let background: Vec<String> = c
        .background
        .iter()
        .map(|(k, n)| format!("{} {n}", k.name()))
        .collect();
    println!(
        "Calls for no event in {:.1} s (sweeps, empty long polls; per replica, not per event): {}",
        c.seconds,
        background.join(", ")
    );
    println!();
}

fn print_rate_limit(r: &ratelimit::RateLimitFigures) {
    for (title, p) in [
        ("a receiver that takes everything", &r.cap),
        (
            "a receiver that answers 429 above its capacity",
            &r.adaptive,
        ),
    ] {
        println!(
            "Rate limit {:.0}/s for three replicas (6 partitions, max_in_flight 8 each), {title}",
            p.limit
        );
        println!(
            "{:>44} {}",
            "receiver capacity",
            p.cap.map_or("unlimited".into(), |c| format!("{c}/s"))
        );
        println!(
            "{:>44} {} in {:.1} s",
            "events delivered", p.events, p.seconds
        );
        println!(
            "{:>44} {} ({:.1} % of the limit)",
            "most requests in any 1 s window",
            p.max_per_s,
            100.0 * p.max_per_s as f64 / p.limit
        );
        if p.cap.is_some() {
            println!("{:>44} {}", "… from 30 s on", p.max_per_s_after_30s);
            println!(
                "{:>44} {}",
                "whole seconds above capacity from 30 s on", p.seconds_above_cap_after_30s
            );
            println!(
                "{:>44} {}",
                "at or below capacity from second",
                p.converged_at_s.map_or("never".into(), |s| s.to_string())
            );
            println!(
                "{:>44} {} 429s, {} decreases, {} dead letters, {} breaker openings",
                "", p.throttled, p.decreases, p.dead_lettered, p.breaker_opens
            );
        }
        let seconds: Vec<String> = p.per_second.iter().map(|n| n.to_string()).collect();
        println!("{:>44} {}", "requests per second", seconds.join(" "));
        println!();
    }
}

fn print_tables(args: &BenchArgs, f: &Figures) {
    if let Some(a) = &f.azure {
        println!(
            "At Azure's latencies (blob 8ms:40ms, Service Bus 15ms:80ms, Event Hubs 5ms:20ms per round trip), a {} ms downstream, {} partitions, {} keyed events (997 keys), max_in_flight {}, retry.concurrency {}",
            a.handler.as_millis(),
            a.partitions,
            a.events,
            a.max_in_flight,
            a.retry_concurrency
        );
        let row = |label: &str, v: String| println!("{label:>52} {v:>12}");
        row(
            "azure_events_per_s_per_partition",
            format!("{:.0}", a.events_per_s_per_partition),
        );
        row(
            "limit (max_in_flight / handler latency)",
            format!("{:.0}", a.limit_per_s()),
        );
        row("azure_limit_ratio", format!("{:.3}", a.limit_ratio()));
        row(
            "events/s per partition, 10 % failing once",
            format!("{:.0}", a.failing_events_per_s_per_partition),
        );
        row("azure_failure_ratio", format!("{:.3}", a.failure_ratio()));
        row(
            &format!(
                "retries drained per s while due and waiting ({} due in ~10 s)",
                a.retries
            ),
            format!("{:.0}", a.retry_drain_per_s),
        );
        row(
            "retries per s, first start to last return",
            format!("{:.0}", a.retry_span_per_s),
        );
        row(
            "limit (retry.concurrency / handler latency)",
            format!("{:.0}", a.retry_limit_per_s()),
        );
        row(
            "azure_retry_drain_ratio",
            format!("{:.3}", a.retry_drain_ratio()),
        );
        row(
            "azure_retry_lateness_p50_ms / p99_ms",
            format!(
                "{:.0} / {:.0}",
                a.retry_lateness_ms.0, a.retry_lateness_ms.1
            ),
        );
        println!();
    }
    if let Some(r) = &f.rate_limit {
        print_rate_limit(r);
    }
    if !f.eventhubs.is_empty() {
        println!("Event Hubs emulator through azure_messaging_eventhubs 0.16 ({} events of {} B, batched sends)", args.events, args.size);
        println!(
            "{:>10} {:>16} {:>16}",
            "partitions", "produce ev/s", "consume ev/s"
        );
        for r in &f.eventhubs {
            println!(
                "{:>10} {:>16.0} {:>16.0}",
                r.partitions, r.produce_per_s, r.consume_per_s
            );
        }
        println!();
    }
    if !f.guard.is_empty() {
        println!("The guard's cost: bare SDK consumer vs hubguard with a no-op handler, same events, side by side");
        println!("(events/s from the first event to the last; checkpoint bound: per partition one write per checkpoint.min_interval, plus the first and the last)");
        println!(
            "{:>10} {:>14} {:>14} {:>8} {:>12} {:>14} {:>12} {:>18}",
            "partitions",
            "bare ev/s",
            "hubguard ev/s",
            "ratio",
            "checkpoints",
            "ckpt writes/s",
            "ckpt bound/s",
            "SB+ledger ops/ev"
        );
        for g in &f.guard {
            println!(
                "{:>10} {:>14.0} {:>14.0} {:>8.3} {:>12} {:>14.2} {:>12.1} {:>18.4}",
                g.partitions,
                g.bare_per_s,
                g.guard_per_s,
                g.guard_per_s / g.bare_per_s,
                g.checkpoint_writes,
                g.checkpoint_writes_per_s,
                g.checkpoint_writes_bound_per_s,
                g.happy_path_ops_per_event
            );
        }
        println!();
    }
    if let Some(c) = &f.concurrency {
        println!(
            "A handler waiting {} ms per event, one partition",
            c.delay.as_millis()
        );
        println!("{:>14} {:>12}", "max_in_flight", "events/s");
        println!("{:>14} {:>12.1}", 1, c.one_per_s);
        println!("{:>14} {:>12.1}", c.wide, c.wide_per_s);
        println!("speed-up: {:.1}x", c.wide_per_s / c.one_per_s);
        println!();
    }
    if let Some(r) = &f.retries {
        println!(
            "The retry path ({} events failing once, retried 1 s later, on the emulator)",
            r.retries
        );
        println!("{:>44} {:>10} {:>10}", "", "p50 ms", "p99 ms");
        println!(
            "{:>44} {:>10.1} {:>10.1}",
            "failure -> Service Bus accepted the retry", r.schedule_ms.0, r.schedule_ms.1
        );
        println!(
            "{:>44} {:>10.1} {:>10.1}",
            "due time -> retry started (lateness)", r.lateness_ms.0, r.lateness_ms.1
        );
        println!();
    }
    if let Some(c) = &f.cpu {
        println!(
            "CPU of the consuming process per event ({} events, {} partitions; emulators in a child process, latency {}; no-op handler)",
            c.events, c.partitions, c.latency
        );
        println!(
            "{:>24} {:>12} {:>12} {:>8}",
            "", "hubguard", "bare SDK", "ratio"
        );
        println!(
            "{:>24} {:>12.1} {:>12.1} {:>8.2}",
            "CPU µs per event",
            c.guard_us,
            c.bare_us,
            c.ratio()
        );
        println!();
    }
    if let Some(l) = &f.ledger {
        println!(
            "The overdue sweep's listing (= /v1/retries, retries list, the gauges): {} waiting retries, with {} settled records and with none",
            l.pending, l.settled
        );
        println!(
            "(store calls billed as Azure does: one List Blobs call per 5,000 blobs, one per read)"
        );
        println!("{:>24} {:>12} {:>12}", "", "settled", "empty");
        println!(
            "{:>24} {:>12} {:>12}",
            "store calls", l.sweep_calls_settled, l.sweep_calls_empty
        );
        println!(
            "{:>24} {:>12.1} {:>12.1}",
            "retries list ms", l.retries_list_ms, l.retries_list_empty_ms
        );
        println!("{:>24} {:>12}", "blobs listed", l.sweep_listed_settled);
        let mb = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
        println!(
            "{:>24} {:>12} {:>12}",
            "sweep peak +MB",
            mb(l.sweep_peak_mb.0),
            mb(l.sweep_peak_mb.1)
        );
        println!(
            "{:>24} {:>12} {:>12}",
            "retention peak +MB",
            mb(l.retention_peak_mb.0),
            mb(l.retention_peak_mb.1)
        );
        println!("(peak resident memory gained during one pass, this process; Linux)");
        println!();
    }
    if let Some(c) = &f.cost {
        print_cost(c);
    }
    if let Some(l) = &f.lines {
        println!(
            "Ordered retries at the azure latency profile: {} partitions, handler {} ms, {} lines of {} parked events, {} events of free keys (max_in_flight {})",
            l.partitions,
            l.handler.as_millis(),
            l.lines,
            l.line_length,
            l.free_events,
            crate::config::DEFAULT_MAX_IN_FLIGHT
        );
        println!(
            "{:>44} {:>10.1}",
            "free keys, events/s, no line open", l.free_per_s_without_lines
        );
        println!(
            "{:>44} {:>10.1}",
            "free keys, events/s, lines open and filling", l.free_per_s_with_lines
        );
        println!("{:>44} {:>10.3}", "ratio", l.free_ratio());
        println!(
            "{:>44} {:>10.1} ({:.2} per line; {:.1} s for all)",
            "released lines drain, parked events/s",
            l.drain_per_s,
            l.drain_per_s_per_line(),
            l.drain_s
        );
        println!();
    }
    if let Some(m) = &f.memory {
        println!("Resident memory of `hubguard run` (a child process; emulators in this one)");
        let row = |label: String, mb: f64| println!("{label:>44} {mb:>10.1} MB");
        row("0 retries pending".into(), m.rss_idle_mb);
        row(
            format!("{} retries pending (warm-up)", m.warm_pending),
            m.rss_warm_mb,
        );
        row(format!("{} retries pending", m.pending), m.rss_pending_mb);
        row(
            "the failure path's fixed cost".into(),
            m.rss_warm_mb - m.rss_idle_mb,
        );
        let (lo, hi) = m.growth_range_mb();
        println!(
            "{:>44} {:>10.1} MB (median of {} readings a second apart; {lo:.1} to {hi:.1})",
            format!("growth for {} pending retries", m.pending),
            m.growth_per_pending_mb(),
            m.growth_readings_mb.len()
        );
    }
    if !f.scale.is_empty() {
        println!(
            "Replicas coming and going on a backlog of 4 x {} events (max_in_flight {}, handler {} ms; update interval 0.5 s, ownership expiration 5 s)",
            args.scale_events, args.max_in_flight, args.scale_delay_ms
        );
        println!(
            "{:>16} {:>22} {:>11} {:>8} {:>6} {:>16}",
            "scenario", "balancing", "duplicates", "%", "moves", "max unread ms"
        );
        for r in &f.scale {
            println!(
                "{:>16} {:>22} {:>11} {:>8.2} {:>6} {:>16}",
                r.scenario,
                if r.handover {
                    "hubguard handover"
                } else {
                    "SDK alone (stealing)"
                },
                r.duplicates,
                r.duplicate_pct(),
                r.moves,
                r.max_unread_ms
            );
        }
        println!();
    }
}

/// Produces `events` events of `size` bytes spread over `partitions` partitions in batches,
/// then consumes them all with one receiver per partition.
pub async fn eventhubs_throughput(
    partitions: usize,
    events: usize,
    size: usize,
) -> anyhow::Result<Throughput> {
    let emulator = EventHubsEmulator::start(EventHubsConfig {
        hubs: vec![HubSpec::new("bench", partitions)],
        ..Default::default()
    })
    .await
    .context("starting the Event Hubs emulator")?;
    let cs: ConnectionString = emulator.connection_string().parse()?;
    let (sent, produce) = produce(&cs, partitions, events, size).await?;
    let per_partition: Vec<usize> = (0..partitions)
        .map(|p| {
            emulator
                .store()
                .hub("bench")
                .map_or(0, |h| h.partitions[p].len())
        })
        .collect();
    let (received, consume) = consume(&cs, &per_partition, 1000).await?;
    emulator.shutdown().await;
    Ok(Throughput {
        partitions,
        events: received,
        produce_per_s: sent as f64 / produce.as_secs_f64(),
        consume_per_s: received as f64 / consume.as_secs_f64(),
    })
}

/// The guard's cost on the happy path.
#[derive(Debug, Clone)]
pub struct GuardFigures {
    /// Partitions.
    pub partitions: usize,
    /// A bare SDK consumer loop (one receiver per partition), events/s.
    pub bare_per_s: f64,
    /// hubguard with a no-op handler, events/s (from start, processor claim included).
    pub guard_per_s: f64,
    /// Checkpoints written.
    pub checkpoint_writes: u64,
    /// Checkpoints written per second of the guard's run.
    pub checkpoint_writes_per_s: f64,
    /// The most checkpoint writes per second the settings allow: per partition, one per
    /// `checkpoint.min_interval`, plus its first and its final write.
    pub checkpoint_writes_bound_per_s: f64,
    /// Service Bus sends plus ledger records, per event.
    pub happy_path_ops_per_event: f64,
}

/// Sends `events` events of `size` bytes in batches, one partition after another (each gets
/// its share); returns how many and how long the sends took.
pub(crate) async fn produce(
    cs: &ConnectionString,
    partitions: usize,
    events: usize,
    size: usize,
) -> anyhow::Result<(usize, Duration)> {
    let plan = Plan::partition_by_partition("bench", events, partitions);
    let produced = producer::produce(cs, &plan, |_| Outgoing::filler(size)).await?;
    Ok((produced.sent, produced.elapsed))
}

/// A bare SDK consumer loop: one receiver per partition reading `per_partition[p]` events
/// from the earliest; returns how many, and the time from the first event to the last.
async fn consume(
    cs: &ConnectionString,
    per_partition: &[usize],
    prefetch: u32,
) -> anyhow::Result<(usize, Duration)> {
    let consumer = Arc::new(
        cs.open_consumer(ConsumerClient::builder(), "bench")
            .await
            .context("opening the consumer")?,
    );
    let (n, first, last) = bare_consume(&consumer, per_partition, prefetch, None).await?;
    if let Ok(c) = Arc::try_unwrap(consumer) {
        c.close().await?;
    }
    Ok((n, last.saturating_duration_since(first)))
}

/// Where and how often a bare consumer checkpoints (the `cpu` scenario's bare loop checkpoints
/// on hubguard's schedule, through the same blob checkpoint store).
#[derive(Clone)]
pub(crate) struct BareCheckpoints {
    pub(crate) store: Arc<crate::azure::BlobCheckpointStore>,
    pub(crate) namespace: String,
    pub(crate) consumer_group: String,
    pub(crate) every_events: u64,
    pub(crate) every: Duration,
}

/// A bare SDK consumer loop over `per_partition[p]` events of each partition, from the
/// earliest, checkpointing on `checkpoints`' schedule if given: events read, first, last.
pub(crate) async fn bare_consume(
    consumer: &Arc<ConsumerClient>,
    per_partition: &[usize],
    prefetch: u32,
    checkpoints: Option<BareCheckpoints>,
) -> anyhow::Result<(usize, Instant, Instant)> {
    let mut tasks = Vec::new();
    for (p, &expected) in per_partition.iter().enumerate() {
        let (consumer, checkpoints) = (consumer.clone(), checkpoints.clone());
        tasks.push(tokio::spawn(async move {
            let receiver = consumer
                .open_receiver_on_partition(
                    p.to_string(),
                    Some(OpenReceiverOptions {
                        start_position: Some(StartPosition {
                            location: StartLocation::Earliest,
                            inclusive: false,
                        }),
                        prefetch: Some(prefetch),
                        ..Default::default()
                    }),
                )
                .await?;
            let mut got = 0usize;
            let (mut first, mut last) = (None, Instant::now());
            let (mut since, mut at) = (0u64, Instant::now());
            {
                let stream = receiver.stream_events();
                futures::pin_mut!(stream);
                while got < expected {
                    let e = match tokio::time::timeout(Duration::from_secs(30), stream.next()).await
                    {
                        Ok(Some(Ok(e))) => e,
                        Ok(Some(Err(e))) => return Err(anyhow::Error::from(e)),
                        _ => bail!("bare consumer stalled after {got} of {expected}"),
                    };
                    got += 1;
                    last = Instant::now();
                    first.get_or_insert(last);
                    let Some(c) = &checkpoints else { continue };
                    since += 1;
                    if since >= c.every_events || at.elapsed() >= c.every || got == expected {
                        use azure_messaging_eventhubs::CheckpointStore as _;
                        c.store
                            .update_checkpoint(azure_messaging_eventhubs::models::Checkpoint {
                                fully_qualified_namespace: c.namespace.clone(),
                                event_hub_name: "bench".into(),
                                consumer_group: c.consumer_group.clone(),
                                partition_id: p.to_string(),
                                offset: e.offset().clone(),
                                sequence_number: e.sequence_number(),
                            })
                            .await?;
                        (since, at) = (0, Instant::now());
                    }
                }
            }
            receiver.close().await?;
            Ok::<_, anyhow::Error>((got, first.unwrap_or(last), last))
        }));
    }
    let mut n = 0;
    let (mut first, mut last): (Option<Instant>, Option<Instant>) = (None, None);
    for t in tasks {
        let (got, f, l) = t.await??;
        n += got;
        first = Some(first.map_or(f, |x| x.min(f)));
        last = Some(last.map_or(l, |x| x.max(l)));
    }
    let now = Instant::now();
    Ok((n, first.unwrap_or(now), last.unwrap_or(now)))
}

/// Reads the same events with a bare SDK consumer loop and with hubguard (no-op handler).
pub async fn guard_vs_bare(
    partitions: usize,
    events: usize,
    size: usize,
) -> anyhow::Result<GuardFigures> {
    use crate::emulator::{Emulators, EmulatorsConfig};
    use crate::pipeline::Pipeline;

    let emulators = Emulators::start(EmulatorsConfig {
        hubs: vec![HubSpec::new("bench", partitions)],
        ..Default::default()
    })
    .await?;
    let eh = emulators.eventhubs.as_ref().context("event hubs")?;
    let cs: ConnectionString = eh.connection_string().parse()?;
    produce(&cs, partitions, events, size).await?;
    let per_partition: Vec<usize> = (0..partitions)
        .map(|p| eh.store().hub("bench").map_or(0, |h| h.partitions[p].len()))
        .collect();
    // Bare SDK consumer.
    let (bare, bare_elapsed) = consume(&cs, &per_partition, 300).await?;

    // hubguard, no-op handler.
    let handler = Arc::new(pipelines::BenchHandler::new(Duration::ZERO, 0, false));
    let wiring = pipelines::wiring(&emulators)?
        .breaker(crate::breaker::BreakerConfig::default())
        .options(pipelines::bench_options());
    let records = Arc::new(wiring.record_store()?);
    let parts = wiring
        .with_records(records.clone())
        .parts(handler.clone())?;
    let min_interval = parts.options.checkpoint_min_interval;
    let pipeline = Pipeline::new(parts);
    let health = pipeline.health();
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let h = handler.clone();
    pipelines::wait_progress(
        "hubguard",
        || h.delivered.load(std::sync::atomic::Ordering::Relaxed),
        bare as u64,
    )
    .await?;
    let guard_elapsed = handler.busy();
    cancel.cancel();
    run.await??;
    let snap = health.snapshot();
    let sb_sends = emulators
        .servicebus
        .as_ref()
        .context("service bus")?
        .counters("retries")
        .map_or(0, |c| c.sends);
    let ledger_records = records_count(&*records).await?;
    emulators.shutdown().await;
    let secs = guard_elapsed.as_secs_f64().max(1e-9);
    Ok(GuardFigures {
        partitions,
        bare_per_s: bare as f64 / bare_elapsed.as_secs_f64().max(1e-9),
        guard_per_s: snap.delivered as f64 / secs,
        checkpoint_writes: snap.checkpoints,
        checkpoint_writes_per_s: snap.checkpoints as f64 / secs,
        // Per partition: one write per minimum interval, plus the first and the final one.
        checkpoint_writes_bound_per_s: partitions as f64
            * ((secs / min_interval.as_secs_f64()).floor() + 2.0)
            / secs,
        happy_path_ops_per_event: (sb_sends + ledger_records) as f64 / bare.max(1) as f64,
    })
}

async fn records_count(records: &dyn crate::azure::RecordStore) -> anyhow::Result<u64> {
    Ok(records.list("ledger/").await?.len() as u64
        + records.list("deadletters/").await?.len() as u64)
}
