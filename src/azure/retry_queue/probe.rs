//! The probe message `hubguard check` sends to the retry queue to prove the Send and Listen
//! rights (issue 43): a message every hubguard receiver recognises by its custom property
//! [`PROBE_PROPERTY`] and completes at once, without calling the handler, reading the ledger
//! or counting an attempt. It carries no event and no deployment; whoever locks it first
//! (check itself, or a replica's retry loop or dead-letter sweep) removes it. A probe nobody
//! receives expires after five minutes (Service Bus drops an expired message, or moves it
//! to the dead-letter sub-queue when the queue dead-letters on expiry, where the sweep
//! completes it too).

use super::ReceivedMessage;

testbed_pub! {
    /// The custom property that marks a probe; its value is the probe's id.
    pub const PROBE_PROPERTY: &str = "hubguard-probe";
}

testbed_pub! {
    /// The probe with id `id`: visible at once, MessageId `hubguard-probe-{id}`, the
    /// property [`PROBE_PROPERTY`] = `id`, five minutes to live. (`hubguard check` sends it.)
    #[cfg(any(test, feature = "cli"))]
    pub fn probe_message(id: &str) -> super::OutgoingMessage {
        super::OutgoingMessage {
            message_id: format!("hubguard-probe-{id}"),
            correlation_id: None,
            label: Some("hubguard-probe".into()),
            body: "hubguard check: a probe of the Send and Listen rights, not a retry; any hubguard receiver completes it".into(),
            content_type: Some("text/plain".into()),
            due: std::time::SystemTime::UNIX_EPOCH,
            time_to_live: Some(std::time::Duration::from_secs(300)),
            properties: vec![(PROBE_PROPERTY.into(), id.into())],
        }
    }
}

testbed_pub! {
    /// The probe id of `message` if it is a probe (custom properties arrive lower-cased,
    /// the property is lower-case already).
    pub fn probe_id(message: &ReceivedMessage) -> Option<&str> {
        message.properties.get(PROBE_PROPERTY).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    struct NoLock;
    #[async_trait::async_trait]
    impl super::super::MessageLock for NoLock {
        async fn complete(&self) -> Result<(), super::super::RetryQueueError> {
            Ok(())
        }
        async fn abandon(&self) -> Result<(), super::super::RetryQueueError> {
            Ok(())
        }
        async fn renew(&self) -> Result<SystemTime, super::super::RetryQueueError> {
            Ok(SystemTime::UNIX_EPOCH)
        }
    }

    #[test]
    fn a_probe_is_told_from_a_retry_by_its_property() {
        let out = probe_message("abc");
        assert_eq!(out.message_id, "hubguard-probe-abc");
        assert!(out.message_id.len() <= 128);
        let mut m = ReceivedMessage::new(
            out.message_id.clone(),
            out.body.clone(),
            SystemTime::UNIX_EPOCH,
            Box::new(NoLock),
        );
        assert_eq!(probe_id(&m), None, "no property: a retry");
        m.properties
            .insert(PROBE_PROPERTY.into(), out.properties[0].1.clone());
        assert_eq!(probe_id(&m), Some("abc"));
    }
}
