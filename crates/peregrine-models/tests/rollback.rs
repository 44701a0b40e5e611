//! Rollback at the model level, for every cache kind: prefill, decode some tokens, trim them,
//! decode others; every logit then equals a cache that never saw the trimmed tokens. What
//! speculative decoding and the prompt cache rely on.
//!
//! Tolerance 1e-5 max abs: both caches hold the same numbers, but the trimmed one grew its
//! buffers at other moments, and the decode kernel splits keys by buffer capacity, so sums may
//! round in another order. A trimmed position still read, or a slot off by one, moves the logits
//! by 1e-2 or more.

mod common;

use peregrine_models::{
    KvOptions, KvQuant, LoadOptions, Logits, SequenceCache, TurboOptions, load_model,
};
use peregrine_tensor::DType;

use common::fixture;

fn kinds() -> Vec<(&'static str, KvOptions)> {
    let quant = |bits| KvOptions {
        quant: Some(KvQuant {
            bits,
            group_size: 16,
        }),
        ..KvOptions::default()
    };
    let turbo = KvOptions {
        // A hot window narrower than the rollback: trimmed tokens had been compressed too.
        turbo: Some(TurboOptions {
            hot_window: 2,
            threshold: 6,
        }),
        ..KvOptions::default()
    };
    let f16 = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    vec![
        ("f32", KvOptions::default()),
        ("f16", f16),
        ("q8", quant(8)),
        ("q4", quant(4)),
        ("turbo", turbo),
    ]
}

#[test]
fn generate_trim_regenerate_equals_never_having_generated() {
    let prompt: Vec<u32> = (0..7).map(|i| 3 + 11 * i).collect();
    let rejected = [5u32, 17, 40, 2];
    let accepted: Vec<u32> = (0..9).map(|i| 7 + 13 * i).collect();
    // Gemma 3: sliding (window 8) and full layers; Llama: full only.
    for checkpoint in ["gemma3/hf", "llama/hf"] {
        let model = load_model(&fixture(checkpoint), &LoadOptions::default())
            .unwrap()
            .model;
        for (name, kv) in kinds() {
            let new_cache = || {
                let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
                model.forward(&prompt, &mut cache, Logits::Last).unwrap();
                cache
            };
            let (mut trimmed, mut fresh) = (new_cache(), new_cache());
            let mut logits = Vec::new();
            for &t in &rejected {
                model.decode(t, &mut trimmed, &mut logits).unwrap();
            }
            trimmed.trim(rejected.len()).unwrap();
            assert_eq!(trimmed.len(), fresh.len(), "{checkpoint} {name}");
            let mut want = Vec::new();
            for (i, &t) in accepted.iter().enumerate() {
                model.decode(t, &mut trimmed, &mut logits).unwrap();
                model.decode(t, &mut fresh, &mut want).unwrap();
                let diff = (logits.iter().zip(&want)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    diff < 1e-5,
                    "{checkpoint} {name}, token {i} after the trim: {diff}"
                );
            }
        }
    }
}
