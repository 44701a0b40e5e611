//! Gemma 3 text (`gemma3_text`, GGUF `gemma3`):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma3/modeling_gemma3.py>
//!
//! What differs from llama: embeddings scaled by `sqrt(hidden_size)`; RMSNorm scales by `1 + w`
//! (folded at load); four norms per layer (pre/post attention, pre/post MLP); q/k RMSNorm per
//! head; GELU-tanh gated MLP; attention scale `query_pre_attn_scalar^-0.5`; sliding-window
//! layers (usually five of every six) with their own unscaled RoPE base `rope_local_base_freq`,
//! the full layers with `rope_theta` and `rope_scaling`; tied `lm_head`; soft-capped scores and
//! logits when the config asks (Gemma 2's caps). The decoder is the Gemma one
//! ([`super::gemma4::model`]), which Gemma 2 ([`super::gemma2`]) runs on too.

use crate::config::{Activation, Fields, rope_scaling_from};
use crate::{ModelConfig, Result};
use peregrine_tensor::RopeScaling;

/// Layers are sliding except every `pattern`-th (HF's `sliding_window_pattern`, llama.cpp's
/// swa pattern): layer `i` slides when `(i + 1) % pattern != 0`.
pub fn sliding_pattern(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers).map(|i| (i + 1) % pattern != 0).collect()
}

/// Reads Gemma 3's fields from an HF `config.json` (legacy keys and transformers 5's
/// `layer_types` / per-layer-type `rope_parameters`).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    check_gemma(fields)?;
    config.activation = Activation::GeluTanh;
    config.norm_weight_offset = 1.0;
    config.qk_norm = true;
    // HF's Gemma3TextConfig defaults (no soft caps unless the config sets them).
    config.query_pre_attn_scalar = Some(fields.opt_f64("query_pre_attn_scalar")?.unwrap_or(256.0));
    config.sliding_window = Some(fields.opt_usize("sliding_window")?.unwrap_or(4096));
    let layers = config.num_hidden_layers;
    config.sliding_layers = Some(match layer_types(fields, layers, "sliding_attention")? {
        Some(types) => types,
        None => {
            let pattern = fields.opt_usize("sliding_window_pattern")?.unwrap_or(6);
            sliding_pattern(layers, pattern)
        }
    });
    config.rope_local_theta = Some(local_rope_theta(fields)?);
    config.attn_logit_softcapping = fields.opt_f64("attn_logit_softcapping")?;
    config.final_logit_softcapping = fields.opt_f64("final_logit_softcapping")?;
    Ok(())
}

/// What every Gemma config must say for this decoder: the GELU-tanh MLP, causal attention.
pub(crate) fn check_gemma(fields: &Fields) -> Result<()> {
    let act = fields
        .opt_str("hidden_activation")?
        .or(fields.opt_str("hidden_act")?);
    if !matches!(act, None | Some("gelu_pytorch_tanh")) {
        return Err(fields.err(format!(
            "field `hidden_activation` `{}` is not supported (only `gelu_pytorch_tanh`)",
            act.unwrap_or_default()
        )));
    }
    if fields.opt_bool("use_bidirectional_attention")? == Some(true) {
        return Err(fields.err(
            "field `use_bidirectional_attention: true` (embedding models) is not supported".into(),
        ));
    }
    Ok(())
}

/// Which layers are of kind `other` rather than `full_attention`, from `layer_types` (Gemma's
/// `sliding_attention`, Qwen3-Next's `linear_attention`); `None` when the config has no such
/// list.
pub(crate) fn layer_types(
    fields: &Fields,
    layers: usize,
    other: &str,
) -> Result<Option<Vec<bool>>> {
    let Some(types) = fields.get("layer_types") else {
        return Ok(None);
    };
    let bad = || {
        fields.err(format!(
            "field `layer_types` must list {layers} of `{other}` / `full_attention`"
        ))
    };
    let types = types
        .as_array()
        .filter(|t| t.len() == layers)
        .ok_or_else(bad)?;
    let types = types.iter().map(|t| match t.as_str() {
        Some("full_attention") => Ok(false),
        Some(t) if t == other => Ok(true),
        _ => Err(bad()),
    });
    types.collect::<Result<_>>().map(Some)
}

