//! Decoding the prompt fields: chat `messages` and completions' `prompt`.

use peregrine_engine::{ChatMessage, Prompt};
use serde_json::{Map, Value};

use super::error::ApiError;
use super::media::{Images, RemoteMedia};
use super::openai::{Fields, MAX_CONTENT_PARTS, MAX_MESSAGES, ROLES, type_error};

/// The chat's prompt, and the pictures of its image parts (each replaced by `{"type":
/// "image"}` for the template; `remote` fetches `http(s)` ones).
pub(super) fn chat_prompt<'a>(
    f: &Fields,
    remote: Option<&'a RemoteMedia>,
) -> Result<(Prompt, Images<'a>), ApiError> {
    let items = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(type_error("messages", "an array of messages")),
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    if items.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!("`messages` holds at most {MAX_MESSAGES} messages"),
        ));
    }
    let mut messages = Vec::with_capacity(items.len());
    let mut images = Images::new(remote);
    for (i, item) in items.iter().enumerate() {
        messages.push(chat_message(i, item, &mut images)?);
    }
    let mut template_kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => return Err(type_error("chat_template_kwargs", "an object")),
    };
    if let Some(on) = f.bool("enable_thinking")? {
        template_kwargs.insert("enable_thinking".into(), Value::Bool(on));
    }
    let prompt = Prompt::Chat {
        messages,
        template_kwargs,
    };
    Ok((prompt, images))
}

fn chat_message(i: usize, item: &Value, images: &mut Images) -> Result<ChatMessage, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(obj) = item else {
        return Err(type_error(&format!("messages[{i}]"), "an object"));
    };
    let role = match obj.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
        Some(Value::String(r)) => {
            return Err(ApiError::invalid(
                at("role"),
                format!("unknown role `{r}`: expected one of {}", ROLES.join(", ")),
            ));
        }
        Some(_) => return Err(type_error(&at("role"), "a string")),
        None => return Err(ApiError::invalid(at("role"), "`role` is required")),
    };
    let mut content = obj.get("content").cloned().unwrap_or(Value::Null);
    match &mut content {
        Value::String(_) => {}
        Value::Null if role == "assistant" => {}
        Value::Array(parts) => {
            if parts.len() > MAX_CONTENT_PARTS {
                return Err(ApiError::invalid(
                    at("content"),
                    format!("a message holds at most {MAX_CONTENT_PARTS} content parts"),
                ));
            }
            for (j, part) in parts.iter_mut().enumerate() {
                let param = format!("messages[{i}].content[{j}]");
                let kind = part.get("type").and_then(Value::as_str);
                let text = part.get("text").and_then(Value::as_str);
                match kind {
                    Some("text") if text.is_some() => {}
                    Some("image_url") => *part = images.take(&param, part)?,
                    Some("input_audio") => *part = images.take_audio(&param, part)?,
                    _ => {
                        return Err(ApiError::invalid(
                            param,
                            "a content part must be `text` ({\"type\": \"text\", \"text\": \
                             ...}), `image_url` or `input_audio`",
                        ));
                    }
                }
            }
        }
        _ => {
            return Err(type_error(
                &at("content"),
                "a string or an array of content parts",
            ));
        }
    }
    let mut extra = obj.clone();
    extra.remove("role");
    extra.remove("content");
    // Templates know `system`; OpenAI's newer `developer` role means the same.
    let role = if role == "developer" { "system" } else { role };
    Ok(ChatMessage {
        role: role.to_string(),
        content,
        extra,
    })
}

pub(super) fn completion_prompts(f: &Fields) -> Result<Vec<Prompt>, ApiError> {
    let expected = "a string, an array of strings, or token ids";
    let ids = |v: &Value, param: &str| -> Result<Vec<u32>, ApiError> {
        let items = v.as_array().ok_or_else(|| type_error(param, expected))?;
        items
            .iter()
            .map(|t| {
                t.as_u64()
                    .filter(|&t| t <= u32::MAX as u64)
                    .map(|t| t as u32)
                    .ok_or_else(|| type_error(param, expected))
            })
            .collect()
    };
    let prompts = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(items)) if items.first().is_some_and(Value::is_number) => {
            vec![Prompt::Tokens(ids(&Value::Array(items.clone()), "prompt")?)]
        }
        Some(Value::Array(items)) => {
            let mut out = vec![];
            for (i, item) in items.iter().enumerate() {
                let param = format!("prompt[{i}]");
                out.push(match item {
                    Value::String(s) => Prompt::Text(s.clone()),
                    v => Prompt::Tokens(ids(v, &param)?),
                });
            }
            out
        }
        Some(_) => return Err(type_error("prompt", expected)),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    Ok(prompts)
}
