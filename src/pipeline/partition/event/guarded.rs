//! The event path's attempt under the dead-letter storm guard: while the guard holds, the
//! event waits in its partition before its attempt, and a refusal is attempted again instead
//! of being dead-lettered (see `breaker::storm`).

use std::time::Duration;

use super::{EventTask, Report, Source};
use crate::breaker::storm::{StormGate, StormVerdict};
use crate::event::Event;
use crate::pipeline::attempt;

impl EventTask<'_> {
    /// Admit → pace → attempt, again while the downstream's storm guard holds the event's
    /// refusal instead of dead-lettering it: the event waits where it is (nothing checkpoints
    /// past it) and is attempted again once the guard lets it. `None` if stopped first.
    pub(super) async fn attempt_guarded(&self, event: &Event) -> Option<attempt::Attempted> {
        let event_type = event.identity.event_type.as_deref();
        loop {
            let gate = self.admit(event).await?;
            let trial = self.storm_admit(event).await?;
            let paced = self.pace().await?;
            let attempted = self.attempt(event, paced).await;
            self.shared.attempted(&attempted, gate, event_type).await;
            let report = Report {
                event,
                attempt: 1,
                source: Source::EventHubs,
                started: attempted.started,
                outcome: &attempted.outcome,
                trace_id: &attempted.trace_id,
                traceparents: std::slice::from_ref(&attempted.traceparent),
            };
            let verdict = self.shared.storm_verdict(&report, None, trial).await;
            if verdict == StormVerdict::Settle {
                return Some(attempted);
            }
            tracing::debug!(key = %event.identity.idempotency_key, "refused for good while the storm guard holds: held, not dead-lettered");
        }
    }

    /// The storm guard's admission of `event`: while the guard holds, the partition waits
    /// here (as for an open breaker), uncounted, until the guard releases or lets this event
    /// through as its trial. `None` if stopped first; else the trial it is, if one.
    async fn storm_admit(&self, event: &Event) -> Option<Option<i64>> {
        let (pid, shared, seq) = (self.pid, self.shared, event.sequence_number);
        let mut held = false;
        let trial = loop {
            match shared.storm_admit(event).await {
                StormGate::Run { trial } => break trial,
                StormGate::Wait(until) => {
                    held = true;
                    let reason = shared
                        .downstream
                        .storm
                        .as_ref()
                        .and_then(|g| g.waiting_for(event.identity.event_type.as_deref()))
                        .unwrap_or_else(|| "downstream storm guard holding".into());
                    shared.health.hold_event(
                        pid,
                        seq,
                        crate::pipeline::health::HoldCause::StormGuard,
                        reason,
                    );
                    // Look again at least every second: a release (a trial elsewhere, an
                    // operator) comes any time.
                    let wait = shared.clock().until(until).min(Duration::from_secs(1));
                    tokio::select! {
                        _ = self.cancel.cancelled() => return None,
                        _ = shared.clock().sleep(wait) => {}
                    }
                }
            }
        };
        if held {
            shared.health.release_event(pid, seq);
        }
        Some(trial)
    }
}
