//! Who is asking, and may they: the reading and acting roles, from a bearer token (compared
//! in constant time) or a trusted authenticating proxy's user header, and the cross-site
//! request checks every action passes (its `Origin` and `Sec-Fetch-Site`, and a token only
//! the console's own page can read).

use axum::http::HeaderMap;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// See everything the console shows.
    Reader,
    /// Read, and act: pause, resume, retry now, cancel, replay.
    Operator,
}

/// A caller the console recognised.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Caller {
    /// Who, as the audit trail records it: the proxy's user, or the token's role.
    pub who: String,
    /// What they may do.
    pub role: Role,
}

/// A secret compared in constant time, never printed.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// `text`, trimmed; `None` when empty.
    pub fn new(text: &str) -> Option<Self> {
        let t = text.trim();
        (!t.is_empty()).then(|| Self(t.to_string()))
    }

    /// Whether `given` is this secret: the SHA-256 digests are compared byte by byte
    /// without an early exit, so the time taken says nothing about how much matched.
    pub fn matches(&self, given: &str) -> bool {
        let a = Sha256::digest(self.0.as_bytes());
        let b = Sha256::digest(given.as_bytes());
        a.iter()
            .zip(b.iter())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// How the console tells callers apart (from `[console]`).
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Grants reading; none: reading is open.
    pub reader_token: Option<Secret>,
    /// Grants acting.
    pub operator_token: Option<Secret>,
    /// The trusted proxy header (lower case), if any.
    pub user_header: Option<String>,
    /// Proxy users who may act.
    pub operators: Vec<String>,
    /// Other origins whose pages may act.
    pub allowed_origins: Vec<String>,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// No credential, or a wrong one, where one is needed.
    #[error("a credential is needed: a reader or operator token (Authorization: Bearer …), or the trusted proxy's user")]
    Unauthenticated,
    /// Recognised, but without the operator role.
    #[error("{0} may read but not act: actions need the operator role")]
    NotOperator(String),
    /// From another site's page.
    #[error("refused: the request came from another site ({0}); actions are taken only from the console's own page")]
    CrossSite(String),
    /// Without the console page's token.
    #[error("refused: the request lacks the console's anti-forgery token (X-Hubguard-Csrf); reload the console")]
    NoCsrfToken,
}

impl Access {
    /// Who is asking: a bearer token first, then the trusted proxy's user, else an
    /// anonymous reader when reading is open.
    pub fn caller(&self, headers: &HeaderMap) -> Result<Caller, Refused> {
        let bearer = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if let Some(given) = bearer {
            if self
                .operator_token
                .as_ref()
                .is_some_and(|t| t.matches(given))
            {
                return Ok(Caller {
                    who: "operator (token)".into(),
                    role: Role::Operator,
                });
            }
            if self.reader_token.as_ref().is_some_and(|t| t.matches(given)) {
                return Ok(Caller {
                    who: "reader (token)".into(),
                    role: Role::Reader,
                });
            }
            return Err(Refused::Unauthenticated);
        }
        if let Some(h) = &self.user_header {
            if let Some(user) = headers
                .get(h.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|u| !u.is_empty())
            {
                let role = if self.operators.iter().any(|o| o == user) {
                    Role::Operator
                } else {
                    Role::Reader
                };
                return Ok(Caller {
                    who: user.to_string(),
                    role,
                });
            }
        }
        if self.reader_token.is_none() && self.user_header.is_none() {
            return Ok(Caller {
                who: "anonymous".into(),
                role: Role::Reader,
            });
        }
        Err(Refused::Unauthenticated)
    }

    /// Whether any caller could act (a token or proxy operators are configured).
    pub fn can_anyone_act(&self) -> bool {
        self.operator_token.is_some() || !self.operators.is_empty()
    }

    /// The checks an action passes: the operator role, a request from the console's own
    /// origin (or an allowed one), and the anti-forgery token of `caller`.
    pub fn may_act(&self, headers: &HeaderMap, csrf: &CsrfKey) -> Result<Caller, Refused> {
        self.same_origin(headers)?;
        let caller = self.caller(headers)?;
        if caller.role != Role::Operator {
            return Err(Refused::NotOperator(caller.who));
        }
        let token = headers
            .get("x-hubguard-csrf")
            .and_then(|v| v.to_str().ok())
            .ok_or(Refused::NoCsrfToken)?;
        if !csrf.verify(&caller.who, token) {
            return Err(Refused::NoCsrfToken);
        }
        Ok(caller)
    }

