//! In-memory twins of hubguard's storage traits — [`MemoryRecordStore`] for [`RecordStore`]
//! and [`MemoryRetryQueue`] for [`RetryQueue`] — as the Azure SDK ships an in-memory
//! checkpoint store: the same contracts (compare-and-swap with ETags; scheduled messages,
//! duplicate detection by MessageId, peek-lock with expiry, a dead-letter sub-queue at the
//! delivery limit) without a network, for fast tests of the settlement and retry logic and
//! for users who test their own handler against the pipeline's rules.
//!
//! Policy time is a [`Clock`]: tests advance it to make messages due or locks lapse.

use crate::sync::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use super::record_store::{Listed, Record, RecordStore, StoreError, Tags};
use super::retry_queue::{
    MessageLock, OutgoingMessage, ReceivedMessage, RetryQueue, RetryQueueError,
};
use crate::clock::Clock;

/// [`RecordStore`] in memory.
#[derive(Debug, Default)]
pub struct MemoryRecordStore {
    records: Mutex<BTreeMap<String, (Bytes, u64, Tags)>>,
    next_etag: std::sync::atomic::AtomicU64,
    reads: std::sync::atomic::AtomicU64,
}

impl MemoryRecordStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn etag(&self) -> u64 {
        self.next_etag
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// How many reads it has answered (a test counts what a step costs).
    #[cfg(test)]
    pub fn reads(&self) -> u64 {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Replaces a record's bytes unconditionally (for tests that corrupt a record).
    #[cfg(test)]
    pub fn overwrite(&self, key: &str, body: Bytes) {
        let etag = self.etag();
        self.lock()
            .insert(key.to_string(), (body, etag, Tags::new()));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Bytes, u64, Tags)>> {
        self.records.locked()
    }
}

#[async_trait]
impl RecordStore for MemoryRecordStore {
    async fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.lock().get(key).map(|(body, etag, _)| Record {
            body: body.clone(),
            etag: etag.to_string(),
        }))
    }

    async fn create(&self, key: &str, body: Bytes) -> Result<String, StoreError> {
        self.write_tagged(key, body, None, &Tags::new()).await
    }

    async fn update(&self, key: &str, body: Bytes, etag: &str) -> Result<String, StoreError> {
        self.write_tagged(key, body, Some(etag), &Tags::new()).await
    }

    async fn delete(&self, key: &str, etag: &str) -> Result<(), StoreError> {
        let mut records = self.lock();
        match records.get(key) {
            None => Err(StoreError::NotFound),
            Some((_, current, _)) if current.to_string() != etag => Err(StoreError::Conflict),
            Some(_) => {
                records.remove(key);
                Ok(())
            }
        }
    }

    async fn remove(&self, key: &str) -> Result<(), StoreError> {
        self.lock().remove(key);
        Ok(())
    }

    async fn list_page(
        &self,
        prefix: &str,
        marker: Option<&str>,
    ) -> Result<(Vec<Listed>, Option<String>), StoreError> {
        /// Blobs per List Blobs page, as on Azure.
        const PAGE: usize = 5_000;
        let records = self.lock();
        let start = marker.unwrap_or(prefix).to_string();
        let mut items = records
            .range(start..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (_, etag, tags))| Listed {
                key: k.clone(),
                etag: etag.to_string(),
                last_modified: None,
                tags: tags.clone(),
            });
        let page: Vec<Listed> = items.by_ref().take(PAGE).collect();
        let next = items.next().map(|l| l.key);
        Ok((page, next))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        Ok(self
            .lock()
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (_, etag, tags))| Listed {
                key: k.clone(),
                etag: etag.to_string(),
                last_modified: None,
                tags: tags.clone(),
            })
            .collect())
    }

    async fn write_tagged(
        &self,
        key: &str,
        body: Bytes,
        etag: Option<&str>,
        tags: &Tags,
    ) -> Result<String, StoreError> {
        let new = self.etag();
        let mut records = self.lock();
        match (etag, records.get(key)) {
            (None, Some(_)) => return Err(StoreError::Conflict),
            // If-Match on a record that is gone: it changed under the caller.
            (Some(_), None) => return Err(StoreError::Conflict),
            (Some(e), Some((_, current, _))) if current.to_string() != e => {
                return Err(StoreError::Conflict)
            }
            _ => {}
        }
        records.insert(key.to_string(), (body, new, tags.clone()));
        Ok(new.to_string())
    }
}

