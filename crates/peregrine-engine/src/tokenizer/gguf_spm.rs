//! `tokenizer.ggml.model = llama`: SentencePiece vocabularies stored with scores and no merges
//! (Llama 1/2, Gemma). llama.cpp's `llm_tokenizer_spm_session` repeatedly merges the adjacent pair
//! whose concatenation is the highest-scoring token; a BPE whose merges are "every split of a token
//! into two tokens, ranked by the token's score" does the same, so it is built here for
//! `tokenizers` with byte fallback (`<0xNN>`) for characters outside the vocabulary.

use std::collections::HashMap;

use peregrine_tensor::candle::quantized::gguf_file::Value;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{
    NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence,
};

use super::TokenizerError;
use super::gguf::{GgufVocab, boolean, build_error, missing};

const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
/// SentencePiece's escaped space.
const SPACE: &str = "\u{2581}";

/// Builds the byte-fallback BPE equivalent of the SentencePiece vocabulary.
pub(super) fn build(
    md: &HashMap<String, Value>,
    vocab: &GgufVocab,
    unk: Option<u32>,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let scores = vocab.scores.as_deref().ok_or_else(|| missing(KEY_SCORES))?;
    // llama.cpp prepends a space to each piece of text that starts the prompt or follows a special token.
    let add_space_prefix = boolean(md, KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);
    let err = build_error("llama");

    let mut ids = Vocab::with_capacity(vocab.tokens.len());
    for (i, token) in vocab.tokens.iter().enumerate() {
        ids.insert(token.clone(), i as u32);
    }
    let merges = merges_from_scores(&vocab.tokens, scores, &ids);
    let mut builder = BPE::builder()
        .vocab_and_merges(ids, merges)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(vocab.tokens[unk as usize].clone());
    }
    let bpe = builder.build().map_err(&err)?;

    let escape: NormalizerWrapper = Replace::new(" ", SPACE).map_err(&err)?.into();
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new(SPACE.to_owned()).into(), escape]).into()
    } else {
        escape
    };
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE, " ").map_err(&err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        // Undo the prefix space of the first piece, as llama.cpp's detokenizer does.
        decoders.push(Strip::new(' ', 1, 0).into());
    }

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(Some(normalizer)).map_err(&err)?;
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    tok.add_special_tokens(vocab.added_tokens()).map_err(&err)?;
    Ok(tok)
}

/// Every split of a token into two in-vocabulary tokens, highest-scoring merged token first (ties:
/// lower id, then shorter left part, to keep the order deterministic).
fn merges_from_scores(tokens: &[String], scores: &[f32], ids: &Vocab) -> Vec<(String, String)> {
    let mut ranked: Vec<(f32, u32, u32)> = Vec::with_capacity(tokens.len() * 4);
    for (id, token) in tokens.iter().enumerate() {
        // Duplicated texts map to their last id, as in llama.cpp's `token_to_id`.
        if ids.get(token.as_str()) != Some(&(id as u32)) {
            continue;
        }
        for (split, _) in token.char_indices().skip(1) {
            let (a, b) = token.split_at(split);
            if ids.contains_key(a) && ids.contains_key(b) {
                ranked.push((scores[id], id as u32, split as u32));
            }
        }
    }
    ranked.sort_unstable_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    ranked
        .into_iter()
        .map(|(_, id, split)| {
            let (a, b) = tokens[id as usize].split_at(split as usize);
            (a.to_owned(), b.to_owned())
        })
        .collect()
}
