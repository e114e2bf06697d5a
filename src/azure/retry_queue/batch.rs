//! Send Message Batch: concurrent sends coalesced into one request.
//!
//! Service Bus's REST API takes a JSON array of messages in one `POST …/messages` with
//! `Content-Type: application/vnd.microsoft.servicebus.json` ("Send Message Batch", REST
//! reference), and answers for the batch as a whole. A send goes out at once while fewer
//! than [`SENDERS`] requests are in flight — alone, as a plain Send Message, exactly as
//! without batching; the messages that arrive while they are all busy wait for the next free
//! one and go together (group commit: batching adds no wait of its own, it only fills the
//! time a send would have waited anyway). A batch is at most [`MAX_MESSAGES`] messages and
//! [`MAX_BYTES`] of JSON, under the smallest maximum message size a queue can have on
//! Standard (256 KB, which a batch may not exceed: "Service Bus quotas").
//!
//! A batch refused for what is in it (400, or 403 "message too large") is sent again one
//! message at a time, so each message gets its own answer and one bad message never holds
//! back the others; any other failure (the service, the network, a deadline) is every
//! message's answer, and each caller settles as it would after a single send's failure.

use crate::sync::LockExt;
use std::collections::VecDeque;
use std::sync::Mutex;

use async_trait::async_trait;
use tokio::sync::{oneshot, Semaphore};

use super::{OutgoingMessage, RetryQueueError};

/// Requests in flight at once.
pub(super) const SENDERS: usize = 32;
/// Most messages in one batch.
pub(super) const MAX_MESSAGES: usize = 100;
/// Most bytes of JSON in one batch.
pub(super) const MAX_BYTES: usize = 192 * 1024;

/// What the batcher sends through.
#[async_trait]
pub(super) trait Send: Sync {
    /// One message, as Send Message.
    async fn send_one(&self, message: OutgoingMessage) -> Result<(), RetryQueueError>;
    /// A batch: `body` is the JSON array.
    async fn send_batch(&self, body: String) -> Result<(), RetryQueueError>;
}

struct Pending {
    message: OutgoingMessage,
    /// Its element of the batch's JSON array.
    json: String,
    answer: oneshot::Sender<Result<(), RetryQueueError>>,
}

/// Coalesces concurrent sends (see the module).
pub(super) struct Batcher {
    queue: Mutex<VecDeque<Pending>>,
    senders: Semaphore,
}

impl Default for Batcher {
    fn default() -> Self {
        Self {
            queue: Mutex::default(),
            senders: Semaphore::new(SENDERS),
        }
    }
}

impl Batcher {
    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Pending>> {
        self.queue.locked()
    }

    /// Sends `message` (its batch element `json`) through `to`, alone or with others.
    pub(super) async fn send(
        &self,
        to: &impl Send,
        message: OutgoingMessage,
        json: String,
    ) -> Result<(), RetryQueueError> {
        let (answer, mut answered) = oneshot::channel();
        self.queue().push_back(Pending {
            message,
            json,
            answer,
        });
        let abandoned = |_| {
            Err(RetryQueueError::Transport(
                "the request carrying this message was abandoned before its answer".into(),
            ))
        };
        loop {
            tokio::select! {
                biased;
                r = &mut answered => return r.unwrap_or_else(abandoned),
                permit = self.senders.acquire() => {
                    let _permit = permit.expect("the semaphore is never closed");
                    let taken = self.take();
                    if taken.is_empty() {
                        // Another request carries this message: its answer comes with it.
                        drop(_permit);
                        return answered.await.unwrap_or_else(abandoned);
                    }
                    send_taken(to, taken).await;
                }
            }
        }
    }

    /// The oldest waiting messages, as many as one batch holds.
    fn take(&self) -> Vec<Pending> {
        let mut queue = self.queue();
        let mut taken = Vec::new();
        let mut bytes = 2;
        while let Some(next) = queue.front() {
            let more = next.json.len() + 1;
            if !taken.is_empty() && (taken.len() == MAX_MESSAGES || bytes + more > MAX_BYTES) {
                break;
            }
            bytes += more;
            taken.extend(queue.pop_front());
        }
        taken
    }
}

