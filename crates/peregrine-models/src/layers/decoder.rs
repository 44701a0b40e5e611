//! The llama-family decoder (pre-norm attention + gated MLP), parameterised by config flags:
//! q/k/v bias (Qwen2), q/k norm (Qwen3), sliding window (Mistral), routed experts in place of
//! the MLP (Mixtral, Qwen3-MoE), and by its attention ([`SelfAttention`]: grouped-query
//! [`Attention`], or DeepSeek's latent [`Mla`](super::mla::Mla)). Architectures that differ only in such flags
//! reuse it rather than copying it.

mod mtp;

use peregrine_kv::{LayerCache, LayerKind, SequenceCache};
use peregrine_tensor::ops::{add_rms_norm, rms_norm};
use peregrine_tensor::{DType, Device, Embedding, QLinear, RotaryEmbedding, Tensor};

use crate::layers::attention::Attention;
use crate::layers::batch::{
    BatchSeq, Segment, batch_logits, check_media_with, moe_limits, run_layers, splice_media,
    stacked_ids,
};
use crate::layers::mlp::GatedMlp;
use crate::layers::moe::Ffn;
use crate::layers::norm_weight;
use crate::layers::step::{
    StepBuffers, StepPool, StepRow, add_into, batch_positions, decodes_only, head_rows_into,
    norm_into, norm_rows_into, output_logits_into, step_rows,
};
use crate::weights::Weights;
use crate::{CausalLm, Logits, ModelConfig, Result};

/// A decoder layer's attention: what [`DecoderLm`] needs of it.
pub trait SelfAttention: Sized + Send + Sync {
    /// Loads layer `layer`'s mixer (`model.layers.{layer}.self_attn.*`).
    fn load(c: &ModelConfig, w: &Weights, layer: usize) -> Result<Self>;
    /// The RoPE table's `(head width, rotated dimensions)`.
    fn rope_dims(c: &ModelConfig) -> (usize, usize) {
        (c.head_dim, c.rotary_dim())
    }
    /// The cache layer `layer` keeps.
    fn cache_kind(c: &ModelConfig, _layer: usize) -> LayerKind {
        match c.sliding_window {
            Some(window) => LayerKind::Sliding { window },
            None => LayerKind::Full,
        }
    }
    /// `x: [1, rows, hidden]` (normed), the stacked rows of `segments` (each sequence's new
    /// positions, over its own cache) → `[1, rows, hidden]`.
    fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        segments: &mut [Segment],
    ) -> Result<Tensor>;
    /// One token at rotary position `pos` from `b.normed` into `b.out`, allocating nothing.
    fn step(
        &self,
        b: &mut StepBuffers,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        pos: usize,
    ) -> Result<()>;
    /// Whether [`step_rows`](Self::step_rows) runs this layer (a batched decode step).
    fn steps_rows(&self) -> bool {
        false
    }
    /// [`step`](Self::step) for several sequences' one new token each: row `i` of `b.normed`
    /// (`b.rows` rows) at `seqs[i]`'s cache and position, into row `i` of `b.out`; each row's
    /// bits are those its sequence's own step gives.
    fn step_rows(
        &self,
        _b: &mut StepBuffers,
        _rope: &RotaryEmbedding,
        _seqs: &mut [StepRow],
    ) -> Result<()> {
        let why = "this attention has no batched decode step";
        Err(peregrine_tensor::candle::Error::Msg(why.into()).into())
    }
    /// Bytes of weights.
    fn weight_bytes(&self) -> usize;
    /// Whether [`step`](Self::step) runs this model's layers (else decode runs `forward`).
    fn steps(_c: &ModelConfig) -> bool {
        true
    }
}

struct DecoderLayer<A> {
    input_layernorm: Tensor,
    self_attn: A,
    post_attention_layernorm: Tensor,
    mlp: Ffn,
}

/// A decoder-only transformer of the llama family, with attention `A`.
pub struct DecoderLm<A = Attention> {
    config: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer<A>>,
    norm: Tensor,
    lm_head: QLinear,
    rope: RotaryEmbedding,
    device: Device,
    dtype: DType,
    steps: StepPool,
    /// The multi-token-prediction head, when loaded ([`ModelConfig::mtp_layers`]).
    mtp: Option<mtp::MtpHead<A>>,
}

