//! One partition: read in order, attempt, settle, and checkpoint the contiguous settled
//! prefix — every N events or T milliseconds (never more often than the minimum interval),
//! once more at the end. Up to `max_in_flight` events run at once; events sharing an ordering
//! key run one after another in sequence order ([`Dispatcher`]). A settlement that fails
//! holds its event (nothing behind it can move the checkpoint) and is retried with backoff
//! until it succeeds or the task is stopped; a stop while holding leaves the event after the
//! checkpoint, so the next owner replays it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use azure_messaging_eventhubs::models::ReceivedEventData;
use azure_messaging_eventhubs::processor::PartitionClient;
use futures::stream::FuturesUnordered;
use futures::StreamExt;

use super::admission::Gate;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::backoff::{until_settled, Hold};
use super::settle::{Report, Source};
use super::{attempt, Shared};
use crate::event::Event;
use crate::guard::Dispatcher;

mod checkpointer;
use checkpointer::{lag, Checkpointer, Writing};

/// How a partition task ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    /// Its stream failed (not a revocation, `cancel` or the end of the stream).
    pub(crate) failed: bool,
    /// Events it received.
    pub(crate) received: u64,
}

/// Processes one partition until it is revoked, fails, or `cancel` fires; then lets the
/// events in flight settle, writes the final checkpoint and closes the partition client (the
/// only clean give-back). `stop_reading` (a handover) stops the reading alone: what is in
/// flight still settles, however long that takes.
pub(crate) async fn run(
    pc: Arc<PartitionClient>,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    stop_reading: CancellationToken,
    fence: &super::checkpoint::FencedCheckpointStore,
) -> Ended {
    let pid = pc.get_partition_id().to_string();
    shared.health.set_owned(&pid, None);
    tracing::info!(partition = %pid, "partition claimed");
    let mut task = Task::claimed(pc, shared, pid).await;
    task.read(&cancel, &stop_reading, fence).await;
    task.release(fence).await
}

/// A partition task between its claim and its release: what it accepted and has not
/// settled, its checkpoint, what it knows of the ledger, and the operator's pause and rewind
/// as it last saw them.
struct Task {
    pid: String,
    pc: Arc<PartitionClient>,
    shared: Arc<Shared>,
    dispatcher: Dispatcher,
    // Accepted, unsettled events: the SDK's copy (to checkpoint) and ours (to start later if
    // it waits behind its key).
    received_by_seq: BTreeMap<i64, ReceivedEventData>,
    waiting: BTreeMap<i64, Event>,
    cp: Checkpointer,
    /// The checkpoint write in flight (one at a time, in the background).
    writing: Option<Writing>,
    recorded: Arc<super::recorded::Recorded>,
    known: Arc<super::lines::Known>,
    /// Ordered retries are on.
    ordered: bool,
    reading: bool,
    paused: Option<super::control::Pause>,
    rewinding: Option<super::control::Rewind>,
    /// The last sequence number read (see [`Task::received`]).
    last_seq: Option<i64>,
    ended: Ended,
}

/// A background listing of what a partition knows of the ledger (see [`Task::tick`]).
type Relisting = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

impl Task {
    /// A task for the partition just claimed, with the ledger's records and lines of it
    /// listed.
    async fn claimed(pc: Arc<PartitionClient>, shared: Arc<Shared>, pid: String) -> Self {
        let dispatcher =
            Dispatcher::with_window(shared.options.max_in_flight, shared.options.window);
        let cp = Checkpointer::default();
        // Which of this partition's events the ledger may hold a retry of: listed before the
        // first event is read (if the listing fails, every delivery asks the ledger until a
        // later listing succeeds).
        let recorded = Arc::new(super::recorded::Recorded::default());
        list_recorded(&recorded, &pid, &shared).await;
        // Ordered retries: which of this partition's keys have a line (see `pipeline::lines`).
        let known = Arc::new(super::lines::Known::default());
        let ordered = shared.options.retry_ordering.lines().is_some();
        if ordered {
            list_lines(&known, &pid, &shared).await;
        }
        Self {
            pid,
            pc,
            shared,
            dispatcher,
            received_by_seq: BTreeMap::new(),
            waiting: BTreeMap::new(),
            cp,
            writing: None,
            recorded,
            known,
            ordered,
            reading: true,
            paused: None,
            rewinding: None,
            last_seq: None,
            ended: Ended {
                failed: false,
                received: 0,
            },
        }
    }

