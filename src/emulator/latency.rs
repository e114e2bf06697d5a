//! Latency the emulators add to look like Azure over a network: a distribution per service
//! with a median and a tail (p99), drawn once per HTTP request (blob storage, Service Bus,
//! the webhook receiver) and once per AMQP round trip (Event Hubs: what the client sends —
//! an attach, a CBS `put-token`, a management request, a `flow` granting credit — reaches
//! the service that much later; transfers streamed on credit already granted are not
//! delayed, as prefetch keeps them flowing on Azure).
//!
//! The distribution is log-normal: `ln X ~ N(ln median, σ)` with σ chosen so that the 99th
//! percentile is the given p99 (`σ = ln(p99 / median) / z₀.₉₉`, `z₀.₉₉ ≈ 2.326`). Service
//! latencies are right-skewed with a long tail, which a log-normal has and a normal does
//! not. Draws are capped at 4 × p99 so one draw cannot stall a benchmark.
//!
//! The `azure` preset ([`LatencyProfile::azure`]), median:p99:
//!
//! | service | preset | source |
//! |---|---|---|
//! | blob storage | 8 ms : 40 ms | "Latency in Blob storage" (https://learn.microsoft.com/azure/storage/blobs/storage-blobs-latency): standard block blobs have higher and less consistent latency than premium (SSD) ones; Azure Monitor reports `SuccessServerLatency` and `SuccessE2ELatency` apart. One published server-side figure for Set Blob Metadata averages 6.3 ms; the network adds the rest. |
//! | Service Bus | 15 ms : 80 ms | "Best practices for performance improvements using Service Bus messaging" (https://learn.microsoft.com/azure/service-bus-messaging/service-bus-performance-improvements): the Standard tier suits "developer/test environments or low throughput scenarios", with variable latency; user reports put settle times near 20 ms with a tail near 100 ms. |
//! | Event Hubs | 5 ms : 20 ms | "Scaling with Event Hubs" (https://learn.microsoft.com/azure/event-hubs/event-hubs-scalability): a throughput unit takes 1 MB/s or 1,000 events/s in; a round trip is one AMQP exchange in the region, cheaper than an HTTP request (no per-request authorization: the CBS token covers the link). |
//!
//! [`Latency::parse`] reads `8ms:40ms` (median:p99; `0` for none; `15ms` alone is a fixed
//! latency); [`LatencyProfile::parse`] reads `azure`, `none`, or
//! `blob=8ms:40ms,servicebus=15ms:80ms,eventhubs=5ms:20ms,webhook=50ms:150ms` (services left
//! out add nothing).

use std::fmt;
use std::time::Duration;

use rand::Rng;

/// z of the 99th percentile of the standard normal distribution.
const Z_P99: f64 = 2.326_347_874;

/// A latency distribution: median and 99th percentile (log-normal between them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Latency {
    /// Half the draws are below this.
    pub median: Duration,
    /// 99 % of the draws are below this.
    pub p99: Duration,
}

impl Latency {
    /// No added latency.
    pub const ZERO: Latency = Latency {
        median: Duration::ZERO,
        p99: Duration::ZERO,
    };

    /// A distribution with this median and p99 (a p99 below the median is taken as the
    /// median: a fixed latency).
    pub fn new(median: Duration, p99: Duration) -> Self {
        Self {
            median,
            p99: p99.max(median),
        }
    }

    /// Always `d`.
    pub fn fixed(d: Duration) -> Self {
        Self::new(d, d)
    }

    /// Whether it adds nothing.
    pub fn is_zero(&self) -> bool {
        self.median.is_zero()
    }

