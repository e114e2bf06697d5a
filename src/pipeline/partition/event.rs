//! One event of a partition: ordered retries' line steps, the breaker's admission, the
//! attempt, and the settlement that holds the partition while it fails.

use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::event::Event;
use crate::pipeline::admission::Gate;
use crate::pipeline::backoff::{until_settled, Hold};
use crate::pipeline::settle::{Report, Source};
use crate::pipeline::{attempt, Shared};

use super::lag;

/// What one event's task works with: its partition, how to stop, the lag a hold reports, and
/// what the partition knows of the ledger's records and lines.
#[derive(Clone, Copy)]
struct EventTask<'a> {
    pid: &'a str,
    shared: &'a Shared,
    cancel: &'a CancellationToken,
    lag: (u64, Option<SystemTime>),
    recorded: &'a crate::pipeline::recorded::Recorded,
    known: &'a crate::pipeline::lines::Known,
}

/// Where an ordered-retries step leaves an event.
enum LineStep {
    /// Stopped before the event settled.
    Stopped,
    /// The event is settled without (another) delivery: parked behind its line's head, or a
    /// replay of an event its line already settled.
    Settled,
    /// Go on with the event; `heads`: it is its key's line's head.
    Continue { heads: bool },
}

/// Attempts and settles one event; `false` if stopped before it settled.
pub(super) async fn process(
    event: Event,
    pid: &str,
    shared: &Shared,
    cancel: &CancellationToken,
    lag: (u64, Option<SystemTime>),
    recorded: &crate::pipeline::recorded::Recorded,
    known: &crate::pipeline::lines::Known,
) -> bool {
    let task = EventTask {
        pid,
        shared,
        cancel,
        lag,
        recorded,
        known,
    };
    // Ordered retries: an event whose key has a line is parked behind its head instead of
    // delivered (see `pipeline::lines`). `heads`: this event is its key's line's head (a
    // replay of it, or a failure that just opened the line), so it settles through the ledger
    // and moves the line on once it settles for good.
    let line_key = shared
        .options
        .retry_ordering
        .lines()
        .and(shared.options.ordering.of(&event));
    let mut heads = false;
    if let Some(k) = line_key {
        match task.before_attempt(&event, k).await {
            LineStep::Stopped => return false,
            LineStep::Settled => return true,
            LineStep::Continue { heads: h } => heads = h,
        }
    }
    shared.observe.count_attempt();
    let policy = shared
        .settler
        .policies()
        .for_type(event.identity.event_type.as_deref());
    let mut cx = attempt::Context {
        consumer_group: &shared.origin.consumer_group,
        source: Source::EventHubs,
        policy: &policy.name,
        max_attempts: policy.max_attempts,
        clock: shared.clock(),
        rate_limit_wait: None,
    };
    let event_type = event.identity.event_type.as_deref();
    let Some(gate) = task.admit(event.sequence_number, event_type).await else {
        return false;
    };
    // The rate limit: the event waits here, in its partition (Event Hubs keeps the backlog
    // behind it), uncounted; the checkpoint window cannot pass it meanwhile.
    match shared.pace(cancel, true).await {
        None => return false,
        Some(acquired) => {
            if shared.downstream.limiter.is_some() {
                cx.rate_limit_wait = Some(match acquired {
                    crate::ratelimit::limiter::Acquired::Go(w) => w,
                    crate::ratelimit::limiter::Acquired::NoShare => Duration::ZERO,
                });
            }
        }
    }
    let attempted = attempt::run(&shared.downstream.handler, &event, 1, &[], cx).await;
    shared.attempted(&attempted, gate, event_type).await;
    // Ordered retries: a failure opens its key's line before it is settled, so the line
    // exists before any retry message of it can run (and end the line).
    if let (Some(k), crate::handler::Outcome::Failed(_)) = (line_key, &attempted.outcome) {
        if !heads {
            match task.open_line(&event, k, &attempted).await {
                LineStep::Stopped => return false,
                LineStep::Settled => return true,
                LineStep::Continue { heads: h } => heads = h,
            }
        }
    }
    task.settle(&event, line_key.filter(|_| heads), &attempted)
        .await
}

