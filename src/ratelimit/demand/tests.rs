use super::*;
use proptest::prelude::*;

const TICK: Duration = Duration::from_millis(500);
const LEASE: Duration = Duration::from_secs(3);

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-5
}

#[test]
fn fair_gives_small_demands_what_they_need_and_splits_the_rest_among_backlogs() {
    let s = fair(&[Demand::Backlog, Demand::UpTo(0.1), Demand::UpTo(0.02)]);
    assert!(
        close(s[1], 0.1) && close(s[2], 0.02) && close(s[0], 0.88),
        "{s:?}"
    );
    let s = fair(&[Demand::Backlog, Demand::Backlog, Demand::UpTo(0.6)]);
    assert!(close(s[0], 1.0 / 3.0) && close(s[2], 1.0 / 3.0), "{s:?}");
    // Nobody asks for everything: what is left is split evenly.
    let s = fair(&[Demand::UpTo(0.02), Demand::UpTo(0.02)]);
    assert!(close(s[0], 0.5) && close(s[1], 0.5), "{s:?}");
    assert!(fair(&[]).is_empty());
}

/// A replica in the simulations below: what it paces at, and its lease.
#[derive(Debug, Clone)]
struct Replica {
    name: String,
    seen: Seen,
    /// The share it paces at while its lease holds.
    pacing: f64,
    /// When its last successful write was sent.
    sent: Option<Instant>,
    /// A write decided on a read, not yet made: the version it read and the step.
    pending: Option<(u64, Step)>,
    demand: Demand,
    alive: bool,
}

impl Replica {
    fn new(name: &str, demand: Demand) -> Self {
        Self {
            name: name.into(),
            seen: Seen::default(),
            pacing: 0.0,
            sent: None,
            pending: None,
            demand,
            alive: true,
        }
    }

    /// What it paces at `now`: nothing once its last write is a lease old.
    fn using(&self, now: Instant) -> f64 {
        match self.sent {
            Some(s) if now.duration_since(s) < LEASE => self.pacing,
            _ => 0.0,
        }
    }

    /// Reads the record and decides; lowers at once.
    fn read(&mut self, store: &(u64, SharesRecord), now: Instant) {
        self.seen.observe(&store.1, now);
        let step = step(
            &store.1,
            &self.seen,
            Tick {
                me: &self.name,
                demand: self.demand,
                now,
                drop_after: LEASE + TICK,
                renew: self.sent.is_none_or(|s| now.duration_since(s) >= LEASE / 4),
                first_beat: fresh_beat(),
            },
        );
        self.pacing = self.pacing.min(step.now_at_most);
        self.pending = Some((store.0, step));
    }

    /// Writes what it decided, if the record is still the version it read.
    fn write(&mut self, store: &mut (u64, SharesRecord), now: Instant) {
        let Some((version, step)) = self.pending.take() else {
            return;
        };
        match step.write {
            Some(next) if store.0 == version => {
                *store = (version + 1, next);
                self.sent = Some(now);
                self.pacing = step.share;
            }
            Some(_) => {}
            None => self.pacing = self.pacing.min(step.share),
        }
    }
}

/// A new entry's beat, never the same twice (the limiter takes a random one).
fn fresh_beat() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1 << 40);
    NEXT.fetch_add(1 << 20, std::sync::atomic::Ordering::Relaxed)
}

fn demand_from(kind: u8, x: f64) -> Demand {
    if kind == 0 {
        Demand::Backlog
    } else {
        Demand::UpTo(x)
    }
}

#[test]
fn a_joining_replica_gets_half_within_three_ticks_and_nobody_is_ever_over() {
    let t0 = Instant::now();
    let mut store = (0u64, SharesRecord::default());
    let mut a = Replica::new("a", Demand::Backlog);
    a.read(&store, t0);
    a.write(&mut store, t0);
    assert_eq!(a.using(t0), 1.0, "alone, it has all of it");
    let mut rs = [Replica::new("b", Demand::Backlog), a];
    let mut now = t0;
    for round in 0..3 {
        now += TICK;
        for i in 0..2 {
            rs[i].read(&store, now);
            rs[i].write(&mut store, now);
            let sum = rs[0].using(now) + rs[1].using(now);
            assert!(sum <= 1.0 + 1e-9, "round {round}: {sum}");
            assert!(sum > 0.0, "round {round}: nobody paces");
        }
    }
    assert!(
        close(rs[0].using(now), 0.5) && close(rs[1].using(now), 0.5),
        "{rs:?}"
    );
}

#[test]
fn a_dead_replicas_share_is_taken_only_after_its_own_lease_ran_out() {
    let t0 = Instant::now();
    let mut store = (0u64, SharesRecord::default());
    let mut rs = [
        Replica::new("a", Demand::Backlog),
        Replica::new("b", Demand::Backlog),
    ];
    let mut now = t0;
    for _ in 0..4 {
        now += TICK;
        for r in rs.iter_mut() {
            r.read(&store, now);
            r.write(&mut store, now);
        }
    }
    // b dies (no more ticks, no withdrawal); a keeps ticking.
    let died = now;
    let dead = rs[1].clone();
    while now < died + LEASE * 3 {
        now += TICK;
        rs[0].read(&store, now);
        rs[0].write(&mut store, now);
        assert!(rs[0].using(now) + dead.using(now) <= 1.0 + 1e-9);
        if rs[0].using(now) > 0.5 + 1e-9 {
            assert_eq!(dead.using(now), 0.0, "took b's share while b could use it");
        }
    }
    assert_eq!(rs[0].using(now), 1.0, "a has it all once b's lease is gone");
    // A clean stop hands it over at once.
    let gone = withdraw(&store.1, "a").unwrap();
    assert!(gone.replicas.is_empty());
    assert_eq!(withdraw(&gone, "a"), None);
}

