//! Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`), request side: a body is
//! translated into the chat-completions body it means, so one decoder checks the shared fields
//! and one generation path serves both APIs. Fields only Anthropic has are checked here, and an
//! error from the shared decoder is renamed back to the Anthropic field.

use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::openai::{Fields, MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, type_error};

/// The chat-completions body an Anthropic Messages body means. `count_only`: a
/// `count_tokens` body, which has no `max_tokens`.
pub fn translate(body: &[u8], count_only: bool) -> Result<(Vec<u8>, Renames), ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    let f = Fields(&obj);
    let mut out = Map::new();
    match f.string("model")? {
        Some(m) => out.insert("model".into(), json!(m)),
        None => return Err(ApiError::invalid("model", "`model` is required")),
    };
    if !count_only {
        match f.get("max_tokens") {
            Some(v) => out.insert("max_tokens".into(), v.clone()),
            None => return Err(ApiError::invalid("max_tokens", "`max_tokens` is required")),
        };
    }
    for key in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = f.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    if let Some(v) = f.get("stop_sequences") {
        if !v.is_array() {
            return Err(type_error("stop_sequences", "an array of strings"));
        }
        out.insert("stop".into(), v.clone());
    }
    let mut messages = system(&f)?;
    let (conversation, renames) = conversation(&f, messages.len())?;
    messages.extend(conversation);
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = tools(&f)? {
        out.insert("tools".into(), tools);
    }
    if let Some((choice, parallel)) = tool_choice(&f)? {
        out.insert("tool_choice".into(), choice);
        out.insert("parallel_tool_calls".into(), json!(parallel));
    }
    if let Some(on) = thinking(&f)? {
        out.insert("enable_thinking".into(), json!(on));
    }
    Ok((Value::Object(out).to_string().into_bytes(), renames))
}

/// The Anthropic field an error of the shared decoder is about.
pub fn rename(mut e: ApiError) -> ApiError {
    if let Some(param) = &e.param {
        let renamed = if let Some(rest) = param.strip_prefix("stop") {
            format!("stop_sequences{rest}")
        } else if param == "enable_thinking" {
            "thinking".into()
        } else if param == "max_completion_tokens" {
            "max_tokens".into()
        } else {
            param
                .replace(".function.parameters", ".input_schema")
                .replace(".function.", ".")
        };
        e.message = e.message.replace(param.as_str(), &renamed);
        e.param = Some(renamed);
    }
    e
}

/// `system`: a string or text blocks, as the first message.
fn system(f: &Fields) -> Result<Vec<Value>, ApiError> {
    let text = match f.get("system") {
        None => return Ok(vec![]),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => text_blocks(blocks, "system")?,
        Some(_) => return Err(type_error("system", "a string or an array of text blocks")),
    };
    Ok(vec![json!({"role": "system", "content": text})])
}

fn text_blocks(blocks: &[Value], param: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, block) in blocks.iter().enumerate() {
        match (block_type(block), block.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(t)) => text.push_str(t),
            _ => return Err(type_error(&format!("{param}[{j}]"), "a text block")),
        }
    }
    Ok(text)
}

fn block_type(block: &Value) -> Option<&str> {
    block.get("type").and_then(Value::as_str)
}

/// `messages`: user and assistant turns of text, images, `tool_use` and `tool_result` blocks,
/// as chat messages (a tool result becomes a `tool` message ahead of the user's text), after
/// `skip` messages; with the chat field of each image and its Anthropic one.
fn conversation(f: &Fields, skip: usize) -> Result<(Vec<Value>, Renames), ApiError> {
    let items = match f.array("messages", MAX_MESSAGES, "an array of messages")? {
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(items) if items.is_empty() => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ));
        }
        Some(items) => items,
    };
    let (mut out, mut renames) = (vec![], Renames::default());
    for (i, item) in items.iter().enumerate() {
        let (messages, images) = message(i, item)?;
        let last = skip + out.len() + messages.len().saturating_sub(1);
        for (part, param) in images {
            (renames.0).push((format!("messages[{last}].content[{part}]"), param));
        }
        out.extend(messages);
    }
    Ok((out, renames))
}

/// Chat fields (image parts) an Anthropic body's translation moved, with the Anthropic field
/// each came from.
#[derive(Debug, Default)]
pub struct Renames(Vec<(String, String)>);

