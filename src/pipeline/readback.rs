//! Reading one event back from Event Hubs by its position: how a retry whose ledger record
//! was removed by hand is recovered. The retry message is a claim check (the ledger holds the
//! event), so without the record only Event Hubs still has the event — while the hub's
//! retention keeps it (events older than the retention period are removed: "Event
//! retention", https://learn.microsoft.com/azure/event-hubs/event-hubs-features#event-retention;
//! the partition's beginning sequence number then moves past them).
//!
//! The partition may be read by this deployment's own processor at the same moment. Its
//! receivers carry owner level 0, and Event Hubs refuses a receiver without an owner level
//! while one with an owner level is connected, and lets one with an equal or higher level
//! take over ("Event Hubs Receiver Epoch",
//! https://learn.microsoft.com/archive/blogs/gyan/event-hubs-receiver-epoch; the .NET
//! `EventHubClient.CreateEpochReceiver` reference states the same rules). So the
//! reader first tries without one and, refused, reads with owner level 0: the processor's
//! receiver is detached (`amqp:link:stolen`), its partition is handed out again at the next
//! load-balancing cycle and resumes from its checkpoint (events after it may be delivered
//! again: at least once, never lost). This only happens for a record removed by hand.

use std::time::Duration;

use async_trait::async_trait;
use azure_messaging_eventhubs::models::ReceivedEventData;
use azure_messaging_eventhubs::{
    ConsumerClient, OpenReceiverOptions, StartLocation, StartPosition,
};
use futures::StreamExt as _;

use super::EventHubsTarget;
use crate::event::{Event, IdentityConfig};

/// What reading an event back found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadBack {
    /// The event at the position.
    Found(Box<Event>),
    /// Nothing is there any more (past the hub's retention, or never was): why.
    Gone(String),
}

/// Reads an event back from Event Hubs. `Err` when Event Hubs could not be asked (try again
/// later); [`ReadBack::Gone`] when it answered that the event is not there.
#[async_trait]
pub trait EventReader: Send + Sync {
    /// The event at `sequence_number` of `partition`.
    async fn read(&self, partition: &str, sequence_number: i64) -> Result<ReadBack, String>;
}

/// [`EventReader`] on the Event Hubs SDK: a consumer opened for the read and closed after.
pub(crate) struct SdkEventReader {
    pub(crate) target: EventHubsTarget,
    pub(crate) identity: IdentityConfig,
    pub(crate) deadline: Duration,
    pub(crate) application_id: String,
}

/// The first event of `partition` at `location` (inclusive), read by a receiver opened for
/// it and closed after. Tried without an owner level first; refused while the processor's
/// receiver (owner level 0) is connected, it reads with owner level 0 (see the module's
/// documentation for what that does to the processor's reader).
pub(crate) async fn first_event_at(
    consumer: &ConsumerClient,
    partition: &str,
    location: StartLocation,
    deadline: Duration,
) -> Result<ReceivedEventData, String> {
    let mut last_error = String::new();
    for owner_level in [None, Some(0)] {
        let opened = tokio::time::timeout(
            deadline,
            consumer.open_receiver_on_partition(
                partition.to_string(),
                Some(OpenReceiverOptions {
                    owner_level,
                    prefetch: Some(1),
                    start_position: Some(StartPosition {
                        location: location.clone(),
                        inclusive: true,
                    }),
                    receive_timeout: None,
                }),
            ),
        )
        .await;
        let receiver = match opened {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                last_error = format!("opening a receiver: {e}");
                continue;
            }
            Err(_) => {
                last_error = format!("opening a receiver timed out after {deadline:?}");
                continue;
            }
        };
        let first = {
            let stream = receiver.stream_events();
            futures::pin_mut!(stream);
            tokio::time::timeout(deadline, stream.next()).await
        };
        let _ = tokio::time::timeout(deadline, receiver.close()).await;
        match first {
            Ok(Some(Ok(received))) => return Ok(received),
            Ok(Some(Err(e))) => last_error = format!("receiving: {e}"),
            Ok(None) => last_error = "the receiver ended without an event".into(),
            Err(_) => last_error = format!("no event within {deadline:?}"),
        }
    }
    Err(last_error)
}

#[async_trait]
impl EventReader for SdkEventReader {
    async fn read(&self, partition: &str, sequence_number: i64) -> Result<ReadBack, String> {
        let t = &self.target;
        let mut builder = ConsumerClient::builder()
            .with_application_id(self.application_id.clone())
            .with_consumer_group(t.consumer_group.clone());
        if let Some(e) = &t.custom_endpoint {
            builder = builder.with_custom_endpoint(e.clone());
        }
        let consumer = tokio::time::timeout(
            self.deadline,
            t.auth.open_consumer(builder, &t.namespace, &t.hub),
        )
        .await
        .map_err(|_| {
            format!(
                "opening the Event Hubs consumer timed out after {:?}",
                self.deadline
            )
        })?
        .map_err(|e| format!("opening the Event Hubs consumer: {e}"))?;
        let read = async {
            let props =
                tokio::time::timeout(self.deadline, consumer.get_partition_properties(partition))
                    .await
                    .map_err(|_| format!("reading partition {partition}'s properties timed out"))?
                    .map_err(|e| format!("reading partition {partition}'s properties: {e}"))?;
            if props.is_empty
                || sequence_number < props.beginning_sequence_number
                || sequence_number > props.last_enqueued_sequence_number
            {
                return Ok(ReadBack::Gone(format!(
                    "partition {partition} keeps sequence numbers {} to {}; {sequence_number} is past the hub's retention",
                    props.beginning_sequence_number, props.last_enqueued_sequence_number
                )));
            }
            let received = first_event_at(
                &consumer,
                partition,
                StartLocation::SequenceNumber(sequence_number),
                self.deadline,
            )
            .await?;
            let event = self.identity.event(&self.target.hub, partition, &received);
            if event.sequence_number != sequence_number {
                return Ok(ReadBack::Gone(format!(
                    "partition {partition} begins at sequence number {} now; {sequence_number} is past the hub's retention",
                    event.sequence_number
                )));
            }
            Ok(ReadBack::Found(Box::new(event)))
        };
        let result = read.await;
        let _ = tokio::time::timeout(self.deadline, consumer.close()).await;
        result
    }
}
