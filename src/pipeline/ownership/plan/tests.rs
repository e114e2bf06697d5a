use super::*;
use proptest::prelude::*;

const EXPIRATION: Duration = Duration::from_secs(30);

/// How long ago an ownership was last modified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Modified {
    Unknown,
    Recently,
    LongAgo,
}

/// One listed ownership, plainly: the partition, its owner (`""`: released), when modified.
#[derive(Debug, Clone)]
struct Listed {
    partition: usize,
    owner: Option<&'static str>,
    modified: Modified,
}

/// One partition's handover requests, plainly.
#[derive(Debug, Clone)]
struct Asks {
    partition: usize,
    /// This replica's request: the owner asked, and whether it is overdue.
    mine: Option<(&'static str, bool)>,
    /// Another asker's request: its ETag, and whether it is stale.
    theirs: Option<(String, bool)>,
}

/// A cycle as the reference reads it.
#[derive(Debug, Clone)]
struct Case {
    listed: Vec<Listed>,
    /// Wanted partitions, in the processor's order.
    wanted: Vec<usize>,
    requests: Vec<Asks>,
    hub_partitions: usize,
    live: Option<usize>,
}

fn now() -> time::OffsetDateTime {
    time::macros::datetime!(2026-01-01 12:00 UTC)
}

fn age(long: bool) -> Duration {
    if long {
        EXPIRATION + Duration::from_secs(1)
    } else {
        EXPIRATION - Duration::from_secs(1)
    }
}

fn ownership(partition: usize, owner: Option<&str>, modified: Modified) -> Ownership {
    Ownership {
        fully_qualified_namespace: "ns".into(),
        event_hub_name: "hub".into(),
        consumer_group: "$Default".into(),
        partition_id: partition.to_string(),
        owner_id: owner.map(str::to_string),
        last_modified_time: match modified {
            Modified::Unknown => None,
            Modified::Recently => Some(now() - Duration::from_secs(1)),
            Modified::LongAgo => Some(now() - EXPIRATION - Duration::from_secs(1)),
        },
        ..Default::default()
    }
}

fn view(case: &Case) -> View {
    View {
        me: "r0".into(),
        listed: case
            .listed
            .iter()
            .map(|l| ownership(l.partition, l.owner, l.modified))
            .collect(),
        hub_partitions: case.hub_partitions,
        now: now(),
        expiration: EXPIRATION,
        requests: case
            .requests
            .iter()
            .map(|a| {
                let r = Requests {
                    mine: a.mine.map(|(o, long)| (o.to_string(), age(long))),
                    theirs: a.theirs.clone().map(|(e, long)| (e, age(long))),
                };
                (a.partition.to_string(), r)
            })
            .collect(),
    }
}

fn wanted(case: &Case) -> Vec<Ownership> {
    case.wanted
        .iter()
        .map(|p| ownership(*p, Some("r0"), Modified::Recently))
        .collect()
}

/// What the reference expects: the partitions claimed (in order), asked for (partition,
/// owner, stale ETag), and overdue (partition, owner).
type Expected = (
    Vec<String>,
    Vec<(String, String, Option<String>)>,
    Vec<(String, String)>,
);

/// The rules, plainly, one partition at a time: a live other owner (named, not this
/// replica, modified within the expiration or unknown) is asked, not stolen; this
/// replica's own are renewed; the rest are claimed up to the share (the partitions divided
/// among the live replicas, rounded up, less what this replica owns).
fn reference(case: &Case) -> Expected {
    let listed = |p: usize| case.listed.iter().rev().find(|l| l.partition == p);
    let live_owner = |l: &Listed| match l.owner {
        Some(o) if !o.is_empty() && o != "r0" && l.modified != Modified::LongAgo => Some(o),
        _ => None,
    };
    let distinct: Vec<&Listed> = (0..8).filter_map(listed).collect();
    let mut replicas: Vec<&str> = vec!["r0"];
    for o in distinct.iter().filter_map(|l| live_owner(l)) {
        if !replicas.contains(&o) {
            replicas.push(o);
        }
    }
    let n = replicas.len().max(case.live.unwrap_or(0)).max(1);
    let partitions = case.hub_partitions.max(distinct.len());
    let owned = distinct.iter().filter(|l| l.owner == Some("r0")).count();
    let mut room = if partitions == 0 {
        usize::MAX
    } else {
        partitions.div_ceil(n).saturating_sub(owned)
    };
    let request = |p: usize| case.requests.iter().find(|r| r.partition == p);
    let (mut renewals, mut fresh, mut steals) = (Vec::new(), Vec::new(), Vec::new());
    for &p in &case.wanted {
        match listed(p) {
            Some(l) if live_owner(l).is_some() => steals.push((p, live_owner(l).unwrap())),
            Some(l) if l.owner == Some("r0") => renewals.push(p.to_string()),
            _ if room > 0 => {
                room -= 1;
                fresh.push(p.to_string());
            }
            _ => {}
        }
    }
    let pending = case
        .requests
        .iter()
        .filter(|a| {
            a.mine
                .is_some_and(|(o, _)| listed(a.partition).and_then(live_owner) == Some(o))
        })
        .count();
    let mut budget = steals.len().saturating_sub(pending);
    let (mut asks, mut overdue) = (Vec::new(), Vec::new());
    for (p, owner) in steals {
        let r = request(p);
        match r.and_then(|r| r.mine).filter(|(o, _)| *o == owner) {
            Some((_, true)) => overdue.push((p.to_string(), owner.to_string())),
            Some((_, false)) => {}
            None if budget > 0 => {
                budget -= 1;
                let stale = r
                    .and_then(|r| r.theirs.clone())
                    .filter(|(_, long)| *long)
                    .map(|(e, _)| e);
                asks.push((p.to_string(), owner.to_string(), stale));
            }
            None => {}
        }
    }
    renewals.extend(fresh);
    (renewals, asks, overdue)
}

fn planned(case: &Case) -> (Plan, Expected) {
    let view = view(case);
    let sorted = sort(&view, wanted(case));
    let plan = sorted.plan(&view, case.live);
    let claims = plan.claim.iter().map(|o| o.partition_id.clone()).collect();
    let (mut asks, mut overdue) = (Vec::new(), Vec::new());
    for s in &plan.steals {
        match s {
            Steal::Ask {
                partition,
                owner,
                stale,
            } => asks.push((partition.clone(), owner.clone(), stale.clone())),
            Steal::Overdue { ownership, owner } => {
                overdue.push((ownership.partition_id.clone(), owner.clone()))
            }
        }
    }
    (plan, (claims, asks, overdue))
}

fn cases() -> impl Strategy<Value = Case> {
    let owner = prop_oneof![
        Just(None),
        Just(Some("")),
        Just(Some("r0")),
        Just(Some("r1")),
        Just(Some("r2")),
    ];
    let modified = prop_oneof![
        Just(Modified::Unknown),
        Just(Modified::Recently),
        Just(Modified::LongAgo),
    ];
    // Most partitions listed (now and then one twice), most requests about listed ones.
    let entry = (owner, modified);
    let listed = (
        proptest::collection::vec(proptest::option::weighted(0.8, entry.clone()), 6),
        proptest::collection::vec((0usize..6, entry), 0..2),
    )
        .prop_map(|(each, twice)| {
            let once = each
                .into_iter()
                .enumerate()
                .filter_map(|(partition, e)| e.map(|e| (partition, e)));
            once.chain(twice)
                .map(|(partition, (owner, modified))| Listed {
                    partition,
                    owner,
                    modified,
                })
                .collect::<Vec<_>>()
        });
    let wanted = (proptest::collection::vec(any::<bool>(), 6), 0usize..6).prop_map(|(w, r)| {
        let mut ps: Vec<usize> = (0..6).filter(|p| w[*p]).collect();
        let k = r % ps.len().max(1);
        ps.rotate_left(k);
        ps
    });
    let request = (
        proptest::option::of((prop_oneof![Just("r1"), Just("r2")], any::<bool>())),
        proptest::option::of(("e[0-9]", any::<bool>())),
    );
    let requests =
        proptest::collection::vec(proptest::option::weighted(0.5, request), 6).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .filter_map(|(partition, r)| {
                    r.map(|(mine, theirs)| Asks {
                        partition,
                        mine,
                        theirs,
                    })
                })
                .collect::<Vec<_>>()
        });
    (
        listed,
        wanted,
        requests,
        0usize..8,
        proptest::option::of(0usize..5),
    )
        .prop_map(|(listed, wanted, requests, hub_partitions, live)| Case {
            listed,
            wanted,
            requests,
            hub_partitions,
            live,
        })
}

