//! `hubguard demo`: everything in one process on the embedded emulators — Event Hubs, Service
//! Bus, Blob storage, a webhook receiver that misbehaves as told, a producer, and hubguard
//! replicas — with policies scaled down so the whole story fits in about a minute: transient
//! and permanent failures, a downstream outage, a Service Bus outage (a held partition),
//! replica crashes. Then it verifies, independently of hubguard's own counters, that nothing
//! was lost: every event the producer sent was delivered (the receiver saw a 2xx) or
//! dead-lettered (the ledger says so).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
use azure_messaging_eventhubs::{EventDataBatchOptions, ProducerClient};
use clap::builder::ArgPredicate;
use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::azure::ConnectionString;
use crate::emulator::blob::{BlobConfig, BlobEmulator};
use crate::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use crate::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use crate::emulator::webhook::WebhookReceiver;
use crate::handler::webhook::{WebhookConfig, WebhookHandler};
use crate::ledger::{Ledger, State};
use crate::pipeline::health::Health;
use crate::pipeline::settle::Policies;
use crate::pipeline::{EventHubsTarget, Pipeline, PipelineOptions, PipelineParts};
use crate::policy::{Curve, RetryPolicy};

pub mod verify;

/// A `START:DURATION` window, e.g. `8s:10s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// When it starts, after the demo starts.
    pub start: Duration,
    /// How long it lasts.
    pub duration: Duration,
}

/// Parses `500ms`, `10s`, `2m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(
        s.find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len()),
    );
    let n: f64 = num
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (use e.g. 500ms, 10s, 2m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        _ => return Err(format!("unknown unit in {s:?} (use ms, s or m)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

impl std::str::FromStr for Window {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, b) = s
            .split_once(':')
            .ok_or_else(|| format!("expected START:DURATION, e.g. 8s:10s, got {s:?}"))?;
        Ok(Self {
            start: parse_duration(a)?,
            duration: parse_duration(b)?,
        })
    }
}

/// Options of `hubguard demo`. `--chaos` switches every option left unset to the chaos
/// soak's value (100,000 events, 8 partitions, 3 replicas, two Service Bus outages, a blob
/// storage outage, a crash every 20 s, `max_in_flight` 8).
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The chaos soak: defaults for a long run under sustained faults (explicit flags win).
    #[arg(long)]
    pub chaos: bool,
    /// Events to produce.
    #[arg(long, default_value_t = 400, default_value_if("chaos", ArgPredicate::Equals("true".into()), "100000"))]
    pub events: usize,
    /// Spread the producer's sends over this long (events keep arriving during the outages).
    #[arg(long, default_value = "30s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "90s"), value_parser = parse_duration)]
    pub produce_over: Duration,
    /// Partitions of the demo hub.
    #[arg(long, default_value_t = 4, default_value_if("chaos", ArgPredicate::Equals("true".into()), "8"))]
    pub partitions: usize,
    /// Share of events whose first 1–3 deliveries fail transiently (503).
    #[arg(long, default_value_t = 0.2)]
    pub transient_rate: f64,
    /// Share of events the downstream refuses for good (400): dead-lettered at once.
    #[arg(long, default_value_t = 0.02)]
    pub permanent_rate: f64,
    /// The downstream answers 503 to everything in this window (`none` for no outage).
    #[arg(long, default_value = "6s:8s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "15s:10s"))]
    pub downstream_outage: Outage,
    /// Service Bus answers 503 in these windows (comma separated): partitions hold.
    #[arg(long, value_delimiter = ',', default_value = "20s:6s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "35s:8s,70s:6s"))]
    pub servicebus_outage: Vec<Outage>,
    /// Blob storage (checkpoints, ownership, the ledger) answers 503 in these windows.
    #[arg(long, value_delimiter = ',', default_value = "none", default_value_if("chaos", ArgPredicate::Equals("true".into()), "50s:6s"))]
    pub blob_outage: Vec<Outage>,
    /// Crash a replica (no final checkpoint, no ownership release) this often and start it
    /// again (`none` for no crashes).
    #[arg(long, default_value = "15s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "20s"))]
    pub crash_every: Every,
    /// hubguard replicas sharing the partitions.
    #[arg(long, default_value_t = 2, default_value_if("chaos", ArgPredicate::Equals("true".into()), "3"))]
    pub replicas: usize,
    /// Events of one partition handled at once (`processor.max_in_flight`).
    #[arg(long, default_value_t = 1, default_value_if("chaos", ArgPredicate::Equals("true".into()), "8"))]
    pub max_in_flight: usize,
    /// Seed for which events fail.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Give up (and fail) after this long.
    #[arg(long, default_value = "240s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "1200s"), value_parser = parse_duration)]
    pub timeout: Duration,
    /// Print one JSON line at the end instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The windows as text.
pub fn windows_text(w: &[Outage]) -> String {
    let active: Vec<String> = w
        .iter()
        .filter(|o| o.0.is_some())
        .map(|o| o.to_string())
        .collect();
    if active.is_empty() {
        "none".into()
    } else {
        active.join(", ")
    }
}

/// An outage window, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage(pub Option<Window>);

impl std::fmt::Display for Outage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(w) => write!(f, "from {:?} for {:?}", w.start, w.duration),
            None => f.write_str("none"),
        }
    }
}

