//! `hubguard bench --only scale`: duplicates and unread time when replicas come and go on a
//! backlog, with hubguard's cooperative handover and with the SDK's own balancing alone
//! (`handover = false`: a partition moves by being stolen).
//!
//! Scenarios, each on fresh emulators with a 4-partition hub and a backlog:
//! - **cold start**: three replicas started together;
//! - **join**: one replica reading, two more join;
//! - **leave**: three reading, one stops gracefully (SIGTERM);
//! - **crash**: three reading, one dies without a word (its ownerships expire).
//!
//! Figures: deliveries beyond the first of an event (duplicates, % of the backlog), the
//! partition moves seen (a partition read by a replica other than the previous one), and the
//! longest time a partition that had been read was read by no replica (sampled every 10 ms
//! from each replica's readiness; the first claim at start is not counted).

use crate::sync::LockExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use tokio_util::sync::CancellationToken;

use super::pipelines::{bench_options, parts, start};
use crate::event::Event;
use crate::handler::{Attempt, Handler, Outcome};
use crate::pipeline::health::Health;
use crate::pipeline::Pipeline;
use crate::policy::RetryPolicy;

const PARTITIONS: usize = 4;

/// One scenario's figures.
#[derive(Debug, Clone)]
pub struct ScaleRun {
    /// The scenario.
    pub scenario: &'static str,
    /// Whether the cooperative handover was on.
    pub handover: bool,
    /// Events in the backlog.
    pub events: usize,
    /// Deliveries beyond the first.
    pub duplicates: usize,
    /// Partition moves seen.
    pub moves: usize,
    /// Longest time a partition was read by no replica, ms.
    pub max_unread_ms: u128,
}

impl ScaleRun {
    /// Duplicates as a share of the backlog, %.
    pub fn duplicate_pct(&self) -> f64 {
        self.duplicates as f64 * 100.0 / self.events.max(1) as f64
    }
}

/// Counts deliveries per event (partition, sequence number), after a fixed wait per event.
struct Counting {
    delay: Duration,
    seen: Mutex<HashMap<(String, i64), u32>>,
}

#[async_trait::async_trait]
impl Handler for Counting {
    async fn handle(&self, event: &Event, _attempt: &Attempt) -> Outcome {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        *self
            .seen
            .locked()
            .entry((event.partition_id.clone(), event.sequence_number))
            .or_default() += 1;
        Outcome::Delivered
    }
}

impl Counting {
    fn distinct(&self) -> usize {
        self.seen.locked().len()
    }
    fn duplicates(&self) -> usize {
        self.seen
            .locked()
            .values()
            .map(|n| (*n as usize).saturating_sub(1))
            .sum()
    }
}

struct Replica {
    health: Arc<Health>,
    cancel: CancellationToken,
    crash: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), crate::pipeline::RunError>>,
}

/// Watches which replica reads each partition.
#[derive(Default)]
struct Watch {
    /// partition → (replica reading it, or none since when).
    state: HashMap<String, (Option<usize>, Instant)>,
    moves: usize,
    max_unread: Duration,
}

impl Watch {
    fn sample(&mut self, replicas: &[Option<Arc<Health>>]) {
        let now = Instant::now();
        for p in 0..PARTITIONS {
            let p = p.to_string();
            let reader = replicas
                .iter()
                .position(|h| h.as_ref().is_some_and(|h| h.owned().contains_key(&p)));
            match (self.state.get(&p).copied(), reader) {
                (None, Some(r)) => {
                    self.state.insert(p, (Some(r), now));
                }
                (None, None) => {}
                (Some((Some(prev), _)), None) => {
                    self.state.insert(p, (None, now));
                    let _ = prev;
                }
                (Some((None, since)), Some(r)) => {
                    self.max_unread = self.max_unread.max(now - since);
                    self.moves += 1;
                    self.state.insert(p, (Some(r), now));
                }
                (Some((Some(prev), _)), Some(r)) if prev != r => {
                    self.moves += 1;
                    self.state.insert(p, (Some(r), now));
                }
                _ => {}
            }
        }
    }
}

struct Scenario {
    handler: Arc<Counting>,
    emulators: crate::emulator::Emulators,
    replicas: Vec<Option<Replica>>,
    watch: Watch,
    handover: bool,
    max_in_flight: usize,
}

impl Scenario {
    async fn new(handover: bool, delay: Duration, max_in_flight: usize) -> anyhow::Result<Self> {
        let (emulators, _) = start(PARTITIONS).await?;
        Ok(Self {
            handler: Arc::new(Counting {
                delay,
                seen: Mutex::default(),
            }),
            emulators,
            replicas: Vec::new(),
            watch: Watch::default(),
            handover,
            max_in_flight,
        })
    }

