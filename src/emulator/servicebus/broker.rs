//! The Service Bus broker model: queues with scheduled messages, duplicate detection,
//! peek-lock, delivery counts, time to live and a dead-letter sub-queue — the service's
//! semantics, independent of HTTP. Every time comes from the emulator [`Clock`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::emulator::clock::Clock;

/// Configuration of one queue.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSpec {
    /// The queue's name.
    pub name: String,
    /// How long a peek-lock holds a message.
    pub lock_duration: Duration,
    /// Deliveries after which a message is dead-lettered.
    pub max_delivery_count: u32,
    /// Duplicate detection window (`None` turns detection off).
    pub duplicate_detection_window: Option<Duration>,
    /// The entity's default (and maximum) message time to live.
    pub default_ttl: Option<Duration>,
    /// Dead-letter expired messages instead of discarding them.
    pub dead_letter_on_expiration: bool,
    /// Largest message the queue takes, in KB (`MaxMessageSizeInKilobytes`): 256 on the
    /// Standard tier; 1,024 (Premium's default) to 102,400 on Premium.
    pub max_message_size_kb: u32,
}

/// Azure's limits on a queue's settings ("Service Bus quotas" and the `QueueDescription`
/// reference, learn.microsoft.com), checked when the emulator opens a queue.
pub mod limits {
    use std::time::Duration;

    /// Lock duration: at least 5 seconds, at most 5 minutes.
    pub const LOCK_DURATION: (Duration, Duration) =
        (Duration::from_secs(5), Duration::from_secs(300));
    /// Duplicate-detection window: 20 seconds to 7 days.
    pub const DUPLICATE_DETECTION_WINDOW: (Duration, Duration) =
        (Duration::from_secs(20), Duration::from_secs(7 * 24 * 3600));
    /// Message size on the Standard tier, in KB (headers included).
    pub const STANDARD_MESSAGE_KB: u32 = 256;
    /// Message size a Premium queue may be configured for, in KB.
    pub const PREMIUM_MESSAGE_KB: (u32, u32) = (1_024, 102_400);
    /// MessageId, SessionId and PartitionKey: at most 128 characters.
    pub const MESSAGE_ID_CHARS: usize = 128;
    /// One custom property: at most 32 KB.
    pub const PROPERTY_BYTES: usize = 32 * 1024;
    /// All of a message's headers (system and custom properties): at most 64 KB.
    pub const HEADER_BYTES: usize = 64 * 1024;
    /// Custom properties of one message: "Maximum number of header properties in property
    /// bag: byte/int.MaxValue" — the stricter reading, `byte.MaxValue` (255). Over REST each
    /// custom property is one HTTP header (REST reference, "Send Message"). Source:
    /// https://learn.microsoft.com/azure/service-bus-messaging/service-bus-quotas
    pub const CUSTOM_PROPERTIES: usize = u8::MAX as usize;
}

impl QueueSpec {
    /// Refuses settings Azure refuses, naming the setting and what is allowed.
    pub fn validate(&self) -> Result<(), String> {
        let name = &self.name;
        let (lo, hi) = limits::LOCK_DURATION;
        if self.lock_duration < lo || self.lock_duration > hi {
            return Err(format!(
                "queue {name}: LockDuration {:?} is outside Azure's range of 5 s to 5 minutes",
                self.lock_duration
            ));
        }
        if let Some(w) = self.duplicate_detection_window {
            let (lo, hi) = limits::DUPLICATE_DETECTION_WINDOW;
            if w < lo || w > hi {
                return Err(format!(
                    "queue {name}: DuplicateDetectionHistoryTimeWindow {w:?} is outside Azure's range of 20 s to 7 days"
                ));
            }
        }
        if self.max_delivery_count == 0 {
            return Err(format!("queue {name}: MaxDeliveryCount must be at least 1"));
        }
        let (lo, hi) = limits::PREMIUM_MESSAGE_KB;
        if self.max_message_size_kb != limits::STANDARD_MESSAGE_KB
            && !(lo..=hi).contains(&self.max_message_size_kb)
        {
            return Err(format!(
                "queue {name}: MaxMessageSizeInKilobytes {} is neither Standard's 256 nor within Premium's 1,024 to 102,400",
                self.max_message_size_kb
            ));
        }
        Ok(())
    }
}

