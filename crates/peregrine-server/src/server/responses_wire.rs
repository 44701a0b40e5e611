//! OpenAI Responses, response side: the `response` object with its output items (`reasoning`,
//! `message`, `function_call`), and the streamed events in the spec's order, each with its
//! `sequence_number`. Both read the output through the shared [`Reader`].

use std::time::{SystemTime, UNIX_EPOCH};

use peregrine_engine::{Event, FinishReason, Usage};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::complete::{Job, Next, Totals, shutting_down, unfinished};
use super::error::ApiError;
use super::responses::Stored;
use super::semantic::{Part, Reader};
use super::sse::{Closed, SseSender};

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage_json(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens_details": {"reasoning_tokens": 0},
    })
}

/// An output item in progress: its kind and text so far.
#[derive(Debug, Clone)]
enum Item {
    Reasoning(String),
    Message(String),
    Call { name: String, arguments: String },
}

impl Item {
    /// The item object; `done`: finished (else in progress, content still empty).
    fn json(&self, id: &str, call_id: &str, done: bool) -> Value {
        let status = if done { "completed" } else { "in_progress" };
        match self {
            Self::Reasoning(text) => {
                let content = match done {
                    true => json!([{"type": "reasoning_text", "text": text}]),
                    false => json!([]),
                };
                json!({"type": "reasoning", "id": id, "summary": [], "content": content})
            }
            Self::Message(text) => {
                let content = match done {
                    true => json!([Self::text_part(text)]),
                    false => json!([]),
                };
                json!({"type": "message", "id": id, "status": status, "role": "assistant",
                       "content": content})
            }
            Self::Call { name, arguments } => {
                let arguments = if done { arguments.as_str() } else { "" };
                json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
                       "arguments": arguments, "status": status})
            }
        }
    }

    fn text_part(text: &str) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    }
}

/// The parts of an output grouped into items (consecutive reasoning or text join one item).
fn items(parts: Vec<Part>) -> Vec<Item> {
    let mut out: Vec<Item> = vec![];
    for part in parts {
        match (part, out.last_mut()) {
            (Part::Reasoning(r), Some(Item::Reasoning(text))) => text.push_str(&r),
            (Part::Text(t), Some(Item::Message(text))) => text.push_str(&t),
            (Part::Reasoning(r), _) => out.push(Item::Reasoning(r)),
            (Part::Text(t), _) => out.push(Item::Message(t)),
            (Part::Call(c), _) => out.push(Item::Call {
                name: c.name,
                arguments: c.arguments,
            }),
        }
    }
    out
}

impl Job {
    /// The ids of output item `k`: the item's and, for a call, the call's.
    fn item_ids(&self, k: usize, item: &Item) -> (String, String) {
        let request = self.env.id.rsplit('_').next().unwrap_or_default();
        let prefix = match item {
            Item::Reasoning(_) => "rs",
            Item::Message(_) => "msg",
            Item::Call { .. } => "fc",
        };
        (
            format!("{prefix}_{request}{k:02x}"),
            format!("call_{request}{k:02x}"),
        )
    }

    /// The `response` object; `output` and `usage` as far as they are known.
    fn resource(&self, output: Vec<Value>, done: Option<(FinishReason, Usage)>) -> Value {
        let sampling = &self.decoded.requests[0].sampling;
        let (status, incomplete, completed_at) = match done {
            None => ("in_progress", Value::Null, Value::Null),
            Some((FinishReason::Length, _)) => (
                "incomplete",
                json!({"reason": "max_output_tokens"}),
                json!(now()),
            ),
            Some(_) => ("completed", Value::Null, json!(now())),
        };
        let tools = self.decoded.tools.as_ref();
        let mut resource = json!({
            "id": self.env.id, "object": "response", "created_at": self.env.created,
            "completed_at": completed_at, "status": status, "incomplete_details": incomplete,
            "model": self.env.model, "previous_response_id": null, "instructions": null,
            "output": output, "error": null, "tools": [], "tool_choice": "auto",
            "truncation": "disabled", "parallel_tool_calls": tools.is_none_or(|t| t.parallel),
            "text": {"format": {"type": "text"}}, "top_p": sampling.top_p,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty, "top_logprobs": 0,
            "temperature": sampling.temperature, "reasoning": {"effort": null, "summary": null},
            "usage": done.map(|(_, u)| usage_json(u)),
            "max_output_tokens": null, "max_tool_calls": null,
            "store": &self.responses.store, "background": false, "service_tier": "default",
            "metadata": {}, "safety_identifier": null, "prompt_cache_key": null,
        });
        for (k, v) in &self.responses.echo {
            resource[k] = v.clone();
        }
        resource
    }

