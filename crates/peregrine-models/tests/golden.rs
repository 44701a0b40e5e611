//! Golden logits: every registered architecture against transformers' f32 reference on its tiny
//! random fixture (`tests/fixtures/<arch>/hf`, made by `scripts/fixtures`).
//!
//! Tolerance 1e-3 max abs: weights are stored in f32 and we compute in f32, so the only
//! differences are summation order (observed ~1e-5); a real bug (wrong RoPE pair, missing bias,
//! off-by-one window) moves logits by 1e-1 or more.

mod common;

use std::path::PathBuf;

use peregrine_models::{
    KvOptions, LoadOptions, Logits, SequenceCache, load_model, supported_architectures,
};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

const TOLERANCE: f32 = 1e-3;

fn fixture(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(arch)
        .join("hf")
}

struct Reference {
    ids: Vec<u32>,
    logits: Tensor,
    greedy: Vec<u32>,
}

fn reference(arch: &str) -> Reference {
    let r = load(fixture(arch).join("reference.safetensors"), &Device::Cpu)
        .expect("reference.safetensors");
    let ids = |name: &str| -> Vec<u32> {
        r[name]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()
    };
    Reference {
        ids: ids("input_ids"),
        logits: r["logits"].clone(),
        greedy: ids("greedy_ids"),
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

/// Runs the prompt in chunks of `chunk` tokens (exercising the cache across chunks).
fn logits_in_chunks(arch: &str, chunk: usize) -> (Tensor, Reference) {
    let loaded = load_model(&fixture(arch), &LoadOptions::default()).expect("fixture loads");
    let model = loaded.model;
    let r = reference(arch);
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    let parts: Vec<Tensor> = r
        .ids
        .chunks(chunk)
        .map(|c| model.forward(c, &mut cache, Logits::All).expect("forward"))
        .collect();
    (Tensor::cat(&parts, 0).unwrap(), r)
}

fn check_logits(arch: &str) {
    for chunk in [usize::MAX, 5, 1] {
        let (ours, r) = logits_in_chunks(arch, chunk.min(1024));
        assert_eq!(ours.dims(), r.logits.dims(), "{arch}: logits shape");
        let diff = max_abs_diff(&ours, &r.logits);
        eprintln!("{arch} (chunk {chunk}): max abs diff {diff:.2e}");
        assert!(
            diff < TOLERANCE,
            "{arch} (chunk {chunk}): max abs diff {diff} ≥ {TOLERANCE}"
        );
    }
}

fn check_greedy(arch: &str) {
    let model = load_model(&fixture(arch), &LoadOptions::default())
        .unwrap()
        .model;
    let r = reference(arch);
    let out = common::greedy_ids(model.as_ref(), &r.ids, r.greedy.len());
    assert_eq!(out, r.greedy, "{arch}: greedy continuation");
}

#[test]
fn every_registered_architecture_has_a_fixture() {
    for arch in supported_architectures() {
        assert!(
            fixture(arch).join("reference.safetensors").exists(),
            "no golden fixture for `{arch}`"
        );
    }
}

macro_rules! golden {
    ($($arch:ident),*) => {$(
        mod $arch {
            #[test]
            fn logits_match_transformers() { super::check_logits(stringify!($arch)); }
            #[test]
            fn greedy_ids_match_transformers() { super::check_greedy(stringify!($arch)); }
        }
    )*};
}

golden!(
    gemma2, gemma3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
);

/// The sliding-window families' fixtures (window 8, a 24-token prompt): prefilling the prompt 3
/// tokens at a time, so that the window's edge falls inside and across chunks, gives the logits
/// of one-shot prefill.
#[test]
fn sliding_window_prefill_in_chunks_of_3_equals_one_shot() {
    for arch in ["gemma2", "gemma3", "mistral"] {
        let model = load_model(&fixture(arch), &LoadOptions::default()).unwrap();
        assert_eq!(model.model.config().sliding_window, Some(8), "{arch}");
        let (whole, r) = logits_in_chunks(arch, 1024);
        assert_eq!(r.ids.len(), 24, "{arch}");
        let (chunked, _) = logits_in_chunks(arch, 3);
        let diff = max_abs_diff(&chunked, &whole);
        eprintln!("{arch}: chunks of 3 vs one shot: max abs diff {diff:.2e}");
        assert!(
            diff < 1e-5,
            "{arch}: chunks of 3 differ from one shot by {diff}"
        );
    }
}
