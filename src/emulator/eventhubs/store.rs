//! The emulator's event store: hubs, partitions and their append-only logs.
//!
//! Each partition is a log of AMQP messages as they were delivered to consumers (the
//! producer's sections plus the service annotations). An event's offset is the byte position
//! of its record in the log, as in the service, so offsets and sequence numbers differ and
//! code that confuses them fails here too. With a data directory each partition's log is a
//! file (`<dir>/<hub>/<partition>.log`, records `u32 length (LE) ‖ encoded message`) that is
//! replayed on start; without one the log lives in memory.

use crate::sync::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use fe2o3_amqp_types::messaging::annotations::OwnedKey;
use fe2o3_amqp_types::messaging::message::__private::{Deserializable, Serializable};
use fe2o3_amqp_types::messaging::{Body, Message, MessageAnnotations};
use fe2o3_amqp_types::primitives::{Symbol, Timestamp, Value};
use tokio::sync::{oneshot, watch};

use super::selector::StartPosition;

/// A message as the emulator stores and delivers it.
pub type Msg = Message<Body<Value>>;

/// The enqueued-time value the service reports for "never".
pub const NEVER_ENQUEUED_MS: i64 = -62_135_596_800_000;

/// Annotation keys the service adds to every event.
pub mod annotation {
    /// Sequence number (long).
    pub const SEQUENCE_NUMBER: &str = "x-opt-sequence-number";
    /// Offset (string).
    pub const OFFSET: &str = "x-opt-offset";
    /// Enqueued time (timestamp).
    pub const ENQUEUED_TIME: &str = "x-opt-enqueued-time";
    /// Partition key (string), when the producer gave one.
    pub const PARTITION_KEY: &str = "x-opt-partition-key";
}

/// What a hub looks like: `NAME:PARTITIONS[:CG1,CG2,…]` on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSpec {
    /// The hub's name.
    pub name: String,
    /// Number of partitions (ids `0..n`).
    pub partitions: usize,
    /// Consumer groups besides `$Default`, which always exists.
    pub consumer_groups: Vec<String>,
}

impl std::str::FromStr for HubSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.splitn(3, ':');
        let name = parts.next().unwrap_or_default().trim();
        if name.is_empty() || name.contains('/') {
            return Err(format!(
                "hub name must be non-empty and contain no '/': {s:?}"
            ));
        }
        let partitions = match parts.next() {
            None => 4,
            Some(p) => p
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=1024).contains(n))
                .ok_or_else(|| format!("partition count must be 1..=1024 in {s:?}"))?,
        };
        let consumer_groups = parts
            .next()
            .map(|cgs| {
                cgs.split(',')
                    .map(str::trim)
                    .filter(|c| !c.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self {
            name: name.to_string(),
            partitions,
            consumer_groups,
        })
    }
}

impl HubSpec {
    /// A hub with `partitions` partitions and only `$Default`.
    pub fn new(name: impl Into<String>, partitions: usize) -> Self {
        Self {
            name: name.into(),
            partitions,
            consumer_groups: Vec::new(),
        }
    }
}

/// One stored event.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    /// Sequence number within the partition, from 0.
    pub sequence_number: i64,
    /// Byte position of the record in the partition log.
    pub offset: i64,
    /// When the event was enqueued (ms since the Unix epoch).
    pub enqueued_ms: i64,
    /// The message as delivered (with the service annotations).
    pub message: Arc<Msg>,
}

impl StoredEvent {
    /// A string (or symbol) application property of the event.
    pub fn string_property(&self, key: &str) -> Option<String> {
        use fe2o3_amqp_types::primitives::SimpleValue;
        self.message
            .application_properties
            .as_ref()
            .and_then(|a| match a.0.get(key) {
                Some(SimpleValue::String(s)) => Some(s.clone()),
                Some(SimpleValue::Symbol(s)) => Some(s.0.clone()),
                _ => None,
            })
    }
}

#[derive(Debug, Default)]
struct Log {
    events: Vec<StoredEvent>,
    /// Events at the front that passed the hub's retention: never served again.
    expired: usize,
    next_offset: i64,
    file: Option<File>,
}

