//! The console where users live: a ledger of 200,000 settled records, 10,000 waiting retries
//! and 2,000 dead letters (as the ledger bench builds it), behind a record store that waits
//! the emulators' `azure` blob latency (8 ms median, 40 ms p99) on every round trip — one per
//! call, one per List Blobs page of 5,000. Ignored (minutes to build the ledger in a debug
//! build); run it with `cargo test --test it console_scale -- --ignored --nocapture`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use hubguard::azure::record_store::{Listed, Record, RecordStore, StoreError, Tags};
use hubguard::console::{Console, Settings};
use hubguard::emulator::latency::Latency;
use hubguard::event::{Event, Identity};
use hubguard::ledger::{Ledger, LedgerRecord};
use hubguard::pipeline::settle::{Policies, Settler};
use hubguard::policy::{DeadLetterReason, RetryPolicy};
use hubguard::MemoryRecordStore;

const PAGE: usize = 5_000;

/// The memory store, waiting Azure's blob latency per round trip once `slow` is set.
struct AtAzure {
    inner: MemoryRecordStore,
    latency: Latency,
    slow: AtomicBool,
}

impl AtAzure {
    async fn trips(&self, n: usize) {
        if self.slow.load(Ordering::Relaxed) {
            let d: Duration = (0..n)
                .map(|_| self.latency.sample(&mut rand::thread_rng()))
                .sum();
            tokio::time::sleep(d).await; // simulated work: the service's round trips
        }
    }
}

#[async_trait]
impl RecordStore for AtAzure {
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.trips(1).await;
        self.inner.read(key).await
    }
    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError> {
        self.trips(1).await;
        self.inner.create(key, body).await
    }
    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError> {
        self.trips(1).await;
        self.inner.update(key, body, etag).await
    }
    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
        self.trips(1).await;
        self.inner.delete(key, etag).await
    }
    async fn remove(&self, key: &str) -> Result<(), StoreError> {
        self.trips(1).await;
        self.inner.remove(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        let listed = self.inner.list(prefix).await?;
        self.trips(listed.len().div_ceil(PAGE).max(1)).await;
        Ok(listed)
    }
    async fn list_page(
        &self,
        prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<Listed>, Option<String>), StoreError> {
        self.trips(1).await;
        self.inner.list_page(prefix, marker).await
    }
    async fn write_tagged(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        self.trips(1).await;
        self.inner.write_tagged(key, body, etag, tags).await
    }
    async fn put_tagged(&self, key: &str, body: Bytes, tags: &Tags) -> Result<String, StoreError> {
        self.trips(1).await;
        self.inner.put_tagged(key, body, tags).await
    }
}

fn record(key: &str, seq: i64) -> LedgerRecord {
    let event = Event {
        body: Vec::new(),
        content_type: None,
        properties: Default::default(),
        hub: "hub".into(),
        partition_id: (seq % 4).to_string(),
        sequence_number: seq,
        offset: None,
        enqueued_ms: None,
        partition_key: None,
        identity: Identity {
            idempotency_key: key.into(),
            correlation_id: key.into(),
            event_type: Some(format!("order.{}", seq % 3)),
        },
    };
    let mut rec =
        LedgerRecord::first_failure(&event, RetryPolicy::event_grid(), hubguard::clock::at(0));
    rec.attempts = 1;
    rec.last_error = Some(format!("HTTP {} from the webhook", 500 + seq % 4));
    rec.last_delay_ms = Some(10_000);
    rec
}

