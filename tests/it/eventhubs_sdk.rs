//! The Event Hubs emulator through the real `azure_messaging_eventhubs` 0.16 clients.

use std::sync::Arc;
use std::time::{Duration, Instant};

use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
use azure_messaging_eventhubs::{
    ConsumerClient, EventDataBatchOptions, ProducerClient, SendEventOptions, StartLocation,
};
use hubguard::azure::SasKey;
use hubguard::emulator::eventhubs::{EventHubsConfig, HubSpec};

use crate::common::*;

fn event(body: &str) -> EventData {
    EventData::builder()
        .with_body(body.as_bytes().to_vec())
        .build()
}

async fn send_batch(
    p: &ProducerClient,
    bodies: &[String],
    partition: Option<&str>,
    key: Option<&str>,
) {
    let batch = within(
        "create batch",
        p.create_batch(Some(EventDataBatchOptions {
            partition_id: partition.map(String::from),
            partition_key: key.map(String::from),
            ..Default::default()
        })),
    )
    .await
    .expect("batch");
    for b in bodies {
        assert!(
            batch.try_add_event_data(event(b), None).unwrap(),
            "event fits"
        );
    }
    within("send batch", p.send_batch(batch, None))
        .await
        .expect("batch accepted");
}

#[tokio::test]
async fn management_reports_hub_and_partition_properties() {
    let emu = emulator(&[("orders", 3)]).await;
    let cs = conn(&emu);
    let c = consumer(&cs, "orders").await;
    let hub = within("hub props", c.get_eventhub_properties())
        .await
        .unwrap();
    assert_eq!(hub.name, "orders");
    assert_eq!(hub.partition_ids, vec!["0", "1", "2"]);
    let p = within("partition props", c.get_partition_properties("1"))
        .await
        .unwrap();
    assert!(p.is_empty);
    assert_eq!(p.last_enqueued_sequence_number, -1);

    let prod = producer(&cs, "orders").await;
    send_batch(&prod, &["a".into(), "b".into()], Some("1"), None).await;
    let p = within("partition props", c.get_partition_properties("1"))
        .await
        .unwrap();
    assert!(!p.is_empty);
    assert_eq!(p.beginning_sequence_number, 0);
    assert_eq!(p.last_enqueued_sequence_number, 1);
    let stored = emu.store().hub("orders").unwrap().partitions[1].events_from(1, 1);
    assert_eq!(p.last_enqueued_offset, stored[0].offset.to_string());
    within("close producer", prod.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
}

#[tokio::test]
async fn single_and_batched_sends_arrive_complete_in_order_with_annotations() {
    let emu = emulator(&[("hub", 4)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;

    // Single events to an explicit partition, with properties and a content type.
    for i in 0..5 {
        let ev = EventData::builder()
            .with_body(format!("single-{i}").into_bytes())
            .with_content_type("application/json".into())
            .with_message_id(format!("mid-{i}"))
            .add_property("n".into(), AmqpSimpleValue::Int(i))
            .add_property("who".into(), AmqpSimpleValue::String("test".into()))
            .build();
        within(
            "send event",
            prod.send_event(
                ev,
                Some(SendEventOptions {
                    partition_id: Some("2".into()),
                }),
            ),
        )
        .await
        .expect("event accepted");
    }
    // A batch to an explicit partition.
    let batch: Vec<String> = (0..50).map(|i| format!("batch-{i}")).collect();
    send_batch(&prod, &batch, Some("2"), None).await;
    // A batch with a partition key goes to one partition, key annotated.
    let keyed: Vec<String> = (0..20).map(|i| format!("keyed-{i}")).collect();
    send_batch(&prod, &keyed, None, Some("customer-42")).await;
    send_batch(&prod, &keyed, None, Some("customer-42")).await;

    let c = consumer(&cs, "hub").await;
    let r = receiver(&c, "2", StartLocation::Earliest, false).await;
    let got = take(&r, 55).await;
    for (i, ev) in got.iter().enumerate() {
        assert_eq!(ev.sequence_number(), Some(i as i64));
        assert!(ev.offset().as_deref().unwrap().parse::<i64>().is_ok());
        assert!(ev.enqueued_time().is_some());
    }
    assert_eq!(body(&got[0]), "single-0");
    assert_eq!(got[0].event_data().content_type(), Some("application/json"));
    let props = got[3].event_data().properties().unwrap();
    assert_eq!(props.get("n"), Some(&AmqpSimpleValue::Int(3)));
    assert_eq!(
        props.get("who"),
        Some(&AmqpSimpleValue::String("test".into()))
    );
    let bodies: Vec<String> = got[5..].iter().map(body).collect();
    assert_eq!(bodies, batch);
    // Offsets strictly increase and differ from sequence numbers (they are byte positions).
    assert!(got.windows(2).all(|w| {
        w[0].offset().as_deref().unwrap().parse::<i64>().unwrap()
            < w[1].offset().as_deref().unwrap().parse::<i64>().unwrap()
    }));
    assert_ne!(got[3].offset().as_deref(), Some("3"));
    within("close receiver", r.close()).await.unwrap();

    // The keyed events all landed, in order, on one partition, with the key annotated.
    let hub = emu.store().hub("hub").unwrap();
    let keyed_partition = (0..4)
        .find(|p| {
            hub.partitions[*p].events_from(0, 100).iter().any(|e| {
                hubguard::emulator::eventhubs::store::partition_key_of(&e.message).as_deref()
                    == Some("customer-42")
            })
        })
        .expect("keyed events stored");
    let r = receiver(
        &c,
        &keyed_partition.to_string(),
        StartLocation::Earliest,
        false,
    )
    .await;
    let total = hub.partitions[keyed_partition].len();
    let got = take(&r, total).await;
    let keyed_got: Vec<_> = got
        .iter()
        .filter(|e| e.partition_key().as_deref() == Some("customer-42"))
        .collect();
    assert_eq!(keyed_got.len(), 40);
    let expected: Vec<String> = keyed.iter().chain(keyed.iter()).cloned().collect();
    assert_eq!(
        keyed_got.iter().map(|e| body(e)).collect::<Vec<_>>(),
        expected
    );
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn hub_level_sends_without_key_spread_round_robin() {
    let emu = emulator(&[("hub", 4)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    for i in 0..8 {
        within("send", prod.send_event(event(&format!("e{i}")), None))
            .await
            .unwrap();
    }
    let hub = emu.store().hub("hub").unwrap();
    let lens: Vec<usize> = hub.partitions.iter().map(|p| p.len()).collect();
    assert_eq!(lens, vec![2, 2, 2, 2]);
    within("close", prod.close()).await.unwrap();
}

#[tokio::test]
async fn every_start_position_inclusive_and_exclusive() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    let bodies: Vec<String> = (0..10).map(|i| format!("ev-{i}")).collect();
    send_batch(&prod, &bodies[..5], Some("0"), None).await;
    // Distinct enqueued times for the time filter: the second batch after the first's.
    let partition = &emu.store().hub("hub").unwrap().partitions[0];
    let first = partition.info().last_enqueued_ms;
    eventually(
        "the clock passes the first batch's enqueued time",
        STEP,
        || async {
            seen(hubguard::clock::ms(std::time::SystemTime::now()), |now| {
                *now > first
            })
        },
    )
    .await;
    send_batch(&prod, &bodies[5..], Some("0"), None).await;
    let stored = emu.store().hub("hub").unwrap().partitions[0].events_from(0, 10);
    let c = consumer(&cs, "hub").await;

    let first_body = |loc: StartLocation, inclusive: bool| {
        let c = &c;
        async move {
            let r = receiver(c, "0", loc, inclusive).await;
            let ev = take(&r, 1).await;
            within("close receiver", r.close()).await.unwrap();
            body(&ev[0])
        }
    };
    assert_eq!(first_body(StartLocation::Earliest, false).await, "ev-0");
    assert_eq!(
        first_body(StartLocation::SequenceNumber(3), false).await,
        "ev-4"
    );
    assert_eq!(
        first_body(StartLocation::SequenceNumber(3), true).await,
        "ev-3"
    );
    let off = stored[6].offset.to_string();
    assert_eq!(
        first_body(StartLocation::Offset(off.clone()), false).await,
        "ev-7"
    );
    assert_eq!(first_body(StartLocation::Offset(off), true).await, "ev-6");
    let t5 = std::time::UNIX_EPOCH + Duration::from_millis(stored[5].enqueued_ms as u64);
    assert_eq!(
        first_body(StartLocation::EnqueuedTime(t5), true).await,
        "ev-5"
    );
    let t4 = std::time::UNIX_EPOCH + Duration::from_millis(stored[4].enqueued_ms as u64);
    assert_eq!(
        first_body(StartLocation::EnqueuedTime(t4), false).await,
        "ev-5"
    );

    // Latest: only events enqueued after the receiver attached (live tailing).
    let r = receiver(&c, "0", StartLocation::Latest, false).await;
    // The link attaches lazily on the first read; give it a moment by reading concurrently.
    let reader = async { take(&r, 2).await };
    let writer = async {
        // Wait until the receiver is attached before sending.
        let hub = emu.store().hub("hub").unwrap();
        eventually("the receiver attached", STEP, || async {
            hub.receiver_count("$Default", 0) > 0
        })
        .await;
        send_batch(&prod, &["live-1".into(), "live-2".into()], Some("0"), None).await;
    };
    let (got, ()) = tokio::join!(reader, writer);
    assert_eq!(
        got.iter().map(body).collect::<Vec<_>>(),
        vec!["live-1", "live-2"]
    );
    assert_eq!(got[0].sequence_number(), Some(10));
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn wrong_sas_key_is_refused_with_a_clear_error() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let mut bad = cs.clone();
    bad.key = SasKey::new(cs.key.name(), "not-the-key");
    let c = within("open", bad.open_consumer(ConsumerClient::builder(), "hub")).await;
    let err = match c {
        Err(e) => format!("{e:?}"),
        Ok(c) => {
            let r = within("properties", c.get_eventhub_properties()).await;
            let e = r.expect_err("a wrong key must be refused");
            let mut chain = format!("{e:?}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                chain.push_str(&format!(" <- {s:?}"));
                src = s.source();
            }
            let e = chain;
            // The SDK's close after a refused token may itself report the broken link.
            let _ = within("close", c.close()).await;
            e
        }
    };
    assert!(err.contains("401"), "error should carry status 401: {err}");
    assert!(
        !err.contains("not-the-key"),
        "the key never appears in errors"
    );

    // A token for another hub is refused too (wrong audience): see
    // eventhubs_amqp::cbs_token_types_and_audiences_are_checked_as_azure_does.
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 0);
}

#[tokio::test]
async fn unknown_hub_and_partition_are_not_found() {
    let emu = emulator_with(EventHubsConfig {
        hubs: vec![HubSpec::new("hub", 2)],
        ..Default::default()
    })
    .await;
    let cs = conn(&emu);
    let c = consumer(&cs, "hub").await;
    let err = within("partition 7", c.get_partition_properties("7"))
        .await
        .unwrap_err();
    assert!(format!("{err:?}").contains("404"), "{err:?}");
    let r = within(
        "open receiver on 7",
        c.open_receiver_on_partition("7".into(), None),
    )
    .await;
    let failed = match r {
        Err(e) => format!("{e:?}"),
        Ok(r) => {
            let stream = r.stream_events();
            futures::pin_mut!(stream);
            let e = within("read from 7", futures::StreamExt::next(&mut stream)).await;
            format!("{e:?}")
        }
    };
    assert!(
        failed.to_lowercase().contains("not-found")
            || failed.contains("NotFound")
            || failed.contains("could not be found"),
        "{failed}"
    );
    within("close", c.close()).await.unwrap();

    let nohub = consumer(&cs, "nohub").await;
    let err = within("props of unknown hub", nohub.get_eventhub_properties())
        .await
        .unwrap_err();
    assert!(format!("{err:?}").contains("404"), "{err:?}");
    within("close", nohub.close()).await.unwrap();

    let unknown_cg = consumer_in(&cs, "hub", Some("nobody")).await;
    let r = within(
        "open receiver in unknown group",
        unknown_cg.open_receiver_on_partition("0".into(), None),
    )
    .await;
    let failed = match r {
        Err(e) => format!("{e:?}"),
        Ok(r) => {
            let stream = r.stream_events();
            futures::pin_mut!(stream);
            format!(
                "{:?}",
                within("read", futures::StreamExt::next(&mut stream)).await
            )
        }
    };
    assert!(
        failed.contains("could not be found")
            || failed.to_lowercase().contains("not-found")
            || failed.contains("NotFound"),
        "{failed}"
    );
    within("close", unknown_cg.close()).await.unwrap();
}

#[tokio::test]
async fn restart_on_the_same_data_dir_keeps_events_and_sequence_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let config = || EventHubsConfig {
        hubs: vec![HubSpec::new("hub", 2)],
        data_dir: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let emu = emulator_with(config()).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    let bodies: Vec<String> = (0..30).map(|i| format!("durable-{i}")).collect();
    send_batch(&prod, &bodies, Some("1"), None).await;
    within("close", prod.close()).await.unwrap();
    emu.shutdown().await;

    let emu = emulator_with(config()).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    send_batch(&prod, &["after-restart".into()], Some("1"), None).await;
    let c = consumer(&cs, "hub").await;
    let r = receiver(&c, "1", StartLocation::Earliest, false).await;
    let got = take(&r, 31).await;
    let mut expected = bodies.clone();
    expected.push("after-restart".into());
    assert_eq!(got.iter().map(body).collect::<Vec<_>>(), expected);
    assert_eq!(
        got.iter()
            .map(|e| e.sequence_number().unwrap())
            .collect::<Vec<_>>(),
        (0..31).collect::<Vec<_>>()
    );
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
    within("close producer", prod.close()).await.unwrap();
}

fn distinct(got: &[azure_messaging_eventhubs::models::ReceivedEventData]) -> usize {
    got.iter()
        .filter_map(|e| e.sequence_number())
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

#[tokio::test]
async fn dropped_connections_mid_stream_lose_and_reorder_nothing_and_replay_from_the_start() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    let bodies: Vec<String> = (0..300).map(|i| format!("ev-{i:03}")).collect();
    send_batch(&prod, &bodies[..100], Some("0"), None).await;
    let c = consumer(&cs, "hub").await;
    let r = receiver(&c, "0", StartLocation::Earliest, false).await;
    let mut got = take(&r, 40).await;
    emu.faults().drop_connections();
    // The producer's next send fails or is answered; the SDK's AMQP client can hang on a
    // dead connection, so (as hubguard does everywhere) each attempt has a deadline, and a
    // producer that misses it is replaced by one on a fresh connection.
    let mut prod = prod;
    let mut replaced = 0;
    loop {
        let attempt = tokio::time::timeout(Duration::from_secs(5), async {
            let batch = prod
                .create_batch(Some(EventDataBatchOptions {
                    partition_id: Some("0".into()),
                    ..Default::default()
                }))
                .await?;
            for b in &bodies[100..] {
                batch.try_add_event_data(event(b), None)?;
            }
            prod.send_batch(batch, None).await
        })
        .await;
        match attempt {
            Ok(Ok(())) => break,
            other => {
                tracing::debug!(?other, "producer attempt after the drop");
                replaced += 1;
                assert!(replaced <= 3, "producer never recovered");
                let _ = tokio::time::timeout(Duration::from_secs(5), prod.close()).await;
                prod = producer(&cs, "hub").await;
            }
        }
    }
    // 0.15 reported the lost connection; 0.16 recovers the connection and re-attaches the
    // receiver at its *original* start position, so the stream replays from there (measured:
    // 0..99, then 0, 1, 2, …). hubguard's partition task drops such re-deliveries by sequence
    // number. If the stream reports an error instead, the consumer resumes after the last
    // event it saw, as the processor does from a checkpoint. Nothing may be missing, skipped
    // or out of order; a repeat may only be a replay from the start position.
    let mut failures = Vec::new();
    {
        let stream = r.stream_events();
        futures::pin_mut!(stream);
        while distinct(&got) < 300 {
            match within("receive after drop", futures::StreamExt::next(&mut stream)).await {
                Some(Ok(ev)) => got.push(ev),
                Some(Err(e)) => {
                    failures.push(format!("{e:?}"));
                    break;
                }
                None => break,
            }
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), r.close()).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), c.close()).await;
    if distinct(&got) < 300 {
        let last = got.last().and_then(|e| e.sequence_number()).unwrap();
        let c2 = consumer(&cs, "hub").await;
        let r2 = receiver(&c2, "0", StartLocation::SequenceNumber(last), false).await;
        got.extend(take(&r2, 299 - last as usize).await);
        within("close receiver", r2.close()).await.unwrap();
        within("close consumer", c2.close()).await.unwrap();
    }
    assert!(
        failures.iter().all(|f| f.contains("Connection")),
        "only the dropped connection is reported: {failures:?}"
    );
    let seqs: Vec<i64> = got.iter().map(|e| e.sequence_number().unwrap()).collect();
    let mut firsts = Vec::new();
    let mut first_bodies = Vec::new();
    for (i, ev) in got.iter().enumerate() {
        let s = seqs[i];
        if i > 0 {
            assert!(
                s == seqs[i - 1] + 1 || s == 0,
                "after {} came {s}: only a replay from the start position may go back",
                seqs[i - 1]
            );
        }
        if !firsts.contains(&s) {
            firsts.push(s);
            first_bodies.push(body(ev));
        }
    }
    assert_eq!(
        firsts,
        (0..300).collect::<Vec<_>>(),
        "every event, in order"
    );
    assert_eq!(first_bodies, bodies);
    assert_eq!(emu.faults().drops(), 1);
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn refused_connections_recover_when_the_period_ends() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    emu.faults()
        .refuse_connections_for(Duration::from_millis(300));
    let started = Instant::now();
    let prod = Wait::new("a producer opens once the refusals end", STEP)
        .every(Duration::from_millis(100))
        .until(|| async {
            within(
                "open while refused",
                cs.open_producer(ProducerClient::builder(), "hub"),
            )
            .await
        })
        .await;
    within("send after refusal", prod.send_event(event("late"), None))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 1);
    within("close", prod.close()).await.unwrap();
}

#[tokio::test]
async fn delayed_responses_slow_but_do_not_break_clients() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let c = consumer(&cs, "hub").await;
    within("warm up", c.get_eventhub_properties())
        .await
        .unwrap();
    emu.faults().set_delay(Duration::from_millis(200));
    let t = Instant::now();
    within("delayed props", c.get_partition_properties("0"))
        .await
        .unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "the delay applies"
    );
    emu.faults().clear();
    within("close", c.close()).await.unwrap();
}

