//! The `rate_limit` bench scenario: three replicas, one webhook, `handler.rate_limit` for
//! the whole deployment, a backlog of events waiting in the hub.
//!
//! 1. **The cap**: a receiver that takes everything; the receiver's own log must show no
//!    one-second window (sliding) above 105 % of the limit.
//! 2. **Adaptation**: a receiver that answers 429 above `cap` requests a second (no
//!    `Retry-After`); the deployment's rate must come down to `cap` within 30 s, with no
//!    dead letter and no breaker opening.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use tokio_util::sync::CancellationToken;

use super::pipelines::{bench_options, parts, start};
use crate::breaker::BreakerConfig;
use crate::emulator::capped::{max_in_any_second, per_second, CappedReceiver, Logged};
use crate::emulator::Emulators;
use crate::handler::webhook::{WebhookConfig, WebhookHandler};
use crate::pipeline::Pipeline;
use crate::policy::{Curve, RetryPolicy};
use crate::ratelimit::limiter::Limiter;
use crate::ratelimit::RateLimitConfig;

/// What one phase measured.
#[derive(Debug, Clone)]
pub struct Phase {
    /// The configured limit (requests/s, the whole deployment).
    pub limit: f64,
    /// The receiver's capacity (`None`: unlimited).
    pub cap: Option<u32>,
    /// Events delivered.
    pub events: usize,
    /// Seconds from the first request to the last delivery.
    pub seconds: f64,
    /// The most requests in any one-second window (sliding), from the start.
    pub max_per_s: usize,
    /// The same from 30 s on.
    pub max_per_s_after_30s: usize,
    /// Requests per whole second (the receiver's log).
    pub per_second: Vec<u32>,
    /// From when on no whole second held more than `cap` requests (s), if ever.
    pub converged_at_s: Option<usize>,
    /// Whole seconds from 30 s on above `cap`.
    pub seconds_above_cap_after_30s: usize,
    /// Requests answered 429.
    pub throttled: usize,
    /// Dead letters (all replicas).
    pub dead_lettered: u64,
    /// Breaker openings.
    pub breaker_opens: u64,
    /// Rate decreases (deployment-wide).
    pub decreases: u64,
}

/// Both phases.
#[derive(Debug, Clone)]
pub struct RateLimitFigures {
    /// The cap holding with a receiver that takes everything.
    pub cap: Phase,
    /// Adaptation to a receiver that takes `cap` a second.
    pub adaptive: Phase,
}

/// Runs `events` through three replicas limited to `limit`/s to a receiver taking `cap`/s.
async fn phase(events: usize, limit: f64, cap: Option<u32>) -> anyhow::Result<Phase> {
    let partitions = 6;
    let (emulators, cs) = start(partitions).await?;
    let receiver = CappedReceiver::start("127.0.0.1:0".parse()?, cap, None).await?;
    let policy = replica_policy();
    let cancel = CancellationToken::new();
    let mut runs = Vec::new();
    let mut limiters = Vec::new();
    let mut healths = Vec::new();
    let mut breakers = Vec::new();
    for r in 0..3 {
        let pipeline = replica(&emulators, &receiver, &policy, r, limit)?;
        limiters.push(pipeline.rate_limiter().context("a limit is configured")?);
        healths.push(pipeline.health());
        breakers.push(pipeline.breaker());
        runs.push(tokio::spawn(pipeline.run(cancel.clone())));
    }
    // The backlog arrives once the replicas have shared the partitions out.
    wait_shared_out(&limiters).await?;
    super::produce(&cs, partitions, events, 256).await?;
    wait_delivered(&receiver, events).await?;
    cancel.cancel();
    for r in runs {
        r.await??;
    }
    let log = since_first(receiver.log());
    let seconds = log.last().map_or(0.0, |l| l.at.as_secs_f64());
    let ps = per_second(&log);
    let (converged_at_s, seconds_above_cap_after_30s) = convergence(&ps, cap);
    let mut opens = 0;
    for b in breakers.iter().flatten() {
        opens = opens.max(b.cached().map_or(0, |r| r.opens));
    }
    let figures = Phase {
        limit,
        cap,
        events,
        seconds,
        max_per_s: max_in_any_second(&log, Duration::ZERO),
        max_per_s_after_30s: max_in_any_second(&log, Duration::from_secs(30)),
        per_second: ps,
        converged_at_s,
        seconds_above_cap_after_30s,
        throttled: receiver.throttled(),
        dead_lettered: healths.iter().map(|h| h.snapshot().dead_lettered).sum(),
        breaker_opens: opens,
        decreases: limiters
            .iter()
            .map(|l| l.snapshot().decreases)
            .max()
            .unwrap_or(0),
    };
    receiver.shutdown().await;
    emulators.shutdown().await;
    Ok(figures)
}

