//! `hubguard check`: the preflight against the real namespace and account, from the same
//! configuration file as `run` (issue 43). Each line says what was proven, or what failed
//! and the fix. Every permission is proven by a harmless operation: the container is
//! listed under `hubguard-check/`, a probe blob is written (with an index tag when the
//! ledger uses them) and deleted; the retry queue's description is read and held to what the
//! configuration needs (the start-up proof `run` makes too); the hub's partitions read and a
//! receiver opened in the consumer group; the webhook's handshake made (or its host reached);
//! the Send and Listen rights on the retry queue proven with a probe message (`rights`); the
//! clock offsets to Service Bus and blob storage measured from the `Date` of those calls'
//! responses by the pipeline's own estimator (`clocks`), and to Event Hubs from the `Date`
//! of its namespace's REST answers to an unauthenticated `GET /{hub}`. `run` makes the storage lines
//! at start as well, and does not start when one fails.

mod clocks;
mod rights;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::azure::blob::{BlobContainer, BlobError, Condition};
use crate::azure::retry_queue::QueueRefusal;
use crate::config::Config;
use crate::wiring::{StorageAccess, Wiring, WiringError};

/// The prefix of the probe blobs (nothing else of hubguard's lives under it).
const PROBE_PREFIX: &str = "hubguard-check/";

/// One line of the check's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CheckLine {
    /// What was checked.
    pub what: String,
    /// Whether it holds.
    pub passed: bool,
    /// What was found.
    pub detail: String,
    /// What to do when it failed.
    pub fix: Option<String>,
}

impl CheckLine {
    fn pass(what: &str, detail: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            passed: true,
            detail: detail.into(),
            fix: None,
        }
    }

    fn fail(what: &str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            passed: false,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

impl std::fmt::Display for CheckLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mark = if self.passed { "pass" } else { "FAIL" };
        write!(f, "{mark}  {}: {}", self.what, self.detail)?;
        if let Some(fix) = &self.fix {
            write!(f, "\n      fix: {fix}")?;
        }
        Ok(())
    }
}

/// The fix for a storage refusal, by its status and code.
fn storage_fix(e: &BlobError, container: &str) -> String {
    let (account, name) = account_and_container(container);
    match (e.status(), e.code()) {
        (Some(404), Some("ContainerNotFound")) => format!(
            "create the container: az storage container create --account-name {account} --name {name} --auth-mode login"
        ),
        (Some(401 | 403), _) => format!(
            "grant Storage Blob Data Contributor on the container to hubguard's identity: az role assignment create --role \"Storage Blob Data Contributor\" --assignee <principal-id> --scope <storage-account-id>/blobServices/default/containers/{name}; with a SAS, give it the permissions r, a, c, w, d, l (and t with ledger.lifecycle_tags)"
        ),
        (None, _) => format!("make {container} reachable from this host (DNS, firewall, private endpoint)"),
        _ => "see the error above; Azure's error codes: learn.microsoft.com/rest/api/storageservices/blob-service-error-codes".into(),
    }
}

/// The account and container names of a container URL (the last two path segments of a
/// path-style emulator URL, else the host's first label and the path).
fn account_and_container(url: &str) -> (String, String) {
    let parsed = url::Url::parse(url).ok();
    let segs: Vec<String> = parsed
        .as_ref()
        .and_then(|u| u.path_segments())
        .map(|s| s.filter(|x| !x.is_empty()).map(str::to_string).collect())
        .unwrap_or_default();
    let host = parsed.as_ref().and_then(|u| u.host_str()).unwrap_or("");
    match segs.as_slice() {
        [account, container] => (account.clone(), container.clone()),
        [container] => (
            host.split('.').next().unwrap_or("").into(),
            container.clone(),
        ),
        _ => ("<account>".into(), "<container>".into()),
    }
}

/// The storage lines: reachable and listable, writable and deletable (with tags when the
/// ledger uses them); each response's `Date` measured on `clock`.
pub(super) async fn storage_lines(
    storage: &StorageAccess,
    deadline: Duration,
    clock: &Arc<crate::clock::Clock>,
) -> Vec<CheckLine> {
    let container =
        match BlobContainer::new(&storage.container_url, storage.credential.clone(), deadline) {
            Ok(c) => {
                c.measure_on(clock.clone());
                Arc::new(c)
            }
            Err(e) => {
                return vec![CheckLine::fail(
                "storage.container_url",
                e.to_string(),
                "set storage.container_url to https://<account>.blob.core.windows.net/<container>",
            )]
            }
        };
    let url = container.url().to_string();
    let mut lines = Vec::new();
    match tokio::time::timeout(deadline, container.list_blobs(PROBE_PREFIX, false)).await {
        Ok(Ok(_)) => lines.push(CheckLine::pass(
            "storage: list",
            format!("{url} reachable and listable"),
        )),
        Ok(Err(e)) => {
            lines.push(CheckLine::fail(
                "storage: list",
                format!("{url}: {e}"),
                storage_fix(&e, &url),
            ));
            return lines;
        }
        Err(_) => {
            lines.push(CheckLine::fail(
                "storage: list",
                format!("{url}: no answer within {deadline:?}"),
                format!("make {url} reachable from this host (DNS, firewall, private endpoint)"),
            ));
            return lines;
        }
    }
    lines.extend(probe_lines(&container, &url, storage.index_tags, deadline).await);
    lines
}

