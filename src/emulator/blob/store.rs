//! The blob emulator's storage model: containers of block blobs with content, metadata,
//! an ETag and a Last-Modified time, optionally durable on disk
//! (`<dir>/blob/<container>/<hex of the blob name>.blob`: a JSON header line, then the bytes).

use crate::sync::LockExt;
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// One block blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    /// The content.
    pub content: Bytes,
    /// Content type.
    pub content_type: String,
    /// Metadata (names lower-cased as the service stores them).
    pub metadata: BTreeMap<String, String>,
    /// Blob index tags (`x-ms-tags`, Set Blob Tags).
    pub tags: BTreeMap<String, String>,
    /// Entity tag (unquoted).
    pub etag: String,
    /// Last modification (whole seconds, like the service).
    pub last_modified: SystemTime,
    /// Creation time.
    pub created: SystemTime,
}

#[derive(Debug, Serialize, Deserialize)]
struct BlobHeader {
    content_type: String,
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    tags: BTreeMap<String, String>,
    etag: String,
    last_modified_s: u64,
    created_s: u64,
}

/// What Put Blob writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewBlob {
    /// The content.
    pub content: Bytes,
    /// Content type.
    pub content_type: String,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
    /// Blob index tags: Put Blob replaces the blob, tags included (none given: none kept).
    pub tags: BTreeMap<String, String>,
}

impl NewBlob {
    /// Content of type `content_type` without metadata.
    pub fn new(content: impl Into<Bytes>, content_type: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            content_type: content_type.into(),
            metadata: BTreeMap::new(),
            tags: BTreeMap::new(),
        }
    }
}

/// One page of a listing: the blobs and the marker of the next page.
pub type Page = (Vec<(String, Blob)>, Option<String>);

/// One container.
#[derive(Debug, Clone)]
pub struct Container {
    /// Its blobs by name.
    pub blobs: BTreeMap<String, Blob>,
    /// Entity tag.
    pub etag: String,
    /// Last modification.
    pub last_modified: SystemTime,
}

/// A failed storage operation, as the service names it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlobError {
    /// 404 ContainerNotFound.
    #[error("The specified container does not exist.")]
    ContainerNotFound,
    /// 404 BlobNotFound.
    #[error("The specified blob does not exist.")]
    BlobNotFound,
    /// 409 ContainerAlreadyExists.
    #[error("The specified container already exists.")]
    ContainerAlreadyExists,
    /// 409 BlobAlreadyExists.
    #[error("The specified blob already exists.")]
    BlobAlreadyExists,
    /// 409 ContainerBeingDeleted.
    #[error("The specified container is being deleted. Try operation later.")]
    ContainerBeingDeleted,
    /// 412 ConditionNotMet.
    #[error("The condition specified using HTTP conditional header(s) is not met.")]
    ConditionNotMet,
    /// 500 InternalError (the disk failed).
    #[error("The server encountered an internal error: {0}")]
    Internal(String),
}

/// The conditional headers of a write or delete: `If-Match` / `If-None-Match` and the date
/// conditions `If-Modified-Since` / `If-Unmodified-Since` ("Specifying conditional headers
/// for Blob service operations", learn.microsoft.com: on a write or delete every unmet
/// condition is 412 `ConditionNotMet`, as Azure answered a Delete Blob with
/// `If-Unmodified-Since` in the past in the C++ SDK's recording `DeleteWithConditions`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Conditions {
    /// `If-Match` (an ETag or `*`).
    pub if_match: Option<String>,
    /// `If-None-Match` (an ETag or `*`).
    pub if_none_match: Option<String>,
    /// `If-Modified-Since`: only if the blob changed after this (at whole seconds).
    pub if_modified_since: Option<SystemTime>,
    /// `If-Unmodified-Since`: only if the blob did not change after this.
    pub if_unmodified_since: Option<SystemTime>,
}

fn unquote(s: &str) -> &str {
    s.trim().trim_start_matches("W/").trim_matches('"')
}

