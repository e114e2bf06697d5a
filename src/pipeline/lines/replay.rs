//! `dead-letters replay` with ordered retries on: one ordering key's dead letters replayed as
//! a line, in sequence order.

use crate::azure::versioned::{Change, Start};
use crate::clock::ms;
use crate::ledger::{Ledger, LedgerError, LedgerRecord, Line};
use crate::pipeline::settle::{ReplayStep, Settler};

use super::{park, Park};

/// Replays the dead letters `group` — one partition's, of ordering key `key`, as read with
/// their ETags, each matching the replay's filter — in sequence order (`dead-letters replay`
/// with ordered retries on). The first becomes a retry due now and the head of a new line of
/// the key; the others are parked behind it and taken off the dead letters, so they are
/// released one after another as the head settles, exactly as a line drains. The steps:
///
/// 1. The head's record becomes a retry due now, its message not yet sent (the retry loop's
///    overdue sweep would send it): from here on the line sweep waits for its settlement
///    instead of moving its line on.
/// 2. The line opens with it as head (replacing the tombstone of the line that
///    dead-lettered them, if it is still there).
/// 3. Each other event is parked behind it, then its dead-lettered record is removed
///    (`If-Match`): a crash in between leaves it parked *and* a dead letter, and its release
///    then finds the record final and leaves it a dead letter (replay it again).
/// 4. The head's message goes to Service Bus.
///
/// A key whose line is open is left alone (its events are older than what the line holds:
/// replay them once it has drained). One step per record, the head's first.
pub(crate) async fn replay_line(
    settler: &Settler,
    key: &str,
    mut group: Vec<crate::ledger::Versioned<LedgerRecord>>,
    matches: &(dyn Fn(&LedgerRecord) -> bool + Sync),
) -> Vec<ReplayStep> {
    group.sort_by_key(|r| r.value.event.sequence_number);
    let Some(head) = group.first().map(|r| &r.value) else {
        return Vec::new();
    };
    let head = head.clone();
    if group.len() == 1 {
        return vec![replay_alone(settler, head, matches).await];
    }
    if let Some(refused) = refusal(settler, key, &group).await {
        return all(&group, &refused);
    }
    let same = |r: &LedgerRecord| {
        r.event.partition_id == head.event.partition_id
            && r.event.sequence_number == head.event.sequence_number
            && matches(r)
    };
    // 1. The head: a retry due now, its message not yet sent.
    let replayed = match settler.replay_record_if(&head.key, same).await {
        Ok(Some(r)) => r,
        Ok(None) => {
            return all(
                &group,
                &skipped(format!(
                    "the line's first event, {}, changed while it was being replayed: run the replay again",
                    head.key.escape_debug()
                )),
            )
        }
        Err(e) => return all(&group, &failed(&e)),
    };
    // 2. Its line.
    let line = Line {
        ordering_key: key.to_string(),
        partition: head.event.partition_id.clone(),
        head_key: head.key.clone(),
        head_seq: head.event.sequence_number,
        tail_seq: None,
        parked: 0,
        opened_ms: ms(settler.clock().now()),
        oldest_parked_ms: None,
        ended: false,
        head_traceparent: None,
        released_behind: None,
        drain: None,
    };
    let stopped = match open_replayed(&settler.ledger, &line).await {
        Ok(true) => None,
        Ok(false) => Some(skipped(
            "a line of its ordering key opened meanwhile: replay it once that line has drained",
        )),
        Err(e) => Some(failed(&e)),
    };
    // 3. The others, parked behind it in order, then off the dead letters.
    let rest = park_behind(settler, key, &head.key, &group[1..], stopped).await;
    // 4. The head's message.
    let first = match settler.send_replayed(&replayed).await {
        Ok(attempt) => ReplayStep::Replayed {
            key: head.key.clone(),
            attempt,
        },
        Err(e) => failed(&format!(
            "{e}; its record is due, so the retry loop's overdue sweep sends it"
        ))(head.key.clone()),
    };
    std::iter::once(first).chain(rest).collect()
}

/// What becomes of each record of a group one step stands for.
type Step = Box<dyn Fn(String) -> ReplayStep + Send>;

/// Every record of `group` skipped or failed alike.
fn all(group: &[crate::ledger::Versioned<LedgerRecord>], step: &Step) -> Vec<ReplayStep> {
    group.iter().map(|r| step(r.value.key.clone())).collect()
}

