//! hubguard's own Blob Storage REST client: the six operations its stores need, on `reqwest`.
//!
//! Why not an Azure crate: `azure_messaging_eventhubs` 0.16 needs `azure_core`
//! 1.2.0-beta.1, and `azure_storage_blob` 1.1 (like the official checkpoint store 0.9 built on
//! it) requires `azure_core` ^1.0/^1.1, which excludes pre-releases, so the two cannot be in
//! one build. The legacy `azure_storage_blobs` 0.21 would resolve, but it is unmaintained and
//! brings the legacy credential trait (a second identity stack for one service). This client
//! takes the same `azure_core` 1.2 `TokenCredential` as Event Hubs, and it sits behind
//! [`RecordStore`](super::RecordStore) and the SDK's `CheckpointStore` trait, so moving to
//! `azure_storage_blob` once it accepts `azure_core` 1.2 replaces this file and nothing else.
//!
//! Operations ("Blob service REST API", learn.microsoft.com): Put Blob (block blob, with
//! metadata and `If-Match` / `If-None-Match: *`), Set Blob Metadata (with the same
//! conditions), Get Blob (also with `If-None-Match`, answered 304 Not Modified while the
//! blob is unchanged), Delete Blob (`If-Match`), List Blobs (`prefix`, `marker`,
//! `include=metadata`; the XML `EnumerationResults`). Every request carries `x-ms-version`
//! and `x-ms-date`; authentication is a SAS in the container URL's query, or
//! `Authorization: Bearer` with a token for `https://storage.azure.com/.default`, or none
//! (the emulators).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use azure_core::credentials::{AccessToken, TokenCredential};
use azure_core::time::OffsetDateTime;
use bytes::Bytes;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use quick_xml::events::Event;

/// The REST API version every request names (supported by Azure and by Azurite 3.37).
pub const API_VERSION: &str = "2024-11-04";
/// The Entra ID scope of Azure Storage.
pub const STORAGE_SCOPE: &str = "https://storage.azure.com/.default";

/// Characters escaped in a blob name's path: everything but unreserved characters and `/`
/// (kept raw, as the Python and .NET clients send it; Azure decodes either form).
const BLOB_PATH: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b'/');

/// Characters escaped in a query value.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// What went wrong with a blob call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlobError {
    /// The service answered with an error status.
    #[error("status {status}{}{}", code.as_deref().map(|c| format!(" {c}")).unwrap_or_default(), if message.is_empty() { String::new() } else { format!(": {message}") })]
    Status {
        /// The HTTP status.
        status: u16,
        /// `x-ms-error-code` (or the XML body's `<Code>`).
        code: Option<String>,
        /// The XML body's `<Message>`, if any (first line).
        message: String,
    },
    /// No answer: connection refused, reset, TLS, a broken body.
    #[error("{0}")]
    Transport(String),
    /// The credential gave no token.
    #[error("no storage token: {0}")]
    Credential(String),
    /// The service's answer could not be read.
    #[error("unreadable answer: {0}")]
    Protocol(String),
}

impl BlobError {
    /// The HTTP status, if the service answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The service's error code, if any.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Status { code, .. } => code.as_deref(),
            _ => None,
        }
    }
}

/// A write's precondition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// Unconditional.
    None,
    /// `If-None-Match: *`: only if the blob does not exist.
    IfNotExists,
    /// `If-Match: <etag>`: only if the blob still has this ETag.
    IfMatch(String),
}

/// What a successful write returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The blob's new ETag (as the `ETag` header gave it).
    pub etag: String,
    /// Its new `Last-Modified`.
    pub last_modified: Option<OffsetDateTime>,
}

/// A blob as List Blobs describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlobItem {
    /// The blob's full name.
    pub name: String,
    /// Its ETag (`<Etag>`).
    pub etag: String,
    /// Its `<Last-Modified>`.
    pub last_modified: Option<OffsetDateTime>,
    /// Its metadata (with `include=metadata`), names as listed.
    pub metadata: Vec<(String, String)>,
}

impl BlobItem {
    /// The metadata value named `name` (case-insensitively, as Azure treats metadata names).
    pub fn meta(&self, name: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A blob's content and ETag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Downloaded {
    /// The bytes.
    pub body: Bytes,
    /// The ETag.
    pub etag: String,
}

/// What a conditional Get Blob found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Revalidated {
    /// The blob still has the ETag the caller holds (304 Not Modified, no body sent).
    NotModified,
    /// The blob changed: its content and ETag now.
    Changed(Downloaded),
    /// The blob no longer exists.
    Missing,
}

