//! Small JSON-ish records in blob storage with compare-and-swap, for the attempt ledger and
//! the shared circuit breaker. Writes are conditional — `If-None-Match: *` to create,
//! `If-Match: <etag>` to update — and the errors tell "someone else won"
//! ([`StoreError::Conflict`]) from "storage is down" ([`StoreError::Unavailable`]), because
//! callers do different things about them. Every call has a deadline. A read-modify-write
//! of a record goes through the one compare-and-swap, [`super::versioned::compare_and_swap`].

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use azure_core::credentials::TokenCredential;
use bytes::Bytes;

use super::blob::{BlobContainer, BlobError, Condition, Revalidated};
use super::versioned::{
    compare_and_swap, Change, Conflicts, Contended, RecordKind, Start, Versioned,
};

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

/// What [`RecordStore::read_if_changed`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IfChanged {
    /// The record still has the ETag the caller read it with.
    Unchanged,
    /// The record changed: as it is now.
    Changed(Record),
    /// The record no longer exists.
    Missing,
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
    /// Whether the record at `key` still has `etag`, and if not, the record as it is now:
    /// a cheap re-validation of a record read earlier. The default reads the record and
    /// compares; blob storage answers a conditional read (`If-None-Match`) without the body.
    async fn read_if_changed(&self, key: &str, etag: &str) -> Result<IfChanged, StoreError> {
        Ok(match self.read(key).await? {
            None => IfChanged::Missing,
            Some(r) if r.etag == etag => IfChanged::Unchanged,
            Some(r) => IfChanged::Changed(r),
        })
    }
    /// Creates `key`; [`StoreError::Conflict`] if it exists. Returns the new ETag.
    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError>;
    /// Replaces `key` if it still has `etag`; [`StoreError::Conflict`] if it changed.
    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError>;
    /// Deletes `key` if it still has `etag`.
    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError>;
    /// Every record whose key starts with `prefix`, with its tags.
    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError>;
    /// One page of [`list`](Self::list): records whose key starts with `prefix`, from
    /// `marker` (the continuation the previous page returned; `None`: the first page), and
    /// the next page's marker (`None`: no more). Lets a caller walk a large prefix holding
    /// one page at a time (blob storage: one List Blobs call, at most 5,000 blobs). The
    /// default lists everything and returns it as one page.
    async fn list_page(
        &self,
        prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<Listed>, Option<String>), StoreError> {
        if marker.is_some() {
            return Ok((Vec::new(), None));
        }
        Ok((self.list(prefix).await?, None))
    }
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
    /// [`write_tagged`](Self::write_tagged), also setting `index` as the blob's index tags
    /// (blob storage: `x-ms-tags` on the same Put Blob, when the store was built to send
    /// them), which a lifecycle management policy can filter on (`blobIndexMatch`). A store
    /// without index tags writes as [`write_tagged`](Self::write_tagged) does (the default).
    async fn write_indexed(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
        index: &Tags,
    ) -> Result<String, StoreError> {
        let _ = index;
        self.write_tagged(key, body, etag, tags).await
    }
    /// Deletes `key` whatever its ETag; a missing record is no error. The default reads
    /// the ETag first; blob storage deletes with one unconditional Delete Blob.
    async fn remove(&self, key: &str) -> Result<(), StoreError> {
        let Some(r) = self.read(key).await? else {
            return Ok(());
        };
        match self.delete(key, &r.etag).await {
            Ok(()) | Err(StoreError::NotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }
    /// Writes `key` with `tags` whether or not it exists (for index entries, whose content
    /// is derived from a record and so never contended). The default creates it, and on a
    /// conflict replaces what it reads; blob storage writes it with one unconditional Put
    /// Blob.
    async fn put_tagged(&self, key: &str, body: Bytes, tags: &Tags) -> Result<String, StoreError> {
        let overwrite = Overwrite {
            store: self,
            key,
            tags,
        };
        let put = compare_and_swap(&overwrite, Start::From(None), |_| {
            Change::Write(Box::new(body.clone()), ())
        });
        Ok(put.await?.written.map(|w| w.etag).unwrap_or_default())
    }
}

/// A record written whatever it holds ([`RecordStore::put_tagged`]): over the ETag it was
/// last read with, so a store without unconditional writes still writes it once.
struct Overwrite<'a, S: ?Sized> {
    store: &'a S,
    key: &'a str,
    tags: &'a Tags,
}

