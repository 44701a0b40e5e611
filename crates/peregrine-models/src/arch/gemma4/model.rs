//! The Gemma decoder (Gemma 2, 3 and 4): four norms per layer around the shared attention and
//! the gated MLP (GELU-tanh), one RoPE table per layer kind, output logits soft-capped when the
//! config says so. Gemma 2 and 3 are the plain form (their own q/k norms, score scaling and
//! caps come from the config); Gemma 4 adds v-norms, KV-shared layers reading an earlier
//! layer's cache slot, an MoE block beside the MLP, a per-layer input block after it and a
//! scalar on each layer's output (see the [module above](super)), each `None` or 1 when the
//! config or checkpoint has none.

mod rows;

use peregrine_kv::{LayerCache, LayerKind, SequenceCache, SharedView};
use peregrine_tensor::ops::{Gate, gelu_mul, rms_norm};
use peregrine_tensor::{DType, Device, Embedding, QLinear, RopeScaling, RotaryEmbedding, Tensor};

use crate::config::PerLayerInput;
use crate::layers::attention::{Attention, KvProjections};
use crate::layers::batch::{
    BatchSeq, Segment, batch_logits, check_media, moe_limits, record_hidden, run_layers,
    splice_media, stacked_ids,
};
use crate::layers::decoder::SelfAttention;
use crate::layers::mlp::GatedMlp;
use crate::layers::moe::MoeBlock;
use crate::layers::step::{
    StepBuffers, StepPool, add_normed_into, norm_into, norm_rows_in_place, output_logits_into,
    softcap_in_place,
};
use crate::layers::{add_normed, norm_weight, softcapped};
use crate::weights::Weights;
use crate::{CausalLm, Logits, ModelConfig, Result, SharedKv};

/// The MoE block and the norms that join it to the dense MLP's output.
struct Moe {
    block: MoeBlock,
    /// `post_feedforward_layernorm_1`, on the dense MLP's output.
    post_dense: Tensor,
    /// `post_feedforward_layernorm_2`, on the experts' output.
    post_experts: Tensor,
}

/// A layer's per-layer input block: `x + norm(projection(gelu(gate(x)) · input))`.
struct PerLayerBlock {
    gate: QLinear,
    projection: QLinear,
    norm: Tensor,
}

/// The model-wide half of the per-layer inputs: every layer's input for each token, from a
/// table of its own and a projection of the token's embedding.
struct PerLayerInputs {
    /// `embed_tokens_per_layer`, `[vocab, layers · width]`.
    embed: Embedding,
    /// `per_layer_model_projection`, `[layers · width, hidden]`.
    projection: QLinear,
    /// `per_layer_projection_norm`, `[width]`.
    norm: Tensor,
    width: usize,
    /// `sqrt(width)`, the table's scale; `hidden^-0.5`, the projection's.
    scales: (f32, f32),
    /// The token whose table row image and audio positions read.
    pad: u32,
}

/// transformers' `per_layer_input_scale`: the sum of the two halves times `2^-0.5`.
const PER_LAYER_INPUT_SCALE: f32 = std::f32::consts::FRAC_1_SQRT_2;

struct Layer {
    input_layernorm: Tensor,
    self_attn: Attention,
    post_attention_layernorm: Tensor,
    pre_feedforward_layernorm: Tensor,
    mlp: GatedMlp,
    moe: Option<Moe>,
    post_feedforward_layernorm: Tensor,
    per_layer: Option<PerLayerBlock>,
    /// `layer_scalar`.
    scalar: f32,
    sliding: bool,
    /// The cache slot the layer attends to: its own, or its KV source's.
    slot: usize,
}

