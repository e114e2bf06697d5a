//! `hubguard bench`: performance figures measured through the real Azure SDK against the
//! in-process emulators, printed as a table or (with `--json`) one JSON line.
//!
//! Today it measures the Event Hubs emulator itself: produce and consume throughput of 1 KB
//! events in batches, over 1 and 4 partitions, through `azure_messaging_eventhubs`.

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
    for &p in &args.partitions {
        results.push(eventhubs_throughput(p, args.events, args.size).await?);
    }
    if args.json {
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
            "{{\"events\":{},\"event_bytes\":{},{}}}",
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
    let endpoint = cs.custom_endpoint().context("emulator endpoint")?;
    let producer = ProducerClient::builder()
        .with_custom_endpoint(endpoint.clone())
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
            while done < target {
                let ev = EventData::builder().with_body(body.clone()).build();
                if !batch.try_add_event_data(ev, None)? {
                    break;
                }
                done += 1;
            }
            producer.send_batch(batch, None::<SendBatchOptions>).await?;
        }
        sent += target;
    }
    let produce = started.elapsed();
    producer.close().await?;

    let consumer = Arc::new(
        ConsumerClient::builder()
            .with_custom_endpoint(endpoint)
            .open(
                &cs.namespace(),
                "bench".into(),
                Arc::new(cs.credential(Some("bench"))),
            )
            .await
            .context("opening the consumer")?,
    );
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..partitions {
        let expected = emulator.store().hub("bench").context("hub")?.partitions[p].len();
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
                        prefetch: Some(1000),
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
                        Ok(None) => bail!("stream ended after {got} of {expected} events"),
                        Err(_) => bail!("no event for 30 s after {got} of {expected}"),
                    }
                }
            }
            receiver.close().await?;
            Ok::<usize, anyhow::Error>(got)
        }));
    }
    let mut received = 0;
    for t in tasks {
        received += t.await??;
    }
    let consume = started.elapsed();
    if let Ok(c) = Arc::try_unwrap(consumer) {
        c.close().await?;
    }
    emulator.shutdown().await;
    Ok(Throughput {
        partitions,
        events: received,
        produce_per_s: sent as f64 / produce.as_secs_f64(),
        consume_per_s: received as f64 / consume.as_secs_f64(),
    })
}
