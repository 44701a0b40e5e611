//! Decoding OpenAI request bodies into engine requests.
//!
//! Decoding walks the JSON by hand rather than through `#[derive(Deserialize)]` so that each
//! rejection names the exact field (`messages[2].role`, `stop[1]`) in `error.param`, as OpenAI
//! does. Unknown fields are ignored; `null` counts as absent; known fields with a wrong type or
//! out of range are errors.

use peregrine_engine::{Grammar, KvRequest, Prompt, Request, SamplingParams};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::media::{Images, RemoteMedia};
use super::prompt::{chat_prompt, completion_prompts};
use super::tools::{self, Tools};

/// Which endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/messages` (Anthropic), translated into a chat request.
    Messages,
    /// `/v1/responses` (OpenAI Responses), translated into a chat request.
    Responses,
}

/// Most choices one request may ask for (`n`).
pub const MAX_N: u64 = 16;
/// Most alternatives per token (`top_logprobs`, completions' `logprobs`).
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// Most stop sequences.
pub const MAX_STOP: usize = 16;
/// Longest stop sequence in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most chat messages.
pub const MAX_MESSAGES: usize = 4096;
/// Most content parts in one message.
pub const MAX_CONTENT_PARTS: usize = 1024;
/// Most `tools`.
pub const MAX_TOOLS: usize = 256;
/// Most entries of `logit_bias`.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Largest temperature: the engine's cap (OpenAI's is 2; larger values work, as in vLLM).
pub const MAX_TEMPERATURE: f64 = 100.0;
/// Roles a chat message may have.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A decoded request: one engine request per prompt, and how to answer.
#[derive(Debug, Clone)]
pub struct Decoded {
    /// The `model` field (required, as in OpenAI's spec).
    pub model: String,
    /// One request per prompt (completions take a list); each runs `n` times.
    pub requests: Vec<Request>,
    /// Prepend the prompt to the text (completions' `echo`).
    pub echo: bool,
    /// Choices per prompt.
    pub n: usize,
    /// Answer with server-sent events.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// Whether logprobs were asked for (the response then carries them).
    pub logprobs: bool,
    /// The grammar the output must match, and the field that asked for it.
    pub grammar: Option<(Grammar, &'static str)>,
    /// The tools the model is shown (chat).
    pub tools: Option<Tools>,
    /// The content parts that held the requests' images (`messages[0].content[1]`).
    pub image_parts: Vec<String>,
    /// Each audio part, in order (`messages[0].content[1]`), for errors.
    pub audio_parts: Vec<String>,
}

/// Parses and validates a body. `default_max_tokens` and `defaults` apply to fields the body
/// leaves out; `remote` fetches `http(s)` image URLs (refused without it).
pub fn decode(
    body: &[u8],
    endpoint: Endpoint,
    default_max_tokens: usize,
    defaults: &SamplingParams,
    remote: Option<&RemoteMedia>,
) -> Result<Decoded, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    let f = Fields(&obj);
    let model = match f.string("model")? {
        Some(m) => m.to_string(),
        None => return Err(ApiError::invalid("model", "`model` is required")),
    };
    f.string("user")?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o)
            .bool("include_usage")
            .map_err(|e| ApiError::invalid("stream_options.include_usage", e.message))?
            .unwrap_or(false),
        Some(_) => return Err(type_error("stream_options", "an object")),
    };
    let max_tokens = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            f.uint("max_completion_tokens", 1, u32::MAX as u64)?
        }
        Endpoint::Completions => None,
    };
    let max_tokens = match max_tokens {
        Some(m) => Some(m),
        None => f.uint("max_tokens", 1, u32::MAX as u64)?,
    };
    let n = f.uint("n", 1, MAX_N)?.unwrap_or(1) as usize;
    let sampling = sampling(&f, defaults)?;
    let stop = stop(&f)?;
    let tools = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => tools::decode(&f)?,
        Endpoint::Completions => None,
    };
    limit_count(&f, "logit_bias", MAX_LOGIT_BIAS)?;
    let (logprobs, top) = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            let top = f.uint("top_logprobs", 0, MAX_TOP_LOGPROBS)?;
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` requires `logprobs` to be true",
                ));
            }
            (on, top.unwrap_or(0))
        }
        Endpoint::Completions => {
            let top = f.uint("logprobs", 0, MAX_TOP_LOGPROBS)?;
            (top.is_some(), top.unwrap_or(0))
        }
    };
    let grammar = output_grammar(&f)?;
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let kv = kv_request(&f)?;
    // Experts per token (a quality trade): the engine checks it against the model.
    let moe_top_k = f.uint("moe_top_k", 1, 1024)?.map(|k| k as usize);
    // Speculative decoding, where the server drafts: on unless the request says otherwise.
    let speculative = f.bool("speculative")?.unwrap_or(true);
    let template = Prompt::Tokens(vec![]);
    let mut images = Images::default();
    let base = Request {
        sampling,
        stop,
        max_tokens: Some(max_tokens.map_or(default_max_tokens, |m| m as usize)),
        logprobs: logprobs.then_some(top as usize),
        ignore_eos,
        kv,
        moe_top_k,
        speculative,
        ..Request::new(template)
    };
    let (prompts, echo) = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            let (prompt, found) = chat_prompt(&f, remote)?;
            images = found;
            (vec![prompt], false)
        }
        Endpoint::Completions => {
            if let Some(suffix) = f.string("suffix")?
                && !suffix.is_empty()
            {
                return Err(ApiError::invalid(
                    "suffix",
                    "`suffix` (fill-in-the-middle) is not supported by this model",
                ));
            }
            let prompts = completion_prompts(&f)?;
            (prompts, f.bool("echo")?.unwrap_or(false))
        }
    };
    let requests = prompts
        .into_iter()
        .map(|prompt| Request {
            prompt,
            images: images.images.clone(),
            audio: images.audio.clone(),
            ..base.clone()
        })
        .collect();
    Ok(Decoded {
        image_parts: images.parts,
        audio_parts: images.audio_parts,
        model,
        requests,
        echo,
        n,
        stream,
        include_usage,
        logprobs,
        grammar,
        tools,
    })
}

/// The KV storage fields: `kv_bits` (4 or 8), `kv_group_size` (32, 64 or 128), `turbo_kv`.
fn kv_request(f: &Fields) -> Result<KvRequest, ApiError> {
    let kv_bits = f.uint("kv_bits", 4, 8)?;
    if let Some(bits) = kv_bits
        && bits != 4
        && bits != 8
    {
        return Err(ApiError::invalid("kv_bits", "`kv_bits` must be 4 or 8"));
    }
    let kv_group_size = f.uint("kv_group_size", 32, 128)?;
    if let Some(g) = kv_group_size
        && ![32, 64, 128].contains(&g)
    {
        let message = "`kv_group_size` must be 32, 64 or 128";
        return Err(ApiError::invalid("kv_group_size", message));
    }
    let turbo_kv = f.bool("turbo_kv")?;
    if kv_bits.is_some() && turbo_kv == Some(true) {
        let message = "`turbo_kv` and `kv_bits` choose different KV storage: give one";
        return Err(ApiError::invalid("turbo_kv", message));
    }
    Ok(KvRequest {
        kv_bits: kv_bits.map(|b| b as u8),
        kv_group_size: kv_group_size.map(|g| g as usize),
        turbo_kv,
    })
}

pub(super) fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(param, format!("`{param}` must be {expected}"))
}

/// Typed access to an object's fields; `null` reads as absent.
pub(super) struct Fields<'a>(pub(super) &'a Map<String, Value>);

impl<'a> Fields<'a> {
    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn string(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(type_error(key, "a string")),
        }
    }

    pub(super) fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(type_error(key, "a boolean")),
        }
    }

    /// An array of at most `max` entries; `expected` names its type for the error.
    pub(super) fn array(
        &self,
        key: &str,
        max: usize,
        expected: &str,
    ) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) if items.len() > max => {
                let message = format!("`{key}` holds at most {max} entries");
                Err(ApiError::invalid(key, message))
            }
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(_) => Err(type_error(key, expected)),
        }
    }

    /// A number in `[lo, hi]` (`open_lo` excludes `lo`).
    pub(super) fn number(
        &self,
        key: &str,
        lo: f64,
        hi: f64,
        open_lo: bool,
    ) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| type_error(key, "a number"))?;
        let above = if open_lo { x > lo } else { x >= lo };
        if !(above && x <= hi) {
            let open = if open_lo { '(' } else { '[' };
            return Err(ApiError::invalid(
                key,
                format!("`{key}` = {x} is out of range: must be in {open}{lo}, {hi}]"),
            ));
        }
        Ok(Some(x as f32))
    }

    /// An integer in `[lo, hi]`.
    pub(super) fn uint(&self, key: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        if !(v.is_i64() || v.is_u64()) {
            return Err(type_error(key, "an integer"));
        }
        match v.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::invalid(
                key,
                format!("`{key}` = {v} is out of range: must be in [{lo}, {hi}]"),
            )),
        }
    }
}

fn sampling(f: &Fields, d: &SamplingParams) -> Result<SamplingParams, ApiError> {
    let top_k = match f.get("top_k") {
        // -1 means "off" in vLLM and llama.cpp.
        Some(v) if v.as_i64() == Some(-1) => 0,
        _ => f
            .uint("top_k", 0, u32::MAX as u64)?
            .map_or(d.top_k, |k| k as usize),
    };
    let seed = match f.get("seed") {
        None => None,
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(s), _) => Some(s),
            (None, Some(s)) => Some(s as u64),
            _ => return Err(type_error("seed", "an integer")),
        },
    };
    Ok(SamplingParams {
        temperature: f
            .number("temperature", 0.0, MAX_TEMPERATURE, false)?
            .unwrap_or(d.temperature),
        top_k,
        top_p: f.number("top_p", 0.0, 1.0, true)?.unwrap_or(d.top_p),
        min_p: f.number("min_p", 0.0, 1.0, false)?.unwrap_or(d.min_p),
        repetition_penalty: f
            .number("repetition_penalty", 0.0, 100.0, true)?
            .unwrap_or(d.repetition_penalty),
        frequency_penalty: f
            .number("frequency_penalty", -2.0, 2.0, false)?
            .unwrap_or(d.frequency_penalty),
        presence_penalty: f
            .number("presence_penalty", -2.0, 2.0, false)?
            .unwrap_or(d.presence_penalty),
        seed,
    })
}

fn stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let list = match f.get("stop") {
        None => return Ok(vec![]),
        Some(Value::String(s)) => vec![(s.clone(), "stop".to_string())],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!("`stop` holds at most {MAX_STOP} sequences"),
                ));
            }
            let mut out = vec![];
            for (i, item) in items.iter().enumerate() {
                let param = format!("stop[{i}]");
                let s = item
                    .as_str()
                    .ok_or_else(|| type_error(&param, "a string"))?;
                out.push((s.to_string(), param));
            }
            out
        }
        Some(_) => return Err(type_error("stop", "a string or an array of strings")),
    };
    list.into_iter()
        .map(|(s, param)| match s.len() {
            0 => Err(ApiError::invalid(param, "stop sequences must not be empty")),
            n if n > MAX_STOP_BYTES => Err(ApiError::invalid(
                param,
                format!("a stop sequence holds at most {MAX_STOP_BYTES} bytes (this one {n})"),
            )),
            _ => Ok(s),
        })
        .collect()
}

/// Rejects an array or object field with more than `max` entries.
fn limit_count(f: &Fields, key: &str, max: usize) -> Result<(), ApiError> {
    let n = match f.get(key) {
        Some(Value::Array(a)) => a.len(),
        Some(Value::Object(o)) => o.len(),
        _ => return Ok(()),
    };
    if n > max {
        return Err(ApiError::invalid(
            key,
            format!("`{key}` holds at most {max} entries (this one {n})"),
        ));
    }
    Ok(())
}

/// `response_format` (`text`, `json_object`, `json_schema`) and the `grammar` extension (Lark,
/// as llguidance takes it) as the grammar the output must match, with the field it came from.
fn output_grammar(f: &Fields) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    if let Some(lark) = f.string("grammar")? {
        if f.get("response_format")
            .is_some_and(|v| v.get("type") != Some(&json!("text")))
        {
            let message =
                "`grammar` and a JSON `response_format` both constrain the output: give one";
            return Err(ApiError::invalid("grammar", message));
        }
        return Ok(Some((Grammar::Lark(lark.to_string()), "grammar")));
    }
    let Some(v) = f.get("response_format") else {
        return Ok(None);
    };
    let Value::Object(format) = v else {
        return Err(type_error("response_format", "an object"));
    };
    let format = Fields(format);
    let param = "response_format";
    match format.string("type").map_err(|e| e.within(param))? {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((Grammar::JsonObject, param))),
        Some("json_schema") => {
            let spec = match format.get("json_schema") {
                Some(Value::Object(spec)) => Fields(spec),
                Some(_) => return Err(type_error("response_format.json_schema", "an object")),
                None => {
                    let message =
                        "`response_format.json_schema` is required for type `json_schema`";
                    return Err(ApiError::invalid("response_format.json_schema", message));
                }
            };
            let named = |e: ApiError| e.within("response_format.json_schema");
            if spec.string("name").map_err(named)?.is_none() {
                let message = "`response_format.json_schema.name` is required";
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    message,
                ));
            }
            spec.bool("strict").map_err(named)?;
            match spec.get("schema") {
                None => Ok(Some((Grammar::JsonObject, param))),
                Some(schema @ Value::Object(_)) => {
                    Ok(Some((Grammar::JsonSchema(schema.clone()), param)))
                }
                Some(_) => Err(type_error(
                    "response_format.json_schema.schema",
                    "an object",
                )),
            }
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be `text`, `json_object` or `json_schema`",
        )),
    }
}
