use super::*;
use crate::azure::memory::{MemoryRecordStore, MemoryRetryQueue};
use crate::azure::{OutgoingMessage, RecordStore};
use crate::clock::{at, Clock};
use crate::event::{Event, Identity};
use crate::handler::{Failure, Outcome};
use crate::policy::{Curve, RetryPolicy};

fn event(key: &str) -> Event {
    Event {
        body: b"payload".to_vec(),
        content_type: None,
        properties: Default::default(),
        hub: "hub".into(),
        partition_id: "0".into(),
        sequence_number: 7,
        offset: None,
        enqueued_ms: None,
        partition_key: None,
        identity: Identity {
            idempotency_key: key.into(),
            correlation_id: key.into(),
            event_type: None,
        },
    }
}

struct Bed {
    clock: Arc<Clock>,
    records: Arc<MemoryRecordStore>,
    queue: Arc<MemoryRetryQueue>,
    settler: Settler,
}

fn bed_with(queue: Option<Arc<dyn RetryQueue>>) -> Bed {
    let clock = Arc::new(Clock::default());
    let records = Arc::new(MemoryRecordStore::new());
    let memory = Arc::new(MemoryRetryQueue::new(clock.clone()));
    let ledger = Ledger::new(records.clone(), "hub", "$Default");
    let policy = RetryPolicy {
        name: "test".into(),
        curve: Curve::Fixed,
        base_s: 10,
        floor_s: 10,
        cap_s: 60,
        max_attempts: 3,
        max_age_s: None,
    };
    let settler = Settler::new(
        ledger,
        queue.unwrap_or_else(|| memory.clone()),
        Policies {
            default: policy,
            by_type: HashMap::new(),
        },
    )
    .with_clock(clock.clone());
    Bed {
        clock,
        records,
        queue: memory,
        settler,
    }
}

fn bed() -> Bed {
    bed_with(None)
}

async fn fail(b: &Bed, key: &str, attempt: u32, source: Source) -> Result<Settled, SettleError> {
    b.settler
        .settle(&Report {
            event: &event(key),
            attempt,
            source,
            started: b.clock.now(),
            outcome: &Outcome::Failed(Failure::transient("boom")),
            trace_id: "0af7651916cd43dd8448eb211c80319c",
            traceparents: &[],
        })
        .await
}

#[tokio::test]
async fn a_failure_records_the_attempt_then_schedules_a_claim_check() {
    let b = bed();
    let s = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    assert!(
        matches!(s, Settled::RetryScheduled { attempt: 2, .. }),
        "{s:?}"
    );
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::RetryScheduled, 1));
    assert_eq!(b.queue.accepted(), vec!["k-attempt-2"]);
    let body: RetryMessage = serde_json::from_str(&b.queue.bodies()[0]).unwrap();
    assert_eq!((body.v, body.key.as_str(), body.attempt), (2, "k", 2));
    assert!(body.event.is_none(), "the event stays in the ledger");
    assert_eq!(Some(at(body.due_ms)), rec.next_attempt_at());
}

/// A transient failure of `key`'s first attempt, settled as known to have no record.
async fn first_unrecorded(b: &Bed, key: &str) -> Settled {
    b.settler
        .settle_unrecorded(&Report {
            event: &event(key),
            attempt: 1,
            source: Source::EventHubs,
            started: b.clock.now(),
            outcome: &Outcome::Failed(Failure::transient("boom")),
            trace_id: "0af7651916cd43dd8448eb211c80319c",
            traceparents: &[],
        })
        .await
        .unwrap()
}

