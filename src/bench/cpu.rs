//! The guard's cost in CPU: CPU time of the consuming process per event, hubguard (a no-op
//! handler) against a bare SDK consumer loop that checkpoints on the same schedule, with the
//! emulators in **another process** (`hubguard emulator`, started as a child), so their work
//! is counted against neither — as on Azure, where the broker and the storage account run
//! elsewhere. Both read the same events from the same hub, one after the other.
//!
//! CPU time is this process's user + system time from `/proc/self/stat` (clock ticks of
//! 1/100 s, Linux's `USER_HZ`); with thousands of events per run that resolution is well
//! under a percent of the figure.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use azure_messaging_eventhubs::ConsumerClient;

use super::pipelines;
use crate::azure::{BlobCheckpointStore, ConnectionString};
use crate::pipeline::{EventHubsTarget, Pipeline};
use crate::wiring::{ServiceBusAccess, StorageAccess, Wiring};

/// What the CPU scenario measured.
#[derive(Debug, Clone)]
pub struct CpuFigures {
    /// Events each consumer read.
    pub events: usize,
    /// Partitions of the hub.
    pub partitions: usize,
    /// Latency profile of the emulators' process.
    pub latency: String,
    /// CPU µs per event, hubguard with a no-op handler.
    pub guard_us: f64,
    /// CPU µs per event, a bare SDK consumer checkpointing on the same schedule.
    pub bare_us: f64,
}

impl CpuFigures {
    /// `cpu_per_event_ratio`.
    pub fn ratio(&self) -> f64 {
        self.guard_us / self.bare_us.max(1e-9)
    }
}

/// This process's CPU time (user + system) so far.
pub(super) fn cpu_time() -> anyhow::Result<Duration> {
    cpu_time_of("self")
}

/// The CPU time so far of the busiest of this process's threads named `name` (as `/proc`
/// shortens names: 15 bytes).
pub(super) fn busiest_thread_cpu_time(name: &str) -> anyhow::Result<Duration> {
    let short = &name[..name.len().min(15)];
    let mut busiest = Duration::ZERO;
    for task in std::fs::read_dir("/proc/self/task").context("reading /proc/self/task")? {
        let tid = task?.file_name().to_string_lossy().into_owned();
        let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"));
        if comm.is_ok_and(|c| c.trim_end() == short) {
            // A thread that ended since the listing is not counted.
            let used = cpu_time_of(&format!("self/task/{tid}")).unwrap_or_default();
            busiest = busiest.max(used);
        }
    }
    Ok(busiest)
}

/// The CPU time (user + system) so far of process `pid` (`self`: this one).
fn cpu_time_of(pid: &str) -> anyhow::Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // Fields after the command name (which may hold spaces) in parentheses: state is the
    // 3rd field, utime the 14th and stime the 15th (proc(5)).
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("/proc/self/stat has no command name")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i - 3)
            .context("/proc/self/stat is short")?
            .parse::<u64>()
            .context("/proc/self/stat: not a number")
    };
    let t = ticks(14)? + ticks(15)?;
    Ok(Duration::from_millis(t * 10))
}

/// The emulators in a child process, killed when dropped.
pub(super) struct ChildEmulators {
    child: Child,
    lines: BTreeMap<String, String>,
}

impl ChildEmulators {
    /// The endpoint the child listed as `name` (`eventhubs`, `servicebus`, `blob`,
    /// `webhook`).
    pub(super) fn line(&self, name: &str) -> anyhow::Result<&str> {
        self.lines
            .get(name)
            .map(String::as_str)
            .with_context(|| format!("the child listed no {name} endpoint"))
    }

    /// The child's CPU time (user + system) so far.
    pub(super) fn cpu_time(&self) -> anyhow::Result<Duration> {
        cpu_time_of(&self.child.id().to_string())
    }
}

impl Drop for ChildEmulators {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_child(partitions: usize, latency: &str) -> anyhow::Result<ChildEmulators> {
    start_child_with(partitions, latency, None)
}

/// `hubguard emulator` in a child process: hub `bench` with `partitions`, the `latency`
/// profile, the webhook receiver failing as `webhook_failures` says.
pub(super) fn start_child_with(
    partitions: usize,
    latency: &str,
    webhook_failures: Option<&str>,
) -> anyhow::Result<ChildEmulators> {
    let exe = std::env::current_exe().context("finding the hubguard binary")?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "emulator",
        "--eventhubs-port",
        "0",
        "--eventhubs-rest-port",
        "0",
        "--servicebus-port",
        "0",
        "--blob-port",
        "0",
        "--webhook-port",
        "0",
        "--admin-port",
        "0",
        "--hub",
        &format!("bench:{partitions}"),
    ]);
    if latency != "none" {
        cmd.args(["--latency", latency]);
    }
    if let Some(mix) = webhook_failures {
        cmd.args(["--webhook-failures", mix]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .context("starting `hubguard emulator` in a child process")?;
    let stdout = child.stdout.take().context("the child's stdout")?;
    let mut lines = BTreeMap::new();
    let mut reader = BufReader::new(stdout);
    let mut guard = ChildEmulators {
        child,
        lines: BTreeMap::new(),
    };
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            bail!("the emulators' process ended before it listed its endpoints");
        }
        if let Some((k, v)) = line.trim().split_once(": ") {
            lines.insert(k.to_string(), v.to_string());
            if k == "admin" {
                break;
            }
        }
    }
    guard.lines = lines;
    Ok(guard)
}

