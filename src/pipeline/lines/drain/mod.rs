//! A released line drained in ordered batches, when the handler takes them
//! ([`Handler::in_order_max`](crate::handler::Handler::in_order_max) above 1: the webhook with
//! `handler.batch_max` above 1, a [`Batched`](crate::handler::Batched) handler).
//!
//! One by one ([`super::advance`]), each parked event is released through a retry message
//! of its own, and the next waits for it to be received, attempted and settled: a few
//! events per second per line. Drained, the retry loop that settled the line's head hands
//! the events parked behind it to the handler itself, in sequence order, up to
//! `in_order_max` per call ([`Handler::handle_in_order`](crate::handler::Handler::handle_in_order)):
//!
//! 1. **The lease.** The line's pointer takes a drain lease (compare-and-swap): while it is
//!    live nobody else moves the line on (another copy of the head's message, the sweep);
//!    each batch's write of the pointer renews it. A drainer that dies leaves it to lapse,
//!    then the sweep moves the line on as for any head settled while nobody advanced it.
//! 2. **The call.** Each event gets its own attempt (its span, linked to the attempt it
//!    waited behind; its number after the attempts it made before it was parked). The batch
//!    never carries an event on its last attempt with another (a poison event goes
//!    alone), nor an event an operator paused (it goes one by one, and its retry is
//!    deferred as any paused retry); the breaker, the storm guard and the rate limit are
//!    asked as for a retry (the rate limit once per event).
//! 3. **The outcomes.** The events before the first one that did not succeed are delivered:
//!    each gets its ledger record, delivered (one write each, as a released event's
//!    delivery on a retry writes). The first failure is settled on its own record, as a
//!    released event's first attempt failing (its retry scheduled on Service Bus, or its
//!    dead letter), and heads the line. Everything after it counts as not attempted,
//!    whatever the receiver answered: it stays parked and goes again after the failed one.
//! 4. **The pointer** then names the last delivered event (or the failed one) as its head,
//!    and the delivered events' parked records go.
//! 5. **Pipelined** ([`pipelined`]): once the drain has moved the line on once, a batch the
//!    handler answered with every event delivered is settled (its records, its parked
//!    records' removal, the pointer's move) while the next batch is in the handler, under a
//!    lease with half of it left and the next batch admitted as any. The next call starts
//!    only after the one before answered all delivered, so the receiver still gets a key's
//!    events in sequence order, one request after the other; the next batch is settled after
//!    the one before, on the pointer that one wrote. Writes that fail, or find the line moved
//!    on, leave the next batch's events delivered but unrecorded: still parked, their
//!    attempts ended as `settle_failed`, sent again after.
//!
//! A crash anywhere leaves the pointer naming a settled head and the events after it still
//! parked: the next drain (after the lease lapses) delivers them again — duplicates in
//! sequence order, never an event before an earlier one of its key. Pipelined, that covers
//! the batch in the handler while the one before was being written: a receiver may have
//! applied it, and it comes again after the one before (a re-run of a suffix of the line).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use futures::future::join_all;

use crate::azure::versioned::{Change, Start};
use crate::clock::ms;
use crate::event::Event;
use crate::handler::batch::Item;
use crate::handler::{Failure, Outcome};
use crate::ledger::{DrainLease, LedgerRecord, Line, Parked, ParkedEntry, State, Versioned};
use crate::pipeline::admission::Gate;
use crate::pipeline::attempt::{self, Attempted, Started};
use crate::pipeline::settle::plan::{plan, Plan};
use crate::pipeline::settle::{Report, SettleError, Settled, Source};
use crate::pipeline::Shared;
use crate::sync::LockExt;

use super::advance::{released_record, write_new};

mod pipelined;

/// How long a drain's lease holds past its last write of the pointer.
pub(crate) const DRAIN_LEASE: Duration = crate::pipeline::settle::CLAIM_LEASE;

/// What one step of a drain came to.
pub(crate) enum Drained {
    /// A batch was delivered: the line's head is now its last event (delivered); drain on.
    Moved(Box<Event>),
    /// The line waits: on its head's retry (a batch's failed event), or on another drain.
    Waits,
    /// Nothing more to drain in batches: the one-by-one advance goes on from the head
    /// (nothing parked, a dead-lettered head, the breaker open, a paused event …). The
    /// drain's lease is given up first.
    OneByOne(Box<Event>),
}

