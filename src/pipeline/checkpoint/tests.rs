use super::*;
use azure_messaging_eventhubs::InMemoryCheckpointStore;

fn ownership(pid: &str, owner: &str) -> Ownership {
    Ownership {
        fully_qualified_namespace: "ns".into(),
        event_hub_name: "hub".into(),
        consumer_group: "$Default".into(),
        partition_id: pid.into(),
        owner_id: Some(owner.into()),
        ..Default::default()
    }
}

fn checkpoint(pid: &str, seq: i64) -> Checkpoint {
    Checkpoint {
        fully_qualified_namespace: "ns".into(),
        event_hub_name: "hub".into(),
        consumer_group: "$Default".into(),
        partition_id: pid.into(),
        offset: Some((seq * 100).to_string()),
        sequence_number: Some(seq),
    }
}

#[tokio::test(start_paused = true)]
async fn fences_by_ownership_and_never_moves_back() {
    let inner = Arc::new(InMemoryCheckpointStore::new());
    let store = FencedCheckpointStore::new(
        inner.clone(),
        "me".into(),
        Duration::from_secs(5),
        Duration::from_secs(30),
    );
    // Not claimed: refused.
    assert!(store.update_checkpoint(checkpoint("0", 5)).await.is_err());
    let won = store
        .claim_ownership(&[ownership("0", "me")])
        .await
        .unwrap();
    store.update_checkpoint(checkpoint("0", 5)).await.unwrap();
    // Backwards: refused; the stored checkpoint stays.
    assert!(store.update_checkpoint(checkpoint("0", 3)).await.is_err());
    let cps = inner
        .list_checkpoints("ns", "hub", "$Default")
        .await
        .unwrap();
    assert_eq!(cps[0].sequence_number, Some(5));
    // Stale after the expiration without a renewed claim.
    tokio::time::advance(Duration::from_secs(31)).await;
    assert!(store.update_checkpoint(checkpoint("0", 9)).await.is_err());
    // The renewal rotates the ETag (0.16's in-memory store, like blob storage): keep it.
    let won = store.claim_ownership(&won).await.unwrap();
    store.update_checkpoint(checkpoint("0", 9)).await.unwrap();
    // Another owner seen in the listing: lost.
    let mut stolen = won[0].clone();
    stolen.owner_id = Some("other".into());
    inner.update_ownership(&stolen).unwrap();
    store
        .list_ownerships("ns", "hub", "$Default")
        .await
        .unwrap();
    assert!(!store.owns("0"));
    assert!(store.update_checkpoint(checkpoint("0", 12)).await.is_err());
}

fn with_handovers(
    inner: &Arc<InMemoryCheckpointStore>,
    records: &Arc<crate::azure::memory::MemoryRecordStore>,
    id: &str,
) -> FencedCheckpointStore {
    let store = FencedCheckpointStore::new(
        inner.clone(),
        id.into(),
        Duration::from_secs(5),
        Duration::from_secs(30),
    )
    .with_handovers(Handovers::new(records.clone(), "hub", "$Default", id));
    store.set_partitions(vec!["0".into(), "1".into()]);
    store
}

async fn cycle(store: &FencedCheckpointStore, want: &[(&str, &str)]) -> Vec<String> {
    // What the processor's load balancing does each cycle: list, then claim its own
    // partitions and the ones it wants (with the ETags listed).
    let listed = store
        .list_ownerships("ns", "hub", "$Default")
        .await
        .unwrap();
    let mut claims: Vec<Ownership> = listed
        .iter()
        .filter(|o| o.owner_id.as_deref() == Some(store.owner_id.as_str()))
        .cloned()
        .collect();
    for (p, _) in want {
        let mut o = listed
            .iter()
            .find(|o| o.partition_id == *p)
            .cloned()
            .unwrap_or_else(|| ownership(p, ""));
        o.owner_id = Some(store.owner_id.clone());
        claims.retain(|c| c.partition_id != *p);
        claims.insert(0, o);
    }
    if claims.is_empty() {
        return Vec::new();
    }
    let mut got: Vec<String> = store
        .claim_ownership(&claims)
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.partition_id)
        .collect();
    got.sort();
    got
}