#[async_trait]
impl<S: RecordStore + ?Sized> RecordKind for Overwrite<'_, S> {
    type Value = Bytes;
    type Error = StoreError;

    fn name(&self) -> String {
        self.key.to_string()
    }

    async fn read(&self) -> Result<Option<Versioned<Bytes>>, StoreError> {
        let read = self.store.read(self.key).await?;
        Ok(read.map(|r| Versioned::new(r.body, r.etag)))
    }

    async fn write(&self, body: &Bytes, etag: Option<&str>) -> Result<String, StoreError> {
        self.store
            .write_tagged(self.key, body.clone(), etag, self.tags)
            .await
    }

    fn lost(&self, e: &StoreError) -> bool {
        e.is_conflict()
    }

    fn contended(&self, _: Contended) -> StoreError {
        StoreError::Conflict
    }
}

/// [`RecordStore`] on an Azure Blob Storage container (hubguard's REST client,
/// [`BlobContainer`]).
pub struct BlobRecordStore {
    container: Arc<BlobContainer>,
    deadline: Duration,
    /// Whether [`RecordStore::write_indexed`] sends blob index tags (`x-ms-tags`).
    index_tags: bool,
}

impl fmt::Debug for BlobRecordStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlobRecordStore")
            .field("container", &self.container.url())
            .finish()
    }
}

impl BlobRecordStore {
    /// A store on the container at `url` (`https://acct.blob.core.windows.net/c`, a path-style
    /// emulator URL, either optionally with a SAS in the query), with an Entra ID credential or
    /// none. No retries inside: the caller retries, and every call has `deadline`.
    pub fn new(
        url: &str,
        credential: Option<Arc<dyn TokenCredential>>,
        deadline: Duration,
    ) -> Result<Self, StoreError> {
        let container = BlobContainer::new(url, credential, deadline)
            .map_err(|e| StoreError::Misconfigured(format!("container URL: {e}")))?;
        Ok(Self::on(Arc::new(container), deadline))
    }

    /// A store on an existing container client.
    pub fn on(container: Arc<BlobContainer>, deadline: Duration) -> Self {
        Self {
            container,
            deadline,
            index_tags: false,
        }
    }

    /// Sends the blob index tags of [`RecordStore::write_indexed`] with each write (`x-ms-tags`
    /// on the same Put Blob: no extra call). Off by default: setting tags needs the
    /// `tags/write` permission (Storage Blob Data Owner, or a SAS with `t`), which Storage
    /// Blob Data Contributor lacks, and accounts with a hierarchical namespace have no tags
    /// ("Manage and find Azure Blob data with blob index tags", learn.microsoft.com/azure/
    /// storage/blobs/storage-manage-find-blobs).
    pub fn with_index_tags(mut self, on: bool) -> Self {
        self.index_tags = on;
        self
    }

    /// The container client (shared with the checkpoint store).
    pub fn container(&self) -> Arc<BlobContainer> {
        self.container.clone()
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
                    StoreError::Unavailable(format!("{}: {m}", self.container.url()))
                }
                other => other,
            })
    }

    /// Put Blob with a condition and, when given, the tags as metadata; `not_found_as`
    /// replaces a 404 answer.
    async fn upload(
        &self,
        key: &str,
        body: Bytes,
        condition: Condition,
        not_found_as: Option<StoreError>,
        tags: Option<&Tags>,
        index: Option<&Tags>,
    ) -> Result<String, StoreError> {
        self.deadline(async {
            fn pairs(t: Option<&Tags>) -> Vec<(&str, &str)> {
                t.map(|t| t.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect())
                    .unwrap_or_default()
            }
            let (metadata, index) = (pairs(tags), pairs(index.filter(|_| self.index_tags)));
            self.container
                .put_blob_tagged(key, body, "application/json", &metadata, &index, &condition)
                .await
                .map(|w| w.etag)
                .map_err(|e| match (classify(&e), &not_found_as) {
                    (StoreError::NotFound, Some(replacement)) => replacement.clone(),
                    (other, _) => other,
                })
        })
        .await
    }
}

fn listed(i: crate::azure::blob::BlobItem) -> Listed {
    Listed {
        key: i.name,
        etag: i.etag,
        last_modified: i.last_modified.map(SystemTime::from),
        tags: i.metadata.into_iter().collect(),
    }
}

