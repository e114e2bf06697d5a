//! `hubguard bench --profile azure`: hubguard at Azure's latencies. The emulators answer
//! with the `azure` latency profile (blob 8 ms : 40 ms, Service Bus 15 ms : 80 ms, Event Hubs
//! 5 ms : 20 ms per round trip, median : p99; see [`crate::emulator::latency`]) and the
//! downstream is the emulator's webhook receiver answering after a fixed handler latency
//! (50 ms by default) with a seeded failure mix, so the figures measure hubguard, not the
//! receiver.
//!
//! - `azure_events_per_s_per_partition`: first deliveries per second per partition with the
//!   configuration file's defaults (`max_in_flight`, `retry.concurrency`), keyed events with
//!   many keys (`ordering_key = property:order_id`, 997 keys), nothing failing;
//!   `azure_limit_ratio`: that rate ÷ the limit the settings allow (`max_in_flight` ÷
//!   handler latency).
//! - `azure_failure_ratio`: the same with 10 % of events failing once (each scheduled for
//!   retry: a ledger write and a Service Bus send on its slot) ÷ the rate with none. The
//!   retries are due after the measurement, so the rate is the first pass's.
//! - `azure_retry_drain_ratio`: every event fails once and comes due in the same window;
//!   retries completed per second while retries are due and waiting ÷ (`retry.concurrency` ÷
//!   handler latency) — see [`drain_while_waiting`] — and
//!   `azure_retry_lateness_p99_ms`: due time (the ledger's) → the retry's start;
//!   `azure_retry_due_per_s`: how fast the retries came due (above the limit they queue);
//!   `azure_retry_lateness_past_slot_p99_ms`: the lateness past the wait for a free slot
//!   ([`lateness_past_slots`]).
//! - `azure_…machine_busy` and `azure_…partition_thread_busy` of each first pass: how busy
//!   the cores (both processes) and hubguard's busiest partition thread were — near 1, the pass
//!   measured this machine's CPU, not Azure's latencies.
//! - `azure_batch_events_per_s_per_partition`: the first measurement with the webhook's
//!   batches on (`handler.batch_max` = [`BATCH_MAX`], `processor.max_in_flight` =
//!   [`BATCH_IN_FLIGHT`]), the receiver answering each batch after the same latency;
//!   `azure_batch_failure_ratio`: the same with 10 % of events failing once ÷ the rate
//!   with none.
//! - `azure_cpu_us_per_event` (and `_failing_`, `_batch_`, `_batch_failing_`): CPU time
//!   of hubguard's process per event settled in each of the four first passes;
//!   `azure_batch_cpu_ratio`: batches ÷ alone. The first passes run with the emulators
//!   (and the webhook receiver) in a **child process** (`hubguard emulator`, as
//!   [`super::cpu`] does), so hubguard's CPU is told apart from theirs, as on Azure where
//!   the services run elsewhere; their CPU per event is reported beside it
//!   (`azure_emulators_cpu_us_per_event…`).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context as _};
use futures::StreamExt as _;

use super::pipelines::{self, BenchHandler};
use crate::azure::ConnectionString;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::latency::{Latency, LatencyProfile};
use crate::emulator::producer::{self, Outgoing, Plan};
use crate::emulator::webhook::FailureMix;
use crate::emulator::{Emulators, EmulatorsConfig};
use crate::pipeline::{OrderingKey, Pipeline, PipelineOptions};
use crate::policy::RetryPolicy;

/// `handler.batch_max` of the batch measurement.
pub const BATCH_MAX: usize = 100;
/// `processor.max_in_flight` of the batch measurement: a few batches in flight at once.
pub const BATCH_IN_FLIGHT: usize = 500;