impl EventTask<'_> {
    /// Ordered retries, before an attempt of `event` whose key `k` may have a line: parked
    /// behind the line's head, recognised as a replay of an event the line already settled,
    /// or delivered (as the line's head, or not).
    async fn before_attempt(&self, event: &Event, k: &str) -> LineStep {
        use crate::pipeline::lines::KeyState;
        let seq = event.sequence_number;
        let Some(state) = self.key_state(seq, k).await else {
            return LineStep::Stopped;
        };
        let mut heads = false;
        // Whether the event may be a replay of one a line already settled.
        let verify = match state {
            KeyState::Unknown | KeyState::Free => false,
            KeyState::Ended(x) => seq <= x,
            KeyState::Line(h) if seq > h => {
                let (pid, shared, cancel, lag) = (self.pid, self.shared, self.cancel, self.lag);
                match park_or_deliver(event, k, pid, shared, cancel, lag, self.known).await {
                    None => return LineStep::Stopped,
                    Some(Err(_parked)) => return LineStep::Settled,
                    Some(Ok((h, verify))) => {
                        heads = h;
                        verify
                    }
                }
            }
            KeyState::Line(h) => {
                heads = h == seq;
                true
            }
        };
        // The key has (or had) a line, and this event is its head, before it, or read before
        // it ended: it may be a replay of an event the line already settled (released and
        // delivered, or dead-lettered with its head). Such an event is not delivered again,
        // which could bring it after later events of its key.
        if verify {
            match self.settled_replay(event, k, heads).await {
                None => return LineStep::Stopped,
                Some(true) => return LineStep::Settled,
                Some(false) => {}
            }
        }
        LineStep::Continue { heads }
    }

    /// What the partition knows of key `k`'s line, read from the ledger when it does not
    /// know; `None` if stopped first.
    async fn key_state(&self, seq: i64, k: &str) -> Option<crate::pipeline::lines::KeyState> {
        use crate::pipeline::lines::KeyState;
        let (pid, shared) = (self.pid, self.shared);
        match self.known.state(k) {
            KeyState::Unknown => {
                let read = until_done(pid, seq, shared, self.cancel, self.lag, || async {
                    Ok::<_, crate::pipeline::settle::SettleError>(
                        shared.settler.ledger.line(pid, k).await?.map(|(l, _)| {
                            if l.ended {
                                KeyState::Ended(l.last_seq())
                            } else {
                                KeyState::Line(l.head_seq)
                            }
                        }),
                    )
                })
                .await;
                read.map(|s| s.unwrap_or(KeyState::Free))
            }
            s => Some(s),
        }
    }

    /// Whether `event` is a replay of an event its line already settled for good (then it is
    /// settled as such, and its line moved on if it `heads` it); `None` if stopped first.
    async fn settled_replay(&self, event: &Event, k: &str, heads: bool) -> Option<bool> {
        let (pid, shared, cancel, lag) = (self.pid, self.shared, self.cancel, self.lag);
        let seq = event.sequence_number;
        let final_record = until_done(pid, seq, shared, cancel, lag, || async {
            Ok::<_, crate::pipeline::settle::SettleError>(
                shared
                    .settler
                    .ledger
                    .record(&event.identity.idempotency_key)
                    .await?
                    .filter(|r| {
                        r.state() != crate::ledger::State::RetryScheduled
                            && r.event.partition_id == event.partition_id
                            && r.event.sequence_number == seq
                    }),
            )
        })
        .await?;
        let Some(rec) = final_record else {
            return Some(false);
        };
        if heads {
            match advance_line(event, k, pid, shared, cancel, lag).await {
                None => return None,
                Some(true) => self.known.ended(k, Some(seq)),
                Some(false) => {}
            }
        }
        tracing::debug!(partition = %pid, sequence_number = seq, key = %event.identity.idempotency_key, state = ?rec.state(), "a replay of an event its line already settled: not delivered again");
        let s = crate::pipeline::settle::Settled::AlreadyFinal(rec.state());
        shared
            .observe
            .count_settled(&s, event.identity.event_type.as_deref());
        shared.health.release_event(pid, seq);
        Some(true)
    }

    /// The breaker's admission of event `seq`. Outage mode: while the downstream's breaker
    /// is open the partition waits — Event Hubs holds the backlog — instead of scheduling one
    /// retry per event. No attempt is counted. `None` if stopped first.
    async fn admit(&self, seq: i64, event_type: Option<&str>) -> Option<Gate> {
        let (pid, shared, cancel) = (self.pid, self.shared, self.cancel);
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
                        shared.observe.count_deferred(event_type);
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

    /// Ordered retries: opens the line of `event`'s key `k` after its first attempt failed;
    /// an event that finds a line it did not know of belongs behind it, whatever its attempt
    /// said.
    async fn open_line(&self, event: &Event, k: &str, attempted: &attempt::Attempted) -> LineStep {
        let (pid, shared, cancel, lag) = (self.pid, self.shared, self.cancel, self.lag);
        let seq = event.sequence_number;
        loop {
            let opened = until_done(pid, seq, shared, cancel, lag, || async {
                Ok::<_, crate::pipeline::settle::SettleError>(
                    crate::pipeline::lines::open(&shared.settler, event, k, &attempted.traceparent)
                        .await?,
                )
            })
            .await;
            match opened {
                None => return LineStep::Stopped,
                Some(crate::pipeline::lines::Open::Head) => {
                    return LineStep::Continue { heads: true }
                }
                Some(crate::pipeline::lines::Open::Older) => {
                    return LineStep::Continue { heads: false }
                }
                // A line this partition did not know of (a previous owner's, during a
                // rebalance): the event belongs behind it, whatever this attempt said.
                Some(crate::pipeline::lines::Open::Behind) => {
                    match park_or_deliver(event, k, pid, shared, cancel, lag, self.known).await {
                        None => return LineStep::Stopped,
                        Some(Err(parked)) => {
                            attempt::finish(attempted, Ok(&parked));
                            return LineStep::Settled;
                        }
                        Some(Ok((true, _))) => return LineStep::Continue { heads: true },
                        // The line ended meanwhile: open it again with this event.
                        Some(Ok((false, _))) => {}
                    }
                }
            }
        }
    }

    /// Settles `event`'s first attempt; `head_of`: the key of the line it heads (it settles
    /// through the ledger and moves the line on once settled for good). `false` if stopped
    /// before it settled.
    async fn settle(
        &self,
        event: &Event,
        head_of: Option<&str>,
        attempted: &attempt::Attempted,
    ) -> bool {
        let (pid, shared, cancel, lag) = (self.pid, self.shared, self.cancel, self.lag);
        let seq = event.sequence_number;
        // The happy path: a delivery of an event the ledger provably has no record of is
        // settled as it is (see `pipeline::recorded` for why that is safe).
        if attempted.outcome == crate::handler::Outcome::Delivered
            && head_of.is_none()
            && !self.recorded.may_have_record(event)
        {
            let s = crate::pipeline::settle::Settled::Delivered;
            attempt::finish(attempted, Ok(&s));
            shared
                .observe
                .count_settled(&s, event.identity.event_type.as_deref());
            shared.health.release_event(pid, seq);
            return true;
        }
        let report = Report {
            event,
            attempt: 1,
            source: Source::EventHubs,
            started: attempted.started,
            outcome: &attempted.outcome,
            trace_id: &attempted.trace_id,
            traceparents: std::slice::from_ref(&attempted.traceparent),
        };
        let mut hold = PartitionHold {
            pid,
            seq,
            shared,
            cancel,
            lag,
            held: false,
        };
        let settled = until_settled(&mut hold, shared.options.settle_backoff_max, || {
            shared
                .settler
                .settle(&report)
                .instrument(attempted.span.clone())
        })
        .await;
        let s = match settled {
            Ok(s) => s,
            Err(e) => {
                attempt::finish(attempted, Err(&e));
                return false;
            }
        };
        self.recorded.forget(event);
        if let Some(k) = head_of {
            if matches!(s, crate::pipeline::settle::Settled::RetryScheduled { .. }) {
                self.known.line(k, seq);
            } else {
                // Settled for good: the line moves on (a stop before it leaves the event
                // unsettled, and its replay moves the line on).
                match advance_line(event, k, pid, shared, cancel, lag).await {
                    None => {
                        attempt::finish(attempted, Ok(&s));
                        return false;
                    }
                    Some(true) => self.known.ended(k, Some(seq)),
                    Some(false) => self.known.line(k, seq),
                }
            }
        }
        attempt::finish(attempted, Ok(&s));
        shared
            .observe
            .count_settled(&s, event.identity.event_type.as_deref());
        shared.health.release_event(pid, seq);
        true
    }
}

