use super::*;
use crate::azure::memory::MemoryRecordStore;

fn limiter(store: Arc<dyn RecordStore>, owner: &str, per_s: f64, clock: Arc<Clock>) -> Limiter {
    Limiter::new(
        RateLimitConfig::per_second(per_s),
        store,
        "receiver:80",
        owner,
        Duration::from_secs(60),
        clock,
    )
}

#[tokio::test(start_paused = true)]
async fn attempts_are_paced_at_the_replicas_share_and_the_wait_is_reported() {
    let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
    let l = limiter(store, "a", 10.0, Arc::default());
    l.tick().await;
    let cancel = CancellationToken::new();
    let t0 = Instant::now();
    let mut waits = Vec::new();
    for _ in 0..5 {
        match l.acquire(&cancel, true).await {
            Some(Acquired::Go(w)) => waits.push(w),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(waits[0], Duration::ZERO);
    // 10/s, paced with the headroom: 103 ms apart.
    let gap = Duration::from_secs_f64(1.0 / (10.0 * crate::ratelimit::PACING_HEADROOM));
    let close = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_millis(2);
    assert!(close(t0.elapsed(), gap * 4), "{:?}", t0.elapsed());
    assert!(close(waits[4], gap), "{:?}", waits[4]);
    assert_eq!(l.snapshot().rate_per_s, Some(10.0));
}

#[tokio::test(start_paused = true)]
async fn a_429_lowers_the_rate_of_every_replica_and_its_retry_after_pauses_them_all() {
    let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
    let clock: Arc<Clock> = Arc::default();
    let a = limiter(store.clone(), "a", 100.0, clock.clone());
    let b = limiter(store.clone(), "b", 100.0, clock.clone());
    for l in [&a, &b, &a, &b] {
        l.tick().await;
    }
    assert_eq!((a.snapshot().share, b.snapshot().share), (0.5, 0.5));
    let cancel = CancellationToken::new();
    assert!(matches!(
        b.acquire(&cancel, true).await,
        Some(Acquired::Go(_))
    ));
    a.observe(Signal::Slow {
        reason: DecreaseReason::Throttled,
        retry_after: None,
    })
    .await;
    let rate = a.snapshot().deployment_rate_per_s.unwrap();
    assert!(rate < 51.0, "{rate}");
    assert_eq!(a.snapshot().last_decrease_reason, Some("throttled_429"));
    // b reads the shared record at its next refresh.
    tokio::time::advance(Duration::from_millis(600)).await;
    assert!(matches!(
        b.acquire(&cancel, true).await,
        Some(Acquired::Go(_))
    ));
    let rb = b.snapshot().deployment_rate_per_s.unwrap();
    assert!(rb < 52.0, "b lowered too: {rb}");
    // A Retry-After pauses b as well, on the policy clock.
    clock.advance(Duration::from_secs(2));
    a.observe(Signal::Slow {
        reason: DecreaseReason::Throttled,
        retry_after: Some(Duration::from_secs(30)),
    })
    .await;
    tokio::time::advance(Duration::from_millis(600)).await;
    let waiting = b.acquire(&cancel, true);
    tokio::pin!(waiting);
    tokio::select! {
        _ = &mut waiting => panic!("b must wait out the pause"),
        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
    }
    assert!(b.snapshot().paused_until.is_some());
    clock.advance(Duration::from_secs(31));
    assert!(matches!(waiting.await, Some(Acquired::Go(w)) if w >= Duration::from_secs(1)));
}

#[tokio::test(start_paused = true)]
async fn without_a_share_retries_are_left_to_others_and_partitions_wait_and_ask() {
    let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
    let l = Arc::new(limiter(store.clone(), "a", 10.0, Arc::default()));
    let cancel = CancellationToken::new();
    // Not yet ticked: no share.
    assert_eq!(l.acquire(&cancel, false).await, Some(Acquired::NoShare));
    let waiting = l.acquire(&cancel, true);
    tokio::pin!(waiting);
    tokio::select! {
        _ = &mut waiting => panic!("no share: it waits"),
        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
    }
    // The tick publishes a backlog (attempts waited, one was turned away) and takes it all.
    l.tick().await;
    assert!(matches!(waiting.await, Some(Acquired::Go(_))));
    let s = l.snapshot();
    assert!(s.backlog, "{s:?}");
    assert_eq!((s.share, s.rate_per_s, s.replicas), (1.0, Some(10.0), 1));
}

#[tokio::test(start_paused = true)]
async fn a_stopped_replica_hands_its_share_over_at_once_and_a_silent_one_after_its_lease() {
    let store: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
    let lease = Duration::from_secs(2);
    let new = |owner: &str| {
        Limiter::new(
            RateLimitConfig::per_second(10.0),
            store.clone(),
            "d",
            owner,
            lease,
            Arc::default(),
        )
    };
    let (a, b, c) = (new("a"), new("b"), new("c"));
    for l in [&a, &b, &a, &b] {
        l.tick().await;
    }
    assert_eq!((a.snapshot().share, b.snapshot().share), (0.5, 0.5));
    b.withdraw().await;
    assert_eq!(b.snapshot().share, 0.0);
    a.tick().await;
    assert_eq!(
        a.snapshot().share,
        1.0,
        "a stopped replica's share is free at once"
    );
    for l in [&c, &a, &c] {
        l.tick().await;
    }
    assert_eq!((a.snapshot().share, c.snapshot().share), (0.5, 0.5));
    // c goes silent (killed, frozen): a takes its share only once c's own lease ran out.
    let silent = Instant::now();
    while a.snapshot().share < 1.0 {
        tokio::time::advance(Duration::from_millis(500)).await;
        a.tick().await;
        let (sa, sc) = (a.snapshot().share, c.snapshot().share);
        assert!(sa + sc <= 1.0 + 1e-9, "{sa} + {sc}");
        assert!(silent.elapsed() < lease * 4, "c's share never came back");
    }
    assert!(silent.elapsed() >= lease, "{:?}", silent.elapsed());
    assert_eq!(c.snapshot().share, 0.0);
}

#[test]
fn signals_from_outcomes() {
    use crate::handler::{Failure, Outcome};
    let cap = Duration::from_secs(60);
    let f = |s: u16| Outcome::Failed(Failure::transient("x").with_http_status(s));
    assert!(matches!(
        signal_of(&f(429), cap),
        Signal::Slow {
            reason: DecreaseReason::Throttled,
            retry_after: None
        }
    ));
    let long = Outcome::Failed(
        Failure::transient("x")
            .with_http_status(429)
            .with_retry_after(Some(Duration::from_secs(999_999))),
    );
    assert_eq!(
        signal_of(&long, cap),
        Signal::Slow {
            reason: DecreaseReason::Throttled,
            retry_after: Some(cap)
        },
        "bounded"
    );
    assert!(matches!(
        signal_of(&f(503), cap),
        Signal::Slow {
            reason: DecreaseReason::Unavailable,
            ..
        }
    ));
    assert!(matches!(
        signal_of(&Outcome::Failed(Failure::timeout("slow")), cap),
        Signal::Slow {
            reason: DecreaseReason::Timeout,
            ..
        }
    ));
    assert_eq!(signal_of(&f(400), cap), Signal::Neutral);
    assert_eq!(signal_of(&Outcome::Delivered, cap), Signal::Success);
}
