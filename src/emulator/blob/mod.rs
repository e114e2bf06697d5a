//! Blob storage emulator: the REST subset the official `BlobCheckpointStore` and hubguard's
//! record store (ledger, breaker) use, path-style `/{account}/{container}/{blob}`, behaving as
//! the service documents each operation (learn.microsoft.com/rest/api/storageservices):
//!
//! - containers: create (201/409), properties (200/404), delete (202), list blobs
//!   (`prefix`, `marker`, `maxresults`, `include=metadata`);
//! - blobs: Put Blob (201), Get Blob (200, or 206 with `x-ms-range`/`Range`), Get Properties
//!   (HEAD), Set Metadata (`comp=metadata`, 200), Delete (202); blob index tags: `x-ms-tags`
//!   on Put Blob (which replaces the blob's tags with those given, none without the header),
//!   Set Blob Tags (`comp=tags`, 204; the ETag and Last-Modified stay), Get Blob Tags (200),
//!   `x-ms-tag-count` on Get Blob and Get Properties;
//! - `If-Match` → 412 `ConditionNotMet`, `If-None-Match: *` → 409 `BlobAlreadyExists` on
//!   Put Blob (412 elsewhere); on Get Blob and Get Properties, `If-None-Match` (and
//!   `If-Modified-Since`) → 304 Not Modified without a body, `If-Match` (and
//!   `If-Unmodified-Since`) → 412, `If-None-Match: *` → 400 `UnsatisfiableCondition`; 404 `BlobNotFound`/`ContainerNotFound`, with `x-ms-error-code`
//!   and the XML error body; `ETag` and `Last-Modified` (GMT) on every write.
//!
//! Anonymous requests are accepted, and so is a SAS in the query string (neither is
//! verified). An Entra ID token (`Authorization: Bearer …`) cannot be verified here, so, like
//! the Service Bus emulator, this one accepts it only when started with `accept_any_token`
//! (`--accept-any-token`); otherwise it answers as Azure answers a token it refuses: 401
//! `InvalidAuthenticationInfo` with a `WWW-Authenticate: Bearer` challenge ("Authorize access
//! to blobs using Microsoft Entra ID", learn.microsoft.com). A bearer token over plain HTTP is
//! the emulator's exception: Azure takes one only over HTTPS.
//!
//! What Azure refuses, this refuses the same way ("Naming and referencing containers, blobs,
//! and metadata" and "Blob service error codes", learn.microsoft.com; Azurite, Microsoft's
//! emulator, answers the same codes and is the referee in the fidelity tests):
//!
//! | rule | answer |
//! |---|---|
//! | a blob name over 1,024 characters | 400 `OutOfRangeInput` |
//! | a metadata name that is not a valid C# identifier | 400 `InvalidMetadata` |
//! | all of a blob's metadata (names and values) over 8 KB | 400 `MetadataTooLarge` |
//! | more than 10 index tags, a key over 128 characters, a value over 256 | 400 `TagsTooLarge` |
//! | an empty index tag key | 400 `EmptyTagName` |
//! | a character outside a-z A-Z 0-9 space `+ - . / : = _`, a key twice | 400 `InvalidTag` |
//! | a throttled account (fault kind `server-busy`) | 503 `ServerBusy` |
//!
//! This module starts the server and routes each request; `request` reads and checks what
//! a request carries, `response` writes the headers and error answers, `read` answers Get
//! Blob, Get Properties and List Blobs, and `store` keeps the containers and blobs.

mod read;
mod request;
mod response;
pub mod store;

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::read::{get_blob, list};
use self::request::{
    body_tags, check_metadata, conditions, header_tags, metadata, query_map, refuse_bearer,
    BLOB_NAME_CHARS,
};
use self::response::{blob_error, common_headers, error_response, tag_set_xml, write_headers};
use self::store::{BlobError, BlobStore};
use crate::emulator::clock::Clock;
use crate::emulator::Faults;

/// The storage account name the emulator serves (Azurite's well-known development account).
pub const DEFAULT_ACCOUNT: &str = "devstoreaccount1";
/// The container created by default.
pub const DEFAULT_CONTAINER: &str = "hubguard";
/// The API version the emulator reports.
const VERSION: &str = "2026-04-06";

