//! # hubguard
//!
//! An Azure Event Hubs consumer with a *checkpoint guard*: a partition's checkpoint advances
//! only past events that were delivered, durably scheduled for retry, or dead-lettered, so no
//! event is ever lost silently.
//!
//! ## Module map
//!
//! ```text
//!  Event Hubs ─► pipeline::partition ─► handler (Handler trait · webhook)
//!                    │                      │
//!                    │◄── guard (checkpoint window) ◄── pipeline::settle ─► ledger (blob, CAS)
//!                    ▼                                        └──────────► azure::retry_queue (Service Bus)
//!              fenced checkpoint store          Service Bus ─► pipeline::retry ─► handler ─► settle
//! ```
//!
//! - [`pipeline`]: the partition loop, the retry loop, settlement, the fenced checkpoint
//!   store, health; the admission step both loops take around a handler call (the breaker),
//!   and what they count; [`pipeline::Pipeline`] runs it all.
//! - [`breaker`]: the downstream's circuit breaker shared by every replica (a blob record) —
//!   pure decide/apply over the record and `now`.
//! - [`ratelimit`]: one downstream rate limit for the whole deployment, shared out by owned
//!   partitions and adapted from 429s, 503s and timeouts (AIMD; a blob record beside the
//!   breaker's) — pure rate, share and pacing functions, and the replica's limiter.
//! - [`handler`]: the [`handler::Handler`] trait library users implement, and the webhook.
//! - [`policy`]: backoff curves, budgets and error classification — pure functions.
//! - [`guard`]: the contiguous-settled-prefix checkpoint window — pure.
//! - [`ledger`]: attempt records in blob storage, authoritative for the attempt number.
//! - [`event`]: an event and its identity (idempotency key, correlation id, type).
//! - [`config`]: `hubguard run`'s TOML + environment configuration: schema and validation.
//! - [`wiring`]: credentials, clients and stores, and the one builder of the pipeline's parts
//!   ([`wiring::Wiring`]) that `run`, the demo, the bench and the tests use.
//! - [`telemetry`]: spans per attempt (linked across retries) and metrics, by OTLP; every
//!   name in [`telemetry::names`], the gauges beside them ([`telemetry::gauges`]).
//! - [`clock`]: the clock policy time runs on (wall time; tests advance it), and time's
//!   formats (epoch milliseconds, RFC 3339, HTTP dates, Service Bus's whole seconds).
//! - [`redact`]: the one rule masking credentials (URL userinfo, SAS signatures, keys,
//!   tokens) in every text that leaves the process.
//! - [`status`]: `/healthz`, `/readyz`, `/v1/events/{key}` and `hubguard status`.
//! - [`azure`]: connection strings, the SAS credential, the Service Bus retry queue and the
//!   blob record store — hubguard's clients, with typed errors and deadlines; in-memory twins
//!   of the record store and the retry queue ([`azure::memory`]).
//!
//! Dependencies point downwards only; each layer may use anything below it, and the
//! integration test `architecture` checks there is no cycle and no use of the test bed:
//!
//! ```text
//!  wiring ─► config, status ─► pipeline ─► ledger, breaker, ratelimit, handler ─► policy, azure
//!        ─► clock, event, guard, telemetry
//! ```
//!
//! Behind the default feature `testbed` (what the `hubguard` binary and the tests need; a
//! program embedding the pipeline turns it off and compiles none of it):
//!
//! - `emulator`: in-process emulators that speak the services' wire protocols, so every test
//!   and the demo drive the real SDK crates with no Azure and no Docker.
//! - `demo`: `hubguard demo`, the whole story in one process on the emulators.
//! - `bench`: performance figures measured through the real SDK.
//! - `cli`: the `hubguard` command line.

pub mod azure;
#[cfg(feature = "testbed")]
pub mod bench;
pub mod breaker;
#[cfg(feature = "testbed")]
pub mod cli;
pub mod clock;
pub mod config;
#[cfg(feature = "testbed")]
pub mod demo;
#[cfg(feature = "testbed")]
pub mod emulator;
pub mod event;
pub mod guard;
pub mod handler;
pub mod ledger;
pub mod pipeline;
pub mod policy;
pub mod ratelimit;
pub mod redact;
pub mod status;
pub mod telemetry;
pub mod wiring;
