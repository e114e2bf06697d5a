//! One event of a partition: admit → pace → attempt → settle, with the settlement holding the
//! partition while it fails. Ordered retries wrap the attempt through one hook
//! ([`LineHook`]): before it (deliver, or settled already: parked, or a replay), after it (a
//! failure opens its key's line) and after the settlement (the line moves on); the line steps
//! live in `pipeline::lines`.

use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::event::Event;
use crate::pipeline::admission::Gate;
use crate::pipeline::backoff::{until_settled, Hold};
use crate::pipeline::lines::{Advanced, Known, LineHook, LineStep, Place, StepFuture, UntilDone};
use crate::pipeline::recorded::Recorded;
use crate::pipeline::settle::{Report, SettleError, Settled, Source};
use crate::pipeline::{attempt, Shared};

use super::lag;

mod guarded;

/// The partition's lag when an event started, which a hold of it reports.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lag {
    /// Events received and not yet covered by a checkpoint.
    pub(super) uncovered: u64,
    /// When the oldest of them was enqueued.
    pub(super) oldest: Option<SystemTime>,
}

impl Lag {
    /// The partition's lag as `cp` has it now.
    pub(super) fn of(cp: &super::Checkpointer) -> Self {
        Self {
            uncovered: cp.uncovered,
            oldest: cp.oldest_uncovered,
        }
    }
}

/// What one event's task works with: its partition, how to stop, the lag a hold reports,
/// what the partition knows of the ledger's records and lines, and the fence.
#[derive(Clone, Copy)]
pub(super) struct EventTask<'a> {
    pub(super) pid: &'a str,
    pub(super) shared: &'a Shared,
    pub(super) cancel: &'a CancellationToken,
    pub(super) lag: Lag,
    pub(super) recorded: &'a Recorded,
    pub(super) known: &'a Known,
    pub(super) fence: &'a crate::pipeline::checkpoint::FencedCheckpointStore,
    /// Told the event's sequence number when its handler call ended.
    pub(super) answered: &'a tokio::sync::mpsc::UnboundedSender<i64>,
}

/// Attempts and settles one event; `false` if stopped before it settled.
pub(super) async fn process(event: Event, task: EventTask<'_>) -> bool {
    let lines = LineHook::for_partition(task.shared, task.known);
    let hold = &mut task.hold(event.sequence_number);
    let place = match lines.before_attempt(&event, hold).await {
        LineStep::Go(place) => place,
        LineStep::Settled(s) => return task.settled(&event, &s),
        LineStep::Stopped => return false,
    };
    task.shared.observe.count_attempt();
    let Some(attempted) = task.attempt_guarded(&event).await else {
        return false;
    };
    let _ = task.answered.send(event.sequence_number);
    let place = match lines.after_attempt(&event, place, &attempted, hold).await {
        LineStep::Go(place) => place,
        LineStep::Settled(s) => {
            task.settled(&event, &s);
            attempt::finish(&attempted, Ok(&s));
            return true;
        }
        LineStep::Stopped => return false,
    };
    task.settle(&event, place, &attempted, &lines).await
}

/// What the rate limit made an event wait, if a limit is configured.
#[derive(Debug, Clone, Copy)]
struct Paced {
    rate_limit_wait: Option<Duration>,
}

