//! The emulators' side of Shared Access Signatures: checking a token against the key
//! ([`Verify`], as Azure does for a SAS the client presents) and whether its resource covers
//! the entity it is used for ([`audience_covers`]); and [`SasCredential`], a
//! `TokenCredential` that signs SAS tokens, for checks and raw protocol tests (the product's
//! clients sign with [`SasKey::token`] or the SDK's connection-string credential).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use azure_core::credentials::{AccessToken, TokenCredential, TokenRequestOptions};
use percent_encoding::percent_decode_str;

use crate::azure::{ConnectionString, SasKey};

/// The default lifetime of a token the [`SasCredential`] issues.
pub const DEFAULT_TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

/// Why a token was refused. The messages never contain the token or the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SasError {
    /// The token is not of the `SharedAccessSignature k=v&…` form or lacks a field.
    #[error("malformed SAS token: {0}")]
    Malformed(&'static str),
    /// The token names a key other than the configured one.
    #[error("SAS token is signed with an unknown key name")]
    UnknownKeyName,
    /// The signature does not match the configured key.
    #[error("SAS token signature does not match the key")]
    BadSignature,
    /// The token's `se` is in the past.
    #[error("SAS token has expired")]
    Expired,
    /// The token's resource (`sr`) does not cover the entity it is used for.
    #[error("SAS token resource does not cover {0}")]
    WrongAudience(String),
}

/// Checking a SAS token against a key: what the emulators do with the token a client
/// presents.
pub trait Verify {
    /// Checks `token` against this key at time `now`, and that its resource covers
    /// `audience` (see [`audience_covers`]). Returns the token's expiry.
    fn verify(&self, token: &str, audience: &str, now: SystemTime) -> Result<u64, SasError>;
}

