//! `hubguard demo`: everything in one process on the embedded emulators — Event Hubs, Service
//! Bus, Blob storage, a webhook receiver that misbehaves as told, a producer, and hubguard
//! replicas — with policies scaled down so the whole story fits in about a minute: transient
//! and permanent failures, a downstream outage, a Service Bus outage (a held partition),
//! replica crashes. Then it verifies, independently of hubguard's own counters, that nothing
//! was lost: every event the producer sent was delivered (the receiver saw a 2xx) or
//! dead-lettered (the ledger says so).
//!
//! - `args`: the options ([`DemoArgs`]) and the windows they are written in.
//! - `bed`: the emulators, the misbehaving downstream, the replicas and their parts.
//! - `script`: what happens when — producing, outages, crashes — and when it ends.
//! - `report`: the progress drawn each second, the [`Report`] and its table.
//! - [`verify`]: the independent checks the report runs on what the emulators recorded.

use std::time::Instant;

mod args;
mod bed;
mod report;
mod script;
pub mod verify;

pub use args::{parse_duration, windows_text, DemoArgs, DurationError, Every, Outage, Window};
pub use report::{print_table, Report};

/// Runs the demo and returns its report; `progress` receives one line per second.
pub async fn run(args: &DemoArgs, mut progress: impl FnMut(&str)) -> anyhow::Result<Report> {
    args.validate()?;
    let started = Instant::now();
    let bed = bed::Bed::start(args).await?;
    let ending = script::play(&bed, args, started, &mut progress).await?;
    let (report, records) = report::gather(
        &bed,
        args,
        &ending.keys,
        ending.crashes,
        &ending.replicas,
        started,
    )
    .await?;
    if !args.json {
        report::tell_one_retry(&records, &mut progress);
    }
    Ok(report)
}
