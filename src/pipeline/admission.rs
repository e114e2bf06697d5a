//! The admission step both loops take around a handler call: ask the downstream's circuit
//! breaker whether the attempt may run (or is a half-open probe, or must wait until the
//! breaker's expiry), and afterwards report the outcome to the breaker and record the
//! handler's duration. One home, so the partition loop and the retry loop cannot drift.
//! Between the two, the attempt waits for the downstream's rate limiter ([`Shared::pace`]),
//! which learns from the outcome too: a 429, 503 or timeout slows the whole deployment.

use std::time::SystemTime;

use super::attempt::Attempted;
use super::Shared;
use crate::breaker::storm::{Counted, StormGate, StormVerdict};
use crate::breaker::Admission;
use crate::ratelimit::limiter::{signal_of, Acquired};

/// What the breaker says about an attempt that wants to run now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Run it; `probe` when it is one of the half-open trial's calls.
    Run {
        /// The half-open trial it was admitted to: its outcome counts towards closing or
        /// re-opening the breaker.
        probe: Option<i64>,
        /// A new event's call (asked with [`Shared::admit_new`]): reported as one.
        new: bool,
    },
    /// The breaker is open: the attempt waits until then (plus jitter), uncounted.
    Defer(SystemTime),
}

impl Shared {
    /// Asks the breaker, if there is one.
    pub(crate) async fn admit(&self) -> Gate {
        self.admission(false).await
    }

    /// Asks the breaker for a new event from a partition: at the brink of tripping it first
    /// waits a while for a success (see [`crate::breaker::Shared::admit_new`]).
    pub(crate) async fn admit_new(&self) -> Gate {
        self.admission(true).await
    }

    async fn admission(&self, new: bool) -> Gate {
        let Some(b) = &self.downstream.breaker else {
            return Gate::Run { probe: None, new };
        };
        let jitter = rand::random::<f64>();
        let admission = if new {
            b.admit_new(jitter).await
        } else {
            b.admit(jitter).await
        };
        match admission {
            Admission::Allow => Gate::Run { probe: None, new },
            Admission::Probe { trial } => Gate::Run {
                probe: Some(trial),
                new,
            },
            Admission::Defer(until) => Gate::Defer(until),
        }
    }

    /// Waits for the downstream's rate limiter (at once without one); `None` if `cancel`
    /// fired first. The wait counts no attempt: the event waits where it is (in its
    /// partition, or its retry message under its lock). With no share of the rate (this
    /// replica owns no partition), `wait_for_share` decides between waiting for one and
    /// [`Acquired::NoShare`].
    pub(crate) async fn pace(
        &self,
        cancel: &tokio_util::sync::CancellationToken,
        wait_for_share: bool,
    ) -> Option<Acquired> {
        match &self.downstream.limiter {
            None => Some(Acquired::Go(std::time::Duration::ZERO)),
            Some(l) => l.acquire(cancel, wait_for_share).await,
        }
    }

    /// After the handler ran: the breaker learns the outcome (a transient failure counts
    /// against the downstream; a permanent one is the event's fault, not the downstream's),
    /// and the handler's duration is recorded. With a rate limiter, the limiter learns it
    /// too, and a 429 is its business — the downstream answered, asking for less — so the
    /// breaker counts it as an answer, not a failure (a 429 storm slows the deployment
    /// instead of opening and closing the breaker in turns). A 429's `Retry-After` pauses
    /// the downstream for at most the event type's policy cap.
    pub(crate) async fn attempted(
        &self,
        attempted: &Attempted,
        gate: Gate,
        event_type: Option<&str>,
    ) {
        let throttled = matches!(&attempted.outcome, crate::handler::Outcome::Failed(f) if f.http_status == Some(429));
        if let Some(l) = &self.downstream.limiter {
            let cap = self.settler.policies().for_type(event_type).longest_wait();
            l.observe(signal_of(&attempted.outcome, cap)).await;
        }
        if let Some(b) = &self.downstream.breaker {
            let answered =
                throttled && self.downstream.limiter.as_ref().is_some_and(|l| l.adapts());
            let success = answered || !super::partition::transient_failure(&attempted.outcome);
            match gate {
                Gate::Run { probe, new: true } => b.report_new(success, probe).await,
                Gate::Run { probe, new: false } => b.report(success, probe).await,
                Gate::Defer(_) => b.report(success, None).await,
            };
        }
        self.observe
            .handler_duration(attempted.duration, event_type);
    }
}

/// Readiness asks the downstream's breaker whether work waits on it.
impl super::health::WaitingOn for crate::breaker::Shared {
    fn waiting(&self) -> Option<String> {
        crate::breaker::Shared::waiting(self)
    }
}

/// Readiness asks the downstream's storm guard whether work waits on it.
impl super::health::WaitingOn for crate::breaker::storm::Guard {
    fn waiting(&self) -> Option<String> {
        crate::breaker::storm::Guard::waiting(self)
    }
}

impl Shared {
    /// Asks the downstream's storm guard whether an attempt of `event` may run (at once
    /// without a guard): `Run` (with the trial it is, if the held guard lets it through as
    /// one) or `Wait` until then, uncounted.
    pub(crate) async fn storm_admit(&self, event: &crate::event::Event) -> StormGate {
        match &self.downstream.storm {
            None => StormGate::Run { trial: None },
            Some(g) => {
                g.admit(event.identity.event_type.as_deref(), rand::random::<f64>())
                    .await
            }
        }
    }

    /// After the handler ran: the storm guard counts the outcome and says whether the
    /// attempt settles as usual or — a refusal while the guard holds — waits instead of
    /// being dead-lettered. `record`: the ledger record the settlement starts from (a
    /// retry's), so an exhausted retry counts as a refusal too.
    pub(crate) async fn storm_verdict(
        &self,
        report: &crate::pipeline::settle::Report<'_>,
        record: Option<&crate::ledger::LedgerRecord>,
        trial: Option<i64>,
    ) -> StormVerdict {
        let Some(g) = &self.downstream.storm else {
            return StormVerdict::Settle;
        };
        let counted = match report.outcome {
            crate::handler::Outcome::Delivered => Counted::Delivered,
            crate::handler::Outcome::Failed(_) => {
                let policies = self.settler.policies();
                if super::settle::plan::dead_letters(record, report, policies, self.clock().now()) {
                    Counted::Refused
                } else {
                    Counted::Failed
                }
            }
        };
        let verdict = g
            .counted(report.event.identity.event_type.as_deref(), counted, trial)
            .await;
        if verdict == StormVerdict::Hold {
            self.observe
                .count_storm_held(report.event.identity.event_type.as_deref());
        }
        verdict
    }

    /// Until when a retry of an event of `event_type` that the storm guard holds is deferred:
    /// past the guard's next trial, by as long as it has held so far (at least a trial
    /// interval, at most `held_retry_defer_max_ms`), spread so the held retries do not all
    /// come back at once ([`crate::breaker::storm::held_retry_until`]).
    pub(crate) fn storm_resume_at(&self, event_type: Option<&str>) -> SystemTime {
        match &self.downstream.storm {
            None => self.clock().now(),
            Some(g) => g.held_retry_until(event_type, rand::random::<f64>()),
        }
    }
}
