//! Refined activations: each input row's blocks of largest scale carried to ~16 bits by a residual
//! block (`quant::Refinement`). On a row whose one outlier makes its block's step coarse, every
//! kernel and layout of the 32-value formats gives the exact product of the dequantized weights
//! to within the other blocks' rounding, where plain 8-bit blocks would lose the outlier block's
//! small values entirely; formats that take no refinements are unchanged.

mod common;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use peregrine_tensor::GgufMatrix;
use peregrine_tensor::quant::{Format, Kernel, QK};

use common::Rng;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n).map(|_| rng.uniform()).collect()
}

/// Input rows of small values (|x| ≤ 0.05) with one outlier of 50 in block `row % blocks`.
fn outlier_rows(m: usize, k: usize) -> Vec<f32> {
    let mut x: Vec<f32> = values(m * k, 7).iter().map(|v| v * 0.05).collect();
    for (i, row) in x.chunks_mut(k).enumerate() {
        row[(i % (k / QK)) * QK + 3] = 50.0;
    }
    x
}

#[test]
fn the_outlier_block_is_exact_in_every_kernel_and_layout() {
    let (n, k) = (24, 256);
    let formats = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ];
    for dtype in formats {
        let w = Tensor::from_vec(values(n * k, 3), (n, k), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        let wf: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let refines = Format::of(dtype).unwrap().refines();
        for layout in [
            GgufMatrix::new(q.clone()).unwrap(),
            GgufMatrix::new_rows(q.clone()).unwrap(),
        ] {
            // Decode, a 4-input tile plus a tail, and a prefill-sized batch (the panel GEMM).
            for m in [1, 6, 20] {
                let x = outlier_rows(m, k);
                for kernel in Kernel::available() {
                    let y = layout.matmul_with(&x, m, kernel).unwrap();
                    for (o, &got) in y.iter().enumerate() {
                        let (xr, wr) = (&x[o / n * k..][..k], &wf[o % n * k..][..k]);
                        let exact: f64 = xr.iter().zip(wr).map(|(x, w)| f64::from(x * w)).sum();
                        // The other blocks' 8-bit rounding (amax 0.05: half-steps of 0.05/254),
                        // plus f16-rounded scales: ~1e-3 in all.
                        let small: f32 = (xr.iter().zip(wr))
                            .filter(|(x, _)| x.abs() < 1.0)
                            .map(|(x, w)| (x * w).abs())
                            .sum();
                        let err = (f64::from(got) - exact).abs();
                        let case = format!(
                            "{dtype:?} interleaved={} {kernel:?} m={m} out {o}",
                            layout.is_interleaved()
                        );
                        if refines {
                            assert!(
                                err <= 0.02 * f64::from(small) + 2e-3,
                                "{case}: {got} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
        if refines {
            continue;
        }
        // The K-quants take no refinements: their error on these rows is the outlier block's
        // step (a check that the rows exercise what the refinement fixes).
        let m = 6;
        let x = outlier_rows(m, k);
        let y = GgufMatrix::new(q.clone())
            .unwrap()
            .matmul_with(&x, m, Kernel::best())
            .unwrap();
        let worst = y.iter().enumerate().map(|(o, &got)| {
            let (xr, wr) = (&x[o / n * k..][..k], &wf[o % n * k..][..k]);
            let exact: f64 = xr.iter().zip(wr).map(|(x, w)| f64::from(x * w)).sum();
            (f64::from(got) - exact).abs()
        });
        assert!(
            worst.fold(0f64, f64::max) > 0.02,
            "{dtype:?}: rows without a coarse block"
        );
    }
}
