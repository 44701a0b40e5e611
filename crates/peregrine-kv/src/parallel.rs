//! A layer that runs attention and a recurrent mixer side by side (Falcon-H1): its KV cache
//! and its state, kept at the same length and rolled back together.

use peregrine_tensor::attention::AttnScratch;
use peregrine_tensor::{Result, Tensor};

use crate::{AttnParams, LayerCache, RecurrentCache};

/// A KV cache and a recurrent state for one layer.
pub struct ParallelCache {
    /// The attention half's keys and values.
    pub kv: Box<dyn LayerCache>,
    /// The mixer's state.
    pub state: RecurrentCache,
}

impl LayerCache for ParallelCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.kv.append(k, v)
    }

    fn attend(&self, q: &Tensor, params: &AttnParams) -> Result<Tensor> {
        self.kv.attend(q, params)
    }

    fn append_row(&mut self, k: &[f32], v: &[f32], head_dim: usize) -> Result<()> {
        self.kv.append_row(k, v, head_dim)
    }

    fn note_queries(&mut self, q: &Tensor, kv_heads: usize) -> Result<()> {
        self.kv.note_queries(q, kv_heads)
    }

    fn note_query_row(&mut self, q: &[f32], head_dim: usize, kv_heads: usize) -> Result<()> {
        self.kv.note_query_row(q, head_dim, kv_heads)
    }

    fn attend_row(
        &self,
        q: &[f32],
        head_dim: usize,
        params: &AttnParams,
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) -> Result<()> {
        self.kv.attend_row(q, head_dim, params, out, scratch)
    }

    fn len(&self) -> usize {
        self.kv.len()
    }

    fn can_trim(&self, n: usize) -> bool {
        self.kv.can_trim(n) && self.state.can_trim(n)
    }

    /// Both halves or neither.
    fn trim(&mut self, n: usize) -> Result<()> {
        if !self.state.can_trim(n) {
            return self.state.trim(n); // reports why, changing nothing
        }
        self.kv.trim(n)?;
        self.state.trim(n)
    }

    fn bytes(&self) -> usize {
        self.kv.bytes() + self.state.bytes()
    }

    fn snapshot(&self) -> Result<Box<dyn LayerCache>> {
        Ok(Box::new(Self {
            kv: self.kv.snapshot()?,
            state: self.state.clone(),
        }))
    }

    fn recurrent(&mut self) -> Option<&mut RecurrentCache> {
        Some(&mut self.state)
    }
}
