//! The admission step both loops take around a handler call: ask the downstream's circuit
//! breaker whether the attempt may run (or is a half-open probe, or must wait until the
//! breaker's expiry), and afterwards report the outcome to the breaker and record the
//! handler's duration. One home, so the partition loop and the retry loop cannot drift.

use std::time::SystemTime;

use super::attempt::Attempted;
use super::Shared;
use crate::breaker::Admission;

/// What the breaker says about an attempt that wants to run now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Run it; `probe` when it is one of the half-open trial's calls.
    Run {
        /// The half-open trial it was admitted to: its outcome counts towards closing or
        /// re-opening the breaker.
        probe: Option<i64>,
    },
    /// The breaker is open: the attempt waits until then (plus jitter), uncounted.
    Defer(SystemTime),
}

impl Shared {
    /// Asks the breaker, if there is one.
    pub(crate) async fn admit(&self) -> Gate {
        match &self.downstream.breaker {
            None => Gate::Run { probe: None },
            Some(b) => match b.admit(rand::random::<f64>()).await {
                Admission::Allow => Gate::Run { probe: None },
                Admission::Probe { trial } => Gate::Run { probe: Some(trial) },
                Admission::Defer(until) => Gate::Defer(until),
            },
        }
    }

    /// After the handler ran: the breaker learns the outcome (a transient failure counts
    /// against the downstream; a permanent one is the event's fault, not the downstream's),
    /// and the handler's duration is recorded.
    pub(crate) async fn attempted(
        &self,
        attempted: &Attempted,
        gate: Gate,
        event_type: Option<&str>,
    ) {
        if let Some(b) = &self.downstream.breaker {
            let probe = match gate {
                Gate::Run { probe } => probe,
                Gate::Defer(_) => None,
            };
            b.report(
                !super::partition::transient_failure(&attempted.outcome),
                probe,
            )
            .await;
        }
        self.observe
            .handler_duration(attempted.duration, event_type);
    }
}