impl QueueSpec {
    /// A queue with the service's defaults: 60 s locks, 10 deliveries, 10 minute duplicate
    /// detection, unlimited TTL.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            lock_duration: Duration::from_secs(60),
            max_delivery_count: 10,
            duplicate_detection_window: Some(Duration::from_secs(600)),
            default_ttl: None,
            dead_letter_on_expiration: false,
            max_message_size_kb: limits::STANDARD_MESSAGE_KB,
        }
    }
}

impl std::str::FromStr for QueueSpec {
    type Err = String;

    /// `NAME[:DUPLICATE_DETECTION]`, as `hubguard emulator --queue` takes it: the service's
    /// defaults, with the duplicate-detection window in seconds, or `off` (e.g. `retries:off`,
    /// `retries:86400`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, dedup) = match s.split_once(':') {
            Some((n, d)) => (n, Some(d)),
            None => (s, None),
        };
        if name.trim().is_empty() {
            return Err(format!("`{s}`: a queue needs a name"));
        }
        let mut spec = Self::new(name.trim());
        match dedup.map(str::trim) {
            None => {}
            Some(d) if d.eq_ignore_ascii_case("off") => spec.duplicate_detection_window = None,
            Some(d) => {
                let secs: u64 = d.parse().map_err(|_| {
                    format!("`{s}`: the duplicate-detection window is seconds or `off`")
                })?;
                spec.duplicate_detection_window = Some(Duration::from_secs(secs));
            }
        }
        spec.validate()?;
        Ok(spec)
    }
}

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

#[derive(Debug, Clone, PartialEq)]
struct Lock {
    token: String,
    until: SystemTime,
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

#[derive(Debug, Serialize, Deserialize)]
enum JournalRecord {
    Send {
        entity: u8,
        message: Box<StoredMessage>,
    },
    Remove {
        entity: u8,
        sequence_number: i64,
    },
    DeadLetter {
        sequence_number: i64,
        reason: String,
        description: String,
    },
    Delivered {
        entity: u8,
        sequence_number: i64,
        count: u32,
    },
}

fn entity_code(e: Entity) -> u8 {
    match e {
        Entity::Main => 0,
        Entity::DeadLetter => 1,
    }
}

/// One entity's messages, indexed so every operation costs O(log n) in the number stored:
/// the retry queue holds every pending retry, and a scan per receive would make a backlog of
/// 100,000 quadratic.
#[derive(Debug)]
struct Store {
    messages: BTreeMap<i64, StoredMessage>,
    next_sequence: i64,
    /// Unlocked messages that were not visible when last looked at: (visible from, seq).
    waiting: BTreeSet<(i64, i64)>,
    /// Unlocked visible messages, by sequence number (receives take the lowest).
    visible: BTreeSet<i64>,
    /// Locked messages by lock expiry.
    locks: BTreeSet<(SystemTime, i64)>,
    /// Messages with a time to live, by expiry (the main entity only).
    expiries: Option<BTreeSet<(SystemTime, i64)>>,
    /// Sequence numbers by MessageId (without duplicate detection, ids repeat).
    by_id: HashMap<String, BTreeSet<i64>>,
    default_ttl: Option<Duration>,
}

impl Store {
    /// `expiring`: whether messages expire here (the dead-letter sub-queue keeps them).
    fn new(expiring: bool, default_ttl: Option<Duration>) -> Self {
        Self {
            messages: BTreeMap::new(),
            next_sequence: 1,
            waiting: BTreeSet::new(),
            visible: BTreeSet::new(),
            locks: BTreeSet::new(),
            expiries: expiring.then(BTreeSet::new),
            by_id: HashMap::new(),
            default_ttl,
        }
    }

