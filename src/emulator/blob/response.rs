//! Writing a blob answer: the headers every answer carries, a blob's and a write's headers,
//! the XML error body with `x-ms-error-code`, and Get Blob Tags' XML.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::store::{Blob, BlobError};
use super::VERSION;
use crate::emulator::clock::http_date;

fn error_code(e: &BlobError) -> (StatusCode, &'static str) {
    match e {
        BlobError::ContainerNotFound => (StatusCode::NOT_FOUND, "ContainerNotFound"),
        BlobError::BlobNotFound => (StatusCode::NOT_FOUND, "BlobNotFound"),
        BlobError::ContainerAlreadyExists => (StatusCode::CONFLICT, "ContainerAlreadyExists"),
        BlobError::ContainerBeingDeleted => (StatusCode::CONFLICT, "ContainerBeingDeleted"),
        BlobError::BlobAlreadyExists => (StatusCode::CONFLICT, "BlobAlreadyExists"),
        BlobError::ConditionNotMet => (StatusCode::PRECONDITION_FAILED, "ConditionNotMet"),
        BlobError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "InternalError"),
    }
}

/// The UTF-8 byte-order mark Azure Storage starts every XML body with (errors, listings, tag
/// sets: every recording in tests/data/azure-recordings shows it), so every client here
/// parses one as it must on Azure.
pub(super) const BOM: &str = "\u{feff}";

pub(super) fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

/// Azure answers with the `x-ms-version` the request named (every recording shows the
/// request's version echoed); the emulator's own when the request named none.
pub(super) fn echo_version(req: &HeaderMap, resp: &mut Response) {
    if let Some(v) = req.get("x-ms-version") {
        resp.headers_mut().insert("x-ms-version", v.clone());
    }
}

pub(super) fn common_headers(h: &mut HeaderMap, now: std::time::SystemTime) {
    h.insert("x-ms-version", HeaderValue::from_static(VERSION));
    if let Ok(v) = HeaderValue::from_str(&uuid::Uuid::new_v4().to_string()) {
        h.insert("x-ms-request-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(&http_date(now)) {
        h.insert("date", v);
    }
}

pub(super) fn error_response(
    code: StatusCode,
    name: &str,
    message: &str,
    head: bool,
    now: std::time::SystemTime,
) -> Response {
    let mut h = HeaderMap::new();
    common_headers(&mut h, now);
    if let Ok(v) = HeaderValue::from_str(name) {
        h.insert("x-ms-error-code", v);
    }
    if head {
        return (code, h).into_response();
    }
    h.insert("content-type", HeaderValue::from_static("application/xml"));
    let body = format!(
        "{BOM}<?xml version=\"1.0\" encoding=\"utf-8\"?><Error><Code>{name}</Code><Message>{}</Message></Error>",
        xml_escape(message)
    );
    (code, h, body).into_response()
}

pub(super) fn blob_error(e: BlobError, head: bool, now: std::time::SystemTime) -> Response {
    let (status, name) = error_code(&e);
    error_response(status, name, &e.to_string(), head, now)
}

/// Get Blob Tags' answer.
pub(super) fn tag_set_xml(tags: &BTreeMap<String, String>) -> String {
    let esc = |t: &str| quick_xml::escape::escape(t).into_owned();
    let mut xml = format!("{BOM}<?xml version=\"1.0\" encoding=\"utf-8\"?><Tags><TagSet>");
    for (k, v) in tags {
        xml.push_str(&format!(
            "<Tag><Key>{}</Key><Value>{}</Value></Tag>",
            esc(k),
            esc(v)
        ));
    }
    xml.push_str("</TagSet></Tags>");
    xml
}

pub(super) fn write_headers(h: &mut HeaderMap, etag: &str, last_modified: std::time::SystemTime) {
    if let Ok(v) = HeaderValue::from_str(&format!("\"{etag}\"")) {
        h.insert("etag", v);
    }
    if let Ok(v) = HeaderValue::from_str(&http_date(last_modified)) {
        h.insert("last-modified", v);
    }
}

pub(super) fn blob_headers(h: &mut HeaderMap, b: &Blob) {
    write_headers(h, &b.etag, b.last_modified);
    if let Ok(v) = HeaderValue::from_str(&b.content_type) {
        h.insert("content-type", v);
    }
    h.insert("x-ms-blob-type", HeaderValue::from_static("BlockBlob"));
    h.insert("accept-ranges", HeaderValue::from_static("bytes"));
    h.insert("x-ms-lease-state", HeaderValue::from_static("available"));
    h.insert("x-ms-lease-status", HeaderValue::from_static("unlocked"));
    h.insert("x-ms-server-encrypted", HeaderValue::from_static("true"));
    if let Ok(v) = HeaderValue::from_str(&http_date(b.created)) {
        h.insert("x-ms-creation-time", v);
    }
    if !b.tags.is_empty() {
        h.insert("x-ms-tag-count", HeaderValue::from(b.tags.len()));
    }
    for (k, v) in &b.metadata {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(format!("x-ms-meta-{k}").as_bytes()),
            HeaderValue::from_str(v),
        ) {
            h.insert(name, value);
        }
    }
}