impl Conditions {
    /// Checks the conditions against the current blob (`None`: absent). `create` selects Put
    /// Blob's answer for `If-None-Match: *` on an existing blob (409 rather than 412).
    pub fn check(&self, current: Option<&Blob>, create: bool) -> Result<(), BlobError> {
        if let Some(m) = &self.if_match {
            let ok = match current {
                None => false,
                Some(b) => m
                    .split(',')
                    .any(|t| unquote(t) == "*" || unquote(t) == b.etag),
            };
            if !ok {
                return Err(BlobError::ConditionNotMet);
            }
        }
        if let Some(m) = &self.if_none_match {
            if let Some(b) = current {
                let star = m.split(',').any(|t| unquote(t) == "*");
                if star {
                    return Err(if create {
                        BlobError::BlobAlreadyExists
                    } else {
                        BlobError::ConditionNotMet
                    });
                }
                if m.split(',').any(|t| unquote(t) == b.etag) {
                    return Err(BlobError::ConditionNotMet);
                }
            }
        }
        if let Some(b) = current {
            let modified = secs(b.last_modified);
            if self.if_unmodified_since.is_some_and(|t| modified > secs(t))
                || self.if_modified_since.is_some_and(|t| modified <= secs(t))
            {
                return Err(BlobError::ConditionNotMet);
            }
        }
        Ok(())
    }
}

/// All containers of one account.
#[derive(Debug)]
pub struct BlobStore {
    containers: Mutex<BTreeMap<String, Container>>,
    /// Containers deleted, and when: a deletion takes [`DELETING`] on Azure.
    deleting: Mutex<BTreeMap<String, SystemTime>>,
    dir: Option<PathBuf>,
    etags: AtomicU64,
    writes: Mutex<Option<Vec<BlobWrite>>>,
}

/// One successful Put Blob or Set Blob Metadata, as [`BlobStore::record_writes`] keeps them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobWrite {
    /// The container.
    pub container: String,
    /// The blob's name.
    pub name: String,
    /// The blob's metadata after the write.
    pub metadata: BTreeMap<String, String>,
    /// When the write was applied.
    pub at: SystemTime,
}

/// How long a deleted container stays "being deleted": Azure documents at least 30 seconds
/// before the name can be used again ("Delete Container", learn.microsoft.com).
pub const DELETING: Duration = Duration::from_secs(30);

fn whole_seconds(t: SystemTime) -> SystemTime {
    let s = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    SystemTime::UNIX_EPOCH + Duration::from_secs(s)
}

