//! The storm guard's settings and the error naming a setting out of range.

use std::collections::BTreeMap;

use serde::Deserialize;

/// `[storm_guard]`: when refusals for good stop being dead-lettered for a downstream. It holds
/// once `min_refusals` attempts within `window_ms` (cluster-wide) would have ended in a dead
/// letter and they are at least `share` of the attempts that ended their event (delivered or
/// refused; transient failures are not counted). The defaults never trip on an ordinary day's
/// dead letters (a few per cent of the attempts) and always on a receiver refusing everything.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StormGuardConfig {
    /// Whether the guard is used at all (`false`: every refusal is dead-lettered at once, as
    /// before).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The share (0–1] of the attempts that ended their event within the window (delivered
    /// or refused) that must be refusals.
    #[serde(default = "half")]
    pub share: f64,
    /// The refusals within the window that trip it at the least (the most dead-lettered
    /// before it holds is one fewer).
    #[serde(default = "d20")]
    pub min_refusals: u32,
    /// The window the attempts and refusals are counted over (ms).
    #[serde(default = "d60000")]
    pub window_ms: u64,
    /// While it holds, one event is let through this often (ms), cluster-wide: delivered, the
    /// guard releases itself.
    #[serde(default = "d15000")]
    pub trial_every_ms: u64,
    /// Per event type (`event_types."order.created".enabled = false`): a type whose refusals
    /// are always dead-lettered at once, never counted and never held.
    #[serde(default)]
    pub event_types: BTreeMap<String, StormGuardType>,
}

/// The storm guard's setting for one event type.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StormGuardType {
    /// `false`: this type's refusals are dead-lettered at once and not counted.
    #[serde(default = "yes")]
    pub enabled: bool,
}

fn yes() -> bool {
    true
}
fn half() -> f64 {
    0.5
}
fn d20() -> u32 {
    20
}
fn d60000() -> u64 {
    60_000
}
fn d15000() -> u64 {
    15_000
}

impl Default for StormGuardConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            share: 0.5,
            min_refusals: 20,
            window_ms: 60_000,
            trial_every_ms: 15_000,
            event_types: BTreeMap::new(),
        }
    }
}

impl StormGuardConfig {
    /// Whether the guard watches events of `event_type`.
    pub fn covers(&self, event_type: Option<&str>) -> bool {
        self.enabled
            && event_type
                .and_then(|t| self.event_types.get(t))
                .is_none_or(|t| t.enabled)
    }

    /// Checks the settings; the error names the key and what is allowed.
    pub fn validate(&self) -> Result<(), StormGuardConfigError> {
        if !self.enabled {
            return Ok(());
        }
        if !(self.share > 0.0 && self.share <= 1.0) {
            return Err(StormGuardConfigError::Share(self.share));
        }
        if self.min_refusals < 2 {
            return Err(StormGuardConfigError::MinRefusals(self.min_refusals));
        }
        if self.window_ms < 1000 {
            return Err(StormGuardConfigError::Window(self.window_ms));
        }
        if self.trial_every_ms < 1000 {
            return Err(StormGuardConfigError::TrialEvery(self.trial_every_ms));
        }
        Ok(())
    }
}

/// A storm-guard setting out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StormGuardConfigError {
    /// The share is not in (0, 1].
    #[error("storm_guard.share must be above 0 and at most 1, got {0}")]
    Share(f64),
    /// Fewer than two refusals would trip it: one bad event among good ones would hold it.
    #[error("storm_guard.min_refusals must be at least 2 (one bad event must never trip the guard), got {0}")]
    MinRefusals(u32),
    /// A window under a second.
    #[error("storm_guard.window_ms must be at least 1000, got {0}")]
    Window(u64),
    /// Trials more often than once a second.
    #[error("storm_guard.trial_every_ms must be at least 1000, got {0}")]
    TrialEvery(u64),
}

impl StormGuardConfigError {
    /// The configuration key of the setting.
    pub fn key(&self) -> &'static str {
        match self {
            Self::Share(_) => "storm_guard.share",
            Self::MinRefusals(_) => "storm_guard.min_refusals",
            Self::Window(_) => "storm_guard.window_ms",
            Self::TrialEvery(_) => "storm_guard.trial_every_ms",
        }
    }
}
