//! OpenAI Responses (`/v1/responses`), request side: a body is translated into the chat body it
//! means (items into messages, `instructions` into a system message, `previous_response_id`
//! into the stored conversation), and finished responses are kept in a capped in-memory store
//! for `GET`, `DELETE` and later turns.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use hyper::StatusCode;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::openai::{Fields, MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, type_error};

/// What a response needs from its request beyond the chat body.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// Request fields the response object repeats (`instructions`, `tools`, `temperature`, …).
    pub echo: Map<String, Value>,
    /// The conversation so far as chat messages, `instructions` left out (they do not carry
    /// over to a later turn).
    pub messages: Vec<Value>,
    /// Whether to keep the finished response.
    pub store: bool,
}

/// A stored response: its object and the conversation including its output.
#[derive(Debug, Clone)]
pub struct Stored {
    /// The response object, as `GET` returns it.
    pub resource: Value,
    /// The conversation as chat messages, for `previous_response_id`.
    pub messages: Vec<Value>,
}

/// Finished responses by id; the oldest go once `cap` are kept.
#[derive(Debug)]
pub struct Store {
    cap: usize,
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
}

impl Store {
    /// A store keeping at most `cap` responses.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            inner: Mutex::default(),
        }
    }

    /// Keeps `stored` under `id`, dropping the oldest past the cap.
    pub fn put(&self, id: String, stored: Stored) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, order) = &mut *inner;
        if map.insert(id.clone(), stored).is_none() {
            order.push_back(id);
        }
        while order.len() > self.cap {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    /// The response stored under `id`.
    pub fn get(&self, id: &str) -> Option<Stored> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.0.get(id).cloned()
    }

    /// Forgets `id`; whether it was there.
    pub fn delete(&self, id: &str) -> bool {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, order) = &mut *inner;
        order.retain(|o| o != id);
        map.remove(id).is_some()
    }
}

/// The 404 for a response id the store does not hold.
pub fn not_found(id: &str, param: &str) -> ApiError {
    ApiError::invalid(param, format!("no stored response has the id `{id}`"))
        .status(StatusCode::NOT_FOUND)
        .code("response_not_found")
}

/// The chat body a Responses body means, and what the answer needs besides.
pub fn translate(body: &[u8], store: &Store) -> Result<(Vec<u8>, Context), ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    let f = Fields(&obj);
    let mut out = Map::new();
    let mut echo = Map::new();
    match f.string("model")? {
        Some(m) => out.insert("model".into(), json!(m)),
        None => return Err(ApiError::invalid("model", "`model` is required")),
    };
    for key in ["temperature", "top_p", "stream", "parallel_tool_calls"] {
        if let Some(v) = f.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    if let Some(v) = f.get("max_output_tokens") {
        out.insert("max_tokens".into(), v.clone());
        echo.insert("max_output_tokens".into(), v.clone());
    }
    let mut messages = match f.string("previous_response_id")? {
        Some(id) => {
            let previous = store
                .get(id)
                .ok_or_else(|| not_found(id, "previous_response_id"))?;
            echo.insert("previous_response_id".into(), json!(id));
            previous.messages
        }
        None => vec![],
    };
    messages.extend(input(&f)?);
    let mut chat = vec![];
    if let Some(instructions) = f.string("instructions")? {
        chat.push(json!({"role": "system", "content": instructions}));
        echo.insert("instructions".into(), json!(instructions));
    }
    chat.extend(messages.iter().cloned());
    out.insert("messages".into(), Value::Array(chat));
    if let Some(tools) = tools(&f)? {
        echo.insert("tools".into(), tools.clone());
        let functions = (tools.as_array().into_iter().flatten()).map(|t| {
            json!({"type": "function", "function": {
                "name": t["name"], "description": t["description"], "parameters": t["parameters"]}})
        });
        out.insert("tools".into(), Value::Array(functions.collect()));
    }
    if let Some(choice) = f.get("tool_choice") {
        let chat_choice = match choice {
            Value::Object(c) if c.get("type") == Some(&json!("function")) => {
                json!({"type": "function", "function": {"name": c.get("name")}})
            }
            other => other.clone(),
        };
        out.insert("tool_choice".into(), chat_choice);
        echo.insert("tool_choice".into(), choice.clone());
    }
    if let Some(text) = f.get("text") {
        let format = text.get("format").filter(|v| !v.is_null());
        if let Some(format) = format {
            out.insert("response_format".into(), response_format(format)?);
        }
        echo.insert(
            "text".into(),
            json!({"format": format.cloned().unwrap_or(json!({"type": "text"}))}),
        );
    }
    if let Some(metadata) = f.get("metadata") {
        echo.insert("metadata".into(), metadata.clone());
    }
    let store = f.bool("store")?.unwrap_or(true);
    let context = Context {
        echo,
        messages,
        store,
    };
    Ok((Value::Object(out).to_string().into_bytes(), context))
}

