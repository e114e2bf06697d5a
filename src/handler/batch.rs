//! Batches: many events per call, one outcome per event.
//!
//! A [`BatchHandler`] takes several events in one call and answers an [`Outcome`] for each.
//! [`Batched`] makes one a [`Handler`]: the pipeline still attempts, settles, retries and
//! dead-letters every event on its own — its own attempt span, ledger record, attempt count,
//! pinned schedule and dead letter — and `Batched` only coalesces the calls that are in
//! flight at the same moment into one: up to `max_events` and `max_bytes` per call, after
//! waiting up to `wait` for a batch to fill (zero: only what is already in hand). The
//! checkpoint passes each event as it settles, so a batch with one failure holds nothing
//! back but that event, whose retry goes to Service Bus like any other.
//!
//! **A released line** of ordered retries (`retry_ordering = "key"`) is the one place a
//! batch carries several events of a key: once the line's head is delivered, the retry loop
//! hands the events parked behind it to [`Handler::handle_in_order`], which `Batched` sends
//! as calls of up to `max_events`, in sequence order, one after another, stopping after the
//! call that carried a failure. The pipeline counts everything after the first failure as
//! not attempted (see `pipeline::lines::drain`).
//!
//! What a batch never does:
//! - **carry two events of one ordering key out of a released line**: the partition runs a
//!   key's events one after another (the next starts when the one before settled), so a
//!   first delivery's batch holds at most one event per key, and with
//!   `retry_ordering = "key"` no event of a key is delivered after an earlier one failed —
//!   exactly as without batches;
//! - **carry an event on its last attempt** ([`Attempt::last`]): that one goes alone, so a
//!   poison event that takes a whole batch down (a receiver that fails the request for one
//!   bad item) cannot take its neighbours' last attempts with it;
//! - **assume success**: an outcome the batch handler does not give (fewer outcomes than
//!   events) is a transient failure, and so is a batch call abandoned half-way.
//!
//! The peers' designs this follows: AWS Lambda's partial batch response
//! (`batchItemFailures`,
//! <https://docs.aws.amazon.com/lambda/latest/dg/services-sqs-errorhandling.html>),
//! Cloudflare Queues' per-message `ack()`/`retry()`
//! (<https://developers.cloudflare.com/queues/configuration/batching-retries/>).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{oneshot, Notify};

use super::{Attempt, Failure, Handler, Outcome};
use crate::event::Event;
use crate::sync::LockExt;

/// One event of a batch and its attempt.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    /// The event.
    pub event: &'a Event,
    /// Its attempt (each event of a batch has its own number and `traceparent`).
    pub attempt: &'a Attempt,
}

/// Handles several events in one call. Called at least once per event, as [`Handler`] is.
#[async_trait]
pub trait BatchHandler: Send + Sync + 'static {
    /// Handles `items` in one call; one outcome per item, in their order. An item without an
    /// outcome (fewer outcomes than items) counts as a transient failure.
    async fn handle_batch(&self, items: &[Item<'_>]) -> Vec<Outcome>;

    /// The downstream this handler calls, for the circuit breaker (one breaker per name).
    fn downstream(&self) -> String {
        "handler".into()
    }

    /// As [`Handler::blocked`].
    fn blocked(&self) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        None
    }

    /// As [`Handler::allowed_rate`].
    fn allowed_rate(&self) -> Option<tokio::sync::watch::Receiver<Option<f64>>> {
        None
    }

    /// What `event` adds to a batch's size, for [`BatchLimits::max_bytes`] (default: its
    /// body's length).
    fn size_of(&self, event: &Event) -> usize {
        event.body.len()
    }
}

/// How big a batch may grow, and how long a call waits for one to fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Events per call (at least 1; 1 sends every event alone).
    pub max_events: usize,
    /// Bytes per call, as [`BatchHandler::size_of`] counts them (an event larger than this
    /// goes alone).
    pub max_bytes: usize,
    /// How long a call waits for a batch to fill; zero: only the calls already in hand.
    pub wait: Duration,
}

/// A [`BatchHandler`] as a [`Handler`]: the calls in flight at once go out together.
pub struct Batched<B> {
    inner: Arc<B>,
    limits: BatchLimits,
    queue: Mutex<Queue>,
    /// Woken when the queue holds a full batch.
    full: Notify,
}

#[derive(Default)]
struct Queue {
    next_id: u64,
    waiting: VecDeque<Waiting>,
}