/// Properties of a partition, as `$management` reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionInfo {
    /// First retained sequence number (0 when empty).
    pub begin_sequence_number: i64,
    /// Last sequence number, −1 when empty.
    pub last_sequence_number: i64,
    /// Last offset, `"-1"` when empty.
    pub last_offset: String,
    /// Last enqueued time, [`NEVER_ENQUEUED_MS`] when empty.
    pub last_enqueued_ms: i64,
    /// Whether the partition holds no event.
    pub is_empty: bool,
}

/// One partition of a hub.
#[derive(Debug)]
pub struct Partition {
    /// The partition id (`"0"`, `"1"`, …).
    pub id: String,
    log: RwLock<Log>,
    tail: watch::Sender<usize>,
    /// How far this partition's clock runs ahead of the host's, in ms (a test's fault: a
    /// service whose clock is off stamps its enqueued times so).
    ahead_ms: std::sync::atomic::AtomicI64,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn annotate(msg: &mut Msg, seq: i64, offset: i64, enqueued_ms: i64, key: Option<&str>) {
    let ann = msg
        .message_annotations
        .get_or_insert_with(|| MessageAnnotations(Default::default()));
    let k = |s: &str| OwnedKey::Symbol(Symbol::from(s));
    ann.0
        .insert(k(annotation::SEQUENCE_NUMBER), Value::Long(seq));
    ann.0
        .insert(k(annotation::OFFSET), Value::String(offset.to_string()));
    ann.0.insert(
        k(annotation::ENQUEUED_TIME),
        Value::Timestamp(Timestamp::from_milliseconds(enqueued_ms)),
    );
    if let Some(key) = key {
        let present = ann
            .0
            .iter()
            .any(|(k, _)| matches!(k, OwnedKey::Symbol(s) if s.0 == annotation::PARTITION_KEY));
        if !present {
            ann.0
                .insert(k(annotation::PARTITION_KEY), Value::String(key.to_string()));
        }
    }
}

fn annotation_of<'a>(msg: &'a Msg, name: &str) -> Option<&'a Value> {
    msg.message_annotations.as_ref().and_then(|a| {
        a.0.iter()
            .find(|(k, _)| matches!(k, OwnedKey::Symbol(s) if s.0 == name))
            .map(|(_, v)| v)
    })
}

/// The partition key a message carries, if any.
pub fn partition_key_of(msg: &Msg) -> Option<String> {
    match annotation_of(msg, annotation::PARTITION_KEY)? {
        Value::String(s) => Some(s.clone()),
        Value::Symbol(s) => Some(s.0.clone()),
        _ => None,
    }
}

