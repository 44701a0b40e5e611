//! The tokenizer of an HF checkpoint as GGUF `tokenizer.ggml.*` metadata (byte-level BPE).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use peregrine_engine::tensor::candle::quantized::gguf_file::Value;
use serde_json::Value as Json;

/// The pre-tokenizer regexes llama.cpp knows by name (`tokenizer.ggml.pre`), as tokenizer.json
/// spells them.
const PRE_NAMES: &[(&str, &str)] = &[
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe",
    ),
];

/// `tokenizer.ggml.*` from tokenizer.json (+ tokenizer_config.json for BOS/EOS and the chat
/// template). Only byte-level BPE is transcribed: SentencePiece models would need scores and
/// token types that tokenizer.json does not carry in the same form.
pub(super) fn tokenizer_metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Value)>> {
    let path = dir.join("tokenizer.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{}: cannot read (the GGUF loader takes the tokenizer from the file)",
            path.display()
        )
    })?;
    let tok: Json =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let unsupported = |why: &str| {
        anyhow::anyhow!(
            "{}: {why}; only byte-level BPE tokenizers can be written into GGUF",
            path.display()
        )
    };
    let model = &tok["model"];
    if model["type"] != "BPE" {
        return Err(unsupported("the model is not BPE"));
    }
    let pre =
        pre_name(&tok["pre_tokenizer"]).ok_or_else(|| unsupported("unknown pre-tokenizer"))?;

    // Token texts by id: the BPE vocabulary, then added tokens; holes and the rows past the
    // tokenizer (embedding tables are often padded) get llama.cpp's `[PAD{id}]` names.
    let mut texts: BTreeMap<usize, (String, i32)> = BTreeMap::new();
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| unsupported("`model.vocab` is not an object"))?;
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| unsupported("a vocabulary id is not an integer"))?;
        texts.insert(id as usize, (text.clone(), 1)); // 1: normal
    }
    for added in tok["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) else {
            return Err(unsupported("an added token lacks `id` or `content`"));
        };
        // 3: control (special), 4: user-defined.
        let kind = if added["special"].as_bool().unwrap_or(false) {
            3
        } else {
            4
        };
        texts.insert(id as usize, (text.to_string(), kind));
    }
    let n = texts.keys().next_back().map_or(0, |&last| last + 1);
    if n > vocab_size {
        bail!(
            "{}: {n} token ids but the model has {vocab_size} embedding rows",
            path.display()
        );
    }
    let (mut tokens, mut types) = (Vec::with_capacity(vocab_size), vec![]);
    for id in 0..vocab_size {
        let (text, kind) = texts
            .remove(&id)
            .unwrap_or_else(|| (format!("[PAD{id}]"), 5)); // 5: unused
        tokens.push(Value::String(text));
        types.push(Value::I32(kind));
    }
    let merges: Vec<Value> = model["merges"]
        .as_array()
        .ok_or_else(|| unsupported("`model.merges` is not an array"))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Array(pair) if pair.len() == 2 => Ok(Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap_or_default(),
                pair[1].as_str().unwrap_or_default()
            ))),
            _ => Err(unsupported("a merge is neither `a b` nor [a, b]")),
        })
        .collect::<Result<_>>()?;

    let mut md = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ];
    // BOS/EOS/PAD and add_bos from tokenizer_config.json (token texts resolved to ids).
    let config: Json = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Json::Null);
    let id_of = |key: &str| -> Option<u32> {
        let text = match &config[key] {
            Json::String(s) => s.as_str(),
            Json::Object(o) => o.get("content")?.as_str()?,
            _ => return None,
        };
        let id = vocab.get(text).and_then(Json::as_u64).or_else(|| {
            tok["added_tokens"]
                .as_array()?
                .iter()
                .find(|a| a["content"] == text)?["id"]
                .as_u64()
        })?;
        Some(id as u32)
    };
    for (key, gguf_key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(id) = id_of(key) {
            md.push((gguf_key.into(), Value::U32(id)));
        }
    }
    md.push((
        "tokenizer.ggml.add_bos_token".into(),
        Value::Bool(config["add_bos_token"].as_bool().unwrap_or(false)),
    ));
    let template = std::fs::read_to_string(dir.join("chat_template.jinja"))
        .ok()
        .or_else(|| config["chat_template"].as_str().map(str::to_owned));
    if let Some(t) = template {
        md.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    Ok(md)
}

/// `tokenizer.ggml.pre` for a tokenizer.json `pre_tokenizer`: GPT-2's byte-level regex, or a
/// `Split` by one of [`PRE_NAMES`] followed by a regex-free `ByteLevel`.
fn pre_name(pre: &Json) -> Option<&'static str> {
    match pre["type"].as_str()? {
        "ByteLevel" if pre["use_regex"].as_bool().unwrap_or(true) => Some("gpt-2"),
        "Sequence" => {
            let steps = pre["pretokenizers"].as_array()?;
            let [split, byte_level] = steps.as_slice() else {
                return None;
            };
            if split["type"] != "Split"
                || byte_level["type"] != "ByteLevel"
                || byte_level["use_regex"].as_bool() != Some(false)
            {
                return None;
            }
            let regex = split["pattern"]["Regex"].as_str()?;
            PRE_NAMES
                .iter()
                .find(|(r, _)| *r == regex)
                .map(|(_, name)| *name)
        }
        _ => None,
    }
}