impl std::fmt::Display for Every {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(d) => write!(f, "every {d:?}"),
            None => f.write_str("none"),
        }
    }
}

impl std::str::FromStr for Outage {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "none" {
            Ok(Self(None))
        } else {
            s.parse().map(|w| Self(Some(w)))
        }
    }
}

/// A period, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Every(pub Option<Duration>);

impl std::str::FromStr for Every {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "none" {
            Ok(Self(None))
        } else {
            parse_duration(s).map(|d| Self(Some(d)))
        }
    }
}

/// What the demo found.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// Events the producer sent.
    pub events: usize,
    /// Events the receiver accepted at least once.
    pub delivered: usize,
    /// Events the ledger records as dead-lettered (and never delivered).
    pub dead_lettered: usize,
    /// Events neither delivered nor dead-lettered.
    pub lost: usize,
    /// Deliveries beyond the first (at-least-once duplicates).
    pub duplicate_deliveries: usize,
    /// Retry messages Service Bus accepted (duplicates dropped by detection excluded).
    pub retries_scheduled: u64,
    /// The highest attempt number any event reached.
    pub max_attempt: u32,
    /// How often the downstream's circuit breaker opened from closed.
    pub breaker_opens: u64,
    /// How often a failed half-open probe re-opened it.
    pub breaker_reopens: u64,
    /// Checkpoints written by all replicas.
    pub checkpoint_writes: u64,
    /// Replica crashes.
    pub crashes: usize,
    /// Duplicate deliveries per event.
    pub duplicate_ratio: f64,
    /// The independent checks (checkpoints, attempts, doubles, unsettled partitions).
    #[serde(flatten)]
    pub checks: verify::Verdict,
    /// `max_in_flight` of every replica.
    pub max_in_flight: usize,
    /// Wall time.
    pub elapsed_ms: u64,
}

impl Report {
    /// Whether nothing was lost and every check passed.
    pub fn clean(&self) -> bool {
        self.lost == 0 && self.checks.clean()
    }
}

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

struct Replica {
    owner: String,
    cancel: CancellationToken,
    crash: CancellationToken,
    health: Arc<Health>,
    task: tokio::task::JoinHandle<()>,
}

struct Bed {
    eh: EventHubsEmulator,
    sb: ServiceBusEmulator,
    blob: BlobEmulator,
    hook: WebhookReceiver,
    max_in_flight: usize,
}

const HUB: &str = "demo";

