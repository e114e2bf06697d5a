//! hubguard's blob checkpoint store, behind the SDK's `CheckpointStore` trait (the official
//! `azure_messaging_eventhubs_checkpointstore_blob` cannot be built with Event Hubs 0.16; see
//! [`blob`](super::blob)). It writes the layout and metadata every official Event Hubs
//! checkpoint store shares, so other SDKs' processors and KEDA's Event Hubs scaler read the
//! same checkpoints and ownerships:
//!
//! - `{namespace}/{hub}/{consumer group}/checkpoint/{partition}`, metadata `sequencenumber` and
//!   `offset`: Set Blob Metadata without a condition (last writer wins, as everywhere; the
//!   fencing wrapper in `pipeline::checkpoint` decides who may write), Put Blob on 404;
//! - `{namespace}/{hub}/{consumer group}/ownership/{partition}`, metadata `ownerid`: a claim
//!   with an ETag is Set Blob Metadata `If-Match`, a claim without one is Put Blob
//!   `If-None-Match: *`; 412 / 409 (and a blob that vanished, 404) mean the claim was lost and
//!   the ownership is left out of the result; a release writes `ownerid` empty (the Python
//!   store needs the key to be there), listed back as no owner;
//! - names are **lower-cased** whole, as the .NET, Java, Python, JavaScript and Go stores
//!   write them (the Rust store 0.9 kept the case: `$Default`). Checkpoints that hubguard wrote
//!   with the Rust store under the case-kept names are still read, for partitions that have
//!   none under the lower-cased name, so an upgrade resumes where it stopped.

use std::sync::Arc;

use async_trait::async_trait;
use azure_core::error::ErrorKind;
use azure_core::http::Etag;
use azure_messaging_eventhubs::models::{Checkpoint, Ownership};
use azure_messaging_eventhubs::CheckpointStore;
use bytes::Bytes;

use super::blob::{BlobContainer, BlobError, Condition, Written};

const OWNER_ID: &str = "ownerid";
const OFFSET: &str = "offset";
const SEQUENCE_NUMBER: &str = "sequencenumber";

/// Checkpoints and ownerships in one blob container, in the official layout.
#[derive(Debug, Clone)]
pub struct BlobCheckpointStore {
    container: Arc<BlobContainer>,
}

fn to_azure(what: &str, e: BlobError) -> azure_core::Error {
    let kind = match e.status() {
        Some(s) => ErrorKind::HttpResponse {
            status: s.into(),
            error_code: e.code().map(str::to_string),
            raw_response: None,
        },
        None => ErrorKind::Io,
    };
    azure_core::Error::with_message(kind, format!("checkpoint store: {what}: {e}"))
}

fn prefix(namespace: &str, hub: &str, cg: &str, kind: &str) -> azure_core::Result<String> {
    for (v, name) in [
        (namespace, "namespace"),
        (hub, "event hub"),
        (cg, "consumer group"),
    ] {
        if v.is_empty() {
            return Err(azure_core::Error::with_message(
                ErrorKind::Other,
                format!("checkpoint store: the {name} is empty"),
            ));
        }
    }
    Ok(format!("{namespace}/{hub}/{cg}/{kind}/"))
}

/// The official blob name's prefix (lower-cased): `{ns}/{hub}/{cg}/{checkpoint|ownership}/`.
pub fn blob_prefix(namespace: &str, hub: &str, cg: &str, kind: &str) -> String {
    format!("{namespace}/{hub}/{cg}/{kind}/").to_lowercase()
}

fn partition_of(name: &str) -> String {
    name.rsplit('/').next().unwrap_or_default().to_string()
}

impl BlobCheckpointStore {
    /// A store in `container`.
    pub fn new(container: Arc<BlobContainer>) -> Arc<Self> {
        Arc::new(Self { container })
    }

    async fn write_checkpoint(
        &self,
        name: &str,
        metadata: &[(&str, &str)],
    ) -> Result<Written, BlobError> {
        match self
            .container
            .set_metadata(name, metadata, &Condition::None)
            .await
        {
            Err(e) if e.status() == Some(404) && e.code() != Some("ContainerNotFound") => {
                self.container
                    .put_blob(
                        name,
                        Bytes::new(),
                        "application/octet-stream",
                        metadata,
                        &Condition::None,
                    )
                    .await
            }
            other => other,
        }
    }