/// The Responses field an error of the shared decoder is about.
pub fn rename(mut e: ApiError) -> ApiError {
    if let Some(param) = &e.param {
        let renamed = if param == "max_tokens" {
            "max_output_tokens".into()
        } else if let Some(rest) = param.strip_prefix("response_format") {
            format!("text.format{}", rest.replacen(".json_schema", "", 1))
        } else if param.starts_with("messages") {
            "input".into()
        } else {
            param
                .replace(".function.", ".")
                .replace("tool_choice.function", "tool_choice")
        };
        e.message = e.message.replace(param.as_str(), &renamed);
        e.param = Some(renamed);
    }
    e
}

/// `text.format`: `text`, `json_object` or `json_schema` (flat, as Responses has it) as chat's
/// `response_format`.
fn response_format(format: &Value) -> Result<Value, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => {
            let mut spec = format.clone();
            if let Some(obj) = spec.as_object_mut() {
                obj.remove("type");
            }
            Ok(json!({"type": "json_schema", "json_schema": spec}))
        }
        Some("text" | "json_object") => Ok(format.clone()),
        _ => {
            let message = "`text.format.type` must be `text`, `json_object` or `json_schema`";
            Err(ApiError::invalid("text.format.type", message))
        }
    }
}

/// `input`: a string, or items (messages, `function_call`, `function_call_output`) as chat
/// messages.
fn input(f: &Fields) -> Result<Vec<Value>, ApiError> {
    let items = match f.get("input") {
        None => return Err(ApiError::invalid("input", "`input` is required")),
        Some(Value::String(s)) => return Ok(vec![json!({"role": "user", "content": s})]),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::invalid("input", "`input` must not be empty"));
        }
        Some(Value::Array(items)) if items.len() > MAX_MESSAGES => {
            let message = format!("`input` holds at most {MAX_MESSAGES} items");
            return Err(ApiError::invalid("input", message));
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(type_error("input", "a string or an array of items")),
    };
    let mut out: Vec<Value> = vec![];
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Value::Object(obj) = item else {
            return Err(type_error(&at, "an object"));
        };
        let it = Fields(obj);
        let text = |key: &str| match it.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(type_error(&format!("{at}.{key}"), "a string")),
        };
        match it
            .string("type")
            .map_err(|e| e.within(&at))?
            .unwrap_or("message")
        {
            "message" => out.push(message(&at, &it)?),
            "function_call" => {
                let call = json!({"id": text("call_id")?, "type": "function",
                                  "function": {"name": text("name")?, "arguments": text("arguments")?}});
                // Calls of one turn join the assistant message before them.
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" => match m["tool_calls"].as_array_mut() {
                        Some(calls) => calls.push(call),
                        None => m["tool_calls"] = json!([call]),
                    },
                    _ => {
                        out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                    }
                }
            }
            "function_call_output" => {
                let output = match it.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => content_text(&format!("{at}.output"), parts)?,
                    _ => return Err(type_error(&format!("{at}.output"), "a string")),
                };
                out.push(
                    json!({"role": "tool", "tool_call_id": text("call_id")?, "content": output}),
                );
            }
            // Earlier reasoning is not shown again.
            "reasoning" => {}
            kind => {
                let message = format!("input items of type `{kind}` are not supported");
                return Err(ApiError::invalid(format!("{at}.type"), message));
            }
        }
    }
    Ok(out)
}