fn encode(msg: &Msg) -> io::Result<Vec<u8>> {
    serde_amqp::to_vec(&Serializable(msg))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The size of a message's AMQP encoding (its sections as a transfer carries them).
pub fn encoded_size(msg: &Msg) -> usize {
    serde_amqp::serialized_size(&Serializable(msg)).unwrap_or(usize::MAX)
}

/// Decodes one AMQP-encoded message (an inner section of a batch, or a log record).
pub fn decode(bytes: &[u8]) -> Result<Msg, serde_amqp::Error> {
    serde_amqp::from_slice::<Deserializable<Msg>>(bytes).map(|d| d.0)
}

impl Partition {
    fn open(id: String, file: Option<PathBuf>) -> io::Result<Self> {
        let mut log = Log::default();
        if let Some(path) = file {
            let mut f = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .open(&path)?;
            let mut data = Vec::new();
            f.read_to_end(&mut data)?;
            let mut pos = 0usize;
            while pos + 4 <= data.len() {
                let len =
                    u32::from_le_bytes(data[pos..pos + 4].try_into().expect("4 bytes")) as usize;
                let Some(record) = data.get(pos + 4..pos + 4 + len) else {
                    break;
                };
                let Ok(msg) = decode(record) else { break };
                let seq = match annotation_of(&msg, annotation::SEQUENCE_NUMBER) {
                    Some(Value::Long(s)) => *s,
                    _ => log.events.len() as i64,
                };
                let enq = match annotation_of(&msg, annotation::ENQUEUED_TIME) {
                    Some(Value::Timestamp(t)) => t.milliseconds(),
                    _ => now_ms(),
                };
                log.events.push(StoredEvent {
                    sequence_number: seq,
                    offset: pos as i64,
                    enqueued_ms: enq,
                    message: Arc::new(msg),
                });
                pos += 4 + len;
            }
            if pos < data.len() {
                // A torn record from a crash mid-write: it was never acknowledged; drop it.
                tracing::warn!(path = %path.display(), kept = pos, dropped = data.len() - pos, "truncating torn tail of partition log");
                f.set_len(pos as u64)?;
            }
            log.next_offset = pos as i64;
            log.file = Some(f);
        }
        let (tail, _) = watch::channel(log.events.len());
        Ok(Self {
            id,
            log: RwLock::new(log),
            tail,
            ahead_ms: Default::default(),
        })
    }

    /// Makes this partition stamp enqueued times `ms` ahead of the host's clock (negative:
    /// behind), as a service whose clock is off would.
    pub fn set_clock_ahead_ms(&self, ms: i64) {
        self.ahead_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// The partition's clock (ms since the epoch).
    fn now_ms(&self) -> i64 {
        now_ms() + self.ahead_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Log> {
        self.log.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends `messages` (in order), stamping sequence number, offset, enqueued time and the
    /// partition key. Durable (written to the log file) before it returns when the hub has a
    /// data directory.
    pub fn append(&self, messages: Vec<Msg>, key: Option<&str>) -> io::Result<()> {
        let mut log = self.log.write().unwrap_or_else(|p| p.into_inner());
        let first_seq = log.events.last().map_or(0, |e| e.sequence_number + 1);
        let mut offset = log.next_offset;
        let mut enq = self
            .now_ms()
            .max(log.events.last().map_or(0, |e| e.enqueued_ms));
        let mut records = Vec::new();
        let mut added = Vec::with_capacity(messages.len());
        for (seq, mut msg) in (first_seq..).zip(messages) {
            let own_key = partition_key_of(&msg);
            annotate(&mut msg, seq, offset, enq, own_key.as_deref().or(key));
            let bytes = encode(&msg)?;
            records.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            records.extend_from_slice(&bytes);
            added.push(StoredEvent {
                sequence_number: seq,
                offset,
                enqueued_ms: enq,
                message: Arc::new(msg),
            });
            offset += 4 + bytes.len() as i64;
            enq = enq.max(self.now_ms());
        }
        if let Some(f) = log.file.as_mut() {
            f.write_all(&records)?;
            f.flush()?;
        }
        log.next_offset = offset;
        log.events.extend(added);
        let len = log.events.len();
        drop(log);
        self.tail.send_replace(len);
        Ok(())
    }

    /// Number of events in the partition.
    pub fn len(&self) -> usize {
        self.read().events.len()
    }

    /// Whether the partition holds no event.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Retention: every event with a sequence number up to `sequence_number` is removed, as
    /// Event Hubs removes events older than the hub's retention period ("Event retention",
    /// https://learn.microsoft.com/azure/event-hubs/event-hubs-features#event-retention):
    /// receivers start at the earliest event kept, and the
    /// partition's beginning sequence number moves past them. (In memory only: a restart on
    /// a data directory serves them again.)
    pub fn expire_through(&self, sequence_number: i64) {
        let mut log = self.log.write().unwrap_or_else(|p| p.into_inner());
        let n = log
            .events
            .partition_point(|e| e.sequence_number <= sequence_number);
        log.expired = log.expired.max(n);
    }

    /// Up to `max` events from index `from`.
    pub fn events_from(&self, from: usize, max: usize) -> Vec<StoredEvent> {
        let log = self.read();
        let from = from.max(log.expired).min(log.events.len());
        let to = from.saturating_add(max).min(log.events.len());
        log.events[from..to].to_vec()
    }

    /// Index of the first event a receiver with `start` gets.
    pub fn start_index(&self, start: StartPosition) -> usize {
        let log = self.read();
        let ev = &log.events;
        let first = |pred: &dyn Fn(&StoredEvent) -> bool| ev.partition_point(|e| !pred(e));
        let index = match start {
            StartPosition::Earliest => 0,
            StartPosition::Latest => ev.len(),
            StartPosition::Offset { offset, inclusive } => first(&|e| {
                if inclusive {
                    e.offset >= offset
                } else {
                    e.offset > offset
                }
            }),
            StartPosition::SequenceNumber {
                sequence_number: n,
                inclusive,
            } => first(&|e| {
                if inclusive {
                    e.sequence_number >= n
                } else {
                    e.sequence_number > n
                }
            }),
            StartPosition::EnqueuedTime { millis, inclusive } => first(&|e| {
                if inclusive {
                    e.enqueued_ms >= millis
                } else {
                    e.enqueued_ms > millis
                }
            }),
        };
        // Nothing before the retained events is served.
        index.max(log.expired)
    }

    /// A receiver of the partition's length, which changes whenever events are appended.
    pub fn subscribe(&self) -> watch::Receiver<usize> {
        self.tail.subscribe()
    }

    /// The partition's properties.
    pub fn info(&self) -> PartitionInfo {
        let log = self.read();
        match (log.events.get(log.expired), log.events.last()) {
            (Some(first), Some(last)) => PartitionInfo {
                begin_sequence_number: first.sequence_number,
                last_sequence_number: last.sequence_number,
                last_offset: last.offset.to_string(),
                last_enqueued_ms: last.enqueued_ms,
                is_empty: false,
            },
            _ => PartitionInfo {
                begin_sequence_number: 0,
                last_sequence_number: -1,
                last_offset: "-1".into(),
                last_enqueued_ms: NEVER_ENQUEUED_MS,
                is_empty: true,
            },
        }
    }
}

/// Why a receiver was turned away or evicted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stolen(pub String);

struct Slot {
    id: u64,
    epoch: Option<i64>,
    evict: Option<oneshot::Sender<Stolen>>,
}

/// A receiver registered on a (consumer group, partition); leaving removes it.
pub struct ReceiverLease {
    hub: Arc<Hub>,
    key: (String, usize),
    id: u64,
}

impl std::fmt::Debug for ReceiverLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverLease")
            .field("key", &self.key)
            .field("id", &self.id)
            .finish()
    }
}

impl Drop for ReceiverLease {
    fn drop(&mut self) {
        let mut slots = self.hub.receivers.locked();
        if let Some(v) = slots.get_mut(&self.key) {
            v.retain(|s| s.id != self.id);
        }
    }
}

/// One Event Hub.
pub struct Hub {
    /// The hub's name as configured.
    pub name: String,
    /// When the hub was created (ms since the Unix epoch).
    pub created_ms: i64,
    consumer_groups: Vec<String>,
    /// The partitions, indexed by id.
    pub partitions: Vec<Partition>,
    round_robin: AtomicUsize,
    receivers: Mutex<HashMap<(String, usize), Vec<Slot>>>,
    next_receiver: AtomicU64,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("name", &self.name)
            .field("partitions", &self.partitions.len())
            .field("consumer_groups", &self.consumer_groups)
            .finish()
    }
}

/// 32-bit FNV-1a: a stable hash of a partition key (the same key always maps to the same
/// partition, across restarts and processes).
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

impl Hub {
    /// The partition index for `id`, if the hub has it.
    pub fn partition_index(&self, id: &str) -> Option<usize> {
        let i: usize = id.trim().parse().ok()?;
        (i < self.partitions.len() && i.to_string() == id.trim()).then_some(i)
    }

    /// Whether the consumer group exists (case-insensitive; `$Default` always does).
    pub fn has_consumer_group(&self, cg: &str) -> bool {
        cg.eq_ignore_ascii_case("$default")
            || self
                .consumer_groups
                .iter()
                .any(|c| c.eq_ignore_ascii_case(cg))
    }

    /// The consumer groups, `$Default` first.
    pub fn consumer_groups(&self) -> Vec<String> {
        std::iter::once("$Default".to_string())
            .chain(self.consumer_groups.iter().cloned())
            .collect()
    }

    /// The partition an event sent to the hub (not to a partition) goes to: by key hash when
    /// it has a key, else round robin.
    pub fn route(&self, key: Option<&str>) -> usize {
        let n = self.partitions.len();
        match key {
            Some(k) => fnv1a(k.as_bytes()) as usize % n,
            None => self.round_robin.fetch_add(1, Ordering::Relaxed) % n,
        }
    }

    /// Registers a receiver on (`cg`, `partition`) with an optional owner level, applying the
    /// service's epoch rules: a higher-or-equal epoch evicts the current receivers, a lower one
    /// is refused, a non-epoch receiver is refused while an epoch receiver exists.
    pub fn admit_receiver(
        self: &Arc<Self>,
        cg: &str,
        partition: usize,
        epoch: Option<i64>,
    ) -> Result<(ReceiverLease, oneshot::Receiver<Stolen>), Stolen> {
        let key = (cg.to_ascii_lowercase(), partition);
        let mut all = self.receivers.locked();
        let slots = all.entry(key.clone()).or_default();
        let current = slots.iter().filter_map(|s| s.epoch).max();
        match (epoch, current) {
            (Some(e), Some(c)) if e < c => {
                return Err(Stolen(format!(
                    "a receiver with a higher epoch ({c}) is connected; epoch {e} refused"
                )))
            }
            (None, Some(c)) => {
                return Err(Stolen(format!(
                    "a receiver with epoch {c} is connected; receivers without an epoch are refused"
                )))
            }
            (Some(e), _) => {
                for mut s in slots.drain(..) {
                    if let Some(tx) = s.evict.take() {
                        let _ = tx.send(Stolen(format!(
                            "a new receiver with epoch {e} took over the partition"
                        )));
                    }
                }
            }
            (None, None) => {}
        }
        let id = self.next_receiver.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        slots.push(Slot {
            id,
            epoch,
            evict: Some(tx),
        });
        drop(all);
        Ok((
            ReceiverLease {
                hub: self.clone(),
                key,
                id,
            },
            rx,
        ))
    }

    /// The owner levels (epochs) of the receivers attached to (`cg`, `partition`), as their
    /// attach carried them (`com.microsoft:epoch`; `None`: no owner level).
    pub fn receiver_epochs(&self, cg: &str, partition: usize) -> Vec<Option<i64>> {
        let all = self.receivers.locked();
        all.get(&(cg.to_ascii_lowercase(), partition))
            .map_or_else(Vec::new, |v| v.iter().map(|s| s.epoch).collect())
    }

    /// Number of receivers currently attached to (`cg`, `partition`).
    pub fn receiver_count(&self, cg: &str, partition: usize) -> usize {
        let all = self.receivers.locked();
        all.get(&(cg.to_ascii_lowercase(), partition))
            .map_or(0, Vec::len)
    }
}

/// Every hub of one emulator.
#[derive(Debug)]
pub struct EventStore {
    hubs: BTreeMap<String, Arc<Hub>>,
}

impl EventStore {
    /// Opens (or creates) the hubs; with `data_dir`, replays their logs from disk.
    pub fn open(specs: &[HubSpec], data_dir: Option<&Path>) -> io::Result<Self> {
        let mut hubs = BTreeMap::new();
        for spec in specs {
            let dir = match data_dir {
                Some(d) => {
                    let dir = d.join("eventhubs").join(&spec.name);
                    fs::create_dir_all(&dir)?;
                    Some(dir)
                }
                None => None,
            };
            let partitions = (0..spec.partitions)
                .map(|i| {
                    Partition::open(
                        i.to_string(),
                        dir.as_ref().map(|d| d.join(format!("{i}.log"))),
                    )
                })
                .collect::<io::Result<Vec<_>>>()?;
            let hub = Hub {
                name: spec.name.clone(),
                created_ms: now_ms(),
                consumer_groups: spec.consumer_groups.clone(),
                partitions,
                round_robin: AtomicUsize::new(0),
                receivers: Mutex::new(HashMap::new()),
                next_receiver: AtomicU64::new(0),
            };
            if hubs
                .insert(spec.name.to_ascii_lowercase(), Arc::new(hub))
                .is_some()
            {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("hub {} is configured twice", spec.name),
                ));
            }
        }
        Ok(Self { hubs })
    }

    /// The hub called `name` (case-insensitive).
    pub fn hub(&self, name: &str) -> Option<Arc<Hub>> {
        self.hubs.get(&name.to_ascii_lowercase()).cloned()
    }

    /// All hubs.
    pub fn hubs(&self) -> impl Iterator<Item = &Arc<Hub>> {
        self.hubs.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp_types::messaging::Data;

    fn msg(body: &str) -> Msg {
        Message::builder()
            .body(Body::Data(
                vec![Data(body.as_bytes().to_vec().into())].into(),
            ))
            .build()
    }

    #[test]
    fn hub_spec_parses_and_names_errors() {
        assert_eq!(
            "orders:8".parse::<HubSpec>().unwrap(),
            HubSpec::new("orders", 8)
        );
        let s: HubSpec = "h:2:audit, billing".parse().unwrap();
        assert_eq!(s.consumer_groups, vec!["audit", "billing"]);
        assert_eq!("h".parse::<HubSpec>().unwrap().partitions, 4);
        assert!("h:0"
            .parse::<HubSpec>()
            .unwrap_err()
            .contains("partition count"));
        assert!(":3".parse::<HubSpec>().is_err());
    }

    #[test]
    fn offsets_are_byte_positions_and_positions_resolve() {
        let store = EventStore::open(&[HubSpec::new("h", 1)], None).unwrap();
        let p = &store.hub("H").unwrap().partitions[0];
        p.append(vec![msg("a"), msg("bb"), msg("ccc")], None)
            .unwrap();
        let ev = p.events_from(0, 10);
        assert_eq!(
            ev.iter().map(|e| e.sequence_number).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(ev[0].offset, 0);
        assert!(ev[1].offset > ev[0].offset && ev[2].offset > ev[1].offset);
        assert_eq!(p.start_index(StartPosition::Earliest), 0);
        assert_eq!(p.start_index(StartPosition::Latest), 3);
        let o1 = ev[1].offset;
        assert_eq!(
            p.start_index(StartPosition::Offset {
                offset: o1,
                inclusive: true
            }),
            1
        );
        assert_eq!(
            p.start_index(StartPosition::Offset {
                offset: o1,
                inclusive: false
            }),
            2
        );
        assert_eq!(
            p.start_index(StartPosition::SequenceNumber {
                sequence_number: 0,
                inclusive: false
            }),
            1
        );
        assert_eq!(p.info().last_offset, ev[2].offset.to_string());
    }

    #[test]
    fn log_survives_reopen_and_drops_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let specs = [HubSpec::new("h", 2)];
        {
            let store = EventStore::open(&specs, Some(dir.path())).unwrap();
            let hub = store.hub("h").unwrap();
            hub.partitions[1]
                .append(vec![msg("x"), msg("y")], Some("k"))
                .unwrap();
        }
        let path = dir.path().join("eventhubs/h/1.log");
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[200, 0, 0, 0, 1, 2]).unwrap();
        drop(f);
        let store = EventStore::open(&specs, Some(dir.path())).unwrap();
        let p = &store.hub("h").unwrap().partitions[1];
        let ev = p.events_from(0, 10);
        assert_eq!(ev.len(), 2);
        assert_eq!(partition_key_of(&ev[1].message).as_deref(), Some("k"));
        let log_len = fs::metadata(&path).unwrap().len() as i64;
        p.append(vec![msg("z")], None).unwrap();
        let ev = p.events_from(0, 10);
        assert_eq!(ev[2].sequence_number, 2);
        assert_eq!(
            ev[2].offset, log_len,
            "the offset is the record's byte position"
        );
    }

    #[tokio::test]
    async fn epoch_rules() {
        let store = EventStore::open(&[HubSpec::new("h", 1)], None).unwrap();
        let hub = store.hub("h").unwrap();
        let (plain, mut plain_evicted) = hub.admit_receiver("$Default", 0, None).unwrap();
        let (e5, mut e5_evicted) = hub.admit_receiver("$default", 0, Some(5)).unwrap();
        assert!(
            plain_evicted.try_recv().is_ok(),
            "epoch receiver evicts non-epoch ones"
        );
        assert!(hub.admit_receiver("$Default", 0, None).is_err());
        assert!(hub.admit_receiver("$Default", 0, Some(4)).is_err());
        let (_e5b, _) = hub.admit_receiver("$Default", 0, Some(5)).unwrap();
        assert!(e5_evicted.try_recv().is_ok(), "equal epoch steals");
        assert_eq!(hub.receiver_count("$Default", 0), 1);
        drop((plain, e5));
        assert_eq!(hub.receiver_count("$Default", 0), 1);
        // Another consumer group is independent.
        assert!(hub.admit_receiver("other", 0, None).is_ok());
    }
}
