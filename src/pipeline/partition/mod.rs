//! One partition: read in order, attempt, settle, and checkpoint the contiguous settled
//! prefix — every N events or T milliseconds (never more often than the minimum interval),
//! once more at the end. Up to `max_in_flight` events run at once; events sharing an ordering
//! key run one after another in sequence order ([`Dispatcher`]). A settlement that fails
//! holds its event (nothing behind it can move the checkpoint) and is retried with backoff
//! until it succeeds or the task is stopped; a stop while holding leaves the event after the
//! checkpoint, so the next owner replays it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use azure_messaging_eventhubs::models::ReceivedEventData;
use azure_messaging_eventhubs::processor::PartitionClient;
use futures::stream::FuturesUnordered;
use futures::StreamExt;

use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::event::Event;
use crate::guard::Dispatcher;

mod event;

use event::process;
pub(crate) use event::transient_failure;

mod checkpointer;
use checkpointer::{lag, Checkpointer, Writing};

/// How a partition task ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    /// Its stream failed (not a revocation, `cancel` or the end of the stream).
    pub(crate) failed: bool,
    /// Events it received.
    pub(crate) received: u64,
    /// Its partition client was closed, which is what lets the processor hand the partition
    /// out again: a client whose `close()` fails stays in the SDK's map for good.
    pub(crate) closed: bool,
}

/// Why a partition task stops reading: each way ends the same — what was read settles, a
/// final checkpoint is written (or the operator's rewind instead), the client is closed, and
/// the fence decides what becomes of the partition (kept, handed over, released).
#[derive(Debug, Clone)]
enum Drain {
    /// The replica stops (or rebuilds its processor).
    Stop,
    /// Given up: promised to another replica that asked for it, or lost (another owner is
    /// listed, or this process no longer holds its owner id).
    GivenUp,
    /// An operator's rewind: its checkpoint is written instead of a final one.
    Rewind(super::control::Rewind),
    /// The stream ended or failed (a revocation, a lost connection).
    StreamEnded,
    /// The stream skipped events: the partition restarts from its checkpoint.
    Gap,
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
    // Accepted, unsettled events: the SDK's copy (to checkpoint), in sequence order (each
    // one read is the one after the last: see `received`), and ours (to start later if it
    // waits behind its key).
    received_by_seq: VecDeque<(i64, ReceivedEventData)>,
    waiting: BTreeMap<i64, Event>,
    cp: Checkpointer,
    /// The checkpoint write in flight (one at a time, in the background).
    writing: Option<Writing>,
    recorded: Arc<super::recorded::Recorded>,
    known: Arc<super::lines::Known>,
    /// Ordered retries are on.
    ordered: bool,
    /// Why reading stopped (`None` while it reads).
    drain: Option<Drain>,
    paused: Option<super::control::Pause>,
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
            received_by_seq: VecDeque::new(),
            waiting: BTreeMap::new(),
            cp,
            writing: None,
            recorded,
            known,
            ordered,
            drain: None,
            paused: None,
            last_seq: None,
            ended: Ended {
                failed: false,
                received: 0,
                closed: false,
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
        // Each event says when its handler call ended, and leaves its slot (see
        // `Dispatcher::answered`).
        let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel::<i64>();
        let start = {
            let (shared, cancel, pid) = (self.shared.clone(), cancel.clone(), self.pid.clone());
            let (recorded, known) = (self.recorded.clone(), self.known.clone());
            move |event: Event, cp: &Checkpointer| {
                let (shared, cancel, pid) = (shared.clone(), cancel.clone(), pid.clone());
                let (recorded, known) = (recorded.clone(), known.clone());
                let answered = answered_tx.clone();
                let lag = event::Lag::of(cp);
                async move {
                    let seq = event.sequence_number;
                    let task = event::EventTask {
                        pid: &pid,
                        shared: &shared,
                        cancel: &cancel,
                        lag,
                        recorded: &recorded,
                        known: &known,
                        fence,
                        answered: &answered,
                    };
                    (seq, process(event, task).await)
                }
            }
        };
        let mut running: FuturesUnordered<_> = FuturesUnordered::new();
        let pc = self.pc.clone();
        let stream = pc.stream_events();
        futures::pin_mut!(stream);
        let mut tick = tokio::time::interval(self.shared.options.checkpoint_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pauses = self.controls(fence);
        let mut relisting: Option<Relisting> = None;
        loop {
            let reading = self.drain.is_none();
            if !reading && running.is_empty() {
                break;
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled(), if reading => self.drain = Some(Drain::Stop),
                _ = stop_reading.cancelled(), if reading => self.drain = Some(Drain::GivenUp),
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
                Some(seq) = answered.recv() => self.dispatcher.answered(seq),
                Ok(()) = pauses.changed() => self.control_changed(&mut pauses, fence),
                _ = tick.tick() => self.tick(&mut relisting).await,
                _ = async { relisting.as_mut().expect("guarded").await }, if relisting.is_some() => {
                    relisting = None;
                }
                written = async { self.writing.as_mut().expect("guarded").await }, if self.writing.is_some() => {
                    self.writing = None;
                    self.cp.finish(written, &self.pid, &self.shared);
                }
                next = stream.next(), if reading && self.dispatcher.has_room() && self.paused.is_none() => match next {
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
                        self.drain = Some(Drain::StreamEnded);
                    }
                    None => self.drain = Some(Drain::StreamEnded),
                },
            }
        }
    }

