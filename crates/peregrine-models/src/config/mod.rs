//! The one configuration type every architecture is built from, read from HF `config.json`
//! (both legacy `rope_theta`/`rope_scaling` and transformers-5 `rope_parameters`) or from GGUF
//! metadata (see `weights::gguf`).

use std::path::Path;

use peregrine_tensor::{RopeScaling, RopeStyle};
#[cfg(test)]
use serde_json::{Map, Value};

use crate::{ModelError, Result};

mod fields;
mod rope;

pub use fields::{Fields, read_json_object};
pub use rope::{longrope_attention_factor, rope_scaling_from, yarn_get_mscale};
use rope::{mrope_sections, rope_from_hf};

/// Hyper-parameters of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// HF `model_type` (`llama`, `mistral`, `qwen2`, `qwen3`, ...).
    pub model_type: String,
    /// Vocabulary size (rows of the embedding table).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Fraction of each head that RoPE rotates (the first `rotary_dim()` dimensions; Phi-3.5 /
    /// Phi-4-mini's `partial_rotary_factor`); the rest pass through.
    pub partial_rotary_factor: f64,
    /// Which dimensions RoPE rotates together (depends on how the weights were converted).
    pub rope_style: RopeStyle,
    /// Qwen2-VL's M-RoPE: the rotated pairs that turn by an image token's time, height and
    /// width positions (text tokens turn as plain RoPE).
    pub mrope_sections: Option<[usize; 3]>,
    /// Whether the M-RoPE sections take turns pair by pair (Qwen3-VL's `mrope_interleaved`).
    pub mrope_interleaved: bool,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// The output projection reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// Sliding-window width for every layer, when the model uses one.
    pub sliding_window: Option<usize>,
    /// q/k/v projections carry biases.
    pub attention_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Added to every RMSNorm weight at load: Gemma's HF checkpoints store `w - 1` and scale by
    /// `1 + w`; llama.cpp's converter already adds the 1, so GGUF files use 0.
    pub norm_weight_offset: f64,
    /// The gated MLP's activation.
    pub activation: Activation,
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5` (Gemma); `None`: `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Which layers use `sliding_window` (Gemma 3 interleaves local and global layers);
    /// `None`: every layer does when `sliding_window` is set.
    pub sliding_layers: Option<Vec<bool>>,
    /// RoPE base of the sliding-window layers, without scaling (Gemma 3's
    /// `rope_local_base_freq`); `None`: the same RoPE as every other layer.
    pub rope_local_theta: Option<f64>,
    /// Attention scores soft-capped at this value, `cap · tanh(s / cap)` before the mask
    /// (Gemma 2's `attn_logit_softcapping`).
    pub attn_logit_softcapping: Option<f64>,
    /// Output logits soft-capped at this value (Gemma 2's `final_logit_softcapping`).
    pub final_logit_softcapping: Option<f64>,
    /// Beginning-of-sequence token, when the config names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens named by the config.
    pub eos_token_ids: Vec<u32>,
    /// Mixture-of-experts feed-forward layers, when the model has them.
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention (DeepSeek-V3) in place of q/k/v projections.
    pub mla: Option<MlaConfig>,
    /// Values RMS-normed per head without a weight (Gemma 4's `v_norm`).
    pub v_norm: bool,
    /// Per-layer input embeddings (Gemma 4's `hidden_size_per_layer_input`), when the model
    /// has them.
    pub per_layer_input: Option<PerLayerInput>,
    /// How each layer departs from the fields above (Gemma 4: wider global heads, KV shared
    /// with an earlier layer, wider MLPs); empty: every layer is as the fields say.
    pub layer_specs: Vec<LayerSpec>,
    /// The state-space mixer's sizes (Mamba 2; Falcon-H1's, beside its attention).
    pub ssm: Option<crate::layers::ssm::SsmConfig>,
    /// The Mamba (v1) mixer's sizes (Jamba).
    pub mamba: Option<crate::layers::mamba::MambaConfig>,
    /// The gated delta-net layers' sizes and which layers they are (Qwen3-Next, Qwen3.5).
    pub delta_net: Option<crate::layers::delta_net::DeltaNetConfig>,
    /// Falcon-H1's µP multipliers.
    pub falcon: Option<crate::arch::falcon_h1::FalconMultipliers>,
    /// Attention without positional encoding (Jamba: its Mamba layers carry the order).
    pub no_rope: bool,
    /// `q_proj` also gives a per-head output gate, `o_proj(attn · sigmoid(gate))` (Qwen3-Next).
    pub attn_output_gate: bool,
    /// Multi-token-prediction layers the checkpoint carries after the last decoder layer
    /// (DeepSeek-V3's `num_nextn_predict_layers`, Qwen3-Next's and Qwen3.5's
    /// `mtp_num_hidden_layers`); read only when [`LoadOptions::mtp`](crate::LoadOptions) asks.
    pub mtp_layers: usize,
}

