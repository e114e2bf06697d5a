//! A local webhook receiver: the downstream for `hubguard run` on the emulators and for the
//! demo. It answers `POST /events` (200 by default, or as a behaviour function decides) and
//! records each successful delivery by `Idempotency-Key`; faults (error status, delay,
//! refused connections) make it misbehave as told. `GET /deliveries` lists what arrived:
//! key → number of successful deliveries.
//!
//! It answers the CloudEvents abuse-protection handshake (`OPTIONS /events` with
//! `WebHook-Request-Origin`) with `WebHook-Allowed-Origin` — and `WebHook-Allowed-Rate` when
//! told a rate — or refuses it (403, no allowed origin) when told to
//! ([`WebhookReceiver::set_handshake`]). Tests can also have it keep every request
//! ([`WebhookReceiver::record_requests`]).

use crate::sync::LockExt;
use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::response::Json;
use axum::routing::{get, post};
use axum::Router;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Faults;

/// Decides the status for a call: (idempotency key, how many calls this key had before) →
/// HTTP status.
pub type Behaviour = Arc<dyn Fn(&str, u32) -> u16 + Send + Sync>;

/// A failure mix for benchmarks: by a hash of each event's idempotency key (and a seed), a
/// `transient` share of events fails its first `times` deliveries with 503 and then
/// succeeds, a `refused` share is refused for good with 400, the rest succeed. Which events
/// fail does not depend on timing, so runs compare. The receiver's latency is the
/// `webhook` entry of the latency profile ([`Faults::set_latency`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FailureMix {
    /// Share of events failing transiently (0–1).
    pub transient: f64,
    /// How many deliveries of each of those fail before one succeeds.
    pub times: u32,
    /// Share of events refused for good (0–1).
    pub refused: f64,
    /// Seed of the choice.
    pub seed: u64,
}

impl Default for FailureMix {
    fn default() -> Self {
        Self {
            transient: 0.0,
            times: 1,
            refused: 0.0,
            seed: 42,
        }
    }
}

impl FailureMix {
    /// What the receiver answers.
    pub fn behaviour(self) -> Behaviour {
        Arc::new(move |key: &str, before: u32| self.status(key, before))
    }

    /// The status for the call to `key` that had `before` calls before it.
    pub fn status(&self, key: &str, before: u32) -> u16 {
        let share = |salt: u64| (key_hash(self.seed, key, salt) >> 11) as f64 / (1u64 << 53) as f64;
        if share(1) < self.refused {
            400
        } else if share(2) < self.transient && before < self.times {
            503
        } else {
            200
        }
    }

    /// Reads `transient=0.1:2,refused=0.01[,seed=7]` (share[:times]).
    pub fn parse(s: &str) -> Result<Self, FailureMixError> {
        let mut m = Self::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| FailureMixError::NotAPair(part.to_string()))?;
            let share = |v: &str| -> Result<f64, FailureMixError> {
                let x: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| FailureMixError::NotANumber(part.to_string()))?;
                if (0.0..=1.0).contains(&x) {
                    Ok(x)
                } else {
                    Err(FailureMixError::ShareOutOfRange(part.to_string()))
                }
            };
            match k.trim() {
                "transient" => {
                    let (sh, times) = v.split_once(':').unwrap_or((v, "1"));
                    m.transient = share(sh)?;
                    m.times = times
                        .trim()
                        .parse()
                        .map_err(|_| FailureMixError::Times(part.to_string()))?;
                }
                "refused" => m.refused = share(v)?,
                "seed" => {
                    m.seed = v
                        .trim()
                        .parse()
                        .map_err(|_| FailureMixError::Seed(part.to_string()))?
                }
                other => return Err(FailureMixError::Unknown(other.to_string())),
            }
        }
        Ok(m)
    }
}

impl std::str::FromStr for FailureMix {
    type Err = FailureMixError;
    fn from_str(s: &str) -> Result<Self, FailureMixError> {
        Self::parse(s)
    }
}

