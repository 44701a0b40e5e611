//! Tool calls in model output: each family's native call syntax (Hermes/Qwen `<tool_call>`,
//! Llama 3.x bare JSON, Mistral `[TOOL_CALLS]`, DeepSeek's `<｜tool▁calls▁begin｜>`, Gemma 4's
//! `<|tool_call>call:name{…}<tool_call|>`), found in a
//! stream of text deltas so that calls can be streamed as they close. Text that only looks like
//! the start of a call is held back until it is decided; a call that does not parse is text.

mod gemma4;

use serde_json::Value;

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text.
    pub arguments: String,
}

/// What the parser lets through: text, or a whole call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Output text that is not a call.
    Text(String),
    /// A call.
    Call(ToolCall),
}

/// A family's call syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// `<tool_call>{"name": …, "arguments": …}</tool_call>` (Hermes, Qwen 2.5/3, our fallback).
    Hermes,
    /// `{"name": …, "parameters": …}` as the whole answer, `<|python_tag|>` optional (Llama 3.x).
    LlamaJson,
    /// `[TOOL_CALLS][{"name": …, "arguments": …}]` or `[TOOL_CALLS]name[ARGS]{…}` (Mistral).
    Mistral,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>…<｜tool▁sep｜>…<｜tool▁call▁end｜>…` (DeepSeek).
    DeepSeek,
    /// `<|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|>` (Gemma 4; [`gemma4`]).
    Gemma4,
}

const HERMES: (&str, Option<&str>) = ("<tool_call>", Some("</tool_call>"));
const PYTHON_TAG: (&str, Option<&str>) = ("<|python_tag|>", None);
const MISTRAL: (&str, Option<&str>) = ("[TOOL_CALLS]", None);
const DEEPSEEK: (&str, Option<&str>) = ("<｜tool▁calls▁begin｜>", Some("<｜tool▁calls▁end｜>"));
const GEMMA4: (&str, Option<&str>) = ("<|tool_call>", Some("<tool_call|>"));

impl CallFormat {
    /// The format a chat template's tool section writes; Hermes when it shows none.
    pub fn of_template(template: Option<&str>) -> Self {
        let t = template.unwrap_or_default();
        if !t.contains("tools") || t.contains("<tool_call>") {
            Self::Hermes
        } else if t.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if t.contains("tool▁calls▁begin") {
            Self::DeepSeek
        } else if t.contains("<|tool_call>") {
            Self::Gemma4
        } else if t.contains("<|start_header_id|>") {
            Self::LlamaJson
        } else {
            Self::Hermes
        }
    }

    /// Whether the format's markers are control tokens, which the text keeps only when asked.
    pub fn markers_are_special(self) -> bool {
        matches!(self, Self::Mistral | Self::DeepSeek | Self::Gemma4)
    }

    /// The key holding a call's arguments.
    pub fn arguments_key(self) -> &'static str {
        match self {
            Self::LlamaJson => "parameters",
            _ => "arguments",
        }
    }

    /// Text around one forced call's JSON. Mistral's, DeepSeek's and Gemma 4's markers are
    /// control tokens a grammar cannot spell as text, so forced calls there use Hermes tags (which
    /// every format's parser also reads).
    pub fn grammar_markers(self) -> (&'static str, &'static str) {
        match self {
            Self::LlamaJson => ("", ""),
            _ => ("<tool_call>\n", "\n</tool_call>"),
        }
    }

    /// The start and end markers a call may sit between (`None`: to the end of the output).
    fn markers(self) -> &'static [(&'static str, Option<&'static str>)] {
        match self {
            Self::Hermes => &[HERMES],
            Self::LlamaJson => &[PYTHON_TAG, HERMES],
            Self::Mistral => &[MISTRAL, HERMES],
            Self::DeepSeek => &[DEEPSEEK, HERMES],
            Self::Gemma4 => &[GEMMA4, HERMES],
        }
    }
}

/// Finds calls in a stream of text deltas.
#[derive(Debug)]
pub struct CallParser {
    format: CallFormat,
    held: String,
    /// The marker of the call being read.
    inside: Option<(&'static str, Option<&'static str>)>,
    /// No text has been let through yet (Llama's bare JSON call must open the answer).
    at_start: bool,
}

impl CallParser {
    /// A parser for `format`.
    pub fn new(format: CallFormat) -> Self {
        Self {
            format,
            held: String::new(),
            inside: None,
            at_start: true,
        }
    }

    /// Takes the next delta; returns what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = vec![];
        loop {
            if let Some((start, end)) = self.inside {
                let Some(end) = end else { break };
                let Some(at) = self.held.find(end) else { break };
                let body: String = self.held.drain(..at + end.len()).collect();
                self.close(start, &body[..at], Some(end), &mut out);
                continue;
            }
            if self.at_start && self.format == CallFormat::LlamaJson {
                let trimmed = self.held.trim_start();
                if trimmed.is_empty() {
                    break;
                }
                if trimmed.starts_with('{') {
                    self.held = trimmed.to_string();
                    self.inside = Some(("", None));
                    continue;
                }
            }
            let found = (self.format.markers().iter())
                .filter_map(|m| self.held.find(m.0).map(|at| (at, *m)))
                .min_by_key(|(at, _)| *at);
            if let Some((at, marker)) = found {
                let before: String = self.held.drain(..at + marker.0.len()).collect();
                self.text(&before[..at], &mut out);
                self.inside = Some(marker);
                continue;
            }
            let keep = self.undecided_tail();
            let free: String = self.held.drain(..self.held.len() - keep).collect();
            self.text(&free, &mut out);
            break;
        }
        out
    }

    /// The output ended: a call still open is read as it stands.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = vec![];
        let rest = std::mem::take(&mut self.held);
        match self.inside.take() {
            Some((start, _)) => self.close(start, &rest, None, &mut out),
            None => self.text(&rest, &mut out),
        }
        out
    }

    fn text(&mut self, text: &str, out: &mut Vec<Piece>) {
        if !text.is_empty() {
            self.at_start = false;
            out.push(Piece::Text(text.to_string()));
        }
    }

    /// Parses the body of a call between `start` and `end`; what does not parse is text.
    fn close(&mut self, start: &str, body: &str, end: Option<&str>, out: &mut Vec<Piece>) {
        self.inside = None;
        match parse_body(start, body) {
            Some(calls) if !calls.is_empty() => {
                self.at_start = false;
                out.extend(calls.into_iter().map(Piece::Call));
            }
            _ => {
                let raw = format!("{start}{body}{}", end.unwrap_or_default());
                self.text(&raw, out);
            }
        }
    }

    /// How many bytes at the end of the held text could begin a marker.
    fn undecided_tail(&self) -> usize {
        let held = &self.held;
        (self.format.markers().iter())
            .map(|(start, _)| {
                (1..start.len().min(held.len() + 1))
                    .rev()
                    .find(|&n| start.is_char_boundary(n) && held.ends_with(&start[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }
}

/// The calls in one marker's body.
fn parse_body(start: &str, body: &str) -> Option<Vec<ToolCall>> {
    match start {
        "[TOOL_CALLS]" => mistral(body),
        s if s == DEEPSEEK.0 => deepseek(body),
        s if s == GEMMA4.0 => gemma4::calls(body),
        // Llama 3.2 separates parallel calls with `;`.
        "" | "<|python_tag|>" => (body.split(';').filter(|s| !s.trim().is_empty()))
            .map(|s| json_call(s.trim()))
            .collect(),
        _ => json_call(body.trim()).map(|c| vec![c]),
    }
}

/// `{"name": …, "arguments" | "parameters": …}`, arguments as an object or as JSON text.
fn json_call(text: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(text).ok()?;
    call_of(&v)
}

fn call_of(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    Some(ToolCall {
        name,
        arguments: arguments_text(args.unwrap_or(&Value::Object(Default::default())))?,
    })
}

/// Arguments as compact JSON text; a string holding JSON is taken as that JSON.
fn arguments_text(args: &Value) -> Option<String> {
    match args {
        Value::String(s) => serde_json::from_str::<Value>(s).ok().map(|v| v.to_string()),
        Value::Object(_) => Some(args.to_string()),
        _ => None,
    }
}

fn mistral(body: &str) -> Option<Vec<ToolCall>> {
    let body = body.trim();
    if body.starts_with('[') {
        let list: Vec<Value> = serde_json::from_str(body).ok()?;
        return list.iter().map(call_of).collect();
    }
    // v11+: `name[ARGS]{…}`, repeated after further `[TOOL_CALLS]`.
    (body.split("[TOOL_CALLS]").filter(|s| !s.trim().is_empty()))
        .map(|one| {
            let (name, args) = one.split_once("[ARGS]")?;
            let args: Value = serde_json::from_str(args.trim()).ok()?;
            Some(ToolCall {
                name: name.trim().to_string(),
                arguments: arguments_text(&args)?,
            })
        })
        .collect()
}

fn deepseek(body: &str) -> Option<Vec<ToolCall>> {
    const BEGIN: &str = "<｜tool▁call▁begin｜>";
    const SEP: &str = "<｜tool▁sep｜>";
    const END: &str = "<｜tool▁call▁end｜>";
    (body.split(BEGIN).skip(1))
        .map(|one| {
            let one = one.split(END).next()?;
            let (left, right) = one.split_once(SEP)?;
            // V3: `function<sep>name\n```json\n{…}\n````; V3.1: `name<sep>{…}`.
            let (name, args) = match left.trim() {
                "function" => {
                    let (name, rest) = right.split_once('\n')?;
                    let rest = rest
                        .trim()
                        .trim_start_matches("```json")
                        .trim_end_matches("```");
                    (name.trim(), rest.trim())
                }
                name => (name, right.trim()),
            };
            let args: Value = serde_json::from_str(args).ok()?;
            Some(ToolCall {
                name: name.to_string(),
                arguments: arguments_text(&args)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits a whole output into its text and its calls.
    fn split_calls(format: CallFormat, output: &str) -> (String, Vec<ToolCall>) {
        let mut parser = CallParser::new(format);
        let mut pieces = parser.push(output);
        pieces.extend(parser.finish());
        let (mut text, mut calls) = (String::new(), vec![]);
        for piece in pieces {
            match piece {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(c) => calls.push(c),
            }
        }
        (text, calls)
    }

    /// Parses `text` whole and streamed one char at a time; both must agree.
    fn parse(format: CallFormat, text: &str) -> (String, Vec<ToolCall>) {
        let whole = split_calls(format, text);
        let mut streamed = CallParser::new(format);
        let (mut streamed_text, mut streamed_calls) = (String::new(), vec![]);
        let mut pieces = vec![];
        for c in text.chars() {
            pieces.extend(streamed.push(&c.to_string()));
        }
        pieces.extend(streamed.finish());
        for p in pieces {
            match p {
                Piece::Text(t) => streamed_text.push_str(&t),
                Piece::Call(c) => streamed_calls.push(c),
            }
        }
        assert_eq!(
            whole,
            (streamed_text, streamed_calls),
            "streamed and whole disagree on {text:?}"
        );
        whole
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    // Qwen2.5-7B-Instruct's answer to a weather question with two tools.
    #[test]
    fn hermes_calls_and_text() {
        let out = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"San Francisco, CA\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let (text, calls) = parse(CallFormat::Hermes, out);
        assert_eq!(text, "Let me check.\n\n");
        assert_eq!(
            calls,
            [
                call(
                    "get_weather",
                    r#"{"location":"San Francisco, CA","unit":"celsius"}"#
                ),
                call("get_time", "{}")
            ]
        );
    }

    #[test]
    fn hermes_unclosed_call_at_eos_still_parses_and_bad_json_is_text() {
        let (text, calls) = parse(
            CallFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n",
        );
        assert_eq!((text.as_str(), calls), ("", vec![call("f", r#"{"a":1}"#)]));
        let (text, calls) = parse(CallFormat::Hermes, "x <tool_call>{not json}</tool_call> y");
        assert_eq!(text, "x <tool_call>{not json}</tool_call> y");
        assert!(calls.is_empty());
        let (text, calls) = parse(CallFormat::Hermes, "a < b and <tool");
        assert_eq!((text.as_str(), calls.len()), ("a < b and <tool", 0));
    }

    // Llama-3.2-3B-Instruct: a bare JSON object with `parameters`; two calls joined by `;`.
    #[test]
    fn llama_json_calls() {
        let out = "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris\"}}";
        let (text, calls) = parse(CallFormat::LlamaJson, out);
        assert_eq!(
            (text.as_str(), calls),
            ("", vec![call("get_weather", r#"{"location":"Paris"}"#)])
        );
        let out = "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": \"1\"}}";
        let (_, calls) = parse(CallFormat::LlamaJson, out);
        assert_eq!(calls, [call("a", "{}"), call("b", r#"{"x":"1"}"#)]);
        // JSON that is not a call, and braces later in prose, stay text.
        let (text, calls) = parse(CallFormat::LlamaJson, "{\"answer\": 4}");
        assert_eq!((text.as_str(), calls.len()), ("{\"answer\": 4}", 0));
        let (text, _) = parse(CallFormat::LlamaJson, "Sure: {\"name\": \"a\"}");
        assert_eq!(text, "Sure: {\"name\": \"a\"}");
    }

    // Mistral-7B-Instruct-v0.3 (array) and Mistral-Small-3.2 (v11 `name[ARGS]`).
    #[test]
    fn mistral_calls() {
        let out = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 2}\"}]";
        let (text, calls) = parse(CallFormat::Mistral, out);
        assert_eq!(text, "");
        assert_eq!(
            calls,
            [
                call("get_weather", r#"{"city":"Paris"}"#),
                call("f", r#"{"a":2}"#)
            ]
        );
        let out = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]f[ARGS]{}";
        let (_, calls) = parse(CallFormat::Mistral, out);
        assert_eq!(
            calls,
            [call("get_weather", r#"{"city":"Paris"}"#), call("f", "{}")]
        );
    }

    // DeepSeek-V3 and V3.1 call blocks.
    #[test]
    fn deepseek_calls() {
        let out = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (text, calls) = parse(CallFormat::DeepSeek, out);
        assert_eq!(
            (text.as_str(), calls),
            ("", vec![call("get_weather", r#"{"location":"Tokyo"}"#)])
        );
        let out = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (text, calls) = parse(CallFormat::DeepSeek, out);
        assert_eq!(
            (text.as_str(), calls),
            (
                "Checking.",
                vec![call("get_weather", r#"{"location":"Oslo"}"#)]
            )
        );
    }

    // Gemma 4: the call Google's function-calling guide shows the model answering with, then
    // two calls after text with nested arguments (the template's argument syntax).
    #[test]
    fn gemma4_calls() {
        let out =
            "<|tool_call>call:get_current_temperature{location:<|\"|>London<|\"|>}<tool_call|>";
        let (text, calls) = parse(CallFormat::Gemma4, out);
        assert_eq!(
            (text.as_str(), calls),
            (
                "",
                vec![call("get_current_temperature", r#"{"location":"London"}"#)]
            )
        );
        let out = "Checking both.<|tool_call>call:get_weather{city:<|\"|>Paris, FR<|\"|>,days:2}<tool_call|><|tool_call>call:book{when:{day:<|\"|>mon<|\"|>,late:false},seats:[1,2]}<tool_call|>";
        let (text, calls) = parse(CallFormat::Gemma4, out);
        assert_eq!(text, "Checking both.");
        assert_eq!(
            calls,
            [
                call("get_weather", r#"{"city":"Paris, FR","days":2}"#),
                call(
                    "book",
                    r#"{"when":{"day":"mon","late":false},"seats":[1,2]}"#
                )
            ]
        );
        // A block that does not parse stays text; a forced call's Hermes tags are read too.
        let (text, calls) = parse(CallFormat::Gemma4, "<|tool_call>call:f{a:}<tool_call|>");
        assert_eq!(
            (text.as_str(), calls.len()),
            ("<|tool_call>call:f{a:}<tool_call|>", 0)
        );
        let (_, calls) = parse(
            CallFormat::Gemma4,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(calls, [call("f", "{}")]);
    }

    #[test]
    fn formats_follow_the_template() {
        assert_eq!(CallFormat::of_template(None), CallFormat::Hermes);
        let qwen = "{%- if tools %}<tools>{{ tool | tojson }}</tools><tool_call>{%- endif %}";
        assert_eq!(CallFormat::of_template(Some(qwen)), CallFormat::Hermes);
        let llama = "<|start_header_id|>{%- if tools is not none %}{{ t | tojson }}{%- endif %}";
        assert_eq!(CallFormat::of_template(Some(llama)), CallFormat::LlamaJson);
        let mistral = "{%- if tools %}[AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]";
        assert_eq!(CallFormat::of_template(Some(mistral)), CallFormat::Mistral);
        let gemma4 = "{%- if tools %}<|tool>declaration:{%- endif %}<|tool_call>call:";
        assert_eq!(CallFormat::of_template(Some(gemma4)), CallFormat::Gemma4);
    }
}
