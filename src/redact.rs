//! The one redaction rule: what hubguard masks in any text that leaves the process — log
//! lines (text and JSON), `/readyz` and `/v1/*`, ledger records and their metadata, span
//! attributes and events, dead-letter messages, command output and error messages.
//!
//! [`redact`] masks, with `***`:
//! 1. **In a URL** (`scheme://…`): the userinfo (`https://***@host/`, RFC 3986 §3.2.1: "Use
//!    of the format "user:password" in the userinfo field is deprecated", because it puts a
//!    password in clear text wherever the URL is shown), and the value of every query and
//!    fragment parameter (`?sig=***&code=***`) but a few that are never secret
//!    (`api-version`, a SAS's `sv`, `se`, `sp`, …): a URL's query is where Azure puts a shared
//!    access signature (`sig`, <https://learn.microsoft.com/en-us/rest/api/storageservices/create-service-sas>)
//!    and Azure Functions its function key (`code`,
//!    <https://learn.microsoft.com/en-us/azure/azure-functions/function-keys-how-to>).
//! 2. **A named secret** anywhere: the value after `name=` (or `"name":` in JSON) when the
//!    name is one a credential goes by — `SharedAccessKey`, `SharedAccessSignature`,
//!    `AccountKey` (the connection strings of Event Hubs, Service Bus and Storage,
//!    <https://learn.microsoft.com/en-us/azure/storage/common/storage-configure-connection-string>),
//!    `sig`, `password`, `pwd`, `secret`, `token`, `api_key`, `authorization`, and any name
//!    ending in `_secret`, `-token`, `_password`, … (`AZURE_CLIENT_SECRET`, `x-api-key`).
//! 3. **An `Authorization` credential**: the token after `Bearer`, `Basic` or
//!    `SharedAccessSignature` (RFC 9110 §11.4; the Service Bus SAS token form,
//!    <https://learn.microsoft.com/en-us/azure/service-bus-messaging/service-bus-sas>),
//!    unless it is a plain lower-case word (prose such as "the Bearer token is empty").
//!
//! It is idempotent (masking masked text changes nothing) and leaves text without any of
//! these untouched. Callers apply it where text leaves — see where `redact::` is called —
//! and never build an output from a secret in the first place where they can avoid it.

use std::borrow::Cow;

/// What a secret is replaced with.
pub const MASK: &str = "***";

/// `text` with every credential masked (see the module docs).
pub fn redact(text: &str) -> Cow<'_, str> {
    let b = text.as_bytes();
    let mut spans: Vec<(usize, usize)> = Vec::new();
    urls(b, &mut spans);
    named(b, &mut spans);
    schemes(b, &mut spans);
    if spans.is_empty() {
        return Cow::Borrowed(text);
    }
    spans.sort_unstable();
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    let mut i = 0;
    while i < spans.len() {
        let (s, mut e) = spans[i];
        // Overlapping or touching spans become one mask.
        while i + 1 < spans.len() && spans[i + 1].0 <= e {
            e = e.max(spans[i + 1].1);
            i += 1;
        }
        let s = s.max(at);
        if s < e {
            out.push_str(&text[at..s]);
            out.push_str(MASK);
            at = e;
        }
        i += 1;
    }
    out.push_str(&text[at..]);
    Cow::Owned(out)
}

/// [`redact`] as an owned string.
pub fn redacted(text: &str) -> String {
    redact(text).into_owned()
}

/// [`redact`] of an owned string, reusing it when nothing is masked.
pub fn redact_owned(text: String) -> String {
    match redact(&text) {
        Cow::Borrowed(_) => text,
        Cow::Owned(r) => r,
    }
}

