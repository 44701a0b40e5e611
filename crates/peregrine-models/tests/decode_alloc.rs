//! The decode step allocates nothing: after a few warm-up tokens (which size the step's
//! buffers), 16 more tokens through `CausalLm::decode` make no call to the allocator on any
//! thread, for checkpoints whose matmuls run on Peregrine's kernels: the fixtures' MLX 4-bit
//! (regrouped into interleaved Q4_1 rows) and 8-bit (MLX8G64 blocks), and the two real GGUF
//! models (SmolLM2 Q4_1; Gemma 3 Q4_K_M: Q4_K/Q6_K rows, sliding-window layers), with f32 and
//! f16 caches. The KV buffers (and attention's scratch with them) still grow every 256
//! positions, outside this window; dense and MLX 3/6-bit weights go through candle and
//! allocate. One test in this binary: the counter sees every thread of the process.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use peregrine_models::{KvOptions, LoadOptions, Logits, SequenceCache, load_model};
use peregrine_tensor::DType;
use peregrine_tensor::device::in_compute_pool;

use common::{fixture, real_model};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Windows of 16 steps measured; the fewest allocations among them is reported.
const WINDOWS: usize = 3;

/// Allocations made by 16 decode steps after an 8-token prompt and 4 warm-up steps: the
/// fewest over [`WINDOWS`] consecutive windows. An allocation the step makes shows in every
/// window; on a heavily loaded machine the thread pool's own bookkeeping (work stolen late)
/// was seen to allocate twice in one window, which the minimum leaves out.
fn allocations_per_16_steps(path: &Path, kv: KvOptions) -> usize {
    let model = load_model(path, &LoadOptions::default()).unwrap().model;
    let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
    let mut logits = Vec::new();
    let mut fewest = usize::MAX;
    in_compute_pool(|| {
        model
            .forward(&[1, 2, 3, 4, 5, 6, 7, 8], &mut cache, Logits::Last)
            .unwrap();
        for token in 0..4 {
            model.decode(token, &mut cache, &mut logits).unwrap();
        }
        for _ in 0..WINDOWS {
            ALLOCATIONS.store(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            for token in 0..16 {
                model.decode(token, &mut cache, &mut logits).unwrap();
            }
            COUNTING.store(false, Ordering::SeqCst);
            fewest = fewest.min(ALLOCATIONS.load(Ordering::SeqCst));
        }
    });
    // 12 + 48 positions: the KV buffers (grown every 256) do not grow inside the windows.
    assert_eq!(cache.len(), 12 + 16 * WINDOWS);
    fewest
}

#[test]
fn decode_steps_allocate_nothing() {
    let f16 = KvOptions {
        dtype: Some(DType::F16),
        ..KvOptions::default()
    };
    let q4_kv = KvOptions {
        quant: Some(peregrine_models::KvQuant {
            bits: 4,
            group_size: 16,
        }),
        ..KvOptions::default()
    };
    let cases = [
        (fixture("llama/mlx-q4-g64"), KvOptions::default()),
        (fixture("qwen3/mlx-q4-g32"), KvOptions::default()),
        (fixture("qwen3/mlx-q8-g64"), f16),
        (fixture("llama/mlx-q8-g64"), q4_kv),
        (fixture("qwen3_moe/mlx-q4-g64"), KvOptions::default()),
        (fixture("mixtral/mlx-q8-g64"), f16),
        // Per-layer inputs, KV-shared layers, MoE beside the dense MLP (g32: the 32-wide per-layer
        // projection stays unquantized at g64, and dense matrices go through candle).
        (fixture("gemma4_text/mlx-q4-g32"), KvOptions::default()),
        (fixture("gemma4_text_moe/mlx-q4-g32"), f16),
        // Q8_0 experts on the interleaved kernels, the router in f32 as llama.cpp keeps it.
        (
            fixture("qwen3_moe/gguf/model-q8_0.gguf"),
            KvOptions::default(),
        ),
        (real_model("SmolLM2-135M-Instruct.Q4_1.gguf"), f16),
        (real_model("gemma-3-270m-q4_k_m.gguf"), KvOptions::default()),
    ];
    for (path, kv) in cases {
        let n = allocations_per_16_steps(&path, kv);
        let name = path.display();
        eprintln!("{name} ({:?} cache): {n} allocations in 16 steps", kv.dtype);
        assert_eq!(
            n, 0,
            "{name}: the decode step allocated {n} times in 16 steps"
        );
    }
}
