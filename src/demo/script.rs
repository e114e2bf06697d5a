//! The demo's script: what happens when. The replicas start, the producer sends the events
//! spread over `--produce-over`, each outage starts at its time, a replica crashes every
//! `--crash-every` and starts again; once a second the progress is drawn. The script ends
//! once every event is delivered or dead-lettered, every outage is over, no retry waits and
//! no partition is held — or at the timeout — and stops the replicas.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::task::JoinHandle;

use super::bed::{Bed, Replica, HUB, QUEUE};
use super::report::{Progress, Tick};
use super::{DemoArgs, Outage, Window};
use crate::emulator::producer::{self, Outgoing, Plan, Produced};
use crate::emulator::Faults;
use crate::ledger::Ledger;
use crate::pipeline::health::Health;

/// How the script ended.
pub(super) struct Ending {
    /// The keys of the events produced, in the order sent.
    pub(super) keys: Vec<String>,
    /// Replica crashes.
    pub(super) crashes: usize,
    /// The health of every replica that ran, crashed or stopped.
    pub(super) replicas: Vec<Arc<Health>>,
}

/// The `n`-th event: key `demo-0000n`, a JSON body, every other one `order.created`, the
/// rest `campaign.fired`.
fn event(n: usize) -> Outgoing {
    let key = format!("demo-{n:05}");
    let kind = if n.is_multiple_of(2) {
        "order.created"
    } else {
        "campaign.fired"
    };
    Outgoing::keyed(&key, format!("{{\"id\":\"{key}\"}}"))
        .content_type("application/json")
        .property("ce_type", kind)
}

/// Outage windows of one kind, and which have started.
struct Outages {
    windows: Vec<Window>,
    started: Vec<bool>,
}

impl Outages {
    fn new(outages: &[Outage]) -> Self {
        let windows: Vec<Window> = outages.iter().filter_map(|o| o.0).collect();
        Self {
            started: vec![false; windows.len()],
            windows,
        }
    }

    /// The windows whose start time `t` has reached, not started before (now started).
    fn due(&mut self, t: Duration) -> Vec<Window> {
        let mut due = Vec::new();
        for (w, started) in self.windows.iter().zip(self.started.iter_mut()) {
            if !*started && t >= w.start {
                *started = true;
                due.push(*w);
            }
        }
        due
    }

    fn all_started(&self) -> bool {
        self.started.iter().all(|s| *s)
    }
}

/// One service's outages: when, whose faults, and what the progress line says.
struct ServiceOutages<'b> {
    windows: Outages,
    faults: &'b Arc<Faults>,
    what: &'static str,
    then: &'static str,
}

impl ServiceOutages<'_> {
    /// Starts the windows due at `t` (503 for each one's duration) and says so.
    fn start_due(&mut self, t: Duration, progress: &mut impl FnMut(&str)) {
        let (what, then) = (self.what, self.then);
        for w in self.windows.due(t) {
            self.faults.error_status_for(503, w.duration);
            progress(&format!(
                "t={:>3}s  {what} {:?}{then}",
                t.as_secs(),
                w.duration
            ));
        }
    }

    /// Whether every window has started and none is in force now.
    fn over(&self) -> bool {
        self.windows.all_started() && self.faults.error_status().is_none()
    }
}

/// Each service's outages: the downstream's, Service Bus's and blob storage's.
fn outages<'b>(bed: &'b Bed, args: &DemoArgs) -> [ServiceOutages<'b>; 3] {
    [
        ServiceOutages {
            windows: Outages::new(std::slice::from_ref(&args.downstream_outage)),
            faults: bed.hook.faults(),
            what: "downstream outage: the webhook answers 503 for",
            then: "",
        },
        ServiceOutages {
            windows: Outages::new(&args.servicebus_outage),
            faults: bed.sb.faults(),
            what: "Service Bus outage: 503 for",
            then: "; partitions with failures will hold",
        },
        ServiceOutages {
            windows: Outages::new(&args.blob_outage),
            faults: bed.blob.faults(),
            what: "blob storage outage: 503 for",
            then: "; checkpoints, ownership and the ledger fail",
        },
    ]
}

/// Starts the producer's task: the events spread over `--produce-over`.
fn start_producer(
    bed: &Bed,
    args: &DemoArgs,
) -> anyhow::Result<JoinHandle<anyhow::Result<Produced>>> {
    let cs = bed.eventhubs()?;
    let plan = Plan::spread(HUB, args.events, args.partitions, 10, args.produce_over)
        .send_timeout(Duration::from_secs(10));
    Ok(tokio::spawn(async move {
        producer::produce(&cs, &plan, event).await
    }))
}

