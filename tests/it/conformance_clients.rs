//! hubguard's own clients against Azure's answers (issue 43): a replay server answers with
//! the recordings in `tests/data/azure-recordings` byte for byte — the byte-order mark, the
//! unquoted listing ETags, Azure's error bodies, the Atom entry with its namespaces — and
//! hubguard's blob client, its checkpoint store and its Service Bus client read them. A change
//! of XML library or parser that breaks the real path fails here, whatever the emulators do.
//!
//! The replay server answers a request with the first unused recorded exchange of the same
//! method, path, `comp` and `prefix`. The one answer it makes up: a List Blobs of a prefix no
//! recording lists is answered as Azure answers an empty prefix (a listing without blobs),
//! so a client that lists more than one prefix can be replayed; anything else unrecorded is a
//! 501 that fails the test. (A locked message's recorded `Location` names the recording's
//! namespace; hubguard's Service Bus client, pointed at an emulator endpoint, sends every
//! request and lock there, here the replay server.)

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use azure_messaging_eventhubs::CheckpointStore;
use hubguard::azure::blob::Condition;
use hubguard::azure::{BlobCheckpointStore, BlobContainer, ConnectionString, ServiceBusRetryQueue};

use super::common::within;
use super::conformance::{load, Exchange};

type Pool = Arc<Mutex<Vec<Exchange>>>;

fn query(uri: &str) -> BTreeMap<String, String> {
    let q = uri.split_once('?').map(|(_, q)| q).unwrap_or("");
    url::form_urlencoded::parse(q.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

fn decoded_path(uri: &str) -> String {
    let path = uri.split('?').next().unwrap_or("");
    percent_encoding::percent_decode_str(path)
        .decode_utf8_lossy()
        .into_owned()
}

/// The key a request is matched by: method, decoded path (a Service Bus path, which names
/// `messages` and `head` in either case, in lower case), `comp` and `prefix`.
fn key(method: &str, uri: &str) -> (String, String, Option<String>, Option<String>) {
    let q = query(uri);
    let path = decoded_path(uri);
    let path = if path.to_ascii_lowercase().contains("/messages") {
        path.to_ascii_lowercase()
    } else {
        path
    };
    (
        method.to_string(),
        path,
        q.get("comp").cloned(),
        q.get("prefix").cloned(),
    )
}

async fn answer(State(pool): State<Pool>, method: Method, uri: Uri) -> Response {
    let uri = uri.to_string();
    let wanted = key(method.as_str(), &uri);
    let found = {
        let mut pool = pool.lock().unwrap();
        let at = pool
            .iter()
            .position(|x| key(&x.method, &x.path_and_query) == wanted);
        at.map(|i| pool.remove(i))
    };
    let Some(x) = found else {
        if wanted.2.as_deref() == Some("list") {
            let prefix = wanted.3.unwrap_or_default();
            let body = format!("\u{feff}<?xml version=\"1.0\" encoding=\"utf-8\"?><EnumerationResults ServiceEndpoint=\"http://replay/\" ContainerName=\"container\"><Prefix>{prefix}</Prefix><Blobs /><NextMarker /></EnumerationResults>");
            return (StatusCode::OK, [("content-type", "application/xml")], body).into_response();
        }
        return (
            StatusCode::NOT_IMPLEMENTED,
            format!("not recorded: {method} {uri}"),
        )
            .into_response();
    };
    let mut headers = HeaderMap::new();
    for (k, v) in &x.headers {
        if matches!(
            k.as_str(),
            "transfer-encoding" | "content-length" | "server"
        ) {
            continue;
        }
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.insert(k, v);
        }
    }
    let status = StatusCode::from_u16(x.status).expect("a status");
    let body = Bytes::from(x.body.unwrap_or_default().into_bytes());
    (status, headers, body).into_response()
}

/// Serves the exchanges of `files` on a loopback port; returns `http://127.0.0.1:PORT`.
async fn replay_server(files: &[&str]) -> (String, tokio::task::JoinHandle<()>) {
    let pool: Pool = Arc::new(Mutex::new(files.iter().flat_map(|f| load(f)).collect()));
    let app = axum::Router::new().fallback(answer).with_state(pool);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), task)
}

