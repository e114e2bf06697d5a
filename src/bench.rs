//! `hubguard bench`: performance figures measured through the real Azure SDK against the
//! in-process emulators, printed as a table or (with `--json`) one JSON line.
//!
//! - The Event Hubs emulator itself: produce and consume throughput of 1 KB events in
//!   batches, over 1 and 4 partitions, through `azure_messaging_eventhubs`.
//! - The guard's cost: a bare SDK consumer loop and `hubguard`'s pipeline with a no-op
//!   handler reading the same events side by side, their events/s and ratio, checkpoint
//!   writes per second, and Service Bus and ledger operations per event on the happy path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use azure_messaging_eventhubs::models::EventData;
use azure_messaging_eventhubs::{
    ConsumerClient, OpenReceiverOptions, ProducerClient, SendBatchOptions, StartLocation,
    StartPosition,
};
use clap::Args;
use futures::StreamExt;

use crate::azure::ConnectionString;
use crate::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};

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

/// Runs the benchmark and prints it.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.events == 0 || args.partitions.contains(&0) {
        bail!("--events and --partitions must be positive");
    }
    let mut results = Vec::new();
    let mut guards = Vec::new();
    for &p in &args.partitions {
        results.push(eventhubs_throughput(p, args.events, args.size).await?);
        guards.push(guard_vs_bare(p, args.events, args.size).await?);
    }
    if args.json {
        let mut fields: Vec<String> = guards
            .iter()
            .flat_map(|g| {
                [
                    format!("\"bare_per_s_p{}\":{:.0}", g.partitions, g.bare_per_s),
                    format!("\"guard_per_s_p{}\":{:.0}", g.partitions, g.guard_per_s),
                    format!(
                        "\"guard_vs_bare_ratio_p{}\":{:.3}",
                        g.partitions,
                        g.guard_per_s / g.bare_per_s
                    ),
                ]
            })
            .collect();
        if let Some(g) = guards.last() {
            fields.push(format!(
                "\"guard_vs_bare_ratio\":{:.3}",
                g.guard_per_s / g.bare_per_s
            ));
            fields.push(format!(
                "\"checkpoint_writes_per_s\":{:.2}",
                g.checkpoint_writes_per_s
            ));
            fields.push(format!(
                "\"happy_path_ops_per_event\":{:.4}",
                g.happy_path_ops_per_event
            ));
        }
        let guard_json = fields.join(",");
        let fields: Vec<String> = results
            .iter()
            .flat_map(|r| {
                [
                    format!(
                        "\"eventhubs_produce_per_s_p{}\":{:.0}",
                        r.partitions, r.produce_per_s
                    ),
                    format!(
                        "\"eventhubs_consume_per_s_p{}\":{:.0}",
                        r.partitions, r.consume_per_s
                    ),
                ]
            })
            .collect();
        println!(
            "{{\"events\":{},\"event_bytes\":{},{},{guard_json}}}",
            args.events,
            args.size,
            fields.join(",")
        );
    } else {
        println!("Event Hubs emulator through azure_messaging_eventhubs 0.15 ({} events of {} B, batched sends)", args.events, args.size);
        println!(
            "{:>10} {:>16} {:>16}",
            "partitions", "produce ev/s", "consume ev/s"
        );
        for r in &results {
            println!(
                "{:>10} {:>16.0} {:>16.0}",
                r.partitions, r.produce_per_s, r.consume_per_s
            );
        }
        println!();
        println!("The guard's cost: bare SDK consumer vs hubguard with a no-op handler, same events, side by side");
        println!(
            "{:>10} {:>14} {:>14} {:>8} {:>12} {:>14} {:>18}",
            "partitions",
            "bare ev/s",
            "hubguard ev/s",
            "ratio",
            "checkpoints",
            "ckpt writes/s",
            "SB+ledger ops/ev"
        );
        for g in &guards {
            println!(
                "{:>10} {:>14.0} {:>14.0} {:>8.3} {:>12} {:>14.2} {:>18.4}",
                g.partitions,
                g.bare_per_s,
                g.guard_per_s,
                g.guard_per_s / g.bare_per_s,
                g.checkpoint_writes,
                g.checkpoint_writes_per_s,
                g.happy_path_ops_per_event
            );
        }
    }
    Ok(())
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
    /// Service Bus sends plus ledger records, per event.
    pub happy_path_ops_per_event: f64,
}

