//! Producer and consumer links: their addresses (a hub or one of its partitions; a consumer
//! group's partition), the events a producer delivers (single or batched, size-checked,
//! appended to a partition's log) and the events a consumer receives from its start position,
//! with owner-level (epoch) arbitration.

use std::sync::Arc;

use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::types::definitions::{AmqpError, Error as AmqpErrorBody, LinkError};
use fe2o3_amqp::types::messaging::Body;
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::{Receiver, Sendable, Sender};

use super::super::selector::{self, StartPosition};
use super::super::store::{self, Hub, Msg};
use super::super::Shared;
use super::{
    custom, error, message_size_exceeded, server_busy, ConnectionAuth, BATCH_FORMAT,
    DELIVERY_CHUNK, MAX_MESSAGE_SIZE,
};
use crate::emulator::sas::path_segments;

/// A consumer link address: `…/{hub}/ConsumerGroups/{cg}/Partitions/{id}`.
struct ConsumerAddress {
    hub: Arc<Hub>,
    consumer_group: String,
    partition: usize,
}

/// A producer link address: `…/{hub}` or `…/{hub}/Partitions/{id}`.
struct ProducerAddress {
    hub: Arc<Hub>,
    partition: Option<usize>,
}

fn original_segments(address: &str) -> Vec<String> {
    // Like `path_segments`, but keeps case (consumer group names are reported as given).
    let lower = path_segments(address);
    let without_scheme = address.split_once("://").map_or(address, |(_, r)| r);
    let path = if address.contains("://") {
        without_scheme.split_once('/').map_or("", |(_, p)| p)
    } else {
        without_scheme
    };
    let orig: Vec<String> = path
        .split(['?', '#'])
        .next()
        .unwrap_or("")
        .split('/')
        .filter(|s| !s.is_empty())
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        })
        .collect();
    if orig.len() == lower.len() {
        orig
    } else {
        lower
    }
}

fn parse_consumer(shared: &Shared, address: &str) -> Result<ConsumerAddress, String> {
    let segs = original_segments(address);
    let [hub, cgs, cg, parts, pid] = segs.as_slice() else {
        return Err(format!(
            "'{address}' is not a partition of a consumer group"
        ));
    };
    if !cgs.eq_ignore_ascii_case("consumergroups") || !parts.eq_ignore_ascii_case("partitions") {
        return Err(format!(
            "'{address}' is not a partition of a consumer group"
        ));
    }
    let hub = shared
        .store
        .hub(hub)
        .ok_or_else(|| format!("The messaging entity '{hub}' could not be found."))?;
    if !hub.has_consumer_group(cg) {
        return Err(format!(
            "The consumer group '{cg}' of entity '{}' could not be found.",
            hub.name
        ));
    }
    let partition = hub.partition_index(pid).ok_or_else(|| {
        format!(
            "Partition '{pid}' of entity '{}' could not be found (it has {} partitions).",
            hub.name,
            hub.partitions.len()
        )
    })?;
    Ok(ConsumerAddress {
        hub,
        consumer_group: cg.clone(),
        partition,
    })
}

fn parse_producer(shared: &Shared, address: &str) -> Result<ProducerAddress, String> {
    let segs = original_segments(address);
    let (hub, pid) = match segs.as_slice() {
        [hub] => (hub, None),
        [hub, parts, pid] if parts.eq_ignore_ascii_case("partitions") => (hub, Some(pid)),
        _ => {
            return Err(format!(
                "'{address}' is not an event hub or one of its partitions"
            ))
        }
    };
    let hub = shared
        .store
        .hub(hub)
        .ok_or_else(|| format!("The messaging entity '{hub}' could not be found."))?;
    let partition = match pid {
        None => None,
        Some(pid) => Some(hub.partition_index(pid).ok_or_else(|| {
            format!(
                "Partition '{pid}' of entity '{}' could not be found.",
                hub.name
            )
        })?),
    };
    Ok(ProducerAddress { hub, partition })
}
/// The events of one transfer: a single event, or the inner events of a batch.
fn events_of(format: Option<u32>, envelope: Msg) -> Result<(Vec<Msg>, Option<String>), String> {
    let envelope_key = store::partition_key_of(&envelope);
    if format != Some(BATCH_FORMAT) {
        return Ok((vec![envelope], envelope_key));
    }
    let Body::Data(sections) = envelope.body else {
        return Err("a batch (format 0x80013700) must carry data sections".into());
    };
    let mut events = Vec::new();
    for (i, data) in sections.into_iter().enumerate() {
        let event = store::decode(&data.0)
            .map_err(|e| format!("batch section {i} is not an AMQP message: {e}"))?;
        events.push(event);
    }
    let key = envelope_key.or_else(|| events.first().and_then(store::partition_key_of));
    Ok((events, key))
}

