//! Fused elementwise ops with their candle-op references. On CPU with f32 data they run as one
//! pass over the data split across rayon's pool (candle's versions take one pass per op and
//! spin-wait on a pool of their own); elsewhere they use candle's kernels.

use candle_core::{D, DType, Device, Result, Storage, Tensor};
use rayon::prelude::*;

/// Elements per rayon task for elementwise work: enough to amortise a join.
const CHUNK: usize = 1 << 14;

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let x = x.contiguous()?;
    let dim = x.dim(D::Minus1)?;
    let fused = with_f32(&x, |xs| with_f32(w, |ws| rms_norm_rows(xs, ws, dim, eps)))?;
    match fused.transpose()?.flatten() {
        Some(out) => Tensor::from_vec(out, x.shape(), &Device::Cpu),
        None => candle_nn::ops::rms_norm(&x, w, eps),
    }
}

/// `(x + y, rms_norm(x + y, w))`: a residual add and the norm after it (one launch on CUDA,
/// the two ops elsewhere).
pub fn add_rms_norm(x: &Tensor, y: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some(both) = crate::fused_cuda::add_rms_norm(x, y, w, eps)? {
        return Ok(both);
    }
    let sum = (x + y)?;
    let normed = rms_norm(&sum, w, eps)?;
    Ok((sum, normed))
}

fn rms_norm_rows(xs: &[f32], ws: &[f32], dim: usize, eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; xs.len()];
    out.par_chunks_mut(dim)
        .zip(xs.par_chunks(dim))
        .with_min_len((CHUNK / dim).max(1))
        .for_each(|(y, x)| rms_norm_into(x, ws, eps, y));
    out
}

/// One row of [`rms_norm`] into `out` (the allocation-free decode step's form).
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inverse_rms(x, eps);
    for ((y, x), w) in out.iter_mut().zip(x).zip(w) {
        *y = x * inv * w;
    }
}

/// [`rms_norm_into`] over each `w.len()`-wide row of `x`, in place (per-head q/k norms).
pub fn rms_norm_rows_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let inv = inverse_rms(row, eps);
        row.iter_mut().zip(w).for_each(|(x, w)| *x = *x * inv * w);
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    // Eight running sums: a loop the compiler can vectorise (one sum would be serial).
    let mut sums = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        sums.iter_mut().zip(c).for_each(|(s, v)| *s += v * v);
    }
    let mean = (sums.iter().sum::<f32>() + tail) / x.len() as f32;
    1.0 / (mean + eps).sqrt()
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
    #[cfg(feature = "cuda")]
    if let Some(y) = crate::fused_cuda::silu_mul(gate, up)? {
        return Ok(y);
    }
    if gate.shape() == up.shape() {
        let fused = with_f32(gate, |g| with_f32(up, |u| silu_mul_chunks(g, u)))?;
        if let Some(out) = fused.transpose()?.flatten() {
            return Tensor::from_vec(out, gate.shape(), &Device::Cpu);
        }
    }
    candle_nn::ops::silu(gate)? * up
}

fn silu_mul_chunks(g: &[f32], u: &[f32]) -> Vec<f32> {
    gated(g, u, silu)
}

/// `g · sigmoid(g)`.
#[inline]
pub fn silu(g: f32) -> f32 {
    times_sigmoid(g, g)
}

/// `x · sigmoid(z)` from `e^-|z|` alone, so that no exponential overflows and the loops that
/// call it vectorise (libm's `expf` is a call per element).
#[inline(always)]
fn times_sigmoid(x: f32, z: f32) -> f32 {
    let e = exp_nonpositive(-z.abs());
    // σ(z) = 1 / (1 + e^-z) for z ≥ 0, e^z / (1 + e^z) below.
    let numerator = if z >= 0.0 { x } else { x * e };
    numerator / (1.0 + e)
}

/// `e^x` for `x ≤ 0` (scores less their row's maximum), Cephes' `expf` reduction and polynomial:
/// `x = n·ln2 + r`, `|r| ≤ ln2/2`, `e^r` by a degree-6 polynomial, `2^n` built in the exponent
/// bits. Relative error under 2e-7 (f32 rounding: libm's is 1 ulp); below -87 it returns 0, as
/// `e^x` is then under f32's smallest normal number.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer without a rounding instruction.
    const ROUND: f32 = 12_582_912.0;
    // The low mantissa bits of 1.5·2^23 + n hold n + 0x400000 (|n| < 2^22).
    const ROUND_BITS: u32 = 0x4B40_0000;
    let clamped = x.max(-87.0);
    let shifted = clamped * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 5e-1;
    // 2^n from n's integer bits: a float-to-int cast would not vectorise (Rust's saturates).
    let two_n = f32::from_bits(shifted.to_bits().wrapping_sub(ROUND_BITS - 127) << 23);
    let e = (p * r * r + r + 1.0) * two_n;
    if x < -87.0 { 0.0 } else { e }
}

/// `gelu(gate) * up` with GELU's tanh approximation (Gemma's `gelu_pytorch_tanh`).
pub fn gelu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() == up.shape() {
        let fused = with_f32(gate, |g| with_f32(up, |u| gated(g, u, gelu_tanh)))?;
        if let Some(out) = fused.transpose()?.flatten() {
            return Tensor::from_vec(out, gate.shape(), &Device::Cpu);
        }
    }
    gelu_mul_ref(gate, up)
}

/// Reference `gelu(gate) * up`: candle's tanh-approximated `gelu`.
pub fn gelu_mul_ref(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.gelu()? * up
}

