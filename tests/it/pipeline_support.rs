//! A test bed for the pipeline: the three emulators, a scripted handler whose behaviour is
//! written in each event's body, and helpers to produce events and wait on conditions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
use azure_messaging_eventhubs::{CheckpointStore, EventDataBatchOptions};
use hubguard::azure::{BlobRecordStore, ConnectionString, RecordStore, ServiceBusRetryQueue};
use hubguard::emulator::blob::{BlobConfig, BlobEmulator};
use hubguard::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use hubguard::event::Event;
use hubguard::handler::{Attempt, Failure, Handler, Outcome};
use hubguard::ledger::Ledger;
use hubguard::pipeline::health::Health;
use hubguard::pipeline::settle::{Policies, Settler};
use hubguard::pipeline::{EventHubsTarget, Pipeline, PipelineOptions, PipelineParts};
use hubguard::policy::{Curve, RetryPolicy};
use hubguard::wiring::{ServiceBusAccess, StorageAccess, Wiring};
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// Body instructions: `ok`, `fail:N` (transient failures for the first N attempts),
/// `perm` (permanent failure), `retry-after:S` (one 429-like failure asking for S seconds);
/// anything after a `#` is padding.
#[derive(Default)]
pub(crate) struct Scripted {
    /// key → attempt numbers seen, in order.
    pub calls: Mutex<HashMap<String, Vec<u32>>>,
    /// keys delivered (in delivery order, duplicates included).
    pub delivered: Mutex<Vec<String>>,
    /// When set, every call fails transiently (a downstream outage).
    pub outage: std::sync::atomic::AtomicBool,
}

impl Scripted {
    pub(crate) fn calls_of(&self, key: &str) -> Vec<u32> {
        self.calls
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }
    pub(crate) fn delivered_keys(&self) -> std::collections::BTreeSet<String> {
        self.delivered.lock().unwrap().iter().cloned().collect()
    }
}

#[async_trait]
impl Handler for Scripted {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let key = event.identity.idempotency_key.clone();
        let n = {
            let mut calls = self.calls.lock().unwrap();
            let v = calls.entry(key.clone()).or_default();
            v.push(attempt.number);
            v.len() as u32
        };
        if self.outage.load(std::sync::atomic::Ordering::SeqCst) {
            return Outcome::Failed(Failure::transient("downstream outage"));
        }
        // Anything after `#` is padding (large events).
        let body = String::from_utf8_lossy(&event.body).to_string();
        let body = body.split('#').next().unwrap_or_default().to_string();
        let outcome = if let Some(k) = body.strip_prefix("fail:") {
            if n <= k.parse::<u32>().unwrap_or(0) {
                Outcome::Failed(Failure::transient(format!("scripted failure {n}")))
            } else {
                Outcome::Delivered
            }
        } else if body == "perm" {
            Outcome::Failed(Failure::permanent("scripted permanent failure"))
        } else if let Some(s) = body.strip_prefix("retry-after:") {
            if n == 1 {
                Outcome::Failed(
                    Failure::transient("busy")
                        .with_retry_after(Some(Duration::from_secs(s.parse().unwrap_or(1)))),
                )
            } else {
                Outcome::Delivered
            }
        } else {
            Outcome::Delivered
        };
        if outcome == Outcome::Delivered {
            self.delivered.lock().unwrap().push(key);
        }
        outcome
    }
}

pub(crate) struct Bed {
    pub eh: EventHubsEmulator,
    pub sb: ServiceBusEmulator,
    pub blob: BlobEmulator,
    pub cs: ConnectionString,
}

/// A fast policy for tests: fixed 1 s waits.
pub(crate) fn fast_policy(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        name: "test".into(),
        curve: Curve::Fixed,
        base_s: 1,
        floor_s: 1,
        cap_s: 60,
        max_attempts,
        max_age_s: None,
    }
}

pub(crate) struct Running {
    pub cancel: CancellationToken,
    pub health: Arc<Health>,
    pub task: tokio::task::JoinHandle<()>,
    /// The pipeline's logs, printed if the test fails while it runs.
    _log: crate::test_log::TestLog,
}

