//! Operational events: CloudEvents about hubguard itself — the breaker opening and closing,
//! a partition held longer than a bound, retries exhausted (dead-lettered) per downstream,
//! the rate limit lowered — sent to a webhook (signed as deliveries are) or a Service Bus
//! queue or topic, for teams that automate (open a ticket, page the receiver's owners, stop
//! a rollout) rather than watch Prometheus.
//!
//! They never block or slow delivery: the watcher ([`watch`]) reads what the pipeline already
//! reports, off the event path, and hands each event to a bounded channel; when it is full the
//! event is dropped and counted. They are never lost silently: every event suppressed,
//! dropped or refused by its destination is counted (`hubguard.opsevents.*`) and logged, and a
//! failing destination leaves readiness alone (it is not the pipeline's dependency). Each
//! type and subject has a suppression window: the first occurrence is sent, later ones within
//! the window are counted into the next one sent (`data.suppressed`).

pub mod send;
pub mod watch;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use opentelemetry::KeyValue;
use serde_json::json;

use crate::clock::Clock;
use crate::sync::LockExt as _;
use crate::telemetry::names::{metric, metric_attr};

/// The operational event types (the CloudEvents `type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum OpsEventKind {
    /// A downstream's breaker opened (subject: the downstream).
    BreakerOpened,
    /// A downstream's breaker closed again (subject: the downstream).
    BreakerClosed,
    /// A partition has been held longer than the bound (subject: the partition).
    PartitionHeld,
    /// Events were dead-lettered (their retries exhausted or their error permanent)
    /// (subject: the downstream).
    RetriesExhausted,
    /// The deployment's rate to the downstream was lowered (subject: the downstream).
    RateLimitLowered,
    /// The dead-letter storm guard began holding a downstream's events.
    StormGuardHolding,
    /// The dead-letter storm guard released them.
    StormGuardReleased,
}

impl OpsEventKind {
    /// Every type, in documentation order.
    pub const ALL: [OpsEventKind; 7] = [
        OpsEventKind::BreakerOpened,
        OpsEventKind::BreakerClosed,
        OpsEventKind::PartitionHeld,
        OpsEventKind::RetriesExhausted,
        OpsEventKind::RateLimitLowered,
        OpsEventKind::StormGuardHolding,
        OpsEventKind::StormGuardReleased,
    ];

    /// The CloudEvents `type`.
    pub fn type_name(self) -> &'static str {
        match self {
            OpsEventKind::BreakerOpened => "com.hubguard.breaker.opened",
            OpsEventKind::BreakerClosed => "com.hubguard.breaker.closed",
            OpsEventKind::PartitionHeld => "com.hubguard.partition.held",
            OpsEventKind::RetriesExhausted => "com.hubguard.retries.exhausted",
            OpsEventKind::RateLimitLowered => "com.hubguard.ratelimit.lowered",
            OpsEventKind::StormGuardHolding => "com.hubguard.stormguard.holding",
            OpsEventKind::StormGuardReleased => "com.hubguard.stormguard.released",
        }
    }
}

/// One operational event, before it becomes a CloudEvent.
#[derive(Debug, Clone, PartialEq)]
pub struct OpsEvent {
    /// Its type.
    pub kind: OpsEventKind,
    /// What it is about: a downstream or a partition.
    pub subject: String,
    /// A stable id when every replica observes the same fact (a breaker opening at one
    /// time): receivers drop the repeats by `source` + `id`, as CloudEvents asks. `None`: a
    /// fresh UUID.
    pub id: Option<String>,
    /// When it happened.
    pub time: SystemTime,
    /// The type's data (see docs/telemetry.md for each schema).
    pub data: serde_json::Value,
}

impl OpsEvent {
    /// The CloudEvent in JSON (structured content mode, CloudEvents 1.0), from `source`
    /// (the deployment), with `suppressed` (occurrences suppressed since the last one sent)
    /// and `replica` added to the data.
    pub fn cloudevent(&self, source: &str, replica: &str, suppressed: u64) -> serde_json::Value {
        let mut data = self.data.clone();
        if let Some(o) = data.as_object_mut() {
            o.insert("suppressed".into(), json!(suppressed));
            o.insert("replica".into(), json!(replica));
        }
        json!({
            "specversion": "1.0",
            "id": self.id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            "source": source,
            "type": self.kind.type_name(),
            "subject": self.subject,
            "time": crate::clock::rfc3339(self.time),
            "datacontenttype": "application/json",
            "data": data,
        })
    }
}

/// Suppression windows by type and subject (pure: the caller gives the time).
#[derive(Debug, Default)]
pub struct Suppressor {
    window: Duration,
    last: HashMap<(OpsEventKind, String), (SystemTime, u64)>,
}

