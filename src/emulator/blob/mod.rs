//! Blob storage emulator: the REST subset the official `BlobCheckpointStore` and hubguard's
//! record store (ledger, breaker) use, path-style `/{account}/{container}/{blob}`, behaving as
//! the service documents each operation (learn.microsoft.com/rest/api/storageservices):
//!
//! - containers: create (201/409; 409 `ContainerBeingDeleted` for 30 s after a delete),
//!   properties (200/404), delete (202, again 202 while being deleted), list blobs (`prefix`,
//!   `marker`, `maxresults`, `include=metadata`; each `<Etag>` unquoted, as Azure lists it);
//!   a name Azure refuses: 400 `InvalidResourceName`;
//! - blobs: Put Blob (201; block blobs only: `x-ms-blob-type` missing → 400
//!   `MissingRequiredHeader`, an append or page blob with content → 400 `InvalidHeaderValue`
//!   as Azure answers, an empty one → 400 `UnsupportedHeader`, where Azure would create it),
//!   Get Blob (200, or 206 with `x-ms-range`/`Range`), Get Properties
//!   (HEAD), Set Metadata (`comp=metadata`, 200), Delete (202); blob index tags: `x-ms-tags`
//!   on Put Blob (which replaces the blob's tags with those given, none without the header),
//!   Set Blob Tags (`comp=tags`, 204; the ETag and Last-Modified stay), Get Blob Tags (200),
//!   `x-ms-tag-count` on Get Blob and Get Properties;
//! - `If-Match` → 412 `ConditionNotMet`, `If-None-Match: *` → 409 `BlobAlreadyExists` on
//!   Put Blob (412 elsewhere); on Get Blob and Get Properties, `If-None-Match` (and
//!   `If-Modified-Since`) → 304 Not Modified without a body, `If-Match` (and
//!   `If-Unmodified-Since`) → 412, `If-None-Match: *` → 400 `UnsatisfiableCondition`; 404 `BlobNotFound`/`ContainerNotFound`, with `x-ms-error-code`
//!   and the XML error body; `ETag` and `Last-Modified` (GMT) on every write; on writes and
//!   deletes `If-Modified-Since`/`If-Unmodified-Since` unmet → 412 `ConditionNotMet`;
//! - every XML body starts with a UTF-8 byte-order mark and the request's `x-ms-version` is
//!   echoed, as Azure answers (the recordings in tests/data/azure-recordings, held by
//!   tests/it/conformance.rs; docs/conformance.md).
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

use std::collections::BTreeMap;
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
use self::response::{
    blob_error, common_headers, echo_version, error_response, tag_set_xml, write_headers,
};
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

/// Answers one request, with the request's `x-ms-version` echoed as Azure echoes it.
async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut resp = route(&shared, method, &uri, &headers, body);
    echo_version(&headers, &mut resp);
    resp
}

/// A container name Azure accepts ("Naming and referencing containers, blobs, and metadata",
/// learn.microsoft.com): 3 to 63 lowercase letters, digits and hyphens, starting with a
/// letter or digit, every hyphen between letters or digits; or one of the named system
/// containers. Azure answers any other 400 `InvalidResourceName` (the C++ SDK's recording
/// `BlobContainerClientTest.CreateDelete`, for `UPPERCASE`).
fn valid_container_name(name: &str) -> bool {
    if matches!(name, "$root" | "$logs" | "$web") {
        return true;
    }
    let b = name.as_bytes();
    let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    (3..=63).contains(&b.len())
        && b.iter().all(|&c| ok(c) || c == b'-')
        && ok(b[0])
        && ok(b[b.len() - 1])
        && !name.contains("--")
}

/// Routes one request. The checks come in Azure's error precedence (the tests assert it): the
/// bearer token, the account, the container name, the blob name and metadata, then the
/// operation's own.
fn route(shared: &Shared, method: Method, uri: &Uri, headers: &HeaderMap, body: Bytes) -> Response {
    let headers = headers.clone();
    let now = shared.clock.now();
    let head = method == Method::HEAD;
    if let Some(refusal) = refuse_bearer(shared, &headers, head, now) {
        return refusal;
    }
    let (container, blob) = match resource(&shared.account, uri.path()) {
        Ok(resource) => resource,
        Err(account) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "InvalidUri",
                &format!("unknown account '{account}'"),
                head,
                now,
            )
        }
    };
    if !container.is_empty() && !valid_container_name(&container) {
        return error_response(
            StatusCode::BAD_REQUEST,
            "InvalidResourceName",
            "The specifed resource name contains invalid characters.",
            head,
            now,
        );
    }
    let q = query_map(uri);
    let restype = q.get("restype").map(String::as_str);
    let comp = q.get("comp").map(String::as_str);
    if let Some(refusal) = refuse_input(&method, blob.as_deref(), comp, &headers, head, now) {
        return refusal;
    }
    let mut h = HeaderMap::new();
    common_headers(&mut h, now);
    let op = Operation {
        shared,
        container: &container,
        headers: &headers,
        head,
        now,
    };
    match (method.clone(), blob.as_deref(), restype, comp) {
        // Containers.
        (Method::PUT, None, Some("container"), None) => op.create_container(h),
        (Method::GET | Method::HEAD, None, Some("container"), None) => op.container_properties(h),
        (Method::DELETE, None, Some("container"), None) => op.delete_container(h),
        (Method::GET, None, Some("container"), Some("list")) => op.list_blobs(&q, h),
        // Blobs.
        (Method::PUT, Some(name), None, None) => op.put_blob(name, body, h),
        (Method::PUT, Some(name), None, Some("metadata")) => op.set_metadata(name, h),
        (Method::PUT, Some(name), None, Some("tags")) => op.set_tags(name, &body, h),
        (Method::GET, Some(name), None, Some("tags")) => op.get_tags(name, h),
        (Method::GET | Method::HEAD, Some(name), None, None) => op.get_blob(name, h),
        (Method::DELETE, Some(name), None, None) => op.delete_blob(name, h),
        _ => error_response(
            StatusCode::BAD_REQUEST,
            "UnsupportedHttpVerb",
            &format!("{method} {} is not supported by this emulator", uri.path()),
            head,
            now,
        ),
    }
}