/// Reads every event with a bare SDK consumer (one receiver per partition), checkpointing
/// each partition every `every_events` events or `every` (as hubguard's pipeline does),
/// through the same blob checkpoint store; returns the events read.
async fn bare_with_checkpoints(
    cs: &ConnectionString,
    store: Arc<BlobCheckpointStore>,
    per_partition: &[usize],
    every_events: u64,
    every: Duration,
) -> anyhow::Result<usize> {
    let consumer = Arc::new(
        cs.open_consumer(ConsumerClient::builder(), "bench")
            .await
            .context("opening the bare consumer")?,
    );
    let checkpoints = super::BareCheckpoints {
        store,
        namespace: cs.host.clone(),
        consumer_group: "bare".into(),
        every_events,
        every,
    };
    let (n, _, _) = super::bare_consume(&consumer, per_partition, 300, Some(checkpoints)).await?;
    if let Ok(c) = Arc::try_unwrap(consumer) {
        c.close().await?;
    }
    Ok(n)
}

/// Measures both, bare first.
pub async fn cpu(
    partitions: usize,
    events: usize,
    size: usize,
    latency: &str,
) -> anyhow::Result<CpuFigures> {
    let child = start_child(partitions, latency)?;
    let eh: ConnectionString = child
        .lines
        .get("eventhubs")
        .context("the child listed no Event Hubs endpoint")?
        .parse()?;
    let sb = child
        .lines
        .get("servicebus")
        .context("the child listed no Service Bus endpoint")?
        .clone();
    let blob = child
        .lines
        .get("blob")
        .context("the child listed no blob endpoint")?
        .clone();
    let container = format!("{}/{}", blob.trim_end_matches('/'), "hubguard");
    super::produce(&eh, partitions, events, size).await?;
    let per_partition = {
        let consumer = eh
            .open_consumer(ConsumerClient::builder(), "bench")
            .await
            .context("opening a consumer")?;
        let mut v = Vec::new();
        for p in 0..partitions {
            let props = consumer.get_partition_properties(&p.to_string()).await?;
            v.push(if props.is_empty {
                0
            } else {
                (props.last_enqueued_sequence_number - props.beginning_sequence_number + 1) as usize
            });
        }
        consumer.close().await?;
        v
    };
    let sent: usize = per_partition.iter().sum();
    let options = pipelines::bench_options();
    let storage = StorageAccess::url(&container);
    let store = storage.record_store(options.deadline)?;
    let checkpoints = BlobCheckpointStore::new(store.container());

    let before = cpu_time()?;
    let bare = bare_with_checkpoints(
        &eh,
        checkpoints,
        &per_partition,
        options.checkpoint_every_events,
        options.checkpoint_every,
    )
    .await?;
    let bare_cpu = cpu_time()? - before;

    let handler = Arc::new(pipelines::BenchHandler::new(Duration::ZERO, 0, false));
    let wiring = Wiring::new(
        EventHubsTarget::with_connection_string(&eh, "bench", "$Default"),
        storage,
        ServiceBusAccess::ConnectionString(sb.parse()?),
    )
    .breaker(crate::breaker::BreakerConfig::default())
    .options(options);
    let parts = wiring.parts(handler.clone())?;
    let before = cpu_time()?;
    let pipeline = Pipeline::new(parts);
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(pipeline.run(cancel.clone()));
    let h = handler.clone();
    pipelines::wait_progress(
        "hubguard (cpu)",
        || h.delivered.load(std::sync::atomic::Ordering::Relaxed),
        sent as u64,
    )
    .await?;
    cancel.cancel();
    run.await??;
    let guard_cpu = cpu_time()? - before;
    drop(child);
    if bare == 0 {
        bail!("the bare consumer read nothing");
    }
    Ok(CpuFigures {
        events: bare,
        partitions,
        latency: latency.to_string(),
        guard_us: guard_cpu.as_secs_f64() * 1e6 / sent as f64,
        bare_us: bare_cpu.as_secs_f64() * 1e6 / bare as f64,
    })
}
