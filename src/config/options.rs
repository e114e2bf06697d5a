//! The pipeline's tunables as a checked configuration sets them.

use std::time::Duration;

use crate::pipeline::{OrderingKey, PipelineOptions, RetryOrdering};

use super::{invalid, Config, ConfigError, HandlerSection, RetryOrderingKind, StartPosition};

impl Config {
    /// `processor.retry_ordering` with `processor.line_on_dead_letter`: refused when lines
    /// are on without an ordering key to line events up by.
    pub(super) fn retry_ordering(&self) -> Result<RetryOrdering, ConfigError> {
        match self.processor.retry_ordering {
            RetryOrderingKind::Off => Ok(RetryOrdering::Off),
            RetryOrderingKind::Key if self.processor.ordering_key == OrderingKey::None => Err(invalid(
                "processor.retry_ordering",
                "processor.retry_ordering = \"key\" needs an ordering key: processor.ordering_key is `none`",
            )),
            RetryOrderingKind::Key => Ok(RetryOrdering::Key(self.processor.line_on_dead_letter)),
        }
    }

    /// The tunables this configuration sets (the rest at their defaults).
    pub fn pipeline_options(&self) -> Result<PipelineOptions, ConfigError> {
        Ok(PipelineOptions {
            owner_id: self
                .processor
                .owner_id
                .clone()
                .filter(|o| !o.is_empty())
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            update_interval: Duration::from_millis(self.processor.update_interval_ms),
            ownership_expiration: Duration::from_millis(self.processor.ownership_expiration_ms),
            checkpoint_every_events: self.checkpoint.every_events,
            checkpoint_every: Duration::from_millis(self.checkpoint.every_ms),
            checkpoint_min_interval: Duration::from_millis(self.checkpoint.min_interval_ms),
            max_in_flight: self.processor.max_in_flight,
            window: self
                .processor
                .window
                .unwrap_or_else(|| super::window_for(self.processor.max_in_flight)),
            ordering: self.processor.ordering_key.clone(),
            retry_ordering: self.retry_ordering()?,
            prefetch: self.processor.prefetch,
            partition_threads: self.processor.threads,
            start_at_latest: self.processor.start == StartPosition::Latest,
            deadline: Duration::from_millis(self.retry.call_deadline_ms),
            retry_concurrency: self.retry.concurrency,
            retry_lead: Duration::from_millis(self.retry.lead_ms),
            retry_prefetch: self.retry.prefetch,
            retry_receive_wait: Duration::from_millis(self.retry.receive_wait_ms),
            retry_pause_recheck: Duration::from_millis(self.retry.pause_recheck_ms),
            dead_letter_sweep: Duration::from_millis(self.retry.dead_letter_sweep_ms),
            overdue_margin: Duration::from_millis(self.retry.overdue_margin_ms),
            retention: (self.ledger.retention_days > 0)
                .then(|| Duration::from_secs(self.ledger.retention_days.saturating_mul(86_400))),
            unhealthy_after: (self.status.unhealthy_after_ms > 0)
                .then(|| Duration::from_millis(self.status.unhealthy_after_ms)),
            backlog_every: Duration::from_millis(self.status.backlog_every_ms),
            max_clock_skew: Duration::from_millis(self.status.max_clock_skew_ms),
            storm_guard: self.storm_guard.enabled.then(|| self.storm_guard.clone()),
            rate_limit: {
                let HandlerSection::Webhook(w) = &self.handler;
                crate::ratelimit::RateLimitConfig {
                    per_s: w.rate_limit,
                    adaptive: w.rate_limit_adaptive,
                }
            },
            ..Default::default()
        })
    }
}
