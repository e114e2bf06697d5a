use super::*;
use crate::event::Event;
use crate::policy::{DeadLetterReason, RetryPolicy};

/// Records as this version and the ones before it write them (waiting, dead-lettered,
/// delivered on a replay): each reads, and writes back byte for byte.
const RECORDS_ON_THE_WIRE: [&str; 3] = [
    r#"{"key":"k","correlation_id":"c","event_type":"order.created","state":"RETRY_SCHEDULED","attempts":2,"next_attempt_ms":1700000030000,"first_failure_ms":1700000000000,"updated_ms":1700000020000,"last_error":"503","dead_letter_reason":null,"last_delay_ms":10000,"policy":{"name":"fibonacci","curve":"fibonacci","base_s":10,"floor_s":10,"cap_s":604800,"max_attempts":29,"max_age_s":null},"attempt_base":0,"history":[{"attempt":1,"started_ms":1700000000000,"finished_ms":1700000000100,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000010000,"trace_id":"t1"},{"attempt":2,"started_ms":1700000010000,"finished_ms":1700000020000,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000030000,"trace_id":"t2","retry_after_capped_from_s":600}],"event":{"body":"eyJuIjoxfQ==","content_type":"application/json","properties":{},"hub":"h","partition_id":"0","sequence_number":7,"offset":"1024","enqueued_ms":1000,"partition_key":null,"identity":{"idempotency_key":"k","correlation_id":"c","event_type":"order.created"}},"indexed":{"attempt":3,"due_ms":1700000030000}}"#,
    r#"{"key":"k","correlation_id":"c","event_type":"order.created","state":"DEAD_LETTERED","attempts":2,"next_attempt_ms":null,"first_failure_ms":1700000000000,"updated_ms":1700000020000,"last_error":"503","dead_letter_reason":"attempts_exhausted","last_delay_ms":10000,"policy":{"name":"fibonacci","curve":"fibonacci","base_s":10,"floor_s":10,"cap_s":604800,"max_attempts":29,"max_age_s":null},"attempt_base":0,"history":[{"attempt":1,"started_ms":1700000000000,"finished_ms":1700000000100,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000010000,"trace_id":"t1"},{"attempt":2,"started_ms":1700000010000,"finished_ms":1700000020000,"outcome":"dead_lettered","error":"503","next_attempt_ms":null,"trace_id":"t2"}],"event":{"body":"eyJuIjoxfQ==","content_type":"application/json","properties":{},"hub":"h","partition_id":"0","sequence_number":7,"offset":"1024","enqueued_ms":1000,"partition_key":null,"identity":{"idempotency_key":"k","correlation_id":"c","event_type":"order.created"}}}"#,
    r#"{"key":"k","correlation_id":"c","event_type":"order.created","state":"DELIVERED","attempts":2,"next_attempt_ms":null,"first_failure_ms":1700000000000,"updated_ms":1700000020000,"last_error":"503","dead_letter_reason":null,"last_delay_ms":10000,"policy":{"name":"fibonacci","curve":"fibonacci","base_s":10,"floor_s":10,"cap_s":604800,"max_attempts":29,"max_age_s":null},"attempt_base":0,"history":[{"attempt":1,"started_ms":1700000000000,"finished_ms":1700000000100,"outcome":"retry_scheduled","error":"503","next_attempt_ms":1700000010000,"trace_id":"t1"},{"attempt":2,"started_ms":1700000010000,"finished_ms":1700000020000,"outcome":"delivered_on_replay","error":null,"next_attempt_ms":null,"trace_id":"t2"}],"event":{"body":"eyJuIjoxfQ==","content_type":"application/json","properties":{},"hub":"h","partition_id":"0","sequence_number":7,"offset":"1024","enqueued_ms":1000,"partition_key":null,"identity":{"idempotency_key":"k","correlation_id":"c","event_type":"order.created"}}}"#,
];