/// Latency is paid per AMQP round trip, not per transfer: a prefetching receiver streams a
/// backlog at loopback speed once its credit is granted, as prefetch does on Azure.
#[tokio::test]
async fn a_prefetching_receiver_pays_latency_per_round_trip_not_per_transfer() {
    use hubguard::emulator::latency::Latency;
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    let bodies: Vec<String> = (0..200).map(|i| format!("e{i}")).collect();
    send_batch(&prod, &bodies, Some("0"), None).await;
    let c = consumer(&cs, "hub").await;
    within("warm up", c.get_eventhub_properties())
        .await
        .unwrap();
    let latency = Duration::from_millis(40);
    emu.faults()
        .set_latency(Latency::fixed(Duration::from_millis(20)), 1);
    emu.faults().set_delay(Duration::from_millis(20));
    // A management round trip pays the latency plus the delay fault.
    let t = Instant::now();
    within("props", c.get_partition_properties("0"))
        .await
        .unwrap();
    assert!(t.elapsed() >= latency, "a round trip waits {latency:?}");
    let t = Instant::now();
    let r = receiver(&c, "0", StartLocation::Earliest, true).await;
    let got = take(&r, 200).await;
    let took = t.elapsed();
    assert_eq!(got.len(), 200);
    assert!(took >= latency, "attach and credit pay the latency");
    // 200 transfers at 40 ms each would take 8 s; a handful of round trips take well under
    // that (under 1 s on a quiet machine; the bound leaves room for a loaded one).
    assert!(
        took < latency * 150,
        "200 prefetched events took {took:?}: latency was paid per transfer"
    );
    emu.faults().clear();
    assert_eq!(emu.faults().delay(), Duration::ZERO);
    assert_eq!(
        emu.faults().round_trip(),
        Duration::from_millis(20),
        "clear keeps the profile"
    );
    within("close", r.close()).await.unwrap();
    within("close", c.close()).await.unwrap();
    within("close", prod.close()).await.unwrap();
}