struct Waiting {
    id: u64,
    event: Event,
    attempt: Attempt,
    bytes: usize,
    outcome: oneshot::Sender<Outcome>,
    /// Woken when this call comes to the front of the queue: its caller forms and sends the
    /// next batch.
    turn: Arc<Notify>,
}

impl Queue {
    /// Wakes the caller at the front: it forms the next batch (a permit is stored if it is
    /// not waiting yet, so the turn is never missed).
    fn wake_front(&self) {
        if let Some(front) = self.waiting.front() {
            front.turn.notify_one();
        }
    }
}

impl<B> std::fmt::Debug for Batched<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batched")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl<B: BatchHandler> Batched<B> {
    /// `inner`'s calls coalesced within `limits`.
    pub fn new(inner: B, limits: BatchLimits) -> Self {
        Self::shared(Arc::new(inner), limits)
    }

    /// As [`Self::new`], for a handler shared elsewhere.
    pub fn shared(inner: Arc<B>, limits: BatchLimits) -> Self {
        Self {
            inner,
            limits: BatchLimits {
                max_events: limits.max_events.max(1),
                ..limits
            },
            queue: Mutex::default(),
            full: Notify::new(),
        }
    }

    /// The batch handler.
    pub fn inner(&self) -> &Arc<B> {
        &self.inner
    }

    /// Calls the handler with `items` and sends each its outcome (a missing one: a transient
    /// failure).
    async fn run(&self, batch: Vec<Waiting>) {
        let items: Vec<Item<'_>> = batch
            .iter()
            .map(|w| Item {
                event: &w.event,
                attempt: &w.attempt,
            })
            .collect();
        let mut outcomes = self.call(&items).await.into_iter();
        for w in batch {
            let outcome = outcomes.next().unwrap_or_else(no_outcome);
            let _ = w.outcome.send(outcome);
        }
    }

    /// One call of the batch handler with `items`, in a span of its own linked to each
    /// event's attempt.
    async fn call(&self, items: &[Item<'_>]) -> Vec<Outcome> {
        let span = tracing::info_span!(
            target: "hubguard::attempt",
            parent: None,
            "batch",
            otel.name = crate::telemetry::names::span::BATCH,
            hubguard.batch.size = items.len(),
        );
        if !span.is_disabled() {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            for i in items {
                if let Some(sc) = crate::telemetry::parse_traceparent(&i.attempt.traceparent) {
                    span.add_link(sc);
                }
            }
        }
        tracing::Instrument::instrument(self.inner.handle_batch(items), span).await
    }

    /// How many of `items` (at least one) fit in one call.
    fn fitting(&self, items: &[Item<'_>]) -> usize {
        let mut bytes = 0usize;
        let mut n = 0;
        for i in items {
            let size = self.inner.size_of(i.event);
            if n >= self.limits.max_events || (n > 0 && bytes + size > self.limits.max_bytes) {
                break;
            }
            bytes += size;
            n += 1;
        }
        n.max(1)
    }

    /// The oldest waiting calls that fit in one batch (empty when none waits).
    fn take(&self) -> Vec<Waiting> {
        let mut q = self.queue.locked();
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        while let Some(next) = q.waiting.front() {
            let fits = batch.len() < self.limits.max_events
                && (batch.is_empty() || bytes + next.bytes <= self.limits.max_bytes);
            if !fits {
                break;
            }
            bytes += next.bytes;
            batch.extend(q.waiting.pop_front());
        }
        // The next batch forms while this one is in flight.
        if !batch.is_empty() {
            q.wake_front();
        }
        batch
    }

    /// Queues a call; its ticket takes it out again if the caller goes before it is sent.
    /// The first call of an empty queue has its turn at once.
    fn enqueue(&self, event: &Event, attempt: &Attempt) -> Queued<'_, B> {
        let (tx, rx) = oneshot::channel();
        let bytes = self.inner.size_of(event);
        let turn = Arc::new(Notify::new());
        let (id, full) = {
            let mut q = self.queue.locked();
            q.next_id += 1;
            let id = q.next_id;
            q.waiting.push_back(Waiting {
                id,
                event: event.clone(),
                attempt: attempt.clone(),
                bytes,
                outcome: tx,
                turn: turn.clone(),
            });
            if q.waiting.len() == 1 {
                q.wake_front();
            }
            (id, q.waiting.len() >= self.limits.max_events)
        };
        if full {
            self.full.notify_waiters();
        }
        Queued {
            _ticket: Ticket { batched: self, id },
            outcome: rx,
            turn,
        }
    }

    /// The caller at the front of the queue (the only one that forms a batch) waits for
    /// its batch to fill: `wait`, or less once a full batch is waiting; with no
    /// wait, lets the calls already in hand join first — yielding while the queue grows (a
    /// partition starts its events one per turn of its loop, from what Event Hubs already
    /// sent), never past a turn in which nothing joined.
    async fn fill(&self) {
        if self.limits.wait.is_zero() {
            let waiting = || self.queue.locked().waiting.len();
            for _ in 0..=self.limits.max_events {
                let before = waiting();
                if before >= self.limits.max_events {
                    return;
                }
                tokio::task::yield_now().await;
                if waiting() == before {
                    return;
                }
            }
            return;
        }
        let full = self.full.notified();
        tokio::pin!(full);
        full.as_mut().enable();
        if self.queue.locked().waiting.len() >= self.limits.max_events {
            return;
        }
        tokio::select! {
            _ = full => {}
            _ = tokio::time::sleep(self.limits.wait) => {}
        }
    }
}