proptest! {
    #[test]
    fn the_plan_is_the_reference_s(case in cases()) {
        let (_, got) = planned(&case);
        prop_assert_eq!(got, reference(&case));
    }

    #[test]
    fn a_live_owner_s_partition_is_asked_for_never_claimed_before_its_request_is_overdue(case in cases()) {
        let view = view(&case);
        let (plan, _) = planned(&case);
        let listing = view.by_partition();
        for o in &plan.claim {
            let owner = listing.get(o.partition_id.as_str()).and_then(|l| view.live_other(l));
            prop_assert!(owner.is_none(), "claimed {} from the live {:?}", o.partition_id, owner);
        }
        let asks = plan.steals.iter().filter(|s| matches!(s, Steal::Ask { .. })).count();
        let wanted_of_others = case.wanted.iter().filter(|p| {
            listing.get(p.to_string().as_str()).and_then(|l| view.live_other(l)).is_some()
        }).count();
        prop_assert!(asks <= wanted_of_others);
        // Renewals are never held back.
        for p in &case.wanted {
            let renewal = listing.get(p.to_string().as_str()).is_some_and(|l| l.owner_id.as_deref() == Some("r0"));
            prop_assert!(!renewal || plan.claim.iter().any(|o| o.partition_id == p.to_string()));
        }
    }

    #[test]
    fn replicas_starting_together_claim_no_more_than_the_hub_s_partitions_between_them(
        hub in 1usize..20,
        replicas in 1usize..6,
    ) {
        // Nothing listed yet, every replica's owner record live: each wants every partition.
        let mut claimed = 0;
        for r in 0..replicas {
            let view = View {
                me: format!("r{r}"),
                listed: Vec::new(),
                hub_partitions: hub,
                now: now(),
                expiration: EXPIRATION,
                requests: HashMap::new(),
            };
            let wanted = (0..hub).map(|p| ownership(p, Some(&view.me), Modified::Recently)).collect();
            let sorted = sort(&view, wanted);
            prop_assert!(sorted.needs_share());
            claimed += sorted.plan(&view, Some(replicas)).claim.len();
        }
        prop_assert!(claimed < hub + replicas, "{claimed} of {hub} among {replicas}");
        prop_assert!(claimed >= hub);
    }
}