impl<A: SelfAttention> DecoderLm<A> {
    /// Loads the weights for `config`; RoPE tables cover `max_context` positions. Layers past
    /// `num_hidden_layers` (multi-token-prediction layers) are read only when
    /// [`ModelConfig::mtp_layers`] asks.
    pub fn load(config: ModelConfig, w: &Weights, max_context: usize) -> Result<Self> {
        let c = &config;
        let h = c.hidden_size;
        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::load(c, w, i))
            .collect::<Result<Vec<_>>>()?;
        let embed_tokens = w.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let lm_head = super::lm_head(c, w, &embed_tokens)?;
        let rope = crate::layers::rope_table(c, w, A::rope_dims(c), max_context)?;
        Ok(Self {
            mtp: mtp::MtpHead::load(c, w)?,
            norm: norm_weight(c, w, "model.norm.weight", h)?,
            embed_tokens,
            layers,
            lm_head,
            rope,
            device: w.device().clone(),
            dtype: w.dtype(),
            config,
            steps: StepPool::default(),
        })
    }
}

impl<A: SelfAttention> DecoderLm<A> {
    /// The last layer's output `[1, rows, hidden]` for the stacked new tokens of `batch`.
    fn hidden(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        let mrope = self.rope.sections().is_some();
        check_media_with(batch, self.rope.max_positions(), mrope)?;
        let eps = self.config.rms_norm_eps as f32;
        let ids = Tensor::new(stacked_ids(batch), &self.device)?.unsqueeze(0)?; // [1, rows]
        let x = self.embed_tokens.forward(&ids, self.dtype)?; // [1, rows, hidden]
        let x = splice_media(x, batch)?; // image rows in place of their tokens' embeddings
        let limits = moe_limits(batch);
        // Each layer's MLP output is added to the residual by the next layer's first norm
        // (one fused launch on a GPU instead of an add and a norm), except where image rows
        // may add deepstack features between layers.
        let defer = batch.iter().all(|s| s.media.is_none());
        let pending = std::cell::RefCell::new(None);
        let x = run_layers(
            batch,
            x,
            self.layers.len(),
            |i| i,
            |i, x, segments| {
                let next = self.layers.get(i + 1).map(|l| &l.mlp);
                let rows = (segments, limits.as_slice());
                let delta = pending.borrow_mut().take();
                let (x, out) = self.layers[i].forward(x, delta, eps, &self.rope, rows, next)?;
                match defer {
                    true => {
                        *pending.borrow_mut() = Some(out);
                        Ok(x)
                    }
                    false => Ok((x + out)?),
                }
            },
        )?;
        match pending.into_inner() {
            Some(out) => Ok((x + out)?),
            None => Ok(x),
        }
    }
}

impl<A: SelfAttention> DecoderLm<A> {
    /// Whether [`step_batch`](Self::step_batch) runs `batch`: one new token per sequence, no
    /// image rows or MTP head, on the CPU, through dense layers whose attention has a batched
    /// step.
    fn steps_batch(&self, batch: &mut [BatchSeq]) -> bool {
        let layers = (self.layers.iter())
            .all(|l| matches!(l.mlp, Ffn::Dense(_)) && l.self_attn.steps_rows());
        decodes_only(batch) && layers && self.device.is_cpu() && A::steps(&self.config)
    }

