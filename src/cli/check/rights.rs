//! The retry queue's Send and Listen rights, proven with a probe message (issue 43): check
//! sends a message marked as a probe (`hubguard-probe`, see
//! [`crate::azure::retry_queue::probe`]) and takes it back with a peek-lock and a complete.
//! Every hubguard receiver completes a probe at once without the handler or the ledger, so
//! replicas running beside check never take it for work; when one of them takes it first,
//! check's own peek-lock still proves Listen (Service Bus answers a receive without the
//! claim with 401, whatever the queue holds).

use std::time::Duration;

use super::CheckLine;
use crate::azure::retry_queue::probe::{probe_id, probe_message};
use crate::azure::{RetryQueue, RetryQueueError};

/// Peek-locks check makes for its probe, each waiting up to [`RECEIVE_WAIT`].
const RECEIVES: usize = 3;
/// How long one of check's peek-locks waits for a message.
const RECEIVE_WAIT: Duration = Duration::from_secs(2);

/// The role to grant and the SAS right, by the claim that was missing.
fn grant(role: &str, right: &str, queue: &str) -> String {
    format!(
        "grant {role} on the queue to hubguard's identity: az role assignment create --role \"{role}\" --assignee <principal-id> --scope <servicebus-namespace-id>/queues/{queue}; with a connection string, use a SAS policy with {right}"
    )
}

fn send_fix(e: &RetryQueueError, queue: &str) -> String {
    match e {
        RetryQueueError::Unauthorized { .. } => {
            grant("Azure Service Bus Data Sender", "Send", queue)
        }
        RetryQueueError::EntityNotFound { .. } => format!("create the queue {queue} (see the queue's line)"),
        e if e.is_transient() => "check the namespace's availability and this host's network path to it (HTTPS, port 443)".into(),
        _ => "see the error; Service Bus's answers: learn.microsoft.com/rest/api/servicebus/send-message-to-queue".into(),
    }
}

fn receive_fix(e: &RetryQueueError, queue: &str) -> String {
    match e {
        RetryQueueError::Unauthorized { .. } => {
            grant("Azure Service Bus Data Receiver", "Listen", queue)
        }
        RetryQueueError::EntityNotFound { .. } => format!("create the queue {queue} (see the queue's line)"),
        e if e.is_transient() => "check the namespace's availability and this host's network path to it (HTTPS, port 443)".into(),
        _ => "see the error; Service Bus's answers: learn.microsoft.com/rest/api/servicebus/peek-lock-message-non-destructive-read".into(),
    }
}

/// The send line and the receive line.
pub(super) async fn rights_lines(queue: &dyn RetryQueue, name: &str) -> Vec<CheckLine> {
    let send_what = format!("servicebus: send to {name}");
    let id = uuid::Uuid::new_v4().to_string();
    let sent = match queue.schedule(probe_message(&id)).await {
        Ok(()) => {
            let detail =
                "a probe message sent (marked hubguard-probe: replicas complete it unread)";
            vec![CheckLine::pass(&send_what, detail)]
        }
        Err(e) => vec![CheckLine::fail(
            &send_what,
            e.to_string(),
            send_fix(&e, name),
        )],
    };
    let probe_sent = sent.iter().all(|l| l.passed);
    let mut lines = sent;
    lines.push(receive_line(queue, name, &id, probe_sent).await);
    lines
}

/// Peek-locks until check's own probe comes back (then completes it), Service Bus answers
/// that nothing is waiting, or it hands out something else (released at once).
async fn receive_line(queue: &dyn RetryQueue, name: &str, id: &str, probe_sent: bool) -> CheckLine {
    let what = format!("servicebus: receive from {name}");
    for _ in 0..RECEIVES {
        let m = match queue.receive(RECEIVE_WAIT).await {
            Ok(Some(m)) => m,
            Ok(None) if probe_sent => continue,
            Ok(None) => return CheckLine::pass(&what, "a peek-lock allowed (nothing waiting)"),
            Err(e) => return CheckLine::fail(&what, e.to_string(), receive_fix(&e, name)),
        };
        match probe_id(&m) {
            Some(p) if p == id => {
                return match m.complete().await {
                    Ok(()) => {
                        CheckLine::pass(&what, "the probe received back (peek-lock) and completed")
                    }
                    Err(e) => CheckLine::fail(
                        &what,
                        format!("completing the probe: {e}"),
                        receive_fix(&e, name),
                    ),
                };
            }
            // Another check's probe: removed, as any hubguard receiver does.
            Some(_) => {
                let _ = m.complete().await;
            }
            // A retry waiting in the queue: not check's to run. Released at once.
            None => {
                let released = m.abandon().await;
                let how = match released {
                    Ok(()) => "released at once (Service Bus counts it one delivery)",
                    Err(_) => "left to its lock's expiry",
                };
                return CheckLine::pass(
                    &what,
                    format!("a peek-lock allowed: Service Bus handed out a waiting retry before the probe, {how}; the replicas complete the probe"),
                );
            }
        }
    }
    CheckLine::pass(
        &what,
        format!("a peek-lock allowed; the probe was not back within {:?} (a running replica took it and completed it)", RECEIVE_WAIT * RECEIVES as u32),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_claim_names_the_role_to_grant() {
        let refused = RetryQueueError::Unauthorized {
            status: 401,
            detail: "Unauthorized access. 'Send' claim(s) are required".into(),
        };
        let fix = send_fix(&refused, "retries");
        assert!(
            fix.contains("Azure Service Bus Data Sender") && fix.contains("/queues/retries"),
            "{fix}"
        );
        let fix = receive_fix(&refused, "retries");
        assert!(
            fix.contains("Azure Service Bus Data Receiver") && fix.contains("Listen"),
            "{fix}"
        );
    }
}
