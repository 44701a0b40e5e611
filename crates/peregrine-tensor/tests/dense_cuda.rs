//! The CUDA dense GEMV (`kernels/cuda/dense_gemv.cu`, the decode step's bf16/f16 projections)
//! against the f32 product on the CPU of the same bf16/f16 values, at 1-8 input rows, with cuBLAS
//! taking over at 9 (the kernel takes up to `PEREGRINE_CUDA_GEMV_ROWS` rows, which this test sets to 8). Built only with the `cuda` feature and run on a GPU machine (`cargo test -p
//! peregrine-tensor --features cuda --test dense_cuda`).
//!
//! Tolerance: both sides multiply the same rounded inputs; the GPU sums in f32 in another order
//! and rounds its result to bf16/f16, so an output may differ by its own rounding step (2⁻⁸
//! relative for bf16, 2⁻¹¹ for f16) plus 1e-5 of Σ|w·x|. A wrong row, column or lane moves an
//! output by far more.
#![cfg(feature = "cuda")]

use peregrine_tensor::{DType, Device, QLinear, Tensor};

#[test]
fn the_gemv_matches_the_f32_product_at_every_row_count() {
    // SAFETY: set before any other thread of this test binary reads the environment.
    unsafe { std::env::set_var("PEREGRINE_CUDA_GEMV_ROWS", "8") };
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    for dtype in [DType::BF16, DType::F16] {
        for (out, inp) in [(64, 64), (8, 4096), (1000, 776), (14336, 4096)] {
            for m in [1, 3, 8, 9] {
                let seed = (out * 31 + inp * 7 + m) as f32;
                let w = wave(&[out, inp], seed, dtype);
                let x = wave(&[1, m, inp], seed + 1.0, dtype);
                let (x32, w32) = (f32s(&x), f32s(&w));
                let want = product(&x32, &w32);
                let scale = product(&x32.abs().unwrap(), &w32.abs().unwrap());
                let layer = QLinear::Dense {
                    w: w.to_device(&gpu).unwrap(),
                    b: None,
                };
                let got = layer.forward(&x.to_device(&gpu).unwrap()).unwrap();
                assert_eq!(got.dims(), want.dims());
                let got = got
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap();
                let step = if dtype == DType::BF16 {
                    1.0 / 256.0
                } else {
                    1.0 / 2048.0
                };
                let (got, want, scale) = (flat(&got), flat(&want), flat(&scale));
                for (i, ((g, w), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                    let tol = w.abs() * step + 1e-5 * s + 1e-6;
                    assert!(
                        (g - w).abs() <= tol,
                        "{dtype:?} {out}x{inp}, {m} rows, output {i}: {g} against {w}"
                    );
                }
            }
        }
    }
}

/// A deterministic tensor of `dims` with values in [-1, 1] of every magnitude.
fn wave(dims: &[usize], seed: f32, dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            ((i as f32 * 0.7548777 + seed * 0.5698403).fract() * 2.0 - 1.0) * ((i % 7) as f32 + 1.0)
                / 7.0
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn f32s(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// `x: [1, m, in] · w[out, in]ᵀ` in f32 on the CPU.
fn product(x: &Tensor, w: &Tensor) -> Tensor {
    x.matmul(&w.t().unwrap().unsqueeze(0).unwrap()).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The Q4_K GEMV (`kernels/cuda/gguf_gemv.cu`): a GGUF Q4_K matrix on the GPU (through
/// `GgufMatrix::forward`, as the model calls it) times 1-8 bf16/f16 rows, against the f32
/// product on the CPU of candle's dequantization of the same blocks and the same rounded
/// inputs; 9 rows take candle's kernels and are checked against a looser bound (they quantize
/// the input to 8 bits). Tolerance as above: the output's rounding step plus 1e-5 of Σ|w·x|.
/// Passed on an H100, 2026-12-07 (the kernel is off by default: slower than candle's).
#[test]
fn the_q4k_gemv_matches_the_dequantized_product() {
    // SAFETY: set before any other thread of this test binary reads the environment.
    unsafe { std::env::set_var("PEREGRINE_CUDA_GGUF_GEMV", "1") };
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};
    use peregrine_tensor::GgufMatrix;
    use std::sync::Arc;
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    for (out, inp) in [(8, 256), (1000, 768), (4096, 4096), (1024, 14336)] {
        let w = wave(&[out, inp], out as f32, DType::F32);
        let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
        let w32 = q.dequantize(&Device::Cpu).unwrap();
        // The same blocks on the GPU.
        let blocks = QStorage::from_data(q.data().unwrap(), &gpu, GgmlDType::Q4K).unwrap();
        let q_gpu = QTensor::new(blocks, (out, inp)).unwrap();
        let matrix = GgufMatrix::new(Arc::new(q_gpu)).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            for m in [1, 2, 8, 9] {
                let x = wave(&[1, m, inp], (m + out) as f32 + 0.5, dtype);
                let x32 = f32s(&x);
                let want = product(&x32, &w32);
                let scale = product(&x32.abs().unwrap(), &w32.abs().unwrap());
                let got = matrix.forward(&x.to_device(&gpu).unwrap()).unwrap();
                assert_eq!(got.dims(), want.dims());
                let got = got.to_device(&Device::Cpu).unwrap();
                let step = if dtype == DType::BF16 {
                    1.0 / 256.0
                } else {
                    1.0 / 2048.0
                };
                // candle's path (9 rows) multiplies 8-bit inputs: about 2⁻⁸ of Σ|w·x|.
                let loose = if m > 8 { 1.0 / 128.0 } else { 1e-5 };
                let (got, want, scale) = (flat(&f32s(&got)), flat(&want), flat(&scale));
                for (i, ((g, w), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                    let tol = w.abs() * step + loose * s + 1e-6;
                    assert!(
                        (g - w).abs() <= tol,
                        "{dtype:?} {out}x{inp}, {m} rows, output {i}: {g} against {w}"
                    );
                }
            }
        }
    }
}

/// GGUF matrices multiplied as a group on the GPU (`GgufMatrix::forward_group`: the input
/// quantized to 8 bits once for all of them, candle's MMVQ kernel per matrix) give
/// candle's `QMatMul` of each matrix alone bit for bit: the same kernels over the same 8-bit input. Q4_K, Q6_K
/// and Q8_0 matrices of different heights, 1, 3 and 8 bf16/f16 rows. Written 2026-12-07 after
/// that session's device time ran out: not yet run on a GPU.
#[test]
fn grouped_gguf_products_equal_each_alone() {
    // SAFETY: set before any other thread of this test binary reads the environment.
    unsafe { std::env::set_var("PEREGRINE_CUDA_MMVQ_GROUP", "1") };
    use candle_core::Module;
    use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
    use peregrine_tensor::GgufMatrix;
    use std::sync::Arc;
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let inp = 2048;
    let formats = [
        (GgmlDType::Q4K, 512),
        (GgmlDType::Q6K, 128),
        (GgmlDType::Q8_0, 96),
    ];
    let qs: Vec<Arc<QTensor>> = (formats.into_iter())
        .map(|(format, out)| {
            let w = wave(&[out, inp], out as f32, DType::F32);
            let q = QTensor::quantize(&w, format).unwrap();
            let blocks = QStorage::from_data(q.data().unwrap(), &gpu, format).unwrap();
            Arc::new(QTensor::new(blocks, (out, inp)).unwrap())
        })
        .collect();
    let mats: Vec<GgufMatrix> = qs
        .iter()
        .map(|q| GgufMatrix::new(q.clone()).unwrap())
        .collect();
    let refs: Vec<&GgufMatrix> = mats.iter().collect();
    for dtype in [DType::BF16, DType::F16] {
        for m in [1, 3, 8] {
            let x = wave(&[1, m, inp], m as f32 + 0.25, dtype)
                .to_device(&gpu)
                .unwrap();
            let grouped = GgufMatrix::forward_group(&refs, &x).unwrap();
            for (i, (q, y)) in qs.iter().zip(&grouped).enumerate() {
                // candle's own path for one matrix (not ours: another test turns on our GEMV).
                let alone = QMatMul::from_arc(q.clone()).unwrap().forward(&x).unwrap();
                assert_eq!(y.dims(), alone.dims());
                let host = |t: &Tensor| flat(&f32s(&t.to_device(&Device::Cpu).unwrap()));
                assert_eq!(host(y), host(&alone), "{dtype:?}, {m} rows, matrix {i}");
            }
        }
    }
}
