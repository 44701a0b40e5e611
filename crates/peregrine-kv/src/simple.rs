//! The full-attention cache: every position is kept.

use peregrine_tensor::{DType, Device, Result, Tensor};

use crate::buffer::KvBuffer;
use crate::{AttnParams, KvQuant, LayerCache};
use peregrine_tensor::attention::AttnScratch;

/// Keeps every position; trims exactly to any length.
#[derive(Debug, Clone, Default)]
pub struct SimpleCache {
    buf: KvBuffer,
}

impl SimpleCache {
    /// An empty cache storing k/v in `dtype` (`None`: the activations' dtype).
    pub fn new(dtype: Option<DType>) -> Self {
        Self {
            buf: KvBuffer::new(dtype),
        }
    }
}

impl SimpleCache {
    /// [`new`](Self::new) storing keys only: `attend` reads each position's key as its value
    /// (the `v` given to `append` is not stored).
    pub fn keys_as_values(dtype: Option<DType>) -> Self {
        Self {
            buf: KvBuffer::keys_as_values(dtype),
        }
    }
}

impl SimpleCache {
    /// This cache quantizing keys and values as they are written (`--kv-bits`); `None`
    /// keeps floats.
    pub fn quantized(mut self, quant: Option<KvQuant>) -> Self {
        self.buf.quant = quant;
        self
    }
}

impl LayerCache for SimpleCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.buf.append(k, v, None)
    }

    fn decode_kv(&self) -> Option<(Tensor, Tensor)> {
        self.buf.decode_kv(None)
    }

    fn has_decode_slots(&self, device: &Device) -> bool {
        self.buf.has_decode_slots(device)
    }

    fn decode_slot(
        &mut self,
        shape: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Option<(Tensor, Tensor, usize)>> {
        self.buf.decode_slot(shape, dtype, device, None)
    }

    fn attend(&self, q: &Tensor, params: &AttnParams) -> Result<Tensor> {
        self.buf.attend(q, params, None)
    }

    fn append_row(&mut self, k: &[f32], v: &[f32], head_dim: usize) -> Result<()> {
        self.buf.append_row(k, v, head_dim, None)
    }

    fn attend_row(
        &self,
        q: &[f32],
        head_dim: usize,
        params: &AttnParams,
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) -> Result<()> {
        (self.buf).attend_row(q, head_dim, params, None, (out, scratch))
    }

    fn len(&self) -> usize {
        self.buf.end()
    }

    fn can_trim(&self, n: usize) -> bool {
        n <= self.buf.used
    }

    fn trim(&mut self, n: usize) -> Result<()> {
        if !self.can_trim(n) {
            peregrine_tensor::candle::bail!(
                "cannot trim {n} positions from a cache of {}",
                self.buf.used
            )
        }
        self.buf.trim(n);
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.buf.bytes()
    }

    fn snapshot(&self) -> Result<Box<dyn LayerCache>> {
        Ok(Box::new(Self {
            buf: self.buf.deep_copy()?,
        }))
    }
}