fn secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn hex(name: &str) -> String {
    name.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> = (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect();
    String::from_utf8(bytes?).ok()
}

impl BlobStore {
    /// Opens the store, creating `containers` if they do not exist; with `data_dir`, loads
    /// what a previous run stored.
    pub fn open(
        containers: &[String],
        data_dir: Option<&Path>,
        now: SystemTime,
    ) -> io::Result<Self> {
        let dir = match data_dir {
            Some(d) => {
                let dir = d.join("blob");
                fs::create_dir_all(&dir)?;
                Some(dir)
            }
            None => None,
        };
        let store = Self {
            containers: Mutex::new(BTreeMap::new()),
            deleting: Mutex::new(BTreeMap::new()),
            dir,
            etags: AtomicU64::new(0x8DC0_0000_0000_0000u64.wrapping_add(secs(now) << 16)),
            writes: Mutex::new(None),
        };
        if let Some(dir) = &store.dir {
            let mut all = store.lock();
            for entry in fs::read_dir(dir)? {
                let entry = entry?;
                if !entry.file_type()?.is_dir() {
                    continue;
                }
                let Some(cname) = entry.file_name().to_str().and_then(unhex) else {
                    continue;
                };
                let mut blobs = BTreeMap::new();
                for f in fs::read_dir(entry.path())? {
                    let f = f?;
                    let fname = f.file_name().to_string_lossy().into_owned();
                    let Some(stem) = fname.strip_suffix(".blob") else {
                        continue;
                    };
                    let Some(name) = unhex(stem) else { continue };
                    let data = fs::read(f.path())?;
                    let Some(nl) = data.iter().position(|b| *b == b'\n') else {
                        continue;
                    };
                    let Ok(h) = serde_json::from_slice::<BlobHeader>(&data[..nl]) else {
                        continue;
                    };
                    blobs.insert(
                        name,
                        Blob {
                            content: Bytes::copy_from_slice(&data[nl + 1..]),
                            content_type: h.content_type,
                            metadata: h.metadata,
                            tags: h.tags,
                            etag: h.etag,
                            last_modified: SystemTime::UNIX_EPOCH
                                + Duration::from_secs(h.last_modified_s),
                            created: SystemTime::UNIX_EPOCH + Duration::from_secs(h.created_s),
                        },
                    );
                }
                // Never hand out an ETag a previous run did.
                let highest = blobs
                    .values()
                    .filter_map(|b| u64::from_str_radix(b.etag.trim_start_matches("0x"), 16).ok())
                    .max()
                    .unwrap_or(0);
                store
                    .etags
                    .fetch_max(highest.wrapping_add(1), Ordering::Relaxed);
                all.insert(
                    cname,
                    Container {
                        blobs,
                        etag: store.next_etag(),
                        last_modified: whole_seconds(now),
                    },
                );
            }
        }
        for c in containers {
            let _ = store.create_container(c, now);
        }
        Ok(store)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Container>> {
        self.containers.locked()
    }

    fn next_etag(&self) -> String {
        format!("0x{:X}", self.etags.fetch_add(1, Ordering::Relaxed))
    }

    fn container_dir(&self, container: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(hex(container)))
    }

    fn persist(&self, container: &str, name: &str, blob: Option<&Blob>) -> Result<(), BlobError> {
        let Some(dir) = self.container_dir(container) else {
            return Ok(());
        };
        let io = |e: io::Error| BlobError::Internal(e.to_string());
        let path = dir.join(format!("{}.blob", hex(name)));
        match blob {
            None => match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io(e)),
                _ => Ok(()),
            },
            Some(b) => {
                fs::create_dir_all(&dir).map_err(io)?;
                let header = BlobHeader {
                    content_type: b.content_type.clone(),
                    metadata: b.metadata.clone(),
                    tags: b.tags.clone(),
                    etag: b.etag.clone(),
                    last_modified_s: secs(b.last_modified),
                    created_s: secs(b.created),
                };
                let tmp = path.with_extension("tmp");
                let mut f = fs::File::create(&tmp).map_err(io)?;
                let mut line =
                    serde_json::to_vec(&header).map_err(|e| BlobError::Internal(e.to_string()))?;
                line.push(b'\n');
                f.write_all(&line).map_err(io)?;
                f.write_all(&b.content).map_err(io)?;
                f.sync_data().map_err(io)?;
                fs::rename(&tmp, &path).map_err(io)
            }
        }
    }

    /// Creates a container.
    pub fn create_container(&self, name: &str, now: SystemTime) -> Result<Container, BlobError> {
        let mut all = self.lock();
        if all.contains_key(name) {
            return Err(BlobError::ContainerAlreadyExists);
        }
        let being_deleted = self
            .deleting
            .locked()
            .get(name)
            .is_some_and(|at| now.duration_since(*at).map_or(true, |d| d < DELETING));
        if being_deleted {
            return Err(BlobError::ContainerBeingDeleted);
        }
        if let Some(dir) = self.container_dir(name) {
            fs::create_dir_all(dir).map_err(|e| BlobError::Internal(e.to_string()))?;
        }
        let c = Container {
            blobs: BTreeMap::new(),
            etag: self.next_etag(),
            last_modified: whole_seconds(now),
        };
        all.insert(name.to_string(), c.clone());
        Ok(c)
    }

    /// A container's properties (without its blobs).
    pub fn container(&self, name: &str) -> Result<(String, SystemTime), BlobError> {
        self.lock()
            .get(name)
            .map(|c| (c.etag.clone(), c.last_modified))
            .ok_or(BlobError::ContainerNotFound)
    }

    /// Deletes a container and its blobs. Azure deletes a container in the background: for
    /// [`DELETING`] after a deletion, a Delete Container is accepted again and a Create
    /// Container refused with 409 `ContainerBeingDeleted` ("Delete Container",
    /// learn.microsoft.com/rest/api/storageservices/delete-container).
    pub fn delete_container(&self, name: &str, now: SystemTime) -> Result<(), BlobError> {
        let mut all = self.lock();
        let mut deleting = self.deleting.locked();
        deleting.retain(|_, at| now.duration_since(*at).map_or(true, |d| d < DELETING));
        if all.remove(name).is_none() {
            return if deleting.contains_key(name) {
                Ok(())
            } else {
                Err(BlobError::ContainerNotFound)
            };
        }
        deleting.insert(name.to_string(), now);
        if let Some(dir) = self.container_dir(name) {
            let _ = fs::remove_dir_all(dir);
        }
        Ok(())
    }

    /// A blob.
    pub fn get(&self, container: &str, name: &str) -> Result<Blob, BlobError> {
        let all = self.lock();
        let c = all.get(container).ok_or(BlobError::ContainerNotFound)?;
        c.blobs.get(name).cloned().ok_or(BlobError::BlobNotFound)
    }

    /// From now on, keep a history of every successful write (for tests and the chaos soak,
    /// which check checkpoint writes against what was settled at the time).
    pub fn record_writes(&self) {
        let mut w = self.writes.locked();
        w.get_or_insert_with(Vec::new);
    }

    /// The writes recorded since [`record_writes`](Self::record_writes), oldest first.
    pub fn writes(&self) -> Vec<BlobWrite> {
        self.writes.locked().clone().unwrap_or_default()
    }

    fn log_write(&self, container: &str, name: &str, blob: &Blob) {
        let mut w = self.writes.locked();
        if let Some(w) = w.as_mut() {
            w.push(BlobWrite {
                container: container.to_string(),
                name: name.to_string(),
                metadata: blob.metadata.clone(),
                at: SystemTime::now(),
            });
        }
    }

    /// Put Blob: creates or replaces a blob, subject to `conditions`.
    pub fn put(
        &self,
        container: &str,
        name: &str,
        new: NewBlob,
        conditions: &Conditions,
        now: SystemTime,
    ) -> Result<Blob, BlobError> {
        let NewBlob {
            content,
            content_type,
            metadata,
            tags,
        } = new;
        let mut all = self.lock();
        let c = all.get_mut(container).ok_or(BlobError::ContainerNotFound)?;
        let current = c.blobs.get(name);
        conditions.check(current, true)?;
        let blob = Blob {
            content,
            content_type,
            metadata,
            tags,
            etag: self.next_etag(),
            last_modified: whole_seconds(now),
            created: current.map_or(whole_seconds(now), |b| b.created),
        };
        self.persist(container, name, Some(&blob))?;
        self.log_write(container, name, &blob);
        c.blobs.insert(name.to_string(), blob.clone());
        Ok(blob)
    }

    /// Set Blob Metadata: replaces all metadata, subject to `conditions`.
    pub fn set_metadata(
        &self,
        container: &str,
        name: &str,
        metadata: BTreeMap<String, String>,
        conditions: &Conditions,
        now: SystemTime,
    ) -> Result<Blob, BlobError> {
        let mut all = self.lock();
        let c = all.get_mut(container).ok_or(BlobError::ContainerNotFound)?;
        let current = c.blobs.get(name).ok_or(BlobError::BlobNotFound)?;
        conditions.check(Some(current), false)?;
        let mut blob = current.clone();
        blob.metadata = metadata;
        blob.etag = self.next_etag();
        blob.last_modified = whole_seconds(now);
        self.persist(container, name, Some(&blob))?;
        self.log_write(container, name, &blob);
        c.blobs.insert(name.to_string(), blob.clone());
        Ok(blob)
    }

    /// Set Blob Tags: replaces all of the blob's index tags. As on Azure, neither the ETag nor
    /// Last-Modified changes ("Set Blob Tags", learn.microsoft.com/rest/api/storageservices/
    /// set-blob-tags).
    pub fn set_tags(
        &self,
        container: &str,
        name: &str,
        tags: BTreeMap<String, String>,
    ) -> Result<Blob, BlobError> {
        let mut all = self.lock();
        let c = all.get_mut(container).ok_or(BlobError::ContainerNotFound)?;
        let current = c.blobs.get(name).ok_or(BlobError::BlobNotFound)?;
        let mut blob = current.clone();
        blob.tags = tags;
        self.persist(container, name, Some(&blob))?;
        c.blobs.insert(name.to_string(), blob.clone());
        Ok(blob)
    }

    /// Delete Blob, subject to `conditions`.
    pub fn delete(
        &self,
        container: &str,
        name: &str,
        conditions: &Conditions,
    ) -> Result<(), BlobError> {
        let mut all = self.lock();
        let c = all.get_mut(container).ok_or(BlobError::ContainerNotFound)?;
        let current = c.blobs.get(name).ok_or(BlobError::BlobNotFound)?;
        conditions.check(Some(current), false)?;
        self.persist(container, name, None)?;
        c.blobs.remove(name);
        Ok(())
    }

    /// Up to `max` blobs whose names start with `prefix`, from `marker` on; and the marker
    /// of the next page.
    pub fn list(
        &self,
        container: &str,
        prefix: &str,
        marker: Option<&str>,
        max: usize,
    ) -> Result<Page, BlobError> {
        let all = self.lock();
        let c = all.get(container).ok_or(BlobError::ContainerNotFound)?;
        let start = marker.unwrap_or(prefix);
        let mut items = c
            .blobs
            .range(start.to_string()..)
            .take_while(|(n, _)| n.starts_with(prefix))
            .map(|(n, b)| (n.clone(), b.clone()));
        let page: Vec<_> = items.by_ref().take(max.max(1)).collect();
        let next = items.next().map(|(n, _)| n);
        Ok((page, next))
    }

    /// Names of all containers.
    pub fn container_names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> BlobStore {
        BlobStore::open(&["c".into()], None, SystemTime::now()).unwrap()
    }

    #[test]
    fn conditional_writes_follow_the_service() {
        let s = store();
        let now = SystemTime::now();
        let create = Conditions {
            if_none_match: Some("*".into()),
            ..Default::default()
        };
        let b = s
            .put(
                "c",
                "k",
                NewBlob {
                    content: Bytes::from_static(b"1"),
                    content_type: "text/plain".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &create,
                now,
            )
            .unwrap();
        assert_eq!(
            s.put(
                "c",
                "k",
                NewBlob {
                    content: Bytes::new(),
                    content_type: "x".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &create,
                now
            ),
            Err(BlobError::BlobAlreadyExists)
        );
        let stale = Conditions {
            if_match: Some("\"0xdead\"".into()),
            ..Default::default()
        };
        assert_eq!(
            s.put(
                "c",
                "k",
                NewBlob {
                    content: Bytes::new(),
                    content_type: "x".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &stale,
                now
            ),
            Err(BlobError::ConditionNotMet)
        );
        let fresh = Conditions {
            if_match: Some(format!("\"{}\"", b.etag)),
            ..Default::default()
        };
        let b2 = s
            .put(
                "c",
                "k",
                NewBlob {
                    content: Bytes::from_static(b"2"),
                    content_type: "x".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &fresh,
                now,
            )
            .unwrap();
        assert_ne!(b.etag, b2.etag);
        // Unquoted ETags (as listed in XML) match too.
        let unquoted = Conditions {
            if_match: Some(b2.etag.clone()),
            ..Default::default()
        };
        s.set_metadata(
            "c",
            "k",
            BTreeMap::from([("a".into(), "b".into())]),
            &unquoted,
            now,
        )
        .unwrap();
        assert_eq!(
            s.set_metadata("c", "missing", BTreeMap::new(), &Conditions::default(), now),
            Err(BlobError::BlobNotFound)
        );
        let absent_match = Conditions {
            if_match: Some("*".into()),
            ..Default::default()
        };
        assert_eq!(
            s.put(
                "c",
                "new",
                NewBlob {
                    content: Bytes::new(),
                    content_type: "x".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &absent_match,
                now
            ),
            Err(BlobError::ConditionNotMet)
        );
        assert_eq!(s.get("nope", "k"), Err(BlobError::ContainerNotFound));
    }

    #[test]
    fn listing_pages_by_prefix() {
        let s = store();
        let now = SystemTime::now();
        for n in ["a/1", "a/2", "a/3", "b/1"] {
            s.put(
                "c",
                n,
                NewBlob {
                    content: Bytes::new(),
                    content_type: "x".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &Conditions::default(),
                now,
            )
            .unwrap();
        }
        let (page, next) = s.list("c", "a/", None, 2).unwrap();
        assert_eq!(
            page.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            vec!["a/1", "a/2"]
        );
        assert_eq!(next.as_deref(), Some("a/3"));
        let (page, next) = s.list("c", "a/", next.as_deref(), 2).unwrap();
        assert_eq!(page.len(), 1);
        assert_eq!(next, None);
    }

    #[test]
    fn durable_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        let etag = {
            let s = BlobStore::open(&["c".into()], Some(dir.path()), now).unwrap();
            s.put(
                "c",
                "ns/hub/$Default/checkpoint/0",
                NewBlob {
                    content: Bytes::from_static(b"{}"),
                    content_type: "application/json".into(),
                    metadata: BTreeMap::from([("offset".into(), "42".into())]),
                    tags: BTreeMap::new(),
                },
                &Conditions::default(),
                now,
            )
            .unwrap();
            s.put(
                "c",
                "gone",
                NewBlob {
                    content: Bytes::new(),
                    content_type: "x".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &Conditions::default(),
                now,
            )
            .unwrap();
            s.delete("c", "gone", &Conditions::default()).unwrap();
            s.get("c", "ns/hub/$Default/checkpoint/0").unwrap().etag
        };
        let s = BlobStore::open(&["c".into()], Some(dir.path()), now).unwrap();
        let b = s.get("c", "ns/hub/$Default/checkpoint/0").unwrap();
        assert_eq!(b.etag, etag);
        assert_eq!(b.metadata.get("offset").map(String::as_str), Some("42"));
        assert_eq!(&b.content[..], b"{}");
        assert_eq!(s.get("c", "gone"), Err(BlobError::BlobNotFound));
        // New writes get fresh ETags, never one already handed out.
        let b2 = s
            .put(
                "c",
                "x",
                NewBlob {
                    content: Bytes::new(),
                    content_type: "x".into(),
                    metadata: BTreeMap::new(),
                    tags: BTreeMap::new(),
                },
                &Conditions::default(),
                now,
            )
            .unwrap();
        assert_ne!(b2.etag, etag);
    }
}
