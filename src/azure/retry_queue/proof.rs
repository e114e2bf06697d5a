//! The start-up proof that the retry queue keeps hubguard's promise.

use super::atom::iso8601;
use super::atom::QueueDescription;
use super::error::RetryQueueError;
use std::time::Duration;

/// What the retry queue must offer for this configuration (see [`prove_queue`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueNeeds {
    /// The longest time from Service Bus accepting a retry message to a replay of its event
    /// from Event Hubs re-sending the same MessageId (`Config::replay_gap`).
    pub replay_gap: Duration,
    /// The deadline of every call (`retry.call_deadline_ms`).
    pub call_deadline: Duration,
}

impl QueueNeeds {
    /// The duplicate-detection window needed with a queue whose locks last `lock`: the
    /// longer of the Event Hubs replay gap and the retry loop's own re-send path (a process
    /// dies after sending attempt n+1 but before completing the message of attempt n; the
    /// lock lapses, Service Bus redelivers it, and the next receiver re-sends attempt n+1
    /// after reading the ledger: the lock, plus a few calls, plus a minute of margin).
    pub fn window(&self, lock: Option<Duration>) -> Duration {
        let redelivery = lock.unwrap_or(Duration::from_secs(60))
            + self.call_deadline * 4
            + Duration::from_secs(60);
        self.replay_gap.max(redelivery)
    }
}

/// What the start-up proof found: a summary for the log and warnings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueProof {
    /// One line with the properties read (or why they could not be).
    pub summary: String,
    /// Allowed but risky, or not verifiable.
    pub warnings: Vec<String>,
}

/// Why the retry queue cannot keep hubguard's promise: each names the property and the
/// value needed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueRefusal {
    /// The queue does not exist.
    #[error(
        "the retry queue '{queue}' does not exist ({detail}): create it with RequiresDuplicateDetection = true and DuplicateDetectionHistoryTimeWindow at least {} ({} s)",
        iso8601(*need),
        need.as_secs()
    )]
    Missing {
        /// The queue's name.
        queue: String,
        /// What Service Bus said.
        detail: String,
        /// The duplicate-detection window it needs.
        need: Duration,
    },
    /// Duplicate detection is off (it can be chosen only when a queue is created).
    #[error(
        "the retry queue '{queue}' has RequiresDuplicateDetection = false; hubguard needs true, with DuplicateDetectionHistoryTimeWindow at least {} ({} s): a replayed event re-sends its retry under the same MessageId, and without duplicate detection it would be retried twice. Duplicate detection can only be chosen when a queue is created: create a queue with it and set servicebus.queue",
        iso8601(*need),
        need.as_secs()
    )]
    NoDuplicateDetection {
        /// The queue's name.
        queue: String,
        /// The duplicate-detection window it needs.
        need: Duration,
    },
    /// The duplicate-detection window is shorter than the configuration needs
    /// (`QueueNeeds::window`).
    #[error(
        "the retry queue '{queue}' has DuplicateDetectionHistoryTimeWindow = {} ({} s); this configuration needs at least {} ({} s): the longest time from scheduling a retry to a replay re-sending the same MessageId (checkpoint.every_ms + processor.ownership_expiration_ms + 4 × retry.call_deadline_ms + 60 s, or the queue's LockDuration + 4 × retry.call_deadline_ms + 60 s). Raise the window on the queue, or checkpoint more often",
        iso8601(*window),
        window.as_secs(),
        iso8601(*need),
        need.as_secs()
    )]
    WindowTooShort {
        /// The queue's name.
        queue: String,
        /// The queue's window.
        window: Duration,
        /// The window it needs.
        need: Duration,
    },
}

