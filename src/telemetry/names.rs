//! Every attribute and metric name hubguard emits, defined once. Dashboards, the queries in
//! `dashboards/README.md` and the tests refer only to these (a test fails when a dashboard
//! names something not listed here).

// The catalogue is whole in every build: some names are read only by the dashboards, the
// alerts and the tests, or emitted only by the command line's gauges.
#![allow(dead_code)]

/// Span names.
pub mod span {
    /// One attempt of an event: the first delivery from Event Hubs or a retry.
    pub const ATTEMPT: &str = "hubguard.attempt";
    /// The handler call inside an attempt.
    pub const HANDLER: &str = "hubguard.handler";
    /// One call of a batch handler carrying several events' attempts (linked to each).
    pub const BATCH: &str = "hubguard.batch";
    /// Scheduling the next attempt on Service Bus.
    pub const SCHEDULE: &str = "hubguard.servicebus.schedule";
    /// Writing the ledger record.
    pub const LEDGER_WRITE: &str = "hubguard.ledger.write";
    /// Ordered retries: an event parked behind the head of its ordering key's line (no
    /// handler call); its attempts, once released, are ordinary attempt spans.
    pub const PARK: &str = "hubguard.park";
}

/// Span attribute keys.
pub mod attr {
    /// Semantic convention: the operation type (`process`: hubguard processes the event).
    pub const MESSAGING_OPERATION_TYPE: &str = "messaging.operation.type";
    /// Semantic convention: the system-specific operation name (`process`).
    pub const MESSAGING_OPERATION_NAME: &str = "messaging.operation.name";
    /// Semantic convention: the message id — the event's idempotency key.
    pub const MESSAGE_ID: &str = "messaging.message.id";
    /// Semantic convention: the conversation id — the event's correlation id, the same on
    /// every attempt of one event (the support query key).
    pub const CONVERSATION_ID: &str = "messaging.message.conversation_id";
    /// Event type (selects the policy).
    pub const EVENT_TYPE: &str = "hubguard.event_type";
    /// Attempt number (1 = first delivery from Event Hubs).
    pub const ATTEMPT: &str = "hubguard.attempt.number";
    /// The policy's maximum attempts.
    pub const MAX_ATTEMPTS: &str = "hubguard.max_attempts";
    /// The attempt's outcome (see [`super::outcome`]).
    pub const OUTCOME: &str = "hubguard.outcome";
    /// When the next attempt is due (RFC 3339), when a retry was scheduled.
    pub const NEXT_ATTEMPT_AT: &str = "hubguard.next_attempt_at";
    /// The policy's name.
    pub const POLICY: &str = "hubguard.policy";
    /// `true` when the attempt failed and no retry follows (for tail sampling).
    pub const TERMINAL: &str = "hubguard.terminal";
    /// Why it was dead-lettered.
    pub const DEAD_LETTER_REASON: &str = "hubguard.dead_letter_reason";
    /// The error message.
    pub const ERROR_MESSAGE: &str = "hubguard.error.message";
    /// Semantic convention: the HTTP status the downstream answered a failed attempt with.
    pub const HTTP_STATUS: &str = "http.response.status_code";
    /// Seconds the downstream asked to wait (`Retry-After`) on a failed attempt.
    pub const RETRY_AFTER: &str = "hubguard.retry_after_s";
    /// Seconds of a `Retry-After` longer than the policy allows, which the retry's schedule
    /// shortened to the policy's limit (set only when it did).
    pub const RETRY_AFTER_CAPPED_FROM: &str = "hubguard.retry_after_capped_from_s";
    /// Ordered retries: the idempotency key of the event this one was parked behind (the
    /// head of its ordering key's line); the head's own spans answer when it retries.
    pub const PARKED_BEHIND: &str = "hubguard.parked_behind";
    /// Ordered retries: the sequence number of that head.
    pub const PARKED_BEHIND_SEQUENCE_NUMBER: &str = "hubguard.parked_behind.sequence_number";
    /// Seconds the attempt waited for the downstream's rate limiter before it called it.
    pub const RATE_LIMIT_WAIT: &str = "hubguard.ratelimit.wait_s";
    /// OpenTelemetry semantic convention: the error's type (`transient`, `permanent`, …).
    pub const ERROR_TYPE: &str = "error.type";
    /// Semantic convention: the messaging system the attempt came from: `eventhubs` (the
    /// first attempt, or a replay of it) or `servicebus` (a retry).
    pub const MESSAGING_SYSTEM: &str = "messaging.system";
    /// Semantic convention: the hub (for a retry too: where the event came from).
    pub const MESSAGING_DESTINATION: &str = "messaging.destination.name";
    /// Semantic convention: the consumer group.
    pub const MESSAGING_CONSUMER_GROUP: &str = "messaging.consumer.group.name";
    /// Semantic convention: the partition.
    pub const MESSAGING_PARTITION: &str = "messaging.destination.partition.id";
    /// The event's sequence number in its partition.
    pub const SEQUENCE_NUMBER: &str = "messaging.eventhubs.message.sequence_number";
    /// `true` on an attempt the ledger had already recorded: a replay from Event Hubs after
    /// a crash (its checkpoint had not passed the event), or a retry message delivered
    /// again. Absent otherwise.
    pub const REPLAY: &str = "hubguard.replay";
}

