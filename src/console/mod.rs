//! The web console `hubguard run` serves on the status listener (`/console`; `/` leads
//! there): for support staff, a key's story ("when will this retry?"); for operators, what
//! waits, the dead letters grouped by cause, the partitions, and the actions of the command
//! line — pause and resume, retry now, cancel, replay — through the same operations.
//!
//! - `auth.rs`: the reading and acting roles, tokens, the trusted proxy, cross-site checks.
//! - `read.rs`: the JSON the page reads (lookup, retries, dead-letter groups, overview),
//!   from the ledger's pending index and dead-letter index and the health report: no page
//!   lists every record.
//! - `act.rs`: the actions and replay jobs with progress.
//! - `audit.rs`: the audit trail, one record the replicas share.
//! - `rewind.rs`: the rewind of checkpoints, through the command line's code.
//! - `schedule.rs`: the rest of a pinned schedule (pure).
//! - `assets/`: the page, its script and its style, built into the binary (no Node
//!   toolchain, nothing fetched from elsewhere). The page writes every text it shows with
//!   `textContent`, and a strict Content-Security-Policy lets no other script run.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::config::ConsoleSection;
use crate::ledger::Ledger;
use crate::pipeline::health::Health;
use crate::pipeline::settle::Settler;
use crate::pipeline::{OrderingKey, Pipeline};

pub mod act;
pub mod audit;
pub mod auth;
pub mod read;
pub mod rewind;
pub mod schedule;

pub use auth::{Access, Secret};

/// The console's settings, from `[console]` (tokens read from their files).
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// Who may read and act.
    pub access: Access,
    /// The trace link's template (`{trace_id}`, `{key}`, `{correlation_id}`).
    pub trace_url: Option<String>,
    /// Ordered retries' ordering key, when on: a replay re-drives a line in order.
    pub ordering: Option<OrderingKey>,
    /// This replica's owner id, shown beside the partitions it owns.
    pub owner: String,
    /// What a rewind needs (`None`: the console does not offer it).
    pub rewind: Option<rewind::RewindParts>,
}

/// A token file that cannot be read (the path named, never the contents).
#[derive(Debug, thiserror::Error)]
#[error("console.{key}: cannot read {path}: {reason}")]
pub struct TokenFileError {
    /// The configuration key.
    pub key: &'static str,
    /// The file.
    pub path: String,
    /// Why.
    pub reason: String,
}

impl Settings {
    /// From the configuration's `[console]` (`ordering`: ordered retries' key, when on).
    pub fn from_section(
        c: &ConsoleSection,
        ordering: Option<OrderingKey>,
    ) -> Result<Self, TokenFileError> {
        let token = |text: &Option<String>,
                     file: &Option<std::path::PathBuf>,
                     key: &'static str|
         -> Result<Option<Secret>, TokenFileError> {
            if let Some(f) = file {
                let read = std::fs::read_to_string(f).map_err(|e| TokenFileError {
                    key,
                    path: f.display().to_string(),
                    reason: e.kind().to_string(),
                })?;
                return Ok(Secret::new(read.lines().next().unwrap_or("")));
            }
            Ok(text.as_deref().and_then(Secret::new))
        };
        Ok(Self {
            access: Access {
                reader_token: token(&c.reader_token, &c.reader_token_file, "reader_token_file")?,
                operator_token: token(
                    &c.operator_token,
                    &c.operator_token_file,
                    "operator_token_file",
                )?,
                user_header: c
                    .trusted_user_header
                    .as_ref()
                    .map(|h| h.to_ascii_lowercase()),
                operators: c.operators.clone(),
                allowed_origins: c.allowed_origins.clone(),
            },
            trace_url: c.trace_url.clone(),
            ordering,
            owner: String::new(),
            rewind: None,
        })
    }
}

