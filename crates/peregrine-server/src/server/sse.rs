//! Response bodies: whole JSON, or server-sent events fed through a channel.
//!
//! A streaming body is the receiving end of a channel. When the client goes away hyper drops
//! the body, the channel closes, and the task producing events sees it and drops the engine's
//! `EventStream`, which cancels generation.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Body as HttpBody, Frame};
use serde_json::Value;
use tokio::sync::mpsc;

/// Every response's body type.
pub type Body = BoxBody<Bytes, Infallible>;

/// Chunks buffered between the generating task and the socket.
const CHANNEL_DEPTH: usize = 64;

/// A body holding `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed()
}

/// A streaming body and the sender that feeds it. A client that reads nothing for `stall`
/// while the buffer is full counts as gone.
pub fn channel(stall: Duration) -> (SseSender, Body) {
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    (SseSender { tx, stall }, ChannelBody(rx).boxed())
}

/// Writes server-sent events into a streaming body.
#[derive(Debug, Clone)]
pub struct SseSender {
    tx: mpsc::Sender<Bytes>,
    stall: Duration,
}

/// The client has gone away.
#[derive(Debug, Clone, Copy)]
pub struct Closed;

impl SseSender {
    /// Sends `data: {json}`.
    pub async fn data(&self, value: &Value) -> Result<(), Closed> {
        self.raw(format!("data: {value}\n\n")).await
    }

    /// Sends `event: {name}` with `data: {json}` (Anthropic's named events).
    pub async fn event(&self, name: &str, value: &Value) -> Result<(), Closed> {
        self.raw(format!("event: {name}\ndata: {value}\n\n")).await
    }

    /// Sends `data: [DONE]`.
    pub async fn done(&self) -> Result<(), Closed> {
        self.raw("data: [DONE]\n\n".into()).await
    }

    /// Sends an SSE comment, which clients ignore (keep-alive).
    pub async fn comment(&self, text: &str) -> Result<(), Closed> {
        self.raw(format!(": {text}\n\n")).await
    }

    async fn raw(&self, text: String) -> Result<(), Closed> {
        let sent = self.tx.send_timeout(Bytes::from(text), self.stall).await;
        sent.map_err(|_| Closed)
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

struct ChannelBody(mpsc::Receiver<Bytes>);

impl HttpBody for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}
