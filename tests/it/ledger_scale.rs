//! A ledger that stays cheap however much history it holds: the overdue sweep, the pending
//! list and a partition's listing at claim read the pending index (one small blob per
//! waiting retry), never the settled records; a stale index entry is repaired against its
//! record. The pipeline runs on the blob emulator through hubguard's REST client, with a
//! store that counts what each call listed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use hubguard::azure::record_store::{Listed, Tags};
use hubguard::azure::{Record, RecordStore, StoreError};
use hubguard::event::{Event, Identity};
use hubguard::ledger::{ms, LedgerRecord, State};

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// The bed's records, counting every listing (its prefix and how many blobs it returned)
/// and every read.
pub(crate) struct Counting {
    pub inner: Arc<dyn RecordStore>,
    pub listings: Mutex<Vec<(String, usize)>>,
    pub reads: std::sync::atomic::AtomicUsize,
}

impl Counting {
    pub(crate) fn new(inner: Arc<dyn RecordStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            listings: Mutex::default(),
            reads: Default::default(),
        })
    }
}

#[async_trait::async_trait]
impl RecordStore for Counting {
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.read(key).await
    }
    async fn create(&self, key: &str, body: bytes::Bytes) -> Result<String, StoreError> {
        self.inner.create(key, body).await
    }
    async fn update(
        &self,
        key: &str,
        body: bytes::Bytes,
        etag: &str,
    ) -> Result<String, StoreError> {
        self.inner.update(key, body, etag).await
    }
    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
        self.inner.delete(key, etag).await
    }
    async fn remove(&self, key: &str) -> Result<(), StoreError> {
        self.inner.remove(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        let listed = self.inner.list(prefix).await?;
        self.listings
            .lock()
            .unwrap()
            .push((prefix.to_string(), listed.len()));
        Ok(listed)
    }
    async fn write_tagged(
        &self,
        key: &str,
        body: bytes::Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        self.inner.write_tagged(key, body, etag, tags).await
    }
    async fn put_tagged(
        &self,
        key: &str,
        body: bytes::Bytes,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        self.inner.put_tagged(key, body, tags).await
    }
}