/// Values of the messaging attributes.
pub mod messaging {
    /// [`super::attr::MESSAGING_OPERATION_TYPE`] and [`super::attr::MESSAGING_OPERATION_NAME`].
    pub const PROCESS: &str = "process";
    /// [`super::attr::MESSAGING_SYSTEM`] of an attempt read from Event Hubs.
    pub const EVENTHUBS: &str = "eventhubs";
    /// [`super::attr::MESSAGING_SYSTEM`] of a retry received from Service Bus.
    pub const SERVICEBUS: &str = "servicebus";
}

/// Values of [`attr::OUTCOME`].
pub mod outcome {
    /// The handler succeeded.
    pub const DELIVERED: &str = "delivered";
    /// Failed; the next attempt is scheduled.
    pub const RETRY_SCHEDULED: &str = "retry_scheduled";
    /// Failed for good.
    pub const DEAD_LETTERED: &str = "dead_lettered";
    /// Deferred without counting an attempt (open circuit breaker).
    pub const DEFERRED_BY_BREAKER: &str = "deferred_by_breaker";
    /// The outcome could not be made durable (the event stays unsettled and is replayed).
    pub const SETTLE_FAILED: &str = "settle_failed";
    /// The ledger already had a final state (a duplicate delivery).
    pub const ALREADY_FINAL: &str = "already_final";
    /// Parked behind an earlier event of its ordering key waiting for a retry (ordered
    /// retries): delivered once that one settles.
    pub const PARKED: &str = "parked";
    /// In an ordered batch of a released line, after the batch's first failure: not
    /// attempted, whatever the receiver answered; it goes again after the failed event.
    pub const NOT_ATTEMPTED: &str = "not_attempted";
}

