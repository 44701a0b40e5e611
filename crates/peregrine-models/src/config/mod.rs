//! The one configuration type every architecture is built from, read from HF `config.json`
//! (both legacy `rope_theta`/`rope_scaling` and transformers-5 `rope_parameters`) or from GGUF
//! metadata (see `weights::gguf`).

use std::path::{Path, PathBuf};

use peregrine_tensor::{RopeScaling, RopeStyle};
use serde_json::{Map, Value};

use crate::{ModelError, Result};

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

/// Reads fields from a JSON object, with errors that name the file and the field.
pub struct Fields<'a> {
    file: PathBuf,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// Wraps a parsed JSON object read from `file`.
    pub fn new(file: &Path, map: &'a Map<String, Value>) -> Self {
        Self {
            file: file.to_path_buf(),
            map,
        }
    }

    /// An error naming this file.
    pub fn err(&self, message: String) -> ModelError {
        ModelError::config(&self.file, message)
    }

    /// Whether `key` is present, even as JSON `null` (which can mean "off" where the field's
    /// default is on, as Gemma 2's soft caps).
    pub fn contains(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// The keys present (JSON `null` ones too).
    pub fn keys(&self) -> impl Iterator<Item = &'a String> + use<'a> {
        self.map.keys()
    }

    /// The raw value of `key`, treating JSON `null` as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// A required positive integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("missing required field `{key}`")))
    }

    /// An optional positive integer.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(self.err(format!("field `{key}` must be a positive integer, got {v}"))),
            },
        }
    }

    /// An optional number.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a number, got {v}"))),
        }
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be true or false, got {v}"))),
        }
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a string, got {v}"))),
        }
    }

    /// Token ids given as one integer or a list of integers.
    pub fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = || {
            self.err(format!(
                "field `{key}` must be a token id or a list of token ids"
            ))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|n| n as u32).ok_or_else(bad))
                .collect(),
            Some(v) => Ok(vec![v.as_u64().ok_or_else(bad)? as u32]),
        }
    }

    /// A list of non-negative integers (empty when absent).
    pub fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        let bad = || {
            self.err(format!(
                "field `{key}` must be a list of non-negative integers"
            ))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|n| n as usize).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }

    /// A list of numbers (empty when absent).
    pub fn f64_list(&self, key: &str) -> Result<Vec<f64>> {
        let bad = || self.err(format!("field `{key}` must be a list of numbers"));
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items.iter().map(|v| v.as_f64().ok_or_else(bad)).collect(),
            Some(_) => Err(bad()),
        }
    }

    /// A nested object.
    pub fn object(&self, key: &str) -> Result<Option<Fields<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields {
                file: self.file.clone(),
                map,
            })),
            Some(v) => Err(self.err(format!("field `{key}` must be an object, got {v}"))),
        }
    }
}

/// Reads and parses a JSON object file.
pub fn read_json_object(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ModelError::config(path, "expected a JSON object")),
        Err(e) => Err(ModelError::config(path, format!("invalid JSON: {e}"))),
    }
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

/// RoPE base, scaling and partial rotary factor from either `rope_parameters` (transformers 5)
/// or the legacy keys. A per-layer-type `rope_parameters` (Gemma 3) contributes its
/// `full_attention` entry.
fn rope_from_hf(fields: &Fields) -> Result<(f64, RopeScaling, f64)> {
    let params = fields.object("rope_parameters")?;
    let params = match params {
        Some(p) if p.get("full_attention").is_some() => p.object("full_attention")?,
        other => other,
    };
    let legacy = fields.object("rope_scaling")?;
    let theta = match &params {
        Some(p) => p.opt_f64("rope_theta")?,
        None => None,
    };
    let theta = theta.or(fields.opt_f64("rope_theta")?).unwrap_or(10_000.0);
    // transformers moves a top-level `partial_rotary_factor` into `rope_parameters` unless
    // that already has one.
    let partial = match &params {
        Some(p) => p.opt_f64("partial_rotary_factor")?,
        None => None,
    };
    let partial = partial
        .or(fields.opt_f64("partial_rotary_factor")?)
        .unwrap_or(1.0);
    let Some(scaling) = params.or(legacy) else {
        return Ok((theta, RopeScaling::None, partial));
    };
    let scaling = rope_scaling_in(&scaling, Some(fields))?;
    // Proportional RoPE carries its own rotated fraction over the whole head.
    let partial = match scaling {
        RopeScaling::Proportional { .. } => 1.0,
        _ => partial,
    };
    Ok((theta, scaling, partial))
}