    /// One draw.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> Duration {
        if self.median.is_zero() {
            return Duration::ZERO;
        }
        if self.p99 <= self.median {
            return self.median;
        }
        let m = self.median.as_secs_f64();
        let sigma = (self.p99.as_secs_f64() / m).ln() / Z_P99;
        // Box–Muller: a standard normal from two uniforms in (0, 1].
        let u1: f64 = 1.0 - rng.gen::<f64>();
        let u2: f64 = rng.gen::<f64>();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let x = m * (sigma * z).exp();
        Duration::from_secs_f64(x.min(4.0 * self.p99.as_secs_f64()))
    }

    /// Reads `8ms:40ms` (median:p99), `15ms` (fixed), `0` or `none`. Units: `us`, `ms`, `s`.
    pub fn parse(s: &str) -> Result<Self, LatencyError> {
        let s = s.trim();
        if s == "0" || s.eq_ignore_ascii_case("none") {
            return Ok(Self::ZERO);
        }
        let (m, p) = match s.split_once(':') {
            Some((m, p)) => (duration(m)?, duration(p)?),
            None => {
                let d = duration(s)?;
                (d, d)
            }
        };
        if p < m {
            return Err(LatencyError::P99BelowMedian {
                latency: s.to_string(),
                p99: p,
                median: m,
            });
        }
        Ok(Self::new(m, p))
    }
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}ms:{}ms",
            self.median.as_secs_f64() * 1e3,
            self.p99.as_secs_f64() * 1e3
        )
    }
}

/// A latency or latency profile that does not parse (`--latency`); the message quotes the
/// part that does not, and says what is expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LatencyError {
    /// The p99 is below the median.
    #[error("latency '{latency}': the p99 ({p99:?}) is below the median ({median:?})")]
    P99BelowMedian {
        /// The latency as given.
        latency: String,
        /// Its p99.
        p99: Duration,
        /// Its median.
        median: Duration,
    },
    /// A duration without a unit.
    #[error("latency '{0}': give a unit (us, ms or s), e.g. 8ms:40ms")]
    NoUnit(String),
    /// A duration that is not a number.
    #[error("latency '{0}': not a number")]
    NotANumber(String),
    /// A duration over 60 s (or negative).
    #[error("latency '{0}': must be between 0 and 60 s")]
    OutOfRange(String),
    /// A part of a profile that is neither a preset nor `service=…`.
    #[error("latency '{0}': expected azure, none or service=median:p99 (e.g. blob=8ms:40ms)")]
    NotAService(String),
    /// A service the emulators do not have.
    #[error("latency: unknown service '{0}' (blob, servicebus, eventhubs, webhook)")]
    UnknownService(String),
}

fn duration(s: &str) -> Result<Duration, LatencyError> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if s == "0" {
        (s, 0.0)
    } else {
        return Err(LatencyError::NoUnit(s.to_string()));
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| LatencyError::NotANumber(s.to_string()))?;
    if !(0.0..=60.0).contains(&(v * scale)) {
        return Err(LatencyError::OutOfRange(s.to_string()));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// Latency per emulated service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencyProfile {
    /// Per blob storage request.
    pub blob: Latency,
    /// Per Service Bus request.
    pub servicebus: Latency,
    /// Per Event Hubs AMQP round trip.
    pub eventhubs: Latency,
    /// Per webhook request (the downstream's own latency).
    pub webhook: Latency,
}

impl LatencyProfile {
    /// The `azure` preset (see the module docs for the figures and their sources). The
    /// webhook is left alone: it is the user's downstream, not Azure.
    pub fn azure() -> Self {
        let ms = Duration::from_millis;
        Self {
            blob: Latency::new(ms(8), ms(40)),
            servicebus: Latency::new(ms(15), ms(80)),
            eventhubs: Latency::new(ms(5), ms(20)),
            webhook: Latency::ZERO,
        }
    }

    /// Whether it adds nothing anywhere.
    pub fn is_zero(&self) -> bool {
        self.blob.is_zero()
            && self.servicebus.is_zero()
            && self.eventhubs.is_zero()
            && self.webhook.is_zero()
    }

    /// The latency of `service` (`blob`, `servicebus`, `eventhubs`, `webhook`).
    pub fn of(&self, service: &str) -> Latency {
        match service {
            "blob" => self.blob,
            "servicebus" => self.servicebus,
            "eventhubs" => self.eventhubs,
            "webhook" => self.webhook,
            _ => Latency::ZERO,
        }
    }

