//! The `eventhubs` and `guard` scenarios: the Event Hubs emulator's produce and consume
//! throughput through the SDK, and a bare SDK consumer loop against hubguard with a no-op
//! handler on the same events; and the SDK loops the other scenarios share (producing in
//! batches, a bare consumer that may checkpoint on hubguard's schedule).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use azure_messaging_eventhubs::{
    ConsumerClient, OpenReceiverOptions, StartLocation, StartPosition,
};
use futures::StreamExt;

use super::pipelines;
use crate::azure::ConnectionString;
use crate::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use crate::emulator::producer::{self, Outgoing, Plan};

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
