//! `hubguard run`: the service.

use anyhow::Context as _;

use crate::config::HandlerSection;
use crate::handler::webhook::WebhookHandler;
use crate::pipeline::Pipeline;
use crate::wiring::Wiring;
use tokio_util::sync::CancellationToken;

use super::{load_config, shutdown_signal, ConfigArg};

pub(super) async fn run_pipeline(args: ConfigArg) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    // Start-up proof: the retry queue must keep hubguard's promise (duplicate detection on,
    // its window long enough for this configuration), or hubguard does not start.
    let mut wiring = Wiring::from_config(&config)?;
    for w in wiring.prove_retry_queue().await? {
        tracing::warn!("{w}");
    }
    // The cheap lines of `hubguard check`: the container reachable, writable and deletable.
    let storage = crate::wiring::StorageAccess::from_config(&config)?;
    let options = wiring.options_mut();
    let (deadline, clock) = (options.deadline, options.clock.clone());
    let failed: Vec<String> = super::check::storage_lines(&storage, deadline, &clock)
        .await
        .into_iter()
        .filter(|l| !l.passed && l.what.starts_with("storage"))
        .map(|l| l.to_string())
        .collect();
    if !failed.is_empty() {
        anyhow::bail!(
            "storage is not ready (see `hubguard check`):\n{}",
            failed.join("\n")
        );
    }
    let HandlerSection::Webhook(w) = &config.handler;
    let clock = wiring.options_mut().clock.clone();
    let handler = WebhookHandler::new(w.clone()).map_err(|e| anyhow::anyhow!(e))?;
    let parts = wiring.parts(handler.with_clock(clock).into_handler())?;
    let owner = parts.options.owner_id.clone();
    let rewind = crate::console::rewind::RewindParts::of(&parts);
    let pipeline = Pipeline::new(parts);
    let health = pipeline.health();
    let status = tokio::net::TcpListener::bind(config.status.listen)
        .await
        .with_context(|| format!("cannot bind status.listen {}", config.status.listen))?;
    let status_addr = status.local_addr()?;
    let mut router = crate::status::router_with_rate_limit(
        health.clone(),
        pipeline.settler().ledger.clone(),
        pipeline.breaker(),
        pipeline.rate_limiter(),
    )
    .merge(crate::telemetry::backlog::router(pipeline.backlog()));
    // The web console on the same listener (docs/console.md).
    let console = config
        .console
        .enabled
        .then(|| format!("http://{status_addr}/console/"));
    if config.console.enabled {
        let options = config.pipeline_options()?;
        let ordering = options
            .retry_ordering
            .lines()
            .map(|_| options.ordering.clone());
        let mut settings = crate::console::Settings::from_section(&config.console, ordering)?;
        settings.owner = owner.clone();
        settings.rewind = Some(rewind);
        router = router.merge(crate::console::Console::new(&pipeline, settings).router());
    }
    let status_task = tokio::spawn(async move {
        let _ = axum::serve(status, router).await;
    });
    // What is waiting, for /metrics: the ledger's listing once a minute.
    let _pending_gauges = crate::status::PendingGauges::start_with_lines(
        pipeline.settler().ledger.clone(),
        std::time::Duration::from_secs(60),
        config.pipeline_options()?.retry_ordering.lines().is_some(),
        pipeline.settler().clock().clone(),
    );
    // The figures alerts compare readings with (retention headroom).
    let _config_gauges = crate::telemetry::gauges::ConfigGauges::register(
        std::time::Duration::from_secs(config.eventhubs.retention_hours * 3600),
    );
    tracing::info!(hub = %config.eventhubs.hub, consumer_group = %config.eventhubs.consumer_group, owner_id = %owner, status = %status_addr, "hubguard running");
    println!(
        "hubguard: consuming {} ({}) as {owner}; status on http://{status_addr}{}",
        config.eventhubs.hub,
        config.eventhubs.consumer_group,
        console
            .map(|c| format!("; console on {c}"))
            .unwrap_or_default()
    );
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down: finishing in-flight events, writing final checkpoints");
        c.cancel();
    });
    pipeline.run(cancel).await?;
    status_task.abort();
    println!(
        "hubguard: stopped; {}",
        serde_json::to_string(&health.snapshot())?
    );
    Ok(())
}
