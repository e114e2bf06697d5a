//! One owner id, one live process.
//!
//! The Event Hubs processor's load balancing knows replicas only by their owner id: every
//! ownership blob naming that id counts as "mine". Two live processes with one
//! `processor.owner_id` (a copy-pasted deployment, a fixed id in a ConfigMap or an
//! environment variable shared by every pod) therefore both claim every partition, steal
//! each other's receiver links and deliver the same events twice, with nothing to notice.
//!
//! So each process also holds an *owner record* beside the ledger: `owners/{hub}/{consumer
//! group}/{owner id}`, naming the instance that uses the id (a random instance id, the host
//! and the start time), renewed with compare-and-swap at every load-balancing cycle. A
//! process whose owner id is held by another instance that keeps renewing it claims no
//! partition at all, and its readiness names the id and the other instance; the first one
//! keeps working. A record nobody renewed for the ownership expiration belongs to a process
//! that is gone (a restart after a crash): it is taken over, as the partitions' ownerships
//! expire at the same pace. A graceful stop deletes the record, so a restart is immediate.
//!
//! Staleness is judged on this process's own monotonic clock (the record's ETag did not
//! change for that long), never by comparing two hosts' wall clocks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::azure::{RecordStore, StoreError};
use crate::pipeline::health::Health;

/// Who uses an owner id, as its owner record says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerInstance {
    /// The owner id.
    pub owner_id: String,
    /// A random id of the process (new at every start).
    pub instance: String,
    /// The host it runs on (`HOSTNAME`: the pod name on Kubernetes), if known.
    #[serde(default)]
    pub host: Option<String>,
    /// When it started (RFC 3339).
    pub started: String,
}

impl std::fmt::Display for OwnerInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "instance {}", self.instance)?;
        if let Some(h) = &self.host {
            write!(f, " on host {h}")?;
        }
        write!(f, ", started {}", self.started)
    }
}

#[derive(Debug)]
enum LeaseState {
    /// Not known yet (nothing read, or a lost race to create the record).
    Unknown,
    /// This instance holds the owner id; the record's ETag as last written.
    Held { etag: String },
    /// Another instance holds it: the record's ETag as read, and since when it is unchanged.
    Other {
        etag: String,
        unchanged_since: Instant,
    },
}

/// This process's hold on its owner id (see the module's documentation).
pub(in crate::pipeline) struct OwnerLease {
    records: Arc<dyn RecordStore>,
    key: String,
    me: OwnerInstance,
    expiration: Duration,
    state: Mutex<LeaseState>,
    health: Arc<Health>,
}

impl std::fmt::Debug for OwnerLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerLease")
            .field("key", &self.key)
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

/// Where the owner record of `owner_id` lives: the id itself when it is short and plain,
/// else its digest (blob names are at most 1,024 characters).
pub fn record_name(hub: &str, consumer_group: &str, owner_id: &str) -> String {
    let plain = !owner_id.is_empty()
        && owner_id.len() <= 200
        && !owner_id.starts_with('~')
        && owner_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    let id = if plain {
        owner_id.to_string()
    } else {
        crate::event::key_digest(owner_id)
    };
    format!("owners/{hub}/{}/{id}", consumer_group.to_ascii_lowercase())
}

impl OwnerLease {
    /// The hold of this process (a fresh instance id) on `owner_id` for `hub` and
    /// `consumer_group`, in `records`; a holder silent for `expiration` is gone.
    pub(in crate::pipeline) fn new(
        records: Arc<dyn RecordStore>,
        hub: &str,
        consumer_group: &str,
        owner_id: &str,
        expiration: Duration,
        health: Arc<Health>,
    ) -> Self {
        let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty());
        Self {
            records,
            key: record_name(hub, consumer_group, owner_id),
            me: OwnerInstance {
                owner_id: owner_id.to_string(),
                instance: uuid::Uuid::new_v4().to_string(),
                host,
                started: crate::clock::rfc3339(std::time::SystemTime::now()),
            },
            expiration,
            state: Mutex::new(LeaseState::Unknown),
            health,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LeaseState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn body(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(&self.me).unwrap_or_default())
    }

    /// Whether this instance holds its owner id (as last checked): only then may it claim
    /// partitions.
    pub(in crate::pipeline) fn holds(&self) -> bool {
        matches!(*self.state(), LeaseState::Held { .. })
    }