impl Suppressor {
    /// Windows of `window` for every type.
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            last: HashMap::new(),
        }
    }

    /// Whether an occurrence of `kind` about `subject` at `now` is sent: `Some(n)` with the
    /// occurrences suppressed since the last one sent, or `None` (suppressed, counted).
    pub fn admit(&mut self, kind: OpsEventKind, subject: &str, now: SystemTime) -> Option<u64> {
        let entry = self.last.entry((kind, subject.to_string()));
        match entry {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let (sent, suppressed) = *e.get();
                let within = now.duration_since(sent).map_or(true, |d| d < self.window);
                if within {
                    e.get_mut().1 += 1;
                    None
                } else {
                    e.insert((now, 0));
                    Some(suppressed)
                }
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert((now, 0));
                Some(0)
            }
        }
    }
}

/// What became of operational events, counted (also exported as `hubguard.opsevents.*`).
#[derive(Debug, Default)]
pub struct Counts {
    /// Handed to the sender (queued in the channel).
    pub queued: AtomicU64,
    /// Accepted by the destination.
    pub sent: AtomicU64,
    /// Suppressed by a window (counted into the next one sent).
    pub suppressed: AtomicU64,
    /// Dropped because the channel to the sender was full (the destination is slow).
    pub dropped: AtomicU64,
    /// Refused by the destination, or not answered in time.
    pub failed: AtomicU64,
}

/// A snapshot of [`Counts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpsEventsCounts {
    /// Handed to the sender.
    pub queued: u64,
    /// Accepted by the destination.
    pub sent: u64,
    /// Suppressed by a window.
    pub suppressed: u64,
    /// Dropped: the channel was full.
    pub dropped: u64,
    /// Refused by the destination or timed out.
    pub failed: u64,
}

/// The replica's operational events: suppression, the bounded channel and the counts. Built
/// with its destination ([`send::OpsEventsDestination`]); the pipeline starts its sender and watcher.
pub struct OpsEvents {
    suppressor: Mutex<Suppressor>,
    tx: tokio::sync::mpsc::Sender<(OpsEvent, u64)>,
    rx: Mutex<Option<tokio::sync::mpsc::Receiver<(OpsEvent, u64)>>>,
    destination: Arc<dyn send::OpsEventsDestination>,
    counts: Counts,
    clock: Arc<Clock>,
    /// How long a partition is held before [`OpsEventKind::PartitionHeld`] is sent.
    pub held_longer_than: Duration,
    /// How often the watcher looks.
    pub poll: Duration,
}

impl std::fmt::Debug for OpsEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpsEvents")
            .field("destination", &self.destination.describe())
            .field("held_longer_than", &self.held_longer_than)
            .finish_non_exhaustive()
    }
}

/// How operational events behave (`[operational_events]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpsEventsSettings {
    /// The suppression window of every type, per subject.
    pub suppression: Duration,
    /// A partition held longer than this is reported.
    pub held_longer_than: Duration,
    /// Events waiting for the destination at most; more are dropped (counted).
    pub queue_size: usize,
    /// How often the watcher reads the pipeline's state.
    pub poll: Duration,
}

impl Default for OpsEventsSettings {
    fn default() -> Self {
        Self {
            suppression: Duration::from_secs(300),
            held_longer_than: Duration::from_secs(300),
            queue_size: 256,
            poll: Duration::from_secs(1),
        }
    }
}

