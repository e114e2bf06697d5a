//! The emulators held to Azure's own answers (issue 43): each exchange of the recordings in
//! `tests/data/azure-recordings` (real Azure traffic recorded by the official SDKs' tests,
//! copied from Azure/azure-sdk-assets; see `PROVENANCE.md` there) is replayed against
//! `hubguard`'s emulators, and what a client depends on is compared with what Azure answered:
//! the status, the error code and message, the form of ETags (quoted in headers, unquoted in
//! a listing) and of times, the content type, the echoed `x-ms-version`, the byte-order mark
//! and the structure of XML bodies (element names and order), and the values of a listing
//! or a queue description. Every difference is named; `docs/conformance.md` says why each
//! element Azure sends and the emulators leave out cannot matter.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::SystemTime;

use hubguard::emulator::blob::{BlobConfig, BlobEmulator};
use hubguard::emulator::servicebus::{QueueSpec, ServiceBusConfig, ServiceBusEmulator};
use quick_xml::events::Event;

use super::common::within;

/// One recorded request and Azure's answer.
#[derive(Debug, Clone)]
pub(crate) struct Exchange {
    /// Where it comes from: `file#entry`.
    pub(crate) source: String,
    pub(crate) method: String,
    /// The path and query after the (sanitized) host.
    pub(crate) path_and_query: String,
    pub(crate) request_headers: Vec<(String, String)>,
    pub(crate) request_body: Vec<u8>,
    pub(crate) status: u16,
    /// Lower-cased names; a list of values joined with ", ".
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) body: Option<String>,
}

/// The exchanges of one recording, in order.
pub(crate) fn load(file: &str) -> Vec<Exchange> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/azure-recordings")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let doc: serde_json::Value = serde_json::from_str(&text).expect("a recording is JSON");
    let entries = doc["Entries"].as_array().expect("Entries");
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let uri = e["RequestUri"].as_str().expect("RequestUri");
            let after_host = uri.splitn(4, '/').nth(3).unwrap_or("");
            let text = |v: &serde_json::Value| match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Array(parts) => {
                    Some(parts.iter().filter_map(|p| p.as_str()).collect::<String>())
                }
                _ => None,
            };
            let headers = |v: &serde_json::Value| -> Vec<(String, String)> {
                v.as_object()
                    .map(|o| {
                        o.iter()
                            .map(|(k, v)| (k.to_ascii_lowercase(), text(v).unwrap_or_default()))
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let joined = |v: &serde_json::Value| -> BTreeMap<String, String> {
                let mut m = BTreeMap::new();
                for (k, v) in v.as_object().into_iter().flatten() {
                    let value = match v {
                        serde_json::Value::Array(p) => p
                            .iter()
                            .filter_map(|x| x.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        other => other.as_str().unwrap_or_default().to_string(),
                    };
                    m.insert(k.to_ascii_lowercase(), value);
                }
                m
            };
            let request_headers = headers(&e["RequestHeaders"]);
            let response_headers = joined(&e["ResponseHeaders"]);
            let request_length = request_headers
                .iter()
                .find(|(k, _)| k == "content-length")
                .map(|(_, v)| v.as_str());
            let request_body = text(&e["RequestBody"])
                .map(|b| binary(b, request_length))
                .unwrap_or_default();
            let body = match response_headers.get("content-type") {
                Some(t) if !t.contains("xml") => text(&e["ResponseBody"]).map(|b| {
                    let bytes = binary(
                        b,
                        response_headers.get("content-length").map(String::as_str),
                    );
                    String::from_utf8(bytes).expect("a recorded download is UTF-8 text")
                }),
                _ => text(&e["ResponseBody"]),
            };
            Exchange {
                source: format!("{file}#{}", i + 1),
                method: e["RequestMethod"].as_str().expect("method").to_string(),
                path_and_query: format!("/{after_host}"),
                request_headers,
                request_body,
                status: e["StatusCode"].as_u64().expect("StatusCode") as u16,
                headers: response_headers,
                body,
            }
        })
        .collect()
}

/// A recorded body as its bytes: the test proxy of the newer SDKs (Rust, .NET) records a body
/// that is not text in base64, so a body whose `Content-Length` is the length of its base64
/// decoding, and not its own, is decoded; any other body is its text.
fn binary(recorded: String, content_length: Option<&str>) -> Vec<u8> {
    use base64::Engine as _;
    let Some(n) = content_length.and_then(|n| n.parse::<usize>().ok()) else {
        return recorded.into_bytes();
    };
    if recorded.len() == n {
        return recorded.into_bytes();
    }
    match base64::engine::general_purpose::STANDARD.decode(&recorded) {
        Ok(bytes) if bytes.len() == n => bytes,
        _ => recorded.into_bytes(),
    }
}

/// An answer, as the emulator (or Azure) gave it.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) body: String,
}

