//! One attempt: a span per attempt (linked to the earlier attempts of the same event, child
//! of the producer's trace when the event carries one), the handler call in a child span,
//! never letting a panic escape; [`finish`] records the settled outcome on the span.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::FutureExt;
use opentelemetry::trace::TraceContextExt;
use opentelemetry::KeyValue;
use rand::RngCore;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::settle::{SettleError, Settled, Source};
use crate::clock::rfc3339;
use crate::clock::{at, ms};
use crate::event::Event;
use crate::handler::{Attempt, Failure, Handler, Outcome};
use crate::policy::classify::ErrorClass;
use crate::telemetry::names::{attr, outcome as out, span as span_name};
use crate::telemetry::{format_traceparent, parse_traceparent};

/// A finished attempt.
#[derive(Debug, Clone)]
pub(crate) struct Attempted {
    /// What the handler answered.
    pub outcome: Outcome,
    /// When it started.
    pub started: SystemTime,
    /// Its W3C `traceparent`.
    pub traceparent: String,
    /// Its trace id.
    pub trace_id: String,
    /// The attempt's span (settlement runs inside it).
    pub span: tracing::Span,
    /// How long the handler took.
    pub duration: std::time::Duration,
    /// Where the attempt came from.
    pub source: Source,
}

/// A new random W3C `traceparent` and its trace id (when no tracer is installed).
pub(super) fn new_traceparent() -> (String, String) {
    let mut rng = rand::thread_rng();
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    rng.fill_bytes(&mut trace);
    rng.fill_bytes(&mut span);
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let hex = |b: &[u8], out: &mut String| {
        for x in b {
            out.push(HEX[usize::from(x >> 4)] as char);
            out.push(HEX[usize::from(x & 0xf)] as char);
        }
    };
    let mut tp = String::with_capacity(55);
    tp.push_str("00-");
    hex(&trace, &mut tp);
    let trace_id = tp[3..35].to_string();
    tp.push('-');
    hex(&span, &mut tp);
    tp.push_str("-01");
    (tp, trace_id)
}

/// What the attempt's span says about where it runs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Context<'a> {
    /// The consumer group.
    pub consumer_group: &'a str,
    /// Where the attempt came from.
    pub source: Source,
    /// The policy's name.
    pub policy: &'a str,
    /// The policy's maximum attempts.
    pub max_attempts: u32,
    /// The clock the attempt's start is recorded on.
    pub clock: &'a crate::clock::Clock,
    /// How long the attempt waited for the downstream's rate limiter (`None`: no limiter).
    pub rate_limit_wait: Option<std::time::Duration>,
}

fn producer_trace(event: &Event) -> Option<opentelemetry::trace::SpanContext> {
    ["traceparent", "Diagnostic-Id", "diagnostic-id"]
        .iter()
        .find_map(|k| event.properties.get(*k))
        .and_then(|tp| parse_traceparent(tp))
}

/// Runs attempt `number` of `event`; `earlier` are the `traceparent`s of its earlier attempts.
pub(super) async fn run(
    handler: &Arc<dyn Handler>,
    event: &Event,
    number: u32,
    earlier: &[String],
    cx: Context<'_>,
) -> Attempted {
    let started = start(event, number, earlier, cx);
    let (outcome, duration) = call(handler, event, &started.attempt, &started.span).await;
    started.done(outcome, duration)
}

/// An attempt with its span, not yet made: one item of an ordered batch
/// ([`Handler::handle_in_order`]) until the batch's call answers.
pub(super) struct Started {
    /// What the handler is told about it.
    pub attempt: Attempt,
    span: tracing::Span,
    trace_id: String,
    started: SystemTime,
    source: Source,
}

impl Started {
    /// The attempt's span.
    pub(super) fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The attempt, answered `outcome` after `duration`.
    pub(super) fn done(self, outcome: Outcome, duration: Duration) -> Attempted {
        Attempted {
            outcome,
            started: self.started,
            traceparent: self.attempt.traceparent,
            trace_id: self.trace_id,
            span: self.span,
            duration,
            source: self.source,
        }
    }
}

