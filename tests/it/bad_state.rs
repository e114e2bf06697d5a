//! Broken state and unreachable dependencies: contained, named, and never hidden behind a
//! readiness of 200.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hubguard::ledger::State;
use hubguard::policy::DeadLetterReason;

use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Overwrites `key`'s ledger record with bytes that do not parse.
async fn corrupt(bed: &Bed, key: &str) {
    let store = bed.records();
    let name = bed.ledger().record_name(key);
    match store.read(&name).await.unwrap() {
        Some(r) => {
            store
                .update(&name, Bytes::from_static(b"{not json"), &r.etag)
                .await
                .unwrap();
        }
        None => {
            store
                .create(&name, Bytes::from_static(b"{not json"))
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_ledger_record_is_set_aside_and_its_event_dead_lettered_never_held() {
    let bed = Bed::start(1).await;
    let ledger = bed.ledger();
    // On the partition path: the record is corrupt before the event's first failure.
    corrupt(&bed, "corrupt-on-read").await;
    bed.send(0, &[("corrupt-on-read", "fail:1"), ("behind", "ok")])
        .await;
    // On the retry path: the record turns corrupt while its retry waits.
    let slow = hubguard::policy::RetryPolicy {
        base_s: 30,
        floor_s: 30,
        ..fast_policy(5)
    };
    bed.send(0, &[("corrupt-later", "fail:1")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), slow, "replica-a"));
    wait_for("partition path settled", &run.health, LIMIT, || async {
        matches!(ledger.record("corrupt-later").await, Ok(Some(r)) if r.state() == State::RetryScheduled)
            && bed.checkpoint_of("0").await == Some(2)
    })
    .await;
    let rec = ledger.record("corrupt-on-read").await.unwrap().unwrap();
    assert_eq!(rec.state(), State::DeadLettered);
    assert_eq!(
        rec.dead_letter_reason(),
        Some(DeadLetterReason::CorruptRecord)
    );
    assert!(!rec.event_unknown, "the event was in hand");
    let aside = rec.quarantined.clone().expect("quarantine blob named");
    let kept = bed.records().read(&aside).await.unwrap().unwrap();
    assert_eq!(&kept.body[..], b"{not json");
    assert!(
        handler.delivered_keys().contains("behind"),
        "the partition moved on"
    );

    corrupt(&bed, "corrupt-later").await;
    bed.clock().advance(Duration::from_secs(31));
    wait_for("retry path dead-lettered", &run.health, LIMIT, || async {
        matches!(ledger.record("corrupt-later").await, Ok(Some(r)) if r.state() == State::DeadLettered)
    })
    .await;
    let rec = ledger.record("corrupt-later").await.unwrap().unwrap();
    assert_eq!(
        rec.dead_letter_reason(),
        Some(DeadLetterReason::CorruptRecord)
    );
    assert!(rec.event_unknown, "the retry message carries only the key");
    assert!(run.health.held_retries().is_empty());
    assert!(run.health.held().is_empty());
    wait_for(
        "nothing left on Service Bus",
        &run.health,
        LIMIT,
        || async {
            let c = bed.sb.counters("retries").unwrap();
            c.active + c.scheduled + c.locked == 0
        },
    )
    .await;
    run.stop().await;

    // Both are listed as dead letters; the one whose event is known replays, the other says why not.
    let mut keys = ledger.dead_letter_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, vec!["corrupt-later", "corrupt-on-read"]);
    let settler = bed.settler(fast_policy(5));
    assert!(settler.replay("corrupt-on-read").await.unwrap().is_some());
    let e = settler.replay("corrupt-later").await.unwrap_err();
    assert!(e.to_string().contains("quarantine"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_event_hubs_is_named_in_readiness() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler, fast_policy(5), "replica-a");
    parts.options.unhealthy_after = Some(Duration::ZERO);
    let Bed { eh, sb, blob, cs } = bed;
    let addr = eh.local_addr();
    eh.shutdown().await;
    let run = Bed::run(parts);
    wait_for("consumer failing, named", &run.health, LIMIT, || async {
        run.health.not_ready_reasons().iter().any(|r| {
            r.contains("Event Hubs consumer failing") && r.contains(&addr.port().to_string())
        })
    })
    .await;
    assert!(!run.health.ready());
    // With a zero limit liveness fails at once too, so an orchestrator would restart it.
    assert!(run.health.live().is_err());
    let reasons = run.health.not_ready_reasons().join("\n");
    assert!(!reasons.contains("SharedAccessKey"), "no secret: {reasons}");
    run.stop().await;
    drop((sb, blob, cs));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_no_replica_owns_makes_readiness_fail_naming_it() {
    let bed = Bed::start(2).await;
    let handler = Arc::new(Scripted::default());
    let mut parts = bed.parts(handler, fast_policy(5), "replica-a");
    parts.checkpoint_store = Arc::new(ShapedStore {
        inner: parts.checkpoint_store,
        unclaimable: Some("1"),
        no_checkpoints: false,
    });
    let run = Bed::run(parts);
    wait_for(
        "partition 1 reported unowned",
        &run.health,
        LIMIT,
        || async { run.health.unowned() == vec!["1".to_string()] },
    )
    .await;
    assert!(!run.health.ready());
    assert!(run
        .health
        .not_ready_reasons()
        .iter()
        .any(|r| r.contains("partitions 1 are owned by no replica")));
    assert!(run.health.owned().contains_key("0"));
    run.stop().await;
}

#[tokio::test]
async fn unreachable_blob_storage_is_named_with_its_cause_and_never_its_sas() {
    use hubguard::azure::{BlobRecordStore, RecordStore};
    // A port nothing listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}/devstoreaccount1/hubguard?sv=2024&sig=SECRETSIG");
    let store = BlobRecordStore::new(&url, None, Duration::from_secs(5)).unwrap();
    let e = store.read("ledger/x").await.unwrap_err().to_string();
    assert!(
        e.contains(&format!("127.0.0.1:{port}/devstoreaccount1/hubguard")),
        "{e}"
    );
    assert!(
        e.to_ascii_lowercase().contains("refused") || e.contains("connect"),
        "{e}"
    );
    assert!(!e.contains("SECRETSIG"), "{e}");
}

/// Writes a checkpoint blob for `partition` with the given `sequencenumber` text.
async fn bad_checkpoint(bed: &Bed, partition: &str, sequence: &str) -> String {
    let container = bed.container();
    let name = format!(
        "{}{partition}",
        hubguard::azure::checkpoint_store::blob_prefix(
            &bed.cs.host,
            "hub",
            "$Default",
            "checkpoint"
        )
    );
    container
        .put_blob(
            &name,
            Bytes::new(),
            "application/octet-stream",
            &[("sequencenumber", sequence), ("offset", "0")],
            &hubguard::azure::blob::Condition::None,
        )
        .await
        .unwrap();
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_holds_only_its_partition_and_names_the_blob() {
    for bad in ["not-a-number", "99999999999999999999", "-7"] {
        let bed = Bed::start(2).await;
        let blob = bad_checkpoint(&bed, "0", bad).await;
        bed.send(0, &[("p0-a", "ok")]).await;
        bed.send(1, &[("p1-a", "ok"), ("p1-b", "ok")]).await;
        let handler = Arc::new(Scripted::default());
        let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
        wait_for("partition 1 consumed", &run.health, LIMIT, || async {
            let d = handler.delivered_keys();
            d.contains("p1-a") && d.contains("p1-b")
        })
        .await;
        wait_for(
            "partition 0 held, naming the blob",
            &run.health,
            LIMIT,
            || async {
                run.health
                    .held()
                    .get("0")
                    .is_some_and(|h| h.reason.contains(&blob))
            },
        )
        .await;
        assert!(!run.health.ready(), "{bad}");
        assert!(
            !handler.delivered_keys().contains("p0-a"),
            "{bad}: partition 0 is not read from a guessed position"
        );
        // An operator deletes the bad blob: the partition is claimed and read again.
        bed.container().delete_blob(&blob, None).await.unwrap();
        wait_for(
            "partition 0 read after the repair",
            &run.health,
            LIMIT,
            || async { handler.delivered_keys().contains("p0-a") && run.health.held().is_empty() },
        )
        .await;
        run.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_list_and_replay_report_a_bad_record_and_carry_on() {
    use hubguard::handler::{Failure, Outcome};
    use hubguard::pipeline::settle::Source;
    let bed = Bed::start(1).await;
    let settler = bed.settler(fast_policy(5));
    for key in ["dl-a", "dl\tb", "dl-c"] {
        let event = hubguard::event::Event {
            body: b"x".to_vec(),
            content_type: None,
            properties: Default::default(),
            hub: "hub".into(),
            partition_id: "0".into(),
            sequence_number: 1,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: hubguard::event::Identity {
                idempotency_key: key.into(),
                correlation_id: key.into(),
                event_type: None,
            },
        };
        let s = settler
            .settle(&hubguard::pipeline::settle::Report {
                event: &event,
                attempt: 1,
                source: Source::EventHubs,
                started: std::time::SystemTime::now(),
                outcome: &Outcome::Failed(Failure::permanent("400 from the webhook")),
                trace_id: "t",
                traceparents: &[],
            })
            .await
            .unwrap();
        assert!(matches!(
            s,
            hubguard::pipeline::settle::Settled::DeadLettered(_)
        ));
    }
    corrupt(&bed, "dl-c").await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hubguard.toml");
    std::fs::write(
        &config,
        format!(
            "[eventhubs]\nconnection_string = \"{}\"\nhub = \"hub\"\n[servicebus]\nconnection_string = \"{}\"\n[storage]\ncontainer_url = \"{}\"\n[handler]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/events\"\n",
            bed.eh.connection_string(),
            bed.sb.connection_string(),
            bed.blob.container_url("hubguard"),
        ),
    )
    .unwrap();
    let run = move |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
            .args(args)
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
    };
    let (code, out, err) = tokio::task::spawn_blocking({
        let run = run.clone();
        move || run(&["dead-letters", "list"])
    })
    .await
    .unwrap();
    assert!(out.contains("3 dead-lettered"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("dl-a\t")), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("dl\\tb\t")),
        "the tab is escaped: {out}"
    );
    assert!(out.contains("dl-c\t(cannot be read"), "{out}");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("1 dead-lettered record(s) could not be read"),
        "{err}"
    );
    let (code, out, err) =
        tokio::task::spawn_blocking(move || run(&["dead-letters", "replay", "--all"]))
            .await
            .unwrap();
    assert!(out.contains("2 replayed"), "{out}");
    assert!(out.contains("dl-c: not replayed"), "{out}");
    assert_eq!(code, Some(1), "{err}");
}