/// How to run the blob emulator.
#[derive(Debug, Clone)]
pub struct BlobConfig {
    /// Address to listen on; port 0 picks a free one.
    pub listen: SocketAddr,
    /// The account name in request paths.
    pub account: String,
    /// Containers created at start (if absent).
    pub containers: Vec<String>,
    /// Where to keep blobs; `None` keeps them in memory.
    pub data_dir: Option<PathBuf>,
    /// Accept any non-empty `Authorization: Bearer` token; without it one gets 401.
    pub accept_any_token: bool,
}

impl Default for BlobConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            account: DEFAULT_ACCOUNT.into(),
            containers: vec![DEFAULT_CONTAINER.into()],
            data_dir: None,
            accept_any_token: false,
        }
    }
}

#[derive(Debug)]
struct Shared {
    account: String,
    store: BlobStore,
    clock: Arc<Clock>,
    accept_any_token: bool,
}

/// A running blob emulator. Dropping it stops it.
#[derive(Debug)]
pub struct BlobEmulator {
    addr: SocketAddr,
    shared: Arc<Shared>,
    faults: Arc<Faults>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl BlobEmulator {
    /// Opens the store and starts listening.
    pub async fn start(config: BlobConfig) -> io::Result<Self> {
        let clock = Arc::new(Clock::default());
        let store = BlobStore::open(&config.containers, config.data_dir.as_deref(), clock.now())?;
        let shared = Arc::new(Shared {
            account: config.account,
            store,
            clock,
            accept_any_token: config.accept_any_token,
        });
        let shutdown = CancellationToken::new();
        let faults = Arc::new(Faults::new(shutdown.clone()));
        let router = Router::new().fallback(handle).with_state(shared.clone());
        let (addr, task) =
            super::http::serve(config.listen, router, faults.clone(), shutdown.clone()).await?;
        Ok(Self {
            addr,
            shared,
            faults,
            shutdown,
            task: Some(task),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://HOST:PORT/{account}`: append `/{container}` for a container URL.
    pub fn account_url(&self) -> String {
        format!("http://{}/{}", self.addr, self.shared.account)
    }

    /// The URL of a container (no trailing slash, as the SDK needs).
    pub fn container_url(&self, container: &str) -> String {
        format!("{}/{container}", self.account_url())
    }

    /// The fault injection handle.
    pub fn faults(&self) -> &Arc<Faults> {
        &self.faults
    }

    /// The stored blobs, for inspection.
    pub fn store(&self) -> &BlobStore {
        &self.shared.store
    }

    /// Stops listening and drops every connection.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for BlobEmulator {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let now = shared.clock.now();
    let head = method == Method::HEAD;
    if let Some(refusal) = refuse_bearer(&shared, &headers, head, now) {
        return refusal;
    }
    let raw = uri.path().trim_start_matches('/');
    let (account, rest) = raw.split_once('/').unwrap_or((raw, ""));
    if account != shared.account {
        return error_response(
            StatusCode::BAD_REQUEST,
            "InvalidUri",
            &format!("unknown account '{account}'"),
            head,
            now,
        );
    }
    let (container, blob) = match rest.split_once('/') {
        Some((c, b)) => (
            c,
            Some(
                percent_encoding::percent_decode_str(b)
                    .decode_utf8_lossy()
                    .into_owned(),
            ),
        ),
        None => (rest, None),
    };
    let container = percent_encoding::percent_decode_str(container)
        .decode_utf8_lossy()
        .into_owned();
    let q = query_map(&uri);
    let restype = q.get("restype").map(String::as_str);
    let comp = q.get("comp").map(String::as_str);
    if blob
        .as_deref()
        .is_some_and(|b| b.chars().count() > BLOB_NAME_CHARS)
    {
        return error_response(
            StatusCode::BAD_REQUEST,
            "OutOfRangeInput",
            "The specified resource name length is not within the permissible limits.",
            head,
            now,
        );
    }
    if method == Method::PUT && blob.is_some() && matches!(comp, None | Some("metadata")) {
        if let Err((status, code, message)) = check_metadata(&metadata(&headers)) {
            return error_response(status, code, &message, head, now);
        }
    }
    let mut h = HeaderMap::new();
    common_headers(&mut h, now);
    let store = &shared.store;
    let result: Result<Response, BlobError> = match (method.clone(), blob.as_deref(), restype, comp)
    {
        // Containers.
        (Method::PUT, None, Some("container"), None) => {
            store.create_container(&container, now).map(|c| {
                write_headers(&mut h, &c.etag, c.last_modified);
                (StatusCode::CREATED, h).into_response()
            })
        }
        (Method::GET | Method::HEAD, None, Some("container"), None) => {
            store.container(&container).map(|(etag, lm)| {
                write_headers(&mut h, &etag, lm);
                h.insert("x-ms-lease-state", HeaderValue::from_static("available"));
                h.insert("x-ms-lease-status", HeaderValue::from_static("unlocked"));
                h.insert(
                    "x-ms-has-immutability-policy",
                    HeaderValue::from_static("false"),
                );
                h.insert("x-ms-has-legal-hold", HeaderValue::from_static("false"));
                (StatusCode::OK, h).into_response()
            })
        }
        (Method::DELETE, None, Some("container"), None) => store
            .delete_container(&container)
            .map(|_| (StatusCode::ACCEPTED, h).into_response()),
        (Method::GET, None, Some("container"), Some("list")) => list(&shared, &container, &q, h),
        // Blobs.
        (Method::PUT, Some(name), None, None) => {
            let tags = match header_tags(&headers) {
                Ok(t) => t,
                Err((status, code, message)) => {
                    return error_response(status, code, &message, head, now)
                }
            };
            let content_type = headers
                .get("x-ms-blob-content-type")
                .or_else(|| headers.get("content-type"))
                .and_then(|v| v.to_str().ok())
                .unwrap_or("application/octet-stream")
                .to_string();
            store
                .put(
                    &container,
                    name,
                    store::NewBlob {
                        content: body,
                        content_type,
                        metadata: metadata(&headers),
                        tags,
                    },
                    &conditions(&headers),
                    now,
                )
                .map(|b| {
                    write_headers(&mut h, &b.etag, b.last_modified);
                    h.insert(
                        "x-ms-request-server-encrypted",
                        HeaderValue::from_static("true"),
                    );
                    (StatusCode::CREATED, h).into_response()
                })
        }
        (Method::PUT, Some(name), None, Some("metadata")) => store
            .set_metadata(
                &container,
                name,
                metadata(&headers),
                &conditions(&headers),
                now,
            )
            .map(|b| {
                write_headers(&mut h, &b.etag, b.last_modified);
                h.insert(
                    "x-ms-request-server-encrypted",
                    HeaderValue::from_static("true"),
                );
                (StatusCode::OK, h).into_response()
            }),
        (Method::PUT, Some(name), None, Some("tags")) => {
            let tags = match body_tags(&body) {
                Ok(t) => t,
                Err((status, code, message)) => {
                    return error_response(status, code, &message, head, now)
                }
            };
            store
                .set_tags(&container, name, tags)
                .map(|_| (StatusCode::NO_CONTENT, h).into_response())
        }
        (Method::GET, Some(name), None, Some("tags")) => store.get(&container, name).map(|b| {
            h.insert("content-type", HeaderValue::from_static("application/xml"));
            (StatusCode::OK, h, tag_set_xml(&b.tags)).into_response()
        }),
        (Method::GET | Method::HEAD, Some(name), None, None) => store
            .get(&container, name)
            .and_then(|b| get_blob(&b, &headers, head, h, now)),
        (Method::DELETE, Some(name), None, None) => store
            .delete(&container, name, &conditions(&headers))
            .map(|_| (StatusCode::ACCEPTED, h).into_response()),
        _ => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "UnsupportedHttpVerb",
                &format!("{method} {} is not supported by this emulator", uri.path()),
                head,
                now,
            )
        }
    };
    result.unwrap_or_else(|e| blob_error(e, head, now))
}