/// Whether a link to `address` is accepted, in Event Hubs' order: an address that names
/// no entity (`amqp:not-found`), then a missing token (`amqp:unauthorized-access`), then the
/// server-busy fault; the parsed address when it is.
fn admit<T>(
    shared: &Shared,
    auth: &ConnectionAuth,
    address: &str,
    parse: impl FnOnce(&Shared, &str) -> Result<T, String>,
) -> Result<T, AmqpErrorBody> {
    let parsed = parse(shared, address).map_err(|why| error(AmqpError::NotFound, why))?;
    if !auth.covers(address) {
        return Err(error(
            AmqpError::UnauthorizedAccess,
            format!("Unauthorized access to '{address}': put a token first"),
        ));
    }
    if shared.faults.server_busy() {
        return Err(server_busy());
    }
    Ok(parsed)
}

pub(super) async fn serve_producer(
    mut receiver: Receiver,
    address: String,
    shared: Arc<Shared>,
    auth: Arc<ConnectionAuth>,
) {
    let target = match admit(&shared, &auth, &address, parse_producer) {
        Ok(t) => t,
        Err(refusal) => {
            let _ = receiver.close_with_error(refusal).await;
            return;
        }
    };
    loop {
        let delivery = match receiver.recv::<Body<Value>>().await {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(error = ?e, address, "eventhubs emulator: producer link ended");
                break;
            }
        };
        let format = *delivery.message_format();
        let info = DeliveryInfo::from(&delivery);
        if shared.faults.server_busy() {
            if receiver.reject(info, server_busy()).await.is_err() {
                break;
            }
            continue;
        }
        let size = store::encoded_size(delivery.message());
        if size as u64 > MAX_MESSAGE_SIZE {
            tracing::info!(
                address,
                size,
                "eventhubs emulator: delivery over the size limit rejected"
            );
            let refusal = message_size_exceeded(*delivery.delivery_id(), size);
            if receiver.reject(info, refusal).await.is_err() {
                break;
            }
            continue;
        }
        let outcome = events_of(format, delivery.into_message()).and_then(|(events, key)| {
            let partition = target
                .partition
                .unwrap_or_else(|| target.hub.route(key.as_deref()));
            target.hub.partitions[partition]
                .append(events, key.as_deref())
                .map_err(|e| format!("the event could not be stored: {e}"))
        });
        let disposed = match outcome {
            Ok(()) => receiver.accept(info).await,
            Err(why) => {
                tracing::info!(address, reason = %why, "eventhubs emulator: event rejected");
                receiver
                    .reject(info, error(AmqpError::DecodeError, why))
                    .await
            }
        };
        if disposed.is_err() {
            break;
        }
    }
    let _ = receiver.close().await;
}

pub(super) async fn serve_consumer(
    mut sender: Sender,
    address: String,
    selector_expr: Option<String>,
    epoch: Option<i64>,
    shared: Arc<Shared>,
    auth: Arc<ConnectionAuth>,
) {
    let source = match admit(&shared, &auth, &address, parse_consumer) {
        Ok(s) => s,
        Err(refusal) => {
            let _ = sender.close_with_error(refusal).await;
            return;
        }
    };
    let start = match selector_expr.as_deref().map(selector::parse) {
        None => StartPosition::Latest,
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            let _ = sender
                .close_with_error(error(custom("com.microsoft:argument-error"), e.to_string()))
                .await;
            return;
        }
    };
    let (_lease, mut evicted) =
        match source
            .hub
            .admit_receiver(&source.consumer_group, source.partition, epoch)
        {
            Ok(x) => x,
            Err(stolen) => {
                let _ = sender
                    .close_with_error(error(LinkError::Stolen, stolen.0))
                    .await;
                return;
            }
        };
    let partition = &source.hub.partitions[source.partition];
    let mut tail = partition.subscribe();
    let mut next = partition.start_index(start);
    loop {
        let chunk = partition.events_from(next, DELIVERY_CHUNK);
        if chunk.is_empty() {
            tokio::select! {
                changed = tail.changed() => if changed.is_err() { break },
                stolen = &mut evicted => {
                    let why = stolen.map(|s| s.0).unwrap_or_else(|_| "receiver evicted".into());
                    let _ = sender.close_with_error(error(LinkError::Stolen, why)).await;
                    return;
                }
                _ = sender.on_detach() => break,
            }
            continue;
        }
        for event in chunk {
            let sendable = Sendable::builder()
                .message(Msg::clone(&event.message))
                .settled(true)
                .build();
            tokio::select! {
                sent = sender.send(sendable) => if sent.is_err() { let _ = sender.close().await; return },
                stolen = &mut evicted => {
                    let why = stolen.map(|s| s.0).unwrap_or_else(|_| "receiver evicted".into());
                    let _ = sender.close_with_error(error(LinkError::Stolen, why)).await;
                    return;
                }
            }
            next += 1;
        }
    }
    let _ = sender.close().await;
}
