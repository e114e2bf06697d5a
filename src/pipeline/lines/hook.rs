//! Ordered retries as a hook around an attempt: the one interface the partition's event path
//! and the retry path call, so neither is woven through with line steps.
//!
//! - **Before a first delivery** ([`LineHook::before_attempt`]): deliver the event, in its
//!   [`Place`] in its key's line; or it is settled already ([`LineStep::Settled`]) — parked
//!   behind its line's head, or a replay of an event its line already settled.
//! - **After a first attempt** ([`LineHook::after_attempt`]): a failure opens its key's line
//!   before it is settled (or finds a line it did not know of, and parks behind it).
//! - **After a settlement** ([`LineHook::after_settled`]): a head settled for good moves its
//!   line on. The retry path calls this one alone: a retry is never parked (lines park first
//!   deliveries only), and it may head its key's line ([`LineHook::retry_place`]).
//!
//! With `retry_ordering = "off"` the hook is [`LineHook::Off`] and every step is a no-op. How
//! a step is held while the ledger or Service Bus fails is the caller's ([`UntilDone`]): the
//! partition holds its event, the retry loop its message.

use std::future::Future;
use std::pin::Pin;

use crate::event::Event;
use crate::pipeline::attempt::Attempted;
use crate::pipeline::settle::{SettleError, Settled};
use crate::pipeline::{LineOnDeadLetter, Shared};

use super::{KeyState, Known, Open, Park};

/// One try of a line step: a boxed future, so the steps' futures stay `Send` for the retry
/// path's spawned tasks (the compiler cannot prove it through a generic closure's opaque
/// future there).
pub(crate) type StepFuture<'f, T> =
    Pin<Box<dyn Future<Output = Result<T, SettleError>> + Send + 'f>>;

/// How the caller of a line step holds its work while the step fails: the partition holds
/// its event (nothing behind it moves the checkpoint), the retry loop its message (its lock
/// renewed). Both back off between tries.
pub(crate) trait UntilDone {
    /// Runs `op` (doing `what`, for the caller's telemetry) until it succeeds; `None` if the
    /// caller stopped first.
    fn until_done<'f, T: Send>(
        &'f mut self,
        what: &'static str,
        op: &'f mut (dyn FnMut() -> StepFuture<'f, T> + Send + 'f),
    ) -> impl Future<Output = Option<T>> + Send;
}

/// `fut` as one try of a line step.
fn step_future<'f, T>(
    fut: impl Future<Output = Result<T, SettleError>> + Send + 'f,
) -> StepFuture<'f, T> {
    Box::pin(fut)
}

/// An event's place in its ordering key's line, as its attempt and settlement need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place<'k> {
    /// No line to mind: ordering is off, or the event has no ordering key.
    Unordered,
    /// Its key (this one) has no line it heads: a failure of its first attempt opens one.
    Keyed(&'k str),
    /// It heads its key's (this one's) line: it settles through the ledger, and moves the
    /// line on once settled for good. (A retry may head it: the advance checks.)
    Head(&'k str),
}

impl Place<'_> {
    /// Whether the event heads its key's line.
    pub(crate) fn heads(&self) -> bool {
        matches!(self, Place::Head(_))
    }
}

/// Where a line step leaves an event.
#[derive(Debug)]
pub(crate) enum LineStep<'k> {
    /// Go on with the event (attempt it, or settle its attempt), in this place of its line.
    Go(Place<'k>),
    /// The event is settled without (another) delivery: parked behind its line's head, or a
    /// replay of an event its line already settled. The caller counts it and lets it go.
    Settled(Settled),
    /// Stopped before the event settled.
    Stopped,
}

/// Whether the line step after a settlement got done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Advanced {
    /// Done (or nothing to do).
    Done,
    /// Stopped first: the event's line is moved on by whoever settles it next (a replay, a
    /// copy of the retry message, the sweep).
    Stopped,
}