/// Skipped, for `why`.
fn skipped(why: impl Into<String>) -> Step {
    let why = why.into();
    Box::new(move |key: String| ReplayStep::Skipped {
        key,
        why: why.clone(),
    })
}

/// Failed with `e` (redacted: an error may quote a connection string).
fn failed(e: &dyn std::fmt::Display) -> Step {
    let error = crate::redact::redacted(&e.to_string());
    Box::new(move |key: String| ReplayStep::Failed {
        key,
        error: error.clone(),
    })
}

/// A line of one event is no line: it is replayed as any dead letter is.
async fn replay_alone(
    settler: &Settler,
    head: LedgerRecord,
    matches: &(dyn Fn(&LedgerRecord) -> bool + Sync),
) -> ReplayStep {
    match settler.replay_if(&head.key, matches).await {
        Ok(Some(attempt)) => ReplayStep::Replayed {
            key: head.key,
            attempt,
        },
        Ok(None) => ReplayStep::Skipped {
            key: head.key,
            why: "changed while it was being replayed".into(),
        },
        Err(e) => failed(&e)(head.key),
    }
}

/// Why the group (sorted, its head first) is not replayed as a line, if it is not: an event
/// of it is not in the ledger, or a line of its key is open.
async fn refusal(
    settler: &Settler,
    key: &str,
    group: &[crate::ledger::Versioned<LedgerRecord>],
) -> Option<Step> {
    if let Some(r) = group.iter().map(|r| &r.value).find(|r| r.event_unknown) {
        return Some(skipped(format!(
            "{} of its line has no event in the ledger: replay the line's events one by one",
            r.key.escape_debug()
        )));
    }
    let partition = &group.first()?.value.event.partition_id;
    match settler.ledger.line(partition, key).await {
        Ok(Some(l)) if !l.value.ended => Some(skipped(format!(
            "a line of its ordering key is open (head {}): replay once it has drained",
            l.value.head_key.escape_debug()
        ))),
        Ok(_) => None,
        Err(e) => Some(failed(&e)),
    }
}

/// Step 3 of [`replay_line`]: each of `others` parked behind the head `head_key`, in order,
/// then taken off the dead letters; once one cannot be parked (or the line could not be
/// opened: `stopped`), the rest come to the same.
async fn park_behind(
    settler: &Settler,
    key: &str,
    head_key: &str,
    others: &[crate::ledger::Versioned<LedgerRecord>],
    mut stopped: Option<Step>,
) -> Vec<ReplayStep> {
    let mut rest = Vec::with_capacity(others.len());
    for crate::ledger::Versioned { value: rec, etag } in others {
        if let Some(step) = &stopped {
            rest.push(step(rec.key.clone()));
            continue;
        }
        match park(settler, &rec.event, key, Some(rec)).await {
            Ok(Park::Parked { .. }) => {
                match settler.ledger.remove_dead_letter(&rec.key, etag).await {
                    Ok(_) => rest.push(ReplayStep::Parked {
                        key: rec.key.clone(),
                        behind: head_key.to_string(),
                    }),
                    Err(e) => rest.push(failed(&format!(
                    "parked, but its dead letter could not be removed ({e}): it stays a dead letter"
                ))(rec.key.clone())),
                }
            }
            Ok(Park::Deliver { .. }) => {
                let step = skipped(
                    "the line ended before it was parked (its head settled already): run the replay again",
                );
                rest.push(step(rec.key.clone()));
                stopped = Some(step);
            }
            Err(e) => {
                let step = failed(&e);
                rest.push(step(rec.key.clone()));
                stopped = Some(step);
            }
        }
    }
    rest
}

/// Opens the line of a replay: `false` when another line of the key is open. The tombstone
/// of an ended line (the one that dead-lettered these events, say) is replaced.
async fn open_replayed(ledger: &Ledger, line: &Line) -> Result<bool, LedgerError> {
    let opening = ledger.change_line(
        &line.partition,
        &line.ordering_key,
        Start::From(None),
        |current| match current {
            None => Change::Write(Box::new(line.clone()), true),
            Some(l) if l.head_key == line.head_key && l.head_seq == line.head_seq => {
                Change::Keep(true)
            }
            Some(l) if l.ended => Change::Write(Box::new(line.clone()), true),
            Some(_) => Change::Keep(false),
        },
    );
    Ok(opening.await?.value)
}
