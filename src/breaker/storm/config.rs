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
    /// While it holds, a held retry is deferred by as long as the guard has held so far (at
    /// least one trial interval, past the next trial), at most this long (ms): a retry held
    /// for an hour is sent back to Service Bus a few dozen times, not once per trial, and is
    /// attempted at most this long after the guard releases.
    #[serde(default = "d120000")]
    pub held_retry_defer_max_ms: u64,
    /// Per event type: `enabled = false` leaves a type out (its refusals are always
    /// dead-lettered at once, never counted and never held); any of `min_refusals`, `share`,
    /// `window_ms` or `trial_every_ms` gives a type a guard of its own (its own counts, its own
    /// holding and trials, only its events held) instead of the downstream's.
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
    /// This type's own minimum (the downstream's when unset).
    #[serde(default)]
    pub min_refusals: Option<u32>,
    /// This type's own share (the downstream's when unset).
    #[serde(default)]
    pub share: Option<f64>,
    /// This type's own window (ms; the downstream's when unset).
    #[serde(default)]
    pub window_ms: Option<u64>,
    /// This type's own trial interval (ms; the downstream's when unset).
    #[serde(default)]
    pub trial_every_ms: Option<u64>,
}

impl Default for StormGuardType {
    /// Watched, by the downstream's guard.
    fn default() -> Self {
        Self {
            enabled: true,
            min_refusals: None,
            share: None,
            window_ms: None,
            trial_every_ms: None,
        }
    }
}

impl StormGuardType {
    /// A type left out of the guard (`enabled = false`).
    pub fn exempt() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    /// Whether the type has a guard of its own (any threshold of its own set).
    pub fn own(&self) -> bool {
        self.enabled
            && (self.min_refusals.is_some()
                || self.share.is_some()
                || self.window_ms.is_some()
                || self.trial_every_ms.is_some())
    }
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
fn d120000() -> u64 {
    120_000
}

impl Default for StormGuardConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            share: 0.5,
            min_refusals: 20,
            window_ms: 60_000,
            trial_every_ms: 15_000,
            held_retry_defer_max_ms: 120_000,
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

    /// The type whose own guard counts and holds events of `event_type` (`None`: the
    /// downstream's guard).
    pub fn lane_of<'a>(&self, event_type: Option<&'a str>) -> Option<&'a str> {
        event_type.filter(|t| self.event_types.get(*t).is_some_and(StormGuardType::own))
    }

    /// The settings of the guard of `lane` (a type with thresholds of its own, or `None`: the
    /// downstream's): the type's thresholds over the downstream's, no types of its own.
    pub fn lane(&self, lane: Option<&str>) -> StormGuardConfig {
        let mut c = StormGuardConfig {
            event_types: BTreeMap::new(),
            ..self.clone()
        };
        if let Some(t) = lane.and_then(|l| self.event_types.get(l)) {
            c.min_refusals = t.min_refusals.unwrap_or(c.min_refusals);
            c.share = t.share.unwrap_or(c.share);
            c.window_ms = t.window_ms.unwrap_or(c.window_ms);
            c.trial_every_ms = t.trial_every_ms.unwrap_or(c.trial_every_ms);
        }
        c
    }

    /// The event types with a guard of their own.
    pub fn own_types(&self) -> impl Iterator<Item = &str> {
        self.event_types
            .iter()
            .filter(|(_, t)| t.own())
            .map(|(n, _)| n.as_str())
    }

    /// Checks the settings; the error names the key and what is allowed.
    pub fn validate(&self) -> Result<(), StormGuardConfigError> {
        if !self.enabled {
            return Ok(());
        }
        self.validate_thresholds()?;
        if self.held_retry_defer_max_ms < self.trial_every_ms
            || self.held_retry_defer_max_ms > 3_600_000
        {
            return Err(StormGuardConfigError::HeldRetryDeferMax {
                value: self.held_retry_defer_max_ms,
                trial_every_ms: self.trial_every_ms,
            });
        }
        for (name, t) in &self.event_types {
            let wrap = |error: StormGuardConfigError| StormGuardConfigError::Type {
                event_type: name.clone(),
                error: Box::new(error),
            };
            if name.trim().is_empty() {
                return Err(StormGuardConfigError::EmptyType);
            }
            if !t.enabled && *t != StormGuardType::exempt() {
                return Err(wrap(StormGuardConfigError::ExemptWithThresholds));
            }
            self.lane(Some(name)).validate_thresholds().map_err(wrap)?;
        }
        Ok(())
    }

    fn validate_thresholds(&self) -> Result<(), StormGuardConfigError> {
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
    /// A held retry's longest deferral under the trial interval (a held retry would come back
    /// before the trial that could release it) or over an hour.
    #[error("storm_guard.held_retry_defer_max_ms must be at least storm_guard.trial_every_ms ({trial_every_ms}) and at most 3600000 (an hour), got {value}")]
    HeldRetryDeferMax {
        /// The value given.
        value: u64,
        /// The trial interval it must not be under.
        trial_every_ms: u64,
    },
    /// An event type named by an empty string.
    #[error("storm_guard.event_types: an event type's name must not be empty")]
    EmptyType,
    /// Thresholds on a type left out of the guard: they would do nothing.
    #[error("storm_guard.enabled = false (the event type left out of the guard) takes no thresholds: remove them, or enabled = true for a guard of its own")]
    ExemptWithThresholds,
    /// One event type's setting out of range.
    #[error("{}", in_type(event_type, error))]
    Type {
        /// The event type.
        event_type: String,
        /// What is wrong with its setting.
        error: Box<StormGuardConfigError>,
    },
}

impl StormGuardConfigError {
    /// The configuration key of the setting.
    pub fn key(&self) -> String {
        let field = match self {
            Self::Share(_) => "share",
            Self::MinRefusals(_) => "min_refusals",
            Self::Window(_) => "window_ms",
            Self::TrialEvery(_) => "trial_every_ms",
            Self::HeldRetryDeferMax { .. } => "held_retry_defer_max_ms",
            Self::EmptyType => "event_types",
            Self::ExemptWithThresholds => "enabled",
            Self::Type { event_type, error } => {
                let inner = error.key();
                let field = inner.trim_start_matches("storm_guard.");
                return format!("storm_guard.event_types.\"{event_type}\".{field}");
            }
        };
        format!("storm_guard.{field}")
    }
}

/// An event type's error, its key named in full.
fn in_type(event_type: &str, error: &StormGuardConfigError) -> String {
    let inner = error.to_string();
    match inner.strip_prefix("storm_guard.") {
        Some(rest) => format!("storm_guard.event_types.\"{event_type}\".{rest}"),
        None => format!("storm_guard.event_types.\"{event_type}\": {inner}"),
    }
}
