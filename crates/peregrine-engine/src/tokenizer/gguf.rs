//! Reading `tokenizer.ggml.*` metadata and deciding special tokens the way llama.cpp's
//! `llama_vocab::impl::load` does, then handing off to the `gpt2` or `llama` builder.

use std::collections::HashMap;

use peregrine_tensor::candle::quantized::gguf_file::Value;
use tokenizers::AddedToken;

use super::gguf_special::{attr, end_of_generation};
use super::{SpecialTokens, Tokenizer, TokenizerError, gguf_bpe, gguf_spm};

pub(super) const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// The vocabulary as stored in GGUF, with token types already adjusted as llama.cpp adjusts them.
pub(super) struct GgufVocab {
    /// Token texts; empty ones renamed `[EMPTY_i]` as llama.cpp does.
    pub tokens: Vec<String>,
    /// llama.cpp attributes per token ([`attr`]), from `token_type` (all normal when absent).
    pub attrs: Vec<u32>,
    /// `scores` per token, if stored.
    pub scores: Option<Vec<f32>>,
}

impl GgufVocab {
    /// The tokens llama.cpp splits out of the text before tokenizing (control, user-defined and
    /// unknown), as `tokenizers` added tokens; control and unknown ones are dropped by `skip_special`.
    pub fn added_tokens(&self) -> Vec<AddedToken> {
        let special = attr::CONTROL | attr::UNKNOWN;
        self.tokens
            .iter()
            .zip(&self.attrs)
            .filter(|&(_, &a)| a & (special | attr::USER_DEFINED) != 0)
            .map(|(text, &a)| AddedToken::from(text.clone(), a & special != 0).normalized(false))
            .collect()
    }

    /// The lowest id whose text is one of `texts`.
    pub fn find(&self, texts: &[&str]) -> Option<u32> {
        self.tokens
            .iter()
            .position(|t| texts.contains(&t.as_str()))
            .map(|i| i as u32)
    }
}

/// Builds the tokenizer for `tokenizer.ggml.model` (`gpt2` or `llama`).
pub(super) fn load(md: &HashMap<String, Value>) -> Result<Tokenizer, TokenizerError> {
    let model = string(md, KEY_MODEL)?.ok_or_else(|| missing(KEY_MODEL))?;
    let mut vocab = read_vocab(md)?;
    let n = vocab.tokens.len() as u32;
    // llama.cpp's defaults: SentencePiece models put BOS at 1 and EOS at 2 and add BOS.
    let (mut bos, mut eos, mut add_bos) = match model {
        "llama" => (Some(1), Some(2), true),
        "gpt2" => (None, None, gguf_bpe::adds_bos_by_default(md)?),
        other => {
            return Err(TokenizerError::Metadata {
                key: KEY_MODEL.into(),
                message: format!("unsupported tokenizer `{other}` (supported: gpt2, llama)"),
            });
        }
    };
    bos = token_id(md, KEY_BOS, n)?.or(bos);
    eos = token_id(md, KEY_EOS, n)?.or(eos);
    add_bos = boolean(md, KEY_ADD_BOS)?.unwrap_or(add_bos);
    let add_eos = boolean(md, KEY_ADD_EOS)?.unwrap_or(false);
    let eos_ids = end_of_generation(md, &mut vocab, eos)?;
    let specials = SpecialTokens {
        bos_id: bos,
        eos_ids,
        add_bos,
        add_eos,
        chat_template: string(md, KEY_CHAT_TEMPLATE)?.map(str::to_owned),
    };
    let inner = match model {
        "gpt2" => gguf_bpe::build(md, &vocab)?,
        _ => gguf_spm::build(md, &vocab, unk_id(md, n)?)?,
    };
    let mut tokenizer = specials.build(inner);
    tokenizer.vocab_size -= unused_tail(md)?;
    Ok(tokenizer)
}

/// How many tokens at the end of the list are typed unused (5): the `[PADn]` entries llama.cpp's
/// converter adds to fill the embedding's padded rows (Qwen's). They stay outside the vocabulary
/// generation draws from, as the rows past an HF tokenizer's ids do.
fn unused_tail(md: &HashMap<String, Value>) -> Result<usize, TokenizerError> {
    let Some(types) = array(md, KEY_TYPES)? else {
        return Ok(0);
    };
    Ok(types
        .iter()
        .rev()
        .take_while(|v| integer(v) == Some(5))
        .count())
}

