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

mod common;

use common::{f32s, flat, product, ramp};
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
                let w = ramp(&[out, inp], seed, dtype);
                let x = ramp(&[1, m, inp], seed + 1.0, dtype);
                let layer = QLinear::Dense {
                    w: w.to_device(&gpu).unwrap(),
                    b: None,
                };
                let got = layer.forward(&x.to_device(&gpu).unwrap()).unwrap();
                check(&got, &x, &w, &format!("{dtype:?} {out}x{inp}, {m} rows"));
            }
        }
    }
}

/// `got` (on the GPU) against the f32 product of `x` and `w` within the tolerance above.
fn check(got: &Tensor, x: &Tensor, w: &Tensor, what: &str) {
    let (x32, w32) = (f32s(x), f32s(w));
    let want = product(&x32, &w32);
    let scale = product(&x32.abs().unwrap(), &w32.abs().unwrap());
    assert_eq!(got.dims(), want.dims(), "{what}");
    let got = got
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let step = if x.dtype() == DType::BF16 {
        1.0 / 256.0
    } else {
        1.0 / 2048.0
    };
    let (got, want, scale) = (flat(&got), flat(&want), flat(&scale));
    for (i, ((g, w), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
        let tol = w.abs() * step + 1e-5 * s + 1e-6;
        assert!((g - w).abs() <= tol, "{what}, output {i}: {g} against {w}");
    }
}

/// Dense layers that read one input (q/k/v, gate/up) in one launch (`QLinear::forward_group`
/// through the group kernel): each output against its own matrix's f32 product, three
/// matrices of different heights (the warps of one launch split between them), 1-8 rows.
#[test]
fn grouped_dense_products_match_the_f32_product() {
    // SAFETY: set before any other thread of this test binary reads the environment.
    unsafe { std::env::set_var("PEREGRINE_CUDA_GEMV_ROWS", "8") };
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    for dtype in [DType::BF16, DType::F16] {
        for (outs, inp) in [([1000, 64, 8], 776), ([4096, 1024, 1024], 4096)] {
            let ws: Vec<Tensor> = (outs.iter())
                .map(|&out| ramp(&[out, inp], (out + inp) as f32, dtype))
                .collect();
            let layers: Vec<QLinear> = (ws.iter())
                .map(|w| QLinear::Dense {
                    w: w.to_device(&gpu).unwrap(),
                    b: None,
                })
                .collect();
            let refs: Vec<&QLinear> = layers.iter().collect();
            for m in [1, 3, 8] {
                let x = ramp(&[1, m, inp], m as f32 + 0.5, dtype);
                let ys = QLinear::forward_group(&refs, &x.to_device(&gpu).unwrap()).unwrap();
                for (i, (y, w)) in ys.iter().zip(&ws).enumerate() {
                    check(
                        y,
                        &x,
                        w,
                        &format!("{dtype:?} matrix {i} of {outs:?}, {m} rows"),
                    );
                }
            }
        }
    }
}

/// GGUF matrices multiplied as a group on the GPU (`GgufMatrix::forward_group`: the input
/// quantized to 8 bits once for all of them, candle's MMVQ kernel per matrix) give
/// candle's `QMatMul` of each matrix alone bit for bit: the same kernels over the same 8-bit input. Q4_K, Q6_K
/// and Q8_0 matrices of different heights, 1, 3 and 8 bf16/f16 rows.
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
            let w = ramp(&[out, inp], out as f32, DType::F32);
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
            let x = ramp(&[1, m, inp], m as f32 + 0.25, dtype)
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