/// Metric names (OpenTelemetry instruments; Prometheus turns dots into underscores).
pub mod metric {
    /// Counter: events delivered.
    pub const DELIVERED: &str = "hubguard.events.delivered";
    /// Counter: retries scheduled.
    pub const RETRIES_SCHEDULED: &str = "hubguard.retries.scheduled";
    /// Counter: events dead-lettered.
    pub const DEAD_LETTERED: &str = "hubguard.events.dead_lettered";
    /// Counter: attempts deferred by an open breaker.
    pub const DEFERRED: &str = "hubguard.events.deferred";
    /// Counter: retries due while an operator paused them (`hubguard retries pause`),
    /// deferred without counting an attempt.
    pub const PAUSED: &str = "hubguard.retries.paused";
    /// Counter: retries taken back from Service Bus's dead-letter sub-queue.
    pub const RESCUED: &str = "hubguard.retries.rescued";
    /// Counter: overdue retries the ledger recorded and nothing ran, scheduled again.
    pub const RECOVERED: &str = "hubguard.retries.recovered";
    /// Counter: retries of another deployment received from a shared queue and handed back
    /// to it for their own deployment.
    pub const FORWARDED: &str = "hubguard.retries.forwarded";
    /// Counter: retries whose ledger record was missing, rebuilt from the event read back
    /// from Event Hubs.
    pub const RECORDS_REBUILT: &str = "hubguard.retries.records_rebuilt";
    /// Counter: retries whose ledger record was missing and whose event was gone from Event
    /// Hubs, dead-lettered as `record_missing`. Alert on any increase: an event is known
    /// only by its key.
    pub const RECORDS_MISSING: &str = "hubguard.retries.records_missing";
    /// Gauge: retries the ledger says are waiting (state RETRY_SCHEDULED), from its listing.
    pub const RETRIES_PENDING: &str = "hubguard.retries.pending";
    /// Gauge: of those, the ones already past their due time.
    pub const RETRIES_OVERDUE: &str = "hubguard.retries.overdue";
    /// Gauge: events parked behind an earlier event of their ordering key (ordered retries),
    /// from the ledger's listing.
    pub const LINES_PARKED: &str = "hubguard.lines.parked";
    /// Gauge (s): how long the oldest parked event has waited.
    pub const LINES_OLDEST_PARKED_AGE: &str = "hubguard.lines.oldest_parked_age";
    /// Counter: settlements that failed (and were retried).
    pub const SETTLE_FAILURES: &str = "hubguard.settle.failures";
    /// Histogram (s): handler call duration.
    pub const HANDLER_DURATION: &str = "hubguard.handler.duration";
    /// Histogram (s): retry start minus its scheduled time.
    pub const RETRY_LATENESS: &str = "hubguard.retry.lateness";
    /// Gauge: events received but not yet covered by the checkpoint, per partition.
    pub const CHECKPOINT_LAG_EVENTS: &str = "hubguard.checkpoint.lag.events";
    /// Gauge (s): age of the oldest event not covered by the checkpoint, per partition.
    pub const CHECKPOINT_LAG_SECONDS: &str = "hubguard.checkpoint.lag.seconds";
    /// Gauge: partitions held (settlement failing), labelled by reason.
    pub const PARTITIONS_HELD: &str = "hubguard.partitions.held";
    /// Gauge: retry loop state (1 running, 2 reconnecting, 3 watchdog, 0 stopped/starting).
    pub const RETRY_LOOP_STATE: &str = "hubguard.retry_loop.state";
    /// Gauge (s): how long the downstream's breaker has been open (0 when closed). Alert when
    /// it never returns to 0: something keeps feeding it.
    pub const BREAKER_AGE: &str = "hubguard.breaker.age";
    /// Gauge: how many times the downstream's breaker opened.
    pub const BREAKER_OPENS: &str = "hubguard.breaker.opens";
    /// Gauge: 1 while the downstream's dead-letter storm guard holds (refusals are not
    /// dead-lettered, new events wait), else 0; by `downstream`.
    pub const STORM_GUARD_HOLDING: &str = "hubguard.storm_guard.holding";
    /// Gauge (s): how long the storm guard has been holding (0 when it does not).
    pub const STORM_GUARD_AGE: &str = "hubguard.storm_guard.age";
    /// Counter: refusals the storm guard held instead of dead-lettering (by event type).
    pub const STORM_GUARD_HELD: &str = "hubguard.storm_guard.held";
    /// Gauge (s): how long the downstream's breaker stays open once opened
    /// (`breaker.open_ms`), for alerts on an age of a few times that.
    pub const BREAKER_OPEN_DURATION: &str = "hubguard.breaker.open_duration";
    /// Gauge (s): how long each held partition has been held, per partition and reason
    /// (0, unlabelled, when none is).
    pub const PARTITION_HELD_SECONDS: &str = "hubguard.partition.held.seconds";
    /// Gauge: partitions this replica owns (processes) now.
    pub const PARTITIONS_OWNED: &str = "hubguard.partitions.owned";
    /// Gauge: 1 per partition of the hub no replica has owned for longer than ownership takes
    /// to expire and be claimed again, by partition (0, unlabelled, when every one has an
    /// owner). Every replica reports the same: use `max`.
    pub const PARTITIONS_UNOWNED: &str = "hubguard.partitions.unowned";
    /// Gauge: 1 when the replica is ready (`/readyz` answers 200), else 0.
    pub const READY: &str = "hubguard.ready";
    /// Gauge: the Event Hubs consumer (1 running, 2 failing and being rebuilt, 0 starting).
    pub const CONSUMER_STATE: &str = "hubguard.consumer.state";
    /// Gauge (s): the hub's retention as configured (`eventhubs.retention_hours`), for
    /// alerts on the headroom a held partition has left.
    pub const RETENTION: &str = "hubguard.eventhubs.retention";
    /// Gauge (requests/s): the downstream's rate limit for the whole deployment
    /// (`handler.rate_limit`, capped by the webhook's `WebHook-Allowed-Rate`).
    pub const RATE_LIMIT: &str = "hubguard.ratelimit.limit";
    /// Gauge (requests/s): this replica's rate to the downstream now (its share of the
    /// adapted deployment rate), labelled with the last decrease's `reason`. Sum over
    /// replicas: the deployment's rate.
    pub const RATE_CURRENT: &str = "hubguard.ratelimit.rate";
    /// Gauge (requests/s): the deployment's adapted rate now (the same on every replica).
    pub const RATE_DEPLOYMENT: &str = "hubguard.ratelimit.deployment_rate";
    /// Gauge: how many times the deployment's rate was lowered (429, 503, timeouts).
    pub const RATE_DECREASES: &str = "hubguard.ratelimit.decreases";
    /// Gauge: work not yet done, by `kind` ([`super::backlog_kind`]): the whole deployment's,
    /// from any replica (aggregate with `max`).
    pub const BACKLOG_EVENTS: &str = "hubguard.backlog.events";
    /// Counter: operational events the destination accepted, by `type`.
    pub const OPSEVENTS_SENT: &str = "hubguard.opsevents.sent";
    /// Counter: operational events suppressed by their window, by `type`.
    pub const OPSEVENTS_SUPPRESSED: &str = "hubguard.opsevents.suppressed";
    /// Counter: operational events dropped (the channel to a slow destination was full).
    pub const OPSEVENTS_DROPPED: &str = "hubguard.opsevents.dropped";
    /// Counter: operational events the destination refused or did not answer in time.
    pub const OPSEVENTS_FAILED: &str = "hubguard.opsevents.failed";
    /// Gauge (s): each service's clock minus this host's, as measured from its responses'
    /// `Date` (by `service`: `servicebus`, `blob`; absent before any response).
    pub const CLOCK_OFFSET: &str = "hubguard.clock.offset";
}