/// A first failure of an event its partition knows has no pending record: created with no
/// read; and when a record is there after all (a retry scheduled by another reader, an
/// earlier delivery), the create fails, the record is read and the decision made on it.
#[tokio::test]
async fn a_first_failure_known_unrecorded_creates_its_record_without_reading() {
    let b = bed();
    let before = b.records.reads();
    let s = first_unrecorded(&b, "k").await;
    assert!(
        matches!(s, Settled::RetryScheduled { attempt: 2, .. }),
        "{s:?}"
    );
    assert_eq!(b.records.reads(), before, "no read before the create");
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::RetryScheduled, 1));
    assert_eq!(b.queue.accepted(), vec!["k-attempt-2"]);

    // Recorded already (attempt 1 scheduled by another reader of the partition): the
    // create fails, the record is read, and the recorded retry is sent again (the same
    // MessageId, dropped by duplicate detection), not a second attempt counted.
    let again = first_unrecorded(&b, "k").await;
    assert!(
        matches!(again, Settled::RetryScheduled { attempt: 2, .. }),
        "{again:?}"
    );
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::RetryScheduled, 1));
    assert!(b.queue.accepted().iter().all(|id| id == "k-attempt-2"));

    // Delivered on its retry before, read again from Event Hubs (a rewind) and failing
    // now: the delivered record stands, no retry is scheduled.
    fail(&b, "d", 1, Source::EventHubs).await.unwrap();
    b.settler
        .settle(&Report {
            event: &event("d"),
            attempt: 2,
            source: Source::Retry,
            started: b.clock.now(),
            outcome: &Outcome::Delivered,
            trace_id: "0af7651916cd43dd8448eb211c80319c",
            traceparents: &[],
        })
        .await
        .unwrap();
    let messages = b.queue.len();
    let s = first_unrecorded(&b, "d").await;
    assert!(!matches!(s, Settled::RetryScheduled { .. }), "{s:?}");
    let rec = b.settler.ledger.record("d").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
    assert_eq!(b.queue.len(), messages, "no retry message");
}

#[tokio::test]
async fn settling_from_the_record_in_hand_reads_nothing_unless_someone_wrote_since() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    let read = b.settler.ledger.get("k").await.unwrap().unwrap();
    let k = event("k");
    let report = Report {
        event: &k,
        attempt: 2,
        source: Source::Retry,
        started: b.clock.now(),
        outcome: &Outcome::Delivered,
        trace_id: "0af7651916cd43dd8448eb211c80319c",
        traceparents: &[],
    };
    let delivered = |read| b.settler.settle_from(read, &report);
    // Nobody wrote since the read: the write's If-Match proves it, no second read.
    let before = b.records.reads();
    assert_eq!(delivered(Some(read)).await.unwrap(), Settled::Delivered);
    assert_eq!(b.records.reads(), before, "one read per retry");
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));

    // Somebody wrote after the read (attempt 2 failed elsewhere): the conflict reads the
    // record again and decides on what it says now.
    fail(&b, "j", 1, Source::EventHubs).await.unwrap();
    let stale = b.settler.ledger.get("j").await.unwrap().unwrap();
    fail(&b, "j", 2, Source::Retry).await.unwrap();
    let messages = b.queue.len();
    let failed = b
        .settler
        .settle_from(
            Some(stale),
            &Report {
                event: &event("j"),
                attempt: 2,
                source: Source::Retry,
                started: b.clock.now(),
                outcome: &Outcome::Failed(Failure::transient("boom")),
                trace_id: "0af7651916cd43dd8448eb211c80319c",
                traceparents: &[],
            },
        )
        .await
        .unwrap();
    assert!(
        matches!(failed, Settled::RetryScheduled { attempt: 3, .. }),
        "{failed:?}"
    );
    let rec = b.settler.ledger.record("j").await.unwrap().unwrap();
    assert_eq!(rec.attempts, 2, "attempt 2 recorded once");
    assert_eq!(
        b.queue.len(),
        messages,
        "no second retry message for attempt 3"
    );
}

#[tokio::test]
async fn a_record_read_early_is_revalidated_by_its_etag() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    let ledger = &b.settler.ledger;
    let etag = ledger.get("k").await.unwrap().unwrap().etag;
    assert!(ledger.get_if_changed("k", &etag).await.unwrap().is_none());
    fail(&b, "k", 2, Source::Retry).await.unwrap();
    let crate::ledger::Versioned {
        value: rec,
        etag: now,
    } = ledger
        .get_if_changed("k", &etag)
        .await
        .unwrap()
        .expect("changed")
        .expect("still there");
    assert_eq!(rec.attempts, 2);
    assert_ne!(now, etag);
    assert!(ledger.get_if_changed("k", &now).await.unwrap().is_none());
    assert_eq!(
        ledger.get_if_changed("gone", &now).await.unwrap(),
        Some(None)
    );
}

