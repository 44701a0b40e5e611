//! The decode step (`CausalLm::decode`: one token over buffers reused from token to token)
//! against `forward`, the reference path, token by token on every fixture: HF f32 weights
//! (dense matmuls through candle), MLX 4-bit (regrouped into Q4_1: the interleaved kernels),
//! MLX 8-bit (MLX8G64 blocks), MLX 3- and 6-bit (f32 activations), full and sliding-window
//! layers, f32 and f16 KV caches; and the two real GGUF models (SmolLM2 Q4_1, Gemma 3 Q4_K_M).
//!
//! Tolerance 1e-5 max abs on the logits: both paths run the same kernels on the same numbers and
//! differ at most in rounding order; measured bit-identical (0.0) everywhere but DeepSeek-V3's
//! MLA step (2.4e-6: its latent attention sums in another order) and the Qwen hybrids' bf16
//! GGUF files (7.0e-6: the MoE step and `forward` sum the bf16 experts in another order). A wrong position,
//! head order, window, norm or cache slot moves the logits by 1e-2 or more.

mod common;

use peregrine_models::{
    KvOptions, KvQuant, LoadOptions, Logits, SequenceCache, TurboOptions, load_model,
};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device};

use common::{fixture, real_model};

const TOLERANCE: f32 = 1e-5;