async fn send_taken(to: &impl Send, mut taken: Vec<Pending>) {
    if taken.len() == 1 {
        let p = taken.pop().expect("one");
        let _ = p.answer.send(to.send_one(p.message).await);
        return;
    }
    let mut body = String::with_capacity(taken.iter().map(|p| p.json.len() + 1).sum::<usize>() + 2);
    body.push('[');
    for (i, p) in taken.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&p.json);
    }
    body.push(']');
    match to.send_batch(body).await {
        Ok(()) => {
            for p in taken {
                let _ = p.answer.send(Ok(()));
            }
        }
        // Refused for what it holds: each message on its own, for its own answer.
        Err(RetryQueueError::Refused { .. }) => {
            let answers = futures::future::join_all(taken.into_iter().map(|p| async move {
                let r = to.send_one(p.message).await;
                let _ = p.answer.send(r);
            }));
            answers.await;
        }
        Err(e) => {
            for p in taken {
                let _ = p.answer.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    /// Records what it was asked to send; refuses batches holding `bad`, and a single send
    /// of `bad`; answers after `latency` (paused time).
    #[derive(Default)]
    struct Fake {
        singles: Mutex<Vec<String>>,
        batches: Mutex<Vec<usize>>,
        bad: Option<String>,
        down: bool,
        latency: Duration,
    }

    #[async_trait]
    impl Send for Fake {
        async fn send_one(&self, m: OutgoingMessage) -> Result<(), RetryQueueError> {
            tokio::time::sleep(self.latency).await;
            self.singles.lock().unwrap().push(m.message_id.clone());
            if self.down {
                return Err(RetryQueueError::Transport("down".into()));
            }
            if Some(&m.message_id) == self.bad.as_ref() {
                return Err(RetryQueueError::Refused {
                    status: 400,
                    detail: "bad".into(),
                });
            }
            Ok(())
        }
        async fn send_batch(&self, body: String) -> Result<(), RetryQueueError> {
            tokio::time::sleep(self.latency).await;
            self.batches
                .lock()
                .unwrap()
                .push(body.matches("\"Body\"").count());
            if self.down {
                return Err(RetryQueueError::Throttled {
                    status: 503,
                    detail: "busy".into(),
                });
            }
            match &self.bad {
                Some(b) if body.contains(b.as_str()) => Err(RetryQueueError::Refused {
                    status: 400,
                    detail: "bad".into(),
                }),
                _ => Ok(()),
            }
        }
    }

    fn message(id: &str) -> (OutgoingMessage, String) {
        let m = OutgoingMessage {
            message_id: id.into(),
            correlation_id: None,
            label: None,
            body: "{}".into(),
            content_type: None,
            due: SystemTime::UNIX_EPOCH,
            time_to_live: None,
            properties: Vec::new(),
        };
        (m, format!("{{\"Body\":\"{id}\"}}"))
    }

    async fn send_all(fake: Arc<Fake>, n: usize) -> Vec<(String, Result<(), RetryQueueError>)> {
        let batcher = Arc::new(Batcher::default());
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let (batcher, fake) = (batcher.clone(), fake.clone());
                tokio::spawn(async move {
                    let id = format!("m-{i:03}");
                    let (m, json) = message(&id);
                    (id, batcher.send(fake.as_ref(), m, json).await)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_send_goes_alone_and_a_crowd_goes_in_batches() {
        let fake = Arc::new(Fake {
            latency: Duration::from_millis(15),
            ..Default::default()
        });
        let one = send_all(fake.clone(), 1).await;
        assert!(one[0].1.is_ok());
        assert_eq!(fake.singles.lock().unwrap().len(), 1);
        assert!(fake.batches.lock().unwrap().is_empty());

        let fake = Arc::new(Fake {
            latency: Duration::from_millis(15),
            ..Default::default()
        });
        let all = send_all(fake.clone(), 500).await;
        assert!(all.iter().all(|(_, r)| r.is_ok()));
        let singles = fake.singles.lock().unwrap().len();
        let batches = fake.batches.lock().unwrap().clone();
        // Every message went exactly once, most of them in batches, none over the cap.
        assert_eq!(singles + batches.iter().sum::<usize>(), 500);
        assert!(
            batches.iter().all(|&n| (2..=MAX_MESSAGES).contains(&n)),
            "{batches:?}"
        );
        assert!(singles + batches.len() < 500 / 4, "{singles} + {batches:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_batch_is_sent_again_one_by_one_and_only_the_bad_message_fails() {
        let fake = Arc::new(Fake {
            latency: Duration::from_millis(15),
            bad: Some("m-042".into()),
            ..Default::default()
        });
        let all = send_all(fake.clone(), 200).await;
        for (id, r) in &all {
            if id == "m-042" {
                assert!(matches!(r, Err(RetryQueueError::Refused { .. })), "{r:?}");
            } else {
                assert!(r.is_ok(), "{id}: {r:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_batch_is_every_messages_answer_without_a_resend() {
        let fake = Arc::new(Fake {
            latency: Duration::from_millis(15),
            down: true,
            ..Default::default()
        });
        let all = send_all(fake.clone(), 100).await;
        assert!(all.iter().all(|(_, r)| r.is_err()));
        let singles = fake.singles.lock().unwrap().len();
        let batched: usize = fake.batches.lock().unwrap().iter().sum();
        // Nothing was sent twice: an outage is not multiplied by fallbacks.
        assert_eq!(singles + batched, 100);
    }

    #[test]
    fn a_batch_stays_under_the_byte_budget_and_a_giant_goes_alone() {
        let b = Batcher::default();
        let (tx, _rx) = oneshot::channel();
        let (m, _) = message("giant");
        b.queue().push_back(Pending {
            message: m,
            json: "x".repeat(MAX_BYTES + 10),
            answer: tx,
        });
        let push = |id: String, len: usize| {
            let (tx, _rx) = oneshot::channel();
            let (m, _) = message(&id);
            b.queue().push_back(Pending {
                message: m,
                json: "y".repeat(len),
                answer: tx,
            });
        };
        for i in 0..2 {
            push(format!("half-{i}"), MAX_BYTES / 2 + 10);
        }
        for i in 0..3 {
            push(format!("third-{i}"), MAX_BYTES / 3 - 10);
        }
        assert_eq!(b.take().len(), 1, "the giant alone");
        assert_eq!(
            b.take().len(),
            1,
            "two halves, commas and brackets do not fit"
        );
        assert_eq!(b.take().len(), 2, "a half and a third do");
        assert_eq!(b.take().len(), 2);
        assert!(b.take().is_empty());
    }
}
