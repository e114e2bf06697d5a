//! The `lines` bench scenario (ordered retries, `processor.retry_ordering = "key"`), at the
//! `azure` latency profile (see [`crate::emulator::latency`]) with a handler answering after
//! a fixed latency:
//!
//! 1. **Free keys beside long lines**: the same stream twice, side by side. In the baseline
//!    the lines' heads are delivered, so no line opens; in the measured run each head fails
//!    with its retry due in an hour, and the later events of its key (interleaved with the
//!    free keys' events) are parked behind it. Figure: events/s of the free keys in each run,
//!    and their ratio.
//! 2. **A released line drains**: every head is pulled forward (`retries run-now`, as an
//!    operator would); the parked events are released one after another through Service Bus.
//!    Figure: parked events delivered per second, all lines and per line, from the pull to
//!    the last delivery; and per line from its first parked delivery to its last.
//! 3. **A released line drains in ordered batches**: the measured run again with the
//!    handler taking batches (`batch_max`, 100 by default) and one longer line per
//!    partition (`batch_line_length`): once its head is delivered, the retry loop hands the
//!    parked events to the handler in order, many per call (`pipeline::lines` drain).
//!    Figure: events/s per line from its first parked delivery to its last, the largest
//!    batch the handler saw, and the ratio to the one-by-one drain's per-line rate; then the
//!    same for one line alone (a hub of one partition), the whole process's work its own.
//!
//! The run fails if any key's first deliveries come out of sequence order, or an event is
//! missing at the end.

use crate::sync::LockExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use super::pipelines;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::latency::LatencyProfile;
use crate::emulator::producer::{self, Outgoing, Plan};
use crate::emulator::{Emulators, EmulatorsConfig};
use crate::event::Event;
use crate::handler::batch::{BatchHandler, BatchLimits, Batched, Item};
use crate::handler::{Attempt, Failure, Handler, Outcome};
use crate::pipeline::settle::Settler;
use crate::pipeline::{LineOnDeadLetter, OrderingKey, Pipeline, PipelineOptions, RetryOrdering};
use crate::policy::RetryPolicy;

/// What the scenario measured.
#[derive(Debug, Clone)]
pub struct LinesFigures {
    /// Partitions of the hub.
    pub partitions: usize,
    /// The handler's latency.
    pub handler: Duration,
    /// Lines (keys whose head waits for a retry), spread over the partitions.
    pub lines: usize,
    /// Events parked behind each line.
    pub line_length: usize,
    /// Events of the free keys (one key each).
    pub free_events: usize,
    /// Free keys' events/s with no line open (the heads delivered).
    pub free_per_s_without_lines: f64,
    /// Free keys' events/s while the lines are open and filling.
    pub free_per_s_with_lines: f64,
    /// Parked events delivered per second once the heads were pulled forward (all lines).
    pub drain_per_s: f64,
    /// Seconds from the pull to the last parked delivery.
    pub drain_s: f64,
    /// One by one: parked events/s per line from its first parked delivery to its last
    /// (the median line).
    pub drain_line_per_s: f64,
    /// The run with ordered batches, when measured.
    pub batched: Option<BatchedDrain>,
}

/// A released line drained in ordered batches.
#[derive(Debug, Clone)]
pub struct BatchedDrain {
    /// Events per call.
    pub batch_max: usize,
    /// Lines (one per partition).
    pub lines: usize,
    /// Events parked behind each.
    pub line_length: usize,
    /// Parked events/s per line from its first parked delivery to its last (the median
    /// line), the lines draining at once.
    pub line_per_s: f64,
    /// The same for one line alone (a hub of one partition).
    pub one_line_per_s: f64,
    /// The largest batch the handler was handed.
    pub largest_batch: usize,
}

impl LinesFigures {
    /// `free_per_s_with_lines ÷ free_per_s_without_lines`.
    pub fn free_ratio(&self) -> f64 {
        self.free_per_s_with_lines / self.free_per_s_without_lines
    }

    /// Parked events released per second and line.
    pub fn drain_per_s_per_line(&self) -> f64 {
        self.drain_per_s / self.lines as f64
    }

    /// The batched drain's per-line rate over the one-by-one drain's.
    pub fn batched_ratio(&self) -> Option<f64> {
        self.batched
            .as_ref()
            .map(|b| b.line_per_s / self.drain_line_per_s.max(1e-9))
    }

