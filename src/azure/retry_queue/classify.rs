//! Service Bus's answers as typed errors: the status and the detail the service gave (a 403
//! is a quota or a message too large, told apart by its detail).

use super::error::RetryQueueError;

/// Maps a status and the service's error detail to a typed error (see [`RetryQueueError`]).
pub(super) fn status_error(status: u16, detail: &str) -> RetryQueueError {
    let detail = detail.to_string();
    let lower = detail.to_ascii_lowercase();
    // What the request is, not what the service is: too large, too many properties or
    // headers, malformed. The same request gets the same answer every time, so it must not
    // hold anything (HTTP semantics, RFC 9110 §15.5.1, §15.5.14, §15.5.15; 431: RFC 6585
    // §5), whatever front end said it.
    let about_the_request = lower.contains("too large")
        || lower.contains("too many properties")
        || lower.contains("too many headers");
    match status {
        400 | 413 | 414 | 431 => RetryQueueError::Refused { status, detail },
        403 if about_the_request => RetryQueueError::Refused { status, detail },
        401 => RetryQueueError::Unauthorized { status, detail },
        // 403 is "quota exceeded or message too large": the detail tells which. A message
        // too large is refused for what it is; anything else at 403 concerns every request.
        403 if lower.contains("size")
            && (lower.contains("exceed") || lower.contains("large"))
            && !lower.contains("entity size") =>
        {
            RetryQueueError::Refused { status, detail }
        }
        403 if lower.contains("quota") || lower.contains("entity size") => {
            RetryQueueError::QuotaExceeded(detail)
        }
        403 => RetryQueueError::Unauthorized { status, detail },
        404 | 410 => RetryQueueError::EntityNotFound { status, detail },
        429 => RetryQueueError::Throttled { status, detail },
        503 if lower.contains("busy") || lower.contains("throttl") => {
            RetryQueueError::Throttled { status, detail }
        }
        _ => RetryQueueError::Unavailable { status, detail },
    }
}

pub(super) fn classify(e: &azure_core_legacy::Error) -> RetryQueueError {
    match e.kind() {
        azure_core_legacy::error::ErrorKind::HttpResponse { status, error_code } => {
            status_error(u16::from(*status), error_code.as_deref().unwrap_or(""))
        }
        azure_core_legacy::error::ErrorKind::Io => RetryQueueError::Transport(e.to_string()),
        azure_core_legacy::error::ErrorKind::Credential => {
            RetryQueueError::Credential(e.to_string())
        }
        _ => {
            // Connection failures surface as wrapped reqwest errors.
            RetryQueueError::Transport(e.to_string())
        }
    }
}

pub(super) fn lock_error(e: &azure_core_legacy::Error) -> RetryQueueError {
    match classify(e) {
        // 404 on a lock: the lock (not the queue, which answers 410) is gone.
        RetryQueueError::EntityNotFound { status: 404, .. } => RetryQueueError::LockLost,
        other => other,
    }
}

/// Longest error detail kept from a response body.
pub(super) const DETAIL_LIMIT: usize = 300;

/// The `<Detail>` (else `<Message>`) of a Service Bus error body, unescaped, with control
/// characters removed and cut to `DETAIL_LIMIT` (300) characters: what the service said about a
/// refusal, fit for a log line, a ledger record and `hubguard status`.
pub fn error_detail(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let inner = |tag: &str| {
        let open = format!("<{tag}>");
        let start = text.find(&open)? + open.len();
        let end = text[start..].find(&format!("</{tag}>"))? + start;
        Some(text[start..end].to_string())
    };
    let raw = inner("Detail")
        .or_else(|| inner("Message"))
        .unwrap_or_else(|| text.to_string());
    let unescaped = raw
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&");
    let mut out: String = unescaped
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(DETAIL_LIMIT)
        .collect();
    if unescaped.chars().count() > DETAIL_LIMIT {
        out.push('…');
    }
    out.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_typed_errors() {
        assert!(matches!(
            status_error(401, ""),
            RetryQueueError::Unauthorized { status: 401, .. }
        ));
        assert!(matches!(
            status_error(410, "gone"),
            RetryQueueError::EntityNotFound { status: 410, .. }
        ));
        assert!(status_error(503, "").is_transient());
        assert!(status_error(429, "").is_transient());
        assert!(!status_error(401, "").is_transient());
        assert!(status_error(400, "bad MessageId").is_refusal_of_request());
        // Whatever the front end: a request too large or with too many headers concerns
        // that request only.
        for status in [413, 414, 431] {
            let e = status_error(status, "");
            assert!(e.is_refusal_of_request() && !e.is_transient(), "{e:?}");
        }
        let many = status_error(403, "The message has too many properties: 300");
        assert!(many.is_refusal_of_request(), "{many:?}");
    }

    #[test]
    fn a_403_is_told_apart_by_its_detail() {
        let too_large = status_error(
            403,
            "The message of 300000 bytes exceeds the maximum message size of 262144 bytes",
        );
        assert!(too_large.is_refusal_of_request(), "{too_large:?}");
        let full = status_error(
            403,
            "The maximum entity size has been reached or exceeded for Queue: 'retries'.",
        );
        assert!(
            matches!(full, RetryQueueError::QuotaExceeded(_)),
            "{full:?}"
        );
        assert!(!full.is_refusal_of_request());
        let rights = status_error(403, "Unauthorized access. 'Send' claim(s) are required");
        assert!(matches!(rights, RetryQueueError::Unauthorized { .. }));
        let busy = status_error(503, "SubCode=50009. The entity is being throttled.");
        assert!(matches!(busy, RetryQueueError::Throttled { .. }));
    }

    #[test]
    fn error_details_are_read_from_the_xml_body_and_sanitised() {
        let body = b"<Error><Code>400</Code><Detail>Bad &lt;id&gt;\r\nline</Detail></Error>";
        assert_eq!(error_detail(body), "Bad <id>  line");
        let long = format!("<Error><Detail>{}</Detail></Error>", "x".repeat(1000));
        assert!(error_detail(long.as_bytes()).chars().count() <= DETAIL_LIMIT + 1);
    }
}