/// What `--profile azure` measured.
#[derive(Debug, Clone)]
pub struct AzureFigures {
    /// Partitions of the hub.
    pub partitions: usize,
    /// Events of each first-pass run.
    pub events: usize,
    /// The downstream's latency.
    pub handler: Duration,
    /// `processor.max_in_flight` used (the configuration file's default).
    pub max_in_flight: usize,
    /// `retry.concurrency` used (the configuration file's default).
    pub retry_concurrency: usize,
    /// First deliveries per second per partition, nothing failing.
    pub events_per_s_per_partition: f64,
    /// The same with 10 % of events failing once.
    pub failing_events_per_s_per_partition: f64,
    /// Retries measured for the drain.
    pub retries: usize,
    /// Retries completed per second while retries were due and waiting
    /// ([`drain_while_waiting`]).
    pub retry_drain_per_s: f64,
    /// Retries completed per second from the first retry's start to the last one's return,
    /// the seconds with nothing due included.
    pub retry_span_per_s: f64,
    /// Due time → retry started, p50 and p99 (ms).
    pub retry_lateness_ms: (f64, f64),
    /// Retries coming due per second, first due time to last: above the retry limit
    /// (`retry.concurrency` ÷ handler latency), retries queue for a slot and the lateness
    /// above grows with the queue.
    pub retry_due_per_s: f64,
    /// The lateness past the wait for a slot, p50 and p99 (ms): due time, or the moment one
    /// of the `retry.concurrency` slots came free if later → the retry's start
    /// ([`lateness_past_slots`]). What hubguard adds to the queue's wait.
    pub retry_lateness_past_slot_ms: (f64, f64),
    /// First deliveries per second per partition with batches on, nothing failing.
    pub batch_events_per_s_per_partition: f64,
    /// The same with 10 % of events failing once.
    pub batch_failing_events_per_s_per_partition: f64,
    /// CPU per event of the four first passes: alone, alone with 10 % failing, batches,
    /// batches with 10 % failing.
    pub cpu: [PassCpu; 4],
}

/// CPU time per event settled in one first pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct PassCpu {
    /// hubguard's process, µs per event.
    pub hubguard_us: f64,
    /// The emulators' process (the services and the receiver), µs per event.
    pub emulators_us: f64,
    /// How busy the machine's cores were, both processes together (0–1): near 1, the pass
    /// measured the machine's CPU, not the latencies.
    pub machine_busy: f64,
    /// How busy hubguard's busiest partition thread was (0–1 of a core): a replica's
    /// partitions are read and settled on a pool of threads, one per core.
    pub partition_thread_busy: f64,
}

/// One first pass: its rate and its CPU.
struct Pass {
    per_s: f64,
    cpu: PassCpu,
}

impl AzureFigures {
    /// The most first deliveries per second per partition the settings allow.
    pub fn limit_per_s(&self) -> f64 {
        self.max_in_flight as f64 / self.handler.as_secs_f64()
    }

    /// `azure_limit_ratio`.
    pub fn limit_ratio(&self) -> f64 {
        self.events_per_s_per_partition / self.limit_per_s()
    }

    /// `azure_failure_ratio`.
    pub fn failure_ratio(&self) -> f64 {
        self.failing_events_per_s_per_partition / self.events_per_s_per_partition
    }

    /// The most retries per second `retry.concurrency` allows.
    pub fn retry_limit_per_s(&self) -> f64 {
        self.retry_concurrency as f64 / self.handler.as_secs_f64()
    }

    /// `azure_retry_drain_ratio`.
    pub fn retry_drain_ratio(&self) -> f64 {
        self.retry_drain_per_s / self.retry_limit_per_s()
    }

    /// `azure_batch_failure_ratio`.
    pub fn batch_failure_ratio(&self) -> f64 {
        self.batch_failing_events_per_s_per_partition / self.batch_events_per_s_per_partition
    }

    /// `azure_batch_cpu_ratio`: hubguard's CPU per event with batches ÷ alone.
    pub fn batch_cpu_ratio(&self) -> f64 {
        self.cpu[2].hubguard_us / self.cpu[0].hubguard_us.max(1e-9)
    }
}

/// How the webhook sends: each event alone (the defaults), or in batches.
#[derive(Debug, Clone, Copy)]
enum Sending {
    Alone,
    Batches,
}

fn options() -> PipelineOptions {
    PipelineOptions {
        max_in_flight: crate::config::DEFAULT_MAX_IN_FLIGHT,
        window: crate::config::window_for(crate::config::DEFAULT_MAX_IN_FLIGHT),
        retry_concurrency: crate::config::DEFAULT_RETRY_CONCURRENCY,
        ordering: OrderingKey::Property("order_id".into()),
        ..pipelines::bench_options()
    }
}