    /// An event settled: the checkpoint moves to `moved` (the new end of the contiguous
    /// settled prefix), written (in the background) when enough events settled.
    fn settled(&mut self, moved: Option<i64>) {
        // The events the checkpoint passes leave from the front; what follows them stays
        // where it is.
        let moved_to = moved.and_then(|c| {
            let mut at = None;
            while self
                .received_by_seq
                .front()
                .is_some_and(|(seq, _)| *seq <= c)
            {
                if let Some((seq, received)) = self.received_by_seq.pop_front() {
                    at = (seq == c).then_some(received);
                }
            }
            at
        });
        self.cp.settled(moved_to);
        if self.writing.is_none() && self.cp.count_due(&self.shared) {
            self.writing = self.cp.begin(&self.pc, &self.shared);
        }
    }

    /// The operator's controls as they stand when reading starts, and their changes after.
    /// A pause: no read while it holds (what was accepted still settles and checkpoints),
    /// listed as held under its own key so other holds stay apart. A rewind waiting for this
    /// partition: read nothing more, let what was read settle, then write the rewind's
    /// checkpoint instead of a final one and give the partition back, so the processor hands
    /// it out again from there.
    fn controls(
        &mut self,
        fence: &super::checkpoint::FencedCheckpointStore,
    ) -> tokio::sync::watch::Receiver<super::control::Pauses> {
        let mut pauses = self.shared.pauses.subscribe();
        self.paused = pauses.borrow_and_update().of(&self.pid).cloned();
        mark_paused(&self.shared, &self.pid, self.paused.as_ref());
        if let Some(r) = pauses
            .borrow()
            .waiting_rewind(&self.pid)
            .filter(|r| !fence.rewind_done(&r.id))
        {
            self.drain = Some(Drain::Rewind(r.clone()));
        }
        pauses
    }

    /// The control record changed: an operator's rewind stops the reading, a pause holds it.
    fn control_changed(
        &mut self,
        pauses: &mut tokio::sync::watch::Receiver<super::control::Pauses>,
        fence: &super::checkpoint::FencedCheckpointStore,
    ) {
        let pid = &self.pid;
        // A rewind takes over a drain begun for another reason too: its checkpoint is what
        // the partition's next reader must start from.
        if !matches!(self.drain, Some(Drain::Rewind(_))) {
            let waiting = pauses
                .borrow()
                .waiting_rewind(pid)
                .filter(|r| !fence.rewind_done(&r.id))
                .cloned();
            if let Some(r) = waiting {
                tracing::info!(partition = %pid, first = r.first, by = %r.by, "an operator's rewind: stop reading, settle what was read, then rewind the checkpoint");
                self.drain = Some(Drain::Rewind(r));
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
                self.drain = Some(Drain::Gap);
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
        self.received_by_seq.push_back((seq, received));
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
            drain,
            mut ended,
            ..
        } = self;
        // Events still waiting behind their key never started: they stay after the checkpoint.
        debug_assert!(cp
            .last_settled
            .as_ref()
            .and_then(|e| e.sequence_number())
            .is_none_or(|s| dispatcher.oldest_unsettled().is_none_or(|o| s < o)));
        match &drain {
            Some(Drain::Stop | Drain::GivenUp | Drain::StreamEnded | Drain::Gap) | None => {
                cp.flush(writing, &pc, &shared).await
            }
            Some(Drain::Rewind(r)) => {
                // A write still in flight lands first: it must not land after the rewind's.
                if let Some(w) = writing {
                    cp.finish(w.await, &pid, &shared);
                }
                apply_rewind(&pid, r, &shared, fence).await
            }
        }
        mark_paused(&shared, &pid, None);
        shared.health.unset_owned(&pid);
        ended.closed = match Arc::try_unwrap(pc) {
            Ok(pc) => match tokio::time::timeout(shared.options.deadline, pc.close()).await {
                Ok(Ok(())) => true,
                Ok(Err(e)) => {
                    tracing::warn!(partition = %pid, error = %e, "closing the partition client failed");
                    false
                }
                Err(_) => {
                    tracing::warn!(partition = %pid, "closing the partition client timed out");
                    false
                }
            },
            Err(_) => {
                tracing::warn!(partition = %pid, "partition client still shared; cannot give it back cleanly");
                false
            }
        };
        tracing::info!(partition = %pid, why = ?drain, "partition released");
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