/// A probe blob written (tagged when the ledger uses index tags) and deleted.
async fn probe_lines(
    container: &BlobContainer,
    url: &str,
    index_tags: bool,
    deadline: Duration,
) -> Vec<CheckLine> {
    let mut lines = Vec::new();
    let probe = format!("{PROBE_PREFIX}{}", uuid::Uuid::new_v4());
    let tags: &[(&str, &str)] = if index_tags {
        &[("hubguard", "check")]
    } else {
        &[]
    };
    let what = if index_tags {
        "storage: write, tag, delete"
    } else {
        "storage: write, delete"
    };
    let written = tokio::time::timeout(
        deadline,
        container.put_blob_tagged(
            &probe,
            Bytes::from_static(b"probe"),
            "text/plain",
            &[],
            tags,
            &Condition::IfNotExists,
        ),
    )
    .await;
    let written = match written {
        Ok(Ok(w)) => w,
        Ok(Err(e)) => {
            lines.push(CheckLine::fail(
                what,
                format!("writing {probe}: {e}"),
                storage_fix(&e, url),
            ));
            return lines;
        }
        Err(_) => {
            lines.push(CheckLine::fail(
                what,
                format!("writing {probe}: no answer within {deadline:?}"),
                "check the account's availability and network path",
            ));
            return lines;
        }
    };
    match tokio::time::timeout(deadline, container.delete_blob(&probe, Some(&written.etag))).await {
        Ok(Ok(())) => lines.push(CheckLine::pass(
            what,
            format!("a probe blob written and deleted under {PROBE_PREFIX}"),
        )),
        Ok(Err(e)) => lines.push(CheckLine::fail(
            what,
            format!("deleting {probe}: {e}"),
            storage_fix(&e, url),
        )),
        Err(_) => lines.push(CheckLine::fail(
            what,
            format!("deleting {probe}: no answer within {deadline:?}"),
            "check the account's availability and network path",
        )),
    }
    lines
}

/// The retry queue's line: its description read and held to the configuration (duplicate
/// detection and its window against the retry schedule, lock duration, delivery count,
/// message size): the proof `run` makes at start.
async fn queue_lines(wiring: &Wiring, queue: &str) -> Vec<CheckLine> {
    let what = format!("servicebus: queue {queue}");
    match wiring.prove_retry_queue().await {
        Ok(warnings) if warnings.is_empty() => vec![CheckLine::pass(&what, "its settings keep hubguard's promise")],
        Ok(warnings) => warnings
            .into_iter()
            .map(|w| CheckLine::fail(&what, w, "grant Azure Service Bus Data Owner (or use a SAS policy with Manage) so the queue's settings can be read and proven"))
            .collect(),
        Err(WiringError::QueueRefused(r)) => {
            let fix = queue_fix(&r, queue);
            vec![CheckLine::fail(&what, r.to_string(), fix)]
        }
        Err(e) => vec![CheckLine::fail(&what, e.to_string(), "see servicebus in the configuration")],
    }
}

/// The fix for a refused queue: the az CLI command that makes it keep the promise.
fn queue_fix(refusal: &QueueRefusal, queue: &str) -> String {
    let create = |need: &Duration| {
        format!(
            "az servicebus queue create --resource-group <rg> --namespace-name <namespace> --name {queue} --enable-duplicate-detection true --duplicate-detection-history-time-window PT{}S",
            need.as_secs()
        )
    };
    match refusal {
        QueueRefusal::Missing { need, .. } => format!("create the queue: {}", create(need)),
        QueueRefusal::NoDuplicateDetection { need, .. } => format!(
            "set RequiresDuplicateDetection (only possible when a queue is created): {}, then set servicebus.queue to it",
            create(need)
        ),
        QueueRefusal::WindowTooShort { need, .. } => format!(
            "az servicebus queue update --resource-group <rg> --namespace-name <namespace> --name {queue} --duplicate-detection-history-time-window PT{}S",
            need.as_secs()
        ),
    }
}

