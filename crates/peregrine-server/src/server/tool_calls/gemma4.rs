//! Gemma 4's call body: `call:name{key:value,…}`, one or more, where a value is a string
//! between `<|"|>` quote tokens (no escapes inside), a number, `true`/`false`/`null`, an
//! object `{key:value,…}` with bare keys, or an array `[value,…]`. The chat template writes
//! arguments this way and the model answers in kind; JSON-quoted strings and keys are read too,
//! as other runtimes accept them. Converted to JSON for the API.

use serde_json::{Map, Number, Value};

use super::ToolCall;

/// Gemma 4's string quote (a control token of its vocabulary).
const QUOTE: &str = "<|\"|>";

/// The calls in the body of one `<|tool_call>…<tool_call|>` block; `None` when it does not
/// parse whole.
pub(super) fn calls(body: &str) -> Option<Vec<ToolCall>> {
    let mut reader = Reader { rest: body };
    let mut calls = vec![];
    loop {
        reader.skip(|c| c.is_whitespace() || c == ',');
        if reader.rest.is_empty() {
            return Some(calls);
        }
        calls.push(reader.call()?);
    }
}

/// What is left of the body to read.
struct Reader<'a> {
    rest: &'a str,
}

impl Reader<'_> {
    fn skip(&mut self, drop: impl Fn(char) -> bool) {
        self.rest = self.rest.trim_start_matches(drop);
    }

    /// Consumes `prefix` (after whitespace) if the text starts with it.
    fn eat(&mut self, prefix: &str) -> bool {
        self.skip(char::is_whitespace);
        match self.rest.strip_prefix(prefix) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    /// `call:name{…}`.
    fn call(&mut self) -> Option<ToolCall> {
        if !self.eat("call:") {
            return None;
        }
        let open = self.rest.find('{')?;
        let name = self.rest[..open].trim();
        let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
        if name.is_empty() || !name.chars().all(valid) {
            return None;
        }
        let name = name.to_string();
        self.rest = &self.rest[open..];
        let arguments = self.value(0)?;
        arguments.is_object().then(|| ToolCall {
            name,
            arguments: arguments.to_string(),
        })
    }

    /// One value, `depth` containers deep (bounded: the body is the model's output).
    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > 64 {
            return None;
        }
        self.skip(char::is_whitespace);
        if self.eat(QUOTE) {
            let end = self.rest.find(QUOTE)?;
            let text = self.rest[..end].to_string();
            self.rest = &self.rest[end + QUOTE.len()..];
            return Some(Value::String(text));
        }
        match self.rest.chars().next()? {
            '"' => self.json_string().map(Value::String),
            '{' => self.object(depth),
            '[' => self.array(depth),
            _ => self.scalar(),
        }
    }

    fn object(&mut self, depth: usize) -> Option<Value> {
        self.eat("{");
        let mut map = Map::new();
        if self.eat("}") {
            return Some(Value::Object(map));
        }
        loop {
            let key = self.key()?;
            if !self.eat(":") {
                return None;
            }
            map.insert(key, self.value(depth + 1)?);
            if self.eat("}") {
                return Some(Value::Object(map));
            }
            if !self.eat(",") {
                return None;
            }
        }
    }

    fn array(&mut self, depth: usize) -> Option<Value> {
        self.eat("[");
        let mut items = vec![];
        if self.eat("]") {
            return Some(Value::Array(items));
        }
        loop {
            items.push(self.value(depth + 1)?);
            if self.eat("]") {
                return Some(Value::Array(items));
            }
            if !self.eat(",") {
                return None;
            }
        }
    }

    /// A bare key (up to its `:`), or a quoted one.
    fn key(&mut self) -> Option<String> {
        self.skip(char::is_whitespace);
        if self.rest.starts_with(QUOTE) || self.rest.starts_with('"') {
            return match self.value(0)? {
                Value::String(key) => Some(key),
                _ => None,
            };
        }
        let end = self.rest.find(|c: char| c == ':' || "{}[],".contains(c))?;
        let key = self.rest[..end].trim();
        (!key.is_empty() && !key.contains(char::is_whitespace)).then(|| {
            self.rest = &self.rest[end..];
            key.to_string()
        })
    }

    /// A JSON string literal, escapes and all.
    fn json_string(&mut self) -> Option<String> {
        let mut escaped = false;
        let end = (self.rest.char_indices().skip(1)).find_map(|(i, c)| {
            let closes = c == '"' && !escaped;
            escaped = c == '\\' && !escaped;
            closes.then_some(i)
        })?;
        let text = serde_json::from_str(&self.rest[..=end]).ok()?;
        self.rest = &self.rest[end + 1..];
        Some(text)
    }

    /// `true`, `false`, `null` or a number, up to the next delimiter.
    fn scalar(&mut self) -> Option<Value> {
        let end = (self.rest.find(|c: char| ",}]".contains(c))).unwrap_or(self.rest.len());
        let word = self.rest[..end].trim();
        let value = match word {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            "null" => Value::Null,
            _ => Value::Number(serde_json::from_str::<Number>(word).ok()?),
        };
        self.rest = &self.rest[end..];
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(body: &str) -> Option<(String, Value)> {
        let mut calls = calls(body)?;
        assert_eq!(calls.len(), 1, "{body}");
        let call = calls.remove(0);
        Some((call.name, serde_json::from_str(&call.arguments).unwrap()))
    }

    #[test]
    fn values_of_every_kind_become_json() {
        let body = r#"call:plan{title:<|"|>Trip, "day" 1<|"|>,days:3,ratio:-0.5e1,ok:true,no:false,x:null,tags:[<|"|>a<|"|>,"b\"c",2],where:{city:<|"|>Oslo<|"|>,"zip code":<|"|>0150<|"|>},empty:{},none:[]}"#;
        let (name, args) = one(body).unwrap();
        assert_eq!(name, "plan");
        assert_eq!(
            args,
            serde_json::json!({"title": "Trip, \"day\" 1", "days": 3, "ratio": -5.0, "ok": true,
                "no": false, "x": null, "tags": ["a", "b\"c", 2],
                "where": {"city": "Oslo", "zip code": "0150"}, "empty": {}, "none": []})
        );
        // Whitespace between tokens, and no arguments at all.
        let (_, args) = one("call: f { a : 1 , b : [ 1 , 2 ] }").unwrap();
        assert_eq!(args, serde_json::json!({"a": 1, "b": [1, 2]}));
        assert_eq!(one("call:now{}").unwrap().1, serde_json::json!({}));
    }

    #[test]
    fn malformed_bodies_do_not_parse() {
        for body in [
            "",
            "call:{a:1}",
            "call:f",
            "call:f{a:1",
            "call:f{a 1}",
            "call:f{a:<|\"|>open}",
            "call:f{a:1,}",
            "call:f{a:word}",
            "call:two words{}",
            "cal:f{}",
            "call:f{a:1} trailing",
        ] {
            assert!(calls(body).is_none_or(|c| c.is_empty()), "{body:?} parsed");
        }
        let deep = format!("call:f{{a:{}1{}}}", "[".repeat(100), "]".repeat(100));
        assert!(calls(&deep).is_none());
    }
}