impl Running {
    pub(crate) async fn stop(self) {
        self.cancel.cancel();
        within("pipeline stops", self.task).await.unwrap();
    }
}

impl Bed {
    pub(crate) async fn start(partitions: usize) -> Self {
        Self::start_with_queue(partitions, QueueSpec::new("retries")).await
    }

    pub(crate) async fn start_with_queue(partitions: usize, queue: QueueSpec) -> Self {
        Self::start_with_queues(partitions, vec![queue]).await
    }

    /// A bed whose Service Bus namespace has these queues (the first is usually `retries`).
    pub(crate) async fn start_with_queues(partitions: usize, queues: Vec<QueueSpec>) -> Self {
        let eh = EventHubsEmulator::start(EventHubsConfig {
            hubs: vec![HubSpec::new("hub", partitions)],
            ..Default::default()
        })
        .await
        .unwrap();
        let sb = ServiceBusEmulator::start(ServiceBusConfig {
            queues,
            ..Default::default()
        })
        .await
        .unwrap();
        let blob = BlobEmulator::start(BlobConfig::default()).await.unwrap();
        let cs = conn(&eh);
        Self { eh, sb, blob, cs }
    }

    pub(crate) fn records(&self) -> Arc<dyn RecordStore> {
        Arc::new(
            BlobRecordStore::new(
                &self.blob.container_url("hubguard"),
                None,
                Duration::from_secs(3),
            )
            .unwrap(),
        )
    }

    pub(crate) fn checkpoint_store(&self) -> Arc<dyn CheckpointStore + Send + Sync> {
        hubguard::azure::BlobCheckpointStore::new(Arc::new(self.container()))
    }

    /// The blob container the checkpoints and the ledger live in, for raw access.
    pub(crate) fn container(&self) -> hubguard::azure::BlobContainer {
        hubguard::azure::BlobContainer::new(
            &self.blob.container_url("hubguard"),
            None,
            Duration::from_secs(3),
        )
        .unwrap()
    }

    /// A settler on the bed's ledger and retry queue, outside any pipeline (as the CLI uses).
    pub(crate) fn settler(&self, policy: RetryPolicy) -> Settler {
        let sb_cs: ConnectionString = self.sb.connection_string().parse().unwrap();
        let queue = ServiceBusRetryQueue::new(
            &sb_cs,
            "retries",
            hubguard::azure::retry_queue::ServiceBusOptions::default(),
        )
        .unwrap();
        Settler::new(
            self.ledger(),
            Arc::new(queue),
            Policies {
                default: policy,
                by_type: HashMap::new(),
            },
        )
    }

    /// The clock the pipeline and the Service Bus emulator share (tests may advance it).
    pub(crate) fn clock(&self) -> Arc<hubguard::clock::Clock> {
        self.sb.clock().clone()
    }

    /// The breaker record of `downstream` as stored (`None`: never opened).
    pub(crate) async fn breaker_record(
        &self,
        downstream: &str,
    ) -> Option<hubguard::breaker::BreakerRecord> {
        self.records()
            .read(&hubguard::breaker::record_name(downstream))
            .await
            .unwrap()
            .map(|r| serde_json::from_slice(&r.body).unwrap())
    }

    pub(crate) fn ledger(&self) -> Ledger {
        Ledger::new(self.records(), "hub", "$Default")
    }

    /// The bed's services wired as a pipeline of `owner` would be: hub `hub`, queue
    /// `retries`, container `hubguard`, short deadlines and the shared clock; no breaker.
    pub(crate) fn wiring(&self, owner: &str) -> Wiring {
        self.wiring_with(owner, "$Default", self.clock())
    }

    /// [`wiring`](Self::wiring) for another consumer group of the hub: another deployment
    /// on the same queue and container.
    pub(crate) fn wiring_in(&self, owner: &str, consumer_group: &str) -> Wiring {
        self.wiring_with(owner, consumer_group, self.clock())
    }

    /// [`wiring`](Self::wiring) with the pipeline on a clock of its own (so a test can step
    /// the Service Bus emulator's clock alone).
    pub(crate) fn wiring_on(&self, owner: &str, clock: Arc<hubguard::clock::Clock>) -> Wiring {
        self.wiring_with(owner, "$Default", clock)
    }