/// The container and (percent-decoded) blob a `/{account}/{container}/{blob}` path names, or
/// the account when it is not the one served.
fn resource<'p>(served: &str, path: &'p str) -> Result<(String, Option<String>), &'p str> {
    let raw = path.trim_start_matches('/');
    let (account, rest) = raw.split_once('/').unwrap_or((raw, ""));
    if account != served {
        return Err(account);
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
    Ok((container, blob))
}

/// The 400 for a blob name over 1,024 characters, or for metadata Azure refuses on Put Blob or
/// Set Metadata (checked in that order); `None` when neither.
fn refuse_input(
    method: &Method,
    blob: Option<&str>,
    comp: Option<&str>,
    headers: &HeaderMap,
    head: bool,
    now: std::time::SystemTime,
) -> Option<Response> {
    if blob.is_some_and(|b| b.chars().count() > BLOB_NAME_CHARS) {
        return Some(error_response(
            StatusCode::BAD_REQUEST,
            "OutOfRangeInput",
            "The specified resource name length is not within the permissible limits.",
            head,
            now,
        ));
    }
    if method == Method::PUT && blob.is_some() && comp.is_none() {
        if let Err((status, code, message)) = check_blob_type(headers) {
            return Some(error_response(status, code, &message, head, now));
        }
    }
    if method == Method::PUT && blob.is_some() && matches!(comp, None | Some("metadata")) {
        if let Err((status, code, message)) = check_metadata(&metadata(headers)) {
            return Some(error_response(status, code, &message, head, now));
        }
    }
    None
}

/// Put Blob's `x-ms-blob-type`, as Azure holds it ("Put Blob", learn.microsoft.com/rest/api/
/// storageservices/put-blob: required, `BlockBlob`, `PageBlob` or `AppendBlob`; for a page or
/// an append blob `Content-Length` must be zero, Put Blob only initialises it; the error codes
/// from "Common REST API error codes"). This emulator keeps block blobs only: an append or page
/// blob, which Azure would create, is refused loudly (400 `UnsupportedHeader`, naming the
/// emulator) rather than stored as a block blob (docs/conformance.md).
fn check_blob_type(headers: &HeaderMap) -> Result<(), (StatusCode, &'static str, String)> {
    let length = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let bad = |code: &'static str, message: &str| {
        Err((StatusCode::BAD_REQUEST, code, message.to_string()))
    };
    match headers.get("x-ms-blob-type").map(|v| v.to_str().unwrap_or("")) {
        None => bad("MissingRequiredHeader", "An HTTP header that's mandatory for this request is not specified.\nHeaderName: x-ms-blob-type"),
        Some("BlockBlob") => Ok(()),
        Some("AppendBlob" | "PageBlob") if length > 0 => bad("InvalidHeaderValue", "The value for one of the HTTP headers is not in the correct format.\nHeaderName: Content-Length (zero for an append or page blob: Put Blob only initialises it)"),
        Some(t @ ("AppendBlob" | "PageBlob")) => bad("UnsupportedHeader", &format!("One of the HTTP headers specified in the request is not supported.\nHeaderName: x-ms-blob-type ({t}: this emulator keeps block blobs only; Azurite keeps every type)")),
        Some(_) => bad("InvalidHeaderValue", "The value for one of the HTTP headers is not in the correct format.\nHeaderName: x-ms-blob-type"),
    }
}

/// One request's operation on a container or blob: what each operation needs to answer.
struct Operation<'a> {
    shared: &'a Shared,
    container: &'a str,
    headers: &'a HeaderMap,
    head: bool,
    now: std::time::SystemTime,
}

