//! The Settler's replay of a dead-lettered event (the test bed's operator action).



use crate::clock::{at, ms};
use crate::ledger::{
    Change, LedgerRecord, State,
};


use super::{MessageId, RetryCopy, SettleError, Settler};

impl Settler {
    /// Replays a dead-lettered event: schedules its next attempt now with a fresh attempt
    /// budget, and takes it off the dead-letter index.
    #[cfg(any(test, feature = "testbed"))]
    pub async fn replay(&self, key: &str) -> Result<Option<u32>, SettleError> {
        self.replay_if(key, |_| true).await
    }

    /// [`replay`](Self::replay), if the dead-lettered record still matches `matches` when
    /// it is replayed (under the compare-and-swap): `Ok(None)` when it does not, or is no
    /// longer dead-lettered.
    #[cfg(any(test, feature = "testbed"))]
    pub async fn replay_if(
        &self,
        key: &str,
        matches: impl Fn(&LedgerRecord) -> bool,
    ) -> Result<Option<u32>, SettleError> {
        match self.replay_record_if(key, matches).await? {
            Some(rec) => self.send_replayed(&rec).await.map(Some),
            None => Ok(None),
        }
    }

    /// The first half of [`replay_if`](Self::replay_if): the dead-lettered record becomes a
    /// retry due now (a fresh attempt budget), its message not yet sent. `Ok(None)` when it
    /// no longer matches or is no longer dead-lettered. Until [`send_replayed`](Self::send_replayed)
    /// sends it, the retry loop's overdue sweep would send it (the record is due).
    #[cfg(any(test, feature = "testbed"))]
    pub(crate) async fn replay_record_if(
        &self,
        key: &str,
        matches: impl Fn(&LedgerRecord) -> bool,
    ) -> Result<Option<LedgerRecord>, SettleError> {
        let now = self.clock.now();
        self.ledger
            .update(key, |rec| match rec {
                Some(rec) if rec.state == State::DeadLettered && !matches(&rec) => {
                    Change::Keep(Ok(None))
                }
                Some(rec) if rec.state == State::DeadLettered && rec.event_unknown => {
                    Change::Keep(Err(SettleError::EventUnknown {
                        key: key.to_string(),
                        quarantined: rec.quarantined.clone().unwrap_or_default(),
                    }))
                }
                Some(mut rec) if rec.state == State::DeadLettered => {
                    rec.state = State::RetryScheduled;
                    rec.attempt_base = rec.attempts;
                    rec.first_failure_ms = ms(now);
                    rec.next_attempt_ms = Some(ms(now));
                    rec.dead_letter_reason = None;
                    rec.updated_ms = ms(now);
                    // The replayed attempt runs from the copy sent now only: a copy of it
                    // sent before (a cancelled retry's) stands down when it arrives.
                    rec.run_now = Some(crate::ledger::RunNow {
                        attempt: rec.attempts + 1,
                        at_ms: ms(now),
                        by: "replay".into(),
                        previous_due_ms: None,
                    });
                    Change::Write(Box::new(rec.clone()), Ok(Some(rec)))
                }
                _ => Change::Keep(Ok(None)),
            })
            .await?
    }

    /// The second half of [`replay_if`](Self::replay_if): sends the replayed record's
    /// message; the attempt it runs.
    #[cfg(any(test, feature = "testbed"))]
    pub(crate) async fn send_replayed(&self, rec: &LedgerRecord) -> Result<u32, SettleError> {
        let key = rec.key.as_str();
        let marked = rec.run_now.as_ref().map_or(rec.updated_ms, |r| r.at_ms);
        // A MessageId of its own: the attempt's plain one may still be in the
        // duplicate-detection window (a cancelled retry's), and would be dropped.
        // Off the dead-letter index before the copy is sent: an attempt that dead-letters
        // it again at once indexes it again, and must not be undone by this.
        self.ledger.unindex_dead_letter(key).await?;
        let attempt = rec.attempts + 1;
        let id = MessageId::retry(key, attempt).copy(RetryCopy::Replayed { at_ms: marked });
        if let Err(e) = self
            .schedule_marked(id, &rec.event, attempt, at(marked), &[], Some(marked))
            .await
        {
            if e.is_refusal_of_request() {
                // Refused again: it stays a dead letter, with Service Bus's reason.
                self.dead_letter_refused(key, &e).await?;
            }
            return Err(e.into());
        }
        Ok(attempt)
    }
}
