//! A sequence's caches, one per layer, built from the model's cache spec.

use peregrine_tensor::{DType, Result};

use crate::mtp::MtpState;
use crate::turbo::{TurboCache, TurboOptions};
use crate::{
    DEFAULT_RECURRENT_ROLLBACK, LayerCache, ParallelCache, RecurrentCache, RotatingCache,
    SimpleCache,
};

/// What kind of memory a layer needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention over every earlier position.
    Full,
    /// [`Full`](Self::Full), storing keys only: each position's value is its key (DeepSeek's
    /// latent attention, whose value is the leading columns of its `[latent | rope]` key).
    FullKeysAsValues,
    /// Attention over the last `window` positions.
    Sliding {
        /// Window width (query `q` sees key `k` when `q - k < window`).
        window: usize,
    },
    /// A fixed-size recurrent state (Mamba 2's conv and SSM states), whatever the length.
    Recurrent {
        /// f32 values of the state.
        state: usize,
    },
    /// [`Full`](Self::Full) attention and a recurrent mixer side by side in one layer
    /// (Falcon-H1): a KV cache and a state.
    FullAndRecurrent {
        /// f32 values of the state.
        state: usize,
    },
}

/// Per-request cache choices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvOptions {
    /// Storage dtype of keys and values; `None` keeps the activations' dtype (f32 on CPU).
    /// `F16` halves memory and matches llama.cpp's default cache precision.
    pub dtype: Option<DType>,
    /// Quantize keys and values as they are written (then `dtype` is unused).
    pub quant: Option<KvQuant>,
    /// TurboQuant compression of old positions (then `dtype` and `quant` are unused; keys
    /// stored as values, DeepSeek's latent, keep their plain cache).
    pub turbo: Option<TurboOptions>,
    /// Positions a recurrent layer can roll back ([`RecurrentCache`]; each costs a copy of its
    /// state); `None`: [`DEFAULT_RECURRENT_ROLLBACK`].
    pub recurrent_rollback: Option<usize>,
}

/// Affine quantization of cached keys and values (`--kv-bits`, as mlx-lm's): each group of
/// `group_size` values of a row is `scale · code + bias`, with f16 scale and bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvQuant {
    /// Code width: 4 or 8.
    pub bits: u8,
    /// Values per scale and bias: 16, 32, 64 or 128, dividing the head dimension.
    pub group_size: usize,
}

impl KvQuant {
    /// Why this format cannot hold rows of `head_dim` values, if it cannot.
    pub fn check(&self, head_dim: usize) -> std::result::Result<(), String> {
        let KvQuant { bits, group_size } = *self;
        if !matches!(bits, 4 | 8) {
            return Err(format!("{bits}-bit KV codes: 4 or 8 bits"));
        }
        if !matches!(group_size, 16 | 32 | 64 | 128) || !head_dim.is_multiple_of(group_size) {
            return Err(format!(
                "KV group size {group_size} must be 16, 32, 64 or 128 and divide this model's \
                 head_dim {head_dim}"
            ));
        }
        Ok(())
    }
}

impl KvOptions {
    /// Positions a recurrent layer can roll back with these options.
    pub fn recurrent_depth(&self) -> usize {
        self.recurrent_rollback
            .unwrap_or(DEFAULT_RECURRENT_ROLLBACK)
    }

    /// Why these options cannot serve the layers `spec` with attention rows `head_dim` wide,
    /// if they cannot (TurboQuant that would compress no layer is refused, not ignored).
    pub fn check(&self, head_dim: usize, spec: &[LayerKind]) -> std::result::Result<(), String> {
        if let Some(quant) = &self.quant {
            quant.check(head_dim)?;
        }
        let latent_only = spec.iter().all(|k| *k == LayerKind::FullKeysAsValues);
        if self.turbo.is_some() && latent_only {
            return Err(
                "TurboQuant does not apply to latent-attention (MLA) caches, this \
                        model's only kind; use --kv-bits"
                    .into(),
            );
        }
        if self.turbo.is_some() && !crate::turbo::supports(head_dim) {
            return Err(format!(
                "TurboQuant needs a power-of-two head_dim in 16..=1024; this model's is {head_dim}"
            ));
        }
        Ok(())
    }
}

