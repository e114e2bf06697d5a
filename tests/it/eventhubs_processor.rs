//! The SDK's `EventProcessor` against the emulator, with the SDK's in-memory checkpoint store:
//! claiming every partition, resuming from checkpoints, and two processors sharing a hub.
//! `PartitionClient::stream_events()` is `!Send`, so partition tasks run on a `LocalSet`.

use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use azure_messaging_eventhubs::models::{EventData, StartPositions};
use azure_messaging_eventhubs::processor::PartitionClient;
use azure_messaging_eventhubs::{
    CheckpointStore, ConsumerClient, EventDataBatchOptions, EventProcessor,
    InMemoryCheckpointStore, ProducerClient, StartLocation, StartPosition,
};
use futures::StreamExt;
use hubguard::azure::ConnectionString;
use tokio::task::LocalSet;

use crate::common::*;

/// Events each replica read: owner → {(partition, sequence number)}.
type Received = Rc<std::cell::RefCell<BTreeMap<&'static str, BTreeSet<(String, i64)>>>>;

async fn fill(prod: &ProducerClient, partitions: usize, per_partition: usize, tag: &str) {
    for p in 0..partitions {
        let batch = within(
            "batch",
            prod.create_batch(Some(EventDataBatchOptions {
                partition_id: Some(p.to_string()),
                ..Default::default()
            })),
        )
        .await
        .unwrap();
        for i in 0..per_partition {
            let ev = EventData::builder()
                .with_body(format!("{tag}-{p}-{i}").into_bytes())
                .build();
            assert!(batch.try_add_event_data(ev, None).unwrap());
        }
        within("send", prod.send_batch(batch, None)).await.unwrap();
    }
}

async fn processor(
    cs: &ConnectionString,
    owner: &str,
    store: Arc<dyn CheckpointStore + Send + Sync>,
) -> Arc<EventProcessor> {
    let client = within(
        "open consumer",
        ConsumerClient::builder()
            .with_custom_endpoint(cs.custom_endpoint().unwrap())
            .with_application_id(owner.to_string())
            .open(
                &cs.namespace(),
                "hub".into(),
                Arc::new(cs.credential(Some("hub"))),
            ),
    )
    .await
    .unwrap();
    within(
        "build processor",
        EventProcessor::builder()
            .with_update_interval(Duration::from_millis(500).try_into().unwrap())
            .with_partition_expiration_duration(Duration::from_secs(3).try_into().unwrap())
            .with_start_positions(StartPositions {
                default: StartPosition {
                    location: StartLocation::Earliest,
                    inclusive: false,
                },
                ..Default::default()
            })
            .build(client, store),
    )
    .await
    .unwrap()
}

/// Reads `n` events from a partition client, checkpointing the last one; returns the
/// sequence numbers read.
async fn read_and_checkpoint(pc: &PartitionClient, n: usize) -> Vec<i64> {
    let mut seqs = Vec::new();
    let stream = pc.stream_events();
    futures::pin_mut!(stream);
    let mut last = None;
    while seqs.len() < n {
        match within("partition event", stream.next()).await {
            Some(Ok(ev)) => {
                seqs.push(ev.sequence_number().unwrap());
                last = Some(ev);
            }
            other => panic!("partition stream failed: {other:?}"),
        }
    }
    if let Some(ev) = last {
        within("checkpoint", pc.update_checkpoint(&ev))
            .await
            .unwrap();
    }
    seqs
}

/// Shuts a processor down in the order that releases everything (PROCESSOR_NOTES.md).
async fn stop(
    processor: Arc<EventProcessor>,
    runner: tokio::task::JoinHandle<()>,
    clients: Vec<Arc<PartitionClient>>,
) {
    within("shutdown", processor.shutdown()).await.unwrap();
    within("run returns", runner).await.unwrap();
    for pc in clients {
        let pc = Arc::try_unwrap(pc).unwrap_or_else(|_| panic!("partition client still shared"));
        within("close partition client", pc.close()).await.unwrap();
    }
    let p = Arc::try_unwrap(processor).unwrap_or_else(|_| panic!("processor still shared"));
    within("close processor", p.close()).await.unwrap();
}

#[tokio::test]
async fn processor_claims_every_partition_and_resumes_from_checkpoints() {
    claim_and_resume(Arc::new(InMemoryCheckpointStore::new())).await;
}

