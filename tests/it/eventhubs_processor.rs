//! The SDK's `EventProcessor` against the emulator, with the SDK's in-memory checkpoint store:
//! claiming every partition, resuming from checkpoints, and two processors sharing a hub.
//! `PartitionClient::stream_events()` is `!Send`, so partition tasks run on a `LocalSet`.

use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

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
        cs.open_consumer(
            ConsumerClient::builder().with_application_id(owner.to_string()),
            "hub",
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
                                {
                                    let stream = pc.stream_events();
                                    futures::pin_mut!(stream);
                                    while let Some(Ok(ev)) = stream.next().await {
                                        received.borrow_mut().entry(owner).or_default().insert((
                                            pc.get_partition_id().to_string(),
                                            ev.sequence_number().unwrap(),
                                        ));
                                    }
                                }
                                // Give the partition back on any end (revoked, or evicted by
                                // the old owner's receiver before its cycle revoked it), as
                                // hubguard does: only then does the processor hand it out
                                // again (a dropped client stalls its partition for good).
                                if let Ok(pc) = Arc::try_unwrap(pc) {
                                    let _ = pc.close().await;
                                }
                            });
                        }
                    })
                };
                processors.push((p, dispatcher));
            }

            // Wait (bounded) until the ownerships settle at two partitions per replica.
            eventually("the ownership split two and two", STEP, || async {
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
                seen(per_owner, |p| p.len() == 2 && p.values().all(|n| *n == 2))
            })
            .await;

            // Every event sent now is read by whoever owns its partition.
            fill(&prod, 4, 5, "split").await;
            eventually("all 20 events read", STEP, || async {
                let all: BTreeSet<(String, i64)> =
                    received.borrow().values().flatten().cloned().collect();
                seen(all.len(), |n| *n == 20)
            })
            .await;
            // Until the old owner's next cycle revokes it, its receiver and the new owner's
            // can evict each other (same owner level): keep sending (bounded) until the new
            // owner, handed the partition again, has read too.
            let round = std::cell::Cell::new(0);
            Wait::new("both replicas read events", STEP)
                .every(Duration::from_millis(200))
                .until(|| async {
                    if received.borrow().len() >= 2 {
                        return Ok(());
                    }
                    round.set(round.get() + 1);
                    fill(&prod, 4, 1, &format!("more-{}", round.get())).await;
                    Err(received.borrow().keys().cloned().collect::<Vec<_>>())
                })
                .await;
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

/// Waits (within [`STEP`]) until `cond` holds.
async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    eventually(what, STEP, || std::future::ready(cond())).await
}

/// A checkpoint store one replica loses (its blob storage is unreachable) while the other
/// keeps it: the split brain of a one-sided blob outage.
struct Severable {
    inner: Arc<dyn CheckpointStore + Send + Sync>,
    down: std::sync::atomic::AtomicBool,
}

impl Severable {
    fn check(&self) -> azure_core::Result<()> {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            Err(azure_core::Error::with_message(
                azure_core::error::ErrorKind::Io,
                "blob storage unreachable (test)",
            ))
        } else {
            Ok(())
        }
    }
}

