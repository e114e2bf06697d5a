//! Azure SDK client construction and authentication.
//!
//! - [`connection_string`]: the `Endpoint=…;SharedAccessKeyName=…;SharedAccessKey=…` form,
//!   parsed with errors that name the missing key and never echo the secret.
//! - [`sas`]: Shared Access Signature tokens (HMAC-SHA256 over the audience) — the
//!   [`SasCredential`](sas::SasCredential) that lets the Event Hubs 0.15 clients (which only take
//!   a `TokenCredential`) use a connection string, and the verifier the emulators use.

pub mod connection_string;
pub mod sas;

pub use connection_string::{ConnectionString, ConnectionStringError};
pub use sas::{SasCredential, SasError, SasKey};
