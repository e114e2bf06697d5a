//! Samples the backlog (`telemetry::backlog`) every `backlog_every`: per partition the last
//! enqueued sequence number (the SDK's partition properties) against the checkpoint (the
//! checkpoint store's listing, every replica's), the retries the ledger lists as due, and
//! with ordered retries the parked events. Every replica samples the whole deployment, so
//! KEDA may ask any of them. A failed sample keeps the last one (and says so in the log):
//! the backlog is for scaling, never for the guarantee.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use azure_messaging_eventhubs::{CheckpointStore, ConsumerClient};
use tokio_util::sync::CancellationToken;

use super::EventHubsTarget;
use crate::clock::Clock;
use crate::ledger::Ledger;
use crate::telemetry::backlog::{unread, Backlog, BacklogCell, BacklogGauge};

/// What the sampler reads and how.
pub(crate) struct Sampler {
    pub(crate) target: EventHubsTarget,
    /// The checkpoint store as built (not the fenced one: a listing here fences nothing).
    pub(crate) checkpoints: Arc<dyn CheckpointStore + Send + Sync>,
    pub(crate) ledger: Ledger,
    pub(crate) clock: Arc<Clock>,
    /// Ordered retries are on: list the parked events too.
    pub(crate) lines: bool,
    pub(crate) start_at_latest: bool,
    pub(crate) deadline: Duration,
    pub(crate) every: Duration,
    pub(crate) application_id: String,
    pub(crate) cell: BacklogCell,
}

impl Sampler {
    /// The sampler for the pipeline built from `parts`.
    pub(crate) fn new(parts: &super::PipelineParts) -> Self {
        let o = &parts.options;
        Self {
            target: parts.eventhubs.clone(),
            checkpoints: parts.checkpoint_store.clone(),
            ledger: Ledger::new(
                parts.records.clone(),
                &parts.eventhubs.hub,
                &parts.eventhubs.consumer_group,
            ),
            clock: o.clock.clone(),
            lines: o.retry_ordering.lines().is_some(),
            start_at_latest: o.start_at_latest,
            deadline: o.deadline,
            every: o.backlog_every,
            application_id: format!("{}-backlog", o.owner_id),
            cell: BacklogCell::default(),
        }
    }

    /// Samples until `stop` fires, serving the gauge meanwhile.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let _gauge = BacklogGauge::register(self.cell.clone());
        let mut consumer: Option<ConsumerClient> = None;
        loop {
            if consumer.is_none() {
                consumer = self.open().await.map_err(|e| self.failed(&e)).ok();
            }
            if let Some(c) = &consumer {
                match self.sample(c).await {
                    Ok(b) => self.cell.set(b),
                    Err(e) => {
                        self.failed(&e);
                        // A fresh connection next time.
                        if let Some(c) = consumer.take() {
                            let _ = tokio::time::timeout(self.deadline, c.close()).await;
                        }
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(self.every) => {}
            }
        }
        if let Some(c) = consumer {
            let _ = tokio::time::timeout(self.deadline, c.close()).await;
        }
    }

    fn failed(&self, e: &str) {
        tracing::warn!(error = %crate::redact::redact(e), "cannot sample the backlog; keeping the last sample");
    }

    async fn open(&self) -> Result<ConsumerClient, String> {
        let t = &self.target;
        let mut builder = ConsumerClient::builder()
            .with_application_id(self.application_id.clone())
            .with_consumer_group(t.consumer_group.clone());
        if let Some(e) = &t.custom_endpoint {
            builder = builder.with_custom_endpoint(e.clone());
        }
        self.timed(
            "opening the Event Hubs consumer",
            t.auth.open_consumer(builder, &t.namespace, &t.hub),
        )
        .await
    }

    async fn timed<T, E: std::fmt::Display>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, String> {
        tokio::time::timeout(self.deadline, call)
            .await
            .map_err(|_| format!("{what} timed out after {:?}", self.deadline))?
            .map_err(|e| format!("{what}: {e}"))
    }

    async fn sample(&self, consumer: &ConsumerClient) -> Result<Backlog, String> {
        let t = &self.target;
        let hub = self
            .timed(
                "reading the hub's properties",
                consumer.get_eventhub_properties(),
            )
            .await?;
        let checkpoints: BTreeMap<String, i64> = self
            .timed(
                "listing the checkpoints",
                self.checkpoints.list_checkpoints(
                    &checkpoint_namespace(&t.namespace),
                    &t.hub,
                    &t.consumer_group,
                ),
            )
            .await?
            .into_iter()
            .filter_map(|c| c.sequence_number.map(|s| (c.partition_id, s)))
            .collect();
        let mut unread_by_partition = BTreeMap::new();
        for p in &hub.partition_ids {
            let props = self
                .timed(
                    &format!("reading partition {p}'s properties"),
                    consumer.get_partition_properties(p),
                )
                .await?;
            let n = unread(
                props.beginning_sequence_number,
                props.last_enqueued_sequence_number,
                props.is_empty,
                checkpoints.get(p).copied(),
                self.start_at_latest,
            );
            unread_by_partition.insert(p.clone(), n);
        }
        let now = self.clock.now();
        let pending = self
            .timed("listing the pending retries", self.ledger.pending())
            .await?;
        let retries_due = pending.iter().filter(|r| r.due <= now).count() as u64;
        let parked = if self.lines {
            self.timed("listing the parked events", self.ledger.all_parked())
                .await?
                .len() as u64
        } else {
            0
        };
        Ok(Backlog {
            unread_by_partition,
            retries_due,
            retries_waiting: pending.len() as u64 - retries_due,
            parked,
            sampled_at: now,
        })
    }
}

/// A token cancelled when either `a` or `b` is.
pub(crate) fn either(a: &CancellationToken, b: &CancellationToken) -> CancellationToken {
    let stop = CancellationToken::new();
    let (a, b, s) = (a.clone(), b.clone(), stop.clone());
    tokio::spawn(async move {
        tokio::select! { _ = a.cancelled() => {}, _ = b.cancelled() => {} }
        s.cancel();
    });
    stop
}

/// The namespace as the SDK's processor names checkpoints: the host of `amqps://{namespace}`
/// (as `rewind::checkpoint_namespace`, which exists only with the command line).
fn checkpoint_namespace(namespace: &str) -> String {
    url::Url::parse(&format!("amqps://{namespace}/"))
        .ok()
        .and_then(|u| u.host_str().map(str::to_string))
        .unwrap_or_else(|| namespace.to_string())
}
