//! Connections: how many may be open, and how long one may sit idle or dribble its headers.
//!
//! hyper's own header timer starts when a connection waits for a request head, so it would also
//! cut idle keep-alive connections at the header limit. Here the two clocks are separate: an
//! [`Activity`] per connection, fed by the socket wrapper ([`Watched`]) and by the service, is
//! checked by a watchdog that drops the connection when
//! - a request head has been arriving for longer than the header timeout (slow-loris), or
//! - no request is running and nothing has arrived for the idle timeout.
//!
//! Dropping is safe then: no response is being written. Connections over `--max-connections`
//! get a 503 and are closed after their request is drained, so the client reads the answer.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

use super::{State, routes};

/// No time recorded (a millisecond count that never occurs).
const NONE: u64 = u64::MAX;

/// The per-connection limits (`--header-timeout`, `--idle-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest a request head may take from its first byte.
    pub header: Duration,
    /// Longest a connection may sit with no request running and nothing arriving.
    pub idle: Duration,
}

/// Why the watchdog dropped a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// A request head took longer than the header timeout.
    HeaderTimeout,
    /// Nothing ran or arrived for the idle timeout.
    Idle,
}

/// What a connection is doing, in milliseconds since it opened.
#[derive(Debug)]
pub struct Activity {
    opened: Instant,
    /// Requests being answered (their handler or response body is alive).
    busy: AtomicUsize,
    /// When the first byte of a request head arrived while idle, or [`NONE`].
    head_since: AtomicU64,
    /// When the connection last became idle.
    idle_since: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            opened: Instant::now(),
            busy: AtomicUsize::new(0),
            head_since: AtomicU64::new(NONE),
            idle_since: AtomicU64::new(0),
        })
    }

    fn now(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// Bytes arrived: if no request is running, a head has started.
    fn received(&self) {
        if self.busy.load(Ordering::Relaxed) == 0 {
            let now = self.now();
            let _ =
                (self.head_since).compare_exchange(NONE, now, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// A request's head is complete and its handler starts; the guard ends it.
    pub fn begin(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.head_since.store(NONE, Ordering::Relaxed);
        Busy(self.clone())
    }

    /// Why the connection should be dropped now, if it should, and otherwise how long until it
    /// might be.
    fn verdict(&self, limits: Limits) -> Result<Duration, Dropped> {
        if self.busy.load(Ordering::Relaxed) > 0 {
            return Ok(limits.header);
        }
        let now = self.now();
        let waited = |since: u64, limit: Duration| {
            limit.saturating_sub(Duration::from_millis(now.saturating_sub(since)))
        };
        let head = self.head_since.load(Ordering::Relaxed);
        let (left, why) = match head {
            NONE => (
                waited(self.idle_since.load(Ordering::Relaxed), limits.idle),
                Dropped::Idle,
            ),
            since => (waited(since, limits.header), Dropped::HeaderTimeout),
        };
        if left.is_zero() { Err(why) } else { Ok(left) }
    }

    /// Resolves when the connection should be dropped, with the reason.
    pub async fn watchdog(&self, limits: Limits) -> Dropped {
        // A head may start at any moment: wake often enough to cut it within a tenth of the
        // header timeout of its deadline.
        let tick = (limits.header / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        loop {
            match self.verdict(limits) {
                Err(why) => return why,
                Ok(left) => tokio::time::sleep(left.min(tick)).await,
            }
        }
    }
}

/// A running request of a connection; dropping it (the handler ended and its body was sent or
/// dropped) makes the connection idle again.
#[derive(Debug)]
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::Relaxed) == 1 {
            let now = self.0.now();
            self.0.idle_since.store(now, Ordering::Relaxed);
        }
    }
}

/// A socket that reports arriving bytes to its connection's [`Activity`].
pub struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl Watched {
    pub fn new(stream: TcpStream, activity: Arc<Activity>) -> Self {
        Self { stream, activity }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.received();
        }
        polled
    }
}

impl tokio::io::AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Serves `stream` over HTTP/1.1 on its own task until it closes, shutdown closes it, or the
/// watchdog drops it; `slot` (its place under `--max-connections`) is released at the end.
pub fn serve(
    state: &Arc<State>,
    stream: TcpStream,
    limits: Limits,
    slot: OwnedSemaphorePermit,
    graceful: &GracefulShutdown,
) {
    let activity = Activity::new();
    let io = TokioIo::new(Watched::new(stream, activity.clone()));
    let service = service_fn({
        let (state, activity) = (state.clone(), activity.clone());
        move |req| {
            let (busy, state) = (activity.begin(), state.clone());
            async move {
                let response = routes::handle(state, req).await?;
                Ok::<_, Infallible>(response.map(|body| hold(body, busy)))
            }
        }
    });
    // Our watchdog keeps the header and idle clocks, not hyper's.
    let connection = http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(io, service);
    let connection = graceful.watch(connection);
    let state = state.clone();
    tokio::spawn(async move {
        let metrics = &state.metrics;
        metrics.connections.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            _ = connection => {}
            why = activity.watchdog(limits) => {
                let counter = match why {
                    Dropped::HeaderTimeout => &metrics.header_timeouts,
                    Dropped::Idle => &metrics.idle_timeouts,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
        metrics.connections.fetch_sub(1, Ordering::Relaxed);
        drop(slot);
    });
}

/// Answers a connection over the limit with 503 and closes it. What the client sent is read
/// (up to 64 KiB, for at most a second) after the answer, so that closing does not reset the
/// connection before the client has read it.
pub async fn refuse(mut stream: TcpStream, limit: usize) {
    let body = serde_json::json!({"error": {
        "message": format!("the server has {limit} connections open (--max-connections); retry later"),
        "type": "server_error", "param": null, "code": "too_many_connections",
    }})
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < 64 << 10 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        io::Result::Ok(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
}

/// `body` holding `busy` until hyper has sent or dropped it.
fn hold(body: super::Body, busy: Busy) -> super::Body {
    use http_body_util::BodyExt;
    Held { body, _busy: busy }.boxed()
}

struct Held {
    body: super::Body,
    _busy: Busy,
}

impl hyper::body::Body for Held {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
