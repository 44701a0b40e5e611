//! DeepSeek-V3 (and its R1 / V3.1 checkpoints): multi-head latent attention, sigmoid
//! group-limited routed experts with shared experts, YaRN RoPE.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/deepseek_v3/modeling_deepseek_v3.py>
//!
//! What differs from llama, and where it is handled:
//! - Attention is MLA (`layers/mla.rs`): `q_lora_rank` (null: a plain `q_proj`), `kv_lora_rank`,
//!   `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; scores scaled by
//!   `(nope + rope)^-0.5 · mscale²` with `mscale = yarn_get_mscale(factor, mscale_all_dim)` when
//!   the RoPE scaling has a non-zero `mscale_all_dim` (transformers' `yarn_apply_mscale`).
//!   The cache holds decompressed per-head keys and values (see `layers/mla.rs`).
//! - RoPE covers `qk_rope_head_dim` only, YaRN-scaled (`RopeScaling::Yarn`); `rope_interleave`
//!   (default true) rotates adjacent pairs.
//! - Layers `< first_k_dense_replace` have a dense MLP of `intermediate_size`; the others are
//!   MoE (`mlp.gate` with `e_score_correction_bias`, `mlp.experts.N`, `mlp.shared_experts` of
//!   `moe_intermediate_size · n_shared_experts`): sigmoid scores, `n_group` / `topk_group`
//!   group-limited choice, `norm_topk_prob`, weights times `routed_scaling_factor`.
//! - Real checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the
//!   last one (`model.layers.61.*` in DeepSeek-V3); only layers `< num_hidden_layers` are read,
//!   so they are ignored.

use peregrine_kv::{LayerCache, LayerKind, SequenceCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, Device, Embedding, QLinear, RopeScaling, RotaryEmbedding, Tensor};

use crate::config::{ExpertNaming, Fields, MlaConfig, MoeConfig, SigmoidRouting, yarn_get_mscale};
use crate::layers::mla::Mla;
use crate::layers::moe::Ffn;
use crate::layers::norm_weight;
use crate::layers::step::{StepBuffers, StepPool, add_into, norm_into, output_logits_into};
use crate::weights::Weights;
use crate::{CausalLm, Logits, ModelConfig, Result};

/// Reads the MLA and MoE fields. `head_dim` becomes the cached head width (`nope + rope`) and
/// the key/value heads the query heads (MLA has no grouped heads).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    match fields.opt_str("hidden_act")? {
        None | Some("silu") => {}
        Some(other) => {
            return Err(fields.err(format!(
                "deepseek_v3 with `hidden_act` `{other}` is not supported (only `silu`)"
            )));
        }
    }
    let nope = fields.usize("qk_nope_head_dim")?;
    let rope = fields.usize("qk_rope_head_dim")?;
    let v = fields.usize("v_head_dim")?;
    if v > nope + rope {
        return Err(fields.err(format!(
            "`v_head_dim` {v} wider than `qk_nope_head_dim + qk_rope_head_dim` {} is not supported",
            nope + rope
        )));
    }
    let mut softmax_scale = ((nope + rope) as f64).powf(-0.5);
    let params = match fields.object("rope_parameters")? {
        Some(p) => Some(p),
        None => fields.object("rope_scaling")?,
    };
    if let (Some(p), RopeScaling::Yarn { factor, .. }) = (&params, &config.rope_scaling)
        && let Some(all) = p.opt_f64("mscale_all_dim")?.filter(|m| *m != 0.0)
    {
        let mscale = yarn_get_mscale(*factor, all);
        softmax_scale *= mscale * mscale;
    }
    config.mla = Some(MlaConfig {
        q_lora_rank: fields.opt_usize("q_lora_rank")?,
        kv_lora_rank: fields.usize("kv_lora_rank")?,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: v,
        softmax_scale,
    });
    config.head_dim = nope + rope;
    config.num_key_value_heads = config.num_attention_heads;
    config.partial_rotary_factor = rope as f64 / (nope + rope) as f64;
    // DeepSeek's checkpoints keep the RoPE dimensions in adjacent pairs (transformers' default).
    if fields.opt_bool("rope_interleave")?.unwrap_or(true) {
        config.rope_style = peregrine_tensor::RopeStyle::Interleaved;
    }
    let experts = fields.usize("n_routed_experts")?;
    let top_k = fields.usize("num_experts_per_tok")?;
    if top_k > experts {
        return Err(fields.err(format!(
            "`num_experts_per_tok` {top_k} exceeds the {experts} experts"
        )));
    }
    let moe_intermediate = fields.usize("moe_intermediate_size")?;
    let dense = fields.opt_usize("first_k_dense_replace")?.unwrap_or(0);
    let groups = match (
        fields.opt_usize("n_group")?,
        fields.opt_usize("topk_group")?,
    ) {
        (Some(g), Some(k)) if g > 1 => {
            if !experts.is_multiple_of(g) || k > g {
                return Err(fields.err(format!(
                    "`n_group` {g} / `topk_group` {k} do not divide the {experts} experts"
                )));
            }
            Some((g, k))
        }
        _ => None,
    };
    config.moe = Some(MoeConfig {
        num_experts: experts,
        top_k,
        intermediate_size: moe_intermediate,
        normalize: fields.opt_bool("norm_topk_prob")?.unwrap_or(true),
        sparse_layers: (0..config.num_hidden_layers).map(|i| i >= dense).collect(),
        naming: ExpertNaming::Qwen,
        sigmoid: Some(SigmoidRouting {
            groups,
            scale: fields.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
        }),
        shared_intermediate_size: fields
            .opt_usize("n_shared_experts")?
            .map(|n| n * moe_intermediate),
    });
    Ok(())
}

