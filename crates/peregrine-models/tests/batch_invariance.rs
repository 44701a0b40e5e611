//! A sequence's logits must not depend on how its prompt was cut into forward passes or on the
//! thread count: the prompt cache prefills only a prompt's new tail, and continuous batching
//! runs a sequence beside others, and both promise the output of one whole prefill at
//! temperature 0. So this test asks for bit-identical logits, not a tolerance: on the two real
//! GGUF models (their Q4_1, Q4_K, Q5_0, Q6_K and Q8_0 matrices all take the interleaved
//! kernels), f16 and 8-bit KV caches, a 300-token prompt (attention spans three key chunks),
//! cut into pieces of 1, 5 and 77 tokens, on pools of 1 and 2 threads.
//!
//! Formats in GGUF's row layout (Q5_K, MLX 8-bit, matrices whose rows are not a multiple of 8)
//! run another kernel from 16 rows on, whose float order differs from the small-batch one;
//! they are not covered here.

mod common;

use peregrine_models::{CausalLm, KvOptions, KvQuant, LoadOptions, Logits, SequenceCache};
use peregrine_tensor::DType;

use common::real_model;

/// The logits after each piece of `ids`, prefilled `piece` tokens per forward pass (the last
/// position's: it attends every cached key and value, so any earlier difference shows there).
fn logits(model: &dyn CausalLm, ids: &[u32], piece: usize, kv: &KvOptions) -> Vec<Vec<f32>> {
    let mut cache = SequenceCache::new(&model.cache_spec(), kv);
    let pieces = ids.chunks(piece).map(|chunk| {
        let y = model.forward(chunk, &mut cache, Logits::Last).unwrap();
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    });
    pieces.collect()
}

#[test]
fn logits_do_not_depend_on_prefill_pieces_or_threads() {
    // Token ids below both vocabularies' sizes; what they spell does not matter here.
    let ids: Vec<u32> = (0..300).map(|i| 100 + (37 * i) % 9000).collect();
    let f16 = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    let q8 = KvOptions {
        quant: Some(KvQuant {
            bits: 8,
            group_size: 64,
        }),
        ..KvOptions::default()
    };
    let pool = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    };
    let (one, two) = (pool(1), pool(2));
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let model = load_model(file);
        for (name, kv) in [("f16", &f16), ("q8", &q8)] {
            let whole = two.install(|| logits(model.as_ref(), &ids, ids.len(), kv));
            for (threads, pool, piece) in [(2, &two, 1), (2, &two, 5), (1, &one, 77)] {
                let cut = pool.install(|| logits(model.as_ref(), &ids, piece, kv));
                assert!(
                    cut.last() == whole.last(),
                    "{file}, {name} KV: prefilled {piece} at a time on {threads} threads, the \
                     last position's logits differ from one whole prefill's"
                );
            }
        }
    }
}

fn load_model(file: &str) -> std::sync::Arc<dyn CausalLm> {
    let path = real_model(file);
    peregrine_models::load_model(&path, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .model
}
