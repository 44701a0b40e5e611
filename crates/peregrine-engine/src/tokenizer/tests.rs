//! Unit tests on tiny hand-made vocabularies (the parity tests against llama.cpp and HF are in
//! `tests/tokenizer.rs`).

use std::collections::HashMap;

use peregrine_tensor::candle::quantized::gguf_file::Value;

use super::{Tokenizer, TokenizerError};

fn strings(items: &[&str]) -> Value {
    Value::Array(
        items
            .iter()
            .map(|s| Value::String((*s).to_owned()))
            .collect(),
    )
}

/// GPT-2's printable stand-in for each byte (`bytes_to_unicode`).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap()
}

/// A byte-level BPE vocabulary: 256 bytes, then `he`, `Ġt`, `Ġthe`, `12`, `<|im_start|>`, `<|im_end|>`.
fn gpt2_metadata(pre: &str) -> HashMap<String, Value> {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    tokens.extend(["he", "Ġt", "Ġthe", "12", "<|im_start|>", "<|im_end|>"].map(String::from));
    let mut types = vec![Value::I32(1); 260];
    types.extend([Value::I32(3), Value::I32(3)]);
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    );
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
    md.insert(
        "tokenizer.ggml.merges".into(),
        strings(&["h e", "Ġ t", "Ġt he", "1 2"]),
    );
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(260));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(261));
    md.insert(
        "tokenizer.chat_template".into(),
        Value::String("{{ messages }}".into()),
    );
    md
}

/// llama.cpp's converter pads Qwen's token list with unused `[PADn]` entries up to the
/// embedding's rows: they stay outside the vocabulary (generation never draws them, their ids
/// do not decode), as the rows past an HF tokenizer's ids do.
#[test]
fn trailing_unused_tokens_are_padding() {
    let mut md = gpt2_metadata("qwen2");
    let push = |md: &mut HashMap<String, Value>, key: &str, value: Value| {
        if let Some(Value::Array(items)) = md.get_mut(key) {
            items.push(value);
        }
    };
    for i in 262..266 {
        push(
            &mut md,
            "tokenizer.ggml.tokens",
            Value::String(format!("[PAD{i}]")),
        );
        push(&mut md, "tokenizer.ggml.token_type", Value::I32(5));
    }
    let tok = Tokenizer::from_gguf(&md).unwrap();
    assert_eq!(tok.vocab_size(), 262);
    assert!(tok.decode(&[263], false).is_err());
}

fn byte_id(b: u8) -> u32 {
    u32::from(b)
}

#[test]
fn gpt2_merges_and_no_prefix_space() {
    let tok = Tokenizer::from_gguf(&gpt2_metadata("gpt-2")).unwrap();
    assert_eq!(
        tok.encode("the the", false).unwrap(),
        vec![byte_id(b't'), 256, 258]
    );
    assert_eq!(tok.encode("12", false).unwrap(), vec![259]);
    assert_eq!(
        tok.decode(&[byte_id(b't'), 256, 258], false).unwrap(),
        "the the"
    );
    assert_eq!(tok.vocab_size(), 262);
    assert!(format!("{tok:?}").starts_with("Tokenizer { vocab_size: 262,"));
    assert_eq!(tok.chat_template(), Some("{{ messages }}"));
}

#[test]
fn gpt2_smollm_splits_digits() {
    // smollm isolates every digit before the word regex, so the `1 2` merge never applies.
    let tok = Tokenizer::from_gguf(&gpt2_metadata("smollm")).unwrap();
    assert_eq!(
        tok.encode("12", false).unwrap(),
        vec![byte_id(b'1'), byte_id(b'2')]
    );
}

#[test]
fn gpt2_pre_types_follow_llama_cpp() {
    let mut md = gpt2_metadata("llama-bpe");
    md.insert("tokenizer.ggml.merges".into(), strings(&["h e"]));
    // llama-bpe: `12` is one word and a token, so ignore_merges emits it without any merge; BOS on.
    let tok = Tokenizer::from_gguf(&md).unwrap();
    assert_eq!(tok.encode("12", true).unwrap(), vec![260, 259]);
    md.insert("tokenizer.ggml.pre".into(), Value::String("gpt-2".into()));
    let tok = Tokenizer::from_gguf(&md).unwrap();
    assert_eq!(
        tok.encode("12", true).unwrap(),
        vec![byte_id(b'1'), byte_id(b'2')]
    );
    // qwen2 splits numbers into single digits even when a merge would join them.
    let tok = Tokenizer::from_gguf(&gpt2_metadata("qwen2")).unwrap();
    assert_eq!(
        tok.encode("12", false).unwrap(),
        vec![byte_id(b'1'), byte_id(b'2')]
    );
}

#[test]
fn gpt2_special_tokens_are_parsed_and_end_generation() {
    let tok = Tokenizer::from_gguf(&gpt2_metadata("smollm")).unwrap();
    let ids = tok.encode("<|im_start|>he<|im_end|>", true).unwrap();
    assert_eq!(
        ids,
        vec![260, 256, 261],
        "BOS is not added: gpt2 defaults to add_bos false"
    );
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>he<|im_end|>");
    assert_eq!(tok.decode(&ids, true).unwrap(), "he");
    assert_eq!(tok.eos_ids(), &[261]);
    assert!(tok.is_eos(261) && !tok.is_eos(260));
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
}

