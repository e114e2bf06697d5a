//! A queue's journal: the records a durable queue appends (sends, removals, dead-lettering,
//! delivery counts), replayed and compacted when the queue is opened.

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::PathBuf;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::state::QueueState;
use super::store::Store;
use super::{Counters, Entity, Queue, QueueSpec, StoredMessage};

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum JournalRecord {
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

pub(super) fn entity_code(e: Entity) -> u8 {
    match e {
        Entity::Main => 0,
        Entity::DeadLetter => 1,
    }
}
impl Queue {
    pub(super) fn open(spec: QueueSpec, journal: Option<PathBuf>) -> io::Result<Self> {
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
}