    /// Stores `m` under a new sequence number.
    fn push(&mut self, mut m: StoredMessage) -> i64 {
        m.sequence_number = self.next_sequence;
        self.insert(m)
    }

    /// Stores `m` under its own sequence number (a journal replay).
    fn insert(&mut self, mut m: StoredMessage) -> i64 {
        let seq = m.sequence_number;
        self.next_sequence = self.next_sequence.max(seq + 1);
        m.lock = None;
        self.waiting.insert((m.enqueued_at_ms, seq));
        if let Some(exp) = self.expiries.as_mut() {
            if let Some(t) = expires_at(self.default_ttl, &m) {
                exp.insert((t, seq));
            }
        }
        self.by_id
            .entry(m.message_id.clone())
            .or_default()
            .insert(seq);
        if let Some(old) = self.messages.insert(seq, m) {
            self.unindex(&old);
        }
        seq
    }

    fn unindex(&mut self, m: &StoredMessage) {
        let seq = m.sequence_number;
        self.waiting.remove(&(m.enqueued_at_ms, seq));
        self.visible.remove(&seq);
        if let Some(l) = &m.lock {
            self.locks.remove(&(l.until, seq));
        }
        if let (Some(exp), Some(t)) = (self.expiries.as_mut(), expires_at(self.default_ttl, m)) {
            exp.remove(&(t, seq));
        }
        if let Some(ids) = self.by_id.get_mut(&m.message_id) {
            ids.remove(&seq);
            if ids.is_empty() {
                self.by_id.remove(&m.message_id);
            }
        }
    }

    fn remove(&mut self, seq: i64) -> Option<StoredMessage> {
        let m = self.messages.remove(&seq)?;
        self.unindex(&m);
        Some(m)
    }

    /// Moves what has come due by `now` from waiting to visible.
    fn promote(&mut self, now: SystemTime) {
        let now_ms = ms(now);
        while let Some(&(from, seq)) = self.waiting.first() {
            if from > now_ms {
                break;
            }
            self.waiting.pop_first();
            self.visible.insert(seq);
        }
    }

    /// Locks the lowest visible message at `now`.
    fn lock_first(&mut self, now: SystemTime, duration: Duration) -> Option<Locked> {
        self.promote(now);
        let seq = self.visible.pop_first()?;
        let m = self.messages.get_mut(&seq).expect("indexed");
        m.delivery_count += 1;
        let token = uuid::Uuid::new_v4().to_string();
        let until = now + duration;
        m.lock = Some(Lock {
            token: token.clone(),
            until,
        });
        self.locks.insert((until, seq));
        Some(Locked {
            message: m.clone(),
            lock_token: token,
            locked_until: until,
        })
    }

    /// Ends `seq`'s lock: it waits to be visible again (at once: it was visible before).
    fn unlock(&mut self, seq: i64) -> Option<&StoredMessage> {
        let m = self.messages.get_mut(&seq)?;
        if let Some(l) = m.lock.take() {
            self.locks.remove(&(l.until, seq));
            self.waiting.insert((m.enqueued_at_ms, seq));
        }
        Some(m)
    }

    /// Moves `seq`'s lock to `until`.
    fn relock(&mut self, seq: i64, until: SystemTime) {
        if let Some(l) = self.messages.get_mut(&seq).and_then(|m| m.lock.as_mut()) {
            self.locks.remove(&(l.until, seq));
            l.until = until;
            self.locks.insert((until, seq));
        }
    }