    fn wiring_with(
        &self,
        owner: &str,
        consumer_group: &str,
        clock: Arc<hubguard::clock::Clock>,
    ) -> Wiring {
        Wiring::new(
            EventHubsTarget::with_connection_string(&self.cs, "hub", consumer_group),
            StorageAccess::url(&self.blob.container_url("hubguard")),
            ServiceBusAccess::ConnectionString(self.sb.connection_string().parse().unwrap()),
        )
        .options(PipelineOptions {
            owner_id: owner.into(),
            update_interval: Duration::from_millis(500),
            ownership_expiration: Duration::from_secs(3),
            checkpoint_every_events: 1000,
            checkpoint_every: Duration::from_millis(300),
            deadline: Duration::from_secs(3),
            settle_backoff_max: Duration::from_millis(500),
            retry_receive_wait: Duration::from_secs(1),
            reconnect_base: Duration::from_millis(200),
            watchdog_interval: Duration::from_millis(500),
            clock,
            ..Default::default()
        })
    }

    pub(crate) fn parts(
        &self,
        handler: Arc<dyn Handler>,
        policy: RetryPolicy,
        owner: &str,
    ) -> PipelineParts {
        self.wiring(owner).policy(policy).parts(handler).unwrap()
    }

    pub(crate) fn run(parts: PipelineParts) -> Running {
        Self::run_pipeline(Pipeline::new(parts))
    }

    /// Runs a pipeline built by the test (to keep a handle such as its backlog).
    pub(crate) fn run_pipeline(pipeline: Pipeline) -> Running {
        let health = pipeline.health();
        let cancel = CancellationToken::new();
        let c = cancel.clone();
        let task = tokio::spawn(async move {
            pipeline.run(c).await.unwrap();
        });
        Running {
            cancel,
            health,
            task,
            _log: crate::test_log::TestLog::in_process(),
        }
    }

    /// Sends events with `ce_id` = key and the given body to a partition.
    pub(crate) async fn send(&self, partition: usize, events: &[(&str, &str)]) {
        let prod = producer(&self.cs, "hub").await;
        let batch = within(
            "batch",
            prod.create_batch(Some(EventDataBatchOptions {
                partition_id: Some(partition.to_string()),
                ..Default::default()
            })),
        )
        .await
        .unwrap();
        for (key, body) in events {
            let ev = EventData::builder()
                .with_body(body.as_bytes().to_vec())
                .add_property("ce_id".into(), AmqpSimpleValue::String(key.to_string()))
                .add_property(
                    "ce_type".into(),
                    AmqpSimpleValue::String("test.event".into()),
                )
                .build();
            assert!(batch.try_add_event_data(ev, None).unwrap());
        }
        within("send", prod.send_batch(batch, None)).await.unwrap();
        close_producer(prod).await;
    }

    /// Sends one event on its own (not in a batch: the 0.15 SDK counts a batch's first
    /// event twice, so an event near 1 MB only goes out alone).
    pub(crate) async fn send_one(&self, partition: usize, key: &str, body: &str) {
        let prod = producer(&self.cs, "hub").await;
        let ev = EventData::builder()
            .with_body(body.as_bytes().to_vec())
            .add_property("ce_id".into(), AmqpSimpleValue::String(key.to_string()))
            .add_property(
                "ce_type".into(),
                AmqpSimpleValue::String("test.event".into()),
            )
            .build();
        within(
            "send one",
            prod.send_event(
                ev,
                Some(azure_messaging_eventhubs::SendEventOptions {
                    partition_id: Some(partition.to_string()),
                }),
            ),
        )
        .await
        .unwrap();
        close_producer(prod).await;
    }

    /// The checkpointed sequence number of a partition, if any.
    pub(crate) async fn checkpoint_of(&self, partition: &str) -> Option<i64> {
        let cps = self
            .checkpoint_store()
            .list_checkpoints(&self.cs.host, "hub", "$Default")
            .await
            .unwrap();
        cps.into_iter()
            .find(|c| c.partition_id == partition)
            .and_then(|c| c.sequence_number)
    }
}

