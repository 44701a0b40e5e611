//! Falcon-H1 (`falcon_h1`): every layer runs a Mamba 2 mixer and attention side by side on the
//! same normed input and adds both to the residual, then a gated MLP; µP multipliers scale
//! the pieces.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/falcon_h1/modeling_falcon_h1.py>
//!
//! `x += mixer(n · ssm_in) · ssm_out + attn(n · attention_in) · attention_out` with
//! `n = rms_norm(x)`; the mixer's `in_proj` parts are scaled by `ssm_multipliers` and it
//! normalises before its gate; keys are scaled by `key_multiplier` (folded into the attention
//! scale: RoPE and the dot product are linear in the key); the MLP is
//! `down(up(x) · silu(gate(x) · m₀)) · m₁`; embeddings and logits have their own multipliers.
//! Each layer's cache is a KV cache beside the mixer's state
//! ([`LayerKind::FullAndRecurrent`]).

use peregrine_tensor::ops::{rms_norm, silu_mul};
use peregrine_tensor::{DType, Device, Embedding, QLinear, RotaryEmbedding, Tensor};

use crate::config::Fields;
use crate::layers::attention::Attention;
use crate::layers::batch::{BatchSeq, Segment, batch_logits, check_batch, run_layers, stacked_ids};
use crate::layers::decoder::SelfAttention;
use crate::layers::ssm::{Mamba2Mixer, SsmConfig};
use crate::weights::gguf_config::GgufMeta;
use crate::weights::{Source, Weights};
use crate::{CausalLm, LayerKind, Logits, ModelConfig, ModelError, Result, SequenceCache};

/// Falcon-H1's multipliers (µP), each 1 when the config omits it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FalconMultipliers {
    embedding: f64,
    lm_head: f64,
    attention_in: f64,
    attention_out: f64,
    ssm_in: f64,
    ssm_out: f64,
    mlp_gate: f64,
    mlp_down: f64,
}

/// Reads the `mamba_*` fields and the multipliers.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    if let Some(act) = fields.opt_str("hidden_act")?.filter(|a| *a != "silu") {
        return Err(fields.err(format!("falcon_h1 with `hidden_act` `{act}`: only `silu`")));
    }
    let h = config.hidden_size;
    let expand = fields.opt_usize("mamba_expand")?.unwrap_or(2);
    let inner = fields.opt_usize("mamba_d_ssm")?.unwrap_or(expand * h);
    let heads = fields.opt_usize("mamba_n_heads")?.unwrap_or(128);
    let head_dim = match fields.opt_usize("mamba_d_head")? {
        Some(d) => d,
        None => inner / heads.max(1),
    };
    let list = |key: &str, n: usize| -> Result<Vec<f64>> {
        match fields.f64_list(key)? {
            v if v.is_empty() => Ok(vec![1.0; n]),
            v if v.len() == n => Ok(v),
            v => Err(fields.err(format!("`{key}` has {} entries, not {n}", v.len()))),
        }
    };
    let ssm_parts = list("ssm_multipliers", 5)?;
    let ssm = SsmConfig {
        heads,
        head_dim,
        state_size: fields.opt_usize("mamba_d_state")?.unwrap_or(256),
        groups: fields.opt_usize("mamba_n_groups")?.unwrap_or(1),
        conv_kernel: fields.opt_usize("mamba_d_conv")?.unwrap_or(4),
        bias: fields.opt_bool("mamba_proj_bias")?.unwrap_or(false),
        out_bias: fields.opt_bool("projectors_bias")?.unwrap_or(false),
        conv_bias: fields.opt_bool("mamba_conv_bias")?.unwrap_or(true),
        gated_norm: fields.opt_bool("mamba_rms_norm")?.unwrap_or(false),
        norm_before_gate: fields.opt_bool("mamba_norm_before_gate")?.unwrap_or(true),
        multipliers: std::array::from_fn(|i| ssm_parts[i] as f32),
    };
    if ssm.inner() != inner
        || ssm.groups == 0
        || !heads.is_multiple_of(ssm.groups)
        || ssm.conv_kernel < 2
    {
        return Err(fields.err(format!(
            "`mamba_n_heads` {heads} × `mamba_d_head` {head_dim} must equal the mixer width \
             {inner}, `mamba_n_groups` {} divide the heads and `mamba_d_conv` be at least 2",
            ssm.groups
        )));
    }
    if fields.opt_bool("mlp_bias")?.unwrap_or(false) {
        return Err(fields.err("falcon_h1 with `mlp_bias: true` is not supported yet".into()));
    }
    // Keys times `key_multiplier` scale every score by it: fold it into the scale.
    let key = fields.opt_f64("key_multiplier")?.unwrap_or(1.0);
    config.query_pre_attn_scalar = Some(config.head_dim as f64 / (key * key));
    let one = |k: &str| -> Result<f64> { Ok(fields.opt_f64(k)?.unwrap_or(1.0)) };
    let mlp = list("mlp_multipliers", 2)?;
    config.falcon = Some(FalconMultipliers {
        embedding: one("embedding_multiplier")?,
        lm_head: one("lm_head_multiplier")?,
        attention_in: one("attention_in_multiplier")?,
        attention_out: one("attention_out_multiplier")?,
        ssm_in: one("ssm_in_multiplier")?,
        ssm_out: one("ssm_out_multiplier")?,
        mlp_gate: mlp[0],
        mlp_down: mlp[1],
    });
    config.ssm = Some(ssm);
    Ok(())
}

