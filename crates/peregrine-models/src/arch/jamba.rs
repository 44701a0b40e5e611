//! Jamba (`jamba`): Mamba layers with an attention layer every `attn_layer_period`, and routed
//! experts in place of the MLP every `expert_layer_period`.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/jamba/modeling_jamba.py>
//!
//! Layer `i` mixes with attention when `i % attn_layer_period == attn_layer_offset` (no
//! positional encoding: the Mamba layers carry the order), else with a [`MambaMixer`]; its
//! feed-forward is MoE (softmax top-k, not renormalised) when `i % expert_layer_period ==
//! expert_layer_offset`. Pre-norm residual blocks (`input_layernorm`, `pre_ff_layernorm`),
//! `final_layernorm`.

use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, Device, Embedding, QLinear, RotaryEmbedding, Tensor};

use crate::config::{ExpertNaming, Fields, MoeConfig};
use crate::layers::attention::Attention;
use crate::layers::batch::{
    BatchSeq, Segment, batch_logits, check_batch, moe_limits, run_layers, stacked_ids,
};
use crate::layers::decoder::SelfAttention;
use crate::layers::mamba::{MambaConfig, MambaMixer};
use crate::layers::mlp::GatedMlp;
use crate::layers::moe::{Ffn, MoeBlock};
use crate::weights::Weights;
use crate::weights::gguf_config::GgufMeta;
use crate::{CausalLm, LayerKind, Logits, ModelConfig, ModelError, Result, SequenceCache};

/// Reads the Mamba sizes, the layer periods and the MoE block.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    if let Some(act) = fields.opt_str("hidden_act")?.filter(|a| *a != "silu") {
        return Err(fields.err(format!("jamba with `hidden_act` `{act}`: only `silu`")));
    }
    let h = config.hidden_size;
    let expand = fields.opt_usize("mamba_expand")?.unwrap_or(2);
    let every = |period: &str, offset: &str, defaults: (usize, usize)| -> Result<Vec<bool>> {
        let p = fields.opt_usize(period)?.unwrap_or(defaults.0).max(1);
        let o = fields.opt_usize(offset)?.unwrap_or(defaults.1);
        Ok((0..config.num_hidden_layers).map(|i| i % p == o).collect())
    };
    let attention = every("attn_layer_period", "attn_layer_offset", (8, 4))?;
    let experts = every("expert_layer_period", "expert_layer_offset", (2, 1))?;
    let mamba = MambaConfig {
        inner: expand * h,
        state: fields.opt_usize("mamba_d_state")?.unwrap_or(16),
        conv_kernel: fields.opt_usize("mamba_d_conv")?.unwrap_or(4),
        dt_rank: fields.opt_usize("mamba_dt_rank")?.unwrap_or(h.div_ceil(16)),
        conv_bias: fields.opt_bool("mamba_conv_bias")?.unwrap_or(true),
        bias: fields.opt_bool("mamba_proj_bias")?.unwrap_or(false),
        layers: attention.iter().map(|a| !a).collect(),
    };
    if mamba.conv_kernel < 2 {
        return Err(fields.err("`mamba_d_conv` must be at least 2".into()));
    }
    let num_experts = fields.opt_usize("num_experts")?.unwrap_or(16);
    if num_experts > 1 {
        let top_k = fields.opt_usize("num_experts_per_tok")?.unwrap_or(2);
        config.moe = Some(MoeConfig {
            num_experts,
            top_k: top_k.min(num_experts),
            intermediate_size: config.intermediate_size,
            normalize: false,
            sparse_layers: experts,
            naming: ExpertNaming::Jamba,
            sigmoid: None,
            shared_intermediate_size: None,
            shared_gated: false,
        });
    }
    config.no_rope = true;
    config.mamba = Some(mamba);
    Ok(())
}