/// Gemma 4's per-layer input embeddings: a second embedding table of `vocab` rows holding
/// `hidden` values for every layer, plus a projection of the main embedding, fed to each layer
/// through a small gated block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerLayerInput {
    /// Width of one layer's input (`hidden_size_per_layer_input`).
    pub hidden: usize,
    /// Rows of the per-layer table (`vocab_size_per_layer_input`).
    pub vocab: usize,
    /// The token whose row image and audio positions read (`pad_token_id`), as transformers
    /// gives multimodal tokens the padding token's per-layer input.
    pub pad: u32,
}

/// One layer's shape where it differs from the model-wide fields (transformers'
/// `per_layer_config` and KV sharing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Width of this layer's heads.
    pub head_dim: usize,
    /// This layer's key/value heads.
    pub num_key_value_heads: usize,
    /// Width of this layer's MLP.
    pub intermediate_size: usize,
    /// The earlier layer whose keys and values this one attends to instead of projecting its
    /// own (`num_kv_shared_layers`); `None`: its own.
    pub kv_source: Option<usize>,
    /// Values are the keys' projection before the key norm and RoPE (`attention_k_eq_v`).
    pub values_from_keys: bool,
}

/// DeepSeek-V2/V3's multi-head latent attention: queries through an optional low-rank
/// bottleneck, keys and values decompressed from one shared latent, a RoPE part shared by
/// every head.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// Rank of the query bottleneck (`q_a_proj` → `q_a_layernorm` → `q_b_proj`); `None`: a
    /// plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed key/value latent.
    pub kv_lora_rank: usize,
    /// Per-head query/key dimensions without RoPE.
    pub qk_nope_head_dim: usize,
    /// Query/key dimensions with RoPE (the key's are shared by all heads).
    pub qk_rope_head_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// Attention scores' scale: `(nope + rope)^-0.5`, times YaRN's `mscale²` when
    /// `mscale_all_dim` is set (transformers' `yarn_apply_mscale`).
    pub softmax_scale: f64,
}

/// A mixture-of-experts feed-forward block: a router picks `top_k` of `num_experts` gated MLPs
/// per token.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Hidden width of one expert's MLP.
    pub intermediate_size: usize,
    /// Renormalise the chosen experts' weights to sum to one.
    pub normalize: bool,
    /// Which layers are MoE (the others keep the dense MLP of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// Where the checkpoint keeps the block's tensors.
    pub naming: ExpertNaming,
    /// Sigmoid scores with a `gate.e_score_correction_bias` (DeepSeek-V3); `None`: softmax.
    pub sigmoid: Option<SigmoidRouting>,
    /// Width of the always-on shared experts' MLP (`mlp.shared_experts`), when there are any.
    pub shared_intermediate_size: Option<usize>,
    /// The shared expert is `mlp.shared_expert` behind a sigmoid `mlp.shared_expert_gate`
    /// (Qwen3-Next), not DeepSeek's ungated `mlp.shared_experts`.
    pub shared_gated: bool,
}

