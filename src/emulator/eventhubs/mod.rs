//! Event Hubs emulator over AMQP 1.0.
//!
//! It serves the protocol the service speaks, so the Rust SDK and the other official SDKs work
//! against it unmodified with an ordinary emulator connection string
//! (`Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=…;SharedAccessKey=…;UseDevelopmentEmulator=true`):
//! SASL ANONYMOUS, CBS `put-token` with verified SAS tokens, `$management` READ, receivers with
//! selector filters and owner-level (epoch) arbitration, hub- and partition-level senders with
//! single and batched events, as the Rust and Python SDKs use them (each detail is tested
//! against the real SDK in `tests/it/eventhubs_*.rs` and `tests/it/interop.rs`).
//!
//! # What it refuses, as the service does
//!
//! Each rule and where it comes from (where the sources leave room, the stricter reading):
//!
//! - **No frame larger than the peer's `max-frame-size`.** The `open` a client sends bounds
//!   every frame the emulator writes, padding included; a delivery that does not fit in one
//!   frame is split over several `transfer` frames, all but the last with `more = true`.
//!   Source: AMQP 1.0 §2.7.1 (`open`, `max-frame-size`), §2.4 / §2.6.14 (framing and
//!   transferring a message), §2.7.5 (`transfer`, `more`). Enforced in [`wire`].
//! - **Multi-frame deliveries from producers are reassembled**, up to the publication limit.
//!   The emulator announces `max-frame-size` 65,536, so any event above ~64 KB arrives in
//!   several transfers. Source: AMQP 1.0 §2.6.14, §2.7.5.
//! - **A publication (one event, or one batch envelope) is at most 1 MiB (1,048,576 bytes)**,
//!   measured as the AMQP encoding of the delivered message. Every link the emulator receives
//!   on advertises `max-message-size` 1,048,576; a bigger delivery gets a settled `rejected`
//!   outcome with `amqp:link:message-size-exceeded` and the service's description ("The
//!   received message (delivery-id:…, size:… bytes) exceeds the limit (1048576 bytes)
//!   currently allowed on the link."); the link stays attached. Sources: learn.microsoft.com,
//!   "Azure Event Hubs quotas and limits" (*Maximum size of Event Hubs publication*: 1 MB on
//!   Standard, Premium and Dedicated); AMQP 1.0 §2.7.3 (`attach`, `max-message-size`) and
//!   §2.8.15 (link error `message-size-exceeded`); the service's reply as logged by its
//!   clients (Azure/azure-event-hubs-python#106: a settled `rejected` disposition with that
//!   condition). The Rust SDK 0.15 does not check `send_event` against the limit
//!   (Azure/azure-sdk-for-rust#5101), so the emulator must.
//! - **Application properties:** the quotas page documents no separate limit for Event Hubs
//!   (the 64 KB header limit is Service Bus's); they count towards the publication size.
//! - **A throttled namespace answers `com.microsoft:server-busy`**: while the server-busy
//!   fault is on ([`Faults::server_busy_for`], admin `{"kind":"server-busy","seconds":N}`),
//!   new producer and consumer links are detached with it and every delivery on an
//!   attached producer link is rejected with it. Sources: learn.microsoft.com, "Azure Event
//!   Hubs quotas and limits" and "Event Hubs messaging exceptions" (ServerBusy, error 50002);
//!   "AMQP errors in Azure Service Bus" (the `com.microsoft:server-busy` condition).
//!
//! # Modules
//!
//! - [`store`]: hubs, partitions and their (optionally durable) logs.
//! - [`selector`]: start positions from the receivers' selector filters.
//! - `server`: connections, sessions and links.
//! - [`wire`]: the transport shim (full-length performatives, held-back frames, quick ACKs).

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::azure::SasKey;
use crate::emulator::Faults;

mod rest;
pub mod selector;
mod server;
pub mod store;
pub mod wire;

pub use server::MAX_MESSAGE_SIZE;
pub use store::{EventStore, HubSpec};

/// How to run the Event Hubs emulator.
#[derive(Debug, Clone)]
pub struct EventHubsConfig {
    /// Address to listen on; port 0 picks a free port.
    pub listen: SocketAddr,
    /// The hubs to serve.
    pub hubs: Vec<HubSpec>,
    /// Where to keep the partition logs; `None` keeps them in memory.
    pub data_dir: Option<PathBuf>,
    /// The SAS key tokens must be signed with.
    pub key: SasKey,
    /// Accept any non-empty token presented as `jwt` (Entra ID), which the emulator cannot
    /// verify. SAS tokens are verified either way, and only under the type
    /// `servicebus.windows.net:sastoken`, as Azure does (`--accept-any-token`).
    pub accept_any_token: bool,
    /// Where to answer the namespace's REST requests (`GET /{hub}`, each answer dated on
    /// the emulator's clock: how `hubguard check` reads Event Hubs's clock); port 0 picks a
    /// free port, `None` serves no REST.
    pub rest_listen: Option<SocketAddr>,
}

