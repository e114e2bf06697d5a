//! The threads a replica's consumer runs on.
//!
//! The SDK's partition streams are not `Send`, so a partition task runs on one thread from
//! its claim to its release: a current-thread runtime with a `LocalSet`. One such thread for
//! every partition of a replica would cap the replica at one core — and with batches, one
//! core is what a replica's partitions need at ~15,000 events/s — so a replica has a pool of
//! them, by default one per core (`PipelineOptions::partition_threads`). The SDK's event
//! processor and the Event Hubs connection it opens run on the first; each claimed
//! partition goes to the thread with the fewest tasks (the processor counts as one). The
//! `PartitionClient` (which is `Send`) is handed over by the processor; its stream is
//! created and polled on the partition's thread.
//!
//! The threads live as long as the pipeline, not as long as a partition: what the SDK spawns
//! while a partition reads (a session or a link re-attached after a lost connection) runs on
//! the runtime of the thread that asked for it, and must outlive that partition. When the
//! pipeline stops the threads end; a crash ends them at once, dropping every task on them
//! without closing or writing anything, as a killed process would.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// What a partition's thread is handed: it builds the (`!Send`) task there.
type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// A pool of partition threads (see the module's docs).
pub(crate) struct PartitionThreads {
    workers: Vec<Worker>,
    /// Fired by [`close`](Self::close).
    closing: CancellationToken,
    ended: std::sync::Mutex<Vec<oneshot::Receiver<()>>>,
}

struct Worker {
    jobs: mpsc::UnboundedSender<Job>,
    /// Partition tasks on this thread now.
    load: Arc<AtomicUsize>,
}

impl PartitionThreads {
    /// Starts `n` threads (at least one), named `name`, each with its runtime; `crash` ends
    /// them at once.
    pub(crate) fn start(n: usize, name: &str, crash: CancellationToken) -> std::io::Result<Self> {
        let mut workers = Vec::new();
        let mut ended = Vec::new();
        let closing = CancellationToken::new();
        for _ in 0..n.max(1) {
            let (jobs, rx) = mpsc::unbounded_channel::<Job>();
            let (done_tx, done_rx) = oneshot::channel();
            // Built here, so a runtime that cannot be built fails the start, naming why,
            // instead of leaving a thread that drops every partition handed to it.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (crash, closing) = (crash.clone(), closing.clone());
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    serve(rt, rx, closing, crash);
                    let _ = done_tx.send(());
                })?;
            workers.push(Worker {
                jobs,
                load: Arc::default(),
            });
            ended.push(done_rx);
        }
        Ok(Self {
            workers,
            closing,
            ended: std::sync::Mutex::new(ended),
        })
    }

    /// Runs the future `make` builds on the thread with the fewest tasks; the receiver
    /// answers when it has ended (or is dropped unanswered if its thread ended first: a
    /// crash, the pool closed, or a thread that could not build its runtime).
    pub(crate) fn spawn<F, Fut>(&self, make: F) -> oneshot::Receiver<()>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let fewest = self
            .workers
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| w.load.load(Ordering::Relaxed))
            .map_or(0, |(i, _)| i);
        self.spawn_on(fewest, make)
    }

    /// [`spawn`](Self::spawn) on the first thread: the processor's, which counts as one
    /// task there, so with a thread per core the first partitions go to the others.
    pub(crate) fn spawn_first<F, Fut>(&self, make: F) -> oneshot::Receiver<()>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        self.spawn_on(0, make)
    }

    fn spawn_on<F, Fut>(&self, index: usize, make: F) -> oneshot::Receiver<()>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let Some(worker) = self.workers.get(index) else {
            return rx;
        };
        worker.load.fetch_add(1, Ordering::Relaxed);
        // Counted down however the task ends, dropped unrun included.
        let guard = Unload(worker.load.clone());
        let job: Job = Box::new(move || {
            Box::pin(async move {
                let _guard = guard;
                make().await;
                let _ = tx.send(());
            })
        });
        // Refused once the thread has ended: the job (and its sender) is dropped with the
        // error, and `rx` answers that it never ran.
        let _ = worker.jobs.send(job);
        rx
    }

    /// Ends the threads, dropping the tasks still on them (the pipeline has waited for its
    /// partitions first, within its deadlines); a task handed over after this is dropped
    /// unrun.
    pub(crate) async fn close(&self) {
        self.closing.cancel();
        let ended = std::mem::take(&mut *self.ended.lock().unwrap_or_else(|e| e.into_inner()));
        for thread in ended {
            let _ = thread.await;
        }
    }
}

/// Counts a partition task off its thread's load when dropped.
struct Unload(Arc<AtomicUsize>);

impl Drop for Unload {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One thread: runs every job it is handed on `rt` until the pool is closed or `crash`
/// fires.
fn serve(
    rt: tokio::runtime::Runtime,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    closing: CancellationToken,
    crash: CancellationToken,
) {
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        loop {
            tokio::select! {
                biased;
                _ = crash.cancelled() => return,
                // The pipeline has waited for its partitions, within its deadlines: what is
                // left is dropped, as a crash drops everything.
                _ = closing.cancelled() => return,
                job = jobs.recv() => match job {
                    // Detached: its end is answered through the job's own channel.
                    Some(job) => {
                        tokio::task::spawn_local(job());
                    }
                    None => return,
                },
            }
        }
    });
    // Dropping the runtime drops every task left: nothing is closed or written.
    rt.shutdown_background();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_task_goes_to_the_thread_with_the_fewest_and_runs_there() {
        let pool = PartitionThreads::start(2, "hubguard-test-pool", CancellationToken::new())
            .expect("threads start");
        let (hold_tx, hold_rx) = tokio::sync::watch::channel(false);
        let mut names = Vec::new();
        let mut ended = Vec::new();
        for _ in 0..4 {
            let (name_tx, name_rx) = oneshot::channel();
            let mut hold = hold_rx.clone();
            ended.push(pool.spawn(move || async move {
                // A `!Send` value held across an await: this future only runs on one thread.
                let here = std::rc::Rc::new(std::thread::current().id());
                let _ = name_tx.send(*here);
                let _ = hold.wait_for(|go| *go).await;
                drop(here);
            }));
            names.push(name_rx.await.expect("the task ran"));
        }
        // Two on each thread, taken in turn while all four are running.
        assert_ne!(names[0], names[1]);
        assert_eq!(names.iter().filter(|n| **n == names[0]).count(), 2);
        assert_ne!(names[0], std::thread::current().id());
        hold_tx.send(true).expect("tasks wait");
        for e in ended {
            e.await.expect("each task ends and says so");
        }
        pool.close().await;
    }

    #[tokio::test]
    async fn a_crash_drops_every_task_at_once() {
        let crash = CancellationToken::new();
        let pool =
            PartitionThreads::start(1, "hubguard-test-pool", crash.clone()).expect("threads start");
        let (started_tx, started_rx) = oneshot::channel();
        let ended = pool.spawn(move || async move {
            let _ = started_tx.send(());
            std::future::pending::<()>().await;
        });
        started_rx.await.expect("the task started");
        crash.cancel();
        assert!(ended.await.is_err(), "a crashed task never says it ended");
        pool.close().await;
        // A task handed to a crashed pool is dropped, not run.
        let crashed = PartitionThreads::start(1, "hubguard-test-pool", crash).expect("start");
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        let _ = crashed
            .spawn(move || async move {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .await;
        crashed.close().await;
        assert_eq!(ran.load(Ordering::SeqCst), 0);
    }
}
