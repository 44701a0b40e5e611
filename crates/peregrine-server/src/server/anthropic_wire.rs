//! Anthropic Messages, response side: the whole `message` object, the streamed event sequence
//! (`message_start`, `content_block_start/delta/stop`, `message_delta`, `message_stop`, `ping`)
//! and errors in Anthropic's shape. Both read the output through the shared [`Reader`].

use hyper::StatusCode;
use peregrine_engine::{Event, FinishReason, Usage};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::complete::{Job, Next, Totals, shutting_down, unfinished};
use super::error::ApiError;
use super::semantic::{Part, Reader};
use super::sse::{Closed, SseSender};
use super::wire::Choice;

/// Anthropic's `stop_reason` and `stop_sequence`; `called`: the output held tool calls.
fn stop_fields(finish: FinishReason, called: bool, stop_string: Option<&str>) -> (Value, Value) {
    let reason = match finish {
        FinishReason::Length => "max_tokens",
        FinishReason::Stop if called => "tool_use",
        FinishReason::Stop if stop_string.is_some() => "stop_sequence",
        FinishReason::Stop | FinishReason::Cancelled => "end_turn",
    };
    (json!(reason), json!(stop_string))
}

/// The `usage` object; prompt tokens read from the prompt cache count apart, as Anthropic's do.
fn usage_json(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens - usage.cached_tokens.min(usage.prompt_tokens),
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        // Fields of Anthropic's hosted service, present (as null) because its schema lists them.
        "cache_creation": null, "inference_geo": null, "output_tokens_details": null,
        "server_tool_use": null, "service_tier": null,
    })
}

/// An error body: `{"type": "error", "error": {"type": ..., "message": ...}}`, the field named
/// in the message.
pub fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    let message = match &e.param {
        Some(p) if !p.is_empty() && !e.message.contains(p.as_str()) => {
            format!("{p}: {}", e.message)
        }
        _ => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

impl Job {
    /// The id of the `k`th tool call.
    fn tool_use_id(&self, k: usize) -> String {
        let request = self.env.id.rsplit('_').next().unwrap_or_default();
        format!("toolu_{request}{k:02x}")
    }

    /// A whole content block for `part`; `k` counts the calls before it.
    fn block(&self, part: &Part, k: usize) -> Value {
        match part {
            Part::Reasoning(r) => json!({"type": "thinking", "thinking": r, "signature": ""}),
            Part::Text(t) => json!({"type": "text", "text": t, "citations": null}),
            Part::Call(c) => {
                let input = serde_json::from_str::<Value>(&c.arguments).unwrap_or(json!({}));
                json!({"type": "tool_use", "id": self.tool_use_id(k), "name": c.name, "input": input,
                       "caller": {"type": "direct"}})
            }
        }
    }

    /// The `message` object without content, stop reason or usage.
    fn message_head(&self) -> Value {
        json!({"id": self.env.id, "type": "message", "role": "assistant", "model": self.env.model,
               "content": [], "stop_reason": null, "stop_sequence": null, "stop_details": null,
               "container": null})
    }

    /// The whole non-streaming answer for one finished choice.
    pub(super) fn message(&self, choice: &Choice, usage: Usage) -> Value {
        let parts = Reader::new(self.think, self.calls).read_all(&choice.text);
        let mut calls = 0;
        let mut content = vec![];
        for part in &parts {
            content.push(self.block(part, calls));
            calls += usize::from(matches!(part, Part::Call(_)));
        }
        let finish = choice.finish.unwrap_or(FinishReason::Stop);
        let (reason, sequence) = stop_fields(finish, calls > 0, choice.stop_string.as_deref());
        let mut message = self.message_head();
        message["content"] = Value::Array(content);
        message["stop_reason"] = reason;
        message["stop_sequence"] = sequence;
        message["usage"] = usage_json(usage);
        message
    }

    /// Streams the answer as Anthropic's event sequence.
    pub(super) async fn stream_messages(
        &self,
        events: &mut UnboundedReceiver<(usize, Event)>,
        sse: &SseSender,
        totals: &mut Totals,
    ) -> Result<(), Closed> {
        let mut head = self.message_head();
        head["usage"] = json!({"input_tokens": self.prompt_tokens, "output_tokens": 0});
        let start = json!({"type": "message_start", "message": head});
        sse.event("message_start", &start).await?;
        sse.event("ping", &json!({"type": "ping"})).await?;
        let mut reader = Reader::new(self.think, self.calls);
        let mut blocks = Blocks::default();
        let mut stopping = std::pin::pin!(self.state.stopping());
        loop {
            let event = match self.next(events, sse, &mut stopping, totals).await? {
                Next::Event(_, event) => event,
                Next::Quiet => {
                    sse.event("ping", &json!({"type": "ping"})).await?;
                    continue;
                }
                Next::Stopping => return send_error(sse, &shutting_down()).await,
                Next::End => break,
            };
            match event {
                Event::Delta { text, .. } => {
                    for part in reader.push(&text) {
                        blocks.send(self, sse, part).await?;
                    }
                }
                Event::Done {
                    finish,
                    usage,
                    stop_string,
                    ..
                } => {
                    for part in reader.finish() {
                        blocks.send(self, sse, part).await?;
                    }
                    blocks.close(sse).await?;
                    let (reason, sequence) =
                        stop_fields(finish, blocks.calls > 0, stop_string.as_deref());
                    let delta = json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage_json(usage),
                    });
                    sse.event("message_delta", &delta).await?;
                    return sse
                        .event("message_stop", &json!({"type": "message_stop"}))
                        .await;
                }
                Event::Error(e) => return send_error(sse, &self.failed(&e)).await,
            }
        }
        send_error(sse, &self.failed(&unfinished())).await
    }
}

