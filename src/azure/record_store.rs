//! Small JSON-ish records in blob storage with compare-and-swap, for the attempt ledger and
//! the shared circuit breaker. Writes are conditional — `If-None-Match: *` to create,
//! `If-Match: <etag>` to update — and the errors tell "someone else won"
//! ([`StoreError::Conflict`]) from "storage is down" ([`StoreError::Unavailable`]), because
//! callers do different things about them. Every call has a deadline.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use azure_core::credentials::TokenCredential;
use azure_core::http::{ClientOptions, Etag, NoFormat, RequestContent, RetryOptions, StatusCode};
use azure_core::Bytes;
use azure_storage_blob::models::{
    BlobClientDeleteOptions, BlobContainerClientListBlobsOptions, BlockBlobClientUploadOptions,
    ListBlobsIncludeItem,
};
use azure_storage_blob::{BlobContainerClient, BlobContainerClientOptions};
use futures::TryStreamExt;

/// Why a record-store call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A conditional write lost: the record exists (create) or changed (update). Someone else
    /// won; read it again.
    #[error("the record was changed by someone else")]
    Conflict,
    /// The record (for an update or delete) does not exist.
    #[error("the record does not exist")]
    NotFound,
    /// The container does not exist or the credentials are refused: an operator must act.
    #[error("blob storage refused the request: {0}")]
    Misconfigured(String),
    /// Storage answered with a server error or could not be reached.
    #[error("blob storage is unavailable: {0}")]
    Unavailable(String),
    /// No answer within the deadline.
    #[error("blob storage did not answer within {0:?}")]
    Timeout(Duration),
}

impl StoreError {
    /// Whether trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Timeout(_))
    }
}

/// A record and the ETag it was read with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The stored bytes.
    pub body: Bytes,
    /// Its ETag, for a later [`RecordStore::update`].
    pub etag: String,
}

/// A listed record (without its body).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listed {
    /// The record's key.
    pub key: String,
    /// Its ETag.
    pub etag: String,
    /// When it was last written.
    pub last_modified: Option<SystemTime>,
    /// The tags it was written with ([`RecordStore::write_tagged`]); a listing returns them
    /// without reading the record.
    pub tags: std::collections::BTreeMap<String, String>,
}

/// Small name–value pairs stored beside a record and returned by a listing (blob metadata:
/// names are C# identifiers, values ASCII, all of them at most 8 KB).
pub type Tags = std::collections::BTreeMap<String, String>;

/// Records with compare-and-swap.
#[async_trait]
pub trait RecordStore: Send + Sync {
    /// The record at `key`, if any.
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError>;
    /// Creates `key`; [`StoreError::Conflict`] if it exists. Returns the new ETag.
    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError>;
    /// Replaces `key` if it still has `etag`; [`StoreError::Conflict`] if it changed.
    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError>;
    /// Deletes `key` if it still has `etag`.
    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError>;
    /// Every record whose key starts with `prefix`, with its tags.
    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError>;
    /// Creates (`etag` `None`) or replaces `key` like [`create`](Self::create) and
    /// [`update`](Self::update), storing `tags` beside it in the same write. A store that
    /// cannot keep tags writes the record alone (the default).
    async fn write_tagged(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        let _ = tags;
        match etag {
            None => self.create(key, body).await,
            Some(e) => self.update(key, body, e).await,
        }
    }
}

/// [`RecordStore`] on an Azure Blob Storage container (`azure_storage_blob` 1.1).
pub struct BlobRecordStore {
    container: BlobContainerClient,
    deadline: Duration,
}

impl fmt::Debug for BlobRecordStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut url = self.container.url().clone();
        url.set_query(None); // a SAS in the query is a secret
        f.debug_struct("BlobRecordStore")
            .field("container", &url.as_str())
            .finish()
    }
}

