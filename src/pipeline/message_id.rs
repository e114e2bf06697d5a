//! The MessageIds of the messages hubguard sends to Service Bus, and their budget.
//!
//! Duplicate detection drops a message whose MessageId the queue saw within its window
//! ("Duplicate detection", learn.microsoft.com/azure/service-bus-messaging/duplicate-detection),
//! so the id says exactly which copy a message is: a repeat of the same copy (a crash
//! before its settlement was recorded) is dropped, and any other copy goes through. Every id
//! is `{deployment id}.{key}-attempt-{n}[-{copy}-{number}]` or
//! `{deployment id}.{key}-deadletter-{attempts}`; Service Bus allows 128 characters
//! ("Service Bus quotas", learn.microsoft.com/azure/service-bus-messaging/service-bus-quotas),
//! and [`MessageId::qualified`] stays within them for any key.

use std::borrow::Cow;
use std::fmt;

use crate::event::{key_digest, Deployment, DEPLOYMENT_ID_LEN};

/// The longest MessageId Service Bus accepts.
pub(crate) const LIMIT: usize = 128;

/// The longest suffix after the key: attempt `u32::MAX`, rescued from a dead-letter sequence
/// number of 19 digits (`i64::MAX`). Times in ms since the epoch have 13 digits until 2286.
const LONGEST_SUFFIX: usize = "-attempt-4294967295-rescued-9223372036854775807".len();

/// Longest key used as it is in a MessageId: what the deployment id, its dot and the
/// longest suffix leave of [`LIMIT`] (128 − 13 − 47 = 68), one spare.
pub(crate) const READABLE_KEY_LIMIT: usize = LIMIT - (DEPLOYMENT_ID_LEN + 1) - LONGEST_SUFFIX - 1;

/// Which copy of a retry message a MessageId names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryCopy {
    /// `-attempt-{n}`: the attempt as its failure scheduled it.
    Scheduled,
    /// `-attempt-{n}-deferred-{until ms}`: put off while a circuit breaker is open.
    Deferred {
        /// When it is deferred to (ms since the epoch).
        until_ms: i64,
    },
    /// `-attempt-{n}-rescued-{sequence number}`: put back from Service Bus's dead-letter
    /// sub-queue, where the copy had that sequence number.
    Rescued {
        /// The dead-lettered copy's sequence number.
        dead_letter_seq: i64,
    },
    /// `-attempt-{n}-recovered-{ms}`: sent again by the sweep for an overdue retry.
    Recovered {
        /// When it was recovered (ms since the epoch).
        at_ms: i64,
    },
    /// `-attempt-{n}-now-{ms}`: an operator's pull forward.
    // This and `Replayed` are the operator commands' (in the test bed).
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    Pulled {
        /// The pull's mark (ms since the epoch).
        at_ms: i64,
    },
    /// `-attempt-{n}-replay-{ms}`: a dead letter replayed.
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    Replayed {
        /// When it was replayed (ms since the epoch).
        at_ms: i64,
    },
    /// `-attempt-{n}-fwd-{sequence number}`: another deployment's retry handed back to the
    /// queue, from the copy with that sequence number.
    Forwarded {
        /// The forwarded copy's sequence number.
        sequence_number: i64,
    },
}

/// The MessageId of a message hubguard sends, before the deployment is put in front of it
/// ([`qualified`](Self::qualified)); `Display` writes it without the deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageId<'k> {
    /// A retry message: a copy of attempt `attempt` of `key`.
    Retry {
        /// The event's idempotency key.
        key: &'k str,
        /// The attempt the message triggers.
        attempt: u32,
        /// Which copy.
        copy: RetryCopy,
    },
    /// `{key}-deadletter-{attempts}`: the dead letter of `key` after `attempts` attempts,
    /// sent to the dead-letter destination.
    DeadLetter {
        /// The event's idempotency key.
        key: &'k str,
        /// Attempts made.
        attempts: u32,
    },
}

impl<'k> MessageId<'k> {
    /// Attempt `attempt` of `key` as its failure scheduled it: `{key}-attempt-{n}`.
    pub fn retry(key: &'k str, attempt: u32) -> Self {
        Self::Retry {
            key,
            attempt,
            copy: RetryCopy::Scheduled,
        }
    }

    /// This attempt's `copy` (a dead letter's id stays as it is).
    pub fn copy(self, copy: RetryCopy) -> Self {
        match self {
            Self::Retry { key, attempt, .. } => Self::Retry { key, attempt, copy },
            dead_letter => dead_letter,
        }
    }

    /// The id as `deployment` sends it: `{deployment id}.{id}` (the id alone for an unnamed
    /// deployment), within [`LIMIT`] for any key of a deployment hubguard names ([`base`]
    /// keeps the key's part within what the deployment id and the longest suffix leave). A
    /// deployment id from elsewhere is taken as it is: Service Bus refuses what is too long.
    pub fn qualified(&self, deployment: Option<&Deployment>) -> String {
        qualified(deployment, &self.to_string())
    }
}