#[tokio::test]
async fn a_replayed_attempt_resends_the_recorded_retry_and_counts_nothing() {
    let b = bed();
    let first = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    b.clock.advance(Duration::from_secs(3));
    let replay = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    assert_eq!(first, replay, "the same attempt and due time");
    assert_eq!(
        b.queue.accepted(),
        vec!["k-attempt-2"],
        "the repeat was dropped"
    );
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!(rec.attempts, 1);
    assert_eq!(rec.history.len(), 1);
}

#[tokio::test]
async fn a_final_record_wins_over_late_attempts() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    let delivered = b
        .settler
        .settle(&Report {
            event: &event("k"),
            attempt: 2,
            source: Source::Retry,
            started: b.clock.now(),
            outcome: &Outcome::Delivered,
            trace_id: "t",
            traceparents: &[],
        })
        .await
        .unwrap();
    assert_eq!(delivered, Settled::Delivered);
    let late = fail(&b, "k", 2, Source::Retry).await.unwrap();
    assert_eq!(late, Settled::AlreadyFinal(State::Delivered));
}

struct Refusing;

#[async_trait::async_trait]
impl RetryQueue for Refusing {
    async fn schedule(&self, _: OutgoingMessage) -> Result<(), RetryQueueError> {
        Err(RetryQueueError::Refused {
            status: 400,
            detail: "The message was refused.".into(),
        })
    }
    async fn receive(
        &self,
        _: Duration,
    ) -> Result<Option<crate::azure::ReceivedMessage>, RetryQueueError> {
        Ok(None)
    }
}

#[tokio::test]
async fn a_retry_message_service_bus_refuses_dead_letters_the_event() {
    let b = bed_with(Some(Arc::new(Refusing)));
    let s = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    assert_eq!(s, Settled::DeadLettered(DeadLetterReason::RetryRefused));
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!(rec.state(), State::DeadLettered);
    assert!(rec.last_error.unwrap().contains("refused"));
    assert_eq!(
        b.settler.ledger.dead_letter_keys().await.unwrap(),
        vec!["k"]
    );
}

#[tokio::test]
async fn a_corrupt_record_is_set_aside_and_the_event_dead_lettered() {
    let b = bed();
    let name = b.settler.ledger.record_name("k");
    b.records
        .overwrite(&name, bytes::Bytes::from_static(b"{oops"));
    let s = fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    assert_eq!(s, Settled::DeadLettered(DeadLetterReason::CorruptRecord));
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    let aside = rec.quarantined.unwrap();
    assert_eq!(
        b.records.read(&aside).await.unwrap().unwrap().body,
        bytes::Bytes::from_static(b"{oops")
    );
    assert_eq!(
        rec.event,
        event("k"),
        "the event in hand is kept for a replay"
    );
}