impl BlobRecordStore {
    /// A store on the container at `url` (`https://acct.blob.core.windows.net/c`, a path-style
    /// emulator URL, either optionally with a SAS query), with an Entra ID credential or none.
    /// The SDK's own retries are off: the caller retries, and every call has `deadline`.
    pub fn new(
        url: &str,
        credential: Option<Arc<dyn TokenCredential>>,
        deadline: Duration,
    ) -> Result<Self, StoreError> {
        let parsed = url::Url::parse(url.trim_end_matches('/'))
            .map_err(|e| StoreError::Misconfigured(format!("invalid container URL: {e}")))?;
        let options = BlobContainerClientOptions {
            client_options: ClientOptions {
                retry: RetryOptions::none(),
                ..Default::default()
            },
            ..Default::default()
        };
        let container = BlobContainerClient::new(parsed, credential, Some(options))
            .map_err(|e| StoreError::Misconfigured(e.to_string()))?;
        Ok(Self {
            container,
            deadline,
        })
    }

    /// The underlying container client (for the official checkpoint store).
    pub fn container_client(&self) -> &BlobContainerClient {
        &self.container
    }

    async fn deadline<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.deadline, f)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.deadline)))
            .map_err(|e| match e {
                // Name the endpoint: "blob storage is unavailable" alone sends nobody anywhere.
                StoreError::Unavailable(m) => {
                    StoreError::Unavailable(format!("{}: {m}", self.endpoint()))
                }
                other => other,
            })
    }

    /// The container's URL without its query (a SAS there is a secret).
    fn endpoint(&self) -> String {
        let mut url = self.container.url().clone();
        url.set_query(None);
        url.to_string()
    }
}

impl BlobRecordStore {
    /// Put Blob with a condition: `If-None-Match: *` (`create`) or `If-Match` (`update`);
    /// `not_found_as` replaces a 404 answer.
    async fn upload(
        &self,
        key: &str,
        body: Bytes,
        condition: Etag,
        not_found_as: Option<StoreError>,
        tags: Option<&Tags>,
    ) -> Result<String, StoreError> {
        let create = condition.to_string() == "*";
        self.deadline(async {
            let options = BlockBlobClientUploadOptions {
                if_none_match: create.then(|| condition.clone()),
                if_match: (!create).then(|| condition.clone()),
                blob_content_type: Some("application/json".into()),
                metadata: tags.map(|t| t.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
                ..Default::default()
            };
            let r = self
                .container
                .blob_client(key)
                .upload(
                    RequestContent::<Bytes, NoFormat>::from(body.to_vec()),
                    Some(options),
                )
                .await
                .map_err(|e| match (classify(&e), &not_found_as) {
                    (StoreError::NotFound, Some(replacement)) => replacement.clone(),
                    (other, _) => other,
                })?;
            Ok(etag_of(r.etag))
        })
        .await
    }
}

fn classify(e: &azure_core::Error) -> StoreError {
    let code = match e.kind() {
        azure_core::error::ErrorKind::HttpResponse { error_code, .. } => error_code.clone(),
        _ => None,
    };
    match e.http_status() {
        Some(StatusCode::PreconditionFailed) | Some(StatusCode::Conflict) => StoreError::Conflict,
        Some(StatusCode::NotFound) if code.as_deref() == Some("ContainerNotFound") => {
            StoreError::Misconfigured("the container does not exist".into())
        }
        Some(StatusCode::NotFound) => StoreError::NotFound,
        Some(StatusCode::Unauthorized) | Some(StatusCode::Forbidden) => {
            StoreError::Misconfigured(format!("access refused ({})", code.unwrap_or_default()))
        }
        // A 400 is a refusal of this request for what it is (a name or metadata Azure does
        // not take): it will not pass by waiting, but it concerns one record, so the caller
        // holds that record's work and says why.
        Some(StatusCode::BadRequest) => {
            StoreError::Misconfigured(format!("status 400 {}", code.unwrap_or_default()))
        }
        // 503 `ServerBusy` is a throttled account ("Blob service error codes"): transient.
        Some(s) => StoreError::Unavailable(match code {
            Some(c) if c == "ServerBusy" => {
                format!("status {} ServerBusy (throttled)", u16::from(s))
            }
            _ => format!("status {}", u16::from(s)),
        }),
        None => StoreError::Unavailable(with_causes(e)),
    }
}

/// An error and its causes ("failed to execute `reqwest` request: error sending request: …
/// Connection refused"), each once.
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text.push_str(": ");
            text.push_str(&c_text);
        }
        cause = c.source();
    }
    without_urls(&text)
}

