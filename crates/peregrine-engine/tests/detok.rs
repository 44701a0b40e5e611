//! Incremental detokenization against real `tokenizers` tokenizers built in code: byte-level BPE
//! (GPT-2/Qwen/Llama-3 family) and SentencePiece-style BPE with byte fallback (Llama-2 family).

use peregrine_engine::detok::IncrementalDetokenizer;
use serde_json::{Map, Value, json};
use tokenizers::Tokenizer;

/// GPT-2's reversible byte-to-char map, indexed by byte.
fn byte_chars() -> Vec<char> {
    let mut bytes: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut chars = bytes.clone();
    let mut extra = 0;
    for b in 0..256 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in bytes.iter().zip(chars) {
        map[*b as usize] = char::from_u32(c).unwrap();
    }
    map
}

/// A BPE model whose vocabulary is `base` plus every merge result, in that order.
fn bpe(base: Vec<String>, merges: &[(String, String)], sentencepiece: bool) -> Value {
    let mut vocab = Map::new();
    for t in base
        .into_iter()
        .chain(merges.iter().map(|(a, b)| format!("{a}{b}")))
    {
        let id = vocab.len();
        vocab.entry(t).or_insert(json!(id));
    }
    let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    json!({"type": "BPE", "dropout": null, "unk_token": if sentencepiece { json!("<unk>") } else { json!(null) },
        "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": sentencepiece,
        "byte_fallback": sentencepiece, "vocab": vocab, "merges": merges})
}

fn build(model: Value, normalizer: Value, pre: Value, decoder: Value) -> Tokenizer {
    let j = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": null,
        "decoder": decoder, "model": model});
    j.to_string().parse().expect("tokenizer json")
}

/// Byte-level BPE with merges that split multi-byte characters mid-way (the first two bytes of
/// an emoji, the lead byte of "é" with "h").
fn byte_level() -> Tokenizer {
    let m = byte_chars();
    let s = |bytes: &[u8]| bytes.iter().map(|&b| m[b as usize]).collect::<String>();
    let merges: Vec<(String, String)> = [
        (&b"h"[..], &b"e"[..]),
        (b"he", b"l"),
        (b"hel", b"l"),
        (b" ", b"w"),
        (b"\xf0", b"\x9f"),
        (b"h", b"\xc3"),
        (b"\xe4", b"\xbd"),
    ]
    .iter()
    .map(|(a, b)| (s(a), s(b)))
    .collect();
    let base = (0..=255u8).map(|b| s(&[b])).collect();
    let bl = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    build(bpe(base, &merges, false), Value::Null, bl.clone(), bl)
}

