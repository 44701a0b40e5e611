//! Per-layer KV caches. Attention over the cache belongs to the cache, because only the cache
//! knows its representation: a model appends k/v and asks the cache to attend.
//!
//! Every cache rolls back exactly with [`LayerCache::trim`] (speculative decoding, prompt-cache
//! reuse); a rotating cache refuses a rollback it cannot do exactly rather than approximating it.
#![warn(missing_docs)]

mod buffer;
mod mtp;
mod parallel;
mod recurrent;
mod rotating;
mod sequence;
mod simple;
pub mod turbo;

pub use mtp::{MTP_HIDDEN_KEPT, MtpState, SharedView};
pub use parallel::ParallelCache;
pub use recurrent::{DEFAULT_RECURRENT_ROLLBACK, RecurrentCache};
pub use rotating::RotatingCache;
pub use sequence::{KvOptions, KvQuant, LayerKind, SequenceCache};
pub use simple::SimpleCache;
pub use turbo::{TurboCache, TurboKeys, TurboOptions};

use peregrine_tensor::attention::AttnScratch;
use peregrine_tensor::{DType, Device, Result, Tensor};

/// Per-call attention parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    /// Multiplier applied to `q·k` (usually `1/sqrt(head_dim)`).
    pub scale: f64,
    /// Soft cap of the scaled scores, `cap · tanh(s / cap)` before the mask and softmax
    /// (Gemma 2's `attn_logit_softcapping`); `None` leaves them as they are.
    pub softcap: Option<f32>,
    /// Absolute positions `[start, end)` among the queries that attend to each other both
    /// ways (an image's tokens in Gemma 3); the rest is causal.
    pub both_ways: Option<(usize, usize)>,
}

impl AttnParams {
    /// Scores scaled by `scale`, not capped.
    pub fn scaled(scale: f64) -> Self {
        Self {
            scale,
            softcap: None,
            both_ways: None,
        }
    }
}

/// One layer's key/value memory.
pub trait LayerCache: Send + Sync {
    /// Appends `k, v: [1, kv_heads, n, head_dim]` for the next `n` positions.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()>;
    /// Attends `q: [1, heads, n, head_dim]`, the queries of the last `n` appended positions,
    /// over everything they may see. Returns `[1, heads, n, head_dim]`.
    fn attend(&self, q: &Tensor, params: &AttnParams) -> Result<Tensor>;
    /// Attends one query row `q: [1, heads, 1, head_dim]` that is not in the cache (a drafter
    /// reading it, as Gemma 4's assistant reads its target's) over the last `last` positions,
    /// or all of them (`None`). Caches that cannot widen their window refuse `Some`.
    fn attend_shared(
        &self,
        q: &Tensor,
        params: &AttnParams,
        last: Option<usize>,
    ) -> Result<Tensor> {
        match last {
            None => self.attend(q, params),
            Some(n) => peregrine_tensor::candle::bail!(
                "this cache cannot be read over its last {n} positions by a query past its end"
            ),
        }
    }
    /// The keys and values the newest position attends (`[1, kv_heads, n, head_dim]` views of
    /// the cache's own storage, all of them seen by that position), for a decode step that
    /// attends many sequences' caches in one launch; `None` for caches that keep anything
    /// else (the CPU's planes, quantized or compressed entries, none yet): attend alone.
    fn decode_kv(&self) -> Option<(Tensor, Tensor)> {
        None
    }
    /// Whether [`decode_slot`](Self::decode_slot) hands out slots on `device` (then it does for
    /// every position, and the cache takes no [`note_queries`](Self::note_queries)).
    fn has_decode_slots(&self, _device: &Device) -> bool {
        false
    }
    /// Room for one more position that the caller writes in place (a batched decode step
    /// appending every sequence's row in one launch): the key and value buffers `[1,
    /// kv_heads, capacity, head_dim]` and the slot; the position counts as appended from here
    /// on. `None`, changing nothing, for caches that keep anything else (the default): append.
    fn decode_slot(
        &mut self,
        _shape: (usize, usize),
        _dtype: DType,
        _device: &Device,
    ) -> Result<Option<(Tensor, Tensor, usize)>> {
        Ok(None)
    }
    /// [`append`](Self::append) of one position from f32 rows `k, v` (`kv_heads · head_dim`
    /// each), the decode step's form: caches that can write in place allocate nothing (but
    /// when they grow). The default wraps the rows in tensors.
    fn append_row(&mut self, k: &[f32], v: &[f32], head_dim: usize) -> Result<()> {
        let shape = (1, k.len() / head_dim, 1, head_dim);
        let t = |x: &[f32]| Tensor::from_slice(x, shape, &Device::Cpu);
        self.append(&t(k)?, &t(v)?)
    }
    /// [`attend`](Self::attend) for the last appended position's query heads `q`
    /// (`heads · head_dim`, f32) into `out`, the decode step's form: caches with a row
    /// kernel allocate nothing once `scratch` has grown. The default wraps `q` in a tensor.
    fn attend_row(
        &self,
        q: &[f32],
        head_dim: usize,
        params: &AttnParams,
        out: &mut [f32],
        _scratch: &mut AttnScratch,
    ) -> Result<()> {
        let q = Tensor::from_slice(q, (1, q.len() / head_dim, 1, head_dim), &Device::Cpu)?;
        let y = self.attend(&q, params)?.flatten_all()?;
        out.copy_from_slice(&y.to_dtype(peregrine_tensor::DType::F32)?.to_vec1::<f32>()?);
        Ok(())
    }
    /// The queries `q: [1, heads, n, head_dim]` of the next `n` positions, given before their
    /// keys are appended (`kv_heads` of them): a cache that fits its encoding to the queries
    /// that read it (TurboQuant's key scales) keeps statistics. The default ignores them.
    fn note_queries(&mut self, _q: &Tensor, _kv_heads: usize) -> Result<()> {
        Ok(())
    }
    /// [`note_queries`](Self::note_queries) for one position's query heads `q`
    /// (`heads · head_dim`, f32), the decode step's form.
    fn note_query_row(&mut self, _q: &[f32], _head_dim: usize, _kv_heads: usize) -> Result<()> {
        Ok(())
    }
    /// Number of positions seen so far (the next token's position).
    fn len(&self) -> usize;
    /// True when nothing has been appended.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether the last `n` positions can be forgotten exactly.
    fn can_trim(&self, n: usize) -> bool;
    /// Forgets the last `n` positions exactly, or fails without changing anything.
    fn trim(&mut self, n: usize) -> Result<()>;
    /// Bytes of memory the cache holds (allocated, not only used).
    fn bytes(&self) -> usize;
    /// An independent copy (for prompt-cache entries).
    fn snapshot(&self) -> Result<Box<dyn LayerCache>>;
    /// The recurrent state, for layers that keep one instead of keys and values.
    fn recurrent(&mut self) -> Option<&mut RecurrentCache> {
        None
    }
}

// The README's examples compile and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
