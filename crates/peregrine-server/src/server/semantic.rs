//! What a choice's output means, shared by every front end: the engine's text deltas read into
//! reasoning, answer text and tool calls. Each API (chat completions, Anthropic Messages) only
//! renders these parts in its own shape.

use super::reasoning::{Think, ThinkSplitter};
use super::tool_calls::{CallFormat, CallParser, Piece, ToolCall};

/// One decided part of a choice's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Text of the think block.
    Reasoning(String),
    /// Answer text.
    Text(String),
    /// A whole tool call.
    Call(ToolCall),
}

/// Reads one choice's deltas into parts, holding back text that may still turn out to be a tag
/// or a call.
#[derive(Debug)]
pub struct Reader {
    think: Option<ThinkSplitter>,
    calls: Option<CallParser>,
}

impl Reader {
    /// A reader; `think`: where reasoning templates' thinking is; `calls`: the call syntax to
    /// look for, when the request has tools.
    pub fn new(think: Option<Think>, calls: Option<CallFormat>) -> Self {
        Self {
            think: think.map(ThinkSplitter::new),
            calls: calls.map(CallParser::new),
        }
    }

    /// Feeds generated text; returns the parts decided so far (empty texts left out).
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        let (reasoning, content) = match &mut self.think {
            Some(splitter) => {
                let split = splitter.push(text);
                (split.reasoning, split.content)
            }
            None => (String::new(), text.to_string()),
        };
        self.parts(reasoning, content, false)
    }

    /// Ends the output; returns whatever was held back.
    pub fn finish(&mut self) -> Vec<Part> {
        let (reasoning, content) = match &mut self.think {
            Some(splitter) => {
                let split = splitter.finish();
                (split.reasoning, split.content)
            }
            None => (String::new(), String::new()),
        };
        self.parts(reasoning, content, true)
    }

    fn parts(&mut self, reasoning: String, content: String, last: bool) -> Vec<Part> {
        let mut out = vec![];
        if !reasoning.is_empty() {
            out.push(Part::Reasoning(reasoning));
        }
        let pieces = match &mut self.calls {
            Some(parser) => {
                let mut pieces = parser.push(&content);
                if last {
                    pieces.extend(parser.finish());
                }
                pieces
            }
            None => vec![Piece::Text(content)],
        };
        out.extend(pieces.into_iter().filter_map(|p| match p {
            Piece::Text(t) if t.is_empty() => None,
            Piece::Text(t) => Some(Part::Text(t)),
            Piece::Call(c) => Some(Part::Call(c)),
        }));
        out
    }

    /// A whole output at once, as the streamed parts would give it.
    pub fn read_all(mut self, text: &str) -> Vec<Part> {
        let mut parts = self.push(text);
        parts.extend(self.finish());
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_text_and_a_call_come_apart_in_order() {
        let out = "<think>plan</think>Sure.<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let think = Think {
            tags: super::super::reasoning::THINK,
            inside: false,
        };
        let parts = Reader::new(Some(think), Some(CallFormat::Hermes)).read_all(out);
        assert_eq!(parts[0], Part::Reasoning("plan".into()));
        assert_eq!(parts[1], Part::Text("Sure.".into()));
        assert!(matches!(&parts[2], Part::Call(c) if c.name == "f" && c.arguments == "{}"));
        assert_eq!(parts.len(), 3);
    }

    #[test]
    fn streamed_deltas_give_the_same_parts_as_the_whole_text() {
        let out = "Hi <tool_call>\n{\"name\": \"g\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let whole = Reader::new(None, Some(CallFormat::Hermes)).read_all(out);
        let mut reader = Reader::new(None, Some(CallFormat::Hermes));
        let mut streamed = vec![];
        for ch in out.chars() {
            streamed.extend(reader.push(&ch.to_string()));
        }
        streamed.extend(reader.finish());
        let text = |parts: &[Part]| -> String {
            (parts.iter())
                .map(|p| match p {
                    Part::Text(t) => t.clone(),
                    Part::Reasoning(r) => format!("[{r}]"),
                    Part::Call(c) => format!("<{}:{}>", c.name, c.arguments),
                })
                .collect()
        };
        assert_eq!(text(&streamed), text(&whole));
        assert!(matches!(whole.last(), Some(Part::Call(c)) if c.name == "g"));
    }
}