#[test]
fn a_replica_that_only_trickles_keeps_what_it_uses_and_the_backlog_gets_the_rest() {
    assert_eq!(demand_of(0.7, false, 0.1), Demand::Backlog);
    assert_eq!(demand_of(0.0, true, 0.0), Demand::Backlog);
    assert!(matches!(demand_of(0.1, false, 0.2), Demand::UpTo(d) if close(d, 0.26)));
    let t0 = Instant::now();
    let mut store = (0u64, SharesRecord::default());
    let mut rs = [
        Replica::new("a", Demand::Backlog),
        Replica::new("b", demand_of(0.0, false, 0.2)),
        Replica::new("c", demand_of(0.0, false, 0.0)),
    ];
    let mut now = t0;
    for _ in 0..4 {
        now += TICK;
        for r in rs.iter_mut() {
            r.read(&store, now);
            r.write(&mut store, now);
        }
    }
    let used: Vec<f64> = rs.iter().map(|r| r.using(now)).collect();
    assert!(
        close(used[0], 0.72) && close(used[1], 0.26) && close(used[2], 0.02),
        "{used:?}"
    );
}

proptest! {
    #[test]
    fn fair_shares_add_up_to_at_most_one_and_are_max_min_fair(
        demands in proptest::collection::vec((0u8..3, 0.0f64..1.0), 1..8),
    ) {
        let d: Vec<Demand> = demands.iter().map(|(k, x)| demand_from(*k, *x)).collect();
        let s = fair(&d);
        let sum: f64 = s.iter().sum();
        prop_assert!(sum <= 1.0 + 1e-9, "{sum}");
        prop_assert!(sum >= 1.0 - 1e-5 * d.len() as f64, "all of it is handed out: {sum}");
        for (i, di) in d.iter().enumerate() {
            if s[i] + 1e-5 < di.cap() {
                // Short of its demand: nobody got more than it.
                for sj in &s {
                    prop_assert!(*sj <= s[i] + 1e-5, "{s:?} for {d:?}");
                }
            }
        }
    }

    /// Three replicas under any interleaving of reads, writes (compare-and-swap on one
    /// version), changes of demand, deaths, freezes, clean stops and returns: what they pace
    /// at never adds up to more than the whole, counting a dead or frozen one for as long
    /// as its own lease lets it pace.
    #[test]
    fn what_the_replicas_pace_at_never_adds_up_to_more_than_the_whole(
        events in proptest::collection::vec((0usize..3, 0u8..8, 0u8..3, 0.0f64..1.0, 0u64..1500), 1..200),
    ) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut store = (0u64, SharesRecord::default());
        let mut rs: Vec<Replica> = ["r0", "r1", "r2"].iter().map(|n| Replica::new(n, Demand::Backlog)).collect();
        for (r, what, kind, x, gap) in events {
            now += Duration::from_millis(gap);
            match what {
                0..=2 if rs[r].alive => rs[r].read(&store, now),
                3 | 4 if rs[r].alive => rs[r].write(&mut store, now),
                5 => rs[r].demand = demand_from(kind, x),
                // Dies or freezes: no more ticks, the lease runs out by itself.
                6 => rs[r].alive = !rs[r].alive,
                // A clean stop: pacing ends, then the entry goes.
                _ if rs[r].alive => {
                    rs[r].pacing = 0.0;
                    if let Some(next) = withdraw(&store.1, &rs[r].name) {
                        store = (store.0 + 1, next);
                    }
                    rs[r].sent = None;
                    rs[r].pending = None;
                }
                _ => {}
            }
            let sum: f64 = rs.iter().map(|r| r.using(now)).sum();
            prop_assert!(sum <= 1.0 + 1e-9, "they pace at {sum} in all: {rs:#?} {store:?}");
            let committed: f64 = store.1.replicas.values().map(|e| e.share).sum();
            prop_assert!(committed <= 1.0 + 1e-9, "the record commits {committed}");
        }
    }

    /// Whatever the demands, replicas that all tick settle within three rounds on shares that
    /// hand out the whole, each at its fair part.
    #[test]
    fn ticking_replicas_settle_on_the_fair_split_within_three_rounds(
        demands in proptest::collection::vec((0u8..3, 0.0f64..1.0), 3),
        first in proptest::collection::vec((0u8..3, 0.0f64..1.0), 3),
    ) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut store = (0u64, SharesRecord::default());
        let mut rs: Vec<Replica> = ["r0", "r1", "r2"].iter().zip(&first).map(|(n, (k, x))| Replica::new(n, demand_from(*k, *x))).collect();
        for _ in 0..3 {
            now += TICK;
            for r in rs.iter_mut() { r.read(&store, now); r.write(&mut store, now); }
        }
        for (r, (k, x)) in rs.iter_mut().zip(&demands) { r.demand = demand_from(*k, *x); }
        for _ in 0..3 {
            now += TICK;
            for r in rs.iter_mut() { r.read(&store, now); r.write(&mut store, now); }
        }
        let want = fair(&rs.iter().map(|r| r.demand).collect::<Vec<_>>());
        for (r, w) in rs.iter().zip(&want) {
            prop_assert!((r.using(now) - w).abs() < 1e-5, "{} at {} for {w}: {rs:#?}", r.name, r.using(now));
        }
    }
}
