//! GGUF metadata mapped onto [`ModelConfig`] (llama.cpp's keys: `{arch}.block_count` etc.).

use peregrine_tensor::candle::quantized::gguf_file::Value;
use peregrine_tensor::{RopeScaling, RopeStyle};

use super::GgufFile;
use crate::config::Activation;
use crate::{ModelConfig, ModelError, Result};

/// The `partial_rotary_factor` whose `rotary_dim()` is exactly `rotary` of `head_dim` (the
/// smallest such f64 at or above `rotary / head_dim`, since `rotary_dim` truncates).
pub(crate) fn partial_rotary_factor(rotary: usize, head_dim: usize) -> f64 {
    let mut f = rotary as f64 / head_dim as f64;
    while ((head_dim as f64 * f) as usize) < rotary {
        f = f64::from_bits(f.to_bits() + 1);
    }
    f
}

/// A non-negative integer of any GGUF integer type (gguf-py writes Python lists as `i32`).
fn count(v: &Value) -> Option<usize> {
    let n = match *v {
        Value::U8(n) => n as i64,
        Value::U16(n) => n as i64,
        Value::U32(n) => n as i64,
        Value::U64(n) => i64::try_from(n).ok()?,
        Value::I8(n) => n as i64,
        Value::I16(n) => n as i64,
        Value::I32(n) => n as i64,
        Value::I64(n) => n,
        _ => return None,
    };
    usize::try_from(n).ok()
}

/// A typed view of one file's GGUF metadata (keys under its architecture) with errors naming
/// the key.
pub(crate) struct GgufMeta<'a> {
    pub(crate) file: &'a GgufFile,
    pub(crate) arch: String,
}

impl GgufMeta<'_> {
    fn value(&self, key: &str) -> Option<&Value> {
        self.file.metadata().get(&format!("{}.{key}", self.arch))
    }

    /// An error about `{arch}.{key}`.
    pub(crate) fn err(&self, key: &str, what: &str) -> ModelError {
        ModelError::config(
            self.file.path(),
            format!("metadata `{}.{key}` {what}", self.arch),
        )
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .to_u64()
                .map(|n| Some(n as usize))
                .map_err(|_| self.err(key, "must be an integer")),
        }
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(key, "is missing"))
    }

    /// An integer per layer: one for all (`n`) or an array of `layers` (llama.cpp writes
    /// arrays where layers differ, as Gemma 4's widths and KV heads).
    pub(crate) fn opt_per_layer(&self, key: &str, layers: usize) -> Result<Option<Vec<usize>>> {
        let Some(Value::Array(values)) = self.value(key) else {
            return Ok(self.opt_usize(key)?.map(|n| vec![n; layers]));
        };
        if values.len() != layers {
            let what = format!("has {} values for {layers} layers", values.len());
            return Err(self.err(key, &what));
        }
        let each: Option<Vec<usize>> = values.iter().map(count).collect();
        each.map(Some)
            .ok_or_else(|| self.err(key, "must hold non-negative integers"))
    }

    /// A boolean per layer (Gemma 4's `attention.sliding_window_pattern`).
    pub(crate) fn opt_bools(&self, key: &str) -> Result<Option<Vec<bool>>> {
        let Some(v) = self.value(key) else {
            return Ok(None);
        };
        let bad = || self.err(key, "must be an array of booleans");
        let Value::Array(values) = v else {
            return Err(bad());
        };
        (values.iter())
            .map(|v| match v {
                Value::Bool(b) => Ok(*b),
                _ => Err(bad()),
            })
            .collect::<Result<Vec<bool>>>()
            .map(Some)
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.err(key, "must be a boolean")),
        }
    }

    /// A string value.
    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.err(key, "must be a string")),
        }
    }

    /// An array of numbers.
    pub(crate) fn opt_f64s(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let number = |v: &Value| match *v {
            Value::F32(x) => Some(x as f64),
            Value::F64(x) => Some(x),
            _ => count(v).map(|n| n as f64),
        };
        match self.value(key) {
            None => Ok(None),
            Some(Value::Array(items)) => (items.iter().map(number).collect::<Option<Vec<_>>>())
                .map(Some)
                .ok_or_else(|| self.err(key, "must hold numbers")),
            Some(_) => Err(self.err(key, "must be an array")),
        }
    }

    pub(crate) fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x as f64)),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => v
                .to_u64()
                .map(|n| Some(n as f64))
                .map_err(|_| self.err(key, "must be a number")),
        }
    }
}