#[tokio::test(start_paused = true)]
async fn two_askers_for_one_partition_the_first_gets_it_handed_over_the_second_nothing() {
    let inner = Arc::new(InMemoryCheckpointStore::new());
    let records = Arc::new(crate::azure::memory::MemoryRecordStore::new());
    let (a, b, c) = (
        with_handovers(&inner, &records, "a"),
        with_handovers(&inner, &records, "b"),
        with_handovers(&inner, &records, "c"),
    );
    assert_eq!(cycle(&a, &[("0", "")]).await, vec!["0"]);
    // b and c both want it while a owns it: they ask (one of them), neither takes it.
    assert!(
        cycle(&b, &[("0", "")]).await.is_empty(),
        "b asks, not steals"
    );
    assert!(
        cycle(&c, &[("0", "")]).await.is_empty(),
        "c leaves b's request"
    );
    let (request, _) = Handovers::new(records.clone(), "hub", "$Default", "x")
        .read("0")
        .await
        .unwrap()
        .expect("a request");
    assert_eq!((request.asker.as_str(), request.owner.as_str()), ("b", "a"));
    assert!(a.owns("0"), "still a's");
    // a's next cycle answers: nothing reads the partition here, so it goes at once —
    // written over to b, never unowned.
    assert!(cycle(&a, &[]).await.is_empty());
    assert!(!a.owns("0"));
    let listed = inner
        .list_ownerships("ns", "hub", "$Default")
        .await
        .unwrap();
    assert_eq!(listed[0].owner_id.as_deref(), Some("b"));
    assert!(
        a.update_checkpoint(checkpoint("0", 1)).await.is_err(),
        "a is fenced"
    );
    assert_eq!(cycle(&b, &[]).await, vec!["0"]);
    b.update_checkpoint(checkpoint("0", 1)).await.unwrap();
    assert!(
        Handovers::new(records.clone(), "hub", "$Default", "x")
            .read("0")
            .await
            .unwrap()
            .is_none(),
        "the request is withdrawn once b owns the partition"
    );
    // c, still wanting it, now asks b; it never owned it meanwhile.
    assert!(cycle(&c, &[("0", "")]).await.is_empty());
    assert!(!c.owns("0"));
}

#[tokio::test(start_paused = true)]
async fn an_owner_that_never_answers_loses_the_partition_at_expiry_one_that_is_finishing_keeps_it()
{
    let inner = Arc::new(InMemoryCheckpointStore::new());
    let records = Arc::new(crate::azure::memory::MemoryRecordStore::new());
    let (a, b) = (
        with_handovers(&inner, &records, "a"),
        with_handovers(&inner, &records, "b"),
    );
    assert_eq!(cycle(&a, &[("0", ""), ("1", "")]).await, vec!["0", "1"]);
    assert!(
        a.partition_started("1", tokio_util::sync::CancellationToken::new()),
        "a reads partition 1"
    );
    // b asks for partition 0; a never looks (a silent owner: its ownership is renewed
    // by whatever runs it, as a hung processor's would be).
    assert!(cycle(&b, &[("0", "")]).await.is_empty());
    tokio::time::advance(Duration::from_secs(20)).await;
    assert!(
        cycle(&b, &[("0", "")]).await.is_empty(),
        "not before the expiration"
    );
    tokio::time::advance(Duration::from_secs(11)).await;
    assert_eq!(
        cycle(&b, &[("0", "")]).await,
        vec!["0"],
        "taken once the owner left the request unanswered for the expiration"
    );
    // Partition 1: b asks, a answers and is still finishing (an event it cannot settle
    // yet): b waits past the expiration, a keeps renewing and checkpointing.
    assert!(cycle(&b, &[("1", "")]).await.iter().all(|p| p != "1"));
    assert!(
        cycle(&a, &[]).await.is_empty(),
        "hidden from a's processor: it stops reading"
    );
    tokio::time::advance(Duration::from_secs(31)).await;
    assert!(cycle(&a, &[]).await.is_empty());
    a.update_checkpoint(checkpoint("1", 7)).await.unwrap();
    assert!(
        cycle(&b, &[("1", "")]).await.iter().all(|p| p != "1"),
        "b waits"
    );
    assert!(a.owns("1"));
    // a's task ends (final checkpoint written): the partition is written over to b.
    a.partition_ended("1", true).await;
    assert!(!a.owns("1"));
    assert!(cycle(&b, &[]).await.contains(&"1".to_string()));
}