impl Renames {
    /// The Anthropic field the chat field `param` came from (`param` where none moved).
    pub fn param(&self, param: &str) -> String {
        let moved = (self.0.iter()).find_map(|(chat, anthropic)| {
            let rest = param.strip_prefix(chat.as_str())?;
            Some(format!("{anthropic}{rest}"))
        });
        moved.unwrap_or_else(|| param.to_string())
    }

    /// `e` about the Anthropic field its chat field came from.
    pub fn apply(&self, mut e: ApiError) -> ApiError {
        if let Some(param) = e.param.clone() {
            let renamed = self.param(&param);
            e.message = e.message.replace(&param, &renamed);
            e.param = Some(renamed);
        }
        e
    }
}

/// For each image of a message: its part in the translated user message, and its block's field.
type ImageBlocks = Vec<(usize, String)>;

/// The chat messages an Anthropic message means, and where its images went.
fn message(i: usize, item: &Value) -> Result<(Vec<Value>, ImageBlocks), ApiError> {
    let at = |field: &str| format!("messages[{i}]{field}");
    let Value::Object(obj) = item else {
        return Err(type_error(&at(""), "an object"));
    };
    let role = match obj.get("role") {
        Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
        Some(Value::String(r)) => {
            let message = format!("unknown role `{r}`: expected `user` or `assistant`");
            return Err(ApiError::invalid(at(".role"), message));
        }
        Some(_) => return Err(type_error(&at(".role"), "a string")),
        None => return Err(ApiError::invalid(at(".role"), "`role` is required")),
    };
    let blocks = match obj.get("content") {
        Some(Value::String(s)) => return Ok((vec![json!({"role": role, "content": s})], vec![])),
        Some(Value::Array(blocks)) if blocks.len() <= MAX_CONTENT_PARTS => blocks,
        Some(Value::Array(_)) => {
            let message = format!("a message holds at most {MAX_CONTENT_PARTS} content blocks");
            return Err(ApiError::invalid(at(".content"), message));
        }
        Some(_) => {
            return Err(type_error(
                &at(".content"),
                "a string or an array of content blocks",
            ));
        }
        None => return Err(ApiError::invalid(at(".content"), "`content` is required")),
    };
    let (mut text, mut calls, mut results) = (String::new(), vec![], vec![]);
    // The user's text and images as chat parts, in order, and each image's block.
    let (mut parts, mut images) = (vec![], vec![]);
    for (j, block) in blocks.iter().enumerate() {
        let param = at(&format!(".content[{j}]"));
        let field = |name: &str| block.get(name).filter(|v| !v.is_null());
        match (block_type(block), role) {
            (Some("text"), _) => match field("text") {
                Some(Value::String(t)) => {
                    text.push_str(t);
                    parts.push(json!({"type": "text", "text": t}));
                }
                _ => return Err(type_error(&format!("{param}.text"), "a string")),
            },
            (Some("image"), "user") => {
                images.push((parts.len(), param.clone()));
                parts.push(image_part(&param, block)?);
            }
            (Some("tool_use"), "assistant") => {
                let (Some(Value::String(id)), Some(Value::String(name))) =
                    (field("id"), field("name"))
                else {
                    let message = "a `tool_use` block needs string `id` and `name`";
                    return Err(ApiError::invalid(param, message));
                };
                let input = field("input").cloned().unwrap_or(json!({}));
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": input.to_string()}}));
            }
            (Some("tool_result"), "user") => {
                let Some(Value::String(id)) = field("tool_use_id") else {
                    let message = "a `tool_result` block needs a string `tool_use_id`";
                    return Err(ApiError::invalid(param, message));
                };
                let content = match field("content") {
                    None => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => text_blocks(parts, &format!("{param}.content"))?,
                    Some(_) => {
                        let expected = "a string or an array of text blocks";
                        return Err(type_error(&format!("{param}.content"), expected));
                    }
                };
                results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            // Earlier thinking is not shown again, as Anthropic's own models do not see it.
            (Some("thinking" | "redacted_thinking"), "assistant") => {}
            (Some("document"), _) => {
                let message = "document input is not supported by this server";
                return Err(ApiError::invalid(param, message));
            }
            (Some(kind), _) => {
                let message = format!("a `{kind}` block is not accepted in a {role} message");
                return Err(ApiError::invalid(param, message));
            }
            (None, _) => return Err(type_error(&format!("{param}.type"), "a string")),
        }
    }
    if role == "assistant" {
        let mut m = json!({"role": "assistant", "content": text});
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        return Ok((vec![m], vec![]));
    }
    if !images.is_empty() {
        results.push(json!({"role": "user", "content": parts}));
    } else if !text.is_empty() || results.is_empty() {
        results.push(json!({"role": "user", "content": text}));
    }
    Ok((results, images))
}

/// An `image` block (`source`: `base64` with `media_type` and `data`, or `url`) as chat's
/// `image_url` part; the chat decoder reads it.
fn image_part(param: &str, block: &Value) -> Result<Value, ApiError> {
    let source = block.get("source").unwrap_or(&Value::Null);
    let str_of = |key: &str| source.get(key).and_then(Value::as_str);
    let url = match str_of("type") {
        Some("base64") => match (str_of("media_type"), str_of("data")) {
            (Some(media), Some(data)) => format!("data:{media};base64,{data}"),
            _ => {
                let message = "a base64 image source needs string `media_type` and `data`";
                return Err(ApiError::invalid(format!("{param}.source"), message));
            }
        },
        Some("url") => str_of("url").unwrap_or_default().to_string(),
        _ => {
            let message = "an image `source` must be of type `base64` (or `url`)";
            return Err(ApiError::invalid(format!("{param}.source"), message));
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// `tools`: `{name, description, input_schema}` as chat's function tools.
fn tools(f: &Fields) -> Result<Option<Value>, ApiError> {
    let Some(items) = f.array("tools", MAX_TOOLS, "an array of tools")? else {
        return Ok(None);
    };
    let mut out = vec![];
    for (i, tool) in items.iter().enumerate() {
        let Value::Object(obj) = tool else {
            return Err(type_error(&format!("tools[{i}]"), "an object"));
        };
        let t = Fields(obj);
        let kind = t
            .string("type")
            .map_err(|e| e.within(&format!("tools[{i}]")))?;
        if kind.is_some_and(|k| k != "custom") {
            let message = "only client tools (`name`, `input_schema`) are supported";
            return Err(ApiError::invalid(format!("tools[{i}].type"), message));
        }
        let mut function = json!({"name": obj.get("name").cloned().unwrap_or(Value::Null)});
        if let Some(d) = t.get("description") {
            function["description"] = d.clone();
        }
        match t.get("input_schema") {
            Some(schema) => function["parameters"] = schema.clone(),
            None => {
                let message = "`input_schema` is required";
                return Err(ApiError::invalid(
                    format!("tools[{i}].input_schema"),
                    message,
                ));
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(Value::Array(out)))
}

/// `tool_choice` (`auto`, `any`, `tool` with a `name`, `none`) and whether parallel calls stay
/// allowed (`disable_parallel_tool_use`).
fn tool_choice(f: &Fields) -> Result<Option<(Value, bool)>, ApiError> {
    let Some(v) = f.get("tool_choice") else {
        return Ok(None);
    };
    let Value::Object(obj) = v else {
        return Err(type_error("tool_choice", "an object"));
    };
    let c = Fields(obj);
    let named = |e: ApiError| e.within("tool_choice");
    let parallel = !c
        .bool("disable_parallel_tool_use")
        .map_err(named)?
        .unwrap_or(false);
    let choice = match c.string("type").map_err(named)? {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match c.string("name").map_err(named)? {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => {
                let message = "`tool_choice.name` is required for type `tool`";
                return Err(ApiError::invalid("tool_choice.name", message));
            }
        },
        _ => {
            let message = "`tool_choice.type` must be `auto`, `any`, `tool` or `none`";
            return Err(ApiError::invalid("tool_choice.type", message));
        }
    };
    Ok(Some((choice, parallel)))
}

/// `thinking`: `{"type": "enabled" | "adaptive" | "disabled"}` as the template's switch.
fn thinking(f: &Fields) -> Result<Option<bool>, ApiError> {
    let Some(v) = f.get("thinking") else {
        return Ok(None);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        _ => {
            let message = "`thinking.type` must be `enabled`, `adaptive` or `disabled`";
            Err(ApiError::invalid("thinking.type", message))
        }
    }
}