/// llama.cpp's M-RoPE sections (`qwen2vl`, `qwen3vl`, `qwen35`, …) (`rope.dimension_sections`: time, height, width and
/// an unused fourth), as rotated pairs.
fn mrope_sections(meta: &GgufMeta) -> Result<Option<[usize; 3]>> {
    let key = "rope.dimension_sections";
    match meta.opt_f64s(key)?.as_deref() {
        None => Ok(None),
        Some([t, h, w, rest @ ..]) if rest.iter().all(|&x| x == 0.0) => {
            Ok(Some([*t as usize, *h as usize, *w as usize]))
        }
        Some(_) => Err(meta.err(key, "must hold three section sizes (and zeros)")),
    }
}

/// Maps GGUF metadata to a [`ModelConfig`].
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig> {
    let md = file.metadata();
    let arch = match md.get("general.architecture").map(|v| v.to_string()) {
        Some(Ok(a)) => a.clone(),
        _ => {
            return Err(ModelError::config(
                file.path(),
                "metadata `general.architecture` is missing",
            ));
        }
    };
    let meta = GgufMeta {
        file,
        arch: arch.clone(),
    };
    let hidden_size = meta.usize("embedding_length")?;
    // llama.cpp counts multi-token-prediction layers (after the last one) in `block_count`;
    // the model is the layers before them (the MTP layers are not read).
    let blocks = meta.usize("block_count")?;
    let nextn = meta.opt_usize("nextn_predict_layers")?.unwrap_or(0);
    let layers = blocks
        .checked_sub(nextn)
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            meta.err(
                "nextn_predict_layers",
                &format!("{nextn} leaves none of {blocks} blocks"),
            )
        })?;
    // Per-layer widths and KV heads: the first layer's, which Gemma 4 overrides per layer.
    let per_layer = |key| -> Result<Option<Vec<usize>>> {
        let values = meta.opt_per_layer(key, blocks)?;
        Ok(values.map(|v| v[..layers].to_vec()))
    };
    let (ffn, mut kv_heads) = (
        per_layer("feed_forward_length")?,
        per_layer("attention.head_count_kv")?,
    );
    // Jamba's Mamba layers have no KV heads (0): the attention layers' count is the model's.
    let jamba_attention = match (arch.as_str(), kv_heads.as_mut()) {
        ("jamba", Some(kv)) => {
            let attention: Vec<bool> = kv.iter().map(|&n| n > 0).collect();
            let n = kv.iter().copied().max().unwrap_or(0);
            kv.iter_mut().for_each(|k| *k = n);
            Some(attention)
        }
        _ => None,
    };
    if arch != "gemma4" {
        for (key, values) in [
            ("feed_forward_length", &ffn),
            ("attention.head_count_kv", &kv_heads),
        ] {
            if let Some(v) = values
                && v.iter().any(|&n| n != v[0])
            {
                return Err(meta.err(
                    key,
                    "differs between layers, which this architecture does not support",
                ));
            }
        }
    }
    let heads = match meta.usize("attention.head_count")? {
        // Mamba 2 has no attention (0 heads): its SSM heads stand in, as in its HF config.
        0 if arch == "mamba2" => meta.usize("ssm.time_step_rank")?,
        heads => heads,
    };
    let vocab_size = match md.get("tokenizer.ggml.tokens").map(|v| v.to_vec()) {
        Some(Ok(tokens)) => tokens.len(),
        _ => meta.usize("vocab_size")?,
    };
    let token_id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
    let rope_scaling = match md
        .get(&format!("{arch}.rope.scaling.type"))
        .map(|v| v.to_string())
    {
        Some(Ok(kind)) if kind == "linear" => RopeScaling::Linear {
            factor: meta
                .opt_f64("rope.scaling.factor")?
                .ok_or_else(|| meta.err("rope.scaling.factor", "is missing"))?,
        },
        Some(Ok(kind)) if kind == "yarn" => {
            let factor = meta
                .opt_f64("rope.scaling.factor")?
                .ok_or_else(|| meta.err("rope.scaling.factor", "is missing"))?;
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: meta
                    .usize("rope.scaling.original_context_length")?,
                beta_fast: meta.opt_f64("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                beta_slow: meta.opt_f64("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                // transformers' default; DeepSeek's files move it into the score scale.
                attention_factor: meta
                    .opt_f64("rope.scaling.attn_factor")?
                    .unwrap_or_else(|| crate::config::yarn_get_mscale(factor, 1.0)),
                truncate: true,
            }
        }
        Some(Ok(kind)) if kind != "none" => {
            return Err(meta.err("rope.scaling.type", &format!("`{kind}` is not supported")));
        }
        _ => RopeScaling::None,
    };
    let mut config = ModelConfig {
        model_type: arch.clone(),
        vocab_size,
        hidden_size,
        intermediate_size: ffn
            .as_ref()
            .map(|v| v[0])
            .ok_or_else(|| meta.err("feed_forward_length", "is missing"))?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads.as_ref().map_or(heads, |v| v[0]),
        head_dim: meta
            .opt_usize("attention.key_length")?
            .unwrap_or(hidden_size / heads),
        rms_norm_eps: meta
            .opt_f64("attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-5),
        rope_theta: meta.opt_f64("rope.freq_base")?.unwrap_or(10_000.0),
        rope_scaling,
        partial_rotary_factor: 1.0,
        mrope_sections: mrope_sections(&meta)?,
        // llama.cpp turns these by its interleaved M-RoPE (Qwen3-VL's layout).
        mrope_interleaved: matches!(
            arch.as_str(),
            "qwen3vl" | "qwen3vlmoe" | "qwen35" | "qwen35moe"
        ),
        // llama.cpp's converter permutes llama q/k weights for GPT-J-style rotation.
        rope_style: if arch == "llama" {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Half
        },
        max_position_embeddings: meta.opt_usize("context_length")?.unwrap_or(4096),
        tie_word_embeddings: !file.has_tensor("output.weight"),
        sliding_window: meta.opt_usize("attention.sliding_window")?,
        attention_bias: file.has_tensor("blk.0.attn_q.bias"),
        qk_norm: file.has_tensor("blk.0.attn_q_norm.weight"),
        norm_weight_offset: 0.0,
        activation: Activation::Silu,
        query_pre_attn_scalar: None,
        sliding_layers: None,
        rope_local_theta: None,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: token_id("tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
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
    if let Some(experts) = meta.opt_usize("expert_count")? {
        // llama.cpp makes every layer of these families sparse and renormalises the chosen
        // experts' weights unless `expert_weights_norm` says otherwise.
        config.moe = Some(crate::config::MoeConfig {
            num_experts: experts,
            top_k: meta.usize("expert_used_count")?,
            intermediate_size: meta
                .opt_usize("expert_feed_forward_length")?
                .unwrap_or(config.intermediate_size),
            normalize: !matches!(meta.value("expert_weights_norm"), Some(Value::Bool(false))),
            sparse_layers: vec![true; config.num_hidden_layers],
            naming: crate::config::ExpertNaming::Qwen,
            sigmoid: None,
            shared_intermediate_size: None,
            shared_gated: false,
        });
    }
    if arch == "gemma3" {
        crate::arch::gemma3::configure_gguf(&mut config, meta.opt_f64("rope.freq_base_swa")?);
    }
    if matches!(arch.as_str(), "qwen3next" | "qwen35" | "qwen35moe") {
        crate::arch::qwen3_next::configure_gguf(&meta, &mut config, arch != "qwen3next")?;
    }
    if arch == "mamba2" {
        crate::arch::mamba2::configure_gguf(&meta, &mut config)?;
    }
    if arch == "falcon-h1" {
        crate::arch::falcon_h1::configure_gguf(&meta, &mut config)?;
    }
    if let Some(attention) = jamba_attention {
        crate::arch::jamba::configure_gguf(&meta, &mut config, attention)?;
    }
    if arch == "gemma4" {
        crate::arch::gemma4::gguf::configure(&meta, &mut config)?;
    } else if arch == "deepseek2" {
        crate::arch::deepseek_v3::configure_gguf(&meta, &mut config)?;
    } else if let Some(rotary) = meta.opt_usize("rope.dimension_count")? {
        config.partial_rotary_factor = partial_rotary_factor(rotary, config.head_dim);
    }
    // Llama 3.1's scaling as llama.cpp's converter writes it: a divisor per rotated pair.
    if arch != "gemma4"
        && let Some(factors) = file.f32_values("rope_freqs.weight")?
    {
        let pairs = config.rotary_dim() / 2;
        if factors.len() != pairs || config.rope_scaling != RopeScaling::None {
            let message = format!(
                "tensor `rope_freqs.weight`: {} factors for {pairs} rotated pairs{}",
                factors.len(),
                match config.rope_scaling {
                    RopeScaling::None => "",
                    _ => ", beside a `rope.scaling.type` (both at once are not supported)",
                }
            );
            return Err(ModelError::config(file.path(), &message));
        }
        config.rope_scaling = RopeScaling::Factors(factors.into_iter().map(f64::from).collect());
    }
    if arch == "phi3" {
        let factors = (
            file.f32_values("rope_factors_short.weight")?,
            file.f32_values("rope_factors_long.weight")?,
        );
        let scaling = (
            meta.opt_usize("rope.scaling.original_context_length")?,
            meta.opt_f64("rope.scaling.attn_factor")?,
        );
        crate::arch::phi3::configure_gguf(&mut config, file.path(), factors, scaling)?;
    }
    if arch == "gemma2" {
        let caps = (
            meta.opt_f64("attn_logit_softcapping")?,
            meta.opt_f64("final_logit_softcapping")?,
        );
        crate::arch::gemma2::configure_gguf(&mut config, caps);
    }
    config.validate(file.path())?;
    Ok(config)
}
