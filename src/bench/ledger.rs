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
use crate::ledger::{ms, Ledger, LedgerRecord, State};
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
    LedgerRecord {
        key: key.into(),
        correlation_id: key.into(),
        event_type: None,
        state: if due.is_some() {
            State::RetryScheduled
        } else {
            State::Delivered
        },
        attempts: 1,
        next_attempt_ms: due.map(ms),
        first_failure_ms: 0,
        updated_ms: 0,
        last_error: Some("status 503".into()),
        dead_letter_reason: None,
        last_delay_ms: Some(1_000),
        policy: RetryPolicy::seed_fibonacci(),
        attempt_base: 0,
        history: Vec::new(),
        event: Event {
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
        },
        quarantined: None,
        event_unknown: false,
        claim: None,
        indexed: None,
        run_now: None,
    }
}

/// A ledger holding `settled` delivered records (each went through the index: waiting,
/// then delivered) and `pending` waiting ones; one sweep's listing measured over it.
async fn one(settled: usize, pending: usize) -> anyhow::Result<(u64, u64, f64)> {
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
        let (mut rec, etag) = ledger
            .get(&key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("record {key} vanished"))?;
        rec.state = State::Delivered;
        rec.attempts = 2;
        rec.next_attempt_ms = None;
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
    Ok((
        store.calls.load(Ordering::Relaxed) - calls,
        store.listed.load(Ordering::Relaxed) - listed,
        took,
    ))
}

/// The scenario: `settled` settled records and `pending` waiting ones, against `pending`
/// alone.
pub(super) async fn ledger(settled: usize, pending: usize) -> anyhow::Result<LedgerFigures> {
    let (sweep_calls_settled, sweep_listed_settled, retries_list_ms) =
        one(settled, pending).await?;
    let (sweep_calls_empty, _, retries_list_empty_ms) = one(0, pending).await?;
    Ok(LedgerFigures {
        settled,
        pending,
        sweep_calls_settled,
        sweep_calls_empty,
        sweep_listed_settled,
        retries_list_ms,
        retries_list_empty_ms,
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