/// Checks `queue`'s description against what the configuration needs. `Err` when the queue
/// cannot keep hubguard's promise (it does not exist, duplicate detection is off, or its
/// window is shorter than [`QueueNeeds::window`]): the message names the property and the
/// value needed. When the description cannot be read (no Manage right: 401/403; Service
/// Bus unreachable) the proof is a warning, not a refusal: sending and receiving need no
/// Manage right, and least privilege should not stop hubguard.
pub fn prove_queue(
    queue: &str,
    described: Result<QueueDescription, RetryQueueError>,
    needs: &QueueNeeds,
) -> Result<QueueProof, QueueRefusal> {
    let d = match described {
        Ok(d) => d,
        Err(RetryQueueError::EntityNotFound { detail, .. }) => {
            return Err(QueueRefusal::Missing {
                queue: queue.to_string(),
                detail,
                need: needs.window(None),
            });
        }
        Err(e @ RetryQueueError::Unauthorized { .. }) => {
            let need = needs.window(None);
            let w = format!(
                "cannot read the retry queue '{queue}''s description ({e}): the credential lacks the Manage right (a SAS policy with Manage, or the Azure Service Bus Data Owner role); sending and receiving work without it, but duplicate detection is not verified: make sure the queue has RequiresDuplicateDetection = true and DuplicateDetectionHistoryTimeWindow at least {} ({} s)",
                iso8601(need),
                need.as_secs()
            );
            return Ok(QueueProof {
                summary: format!(
                    "retry queue '{queue}': description not readable (no Manage right)"
                ),
                warnings: vec![w],
            });
        }
        Err(e) => {
            return Ok(QueueProof {
                summary: format!("retry queue '{queue}': description not read"),
                warnings: vec![format!(
                    "cannot read the retry queue '{queue}''s description ({e}): duplicate detection is not verified"
                )],
            });
        }
    };
    let need = needs.window(d.lock_duration);
    if !d.requires_duplicate_detection {
        return Err(QueueRefusal::NoDuplicateDetection {
            queue: queue.to_string(),
            need,
        });
    }
    let window = d
        .duplicate_detection_history_time_window
        .unwrap_or(Duration::from_secs(600));
    if window < need {
        return Err(QueueRefusal::WindowTooShort {
            queue: queue.to_string(),
            window,
            need,
        });
    }
    let mut warnings = Vec::new();
    if let Some(lock) = d.lock_duration {
        if lock < needs.call_deadline * 2 {
            warnings.push(format!(
                "the retry queue '{queue}' has LockDuration = {} ({} s), less than twice retry.call_deadline_ms: a held retry's lock is renewed at half its time, and a slow renewal may let it lapse (Service Bus then delivers the message again)",
                iso8601(lock),
                lock.as_secs()
            ));
        }
    }
    let opt = |v: Option<String>| v.unwrap_or_else(|| "not given".into());
    Ok(QueueProof {
        summary: format!(
            "retry queue '{queue}': RequiresDuplicateDetection true, DuplicateDetectionHistoryTimeWindow {} (needs {}), LockDuration {}, MaxDeliveryCount {}, MaxMessageSizeInKilobytes {}",
            iso8601(window),
            iso8601(need),
            opt(d.lock_duration.map(iso8601)),
            opt(d.max_delivery_count.map(|n| n.to_string())),
            opt(d.max_message_size_in_kilobytes.map(|n| n.to_string())),
        ),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::azure::retry_queue::atom::tests::ENTRY;

    #[test]
    fn the_proof_refuses_naming_the_property_and_the_value_needed() {
        let needs = QueueNeeds {
            replay_gap: Duration::from_secs(121),
            call_deadline: Duration::from_secs(10),
        };
        let good = QueueDescription::from_atom(ENTRY).unwrap().unwrap();
        let proof = prove_queue("retries", Ok(good.clone()), &needs).unwrap();
        assert!(proof.warnings.is_empty(), "{proof:?}");
        assert!(proof.summary.contains("needs PT2M40S"), "{}", proof.summary);
        let off = QueueDescription {
            requires_duplicate_detection: false,
            ..good.clone()
        };
        let e = prove_queue("retries", Ok(off), &needs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RequiresDuplicateDetection = false") && e.contains("PT2M40S (160 s)"),
            "{e}"
        );
        let short = QueueDescription {
            duplicate_detection_history_time_window: Some(Duration::from_secs(60)),
            ..good.clone()
        };
        let e = prove_queue("retries", Ok(short), &needs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DuplicateDetectionHistoryTimeWindow = PT1M (60 s)")
                && e.contains("at least PT2M40S (160 s)"),
            "{e}"
        );
        let no_manage = RetryQueueError::Unauthorized {
            status: 401,
            detail: "Manage,EntityRead claims required for this operation.".into(),
        };
        let proof = prove_queue("retries", Err(no_manage), &needs).unwrap();
        assert!(proof.warnings[0].contains("Manage right"), "{proof:?}");
        let missing = RetryQueueError::EntityNotFound {
            status: 404,
            detail: String::new(),
        };
        assert!(prove_queue("retries", Err(missing), &needs)
            .unwrap_err()
            .to_string()
            .contains("does not exist"));
        let short_lock = QueueDescription {
            lock_duration: Some(Duration::from_secs(5)),
            ..good
        };
        let proof = prove_queue("retries", Ok(short_lock), &needs).unwrap();
        assert!(
            proof.warnings[0].contains("LockDuration = PT5S"),
            "{proof:?}"
        );
    }
}