fn message(at: &str, it: &Fields) -> Result<Value, ApiError> {
    let role = match it.string("role").map_err(|e| e.within(at))? {
        Some(r @ ("user" | "assistant" | "system")) => r,
        Some("developer") => "system",
        Some(r) => {
            let message =
                format!("unknown role `{r}`: expected user, assistant, system or developer");
            return Err(ApiError::invalid(format!("{at}.role"), message));
        }
        None => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                "`role` is required",
            ));
        }
    };
    let content = match it.get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => content_parts(&format!("{at}.content"), parts)?,
        _ => {
            let expected = "a string or an array of content parts";
            return Err(type_error(&format!("{at}.content"), expected));
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// A message's parts as chat content: their text, or chat's parts where images or audio are
/// among them (`input_image` with an `image_url`, `input_audio` as chat's).
fn content_parts(at: &str, parts: &[Value]) -> Result<Value, ApiError> {
    let kind = |p: &Value| p.get("type").and_then(Value::as_str).map(str::to_owned);
    let media = |p: &Value| matches!(kind(p).as_deref(), Some("input_image" | "input_audio"));
    if !parts.iter().any(media) {
        return Ok(Value::String(content_text(at, parts)?));
    }
    if parts.len() > MAX_CONTENT_PARTS {
        let message = format!("a message holds at most {MAX_CONTENT_PARTS} content parts");
        return Err(ApiError::invalid(at, message));
    }
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let text = part.get("text").and_then(Value::as_str);
        match (kind(part).as_deref(), text, part.get("image_url")) {
            (Some("input_text" | "output_text" | "text"), Some(t), _) => {
                out.push(json!({"type": "text", "text": t}));
            }
            (Some("input_image"), _, Some(Value::String(url))) => {
                out.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            (Some("input_image"), ..) => {
                let message = "an `input_image` part needs an `image_url` (a base64 `data:` URL)";
                return Err(ApiError::invalid(format!("{at}[{j}]"), message));
            }
            (Some("input_audio"), ..) => out.push(part.clone()),
            _ => {
                let expected = "an `input_text`, `input_image` or `input_audio` part";
                return Err(type_error(&format!("{at}[{j}]"), expected));
            }
        }
    }
    Ok(Value::Array(out))
}

/// The text of `input_text` / `output_text` parts.
fn content_text(at: &str, parts: &[Value]) -> Result<String, ApiError> {
    if parts.len() > MAX_CONTENT_PARTS {
        let message = format!("a message holds at most {MAX_CONTENT_PARTS} content parts");
        return Err(ApiError::invalid(at, message));
    }
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str);
        match (kind, part.get("text").and_then(Value::as_str)) {
            (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
            (Some("input_file"), _) => {
                let message = "file input is not supported by this server";
                return Err(ApiError::invalid(format!("{at}[{j}]"), message));
            }
            _ => return Err(type_error(&format!("{at}[{j}]"), "an `input_text` part")),
        }
    }
    Ok(text)
}

/// `tools`: function tools (`{type, name, description, parameters, strict}`), normalised.
fn tools(f: &Fields) -> Result<Option<Value>, ApiError> {
    let Some(items) = f.array("tools", MAX_TOOLS, "an array of tools")? else {
        return Ok(None);
    };
    let mut out = vec![];
    for (i, tool) in items.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            let message = "only `function` tools are supported";
            return Err(ApiError::invalid(format!("tools[{i}].type"), message));
        }
        let get = |k: &str| tool.get(k).cloned().unwrap_or(Value::Null);
        out.push(
            json!({"type": "function", "name": get("name"), "description": get("description"),
                        "parameters": get("parameters"), "strict": get("strict")}),
        );
    }
    Ok(Some(Value::Array(out)))
}
