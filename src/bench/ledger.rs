//! `hubguard bench --only ledger`: what the overdue sweep (and `/v1/retries`, `retries
//! list`, the gauges, a partition's listing at claim — all one [`Ledger::pending`]) costs
//! with a large settled history against with none. The records sit in the in-memory
//! record store behind a counter that bills a listing as Azure does: one List Blobs call per
//! page of at most 5,000 blobs ("List Blobs", learn.microsoft.com/rest/api/storageservices/
//! list-blobs: `maxresults` at most 5,000), one call per read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use crate::azure::memory::MemoryRecordStore;
use crate::azure::record_store::{Listed, Record, RecordStore, StoreError, Tags};
use crate::event::{Event, Identity};
use crate::ledger::{at, ms, Ledger, LedgerRecord};
use crate::policy::RetryPolicy;

/// Blobs per List Blobs page on Azure.
const PAGE: usize = 5_000;

/// What the ledger scenario measured.
#[derive(Debug, Clone)]
pub(super) struct LedgerFigures {
    /// Settled (DELIVERED) records in the large ledger.
    pub settled: usize,
    /// Retries waiting in both ledgers.
    pub pending: usize,
    /// Store calls (list pages + reads) of one sweep's listing over the large ledger.
    pub sweep_calls_settled: u64,
    /// The same with no settled record.
    pub sweep_calls_empty: u64,
    /// Blobs one sweep's listing returned over the large ledger.
    pub sweep_listed_settled: u64,
    /// Time of `retries list` (one `pending()`) over the large ledger.
    pub retries_list_ms: f64,
    /// The same with no settled record.
    pub retries_list_empty_ms: f64,
    /// Peak resident memory this process gained during one sweep's listing over the large
    /// ledger, and over the one with no settled record (MB; `None` off Linux).
    pub sweep_peak_mb: (Option<f64>, Option<f64>),
    /// The same for one retention pass (`Ledger::expire`, deleting nothing).
    pub retention_peak_mb: (Option<f64>, Option<f64>),
}

/// What one ledger measured.
struct One {
    calls: u64,
    listed: u64,
    ms: f64,
    sweep_peak_mb: Option<f64>,
    retention_peak_mb: Option<f64>,
}

/// A `/proc/self/status` figure in MB.
fn status_mb(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    Some(kb / 1024.0)
}

/// How much this process's peak resident memory rose above what it held before `f` ran:
/// the peak (`VmHWM`) is reset first by writing 5 to `/proc/self/clear_refs` (Linux).
async fn peak_growth<T>(f: impl std::future::Future<Output = T>) -> (T, Option<f64>) {
    let before = status_mb("VmRSS:");
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let out = f.await;
    let peak = status_mb("VmHWM:");
    let growth = match (reset, before, peak) {
        (true, Some(b), Some(p)) => Some((p - b).max(0.0)),
        _ => None,
    };
    (out, growth)
}

/// Counts calls as Azure bills them.
struct Billed {
    inner: MemoryRecordStore,
    calls: AtomicU64,
    listed: AtomicU64,
}

#[async_trait]
impl RecordStore for Billed {
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.read(key).await
    }
    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.create(key, body).await
    }
    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.update(key, body, etag).await
    }
    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.delete(key, etag).await
    }
    async fn remove(&self, key: &str) -> Result<(), StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.remove(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        let listed = self.inner.list(prefix).await?;
        self.calls
            .fetch_add(listed.len().div_ceil(PAGE).max(1) as u64, Ordering::Relaxed);
        self.listed
            .fetch_add(listed.len() as u64, Ordering::Relaxed);
        Ok(listed)
    }
    async fn list_page(
        &self,
        prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<Listed>, Option<String>), StoreError> {
        let page = self.inner.list_page(prefix, marker).await?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.listed
            .fetch_add(page.0.len() as u64, Ordering::Relaxed);
        Ok(page)
    }
    async fn write_tagged(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.write_tagged(key, body, etag, tags).await
    }
    async fn put_tagged(&self, key: &str, body: Bytes, tags: &Tags) -> Result<String, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.put_tagged(key, body, tags).await
    }
}

fn record(key: &str, seq: i64, due: Option<SystemTime>) -> LedgerRecord {
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
            event_type: None,
        },
    };
    let mut rec = LedgerRecord::first_failure(&event, RetryPolicy::seed_fibonacci(), at(0));
    rec.attempts = 1;
    rec.last_error = Some("status 503".into());
    rec.last_delay_ms = Some(1_000);
    match due {
        Some(due) => rec.schedule_retry(ms(due)),
        None => rec.deliver(),
    }
    rec
}

