//! The Service Bus emulator's REST data plane held to Azure's own answers (issue 43): the
//! legacy Node.js SDK's tests recorded real Service Bus traffic over REST (nock recordings,
//! Azure/azure-sdk-for-node; see `tests/data/azure-recordings/PROVENANCE.md`) — Send Message,
//! Peek-Lock Message, Delete Message, Unlock Message and a receive-and-delete — and each
//! exchange is replayed against `hubguard`'s emulator. Compared: the status, the content type,
//! the `Location` of a locked message (`/{queue}/messages/{sequence}/{lock token}`), each
//! `BrokerProperties` field Azure sent (its value, or for a lock token, a message id and a
//! lock's expiry its form, the expiry's distance from the answer's `Date` within 2 s), the
//! fields the emulator adds, and the body. The newer SDKs speak AMQP to Service Bus, so these
//! are the only recordings of the REST data plane; `docs/conformance.md` lists each rule that
//! stands on the documentation alone.

use std::collections::BTreeMap;

use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use serde_json::Value;

use super::conformance::{load, replay, time_form, Answer, Exchange};

/// The recording, in the JSON form of the other recordings.
const FILE: &str = "servicebusservice-tests.queue-messages.json";

/// `BrokerProperties` fields the emulator sends that Azure's 2013 answers lack, each with why
/// it cannot mislead a client: `EnqueuedTimeUtc` is in the property's reference
/// ("Message headers and properties", learn.microsoft.com) and sent by later API versions.
const EMULATOR_ONLY: &[&str] = &["EnqueuedTimeUtc"];

/// The lock duration of the recording's queues (`<LockDuration>PT1M</LockDuration>`).
const LOCK_SECS: i64 = 60;

fn broker_properties(headers: &BTreeMap<String, String>) -> Option<serde_json::Map<String, Value>> {
    let raw = headers.get("brokerproperties")?;
    match serde_json::from_str(raw) {
        Ok(Value::Object(m)) => Some(m),
        _ => None,
    }
}

/// `/{queue}/messages/{sequence}/{lock}` of a `Location`, or why it is not of that form.
fn location_path(location: &str) -> Result<(String, String), String> {
    let path = location
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('/'))
        .map(|(_, p)| p)
        .ok_or_else(|| format!("not an absolute URL: {location:?}"))?;
    let segs: Vec<&str> = path.split('/').collect();
    match segs.as_slice() {
        [queue, m, seq, lock]
            if m.eq_ignore_ascii_case("messages")
                && seq.bytes().all(|b| b.is_ascii_digit())
                && uuid::Uuid::parse_str(lock).is_ok() =>
        {
            Ok((format!("/{path}"), format!("{queue}/{seq}")))
        }
        _ => Err(format!(
            "not /{{queue}}/messages/{{seq}}/{{lock}}: {location:?}"
        )),
    }
}

