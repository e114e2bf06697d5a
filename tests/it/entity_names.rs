//! Service Bus entity names compared as Azure compares them: case-insensitively ("Always
//! perform a case-insensitive comparison of names",
//! <https://learn.microsoft.com/azure/azure-resource-manager/management/resource-name-rules#microsoftservicebus>).
//! The emulator, through the real `azure_messaging_servicebus` crate, holds one queue under
//! any spelling; the configuration refuses a dead-letter queue that is the retry queue under
//! another spelling.

use std::time::{Duration, SystemTime};

use hubguard::azure::retry_queue::ServiceBusOptions;
use hubguard::azure::{ConnectionString, OutgoingMessage, RetryQueue, ServiceBusRetryQueue};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};

use crate::common::within;

fn client(emu: &ServiceBusEmulator, queue: &str) -> ServiceBusRetryQueue {
    let cs: ConnectionString = emu.connection_string().parse().unwrap();
    ServiceBusRetryQueue::new(
        &cs,
        queue,
        ServiceBusOptions {
            deadline: Duration::from_secs(5),
        },
    )
    .unwrap()
}

#[tokio::test]
async fn one_queue_under_any_spelling_and_the_dead_letter_queue_is_never_the_retry_queue() {
    let emu = ServiceBusEmulator::start(ServiceBusConfig {
        queues: vec![QueueSpec::new("retries")],
        ..Default::default()
    })
    .await
    .unwrap();
    within(
        "send to RETRIES",
        client(&emu, "RETRIES").schedule(OutgoingMessage {
            message_id: "m-1".into(),
            correlation_id: None,
            label: None,
            body: "{}".into(),
            content_type: None,
            due: SystemTime::now(),
            time_to_live: None,
            properties: Vec::new(),
        }),
    )
    .await
    .unwrap();
    let m = within(
        "receive from Retries",
        client(&emu, "Retries").receive(Duration::from_secs(2)),
    )
    .await
    .unwrap()
    .expect("the message sent to RETRIES");
    assert_eq!(m.message_id, "m-1");
    within("complete", m.complete()).await.unwrap();
    assert_eq!(emu.counters("retries").unwrap().completes, 1);

    // So a dead-letter queue spelt differently is the retry queue, and start-up says so.
    let base = format!(
        "[eventhubs]\nconnection_string = \"Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=k;SharedAccessKey=a2V5;UseDevelopmentEmulator=true\"\nhub = \"hub\"\n\
         [servicebus]\nconnection_string = \"{}\"\nqueue = \"retries\"\n\
         [storage]\ncontainer_url = \"http://127.0.0.1:10000/devstoreaccount1/hubguard\"\n\
         [handler]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9000/events\"\n",
        emu.connection_string()
    );
    for dead in ["RETRIES", "Retries/$DeadLetterQueue"] {
        let e = hubguard::config::Config::parse(
            &format!("{base}[dead_letters]\nqueue = \"{dead}\"\n"),
            Vec::new(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("dead_letters.queue"), "{dead}: {e}");
        assert!(!e.contains("SharedAccessKey="), "{dead}: {e}");
    }
    emu.shutdown().await;
}
