//! Retention: delivered records deleted once kept long enough and their event settled.

use std::time::SystemTime;

use crate::azure::StoreError;

use super::{
    index::{TAG_PARTITION, TAG_SEQUENCE, TAG_STATE},
    Ledger, LedgerError,
};

/// What [`Ledger::expire`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expired {
    /// Delivered records deleted.
    pub deleted: u64,
    /// Delivered records past retention kept because their event is not settled on its
    /// partition yet (or the record does not say where its event is).
    pub kept_unsettled: u64,
}

impl Ledger {
    /// Deletes the DELIVERED records last written before `before` whose event is settled on
    /// its partition (`settled(partition, sequence number)`: at or before the partition's
    /// checkpoint, so no replica reads it again and needs the record to know it was
    /// delivered). A record that waits (RETRY_SCHEDULED) or is dead-lettered is never
    /// deleted here — a dead letter stays until it is replayed or purged — nor one whose
    /// metadata does not name its state, partition and sequence number, nor one written
    /// since the listing (the delete carries the listed ETag, `If-Match`). Deletion is free
    /// on Azure ("Azure Blob Storage pricing", azure.microsoft.com/pricing/details/storage/
    /// blobs: "Delete operations are free"); one listing of the ledger, which retention
    /// itself bounds.
    pub async fn expire(
        &self,
        before: SystemTime,
        settled: &(dyn Fn(&str, i64) -> bool + Send + Sync),
    ) -> Result<Expired, LedgerError> {
        let prefix = format!("ledger/{}", self.prefix);
        let mut out = Expired::default();
        // Page by page (one List Blobs call of at most 5,000 each): a replica holds one page,
        // however many records retention keeps.
        let mut marker: Option<String> = None;
        loop {
            let (page, next) = self.store.list_page(&prefix, marker.as_deref()).await?;
            self.expire_page(page, before, settled, &mut out).await?;
            match next {
                Some(n) => marker = Some(n),
                None => break,
            }
        }
        Ok(out)
    }

    /// [`expire`](Self::expire) over one listed page.
    async fn expire_page(
        &self,
        page: Vec<crate::azure::record_store::Listed>,
        before: SystemTime,
        settled: &(dyn Fn(&str, i64) -> bool + Send + Sync),
        out: &mut Expired,
    ) -> Result<(), LedgerError> {
        for l in page {
            if l.tags.get(TAG_STATE).map(String::as_str) != Some("DELIVERED")
                || l.last_modified.is_none_or(|t| t >= before)
            {
                continue;
            }
            let position = l
                .tags
                .get(TAG_PARTITION)
                .zip(l.tags.get(TAG_SEQUENCE).and_then(|s| s.parse::<i64>().ok()));
            match position {
                Some((p, seq)) if settled(p, seq) => {}
                _ => {
                    out.kept_unsettled += 1;
                    continue;
                }
            }
            match self.store.delete(&l.key, &l.etag).await {
                Ok(()) => out.deleted += 1,
                Err(StoreError::NotFound) | Err(StoreError::Conflict) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
