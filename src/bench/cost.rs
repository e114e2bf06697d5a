//! `hubguard bench --only cost`: the Azure operations one event costs on each path, counted
//! from the calls hubguard's pipeline really makes. The pipeline runs on the emulators with
//! its record store and retry queue behind counting wrappers ([`CountingStore`],
//! [`CountingQueue`]) that attribute each call to the event it concerns — a ledger,
//! pending-index or dead-letter-index blob by the key in its name, a Service Bus message by
//! its MessageId — and bill it as Azure does: Put Blob a write, Get Blob (conditional or not)
//! a read, one List Blobs per page of 5,000 a list, Delete Blob "other" (free); on Service
//! Bus every call is one operation: a send (schedule), a peek-lock receive, a complete, an
//! abandon, a lock renewal ("Service Bus pricing", azure.microsoft.com/pricing/details/
//! service-bus). Each event's calls are cut at each receive of its retry message: what came
//! before the first receive is its first attempt's cost, each later run one retry's.
//!
//! The handler scripts five kinds of event by sequence number: delivered at once; failing
//! twice then delivered; refused for good (permanent); failing every attempt until the
//! policy's three are spent; failing once, then a retry that outlasts half the queue's lock
//! (5 s, Azure's shortest) so its lock is renewed.
//!
//! Calls no event is named in (the overdue sweep's listing of the pending index, empty
//! receives of the retry loop's long polls, the control record) are per replica and per
//! interval, not per event: reported apart, as `background`.

use crate::sync::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_trait::async_trait;
use base64::Engine as _;
use bytes::Bytes;

use crate::azure::record_store::{Listed, Record, RecordStore, StoreError, Tags};
use crate::azure::retry_queue::{
    MessageLock, OutgoingMessage, QueueDescription, ReceivedMessage, RetryQueue, RetryQueueError,
};
use crate::azure::IfChanged;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::servicebus::QueueSpec;
use crate::emulator::{Emulators, EmulatorsConfig};
use crate::event::Event;
use crate::handler::{Attempt, Failure, Handler, Outcome};
use crate::pipeline::{Pipeline, PipelineOptions, PipelineParts};
use crate::policy::RetryPolicy;

/// Blobs per List Blobs page on Azure.
const PAGE: usize = 5_000;

/// How Azure bills a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Put Blob (a write operation).
    BlobWrite,
    /// Get Blob, conditional or not (a read operation).
    BlobRead,
    /// List Blobs, per page of at most 5,000 (a list operation).
    BlobList,
    /// Delete Blob ("other"; deletes are free).
    BlobOther,
    /// Service Bus: a send (a scheduled message).
    SbSend,
    /// Service Bus: a peek-lock receive.
    SbReceive,
    /// Service Bus: a complete.
    SbComplete,
    /// Service Bus: an abandon.
    SbAbandon,
    /// Service Bus: a lock renewal.
    SbRenew,
}

/// Every kind, in the order tables print them.
pub const KINDS: [Kind; 9] = [
    Kind::BlobWrite,
    Kind::BlobRead,
    Kind::BlobList,
    Kind::BlobOther,
    Kind::SbSend,
    Kind::SbReceive,
    Kind::SbComplete,
    Kind::SbAbandon,
    Kind::SbRenew,
];

impl Kind {
    /// The name in `--json` and tables: `{service}_{kind}`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::BlobWrite => "blob_write",
            Kind::BlobRead => "blob_read",
            Kind::BlobList => "blob_list",
            Kind::BlobOther => "blob_other",
            Kind::SbSend => "servicebus_send",
            Kind::SbReceive => "servicebus_receive",
            Kind::SbComplete => "servicebus_complete",
            Kind::SbAbandon => "servicebus_abandon",
            Kind::SbRenew => "servicebus_renew",
        }
    }

    fn blob(self) -> bool {
        matches!(
            self,
            Kind::BlobWrite | Kind::BlobRead | Kind::BlobList | Kind::BlobOther
        )
    }
}

/// Operations per event on one path (means over the events that took it).
#[derive(Debug, Clone, Default)]
pub struct Ops {
    /// Events measured.
    pub events: usize,
    /// Mean calls per event, by kind.
    pub per_kind: BTreeMap<Kind, f64>,
}

