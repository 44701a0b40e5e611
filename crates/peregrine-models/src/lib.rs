//! Model architectures and checkpoint loading.
//!
//! Models are stateless apart from their weights: [`CausalLm::forward`] takes the sequence's
//! KV cache from outside, so one loaded model serves many sequences. Architecture files
//! (`arch/<model_type>.rs`) are written against HF tensor names; `weights/` maps every checkpoint
//! format (safetensors, sharded safetensors, GGUF) onto those names and onto [`ModelConfig`].
#![warn(missing_docs)]

pub mod arch;
pub mod audio;
pub mod config;
pub mod error;
pub mod layers;
pub mod registry;
pub mod vision;
pub mod weights;

pub use arch::gemma4::assistant::Gemma4Assistant;
pub use config::ModelConfig;
pub use error::{ModelError, Result};
pub use layers::batch::{BatchSeq, Media};
pub use peregrine_kv::{
    DEFAULT_RECURRENT_ROLLBACK, KvOptions, KvQuant, LayerKind, MTP_HIDDEN_KEPT, MtpState,
    SequenceCache, TurboKeys, TurboOptions,
};
pub use peregrine_moe::{ReadPool, StreamStats};
pub use registry::{
    ExpertOptions, LoadOptions, LoadedModel, OpenModel, load_model, open_model,
    supported_architectures,
};
pub use weights::LoadProgress;

use peregrine_tensor::{Device, Tensor};

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's (generation).
    Last,
    /// Every position's (scoring, teacher forcing, parity tools).
    All,
}

/// A decoder-only language model.
pub trait CausalLm: Send + Sync {
    /// The parsed configuration.
    fn config(&self) -> &ModelConfig;
    /// The memory each layer needs; build a sequence's cache with `SequenceCache::new(&spec, &options)`.
    fn cache_spec(&self) -> Vec<LayerKind>;
    /// Runs `tokens` (the next positions of the sequence held in `cache`) and returns f32
    /// logits `[positions, vocab]` for the positions `want` selects.
    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor>;
    /// Runs several sequences' next tokens (decode steps and prefill chunks mixed) in one
    /// pass and returns f32 logits `[rows, vocab]`: each sequence's last new position, or all
    /// of its new positions where its [`BatchSeq::logits`] asks (in batch order).
    /// Matmuls run on the stacked rows of all sequences, so weights are read once per pass;
    /// attention runs per sequence over its own cache. A sequence's logits equal those of its
    /// own [`forward`](Self::forward) (bit for bit on the CPU's batch-invariant kernels). This
    /// default runs `forward` per sequence.
    fn forward_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        if batch.iter().any(|s| s.media.is_some()) {
            return Err(layers::batch::no_media());
        }
        let rows = (batch.iter_mut())
            .map(|s| self.forward(s.tokens, s.cache, s.logits))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&rows, 0)?)
    }
    /// Runs one token (the next position of the sequence in `cache`) and writes its f32
    /// logits (`[vocab]`) into `logits`: generation's step. CPU models override it with a
    /// step over buffers reused from token to token ([`layers::step`]); this default goes
    /// through [`forward`](Self::forward).
    fn decode(&self, token: u32, cache: &mut SequenceCache, logits: &mut Vec<f32>) -> Result<()> {
        decode_with_forward(self, token, cache, logits)
    }
    /// The cache kinds of the multi-token-prediction head, when the model loaded one
    /// ([`LoadOptions::mtp`]). A sequence that drafts with it keeps the head's memory beside
    /// its cache ([`SequenceCache::enable_mtp`]), which every pass then brings up to date.
    fn mtp_spec(&self) -> Option<Vec<LayerKind>> {
        None
    }
    /// One row of the multi-token-prediction head at the next position of `cache` (the head's,
    /// [`MtpState::cache`](peregrine_kv::MtpState::cache)): joins `input`'s hidden state (the
    /// target's final one, or the head's own output for a chained draft) with its token, and
    /// writes the following token's f32 logits and the head's output into `output`.
    fn mtp_step(
        &self,
        input: (&[f32], u32),
        cache: &mut SequenceCache,
        output: (&mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<()> {
        let _ = (input, cache, output);
        Err(ModelError::Tensor(peregrine_tensor::candle::Error::Msg(
            "this model has no multi-token-prediction head".into(),
        )))
    }
    /// Where a drafter that reads this model's keys and values finds them (Gemma 4's
    /// assistant); `None` for a model that offers none.
    fn shared_kv(&self) -> Option<SharedKv> {
        None
    }
    /// The first layer's input for `token` (`[1, 1, hidden]`; Gemma's embedding scaled by
    /// `sqrt(hidden)`), for a drafter that starts from it.
    fn input_embedding(&self, token: u32) -> Result<Tensor> {
        let _ = token;
        Err(ModelError::Tensor(peregrine_tensor::candle::Error::Msg(
            "this model does not hand out its input embeddings".into(),
        )))
    }
    /// The device the weights live on.
    fn device(&self) -> &Device;
    /// Bytes of weights held in memory.
    fn weight_bytes(&self) -> usize;
}

/// The cache slots of a model's last full-attention and last sliding-window layers, and the
/// window, which a drafter sharing its keys and values reads ([`CausalLm::shared_kv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedKv {
    /// The last full-attention layer's cache slot.
    pub full: usize,
    /// The last sliding layer's cache slot and its window, when the model has one.
    pub sliding: Option<(usize, usize)>,
}

/// [`CausalLm::decode`] through [`CausalLm::forward`] (allocating tensors on the way).
pub fn decode_with_forward<M: CausalLm + ?Sized>(
    model: &M,
    token: u32,
    cache: &mut SequenceCache,
    logits: &mut Vec<f32>,
) -> Result<()> {
    let row = model.forward(&[token], cache, Logits::Last)?;
    *logits = row.flatten_all()?.to_vec1::<f32>()?;
    Ok(())
}

// The README's examples compile and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
