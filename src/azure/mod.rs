//! Azure SDK client construction and authentication.
//!
//! - [`connection_string`]: the `Endpoint=…;SharedAccessKeyName=…;SharedAccessKey=…` form,
//!   parsed with errors that name the missing key and never echo the secret.
//! - [`sas`]: Shared Access Signature tokens (HMAC-SHA256 over the audience), as the clients
//!   sign them (Event Hubs clients use the SDK's own connection-string credential, see
//!   [`ConnectionString::open_consumer`]); the emulators verify them (`emulator::sas`).
//! - [`blob`]: hubguard's small Blob Storage REST client (SAS, Entra ID or anonymous), under
//!   both stores below, until `azure_storage_blob` accepts `azure_core` 1.2.
//! - [`checkpoint_store`]: checkpoints and ownerships in the official blob layout, behind the
//!   SDK's `CheckpointStore` trait.
//! - [`memory`]: in-memory twins of the record store and the retry queue, for tests.
//! - [`record_store`]: records with compare-and-swap in blob storage (ledger, breaker).
//! - [`versioned`]: a value and its ETag, and the one compare-and-swap update of every record.
//! - [`retry_queue`]: the [`RetryQueue`] trait and its Service Bus implementation, with typed
//!   errors and a deadline on every call.

pub mod blob;
pub mod checkpoint_store;
pub mod connection_string;
pub mod memory;
pub mod record_store;
pub mod retry_queue;
pub mod sas;
pub mod versioned;

#[cfg(any(test, feature = "testbed"))]
pub use blob::BlobContainer;
pub use checkpoint_store::BlobCheckpointStore;
pub use connection_string::{ConnectionString, ConnectionStringError};
pub use record_store::{BlobRecordStore, IfChanged, Record, RecordStore, StoreError};
pub use retry_queue::{
    OutgoingMessage, QueueDescription, ReceivedMessage, RetryQueue, RetryQueueError,
    ServiceBusRetryQueue,
};
pub use sas::SasKey;

/// Installs rustls's aws-lc-rs provider as the process-wide default, once. The Event Hubs
/// SDK's AMQP transport asks rustls for the default provider, and with both of rustls's
/// providers compiled in (aws-lc-rs from the 1.x Azure crates, ring from the legacy Service Bus
/// stack) rustls refuses to guess and panics. Every hubguard path that opens an Event Hubs
/// client calls this; an application that opens SDK clients itself calls it first.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err: someone installed one already, which is as good.
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    });
}

/// How hubguard authenticates to Event Hubs.
#[derive(Clone)]
pub enum EventHubsAuth {
    /// A connection string: the SDK's connection-string credential, SAS tokens presented as
    /// `servicebus.windows.net:sastoken`.
    ConnectionString(ConnectionString),
    /// An Entra ID credential: tokens for `https://eventhubs.azure.net/.default`, presented as
    /// `jwt`. Needs the role Azure Event Hubs Data Receiver (and Sender to produce).
    Credential(std::sync::Arc<dyn azure_core::credentials::TokenCredential>),
}

impl std::fmt::Debug for EventHubsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ConnectionString(cs) => write!(f, "ConnectionString({})", cs.namespace()),
            Self::Credential(_) => f.write_str("Credential"),
        }
    }
}

impl EventHubsAuth {
    /// Opens a consumer for `hub` in `namespace`: with a connection string, as
    /// [`ConnectionString::open_consumer`] does (its own namespace, and its emulator endpoint
    /// with `UseDevelopmentEmulator=true`); with a credential, at the builder's endpoint.
    pub async fn open_consumer(
        &self,
        builder: azure_messaging_eventhubs::builders::ConsumerClientBuilder,
        namespace: &str,
        hub: &str,
    ) -> azure_messaging_eventhubs::Result<azure_messaging_eventhubs::ConsumerClient> {
        install_crypto_provider();
        match self {
            Self::ConnectionString(cs) => cs.open_consumer(builder, hub).await,
            Self::Credential(c) => builder.open(namespace, hub.to_string(), c.clone()).await,
        }
    }

    /// Opens a producer for `hub` in `namespace`.
    pub async fn open_producer(
        &self,
        builder: azure_messaging_eventhubs::builders::ProducerClientBuilder,
        namespace: &str,
        hub: &str,
    ) -> azure_messaging_eventhubs::Result<azure_messaging_eventhubs::ProducerClient> {
        install_crypto_provider();
        match self {
            Self::ConnectionString(cs) => cs.open_producer(builder, hub).await,
            Self::Credential(c) => builder.open(namespace, hub, c.clone()).await,
        }
    }
}
