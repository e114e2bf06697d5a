//! `GET /{queue}`: a queue's description as the management REST API answers it, an Atom
//! entry holding a `QueueDescription` (or an empty feed for a queue that does not exist).

use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::broker::{Entity, Queue};
use super::response::xml_escape;
use super::{QueueSpec, Shared};

/// `GET /{queue}`: the queue's description, as the management REST API answers it.
pub(super) fn describe(shared: &Shared, name: &str, host: &str) -> Response {
    let atom = [(
        "content-type",
        "application/atom+xml;type=entry;charset=utf-8",
    )];
    let Some(queue) = shared.broker.queue(name) else {
        // Service Bus answers a missing entity with an empty feed, not an error (the
        // official administration clients turn it into "does not exist").
        return (
            StatusCode::OK,
            [("content-type", "application/atom+xml;type=feed;charset=utf-8")],
            format!(
                "<feed xmlns=\"http://www.w3.org/2005/Atom\"><title type=\"text\">Publicly Listed Services</title><subtitle type=\"text\">This is the list of publicly-listed services currently available.</subtitle><id>uuid:{}</id><updated>{}</updated><generator>Service Bus 1.1</generator></feed>",
                uuid::Uuid::new_v4(),
                atom_time(shared.broker.clock.now())
            ),
        )
            .into_response();
    };
    let now = shared.broker.clock.now();
    let times = Times {
        now,
        created: shared.created,
    };
    // Azure's ETag of a description is its UpdatedAt in .NET ticks, unquoted (the Python
    // administration client's recording `test_mgmt_queue_get_runtime_properties_basic`).
    let etag = [("etag", ticks(shared.created).to_string())];
    let counts = Counts::of(&queue, now);
    (
        StatusCode::OK,
        atom,
        etag,
        queue_entry(&queue.spec(), host, &times, &counts),
    )
        .into_response()
}

