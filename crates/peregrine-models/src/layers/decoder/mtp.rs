//! The multi-token-prediction (MTP) head of DeepSeek-V3, Qwen3-Next and Qwen3.5, as
//! transformers' `MtpLayer` runs it: the token's embedding and the target's final (normed)
//! hidden state, each RMS-normed, joined and projected back to the hidden width, then one
//! decoder layer of the model's own kind, a final norm, and the target's `lm_head`.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/modeling_layers.py>
//!
//! Row `j` of the head joins the hidden state at position `j` with the token at `j + 1` and
//! predicts the token at `j + 2`; its cache keeps row `j` at position `j` (transformers places
//! it at `j + 1`: RoPE scores depend on the distance between positions only, so the rows come
//! out the same). Drafting more tokens than the checkpoint has MTP layers chains the head: its
//! output stands in for the hidden state of the next row.
//!
//! Checkpoint layouts: DeepSeek-V3 keeps the head as layer `num_hidden_layers`
//! (`model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm}` around the decoder layer);
//! Qwen3-Next and Qwen3.5 under `mtp.` (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`,
//! `norm`, and the decoder layer as `mtp.layers.0`).

use peregrine_kv::{LayerKind, SequenceCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, QLinear, Tensor};

use super::{DecoderLayer, DecoderLm, SelfAttention};
use crate::layers::batch::{BatchSeq, Segment};
use crate::layers::norm_weight;
use crate::weights::Weights;
use crate::{ModelConfig, ModelError, Result};

/// An MTP head: its projections around one decoder layer.
pub(super) struct MtpHead<A> {
    enorm: Tensor,
    hnorm: Tensor,
    eh_proj: QLinear,
    block: DecoderLayer<A>,
    post_norm: Tensor,
    spec: Vec<LayerKind>,
}

impl<A: SelfAttention> MtpHead<A> {
    /// The first MTP layer of the checkpoint, when `c` asks for one
    /// ([`ModelConfig::mtp_layers`]).
    pub fn load(c: &ModelConfig, w: &Weights) -> Result<Option<Self>> {
        if c.mtp_layers == 0 {
            return Ok(None);
        }
        if c.mtp_layers > 1 {
            tracing::info!(
                "drafting with the first of {} MTP layers, chained",
                c.mtp_layers
            );
        }
        let (l, h) = (c.num_hidden_layers, c.hidden_size);
        let layer = format!("model.layers.{l}");
        let (w, names, always_sparse) = if w.contains("mtp.fc.weight") {
            let names = [
                "mtp.pre_fc_norm_embedding",
                "mtp.pre_fc_norm_hidden",
                "mtp.fc",
                "mtp.norm",
            ];
            (
                w.aliased(&format!("{layer}."), "mtp.layers.0."),
                names.map(String::from),
                false,
            )
        } else if w.contains(&format!("{layer}.eh_proj.weight")) {
            let names = ["enorm", "hnorm", "eh_proj", "shared_head.norm"];
            (w.clone(), names.map(|n| format!("{layer}.{n}")), true)
        } else {
            return Err(ModelError::config(
                w.path(),
                format!(
                    "multi-token prediction was asked for, but the checkpoint has no MTP layer \
                     (neither `mtp.fc.weight` nor `{layer}.eh_proj.weight`; quantized \
                     conversions often drop it)"
                ),
            ));
        };
        // The head's layer is layer `l` of a model one layer deeper: full attention, and
        // routed experts where the model has them (DeepSeek-V3's always; Qwen's by the rule
        // that makes layer 0 sparse, transformers building the head as its own layer 0).
        let mut bc = c.clone();
        bc.num_hidden_layers = l + 1;
        if let Some(moe) = &mut bc.moe {
            let sparse = always_sparse || moe.sparse_layers.first() == Some(&true);
            moe.sparse_layers.push(sparse);
        }
        if let Some(d) = &mut bc.delta_net {
            d.layers.push(false);
        }
        let norm = |name: &String| norm_weight(c, &w, &format!("{name}.weight"), h);
        Ok(Some(Self {
            enorm: norm(&names[0])?,
            hnorm: norm(&names[1])?,
            eh_proj: w.linear(&names[2], h, 2 * h, false)?,
            post_norm: norm(&names[3])?,
            block: DecoderLayer::load(&bc, &w, l)?,
            spec: vec![A::cache_kind(&bc, l)],
        }))
    }