#[test]
fn records_on_the_wire_read_and_write_back_byte_for_byte() {
    let outcomes = |rec: &LedgerRecord| -> Vec<HistoryOutcome> {
        rec.history.iter().map(|h| h.outcome.clone()).collect()
    };
    let read: Vec<LedgerRecord> = RECORDS_ON_THE_WIRE
        .iter()
        .map(|json| serde_json::from_str(json).unwrap())
        .collect();
    for (rec, json) in read.iter().zip(RECORDS_ON_THE_WIRE) {
        assert_eq!(serde_json::to_string(rec).unwrap(), json);
    }
    use HistoryOutcome::*;
    assert_eq!(
        (read[0].state, read[0].next_attempt_ms, outcomes(&read[0])),
        (
            State::RetryScheduled,
            Some(1_700_000_030_000),
            vec![RetryScheduled, RetryScheduled]
        )
    );
    assert_eq!(
        (
            read[1].state,
            &read[1].dead_letter_reason,
            outcomes(&read[1])
        ),
        (
            State::DeadLettered,
            &Some(DeadLetterReason::AttemptsExhausted),
            vec![RetryScheduled, DeadLettered]
        )
    );
    assert_eq!(
        (read[2].state, outcomes(&read[2])),
        (State::Delivered, vec![RetryScheduled, DeliveredOnReplay])
    );
}

#[test]
fn history_outcomes_keep_their_strings_and_an_unknown_one_survives() {
    for (outcome, text) in [
        (HistoryOutcome::Delivered, "delivered"),
        (HistoryOutcome::DeliveredOnReplay, "delivered_on_replay"),
        (HistoryOutcome::RetryScheduled, "retry_scheduled"),
        (HistoryOutcome::DeadLettered, "dead_lettered"),
        (HistoryOutcome::Cancelled, "cancelled"),
        (HistoryOutcome::Parked, "parked"),
        (HistoryOutcome::Other("rerouted".into()), "rerouted"),
    ] {
        let json = format!("\"{text}\"");
        assert_eq!(serde_json::to_string(&outcome).unwrap(), json);
        assert_eq!(
            serde_json::from_str::<HistoryOutcome>(&json).unwrap(),
            outcome
        );
        assert_eq!(outcome, text);
        assert_eq!(format!("{outcome:<10}|"), format!("{text:<10}|"));
    }
}

#[test]
fn the_verdict_follows_the_record() {
    let event = crate::event::Event {
        body: Vec::new(),
        content_type: None,
        properties: Default::default(),
        hub: "h".into(),
        partition_id: "0".into(),
        sequence_number: 1,
        offset: None,
        enqueued_ms: None,
        partition_key: None,
        identity: crate::event::Identity {
            idempotency_key: "k".into(),
            correlation_id: "k".into(),
            event_type: None,
        },
    };
    let mut rec = LedgerRecord {
        key: "k".into(),
        correlation_id: "k".into(),
        event_type: None,
        state: State::RetryScheduled,
        attempts: 2,
        next_attempt_ms: Some(0),
        first_failure_ms: 0,
        updated_ms: 0,
        last_error: None,
        dead_letter_reason: None,
        last_delay_ms: None,
        policy: RetryPolicy::seed_fibonacci(),
        attempt_base: 0,
        history: Vec::new(),
        event,
        quarantined: None,
        event_unknown: false,
        claim: None,
        run_now: None,
        indexed: None,
    };
    assert_eq!(Verdict::of(None, 1), Verdict::Unrecorded);
    assert_eq!(Verdict::of(Some(&rec), 1), Verdict::Stale);
    assert_eq!(Verdict::of(Some(&rec), 2), Verdict::Stale);
    assert_eq!(Verdict::of(Some(&rec), 3), Verdict::Current);
    rec.state = State::Delivered;
    assert_eq!(Verdict::of(Some(&rec), 3), Verdict::Final(State::Delivered));
}

#[test]
fn blob_names_stay_within_azures_limit_for_any_key() {
    struct Nothing;
    #[async_trait::async_trait]
    impl RecordStore for Nothing {
        async fn read(&self, _: &str) -> Result<Option<crate::azure::Record>, StoreError> {
            Ok(None)
        }
        async fn create(&self, _: &str, _: Bytes) -> Result<String, StoreError> {
            Ok(String::new())
        }
        async fn update(&self, _: &str, _: Bytes, _: &str) -> Result<String, StoreError> {
            Ok(String::new())
        }
        async fn delete(&self, _: &str, _: &str) -> Result<(), StoreError> {
            Ok(())
        }
        async fn list(
            &self,
            _: &str,
        ) -> Result<Vec<crate::azure::record_store::Listed>, StoreError> {
            Ok(Vec::new())
        }
    }
    let ledger = Ledger::new(Arc::new(Nothing), "hub", "$Default");
    // A short key keeps its readable (base64) name.
    assert_eq!(
        ledger.record_name("a/b"),
        format!("ledger/hub/$default/{}", encode_key("a/b"))
    );
    for len in [300, 760, 800, 5_000, 1_000_000] {
        let key = "k".repeat(len);
        let name = ledger.record_name(&key);
        assert!(name.len() <= BLOB_NAME_LIMIT, "{len}: {}", name.len());
        assert_eq!(name, ledger.record_name(&key), "stable");
        assert_ne!(name, ledger.record_name(&format!("{key}x")), "distinct");
    }
    assert!(ledger.dead_letter_name(&"é".repeat(2_000)).len() <= BLOB_NAME_LIMIT);
}

