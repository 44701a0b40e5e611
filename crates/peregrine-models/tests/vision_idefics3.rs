//! SmolVLM's image processor (transformers' `Idefics3ImageProcessorPil`, `do_convert_rgb=True`)
//! and its prompt expansion against the tiny VLM fixture `tests/fixtures/vlm/smolvlm` (made by
//! `scripts/fixtures/make_vlm.py`): the tiles, split grid and masks of six PNGs, the model
//! fixture's pixel values, and the processor's expanded prompt.

mod common;

use std::collections::HashMap;

use common::fixture;
use peregrine_models::vision::idefics3::{
    Idefics3Pixels, Idefics3Processor, Idefics3Tokens, prompt_expansion,
};
use peregrine_models::vision::image::{ImageLimits, decode_image};
use peregrine_models::vision::resize::Filter;
use safetensors::{Dtype, SafeTensors};

/// The six PNGs of `images/` (sizes, aspect ratios and modes: RGBA, grayscale, palette).
const IMAGES: [&str; 6] = ["gray", "palette", "rgba", "small", "tall", "wide"];

/// Identical 8-bit pixels give identical f32 values (the rescale and normalisation are numpy's
/// arithmetic); one level off shows as 2/255 ≈ 0.008 with std 0.5.
const TOL: f32 = 1e-6;

fn processor() -> Idefics3Processor {
    Idefics3Processor::read(&fixture("vlm/smolvlm/hf")).expect("preprocessor_config.json reads")
}

fn run(p: &Idefics3Processor, png: &str) -> Idefics3Pixels {
    let bytes = std::fs::read(fixture(png)).unwrap();
    p.process(&decode_image(&bytes, &ImageLimits::default()).unwrap())
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

fn u8s(file: &str, name: &str) -> (Vec<usize>, Vec<u8>) {
    let (dtype, shape, data) = tensor(file, name);
    assert_eq!(dtype, Dtype::U8, "{file}: {name}");
    (shape, data)
}

fn words<const N: usize>(file: &str, name: &str, dtype: Dtype) -> (Vec<usize>, Vec<[u8; N]>) {
    let (d, shape, data) = tensor(file, name);
    assert_eq!(d, dtype, "{file}: {name}");
    let words = data
        .chunks_exact(N)
        .map(|b| b.try_into().unwrap())
        .collect();
    (shape, words)
}

/// The HF value an 8-bit level was normalised to (mean = std = 0.5, rescale 1/255, as
/// make_vlm.py checks it).
fn level_value(level: u8) -> f32 {
    ((f64::from(level) * (1.0 / 255.0)) as f32 - 0.5) / 0.5
}

/// Max abs difference between our tiles and the reference's, all tiles flattened in order.
fn max_abs_diff(got: &Idefics3Pixels, want: &[f32]) -> f32 {
    let flat: Vec<f32> = got.tiles.iter().flatten().copied().collect();
    assert_eq!(flat.len(), want.len(), "value count");
    flat.iter()
        .zip(want)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn settings_from_the_fixture() {
    let p = processor();
    assert_eq!(p.pixels.filter, Filter::Lanczos);
    assert_eq!(
        (p.longest_edge, p.tile_size(), p.image_seq_len),
        (128, 64, 4)
    );
    assert!(p.do_resize && p.split);
}

#[test]
fn smolvlm_processor_images() {
    let p = processor();
    let s = p.tile_size();
    let file = "vlm/smolvlm/hf/processor_reference.safetensors";
    for name in IMAGES {
        let (shape, levels) = u8s(file, name);
        let want: Vec<f32> = levels.iter().map(|&l| level_value(l)).collect();
        let n = shape[0];
        assert_eq!(shape, [n, 3, s, s], "{name}");
        let png = format!("vlm/smolvlm/images/{name}.png");
        let got = run(&p, &png);
        let grid = (
            u8s(file, &format!("{name}.rows")).1,
            u8s(file, &format!("{name}.cols")).1,
        );
        assert_eq!(
            (vec![got.rows as u8], vec![got.cols as u8]),
            grid,
            "{name}: grid"
        );
        assert_eq!(got.tiles.len(), n, "{name}: tile count");
        assert_eq!(n, got.rows * got.cols + 1, "{name}: split tiles + global");
        // One image: no padding tiles, every pixel valid.
        let (_, mask) = u8s(file, &format!("{name}.pixel_attention_mask"));
        assert_eq!(mask.len(), n * s * s, "{name}: mask size");
        assert!(mask.iter().all(|&m| m == 1), "{name}: mask all ones");
        let diff = max_abs_diff(&got, &want);
        println!(
            "{name}: {}x{} grid, {n} tiles, max abs diff {diff:e}",
            got.rows, got.cols
        );
        assert!(diff <= TOL, "{name}: max abs diff {diff}");
        // Another filter must fail the comparison, or it could not catch anything.
        let mut bicubic = p.clone();
        bicubic.pixels.filter = Filter::Bicubic;
        let other = max_abs_diff(&run(&bicubic, &png), &want);
        println!("{name}: bicubic instead, max abs diff {other:e}");
        assert!(other > 1e-3, "{name}: bicubic matches too ({other})");
    }
}

/// The model fixture's 128x64 photo: no resize, a 1 x 2 grid plus the global tile.
#[test]
fn smolvlm_model_fixture_image() {
    let p = processor();
    let s = p.tile_size();
    let file = "vlm/smolvlm/hf/reference.safetensors";
    let (shape, values) = words::<4>(file, "pixel_values", Dtype::F32);
    let want: Vec<f32> = values.into_iter().map(f32::from_le_bytes).collect();
    let got = run(&p, "vlm/smolvlm/image.png");
    assert_eq!(shape, [1, got.tiles.len(), 3, s, s]);
    assert_eq!((got.rows, got.cols), (1, 2));
    let (mshape, mask) = words::<8>(file, "pixel_attention_mask", Dtype::I64);
    assert_eq!(mshape, [1, got.tiles.len(), s, s]);
    assert!(mask.into_iter().all(|m| i64::from_le_bytes(m) == 1));
    let diff = max_abs_diff(&got, &want);
    println!("image.png: max abs diff {diff:e}");
    assert!(diff <= TOL, "max abs diff {diff}");
}

/// GPT-2's byte-to-character table (`bytes_to_unicode`), inverted: the byte-level BPE vocabulary
/// writes byte `b` as this character.
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut map = HashMap::new();
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap()
        };
        map.insert(c, b);
    }
    map
}