fn prompt(arch: &str) -> Vec<u32> {
    let r = load(fixture(arch).join("hf/reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    ids.to_vec1::<u32>().unwrap()
}

/// [`compare`] on a fixture's prompt.
fn decode_vs_forward(checkpoint: &str, kv: KvOptions) -> f32 {
    let arch = checkpoint.split('/').next().unwrap();
    let ids = prompt(arch);
    assert!(
        ids.len() > 10,
        "{checkpoint}: a prompt long enough to pass the window"
    );
    compare(&fixture(checkpoint), &ids, kv)
}

/// Prefills the first 3 of `ids`, then runs every later one through `decode` and through
/// `forward` on two caches; returns the largest logit difference.
fn compare(path: &std::path::Path, ids: &[u32], kv: KvOptions) -> f32 {
    let checkpoint = path.display();
    let model = load_model(path, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{checkpoint}: {e}"))
        .model;
    let new_cache = || SequenceCache::new(&model.cache_spec(), &kv);
    let (mut stepped, mut reference) = (new_cache(), new_cache());
    for cache in [&mut stepped, &mut reference] {
        model.forward(&ids[..3], cache, Logits::Last).unwrap();
    }
    let mut logits = Vec::new();
    let mut worst = 0f32;
    for (i, &token) in ids.iter().enumerate().skip(3) {
        model.decode(token, &mut stepped, &mut logits).unwrap();
        let want = model
            .forward(&[token], &mut reference, Logits::Last)
            .unwrap();
        let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(logits.len(), want.len(), "{checkpoint}: vocabulary");
        let diff = (logits.iter().zip(&want)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff < TOLERANCE,
            "{checkpoint} position {i}: decode differs from forward by {diff}"
        );
        worst = worst.max(diff);
    }
    assert_eq!(stepped.len(), reference.len());
    eprintln!("{checkpoint} ({kv:?}): max abs diff {worst:.2e}");
    worst
}

#[test]
fn decode_matches_forward_on_every_architecture() {
    for arch in [
        "deepseek_v3",
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "gemma4_text",
        "gemma4_text_moe",
        "mixtral",
        "phi3",
        "qwen3_moe",
        "deepseek_v3",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
    ] {
        decode_vs_forward(&format!("{arch}/hf"), KvOptions::default());
    }
}

/// The Qwen hybrids' step (their mixers through `forward` on one row, the rest of the layer in
/// the step) from GGUF and MLX files too.
#[test]
fn decode_matches_forward_on_hybrid_files() {
    for checkpoint in [
        "qwen3_next/gguf/model-bf16.gguf",
        "qwen3_5_moe/gguf/model-bf16.gguf",
        "qwen3_next/mlx-q4-g64",
        "qwen3_5/mlx-q8-g64",
        "qwen3_5_moe/mlx-q4-g64",
    ] {
        decode_vs_forward(checkpoint, KvOptions::default());
    }
}

/// Phi-3's LongRoPE across `original_max_position_embeddings` (32): the 49-token prompt's
/// decode steps rotate with the short factors up to position 31 and the long ones from 32 on,
/// in the step (`apply_rows_in_place`) as in `forward`; HF f32 weights and the Q8_0 GGUF
/// (fused matrices split into interleaved Q8_0 rows), full and partial rotary.
#[test]
fn decode_matches_forward_across_the_longrope_switch() {
    let r = load(fixture("phi3/hf/reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["long_input_ids"].to_dtype(DType::U32).unwrap();
    let ids = ids.to_vec1::<u32>().unwrap();
    assert!(ids.len() > 32);
    for checkpoint in [
        "phi3/hf",
        "phi3/gguf/model-q8_0.gguf",
        "phi3/gguf/partial-q8_0.gguf",
    ] {
        compare(&fixture(checkpoint), &ids, KvOptions::default());
    }
}

#[test]
fn decode_matches_forward_on_mlx_checkpoints() {
    for arch in ["llama", "qwen3", "qwen3_moe", "phi3"] {
        for format in [
            "mlx-q4-g32",
            "mlx-q4-g64",
            "mlx-q8-g64",
            "mlx-q3-g32",
            "mlx-q6-g128",
        ] {
            decode_vs_forward(&format!("{arch}/{format}"), KvOptions::default());
        }
    }
    for arch in ["gemma4_text", "gemma4_text_moe"] {
        for format in ["mlx-q4-g64", "mlx-q8-g64", "mlx-q4-g32"] {
            decode_vs_forward(&format!("{arch}/{format}"), KvOptions::default());
        }
    }
}

/// Q8_0 experts and the f32 router llama.cpp keeps (Qwen3-MoE; Gemma 4's fused gate+up
/// experts as llama.cpp's converter writes them; its bf16 files differ by 1.3e-5, float
/// summation order that Gemma 4's unscaled scores amplify, and are checked by golden.rs): both paths multiply the router row by row
/// (with candle's GEMM in `forward` the last bits differed, and 8-bit activation rounding
/// downstream amplified them to 1.2e-4).
#[test]
fn decode_matches_forward_on_a_moe_gguf() {
    let ids = prompt("qwen3_moe");
    compare(
        &fixture("qwen3_moe/gguf/model-q8_0.gguf"),
        &ids,
        KvOptions::default(),
    );
    // DeepSeek's Q8_0 file is left out: its MLA step sums the latent attention in another
    // order than `forward` (2.4e-6 on the f32 fixture, above), which 8-bit activation rounding
    // amplifies to 1.8e-4.
    for arch in ["gemma4_text", "gemma4_text_moe"] {
        let file = fixture(&format!("{arch}/gguf/model-q8_0.gguf"));
        compare(&file, &prompt(arch), KvOptions::default());
    }
}

#[test]
fn decode_matches_forward_with_an_f16_cache() {
    let kv = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    for checkpoint in ["gemma3/hf", "qwen3/mlx-q4-g64"] {
        decode_vs_forward(checkpoint, kv);
    }
}

#[test]
fn decode_matches_forward_with_a_quantized_cache() {
    // The fixtures' heads are 16 wide: one group per row. Latent attention (DeepSeek) stores
    // 80-wide keys-as-values rows.
    for bits in [8, 4] {
        let kv = KvOptions {
            quant: Some(KvQuant {
                bits,
                group_size: 16,
            }),
            ..KvOptions::default()
        };
        for checkpoint in ["gemma3/hf", "qwen3/mlx-q4-g64", "deepseek_v3/hf"] {
            decode_vs_forward(checkpoint, kv);
        }
    }
}

#[test]
fn decode_matches_forward_with_a_turbo_cache() {
    // A 2-position hot window past 6 positions: most of the fixtures' prompts read compressed
    // keys, on Gemma 3's sliding layers (window 8) too.
    let kv = KvOptions {
        turbo: Some(TurboOptions {
            hot_window: 2,
            threshold: 6,
            ..TurboOptions::default()
        }),
        ..KvOptions::default()
    };
    for checkpoint in ["gemma3/hf", "qwen3/mlx-q4-g64", "llama/hf"] {
        decode_vs_forward(checkpoint, kv);
    }
}

#[test]
fn decode_refuses_a_position_past_the_context() {
    let options = LoadOptions {
        max_context: Some(4),
        ..LoadOptions::default()
    };
    let model = load_model(&fixture("llama/hf"), &options).unwrap().model;
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    model
        .forward(&[1, 2, 3, 4], &mut cache, Logits::Last)
        .unwrap();
    let err = model.decode(5, &mut cache, &mut Vec::new()).unwrap_err();
    assert!(
        err.to_string().contains("context holds 4 positions"),
        "{err}"
    );
    assert_eq!(cache.len(), 4, "a refused step changes nothing");
}

#[test]
fn decode_matches_forward_on_the_real_models() {
    // Token ids below both vocabularies' sizes; what they spell does not matter here.
    let ids: Vec<u32> = (0..40).map(|i| 100 + 37 * i).collect();
    let f16 = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        compare(&real_model(file), &ids, f16);
    }
}
