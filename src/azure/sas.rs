//! Shared Access Signature tokens for Event Hubs and Service Bus: the client's signing.
//!
//! A token reads `SharedAccessSignature sr=<url-encoded resource>&sig=<url-encoded
//! base64 signature>&se=<unix expiry>&skn=<key name>`, where the signature is
//! `HMAC-SHA256(key, "<sr as it appears in the token>\n<se>")` and the HMAC key is the raw
//! UTF-8 bytes of the key string (not its base64 decoding). The emulators' side — checking a
//! token, and a `TokenCredential` for the tests — is `emulator::sas`.

use std::fmt;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use sha2::Sha256;

/// The characters `application/x-www-form-urlencoded` leaves alone are `*-._` and
/// alphanumerics; everything else is escaped (a space as `%20`, which every SDK accepts).
const FORM: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'*')
    .remove(b'-')
    .remove(b'.')
    .remove(b'_');

/// A named shared access key. `Debug` and `Display` never show the key.
#[derive(Clone, PartialEq, Eq)]
pub struct SasKey {
    name: String,
    key: String,
}

impl fmt::Debug for SasKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SasKey")
            .field("name", &self.name)
            .field("key", &"<redacted>")
            .finish()
    }
}

impl SasKey {
    /// A key called `name` with the secret `key` (as written in a connection string).
    pub fn new(name: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            key: key.into(),
        }
    }

    /// The key's name (`SharedAccessKeyName`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The secret itself, for building a connection string to hand to a client. Never log it.
    pub fn secret(&self) -> &str {
        &self.key
    }

    /// The base64 HMAC-SHA256 of `string_to_sign` under this key (a token's `sig`, before
    /// its URL encoding).
    pub(crate) fn signature(&self, string_to_sign: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(self.key.as_bytes())
            .expect("HMAC accepts keys of any length");
        mac.update(string_to_sign.as_bytes());
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    }

    /// A token for `resource` (e.g. `sb://ns.servicebus.windows.net/hub`) that expires at
    /// `expiry` (whole seconds since the Unix epoch).
    pub fn token(&self, resource: &str, expiry: u64) -> String {
        let sr = utf8_percent_encode(resource, FORM).to_string();
        let sig = self.signature(&format!("{sr}\n{expiry}"));
        format!(
            "SharedAccessSignature sr={sr}&sig={}&se={expiry}&skn={}",
            utf8_percent_encode(&sig, FORM),
            utf8_percent_encode(&self.name, FORM)
        )
    }
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
    const VECTOR_2: &str = "SharedAccessSignature sr=sb%3A%2F%2F127.0.0.1%3A5672%2Fhub&sig=Je6PwGVse3dCUsdbJXi2LeUkpLWnZKxux7RasZSmu4A%3D&se=4102444800&skn=hubguard";

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
    fn tokens_match_known_vectors() {
        assert_eq!(
            key1().token(
                "sb://mynamespace.servicebus.windows.net/myhub",
                1_700_000_000
            ),
            VECTOR_1
        );
        assert_eq!(
            key2().token("sb://127.0.0.1:5672/hub", 4_102_444_800),
            VECTOR_2
        );
    }
}