const NS: &str = "eh-t7d71a09db13a76aa.servicebus.windows.net";

#[tokio::test]
async fn blob_client_reads_azures_listing_errors_and_etags() {
    let (base, server) = replay_server(&[
        "update_checkpoint_verify_in_list_checkpoints.json",
        "claim_ownership_concurrent_update_should_fail.json",
    ])
    .await;
    let c =
        BlobContainer::new(&format!("{base}/container"), None, Duration::from_secs(10)).unwrap();
    let name = format!("{NS}/testeventhub/$Default/checkpoint/5");
    let meta = [("offset", "99999"), ("sequencenumber", "42")];
    let written = within(
        "set metadata",
        c.set_metadata(&name, &meta, &Condition::None),
    )
    .await
    .expect("Azure's 200");
    assert_eq!(written.etag, "\"0x8DDF489CEAA3B7A\"");
    assert!(written.last_modified.is_some(), "Last-Modified read");
    let prefix = format!("{NS}/testeventhub/$Default/checkpoint/");
    let items = within("list", c.list_blobs(&prefix, true))
        .await
        .expect("Azure's listing, BOM and all");
    assert_eq!(items.len(), 6);
    let five = items
        .iter()
        .find(|i| i.name == name)
        .expect("checkpoint 5 listed");
    // The bug class issue 43 names: Azure lists `0x8DD…` and writes `"0x8DD…"`.
    assert_eq!(
        five.etag, written.etag,
        "a listed ETag compares equal to the written one"
    );
    assert_eq!(five.meta("sequencenumber"), Some("42"));
    assert_eq!(items[0].meta("offset"), Some("12345"));
    assert!(items.iter().all(|i| i.last_modified.is_some()));

    let owner = format!("{NS}g96yQ86txBRg/testeventhub/$Default/ownership/0");
    let created = within(
        "create",
        c.put_blob(
            &owner,
            Bytes::new(),
            "application/octet-stream",
            &[("ownerid", "initial-owner")],
            &Condition::IfNotExists,
        ),
    )
    .await
    .expect("Azure's 201");
    assert_eq!(created.etag, "\"0x8DDF489CEC325BB\"");
    let refused = within(
        "stale update",
        c.set_metadata(
            &owner,
            &[("ownerid", "concurrent-owner")],
            &Condition::IfMatch("stale-etag-value".into()),
        ),
    )
    .await
    .expect_err("Azure's 412");
    assert_eq!(refused.status(), Some(412));
    assert_eq!(refused.code(), Some("ConditionNotMet"));
    assert!(
        refused
            .to_string()
            .contains("The condition specified using HTTP conditional header(s) is not met."),
        "the message read from Azure's error body: {refused}"
    );
    server.abort();
}

#[tokio::test]
async fn checkpoint_store_reads_azures_checkpoints() {
    let (base, server) =
        replay_server(&["update_checkpoint_verify_in_list_checkpoints.json"]).await;
    let c =
        BlobContainer::new(&format!("{base}/container"), None, Duration::from_secs(10)).unwrap();
    let store = BlobCheckpointStore::new(Arc::new(c));
    let mut found = within(
        "list checkpoints",
        store.list_checkpoints(NS, "testeventhub", "$Default"),
    )
    .await
    .expect("Azure's listing");
    found.sort_by(|a, b| a.partition_id.cmp(&b.partition_id));
    let seen: Vec<(String, Option<String>, Option<i64>)> = found
        .iter()
        .map(|c| (c.partition_id.clone(), c.offset.clone(), c.sequence_number))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("0".into(), Some("12345".into()), Some(100)),
            ("1".into(), Some("67890".into()), None),
            ("2".into(), None, Some(200)),
            ("3".into(), None, None),
            ("4".into(), Some("300".into()), Some(30)),
            ("5".into(), Some("99999".into()), Some(42)),
        ]
    );
    server.abort();
}