struct Noop;

#[async_trait::async_trait]
impl crate::handler::Handler for Noop {
    async fn handle(
        &self,
        _: &crate::event::Event,
        _: &crate::handler::Attempt,
    ) -> crate::handler::Outcome {
        crate::handler::Outcome::Delivered
    }
}

/// Sends `events` events of `size` bytes in batches, spread evenly over the partitions;
/// returns how many and how long the sends took.
async fn produce(
    cs: &ConnectionString,
    partitions: usize,
    events: usize,
    size: usize,
) -> anyhow::Result<(usize, Duration)> {
    let producer = ProducerClient::builder()
        .with_custom_endpoint(cs.custom_endpoint().context("emulator endpoint")?)
        .open(
            &cs.namespace(),
            "bench",
            Arc::new(cs.credential(Some("bench"))),
        )
        .await
        .context("opening the producer")?;
    let body = vec![b'x'; size];
    let per_partition = events.div_ceil(partitions);
    let started = Instant::now();
    let mut sent = 0usize;
    for p in 0..partitions {
        let target = per_partition.min(events - sent);
        let mut done = 0;
        while done < target {
            let batch = producer
                .create_batch(Some(azure_messaging_eventhubs::EventDataBatchOptions {
                    partition_id: Some(p.to_string()),
                    ..Default::default()
                }))
                .await?;
            while done < target
                && batch.try_add_event_data(
                    EventData::builder().with_body(body.clone()).build(),
                    None,
                )?
            {
                done += 1;
            }
            producer.send_batch(batch, None::<SendBatchOptions>).await?;
        }
        sent += target;
    }
    let elapsed = started.elapsed();
    producer.close().await?;
    Ok((sent, elapsed))
}

/// A bare SDK consumer loop: one receiver per partition reading `per_partition[p]` events
/// from the earliest; returns how many and how long.
async fn consume(
    cs: &ConnectionString,
    per_partition: &[usize],
    prefetch: u32,
) -> anyhow::Result<(usize, Duration)> {
    let consumer = Arc::new(
        ConsumerClient::builder()
            .with_custom_endpoint(cs.custom_endpoint().context("emulator endpoint")?)
            .open(
                &cs.namespace(),
                "bench".into(),
                Arc::new(cs.credential(Some("bench"))),
            )
            .await
            .context("opening the consumer")?,
    );
    let started = Instant::now();
    let n = bare_consume(&consumer, per_partition, prefetch).await?;
    let elapsed = started.elapsed();
    if let Ok(c) = Arc::try_unwrap(consumer) {
        c.close().await?;
    }
    Ok((n, elapsed))
}

async fn bare_consume(
    consumer: &Arc<ConsumerClient>,
    per_partition: &[usize],
    prefetch: u32,
) -> anyhow::Result<usize> {
    let mut tasks = Vec::new();
    for (p, &expected) in per_partition.iter().enumerate() {
        let consumer = consumer.clone();
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
            {
                let stream = receiver.stream_events();
                futures::pin_mut!(stream);
                while got < expected {
                    match tokio::time::timeout(Duration::from_secs(30), stream.next()).await {
                        Ok(Some(Ok(_))) => got += 1,
                        Ok(Some(Err(e))) => return Err(anyhow::Error::from(e)),
                        _ => bail!("bare consumer stalled after {got} of {expected}"),
                    }
                }
            }
            receiver.close().await?;
            Ok::<usize, anyhow::Error>(got)
        }));
    }
    let mut n = 0;
    for t in tasks {
        n += t.await??;
    }
    Ok(n)
}

