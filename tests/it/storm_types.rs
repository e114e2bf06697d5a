//! The dead-letter storm guard of an event type with thresholds of its own, end to end on the
//! emulators through the real SDK clients, the real webhook handler and the real binary's
//! `storm-guard` command: a receiver refusing every event of one type among many delivered
//! events of another. With a guard of its own the type neither hides behind the other type's
//! deliveries (the downstream's share alone would let every refusal be dead-lettered) nor
//! holds the other type back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
use azure_messaging_eventhubs::EventDataBatchOptions;
use hubguard::breaker::storm::{self, StormGuardConfig, StormGuardType, StormRecord};
use hubguard::emulator::webhook::WebhookReceiver;
use hubguard::handler::webhook::{WebhookConfig, WebhookHandler};
use hubguard::handler::Handler;
use hubguard::pipeline::Pipeline;
use tokio_util::sync::CancellationToken;

use crate::common::{eventually, seen, within};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);
/// The "bulk" type's own minimum.
const BULK_MIN: u32 = 4;

/// Sends `(key, type)` events to `partition`, in order.
async fn send(bed: &Bed, partition: usize, events: &[(String, &str)]) {
    let prod = crate::common::producer(&bed.cs, "hub").await;
    let batch = within(
        "batch",
        prod.create_batch(Some(EventDataBatchOptions {
            partition_id: Some(partition.to_string()),
            ..Default::default()
        })),
    )
    .await
    .unwrap();
    for (key, ty) in events {
        let ev = EventData::builder()
            .with_body(b"x".to_vec())
            .add_property("ce_id".into(), AmqpSimpleValue::String(key.clone()))
            .add_property("ce_type".into(), AmqpSimpleValue::String(ty.to_string()))
            .build();
        assert!(batch.try_add_event_data(ev, None).unwrap());
    }
    within("send", prod.send_batch(batch, None)).await.unwrap();
    within("close producer", prod.close()).await.unwrap();
}

fn guard_config() -> StormGuardConfig {
    let mut c = StormGuardConfig {
        min_refusals: 5,
        trial_every_ms: 1_000,
        held_retry_defer_max_ms: 4_000,
        ..Default::default()
    };
    c.event_types.insert(
        "bulk".into(),
        StormGuardType {
            min_refusals: Some(BULK_MIN),
            share: Some(0.9),
            ..Default::default()
        },
    );
    c
}

async fn lane(bed: &Bed, receiver: &WebhookReceiver, ty: Option<&str>) -> StormRecord {
    let handler = WebhookHandler::new(WebhookConfig::new(receiver.url())).unwrap();
    storm::read_lane(bed.records().as_ref(), &handler.downstream(), ty)
        .await
        .unwrap()
        .unwrap_or_default()
}

/// Runs `hubguard storm-guard …` (the real binary) with the bed, the receiver and the
/// "bulk" type's guard configured: its exit status, what it printed and its errors.
async fn storm_cli(
    bed: &Bed,
    receiver: &WebhookReceiver,
    dir: &std::path::Path,
    args: &[&str],
) -> (Option<i32>, String, String) {
    let config = dir.join("hubguard.toml");
    std::fs::write(
        &config,
        format!(
            "[eventhubs]\nconnection_string = \"{}\"\nhub = \"hub\"\n[servicebus]\nconnection_string = \"{}\"\n[storage]\ncontainer_url = \"{}\"\n[handler]\nkind = \"webhook\"\nurl = \"{}\"\n[storm_guard]\nmin_refusals = 5\n[storm_guard.event_types.\"bulk\"]\nmin_refusals = {BULK_MIN}\nshare = 0.9\n",
            bed.eh.connection_string(),
            bed.sb.connection_string(),
            bed.blob.container_url("hubguard"),
            receiver.url(),
        ),
    )
    .unwrap();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
            .arg("storm-guard")
            .args(&args)
            .arg("--config")
            .arg(&config)
            .env("NO_COLOR", "1")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    })
    .await
    .unwrap()
}

