//! `hubguard run`'s configuration: TOML, then `HUBGUARD_*` environment overrides, then
//! validation. A bad value stops start-up with an error that names the key and what is
//! allowed; no error ever quotes a secret (connection strings are never echoed).
//!
//! Environment overrides use `__` between levels: `HUBGUARD_EVENTHUBS__CONNECTION_STRING`,
//! `HUBGUARD_POLICY__DEFAULT__MAX_ATTEMPTS`, `HUBGUARD_STATUS__LISTEN`. Values are read as
//! TOML (numbers, booleans, arrays) and otherwise as strings.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::event::IdentityConfig;
use crate::handler::webhook::WebhookConfig;
use crate::policy::RetryPolicy;

mod checks;
mod error;
mod options;
mod sections;

pub use error::ConfigError;
use error::{entity_key, invalid};
pub(crate) use sections::window_for;
pub use sections::{
    Access, CheckpointSection, ConsoleSection, CredentialKind, DeadLettersSection,
    EventHubsSection, HandlerSection, LedgerSection, OperationalEventsSection, PolicySection,
    ProcessorSection, RetryOrderingKind, RetrySection, ServiceBusSection, StartPosition,
    StatusSection, StorageSection,
};
#[cfg(any(test, feature = "testbed"))]
pub use sections::{DEFAULT_MAX_IN_FLIGHT, DEFAULT_RETRY_CONCURRENCY};

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[eventhubs]`
    pub eventhubs: EventHubsSection,
    /// `[servicebus]`
    pub servicebus: ServiceBusSection,
    /// `[storage]`
    pub storage: StorageSection,
    /// `[handler]`
    pub handler: HandlerSection,
    /// `[processor]`
    #[serde(default)]
    pub processor: ProcessorSection,
    /// `[checkpoint]`
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// `[retry]`
    #[serde(default)]
    pub retry: RetrySection,
    /// `[policy]`
    #[serde(default)]
    pub policy: PolicySection,
    /// `[identity]`
    #[serde(default)]
    pub identity: IdentityConfig,
    /// `[status]`
    #[serde(default)]
    pub status: StatusSection,
    /// `[log]`: the log format (read before the rest, so start-up logs follow it).
    #[serde(default)]
    pub log: crate::telemetry::logs::LogSection,
    /// `[breaker]`: the circuit breaker for the handler's downstream.
    #[serde(default)]
    pub breaker: crate::breaker::BreakerConfig,
    /// `[storm_guard]`: refusals for good stop being dead-lettered when a downstream refuses
    /// nearly everything (defined beside the breaker: `breaker::storm`).
    #[serde(default)]
    pub storm_guard: crate::breaker::storm::StormGuardConfig,
    /// `[dead_letters]`: where dead letters are also published (none by default).
    #[serde(default)]
    pub dead_letters: Option<DeadLettersSection>,
    /// `[operational_events]`: CloudEvents about hubguard itself (none by default).
    #[serde(default)]
    pub operational_events: Option<OperationalEventsSection>,
    /// `[ledger]`: how long delivered records are kept.
    #[serde(default)]
    pub ledger: LedgerSection,
    /// `[console]`: the web console on `status.listen`, and who may read and act.
    #[serde(default)]
    pub console: ConsoleSection,
}

const POLICY_KEYS: &[&str] = &[
    "name",
    "curve",
    "base_s",
    "floor_s",
    "cap_s",
    "max_attempts",
    "max_age_s",
    "delays_s",
    "repeat_last",
];

/// `SERVICE_HOST`, `SERVICE_PORT…`, `PORT`, `PORT_…`: what Kubernetes sets for a Service
/// (its "service links"), after the Service's upper-cased name.
fn is_service_link(rest: &str) -> bool {
    rest.ends_with("SERVICE_HOST")
        || rest.contains("SERVICE_PORT")
        || rest == "PORT"
        || rest.ends_with("_PORT")
        || rest.starts_with("PORT_")
        || rest.contains("_PORT_")
}

/// Keys whose values are (or may carry) secrets, never quoted in an error: connection
/// strings, a container URL (its query may hold a SAS), and anything named like a secret.
/// Matched on the key's last segment, so `processor.ordering_key` or
/// `identity.idempotency_key_properties` keep their helpful messages.
fn is_secret_path(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path).to_ascii_lowercase();
    matches!(
        last.as_str(),
        "connection_string" | "container_url" | "key" | "sas"
    ) || ["secret", "token", "password", "authorization"]
        .iter()
        .any(|s| last.contains(s))
}

/// Describes a TOML error by position and message, never by quoting the source line.
fn describe(e: &toml::de::Error, source: &str) -> String {
    let line = e
        .span()
        .map(|s| source[..s.start.min(source.len())].lines().count().max(1));
    match line {
        Some(l) => format!("line {l}: {}", e.message()),
        None => e.message().to_string(),
    }
}

fn set_path(root: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, parents) = path
        .split_last()
        .ok_or_else(|| "empty environment override".to_string())?;
    let mut table = root;
    for p in parents {
        let entry = table
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry
            .as_table_mut()
            .ok_or_else(|| format!("environment override: `{p}` is not a table"))?;
    }
    table.insert(last.clone(), value);
    Ok(())
}

fn env_value(raw: &str) -> toml::Value {
    match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    }
}

impl Config {
    /// Reads `path`, applies `HUBGUARD_*` overrides from `env`, and validates.
    pub fn load(
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let source = std::fs::read_to_string(path).map_err(|e| ConfigError::Unreadable {
            path: path.into(),
            reason: e.to_string(),
        })?;
        Self::parse(&source, env)
    }

    /// Parses TOML text, applies overrides, validates.
    pub fn parse(
        source: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut table: toml::Table = source
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Syntax(describe(&e, source)))?;
        seed_default_policy(&mut table)?;
        let from_env = apply_env_overrides(&mut table, env)?;
        check_policy_keys(&table)?;
        let config = deserialize_config(table, &from_env)?;
        config.validate()?;
        Ok(config)
    }
}

/// Gives the table a `[policy.default]` (the seed Fibonacci policy) when it has none.
fn seed_default_policy(table: &mut toml::Table) -> Result<(), ConfigError> {
    // Overrides of single policy fields apply on top of the default policy.
    let policy = table
        .entry("policy")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(p) = policy {
        if !p.contains_key("default") {
            let seed = toml::Value::try_from(RetryPolicy::seed_fibonacci())
                .map_err(|e| invalid("policy.default", e))?;
            p.insert("default".into(), seed);
        }
    }
    Ok(())
}

/// Applies the `HUBGUARD_SECTION__KEY` overrides in `env` to the table, and answers which
/// variable set each key (dotted path → variable).
fn apply_env_overrides(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<HashMap<String, String>, ConfigError> {
    // Which environment variable set each key, so an error names what the user wrote.
    let mut from_env: HashMap<String, String> = HashMap::new();
    for (k, v) in env {
        let Some(rest) = k.strip_prefix("HUBGUARD_") else {
            continue;
        };
        if rest.starts_with("EMULATOR_")
            || rest == "CONFIG"
            || rest.starts_with("REQUIRE_")
            || rest.starts_with("AZURITE")
        {
            continue; // settings of other commands and of the test suite
        }
        if !rest.contains("__") {
            // Every key lives in a section (`HUBGUARD_SECTION__KEY`). Kubernetes adds
            // `HUBGUARD_SERVICE_HOST`, `HUBGUARD_PORT_8080_TCP`, … for a Service named
            // `hubguard`: those are not ours. Anything else is a mistyped override.
            if is_service_link(rest) {
                continue;
            }
            return Err(ConfigError::Environment {
                var: k,
                reason: "not a configuration key; overrides are HUBGUARD_SECTION__KEY, with two underscores between levels (HUBGUARD_RETRY__CONCURRENCY)".into(),
            });
        }
        let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
        from_env.insert(path.join("."), k.clone());
        set_path(table, &path, env_value(&v)).map_err(|reason| ConfigError::Environment {
            var: k.clone(),
            reason,
        })?;
    }
    Ok(from_env)
}

/// Refuses a key no retry policy has, in `[policy.default]` or a `[policy.types."…"]`.
fn check_policy_keys(table: &toml::Table) -> Result<(), ConfigError> {
    let Some(toml::Value::Table(policy)) = table.get("policy") else {
        return Ok(());
    };
    let mut tables: Vec<(String, &toml::Table)> = Vec::new();
    if let Some(toml::Value::Table(d)) = policy.get("default") {
        tables.push(("policy.default".into(), d));
    }
    if let Some(toml::Value::Table(types)) = policy.get("types") {
        for (name, t) in types {
            if let toml::Value::Table(t) = t {
                tables.push((format!("policy.types.\"{name}\""), t));
            }
        }
    }
    for (where_, t) in tables {
        if let Some(k) = t.keys().find(|k| !POLICY_KEYS.contains(&k.as_str())) {
            return Err(ConfigError::Value {
                message: format!("unknown key `{k}` (allowed: {})", POLICY_KEYS.join(", ")),
                key: where_,
                env_var: None,
            });
        }
    }
    Ok(())
}

/// Deserialises the table into a [`Config`]; an error names the key at fault (and the
/// environment variable that set it, if one did).
fn deserialize_config(
    table: toml::Table,
    from_env: &HashMap<String, String>,
) -> Result<Config, ConfigError> {
    // `[handler]` is an internally tagged enum, whose errors serde reports at `handler`:
    // deserialise its body alone to find the key inside.
    let handler_body = table.get("handler").and_then(|h| h.as_table()).map(|h| {
        let mut h = h.clone();
        h.remove("kind");
        h
    });
    serde_path_to_error::deserialize(toml::Value::Table(table))
        .map_err(|e| value_error(&e, handler_body, from_env))
}

/// The [`ConfigError::Value`] for a deserialisation error: the key's full path, and its
/// message unless the key holds a secret.
fn value_error(
    e: &serde_path_to_error::Error<toml::de::Error>,
    handler_body: Option<toml::Table>,
    from_env: &HashMap<String, String>,
) -> ConfigError {
    let mut path = e.path().to_string();
    // A policy's curve is a flattened tagged enum: serde names its table only.
    if path.starts_with("policy.")
        && !path.ends_with(".curve")
        && e.inner().message().starts_with("unknown variant")
    {
        path.push_str(".curve");
    }
    if path == "handler" {
        if let Some(Err(inner)) = handler_body
            .map(|b| serde_path_to_error::deserialize::<_, WebhookConfig>(toml::Value::Table(b)))
        {
            path = format!("handler.{}", inner.path());
        }
    }
    let message = if is_secret_path(&path) {
        // A misplaced value could be a secret: name the key, not the value.
        "invalid value (not shown: this key holds a secret)".to_string()
    } else {
        e.inner().message().to_string()
    };
    ConfigError::Value {
        env_var: from_env.get(&path).cloned(),
        key: path,
        message,
    }
}

#[cfg(test)]
mod tests;