impl Operation<'_> {
    /// The store's answer, or its error as Azure words it.
    fn answer(&self, result: Result<Response, BlobError>) -> Response {
        result.unwrap_or_else(|e| blob_error(e, self.head, self.now))
    }

    /// A request check's refusal (status, error code, message) as an error answer.
    fn refuse(&self, (status, code, message): (StatusCode, &str, String)) -> Response {
        error_response(status, code, &message, self.head, self.now)
    }

    /// Create Container: 201, or 409 if it exists.
    fn create_container(&self, mut h: HeaderMap) -> Response {
        let result = self
            .shared
            .store
            .create_container(self.container, self.now)
            .map(|c| {
                write_headers(&mut h, &c.etag, c.last_modified);
                (StatusCode::CREATED, h).into_response()
            });
        self.answer(result)
    }

    /// Get Container Properties: 200 with the ETag, Last-Modified, lease and policy headers.
    fn container_properties(&self, mut h: HeaderMap) -> Response {
        let result = self
            .shared
            .store
            .container(self.container)
            .map(|(etag, lm)| {
                write_headers(&mut h, &etag, lm);
                h.insert("x-ms-lease-state", HeaderValue::from_static("available"));
                h.insert("x-ms-lease-status", HeaderValue::from_static("unlocked"));
                h.insert(
                    "x-ms-has-immutability-policy",
                    HeaderValue::from_static("false"),
                );
                h.insert("x-ms-has-legal-hold", HeaderValue::from_static("false"));
                (StatusCode::OK, h).into_response()
            });
        self.answer(result)
    }

    /// Delete Container: 202 (again 202 while the deletion is under way, as Azure answered a
    /// second Delete Container in the C++ SDK's recording `DeleteWithConditions`).
    fn delete_container(&self, h: HeaderMap) -> Response {
        let result = self
            .shared
            .store
            .delete_container(self.container, self.now)
            .map(|_| (StatusCode::ACCEPTED, h).into_response());
        self.answer(result)
    }

    /// List Blobs (`prefix`, `marker`, `maxresults`, `include=metadata`).
    fn list_blobs(&self, q: &BTreeMap<String, String>, h: HeaderMap) -> Response {
        self.answer(list(self.shared, self.container, q, h))
    }

    /// Put Blob: 201, after checking `x-ms-tags`; the conditions are the store's to check.
    fn put_blob(&self, name: &str, body: Bytes, h: HeaderMap) -> Response {
        let tags = match header_tags(self.headers) {
            Ok(t) => t,
            Err(refusal) => return self.refuse(refusal),
        };
        let content_type = self
            .headers
            .get("x-ms-blob-content-type")
            .or_else(|| self.headers.get("content-type"))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("application/octet-stream")
            .to_string();
        let result = self
            .shared
            .store
            .put(
                self.container,
                name,
                store::NewBlob {
                    content: body,
                    content_type,
                    metadata: metadata(self.headers),
                    tags,
                },
                &conditions(self.headers),
                self.now,
            )
            .map(|b| written(h, &b, StatusCode::CREATED));
        self.answer(result)
    }

    /// Set Blob Metadata (`comp=metadata`): 200.
    fn set_metadata(&self, name: &str, h: HeaderMap) -> Response {
        let result = self
            .shared
            .store
            .set_metadata(
                self.container,
                name,
                metadata(self.headers),
                &conditions(self.headers),
                self.now,
            )
            .map(|b| written(h, &b, StatusCode::OK));
        self.answer(result)
    }

    /// Set Blob Tags (`comp=tags`): 204, after checking the body's tags.
    fn set_tags(&self, name: &str, body: &[u8], h: HeaderMap) -> Response {
        let tags = match body_tags(body) {
            Ok(t) => t,
            Err(refusal) => return self.refuse(refusal),
        };
        let result = self
            .shared
            .store
            .set_tags(self.container, name, tags)
            .map(|_| (StatusCode::NO_CONTENT, h).into_response());
        self.answer(result)
    }

    /// Get Blob Tags (`comp=tags`): 200 with the tag set's XML.
    fn get_tags(&self, name: &str, mut h: HeaderMap) -> Response {
        let result = self.shared.store.get(self.container, name).map(|b| {
            h.insert("content-type", HeaderValue::from_static("application/xml"));
            (StatusCode::OK, h, tag_set_xml(&b.tags)).into_response()
        });
        self.answer(result)
    }

    /// Get Blob or Get Blob Properties (HEAD), with their conditions and ranges.
    fn get_blob(&self, name: &str, h: HeaderMap) -> Response {
        let result = self
            .shared
            .store
            .get(self.container, name)
            .and_then(|b| get_blob(&b, self.headers, self.head, h, self.now));
        self.answer(result)
    }

    /// Delete Blob: 202, if its conditions hold.
    fn delete_blob(&self, name: &str, h: HeaderMap) -> Response {
        let result = self
            .shared
            .store
            .delete(self.container, name, &conditions(self.headers))
            .map(|_| (StatusCode::ACCEPTED, h).into_response());
        self.answer(result)
    }
}
/// The answer to a write of a blob's content or metadata (`status`): its ETag and time, and
/// the encryption flag Azure Storage always sets (data is encrypted at rest).
fn written(mut h: HeaderMap, blob: &store::Blob, status: StatusCode) -> Response {
    write_headers(&mut h, &blob.etag, blob.last_modified);
    h.insert(
        "x-ms-request-server-encrypted",
        HeaderValue::from_static("true"),
    );
    (status, h).into_response()
}