/// One line's drain in batches.
pub(crate) struct Drain<'a> {
    shared: &'a Shared,
    key: &'a str,
    /// The lease's id.
    id: String,
    /// Events per call.
    max: usize,
    /// Parked events listed and not yet drained, in sequence order.
    listed: Mutex<VecDeque<ParkedEntry>>,
    /// The next batch's parked records, read while the batch before was in the handler.
    prefetched: Mutex<Vec<(String, Parked)>>,
    /// The pointer as this drain last wrote it (its lease on it), so the next step need not
    /// read it: a write on a stale one fails and reads it again.
    pointer: Mutex<Option<Versioned<Line>>>,
    /// A batch the handler answered all delivered while the one before it was being settled,
    /// itself not settled yet: the next step settles it (`pipelined`).
    pending: Mutex<Option<Called>>,
    /// Whether this drain has moved the line on once: only then does it call a batch while
    /// the one before is still being settled (`pipelined`).
    moved: AtomicBool,
}

/// A called batch: the handler's answer for each event of it.
struct Called {
    entries: Vec<ParkedEntry>,
    parked: Vec<Parked>,
    /// The attempts made: up to the first that did not succeed (the rest were not attempted).
    attempted: Vec<Attempted>,
    /// How many of `attempted` were delivered (all of them before the first failure).
    delivered: usize,
    /// The storm guard's trial the call ran under.
    trial: Option<i64>,
}

impl Called {
    /// Whether every event of the batch was delivered.
    fn all_delivered(&self) -> bool {
        self.delivered == self.entries.len()
    }
}

/// The items of one batch: the parked events and their attempts.
struct Batch {
    entries: Vec<ParkedEntry>,
    parked: Vec<Parked>,
    started: Vec<Started>,
}

impl<'a> Drain<'a> {
    /// A drain of `key`'s line, when the handler takes ordered batches.
    pub(crate) fn new(shared: &'a Shared, key: &'a str) -> Option<Self> {
        let max = shared.downstream.handler.in_order_max();
        (max > 1).then(|| Self {
            shared,
            key,
            id: uuid::Uuid::new_v4().to_string(),
            max,
            listed: Mutex::default(),
            prefetched: Mutex::default(),
            pointer: Mutex::default(),
            pending: Mutex::default(),
            moved: AtomicBool::new(false),
        })
    }

    /// One step from the delivered head `head` (the pointer's head, or the head it names once
    /// the batch the last step left pending is settled).
    pub(crate) async fn step(&self, head: &Event) -> Result<Drained, SettleError> {
        let pending = self.pending.locked().take();
        if let Some(called) = pending {
            return self.settle_pending(head, called).await;
        }
        let ledger = &self.shared.settler.ledger;
        let p = head.partition_id.as_str();
        let one_by_one = || Drained::OneByOne(Box::new(head.clone()));
        let kept = self.pointer.locked().take();
        let read = match kept {
            Some(v) => Some(v),
            None => ledger.line(p, self.key).await?,
        };
        let Some(read) = read else {
            return Ok(one_by_one());
        };
        let line = &read.value;
        if line.ended
            || line.head_key != head.identity.idempotency_key
            || line.head_seq != head.sequence_number
        {
            return Ok(one_by_one());
        }
        if self.others_lease(line) {
            return Ok(Drained::Waits);
        }
        let head_seq = line.head_seq;
        // Something parked: the lease first, so that the retry loop's sweep (which leaves a
        // leased line alone) does not release the next event one by one meanwhile.
        let read = if line.parked > 0 {
            match self.take_lease(p, head, read).await? {
                Some(read) => read,
                None => return Ok(Drained::Waits),
            }
        } else {
            read
        };
        let batch = match self.batch(p, head_seq).await? {
            Some(b) => b,
            None => return self.give_up(head, read).await,
        };
        let Some(admitted) = self.admit(&batch).await else {
            return self.give_up(head, read).await;
        };
        let Some(read) = self.take_lease(p, head, read).await? else {
            return Ok(Drained::Waits);
        };
        let called = self.call(batch, admitted).await;
        if called.all_delivered() && self.moved.load(Ordering::Acquire) {
            return self.overlapped(head, read, called).await;
        }
        self.settle(head, read, &called).await
    }

    /// Whether another drain's lease on `line` is live.
    fn others_lease(&self, line: &Line) -> bool {
        let now = self.shared.clock().now();
        line.drain
            .as_ref()
            .is_some_and(|l| l.by != self.id && l.live(now))
    }