async fn start(partitions: usize, handler: Duration, mix: FailureMix) -> anyhow::Result<Emulators> {
    Ok(Emulators::start(EmulatorsConfig {
        hubs: vec![HubSpec::new("bench", partitions)],
        webhook_port: Some(0),
        latency: LatencyProfile {
            webhook: Latency::fixed(handler),
            ..LatencyProfile::azure()
        },
        webhook_failures: mix,
        ..Default::default()
    })
    .await?)
}

async fn produce_keyed(
    cs: &ConnectionString,
    partitions: usize,
    events: usize,
) -> anyhow::Result<()> {
    let plan = Plan::partition_by_partition("bench", events, partitions);
    producer::produce(cs, &plan, |n| {
        Outgoing::keyed(format!("az-{n}"), vec![b'x'; 1024])
            .property("order_id", (n % 997).to_string())
    })
    .await?;
    Ok(())
}

/// First deliveries per second per partition through the webhook handler, with 10 % of
/// events failing once when `failing`, and the CPU per event of both processes; the
/// emulators and the receiver in a child process.
async fn first_pass(
    partitions: usize,
    events: usize,
    handler: Duration,
    failing: bool,
    sending: Sending,
) -> anyhow::Result<Pass> {
    let latency = format!("azure,webhook={0}ms:{0}ms", handler.as_millis());
    let child =
        super::cpu::start_child_with(partitions, &latency, failing.then_some("transient=0.1:1"))?;
    let eh: ConnectionString = child.line("eventhubs")?.parse()?;
    produce_keyed(&eh, partitions, events).await?;
    let webhook =
        crate::handler::webhook::WebhookHandler::new(crate::handler::webhook::WebhookConfig {
            url: child.line("webhook")?.to_string(),
            timeout_ms: 5000,
            conflict_is_permanent: true,
            batch_max: match sending {
                Sending::Alone => 1,
                Sending::Batches => BATCH_MAX,
            },
            ..Default::default()
        })
        .map_err(|e| anyhow::anyhow!(e))?;
    let mut options = options();
    if let Sending::Batches = sending {
        options.max_in_flight = BATCH_IN_FLIGHT;
        // The configuration's default for these slots (`processor.window` unset).
        options.window = crate::config::window_for(BATCH_IN_FLIGHT);
    }
    // Retries are due well after the run: the rate is the first pass's.
    let policy = RetryPolicy {
        name: "bench".into(),
        curve: crate::policy::Curve::Fixed,
        base_s: 600,
        floor_s: 600,
        cap_s: 600,
        max_attempts: 5,
        max_age_s: None,
    };
    let container = format!("{}/hubguard", child.line("blob")?.trim_end_matches('/'));
    let parts = crate::wiring::Wiring::new(
        crate::pipeline::EventHubsTarget::with_connection_string(&eh, "bench", "$Default"),
        crate::wiring::StorageAccess::url(&container),
        crate::wiring::ServiceBusAccess::ConnectionString(child.line("servicebus")?.parse()?),
    )
    .policy(policy)
    .options(options)
    .parts(webhook.into_handler())?;
    let cpu_before = (super::cpu::cpu_time()?, child.cpu_time()?);
    let began = Instant::now();
    let pipeline = Pipeline::new(parts);
    let health = pipeline.health();
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let settled = || {
        let s = health.snapshot();
        s.delivered + s.retries_scheduled + s.dead_lettered
    };
    // From the first settled event to the last: the processor's claim is not counted.
    let mut first: Option<(Instant, u64)> = None;
    let mut last = (Instant::now(), 0u64);
    while last.1 < events as u64 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let n = settled();
        if n > last.1 {
            last = (Instant::now(), n);
            first.get_or_insert(last);
        } else if last.0.elapsed() > Duration::from_secs(60) {
            bail!("azure profile stalled at {n} of {events}");
        }
    }
    // The partition threads end with the pipeline: read them while it runs.
    let thread = (
        super::cpu::busiest_thread_cpu_time(crate::pipeline::PARTITION_THREAD)?,
        began.elapsed(),
    );
    cancel.cancel();
    run.await??;
    let cpu_after = (super::cpu::cpu_time()?, child.cpu_time()?);
    let wall = began.elapsed().as_secs_f64().max(1e-3);
    drop(child);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let used = (cpu_after.0.saturating_sub(cpu_before.0)
        + cpu_after.1.saturating_sub(cpu_before.1))
    .as_secs_f64();
    let (t0, n0) = first.context("nothing settled")?;
    let secs = last.0.saturating_duration_since(t0).as_secs_f64().max(1e-3);
    let per_event =
        |a: Duration, b: Duration| b.saturating_sub(a).as_secs_f64() * 1e6 / (last.1.max(1)) as f64;
    Ok(Pass {
        per_s: (last.1 - n0) as f64 / secs / partitions as f64,
        cpu: PassCpu {
            hubguard_us: per_event(cpu_before.0, cpu_after.0),
            emulators_us: per_event(cpu_before.1, cpu_after.1),
            machine_busy: used / (wall * cores),
            partition_thread_busy: thread.0.as_secs_f64() / thread.1.as_secs_f64().max(1e-3),
        },
    })
}

