//! `hubguard checkpoints rewind` through the binary against running replicas on the
//! emulators: refused while an owner reads the partition, applied by the owner once paused
//! (events after the rewound position delivered again, as attempt 1, nothing else), and
//! applied by the command itself when no replica owns the partitions.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{eventually, seen};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Runs the binary with `args` and the configuration; (exit code, stdout).
pub(crate) async fn hubguard(config: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    let (config, args) = (
        config.to_path_buf(),
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    );
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubguard"))
            .args(&args)
            .arg("--config")
            .arg(&config)
            .env("NO_COLOR", "1")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr),
        )
    })
    .await
    .unwrap()
}

pub(crate) fn config_of(bed: &Bed, dir: &tempfile::TempDir) -> std::path::PathBuf {
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
    config
}

pub(crate) fn json_of(out: &str) -> serde_json::Value {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON in: {out}"));
    serde_json::from_str(line).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_is_refused_while_owned_then_applied_by_the_paused_owner_and_delivers_again_from_there(
) {
    let bed = Bed::start(2).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    let b = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-b"));
    let p0: Vec<String> = (0..5).map(|i| format!("p0-{i}")).collect();
    let p1: Vec<String> = (0..3).map(|i| format!("p1-{i}")).collect();
    let with_ok = |keys: &[String]| keys.iter().map(|k| (k.clone(), "ok")).collect::<Vec<_>>();
    let (e0, e1) = (with_ok(&p0), with_ok(&p1));
    bed.send(
        0,
        &e0.iter().map(|(k, b)| (k.as_str(), *b)).collect::<Vec<_>>(),
    )
    .await;
    bed.send(
        1,
        &e1.iter().map(|(k, b)| (k.as_str(), *b)).collect::<Vec<_>>(),
    )
    .await;
    wait_for(
        "every event delivered and checkpointed",
        &a.health,
        LIMIT,
        || async {
            handler.delivered_keys().len() == 8
                && bed.checkpoint_of("0").await == Some(4)
                && bed.checkpoint_of("1").await == Some(2)
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_of(&bed, &dir);

    // Owned and read: refused, nothing written.
    let (code, out) = hubguard(
        &config,
        &[
            "checkpoints",
            "rewind",
            "--sequence",
            "2",
            "--partition",
            "0",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, Some(6), "{out}");
    let v = json_of(&out);
    assert_eq!(v["partitions"][0]["result"], "refused", "{out}");
    assert!(
        v["partitions"][0]["why"]
            .as_str()
            .unwrap()
            .contains("partitions pause --partition 0"),
        "{out}"
    );
    assert_eq!(bed.checkpoint_of("0").await, Some(4));

    // A dry run says what it would do and writes nothing.
    let (code, out) = hubguard(
        &config,
        &["partitions", "pause", "--partition", "0", "--by", "alice"],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = hubguard(
        &config,
        &[
            "checkpoints",
            "rewind",
            "--sequence",
            "2",
            "--partition",
            "0",
            "--dry-run",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let v = json_of(&out);
    assert_eq!(
        (
            v["partitions"][0]["result"].as_str(),
            v["partitions"][0]["first"].as_i64(),
            v["partitions"][0]["events_again"].as_i64()
        ),
        (Some("would_rewind"), Some(2), Some(3)),
        "{out}"
    );
    assert_eq!(bed.checkpoint_of("0").await, Some(4));

    // Paused: the owner applies it.
    let (code, out) = hubguard(
        &config,
        &[
            "checkpoints",
            "rewind",
            "--sequence",
            "2",
            "--partition",
            "0",
            "--by",
            "alice",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let v = json_of(&out);
    let by = v["partitions"][0]["by"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        by == "replica-a" || by == "replica-b",
        "applied by the owner: {out}"
    );
    assert_eq!(bed.checkpoint_of("0").await, Some(1), "{out}");
    // Nothing is read while paused, and the rewound checkpoint holds.
    assert_eq!(handler.calls_of("p0-2"), vec![1]);

    // The status API shows the control record.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let router = hubguard::status::router(a.health.clone(), bed.ledger(), None);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let (code, body) = crate::common::http_get(&addr, "/v1/control").await;
    assert_eq!(code, 200, "{body}");
    let control: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(control["partitions"]["0"]["by"], "alice", "{control}");
    assert_eq!(control["rewinds"]["0"]["first"], 2, "{control}");
    assert_eq!(
        control["rewinds"]["0"]["applied"]["by"],
        by.as_str(),
        "{control}"
    );

    // Run again: already there, nothing to do.
    let (code, out) = hubguard(
        &config,
        &[
            "checkpoints",
            "rewind",
            "--sequence",
            "2",
            "--partition",
            "0",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(json_of(&out)["partitions"][0]["result"], "nothing", "{out}");

    let (code, out) = hubguard(&config, &["partitions", "resume"]).await;
    assert_eq!(code, Some(0), "{out}");
    wait_for(
        "partition 0 delivered again from 2",
        &a.health,
        LIMIT,
        || async {
            p0[2..].iter().all(|k| handler.calls_of(k).len() == 2)
                && bed.checkpoint_of("0").await == Some(4)
        },
    )
    .await;
    a.stop().await;
    b.stop().await;
    for k in &p0[..2] {
        assert_eq!(handler.calls_of(k), vec![1], "{k}: before the rewind, once");
    }
    for k in &p0[2..] {
        assert_eq!(
            handler.calls_of(k),
            vec![1, 1],
            "{k}: again, as a first attempt"
        );
    }
    for k in &p1 {
        assert_eq!(
            handler.calls_of(k),
            vec![1],
            "{k}: another partition, untouched"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_replica_running_the_command_rewinds_to_a_time_and_the_next_replica_reads_from_there(
) {
    let bed = Bed::start(2).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    bed.send(0, &[("old-0", "ok")]).await;
    bed.send(1, &[("old-1", "ok")]).await;
    wait_for("the old events checkpointed", &a.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(0) && bed.checkpoint_of("1").await == Some(0)
    })
    .await;
    // The emulator stamps enqueued times with the wall clock, in milliseconds: `since` is a
    // millisecond after the old events, and the new ones go once the clock is past it.
    let hub = bed.eh.store().hub("hub").unwrap();
    let old = (0..2)
        .map(|p| hub.partitions[p].info().last_enqueued_ms)
        .max()
        .unwrap();
    let since_ms = old + 1;
    eventually("the clock passes `since`", LIMIT, || async {
        seen(hubguard::clock::ms(std::time::SystemTime::now()), |now| {
            *now > since_ms
        })
    })
    .await;
    let since = hubguard::clock::rfc3339(hubguard::clock::at(since_ms));
    bed.send(0, &[("new-0", "ok")]).await;
    bed.send(1, &[("new-1", "ok")]).await;
    wait_for("the new events checkpointed", &a.health, LIMIT, || async {
        bed.checkpoint_of("0").await == Some(1) && bed.checkpoint_of("1").await == Some(1)
    })
    .await;
    a.stop().await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_of(&bed, &dir);
    let (code, out) = hubguard(
        &config,
        &["checkpoints", "rewind", "--to", &since, "--json"],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let v = json_of(&out);
    for p in 0..2 {
        let line = &v["partitions"][p];
        assert_eq!(
            (
                line["result"].as_str(),
                line["by"].as_str(),
                line["first"].as_i64()
            ),
            (
                Some("applied"),
                Some("hubguard checkpoints rewind"),
                Some(1)
            ),
            "{out}"
        );
    }
    assert_eq!(bed.checkpoint_of("0").await, Some(0));
    assert_eq!(bed.checkpoint_of("1").await, Some(0));
    // From the first event: the checkpoint names the event before it, offset -1 (the start
    // of the retained stream).
    let (code, out) = hubguard(
        &config,
        &[
            "checkpoints",
            "rewind",
            "--sequence",
            "0",
            "--partition",
            "1",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let v = json_of(&out);
    assert_eq!(
        (
            v["partitions"][0]["first"].as_i64(),
            v["partitions"][0]["result"].as_str()
        ),
        (Some(0), Some("applied")),
        "{out}"
    );
    assert_eq!(bed.checkpoint_of("1").await, Some(-1));
    let (code, out) = hubguard(
        &config,
        &["checkpoints", "rewind", "--sequence=-1", "--partition", "1"],
    )
    .await;
    assert_eq!(
        code,
        Some(2),
        "a negative sequence number is a usage error: {out}"
    );
    // Beyond the last event: refused with the reason.
    let (code, out) = hubguard(
        &config,
        &[
            "checkpoints",
            "rewind",
            "--sequence",
            "99",
            "--partition",
            "0",
        ],
    )
    .await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("beyond"), "{out}");
    let b = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-b"));
    wait_for(
        "read again from the rewound positions",
        &b.health,
        LIMIT,
        || async {
            handler.calls_of("new-0").len() == 2
                && handler.calls_of("old-1").len() == 2
                && handler.calls_of("new-1").len() == 2
                && bed.checkpoint_of("0").await == Some(1)
                && bed.checkpoint_of("1").await == Some(1)
        },
    )
    .await;
    b.stop().await;
    assert_eq!(handler.calls_of("old-0"), vec![1], "before --to: not again");
}

/// An event held for Service Bus while the partition is paused: the owner applies the rewind
/// only after it settles, so its own checkpoint never lands after the rewind's, and the
/// command says it waits (exit 7) until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_waits_for_an_event_held_during_a_service_bus_outage_and_never_skips_it() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    bed.send(0, &[("first", "ok")]).await;
    wait_for(
        "first delivered and checkpointed",
        &a.health,
        LIMIT,
        || async { bed.checkpoint_of("0").await == Some(0) },
    )
    .await;
    bed.sb
        .faults()
        .error_status_for(503, Duration::from_secs(3600));
    bed.send(0, &[("stuck", "fail:1")]).await;
    wait_for("held for Service Bus", &a.health, LIMIT, || async {
        a.health
            .held()
            .get("0")
            .is_some_and(|h| h.cause == hubguard::pipeline::health::HoldCause::ServiceBus)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_of(&bed, &dir);
    let (code, out) = hubguard(&config, &["partitions", "pause"]).await;
    assert_eq!(code, Some(0), "{out}");
    wait_for("paused", &a.health, LIMIT, || async {
        a.health
            .held()
            .contains_key(&hubguard::pipeline::control::held_name("0"))
    })
    .await;
    let (code, out) = hubguard(
        &config,
        &[
            "checkpoints",
            "rewind",
            "--sequence",
            "0",
            "--wait",
            "3",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, Some(7), "the owner holds an unsettled event: {out}");
    let v = json_of(&out);
    assert_eq!(
        (
            v["partitions"][0]["result"].as_str(),
            v["partitions"][0]["owner"].as_str()
        ),
        (Some("waiting"), Some("replica-a")),
        "{out}"
    );
    assert_eq!(
        bed.checkpoint_of("0").await,
        Some(0),
        "not applied while held"
    );
    bed.sb.faults().clear();
    let store = bed.records();
    let name = hubguard::pipeline::control::record_name("hub", "$Default");
    wait_for(
        "applied once the held event settled",
        &a.health,
        LIMIT,
        || async {
            hubguard::pipeline::control::read(store.as_ref(), &name)
                .await
                .ok()
                .flatten()
                .is_some_and(|c| c.value.rewinds["0"].applied.is_some())
        },
    )
    .await;
    assert_eq!(bed.checkpoint_of("0").await, Some(-1));
    let (code, out) = hubguard(&config, &["partitions", "resume"]).await;
    assert_eq!(code, Some(0), "{out}");
    wait_for("read again from the start", &a.health, LIMIT, || async {
        handler.calls_of("first").len() == 2
            && handler.delivered_keys().contains("stuck")
            && bed.checkpoint_of("0").await == Some(1)
    })
    .await;
    a.stop().await;
    assert_eq!(handler.calls_of("first"), vec![1, 1]);
    assert_eq!(
        handler.calls_of("stuck")[0],
        1,
        "{:?}",
        handler.calls_of("stuck")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_with_a_retry_pending_reads_the_partition_again_every_time() {
    let bed = Bed::start(1).await;
    let handler = Arc::new(Scripted::default());
    let a = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    bed.send(0, &[("first", "ok"), ("retried", "fail:1"), ("last", "ok")])
        .await;
    wait_for("all three delivered", &a.health, LIMIT, || async {
        handler.delivered_keys().len() == 3 && bed.checkpoint_of("0").await == Some(2)
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_of(&bed, &dir);
    for round in 1..=4usize {
        // A retry pending while the rewind is asked for: refused once more, due in 1 s.
        let key = format!("pending-{round}");
        bed.send(0, &[(key.as_str(), "fail:1")]).await;
        let end = 2 + round as i64;
        wait_for(
            &format!("{key} failed once, its retry scheduled and checkpointed past"),
            &a.health,
            LIMIT,
            || async {
                handler.calls_of(&key).len() == 1 && bed.checkpoint_of("0").await == Some(end)
            },
        )
        .await;
        let (code, out) = hubguard(&config, &["partitions", "pause", "--partition", "0"]).await;
        assert_eq!(code, Some(0), "{out}");
        let (code, out) = hubguard(
            &config,
            &[
                "checkpoints",
                "rewind",
                "--sequence",
                "0",
                "--partition",
                "0",
                "--json",
            ],
        )
        .await;
        assert_eq!(code, Some(0), "round {round}: {out}");
        assert_eq!(
            json_of(&out)["partitions"][0]["result"],
            "applied",
            "round {round}: {out}"
        );
        let (code, out) = hubguard(&config, &["partitions", "resume"]).await;
        assert_eq!(code, Some(0), "{out}");
        let times = round + 1;
        wait_for(
            &format!("round {round}: partition 0 read again from its first event"),
            &a.health,
            Duration::from_secs(30),
            || async {
                handler.calls_of("first").len() == times && handler.delivered_keys().contains(&key)
            },
        )
        .await;
    }
    a.stop().await;
}