/// Starts attempt `number` of `event` (its span, its `traceparent`), without calling the
/// handler.
pub(super) fn start(event: &Event, number: u32, earlier: &[String], cx: Context<'_>) -> Started {
    // The fields named here are exported once, by the OpenTelemetry layer, under the
    // conventions' names (and shown in text logs); the rest are set by `describe`. The span
    // follows the messaging conventions for a `process` operation.
    let span = tracing::info_span!(
        target: "hubguard::attempt",
        "attempt",
        otel.name = span_name::ATTEMPT,
        otel.kind = "consumer",
        messaging.message.conversation_id = %event.identity.correlation_id,
        hubguard.attempt.number = number,
    );
    // Attributes and links only matter to an exporter: skip the work when nobody listens.
    // The parent and the links go in before the span starts; the attributes after, all in one
    // call on the started span (one lookup instead of one per attribute: this runs per event).
    let (traceparent, trace_id) = if span.is_disabled() {
        new_traceparent()
    } else {
        describe(&span, event, earlier, cx)
    };
    Started {
        attempt: Attempt {
            number,
            traceparent,
            last: number >= cx.max_attempts,
        },
        span,
        trace_id,
        started: cx.clock.now(),
        source: cx.source,
    }
}

/// Gives the exported attempt span `span` its parent (the producer's trace), its links (the
/// earlier attempts) and its attributes; the attempt's `traceparent` and trace id.
fn describe(
    span: &tracing::Span,
    event: &Event,
    earlier: &[String],
    cx: Context<'_>,
) -> (String, String) {
    if let Some(parent) = producer_trace(event) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
    }
    for tp in earlier {
        if let Some(sc) = parse_traceparent(tp) {
            span.add_link(sc);
        }
    }
    let otel = span.context();
    let started = otel.span();
    use crate::telemetry::names::messaging as m;
    let mut attributes = Vec::with_capacity(11);
    attributes.extend([
        KeyValue::new(attr::MESSAGING_OPERATION_TYPE, m::PROCESS),
        KeyValue::new(attr::MESSAGING_OPERATION_NAME, m::PROCESS),
        KeyValue::new(
            attr::MESSAGING_SYSTEM,
            match cx.source {
                Source::EventHubs => m::EVENTHUBS,
                Source::Retry => m::SERVICEBUS,
            },
        ),
        KeyValue::new(attr::MESSAGE_ID, event.identity.idempotency_key.clone()),
    ]);
    if let Some(t) = &event.identity.event_type {
        attributes.push(KeyValue::new(attr::EVENT_TYPE, t.clone()));
    }
    attributes.extend([
        KeyValue::new(attr::MAX_ATTEMPTS, i64::from(cx.max_attempts)),
        KeyValue::new(attr::POLICY, cx.policy.to_string()),
        KeyValue::new(attr::MESSAGING_DESTINATION, event.hub.clone()),
        KeyValue::new(
            attr::MESSAGING_CONSUMER_GROUP,
            cx.consumer_group.to_string(),
        ),
        KeyValue::new(attr::MESSAGING_PARTITION, event.partition_id.clone()),
        KeyValue::new(attr::SEQUENCE_NUMBER, event.sequence_number),
    ]);
    if let Some(w) = cx.rate_limit_wait {
        attributes.push(KeyValue::new(attr::RATE_LIMIT_WAIT, w.as_secs_f64()));
    }
    started.set_attributes(attributes);
    let sc = started.span_context();
    if sc.is_valid() {
        (format_traceparent(sc), sc.trace_id().to_string())
    } else {
        new_traceparent()
    }
}

/// Calls the handler for `attempt` in a child span of `span`, a panic a transient failure;
/// the outcome and how long the handler took.
async fn call(
    handler: &Arc<dyn Handler>,
    event: &Event,
    attempt: &Attempt,
    span: &tracing::Span,
) -> (Outcome, Duration) {
    let handler_span = tracing::info_span!(target: "hubguard::attempt", parent: span, "handler", otel.name = span_name::HANDLER);
    let t0 = Instant::now();
    let outcome = match AssertUnwindSafe(handler.handle(event, attempt))
        .catch_unwind()
        .instrument(handler_span)
        .await
    {
        Ok(o) => o,
        Err(_) => Outcome::Failed(Failure::transient("the handler panicked")),
    };
    let duration = t0.elapsed();
    if let Outcome::Failed(f) = &outcome {
        tracing::info!(parent: span, error = %crate::redact::redact(&f.error), class = ?f.class, "attempt failed");
    }
    (outcome, duration)
}