/// A failure mix that does not parse (`--webhook-failures`); the message quotes the part that
/// does not, and says what is expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FailureMixError {
    /// A part that is not `key=value`.
    #[error("failure mix '{0}': expected transient=SHARE[:TIMES], refused=SHARE or seed=N")]
    NotAPair(String),
    /// A share that is not a number.
    #[error("failure mix '{0}': not a number")]
    NotANumber(String),
    /// A share outside 0 to 1.
    #[error("failure mix '{0}': a share is between 0 and 1")]
    ShareOutOfRange(String),
    /// A number of times that is not a whole number.
    #[error("failure mix '{0}': times is a whole number")]
    Times(String),
    /// A seed that is not a whole number.
    #[error("failure mix '{0}': seed is a whole number")]
    Seed(String),
    /// A key other than transient, refused and seed.
    #[error("failure mix: unknown '{0}' (transient, refused, seed)")]
    Unknown(String),
}

/// FNV-1a over the key, then a splitmix finaliser: deterministic per (seed, key, salt).
fn key_hash(seed: u64, key: &str, salt: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in key.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

struct Deliveries {
    /// Successful (2xx) deliveries per key.
    by_key: Mutex<BTreeMap<String, u32>>,
    /// Calls per key (any answer).
    calls: Mutex<BTreeMap<String, u32>>,
    /// When each key was first answered with a 2xx.
    first: Mutex<BTreeMap<String, std::time::SystemTime>>,
    /// The `x-hubguard-attempt` of every call per key, in arrival order.
    attempts: Mutex<BTreeMap<String, Vec<u32>>>,
    behaviour: Behaviour,
    /// How the handshake is answered.
    handshake: Mutex<HandshakeAnswer>,
    /// The `WebHook-Request-Origin` of every handshake, in arrival order.
    handshakes: Mutex<Vec<String>>,
    /// Every request, when recording.
    requests: Mutex<Option<Vec<Recorded>>>,
}

/// How the receiver answers the abuse-protection handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeAnswer {
    /// 200 with `WebHook-Allowed-Origin` (the requested origin) and, with a rate,
    /// `WebHook-Allowed-Rate` (requests per minute).
    Allow {
        /// The rate granted (`None`: `*`).
        rate: Option<u32>,
    },
    /// 403 without `WebHook-Allowed-Origin`.
    Refuse,
}

/// A request as it arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// Header names (lower case) and values, in order.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Recorded {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl std::fmt::Debug for Deliveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deliveries")
    }
}

/// A running webhook receiver. Dropping it stops it.
#[derive(Debug)]
pub struct WebhookReceiver {
    addr: SocketAddr,
    deliveries: Arc<Deliveries>,
    faults: Arc<Faults>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

async fn handshake(
    State(d): State<Arc<Deliveries>>,
    headers: HeaderMap,
) -> axum::response::Response {
    let origin = headers
        .get("webhook-request-origin")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).to_string());
    let Some(origin) = origin else {
        // Not a handshake: what an endpoint without CORS or handshake support answers.
        return (StatusCode::OK, [("allow", "POST, OPTIONS")]).into_response();
    };
    d.handshakes.locked().push(origin.clone());
    let answer = *d.handshake.locked();
    match answer {
        HandshakeAnswer::Allow { rate } => {
            let mut h = HeaderMap::new();
            h.insert(
                "allow",
                axum::http::HeaderValue::from_static("POST, OPTIONS"),
            );
            if let Ok(v) = axum::http::HeaderValue::from_str(&origin) {
                h.insert("webhook-allowed-origin", v);
            }
            let rate = rate.map_or("*".to_string(), |r| r.to_string());
            if let Ok(v) = axum::http::HeaderValue::from_str(&rate) {
                h.insert("webhook-allowed-rate", v);
            }
            (StatusCode::OK, h).into_response()
        }
        HandshakeAnswer::Refuse => (
            StatusCode::FORBIDDEN,
            "this endpoint does not accept events from this origin",
        )
            .into_response(),
    }
}

async fn receive(
    State(d): State<Arc<Deliveries>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    if let Some(r) = d.requests.locked().as_mut() {
        r.push(Recorded {
            headers: headers
                .iter()
                .map(|(n, v)| {
                    (
                        n.as_str().to_string(),
                        String::from_utf8_lossy(v.as_bytes()).to_string(),
                    )
                })
                .collect(),
            body: body.to_vec(),
        });
    }
    let batch = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/cloudevents-batch+json"));
    if batch {
        return receive_batch(&d, &body).into_response();
    }
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("(no key)")
        .to_string();
    let attempt = headers
        .get("x-hubguard-attempt")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok());
    answer(&d, key, attempt).into_response()
}