/// Request headers that do not go to the emulator: credentials (sanitized in the
/// recordings; the emulator's own are added), and transport details the HTTP client sets.
const NOT_REPLAYED: &[&str] = &[
    "authorization",
    "content-length",
    "expect",
    "accept-encoding",
    "user-agent",
    "connection",
    "host",
    "transfer-encoding",
];

/// Sends one recorded request to `base` (`http://host:port/prefix`), with `auth` if given.
pub(crate) async fn replay(base: &str, x: &Exchange, auth: Option<String>) -> Answer {
    let client = reqwest::Client::new();
    let method = reqwest::Method::from_bytes(x.method.as_bytes()).expect("a method");
    let mut req = client
        .request(method, format!("{base}{}", x.path_and_query))
        .body(x.request_body.clone());
    for (k, v) in &x.request_headers {
        if !NOT_REPLAYED.contains(&k.as_str()) {
            req = req.header(k, v);
        }
    }
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let resp = within(&x.source, req.send())
        .await
        .expect("the emulator answers");
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let bytes = within(&x.source, resp.bytes()).await.expect("a body");
    // Raw bytes to text without dropping a byte-order mark (what `text()` would do).
    let body = String::from_utf8(bytes.to_vec()).expect("UTF-8");
    Answer {
        status,
        headers,
        body,
    }
}

/// One element of an XML document: its path of local names, its text, in document order.
type Element = (Vec<String>, String);

fn elements(xml: &str) -> Result<Vec<Element>, String> {
    let mut reader = quick_xml::Reader::from_str(xml.trim_start_matches('\u{feff}'));
    let (mut path, mut text, mut out) = (Vec::<String>::new(), String::new(), Vec::new());
    let local = |n: &[u8]| {
        let n = String::from_utf8_lossy(n).into_owned();
        n.rsplit(':').next().unwrap_or(&n).to_string()
    };
    loop {
        match reader.read_event().map_err(|e| e.to_string())? {
            Event::Start(e) => {
                path.push(local(e.name().as_ref()));
                out.push((path.clone(), String::new()));
                text.clear();
            }
            Event::Empty(e) => {
                path.push(local(e.name().as_ref()));
                out.push((path.clone(), String::new()));
                path.pop();
            }
            Event::Text(t) => text.push_str(&t.decode().map_err(|e| e.to_string())?),
            Event::GeneralRef(r) => text.push_str(&format!("&{};", String::from_utf8_lossy(&r))),
            Event::End(_) => {
                if let Some(open) = out.iter_mut().rev().find(|(p, _)| *p == path) {
                    open.1 = text.clone();
                }
                path.pop();
                text.clear();
            }
            Event::Eof => return Ok(out),
            _ => {}
        }
    }
}

/// Elements Azure sends that the emulators leave out, each a reason in docs/conformance.md
/// (none of them is read by hubguard, the Rust SDK's checkpoint store or its processor).
pub(crate) const AZURE_ONLY: &[&str] = &[
    "Content-Encoding",
    "Content-Language",
    "Content-CRC64",
    "Content-MD5",
    "Cache-Control",
    "Content-Disposition",
    "AccessTier",
    "AccessTierInferred",
    "OrMetadata",
];

