//! In-process emulators that speak the real wire protocols, so the real Azure SDK crates are
//! exercised in every test and in the demo, with no Docker and no Azure.
//!
//! - [`eventhubs`]: Event Hubs over AMQP 1.0 (CBS, `$management`, partitioned receive with
//!   selector filters and owner-level arbitration, partitioned and batched send).
//! - [`servicebus`]: Service Bus over its REST API (scheduled messages, duplicate detection,
//!   peek-lock, delivery counts, dead-lettering).
//! - [`blob`]: Blob storage over its REST API (the subset checkpoints, ownership and the
//!   ledger use: conditional writes, metadata, listing, ranged reads).
//! - [`faults`]: fault injection (refuse, delay, drop connections, error status).
//! - [`latency`]: Azure-like latency per request / round trip (`--latency azure`).
//! - [`clock`]: the emulators' clock, which tests advance instead of sleeping.
//! - [`http`]: the serve loop and fault plumbing the REST emulators share.
//! - [`webhook`]: a local webhook receiver, the downstream that misbehaves as told.
//! - [`producer`]: the upstream: sends events through the SDK's producer, batched, round the
//!   partitions, optionally spread over time (the demo and the bench use it).
//! - [`sas`]: checking the SAS tokens clients present (the key, the expiry, the audience),
//!   and a SAS `TokenCredential` for raw protocol tests.
//! - [`admin`]: the HTTP admin endpoint (faults, counters) of `hubguard emulator`.
//!
//! [`Emulators`] starts any subset of the three together, as `hubguard emulator` and the demo do.

pub mod admin;
pub mod blob;
pub mod capped;
pub mod clock;
pub mod eventhubs;
pub mod faults;
pub mod http;
pub mod latency;
pub mod producer;
pub mod sas;
pub mod servicebus;
pub mod webhook;

pub use faults::Faults;

/// The SAS key name the emulators accept by default (a well-known development value, like
/// Azurite's `devstoreaccount1`; never use it outside a local emulator).
pub const DEFAULT_KEY_NAME: &str = "RootManageSharedAccessKey";
/// The SAS key the emulators accept by default (well known; development only).
pub const DEFAULT_KEY: &str = "SAS_KEY_VALUE";

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use crate::azure::SasKey;

/// Which emulators to run and where.
#[derive(Debug, Clone)]
pub struct EmulatorsConfig {
    /// Address every service listens on.
    pub host: IpAddr,
    /// Event Hubs (AMQP) port, or `None` not to run it.
    pub eventhubs_port: Option<u16>,
    /// Event Hubs's REST port (its `Date` is Event Hubs's clock for `hubguard check`);
    /// served with Event Hubs.
    pub eventhubs_rest_port: u16,
    /// Service Bus (HTTP) port, or `None`.
    pub servicebus_port: Option<u16>,
    /// Blob (HTTP) port, or `None`.
    pub blob_port: Option<u16>,
    /// Webhook receiver port, or `None`.
    pub webhook_port: Option<u16>,
    /// The hubs.
    pub hubs: Vec<eventhubs::HubSpec>,
    /// The queues.
    pub queues: Vec<servicebus::QueueSpec>,
    /// The containers created at start.
    pub containers: Vec<String>,
    /// Durable state directory (each service in a subdirectory).
    pub data_dir: Option<PathBuf>,
    /// The SAS key for Event Hubs and Service Bus.
    pub key: SasKey,
    /// Accept any non-empty Entra ID token: Event Hubs `jwt` tokens, and
    /// `Authorization: Bearer` on Service Bus and blob storage (refused with 401 otherwise).
    pub accept_any_token: bool,
    /// Latency per request / round trip of each service (none by default).
    pub latency: latency::LatencyProfile,
    /// How the webhook receiver fails (every call succeeds by default).
    pub webhook_failures: webhook::FailureMix,
}

impl Default for EmulatorsConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::from([127, 0, 0, 1]),
            eventhubs_port: Some(0),
            eventhubs_rest_port: 0,
            servicebus_port: Some(0),
            blob_port: Some(0),
            webhook_port: None,
            hubs: vec![eventhubs::HubSpec::new("hub", 4)],
            queues: vec![servicebus::QueueSpec::new("retries")],
            containers: vec![blob::DEFAULT_CONTAINER.into()],
            data_dir: None,
            key: SasKey::new(DEFAULT_KEY_NAME, DEFAULT_KEY),
            accept_any_token: false,
            latency: latency::LatencyProfile::default(),
            webhook_failures: webhook::FailureMix::default(),
        }
    }
}

/// Running emulators.
#[derive(Debug)]
pub struct Emulators {
    /// Event Hubs, if running.
    pub eventhubs: Option<eventhubs::EventHubsEmulator>,
    /// Service Bus, if running.
    pub servicebus: Option<servicebus::ServiceBusEmulator>,
    /// Blob storage, if running.
    pub blob: Option<blob::BlobEmulator>,
    /// The webhook receiver, if running.
    pub webhook: Option<webhook::WebhookReceiver>,
}

