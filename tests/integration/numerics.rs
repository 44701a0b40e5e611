//! Real-GGUF numerics: Peregrine's logits against the exact reference of each file (transformers
//! in f32 on the GGUF's tensors dequantized), no further from it than llama.cpp's on the same
//! file, on both real models over several prompts (recorded by `scripts/gguf_numerics.py
//! --record`; see tests/data/numerics/README.md). Each comparison is on equal terms: our KV cache
//! in f32 against llama.cpp's in f32, and in f16 (llama.cpp's default) against its f16.

use peregrine::Engine;
use peregrine::engine::tensor::{D, DType};
use peregrine::engine::{EngineConfig, KvOptions};

use crate::common::{data_json, ids, real_model};

/// Little-endian i16s from base64 (the recorded logits, `round(logit · scale)`).
fn i16s_from_base64(text: &str) -> Vec<i16> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let mut bytes = Vec::with_capacity(text.len() / 4 * 3);
    for quad in text.trim_end_matches('=').as_bytes().chunks(4) {
        let n =
            quad.iter().fold(0u32, |n, &c| n << 6 | u32::from(value(c))) << (6 * (4 - quad.len()));
        bytes.extend(&n.to_be_bytes()[1..quad.len()]);
    }
    bytes
        .chunks_exact(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// Mean |logit error| over the recorded vocabulary sample and top-1 agreement (full vocabulary)
/// of `engine` against the reference in `data`.
fn against_reference(engine: &Engine, data: &serde_json::Value) -> (f64, f64) {
    let sample: Vec<usize> = ids(&data["sample_ids"])
        .iter()
        .map(|&i| i as usize)
        .collect();
    let scale = data["scale"].as_f64().unwrap();
    let (mut err, mut values, mut agree, mut positions) = (0f64, 0usize, 0usize, 0usize);
    for case in data["cases"].as_array().unwrap() {
        let tokens = ids(&case["ids"]);
        let top1 = ids(&case["ref_top1"]);
        let reference = i16s_from_base64(case["ref_sample"].as_str().unwrap());
        assert_eq!(reference.len(), tokens.len() * sample.len());
        let logits = engine.logits(&tokens, 0..tokens.len()).unwrap();
        let ours = logits.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap();
        let rows = logits.to_vec2::<f32>().unwrap();
        for (p, row) in rows.iter().enumerate() {
            for (j, &id) in sample.iter().enumerate() {
                let want = f64::from(reference[p * sample.len() + j]) / scale;
                err += (f64::from(row[id]) - want).abs();
            }
            values += sample.len();
            agree += usize::from(ours[p] == top1[p]);
            positions += 1;
        }
    }
    (err / values as f64, agree as f64 / positions as f64)
}

fn check(data: &str) {
    let data = data_json(data);
    let file = data["model"].as_str().unwrap();
    let positions = data["positions"].as_u64().unwrap();
    assert!(positions >= 512, "{positions} positions recorded");
    for (kv, dtype) in [("f32", None), ("f16", Some(DType::F16))] {
        let config = EngineConfig {
            kv: KvOptions {
                dtype,
                ..KvOptions::default()
            },
            ..Default::default()
        };
        let engine = Engine::load(&real_model(file), config).expect("model loads");
        let (err, top1) = against_reference(&engine, &data);
        let bar = &data["llama_cpp"][kv];
        let (their_err, their_top1) = (
            bar["sample_err"].as_f64().unwrap(),
            bar["top1"].as_f64().unwrap(),
        );
        eprintln!(
            "{file}, KV {kv}, {positions} positions: mean |logit error| {err:.4} (llama.cpp \
             {their_err:.4}), top-1 agreement {top1:.4} (llama.cpp {their_top1:.4})"
        );
        assert!(
            err <= their_err,
            "KV {kv}: error {err} > llama.cpp's {their_err}"
        );
        assert!(
            top1 >= their_top1,
            "KV {kv}: top-1 {top1} < llama.cpp's {their_top1}"
        );
    }
}

/// SmolLM2-135M-Instruct Q4_1 (Q4_1 layers, Q8_0 embeddings and output), 20 chat prompts.
#[test]
fn smollm2_logits_are_as_close_to_the_reference_as_llama_cpps() {
    check("numerics/smollm2.json");
}

/// Gemma 3 270M Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K layers, Q8_0 output), 30 text prompts.
#[test]
fn gemma3_logits_are_as_close_to_the_reference_as_llama_cpps() {
    check("numerics/gemma3.json");
}
