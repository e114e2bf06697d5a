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
//!
//! This module takes the options and runs the scenarios asked for; the `eventhubs` and
//! `guard` scenarios and the SDK loops the others share are in `throughput`, and the
//! figures are printed by `tables` or, with `--json`, `json`.

pub mod azure;
pub mod cost;
pub mod cpu;
mod json;
mod ledger;
pub mod lines;
pub mod memory;
pub mod pipelines;
pub mod ratelimit;
pub mod scale;
mod tables;
mod throughput;

use std::time::Duration;

use anyhow::bail;
use clap::Args;

use self::json::json_line;
use self::tables::tables;
pub(crate) use self::throughput::{bare_consume, produce, BareCheckpoints};
pub use self::throughput::{eventhubs_throughput, guard_vs_bare, GuardFigures, Throughput};

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
    /// `lines`: events per call when a released line drains in ordered batches (1: that run
    /// is left out).
    #[arg(long, default_value_t = 100)]
    lines_batch_max: usize,
    /// `lines`: events parked behind each line (one per partition) in the batched drain.
    #[arg(long, default_value_t = 500)]
    lines_batch_length: usize,
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
    check_options(&args)?;
    let f = if args.profile == "azure" {
        azure_profile(&args).await?
    } else {
        local_profile(&args).await?
    };
    if args.json {
        println!("{}", json_line(&args, &f));
    } else {
        print!("{}", tables(&args, &f));
    }
    Ok(())
}

/// The options every profile needs, checked before anything runs.
fn check_options(args: &BenchArgs) -> anyhow::Result<()> {
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
    Ok(())
}

/// `--profile azure`: hubguard at Azure's latencies, then its CPU per event there.
async fn azure_profile(args: &BenchArgs) -> anyhow::Result<Figures> {
    if args.handler_ms == 0
        || args.azure_partitions == 0
        || args.azure_events == 0
        || args.azure_retries == 0
    {
        bail!(
            "--handler-ms, --azure-partitions, --azure-events and --azure-retries must be positive"
        );
    }
    let azure = azure::azure(
        args.azure_partitions,
        args.azure_events,
        Duration::from_millis(args.handler_ms),
        args.azure_retries,
    )
    .await?;
    let cpu = cpu::cpu(args.azure_partitions, args.azure_events, 1024, "azure").await?;
    Ok(Figures {
        azure: Some(azure),
        cpu: Some(cpu),
        ..Figures::default()
    })
}

/// `--profile local`: the scenarios of `--only`, in a fixed order.
async fn local_profile(args: &BenchArgs) -> anyhow::Result<Figures> {
    let on = |s: &str| args.only.iter().any(|o| o == s);
    let mut f = Figures::default();
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
        f.concurrency = Some(run_concurrency(args).await?);
    }
    if on("retries") {
        f.retries = Some(pipelines::retry_timing(args.retries, 4).await?);
    }
    if on("memory") {
        f.memory = Some(memory::memory(args.pending, args.pending, 4).await?);
    }
    if on("scale") {
        f.scale = run_scale(args).await?;
    }
    if on("rate_limit") {
        f.rate_limit = Some(run_rate_limit(args).await?);
    }
    if on("cpu") {
        f.cpu = Some(cpu::cpu(4, args.events, args.size, &args.cpu_latency).await?);
    }
    if on("ledger") {
        f.ledger = Some(ledger::ledger(args.ledger_settled, args.ledger_pending).await?);
    }
    if on("cost") {
        f.cost = Some(run_cost(args).await?);
    }
    if on("lines") {
        f.lines = Some(run_lines(args).await?);
    }
    Ok(f)
}

/// The `concurrency` scenario: the slow handler with one event in flight and with many.
async fn run_concurrency(args: &BenchArgs) -> anyhow::Result<pipelines::Concurrency> {
    pipelines::concurrency(
        args.slow_events,
        Duration::from_millis(args.delay_ms),
        args.max_in_flight,
    )
    .await
}

/// The `scale` scenario: replicas joining and leaving on a backlog.
async fn run_scale(args: &BenchArgs) -> anyhow::Result<Vec<scale::ScaleRun>> {
    scale::scale(
        args.scale_events.max(1),
        Duration::from_millis(args.scale_delay_ms),
        args.max_in_flight,
    )
    .await
}

