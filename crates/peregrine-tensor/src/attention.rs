//! Scaled dot-product attention with grouped-query heads, causal and sliding-window masks, and
//! optional soft-capping of the scores (Gemma 2's `cap · tanh(s / cap)` before the mask).

use candle_core::{D, DType, Device, Result, Tensor};
use half::{bf16, f16};

#[cfg(feature = "cuda")]
pub use crate::attention_cuda::{decode_attention, decode_attention_many};

/// Whether [`attention_many`] may take a batch (a CUDA build, unless `PEREGRINE_CUDA_BATCH_ATTN=0`).
pub fn many_enabled() -> bool {
    #[cfg(feature = "cuda")]
    return crate::attention_cuda::batch_enabled();
    #[cfg(not(feature = "cuda"))]
    false
}

/// A decode step's attention for many sequences at once, each over its own cache: `q:
/// [sequences, heads, d]`, `kvs[s]` sequence `s`'s visible keys and values (`[1, kv_heads, n,
/// d]`, all of them seen: one new position each). `[sequences, heads, d]` in `dtype`; `None`
/// where no batched kernel takes them (the CPU, other layouts, `PEREGRINE_CUDA_BATCH_ATTN=0`):
/// attend each alone.
pub fn attention_many(
    q: &Tensor,
    kvs: &[(Tensor, Tensor)],
    (scale, softcap): (f64, Option<f32>),
    dtype: DType,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if crate::attention_cuda::batch_enabled()
        && let Some(y) =
            crate::attention_cuda::decode_attention_many(q, kvs, (scale, softcap), dtype)?
    {
        return Ok(Some(y));
    }
    let _ = (q, kvs, scale, softcap, dtype);
    Ok(None)
}

/// One row of a decode step's keys and values going into a sequence's cache, for
/// [`append_rows`]: row `row` (axis 2) of the step's keys and values to slot `slot` of the
/// cache's buffers `k, v` (`[1, kv_heads, capacity, d]`).
#[derive(Debug, Clone)]
pub struct AppendSlot {
    /// The row of the step's keys and values.
    pub row: usize,
    /// The cache's key buffer.
    pub k: Tensor,
    /// The cache's value buffer.
    pub v: Tensor,
    /// The slot the row goes to.
    pub slot: usize,
}

/// Whether [`append_rows`] takes a step's keys and values `k, v: [1, kv_heads, rows, d]` into
/// caches of `cache_dtype`: a CUDA build, float tensors on the GPU, each head's row contiguous.
pub fn append_rows_takes(k: &Tensor, v: &Tensor, cache_dtype: DType) -> bool {
    #[cfg(feature = "cuda")]
    return crate::kv_append_cuda::takes(k, v, cache_dtype);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, cache_dtype);
        false
    }
}

/// Writes each slot's row of `k, v` into its cache's buffers in place, converted to their
/// dtype, in one launch (where [`append_rows_takes`] holds; an error elsewhere). The caller
/// owns the buffers and has made room in them.
pub fn append_rows(k: &Tensor, v: &Tensor, slots: &[AppendSlot]) -> Result<()> {
    #[cfg(feature = "cuda")]
    return crate::kv_append_cuda::append_rows(k, v, slots);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, slots);
        candle_core::bail!("kv append: rows of many caches at once need a CUDA build")
    }
}

/// Which keys a query may see, in absolute positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskSpec {
    /// Absolute position of the first query row.
    pub q_start: usize,
    /// Absolute position of the first key column.
    pub k_start: usize,
    /// Query `q` sees key `k` only when `q - k < window` (transformers' convention).
    pub window: Option<usize>,
    /// Positions `[start, end)` that see each other both ways besides the causal rule (an
    /// image's tokens in Gemma 3); the span's keys must all be in the cache.
    pub both_ways: Option<(usize, usize)>,
}

impl MaskSpec {
    /// True when no key needs masking for `q_len` queries over `k_len` keys.
    pub fn is_trivial(&self, q_len: usize, k_len: usize) -> bool {
        if self.both_ways.is_some() {
            return false;
        }
        let last_key = self.k_start + k_len - 1;
        let causal_ok = last_key <= self.q_start;
        let window_ok = self
            .window
            .is_none_or(|w| self.q_start + q_len - 1 - self.k_start < w);
        causal_ok && window_ok
    }

    /// The keys the query at absolute position `pos` sees: positions `[lo, hi)`.
    pub fn keys_of(&self, pos: usize) -> (usize, usize) {
        let lo = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        match self.both_ways {
            // The span's tokens see all of it, and what the causal window shows them.
            Some((start, end)) if (start..end).contains(&pos) => (lo.min(start), end),
            _ => (lo, pos + 1),
        }
    }

    /// Additive mask `[q_len, k_len]`: 0 where visible, -inf where not.
    pub fn build(&self, q_len: usize, k_len: usize, device: &Device) -> Result<Tensor> {
        let mut mask = Vec::with_capacity(q_len * k_len);
        for i in 0..q_len {
            let (lo, hi) = self.keys_of(self.q_start + i);
            for j in 0..k_len {
                let visible = (lo..hi).contains(&(self.k_start + j));
                mask.push(if visible { 0f32 } else { f32::NEG_INFINITY });
            }
        }
        Tensor::from_vec(mask, (q_len, k_len), device)
    }
}

/// `cap · tanh(s / cap)` of scores `s`: a soft cap at `±cap` (Gemma 2's attention and output
/// logits), computed as transformers computes it.
pub fn softcap(s: &Tensor, cap: f32) -> Result<Tensor> {
    (s / cap as f64)?.tanh()? * cap as f64
}

