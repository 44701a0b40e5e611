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
            ..TurboOptions::default()
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

/// Every recurrent fixture ([`common::RECURRENT`]; the hybrids' attention caches trim beside
/// their states) rolls back exactly: generate 20 tokens greedily, trim
/// the last `k`, regenerate greedily; the logits and ids are bit-identical to a sequence that
/// stopped after `20 - k` tokens and went on (the restored state is the very state that
/// sequence had). Past the rollback depth the trim is refused and the cache is unchanged.
#[test]
fn recurrent_state_rolls_back_exactly() {
    for arch in common::RECURRENT {
        check_rollback(arch);
    }
}

fn check_rollback(arch: &str) {
    let model = load_model(&fixture(&format!("{arch}/hf")), &LoadOptions::default())
        .unwrap()
        .model;
    let kv = KvOptions {
        recurrent_rollback: Some(20),
        ..KvOptions::default()
    };
    let prompt: Vec<u32> = (0..7).map(|i| 3 + 11 * i).collect();
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
    // Greedy ids and logits of `n` tokens after `start` from `cache`.
    let generate = |cache: &mut SequenceCache, mut logits: Vec<f32>, n: usize| {
        let mut steps = vec![];
        for _ in 0..n {
            let id = argmax(&logits);
            model.decode(id, cache, &mut logits).unwrap();
            steps.push((id, logits.clone()));
        }
        steps
    };
    let start = |cache: &mut SequenceCache| {
        let l = model.forward(&prompt, cache, Logits::Last).unwrap();
        l.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    for k in [1, 5, 19] {
        let mut long = SequenceCache::new(&model.cache_spec(), &kv);
        let first = start(&mut long);
        let generated = generate(&mut long, first.clone(), 20);
        long.trim(k).unwrap();
        let kept = &generated[..20 - k];
        let resume = kept.last().map_or(first.clone(), |(_, l)| l.clone());
        let again = generate(&mut long, resume.clone(), 10);

        let mut fresh = SequenceCache::new(&model.cache_spec(), &kv);
        let fresh_first = start(&mut fresh);
        let fresh_kept = generate(&mut fresh, fresh_first, 20 - k);
        assert_eq!(
            fresh_kept,
            kept,
            "{arch} k {k}: the same first {} tokens",
            20 - k
        );
        let want = generate(&mut fresh, resume, 10);
        assert_eq!(again, want, "{arch} k {k}: regenerated after the trim");
    }
    let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
    let first = start(&mut cache);
    generate(&mut cache, first, 25);
    assert!(
        cache.trim(21).is_err(),
        "21 positions back, past a depth of 20"
    );
    assert_eq!(
        cache.len(),
        prompt.len() + 25,
        "a refused trim changes nothing"
    );
}