/// Every event fails once, due 10 s later: how fast the retries drain, and how late.
async fn retry_drain(
    partitions: usize,
    events: usize,
    handler: Duration,
) -> anyhow::Result<Drained> {
    let concurrency = crate::config::DEFAULT_RETRY_CONCURRENCY;
    let emulators = start(partitions, handler, FailureMix::default()).await?;
    let cs: ConnectionString = emulators
        .eventhubs
        .as_ref()
        .context("event hubs")?
        .connection_string()
        .parse()?;
    produce_keyed(&cs, partitions, events).await?;
    let bench = Arc::new(BenchHandler::new(handler, 1, true));
    let policy = RetryPolicy {
        name: "bench".into(),
        curve: crate::policy::Curve::Fixed,
        base_s: 10,
        floor_s: 10,
        cap_s: 10,
        max_attempts: 5,
        max_age_s: None,
    };
    let mut o = options();
    o.retry_receive_wait = Duration::from_secs(1);
    let parts = pipelines::parts(&emulators, bench.clone(), policy, o)?;
    let records = parts.records.clone();
    let pipeline = Pipeline::new(parts);
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let b = bench.clone();
    pipelines::wait_progress(
        "azure retries",
        || b.delivered.load(Ordering::Relaxed),
        events as u64,
    )
    .await?;
    cancel.cancel();
    run.await??;
    let calls = bench.calls_recorded();
    // Each retry's call (attempt 2): started, returned.
    let retried: HashMap<String, (SystemTime, SystemTime)> = calls
        .iter()
        .filter_map(|(k, c)| c.iter().find(|c| c.0 == 2).map(|c| (k.clone(), (c.1, c.2))))
        .collect();
    // Each one's due time: the ledger's.
    let ledger = Arc::new(crate::ledger::Ledger::new(records, "bench", "$Default"));
    let timed: Vec<Retried> = futures::stream::iter(retried)
        .map(|(key, (start, end))| {
            let ledger = ledger.clone();
            async move {
                let rec = ledger.record(&key).await.ok()??;
                let due = rec
                    .history
                    .iter()
                    .find(|h| h.attempt == 1)
                    .and_then(|h| h.next_attempt_ms)?;
                Some(Retried {
                    due: crate::ledger::at(due),
                    start,
                    end,
                })
            }
        })
        .buffer_unordered(64)
        .filter_map(|x| async move { x })
        .collect()
        .await;
    emulators.shutdown().await;
    if timed.is_empty() {
        bail!("no retry ran");
    }
    Drained::of(&timed, concurrency)
}

/// What the retry drain measured (see [`AzureFigures`]).
struct Drained {
    drain: f64,
    span: f64,
    lateness: (f64, f64),
    due_per_s: f64,
    past_slot: (f64, f64),
}

