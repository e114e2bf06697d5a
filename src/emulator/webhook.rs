//! A local webhook receiver: the downstream for `hubguard run` on the emulators and for the
//! demo. It answers `POST /events` (200 by default, or as a behaviour function decides) and
//! records each successful delivery by `Idempotency-Key`; faults (error status, delay,
//! refused connections) make it misbehave as told. `GET /deliveries` lists what arrived:
//! key → number of successful deliveries.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Json;
use axum::routing::{get, post};
use axum::Router;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Faults;

/// Decides the status for a call: (idempotency key, how many calls this key had before) →
/// HTTP status.
pub type Behaviour = Arc<dyn Fn(&str, u32) -> u16 + Send + Sync>;

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

async fn receive(State(d): State<Arc<Deliveries>>, headers: HeaderMap) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("(no key)")
        .to_string();
    if let Some(n) = headers
        .get("x-hubguard-attempt")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok())
    {
        d.attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_default()
            .push(n);
    }
    let before = {
        let mut calls = d.calls.lock().unwrap_or_else(|p| p.into_inner());
        let c = calls.entry(key.clone()).or_default();
        *c += 1;
        *c - 1
    };
    let status = StatusCode::from_u16((d.behaviour)(&key, before)).unwrap_or(StatusCode::OK);
    if status.is_success() {
        d.first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_insert_with(std::time::SystemTime::now);
        *d.by_key
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default() += 1;
    }
    status
}

async fn list(State(d): State<Arc<Deliveries>>) -> Json<BTreeMap<String, u32>> {
    Json(d.by_key.lock().unwrap_or_else(|p| p.into_inner()).clone())
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
        });
        let shutdown = CancellationToken::new();
        let faults = Arc::new(Faults::new(shutdown.clone()));
        let router = Router::new()
            .route("/events", post(receive))
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
        self.deliveries
            .by_key
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The attempt number (`x-hubguard-attempt`) of every call per key, in arrival order.
    pub fn attempts_seen(&self) -> BTreeMap<String, Vec<u32>> {
        self.deliveries
            .attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// When each key was first answered with a 2xx.
    pub fn first_deliveries(&self) -> BTreeMap<String, std::time::SystemTime> {
        self.deliveries
            .first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Calls so far (any answer): idempotency key → count.
    pub fn calls(&self) -> BTreeMap<String, u32> {
        self.deliveries
            .calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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