impl Ops {
    fn mean(samples: &[BTreeMap<Kind, u64>]) -> Self {
        let mut per_kind = BTreeMap::new();
        for k in KINDS {
            let sum: u64 = samples
                .iter()
                .map(|s| s.get(&k).copied().unwrap_or(0))
                .sum();
            per_kind.insert(k, sum as f64 / samples.len().max(1) as f64);
        }
        Self {
            events: samples.len(),
            per_kind,
        }
    }

    /// Calls of `kind`.
    pub fn of(&self, kind: Kind) -> f64 {
        self.per_kind.get(&kind).copied().unwrap_or(0.0)
    }

    /// Blob storage calls (deletes included; they are free).
    pub fn blob(&self) -> f64 {
        KINDS.iter().filter(|k| k.blob()).map(|&k| self.of(k)).sum()
    }

    /// Service Bus operations.
    pub fn servicebus(&self) -> f64 {
        KINDS
            .iter()
            .filter(|k| !k.blob())
            .map(|&k| self.of(k))
            .sum()
    }

    /// `{"total":…,"blob_write":…,…}`.
    pub fn json(&self) -> String {
        let mut fields = vec![
            format!("\"total\":{}", num(self.blob() + self.servicebus())),
            format!("\"events\":{}", self.events),
        ];
        fields.extend(
            KINDS
                .iter()
                .map(|&k| format!("\"{}\":{}", k.name(), num(self.of(k)))),
        );
        format!("{{{}}}", fields.join(","))
    }
}

/// A mean as JSON: whole numbers without a fraction.
fn num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

/// What the cost scenario measured.
#[derive(Debug, Clone, Default)]
pub struct CostFigures {
    /// Delivered on the first attempt.
    pub happy: Ops,
    /// The first attempt failing (transiently): the retry scheduled.
    pub first_failure: Ops,
    /// A retry that fails again: the next one scheduled.
    pub retry_rescheduled: Ops,
    /// A retry that delivers.
    pub retry_delivered: Ops,
    /// A retry whose attempt outlasts half the queue's lock, then delivers.
    pub retry_long: Ops,
    /// How long that attempt took, and the queue's lock duration.
    pub retry_long_attempt_s: f64,
    /// The queue's lock duration.
    pub lock_s: f64,
    /// A permanent failure on the first attempt: dead-lettered.
    pub dead_letter: Ops,
    /// The last retry failing: the policy spent, dead-lettered.
    pub dead_letter_exhausted: Ops,
    /// Calls attributed to no event over the run, and its length.
    pub background: BTreeMap<Kind, u64>,
    /// The run's length in seconds.
    pub seconds: f64,
}

/// One counted call: the event it concerns, if any, and its kind.
#[derive(Default)]
struct Log {
    calls: Mutex<Vec<(Option<String>, Kind)>>,
    completes: AtomicU64,
}

impl Log {
    fn note(&self, key: Option<String>, kind: Kind, n: u64) {
        if kind == Kind::SbComplete {
            self.completes.fetch_add(n, Ordering::Relaxed);
        }
        let mut calls = self.calls.locked();
        for _ in 0..n {
            calls.push((key.clone(), kind));
        }
    }
}

/// The event a blob concerns: the base64url key ending the name of a ledger record or an
/// index entry (`{area}/{hub}/{consumer group}/{key}`).
fn key_of_blob(name: &str) -> Option<String> {
    let area = name.split('/').next()?;
    if !matches!(area, "ledger" | "pending" | "deadletters") {
        return None;
    }
    let encoded = name.rsplit('/').next().filter(|e| !e.is_empty())?;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
}

/// The event a retry message concerns: `{deployment}.{key}-attempt-{n}`.
fn key_of_message(id: &str) -> Option<String> {
    crate::pipeline::settle::unqualified(id)
        .rsplit_once("-attempt-")
        .map(|(k, _)| k.to_string())
}

/// The pipeline's record store, counted.
struct CountingStore {
    inner: Arc<dyn RecordStore>,
    log: Arc<Log>,
}

