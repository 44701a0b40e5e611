//! The sliding-window cache: keeps the last `window` positions plus a rollback margin.

use peregrine_tensor::{DType, Device, Result, Tensor};

use crate::buffer::KvBuffer;
use crate::{AttnParams, KvQuant, LayerCache};
use peregrine_tensor::attention::AttnScratch;

/// Keeps the last `window - 1 + rollback` positions, so that a query sees exactly the keys
/// `q - k < window` and the last `rollback` positions can still be trimmed exactly.
#[derive(Debug, Clone)]
pub struct RotatingCache {
    buf: KvBuffer,
    window: usize,
    rollback: usize,
}

impl RotatingCache {
    /// A cache for a `window`-wide sliding attention that can roll back `rollback` positions.
    /// K/v are stored in `dtype` (`None`: the activations' dtype).
    pub fn new(window: usize, rollback: usize, dtype: Option<DType>) -> Self {
        Self {
            buf: KvBuffer::new(dtype),
            window: window.max(1),
            rollback,
        }
    }

    /// The attention window.
    pub fn window(&self) -> usize {
        self.window
    }

    fn keep(&self) -> usize {
        self.window - 1 + self.rollback
    }
}

impl RotatingCache {
    /// This cache quantizing keys and values as they are written (`--kv-bits`); `None`
    /// keeps floats.
    pub fn quantized(mut self, quant: Option<KvQuant>) -> Self {
        self.buf.quant = quant;
        self
    }
}

impl LayerCache for RotatingCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let keep = self.keep();
        self.buf.append(k, v, Some(keep))
    }

    fn decode_kv(&self) -> Option<(Tensor, Tensor)> {
        self.buf.decode_kv(Some(self.window))
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
        self.buf
            .decode_slot(shape, dtype, device, Some(self.keep()))
    }

    fn attend(&self, q: &Tensor, params: &AttnParams) -> Result<Tensor> {
        self.buf.attend(q, params, Some(self.window))
    }

    /// Over the last `last` kept positions (the window and the rollback margin bound it).
    fn attend_shared(
        &self,
        q: &Tensor,
        params: &AttnParams,
        last: Option<usize>,
    ) -> Result<Tensor> {
        self.buf
            .attend(q, params, Some(last.unwrap_or(self.window)))
    }

    fn append_row(&mut self, k: &[f32], v: &[f32], head_dim: usize) -> Result<()> {
        self.buf.append_row(k, v, head_dim, Some(self.keep()))
    }

    fn attend_row(
        &self,
        q: &[f32],
        head_dim: usize,
        params: &AttnParams,
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) -> Result<()> {
        let window = Some(self.window);
        (self.buf).attend_row(q, head_dim, params, window, (out, scratch))
    }

    fn len(&self) -> usize {
        self.buf.end()
    }

    fn can_trim(&self, n: usize) -> bool {
        // After trimming, the next query needs positions `new_end - (window - 1) ..`.
        n <= self.buf.used && (self.buf.end() - n).saturating_sub(self.window - 1) >= self.buf.start
    }

    fn trim(&mut self, n: usize) -> Result<()> {
        match self.can_trim(n) {
            true => {
                self.buf.trim(n);
                Ok(())
            }
            false => peregrine_tensor::candle::bail!(
                "cannot trim {n} positions exactly: the sliding-window cache keeps positions {}..{} \
                 (window {}, rollback margin {})",
                self.buf.start,
                self.buf.end(),
                self.window,
                self.rollback
            ),
        }
    }

    fn bytes(&self) -> usize {
        self.buf.bytes()
    }

    fn snapshot(&self) -> Result<Box<dyn LayerCache>> {
        Ok(Box::new(Self {
            buf: self.buf.deep_copy()?,
            ..*self
        }))
    }
}