/// Gemma 2, 3 and 4 (text): see the [module above](super).
pub struct GemmaLm {
    config: ModelConfig,
    embed_tokens: Embedding,
    /// `sqrt(hidden_size)` in the compute dtype.
    embed_scale: Tensor,
    per_layer_inputs: Option<PerLayerInputs>,
    layers: Vec<Layer>,
    /// The cache kind of each slot (the layers that project keys and values).
    slots: Vec<LayerKind>,
    norm: Tensor,
    lm_head: QLinear,
    rope_global: RotaryEmbedding,
    rope_local: RotaryEmbedding,
    device: Device,
    dtype: DType,
    steps: StepPool,
}

impl GemmaLm {
    /// Loads the weights for `config`; RoPE tables cover `max_context` positions.
    pub fn load(config: ModelConfig, w: &Weights, max_context: usize) -> Result<Self> {
        Self::load_with(config, w, max_context, false)
    }

    /// [`load`](Self::load); `shared`: every layer projects only queries, reading another
    /// model's keys and values ([`run_shared`](Self::run_shared), Gemma 4's assistant).
    pub(crate) fn load_with(
        config: ModelConfig,
        w: &Weights,
        max_context: usize,
        shared: bool,
    ) -> Result<Self> {
        let c = &config;
        let h = c.hidden_size;
        // Without a pattern every layer slides when the config has a window (Mistral-style).
        let sliding: Vec<bool> = (0..c.num_hidden_layers)
            .map(|i| match (&c.sliding_layers, c.sliding_window) {
                (Some(s), Some(_)) => s[i],
                (None, Some(_)) => true,
                (_, None) => false,
            })
            .collect();
        let window = c.sliding_window.unwrap_or(usize::MAX);
        let (mut layers, mut slots) = (Vec::new(), Vec::new());
        for (i, &slides) in sliding.iter().enumerate() {
            let (p, lc) = (format!("model.layers.{i}"), c.for_layer(i));
            let spec = c.layer_specs.get(i);
            let kv = match spec {
                _ if shared => KvProjections::Shared,
                Some(s) if s.kv_source.is_some() => KvProjections::Shared,
                Some(s) if s.values_from_keys => KvProjections::ValuesFromKeys,
                _ => KvProjections::Own,
            };
            let slot = match (shared, spec.and_then(|s| s.kv_source)) {
                (true, _) => 0,
                (false, Some(source)) => layers.get(source).map_or(0, |l: &Layer| l.slot),
                (false, None) => {
                    slots.push(match slides {
                        true => LayerKind::Sliding { window },
                        false => LayerKind::Full,
                    });
                    slots.len() - 1
                }
            };
            let norm = |name: &str| norm_weight(c, w, &format!("{p}.{name}.weight"), h);
            let moe = match &c.moe {
                Some(moe) => Some(Moe {
                    block: MoeBlock::load(c, w, i, moe)?,
                    post_dense: norm("post_feedforward_layernorm_1")?,
                    post_experts: norm("post_feedforward_layernorm_2")?,
                }),
                None => None,
            };
            let per_layer = match c.per_layer_input {
                Some(PerLayerInput { hidden: pl, .. }) => Some(PerLayerBlock {
                    gate: w.linear(&format!("{p}.per_layer_input_gate"), pl, h, false)?,
                    projection: w.linear(&format!("{p}.per_layer_projection"), h, pl, false)?,
                    norm: norm("post_per_layer_input_norm")?,
                }),
                None => None,
            };
            let scalar = match w.contains(&format!("{p}.layer_scalar")) {
                true => w.tensor(&format!("{p}.layer_scalar"), &[1])?,
                false => Tensor::new(&[1f32], w.device())?,
            };
            layers.push(Layer {
                input_layernorm: norm("input_layernorm")?,
                self_attn: Attention::load_kv(&lc, w, &format!("{p}.self_attn"), kv)?,
                post_attention_layernorm: norm("post_attention_layernorm")?,
                pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
                mlp: GatedMlp::load(&lc, w, &format!("{p}.mlp"))?,
                moe,
                post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
                per_layer,
                scalar: scalar.to_dtype(DType::F32)?.to_vec1::<f32>()?[0],
                sliding: slides,
                slot,
            });
        }
        let per_layer_inputs = match c.per_layer_input {
            Some(PerLayerInput {
                hidden: pl,
                vocab,
                pad,
            }) => {
                let all = pl * c.num_hidden_layers;
                Some(PerLayerInputs {
                    embed: w.embedding("model.embed_tokens_per_layer.weight", vocab, all)?,
                    projection: w.linear("model.per_layer_model_projection", all, h, false)?,
                    norm: norm_weight(c, w, "model.per_layer_projection_norm.weight", pl)?,
                    width: pl,
                    scales: ((pl as f32).sqrt(), (h as f32).powf(-0.5)),
                    pad,
                })
            }
            None => None,
        };
        let embed_tokens = w.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let lm_head = crate::layers::lm_head(c, w, &embed_tokens)?;
        // One table per layer kind, at that kind's head width.
        let rope = |sliding: bool, theta: f64, scaling: &RopeScaling| {
            let i = layers
                .iter()
                .position(|l| l.sliding == sliding)
                .unwrap_or(0);
            let head_dim = c.for_layer(i).head_dim;
            let style = c.rope_style;
            RotaryEmbedding::new(
                head_dim,
                theta,
                scaling,
                style,
                max_context,
                w.dtype(),
                w.device(),
            )
        };
        let rope_global = rope(false, c.rope_theta, &c.rope_scaling)?;
        // Gemma 2 has one RoPE base (and scaling) for both kinds.
        let rope_local = match c.rope_local_theta {
            Some(theta) => rope(true, theta, &RopeScaling::None)?,
            None => rope_global.clone(),
        };
        let embed_scale = Tensor::new(&[(h as f32).sqrt()], w.device())?.to_dtype(w.dtype())?;
        Ok(Self {
            rope_global,
            rope_local,
            norm: norm_weight(c, w, "model.norm.weight", h)?,
            embed_tokens,
            embed_scale,
            per_layer_inputs,
            layers,
            slots,
            lm_head,
            device: w.device().clone(),
            dtype: w.dtype(),
            config,
            steps: StepPool::default(),
        })
    }

