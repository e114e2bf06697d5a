//! Reading a blob request: the query string, the conditional headers, metadata and index tags
//! from headers or body, checked against Azure's limits (the table in the module doc of
//! `emulator::blob`), and the refusal of a bearer token the emulator was not told to accept.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response;

use super::response::error_response;
use super::store::Conditions;
use super::Shared;

pub(super) fn query_map(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .map(|(k, v)| (k.to_ascii_lowercase(), v.into_owned()))
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn conditions(h: &HeaderMap) -> Conditions {
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(String::from);
    let date = |n: &str| get(n).and_then(|d| crate::clock::parse_http_date(&d));
    Conditions {
        if_match: get("if-match"),
        if_none_match: get("if-none-match"),
        if_modified_since: date("if-modified-since"),
        if_unmodified_since: date("if-unmodified-since"),
    }
}

/// Longest blob name, in characters.
pub(super) const BLOB_NAME_CHARS: usize = 1024;
/// Most metadata a blob may carry, names and values, in bytes.
const METADATA_BYTES: usize = 8 * 1024;

/// A C# identifier, as Azure requires of metadata names (ASCII letters, digits and `_`, not
/// starting with a digit; header names arrive lower-cased).
fn is_csharp_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Refuses metadata Azure refuses (see the module's table).
pub(super) fn check_metadata(
    meta: &BTreeMap<String, String>,
) -> Result<(), (StatusCode, &'static str, String)> {
    if let Some(bad) = meta.keys().find(|k| !is_csharp_identifier(k)) {
        return Err((
            StatusCode::BAD_REQUEST,
            "InvalidMetadata",
            format!("The metadata specified is invalid. It has characters that are not permitted: '{bad}'."),
        ));
    }
    let size: usize = meta.iter().map(|(k, v)| k.len() + v.len()).sum();
    if size > METADATA_BYTES {
        return Err((
            StatusCode::BAD_REQUEST,
            "MetadataTooLarge",
            format!("The size of the specified metadata ({size} bytes) exceeds the maximum size permitted ({METADATA_BYTES} bytes)."),
        ));
    }
    Ok(())
}

/// Most index tags on a blob.
const TAGS_MAX: usize = 10;

/// Parses and checks blob index tags as Azure does ("Manage and find Azure Blob data with
/// blob index tags", learn.microsoft.com/azure/storage/blobs/storage-manage-find-blobs: at
/// most 10 tags; keys 1 to 128 characters, values 0 to 256, case-sensitive; only a-z A-Z
/// 0-9, space and `+ - . / : = _`). Errors as Azurite 3.37 answers them (its validation
/// follows the Set Blob Tags reference): 400 `TagsTooLarge` for more than 10 tags or a key or
/// value too long, 400 `EmptyTagName` for an empty key, 400 `InvalidTag` for a character
/// outside the set (and a key given twice).
fn check_tags(
    pairs: Vec<(String, String)>,
) -> Result<BTreeMap<String, String>, (StatusCode, &'static str, String)> {
    if pairs.len() > TAGS_MAX {
        return Err((
            StatusCode::BAD_REQUEST,
            "TagsTooLarge",
            "The tags specified exceed the maximum permissible limit.".into(),
        ));
    }
    let allowed = |t: &str| {
        t.chars()
            .all(|c| c.is_ascii_alphanumeric() || " +-./:=_".contains(c))
    };
    let invalid = || {
        (
            StatusCode::BAD_REQUEST,
            "InvalidTag",
            "The tags specified are invalid. It contains characters that are not permitted."
                .to_string(),
        )
    };
    let too_large = || {
        (
            StatusCode::BAD_REQUEST,
            "TagsTooLarge",
            "The tags specified exceed the maximum permissible limit.".to_string(),
        )
    };
    let mut tags = BTreeMap::new();
    for (k, v) in pairs {
        if k.is_empty() {
            return Err((
                StatusCode::BAD_REQUEST,
                "EmptyTagName",
                "The name of one of the tag key-value pairs is empty.".into(),
            ));
        }
        if k.chars().count() > 128 || v.chars().count() > 256 {
            return Err(too_large());
        }
        if !allowed(&k) || !allowed(&v) {
            return Err(invalid());
        }
        if tags.insert(k, v).is_some() {
            return Err(invalid()); // a key given twice
        }
    }
    Ok(tags)
}

/// The tags of `x-ms-tags` (a URL query string), checked; none without the header.
pub(super) fn header_tags(
    h: &HeaderMap,
) -> Result<BTreeMap<String, String>, (StatusCode, &'static str, String)> {
    let Some(raw) = h.get("x-ms-tags") else {
        return Ok(BTreeMap::new());
    };
    let raw = String::from_utf8_lossy(raw.as_bytes()).into_owned();
    let pairs = raw
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let dec = |x: &str| {
                percent_encoding::percent_decode_str(&x.replace('+', " "))
                    .decode_utf8_lossy()
                    .into_owned()
            };
            (dec(k), dec(v))
        })
        .collect();
    check_tags(pairs)
}

/// The tags of a Set Blob Tags body (`<Tags><TagSet><Tag><Key>…</Key><Value>…</Value>`).
pub(super) fn body_tags(
    body: &[u8],
) -> Result<BTreeMap<String, String>, (StatusCode, &'static str, String)> {
    let text = String::from_utf8_lossy(body);
    if !text.contains("<Tags") {
        return Err((
            StatusCode::BAD_REQUEST,
            "InvalidXmlDocument",
            "XML specified is not syntactically valid.".into(),
        ));
    }
    check_tags(crate::azure::blob::bed::parse_tag_set(&text))
}

pub(super) fn metadata(h: &HeaderMap) -> BTreeMap<String, String> {
    h.iter()
        .filter_map(|(k, v)| {
            k.as_str().strip_prefix("x-ms-meta-").map(|name| {
                (
                    name.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
        })
        .collect()
}

/// `Some(401)` for a bearer token the emulator was not told to accept (see the module doc).
pub(super) fn refuse_bearer(
    shared: &Shared,
    headers: &HeaderMap,
    head: bool,
    now: std::time::SystemTime,
) -> Option<Response> {
    let auth = headers.get("authorization")?.to_str().unwrap_or("");
    let (scheme, token) = auth.split_once(' ').unwrap_or((auth, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let message = if !shared.accept_any_token {
        "Server failed to authenticate the request: this emulator cannot verify Entra ID (Bearer) tokens and accepts them only when started with --accept-any-token."
    } else if token.trim().is_empty() {
        "Server failed to authenticate the request: the Bearer token is empty."
    } else {
        return None;
    };
    let mut r = error_response(
        StatusCode::UNAUTHORIZED,
        "InvalidAuthenticationInfo",
        message,
        head,
        now,
    );
    r.headers_mut().insert(
        "www-authenticate",
        HeaderValue::from_static(
            "Bearer authorization_uri=https://login.microsoftonline.com/common/oauth2/authorize resource_id=https://storage.azure.com",
        ),
    );
    Some(r)
}
