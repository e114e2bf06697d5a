//! What the REST emulators share: a listener that honours connection faults (refuse, drop),
//! a middleware for response faults (delay, error status, held requests), and the serve loop.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::Faults;

/// A TCP stream that fails every read and write once its token is cancelled, so
/// [`Faults::drop_connections`] cuts keep-alive connections too.
pub struct Killable {
    inner: TcpStream,
    token: CancellationToken,
    killed: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl Killable {
    fn new(inner: TcpStream, token: CancellationToken) -> Self {
        Self {
            inner,
            killed: Box::pin(token.clone().cancelled_owned()),
            token,
        }
    }

    fn aborted() -> io::Error {
        io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "connection dropped by the emulator",
        )
    }
}

impl AsyncRead for Killable {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.killed.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(Self::aborted()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Killable {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.token.is_cancelled() {
            return Poll::Ready(Err(Self::aborted()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

use std::future::Future as _;

/// A listener that closes new connections while refusing and hands out killable streams.
pub struct FaultyListener {
    inner: TcpListener,
    faults: Arc<Faults>,
}

impl axum::serve::Listener for FaultyListener {
    type Io = Killable;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    if self.faults.refusing() {
                        drop(stream);
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    self.faults.count_accepted();
                    return (Killable::new(stream, self.faults.connection_token()), addr);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "emulator: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// Applies response faults: an injected error status answers at once (with the service's
/// error body shape left to the client), the service's latency and an injected delay
/// postpone the answer (once per request: HTTP has one round trip per request).
pub async fn fault_layer(
    State(faults): State<Arc<Faults>>,
    request: Request,
    next: Next,
) -> Response {
    let delay = faults.round_trip();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if faults.server_busy() {
        // A throttled namespace or account: 503 "server busy" with a hint of when to come
        // back. Service Bus: "Service Bus messaging exceptions" (ServerBusy) and "Throttling
        // operations on Azure Service Bus"; Blob storage: error code `ServerBusy` ("Blob
        // service error codes"). One body serves both: Service Bus clients read `<Detail>`,
        // storage clients `x-ms-error-code` and `<Code>`.
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            [
                ("x-ms-error-code", "ServerBusy"),
                ("retry-after", "1"),
                ("content-type", "application/xml; charset=utf-8"),
            ],
            "<Error><Code>ServerBusy</Code><Message>The server is busy.</Message>\
             <Detail>SubCode=50009. The server is busy: the request was terminated because \
             the namespace is being throttled. Please wait 1 second and try again.</Detail></Error>",
        )
            .into_response();
    }
    if let Some(status) = faults.error_status() {
        return injected(status);
    }
    let held = faults.held(request.method().as_str(), request.uri().path());
    if let Some(held) = held {
        if let Some(status) = held.wait().await {
            return injected(status);
        }
    }
    next.run(request).await
}

/// The answer of an injected error status.
fn injected(status: u16) -> Response {
    let status = axum::http::StatusCode::from_u16(status)
        .unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE);
    (
        status,
        [("x-ms-error-code", "InjectedFault")],
        "injected fault",
    )
        .into_response()
}

/// Most request headers a connection accepts. hyper's server refuses a request with more
/// than 100 headers with its own 431 (Request Header Fields Too Large), an answer no Azure
/// service documents: Service Bus over REST carries each custom property as a header and
/// allows up to 255 of them, blob storage takes up to 8 KB of `x-ms-meta-*` headers. Raised
/// above both (8 KB of metadata in entries of 8 bytes or more), so the emulators' own checks
/// give Azure's answer (see each emulator's table of what it refuses). Not higher: hyper
/// allocates and fills room for this many headers on every request it parses, and at 4,096
/// that was 256 KB per request, a measurable share of the emulators' CPU in the benchmarks.
pub const MAX_REQUEST_HEADERS: usize = 1024;

/// Most bytes of a request's head (start line and headers) a connection buffers: above
/// every header limit the emulators enforce themselves (64 KB on Service Bus), so those
/// limits, not the HTTP server's, decide.
pub const MAX_REQUEST_HEAD_BYTES: usize = 1024 * 1024;

/// Binds `listen` and serves `router` with fault injection until `shutdown` is cancelled.
/// HTTP/1.1 (what every Azure SDK's REST client speaks to these services), with the header
/// limits above instead of the HTTP server's defaults; on shutdown each connection finishes
/// its request in flight and the task ends once all have closed.
pub async fn serve(
    listen: SocketAddr,
    router: Router,
    faults: Arc<Faults>,
    shutdown: CancellationToken,
) -> io::Result<(SocketAddr, JoinHandle<()>)> {
    use axum::serve::Listener as _;

    let inner = TcpListener::bind(listen).await?;
    let addr = inner.local_addr()?;
    let router = router.layer(axum::middleware::from_fn_with_state(
        faults.clone(),
        fault_layer,
    ));
    let mut listener = FaultyListener { inner, faults };
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let io = tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                (io, _) = listener.accept() => io,
            };
            let service = hyper_util::service::TowerToHyperService::new(router.clone());
            let shutdown = shutdown.clone();
            connections.spawn(async move {
                let mut builder = hyper::server::conn::http1::Builder::new();
                builder
                    .max_headers(MAX_REQUEST_HEADERS)
                    .max_buf_size(MAX_REQUEST_HEAD_BYTES);
                let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
                tokio::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => {}
                    _ = shutdown.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            });
        }
        while connections.join_next().await.is_some() {}
    });
    Ok((addr, task))
}
