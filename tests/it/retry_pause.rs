//! `hubguard retries pause|resume` (issue 41): an operator's pause of retries by key, event
//! type, error text or all, in the control record every replica reads. A paused retry that
//! comes due is deferred without counting an attempt and without holding a partition; the
//! pause survives the replica that honoured it (it is the shared record's, not a replica's),
//! and once resumed each paused retry runs once, as the attempt it was.

use std::sync::Arc;
use std::time::Duration;

use hubguard::pipeline::control::{self, Pause, Resume, RetryFilter};
use hubguard::pipeline::Pipeline;
use tokio_util::sync::CancellationToken;

use crate::common::within;
use crate::pipeline_support::*;

const LIMIT: Duration = Duration::from_secs(90);

/// A replica that can be killed (no final checkpoint, no release), with a 1 s recheck of
/// paused retries.
struct Replica {
    health: Arc<hubguard::pipeline::health::Health>,
    crash: CancellationToken,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _log: crate::test_log::TestLog,
}

fn replica(bed: &Bed, owner: &str, handler: Arc<Scripted>) -> Replica {
    let mut wiring = bed.wiring(owner).policy(fast_policy(5));
    wiring.options_mut().retry_pause_recheck = Duration::from_secs(1);
    let pipeline = Pipeline::new(wiring.parts(handler).unwrap());
    let health = pipeline.health();
    let (cancel, crash) = (CancellationToken::new(), CancellationToken::new());
    let (c, k) = (cancel.clone(), crash.clone());
    let task = tokio::spawn(async move { pipeline.run_until(c, k).await.unwrap() });
    Replica {
        health,
        crash,
        cancel,
        task,
        _log: crate::test_log::TestLog::in_process(),
    }
}

fn pause_by(by: &str) -> Pause {
    Pause {
        by: by.into(),
        since_ms: hubguard::clock::ms(std::time::SystemTime::now()),
        reason: Some("receiver under repair".into()),
    }
}

/// Waits until the ledger's next due time of `key` has moved `n` times while it waits for
/// attempt 2: evidence that the paused retry came due and was deferred `n` times (by
/// whichever replica runs), each time checked to have counted no attempt and made no call.
async fn deferred(bed: &Bed, handler: &Scripted, key: &str, n: usize) {
    let ledger = bed.ledger();
    let due_now = || async {
        let rec = ledger
            .record(key)
            .await
            .unwrap()
            .expect("a record: attempt 1 failed");
        assert_eq!(rec.attempts, 1, "an attempt counted while paused: {rec:?}");
        assert_eq!(handler.calls_of(key), vec![1], "{key} called while paused");
        rec.next_attempt_ms().expect("waiting for attempt 2")
    };
    let mut last = due_now().await;
    for _ in 0..n {
        last = crate::common::eventually(
            &format!("{key}'s paused retry deferred again"),
            LIMIT,
            || async { crate::common::seen(due_now().await, |d| *d > last) },
        )
        .await;
    }
}