async fn timed<T>(what: &str, f: impl std::future::Future<Output = T>) -> (T, f64) {
    let started = Instant::now();
    let out = f.await;
    let took = started.elapsed().as_secs_f64() * 1000.0;
    println!("{what}: {took:.0} ms");
    (out, took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes to build the ledger in a debug build"]
async fn console_at_scale_answers_within_its_budgets() {
    let (settled, pending, dead) = (200_000usize, 10_000usize, 2_000usize);
    let store = Arc::new(AtAzure {
        inner: MemoryRecordStore::new(),
        latency: Latency::new(Duration::from_millis(8), Duration::from_millis(40)),
        slow: AtomicBool::new(false),
    });
    let ledger = Ledger::new(store.clone(), "hub", "$Default");
    ledger.pending().await.unwrap();
    let now = SystemTime::now();
    let now_ms = hubguard::clock::ms(now);
    for i in 0..settled {
        let mut rec = record(&format!("settled-{i}"), i as i64);
        rec.deliver();
        ledger.put(&rec, None).await.unwrap();
    }
    for i in 0..pending {
        let mut rec = record(&format!("waiting-{i}"), i as i64);
        rec.schedule_retry(now_ms + 60_000 + i as i64 * 1_000);
        ledger.put(&rec, None).await.unwrap();
    }
    for i in 0..dead {
        let key = format!("dead-{i}");
        let mut rec = record(&key, i as i64);
        rec.dead_letter(DeadLetterReason::AttemptsExhausted);
        ledger.index_dead_letter(&key).await.unwrap();
        ledger.put(&rec, None).await.unwrap();
    }
    let queue = Arc::new(hubguard::MemoryRetryQueue::new(Arc::default()));
    let settler = Arc::new(Settler::new(
        Ledger::new(store.clone(), "hub", "$Default"),
        queue,
        Policies {
            default: RetryPolicy::event_grid(),
            by_type: Default::default(),
        },
    ));
    let console = Console::from_parts(Arc::default(), settler, Settings::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(listener, console.router()).await.unwrap();
    });
    store.slow.store(true, Ordering::Relaxed);
    let get = |path: String| async move {
        let res = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
        assert_eq!(res.status(), 200, "{path}");
        let text = res.text().await.unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    // The first answers pay for the index marker, the first listing of the pending index
    // (a running replica's overdue sweep would have made one) and the first dead-letter reads.
    let (_, first_retries) = timed(
        "retries (first: lists the pending index)",
        get("/console/api/retries".into()),
    )
    .await;
    let (v, first_groups) = timed(
        "dead-letter groups (first: every dead letter read)",
        get("/console/api/dead-letters".into()),
    )
    .await;
    assert_eq!(v["dead_letters"], dead);
    let mut key_ms = Vec::new();
    let mut retries_ms = Vec::new();
    let mut groups_ms = Vec::new();
    for i in 0..5 {
        let (v, t) = timed(
            "key page",
            get(format!("/console/api/lookup?q=waiting-{}", i * 997)),
        )
        .await;
        assert_eq!(v["state"], "RETRY_SCHEDULED");
        key_ms.push(t);
        let (v, t) = timed(
            "retries page",
            get("/console/api/retries?event_type=order.1".into()),
        )
        .await;
        assert_eq!(v["waiting"], pending);
        retries_ms.push(t);
        let (_, t) = timed(
            "dead-letter groups",
            get("/console/api/dead-letters".into()),
        )
        .await;
        groups_ms.push(t);
    }
    // Of the retries page, the pending index's listing alone (the store's round trips and
    // building the 10,000 entries).
    let replica = Ledger::new(store.clone(), "hub", "$Default");
    replica.pending().await.unwrap();
    let (_, listing) = timed("the pending listing alone", replica.pending()).await;
    let worst = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    println!(
        "settled {settled}, pending {pending}, dead letters {dead}: key page worst {:.0} ms; retries page worst {:.0} ms (first {first_retries:.0}); dead-letter groups worst {:.0} ms (first {first_groups:.0})",
        worst(&key_ms),
        worst(&retries_ms),
        worst(&groups_ms)
    );
    println!("the pending listing alone: {listing:.0} ms");
    assert!(worst(&key_ms) <= 300.0, "{key_ms:?}");
    // The retries page answers from the pending index as last listed (the first answer
    // lists it; the overdue sweep of a running replica would have): whatever the build.
    assert!(worst(&retries_ms) <= 300.0, "{retries_ms:?}");
    assert!(
        first_groups <= 2_000.0 && worst(&groups_ms) <= 2_000.0,
        "{groups_ms:?}"
    );
    server.abort();
}
