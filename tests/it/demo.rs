//! `hubguard demo` as a new user runs it (scaled down): failures, both outages, a crash and
//! two replicas — and nothing lost, by the demo's independent count.

use std::process::Command;

/// Runs the scaled-down demo (2 partitions, 2 replicas, failures, both outages, a crash
/// every 5 s) with `extra` flags; its JSON report.
fn scaled_demo(events: &str, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args([
            "demo",
            "--events",
            events,
            "--partitions",
            "2",
            "--replicas",
            "2",
        ])
        .args(extra)
        .args([
            "--transient-rate",
            "0.25",
            "--permanent-rate",
            "0.05",
            "--downstream-outage",
            "2s:3s",
            "--servicebus-outage",
            "7s:2s",
            "--crash-every",
            "5s",
            "--timeout",
            "150s",
            "--json",
        ])
        .output()
        .expect("hubguard demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[test]
fn the_demo_loses_nothing_through_outages_and_crashes() {
    let r = scaled_demo("80", &[]);
    assert_eq!(r["events"], 80);
    assert_eq!(r["lost"], 0, "{r}");
    assert_eq!(
        r["delivered"].as_u64().unwrap() + r["dead_lettered"].as_u64().unwrap(),
        80,
        "{r}"
    );
    assert!(
        r["dead_lettered"].as_u64().unwrap() >= 1,
        "permanent failures are dead-lettered: {r}"
    );
    assert!(r["retries_scheduled"].as_u64().unwrap() >= 10, "{r}");
    assert!(r["max_attempt"].as_u64().unwrap() >= 2, "{r}");
    assert!(r["crashes"].as_u64().unwrap() >= 1, "{r}");
    assert!(r["checkpoint_writes"].as_u64().unwrap() >= 1, "{r}");
    for key in [
        "duplicate_deliveries",
        "elapsed_ms",
        "breaker_opens",
        "breaker_reopens",
    ] {
        assert!(r.get(key).is_some(), "{key} in {r}");
    }
}

#[test]
fn the_demo_with_batches_loses_nothing_through_outages_and_crashes() {
    let r = scaled_demo("120", &["--batch-max", "8", "--max-in-flight", "24"]);
    assert_eq!(r["events"], 120);
    assert_eq!(r["lost"], 0, "{r}");
    assert_eq!(
        r["delivered"].as_u64().unwrap() + r["dead_lettered"].as_u64().unwrap(),
        120,
        "{r}"
    );
    assert!(r["dead_lettered"].as_u64().unwrap() >= 1, "{r}");
    assert!(r["retries_scheduled"].as_u64().unwrap() >= 10, "{r}");
}

#[test]
fn bad_demo_flags_are_refused_with_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["demo", "--downstream-outage", "soon"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--downstream-outage") && err.contains("START:DURATION"),
        "{err}"
    );
}

/// The chaos soak: `hubguard demo --chaos` — 8 partitions, 3 replicas, transient and permanent
/// failures, a downstream outage, two Service Bus outages, a blob storage outage and a replica
/// crash every 20 s, `max_in_flight` 8. Full size (100,000 events) by hand:
/// `cargo run --release -- demo --chaos`; `.ci/run` runs this test with
/// `HUBGUARD_SOAK_EVENTS` sized to its time budget.
#[test]
#[ignore = "long: run by .ci/run with HUBGUARD_SOAK_EVENTS, or by hand"]
fn chaos_soak_loses_nothing_and_never_checkpoints_past_an_unsettled_event() {
    let events = std::env::var("HUBGUARD_SOAK_EVENTS").unwrap_or_else(|_| "100000".into());
    // With batches on too: HUBGUARD_SOAK_BATCH_MAX (events per request; raises max_in_flight).
    let batch: Vec<String> = match std::env::var("HUBGUARD_SOAK_BATCH_MAX") {
        Ok(n) => {
            let in_flight = n
                .parse::<usize>()
                .expect("HUBGUARD_SOAK_BATCH_MAX is a number")
                * 4;
            vec![
                "--batch-max".into(),
                n,
                "--max-in-flight".into(),
                in_flight.to_string(),
            ]
        }
        Err(_) => Vec::new(),
    };
    let out = Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args(["demo", "--chaos", "--events", &events, "--json"])
        .args(&batch)
        .env("RUST_LOG", "error")
        .output()
        .expect("hubguard demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    let r: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "no report ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    eprintln!("chaos soak: {r}");
    let n: u64 = events.parse().unwrap();
    assert_eq!(r["events"], n);
    assert_eq!(r["lost"], 0, "{r}");
    assert_eq!(
        r["delivered"].as_u64().unwrap() + r["dead_lettered"].as_u64().unwrap(),
        n,
        "every event ends delivered or dead-lettered: {r}"
    );
    assert_eq!(r["checkpoint_violations"], 0, "{r}");
    assert!(r["checkpoint_writes_checked"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["attempt_regressions"], 0, "{r}");
    assert_eq!(r["double_scheduled"], 0, "{r}");
    assert!(r["crashes"].as_u64().unwrap() >= 2, "{r}");
    assert!(r["duplicate_ratio"].as_f64().is_some(), "{r}");
    assert!(out.status.success(), "{r}");
}
