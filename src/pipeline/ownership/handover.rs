//! Cooperative handover of a partition between live replicas.
//!
//! The Event Hubs processors' load balancing moves a partition by *stealing* it: the replica
//! below its share claims a partition another live replica owns, and the old owner learns it
//! only at its own next cycle — meanwhile both read, and the new owner replays everything
//! since the last checkpoint. After a scale-out on a backlog that is a large share of the
//! backlog delivered twice.
//!
//! hubguard asks instead. A replica that wants a partition a live replica owns writes a
//! *handover request* beside the ledger, `handovers/{hub}/{consumer group}/{partition}`,
//! naming itself and the owner, and claims nothing. The owner sees the request in its next
//! cycle (it lists the requests once per cycle), acknowledges it, stops reading the
//! partition, lets the events in flight settle, writes its checkpoint and then writes the
//! ownership over to the asker (the official ownership blob's `ownerid`, Set Blob Metadata
//! `If-Match` its own claim's ETag), so the partition is never unowned and nobody else can
//! take it in between. The asker finds itself the owner at its next cycle and reads on from
//! that checkpoint: no event twice.
//!
//! Bounds: an owner that does not acknowledge within one ownership expiration (crashed,
//! partitioned, or a processor that does not speak this) has the partition stolen as
//! before; an owner that acknowledged and cannot finish (an event whose settlement waits on
//! a Service Bus outage) keeps the partition, renewed, until it can — the checkpoint never
//! passes the unsettled event. A crashed owner's ownership expires as always. Only one
//! asker at a time: a second asker leaves a fresh request alone. Everything other
//! processors and KEDA read — the checkpoint and ownership blobs — keeps the official
//! layout; the requests are hubguard's own records.
//!
//! Sources: how the processors balance and steal,
//! <https://learn.microsoft.com/en-us/azure/event-hubs/event-processor-balance-partition-load>;
//! the conditional ownership write, Set Blob Metadata with `If-Match`,
//! <https://learn.microsoft.com/en-us/rest/api/storageservices/set-blob-metadata> and
//! <https://learn.microsoft.com/en-us/rest/api/storageservices/specifying-conditional-headers-for-blob-service-operations>;
//! the same idea in Kafka (incremental cooperative rebalancing),
//! <https://cwiki.apache.org/confluence/display/KAFKA/KIP-429%3A+Kafka+Consumer+Incremental+Rebalance+Protocol>.

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::azure::{RecordStore, StoreError};

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(in crate::pipeline) enum Stage {
    /// Written by the asker; the owner has not answered.
    Asked,
    /// The owner stopped reading and is finishing: it writes the ownership over when done.
    Releasing,
}

/// One handover request, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(in crate::pipeline) struct Request {
    /// The partition.
    pub(in crate::pipeline) partition: String,
    /// The replica (owner id) that asks for it.
    pub(in crate::pipeline) asker: String,
    /// The replica (owner id) that owned it when asked.
    pub(in crate::pipeline) owner: String,
    /// Where the request stands.
    pub(in crate::pipeline) stage: Stage,
    /// When it was asked (RFC 3339, for people).
    pub(in crate::pipeline) asked: String,
}

/// What asking gave.
#[derive(Debug)]
pub(in crate::pipeline) enum Asked {
    /// This replica's request is in place.
    Mine,
    /// Another replica's request is in place (with its ETag): leave it.
    Theirs(String),
}

/// The handover requests of one hub and consumer group.
pub(in crate::pipeline) struct Handovers {
    records: Arc<dyn RecordStore>,
    prefix: String,
    me: String,
}

impl std::fmt::Debug for Handovers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handovers")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn body(r: &Request) -> Bytes {
    Bytes::from(serde_json::to_vec(r).unwrap_or_default())
}

impl Handovers {
    /// The requests of `hub` and `consumer_group` in `records`, for the replica `me`.
    pub(in crate::pipeline) fn new(
        records: Arc<dyn RecordStore>,
        hub: &str,
        consumer_group: &str,
        me: &str,
    ) -> Self {
        Self {
            records,
            prefix: format!("handovers/{hub}/{}/", consumer_group.to_ascii_lowercase()),
            me: me.to_string(),
        }
    }

    fn key(&self, partition: &str) -> String {
        format!("{}{partition}", self.prefix)
    }

    /// This replica's owner id.
    pub(in crate::pipeline) fn me(&self) -> &str {
        &self.me
    }

    /// The request for `partition`, with its ETag.
    pub(in crate::pipeline) async fn read(
        &self,
        partition: &str,
    ) -> Result<Option<(Request, String)>, StoreError> {
        Ok(self
            .records
            .read(&self.key(partition))
            .await?
            .and_then(|r| Some((serde_json::from_slice(&r.body).ok()?, r.etag))))
    }

