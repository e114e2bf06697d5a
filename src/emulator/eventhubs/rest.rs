//! The namespace's HTTPS face, as far as a client needs it: Event Hubs namespaces answer
//! REST on the same host as AMQP (`https://{namespace}.servicebus.windows.net/`), and every
//! answer carries a `Date` (RFC 9110 §6.6.1), which is how `hubguard check` reads Event
//! Hubs's clock (its AMQP answers carry none).
//!
//! What it answers, as Azure does:
//!
//! - `GET /` without a token: the namespace's "Publicly Listed Services" Atom feed (the
//!   answer shown in "Troubleshooting guide for Azure Service Bus", Connectivity, which the
//!   guide has users fetch from `https://<yournamespace>.servicebus.windows.net/`).
//! - `GET /{hub}` ("Get Event Hub", learn.microsoft.com/rest/api/eventhub/get-event-hub;
//!   response codes 200 and 401): without a valid SAS `Authorization` a 401 with Service
//!   Bus's XML `<Error>` (`<Code>401</Code><Detail>MissingToken: The authorization header was
//!   not found. …</Detail>`, the wording listed under Unauthorized in "Service Bus Resource
//!   Manager exceptions", learn.microsoft.com/azure/service-bus-messaging/service-bus-resource-manager-exceptions;
//!   the body's shape as the troubleshooting guide shows it); with one, the hub's
//!   `EventHubDescription` (`PartitionCount`, `PartitionIds`, `Status`, `CreatedAt`,
//!   `UpdatedAt`) in an Atom entry, and for a hub that does not exist the empty feed Service
//!   Bus answers for a missing entity.
//! - An Entra ID (`Bearer`) token only with `--accept-any-token`, as on Service Bus.
//! - Anything else, with a valid token: 405 (the emulator does not create or delete hubs
//!   over REST; Azure would).
//!
//! Every answer is dated on the emulator's [`Clock`], so a test that steps it sees Event
//! Hubs's clock move, as `hubguard check` measures it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;

use super::Shared;
use crate::emulator::sas::Verify as _;

/// The Atom feed Service Bus answers for the namespace root and for a missing entity.
fn empty_feed(now: SystemTime) -> Response {
    (
        StatusCode::OK,
        [("content-type", "application/atom+xml;type=feed;charset=utf-8")],
        format!(
            "<feed xmlns=\"http://www.w3.org/2005/Atom\"><title type=\"text\">Publicly Listed Services</title><subtitle type=\"text\">This is the list of publicly-listed services currently available.</subtitle><id>uuid:{}</id><updated>{}</updated><generator>Service Bus 1.1</generator></feed>",
            uuid::Uuid::new_v4(),
            atom_time(now)
        ),
    )
        .into_response()
}

/// An Atom time in whole seconds, as Azure writes them.
fn atom_time(t: SystemTime) -> String {
    time::OffsetDateTime::from_unix_timestamp(crate::clock::ms(t) / 1000)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

/// Service Bus's 401: `<Error><Code>401</Code><Detail>…</Detail></Error>`, with the
/// tracking suffix Azure appends.
fn unauthorized(detail: &str, now: SystemTime) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [("content-type", "application/xml; charset=utf-8")],
        format!(
            "<Error><Code>401</Code><Detail>{}. TrackingId:{}, SystemTracker:NoSystemTracker, Timestamp:{}</Detail></Error>",
            detail.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;"),
            uuid::Uuid::new_v4(),
            atom_time(now).trim_end_matches('Z')
        ),
    )
        .into_response()
}

/// The hub's description, as "Get Event Hub" answers it.
fn hub_entry(shared: &Shared, hub: &super::store::Hub, host: &str) -> Response {
    let ids: String = (0..hub.partitions.len())
        .map(|i| format!("<d2p1:string>{i}</d2p1:string>"))
        .collect();
    let created = atom_time(shared.created);
    let now = atom_time(shared.clock.now());
    let body = format!(
        "<entry xmlns=\"http://www.w3.org/2005/Atom\"><id>https://{host}/{name}?api-version=2014-01</id><title type=\"text\">{name}</title><published>{created}</published><updated>{now}</updated><author><name>{host}</name></author><link rel=\"self\" href=\"https://{host}/{name}?api-version=2014-01\"/><content type=\"application/xml\"><EventHubDescription xmlns=\"http://schemas.microsoft.com/netservices/2010/10/servicebus/connect\" xmlns:i=\"http://www.w3.org/2001/XMLSchema-instance\"><MessageRetentionInDays>1</MessageRetentionInDays><AuthorizationRules/><Status>Active</Status><CreatedAt>{created}</CreatedAt><UpdatedAt>{created}</UpdatedAt><PartitionCount>{count}</PartitionCount><PartitionIds xmlns:d2p1=\"http://schemas.microsoft.com/2003/10/Serialization/Arrays\">{ids}</PartitionIds></EventHubDescription></content></entry>",
        name = hub.name,
        count = hub.partitions.len(),
    );
    (
        StatusCode::OK,
        [(
            "content-type",
            "application/atom+xml;type=entry;charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// Every request: the namespace root answered to anyone, everything else authenticated
/// first (as Azure does, before it looks at the entity).
async fn answer(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let now = shared.clock.now();
    let path = request.uri().path().to_string();
    if path == "/" && request.method() == Method::GET {
        return empty_feed(now);
    }
    let Some(token) = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    else {
        return unauthorized("MissingToken: The authorization header was not found", now);
    };
    let bearer = token
        .strip_prefix("Bearer ")
        .or_else(|| token.strip_prefix("bearer "));
    match bearer {
        // Entra ID tokens cannot be verified here: taken only with --accept-any-token.
        Some(b) if shared.accept_any_token && !b.trim().is_empty() => {}
        Some(_) => {
            return unauthorized(
                "InvalidToken: this emulator cannot verify Entra ID (Bearer) tokens and accepts them only when started with --accept-any-token; sign with the SAS key instead",
                now,
            )
        }
        None => {
            if let Err(e) = shared.key.verify(token, &path, now) {
                return unauthorized(&format!("InvalidSignature: {e}"), now);
            }
        }
    }
    let name = path.trim_matches('/');
    if request.method() != Method::GET || name.is_empty() || name.contains('/') {
        return (
            StatusCode::METHOD_NOT_ALLOWED,
            "the Event Hubs emulator answers GET /{hub} (Get Event Hub) only",
        )
            .into_response();
    }
    let host = request
        .headers()
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost")
        .to_string();
    match shared.store.hub(name) {
        Some(hub) => hub_entry(&shared, &hub, &host),
        None => empty_feed(now),
    }
}

/// Dates every answer on the emulator's clock (the HTTP server would otherwise date it on
/// the wall clock).
async fn dated(State(shared): State<Arc<Shared>>, mut response: Response) -> Response {
    if let Ok(v) = HeaderValue::from_str(&crate::clock::http_date(shared.clock.now())) {
        response.headers_mut().insert("date", v);
    }
    response
}

/// Serves the REST face on `listen` until the emulator shuts down.
pub(super) async fn serve(
    listen: SocketAddr,
    shared: Arc<Shared>,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let router = Router::new()
        .fallback(answer)
        .layer(axum::middleware::map_response_with_state(
            shared.clone(),
            dated,
        ))
        .with_state(shared.clone());
    crate::emulator::http::serve(listen, router, shared.faults.clone(), shutdown).await
}