/// Why a container URL (or the client for it) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContainerUrlError {
    /// Not a URL.
    #[error("invalid URL: {0}")]
    Invalid(String),
    /// Neither http nor https.
    #[error("the container URL must be http or https")]
    Scheme,
    /// A user name or password in the URL.
    #[error("the container URL must not carry a user name or password (use a SAS in the query, or a credential)")]
    UserInfo,
    /// A token credential over plain http to a host that is not a loopback emulator.
    #[error("a token credential needs an https container URL")]
    TokenOverHttp,
    /// No container in the path.
    #[error("the container URL names no container")]
    NoContainer,
    /// The HTTP client could not be built.
    #[error("HTTP client: {0}")]
    HttpClient(String),
}

/// One container, reached by its URL.
pub struct BlobContainer {
    http: reqwest::Client,
    /// `scheme://host[:port]/[account/]container`, no query, no trailing slash.
    base: String,
    /// The SAS query from the container URL, if any (a secret).
    sas: Option<String>,
    credential: Option<Arc<dyn TokenCredential>>,
    token: tokio::sync::Mutex<Option<AccessToken>>,
    /// The clock each response's `Date` is reported to (see [`Self::measure_on`]).
    clock: std::sync::OnceLock<Arc<crate::clock::Clock>>,
}

impl fmt::Debug for BlobContainer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlobContainer")
            .field("url", &self.base)
            .field("sas", &self.sas.as_ref().map(|_| "<redacted>"))
            .field("credential", &self.credential.is_some())
            .finish()
    }
}