/// "bulk" refused for good (400) while "order" is delivered: bulk's own guard holds after
/// fewer than its minimum dead letters — the downstream's guard alone (20 bulk refusals among
/// 40 deliveries, under its 50 %) would have dead-lettered all of them — while every "order"
/// event is delivered and the downstream's guard never holds. The command line shows and
/// names bulk's guard; once bulk is accepted again its trial releases it and every held bulk
/// event is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_with_its_own_guard_is_held_alone_and_does_not_hide_behind_other_types() {
    let bed = Bed::start(2).await;
    let refusing = Arc::new(AtomicBool::new(true));
    let r = refusing.clone();
    let behaviour: hubguard::emulator::webhook::Behaviour = Arc::new(move |key: &str, _: u32| {
        if key.starts_with("bulk-") && r.load(Ordering::SeqCst) {
            400
        } else {
            200
        }
    });
    let receiver = WebhookReceiver::start_with("127.0.0.1:0".parse().unwrap(), behaviour)
        .await
        .unwrap();
    let bulk: Vec<(String, &str)> = (0..20).map(|i| (format!("bulk-{i:04}"), "bulk")).collect();
    let orders: Vec<(String, &str)> = (0..40)
        .map(|i| (format!("order-{i:04}"), "order"))
        .collect();
    send(&bed, 0, &bulk).await;
    send(&bed, 1, &orders).await;
    let mut wiring = bed.wiring("replica-types").policy(fast_policy(50));
    let o = wiring.options_mut();
    o.storm_guard = Some(guard_config());
    let handler: Arc<dyn Handler> =
        Arc::new(WebhookHandler::new(WebhookConfig::new(receiver.url())).unwrap());
    let pipeline = Pipeline::new(wiring.parts(handler).unwrap());
    let health = pipeline.health();
    let (cancel, crash) = (CancellationToken::new(), CancellationToken::new());
    let c = cancel.clone();
    let task = tokio::spawn(async move { pipeline.run_until(c, crash).await.unwrap() });
    let _log = crate::test_log::TestLog::in_process();

    eventually("bulk's own guard holds", LIMIT, || async {
        seen(lane(&bed, &receiver, Some("bulk")).await, |r| {
            r.holding.is_some()
        })
    })
    .await;
    eventually("readiness names bulk's guard", LIMIT, || async {
        seen(health.not_ready_reasons(), |rs| {
            rs.iter()
                .any(|l| l.contains("(event type bulk) storm guard holding"))
        })
    })
    .await;
    eventually(
        "every order delivered while bulk is held",
        LIMIT,
        || async {
            let d = receiver.deliveries();
            seen(
                orders.iter().filter(|(k, _)| d.contains_key(k)).count(),
                |n| *n == orders.len(),
            )
        },
    )
    .await;
    let dead = bed.ledger().dead_letter_keys().await.unwrap();
    assert!(dead.len() < BULK_MIN as usize, "{dead:?}");
    assert!(dead.iter().all(|k| k.starts_with("bulk-")), "{dead:?}");
    let downstream = lane(&bed, &receiver, None).await;
    assert_eq!((downstream.holds, downstream.holding), (0, None));
    assert!(health
        .not_ready_reasons()
        .iter()
        .all(|l| !l.contains("storm guard holding") || l.contains("(event type bulk)")));

    let dir = tempfile::tempdir().unwrap();
    let (code, out, _) = storm_cli(&bed, &receiver, dir.path(), &["status"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("Watching") && out.contains("event type bulk") && out.contains("Holding"),
        "{out}"
    );
    let args = ["status", "--event-type", "bulk", "--json"];
    let (code, out, _) = storm_cli(&bed, &receiver, dir.path(), &args).await;
    assert_eq!(code, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (&v["state"], &v["event_type"]),
        (&"holding".into(), &"bulk".into()),
        "{v}"
    );
    let args = ["release", "--event-type", "order", "--by", "ana"];
    let (code, _, err) = storm_cli(&bed, &receiver, dir.path(), &args).await;
    assert_ne!(code, Some(0));
    assert!(err.contains("no thresholds of its own"), "{err}");

    refusing.store(false, Ordering::SeqCst);
    eventually(
        "every bulk event delivered or dead-lettered",
        LIMIT,
        || async {
            let d = receiver.deliveries();
            let dead = bed.ledger().dead_letter_keys().await.unwrap_or_default();
            seen(
                bulk.iter()
                    .filter(|(k, _)| !d.contains_key(k) && !dead.contains(k))
                    .count(),
                |n| *n == 0,
            )
        },
    )
    .await;
    let released = eventually("bulk's guard released by its trial", LIMIT, || async {
        seen(lane(&bed, &receiver, Some("bulk")).await, |r| {
            r.holding.is_none()
        })
    })
    .await;
    assert_eq!(released.holds, 1);
    let dead = bed.ledger().dead_letter_keys().await.unwrap();
    assert!(dead.len() < BULK_MIN as usize, "{dead:?}");
    cancel.cancel();
    within("pipeline stops", task).await.unwrap();
}