/// The scaling named by a `rope_parameters` / `rope_scaling` object (`rope_type` or `type`).
pub fn rope_scaling_from(scaling: &Fields) -> Result<RopeScaling> {
    rope_scaling_in(scaling, None)
}

/// [`rope_scaling_from`] for the object found in `config` (the top-level fields, which
/// LongRoPE also reads: `original_max_position_embeddings`, `max_position_embeddings`).
fn rope_scaling_in(scaling: &Fields, config: Option<&Fields>) -> Result<RopeScaling> {
    let kind = match scaling.opt_str("rope_type")? {
        Some(kind) => Some(kind),
        None => scaling.opt_str("type")?,
    };
    let factor = || {
        scaling
            .opt_f64("factor")?
            .ok_or_else(|| scaling.err("rope scaling needs `factor`".into()))
    };
    let scaling = match kind.unwrap_or("default") {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: scaling.opt_f64("low_freq_factor")?.unwrap_or(1.0),
            high_freq_factor: scaling.opt_f64("high_freq_factor")?.unwrap_or(4.0),
            original_max_position_embeddings: scaling.usize("original_max_position_embeddings")?,
        },
        // Phi-3's first 128K checkpoints call it `su`.
        "longrope" | "su" => long_rope(scaling, config)?,
        "yarn" => yarn(scaling, config)?,
        "proportional" => RopeScaling::Proportional {
            factor: scaling.opt_f64("factor")?.unwrap_or(1.0),
            partial_rotary_factor: scaling.opt_f64("partial_rotary_factor")?.unwrap_or(1.0),
        },
        other => return Err(scaling.err(format!("unsupported rope scaling type `{other}`"))),
    };
    Ok(scaling)
}

/// LongRoPE's default attention factor for a context `factor` times the `original` one:
/// `sqrt(1 + ln(factor) / ln(original))`, 1 when `factor <= 1` (transformers and llama.cpp's
/// converter alike).
pub fn longrope_attention_factor(factor: f64, original: usize) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    }
}

/// YaRN's `get_mscale`: `0.1 · mscale · ln(factor) + 1` (1 when `factor <= 1`).
pub fn yarn_get_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        return 1.0;
    }
    0.1 * mscale * factor.ln() + 1.0
}

/// YaRN as transformers' `_compute_yarn_parameters` reads it: `factor` (default
/// `max_position_embeddings / original_max_position_embeddings`), `original_max_position_embeddings`
/// (the top level's first, then the scaling object's, then `max_position_embeddings`),
/// `beta_fast` 32, `beta_slow` 1, `truncate` true, and `attention_factor` (default
/// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` when both are set and
/// non-zero, else `get_mscale(factor)`).
fn yarn(scaling: &Fields, config: Option<&Fields>) -> Result<RopeScaling> {
    let top = |key: &str| config.map_or(Ok(None), |c| c.opt_usize(key));
    let original = match top("original_max_position_embeddings")? {
        Some(n) => n,
        None => match scaling.opt_usize("original_max_position_embeddings")? {
            Some(n) => n,
            None => top("max_position_embeddings")?.ok_or_else(|| {
                scaling.err("yarn scaling needs `original_max_position_embeddings`".into())
            })?,
        },
    };
    let factor = match scaling.opt_f64("factor")? {
        Some(f) => f,
        None => match top("max_position_embeddings")? {
            Some(max) => max as f64 / original as f64,
            None => return Err(scaling.err("yarn scaling needs `factor`".into())),
        },
    };
    let nonzero =
        |key: &str| -> Result<Option<f64>> { Ok(scaling.opt_f64(key)?.filter(|v| *v != 0.0)) };
    let attention_factor = match scaling.opt_f64("attention_factor")? {
        Some(a) => a,
        None => match (nonzero("mscale")?, nonzero("mscale_all_dim")?) {
            (Some(m), Some(all)) => yarn_get_mscale(factor, m) / yarn_get_mscale(factor, all),
            _ => yarn_get_mscale(factor, 1.0),
        },
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: nonzero("beta_fast")?.unwrap_or(32.0),
        beta_slow: nonzero("beta_slow")?.unwrap_or(1.0),
        attention_factor,
        truncate: scaling.opt_bool("truncate")?.unwrap_or(true),
    })
}

