//! Standard Webhooks signatures (<https://www.standardwebhooks.com>, "Signature scheme"):
//! every request carries `webhook-id` (stable across retries of one event: its idempotency
//! key), `webhook-timestamp` (Unix seconds) and `webhook-signature`, `v1,` followed by the
//! base64 HMAC-SHA256 of `{id}.{timestamp}.{body}` under the secret. Secrets are written
//! `whsec_` + base64 of the key bytes. With several secrets active (a rotation), one
//! signature per secret is sent, space-separated: receivers holding either secret verify.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The signing keys in force (never printed).
#[derive(Clone, PartialEq, Eq)]
pub struct SigningKeys(Vec<Vec<u8>>);

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKeys({} key(s), redacted)", self.0.len())
    }
}

/// The secret prefix of the Standard Webhooks format.
pub const SECRET_PREFIX: &str = "whsec_";

/// Why signing secrets could not be read: names the configuration key and the secret's
/// position, never a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SigningKeyError {
    /// A secret without the `whsec_` prefix.
    #[error("{key}: secret {n} of {of} does not start with `{SECRET_PREFIX}` (Standard Webhooks form: whsec_ followed by base64)")]
    NoPrefix {
        /// The configuration key.
        key: String,
        /// Which secret (from 1).
        n: usize,
        /// How many were given.
        of: usize,
    },
    /// A secret whose key is not base64.
    #[error("{key}: secret {n} of {of} is not valid base64 after `{SECRET_PREFIX}`")]
    NotBase64 {
        /// The configuration key.
        key: String,
        /// Which secret (from 1).
        n: usize,
        /// How many were given.
        of: usize,
    },
    /// A key shorter than 16 bytes.
    #[error(
        "{key}: secret {n} of {of} is shorter than 16 bytes (Standard Webhooks asks for 24 to 64)"
    )]
    TooShort {
        /// The configuration key.
        key: String,
        /// Which secret (from 1).
        n: usize,
        /// How many were given.
        of: usize,
    },
    /// No secret at all.
    #[error("{key}: no secret given")]
    Empty {
        /// The configuration key.
        key: String,
    },
}

impl SigningKeys {
    /// Parses one or more `whsec_<base64>` secrets separated by whitespace or commas. The
    /// error names `key` and which secret is wrong (by position), never a secret.
    pub fn parse(key: &str, text: &str) -> Result<Self, SigningKeyError> {
        let mut keys = Vec::new();
        let parts: Vec<&str> = text
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|s| !s.is_empty())
            .collect();
        let (key, of) = (key.to_string(), parts.len());
        for (i, s) in parts.iter().enumerate() {
            let n = i + 1;
            let b64 = s
                .strip_prefix(SECRET_PREFIX)
                .ok_or_else(|| SigningKeyError::NoPrefix {
                    key: key.clone(),
                    n,
                    of,
                })?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(b64))
                .map_err(|_| SigningKeyError::NotBase64 {
                    key: key.clone(),
                    n,
                    of,
                })?;
            if bytes.len() < 16 {
                return Err(SigningKeyError::TooShort { key, n, of });
            }
            keys.push(bytes);
        }
        if keys.is_empty() {
            return Err(SigningKeyError::Empty { key });
        }
        Ok(Self(keys))
    }

    /// How many secrets are active.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none (never, once parsed).
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The `webhook-signature` value for `id`, `timestamp` and `body`: `v1,<base64>` per
    /// secret, space-separated.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        self.0
            .iter()
            .map(|k| {
                let mut mac = Hmac::<Sha256>::new_from_slice(k).expect("HMAC takes any key size");
                mac.update(id.as_bytes());
                mac.update(b".");
                mac.update(timestamp.to_string().as_bytes());
                mac.update(b".");
                mac.update(body);
                format!(
                    "v1,{}",
                    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_specifications_example_verifies() {
        // The example in the Standard Webhooks specification (and its reference libraries'
        // tests): secret, id, timestamp, body and the expected signature.
        let keys = SigningKeys::parse("k", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            keys.sign(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1614265330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn several_secrets_sign_separately_and_errors_never_quote_them() {
        let keys = SigningKeys::parse(
            "k",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw whsec_c2Vjb25kLXNlY3JldC1rZXktMTIzNDU2",
        )
        .unwrap();
        assert_eq!(keys.len(), 2);
        let sig = keys.sign("id", 1, b"x");
        assert_eq!(sig.split(' ').count(), 2, "{sig}");
        assert!(!format!("{keys:?}").contains("MfKQ"));
        let e = SigningKeys::parse(
            "handler.signing",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw nope-SECRETVALUE",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("handler.signing") && e.contains("secret 2 of 2"),
            "{e}"
        );
        assert!(!e.contains("SECRETVALUE"), "{e}");
        let e = SigningKeys::parse("k", "whsec_!!!SECRET")
            .unwrap_err()
            .to_string();
        assert!(e.contains("base64") && !e.contains("SECRET!"), "{e}");
    }
}