    /// Reads, dispatches and checkpoints until reading stops (a stop, a handover, the end of
    /// the stream, a gap in it, or an operator's rewind) and everything started has settled.
    async fn read(
        &mut self,
        cancel: &CancellationToken,
        stop_reading: &CancellationToken,
        fence: &super::checkpoint::FencedCheckpointStore,
    ) {
        let start = {
            let (shared, cancel, pid) = (self.shared.clone(), cancel.clone(), self.pid.clone());
            let (recorded, known) = (self.recorded.clone(), self.known.clone());
            move |event: Event, cp: &Checkpointer| {
                let (shared, cancel, pid) = (shared.clone(), cancel.clone(), pid.clone());
                let (recorded, known) = (recorded.clone(), known.clone());
                let lag = (cp.uncovered, cp.oldest_uncovered);
                async move {
                    let seq = event.sequence_number;
                    (
                        seq,
                        process(event, &pid, &shared, &cancel, lag, &recorded, &known).await,
                    )
                }
            }
        };
        let mut running: FuturesUnordered<_> = FuturesUnordered::new();
        let pc = self.pc.clone();
        let stream = pc.stream_events();
        futures::pin_mut!(stream);
        let mut tick = tokio::time::interval(self.shared.options.checkpoint_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // An operator's pause: no read while it holds (what was accepted still settles and
        // checkpoints), listed as held under its own key so other holds stay apart.
        let mut pauses = self.shared.pauses.subscribe();
        self.paused = pauses.borrow_and_update().of(&self.pid).cloned();
        mark_paused(&self.shared, &self.pid, self.paused.as_ref());
        // An operator's rewind waiting for this partition: read nothing more, let what was
        // read settle, then write the rewind's checkpoint instead of a final one and give the
        // partition back, so the processor hands it out again from there.
        self.rewinding = pauses
            .borrow()
            .waiting_rewind(&self.pid)
            .filter(|r| !fence.rewind_done(&r.id))
            .cloned();
        if self.rewinding.is_some() {
            self.reading = false;
        }
        let mut relisting: Option<Relisting> = None;
        loop {
            if !self.reading && running.is_empty() {
                break;
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled(), if self.reading => self.reading = false,
                _ = stop_reading.cancelled(), if self.reading => self.reading = false,
                Some((seq, settled)) = running.next(), if !running.is_empty() => {
                    let (seq, settled): (i64, bool) = (seq, settled);
                    if !settled {
                        continue; // stopped while holding: the event stays unsettled
                    }
                    let (next, moved) = self.dispatcher.settled(seq);
                    if let Some(next) = next.and_then(|n| self.waiting.remove(&n)) {
                        running.push(start(next, &self.cp));
                    }
                    self.settled(moved);
                }
                Ok(()) = pauses.changed() => self.control_changed(&mut pauses, fence),
                _ = tick.tick() => self.tick(&mut relisting).await,
                _ = async { relisting.as_mut().expect("guarded").await }, if relisting.is_some() => {
                    relisting = None;
                }
                written = async { self.writing.as_mut().expect("guarded").await }, if self.writing.is_some() => {
                    self.writing = None;
                    self.cp.finish(written, &self.pid, &self.shared);
                }
                next = stream.next(), if self.reading && self.dispatcher.has_room() && self.paused.is_none() => match next {
                    Some(Ok(received)) => {
                        if let Some(event) = self.received(received) {
                            running.push(start(event, &self.cp));
                        }
                    }
                    Some(Err(e)) => {
                        tracing::info!(partition = %self.pid, error = %e, "partition stream ended (revoked or disconnected)");
                        // A revocation (another replica took the partition) is not a failure.
                        self.ended.failed = !matches!(
                            e.kind,
                            azure_messaging_eventhubs::error::ErrorKind::ConsumerDisconnected(_)
                        );
                        self.reading = false;
                    }
                    None => self.reading = false,
                },
            }
        }
    }

    /// An event settled: the checkpoint moves to `moved` (the new end of the contiguous
    /// settled prefix), written (in the background) when enough events settled.
    fn settled(&mut self, moved: Option<i64>) {
        let moved_to = moved.and_then(|c| {
            let rest = self.received_by_seq.split_off(&(c + 1));
            std::mem::replace(&mut self.received_by_seq, rest).remove(&c)
        });
        self.cp.settled(moved_to);
        if self.writing.is_none() && self.cp.count_due(&self.shared) {
            self.writing = self.cp.begin(&self.pc, &self.shared);
        }
    }

    /// The control record changed: an operator's rewind stops the reading, a pause holds it.
    fn control_changed(
        &mut self,
        pauses: &mut tokio::sync::watch::Receiver<super::control::Pauses>,
        fence: &super::checkpoint::FencedCheckpointStore,
    ) {
        let pid = &self.pid;
        if self.rewinding.is_none() {
            self.rewinding = pauses
                .borrow()
                .waiting_rewind(pid)
                .filter(|r| !fence.rewind_done(&r.id))
                .cloned();
            if let Some(r) = &self.rewinding {
                tracing::info!(partition = %pid, first = r.first, by = %r.by, "an operator's rewind: stop reading, settle what was read, then rewind the checkpoint");
                self.reading = false;
            }
        }
        let now = pauses.borrow_and_update().of(pid).cloned();
        if now != self.paused {
            tracing::info!(partition = %pid, paused = now.is_some(), "the operator's pause changed");
            self.paused = now;
            mark_paused(&self.shared, pid, self.paused.as_ref());
        }
    }

    /// The checkpoint interval: a checkpoint if due, tombstones the checkpoint passed, the
    /// lag, and a listing of what is unlisted (in the background, into `relisting`).
    async fn tick(&mut self, relisting: &mut Option<Relisting>) {
        let (pid, shared, cp, known) = (&self.pid, &self.shared, &mut self.cp, &self.known);
        if self.writing.is_none() && cp.interval_passed(shared) {
            self.writing = cp.begin(&self.pc, shared);
        }
        // Ordered retries: tombstones of lines whose events the checkpoint passed
        // (no replay can meet them again) go.
        if let (true, Some(c)) = (self.ordered, cp.written) {
            for k in known.passed(c) {
                match super::lines::remove_tombstone(&shared.settler, pid, &k, c).await {
                    Ok(Some(state)) => known.set(&k, state),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::debug!(partition = %pid, error = %e, "a line's tombstone stays until the next try")
                    }
                }
            }
        }
        cp.publish_lag(pid, shared);
        // Listed again in the background, so a slow listing holds nothing up.
        let lines_unlisted = self.ordered && !known.is_listed();
        if (!self.recorded.is_listed() || lines_unlisted) && relisting.is_none() {
            let (recorded, pid, shared) = (self.recorded.clone(), pid.clone(), shared.clone());
            let known = known.clone();
            *relisting = Some(Box::pin(async move {
                if !recorded.is_listed() {
                    list_recorded(&recorded, &pid, &shared).await
                }
                if lines_unlisted {
                    list_lines(&known, &pid, &shared).await
                }
            }));
        }
    }