/// The Event Hubs lines: the hub's properties read (its partition count), a receiver
/// opened on its first partition in the consumer group (the group exists, and the identity
/// may listen; nothing is read).
async fn eventhubs_lines(
    t: &crate::pipeline::EventHubsTarget,
    deadline: Duration,
) -> Vec<CheckLine> {
    use azure_messaging_eventhubs::{
        ConsumerClient, OpenReceiverOptions, StartLocation, StartPosition,
    };
    let what = format!("eventhubs: {} ({})", t.hub, t.consumer_group);
    let listen_fix = format!(
        "grant Azure Event Hubs Data Receiver on the hub to hubguard's identity: az role assignment create --role \"Azure Event Hubs Data Receiver\" --assignee <principal-id> --scope <namespace-id>/eventhubs/{}; with a connection string, use a policy with Listen",
        t.hub
    );
    let mut builder = ConsumerClient::builder()
        .with_application_id(format!("hubguard-check-{}", std::process::id()))
        .with_consumer_group(t.consumer_group.clone());
    if let Some(e) = &t.custom_endpoint {
        builder = builder.with_custom_endpoint(e.clone());
    }
    let consumer = match tokio::time::timeout(
        deadline,
        t.auth.open_consumer(builder, &t.namespace, &t.hub),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            return vec![CheckLine::fail(
                &what,
                format!("connecting: {e}"),
                listen_fix,
            )]
        }
        Err(_) => {
            return vec![CheckLine::fail(
                &what,
                format!("no connection within {deadline:?}"),
                format!(
                    "make {} reachable from this host (AMQP over TLS, port 5671)",
                    t.namespace
                ),
            )]
        }
    };
    let mut lines = Vec::new();
    let partitions = match tokio::time::timeout(deadline, consumer.get_eventhub_properties()).await
    {
        Ok(Ok(p)) => {
            lines.push(CheckLine::pass(
                &format!("{what}: hub"),
                format!("{} partitions", p.partition_ids.len()),
            ));
            p.partition_ids
        }
        Ok(Err(e)) => {
            let fix = format!("check that the hub {} exists in {} (az eventhubs eventhub show --resource-group <rg> --namespace-name <namespace> --name {}), and {listen_fix}", t.hub, t.namespace, t.hub);
            lines.push(CheckLine::fail(&format!("{what}: hub"), e.to_string(), fix));
            return lines;
        }
        Err(_) => {
            lines.push(CheckLine::fail(
                &format!("{what}: hub"),
                format!("no answer within {deadline:?}"),
                "check the namespace's availability",
            ));
            return lines;
        }
    };
    let options = OpenReceiverOptions {
        start_position: Some(StartPosition {
            location: StartLocation::Latest,
            ..Default::default()
        }),
        ..Default::default()
    };
    let first = partitions.first().cloned().unwrap_or_else(|| "0".into());
    let cg_fix = format!(
        "create the consumer group: az eventhubs eventhub consumer-group create --resource-group <rg> --namespace-name <namespace> --eventhub-name {} --name {}",
        t.hub, t.consumer_group
    );
    let cg_what = format!("{what}: consumer group");
    lines.push(match attach(&consumer, &first, options, deadline).await {
        Ok(detail) => CheckLine::pass(&cg_what, detail),
        Err(e) => CheckLine::fail(&cg_what, e, format!("{cg_fix}; or {listen_fix}")),
    });
    let _ = tokio::time::timeout(deadline, consumer.close()).await;
    lines
}

/// The webhook's line: with `[handler.handshake]` on, the CloudEvents abuse-protection
/// handshake made (the `OPTIONS` request a receiver answers before it takes deliveries);
/// otherwise its host reached (a TCP connection, nothing sent).
async fn webhook_line(config: &Config) -> CheckLine {
    let crate::config::HandlerSection::Webhook(w) = &config.handler;
    let what = "webhook";
    let shown = crate::redact::redact(&w.url);
    let handler = match crate::handler::webhook::WebhookHandler::new(w.clone()) {
        Ok(h) => h,
        Err(e) => {
            return CheckLine::fail(what, e.to_string(), "see [handler] in the configuration")
        }
    };
    match handler.handshake_now().await {
        Ok(true) => CheckLine::pass(what, format!("{shown} agreed to receive (handshake, origin {})", w.handshake.origin)),
        Err(reason) => CheckLine::fail(
            what,
            format!("{shown}: {reason}"),
            "the receiver must answer the CloudEvents abuse-protection handshake (OPTIONS with WebHook-Request-Origin → 200 with WebHook-Allowed-Origin); see docs/webhook.md, or turn handler.handshake off",
        ),
        Ok(false) => {
            let target = url::Url::parse(&w.url).ok().and_then(|u| {
                Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?))
            });
            let Some(target) = target else {
                return CheckLine::fail(what, format!("{shown} has no host"), "set handler.url");
            };
            let timeout = Duration::from_millis(w.timeout_ms);
            match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&target)).await {
                Ok(Ok(_)) => CheckLine::pass(what, format!("{shown}: its host accepts connections (the handshake is off: nothing sent)")),
                Ok(Err(e)) => CheckLine::fail(what, format!("{shown}: {e}"), format!("make {target} reachable from this host")),
                Err(_) => CheckLine::fail(what, format!("{shown}: no connection within {timeout:?}"), format!("make {target} reachable from this host")),
            }
        }
    }
}

