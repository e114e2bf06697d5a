//! The Service Bus broker model: queues with scheduled messages, duplicate detection,
//! peek-lock, delivery counts, time to live and a dead-letter sub-queue — the service's
//! semantics, independent of HTTP. Every time comes from the emulator [`Clock`].
//!
//! This module holds the message types and the operations on a [`Queue`] and the
//! [`Broker`]; `spec` a queue's configuration and Azure's limits, `store` one entity's
//! indexed messages, `state` what time and duplicate detection do to a queue, and `journal`
//! a durable queue's records, replay and compaction.

mod journal;
mod spec;
mod state;
mod store;

use crate::sync::LockExt;
use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use self::journal::{entity_code, JournalRecord};
pub use self::spec::{limits, QueueSpec, QueueSpecError};
use self::state::QueueState;
use self::store::{ms, Lock};
use crate::emulator::clock::Clock;

/// A message as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredMessage {
    /// Sequence number in its entity, from 1.
    pub sequence_number: i64,
    /// MessageId (generated when the sender gave none).
    pub message_id: String,
    /// Body bytes.
    pub body: Vec<u8>,
    /// `Content-Type` of the send.
    pub content_type: Option<String>,
    /// CorrelationId.
    pub correlation_id: Option<String>,
    /// Label (subject).
    pub label: Option<String>,
    /// Time to live as sent, in seconds.
    pub time_to_live: Option<f64>,
    /// When it was sent (ms since the epoch, emulator clock).
    pub sent_at_ms: i64,
    /// When it becomes visible (the scheduled enqueue time, else the send time).
    pub enqueued_at_ms: i64,
    /// Whether it was sent with a ScheduledEnqueueTimeUtc.
    pub scheduled: bool,
    /// Custom properties (lower-cased names).
    pub properties: Vec<(String, String)>,
    /// Deliveries so far.
    pub delivery_count: u32,
    /// Dead-letter reason and description, on the dead-letter sub-queue.
    pub dead_letter: Option<(String, String)>,
    #[serde(skip)]
    lock: Option<Lock>,
}

impl StoredMessage {
    /// Until when a receiver holds it (`None`: not locked).
    pub fn locked_until(&self) -> Option<SystemTime> {
        self.lock.as_ref().map(|l| l.until)
    }
}

/// What a sender provides.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewMessage {
    /// MessageId, if the sender set one.
    pub message_id: Option<String>,
    /// Body bytes.
    pub body: Vec<u8>,
    /// Content type.
    pub content_type: Option<String>,
    /// CorrelationId.
    pub correlation_id: Option<String>,
    /// Label.
    pub label: Option<String>,
    /// Time to live in seconds.
    pub time_to_live: Option<f64>,
    /// ScheduledEnqueueTimeUtc.
    pub scheduled_enqueue_time: Option<SystemTime>,
    /// Custom properties.
    pub properties: Vec<(String, String)>,
}

/// A locked message handed to a receiver.
#[derive(Debug, Clone)]
pub struct Locked {
    /// The message (delivery count already incremented).
    pub message: StoredMessage,
    /// The lock token.
    pub lock_token: String,
    /// Until when the lock holds.
    pub locked_until: SystemTime,
}

/// Counters of one queue, for tests and the demo.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Visible now (or after a lock ends).
    pub active: u64,
    /// Scheduled for later.
    pub scheduled: u64,
    /// Currently locked.
    pub locked: u64,
    /// In the dead-letter sub-queue.
    pub dead_lettered: u64,
    /// Sends dropped by duplicate detection.
    pub duplicates_dropped: u64,
    /// Accepted sends (duplicates included).
    pub sends: u64,
    /// Completed messages.
    pub completes: u64,
    /// Abandoned locks.
    pub abandons: u64,
    /// Messages discarded by time to live.
    pub expired: u64,
    /// The largest body accepted, in bytes.
    pub largest_body: u64,
    /// Peek-lock receives in progress (long polls waiting for a message). A receiver that
    /// died mid-poll leaves its poll here until the poll's timeout, and a message that turns
    /// visible meanwhile is locked for it (and waits out that lock), as a receive in flight
    /// on Service Bus would.
    pub receiving: u64,
}

