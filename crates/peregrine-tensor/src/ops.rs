//! Fused elementwise ops with their candle-op references.

use candle_core::{D, DType, Result, Tensor};

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) * w` (candle's fused kernel).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)
}

/// Reference RMSNorm built from plain candle ops, computed in f32.
pub fn rms_norm_ref(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps as f64)?.sqrt()?;
    x.broadcast_div(&rms)?
        .broadcast_mul(&w.to_dtype(DType::F32)?)?
        .to_dtype(dtype)
}

/// `silu(gate) * up`, the gated-MLP activation.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    candle_nn::ops::silu(gate)? * up
}

/// Reference `silu(gate) * up`: `gate * sigmoid(gate) * up` from plain ops.
pub fn silu_mul_ref(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let sigmoid = (gate.neg()?.exp()? + 1.0)?.recip()?;
    (gate * sigmoid)? * up
}

/// Largest absolute elementwise difference of two same-shaped tensors, as f32: the measure every
/// parity check (fused vs `*_ref`, ours vs a reference implementation) uses.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar()
}