    /// `Sec-Fetch-Site` (when the browser sends it) must say same-origin, and `Origin` (when
    /// sent) must be the host the request was sent to or an allowed origin.
    fn same_origin(&self, headers: &HeaderMap) -> Result<(), Refused> {
        let get = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
        if let Some(site) = get("sec-fetch-site") {
            if !matches!(site, "same-origin" | "none") {
                return Err(Refused::CrossSite(format!("Sec-Fetch-Site: {site}")));
            }
        }
        if let Some(origin) = get("origin") {
            let host = get("x-forwarded-host").or(get("host")).unwrap_or("");
            let own = origin
                .split_once("://")
                .is_some_and(|(scheme, rest)| matches!(scheme, "http" | "https") && rest == host);
            if !own && !self.allowed_origins.iter().any(|o| o == origin) {
                return Err(Refused::CrossSite(format!("Origin: {origin}")));
            }
        }
        Ok(())
    }
}

/// The key of the anti-forgery tokens: random per process, so a token is good only for
/// the page this process served (a reload after a restart gets a new one).
#[derive(Clone)]
pub struct CsrfKey([u8; 32]);

impl CsrfKey {
    /// A fresh random key.
    pub fn random() -> Self {
        let mut k = [0u8; 32];
        rand::Rng::fill(&mut rand::thread_rng(), &mut k);
        Self(k)
    }

    /// The token of `who`: HMAC-SHA256 of the name under the key, hex.
    pub fn token(&self, who: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("any key length");
        mac.update(who.as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Whether `token` is `who`'s (compared in constant time).
    pub fn verify(&self, who: &str, token: &str) -> bool {
        let bytes: Option<Vec<u8>> = (0..token.len())
            .step_by(2)
            .map(|i| {
                token
                    .get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            })
            .collect();
        let Some(bytes) = bytes else { return false };
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("any key length");
        mac.update(who.as_bytes());
        mac.verify_slice(&bytes).is_ok()
    }
}

impl std::fmt::Debug for CsrfKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CsrfKey(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    fn access() -> Access {
        Access {
            reader_token: Secret::new("read-me"),
            operator_token: Secret::new("act-now"),
            user_header: Some("x-auth-request-user".into()),
            operators: vec!["alice".into()],
            allowed_origins: vec!["https://console.example.com".into()],
        }
    }

    #[test]
    fn tokens_and_proxy_users_have_their_roles() {
        let a = access();
        let role = |h: &[(&'static str, &str)]| a.caller(&headers(h)).map(|c| c.role);
        assert_eq!(
            role(&[("authorization", "Bearer act-now")]),
            Ok(Role::Operator)
        );
        assert_eq!(
            role(&[("authorization", "Bearer read-me")]),
            Ok(Role::Reader)
        );
        assert_eq!(
            role(&[("authorization", "Bearer act-now!")]),
            Err(Refused::Unauthenticated)
        );
        assert_eq!(
            role(&[("x-auth-request-user", "alice")]),
            Ok(Role::Operator)
        );
        assert_eq!(role(&[("x-auth-request-user", "bob")]), Ok(Role::Reader));
        // Another proxy header is not trusted.
        assert_eq!(
            role(&[("x-forwarded-user", "alice")]),
            Err(Refused::Unauthenticated)
        );
        assert_eq!(role(&[]), Err(Refused::Unauthenticated));
        // Nothing configured: reading is open, acting impossible.
        let open = Access::default();
        assert_eq!(open.caller(&headers(&[])).map(|c| c.role), Ok(Role::Reader));
        assert!(!open.can_anyone_act());
    }

    #[test]
    fn an_action_needs_the_role_the_origin_and_the_page_token() {
        let a = access();
        let key = CsrfKey::random();
        let token = key.token("operator (token)");
        let act = |h: &[(&'static str, &str)]| a.may_act(&headers(h), &key).map(|c| c.who);
        let ok = [
            ("authorization", "Bearer act-now"),
            ("host", "127.0.0.1:8080"),
            ("origin", "http://127.0.0.1:8080"),
            ("sec-fetch-site", "same-origin"),
            ("x-hubguard-csrf", token.as_str()),
        ];
        assert_eq!(act(&ok), Ok("operator (token)".into()));
        let mut forged = ok;
        forged[2] = ("origin", "http://evil.example");
        assert!(matches!(act(&forged), Err(Refused::CrossSite(_))));
        let mut cross = ok;
        cross[3] = ("sec-fetch-site", "cross-site");
        assert!(matches!(act(&cross), Err(Refused::CrossSite(_))));
        let mut allowed = ok;
        allowed[2] = ("origin", "https://console.example.com");
        assert!(act(&allowed).is_ok());
        let mut reader = ok;
        reader[0] = ("authorization", "Bearer read-me");
        assert!(matches!(act(&reader), Err(Refused::NotOperator(_))));
        assert_eq!(act(&ok[..4]), Err(Refused::NoCsrfToken));
        let mut wrong = ok;
        let other = key.token("someone else");
        wrong[4] = ("x-hubguard-csrf", other.as_str());
        assert_eq!(act(&wrong), Err(Refused::NoCsrfToken));
    }

    #[test]
    fn a_secret_is_never_printed() {
        let s = Secret::new("hunter2").unwrap();
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(s.matches("hunter2") && !s.matches("hunter3"));
    }
}
