//! The engine's tokenizer: a `tokenizers::Tokenizer` plus what generation needs around it (BOS/EOS
//! ids, whether to add BOS, the chat template).
//!
//! Two sources:
//! - a HuggingFace directory (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`,
//!   `chat_template.jinja`), see [`Tokenizer::from_dir`];
//! - GGUF metadata (`tokenizer.ggml.*`), see [`Tokenizer::from_gguf`]. The GGUF tokenizer is rebuilt
//!   to give llama.cpp's ids: byte-level BPE (`gpt2`) with llama.cpp's pre-tokenizer regexes, and
//!   SentencePiece (`llama`) turned into a byte-fallback BPE whose merges come from the scores.
//!
//! Special tokens written in the text (`<|im_start|>`) are always parsed as special tokens, as
//! llama.cpp does with `parse_special = true`: prompts come from chat templates that write them.
//!
//! Known corners where the GGUF tokenizer can still differ from llama.cpp (none is hit by the
//! parity data in tests/data/tokenizer/):
//! - overlapping special tokens: `tokenizers` takes the leftmost-longest match, llama.cpp the
//!   longest token first, wherever it is;
//! - SentencePiece pieces with equal scores: ties go to the lower id here, to the leftmost pair in
//!   llama.cpp (Gemma 3's normal pieces all have distinct scores);
//! - decoding: user-defined SentencePiece tokens containing `▁` come out with spaces here, verbatim
//!   in llama.cpp; `clean_spaces` (gpt-2/default pre-tokenizers) is not applied;
//! - `gpt2` vocabularies without `bos_token_id`/`eos_token_id` have none here (llama.cpp uses 11).

mod gguf;
mod gguf_bpe;
mod gguf_special;
mod gguf_spm;
mod hf_dir;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use peregrine_tensor::candle::quantized::gguf_file;

/// Errors from loading or running a tokenizer. Messages name the file or metadata key involved.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A tokenizer file is not valid (bad JSON, unexpected field types, bad tokenizer.json).
    #[error("invalid {path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A required GGUF metadata key is absent.
    #[error("GGUF metadata has no `{key}`")]
    MissingKey {
        /// The metadata key.
        key: String,
    },
    /// A GGUF metadata key has an unexpected type or value.
    #[error("GGUF metadata `{key}`: {message}")]
    Metadata {
        /// The metadata key.
        key: String,
        /// What is wrong with its value.
        message: String,
    },
    /// The `tokenizers` crate refused to build the tokenizer described by the metadata.
    #[error("building the `{model}` tokenizer from GGUF metadata: {message}")]
    Build {
        /// The value of `tokenizer.ggml.model`.
        model: String,
        /// The error from `tokenizers`.
        message: String,
    },
    /// Encoding failed.
    #[error("encoding {len} bytes of text: {message}")]
    Encode {
        /// Length in bytes of the text.
        len: usize,
        /// The error from `tokenizers`.
        message: String,
    },
    /// Decoding failed or an id is outside the vocabulary.
    #[error("decoding {count} token ids: {message}")]
    Decode {
        /// How many ids were given.
        count: usize,
        /// What went wrong.
        message: String,
    },
}

/// The engine's tokenizer: text <-> token ids, with the special tokens generation needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Counted once: `tokenizers` recounts the added tokens (a lookup each) on every call.
    vocab_size: usize,
    bos_id: Option<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from `dir`, with `tokenizer_config.json` (BOS/EOS tokens,
    /// `add_bos_token`, `add_eos_token`, `chat_template`), `chat_template.jinja` and
    /// `generation_config.json` (`eos_token_id`, int or list) when present.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        hf_dir::load(dir)
    }

    /// Builds the tokenizer stored in GGUF metadata (`tokenizer.ggml.model` = `gpt2` or `llama`),
    /// tokenizing as llama.cpp does.
    pub fn from_gguf(metadata: &HashMap<String, gguf_file::Value>) -> Result<Self, TokenizerError> {
        gguf::load(metadata)
    }

    /// Encodes `text`. Special tokens written in the text are always recognised; `add_special`
    /// adds BOS (and EOS) when the tokenizer is configured to add them.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode {
                len: text.len(),
                message: e.to_string(),
            })?;
        let body = encoding.get_ids();
        let mut ids = Vec::with_capacity(body.len() + 2);
        if add_special && self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend_from_slice(body);
        if add_special && self.add_eos {
            ids.extend(self.eos_ids.first());
        }
        Ok(ids)
    }

    /// Decodes `ids` to text; `skip_special` drops control tokens (BOS, EOS, `<|im_start|>`...).
    /// Ids outside the vocabulary are an error, not silently dropped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let vocab_size = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(TokenizerError::Decode {
                count: ids.len(),
                message: format!("id {bad} is outside the vocabulary of {vocab_size} tokens"),
            });
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Decode {
                count: ids.len(),
                message: e.to_string(),
            })
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token string of `id` (in the vocabulary's own form, e.g. `Ġthe` or `▁the`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string given in the vocabulary's own form.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` ends generation (EOS, end-of-turn and similar).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// The BOS id, if the vocabulary has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// All ids that end generation; the first is the primary EOS when there is one.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS token string (for chat templates).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string (for chat templates).
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Whether `encode(text, true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(text, true)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// The Jinja chat template shipped with the tokenizer, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The wrapped `tokenizers` tokenizer (for incremental decoding and offsets).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

// Not derived: the wrapped tokenizer would print its whole vocabulary.
impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// Everything but the `tokenizers` object, gathered by the loaders before [`SpecialTokens::build`].
#[derive(Debug, Default)]
struct SpecialTokens {
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<String>,
}

impl SpecialTokens {
    /// Attaches the special-token facts to `inner`, dropping duplicate EOS ids (first one wins).
    fn build(self, inner: tokenizers::Tokenizer) -> Tokenizer {
        let mut eos_ids = Vec::with_capacity(self.eos_ids.len());
        for id in self.eos_ids {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let bos_token = self.bos_id.and_then(|id| inner.id_to_token(id));
        let eos_token = eos_ids.first().and_then(|&id| inner.id_to_token(id));
        Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            inner,
            bos_id: self.bos_id,
            bos_token,
            eos_token,
            eos_ids,
            add_bos: self.add_bos,
            add_eos: self.add_eos,
            chat_template: self.chat_template,
        }
    }
}
