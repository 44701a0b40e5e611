//! Decode attention throughput: `cargo bench -p peregrine --bench attention [-- MODEL]`.
//! One query token per sequence over its own f16 cache, for `ATTN_BENCH_SEQS` sequences (default
//! 1 and 8) in parallel as a batched step runs them, over `ATTN_BENCH_LAYERS` layers' caches (30:
//! more than the last-level cache holds, as in a real step) at `ATTN_BENCH_CONTEXT` keys (default
//! 64, 320, 1024). MODEL: `smollm2` (9 query heads over 3, head_dim 64, the default) or `gemma3`
//! (4 over 1, 256). Prints one JSON line per case: ms per layer-sweep, GB/s of cache read, GMAC/s.

use std::time::Instant;

use peregrine::tensor::attention::{AttnScratch, CpuKv, CpuRows, MaskSpec, attention_row_into};
use rayon::prelude::*;

/// One layer's cache of one sequence: keys and values, `[kv_heads, capacity, head_dim]` each.
struct Layer {
    k: Vec<half::f16>,
    v: Vec<half::f16>,
}

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn main() {
    let model = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let (heads, kv_heads, d) = match model.as_deref() {
        Some("gemma3") => (4, 1, 256),
        _ => (9, 3, 64),
    };
    let layers = env_list("ATTN_BENCH_LAYERS", &[30])[0];
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    for seqs in env_list("ATTN_BENCH_SEQS", &[1, 8]) {
        for context in env_list("ATTN_BENCH_CONTEXT", &[64, 320, 1024]) {
            let capacity = context.next_multiple_of(256);
            let plane = kv_heads * capacity * d;
            let value = |i: usize| half::f16::from_f32(((i * 7919) % 1000) as f32 * 1e-3 - 0.5);
            // By layer, then sequence, as a step reads them.
            let caches: Vec<Vec<Layer>> = (0..layers)
                .map(|l| {
                    (0..seqs)
                        .map(|s| Layer {
                            k: (0..plane).map(|i| value(i + s + l)).collect(),
                            v: (0..plane).map(|i| value(i * 3 + s + l)).collect(),
                        })
                        .collect()
                })
                .collect();
            let q: Vec<f32> = (0..heads * d)
                .map(|i| (i % 13) as f32 * 0.1 - 0.6)
                .collect();
            let mask = MaskSpec {
                q_start: context - 1,
                k_start: 0,
                window: None,
                both_ways: None,
            };
            let mut outs: Vec<(Vec<f32>, AttnScratch)> = (0..seqs)
                .map(|_| (vec![0f32; heads * d], AttnScratch::default()))
                .collect();
            let sweep = |outs: &mut Vec<(Vec<f32>, AttnScratch)>| {
                for layer in &caches {
                    outs.par_iter_mut()
                        .zip(layer)
                        .for_each(|((out, scratch), c)| {
                            let kv = CpuKv::new(
                                CpuRows::F16(&c.k),
                                CpuRows::F16(&c.v),
                                kv_heads,
                                capacity,
                                d,
                            )
                            .unwrap();
                            let scale = 1.0 / (d as f64).sqrt();
                            attention_row_into(
                                &q,
                                &kv,
                                0..context,
                                scale,
                                None,
                                &mask,
                                out,
                                scratch,
                            )
                            .unwrap();
                        });
                }
            };
            pool.install(|| sweep(&mut outs)); // warm the scratch
            // The fastest of 7 blocks: this host's other tenants make single timings noisy.
            let rounds = (4_000_000 / (seqs * layers * context * heads * d)).clamp(2, 50);
            let secs = (0..7)
                .map(|_| {
                    let start = Instant::now();
                    for _ in 0..rounds {
                        pool.install(|| sweep(&mut outs));
                    }
                    start.elapsed().as_secs_f64() / rounds as f64
                })
                .fold(f64::INFINITY, f64::min);
            let bytes = (seqs * layers * 2 * kv_heads * context * d * 2) as f64;
            let macs = (seqs * layers * 2 * heads * context * d) as f64;
            println!(
                "{{\"model\":\"{}\",\"seqs\":{seqs},\"layers\":{layers},\"context\":{context},\"threads\":{},\"ms\":{:.3},\"gb_per_s\":{:.1},\"gmac_per_s\":{:.2}}}",
                model.as_deref().unwrap_or("smollm2"),
                pool.current_num_threads(),
                secs * 1e3,
                bytes / secs / 1e9,
                macs / secs / 1e9
            );
        }
    }
}