/// The differences in what a client reads from `BrokerProperties`.
fn broker_differences(x: &Exchange, got: &Answer) -> Vec<String> {
    let Some(azure) = broker_properties(&x.headers) else {
        return Vec::new();
    };
    let Some(emulator) = broker_properties(&got.headers) else {
        return vec!["BrokerProperties: Azure sent them, the emulator none".into()];
    };
    let secs_after_date = |props: &serde_json::Map<String, Value>,
                           headers: &BTreeMap<String, String>| {
        let until = props.get("LockedUntilUtc")?.as_str()?;
        let date = headers.get("date")?;
        let (u, d) = (
            hubguard::clock::parse_http_date(until)?,
            hubguard::clock::parse_http_date(date)?,
        );
        Some((hubguard::clock::ms(u) - hubguard::clock::ms(d)) / 1000)
    };
    let mut out = Vec::new();
    for (key, a) in &azure {
        let Some(e) = emulator.get(key) else {
            out.push(format!("BrokerProperties.{key}: Azure {a}, emulator none"));
            continue;
        };
        let same = match key.as_str() {
            "LockToken" => e.as_str().is_some_and(|t| uuid::Uuid::parse_str(t).is_ok()),
            "MessageId" => e
                .as_str()
                .is_some_and(|m| m.len() == 32 && m.bytes().all(|b| b.is_ascii_hexdigit())),
            // The lock's expiry is the queue's lock duration (PT1M) after the lock: Azure's
            // is 60 s and 70 s after the `Date` its front end stamped (the two clocks differ),
            // the emulator's must be 60 s after its own, within the second a `Date` rounds to.
            "LockedUntilUtc" => {
                e.as_str().map(time_form) == a.as_str().map(time_form)
                    && secs_after_date(&azure, &x.headers).is_some_and(|a| a >= LOCK_SECS - 2)
                    && secs_after_date(&emulator, &got.headers)
                        .is_some_and(|e| (e - LOCK_SECS).abs() <= 2)
            }
            _ => a == e,
        };
        if !same {
            out.push(format!("BrokerProperties.{key}: Azure {a}, emulator {e}"));
        }
    }
    for key in emulator.keys() {
        if !azure.contains_key(key) && !EMULATOR_ONLY.contains(&key.as_str()) {
            out.push(format!(
                "BrokerProperties.{key}: Azure none, emulator {}",
                emulator[key]
            ));
        }
    }
    out
}

/// Everything a client depends on in which the emulator's answer differs from Azure's.
fn differences(x: &Exchange, got: &Answer) -> Vec<String> {
    let mut out = Vec::new();
    if x.status != got.status {
        out.push(format!(
            "status: Azure {}, emulator {}",
            x.status, got.status
        ));
    }
    let media = |s: Option<&String>| s.map(|s| s.replace(' ', "").to_ascii_lowercase());
    if media(x.headers.get("content-type")) != media(got.headers.get("content-type")) {
        out.push(format!(
            "content-type: Azure {:?}, emulator {:?}",
            x.headers.get("content-type"),
            got.headers.get("content-type")
        ));
    }
    if let Some(a) = x.headers.get("date") {
        if got.headers.get("date").map(|d| time_form(d)) != Some(time_form(a)) {
            out.push(format!(
                "date: Azure {a:?}, emulator {:?}",
                got.headers.get("date")
            ));
        }
    }
    match (x.headers.get("location"), got.headers.get("location")) {
        (Some(_), None) => out.push("Location: Azure sent one, the emulator none".into()),
        (None, Some(e)) => out.push(format!("Location: Azure none, emulator {e:?}")),
        (Some(a), Some(e)) => {
            let (a, e) = (location_path(a), location_path(e));
            match (&a, &e) {
                (Ok((_, qa)), Ok((_, qe))) if qa == qe => {}
                _ => out.push(format!("Location: Azure {a:?}, emulator {e:?}")),
            }
            if let (Ok((_, _)), Ok((path, _))) = (&a, &e) {
                let lock = path.rsplit('/').next().unwrap_or("");
                let token = broker_properties(&got.headers).and_then(|b| {
                    b.get("LockToken")
                        .and_then(|t| t.as_str().map(str::to_string))
                });
                if token.as_deref() != Some(lock) {
                    out.push(format!(
                        "Location's lock {lock:?} is not BrokerProperties.LockToken {token:?}"
                    ));
                }
            }
        }
        (None, None) => {}
    }
    out.extend(broker_differences(x, got));
    if x.body.as_deref().unwrap_or("") != got.body {
        out.push(format!("body: Azure {:?}, emulator {:?}", x.body, got.body));
    }
    out
}

/// The recording's request as it is replayed: a settlement addresses the message by the
/// `Location` the emulator gave it, where Azure's named Azure's.
fn addressed(x: &Exchange, locations: &BTreeMap<String, String>) -> Exchange {
    let mut x = x.clone();
    let (path, query) = x
        .path_and_query
        .split_once('?')
        .map(|(p, q)| (p.to_string(), format!("?{q}")))
        .unwrap_or((x.path_and_query.clone(), String::new()));
    if let Some(mine) = locations.get(&path.to_ascii_lowercase()) {
        x.path_and_query = format!("{mine}{query}");
    }
    x
}

