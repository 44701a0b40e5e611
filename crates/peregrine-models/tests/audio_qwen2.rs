//! Qwen2-Audio against transformers' f32 reference on the tiny random fixture
//! `tests/fixtures/audio/qwen2_audio` (made by scripts/fixtures/make_audio.py from espeak-ng
//! speech): the WAV read here, Whisper's log-mel features, the tower and projector, and the
//! rows spliced into the prompt.
//!
//! Tolerances: features 1e-5 (ours in f64, transformers' torch path in f32: observed ~1e-6);
//! filters 1e-6 (both f64, rounded to f32); rows and logits 1e-3 max abs, as tests/golden.rs
//! (weights stored in bf16, both sides compute in f32 from them).

mod common;

use peregrine_models::audio::{AudioClip, AudioTower, Qwen2AudioTower, decode_wav, load_audio};
use peregrine_models::{LoadOptions, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

const DIR: &str = "audio/qwen2_audio";

fn reference() -> std::collections::HashMap<String, Tensor> {
    load(
        common::fixture(DIR).join("hf/reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

fn speech() -> AudioClip {
    let bytes = std::fs::read(common::fixture(DIR).join("speech.wav")).unwrap();
    decode_wav(&bytes, 30.0).expect("the fixture's WAV decodes")
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

#[test]
fn features_match_whisper_feature_extractor() {
    let audio = load_audio(&common::fixture(DIR).join("hf"), &Device::Cpu)
        .unwrap()
        .expect("an audio tower");
    let r = reference();
    let AudioTower::Qwen2(mel, _) = &audio.tower else {
        panic!("Qwen2-Audio's tower")
    };
    let filters: Vec<f32> = mel.filters().iter().map(|&f| f as f32).collect();
    let filters = Tensor::from_vec(filters, (mel.n_fft / 2 + 1, mel.mels), &Device::Cpu).unwrap();
    let filter_diff = max_abs(&filters, &r["mel_filters"]);
    assert!(filter_diff < 1e-6, "mel filters: {filter_diff}");

    let clip = speech();
    assert_eq!(clip.rate, 16000);
    let mask = r["feature_attention_mask"].to_dtype(DType::F32).unwrap();
    let valid = mask.sum_all().unwrap().to_scalar::<f32>().unwrap() as usize;
    assert_eq!(mel.valid_frames(clip.samples.len()), valid);
    let features = mel.features(&clip.samples);
    let ours = Tensor::from_vec(features, (1, mel.mels, mel.frames()), &Device::Cpu).unwrap();
    let diff = max_abs(&ours, &r["input_features"]);
    eprintln!("log-mel features: max abs diff {diff:.2e}, filters {filter_diff:.2e}");
    assert!(diff < 1e-5, "{diff}");
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
    let u32s = |t: &Tensor| t.to_dtype(DType::U32).unwrap().to_vec1::<u32>().unwrap();
    let ids = u32s(&r["input_ids"]);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let token = config["audio_token_index"]
        .as_u64()
        .expect("audio_token_index") as u32;
    let first = ids.iter().position(|&t| t == token).expect("audio tokens");
    let n = ids.iter().filter(|&&t| t == token).count();
    assert_eq!(audio.tokens(&speech()).unwrap(), n);
    assert_eq!(rows.dims(), [n, model.config().hidden_size]);
    let forward =
        |rows: &Tensor| common::media_logits(model.as_ref(), &ids, &[(first, rows.clone())], false);
    let diff = max_abs(&forward(&rows), &r["logits"]);
    eprintln!("audio rows: max abs diff {row_diff:.2e}; logits {diff:.2e}");
    assert!(row_diff < 1e-3, "rows: {row_diff}");
    assert!(diff < 1e-3, "logits: {diff}");
    // The comparison can fail: the clip played backwards moves the logits.
    let mut reversed = speech();
    reversed.samples.reverse();
    let off = max_abs(&forward(&audio.encode(&reversed).unwrap()), &r["logits"]);
    eprintln!("reversed clip: logits max abs diff {off:.2e}");
    assert!(off > 0.05, "{off}");
}

#[test]
fn token_counts_follow_the_processor() {
    // transformers' Qwen2AudioProcessor: (((frames - 1) // 2 + 1) - 2) // 2 + 1.
    for frames in 1..400usize {
        let python = (((frames as i64 - 1).div_euclid(2) + 1) - 2).div_euclid(2) + 1;
        assert_eq!(
            Qwen2AudioTower::tokens(frames) as i64,
            python,
            "{frames} frames"
        );
    }
}

#[test]
fn bad_wav_files_are_errors() {
    let good = std::fs::read(common::fixture(DIR).join("speech.wav")).unwrap();
    assert!(decode_wav(b"RIFF\0\0\0\0WAVE", 30.0).is_err());
    assert!(decode_wav(b"not audio at all", 30.0).is_err());
    assert!(decode_wav(&good[..40], 30.0).is_err(), "no data chunk");
    let err = decode_wav(&good, 1.0).unwrap_err().to_string();
    assert!(err.contains("1.6 s"), "{err}");
}