/// Elements whose text is a time: compared by form, not value.
const TIMES: &[&str] = &[
    "Creation-Time",
    "Last-Modified",
    "published",
    "updated",
    "CreatedAt",
    "UpdatedAt",
    "AccessedAt",
];

/// Elements whose value names the recording's resources (its namespace, its host, a request
/// id or time in an error message): compared by presence (a message by its first line).
const VOLATILE: &[&str] = &["id", "name", "Message", "Etag"];

/// The form of a time as Azure writes it: RFC 1123 in blob storage, RFC 3339 (whole
/// seconds or milliseconds) in Service Bus.
pub(crate) fn time_form(s: &str) -> &'static str {
    let rfc3339 = |s: &str| {
        let b = s.as_bytes();
        s.len() >= 20
            && b[4] == b'-'
            && b[10] == b'T'
            && s.ends_with('Z')
            && match s.get(19..s.len() - 1) {
                Some("") => true,
                Some(f) => f.starts_with('.') && (2..=4).contains(&f.len()),
                None => false,
            }
    };
    if hubguard::clock::parse_http_date(s).is_some() && s.ends_with(" GMT") {
        "RFC 1123"
    } else if rfc3339(s) {
        "RFC 3339 (seconds or milliseconds)"
    } else {
        "another form"
    }
}

/// The differences between Azure's XML body and the emulator's.
fn xml_differences(azure: &str, emulator: &str) -> Vec<String> {
    let mut out = Vec::new();
    if azure.starts_with('\u{feff}') != emulator.starts_with('\u{feff}') {
        out.push(format!(
            "byte-order mark: Azure {}, emulator {}",
            azure.starts_with('\u{feff}'),
            emulator.starts_with('\u{feff}')
        ));
    }
    let (a, e) = match (elements(azure), elements(emulator)) {
        (Ok(a), Ok(e)) => (a, e),
        (a, e) => return vec![format!("XML: Azure {:?}, emulator {:?}", a.err(), e.err())],
    };
    // Structure: the sequence of element paths, Azure-only elements left out and metadata
    // (unordered, as Azure keeps a blob's metadata in no documented order) sorted.
    let shape = |els: &[Element]| -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = els
            .iter()
            .filter(|(p, _)| !p.iter().any(|n| AZURE_ONLY.contains(&n.as_str())))
            .map(|(p, t)| (p.join("/"), t.clone()))
            .collect();
        sort_metadata_runs(&mut v);
        v
    };
    let (sa, se) = (shape(&a), shape(&e));
    let paths = |v: &[(String, String)]| v.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>();
    let (pa, pe) = (paths(&sa), paths(&se));
    if pa != pe {
        let only_a: Vec<_> = pa.iter().filter(|p| !pe.contains(p)).take(5).collect();
        let only_e: Vec<_> = pe.iter().filter(|p| !pa.contains(p)).take(5).collect();
        out.push(format!(
            "XML structure: only Azure has {only_a:?}, only the emulator has {only_e:?}{}",
            if only_a.is_empty() && only_e.is_empty() {
                " (order or count differs)"
            } else {
                ""
            }
        ));
        return out;
    }
    for ((path, at), (_, et)) in sa.iter().zip(&se) {
        let name = path.rsplit('/').next().unwrap_or(path);
        if TIMES.contains(&name) {
            if time_form(at) != time_form(et) {
                out.push(format!(
                    "{path}: time form {} (Azure {at:?}) but {} ({et:?})",
                    time_form(at),
                    time_form(et)
                ));
            }
        } else if name == "Etag" {
            if at.starts_with('"') != et.starts_with('"') {
                out.push(format!("{path}: ETag form, Azure {at:?}, emulator {et:?}"));
            }
        } else if name == "Message" {
            if at.lines().next() != et.lines().next() {
                out.push(format!("{path}: Azure {at:?}, emulator {et:?}"));
            }
        } else if !VOLATILE.contains(&name) && at != et {
            out.push(format!("{path}: Azure {at:?}, emulator {et:?}"));
        }
    }
    out
}

