//! Qwen3-VL with a picture against transformers' f32 reference on the tiny random VLM fixture
//! (`tests/fixtures/vlm/qwen3_vl`, made by scripts/fixtures/make_vlm_qwen3.py): Qwen2-VL's
//! processor with patch 16 and mean / std 0.5, the tower's learned position table resampled
//! to the 6×8 patch grid, its LayerNorm blocks and axial rope, the merger and two DeepStack
//! mergers, whose rows the Qwen3 text model adds after its layers 0 and 1; the picture at
//! interleaved M-RoPE positions. Qwen3.5's multimodal fixture (`tests/fixtures/vlm/qwen3_5`: the
//! same tower without DeepStack, a portrait photo, the hybrid Qwen3.5 text model with half of
//! each head rotated) is checked the same way.
//!
//! Tolerances: pixel values 1e-5 (the same 8-bit levels through the same f32 arithmetic); logits
//! 1e-3 max abs, as tests/golden.rs (weights stored in bf16, both sides compute in f32). Seen:
//! Qwen3-VL 5.0e-6; Qwen3.5 2.7e-4 at one position and about 1e-5 elsewhere, where transformers'
//! own f32 reference is 4.3e-4 from its f64 run (ill-conditioned there, not a fault of either).

mod common;

use peregrine_models::vision::{ImageRun, decode_image, load_vision};
use peregrine_models::{KvOptions, LoadOptions, SequenceCache, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::ops::max_abs_diff;
use peregrine_tensor::{DType, Device, Tensor};

#[test]
fn logits_with_the_picture_match_transformers() {
    check_logits("qwen3_vl", (6, 8), 2);
}

#[test]
fn qwen3_5_logits_with_the_picture_match_transformers() {
    check_logits("qwen3_5", (8, 6), 0);
}

/// Fixture `family`'s picture of `patches` (rows, columns) through the processor and the tower
/// (with `deepstack` DeepStack mergers) into the text model, against transformers' logits.
fn check_logits(family: &str, patches: (usize, usize), deepstack: usize) {
    let dir = common::fixture(&format!("vlm/{family}/hf"));
    let model = load_model(&dir, &LoadOptions::default())
        .expect("text model loads")
        .model;
    let vision = (load_vision(&dir, &Device::Cpu).unwrap()).expect("a vision tower");
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let u32s = |t: &Tensor| t.to_dtype(DType::U32).unwrap().to_vec1::<u32>().unwrap();
    let ids = u32s(&r["input_ids"]);
    let png = std::fs::read(common::fixture(&format!("vlm/{family}/image.png"))).unwrap();
    let input = vision
        .preprocess(&decode_image(&png, &Default::default()).unwrap())
        .unwrap();
    let pixel_diff = max_abs_diff(&input.tiles, &r["pixel_values"]).unwrap();
    eprintln!("pixel values: max abs diff {pixel_diff:.2e}");
    assert!(pixel_diff < 1e-5, "{pixel_diff}");
    let grid_thw = u32s(&r["image_grid_thw"].flatten_all().unwrap());
    assert_eq!(grid_thw, [1, patches.0 as u32, patches.1 as u32]);
    let grid = (patches.0 / 2, patches.1 / 2);
    let runs = vision.runs(&input);
    assert_eq!(
        runs,
        [ImageRun {
            len: 12,
            grid: Some(grid)
        }]
    );

    // The merged rows and the DeepStack mergers' beside them.
    let rows = vision.encode(&input).unwrap();
    let hidden = model.config().hidden_size;
    assert_eq!(rows.dims(), [12, (1 + deepstack) * hidden]);
    let types = u32s(&r["mm_token_type_ids"]);
    let first = types.iter().position(|&t| t == 1).expect("image tokens");
    let logits = |rows: &Tensor, grid| {
        let runs = [(first, rows.clone())];
        common::media_logits_at(model.as_ref(), &ids, &runs, false, grid)
    };
    let diff = max_abs_diff(&logits(&rows, Some(grid)), &r["logits"]).unwrap();
    eprintln!("{family} logits: max abs diff {diff:.2e}");
    assert!(diff < 1e-3, "{diff}");

    // The comparison can fail: at plain positions, or without DeepStack's rows.
    let plain = max_abs_diff(&logits(&rows, None), &r["logits"]).unwrap();
    eprintln!("{family} at plain positions: {plain:.2e}");
    assert!(plain > 1e-2, "{plain}");
    if deepstack > 0 {
        let merged_only = rows.narrow(1, 0, hidden).unwrap();
        let without = max_abs_diff(&logits(&merged_only, Some(grid)), &r["logits"]).unwrap();
        eprintln!("{family} without DeepStack: {without:.2e}");
        assert!(without > 1e-2, "{without}");
    }
}

/// Decoding past the picture (positions shifted by it) gives transformers' greedy tokens.
#[test]
fn greedy_continuation_past_the_picture() {
    let dir = common::fixture("vlm/qwen3_vl/hf");
    let model = load_model(&dir, &LoadOptions::default()).unwrap().model;
    let vision = load_vision(&dir, &Device::Cpu).unwrap().unwrap();
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let u32s = |t: &Tensor| t.to_dtype(DType::U32).unwrap().to_vec1::<u32>().unwrap();
    let ids = u32s(&r["input_ids"]);
    let png = std::fs::read(common::fixture("vlm/qwen3_vl/image.png")).unwrap();
    let input = vision
        .preprocess(&decode_image(&png, &Default::default()).unwrap())
        .unwrap();
    let rows = vision.encode(&input).unwrap();
    let first = u32s(&r["mm_token_type_ids"])
        .iter()
        .position(|&t| t == 1)
        .unwrap();
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    let mut batch = [peregrine_models::BatchSeq {
        tokens: &ids,
        cache: &mut cache,
        logits: peregrine_models::Logits::Last,
        media: Some(peregrine_models::Media {
            offset: first,
            rows: &rows,
            both_ways: false,
            grid: Some((3, 4)),
        }),
    }];
    let last = model.forward_batch(&mut batch).unwrap();
    let mut logits = last.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let want = u32s(&r["greedy_ids"]);
    let mut got = Vec::new();
    for _ in 0..want.len() {
        let next = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        got.push(next);
        model.decode(next, &mut cache, &mut logits).unwrap();
    }
    assert_eq!(got, want);
}

/// llama.cpp's files of the Qwen3-VL and Qwen3.5 fixtures (scripts/fixtures/make_mmproj.py, its
/// own converter): the text models as `qwen3vl` and `qwen35` (interleaved M-RoPE), the projector
/// files with the Conv3d split and Qwen3-VL's DeepStack mergers named by their blocks. The
/// projectors' rows equal the HF towers', and the logits transformers' (Qwen3.5 as its HF
/// folder gives them: one ill-conditioned position, see above).
#[test]
fn llama_cpp_files_with_the_mmproj_match_transformers() {
    for (family, grid) in [("qwen3_vl", (3, 4)), ("qwen3_5", (4, 3))] {
        let fixture = |path: &str| common::fixture(&format!("vlm/{family}/{path}"));
        let gguf = load_model(&fixture("gguf/model-bf16.gguf"), &LoadOptions::default())
            .expect("the text GGUF loads")
            .model;
        let mmproj_path = fixture("gguf/mmproj-f32.gguf");
        let mmproj =
            peregrine_models::vision::load_mmproj(&mmproj_path, &Device::Cpu).expect("the mmproj");
        let hf = load_vision(&fixture("hf"), &Device::Cpu).unwrap().unwrap();
        let png = std::fs::read(fixture("image.png")).unwrap();
        let image = decode_image(&png, &Default::default()).unwrap();
        let rows = mmproj.encode(&mmproj.preprocess(&image).unwrap()).unwrap();
        let want = hf.encode(&hf.preprocess(&image).unwrap()).unwrap();
        let diff = max_abs_diff(&rows, &want).unwrap();
        eprintln!("{family} mmproj rows vs the HF tower's: {diff:.2e}");
        assert!(diff < 1e-5, "{diff}");
        let r = load(fixture("hf/reference.safetensors"), &Device::Cpu).unwrap();
        let u32s = |t: &Tensor| t.to_dtype(DType::U32).unwrap().to_vec1::<u32>().unwrap();
        let ids = u32s(&r["input_ids"]);
        let first = u32s(&r["mm_token_type_ids"])
            .iter()
            .position(|&t| t == 1)
            .unwrap();
        let runs = [(first, rows)];
        let logits = common::media_logits_at(gguf.as_ref(), &ids, &runs, false, Some(grid));
        let diff = max_abs_diff(&logits, &r["logits"]).unwrap();
        eprintln!("{family} GGUF logits: max abs diff {diff:.2e}");
        assert!(diff < 1e-3, "{diff}");
    }
}