    /// The figures as JSON fields.
    pub fn json(&self) -> String {
        let mut s = format!(
            "\"lines_free_per_s_without_lines\":{:.1},\"lines_free_per_s_with_lines\":{:.1},\"lines_free_ratio\":{:.3},\"lines_drain_per_s\":{:.1},\"lines_drain_per_s_per_line\":{:.2},\"lines_drain_s\":{:.2},\"lines\":{},\"lines_length\":{},\"lines_drain_line_per_s\":{:.2}",
            self.free_per_s_without_lines,
            self.free_per_s_with_lines,
            self.free_ratio(),
            self.drain_per_s,
            self.drain_per_s_per_line(),
            self.drain_s,
            self.lines,
            self.line_length,
            self.drain_line_per_s
        );
        if let (Some(b), Some(r)) = (&self.batched, self.batched_ratio()) {
            s.push_str(&format!(
                ",\"lines_batch_max\":{},\"lines_batch_lines\":{},\"lines_batch_length\":{},\"lines_batch_drain_line_per_s\":{:.1},\"lines_batch_one_line_per_s\":{:.1},\"lines_batch_largest\":{},\"lines_batch_ratio\":{:.2}",
                b.batch_max, b.lines, b.line_length, b.line_per_s, b.one_line_per_s, b.largest_batch, r
            ));
        }
        s
    }
}

/// What an event is, from its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// A line's head: fails its first attempt in the measured run.
    Head,
    /// Behind a head.
    Parked,
    /// A key of its own.
    Free,
}

impl Class {
    fn of(body: &[u8]) -> Self {
        match body.first() {
            Some(b'h') => Self::Head,
            Some(b'p') => Self::Parked,
            _ => Self::Free,
        }
    }
}

/// (partition, ordering key) → first and last parked first delivery, and how many.
type LineSpans = HashMap<(String, String), (Instant, Instant, u64)>;

/// Answers after `latency`; fails a head's first attempt when `fail_heads`.
struct LinesHandler {
    latency: Duration,
    fail_heads: bool,
    free: AtomicU64,
    parked: AtomicU64,
    free_span: Mutex<Option<(Instant, Instant)>>,
    last_parked: Mutex<Option<Instant>>,
    /// (partition, ordering key) → sequence numbers of first deliveries, in delivery order.
    firsts: Mutex<HashMap<(String, String), Vec<i64>>>,
    delivered: Mutex<std::collections::HashSet<(String, i64)>>,
    /// (partition, ordering key) → first and last parked first delivery, and how many.
    line_spans: Mutex<LineSpans>,
    /// The largest batch handed over.
    largest_batch: std::sync::atomic::AtomicUsize,
}

impl LinesHandler {
    fn new(latency: Duration, fail_heads: bool) -> Self {
        Self {
            latency,
            fail_heads,
            free: AtomicU64::new(0),
            parked: AtomicU64::new(0),
            free_span: Mutex::default(),
            last_parked: Mutex::default(),
            firsts: Mutex::default(),
            delivered: Mutex::default(),
            line_spans: Mutex::default(),
            largest_batch: Default::default(),
        }
    }

    /// Parked events/s per line from its first parked delivery to its last: the median line.
    fn line_per_s(&self) -> f64 {
        let mut rates: Vec<f64> = self
            .line_spans
            .locked()
            .values()
            .filter(|(_, _, n)| *n > 1)
            .map(|(a, b, n)| (n - 1) as f64 / b.duration_since(*a).as_secs_f64().max(1e-3))
            .collect();
        rates.sort_by(f64::total_cmp);
        rates.get(rates.len() / 2).copied().unwrap_or(0.0)
    }

    fn free_per_s(&self) -> f64 {
        let span = *self.free_span.locked();
        let n = self.free.load(Ordering::Relaxed);
        match span {
            Some((a, b)) if n > 1 => (n - 1) as f64 / b.duration_since(a).as_secs_f64().max(1e-3),
            _ => 0.0,
        }
    }