fn waiting(key: &str, attempts: u32, due_ms: i64) -> LedgerRecord {
    LedgerRecord {
        key: key.into(),
        correlation_id: key.into(),
        event_type: None,
        state: State::RetryScheduled,
        attempts,
        next_attempt_ms: Some(due_ms),
        first_failure_ms: 0,
        updated_ms: 0,
        last_error: Some("boom".into()),
        dead_letter_reason: None,
        last_delay_ms: None,
        policy: RetryPolicy::seed_fibonacci(),
        attempt_base: 0,
        history: Vec::new(),
        event: Event {
            body: Vec::new(),
            content_type: None,
            properties: Default::default(),
            hub: "hub".into(),
            partition_id: "3".into(),
            sequence_number: 9,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: crate::event::Identity {
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

fn memory() -> (Arc<crate::azure::memory::MemoryRecordStore>, Ledger) {
    let store = Arc::new(crate::azure::memory::MemoryRecordStore::new());
    let ledger = Ledger::new(store.clone(), "hub", "$Default");
    (store, ledger)
}

/// The record written as a crash would leave it: without the ledger's index step.
async fn write_raw(store: &dyn RecordStore, ledger: &Ledger, rec: &LedgerRecord) {
    let name = ledger.record_name(&rec.key);
    let etag = store.read(&name).await.unwrap().map(|r| r.etag);
    store
        .write_tagged(
            &name,
            Bytes::from(serde_json::to_vec(rec).unwrap()),
            etag.as_deref(),
            &tags_of(rec),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn the_index_follows_the_record_and_claims_write_no_entry() {
    let (store, ledger) = memory();
    ledger.put(&waiting("k", 1, 1_000), None).await.unwrap();
    let p = ledger.pending().await.unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!(
        (p[0].attempt, p[0].due, p[0].partition.as_deref()),
        (2, at(1_000), Some("3"))
    );
    assert_eq!(p[0].sequence_number, Some(9));
    // A claim changes neither due time nor attempt: no entry write (the mark says so).
    let crate::ledger::Versioned {
        value: mut rec,
        etag,
    } = ledger.get("k").await.unwrap().unwrap();
    assert_eq!(
        rec.indexed,
        Some(IndexMark {
            attempt: 2,
            due_ms: 1_000
        })
    );
    let entry = store.read(&ledger.entry_name("k")).await.unwrap().unwrap();
    rec.claim = Some(Claim {
        attempt: 2,
        owner: "o".into(),
        instance: "i".into(),
        until_ms: 5_000,
    });
    let etag = ledger.put(&rec, Some(&etag)).await.unwrap();
    let same = store.read(&ledger.entry_name("k")).await.unwrap().unwrap();
    assert_eq!(entry.etag, same.etag, "no entry write for a claim");
    // The retry failed again: the entry moves with the record.
    rec.attempts = 2;
    rec.next_attempt_ms = Some(9_000);
    rec.claim = None;
    let etag = ledger.put(&rec, Some(&etag)).await.unwrap();
    let p = ledger.pending().await.unwrap();
    assert_eq!((p[0].attempt, p[0].due), (3, at(9_000)));
    // Delivered: the entry is gone.
    let mut rec = ledger.record("k").await.unwrap().unwrap();
    rec.state = State::Delivered;
    rec.attempts = 3;
    rec.next_attempt_ms = None;
    ledger.put(&rec, Some(&etag)).await.unwrap();
    assert!(ledger.pending().await.unwrap().is_empty());
    assert!(store.read(&ledger.entry_name("k")).await.unwrap().is_none());
}

#[tokio::test]
async fn a_stale_entry_is_repaired_against_its_record_not_trusted() {
    let (store, ledger) = memory();
    assert!(ledger.pending().await.unwrap().is_empty(), "a new ledger");
    for k in ["moved", "settled", "gone", "true"] {
        ledger.put(&waiting(k, 1, 1_000), None).await.unwrap();
    }
    // Crashes between a record's write and its entry's: a due time that moved later,
    // a record delivered, a record removed.
    let mut moved = ledger.record("moved").await.unwrap().unwrap();
    moved.attempts = 2;
    moved.next_attempt_ms = Some(60_000);
    write_raw(store.as_ref(), &ledger, &moved).await;
    let mut settled = ledger.record("settled").await.unwrap().unwrap();
    settled.state = State::Delivered;
    settled.next_attempt_ms = None;
    write_raw(store.as_ref(), &ledger, &settled).await;
    let name = ledger.record_name("gone");
    let etag = store.read(&name).await.unwrap().unwrap().etag;
    store.delete(&name, &etag).await.unwrap();

    let listed = ledger.pending().await.unwrap();
    assert_eq!(listed.len(), 4, "stale entries are listed until repaired");
    let mut repairs = std::collections::BTreeMap::new();
    for p in &listed {
        repairs.insert(p.key.clone(), ledger.repair_pending(p).await.unwrap());
    }
    assert_eq!(repairs["moved"], Repair::Rewritten);
    assert_eq!(repairs["settled"], Repair::Removed);
    assert_eq!(repairs["gone"], Repair::Removed);
    assert_eq!(repairs["true"], Repair::Accurate);
    let after = ledger.pending().await.unwrap();
    let keys: Vec<_> = after
        .iter()
        .map(|p| (p.key.as_str(), p.attempt, p.due))
        .collect();
    assert_eq!(keys, vec![("true", 2, at(1_000)), ("moved", 3, at(60_000))]);
}

#[tokio::test]
async fn a_late_removal_leaves_the_entry_of_a_replay_alone() {
    let (store, ledger) = memory();
    ledger.put(&waiting("k", 1, 1_000), None).await.unwrap();
    // A replay wrote an entry for attempt 4 after this record was dead-lettered at
    // attempt 1 ran; the dead letter's late removal finds an entry for a later attempt.
    let replayed = waiting("k", 3, 2_000);
    ledger.write_entry(&replayed).await.unwrap();
    ledger.remove_entry("k", 1).await.unwrap();
    assert!(store.read(&ledger.entry_name("k")).await.unwrap().is_some());
    ledger.remove_entry("k", 4).await.unwrap();
    assert!(store.read(&ledger.entry_name("k")).await.unwrap().is_none());
}

#[tokio::test]
async fn records_written_before_the_index_are_indexed_once() {
    let (store, ledger) = memory();
    // An older version wrote records with no index: one waiting, one delivered.
    write_raw(store.as_ref(), &ledger, &waiting("old", 1, 1_000)).await;
    let mut done = waiting("done", 1, 1_000);
    done.state = State::Delivered;
    write_raw(store.as_ref(), &ledger, &done).await;
    let p = ledger.pending().await.unwrap();
    assert_eq!(
        p.iter().map(|p| p.key.as_str()).collect::<Vec<_>>(),
        vec!["old"]
    );
    assert!(store.read(&ledger.index_marker()).await.unwrap().is_some());
    // Another replica (a new Ledger) reads the marker and lists the index alone.
    let again = Ledger::new(store.clone(), "hub", "$Default");
    let reads = store.reads();
    assert_eq!(again.pending().await.unwrap().len(), 1);
    assert_eq!(store.reads() - reads, 1, "the marker only");
}

#[test]
fn a_key_without_a_record_says_how_long_delivered_records_are_kept() {
    use std::time::Duration;
    let store = Arc::new(crate::azure::memory::MemoryRecordStore::new());
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(30 * 86_400);
    let week = Ledger::new(store.clone(), "hub", "$Default")
        .with_retention(Some(Duration::from_secs(7 * 86_400)))
        .no_record("k", now);
    assert_eq!(week["state"], "UNKNOWN");
    assert_eq!(week["delivered_records_kept_days"], 7);
    let since = crate::clock::rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(23 * 86_400));
    assert_eq!(week["records_kept_since"], since.as_str());
    assert!(week["detail"]
        .as_str()
        .unwrap()
        .contains(&format!("delivered on a retry before {since}")));
    let forever = Ledger::new(store.clone(), "hub", "$Default")
        .with_retention(None)
        .no_record("k", now);
    assert!(forever["records_kept_since"].is_null());
    assert!(forever["detail"]
        .as_str()
        .unwrap()
        .contains("kept for ever"));
    let unknown = Ledger::new(store, "hub", "$Default").no_record("k", now);
    assert!(unknown["delivered_records_kept_days"].is_null());
}

#[test]
fn keys_survive_any_characters() {
    for k in ["a/b/c", "order 42 é", "%2F", "hub/0/17"] {
        assert_eq!(decode_key(&encode_key(k)).as_deref(), Some(k));
        assert!(!encode_key(k).contains('/'));
    }
}

fn keys_of(page: &crate::ledger::PendingPage) -> Vec<&str> {
    page.soonest.iter().map(|p| p.key.as_str()).collect()
}

#[tokio::test(start_paused = true)]
async fn a_kept_listing_answers_pages_from_memory_with_this_replicas_changes_applied() {
    use std::time::Duration;
    let (store, ledger) = memory();
    let other = Ledger::new(store.clone(), "hub", "$Default"); // another replica
    ledger.pending().await.unwrap();
    assert!(
        ledger.pending_page(|_| true, 10).is_none(),
        "not kept unless asked"
    );
    ledger.keep_pending_listing();
    ledger.put(&waiting("a", 1, 3_000), None).await.unwrap();
    assert!(
        ledger.pending_page(|_| true, 10).is_none(),
        "nothing listed yet"
    );
    ledger.pending().await.unwrap(); // the overdue sweep's listing
    other.put(&waiting("b", 1, 1_000), None).await.unwrap();
    ledger.put(&waiting("c", 1, 2_000), None).await.unwrap();
    // This replica's retry shows at once; the other's once listed again.
    let page = ledger.pending_page(|_| true, 10).unwrap();
    assert_eq!((keys_of(&page), page.waiting), (vec!["c", "a"], 2));
    // Delivered here: gone at once.
    let found = ledger.get("c").await.unwrap().unwrap();
    let mut rec = found.value;
    rec.state = State::Delivered;
    rec.next_attempt_ms = None;
    ledger.put(&rec, Some(&found.etag)).await.unwrap();
    assert_eq!(keys_of(&ledger.pending_page(|_| true, 10).unwrap()), ["a"]);
    // Fresh enough: no listing.
    ledger
        .refresh_pending(Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(keys_of(&ledger.pending_page(|_| true, 10).unwrap()), ["a"]);
    tokio::time::advance(Duration::from_secs(6)).await;
    let page = ledger.pending_page(|_| true, 10).unwrap();
    assert!(page.age >= Duration::from_secs(6), "{:?}", page.age);
    ledger
        .refresh_pending(Duration::from_secs(5))
        .await
        .unwrap();
    let page = ledger.pending_page(|_| true, 10).unwrap();
    assert_eq!((keys_of(&page), page.age), (vec!["b", "a"], Duration::ZERO));
    // The filter counts every match; the limit bounds the rows, soonest first.
    let page = ledger.pending_page(|p| p.key == "a", 10).unwrap();
    assert_eq!(
        (page.waiting, page.matched, keys_of(&page)),
        (2, 1, vec!["a"])
    );
    let page = ledger.pending_page(|_| true, 1).unwrap();
    assert_eq!((page.matched, keys_of(&page)), (2, vec!["b"]));
    // What every other caller gets is the listing itself, as before.
    let listed: Vec<String> = ledger
        .pending()
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.key)
        .collect();
    assert_eq!(listed, ["b", "a"]);
}

#[tokio::test]
async fn a_listing_that_crossed_this_replicas_writes_keeps_them_and_an_older_one_loses() {
    let (_, ledger) = memory();
    ledger.keep_pending_listing();
    let entry = |key: &str, attempt: u32, due_ms: i64| Pending {
        key: key.into(),
        attempt,
        due: at(due_ms),
        last_error: None,
        partition: None,
        sequence_number: None,
        event_type: None,
        correlation_id: None,
    };
    // Written and removed while a listing ran that saw neither change.
    let ticket = ledger.listing.start().unwrap();
    ledger.listing.wrote(entry("x", 1, 5_000));
    ledger.listing.removed("y", 2);
    ledger.listing.removed("z", 1); // z waits for attempt 3 now: a removal for 1 leaves it
    ticket.install(&[entry("y", 2, 1_000), entry("z", 3, 2_000)]);
    assert_eq!(
        keys_of(&ledger.pending_page(|_| true, 10).unwrap()),
        ["z", "x"]
    );
    // A listing that started before the one installed is not installed over it.
    let older = ledger.listing.start().unwrap();
    let newer = ledger.listing.start().unwrap();
    newer.install(&[entry("n", 1, 1_000)]);
    older.install(&[entry("o", 1, 1_000)]);
    assert_eq!(keys_of(&ledger.pending_page(|_| true, 10).unwrap()), ["n"]);
    // A listing dropped unfinished leaves nothing behind.
    drop(ledger.listing.start().unwrap());
    assert!(ledger.listing.idle());
}
