//! One entity's messages (the queue or its dead-letter sub-queue), indexed so every
//! operation costs O(log n): the waiting (scheduled) and visible sets, the locks by expiry,
//! the expiries by time to live, the sequence numbers by MessageId; and the time helpers
//! they share.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use super::{Locked, StoredMessage};

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Lock {
    token: String,
    pub(super) until: SystemTime,
}
/// One entity's messages, indexed so every operation costs O(log n) in the number stored:
/// the retry queue holds every pending retry, and a scan per receive would make a backlog of
/// 100,000 quadratic.
#[derive(Debug)]
pub(super) struct Store {
    pub(super) messages: BTreeMap<i64, StoredMessage>,
    next_sequence: i64,
    /// Unlocked messages that were not visible when last looked at: (visible from, seq).
    pub(super) waiting: BTreeSet<(i64, i64)>,
    /// Unlocked visible messages, by sequence number (receives take the lowest).
    pub(super) visible: BTreeSet<i64>,
    /// Locked messages by lock expiry.
    pub(super) locks: BTreeSet<(SystemTime, i64)>,
    /// Messages with a time to live, by expiry (the main entity only).
    expiries: Option<BTreeSet<(SystemTime, i64)>>,
    /// Sequence numbers by MessageId (without duplicate detection, ids repeat).
    by_id: HashMap<String, BTreeSet<i64>>,
    default_ttl: Option<Duration>,
}

impl Store {
    /// `expiring`: whether messages expire here (the dead-letter sub-queue keeps them).
    pub(super) fn new(expiring: bool, default_ttl: Option<Duration>) -> Self {
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
    pub(super) fn push(&mut self, mut m: StoredMessage) -> i64 {
        m.sequence_number = self.next_sequence;
        self.insert(m)
    }

    /// Stores `m` under its own sequence number (a journal replay).
    pub(super) fn insert(&mut self, mut m: StoredMessage) -> i64 {
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

    pub(super) fn remove(&mut self, seq: i64) -> Option<StoredMessage> {
        let m = self.messages.remove(&seq)?;
        self.unindex(&m);
        Some(m)
    }

    /// Moves what has come due by `now` from waiting to visible.
    pub(super) fn promote(&mut self, now: SystemTime) {
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
    pub(super) fn lock_first(&mut self, now: SystemTime, duration: Duration) -> Option<Locked> {
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
    pub(super) fn unlock(&mut self, seq: i64) -> Option<&StoredMessage> {
        let m = self.messages.get_mut(&seq)?;
        if let Some(l) = m.lock.take() {
            self.locks.remove(&(l.until, seq));
            self.waiting.insert((m.enqueued_at_ms, seq));
        }
        Some(m)
    }

    /// Moves `seq`'s lock to `until`.
    pub(super) fn relock(&mut self, seq: i64, until: SystemTime) {
        if let Some(l) = self.messages.get_mut(&seq).and_then(|m| m.lock.as_mut()) {
            self.locks.remove(&(l.until, seq));
            l.until = until;
            self.locks.insert((until, seq));
        }
    }

    /// The message `id` (a MessageId, or a sequence number) locked under `token` at `now`.
    pub(super) fn locked(&self, id: &str, token: &str, now: SystemTime) -> Option<i64> {
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
    pub(super) fn ended_locks(&self, now: SystemTime) -> Vec<i64> {
        self.locks
            .iter()
            .take_while(|(until, _)| *until <= now)
            .map(|(_, seq)| *seq)
            .collect()
    }

    /// Unlocked messages whose time to live has ended by `now`.
    pub(super) fn expired(&self, now: SystemTime) -> Vec<i64> {
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
    pub(super) fn next_change(&self) -> Option<SystemTime> {
        let due = self.waiting.first().map(|(from, _)| at(*from));
        let unlock = self.locks.first().map(|(until, _)| *until);
        match (due, unlock) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
pub(super) fn ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

pub(super) fn at(ms: i64) -> SystemTime {
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
