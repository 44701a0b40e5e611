//! Image decoding and preprocessing against transformers' Gemma3ImageProcessor (PIL backend,
//! `do_convert_rgb=True`): the pixel values of `tests/fixtures/vlm/gemma3` (made by
//! `scripts/fixtures/make_vlm.py`), and bad input refused with an error instead of a panic.

mod common;

use common::fixture;
use peregrine_models::vision::image::{ImageLimits, RgbImage, decode_image};
use peregrine_models::vision::resize::{Filter, resize, to_chw_normalized};
use safetensors::{Dtype, SafeTensors};

/// The six PNGs of `images/` (sizes, aspect ratios and modes: RGBA, grayscale, palette).
const IMAGES: [&str; 6] = ["gray", "palette", "rgba", "small", "tall", "wide"];

/// The same integer arithmetic as PIL gives identical u8 pixels, and the f32 rescale and
/// normalisation are numpy's, so the values should be equal; one pixel level off would show as
/// 2/255 ≈ 0.008 after normalising with std 0.5.
const TOL: f32 = 1e-5;

/// Gemma 3's processor settings, from its `preprocessor_config.json`.
struct Processor {
    width: usize,
    height: usize,
    filter: Filter,
    rescale: f64,
    mean: [f32; 3],
    std: [f32; 3],
}

fn processor() -> Processor {
    let text = std::fs::read_to_string(fixture("vlm/gemma3/hf/preprocessor_config.json")).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    let triple = |key: &str| -> [f32; 3] {
        let v: Vec<f32> = cfg[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        v.try_into().unwrap()
    };
    Processor {
        width: cfg["size"]["width"].as_u64().unwrap() as usize,
        height: cfg["size"]["height"].as_u64().unwrap() as usize,
        filter: Filter::from_pil(cfg["resample"].as_u64().unwrap() as u32).unwrap(),
        rescale: cfg["rescale_factor"].as_f64().unwrap(),
        mean: triple("image_mean"),
        std: triple("image_std"),
    }
}

/// `pixel_values` of one image as the processor makes them, with `filter` in place of its own.
fn pixel_values(p: &Processor, png: &str, filter: Filter) -> Vec<f32> {
    let bytes = std::fs::read(fixture(png)).unwrap();
    let img = decode_image(&bytes, &ImageLimits::default()).unwrap();
    let img = resize(&img, p.width, p.height, filter);
    to_chw_normalized(&img, p.rescale, p.mean, p.std)
}

/// An f32 tensor of a safetensors file under `tests/fixtures`: (shape, values).
fn reference(file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(fixture(file)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32, "{file}: {name}");
    let values = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (t.shape().to_vec(), values)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn gemma3_processor_images() {
    let p = processor();
    assert_eq!(p.filter, Filter::Bilinear);
    for name in IMAGES {
        let (shape, want) = reference("vlm/gemma3/hf/processor_reference.safetensors", name);
        assert_eq!(shape, [3, p.height, p.width], "{name}");
        let png = format!("vlm/gemma3/images/{name}.png");
        let diff = max_abs_diff(&pixel_values(&p, &png, p.filter), &want);
        println!("{name}: max abs diff {diff:e}");
        assert!(diff <= TOL, "{name}: max abs diff {diff}");
        // Another filter must fail the comparison, or it could not catch anything.
        let bicubic = max_abs_diff(&pixel_values(&p, &png, Filter::Bicubic), &want);
        println!("{name}: bicubic instead, max abs diff {bicubic:e}");
        assert!(bicubic > 1e-3, "{name}: bicubic matches too ({bicubic})");
    }
}

/// The 150x120 photo of the model fixture, which the processor resizes (bilinear) to 112x112.
#[test]
fn gemma3_model_fixture_image() {
    let p = processor();
    let (shape, want) = reference("vlm/gemma3/hf/reference.safetensors", "pixel_values");
    assert_eq!(shape, [1, 3, p.height, p.width]);
    let got = pixel_values(&p, "vlm/gemma3/image.png", p.filter);
    let diff = max_abs_diff(&got, &want);
    println!("image.png: max abs diff {diff:e}");
    assert!(diff <= TOL, "max abs diff {diff}");
}

/// Pillow 13 runs the vertical pass first when the height loses more than twice as many pixels as
/// the width, else the horizontal pass first; each pass rounds to u8, so the order shows with a
/// sharp filter on noise. (Pillow 12 always ran the horizontal pass first.)
#[test]
fn pass_order_is_pillow_13s() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let img = RgbImage {
        width: 40,
        height: 80,
        data: (0..40 * 80 * 3)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                (state >> 56) as u8
            })
            .collect(),
    };
    let f = Filter::Lanczos;
    let by_rows = |w, h| resize(&resize(&img, w, img.height, f), w, h, f);
    let by_columns = |w, h| resize(&resize(&img, img.width, h, f), w, h, f);
    // 2 * (40 - 36) < 80 - 20: vertical first.
    assert_eq!(resize(&img, 36, 20, f), by_columns(36, 20));
    assert_ne!(resize(&img, 36, 20, f), by_rows(36, 20));
    // 2 * (40 - 10) >= 80 - 30: horizontal first.
    assert_eq!(resize(&img, 10, 30, f), by_rows(10, 30));
    assert_ne!(resize(&img, 10, 30, f), by_columns(10, 30));
}

