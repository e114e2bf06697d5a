//! The test bed's event producer: sends events to a hub through the real SDK's
//! `ProducerClient`, in batches addressed to one partition each, going round the partitions,
//! optionally spread over a duration. The demo and the bench produce through it.
//!
//! A [`Plan`] says how many events go where and when; a function of the event's index says
//! what each one carries ([`Outgoing`]: its key, body and properties).

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use azure_messaging_eventhubs::models::{AmqpSimpleValue, EventData};
use azure_messaging_eventhubs::{EventDataBatchOptions, ProducerClient};

use crate::azure::ConnectionString;

/// The application property an event's key is sent in: the first of hubguard's default
/// idempotency key properties.
pub const KEY_PROPERTY: &str = "ce_id";

/// One event to send.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outgoing {
    /// Its key, sent as the [`KEY_PROPERTY`] application property and listed in
    /// [`Produced::keys`]; `None`: no key.
    pub key: Option<String>,
    /// The body.
    pub body: Vec<u8>,
    /// The AMQP content type, if any.
    pub content_type: Option<String>,
    /// Further string application properties.
    pub properties: Vec<(String, String)>,
}

impl Outgoing {
    /// An event of `size` bytes (`x`s), with no key and no properties.
    pub fn filler(size: usize) -> Self {
        Self {
            body: vec![b'x'; size],
            ..Default::default()
        }
    }

    /// An event with key `key` and body `body`.
    pub fn keyed(key: impl Into<String>, body: impl Into<Vec<u8>>) -> Self {
        Self {
            key: Some(key.into()),
            body: body.into(),
            ..Default::default()
        }
    }

    /// With content type `content_type`.
    pub fn content_type(mut self, content_type: &str) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// With the string application property `name` = `value`.
    pub fn property(mut self, name: &str, value: impl Into<String>) -> Self {
        self.properties.push((name.into(), value.into()));
        self
    }

    /// The SDK's event, and the key.
    fn into_event_data(self) -> (EventData, Option<String>) {
        let mut b = EventData::builder().with_body(self.body);
        if let Some(ct) = self.content_type {
            b = b.with_content_type(ct);
        }
        if let Some(key) = &self.key {
            b = b.add_property(KEY_PROPERTY.into(), AmqpSimpleValue::String(key.clone()));
        }
        for (name, value) in self.properties {
            b = b.add_property(name, AmqpSimpleValue::String(value));
        }
        (b.build(), self.key)
    }
}

/// The passes spread over time: the `k`-th of `passes` does not end before `k / passes` of
/// `over` (after the producer opened).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread {
    /// How many passes (all of them run, even once every event is sent).
    pub passes: usize,
    /// Over how long.
    pub over: Duration,
}

/// How many events go to which partition, and when.
///
/// The producer goes round the partitions in passes, giving each partition up to
/// [`per_pass`](Self::per_pass) events (in as many batches as they need, one partition per
/// batch), events numbered from 0 in the order they are sent, until all are sent (or, with a
/// [`Spread`], for its number of passes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The hub.
    pub hub: String,
    /// Events to send.
    pub events: usize,
    /// Partitions `0..partitions` to send them to.
    pub partitions: usize,
    /// Events per partition in one pass.
    pub per_pass: usize,
    /// Spread the passes over time (`None`: as fast as the hub takes them).
    pub spread: Option<Spread>,
    /// Give up on a batch's send after this long (`None`: wait).
    pub send_timeout: Option<Duration>,
}

impl Plan {
    /// One pass: partition 0 gets its share (`events / partitions`, rounded up), then
    /// partition 1, and so on.
    pub fn partition_by_partition(hub: &str, events: usize, partitions: usize) -> Self {
        Self::round_robin(hub, events, partitions, events.div_ceil(partitions.max(1)))
    }

    /// `per_pass` events to each partition in turn, round and round.
    pub fn round_robin(hub: &str, events: usize, partitions: usize, per_pass: usize) -> Self {
        Self {
            hub: hub.into(),
            events,
            partitions,
            per_pass,
            spread: None,
            send_timeout: None,
        }
    }

    /// Spread evenly over `over` in `passes` passes (each pass a `passes`-th of the events,
    /// shared among the partitions).
    pub fn spread(
        hub: &str,
        events: usize,
        partitions: usize,
        passes: usize,
        over: Duration,
    ) -> Self {
        let per_pass = events.div_ceil(passes.max(1)).div_ceil(partitions.max(1));
        Self {
            spread: Some(Spread { passes, over }),
            ..Self::round_robin(hub, events, partitions, per_pass)
        }
    }

    /// Each batch's send fails after `timeout`.
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = Some(timeout);
        self
    }
}

/// What the producer sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Produced {
    /// Events sent.
    pub sent: usize,
    /// The keys of the events that had one, in the order sent.
    pub keys: Vec<String>,
    /// From the producer opening to the last send's acknowledgement (closing excluded).
    pub elapsed: Duration,
}

