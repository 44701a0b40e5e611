//! Splitting a reasoning model's output into `reasoning_content` (inside `<think>…</think>`, or
//! Gemma 4's `<|channel>thought…<channel|>`) and `content`, incrementally, so streamed deltas and
//! whole answers split identically.
//!
//! Applies only when the chat template mentions the closing marker ([`Tags::of_template`]). A
//! template may open the block in the generation prompt itself (the output then starts inside
//! it); otherwise the block counts only at the very start of the output, after whitespace.

/// A reasoning template's markers around its thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tags {
    /// What opens the block.
    pub open: &'static str,
    /// What closes it.
    pub close: &'static str,
}

/// `<think>…</think>` (Qwen3, DeepSeek-R1 and most reasoning templates).
pub const THINK: Tags = Tags {
    open: "<think>",
    close: "</think>",
};

/// Gemma 4's thought channel. Its markers are control tokens: a request reading them keeps
/// them in its text ([`Tags::markers_are_special`]).
pub const GEMMA4_THOUGHT: Tags = Tags {
    open: "<|channel>thought",
    close: "<channel|>",
};

impl Tags {
    /// The markers a chat template's reasoning uses, if it has any.
    pub fn of_template(template: &str) -> Option<Self> {
        [THINK, GEMMA4_THOUGHT]
            .into_iter()
            .find(|tags| template.contains(tags.close))
    }

    /// Whether the markers are control tokens, which the text keeps only when asked.
    pub fn markers_are_special(self) -> bool {
        self == GEMMA4_THOUGHT
    }
}

/// Where a choice's reasoning is: its markers, and whether the prompt already opened the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Think {
    /// The block's markers.
    pub tags: Tags,
    /// The prompt ends inside the block.
    pub inside: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace yet; an opening tag may still come.
    Start,
    /// Inside the think block.
    Thinking,
    /// Just after the block: whitespace before the answer is dropped.
    Closed,
    /// After the block (or there was none): everything is content.
    Answer,
}

/// An incremental splitter for one choice.
#[derive(Debug, Clone)]
pub struct ThinkSplitter {
    tags: Tags,
    phase: Phase,
    /// Text held back because it may be the start of a tag.
    pending: String,
}

/// Text split into its reasoning and content parts.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    /// Inside the think block.
    pub reasoning: String,
    /// The answer.
    pub content: String,
}

impl ThinkSplitter {
    /// A splitter for `think`'s markers, starting inside the block when the prompt opened it.
    pub fn new(think: Think) -> Self {
        let phase = if think.inside {
            Phase::Thinking
        } else {
            Phase::Start
        };
        Self {
            tags: think.tags,
            phase,
            pending: String::new(),
        }
    }

    /// Feeds generated text; returns what can be emitted now.
    pub fn push(&mut self, text: &str) -> Split {
        self.pending.push_str(text);
        let mut out = Split::default();
        loop {
            match self.phase {
                Phase::Start => {
                    let trimmed = self.pending.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(self.tags.open) {
                        self.pending = rest.to_string();
                        self.phase = Phase::Thinking;
                    } else if self.tags.open.starts_with(trimmed) {
                        return out; // all whitespace, or a prefix of the tag: wait
                    } else {
                        self.phase = Phase::Answer;
                    }
                }
                Phase::Thinking => {
                    let close = self.tags.close;
                    if let Some(at) = self.pending.find(close) {
                        out.reasoning.push_str(&self.pending[..at]);
                        self.pending.drain(..at + close.len());
                        self.phase = Phase::Closed;
                    } else {
                        let keep = held_suffix(&self.pending, close);
                        let emit = self.pending.len() - keep;
                        out.reasoning.push_str(&self.pending[..emit]);
                        self.pending.drain(..emit);
                        return out;
                    }
                }
                Phase::Closed => {
                    let trimmed = self.pending.trim_start();
                    if trimmed.is_empty() {
                        self.pending.clear();
                        return out;
                    }
                    self.pending = trimmed.to_string();
                    self.phase = Phase::Answer;
                }
                Phase::Answer => {
                    out.content.push_str(&self.pending);
                    self.pending.clear();
                    return out;
                }
            }
        }
    }

    /// Flushes held-back text at the end of generation.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        match self.phase {
            Phase::Thinking => Split {
                reasoning: rest,
                content: String::new(),
            },
            _ => Split {
                reasoning: String::new(),
                content: rest,
            },
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn held_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_in_pieces(text: &str, inside: bool, piece: usize) -> Split {
        split_tags_in_pieces(THINK, text, inside, piece)
    }

    fn split_tags_in_pieces(tags: Tags, text: &str, inside: bool, piece: usize) -> Split {
        let mut s = ThinkSplitter::new(Think { tags, inside });
        let mut all = Split::default();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(piece) {
            let part = s.push(&chunk.iter().collect::<String>());
            all.reasoning += &part.reasoning;
            all.content += &part.content;
        }
        let part = s.finish();
        all.reasoning += &part.reasoning;
        all.content += &part.content;
        all
    }

    #[test]
    fn splits_the_same_whatever_the_delta_sizes() {
        let cases = [
            (
                "<think>\nhmm, 2+2</think>\n\nIt is 4.",
                false,
                "\nhmm, 2+2",
                "It is 4.",
            ),
            ("  <think>a</think>b", false, "a", "b"),
            (
                "plain answer <think>not</think>",
                false,
                "",
                "plain answer <think>not</think>",
            ),
            (
                "reasoning only</think>answer",
                true,
                "reasoning only",
                "answer",
            ),
            ("never closed </thi", true, "never closed </thi", ""),
            ("<thi", false, "", "<thi"),
            ("é</think>ü", true, "é", "ü"),
        ];
        for (text, inside, reasoning, content) in cases {
            for piece in [1, 2, 3, 7, 100] {
                let got = split_in_pieces(text, inside, piece);
                assert_eq!(got.reasoning, reasoning, "{text:?} in pieces of {piece}");
                assert_eq!(got.content, content, "{text:?} in pieces of {piece}");
            }
        }
    }

    #[test]
    fn gemma4_thought_channel_splits_whatever_the_delta_sizes() {
        let text = "<|channel>thought\nplan: 2+2<channel|>It is 4.";
        for piece in [1, 2, 3, 7, 100] {
            let split = split_tags_in_pieces(GEMMA4_THOUGHT, text, false, piece);
            assert_eq!(split.reasoning, "\nplan: 2+2", "piece {piece}");
            assert_eq!(split.content, "It is 4.", "piece {piece}");
        }
        // `<think>` means nothing to Gemma 4's splitter, and its markers nothing to the other.
        let split = split_tags_in_pieces(GEMMA4_THOUGHT, "<think>a</think>b", false, 1);
        assert_eq!(
            (split.reasoning.as_str(), split.content.as_str()),
            ("", "<think>a</think>b")
        );
        let split = split_tags_in_pieces(THINK, text, false, 1);
        assert_eq!(split.content, text);
        assert_eq!(
            Tags::of_template("{{ '<|channel>thought\n<channel|>' }}"),
            Some(GEMMA4_THOUGHT)
        );
        assert_eq!(Tags::of_template("{{ '<think>' }}...</think>"), Some(THINK));
        assert_eq!(Tags::of_template("<|im_start|>"), None);
    }
}