/// Attention for `q: [b, heads, q_len, d]` over `k, v: [b, kv_heads, k_len, d]` (k/v in any
/// float dtype, e.g. a narrower cache). Scores are `scale · q·k`, soft-capped at `softcap`
/// when set. On CPU a fused kernel reads k/v in place; elsewhere query heads are grouped onto
/// their kv head by reshaping, so k/v are never repeated.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    softcap: Option<f32>,
    mask: &MaskSpec,
) -> Result<Tensor> {
    if let Some(y) = crate::attention_cpu::attention(q, k, v, scale, softcap, mask)? {
        return Ok(y);
    }
    let out_dtype = q.dtype();
    // One new token (decode): the split-keys kernel where it takes these tensors.
    #[cfg(feature = "cuda")]
    if q.dim(2)? == 1
        && crate::attention_cuda::enabled()
        && mask.is_trivial(1, k.dim(2)?)
        && let Some(y) = decode_attention(q, k, v, scale, softcap)?
    {
        return y.to_dtype(out_dtype);
    }
    // Off the CPU the queries take the cache's dtype (a copy of a few rows), not the cache the
    // queries' (a copy of the whole cache every step); the output goes back to the queries'.
    let work = match k.dtype() {
        DType::F16 | DType::BF16 if !q.device().is_cpu() && v.dtype() == k.dtype() => k.dtype(),
        _ => out_dtype,
    };
    let (q, k, v) = (&q.to_dtype(work)?, &k.to_dtype(work)?, &v.to_dtype(work)?);
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
    let scores = match softcap {
        Some(cap) => self::softcap(&scores, cap)?,
        None => scores,
    };
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
    probs
        .matmul(&v)?
        .reshape((b, heads, q_len, d))?
        .to_dtype(out_dtype)
}

/// Reference attention: k/v repeated per query head, plain softmax, f32.
pub fn attention_ref(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    softcap: Option<f32>,
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
    let scores = match softcap {
        Some(cap) => self::softcap(&scores, cap)?,
        None => scores,
    };
    let m = mask
        .build(q_len, k_len, q.device())?
        .to_dtype(scores.dtype())?;
    let scores = scores.broadcast_add(&m)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    probs.matmul(&v.contiguous()?)
}

/// One layer's keys or values held on the CPU by a cache, `[kv_heads, capacity, head_dim]`
/// row-major in the cache's element type: attention reads them in place, never widened into a
/// copy.
#[derive(Debug, Clone, Copy)]
pub enum CpuRows<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements (llama.cpp's default cache precision).
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// Affine-quantized rows (`--kv-bits`).
    Quant(QuantPlane<'a>),
}

/// Affine-quantized cache rows: each row's values in groups of `group`, value
/// `scale · code + bias`. Codes are `bits` (4 or 8) wide, packed in row order (at 4 bits,
/// element `2i` is byte `i`'s low nibble); `params` holds each row's `(scale, bias)` pairs in
/// group order. [`quantize_rows`] writes this layout.
#[derive(Debug, Clone, Copy)]
pub struct QuantPlane<'a> {
    /// `bits / 8` bytes per value.
    pub codes: &'a [u8],
    /// Two per group: scale, then bias.
    pub params: &'a [f16],
    /// Code width: 4 or 8.
    pub bits: u8,
    /// Values per `(scale, bias)` pair: a multiple of 16 dividing the row length.
    pub group: usize,
}

impl CpuRows<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::F16(x) => x.len(),
            Self::BF16(x) => x.len(),
            Self::Quant(x) => x.codes.len() * 8 / x.bits as usize,
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A layer's cache on the CPU as attention reads it: keys and values of one element type,
/// `[kv_heads, capacity, head_dim]` each.
#[derive(Debug, Clone, Copy)]
pub struct CpuKv<'a> {
    pub(crate) k: CpuRows<'a>,
    pub(crate) v: CpuRows<'a>,
    pub(crate) kv_heads: usize,
    pub(crate) capacity: usize,
    pub(crate) head_dim: usize,
}

impl<'a> CpuKv<'a> {
    /// Keys and values of `kv_heads × capacity × head_dim` elements each, of one element type.
    pub fn new(
        k: CpuRows<'a>,
        v: CpuRows<'a>,
        kv_heads: usize,
        capacity: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let same_type = std::mem::discriminant(&k) == std::mem::discriminant(&v);
        let plane = kv_heads * capacity * head_dim;
        let quant_ok = |rows: &CpuRows| match rows {
            CpuRows::Quant(q) => {
                let rows = kv_heads * capacity;
                let (_, params) = crate::attention_cpu::row_sizes(head_dim, q.bits, q.group);
                matches!(q.bits, 4 | 8)
                    && q.group.is_multiple_of(16)
                    && head_dim.is_multiple_of(q.group)
                    && q.params.len() == rows * params
            }
            _ => true,
        };
        if !same_type || k.len() != plane || v.len() != plane || !quant_ok(&k) || !quant_ok(&v) {
            candle_core::bail!(
                "kv rows: {:?}/{:?} of {}/{} elements for {kv_heads} × {capacity} × {head_dim}",
                std::mem::discriminant(&k),
                std::mem::discriminant(&v),
                k.len(),
                v.len()
            )
        }
        Ok(Self {
            k,
            v,
            kv_heads,
            capacity,
            head_dim,
        })
    }
}

pub use crate::attention_cpu::{
    AttnScratch, attention_kv, attention_row_into, quantize_rows, row_sizes,
};
