//! One attempt: call the handler with a fresh trace context, never letting a panic escape.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::SystemTime;

use futures::FutureExt;
use rand::RngCore;

use crate::event::Event;
use crate::handler::{Attempt, Failure, Handler, Outcome};

/// A finished attempt.
#[derive(Debug, Clone)]
pub struct Attempted {
    /// What the handler answered.
    pub outcome: Outcome,
    /// When it started.
    pub started: SystemTime,
    /// Its W3C `traceparent`.
    pub traceparent: String,
    /// Its trace id.
    pub trace_id: String,
}

/// A new W3C `traceparent` (random trace and span ids, sampled).
pub fn new_traceparent() -> (String, String) {
    let mut rng = rand::thread_rng();
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    rng.fill_bytes(&mut trace);
    rng.fill_bytes(&mut span);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let trace_id = hex(&trace);
    (format!("00-{trace_id}-{}-01", hex(&span)), trace_id)
}

/// Runs attempt `number` of `event`.
pub async fn run(handler: &Arc<dyn Handler>, event: &Event, number: u32) -> Attempted {
    let (traceparent, trace_id) = new_traceparent();
    let started = SystemTime::now();
    let attempt = Attempt {
        number,
        traceparent: traceparent.clone(),
    };
    let outcome = match AssertUnwindSafe(handler.handle(event, &attempt))
        .catch_unwind()
        .await
    {
        Ok(o) => o,
        Err(_) => Outcome::Failed(Failure::transient("the handler panicked")),
    };
    let span = tracing::info_span!(
        "attempt",
        correlation_id = %event.identity.correlation_id,
        idempotency_key = %event.identity.idempotency_key,
        partition = %event.partition_id,
        sequence_number = event.sequence_number,
        attempt = number,
        trace_id = %trace_id,
    );
    let _e = span.enter();
    match &outcome {
        Outcome::Delivered => tracing::debug!("delivered"),
        Outcome::Failed(f) => tracing::info!(error = %f.error, class = ?f.class, "attempt failed"),
    }
    Attempted {
        outcome,
        started,
        traceparent,
        trace_id,
    }
}
