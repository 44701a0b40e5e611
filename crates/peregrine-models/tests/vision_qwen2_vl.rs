//! Qwen2.5-VL's image processor (transformers' `Qwen2VLImageProcessorPil`,
//! `do_convert_rgb=True`) and its image-token count against the tiny VLM fixture
//! `tests/fixtures/vlm/qwen2_5_vl` (made by `scripts/fixtures/make_vlm.py`): the patches and
//! grids of six PNGs, and the model fixture's pixel values, grid and `<|image_pad|>` count.

mod common;

use common::fixture;
use peregrine_models::vision::image::{ImageLimits, decode_image};
use peregrine_models::vision::qwen2_vl::{
    IMAGE_PAD, Qwen2VlPixels, Qwen2VlProcessor, image_tokens, prompt_expansion,
};
use peregrine_models::vision::resize::Filter;
use safetensors::{Dtype, SafeTensors};

/// The six PNGs of `images/` (sizes, aspect ratios and modes: RGBA, grayscale, palette).
const IMAGES: [&str; 6] = ["gray", "palette", "rgba", "small", "tall", "wide"];

/// Identical 8-bit pixels give identical f32 values (the rescale and normalisation are numpy's
/// arithmetic); one level off shows as about 1/255 / 0.27 ≈ 0.015.
const TOL: f32 = 1e-6;

fn processor() -> Qwen2VlProcessor {
    Qwen2VlProcessor::read(&fixture("vlm/qwen2_5_vl/hf")).expect("preprocessor_config.json reads")
}

fn run(p: &Qwen2VlProcessor, png: &str) -> Qwen2VlPixels {
    let bytes = std::fs::read(fixture(png)).unwrap();
    p.process(&decode_image(&bytes, &ImageLimits::default()).unwrap())
        .unwrap()
}

/// A tensor of a safetensors file under `tests/fixtures`: (dtype, shape, bytes).
fn tensor(file: &str, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(fixture(file)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("{file}: {name}: {e}"));
    (t.dtype(), t.shape().to_vec(), t.data().to_vec())
}

fn i64s(file: &str, name: &str) -> (Vec<usize>, Vec<i64>) {
    let (dtype, shape, data) = tensor(file, name);
    assert_eq!(dtype, Dtype::I64, "{file}: {name}");
    let v = data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (shape, v)
}

/// Max abs difference between our patches and the reference's, row-major.
fn max_abs_diff(got: &Qwen2VlPixels, want: &[f32]) -> f32 {
    assert_eq!(got.patches.len(), want.len(), "value count");
    got.patches
        .iter()
        .zip(want)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn settings_from_the_fixture() {
    let p = processor();
    // No `resample` in the fixture's config: the class's BICUBIC.
    assert_eq!(p.pixels.filter, Filter::Bicubic);
    assert_eq!((p.min_pixels, p.max_pixels), (3136, 12544));
    assert_eq!((p.patch, p.temporal, p.merge), (14, 2, 2));
    assert_eq!(p.pixels.rescale, 1.0 / 255.0);
    // The JSON's numbers, read as f64 and rounded to f32 as numpy's f32 arithmetic uses them.
    let f32s = |v: [f64; 3]| v.map(|x| x as f32);
    assert_eq!(p.pixels.mean, f32s([0.48145466, 0.4578275, 0.40821073]));
    assert_eq!(p.pixels.std, f32s([0.26862954, 0.26130258, 0.27577711]));
}

#[test]
fn qwen2_5_vl_processor_images() {
    let p = processor();
    let file = "vlm/qwen2_5_vl/hf/processor_reference.safetensors";
    let per_channel = p.temporal * p.patch * p.patch;
    for name in IMAGES {
        let (dtype, shape, levels) = tensor(file, name);
        assert_eq!(dtype, Dtype::U8, "{name}");
        let row_len = 3 * per_channel;
        assert_eq!(shape[1], row_len, "{name}: row length");
        // The HF value each 8-bit level was normalised from, as make_vlm.py checks it: columns
        // are channel-major, so column j is channel j / (T * P * P).
        let want: Vec<f32> = levels
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let c = (i % row_len) / per_channel;
                ((f64::from(l) * (1.0 / 255.0)) as f32 - p.pixels.mean[c]) / p.pixels.std[c]
            })
            .collect();
        let (gtype, _, grid) = tensor(file, &format!("{name}.image_grid_thw"));
        assert_eq!(gtype, Dtype::U8, "{name}: grid dtype");
        let png = format!("vlm/qwen2_5_vl/images/{name}.png");
        let got = run(&p, &png);
        let g = got.grid;
        assert_eq!(vec![g.0 as u8, g.1 as u8, g.2 as u8], grid, "{name}: grid");
        assert_eq!((got.rows, got.row_len), (shape[0], row_len), "{name}");
        let diff = max_abs_diff(&got, &want);
        println!(
            "{name}: grid {g:?}, {} rows, max abs diff {diff:e}",
            got.rows
        );
        assert!(diff <= TOL, "{name}: max abs diff {diff}");
        // Another filter must fail the comparison, or it could not catch anything.
        let mut bilinear = p.clone();
        bilinear.pixels.filter = Filter::Bilinear;
        let other = max_abs_diff(&run(&bilinear, &png), &want);
        println!("{name}: bilinear instead, max abs diff {other:e}");
        assert!(other > 1e-3, "{name}: bilinear matches too ({other})");
    }
}

/// The model fixture's 112x84 photo (already a multiple of 28: no resize): its pixel values,
/// grid, and the count of `<|image_pad|>` in the processor's prompt.
#[test]
fn qwen2_5_vl_model_fixture_image() {
    let p = processor();
    let file = "vlm/qwen2_5_vl/hf/reference.safetensors";
    let (dtype, shape, bytes) = tensor(file, "pixel_values");
    assert_eq!(dtype, Dtype::F32);
    let want: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let got = run(&p, "vlm/qwen2_5_vl/image.png");
    assert_eq!(shape, [got.rows, got.row_len]);
    let (gshape, grid) = i64s(file, "image_grid_thw");
    assert_eq!(gshape, [1, 3]);
    let g = got.grid;
    assert_eq!(grid, [g.0 as i64, g.1 as i64, g.2 as i64]);
    let diff = max_abs_diff(&got, &want);
    println!("image.png: grid {g:?}, max abs diff {diff:e}");
    assert!(diff <= TOL, "max abs diff {diff}");

    let text = std::fs::read_to_string(fixture("vlm/qwen2_5_vl/hf/tokenizer.json")).unwrap();
    let t: serde_json::Value = serde_json::from_str(&text).unwrap();
    let pad = t["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["content"] == IMAGE_PAD)
        .and_then(|a| a["id"].as_i64())
        .expect("<|image_pad|> among the added tokens");
    let (_, ids) = i64s(file, "input_ids");
    let count = ids.iter().filter(|&&id| id == pad).count();
    let n = image_tokens(got.grid, p.merge);
    assert_eq!(count, n, "<|image_pad|> ids in input_ids");
    assert_eq!(prompt_expansion(n).matches(IMAGE_PAD).count(), n);
}