/// DeepSeek-V3's router beyond its sigmoid scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SigmoidRouting {
    /// Group-limited choice: (`n_group`, `topk_group`).
    pub groups: Option<(usize, usize)>,
    /// `routed_scaling_factor`.
    pub scale: f32,
}

/// How a family names its MoE block's tensors (HF names; GGUF and MLX map onto them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNaming {
    /// `mlp.gate` (router) and `mlp.experts.N.{gate,up,down}_proj` (Qwen-MoE).
    Qwen,
    /// `router.{proj,scale,per_expert_scale}` and stacked `experts.{gate_up_proj,down_proj}`
    /// (MLX: `experts.switch_glu.*`), beside the layer's dense MLP (Gemma 4).
    Gemma4,
    /// `block_sparse_moe.gate` and `block_sparse_moe.experts.N.{w1,w3,w2}` (Mixtral).
    Mixtral,
    /// `feed_forward.router` and `feed_forward.experts.N.{gate,up,down}_proj` (Jamba).
    Jamba,
}

impl MoeConfig {
    /// Reads the fields Qwen2/3-MoE and Mixtral share: `num_experts` (or Mixtral's
    /// `num_local_experts`), `num_experts_per_tok`, `moe_intermediate_size` (else
    /// `intermediate_size`), `norm_topk_prob` (`normalize_default` when absent),
    /// `decoder_sparse_step` and `mlp_only_layers`.
    pub fn from_hf(
        fields: &Fields,
        config: &ModelConfig,
        naming: ExpertNaming,
        normalize_default: bool,
    ) -> Result<Self> {
        let num_experts = match fields.opt_usize("num_experts")? {
            Some(n) => n,
            None => fields.usize("num_local_experts")?,
        };
        let top_k = fields.usize("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(fields.err(format!(
                "`num_experts_per_tok` {top_k} exceeds the {num_experts} experts"
            )));
        }
        let step = fields.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        let dense = fields.usize_list("mlp_only_layers")?;
        let layers = config.num_hidden_layers;
        let sparse_layers = (0..layers)
            .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
            .collect();
        Ok(Self {
            num_experts,
            top_k,
            intermediate_size: fields
                .opt_usize("moe_intermediate_size")?
                .unwrap_or(config.intermediate_size),
            normalize: fields
                .opt_bool("norm_topk_prob")?
                .unwrap_or(normalize_default),
            sparse_layers,
            naming,
            sigmoid: None,
            shared_intermediate_size: None,
            shared_gated: false,
        })
    }
}

/// The gated MLP's activation: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// SiLU (llama, Qwen, Mistral).
    #[default]
    Silu,
    /// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

