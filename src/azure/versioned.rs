//! One way to change a record: a value and the ETag it was read with ([`Versioned`]), and
//! the one compare-and-swap update every record kind uses ([`compare_and_swap`]) — read,
//! decide, write with `If-None-Match: *` (no record) or `If-Match: <etag>`, and when someone
//! else wrote first (412/409, [`StoreError::Conflict`]) read and decide again, at most
//! [`ROUNDS`] times before [`Contended`] names the record.
//!
//! A record kind says how its record is read and written ([`RecordKind`]): the ledger's
//! records, ordered retries' line pointers, the operator's control record, a downstream's
//! breaker and rate limit. [`Json`] is the plain kind: a serde value in one blob.

use std::marker::PhantomData;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};

use super::record_store::{RecordStore, StoreError};

/// Compare-and-swap rounds of one [`compare_and_swap`] before it gives up ([`Contended`]).
pub const ROUNDS: usize = 16;

/// A value and the ETag it was read (or written) with, for a later conditional write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    /// The value.
    pub value: T,
    /// Its ETag.
    pub etag: String,
}

impl<T> Versioned<T> {
    /// `value` as of `etag`.
    pub fn new(value: T, etag: impl Into<String>) -> Self {
        Self {
            value,
            etag: etag.into(),
        }
    }
}

/// What an update does with the value it was shown.
#[derive(Debug)]
pub enum Change<T, R> {
    /// Write this value (create the record if there was none), then return `R`.
    Write(Box<T>, R),
    /// Write nothing; return `R`.
    Keep(R),
}

/// Where an update starts.
#[derive(Debug)]
pub enum Start<T> {
    /// Read the record first.
    Read,
    /// From what the caller already read (`None`: known not to exist): no read unless the
    /// write finds it changed (the write's condition proves it did not).
    From(Option<Versioned<T>>),
}

impl<T> From<Option<Versioned<T>>> for Start<T> {
    /// `None`: nothing read yet ([`Start::Read`]); `Some`: start from that version.
    fn from(read: Option<Versioned<T>>) -> Self {
        match read {
            None => Self::Read,
            Some(v) => Self::From(Some(v)),
        }
    }
}

/// What an update did.
#[derive(Debug)]
pub struct Swapped<T, R> {
    /// What the decision returned.
    pub value: R,
    /// The value written and its new ETag (`None`: the decision kept the record).
    pub written: Option<Versioned<T>>,
}

/// The record kept changing under an update: [`ROUNDS`] writes lost.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the record {record} kept changing ({ROUNDS} compare-and-swap rounds lost)")]
pub struct Contended {
    /// The record (its name, or the key it is kept under).
    pub record: String,
}

/// An error that can say a conditional write lost to someone else's (412/409).
pub trait Conflicts {
    /// Whether it does.
    fn is_conflict(&self) -> bool;
}

impl Conflicts for StoreError {
    fn is_conflict(&self) -> bool {
        matches!(self, StoreError::Conflict)
    }
}

/// How one kind of record is read and conditionally written.
#[async_trait]
pub trait RecordKind: Send + Sync {
    /// The record's value.
    type Value: Send + Sync;
    /// Why a read or write failed.
    type Error: Send;
    /// The record, as [`Contended`] names it.
    fn name(&self) -> String;
    /// The record as it is now, with its ETag (`None`: there is none).
    async fn read(&self) -> Result<Option<Versioned<Self::Value>>, Self::Error>;
    /// Writes `value`: creates the record when `etag` is `None`, else replaces it if it
    /// still has `etag`. Returns the new ETag.
    async fn write(&self, value: &Self::Value, etag: Option<&str>) -> Result<String, Self::Error>;
    /// Whether a failed write lost to someone else's (412/409): read and decide again.
    fn lost(&self, e: &Self::Error) -> bool;
    /// The error of an update whose every round lost (a kind whose error is a
    /// [`StoreError`] says [`StoreError::Conflict`]).
    fn contended(&self, lost: Contended) -> Self::Error;
}