/// An Atom `published`/`updated` time: whole seconds, as Azure writes them.
fn atom_time(t: SystemTime) -> String {
    let secs = crate::clock::ms(t) / 1000;
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

/// A description's `CreatedAt`/`UpdatedAt`/`AccessedAt`: milliseconds at most, trailing zeros
/// dropped (`2024-09-04T18:18:19.92Z`, `…19.943Z`, `…19Z`), as Azure writes them.
fn entity_time(t: SystemTime) -> String {
    let ms = crate::clock::ms(t);
    let whole = atom_time(t);
    let frac = format!("{:03}", ms % 1000);
    let frac = frac.trim_end_matches('0');
    match (frac.is_empty(), whole.strip_suffix('Z')) {
        (false, Some(base)) => format!("{base}.{frac}Z"),
        _ => whole,
    }
}

/// .NET ticks (100 ns since 0001-01-01) of a time, at the milliseconds a description shows.
fn ticks(t: SystemTime) -> i64 {
    (crate::clock::ms(t) + 62_135_596_800_000) * 10_000
}

/// The times a description carries.
struct Times {
    now: SystemTime,
    created: SystemTime,
}

/// A queue's message counts and size, as `CountDetails`, `MessageCount` and `SizeInBytes`
/// report them (active counts locked messages: they are still in the queue).
struct Counts {
    active: u64,
    dead_letter: u64,
    scheduled: u64,
    bytes: u64,
}

impl Counts {
    fn of(queue: &Queue, now: SystemTime) -> Self {
        let c = queue.counters(now);
        let bytes = [Entity::Main, Entity::DeadLetter]
            .into_iter()
            .flat_map(|e| queue.messages(e))
            .map(|m| m.body.len() as u64)
            .sum();
        Self {
            active: c.active + c.locked,
            dead_letter: c.dead_lettered,
            scheduled: c.scheduled,
            bytes,
        }
    }

    fn total(&self) -> u64 {
        self.active + self.dead_letter + self.scheduled
    }

    fn xml(&self) -> String {
        format!(
            "<CountDetails xmlns:d2p1=\"http://schemas.microsoft.com/netservices/2011/06/servicebus\"><d2p1:ActiveMessageCount>{}</d2p1:ActiveMessageCount><d2p1:DeadLetterMessageCount>{}</d2p1:DeadLetterMessageCount><d2p1:ScheduledMessageCount>{}</d2p1:ScheduledMessageCount><d2p1:TransferMessageCount>0</d2p1:TransferMessageCount><d2p1:TransferDeadLetterMessageCount>0</d2p1:TransferDeadLetterMessageCount></CountDetails>",
            self.active, self.dead_letter, self.scheduled
        )
    }
}

/// A duration as .NET writes a `TimeSpan` in XML (`PT1M`, `P7D`, `PT0.5S`).
fn xml_timespan(d: Duration) -> String {
    let secs = d.as_secs();
    let (days, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let nanos = d.subsec_nanos();
    let mut time = String::new();
    if h > 0 {
        time += &format!("{h}H");
    }
    if m > 0 {
        time += &format!("{m}M");
    }
    if s > 0 || nanos > 0 {
        if nanos > 0 {
            let frac = format!("{:07}", nanos / 100);
            time += &format!("{s}.{}S", frac.trim_end_matches('0'));
        } else {
            time += &format!("{s}S");
        }
    }
    match (days, time.is_empty()) {
        (0, true) => "PT0S".into(),
        (0, false) => format!("PT{time}"),
        (d, true) => format!("P{d}D"),
        (d, false) => format!("P{d}DT{time}"),
    }
}

/// .NET's `TimeSpan.MaxValue`, the default time to live and auto-delete interval.
const TIMESPAN_MAX: &str = "P10675199DT2H48M5.4775807S";

/// The Atom entry of a queue, in the shape of the Get Queue reference (the management REST
/// API, api-version 2021-05), from its [`QueueSpec`].
fn queue_entry(spec: &QueueSpec, host: &str, times: &Times, counts: &Counts) -> String {
    let url = format!("https://{host}/{}?api-version=2021-05", spec.name);
    let window = spec
        .duplicate_detection_window
        .unwrap_or(Duration::from_secs(600));
    let ttl = spec
        .default_ttl
        .map(xml_timespan)
        .unwrap_or_else(|| TIMESPAN_MAX.into());
    let t = atom_time(times.now);
    let (created, accessed) = (entity_time(times.created), entity_time(times.now));
    format!(
        "<entry xmlns=\"http://www.w3.org/2005/Atom\"><id>{url}</id><title type=\"text\">{name}</title><published>{t}</published><updated>{t}</updated><author><name>emulator</name></author><link rel=\"self\" href=\"{url}\"/><content type=\"application/xml\"><QueueDescription xmlns=\"http://schemas.microsoft.com/netservices/2010/10/servicebus/connect\" xmlns:i=\"http://www.w3.org/2001/XMLSchema-instance\"><LockDuration>{lock}</LockDuration><MaxSizeInMegabytes>1024</MaxSizeInMegabytes><RequiresDuplicateDetection>{requires}</RequiresDuplicateDetection><RequiresSession>false</RequiresSession><DefaultMessageTimeToLive>{ttl}</DefaultMessageTimeToLive><DeadLetteringOnMessageExpiration>{dlq}</DeadLetteringOnMessageExpiration><DuplicateDetectionHistoryTimeWindow>{window}</DuplicateDetectionHistoryTimeWindow><MaxDeliveryCount>{mdc}</MaxDeliveryCount><EnableBatchedOperations>true</EnableBatchedOperations><SizeInBytes>{bytes}</SizeInBytes><MessageCount>{count}</MessageCount><IsAnonymousAccessible>false</IsAnonymousAccessible><AuthorizationRules/><Status>Active</Status><CreatedAt>{created}</CreatedAt><UpdatedAt>{created}</UpdatedAt><AccessedAt>{accessed}</AccessedAt><SupportOrdering>true</SupportOrdering>{details}<AutoDeleteOnIdle>{max}</AutoDeleteOnIdle><EnablePartitioning>false</EnablePartitioning><EntityAvailabilityStatus>Available</EntityAvailabilityStatus><EnableExpress>false</EnableExpress><MaxMessageSizeInKilobytes>{kb}</MaxMessageSizeInKilobytes></QueueDescription></content></entry>",
        name = xml_escape(&spec.name),
        lock = xml_timespan(spec.lock_duration),
        requires = spec.duplicate_detection_window.is_some(),
        dlq = spec.dead_letter_on_expiration,
        window = xml_timespan(window),
        mdc = spec.max_delivery_count,
        max = TIMESPAN_MAX,
        kb = spec.max_message_size_kb,
        bytes = counts.bytes,
        count = counts.total(),
        details = counts.xml(),
    )
}