/// Waits (bounded) until `cond` holds, re-checking on every health change and every
/// [`POLL`]; on a timeout, the failure shows the health report last seen.
pub(crate) async fn wait_for<F, Fut>(what: &str, health: &Health, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    Wait::new(what, limit)
        .woken_by(changes(health.subscribe()))
        .until(|| {
            let holds = cond();
            async move {
                if holds.await {
                    Ok(())
                } else {
                    Err(Text(health.report().to_string()))
                }
            }
        })
        .await
}

/// Waits until `n` more settlements have failed: the evidence a "nothing happened while
/// held" check needs that the code under test had its chances (a fixed sleep proves nothing
/// on a slow machine). A held event's settlement is tried again inside its partition's task
/// (after 200 ms, doubling up to `settle_backoff_max`: 500 ms on the bed), beside that task's
/// checkpoint interval (300 ms) and its reading; so `n` more failures of one held event mean
/// the task ran through `n - 1` backoffs, several checkpoint intervals for `n` of 4. Every
/// settlement failure of the pipeline counts: use it while the held events are the only
/// ones failing (with Service Bus down, the retry loop receives nothing to fail on).
pub(crate) async fn settle_failures(health: &Health, n: u64) {
    let failures = || health.snapshot().settle_failures;
    let from = failures();
    eventually(&format!("{n} more settlement failures"), LIMIT_HELD, || {
        std::future::ready(
            seen(failures() - from, |f| *f >= n)
                .map_err(|f| Text(format!("{f} failures; health {}", health.report()))),
        )
    })
    .await;
}

/// How long [`settle_failures`] waits at most.
const LIMIT_HELD: Duration = Duration::from_secs(60);

/// The bed's checkpoint store, with a fault a test chooses: a partition that can never be
/// claimed, or checkpoints that never get written (a process that "crashes" before its first).
pub(crate) struct ShapedStore {
    /// The real store.
    pub inner: Arc<dyn CheckpointStore + Send + Sync>,
    /// Claims of this partition are dropped.
    pub unclaimable: Option<&'static str>,
    /// Every checkpoint write fails.
    pub no_checkpoints: bool,
}

#[async_trait]
impl CheckpointStore for ShapedStore {
    async fn claim_ownership(
        &self,
        o: &[azure_messaging_eventhubs::models::Ownership],
    ) -> azure_core::Result<Vec<azure_messaging_eventhubs::models::Ownership>> {
        let wanted: Vec<_> = o
            .iter()
            .filter(|o| Some(o.partition_id.as_str()) != self.unclaimable)
            .cloned()
            .collect();
        self.inner.claim_ownership(&wanted).await
    }
    async fn list_checkpoints(
        &self,
        n: &str,
        h: &str,
        c: &str,
    ) -> azure_core::Result<Vec<azure_messaging_eventhubs::models::Checkpoint>> {
        self.inner.list_checkpoints(n, h, c).await
    }
    async fn list_ownerships(
        &self,
        n: &str,
        h: &str,
        c: &str,
    ) -> azure_core::Result<Vec<azure_messaging_eventhubs::models::Ownership>> {
        self.inner.list_ownerships(n, h, c).await
    }
    async fn update_checkpoint(
        &self,
        c: azure_messaging_eventhubs::models::Checkpoint,
    ) -> azure_core::Result<()> {
        if self.no_checkpoints {
            return Err(azure_core::Error::with_message(
                azure_core::error::ErrorKind::Other,
                "crashed before checkpointing",
            ));
        }
        self.inner.update_checkpoint(c).await
    }
}

/// Closes a test's producer once its events are sent. The events are what the tests
/// depend on, and `send_batch` returned only once the emulator accepted them; a failing
/// close (the 0.15 SDK's AMQP engine answers "Illegal local state" now and then on a loaded
/// machine) is logged, not a failure of the test — `eventhubs_sdk` holds close itself to
/// account. A close that hangs still fails (`within`).
pub(crate) async fn close_producer(prod: azure_messaging_eventhubs::ProducerClient) {
    if let Err(e) = within("close producer", prod.close()).await {
        eprintln!("closing a test producer after its send failed (ignored): {e:?}");
    }
}