    /// An event read: accepted into the window, and returned if it may start now (one that
    /// waits behind its key starts when the event before it settles). Event Hubs numbers a
    /// partition's events contiguously: a stream that skips (after an internal reconnect,
    /// say) must not let the checkpoint pass what it skipped.
    fn received(&mut self, received: ReceivedEventData) -> Option<Event> {
        let (pid, shared) = (&self.pid, &self.shared);
        let seq = received.sequence_number().unwrap_or(-1);
        if let Some(last) = self.last_seq {
            if seq <= last {
                tracing::debug!(partition = %pid, seq, last, "event re-delivered by the stream; already dispatched");
                return None;
            }
            if seq != last + 1 {
                tracing::error!(partition = %pid, after = last, next = seq, "the partition stream skipped events; giving the partition back so it restarts from its checkpoint");
                self.reading = false;
                return None;
            }
        }
        self.last_seq = Some(seq);
        self.ended.received += 1;
        let event = shared
            .origin
            .identity
            .event(&shared.origin.hub, pid, &received);
        self.cp.received(
            received
                .enqueued_time()
                .unwrap_or_else(|| shared.clock().now()),
        );
        let now = self
            .dispatcher
            .accept(seq, shared.options.ordering.of(&event));
        self.received_by_seq.insert(seq, received);
        if now {
            Some(event)
        } else {
            self.waiting.insert(seq, event);
            None
        }
    }