/// Which entity of a queue a request addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entity {
    /// The queue itself.
    Main,
    /// Its `$DeadLetterQueue`.
    DeadLetter,
}

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BrokerError {
    /// No such queue.
    #[error("the messaging entity '{0}' could not be found")]
    EntityNotFound(String),
    /// The lock token is unknown, stale or expired.
    #[error("the lock supplied is invalid: it expired, or the message was already removed")]
    LockLost,
    /// The operation is not allowed on that entity.
    #[error("{0}")]
    NotAllowed(&'static str),
    /// The journal could not be written.
    #[error("storage failure: {0}")]
    Storage(String),
    /// The request is malformed or breaks a limit on its parts (REST 400).
    #[error("{0}")]
    BadRequest(String),
    /// The message is larger than the queue takes (REST 403, "message too large").
    #[error("{0}")]
    MessageTooLarge(String),
}

/// One queue; its state behind a mutex, its waiters behind a notify.
#[derive(Debug)]
pub struct Queue {
    state: Mutex<QueueState>,
    changed: Notify,
    receiving: std::sync::atomic::AtomicU64,
}

/// A peek-lock receive in progress on a queue: counted from creation until dropped.
pub struct Receiving<'a>(&'a Queue);

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.0
            .receiving
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.locked()
    }

    /// From now on, keep the MessageId and time of every accepted send (not the duplicates
    /// detection dropped), for tests and the chaos soak.
    pub fn record_accepted(&self) {
        self.lock().accepted.get_or_insert_with(Vec::new);
    }

    /// The sends accepted since [`record_accepted`](Self::record_accepted): MessageId and the
    /// broker's time, oldest first.
    pub fn accepted(&self) -> Vec<(String, SystemTime)> {
        self.lock().accepted.clone().unwrap_or_default()
    }

    /// Accepts a send. Returns `false` when duplicate detection dropped it.
    pub fn send(&self, new: NewMessage, now: SystemTime) -> Result<bool, BrokerError> {
        let mut st = self.lock();
        st.counters.sends += 1;
        st.counters.largest_body = st.counters.largest_body.max(new.body.len() as u64);
        let message_id = new
            .message_id
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        if let Some(window) = st.spec.duplicate_detection_window {
            let now_ms = ms(now);
            if st.seen_recently(&message_id, now_ms, window.as_millis() as i64) {
                st.counters.duplicates_dropped += 1;
                return Ok(false);
            }
            st.remember(&message_id, now_ms);
        }
        let enqueued = new
            .scheduled_enqueue_time
            .filter(|t| *t > now)
            .unwrap_or(now);
        let message = StoredMessage {
            sequence_number: 0,
            message_id,
            body: new.body,
            content_type: new.content_type,
            correlation_id: new.correlation_id,
            label: new.label,
            time_to_live: new.time_to_live,
            sent_at_ms: ms(now),
            enqueued_at_ms: ms(enqueued),
            scheduled: new.scheduled_enqueue_time.is_some(),
            properties: new.properties,
            delivery_count: 0,
            dead_letter: None,
            lock: None,
        };
        let seq = st.main.push(message.clone());
        let accepted_id = st.accepted.is_some().then(|| message.message_id.clone());
        let mut journaled = message;
        journaled.sequence_number = seq;
        if let Err(e) = st.write(&JournalRecord::Send {
            entity: 0,
            message: Box::new(journaled),
        }) {
            st.main.remove(seq);
            return Err(e);
        }
        if let (Some(a), Some(id)) = (st.accepted.as_mut(), accepted_id) {
            a.push((id, now));
        }
        drop(st);
        self.changed.notify_waiters();
        Ok(true)
    }

    /// Locks the first visible message, if any.
    pub fn try_lock(&self, entity: Entity, now: SystemTime) -> Result<Option<Locked>, BrokerError> {
        let mut st = self.lock();
        st.settle_time(now)?;
        let lock_duration = st.spec.lock_duration;
        let Some(locked) = st.store(entity).lock_first(now, lock_duration) else {
            return Ok(None);
        };
        let rec = JournalRecord::Delivered {
            entity: entity_code(entity),
            sequence_number: locked.message.sequence_number,
            count: locked.message.delivery_count,
        };
        st.write(&rec)?;
        Ok(Some(locked))
    }

    /// Removes the first visible message (receive-and-delete).
    pub fn take(
        &self,
        entity: Entity,
        now: SystemTime,
    ) -> Result<Option<StoredMessage>, BrokerError> {
        let mut st = self.lock();
        st.settle_time(now)?;
        let Some(&seq) = st.store(entity).visible.first() else {
            return Ok(None);
        };
        st.write(&JournalRecord::Remove {
            entity: entity_code(entity),
            sequence_number: seq,
        })?;
        // This delivery counts, as a lock's does (Azure answered a receive-and-delete after
        // one abandoned lock with `DeliveryCount` 2: tests/it/conformance_servicebus.rs).
        Ok(st.store(entity).remove(seq).map(|mut m| {
            m.delivery_count += 1;
            m
        }))
    }

    fn with_lock<T>(
        &self,
        entity: Entity,
        id: &str,
        token: &str,
        now: SystemTime,
        op: impl FnOnce(&mut QueueState, i64) -> Result<T, BrokerError>,
    ) -> Result<T, BrokerError> {
        let mut st = self.lock();
        let seq = st
            .store(entity)
            .locked(id, token, now)
            .ok_or(BrokerError::LockLost)?;
        op(&mut st, seq)
    }

    /// Completes a locked message.
    pub fn complete(
        &self,
        entity: Entity,
        id: &str,
        token: &str,
        now: SystemTime,
    ) -> Result<(), BrokerError> {
        self.with_lock(entity, id, token, now, |st, seq| {
            st.write(&JournalRecord::Remove {
                entity: entity_code(entity),
                sequence_number: seq,
            })?;
            st.store(entity).remove(seq);
            st.counters.completes += 1;
            Ok(())
        })
    }

    /// Abandons a lock: the message is visible again, or dead-lettered at the delivery limit.
    pub fn abandon(
        &self,
        entity: Entity,
        id: &str,
        token: &str,
        now: SystemTime,
    ) -> Result<(), BrokerError> {
        self.with_lock(entity, id, token, now, |st, seq| {
            st.counters.abandons += 1;
            let max = st.spec.max_delivery_count;
            let count = st
                .store(entity)
                .unlock(seq)
                .expect("found under lock")
                .delivery_count;
            if entity == Entity::Main && count >= max {
                st.move_to_dead_letter(
                    seq,
                    "MaxDeliveryCountExceeded",
                    &format!("Message could not be consumed after {max} delivery attempts."),
                )?;
            }
            Ok(())
        })?;
        self.changed.notify_waiters();
        Ok(())
    }

    /// Renews a lock; returns the new locked-until time.
    pub fn renew(
        &self,
        entity: Entity,
        id: &str,
        token: &str,
        now: SystemTime,
    ) -> Result<SystemTime, BrokerError> {
        self.with_lock(entity, id, token, now, |st, seq| {
            let until = now + st.spec.lock_duration;
            st.store(entity).relock(seq, until);
            Ok(until)
        })
    }

    /// When something next becomes visible in `entity`.
    pub fn next_change(&self, entity: Entity) -> Option<SystemTime> {
        let mut st = self.lock();
        st.store(entity).next_change()
    }

    /// Resolves when a send or an abandon changed the queue.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// The queue's counters at `now`.
    pub fn counters(&self, now: SystemTime) -> Counters {
        let mut st = self.lock();
        let _ = st.settle_time(now);
        let mut c = st.counters;
        c.active = st.main.visible.len() as u64;
        c.scheduled = st.main.waiting.len() as u64;
        c.locked = st.main.locks.len() as u64;
        c.dead_lettered = st.dlq.messages.len() as u64;
        c.receiving = self.receiving.load(std::sync::atomic::Ordering::SeqCst);
        c
    }

    /// Counts a peek-lock receive in progress until the returned guard is dropped.
    pub fn receiving(&self) -> Receiving<'_> {
        self.receiving
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Receiving(self)
    }

    /// The queue's configuration.
    pub fn spec(&self) -> QueueSpec {
        self.lock().spec.clone()
    }

    /// The largest message the queue takes, headers included, in bytes.
    pub fn max_message_bytes(&self) -> usize {
        self.lock().spec.max_message_size_kb as usize * 1024
    }

    /// Every message of `entity` (for tests and the demo's verification).
    pub fn messages(&self, entity: Entity) -> Vec<StoredMessage> {
        let mut st = self.lock();
        st.store(entity).messages.values().cloned().collect()
    }
}

