//! A webhook receiver with a capacity: it takes at most `cap` requests in any one second
//! (sliding) and answers the rest `429 Too Many Requests` — with `Retry-After` when told to —
//! as small receivers behind a rate limiter do. It logs every request's arrival and answer
//! (its own log, independent of hubguard's counters), so a test or the bench can count
//! requests per second and deliveries per key.

use crate::sync::LockExt;
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::faults::Faults;

/// One request as the receiver logged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Logged {
    /// When it arrived, since the receiver started.
    pub at: Duration,
    /// What it answered.
    pub status: u16,
}

struct Inner {
    started: Instant,
    cap: Mutex<Option<u32>>,
    retry_after_s: Option<u32>,
    accepted: Mutex<VecDeque<Instant>>,
    log: Mutex<Vec<Logged>>,
    delivered: Mutex<BTreeMap<String, u32>>,
}

/// A running capped receiver. Dropping it stops it.
pub struct CappedReceiver {
    addr: SocketAddr,
    inner: Arc<Inner>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CappedReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CappedReceiver")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

async fn receive(State(d): State<Arc<Inner>>, headers: HeaderMap) -> axum::response::Response {
    let now = Instant::now();
    let cap = *d.cap.locked();
    let ok = {
        let mut accepted = d.accepted.locked();
        while accepted
            .front()
            .is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(1))
        {
            accepted.pop_front();
        }
        let ok = cap.is_none_or(|c| (accepted.len() as u32) < c);
        if ok {
            accepted.push_back(now);
        }
        ok
    };
    let status = if ok { 200 } else { 429 };
    d.log.locked().push(Logged {
        at: now.duration_since(d.started),
        status,
    });
    if ok {
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("(no key)")
            .to_string();
        *d.delivered.locked().entry(key).or_default() += 1;
        return StatusCode::OK.into_response();
    }
    match d.retry_after_s {
        Some(s) => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", s.to_string())],
            "too many requests",
        )
            .into_response(),
        None => (StatusCode::TOO_MANY_REQUESTS, "too many requests").into_response(),
    }
}

impl CappedReceiver {
    /// Starts on `listen`, taking at most `cap` requests a second (`None`: all), answering
    /// the rest 429 with `Retry-After: retry_after_s` when given.
    pub async fn start(
        listen: SocketAddr,
        cap: Option<u32>,
        retry_after_s: Option<u32>,
    ) -> io::Result<Self> {
        let inner = Arc::new(Inner {
            started: Instant::now(),
            cap: Mutex::new(cap),
            retry_after_s,
            accepted: Mutex::default(),
            log: Mutex::default(),
            delivered: Mutex::default(),
        });
        let shutdown = CancellationToken::new();
        let faults = Arc::new(Faults::new(shutdown.clone()));
        let router = Router::new()
            .route("/events", post(receive))
            .with_state(inner.clone());
        let (addr, task) = super::http::serve(listen, router, faults, shutdown.clone()).await?;
        Ok(Self {
            addr,
            inner,
            shutdown,
            task: Some(task),
        })
    }

    /// The URL events are posted to.
    pub fn url(&self) -> String {
        format!("http://{}/events", self.addr)
    }

    /// Changes the capacity (`None`: unlimited).
    pub fn set_cap(&self, cap: Option<u32>) {
        *self.inner.cap.locked() = cap;
    }

    /// Every request so far, in arrival order.
    pub fn log(&self) -> Vec<Logged> {
        self.inner.log.locked().clone()
    }

    /// Requests answered 429 so far.
    pub fn throttled(&self) -> usize {
        self.log().iter().filter(|l| l.status == 429).count()
    }

    /// Deliveries (200s) per idempotency key.
    pub fn delivered(&self) -> BTreeMap<String, u32> {
        self.inner.delivered.locked().clone()
    }

    /// Requests per whole second since the start (index = second).
    pub fn per_second(&self) -> Vec<u32> {
        per_second(&self.log())
    }

    /// Stops it.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for CappedReceiver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Requests per whole second of `log` (index = second since the receiver started).
pub fn per_second(log: &[Logged]) -> Vec<u32> {
    let mut out = Vec::new();
    for l in log {
        let s = l.at.as_secs() as usize;
        if out.len() <= s {
            out.resize(s + 1, 0);
        }
        out[s] += 1;
    }
    out
}

/// The most requests in any one-second window of `log` that starts at a request
/// (sliding), from `from` on.
pub fn max_in_any_second(log: &[Logged], from: Duration) -> usize {
    let times: Vec<Duration> = log.iter().map(|l| l.at).filter(|t| *t >= from).collect();
    let mut best = 0;
    let mut j = 0;
    for i in 0..times.len() {
        while j < times.len() && times[j] < times[i] + Duration::from_secs(1) {
            j += 1;
        }
        best = best.max(j - i);
    }
    best
}