impl FalconMultipliers {
    /// Every multiplier already folded into the weights, the logits scaled by `lm_head`.
    fn folded(lm_head: f64) -> Self {
        Self {
            embedding: 1.0,
            lm_head,
            attention_in: 1.0,
            attention_out: 1.0,
            ssm_in: 1.0,
            ssm_out: 1.0,
            mlp_gate: 1.0,
            mlp_down: 1.0,
        }
    }
}

/// A `falcon-h1` GGUF file: llama.cpp's converter folds every multiplier into the weights, so
/// they are all 1 here; the mixer's sizes are Mamba 2's `ssm.*`.
pub(crate) fn configure_gguf(meta: &GgufMeta, config: &mut ModelConfig) -> Result<()> {
    super::mamba2::configure_gguf(meta, config)?;
    config.falcon = Some(FalconMultipliers::folded(1.0));
    Ok(())
}

/// mlx-lm's conversion folds the multipliers into the weights too (its folders are told by the
/// conv stored as `[C, K, 1]`), and its model applies none of them, so they become 1 here:
/// what such a folder computes is mlx-lm's model. That folding is not transformers' (it scales
/// q and k by `attention_in_multiplier` but not v, and drops `key_multiplier`), so the keys'
/// scale goes too. Tied logits keep `lm_head_multiplier / embedding_multiplier`, as mlx-lm
/// applies it to the folded embedding.
pub fn adjust_for_mlx_lm(config: &mut ModelConfig, w: &Weights) -> Result<()> {
    let conv = "model.layers.0.mamba.conv1d.weight";
    let (Some(ssm), Some(m)) = (config.ssm.as_mut(), config.falcon) else {
        return Ok(());
    };
    if matches!(w.source(), Source::Gguf(_))
        || !w.contains(conv)
        || w.dims(conv)?.last() != Some(&1)
    {
        return Ok(());
    }
    let lm_head = match config.tie_word_embeddings {
        true => m.lm_head / m.embedding,
        false => 1.0,
    };
    config.falcon = Some(FalconMultipliers::folded(lm_head));
    ssm.multipliers = [1.0; 5];
    config.query_pre_attn_scalar = None;
    Ok(())
}

struct Layer {
    input_norm: Tensor,
    mixer: Mamba2Mixer,
    attn: Attention,
    ff_norm: Tensor,
    gate: QLinear,
    up: QLinear,
    down: QLinear,
}

/// The Falcon-H1 language model.
pub struct FalconH1Lm {
    config: ModelConfig,
    m: FalconMultipliers,
    state: usize,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: QLinear,
    rope: RotaryEmbedding,
    device: Device,
    dtype: DType,
}