    /// Everything started has settled: writes the final checkpoint (or the operator's
    /// rewind), and gives the partition back.
    async fn release(self, fence: &super::checkpoint::FencedCheckpointStore) -> Ended {
        let Task {
            pid,
            pc,
            shared,
            dispatcher,
            mut cp,
            writing,
            rewinding,
            ended,
            ..
        } = self;
        // Events still waiting behind their key never started: they stay after the checkpoint.
        debug_assert!(cp
            .last_settled
            .as_ref()
            .and_then(|e| e.sequence_number())
            .is_none_or(|s| dispatcher.oldest_unsettled().is_none_or(|o| s < o)));
        match &rewinding {
            None => cp.flush(writing, &pc, &shared).await,
            Some(r) => {
                // A write still in flight lands first: it must not land after the rewind's.
                if let Some(w) = writing {
                    cp.finish(w.await, &pid, &shared);
                }
                apply_rewind(&pid, r, &shared, fence).await
            }
        }
        mark_paused(&shared, &pid, None);
        shared.health.unset_owned(&pid);
        match Arc::try_unwrap(pc) {
            Ok(pc) => {
                if tokio::time::timeout(shared.options.deadline, pc.close())
                    .await
                    .is_err()
                {
                    tracing::warn!(partition = %pid, "closing the partition client timed out");
                }
            }
            Err(_) => {
                tracing::warn!(partition = %pid, "partition client still shared; cannot give it back cleanly")
            }
        }
        tracing::info!(partition = %pid, "partition released");
        ended
    }
}

/// Writes an operator's rewind of `pid` (everything read has settled) and marks it applied in
/// the control record. A failure leaves it waiting: the partition is given back all the same,
/// and its next task (here or on another replica) tries again.
async fn apply_rewind(
    pid: &str,
    r: &super::control::Rewind,
    shared: &Shared,
    fence: &super::checkpoint::FencedCheckpointStore,
) {
    if let Err(e) = fence.rewind(pid, r).await {
        tracing::warn!(partition = %pid, error = %e, "the operator's rewind was not written; the partition's next owner tries again");
        return;
    }
    let name = super::control::record_name(&shared.origin.hub, &shared.origin.consumer_group);
    match super::control::mark_applied(
        shared.settler.ledger.store().as_ref(),
        &name,
        pid,
        &r.id,
        &shared.options.owner_id,
    )
    .await
    {
        Ok(()) => {
            tracing::info!(partition = %pid, first = r.first, checkpoint = r.sequence_number, by = %r.by, "the operator's rewind is applied; the partition is read again from there")
        }
        Err(e) => {
            tracing::warn!(partition = %pid, error = %e, "the rewind's checkpoint is written but not yet marked applied; the partition's next owner writes it again")
        }
    }
}

/// Lists the ledger's pending retries of `pid`'s events into `recorded` (each storage call
/// has its deadline); a failure leaves it unlisted, which only costs a ledger read per
/// delivery until a later listing succeeds.
async fn list_recorded(recorded: &super::recorded::Recorded, pid: &str, shared: &Shared) {
    match shared.settler.ledger.pending().await {
        Ok(pending) => recorded.set_listing(pending, pid),
        Err(e) => {
            tracing::warn!(partition = %pid, error = %e, "cannot list the ledger's pending retries; every delivery asks the ledger until a listing succeeds")
        }
    }
}

/// Lists the open lines of `pid`'s keys into `known` (ordered retries); a failure leaves it
/// unlisted, which only costs a pointer read per event with a key until a listing succeeds.
async fn list_lines(known: &super::lines::Known, pid: &str, shared: &Shared) {
    match shared.settler.ledger.lines_and_ends(Some(pid)).await {
        Ok(lines) => known.set_listing(lines),
        Err(e) => {
            tracing::warn!(partition = %pid, error = %e, "cannot list the partition's lines (ordered retries); every event with an ordering key reads its line until a listing succeeds")
        }
    }
}

