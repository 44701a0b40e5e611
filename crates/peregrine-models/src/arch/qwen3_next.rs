//! Qwen3-Next and Qwen3.5 (text): hybrids of gated delta-net linear attention and gated full
//! attention, over dense or routed-expert MLPs.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_next/modeling_qwen3_next.py>
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_5/modeling_qwen3_5.py>
//!
//! The llama-family decoder with a per-layer mixer: `layer_types` names each layer
//! `linear_attention` ([`GatedDeltaNet`], a recurrent state) or `full_attention` (Qwen3's
//! q/k-normed attention whose `q_proj` also gives an output gate, `o_proj(attn ·
//! sigmoid(gate))`, with partial rotary). Every RMSNorm but the delta-net's is `1 + w`. MoE
//! layers add a shared expert behind a sigmoid gate. Qwen3.5 projects the delta-net's inputs
//! apart (`in_proj_qkv`, `_z`, `_b`, `_a`) where Qwen3-Next groups them per key head.

use peregrine_kv::{LayerCache, LayerKind};
use peregrine_tensor::{DType, Device, RotaryEmbedding, Tensor};

use crate::config::{ExpertNaming, Fields, MoeConfig};
use crate::layers::attention::Attention;
use crate::layers::batch::Segment;
use crate::layers::decoder::SelfAttention;
use crate::layers::delta_net::{DeltaNetConfig, GatedDeltaNet};
use crate::layers::step::StepBuffers;
use crate::weights::Weights;
use crate::weights::gguf_config::GgufMeta;
use crate::{ModelConfig, Result};

/// Qwen3-Next: Qwen3's attention flags, gated, `1 + w` norms, the delta-net layers, and
/// (with `num_experts`) routed experts plus a gated shared expert (Qwen3.5's router always
/// renormalises its top k, Qwen3-Next's by default).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    super::qwen3::configure(fields, config)?;
    config.norm_weight_offset = 1.0;
    config.attn_output_gate = true;
    config.delta_net = Some(DeltaNetConfig::from_hf(fields, config.num_hidden_layers)?);
    config.mtp_layers = fields.opt_usize("mtp_num_hidden_layers")?.unwrap_or(0);
    if fields.opt_usize("num_experts")?.unwrap_or(0) > 0 {
        let mut moe = MoeConfig::from_hf(fields, config, ExpertNaming::Qwen, true)?;
        moe.shared_intermediate_size = fields.opt_usize("shared_expert_intermediate_size")?;
        moe.shared_gated = true;
        config.moe = Some(moe);
    }
    Ok(())
}