#[tokio::test]
async fn service_bus_client_reads_azures_queue_description() {
    let (base, server) =
        replay_server(&["test_mgmt_queue_get_runtime_properties_basic.json"]).await;
    let host = base.trim_start_matches("http://");
    let cs: ConnectionString = format!(
        "Endpoint=sb://{host};SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=replayed;UseDevelopmentEmulator=true"
    )
    .parse()
    .unwrap();
    let q = ServiceBusRetryQueue::new(&cs, "test_queue", Default::default()).unwrap();
    let d = within("describe", q.describe())
        .await
        .expect("Azure's Atom entry");
    assert!(!d.requires_duplicate_detection);
    assert_eq!(
        d.duplicate_detection_history_time_window,
        Some(Duration::from_secs(600))
    );
    assert_eq!(d.lock_duration, Some(Duration::from_secs(60)));
    assert_eq!(d.max_delivery_count, Some(10));
    assert_eq!(d.max_message_size_in_kilobytes, Some(256));
    server.abort();
}

/// hubguard's blob client on Azure's answers to the reads and writes of its ledger: a ranged
/// download (206, the bytes the Rust SDK recorded), a revalidation Azure answers 304 with
/// `x-ms-error-code: ConditionNotMet` and no body, a tagged Put Blob (its `x-ms-tags` encoded
/// as the Rust SDK sent it), a second create refused 409 `BlobAlreadyExists` with Azure's
/// error body, and a blob's index tags written and read back (a BOM-prefixed `<Tags>`,
/// Azure's key order, an empty `<TagSet/>`).
#[tokio::test]
async fn blob_client_reads_azures_downloads_conditions_and_tags() {
    let (base, server) = replay_server(&[
        "test_download_blob.json",
        "DownloadAsync_AccessConditionsFail.json",
        "test_blob_error_codes.json",
        "test_find_blobs_by_tags_container.json",
        "test_blob_tags.json",
    ])
    .await;
    let container = |name: &str| {
        BlobContainer::new(&format!("{base}/{name}"), None, Duration::from_secs(10)).unwrap()
    };

    let got = within(
        "get",
        container("containeryurads2q").get_blob("blobzognjof7"),
    )
    .await
    .expect("Azure's 206")
    .expect("the blob");
    assert_eq!(&got.body[..], b"hello rusty world");
    assert_eq!(got.etag, "\"0x8DE91C7E6082773\"");

    let c = container("test-container-1bb8a581-c1d8-d4ab-9f28-f09646c38a80");
    let still = within(
        "revalidate",
        c.get_blob_if_none_match(
            "test-blob-bb6e0467-02d9-4764-0bb6-78fa16272c2c",
            "\"0x8DC867E53BE7CFB\"",
        ),
    )
    .await
    .expect("Azure's 304 is no error");
    assert_eq!(still, hubguard::azure::blob::Revalidated::NotModified);

    let c = container("containerq6oeq2hx");
    let created = within(
        "create",
        c.put_blob(
            "blobtbpve6cz",
            Bytes::from_static(b"hello rusty world"),
            "application/octet-stream",
            &[],
            &Condition::IfNotExists,
        ),
    )
    .await
    .expect("Azure's 201");
    assert_eq!(created.etag, "\"0x8DE95B904218744\"");
    let again = within(
        "create again",
        c.put_blob(
            "blobtbpve6cz",
            Bytes::from_static(b"duplicate"),
            "application/octet-stream",
            &[],
            &Condition::IfNotExists,
        ),
    )
    .await
    .expect_err("Azure's 409");
    assert_eq!(again.status(), Some(409));
    assert_eq!(again.code(), Some("BlobAlreadyExists"));
    assert!(
        again
            .to_string()
            .contains("The specified blob already exists."),
        "the message read from Azure's error body: {again}"
    );

    // The index tags as the Rust SDK sent them on Put Blob, and Azure's 201 to hubguard's.
    let recorded = load("test_find_blobs_by_tags_container.json");
    let sent = recorded[1]
        .request_headers
        .iter()
        .find(|(k, _)| k == "x-ms-tags")
        .map(|(_, v)| v.as_str());
    let tags = [("alice", "bob"), ("foo", "bar")];
    assert_eq!(
        Some(hubguard::azure::blob::encode_tags(&tags).as_str()),
        sent
    );
    let tagged = within(
        "tagged put",
        container("containertgz5iggy").put_blob_tagged(
            "blobuqswufus",
            Bytes::from_static(b"hello world"),
            "application/octet-stream",
            &[],
            &tags,
            &Condition::IfNotExists,
        ),
    )
    .await
    .expect("Azure's 201");
    assert_eq!(tagged.etag, "\"0x8DDF0B7EE8DF1BA\"");

    let c = container("containerixiypqyq");
    within(
        "set tags",
        c.set_tags("blobl5gkhn0s", &[("hello", "world"), ("ferris", "crab")]),
    )
    .await
    .expect("Azure's 204");
    let read = within("get tags", c.get_tags("blobl5gkhn0s"))
        .await
        .expect("Azure's 200")
        .expect("the blob");
    assert_eq!(
        read,
        vec![
            ("ferris".to_string(), "crab".to_string()),
            ("hello".to_string(), "world".to_string())
        ],
        "Azure's tag set, BOM and all, in Azure's order"
    );
    within("clear tags", c.set_tags("blobl5gkhn0s", &[]))
        .await
        .expect("Azure's 204");
    let none = within("get tags", c.get_tags("blobl5gkhn0s"))
        .await
        .expect("Azure's 200")
        .expect("the blob");
    assert!(none.is_empty(), "an empty <TagSet/>: {none:?}");
    server.abort();
}

