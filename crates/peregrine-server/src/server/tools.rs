//! Tool calling, API side: decoding `tools` / `tool_choice` / `parallel_tool_calls`, handing
//! the tools to the chat template (or, for a template that takes none, describing them in a
//! system message), and the grammar that makes `required` or a named choice a valid call.

use peregrine_engine::constraint::with_layout;
use peregrine_engine::{ChatMessage, Grammar, Prompt};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::openai::{Fields, MAX_TOOLS, type_error};
use super::tool_calls::CallFormat;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// A JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// Which calls the model may or must make.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// Text or calls, as the model likes.
    Auto,
    /// No calls: the tools are not shown.
    None,
    /// At least one call of a listed function.
    Required,
    /// A call of this function.
    Function(String),
}

/// The tools of a request and how they may be used.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The functions.
    pub list: Vec<Tool>,
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// Whether one answer may hold several calls.
    pub parallel: bool,
}

impl Tools {
    /// Whether the model must call a tool (a grammar then holds it to the call syntax).
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// The tools as HF chat templates take them (OpenAI's `{"type": "function", ...}` shape).
    pub fn template_json(&self) -> Value {
        let list = self.list.iter().map(|t| {
            let mut function = json!({"name": t.name, "parameters": t.parameters});
            if let Some(d) = &t.description {
                function["description"] = json!(d);
            }
            json!({"type": "function", "function": function})
        });
        Value::Array(list.collect())
    }

    /// The tools that may be called under `tool_choice`.
    fn callable(&self) -> impl Iterator<Item = &Tool> {
        self.list.iter().filter(|t| match &self.choice {
            ToolChoice::Function(name) => &t.name == name,
            _ => true,
        })
    }

    /// The grammar of a forced call in `format`, or `None` when calls are not forced.
    pub fn grammar(&self, format: CallFormat) -> Option<Grammar> {
        if !self.forced() {
            return None;
        }
        let calls: Vec<Value> = (self.callable())
            .map(|t| {
                let arguments = closed(t.parameters.clone());
                json!({"type": "object", "additionalProperties": false,
                       "required": ["name", format.arguments_key()],
                       "properties": {"name": {"const": t.name}, format.arguments_key(): arguments}})
            })
            .collect();
        let schema = with_layout(json!({"anyOf": calls}));
        let (open, close) = format.grammar_markers();
        let call = format!("{} %json {schema} {}", lark_str(open), lark_str(close));
        // Parallel calls: at most one per callable function, so a small model cannot loop.
        let extra = if self.parallel { calls.len() - 1 } else { 0 };
        let repeat = " (\"\\n\" call)?".repeat(extra);
        Some(Grammar::Lark(format!(
            "start: call{repeat}\ncall: {call}\n"
        )))
    }
}

/// `schema` with every object that lists its `properties` closed to others (unless it says
/// otherwise), as OpenAI's strict mode reads a function's parameters: a forced call then ends
/// instead of a small model inventing argument after argument until `max_tokens`.
fn closed(mut schema: Value) -> Value {
    match &mut schema {
        Value::Object(obj) => {
            if obj.contains_key("properties") && !obj.contains_key("additionalProperties") {
                obj.insert("additionalProperties".into(), json!(false));
            }
            for v in obj.values_mut() {
                *v = closed(std::mem::take(v));
            }
        }
        Value::Array(items) => {
            for v in items.iter_mut() {
                *v = closed(std::mem::take(v));
            }
        }
        _ => {}
    }
    schema
}

/// A Lark string literal (JSON's escapes are Lark's).
fn lark_str(s: &str) -> String {
    if s.is_empty() {
        return String::new();
    }
    Value::String(s.to_string()).to_string()
}

/// Decodes `tools`, `tool_choice` and `parallel_tool_calls` of a chat completion request.
pub fn decode(f: &Fields) -> Result<Option<Tools>, ApiError> {
    let list = match f.array("tools", MAX_TOOLS, "an array of tools")? {
        None => vec![],
        Some(items) => {
            let tools: Result<Vec<Tool>, ApiError> = (items.iter().enumerate())
                .map(|(i, t)| openai_tool(t).map_err(|e| e.within(&format!("tools[{i}]"))))
                .collect();
            tools?
        }
    };
    let choice = match f.get("tool_choice") {
        None if list.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => {
                let message = "`tool_choice` must be `auto`, `none`, `required` or a function";
                return Err(ApiError::invalid("tool_choice", message));
            }
        },
        Some(v) => {
            let name = v.pointer("/function/name").and_then(Value::as_str);
            match (v.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Function(name.to_string()),
                _ => {
                    let message = "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}";
                    return Err(ApiError::invalid("tool_choice", message));
                }
            }
        }
    };
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    checked(list, choice, parallel)
}

/// Checks that a forced choice has something to call.
fn checked(list: Vec<Tool>, choice: ToolChoice, parallel: bool) -> Result<Option<Tools>, ApiError> {
    let choice_param = "tool_choice";
    if let ToolChoice::Function(name) = &choice
        && !list.iter().any(|t| &t.name == name)
    {
        let message = format!("`tool_choice` names `{name}`, which is not in `tools`");
        return Err(ApiError::invalid(choice_param, message));
    }
    if list.is_empty() && !matches!(choice, ToolChoice::None | ToolChoice::Auto) {
        let message = "`tool_choice` asks for a call but `tools` is empty";
        return Err(ApiError::invalid(choice_param, message));
    }
    if list.is_empty() || choice == ToolChoice::None {
        return Ok(None);
    }
    Ok(Some(Tools {
        list,
        choice,
        parallel,
    }))
}