/// What the console reads and acts on: one pipeline's parts.
pub(crate) struct Inner {
    pub(crate) health: Arc<Health>,
    pub(crate) ledger: Ledger,
    pub(crate) settler: Arc<Settler>,
    pub(crate) breaker: Option<Arc<crate::breaker::Shared>>,
    pub(crate) rate_limit: Option<Arc<crate::ratelimit::limiter::Limiter>>,
    pub(crate) settings: Settings,
    pub(crate) csrf: auth::CsrfKey,
    pub(crate) audit: audit::Audit,
    pub(crate) jobs: act::Jobs,
    pub(crate) dead_cache: read::DeadCache,
}

/// The console's shared state.
#[derive(Clone)]
pub struct Console(pub(crate) Arc<Inner>);

impl Console {
    /// The console of `pipeline`.
    pub fn new(pipeline: &Pipeline, settings: Settings) -> Self {
        let mut console = Self::from_parts(pipeline.health(), pipeline.settler(), settings);
        if let Some(inner) = Arc::get_mut(&mut console.0) {
            inner.breaker = pipeline.breaker();
            inner.rate_limit = pipeline.rate_limiter();
        }
        console
    }

    /// A console over a pipeline's read side and its settler, without the pipeline (no
    /// breaker or rate limit shown): what the command line's operator tools hold, and what a
    /// measurement of the console over a large ledger needs.
    pub fn from_parts(health: Arc<Health>, settler: Arc<Settler>, settings: Settings) -> Self {
        // The retries page answers from the pending index as last listed (the overdue
        // sweep's listings, and this replica's changes as it makes them).
        settler.ledger.keep_pending_listing();
        let audit = audit::Audit::new(
            settler.ledger.store().clone(),
            settler.ledger.audit_record_name(),
        );
        Self(Arc::new(Inner {
            health,
            ledger: settler.ledger.clone(),
            settler,
            breaker: None,
            rate_limit: None,
            settings,
            csrf: auth::CsrfKey::random(),
            audit,
            jobs: Default::default(),
            dead_cache: Default::default(),
        }))
    }

    /// The console's routes: `/` (a redirect), `/console/` (the page and its assets) and
    /// `/console/api/…`; merge them into the status router.
    pub fn router(self) -> Router {
        Router::new()
            .route("/", get(|| async { Redirect::to("/console/") }))
            .route("/console", get(|| async { Redirect::to("/console/") }))
            .route("/console/", get(page))
            .route("/console/app.js", get(script))
            .route("/console/app.css", get(style))
            .route("/console/api/session", get(read::session))
            .route("/console/api/lookup", get(read::lookup))
            .route("/console/api/retries", get(read::retries))
            .route("/console/api/dead-letters", get(read::dead_letters))
            .route("/console/api/overview", get(read::overview))
            .route("/console/api/audit", get(audit::audit))
            .route("/console/api/act/{action}", post(act::act))
            .route("/console/api/jobs/{id}", get(act::job))
            .route("/console/api/jobs/{id}/stop", post(act::stop_job))
            .layer(axum::middleware::from_fn(secure_headers))
            .with_state(self)
    }
}

/// What no script from elsewhere, and no inline script or style, may do in the page.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Every console answer: the Content-Security-Policy, no sniffing, no framing, no
/// referrer (a trace link does not carry the page's address), not cached.
async fn secure_headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    let set = |h: &mut axum::http::HeaderMap, k: &'static str, v: &'static str| {
        h.insert(k, HeaderValue::from_static(v));
    };
    set(h, "content-security-policy", CONTENT_SECURITY_POLICY);
    set(h, "x-content-type-options", "nosniff");
    set(h, "x-frame-options", "DENY");
    set(h, "referrer-policy", "no-referrer");
    set(h, "cache-control", "no-store");
    res
}

async fn page() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("assets/index.html"),
    )
        .into_response()
}

async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("assets/app.js"),
    )
        .into_response()
}

async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("assets/app.css"),
    )
        .into_response()
}
