//! The per-section checks of values serde cannot check, what the retry queue must offer, and
//! the warnings about allowed but risky settings.

use std::time::Duration;

use super::{entity_key, invalid, Config, ConfigError, HandlerSection};

/// `dead_letters.queue` must be another queue than the retry queue, compared as Service Bus
/// compares entity names: not `servicebus.queue` in any case, not its `$DeadLetterQueue`
/// sub-queue (which Service Bus fills itself and nobody may send to), and not an address
/// (the queue lives in the `[servicebus]` namespace; an address could spell that namespace
/// differently — host names are case-insensitive — and still be the retry queue).
pub(super) fn dead_letter_queue_is_not_the_retry_queue(
    dead: &str,
    retry: &str,
) -> Result<(), ConfigError> {
    let key = "dead_letters.queue";
    let (d, r) = (entity_key(dead), entity_key(retry));
    if d.is_empty() {
        return Err(invalid(
            key,
            "dead_letters.queue must name a queue (it is empty)",
        ));
    }
    if d.contains("://") {
        return Err(invalid(key, format!(
            "dead_letters.queue ({dead:?}) must be a queue name in the [servicebus] namespace, not an address"
        )));
    }
    if d == r {
        return Err(invalid(key, format!(
            "dead_letters.queue ({dead:?}) is servicebus.queue ({retry:?}): Service Bus entity names are case-insensitive; name a queue other than the retry queue"
        )));
    }
    if d.ends_with("/$deadletterqueue") || d.contains("$") {
        let whose = if d.strip_suffix("/$deadletterqueue") == Some(r.as_str()) {
            format!("the dead-letter sub-queue of servicebus.queue ({retry:?})")
        } else {
            "a Service Bus system sub-queue".to_string()
        };
        return Err(invalid(key, format!(
            "dead_letters.queue ({dead:?}) is {whose}: Service Bus fills it itself and nothing may be sent to it; name a queue of its own"
        )));
    }
    Ok(())
}