impl Bed {
    fn parts(&self, owner: &str) -> anyhow::Result<PipelineParts> {
        let cs: ConnectionString = self.eh.connection_string().parse()?;
        let sb: ConnectionString = self.sb.connection_string().parse()?;
        let container = self.blob.container_url("hubguard");
        let deadline = Duration::from_secs(3);
        let policy = RetryPolicy {
            name: "demo".into(),
            curve: Curve::Exponential,
            base_s: 1,
            floor_s: 1,
            cap_s: 4,
            max_attempts: 8,
            max_age_s: None,
        };
        let records = Arc::new(crate::azure::BlobRecordStore::new(
            &container, None, deadline,
        )?);
        Ok(PipelineParts {
            eventhubs: EventHubsTarget {
                namespace: cs.namespace(),
                custom_endpoint: cs.custom_endpoint(),
                hub: HUB.into(),
                consumer_group: "$Default".into(),
                auth: crate::azure::EventHubsAuth::ConnectionString(cs.clone()),
            },
            checkpoint_store: crate::azure::BlobCheckpointStore::new(records.container()),
            records,
            queue: Arc::new(crate::azure::ServiceBusRetryQueue::new(
                &sb,
                "retries",
                crate::azure::retry_queue::ServiceBusOptions { deadline },
            )?),
            handler: Arc::new(
                WebhookHandler::new(WebhookConfig {
                    url: self.hook.url(),
                    timeout_ms: 2000,
                    conflict_is_permanent: true,
                    ..Default::default()
                })
                .map_err(|e| anyhow::anyhow!(e))?,
            ),
            policies: Policies {
                default: policy,
                by_type: Default::default(),
            },
            identity: crate::event::IdentityConfig::default(),
            breaker: Some(crate::breaker::BreakerConfig {
                enabled: true,
                consecutive_failures: 12,
                failure_ratio: None,
                ratio_window: 20,
                open_ms: 3000,
                spread_ms: 2000,
                probe_timeout_ms: 3000,
            }),
            options: PipelineOptions {
                owner_id: owner.into(),
                update_interval: Duration::from_millis(500),
                ownership_expiration: Duration::from_secs(3),
                checkpoint_every_events: 50,
                checkpoint_every: Duration::from_millis(500),
                max_in_flight: self.max_in_flight,
                deadline,
                settle_backoff_max: Duration::from_millis(500),
                retry_concurrency: 16,
                retry_receive_wait: Duration::from_secs(1),
                reconnect_base: Duration::from_millis(200),
                watchdog_interval: Duration::from_secs(1),
                ..Default::default()
            },
        })
    }

    fn start_replica(&self, owner: &str) -> anyhow::Result<Replica> {
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

    fn ledger(&self) -> anyhow::Result<Ledger> {
        let store = crate::azure::BlobRecordStore::new(
            &self.blob.container_url("hubguard"),
            None,
            Duration::from_secs(5),
        )?;
        Ok(Ledger::new(Arc::new(store), HUB, "$Default"))
    }
}

async fn produce(
    cs: &ConnectionString,
    events: usize,
    partitions: usize,
    over: Duration,
) -> anyhow::Result<Vec<String>> {
    let producer = cs.open_producer(ProducerClient::builder(), HUB).await?;
    let mut keys = Vec::with_capacity(events);
    let rounds = 10usize;
    let per_round = events.div_ceil(rounds);
    let started = Instant::now();
    for round in 0..rounds {
        for p in 0..partitions {
            let batch = producer
                .create_batch(Some(EventDataBatchOptions {
                    partition_id: Some(p.to_string()),
                    ..Default::default()
                }))
                .await?;
            let mut added = 0;
            while keys.len() < events && added < per_round.div_ceil(partitions) {
                let key = format!("demo-{:05}", keys.len());
                let kind = if keys.len() % 2 == 0 {
                    "order.created"
                } else {
                    "campaign.fired"
                };
                let ev = EventData::builder()
                    .with_body(format!("{{\"id\":\"{key}\"}}").into_bytes())
                    .with_content_type("application/json".into())
                    .add_property("ce_id".into(), AmqpSimpleValue::String(key.clone()))
                    .add_property("ce_type".into(), AmqpSimpleValue::String(kind.into()))
                    .build();
                if !batch.try_add_event_data(ev, None)? {
                    break;
                }
                keys.push(key);
                added += 1;
            }
            if added > 0 {
                tokio::time::timeout(Duration::from_secs(10), producer.send_batch(batch, None))
                    .await
                    .context("sending to Event Hubs timed out")??;
            }
        }
        let next = over.mul_f64((round + 1) as f64 / rounds as f64);
        tokio::time::sleep(next.saturating_sub(started.elapsed())).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), producer.close()).await;
    Ok(keys)
}