/// Sorts each run of `…/Metadata/<name>` elements (one blob's metadata), keeping the rest.
fn sort_metadata_runs(v: &mut [(String, String)]) {
    let mut i = 0;
    while i < v.len() {
        let parent = |s: &str| s.rsplit_once('/').map(|(p, _)| p.to_string());
        if parent(&v[i].0).is_some_and(|p| p.ends_with("/Metadata")) {
            let p = parent(&v[i].0);
            let j = (i..v.len())
                .find(|&j| parent(&v[j].0) != p)
                .unwrap_or(v.len());
            v[i..j].sort();
            i = j;
        } else {
            i += 1;
        }
    }
}

/// Everything a client depends on in which the emulator's answer differs from Azure's.
pub(crate) fn differences(x: &Exchange, got: &Answer) -> Vec<String> {
    let mut out = Vec::new();
    if x.status != got.status {
        out.push(format!(
            "status: Azure {}, emulator {}",
            x.status, got.status
        ));
    }
    let header = |n: &str| got.headers.get(n).map(String::as_str);
    let azure = |n: &str| x.headers.get(n).map(String::as_str);
    if azure("x-ms-error-code") != header("x-ms-error-code") {
        out.push(format!(
            "x-ms-error-code: Azure {:?}, emulator {:?}",
            azure("x-ms-error-code"),
            header("x-ms-error-code")
        ));
    }
    match (azure("etag"), header("etag")) {
        (Some(a), Some(e)) if a.starts_with('"') != e.starts_with('"') => {
            out.push(format!("ETag header form: Azure {a}, emulator {e}"))
        }
        (Some(a), None) => out.push(format!("ETag header: Azure {a}, emulator none")),
        _ => {}
    }
    for name in ["last-modified", "date"] {
        if let Some(a) = azure(name) {
            let form = header(name).map(time_form);
            if form != Some(time_form(a)) {
                out.push(format!("{name}: Azure {a:?}, emulator {:?}", header(name)));
            }
        }
    }
    let media = |s: Option<&str>| s.map(|s| s.replace(' ', "").to_ascii_lowercase());
    if azure("content-type").is_some()
        && media(azure("content-type")) != media(header("content-type"))
    {
        out.push(format!(
            "content-type: Azure {:?}, emulator {:?}",
            azure("content-type"),
            header("content-type")
        ));
    }
    if azure("x-ms-version").is_some() && azure("x-ms-version") != header("x-ms-version") {
        out.push(format!(
            "x-ms-version: Azure echoed {:?}, emulator {:?}",
            azure("x-ms-version"),
            header("x-ms-version")
        ));
    }
    if azure("x-ms-tag-count") != header("x-ms-tag-count") {
        out.push(format!(
            "x-ms-tag-count: Azure {:?}, emulator {:?}",
            azure("x-ms-tag-count"),
            header("x-ms-tag-count")
        ));
    }
    // A blob's bytes: the length (a HEAD's says it without a body) and the range served.
    let xml = azure("content-type").is_some_and(|t| t.contains("xml"));
    if !xml && matches!(x.status, 200 | 206) {
        for name in ["content-length", "content-range"] {
            if azure(name).is_some() && azure(name) != header(name) {
                out.push(format!(
                    "{name}: Azure {:?}, emulator {:?}",
                    azure(name),
                    header(name)
                ));
            }
        }
    }
    match x.body.as_deref().filter(|b| !b.is_empty()) {
        Some(b) if xml => out.extend(xml_differences(b, &got.body)),
        Some(b) if b != got.body => out.push(format!("body: Azure {b:?}, emulator {:?}", got.body)),
        Some(_) => {}
        None if !got.body.is_empty() && x.method != "HEAD" => {
            out.push(format!("body: Azure none, emulator {:?}", got.body))
        }
        None => {}
    }
    out
}

