//! Audio input, timed: `cargo bench -p peregrine --bench audio [-- MODEL [WAV [REPEAT]]]`.
//! MODEL is an audio-language checkpoint folder (default the tiny Gemma 4 audio fixture, whose
//! figures only show that the bench runs; `scripts/make_audio_bench.py` makes towers of real
//! shapes), WAV a clip at the model's rate (default the fixture's speech). Times, as medians over
//! REPEAT runs (default 3): decoding the file, the feature extractor, the tower with its
//! projector (`encode`, features included), and the prefill of a chat prompt with the clip
//! against the same prompt without it. Prints one JSON line; threads are rayon's
//! (`RAYON_NUM_THREADS`).

#[path = "support.rs"]
mod support;

use std::path::PathBuf;

use peregrine::engine::{ChatMessage, ChatTemplate, Tokenizer};
use peregrine::models::audio::{AudioTower, decode_wav, load_audio};
use peregrine::models::{
    BatchSeq, KvOptions, LoadOptions, Logits, Media, SequenceCache, load_model,
};
use peregrine::tensor::device::in_compute_pool;
use peregrine::tensor::{DType, Device};
use support::timed;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = (std::env::args().skip(1))
        .filter(|a| !a.starts_with('-'))
        .collect();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/audio/gemma4");
    let dir = args.first().map_or(root.join("hf"), PathBuf::from);
    let wav = args.get(1).map_or(root.join("speech.wav"), PathBuf::from);
    let repeat: usize = args.get(2).map_or(Ok(3), |a| a.parse())?;
    let model = load_model(&dir, &LoadOptions::default())?.model;
    let audio = load_audio(&dir, &Device::Cpu)?.ok_or("the checkpoint has no audio tower")?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let bytes = std::fs::read(&wav)?;

    let (decode_s, clip) = timed(repeat, || decode_wav(&bytes, 600.0));
    let clip = clip?;
    let (features_s, ()) = timed(repeat, || match &audio.tower {
        AudioTower::Qwen2(mel, _) => drop(mel.features(&clip.samples)),
        AudioTower::Gemma4(mel, _) => drop(mel.features(&clip.samples)),
    });
    let (encode_s, rows) = timed(repeat, || in_compute_pool(|| audio.encode(&clip)));
    let rows = rows?;

    // The same question with and without the clip, through the model's chat template.
    let question = "What does the speaker say?";
    let prompt = |with_clip: bool| -> Result<Vec<u32>, Box<dyn std::error::Error>> {
        let mut parts = vec![serde_json::json!({"type": "text", "text": question})];
        if with_clip {
            parts.insert(0, serde_json::json!({"type": "audio"}));
        }
        let message = ChatMessage {
            content: serde_json::Value::Array(parts),
            ..ChatMessage::text("user", "")
        };
        let template = ChatTemplate::new(
            tokenizer.chat_template().ok_or("no chat template")?,
            tokenizer.bos_token().map(str::to_owned),
            tokenizer.eos_token().map(str::to_owned),
        )?;
        let text = template.render(&[message], true, &Default::default())?;
        let text = text.replace(&audio.audio_token, &audio.expansion(rows.dim(0)?));
        Ok(tokenizer.encode(&text, false)?)
    };
    let (with, without) = (prompt(true)?, prompt(false)?);
    let token = tokenizer.token_to_id(&audio.audio_token);
    let offset = (with.iter())
        .position(|&t| Some(t) == token)
        .ok_or("no audio tokens")?;
    let kv = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    let prefill = |ids: &[u32], media: Option<Media>| {
        let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
        let mut batch = [BatchSeq {
            tokens: ids,
            cache: &mut cache,
            logits: Logits::Last,
            media,
        }];
        in_compute_pool(|| model.forward_batch(&mut batch)).map(|_| ())
    };
    let media = Media {
        offset,
        rows: &rows,
        both_ways: false,
        grid: None,
    };
    let (with_s, done) = timed(repeat, || prefill(&with, Some(media)));
    done?;
    let (without_s, done) = timed(repeat, || prefill(&without, None));
    done?;
    let report = serde_json::json!({
        "model": dir.display().to_string(),
        "wav": wav.display().to_string(),
        "seconds": clip.seconds(),
        "threads": rayon::current_num_threads(),
        "decode_ms": decode_s * 1e3,
        "features_ms": features_s * 1e3,
        "encode_ms": encode_s * 1e3,
        "audio_tokens": rows.dim(0)?,
        "prefill_with_audio": {"tokens": with.len(), "ms": with_s * 1e3,
                               "tok_per_s": with.len() as f64 / with_s},
        "prefill_text_only": {"tokens": without.len(), "ms": without_s * 1e3,
                              "tok_per_s": without.len() as f64 / without_s},
    });
    println!("{report}");
    Ok(())
}