impl Default for EventHubsConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            hubs: vec![HubSpec::new("hub", 4)],
            data_dir: None,
            key: SasKey::new(super::DEFAULT_KEY_NAME, super::DEFAULT_KEY),
            accept_any_token: false,
            rest_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        }
    }
}

/// State shared by every connection of one emulator.
#[derive(Debug)]
struct Shared {
    store: EventStore,
    key: SasKey,
    accept_any_token: bool,
    faults: Arc<Faults>,
    /// The clock its REST answers are dated on.
    clock: Arc<crate::emulator::clock::Clock>,
    /// When it started (the hubs' `CreatedAt`).
    created: std::time::SystemTime,
}

/// A running Event Hubs emulator. Dropping it stops it.
#[derive(Debug)]
pub struct EventHubsEmulator {
    addr: SocketAddr,
    rest_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
    rest_task: Option<JoinHandle<()>>,
}

/// The socket options every official client needs: `TCP_MAXSEG` 16384 on the listener (the
/// Python SDK writes back the MSS it reads, and the loopback default makes that fail).
fn listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    #[cfg(target_os = "linux")]
    let _ = socket.set_mss(16_384);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

impl EventHubsEmulator {
    /// Opens the store and starts listening.
    pub async fn start(config: EventHubsConfig) -> io::Result<Self> {
        Self::start_with_clock(config, Arc::new(crate::emulator::clock::Clock::default())).await
    }

    /// Like [`start`](Self::start), dating its REST answers on `clock`.
    pub async fn start_with_clock(
        config: EventHubsConfig,
        clock: Arc<crate::emulator::clock::Clock>,
    ) -> io::Result<Self> {
        let store = EventStore::open(&config.hubs, config.data_dir.as_deref())?;
        let listener = listener(config.listen)?;
        let addr = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let shared = Arc::new(Shared {
            store,
            key: config.key,
            accept_any_token: config.accept_any_token,
            faults: Arc::new(Faults::new(shutdown.clone())),
            created: clock.now(),
            clock,
        });
        let (rest_addr, rest_task) = match config.rest_listen {
            Some(listen) => {
                let (a, t) = rest::serve(listen, shared.clone(), shutdown.clone()).await?;
                (Some(a), Some(t))
            }
            None => (None, None),
        };
        let task = tokio::spawn(accept_loop(listener, shared.clone(), shutdown.clone()));
        Ok(Self {
            addr,
            rest_addr,
            shared,
            shutdown,
            task: Some(task),
            rest_task,
        })
    }

    /// The address of its REST face, if it serves one ([`EventHubsConfig::rest_listen`]).
    pub fn rest_addr(&self) -> Option<SocketAddr> {
        self.rest_addr
    }

    /// `http://HOST:PORT/`, the REST endpoint to give `hubguard check`
    /// (`eventhubs.rest_endpoint`), if it serves one.
    pub fn rest_endpoint(&self) -> Option<String> {
        self.rest_addr.map(|a| format!("http://{a}/"))
    }

    /// The clock its REST answers are dated on (tests advance it to put Event Hubs's clock
    /// ahead of the host's).
    pub fn clock(&self) -> &Arc<crate::emulator::clock::Clock> {
        &self.shared.clock
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The emulator connection string for its SAS key:
    /// `Endpoint=sb://HOST:PORT;SharedAccessKeyName=…;SharedAccessKey=…;UseDevelopmentEmulator=true`.
    pub fn connection_string(&self) -> String {
        connection_string(self.addr, &self.shared.key)
    }

    /// The fault injection handle.
    pub fn faults(&self) -> &Arc<Faults> {
        &self.shared.faults
    }

    /// The hubs and their events.
    pub fn store(&self) -> &EventStore {
        &self.shared.store
    }

    /// Stops listening and drops every connection.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        if let Some(task) = self.rest_task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for EventHubsEmulator {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The emulator connection string for `addr` and `key`.
pub fn connection_string(addr: SocketAddr, key: &SasKey) -> String {
    // The key is part of the string by design: this is what a user pastes into a client.
    format!(
        "Endpoint=sb://{addr};SharedAccessKeyName={};SharedAccessKey={};UseDevelopmentEmulator=true",
        key.name(),
        key.secret()
    )
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, shutdown: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.cancelled() => return,
        };
        match accepted {
            Ok((stream, _)) => {
                if shared.faults.refusing() {
                    drop(stream);
                    continue;
                }
                tokio::spawn(server::serve_connection(stream, shared.clone()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "eventhubs emulator: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}