impl Config {
    /// Checks values serde cannot, section by section (the first problem found is reported).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.eventhubs.access()?;
        if self.eventhubs.hub.trim().is_empty() {
            return Err(invalid("eventhubs.hub", "eventhubs.hub must not be empty"));
        }
        if let Some(e) = &self.eventhubs.rest_endpoint {
            let ok = url::Url::parse(e)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if !ok {
                return Err(invalid(
                    "eventhubs.rest_endpoint",
                    format!("eventhubs.rest_endpoint ({e:?}) must be an http(s) URL with a host (leave it out against Azure: https://{{namespace}}/ is used)"),
                ));
            }
        }
        self.servicebus.access()?;
        self.validate_storage()?;
        self.validate_handler()?;
        self.validate_minimums()?;
        self.validate_processor()?;
        self.validate_retry()?;
        self.console.check()?;
        self.validate_checkpoint()?;
        self.validate_policies()?;
        self.validate_duplicate_window()?;
        self.validate_breaker()?;
        self.storm_guard
            .validate()
            .map_err(|e| invalid(e.key(), e))?;
        if let Some(d) = &self.dead_letters {
            d.validate(&self.servicebus.queue)?;
        }
        if let Some(o) = &self.operational_events {
            o.validate(&self.servicebus.queue)?;
        }
        if self.eventhubs.retention_hours == 0 {
            return Err(invalid(
                "eventhubs.retention_hours",
                "eventhubs.retention_hours must be positive",
            ));
        }
        Ok(())
    }

    fn validate_storage(&self) -> Result<(), ConfigError> {
        let url = url::Url::parse(&self.storage.container_url).map_err(|e| {
            invalid(
                "storage.container_url",
                format!("storage.container_url is not a URL: {e}"),
            )
        })?;
        // Azure Storage authorizes a request by Shared Key, a SAS in the query, Entra ID or
        // anonymous read access — never by a user name and password in the URL
        // (https://learn.microsoft.com/en-us/rest/api/storageservices/authorize-requests-to-azure-storage).
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid(
                "storage.container_url",
                "storage.container_url must not carry a user name or password (Azure Storage takes a SAS in the query, or storage.credential)",
            ));
        }
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid(
                "storage.container_url",
                format!(
                    "storage.container_url must be an https (or, for an emulator, http) URL, not {}:",
                    url.scheme()
                ),
            ));
        }
        let loopback = matches!(url.host_str(), Some("127.0.0.1" | "localhost" | "[::1]"));
        if self.storage.credential.is_some() && url.scheme() != "https" && !loopback {
            return Err(invalid("storage.credential",
                "storage.credential needs an https storage.container_url (Azure takes bearer tokens over TLS only)",
            ));
        }
        Ok(())
    }

    /// The webhook's settings, its secrets and TLS files read and checked (wiring builds the
    /// handler).
    fn validate_handler(&self) -> Result<(), ConfigError> {
        let HandlerSection::Webhook(w) = &self.handler;
        if w.timeout_ms == 0 {
            return Err(invalid("handler.timeout_ms",
                "handler.timeout_ms must be positive: a webhook call with no time to answer fails every event",
            ));
        }
        w.check().map_err(|e| invalid(e.key(), e))?;
        if let Some(limit) = w.rate_limit {
            crate::ratelimit::validate_limit(limit)
                .map_err(|e| invalid("handler.rate_limit", format!("handler.rate_limit {e}")))?;
        }
        Ok(())
    }

    /// Values below which nothing would run.
    fn validate_minimums(&self) -> Result<(), ConfigError> {
        for (key, value, min) in [
            ("retry.call_deadline_ms", self.retry.call_deadline_ms, 100),
            ("retry.receive_wait_ms", self.retry.receive_wait_ms, 1),
            ("retry.pause_recheck_ms", self.retry.pause_recheck_ms, 1_000),
            ("retry.concurrency", self.retry.concurrency as u64, 1),
            ("retry.prefetch", self.retry.prefetch as u64, 1),
            (
                "processor.update_interval_ms",
                self.processor.update_interval_ms,
                100,
            ),
            ("processor.prefetch", u64::from(self.processor.prefetch), 1),
            (
                "status.backlog_every_ms",
                self.status.backlog_every_ms,
                1_000,
            ),
            (
                "status.max_clock_skew_ms",
                self.status.max_clock_skew_ms,
                1_000,
            ),
        ] {
            if value < min {
                let why = match key {
                    "retry.call_deadline_ms" => "every call to Azure would time out before it is sent, and nothing would ever be consumed",
                    "retry.receive_wait_ms" => "the retry loop would poll Service Bus without pause",
                    "retry.pause_recheck_ms" => "every paused retry would cost a ledger write and a Service Bus message many times a second",
                    "processor.prefetch" => "a partition with no prefetch receives nothing",
                    "status.backlog_every_ms" => "each sample reads every partition's properties, the checkpoints and the ledger's listing",
                    "status.max_clock_skew_ms" => "the skew is measured from HTTP Date headers, which carry whole seconds",
                    _ => "nothing would run",
                };
                return Err(invalid(
                    key,
                    format!("{key} must be at least {min} (got {value}): {why}"),
                ));
            }
        }
        if self.status.max_clock_skew_ms > 900_000 {
            return Err(invalid(
                "status.max_clock_skew_ms",
                format!("status.max_clock_skew_ms must be at most 900000 (got {}): Azure Storage itself refuses a Shared Key request dated more than 15 minutes off", self.status.max_clock_skew_ms),
            ));
        }
        Ok(())
    }

    fn validate_processor(&self) -> Result<(), ConfigError> {
        if self.processor.ownership_expiration_ms <= self.processor.update_interval_ms {
            return Err(invalid("processor.ownership_expiration_ms", "processor.ownership_expiration_ms must be greater than processor.update_interval_ms"));
        }
        if !(1..=10_000).contains(&self.processor.max_in_flight) {
            return Err(invalid(
                "processor.max_in_flight",
                "processor.max_in_flight must be between 1 and 10000",
            ));
        }
        if self
            .processor
            .window
            .is_some_and(|w| w > super::sections::MAX_WINDOW)
        {
            return Err(invalid(
                "processor.window",
                format!(
                    "processor.window must be at most {} (each event in it is held in memory)",
                    super::sections::MAX_WINDOW
                ),
            ));
        }
        // A partition uses one thread, and an event hub has at most 1,024 partitions
        // (Dedicated; "Event Hubs quotas and limits",
        // https://learn.microsoft.com/azure/event-hubs/event-hubs-quotas): the threads start
        // with the replica, so more would only idle.
        if self.processor.threads > 1_024 {
            return Err(invalid(
                "processor.threads",
                format!("processor.threads must be at most 1024 (got {}): a partition uses one thread, and an event hub has at most 1,024 partitions; 0 is one per core", self.processor.threads),
            ));
        }
        self.retry_ordering().map(drop)
    }

    fn validate_retry(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            (
                "retry.dead_letter_sweep_ms",
                self.retry.dead_letter_sweep_ms,
            ),
            ("retry.overdue_margin_ms", self.retry.overdue_margin_ms),
        ] {
            if value < 1000 {
                return Err(invalid(
                    key,
                    format!("{key} must be at least 1000 (got {value})"),
                ));
            }
        }
        Ok(())
    }

    fn validate_checkpoint(&self) -> Result<(), ConfigError> {
        if self.checkpoint.every_events == 0 || self.checkpoint.every_ms == 0 {
            return Err(invalid(
                "checkpoint.every_events",
                "checkpoint.every_events and checkpoint.every_ms must be positive",
            ));
        }
        if self.checkpoint.min_interval_ms > self.checkpoint.every_ms {
            return Err(invalid(
                "checkpoint.min_interval_ms",
                "checkpoint.min_interval_ms must not exceed checkpoint.every_ms",
            ));
        }
        Ok(())
    }

    fn validate_policies(&self) -> Result<(), ConfigError> {
        self.policy
            .default
            .validate()
            .map_err(|e| invalid("policy.default", format!("policy.default: {e}")))?;
        for (t, p) in &self.policy.types {
            p.validate().map_err(|e| {
                invalid(
                    format!("policy.types.\"{t}\""),
                    format!("policy.types.\"{t}\": {e}"),
                )
            })?;
        }
        Ok(())
    }

    /// A replay re-sends a retry message with the same MessageId, and so does a redelivered
    /// retry message; if either can happen after the duplicate-detection window, a second
    /// retry message would be created. The window needed is [`QueueNeeds::window`]'s (the
    /// start-up proof's), with the queue's lock duration unknown here (Service Bus's
    /// default, 60 s, as there).
    ///
    /// [`QueueNeeds::window`]: crate::azure::retry_queue::QueueNeeds::window
    fn validate_duplicate_window(&self) -> Result<(), ConfigError> {
        let needs = self.queue_needs();
        let need = needs.window(None);
        let window = self.servicebus.duplicate_detection_window_s;
        if Duration::from_secs(window) < need {
            return Err(invalid("servicebus.duplicate_detection_window_s", format!(
                "servicebus.duplicate_detection_window_s ({window}) is shorter than this configuration needs ({} s: the longer of the schedule-to-replay gap, {} s, and the re-send of a retry message redelivered after its lock lapsed): a replay or a redelivery could schedule a second retry. Raise the window on the queue (and here) or checkpoint more often",
                need.as_secs_f64().ceil(),
                needs.replay_gap.as_secs_f64().ceil()
            )));
        }
        Ok(())
    }

    fn validate_breaker(&self) -> Result<(), ConfigError> {
        if !self.breaker.enabled {
            return Ok(());
        }
        if self.breaker.consecutive_failures == 0 || self.breaker.open_ms == 0 {
            return Err(invalid("breaker", "breaker.consecutive_failures and breaker.open_ms must be positive (or set breaker.enabled = false)"));
        }
        self.breaker.validate().map_err(|e| invalid(e.key(), e))?;
        if Duration::from_millis(self.breaker.open_ms + self.breaker.probe_timeout_ms)
            >= Duration::from_secs(self.eventhubs.retention_hours * 3600)
        {
            return Err(invalid("breaker.open_ms", format!(
                "breaker.open_ms + breaker.probe_timeout_ms reaches eventhubs.retention_hours ({} h): a partition paused by the breaker would lose events to retention",
                self.eventhubs.retention_hours
            )));
        }
        Ok(())
    }

    /// What the retry queue must offer for this configuration: the start-up proof checks the
    /// queue's description against it, and validation the configured window.
    pub(crate) fn queue_needs(&self) -> crate::azure::retry_queue::QueueNeeds {
        crate::azure::retry_queue::QueueNeeds {
            replay_gap: self.replay_gap(),
            call_deadline: Duration::from_millis(self.retry.call_deadline_ms),
        }
    }

    /// Warnings about configurations that are allowed but risky.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        let retention = Duration::from_secs(self.eventhubs.retention_hours * 3600);
        if retention < Duration::from_secs(24 * 3600) {
            w.push(format!(
                "eventhubs.retention_hours is {}: a partition held longer than that (Service Bus or blob storage down) loses its oldest events to retention",
                self.eventhubs.retention_hours
            ));
        }
        w
    }

    /// The longest time from Service Bus accepting a retry message to a replay of its event
    /// re-sending the same MessageId, which the queue's duplicate-detection window must cover
    /// ([`crate::pipeline::replay_gap`], from `checkpoint.every_ms`,
    /// `processor.ownership_expiration_ms` and `retry.call_deadline_ms`).
    pub fn replay_gap(&self) -> Duration {
        crate::pipeline::replay_gap(
            Duration::from_millis(self.checkpoint.every_ms),
            Duration::from_millis(self.processor.ownership_expiration_ms),
            Duration::from_millis(self.retry.call_deadline_ms),
        )
    }
}