/// Every replica's retry policy: a fixed 1 s (at most 60 s), 50 attempts.
fn replica_policy() -> RetryPolicy {
    RetryPolicy {
        name: "bench".into(),
        curve: Curve::Fixed,
        base_s: 1,
        floor_s: 1,
        cap_s: 60,
        max_attempts: 50,
        max_age_s: None,
    }
}

/// Replica `r`: 8 in flight, `limit`/s in all, a breaker, a webhook to `receiver`.
fn replica(
    emulators: &Emulators,
    receiver: &CappedReceiver,
    policy: &RetryPolicy,
    r: usize,
    limit: f64,
) -> anyhow::Result<Pipeline> {
    let mut options = bench_options();
    options.owner_id = format!("bench-{r}");
    options.max_in_flight = 8;
    options.rate_limit = RateLimitConfig::per_second(limit);
    let handler = Arc::new(
        WebhookHandler::new(WebhookConfig {
            timeout_ms: 5000,
            ..WebhookConfig::new(receiver.url())
        })
        .map_err(|e| anyhow::anyhow!(e))?,
    );
    let mut p = parts(emulators, handler, policy.clone(), options)?;
    p.breaker = Some(BreakerConfig::default());
    Ok(Pipeline::new(p))
}

/// Waits (at most 60 s) until the replicas' limiters share the whole limit, each a part.
async fn wait_shared_out(limiters: &[Arc<Limiter>]) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let shares: Vec<f64> = limiters.iter().map(|l| l.snapshot().share).collect();
        // Shares are kept in millionths, rounded down.
        if shares.iter().all(|s| *s > 0.0) && (shares.iter().sum::<f64>() - 1.0).abs() < 1e-5 {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the replicas did not share the partitions out: {shares:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `receiver` took `events` (fails on 60 s without progress or 600 s in all).
async fn wait_delivered(receiver: &CappedReceiver, events: usize) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let mut last = (0, tokio::time::Instant::now());
    loop {
        let delivered = receiver.delivered().len();
        if delivered >= events {
            return Ok(());
        }
        if delivered != last.0 {
            last = (delivered, tokio::time::Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(60) {
            bail!("rate-limited delivery stalled at {delivered} of {events}");
        }
        if tokio::time::Instant::now() > deadline {
            bail!("rate-limited delivery took too long: {delivered} of {events}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The receiver's log with times since its first request.
fn since_first(log: Vec<Logged>) -> Vec<Logged> {
    let start_at = log.first().map(|l| l.at).unwrap_or_default();
    log.into_iter()
        .map(|l| Logged {
            at: l.at - start_at,
            status: l.status,
        })
        .collect()
}

/// With a `cap`: when the rate came under it to stay, and full seconds above it from 30 s on.
fn convergence(ps: &[u32], cap: Option<u32>) -> (Option<usize>, usize) {
    // The last second is partial; a second is "above" when it holds more than the cap.
    let full = &ps[..ps.len().saturating_sub(1)];
    let converged_at_s = cap.and_then(|c| {
        let last_above = full.iter().rposition(|n| *n > c);
        match last_above {
            None => Some(0),
            Some(i) if i + 1 < full.len() => Some(i + 1),
            Some(_) => None,
        }
    });
    let seconds_above_cap_after_30s =
        cap.map_or(0, |c| full.iter().skip(30).filter(|n| **n > c).count());
    (converged_at_s, seconds_above_cap_after_30s)
}

/// The scenario: the cap with `limit` and an unlimited receiver (`cap_events` events), then
/// adaptation with `limit` and a receiver taking `cap` a second (`adaptive_events`).
pub async fn rate_limit(
    limit: f64,
    cap: u32,
    cap_events: usize,
    adaptive_events: usize,
) -> anyhow::Result<RateLimitFigures> {
    Ok(RateLimitFigures {
        cap: phase(cap_events, limit, None).await?,
        adaptive: phase(adaptive_events, limit, Some(cap)).await?,
    })
}
