//! GGUF CPU kernel throughput: `cargo bench -p peregrine --bench gguf_matmul [-- FORMAT]`.
//! Prints one JSON line per (format, kernel, batch) with giga multiply-adds per second over the
//! threads rayon uses (set `RAYON_NUM_THREADS`). Shapes are SmolLM2's MLP (1536 × 576), or
//! `GGUF_BENCH_SHAPE=OUTxIN` (e.g. `262144x640`, Gemma 3's output matrix; K-quants round IN up
//! to a multiple of 256). `GGUF_BENCH_KERNEL=avx2` (etc.) runs one kernel only;
//! `GGUF_BENCH_BATCHES=1,4,8` sets the batch sizes (default 1 and 128). `GGUF_BENCH_COPIES=N`
//! multiplies N copies of the matrix in turn, so that a small one (an expert, `768x2048`) comes
//! from memory as decode meets it rather than from cache (the interleaved and in-place layouts;
//! the row layout's copies share one tensor's bytes).

use std::sync::Arc;
use std::time::Instant;

use peregrine::tensor::candle::quantized::{GgmlDType, QTensor};
use peregrine::tensor::quant::{Format, Kernel, SharedBytes};
use peregrine::tensor::{Device, GgufMatrix, Tensor};

/// Row-layout bytes multiplied where they lie.
#[derive(Debug)]
struct InPlace(Vec<u8>);

impl SharedBytes for InPlace {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn main() {
    // Inside the pool, as the engine runs every forward pass: no hand-off per call.
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    pool.install(run);
}

fn run() {
    let filter = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let (n, k) = std::env::var("GGUF_BENCH_SHAPE")
        .ok()
        .and_then(|s| {
            let (n, k) = s.split_once('x')?;
            Some((n.parse().ok()?, k.parse().ok()?))
        })
        .unwrap_or((1536, 576));
    let batches: Vec<usize> = std::env::var("GGUF_BENCH_BATCHES")
        .ok()
        .map(|s| s.split(',').filter_map(|b| b.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 128]);
    let copies: usize = std::env::var("GGUF_BENCH_COPIES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(1);
    let formats = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ];
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
    let k256 = k.next_multiple_of(256); // K-quants need a multiple of 256
    let w256 = Tensor::randn(0f32, 1.0, (n, k256), &Device::Cpu).unwrap();
    for dtype in formats {
        if filter
            .as_ref()
            .is_some_and(|f| !format!("{dtype:?}").eq_ignore_ascii_case(f))
        {
            continue;
        }
        let (w, k) = if dtype.block_size() == 256 {
            (&w256, k256)
        } else {
            (&w, k)
        };
        let qt = Arc::new(QTensor::quantize(w, dtype).unwrap());
        // The file's row layout too where the x86 kernels interleave rows, and those rows
        // multiplied in place 8 at a time (a streamed expert's mapped bytes) where they can be.
        let copies =
            |make: &dyn Fn() -> GgufMatrix| (0..copies).map(|_| make()).collect::<Vec<_>>();
        let mut layouts = vec![(
            "interleaved",
            copies(&|| GgufMatrix::new(qt.clone()).unwrap()),
        )];
        if layouts[0].1[0].is_interleaved() {
            layouts.push((
                "rows",
                copies(&|| GgufMatrix::new_rows(qt.clone()).unwrap()),
            ));
        }
        let format = Format::of(dtype).unwrap();
        if GgufMatrix::multiplies_in_place(format, n, k) {
            let in_place = || {
                let bytes = Arc::new(InPlace(qt.data().unwrap().to_vec()));
                GgufMatrix::from_shared(format, bytes, (n, k)).unwrap()
            };
            layouts.push(("in_place", copies(&in_place)));
        }
        let only = std::env::var("GGUF_BENCH_KERNEL").ok();
        let kernels: Vec<Kernel> = Kernel::available()
            .into_iter()
            .filter(|k| (only.as_ref()).is_none_or(|o| format!("{k:?}").eq_ignore_ascii_case(o)))
            .collect();
        for ((layout, q), kernel) in layouts
            .iter()
            .flat_map(|q| kernels.iter().map(move |k| (q, *k)))
        {
            for &m in &batches {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let reps =
                    ((if m == 1 { 2e9 } else { 2e10 }) / (n * k * m) as f64).max(3.0) as usize;
                q[0].matmul_with(&x, m, kernel).unwrap();
                let start = Instant::now();
                for r in 0..reps {
                    let q = &q[r % q.len()];
                    std::hint::black_box(q.matmul_with(&x, m, kernel).unwrap());
                }
                let secs = start.elapsed().as_secs_f64();
                let gmacs = (n * k * m * reps) as f64 / secs / 1e9;
                println!(
                    "{{\"format\":\"{dtype:?}\",\"layout\":\"{layout}\",\"kernel\":\"{kernel:?}\",\"m\":{m},\"n\":{n},\"k\":{k},\"us_per_call\":{:.1},\"gmacs\":{gmacs:.2}}}",
                    secs / reps as f64 * 1e6
                );
            }
        }
    }
}