/// The blob emulator with the blobs a recorded listing shows (their names and metadata):
/// the state the recording started from.
async fn blob_emulator(containers: &[&str]) -> BlobEmulator {
    BlobEmulator::start(BlobConfig {
        containers: containers.iter().map(|c| c.to_string()).collect(),
        ..Default::default()
    })
    .await
    .expect("blob emulator")
}

/// Creates each blob the listing `x` shows, with its metadata, through the emulator's REST.
async fn blobs_listed_in(base: &str, x: &Exchange) {
    let els = elements(x.body.as_deref().unwrap_or("")).expect("a listing");
    let container = x.path_and_query[1..].split(['?', '/']).next().unwrap_or("");
    let client = reqwest::Client::new();
    let mut blobs: Vec<(String, Vec<(String, String)>)> = Vec::new();
    for (path, text) in els {
        let p: Vec<&str> = path.iter().map(String::as_str).collect();
        match p.as_slice() {
            [.., "Blob", "Name"] => blobs.push((text, Vec::new())),
            [.., "Blob", "Metadata", key] => {
                if let Some((_, meta)) = blobs.last_mut() {
                    meta.push((key.to_string(), text));
                }
            }
            _ => {}
        }
    }
    for (name, meta) in blobs {
        let mut req = client
            .put(format!("{base}/{container}/{name}"))
            .header("x-ms-blob-type", "BlockBlob");
        for (k, v) in meta {
            req = req.header(format!("x-ms-meta-{k}"), v);
        }
        let resp = within("prior state", req.send()).await.expect("put");
        assert_eq!(
            resp.status().as_u16(),
            201,
            "prior state: {}",
            resp.status()
        );
    }
}

/// The request `x` as it is replayed now: each ETag Azure answered earlier in the recording
/// that a condition names (`If-Match`, `If-None-Match`, in whichever form, quoted or not, the
/// recording sent it) becomes the ETag the emulator answered in its place, and each date
/// condition (`If-Modified-Since`, `If-Unmodified-Since`) keeps its distance from Azure's
/// `Date` of that answer, measured now from `now` — an hour in the past stays an hour in the
/// past, a day ahead stays a day ahead.
fn rewritten(x: &Exchange, etags: &BTreeMap<String, String>, now: SystemTime) -> Exchange {
    let mut x = x.clone();
    let recorded_date = x
        .headers
        .get("date")
        .and_then(|d| hubguard::clock::parse_http_date(d));
    for (k, v) in x.request_headers.iter_mut() {
        match k.as_str() {
            "if-match" | "if-none-match" => {
                for (azure, emulator) in etags {
                    *v = v.replace(azure.as_str(), emulator);
                }
            }
            "if-modified-since" | "if-unmodified-since" => {
                if let (Some(at), Some(date)) = (hubguard::clock::parse_http_date(v), recorded_date)
                {
                    let shift = hubguard::clock::ms(at) - hubguard::clock::ms(date);
                    *v = hubguard::clock::http_date(hubguard::clock::at(
                        hubguard::clock::ms(now) + shift,
                    ));
                }
            }
            _ => {}
        }
    }
    x
}

/// The container and blob a blob request names (`None` for a container or account request).
fn blob_path(x: &Exchange) -> Option<String> {
    let path = x.path_and_query.split('?').next().unwrap_or("");
    let (container, blob) = path.trim_start_matches('/').split_once('/')?;
    (!blob.is_empty()).then(|| format!("{container}/{blob}"))
}