/// What a blob error means to a caller of the record store.
pub fn classify(e: &BlobError) -> StoreError {
    let code = e.code().map(str::to_string);
    match e.status() {
        Some(412) | Some(409) => StoreError::Conflict,
        Some(404) if code.as_deref() == Some("ContainerNotFound") => {
            StoreError::Misconfigured("the container does not exist".into())
        }
        Some(404) => StoreError::NotFound,
        Some(401) | Some(403) => {
            StoreError::Misconfigured(format!("access refused ({})", code.unwrap_or_default()))
        }
        // A 400 is a refusal of this request for what it is (a name or metadata Azure does
        // not take): it will not pass by waiting, but it concerns one record, so the caller
        // holds that record's work and says why.
        Some(400) => StoreError::Misconfigured(format!("status 400 {}", code.unwrap_or_default())),
        // 503 `ServerBusy` is a throttled account ("Blob service error codes"): transient.
        Some(s) => StoreError::Unavailable(match code {
            Some(c) if c == "ServerBusy" => format!("status {s} ServerBusy (throttled)"),
            _ => format!("status {s}"),
        }),
        // No token is an operator's problem, not an outage.
        None if matches!(e, BlobError::Credential(_)) => StoreError::Misconfigured(e.to_string()),
        None => StoreError::Unavailable(without_urls(&e.to_string())),
    }
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

#[async_trait]
impl RecordStore for BlobRecordStore {
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.deadline(async {
            match self.container.get_blob(key).await {
                Ok(Some(d)) => Ok(Some(Record {
                    body: d.body,
                    etag: d.etag,
                })),
                Ok(None) => Ok(None),
                Err(e) => Err(classify(&e)),
            }
        })
        .await
    }

    async fn read_if_changed(&self, key: &str, etag: &str) -> Result<IfChanged, StoreError> {
        self.deadline(async {
            match self.container.get_blob_if_none_match(key, etag).await {
                Ok(Revalidated::NotModified) => Ok(IfChanged::Unchanged),
                Ok(Revalidated::Changed(d)) => Ok(IfChanged::Changed(Record {
                    body: d.body,
                    etag: d.etag,
                })),
                Ok(Revalidated::Missing) => Ok(IfChanged::Missing),
                Err(e) => Err(classify(&e)),
            }
        })
        .await
    }

    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError> {
        self.upload(key, body, Condition::IfNotExists, None, None, None)
            .await
    }

    async fn write_tagged(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        self.write_indexed(key, body, etag, tags, &Tags::new())
            .await
    }

    async fn write_indexed(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
        index: &Tags,
    ) -> Result<String, StoreError> {
        match etag {
            None => {
                self.upload(
                    key,
                    body,
                    Condition::IfNotExists,
                    None,
                    Some(tags),
                    Some(index),
                )
                .await
            }
            Some(e) => {
                self.upload(
                    key,
                    body,
                    Condition::IfMatch(e.to_string()),
                    Some(StoreError::Conflict),
                    Some(tags),
                    Some(index),
                )
                .await
            }
        }
    }

    async fn remove(&self, key: &str) -> Result<(), StoreError> {
        self.deadline(async {
            match self.container.delete_blob(key, None).await {
                Ok(()) => Ok(()),
                Err(e) => match classify(&e) {
                    StoreError::NotFound => Ok(()),
                    other => Err(other),
                },
            }
        })
        .await
    }

    async fn put_tagged(&self, key: &str, body: Bytes, tags: &Tags) -> Result<String, StoreError> {
        self.upload(key, body, Condition::None, None, Some(tags), None)
            .await
    }

    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError> {
        // If-Match on a deleted record: it changed under us.
        self.upload(
            key,
            body,
            Condition::IfMatch(etag.to_string()),
            Some(StoreError::Conflict),
            None,
            None,
        )
        .await
    }

    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
        self.deadline(async {
            self.container
                .delete_blob(key, Some(etag))
                .await
                .map_err(|e| classify(&e))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        self.deadline(async {
            let items = self
                .container
                .list_blobs(prefix, true)
                .await
                .map_err(|e| classify(&e))?;
            Ok(items.into_iter().map(listed).collect())
        })
        .await
    }

    async fn list_page(
        &self,
        prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<Listed>, Option<String>), StoreError> {
        self.deadline(async {
            let (items, next) = self
                .container
                .list_blobs_page(prefix, true, marker, None)
                .await
                .map_err(|e| classify(&e))?;
            Ok((items.into_iter().map(listed).collect(), next))
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
