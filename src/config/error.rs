//! The configuration's one error type: which key is wrong, and why.

/// A configuration problem: where (the file, a key, an environment variable) and why. No
/// variant ever carries a secret's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("configuration: cannot read {}: {reason}", path.display())]
    Unreadable {
        /// The file.
        path: std::path::PathBuf,
        /// Why (the operating system's words).
        reason: String,
    },
    /// The text is not TOML: the line, and what the parser says (never the line itself).
    #[error("configuration: {0}")]
    Syntax(String),
    /// A `HUBGUARD_*` variable that is not a configuration key, or cannot be placed.
    #[error("configuration: environment variable {var}: {reason}")]
    Environment {
        /// The variable's name.
        var: String,
        /// Why.
        reason: String,
    },
    /// A value of the wrong type or shape, or an unknown key, at `key` (set by `env_var` when
    /// an environment override wrote it).
    #[error("configuration: {}", match env_var {
        Some(var) => format!("environment variable {var} ({key}): {message}"),
        None => format!("{key}: {message}"),
    })]
    Value {
        /// The key's dotted path (`retry.concurrency`).
        key: String,
        /// The environment variable that set it, if one did.
        env_var: Option<String>,
        /// What is wrong (not the value when the key holds a secret).
        message: String,
    },
    /// A value hubguard cannot run with (checked after parsing); `message` names the key and
    /// what is allowed.
    #[error("configuration: {message}")]
    Invalid {
        /// The key (or section) at fault.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
    },
}

impl ConfigError {
    /// The key at fault, when the problem is one key's.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Value { key, .. } | Self::Invalid { key, .. } => Some(key),
            _ => None,
        }
    }
}

pub(super) fn invalid(key: impl Into<String>, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.to_string(),
    }
}

/// A Service Bus entity name as Service Bus compares it: entity names are case-insensitive
/// ("Resource and resource group names are case-insensitive unless specifically noted …
/// Always perform a case-insensitive comparison of names",
/// <https://learn.microsoft.com/azure/azure-resource-manager/management/resource-name-rules#microsoftservicebus>),
/// and a path's leading or trailing `/` names the same entity.
pub(super) fn entity_key(name: &str) -> String {
    name.trim().trim_matches('/').to_ascii_lowercase()
}