    /// Renews the hold, or takes the id if nobody holds it (or its holder is gone); returns
    /// whether this instance holds it. Called at every load-balancing cycle. A storage
    /// failure changes nothing (the verdict stays what it was).
    pub(in crate::pipeline) async fn check(&self) -> bool {
        if let Some(holds) = self.renew().await {
            return holds;
        }
        let read = match self.records.read(&self.key).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(owner_id = %self.me.owner_id, error = %e, "could not read the owner record");
                if !self.holds() {
                    self.health.set_owner_conflict(Some(format!(
                        "owner id `{}`: this instance ({}) cannot read its owner record ({e}) and claims no partition until it can",
                        self.me.owner_id, self.me.instance
                    )));
                }
                return self.holds();
            }
        };
        let Some(record) = read else {
            return match self.records.create(&self.key, self.body()).await {
                Ok(etag) => self.now_held(etag, None),
                Err(e) => {
                    // Lost the race to another instance (Conflict), or storage failed: look
                    // again at the next cycle; claim nothing meanwhile.
                    tracing::debug!(owner_id = %self.me.owner_id, error = %e, "owner record not created");
                    *self.state() = LeaseState::Unknown;
                    self.report_unknown();
                    false
                }
            };
        };
        let holder: Option<OwnerInstance> = serde_json::from_slice(&record.body).ok();
        if holder
            .as_ref()
            .is_some_and(|h| h.instance == self.me.instance)
        {
            return self.now_held(record.etag, None);
        }
        // Another instance's record: gone if its ETag stayed the same for the expiration.
        let gone = match &*self.state() {
            LeaseState::Other {
                etag,
                unchanged_since,
                ..
            } => *etag == record.etag && unchanged_since.elapsed() >= self.expiration,
            _ => false,
        };
        if gone {
            match self
                .records
                .update(&self.key, self.body(), &record.etag)
                .await
            {
                Ok(etag) => return self.now_held(etag, holder),
                Err(e) => {
                    tracing::debug!(owner_id = %self.me.owner_id, error = %e, "owner record not taken over");
                }
            }
            *self.state() = LeaseState::Unknown;
            self.report_unknown();
            return false;
        }
        self.held_by_another(record.etag, holder.as_ref())
    }

    /// The renewal of a hold: `Some` verdict when it settles the check (renewed, or storage
    /// failed and the verdict stays), `None` when this instance does not hold the id (any
    /// more) as far as it knows and the record must be read.
    async fn renew(&self) -> Option<bool> {
        let held = match &*self.state() {
            LeaseState::Held { etag } => Some(etag.clone()),
            _ => None,
        };
        if let Some(etag) = held {
            match self.records.update(&self.key, self.body(), &etag).await {
                Ok(etag) => {
                    *self.state() = LeaseState::Held { etag };
                    return Some(true);
                }
                Err(StoreError::Conflict | StoreError::NotFound) => {
                    // Someone wrote it (took it over while we could not renew) or deleted
                    // it: claim nothing until a read says who holds it now.
                    *self.state() = LeaseState::Unknown;
                }
                Err(e) => {
                    tracing::warn!(owner_id = %self.me.owner_id, error = %e, "could not renew this instance's owner record");
                    return Some(true);
                }
            }
        }
        None
    }

    /// Another instance, `holder`, holds the owner id and its record (ETag `etag`) is not
    /// stale: remembers since when the record is unchanged, reports the conflict (logged at
    /// first sight) and claims nothing.
    fn held_by_another(&self, etag: String, holder: Option<&OwnerInstance>) -> bool {
        let (since, first_sight) = {
            let mut st = self.state();
            let since = match &*st {
                LeaseState::Other {
                    etag: seen,
                    unchanged_since,
                    ..
                } if *seen == etag => Some(*unchanged_since),
                _ => None,
            };
            let first_sight = !matches!(&*st, LeaseState::Other { .. });
            *st = LeaseState::Other {
                etag,
                unchanged_since: since.unwrap_or_else(Instant::now),
            };
            (since, first_sight)
        };
        let silent_for = since.map_or(Duration::ZERO, |t| t.elapsed());
        let reason = self.conflict(holder, silent_for);
        if first_sight {
            tracing::error!(owner_id = %self.me.owner_id, instance = %self.me.instance, "{reason}");
        }
        self.health.set_owner_conflict(Some(reason));
        false
    }

    fn now_held(&self, etag: String, taken_from: Option<OwnerInstance>) -> bool {
        let was = std::mem::replace(&mut *self.state(), LeaseState::Held { etag });
        if let Some(from) = taken_from {
            tracing::warn!(owner_id = %self.me.owner_id, instance = %self.me.instance, previous = %from, "took over the owner id: its previous instance stopped renewing it");
        } else if !matches!(was, LeaseState::Held { .. }) {
            tracing::info!(owner_id = %self.me.owner_id, instance = %self.me.instance, "this instance holds its owner id");
        }
        self.health.set_owner_conflict(None);
        true
    }

    fn report_unknown(&self) {
        self.health.set_owner_conflict(Some(format!(
            "owner id `{}`: this instance ({}) does not hold it yet and claims no partition",
            self.me.owner_id, self.me.instance
        )));
    }

    fn conflict(&self, holder: Option<&OwnerInstance>, silent_for: Duration) -> String {
        let other = holder.map_or_else(
            || "an instance whose owner record cannot be read".to_string(),
            ToString::to_string,
        );
        format!(
            "owner id `{}` is held by another process ({other}), whose record last changed {}s ago as seen from here; this one ({}) claims no partition until that one stops (a graceful stop hands the id over at once) or leaves it unrenewed for {}s (a crash). Two live processes with one owner id would both read every partition: every replica needs its own processor.owner_id — leave it unset (a random id per process) or set it to the pod name",
            self.me.owner_id,
            silent_for.as_secs(),
            self.me,
            self.expiration.as_secs()
        )
    }

    /// How many processes hold owner records of this hub and consumer group renewed within
    /// `within` (as blob storage's last-modified times say, against blob storage's measured time: an
    /// estimate, used only to share unowned partitions at start-up).
    pub(in crate::pipeline) async fn live_instances(
        &self,
        within: Duration,
    ) -> Result<usize, StoreError> {
        let prefix = self
            .key
            .rsplit_once('/')
            .map_or(String::new(), |(p, _)| format!("{p}/"));
        // Last-Modified is blob storage's time: judged on blob storage's clock as measured.
        let now = self
            .health
            .clock()
            .service_now(crate::clock::Service::BlobStorage);
        Ok(self
            .records
            .list(&prefix)
            .await?
            .iter()
            .filter(|l| {
                l.last_modified
                    .is_some_and(|t| now.duration_since(t).unwrap_or_default() < within)
            })
            .count())
    }

    /// Gives the owner id up (graceful stop), so a restart need not wait for the expiration.
    pub(in crate::pipeline) async fn release(&self) {
        let etag = match std::mem::replace(&mut *self.state(), LeaseState::Unknown) {
            LeaseState::Held { etag } => etag,
            _ => return,
        };
        if let Err(e) = self.records.delete(&self.key, &etag).await {
            tracing::warn!(owner_id = %self.me.owner_id, error = %e, "could not delete the owner record; it will expire");
        }
    }

    /// This instance, as its record names it.
    #[cfg(test)]
    pub(in crate::pipeline) fn me(&self) -> &OwnerInstance {
        &self.me
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::azure::memory::MemoryRecordStore;

    fn lease(records: &Arc<MemoryRecordStore>, health: &Arc<Health>) -> OwnerLease {
        OwnerLease::new(
            records.clone(),
            "hub",
            "$Default",
            "replica-a",
            Duration::from_secs(20),
            health.clone(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn the_second_live_instance_of_an_owner_id_holds_nothing_until_the_first_is_gone() {
        let records = Arc::new(MemoryRecordStore::new());
        let (ha, hb) = (Arc::new(Health::default()), Arc::new(Health::default()));
        let (a, b) = (lease(&records, &ha), lease(&records, &hb));
        assert!(a.check().await, "the first instance takes the id");
        assert!(!b.check().await, "the second refuses it");
        let why = hb.not_ready_reasons().join("; ");
        assert!(
            why.contains("replica-a") && why.contains(&a.me().instance),
            "{why}"
        );
        assert!(ha
            .not_ready_reasons()
            .iter()
            .all(|r| !r.contains("owner id")));
        // While the first renews, the second never takes it, however long.
        for _ in 0..10 {
            tokio::time::advance(Duration::from_secs(5)).await;
            assert!(a.check().await);
            assert!(!b.check().await);
        }
        // The first dies (no renewal): after the expiration the second takes over.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(!b.check().await, "not yet: renewed 5 s ago");
        tokio::time::advance(Duration::from_secs(16)).await;
        assert!(b.check().await, "the silent holder is gone");
        assert!(hb
            .not_ready_reasons()
            .iter()
            .all(|r| !r.contains("owner id")));
        // The first comes back from its pause: it has lost the id and claims nothing.
        assert!(!a.check().await);
        assert!(ha.not_ready_reasons().join(" ").contains(&b.me().instance));
    }

    #[tokio::test(start_paused = true)]
    async fn a_graceful_stop_hands_the_id_over_at_once() {
        let records = Arc::new(MemoryRecordStore::new());
        let health = Arc::new(Health::default());
        let a = lease(&records, &health);
        assert!(a.check().await);
        a.release().await;
        let restarted = lease(&records, &health);
        assert!(restarted.check().await, "no wait after a graceful stop");
    }

    #[test]
    fn record_names_stay_within_blob_limits() {
        assert_eq!(
            record_name("hub", "$Default", "pod-7"),
            "owners/hub/$default/pod-7"
        );
        let odd = record_name("hub", "$Default", &"é/..".repeat(500));
        assert!(odd.len() < 200 && odd.contains('~'), "{odd}");
    }
}