impl FalconH1Lm {
    /// Loads `model.*` and `lm_head`; RoPE tables cover `max_context` positions.
    pub fn load(config: ModelConfig, w: &Weights, max_context: usize) -> Result<Self> {
        let (Some(ssm), Some(m)) = (config.ssm, config.falcon) else {
            let why = "falcon_h1 without its mixer fields";
            return Err(ModelError::config(w.path(), why.to_string()));
        };
        let (c, h) = (&config, config.hidden_size);
        let (i_size, eps) = (c.intermediate_size, c.rms_norm_eps as f32);
        let layers = (0..c.num_hidden_layers)
            .map(|i| -> Result<Layer> {
                let p = format!("model.layers.{i}");
                let f = format!("{p}.feed_forward");
                Ok(Layer {
                    input_norm: w.tensor(&format!("{p}.input_layernorm.weight"), &[h])?,
                    mixer: Mamba2Mixer::load(ssm, w, &format!("{p}.mamba"), h, eps)?,
                    attn: <Attention as SelfAttention>::load(c, w, i)?,
                    ff_norm: w.tensor(&format!("{p}.pre_ff_layernorm.weight"), &[h])?,
                    gate: w.linear(&format!("{f}.gate_proj"), i_size, h, false)?,
                    up: w.linear(&format!("{f}.up_proj"), i_size, h, false)?,
                    down: w.linear(&format!("{f}.down_proj"), h, i_size, false)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = w.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let rope = crate::layers::rope_table(c, w, (c.head_dim, c.rotary_dim()), max_context)?;
        Ok(Self {
            lm_head: crate::layers::lm_head(c, w, &embed)?,
            norm: w.tensor("model.final_layernorm.weight", &[h])?,
            state: ssm.state_len(),
            m,
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
        let x = (self.embed.forward(&ids, self.dtype)? * self.m.embedding)?;
        let layers = self.layers.len();
        run_layers(batch, x, layers, |i| i, |i, x, s| self.layer(i, x, s))
    }

    fn layer(&self, i: usize, x: &Tensor, segments: &mut [Segment]) -> Result<Tensor> {
        let (l, m, eps) = (&self.layers[i], &self.m, self.config.rms_norm_eps as f32);
        let n = rms_norm(x, &l.input_norm, eps)?;
        let mixed = (l.mixer.forward(&(&n * m.ssm_in)?, segments)? * m.ssm_out)?;
        let attended = l
            .attn
            .forward(&(&n * m.attention_in)?, &self.rope, segments)?;
        let x = ((x + mixed)? + (attended * m.attention_out)?)?;
        let f = rms_norm(&x, &l.ff_norm, eps)?;
        let gate = (l.gate.forward(&f)? * m.mlp_gate)?;
        let y = l.down.forward(&silu_mul(&gate, &l.up.forward(&f)?)?)?;
        Ok((x + (y * m.mlp_down)?)?)
    }
}

impl CausalLm for FalconH1Lm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        let kind = LayerKind::FullAndRecurrent { state: self.state };
        vec![kind; self.layers.len()]
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(&mut [BatchSeq::last(tokens, cache)])?;
        let logits = crate::layers::output_logits(&x, want, &self.norm, eps, &self.lm_head)?;
        Ok((logits * self.m.lm_head)?)
    }

    fn forward_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(batch)?;
        let logits = batch_logits(&x, batch, &self.norm, eps, &self.lm_head)?;
        Ok((logits * self.m.lm_head)?)
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let layers = self.layers.iter().map(|l| {
            l.mixer.weight_bytes()
                + l.attn.weight_bytes()
                + [&l.gate, &l.up, &l.down]
                    .iter()
                    .map(|q| q.weight_bytes())
                    .sum::<usize>()
        });
        let norms =
            (2 * self.layers.len() + 1) * self.config.hidden_size * self.dtype.size_in_bytes();
        let head = match self.config.tie_word_embeddings {
            true => 0,
            false => self.lm_head.weight_bytes(),
        };
        layers.sum::<usize>() + norms + self.embed.weight_bytes() + head
    }
}