/// Marks the attempt span `span` as a replay (`hubguard.replay = true`): the ledger already
/// recorded this attempt — Event Hubs delivered the event again after a crash, before the
/// checkpoint passed it, or Service Bus delivered a retry again. Settlement calls it (on the
/// current span, the attempt's) when it finds the attempt recorded; a replay whose handler
/// succeeds reads no ledger (the happy path) and is not marked.
pub(super) fn mark_replay(span: &tracing::Span) {
    if span.is_disabled() {
        return;
    }
    // Once per span, whatever the number of settlement rounds (the SDK keeps every
    // `set_attribute`, duplicates included).
    struct Replay;
    let first = span
        .with_subscriber(|(id, dispatch)| {
            let registry = dispatch.downcast_ref::<tracing_subscriber::Registry>()?;
            let data = tracing_subscriber::registry::LookupSpan::span(registry, id)?;
            let mut ext = data.extensions_mut();
            let first = ext.get_mut::<Replay>().is_none();
            if first {
                ext.insert(Replay);
            }
            Some(first)
        })
        .flatten()
        .unwrap_or(true);
    if first {
        span.set_attribute(attr::REPLAY, true);
    }
}

/// Records the settled outcome on the attempt's span.
pub(super) fn finish(a: &Attempted, settled: Result<&Settled, &SettleError>) {
    let span = &a.span;
    if span.is_disabled() {
        return;
    }
    // An attempt from Event Hubs on an event the ledger already holds as final: a replay
    // (settlement marks the other replays, see [`mark_replay`]).
    if a.source == Source::EventHubs && matches!(settled, Ok(Settled::AlreadyFinal(_))) {
        mark_replay(span);
    }
    if let Outcome::Failed(f) = &a.outcome {
        span.set_attribute(
            attr::ERROR_TYPE,
            match f.class {
                ErrorClass::Transient => "transient",
                ErrorClass::Permanent => "permanent",
            },
        );
        span.set_attribute(attr::ERROR_MESSAGE, crate::redact::redacted(&f.error));
        if let Some(status) = f.http_status {
            span.set_attribute(attr::HTTP_STATUS, i64::from(status));
        }
        if let Some(ra) = f.retry_after {
            span.set_attribute(attr::RETRY_AFTER, ra.as_secs_f64());
        }
    }
    let (outcome, terminal) = match settled {
        Ok(Settled::Delivered) => (out::DELIVERED, false),
        Ok(Settled::RetryScheduled { due, .. }) => {
            span.set_attribute(attr::NEXT_ATTEMPT_AT, rfc3339(at(ms(*due))));
            (out::RETRY_SCHEDULED, false)
        }
        Ok(Settled::DeadLettered(reason)) => {
            span.set_attribute(
                attr::DEAD_LETTER_REASON,
                format!("{reason:?}").to_lowercase(),
            );
            (out::DEAD_LETTERED, true)
        }
        Ok(Settled::AlreadyFinal(_)) => (out::ALREADY_FINAL, false),
        Ok(Settled::Parked { behind, behind_seq }) => {
            span.set_attribute(attr::PARKED_BEHIND, behind.clone());
            span.set_attribute(attr::PARKED_BEHIND_SEQUENCE_NUMBER, *behind_seq);
            (out::PARKED, false)
        }
        Err(_) => (out::SETTLE_FAILED, false),
    };
    span.set_attribute(attr::OUTCOME, outcome);
    span.set_attribute(attr::TERMINAL, terminal);
    if matches!(a.outcome, Outcome::Failed(_)) || settled.is_err() {
        span.set_status(opentelemetry::trace::Status::error(outcome));
    }
}

/// Marks the attempt's span when its retry was scheduled at the policy's limit instead of
/// the downstream's longer `Retry-After` (`capped_from`, what the downstream asked for).
pub(super) fn mark_retry_after_capped(span: &tracing::Span, capped_from: Option<Duration>) {
    if let Some(asked) = capped_from {
        span.set_attribute(attr::RETRY_AFTER_CAPPED_FROM, asked.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn new_traceparent_is_w3c() {
        let (tp, trace_id) = super::new_traceparent();
        assert_eq!(tp.len(), 55, "{tp}");
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4);
        assert_eq!((parts[0], parts[3]), ("00", "01"));
        assert_eq!(parts[1], trace_id);
        assert_eq!((parts[1].len(), parts[2].len()), (32, 16));
        assert!(tp
            .bytes()
            .all(|b| b == b'-' || b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert!(crate::telemetry::parse_traceparent(&tp).is_some());
    }
}