#[tokio::test]
async fn every_client_closes_promptly() {
    let emu = emulator(&[("hub", 2)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    send_batch(&prod, &["x".into()], Some("0"), None).await;
    let c = consumer(&cs, "hub").await;
    let r_busy = receiver(&c, "0", StartLocation::Earliest, false).await;
    take(&r_busy, 1).await;
    let r_idle = receiver(&c, "1", StartLocation::Latest, false).await;
    let limit = Duration::from_secs(2);
    for (what, fut) in [
        (
            "receiver with events",
            Box::pin(r_busy.close())
                as std::pin::Pin<
                    Box<dyn std::future::Future<Output = azure_messaging_eventhubs::Result<()>>>,
                >,
        ),
        ("idle receiver", Box::pin(r_idle.close())),
        ("consumer", Box::pin(c.close())),
        ("producer", Box::pin(prod.close())),
    ] {
        let t = Instant::now();
        tokio::time::timeout(limit, fut)
            .await
            .unwrap_or_else(|_| panic!("{what} close hung"))
            .unwrap_or_else(|e| panic!("{what} close failed: {e:?}"));
        assert!(t.elapsed() < limit);
    }
}

#[tokio::test]
async fn two_hundred_connect_read_close_cycles_without_a_hang() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    send_batch(
        &prod,
        &["a".into(), "b".into(), "c".into()],
        Some("0"),
        None,
    )
    .await;
    within("close producer", prod.close()).await.unwrap();
    for i in 0..200 {
        let c = consumer(&cs, "hub").await;
        within(
            &format!("cycle {i}: props"),
            c.get_partition_properties("0"),
        )
        .await
        .unwrap_or_else(|e| panic!("cycle {i}: {e:?}"));
        let r = receiver(&c, "0", StartLocation::Earliest, false).await;
        let got = take(&r, 3).await;
        assert_eq!(body(&got[2]), "c", "cycle {i}");
        within(&format!("cycle {i}: close receiver"), r.close())
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: {e:?}"));
        within(&format!("cycle {i}: close consumer"), c.close())
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: {e:?}"));
    }
}

/// The error and its sources, as text.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut chain = format!("{e:?}");
    let mut src = e.source();
    while let Some(s) = src {
        chain.push_str(&format!(" <- {s:?}"));
        src = s.source();
    }
    chain
}