    /// [`forward_batch`](CausalLm::forward_batch) of one token per sequence over a batched
    /// step's buffers: the decode step with a row per sequence (matmuls on all rows at once,
    /// attention per sequence), allocating no tensors between the embeddings and the logits.
    /// Each row's bits are its sequence's `forward`'s.
    fn step_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        let (rows, h, vocab) = (batch.len(), self.config.hidden_size, self.config.vocab_size);
        let positions = batch_positions(batch, self.rope.max_positions())?;
        let positions: Vec<usize> = (batch.iter().zip(positions))
            .map(|(s, pos)| s.cache.rope_position(pos)) // past an M-RoPE image, its rotary position
            .collect();
        let eps = self.config.rms_norm_eps as f32;
        let mut logits = vec![0f32; rows * vocab];
        self.steps.run_rows(&self.config, rows, |b| -> Result<()> {
            for (x, s) in b.x.chunks_mut(h).zip(batch.iter()) {
                self.embed_tokens.row_into(s.tokens[0], x)?;
            }
            for (i, layer) in self.layers.iter().enumerate() {
                layer.step_rows(b, eps, &self.rope, &mut step_rows(batch, &positions, i))?;
            }
            head_rows_into(b, &self.norm, eps, &self.lm_head, &mut logits)
        })?;
        Ok(Tensor::from_vec(logits, (rows, vocab), &self.device)?)
    }
}

impl<A: SelfAttention> DecoderLm<A> {
    /// Runs the MTP head's rows of the pass just run for the sequences that keep one; `x` is
    /// the last layer's output.
    fn mtp_catch_up(&self, x: &Tensor, batch: &mut [BatchSeq]) -> Result<()> {
        let Some(mtp) = &self.mtp else { return Ok(()) };
        if batch.iter_mut().all(|s| s.cache.mtp().is_none()) {
            return Ok(());
        }
        let normed = rms_norm(x, &self.norm, self.config.rms_norm_eps as f32)?;
        mtp.catch_up(self, &normed, batch)
    }
}

impl<A: SelfAttention> DecoderLayer<A> {
    /// Loads `model.layers.{i}`.
    fn load(c: &ModelConfig, w: &Weights, i: usize) -> Result<Self> {
        let (p, h) = (format!("model.layers.{i}"), c.hidden_size);
        // Phi-3 fuses gate/up: split at load, the layer stays the same.
        let mlp = format!("{p}.mlp");
        let norm = |name: &str| norm_weight(c, w, &format!("{p}.{name}.weight"), h);
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm")?,
            self_attn: A::load(c, w, i)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            mlp: match w.contains(&format!("{mlp}.gate_up_proj.weight")) {
                true => Ffn::Dense(GatedMlp::load_fused(c, w, &mlp)?),
                false => Ffn::load(c, w, i)?,
            },
        })
    }

    /// `x: [1, rows, hidden]`, the stacked rows of `segments`, each routed to at most
    /// `limits[row]` experts (when given), plus `delta`, the previous layer's MLP output when
    /// it left it to this layer to add. Returns the residual after attention and the MLP's
    /// output, whose sum is the layer's output. `next`: the next layer's feed-forward, whose
    /// experts a streaming store starts reading on a guess from this layer's input to its own.
    fn forward(
        &self,
        x: &Tensor,
        delta: Option<Tensor>,
        eps: f32,
        rope: &RotaryEmbedding,
        (segments, limits): (&mut [Segment], &[usize]),
        next: Option<&Ffn>,
    ) -> Result<(Tensor, Tensor)> {
        let (x, normed) = match delta {
            Some(d) => add_rms_norm(x, &d, &self.input_layernorm, eps)?,
            None => (x.clone(), rms_norm(x, &self.input_layernorm, eps)?),
        };
        let attn = self.self_attn.forward(&normed, rope, segments)?;
        let (x, normed) = add_rms_norm(&x, &attn, &self.post_attention_layernorm, eps)?;
        if let Some(next) = next {
            next.speculate(&normed)?;
        }
        Ok((x, self.mlp.forward(&normed, limits)?))
    }

    /// [`step`](Self::step) for a batched step's rows (`b.x`, one per sequence of `seqs`), on
    /// a dense layer.
    fn step_rows(
        &self,
        b: &mut StepBuffers,
        eps: f32,
        rope: &RotaryEmbedding,
        seqs: &mut [StepRow],
    ) -> Result<()> {
        let Ffn::Dense(mlp) = &self.mlp else {
            let why = "a batched decode step runs dense layers only";
            return Err(peregrine_tensor::candle::Error::Msg(why.into()).into());
        };
        norm_rows_into(&b.x, &self.input_layernorm, eps, &mut b.normed)?;
        self.self_attn.step_rows(b, rope, seqs)?;
        add_into(&mut b.x, &b.out);
        norm_rows_into(&b.x, &self.post_attention_layernorm, eps, &mut b.normed)?;
        mlp.step(b)?;
        add_into(&mut b.x, &b.out);
        Ok(())
    }

    /// [`forward`](Self::forward) for one token over a decode step's buffers (`b.x`).
    fn step(
        &self,
        b: &mut StepBuffers,
        eps: f32,
        rope: &RotaryEmbedding,
        (cache, pos, limit): (&mut dyn LayerCache, usize, Option<usize>),
        next: Option<&Ffn>,
    ) -> Result<()> {
        norm_into(&b.x, &self.input_layernorm, eps, &mut b.normed)?;
        self.self_attn.step(b, rope, cache, pos)?;
        add_into(&mut b.x, &b.out);
        norm_into(&b.x, &self.post_attention_layernorm, eps, &mut b.normed)?;
        if let Some(next) = next {
            next.speculate_row(&b.normed)?;
        }
        self.mlp.step(b, limit)?;
        add_into(&mut b.x, &b.out);
        Ok(())
    }
}

