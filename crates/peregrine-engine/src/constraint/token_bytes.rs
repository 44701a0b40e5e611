//! Each token's bytes, for llguidance's token trie: the vocabulary strings undone the way the
//! tokenizer's decoder undoes them (byte-level BPE's char map, or SentencePiece's `▁` and
//! `<0xNN>` byte-fallback pieces). Special tokens become `0xFF` + their name, as toktrie wants.

use std::collections::HashMap;

use llguidance::toktrie::TokTrie;
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// How a vocabulary spells bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spelling {
    /// GPT-2's byte-to-char map (`Ġ` is a space).
    ByteLevel,
    /// Pieces are text, `space` stands for ' ', `<0xNN>` is one raw byte.
    ByteFallback { space: char },
}

/// The bytes of every id in `0..vocab_size`, or why the vocabulary's spelling is unknown.
pub(super) fn token_bytes(tok: &Tokenizer) -> Result<Vec<Vec<u8>>, String> {
    let inner = tok.inner();
    let decoder = serde_json::to_value(inner.get_decoder()).unwrap_or(Value::Null);
    let spelling = spelling(&decoder).ok_or_else(|| {
        format!("the tokenizer's decoder is neither byte-level nor byte-fallback: {decoder}")
    })?;
    let specials: HashMap<u32, String> = (inner.get_added_tokens_decoder().into_iter())
        .filter(|(_, t)| t.special || (t.content.starts_with('<') && t.content.ends_with('>')))
        .map(|(id, t)| (id, t.content))
        .collect();
    let char_map = byte_level_chars();
    let out = (0..tok.vocab_size() as u32)
        .map(|id| {
            if let Some(name) = specials.get(&id) {
                let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                bytes.extend_from_slice(name.as_bytes());
                return bytes;
            }
            let Some(piece) = inner.id_to_token(id) else {
                return vec![];
            };
            match spelling {
                // A piece with a char outside the map (a plain added token) is its own text.
                Spelling::ByteLevel => (piece.chars().map(|c| char_map.get(&c).copied()))
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| piece.into_bytes()),
                Spelling::ByteFallback { space } => match fallback_byte(&piece) {
                    Some(b) => vec![b],
                    None => piece.replace(space, " ").into_bytes(),
                },
            }
        })
        .collect();
    Ok(out)
}

/// Reads the spelling off the decoder's JSON (walking `Sequence`s).
fn spelling(decoder: &Value) -> Option<Spelling> {
    let (mut byte_level, mut fallback, mut space) = (false, false, ' ');
    walk(decoder, &mut |d| match d["type"].as_str() {
        Some("ByteLevel") => byte_level = true,
        Some("ByteFallback") => fallback = true,
        Some("Replace") if d["content"] == " " => {
            if let Some(c) = d["pattern"]["String"].as_str().and_then(single_char) {
                space = c;
            }
        }
        _ => {}
    });
    match (byte_level, fallback) {
        (true, _) => Some(Spelling::ByteLevel),
        (false, true) => Some(Spelling::ByteFallback { space }),
        (false, false) => None,
    }
}

fn walk(d: &Value, visit: &mut impl FnMut(&Value)) {
    visit(d);
    for inner in d["decoders"].as_array().into_iter().flatten() {
        walk(inner, visit);
    }
}

fn single_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) => Some(c),
        _ => None,
    }
}

/// `<0xNN>` → the byte NN.
fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// GPT-2's map from the printable char standing for a byte back to the byte.
fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                let c = char::from_u32(next).expect("below the surrogates");
                next += 1;
                (c, b)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_chars_invert_gpt2() {
        let map = byte_level_chars();
        assert_eq!(map[&'Ġ'], b' ');
        assert_eq!(map[&'Ċ'], b'\n');
        assert_eq!(map[&'a'], b'a');
        assert_eq!(map.len(), 256);
    }

    #[test]
    fn fallback_bytes_parse() {
        assert_eq!(fallback_byte("<0x0A>"), Some(b'\n'));
        assert_eq!(fallback_byte("<0x0>"), None);
        assert_eq!(fallback_byte("<0xZZ>"), None);
        assert_eq!(fallback_byte("hello"), None);
    }

    #[test]
    fn spelling_reads_sentencepiece_decoders() {
        let d = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
        ]});
        assert_eq!(spelling(&d), Some(Spelling::ByteFallback { space: '▁' }));
        let d = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false});
        assert_eq!(spelling(&d), Some(Spelling::ByteLevel));
        assert_eq!(spelling(&serde_json::json!({"type": "WordPiece"})), None);
    }
}