#[async_trait]
impl RecordStore for CountingStore {
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobRead, 1);
        self.inner.read(key).await
    }
    async fn read_if_changed(&self, key: &str, etag: &str) -> Result<IfChanged, StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobRead, 1);
        self.inner.read_if_changed(key, etag).await
    }
    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobWrite, 1);
        self.inner.create(key, body).await
    }
    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobWrite, 1);
        self.inner.update(key, body, etag).await
    }
    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobOther, 1);
        self.inner.delete(key, etag).await
    }
    async fn remove(&self, key: &str) -> Result<(), StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobOther, 1);
        self.inner.remove(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        let listed = self.inner.list(prefix).await?;
        let pages = listed.len().div_ceil(PAGE).max(1) as u64;
        self.log.note(key_of_blob(prefix), Kind::BlobList, pages);
        Ok(listed)
    }
    async fn list_page(
        &self,
        prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<Listed>, Option<String>), StoreError> {
        self.log.note(key_of_blob(prefix), Kind::BlobList, 1);
        self.inner.list_page(prefix, marker).await
    }
    async fn write_tagged(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobWrite, 1);
        self.inner.write_tagged(key, body, etag, tags).await
    }
    async fn write_indexed(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
        index: &Tags,
    ) -> Result<String, StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobWrite, 1);
        self.inner.write_indexed(key, body, etag, tags, index).await
    }
    async fn put_tagged(&self, key: &str, body: Bytes, tags: &Tags) -> Result<String, StoreError> {
        self.log.note(key_of_blob(key), Kind::BlobWrite, 1);
        self.inner.put_tagged(key, body, tags).await
    }
}

/// The pipeline's retry queue, counted.
struct CountingQueue {
    inner: Arc<dyn RetryQueue>,
    log: Arc<Log>,
}

/// A received message's lock, counted.
struct CountingLock {
    message: tokio::sync::Mutex<ReceivedMessage>,
    key: Option<String>,
    log: Arc<Log>,
}

#[async_trait]
impl MessageLock for CountingLock {
    async fn complete(&self) -> Result<(), RetryQueueError> {
        self.log.note(self.key.clone(), Kind::SbComplete, 1);
        self.message.lock().await.complete().await
    }
    async fn abandon(&self) -> Result<(), RetryQueueError> {
        self.log.note(self.key.clone(), Kind::SbAbandon, 1);
        self.message.lock().await.abandon().await
    }
    async fn renew(&self) -> Result<std::time::SystemTime, RetryQueueError> {
        self.log.note(self.key.clone(), Kind::SbRenew, 1);
        let mut m = self.message.lock().await;
        m.renew().await?;
        Ok(m.locked_until)
    }
}

impl CountingQueue {
    fn wrap(&self, received: Option<ReceivedMessage>) -> Option<ReceivedMessage> {
        let Some(m) = received else {
            self.log.note(None, Kind::SbReceive, 1); // an empty long poll: per replica
            return None;
        };
        let key = key_of_message(&m.message_id);
        self.log.note(key.clone(), Kind::SbReceive, 1);
        // What the counting copy shows of the message it wraps (which its lock settles).
        let (correlation_id, label, properties) = (
            m.correlation_id.clone(),
            m.label.clone(),
            m.properties.clone(),
        );
        let (delivery_count, sequence_number, enqueued_at) =
            (m.delivery_count, m.sequence_number, m.enqueued_at);
        let mut received = ReceivedMessage::new(
            m.message_id.clone(),
            m.body.clone(),
            m.locked_until,
            Box::new(CountingLock {
                message: tokio::sync::Mutex::new(m),
                key,
                log: self.log.clone(),
            }),
        );
        received.correlation_id = correlation_id;
        received.label = label;
        received.delivery_count = delivery_count;
        received.sequence_number = sequence_number;
        received.enqueued_at = enqueued_at;
        received.properties = properties;
        Some(received)
    }
}

