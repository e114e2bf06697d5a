//! # hubguard
//!
//! An Azure Event Hubs consumer with a *checkpoint guard*: a partition's checkpoint advances
//! only past events that were delivered, durably scheduled for retry, or dead-lettered, so no
//! event is ever lost silently.
//!
//! ## Module map
//!
//! ```text
//!  cli ──► emulator ──► eventhubs (AMQP 1.0: store · selector · server · wire)
//!   │         └──────► faults (refuse · delay · drop · error status)
//!   ├────► bench     (throughput through the real SDK against the emulator)
//!   └────► azure     (connection strings, SAS credential for the SDK clients)
//! ```
//!
//! - [`azure`]: what the Azure SDK clients need from us — connection-string parsing and the
//!   SAS [`TokenCredential`](azure_core::credentials::TokenCredential) that lets the Event Hubs
//!   0.15 clients (which have no connection-string API) authenticate with a shared key.
//! - [`emulator`]: in-process emulators that speak the services' wire protocols, so every test
//!   and the demo drive the real SDK crates with no Azure and no Docker.
//! - [`bench`]: performance figures measured through the real SDK.
//! - [`cli`]: the `hubguard` command line.

pub mod azure;
pub mod bench;
pub mod cli;
pub mod emulator;
pub mod event;
pub mod guard;
pub mod handler;
pub mod ledger;
pub mod pipeline;
pub mod policy;
