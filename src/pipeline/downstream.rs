//! The downstream's guards as a pipeline is assembled: its circuit breaker, its dead-letter
//! storm guard and its rate limiter, their gauges, and the health that watches them.

use std::sync::Arc;

use super::health::Health;
use super::{Downstream, PipelineParts};
use crate::handler::Handler;

impl Downstream {
    /// The handler and what guards its downstream, with their gauges registered.
    pub(super) fn new(
        handler: Arc<dyn Handler>,
        breaker: Option<Arc<crate::breaker::Shared>>,
        storm: Option<Arc<crate::breaker::storm::Guard>>,
        limiter: Option<Arc<crate::ratelimit::limiter::Limiter>>,
    ) -> Self {
        use crate::telemetry::gauges::{
            RateLimitGauges, RateLimitReadings, StormGuardGauges, StormGuardReadings,
        };
        Self {
            handler,
            breaker,
            _storm_gauges: storm
                .clone()
                .map(|g| StormGuardGauges::register(g as Arc<dyn StormGuardReadings>)),
            storm,
            _rate_gauges: limiter
                .clone()
                .map(|l| RateLimitGauges::register(l as Arc<dyn RateLimitReadings>)),
            limiter,
        }
    }
}

/// The pipeline's health, watching the downstream's breaker and storm guard.
pub(super) fn health(
    parts: &PipelineParts,
    breaker: Option<&Arc<crate::breaker::Shared>>,
    storm: Option<&Arc<crate::breaker::storm::Guard>>,
) -> Arc<Health> {
    let o = &parts.options;
    let health = Arc::new(Health::new(o.clock.clone()).with_max_skew(o.max_clock_skew));
    health.set_unhealthy_after(o.unhealthy_after);
    if let Some(b) = breaker {
        health.watch(b.clone());
    }
    if let Some(g) = storm {
        health.watch(g.clone());
        health.set_storm_guard(g.clone());
    }
    health
}

/// The downstream's shared circuit breaker, if configured and enabled.
pub(super) fn breaker(parts: &PipelineParts) -> Option<Arc<crate::breaker::Shared>> {
    parts.breaker.clone().filter(|b| b.enabled).map(|b| {
        Arc::new(
            crate::breaker::Shared::new(
                parts.records.clone(),
                &parts.handler.downstream(),
                &parts.options.owner_id,
                b,
            )
            .with_clock(parts.options.clock.clone()),
        )
    })
}

/// The downstream's dead-letter storm guard, if configured.
pub(super) fn storm_guard(parts: &PipelineParts) -> Option<Arc<crate::breaker::storm::Guard>> {
    let config = parts.options.storm_guard.clone().filter(|c| c.enabled)?;
    Some(Arc::new(
        crate::breaker::storm::Guard::new(
            parts.records.clone(),
            &parts.handler.downstream(),
            &parts.options.owner_id,
            config,
        )
        .with_clock(parts.options.clock.clone()),
    ))
}

/// The downstream's rate limiter: when `rate_limit` is configured or the handler can grant a
/// rate. Its share of the rate (from the replicas' demands) holds for an ownership expiration
/// after each renewal, as a claim does.
pub(super) fn rate_limiter(
    parts: &PipelineParts,
) -> Option<Arc<crate::ratelimit::limiter::Limiter>> {
    let allowed = parts.handler.allowed_rate();
    if parts.options.rate_limit.per_s.is_none() && allowed.is_none() {
        return None;
    }
    let o = &parts.options;
    let limiter = crate::ratelimit::limiter::Limiter::new(
        o.rate_limit,
        parts.records.clone(),
        &parts.handler.downstream(),
        &o.owner_id,
        o.ownership_expiration,
        o.clock.clone(),
    );
    Some(Arc::new(match allowed {
        Some(a) => limiter.with_allowed_rate(a),
        None => limiter,
    }))
}