impl fmt::Display for MessageId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Retry { key, attempt, copy } => {
                write!(f, "{}-attempt-{attempt}", base(key))?;
                match copy {
                    RetryCopy::Scheduled => Ok(()),
                    RetryCopy::Deferred { until_ms } => write!(f, "-deferred-{until_ms}"),
                    RetryCopy::Rescued { dead_letter_seq } => {
                        write!(f, "-rescued-{dead_letter_seq}")
                    }
                    RetryCopy::Recovered { at_ms } => write!(f, "-recovered-{at_ms}"),
                    RetryCopy::Pulled { at_ms } => write!(f, "-now-{at_ms}"),
                    RetryCopy::Replayed { at_ms } => write!(f, "-replay-{at_ms}"),
                    RetryCopy::Forwarded { sequence_number } => {
                        write!(f, "-fwd-{sequence_number}")
                    }
                }
            }
            Self::DeadLetter { key, attempts } => {
                write!(f, "{}-deadletter-{attempts}", base(key))
            }
        }
    }
}

/// What stands for `key` in a MessageId: the key itself when it is short printable ASCII
/// (so operators can read it in the queue), else its [`key_digest`] (65 characters).
pub(crate) fn base(key: &str) -> Cow<'_, str> {
    let readable = !key.is_empty()
        && key.len() <= READABLE_KEY_LIMIT
        && !key.starts_with('~')
        && key.bytes().all(|b| (0x21..0x7f).contains(&b));
    if readable {
        Cow::Borrowed(key)
    } else {
        Cow::Owned(key_digest(key))
    }
}

/// `id` under `deployment`: `{deployment id}.{id}`, or `id` alone for an unnamed one.
pub fn qualified(deployment: Option<&Deployment>, id: &str) -> String {
    match deployment {
        Some(d) => format!("{}.{id}", d.id),
        None => id.to_string(),
    }
}

/// `id` without the deployment id [`qualified`] put before it (`id` itself when it has none).
#[cfg(any(test, feature = "testbed"))]
pub fn unqualified(id: &str) -> &str {
    match id.split_at_checked(DEPLOYMENT_ID_LEN) {
        Some((d, rest))
            if rest.starts_with('.')
                && d.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            &rest[1..]
        }
        _ => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind of id of `key`: `seq` for sequence numbers, `ms` for times.
    fn every_copy(key: &str, attempt: u32, seq: i64, ms: i64) -> Vec<MessageId<'_>> {
        let retry = MessageId::retry(key, attempt);
        vec![
            retry,
            retry.copy(RetryCopy::Deferred { until_ms: ms }),
            retry.copy(RetryCopy::Rescued {
                dead_letter_seq: seq,
            }),
            retry.copy(RetryCopy::Recovered { at_ms: ms }),
            retry.copy(RetryCopy::Pulled { at_ms: ms }),
            retry.copy(RetryCopy::Replayed { at_ms: ms }),
            retry.copy(RetryCopy::Forwarded {
                sequence_number: seq,
            }),
            MessageId::DeadLetter {
                key,
                attempts: attempt,
            },
        ]
    }

    /// The ids duplicate detection has seen from earlier versions: a change here would let
    /// a repeat through (or drop a copy that should go).
    #[test]
    fn ids_are_spelled_as_before() {
        let d = Deployment::new("ns.servicebus.windows.net", "hub", "$Default");
        let ids: Vec<String> = every_copy("order-42", 3, 1_700_000_000_000, 1_700_000_000_000)
            .iter()
            .map(|id| id.qualified(Some(&d)))
            .collect();
        let p = &d.id;
        assert_eq!(
            ids,
            [
                format!("{p}.order-42-attempt-3"),
                format!("{p}.order-42-attempt-3-deferred-1700000000000"),
                format!("{p}.order-42-attempt-3-rescued-1700000000000"),
                format!("{p}.order-42-attempt-3-recovered-1700000000000"),
                format!("{p}.order-42-attempt-3-now-1700000000000"),
                format!("{p}.order-42-attempt-3-replay-1700000000000"),
                format!("{p}.order-42-attempt-3-fwd-1700000000000"),
                format!("{p}.order-42-deadletter-3"),
            ]
        );
        assert_eq!(
            MessageId::retry("order-42", 2).qualified(None),
            "order-42-attempt-2"
        );
        let digest = key_digest("a b");
        assert_eq!(
            MessageId::retry("a b", 2).to_string(),
            format!("{digest}-attempt-2")
        );
        assert_eq!(
            MessageId::retry("~x", 2).to_string(),
            format!("{}-attempt-2", key_digest("~x"))
        );
        assert_eq!(unqualified(&ids[0]), "order-42-attempt-3");
        assert_eq!(unqualified("order-42-attempt-3"), "order-42-attempt-3");
    }

    #[test]
    fn every_id_stays_within_the_limit_for_any_key() {
        assert_eq!((LONGEST_SUFFIX, READABLE_KEY_LIMIT), (47, 67));
        let d = Deployment::new("ns.servicebus.windows.net", "hub", "$Default");
        let readable = "k".repeat(READABLE_KEY_LIMIT);
        assert_eq!(base(&readable), readable.as_str());
        assert_ne!(base(&"k".repeat(READABLE_KEY_LIMIT + 1)), "k".repeat(68));
        for key in [readable.as_str(), &"é".repeat(300), "~x", "a b", ""] {
            // Times in ms since the epoch: 13 digits until the year 2286.
            for id in every_copy(key, u32::MAX, i64::MAX, 9_999_999_999_999) {
                let q = id.qualified(Some(&d));
                assert!(q.chars().count() <= LIMIT, "{q}");
                assert!(q.starts_with(&format!("{}.", d.id)), "{q}");
            }
        }
    }
}
