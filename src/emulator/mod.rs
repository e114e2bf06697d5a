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
//! - [`clock`]: the emulators' clock, which tests advance instead of sleeping.
//! - [`http`]: the serve loop and fault plumbing the REST emulators share.

pub mod blob;
pub mod clock;
pub mod eventhubs;
pub mod faults;
pub mod http;
pub mod servicebus;

pub use faults::Faults;

/// The SAS key name the emulators accept by default (a well-known development value, like
/// Azurite's `devstoreaccount1`; never use it outside a local emulator).
pub const DEFAULT_KEY_NAME: &str = "RootManageSharedAccessKey";
/// The SAS key the emulators accept by default (well known; development only).
pub const DEFAULT_KEY: &str = "SAS_KEY_VALUE";