/// Masks every string in a JSON value in place (keys are hubguard's own and stay).
pub fn redact_json(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => {
            if let Cow::Owned(r) = redact(s) {
                *s = r;
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(redact_json),
        serde_json::Value::Object(o) => o.values_mut().for_each(redact_json),
        _ => {}
    }
}

/// Where a URL (or a bare value) ends in text: whitespace, controls, quotes, angle brackets,
/// a backslash (JSON escapes) and a backtick.
fn ends_url(c: u8) -> bool {
    c.is_ascii_whitespace()
        || c.is_ascii_control()
        || matches!(c, b'"' | b'\'' | b'<' | b'>' | b'\\' | b'`')
}

/// Rule 1: userinfo and parameter values of every `scheme://…` in the text.
fn urls(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    let mut from = 0;
    while let Some(p) = find(b, from, b"://") {
        let start = p + 3;
        let end = (start..b.len())
            .find(|&i| ends_url(b[i]))
            .unwrap_or(b.len());
        let first_end = (start..end)
            .find(|&i| matches!(b[i], b'/' | b'?' | b'#'))
            .unwrap_or(end);
        let mut at = (start..first_end).rev().find(|&i| b[i] == b'@');
        if at.is_none() {
            // `user:pa/ss@host`: a password with a raw `/`, `?` or `#` (a malformed URL, but
            // still a password) — unless what follows the `:` is a port.
            if let Some(colon) = (start..first_end).find(|&i| b[i] == b':') {
                if !b[colon + 1..first_end].iter().all(u8::is_ascii_digit) {
                    at = (first_end..end).find(|&i| b[i] == b'@');
                }
            }
        }
        let auth_end = match at {
            Some(at) => {
                spans.push((start, at));
                (at..end)
                    .find(|&i| matches!(b[i], b'/' | b'?' | b'#'))
                    .unwrap_or(end)
            }
            None => first_end,
        };
        if let Some(q) = (auth_end..end).find(|&i| matches!(b[i], b'?' | b'#')) {
            let mut param = q + 1;
            for i in q + 1..=end {
                if i == end || matches!(b[i], b'&' | b'#' | b';') {
                    if param < i {
                        let eq = (param..i).find(|&j| b[j] == b'=');
                        let public = eq.is_some_and(|eq| public_param(&b[param..eq]));
                        let value = eq.map_or(param, |j| j + 1);
                        if value < i && !public {
                            spans.push((value, i));
                        }
                    }
                    param = i + 1;
                }
            }
        }
        from = start;
    }
}

/// Query parameters whose values are never secret and help a reader: the REST APIs'
/// `api-version`, `timeout`, listing parameters, and a SAS's fields other than its signature
/// (version, services, resource types, permissions, start, expiry, protocol, resource, IP
/// range, policy id, key name:
/// <https://learn.microsoft.com/en-us/rest/api/storageservices/create-service-sas>).
const PUBLIC_PARAMS: &[&str] = &[
    "api-version",
    "timeout",
    "comp",
    "restype",
    "prefix",
    "marker",
    "include",
    "maxresults",
    "sv",
    "ss",
    "srt",
    "sp",
    "st",
    "se",
    "spr",
    "sr",
    "sip",
    "si",
    "skn",
];

fn public_param(name: &[u8]) -> bool {
    PUBLIC_PARAMS
        .iter()
        .any(|p| name.eq_ignore_ascii_case(p.as_bytes()))
}

/// Names a credential goes by, compared without case.
const SECRET_NAMES: &[&str] = &[
    "sig",
    "sharedaccesskey",
    "sharedaccesssignature",
    "accountkey",
    "password",
    "passwd",
    "pwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "api-key",
    "sas",
    "sastoken",
    "accesskey",
    "access_key",
    "access-key",
    "authorization",
    "proxy-authorization",
];

/// Endings of names that hold a credential (`AZURE_CLIENT_SECRET`, `x-api-key`, `id_token`).
const SECRET_SUFFIXES: &[&str] = &[
    "_secret",
    "-secret",
    "_password",
    "-password",
    "_token",
    "-token",
    "_api_key",
    "-api-key",
    "_apikey",
    "-apikey",
    "_accesskey",
    "_access_key",
    "-access-key",
    "_sas_key",
    "-sas-key",
];

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

fn secret_name(word: &[u8]) -> bool {
    // `handler.authorization`, `a.b.token`: the last dotted segment names it.
    let last = word.rsplit(|&c| c == b'.').next().unwrap_or(word);
    let lower = last.to_ascii_lowercase();
    SECRET_NAMES.iter().any(|n| lower == n.as_bytes())
        || SECRET_SUFFIXES
            .iter()
            .any(|s| lower.ends_with(s.as_bytes()))
}

/// Rule 2: `name=value`, `"name": "value"` for a credential's name.
fn named(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    let mut i = 0;
    while i < b.len() {
        if !is_name_char(b[i]) || (i > 0 && is_name_char(b[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && is_name_char(b[i]) {
            i += 1;
        }
        let word = &b[start..i];
        if !secret_name(word) {
            continue;
        }
        let quoted_name = start > 0 && b[start - 1] == b'"';
        let mut j = i;
        // A closing quote of the name (`"token"`, or `\"token\"` inside JSON text).
        if quoted_name {
            if b.get(j) == Some(&b'\\') && b.get(j + 1) == Some(&b'"') {
                j += 2;
            } else if b.get(j) == Some(&b'"') {
                j += 1;
            }
        }
        while b.get(j) == Some(&b' ') {
            j += 1;
        }
        match b.get(j) {
            Some(b'=') => {}
            Some(b':') if quoted_name => {}
            _ => continue,
        }
        j += 1;
        while b.get(j) == Some(&b' ') {
            j += 1;
        }
        let header = matches!(
            word.to_ascii_lowercase().as_slice(),
            b"authorization" | b"proxy-authorization"
        ) || word.to_ascii_lowercase().ends_with(b".authorization");
        let (s, e) = if b.get(j) == Some(&b'\\') && b.get(j + 1) == Some(&b'"') {
            // `\"value\"` (JSON inside JSON): up to the next `\"`.
            let s = j + 2;
            let e = find(b, s, b"\\\"").unwrap_or(b.len());
            (s, e)
        } else if matches!(b.get(j), Some(b'"' | b'\'')) {
            let q = b[j];
            let s = j + 1;
            let mut e = s;
            while e < b.len() && !(b[e] == q && b[e - 1] != b'\\') {
                e += 1;
            }
            (s, e)
        } else {
            let s = j;
            let mut e = s;
            while e < b.len() {
                let c = b[e];
                let stop = if header {
                    // An Authorization value has a space inside (`Basic dXNl…`).
                    (c.is_ascii_control() || c == b'\n')
                        || matches!(c, b'"' | b'\'' | b'<' | b'>' | b'\\' | b',' | b';' | b'&')
                } else {
                    ends_url(c) || matches!(c, b'&' | b';' | b',' | b')' | b']' | b'}')
                };
                if stop {
                    break;
                }
                e += 1;
            }
            (s, e)
        };
        if s < e {
            spans.push((s, e));
        }
        i = e.max(i);
    }
}

/// Authorization schemes whose token is a credential (case as they are written).
const SCHEMES: &[&[u8]] = &[b"Bearer", b"Basic", b"SharedAccessSignature"];

/// Rule 3: the token after an authorization scheme.
fn schemes(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    for scheme in SCHEMES {
        let mut from = 0;
        while let Some(p) = find(b, from, scheme) {
            from = p + scheme.len();
            if p > 0 && b[p - 1].is_ascii_alphanumeric() {
                continue;
            }
            let mut s = from;
            while b.get(s) == Some(&b' ') {
                s += 1;
            }
            if s == from {
                continue;
            }
            let e = (s..b.len())
                .find(|&i| ends_url(b[i]) || matches!(b[i], b',' | b';'))
                .unwrap_or(b.len());
            let token = &b[s..e];
            let prose = token.iter().all(|c| c.is_ascii_lowercase());
            if !token.is_empty() && !prose {
                spans.push((s, e));
            }
        }
    }
}

fn find(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    if from >= hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// A log writer that masks each line before it reaches `W` ([`tracing_subscriber`] formats a
/// whole event into one buffer and writes it at once; this writer buffers until it is
/// dropped, so a line is masked whole).
#[derive(Debug)]
pub struct RedactingWriter<W: std::io::Write> {
    inner: W,
    buf: Vec<u8>,
}

impl<W: std::io::Write> RedactingWriter<W> {
    /// Masks what is written before passing it to `inner`.
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            buf: Vec::new(),
        }
    }

    fn pass(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&self.buf);
        let masked = redact(&text).into_owned();
        self.buf.clear();
        self.inner.write_all(masked.as_bytes())?;
        self.inner.flush()
    }
}

impl<W: std::io::Write> std::io::Write for RedactingWriter<W> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.pass()
    }
}