    /// Asks `owner` for `partition`; `stale` is the ETag of another asker's request this
    /// replica has seen unchanged for an ownership expiration (its asker is gone): it is
    /// replaced.
    pub(in crate::pipeline) async fn ask(
        &self,
        partition: &str,
        owner: &str,
        stale: Option<&str>,
    ) -> Result<Asked, StoreError> {
        let request = Request {
            partition: partition.to_string(),
            asker: self.me.clone(),
            owner: owner.to_string(),
            stage: Stage::Asked,
            asked: crate::clock::rfc3339(std::time::SystemTime::now()),
        };
        let key = self.key(partition);
        let written = match stale {
            Some(etag) => self.records.update(&key, body(&request), etag).await,
            None => self.records.create(&key, body(&request)).await,
        };
        match written {
            Ok(_) => Ok(Asked::Mine),
            Err(StoreError::Conflict | StoreError::NotFound) => match self.read(partition).await? {
                Some((r, _)) if r.asker == self.me && r.owner == owner => Ok(Asked::Mine),
                Some((r, etag)) if r.asker != self.me => Ok(Asked::Theirs(etag)),
                // Our own request, but to an owner since replaced: ask the current one.
                Some((_, etag)) => {
                    self.records.update(&key, body(&request), &etag).await?;
                    Ok(Asked::Mine)
                }
                None => {
                    self.records.create(&key, body(&request)).await?;
                    Ok(Asked::Mine)
                }
            },
            Err(e) => Err(e),
        }
    }

    /// The requests addressed to this replica for any of `held`, with their ETags (one
    /// listing, then one read per request present).
    pub(in crate::pipeline) async fn addressed_to_me(
        &self,
        held: &[String],
    ) -> Result<Vec<(Request, String)>, StoreError> {
        let listed = self.records.list(&self.prefix).await?;
        let mut found = Vec::new();
        for l in listed {
            let partition = l.key.rsplit('/').next().unwrap_or_default();
            if !held.iter().any(|h| h == partition) {
                continue;
            }
            if let Some((r, etag)) = self.read(partition).await? {
                if r.owner == self.me && r.asker != self.me {
                    found.push((r, etag));
                }
            }
        }
        Ok(found)
    }

    /// Tells the asker the owner is finishing (so it waits instead of stealing).
    pub(in crate::pipeline) async fn acknowledge(
        &self,
        request: &Request,
        etag: &str,
    ) -> Result<(), StoreError> {
        let r = Request {
            stage: Stage::Releasing,
            ..request.clone()
        };
        self.records
            .update(&self.key(&request.partition), body(&r), etag)
            .await
            .map(|_| ())
    }

    /// Removes this replica's request for `partition` (it owns it now, or gave up asking).
    pub(in crate::pipeline) async fn withdraw(&self, partition: &str) {
        if let Ok(Some((r, etag))) = self.read(partition).await {
            if r.asker == self.me {
                if let Err(e) = self.records.delete(&self.key(partition), &etag).await {
                    tracing::debug!(partition, error = %e, "handover request not removed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::azure::memory::MemoryRecordStore;

    #[tokio::test]
    async fn one_asker_at_a_time_and_the_owner_sees_what_is_addressed_to_it() {
        let records: Arc<dyn RecordStore> = Arc::new(MemoryRecordStore::new());
        let a = Handovers::new(records.clone(), "hub", "$Default", "a");
        let b = Handovers::new(records.clone(), "hub", "$Default", "b");
        let owner = Handovers::new(records.clone(), "hub", "$Default", "o");
        assert!(matches!(a.ask("1", "o", None).await.unwrap(), Asked::Mine));
        assert!(matches!(a.ask("1", "o", None).await.unwrap(), Asked::Mine));
        let Asked::Theirs(etag) = b.ask("1", "o", None).await.unwrap() else {
            panic!("the second asker must leave the first one's request alone");
        };
        let seen = owner
            .addressed_to_me(&["1".into(), "2".into()])
            .await
            .unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].0.asker, "a");
        assert!(owner
            .addressed_to_me(&["2".into()])
            .await
            .unwrap()
            .is_empty());
        // A request gone stale is replaced by the next asker.
        assert!(matches!(
            b.ask("1", "o", Some(&etag)).await.unwrap(),
            Asked::Mine
        ));
        let (r, etag) = owner.read("1").await.unwrap().unwrap();
        assert_eq!(r.asker, "b");
        owner.acknowledge(&r, &etag).await.unwrap();
        assert_eq!(
            owner.read("1").await.unwrap().unwrap().0.stage,
            Stage::Releasing
        );
        a.withdraw("1").await;
        assert!(
            owner.read("1").await.unwrap().is_some(),
            "not a's to remove"
        );
        b.withdraw("1").await;
        assert!(owner.read("1").await.unwrap().is_none());
    }
}