async fn send_error(sse: &SseSender, e: &ApiError) -> Result<(), Closed> {
    sse.event("error", &error_body(e)).await
}

/// The content blocks of a stream: which one is open, and how many came before.
#[derive(Default)]
struct Blocks {
    /// The open block's kind (`text` or `thinking`), if one is open.
    open: Option<&'static str>,
    /// The index the next or open block has.
    index: usize,
    /// Tool calls sent.
    calls: usize,
}

impl Blocks {
    async fn send(&mut self, job: &Job, sse: &SseSender, part: Part) -> Result<(), Closed> {
        let (kind, delta) = match &part {
            Part::Text(t) => ("text", json!({"type": "text_delta", "text": t})),
            Part::Reasoning(r) => ("thinking", json!({"type": "thinking_delta", "thinking": r})),
            Part::Call(c) => {
                self.close(sse).await?;
                let mut block = job.block(&part, self.calls);
                block["input"] = json!({});
                self.start(sse, block).await?;
                let delta = json!({"type": "input_json_delta", "partial_json": c.arguments});
                self.delta(sse, delta).await?;
                self.calls += 1;
                self.open = Some("tool_use");
                return self.close(sse).await;
            }
        };
        if self.open != Some(kind) {
            self.close(sse).await?;
            let block = match kind {
                "text" => json!({"type": "text", "text": "", "citations": null}),
                _ => json!({"type": "thinking", "thinking": "", "signature": ""}),
            };
            self.start(sse, block).await?;
            self.open = Some(kind);
        }
        self.delta(sse, delta).await
    }

    async fn start(&self, sse: &SseSender, block: Value) -> Result<(), Closed> {
        let start =
            json!({"type": "content_block_start", "index": self.index, "content_block": block});
        sse.event("content_block_start", &start).await
    }

    async fn delta(&self, sse: &SseSender, delta: Value) -> Result<(), Closed> {
        let delta = json!({"type": "content_block_delta", "index": self.index, "delta": delta});
        sse.event("content_block_delta", &delta).await
    }

    async fn close(&mut self, sse: &SseSender) -> Result<(), Closed> {
        if self.open.take().is_some() {
            let stop = json!({"type": "content_block_stop", "index": self.index});
            sse.event("content_block_stop", &stop).await?;
            self.index += 1;
        }
        Ok(())
    }
}