#[tokio::test]
async fn one_copy_claims_an_attempt_and_a_claim_left_behind_expires() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    let read = b.settler.ledger.get("k").await.unwrap().unwrap();
    let ledger = &b.settler.ledger;
    // Two copies read the same record; the first claims it.
    let mine = b
        .settler
        .claim("k", 2, Some(read.clone()), "replica-a", "instance-a")
        .await
        .unwrap();
    let Claimed::Mine(claimed) = mine else {
        panic!("{mine:?}")
    };
    assert_eq!(claimed.value.claim.as_ref().map(|c| c.attempt), Some(2));
    // The second one's compare-and-swap fails; it reads again and finds the live claim.
    let busy = b
        .settler
        .claim("k", 2, Some(read), "replica-b", "instance-b")
        .await
        .unwrap();
    let Claimed::Busy(until) = busy else {
        panic!("{busy:?}")
    };
    assert_eq!(until, b.clock.now().max(until));
    // The same process may take its own claim back (its copy is no longer in hand).
    assert!(matches!(
        b.settler
            .claim("k", 2, None, "replica-a", "instance-a")
            .await
            .unwrap(),
        Claimed::Mine(_)
    ));
    // A claim whose process died expires, and another copy takes it over.
    b.clock.advance(CLAIM_LEASE + Duration::from_secs(1));
    let taken = b
        .settler
        .claim("k", 2, None, "replica-b", "instance-b")
        .await
        .unwrap();
    let Claimed::Mine(taken) = taken else {
        panic!("{taken:?}")
    };
    // Its settlement clears the claim, and later copies find the attempt done.
    let delivered = b
        .settler
        .settle_from(
            Some(*taken),
            &Report {
                event: &event("k"),
                attempt: 2,
                source: Source::Retry,
                started: b.clock.now(),
                outcome: &Outcome::Delivered,
                trace_id: "t",
                traceparents: &[],
            },
        )
        .await
        .unwrap();
    assert_eq!(delivered, Settled::Delivered);
    let rec = ledger.record("k").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.claim), (State::Delivered, None));
    assert!(matches!(
        b.settler
            .claim("k", 2, None, "replica-a", "instance-a")
            .await
            .unwrap(),
        Claimed::Changed(Verdict::Final(State::Delivered), _)
    ));
}

#[tokio::test]
async fn the_sweep_leaves_a_claimed_attempt_alone() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    b.clock.advance(Duration::from_secs(600));
    let claimed = b
        .settler
        .claim("k", 2, None, "replica-a", "instance-a")
        .await
        .unwrap();
    assert!(matches!(claimed, Claimed::Mine(_)));
    let overdue_before = b.clock.now() - Duration::from_secs(300);
    assert!(!b.settler.recover("k", overdue_before).await.unwrap());
    assert_eq!(b.queue.accepted(), vec!["k-attempt-2"]);
}

#[tokio::test]
async fn a_replay_from_event_hubs_settles_only_the_record_of_its_own_event() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    let b = &b;
    let delivered = |e: Event| async move {
        b.settler
            .settle(&Report {
                event: &e,
                attempt: 1,
                source: Source::EventHubs,
                started: b.clock.now(),
                outcome: &Outcome::Delivered,
                trace_id: "t",
                traceparents: &[],
            })
            .await
            .unwrap()
    };
    // Another event that carries the same key: the record's retry is still owed.
    let mut other = event("k");
    other.sequence_number += 1;
    assert_eq!(delivered(other).await, Settled::Delivered);
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!(rec.state(), State::RetryScheduled);
    // The recorded event itself, replayed and delivered: the record says so.
    assert_eq!(delivered(event("k")).await, Settled::Delivered);
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!(
        (rec.state(), rec.attempts, rec.next_attempt_ms()),
        (State::Delivered, 1, None)
    );
}

#[tokio::test]
async fn a_replay_after_later_attempts_is_recorded_as_a_replay_and_ends_the_retries() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    fail(&b, "k", 2, Source::Retry).await.unwrap();
    let settled = b
        .settler
        .settle(&Report {
            event: &event("k"),
            attempt: 1,
            source: Source::EventHubs,
            started: b.clock.now(),
            outcome: &Outcome::Delivered,
            trace_id: "t",
            traceparents: &[],
        })
        .await
        .unwrap();
    assert_eq!(settled, Settled::Delivered);
    let rec = b.settler.ledger.record("k").await.unwrap().unwrap();
    assert_eq!((rec.state(), rec.attempts), (State::Delivered, 2));
    let last = rec.history.last().unwrap();
    assert_eq!(
        (last.attempt, last.outcome.as_str()),
        (1, DELIVERED_ON_REPLAY)
    );
    // The retry scheduled for attempt 3 finds the event final and runs nothing.
    assert_eq!(Verdict::of(Some(&rec), 3), Verdict::Final(State::Delivered));
}