/// The `rate_limit` scenario, once its options are checked.
async fn run_rate_limit(args: &BenchArgs) -> anyhow::Result<ratelimit::RateLimitFigures> {
    crate::ratelimit::validate_limit(args.rate_limit)
        .map_err(|e| anyhow::anyhow!("--rate-limit {e}"))?;
    if args.receiver_cap == 0 || args.rate_events == 0 || args.adaptive_events == 0 {
        bail!("--receiver-cap, --rate-events and --adaptive-events must be positive");
    }
    ratelimit::rate_limit(
        args.rate_limit,
        args.receiver_cap,
        args.rate_events,
        args.adaptive_events,
    )
    .await
}

/// The `cost` scenario, once `--cost-events` is checked.
async fn run_cost(args: &BenchArgs) -> anyhow::Result<cost::CostFigures> {
    if args.cost_events < 5 {
        bail!("--cost-events must be at least 5 (one event on each path)");
    }
    cost::cost(args.cost_events).await
}

/// The `lines` scenario: ordered retries at the azure latency profile, over 4 partitions.
async fn run_lines(args: &BenchArgs) -> anyhow::Result<lines::LinesFigures> {
    lines::lines(lines::LinesArgs {
        partitions: 4,
        lines: args.lines,
        line_length: args.line_length,
        free_events: args.events,
        handler: Duration::from_millis(args.handler_ms),
        batch_max: args.lines_batch_max,
        batch_line_length: args.lines_batch_length,
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    /// Options, and figures with every figure set to a distinctive value (the pinned tests).
    pub(super) fn sample() -> (BenchArgs, Figures) {
        let args = Cli::parse_from([
            "bench",
            "--events",
            "12345",
            "--size",
            "777",
            "--scale-events",
            "321",
            "--max-in-flight",
            "17",
            "--scale-delay-ms",
            "9",
        ])
        .bench;
        let ops = |base: f64| cost::Ops {
            events: 7,
            per_kind: cost::KINDS
                .iter()
                .enumerate()
                .map(|(i, &k)| {
                    (
                        k,
                        if i % 3 == 0 {
                            base
                        } else {
                            base + i as f64 / 7.0
                        },
                    )
                })
                .collect(),
        };
        let phase = |limit: f64, cap: Option<u32>| ratelimit::Phase {
            limit,
            cap,
            events: 1501,
            seconds: 15.678,
            max_per_s: 103,
            max_per_s_after_30s: 52,
            per_second: vec![98, 103, 101],
            converged_at_s: cap.map(|_| 27),
            seconds_above_cap_after_30s: 2,
            throttled: 44,
            dead_lettered: 0,
            breaker_opens: 1,
            decreases: 5,
        };
        let f = Figures {
            eventhubs: vec![
                Throughput {
                    partitions: 1,
                    events: 12345,
                    produce_per_s: 45678.49,
                    consume_per_s: 23456.51,
                },
                Throughput {
                    partitions: 4,
                    events: 12345,
                    produce_per_s: 98765.4,
                    consume_per_s: 87654.6,
                },
            ],
            guard: vec![
                GuardFigures {
                    partitions: 1,
                    bare_per_s: 20000.4,
                    guard_per_s: 19000.6,
                    checkpoint_writes: 42,
                    checkpoint_writes_per_s: 3.14259,
                    checkpoint_writes_bound_per_s: 4.271828,
                    happy_path_ops_per_event: 0.012345,
                },
                GuardFigures {
                    partitions: 4,
                    bare_per_s: 60000.7,
                    guard_per_s: 50000.2,
                    checkpoint_writes: 99,
                    checkpoint_writes_per_s: 9.8765,
                    checkpoint_writes_bound_per_s: 11.1111,
                    happy_path_ops_per_event: 0.00067,
                },
            ],
            concurrency: Some(pipelines::Concurrency {
                delay: Duration::from_millis(20),
                wide: 32,
                one_per_s: 49.123,
                wide_per_s: 1500.987,
            }),
            retries: Some(pipelines::RetryTiming {
                retries: 500,
                schedule_ms: (3.456, 12.345),
                lateness_ms: (7.891, 45.678),
            }),
            memory: Some(memory::Memory {
                pending: 100_000,
                warm_pending: 1_000,
                rss_idle_mb: 21.234,
                rss_warm_mb: 35.678,
                rss_pending_mb: 88.912,
                growth_readings_mb: vec![52.1, 51.37, 53.94],
            }),
            azure: Some(azure::AzureFigures {
                partitions: 2,
                events: 10_000,
                handler: Duration::from_millis(50),
                max_in_flight: 64,
                retry_concurrency: 16,
                events_per_s_per_partition: 1234.567,
                failing_events_per_s_per_partition: 1111.111,
                retries: 10_000,
                retry_drain_per_s: 300.3,
                retry_span_per_s: 250.75,
                retry_lateness_ms: (123.4, 567.8),
                retry_due_per_s: 2345.6,
                retry_lateness_past_slot_ms: (12.3, 45.6),
                batch_events_per_s_per_partition: 6789.1,
                batch_failing_events_per_s_per_partition: 6543.2,
                cpu: [
                    azure::PassCpu {
                        hubguard_us: 400.0,
                        emulators_us: 900.0,
                        machine_busy: 0.5,
                        partition_thread_busy: 0.25,
                    },
                    azure::PassCpu {
                        hubguard_us: 450.0,
                        emulators_us: 1000.0,
                        machine_busy: 0.5,
                        partition_thread_busy: 0.25,
                    },
                    azure::PassCpu {
                        hubguard_us: 200.0,
                        emulators_us: 300.0,
                        machine_busy: 0.5,
                        partition_thread_busy: 0.25,
                    },
                    azure::PassCpu {
                        hubguard_us: 260.0,
                        emulators_us: 420.0,
                        machine_busy: 0.5,
                        partition_thread_busy: 0.25,
                    },
                ],
            }),
            scale: vec![
                scale::ScaleRun {
                    scenario: "scale out",
                    handover: false,
                    events: 2400,
                    duplicates: 37,
                    moves: 3,
                    max_unread_ms: 5123,
                },
                scale::ScaleRun {
                    scenario: "scale out",
                    handover: true,
                    events: 2400,
                    duplicates: 0,
                    moves: 2,
                    max_unread_ms: 612,
                },
                scale::ScaleRun {
                    scenario: "crash",
                    handover: true,
                    events: 2400,
                    duplicates: 11,
                    moves: 1,
                    max_unread_ms: 6001,
                },
            ],
            rate_limit: Some(ratelimit::RateLimitFigures {
                cap: phase(100.0, None),
                adaptive: phase(100.0, Some(50)),
            }),
            ledger: Some(ledger::LedgerFigures {
                settled: 200_000,
                pending: 1_000,
                sweep_calls_settled: 1041,
                sweep_calls_empty: 1001,
                sweep_listed_settled: 201_000,
                retries_list_ms: 456.789,
                retries_list_empty_ms: 12.345,
                sweep_peak_mb: (Some(12.34), None),
                retention_peak_mb: (None, Some(0.06)),
            }),
            cpu: Some(cpu::CpuFigures {
                events: 12345,
                partitions: 4,
                latency: "none".into(),
                guard_us: 45.678,
                bare_us: 30.123,
            }),
            cost: Some(cost::CostFigures {
                happy: ops(0.0),
                first_failure: ops(1.0),
                retry_rescheduled: ops(2.0),
                retry_delivered: ops(1.5),
                retry_long: ops(3.25),
                retry_long_attempt_s: 2.75,
                lock_s: 5.0,
                dead_letter: ops(0.5),
                dead_letter_exhausted: ops(4.0),
                background: BTreeMap::from([
                    (cost::Kind::BlobList, 12),
                    (cost::Kind::SbReceive, 34),
                ]),
                seconds: 10.04,
            }),
            lines: Some(lines::LinesFigures {
                partitions: 4,
                handler: Duration::from_millis(50),
                lines: 16,
                line_length: 25,
                free_events: 12345,
                free_per_s_without_lines: 1234.56,
                free_per_s_with_lines: 1200.04,
                drain_per_s: 77.77,
                drain_s: 5.144,
                drain_line_per_s: 4.9,
                batched: Some(lines::BatchedDrain {
                    batch_max: 100,
                    lines: 4,
                    line_length: 500,
                    line_per_s: 1234.5,
                    one_line_per_s: 1500.0,
                    largest_batch: 100,
                }),
            }),
        };
        (args, f)
    }
}