/// What the receiver reads of a batch's element: its id, and hubguard's key and attempt (the
/// rest, the data above all, is skipped, not copied).
#[derive(serde::Deserialize)]
struct BatchElement {
    #[serde(default)]
    id: serde_json::Value,
    #[serde(default)]
    hubguardkey: Option<serde_json::Value>,
    #[serde(default)]
    hubguardattempt: Option<serde_json::Value>,
}

/// A CloudEvents JSON batch (hubguard's `handler.batch_max`): each event answered as a
/// single delivery would be, the failures listed by id in hubguard's batch answer.
fn receive_batch(d: &Deliveries, body: &[u8]) -> (StatusCode, String) {
    let Ok(elements) = serde_json::from_slice::<Vec<BatchElement>>(body) else {
        return (
            StatusCode::BAD_REQUEST,
            "not a CloudEvents JSON batch".into(),
        );
    };
    let mut failures = Vec::new();
    for e in &elements {
        let key = e
            .hubguardkey
            .as_ref()
            .and_then(|k| k.as_str())
            .or_else(|| e.id.as_str())
            .unwrap_or("(no key)")
            .to_string();
        let attempt = e
            .hubguardattempt
            .as_ref()
            .and_then(|a| a.as_u64())
            .map(|n| n as u32);
        let status = answer(d, key, attempt);
        if !status.is_success() {
            let transient = status.is_server_error()
                || status == StatusCode::TOO_MANY_REQUESTS
                || status == StatusCode::REQUEST_TIMEOUT;
            failures.push(serde_json::json!({
                "id": e.id,
                "kind": if transient { "transient" } else { "permanent" },
                "error": format!("HTTP {} for this event", status.as_u16()),
            }));
        }
    }
    (
        StatusCode::OK,
        serde_json::json!({ "failures": failures }).to_string(),
    )
}

/// The answer to one event's delivery (alone or in a batch), counted.
fn answer(d: &Deliveries, key: String, attempt: Option<u32>) -> StatusCode {
    if let Some(n) = attempt {
        d.attempts.locked().entry(key.clone()).or_default().push(n);
    }
    let before = {
        let mut calls = d.calls.locked();
        let c = calls.entry(key.clone()).or_default();
        *c += 1;
        *c - 1
    };
    let status = StatusCode::from_u16((d.behaviour)(&key, before)).unwrap_or(StatusCode::OK);
    if status.is_success() {
        d.first
            .locked()
            .entry(key.clone())
            .or_insert_with(std::time::SystemTime::now);
        *d.by_key.locked().entry(key).or_default() += 1;
    }
    status
}

async fn list(State(d): State<Arc<Deliveries>>) -> Json<BTreeMap<String, u32>> {
    Json(d.by_key.locked().clone())
}

impl WebhookReceiver {
    /// Starts listening on `listen`; every call succeeds (unless a fault says otherwise).
    pub async fn start(listen: SocketAddr) -> io::Result<Self> {
        Self::start_with(listen, Arc::new(|_, _| 200)).await
    }

    /// Starts listening on `listen`, answering as `behaviour` decides.
    pub async fn start_with(listen: SocketAddr, behaviour: Behaviour) -> io::Result<Self> {
        let deliveries = Arc::new(Deliveries {
            by_key: Mutex::default(),
            calls: Mutex::default(),
            first: Mutex::default(),
            attempts: Mutex::default(),
            behaviour,
            handshake: Mutex::new(HandshakeAnswer::Allow { rate: None }),
            handshakes: Mutex::default(),
            requests: Mutex::default(),
        });
        let shutdown = CancellationToken::new();
        let faults = Arc::new(Faults::new(shutdown.clone()));
        let router = Router::new()
            .route("/events", post(receive).options(handshake))
            .route("/deliveries", get(list))
            .with_state(deliveries.clone());
        let (addr, task) =
            super::http::serve(listen, router, faults.clone(), shutdown.clone()).await?;
        Ok(Self {
            addr,
            deliveries,
            faults,
            shutdown,
            task: Some(task),
        })
    }

