//! Batches and the circuit breaker (issue 40): the breaker counts events, not requests — a
//! batch of ten that fails is ten failures, so a downstream refusing every batch opens the
//! breaker after one or two calls, not after `consecutive_failures` calls of a hundred events
//! each; while it is open no batch is sent.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use hubguard::handler::batch::{BatchHandler, BatchLimits, Batched, Item};
use hubguard::handler::{Failure, Outcome};

use crate::common::{eventually, seen};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A downstream down: every batch fails, transiently; each call's size kept.
#[derive(Default)]
struct Down {
    calls: Mutex<Vec<usize>>,
}

#[async_trait]
impl BatchHandler for Down {
    async fn handle_batch(&self, items: &[Item<'_>]) -> Vec<Outcome> {
        self.calls.lock().unwrap().push(items.len());
        items
            .iter()
            .map(|_| Outcome::Failed(Failure::transient("HTTP 503 for the batch")))
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_counts_a_failed_batchs_events_not_its_request() {
    const CONSECUTIVE: u32 = 8;
    let bed = Bed::start(1).await;
    let down = Arc::new(Down::default());
    let handler = Arc::new(Batched::shared(
        down.clone(),
        BatchLimits {
            max_events: 20,
            max_bytes: 1 << 20,
            // Wait for the in-flight events to join: a batch of all of them.
            wait: Duration::from_millis(200),
        },
    ));
    let mut wiring = bed.wiring("replica-batch-breaker").policy(fast_policy(10));
    wiring.options_mut().max_in_flight = 20;
    let mut parts = wiring.parts(handler).unwrap();
    parts.breaker = Some(hubguard::breaker::BreakerConfig {
        enabled: true,
        consecutive_failures: CONSECUTIVE,
        failure_ratio: None,
        ratio_window: 20,
        // Open long enough that no probe runs in the test.
        open_ms: 600_000,
        spread_ms: 0,
        probe_timeout_ms: 3000,
        brink_hold_ms: 0,
        ..Default::default()
    });
    let run = Bed::run(parts);
    let keys: Vec<String> = (0..20).map(|i| format!("bb-{i:02}")).collect();
    bed.send(
        0,
        &keys.iter().map(|k| (k.as_str(), "ok")).collect::<Vec<_>>(),
    )
    .await;
    let record = eventually("the breaker opens", LIMIT, || async {
        seen(bed.breaker_record("handler").await, |r| {
            r.as_ref().is_some_and(|r| r.opens == 1)
        })
    })
    .await
    .unwrap();
    assert!(record.open_until_ms.is_some(), "{record:?}");
    let calls = down.calls.lock().unwrap().clone();
    let failed: usize = calls.iter().sum();
    assert!(
        failed >= CONSECUTIVE as usize,
        "it opened on {CONSECUTIVE} failed events: {calls:?}"
    );
    assert!(
        calls.len() < CONSECUTIVE as usize,
        "opened after {} requests, fewer than {CONSECUTIVE}: the breaker counts events ({calls:?})",
        calls.len()
    );
    // Open: the failed events' retries wait on Service Bus, and new events wait in Event
    // Hubs, the partition held; no batch goes out.
    eventually(
        "the failed events' retries are scheduled",
        LIMIT,
        || async {
            let c = bed.sb.counters("retries").unwrap();
            seen(c.sends, |n| *n >= failed as u64)
        },
    )
    .await;
    bed.send(0, &[("bb-late-1", "ok"), ("bb-late-2", "ok")])
        .await;
    wait_for(
        "the partition waits for the breaker",
        &run.health,
        LIMIT,
        || async {
            run.health
                .held()
                .get("0")
                .is_some_and(|h| h.reason.starts_with("downstream breaker open"))
        },
    )
    .await;
    assert_eq!(
        down.calls.lock().unwrap().len(),
        calls.len(),
        "no batch while the breaker is open"
    );
    assert_eq!(
        bed.breaker_record("handler").await.map(|r| r.opens),
        Some(1)
    );
    run.stop().await;
}