/// A `jamba` GGUF file: the Mamba sizes from `ssm.*`, `attention` the layers with KV heads,
/// MoE where a layer has a router (softmax top-k, not renormalised), no positional encoding.
pub(crate) fn configure_gguf(
    meta: &GgufMeta,
    config: &mut ModelConfig,
    attention: Vec<bool>,
) -> Result<()> {
    let file = meta.file;
    if meta.usize("ssm.conv_kernel")? < 2 {
        return Err(meta.err("ssm.conv_kernel", "must be at least 2"));
    }
    config.mamba = Some(MambaConfig {
        inner: meta.usize("ssm.inner_size")?,
        state: meta.usize("ssm.state_size")?,
        conv_kernel: meta.usize("ssm.conv_kernel")?,
        dt_rank: meta.usize("ssm.time_step_rank")?,
        conv_bias: file.has_tensor("blk.0.ssm_conv1d.bias"),
        bias: file.has_tensor("blk.0.ssm_in.bias"),
        layers: attention.iter().map(|a| !a).collect(),
    });
    if let Some(moe) = config.moe.as_mut() {
        moe.normalize = false;
        moe.naming = ExpertNaming::Jamba;
        moe.sparse_layers = (0..config.num_hidden_layers)
            .map(|i| file.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect();
    }
    config.no_rope = true;
    Ok(())
}

enum Mixer {
    Attention(Box<Attention>),
    Mamba(Box<MambaMixer>),
}

struct Layer {
    input_norm: Tensor,
    mixer: Mixer,
    ff_norm: Tensor,
    ffn: Ffn,
}

/// The Jamba language model.
pub struct JambaLm {
    config: ModelConfig,
    state: usize,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: QLinear,
    /// Unused by the (position-free) attention; it bounds the context.
    rope: RotaryEmbedding,
    device: Device,
    dtype: DType,
}

impl JambaLm {
    /// Loads `model.*` and `lm_head` for `max_context` positions.
    pub fn load(config: ModelConfig, w: &Weights, max_context: usize) -> Result<Self> {
        let Some(mamba) = config.mamba.clone() else {
            return Err(ModelError::config(
                w.path(),
                "jamba without its Mamba fields",
            ));
        };
        let (c, h, eps) = (&config, config.hidden_size, config.rms_norm_eps as f32);
        let layers = (0..c.num_hidden_layers)
            .map(|i| -> Result<Layer> {
                let p = format!("model.layers.{i}");
                let mixer = match mamba.layers[i] {
                    true => {
                        let m = MambaMixer::load(&mamba, w, &format!("{p}.mamba"), h, eps)?;
                        Mixer::Mamba(Box::new(m))
                    }
                    false => {
                        let a = <Attention as SelfAttention>::load(c, w, i)?;
                        Mixer::Attention(Box::new(a))
                    }
                };
                let ffn = match &c.moe {
                    Some(moe) if moe.sparse_layers[i] => {
                        Ffn::Moe(Box::new(MoeBlock::load(c, w, i, moe)?))
                    }
                    _ => Ffn::Dense(GatedMlp::load(c, w, &format!("{p}.feed_forward"))?),
                };
                Ok(Layer {
                    input_norm: w.tensor(&format!("{p}.input_layernorm.weight"), &[h])?,
                    mixer,
                    ff_norm: w.tensor(&format!("{p}.pre_ff_layernorm.weight"), &[h])?,
                    ffn,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = w.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let rope = crate::layers::rope_table(c, w, (c.head_dim, c.head_dim), max_context)?;
        Ok(Self {
            lm_head: crate::layers::lm_head(c, w, &embed)?,
            norm: w.tensor("model.final_layernorm.weight", &[h])?,
            state: mamba.state_len(),
            embed,
            layers,
            rope,
            device: w.device().clone(),
            dtype: w.dtype(),
            config,
        })
    }

    fn hidden(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        check_batch(batch, self.rope.max_positions())?;
        let ids = Tensor::new(stacked_ids(batch), &self.device)?.unsqueeze(0)?;
        let x = self.embed.forward(&ids, self.dtype)?;
        let (layers, limits) = (self.layers.len(), moe_limits(batch));
        run_layers(
            batch,
            x,
            layers,
            |i| i,
            |i, x, s| self.layer(i, x, s, &limits),
        )
    }

    /// Layer `i` over `x`, the stacked rows of `segments`, each routed to at most `limits[row]`
    /// experts (when given).
    fn layer(
        &self,
        i: usize,
        x: &Tensor,
        segments: &mut [Segment],
        limits: &[usize],
    ) -> Result<Tensor> {
        let (l, eps) = (&self.layers[i], self.config.rms_norm_eps as f32);
        let n = rms_norm(x, &l.input_norm, eps)?;
        let mixed = match &l.mixer {
            Mixer::Attention(a) => a.forward(&n, &self.rope, segments)?,
            Mixer::Mamba(m) => m.forward(&n, segments)?,
        };
        let x = (x + mixed)?;
        let y = l.ffn.forward(&rms_norm(&x, &l.ff_norm, eps)?, limits)?;
        Ok((x + y)?)
    }
}

impl CausalLm for JambaLm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        (self.layers.iter())
            .map(|l| match l.mixer {
                Mixer::Attention(_) => LayerKind::Full,
                Mixer::Mamba(_) => LayerKind::Recurrent { state: self.state },
            })
            .collect()
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(&mut [BatchSeq::last(tokens, cache)])?;
        crate::layers::output_logits(&x, want, &self.norm, eps, &self.lm_head)
    }

    fn forward_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(batch)?;
        batch_logits(&x, batch, &self.norm, eps, &self.lm_head)
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let layers = self.layers.iter().map(|l| {
            let mixer = match &l.mixer {
                Mixer::Attention(a) => a.weight_bytes(),
                Mixer::Mamba(m) => m.weight_bytes(),
            };
            mixer + l.ffn.weight_bytes()
        });
        crate::layers::decoder_weight_bytes(
            &self.config,
            self.dtype,
            2,
            layers.sum(),
            &self.embed,
            &self.lm_head,
        )
    }
}