/// Runs the demo and returns its report; `progress` receives one line per second.
pub async fn run(args: &DemoArgs, mut progress: impl FnMut(&str)) -> anyhow::Result<Report> {
    if args.events == 0 || args.partitions == 0 || args.replicas == 0 || args.max_in_flight == 0 {
        bail!("--events, --partitions, --replicas and --max-in-flight must be positive");
    }
    if !(0.0..=1.0).contains(&args.transient_rate) || !(0.0..=1.0).contains(&args.permanent_rate) {
        bail!("--transient-rate and --permanent-rate must be between 0 and 1");
    }
    let started = Instant::now();
    let seed = args.seed;
    let (transient, permanent) = (args.transient_rate, args.permanent_rate);
    let behaviour: crate::emulator::webhook::Behaviour = Arc::new(move |key: &str, before: u32| {
        if unit(mix(seed, key, 1)) < permanent {
            return 400;
        }
        if unit(mix(seed, key, 2)) < transient && before < 1 + (mix(seed, key, 3) % 3) as u32 {
            return 503;
        }
        200
    });
    let local = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let mut queue = QueueSpec::new("retries");
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
    };
    // The independent checks read what the emulators recorded from the start.
    bed.blob.store().record_writes();
    if let Some(q) = bed.sb.queue("retries") {
        q.record_accepted();
    }
    let mut replicas: Vec<Replica> = (0..args.replicas)
        .map(|i| bed.start_replica(&format!("replica-{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut retired: Vec<Arc<Health>> = Vec::new();

    let cs: ConnectionString = bed.eh.connection_string().parse()?;
    let producer = tokio::spawn({
        let (events, partitions, over) = (args.events, args.partitions, args.produce_over);
        async move { produce(&cs, events, partitions, over).await }
    });
    let ledger = bed.ledger()?;
    let mut keys: Option<Vec<String>> = None;
    let mut producer = Some(producer);
    let mut downstream_done = args.downstream_outage.0.is_none();
    let mut servicebus_started = vec![false; args.servicebus_outage.len()];
    let mut blob_started = vec![false; args.blob_outage.len()];
    let mut next_crash = args.crash_every.0;
    let mut crashes = 0usize;
    let tty = std::io::stderr().is_terminal();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t = started.elapsed();
        if let Some(w) = args
            .downstream_outage
            .0
            .filter(|w| !downstream_done && t >= w.start)
        {
            bed.hook.faults().error_status_for(503, w.duration);
            progress(&format!(
                "t={:>3}s  downstream outage: the webhook answers 503 for {:?}",
                t.as_secs(),
                w.duration
            ));
            downstream_done = true;
        }
        start_outages(
            t,
            &args.servicebus_outage,
            &mut servicebus_started,
            bed.sb.faults(),
            "Service Bus outage",
            "partitions with failures will hold",
            &mut progress,
        );
        start_outages(
            t,
            &args.blob_outage,
            &mut blob_started,
            bed.blob.faults(),
            "blob storage outage",
            "checkpoints, ownership and the ledger fail",
            &mut progress,
        );
        if let Some(every) = next_crash.filter(|n| t >= *n) {
            let i = crashes % replicas.len();
            let victim = replicas.remove(i);
            victim.crash.cancel();
            let _ = victim.task.await;
            retired.push(victim.health.clone());
            progress(&format!("t={:>3}s  crash: {} killed (no final checkpoint, no ownership release); restarting it", t.as_secs(), victim.owner));
            replicas.insert(i, bed.start_replica(&victim.owner)?);
            crashes += 1;
            next_crash = args.crash_every.0.map(|e| every + e);
        }
        if producer.as_ref().is_some_and(|p| p.is_finished()) {
            keys = Some(producer.take().context("producer")?.await??);
        }
        let delivered = bed.hook.deliveries();
        let dead: BTreeSet<String> = ledger
            .dead_letter_keys()
            .await
            .unwrap_or_default()
            .into_iter()
            .collect();
        let sb = bed.sb.counters("retries").unwrap_or_default();
        let held: BTreeMap<String, String> = replicas
            .iter()
            .flat_map(|r| {
                r.health
                    .held()
                    .into_iter()
                    .map(|(p, h)| (p, h.cause.label().replace('_', " ")))
            })
            .collect();
        let produced = keys.as_ref().map_or(0, Vec::len);
        let line = format!(
            "t={:>3}s  delivered {}/{}  retrying {}  dead-lettered {}  held partitions {}{}",
            t.as_secs(),
            delivered.len(),
            if produced > 0 { produced } else { args.events },
            sb.scheduled + sb.active + sb.locked,
            dead.len(),
            held.len(),
            if held.is_empty() {
                String::new()
            } else {
                format!(
                    " ({})",
                    held.values()
                        .cloned()
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        if tty && !args.json {
            let done = delivered.len() + dead.len();
            let width = 30;
            let filled = (done * width / args.events.max(1)).min(width);
            eprint!(
                "\r[{}{}] {line}   ",
                "#".repeat(filled),
                ".".repeat(width - filled)
            );
            let _ = std::io::stderr().flush();
        } else {
            progress(&line);
        }
        if let Some(keys) = &keys {
            let settled = keys
                .iter()
                .all(|k| delivered.contains_key(k) || dead.contains(k));
            let started =
                |v: &[bool], w: &[Outage]| v.iter().zip(w).all(|(s, w)| *s || w.0.is_none());
            let outages_over = downstream_done
                && started(&servicebus_started, &args.servicebus_outage)
                && started(&blob_started, &args.blob_outage)
                && bed.sb.faults().error_status().is_none()
                && bed.blob.faults().error_status().is_none()
                && bed.hook.faults().error_status().is_none();
            if settled
                && outages_over
                && sb.scheduled + sb.active + sb.locked == 0
                && held.is_empty()
            {
                break;
            }
        }
        if t > args.timeout {
            break;
        }
    }
    if tty && !args.json {
        eprintln!();
    }
    for r in replicas.drain(..) {
        r.cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), r.task).await;
        retired.push(r.health);
    }
    let keys = match keys {
        Some(k) => k,
        None => bail!("the producer did not finish"),
    };
    let delivered = bed.hook.deliveries();
    let dead: BTreeSet<String> = ledger.dead_letter_keys().await?.into_iter().collect();
    let produced: BTreeSet<&String> = keys.iter().collect();
    let delivered_n = produced
        .iter()
        .filter(|k| delivered.contains_key(**k))
        .count();
    let dead_n = produced
        .iter()
        .filter(|k| !delivered.contains_key(**k) && dead.contains(**k))
        .count();
    let mut ledger_records: std::collections::HashMap<String, crate::ledger::LedgerRecord> =
        Default::default();
    for key in ledger.keys().await? {
        if let Some((rec, _)) = ledger.get(&key).await? {
            ledger_records.insert(key, rec);
        }
    }
    let max_attempt = ledger_records
        .values()
        .map(|r| r.attempts)
        .max()
        .unwrap_or(1)
        .max(1);
    let blob_writes = bed.blob.store().writes();
    let accepted = bed
        .sb
        .queue("retries")
        .map(|q| q.accepted())
        .unwrap_or_default();
    let first_delivered = bed.hook.first_deliveries();
    let attempts_seen = bed.hook.attempts_seen();
    let verdict = verify::verify(&verify::Evidence {
        eventhubs: &bed.eh,
        hub: HUB,
        blob_writes: &blob_writes,
        accepted: &accepted,
        first_delivered: &first_delivered,
        attempts_seen: &attempts_seen,
        ledger: &ledger,
        records: &ledger_records,
    });
    let sb = bed.sb.counters("retries").unwrap_or_default();
    let breaker_key = crate::breaker::record_name(
        bed.hook
            .url()
            .trim_start_matches("http://")
            .trim_end_matches("/events"),
    );
    let records = crate::azure::BlobRecordStore::new(
        &bed.blob.container_url("hubguard"),
        None,
        Duration::from_secs(5),
    )?;
    let (breaker_opens, breaker_reopens) =
        match crate::azure::RecordStore::read(&records, &breaker_key).await? {
            Some(r) => serde_json::from_slice::<crate::breaker::BreakerRecord>(&r.body)
                .map(|b| (b.opens, b.reopens))
                .unwrap_or((0, 0)),
            None => (0, 0),
        };
    let report = Report {
        events: keys.len(),
        delivered: delivered_n,
        dead_lettered: dead_n,
        lost: keys.len() - delivered_n - dead_n,
        duplicate_deliveries: delivered.values().map(|n| *n as usize).sum::<usize>()
            - delivered.len(),
        retries_scheduled: sb.sends - sb.duplicates_dropped,
        max_attempt,
        breaker_opens,
        breaker_reopens,
        checkpoint_writes: retired.iter().map(|h| h.snapshot().checkpoints).sum(),
        crashes,
        duplicate_ratio: (delivered.values().map(|n| *n as usize).sum::<usize>() - delivered.len())
            as f64
            / keys.len().max(1) as f64,
        checks: verdict,
        max_in_flight: args.max_in_flight,
        elapsed_ms: started.elapsed().as_millis() as u64,
    };
    // The operator story: one retried event as support staff would look it up.
    if !args.json {
        let mut best: Option<crate::ledger::LedgerRecord> = None;
        let mut keys: Vec<&String> = ledger_records.keys().collect();
        keys.sort();
        for key in keys {
            let rec = &ledger_records[key];
            if rec.state == State::Delivered
                && best.as_ref().is_none_or(|b| rec.attempts > b.attempts)
            {
                best = Some(rec.clone());
            }
        }
        if let Some(rec) = best {
            progress("");
            progress(&format!(
                "One retried event, as `hubguard status {}` shows it:",
                rec.key
            ));
            for l in crate::status::record_text(&rec).lines() {
                progress(&format!("  {l}"));
            }
            progress("The trace query that finds every attempt (Grafana Tempo):");
            // Built from the names the spans are emitted with, so it cannot go stale.
            use crate::telemetry::names::{attr, span};
            progress(&format!(
                "  {{ name = \"{}\" && span.{} = \"{}\" }} | select(span.{}, span.{}, span.{})",
                span::ATTEMPT,
                attr::CONVERSATION_ID,
                rec.correlation_id,
                attr::ATTEMPT,
                attr::OUTCOME,
                attr::NEXT_ATTEMPT_AT
            ));
        }
    }
    Ok(report)
}

/// Prints the report as a table.
pub fn print_table(r: &Report) {
    let row = |label: &str, value: &dyn std::fmt::Display| println!("{label:<24} {value:>10}");
    println!();
    row("events produced", &r.events);
    row("delivered", &r.delivered);
    row("dead-lettered", &r.dead_lettered);
    row("LOST", &r.lost);
    row("duplicate deliveries", &r.duplicate_deliveries);
    row("retries scheduled", &r.retries_scheduled);
    row("highest attempt", &r.max_attempt);
    row("breaker opens", &r.breaker_opens);
    row("failed probes (reopens)", &r.breaker_reopens);
    row("checkpoint writes", &r.checkpoint_writes);
    row("replica crashes", &r.crashes);
    row("duplicates per event", &format!("{:.4}", r.duplicate_ratio));
    row("checkpoints checked", &r.checks.checkpoint_writes_checked);
    row("ckpt past unsettled", &r.checks.checkpoint_violations);
    row("attempts went back", &r.checks.attempt_regressions);
    row("retry scheduled twice", &r.checks.double_scheduled);
    for p in &r.checks.problems {
        println!("  problem: {p}");
    }
    for (p, (n, first, cp)) in &r.checks.unsettled {
        println!(
            "  partition {p}: {n} event(s) never settled, from sequence number {first}; last checkpoint {}",
            cp.map_or("none".to_string(), |c| c.to_string())
        );
    }
    println!("{:<24} {:>9.1}s", "elapsed", r.elapsed_ms as f64 / 1000.0);
    if r.clean() {
        println!("\nNothing lost: every event was delivered or dead-lettered, and no checkpoint ever passed an unsettled event.");
    }
}

/// Starts each outage of `windows` whose time `t` has come and that `started` does not mark
/// yet: `faults` answers 503 for its duration.
fn start_outages(
    t: Duration,
    windows: &[Outage],
    started: &mut [bool],
    faults: &crate::emulator::Faults,
    what: &str,
    effect: &str,
    progress: &mut impl FnMut(&str),
) {
    for (w, started) in windows.iter().zip(started.iter_mut()) {
        if let Some(w) = w.0.filter(|w| !*started && t >= w.start) {
            faults.error_status_for(503, w.duration);
            progress(&format!(
                "t={:>3}s  {what}: 503 for {:?}; {effect}",
                t.as_secs(),
                w.duration
            ));
            *started = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_and_durations_parse() {
        assert_eq!(
            "8s:10s".parse::<Window>().unwrap(),
            Window {
                start: Duration::from_secs(8),
                duration: Duration::from_secs(10)
            }
        );
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("soon").is_err());
        assert!("8s".parse::<Window>().is_err());
        assert_eq!("none".parse::<Outage>().unwrap(), Outage(None));
        assert_eq!(
            "15s".parse::<Every>().unwrap(),
            Every(Some(Duration::from_secs(15)))
        );
    }

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
}