/// A processor claims every partition, reads and checkpoints; a second run with the same
/// owner id resumes right after the checkpoints. Used with every checkpoint store.
pub(crate) async fn claim_and_resume(store: Arc<dyn CheckpointStore + Send + Sync>) {
    let emu = emulator(&[("hub", 4)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    fill(&prod, 4, 10, "a").await;

    LocalSet::new()
        .run_until(async {
            // First run: read 6 events of each partition and checkpoint the 6th.
            let p1 = processor(&cs, "replica-a", store.clone()).await;
            let run = {
                let p = p1.clone();
                tokio::task::spawn_local(async move {
                    let _ = p.run().await;
                })
            };
            let mut clients = Vec::new();
            let mut seen = BTreeMap::new();
            for _ in 0..4 {
                let pc = within("next partition client", p1.next_partition_client())
                    .await
                    .unwrap();
                let seqs = read_and_checkpoint(&pc, 6).await;
                seen.insert(pc.get_partition_id().to_string(), seqs);
                clients.push(pc);
            }
            assert_eq!(
                seen.keys().cloned().collect::<Vec<_>>(),
                vec!["0", "1", "2", "3"]
            );
            assert!(seen.values().all(|s| *s == (0..6).collect::<Vec<_>>()));
            stop(p1, run, clients).await;

            // The checkpoints hold offsets and sequence numbers.
            let cps = within(
                "list checkpoints",
                store.list_checkpoints(&cs.host, "hub", "$Default"),
            )
            .await
            .unwrap();
            assert_eq!(cps.len(), 4);
            assert!(cps
                .iter()
                .all(|c| c.sequence_number == Some(5) && c.offset.is_some()));

            // Second run, same owner: resumes right after the checkpoint.
            let p2 = processor(&cs, "replica-a", store.clone()).await;
            let run = {
                let p = p2.clone();
                tokio::task::spawn_local(async move {
                    let _ = p.run().await;
                })
            };
            let mut clients = Vec::new();
            for _ in 0..4 {
                let pc = within("next partition client", p2.next_partition_client())
                    .await
                    .unwrap();
                let seqs = read_and_checkpoint(&pc, 4).await;
                assert_eq!(
                    seqs,
                    vec![6, 7, 8, 9],
                    "partition {} resumes after its checkpoint",
                    pc.get_partition_id()
                );
                clients.push(pc);
            }
            stop(p2, run, clients).await;
        })
        .await;
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn two_processors_split_the_partitions() {
    let emu = emulator(&[("hub", 4)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    let store: Arc<dyn CheckpointStore + Send + Sync> = Arc::new(InMemoryCheckpointStore::new());

    LocalSet::new()
        .run_until(async {
            let received: Received = Default::default();
            let mut runs = Vec::new();
            let mut processors = Vec::new();
            for owner in ["replica-a", "replica-b"] {
                let p = processor(&cs, owner, store.clone()).await;
                runs.push({
                    let p = p.clone();
                    tokio::task::spawn_local(async move {
                        let _ = p.run().await;
                    })
                });
                // Dispatch: every partition client this processor gets is read until revoked.
                let dispatcher = {
                    let p = p.clone();
                    let received = received.clone();
                    tokio::task::spawn_local(async move {
                        while let Ok(pc) = p.next_partition_client().await {
                            let received = received.clone();
                            tokio::task::spawn_local(async move {
                                let stream = pc.stream_events();
                                futures::pin_mut!(stream);
                                while let Some(Ok(ev)) = stream.next().await {
                                    received.borrow_mut().entry(owner).or_default().insert((
                                        pc.get_partition_id().to_string(),
                                        ev.sequence_number().unwrap(),
                                    ));
                                }
                            });
                        }
                    })
                };
                processors.push((p, dispatcher));
            }

            // Wait (bounded) until the ownerships settle at two partitions per replica.
            let deadline = Instant::now() + STEP;
            loop {
                let owners = store
                    .list_ownerships(&cs.host, "hub", "$Default")
                    .await
                    .unwrap();
                let mut per_owner: BTreeMap<String, usize> = BTreeMap::new();
                for o in &owners {
                    *per_owner
                        .entry(o.owner_id.clone().unwrap_or_default())
                        .or_default() += 1;
                }
                if per_owner.len() == 2 && per_owner.values().all(|n| *n == 2) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "ownership never split: {per_owner:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }

            // Every event sent now is read by whoever owns its partition.
            fill(&prod, 4, 5, "split").await;
            let deadline = Instant::now() + STEP;
            loop {
                let all: BTreeSet<(String, i64)> =
                    received.borrow().values().flatten().cloned().collect();
                if all.len() == 20 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "only {} of 20 events read",
                    all.len()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let readers = received.borrow().len();
            assert_eq!(readers, 2, "both replicas read events");
            for ((p, dispatcher), run) in processors.into_iter().zip(runs) {
                dispatcher.abort();
                within("shutdown", p.shutdown()).await.unwrap();
                within("run returns", run).await.unwrap();
            }
        })
        .await;
    within("close producer", prod.close()).await.unwrap();
}