    /// The last layer's output `[1, rows, hidden]` for the stacked new tokens of `batch`.
    fn hidden(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        check_media(batch, self.rope_global.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        let stacked = stacked_ids(batch);
        let ids = Tensor::new(stacked.as_slice(), &self.device)?.unsqueeze(0)?; // [1, rows]
        let x = self.embed_tokens.forward(&ids, self.dtype)?;
        // [1, rows, hidden]; image and audio rows replace their tokens' embeddings unscaled.
        let x = splice_media(x.broadcast_mul(&self.embed_scale)?, batch)?;
        let layers = self.layers.len();
        let inputs = (self.per_layer_inputs.as_ref())
            .map(|p| {
                p.forward(
                    &media_as_pad(&stacked, batch, p.pad, &self.device)?,
                    &x,
                    layers,
                    eps,
                )
            })
            .transpose()?; // [1, rows, layers, width]
        let slot = |i: usize| self.layers[i].slot;
        let limits = moe_limits(batch);
        let gemma4 = self.config.model_type.starts_with("gemma4");
        run_layers(batch, x, layers, slot, |i, x, segments| {
            if gemma4 && !self.layers[i].sliding {
                // Gemma 4's picture tokens see each other both ways in sliding layers only
                // (Gemma 3's in every layer).
                segments.iter_mut().for_each(|s| s.both_ways = None);
            }
            let input = match &inputs {
                Some(t) => Some(t.narrow(2, i, 1)?.squeeze(2)?),
                None => None,
            };
            let layer = &self.layers[i];
            layer.forward(x, input, eps, self.rope(layer), (segments, &limits))
        })
    }

    /// One row `x` (`[1, 1, hidden]`, already embedded) at position `pos` through every layer,
    /// each reading the slot `kv` names for its kind in `target` as a query past its end
    /// (sliding layers over the last `window + 1` positions, as transformers' flipped
    /// bidirectional window has it): the final norm's output. For a model loaded `shared`.
    pub(crate) fn run_shared(
        &self,
        x: &Tensor,
        target: &mut SequenceCache,
        pos: usize,
        kv: SharedKv,
    ) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let mut x = x.clone();
        for layer in &self.layers {
            let (slot, last) = match (layer.sliding, kv.sliding) {
                (true, Some((slot, window))) => (slot, Some(window + 1)),
                _ => (kv.full, None),
            };
            let mut view = SharedView::new(&*target.layer(slot), last);
            let mut segment = [Segment::causal(&mut view, pos, 1)];
            x = layer.forward(&x, None, eps, self.rope(layer), (&mut segment, &[]))?;
        }
        Ok(rms_norm(&x, &self.norm, eps)?)
    }

