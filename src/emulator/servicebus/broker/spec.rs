//! A queue's configuration ([`QueueSpec`]) and Azure's limits on it and on messages
//! ([`limits`]), checked when the emulator opens a queue.

use std::time::Duration;

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

/// A queue setting Azure refuses, or a `--queue` that does not parse; the message names the
/// queue and the setting, and says what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueSpecError {
    /// `--queue` without a name.
    #[error("`{0}`: a queue needs a name")]
    NoName(String),
    /// `--queue NAME:X` where X is neither seconds nor `off`.
    #[error("`{0}`: the duplicate-detection window is seconds or `off`")]
    BadDuplicateDetection(String),
    /// LockDuration outside 5 s to 5 minutes.
    #[error("queue {name}: LockDuration {lock:?} is outside Azure's range of 5 s to 5 minutes")]
    LockDuration {
        /// The queue.
        name: String,
        /// The lock duration asked for.
        lock: Duration,
    },
    /// DuplicateDetectionHistoryTimeWindow outside 20 s to 7 days.
    #[error("queue {name}: DuplicateDetectionHistoryTimeWindow {window:?} is outside Azure's range of 20 s to 7 days")]
    DuplicateDetectionWindow {
        /// The queue.
        name: String,
        /// The window asked for.
        window: Duration,
    },
    /// MaxDeliveryCount 0.
    #[error("queue {name}: MaxDeliveryCount must be at least 1")]
    MaxDeliveryCount {
        /// The queue.
        name: String,
    },
    /// MaxMessageSizeInKilobytes neither Standard's nor Premium's.
    #[error("queue {name}: MaxMessageSizeInKilobytes {kb} is neither Standard's 256 nor within Premium's 1,024 to 102,400")]
    MaxMessageSize {
        /// The queue.
        name: String,
        /// The size asked for.
        kb: u32,
    },
}

impl QueueSpec {
    /// Refuses settings Azure refuses, naming the setting and what is allowed.
    pub fn validate(&self) -> Result<(), QueueSpecError> {
        let name = || self.name.clone();
        let (lo, hi) = limits::LOCK_DURATION;
        if self.lock_duration < lo || self.lock_duration > hi {
            return Err(QueueSpecError::LockDuration {
                name: name(),
                lock: self.lock_duration,
            });
        }
        if let Some(w) = self.duplicate_detection_window {
            let (lo, hi) = limits::DUPLICATE_DETECTION_WINDOW;
            if w < lo || w > hi {
                return Err(QueueSpecError::DuplicateDetectionWindow {
                    name: name(),
                    window: w,
                });
            }
        }
        if self.max_delivery_count == 0 {
            return Err(QueueSpecError::MaxDeliveryCount { name: name() });
        }
        let (lo, hi) = limits::PREMIUM_MESSAGE_KB;
        if self.max_message_size_kb != limits::STANDARD_MESSAGE_KB
            && !(lo..=hi).contains(&self.max_message_size_kb)
        {
            return Err(QueueSpecError::MaxMessageSize {
                name: name(),
                kb: self.max_message_size_kb,
            });
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
    type Err = QueueSpecError;

    /// `NAME[:DUPLICATE_DETECTION]`, as `hubguard emulator --queue` takes it: the service's
    /// defaults, with the duplicate-detection window in seconds, or `off` (e.g. `retries:off`,
    /// `retries:86400`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, dedup) = match s.split_once(':') {
            Some((n, d)) => (n, Some(d)),
            None => (s, None),
        };
        if name.trim().is_empty() {
            return Err(QueueSpecError::NoName(s.to_string()));
        }
        let mut spec = Self::new(name.trim());
        match dedup.map(str::trim) {
            None => {}
            Some(d) if d.eq_ignore_ascii_case("off") => spec.duplicate_detection_window = None,
            Some(d) => {
                let secs: u64 = d
                    .parse()
                    .map_err(|_| QueueSpecError::BadDuplicateDetection(s.to_string()))?;
                spec.duplicate_detection_window = Some(Duration::from_secs(secs));
            }
        }
        spec.validate()?;
        Ok(spec)
    }
}
