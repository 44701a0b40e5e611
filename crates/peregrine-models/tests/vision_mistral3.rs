//! Mistral 3 with an image against transformers' f32 reference on the tiny random VLM fixture
//! (`tests/fixtures/vlm/mistral3`, made by scripts/fixtures/make_vlm_mistral3.py): Pixtral's
//! processor (shrink to the longest edge, sides rounded up to patch × merge, bicubic), the
//! tower's 2D rotary attention, the 2×2 patch merger and projector, and the rows spliced into
//! the prompt one row of merged patches per run (rows are separated by `[IMG_BREAK]`).
//!
//! Tolerances: pixel values 1e-5 (the same 8-bit levels through the same f32 arithmetic); logits
//! 1e-3 max abs, as tests/golden.rs (weights stored in bf16, both sides compute in f32).

mod common;

use peregrine_models::vision::{ImageRun, decode_image, load_vision};
use peregrine_models::{LoadOptions, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device};

#[test]
fn logits_match_transformers() {
    let dir = common::fixture("vlm/mistral3/hf");
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
    let png = std::fs::read(common::fixture("vlm/mistral3/image.png")).unwrap();
    let input = vision
        .preprocess(&decode_image(&png, &Default::default()).unwrap())
        .unwrap();
    let pixel_diff = peregrine_tensor::ops::max_abs_diff(&input.tiles, &r["pixel_values"]).unwrap();
    eprintln!("pixel values: max abs diff {pixel_diff:.2e}");
    assert!(pixel_diff < 1e-5, "{pixel_diff}");
    // 112×84: 4×3 merged patches, three runs of four `[IMG]`.
    let layout = vision.runs(&input);
    assert_eq!(layout, vec![ImageRun { len: 4, grid: None }; 3]);
    let rows = vision.encode(&input).unwrap();
    assert_eq!(rows.dims(), [12, model.config().hidden_size]);
    let token = 5; // `[IMG]` (config.json: image_token_index)
    let mut runs = Vec::new();
    let mut at = 0;
    for (i, &t) in ids.iter().enumerate() {
        if t == token && (i == 0 || ids[i - 1] != token) {
            runs.push((i, rows.narrow(0, at, 4).unwrap()));
            at += 4;
        }
    }
    assert_eq!(at, 12, "the prompt holds the image's 12 tokens");
    let diff = peregrine_tensor::ops::max_abs_diff(
        &common::media_logits(model.as_ref(), &ids, &runs, false),
        &r["logits"],
    )
    .unwrap();
    eprintln!("logits: max abs diff {diff:.2e}");
    assert!(diff < 1e-3, "{diff}");
    // The comparison can fail: the rows in the wrong order move the logits.
    let flipped: Vec<_> = runs
        .iter()
        .rev()
        .map(|(_, r)| r.clone())
        .zip(runs.iter().map(|(s, _)| *s))
        .map(|(r, s)| (s, r))
        .collect();
    let off = peregrine_tensor::ops::max_abs_diff(
        &common::media_logits(model.as_ref(), &ids, &flipped, false),
        &r["logits"],
    )
    .unwrap();
    eprintln!("rows of the picture upside down: max abs diff {off:.2e}");
    assert!(off > 0.05, "{off}");
}

#[test]
fn the_processor_shrinks_and_rounds_as_pixtral_does() {
    let dir = common::fixture("vlm/mistral3/hf");
    let vision = (load_vision(&dir, &Device::Cpu).unwrap()).expect("a vision tower");
    // (width, height) → transformers' `get_resize_output_image_size` with longest edge 112 and
    // patch × merge 28 (worked by hand).
    let image = |w: usize, h: usize| peregrine_models::vision::RgbImage {
        width: w,
        height: h,
        data: vec![128; w * h * 3],
    };
    for ((w, h), want) in [
        ((120, 90), (112, 84)),
        ((30, 20), (56, 28)),
        ((500, 100), (112, 28)),
        ((28, 28), (28, 28)),
    ] {
        let input = vision.preprocess(&image(w, h)).unwrap();
        let (_, _, th, tw) = input.tiles.dims4().unwrap();
        assert_eq!((tw, th), want, "{w}x{h}");
        assert_eq!(input.grid, (th / 28, tw / 28));
    }
}

/// llama.cpp's projector file of the fixture (`pixtral`, written by its converter:
/// scripts/fixtures/make_mmproj.py; its query and key rows reordered for llama.cpp's rotation,
/// put back at load) gives the HF tower's rows from the same processed picture.
#[test]
fn llama_cpp_projector_file_gives_the_towers_rows() {
    common::check_mmproj_against_hf("mistral3");
}
