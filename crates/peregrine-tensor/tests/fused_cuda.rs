//! The fused CUDA element-wise kernels (`kernels/cuda/fused.cu`) against candle's separate ops
//! on the same GPU: the residual add with the RMSNorm after it, and SiLU times the up
//! projection, in bf16, f16 and f32, at 1-8 rows (and 77, which keeps the separate ops). Built only with the
//! `cuda` feature and run on a GPU machine (`cargo test -p peregrine-tensor --features cuda
//! --test fused_cuda`).
//!
//! Tolerance: the sum is one rounding of the same float sum on both sides, so it must be equal
//! bit for bit. The norm sums its squares in another order than candle's kernel, which can move
//! a normed value by one unit in its last place (at most 2⁻⁷ relative for bf16, 2⁻¹⁰ for f16;
//! 1e-6 for f32); SiLU·up rounds like the two ops it replaces, but takes SiLU in f32 where
//! candle's f16 kernel computes it in half precision, rounding its exponential, sum and
//! quotient, each by up to half a unit: two units apart on an H100 (0.47851563 against candle's
//! 0.4790039), so f16's SiLU·up is allowed four. A wrong row, column or weight moves values by
//! far more.
#![cfg(feature = "cuda")]

mod common;

use common::{close, flat, wave};
use peregrine_tensor::ops::{add_rms_norm, silu_mul};
use peregrine_tensor::{DType, Device};

#[test]
fn the_fused_kernels_match_candles_separate_ops() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // One unit in the last place, relative, at its widest (just above a power of two).
        let step = match dtype {
            DType::BF16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            _ => 1e-6,
        };
        // candle's half-precision SiLU (see above).
        let silu_step = if dtype == DType::F16 {
            4.0 * step
        } else {
            step
        };
        // Up to 8 rows take the fused kernels; 77 (a prefill chunk) the separate ops.
        for (rows, cols) in [(1, 4096), (3, 576), (8, 896), (2, 100), (77, 896)] {
            let seed = (rows * 13 + cols) as f32;
            let x = wave(&[1, rows, cols], seed, dtype, &gpu);
            let y = wave(&[1, rows, cols], seed + 1.0, dtype, &gpu);
            let w = wave(&[cols], seed + 2.0, dtype, &gpu);
            let (sum, normed) = add_rms_norm(&x, &y, &w, 1e-5).unwrap();
            let want_sum = (&x + &y).unwrap();
            let want_normed = candle_nn::ops::rms_norm(&want_sum, &w, 1e-5).unwrap();
            let case = format!("{dtype:?} {rows}x{cols}");
            assert_eq!(flat(&sum), flat(&want_sum), "{case}: the sum");
            close(
                &flat(&normed),
                &flat(&want_normed),
                (step, 1e-6),
                &format!("{case}: the norm"),
            );

            let gate = wave(&[rows, cols], seed + 3.0, dtype, &gpu);
            let up = wave(&[rows, cols], seed + 4.0, dtype, &gpu);
            let got = silu_mul(&gate, &up).unwrap();
            let want = (candle_nn::ops::silu(&gate).unwrap() * &up).unwrap();
            close(
                &flat(&got),
                &flat(&want),
                (silu_step, 1e-6),
                &format!("{case}: silu · up"),
            );
        }
    }
}