/// Crashes replica `i` into `retired` (no final checkpoint, no ownership release), says so,
/// and starts it again in its place.
async fn crash_and_restart(
    bed: &Bed,
    replicas: &mut Vec<Replica>,
    i: usize,
    retired: &mut Vec<Arc<Health>>,
    t: Duration,
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<()> {
    let victim = replicas.remove(i);
    let owner = victim.owner.clone();
    retired.push(victim.crash().await);
    progress(&format!("t={:>3}s  crash: {owner} killed (no final checkpoint, no ownership release); restarting it", t.as_secs()));
    replicas.insert(i, bed.start_replica(&owner)?);
    Ok(())
}

/// What the services report at one tick.
struct Observed {
    /// The receiver's deliveries by key.
    delivered: BTreeMap<String, u32>,
    /// The keys the ledger records as dead-lettered.
    dead: BTreeSet<String>,
    /// The progress to draw.
    tick: Tick,
}

/// Reads the deliveries, the ledger's dead letters, the retry queue and the running
/// replicas' held partitions at `t`; `keys` are the events produced, once known.
async fn observe(
    bed: &Bed,
    ledger: &Ledger,
    replicas: &[Replica],
    keys: Option<&Vec<String>>,
    args: &DemoArgs,
    t: Duration,
) -> Observed {
    let delivered = bed.hook.deliveries();
    let dead: BTreeSet<String> = ledger
        .dead_letter_keys()
        .await
        .unwrap_or_default()
        .into_iter()
        .collect();
    let sb = bed.sb.counters(QUEUE).unwrap_or_default();
    let held: BTreeMap<String, _> = replicas
        .iter()
        .flat_map(|r| r.health().held().into_iter().map(|(p, h)| (p, h.cause)))
        .collect();
    let produced = keys.map_or(0, Vec::len);
    let tick = Tick {
        t,
        delivered: delivered.len(),
        events: if produced > 0 { produced } else { args.events },
        retrying: sb.scheduled + sb.active + sb.locked,
        dead_lettered: dead.len(),
        held,
    };
    Observed {
        delivered,
        dead,
        tick,
    }
}

/// Whether the script is done: every event in `keys` delivered or dead-lettered, every outage
/// over, no retry waiting and no partition held.
fn done(keys: &[String], seen: &Observed, outages: &[ServiceOutages<'_>]) -> bool {
    let settled = keys
        .iter()
        .all(|k| seen.delivered.contains_key(k) || seen.dead.contains(k));
    let outages_over = outages.iter().all(ServiceOutages::over);
    settled && outages_over && seen.tick.retrying == 0 && seen.tick.held.is_empty()
}

/// Plays the script on `bed`; `started` is when the demo started (the outages' and crashes'
/// times count from it).
pub(super) async fn play(
    bed: &Bed,
    args: &DemoArgs,
    started: Instant,
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<Ending> {
    let mut replicas: Vec<Replica> = (0..args.replicas)
        .map(|i| bed.start_replica(&format!("replica-{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut retired: Vec<Arc<Health>> = Vec::new();

    let mut producer = Some(start_producer(bed, args)?);
    let ledger = bed.ledger()?;
    let mut keys: Option<Vec<String>> = None;
    let mut outages = outages(bed, args);
    let mut next_crash = args.crash_every.0;
    let mut crashes = 0usize;
    let drawing = Progress::new(args);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t = started.elapsed();
        for service in &mut outages {
            service.start_due(t, progress);
        }
        if let Some(every) = next_crash.filter(|n| t >= *n) {
            let i = crashes % replicas.len();
            crash_and_restart(bed, &mut replicas, i, &mut retired, t, progress).await?;
            crashes += 1;
            next_crash = args.crash_every.0.map(|e| every + e);
        }
        if producer.as_ref().is_some_and(|p| p.is_finished()) {
            keys = Some(producer.take().context("producer")?.await??.keys);
        }
        let seen = observe(bed, &ledger, &replicas, keys.as_ref(), args, t).await;
        drawing.tick(&seen.tick, progress);
        if keys
            .as_ref()
            .is_some_and(|keys| done(keys, &seen, &outages))
        {
            break;
        }
        if t > args.timeout {
            break;
        }
    }
    drawing.finish();
    for r in replicas {
        retired.push(r.stop().await);
    }
    let Some(keys) = keys else {
        bail!("the producer did not finish");
    };
    Ok(Ending {
        keys,
        crashes,
        replicas: retired,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_start_once_at_their_time() {
        let w = |s, d| {
            Outage(Some(Window {
                start: Duration::from_secs(s),
                duration: Duration::from_secs(d),
            }))
        };
        let mut o = Outages::new(&[w(5, 2), Outage(None), w(3, 1)]);
        assert!(o.due(Duration::from_secs(2)).is_empty());
        assert_eq!(o.due(Duration::from_secs(4)), [o.windows[1]]);
        assert!(!o.all_started());
        assert_eq!(o.due(Duration::from_secs(9)), [o.windows[0]]);
        assert!(o.due(Duration::from_secs(10)).is_empty());
        assert!(o.all_started());
        assert!(Outages::new(&[Outage(None)]).all_started());
    }

    #[test]
    fn events_are_the_demos() {
        let e = event(12);
        assert_eq!(e.key.as_deref(), Some("demo-00012"));
        assert_eq!(e.body, br#"{"id":"demo-00012"}"#);
        assert_eq!(e.content_type.as_deref(), Some("application/json"));
        assert_eq!(e.properties, [("ce_type".into(), "order.created".into())]);
        assert_eq!(event(1).properties[0].1, "campaign.fired");
    }
}