#[async_trait::async_trait]
impl CheckpointStore for Severable {
    async fn claim_ownership(
        &self,
        o: &[azure_messaging_eventhubs::models::Ownership],
    ) -> azure_core::Result<Vec<azure_messaging_eventhubs::models::Ownership>> {
        self.check()?;
        self.inner.claim_ownership(o).await
    }
    async fn list_checkpoints(
        &self,
        ns: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<azure_messaging_eventhubs::models::Checkpoint>> {
        self.check()?;
        self.inner.list_checkpoints(ns, hub, cg).await
    }
    async fn list_ownerships(
        &self,
        ns: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<azure_messaging_eventhubs::models::Ownership>> {
        self.check()?;
        self.inner.list_ownerships(ns, hub, cg).await
    }
    async fn update_checkpoint(
        &self,
        c: azure_messaging_eventhubs::models::Checkpoint,
    ) -> azure_core::Result<()> {
        self.check()?;
        self.inner.update_checkpoint(c).await
    }
}

/// 0.16's processor attaches every partition receiver with owner level 0
/// (`com.microsoft:epoch`), and the emulator applies Azure's rule: an equal or higher owner
/// level takes the partition and the old receiver is detached (`amqp:link:stolen`). So when
/// replica A loses blob storage (it can neither renew nor learn that it lost its partitions)
/// and replica B takes the partitions over, A stops receiving the moment B attaches: no
/// event sent after the handover reaches both. (With 0.15, which sent no owner level, both
/// replicas delivered such events.)
#[tokio::test]
async fn after_a_blob_outage_the_new_owner_evicts_the_old_by_owner_level_and_nothing_is_read_twice()
{
    let emu = emulator(&[("hub", 2)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    let shared: Arc<dyn CheckpointStore + Send + Sync> = Arc::new(InMemoryCheckpointStore::new());
    let a_store = Arc::new(Severable {
        inner: shared.clone(),
        down: false.into(),
    });
    let hub = emu.store().hub("hub").unwrap();

    LocalSet::new()
        .run_until(async {
            let received: Received = Default::default();
            // Partition clients each replica still reads.
            let reading: Rc<std::cell::RefCell<BTreeMap<&'static str, usize>>> = Default::default();
            let start = |owner: &'static str, store: Arc<dyn CheckpointStore + Send + Sync>| {
                let cs = cs.clone();
                let received = received.clone();
                let reading = reading.clone();
                async move {
                    let p = processor(&cs, owner, store).await;
                    let run = {
                        let p = p.clone();
                        tokio::task::spawn_local(async move {
                            let _ = p.run().await;
                        })
                    };
                    let dispatch = {
                        let p = p.clone();
                        tokio::task::spawn_local(async move {
                            while let Ok(pc) = p.next_partition_client().await {
                                let received = received.clone();
                                let reading = reading.clone();
                                *reading.borrow_mut().entry(owner).or_default() += 1;
                                tokio::task::spawn_local(async move {
                                    let stream = pc.stream_events();
                                    futures::pin_mut!(stream);
                                    while let Some(Ok(ev)) = stream.next().await {
                                        received.borrow_mut().entry(owner).or_default().insert((
                                            pc.get_partition_id().to_string(),
                                            ev.sequence_number().unwrap(),
                                        ));
                                    }
                                    *reading.borrow_mut().entry(owner).or_default() -= 1;
                                });
                            }
                        })
                    };
                    (p, run, dispatch)
                }
            };

            // Replica A owns both partitions and reads; on the wire its receivers carry owner
            // level 0.
            let a = start("replica-a", a_store.clone()).await;
            wait_until("A attaches both partitions", || {
                (0..2).all(|p| hub.receiver_epochs("$Default", p) == vec![Some(0)])
            })
            .await;
            fill(&prod, 2, 3, "before").await;
            wait_until("A reads the first events", || {
                received.borrow().get("replica-a").map_or(0, |s| s.len()) == 6
            })
            .await;

            // A's blob storage goes away; B starts and, once A's claims expire, takes both.
            a_store
                .down
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let b = start("replica-b", shared.clone()).await;
            wait_until("B owns both partitions", || {
                futures::executor::block_on(shared.list_ownerships(&cs.host, "hub", "$Default"))
                    .map(|o| {
                        o.len() == 2 && o.iter().all(|o| o.owner_id.as_deref() == Some("replica-b"))
                    })
                    .unwrap_or(false)
            })
            .await;
            // B's receivers are attached once B has read the first events (no checkpoint was
            // written: it starts at the earliest). Until then A may still read, legitimately:
            // events sent between B's claim and B's attach reach both (at least once).
            wait_until("B attaches and reads both partitions", || {
                received
                    .borrow()
                    .get("replica-b")
                    .is_some_and(|s| s.iter().filter(|(_, seq)| *seq < 3).count() == 6)
            })
            .await;
            // Exactly one receiver per partition, B's, owner level 0: A's were detached.
            wait_until("one receiver per partition", || {
                (0..2).all(|p| hub.receiver_epochs("$Default", p) == vec![Some(0)])
            })
            .await;

            fill(&prod, 2, 5, "after").await;
            wait_until("B reads the new events", || {
                received
                    .borrow()
                    .get("replica-b")
                    .is_some_and(|s| s.iter().filter(|(_, seq)| *seq >= 3).count() == 10)
            })
            .await;
            // What A read is final: its processor stopped when its store refused it, and
            // every partition client it was handed has ended (its receivers were detached).
            wait_until("A stopped reading", || {
                a.1.is_finished() && reading.borrow().get("replica-a") == Some(&0)
            })
            .await;
            let got = received.borrow().clone();
            let a_after: Vec<_> = got
                .get("replica-a")
                .map(|s| s.iter().filter(|(_, seq)| *seq >= 3).cloned().collect())
                .unwrap_or_default();
            assert!(
                a_after.is_empty(),
                "the old owner read events sent after the handover: {a_after:?}"
            );

            for (p, run, dispatch) in [a, b] {
                dispatch.abort();
                let _ = within("shutdown", p.shutdown()).await;
                let _ = within("run returns", run).await;
            }
        })
        .await;
    within("close producer", prod.close()).await.unwrap();
}