fn big_body(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

#[tokio::test]
async fn a_one_megabyte_event_round_trips_through_the_sdk() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    let big = big_body(1_000_000);
    // Two large events back to back (multi-frame deliveries in both directions), then a
    // small one: delivery ids and session windows stay consistent after split transfers.
    for _ in 0..2 {
        within(
            "send 1 MB",
            prod.send_event(EventData::builder().with_body(big.clone()).build(), None),
        )
        .await
        .expect("a 1,000,000-byte event is accepted");
    }
    within("send small", prod.send_event(event("after"), None))
        .await
        .unwrap();
    let c = consumer(&cs, "hub").await;
    let r = receiver(&c, "0", StartLocation::Earliest, false).await;
    // `take` fails on the first receive error, so a consumer that had to rebuild its link
    // (the symptom of a frame over its max-frame-size) fails here rather than looping.
    let got = take(&r, 3).await;
    assert_eq!(got[0].event_data().body(), Some(&big[..]));
    assert_eq!(got[1].event_data().body(), Some(&big[..]));
    assert_eq!(body(&got[2]), "after");
    assert_eq!(
        got.iter()
            .map(|e| e.sequence_number().unwrap())
            .collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn the_sdk_reads_a_one_mebibyte_max_message_size_from_the_producer_link() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    let prod = producer(&cs, "hub").await;
    // The batch is sized by the link's advertised max-message-size: 1 MiB.
    let batch = within("create batch", prod.create_batch(None))
        .await
        .unwrap();
    assert!(!batch
        .try_add_event_data(
            EventData::builder().with_body(big_body(1_048_577)).build(),
            None
        )
        .unwrap());
    let batch = within("create batch", prod.create_batch(None))
        .await
        .unwrap();
    // (The SDK counts a batch's first event twice, once for the envelope it copies, so the
    // largest single event it will batch is about half the limit.)
    let added = batch.try_add_event_data(
        EventData::builder().with_body(big_body(500_000)).build(),
        None,
    );
    assert!(added.unwrap(), "size {}", batch.size());
    within("send batch", prod.send_batch(batch, None))
        .await
        .expect("a 500,000-byte batch is accepted");
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 1);
    within("close producer", prod.close()).await.unwrap();
}