#[async_trait]
impl RetryQueue for CountingQueue {
    async fn schedule(&self, message: OutgoingMessage) -> Result<(), RetryQueueError> {
        self.log
            .note(key_of_message(&message.message_id), Kind::SbSend, 1);
        self.inner.schedule(message).await
    }
    async fn receive(&self, wait: Duration) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        let r = self.inner.receive(wait).await?;
        Ok(self.wrap(r))
    }
    async fn receive_dead_lettered(
        &self,
        wait: Duration,
    ) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        let r = self.inner.receive_dead_lettered(wait).await?;
        Ok(self.wrap(r))
    }
    async fn describe(&self) -> Result<QueueDescription, RetryQueueError> {
        self.inner.describe().await
    }
}

/// The five scripted paths, by sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Path {
    Happy,
    TwiceThenDelivered,
    Permanent,
    Exhausted,
    LongRetry,
}

impl Path {
    fn of(seq: i64) -> Self {
        match seq.rem_euclid(5) {
            0 => Path::Happy,
            1 => Path::TwiceThenDelivered,
            2 => Path::Permanent,
            3 => Path::Exhausted,
            _ => Path::LongRetry,
        }
    }
}

struct Scripted {
    long: Duration,
    paths: Mutex<HashMap<String, Path>>,
    calls: AtomicU64,
}

#[async_trait]
impl Handler for Scripted {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        let path = Path::of(event.sequence_number);
        self.paths
            .locked()
            .insert(event.identity.idempotency_key.clone(), path);
        self.calls.fetch_add(1, Ordering::Relaxed);
        let fail = || Outcome::Failed(Failure::transient("bench: scripted 503"));
        match (path, attempt.number) {
            (Path::Happy, _) => Outcome::Delivered,
            (Path::TwiceThenDelivered, n) if n <= 2 => fail(),
            (Path::Permanent, _) => Outcome::Failed(Failure::permanent("bench: scripted 400")),
            (Path::Exhausted, _) => fail(),
            (Path::LongRetry, 1) => fail(),
            (Path::LongRetry, _) => {
                tokio::time::sleep(self.long).await;
                Outcome::Delivered
            }
            _ => Outcome::Delivered,
        }
    }
}

/// Each event's calls, cut at each receive of its retry message (by idempotency key).
type Segments = HashMap<String, Vec<BTreeMap<Kind, u64>>>;

/// The scenario: `events` events (a fifth on each path) over 2 partitions.
pub async fn cost(events: usize) -> anyhow::Result<CostFigures> {
    let events = events.max(5);
    let lock = Duration::from_secs(5); // Azure's shortest LockDuration
    let long = lock * 3 / 4; // outlasts half the lock: one renewal
    let emulators = start_with_backlog(events, lock).await?;
    let handler = Arc::new(Scripted {
        long,
        paths: Mutex::default(),
        calls: AtomicU64::new(0),
    });
    let (parts, log) = counted_parts(&emulators, handler.clone(), events)?;
    let seconds = run_until_settled(parts, &handler, &log, events).await?;
    emulators.shutdown().await;
    let calls = log.calls.locked().clone();
    let (runs, background) = segments(calls);
    let paths = handler.paths.locked().clone();
    Ok(CostFigures {
        retry_long_attempt_s: long.as_secs_f64(),
        lock_s: lock.as_secs_f64(),
        background,
        seconds,
        ..path_means(&paths, &runs)
    })
}

/// The means of each path's calls per event, from each event's segments.
fn path_means(paths: &HashMap<String, Path>, runs: &Segments) -> CostFigures {
    let segment = |path: Path, i: usize| -> Vec<BTreeMap<Kind, u64>> {
        paths
            .iter()
            .filter(|(_, p)| **p == path)
            .map(|(k, _)| {
                runs.get(k)
                    .and_then(|s| s.get(i).cloned())
                    .unwrap_or_default()
            })
            .collect()
    };
    let mut first = segment(Path::TwiceThenDelivered, 0);
    first.extend(segment(Path::Exhausted, 0));
    first.extend(segment(Path::LongRetry, 0));
    let mut rescheduled = segment(Path::TwiceThenDelivered, 1);
    rescheduled.extend(segment(Path::Exhausted, 1));
    CostFigures {
        happy: Ops::mean(&happy_totals(paths, runs)),
        first_failure: Ops::mean(&first),
        retry_rescheduled: Ops::mean(&rescheduled),
        retry_delivered: Ops::mean(&segment(Path::TwiceThenDelivered, 2)),
        retry_long: Ops::mean(&segment(Path::LongRetry, 1)),
        dead_letter: Ops::mean(&segment(Path::Permanent, 0)),
        dead_letter_exhausted: Ops::mean(&segment(Path::Exhausted, 2)),
        ..CostFigures::default()
    }
}