/// Replays every exchange of `file` in order and returns the named differences. A blob the
/// recording reads (with an answer other than 404) that no kept entry wrote — its upload was
/// left out of the copy (`PROVENANCE.md`) — is written first with `left_out_upload` bytes.
async fn replay_blob_recording(
    file: &str,
    containers: &[&str],
    left_out_upload: usize,
) -> Vec<String> {
    let emu = blob_emulator(containers).await;
    let base = emu.account_url();
    let exchanges = load(file);
    for x in exchanges
        .iter()
        .filter(|x| x.path_and_query.contains("comp=list"))
    {
        blobs_listed_in(&base, x).await;
    }
    let mut out = Vec::new();
    let mut etags = BTreeMap::new();
    let mut written = BTreeSet::new();
    let unquoted = |e: &str| e.trim_matches('"').to_string();
    for x in &exchanges {
        let blob = blob_path(x);
        if let Some(b) = &blob {
            if matches!(x.method.as_str(), "GET" | "HEAD")
                && x.status != 404
                && !written.contains(b)
            {
                put_left_out_upload(&base, b, left_out_upload).await;
                written.insert(b.clone());
            }
        }
        let got = replay(&base, &rewritten(x, &etags, SystemTime::now()), None).await;
        if let (Some(a), Some(e)) = (x.headers.get("etag"), got.headers.get("etag")) {
            etags.insert(unquoted(a), unquoted(e));
        }
        if let Some(b) = blob.filter(|_| x.method == "PUT" && got.status == 201) {
            written.insert(b);
        }
        for d in differences(x, &got) {
            out.push(format!(
                "{} {} {}: {d}",
                x.source, x.method, x.path_and_query
            ));
        }
    }
    out
}

/// Writes the blob an upload left out of a recording would have written.
async fn put_left_out_upload(base: &str, blob: &str, len: usize) {
    let resp = reqwest::Client::new()
        .put(format!("{base}/{blob}"))
        .header("x-ms-blob-type", "BlockBlob")
        .body(vec![b'x'; len]);
    let resp = within("left-out upload", resp.send()).await.expect("put");
    assert_eq!(resp.status().as_u16(), 201, "left-out upload of {blob}");
}

#[tokio::test]
async fn blob_emulator_answers_as_azure_answered() {
    let mut all = Vec::new();
    for (file, containers, left_out_upload) in [
        (
            "claim_ownership_concurrent_update_should_fail.json",
            &["container"][..],
            0,
        ),
        (
            "update_checkpoint_verify_in_list_checkpoints.json",
            &["container"][..],
            0,
        ),
        ("BlockBlobClientTest.DeleteWithConditions.json", &[][..], 0),
        ("BlobContainerClientTest.CreateDelete.json", &[][..], 0),
        ("test_blob_tags.json", &[][..], 0),
        ("test_get_blob_properties.json", &[][..], 0),
        ("test_download_blob.json", &[][..], 0),
        ("test_blob_error_codes.json", &[][..], 0),
        ("test_find_blobs_by_tags_container.json", &[][..], 0),
        // Its append blob's creation (empty) is left out.
        ("BlobContainerClientTest.Tags.json", &[][..], 0),
        // Its 1 KiB uploads (random bytes, recorded in base64) are left out.
        ("DownloadAsync_AccessConditionsFail.json", &[][..], 1024),
    ] {
        all.extend(replay_blob_recording(file, containers, left_out_upload).await);
    }
    assert!(
        all.is_empty(),
        "differences from Azure:\n{}",
        all.join("\n")
    );
}

#[tokio::test]
async fn service_bus_emulator_describes_a_queue_as_azure_did() {
    let mut spec = QueueSpec::new("test_queue");
    spec.duplicate_detection_window = None;
    let config = ServiceBusConfig {
        queues: vec![spec],
        ..Default::default()
    };
    let key = config.key.clone();
    let emu = ServiceBusEmulator::start(config)
        .await
        .expect("service bus");
    let base = format!("http://{}", emu.local_addr());
    let mut all = Vec::new();
    for x in load("test_mgmt_queue_get_runtime_properties_basic.json") {
        let resource = format!("{base}/test_queue");
        let auth = key.token(&resource, 4_102_444_800);
        let got = replay(&base, &x, Some(auth)).await;
        let mut found = differences(&x, &got);
        // Azure's description ETag is a number (UpdatedAt in .NET ticks), unquoted.
        let numeric = |s: Option<&String>| s.is_some_and(|e| e.bytes().all(|b| b.is_ascii_digit()));
        if numeric(x.headers.get("etag")) && !numeric(got.headers.get("etag")) {
            found.push(format!(
                "ETag: Azure a number, emulator {:?}",
                got.headers.get("etag")
            ));
        }
        all.extend(found.into_iter().map(|d| format!("{}: {d}", x.source)));
    }
    assert!(
        all.is_empty(),
        "differences from Azure:\n{}",
        all.join("\n")
    );
}

