//! Image input, timed: `cargo bench -p peregrine --bench vision [-- MODEL [IMAGE [REPEAT]]]`.
//! MODEL is a vision-language checkpoint folder (default the tiny Gemma 3 VLM fixture, whose
//! figures only show that the bench runs; `scripts/make_vlm_bench.py` makes one of real shapes),
//! IMAGE a PNG/JPEG/WebP file (default the fixture's photo). Times, as medians over REPEAT runs
//! (default 3): decoding the file, the processor's preprocessing, the vision tower and
//! projector (`encode`), and the prefill of a chat prompt with the image against the same prompt
//! without it. Prints one JSON line; threads are rayon's (`RAYON_NUM_THREADS`).

#[path = "support.rs"]
mod support;

use std::path::PathBuf;

use peregrine::engine::{ChatMessage, ChatTemplate, Tokenizer};
use peregrine::models::vision::{decode_image, load_vision};
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
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vlm/gemma3");
    let dir = args.first().map_or(root.join("hf"), PathBuf::from);
    let image = args.get(1).map_or(root.join("image.png"), PathBuf::from);
    let repeat: usize = args.get(2).map_or(Ok(3), |a| a.parse())?;
    let model = load_model(&dir, &LoadOptions::default())?.model;
    let vision = load_vision(&dir, &Device::Cpu)?.ok_or("the checkpoint has no vision tower")?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let bytes = std::fs::read(&image)?;

    let (decode_s, picture) = timed(repeat, || decode_image(&bytes, &Default::default()));
    let picture = picture?;
    let (preprocess_s, pixels) = timed(repeat, || vision.preprocess(&picture));
    let pixels = pixels?;
    let (encode_s, rows) = timed(repeat, || in_compute_pool(|| vision.encode(&pixels)));
    let rows = rows?;

    // The same question with and without the picture, through the model's chat template.
    let question = "Describe this image in one sentence.";
    let prompt = |with_image: bool| -> Result<Vec<u32>, Box<dyn std::error::Error>> {
        let mut parts = vec![serde_json::json!({"type": "text", "text": question})];
        if with_image {
            parts.insert(0, serde_json::json!({"type": "image"}));
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
        let mut text = template.render(&[message], true, &Default::default())?;
        text = text.replace(&vision.prompt().marker, &vision.expansion(&pixels));
        Ok(tokenizer.encode(&text, false)?)
    };
    let (with, without) = (prompt(true)?, prompt(false)?);
    let [run] = vision.runs(&pixels)[..] else {
        return Err("this bench feeds one run of image tokens; the model has several".into());
    };
    let image_token = tokenizer.token_to_id(&vision.prompt().image_token);
    let offset = with
        .iter()
        .position(|&t| Some(t) == image_token)
        .ok_or("no image tokens")?;
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
        both_ways: vision.prompt().both_ways,
        grid: run.grid,
    };
    let (with_s, done) = timed(repeat, || prefill(&with, Some(media)));
    done?;
    let (without_s, done) = timed(repeat, || prefill(&without, None));
    done?;
    let report = serde_json::json!({
        "model": dir.display().to_string(),
        "image": image.display().to_string(),
        "image_size": [picture.width, picture.height],
        "threads": rayon::current_num_threads(),
        "decode_ms": decode_s * 1e3,
        "preprocess_ms": preprocess_s * 1e3,
        "encode_ms": encode_s * 1e3,
        "image_tokens": rows.dim(0)?,
        "prefill_with_image": {"tokens": with.len(), "ms": with_s * 1e3,
                               "tok_per_s": with.len() as f64 / with_s},
        "prefill_text_only": {"tokens": without.len(), "ms": without_s * 1e3,
                              "tok_per_s": without.len() as f64 / without_s},
    });
    println!("{report}");
    Ok(())
}