impl BlobContainer {
    /// The container at `url` (`https://acct.blob.core.windows.net/c`, or a path-style emulator
    /// URL `http://127.0.0.1:10000/devstoreaccount1/c`), optionally with a SAS in the query,
    /// and an Entra ID credential or none. No request outlives `timeout` (plus a second: the
    /// callers' own deadlines are meant to fire first).
    pub fn new(
        url: &str,
        credential: Option<Arc<dyn TokenCredential>>,
        timeout: Duration,
    ) -> Result<Self, ContainerUrlError> {
        let mut parsed =
            url::Url::parse(url.trim()).map_err(|e| ContainerUrlError::Invalid(e.to_string()))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(ContainerUrlError::Scheme);
        }
        // Azure Storage never authorizes by userinfo (Shared Key, SAS, Entra ID or anonymous:
        // https://learn.microsoft.com/en-us/rest/api/storageservices/authorize-requests-to-azure-storage),
        // and a password kept in `base` would be shown wherever the container is named.
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(ContainerUrlError::UserInfo);
        }
        // Azure takes bearer tokens over TLS only; a loopback emulator is the one exception.
        let loopback = matches!(parsed.host_str(), Some("127.0.0.1" | "localhost" | "[::1]"));
        if credential.is_some() && parsed.scheme() != "https" && !loopback {
            return Err(ContainerUrlError::TokenOverHttp);
        }
        let sas = parsed.query().filter(|q| !q.is_empty()).map(str::to_string);
        parsed.set_query(None);
        parsed.set_fragment(None);
        let base = parsed.as_str().trim_end_matches('/').to_string();
        if parsed.path().trim_matches('/').is_empty() {
            return Err(ContainerUrlError::NoContainer);
        }
        // A backstop: callers put their own deadline on every call (and report it as theirs).
        let http = reqwest::Client::builder()
            .timeout(timeout + Duration::from_secs(1))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ContainerUrlError::HttpClient(e.to_string()))?;
        Ok(Self {
            http,
            base,
            sas,
            credential,
            token: tokio::sync::Mutex::new(None),
            clock: std::sync::OnceLock::new(),
        })
    }

    /// Reports the `Date` of every response to `clock` from now on, which measures blob
    /// storage's time from them (the first clock given stays).
    pub fn measure_on(&self, clock: Arc<crate::clock::Clock>) {
        let _ = self.clock.set(clock);
    }

    /// The container URL without its query.
    pub fn url(&self) -> &str {
        &self.base
    }

    fn url_for(&self, blob: Option<&str>, params: &[(&str, &str)]) -> String {
        let mut u = self.base.clone();
        if let Some(name) = blob {
            u.push('/');
            u.push_str(&utf8_percent_encode(name, BLOB_PATH).to_string());
        }
        let mut query: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{k}={}", utf8_percent_encode(v, QUERY_VALUE)))
            .collect();
        if let Some(sas) = &self.sas {
            query.push(sas.clone());
        }
        if !query.is_empty() {
            u.push('?');
            u.push_str(&query.join("&"));
        }
        u
    }

    async fn bearer(&self) -> Result<Option<String>, BlobError> {
        let Some(cred) = &self.credential else {
            return Ok(None);
        };
        let mut cached = self.token.lock().await;
        let fresh = cached.as_ref().is_some_and(|t| {
            t.expires_on > OffsetDateTime::now_utc() + azure_core::time::Duration::minutes(5)
        });
        if !fresh {
            let t = cred
                .get_token(&[STORAGE_SCOPE], None)
                .await
                .map_err(|e| BlobError::Credential(e.to_string()))?;
            *cached = Some(t);
        }
        Ok(cached
            .as_ref()
            .map(|t| format!("Bearer {}", t.token.secret())))
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response, BlobError> {
        let mut req = req
            .header("x-ms-version", API_VERSION)
            .header(
                "x-ms-date",
                azure_core::time::to_rfc7231(&OffsetDateTime::now_utc()),
            )
            .header("x-ms-client-request-id", uuid::Uuid::new_v4().to_string());
        if let Some(b) = self.bearer().await? {
            req = req.header("authorization", b);
        }
        let sent = self.clock.get().map(|c| c.sent());
        let resp = req.send().await.map_err(|e| {
            // reqwest's Display hides the cause; keep the chain, never the URL's query.
            let e = e.without_url();
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(": ");
                msg.push_str(&s.to_string());
                src = s.source();
            }
            BlobError::Transport(msg)
        })?;
        if let (Some(clock), Some(sent), Some(date)) =
            (self.clock.get(), sent, header(&resp, "date"))
        {
            clock.observe(crate::clock::Service::BlobStorage, sent, &date);
        }
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(error_of(resp).await)
    }

    fn conditioned(req: reqwest::RequestBuilder, condition: &Condition) -> reqwest::RequestBuilder {
        match condition {
            Condition::None => req,
            Condition::IfNotExists => req.header("if-none-match", "*"),
            Condition::IfMatch(etag) => req.header("if-match", etag.as_str()),
        }
    }

    fn with_metadata(
        mut req: reqwest::RequestBuilder,
        metadata: &[(&str, &str)],
    ) -> reqwest::RequestBuilder {
        for (k, v) in metadata {
            req = req.header(format!("x-ms-meta-{k}"), *v);
        }
        req
    }

    /// Put Blob (a block blob), replacing content and metadata.
    pub async fn put_blob(
        &self,
        name: &str,
        body: Bytes,
        content_type: &str,
        metadata: &[(&str, &str)],
        condition: &Condition,
    ) -> Result<Written, BlobError> {
        self.put_blob_tagged(name, body, content_type, metadata, &[], condition)
            .await
    }

    /// Put Blob with blob index tags (`x-ms-tags`, query-string encoded; none: the header is
    /// not sent) in the same request: "Put Blob", learn.microsoft.com/rest/api/
    /// storageservices/put-blob. Setting tags needs the `tags/write` permission (a SAS with
    /// `t`; Storage Blob Data Owner) and an account without a hierarchical namespace.
    pub async fn put_blob_tagged(
        &self,
        name: &str,
        body: Bytes,
        content_type: &str,
        metadata: &[(&str, &str)],
        tags: &[(&str, &str)],
        condition: &Condition,
    ) -> Result<Written, BlobError> {
        let mut req = self
            .http
            .put(self.url_for(Some(name), &[]))
            .header("x-ms-blob-type", "BlockBlob")
            .header("content-type", content_type)
            .header("content-length", body.len())
            .body(body);
        if !tags.is_empty() {
            req = req.header("x-ms-tags", encode_tags(tags));
        }
        let req = Self::with_metadata(Self::conditioned(req, condition), metadata);
        written(&self.send(req).await?)
    }

    /// Set Blob Metadata (replaces all of the blob's metadata).
    pub async fn set_metadata(
        &self,
        name: &str,
        metadata: &[(&str, &str)],
        condition: &Condition,
    ) -> Result<Written, BlobError> {
        let req = self
            .http
            .put(self.url_for(Some(name), &[("comp", "metadata")]))
            .header("content-length", 0);
        let req = Self::with_metadata(Self::conditioned(req, condition), metadata);
        written(&self.send(req).await?)
    }

    /// Get Blob: `None` when the blob does not exist (a missing container is an error).
    pub async fn get_blob(&self, name: &str) -> Result<Option<Downloaded>, BlobError> {
        let req = self.http.get(self.url_for(Some(name), &[]));
        match self.send(req).await {
            Ok(resp) => {
                let etag = header(&resp, "etag").unwrap_or_default();
                let body = resp
                    .bytes()
                    .await
                    .map_err(|e| BlobError::Transport(e.without_url().to_string()))?;
                Ok(Some(Downloaded { body, etag }))
            }
            Err(e) if e.status() == Some(404) && e.code() != Some("ContainerNotFound") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Get Blob with `If-None-Match: <etag>`: [`Revalidated::NotModified`] when the blob
    /// still has `etag` (Azure answers 304 Not Modified without the body: "Specifying
    /// conditional headers for Blob service operations", learn.microsoft.com), else the blob
    /// as it is now, or [`Revalidated::Missing`].
    pub async fn get_blob_if_none_match(
        &self,
        name: &str,
        etag: &str,
    ) -> Result<Revalidated, BlobError> {
        let req = self
            .http
            .get(self.url_for(Some(name), &[]))
            .header("if-none-match", etag);
        match self.send(req).await {
            Ok(resp) => {
                let etag = header(&resp, "etag").unwrap_or_default();
                let body = resp
                    .bytes()
                    .await
                    .map_err(|e| BlobError::Transport(e.without_url().to_string()))?;
                Ok(Revalidated::Changed(Downloaded { body, etag }))
            }
            Err(e) if e.status() == Some(304) => Ok(Revalidated::NotModified),
            Err(e) if e.status() == Some(404) && e.code() != Some("ContainerNotFound") => {
                Ok(Revalidated::Missing)
            }
            Err(e) => Err(e),
        }
    }

    /// Delete Blob, optionally only if it still has `if_match`.
    pub async fn delete_blob(&self, name: &str, if_match: Option<&str>) -> Result<(), BlobError> {
        let mut req = self.http.delete(self.url_for(Some(name), &[]));
        if let Some(e) = if_match {
            req = req.header("if-match", e);
        }
        self.send(req).await.map(|_| ())
    }

    /// List Blobs whose names start with `prefix`, every page, with their metadata when
    /// `with_metadata`.
    pub async fn list_blobs(
        &self,
        prefix: &str,
        with_metadata: bool,
    ) -> Result<Vec<BlobItem>, BlobError> {
        let mut out = Vec::new();
        let mut marker: Option<String> = None;
        loop {
            let (items, next) = self
                .list_blobs_page(prefix, with_metadata, marker.as_deref(), None)
                .await?;
            out.extend(items);
            match next {
                Some(n) => marker = Some(n),
                None => break,
            }
        }
        Ok(out)
    }

    /// One List Blobs call: at most `max` blobs (the service's page, at most 5,000, when
    /// `None`) from `marker`, and the marker of the next page (`None`: the last page).
    pub async fn list_blobs_page(
        &self,
        prefix: &str,
        with_metadata: bool,
        marker: Option<&str>,
        max: Option<usize>,
    ) -> Result<(Vec<BlobItem>, Option<String>), BlobError> {
        let max = max.map(|m| m.clamp(1, 5_000).to_string());
        let mut params = vec![("restype", "container"), ("comp", "list")];
        if !prefix.is_empty() {
            params.push(("prefix", prefix));
        }
        if with_metadata {
            params.push(("include", "metadata"));
        }
        if let Some(m) = marker.filter(|m| !m.is_empty()) {
            params.push(("marker", m));
        }
        if let Some(m) = &max {
            params.push(("maxresults", m.as_str()));
        }
        let req = self
            .http
            .get(self.url_for(None, &params))
            .header("accept", "application/xml");
        let resp = self.send(req).await?;
        let text = resp
            .text()
            .await
            .map_err(|e| BlobError::Transport(e.without_url().to_string()))?;
        let (items, next) = parse_list(&text)?;
        Ok((items, next.filter(|n| !n.is_empty())))
    }
}

fn header(resp: &reqwest::Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn written(resp: &reqwest::Response) -> Result<Written, BlobError> {
    let etag = header(resp, "etag")
        .filter(|e| !e.is_empty())
        .ok_or_else(|| BlobError::Protocol("a write answered without an ETag".into()))?;
    let last_modified =
        header(resp, "last-modified").and_then(|s| azure_core::time::parse_rfc7231(&s).ok());
    Ok(Written {
        etag,
        last_modified,
    })
}

async fn error_of(resp: reqwest::Response) -> BlobError {
    let status = resp.status().as_u16();
    let header_code = header(&resp, "x-ms-error-code");
    let body = resp.text().await.unwrap_or_default();
    let (body_code, message) = parse_error(&body);
    BlobError::Status {
        status,
        code: header_code.or(body_code),
        message: message.lines().next().unwrap_or("").to_string(),
    }
}

/// `<Error><Code>…</Code><Message>…</Message></Error>` → (code, message).
fn parse_error(xml: &str) -> (Option<String>, String) {
    let mut code = None;
    let mut message = String::new();
    let _ = walk(xml, |path, text| match path {
        [.., "Error", "Code"] => code = Some(text.to_string()),
        [.., "Error", "Message"] => message = text.to_string(),
        _ => {}
    });
    (code, message)
}

/// Walks an XML document, calling `f(element path, text)` for every element's text content
/// (entity and character references resolved). Empty elements are reported with "".
fn walk(xml: &str, mut f: impl FnMut(&[&str], &str)) -> Result<(), BlobError> {
    let bad = |e: &dyn fmt::Display| BlobError::Protocol(format!("XML: {e}"));
    let mut reader = quick_xml::Reader::from_str(xml);
    let mut path: Vec<String> = Vec::new();
    let mut text = String::new();
    loop {
        match reader.read_event().map_err(|e| bad(&e))? {
            Event::Start(e) => {
                path.push(String::from_utf8_lossy(e.name().as_ref()).into_owned());
                text.clear();
            }
            Event::Empty(e) => {
                path.push(String::from_utf8_lossy(e.name().as_ref()).into_owned());
                let p: Vec<&str> = path.iter().map(String::as_str).collect();
                f(&p, "");
                path.pop();
                text.clear();
            }
            Event::Text(t) => text.push_str(&t.decode().map_err(|e| bad(&e))?),
            Event::CData(t) => text.push_str(&t.decode().map_err(|e| bad(&e))?),
            Event::GeneralRef(r) => {
                if let Some(c) = r.resolve_char_ref().map_err(|e| bad(&e))? {
                    text.push(c);
                } else {
                    let name = r.decode().map_err(|e| bad(&e))?;
                    text.push_str(match name.as_ref() {
                        "amp" => "&",
                        "lt" => "<",
                        "gt" => ">",
                        "quot" => "\"",
                        "apos" => "'",
                        other => return Err(bad(&format!("unknown entity &{other};"))),
                    });
                }
            }
            Event::End(_) => {
                let p: Vec<&str> = path.iter().map(String::as_str).collect();
                f(&p, &text);
                path.pop();
                text.clear();
            }
            Event::Eof => return Ok(()),
            _ => {}
        }
    }
}

/// An ETag as the `ETag` header carries it. Azure lists a blob's `<Etag>` unquoted
/// (`0x8DD…`) and sends it quoted in headers (`"0x8DD…"`), as its recordings show; every
/// ETag hubguard holds is in the header's form, so a listed one compares equal to the one a
/// read or write returned.
fn header_form(etag: &str) -> String {
    let etag = etag.trim();
    if etag.is_empty() || etag.starts_with('"') || etag.starts_with("W/") {
        etag.to_string()
    } else {
        format!("\"{etag}\"")
    }
}

/// A List Blobs page → its blobs and the next marker.
fn parse_list(xml: &str) -> Result<(Vec<BlobItem>, Option<String>), BlobError> {
    let mut items = Vec::new();
    let mut cur = BlobItem::default();
    let mut next = None;
    let mut seen_results = false;
    walk(xml, |path, text| match path {
        ["EnumerationResults", "Blobs", "Blob", "Name"] => cur.name = text.to_string(),
        ["EnumerationResults", "Blobs", "Blob", "Properties", "Etag"] => {
            cur.etag = header_form(text)
        }
        ["EnumerationResults", "Blobs", "Blob", "Properties", "Last-Modified"] => {
            cur.last_modified = azure_core::time::parse_rfc7231(text).ok()
        }
        ["EnumerationResults", "Blobs", "Blob", "Metadata", key] => {
            cur.metadata.push((key.to_string(), text.to_string()))
        }
        ["EnumerationResults", "Blobs", "Blob"] => items.push(std::mem::take(&mut cur)),
        ["EnumerationResults", "NextMarker"] => next = Some(text.to_string()),
        ["EnumerationResults"] => seen_results = true,
        _ => {}
    })?;
    // `<Name Encoded="true">` (names with characters XML cannot carry) is rare; the attribute
    // is not seen by `walk`, so look for it once.
    if xml.contains("Encoded=\"true\"") {
        for item in &mut items {
            if item.name.contains('%') {
                item.name = percent_encoding::percent_decode_str(&item.name)
                    .decode_utf8_lossy()
                    .into_owned();
            }
        }
    }
    if !seen_results {
        return Err(BlobError::Protocol(
            "a List Blobs answer without EnumerationResults".into(),
        ));
    }
    Ok((items, next))
}

/// `x-ms-tags`: the tags as a URL query string (every byte but `A–Z a–z 0–9 - . _ ~`
/// percent-encoded).
pub fn encode_tags(tags: &[(&str, &str)]) -> String {
    const TAG: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    tags.iter()
        .map(|(k, v)| {
            format!(
                "{}={}",
                utf8_percent_encode(k, TAG),
                utf8_percent_encode(v, TAG)
            )
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// What the tests and the emulators use, and the pipeline does not: creating the container
/// (hubguard never creates its container in production: the operator does, with its access
/// policy), and reading or replacing a blob's index tags (the ledger writes them with the
/// blob, [`BlobContainer::put_blob_tagged`]). The test bed's door into this client.
#[cfg(any(test, feature = "testbed"))]
pub mod bed {
    use super::{BlobContainer, BlobError};

    impl BlobContainer {
        /// Create Container; `Ok(false)` when it already exists.
        pub async fn create_container(&self) -> Result<bool, BlobError> {
            let req = self
                .http
                .put(self.url_for(None, &[("restype", "container")]))
                .header("content-length", 0);
            match self.send(req).await {
                Ok(_) => Ok(true),
                Err(e) if e.status() == Some(409) => Ok(false),
                Err(e) => Err(e),
            }
        }

        /// Set Blob Tags (`comp=tags`): replaces all of the blob's index tags; the blob's ETag
        /// and Last-Modified stay ("Set Blob Tags", learn.microsoft.com/rest/api/
        /// storageservices/set-blob-tags).
        pub async fn set_tags(&self, name: &str, tags: &[(&str, &str)]) -> Result<(), BlobError> {
            let esc = |t: &str| quick_xml::escape::escape(t).into_owned();
            let mut xml = String::from("<?xml version=\"1.0\" encoding=\"utf-8\"?><Tags><TagSet>");
            for (k, v) in tags {
                xml.push_str(&format!(
                    "<Tag><Key>{}</Key><Value>{}</Value></Tag>",
                    esc(k),
                    esc(v)
                ));
            }
            xml.push_str("</TagSet></Tags>");
            let req = self
                .http
                .put(self.url_for(Some(name), &[("comp", "tags")]))
                .header("content-type", "application/xml; charset=UTF-8")
                .header("content-length", xml.len())
                .body(xml);
            self.send(req).await.map(|_| ())
        }

        /// Get Blob Tags (`comp=tags`): the blob's index tags; `None` when the blob does not
        /// exist.
        pub async fn get_tags(
            &self,
            name: &str,
        ) -> Result<Option<Vec<(String, String)>>, BlobError> {
            let req = self.http.get(self.url_for(Some(name), &[("comp", "tags")]));
            match self.send(req).await {
                Ok(resp) => {
                    let text = resp
                        .text()
                        .await
                        .map_err(|e| BlobError::Transport(e.without_url().to_string()))?;
                    Ok(Some(parse_tag_set(&text)))
                }
                Err(e) if e.status() == Some(404) && e.code() == Some("BlobNotFound") => Ok(None),
                Err(e) => Err(e),
            }
        }
    }

    /// The `Key`/`Value` pairs of a Get Blob Tags answer (`<Tags><TagSet><Tag>…`).
    pub fn parse_tag_set(xml: &str) -> Vec<(String, String)> {
        let text = |t: &str, name: &str| -> String {
            let (open, close) = (format!("<{name}>"), format!("</{name}>"));
            t.split_once(&open)
                .and_then(|(_, rest)| rest.split_once(&close))
                .map(|(v, _)| {
                    quick_xml::escape::unescape(v)
                        .map(|c| c.into_owned())
                        .unwrap_or_else(|_| v.to_string())
                })
                .unwrap_or_default()
        };
        xml.split("<Tag>")
            .skip(1)
            .map(|t| (text(t, "Key"), text(t, "Value")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A credential that is never asked for a token (the container refuses it first).
    #[derive(Debug)]
    struct NoToken;

    #[async_trait::async_trait]
    impl TokenCredential for NoToken {
        async fn get_token(
            &self,
            _scopes: &[&str],
            _options: Option<azure_core::credentials::TokenRequestOptions<'_>>,
        ) -> azure_core::Result<AccessToken> {
            unreachable!("an http:// container never asks for a token")
        }
    }

    #[test]
    fn parses_a_listing_with_metadata_entities_and_marker() {
        let xml = r#"<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint="http://x/" ContainerName="c"><Prefix>a/</Prefix><Blobs><Blob><Name>a/ns/hub/$default/checkpoint/0</Name><Properties><Last-Modified>Sat, 12 Oct 2019 07:20:50 GMT</Last-Modified><Etag>"0x8D1"</Etag><BlobType>BlockBlob</BlobType></Properties><Metadata><sequencenumber>41</sequencenumber><offset>4&amp;2</offset></Metadata></Blob><Blob><Name>a/b&lt;c</Name><Properties><Etag>0x2</Etag></Properties><Metadata /></Blob></Blobs><NextMarker>m&#49;</NextMarker></EnumerationResults>"#;
        let (items, next) = parse_list(xml).unwrap();
        assert_eq!(next.as_deref(), Some("m1"));
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].name, "a/ns/hub/$default/checkpoint/0");
        assert_eq!(items[0].etag, "\"0x8D1\"");
        assert_eq!(items[0].meta("SequenceNumber"), Some("41"));
        assert_eq!(items[0].meta("offset"), Some("4&2"));
        assert_eq!(
            items[0].last_modified.unwrap().unix_timestamp(),
            1_570_864_850
        );
        assert_eq!(items[1].name, "a/b<c");
        assert_eq!(
            items[1].etag, "\"0x2\"",
            "a listed ETag in the header's form"
        );
        assert!(items[1].metadata.is_empty());
        let (_, next) =
            parse_list("<EnumerationResults><Blobs/><NextMarker/></EnumerationResults>").unwrap();
        assert_eq!(next.as_deref(), Some(""));
        assert!(parse_list("<Error><Code>X</Code></Error>").is_err());
    }

    #[test]
    fn parses_error_bodies() {
        let (code, msg) = parse_error("<?xml version=\"1.0\"?><Error><Code>ConditionNotMet</Code><Message>The condition specified using HTTP conditional header(s) is not met.\nRequestId:1</Message></Error>");
        assert_eq!(code.as_deref(), Some("ConditionNotMet"));
        assert!(msg.starts_with("The condition"));
    }

    #[test]
    fn urls_keep_the_sas_and_escape_names() {
        let c = BlobContainer::new(
            "http://127.0.0.1:10000/devstoreaccount1/c/?sv=1&sig=a%2Bb",
            None,
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(
            c.url_for(Some("127.0.0.1/hub/$default/checkpoint/0"), &[("comp", "metadata")]),
            "http://127.0.0.1:10000/devstoreaccount1/c/127.0.0.1/hub/%24default/checkpoint/0?comp=metadata&sv=1&sig=a%2Bb"
        );
        assert_eq!(
            c.url_for(None, &[("prefix", "a b/")]),
            "http://127.0.0.1:10000/devstoreaccount1/c?prefix=a%20b%2F&sv=1&sig=a%2Bb"
        );
        assert!(!format!("{c:?}").contains("sig"));
        assert!(BlobContainer::new(
            "http://blobs.example:10000/devstoreaccount1/c",
            Some(Arc::new(NoToken)),
            Duration::from_secs(1)
        )
        .is_err());
    }
}