/// hubguard's Service Bus client on Azure's REST answers (the legacy Node.js SDK's recording):
/// a send Azure took (201, an empty XML-typed body), a peek-lock Azure answered with the
/// message, its `Location` and `BrokerProperties` of 2013 (no `EnqueuedTimeUtc`, a lock that
/// has long expired), then the lock completed (200) and, on a second queue, abandoned (200).
#[tokio::test]
async fn service_bus_client_sends_receives_and_settles_on_azures_answers() {
    let (base, server) = replay_server(&["servicebusservice-tests.queue-messages.json"]).await;
    let host = base.trim_start_matches("http://");
    let cs: ConnectionString = format!(
        "Endpoint=sb://{host};SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=replayed;UseDevelopmentEmulator=true"
    )
    .parse()
    .unwrap();
    for (queue, lock, settle) in [
        (
            "sbqueue15",
            "7165bfeb-2fab-4369-8293-ba71d1854282",
            "complete",
        ),
        (
            "sbqueue17",
            "6f1e9e03-455e-48bc-a5e9-c3a48a577730",
            "abandon",
        ),
    ] {
        let q = ServiceBusRetryQueue::new(&cs, queue, Default::default()).unwrap();
        within(
            "send",
            hubguard::azure::RetryQueue::schedule(
                &q,
                hubguard::azure::OutgoingMessage {
                    message_id: "615451d11eaa42698d73e2a7b1862ec5".into(),
                    correlation_id: None,
                    label: None,
                    body: "hi there again".into(),
                    content_type: None,
                    due: std::time::SystemTime::UNIX_EPOCH,
                    time_to_live: None,
                    properties: Vec::new(),
                },
            ),
        )
        .await
        .expect("Azure's 201");
        let m = within(
            "peek-lock",
            hubguard::azure::RetryQueue::receive(&q, Duration::from_secs(5)),
        )
        .await
        .expect("Azure's 201")
        .expect("a message");
        assert_eq!(m.body, "hi there again");
        assert_eq!((m.delivery_count, m.sequence_number), (1, 1));
        assert_eq!(m.message_id.len(), 32);
        assert!(
            m.enqueued_at.is_none(),
            "Azure's 2013 answer has no EnqueuedTimeUtc"
        );
        assert_eq!(
            m.locked_until,
            hubguard::clock::parse_http_date(if queue == "sbqueue15" {
                "Wed, 05 Jun 2013 09:16:14 GMT"
            } else {
                "Wed, 05 Jun 2013 09:17:03 GMT"
            })
            .unwrap()
        );
        let settled = if settle == "complete" {
            within("complete", m.complete()).await
        } else {
            within("abandon", m.abandon()).await
        };
        settled.unwrap_or_else(|e| panic!("{settle} of lock {lock}: Azure's 200, not {e}"));
    }
    server.abort();
}