#[tokio::test]
async fn server_busy_fault_is_seen_by_the_sdk_as_server_busy() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    // The SDK retries server-busy; a short retry budget makes it give up and report it.
    let quick = || azure_messaging_eventhubs::RetryOptions {
        initial_delay: azure_core::time::Duration::milliseconds(10),
        max_delay: azure_core::time::Duration::milliseconds(50),
        max_total_elapsed: azure_core::time::Duration::seconds(5),
        max_retries: 1,
    };
    let prod = within(
        "open producer",
        cs.open_producer(ProducerClient::builder().with_retry_options(quick()), "hub"),
    )
    .await
    .unwrap();
    within("send before", prod.send_event(event("before"), None))
        .await
        .unwrap();

    emu.faults().server_busy_for(Duration::from_secs(600));
    // A send on the attached link is rejected with the condition.
    let err = within("send while busy", prod.send_event(event("busy"), None))
        .await
        .expect_err("a throttled namespace refuses the send");
    let text = error_chain(&err);
    assert!(
        text.contains("ServerBusy") || text.contains("server-busy"),
        "{text}"
    );
    // A new receiver link is detached with the condition.
    let c = within(
        "open consumer",
        cs.open_consumer(ConsumerClient::builder().with_retry_options(quick()), "hub"),
    )
    .await
    .unwrap();
    let r = receiver(&c, "0", StartLocation::Earliest, false).await;
    let failed = {
        let stream = r.stream_events();
        futures::pin_mut!(stream);
        match within("read while busy", futures::StreamExt::next(&mut stream)).await {
            Some(Err(e)) => error_chain(&e),
            other => panic!("expected a server-busy error, got {other:?}"),
        }
    };
    // 0.15 surfaced the detach's condition. 0.16 recovers the detached link itself (its retry
    // budget here: one retry) and, when the budget runs out, reports the recovery's own
    // failure: measured "Link State Error: Session has dropped" without the condition. Either
    // way the read fails instead of hanging or returning nothing.
    assert!(
        failed.contains("ServerBusy")
            || failed.contains("server-busy")
            || failed.contains("Session has dropped"),
        "{failed}"
    );
    let _ = within("close receiver", r.close()).await;
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 1);

    // Turned off, the same producer and a new receiver work again.
    emu.faults().server_busy_for(Duration::ZERO);
    within("send after", prod.send_event(event("after"), None))
        .await
        .unwrap();
    let r = receiver(&c, "0", StartLocation::Earliest, false).await;
    let got = take(&r, 2).await;
    assert_eq!(
        got.iter().map(body).collect::<Vec<_>>(),
        vec!["before", "after"]
    );
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
    within("close producer", prod.close()).await.unwrap();
}