    /// The next batch behind the head at `head_seq`: read from the parked records, cut
    /// before an event on its last attempt (which goes alone) and before an event an
    /// operator paused. `None`: nothing to drain in batches.
    async fn batch(&self, p: &str, head_seq: i64) -> Result<Option<Batch>, SettleError> {
        let ledger = &self.shared.settler.ledger;
        let mut entries = self.take_listed(head_seq);
        if entries.is_empty() {
            let listed = ledger.parked_in(p, self.key).await?;
            *self.listed.locked() = listed.into();
            entries = self.take_listed(head_seq);
        }
        let prefetched = std::mem::take(&mut *self.prefetched.locked());
        let reads = join_all(entries.iter().map(|e| {
            let ready = prefetched
                .iter()
                .find(|(name, _)| *name == e.name)
                .map(|(_, p)| p.clone());
            async move {
                match ready {
                    Some(p) => Ok(Some(p)),
                    None => ledger.read_parked(&e.name).await,
                }
            }
        }))
        .await;
        let mut parked = Vec::with_capacity(reads.len());
        for r in reads {
            match r? {
                Some(p) => parked.push(p),
                // Gone between the listing and the read: someone moved the line on.
                None => break,
            }
        }
        let policies = self.shared.settler.policies();
        let pauses = self.shared.pauses.borrow().clone();
        let mut started = Vec::with_capacity(parked.len());
        for (i, pk) in parked.iter().enumerate() {
            let e = &pk.event;
            let t = e.identity.event_type.as_deref();
            let policy = policies.for_type(t);
            let number = pk.attempts + 1;
            let last = number >= policy.max_attempts;
            if (last && i > 0)
                || pauses
                    .retry_pause(&e.identity.idempotency_key, t, None)
                    .is_some()
            {
                break;
            }
            let cx = attempt::Context {
                consumer_group: &self.shared.origin.consumer_group,
                source: Source::Retry,
                policy: &policy.name,
                max_attempts: policy.max_attempts,
                clock: self.shared.clock(),
                rate_limit_wait: None,
            };
            let earlier: Vec<String> = pk.behind_traceparent.iter().cloned().collect();
            started.push(attempt::start(e, number, &earlier, cx));
            if last {
                // On its last attempt: alone.
                break;
            }
        }
        if started.is_empty() {
            return Ok(None);
        }
        let n = started.len();
        parked.truncate(n);
        entries.truncate(n);
        Ok(Some(Batch {
            entries,
            parked,
            started,
        }))
    }

    /// Up to `max` listed entries after `head_seq`, taken off the list (the ones at or
    /// before it were drained already).
    fn take_listed(&self, head_seq: i64) -> Vec<ParkedEntry> {
        let mut listed = self.listed.locked();
        while listed.front().is_some_and(|e| e.seq <= head_seq) {
            listed.pop_front();
        }
        listed.iter().take(self.max).cloned().collect()
    }

    /// The breaker, the storm guard and the rate limit, asked for `batch`: the gate and the
    /// storm guard's trial. `None`: not now (the one-by-one path defers it as a retry).
    async fn admit(&self, batch: &Batch) -> Option<(Gate, Option<i64>)> {
        let shared = self.shared;
        let gate = shared.admit().await;
        if let Gate::Defer(_) = gate {
            return None;
        }
        let trial = match shared.storm_admit(&batch.parked[0].event).await {
            crate::breaker::storm::StormGate::Run { trial } => trial,
            crate::breaker::storm::StormGate::Wait(_) => return None,
        };
        if shared.downstream.limiter.is_some() {
            let never = tokio_util::sync::CancellationToken::new();
            for _ in &batch.started {
                match shared.pace(&never, false).await {
                    Some(crate::ratelimit::limiter::Acquired::Go(_)) => {}
                    _ => return None,
                }
            }
        }
        Some((gate, trial))
    }

    /// Takes (or renews) the drain's lease on the pointer `read` still naming `head`.
    /// `None`: the line moved on, or another drain holds it.
    async fn take_lease(
        &self,
        p: &str,
        head: &Event,
        read: Versioned<Line>,
    ) -> Result<Option<Versioned<Line>>, SettleError> {
        let until_ms = ms(self.shared.clock().now() + DRAIN_LEASE);
        if self.fresh(&read.value) {
            return Ok(Some(read));
        }
        let swapped = self
            .shared
            .settler
            .ledger
            .change_line(
                p,
                self.key,
                Start::From(Some(read)),
                |current| match current {
                    Some(mut line) if self.still_heads(&line, head) => {
                        line.drain = Some(DrainLease {
                            by: self.id.clone(),
                            until_ms,
                        });
                        Change::Write(Box::new(line), true)
                    }
                    _ => Change::Keep(false),
                },
            )
            .await?;
        Ok(if swapped.value { swapped.written } else { None })
    }