/// The sliding layers' RoPE base: `rope_parameters.sliding_attention` (which must not scale),
/// else `rope_local_base_freq` (10000).
pub(crate) fn local_rope_theta(fields: &Fields) -> Result<f64> {
    let local = match fields.object("rope_parameters")? {
        Some(p) => p.object("sliding_attention")?,
        None => None,
    };
    if let Some(local) = local {
        if rope_scaling_from(&local)? != RopeScaling::None {
            return Err(fields.err(
                "field `rope_parameters.sliding_attention`: scaled local RoPE is not supported"
                    .into(),
            ));
        }
        if let Some(theta) = local.opt_f64("rope_theta")? {
            return Ok(theta);
        }
    }
    Ok(fields.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0))
}

/// GGUF `gemma3` files: what llama.cpp reads or hard-codes for this architecture. Norm weights
/// already hold `1 + w` (the converter adds it), so no offset; the local RoPE base is
/// `rope.freq_base_swa` when present, else 10000; the sliding pattern is 6; the attention scale
/// is `head_dim^-0.5`, except the 62-layer 27B model, which uses `hidden_size / heads`.
pub fn configure_gguf(config: &mut ModelConfig, freq_base_swa: Option<f64>) {
    config.activation = Activation::GeluTanh;
    config.norm_weight_offset = 0.0;
    config.sliding_layers = Some(sliding_pattern(config.num_hidden_layers, 6));
    config.rope_local_theta = Some(freq_base_swa.unwrap_or(10_000.0));
    let scalar = match config.num_hidden_layers {
        62 => config.hidden_size / config.num_attention_heads,
        _ => config.head_dim,
    };
    config.query_pre_attn_scalar = Some(scalar as f64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value, json};

    fn parse(map: &Map<String, Value>) -> Result<ModelConfig> {
        crate::config::parse_with(map, configure)
    }

    fn base() -> Map<String, Value> {
        let v = json!({"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 7, "num_attention_heads": 2,
            "head_dim": 4, "query_pre_attn_scalar": 8, "sliding_window": 3});
        v.as_object().unwrap().clone()
    }

    #[test]
    fn legacy_and_transformers5_keys_agree() {
        let mut legacy = base();
        legacy.extend(
            json!({"sliding_window_pattern": 6, "rope_theta": 1e6,
            "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
            .as_object()
            .unwrap()
            .clone(),
        );
        let mut v5 = base();
        let mut types = vec!["sliding_attention"; 7];
        types[5] = "full_attention";
        v5.extend(
            json!({"layer_types": types, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
            .as_object()
            .unwrap()
            .clone(),
        );
        let (legacy, v5) = (parse(&legacy).unwrap(), parse(&v5).unwrap());
        assert_eq!(legacy, v5);
        assert_eq!(v5.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!((v5.rope_theta, v5.rope_local_theta), (1e6, Some(1e4)));
        let full: Vec<bool> = v5.sliding_layers.unwrap().iter().map(|s| !s).collect();
        assert_eq!(full, [false, false, false, false, false, true, false]);
    }

    #[test]
    fn soft_caps_are_read_when_set() {
        let mut c = base();
        assert_eq!(parse(&c).unwrap().final_logit_softcapping, None);
        c.insert("final_logit_softcapping".into(), json!(30.0));
        c.insert("attn_logit_softcapping".into(), json!(null));
        let config = parse(&c).unwrap();
        assert_eq!(config.final_logit_softcapping, Some(30.0));
        assert_eq!(config.attn_logit_softcapping, None);
    }

    #[test]
    fn unsupported_fields_are_named() {
        for (key, value) in [
            ("hidden_activation", json!("relu")),
            ("layer_types", json!(["full_attention"])),
        ] {
            let mut c = base();
            c.insert(key.into(), value);
            let err = parse(&c).unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}
