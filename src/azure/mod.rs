//! Azure SDK client construction and authentication.
//!
//! - [`connection_string`]: the `Endpoint=…;SharedAccessKeyName=…;SharedAccessKey=…` form,
//!   parsed with errors that name the missing key and never echo the secret.
//! - [`sas`]: Shared Access Signature tokens (HMAC-SHA256 over the audience) — the
//!   [`SasCredential`](sas::SasCredential) that lets the Event Hubs 0.15 clients (which only take
//!   a `TokenCredential`) use a connection string, and the verifier the emulators use.
//! - [`memory`]: in-memory twins of the record store and the retry queue, for tests.
//! - [`record_store`]: records with compare-and-swap in blob storage (ledger, breaker).
//! - [`retry_queue`]: the [`RetryQueue`] trait and its Service Bus implementation, with typed
//!   errors and a deadline on every call.

pub mod connection_string;
pub mod memory;
pub mod record_store;
pub mod retry_queue;
pub mod sas;

pub use connection_string::{ConnectionString, ConnectionStringError};
pub use record_store::{BlobRecordStore, Record, RecordStore, StoreError};
pub use retry_queue::{
    OutgoingMessage, QueueDescription, ReceivedMessage, RetryQueue, RetryQueueError,
    ServiceBusRetryQueue,
};
pub use sas::{SasCredential, SasError, SasKey};
