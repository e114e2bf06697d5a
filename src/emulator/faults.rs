//! Fault injection shared by the emulators: refuse connections for a period, delay every
//! round trip (each HTTP request; each AMQP frame batch a client sends, not each transfer
//! streamed back), drop every live connection, answer with an error status for a period, answer as
//! a throttled namespace (`com.microsoft:server-busy`, Event Hubs) for a period; on the HTTP
//! emulators, hold the requests of one method whose path contains a given text until the
//! test lets them through or fails them ([`Faults::hold_requests`]), so a test can order what
//! a client does around one request without a sleep.
//!
//! Tests drive it through the Rust API on a running emulator; the `hubguard emulator` process
//! will expose the same through its admin endpoint. Time is `tokio::time`, so tests that pause
//! the clock control faults too.

use crate::sync::LockExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::latency::Latency;

/// The faults in force on one emulator.
#[derive(Debug)]
pub struct Faults {
    state: Mutex<FaultState>,
    shutdown: CancellationToken,
}

#[derive(Debug)]
struct FaultState {
    refuse_until: Option<Instant>,
    error_until: Option<(Instant, u16)>,
    server_busy_until: Option<Instant>,
    delay: Duration,
    /// The service's own latency (a profile such as `azure`); `clear` keeps it.
    latency: Latency,
    rng: StdRng,
    connections: CancellationToken,
    dropped: u64,
    accepted: u64,
    /// Requests held until released ([`Faults::hold_requests`]).
    holds: Vec<Arc<Held>>,
}

/// The requests of one method whose path contains a text, held on arrival until the test
/// lets them through ([`release`](Self::release)) or answers them with an error status
/// ([`fail`](Self::fail)); either ends the hold for later requests too.
#[derive(Debug)]
pub struct Held {
    method: String,
    path: String,
    /// `None` while holding; then `Some(None)` (let through) or `Some(Some(status))`.
    verdict: tokio::sync::watch::Sender<Option<Option<u16>>>,
    /// Requests that arrived while it held.
    arrived: std::sync::atomic::AtomicU64,
}

impl Held {
    /// Whether a request of `method` to `path` is one this holds.
    fn matches(&self, method: &str, path: &str) -> bool {
        self.verdict.borrow().is_none() && self.method == method && path.contains(&self.path)
    }

    /// How many requests arrived while it held (the ones waiting and those already answered).
    pub fn arrived(&self) -> u64 {
        self.arrived.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets the held requests through, and holds no more.
    pub fn release(&self) {
        self.verdict.send_replace(Some(None));
    }

    /// Answers the held requests with `status` (as [`Faults::error_status_for`] answers), and
    /// holds no more.
    pub fn fail(&self, status: u16) {
        self.verdict.send_replace(Some(Some(status)));
    }

    /// Waits for the verdict on a request that arrived: `Some(status)` to answer with.
    pub async fn wait(&self) -> Option<u16> {
        let mut rx = self.verdict.subscribe();
        let verdict = match rx.wait_for(Option::is_some).await {
            Ok(v) => v.flatten(),
            Err(_) => None,
        };
        verdict
    }
}

impl Faults {
    /// Faults for an emulator whose connections all end when `shutdown` is cancelled.
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            state: Mutex::new(FaultState {
                refuse_until: None,
                error_until: None,
                server_busy_until: None,
                delay: Duration::ZERO,
                latency: Latency::ZERO,
                rng: StdRng::seed_from_u64(0x6875_6267_7561_7264),
                connections: shutdown.child_token(),
                dropped: 0,
                accepted: 0,
                holds: Vec::new(),
            }),
            shutdown,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FaultState> {
        self.state.locked()
    }

    /// Close every new connection at once for `period`.
    pub fn refuse_connections_for(&self, period: Duration) {
        self.state().refuse_until = Some(Instant::now() + period);
    }

    /// Whether new connections are being refused now.
    pub fn refusing(&self) -> bool {
        self.state()
            .refuse_until
            .is_some_and(|t| Instant::now() < t)
    }

    /// Add `delay` of latency to every round trip, on top of the service's latency (zero
    /// turns it off).
    pub fn set_delay(&self, delay: Duration) {
        self.state().delay = delay;
    }

    /// The service's own latency per round trip, drawn from `latency` (a profile such as
    /// `azure`, see [`LatencyProfile`](super::latency::LatencyProfile)); draws come from a
    /// generator seeded with `seed`, so a run is repeatable. [`clear`](Self::clear) keeps it.
    pub fn set_latency(&self, latency: Latency, seed: u64) {
        let mut st = self.state();
        st.latency = latency;
        st.rng = StdRng::seed_from_u64(seed);
    }

    /// The service's own latency distribution.
    pub fn latency(&self) -> Latency {
        self.state().latency
    }

    /// What one round trip waits now: a draw from the service's latency plus the injected
    /// delay.
    pub fn round_trip(&self) -> Duration {
        let mut st = self.state();
        let FaultState {
            latency,
            rng,
            delay,
            ..
        } = &mut *st;
        latency.sample(rng) + *delay
    }

    /// The delay fault currently added to round trips (without the service's latency).
    pub fn delay(&self) -> Duration {
        self.state().delay
    }

    /// Answer every request with `status` for `period` (for the HTTP emulators; the AMQP
    /// emulator answers management and CBS requests with it).
    pub fn error_status_for(&self, status: u16, period: Duration) {
        self.state().error_until = Some((Instant::now() + period, status));
    }

    /// The error status in force now, if any.
    pub fn error_status(&self) -> Option<u16> {
        self.state()
            .error_until
            .filter(|(t, _)| Instant::now() < *t)
            .map(|(_, s)| s)
    }