#[test]
fn the_gate_stops_claims_while_stopping_and_without_the_owner_id() {
    assert_eq!(Gate::of(true, true), Gate::RenewFinishing);
    assert_eq!(Gate::of(true, false), Gate::RenewFinishing);
    assert_eq!(Gate::of(false, false), Gate::Nothing);
    assert_eq!(Gate::of(false, true), Gate::Claim);
}

#[test]
fn only_the_owner_s_own_acknowledgement_of_this_request_counts_as_finishing() {
    use super::super::handover::{Request, Stage};
    let r = |asker: &str, owner: &str, stage| Request {
        partition: "0".into(),
        asker: asker.into(),
        owner: owner.into(),
        stage,
        asked: String::new(),
    };
    assert!(owner_is_finishing(
        Some(&r("me", "o", Stage::Releasing)),
        "me",
        "o"
    ));
    assert!(!owner_is_finishing(
        Some(&r("me", "o", Stage::Asked)),
        "me",
        "o"
    ));
    assert!(!owner_is_finishing(
        Some(&r("other", "o", Stage::Releasing)),
        "me",
        "o"
    ));
    assert!(!owner_is_finishing(
        Some(&r("me", "x", Stage::Releasing)),
        "me",
        "o"
    ));
    assert!(!owner_is_finishing(None, "me", "o"));
}

#[test]
fn a_partition_listed_twice_counts_once_as_the_last_listing_says() {
    let case = Case {
        listed: vec![
            Listed {
                partition: 0,
                owner: Some("r1"),
                modified: Modified::Recently,
            },
            Listed {
                partition: 0,
                owner: Some(""),
                modified: Modified::Recently,
            },
        ],
        wanted: vec![0],
        requests: Vec::new(),
        hub_partitions: 0,
        live: None,
    };
    let (plan, got) = planned(&case);
    assert_eq!(got, reference(&case));
    assert_eq!(got.0, vec!["0".to_string()], "{plan:?}");
}