    /// The output head (the embedding table, tied).
    pub(crate) fn lm_head(&self) -> &QLinear {
        &self.lm_head
    }

    fn rope(&self, layer: &Layer) -> &RotaryEmbedding {
        match layer.sliding {
            true => &self.rope_local,
            false => &self.rope_global,
        }
    }
}

impl GemmaLm {
    /// Keeps the final hidden states of the sequences whose caches ask for them (a drafter
    /// starting from them, [`SequenceCache::enable_mtp`]); `x` is the last layer's output.
    fn keep_hidden(&self, x: &Tensor, batch: &mut [BatchSeq]) -> Result<()> {
        if batch.iter_mut().all(|s| s.cache.mtp().is_none()) {
            return Ok(());
        }
        let normed = rms_norm(x, &self.norm, self.config.rms_norm_eps as f32)?;
        record_hidden(&normed, batch)
    }
}

impl PerLayerInputs {
    /// Every layer's input for `ids` (`[1, n]`) whose scaled embeddings are `x`
    /// (`[1, n, hidden]`): `(norm(projection(x) · hidden^-0.5) + table(ids) · sqrt(width)) ·
    /// 2^-0.5`, `[1, n, layers, width]`.
    fn forward(&self, ids: &Tensor, x: &Tensor, layers: usize, eps: f32) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let shape = (b, n, layers, self.width);
        let token = self.embed.forward(ids, x.dtype())?;
        let token = token.affine(self.scales.0 as f64, 0.0)?.reshape(shape)?;
        let projected = self
            .projection
            .forward(x)?
            .affine(self.scales.1 as f64, 0.0)?;
        let projected = rms_norm(&projected.reshape(shape)?, &self.norm, eps)?;
        Ok((projected + token)?.affine(PER_LAYER_INPUT_SCALE as f64, 0.0)?)
    }

    /// [`forward`](Self::forward) for one token into `b.per_layer.inputs`; `b.x` holds its
    /// scaled embedding.
    fn step(&self, token: u32, b: &mut StepBuffers, eps: f32) -> Result<()> {
        let (pl, linear) = (&mut b.per_layer, &mut b.linear);
        QLinear::forward_group_into(&[&self.projection], &b.x, &mut [&mut pl.inputs], linear)?;
        pl.inputs.iter_mut().for_each(|v| *v *= self.scales.1);
        norm_rows_in_place(&mut pl.inputs, &self.norm, eps)?;
        self.embed.row_into(token, &mut pl.token)?;
        for (v, t) in pl.inputs.iter_mut().zip(&pl.token) {
            *v = (*v + t * self.scales.0) * PER_LAYER_INPUT_SCALE;
        }
        Ok(())
    }
}

