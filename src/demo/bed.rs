//! The demo's bed: the emulators (Event Hubs, Service Bus, blob storage), the webhook
//! receiver that fails as the options say, the hubguard replicas with their
//! [`PipelineParts`] (policies scaled down to fit a minute), and readers of what they left
//! in storage (the ledger, the breaker record).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::DemoArgs;
use crate::azure::{BlobRecordStore, ConnectionString};
use crate::breaker::BreakerRecord;
use crate::emulator::blob::{BlobConfig, BlobEmulator};
use crate::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use crate::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use crate::emulator::webhook::{Behaviour, WebhookReceiver};
use crate::handler::webhook::{WebhookConfig, WebhookHandler};
use crate::handler::Handler as _;
use crate::ledger::Ledger;
use crate::pipeline::health::Health;
use crate::pipeline::{EventHubsTarget, Pipeline, PipelineOptions, PipelineParts};
use crate::policy::{Curve, RetryPolicy};
use crate::wiring::{ServiceBusAccess, StorageAccess, Wiring};

/// The demo's hub.
pub(super) const HUB: &str = "demo";
/// The Service Bus queue the retries wait in.
pub(super) const QUEUE: &str = "retries";
/// The blob container of checkpoints, ownership, the ledger and the breaker.
const CONTAINER: &str = "hubguard";