/// Attaches a receiver on `partition` (the SDK attaches on the first poll) and waits up to
/// [`ATTACH_WAIT`] for Event Hubs to refuse it (an unknown consumer group, no Listen right).
async fn attach(
    consumer: &azure_messaging_eventhubs::ConsumerClient,
    partition: &str,
    options: azure_messaging_eventhubs::OpenReceiverOptions,
    deadline: Duration,
) -> Result<String, String> {
    use futures::StreamExt;
    let receiver = match tokio::time::timeout(
        deadline,
        consumer.open_receiver_on_partition(partition.to_string(), Some(options)),
    )
    .await
    {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err(format!("no receiver within {deadline:?}")),
    };
    let wait = ATTACH_WAIT.min(deadline);
    let first = {
        let mut events = receiver.stream_events();
        tokio::time::timeout(wait, events.next()).await
    };
    let _ = tokio::time::timeout(deadline, receiver.close()).await;
    match first {
        Ok(Some(Err(e))) => Err(e.to_string()),
        Ok(None) => Err("the receiver closed at once".into()),
        Ok(Some(Ok(_))) | Err(_) => Ok(format!(
            "a receiver attached on partition {partition} (not refused within {wait:?}; nothing settled)"
        )),
    }
}

/// How long a receiver waits to be refused.
const ATTACH_WAIT: Duration = Duration::from_secs(2);

/// Every line of the check, for `config`.
pub(super) async fn check_lines(config: &Config) -> anyhow::Result<Vec<CheckLine>> {
    let storage = StorageAccess::from_config(config)?;
    let mut wiring = Wiring::from_config(config)?;
    // A clock of check's own: every Service Bus and blob response below is measured on it.
    let clock = Arc::new(crate::clock::Clock::default());
    wiring.options_mut().clock = clock.clone();
    let deadline = wiring.options_mut().deadline;
    let bound = wiring.options_mut().max_clock_skew;
    let mut lines = storage_lines(&storage, deadline, &clock).await;
    let queue = &config.servicebus.queue;
    lines.extend(queue_lines(&wiring, queue).await);
    match wiring.retry_queue() {
        Ok(q) => lines.extend(rights::rights_lines(&q.without_batching(), queue).await),
        Err(e) => lines.push(CheckLine::fail(
            &format!("servicebus: send to {queue}"),
            e.to_string(),
            "see [servicebus] in the configuration",
        )),
    }
    let eventhubs = wiring.eventhubs();
    lines.extend(eventhubs_lines(eventhubs, deadline).await);
    lines.push(webhook_line(config).await);
    lines.extend(clocks::clock_lines(&clock, bound));
    let url = clocks::eventhubs_rest_url(
        config.eventhubs.rest_endpoint.as_deref(),
        &eventhubs.namespace,
        &eventhubs.hub,
    );
    let emulator = eventhubs.custom_endpoint.is_some() && config.eventhubs.rest_endpoint.is_none();
    lines.push(clocks::eventhubs_clock_line(url, emulator, &clock, deadline, bound).await);
    Ok(lines)
}

/// `hubguard check`: prints each line; exit 1 when any failed.
pub(super) async fn check(args: super::ConfigArg) -> anyhow::Result<u8> {
    let config = super::load_config(&args)?;
    let lines = check_lines(&config).await?;
    for l in &lines {
        println!("{l}");
    }
    let failed = lines.iter().filter(|l| !l.passed).count();
    if failed == 0 {
        println!("hubguard check: all {} checks passed", lines.len());
        Ok(super::EXIT_OK)
    } else {
        println!("hubguard check: {failed} of {} checks failed", lines.len());
        Ok(super::EXIT_FAILURE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixes_name_the_command() {
        let (a, c) = account_and_container("https://acct.blob.core.windows.net/hubguard");
        assert_eq!((a.as_str(), c.as_str()), ("acct", "hubguard"));
        let (a, c) = account_and_container("http://127.0.0.1:1/devstoreaccount1/hubguard");
        assert_eq!((a.as_str(), c.as_str()), ("devstoreaccount1", "hubguard"));
        let refusal = QueueRefusal::NoDuplicateDetection {
            queue: "retries".into(),
            need: Duration::from_secs(900),
        };
        let fix = queue_fix(&refusal, "retries");
        assert!(
            fix.contains("RequiresDuplicateDetection") && fix.contains("PT900S"),
            "{fix}"
        );
    }
}