/// Removes reqwest's ` for url (…)`: a URL's query may carry a SAS.
fn without_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(" for url (") {
        out.push_str(&rest[..i]);
        match rest[i..].find(')') {
            Some(j) => rest = &rest[i + j + 1..],
            None => rest = "",
        }
    }
    out.push_str(rest);
    out
}

fn etag_of(e: Option<Etag>) -> String {
    e.map(|e| e.to_string()).unwrap_or_default()
}

#[async_trait]
impl RecordStore for BlobRecordStore {
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.deadline(async {
            let blob = self.container.blob_client(key);
            match blob.download(None).await {
                Ok(r) => {
                    let etag = etag_of(r.properties.etag.clone());
                    let body = r
                        .body
                        .collect()
                        .await
                        .map_err(|e| StoreError::Unavailable(e.to_string()))?;
                    Ok(Some(Record { body, etag }))
                }
                Err(e) => match classify(&e) {
                    StoreError::NotFound => Ok(None),
                    other => Err(other),
                },
            }
        })
        .await
    }

    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError> {
        self.upload(key, body, Etag::from("*"), None, None).await
    }

    async fn write_tagged(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        match etag {
            None => {
                self.upload(key, body, Etag::from("*"), None, Some(tags))
                    .await
            }
            Some(e) => {
                self.upload(
                    key,
                    body,
                    Etag::from(e.to_string()),
                    Some(StoreError::Conflict),
                    Some(tags),
                )
                .await
            }
        }
    }

    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError> {
        // If-Match on a deleted record: it changed under us.
        self.upload(
            key,
            body,
            Etag::from(etag.to_string()),
            Some(StoreError::Conflict),
            None,
        )
        .await
    }

    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
        self.deadline(async {
            let options = BlobClientDeleteOptions {
                if_match: Some(Etag::from(etag.to_string())),
                ..Default::default()
            };
            self.container
                .blob_client(key)
                .delete(Some(options))
                .await
                .map_err(|e| classify(&e))?;
            Ok(())
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        self.deadline(async {
            let mut pager = self
                .container
                .list_blobs(Some(BlobContainerClientListBlobsOptions {
                    prefix: Some(prefix.to_string()),
                    include: Some(vec![ListBlobsIncludeItem::Metadata]),
                    ..Default::default()
                }))
                .map_err(|e| classify(&e))?;
            let mut out = Vec::new();
            while let Some(item) = pager.try_next().await.map_err(|e| classify(&e))? {
                let Some(key) = item.name.clone() else {
                    continue;
                };
                let (etag, last_modified) = item
                    .properties
                    .as_ref()
                    .map(|p| {
                        (
                            etag_of(p.etag.clone()),
                            p.last_modified.map(SystemTime::from),
                        )
                    })
                    .unwrap_or_default();
                let tags = item
                    .metadata
                    .as_ref()
                    .and_then(|m| m.values.as_ref())
                    .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
                    .unwrap_or_default();
                out.push(Listed {
                    key,
                    etag,
                    last_modified,
                    tags,
                });
            }
            Ok(out)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_with_their_sas_never_reach_an_error() {
        assert_eq!(
            without_urls("error sending request for url (http://h/c/b?sig=SECRET): refused"),
            "error sending request: refused"
        );
    }
}