    /// The URL events are posted to.
    pub fn url(&self) -> String {
        format!("http://{}/events", self.addr)
    }

    /// The fault handle (an outage is `error_status_for(503, …)`).
    pub fn faults(&self) -> &Arc<Faults> {
        &self.faults
    }

    /// Deliveries so far: idempotency key → count.
    pub fn deliveries(&self) -> BTreeMap<String, u32> {
        self.deliveries.by_key.locked().clone()
    }

    /// The attempt number (`x-hubguard-attempt`) of every call per key, in arrival order.
    pub fn attempts_seen(&self) -> BTreeMap<String, Vec<u32>> {
        self.deliveries.attempts.locked().clone()
    }

    /// When each key was first answered with a 2xx.
    pub fn first_deliveries(&self) -> BTreeMap<String, std::time::SystemTime> {
        self.deliveries.first.locked().clone()
    }

    /// Calls so far (any answer): idempotency key → count.
    pub fn calls(&self) -> BTreeMap<String, u32> {
        self.deliveries.calls.locked().clone()
    }

    /// Answers the abuse-protection handshake as `answer` says from now on.
    pub fn set_handshake(&self, answer: HandshakeAnswer) {
        *self.deliveries.handshake.locked() = answer;
    }

    /// The `WebHook-Request-Origin` of every handshake so far.
    pub fn handshakes(&self) -> Vec<String> {
        self.deliveries.handshakes.locked().clone()
    }

    /// Keeps every `POST /events` request from now on (headers and body), for tests.
    pub fn record_requests(&self) {
        let mut r = self.deliveries.requests.locked();
        if r.is_none() {
            *r = Some(Vec::new());
        }
    }

    /// The requests kept since [`record_requests`](Self::record_requests).
    pub fn requests(&self) -> Vec<Recorded> {
        self.deliveries
            .requests
            .locked()
            .clone()
            .unwrap_or_default()
    }

    /// Stops it.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_fails_its_shares_the_times_asked_and_no_more() {
        let mix = FailureMix::parse("transient=0.1:2,refused=0.02,seed=7").unwrap();
        assert_eq!(mix.times, 2);
        let keys: Vec<String> = (0..20_000).map(|i| format!("k{i}")).collect();
        let refused = keys.iter().filter(|k| mix.status(k, 0) == 400).count();
        let transient = keys.iter().filter(|k| mix.status(k, 0) == 503).count();
        assert!((300..500).contains(&refused), "{refused}");
        // 10 % of the 98 % not refused.
        assert!((1_760..2_160).contains(&transient), "{transient}");
        for k in &keys {
            match mix.status(k, 0) {
                503 => {
                    assert_eq!(mix.status(k, 1), 503);
                    assert_eq!(mix.status(k, 2), 200, "succeeds after `times` failures");
                }
                400 => assert_eq!(mix.status(k, 5), 400, "refused for good"),
                s => assert_eq!(s, 200),
            }
        }
        assert!(FailureMix::parse("transient=2").is_err());
        assert!(FailureMix::parse("flaky=0.1").is_err());
        assert_eq!(FailureMix::parse("").unwrap(), FailureMix::default());
    }

    #[tokio::test]
    async fn the_receiver_answers_with_the_mix_after_its_latency() {
        let mix = FailureMix {
            transient: 1.0,
            times: 1,
            ..Default::default()
        };
        let r = WebhookReceiver::start_with(SocketAddr::from(([127, 0, 0, 1], 0)), mix.behaviour())
            .await
            .unwrap();
        r.faults().set_latency(
            crate::emulator::latency::Latency::fixed(std::time::Duration::from_millis(30)),
            1,
        );
        let client = reqwest::Client::new();
        let post = || {
            client
                .post(r.url())
                .header("idempotency-key", "a")
                .body("{}")
                .send()
        };
        let t = std::time::Instant::now();
        assert_eq!(post().await.unwrap().status().as_u16(), 503);
        assert!(t.elapsed() >= std::time::Duration::from_millis(30));
        assert_eq!(post().await.unwrap().status().as_u16(), 200);
        assert_eq!(r.deliveries().get("a"), Some(&1));
        r.shutdown().await;
    }
}