/// Llama-2 style: "▁" for spaces, byte fallback for unknown characters, and a decoder that strips
/// the leading space of whatever it decodes.
fn sentencepiece() -> Tokenizer {
    let mut base: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    base.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    base.extend("▁Helowrdi".chars().map(String::from));
    let merges: Vec<(String, String)> = [
        ("▁", "H"),
        ("l", "l"),
        ("e", "ll"),
        ("▁H", "ell"),
        ("▁Hell", "o"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("▁wor", "l"),
        ("▁worl", "d"),
        ("▁H", "i"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    let normalizer = json!({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
    let decoder = json!({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]});
    build(bpe(base, &merges, true), normalizer, Value::Null, decoder)
}

fn ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).expect("encode").get_ids().to_vec()
}

/// Streams `generated` after `tail` and returns the deltas plus the final flush.
fn stream(tok: &Tokenizer, tail: &[u32], generated: &[u32]) -> (Vec<String>, String) {
    let decode = |ids: &[u32]| tok.decode(ids, false);
    let mut d = IncrementalDetokenizer::new(tail);
    let deltas = generated
        .iter()
        .map(|&id| d.step(id, decode).unwrap())
        .collect();
    (deltas, d.finish(decode).unwrap())
}

#[test]
fn byte_level_multibyte_characters_split_across_tokens() {
    let tok = byte_level();
    let text = "hello wörld 🦀 hé 你好!";
    let generated = ids(&tok, text);
    // The emoji alone is two tokens (F0 9F merged, then A6 and 80): more than one token per char.
    assert!(generated.len() > text.chars().count() - 4, "{generated:?}");
    assert_eq!(tok.decode(&generated, false).unwrap(), text);
    let (deltas, rest) = stream(&tok, &[], &generated);
    assert_eq!(deltas.concat() + &rest, text);
    assert_eq!(rest, "");
    assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    // Nothing is held longer than needed: the crab appears with the token that completes it.
    let crab = deltas.iter().position(|d| d.contains('🦀')).unwrap();
    let prefix = tok.decode(&generated[..=crab], false).unwrap();
    assert!(prefix.ends_with('🦀'), "{prefix}");
}

#[test]
fn byte_level_with_prompt_tail_matches_decode() {
    let tok = byte_level();
    let prompt = ids(&tok, "say hé");
    let generated = ids(&tok, " 🦀 wörld");
    let (deltas, rest) = stream(&tok, &prompt[prompt.len().saturating_sub(5)..], &generated);
    assert_eq!(
        deltas.concat() + &rest,
        tok.decode(&generated, false).unwrap()
    );
}

#[test]
fn incomplete_character_is_flushed_by_finish() {
    let tok = byte_level();
    let generated = ids(&tok, "ab🦀");
    // Stop one token before the emoji completes: the full decode ends in U+FFFD, so must we.
    let cut = &generated[..generated.len() - 1];
    let (deltas, rest) = stream(&tok, &[], cut);
    assert_eq!(deltas.concat(), "ab");
    assert_eq!(deltas.concat() + &rest, tok.decode(cut, false).unwrap());
    assert!(rest.ends_with('\u{FFFD}'));
}

#[test]
fn sentencepiece_leading_space_and_byte_fallback() {
    let tok = sentencepiece();
    let generated = ids(&tok, "Hello world é");
    assert_eq!(tok.decode(&generated, false).unwrap(), "Hello world é");
    // Decoding one token at a time loses every space: the reason for the window.
    let naive: String = generated
        .iter()
        .map(|&id| tok.decode(&[id], false).unwrap())
        .collect();
    assert_ne!(naive, "Hello world é");
    let (deltas, rest) = stream(&tok, &[], &generated);
    assert_eq!(deltas.concat() + &rest, "Hello world é");
    assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    // After a prompt, the first generated word keeps its space.
    let prompt = ids(&tok, "Hi");
    let generated = ids(&tok, "world");
    let (deltas, rest) = stream(&tok, &prompt, &generated);
    assert_eq!(deltas.concat() + &rest, " world");
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    assert_eq!(
        tok.decode(&all, false).unwrap(),
        format!("Hi{}", deltas.concat())
    );
}

#[test]
fn decode_errors_propagate() {
    let mut d = IncrementalDetokenizer::new(&[]);
    let r = d.step(1, |_| Err::<String, _>("boom"));
    assert_eq!(r, Err("boom"));
}

#[test]
fn llama_fixture_tokenizer() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/llama/hf/tokenizer.json"
    );
    let Ok(tok) = Tokenizer::from_file(path) else {
        eprintln!(
            "skipping llama_fixture_tokenizer: {path} is missing (generated by the fixture scripts)"
        );
        return;
    };
    let text = "Hello world! héllo wörld 🦀🦀 你好, 世界 — done.";
    let prompt = ids(&tok, "User: say it");
    let generated = ids(&tok, text);
    let (deltas, rest) = stream(&tok, &[], &generated);
    assert_eq!(
        deltas.concat() + &rest,
        tok.decode(&generated, false).unwrap()
    );
    assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let tail = &prompt[prompt.len().saturating_sub(5)..];
    let (deltas, rest) = stream(&tok, tail, &generated);
    let full = tok.decode(&all, false).unwrap();
    let before = tok.decode(&prompt, false).unwrap();
    assert_eq!(before.clone() + &deltas.concat() + &rest, full);
}

#[test]
fn special_tokens_skipped_while_streaming() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/llama/hf/tokenizer.json"
    );
    let Ok(tok) = Tokenizer::from_file(path) else {
        eprintln!("skipping special_tokens_skipped_while_streaming: {path} is missing");
        return;
    };
    let generated = ids(&tok, "Paris 🦀.<|im_end|>");
    let decode = |ids: &[u32]| tok.decode(ids, true);
    let mut d = IncrementalDetokenizer::new(&[]);
    let mut text = String::new();
    for &id in &generated {
        text.push_str(&d.step(id, decode).unwrap());
    }
    text.push_str(&d.finish(decode).unwrap());
    assert_eq!(text, tok.decode(&generated, true).unwrap());
    assert_eq!(text, "Paris 🦀.");
}