/// The values of [`metric_attr::KIND`] on [`metric::BACKLOG_EVENTS`].
pub mod backlog_kind {
    /// Events enqueued past a partition's checkpoint, over every partition.
    pub const UNREAD: &str = "unread";
    /// Retries due now that still wait.
    pub const RETRIES_DUE: &str = "retries_due";
    /// Events parked behind an earlier event of their ordering key.
    pub const PARKED: &str = "parked";
}

/// Metric attribute keys.
pub mod metric_attr {
    /// The partition.
    pub const PARTITION: &str = "partition";
    /// The held reason (the dependency).
    pub const REASON: &str = "reason";
    /// The event type.
    pub const EVENT_TYPE: &str = "event_type";
    /// The downstream (breaker name).
    pub const DOWNSTREAM: &str = "downstream";
    /// What a backlog gauge counts ([`super::backlog_kind`]).
    pub const KIND: &str = "kind";
    /// An operational event's CloudEvents type.
    pub const TYPE: &str = "type";
    /// The Azure service whose clock is measured (`servicebus`, `blob`).
    pub const SERVICE: &str = "service";
}

/// Every name above, for the dashboard consistency test.
pub fn all() -> Vec<&'static str> {
    vec![
        span::ATTEMPT,
        span::HANDLER,
        span::BATCH,
        span::SCHEDULE,
        span::LEDGER_WRITE,
        span::PARK,
        attr::MESSAGING_OPERATION_TYPE,
        attr::MESSAGING_OPERATION_NAME,
        attr::MESSAGE_ID,
        attr::CONVERSATION_ID,
        attr::EVENT_TYPE,
        attr::ATTEMPT,
        attr::MAX_ATTEMPTS,
        attr::OUTCOME,
        attr::NEXT_ATTEMPT_AT,
        attr::POLICY,
        attr::TERMINAL,
        attr::DEAD_LETTER_REASON,
        attr::ERROR_MESSAGE,
        attr::ERROR_TYPE,
        attr::HTTP_STATUS,
        attr::RETRY_AFTER,
        attr::RETRY_AFTER_CAPPED_FROM,
        attr::RATE_LIMIT_WAIT,
        attr::MESSAGING_SYSTEM,
        attr::MESSAGING_DESTINATION,
        attr::MESSAGING_CONSUMER_GROUP,
        attr::MESSAGING_PARTITION,
        attr::SEQUENCE_NUMBER,
        attr::REPLAY,
        attr::PARKED_BEHIND,
        attr::PARKED_BEHIND_SEQUENCE_NUMBER,
        metric::DELIVERED,
        metric::RETRIES_SCHEDULED,
        metric::DEAD_LETTERED,
        metric::DEFERRED,
        metric::PAUSED,
        metric::RESCUED,
        metric::RECOVERED,
        metric::FORWARDED,
        metric::RECORDS_REBUILT,
        metric::RECORDS_MISSING,
        metric::RETRIES_PENDING,
        metric::RETRIES_OVERDUE,
        metric::LINES_PARKED,
        metric::LINES_OLDEST_PARKED_AGE,
        metric::SETTLE_FAILURES,
        metric::HANDLER_DURATION,
        metric::RETRY_LATENESS,
        metric::CHECKPOINT_LAG_EVENTS,
        metric::CHECKPOINT_LAG_SECONDS,
        metric::PARTITIONS_HELD,
        metric::RETRY_LOOP_STATE,
        metric::BREAKER_AGE,
        metric::BREAKER_OPENS,
        metric::BREAKER_OPEN_DURATION,
        metric::STORM_GUARD_HOLDING,
        metric::STORM_GUARD_AGE,
        metric::STORM_GUARD_HELD,
        metric::PARTITION_HELD_SECONDS,
        metric::PARTITIONS_OWNED,
        metric::PARTITIONS_UNOWNED,
        metric::READY,
        metric::CONSUMER_STATE,
        metric::RETENTION,
        metric::RATE_LIMIT,
        metric::RATE_CURRENT,
        metric::RATE_DEPLOYMENT,
        metric::RATE_DECREASES,
        metric::BACKLOG_EVENTS,
        metric::OPSEVENTS_SENT,
        metric::OPSEVENTS_SUPPRESSED,
        metric::OPSEVENTS_DROPPED,
        metric::OPSEVENTS_FAILED,
        metric::CLOCK_OFFSET,
        metric_attr::PARTITION,
        metric_attr::REASON,
        metric_attr::EVENT_TYPE,
        metric_attr::DOWNSTREAM,
        metric_attr::KIND,
        metric_attr::TYPE,
        metric_attr::SERVICE,
    ]
}
