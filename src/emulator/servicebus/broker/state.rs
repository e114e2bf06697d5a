//! A queue's state behind its mutex: the queue and its dead-letter sub-queue, what time does
//! to them (locks that end, dead-lettering at the delivery limit, expiry, scheduled messages
//! coming due), the duplicate-detection window, the counters and the journal it writes to.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::time::SystemTime;

use super::journal::JournalRecord;
use super::store::Store;
use super::{BrokerError, Counters, Entity, QueueSpec};

#[derive(Debug)]
pub(super) struct QueueState {
    pub(super) spec: QueueSpec,
    pub(super) main: Store,
    pub(super) dlq: Store,
    /// MessageIds seen within the duplicate-detection window, and when, oldest first.
    pub(super) seen_ids: HashMap<String, i64>,
    pub(super) seen_order: VecDeque<(i64, String)>,
    pub(super) counters: Counters,
    pub(super) journal: Option<File>,
    pub(super) accepted: Option<Vec<(String, SystemTime)>>,
}
impl QueueState {
    pub(super) fn store(&mut self, e: Entity) -> &mut Store {
        match e {
            Entity::Main => &mut self.main,
            Entity::DeadLetter => &mut self.dlq,
        }
    }

    pub(super) fn write(&mut self, record: &JournalRecord) -> Result<(), BrokerError> {
        if let Some(f) = self.journal.as_mut() {
            let mut line =
                serde_json::to_vec(record).map_err(|e| BrokerError::Storage(e.to_string()))?;
            line.push(b'\n');
            f.write_all(&line)
                .map_err(|e| BrokerError::Storage(e.to_string()))?;
        }
        Ok(())
    }

    pub(super) fn move_to_dead_letter(
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
    pub(super) fn settle_time(&mut self, now: SystemTime) -> Result<(), BrokerError> {
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
    pub(super) fn seen_recently(&mut self, id: &str, now_ms: i64, window_ms: i64) -> bool {
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

    pub(super) fn remember(&mut self, id: &str, now_ms: i64) {
        self.seen_ids.insert(id.to_string(), now_ms);
        self.seen_order.push_back((now_ms, id.to_string()));
    }
}