impl EventTask<'_> {
    /// Holds the partition at event `seq` while a step of it fails.
    fn hold(&self, seq: i64) -> EventHold<'_> {
        EventHold { task: self, seq }
    }

    /// The breaker's admission of `event`. Outage mode: while the downstream's breaker is
    /// open the partition waits — Event Hubs holds the backlog — instead of scheduling one
    /// retry per event. No attempt is counted. `None` if stopped first.
    async fn admit(&self, event: &Event) -> Option<Gate> {
        let (pid, shared, cancel) = (self.pid, self.shared, self.cancel);
        let seq = event.sequence_number;
        let mut deferred = false;
        let gate = loop {
            let admitted = tokio::select! {
                _ = cancel.cancelled() => return None,
                g = shared.admit_new() => g,
            };
            match admitted {
                Gate::Defer(until) => {
                    if !deferred {
                        deferred = true;
                        shared
                            .observe
                            .count_deferred(event.identity.event_type.as_deref());
                    }
                    shared.health.hold_event(
                        pid,
                        seq,
                        crate::pipeline::health::HoldCause::BreakerOpen,
                        format!(
                            "downstream breaker open: until {}",
                            crate::clock::rfc3339(until)
                        ),
                    );
                    tokio::select! {
                        _ = cancel.cancelled() => return None,
                        _ = shared.clock().sleep_until(until) => {}
                    }
                }
                run => break run,
            }
        };
        if deferred {
            shared.health.release_event(pid, seq);
        }
        Some(gate)
    }

    /// The rate limit: the event waits here, in its partition (Event Hubs keeps the backlog
    /// behind it), uncounted; the checkpoint window cannot pass it meanwhile. Then the
    /// ownership, proven current on the monotonic clock. `None` if stopped or lost first.
    async fn pace(&self) -> Option<Paced> {
        let acquired = self.shared.pace(self.cancel, true).await?;
        if !self.fence.confirmed(self.pid, self.cancel).await {
            return None;
        }
        let rate_limit_wait = self
            .shared
            .downstream
            .limiter
            .as_ref()
            .map(|_| match acquired {
                crate::ratelimit::limiter::Acquired::Go(w) => w,
                crate::ratelimit::limiter::Acquired::NoShare => Duration::ZERO,
            });
        Some(Paced { rate_limit_wait })
    }

    /// The first attempt of `event`, under the policy in force for its type.
    async fn attempt(&self, event: &Event, paced: Paced) -> attempt::Attempted {
        let shared = self.shared;
        let policy = shared
            .settler
            .policies()
            .for_type(event.identity.event_type.as_deref());
        let cx = attempt::Context {
            consumer_group: &shared.origin.consumer_group,
            source: Source::EventHubs,
            policy: &policy.name,
            max_attempts: policy.max_attempts,
            clock: shared.clock(),
            rate_limit_wait: paced.rate_limit_wait,
        };
        attempt::run(&shared.downstream.handler, event, 1, &[], cx).await
    }

    /// Settles `event`'s first attempt, in its `place` in its key's line (a head settles
    /// through the ledger and, settled for good, moves its line on: `lines`). `false` if
    /// stopped before it settled.
    async fn settle(
        &self,
        event: &Event,
        place: Place<'_>,
        attempted: &attempt::Attempted,
        lines: &LineHook<'_>,
    ) -> bool {
        // The happy path: a delivery the ledger provably has no record of is settled as it
        // is (`pipeline::recorded` says why). The rest is rare: boxed, not in every future.
        if attempted.outcome == crate::handler::Outcome::Delivered
            && !place.heads()
            && !self.recorded.may_have_record(event)
        {
            let s = Settled::Delivered;
            attempt::finish(attempted, Ok(&s));
            return self.settled(event, &s);
        }
        let mut hold = PartitionHold {
            task: self,
            seq: event.sequence_number,
            held: false,
        };
        let max = self.shared.options.settle_backoff_max;
        let may_have_record = self.recorded.may_have_record(event);
        let report = Report {
            event,
            attempt: 1,
            source: Source::EventHubs,
            started: attempted.started,
            outcome: &attempted.outcome,
            trace_id: &attempted.trace_id,
            traceparents: std::slice::from_ref(&attempted.traceparent),
        };
        let settled = Box::pin(until_settled(&mut hold, max, || {
            self.shared
                .settler
                .settle_first(&report, may_have_record)
                .instrument(attempted.span.clone())
        }))
        .await;
        let s = match settled {
            Ok(s) => s,
            Err(e) => {
                attempt::finish(attempted, Err(&e));
                return false;
            }
        };
        self.recorded.forget(event);
        // Settled for good, a head moves its line on (a stop before it leaves the event
        // unsettled, and its replay moves the line on).
        let advanced = lines
            .after_settled(event, place, &s, &mut self.hold(event.sequence_number))
            .await;
        attempt::finish(attempted, Ok(&s));
        if advanced == Advanced::Stopped {
            return false;
        }
        self.settled(event, &s)
    }

    /// `event` settled as `s`: counted, its hold released. `true`.
    fn settled(&self, event: &Event, s: &Settled) -> bool {
        self.shared
            .observe
            .count_settled(s, event.identity.event_type.as_deref());
        self.shared
            .health
            .release_event(self.pid, event.sequence_number);
        true
    }
}

/// The partition holding its event at `seq` while a step of it (a line's) fails.
struct EventHold<'a> {
    task: &'a EventTask<'a>,
    seq: i64,
}

impl UntilDone for EventHold<'_> {
    /// Runs `op` until it succeeds, holding the partition at `seq` on each failure (as a
    /// settlement does: nothing behind the event moves the checkpoint) with backoff; `None`
    /// if stopped first.
    async fn until_done<'f, T: Send>(
        &'f mut self,
        _what: &'static str,
        op: &'f mut (dyn FnMut() -> StepFuture<'f, T> + Send + 'f),
    ) -> Option<T> {
        let (task, seq) = (self.task, self.seq);
        let mut hold = PartitionHold {
            task,
            seq,
            held: false,
        };
        let done = until_settled(&mut hold, task.shared.options.settle_backoff_max, op).await;
        if done.is_ok() && hold.held {
            task.shared.health.release_event(task.pid, seq);
        }
        done.ok()
    }
}

/// A partition holding its event at `seq` while a settlement (or a step of one) fails:
/// readiness and the lag show the hold, and the wait ends early when the partition stops.
struct PartitionHold<'a> {
    task: &'a EventTask<'a>,
    seq: i64,
    /// Whether a failure held the partition.
    held: bool,
}

impl Hold<SettleError> for PartitionHold<'_> {
    fn failed(&mut self, e: &SettleError) {
        let EventTask {
            pid,
            shared,
            lag: l,
            ..
        } = *self.task;
        shared.observe.settle_failed(e);
        shared
            .health
            .set_lag(pid, lag(shared, l.uncovered, l.oldest));
        shared
            .health
            .hold_event(pid, self.seq, e.hold_cause(), e.held_reason());
        self.held = true;
    }

    async fn pause(&mut self, wait: Duration) -> bool {
        tokio::select! {
            _ = self.task.cancel.cancelled() => false,
            _ = self.task.shared.clock().sleep(wait) => true,
        }
    }
}

/// Whether an outcome is a transient failure: what the breaker counts. A permanent failure
/// means the downstream answered: it is up.
pub(crate) fn transient_failure(o: &crate::handler::Outcome) -> bool {
    matches!(o, crate::handler::Outcome::Failed(f) if f.class == crate::policy::classify::ErrorClass::Transient)
}