/// `input_ids` back to text with the fixture's `tokenizer.json` (added tokens verbatim, the rest
/// byte-level), as `tokenizer.decode(ids, skip_special_tokens=False)` gives it.
fn decode(ids: &[i64]) -> String {
    let text = std::fs::read_to_string(fixture("vlm/smolvlm/hf/tokenizer.json")).unwrap();
    let t: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(t["decoder"]["type"], "ByteLevel");
    let mut vocab: HashMap<i64, String> = t["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (v.as_i64().unwrap(), k.clone()))
        .collect();
    let mut added = HashMap::new();
    for a in t["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_i64().unwrap();
        vocab.remove(&id);
        added.insert(id, a["content"].as_str().unwrap().to_string());
    }
    let bytes = unicode_to_byte();
    let mut out = Vec::new();
    for id in ids {
        match (added.get(id), vocab.get(id)) {
            (Some(s), _) => out.extend_from_slice(s.as_bytes()),
            (None, Some(s)) => out.extend(s.chars().map(|c| bytes[&c])),
            _ => panic!("id {id} not in tokenizer.json"),
        }
    }
    String::from_utf8(out).unwrap()
}

/// The processor's token ids, decoded, are the chat template's prompt (the `prompt` metadata,
/// before expansion) with its one `<image>` replaced by our expansion for the image's grid.
#[test]
fn smolvlm_prompt_expansion() {
    let p = processor();
    let file = fixture("vlm/smolvlm/hf/reference.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let prompt = meta.metadata().as_ref().unwrap()["prompt"].clone();
    let tokens = Idefics3Tokens::default();
    assert_eq!(prompt.matches(&tokens.image).count(), 1, "{prompt:?}");
    let (_, ids) = words::<8>(
        "vlm/smolvlm/hf/reference.safetensors",
        "input_ids",
        Dtype::I64,
    );
    let ids: Vec<i64> = ids.into_iter().map(i64::from_le_bytes).collect();
    let got = run(&p, "vlm/smolvlm/image.png");
    let expansion = prompt_expansion(got.rows, got.cols, p.image_seq_len, &tokens);
    let want = prompt.replacen(&tokens.image, &expansion, 1);
    assert_eq!(decode(&ids), want);
    // A wrong grid would not match.
    let wrong = prompt.replacen(&tokens.image, &prompt_expansion(2, 1, 4, &tokens), 1);
    assert_ne!(decode(&ids), wrong);
}

/// Bad settings are refused naming the file and the field.
#[test]
fn bad_settings_name_file_and_field() {
    let dir = std::env::temp_dir().join(format!("idefics3-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (json, field) in [
        (r#"{"resample": 9}"#, "resample"),
        (r#"{"size": {"height": 10, "width": 10}}"#, "size"),
        (r#"{"do_normalize": false}"#, "do_normalize"),
        (r#"{"image_mean": [0.5]}"#, "image_mean"),
    ] {
        std::fs::write(dir.join("preprocessor_config.json"), json).unwrap();
        let e = Idefics3Processor::read(&dir).unwrap_err().to_string();
        assert!(e.contains("preprocessor_config.json"), "{e}");
        assert!(e.contains(&format!("`{field}")), "{e}");
    }
    std::fs::write(dir.join("preprocessor_config.json"), "{}").unwrap();
    let p = Idefics3Processor::read(&dir).unwrap();
    assert_eq!(
        (p.longest_edge, p.tile_size(), p.image_seq_len),
        (1456, 364, 169)
    );
    assert_eq!(p.pixels.filter, Filter::Lanczos);
    std::fs::remove_dir_all(&dir).unwrap();
}
