//! A growable k/v buffer shared by the cache variants.

use peregrine_tensor::attention::{MaskSpec, attention};
use peregrine_tensor::{DType, Result, Tensor};

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
        let n = k.dim(2)?;
        if self.used + n > self.capacity() {
            let kept = keep.map_or(self.used, |keep| keep.min(self.used));
            // Once positions start dropping, room for two windows makes moves rare; before
            // that, grow in steps (a short prompt should not zero a whole window's pages).
            let want = match keep {
                Some(keep) if kept + n > keep => (kept + n).max(2 * keep),
                _ => kept + n,
            };
            self.reallocate(k, kept, want.div_ceil(GROW_STEP) * GROW_STEP)?;
        }
        let (bk, bv) = self.kv.as_ref().expect("allocated above");
        bk.slice_set(&k.to_dtype(bk.dtype())?.contiguous()?, 2, self.used)?;
        bv.slice_set(&v.to_dtype(bv.dtype())?.contiguous()?, 2, self.used)?;
        self.used += n;
        Ok(())
    }

    /// Moves the last `kept` positions into a fresh buffer of `capacity` slots.
    fn reallocate(&mut self, like: &Tensor, kept: usize, capacity: usize) -> Result<()> {
        let (b, h, _, d) = like.dims4()?;
        let dtype = self.dtype.unwrap_or(like.dtype());
        let new_k = Tensor::zeros((b, h, capacity, d), dtype, like.device())?;
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

fn candle_bail<T>(msg: &str) -> Result<T> {
    Err(peregrine_tensor::candle::Error::Msg(msg.to_string()))
}