    /// Answer as a throttled namespace for `period`: the Event Hubs emulator refuses new
    /// producer and consumer links (detach with `com.microsoft:server-busy`) and rejects every
    /// delivery a producer sends with that condition. A zero period turns it off.
    pub fn server_busy_for(&self, period: Duration) {
        self.state().server_busy_until = (!period.is_zero()).then(|| Instant::now() + period);
    }

    /// Whether the server-busy fault is in force now.
    pub fn server_busy(&self) -> bool {
        self.state()
            .server_busy_until
            .is_some_and(|t| Instant::now() < t)
    }

    /// Drop every live connection now (new connections are accepted as usual).
    pub fn drop_connections(&self) {
        let mut st = self.state();
        st.connections.cancel();
        st.connections = self.shutdown.child_token();
        st.dropped += 1;
    }

    /// How many times [`drop_connections`](Self::drop_connections) ran.
    pub fn drops(&self) -> u64 {
        self.state().dropped
    }

    /// A token cancelled when the connection it is given to must be dropped.
    pub fn connection_token(&self) -> CancellationToken {
        self.state().connections.child_token()
    }

    /// Counts a connection the emulator accepted and kept (see [`accepted`](Self::accepted)).
    pub fn count_accepted(&self) {
        self.state().accepted += 1;
    }

    /// How many connections the emulator accepted (refused ones not counted): whether
    /// clients keep their connections alive.
    pub fn accepted(&self) -> u64 {
        self.state().accepted
    }

    /// Holds every request of `method` (`PUT`, `GET` …) whose path contains `path` from now
    /// on, until the returned [`Held`] lets them through or fails them (HTTP emulators).
    pub fn hold_requests(&self, method: &str, path: &str) -> Arc<Held> {
        let held = Arc::new(Held {
            method: method.to_string(),
            path: path.to_string(),
            verdict: tokio::sync::watch::Sender::new(None),
            arrived: Default::default(),
        });
        let mut st = self.state();
        st.holds.retain(|h| h.verdict.borrow().is_none());
        st.holds.push(held.clone());
        held
    }

    /// The hold a request of `method` to `path` waits on, if any (counted as arrived).
    pub fn held(&self, method: &str, path: &str) -> Option<Arc<Held>> {
        let st = self.state();
        let held = st.holds.iter().find(|h| h.matches(method, path))?.clone();
        held.arrived
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Some(held)
    }

    /// Remove every fault (held requests go through).
    pub fn clear(&self) {
        let mut st = self.state();
        st.refuse_until = None;
        st.error_until = None;
        st.server_busy_until = None;
        st.delay = Duration::ZERO;
        for h in st.holds.drain(..) {
            h.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn periods_expire_on_the_injected_clock() {
        let f = Faults::new(CancellationToken::new());
        f.refuse_connections_for(Duration::from_secs(30));
        f.error_status_for(503, Duration::from_secs(10));
        assert!(f.refusing());
        assert_eq!(f.error_status(), Some(503));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(f.error_status(), None);
        assert!(f.refusing());
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(!f.refusing());
    }

    #[tokio::test(start_paused = true)]
    async fn server_busy_turns_on_expires_and_clears() {
        let f = Faults::new(CancellationToken::new());
        assert!(!f.server_busy());
        f.server_busy_for(Duration::from_secs(5));
        assert!(f.server_busy());
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(!f.server_busy());
        f.server_busy_for(Duration::from_secs(5));
        f.clear();
        assert!(!f.server_busy());
        f.server_busy_for(Duration::from_secs(5));
        f.server_busy_for(Duration::ZERO);
        assert!(!f.server_busy());
    }

    #[test]
    fn a_round_trip_waits_the_latency_plus_the_delay_and_clear_keeps_the_latency() {
        let f = Faults::new(CancellationToken::new());
        assert_eq!(f.round_trip(), Duration::ZERO);
        f.set_latency(Latency::fixed(Duration::from_millis(15)), 1);
        f.set_delay(Duration::from_millis(5));
        assert_eq!(f.round_trip(), Duration::from_millis(20));
        f.clear();
        assert_eq!(f.round_trip(), Duration::from_millis(15));
    }

    #[test]
    fn drop_cancels_live_connections_only() {
        let shutdown = CancellationToken::new();
        let f = Faults::new(shutdown.clone());
        let before = f.connection_token();
        f.drop_connections();
        let after = f.connection_token();
        assert!(before.is_cancelled());
        assert!(!after.is_cancelled());
        shutdown.cancel();
        assert!(after.is_cancelled());
        assert_eq!(f.drops(), 1);
    }

    #[tokio::test]
    async fn a_hold_takes_only_its_requests_until_its_verdict() {
        let f = Faults::new(CancellationToken::new());
        let held = f.hold_requests("PUT", "/lines/");
        assert!(f.held("GET", "/c/lines/a").is_none(), "another method");
        assert!(f.held("PUT", "/c/ledger/a").is_none(), "another path");
        let first = f.held("PUT", "/c/lines/a").expect("held");
        let waiting = tokio::spawn(async move { first.wait().await });
        assert_eq!(held.arrived(), 1);
        assert!(!waiting.is_finished());
        held.fail(500);
        assert_eq!(waiting.await.unwrap(), Some(500));
        assert!(f.held("PUT", "/c/lines/a").is_none(), "no longer holding");
        let again = f.hold_requests("PUT", "/lines/");
        let second = f.held("PUT", "/c/lines/b").expect("held again");
        f.clear();
        assert_eq!(second.wait().await, None, "clear lets it through");
        assert_eq!(again.arrived(), 1);
    }
}