/// Moves the line of `key` on after its head `event` settled for good, holding the
/// partition at the event while a step fails: `Some(true)` when the line ended, `None` if
/// stopped first.
async fn advance_line(
    event: &Event,
    key: &str,
    pid: &str,
    shared: &Shared,
    cancel: &CancellationToken,
    lag: (u64, Option<SystemTime>),
) -> Option<bool> {
    let on_dead_letter = shared.options.retry_ordering.lines().unwrap_or_default();
    until_done(pid, event.sequence_number, shared, cancel, lag, || {
        crate::pipeline::lines::advance(
            &shared.settler,
            event,
            key,
            on_dead_letter,
            Some(&shared.observe),
        )
    })
    .await
}

/// Parks `event` behind its key's line: `Some(Err(parked))` when it is parked (settled:
/// counted, its hold released), `Some(Ok((heads, verify)))` when it is to be delivered (the
/// line ended, or the event is at or before its head — `heads` when it is the head; `verify`
/// when it may be a replay of an event the line settled), `None` if stopped first.
async fn park_or_deliver(
    event: &Event,
    key: &str,
    pid: &str,
    shared: &Shared,
    cancel: &CancellationToken,
    lag: (u64, Option<SystemTime>),
    known: &crate::pipeline::lines::Known,
) -> Option<Result<(bool, bool), crate::pipeline::settle::Settled>> {
    let seq = event.sequence_number;
    let parked = until_done(pid, seq, shared, cancel, lag, || async {
        Ok::<_, crate::pipeline::settle::SettleError>(
            crate::pipeline::lines::park(&shared.settler, event, key, None).await?,
        )
    })
    .await?;
    match parked {
        crate::pipeline::lines::Park::Parked {
            behind,
            behind_seq,
            behind_traceparent,
        } => {
            known.line(key, behind_seq);
            // A span of its own, found by the same trace query as its attempts (the
            // conversation id), saying what it waits behind and linked to the head's failing
            // attempt when the line knows it.
            let span = tracing::info_span!(
                target: "hubguard::attempt",
                "park",
                otel.name = crate::telemetry::names::span::PARK,
                otel.kind = "consumer",
                messaging.message.id = %event.identity.idempotency_key,
                messaging.message.conversation_id = %event.identity.correlation_id,
                messaging.destination.partition.id = %pid,
                messaging.eventhubs.message.sequence_number = seq,
                hubguard.outcome = crate::telemetry::names::outcome::PARKED,
                hubguard.parked_behind = %behind,
                hubguard.parked_behind.sequence_number = behind_seq,
            );
            if !span.is_disabled() {
                if let Some(sc) = behind_traceparent
                    .as_deref()
                    .and_then(crate::telemetry::parse_traceparent)
                {
                    use tracing_opentelemetry::OpenTelemetrySpanExt;
                    span.add_link(sc);
                }
            }
            span.in_scope(|| {});
            tracing::debug!(partition = %pid, sequence_number = seq, key = %event.identity.idempotency_key, behind = %behind, behind_seq, "parked behind the head of its ordering key's line");
            let s = crate::pipeline::settle::Settled::Parked { behind, behind_seq };
            shared
                .observe
                .count_settled(&s, event.identity.event_type.as_deref());
            shared.health.release_event(pid, seq);
            Some(Err(s))
        }
        crate::pipeline::lines::Park::Deliver {
            head: None,
            ended_at,
        } => {
            known.ended(key, ended_at);
            Some(Ok((false, ended_at.is_none_or(|x| seq <= x))))
        }
        crate::pipeline::lines::Park::Deliver { head: Some(h), .. } => {
            known.line(key, h);
            Some(Ok((h == seq, true)))
        }
    }
}