/// All queues of one emulator.
#[derive(Debug)]
pub struct Broker {
    queues: HashMap<String, Arc<Queue>>,
    /// The emulator's clock.
    pub clock: Arc<Clock>,
}

impl Broker {
    /// Opens the queues (replaying journals under `data_dir/servicebus/`).
    pub fn open(
        specs: &[QueueSpec],
        data_dir: Option<&Path>,
        clock: Arc<Clock>,
    ) -> io::Result<Self> {
        let dir = match data_dir {
            Some(d) => {
                let dir = d.join("servicebus");
                fs::create_dir_all(&dir)?;
                Some(dir)
            }
            None => None,
        };
        let mut queues = HashMap::new();
        for spec in specs {
            spec.validate()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let journal = dir
                .as_ref()
                .map(|d| d.join(format!("{}.journal", spec.name.to_ascii_lowercase())));
            let q = Queue::open(spec.clone(), journal)?;
            if queues
                .insert(spec.name.to_ascii_lowercase(), Arc::new(q))
                .is_some()
            {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("queue {} is configured twice", spec.name),
                ));
            }
        }
        Ok(Self { queues, clock })
    }

    /// The queue called `name` (case-insensitive).
    pub fn queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.queues.get(&name.to_ascii_lowercase()).cloned()
    }

    /// Names of all queues.
    pub fn queue_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.queues.values().map(|q| q.spec().name).collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::store::at;
    use super::*;

    fn queue(spec: QueueSpec) -> Queue {
        Queue::open(spec, None).unwrap()
    }

    fn msg(id: &str) -> NewMessage {
        NewMessage {
            message_id: Some(id.into()),
            body: b"x".to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn scheduled_message_is_invisible_until_due() {
        let q = queue(QueueSpec::new("q"));
        let t0 = SystemTime::now();
        let due = t0 + Duration::from_secs(30);
        q.send(
            NewMessage {
                scheduled_enqueue_time: Some(due),
                ..msg("a")
            },
            t0,
        )
        .unwrap();
        assert!(q.try_lock(Entity::Main, t0).unwrap().is_none());
        assert_eq!(q.counters(t0).scheduled, 1);
        assert_eq!(q.next_change(Entity::Main), Some(at(ms(due))));
        let l = q.try_lock(Entity::Main, due).unwrap().unwrap();
        assert_eq!(l.message.enqueued_at_ms, ms(due));
    }

    #[test]
    fn duplicates_inside_the_window_are_dropped() {
        let q = queue(QueueSpec::new("q"));
        let t0 = SystemTime::now();
        assert!(q.send(msg("a"), t0).unwrap());
        assert!(!q.send(msg("a"), t0 + Duration::from_secs(599)).unwrap());
        assert!(q.send(msg("a"), t0 + Duration::from_secs(601)).unwrap());
        let c = q.counters(t0);
        assert_eq!((c.sends, c.duplicates_dropped), (3, 1));
    }

    #[test]
    fn abandon_at_max_delivery_dead_letters() {
        let mut spec = QueueSpec::new("q");
        spec.max_delivery_count = 2;
        let q = queue(spec);
        let t = SystemTime::now();
        q.send(msg("a"), t).unwrap();
        for expected in 1..=2 {
            let l = q.try_lock(Entity::Main, t).unwrap().unwrap();
            assert_eq!(l.message.delivery_count, expected);
            q.abandon(
                Entity::Main,
                &l.message.sequence_number.to_string(),
                &l.lock_token,
                t,
            )
            .unwrap();
        }
        assert!(q.try_lock(Entity::Main, t).unwrap().is_none());
        let d = q.try_lock(Entity::DeadLetter, t).unwrap().unwrap();
        assert_eq!(
            d.message.dead_letter.as_ref().unwrap().0,
            "MaxDeliveryCountExceeded"
        );
    }

    #[test]
    fn lock_expiry_releases_and_stale_locks_are_refused() {
        let q = queue(QueueSpec::new("q"));
        let t = SystemTime::now();
        q.send(msg("a"), t).unwrap();
        let l = q.try_lock(Entity::Main, t).unwrap().unwrap();
        let id = l.message.sequence_number.to_string();
        assert!(q.try_lock(Entity::Main, t).unwrap().is_none());
        let later = t + Duration::from_secs(61);
        let again = q.try_lock(Entity::Main, later).unwrap().unwrap();
        assert_eq!(again.message.delivery_count, 2);
        assert_eq!(
            q.complete(Entity::Main, &id, &l.lock_token, later),
            Err(BrokerError::LockLost)
        );
        assert_eq!(
            q.renew(Entity::Main, &id, &again.lock_token, later),
            Ok(later + Duration::from_secs(60))
        );
        q.complete(Entity::Main, &id, &again.lock_token, later)
            .unwrap();
        assert_eq!(
            q.complete(Entity::Main, &id, &again.lock_token, later),
            Err(BrokerError::LockLost)
        );
    }

    #[test]
    fn dead_letter_locks_end_too() {
        let mut spec = QueueSpec::new("q");
        spec.max_delivery_count = 1;
        let q = queue(spec);
        let t = SystemTime::now();
        q.send(msg("a"), t).unwrap();
        let l = q.try_lock(Entity::Main, t).unwrap().unwrap();
        let id = l.message.sequence_number.to_string();
        q.abandon(Entity::Main, &id, &l.lock_token, t).unwrap();
        let d = q.try_lock(Entity::DeadLetter, t).unwrap().unwrap();
        assert!(q.try_lock(Entity::DeadLetter, t).unwrap().is_none());
        let later = t + Duration::from_secs(61);
        let again = q.try_lock(Entity::DeadLetter, later).unwrap().unwrap();
        assert_eq!(again.message.message_id, d.message.message_id);
    }

    /// What the indexes must agree with: a scan of every message, as the broker once was.
    type Modelled = (SystemTime, Option<(SystemTime, String)>, u32);

    #[derive(Debug, Clone)]
    enum Op {
        Send(u8),
        Lock,
        Complete(prop::sample::Index),
        Abandon(prop::sample::Index),
        Renew(prop::sample::Index),
        Advance(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4).prop_map(Op::Send),
            Just(Op::Lock),
            any::<prop::sample::Index>().prop_map(Op::Complete),
            any::<prop::sample::Index>().prop_map(Op::Abandon),
            any::<prop::sample::Index>().prop_map(Op::Renew),
            (0u16..40).prop_map(Op::Advance),
        ]
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_indexes_agree_with_a_scan(ops in proptest::collection::vec(op(), 1..150)) {
            let mut spec = QueueSpec::new("q");
            spec.lock_duration = Duration::from_secs(10);
            spec.max_delivery_count = 3;
            spec.duplicate_detection_window = Some(Duration::from_secs(30));
            let q = queue(spec);
            let mut now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            // The model: seq → (visible from, locked until and token, deliveries).
            let mut model: BTreeMap<i64, Modelled> = BTreeMap::new();
            let mut dead = 0u64;
            let mut next = 1i64;
            let mut sent = 0u32;
            for op in ops {
                let locked: Vec<i64> = model
                    .iter()
                    .filter(|(_, (_, l, _))| l.is_some())
                    .map(|(s, _)| *s)
                    .collect();
                match op {
                    Op::Send(delay) => {
                        sent += 1;
                        let mut m = msg(&format!("m{sent}"));
                        if delay > 0 {
                            m.scheduled_enqueue_time = Some(now + Duration::from_secs(delay.into()));
                        }
                        prop_assert!(q.send(m, now).unwrap());
                        let from = now + Duration::from_secs(delay.into());
                        model.insert(next, (from, None, 0));
                        next += 1;
                    }
                    Op::Lock => {
                        let want = model
                            .iter()
                            .find(|(_, (from, l, _))| l.is_none() && *from <= now)
                            .map(|(s, _)| *s);
                        let got = q.try_lock(Entity::Main, now).unwrap();
                        prop_assert_eq!(got.as_ref().map(|l| l.message.sequence_number), want);
                        if let Some(l) = got {
                            let e = model.get_mut(&l.message.sequence_number).unwrap();
                            e.2 += 1;
                            prop_assert_eq!(l.message.delivery_count, e.2);
                            e.1 = Some((l.locked_until, l.lock_token));
                        }
                    }
                    Op::Complete(i) | Op::Abandon(i) | Op::Renew(i) if !locked.is_empty() => {
                        let s = locked[i.index(locked.len())];
                        let token = model[&s].1.clone().unwrap().1;
                        let id = s.to_string();
                        match op {
                            Op::Complete(_) => {
                                q.complete(Entity::Main, &id, &token, now).unwrap();
                                model.remove(&s);
                            }
                            Op::Abandon(_) => {
                                q.abandon(Entity::Main, &id, &token, now).unwrap();
                                if model[&s].2 >= 3 {
                                    model.remove(&s);
                                    dead += 1;
                                } else {
                                    model.get_mut(&s).unwrap().1 = None;
                                }
                            }
                            _ => {
                                let until = q.renew(Entity::Main, &id, &token, now).unwrap();
                                model.get_mut(&s).unwrap().1 = Some((until, token));
                            }
                        }
                    }
                    Op::Advance(secs) => now += Duration::from_secs(secs.into()),
                    _ => {}
                }
                // What time has done: ended locks release, or dead-letter at the limit.
                let ended: Vec<i64> = model
                    .iter()
                    .filter(|(_, (_, l, _))| l.as_ref().is_some_and(|(u, _)| *u <= now))
                    .map(|(s, _)| *s)
                    .collect();
                for s in ended {
                    if model[&s].2 >= 3 {
                        model.remove(&s);
                        dead += 1;
                    } else {
                        model.get_mut(&s).unwrap().1 = None;
                    }
                }
                let c = q.counters(now);
                let locked = model.values().filter(|(_, l, _)| l.is_some()).count() as u64;
                let active = model
                    .values()
                    .filter(|(from, l, _)| l.is_none() && *from <= now)
                    .count() as u64;
                prop_assert_eq!(c.locked, locked);
                prop_assert_eq!(c.active, active);
                prop_assert_eq!(c.scheduled, model.len() as u64 - locked - active);
                prop_assert_eq!(c.dead_lettered, dead);
                let due = model
                    .values()
                    .map(|(from, l, _)| l.as_ref().map_or(*from, |(u, _)| *u))
                    .filter(|t| *t > now)
                    .min();
                let next_change = q.next_change(Entity::Main).filter(|t| *t > now);
                prop_assert_eq!(next_change, due);
            }
        }
    }

    #[test]
    fn a_backlog_of_a_hundred_thousand_costs_log_n_per_operation() {
        // Not a timing test: it finishes at all only if no operation scans the backlog
        // (100,000 sends each scanning everything would be 10^10 steps).
        let q = queue(QueueSpec::new("q"));
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        for i in 0..100_000u64 {
            let mut m = msg(&format!("m{i}"));
            m.scheduled_enqueue_time = Some(t + Duration::from_secs(3600 + i % 600));
            q.send(m, t).unwrap();
        }
        q.send(msg("now"), t).unwrap();
        for _ in 0..100_000 {
            assert_eq!(q.counters(t).scheduled, 100_000);
        }
        let l = q.try_lock(Entity::Main, t).unwrap().unwrap();
        assert_eq!(l.message.message_id, "now");
        q.complete(Entity::Main, "now", &l.lock_token, t).unwrap();
        assert_eq!(
            q.next_change(Entity::Main),
            Some(t + Duration::from_secs(3600))
        );
    }

    #[test]
    fn ttl_discards_or_dead_letters() {
        let mut spec = QueueSpec::new("q");
        spec.dead_letter_on_expiration = true;
        let q = queue(spec);
        let t = SystemTime::now();
        q.send(
            NewMessage {
                time_to_live: Some(5.0),
                ..msg("a")
            },
            t,
        )
        .unwrap();
        assert!(q
            .try_lock(Entity::Main, t + Duration::from_secs(6))
            .unwrap()
            .is_none());
        let d = q
            .try_lock(Entity::DeadLetter, t + Duration::from_secs(6))
            .unwrap()
            .unwrap();
        assert_eq!(d.message.dead_letter.unwrap().0, "TTLExpiredException");
    }

    #[test]
    fn journal_replays_state_across_restart() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(Clock::default());
        let specs = [QueueSpec::new("retries")];
        let t = clock.now();
        {
            let b = Broker::open(&specs, Some(dir.path()), clock.clone()).unwrap();
            let q = b.queue("retries").unwrap();
            q.send(msg("a"), t).unwrap();
            q.send(
                NewMessage {
                    scheduled_enqueue_time: Some(t + Duration::from_secs(3600)),
                    ..msg("b")
                },
                t,
            )
            .unwrap();
            q.send(msg("c"), t).unwrap();
            let l = q.try_lock(Entity::Main, t).unwrap().unwrap();
            q.complete(
                Entity::Main,
                &l.message.sequence_number.to_string(),
                &l.lock_token,
                t,
            )
            .unwrap();
            let l = q.try_lock(Entity::Main, t).unwrap().unwrap();
            assert_eq!(l.message.message_id, "c");
        }
        let b = Broker::open(&specs, Some(dir.path()), clock).unwrap();
        let q = b.queue("RETRIES").unwrap();
        let ids: Vec<String> = q
            .messages(Entity::Main)
            .into_iter()
            .map(|m| m.message_id)
            .collect();
        assert_eq!(ids, vec!["b", "c"]);
        // The lock did not survive the restart, the delivery count did.
        let l = q.try_lock(Entity::Main, t).unwrap().unwrap();
        assert_eq!(
            (l.message.message_id.as_str(), l.message.delivery_count),
            ("c", 2)
        );
        // Duplicate detection remembers ids across the restart.
        assert!(!q.send(msg("a"), t).unwrap());
        // Sequence numbers continue.
        q.send(msg("d"), t).unwrap();
        assert_eq!(q.messages(Entity::Main).last().unwrap().sequence_number, 4);
    }
}
