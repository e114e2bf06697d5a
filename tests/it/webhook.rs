//! The webhook handler against receivers that misbehave: a redirect is never a delivery.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::IntoResponse;
use hubguard::event::{Event, Identity};
use hubguard::handler::webhook::{WebhookConfig, WebhookHandler};
use hubguard::handler::{Attempt, Handler, Outcome};
use hubguard::policy::classify::ErrorClass;

use crate::common::within;

fn event() -> Event {
    Event {
        body: b"{\"order\":42}".to_vec(),
        content_type: Some("application/json".into()),
        properties: BTreeMap::new(),
        hub: "hub".into(),
        partition_id: "0".into(),
        sequence_number: 7,
        offset: None,
        enqueued_ms: None,
        partition_key: None,
        identity: Identity {
            idempotency_key: "order-42".into(),
            correlation_id: "order-42".into(),
            event_type: None,
        },
    }
}

/// A receiver that answers `/hook` with `status` and `Location: /moved?token=secret`, and
/// answers 200 to anything at `/moved`; it records every request's method and path.
async fn redirecting(status: u16) -> (String, Arc<Mutex<Vec<(Method, String)>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let app = axum::Router::new().fallback(move |method: Method, uri: axum::http::Uri| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push((method, uri.path().to_string()));
            if uri.path() == "/hook" {
                let mut h = HeaderMap::new();
                h.insert("location", "/moved?token=secret".parse().unwrap());
                (StatusCode::from_u16(status).unwrap(), h).into_response()
            } else {
                StatusCode::OK.into_response()
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), seen)
}

#[tokio::test]
async fn a_redirect_is_a_failed_attempt_naming_the_status_and_location_never_a_delivery() {
    for status in [301, 302, 303, 307, 308] {
        let (url, seen) = redirecting(status).await;
        let handler = WebhookHandler::new(WebhookConfig {
            url,
            timeout_ms: 5_000,
            conflict_is_permanent: true,
            ..Default::default()
        })
        .unwrap();
        let outcome = within(
            "webhook call",
            handler.handle(
                &event(),
                &Attempt {
                    number: 1,
                    traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                    last: false,
                },
            ),
        )
        .await;
        let Outcome::Failed(f) = outcome else {
            panic!("{status} counted as delivered");
        };
        assert_eq!(f.class, ErrorClass::Transient, "{status}");
        assert!(
            f.error.contains(&status.to_string()) && f.error.contains("/moved"),
            "{status}: {}",
            f.error
        );
        assert!(
            !f.error.contains("secret"),
            "no query in the error: {}",
            f.error
        );
        assert_eq!(
            seen.lock().unwrap().as_slice(),
            &[(Method::POST, "/hook".to_string())],
            "{status}: the redirect was not followed"
        );
    }
}