/// The unknown-token id for SentencePiece vocabularies (llama.cpp default 0).
fn unk_id(md: &HashMap<String, Value>, n: u32) -> Result<Option<u32>, TokenizerError> {
    Ok(token_id(md, "tokenizer.ggml.unknown_token_id", n)?.or(Some(0).filter(|_| n > 0)))
}

fn read_vocab(md: &HashMap<String, Value>) -> Result<GgufVocab, TokenizerError> {
    let tokens: Vec<String> = array(md, KEY_TOKENS)?
        .ok_or_else(|| missing(KEY_TOKENS))?
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) if s.is_empty() => Ok(format!("[EMPTY_{i}]")),
            Value::String(s) => Ok(s.clone()),
            other => Err(bad(
                KEY_TOKENS,
                format!("entry {i} is {:?}, not a string", other.value_type()),
            )),
        })
        .collect::<Result<_, _>>()?;
    let n = tokens.len();
    let attrs = match array(md, KEY_TYPES)? {
        None => vec![attr::NORMAL; n],
        Some(values) => values
            .iter()
            .map(|v| {
                integer(v)
                    .map(attr::from_type)
                    .ok_or_else(|| bad(KEY_TYPES, "non-integer entry"))
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    let scores = match array(md, KEY_SCORES)? {
        None => None,
        Some(values) => Some(
            values
                .iter()
                .map(|v| match v {
                    Value::F32(x) => Ok(*x),
                    Value::F64(x) => Ok(*x as f32),
                    _ => Err(bad(KEY_SCORES, "non-float entry")),
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    if attrs.len() != n {
        return Err(bad(
            KEY_TYPES,
            format!("{} entries for {n} tokens", attrs.len()),
        ));
    }
    if let Some(s) = scores.as_ref().filter(|s| s.len() != n) {
        return Err(bad(
            KEY_SCORES,
            format!("{} entries for {n} tokens", s.len()),
        ));
    }
    Ok(GgufVocab {
        tokens,
        attrs,
        scores,
    })
}

/// Wraps an error from `tokenizers` while building the `model` tokenizer.
pub(super) fn build_error(model: &str) -> impl Fn(tokenizers::Error) -> TokenizerError + '_ {
    move |e| TokenizerError::Build {
        model: model.to_owned(),
        message: e.to_string(),
    }
}

pub(super) fn missing(key: &str) -> TokenizerError {
    TokenizerError::MissingKey { key: key.into() }
}

pub(super) fn bad(key: &str, message: impl Into<String>) -> TokenizerError {
    TokenizerError::Metadata {
        key: key.into(),
        message: message.into(),
    }
}

fn integer(v: &Value) -> Option<i64> {
    Some(match *v {
        Value::U8(x) => x.into(),
        Value::I8(x) => x.into(),
        Value::U16(x) => x.into(),
        Value::I16(x) => x.into(),
        Value::U32(x) => x.into(),
        Value::I32(x) => x.into(),
        Value::U64(x) => i64::try_from(x).ok()?,
        Value::I64(x) => x,
        _ => return None,
    })
}

pub(super) fn string<'a>(
    md: &'a HashMap<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(bad(
            key,
            format!("expected a string, found {:?}", v.value_type()),
        )),
    }
}

pub(super) fn array<'a>(
    md: &'a HashMap<String, Value>,
    key: &str,
) -> Result<Option<&'a [Value]>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(bad(
            key,
            format!("expected an array, found {:?}", v.value_type()),
        )),
    }
}

pub(super) fn boolean(
    md: &HashMap<String, Value>,
    key: &str,
) -> Result<Option<bool>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(bad(
            key,
            format!("expected a bool, found {:?}", v.value_type()),
        )),
    }
}

/// A token id; ids outside the vocabulary are ignored, as llama.cpp ignores them (with a warning).
pub(super) fn token_id(
    md: &HashMap<String, Value>,
    key: &str,
    n: u32,
) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id = integer(v).ok_or_else(|| {
        bad(
            key,
            format!("expected an integer, found {:?}", v.value_type()),
        )
    })?;
    if (0..i64::from(n)).contains(&id) {
        Ok(Some(id as u32))
    } else {
        tracing::warn!(
            "GGUF metadata `{key}` = {id} is outside the vocabulary of {n} tokens; ignored"
        );
        Ok(None)
    }
}