    /// The head's cache kinds.
    pub fn spec(&self) -> &[LayerKind] {
        &self.spec
    }

    /// The head over rows joining `hidden` (`[1, n, hidden]`) with `tokens` (`n`), appended to
    /// `segments`' caches: the head's output `[1, n, hidden]`, final norm applied.
    pub fn forward(
        &self,
        lm: &DecoderLm<A>,
        hidden: &Tensor,
        tokens: &[u32],
        segments: &mut [Segment],
    ) -> Result<Tensor> {
        let eps = lm.config.rms_norm_eps as f32;
        let ids = Tensor::new(tokens, &lm.device)?.unsqueeze(0)?;
        let embedded = lm.embed_tokens.forward(&ids, lm.dtype)?;
        let joined = Tensor::cat(
            &[
                rms_norm(&embedded, &self.enorm, eps)?,
                rms_norm(&hidden.to_dtype(lm.dtype)?, &self.hnorm, eps)?,
            ],
            2,
        )?;
        let x = self.eh_proj.forward(&joined)?;
        let (x, out) = (self.block).forward(&x, None, eps, &lm.rope, (segments, &[]), None)?;
        Ok(rms_norm(&(x + out)?, &self.post_norm, eps)?)
    }

    /// Brings the head of each sequence of `batch` that keeps one up to the pass just run:
    /// `normed` holds the stacked rows' final hidden states. Row `j` needs the token at `j + 1`,
    /// so the pass's last position waits for the next pass (its hidden state is kept).
    pub fn catch_up(
        &self,
        lm: &DecoderLm<A>,
        normed: &Tensor,
        batch: &mut [BatchSeq],
    ) -> Result<()> {
        let mut at = 0;
        for s in batch.iter_mut() {
            let n = s.tokens.len();
            let rows = normed.narrow(1, at, n)?;
            at += n;
            let start = s.cache.len() - n;
            let Some(state) = s.cache.mtp() else { continue };
            if state.is_lost() {
                continue;
            }
            let head_rows = state.cache().len();
            let pending = start.checked_sub(1).and_then(|p| state.hidden_at(p));
            let (hidden, tokens) = match (start, pending) {
                (0, _) if n == 1 => (None, &s.tokens[..0]),
                (0, _) => (Some(rows.narrow(1, 0, n - 1)?), &s.tokens[1..]),
                (_, Some(pending)) if head_rows + 1 == start => {
                    let pending = Tensor::from_slice(pending, (1, 1, pending.len()), &lm.device)?;
                    let mut parts = vec![pending.to_dtype(rows.dtype())?];
                    if n > 1 {
                        parts.push(rows.narrow(1, 0, n - 1)?);
                    }
                    (Some(Tensor::cat(&parts, 1)?), s.tokens)
                }
                _ => {
                    state.lose();
                    continue;
                }
            };
            if let Some(hidden) = hidden {
                let cache = state.cache();
                let (start, len) = (cache.len(), tokens.len());
                let mut segment = [Segment::causal(cache.layer(0), start, len)];
                self.forward(lm, &hidden, tokens, &mut segment)?;
            }
            let values = rows.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            state.record(start, &values);
        }
        Ok(())
    }

    /// One chained row at the next position of `cache` (the head's): the next token's f32
    /// logits into `logits`, the head's output into `out`.
    pub fn step(
        &self,
        lm: &DecoderLm<A>,
        (hidden, token): (&[f32], u32),
        cache: &mut SequenceCache,
        (logits, out): (&mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<()> {
        let h = Tensor::from_slice(hidden, (1, 1, hidden.len()), &lm.device)?;
        let start = cache.len();
        let mut segment = [Segment::causal(cache.layer(0), start, 1)];
        let y = self.forward(lm, &h, &[token], &mut segment)?;
        let f32_row = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        };
        *logits = f32_row(&lm.lm_head.forward(&y)?)?;
        *out = f32_row(&y)?;
        Ok(())
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        let norms = 3 * self.enorm.elem_count() * self.enorm.dtype().size_in_bytes();
        let block = self.block.self_attn.weight_bytes() + self.block.mlp.weight_bytes();
        norms + self.eh_proj.weight_bytes() + block
    }
}