    /// Keeps a finished response for `GET` and `previous_response_id`.
    fn keep(&self, resource: &Value, items: &[Item]) {
        let context = &self.responses;
        if !context.store {
            return;
        }
        let mut messages = context.messages.clone();
        let mut text = String::new();
        let mut calls = vec![];
        for (k, item) in items.iter().enumerate() {
            match item {
                Item::Reasoning(_) => {}
                Item::Message(t) => text.push_str(t),
                Item::Call { name, arguments } => {
                    let (_, call_id) = self.item_ids(k, item);
                    calls.push(json!({"id": call_id, "type": "function",
                                      "function": {"name": name, "arguments": arguments}}));
                }
            }
        }
        let mut answer = json!({"role": "assistant", "content": text});
        if !calls.is_empty() {
            answer["tool_calls"] = Value::Array(calls);
        }
        messages.push(answer);
        let stored = Stored {
            resource: resource.clone(),
            messages,
        };
        self.state.responses.put(self.env.id.clone(), stored);
    }

    /// The whole non-streaming answer for the output `text`.
    pub(super) fn response_object(
        &self,
        text: &str,
        finish: Option<FinishReason>,
        usage: Usage,
    ) -> Value {
        let items = items(Reader::new(self.think, self.calls).read_all(text));
        self.finished(&items, finish.unwrap_or(FinishReason::Stop), usage)
    }

    /// The finished response object for `items`, kept in the store when asked.
    fn finished(&self, items: &[Item], finish: FinishReason, usage: Usage) -> Value {
        let output = (items.iter().enumerate())
            .map(|(k, item)| {
                let (id, call_id) = self.item_ids(k, item);
                item.json(&id, &call_id, true)
            })
            .collect();
        let resource = self.resource(output, Some((finish, usage)));
        self.keep(&resource, items);
        resource
    }

    /// Streams the answer as the Responses event sequence.
    pub(super) async fn stream_responses(
        &self,
        events: &mut UnboundedReceiver<(usize, Event)>,
        sse: &SseSender,
        totals: &mut Totals,
    ) -> Result<(), Closed> {
        let out = &mut Emitter { sse, seq: 0 };
        let head = self.resource(vec![], None);
        out.send("response.created", json!({"response": head}))
            .await?;
        out.send("response.in_progress", json!({"response": head}))
            .await?;
        let mut reader = Reader::new(self.think, self.calls);
        let mut items: Vec<Item> = vec![];
        let mut stopping = std::pin::pin!(self.state.stopping());
        loop {
            let event = match self.next(events, sse, &mut stopping, totals).await? {
                Next::Event(_, event) => event,
                Next::Quiet => {
                    sse.comment("keep-alive").await?;
                    continue;
                }
                Next::Stopping => return out.error(&shutting_down()).await,
                Next::End => break,
            };
            match event {
                Event::Delta { text, .. } => {
                    for part in reader.push(&text) {
                        self.stream_part(out, &mut items, part).await?;
                    }
                }
                Event::Done { finish, usage, .. } => {
                    for part in reader.finish() {
                        self.stream_part(out, &mut items, part).await?;
                    }
                    if !items.is_empty() {
                        self.close_item(out, &items).await?;
                    }
                    let resource = self.finished(&items, finish, usage);
                    let kind = match finish {
                        FinishReason::Length => "response.incomplete",
                        _ => "response.completed",
                    };
                    return out.send(kind, json!({"response": resource})).await;
                }
                Event::Error(e) => return out.error(&self.failed(&e)).await,
            }
        }
        out.error(&self.failed(&unfinished())).await
    }