impl Drained {
    /// The figures of the retries `timed` (not empty) drained by `concurrency` slots.
    fn of(timed: &[Retried], concurrency: usize) -> anyhow::Result<Drained> {
        let mut lateness: Vec<f64> = timed
            .iter()
            .map(|r| pipelines::ms_between(r.due, r.start))
            .collect();
        let drain = drain_while_waiting(timed, concurrency);
        let mut past_slot = lateness_past_slots(timed, concurrency);
        let dues = (
            timed.iter().map(|r| r.due).min().context("no retry ran")?,
            timed.iter().map(|r| r.due).max().context("no retry ran")?,
        );
        // Due times are whole seconds: a burst due in one second counts as due over one.
        let due_per_s = timed.len() as f64
            / (dues
                .1
                .duration_since(dues.0)
                .unwrap_or_default()
                .as_secs_f64()
                + 1.0);
        // The whole run, first start to last return (idle seconds included).
        let first = timed
            .iter()
            .map(|r| r.start)
            .min()
            .context("no retry ran")?;
        let last = timed.iter().map(|r| r.end).max().context("no retry ran")?;
        let span = timed.len() as f64
            / last
                .duration_since(first)
                .unwrap_or_default()
                .as_secs_f64()
                .max(1e-3);
        Ok(Drained {
            drain,
            span,
            lateness: (
                pipelines::percentile(&mut lateness, 0.5),
                pipelines::percentile(&mut lateness, 0.99),
            ),
            due_per_s,
            past_slot: (
                pipelines::percentile(&mut past_slot, 0.5),
                pipelines::percentile(&mut past_slot, 0.99),
            ),
        })
    }
}

/// Each retry's lateness past the wait for a slot (ms): the retries in the order they
/// started took `concurrency` slots, each slot free again when its call returned; a retry
/// could start no earlier than its due time and the earliest free slot, and the time from
/// the later of those to its start is what the retry loop added (0 at the least).
fn lateness_past_slots(retried: &[Retried], concurrency: usize) -> Vec<f64> {
    let mut by_start: Vec<&Retried> = retried.iter().collect();
    by_start.sort_by_key(|r| r.start);
    // Free times of the slots, earliest first (a min-heap); all free at the start.
    let mut free: std::collections::BinaryHeap<std::cmp::Reverse<SystemTime>> =
        std::iter::repeat_n(
            std::cmp::Reverse(SystemTime::UNIX_EPOCH),
            concurrency.max(1),
        )
        .collect();
    by_start
        .into_iter()
        .map(|r| {
            let std::cmp::Reverse(slot) = free.pop().unwrap_or(std::cmp::Reverse(r.start));
            free.push(std::cmp::Reverse(r.end));
            pipelines::ms_between(r.due.max(slot), r.start).max(0.0)
        })
        .collect()
}

/// One retry of the drain: due (the ledger's time), its call started and returned.
#[derive(Debug, Clone, Copy)]
struct Retried {
    due: SystemTime,
    start: SystemTime,
    end: SystemTime,
}

/// Retries completed per second while retries were due and waiting: the calls' share of
/// `concurrency` slots over the time at least one retry was past its due time and not yet
/// started, as calls per second (`concurrency` × that share ÷ the mean call). Retries come
/// due in whole seconds (Service Bus schedules in whole seconds, so the ledger's due times
/// are rounded up to them); a burst drained before the next second leaves the slots with
/// nothing to do until then, which says nothing of how fast hubguard drains, so that time
/// is not counted.
fn drain_while_waiting(retried: &[Retried], concurrency: usize) -> f64 {
    // Waiting: the union of [due, start) over the late retries.
    let mut late: Vec<(SystemTime, SystemTime)> = retried
        .iter()
        .filter(|r| r.start > r.due)
        .map(|r| (r.due, r.start))
        .collect();
    late.sort();
    let mut waiting: Vec<(SystemTime, SystemTime)> = Vec::new();
    for (a, b) in late {
        match waiting.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => waiting.push((a, b)),
        }
    }
    let secs = |a: SystemTime, b: SystemTime| b.duration_since(a).unwrap_or_default().as_secs_f64();
    let busy: f64 = waiting.iter().map(|(a, b)| secs(*a, *b)).sum();
    if busy <= 0.0 {
        return 0.0;
    }
    // Call time inside the waiting intervals (both sorted: one pass per call is enough at
    // these sizes).
    let in_calls: f64 = retried
        .iter()
        .map(|r| {
            waiting
                .iter()
                .map(|(a, b)| secs((*a).max(r.start), (*b).min(r.end)))
                .sum::<f64>()
        })
        .sum();
    let mean_call =
        retried.iter().map(|r| secs(r.start, r.end)).sum::<f64>() / retried.len() as f64;
    let share = in_calls / (busy * concurrency as f64);
    share * concurrency as f64 / mean_call.max(1e-6)
}