/// One sequence's caches, one per layer, and the per-sequence settings that travel with them
/// through every forward path (a batched pass runs sequences with different ones together).
pub struct SequenceCache {
    layers: Vec<Box<dyn LayerCache>>,
    /// Experts each token of this sequence is routed to, when fewer than the model's.
    moe_top_k: Option<usize>,
    /// A multi-token-prediction head's memory, when this sequence drafts with one.
    mtp: Option<Box<MtpState>>,
    /// Where rotary positions part from cache positions (M-RoPE after an image): from cache
    /// position `.0` on, a token's rotary position is its cache position plus `.1` (the sum of
    /// every shift so far), in increasing `.0`.
    rope_shifts: Vec<(usize, i64)>,
}

/// Positions a sliding-window cache keeps beyond its window so that speculative rollback stays exact.
pub const DEFAULT_ROLLBACK: usize = 64;

impl SequenceCache {
    /// Builds the caches a model's layers need.
    pub fn new(spec: &[LayerKind], options: &KvOptions) -> Self {
        let layers = spec
            .iter()
            .map(|kind| -> Box<dyn LayerCache> {
                let (dtype, quant) = (options.dtype, options.quant);
                match (*kind, options.turbo) {
                    (LayerKind::Recurrent { state }, _) => {
                        Box::new(RecurrentCache::new(state, options.recurrent_depth()))
                    }
                    (LayerKind::Full, Some(turbo)) => {
                        Box::new(TurboCache::new(turbo, None, DEFAULT_ROLLBACK))
                    }
                    // A sliding layer never holds more than its window: at or under the
                    // activation threshold it has nothing to compress (its window is all recent
                    // context, which compressed measurably hurts: Gemma 3's 512-wide layers).
                    (LayerKind::Sliding { window }, Some(turbo)) if window <= turbo.threshold => {
                        Box::new(RotatingCache::new(
                            window,
                            DEFAULT_ROLLBACK,
                            Some(DType::F16),
                        ))
                    }
                    (LayerKind::Sliding { window }, Some(turbo)) => {
                        Box::new(TurboCache::new(turbo, Some(window), DEFAULT_ROLLBACK))
                    }
                    (LayerKind::Full, None) => Box::new(SimpleCache::new(dtype).quantized(quant)),
                    (LayerKind::FullAndRecurrent { state }, turbo) => Box::new(ParallelCache {
                        kv: match turbo {
                            Some(turbo) => Box::new(TurboCache::new(turbo, None, DEFAULT_ROLLBACK)),
                            None => Box::new(SimpleCache::new(dtype).quantized(quant)),
                        },
                        state: RecurrentCache::new(state, options.recurrent_depth()),
                    }),
                    (LayerKind::FullKeysAsValues, _) => {
                        Box::new(SimpleCache::keys_as_values(dtype).quantized(quant))
                    }
                    (LayerKind::Sliding { window }, None) => Box::new(
                        RotatingCache::new(window, DEFAULT_ROLLBACK, dtype).quantized(quant),
                    ),
                }
            })
            .collect();
        Self {
            layers,
            moe_top_k: None,
            mtp: None,
            rope_shifts: Vec::new(),
        }
    }