    fn cs(&self) -> anyhow::Result<crate::azure::ConnectionString> {
        Ok(self
            .emulators
            .eventhubs
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("event hubs"))?
            .connection_string()
            .parse()?)
    }

    fn add(&mut self) -> anyhow::Result<()> {
        let mut options = bench_options();
        options.owner_id = format!("replica-{}", self.replicas.len());
        options.handover = self.handover;
        options.max_in_flight = self.max_in_flight;
        let pipeline = Pipeline::new(parts(
            &self.emulators,
            self.handler.clone(),
            RetryPolicy::seed_fibonacci(),
            options,
        )?);
        let health = pipeline.health();
        let (cancel, crash) = (CancellationToken::new(), CancellationToken::new());
        let task = tokio::spawn(pipeline.run_until(cancel.clone(), crash.clone()));
        self.replicas.push(Some(Replica {
            health,
            cancel,
            crash,
            task,
        }));
        Ok(())
    }

    fn healths(&self) -> Vec<Option<Arc<Health>>> {
        self.replicas
            .iter()
            .map(|r| r.as_ref().map(|r| r.health.clone()))
            .collect()
    }

    /// Samples until `done` holds (bounded: 120 s, or 30 s without progress).
    async fn until(
        &mut self,
        what: &str,
        mut done: impl FnMut(&Self) -> bool,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut last = (self.handler.distinct(), Instant::now());
        while !done(self) {
            let h = self.healths();
            self.watch.sample(&h);
            tokio::time::sleep(Duration::from_millis(10)).await;
            let n = self.handler.distinct();
            if n != last.0 {
                last = (n, Instant::now());
            }
            if started.elapsed() > Duration::from_secs(120)
                || last.1.elapsed() > Duration::from_secs(30)
            {
                bail!("scale bench: {what} did not happen ({n} events delivered)");
            }
        }
        Ok(())
    }

    async fn remove(&mut self, i: usize, crash: bool) -> anyhow::Result<()> {
        let Some(r) = self.replicas.get_mut(i).and_then(Option::take) else {
            bail!("no replica {i}");
        };
        if crash {
            r.crash.cancel();
        } else {
            r.cancel.cancel();
        }
        // Keep sampling while it stops.
        let mut task = r.task;
        loop {
            tokio::select! {
                done = &mut task => { done??; break; }
                _ = tokio::time::sleep(Duration::from_millis(10)) => {
                    let h = self.healths();
                    self.watch.sample(&h);
                }
            }
        }
        Ok(())
    }

    async fn finish(mut self, scenario: &'static str, events: usize) -> anyhow::Result<ScaleRun> {
        self.until("the backlog delivered", |s| s.handler.distinct() >= events)
            .await?;
        for i in 0..self.replicas.len() {
            if self.replicas[i].is_some() {
                self.remove(i, false).await?;
            }
        }
        let run = ScaleRun {
            scenario,
            handover: self.handover,
            events,
            duplicates: self.handler.duplicates(),
            moves: self.watch.moves,
            max_unread_ms: self.watch.max_unread.as_millis(),
        };
        self.emulators.shutdown().await;
        Ok(run)
    }
}

/// Runs every scenario with the handover on and off: `per_partition` events on each of
/// four partitions, a handler taking `delay`, `max_in_flight` events of a partition at once.
pub async fn scale(
    per_partition: usize,
    delay: Duration,
    max_in_flight: usize,
) -> anyhow::Result<Vec<ScaleRun>> {
    let events = per_partition * PARTITIONS;
    let mut runs = Vec::new();
    for handover in [true, false] {
        // Cold start: three replicas together on a backlog.
        let mut s = Scenario::new(handover, delay, max_in_flight).await?;
        super::produce(&s.cs()?, PARTITIONS, events, 256).await?;
        for _ in 0..3 {
            s.add()?;
        }
        runs.push(s.finish("cold start of 3", events).await?);

        // Join: one reads the backlog; two join once a tenth is delivered.
        let mut s = Scenario::new(handover, delay, max_in_flight).await?;
        super::produce(&s.cs()?, PARTITIONS, events, 256).await?;
        s.add()?;
        s.until("a tenth delivered", |s| s.handler.distinct() >= events / 10)
            .await?;
        s.add()?;
        s.add()?;
        runs.push(s.finish("2 join 1", events).await?);

        // Leave and crash: three read, one goes once a fifth is delivered.
        for (name, crash) in [("1 of 3 leaves", false), ("1 of 3 crashes", true)] {
            let mut s = Scenario::new(handover, delay, max_in_flight).await?;
            super::produce(&s.cs()?, PARTITIONS, events, 256).await?;
            for _ in 0..3 {
                s.add()?;
            }
            s.until("every partition read, a fifth delivered", |s| {
                s.handler.distinct() >= events / 5
                    && s.watch.state.values().filter(|(r, _)| r.is_some()).count() == PARTITIONS
            })
            .await?;
            // The replica reading the most partitions goes.
            let busiest = (0..s.replicas.len())
                .max_by_key(|i| {
                    s.replicas[*i]
                        .as_ref()
                        .map_or(0, |r| r.health.owned().len())
                })
                .unwrap_or(0);
            s.remove(busiest, crash).await?;
            runs.push(s.finish(name, events).await?);
        }
    }
    Ok(runs)
}