/// The comparison itself can fail: Azure's own answers, altered as the emulator used to
/// answer (a quoted listing ETag, no byte-order mark, a nanosecond time, the emulator's own
/// `x-ms-version`), are each named.
#[test]
fn each_old_difference_is_named() {
    let listing = load("update_checkpoint_verify_in_list_checkpoints.json")[1].clone();
    let azure_body = listing.body.clone().unwrap();
    let answer = |body: String, version: &str| Answer {
        status: 200,
        headers: [
            ("content-type", "application/xml"),
            ("date", "Mon, 15 Sep 2025 18:58:06 GMT"),
            ("x-ms-version", version),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        body,
    };
    assert!(differences(&listing, &answer(azure_body.clone(), "2025-11-05")).is_empty());
    let quoted = azure_body.replace("<Etag>0x8DDF489CE880CE5<", "<Etag>\"0x8DDF489CE880CE5\"<");
    let no_bom = azure_body.trim_start_matches('\u{feff}').to_string();
    let found = [
        differences(&listing, &answer(quoted, "2025-11-05")),
        differences(&listing, &answer(no_bom, "2025-11-05")),
        differences(&listing, &answer(azure_body, "2026-04-06")),
    ];
    assert!(
        found[0].iter().any(|d| d.contains("ETag form")),
        "{found:?}"
    );
    assert!(
        found[1].iter().any(|d| d.contains("byte-order mark")),
        "{found:?}"
    );
    assert!(
        found[2].iter().any(|d| d.contains("x-ms-version")),
        "{found:?}"
    );
    assert_eq!(
        time_form("2024-09-04T18:18:19.92Z"),
        time_form("2024-09-04T18:18:19Z")
    );
    assert_ne!(
        time_form("2024-09-04T18:18:19.123456789Z"),
        time_form("2024-09-04T18:18:19Z")
    );
    let a: BTreeSet<_> = AZURE_ONLY.iter().collect();
    assert_eq!(a.len(), AZURE_ONLY.len());
}

/// A replayed condition means what it meant when Azure answered it: an ETag it names becomes
/// the emulator's ETag of the same write (the unquoted form kept), and a date keeps its
/// distance from Azure's clock (a day ahead stays a day ahead of now).
#[test]
fn replayed_conditions_keep_their_meaning() {
    let x = load("DownloadAsync_AccessConditionsFail.json");
    let header = |x: &Exchange, n: &str| {
        x.request_headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    let etags: BTreeMap<String, String> =
        [("0x8DC867E53BE7CFB".to_string(), "0x1D1".to_string())].into();
    let now = hubguard::clock::at(1_800_000_000_000);
    assert_eq!(
        header(&rewritten(&x[11], &etags, now), "if-none-match"),
        "0x1D1"
    );
    let ahead = hubguard::clock::parse_http_date(&header(
        &rewritten(&x[1], &etags, now),
        "if-modified-since",
    ))
    .unwrap();
    // Recorded: 23:13:47 the next day, against Azure's Date of 23:13:48.
    assert_eq!(
        hubguard::clock::ms(ahead) - hubguard::clock::ms(now),
        86_399_000
    );
    let behind = hubguard::clock::parse_http_date(&header(
        &rewritten(&x[4], &etags, now),
        "if-unmodified-since",
    ))
    .unwrap();
    assert!(hubguard::clock::ms(behind) < hubguard::clock::ms(now) - 86_000_000);
    // A base64-recorded body of its Content-Length is decoded; a text body is kept.
    assert_eq!(
        binary("aGVsbG8gcnVzdHkgd29ybGQ=".into(), Some("17")),
        b"hello rusty world"
    );
    assert_eq!(binary("duplicate".into(), Some("9")), b"duplicate");
}
