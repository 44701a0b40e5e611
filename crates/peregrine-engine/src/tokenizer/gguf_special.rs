//! Special-token facts llama.cpp derives beyond the stored ids (`llama_vocab::impl::load`):
//! token attributes, end-of-turn/FIM tokens found by their text, and the end-of-generation set.

use std::collections::HashMap;

use peregrine_tensor::candle::quantized::gguf_file::Value;

use super::TokenizerError;
use super::gguf::{GgufVocab, token_id};

const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";

/// llama.cpp token attributes (`llama_token_attr`), derived from `tokenizer.ggml.token_type`.
pub(super) mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;

    /// The attribute of a stored `token_type` (1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte); unused and undefined tokens get no attribute llama.cpp acts on.
    pub fn from_type(t: i64) -> u32 {
        match t {
            1 => NORMAL,
            2 => UNKNOWN,
            3 => CONTROL,
            4 => USER_DEFINED,
            6 => BYTE,
            _ => 0,
        }
    }
}

/// Token texts that llama.cpp takes as end-of-turn when `eot_token_id` is absent.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<end_of_utterance>",
];

/// Token texts that llama.cpp adds to the end-of-generation set whatever the metadata says.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
];

/// Fill-in-the-middle tokens: (metadata keys, texts llama.cpp detects, ends generation).
const FIM: &[(&[&str], &[&str], bool)] = &[
    (
        &[
            "tokenizer.ggml.fim_pre_token_id",
            "tokenizer.ggml.prefix_token_id",
        ],
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        &[
            "tokenizer.ggml.fim_suf_token_id",
            "tokenizer.ggml.suffix_token_id",
        ],
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        &[
            "tokenizer.ggml.fim_mid_token_id",
            "tokenizer.ggml.middle_token_id",
        ],
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        &["tokenizer.ggml.fim_pad_token_id"],
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        &["tokenizer.ggml.fim_rep_token_id"],
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        true,
    ),
    (
        &["tokenizer.ggml.fim_sep_token_id"],
        &["<|file_sep|>"],
        true,
    ),
];

/// The end-of-generation ids (EOS first), marking text-detected ones as control tokens so that
/// they are parsed out of text, as llama.cpp does.
pub(super) fn end_of_generation(
    md: &HashMap<String, Value>,
    vocab: &mut GgufVocab,
    eos: Option<u32>,
) -> Result<Vec<u32>, TokenizerError> {
    let n = vocab.tokens.len() as u32;
    let mut forced = Vec::new();
    let mut eog = Vec::new();
    let eot = match token_id(md, KEY_EOT, n)? {
        Some(id) => Some(id),
        None => vocab.find(EOT_TEXTS).inspect(|&id| forced.push(id)),
    };
    let eom = match token_id(md, KEY_EOM, n)? {
        Some(id) => Some(id),
        None => vocab.find(&["<|eom_id|>"]).inspect(|&id| forced.push(id)),
    };
    for (keys, texts, ends) in FIM {
        let mut id = None;
        for key in *keys {
            id = id.or(token_id(md, key, n)?);
        }
        if id.is_none() {
            id = vocab.find(texts).inspect(|&id| forced.push(id));
        }
        if *ends {
            eog.extend(id);
        }
    }
    for (i, text) in vocab.tokens.iter().enumerate() {
        if EOG_TEXTS.contains(&text.as_str()) {
            forced.push(i as u32);
            eog.push(i as u32);
        }
    }
    for id in forced {
        vocab.attrs[id as usize] |= attr::CONTROL;
    }
    // gpt-oss: llama.cpp always renders these, i.e. makes them user-defined.
    for (text, a) in vocab.tokens.iter().zip(vocab.attrs.iter_mut()) {
        if matches!(
            text.as_str(),
            "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
        ) {
            *a = attr::USER_DEFINED;
        }
    }
    eog.extend(eot);
    eog.extend(eom);
    eog.sort_unstable();
    eog.dedup();
    let tokens = &vocab.tokens;
    let find = |eog: &[u32], s: &str| eog.iter().position(|&id| tokens[id as usize] == s);
    // o200k_harmony and solar-open: `<|end|>` ends a message, not generation.
    let call = find(&eog, "<|call|>").or(find(&eog, "<|calls|>")).is_some();
    let ret = find(&eog, "<|return|>")
        .or(find(&eog, "<|flush|>"))
        .is_some();
    if call
        && ret
        && let Some(i) = find(&eog, "<|end|>")
    {
        vocab.attrs[eog.remove(i) as usize] = attr::USER_DEFINED;
    }
    // gemma4 and paddleocr: `</s>` is text when `<|tool_response>` exists.
    if find(&eog, "<|tool_response>").is_some()
        && let Some(i) = find(&eog, "</s>")
    {
        vocab.attrs[eog.remove(i) as usize] = attr::NORMAL;
    }
    let mut ids: Vec<u32> = eos.into_iter().collect();
    ids.extend(eog);
    Ok(ids)
}
