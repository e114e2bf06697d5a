//! Shared helpers: start an emulator on port 0, open real SDK clients against it, put a
//! deadline on every await so a hang fails the test instead of stalling the run, and wait on
//! a condition with [`eventually`] (the one place a test waits by polling).

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use azure_messaging_eventhubs::models::ReceivedEventData;
use azure_messaging_eventhubs::{
    ConsumerClient, EventReceiver, OpenReceiverOptions, ProducerClient, StartLocation,
    StartPosition,
};
use futures::StreamExt;
use hubguard::azure::ConnectionString;
use hubguard::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};

/// The deadline for any single step of a test.
pub(crate) const STEP: Duration = Duration::from_secs(30);

/// Awaits `f` or panics naming `what` after [`STEP`].
pub(crate) async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(STEP, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {STEP:?}"),
    }
}

/// How often [`eventually`] checks again when nothing wakes it sooner.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// What a check of [`eventually`] answers: done, with what it found, or not yet, with what
/// it saw (the failure message shows the last of these).
pub(crate) trait Check {
    /// What the wait returns once the check holds.
    type Found;
    /// `Ok(found)` when done, `Err(what was seen)` when not yet.
    fn verdict(self) -> Result<Self::Found, String>;
}

impl Check for bool {
    type Found = ();
    fn verdict(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err("false".into())
        }
    }
}

impl<T> Check for Option<T> {
    type Found = T;
    fn verdict(self) -> Result<T, String> {
        self.ok_or_else(|| "None".into())
    }
}

impl<T, E: Debug> Check for Result<T, E> {
    type Found = T;
    fn verdict(self) -> Result<T, String> {
        self.map_err(|seen| format!("{seen:#?}"))
    }
}

/// Text shown as it is in a failure message (a report, a log), not quoted and escaped.
pub(crate) struct Text(pub String);

impl Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `Ok(value)` if `done(&value)`, else `Err(value)`: a check that reports what it saw.
pub(crate) fn seen<V>(value: V, done: impl FnOnce(&V) -> bool) -> Result<V, V> {
    if done(&value) {
        Ok(value)
    } else {
        Err(value)
    }
}

/// Waits until `check` holds, checking again every [`POLL`], and returns what it found;
/// panics after `limit` naming `what` and the last thing the check saw. For a wait that
/// also wakes on a signal, or polls at another pace, see [`Wait`].
pub(crate) async fn eventually<C, Fut>(
    what: &str,
    limit: Duration,
    check: impl FnMut() -> Fut,
) -> C::Found
where
    C: Check,
    Fut: Future<Output = C>,
{
    Wait::new(what, limit).until(check).await
}

/// A bounded wait on a condition: what it waits for, how long at most, how often it checks
/// again, and what wakes it sooner (a change the code under test publishes).
pub(crate) struct Wait<'a> {
    what: &'a str,
    limit: Duration,
    every: Duration,
    wakes: Pin<Box<dyn futures::Stream<Item = ()> + Send + 'a>>,
}

impl<'a> Wait<'a> {
    /// Waits for `what` for at most `limit`, checking every [`POLL`].
    pub(crate) fn new(what: &'a str, limit: Duration) -> Self {
        Self {
            what,
            limit,
            every: POLL,
            wakes: Box::pin(futures::stream::pending()),
        }
    }

    /// Checks every `every` instead.
    pub(crate) fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// Also checks whenever `wakes` yields (and stops listening when it ends).
    pub(crate) fn woken_by(mut self, wakes: impl futures::Stream<Item = ()> + Send + 'a) -> Self {
        self.wakes = Box::pin(wakes.chain(futures::stream::pending()));
        self
    }

    /// Waits until `check` holds and returns what it found, or panics naming what it
    /// waited for and the last thing the check saw.
    pub(crate) async fn until<C, Fut>(mut self, mut check: impl FnMut() -> Fut) -> C::Found
    where
        C: Check,
        Fut: Future<Output = C>,
    {
        let deadline = tokio::time::Instant::now() + self.limit;
        loop {
            let last = match check().await.verdict() {
                Ok(found) => return found,
                Err(last) => last,
            };
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {:?} waiting for: {}; last seen: {last}",
                self.limit,
                self.what
            );
            tokio::select! {
                _ = self.wakes.next() => {}
                _ = tokio::time::sleep(self.every) => {}
            }
        }
    }
}

