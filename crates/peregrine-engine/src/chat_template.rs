//! HF-compatible chat templates on minijinja.
//!
//! A model's `chat_template` is Jinja written against Python's jinja2 as transformers sets it up:
//! `trim_blocks` and `lstrip_blocks` on, the loop-controls extension, `raise_exception`,
//! `strftime_now`, a `tojson` that does not HTML-escape, and Python string methods
//! (`.strip()`, `.split()`, `.startswith()`). This module rebuilds that environment so a template
//! renders byte-for-byte as `tokenizer.apply_chat_template(..., tokenize=False)` would.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, syntax::SyntaxConfig};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

/// ChatML, the fallback when a model ships no template (what transformers used as its default).
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Gemma's turns, the fallback for Gemma checkpoints that ship no template (Gemma 3 270M's GGUF
/// file): Gemma 3's official template for text, the system message folded into the first user
/// turn, `assistant` written as `model`, roles that must alternate.
pub const GEMMA: &str = r#"{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"#;

/// Gemma 4's turns, the fallback for Gemma 4 checkpoints that ship no template: the text part of
/// its official template (`<|turn>role ... <turn|>`, a system turn of its own, `model` for the
/// assistant, content trimmed, and the empty thought channel it opens when thinking is off).
pub const GEMMA4: &str = r#"{{ bos_token }}{% if messages[0]['role'] in ['system', 'developer'] %}{{ '<|turn>system\n' + messages[0]['content'] | trim + '<turn|>\n' }}{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}{% endif %}"#;

/// The template for a model that ships none, by architecture (`ModelConfig::model_type`: GGUF
/// `general.architecture` or HF `model_type`): its name and source. Gemma 4's turns for
/// `gemma4*`, Gemma's (Gemma 3's) for the rest of the family (`gemma`, `gemma2`, `gemma3`,
/// `gemma3_text`), ChatML otherwise.
pub fn fallback_template(model_type: &str) -> (&'static str, &'static str) {
    match model_type {
        t if t.starts_with("gemma4") => ("Gemma 4's turns", GEMMA4),
        t if t.starts_with("gemma") => ("Gemma's turns", GEMMA),
        _ => ("ChatML", CHATML),
    }
}

/// Name under which the template is stored in its environment (no extension: no auto-escape).
const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation, as the OpenAI API and HF templates see it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// A string, OpenAI content parts (`[{"type": "text", "text": ...}]`), or null.
    #[serde(default)]
    pub content: Json,
    /// Other fields the template may read (`name`, `tool_calls`, `tool_call_id`,
    /// `reasoning_content`), passed through unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

impl ChatMessage {
    /// A message with plain-text content.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Json::String(content.into()),
            extra: Map::new(),
        }
    }
}

