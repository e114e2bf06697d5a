//! Dead letters: the quarantined event bytes, the dead-letter index, and purging.

use std::time::SystemTime;

use bytes::Bytes;

use crate::azure::StoreError;
use crate::event::Event;
use crate::policy::{DeadLetterReason, RetryPolicy};

#[cfg(any(test, feature = "cli"))]
use super::at;
use super::{ms, Ledger, LedgerError, LedgerRecord, State};

impl Ledger {
    /// The blob name of `key`'s entry in the dead-letter index.
    pub fn dead_letter_name(&self, key: &str) -> String {
        self.blob_name("deadletters", key)
    }

    /// Sets aside a record that cannot be parsed, so it never holds its event forever: its
    /// bytes are copied to `quarantine/{hub}/{consumer group}/{name}-{ms}` for an operator,
    /// and the record is replaced (if it is still the same bytes) by a DEAD_LETTERED one with
    /// reason [`DeadLetterReason::CorruptRecord`] — for `event` when the caller has it (read
    /// from Event Hubs), else for a stand-in marked `event_unknown`. Returns the quarantine
    /// blob's name; [`StoreError::Conflict`] means the record changed meanwhile: read again.
    pub async fn quarantine(
        &self,
        key: &str,
        event: Option<&Event>,
        reason: &str,
        now: SystemTime,
    ) -> Result<String, LedgerError> {
        let name = self.record_name(key);
        let Some(raw) = self.store.read(&name).await? else {
            return Err(LedgerError::Store(StoreError::Conflict));
        };
        if serde_json::from_slice::<LedgerRecord>(&raw.body).is_ok() {
            return Err(LedgerError::Store(StoreError::Conflict)); // repaired meanwhile
        }
        let aside = format!(
            "quarantine/{}{}-{}",
            self.prefix,
            name.rsplit('/').next().unwrap_or_default(),
            ms(now)
        );
        match self.store.create(&aside, raw.body.clone()).await {
            Ok(_) | Err(StoreError::Conflict) => {}
            Err(e) => return Err(e.into()),
        }
        let stand_in = || Event {
            body: Vec::new(),
            content_type: None,
            properties: Default::default(),
            hub: String::new(),
            partition_id: String::new(),
            sequence_number: -1,
            offset: None,
            enqueued_ms: None,
            partition_key: None,
            identity: crate::event::Identity {
                idempotency_key: key.to_string(),
                correlation_id: key.to_string(),
                event_type: None,
            },
        };
        let error = format!(
            "the ledger record could not be parsed ({reason}); its bytes are kept in blob {aside}"
        );
        let record = LedgerRecord {
            key: key.to_string(),
            correlation_id: event
                .map_or_else(|| key.to_string(), |e| e.identity.correlation_id.clone()),
            event_type: event.and_then(|e| e.identity.event_type.clone()),
            state: State::DeadLettered,
            attempts: 0,
            next_attempt_ms: None,
            first_failure_ms: ms(now),
            updated_ms: ms(now),
            last_error: Some(error),
            dead_letter_reason: Some(DeadLetterReason::CorruptRecord),
            last_delay_ms: None,
            policy: RetryPolicy::seed_fibonacci(),
            attempt_base: 0,
            history: Vec::new(),
            event: event.cloned().unwrap_or_else(stand_in),
            quarantined: Some(aside.clone()),
            event_unknown: event.is_none(),
            claim: None,
            run_now: None,
            indexed: None,
        };
        self.index_dead_letter(key).await?;
        self.put(&record, Some(&raw.etag)).await?;
        tracing::error!(key = %key, quarantine = %aside, %reason, "a ledger record could not be parsed: set aside and its event dead-lettered");
        Ok(aside)
    }

