//! Gemma 2 (`gemma2`, GGUF `gemma2`):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma2/modeling_gemma2.py>
//!
//! The Gemma decoder ([`super::gemma4::model`]) without q/k norms and with one RoPE base:
//! embeddings scaled by `sqrt(hidden_size)`, `1 + w` RMSNorms, four norms per layer, GELU-tanh
//! MLP, attention scale `query_pre_attn_scalar^-0.5`; sliding and full layers alternate (layer 0
//! slides); attention scores are soft-capped (`attn_logit_softcapping`, 50 by default:
//! `cap · tanh(s / cap)` before the mask) and so are the output logits
//! (`final_logit_softcapping`, 30); tied `lm_head` by default.

use crate::arch::gemma3::{check_gemma, layer_types, sliding_pattern};
use crate::config::{Activation, Fields};
use crate::{ModelConfig, Result};

/// HF's Gemma2Config defaults for the caps; llama.cpp's too when a GGUF file omits them.
const ATTN_SOFTCAP: f64 = 50.0;
const FINAL_SOFTCAP: f64 = 30.0;

/// Reads Gemma 2's fields from an HF `config.json`: `layer_types` (transformers 5) or HF's
/// legacy rule (even layers slide), the caps (a `null` cap is off).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    check_gemma(fields)?;
    config.activation = Activation::GeluTanh;
    config.norm_weight_offset = 1.0;
    config.qk_norm = false;
    config.tie_word_embeddings = fields.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    config.query_pre_attn_scalar = Some(fields.opt_f64("query_pre_attn_scalar")?.unwrap_or(256.0));
    config.sliding_window = Some(fields.opt_usize("sliding_window")?.unwrap_or(4096));
    let layers = config.num_hidden_layers;
    config.sliding_layers = Some(
        layer_types(fields, layers, "sliding_attention")?
            .unwrap_or_else(|| sliding_pattern(layers, 2)),
    );
    let cap = |key: &str, default: f64| -> Result<Option<f64>> {
        let cap = match fields.contains(key) {
            true => fields.opt_f64(key)?,
            false => Some(default),
        };
        if cap.is_some_and(|c| c <= 0.0) {
            return Err(fields.err(format!("field `{key}` must be positive")));
        }
        Ok(cap)
    };
    config.attn_logit_softcapping = cap("attn_logit_softcapping", ATTN_SOFTCAP)?;
    config.final_logit_softcapping = cap("final_logit_softcapping", FINAL_SOFTCAP)?;
    Ok(())
}

/// GGUF `gemma2` files, read as llama.cpp reads them: norm weights already hold `1 + w`;
/// `attn_logit_softcapping` / `final_logit_softcapping` (`caps`) default to 50 and 30 and
/// `attention.sliding_window` to 4096; even layers slide; the attention scale is
/// `head_dim^-0.5`, except the 46-layer 27B model, which uses `hidden_size / heads`.
pub fn configure_gguf(config: &mut ModelConfig, caps: (Option<f64>, Option<f64>)) {
    config.activation = Activation::GeluTanh;
    config.norm_weight_offset = 0.0;
    config.sliding_window = Some(config.sliding_window.unwrap_or(4096));
    config.sliding_layers = Some(sliding_pattern(config.num_hidden_layers, 2));
    let scalar = match config.num_hidden_layers {
        46 => config.hidden_size / config.num_attention_heads,
        _ => config.head_dim,
    };
    config.query_pre_attn_scalar = Some(scalar as f64);
    config.attn_logit_softcapping = Some(caps.0.unwrap_or(ATTN_SOFTCAP));
    config.final_logit_softcapping = Some(caps.1.unwrap_or(FINAL_SOFTCAP));
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value, json};

    fn parse(map: &Map<String, Value>) -> Result<ModelConfig> {
        crate::config::parse_with(map, configure)
    }

    /// A hub-style Gemma 2 config: no `layer_types`, no `tie_word_embeddings`.
    fn legacy() -> Map<String, Value> {
        let v = json!({"model_type": "gemma2", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
            "head_dim": 4, "query_pre_attn_scalar": 8, "sliding_window": 3,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh"});
        v.as_object().unwrap().clone()
    }

    #[test]
    fn legacy_and_transformers5_keys_agree() {
        let mut v5 = legacy();
        let types = ["sliding_attention", "full_attention"].repeat(2);
        v5.insert("layer_types".into(), json!(types));
        v5.insert("tie_word_embeddings".into(), json!(true));
        let (legacy, v5) = (parse(&legacy()).unwrap(), parse(&v5).unwrap());
        assert_eq!(legacy, v5);
        assert_eq!(v5.sliding_layers, Some(vec![true, false, true, false]));
        assert!(v5.tie_word_embeddings && !v5.qk_norm);
        assert_eq!(v5.rope_local_theta, None);
        let caps = (v5.attn_logit_softcapping, v5.final_logit_softcapping);
        assert_eq!(caps, (Some(50.0), Some(30.0)));
    }

    #[test]
    fn caps_default_on_and_null_turns_them_off() {
        let mut c = legacy();
        c.remove("attn_logit_softcapping");
        c.insert("final_logit_softcapping".into(), json!(null));
        let config = parse(&c).unwrap();
        let caps = (
            config.attn_logit_softcapping,
            config.final_logit_softcapping,
        );
        assert_eq!(caps, (Some(50.0), None));
        c.insert("attn_logit_softcapping".into(), json!(0.0));
        let err = parse(&c).unwrap_err().to_string();
        assert!(err.contains("attn_logit_softcapping"), "{err}");
    }
}