#[inline]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x);
    // (1 + tanh y) / 2 = sigmoid(2y): one exponential instead of libm's slower `tanhf` (a
    // tenth of Gemma's prefill); exact at both tails.
    times_sigmoid(x, 2.0 * y)
}

/// `act(g) * u` elementwise, in parallel chunks.
fn gated(g: &[f32], u: &[f32], act: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = g.to_vec();
    out.par_chunks_mut(CHUNK)
        .zip(u.par_chunks(CHUNK))
        .for_each(|(g, u)| gate_in_place(g, u, &act));
    out
}

/// `g = act(g) * u`, in 256-bit vectors where the CPU has them (no fused operations: the same
/// bits either way).
fn gate_in_place(g: &mut [f32], u: &[f32], act: &impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::Kernel::best().has_avx2() {
        // SAFETY: the CPU has AVX2.
        return unsafe { gate_in_place_avx2(g, u, act) };
    }
    gate_in_place_portable(g, u, act)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn gate_in_place_avx2(g: &mut [f32], u: &[f32], act: &impl Fn(f32) -> f32) {
    gate_in_place_portable(g, u, act)
}

#[inline(always)]
fn gate_in_place_portable(g: &mut [f32], u: &[f32], act: &impl Fn(f32) -> f32) {
    g.iter_mut().zip(u).for_each(|(g, u)| *g = act(*g) * u);
}

/// The gated-MLP activations, for the slice form [`Gate::apply_in_place`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// [`silu_mul`].
    Silu,
    /// [`gelu_mul`].
    GeluTanh,
}

impl Gate {
    /// `gate = act(gate) * up`, one thread (a decode step's few thousand values).
    pub fn apply_in_place(self, gate: &mut [f32], up: &[f32]) {
        // Each arm its own instance: through a function pointer the loop would not vectorise.
        match self {
            Self::Silu => gate_in_place(gate, up, &silu),
            Self::GeluTanh => gate_in_place(gate, up, &gelu_tanh),
        }
    }
}

/// `f` over a contiguous f32 CPU tensor's elements; `None` for any other tensor.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<Option<R>> {
    if t.dtype() != DType::F32 || !matches!(t.device(), Device::Cpu) {
        return Ok(None);
    }
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return Ok(None);
    };
    Ok(Some(f(&cpu.as_slice::<f32>()?[start..end])))
}

/// `f` over a contiguous bf16 CPU tensor's elements, without copying; `None` for any other
/// tensor.
pub fn with_bf16<R>(t: &Tensor, f: impl FnOnce(&[half::bf16]) -> R) -> Result<Option<R>> {
    if t.dtype() != DType::BF16 || !matches!(t.device(), Device::Cpu) {
        return Ok(None);
    }
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return Ok(None);
    };
    Ok(Some(f(&cpu.as_slice::<half::bf16>()?[start..end])))
}

/// `1 / (1 + exp(-x))` elementwise, from plain ops.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// Reference `silu(gate) * up`: `gate * sigmoid(gate) * up` from plain ops.
pub fn silu_mul_ref(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    (gate * sigmoid(gate)?)? * up
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

/// The rows of `t` (`[n, len]`) as f32, copied into `rows`, which becomes `n` long: vectors
/// already there keep their allocations (a decode step's logits reuse the last step's, instead
/// of a fresh megabyte per row of a large vocabulary).
pub fn rows_into(t: &Tensor, rows: &mut Vec<Vec<f32>>) -> Result<()> {
    let (n, len) = t.dims2()?;
    let t = t
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .contiguous()?;
    let copied = with_f32(&t, |data| {
        rows.resize_with(n, Vec::new);
        for (i, row) in rows.iter_mut().enumerate() {
            row.clear();
            row.extend_from_slice(&data[i * len..][..len]);
        }
    })?;
    copied
        .ok_or_else(|| candle_core::Error::Msg("rows_into: not a contiguous f32 CPU tensor".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm_over_the_softmax_range() {
        let mut worst = 0f32;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (exp_nonpositive(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-1000.0), 0.0);
    }

    #[test]
    fn silu_and_gelu_are_within_a_few_ulp_of_their_f64_forms_and_exact_at_the_tails() {
        let (mut worst_silu, mut worst_gelu) = (0f64, 0f64);
        for i in -300_000..=300_000 {
            let x = i as f32 * 1e-4;
            let xd = x as f64;
            let silu_want = xd / (1.0 + (-xd).exp());
            let y = 0.797_884_6f32 as f64 * xd * (1.0 + 0.044715 * xd * xd);
            let gelu_want = 0.5 * xd * (1.0 + y.tanh());
            // Relative to the value, or absolute near zero (where both vanish).
            let err = |got: f32, want: f64| (got as f64 - want).abs() / want.abs().max(1e-3);
            worst_silu = worst_silu.max(err(silu(x), silu_want));
            worst_gelu = worst_gelu.max(err(gelu_tanh(x), gelu_want));
        }
        // f32 rounding of a few operations and the exponential's 2e-7 (the earlier gelu,
        // `1 - 2 / (e^2y + 1)`, lost up to 3e-4 to cancellation where gelu is small).
        assert!(worst_silu < 2e-6, "silu: worst relative error {worst_silu}");
        assert!(worst_gelu < 2e-6, "gelu: worst relative error {worst_gelu}");
        for act in [silu, gelu_tanh] {
            assert_eq!(act(1e4), 1e4);
            assert_eq!(act(f32::INFINITY), f32::INFINITY);
            assert_eq!(act(-1e4), 0.0);
            assert!(act(f32::NAN).is_nan());
        }
    }
}
