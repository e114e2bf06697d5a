//! `hubguard demo` as a new user runs it (scaled down): failures, both outages, a crash and
//! two replicas — and nothing lost, by the demo's independent count.

use std::process::Command;

#[test]
fn the_demo_loses_nothing_through_outages_and_crashes() {
    let out = Command::new(env!("CARGO_BIN_EXE_hubguard"))
        .args([
            "demo",
            "--events",
            "80",
            "--partitions",
            "2",
            "--replicas",
            "2",
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
    let r: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
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