/// Yields whenever the value `rx` watches changes (for [`Wait::woken_by`]).
pub(crate) fn changes<T: Send + Sync + 'static>(
    rx: tokio::sync::watch::Receiver<T>,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.changed().await.ok()?;
        Some(((), rx))
    })
}

/// Starts an emulator with the given hubs on a free port (memory only).
pub(crate) async fn emulator(hubs: &[(&str, usize)]) -> EventHubsEmulator {
    emulator_with(EventHubsConfig {
        hubs: hubs.iter().map(|(n, p)| HubSpec::new(*n, *p)).collect(),
        ..Default::default()
    })
    .await
}

/// Starts an emulator with a full configuration.
pub(crate) async fn emulator_with(config: EventHubsConfig) -> EventHubsEmulator {
    hubguard::azure::install_crypto_provider();
    EventHubsEmulator::start(config)
        .await
        .expect("emulator starts")
}

/// The emulator's connection string, parsed.
pub(crate) fn conn(emu: &EventHubsEmulator) -> ConnectionString {
    emu.connection_string()
        .parse()
        .expect("valid connection string")
}

/// A producer for `hub`, authenticated by the connection string (the SDK's own
/// connection-string credential: SAS tokens under `servicebus.windows.net:sastoken`).
pub(crate) async fn producer(cs: &ConnectionString, hub: &str) -> ProducerClient {
    within(
        "open producer",
        cs.open_producer(ProducerClient::builder(), hub),
    )
    .await
    .expect("producer opens")
}

/// A consumer for `hub` in `$Default`.
pub(crate) async fn consumer(cs: &ConnectionString, hub: &str) -> ConsumerClient {
    consumer_in(cs, hub, None).await
}

/// A consumer for `hub` in a consumer group.
pub(crate) async fn consumer_in(
    cs: &ConnectionString,
    hub: &str,
    group: Option<&str>,
) -> ConsumerClient {
    let mut b = ConsumerClient::builder();
    if let Some(g) = group {
        b = b.with_consumer_group(g.to_string());
    }
    within("open consumer", cs.open_consumer(b, hub))
        .await
        .expect("consumer opens")
}

/// Opens a receiver on `partition` starting at `location`.
pub(crate) async fn receiver(
    consumer: &ConsumerClient,
    partition: &str,
    location: StartLocation,
    inclusive: bool,
) -> EventReceiver {
    within(
        "open receiver",
        consumer.open_receiver_on_partition(
            partition.to_string(),
            Some(OpenReceiverOptions {
                start_position: Some(StartPosition {
                    location,
                    inclusive,
                }),
                ..Default::default()
            }),
        ),
    )
    .await
    .expect("receiver opens")
}

/// Receives exactly `n` events (each within [`STEP`]).
pub(crate) async fn take(receiver: &EventReceiver, n: usize) -> Vec<ReceivedEventData> {
    let stream = receiver.stream_events();
    futures::pin_mut!(stream);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let next = within(&format!("event {} of {n}", out.len() + 1), stream.next()).await;
        match next {
            Some(Ok(ev)) => out.push(ev),
            Some(Err(e)) => panic!("receive failed after {} events: {e:?}", out.len()),
            None => panic!("stream ended after {} events", out.len()),
        }
    }
    out
}

/// The body of an event as text.
pub(crate) fn body(ev: &ReceivedEventData) -> String {
    String::from_utf8(ev.event_data().body().expect("one data section").to_vec())
        .expect("utf-8 body")
}

/// A minimal HTTP/1.1 client (one request per connection) for the admin endpoint and the
/// status API: the status code and the body.
pub(crate) async fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = within("http connect", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = String::new();
    within("http response", s.read_to_string(&mut resp))
        .await
        .unwrap();
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// `GET path` with [`http`].
pub(crate) async fn http_get(addr: &str, path: &str) -> (u16, String) {
    http(addr, "GET", path, "").await
}
