//! Traces and metrics end to end: an event that fails twice and then succeeds, and one that
//! is dead-lettered, run through the pipeline on the emulators with telemetry exported to an
//! in-process OTLP collector. Plus: every name a dashboard or the README uses exists.

use std::sync::Arc;
use std::time::Duration;

use hubguard::ledger::at;
use hubguard::telemetry::names::{attr, metric, outcome, span};

use crate::common::{eventually, seen};
use crate::otlp::{telemetry, Span};
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);
const PRODUCER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

fn attempts_of(spans: &[Span], correlation: &str) -> Vec<Span> {
    let mut v: Vec<Span> = spans
        .iter()
        .filter(|s| {
            s.name == span::ATTEMPT
                && s.attributes.get(attr::CONVERSATION_ID).map(String::as_str) == Some(correlation)
        })
        .cloned()
        .collect();
    v.sort_by_key(|s| {
        s.attributes
            .get(attr::ATTEMPT)
            .and_then(|a| a.parse::<u32>().ok())
    });
    v
}

fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from(at(ms))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attempt_is_a_linked_span_and_metrics_arrive() {
    let t = telemetry();
    let bed = Bed::start(1).await;
    bed.send(0, &[("otel-flaky", "fail:2"), ("otel-dead", "perm")])
        .await;
    // An event whose producer set a trace context: its attempts join the producer's trace.
    {
        use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
        let prod = crate::common::producer(&bed.cs, "hub").await;
        let ev = EventData::builder()
            .with_body(b"ok".to_vec())
            .add_property(
                "ce_id".into(),
                AmqpSimpleValue::String("otel-parented".into()),
            )
            .add_property(
                "traceparent".into(),
                AmqpSimpleValue::String(format!("00-{PRODUCER_TRACE}-00f067aa0ba902b7-01")),
            )
            .build();
        crate::common::within(
            "send",
            prod.send_event(
                ev,
                Some(azure_messaging_eventhubs::SendEventOptions {
                    partition_id: Some("0".into()),
                }),
            ),
        )
        .await
        .unwrap();
        crate::common::within("close", prod.close()).await.unwrap();
    }
    let handler = Arc::new(Scripted::default());
    let run = Bed::run(bed.parts(handler.clone(), fast_policy(5), "replica-otel"));
    let ledger = bed.ledger();
    wait_for(
        "delivered and dead-lettered",
        &run.health,
        LIMIT,
        || async {
            let d = handler.delivered_keys();
            d.contains("otel-flaky")
                && d.contains("otel-parented")
                && ledger
                    .dead_letter_keys()
                    .await
                    .unwrap_or_default()
                    .contains(&"otel-dead".to_string())
        },
    )
    .await;
    run.stop().await;
    t.flush().await;

    let spans = eventually("the attempts' spans", LIMIT, || async {
        t.flush().await;
        let spans = t.collected.lock().unwrap().spans.clone();
        let counts =
            ["otel-flaky", "otel-dead", "otel-parented"].map(|k| (k, attempts_of(&spans, k).len()));
        if counts[0].1 >= 3 && counts[1].1 > 0 && counts[2].1 > 0 {
            Ok(spans)
        } else {
            Err(counts)
        }
    })
    .await;

    // Three attempt spans with one correlation id and the right outcomes.
    let flaky = attempts_of(&spans, "otel-flaky");
    assert_eq!(flaky.len(), 3);
    let outcomes: Vec<&str> = flaky
        .iter()
        .map(|s| s.attributes[attr::OUTCOME].as_str())
        .collect();
    assert_eq!(
        outcomes,
        vec![
            outcome::RETRY_SCHEDULED,
            outcome::RETRY_SCHEDULED,
            outcome::DELIVERED
        ]
    );
    for s in &flaky {
        assert_eq!(s.attributes[attr::MESSAGE_ID], "otel-flaky");
        assert_eq!(s.attributes[attr::MESSAGING_OPERATION_TYPE], "process");
        assert_eq!(s.attributes[attr::MESSAGING_OPERATION_NAME], "process");
        assert_eq!(s.attributes[attr::MESSAGING_CONSUMER_GROUP], "$Default");
        assert!(!s.attributes.contains_key(attr::REPLAY), "{s:?}");
        // Only the documented names: no duplicates, none of tracing's own fields.
        assert_eq!(s.attribute_count, s.attributes.len(), "a duplicate: {s:?}");
        for k in s.attributes.keys() {
            assert!(
                hubguard::telemetry::names::all().contains(&k.as_str()),
                "undocumented attribute {k} on {s:?}"
            );
        }
        assert_eq!(s.attributes[attr::MESSAGING_DESTINATION], "hub");
        assert_eq!(s.attributes[attr::MESSAGING_PARTITION], "0");
        assert_eq!(s.attributes[attr::MAX_ATTEMPTS], "5");
        assert_eq!(s.attributes[attr::TERMINAL], "false");
    }
    assert_eq!(flaky[0].attributes[attr::MESSAGING_SYSTEM], "eventhubs");
    assert_eq!(flaky[1].attributes[attr::MESSAGING_SYSTEM], "servicebus");
    assert_eq!(flaky[2].attributes[attr::MESSAGING_SYSTEM], "servicebus");
    assert_eq!(flaky[0].attributes[attr::ERROR_TYPE], "transient");
    // Links to every earlier attempt.
    let id = |s: &Span| (s.trace_id.clone(), s.span_id.clone());
    assert!(flaky[0].links.is_empty());
    assert_eq!(flaky[1].links, vec![id(&flaky[0])]);
    assert_eq!(flaky[2].links, vec![id(&flaky[0]), id(&flaky[1])]);
    // next_attempt_at equals what the ledger says, and the retry ran at or after it.
    let rec = ledger.record("otel-flaky").await.unwrap().unwrap();
    for i in 0..2 {
        let due_ms = rec.history[i].next_attempt_ms.unwrap();
        assert_eq!(flaky[i].attributes[attr::NEXT_ATTEMPT_AT], rfc3339(due_ms));
        let started_ms = (flaky[i + 1].start_ns / 1_000_000) as i64;
        assert!(
            started_ms + 1 >= due_ms,
            "attempt {} ran before it was due",
            i + 2
        );
        assert!(
            started_ms - due_ms < 3000,
            "attempt {} ran within the emulator's precision of its due time",
            i + 2
        );
    }
    assert_eq!(
        rec.history
            .iter()
            .filter_map(|h| h.trace_id.clone())
            .collect::<Vec<_>>(),
        flaky.iter().map(|s| s.trace_id.clone()).collect::<Vec<_>>()
    );
    // Child spans: the handler call, the Service Bus schedule, the ledger write.
    let children = |parent: &Span, name: &str| {
        spans
            .iter()
            .filter(|s| s.parent_span_id == parent.span_id && s.name == name)
            .count()
    };
    assert_eq!(children(&flaky[0], span::HANDLER), 1);
    assert_eq!(children(&flaky[0], span::SCHEDULE), 1);
    assert_eq!(children(&flaky[0], span::LEDGER_WRITE), 1);
    assert_eq!(children(&flaky[2], span::SCHEDULE), 0);

    // The dead letter is terminal.
    let dead = attempts_of(&spans, "otel-dead");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].attributes[attr::OUTCOME], outcome::DEAD_LETTERED);
    assert_eq!(dead[0].attributes[attr::TERMINAL], "true");
    assert_eq!(dead[0].attributes[attr::ERROR_TYPE], "permanent");
    assert_eq!(dead[0].status_code, 2, "error status");

    // The producer's trace context is taken from the event.
    let parented = attempts_of(&spans, "otel-parented");
    assert_eq!(parented[0].trace_id, PRODUCER_TRACE);
    assert_eq!(parented[0].parent_span_id, "00f067aa0ba902b7");

    // Metrics with the expected names.
    eventually("the metrics, with the expected names", LIMIT, || async {
        t.flush().await;
        let m = t.collected.lock().unwrap().metrics.clone();
        seen(m, |m| {
            m.get(metric::DELIVERED).is_some_and(|v| *v >= 2.0)
                && m.get(metric::RETRIES_SCHEDULED).is_some_and(|v| *v >= 2.0)
                && m.get(metric::DEAD_LETTERED).is_some_and(|v| *v >= 1.0)
                && m.get(metric::HANDLER_DURATION).is_some_and(|v| *v >= 5.0)
                && m.get(metric::RETRY_LATENESS).is_some_and(|v| *v >= 2.0)
                && m.contains_key(metric::PARTITIONS_HELD)
                && m.contains_key(metric::RETRY_LOOP_STATE)
                && m.contains_key(metric::CHECKPOINT_LAG_EVENTS)
                && m.contains_key(metric::CHECKPOINT_LAG_SECONDS)
        })
    })
    .await;
}