/// Ordered retries as the event path and the retry path see them (see the module's doc).
pub(crate) enum LineHook<'a> {
    /// `retry_ordering = "off"`: every step is a no-op.
    Off,
    /// `retry_ordering = "key"`: a key's events wait behind its line's head.
    Key(KeyLines<'a>),
}

/// Ordered retries on: what the steps work with.
pub(crate) struct KeyLines<'a> {
    shared: &'a Shared,
    /// What a line does when its head is dead-lettered.
    on_dead_letter: LineOnDeadLetter,
    /// What the partition knows of its keys' lines (`None` on the retry path: it knows
    /// nothing, and reads the line where it needs to).
    known: Option<&'a Known>,
}

impl<'a> LineHook<'a> {
    /// The hook for a partition's first deliveries; `known`: what it knows of its keys'
    /// lines.
    pub(crate) fn for_partition(shared: &'a Shared, known: &'a Known) -> Self {
        Self::new(shared, Some(known))
    }

    /// The hook for the retry path.
    pub(crate) fn for_retries(shared: &'a Shared) -> Self {
        Self::new(shared, None)
    }

    fn new(shared: &'a Shared, known: Option<&'a Known>) -> Self {
        match shared.options.retry_ordering.lines() {
            None => Self::Off,
            Some(on_dead_letter) => Self::Key(KeyLines {
                shared,
                on_dead_letter,
                known,
            }),
        }
    }

    /// Before the first attempt of `event`: an event whose key has a line is parked behind
    /// its head instead of delivered; one its line already settled (a replay) is settled as
    /// such; any other is delivered, heading its key's line or not.
    pub(crate) async fn before_attempt<'e>(
        &self,
        event: &'e Event,
        hold: &mut impl UntilDone,
    ) -> LineStep<'e> {
        let Self::Key(lines) = self else {
            return LineStep::Go(Place::Unordered);
        };
        match lines.key_of(event) {
            None => LineStep::Go(Place::Unordered),
            // Boxed: only a keyed event under ordered retries takes this path, and the
            // hook's future is part of every event's (see `partition::event::process`).
            Some(k) => Box::pin(lines.before_attempt(event, k, hold)).await,
        }
    }

    /// After the first attempt of `event` (in `place`): a failure opens its key's line before
    /// it is settled, so the line exists before any retry message of it can run (and end
    /// the line). An event that finds a line it did not know of belongs behind it, whatever
    /// its attempt said: it is parked.
    pub(crate) async fn after_attempt<'e>(
        &self,
        event: &'e Event,
        place: Place<'e>,
        attempted: &Attempted,
        hold: &mut impl UntilDone,
    ) -> LineStep<'e> {
        match (self, place, &attempted.outcome) {
            (Self::Key(lines), Place::Keyed(k), crate::handler::Outcome::Failed(_)) => {
                Box::pin(lines.open_line(event, k, &attempted.traceparent, hold)).await
            }
            _ => LineStep::Go(place),
        }
    }

    /// The place of a retry of `event` in its key's line: it may head it (lines park first
    /// deliveries only; a retry is its line's head, or has none).
    pub(crate) fn retry_place<'e>(&self, event: &'e Event) -> Place<'e> {
        match self {
            Self::Key(lines) => lines.key_of(event).map_or(Place::Unordered, Place::Head),
            Self::Off => Place::Unordered,
        }
    }

    /// After `event` (in `place`) settled as `settled`: a head settled for good moves its line
    /// on (the next parked event released, or the line ended); one waiting for a retry keeps
    /// it.
    pub(crate) async fn after_settled(
        &self,
        event: &Event,
        place: Place<'_>,
        settled: &Settled,
        hold: &mut impl UntilDone,
    ) -> Advanced {
        let (Self::Key(lines), Place::Head(k)) = (self, place) else {
            return Advanced::Done;
        };
        let seq = event.sequence_number;
        match settled {
            Settled::RetryScheduled { .. } => lines.known_line(k, seq),
            // Not an answer of a settlement: a parked event heads no line.
            Settled::Parked { .. } => {}
            Settled::Delivered | Settled::DeadLettered(_) | Settled::AlreadyFinal(_) => {
                let delivered = matches!(
                    settled,
                    Settled::Delivered | Settled::AlreadyFinal(crate::ledger::State::Delivered)
                );
                match Box::pin(lines.advance(event, k, delivered, hold)).await {
                    None => return Advanced::Stopped,
                    Some(true) => lines.known_ended(k, Some(seq)),
                    Some(false) => lines.known_line(k, seq),
                }
            }
        }
        Advanced::Done
    }
}