impl OpsEvents {
    /// Operational events to `destination`, on `clock` (the pipeline's).
    pub fn new(
        settings: OpsEventsSettings,
        destination: Arc<dyn send::OpsEventsDestination>,
        clock: Arc<Clock>,
    ) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(settings.queue_size.max(1));
        Self {
            suppressor: Mutex::new(Suppressor::new(settings.suppression)),
            tx,
            rx: Mutex::new(Some(rx)),
            destination,
            counts: Counts::default(),
            clock,
            held_longer_than: settings.held_longer_than,
            poll: settings.poll,
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> OpsEventsCounts {
        let c = &self.counts;
        OpsEventsCounts {
            queued: c.queued.load(Ordering::Relaxed),
            sent: c.sent.load(Ordering::Relaxed),
            suppressed: c.suppressed.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
        }
    }

    /// The clock events are timed on.
    pub fn now(&self) -> SystemTime {
        self.clock.now()
    }

    /// Whether an occurrence now would be sent (it is then counted as sent by the caller's
    /// [`emit`](Self::emit)); `false`: suppressed and counted. Callers that accumulate (dead
    /// letters) ask before building the event, so the count carries over.
    fn admit(&self, kind: OpsEventKind, subject: &str) -> Option<u64> {
        let admitted = self
            .suppressor
            .locked()
            .admit(kind, subject, self.clock.now());
        if admitted.is_none() {
            self.counts.suppressed.fetch_add(1, Ordering::Relaxed);
            record(metric::OPSEVENTS_SUPPRESSED, kind);
        }
        admitted
    }

    /// Emits `event` unless its window suppresses it; never waits: a full channel drops it
    /// (counted, logged). Returns whether it was queued.
    pub fn emit(&self, event: OpsEvent) -> bool {
        let Some(suppressed) = self.admit(event.kind, &event.subject) else {
            return false;
        };
        let kind = event.kind;
        match self.tx.try_send((event, suppressed)) {
            Ok(()) => {
                self.counts.queued.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
                record(metric::OPSEVENTS_DROPPED, kind);
                tracing::warn!(r#type = kind.type_name(), reason = %e, destination = %self.destination.describe(), "operational event dropped: the destination is not keeping up");
                false
            }
        }
    }

    /// Sends what is queued until `stop` fires (one at a time, each within the
    /// destination's deadline). Runs once: the receiver is taken.
    pub async fn run_sender(
        self: Arc<Self>,
        source: String,
        replica: String,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let Some(mut rx) = self.rx.locked().take() else {
            return;
        };
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => break,
                n = rx.recv() => n,
            };
            let Some((event, suppressed)) = next else {
                break;
            };
            let ce = event.cloudevent(&source, &replica, suppressed);
            match self.destination.send(&ce).await {
                Ok(()) => {
                    self.counts.sent.fetch_add(1, Ordering::Relaxed);
                    record(metric::OPSEVENTS_SENT, event.kind);
                }
                Err(e) => {
                    self.counts.failed.fetch_add(1, Ordering::Relaxed);
                    record(metric::OPSEVENTS_FAILED, event.kind);
                    tracing::warn!(r#type = event.kind.type_name(), id = ce["id"].as_str().unwrap_or_default(), destination = %self.destination.describe(), error = %crate::redact::redact(&e.0), "operational event not delivered");
                }
            }
        }
    }
}

fn record(name: &'static str, kind: OpsEventKind) {
    crate::telemetry::meter()
        .u64_counter(name)
        .build()
        .add(1, &[KeyValue::new(metric_attr::TYPE, kind.type_name())]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_per_window_per_subject_and_the_suppressed_are_counted_into_the_next() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let mut s = Suppressor::new(Duration::from_secs(60));
        assert_eq!(
            s.admit(OpsEventKind::RetriesExhausted, "orders", t0),
            Some(0)
        );
        assert_eq!(
            s.admit(
                OpsEventKind::RetriesExhausted,
                "orders",
                t0 + Duration::from_secs(10)
            ),
            None
        );
        assert_eq!(
            s.admit(
                OpsEventKind::RetriesExhausted,
                "orders",
                t0 + Duration::from_secs(59)
            ),
            None
        );
        // Another subject and another type have windows of their own.
        assert_eq!(
            s.admit(OpsEventKind::RetriesExhausted, "billing", t0),
            Some(0)
        );
        assert_eq!(s.admit(OpsEventKind::BreakerOpened, "orders", t0), Some(0));
        // The window is over: sent, with the two suppressed.
        assert_eq!(
            s.admit(
                OpsEventKind::RetriesExhausted,
                "orders",
                t0 + Duration::from_secs(60)
            ),
            Some(2)
        );
        assert_eq!(
            s.admit(
                OpsEventKind::RetriesExhausted,
                "orders",
                t0 + Duration::from_secs(61)
            ),
            None
        );
        // A clock stepped back counts as within the window.
        assert_eq!(
            s.admit(
                OpsEventKind::BreakerOpened,
                "orders",
                t0 - Duration::from_secs(5)
            ),
            None
        );
    }

    #[test]
    fn a_cloudevent_names_its_type_source_and_subject() {
        let e = OpsEvent {
            kind: OpsEventKind::BreakerOpened,
            subject: "orders".into(),
            id: Some("breaker.opened/orders/5".into()),
            time: SystemTime::UNIX_EPOCH,
            data: json!({ "downstream": "orders" }),
        };
        let ce = e.cloudevent("/hubguard/ns/hub/cg", "replica-1", 3);
        assert_eq!(ce["specversion"], "1.0");
        assert_eq!(ce["type"], "com.hubguard.breaker.opened");
        assert_eq!(ce["id"], "breaker.opened/orders/5");
        assert_eq!(ce["subject"], "orders");
        assert_eq!(ce["data"]["suppressed"], 3);
        assert_eq!(ce["data"]["replica"], "replica-1");
        let names: std::collections::BTreeSet<_> =
            OpsEventKind::ALL.iter().map(|k| k.type_name()).collect();
        assert_eq!(names.len(), OpsEventKind::ALL.len());
    }
}