    /// The message `id` (a MessageId, or a sequence number) locked under `token` at `now`.
    fn locked(&self, id: &str, token: &str, now: SystemTime) -> Option<i64> {
        let holds = |seq: &i64| {
            self.messages.get(seq).is_some_and(|m| {
                m.lock
                    .as_ref()
                    .is_some_and(|l| l.token.eq_ignore_ascii_case(token) && l.until > now)
            })
        };
        let by_seq = id.parse::<i64>().ok().filter(holds);
        let by_id = || self.by_id.get(id)?.iter().copied().find(holds);
        match (by_seq, by_id()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Locks that have ended by `now`, oldest first (still in place).
    fn ended_locks(&self, now: SystemTime) -> Vec<i64> {
        self.locks
            .iter()
            .take_while(|(until, _)| *until <= now)
            .map(|(_, seq)| *seq)
            .collect()
    }

    /// Unlocked messages whose time to live has ended by `now`.
    fn expired(&self, now: SystemTime) -> Vec<i64> {
        let Some(exp) = &self.expiries else {
            return Vec::new();
        };
        exp.iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, seq)| *seq)
            .filter(|seq| self.messages.get(seq).is_some_and(|m| m.lock.is_none()))
            .collect()
    }

    /// When something next becomes visible: a message comes due or a lock ends.
    fn next_change(&self) -> Option<SystemTime> {
        let due = self.waiting.first().map(|(from, _)| at(*from));
        let unlock = self.locks.first().map(|(until, _)| *until);
        match (due, unlock) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[derive(Debug)]
struct QueueState {
    spec: QueueSpec,
    main: Store,
    dlq: Store,
    /// MessageIds seen within the duplicate-detection window, and when, oldest first.
    seen_ids: HashMap<String, i64>,
    seen_order: VecDeque<(i64, String)>,
    counters: Counters,
    journal: Option<File>,
    accepted: Option<Vec<(String, SystemTime)>>,
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

fn ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn at(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// When a message expires: its time to live (capped by the entity's) after it was enqueued.
fn expires_at(default_ttl: Option<Duration>, m: &StoredMessage) -> Option<SystemTime> {
    let ttl = m
        .time_to_live
        .filter(|t| t.is_finite() && *t > 0.0 && *t < 1e11)
        .map(Duration::from_secs_f64);
    let ttl = match (ttl, default_ttl) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }?;
    Some(at(m.enqueued_at_ms) + ttl)
}

impl QueueState {
    fn store(&mut self, e: Entity) -> &mut Store {
        match e {
            Entity::Main => &mut self.main,
            Entity::DeadLetter => &mut self.dlq,
        }
    }

    fn write(&mut self, record: &JournalRecord) -> Result<(), BrokerError> {
        if let Some(f) = self.journal.as_mut() {
            let mut line =
                serde_json::to_vec(record).map_err(|e| BrokerError::Storage(e.to_string()))?;
            line.push(b'\n');
            f.write_all(&line)
                .map_err(|e| BrokerError::Storage(e.to_string()))?;
        }
        Ok(())
    }

    fn move_to_dead_letter(
        &mut self,
        seq: i64,
        reason: &str,
        description: &str,
    ) -> Result<(), BrokerError> {
        self.write(&JournalRecord::DeadLetter {
            sequence_number: seq,
            reason: reason.into(),
            description: description.into(),
        })?;
        if let Some(mut m) = self.main.remove(seq) {
            m.dead_letter = Some((reason.into(), description.into()));
            self.dlq.push(m);
        }
        Ok(())
    }

    /// Applies what time has done: ended locks (dead-lettering at the delivery limit),
    /// expired messages, scheduled messages come due.
    fn settle_time(&mut self, now: SystemTime) -> Result<(), BrokerError> {
        let max = self.spec.max_delivery_count;
        for entity in [Entity::Main, Entity::DeadLetter] {
            for seq in self.store(entity).ended_locks(now) {
                let spent = self
                    .store(entity)
                    .unlock(seq)
                    .is_some_and(|m| m.delivery_count >= max);
                if entity == Entity::Main && spent {
                    self.move_to_dead_letter(
                        seq,
                        "MaxDeliveryCountExceeded",
                        &format!("Message could not be consumed after {max} delivery attempts."),
                    )?;
                }
            }
        }
        for seq in self.main.expired(now) {
            if self.spec.dead_letter_on_expiration {
                self.move_to_dead_letter(
                    seq,
                    "TTLExpiredException",
                    "The message expired and was dead lettered.",
                )?;
            } else {
                self.write(&JournalRecord::Remove {
                    entity: 0,
                    sequence_number: seq,
                })?;
                self.main.remove(seq);
            }
            self.counters.expired += 1;
        }
        self.main.promote(now);
        self.dlq.promote(now);
        Ok(())
    }

    /// Forgets MessageIds older than the duplicate-detection window; whether `id` was seen
    /// within it.
    fn seen_recently(&mut self, id: &str, now_ms: i64, window_ms: i64) -> bool {
        while let Some((t, _)) = self.seen_order.front() {
            if now_ms - *t < window_ms {
                break;
            }
            let (t, old) = self.seen_order.pop_front().expect("front");
            if self.seen_ids.get(&old) == Some(&t) {
                self.seen_ids.remove(&old);
            }
        }
        self.seen_ids
            .get(id)
            .is_some_and(|seen| now_ms - *seen < window_ms)
    }

    fn remember(&mut self, id: &str, now_ms: i64) {
        self.seen_ids.insert(id.to_string(), now_ms);
        self.seen_order.push_back((now_ms, id.to_string()));
    }
}

impl Queue {
    fn open(spec: QueueSpec, journal: Option<PathBuf>) -> io::Result<Self> {
        let mut st = QueueState {
            main: Store::new(true, spec.default_ttl),
            dlq: Store::new(false, None),
            spec,
            seen_ids: HashMap::new(),
            seen_order: VecDeque::new(),
            accepted: None,
            counters: Counters::default(),
            journal: None,
        };
        if let Some(path) = journal {
            if path.exists() {
                let reader = BufReader::new(File::open(&path)?);
                for line in reader.lines() {
                    let line = line?;
                    let Ok(record) = serde_json::from_str::<JournalRecord>(&line) else {
                        tracing::warn!(path = %path.display(), "service bus emulator: ignoring a torn journal record");
                        break;
                    };
                    match record {
                        JournalRecord::Send { entity, message } => {
                            let store = if entity == 0 {
                                &mut st.main
                            } else {
                                &mut st.dlq
                            };
                            let (id, sent) = (message.message_id.clone(), message.sent_at_ms);
                            store.insert(*message);
                            if entity == 0 {
                                st.remember(&id, sent);
                            }
                        }
                        JournalRecord::Remove {
                            entity,
                            sequence_number,
                        } => {
                            let store = if entity == 0 {
                                &mut st.main
                            } else {
                                &mut st.dlq
                            };
                            store.remove(sequence_number);
                        }
                        JournalRecord::DeadLetter {
                            sequence_number,
                            reason,
                            description,
                        } => {
                            if let Some(mut m) = st.main.remove(sequence_number) {
                                m.dead_letter = Some((reason, description));
                                st.dlq.push(m);
                            }
                        }
                        JournalRecord::Delivered {
                            entity,
                            sequence_number,
                            count,
                        } => {
                            let store = if entity == 0 {
                                &mut st.main
                            } else {
                                &mut st.dlq
                            };
                            if let Some(m) = store.messages.get_mut(&sequence_number) {
                                m.delivery_count = count;
                            }
                        }
                    }
                }
                // Rewrite the journal as the current state (compaction).
                let tmp = path.with_extension("journal.tmp");
                {
                    let mut f = File::create(&tmp)?;
                    for (entity, store) in [(0u8, &st.main), (1u8, &st.dlq)] {
                        for m in store.messages.values() {
                            let rec = JournalRecord::Send {
                                entity,
                                message: Box::new(m.clone()),
                            };
                            let mut line = serde_json::to_vec(&rec).map_err(io::Error::other)?;
                            line.push(b'\n');
                            f.write_all(&line)?;
                        }
                    }
                    f.sync_all()?;
                }
                fs::rename(&tmp, &path)?;
            }
            st.journal = Some(OpenOptions::new().create(true).append(true).open(&path)?);
        }
        Ok(Self {
            state: Mutex::new(st),
            changed: Notify::new(),
            receiving: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
        Ok(st.store(entity).remove(seq))
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