    /// The cache of layer `i`.
    pub fn layer(&mut self, i: usize) -> &mut dyn LayerCache {
        self.layers[i].as_mut()
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Positions seen so far (the next token's position).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    /// True when no position has been seen.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets the last `n` positions in every layer, exactly; on failure nothing changes.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if let Some(layer) = self.layers.iter().find(|l| !l.can_trim(n)) {
            return layer.as_ref().snapshot()?.trim(n); // reports why, changing nothing here
        }
        self.layers.iter_mut().try_for_each(|l| l.trim(n))?;
        let len = self.len();
        if let Some(mtp) = &mut self.mtp {
            mtp.trim_to(len);
        }
        // A shift taken at `len` belongs to an image the cache still holds whole.
        self.rope_shifts.retain(|&(from, _)| from <= len);
        Ok(())
    }

    /// The rotary position of cache position `pos`: `pos` itself unless an image has shifted
    /// the positions after it ([`shift_rope`](Self::shift_rope)).
    pub fn rope_position(&self, pos: usize) -> usize {
        let shift = (self.rope_shifts.iter().rev())
            .find(|&&(from, _)| from <= pos)
            .map_or(0, |&(_, by)| by);
        (pos as i64 + shift).max(0) as usize
    }

    /// Moves the rotary positions of cache positions `from` on by `by` more (M-RoPE: an image
    /// of `h × w` rows ending at `from` advances rotary positions by `max(h, w)`, not `h · w`).
    /// Shifts are taken in increasing `from`; one before the last is an error.
    pub fn shift_rope(&mut self, from: usize, by: i64) -> Result<()> {
        let last = self.rope_shifts.last().copied();
        if last.is_some_and(|(at, _)| at > from) {
            peregrine_tensor::candle::bail!("rope shift at position {from} is before the last one")
        }
        let total = last.map_or(0, |(_, total)| total) + by;
        match last {
            Some((at, _)) if at == from => *self.rope_shifts.last_mut().unwrap() = (from, total),
            _ => self.rope_shifts.push((from, total)),
        }
        Ok(())
    }

    /// Bytes held by all layers (and a multi-token-prediction head's memory).
    pub fn bytes(&self) -> usize {
        let mtp = self.mtp.as_ref().map_or(0, |m| m.bytes());
        self.layers.iter().map(|l| l.bytes()).sum::<usize>() + mtp
    }

    /// Keeps a multi-token-prediction head's memory beside this cache (head layers `spec`,
    /// hidden states of `width`), which the model then fills on every pass. On a cache that
    /// already holds positions the head has missed them, so it starts lost. Does nothing when
    /// the cache has one.
    pub fn enable_mtp(&mut self, spec: &[LayerKind], options: &KvOptions, width: usize) {
        if self.mtp.is_some() {
            return;
        }
        let mut state = MtpState::new(spec, options, width);
        if !self.is_empty() {
            state.lose();
        }
        self.mtp = Some(Box::new(state));
    }

    /// Drops the multi-token-prediction head's memory (the model then runs no head rows).
    pub fn disable_mtp(&mut self) {
        self.mtp = None;
    }

    /// The multi-token-prediction head's memory, when kept.
    pub fn mtp(&mut self) -> Option<&mut MtpState> {
        self.mtp.as_deref_mut()
    }

    /// An independent copy of every layer.
    pub fn snapshot(&self) -> Result<Self> {
        Ok(Self {
            layers: self
                .layers
                .iter()
                .map(|l| l.snapshot())
                .collect::<Result<_>>()?,
            moe_top_k: self.moe_top_k,
            mtp: match &self.mtp {
                Some(m) => Some(Box::new(m.snapshot()?)),
                None => None,
            },
            rope_shifts: self.rope_shifts.clone(),
        })
    }

    /// Routes this sequence's tokens to `k` experts in every mixture-of-experts layer instead
    /// of the model's number (`None`: the model's). Set it before the first token: the keys
    /// already cached were computed with the earlier routing.
    pub fn set_moe_top_k(&mut self, k: Option<usize>) {
        self.moe_top_k = k;
    }

    /// Experts this sequence's tokens are routed to, when not the model's number.
    pub fn moe_top_k(&self) -> Option<usize> {
        self.moe_top_k
    }
}