impl<W: std::io::Write> Drop for RedactingWriter<W> {
    fn drop(&mut self) {
        let _ = self.pass();
    }
}

/// A [`tracing_subscriber::fmt::MakeWriter`] whose writers mask each line.
#[derive(Debug)]
pub struct Redacting<M>(pub M);

impl<'a, M> tracing_subscriber::fmt::MakeWriter<'a> for Redacting<M>
where
    M: tracing_subscriber::fmt::MakeWriter<'a>,
{
    type Writer = RedactingWriter<M::Writer>;
    fn make_writer(&'a self) -> Self::Writer {
        RedactingWriter::new(self.0.make_writer())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn r(s: &str) -> String {
        redact(s).into_owned()
    }

    #[test]
    fn userinfo_and_query_values_of_urls_are_masked() {
        assert_eq!(
            r("webhook agreed url=http://user:s3cret@host:9000/events?code=abc&x=1#frag"),
            "webhook agreed url=http://***@host:9000/events?code=***&x=***#***"
        );
        assert_eq!(r("https://tok@github.com/x"), "https://***@github.com/x");
        assert_eq!(
            r("sb://u:p@127.0.0.1:5672/ and more"),
            "sb://***@127.0.0.1:5672/ and more"
        );
        // A raw `/` in a password (a malformed URL) still ends at its `@`.
        assert_eq!(r("http://u:pa/ss@h:1/x"), "http://***@h:1/x");
        // A path with `@` is not userinfo.
        assert_eq!(r("http://h/users/@me"), "http://h/users/@me");
        assert_eq!(
            r("http://127.0.0.1:9000/events"),
            "http://127.0.0.1:9000/events"
        );
        assert_eq!(
            r("\"http://a:b@h/x?sig=Zm9v%2B\"}"),
            "\"http://***@h/x?sig=***\"}"
        );
    }

    #[test]
    fn connection_strings_and_sas_tokens_are_masked() {
        assert_eq!(
            r("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=AbC+/=;EntityPath=q"),
            "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=***;EntityPath=q"
        );
        assert_eq!(
            r("DefaultEndpointsProtocol=https;AccountName=a;AccountKey=Zm9vYmFy==;EndpointSuffix=core.windows.net"),
            "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=***;EndpointSuffix=core.windows.net"
        );
        assert_eq!(
            r("Authorization: SharedAccessSignature sr=sb%3A%2F%2Fns&sig=AbC%3D&se=1&skn=Root"),
            "Authorization: SharedAccessSignature ***"
        );
        assert_eq!(
            r("sv=2022-11-02&sp=r&sig=AbC%3D"),
            "sv=2022-11-02&sp=r&sig=***"
        );
        // In a URL, a SAS keeps its readable fields (an expired `se` is worth seeing).
        assert_eq!(
            r("https://a.blob.core.windows.net/c?sv=2022-11-02&se=2026-01-01&sr=c&sp=rl&sig=AbC%3D&comp=list"),
            "https://a.blob.core.windows.net/c?sv=2022-11-02&se=2026-01-01&sr=c&sp=rl&sig=***&comp=list"
        );
        assert_eq!(
            r("GET https://ns.servicebus.windows.net/q?api-version=2021-05 answered 401"),
            "GET https://ns.servicebus.windows.net/q?api-version=2021-05 answered 401"
        );
        assert_eq!(r("aeg-sas-key=k1 sas=k2"), "aeg-sas-key=*** sas=***");
    }

    #[test]
    fn authorization_values_and_named_secrets_are_masked() {
        assert_eq!(r("got Bearer eyJ0eXAi.x.y back"), "got Bearer *** back");
        assert_eq!(r("Basic dXNlcjpwYXNz"), "Basic ***");
        assert_eq!(
            r("authorization=Basic dXNlcjpwYXNz,x-other=1"),
            "authorization=***,x-other=1"
        );
        assert_eq!(
            r(r#"{"error":"bad","token":"abc123"}"#),
            r#"{"error":"bad","token":"***"}"#
        );
        assert_eq!(
            r(r#"body: {\"password\":\"hunter2\"}"#),
            r#"body: {\"password\":\"***\"}"#
        );
        assert_eq!(
            r("AZURE_CLIENT_SECRET=abc def"),
            "AZURE_CLIENT_SECRET=*** def"
        );
        assert_eq!(r("x-api-key=k1"), "x-api-key=***");
    }

    #[test]
    fn ordinary_text_is_left_alone() {
        for s in [
            "HTTP 503 from the webhook; Retry-After: 30; body: {\"error\":\"overloaded\"}",
            "attempt failed key=hub-0-5 class=Transient",
            "Unauthorized: the Bearer token is empty",
            "a SharedAccessSignature token was presented as type 'jwt'",
            "handler.authorization: cannot read /run/secrets/x: not found",
            "storage.credential needs an https storage.container_url",
            "idempotency_key=order-42 signature_count=2",
            "held since 2026-12-01T00:00:00Z: Service Bus unavailable: status 503",
        ] {
            assert_eq!(r(s), s);
            assert!(matches!(redact(s), Cow::Borrowed(_)), "{s}");
        }
    }

    #[test]
    fn the_log_writer_masks_a_line_whole() {
        use std::io::Write as _;
        let mut out = Vec::new();
        {
            let mut w = RedactingWriter::new(&mut out);
            w.write_all(b"url=http://u:pw").unwrap();
            w.write_all(b"@h/x\n").unwrap();
        }
        assert_eq!(String::from_utf8(out).unwrap(), "url=http://***@h/x\n");
    }

    /// Secrets as users have them: base64, hex, JWT-ish, with at least one upper-case letter
    /// or digit (a plain lower-case word after `Bearer` is prose, see the module docs).
    fn secret() -> impl Strategy<Value = String> {
        "[A-Za-z0-9+/_.~-]{6,40}".prop_map(|s| format!("Zq9{s}"))
    }

    /// Text around a secret, free of what ends a value early in a URL.
    fn filler() -> impl Strategy<Value = String> {
        "[ a-zA-Z0-9:.,()\\[\\]{}\"'=&;/_-]{0,30}"
    }

    proptest! {
        #[test]
        fn no_secret_survives(
            s in secret(),
            user in "[a-z]{1,8}",
            before in filler(),
            after in filler(),
            form in 0usize..10,
        ) {
            // In userinfo a `/` is percent-encoded (RFC 3986 §3.2.1); a raw one would make
            // the rest a path, and the URL a different one.
            let u = s.replace('/', "%2F");
            let placed = match form {
                0 => format!("http://{user}:{u}@host:1/p"),
                1 => format!("https://{u}@host/p"),
                2 => format!("https://host/p?a=1&sig={s}&b=2"),
                3 => format!("http://h/x?code={s}"),
                4 => format!("Endpoint=sb://ns/;SharedAccessKeyName={user};SharedAccessKey={s}"),
                5 => format!("AccountName={user};AccountKey={s};EndpointSuffix=x"),
                6 => format!("Bearer {s}"),
                7 => format!("authorization=Basic {s}"),
                8 => format!("\"token\":\"{s}\""),
                _ => format!("SharedAccessSignature sr=x&sig={s}&se=1&skn={user}"),
            };
            let text = format!("{before} {placed} {after}");
            let out = r(&text);
            prop_assert!(!out.contains(&s) && !out.contains(&u), "{text:?} -> {out:?}");
            // Idempotent: masking masked text changes nothing.
            prop_assert_eq!(r(&out), out.clone());
        }

        #[test]
        fn text_without_a_trigger_is_unchanged(text in "[ a-zA-Z0-9.,()_-]{0,80}") {
            prop_assert_eq!(r(&text), text);
        }

        #[test]
        fn masking_is_idempotent_on_anything(text in ".{0,120}") {
            let once = r(&text);
            prop_assert_eq!(r(&once), once.clone());
        }
    }
}