/// Why a chat template could not be compiled or rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template source is not valid Jinja (for minijinja).
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`: usually a request the model cannot take
    /// (a bad role order, say), so callers should report it as a client error.
    #[error("{0}")]
    Raised(String),
    /// Rendering failed for another reason (a missing variable used as a string, a type error).
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// Carries `raise_exception`'s message through minijinja's error chain.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

/// A compiled chat template with the special tokens it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The template loops over `message.content` itself (OpenAI parts) rather than using it as
    /// a string; otherwise text parts are joined into one string first, as vLLM does.
    wants_parts: bool,
}

impl ChatTemplate {
    /// Compiles `source` in an HF-compatible environment.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let source = strip_generation_tags(source);
        let wants_parts = loops_over_content(&source);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
            wants_parts,
        })
    }

    /// Renders `messages`. `extra` holds the request's `chat_template_kwargs` (such as
    /// `enable_thinking`, or `tools`), visible as top-level template variables; like
    /// transformers, they may override `bos_token`/`eos_token`/`tools`, but not `messages` or
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String, TemplateError> {
        let mut ctx = Map::new();
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Json::String(bos.clone()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Json::String(eos.clone()));
        }
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
        ctx.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        let messages: Vec<ChatMessage> = if self.wants_parts {
            messages.to_vec()
        } else {
            messages.iter().map(flatten_text_parts).collect()
        };
        let messages = serde_json::to_value(messages)
            .map_err(|e| TemplateError::Render(format!("messages: {e}")))?;
        ctx.insert("messages".into(), messages);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        tmpl.render(Value::from(Serde(&ctx)))
            .map_err(to_template_error)
    }
}

/// `raise_exception`'s message if the error carries one, else the error's description.
fn to_template_error(err: Error) -> TemplateError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(Raised(msg)) = e.downcast_ref::<Raised>() {
            return TemplateError::Raised(msg.clone());
        }
        cur = e.source();
    }
    TemplateError::Render(err.to_string())
}

/// Joins the text parts of OpenAI-style content into one string (vLLM's "string" format).
fn flatten_text_parts(m: &ChatMessage) -> ChatMessage {
    let Json::Array(parts) = &m.content else {
        return m.clone();
    };
    let texts: Vec<&str> = parts
        .iter()
        .filter(|p| p.get("type").and_then(Json::as_str) == Some("text"))
        .filter_map(|p| p.get("text").and_then(Json::as_str))
        .collect();
    ChatMessage {
        content: Json::String(texts.join("\n")),
        ..m.clone()
    }
}

/// Whether a `{% for ... in ...content %}` tag iterates over message content.
fn loops_over_content(source: &str) -> bool {
    source.split("{%").skip(1).any(|tag| {
        let tag = tag.split("%}").next().unwrap_or("");
        let tag = tag.trim_start_matches(['-', '+']).trim_start();
        tag.starts_with("for ")
            && tag
                .split_once(" in ")
                .is_some_and(|(_, iter)| iter.contains("content"))
    })
}

/// Removes transformers' `{% generation %}` / `{% endgeneration %}` markers (its assistant-mask
/// extension), which change nothing in the rendered text but are unknown to minijinja.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let Some(len) = rest[open + 2..].find("%}") else {
            break;
        };
        let end = open + 2 + len + 2;
        let inner = rest[open + 2..end - 2].trim_matches(['-', '+', ' ', '\t', '\n']);
        out.push_str(&rest[..open]);
        if inner != "generation" && inner != "endgeneration" {
            out.push_str(&rest[open..end]);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Prints booleans and none as Python does (`True`, `None`); everything else as minijinja does.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool if value.is_true() => out.write_str("True").map_err(Error::from),
        ValueKind::Bool => out.write_str("False").map_err(Error::from),
        ValueKind::None => out.write_str("None").map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn strftime_now(format: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime_utc(&format, secs)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, i.e. Python spacing (`{"a": 1, "b": [1, 2]}`), keys in insertion order and
/// no HTML escaping. `indent` may also come positionally, as jinja2's own filter takes it.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let bad = |msg: &'static str| Error::new(ErrorKind::InvalidOperation, msg);
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            Some(usize::try_from(v).map_err(|_| bad("tojson: indent must be an integer"))?)
        }
        _ => None,
    };
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(v) if v.len() == 2 => Some((v[0].clone(), v[1].clone())),
        Some(_) => return Err(bad("tojson: separators must be a pair")),
        None => None,
    };
    let (item_sep, key_sep) = separators.unwrap_or_else(|| {
        let item = if indent.is_some() { "," } else { ", " };
        (item.to_owned(), ": ".to_owned())
    });
    let mut w = PyJson {
        out: String::new(),
        indent,
        item_sep,
        key_sep,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    w.value(value, 0)?;
    Ok(Value::from_safe_string(w.out))
}

/// A JSON writer with Python's `json.dumps` layout, walking template values directly so map
/// order survives.
struct PyJson {
    out: String,
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn value(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separator(i == 0, depth + 1);
                    self.value(item, depth + 1)?;
                }
                self.close(items.is_empty(), depth, ']');
            }
            ValueKind::Map => {
                let mut pairs = Vec::new();
                for k in v.try_iter()? {
                    // Python turns non-string keys into their JSON text ("1", "true").
                    let key = k
                        .as_str()
                        .map_or_else(|| json_scalar(&k), |s| Ok(s.to_owned()))?;
                    pairs.push((key, v.get_item(&k)?));
                }
                if self.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.out.push('{');
                for (i, (k, x)) in pairs.iter().enumerate() {
                    self.separator(i == 0, depth + 1);
                    self.string(k);
                    self.out.push_str(&self.key_sep.clone());
                    self.value(x, depth + 1)?;
                }
                self.close(pairs.is_empty(), depth, '}');
            }
            _ => self.out.push_str(&json_scalar(v)?),
        }
        Ok(())
    }

    fn separator(&mut self, first: bool, depth: usize) {
        if !first {
            self.out.push_str(&self.item_sep.clone());
        }
        self.newline(depth);
    }

    /// Closes a container; empty ones stay `[]` / `{}` even when indenting, as in Python.
    fn close(&mut self, empty: bool, depth: usize, bracket: char) {
        if !empty {
            self.newline(depth);
        }
        self.out.push(bracket);
    }

    fn newline(&mut self, depth: usize) {
        if let Some(n) = self.indent {
            self.out.push('\n');
            self.out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    fn string(&mut self, s: &str) {
        let quoted = Json::String(s.to_owned()).to_string();
        if !self.ensure_ascii {
            self.out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                self.out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    self.out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

/// JSON text of a number, bool or other scalar.
fn json_scalar(v: &Value) -> Result<String, Error> {
    serde_json::to_string(v).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "tojson: value is not JSON").with_source(e)
    })
}

#[rustfmt::skip]
const MONTHS: [&str; 12] = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
];
#[rustfmt::skip]
const DAYS_BEFORE_MONTH: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
#[rustfmt::skip]
const WEEKDAYS: [&str; 7] = [
    "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
];

/// Python's `strftime` for the UTC time `unix_secs`, covering the directives templates use
/// (`%Y %y %m %d %e %B %b %h %A %a %H %I %M %S %p %j %%`); others are copied through, as glibc
/// does. transformers uses local time; a server has no better notion of the user's zone than UTC.
pub fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let yday = DAYS_BEFORE_MONTH[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let month_name = MONTHS[(month - 1) as usize];
        match d {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'm' => out.push_str(&format!("{month:02}")),
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:2}")),
            'B' => out.push_str(month_name),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'A' => out.push_str(WEEKDAYS[weekday]),
            'a' => out.push_str(&WEEKDAYS[weekday][..3]),
            'H' => out.push_str(&format!("{h:02}")),
            'I' => out.push_str(&format!("{:02}", (h + 11) % 12 + 1)),
            'M' => out.push_str(&format!("{m:02}")),
            'S' => out.push_str(&format!("{s:02}")),
            'p' => out.push_str(if h < 12 { "AM" } else { "PM" }),
            'j' => out.push_str(&format!("{yday:03}")),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}
