//! A downstream's `Retry-After` through the real webhook handler and pipeline: honoured up to
//! the policy's cap (or the webhook's `retry_after_max_s`), never beyond, and the ledger says
//! when it was shortened.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use hubguard::handler::webhook::{WebhookConfig, WebhookHandler};
use hubguard::ledger::State;
use hubguard::telemetry::names::{attr, span};

use crate::common::eventually;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A receiver that answers each event with the `Retry-After` its body names (`429 …` for a
/// 429, else a 503), and 200 to a body without one.
async fn asking() -> String {
    let app = axum::Router::new().fallback(move |body: String| async move {
        let (status, value) = match body.split_once(' ') {
            Some(("429", v)) => (StatusCode::TOO_MANY_REQUESTS, v.to_string()),
            Some(("503", v)) => (StatusCode::SERVICE_UNAVAILABLE, v.to_string()),
            _ => return (StatusCode::OK, HeaderMap::new()).into_response(),
        };
        let mut h = HeaderMap::new();
        h.insert("retry-after", value.parse().unwrap());
        (status, h).into_response()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/events")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_retry_after_waits_the_policy_cap_or_the_handler_limit_and_says_so() {
    let t = crate::otlp::telemetry();
    let bed = Bed::start(1).await;
    let url = asking().await;
    let mut policy = fast_policy(10);
    policy.cap_s = 3600;
    // The webhook without a limit of its own: the policy's cap (1 h) bounds Retry-After.
    let run = Bed::run(bed.parts(
        Arc::new(WebhookHandler::new(WebhookConfig::new(url.clone())).unwrap()),
        policy.clone(),
        "replica-a",
    ));
    let asked = [
        ("seconds", "503 999999999", Some(999_999_999u64)),
        ("date-9999", "503 Fri, 31 Dec 9999 23:59:59 GMT", None),
        ("too-many", "429 99999999999999999999999", Some(u64::MAX)),
        ("fair", "503 120", None),
    ];
    let evs: Vec<(&str, &str)> = asked.iter().map(|(k, b, _)| (*k, *b)).collect();
    bed.send(0, &evs).await;
    let ledger = bed.ledger();
    wait_for("every retry scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == asked.len() as u64
    })
    .await;
    run.stop().await;
    for (key, _, capped_from) in asked {
        let rec = ledger.record(key).await.unwrap().expect(key);
        assert_eq!(rec.state(), State::RetryScheduled, "{key}");
        let entry = rec.history.last().unwrap();
        let wait =
            Duration::from_millis((rec.next_attempt_ms().unwrap() - entry.finished_ms) as u64);
        if key == "fair" {
            // Within the cap: honoured as asked, nothing said.
            assert!(
                wait >= Duration::from_secs(120) && wait <= Duration::from_secs(121),
                "{key}: {wait:?}"
            );
            assert_eq!(entry.retry_after_capped_from_s, None, "{key}");
            continue;
        }
        // Service Bus schedules in whole seconds: the due time is rounded up.
        assert!(
            wait >= Duration::from_secs(3599) && wait <= Duration::from_secs(3601),
            "{key}: scheduled {wait:?} ahead, not within the policy's 1 h cap"
        );
        match capped_from {
            Some(s) => assert_eq!(entry.retry_after_capped_from_s, Some(s), "{key}"),
            // Year 9999, from now: some 8,000 years of seconds.
            None => assert!(
                entry
                    .retry_after_capped_from_s
                    .is_some_and(|s| s > 7_000 * 365 * 86_400),
                "{key}: {entry:?}"
            ),
        }
        let text = hubguard::status::record_text(&rec);
        assert!(
            text.contains("shortened to the policy's limit"),
            "{key}: {text}"
        );
        let view = hubguard::status::record_view(&rec);
        assert!(
            view["history"][0]["retry_after_capped_from_s"].is_u64(),
            "{key}: {view}"
        );
    }
    // The attempt's span says the Retry-After was shortened, and from what.
    let (seconds, fair) = eventually("both attempts' spans", LIMIT, || async {
        t.flush().await;
        let spans = t.collected.lock().unwrap().spans.clone();
        let of = |key: &str| {
            spans
                .iter()
                .find(|s| {
                    s.name == span::ATTEMPT
                        && s.attributes.get(attr::CONVERSATION_ID).map(String::as_str) == Some(key)
                })
                .cloned()
        };
        match (of("seconds"), of("fair")) {
            (Some(seconds), Some(fair)) => Ok((seconds, fair)),
            (seconds, fair) => Err((seconds.is_some(), fair.is_some())),
        }
    })
    .await;
    assert_eq!(
        seconds
            .attributes
            .get(attr::RETRY_AFTER_CAPPED_FROM)
            .and_then(|v| v.parse::<f64>().ok()),
        Some(999_999_999.0),
        "{seconds:?}"
    );
    assert!(
        !fair.attributes.contains_key(attr::RETRY_AFTER_CAPPED_FROM),
        "{fair:?}"
    );
    // Service Bus holds each message no further ahead than the cap.
    let queue = bed.sb.queue("retries").unwrap();
    let now = bed.clock().now();
    for m in queue.messages(hubguard::emulator::servicebus::broker::Entity::Main) {
        let ahead = hubguard::clock::at(m.enqueued_at_ms)
            .duration_since(now)
            .unwrap_or_default();
        assert!(ahead <= Duration::from_secs(3601), "{ahead:?}");
    }

    // With `retry_after_max_s` the webhook honours less than the policy's cap.
    let bed = Bed::start(1).await;
    let run = Bed::run(
        bed.parts(
            Arc::new(
                WebhookHandler::new(WebhookConfig {
                    retry_after_max_s: Some(90),
                    ..WebhookConfig::new(url)
                })
                .unwrap(),
            ),
            policy,
            "replica-a",
        ),
    );
    bed.send(0, &[("limited", "503 999999999"), ("under", "503 30")])
        .await;
    wait_for("both retries scheduled", &run.health, LIMIT, || async {
        bed.sb.counters("retries").unwrap().scheduled == 2
    })
    .await;
    run.stop().await;
    let ledger = bed.ledger();
    let rec = ledger.record("limited").await.unwrap().unwrap();
    let entry = rec.history.last().unwrap();
    let wait = rec.next_attempt_ms().unwrap() - entry.finished_ms;
    assert!((89_000..=91_000).contains(&wait), "{wait} ms");
    assert_eq!(entry.retry_after_capped_from_s, Some(999_999_999));
    let rec = ledger.record("under").await.unwrap().unwrap();
    let entry = rec.history.last().unwrap();
    let wait = rec.next_attempt_ms().unwrap() - entry.finished_ms;
    assert!((29_000..=31_000).contains(&wait), "{wait} ms");
    assert_eq!(entry.retry_after_capped_from_s, None);
}