impl Layer {
    /// `x: [1, rows, hidden]`, the stacked rows of `segments`, each routed to at most
    /// `limits[row]` experts (when given); `input`: this layer's per-layer input
    /// `[1, rows, width]`.
    fn forward(
        &self,
        x: &Tensor,
        input: Option<Tensor>,
        eps: f32,
        rope: &RotaryEmbedding,
        (segments, limits): (&mut [Segment], &[usize]),
    ) -> Result<Tensor> {
        let normed = rms_norm(x, &self.input_layernorm, eps)?;
        let attn = self.self_attn.forward(&normed, rope, segments)?;
        let x = add_normed(x, &attn, &self.post_attention_layernorm, eps)?;
        let mut y = (self.mlp).forward(&rms_norm(&x, &self.pre_feedforward_layernorm, eps)?)?;
        if let Some(moe) = &self.moe {
            // The experts see the residual, not the dense MLP's normed input.
            let experts = rms_norm(&moe.block.forward(&x, limits)?, &moe.post_experts, eps)?;
            y = (rms_norm(&y, &moe.post_dense, eps)? + experts)?;
        }
        let mut x = add_normed(&x, &y, &self.post_feedforward_layernorm, eps)?;
        if let (Some(p), Some(input)) = (&self.per_layer, input) {
            let gated = gelu_mul(&p.gate.forward(&x)?, &input)?;
            x = add_normed(&x, &p.projection.forward(&gated)?, &p.norm, eps)?;
        }
        match self.scalar {
            1.0 => Ok(x),
            scalar => Ok(x.affine(scalar as f64, 0.0)?),
        }
    }

    /// [`forward`](Self::forward) for one token over a decode step's buffers (`b.x`); layer
    /// `i`'s per-layer input is in `b.per_layer.inputs`.
    fn step(
        &self,
        i: usize,
        b: &mut StepBuffers,
        eps: f32,
        rope: &RotaryEmbedding,
        (cache, pos, limit): (&mut dyn LayerCache, usize, Option<usize>),
    ) -> Result<()> {
        norm_into(&b.x, &self.input_layernorm, eps, &mut b.normed)?;
        self.self_attn.step(b, rope, cache, pos)?;
        add_normed_into(
            &mut b.x,
            &b.out,
            &self.post_attention_layernorm,
            eps,
            &mut b.normed,
        )?;
        norm_into(&b.x, &self.pre_feedforward_layernorm, eps, &mut b.normed)?;
        self.mlp.step(b)?;
        if let Some(moe) = &self.moe {
            norm_into(&b.out, &moe.post_dense, eps, &mut b.side)?;
            b.normed.copy_from_slice(&b.x);
            moe.block.step(b, limit)?;
            norm_into(&b.out, &moe.post_experts, eps, &mut b.normed)?;
            let (dense, experts) = (&b.side, &b.normed);
            (b.out.iter_mut().zip(dense).zip(experts)).for_each(|((o, d), e)| *o = d + e);
        }
        add_normed_into(
            &mut b.x,
            &b.out,
            &self.post_feedforward_layernorm,
            eps,
            &mut b.normed,
        )?;
        if let Some(p) = &self.per_layer {
            let pl = &mut b.per_layer;
            let input = &pl.inputs[i * pl.gate.len()..][..pl.gate.len()];
            let gate = &mut pl.gate[..];
            QLinear::forward_group_into(&[&p.gate], &b.x, &mut [&mut *gate], &mut b.linear)?;
            Gate::GeluTanh.apply_in_place(gate, input);
            QLinear::forward_group_into(&[&p.projection], gate, &mut [&mut b.out], &mut b.linear)?;
            add_normed_into(&mut b.x, &b.out, &p.norm, eps, &mut b.normed)?;
        }
        if self.scalar != 1.0 {
            b.x.iter_mut().for_each(|x| *x *= self.scalar);
        }
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        let moe = self.moe.as_ref().map_or(0, |m| m.block.weight_bytes());
        let per_layer = (self.per_layer.as_ref())
            .map_or(0, |p| p.gate.weight_bytes() + p.projection.weight_bytes());
        self.self_attn.weight_bytes() + self.mlp.weight_bytes() + moe + per_layer
    }
}

