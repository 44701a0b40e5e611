//! Tokenizer parity: Peregrine's ids against llama.cpp's on the real GGUF files (SmolLM2 `gpt2`,
//! Gemma 3 `llama`) and against HF `tokenizers` on the fixture tokenizer.json, for the strings
//! recorded in tests/data/tokenizer/*.json by scripts/record_tokenizer_parity.py.
//!
//! The GGUF tests need the models cache filled by scripts/fetch-models.sh and fail when it is not.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use peregrine_engine::tokenizer::Tokenizer;
use peregrine_tensor::candle::quantized::gguf_file;
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    ids_add_special: Vec<u32>,
    detok: String,
}

#[derive(Deserialize)]
struct Recorded {
    vocab_size: usize,
    #[serde(default)]
    bos_id: Option<i64>,
    #[serde(default)]
    add_bos: Option<bool>,
    #[serde(default)]
    eog_ids: Option<Vec<u32>>,
    cases: Vec<Case>,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn recorded(name: &str) -> Recorded {
    let path = repo_root()
        .join("tests/data/tokenizer")
        .join(format!("{name}.json"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models}`, as scripts/fetch-models.sh uses it.
fn models_dir() -> PathBuf {
    match std::env::var_os("PEREGRINE_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is not set"))
            .join(".cache/peregrine/models"),
    }
}

fn gguf_tokenizer(file: &str) -> Tokenizer {
    let path = models_dir().join(file);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (or point PEREGRINE_MODELS at a cache that has it)",
        path.display()
    );
    let mut reader = std::fs::File::open(&path).unwrap();
    let content =
        gguf_file::Content::read(&mut reader).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let start = Instant::now();
    let tok = Tokenizer::from_gguf(&content.metadata).unwrap_or_else(|e| panic!("{file}: {e}"));
    eprintln!(
        "{file}: tokenizer built in {:.3} s",
        start.elapsed().as_secs_f64()
    );
    tok
}

/// Compares encode (with and without special tokens) and decode on every recorded string and
/// reports all mismatches at once.
fn check_cases(name: &str, tok: &Tokenizer, rec: &Recorded) {
    assert_eq!(tok.vocab_size(), rec.vocab_size, "{name}: vocabulary size");
    let mut failures = Vec::new();
    for case in &rec.cases {
        let text = &case.text;
        let ids = tok.encode(text, false).unwrap();
        if ids != case.ids {
            failures.push(format!(
                "encode {text:?}: got {ids:?}, expected {:?}",
                case.ids
            ));
        }
        let ids = tok.encode(text, true).unwrap();
        if ids != case.ids_add_special {
            failures.push(format!(
                "encode+special {text:?}: got {ids:?}, expected {:?}",
                case.ids_add_special
            ));
        }
        let decoded = tok.decode(&case.ids, false).unwrap();
        if decoded != case.detok {
            failures.push(format!(
                "decode {:?}: got {decoded:?}, expected {:?}",
                case.ids, case.detok
            ));
        }
        if case.detok == *text && decoded != *text {
            failures.push(format!("round trip {text:?}: got {decoded:?}"));
        }
    }
    eprintln!(
        "{name}: {} strings, {} mismatches",
        rec.cases.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{name}: {} mismatches over {} strings:\n{}",
        failures.len(),
        rec.cases.len(),
        failures.join("\n")
    );
}

/// BOS, add_bos and the end-of-generation set as llama.cpp reports them.
fn check_specials(name: &str, tok: &Tokenizer, rec: &Recorded) {
    assert_eq!(
        tok.bos_id().map(i64::from),
        rec.bos_id.filter(|&id| id >= 0),
        "{name}: BOS id"
    );
    assert_eq!(Some(tok.add_bos()), rec.add_bos, "{name}: add_bos");
    let ours: BTreeSet<u32> = tok.eos_ids().iter().copied().collect();
    let theirs: BTreeSet<u32> = rec
        .eog_ids
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    assert_eq!(ours, theirs, "{name}: end-of-generation ids");
}

#[test]
fn smollm2_gguf_matches_llama_cpp() {
    let tok = gguf_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf");
    let rec = recorded("smollm2_llamacpp");
    check_specials("smollm2", &tok, &rec);
    check_cases("smollm2", &tok, &rec);
    assert!(
        tok.chat_template()
            .is_some_and(|t| t.contains("<|im_start|>"))
    );
}

#[test]
fn gemma3_gguf_matches_llama_cpp() {
    let tok = gguf_tokenizer("gemma-3-270m-q4_k_m.gguf");
    let rec = recorded("gemma3_llamacpp");
    check_specials("gemma3", &tok, &rec);
    check_cases("gemma3", &tok, &rec);
}

#[test]
fn hf_fixture_matches_hf_tokenizers() {
    let dir = repo_root().join("tests/fixtures/llama/hf");
    let tok = Tokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let rec = recorded("hf_fixture_llama");
    check_cases("hf_fixture_llama", &tok, &rec);
    assert!(!tok.add_bos());
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert!(tok.is_eos(tok.token_to_id("<|im_end|>").unwrap()));
    assert!(
        tok.chat_template()
            .is_some_and(|t| t.contains("<|im_start|>"))
    );
}