#[derive(Debug, Clone)]
struct Stored {
    message: OutgoingMessage,
    sequence_number: i64,
    visible_at: SystemTime,
    delivery_count: u32,
    lock: Option<(String, SystemTime)>,
}

#[derive(Debug, Default)]
struct QueueState {
    main: Vec<Stored>,
    dead_letters: Vec<Stored>,
    /// MessageId → when it was accepted (duplicate detection).
    seen: HashMap<String, SystemTime>,
    next_sequence: i64,
    next_lock: u64,
    /// Every accepted send's MessageId, oldest first.
    accepted: Vec<String>,
}

/// [`RetryQueue`] in memory, with Service Bus's semantics: a message scheduled for later is
/// invisible until due; a MessageId seen inside the duplicate-detection window is dropped; a
/// receive locks a message for the lock duration; a message delivered `max_delivery_count`
/// times without being completed moves to the dead-letter sub-queue.
#[derive(Debug)]
pub struct MemoryRetryQueue {
    state: Arc<Mutex<QueueState>>,
    clock: Arc<Clock>,
    lock_duration: Duration,
    max_delivery_count: u32,
    duplicate_window: Duration,
}

impl MemoryRetryQueue {
    /// A queue on `clock` with Service Bus's defaults: 60 s locks, 10 deliveries, a 10-minute
    /// duplicate-detection window.
    pub fn new(clock: Arc<Clock>) -> Self {
        Self {
            state: Arc::default(),
            clock,
            lock_duration: Duration::from_secs(60),
            max_delivery_count: 10,
            duplicate_window: Duration::from_secs(600),
        }
    }

    /// Sets how many deliveries a message gets before it is dead-lettered.
    pub fn with_max_delivery_count(mut self, n: u32) -> Self {
        self.max_delivery_count = n.max(1);
        self
    }

    /// The MessageIds of every accepted send, oldest first (duplicates dropped are not).
    pub fn accepted(&self) -> Vec<String> {
        self.lock().accepted.clone()
    }

    /// Messages waiting or locked in the queue (not the dead-letter sub-queue).
    pub fn len(&self) -> usize {
        self.lock().main.len()
    }