/// A `qwen3next`, `qwen35` or `qwen35moe` GGUF file's delta-net sizes and layer pattern
/// (llama.cpp's converter writes `ssm.*` and `attention.recurrent_layers`; its norms already
/// hold `1 + w`, its `ssm_a` already `-exp(A_log)`, Qwen3-Next's `in_proj_qkvz` is split into
/// `[q; k; v]` and `z`, and Qwen3.5's value heads are in `tiled` order).
pub(crate) fn configure_gguf(meta: &GgufMeta, config: &mut ModelConfig, tiled: bool) -> Result<()> {
    let layers = config.num_hidden_layers;
    let recurrent = match meta.opt_bools("attention.recurrent_layers")? {
        // The converter counts MTP layers too; they come last.
        Some(r) if r.len() >= layers => r.into_iter().take(layers).collect(),
        Some(r) => {
            let what = format!("has {} entries for {layers} layers", r.len());
            return Err(meta.err("attention.recurrent_layers", &what));
        }
        None => {
            let every = meta
                .opt_usize("full_attention_interval")?
                .unwrap_or(4)
                .max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    let (k_heads, v_heads) = (
        meta.usize("ssm.group_count")?,
        meta.usize("ssm.time_step_rank")?,
    );
    let k_dim = meta.usize("ssm.state_size")?;
    let inner = meta.usize("ssm.inner_size")?;
    if k_heads == 0
        || v_heads == 0
        || !v_heads.is_multiple_of(k_heads)
        || !inner.is_multiple_of(v_heads)
    {
        return Err(meta.err(
            "ssm.group_count",
            "must divide ssm.time_step_rank, which divides ssm.inner_size",
        ));
    }
    let delta_net = DeltaNetConfig {
        k_heads,
        v_heads,
        k_dim,
        v_dim: inner / v_heads,
        conv_kernel: meta.usize("ssm.conv_kernel")?,
        layers: recurrent,
        tiled,
    };
    delta_net
        .check()
        .map_err(|e| meta.err("ssm.inner_size", &format!("gives a delta-net where {e}")))?;
    config.delta_net = Some(delta_net);
    config.attn_output_gate = true;
    // Layer 0, where the shared reader looks for them, is a delta-net layer.
    config.qk_norm = true;
    if let Some(moe) = config.moe.as_mut() {
        moe.shared_intermediate_size = meta.opt_usize("expert_shared_feed_forward_length")?;
        moe.shared_gated = moe.shared_intermediate_size.is_some();
    }
    Ok(())
}

/// mlx-lm's Qwen3-Next and Qwen3.5 conversions store the decoder's norms as `1 + w` already (and
/// the conv as `[C, K, 1]`, which [`GatedDeltaNet`] reads as it is): then no offset is added.
pub fn adjust_for_mlx_lm(config: &mut ModelConfig, w: &Weights) -> Result<()> {
    let Some(layer) = (config.delta_net.as_ref()).and_then(|d| d.layers.iter().position(|&l| l))
    else {
        return Ok(());
    };
    let conv = format!("model.layers.{layer}.linear_attn.conv1d.weight");
    if w.contains(&conv) && w.dims(&conv)?.last() == Some(&1) {
        config.norm_weight_offset = 0.0;
    }
    Ok(())
}

/// A hybrid layer's token mixer.
pub enum HybridMixer {
    /// Gated full attention over a KV cache.
    Attention(Attention),
    /// Gated delta-net linear attention over a recurrent state.
    Linear(GatedDeltaNet),
}

fn is_linear(c: &ModelConfig, layer: usize) -> bool {
    c.delta_net.as_ref().is_some_and(|d| d.layers[layer])
}

impl SelfAttention for HybridMixer {
    /// `model.layers.{layer}.linear_attn` or `.self_attn`, as `layer_types` says.
    fn load(c: &ModelConfig, w: &Weights, layer: usize) -> Result<Self> {
        match is_linear(c, layer) {
            true => Ok(Self::Linear(GatedDeltaNet::load(
                c,
                w,
                &format!("model.layers.{layer}.linear_attn"),
            )?)),
            false => Ok(Self::Attention(<Attention as SelfAttention>::load(
                c, w, layer,
            )?)),
        }
    }

    fn cache_kind(c: &ModelConfig, layer: usize) -> LayerKind {
        match &c.delta_net {
            Some(d) if d.layers[layer] => LayerKind::Recurrent {
                state: d.state_len(),
            },
            _ => LayerKind::Full,
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        segments: &mut [Segment],
    ) -> Result<Tensor> {
        match self {
            Self::Attention(a) => a.forward(x, rope, segments),
            Self::Linear(l) => l.forward(x, segments),
        }
    }

    /// One token through the mixer's `forward` on a one-row tensor (the rest of the layer,
    /// norms and MoE, runs the allocation-free step around it).
    fn step(
        &self,
        b: &mut StepBuffers,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        pos: usize,
    ) -> Result<()> {
        let x = Tensor::from_slice(&b.normed, (1, 1, b.normed.len()), &Device::Cpu)?;
        let mut segment = [Segment::causal(cache, pos, 1)];
        let y = self.forward(&x, rope, &mut segment)?;
        let y = y.flatten_all()?.to_dtype(DType::F32)?;
        b.out.copy_from_slice(&y.to_vec1::<f32>()?);
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Self::Attention(a) => a.weight_bytes(),
            Self::Linear(l) => l.weight_bytes(),
        }
    }
}
