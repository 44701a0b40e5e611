//! KV bytes per token of each storage mode, measured from the caches' allocations: one
//! full-attention layer of `kv_heads × head_dim` filled with `positions` random rows (bytes do not
//! depend on the values), times `layers`.
//!
//! usage: cargo run --release -p peregrine-kv --example kv_bytes -- LAYERS KV_HEADS HEAD_DIM POSITIONS
//! (SmolLM2-135M: 30 3 64 8000; Llama-3.1-8B: 32 8 128 32000). Prints one JSON line per mode.

use peregrine_kv::{KvOptions, KvQuant, LayerKind, SequenceCache, TurboOptions};
use peregrine_tensor::{DType, Device, Tensor};

fn main() -> peregrine_tensor::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap_or(0))
        .collect();
    let [layers, kv_heads, head_dim, positions] = args[..] else {
        eprintln!("usage: kv_bytes LAYERS KV_HEADS HEAD_DIM POSITIONS");
        std::process::exit(2);
    };
    let quant = |bits| KvQuant {
        bits,
        group_size: 64,
    };
    let modes = [
        ("f32", KvOptions::default()),
        (
            "f16",
            KvOptions {
                dtype: Some(DType::F16),
                ..KvOptions::default()
            },
        ),
        (
            "kv_bits 8",
            KvOptions {
                quant: Some(quant(8)),
                ..KvOptions::default()
            },
        ),
        (
            "kv_bits 4",
            KvOptions {
                quant: Some(quant(4)),
                ..KvOptions::default()
            },
        ),
        (
            "turbo",
            KvOptions {
                turbo: Some(TurboOptions::default()),
                ..KvOptions::default()
            },
        ),
    ];
    let f16_bytes = 2 * 2 * kv_heads * head_dim;
    for (name, kv) in modes {
        let mut cache = SequenceCache::new(&[LayerKind::Full], &kv);
        let layer = cache.layer(0);
        let chunk = 512;
        for from in (0..positions).step_by(chunk) {
            let n = chunk.min(positions - from);
            let rows = Tensor::randn(0f32, 1.0, (1, kv_heads, n, head_dim), &Device::Cpu)?;
            layer.append(&rows, &rows)?;
        }
        // One decode step: the caches settle to their steady-state allocation.
        let row = vec![0.5f32; kv_heads * head_dim];
        layer.append_row(&row, &row, head_dim)?;
        let per_token = cache.bytes() as f64 / (positions + 1) as f64;
        println!(
            "{{\"mode\": \"{name}\", \"positions\": {positions}, \"bytes_per_token\": {:.1}, \
             \"model_bytes\": {}, \"vs_f16\": {:.2}}}",
            per_token * layers as f64,
            cache.bytes() * layers,
            f16_bytes as f64 / per_token
        );
    }
    Ok(())
}