/// An Entra ID stand-in: a fixed JWT-shaped token (the emulator cannot verify Entra ID
/// signatures; with `--accept-any-token` it takes any `jwt`).
#[derive(Debug)]
struct FakeEntraCredential;

#[async_trait::async_trait]
impl azure_core::credentials::TokenCredential for FakeEntraCredential {
    async fn get_token(
        &self,
        _scopes: &[&str],
        _options: Option<azure_core::credentials::TokenRequestOptions<'_>>,
    ) -> azure_core::Result<azure_core::credentials::AccessToken> {
        Ok(azure_core::credentials::AccessToken::new(
            "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJodHRwczovL2V2ZW50aHVicy5henVyZS5uZXQifQ.c2ln",
            azure_core::time::OffsetDateTime::now_utc() + azure_core::time::Duration::hours(1),
        ))
    }
}

/// 0.15 presented a SAS token from a `TokenCredential` as `jwt`; Azure refuses that, and so
/// does the emulator. 0.16's connection-string path presents it as
/// `servicebus.windows.net:sastoken` and is accepted; an Entra ID credential (`jwt`) is
/// accepted only by an emulator started with `--accept-any-token`.
#[tokio::test]
async fn sas_presented_as_jwt_is_refused_and_the_connection_string_path_is_accepted() {
    let emu = emulator(&[("hub", 1)]).await;
    let cs = conn(&emu);
    // The 0.15 way: hubguard's SasCredential through `open` (CBS type jwt).
    let opened = within(
        "open with a SAS TokenCredential",
        ProducerClient::builder()
            .with_custom_endpoint(cs.custom_endpoint().unwrap())
            .with_retry_options(azure_messaging_eventhubs::RetryOptions {
                max_retries: 0,
                ..Default::default()
            })
            .open(
                &cs.host,
                "hub",
                Arc::new(hubguard::emulator::sas::credential(&cs, Some("hub"))),
            ),
    )
    .await;
    let err = match opened {
        Err(e) => error_chain(&e),
        Ok(p) => {
            let e = within("send", p.send_event(event("x"), None))
                .await
                .expect_err("a SAS token presented as jwt must be refused");
            let _ = within("close", p.close()).await;
            error_chain(&e)
        }
    };
    assert!(err.contains("401"), "refused with 401: {err}");
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 0);

    // The 0.16 connection-string path: accepted.
    let p = producer(&cs, "hub").await;
    within("send", p.send_event(event("via-connection-string"), None))
        .await
        .unwrap();
    within("close", p.close()).await.unwrap();
    assert_eq!(emu.store().hub("hub").unwrap().partitions[0].len(), 1);

    // An Entra ID credential: refused by a strict emulator…
    let entra = hubguard::azure::EventHubsAuth::Credential(Arc::new(FakeEntraCredential));
    let strict = within(
        "open with Entra ID (strict)",
        entra.open_producer(
            ProducerClient::builder()
                .with_custom_endpoint(cs.custom_endpoint().unwrap())
                .with_retry_options(azure_messaging_eventhubs::RetryOptions {
                    max_retries: 0,
                    ..Default::default()
                }),
            &cs.host,
            "hub",
        ),
    )
    .await;
    if let Ok(p) = strict {
        assert!(within("send", p.send_event(event("x"), None))
            .await
            .is_err());
        let _ = within("close", p.close()).await;
    }
    // …and taken by one started with --accept-any-token, end to end.
    let lenient = emulator_with(EventHubsConfig {
        hubs: vec![HubSpec::new("hub", 1)],
        accept_any_token: true,
        ..Default::default()
    })
    .await;
    let lcs = conn(&lenient);
    let endpoint = lcs.custom_endpoint().unwrap();
    let p = within(
        "open producer with Entra ID",
        entra.open_producer(
            ProducerClient::builder().with_custom_endpoint(endpoint.clone()),
            &lcs.host,
            "hub",
        ),
    )
    .await
    .unwrap();
    within("send", p.send_event(event("via-entra"), None))
        .await
        .unwrap();
    let c = within(
        "open consumer with Entra ID",
        entra.open_consumer(
            ConsumerClient::builder().with_custom_endpoint(endpoint),
            &lcs.host,
            "hub",
        ),
    )
    .await
    .unwrap();
    let r = receiver(&c, "0", StartLocation::Earliest, true).await;
    let got = take(&r, 1).await;
    assert_eq!(body(&got[0]), "via-entra");
    within("close receiver", r.close()).await.unwrap();
    within("close consumer", c.close()).await.unwrap();
    within("close producer", p.close()).await.unwrap();
}
