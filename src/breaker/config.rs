//! The breaker's settings and the error naming a setting out of range.

use serde::Deserialize;

/// Breaker settings. It trips on `consecutive_failures` transient failures in a row, or (when
/// `failure_ratio` is set) when that share of the last `ratio_window` calls failed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Whether the breaker is used at all.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Consecutive transient failures that open it.
    #[serde(default = "d5")]
    pub consecutive_failures: u32,
    /// Trip also when this share (0–1) of the last `ratio_window` calls failed.
    #[serde(default)]
    pub failure_ratio: Option<f64>,
    /// Calls the failure ratio is computed over.
    #[serde(default = "d20")]
    pub ratio_window: u32,
    /// How long it stays open (ms).
    #[serde(default = "d30000")]
    pub open_ms: u64,
    /// Deferred work returns spread over this window after the expiry (ms).
    #[serde(default = "d10000")]
    pub spread_ms: u64,
    /// A half-open trial whose calls do not all report back within this is judged on what
    /// did report (ms).
    #[serde(default = "d30000")]
    pub probe_timeout_ms: u64,
    /// Calls a half-open breaker lets through, cluster-wide, to judge the downstream.
    #[serde(default = "d10")]
    pub half_open_calls: u32,
    /// The share (0–1] of those calls that must succeed for it to close.
    #[serde(default = "half")]
    pub half_open_success_ratio: f64,
    /// At the brink — one failure short of `consecutive_failures` in a row, counting new
    /// events' calls in flight — a new event from a partition waits up to this long (ms) for a
    /// call to succeed before it makes the call that may trip the breaker (0: never waits).
    #[serde(default = "d10000")]
    pub brink_hold_ms: u64,
}

fn yes() -> bool {
    true
}

fn d20() -> u32 {
    20
}

fn d10() -> u32 {
    10
}

fn half() -> f64 {
    0.5
}

fn d5() -> u32 {
    5
}
fn d30000() -> u64 {
    30_000
}
fn d10000() -> u64 {
    10_000
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            consecutive_failures: 5,
            failure_ratio: None,
            ratio_window: 20,
            open_ms: 30_000,
            spread_ms: 10_000,
            probe_timeout_ms: 30_000,
            half_open_calls: 10,
            half_open_success_ratio: 0.5,
            brink_hold_ms: 10_000,
        }
    }
}

impl BreakerConfig {
    /// Successes of a half-open trial that close the breaker: at least one, at most all.
    pub fn successes_to_close(&self) -> u32 {
        let n = self.half_open_calls.max(1);
        ((self.half_open_success_ratio * f64::from(n)).ceil() as u32).clamp(1, n)
    }

    /// Checks the settings; the error names the key and what is allowed.
    pub fn validate(&self) -> Result<(), BreakerConfigError> {
        if self.half_open_calls == 0 {
            return Err(BreakerConfigError::NoTrialCalls);
        }
        if !(self.half_open_success_ratio > 0.0 && self.half_open_success_ratio <= 1.0) {
            return Err(BreakerConfigError::SuccessRatio(
                self.half_open_success_ratio,
            ));
        }
        Ok(())
    }
}

/// A breaker setting out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BreakerConfigError {
    /// A half-open trial lets no call through.
    #[error("breaker.half_open_calls must be at least 1")]
    NoTrialCalls,
    /// The share of a trial's calls that must succeed is not in (0, 1].
    #[error("breaker.half_open_success_ratio must be above 0 and at most 1, got {0}")]
    SuccessRatio(f64),
}

impl BreakerConfigError {
    /// The configuration key of the setting.
    pub fn key(&self) -> &'static str {
        match self {
            Self::NoTrialCalls => "breaker.half_open_calls",
            Self::SuccessRatio(_) => "breaker.half_open_success_ratio",
        }
    }
}
