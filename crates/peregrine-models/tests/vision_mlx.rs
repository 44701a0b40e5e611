//! MLX vision-language checkpoints as mlx-vlm writes them (`tests/fixtures/vlm/*/mlx-q4-g32`,
//! made by scripts/fixtures/make_mlx_vlm.py with `mlx_vlm.convert`): the language model 4-bit
//! under `language_model.`, the tower in bf16 (or f32) under mlx-vlm's names with
//! channels-last convolution kernels, SmolVLM's connector quantized too. Each with its fixture's
//! picture against transformers run on the dequantized weights.
//!
//! Tolerance 1e-3 max abs on the logits, as tests/golden_mlx.rs: loaded with
//! `MlxActivations::F32` (the mode that computes as mlx-lm does), both sides f32 on the same
//! dequantized values.

mod common;

use std::path::Path;

use peregrine_models::vision::{ImageRun, decode_image, load_vision};
use peregrine_models::weights::MlxActivations;
use peregrine_models::{LoadOptions, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::ops::max_abs_diff;
use peregrine_tensor::{DType, Device, Tensor};

/// The fixture `family`'s MLX folder: the picture through its processor and tower into the
/// text model, every position's logits against the reference.
fn check(family: &str) {
    let fixture = |path: &str| common::fixture(&format!("vlm/{family}/{path}"));
    let dir = fixture("mlx-q4-g32");
    let options = LoadOptions {
        mlx_activations: MlxActivations::F32,
        ..LoadOptions::default()
    };
    let model = load_model(&dir, &options).expect("text model loads").model;
    let vision = load_vision(&dir, &Device::Cpu)
        .unwrap()
        .expect("a vision tower");
    let inputs = load(fixture("hf/reference.safetensors"), &Device::Cpu).unwrap();
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<u32> = inputs["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    let png = std::fs::read(fixture("image.png")).unwrap();
    let input = vision
        .preprocess(&decode_image(&png, &Default::default()).unwrap())
        .unwrap();
    let rows = vision.encode(&input).unwrap();
    let token = image_token(&dir);
    let both_ways = vision.prompt().both_ways;
    // Each run of image tokens in the prompt takes the next rows.
    let (mut runs, mut at, mut used, mut grid) = (Vec::new(), 0, 0, None);
    for ImageRun { len, grid: g } in vision.runs(&input) {
        let start = (at..ids.len())
            .find(|&i| ids[i] == token)
            .expect("a run of image tokens");
        runs.push((start, rows.narrow(0, used, len).unwrap()));
        (at, used, grid) = (start + len, used + len, g);
    }
    let logits = |runs: &[(usize, Tensor)]| {
        common::media_logits_at(model.as_ref(), &ids, runs, both_ways, grid)
    };
    let diff = max_abs_diff(&logits(&runs), &r["logits"]).unwrap();
    eprintln!("{family} MLX 4-bit: max abs diff {diff:.2e}");
    assert!(diff < 1e-3, "{family}: {diff}");
    // The comparison can fail: each run's rows in reverse order move the logits.
    let reversed: Vec<(usize, Tensor)> = (runs.iter())
        .map(|(at, rows)| {
            let n = rows.dim(0).unwrap();
            let back: Vec<u32> = (0..n as u32).rev().collect();
            let back = Tensor::new(back.as_slice(), &Device::Cpu).unwrap();
            (*at, rows.index_select(&back, 0).unwrap())
        })
        .collect();
    let off = max_abs_diff(&logits(&reversed), &r["logits"]).unwrap();
    eprintln!("{family} rows reversed: {off:.2e}");
    assert!(off > 1e-2, "{family}: {off}");
}

/// `image_token_id` (or Mistral 3's `image_token_index`) of the folder's config.
fn image_token(dir: &Path) -> u32 {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let id = config
        .get("image_token_id")
        .or(config.get("image_token_index"));
    id.and_then(|v| v.as_u64()).expect("the image token's id") as u32
}

#[test]
fn qwen2_5_vl() {
    check("qwen2_5_vl");
}

#[test]
fn qwen3_vl() {
    check("qwen3_vl");
}

#[test]
fn qwen3_5() {
    check("qwen3_5");
}

#[test]
fn smolvlm() {
    check("smolvlm");
}

/// Gemma 3: the picture seen both ways, Gemma's norms as mlx-vlm keeps them.
#[test]
fn gemma3() {
    check("gemma3");
}

/// Gemma 4: per-layer inputs, the picture both ways in sliding layers only.
#[test]
fn gemma4() {
    check("gemma4");
}

#[test]
fn mistral3() {
    check("mistral3");
}