#[tokio::test]
async fn service_bus_emulator_sends_locks_and_settles_as_azure_did() {
    let queues = ["sbqueue15", "sbqueue17"].map(|name| {
        let mut spec = QueueSpec::new(name);
        // As the recording's queues were created: PT1M lock, no duplicate detection.
        spec.lock_duration = std::time::Duration::from_secs(LOCK_SECS as u64);
        spec.duplicate_detection_window = None;
        spec
    });
    let config = ServiceBusConfig {
        queues: queues.to_vec(),
        ..Default::default()
    };
    let key = config.key.clone();
    let emu = ServiceBusEmulator::start(config)
        .await
        .expect("service bus");
    let base = format!("http://{}", emu.local_addr());
    let mut locations = BTreeMap::new();
    let mut all = Vec::new();
    for x in load(FILE) {
        let x = addressed(&x, &locations);
        let queue = x.path_and_query[1..].split('/').next().unwrap_or("");
        let auth = key.token(&format!("{base}/{queue}"), 4_102_444_800);
        let got = replay(&base, &x, Some(auth)).await;
        if let (Some(a), Some(e)) = (x.headers.get("location"), got.headers.get("location")) {
            if let (Ok((a, _)), Ok((e, _))) = (location_path(a), location_path(e)) {
                locations.insert(a.to_ascii_lowercase(), e);
            }
        }
        all.extend(
            differences(&x, &got)
                .into_iter()
                .map(|d| format!("{} {} {}: {d}", x.source, x.method, x.path_and_query)),
        );
    }
    assert!(
        all.is_empty(),
        "differences from Azure:\n{}",
        all.join("\n")
    );
}

/// The comparison can fail: Azure's peek-lock answer, altered as the emulator could answer
/// (a zero lock token and an expiry in 1970, an `EnqueuedSequenceNumber` that is the
/// sequence number, a lock-free message with a lock token, a `Location` without the lock),
/// is named each time.
#[test]
fn each_broker_difference_is_named() {
    let x = load(FILE);
    let (peek, take) = (&x[1], &x[6]);
    let answer = |from: &Exchange, bp: &str, location: Option<&str>| {
        let mut headers = from.headers.clone();
        headers.insert("brokerproperties".into(), bp.into());
        match location {
            Some(l) => headers.insert("location".into(), l.into()),
            None => headers.remove("location"),
        };
        Answer {
            status: from.status,
            headers,
            body: from.body.clone().unwrap_or_default(),
        }
    };
    let azure_bp = peek.headers["brokerproperties"].clone();
    let location = peek.headers["location"].clone();
    assert!(differences(peek, &answer(peek, &azure_bp, Some(&location))).is_empty());
    let stale = azure_bp.replace(
        "Wed, 05 Jun 2013 09:16:14 GMT",
        "Thu, 01 Jan 1970 00:00:00 GMT",
    );
    let renumbered = azure_bp.replace(
        "\"EnqueuedSequenceNumber\":0",
        "\"EnqueuedSequenceNumber\":1",
    );
    let found = [
        differences(peek, &answer(peek, &stale, Some(&location))),
        differences(peek, &answer(peek, &renumbered, Some(&location))),
        differences(
            take,
            &answer(
                take,
                &take.headers["brokerproperties"].replace(
                    "{",
                    "{\"LockToken\":\"00000000-0000-0000-0000-000000000000\",",
                ),
                None,
            ),
        ),
        differences(
            peek,
            &answer(peek, &azure_bp, Some("http://h/sbqueue15/messages/1")),
        ),
    ];
    assert!(
        found[0].iter().any(|d| d.contains("LockedUntilUtc")),
        "{found:?}"
    );
    assert!(
        found[1]
            .iter()
            .any(|d| d.contains("EnqueuedSequenceNumber")),
        "{found:?}"
    );
    assert!(
        found[2].iter().any(|d| d.contains("LockToken")),
        "{found:?}"
    );
    assert!(found[3].iter().any(|d| d.contains("Location")), "{found:?}");
}