    /// Reads `azure`, `none`, or `service=median:p99,…` (services: blob, servicebus,
    /// eventhubs, webhook; `azure,webhook=50ms:150ms` starts from the preset).
    pub fn parse(s: &str) -> Result<Self, LatencyError> {
        let mut p = Self::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part.eq_ignore_ascii_case("azure") {
                p = Self::azure();
                continue;
            }
            if part.eq_ignore_ascii_case("none") {
                p = Self::default();
                continue;
            }
            let (svc, lat) = part
                .split_once('=')
                .ok_or_else(|| LatencyError::NotAService(part.to_string()))?;
            let lat = Latency::parse(lat)?;
            match svc.trim() {
                "blob" => p.blob = lat,
                "servicebus" => p.servicebus = lat,
                "eventhubs" => p.eventhubs = lat,
                "webhook" => p.webhook = lat,
                other => return Err(LatencyError::UnknownService(other.to_string())),
            }
        }
        Ok(p)
    }
}

impl std::str::FromStr for LatencyProfile {
    type Err = LatencyError;
    fn from_str(s: &str) -> Result<Self, LatencyError> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn quantile(v: &mut [Duration], q: f64) -> Duration {
        v.sort();
        v[((v.len() as f64 - 1.0) * q).round() as usize]
    }

    #[test]
    fn draws_have_the_median_and_the_p99_asked_for() {
        let ms = Duration::from_millis;
        let l = Latency::new(ms(8), ms(40));
        let mut rng = StdRng::seed_from_u64(7);
        let mut v: Vec<Duration> = (0..50_000).map(|_| l.sample(&mut rng)).collect();
        let med = quantile(&mut v, 0.5).as_secs_f64() * 1e3;
        let p99 = quantile(&mut v, 0.99).as_secs_f64() * 1e3;
        assert!((med - 8.0).abs() < 0.4, "median {med} ms");
        assert!((p99 - 40.0).abs() < 3.0, "p99 {p99} ms");
        assert!(v.iter().all(|d| *d <= ms(160)), "capped at 4 × p99");
        assert!(v.iter().all(|d| !d.is_zero()));
    }

    #[test]
    fn the_same_seed_draws_the_same_sequence() {
        let l = Latency::new(Duration::from_millis(15), Duration::from_millis(80));
        let a: Vec<_> = {
            let mut r = StdRng::seed_from_u64(1);
            (0..100).map(|_| l.sample(&mut r)).collect()
        };
        let b: Vec<_> = {
            let mut r = StdRng::seed_from_u64(1);
            (0..100).map(|_| l.sample(&mut r)).collect()
        };
        assert_eq!(a, b);
    }

    #[test]
    fn fixed_and_zero_draw_exactly() {
        let mut r = StdRng::seed_from_u64(3);
        let d = Duration::from_millis(15);
        assert_eq!(Latency::fixed(d).sample(&mut r), d);
        assert_eq!(Latency::ZERO.sample(&mut r), Duration::ZERO);
    }

    #[test]
    fn parses_the_preset_and_per_service_figures() {
        let ms = Duration::from_millis;
        assert_eq!(
            LatencyProfile::parse("azure").unwrap(),
            LatencyProfile::azure()
        );
        let p =
            LatencyProfile::parse("blob=8ms:40ms,servicebus=15ms:80ms,eventhubs=5ms:20ms").unwrap();
        assert_eq!(p.blob, Latency::new(ms(8), ms(40)));
        assert_eq!(p.servicebus, Latency::new(ms(15), ms(80)));
        assert_eq!(p.eventhubs, Latency::new(ms(5), ms(20)));
        assert!(p.webhook.is_zero());
        let p = LatencyProfile::parse("azure,webhook=50ms").unwrap();
        assert_eq!(p.webhook, Latency::fixed(ms(50)));
        assert_eq!(p.blob, LatencyProfile::azure().blob);
        assert!(LatencyProfile::parse("none").unwrap().is_zero());
        assert_eq!(
            Latency::parse("500us:2ms").unwrap().median,
            Duration::from_micros(500)
        );
        for bad in ["blob=8:40", "disk=1ms", "blob=40ms:8ms", "blob", "blob=99s"] {
            assert!(LatencyProfile::parse(bad).is_err(), "{bad}");
        }
    }
}