/// A ledger holding `settled` delivered records (each went through the index: waiting,
/// then delivered) and `pending` waiting ones; one sweep's listing measured over it.
async fn one(settled: usize, pending: usize) -> anyhow::Result<One> {
    let store = Arc::new(Billed {
        inner: MemoryRecordStore::new(),
        calls: AtomicU64::new(0),
        listed: AtomicU64::new(0),
    });
    let ledger = Ledger::new(store.clone(), "hub", "$Default");
    ledger.pending().await?; // a deployment's first start: the index covers it from here
    let now = SystemTime::now();
    for i in 0..settled {
        let key = format!("settled-{i}");
        ledger.put(&record(&key, i as i64, Some(now)), None).await?;
        let crate::ledger::Versioned {
            value: mut rec,
            etag,
        } = ledger
            .get(&key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("record {key} vanished"))?;
        rec.deliver();
        rec.attempts = 2;
        ledger.put(&rec, Some(&etag)).await?;
    }
    for i in 0..pending {
        let due = now + Duration::from_secs(60 + i as u64);
        ledger
            .put(&record(&format!("waiting-{i}"), i as i64, Some(due)), None)
            .await?;
    }
    // Another replica: its first listing reads the index marker, as every replica's does.
    let replica = Ledger::new(store.clone(), "hub", "$Default");
    let (calls, listed) = (
        store.calls.load(Ordering::Relaxed),
        store.listed.load(Ordering::Relaxed),
    );
    let started = Instant::now();
    let found = replica.pending().await?;
    let took = started.elapsed().as_secs_f64() * 1_000.0;
    anyhow::ensure!(
        found.len() == pending,
        "the sweep found {} of {pending} waiting retries",
        found.len()
    );
    let (calls, listed) = (
        store.calls.load(Ordering::Relaxed) - calls,
        store.listed.load(Ordering::Relaxed) - listed,
    );
    // Memory: the sweep again, and a retention pass that deletes nothing (no event is
    // settled on its partition), each from a fresh replica.
    let replica = Ledger::new(store.clone(), "hub", "$Default");
    replica.pending().await?; // the index marker, read once per replica
    let (swept, sweep_peak_mb) = peak_growth(replica.pending()).await;
    anyhow::ensure!(swept?.len() == pending, "the second sweep missed retries");
    let (expired, retention_peak_mb) =
        peak_growth(replica.expire(SystemTime::now(), &|_, _| false)).await;
    anyhow::ensure!(expired?.deleted == 0, "retention deleted a record");
    Ok(One {
        calls,
        listed,
        ms: took,
        sweep_peak_mb,
        retention_peak_mb,
    })
}

/// The scenario: `settled` settled records and `pending` waiting ones, against `pending`
/// alone.
pub(super) async fn ledger(settled: usize, pending: usize) -> anyhow::Result<LedgerFigures> {
    // The empty ledger first, so the large one's allocations do not flatter it.
    let empty = one(0, pending).await?;
    let large = one(settled, pending).await?;
    Ok(LedgerFigures {
        settled,
        pending,
        sweep_calls_settled: large.calls,
        sweep_calls_empty: empty.calls,
        sweep_listed_settled: large.listed,
        retries_list_ms: large.ms,
        retries_list_empty_ms: empty.ms,
        sweep_peak_mb: (large.sweep_peak_mb, empty.sweep_peak_mb),
        retention_peak_mb: (large.retention_peak_mb, empty.retention_peak_mb),
    })
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn the_sweep_costs_the_same_with_a_history_larger_than_a_page() {
        let f = super::ledger(6_000, 10).await.unwrap();
        assert_eq!(f.sweep_calls_settled, f.sweep_calls_empty, "{f:?}");
        assert_eq!(f.sweep_listed_settled, 10, "{f:?}");
    }

    /// The full-size figures (`--only ledger`'s defaults), from the test build:
    /// `cargo test --lib bench::ledger -- --ignored --nocapture`.
    #[tokio::test]
    #[ignore = "minutes in a debug build"]
    async fn full_size() {
        let f = super::ledger(200_000, 1_000).await.unwrap();
        println!("{f:?}");
        assert!(f.sweep_calls_settled <= f.sweep_calls_empty + 1, "{f:?}");
    }
}