    /// Whether this drain holds the lease on `line` with at least half of it left.
    fn fresh(&self, line: &Line) -> bool {
        let now = ms(self.shared.clock().now());
        line.drain.as_ref().is_some_and(|l| {
            l.by == self.id && l.until_ms - now > (DRAIN_LEASE / 2).as_millis() as i64
        })
    }

    /// Whether `line` still names `head` and nobody else drains it.
    fn still_heads(&self, line: &Line, head: &Event) -> bool {
        !line.ended
            && line.head_key == head.identity.idempotency_key
            && line.head_seq == head.sequence_number
            && !self.others_lease(line)
    }

    /// Gives the lease up (if this drain holds it) and leaves the line to the one-by-one
    /// advance from `head`.
    async fn give_up(&self, head: &Event, read: Versioned<Line>) -> Result<Drained, SettleError> {
        let mine = read.value.drain.as_ref().is_some_and(|l| l.by == self.id);
        if mine {
            self.shared
                .settler
                .ledger
                .change_line(
                    &head.partition_id,
                    self.key,
                    Start::From(Some(read)),
                    |current| match current {
                        Some(mut line) if line.drain.as_ref().is_some_and(|l| l.by == self.id) => {
                            line.drain = None;
                            Change::Write(Box::new(line), ())
                        }
                        _ => Change::Keep(()),
                    },
                )
                .await?;
        }
        Ok(Drained::OneByOne(Box::new(head.clone())))
    }

    /// Calls the handler with `batch` (under the lease) and takes its answer: the attempts
    /// up to the first that did not succeed, each told to the breaker; the parked records of
    /// the batch after it are read meanwhile.
    async fn call(&self, batch: Batch, (gate, trial): (Gate, Option<i64>)) -> Called {
        let shared = self.shared;
        let Batch {
            entries,
            parked,
            started,
        } = batch;
        let last_seq = entries.last().map_or(i64::MAX, |e| e.seq);
        let (answered, duration) = {
            let items: Vec<Item<'_>> = parked
                .iter()
                .zip(&started)
                .map(|(pk, s)| Item {
                    event: &pk.event,
                    attempt: &s.attempt,
                })
                .collect();
            let t0 = std::time::Instant::now();
            let call =
                std::panic::AssertUnwindSafe(shared.downstream.handler.handle_in_order(&items));
            let call = async {
                let answered = futures::FutureExt::catch_unwind(call)
                    .await
                    .unwrap_or_else(|_| {
                        vec![Outcome::Failed(Failure::transient("the handler panicked"))]
                    });
                (answered, t0.elapsed())
            };
            futures::join!(call, self.prefetch(last_seq)).0
        };
        let mut answered = answered.into_iter();
        let mut attempted: Vec<Attempted> = Vec::with_capacity(started.len());
        for s in started {
            if attempted
                .last()
                .is_some_and(|a| a.outcome != Outcome::Delivered)
            {
                // After the first failure: not attempted (its span says so, and it ends).
                not_attempted(s.span());
                continue;
            }
            let outcome = answered.next().unwrap_or_else(|| {
                Outcome::Failed(Failure::transient(
                    "the handler gave no outcome for this event",
                ))
            });
            attempted.push(s.done(outcome, duration));
        }
        for (i, a) in attempted.iter().enumerate() {
            shared.observe.count_attempt();
            let g = if i == 0 {
                gate
            } else {
                Gate::Run {
                    probe: None,
                    new: false,
                }
            };
            shared
                .attempted(a, g, parked[i].event.identity.event_type.as_deref())
                .await;
        }
        let delivered = attempted
            .iter()
            .take_while(|a| a.outcome == Outcome::Delivered)
            .count();
        Called {
            entries,
            parked,
            attempted,
            delivered,
            trial,
        }
    }