/// Attempt 1 of `keys` failed and their retries wait in the ledger.
async fn first_attempts_failed(bed: &Bed, keys: &[&str]) {
    let ledger = bed.ledger();
    crate::common::eventually("attempt 1 failed and recorded", LIMIT, || async {
        let mut waiting = 0;
        for k in keys {
            if let Some(r) = ledger.record(k).await.unwrap() {
                waiting += usize::from(r.next_attempt_ms().is_some());
            }
        }
        crate::common::seen(waiting, |w| *w == keys.len())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_retries_wait_uncounted_across_a_crash_and_each_runs_once_when_resumed() {
    let bed = Bed::start(1).await;
    let store = bed.records();
    let name = control::record_name("hub", "$Default");
    // Two pauses, by key and by error text (case-insensitive), before anything fails.
    let by_key = RetryFilter {
        key: Some("held-key".into()),
        ..Default::default()
    };
    let by_error = RetryFilter {
        error: Some("BUSY".into()),
        ..Default::default()
    };
    for f in [&by_key, &by_error] {
        let r = control::pause_or_resume_retries(
            store.as_ref(),
            &name,
            Some((f.clone(), pause_by("ops"))),
            None,
            false,
        )
        .await
        .unwrap();
        assert!(r.changed);
    }
    let handler = Arc::new(Scripted::default());
    let a = replica(&bed, "replica-a", handler.clone());
    bed.send(
        0,
        &[
            ("held-key", "fail:1"),
            ("held-busy", "retry-after:1"),
            ("free", "fail:1"),
        ],
    )
    .await;
    // The unpaused retry runs as always, and the partition is not held by the paused ones:
    // an event after them is delivered and checkpointed.
    wait_for("the unpaused retry delivered", &a.health, LIMIT, || async {
        handler.calls_of("free") == vec![1, 2]
    })
    .await;
    bed.send(0, &[("after", "ok")]).await;
    first_attempts_failed(&bed, &["held-key", "held-busy"]).await;
    deferred(&bed, &handler, "held-key", 2).await;
    deferred(&bed, &handler, "held-busy", 2).await;
    // What `hubguard status KEY` and `/v1/events/{key}` say of it.
    let rec = bed.ledger().record("held-busy").await.unwrap().unwrap();
    let mut view = hubguard::status::record_view(&rec);
    hubguard::pipeline::control::add_retry_pause(&bed.ledger(), &rec, &mut view).await;
    assert_eq!(view["paused"]["by"], "ops", "{view}");
    assert_eq!(view["paused"]["filter"]["error"], "BUSY", "{view}");
    assert!(
        view["paused"]["reason_text"]
            .as_str()
            .unwrap()
            .ends_with("receiver under repair"),
        "{view}"
    );
    wait_for(
        "the partition checkpointed past them",
        &a.health,
        LIMIT,
        || async {
            handler.delivered_keys().contains("after") && bed.checkpoint_of("0").await >= Some(3)
        },
    )
    .await;

    // The replica dies; another takes over and honours the same pauses.
    a.crash.cancel();
    within("a dies", a.task).await.unwrap();
    let b = replica(&bed, "replica-b", handler.clone());
    deferred(&bed, &handler, "held-key", 2).await;
    deferred(&bed, &handler, "held-busy", 1).await;

    // Resuming the key's pause releases that retry alone: it runs once, as attempt 2.
    let r = control::pause_or_resume_retries(
        store.as_ref(),
        &name,
        None,
        Some(Resume::Filter(by_key.clone())),
        false,
    )
    .await
    .unwrap();
    assert!(r.changed);
    assert_eq!(r.record.retries.len(), 1, "{:?}", r.record);
    wait_for("the resumed retry delivered", &b.health, LIMIT, || async {
        handler.delivered_keys().contains("held-key")
    })
    .await;
    assert_eq!(handler.calls_of("held-key"), vec![1, 2]);
    deferred(&bed, &handler, "held-busy", 1).await;

    // Resuming everything releases the other.
    control::pause_or_resume_retries(store.as_ref(), &name, None, Some(Resume::Everything), false)
        .await
        .unwrap();
    wait_for(
        "the last paused retry delivered",
        &b.health,
        LIMIT,
        || async { handler.delivered_keys().contains("held-busy") },
    )
    .await;
    assert_eq!(handler.calls_of("held-busy"), vec![1, 2]);
    let rec = bed.ledger().record("held-busy").await.unwrap().unwrap();
    assert_eq!(rec.attempts, 2, "delivered on attempt 2: {rec:?}");
    b.cancel.cancel();
    within("b stops", b.task).await.unwrap();
}

/// The pause's own rules: criteria together must all match, the error text is matched
/// case-insensitively, the same pause twice is one, and resuming a pause nobody made
/// changes nothing.
#[tokio::test]
async fn retry_pauses_match_by_every_criterion_and_change_the_record_once() {
    let bed = Bed::start(1).await;
    let store = bed.records();
    let name = control::record_name("hub", "$Default");
    let f = RetryFilter {
        event_type: Some("order.created".into()),
        error: Some("503".into()),
        ..Default::default()
    };
    assert!(f.matches(
        "k",
        Some("order.created"),
        Some("HTTP 503 from the receiver")
    ));
    assert!(!f.matches("k", Some("order.created"), Some("HTTP 500")));
    assert!(!f.matches("k", Some("order.paid"), Some("HTTP 503")));
    assert!(!f.matches("k", Some("order.created"), None));
    assert!(RetryFilter::default().matches("any", None, None));
    assert_eq!(
        f.to_string(),
        "retries of event type order.created and last error containing \"503\""
    );
    let pause = |dry_run| {
        control::pause_or_resume_retries(
            store.as_ref(),
            &name,
            Some((f.clone(), pause_by("ops"))),
            None,
            dry_run,
        )
    };
    let dry = pause(true).await.unwrap();
    assert!(dry.changed);
    assert!(control::current(store.as_ref(), &name)
        .await
        .unwrap()
        .retries
        .is_empty());
    assert!(pause(false).await.unwrap().changed);
    assert!(
        !pause(false).await.unwrap().changed,
        "the same pause twice is one"
    );
    let other = RetryFilter {
        key: Some("k".into()),
        ..Default::default()
    };
    let r = control::pause_or_resume_retries(
        store.as_ref(),
        &name,
        None,
        Some(Resume::Filter(other)),
        false,
    )
    .await
    .unwrap();
    assert!(!r.changed);
    assert_eq!(r.record.retries.len(), 1);
    // Resuming every partition leaves the retries paused.
    let now = control::current(store.as_ref(), &name).await.unwrap();
    assert_eq!(now.resumed().retries.len(), 1);
}

/// The command line: a pause needs criteria or `--all`, is listed by `retries paused`, is
/// kept once when asked twice, and `retries resume` with the same criteria removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_pauses_lists_and_resumes_retries() {
    use crate::rewind::{config_of, hubguard, json_of};
    let bed = Bed::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_of(&bed, &dir);
    let (code, out) = hubguard(&config, &["retries", "pause"]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("--key, --event-type, --error"), "{out}");
    let pause = [
        "retries",
        "pause",
        "--event-type",
        "order.created",
        "--error",
        "503",
        "--by",
        "alice",
        "--reason",
        "fix deploying",
        "--json",
    ];
    let (code, out) = hubguard(&config, &pause).await;
    assert_eq!(code, Some(0), "{out}");
    let v = json_of(&out);
    assert_eq!(v["changed"], true, "{out}");
    assert_eq!(v["retries"][0]["by"], "alice", "{out}");
    let (_, out) = hubguard(&config, &pause).await;
    assert_eq!(
        json_of(&out)["changed"],
        false,
        "the same pause twice is one: {out}"
    );
    let (code, out) = hubguard(&config, &["retries", "paused"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("paused: retries of event type order.created and last error containing \"503\" — paused by alice since")
            && out.contains(": fix deploying"),
        "{out}"
    );
    let (code, out) = hubguard(
        &config,
        &[
            "retries",
            "resume",
            "--event-type",
            "order.created",
            "--error",
            "503",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("resumed; every replica follows within seconds"),
        "{out}"
    );
    assert!(out.contains("no retries are paused"), "{out}");
}