impl ModelConfig {
    /// Parses the fields shared by llama-family configs; architecture files adjust the rest.
    pub fn from_hf(fields: &Fields) -> Result<Self> {
        let model_type = fields
            .opt_str("model_type")?
            .unwrap_or_default()
            .to_string();
        let hidden_size = fields.usize("hidden_size")?;
        let num_attention_heads = fields.usize("num_attention_heads")?;
        let head_dim = match fields.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(fields.err(format!(
                    "`hidden_size` {hidden_size} is not a multiple of `num_attention_heads` {num_attention_heads}"
                )));
            }
        };
        let (rope_theta, rope_scaling, partial_rotary_factor) = rope_from_hf(fields)?;
        let mrope = mrope_sections(fields)?;
        let config = Self {
            model_type,
            vocab_size: fields.usize("vocab_size")?,
            hidden_size,
            intermediate_size: fields.usize("intermediate_size")?,
            num_hidden_layers: fields.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: fields
                .opt_usize("num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: fields.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            partial_rotary_factor,
            rope_style: RopeStyle::Half,
            mrope_sections: mrope.map(|(sections, _)| sections),
            mrope_interleaved: mrope.is_some_and(|(_, interleaved)| interleaved),
            max_position_embeddings: fields.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: fields.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            sliding_window: None,
            attention_bias: fields.opt_bool("attention_bias")?.unwrap_or(false),
            qk_norm: false,
            norm_weight_offset: 0.0,
            activation: Activation::Silu,
            query_pre_attn_scalar: None,
            sliding_layers: None,
            rope_local_theta: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            bos_token_id: fields.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: fields.token_ids("eos_token_id")?,
            moe: None,
            mla: None,
            v_norm: false,
            per_layer_input: None,
            layer_specs: vec![],
            ssm: None,
            delta_net: None,
            mamba: None,
            falcon: None,
            no_rope: false,
            attn_output_gate: false,
            mtp_layers: 0,
        };
        config.validate(&fields.file)?;
        Ok(config)
    }

    /// Layer `i`'s own config: the model-wide one with the layer's head width, KV heads and
    /// MLP width from [`layer_specs`](Self::layer_specs), so that the shared layers load it
    /// unchanged.
    pub fn for_layer(&self, i: usize) -> ModelConfig {
        let mut c = self.clone();
        if let Some(spec) = self.layer_specs.get(i) {
            c.head_dim = spec.head_dim;
            c.num_key_value_heads = spec.num_key_value_heads;
            c.intermediate_size = spec.intermediate_size;
        }
        c
    }

    /// The dimensions of each head that RoPE rotates: `int(head_dim · partial_rotary_factor)`,
    /// as transformers computes it.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Checks relations between fields that the forward pass relies on.
    pub fn validate(&self, file: &Path) -> Result<()> {
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::config(
                file,
                format!(
                    "`num_attention_heads` {} is not a multiple of `num_key_value_heads` {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::config(
                file,
                format!("`head_dim` {} must be even for RoPE", self.head_dim),
            ));
        }
        let rotary = self.rotary_dim();
        if !(rotary > 0 && rotary <= self.head_dim && rotary.is_multiple_of(2)) {
            return Err(ModelError::config(
                file,
                format!(
                    "`partial_rotary_factor` {} gives {rotary} rotary dimensions of {}: they \
                     must be even, positive and at most `head_dim`",
                    self.partial_rotary_factor, self.head_dim
                ),
            ));
        }
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        } = &self.rope_scaling
        {
            for (name, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if f.len() != rotary / 2 {
                    return Err(ModelError::config(
                        file,
                        format!(
                            "longrope `{name}` has {} entries; {rotary} rotary dimensions need {}",
                            f.len(),
                            rotary / 2
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// An HF config map parsed with an architecture's `configure` (the `arch/` unit tests).
#[cfg(test)]
pub(crate) fn parse_with(
    map: &Map<String, Value>,
    configure: fn(&Fields, &mut ModelConfig) -> Result<()>,
) -> Result<ModelConfig> {
    let fields = Fields::new(Path::new("config.json"), map);
    let mut config = ModelConfig::from_hf(&fields)?;
    configure(&fields, &mut config)?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An HF config from JSON text (also the `rope` tests').
    pub(super) fn parse(json: &str) -> Result<ModelConfig> {
        let map: Map<String, Value> = serde_json::from_str(json).unwrap();
        ModelConfig::from_hf(&Fields::new(Path::new("config.json"), &map))
    }

    pub(super) const BASE: &str = r#""model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2"#;

    #[test]
    fn errors_name_the_field() {
        let err = parse(r#"{"model_type": "llama"}"#).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains("hidden_size"),
            "{err}"
        );
        let err = parse(&format!(r#"{{{BASE}, "num_key_value_heads": "two"}}"#))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("num_key_value_heads") && err.contains("positive integer"),
            "{err}"
        );
        let err = parse(&format!(
            r#"{{{BASE}, "rope_scaling": {{"type": "dynamic-ntk"}}}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("dynamic-ntk"), "{err}");
    }
}