#[tokio::test(start_paused = true)]
async fn a_partition_whose_client_did_not_close_is_hidden_one_cycle_then_handed_out_afresh() {
    let inner = Arc::new(InMemoryCheckpointStore::new());
    let records = Arc::new(crate::azure::memory::MemoryRecordStore::new());
    let a = with_handovers(&inner, &records, "a");
    assert_eq!(cycle(&a, &[("0", "")]).await, vec!["0"]);
    assert!(a.partition_started("0", tokio_util::sync::CancellationToken::new()));
    // Closed cleanly: shown at the next cycle, as before.
    a.partition_ended("0", true).await;
    assert_eq!(cycle(&a, &[]).await, vec!["0"]);
    assert!(a.partition_started("0", tokio_util::sync::CancellationToken::new()));
    // Its client's close failed: hidden from the processor for one cycle (renewed: still
    // a's), then shown again, so the SDK drops its dead client and hands out a new one.
    a.partition_ended("0", false).await;
    assert!(
        !a.partition_started("0", tokio_util::sync::CancellationToken::new()),
        "not read before it is handed out afresh"
    );
    assert!(cycle(&a, &[]).await.is_empty(), "hidden for one cycle");
    assert!(a.owns("0"), "and still a's");
    assert_eq!(cycle(&a, &[]).await, vec!["0"], "then shown again");
    assert!(a.partition_started("0", tokio_util::sync::CancellationToken::new()));
}

#[tokio::test(start_paused = true)]
async fn an_owned_partition_nobody_reads_is_reported_and_handed_out_afresh() {
    let inner = Arc::new(InMemoryCheckpointStore::new());
    let records = Arc::new(crate::azure::memory::MemoryRecordStore::new());
    let health = Arc::new(crate::pipeline::health::Health::new(Arc::new(
        crate::clock::Clock::default(),
    )));
    let a = with_handovers(&inner, &records, "a").with_health(health.clone());
    assert_eq!(cycle(&a, &[("0", "")]).await, vec!["0"]);
    // The processor never hands it to a task (a client stuck in its map).
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(
        cycle(&a, &[]).await,
        vec!["0"],
        "within half the expiration"
    );
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(cycle(&a, &[]).await.is_empty(), "past it: hidden one cycle");
    let held = health.held();
    let h = held.get("0").expect("readiness names the unread partition");
    assert_eq!(h.cause, crate::pipeline::health::HoldCause::Ownership);
    assert!(h.reason.contains("not read"), "{}", h.reason);
    assert_eq!(cycle(&a, &[]).await, vec!["0"], "then handed out afresh");
    assert!(a.partition_started("0", tokio_util::sync::CancellationToken::new()));
    assert!(health.held().is_empty(), "read again: the hold goes");
}

#[tokio::test(start_paused = true)]
async fn a_stale_claim_stands_down_until_confirmed_and_a_lost_one_stops_its_reader() {
    let inner = Arc::new(InMemoryCheckpointStore::new());
    let records = Arc::new(crate::azure::memory::MemoryRecordStore::new());
    let a = Arc::new(with_handovers(&inner, &records, "a"));
    let never = tokio_util::sync::CancellationToken::new();
    assert!(!a.confirmed("0", &never).await, "never claimed");
    assert_eq!(cycle(&a, &[("0", "")]).await, vec!["0"]);
    let reader = tokio_util::sync::CancellationToken::new();
    assert!(a.partition_started("0", reader.clone()));
    assert!(a.confirmed("0", &never).await);
    // Frozen past the expiration: the next delivery waits for the next confirmation.
    tokio::time::advance(Duration::from_secs(31)).await;
    let waiting = {
        let (a, never) = (a.clone(), never.clone());
        tokio::spawn(async move { a.confirmed("0", &never).await })
    };
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished(), "stands down while unconfirmed");
    assert_eq!(cycle(&a, &[]).await, vec!["0"]);
    assert!(waiting.await.unwrap(), "confirmed by the renewal");
    // Stale again, and another owner is listed: the wait ends unconfirmed, and the task
    // reading the partition is told to stop (its stream may never end by itself).
    tokio::time::advance(Duration::from_secs(31)).await;
    let waiting = {
        let (a, never) = (a.clone(), never.clone());
        tokio::spawn(async move { a.confirmed("0", &never).await })
    };
    let listed = inner
        .list_ownerships("ns", "hub", "$Default")
        .await
        .unwrap();
    let mut stolen = listed[0].clone();
    stolen.owner_id = Some("b".into());
    inner.update_ownership(&stolen).unwrap();
    a.list_ownerships("ns", "hub", "$Default").await.unwrap();
    assert!(!waiting.await.unwrap(), "lost: never confirmed");
    assert!(reader.is_cancelled(), "its reader is told to stop");
}
