//! # hubguard
//!
//! An Azure Event Hubs consumer with a *checkpoint guard*: a partition's checkpoint advances
//! only past events that were delivered, durably scheduled for retry, or dead-lettered, so no
//! event is ever lost silently.
//!
//! ## The public API
//!
//! What a program embedding the pipeline uses, re-exported at the crate's root (without the
//! default feature `testbed` this is all that is public; the integration test `public_api`
//! holds it to `tests/it/public_api.txt`, so a change to it is a decision):
//!
//! - The handler: [`Handler`] (implement it), the [`Event`] it is given with its
//!   [`Identity`], the [`Attempt`], and what it answers: [`Outcome`], [`Failure`] with its
//!   [`ErrorClass`]. The webhook handler: [`WebhookHandler`], [`WebhookConfig`] (with
//!   [`ContentMode`], [`SecretSource`], [`TlsConfig`], [`HandshakeConfig`]) and its
//!   [`WebhookConfigError`].
//! - Wiring and running: [`Wiring`] (the one builder of a pipeline's parts, from a
//!   [`Config`] or from [`EventHubsTarget`], [`StorageAccess`] and [`ServiceBusAccess`]) and
//!   its [`WiringError`] (a refused retry queue: [`QueueRefusal`]); [`Pipeline`],
//!   [`PipelineParts`], [`PipelineOptions`] ([`OrderingKey`], [`RetryOrdering`],
//!   [`RateLimitConfig`], [`Clock`], a [`DeadLetterDestination`]), [`RetryPolicy`] and
//!   [`Policies`], [`BreakerConfig`], [`StormGuardConfig`] (the dead-letter storm guard, in
//!   `PipelineOptions::storm_guard`), [`IdentityConfig`]; [`RunError`] when it cannot start.
//! - The configuration file of `hubguard run`: [`Config`] and its sections, [`ConfigError`].
//! - Logs, traces and metrics as `hubguard run` sets them up: [`init_telemetry`] with
//!   [`TelemetryOptions`] (OTLP from the environment: [`otlp_export_from_env`]).
//! - The read side: [`Health`] (from [`Pipeline::health`]; read only — the pipeline alone
//!   changes it) and its [`HealthReport`], and [`status_router`], the HTTP endpoints
//!   `hubguard run` serves (`/healthz`, `/readyz`, `/v1/status`, `/metrics`, …).
//! - The stores: [`RecordStore`] and [`RetryQueue`] (with their messages and typed errors
//!   [`StoreError`], [`RetryQueueError`]), and their in-memory twins [`MemoryRecordStore`]
//!   and [`MemoryRetryQueue`] for testing a handler against the pipeline's rules without
//!   Azure (as the Azure SDK ships an in-memory checkpoint store).
//!
//! `hubguard run`, embedded (with a handler of the program's own; the names are the
//! crate's root's, with or without the test bed):
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use hubguard::{Attempt, Config, Event, Failure, Handler, Outcome, Pipeline, Wiring};
//!
//! struct Print;
//!
//! #[async_trait::async_trait]
//! impl Handler for Print {
//!     async fn handle(&self, event: &Event, attempt: &Attempt) -> Outcome {
//!         if event.body.is_empty() {
//!             return Outcome::Failed(Failure::permanent("an empty body"));
//!         }
//!         println!("{} (attempt {})", event.identity.idempotency_key, attempt.number);
//!         Outcome::Delivered
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::load("hubguard.toml".as_ref(), std::env::vars())?;
//! let _telemetry = hubguard::init_telemetry(hubguard::TelemetryOptions::default());
//! let wiring = Wiring::from_config(&config)?;
//! for warning in wiring.prove_retry_queue().await? {
//!     eprintln!("{warning}");
//! }
//! let pipeline = Pipeline::new(wiring.parts(Arc::new(Print))?);
//! let status = tokio::net::TcpListener::bind(config.status.listen).await?;
//! let router = hubguard::status_router(&pipeline);
//! tokio::spawn(async move { axum::serve(status, router).await });
//! pipeline.run(tokio_util::sync::CancellationToken::new()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## Module map
//!
//! The modules are public only with the test bed (the bench, the demo and the integration
//! tests use them); to a program embedding the library, and to the command line, they are
//! the implementation.
//!
//! ```text
//!  Event Hubs ─► pipeline::partition ─► handler (Handler trait · webhook)
//!                    │                      │
//!                    │◄── guard (checkpoint window) ◄── pipeline::settle ─► ledger (blob, CAS)
//!                    ▼                                        └──────────► azure::retry_queue (Service Bus)
//!              fenced checkpoint store          Service Bus ─► pipeline::retry ─► handler ─► settle
//! ```
//!
//! - `pipeline`: the partition loop, the retry loop, settlement, the fenced checkpoint
//!   store, health; the admission step both loops take around a handler call (the breaker),
//!   and what they count; `pipeline::Pipeline` runs it all.
//! - `breaker`: the downstream's circuit breaker shared by every replica (a blob record) —
//!   pure decide/apply over the record and `now`.
//! - `ratelimit`: one downstream rate limit for the whole deployment, shared out by owned
//!   partitions and adapted from 429s, 503s and timeouts (AIMD; a blob record beside the
//!   breaker's) — pure rate, share and pacing functions, and the replica's limiter.
//! - `handler`: the `Handler` trait library users implement, and the webhook.
//! - `policy`: backoff curves, budgets and error classification — pure functions.
//! - `guard`: the contiguous-settled-prefix checkpoint window — pure.
//! - `ledger`: attempt records in blob storage, authoritative for the attempt number.
//! - `event`: an event and its identity (idempotency key, correlation id, type).
//! - `config`: `hubguard run`'s TOML + environment configuration: schema and validation.
//! - `wiring`: credentials, clients and stores, and the one builder of the pipeline's parts
//!   (`Wiring`) that `run`, the demo, the bench and the tests use.
//! - `telemetry`: spans per attempt (linked across retries) and metrics, by OTLP; every
//!   name in `telemetry::names`, the gauges beside them (`telemetry::gauges`).
//! - `opsevents`: operational events — CloudEvents about hubguard itself (breaker, held
//!   partitions, dead letters, the rate limit) to a signed webhook or Service Bus, read off the
//!   event path, suppressed per window, dropped with a count when the destination lags.
//! - `clock`: the clock policy time runs on (wall time; tests advance it), and time's
//!   formats (epoch milliseconds, RFC 3339, HTTP dates, Service Bus's whole seconds).
//! - `sync`: locks taken whatever became of their last holder (`LockExt::locked`).
//! - `redact`: the one rule masking credentials (URL userinfo, SAS signatures, keys,
//!   tokens) in every text that leaves the process.
//! - `status`: `/healthz`, `/readyz`, `/v1/events/{key}` and `hubguard status`.
//! - `azure`: connection strings, the SAS credential, the Service Bus retry queue and the
//!   blob record store — hubguard's clients, with typed errors and deadlines; in-memory twins
//!   of the record store and the retry queue (`azure::memory`).
//!
//! Dependencies point downwards only; each layer may use anything below it, and the
//! integration test `architecture` checks there is no cycle and no use of the test bed:
//!
//! ```text
//!  wiring ─► config, status ─► pipeline ─► ledger, breaker, ratelimit, handler ─► policy, azure
//!        ─► clock, event, guard, telemetry
//! ```
//!
//! Two default features, both off for a program embedding the pipeline
//! (`default-features = false`), which compiles none of what they add:
//!
//! - `cli`, the operator's command line: the module `cli` (the `hubguard` binary's commands:
//!   `run`, `status`, `retries`, `dead-letters`, `partitions`, `checkpoints`, …) and the
//!   operator operations they call (replay, retry-now, cancel, rewind, pause and resume, the
//!   status texts). The binary requires it.
//! - `testbed` (includes `cli`: its parts are the command line's subcommands), what the tests
//!   need:
//!   - `emulator`: in-process emulators that speak the services' wire protocols, so every
//!     test and the demo drive the real SDK crates with no Azure and no Docker.
//!   - `demo`: `hubguard demo`, the whole story in one process on the emulators.
//!   - `bench`: performance figures measured through the real SDK.
//!   - the modules above made public, and the few items only the tests use (their doors).

