//! `tokenizer.ggml.model = gpt2`: byte-level BPE with the stored merges, split first by the regexes
//! llama.cpp picks for `tokenizer.ggml.pre` (`llm_tokenizer_bpe`), with no added prefix space.

use std::collections::HashMap;

use peregrine_tensor::candle::quantized::gguf_file::Value;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

use super::TokenizerError;
use super::gguf::{GgufVocab, array, bad, build_error, string};

const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

/// GPT-2's word regex; llama.cpp runs it through a hand-written matcher that also splits lone
/// whitespace, which is what the regex engine's unmatched gaps give here.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

/// One llama.cpp pre-tokenizer type: regexes applied in turn, plus the flags it sets.
struct PreType {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
}

/// llama.cpp's `tokenizer.ggml.pre` table (`llama_vocab::impl::load`), for the types whose
/// behaviour is fully described by regexes and flags.
fn pre_type(pre: &str) -> Option<PreType> {
    let (regexes, ignore_merges, add_bos): (&'static [&'static str], bool, bool) = match pre {
        "default" => (
            &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            false,
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => (&[LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => (&[LLAMA3], false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "stablelm2" | "hunyuan" => {
            (&[QWEN2], false, false)
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "mpt" | "olmo" | "jais" | "trillion" => (&[GPT2], false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
            (&[r"\p{N}", GPT2], false, false)
        }
        "falcon" => (
            &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
            false,
            false,
        ),
        "deepseek-v3" => (
            &[r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3],
            false,
            false,
        ),
        _ => return None,
    };
    Some(PreType {
        regexes,
        ignore_merges,
        add_bos,
    })
}

/// `tokenizer.ggml.pre`, `default` when absent (llama.cpp warns and does the same).
fn pre_name(md: &HashMap<String, Value>) -> Result<&str, TokenizerError> {
    Ok(string(md, KEY_PRE)?.unwrap_or("default"))
}

/// Whether llama.cpp adds BOS for this pre-tokenizer when `add_bos_token` is not stored.
pub(super) fn adds_bos_by_default(md: &HashMap<String, Value>) -> Result<bool, TokenizerError> {
    Ok(pre_type(pre_name(md)?).is_some_and(|p| p.add_bos))
}

/// Builds the byte-level BPE tokenizer.
pub(super) fn build(
    md: &HashMap<String, Value>,
    vocab: &GgufVocab,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let pre = pre_name(md)?;
    let pre =
        pre_type(pre).ok_or_else(|| bad(KEY_PRE, format!("unsupported pre-tokenizer `{pre}`")))?;
    let err = build_error("gpt2");

    let mut ids = Vocab::with_capacity(vocab.tokens.len());
    for (i, token) in vocab.tokens.iter().enumerate() {
        ids.insert(token.clone(), i as u32);
    }
    let merges = read_merges(md, &ids)?;
    let bpe = BPE::builder()
        .vocab_and_merges(ids, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(&err)?;

    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for re in pre.regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(&err)?;
        steps.push(split.into());
    }
    // Splitting is done above: ByteLevel only maps bytes to its printable alphabet.
    steps.push(ByteLevel::new(false, false, false).into());

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Sequence::new(steps)));
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    tok.add_special_tokens(vocab.added_tokens()).map_err(&err)?;
    Ok(tok)
}

/// `tokenizer.ggml.merges` ("left right", split at the first space after the first byte, as
/// llama.cpp does); merges naming tokens outside the vocabulary are dropped with a warning.
fn read_merges(
    md: &HashMap<String, Value>,
    ids: &Vocab,
) -> Result<Vec<(String, String)>, TokenizerError> {
    let values = array(md, KEY_MERGES)?.ok_or_else(|| super::gguf::missing(KEY_MERGES))?;
    let mut merges = Vec::with_capacity(values.len());
    let mut dropped = 0usize;
    for (i, v) in values.iter().enumerate() {
        let Value::String(s) = v else {
            return Err(bad(KEY_MERGES, format!("entry {i} is not a string")));
        };
        let split = s.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(p) = split else {
            return Err(bad(KEY_MERGES, format!("entry {i} `{s}` has no space")));
        };
        let (a, b) = (&s[..p], &s[p + 1..]);
        if ids.contains_key(a) && ids.contains_key(b) && ids.contains_key(&format!("{a}{b}")) {
            merges.push((a.to_owned(), b.to_owned()));
        } else {
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::warn!(
            "{KEY_MERGES}: {dropped} merges name tokens outside the vocabulary; dropped"
        );
    }
    Ok(merges)
}
