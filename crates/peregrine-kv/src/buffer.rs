//! A growable k/v buffer shared by the cache variants.

use half::{bf16, f16};
use peregrine_tensor::attention::{AttnScratch, MaskSpec, attention, attention_row_into};
use peregrine_tensor::candle::{CpuStorage, InplaceOp1, Layout};
use peregrine_tensor::{DType, Device, Result, Tensor};

use crate::AttnParams;

/// Rounds allocations up so that decode rarely reallocates.
const GROW_STEP: usize = 256;

/// k and v stored as `[1, kv_heads, capacity, head_dim]`; slots `0..used` hold positions
/// `start..start + used`.
#[derive(Debug, Clone, Default)]
pub(crate) struct KvBuffer {
    kv: Option<(Tensor, Tensor)>,
    /// Storage dtype; `None` keeps the activations' dtype.
    pub(crate) dtype: Option<DType>,
    pub(crate) start: usize,
    pub(crate) used: usize,
}

impl KvBuffer {
    /// An empty buffer storing k/v in `dtype` (`None`: the activations' dtype).
    pub(crate) fn new(dtype: Option<DType>) -> Self {
        Self {
            dtype,
            ..Self::default()
        }
    }

    pub(crate) fn end(&self) -> usize {
        self.start + self.used
    }

    fn capacity(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Appends `n` positions; when `keep` is set, first drops all but the last `keep` stored
    /// positions if the buffer would otherwise grow.
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor, keep: Option<usize>) -> Result<()> {
        let (_, heads, n, head_dim) = k.dims4()?;
        let dtype = self.dtype.unwrap_or(k.dtype());
        self.make_room(n, keep, (heads, head_dim), dtype, k.device())?;
        let (bk, bv) = self.kv.as_ref().expect("allocated above");
        bk.slice_set(&k.to_dtype(bk.dtype())?.contiguous()?, 2, self.used)?;
        bv.slice_set(&v.to_dtype(bv.dtype())?.contiguous()?, 2, self.used)?;
        self.used += n;
        Ok(())
    }

    /// [`append`](Self::append) of one position from f32 rows on the CPU, written in place.
    pub(crate) fn append_row(
        &mut self,
        k: &[f32],
        v: &[f32],
        head_dim: usize,
        keep: Option<usize>,
    ) -> Result<()> {
        let heads = k.len() / head_dim;
        let dtype = self.dtype.unwrap_or(DType::F32);
        self.make_room(1, keep, (heads, head_dim), dtype, &Device::Cpu)?;
        let (bk, bv) = self.kv.as_ref().expect("allocated above");
        bk.inplace_op1(&WriteRow {
            row: k,
            slot: self.used,
        })?;
        bv.inplace_op1(&WriteRow {
            row: v,
            slot: self.used,
        })?;
        self.used += 1;
        Ok(())
    }