/// The emulators (hub `bench`, 2 partitions; queue `retries`, `lock`) with `events` produced.
async fn start_with_backlog(events: usize, lock: Duration) -> anyhow::Result<Emulators> {
    let emulators = Emulators::start(EmulatorsConfig {
        hubs: vec![HubSpec::new("bench", 2)],
        queues: vec![QueueSpec {
            lock_duration: lock,
            ..QueueSpec::new("retries")
        }],
        ..Default::default()
    })
    .await?;
    let cs = emulators
        .eventhubs
        .as_ref()
        .context("event hubs")?
        .connection_string()
        .parse()?;
    super::produce(&cs, 2, events, 64).await?;
    Ok(emulators)
}

/// The pipeline's parts, its record store and retry queue counting calls into the log.
fn counted_parts(
    emulators: &Emulators,
    handler: Arc<Scripted>,
    events: usize,
) -> anyhow::Result<(PipelineParts, Arc<Log>)> {
    let policy = RetryPolicy {
        name: "bench".into(),
        curve: crate::policy::Curve::Fixed,
        base_s: 1,
        floor_s: 1,
        cap_s: 1,
        max_attempts: 3,
        max_age_s: None,
    };
    // Room for every retry at once, so none waits for a slot holding its lock: renewals
    // then come from the attempt's own length (the renewed path), as they would on a
    // deployment keeping up.
    let options = PipelineOptions {
        retry_receive_wait: Duration::from_secs(1),
        retry_concurrency: events,
        retry_prefetch: events,
        max_in_flight: 16,
        ..super::pipelines::bench_options()
    };
    let mut parts = super::pipelines::parts(emulators, handler, policy, options)?;
    let log = Arc::new(Log::default());
    parts.records = Arc::new(CountingStore {
        inner: parts.records.clone(),
        log: log.clone(),
    });
    parts.queue = Arc::new(CountingQueue {
        inner: parts.queue.clone(),
        log: log.clone(),
    });
    Ok((parts, log))
}

/// Runs until the handler saw every event and every retry completed; the seconds taken.
async fn run_until_settled(
    parts: PipelineParts,
    handler: &Scripted,
    log: &Log,
    events: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(Pipeline::new(parts).run(cancel.clone()));
    // Every retry message ends completed: two for the paths failing twice or more, one for
    // the long retry.
    // (Sequence numbers restart in each partition: count the paths the handler saw.)
    let expected = || {
        let paths = handler.paths.locked();
        paths
            .values()
            .map(|p| match p {
                Path::TwiceThenDelivered | Path::Exhausted => 2,
                Path::LongRetry => 1,
                _ => 0,
            })
            .sum::<u64>()
    };
    super::pipelines::wait_progress(
        "handler calls",
        || handler.paths.lock().map(|p| p.len() as u64).unwrap_or(0),
        events as u64,
    )
    .await?;
    let target = expected();
    super::pipelines::wait_progress(
        "retries completed",
        || log.completes.load(Ordering::Relaxed),
        target,
    )
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    cancel.cancel();
    run.await??;
    Ok(seconds)
}

/// Each event's calls cut at each retry receive, and the calls for no event, by kind.
fn segments(calls: Vec<(Option<String>, Kind)>) -> (Segments, BTreeMap<Kind, u64>) {
    let mut runs: Segments = HashMap::new();
    let mut background: BTreeMap<Kind, u64> = BTreeMap::new();
    for (key, kind) in calls {
        let Some(key) = key else {
            *background.entry(kind).or_default() += 1;
            continue;
        };
        let segments = runs.entry(key).or_insert_with(|| vec![BTreeMap::new()]);
        if kind == Kind::SbReceive {
            segments.push(BTreeMap::new());
        }
        if let Some(last) = segments.last_mut() {
            *last.entry(kind).or_default() += 1;
        }
    }
    (runs, background)
}