/// One OpenAI chat tool: `{"type": "function", "function": {name, description, parameters}}`.
fn openai_tool(v: &Value) -> Result<Tool, ApiError> {
    let Value::Object(obj) = v else {
        return Err(ApiError::invalid("", "a tool must be an object"));
    };
    let f = Fields(obj);
    match f.string("type")? {
        Some("function") => {}
        _ => {
            return Err(ApiError::invalid(
                "type",
                "only `function` tools are supported",
            ));
        }
    }
    let Some(Value::Object(function)) = f.get("function") else {
        return Err(type_error("function", "an object"));
    };
    function_tool(&Fields(function)).map_err(|e| e.within("function"))
}

/// A function's `name`, `description` and `parameters`.
fn function_tool(f: &Fields) -> Result<Tool, ApiError> {
    let parameters_key = "parameters";
    let name = match f.string("name")? {
        Some(n) if valid_name(n) => n.to_string(),
        Some(_) => {
            let message = "a function name is 1 to 64 letters, digits, `_` or `-`";
            return Err(ApiError::invalid("name", message));
        }
        None => return Err(ApiError::invalid("name", "`name` is required")),
    };
    let parameters = match f.get(parameters_key) {
        None => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(type_error(parameters_key, "a JSON schema object")),
    };
    Ok(Tool {
        name,
        description: f.string("description")?.map(str::to_string),
        parameters,
    })
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// Puts `tools` into a chat prompt: as the template's `tools` variable when the template reads
/// one, else as a system message in the Hermes format (with the calls and results of earlier
/// turns rewritten into text the template can show).
pub fn apply(prompt: &mut Prompt, tools: &Tools, template: Option<&str>) {
    let Prompt::Chat {
        messages,
        template_kwargs,
    } = prompt
    else {
        return;
    };
    if template.is_some_and(|t| t.contains("tools")) {
        template_kwargs.insert("tools".into(), tools.template_json());
        for m in messages.iter_mut() {
            arguments_as_objects(m);
        }
        return;
    }
    for m in messages.iter_mut() {
        hermes_history(m);
    }
    let listing: Vec<String> = (tools.template_json().as_array().into_iter().flatten())
        .map(|t| t["function"].to_string())
        .collect();
    let instructions = format!(
        "You may call one or more functions to assist with the user query. The functions are \
         listed in <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\nFor each function call, \
         return a JSON object with the function name and arguments within <tool_call></tool_call> \
         XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
        listing.join("\n")
    );
    match messages.first_mut() {
        Some(first) if first.role == "system" => {
            let text = first.content.as_str().unwrap_or_default();
            first.content = Value::String(format!("{text}\n\n{instructions}"));
        }
        _ => messages.insert(0, ChatMessage::text("system", instructions)),
    }
}

/// HF templates index `tool_call.function.arguments` as a mapping; OpenAI sends a JSON string.
fn arguments_as_objects(m: &mut ChatMessage) {
    for call in (m.extra.get_mut("tool_calls").and_then(Value::as_array_mut))
        .into_iter()
        .flatten()
    {
        if let Some(args) = call.pointer_mut("/function/arguments")
            && let Some(parsed) = args
                .as_str()
                .and_then(|s| serde_json::from_str::<Value>(s).ok())
        {
            *args = parsed;
        }
    }
}

/// An assistant's calls become `<tool_call>` text; a tool result becomes a user message in
/// `<tool_response>` tags, as Hermes-format models saw them in training.
fn hermes_history(m: &mut ChatMessage) {
    if m.role == "tool" {
        let text = content_text(&m.content);
        m.role = "user".into();
        m.content = Value::String(format!("<tool_response>\n{text}\n</tool_response>"));
        m.extra = Map::new();
        return;
    }
    let Some(Value::Array(calls)) = m.extra.remove("tool_calls") else {
        return;
    };
    let mut text = content_text(&m.content);
    for call in calls {
        let name = call
            .pointer("/function/name")
            .cloned()
            .unwrap_or(Value::Null);
        let args = call
            .pointer("/function/arguments")
            .cloned()
            .unwrap_or(json!({}));
        let args = (args.as_str().and_then(|s| serde_json::from_str(s).ok())).unwrap_or(args);
        let body = json!({"name": name, "arguments": args});
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!("<tool_call>\n{body}\n</tool_call>"));
    }
    m.content = Value::String(text);
}

/// The text of a string or of text content parts.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => (parts.iter())
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_call_arguments_admit_no_invented_keys() {
        let schema = json!({"type": "object", "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"zip": {"type": "integer"}}},
            "extra": {"type": "object", "properties": {}, "additionalProperties": true},
        }});
        let closed = closed(schema);
        assert_eq!(closed["additionalProperties"], false);
        assert_eq!(closed["properties"]["where"]["additionalProperties"], false);
        assert_eq!(closed["properties"]["extra"]["additionalProperties"], true);
        assert!(
            closed["properties"]["city"]
                .get("additionalProperties")
                .is_none()
        );
    }
}