/// Reads the same events with a bare SDK consumer loop and with hubguard (no-op handler).
pub async fn guard_vs_bare(
    partitions: usize,
    events: usize,
    size: usize,
) -> anyhow::Result<GuardFigures> {
    use crate::emulator::{Emulators, EmulatorsConfig};
    use crate::pipeline::{EventHubsTarget, Pipeline, PipelineOptions, PipelineParts};

    let emulators = Emulators::start(EmulatorsConfig {
        hubs: vec![HubSpec::new("bench", partitions)],
        ..Default::default()
    })
    .await?;
    let eh = emulators.eventhubs.as_ref().context("event hubs")?;
    let sb = emulators.servicebus.as_ref().context("service bus")?;
    let blob = emulators.blob.as_ref().context("blob")?;
    let cs: ConnectionString = eh.connection_string().parse()?;
    let endpoint = cs.custom_endpoint().context("emulator endpoint")?;
    produce(&cs, partitions, events, size).await?;
    let per_partition: Vec<usize> = (0..partitions)
        .map(|p| eh.store().hub("bench").map_or(0, |h| h.partitions[p].len()))
        .collect();
    // Bare SDK consumer.
    let (bare, bare_elapsed) = consume(&cs, &per_partition, 300).await?;

    // hubguard, no-op handler.
    let container = blob.container_url("hubguard");
    let sb_cs: ConnectionString = sb.connection_string().parse()?;
    let records = Arc::new(crate::azure::BlobRecordStore::new(
        &container,
        None,
        Duration::from_secs(10),
    )?);
    let parts = PipelineParts {
        eventhubs: EventHubsTarget {
            namespace: cs.namespace(),
            custom_endpoint: Some(endpoint),
            hub: "bench".into(),
            consumer_group: "$Default".into(),
            credential: Arc::new(cs.credential(Some("bench"))),
        },
        checkpoint_store: azure_messaging_eventhubs_checkpointstore_blob::BlobCheckpointStore::new(
            azure_storage_blob::BlobContainerClient::new(url::Url::parse(&container)?, None, None)?,
        ),
        records: records.clone(),
        queue: Arc::new(crate::azure::ServiceBusRetryQueue::new(
            &sb_cs,
            "retries",
            Default::default(),
        )?),
        handler: Arc::new(Noop),
        policies: crate::pipeline::settle::Policies {
            default: crate::policy::RetryPolicy::seed_fibonacci(),
            by_type: Default::default(),
        },
        identity: crate::event::IdentityConfig::default(),
        breaker: Some(crate::breaker::BreakerConfig::default()),
        options: PipelineOptions {
            update_interval: Duration::from_millis(500),
            ownership_expiration: Duration::from_secs(5),
            ..Default::default()
        },
    };
    let pipeline = Pipeline::new(parts);
    let health = pipeline.health();
    let cancel = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let mut last = (0, Instant::now());
    while health.snapshot().delivered < bare as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = health.snapshot().delivered;
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(30) {
            bail!("hubguard stalled at {now} of {bare} events");
        }
    }
    let guard_elapsed = started.elapsed();
    cancel.cancel();
    run.await??;
    let snap = health.snapshot();
    let sb_sends = sb.counters("retries").map_or(0, |c| c.sends);
    let ledger_records = records_count(&*records).await?;
    emulators.shutdown().await;
    Ok(GuardFigures {
        partitions,
        bare_per_s: bare as f64 / bare_elapsed.as_secs_f64(),
        guard_per_s: snap.delivered as f64 / guard_elapsed.as_secs_f64(),
        checkpoint_writes: snap.checkpoints,
        checkpoint_writes_per_s: snap.checkpoints as f64 / guard_elapsed.as_secs_f64(),
        happy_path_ops_per_event: (sb_sends + ledger_records) as f64 / bare.max(1) as f64,
    })
}

async fn records_count(records: &dyn crate::azure::RecordStore) -> anyhow::Result<u64> {
    Ok(records.list("ledger/").await?.len() as u64
        + records.list("deadletters/").await?.len() as u64)
}