impl CausalLm for GemmaLm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// One slot per layer that projects keys and values; KV-shared layers have none.
    fn cache_spec(&self) -> Vec<LayerKind> {
        self.slots.clone()
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let mut batch = [BatchSeq::last(tokens, cache)];
        let x = self.hidden(&mut batch)?;
        self.keep_hidden(&x, &mut batch)?;
        let logits = crate::layers::output_logits(&x, want, &self.norm, eps, &self.lm_head)?;
        softcapped(logits, self.config.final_logit_softcapping)
    }

    fn forward_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        if self.steps_batch(batch) {
            return self.step_batch(batch);
        }
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(batch)?;
        self.keep_hidden(&x, batch)?;
        let logits = batch_logits(&x, batch, &self.norm, eps, &self.lm_head)?;
        softcapped(logits, self.config.final_logit_softcapping)
    }

    fn shared_kv(&self) -> Option<SharedKv> {
        let last = |sliding| (self.layers.iter().rev()).find(|l| l.sliding == sliding);
        let window = self.config.sliding_window.unwrap_or(usize::MAX);
        Some(SharedKv {
            full: last(false)?.slot,
            sliding: last(true).map(|l| (l.slot, window)),
        })
    }

    fn input_embedding(&self, token: u32) -> Result<Tensor> {
        let ids = Tensor::new(&[token], &self.device)?.unsqueeze(0)?;
        let x = self.embed_tokens.forward(&ids, self.dtype)?;
        Ok(x.broadcast_mul(&self.embed_scale)?)
    }

    fn decode(&self, token: u32, cache: &mut SequenceCache, logits: &mut Vec<f32>) -> Result<()> {
        // A drafter's hidden states are kept on the forward path.
        if !self.device.is_cpu() || cache.mtp().is_some() {
            return crate::decode_with_forward(self, token, cache, logits);
        }
        let (pos, limit) = (cache.len(), cache.moe_top_k());
        crate::layers::check_room(1, pos, self.rope_global.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        let scale = (self.config.hidden_size as f32).sqrt();
        self.steps.run(&self.config, |b| {
            self.embed_tokens.row_into(token, &mut b.x)?;
            b.x.iter_mut().for_each(|x| *x *= scale);
            if let Some(p) = &self.per_layer_inputs {
                p.step(token, b, eps)?;
            }
            for (i, layer) in self.layers.iter().enumerate() {
                let cache = cache.layer(layer.slot);
                layer.step(i, b, eps, self.rope(layer), (cache, pos, limit))?;
            }
            let vocab = self.config.vocab_size;
            output_logits_into(b, &self.norm, eps, &self.lm_head, vocab, logits)?;
            if let Some(cap) = self.config.final_logit_softcapping {
                softcap_in_place(logits, cap as f32);
            }
            Ok(())
        })
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let layer_bytes = self.layers.iter().map(Layer::weight_bytes).sum();
        let per_layer = (self.per_layer_inputs.as_ref())
            .map_or(0, |p| p.embed.weight_bytes() + p.projection.weight_bytes());
        let norms = if self.config.moe.is_some() { 7 } else { 4 };
        per_layer
            + crate::layers::decoder_weight_bytes(
                &self.config,
                self.dtype,
                norms,
                layer_bytes,
                &self.embed_tokens,
                &self.lm_head,
            )
    }
}

/// The stacked ids `[1, rows]` of `batch` with each media row's token replaced by `pad`: the
/// per-layer table's row transformers gives image and audio positions.
fn media_as_pad(ids: &[u32], batch: &[BatchSeq], pad: u32, device: &Device) -> Result<Tensor> {
    let mut ids = ids.to_vec();
    let mut at = 0;
    for s in batch.iter() {
        if let Some(m) = &s.media {
            let rows = m.rows.dim(0)?;
            ids[at + m.offset..at + m.offset + rows].fill(pad);
        }
        at += s.tokens.len();
    }
    Ok(Tensor::new(ids.as_slice(), device)?.unsqueeze(0)?)
}
