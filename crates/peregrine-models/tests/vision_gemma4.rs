//! Gemma 4 with an image against transformers' f32 reference on the tiny random VLM fixture
//! (`tests/fixtures/vlm/gemma4`, made by scripts/fixtures/make_vlm_gemma4.py): the processor's
//! aspect-preserving resize and channel-last patches, the tower (2D rotary attention over
//! columns and rows, normalised queries, keys and values, GQA, clipped linears), pooling,
//! standardisation, the embedder, and the rows spliced into a text model with per-layer inputs
//! whose sliding layers see the picture both ways.
//!
//! Tolerances: pixel values 1e-6 (8-bit levels times 1/255, as transformers rounds them);
//! logits 1e-3 max abs, as tests/golden.rs (weights stored in bf16, both sides compute in f32).

mod common;

use peregrine_models::vision::{decode_image, load_vision};
use peregrine_models::{LoadOptions, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device};

#[test]
fn logits_match_transformers() {
    let dir = common::fixture("vlm/gemma4/hf");
    let model = load_model(&dir, &LoadOptions::default())
        .expect("text model loads")
        .model;
    let vision = (load_vision(&dir, &Device::Cpu).unwrap()).expect("a vision tower");
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<u32> = r["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    let png = std::fs::read(common::fixture("vlm/gemma4/image.png")).unwrap();
    let input = vision
        .preprocess(&decode_image(&png, &Default::default()).unwrap())
        .unwrap();
    let pixel_diff = peregrine_tensor::ops::max_abs_diff(&input.tiles, &r["pixel_values"]).unwrap();
    eprintln!("pixel values: max abs diff {pixel_diff:.2e}");
    assert!(pixel_diff < 1e-6, "{pixel_diff}");
    assert_eq!(input.grid, (21, 27), "168×216 pixels in patches of 8");
    let rows = vision.encode(&input).unwrap();
    assert_eq!(rows.dims(), [63, model.config().hidden_size]);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let token = config["image_token_id"].as_u64().unwrap() as u32;
    let first = ids.iter().position(|&t| t == token).expect("image tokens");
    assert!(vision.prompt().both_ways);
    let diff = peregrine_tensor::ops::max_abs_diff(
        &common::media_logits(model.as_ref(), &ids, &[(first, rows.clone())], true),
        &r["logits"],
    )
    .unwrap();
    eprintln!("logits: max abs diff {diff:.2e}");
    assert!(diff < 1e-3, "{diff}");
    // The comparison can fail: a causal picture is off.
    let causal = peregrine_tensor::ops::max_abs_diff(
        &common::media_logits(model.as_ref(), &ids, &[(first, rows.clone())], false),
        &r["logits"],
    )
    .unwrap();
    eprintln!("causal inside the picture: max abs diff {causal:.2e}");
    assert!(causal > 0.05, "{causal}");
}

/// llama.cpp's projector file of the fixture (`gemma4v`, written by its converter:
/// scripts/fixtures/make_mmproj.py; its patch kernel stored as a convolution, its clipping
/// ranges as one-value vectors) encodes the HF processor's patches into the HF tower's rows.
/// (The file records no processor settings: it preprocesses as the released checkpoints do,
/// 280 soft tokens, where the fixture asks for 70.)
#[test]
fn llama_cpp_projector_file_gives_the_towers_rows() {
    let dir = common::fixture("vlm/gemma4");
    let mmproj_path = dir.join("gguf/mmproj-f32.gguf");
    let mmproj = peregrine_models::vision::load_mmproj(&mmproj_path, &Device::Cpu)
        .expect("the projector file loads");
    let hf = (load_vision(&dir.join("hf"), &Device::Cpu).unwrap()).expect("a vision tower");
    assert_eq!(mmproj.prompt(), hf.prompt());
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let input = hf
        .preprocess(&decode_image(&png, &Default::default()).unwrap())
        .unwrap();
    let rows = mmproj.encode(&input).unwrap();
    let want = hf.encode(&input).unwrap();
    let diff = peregrine_tensor::ops::max_abs_diff(&rows, &want).unwrap();
    eprintln!("mmproj rows vs the HF tower's: {diff:.2e}");
    assert!(diff < 1e-5, "{diff}");
}
