//! Operational events' view of the pipeline (`opsevents::watch`): what health reports, and
//! the watcher and sender started beside the pipeline when `options.ops_events` is set.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::health::Health;
use super::Shared;
use crate::opsevents::watch::{Observed, Watched};

impl Observed for Health {
    fn dead_lettered(&self) -> u64 {
        self.snapshot().dead_lettered
    }

    fn held_for(&self) -> BTreeMap<String, (&'static str, f64)> {
        self.held_by_partition()
    }
}

/// Starts, until `stop`, the storm guard's reader (every replica shows the guard as it is,
/// work or none) and the sender and the watcher of `shared.options.ops_events`, if set.
pub(crate) fn start(shared: &Shared, stop: CancellationToken) {
    if let Some(g) = shared.downstream.storm.clone() {
        shared.observe.storm_held_series();
        tokio::spawn(g.watch(std::time::Duration::from_secs(1), stop.clone()));
    }
    let Some(events) = shared.options.ops_events.clone() else {
        return;
    };
    let source = format!(
        "/hubguard/{}/{}",
        shared.origin.hub, shared.origin.consumer_group
    );
    tokio::spawn(
        events
            .clone()
            .run_sender(source, shared.options.owner_id.clone(), stop.clone()),
    );
    let d = &shared.downstream;
    tokio::spawn(crate::opsevents::watch::run(
        events,
        Watched {
            observed: shared.health.clone() as Arc<dyn Observed>,
            downstream: d.handler.downstream(),
            breaker: d.breaker.clone(),
            limiter: d
                .limiter
                .clone()
                .map(|l| l as Arc<dyn crate::telemetry::gauges::RateLimitReadings>),
            storm: d.storm.clone(),
        },
        stop,
    ));
}