/// CRC-32 (IEEE, reflected), as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    let crc = crc32(&out[start..]);
    out.extend(crc.to_be_bytes());
}

/// A well-formed PNG start declaring `w`x`h` 8-bit RGB, with a few bytes of IDAT: the header
/// parses, the pixel data is nowhere near there.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // bit depth, RGB, deflate, adaptive filter, no interlace
    png_chunk(&mut out, b"IHDR", &ihdr);
    png_chunk(&mut out, b"IDAT", &[0x78, 0x01, 0x00, 0x00, 0x00]);
    png_chunk(&mut out, b"IEND", &[]);
    out
}

fn decode_err(bytes: &[u8]) -> String {
    match decode_image(bytes, &ImageLimits::default()) {
        Ok(img) => panic!("decoded {}x{}", img.width, img.height),
        Err(e) => e.to_string(),
    }
}

#[test]
fn crc32_of_iend() {
    // Every PNG ends with this chunk: 0000 0000 4945 4e44 ae42 6082.
    assert_eq!(crc32(b"IEND"), 0xAE42_6082);
}

#[test]
fn bad_input_is_an_error() {
    let msg = decode_err(&[]);
    assert!(msg.contains("empty"), "{msg}");

    let mut state = 0x2545_f491_4f6c_dd1du64;
    let random: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    let msg = decode_err(&random);
    assert_eq!(msg, "not a PNG, JPEG or WebP image");

    let real = std::fs::read(fixture("vlm/gemma3/images/small.png")).unwrap();
    let msg = decode_err(&real[..100]);
    assert!(msg.contains("PNG"), "{msg}");
    println!("truncated PNG: {msg}");

    // The right signatures, then garbage.
    for magic in [
        &b"\xff\xd8\xff\xe0"[..],
        b"RIFF\x00\x10\x00\x00WEBPVP8 ",
        b"\x89PNG\r\n\x1a\n",
    ] {
        let mut bytes = magic.to_vec();
        bytes.extend(&random[..512]);
        let msg = decode_err(&bytes);
        println!("corrupt {:?}: {msg}", &magic[..4]);
    }

    let msg = decode_err(&png_header(5, 0));
    assert!(msg.contains("PNG"), "{msg}");
}

/// 20000x20000 RGB would be a 1.2 GB buffer: refused from the header, naming the dimensions.
#[test]
fn huge_dimensions_are_refused_before_decoding() {
    let msg = decode_err(&png_header(20_000, 20_000));
    assert!(msg.contains("20000x20000"), "{msg}");
    assert!(msg.contains("limit"), "{msg}");
    // A small image with the same header gets past the limit, to the (missing) pixel data.
    let msg = decode_err(&png_header(4, 4));
    assert!(msg.starts_with("cannot decode the PNG image"), "{msg}");
}

#[test]
fn too_many_bytes_is_refused() {
    let limits = ImageLimits {
        max_bytes: 1000,
        ..ImageLimits::default()
    };
    let real = std::fs::read(fixture("vlm/gemma3/images/small.png")).unwrap();
    assert!(real.len() > 1000);
    let msg = decode_image(&real, &limits).unwrap_err().0;
    assert!(msg.contains("limit"), "{msg}");
}