    /// Every key's first deliveries in sequence order, or the first key whose are not.
    fn check_order(&self) -> anyhow::Result<()> {
        for ((p, k), seqs) in self.firsts.locked().iter() {
            if seqs.windows(2).any(|w| w[0] > w[1]) {
                bail!("partition {p}, key {k}: first deliveries out of order: {seqs:?}");
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Handler for LinesHandler {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        tokio::time::sleep(self.latency).await;
        self.answer(event, attempt)
    }
}

/// The same receiver taking batches: one wait per call.
#[async_trait::async_trait]
impl BatchHandler for LinesHandler {
    async fn handle_batch(&self, items: &[Item<'_>]) -> Vec<Outcome> {
        self.largest_batch.fetch_max(items.len(), Ordering::Relaxed);
        tokio::time::sleep(self.latency).await;
        items
            .iter()
            .map(|i| self.answer(i.event, i.attempt))
            .collect()
    }
}

impl LinesHandler {
    fn answer(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let class = Class::of(&event.body);
        if class == Class::Head && self.fail_heads && attempt.number == 1 {
            return Outcome::Failed(Failure::transient("bench: the line's head fails once"));
        }
        let now = Instant::now();
        let first = self
            .delivered
            .locked()
            .insert((event.partition_id.clone(), event.sequence_number));
        if first {
            if let Some(k) = event.properties.get("order") {
                self.firsts
                    .locked()
                    .entry((event.partition_id.clone(), k.clone()))
                    .or_default()
                    .push(event.sequence_number);
            }
            match class {
                Class::Free => {
                    self.free.fetch_add(1, Ordering::Relaxed);
                    let mut s = self.free_span.locked();
                    *s = Some(s.map_or((now, now), |(a, _)| (a, now)));
                }
                Class::Parked => {
                    self.parked.fetch_add(1, Ordering::Relaxed);
                    *self.last_parked.locked() = Some(now);
                    if let Some(k) = event.properties.get("order") {
                        let mut spans = self.line_spans.locked();
                        let e = spans
                            .entry((event.partition_id.clone(), k.clone()))
                            .or_insert((now, now, 0));
                        e.1 = now;
                        e.2 += 1;
                    }
                }
                Class::Head => {}
            }
        }
        Outcome::Delivered
    }
}

/// The stream of one partition: `lines` heads first, then the free events with a parked
/// event of each line in turn after every free one until `line_length` are parked behind
/// each, then the rest of the free events.
fn partition_events(lines: usize, line_length: usize, free: usize) -> Vec<(Class, String)> {
    let mut v: Vec<(Class, String)> = (0..lines)
        .map(|l| (Class::Head, format!("line-{l}")))
        .collect();
    let (mut parked, mut free_sent) = (0, 0);
    while parked < lines * line_length || free_sent < free {
        if free_sent < free {
            v.push((Class::Free, format!("free-{free_sent}")));
            free_sent += 1;
        }
        if parked < lines * line_length {
            v.push((Class::Parked, format!("line-{}", parked % lines)));
            parked += 1;
        }
    }
    v
}

struct Run {
    free_per_s: f64,
    drain: Option<(f64, f64)>,
    line_per_s: f64,
    largest_batch: usize,
}

/// One run's shape.
#[derive(Debug, Clone, Copy)]
struct Shape {
    partitions: usize,
    handler_latency: Duration,
    lines_per_partition: usize,
    line_length: usize,
    free_per_partition: usize,
    /// Events per call (1: the handler takes them one by one).
    batch_max: usize,
}

/// One run: the free keys' events/s and, `with_lines`, the released lines' drain.
async fn run_once(shape: Shape, with_lines: bool) -> anyhow::Result<Run> {
    let Shape {
        partitions,
        handler_latency,
        lines_per_partition,
        line_length,
        free_per_partition,
        batch_max,
    } = shape;
    let stream = partition_events(lines_per_partition, line_length, free_per_partition);
    let emulators = start_with_stream(partitions, &stream).await?;
    let handler = Arc::new(LinesHandler::new(handler_latency, with_lines));
    let as_handler: Arc<dyn Handler> = if batch_max > 1 {
        let limits = BatchLimits {
            max_events: batch_max,
            max_bytes: 1 << 20,
            wait: Duration::ZERO,
        };
        Arc::new(Batched::shared(handler.clone(), limits))
    } else {
        handler.clone()
    };
    let pipeline = ordered_pipeline(&emulators, as_handler)?;
    let settler = pipeline.settler();
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let free_total = (free_per_partition * partitions) as u64;
    let parked_total = (lines_per_partition * line_length * partitions) as u64;
    let h = handler.clone();
    pipelines::wait_progress("free keys", || h.free.load(Ordering::Relaxed), free_total).await?;
    let free_per_s = handler.free_per_s();
    let drain = if with_lines {
        Some(measure_drain(&handler, &settler, partitions, &stream, parked_total).await?)
    } else {
        let h = handler.clone();
        pipelines::wait_progress(
            "the lines' events",
            || h.parked.load(Ordering::Relaxed),
            parked_total,
        )
        .await?;
        None
    };
    handler.check_order()?;
    cancel.cancel();
    run.await??;
    emulators.shutdown().await;
    Ok(Run {
        free_per_s,
        drain,
        line_per_s: handler.line_per_s(),
        largest_batch: handler.largest_batch.load(Ordering::Relaxed),
    })
}

/// The emulators at the azure latency profile, `stream` produced to each partition.
async fn start_with_stream(
    partitions: usize,
    stream: &[(Class, String)],
) -> anyhow::Result<Emulators> {
    let emulators = Emulators::start(EmulatorsConfig {
        hubs: vec![HubSpec::new("bench", partitions)],
        latency: LatencyProfile::azure(),
        ..Default::default()
    })
    .await?;
    let cs: crate::azure::ConnectionString = emulators
        .eventhubs
        .as_ref()
        .context("event hubs")?
        .connection_string()
        .parse()?;
    let share = stream.len();
    let plan = Plan::partition_by_partition("bench", share * partitions, partitions);
    producer::produce(&cs, &plan, |n| {
        let (p, j) = (n / share, n % share);
        let (class, order) = &stream[j];
        let body = match class {
            Class::Head => "head",
            Class::Parked => "parked",
            Class::Free => "free",
        };
        Outgoing::keyed(format!("lines-{p}-{j}"), body.as_bytes().to_vec())
            .property("order", format!("{p}-{order}"))
    })
    .await?;
    Ok(emulators)
}

/// The pipeline with retries ordered by the `order` property, each due in an hour.
fn ordered_pipeline(emulators: &Emulators, handler: Arc<dyn Handler>) -> anyhow::Result<Pipeline> {
    // The heads' retries are due in an hour: the lines stay open until they are pulled.
    let policy = RetryPolicy {
        name: "bench".into(),
        curve: crate::policy::Curve::Fixed,
        base_s: 3600,
        floor_s: 3600,
        cap_s: 3600,
        max_attempts: 5,
        max_age_s: None,
    };
    let options = PipelineOptions {
        max_in_flight: crate::config::DEFAULT_MAX_IN_FLIGHT,
        window: crate::config::window_for(crate::config::DEFAULT_MAX_IN_FLIGHT),
        retry_concurrency: crate::config::DEFAULT_RETRY_CONCURRENCY,
        ordering: OrderingKey::Property("order".into()),
        retry_ordering: RetryOrdering::Key(LineOnDeadLetter::Release),
        ..pipelines::bench_options()
    };
    Ok(Pipeline::new(pipelines::parts(
        emulators, handler, policy, options,
    )?))
}

/// Lines filled, heads pulled forward: parked events delivered per second, and the seconds.
async fn measure_drain(
    handler: &Arc<LinesHandler>,
    settler: &Settler,
    partitions: usize,
    stream: &[(Class, String)],
    parked_total: u64,
) -> anyhow::Result<(f64, f64)> {
    wait_all_parked(settler, parked_total).await?;
    if handler.parked.load(Ordering::Relaxed) != 0 {
        bail!("a parked event was delivered before its head");
    }
    let pulled = Instant::now();
    pull_heads(settler, partitions, stream).await?;
    let h = handler.clone();
    pipelines::wait_progress(
        "released lines",
        || h.parked.load(Ordering::Relaxed),
        parked_total,
    )
    .await?;
    let last = handler
        .last_parked
        .locked()
        .context("no parked event delivered")?;
    let secs = last
        .saturating_duration_since(pulled)
        .as_secs_f64()
        .max(1e-3);
    Ok((parked_total as f64 / secs, secs))
}

/// Waits (at most 120 s) until the ledger holds `parked_total` parked events.
async fn wait_all_parked(settler: &Settler, parked_total: u64) -> anyhow::Result<()> {
    let ledger = settler.ledger.clone();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let parked = ledger.all_parked().await?.len() as u64;
        if parked == parked_total {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{parked} of {parked_total} events parked after 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Pulls every line's head forward (as `retries run-now` would), partition by partition.
async fn pull_heads(
    settler: &Settler,
    partitions: usize,
    stream: &[(Class, String)],
) -> anyhow::Result<()> {
    let share = stream.len();
    for p in 0..partitions {
        for (j, (class, _)) in stream.iter().enumerate() {
            if *class == Class::Head {
                settler
                    .retry_now(&format!("lines-{p}-{j}"), "bench", false)
                    .await
                    .with_context(|| format!("pulling line head lines-{p}-{j} (of {share})"))?;
            }
        }
    }
    Ok(())
}

/// The scenario's sizes.
#[derive(Debug, Clone, Copy)]
pub struct LinesArgs {
    /// Partitions of the hub.
    pub partitions: usize,
    /// Lines, spread over the partitions.
    pub lines: usize,
    /// Events parked behind each.
    pub line_length: usize,
    /// Events of free keys.
    pub free_events: usize,
    /// The handler's latency.
    pub handler: Duration,
    /// Events per call in the batched drain (1: not run).
    pub batch_max: usize,
    /// Events parked behind each line (one per partition) in the batched drain.
    pub batch_line_length: usize,
}

/// The scenario: `lines` lines of `line_length` parked events, spread over `partitions`,
/// beside `free_events` events of keys of their own; a handler answering after `handler`;
/// then, with `batch_max` above 1, one line of `batch_line_length` per partition drained in
/// ordered batches.
pub async fn lines(a: LinesArgs) -> anyhow::Result<LinesFigures> {
    if a.lines == 0 || a.line_length == 0 || a.free_events == 0 || a.partitions == 0 {
        bail!("--lines, --line-length and --events must be positive");
    }
    let shape = Shape {
        partitions: a.partitions,
        handler_latency: a.handler,
        lines_per_partition: a.lines.div_ceil(a.partitions),
        line_length: a.line_length,
        free_per_partition: a.free_events.div_ceil(a.partitions),
        batch_max: 1,
    };
    let without = run_once(shape, false).await?;
    let with = run_once(shape, true).await?;
    let (drain_per_s, drain_s) = with.drain.context("the drain was not measured")?;
    let batched = if a.batch_max > 1 {
        let line_length = a.batch_line_length.max(2);
        let batched = Shape {
            lines_per_partition: 1,
            line_length,
            free_per_partition: 50,
            batch_max: a.batch_max,
            ..shape
        };
        let run = run_once(batched, true).await?;
        let alone = run_once(
            Shape {
                partitions: 1,
                ..batched
            },
            true,
        )
        .await?;
        Some(BatchedDrain {
            batch_max: a.batch_max,
            lines: a.partitions,
            line_length,
            line_per_s: run.line_per_s,
            one_line_per_s: alone.line_per_s,
            largest_batch: run.largest_batch.max(alone.largest_batch),
        })
    } else {
        None
    };
    Ok(LinesFigures {
        partitions: a.partitions,
        handler: a.handler,
        lines: shape.lines_per_partition * a.partitions,
        line_length: a.line_length,
        free_events: shape.free_per_partition * a.partitions,
        free_per_s_without_lines: without.free_per_s,
        free_per_s_with_lines: with.free_per_s,
        drain_per_s,
        drain_s,
        drain_line_per_s: with.line_per_s,
        batched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partitions_stream_heads_its_lines_then_interleaves_parked_and_free_events() {
        let s = partition_events(2, 2, 3);
        let got: Vec<(Class, &str)> = s.iter().map(|(c, k)| (*c, k.as_str())).collect();
        assert_eq!(
            got,
            vec![
                (Class::Head, "line-0"),
                (Class::Head, "line-1"),
                (Class::Free, "free-0"),
                (Class::Parked, "line-0"),
                (Class::Free, "free-1"),
                (Class::Parked, "line-1"),
                (Class::Free, "free-2"),
                (Class::Parked, "line-0"),
                (Class::Parked, "line-1"),
            ]
        );
    }
}