#[test]
fn gpt2_errors_name_the_key() {
    let err = Tokenizer::from_gguf(&gpt2_metadata("no-such-pre")).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.pre"), "{err}");
    let mut md = gpt2_metadata("smollm");
    md.remove("tokenizer.ggml.merges");
    let err = Tokenizer::from_gguf(&md).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");
    md.insert("tokenizer.ggml.model".into(), Value::String("t5".into()));
    let err = Tokenizer::from_gguf(&md).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.model"), "{err}");
}

/// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, 256 byte tokens, then scored pieces.
fn spm_metadata(add_space_prefix: Option<bool>) -> HashMap<String, Value> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    // Higher score merges first: `ll`, then `he`, `▁he`, `llo`, `▁hello`; `▁hel` never forms.
    let pieces = [
        ("▁", -10.0),
        ("h", -11.0),
        ("e", -12.0),
        ("l", -13.0),
        ("o", -14.0),
        ("ll", -1.0),
        ("he", -2.0),
        ("▁he", -3.0),
        ("llo", -4.0),
        ("▁hello", -5.0),
        ("▁hel", -6.0),
        ("<end_of_turn>", 0.0),
    ];
    for (piece, score) in pieces {
        tokens.push(piece.into());
        types.push(if piece.starts_with('<') { 3 } else { 1 });
        scores.push(score);
    }
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(types.into_iter().map(Value::I32).collect()),
    );
    md.insert(
        "tokenizer.ggml.scores".into(),
        Value::Array(scores.into_iter().map(Value::F32).collect()),
    );
    if let Some(v) = add_space_prefix {
        md.insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(v));
    }
    md
}

/// Id of a piece in [`spm_metadata`].
fn piece(tok: &Tokenizer, text: &str) -> u32 {
    tok.token_to_id(text)
        .unwrap_or_else(|| panic!("{text} not in vocab"))
}

#[test]
fn spm_merges_follow_scores() {
    let tok = Tokenizer::from_gguf(&spm_metadata(None)).unwrap();
    assert_eq!(
        tok.encode("hello", false).unwrap(),
        vec![piece(&tok, "▁hello")]
    );
    let hell = tok.encode("hell", false).unwrap();
    assert_eq!(hell, vec![piece(&tok, "▁he"), piece(&tok, "ll")]);
    assert_eq!(tok.decode(&hell, false).unwrap(), "hell");
}

#[test]
fn spm_bos_byte_fallback_and_specials() {
    let tok = Tokenizer::from_gguf(&spm_metadata(None)).unwrap();
    assert!(tok.add_bos());
    assert_eq!(tok.bos_id(), Some(1));
    // `é` is not a piece: its UTF-8 bytes C3 A9 come out as byte tokens (id 3 + byte).
    let ids = tok.encode("é", true).unwrap();
    assert_eq!(ids, vec![1, piece(&tok, "▁"), 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "é");
    // A special token resets the prefix space, as in llama.cpp.
    let turn = piece(&tok, "<end_of_turn>");
    let ids = tok.encode("he<end_of_turn>he", false).unwrap();
    assert_eq!(ids, vec![piece(&tok, "▁he"), turn, piece(&tok, "▁he")]);
    assert_eq!(tok.eos_ids(), &[2, turn]);
    assert_eq!(tok.encode("", true).unwrap(), vec![1]);
}

#[test]
fn spm_without_space_prefix() {
    let tok = Tokenizer::from_gguf(&spm_metadata(Some(false))).unwrap();
    let ids = tok.encode("he hello", false).unwrap();
    assert_eq!(ids, vec![piece(&tok, "he"), piece(&tok, "▁hello")]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "he hello");
    let err = tok.decode(&[100_000], false).unwrap_err();
    assert!(matches!(err, TokenizerError::Decode { .. }), "{err}");
}

#[test]
fn spm_requires_scores() {
    let mut md = spm_metadata(None);
    md.remove("tokenizer.ggml.scores");
    let err = Tokenizer::from_gguf(&md).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");
}

#[test]
fn from_dir_reads_side_files() {
    let dir = std::env::temp_dir().join(format!("peregrine-tokenizer-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let built = Tokenizer::from_gguf(&spm_metadata(Some(false))).unwrap();
    built
        .inner()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let config = serde_json::json!({
        "bos_token": {"content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "add_bos_token": true,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [2, 270]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2, 270]);
    assert_eq!(tok.chat_template(), Some("D"));
    assert_eq!(tok.encode("he", true).unwrap(), vec![1, piece(&tok, "he")]);

    std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": 2}"#).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.chat_template(), Some("J"));
    assert_eq!(tok.eos_ids(), &[2]);

    // Without `add_bos_token`, BOS follows tokenizer.json's post-processor (Llama 3 style).
    let mut inner = built.inner().clone();
    let template = tokenizers::processors::template::TemplateProcessing::builder()
        .try_single("<s> $A")
        .unwrap()
        .special_tokens(vec![("<s>", 1)])
        .build()
        .unwrap();
    inner.with_post_processor(Some(template));
    inner.save(dir.join("tokenizer.json"), false).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"bos_token": "<s>"}"#).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert!(tok.add_bos() && !tok.add_eos());
    assert_eq!(tok.encode("he", true).unwrap(), vec![1, piece(&tok, "he")]);
    assert_eq!(tok.encode("he", false).unwrap(), vec![piece(&tok, "he")]);

    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"add_bos_token": "yes"}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