fn mix(seed: u64, key: &str, salt: u64) -> u64 {
    // FNV-1a over the key, then a splitmix finaliser: deterministic per (seed, key, salt).
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in key.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// How the downstream answers: per key (and seed), a `permanent` share is refused for good
/// (400) and a `transient` share fails its first 1–3 deliveries (503); the rest succeed.
fn behaviour(seed: u64, transient: f64, permanent: f64) -> Behaviour {
    Arc::new(move |key: &str, before: u32| {
        if unit(mix(seed, key, 1)) < permanent {
            return 400;
        }
        if unit(mix(seed, key, 2)) < transient && before < 1 + (mix(seed, key, 3) % 3) as u32 {
            return 503;
        }
        200
    })
}

/// One hubguard replica running in a task.
pub(super) struct Replica {
    /// Its owner id.
    pub(super) owner: String,
    cancel: CancellationToken,
    crash: CancellationToken,
    health: Arc<Health>,
    task: tokio::task::JoinHandle<()>,
}

impl Replica {
    /// Its health (partitions held, counters).
    pub(super) fn health(&self) -> &Health {
        &self.health
    }

    /// Kills it: no final checkpoint, no ownership release. Returns its health.
    pub(super) async fn crash(self) -> Arc<Health> {
        self.crash.cancel();
        let _ = self.task.await;
        self.health
    }

    /// Stops it as a shutdown would (waiting up to 30 s). Returns its health.
    pub(super) async fn stop(self) -> Arc<Health> {
        self.cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
        self.health
    }
}

/// The emulators and the downstream, and how replicas are made.
pub(super) struct Bed {
    /// Event Hubs.
    pub(super) eh: EventHubsEmulator,
    /// Service Bus (the retry queue).
    pub(super) sb: ServiceBusEmulator,
    /// Blob storage (checkpoints, ownership, the ledger, the breaker).
    pub(super) blob: BlobEmulator,
    /// The downstream.
    pub(super) hook: WebhookReceiver,
    max_in_flight: usize,
    batch_max: usize,
}

impl Bed {
    /// Starts the emulators and the downstream as `args` say, recording from the start what
    /// the independent checks read (blob writes, retry messages accepted).
    pub(super) async fn start(args: &DemoArgs) -> anyhow::Result<Self> {
        let behaviour = behaviour(args.seed, args.transient_rate, args.permanent_rate);
        let local = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let mut queue = QueueSpec::new(QUEUE);
        queue.lock_duration = Duration::from_secs(5);
        let bed = Bed {
            eh: EventHubsEmulator::start(EventHubsConfig {
                hubs: vec![HubSpec::new(HUB, args.partitions)],
                ..Default::default()
            })
            .await?,
            sb: ServiceBusEmulator::start(ServiceBusConfig {
                queues: vec![queue],
                ..Default::default()
            })
            .await?,
            blob: BlobEmulator::start(BlobConfig::default()).await?,
            hook: WebhookReceiver::start_with(local, behaviour).await?,
            max_in_flight: args.max_in_flight,
            batch_max: usize::from(args.batch_max),
        };
        if let Some(p) = &args.latency {
            bed.eh.faults().set_latency(p.eventhubs, 1);
            bed.sb.faults().set_latency(p.servicebus, 2);
            bed.blob.faults().set_latency(p.blob, 3);
            bed.hook.faults().set_latency(p.webhook, 4);
        }
        bed.blob.store().record_writes();
        if let Some(q) = bed.sb.queue(QUEUE) {
            q.record_accepted();
        }
        Ok(bed)
    }

    /// The Event Hubs connection string.
    pub(super) fn eventhubs(&self) -> anyhow::Result<ConnectionString> {
        Ok(self.eh.connection_string().parse()?)
    }

    /// The handler every replica calls the downstream with.
    fn webhook(&self) -> anyhow::Result<WebhookHandler> {
        WebhookHandler::new(WebhookConfig {
            url: self.hook.url(),
            timeout_ms: 2000,
            conflict_is_permanent: true,
            batch_max: self.batch_max,
            ..Default::default()
        })
        .map_err(|e| anyhow::anyhow!(e))
    }

    fn parts(&self, owner: &str) -> anyhow::Result<PipelineParts> {
        let cs = self.eventhubs()?;
        let policy = RetryPolicy {
            name: "demo".into(),
            curve: Curve::Exponential,
            base_s: 1,
            floor_s: 1,
            cap_s: 4,
            max_attempts: 8,
            max_age_s: None,
        };
        Ok(Wiring::new(
            EventHubsTarget::with_connection_string(&cs, HUB, "$Default"),
            StorageAccess::url(&self.blob.container_url(CONTAINER)),
            ServiceBusAccess::ConnectionString(self.sb.connection_string().parse()?),
        )
        .queue(QUEUE)
        .policy(policy)
        .breaker(crate::breaker::BreakerConfig {
            enabled: true,
            consecutive_failures: 12,
            failure_ratio: None,
            ratio_window: 20,
            open_ms: 3000,
            spread_ms: 2000,
            probe_timeout_ms: 3000,
            ..Default::default()
        })
        .options(PipelineOptions {
            owner_id: owner.into(),
            update_interval: Duration::from_millis(500),
            ownership_expiration: Duration::from_secs(3),
            checkpoint_every_events: 50,
            checkpoint_every: Duration::from_millis(500),
            max_in_flight: self.max_in_flight,
            deadline: Duration::from_secs(3),
            settle_backoff_max: Duration::from_millis(500),
            retry_concurrency: 16,
            retry_receive_wait: Duration::from_secs(1),
            reconnect_base: Duration::from_millis(200),
            watchdog_interval: Duration::from_secs(1),
            ..Default::default()
        })
        .parts(self.webhook()?.into_handler())?)
    }

    /// Starts replica `owner`.
    pub(super) fn start_replica(&self, owner: &str) -> anyhow::Result<Replica> {
        let pipeline = Pipeline::new(self.parts(owner)?);
        let health = pipeline.health();
        let (cancel, crash) = (CancellationToken::new(), CancellationToken::new());
        let (c, k) = (cancel.clone(), crash.clone());
        let task = tokio::spawn(async move {
            let _ = pipeline.run_until(c, k).await;
        });
        Ok(Replica {
            owner: owner.into(),
            cancel,
            crash,
            health,
            task,
        })
    }

    /// The record store the replicas share, for reading.
    fn records(&self) -> anyhow::Result<BlobRecordStore> {
        Ok(BlobRecordStore::new(
            &self.blob.container_url(CONTAINER),
            None,
            Duration::from_secs(5),
        )?)
    }

    /// The ledger the replicas write.
    pub(super) fn ledger(&self) -> anyhow::Result<Ledger> {
        Ok(Ledger::new(Arc::new(self.records()?), HUB, "$Default"))
    }

    /// The downstream's circuit breaker record, by the name the replicas give it (`None`:
    /// it never opened).
    pub(super) async fn breaker(&self) -> anyhow::Result<Option<BreakerRecord>> {
        let downstream = self.webhook()?.downstream();
        Ok(crate::breaker::read(&self.records()?, &downstream).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_choice_is_deterministic_and_near_the_rates() {
        let n = 10_000;
        let perm = (0..n)
            .filter(|i| unit(mix(42, &format!("demo-{i:05}"), 1)) < 0.02)
            .count();
        assert!((150..250).contains(&perm), "{perm}");
        assert_eq!(mix(1, "a", 2), mix(1, "a", 2));
        assert_ne!(mix(1, "a", 2), mix(2, "a", 2));
    }

    #[tokio::test]
    async fn the_breaker_is_read_by_the_name_the_replicas_give_it() {
        let args = DemoArgs {
            partitions: 1,
            ..test_args()
        };
        let bed = Bed::start(&args).await.unwrap();
        assert_eq!(bed.breaker().await.unwrap(), None);
        // The name the demo used to derive from the receiver's URL.
        let name = bed
            .hook
            .url()
            .trim_start_matches("http://")
            .trim_end_matches("/events")
            .to_string();
        let record = BreakerRecord {
            opens: 2,
            reopens: 1,
            ..Default::default()
        };
        crate::azure::RecordStore::create(
            &bed.records().unwrap(),
            &crate::breaker::record_name(&name),
            serde_json::to_vec(&record).unwrap().into(),
        )
        .await
        .unwrap();
        assert_eq!(bed.breaker().await.unwrap(), Some(record));
    }

    fn test_args() -> DemoArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            demo: DemoArgs,
        }
        Cli::parse_from(["demo"]).demo
    }
}
