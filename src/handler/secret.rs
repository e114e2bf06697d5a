//! Secrets the webhook handler sends (signing secrets, an `Authorization` value): the
//! configuration names where they are — an environment variable or a file — and never holds
//! them. A file is read again when it changes (a Kubernetes secret volume is updated in
//! place), so a rotation needs no restart. No error, log line or `Debug` output quotes one.

use crate::sync::LockExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::Deserialize;

/// Where a secret is: exactly one of `env` (an environment variable's name) or `file`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSource {
    /// The environment variable holding it.
    pub env: Option<String>,
    /// The file holding it (surrounding whitespace is ignored).
    pub file: Option<PathBuf>,
}

impl SecretSource {
    /// From an environment variable.
    pub fn env(name: impl Into<String>) -> Self {
        Self {
            env: Some(name.into()),
            file: None,
        }
    }

    /// From a file.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Self {
            env: None,
            file: Some(path.into()),
        }
    }

    /// Where it is, for messages (the variable's name or the file's path; never the value).
    pub fn describe(&self) -> String {
        match (&self.env, &self.file) {
            (Some(v), _) => format!("environment variable {v}"),
            (None, Some(f)) => format!("file {}", f.display()),
            (None, None) => "nowhere".into(),
        }
    }

    fn check(&self, key: &str) -> Result<(), String> {
        match (&self.env, &self.file) {
            (Some(_), Some(_)) => Err(format!("{key}: set `env` or `file`, not both")),
            (None, None) => Err(format!("{key}: set `env` (a variable's name) or `file`")),
            (Some(v), None) if v.trim().is_empty() => Err(format!("{key}.env is empty")),
            _ => Ok(()),
        }
    }

    fn modified(&self) -> Option<SystemTime> {
        self.file
            .as_ref()
            .and_then(|f| std::fs::metadata(f).ok())
            .and_then(|m| m.modified().ok())
    }

    /// Reads it now. Errors name `key` and the source, never the content.
    fn read(&self, key: &str) -> Result<String, String> {
        self.check(key)?;
        let value = match (&self.env, &self.file) {
            (Some(v), _) => std::env::var(v).map_err(|e| {
                format!(
                    "{key}: environment variable {v} {}",
                    match e {
                        std::env::VarError::NotPresent => "is not set",
                        std::env::VarError::NotUnicode(_) => "is not UTF-8",
                    }
                )
            })?,
            (None, Some(f)) => std::fs::read_to_string(f)
                .map_err(|e| format!("{key}: cannot read {}: {}", f.display(), e.kind()))?,
            (None, None) => unreachable!("checked"),
        };
        let value = value.trim().to_string();
        if value.is_empty() {
            return Err(format!("{key}: {} is empty", self.describe()));
        }
        Ok(value)
    }
}

/// A secret loaded from its [`SecretSource`] and parsed into `T`; a file is re-read (and
/// re-parsed) when its modification time changes. A change that does not parse keeps the
/// last good value and logs where the bad one is (never what it is).
pub struct Live<T> {
    key: String,
    source: SecretSource,
    parse: fn(&str, &str) -> Result<T, String>,
    current: Mutex<(Option<SystemTime>, Arc<T>)>,
}

impl<T> std::fmt::Debug for Live<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("key", &self.key)
            .field("source", &self.source.describe())
            .finish_non_exhaustive()
    }
}

/// A secret that cannot be loaded: its source is missing, unreadable or ambiguous, or its
/// text does not parse. The message names the key and the source, never the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SecretError(String);

impl From<String> for SecretError {
    fn from(message: String) -> Self {
        Self(message)
    }
}

impl<T> Live<T> {
    /// Loads the secret at `source` (configured as `key`) and parses it with `parse`
    /// (`parse(key, text)`; its errors must not quote the text).
    pub fn load(
        key: &str,
        source: &SecretSource,
        parse: fn(&str, &str) -> Result<T, String>,
    ) -> Result<Self, SecretError> {
        let modified = source.modified();
        let value = parse(key, &source.read(key)?)?;
        Ok(Self {
            key: key.to_string(),
            source: source.clone(),
            parse,
            current: Mutex::new((modified, Arc::new(value))),
        })
    }

    /// The current value (a file that changed since the last call is read again).
    pub fn get(&self) -> Arc<T> {
        let mut cur = self.current.locked();
        if self.source.file.is_some() {
            let modified = self.source.modified();
            if modified.is_some() && modified != cur.0 {
                match self
                    .source
                    .read(&self.key)
                    .and_then(|t| (self.parse)(&self.key, &t))
                {
                    Ok(v) => {
                        tracing::info!(key = %self.key, source = %self.source.describe(), "secret reloaded");
                        *cur = (modified, Arc::new(v));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "secret changed but cannot be used; keeping the previous one");
                        cur.0 = modified;
                    }
                }
            }
        }
        cur.1.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(_: &str, t: &str) -> Result<String, String> {
        Ok(t.to_string())
    }

    #[test]
    fn errors_name_the_key_and_source_never_the_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let e = Live::load("handler.authorization", &SecretSource::file(&path), text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("handler.authorization") && e.contains("token"),
            "{e}"
        );
        std::fs::write(&path, "  Bearer TOPSECRET\n").unwrap();
        let live = Live::load("handler.authorization", &SecretSource::file(&path), text).unwrap();
        assert_eq!(live.get().as_str(), "Bearer TOPSECRET");
        assert!(!format!("{live:?}").contains("TOPSECRET"));
        let e = Live::load(
            "handler.authorization",
            &SecretSource::env("HUBGUARD_TEST_UNSET_VARIABLE_X"),
            text,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("HUBGUARD_TEST_UNSET_VARIABLE_X is not set"),
            "{e}"
        );
        let both = SecretSource {
            env: Some("A".into()),
            file: Some(path.clone()),
        };
        assert!(Live::load("k", &both, text)
            .unwrap_err()
            .to_string()
            .contains("not both"));
    }

    #[test]
    fn a_changed_file_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        std::fs::write(&path, "one").unwrap();
        let live = Live::load("k", &SecretSource::file(&path), text).unwrap();
        assert_eq!(live.get().as_str(), "one");
        std::fs::write(&path, "two").unwrap();
        // Make sure the modification time differs even on a coarse file system.
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert_eq!(live.get().as_str(), "two");
    }
}
