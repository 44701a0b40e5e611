//! Where a request's events go: each choice's sink on the scheduler's side, its
//! [`EventStream`] on the caller's; dropping the stream cancels the choice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::api::Event;

/// Where one choice's events go.
pub(crate) struct ChoiceSink {
    pub events: UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
}

impl ChoiceSink {
    /// Whether the caller dropped the choice's stream.
    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// The events of one request. Dropping it cancels the request within one decode step.
pub struct EventStream {
    pub(crate) events: UnboundedReceiver<Event>,
    pub(crate) cancel: Arc<AtomicBool>,
}

impl EventStream {
    /// The next event, waiting for it; `None` after the last. Do not call inside an async runtime.
    pub fn blocking_recv(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }

    /// The next event; `None` after the last.
    pub async fn recv(&mut self) -> Option<Event> {
        self.events.recv().await
    }
}

impl Iterator for EventStream {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.blocking_recv()
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}