// The crate's lints for the library without the test bed: every `pub` item of the internal
// modules is public with the test bed (where `unreachable_pub` checks them) and unreachable
// without it, by design; and every type the embedder's API names must be nameable, i.e.
// re-exported below (a type that is reachable but not exported would be an accident).
#![cfg_attr(
    not(feature = "testbed"),
    allow(unreachable_pub),
    warn(unnameable_types)
)]

// The product's modules: public with the test bed (the bench, the demo and the integration
// tests reach into them: the test bed's one door in this file), private without it, where
// the crate's public API is exactly the re-exports below; and `testbed_pub!`, the same
// switch for single items. One switch for all of them, in `cfg_if!`'s form, which `cargo
// fmt` follows into the modules' files (it does not follow `mod` items out of other macros).
cfg_if::cfg_if! {
    if #[cfg(feature = "testbed")] {
        /// An item public with the test bed and crate-visible without it: what the bench,
        /// the demo or the integration tests reach for, that the library uses itself, and
        /// that an embedder is not given. (Written `testbed_pub! { … }` around the item.)
        macro_rules! testbed_pub {
            ($(#[$meta:meta])* pub $($item:tt)*) => { $(#[$meta])* pub $($item)* };
        }

        pub mod azure;
        pub mod breaker;
        pub mod clock;
        pub mod config;
        pub mod event;
        pub mod guard;
        pub mod handler;
        pub mod ledger;
        pub mod opsevents;
        pub mod pipeline;
        pub mod policy;
        pub mod ratelimit;
        pub mod redact;
        pub mod status;
        pub mod telemetry;
        pub mod wiring;

        // The web console `hubguard run` serves on the status listener (docs/console.md):
        // the command line's (the test bed includes `cli`), public here for its tests.
        pub mod console;

        // The test bed itself.
        pub mod bench;
        pub mod demo;
        pub mod emulator;
    } else {
        macro_rules! testbed_pub {
            ($(#[$meta:meta])* pub $($item:tt)*) => { $(#[$meta])* pub(crate) $($item)* };
        }

        mod azure;
        mod breaker;
        mod clock;
        mod config;
        mod event;
        mod guard;
        mod handler;
        mod ledger;
        mod opsevents;
        mod pipeline;
        mod policy;
        mod ratelimit;
        mod redact;
        mod status;
        mod telemetry;
        mod wiring;

        // The web console, with the command line that serves it.
        #[cfg(feature = "cli")]
        mod console;
    }
}

// One small helper every module takes its locks with (crate-internal in every build).
mod sync;

// The operator's command line: the `hubguard` binary's commands.
#[cfg(feature = "cli")]
pub mod cli;

// The embedder's API. Without `testbed` this is the crate's whole public surface (the
// integration test `public_api` holds it to `tests/it/public_api.txt`).

// The handler a program writes, what it is given and what it answers.
pub use event::{Deployment, Event, Identity, IdentityConfig};
pub use handler::{Attempt, Failure, Handler, Outcome};
// Many events per call, one outcome per event (docs/library.md).
pub use handler::batch::{BatchHandler, BatchLimits, Batched, Item};
pub use policy::classify::ErrorClass;
// The webhook handler and its configuration.
pub use handler::cloudevents::ContentMode;
pub use handler::handshake::HandshakeConfig;
pub use handler::secret::SecretSource;
pub use handler::webhook::{TlsConfig, WebhookConfig, WebhookConfigError, WebhookHandler};
// The pipeline, its parts and options, and the one builder of them.
pub use azure::retry_queue::QueueRefusal;
pub use azure::{ConnectionString, ConnectionStringError, EventHubsAuth, SasKey};
pub use breaker::storm::{StormGuardConfig, StormGuardConfigError, StormGuardType};
pub use breaker::{BreakerConfig, BreakerConfigError};
pub use clock::{Clock, Sent as ClockSent, Service as ClockService, Skew as ClockSkew};
pub use pipeline::dead_letter::{DeadLetterDestination, PublishError};
pub use pipeline::settle::Policies;
pub use pipeline::{
    BadLineOnDeadLetter, BadOrderingKey, EventHubsTarget, LineOnDeadLetter, OrderingKey, Pipeline,
    PipelineOptions, PipelineParts, RetryOrdering, RunError,
};
pub use policy::{Curve, PolicyError, RetryPolicy};
// Operational events (CloudEvents about hubguard itself) and the backlog for scaling.
pub use opsevents::send::{
    OpsEventsDestination, OpsEventsError, ServiceBusDestination, WebhookDestination,
};
pub use opsevents::{OpsEvent, OpsEventKind, OpsEvents, OpsEventsCounts, OpsEventsSettings};
pub use ratelimit::RateLimitConfig;
pub use telemetry::backlog::{router as backlog_router, Backlog, BacklogCell};
pub use wiring::{ServiceBusAccess, StorageAccess, Wiring, WiringError};
// `hubguard run`'s configuration file.
pub use config::{
    Access, CheckpointSection, Config, ConfigError, ConsoleSection, CredentialKind,
    DeadLettersSection, EventHubsSection, HandlerSection, LedgerSection, OperationalEventsSection,
    PolicySection, ProcessorSection, RetryOrderingKind, RetrySection, ServiceBusSection,
    StartPosition, StatusSection, StorageSection,
};
pub use telemetry::logs::{LogFormat, LogSection};
// Logs, traces and metrics as `hubguard run` sets them up.
pub use telemetry::logs::LogWriter;
pub use telemetry::{
    export_from_env as otlp_export_from_env, init_with as init_telemetry, Export as OtlpExport,
    Guard as TelemetryGuard, Options as TelemetryOptions,
};
// The health read side, and the status endpoints over it.
pub use pipeline::health::{
    ClockOffset, ConsumerState, CounterSnapshot, Health, HealthReport, Held, HeldRetry, HoldCause,
    Lag, NotLive, RetryLoopState,
};
pub use status::pipeline_router as status_router;
// The stores (record store, retry queue) and their in-memory twins.
pub use azure::memory::{MemoryRecordStore, MemoryRetryQueue};
pub use azure::record_store::Listed;
pub use azure::retry_queue::MessageLock;
pub use azure::{
    IfChanged, OutgoingMessage, QueueDescription, ReceivedMessage, Record, RecordStore, RetryQueue,
    RetryQueueError, StoreError,
};