/// Sends the events of `plan` to the hub at `cs`; `event(n)` is the `n`-th event's content
/// (called again for the same `n` when that event did not fit in a full batch: it must
/// return the same event). Closing the producer is best effort (every batch was acknowledged
/// by then).
pub async fn produce(
    cs: &ConnectionString,
    plan: &Plan,
    mut event: impl FnMut(usize) -> Outgoing,
) -> anyhow::Result<Produced> {
    if plan.events > 0 && (plan.partitions == 0 || plan.per_pass == 0) {
        bail!("producing needs at least one partition and one event per pass");
    }
    let producer = cs
        .open_producer(ProducerClient::builder(), &plan.hub)
        .await
        .context("opening the producer")?;
    let started = Instant::now();
    let mut out = Produced::default();
    let mut pass = 0usize;
    loop {
        let more = match plan.spread {
            Some(s) => pass < s.passes,
            None => out.sent < plan.events,
        };
        if !more {
            break;
        }
        for p in 0..plan.partitions {
            let target = (out.sent + plan.per_pass).min(plan.events);
            while out.sent < target {
                let batch = producer
                    .create_batch(Some(EventDataBatchOptions {
                        partition_id: Some(p.to_string()),
                        ..Default::default()
                    }))
                    .await?;
                let mut added = 0usize;
                while out.sent < target {
                    let (ev, key) = event(out.sent).into_event_data();
                    if !batch.try_add_event_data(ev, None)? {
                        break;
                    }
                    out.keys.extend(key);
                    out.sent += 1;
                    added += 1;
                }
                if added == 0 {
                    bail!("event {} does not fit in an empty batch", out.sent);
                }
                let send = producer.send_batch(batch, None);
                match plan.send_timeout {
                    Some(t) => tokio::time::timeout(t, send)
                        .await
                        .context("sending to Event Hubs timed out")??,
                    None => send.await?,
                }
            }
        }
        pass += 1;
        if let Some(s) = plan.spread {
            let next = s.over.mul_f64(pass as f64 / s.passes as f64);
            tokio::time::sleep(next.saturating_sub(started.elapsed())).await;
        }
    }
    out.elapsed = started.elapsed();
    match tokio::time::timeout(Duration::from_secs(5), producer.close()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "closing the producer failed"),
        Err(_) => tracing::warn!("closing the producer timed out"),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};

    #[test]
    fn plans_share_the_events() {
        let p = Plan::partition_by_partition("h", 10, 4);
        assert_eq!((p.per_pass, p.spread), (3, None));
        let p = Plan::spread("h", 400, 4, 10, Duration::from_secs(30));
        assert_eq!(p.per_pass, 10);
        assert_eq!(p.spread.map(|s| s.passes), Some(10));
        assert_eq!(
            Plan::round_robin("h", 7, 2, 500).send_timeout(Duration::from_secs(1)),
            Plan {
                hub: "h".into(),
                events: 7,
                partitions: 2,
                per_pass: 500,
                spread: None,
                send_timeout: Some(Duration::from_secs(1)),
            }
        );
    }

    #[tokio::test]
    async fn events_go_round_the_partitions_in_order() {
        let emu = EventHubsEmulator::start(EventHubsConfig {
            hubs: vec![HubSpec::new("h", 3)],
            ..Default::default()
        })
        .await
        .unwrap();
        let cs: ConnectionString = emu.connection_string().parse().unwrap();
        // 2 per partition per pass: p0 gets 0,1,6,7; p1 2,3,8,9; p2 4,5,10.
        let produced = produce(&cs, &Plan::round_robin("h", 11, 3, 2), |n| {
            Outgoing::keyed(format!("k-{n}"), format!("{{\"n\":{n}}}"))
                .content_type("application/json")
                .property("ce_type", if n.is_multiple_of(2) { "even" } else { "odd" })
        })
        .await
        .unwrap();
        assert_eq!(produced.sent, 11);
        assert_eq!(
            produced.keys,
            (0..11).map(|n| format!("k-{n}")).collect::<Vec<_>>()
        );
        let hub = emu.store().hub("h").unwrap();
        let keys = |p: usize| -> Vec<String> {
            hub.partitions[p]
                .events_from(0, usize::MAX)
                .iter()
                .map(|e| e.string_property(KEY_PROPERTY).unwrap())
                .collect()
        };
        assert_eq!(keys(0), ["k-0", "k-1", "k-6", "k-7"]);
        assert_eq!(keys(1), ["k-2", "k-3", "k-8", "k-9"]);
        assert_eq!(keys(2), ["k-4", "k-5", "k-10"]);
        let none = produce(&cs, &Plan::partition_by_partition("h", 0, 3), |_| {
            Outgoing::filler(1)
        })
        .await
        .unwrap();
        assert_eq!(none.sent, 0);
        let first = &hub.partitions[2].events_from(2, 1)[0];
        assert_eq!(first.string_property("ce_type").as_deref(), Some("even"));
        let m = &first.message;
        assert_eq!(
            m.properties
                .as_ref()
                .and_then(|p| p.content_type.as_ref())
                .map(|c| c.0.as_str()),
            Some("application/json")
        );
        emu.shutdown().await;
    }
}
