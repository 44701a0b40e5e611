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

use peregrine_models::{
    BatchSeq, CausalLm, KvOptions, KvQuant, LoadOptions, Logits, SequenceCache,
};
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

/// The fixtures' f32 weights go through candle's dense GEMM, whose blocking (and so its
/// summation order) depends on the number of rows: batched rows may differ from solo ones by
/// f32 rounding, amplified through the layers (measured: 9.8e-5 on qwen3_moe, whose experts
/// amplify it; 1.8e-6 on mistral); a wrong position, cache or segment moves logits by 1e-2 or
/// more.
const DENSE_TOLERANCE: f32 = 1e-3;

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap()
}

/// `forward_batch` over sequences of different lengths, prefill chunks and single decode
/// tokens mixed in each pass, gives each sequence the logits of its own `forward` calls: bit
/// for bit on the two real GGUF models (f16 KV), within [`DENSE_TOLERANCE`] and with the same
/// top token on MoE, sliding-window, recurrent and dense fixtures (f32 weights). Passes of one
/// token per sequence take the batched decode step where the model has one.
#[test]
fn a_batched_pass_equals_each_sequences_own() {
    let f16 = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    let models = [
        (real_model("SmolLM2-135M-Instruct.Q4_1.gguf"), true),
        (real_model("gemma-3-270m-q4_k_m.gguf"), true),
        (common::fixture("qwen3_moe/hf"), false),
        (common::fixture("mistral/hf"), false),
        // Passes of single tokens run the batched decode step: q/k/v biases, q/k norms,
        // soft caps, Gemma's four norms and KV-shared layers.
        (common::fixture("qwen2/hf"), false),
        (common::fixture("qwen3/hf"), false),
        (common::fixture("gemma2/hf"), false),
        (common::fixture("gemma3/hf"), false),
        (common::fixture("gemma4_text/hf"), false),
        // Recurrent layers: each sequence's rows run on its own state.
        (common::fixture("mamba2/hf"), false),
        (common::fixture("qwen3_next/hf"), false),
        (common::fixture("qwen3_5/hf"), false),
        (common::fixture("falcon_h1/hf"), false),
        (common::fixture("jamba/hf"), false),
    ];
    for (path, exact) in models {
        let model = peregrine_models::load_model(&path, &LoadOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .model;
        let vocab = model.config().vocab_size as u32;
        // Three sequences; each pass gives each one a chunk of this many tokens (0: it sits
        // the pass out), so prompts of 150, 9 and 40 tokens, then decode steps.
        let plan: [[usize; 3]; 5] = [[100, 5, 0], [50, 4, 40], [1, 1, 1], [1, 0, 1], [1, 1, 1]];
        let ids: Vec<Vec<u32>> = (0..3u32)
            .map(|s| (0..160).map(|i| (7 + 31 * i + 1000 * s) % vocab).collect())
            .collect();
        let new_cache = || SequenceCache::new(&model.cache_spec(), &f16);
        let (mut batched, mut solo): (Vec<_>, Vec<_>) =
            (0..3).map(|_| (new_cache(), new_cache())).unzip();
        let mut at = [0usize; 3];
        for (pass, sizes) in plan.iter().enumerate() {
            let spans: Vec<(usize, std::ops::Range<usize>)> = (0..3)
                .filter(|&s| sizes[s] > 0)
                .map(|s| (s, at[s]..at[s] + sizes[s]))
                .collect();
            let mut batch: Vec<BatchSeq> = Vec::new();
            for (cache, s) in batched
                .iter_mut()
                .enumerate()
                .filter_map(|(s, c)| (sizes[s] > 0).then_some((c, s)))
            {
                batch.push(BatchSeq::last(&ids[s][at[s]..at[s] + sizes[s]], cache));
            }
            let got = model.forward_batch(&mut batch).unwrap();
            for (row, (s, range)) in spans.iter().enumerate() {
                let want = model
                    .forward(&ids[*s][range.clone()], &mut solo[*s], Logits::Last)
                    .unwrap();
                let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let got = got.get(row).unwrap().to_vec1::<f32>().unwrap();
                let diff = (got.iter().zip(&want)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                let case = format!("{}: pass {pass}, sequence {s}", path.display());
                match exact {
                    true => assert!(diff == 0.0, "{case} differs from its own forward by {diff}"),
                    false => {
                        assert!(
                            diff < DENSE_TOLERANCE,
                            "{case}: {diff} from its own forward"
                        );
                        assert_eq!(argmax(&got), argmax(&want), "{case}: another top token");
                    }
                }
                at[*s] = range.end;
            }
        }
    }
}