impl Verify for SasKey {
    fn verify(&self, token: &str, audience: &str, now: SystemTime) -> Result<u64, SasError> {
        let parsed = ParsedToken::parse(token)?;
        if parsed.key_name != self.name() {
            return Err(SasError::UnknownKeyName);
        }
        let expected = self.signature(&format!("{}\n{}", parsed.sr_raw, parsed.se));
        if !constant_time_eq(expected.as_bytes(), parsed.sig.as_bytes()) {
            return Err(SasError::BadSignature);
        }
        let now_s = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        if parsed.se <= now_s {
            return Err(SasError::Expired);
        }
        if !audience_covers(&parsed.resource, audience) {
            return Err(SasError::WrongAudience(audience.to_string()));
        }
        Ok(parsed.se)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The fields of a SAS token.
#[derive(Debug)]
struct ParsedToken {
    sr_raw: String,
    resource: String,
    sig: String,
    se: u64,
    key_name: String,
}
impl ParsedToken {
    fn parse(token: &str) -> Result<Self, SasError> {
        let rest =
            token
                .trim()
                .strip_prefix("SharedAccessSignature ")
                .ok_or(SasError::Malformed(
                    "missing 'SharedAccessSignature' prefix",
                ))?;
        let (mut sr, mut sig, mut se, mut skn) = (None, None, None, None);
        for pair in rest.split('&') {
            let (k, v) = pair
                .split_once('=')
                .ok_or(SasError::Malformed("field without '='"))?;
            match k {
                "sr" => sr = Some(v),
                "sig" => sig = Some(v),
                "se" => se = Some(v),
                "skn" => skn = Some(v),
                _ => {}
            }
        }
        let sr_raw = sr.ok_or(SasError::Malformed("missing sr"))?;
        let decode = |v: &str| {
            percent_decode_str(&v.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        Ok(Self {
            sr_raw: sr_raw.to_string(),
            resource: decode(sr_raw),
            sig: decode(sig.ok_or(SasError::Malformed("missing sig"))?),
            se: se
                .ok_or(SasError::Malformed("missing se"))?
                .parse()
                .map_err(|_| SasError::Malformed("se is not a number"))?,
            key_name: decode(skn.ok_or(SasError::Malformed("missing skn"))?),
        })
    }
}

/// The path segments of an address, lower-cased, ignoring scheme, authority, query and a
/// trailing slash: `amqps://ns/Hub/ConsumerGroups/$Default` → `["hub", "consumergroups", "$default"]`.
pub fn path_segments(address: &str) -> Vec<String> {
    let without_scheme = address.split_once("://").map_or(address, |(_, rest)| rest);
    let path = if address.contains("://") {
        without_scheme.split_once('/').map_or("", |(_, p)| p)
    } else {
        without_scheme
    };
    let path = path.split(['?', '#']).next().unwrap_or("");
    path.split('/')
        .filter(|s| !s.is_empty())
        .map(|s| percent_decode_str(s).decode_utf8_lossy().to_lowercase())
        .collect()
}

/// Whether a token issued for `resource` grants access to `audience`: the resource's path is a
/// prefix (by whole segments, case-insensitively) of the audience's path. Scheme and host are
/// not compared, because clients of a local emulator reach it under many names.
pub fn audience_covers(resource: &str, audience: &str) -> bool {
    let r = path_segments(resource);
    let a = path_segments(audience);
    r.len() <= a.len() && r.iter().zip(&a).all(|(x, y)| x == y)
}

/// A `TokenCredential` that signs SAS tokens for one resource, so the Event Hubs clients
/// (which take only a `TokenCredential`) can use a connection string. Each call issues a
/// fresh token; the SDK refreshes it before it expires.
#[derive(Debug, Clone)]
pub struct SasCredential {
    key: SasKey,
    resource: String,
    lifetime: Duration,
}
impl SasCredential {
    /// Tokens for `resource` (for example `sb://host:5672/hub`), signed with `key`.
    pub fn new(key: SasKey, resource: impl Into<String>) -> Self {
        Self {
            key,
            resource: resource.into(),
            lifetime: DEFAULT_TOKEN_LIFETIME,
        }
    }

    /// Tokens that expire `lifetime` after they are issued.
    pub fn with_lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// A token valid from `now` for the credential's lifetime, and its expiry.
    pub fn token_at(&self, now: SystemTime) -> (String, u64) {
        let expiry = (now + self.lifetime)
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        (self.key.token(&self.resource, expiry), expiry)
    }
}
#[async_trait]
impl TokenCredential for SasCredential {
    async fn get_token(
        &self,
        _scopes: &[&str],
        _options: Option<TokenRequestOptions<'_>>,
    ) -> azure_core::Result<AccessToken> {
        let (token, expiry) = self.token_at(SystemTime::now());
        let expires_on = azure_core::time::OffsetDateTime::from_unix_timestamp(expiry as i64)
            .map_err(|e| azure_core::Error::new(azure_core::error::ErrorKind::Other, e))?;
        Ok(AccessToken::new(token, expires_on))
    }
}

/// A [`SasCredential`] for `cs`'s key, covering `entity` (or the connection string's
/// `EntityPath`, or else the whole namespace). The Event Hubs clients' `open` presents every
/// credential's tokens as `jwt`, which Azure refuses for a SAS token: use
/// [`ConnectionString::open_consumer`] and [`ConnectionString::open_producer`] for Event Hubs.
/// This one is for checks and raw protocol tests.
pub fn credential(cs: &ConnectionString, entity: Option<&str>) -> SasCredential {
    let resource = match entity.or(cs.entity_path.as_deref()) {
        Some(e) => format!("sb://{}/{e}", cs.namespace()),
        None => format!("sb://{}/", cs.namespace()),
    };
    SasCredential::new(cs.key.clone(), resource)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors computed independently with Python's standard library:
    //   sr = urllib.parse.quote_plus(resource)
    //   sig = base64.b64encode(hmac.new(key.encode(), f"{sr}\n{se}".encode(), hashlib.sha256).digest())
    //   token = f"SharedAccessSignature sr={sr}&sig={urllib.parse.quote_plus(sig)}&se={se}&skn={name}"
    // (the same construction as the Python Event Hubs SDK's `generate_sas_token`).
    const VECTOR_1: &str = "SharedAccessSignature sr=sb%3A%2F%2Fmynamespace.servicebus.windows.net%2Fmyhub&sig=0uetcxkh2UqKuDoPMDHwo%2FBKCaIR6yVIzY2X%2B8cHCMI%3D&se=1700000000&skn=RootManageSharedAccessKey";

    fn key1() -> SasKey {
        SasKey::new(
            "RootManageSharedAccessKey",
            "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==",
        )
    }

    fn key2() -> SasKey {
        SasKey::new("hubguard", "SAS_KEY_VALUE")
    }

    #[test]
    fn verify_accepts_known_vector_and_refuses_tampering() {
        let at = UNIX_EPOCH + Duration::from_secs(1_600_000_000);
        let aud =
            "amqps://mynamespace.servicebus.windows.net/myhub/ConsumerGroups/$Default/Partitions/0";
        assert_eq!(key1().verify(VECTOR_1, aud, at), Ok(1_700_000_000));
        // Wrong key (same name).
        let wrong = SasKey::new("RootManageSharedAccessKey", "not-the-key");
        assert_eq!(wrong.verify(VECTOR_1, aud, at), Err(SasError::BadSignature));
        // Wrong key name.
        assert_eq!(
            key2().verify(VECTOR_1, aud, at),
            Err(SasError::UnknownKeyName)
        );
        // Expired.
        let later = UNIX_EPOCH + Duration::from_secs(1_700_000_001);
        assert_eq!(key1().verify(VECTOR_1, aud, later), Err(SasError::Expired));
        // Another hub.
        assert!(matches!(
            key1().verify(
                VECTOR_1,
                "amqps://mynamespace.servicebus.windows.net/otherhub",
                at
            ),
            Err(SasError::WrongAudience(_))
        ));
        // A modified expiry invalidates the signature.
        let tampered = VECTOR_1.replace("se=1700000000", "se=1800000000");
        assert_eq!(
            key1().verify(&tampered, aud, at),
            Err(SasError::BadSignature)
        );
        assert!(matches!(
            key1().verify("Bearer abc", aud, at),
            Err(SasError::Malformed(_))
        ));
    }

    #[test]
    fn audience_matching_is_by_segment_and_case_insensitive() {
        assert!(audience_covers(
            "sb://h:1/hub",
            "amqps://ns/HUB/ConsumerGroups/$Default/Partitions/3"
        ));
        assert!(audience_covers("sb://h:1/", "amqps://ns/hub/$management"));
        assert!(audience_covers(
            "sb://127.0.0.1:5672/hub/consumergroups/$Default",
            "amqps://127.0.0.1:5672/hub/ConsumerGroups/$Default/Partitions/0"
        ));
        assert!(!audience_covers(
            "sb://h/hub",
            "amqps://ns/hub2/Partitions/0"
        ));
        assert!(!audience_covers(
            "sb://h/hub/Partitions/1",
            "amqps://ns/hub/Partitions/0"
        ));
    }

    #[tokio::test]
    async fn credential_issues_fresh_verifiable_tokens() {
        let cred = SasCredential::new(key2(), "sb://127.0.0.1:5672/hub");
        let token = cred.get_token(&["scope"], None).await.unwrap();
        let secret = token.token.secret().to_string();
        let now = SystemTime::now();
        let se = key2()
            .verify(&secret, "amqps://x/hub/$management", now)
            .unwrap();
        assert_eq!(se as i64, token.expires_on.unix_timestamp());
        assert!(
            token.expires_on
                > azure_core::time::OffsetDateTime::now_utc()
                    + azure_core::time::Duration::minutes(59)
        );
        assert!(!format!("{cred:?}").contains("SAS_KEY_VALUE"));
    }
}