impl Emulators {
    /// Starts the configured services.
    pub async fn start(config: EmulatorsConfig) -> std::io::Result<Self> {
        let at = |port: u16| SocketAddr::new(config.host, port);
        let named = |what: &'static str| {
            move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{what}: {e}"))
        };
        let eventhubs = match config.eventhubs_port {
            Some(p) => Some(
                eventhubs::EventHubsEmulator::start(eventhubs::EventHubsConfig {
                    listen: at(p),
                    hubs: config.hubs.clone(),
                    data_dir: config.data_dir.clone(),
                    key: config.key.clone(),
                    accept_any_token: config.accept_any_token,
                    rest_listen: Some(at(config.eventhubs_rest_port)),
                })
                .await
                .map_err(named("event hubs emulator"))?,
            ),
            None => None,
        };
        let servicebus = match config.servicebus_port {
            Some(p) => Some(
                servicebus::ServiceBusEmulator::start(servicebus::ServiceBusConfig {
                    listen: at(p),
                    queues: config.queues.clone(),
                    data_dir: config.data_dir.clone(),
                    key: config.key.clone(),
                    accept_any_token: config.accept_any_token,
                    ..Default::default()
                })
                .await
                .map_err(named("service bus emulator"))?,
            ),
            None => None,
        };
        let blob = match config.blob_port {
            Some(p) => Some(
                blob::BlobEmulator::start(blob::BlobConfig {
                    listen: at(p),
                    containers: config.containers.clone(),
                    data_dir: config.data_dir.clone(),
                    accept_any_token: config.accept_any_token,
                    ..Default::default()
                })
                .await
                .map_err(named("blob emulator"))?,
            ),
            None => None,
        };
        let webhook = match config.webhook_port {
            Some(p) => Some(
                webhook::WebhookReceiver::start_with(at(p), config.webhook_failures.behaviour())
                    .await
                    .map_err(named("webhook receiver"))?,
            ),
            None => None,
        };
        let emulators = Self {
            eventhubs,
            servicebus,
            blob,
            webhook,
        };
        emulators.set_latency(&config.latency);
        Ok(emulators)
    }

    /// Gives each running service its latency from `profile` (each its own seeded draws).
    pub fn set_latency(&self, profile: &latency::LatencyProfile) {
        for (seed, svc) in ["eventhubs", "servicebus", "blob", "webhook"]
            .into_iter()
            .enumerate()
        {
            for f in self.faults_for(svc) {
                f.set_latency(profile.of(svc), seed as u64 + 1);
            }
        }
    }

    /// One line per running service: `eventhubs: <connection string>` (and
    /// `eventhubs-rest: <url>`, its REST endpoint for `eventhubs.rest_endpoint`),
    /// `servicebus: <connection string>`, `blob: <account URL>`.
    pub fn lines(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(e) = &self.eventhubs {
            v.push(format!("eventhubs: {}", e.connection_string()));
            if let Some(rest) = e.rest_endpoint() {
                v.push(format!("eventhubs-rest: {rest}"));
            }
        }
        if let Some(s) = &self.servicebus {
            v.push(format!("servicebus: {}", s.connection_string()));
        }
        if let Some(b) = &self.blob {
            v.push(format!("blob: {}", b.account_url()));
        }
        if let Some(w) = &self.webhook {
            v.push(format!("webhook: {}", w.url()));
        }
        v
    }

    /// The fault handles of `service` (`eventhubs`, `servicebus`, `blob` or `all`).
    pub fn faults_for(&self, service: &str) -> Vec<&Faults> {
        let mut v: Vec<&Faults> = Vec::new();
        let all = service == "all";
        if all || service == "eventhubs" {
            v.extend(self.eventhubs.as_ref().map(|e| e.faults().as_ref()));
        }
        if all || service == "servicebus" {
            v.extend(self.servicebus.as_ref().map(|e| e.faults().as_ref()));
        }
        if all || service == "blob" {
            v.extend(self.blob.as_ref().map(|e| e.faults().as_ref()));
        }
        if all || service == "webhook" {
            v.extend(self.webhook.as_ref().map(|e| e.faults().as_ref()));
        }
        v
    }

    /// What the emulators hold, as JSON.
    pub fn status(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        if let Some(e) = &self.eventhubs {
            let hubs: Vec<serde_json::Value> = e
                .store()
                .hubs()
                .map(|h| serde_json::json!({ "name": h.name, "partition_events": h.partitions.iter().map(|p| p.len()).collect::<Vec<_>>() }))
                .collect();
            out.insert(
                "eventhubs".into(),
                serde_json::json!({ "address": e.local_addr().to_string(), "hubs": hubs }),
            );
        }
        if let Some(s) = &self.servicebus {
            let queues: serde_json::Map<String, serde_json::Value> = s
                .queue_names()
                .into_iter()
                .filter_map(|q| {
                    s.counters(&q)
                        .map(|c| (q, serde_json::to_value(c).unwrap_or_default()))
                })
                .collect();
            out.insert(
                "servicebus".into(),
                serde_json::json!({ "address": s.local_addr().to_string(), "queues": queues }),
            );
        }
        if let Some(w) = &self.webhook {
            let d = w.deliveries();
            out.insert("webhook".into(), serde_json::json!({ "url": w.url(), "events": d.len(), "deliveries": d.values().sum::<u32>() }));
        }
        if let Some(b) = &self.blob {
            out.insert("blob".into(), serde_json::json!({ "address": b.local_addr().to_string(), "containers": b.store().container_names() }));
        }
        serde_json::Value::Object(out)
    }

    /// Stops every service.
    pub async fn shutdown(self) {
        if let Some(e) = self.eventhubs {
            e.shutdown().await;
        }
        if let Some(s) = self.servicebus {
            s.shutdown().await;
        }
        if let Some(b) = self.blob {
            b.shutdown().await;
        }
        if let Some(w) = self.webhook {
            w.shutdown().await;
        }
    }
}