/// The one compare-and-swap update: from `start`, shows `decide` the record as it is (`None`:
/// there is none) and writes what it decides with the record's ETag as the condition; a write
/// that lost reads the record again and decides again, at most [`ROUNDS`] times.
pub async fn compare_and_swap<K: RecordKind, R>(
    kind: &K,
    start: Start<K::Value>,
    mut decide: impl FnMut(Option<K::Value>) -> Change<K::Value, R>,
) -> Result<Swapped<K::Value, R>, K::Error> {
    let mut known = match start {
        Start::Read => None,
        Start::From(read) => Some(read),
    };
    for _ in 0..ROUNDS {
        let current = match known.take() {
            Some(read) => read,
            None => kind.read().await?,
        };
        let (value, etag) = match current {
            Some(Versioned { value, etag }) => (Some(value), Some(etag)),
            None => (None, None),
        };
        let (next, value) = match decide(value) {
            Change::Keep(value) => {
                return Ok(Swapped {
                    value,
                    written: None,
                })
            }
            Change::Write(next, value) => (next, value),
        };
        match kind.write(&next, etag.as_deref()).await {
            Ok(etag) => {
                return Ok(Swapped {
                    value,
                    written: Some(Versioned::new(*next, etag)),
                })
            }
            Err(e) if kind.lost(&e) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(kind.contended(Contended {
        record: kind.name(),
    }))
}

/// A serde value kept as JSON in one blob of a [`RecordStore`]. A body that does not parse
/// is judged by the function [`Json::new`] was given: an error, or a default value.
pub struct Json<'a, T, E = StoreError> {
    store: &'a dyn RecordStore,
    name: &'a str,
    corrupt: fn(&str, serde_json::Error) -> Result<T, E>,
    _value: PhantomData<fn() -> (T, E)>,
}

impl<'a, T: Default> Json<'a, T, StoreError> {
    /// The record `name` in `store`; a body that does not parse reads as the default value.
    pub fn lenient(store: &'a dyn RecordStore, name: &'a str) -> Self {
        Self::new(store, name, |_, _| Ok(T::default()))
    }
}

impl<'a, T, E> Json<'a, T, E> {
    /// The record `name` in `store`; a body that does not parse is what `corrupt` makes of
    /// the record's name and the parser's error.
    pub fn new(
        store: &'a dyn RecordStore,
        name: &'a str,
        corrupt: fn(&str, serde_json::Error) -> Result<T, E>,
    ) -> Self {
        Self {
            store,
            name,
            corrupt,
            _value: PhantomData,
        }
    }
}

impl<T, E> Json<'_, T, E>
where
    T: Serialize + DeserializeOwned + Send + Sync,
    E: From<StoreError> + Send,
{
    /// The record as it is now, with its ETag (`None`: there is none).
    pub async fn read(&self) -> Result<Option<Versioned<T>>, E> {
        let Some(r) = self.store.read(self.name).await? else {
            return Ok(None);
        };
        let value = match serde_json::from_slice(&r.body) {
            Ok(v) => v,
            Err(e) => (self.corrupt)(self.name, e)?,
        };
        Ok(Some(Versioned::new(value, r.etag)))
    }

    /// Writes `value`: creates the record when `etag` is `None`, else replaces it if it
    /// still has `etag`. Returns the new ETag.
    pub async fn write(&self, value: &T, etag: Option<&str>) -> Result<String, E> {
        let body = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
        Ok(match etag {
            Some(e) => self.store.update(self.name, body, e).await?,
            None => self.store.create(self.name, body).await?,
        })
    }
}

#[async_trait]
impl<T, E> RecordKind for Json<'_, T, E>
where
    T: Serialize + DeserializeOwned + Send + Sync,
    E: From<StoreError> + From<Contended> + Conflicts + Send,
{
    type Value = T;
    type Error = E;

    fn name(&self) -> String {
        self.name.to_string()
    }

    async fn read(&self) -> Result<Option<Versioned<T>>, E> {
        Json::read(self).await
    }

    async fn write(&self, value: &T, etag: Option<&str>) -> Result<String, E> {
        Json::write(self, value, etag).await
    }

    fn lost(&self, e: &E) -> bool {
        e.is_conflict()
    }

    fn contended(&self, lost: Contended) -> E {
        lost.into()
    }
}
