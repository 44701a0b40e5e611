//! OpenAI response and stream-chunk JSON for chat completions and completions.

use peregrine_engine::{FinishReason, TokenLogprob, Tokenizer, Usage};
use serde_json::{Value, json};

use super::openai::Endpoint;
use super::tool_calls::ToolCall;

/// What every object of one response shares: one `id` and `created` for a whole stream.
#[derive(Debug, Clone)]
pub struct Envelope {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// Chat or completions.
    pub endpoint: Endpoint,
}

/// One finished choice of a non-streaming answer.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    /// The generated text (with the prompt first for `echo`).
    pub text: String,
    /// Per-token log-probabilities, when asked.
    pub logprobs: Vec<TokenLogprob>,
    /// Why it ended.
    pub finish: Option<FinishReason>,
    /// The think block's text, for reasoning models.
    pub reasoning: Option<String>,
    /// The tool calls found in the output (the text is what is left).
    pub tool_calls: Vec<ToolCall>,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
}

/// OpenAI's name for a finish reason; `called`: the output held tool calls.
pub fn finish_name(finish: FinishReason, called: bool) -> &'static str {
    match finish {
        FinishReason::Length => "length",
        FinishReason::Stop if called => "tool_calls",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// A call in chat's `tool_calls` shape.
fn call_json(id: &str, call: &ToolCall) -> Value {
    json!({"id": id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}})
}

/// The `usage` object.
pub fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    })
}

impl Envelope {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat | Endpoint::Messages | Endpoint::Responses, false) => "chat.completion",
            (Endpoint::Chat | Endpoint::Messages | Endpoint::Responses, true) => {
                "chat.completion.chunk"
            }
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    /// The fields every object shares. `system_fingerprint` is left out: OpenAI's schema makes
    /// it an optional string, not nullable, and there is no backend fingerprint to give.
    fn wrap(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// A whole non-streaming response.
    pub fn response(
        &self,
        choices: &[Choice],
        usage: Usage,
        tok: &Tokenizer,
        logprobs: bool,
    ) -> Value {
        let choices = choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let finish = c.finish.map(|f| finish_name(f, !c.tool_calls.is_empty()));
                let lp = logprobs.then(|| self.logprobs(&c.logprobs, tok));
                match self.endpoint {
                    Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                        let mut message =
                            json!({"role": "assistant", "content": c.text, "refusal": null, "annotations": []});
                        if let Some(r) = &c.reasoning {
                            message["reasoning_content"] = json!(r);
                        }
                        if !c.tool_calls.is_empty() {
                            let calls = (c.tool_calls.iter().enumerate())
                                .map(|(k, call)| call_json(&self.call_id(index, k), call));
                            message["tool_calls"] = Value::Array(calls.collect());
                            if c.text.is_empty() {
                                message["content"] = Value::Null;
                            }
                        }
                        json!({
                            "index": index, "message": message, "logprobs": lp, "finish_reason": finish,
                        })
                    }
                    Endpoint::Completions => json!({
                        "index": index, "text": c.text, "logprobs": lp, "finish_reason": finish,
                    }),
                }
            })
            .collect();
        let mut body = self.wrap(false, choices);
        body["usage"] = usage_json(usage);
        body
    }

    /// A stream chunk for one choice: `text` (or the role, for chat's first chunk), optional
    /// logprobs, and the finish reason on the last. It carries no `usage` field: OpenAI's
    /// schema types the chunk's `usage` as a non-nullable object, so only the final usage chunk
    /// (`usage_chunk`) has one (clients read the absent field as null).
    pub fn chunk(
        &self,
        index: usize,
        delta: Delta<'_>,
        logprobs: Option<(&[TokenLogprob], &Tokenizer)>,
    ) -> Value {
        let lp = logprobs.map(|(lp, tok)| self.logprobs(lp, tok));
        let (finish, text) = match delta {
            Delta::Role => (None, None),
            Delta::Text(t) => (None, Some(t)),
            Delta::Reasoning(_) | Delta::ToolCall(..) => (None, None),
            Delta::Finish(f, called) => (Some(finish_name(f, called)), None),
        };
        let choice = match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                let delta = match delta {
                    Delta::Role => json!({"role": "assistant", "content": ""}),
                    Delta::Text(t) => json!({"content": t}),
                    Delta::Reasoning(r) => json!({"reasoning_content": r}),
                    Delta::ToolCall(k, call) => {
                        let mut c = call_json(&self.call_id(index, k), call);
                        c["index"] = json!(k);
                        json!({"tool_calls": [c]})
                    }
                    Delta::Finish(..) => json!({}),
                };
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            Endpoint::Completions => json!({
                "index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish,
            }),
        };
        self.wrap(true, vec![choice])
    }

    /// The id of choice `index`'s call `k`: unique per request, choice and call.
    fn call_id(&self, index: usize, k: usize) -> String {
        let request = self.id.rsplit('-').next().unwrap_or_default();
        format!("call_{request}{index:02x}{k:02x}")
    }

    /// The final usage chunk (`choices: []`), for `stream_options.include_usage`.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut body = self.wrap(true, vec![]);
        body["usage"] = usage_json(usage);
        body
    }

    /// The logprobs object in the endpoint's shape.
    fn logprobs(&self, lps: &[TokenLogprob], tok: &Tokenizer) -> Value {
        let text = |id: u32| tok.decode(&[id], false).unwrap_or_default();
        // JSON has no -inf (serde_json would write null, which the schema rejects): OpenAI
        // uses -9999.0 for "very unlikely".
        let finite = |lp: f32| if lp.is_finite() { lp } else { -9999.0 };
        match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                let entry = |id: u32, lp: f32| {
                    let t = text(id);
                    json!({"token": t, "logprob": finite(lp), "bytes": t.as_bytes()})
                };
                let content: Vec<Value> = lps
                    .iter()
                    .map(|l| {
                        let mut e = entry(l.id, l.logprob);
                        let top: Vec<Value> = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                        e["top_logprobs"] = Value::Array(top);
                        e
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completions => {
                let mut offset = 0;
                let (mut tokens, mut token_lps, mut tops, mut offsets) =
                    (vec![], vec![], vec![], vec![]);
                for l in lps {
                    let t = text(l.id);
                    offsets.push(offset);
                    offset += t.len();
                    tokens.push(t);
                    token_lps.push(finite(l.logprob));
                    let top: serde_json::Map<String, Value> = l
                        .top
                        .iter()
                        .map(|&(id, lp)| (text(id), json!(finite(lp))))
                        .collect();
                    tops.push(top);
                }
                json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                       "text_offset": offsets})
            }
        }
    }
}

/// What a stream chunk carries.
#[derive(Debug, Clone, Copy)]
pub enum Delta<'a> {
    /// The assistant role (chat's first chunk per choice).
    Role,
    /// New text.
    Text(&'a str),
    /// New text of the think block (chat, reasoning models).
    Reasoning(&'a str),
    /// The choice's call number `.0`, whole.
    ToolCall(usize, &'a ToolCall),
    /// The end, with its reason and whether the choice made calls.
    Finish(FinishReason, bool),
}