/// Runs `op` until it succeeds, holding the partition at `seq` on each failure (as a
/// settlement does: nothing behind the event moves the checkpoint) with backoff; `None` if
/// stopped first.
async fn until_done<T, F, Fut>(
    pid: &str,
    seq: i64,
    shared: &Shared,
    cancel: &CancellationToken,
    lag: (u64, Option<SystemTime>),
    op: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, crate::pipeline::settle::SettleError>>,
{
    let mut hold = PartitionHold {
        pid,
        seq,
        shared,
        cancel,
        lag,
        held: false,
    };
    let done = until_settled(&mut hold, shared.options.settle_backoff_max, op).await;
    if done.is_ok() && hold.held {
        shared.health.release_event(pid, seq);
    }
    done.ok()
}

/// A partition holding its event at `seq` while a settlement (or a step of one) fails:
/// readiness and the lag show the hold, and the wait ends early when the partition stops.
struct PartitionHold<'a> {
    pid: &'a str,
    seq: i64,
    shared: &'a Shared,
    cancel: &'a CancellationToken,
    lag: (u64, Option<SystemTime>),
    /// Whether a failure held the partition.
    held: bool,
}

impl Hold<crate::pipeline::settle::SettleError> for PartitionHold<'_> {
    fn failed(&mut self, e: &crate::pipeline::settle::SettleError) {
        let (pid, shared) = (self.pid, self.shared);
        shared.observe.settle_failed(e);
        shared
            .health
            .set_lag(pid, lag(shared, self.lag.0, self.lag.1));
        shared
            .health
            .hold_event(pid, self.seq, e.hold_cause(), e.held_reason());
        self.held = true;
    }

    async fn pause(&mut self, wait: Duration) -> bool {
        tokio::select! {
            _ = self.cancel.cancelled() => false,
            _ = self.shared.clock().sleep(wait) => true,
        }
    }
}

/// Whether an outcome is a transient failure: what the breaker counts. A permanent failure
/// means the downstream answered: it is up.
pub(crate) fn transient_failure(o: &crate::handler::Outcome) -> bool {
    matches!(o, crate::handler::Outcome::Failed(f) if f.class == crate::policy::classify::ErrorClass::Transient)
}
