//! Bench scenarios that run hubguard's pipeline: a slow handler with and without
//! concurrency within a partition, and the retry path's timing (failure to Service Bus
//! acceptance, due time to actual start).

use crate::sync::LockExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context as _};

use crate::azure::ConnectionString;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::{Emulators, EmulatorsConfig};
use crate::event::Event;
use crate::handler::{Attempt, Failure, Handler, Outcome};
use crate::pipeline::{EventHubsTarget, Pipeline, PipelineOptions, PipelineParts};
use crate::policy::RetryPolicy;
use crate::wiring::{ServiceBusAccess, StorageAccess, Wiring};

/// Per key: (attempt, started, returned) of every call.
type Calls = HashMap<String, Vec<(u32, SystemTime, SystemTime)>>;

/// A handler for benchmarks: waits `delay` per call, fails the first `fail_first` attempts
/// of every event (transiently), and records what it needs to.
pub(crate) struct BenchHandler {
    delay: Duration,
    fail_first: u32,
    /// Calls that returned `Delivered`.
    pub delivered: AtomicU64,
    first: Mutex<Option<Instant>>,
    last: Mutex<Option<Instant>>,
    /// With `record`: key → (attempt, started, returned) of every call.
    calls: Option<Mutex<Calls>>,
}

impl BenchHandler {
    pub(crate) fn new(delay: Duration, fail_first: u32, record: bool) -> Self {
        Self {
            delay,
            fail_first,
            delivered: AtomicU64::new(0),
            first: Mutex::new(None),
            last: Mutex::new(None),
            calls: record.then(Mutex::default),
        }
    }

    /// From the first call to the last delivery.
    pub(crate) fn busy(&self) -> Duration {
        let first = *self.first.locked();
        let last = *self.last.locked();
        match (first, last) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        }
    }

    /// With `record`: key → (attempt, started, returned) of every call.
    pub(crate) fn calls_recorded(&self) -> Calls {
        self.calls()
    }

    fn calls(&self) -> Calls {
        self.calls
            .as_ref()
            .map(|c| c.locked().clone())
            .unwrap_or_default()
    }
}

#[async_trait::async_trait]
impl Handler for BenchHandler {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let started = SystemTime::now();
        self.first.locked().get_or_insert_with(Instant::now);
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        if let Some(c) = &self.calls {
            c.locked()
                .entry(event.identity.idempotency_key.clone())
                .or_default()
                .push((attempt.number, started, SystemTime::now()));
        }
        if attempt.number <= self.fail_first {
            return Outcome::Failed(Failure::transient("bench: scripted failure"));
        }
        self.delivered.fetch_add(1, Ordering::Relaxed);
        *self.last.locked() = Some(Instant::now());
        Outcome::Delivered
    }
}

/// The pipeline's parts on `emulators`, reading hub `bench`.
pub(crate) fn parts(
    emulators: &Emulators,
    handler: Arc<dyn Handler>,
    policy: RetryPolicy,
    options: PipelineOptions,
) -> anyhow::Result<PipelineParts> {
    Ok(wiring(emulators)?
        .policy(policy)
        .options(options)
        .parts(handler)?)
}

/// The bench's emulators, wired: hub `bench`, queue `retries`, container `hubguard` (no
/// breaker unless the caller sets one).
pub(crate) fn wiring(emulators: &Emulators) -> anyhow::Result<Wiring> {
    let eh = emulators.eventhubs.as_ref().context("event hubs")?;
    let sb = emulators.servicebus.as_ref().context("service bus")?;
    let blob = emulators.blob.as_ref().context("blob")?;
    let cs: ConnectionString = eh.connection_string().parse()?;
    Ok(Wiring::new(
        EventHubsTarget::with_connection_string(&cs, "bench", "$Default"),
        StorageAccess::url(&blob.container_url("hubguard")),
        ServiceBusAccess::ConnectionString(sb.connection_string().parse()?),
    ))
}

pub(crate) fn bench_options() -> PipelineOptions {
    PipelineOptions {
        update_interval: Duration::from_millis(500),
        ownership_expiration: Duration::from_secs(5),
        ..Default::default()
    }
}

pub(crate) async fn start(partitions: usize) -> anyhow::Result<(Emulators, ConnectionString)> {
    let emulators = Emulators::start(EmulatorsConfig {
        hubs: vec![HubSpec::new("bench", partitions)],
        ..Default::default()
    })
    .await?;
    let cs = emulators
        .eventhubs
        .as_ref()
        .context("event hubs")?
        .connection_string()
        .parse()?;
    Ok((emulators, cs))
}

/// Waits until `done()` holds, failing if nothing changes for 30 s.
pub(crate) async fn wait_progress(
    what: &str,
    mut progress: impl FnMut() -> u64,
    target: u64,
) -> anyhow::Result<()> {
    let mut last = (progress(), Instant::now());
    // Poll often for short runs (the throughput figures), rarely for long ones.
    let pace = if target > 10_000 {
        Duration::from_millis(250)
    } else {
        Duration::from_millis(5)
    };
    while last.0 < target {
        tokio::time::sleep(pace).await;
        let now = progress();
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(30) {
            bail!("{what} stalled at {now} of {target}");
        }
    }
    Ok(())
}