    /// Marks `key` dead-lettered in the index (idempotent), before the record says so.
    pub async fn index_dead_letter(&self, key: &str) -> Result<(), LedgerError> {
        match self
            .store
            .create(
                &self.dead_letter_name(key),
                Bytes::from(key.as_bytes().to_vec()),
            )
            .await
        {
            Ok(_) | Err(StoreError::Conflict) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes `key` from the dead-letter index (after a replay).
    #[cfg(any(test, feature = "cli"))]
    pub async fn unindex_dead_letter(&self, key: &str) -> Result<(), LedgerError> {
        let name = self.dead_letter_name(key);
        let Some(r) = self.store.read(&name).await? else {
            return Ok(());
        };
        match self.store.delete(&name, &r.etag).await {
            Ok(()) | Err(StoreError::NotFound) | Err(StoreError::Conflict) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes `key`'s dead-lettered record if it still has `etag`, then its index entry
    /// (its event lives on elsewhere: an ordered replay parked it). `false` when it changed
    /// meanwhile (nothing removed).
    #[cfg(any(test, feature = "cli"))]
    pub async fn remove_dead_letter(&self, key: &str, etag: &str) -> Result<bool, LedgerError> {
        match self.store.delete(&self.record_name(key), etag).await {
            Ok(()) | Err(StoreError::NotFound) => {}
            Err(StoreError::Conflict) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        self.unindex_dead_letter(key).await?;
        Ok(true)
    }

    /// Purges `key`'s dead letter when it was last written before `before`: the record
    /// (with its ETag, so one replayed meanwhile stays), then its dead-letter index entry and
    /// its quarantined bytes. `Some(quarantine blob)` when it was (or, with `dry_run`, would
    /// be) purged; `None` when the record is no dead letter or is newer. An index entry
    /// whose record is gone is removed too.
    #[cfg(any(test, feature = "cli"))]
    pub async fn purge_dead_letter(
        &self,
        key: &str,
        before: SystemTime,
        dry_run: bool,
    ) -> Result<Option<Option<String>>, LedgerError> {
        let super::Versioned {
            value: record,
            etag,
        } = match self.get(key).await? {
            Some(found) => found,
            None => {
                if !dry_run {
                    self.unindex_dead_letter(key).await?;
                }
                return Ok(Some(None));
            }
        };
        if record.state != State::DeadLettered || at(record.updated_ms) >= before {
            return Ok(None);
        }
        if dry_run {
            return Ok(Some(record.quarantined));
        }
        match self.store.delete(&self.record_name(key), &etag).await {
            Ok(()) | Err(StoreError::NotFound) => {}
            Err(StoreError::Conflict) => return Ok(None), // changed meanwhile (a replay)
            Err(e) => return Err(e.into()),
        }
        self.unindex_dead_letter(key).await?;
        if let Some(aside) = &record.quarantined {
            self.store.remove(aside).await?;
        }
        Ok(Some(record.quarantined))
    }

    /// Keys in the dead-letter index.
    #[cfg(any(test, feature = "cli"))]
    pub async fn dead_letter_keys(&self) -> Result<Vec<String>, LedgerError> {
        let prefix = format!("deadletters/{}", self.prefix);
        // An index entry's body is its key.
        self.listed_keys(&prefix, |body| String::from_utf8(body.to_vec()).ok())
            .await
    }

    /// The dead-letter index as listed: each key with its entry's ETag, which changes when
    /// the key is replayed and dead-lettered again (so a reader may keep what it read of a
    /// record while the ETag stands). One listing; a digest-named entry's body is read.
    #[cfg(any(test, feature = "cli"))]
    pub async fn dead_letter_entries(&self) -> Result<Vec<(String, String)>, LedgerError> {
        let prefix = format!("deadletters/{}", self.prefix);
        let mut out = Vec::new();
        for l in self.store.list(&prefix).await? {
            let Some(encoded) = l.key.strip_prefix(&prefix) else {
                continue;
            };
            let key = if encoded.starts_with('~') {
                match self.store.read(&l.key).await? {
                    Some(r) => String::from_utf8(r.body.to_vec()).ok(),
                    None => None,
                }
            } else {
                super::decode_key(encoded)
            };
            out.extend(key.map(|k| (k, l.etag)));
        }
        Ok(out)
    }
}