    /// Settles a called batch (`read`: the pointer naming `head`, the event before it): its
    /// delivered events; the first failure, if any.
    async fn settle(
        &self,
        head: &Event,
        read: Versioned<Line>,
        called: &Called,
    ) -> Result<Drained, SettleError> {
        let shared = self.shared;
        let settler = &*shared.settler;
        let Called {
            entries,
            parked,
            attempted,
            delivered,
            trial,
        } = called;
        let (delivered, trial) = (*delivered, *trial);
        let line = read.value.clone();
        let failed = attempted.get(delivered).map(|a| (a, &parked[delivered]));
        let held = match failed {
            Some((a, pk)) => {
                let rec = released_record(settler, pk, &line, settler.clock().now());
                let report = self.report(pk, a);
                shared.storm_verdict(&report, Some(&rec), trial).await
                    == crate::breaker::storm::StormVerdict::Hold
            }
            None => false,
        };
        let failed = failed.filter(|_| !held);
        let new_head = match failed {
            Some((_, pk)) => pk,
            None if delivered > 0 => &parked[delivered - 1],
            // Nothing delivered, and the failure held by the storm guard: one by one.
            None => return self.give_up(head, read).await,
        };
        // The delivered events' records and the removal of their parked records, beside the
        // failed event's record and then the pointer naming the new head (whoever reads the
        // pointer finds the record it names; a delivered event's removal needs no order: the
        // pointer's head is settled and what follows it is what is still parked).
        let records =
            join_all((0..delivered).map(|i| self.record(&line, &parked[i], &attempted[i])));
        let removals = join_all(
            entries[..delivered]
                .iter()
                .map(|e| settler.ledger.remove_parked(&e.name)),
        );
        let moved = async {
            let failed_rec = match failed {
                Some((a, pk)) => Some(self.record(&line, pk, a).await?),
                None => None,
            };
            let written = self
                .move_head(head, read, new_head, failed.map(|(a, _)| a), delivered)
                .await?;
            Ok::<_, SettleError>((failed_rec, written))
        };
        let (written_records, removed, moved) = futures::join!(records, removals, moved);
        for (i, w) in written_records.into_iter().enumerate() {
            let settled = w.map(|_| Settled::Delivered);
            attempt::finish(&attempted[i], settled.as_ref());
            let s = settled?;
            shared.observe.count_released();
            shared
                .observe
                .count_settled(&s, parked[i].event.identity.event_type.as_deref());
        }
        for r in removed {
            r?;
        }
        let (failed_rec, written) = moved?;
        if !written {
            // The lease lapsed and someone else moved the line on: theirs now.
            return Ok(Drained::Waits);
        }
        match (failed, failed_rec) {
            (Some((a, _)), Some(rec)) => {
                let then = self.after_failure(rec, a).await?;
                settler
                    .ledger
                    .remove_parked(&entries[delivered].name)
                    .await?;
                Ok(then)
            }
            _ if held => Ok(Drained::OneByOne(Box::new(new_head.event.clone()))),
            _ => Ok(Drained::Moved(Box::new(new_head.event.clone()))),
        }
    }

    /// Writes the pointer naming `new_head` (the last delivered event, or the `failed` one
    /// after `delivered` delivered) in place of `head`, the lease renewed while the drain goes
    /// on. `false`: the line moved on meanwhile (the lease lapsed), nothing written.
    async fn move_head(
        &self,
        head: &Event,
        read: Versioned<Line>,
        new_head: &Parked,
        failed: Option<&Attempted>,
        delivered: usize,
    ) -> Result<bool, SettleError> {
        let settler = &*self.shared.settler;
        let moved = delivered + usize::from(failed.is_some());
        let new_seq = new_head.event.sequence_number;
        let now = settler.clock().now();
        let next_parked_ms = self
            .listed
            .locked()
            .iter()
            .find(|e| e.seq > new_seq)
            .map(|e| e.parked_ms.unwrap_or(ms(now)));
        let lease = failed.is_none().then(|| DrainLease {
            by: self.id.clone(),
            until_ms: ms(now + DRAIN_LEASE),
        });
        let swapped = settler
            .ledger
            .change_line(
                &head.partition_id,
                self.key,
                Start::From(Some(read)),
                |current| {
                    let Some(mut line) = current.filter(|l| self.still_heads(l, head)) else {
                        return Change::Keep(false);
                    };
                    line.head_key = new_head.event.identity.idempotency_key.clone();
                    line.head_seq = new_seq;
                    line.head_traceparent = failed.map(|a| a.traceparent.clone());
                    line.released_behind = None;
                    line.parked = line.parked.saturating_sub(moved as u64);
                    line.oldest_parked_ms = next_parked_ms;
                    line.drain = lease.clone();
                    Change::Write(Box::new(line), true)
                },
            )
            .await?;
        if swapped.value && lease.is_some() {
            *self.pointer.locked() = swapped.written;
            self.moved.store(true, Ordering::Release);
        }
        Ok(swapped.value)
    }