    /// Makes room for `n` more positions of `(heads, head_dim)`, dropping all but the last
    /// `keep` stored positions first when the buffer would otherwise grow.
    fn make_room(
        &mut self,
        n: usize,
        keep: Option<usize>,
        (heads, head_dim): (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        if self.used + n <= self.capacity() {
            return Ok(());
        }
        let kept = keep.map_or(self.used, |keep| keep.min(self.used));
        // Once positions start dropping, room for two windows makes moves rare; before
        // that, grow in steps (a short prompt should not zero a whole window's pages).
        let want = match keep {
            Some(keep) if kept + n > keep => (kept + n).max(2 * keep),
            _ => kept + n,
        };
        let capacity = want.div_ceil(GROW_STEP) * GROW_STEP;
        let new_k = Tensor::zeros((1, heads, capacity, head_dim), dtype, device)?;
        let new_v = new_k.zeros_like()?;
        if let Some((k, v)) = &self.kv {
            let from = self.used - kept;
            new_k.slice_set(&k.narrow(2, from, kept)?.contiguous()?, 2, 0)?;
            new_v.slice_set(&v.narrow(2, from, kept)?.contiguous()?, 2, 0)?;
            self.start += from;
        }
        self.used = kept;
        self.kv = Some((new_k, new_v));
        Ok(())
    }

    /// Attends the queries of the last `q.dim(2)` positions over the stored keys they may see.
    pub(crate) fn attend(
        &self,
        q: &Tensor,
        params: &AttnParams,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let Some((k, v)) = &self.kv else {
            candle_bail("attend called on an empty cache")?
        };
        let q_len = q.dim(2)?;
        let q_start = self.end() - q_len;
        // Keys older than the window are never visible: skip them instead of masking them.
        let first = window.map_or(self.start, |w| {
            (q_start + 1).saturating_sub(w).max(self.start)
        });
        let skip = first - self.start;
        let (k, v) = (
            k.narrow(2, skip, self.used - skip)?,
            v.narrow(2, skip, self.used - skip)?,
        );
        attention(
            q,
            &k,
            &v,
            params.scale,
            &MaskSpec {
                q_start,
                k_start: first,
                window,
            },
        )
    }

    /// [`attend`](Self::attend) for the last position's query heads `q` into `out`, reading
    /// the cache in place.
    pub(crate) fn attend_row(
        &self,
        q: &[f32],
        params: &AttnParams,
        window: Option<usize>,
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) -> Result<()> {
        let Some((k, v)) = &self.kv else {
            candle_bail("attend called on an empty cache")?
        };
        let q_start = self.end() - 1;
        let first = window.map_or(self.start, |w| {
            (q_start + 1).saturating_sub(w).max(self.start)
        });
        let mask = MaskSpec {
            q_start,
            k_start: first,
            window,
        };
        let slots = first - self.start..self.used;
        attention_row_into(q, k, v, slots, params.scale, &mask, out, scratch)
    }

    pub(crate) fn trim(&mut self, n: usize) {
        self.used -= n;
    }

    pub(crate) fn bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, v)| {
            (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes()
        })
    }

    /// A deep copy: buffers are written in place, so sharing storage would alias.
    pub(crate) fn deep_copy(&self) -> Result<Self> {
        let kv = match &self.kv {
            Some((k, v)) => Some((k.copy()?, v.copy()?)),
            None => None,
        };
        Ok(Self {
            kv,
            dtype: self.dtype,
            start: self.start,
            used: self.used,
        })
    }
}

/// Writes one position's f32 rows (`heads · head_dim`) into slot `slot` of a
/// `[1, heads, capacity, head_dim]` buffer, converting to its dtype.
struct WriteRow<'a> {
    row: &'a [f32],
    slot: usize,
}

impl InplaceOp1 for WriteRow<'_> {
    fn name(&self) -> &'static str {
        "kv-write-row"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let (&[_, heads, capacity, d], &[_, s1, s2, 1]) = (layout.dims(), layout.stride()) else {
            candle_bail("kv write: not a [1, heads, capacity, head_dim] buffer")?
        };
        if self.row.len() != heads * d || self.slot >= capacity {
            candle_bail("kv write: the row does not fit the buffer")?
        }
        let at = |h: usize| layout.start_offset() + h * s1 + self.slot * s2;
        let rows = self.row.chunks_exact(d).enumerate();
        match storage {
            CpuStorage::F32(b) => rows.for_each(|(h, r)| b[at(h)..][..d].copy_from_slice(r)),
            CpuStorage::F16(b) => rows.for_each(|(h, r)| {
                (b[at(h)..][..d].iter_mut().zip(r)).for_each(|(b, &x)| *b = f16::from_f32(x))
            }),
            CpuStorage::BF16(b) => rows.for_each(|(h, r)| {
                (b[at(h)..][..d].iter_mut().zip(r)).for_each(|(b, &x)| *b = bf16::from_f32(x))
            }),
            _ => candle_bail("kv write: the buffer is not f32, f16 or bf16")?,
        }
        Ok(())
    }
}

fn candle_bail<T>(msg: &str) -> Result<T> {
    Err(peregrine_tensor::candle::Error::Msg(msg.to_string()))
}
