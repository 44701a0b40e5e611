//! Our Q4_K and Q6_K GEMV (`kernels/cuda/gguf_gemv.cu`) against candle's MMVQ kernel and the
//! f32 product. A test binary of its own: the switch is read once per
//! process, and `dense_cuda`'s grouped test needs candle's kernels for every format. Built only
//! with the `cuda` feature and run on a GPU machine (`cargo test -p peregrine-tensor --features
//! cuda --test gguf_cuda`).
#![cfg(feature = "cuda")]

mod common;

use common::{f32s, flat, product, ramp};
use peregrine_tensor::{DType, Device, Tensor};

/// Our kernel (`kernels/cuda/gguf_gemv.cu`): a GGUF Q4_K or Q6_K matrix on the GPU (through
/// `GgufMatrix::forward`, as the model calls it) times 1-8 bf16/f16 rows quantized to 8 bits,
/// against candle's MMVQ kernel on the same 8-bit input (the same integer sums added in
/// another order: within the output's rounding step plus 1e-5 of Σ|w·x|), and against the f32
/// product of candle's dequantization (the 8-bit input costs about 2⁻⁸ of Σ|w·x|); 9 rows take
/// candle's kernels.
#[test]
fn the_q4k_and_q6k_gemv_match_candles_mmvq() {
    // SAFETY: set before any other thread of this test binary reads the environment.
    unsafe { std::env::set_var("PEREGRINE_CUDA_GGUF_GEMV", "1") };
    use candle_core::Module;
    use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
    use peregrine_tensor::GgufMatrix;
    use std::sync::Arc;
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let shapes = [(8, 256), (1000, 768), (4096, 4096), (1024, 14336)];
    for ((out, inp), format) in shapes
        .into_iter()
        .flat_map(|s| [(s, GgmlDType::Q4K), (s, GgmlDType::Q6K)])
    {
        let w = ramp(&[out, inp], out as f32, DType::F32);
        let q = QTensor::quantize(&w, format).unwrap();
        let w32 = q.dequantize(&Device::Cpu).unwrap();
        // The same blocks on the GPU.
        let blocks = QStorage::from_data(q.data().unwrap(), &gpu, GgmlDType::Q4K).unwrap();
        let q_gpu = Arc::new(QTensor::new(blocks, (out, inp)).unwrap());
        let matrix = GgufMatrix::new(q_gpu.clone()).unwrap();
        let candle = QMatMul::from_arc(q_gpu).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            for m in [1, 2, 8, 9] {
                let x = ramp(&[1, m, inp], (m + out) as f32 + 0.5, dtype);
                let x32 = f32s(&x);
                let exact = flat(&product(&x32, &w32));
                let scale = flat(&product(&x32.abs().unwrap(), &w32.abs().unwrap()));
                let x = x.to_device(&gpu).unwrap();
                let got = matrix.forward(&x).unwrap();
                assert_eq!(got.dims(), &[1, m, out]);
                let host = |t: &Tensor| flat(&f32s(&t.to_device(&Device::Cpu).unwrap()));
                let (got, theirs) = (host(&got), host(&candle.forward(&x).unwrap()));
                let step = if dtype == DType::BF16 {
                    1.0 / 128.0
                } else {
                    1.0 / 1024.0
                };
                for (i, (((g, c), e), s)) in
                    got.iter().zip(&theirs).zip(&exact).zip(&scale).enumerate()
                {
                    let near = c.abs() * step + 1e-5 * s + 1e-6;
                    assert!(
                        (g - c).abs() <= near,
                        "{format:?} {dtype:?} {out}x{inp}, {m} rows, output {i}: {g} against candle's {c}"
                    );
                    let loose = e.abs() * step + s / 128.0 + 1e-6;
                    assert!(
                        (g - e).abs() <= loose,
                        "{format:?} {dtype:?} {out}x{inp}, {m} rows, output {i}: {g} against f32 {e}"
                    );
                }
            }
        }
    }
}