/// Shows partition `pid` as paused by `pause`, or no longer: held as `{pid} (paused)`, apart
/// from the partition's own holds (an unsettled event's cause stays in view beside it), with
/// no event (-1) as its oldest unsettled.
fn mark_paused(shared: &Shared, pid: &str, pause: Option<&super::control::Pause>) {
    let subject = super::health::HoldSubject::PausedPartition(pid.to_string());
    match pause {
        Some(p) => shared.health.hold(
            subject,
            None,
            super::health::HoldCause::Paused,
            super::control::Pauses::reason(p),
        ),
        None => shared.health.release(&subject, None),
    }
}

/// What one event's task works with: its partition, how to stop, the lag a hold reports, and
/// what the partition knows of the ledger's records and lines.
#[derive(Clone, Copy)]
struct EventTask<'a> {
    pid: &'a str,
    shared: &'a Shared,
    cancel: &'a CancellationToken,
    lag: (u64, Option<SystemTime>),
    recorded: &'a super::recorded::Recorded,
    known: &'a super::lines::Known,
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
async fn process(
    event: Event,
    pid: &str,
    shared: &Shared,
    cancel: &CancellationToken,
    lag: (u64, Option<SystemTime>),
    recorded: &super::recorded::Recorded,
    known: &super::lines::Known,
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
        use super::lines::KeyState;
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
    async fn key_state(&self, seq: i64, k: &str) -> Option<super::lines::KeyState> {
        use super::lines::KeyState;
        let (pid, shared) = (self.pid, self.shared);
        match self.known.state(k) {
            KeyState::Unknown => {
                let read = until_done(pid, seq, shared, self.cancel, self.lag, || async {
                    Ok::<_, super::settle::SettleError>(
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
            Ok::<_, super::settle::SettleError>(
                shared
                    .settler
                    .ledger
                    .get(&event.identity.idempotency_key)
                    .await?
                    .map(|(r, _)| r)
                    .filter(|r| {
                        r.state != crate::ledger::State::RetryScheduled
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
        tracing::debug!(partition = %pid, sequence_number = seq, key = %event.identity.idempotency_key, state = ?rec.state, "a replay of an event its line already settled: not delivered again");
        let s = super::settle::Settled::AlreadyFinal(rec.state);
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
                        super::health::HoldCause::BreakerOpen,
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
                Ok::<_, super::settle::SettleError>(
                    super::lines::open(&shared.settler, event, k, &attempted.traceparent).await?,
                )
            })
            .await;
            match opened {
                None => return LineStep::Stopped,
                Some(super::lines::Open::Head) => return LineStep::Continue { heads: true },
                Some(super::lines::Open::Older) => return LineStep::Continue { heads: false },
                // A line this partition did not know of (a previous owner's, during a
                // rebalance): the event belongs behind it, whatever this attempt said.
                Some(super::lines::Open::Behind) => {
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
            let s = super::settle::Settled::Delivered;
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
            if matches!(s, super::settle::Settled::RetryScheduled { .. }) {
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
        super::lines::advance(
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
    known: &super::lines::Known,
) -> Option<Result<(bool, bool), super::settle::Settled>> {
    let seq = event.sequence_number;
    let parked = until_done(pid, seq, shared, cancel, lag, || async {
        Ok::<_, super::settle::SettleError>(
            super::lines::park(&shared.settler, event, key, None).await?,
        )
    })
    .await?;
    match parked {
        super::lines::Park::Parked {
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
            let s = super::settle::Settled::Parked { behind, behind_seq };
            shared
                .observe
                .count_settled(&s, event.identity.event_type.as_deref());
            shared.health.release_event(pid, seq);
            Some(Err(s))
        }
        super::lines::Park::Deliver {
            head: None,
            ended_at,
        } => {
            known.ended(key, ended_at);
            Some(Ok((false, ended_at.is_none_or(|x| seq <= x))))
        }
        super::lines::Park::Deliver { head: Some(h), .. } => {
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
    Fut: std::future::Future<Output = Result<T, super::settle::SettleError>>,
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

impl Hold<super::settle::SettleError> for PartitionHold<'_> {
    fn failed(&mut self, e: &super::settle::SettleError) {
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
