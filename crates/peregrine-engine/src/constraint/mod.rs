//! Constrained decoding: a request's output held to a JSON schema or a grammar by a token mask
//! that llguidance computes each step, before sampling.

mod token_bytes;

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{
    InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{Value, json};

use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(Value),
    /// A Lark grammar as llguidance takes it; `%json {…}` embeds a schema.
    Lark(String),
}

/// The JSON layout constrained output uses: OpenAI's separators and no free whitespace, which a
/// small model at high temperature would otherwise fill until `max_tokens`.
fn json_layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with `json_layout` attached, unless it chooses its own.
pub fn with_layout(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(json_layout);
    }
    schema
}

impl Grammar {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Self::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(json!({"type": "object"})))
            }
            Self::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(with_layout(schema.clone()))
            }
            Self::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// A compiled grammar; each choice starts its own [`ChoiceMatcher`] from it.
#[derive(Clone)]
pub struct Constraint {
    parser: TokenParser,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    /// A matcher at the grammar's start, for one sequence.
    pub fn start(&self) -> ChoiceMatcher {
        ChoiceMatcher(Matcher::new(Ok(self.parser.deep_clone())))
    }
}

/// One sequence's position in its grammar: [`mask`](Self::mask) the logits, sample, then
/// [`consume`](Self::consume) the token. The engine does this for requests with a
/// [`Constraint`]; it is public for callers that sample themselves (and the benchmark).
pub struct ChoiceMatcher(Matcher);

impl ChoiceMatcher {
    /// Sets the logits of every token the grammar forbids next to -inf (ids past the
    /// tokenizer's vocabulary, padding rows of the output layer, included).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), EngineError> {
        let allowed = self.0.compute_mask_or_eos().map_err(fault)?;
        for (id, logit) in logits.iter_mut().enumerate() {
            if id >= allowed.len() || !allowed.is_allowed(id as TokenId) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Moves past `token` (which the mask allowed).
    pub fn consume(&mut self, token: u32) -> Result<(), EngineError> {
        self.0.consume_token(token).map_err(fault)
    }

    /// Whether the grammar is complete: nothing but end-of-sequence may follow.
    pub fn is_done(&self) -> bool {
        self.0.is_stopped()
    }
}

fn fault(e: impl std::fmt::Display) -> EngineError {
    EngineError::Internal(format!("constrained decoding failed: {e}"))
}

/// Compiles grammars for one tokenizer; its token trie is built on first use (a few hundred
/// milliseconds for a large vocabulary), not at load.
#[derive(Default)]
pub(crate) struct Compiler {
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl Compiler {
    /// Compiles `grammar`; a grammar that does not compile is the client's error.
    pub fn compile(&self, tok: &Tokenizer, grammar: &Grammar) -> Result<Constraint, EngineError> {
        let factory = (self.factory.get_or_init(|| factory(tok)).as_ref()).map_err(|e| {
            EngineError::Internal(format!("constrained decoding is unavailable: {e}"))
        })?;
        let parser = (factory.create_parser(grammar.top_level()))
            .map_err(|e| EngineError::Grammar(e.to_string()))?;
        Ok(Constraint { parser })
    }
}

fn factory(tok: &Tokenizer) -> Result<ParserFactory, String> {
    let words = token_bytes::token_bytes(tok)?;
    let eos = tok.eos_ids();
    let mut info = TokRxInfo::new(words.len() as u32, eos.first().copied().unwrap_or(0));
    info.tok_bos = tok.bos_id();
    let mut trie = TokTrie::from(&info, &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(eos);
    }
    let env: TokEnv = Arc::new(TrieEnv {
        trie,
        tok: tok.clone(),
    });
    let mut factory = ParserFactory::new(
        &env,
        InferenceCapabilities::default(),
        &llguidance::earley::SlicedBiasComputer::general_slices(),
    )
    .map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

/// The trie and our tokenizer, as llguidance sees a tokenizer.
struct TrieEnv {
    trie: TokTrie,
    tok: Tokenizer,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tok.encode(text, false).unwrap_or_default()
        })
    }
}
