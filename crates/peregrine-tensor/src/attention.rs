//! Scaled dot-product attention with grouped-query heads, causal and sliding-window masks.

use candle_core::{D, Device, Result, Tensor};

/// Which keys a query may see, in absolute positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskSpec {
    /// Absolute position of the first query row.
    pub q_start: usize,
    /// Absolute position of the first key column.
    pub k_start: usize,
    /// Query `q` sees key `k` only when `q - k < window` (transformers' convention).
    pub window: Option<usize>,
}

impl MaskSpec {
    /// True when no key needs masking for `q_len` queries over `k_len` keys.
    pub fn is_trivial(&self, q_len: usize, k_len: usize) -> bool {
        let last_key = self.k_start + k_len - 1;
        let causal_ok = last_key <= self.q_start;
        let window_ok = self
            .window
            .is_none_or(|w| self.q_start + q_len - 1 - self.k_start < w);
        causal_ok && window_ok
    }

    /// Additive mask `[q_len, k_len]`: 0 where visible, -inf where not.
    pub fn build(&self, q_len: usize, k_len: usize, device: &Device) -> Result<Tensor> {
        let mut mask = Vec::with_capacity(q_len * k_len);
        for i in 0..q_len {
            let q = self.q_start + i;
            for j in 0..k_len {
                let k = self.k_start + j;
                let visible = k <= q && self.window.is_none_or(|w| q - k < w);
                mask.push(if visible { 0f32 } else { f32::NEG_INFINITY });
            }
        }
        Tensor::from_vec(mask, (q_len, k_len), device)
    }
}

/// Attention for `q: [b, heads, q_len, d]` over `k, v: [b, kv_heads, k_len, d]` (k/v in any
/// float dtype, e.g. a narrower cache). On CPU a fused kernel reads k/v in place; elsewhere
/// query heads are grouped onto their kv head by reshaping, so k/v are never repeated.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &MaskSpec,
) -> Result<Tensor> {
    if let Some(y) = crate::attention_cpu::attention(q, k, v, scale, mask)? {
        return Ok(y);
    }
    let (k, v) = (&k.to_dtype(q.dtype())?, &v.to_dtype(q.dtype())?);
    let (b, heads, q_len, d) = q.dims4()?;
    let (_, kv_heads, k_len, _) = k.dims4()?;
    let groups = heads / kv_heads;
    // [kv_heads, groups * q_len, d]: query heads of one kv head stacked as rows.
    let q = (q.reshape((b * kv_heads, groups * q_len, d))? * scale)?;
    // Squeezing keeps a strided cache view as it is; reshape would copy it.
    let flat = |t: &Tensor| {
        if b == 1 {
            t.squeeze(0)
        } else {
            t.reshape((b * kv_heads, k_len, d))
        }
    };
    let (k, v) = (flat(k)?, flat(v)?);
    let scores = q.matmul(&k.t()?)?;
    let scores = if mask.is_trivial(q_len, k_len) {
        scores
    } else {
        let m = mask
            .build(q_len, k_len, q.device())?
            .to_dtype(scores.dtype())?;
        scores
            .reshape((b * kv_heads, groups, q_len, k_len))?
            .broadcast_add(&m)?
            .reshape((b * kv_heads, groups * q_len, k_len))?
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    probs.matmul(&v)?.reshape((b, heads, q_len, d))
}

/// Reference attention: k/v repeated per query head, plain softmax, f32.
pub fn attention_ref(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &MaskSpec,
) -> Result<Tensor> {
    let (_, heads, q_len, _) = q.dims4()?;
    let (_, kv_heads, k_len, _) = k.dims4()?;
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let (b, h, l, d) = t.dims4()?;
        t.unsqueeze(2)?
            .repeat((1, 1, heads / kv_heads, 1, 1))?
            .reshape((b, h * heads / kv_heads, l, d))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let m = mask
        .build(q_len, k_len, q.device())?
        .to_dtype(scores.dtype())?;
    let scores = scores.broadcast_add(&m)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    probs.matmul(&v.contiguous()?)
}

/// Buffers that [`attention_row_into`] reuses from one decode step to the next.
#[derive(Debug, Default)]
pub struct AttnScratch(crate::attention_cpu::Scratch);

/// One token's attention on the CPU without allocating (the decode step): `q` holds its query
/// heads (`heads · d` f32), `k, v: [1, kv_heads, capacity, d]` (f32/f16/bf16) are a cache's
/// tensors of which slots `slots` hold the keys `mask` numbers from `mask.k_start` on; the
/// result overwrites `out` (`heads · d`). Same arithmetic as [`attention`] on the CPU.
#[allow(clippy::too_many_arguments)]
pub fn attention_row_into(
    q: &[f32],
    k: &Tensor,
    v: &Tensor,
    slots: std::ops::Range<usize>,
    scale: f64,
    mask: &MaskSpec,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) -> Result<()> {
    crate::attention_cpu::attention_row_into(q, k, v, slots, scale, mask, out, &mut scratch.0)
}