/// Where parking left an event.
enum Parking {
    /// Parked behind its line's head: settled.
    Parked(Settled),
    /// To be delivered: the line ended, or the event is at or before its head.
    Deliver(Delivery),
}

/// An event of a key that has (or had) a line, to be delivered.
#[derive(Debug, Clone, Copy)]
struct Delivery {
    /// It heads its key's line.
    heads: bool,
    /// It may be a replay of an event the line already settled: its record decides first.
    check_replay: bool,
}

impl KeyLines<'_> {
    /// The ordering key of `event`, if it has one.
    fn key_of<'e>(&self, event: &'e Event) -> Option<&'e str> {
        self.shared.options.ordering.of(event)
    }

    /// What is known of `key`'s line (nothing on the retry path).
    fn known_state(&self, key: &str) -> KeyState {
        self.known.map_or(KeyState::Unknown, |k| k.state(key))
    }

    /// `key` has a line headed by `seq` (or later).
    fn known_line(&self, key: &str, seq: i64) {
        if let Some(k) = self.known {
            k.line(key, seq);
        }
    }

    /// `key`'s line ended, having settled the events up to `last`.
    fn known_ended(&self, key: &str, last: Option<i64>) {
        if let Some(k) = self.known {
            k.ended(key, last);
        }
    }

    /// Before an attempt of `event` whose key `k` may have a line: parked behind the line's
    /// head, recognised as a replay of an event the line already settled, or delivered (as
    /// the line's head, or not).
    async fn before_attempt<'e>(
        &self,
        event: &'e Event,
        k: &'e str,
        hold: &mut impl UntilDone,
    ) -> LineStep<'e> {
        let seq = event.sequence_number;
        let Some(state) = self.key_state(event, k, hold).await else {
            return LineStep::Stopped;
        };
        let delivery = match state {
            KeyState::Unknown | KeyState::Free => Delivery {
                heads: false,
                check_replay: false,
            },
            KeyState::Ended(x) => Delivery {
                heads: false,
                check_replay: seq <= x,
            },
            KeyState::Line(h) if seq > h => match self.park_or_deliver(event, k, hold).await {
                None => return LineStep::Stopped,
                Some(Parking::Parked(s)) => return LineStep::Settled(s),
                Some(Parking::Deliver(d)) => d,
            },
            KeyState::Line(h) => Delivery {
                heads: h == seq,
                check_replay: true,
            },
        };
        let place = if delivery.heads {
            Place::Head(k)
        } else {
            Place::Keyed(k)
        };
        // The key has (or had) a line, and this event is its head, before it, or read before
        // it ended: it may be a replay of an event the line already settled (released and
        // delivered, or dead-lettered with its head). Such an event is not delivered again,
        // which could bring it after later events of its key.
        if delivery.check_replay {
            return self.settled_replay(event, place, hold).await;
        }
        LineStep::Go(place)
    }

    /// What the partition knows of key `k`'s line, read from the ledger when it does not
    /// know; `None` if stopped first.
    async fn key_state(
        &self,
        event: &Event,
        k: &str,
        hold: &mut impl UntilDone,
    ) -> Option<KeyState> {
        let (shared, pid) = (self.shared, event.partition_id.as_str());
        match self.known_state(k) {
            KeyState::Unknown => {
                let mut op = || {
                    step_future(async {
                        Ok(shared.settler.ledger.line(pid, k).await?.map(|l| {
                            if l.value.ended {
                                KeyState::Ended(l.value.last_seq())
                            } else {
                                KeyState::Line(l.value.head_seq)
                            }
                        }))
                    })
                };
                let read = hold
                    .until_done("reading the line of the event's ordering key", &mut op)
                    .await;
                read.map(|s| s.unwrap_or(KeyState::Free))
            }
            s => Some(s),
        }
    }

    /// Whether `event` (in `place`) is a replay of an event its line already settled for
    /// good: then it is settled as such (its line moved on first if it heads it); else it
    /// goes on.
    async fn settled_replay<'e>(
        &self,
        event: &Event,
        place: Place<'e>,
        hold: &mut impl UntilDone,
    ) -> LineStep<'e> {
        let shared = self.shared;
        let seq = event.sequence_number;
        let mut op = || {
            step_future(async {
                Ok(shared
                    .settler
                    .ledger
                    .record(&event.identity.idempotency_key)
                    .await?
                    .filter(|r| {
                        r.state() != crate::ledger::State::RetryScheduled
                            && r.event.partition_id == event.partition_id
                            && r.event.sequence_number == seq
                    }))
            })
        };
        let final_record = hold
            .until_done("reading the event's ledger record", &mut op)
            .await;
        let rec = match final_record {
            None => return LineStep::Stopped,
            Some(None) => return LineStep::Go(place),
            Some(Some(rec)) => rec,
        };
        if let Place::Head(k) = place {
            match self.advance(event, k, false, hold).await {
                None => return LineStep::Stopped,
                Some(true) => self.known_ended(k, Some(seq)),
                Some(false) => {}
            }
        }
        tracing::debug!(partition = %event.partition_id, sequence_number = seq, key = %event.identity.idempotency_key, state = ?rec.state(), "a replay of an event its line already settled: not delivered again");
        LineStep::Settled(Settled::AlreadyFinal(rec.state()))
    }

    /// Opens the line of `event`'s key `k` after its first attempt (`traceparent`) failed;
    /// an event that finds a line it did not know of belongs behind it, whatever its attempt
    /// said.
    async fn open_line<'e>(
        &self,
        event: &Event,
        k: &'e str,
        traceparent: &str,
        hold: &mut impl UntilDone,
    ) -> LineStep<'e> {
        let settler = &self.shared.settler;
        loop {
            let mut op =
                || step_future(async { Ok(super::open(settler, event, k, traceparent).await?) });
            let opened = hold
                .until_done("opening the line of the event's ordering key", &mut op)
                .await;
            match opened {
                None => return LineStep::Stopped,
                Some(Open::Head) => return LineStep::Go(Place::Head(k)),
                Some(Open::Older) => return LineStep::Go(Place::Keyed(k)),
                // A line this partition did not know of (a previous owner's, during a
                // rebalance): the event belongs behind it, whatever this attempt said.
                Some(Open::Behind) => match self.park_or_deliver(event, k, hold).await {
                    None => return LineStep::Stopped,
                    Some(Parking::Parked(s)) => return LineStep::Settled(s),
                    Some(Parking::Deliver(Delivery { heads: true, .. })) => {
                        return LineStep::Go(Place::Head(k))
                    }
                    // The line ended meanwhile: open it again with this event.
                    Some(Parking::Deliver(Delivery { heads: false, .. })) => {}
                },
            }
        }
    }

    /// Moves the line of `key` on after its head `event` settled for good (`delivered`, or
    /// dead-lettered): `Some(true)` when the line ended, `None` if stopped first. On the
    /// retry path, after a delivered head, a handler that takes ordered batches drains the
    /// line in them first ([`super::drain`]); the rest goes one by one.
    async fn advance(
        &self,
        event: &Event,
        key: &str,
        delivered: bool,
        hold: &mut impl UntilDone,
    ) -> Option<bool> {
        let drain = (delivered && self.known.is_none())
            .then(|| super::drain::Drain::new(self.shared, key))
            .flatten();
        let mut from = None;
        if let Some(drain) = drain {
            let mut head = event.clone();
            loop {
                let step = {
                    let mut op = || step_future(drain.step(&head));
                    hold.until_done(
                        "draining the line of the event's ordering key in batches",
                        &mut op,
                    )
                    .await?
                };
                match step {
                    super::drain::Drained::Moved(next) => head = *next,
                    super::drain::Drained::Waits => return Some(false),
                    super::drain::Drained::OneByOne(next) => {
                        from = Some(*next);
                        break;
                    }
                }
            }
        }
        let event = from.as_ref().unwrap_or(event);
        let (settler, observe) = (&*self.shared.settler, &self.shared.observe);
        let on_dead_letter = self.on_dead_letter;
        let mut op = || {
            step_future(super::advance(
                settler,
                event,
                key,
                on_dead_letter,
                Some(observe),
            ))
        };
        hold.until_done("advancing the line of the event's ordering key", &mut op)
            .await
    }

    /// Parks `event` behind its key's line (`None` if stopped first).
    async fn park_or_deliver(
        &self,
        event: &Event,
        key: &str,
        hold: &mut impl UntilDone,
    ) -> Option<Parking> {
        let settler = &self.shared.settler;
        let seq = event.sequence_number;
        let mut op = || step_future(async { Ok(super::park(settler, event, key, None).await?) });
        let parked = hold
            .until_done("parking the event behind its line's head", &mut op)
            .await?;
        Some(match parked {
            Park::Parked {
                behind,
                behind_seq,
                behind_traceparent,
            } => {
                self.known_line(key, behind_seq);
                park_span(event, &behind, behind_seq, behind_traceparent.as_deref());
                tracing::debug!(partition = %event.partition_id, sequence_number = seq, key = %event.identity.idempotency_key, behind = %behind, behind_seq, "parked behind the head of its ordering key's line");
                Parking::Parked(Settled::Parked { behind, behind_seq })
            }
            Park::Deliver {
                head: None,
                ended_at,
            } => {
                self.known_ended(key, ended_at);
                Parking::Deliver(Delivery {
                    heads: false,
                    check_replay: ended_at.is_none_or(|x| seq <= x),
                })
            }
            Park::Deliver { head: Some(h), .. } => {
                self.known_line(key, h);
                Parking::Deliver(Delivery {
                    heads: h == seq,
                    check_replay: true,
                })
            }
        })
    }
}

/// A parked event's span of its own, found by the same trace query as its attempts (the
/// conversation id), saying what it waits behind and linked to the head's failing attempt
/// (`behind_traceparent`) when the line knows it.
fn park_span(event: &Event, behind: &str, behind_seq: i64, behind_traceparent: Option<&str>) {
    let span = tracing::info_span!(
        target: "hubguard::attempt",
        "park",
        otel.name = crate::telemetry::names::span::PARK,
        otel.kind = "consumer",
        messaging.message.id = %event.identity.idempotency_key,
        messaging.message.conversation_id = %event.identity.correlation_id,
        messaging.destination.partition.id = %event.partition_id,
        messaging.eventhubs.message.sequence_number = event.sequence_number,
        hubguard.outcome = crate::telemetry::names::outcome::PARKED,
        hubguard.parked_behind = %behind,
        hubguard.parked_behind.sequence_number = behind_seq,
    );
    if !span.is_disabled() {
        if let Some(sc) = behind_traceparent.and_then(crate::telemetry::parse_traceparent) {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            span.add_link(sc);
        }
    }
    span.in_scope(|| {});
}
