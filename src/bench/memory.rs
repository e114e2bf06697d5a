//! Resident memory of `hubguard run` with no retries pending and with many pending: the waits
//! must live in Service Bus, not in the process. The emulators and a webhook receiver run
//! in this process; the service runs as a child process (this same binary, `hubguard run`),
//! so its resident set is measured alone.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};

use crate::azure::ConnectionString;
use crate::emulator::eventhubs::HubSpec;
use crate::emulator::producer::{self, Outgoing, Plan};
use crate::emulator::{Emulators, EmulatorsConfig};

/// What the memory scenario measured.
#[derive(Debug, Clone)]
pub struct Memory {
    /// Retries pending in Service Bus in the last reading.
    pub pending: u64,
    /// Retries pending in the warm-up reading.
    pub warm_pending: u64,
    /// Resident set after `pending` events were delivered (none pending), MB.
    pub rss_idle_mb: f64,
    /// Resident set once the failure path ran (ledger, Service Bus clients) with
    /// `warm_pending` retries pending, MB.
    pub rss_warm_mb: f64,
    /// Resident set with `pending` retries scheduled, MB (the median of its readings).
    pub rss_pending_mb: f64,
    /// The growth for `pending` retries of each reading with them pending (from the warm-up
    /// median, scaled as [`Memory::growth_per_pending_mb`]), MB, in order.
    pub growth_readings_mb: Vec<f64>,
}

/// Readings of the resident set at each stage, a second apart: one reading moved with
/// whatever the process was doing at that instant (a pool growing, a batch in flight).
pub const READINGS: usize = 7;

/// The median of `v` (NaN if empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

async fn readings(pid: u32) -> anyhow::Result<Vec<f64>> {
    let mut out = Vec::with_capacity(READINGS);
    for i in 0..READINGS {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        out.push(rss_mb(pid)?);
    }
    Ok(out)
}

impl Memory {
    /// The growth's readings: the smallest and the largest (their spread).
    pub fn growth_range_mb(&self) -> (f64, f64) {
        let lo = self
            .growth_readings_mb
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let hi = self
            .growth_readings_mb
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        (lo, hi)
    }

    /// Growth attributable to pending retries: from `warm_pending` to `pending`, scaled to
    /// `pending` (the failure path's fixed cost, its clients and pools, is left out); the
    /// median of the readings.
    pub fn growth_per_pending_mb(&self) -> f64 {
        median(&self.growth_readings_mb)
    }

    fn scale(&self) -> f64 {
        let extra = self.pending.saturating_sub(self.warm_pending).max(1) as f64;
        self.pending as f64 / extra
    }
}

/// The resident set of process `pid` in MB (Linux: `/proc/<pid>/status`).
pub fn rss_mb(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .context("reading /proc (resident memory is measured on Linux only)")?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS in /proc status")?;
    Ok(kb / 1024.0)
}

/// Sends `events` events keyed `{prefix}-{n}`, 500 to each partition in turn.
async fn produce_keyed(
    cs: &ConnectionString,
    prefix: &str,
    events: usize,
    partitions: usize,
) -> anyhow::Result<()> {
    let plan = Plan::round_robin("bench", events, partitions, 500);
    producer::produce(cs, &plan, |n| {
        Outgoing::keyed(format!("{prefix}-{n}"), format!("{{\"n\":{n}}}"))
    })
    .await?;
    Ok(())
}

struct Child(tokio::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

fn config(emulators: &Emulators, webhook: &str, partitions: usize) -> anyhow::Result<String> {
    let eh = emulators.eventhubs.as_ref().context("event hubs")?;
    let sb = emulators.servicebus.as_ref().context("service bus")?;
    let blob = emulators.blob.as_ref().context("blob")?;
    let _ = partitions;
    Ok(format!(
        r#"[eventhubs]
connection_string = "{}"
hub = "bench"
[servicebus]
connection_string = "{}"
queue = "retries"
[storage]
container_url = "{}"
[handler]
kind = "webhook"
url = "{webhook}"
[processor]
update_interval_ms = 500
ownership_expiration_ms = 5000
max_in_flight = 64
ordering_key = "none"
[status]
listen = "127.0.0.1:0"
[breaker]
enabled = false
[policy.default]
curve = "fixed"
base_s = 3600
floor_s = 3600
cap_s = 3600
max_attempts = 5
"#,
        eh.connection_string(),
        sb.connection_string(),
        blob.container_url("hubguard"),
    ))
}

/// Runs `hubguard run` as a child: `events` delivered, then `pending` failing for an hour.
pub async fn memory(events: usize, pending: usize, partitions: usize) -> anyhow::Result<Memory> {
    let emulators = Emulators::start(EmulatorsConfig {
        hubs: vec![HubSpec::new("bench", partitions)],
        ..Default::default()
    })
    .await?;
    let behaviour: crate::emulator::webhook::Behaviour =
        Arc::new(|key: &str, _| if key.starts_with("fail-") { 503 } else { 200 });
    let hook = crate::emulator::webhook::WebhookReceiver::start_with(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        behaviour,
    )
    .await?;
    let dir = tempdir()?;
    let path = dir.join("hubguard.toml");
    std::fs::write(&path, config(&emulators, &hook.url(), partitions)?)?;
    let cs: ConnectionString = emulators
        .eventhubs
        .as_ref()
        .context("event hubs")?
        .connection_string()
        .parse()?;
    let sb = emulators.servicebus.as_ref().context("service bus")?;
    produce_keyed(&cs, "ok", events, partitions).await?;
    let exe = std::env::current_exe().context("locating the hubguard binary")?;
    let child = Child(
        tokio::process::Command::new(exe)
            .arg("run")
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting `hubguard run`")?,
    );
    let pid = child.0.id().context("child pid")?;
    super::pipelines::wait_progress(
        "`hubguard run` delivering",
        || hook.deliveries().len() as u64,
        events as u64,
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_idle_mb = median(&readings(pid).await?);
    // Warm up the failure path (webhook failures, ledger writes, Service Bus sends, their
    // connection pools at full concurrency) with 5,000 retries (at most half of them), then
    // schedule the rest.
    let warm = (pending / 2).clamp(1, 5000);
    // `n` more events fail; read the resident set once `scheduled` retries wait in Service Bus.
    let fail_and_read = async |prefix: &str, n: usize, scheduled: usize| {
        produce_keyed(&cs, prefix, n, partitions).await?;
        super::pipelines::wait_progress(
            "`hubguard run` scheduling retries",
            || sb.counters("retries").map_or(0, |c| c.scheduled),
            scheduled as u64,
        )
        .await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        readings(pid).await
    };
    let warm_readings = fail_and_read("fail-warm", warm, warm).await?;
    let pending_readings = fail_and_read("fail", pending - warm, pending).await?;
    let pending_now = sb.counters("retries").map_or(0, |c| c.scheduled);
    if pending_now < pending as u64 {
        bail!("only {pending_now} retries pending");
    }
    drop(child);
    emulators.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    let mut m = Memory {
        pending: pending_now,
        warm_pending: warm as u64,
        rss_idle_mb,
        rss_warm_mb: median(&warm_readings),
        rss_pending_mb: median(&pending_readings),
        growth_readings_mb: Vec::new(),
    };
    let scale = m.scale();
    m.growth_readings_mb = pending_readings
        .iter()
        .map(|r| (r - m.rss_warm_mb) * scale)
        .collect();
    Ok(m)
}

fn tempdir() -> anyhow::Result<PathBuf> {
    let dir =
        std::env::temp_dir().join(format!("hubguard-bench-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