    async fn checkpoints_under(
        &self,
        prefix: &str,
        namespace: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<Checkpoint>> {
        let items = self
            .container
            .list_blobs(prefix, true)
            .await
            .map_err(|e| to_azure("list checkpoints", e))?;
        Ok(items
            .into_iter()
            .map(|item| {
                // A checkpoint whose position cannot be read must not fail every partition's
                // listing (the processor would rebuild forever and read nothing). It comes
                // back with no position at all — which no checkpoint this store writes has —
                // and the pipeline's fence holds that partition instead of reading it from a
                // guessed position.
                let sequence_number = item.meta(SEQUENCE_NUMBER).and_then(|s| {
                    s.parse::<i64>()
                        .ok()
                        .filter(|n| *n >= -1)
                        .or_else(|| {
                            tracing::error!(blob = %item.name, sequencenumber = %s, "a checkpoint's sequencenumber is not a valid sequence number; its partition is held");
                            None
                        })
                });
                let offset = item.meta(OFFSET).map(str::to_string);
                let (sequence_number, offset) = match (sequence_number, item.meta(SEQUENCE_NUMBER)) {
                    // Unreadable sequence number: drop the offset too (no usable position).
                    (None, Some(_)) => (None, None),
                    (n, _) => (n, offset),
                };
                Checkpoint {
                    fully_qualified_namespace: namespace.to_string(),
                    event_hub_name: hub.to_string(),
                    consumer_group: cg.to_string(),
                    partition_id: partition_of(&item.name),
                    offset,
                    sequence_number,
                }
            })
            .collect())
    }
}

#[async_trait]
impl CheckpointStore for BlobCheckpointStore {
    async fn claim_ownership(
        &self,
        ownerships: &[Ownership],
    ) -> azure_core::Result<Vec<Ownership>> {
        let mut claimed = Vec::new();
        for o in ownerships {
            let name = prefix(
                &o.fully_qualified_namespace,
                &o.event_hub_name,
                &o.consumer_group,
                "ownership",
            )?
            .to_lowercase()
                + &o.partition_id.to_lowercase();
            let owner = o.owner_id.clone().unwrap_or_default();
            let metadata = [(OWNER_ID, owner.as_str())];
            let result = match &o.etag {
                Some(etag) => {
                    self.container
                        .set_metadata(&name, &metadata, &Condition::IfMatch(etag.to_string()))
                        .await
                }
                None => {
                    self.container
                        .put_blob(
                            &name,
                            Bytes::new(),
                            "application/octet-stream",
                            &metadata,
                            &Condition::IfNotExists,
                        )
                        .await
                }
            };
            match result {
                Ok(w) => claimed.push(Ownership {
                    etag: Some(Etag::from(w.etag)),
                    last_modified_time: w.last_modified,
                    ..o.clone()
                }),
                // Someone else changed or created it first: lost, not an error.
                Err(e) if matches!(e.status(), Some(409) | Some(412)) => {
                    tracing::debug!(blob = %name, error = %e, "ownership claim lost");
                }
                Err(e) if e.status() == Some(404) && e.code() != Some("ContainerNotFound") => {
                    tracing::debug!(blob = %name, "ownership blob vanished: claim lost");
                }
                Err(e) => return Err(to_azure("claim ownership", e)),
            }
        }
        Ok(claimed)
    }

    async fn list_checkpoints(
        &self,
        namespace: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<Checkpoint>> {
        let exact = prefix(namespace, hub, cg, "checkpoint")?;
        let lower = exact.to_lowercase();
        let mut found = self.checkpoints_under(&lower, namespace, hub, cg).await?;
        if exact != lower {
            // Names the Rust store 0.9 wrote (case kept): only for partitions without an
            // official one.
            let legacy = self.checkpoints_under(&exact, namespace, hub, cg).await?;
            for c in legacy {
                if !found.iter().any(|f| f.partition_id == c.partition_id) {
                    tracing::info!(partition = %c.partition_id, "resuming from a checkpoint under the case-kept blob name of an older hubguard");
                    found.push(c);
                }
            }
        }
        Ok(found)
    }

    async fn list_ownerships(
        &self,
        namespace: &str,
        hub: &str,
        cg: &str,
    ) -> azure_core::Result<Vec<Ownership>> {
        let p = prefix(namespace, hub, cg, "ownership")?.to_lowercase();
        let items = self
            .container
            .list_blobs(&p, true)
            .await
            .map_err(|e| to_azure("list ownerships", e))?;
        Ok(items
            .into_iter()
            .map(|item| Ownership {
                fully_qualified_namespace: namespace.to_string(),
                event_hub_name: hub.to_string(),
                consumer_group: cg.to_string(),
                partition_id: partition_of(&item.name),
                owner_id: item
                    .meta(OWNER_ID)
                    .filter(|o| !o.is_empty())
                    .map(str::to_string),
                etag: Some(Etag::from(item.etag.clone())).filter(|e| !e.to_string().is_empty()),
                last_modified_time: item.last_modified,
            })
            .collect())
    }

    async fn update_checkpoint(&self, checkpoint: Checkpoint) -> azure_core::Result<()> {
        let name = prefix(
            &checkpoint.fully_qualified_namespace,
            &checkpoint.event_hub_name,
            &checkpoint.consumer_group,
            "checkpoint",
        )?
        .to_lowercase()
            + &checkpoint.partition_id.to_lowercase();
        let seq = checkpoint.sequence_number.map(|s| s.to_string());
        let mut metadata: Vec<(&str, &str)> = Vec::new();
        if let Some(s) = &seq {
            metadata.push((SEQUENCE_NUMBER, s));
        }
        if let Some(o) = &checkpoint.offset {
            metadata.push((OFFSET, o));
        }
        if metadata.is_empty() {
            return Err(azure_core::Error::with_message(
                ErrorKind::Other,
                format!(
                    "checkpoint of partition {} has neither a sequence number nor an offset",
                    checkpoint.partition_id
                ),
            ));
        }
        self.write_checkpoint(&name, &metadata)
            .await
            .map(|_| ())
            .map_err(|e| to_azure("update checkpoint", e))
    }
}