/// LongRoPE as transformers' `_compute_longrope_parameters` reads it: the factor lists;
/// `original_max_position_embeddings` from the top level of the config when it is there (which
/// transformers prefers), else from the scaling object; `factor` (default
/// `max_position_embeddings / original_max_position_embeddings`) and `attention_factor` (default
/// `sqrt(1 + ln(factor) / ln(original))`, 1 when `factor <= 1`).
fn long_rope(scaling: &Fields, config: Option<&Fields>) -> Result<RopeScaling> {
    let top = |key: &str| config.map_or(Ok(None), |c| c.opt_usize(key));
    let original = match top("original_max_position_embeddings")? {
        Some(n) => n,
        None => scaling.usize("original_max_position_embeddings")?,
    };
    let factor = match scaling.opt_f64("factor")? {
        Some(f) => f,
        None => match top("max_position_embeddings")? {
            Some(max) => max as f64 / original as f64,
            None => return Err(scaling.err("longrope scaling needs `factor`".into())),
        },
    };
    let attention_factor = match scaling.opt_f64("attention_factor")? {
        Some(a) => a,
        None => longrope_attention_factor(factor, original),
    };
    let list = |key: &str| -> Result<Vec<f64>> {
        let v = scaling.f64_list(key)?;
        match v.is_empty() {
            true => Err(scaling.err(format!("longrope scaling needs `{key}`"))),
            false => Ok(v),
        }
    };
    Ok(RopeScaling::LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
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

    fn parse(json: &str) -> Result<ModelConfig> {
        let map: Map<String, Value> = serde_json::from_str(json).unwrap();
        ModelConfig::from_hf(&Fields::new(Path::new("config.json"), &map))
    }

    const BASE: &str = r#""model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2"#;

    #[test]
    fn legacy_and_transformers5_rope_keys_agree() {
        let legacy = parse(&format!(
            r#"{{{BASE}, "rope_theta": 5e5, "rope_scaling": {{"type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        let v5 = parse(&format!(
            r#"{{{BASE}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        assert_eq!(legacy.rope_theta, 5e5);
        assert_eq!(legacy, v5);
        assert!(matches!(
            legacy.rope_scaling,
            RopeScaling::Llama3 { factor: 8.0, .. }
        ));
    }

    /// Phi-3.5-mini's layout (legacy `rope_scaling`, `original_max_position_embeddings` and
    /// `max_position_embeddings` at the top level) and transformers 5's `rope_parameters` read
    /// alike; the attention factor defaults to `sqrt(1 + ln(131072/4096) / ln(4096))`.
    #[test]
    fn longrope_reads_legacy_and_transformers5_keys() {
        let base = r#""model_type": "phi3", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 131072"#;
        let factors =
            r#""short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3.0, 4.0, 5.0]"#;
        let legacy = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 4096, "rope_theta": 1e4,
            "rope_scaling": {{"type": "longrope", {factors}}}}}"#
        ))
        .unwrap();
        let su = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 4096,
            "rope_scaling": {{"type": "su", {factors}}}}}"#
        ))
        .unwrap();
        let v5 = parse(&format!(
            r#"{{{base}, "rope_parameters": {{"rope_type": "longrope", "rope_theta": 1e4,
            "original_max_position_embeddings": 4096, {factors}}}}}"#
        ))
        .unwrap();
        assert_eq!(legacy, v5);
        assert_eq!(legacy, su);
        let RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } = &legacy.rope_scaling
        else {
            panic!("{:?}", legacy.rope_scaling)
        };
        assert_eq!(short_factor, &[1.0, 1.1, 1.2, 1.3]);
        assert_eq!(long_factor, &[2.0, 3.0, 4.0, 5.0]);
        assert_eq!(*original_max_position_embeddings, 4096);
        assert!((attention_factor - 1.190_238_071_423_808_3).abs() < 1e-12);
        // The top level's `original_max_position_embeddings` wins, as in transformers; an
        // explicit `attention_factor` (or `factor`) is used as given.
        let given = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 64,
            "rope_scaling": {{"type": "longrope", "original_max_position_embeddings": 4096,
            "attention_factor": 1.5, {factors}}}}}"#
        ))
        .unwrap();
        assert!(matches!(
            given.rope_scaling,
            RopeScaling::LongRope {
                original_max_position_embeddings: 64,
                attention_factor: 1.5,
                ..
            }
        ));
        let by_factor = parse(&format!(
            r#"{{{base}, "original_max_position_embeddings": 4096,
            "rope_scaling": {{"type": "longrope", "factor": 1.0, {factors}}}}}"#
        ))
        .unwrap();
        assert!(matches!(
            by_factor.rope_scaling,
            RopeScaling::LongRope {
                attention_factor: 1.0,
                ..
            }
        ));
    }

    /// `partial_rotary_factor` from `rope_parameters` or the top level (transformers moves the
    /// top-level one in unless `rope_parameters` has its own); LongRoPE's factor lists must
    /// cover the rotated pairs.
    #[test]
    fn partial_rotary_factor_and_longrope_lengths() {
        let base = r#""model_type": "phi3", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "original_max_position_embeddings": 8"#;
        let top = parse(&format!(r#"{{{base}, "partial_rotary_factor": 0.75}}"#)).unwrap();
        assert_eq!((top.head_dim, top.rotary_dim()), (16, 12));
        let inner = parse(&format!(
            r#"{{{base}, "partial_rotary_factor": 0.75,
            "rope_parameters": {{"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}}}"#
        ))
        .unwrap();
        assert_eq!(inner.rotary_dim(), 8);
        let long = |n: usize| {
            let f = vec!["1.0"; n].join(", ");
            parse(&format!(
                r#"{{{base}, "partial_rotary_factor": 0.5, "rope_scaling": {{"type": "longrope",
                "factor": 2.0, "short_factor": [{f}], "long_factor": [{f}]}}}}"#
            ))
        };
        assert!(long(4).is_ok());
        let err = long(8).unwrap_err().to_string();
        assert!(
            err.contains("short_factor") && err.contains("need 4"),
            "{err}"
        );
        let err = parse(&format!(r#"{{{base}, "partial_rotary_factor": 0.1}}"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("partial_rotary_factor"), "{err}");
    }

    /// YaRN as DeepSeek-V3 writes it (the fixture's values): transformers' inverse frequencies
    /// (`_compute_yarn_parameters`, printed from transformers 5.24) and attention factor.
    #[test]
    fn yarn_parses_and_matches_transformers_frequencies() {
        let c = parse(
            r#"{"model_type": "deepseek_v3", "vocab_size": 10, "hidden_size": 64,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 16,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}}"#,
        )
        .unwrap();
        let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            truncate,
            ..
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(
            (factor, original_max_position_embeddings, truncate),
            (4.0, 64, true)
        );
        assert_eq!(attention_factor, 1.0);
        let want = [
            1.0,
            0.237_170_815,
            0.049_999_997,
            0.007_905_694_7,
            0.002_499_999_9,
            7.905_694_7e-4,
            2.500_000_1e-4,
            7.905_694_7e-5,
        ];
        let got = peregrine_tensor::rope::inv_freqs(16, 1e4, &c.rope_scaling);
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() / w < 1e-6, "{got:?}");
        }
        // Without mscale / mscale_all_dim: attention factor `0.1 ln(factor) + 1`.
        let plain = parse(
            r#"{"model_type": "qwen2", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 256,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}"#,
        )
        .unwrap();
        let RopeScaling::Yarn {
            attention_factor, ..
        } = plain.rope_scaling
        else {
            panic!()
        };
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }

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
