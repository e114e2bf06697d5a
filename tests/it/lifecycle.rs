//! The Azure Storage lifecycle management policy in `deploy/azure/` and the blob index tags
//! it filters on: the policy deletes DELIVERED ledger records and nothing else hubguard
//! writes (waiting retries, dead letters, the indexes), checked against the names and tags
//! hubguard's own code writes through its REST client to the blob emulator; and the
//! emulator checks index tags as Azure does (Azurite too, when installed).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use azure_core::Bytes;
use hubguard::azure::blob::{BlobContainer, Condition};
use hubguard::azure::BlobRecordStore;
use hubguard::ledger::{state_index_value, Ledger, State, STATE_INDEX_TAG};

use crate::blob::backends;
use crate::common::within;
use crate::ledger_scale::record;

fn repo(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The container of `hubguard.example.toml`'s and the README's examples.
fn example_container() -> String {
    let text = std::fs::read_to_string(repo("hubguard.example.toml")).unwrap();
    let cfg: toml::Value = toml::from_str(&text).unwrap();
    let url = cfg["storage"]["container_url"].as_str().unwrap();
    url.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap()
        .to_string()
}

/// One rule of the policy, as much of it as hubguard's layout concerns.
struct Rule {
    prefixes: Vec<String>,
    tags: Vec<(String, String, String)>,
    delete_after_days: Option<u64>,
}

fn rules() -> Vec<Rule> {
    let text = std::fs::read_to_string(repo("deploy/azure/lifecycle-policy.json")).unwrap();
    let policy: serde_json::Value = serde_json::from_str(&text).expect("the policy parses");
    let rules = policy["rules"].as_array().expect("rules").clone();
    assert!(!rules.is_empty());
    rules
        .iter()
        .map(|r| {
            assert_eq!(r["type"], "Lifecycle", "{r}");
            assert_eq!(r["enabled"], true, "{r}");
            let f = &r["definition"]["filters"];
            assert_eq!(f["blobTypes"], serde_json::json!(["blockBlob"]), "{r}");
            let strings = |v: &serde_json::Value| -> Vec<String> {
                v.as_array()
                    .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
                    .unwrap_or_default()
            };
            Rule {
                prefixes: strings(&f["prefixMatch"]),
                tags: f["blobIndexMatch"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|t| {
                                (
                                    t["name"].as_str().unwrap().to_string(),
                                    t["op"].as_str().unwrap().to_string(),
                                    t["value"].as_str().unwrap().to_string(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                delete_after_days: r["definition"]["actions"]["baseBlob"]["delete"]
                    ["daysAfterModificationGreaterThan"]
                    .as_u64(),
            }
        })
        .collect()
}

/// Whether `rule` selects the blob `{container}/{name}` with index tags `tags`, as the
/// lifecycle service evaluates filters: any prefix, and every tag condition.
fn selects(rule: &Rule, container: &str, name: &str, tags: &BTreeMap<String, String>) -> bool {
    let full = format!("{container}/{name}");
    (rule.prefixes.is_empty() || rule.prefixes.iter().any(|p| full.starts_with(p)))
        && rule.tags.iter().all(|(k, op, v)| {
            assert_eq!(op, "==", "hubguard's policy only compares for equality");
            tags.get(k) == Some(v)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lifecycle_policy_deletes_only_delivered_records() {
    let container = example_container();
    let rules = rules();
    let emu = hubguard::emulator::blob::BlobEmulator::start(Default::default())
        .await
        .unwrap();
    let url = emu.container_url(&container);
    let client = Arc::new(BlobContainer::new(&url, None, Duration::from_secs(5)).unwrap());
    within("create container", client.create_container())
        .await
        .unwrap();
    let store =
        Arc::new(BlobRecordStore::on(client.clone(), Duration::from_secs(5)).with_index_tags(true));
    let ledger = Ledger::new(store.clone(), "hub", "$Default");
    let due = SystemTime::now() + Duration::from_secs(3600);
    // Waiting, then delivered: the tag follows the record's last write.
    ledger
        .put(
            &record("delivered", 1, State::RetryScheduled, Some(due)),
            None,
        )
        .await
        .unwrap();
    let hubguard::ledger::Versioned {
        value: mut rec,
        etag,
    } = ledger.get("delivered").await.unwrap().unwrap();
    rec.deliver();
    rec.attempts = 2;
    ledger.put(&rec, Some(&etag)).await.unwrap();
    ledger
        .put(
            &record("waiting", 2, State::RetryScheduled, Some(due)),
            None,
        )
        .await
        .unwrap();
    ledger.index_dead_letter("dead").await.unwrap();
    ledger
        .put(&record("dead", 3, State::DeadLettered, None), None)
        .await
        .unwrap();
    // A dead letter replayed: waiting again, so no longer "dead-lettered" either.
    ledger.index_dead_letter("replayed").await.unwrap();
    ledger
        .put(&record("replayed", 4, State::DeadLettered, None), None)
        .await
        .unwrap();
    let hubguard::ledger::Versioned {
        value: mut rec,
        etag,
    } = ledger.get("replayed").await.unwrap().unwrap();
    rec.schedule_retry(hubguard::ledger::ms(due));
    ledger.put(&rec, Some(&etag)).await.unwrap();
    ledger.pending().await.unwrap(); // writes the index marker

    // Every blob hubguard wrote, with its index tags as Get Blob Tags answers.
    let mut selected = Vec::new();
    let mut names = Vec::new();
    for item in client.list_blobs("", false).await.unwrap() {
        let tags: BTreeMap<String, String> = client
            .get_tags(&item.name)
            .await
            .unwrap()
            .unwrap()
            .into_iter()
            .collect();
        if item.name == ledger.record_name("waiting") {
            assert_eq!(
                tags.get(STATE_INDEX_TAG).map(String::as_str),
                Some(state_index_value(State::RetryScheduled))
            );
        }
        if rules
            .iter()
            .any(|r| selects(r, &container, &item.name, &tags))
        {
            selected.push(item.name.clone());
        }
        names.push(item.name);
    }
    for expected in [
        ledger.record_name("waiting"),
        ledger.entry_name("waiting"),
        ledger.dead_letter_name("dead"),
        ledger.index_marker(),
    ] {
        assert!(names.contains(&expected), "{expected} not in {names:?}");
    }
    assert_eq!(
        selected,
        vec![ledger.record_name("delivered")],
        "the policy selects only the delivered record among {names:?}"
    );

    // Every rule that deletes is confined to the records and to the delivered tag, computed
    // from the ledger's own layout and constants.
    let records = ledger.record_name("k");
    let area = &records[..records.find('/').unwrap() + 1];
    for rule in &rules {
        let Some(days) = rule.delete_after_days else {
            continue;
        };
        assert!(!rule.prefixes.is_empty());
        for p in &rule.prefixes {
            assert_eq!(p, &format!("{container}/{area}"), "prefix {p}");
        }
        assert!(rule.tags.contains(&(
            STATE_INDEX_TAG.to_string(),
            "==".to_string(),
            state_index_value(State::Delivered).to_string()
        )));
        // hubguard's own retention goes first; the platform only catches what it left.
        let retention_days = hubguard::pipeline::DEFAULT_RETENTION.as_secs() / 86_400;
        assert!(days > retention_days, "{days} days");
    }
}

/// The tag rides on the record's own Put Blob: a record's life (first failure, retry,
/// delivery) makes as many writes with `lifecycle_tags` as without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_tag_adds_no_call() {
    let mut writes = Vec::new();
    for tagged in [false, true] {
        let emu = hubguard::emulator::blob::BlobEmulator::start(Default::default())
            .await
            .unwrap();
        let client = Arc::new(
            BlobContainer::new(&emu.container_url("hubguard"), None, Duration::from_secs(5))
                .unwrap(),
        );
        client.create_container().await.unwrap();
        emu.store().record_writes();
        let ledger = Ledger::new(
            Arc::new(
                BlobRecordStore::on(client.clone(), Duration::from_secs(5)).with_index_tags(tagged),
            ),
            "hub",
            "$Default",
        );
        let due = SystemTime::now() + Duration::from_secs(60);
        ledger
            .put(&record("k", 1, State::RetryScheduled, Some(due)), None)
            .await
            .unwrap();
        let hubguard::ledger::Versioned {
            value: mut rec,
            etag,
        } = ledger.get("k").await.unwrap().unwrap();
        rec.attempts = 2;
        rec.deliver();
        ledger.put(&rec, Some(&etag)).await.unwrap();
        let tags = client
            .get_tags(&ledger.record_name("k"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(tags.is_empty(), !tagged, "{tags:?}");
        writes.push(emu.store().writes().len());
    }
    assert_eq!(writes[0], writes[1], "writes without and with the tag");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_lifecycle_tags_a_record_write_sends_no_index_tag() {
    let emu = hubguard::emulator::blob::BlobEmulator::start(Default::default())
        .await
        .unwrap();
    let client = Arc::new(
        BlobContainer::new(&emu.container_url("hubguard"), None, Duration::from_secs(5)).unwrap(),
    );
    client.create_container().await.unwrap();
    let ledger = Ledger::new(
        Arc::new(BlobRecordStore::on(client.clone(), Duration::from_secs(5))),
        "hub",
        "$Default",
    );
    let mut rec = record("k", 1, State::Delivered, None);
    rec.attempts = 2;
    ledger.put(&rec, None).await.unwrap();
    let tags = client
        .get_tags(&ledger.record_name("k"))
        .await
        .unwrap()
        .unwrap();
    assert!(tags.is_empty(), "{tags:?}");
}

/// What Azure accepts and refuses as blob index tags ("Manage and find Azure Blob data with
/// blob index tags", learn.microsoft.com/azure/storage/blobs/storage-manage-find-blobs), on
/// Put Blob (`x-ms-tags`) and Set Blob Tags; Azurite answers the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_index_tags_are_checked_and_replaced_as_azure_does() {
    for backend in backends().await {
        let name = backend.name();
        let client = BlobContainer::new(
            &backend.container_url("tags"),
            None,
            Duration::from_secs(10),
        )
        .unwrap();
        client.create_container().await.unwrap();
        let put = |blob: &'static str, tags: Vec<(String, String)>| {
            let client = &client;
            async move {
                let pairs: Vec<(&str, &str)> =
                    tags.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                client
                    .put_blob_tagged(
                        blob,
                        Bytes::from_static(b"x"),
                        "application/json",
                        &[],
                        &pairs,
                        &Condition::None,
                    )
                    .await
            }
        };
        let t = |k: &str, v: &str| (k.to_string(), v.to_string());
        // Every allowed character, the longest key and value.
        let allowed = "aZ09 +-./:=_";
        let long_key = "k".repeat(128);
        let long_value = "v".repeat(256);
        put(
            "ok",
            vec![
                t(allowed, allowed),
                t(&long_key, &long_value),
                t("empty", ""),
                t(STATE_INDEX_TAG, "delivered"),
            ],
        )
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let got: BTreeMap<String, String> = client
            .get_tags("ok")
            .await
            .unwrap()
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(
            got.get(allowed).map(String::as_str),
            Some(allowed),
            "{name}"
        );
        assert_eq!(got.get(&long_key), Some(&long_value), "{name}");
        assert_eq!(got.get("empty").map(String::as_str), Some(""), "{name}");
        assert_eq!(got.len(), 4, "{name}: {got:?}");

        let refused = |tags: Vec<(String, String)>, code: &'static str| {
            let put = &put;
            async move {
                let e = put("bad", tags).await.expect_err("refused");
                assert_eq!(e.status(), Some(400), "{name}: {e}");
                // Azurite 3.37's StorageErrorFactory.getInvalidTag answers Azure's message for
                // a character that is not permitted under the code `DuplicateTagNames`; Azure
                // (and our emulator) answer `InvalidTag`.
                let azurite_quirk = name == "Azurite"
                    && code == "InvalidTag"
                    && e.code() == Some("DuplicateTagNames");
                assert!(e.code() == Some(code) || azurite_quirk, "{name}: {e}");
            }
        };
        refused(
            (0..11).map(|i| t(&format!("k{i}"), "v")).collect(),
            "TagsTooLarge",
        )
        .await;
        refused(vec![t(&"k".repeat(129), "v")], "TagsTooLarge").await;
        refused(vec![t("k", &"v".repeat(257))], "TagsTooLarge").await;
        refused(vec![t("", "v")], "EmptyTagName").await;
        refused(vec![t("k", "a,b")], "InvalidTag").await;
        refused(vec![t("k!", "v")], "InvalidTag").await;

        // Set Blob Tags replaces them all and leaves the ETag alone.
        let before = client.get_blob("ok").await.unwrap().unwrap().etag;
        client
            .set_tags("ok", &[("only", "one")])
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = client.get_tags("ok").await.unwrap().unwrap();
        assert_eq!(got, vec![t("only", "one")], "{name}");
        let after = client.get_blob("ok").await.unwrap().unwrap().etag;
        assert_eq!(before, after, "{name}: Set Blob Tags changed the ETag");
        let e = client
            .set_tags("ok", &[("bad,char", "v")])
            .await
            .expect_err("refused");
        assert_eq!(e.status(), Some(400), "{name}: {e}");
        assert!(
            e.code() == Some("InvalidTag")
                || (name == "Azurite" && e.code() == Some("DuplicateTagNames")),
            "{name}: {e}"
        );

        // Put Blob replaces the blob and its tags: none given, none kept.
        put("ok", Vec::new()).await.unwrap();
        let got = client.get_tags("ok").await.unwrap().unwrap();
        assert!(got.is_empty(), "{name}: {got:?}");
    }
}