/// A handler that waits `delay` per event, with `max_in_flight` 1 and `wide`: events/s of each.
#[derive(Debug, Clone)]
pub struct Concurrency {
    /// The handler's wait per event.
    pub delay: Duration,
    /// `max_in_flight` of the second run.
    pub wide: usize,
    /// Events/s with `max_in_flight` 1.
    pub one_per_s: f64,
    /// Events/s with `max_in_flight` = `wide`.
    pub wide_per_s: f64,
}

/// Runs one partition of `events` through a handler waiting `delay`, one by one.
async fn slow_run(events: usize, delay: Duration, max_in_flight: usize) -> anyhow::Result<f64> {
    let (emulators, cs) = start(1).await?;
    super::produce(&cs, 1, events, 256).await?;
    let handler = Arc::new(BenchHandler::new(delay, 0, false));
    let mut options = bench_options();
    options.max_in_flight = max_in_flight;
    let pipeline = Pipeline::new(parts(
        &emulators,
        handler.clone(),
        RetryPolicy::seed_fibonacci(),
        options,
    )?);
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let h = handler.clone();
    wait_progress(
        "the slow handler",
        || h.delivered.load(Ordering::Relaxed),
        events as u64,
    )
    .await?;
    cancel.cancel();
    run.await??;
    emulators.shutdown().await;
    Ok(events as f64 / handler.busy().as_secs_f64().max(1e-9))
}

/// The slow-handler comparison: `max_in_flight` 1 against `wide`.
pub async fn concurrency(
    events: usize,
    delay: Duration,
    wide: usize,
) -> anyhow::Result<Concurrency> {
    // One by one takes `delay` per event: read fewer events there, the rate is what counts.
    let one = slow_run((events / 8).max(50), delay, 1).await?;
    let many = slow_run(events, delay, wide).await?;
    Ok(Concurrency {
        delay,
        wide,
        one_per_s: one,
        wide_per_s: many,
    })
}

/// The retry path's timing.
#[derive(Debug, Clone)]
pub struct RetryTiming {
    /// Retries measured.
    pub retries: usize,
    /// From the failed attempt's return to Service Bus accepting the retry: p50, p99 (ms).
    pub schedule_ms: (f64, f64),
    /// From the ledger's due time to the retry's actual start: p50, p99 (ms).
    pub lateness_ms: (f64, f64),
}

pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Every event fails once and is retried 1 s later: scheduling latency and lateness.
pub async fn retry_timing(events: usize, partitions: usize) -> anyhow::Result<RetryTiming> {
    let (emulators, cs) = start(partitions).await?;
    let sb = emulators.servicebus.as_ref().context("service bus")?;
    let queue = sb.queue("retries").context("retries queue")?;
    queue.record_accepted();
    super::produce(&cs, partitions, events, 256).await?;
    let handler = Arc::new(BenchHandler::new(Duration::ZERO, 1, true));
    let policy = RetryPolicy {
        name: "bench".into(),
        curve: crate::policy::Curve::Fixed,
        base_s: 1,
        floor_s: 1,
        cap_s: 1,
        max_attempts: 5,
        max_age_s: None,
    };
    let mut options = bench_options();
    options.max_in_flight = 16;
    options.retry_concurrency = 32;
    options.retry_receive_wait = Duration::from_secs(1);
    let parts = parts(&emulators, handler.clone(), policy, options)?;
    let records = parts.records.clone();
    let pipeline = Pipeline::new(parts);
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let h = handler.clone();
    wait_progress(
        "retries",
        || h.delivered.load(Ordering::Relaxed),
        events as u64,
    )
    .await?;
    cancel.cancel();
    run.await??;
    let accepted: HashMap<String, SystemTime> = queue
        .accepted()
        .into_iter()
        .map(|(id, at)| (crate::pipeline::settle::unqualified(&id).to_string(), at))
        .collect();
    let ledger = crate::ledger::Ledger::new(records, "bench", "$Default");
    let calls = handler.calls();
    let (mut schedule, mut lateness) = (Vec::new(), Vec::new());
    for (key, calls) in &calls {
        let Some((_, _, failed_at)) = calls.iter().find(|c| c.0 == 1) else {
            continue;
        };
        let Some((_, retry_started, _)) = calls.iter().find(|c| c.0 == 2) else {
            continue;
        };
        if let Some(acc) = accepted.get(&crate::pipeline::settle::message_id(key, 2)) {
            schedule.push(ms_between(*failed_at, *acc));
        }
        if let Some(rec) = ledger.record(key).await? {
            if let Some(due) = rec
                .history
                .iter()
                .find(|h| h.attempt == 1)
                .and_then(|h| h.next_attempt_ms)
            {
                lateness.push(ms_between(crate::ledger::at(due), *retry_started));
            }
        }
    }
    emulators.shutdown().await;
    if schedule.is_empty() || lateness.is_empty() {
        bail!("no retry was measured");
    }
    Ok(RetryTiming {
        retries: lateness.len(),
        schedule_ms: (
            percentile(&mut schedule, 0.5),
            percentile(&mut schedule, 0.99),
        ),
        lateness_ms: (
            percentile(&mut lateness, 0.5),
            percentile(&mut lateness, 0.99),
        ),
    })
}

/// `b - a` in milliseconds (negative when `b` is earlier).
pub(crate) fn ms_between(a: SystemTime, b: SystemTime) -> f64 {
    match b.duration_since(a) {
        Ok(d) => d.as_secs_f64() * 1000.0,
        Err(e) => -e.duration().as_secs_f64() * 1000.0,
    }
}
