//! Gemma 4 with a clip against transformers' f32 reference on the tiny random fixture
//! `tests/fixtures/audio/gemma4` (made by scripts/fixtures/make_audio.py from espeak-ng
//! speech): Gemma 4's feature extractor, the Conformer tower with clipped linears, the
//! embedder, and the rows spliced into a text model with per-layer inputs.
//!
//! Tolerances: features 1e-4 (both in f64 from the same f32 products; `ln` near the floor
//! amplifies the FFT's rounding: observed below 1e-5); rows and logits 1e-3 max abs, as
//! tests/golden.rs (weights stored in bf16, both sides compute in f32 from them).

mod common;

use peregrine_models::audio::{AudioTower, decode_wav, load_audio};
use peregrine_models::{LoadOptions, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

const DIR: &str = "audio/gemma4";

fn reference() -> std::collections::HashMap<String, Tensor> {
    load(
        common::fixture(DIR).join("hf/reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

fn speech() -> peregrine_models::audio::AudioClip {
    let bytes = std::fs::read(common::fixture(DIR).join("speech.wav")).unwrap();
    decode_wav(&bytes, 30.0).expect("the fixture's WAV decodes")
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

#[test]
fn features_match_gemma4_feature_extractor() {
    let audio = load_audio(&common::fixture(DIR).join("hf"), &Device::Cpu)
        .unwrap()
        .expect("an audio tower");
    let AudioTower::Gemma4(mel, _) = &audio.tower else {
        panic!("Gemma 4's tower")
    };
    let r = reference();
    let filters: Vec<f32> = mel.filters().iter().map(|&f| f as f32).collect();
    let filters = Tensor::from_vec(filters, (mel.n_fft / 2 + 1, mel.mels), &Device::Cpu).unwrap();
    let filter_diff = max_abs(&filters, &r["mel_filters"]);
    assert!(filter_diff < 1e-6, "mel filters: {filter_diff}");
    let (features, valid) = mel.features(&speech().samples);
    let mask = r["input_features_mask"]
        .to_dtype(DType::U32)
        .unwrap()
        .flatten_all()
        .unwrap();
    let mask: Vec<bool> = mask
        .to_vec1::<u32>()
        .unwrap()
        .iter()
        .map(|&m| m == 1)
        .collect();
    assert_eq!(valid, mask);
    let ours = Tensor::from_vec(features, (1, valid.len(), mel.mels), &Device::Cpu).unwrap();
    let diff = max_abs(&ours, &r["input_features"]);
    eprintln!("log-mel features: max abs diff {diff:.2e}, filters {filter_diff:.2e}");
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn rows_and_logits_match_transformers() {
    let dir = common::fixture(DIR).join("hf");
    let audio = load_audio(&dir, &Device::Cpu)
        .unwrap()
        .expect("an audio tower");
    let model = load_model(&dir, &LoadOptions::default())
        .expect("text model loads")
        .model;
    let r = reference();
    let rows = audio.encode(&speech()).unwrap();
    let row_diff = max_abs(&rows, &r["audio_rows"]);
    eprintln!("audio rows: max abs diff {row_diff:.2e}");
    let ids: Vec<u32> = r["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let token = config["audio_token_id"].as_u64().expect("audio_token_id") as u32;
    let first = ids.iter().position(|&t| t == token).expect("audio tokens");
    let n = ids.iter().filter(|&&t| t == token).count();
    assert_eq!(audio.tokens(&speech()).unwrap(), n);
    assert_eq!(rows.dims(), [n, model.config().hidden_size]);
    assert!(row_diff < 1e-3, "rows: {row_diff}");
    let forward =
        |rows: &Tensor| common::media_logits(model.as_ref(), &ids, &[(first, rows.clone())], false);
    let diff = max_abs(&forward(&rows), &r["logits"]);
    eprintln!("logits: max abs diff {diff:.2e}");
    assert!(diff < 1e-3, "logits: {diff}");
    // The comparison can fail: the clip played backwards moves the logits.
    let mut reversed = speech();
    reversed.samples.reverse();
    let off = max_abs(&forward(&audio.encode(&reversed).unwrap()), &r["logits"]);
    eprintln!("reversed clip: logits max abs diff {off:.2e}");
    assert!(off > 0.05, "{off}");
}