/// Runs the `azure` profile.
pub async fn azure(
    partitions: usize,
    events: usize,
    handler: Duration,
    retries: usize,
) -> anyhow::Result<AzureFigures> {
    let none = first_pass(partitions, events, handler, false, Sending::Alone).await?;
    let failing = first_pass(partitions, events, handler, true, Sending::Alone).await?;
    // Batches: five times the events, so the run lasts about as long.
    let batch = first_pass(partitions, events * 5, handler, false, Sending::Batches).await?;
    let batch_failing = first_pass(partitions, events * 5, handler, true, Sending::Batches).await?;
    let drained = retry_drain(partitions, retries, handler).await?;
    Ok(AzureFigures {
        partitions,
        events,
        handler,
        max_in_flight: crate::config::DEFAULT_MAX_IN_FLIGHT,
        retry_concurrency: crate::config::DEFAULT_RETRY_CONCURRENCY,
        events_per_s_per_partition: none.per_s,
        failing_events_per_s_per_partition: failing.per_s,
        retries,
        retry_drain_per_s: drained.drain,
        retry_span_per_s: drained.span,
        retry_lateness_ms: drained.lateness,
        retry_due_per_s: drained.due_per_s,
        retry_lateness_past_slot_ms: drained.past_slot,
        batch_events_per_s_per_partition: batch.per_s,
        batch_failing_events_per_s_per_partition: batch_failing.per_s,
        cpu: [none.cpu, failing.cpu, batch.cpu, batch_failing.cpu],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
    }

    fn r(due: u64, start: u64, end: u64) -> Retried {
        Retried {
            due: at(due),
            start: at(start),
            end: at(end),
        }
    }

    #[test]
    fn lateness_past_slots_leaves_out_the_wait_for_a_free_slot() {
        // One slot, three retries due at once, 100 ms calls back to back: late by 0, 100 and
        // 200 ms, none of it past the slot; a fourth starting 50 ms after the slot came
        // free is 50 ms late past it.
        let rs = [r(0, 0, 100), r(0, 100, 200), r(0, 200, 300), r(0, 350, 450)];
        assert_eq!(lateness_past_slots(&rs, 1), vec![0.0, 0.0, 0.0, 50.0]);
        // Two slots: the second starts 30 ms after its due time with a slot free all along.
        let rs = [r(0, 0, 100), r(10, 40, 140)];
        assert_eq!(lateness_past_slots(&rs, 2), vec![0.0, 30.0]);
    }

    #[test]
    fn slots_busy_whenever_retries_wait_drain_at_the_limit() {
        // 2 slots, 50 ms calls, 8 retries due at 0: four rounds back to back.
        let rs: Vec<Retried> = (0..8u64)
            .map(|i| r(0, (i / 2) * 50, (i / 2) * 50 + 50))
            .collect();
        let d = drain_while_waiting(&rs, 2);
        // Waiting from 0 to 150 ms (the last round's start); both slots call throughout.
        assert!((d - 40.0).abs() < 1e-6, "{d}");
    }

    #[test]
    fn idle_seconds_with_nothing_due_are_not_counted_but_idle_slots_are() {
        // Two bursts a second apart, each drained with one of two slots idle.
        let mut rs = Vec::new();
        for burst in [0u64, 1000] {
            for i in 0..4u64 {
                rs.push(r(burst, burst + i * 50, burst + i * 50 + 50));
            }
        }
        let d = drain_while_waiting(&rs, 2);
        // One slot of two busy while retries waited: half the limit of 40/s.
        assert!((d - 20.0).abs() < 1e-6, "{d}");
        // Retries that never waited leave nothing to measure.
        assert_eq!(drain_while_waiting(&[r(10, 10, 60)], 2), 0.0);
    }
}