    /// Sends one part: a delta into the open item, or a new item (closing the open one).
    async fn stream_part(
        &self,
        out: &mut Emitter<'_>,
        items: &mut Vec<Item>,
        part: Part,
    ) -> Result<(), Closed> {
        let joins = matches!(
            (&part, items.last()),
            (Part::Reasoning(_), Some(Item::Reasoning(_)))
                | (Part::Text(_), Some(Item::Message(_)))
        );
        if !joins {
            if !items.is_empty() {
                self.close_item(out, items).await?;
            }
            let item = match &part {
                Part::Reasoning(_) => Item::Reasoning(String::new()),
                Part::Text(_) => Item::Message(String::new()),
                Part::Call(c) => Item::Call {
                    name: c.name.clone(),
                    arguments: String::new(),
                },
            };
            let k = items.len();
            let (id, call_id) = self.item_ids(k, &item);
            let added = json!({"output_index": k, "item": item.json(&id, &call_id, false)});
            out.send("response.output_item.added", added).await?;
            if let Item::Message(_) = item {
                let part = json!({"item_id": id, "output_index": k, "content_index": 0,
                                  "part": Item::text_part("")});
                out.send("response.content_part.added", part).await?;
            }
            items.push(item);
        }
        let k = items.len() - 1;
        let (id, _) = self.item_ids(k, &items[k]);
        let at = json!({"item_id": id, "output_index": k, "content_index": 0});
        match (part, &mut items[k]) {
            (Part::Reasoning(r), Item::Reasoning(text)) => {
                text.push_str(&r);
                out.send("response.reasoning.delta", with(at, json!({"delta": r})))
                    .await
            }
            (Part::Text(t), Item::Message(text)) => {
                text.push_str(&t);
                let delta = json!({"delta": t, "logprobs": []});
                out.send("response.output_text.delta", with(at, delta))
                    .await
            }
            (Part::Call(c), Item::Call { arguments, .. }) => {
                *arguments = c.arguments.clone();
                let delta = json!({"item_id": id, "output_index": k, "delta": c.arguments});
                out.send("response.function_call_arguments.delta", delta)
                    .await
            }
            _ => Ok(()),
        }
    }

    /// Sends the `…done` events of the last item.
    async fn close_item(&self, out: &mut Emitter<'_>, items: &[Item]) -> Result<(), Closed> {
        let k = items.len() - 1;
        let item = &items[k];
        let (id, call_id) = self.item_ids(k, item);
        let at = json!({"item_id": id, "output_index": k, "content_index": 0});
        match item {
            Item::Reasoning(text) => {
                let done = with(at, json!({"text": text}));
                out.send("response.reasoning.done", done).await?;
            }
            Item::Message(text) => {
                let done = with(at.clone(), json!({"text": text, "logprobs": []}));
                out.send("response.output_text.done", done).await?;
                let part = with(at, json!({"part": Item::text_part(text)}));
                out.send("response.content_part.done", part).await?;
            }
            Item::Call { arguments, .. } => {
                let done = json!({"item_id": id, "output_index": k, "arguments": arguments});
                out.send("response.function_call_arguments.done", done)
                    .await?;
            }
        }
        let done = json!({"output_index": k, "item": item.json(&id, &call_id, true)});
        out.send("response.output_item.done", done).await
    }
}

/// `a`'s fields with `b`'s added.
fn with(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

/// Sends typed events with increasing sequence numbers.
struct Emitter<'a> {
    sse: &'a SseSender,
    seq: u64,
}

impl Emitter<'_> {
    async fn send(&mut self, kind: &str, mut data: Value) -> Result<(), Closed> {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.sse.event(kind, &data).await
    }

    async fn error(&mut self, e: &ApiError) -> Result<(), Closed> {
        let error = json!({"type": e.kind, "code": e.code, "message": e.message, "param": e.param});
        self.send("error", json!({"error": error})).await
    }
}