    /// Reads the parked records of the batch after the event at `last_seq` (from the listing
    /// in hand), for the next step; a failed read only means the next step reads it.
    async fn prefetch(&self, last_seq: i64) {
        let ledger = &self.shared.settler.ledger;
        let next: Vec<ParkedEntry> = self
            .listed
            .locked()
            .iter()
            .filter(|e| e.seq > last_seq)
            .take(self.max)
            .cloned()
            .collect();
        let reads = join_all(next.iter().map(|e| ledger.read_parked(&e.name))).await;
        let ready: Vec<(String, Parked)> = next
            .into_iter()
            .zip(reads)
            .filter_map(|(e, r)| r.ok().flatten().map(|p| (e.name, p)))
            .collect();
        *self.prefetched.locked() = ready;
    }

    /// The failed event heads the line now: its retry goes to Service Bus (the line waits
    /// on it), or, dead-lettered, the one-by-one advance moves the line on from it.
    async fn after_failure(
        &self,
        rec: LedgerRecord,
        a: &Attempted,
    ) -> Result<Drained, SettleError> {
        let settler = &*self.shared.settler;
        let settled = match rec.state() {
            State::RetryScheduled => {
                let trail = vec![a.traceparent.clone()];
                match settler.resend_recorded(&rec, &trail).await? {
                    Some(due) => Settled::RetryScheduled {
                        attempt: rec.attempts + 1,
                        due,
                    },
                    None => Settled::DeadLettered(crate::policy::DeadLetterReason::RetryRefused),
                }
            }
            State::DeadLettered => Settled::DeadLettered(
                rec.dead_letter_reason()
                    .unwrap_or(crate::policy::DeadLetterReason::Permanent),
            ),
            State::Delivered => Settled::AlreadyFinal(State::Delivered),
        };
        attempt::finish(a, Ok(&settled));
        let t = rec.event.identity.event_type.as_deref();
        self.shared.observe.count_released();
        self.shared.observe.count_settled(&settled, t);
        Ok(match settled {
            Settled::RetryScheduled { .. } => Drained::Waits,
            _ => Drained::OneByOne(Box::new(rec.event)),
        })
    }

    /// The report of attempt `a` of the parked event `pk`.
    fn report<'r>(&self, pk: &'r Parked, a: &'r Attempted) -> Report<'r> {
        Report {
            event: &pk.event,
            attempt: pk.attempts + 1,
            source: Source::Retry,
            started: a.started,
            outcome: &a.outcome,
            trace_id: &a.trace_id,
            traceparents: std::slice::from_ref(&a.traceparent),
        }
    }

    /// Writes the ledger record of the parked event `pk` after its attempt `a`: released
    /// from `line`, then the attempt settled on it (delivered; or failed, its next attempt
    /// due or its dead letter). A record of this very event already there (a drain again
    /// after a crash) stays as it is and is returned, unless it is a release of the event not
    /// attempted since (a one-by-one release, the sweep's, whose pointer write lost to this
    /// drain's lease): this attempt replaces it.
    async fn record(
        &self,
        line: &Line,
        pk: &Parked,
        a: &Attempted,
    ) -> Result<LedgerRecord, SettleError> {
        let settler = &*self.shared.settler;
        let now = settler.clock().now();
        let released = released_record(settler, pk, line, now);
        let report = self.report(pk, a);
        let planned = plan(
            Some(&released),
            &report,
            settler.policies(),
            now,
            &mut rand::thread_rng(),
        );
        let rec = match planned {
            Plan::RecordDelivery(r) | Plan::Schedule { record: r, .. } => *r,
            Plan::DeadLetter { record, .. } => *record,
            // Not for a released record's current attempt: keep it released (due now).
            Plan::Done(_) | Plan::ResendRecorded(_) => released,
        };
        write_new(settler, rec, Some(pk.attempts)).await
    }
}

/// Marks the span of a batch's event after its first failure: not attempted (it goes again
/// after the failed one).
fn not_attempted(span: &tracing::Span) {
    if span.is_disabled() {
        return;
    }
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    span.set_attribute(
        crate::telemetry::names::attr::OUTCOME,
        crate::telemetry::names::outcome::NOT_ATTEMPTED,
    );
}