struct Layer {
    input_layernorm: Tensor,
    self_attn: Mla,
    post_attention_layernorm: Tensor,
    mlp: Ffn,
}

/// DeepSeek-V3's decoder.
pub struct DeepseekV3Lm {
    config: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: QLinear,
    rope: RotaryEmbedding,
    device: Device,
    dtype: DType,
    steps: StepPool,
}

impl DeepseekV3Lm {
    /// Loads layers `0..num_hidden_layers` (any MTP layers after them are not read).
    pub fn load(config: ModelConfig, w: &Weights, max_context: usize) -> Result<Self> {
        let c = &config;
        let h = c.hidden_size;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Ok(Layer {
                    input_layernorm: norm_weight(c, w, &format!("{p}.input_layernorm.weight"), h)?,
                    self_attn: Mla::load(c, w, &format!("{p}.self_attn"))?,
                    post_attention_layernorm: norm_weight(
                        c,
                        w,
                        &format!("{p}.post_attention_layernorm.weight"),
                        h,
                    )?,
                    mlp: Ffn::load(c, w, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_tokens = w.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let lm_head = match c.tie_word_embeddings && !w.contains("lm_head.weight") {
            true => embed_tokens.as_linear()?,
            false => w.linear("lm_head", c.vocab_size, h, false)?,
        };
        let rope = RotaryEmbedding::new_partial(
            (c.head_dim, c.rotary_dim()),
            c.rope_theta,
            &c.rope_scaling,
            c.rope_style,
            max_context,
            DType::F32,
            w.device(),
        )?;
        Ok(Self {
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

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        eps: f32,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        start: usize,
    ) -> Result<Tensor> {
        let normed = rms_norm(x, &self.input_layernorm, eps)?;
        let x = (x + self.self_attn.forward(&normed, rope, cache, start)?)?;
        let mlp = (self.mlp).forward(&rms_norm(&x, &self.post_attention_layernorm, eps)?)?;
        Ok((x + mlp)?)
    }

    fn step(
        &self,
        b: &mut StepBuffers,
        eps: f32,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        pos: usize,
    ) -> Result<()> {
        norm_into(&b.x, &self.input_layernorm, eps, &mut b.normed)?;
        self.self_attn.step(b, rope, cache, pos)?;
        add_into(&mut b.x, &b.out);
        norm_into(&b.x, &self.post_attention_layernorm, eps, &mut b.normed)?;
        self.mlp.step(b)?;
        add_into(&mut b.x, &b.out);
        Ok(())
    }
}

impl CausalLm for DeepseekV3Lm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        vec![LayerKind::Full; self.layers.len()]
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let n = tokens.len();
        let start = cache.len();
        crate::layers::check_room(n, start, self.rope.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        let ids = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        let mut x = self.embed_tokens.forward(&ids, self.dtype)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, eps, &self.rope, cache.layer(i), start)?;
        }
        crate::layers::output_logits(&x, want, &self.norm, eps, &self.lm_head)
    }

    fn decode(&self, token: u32, cache: &mut SequenceCache, logits: &mut Vec<f32>) -> Result<()> {
        if !self.device.is_cpu() {
            return crate::decode_with_forward(self, token, cache, logits);
        }
        let pos = cache.len();
        crate::layers::check_room(1, pos, self.rope.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        self.steps.run(&self.config, |b| {
            self.embed_tokens.row_into(token, &mut b.x)?;
            for (i, layer) in self.layers.iter().enumerate() {
                layer.step(b, eps, &self.rope, cache.layer(i), pos)?;
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
        crate::layers::decoder_weight_bytes(
            &self.config,
            self.dtype,
            2,
            layer_bytes.sum(),
            &self.embed_tokens,
            &self.lm_head,
        )
    }
}