impl<A: SelfAttention + 'static> CausalLm for DecoderLm<A> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        (0..self.layers.len())
            .map(|i| A::cache_kind(&self.config, i))
            .collect()
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let mut batch = [BatchSeq::last(tokens, cache)];
        let x = self.hidden(&mut batch)?;
        self.mtp_catch_up(&x, &mut batch)?;
        super::output_logits(&x, want, &self.norm, eps, &self.lm_head)
    }

    fn forward_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        if self.steps_batch(batch) {
            return self.step_batch(batch);
        }
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(batch)?;
        self.mtp_catch_up(&x, batch)?;
        batch_logits(&x, batch, &self.norm, eps, &self.lm_head)
    }

    fn mtp_spec(&self) -> Option<Vec<LayerKind>> {
        self.mtp.as_ref().map(|m| m.spec().to_vec())
    }

    fn mtp_step(
        &self,
        input: (&[f32], u32),
        cache: &mut SequenceCache,
        output: (&mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<()> {
        match &self.mtp {
            Some(mtp) => mtp.step(self, input, cache, output),
            None => Err(crate::ModelError::config(
                std::path::Path::new(&self.config.model_type),
                "this model was loaded without multi-token-prediction layers",
            )),
        }
    }

    fn decode(&self, token: u32, cache: &mut SequenceCache, logits: &mut Vec<f32>) -> Result<()> {
        // The MTP head's rows run on the forward path.
        if !self.device.is_cpu() || !A::steps(&self.config) || cache.mtp().is_some() {
            return crate::decode_with_forward(self, token, cache, logits);
        }
        let (pos, limit) = (cache.len(), cache.moe_top_k());
        super::check_room(1, pos, self.rope.max_positions())?;
        let pos = cache.rope_position(pos); // past an M-RoPE image, its rotary position
        let eps = self.config.rms_norm_eps as f32;
        self.steps.run(&self.config, |b| {
            self.embed_tokens.row_into(token, &mut b.x)?;
            for (i, layer) in self.layers.iter().enumerate() {
                let next = self.layers.get(i + 1).map(|l| &l.mlp);
                layer.step(b, eps, &self.rope, (cache.layer(i), pos, limit), next)?;
            }
            let vocab = self.config.vocab_size;
            output_logits_into(b, &self.norm, eps, &self.lm_head, vocab, logits)
        })
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let layers = self.layers.iter();
        let layer_bytes = layers.map(|l| l.self_attn.weight_bytes() + l.mlp.weight_bytes());
        let mtp = self.mtp.as_ref().map_or(0, |m| m.weight_bytes());
        mtp + super::decoder_weight_bytes(
            &self.config,
            self.dtype,
            2,
            layer_bytes.sum(),
            &self.embed_tokens,
            &self.lm_head,
        )
    }
}