    /// Whether the queue is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bodies of the messages in the queue, in sequence order.
    pub fn bodies(&self) -> Vec<String> {
        self.lock()
            .main
            .iter()
            .map(|s| s.message.body.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.locked()
    }

    fn take(&self, dead_letter: bool) -> Option<ReceivedMessage> {
        let now = self.clock.now();
        let mut st = self.lock();
        let st = &mut *st;
        // Expired locks end: a message delivered too often moves to the dead letters.
        let mut i = 0;
        while i < st.main.len() {
            let expired = st.main[i]
                .lock
                .as_ref()
                .is_some_and(|(_, until)| *until <= now);
            if expired {
                st.main[i].lock = None;
                if st.main[i].delivery_count >= self.max_delivery_count {
                    let m = st.main.remove(i);
                    st.dead_letters.push(m);
                    continue;
                }
            }
            i += 1;
        }
        let entity = if dead_letter {
            &mut st.dead_letters
        } else {
            &mut st.main
        };
        let m = entity
            .iter_mut()
            .filter(|m| m.lock.is_none() && m.visible_at <= now)
            .min_by_key(|m| m.sequence_number)?;
        st.next_lock += 1;
        let token = format!("lock-{}", st.next_lock);
        let until = now + self.lock_duration;
        m.lock = Some((token.clone(), until));
        m.delivery_count += 1;
        let mut received = ReceivedMessage::new(
            m.message.message_id.clone(),
            m.message.body.clone(),
            until,
            Box::new(MemoryLock {
                state: self.state.clone(),
                clock: self.clock.clone(),
                sequence_number: m.sequence_number,
                token,
                dead_letter,
                lock_duration: self.lock_duration,
            }),
        );
        received.correlation_id = m.message.correlation_id.clone();
        received.label = m.message.label.clone();
        received.delivery_count = m.delivery_count;
        received.sequence_number = m.sequence_number;
        received.enqueued_at = Some(m.visible_at);
        received.properties = m.message.properties.iter().cloned().collect();
        Some(received)
    }
}

#[async_trait]
impl RetryQueue for MemoryRetryQueue {
    async fn schedule(&self, message: OutgoingMessage) -> Result<(), RetryQueueError> {
        let now = self.clock.now();
        let mut st = self.lock();
        let window = self.duplicate_window;
        st.seen
            .retain(|_, at| now.duration_since(*at).unwrap_or_default() < window);
        if st.seen.contains_key(&message.message_id) {
            return Ok(()); // dropped, as Service Bus answers a duplicate: accepted
        }
        st.seen.insert(message.message_id.clone(), now);
        st.accepted.push(message.message_id.clone());
        st.next_sequence += 1;
        let sequence_number = st.next_sequence;
        // As ServiceBusRetryQueue sends it: a due time not in the future is "now"; a later
        // one is rounded up to the whole second Service Bus schedules at.
        let visible_at = if message.due > now {
            crate::clock::ceil_to_second(message.due)
        } else {
            now
        };
        st.main.push(Stored {
            message,
            sequence_number,
            visible_at,
            delivery_count: 0,
            lock: None,
        });
        Ok(())
    }

    async fn receive(&self, wait: Duration) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        if let Some(m) = self.take(false) {
            return Ok(Some(m));
        }
        if wait.is_zero() {
            return Ok(None);
        }
        // Wait on policy time: an advance of the clock makes messages due at once.
        tokio::select! {
            _ = self.clock.sleep(wait) => {}
            _ = self.clock.advanced() => {}
        }
        Ok(self.take(false))
    }

    async fn receive_dead_lettered(
        &self,
        _wait: Duration,
    ) -> Result<Option<ReceivedMessage>, RetryQueueError> {
        Ok(self.take(true))
    }
}

struct MemoryLock {
    state: Arc<Mutex<QueueState>>,
    clock: Arc<Clock>,
    sequence_number: i64,
    token: String,
    dead_letter: bool,
    lock_duration: Duration,
}

impl MemoryLock {
    fn with<T>(&self, f: impl FnOnce(&mut Vec<Stored>, usize) -> T) -> Result<T, RetryQueueError> {
        let now = self.clock.now();
        let mut st = self.state.locked();
        let entity = if self.dead_letter {
            &mut st.dead_letters
        } else {
            &mut st.main
        };
        let i = entity
            .iter()
            .position(|m| {
                m.sequence_number == self.sequence_number
                    && m.lock
                        .as_ref()
                        .is_some_and(|(t, until)| *t == self.token && *until > now)
            })
            .ok_or(RetryQueueError::LockLost)?;
        Ok(f(entity, i))
    }
}

#[async_trait]
impl MessageLock for MemoryLock {
    async fn complete(&self) -> Result<(), RetryQueueError> {
        self.with(|entity, i| {
            entity.remove(i);
        })
    }

    async fn abandon(&self) -> Result<(), RetryQueueError> {
        self.with(|entity, i| entity[i].lock = None)
    }

    async fn renew(&self) -> Result<SystemTime, RetryQueueError> {
        let until = self.clock.now() + self.lock_duration;
        self.with(|entity, i| {
            if let Some((_, u)) = entity[i].lock.as_mut() {
                *u = until;
            }
            until
        })
    }
}

#[cfg(test)]
mod tests {