/// A record of `key` (an event of partition 0 at `seq`) in `state`, due at `due` when it
/// waits.
pub(crate) fn record(key: &str, seq: i64, state: State, due: Option<SystemTime>) -> LedgerRecord {
    let event = Event {
        body: b"ok".to_vec(),
        content_type: None,
        properties: Default::default(),
        hub: "hub".into(),
        partition_id: "0".into(),
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
    let mut rec = LedgerRecord::first_failure(&event, fast_policy(5), SystemTime::UNIX_EPOCH);
    rec.attempts = 1;
    rec.last_error = Some("scripted failure 1".into());
    rec.last_delay_ms = Some(1_000);
    // Any state, as a record written by hand may be (a dead letter without its reason).
    rec.force_state(state, due.map(ms), None);
    rec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_finds_an_overdue_retry_among_many_settled_records_without_listing_them() {
    const SETTLED: usize = 1_200;
    let bed = Bed::start(1).await;
    let ledger = bed.ledger();
    let clock = bed.clock();
    let now = clock.now();
    // A deployment's ledger from its first start on (its pending index covers it).
    assert!(ledger.pending().await.unwrap().is_empty());
    // History: events that failed once and were delivered on their retry.
    use futures::StreamExt as _;
    futures::stream::iter(0..SETTLED)
        .for_each_concurrent(32, |i| {
            let ledger = ledger.clone();
            async move {
                let key = format!("settled-{i}");
                let waiting = record(&key, i as i64, State::RetryScheduled, Some(now));
                ledger.put(&waiting, None).await.unwrap();
                let hubguard::ledger::Versioned {
                    value: mut rec,
                    etag,
                } = ledger.get(&key).await.unwrap().unwrap();
                rec.deliver();
                rec.attempts = 2;
                ledger.put(&rec, Some(&etag)).await.unwrap();
            }
        })
        .await;
    assert!(
        ledger.pending().await.unwrap().is_empty(),
        "settled records leave no index entry"
    );
    // One retry the ledger records as waiting an hour past due, with no message to run it.
    let orphan = record(
        "orphan",
        SETTLED as i64,
        State::RetryScheduled,
        Some(now - Duration::from_secs(3_600)),
    );
    ledger.put(&orphan, None).await.unwrap();
    // And one entry left stale by a crash: its record was delivered, but the process died
    // before the entry went (the record rewritten here without the ledger, as that write).
    let stale = record(
        "crashed",
        SETTLED as i64 + 1,
        State::RetryScheduled,
        Some(now - Duration::from_secs(3_600)),
    );
    ledger.put(&stale, None).await.unwrap();
    let hubguard::ledger::Versioned {
        value: mut delivered,
        etag,
    } = ledger.get("crashed").await.unwrap().unwrap();
    delivered.deliver();
    delivered.attempts = 2;
    bed.records()
        .update(
            &ledger.record_name("crashed"),
            bytes::Bytes::from(serde_json::to_vec(&delivered).unwrap()),
            &etag,
        )
        .await
        .unwrap();
    assert_eq!(
        ledger
            .pending()
            .await
            .unwrap()
            .iter()
            .map(|p| p.key.as_str())
            .collect::<Vec<_>>(),
        vec!["crashed", "orphan"],
        "the stale entry is listed until repaired"
    );

    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.overdue_margin = Duration::from_secs(5);
    let counting = Counting::new(parts.records.clone());
    parts.records = counting.clone();
    let run = Bed::run(parts);
    wait_for(
        "the orphan recovered and delivered",
        &run.health,
        LIMIT,
        || async {
            matches!(ledger.record("orphan").await, Ok(Some(r)) if r.state() == State::Delivered)
                && run.health.snapshot().recovered >= 1
        },
    )
    .await;
    wait_for("the stale entry repaired", &run.health, LIMIT, || async {
        ledger.pending().await.is_ok_and(|p| p.is_empty())
    })
    .await;
    run.stop().await;
    assert_eq!(handler.calls_of("orphan"), vec![2]);
    assert!(
        handler.calls_of("crashed").is_empty(),
        "a stale entry is not trusted"
    );
    let rec = ledger.record("crashed").await.unwrap().unwrap();
    assert_eq!(rec.state(), State::Delivered);
    // Every listing the pipeline made (the sweep, the partition's listing at claim) read the
    // pending index, or the ordered retries' line pointers (the sweep releases a line whose
    // head settled, whatever the setting): a handful of blobs, never the settled records.
    let listings = counting.listings.lock().unwrap().clone();
    assert!(!listings.is_empty());
    for (prefix, n) in &listings {
        assert!(
            prefix.starts_with("pending/")
                || prefix.starts_with("lines/")
                || prefix.starts_with("checkpoints"),
            "listed {prefix}: {listings:?}"
        );
        assert!(*n <= 2, "listed {n} blobs under {prefix}");
    }
    // Reads: the index marker, and the records of the two entries found overdue (and
    // those of the retry that ran) — nothing that grows with the settled records.
    let reads = counting.reads.load(std::sync::atomic::Ordering::Relaxed);
    assert!(reads < 30, "{reads} reads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_settled_deliveries_and_nothing_that_waits_or_is_unsettled() {
    let bed = Bed::start(1).await;
    let ledger = bed.ledger();
    let clock = bed.clock();
    let now = clock.now();
    let delivered = |key: &str, seq: i64| {
        let mut r = record(key, seq, State::Delivered, None);
        r.attempts = 2;
        r
    };
    // A delivery whose event (sequence number 0) the checkpoint will pass; one whose event
    // (sequence number 50) is still ahead of it; a retry that waits; a dead letter.
    ledger.put(&delivered("expired", 0), None).await.unwrap();
    ledger.put(&delivered("unsettled", 50), None).await.unwrap();
    let waiting = record(
        "waiting",
        1,
        State::RetryScheduled,
        Some(now + Duration::from_secs(30 * 86_400)),
    );
    ledger.put(&waiting, None).await.unwrap();
    let mut dead = record("dead", 2, State::DeadLettered, None);
    dead.dead_letter(hubguard::policy::DeadLetterReason::Permanent);
    ledger.put(&dead, None).await.unwrap();

    bed.send(0, &[("first", "ok")]).await;
    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler.clone(), fast_policy(5), "replica-a");
    parts.options.retention = Some(Duration::from_secs(3_600));
    parts.options.retention_sweep = Duration::from_secs(60);
    let run = Bed::run(parts);
    wait_for("first checkpointed", &run.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(0)
    })
    .await;
    // Two hours on: every record is past a one-hour retention.
    clock.advance(Duration::from_secs(7_200));
    wait_for(
        "the settled delivery expired",
        &run.health,
        LIMIT,
        || async { matches!(ledger.get("expired").await, Ok(None)) },
    )
    .await;
    run.stop().await;
    for key in ["unsettled", "waiting", "dead"] {
        assert!(ledger.get(key).await.unwrap().is_some(), "{key} is kept");
    }
    assert_eq!(
        ledger
            .pending()
            .await
            .unwrap()
            .iter()
            .map(|p| p.key.as_str())
            .collect::<Vec<_>>(),
        vec!["waiting"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_an_expired_record_says_how_long_records_are_kept() {
    let bed = Bed::start(1).await;
    let ledger = bed.ledger();
    let mut rec = record("expired-key", 0, State::Delivered, None);
    rec.attempts = 2;
    ledger.put(&rec, None).await.unwrap();
    // Retention passes it (its event settled, its last write before the cutoff).
    let later = SystemTime::now() + Duration::from_secs(60);
    let expired = ledger.expire(later, &|_, _| true).await.unwrap();
    assert_eq!(expired.deleted, 1);
    assert!(ledger.get("expired-key").await.unwrap().is_none());

    let dir = tempfile::tempdir().unwrap();
    let config = write_config(&bed, dir.path());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["status", "expired-key", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(text.contains("kept 7 days after delivery"), "{text}");
    assert!(text.contains("has expired"), "{text}");
    let json = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["status", "expired-key", "--json", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["delivered_records_kept_days"], 7);
    assert_eq!(v["state"], "UNKNOWN");
    // Since when a delivered record would still be there: 7 days before now.
    let since = v["records_kept_since"]
        .as_str()
        .expect("records_kept_since");
    let since =
        time::OffsetDateTime::parse(since, &time::format_description::well_known::Rfc3339).unwrap();
    let age = (time::OffsetDateTime::now_utc() - since).whole_seconds();
    assert!((age - 7 * 86_400).abs() < 600, "{v}");
    assert!(v["detail"].as_str().unwrap().contains("kept 7 days"), "{v}");
}

/// A configuration on the bed for the command line (the handler is never called).
fn write_config(bed: &Bed, dir: &std::path::Path) -> std::path::PathBuf {
    let config = dir.join("hubguard.toml");
    std::fs::write(
        &config,
        format!(
            "[eventhubs]\nconnection_string = \"{}\"\nhub = \"hub\"\n[servicebus]\nconnection_string = \"{}\"\n[storage]\ncontainer_url = \"{}\"\n[handler]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/events\"\n[ledger]\nretention_days = 7\n",
            bed.eh.connection_string(),
            bed.sb.connection_string(),
            bed.blob.container_url("hubguard"),
        ),
    )
    .unwrap();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_kept_until_purged_and_a_dry_run_deletes_nothing() {
    let bed = Bed::start(1).await;
    let ledger = bed.ledger();
    let now = SystemTime::now();
    for (key, age_days) in [("old-dead", 40u64), ("new-dead", 1)] {
        let mut dead = record(key, 0, State::DeadLettered, None);
        dead.dead_letter(hubguard::policy::DeadLetterReason::Permanent);
        dead.updated_ms = ms(now - Duration::from_secs(age_days * 86_400));
        ledger.index_dead_letter(key).await.unwrap();
        ledger.put(&dead, None).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(&bed, dir.path());
    let purge = |extra: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"));
        c.args([
            "dead-letters",
            "purge",
            "--before",
            "30d",
            "--json",
            "--config",
        ])
        .arg(&config)
        .args(extra);
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let dry = purge(&["--dry-run"]);
    let lines: Vec<serde_json::Value> = dry
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{dry}");
    assert_eq!(
        (lines[0]["key"].as_str(), lines[0]["purged"].as_bool()),
        (Some("old-dead"), Some(false))
    );
    assert!(
        ledger.get("old-dead").await.unwrap().is_some(),
        "a dry run deletes nothing"
    );

    let done = purge(&[]);
    assert!(done.contains("\"purged\":true"), "{done}");
    assert!(ledger.get("old-dead").await.unwrap().is_none());
    assert!(
        ledger.get("new-dead").await.unwrap().is_some(),
        "a newer dead letter stays"
    );
    assert_eq!(
        ledger.dead_letter_keys().await.unwrap(),
        vec!["new-dead".to_string()]
    );
}
