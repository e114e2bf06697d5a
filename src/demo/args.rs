//! The demo's options: `hubguard demo`'s flags, their `--chaos` defaults, and the
//! `START:DURATION` windows and periods they are written in.

use std::time::Duration;

use anyhow::bail;
use clap::builder::ArgPredicate;
use clap::Args;

/// A `START:DURATION` window, e.g. `8s:10s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// When it starts, after the demo starts.
    pub start: Duration,
    /// How long it lasts.
    pub duration: Duration,
}

/// A duration, window or period of the demo's options that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a number followed by a unit.
    #[error("not a duration: {0:?} (use e.g. 500ms, 10s, 2m)")]
    NotADuration(String),
    /// A unit other than ms, s and m.
    #[error("unknown unit in {0:?} (use ms, s or m)")]
    UnknownUnit(String),
    /// A window that is not `START:DURATION`.
    #[error("expected START:DURATION, e.g. 8s:10s, got {0:?}")]
    NotAWindow(String),
}

/// Parses `500ms`, `10s`, `2m`.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let s = s.trim();
    let (num, unit) = s.split_at(
        s.find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len()),
    );
    let n: f64 = num
        .parse()
        .map_err(|_| DurationError::NotADuration(s.to_string()))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        _ => return Err(DurationError::UnknownUnit(s.to_string())),
    };
    Ok(Duration::from_secs_f64(secs))
}

impl std::str::FromStr for Window {
    type Err = DurationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, b) = s
            .split_once(':')
            .ok_or_else(|| DurationError::NotAWindow(s.to_string()))?;
        Ok(Self {
            start: parse_duration(a)?,
            duration: parse_duration(b)?,
        })
    }
}

/// Options of `hubguard demo`. `--chaos` switches every option left unset to the chaos
/// soak's value (100,000 events, 8 partitions, 3 replicas, two Service Bus outages, a blob
/// storage outage, a crash every 20 s, `max_in_flight` 8).
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The chaos soak: defaults for a long run under sustained faults (explicit flags win).
    #[arg(long)]
    pub chaos: bool,
    /// Events to produce.
    #[arg(long, default_value_t = 400, default_value_if("chaos", ArgPredicate::Equals("true".into()), "100000"))]
    pub events: usize,
    /// Spread the producer's sends over this long (events keep arriving during the outages).
    #[arg(long, default_value = "30s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "90s"), value_parser = parse_duration)]
    pub produce_over: Duration,
    /// Partitions of the demo hub.
    #[arg(long, default_value_t = 4, default_value_if("chaos", ArgPredicate::Equals("true".into()), "8"))]
    pub partitions: usize,
    /// Share of events whose first 1–3 deliveries fail transiently (503).
    #[arg(long, default_value_t = 0.2)]
    pub transient_rate: f64,
    /// Share of events the downstream refuses for good (400): dead-lettered at once.
    #[arg(long, default_value_t = 0.02)]
    pub permanent_rate: f64,
    /// The downstream answers 503 to everything in this window (`none` for no outage).
    #[arg(long, default_value = "6s:8s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "15s:10s"))]
    pub downstream_outage: Outage,
    /// Service Bus answers 503 in these windows (comma separated): partitions hold.
    #[arg(long, value_delimiter = ',', default_value = "20s:6s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "35s:8s,70s:6s"))]
    pub servicebus_outage: Vec<Outage>,
    /// Blob storage (checkpoints, ownership, the ledger) answers 503 in these windows.
    #[arg(long, value_delimiter = ',', default_value = "none", default_value_if("chaos", ArgPredicate::Equals("true".into()), "50s:6s"))]
    pub blob_outage: Vec<Outage>,
    /// Crash a replica (no final checkpoint, no ownership release) this often and start it
    /// again (`none` for no crashes).
    #[arg(long, default_value = "15s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "20s"))]
    pub crash_every: Every,
    /// hubguard replicas sharing the partitions.
    #[arg(long, default_value_t = 2, default_value_if("chaos", ArgPredicate::Equals("true".into()), "3"))]
    pub replicas: usize,
    /// Events of one partition handled at once (`processor.max_in_flight`).
    #[arg(long, default_value_t = 1, default_value_if("chaos", ArgPredicate::Equals("true".into()), "8"))]
    pub max_in_flight: usize,
    /// Events per webhook request (`handler.batch_max`; 1: each event alone). Above 1 the
    /// events in flight at once go out as CloudEvents JSON batches, each with its own outcome;
    /// raise `--max-in-flight` with it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub batch_max: u16,
    /// Seed for which events fail.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Give up (and fail) after this long.
    #[arg(long, default_value = "240s", default_value_if("chaos", ArgPredicate::Equals("true".into()), "1200s"), value_parser = parse_duration)]
    pub timeout: Duration,
    /// Print one JSON line at the end instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Latency of the emulated services (and the downstream): `azure`, or e.g.
    /// `blob=8ms:40ms,servicebus=15ms:80ms,eventhubs=5ms:20ms,webhook=50ms:150ms` (median:p99;
    /// see `hubguard emulator --help`). None by default.
    #[arg(long, value_name = "PROFILE")]
    pub latency: Option<crate::emulator::latency::LatencyProfile>,
}

/// The windows as text.
pub fn windows_text(w: &[Outage]) -> String {
    let active: Vec<String> = w
        .iter()
        .filter(|o| o.0.is_some())
        .map(|o| o.to_string())
        .collect();
    if active.is_empty() {
        "none".into()
    } else {
        active.join(", ")
    }
}

/// An outage window, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage(pub Option<Window>);

impl std::fmt::Display for Outage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(w) => write!(f, "from {:?} for {:?}", w.start, w.duration),
            None => f.write_str("none"),
        }
    }
}

impl std::fmt::Display for Every {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(d) => write!(f, "every {d:?}"),
            None => f.write_str("none"),
        }
    }
}

impl std::str::FromStr for Outage {
    type Err = DurationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "none" {
            Ok(Self(None))
        } else {
            s.parse().map(|w| Self(Some(w)))
        }
    }
}

/// A period, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Every(pub Option<Duration>);

impl std::str::FromStr for Every {
    type Err = DurationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "none" {
            Ok(Self(None))
        } else {
            parse_duration(s).map(|d| Self(Some(d)))
        }
    }
}

impl DemoArgs {
    /// Refuses options the demo cannot run with.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.events == 0 || self.partitions == 0 || self.replicas == 0 || self.max_in_flight == 0
        {
            bail!("--events, --partitions, --replicas and --max-in-flight must be positive");
        }
        if !(0.0..=1.0).contains(&self.transient_rate)
            || !(0.0..=1.0).contains(&self.permanent_rate)
        {
            bail!("--transient-rate and --permanent-rate must be between 0 and 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_and_durations_parse() {
        assert_eq!(
            "8s:10s".parse::<Window>().unwrap(),
            Window {
                start: Duration::from_secs(8),
                duration: Duration::from_secs(10)
            }
        );
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("soon").is_err());
        assert!("8s".parse::<Window>().is_err());
        assert_eq!("none".parse::<Outage>().unwrap(), Outage(None));
        assert_eq!(
            "15s".parse::<Every>().unwrap(),
            Every(Some(Duration::from_secs(15)))
        );
    }
}