/// Each happy event's calls, its segments summed.
fn happy_totals(paths: &HashMap<String, Path>, runs: &Segments) -> Vec<BTreeMap<Kind, u64>> {
    paths
        .iter()
        .filter(|(_, p)| **p == Path::Happy)
        .map(|(k, _)| {
            let mut all = BTreeMap::new();
            for s in runs.get(k).into_iter().flatten() {
                for (kind, n) in s {
                    *all.entry(*kind).or_default() += n;
                }
            }
            all
        })
        .collect()
}

impl CostFigures {
    /// The paths, in the order tables print them: (JSON name, label, figures).
    pub fn paths(&self) -> [(&'static str, &'static str, &Ops); 7] {
        [
            (
                "ops_per_happy_path",
                "happy path (delivered at once)",
                &self.happy,
            ),
            (
                "ops_per_first_failure",
                "first failure (retry scheduled)",
                &self.first_failure,
            ),
            (
                "ops_per_retry",
                "a retry that delivers",
                &self.retry_delivered,
            ),
            (
                "ops_per_retry_rescheduled",
                "a retry that fails again",
                &self.retry_rescheduled,
            ),
            (
                "ops_per_retry_renewed",
                "a retry outlasting half the lock",
                &self.retry_long,
            ),
            (
                "ops_per_dead_letter",
                "dead letter (permanent error)",
                &self.dead_letter,
            ),
            (
                "ops_per_dead_letter_exhausted",
                "dead letter (attempts spent)",
                &self.dead_letter_exhausted,
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_attributed_to_the_event_they_concern() {
        let ledger = crate::ledger::Ledger::new(
            Arc::new(crate::azure::memory::MemoryRecordStore::new()),
            "bench",
            "$Default",
        );
        let key = "bench/0/12";
        assert_eq!(key_of_blob(&ledger.record_name(key)).as_deref(), Some(key));
        assert_eq!(key_of_blob(&ledger.entry_name(key)).as_deref(), Some(key));
        assert_eq!(
            key_of_blob(&ledger.dead_letter_name(key)).as_deref(),
            Some(key)
        );
        assert_eq!(key_of_blob("pending/bench/$default/"), None);
        assert_eq!(key_of_blob(&ledger.index_marker()), None);
        let id = crate::pipeline::settle::message_id(key, 3);
        assert_eq!(key_of_message(&id).as_deref(), Some(key));
    }

    /// The scenario end to end, small: real calls counted, paths told apart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_path_costs_what_it_calls() {
        let f = cost(10).await.unwrap();
        assert_eq!(f.happy.blob() + f.happy.servicebus(), 0.0, "{f:?}");
        assert_eq!(f.first_failure.of(Kind::SbSend), 1.0, "{f:?}");
        assert!(f.first_failure.of(Kind::BlobWrite) >= 1.0, "{f:?}");
        // The partition's listing says these events have no pending record: the first
        // failure creates it without reading it first.
        assert_eq!(f.first_failure.of(Kind::BlobRead), 0.0, "{f:?}");
        for retry in [&f.retry_delivered, &f.retry_rescheduled, &f.retry_long] {
            assert_eq!(retry.of(Kind::SbReceive), 1.0, "{f:?}");
            assert_eq!(retry.of(Kind::SbComplete), 1.0, "{f:?}");
        }
        assert_eq!(f.retry_rescheduled.of(Kind::SbSend), 1.0, "{f:?}");
        assert_eq!(f.retry_delivered.of(Kind::SbSend), 0.0, "{f:?}");
        assert!(f.retry_long.of(Kind::SbRenew) >= 1.0, "{f:?}");
        assert_eq!(f.dead_letter.of(Kind::SbSend), 0.0, "{f:?}");
        assert!(f.dead_letter.of(Kind::BlobWrite) >= 1.0, "{f:?}");
    }
}