#[tokio::test]
async fn an_overdue_retry_is_recovered_once_under_a_fresh_message_id() {
    let b = bed();
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    b.clock.advance(Duration::from_secs(600));
    let overdue_before = b.clock.now() - Duration::from_secs(300);
    assert!(b.settler.recover("k", overdue_before).await.unwrap());
    assert!(
        !b.settler.recover("k", overdue_before).await.unwrap(),
        "due time moved to now"
    );
    let accepted = b.queue.accepted();
    assert_eq!(accepted.len(), 2);
    assert!(
        accepted[1].starts_with("k-attempt-2-recovered-"),
        "{accepted:?}"
    );
    let pending = b.settler.ledger.pending().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].due, b.clock.now().min(pending[0].due));
}
#[test]
fn every_message_id_names_its_deployment_within_128_characters_for_any_key() {
    let d = Deployment::new("ns.servicebus.windows.net", "hub", "$Default");
    let readable = "k".repeat(super::super::message_id::READABLE_KEY_LIMIT);
    for key in [readable.as_str(), &"é".repeat(300), "~x", "a b"] {
        let retry = MessageId::retry(key, u32::MAX);
        for id in [
            retry.copy(RetryCopy::Rescued {
                dead_letter_seq: i64::MAX,
            }),
            // Times in ms since the epoch: 13 digits until the year 2286.
            retry.copy(RetryCopy::Deferred {
                until_ms: 9_999_999_999_999,
            }),
            retry.copy(RetryCopy::Recovered {
                at_ms: 9_999_999_999_999,
            }),
            retry.copy(RetryCopy::Forwarded {
                sequence_number: i64::MAX,
            }),
            retry.copy(RetryCopy::Pulled {
                at_ms: 9_999_999_999_999,
            }),
            retry.copy(RetryCopy::Replayed {
                at_ms: 9_999_999_999_999,
            }),
            MessageId::DeadLetter {
                key,
                attempts: u32::MAX,
            },
        ] {
            let q = id.qualified(Some(&d));
            assert!(q.chars().count() <= 128, "{q}");
            assert!(q.starts_with(&format!("{}.", d.id)), "{q}");
        }
    }
    assert_eq!(
        qualified(Some(&d), &message_id("order-42", 2)),
        format!("{}.order-42-attempt-2", d.id)
    );
    assert_ne!(
        d.id,
        Deployment::new("ns.servicebus.windows.net", "hub", "cg2").id,
        "another consumer group is another deployment"
    );
    assert_eq!(
        d.id,
        Deployment::new("NS.servicebus.windows.net", "HUB", "$default").id,
        "names compared without case, as Event Hubs compares them"
    );
}

#[test]
fn a_retry_message_without_deployment_or_origin_still_reads() {
    let old: RetryMessage =
        serde_json::from_str(r#"{"v":2,"attempt":3,"due_ms":5,"key":"k","traceparents":[]}"#)
            .unwrap();
    assert_eq!((old.key(), old.attempt), ("k", 3));
    assert_eq!((old.deployment, old.origin), (None, None));
}

#[tokio::test]
async fn a_retry_message_carries_its_deployment_and_where_its_event_sits() {
    let d = Deployment::new("ns", "hub", "$Default");
    let mut b = bed();
    b.settler = Settler::new(
        b.settler.ledger.clone(),
        b.queue.clone(),
        b.settler.policies.clone(),
    )
    .with_clock(b.clock.clone())
    .with_deployment(d.clone());
    fail(&b, "k", 1, Source::EventHubs).await.unwrap();
    assert_eq!(b.queue.accepted(), vec![format!("{}.k-attempt-2", d.id)]);
    let body: RetryMessage = serde_json::from_str(&b.queue.bodies()[0]).unwrap();
    assert_eq!(body.deployment, Some(d));
    let e = event("k");
    assert_eq!(
        body.origin,
        Some(Position {
            partition: e.partition_id,
            sequence_number: e.sequence_number,
            offset: e.offset,
        })
    );
}
