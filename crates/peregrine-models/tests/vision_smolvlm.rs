//! SmolVLM (Idefics3) and SmolVLM 2 with an image against transformers' f32 reference on the
//! tiny random VLM fixtures (`tests/fixtures/vlm/smolvlm{,2}`, made by scripts/fixtures/make_vlm.py): the processor's
//! tiles, the SigLIP tower per tile, the pixel-shuffle connector, and each tile's rows spliced
//! into the llama text model at its run of `<image>` tokens.
//!
//! Tolerance 1e-3 max abs on the logits, as tests/golden.rs: bf16-stored weights, f32 compute on
//! both sides, so only summation order differs. A swapped pair of tiles moves the logits by 0.57
//! (the generator's own check), which the test below also shows.

mod common;

use peregrine_models::vision::{decode_image, load_vision};
use peregrine_models::{LoadOptions, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

const TOLERANCE: f32 = 1e-3;

#[test]
fn logits_match_transformers() {
    check("smolvlm");
}

/// SmolVLM 2 (`smolvlm` config, `SmolVLMForConditionalGeneration`): the same model under other
/// names (`tests/fixtures/vlm/smolvlm2`).
#[test]
fn smolvlm2_logits_match_transformers() {
    check("smolvlm2");
}

/// The fixture `family`'s photo preprocessed, encoded and spliced in, against its reference.
fn check(family: &str) {
    let dir = common::fixture(&format!("vlm/{family}/hf"));
    let model = load_model(&dir, &LoadOptions::default())
        .expect("text model loads")
        .model;
    let vision = (load_vision(&dir, &Device::Cpu).unwrap()).expect("a vision tower");
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    // The photo decoded and processed here: the processor's tiles exactly.
    let png = std::fs::read(common::fixture(&format!("vlm/{family}/image.png"))).unwrap();
    let input = vision
        .preprocess(&decode_image(&png, &Default::default()).unwrap())
        .unwrap();
    let reference = r["pixel_values"].squeeze(0).unwrap();
    let pixel_diff = peregrine_tensor::ops::max_abs_diff(&input.tiles, &reference).unwrap();
    assert!(pixel_diff < 1e-6, "{pixel_diff}");
    let rows = vision.encode(&input).unwrap();
    let run = vision.prompt().run;
    let image = 502; // config.json's image_token_id
    let starts: Vec<usize> = (0..ids.len())
        .filter(|&i| ids[i] == image && (i == 0 || ids[i - 1] != image))
        .collect();
    assert_eq!(starts.len() * run, rows.dim(0).unwrap(), "a run per tile");
    let runs: Vec<(usize, Tensor)> = (starts.iter().enumerate())
        .map(|(t, &s)| (s, rows.narrow(0, t * run, run).unwrap()))
        .collect();
    let diff = peregrine_tensor::ops::max_abs_diff(
        &common::media_logits(model.as_ref(), &ids, &runs, false),
        &r["logits"],
    );
    let diff = diff.unwrap();
    eprintln!("max abs diff {diff:.2e}");
    assert!(diff < TOLERANCE, "{diff}");
    // The comparison can fail: the first two tiles' rows swapped.
    let mut swapped = runs.clone();
    (swapped[0].1, swapped[1].1) = (runs[1].1.clone(), runs[0].1.clone());
    let off = peregrine_tensor::ops::max_abs_diff(
        &common::media_logits(model.as_ref(), &ids, &swapped, false),
        &r["logits"],
    );
    let off = off.unwrap();
    eprintln!("tiles swapped: max abs diff {off:.2e}");
    assert!(off > 0.05, "{off}");
}

/// llama.cpp's projector file of the SmolVLM fixture (`idefics3`, written by its converter:
/// scripts/fixtures/make_mmproj.py) preprocesses the photo into the same tiles (its
/// `preproc_image_size` and tile size are the processor's) and gives the HF tower's rows.
#[test]
fn llama_cpp_projector_file_gives_the_towers_rows() {
    common::check_mmproj_against_hf("smolvlm");
}