    #[tokio::test]
    async fn a_listing_walked_page_by_page_returns_each_record_once() {
        use crate::azure::RecordStore as _;
        let store = MemoryRecordStore::new();
        for i in 0..12_000 {
            store
                .create(&format!("p/{i:05}"), Bytes::from_static(b"x"))
                .await
                .unwrap();
        }
        store.create("q/other", Bytes::new()).await.unwrap();
        let (mut seen, mut sizes, mut marker) = (Vec::new(), Vec::new(), None::<String>);
        loop {
            let (page, next) = store.list_page("p/", marker.as_deref()).await.unwrap();
            sizes.push(page.len());
            seen.extend(page.into_iter().map(|l| l.key));
            match next {
                Some(n) => marker = Some(n),
                None => break,
            }
        }
        assert_eq!(sizes, vec![5_000, 5_000, 2_000]);
        let all: Vec<String> = store
            .list("p/")
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect();
        assert_eq!(seen, all);
    }

    use super::*;

    fn message(id: &str, due: SystemTime) -> OutgoingMessage {
        OutgoingMessage {
            message_id: id.into(),
            correlation_id: None,
            label: None,
            body: format!("body of {id}"),
            content_type: None,
            due,
            time_to_live: None,
            properties: Vec::new(),
        }
    }

    #[tokio::test]
    async fn records_compare_and_swap_like_blob_storage() {
        let s = MemoryRecordStore::new();
        let e1 = s.create("a", Bytes::from_static(b"1")).await.unwrap();
        assert_eq!(
            s.create("a", Bytes::from_static(b"x")).await,
            Err(StoreError::Conflict)
        );
        let e2 = s.update("a", Bytes::from_static(b"2"), &e1).await.unwrap();
        assert_eq!(
            s.update("a", Bytes::from_static(b"3"), &e1).await,
            Err(StoreError::Conflict)
        );
        assert_eq!(
            s.read("a").await.unwrap().unwrap().body,
            Bytes::from_static(b"2")
        );
        let mut tags = Tags::new();
        tags.insert("t".into(), "v".into());
        s.write_tagged("b/1", Bytes::new(), None, &tags)
            .await
            .unwrap();
        let listed = s.list("b/").await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].tags, tags);
        assert_eq!(s.delete("a", &e1).await, Err(StoreError::Conflict));
        s.delete("a", &e2).await.unwrap();
        assert_eq!(s.read("a").await.unwrap(), None);
    }

    #[tokio::test]
    async fn messages_come_due_on_the_clock_and_duplicates_are_dropped() {
        let clock = Arc::new(Clock::default());
        let q = MemoryRetryQueue::new(clock.clone());
        let due = clock.now() + Duration::from_secs(30);
        q.schedule(message("m-1", due)).await.unwrap();
        q.schedule(message("m-1", due)).await.unwrap();
        assert_eq!(q.accepted(), vec!["m-1"]);
        assert!(q.receive(Duration::ZERO).await.unwrap().is_none());
        clock.advance(Duration::from_secs(31));
        let m = q.receive(Duration::ZERO).await.unwrap().unwrap();
        assert_eq!((m.message_id.as_str(), m.delivery_count), ("m-1", 1));
        assert!(q.receive(Duration::ZERO).await.unwrap().is_none(), "locked");
        m.complete().await.unwrap();
        assert!(q.is_empty());
        assert_eq!(m.complete().await, Err(RetryQueueError::LockLost));
    }

    #[tokio::test]
    async fn a_message_never_completed_is_dead_lettered_at_the_delivery_limit() {
        let clock = Arc::new(Clock::default());
        let q = MemoryRetryQueue::new(clock.clone()).with_max_delivery_count(2);
        q.schedule(message("m", clock.now())).await.unwrap();
        for _ in 0..2 {
            let m = q.receive(Duration::ZERO).await.unwrap().unwrap();
            drop(m);
            clock.advance(Duration::from_secs(61)); // the lock lapses
        }
        assert!(q.receive(Duration::ZERO).await.unwrap().is_none());
        let d = q
            .receive_dead_lettered(Duration::ZERO)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(d.message_id, "m");
        d.complete().await.unwrap();
    }
}
