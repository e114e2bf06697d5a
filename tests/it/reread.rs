//! A partition this replica owns is read again, or readiness says why not — after its
//! receiver was taken by another reader (an operator's rewind or a read-back opens one with
//! owner level 0, which detaches the processor's), after a rewind, after anything that ended
//! its task while the replica still held it.

use std::sync::Arc;
use std::time::Duration;

use azure_messaging_eventhubs::{OpenReceiverOptions, StartLocation, StartPosition};
use futures::StreamExt as _;

use crate::common::{consumer, within};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Opens a receiver with owner level 0 on `partition`, as the rewind command and the
/// read-back do: Event Hubs detaches the processor's receiver (`amqp:link:stolen`). Reads one
/// event and closes.
async fn steal(bed: &Bed, partition: &str) {
    let c = consumer(&bed.cs, "hub").await;
    let r = within(
        "the owner-level-0 receiver opens",
        c.open_receiver_on_partition(
            partition.to_string(),
            Some(OpenReceiverOptions {
                owner_level: Some(0),
                prefetch: Some(1),
                start_position: Some(StartPosition {
                    location: StartLocation::Earliest,
                    inclusive: true,
                }),
                receive_timeout: None,
            }),
        ),
    )
    .await
    .unwrap();
    {
        let stream = r.stream_events();
        futures::pin_mut!(stream);
        let first = within("the stealing receiver reads an event", stream.next()).await;
        assert!(matches!(first, Some(Ok(_))), "{first:?}");
    }
    let _ = r.close().await;
    let _ = c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_whose_receiver_was_taken_is_read_again_by_its_owner() {
    let bed = Bed::start(1).await;
    bed.send(0, &[("before", "ok")]).await;
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-a"));
    wait_for("the first event delivered", &run.health, LIMIT, || async {
        handler.delivered_keys().contains("before")
    })
    .await;
    for round in 0..3 {
        steal(&bed, "0").await;
        let key = format!("after-{round}");
        bed.send(0, &[(key.as_str(), "ok")]).await;
        wait_for(
            &format!("{key} delivered: the owner reads its partition again"),
            &run.health,
            LIMIT,
            || async { handler.delivered_keys().contains(&key) },
        )
        .await;
    }
    run.stop().await;
}