/// The outcome of an event the batch handler gave none for: a transient failure.
fn no_outcome() -> Outcome {
    Outcome::Failed(Failure::transient(
        "the batch handler gave no outcome for this event",
    ))
}

/// A queued call: taken out of the queue if its caller goes before the call is sent.
struct Ticket<'a, B> {
    batched: &'a Batched<B>,
    id: u64,
}

impl<B> Drop for Ticket<'_, B> {
    fn drop(&mut self) {
        let mut q = self.batched.queue.locked();
        let was_front = q.waiting.front().is_some_and(|w| w.id == self.id);
        q.waiting.retain(|w| w.id != self.id);
        // A caller that leaves at the front hands its turn on.
        if was_front {
            q.wake_front();
        }
    }
}

/// A call in the queue: its ticket, its outcome, and its turn at the front.
struct Queued<'a, B> {
    _ticket: Ticket<'a, B>,
    outcome: oneshot::Receiver<Outcome>,
    turn: Arc<Notify>,
}

#[async_trait]
impl<B: BatchHandler> Handler for Batched<B> {
    async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
        if self.limits.max_events == 1 || attempt.last {
            let alone = [Item { event, attempt }];
            return self
                .inner
                .handle_batch(&alone)
                .await
                .into_iter()
                .next()
                .unwrap_or_else(no_outcome);
        }
        let Queued {
            _ticket,
            mut outcome,
            turn,
        } = self.enqueue(event, attempt);
        let abandoned = || {
            Outcome::Failed(Failure::transient(
                "the batch call carrying this event was abandoned before it answered",
            ))
        };
        // Only the caller at the front of the queue forms a batch: the others wait for their
        // outcome, or for their turn at the front (handed on when the batch before theirs
        // is taken, or when the caller at the front leaves), so no call waits on a caller
        // that left, and a batch forming costs one caller's turns, not every waiting one's.
        tokio::select! {
            biased;
            o = &mut outcome => return o.unwrap_or_else(|_| abandoned()),
            _ = turn.notified() => {}
        }
        self.fill().await;
        loop {
            if let Ok(o) = outcome.try_recv() {
                return o;
            }
            let batch = self.take();
            if batch.is_empty() {
                return outcome.await.unwrap_or_else(|_| abandoned());
            }
            self.run(batch).await;
        }
    }

    fn in_order_max(&self) -> usize {
        self.limits.max_events
    }

    /// Calls within the limits, one after another in the items' order, until a call
    /// carried a failure (or an item without an outcome: a transient failure); the items
    /// after it get no outcome (not attempted).
    async fn handle_in_order(&self, items: &[Item<'_>]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(items.len());
        let mut rest = items;
        while !rest.is_empty() {
            let n = self.fitting(rest);
            let (now, later) = rest.split_at(n);
            let mut answered = self.call(now).await.into_iter();
            let mut failed = false;
            for _ in now {
                let o = answered.next().unwrap_or_else(no_outcome);
                failed |= o != Outcome::Delivered;
                outcomes.push(o);
            }
            if failed {
                break;
            }
            rest = later;
        }
        outcomes
    }

    fn downstream(&self) -> String {
        self.inner.downstream()
    }

    fn blocked(&self) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        self.inner.blocked()
    }

    fn allowed_rate(&self) -> Option<tokio::sync::watch::Receiver<Option<f64>>> {
        self.inner.allowed_rate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Identity;

    /// Records each call's keys; fails the keys named in `fail`.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<Vec<String>>>,
        fail: Vec<String>,
        short: bool,
    }

    #[async_trait]
    impl BatchHandler for Recorder {
        async fn handle_batch(&self, items: &[Item<'_>]) -> Vec<Outcome> {
            let keys: Vec<String> = items
                .iter()
                .map(|i| i.event.identity.idempotency_key.clone())
                .collect();
            self.calls.locked().push(keys.clone());
            tokio::task::yield_now().await;
            let mut out: Vec<Outcome> = keys
                .iter()
                .map(|k| {
                    if self.fail.contains(k) {
                        Outcome::Failed(Failure::permanent("refused"))
                    } else {
                        Outcome::Delivered
                    }
                })
                .collect();
            if self.short {
                out.pop();
            }
            out
        }
    }

    fn event(key: &str, bytes: usize) -> Event {
        Event {
            body: vec![b'x'; bytes],
            content_type: None,
            properties: Default::default(),
            hub: "h".into(),
            partition_id: "0".into(),
            sequence_number: 0,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: Identity {
                idempotency_key: key.into(),
                correlation_id: key.into(),
                event_type: None,
            },
        }
    }

    fn attempt(last: bool) -> Attempt {
        Attempt {
            number: 1,
            traceparent: String::new(),
            last,
        }
    }

    async fn all(b: &Arc<Batched<Recorder>>, keys: &[(&str, usize, bool)]) -> Vec<Outcome> {
        let calls = keys.iter().map(|(k, bytes, last)| {
            let b = b.clone();
            let e = event(k, *bytes);
            let a = attempt(*last);
            async move { b.handle(&e, &a).await }
        });
        futures::future::join_all(calls).await
    }

    fn limits(max_events: usize, max_bytes: usize, wait_ms: u64) -> BatchLimits {
        BatchLimits {
            max_events,
            max_bytes,
            wait: Duration::from_millis(wait_ms),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn calls_in_flight_together_go_out_in_batches_within_the_bounds() {
        let b = Arc::new(Batched::new(Recorder::default(), limits(3, 1000, 0)));
        let keys: Vec<(String, usize, bool)> =
            (0..7).map(|i| (format!("k{i}"), 10, false)).collect();
        let refs: Vec<(&str, usize, bool)> =
            keys.iter().map(|(k, n, l)| (k.as_str(), *n, *l)).collect();
        let out = all(&b, &refs).await;
        assert!(out.iter().all(|o| *o == Outcome::Delivered));
        let calls = b.inner().calls.locked().clone();
        assert_eq!(
            calls.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![3, 3, 1]
        );
        let sent: Vec<String> = calls.concat();
        assert_eq!(sent.len(), 7, "each event sent once: {calls:?}");
        // The byte bound: 3 × 400 does not fit in 1000.
        let b = Arc::new(Batched::new(Recorder::default(), limits(3, 1000, 0)));
        all(
            &b,
            &[("a", 400, false), ("b", 400, false), ("c", 400, false)],
        )
        .await;
        let sizes: Vec<usize> = b.inner().calls.locked().iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![2, 1]);
        // An event larger than the bound goes alone.
        let b = Arc::new(Batched::new(Recorder::default(), limits(3, 100, 0)));
        all(&b, &[("big", 400, false), ("small", 10, false)]).await;
        let sizes: Vec<usize> = b.inner().calls.locked().iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![1, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_leaving_at_the_front_hands_its_turn_on() {
        // A long wait to fill: the first caller is at the front, waiting for its batch,
        // when it leaves; the two behind it must not wait for it.
        let b = Arc::new(Batched::new(Recorder::default(), limits(10, 1000, 60_000)));
        let call = |key: &'static str| {
            let b = b.clone();
            tokio::spawn(async move { b.handle(&event(key, 1), &attempt(false)).await })
        };
        let front = call("front");
        tokio::task::yield_now().await;
        let behind = [call("b1"), call("b2")];
        tokio::task::yield_now().await;
        front.abort();
        let out =
            tokio::time::timeout(Duration::from_secs(3600), futures::future::join_all(behind))
                .await
                .expect("the calls behind a caller that left were never sent");
        assert!(out.into_iter().all(|o| o.unwrap() == Outcome::Delivered));
        // Sent together once the new front's wait ended, and the one that left never.
        assert_eq!(b.inner().calls.locked().clone(), vec![vec!["b1", "b2"]]);
    }

    #[tokio::test(start_paused = true)]
    async fn each_event_gets_its_own_outcome_and_a_missing_one_is_a_failure() {
        let rec = Recorder {
            fail: vec!["bad".into()],
            ..Default::default()
        };
        let b = Arc::new(Batched::new(rec, limits(10, 1000, 0)));
        let out = all(&b, &[("a", 1, false), ("bad", 1, false), ("c", 1, false)]).await;
        assert_eq!(out[0], Outcome::Delivered);
        assert!(matches!(&out[1], Outcome::Failed(f) if f.error == "refused"));
        assert_eq!(out[2], Outcome::Delivered);
        // A handler that answers for fewer events than it was given: never success.
        let rec = Recorder {
            short: true,
            ..Default::default()
        };
        let b = Arc::new(Batched::new(rec, limits(10, 1000, 0)));
        let out = all(&b, &[("a", 1, false), ("b", 1, false)]).await;
        assert_eq!(out[0], Outcome::Delivered);
        assert!(
            matches!(&out[1], Outcome::Failed(f) if f.class == crate::policy::classify::ErrorClass::Transient)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_on_its_last_attempt_goes_alone() {
        let b = Arc::new(Batched::new(Recorder::default(), limits(10, 1000, 0)));
        all(&b, &[("a", 1, false), ("poison", 1, true), ("c", 1, false)]).await;
        let calls = b.inner().calls.locked().clone();
        assert!(calls.contains(&vec!["poison".to_string()]), "{calls:?}");
        assert!(
            calls
                .iter()
                .all(|c| c.len() == 1 || !c.contains(&"poison".to_string())),
            "{calls:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_waits_to_fill_but_not_past_the_wait_and_not_once_full() {
        let b = Arc::new(Batched::new(Recorder::default(), limits(2, 1000, 500)));
        let started = tokio::time::Instant::now();
        all(&b, &[("a", 1, false), ("b", 1, false)]).await;
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "full: sent at once"
        );
        let started = tokio::time::Instant::now();
        all(&b, &[("c", 1, false)]).await;
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(500),
            "waited to fill"
        );
        let sizes: Vec<usize> = b.inner().calls.locked().iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![2, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn in_order_calls_go_one_after_another_and_stop_after_the_one_with_a_failure() {
        let rec = Recorder {
            fail: vec!["e4".into()],
            ..Default::default()
        };
        let b = Batched::new(rec, limits(3, 1000, 0));
        assert_eq!(b.in_order_max(), 3);
        let events: Vec<Event> = (0..9).map(|i| event(&format!("e{i}"), 1)).collect();
        let a = attempt(false);
        let items: Vec<Item<'_>> = events
            .iter()
            .map(|e| Item {
                event: e,
                attempt: &a,
            })
            .collect();
        let out = b.handle_in_order(&items).await;
        let calls = b.inner().calls.locked().clone();
        assert_eq!(
            calls,
            vec![vec!["e0", "e1", "e2"], vec!["e3", "e4", "e5"]],
            "in order, and nothing after the call that carried the failure"
        );
        assert_eq!(out.len(), 6);
        assert!(out[..4].iter().all(|o| *o == Outcome::Delivered));
        assert!(matches!(&out[4], Outcome::Failed(_)));
        // A plain handler's default: one at a time, stopping at the first failure.
        struct Plain;
        #[async_trait]
        impl Handler for Plain {
            async fn handle(&self, event: &Event, _: &Attempt) -> Outcome {
                if event.identity.idempotency_key == "e1" {
                    Outcome::Failed(Failure::transient("no"))
                } else {
                    Outcome::Delivered
                }
            }
        }
        assert_eq!(Plain.in_order_max(), 1);
        let out = Plain.handle_in_order(&items[..3]).await;
        assert_eq!(out.len(), 2, "stopped after e1");
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_that_leaves_takes_its_event_out_of_the_queue() {
        let b = Arc::new(Batched::new(Recorder::default(), limits(10, 1000, 1000)));
        let e = event("gone", 1);
        let a = attempt(false);
        let call = b.handle(&e, &a);
        let _ = tokio::time::timeout(Duration::from_millis(10), call).await;
        assert!(
            b.queue.locked().waiting.is_empty(),
            "taken out when its caller left"
        );
        all(&b, &[("stays", 1, false)]).await;
        assert_eq!(b.inner().calls.locked().concat(), vec!["stays".to_string()]);
    }
}
