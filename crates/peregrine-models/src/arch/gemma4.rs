//! Gemma 4 text (`gemma4_text`; the text part of multimodal `gemma4` checkpoints):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma4/modeling_gemma4.py>
//!
//! What differs from Gemma 3 ([`super::gemma3`]): RMSNorms scale by `w`, not `1 + w`; attention
//! scores are not scaled (scale 1: the q/k norms set their size) and values are RMS-normed too,
//! without a weight; global (full) layers have their own head width (`global_head_dim`, or
//! transformers' `per_layer_config`), and with `attention_k_eq_v` one projection for keys and
//! values (`num_global_key_value_heads`); their RoPE is `proportional` (a quarter of each head's
//! pairs turn, frequencies over the whole head); the last `num_kv_shared_layers` layers project
//! no keys or values and attend to those of the last earlier layer of their kind; per-layer input
//! embeddings (`hidden_size_per_layer_input`) feed a gated block after the MLP; each layer's
//! output is multiplied by its `layer_scalar`; with `enable_moe_block` an MoE block runs beside
//! the dense MLP (router on the un-normed residual, extra norms around both); KV-shared layers
//! have MLPs twice as wide with `use_double_wide_mlp`; output logits are soft-capped. The decoder
//! is in [`model`].

pub mod assistant;
pub(crate) mod gguf;
pub mod model;

use serde_json::Value;

use crate::arch::gemma3::{layer_types, local_rope_theta, sliding_pattern};
use crate::config::{Activation, ExpertNaming, Fields, LayerSpec, MoeConfig, PerLayerInput};
use crate::{ModelConfig, Result};
use peregrine_tensor::RopeScaling;

/// transformers' Gemma4TextConfig defaults for what hub configs may leave out.
const GLOBAL_HEAD_DIM: usize = 512;
const PER_LAYER_HIDDEN: usize = 256;
const PER_LAYER_VOCAB: usize = 262_144;

/// Reads Gemma 4's fields from an HF `config.json` (or a multimodal config's `text_config`).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    check(fields)?;
    config.activation = Activation::GeluTanh;
    config.norm_weight_offset = 0.0;
    config.qk_norm = true;
    config.v_norm = true;
    // Scores are `q · k` unscaled: `scale = query_pre_attn_scalar^-0.5 = 1`.
    config.query_pre_attn_scalar = Some(1.0);
    config.tie_word_embeddings = fields.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    config.sliding_window = Some(fields.opt_usize("sliding_window")?.unwrap_or(512));
    let layers = config.num_hidden_layers;
    let mut sliding = layer_types(fields, layers, "sliding_attention")?
        .unwrap_or_else(|| sliding_pattern(layers, 6));
    // transformers forces the last layer to be full.
    sliding[layers - 1] = false;
    if fields.get("rope_parameters").is_none() {
        config.rope_theta = 1e6;
        config.rope_scaling = RopeScaling::Proportional {
            factor: 1.0,
            partial_rotary_factor: 0.25,
        };
    }
    config.rope_local_theta = Some(local_rope_theta(fields)?);
    config.attn_logit_softcapping = None;
    config.final_logit_softcapping = fields.opt_f64("final_logit_softcapping")?;
    config.per_layer_input =
        match size_or_off(fields, "hidden_size_per_layer_input", PER_LAYER_HIDDEN)? {
            Some(hidden) => Some(PerLayerInput {
                hidden,
                vocab: fields
                    .opt_usize("vocab_size_per_layer_input")?
                    .unwrap_or(PER_LAYER_VOCAB),
                pad: (fields.token_ids("pad_token_id")?.first()).map_or(0, |&id| id),
            }),
            None => None,
        };
    config.layer_specs = layer_specs(fields, config, &sliding)?;
    config.sliding_layers = Some(sliding);
    if fields.opt_bool("enable_moe_block")? == Some(true) {
        let num_experts = fields.usize("num_experts")?;
        let top_k = fields.usize("top_k_experts")?;
        if top_k > num_experts {
            return Err(fields.err(format!(
                "`top_k_experts` {top_k} exceeds the {num_experts} experts"
            )));
        }
        config.moe = Some(MoeConfig {
            num_experts,
            top_k,
            intermediate_size: fields.usize("moe_intermediate_size")?,
            normalize: true,
            sparse_layers: vec![true; layers],
            naming: ExpertNaming::Gemma4,
            sigmoid: None,
            shared_intermediate_size: None,
            shared_gated: false,
        });
    }
    Ok(())
}

/// Where each layer's keys and values come from (transformers' `kv_sharing_modes`): each of
/// the last `shared` layers reads the last layer of its kind (sliding or full) before them.
pub(crate) fn kv_sources(
    sliding: &[bool],
    shared: usize,
) -> std::result::Result<Vec<Option<usize>>, String> {
    let first_shared = sliding.len() - shared;
    (0..sliding.len())
        .map(|i| match i >= first_shared {
            true => (0..first_shared)
                .rev()
                .find(|&j| sliding[j] == sliding[i])
                .map(Some)
                .ok_or_else(|| format!("layer {i} shares KV, but no earlier layer is of its kind")),
            false => Ok(None),
        })
        .collect()
}

/// The fields this decoder cannot run.
fn check(fields: &Fields) -> Result<()> {
    let act = fields.opt_str("hidden_activation")?;
    if !matches!(act, None | Some("gelu_pytorch_tanh")) {
        return Err(fields.err(format!(
            "field `hidden_activation` `{}` is not supported (only `gelu_pytorch_tanh`)",
            act.unwrap_or_default()
        )));
    }
    // `vision` only changes attention inside images, which text never has.
    if let Some(Value::String(mode)) = fields.get("use_bidirectional_attention")
        && mode == "all"
    {
        return Err(fields.err(
            "field `use_bidirectional_attention: \"all\"` (embedding models) is not supported"
                .into(),
        ));
    }
    Ok(())
}

/// A size where transformers reads `0` or `null` as "off" and a missing key as `default`.
fn size_or_off(fields: &Fields, key: &str, default: usize) -> Result<Option<usize>> {
    match fields.get(key) {
        None if !fields.contains(key) => Ok(Some(default)),
        Some(v) if v.as_u64() != Some(0) => fields.opt_usize(key),
        _ => Ok(None),
    }
}

/// Each layer's head width, KV heads, MLP width and KV source, as transformers'
/// `per_layer_config` and `kv_sharing_modes` give them.
fn layer_specs(fields: &Fields, c: &ModelConfig, sliding: &[bool]) -> Result<Vec<LayerSpec>> {
    let layers = c.num_hidden_layers;
    let k_eq_v = fields.opt_bool("attention_k_eq_v")?.unwrap_or(false);
    let shared = fields.get("num_kv_shared_layers").and_then(Value::as_u64);
    let shared = shared.unwrap_or(0) as usize;
    if shared >= layers {
        return Err(fields.err(format!(
            "field `num_kv_shared_layers` {shared}: at least one of the {layers} layers must \
             project keys and values"
        )));
    }
    let double = fields.opt_bool("use_double_wide_mlp")?.unwrap_or(false);
    let sources = kv_sources(sliding, shared).map_err(|e| fields.err(e))?;
    let mut specs = Vec::with_capacity(layers);
    for (i, kv_source) in sources.into_iter().enumerate() {
        let wide = double && kv_source.is_some();
        specs.push(LayerSpec {
            head_dim: c.head_dim,
            num_key_value_heads: c.num_key_value_heads,
            intermediate_size: c.intermediate_size * if wide { 2 } else { 1 },
            kv_source,
            values_from_keys: k_eq_v && !sliding[i],
        });
    }
    match fields.object("per_layer_config")? {
        Some(per_layer) => {
            for key in per_layer.keys() {
                let i = key
                    .parse::<usize>()
                    .ok()
                    .filter(|&i| i < layers)
                    .ok_or_else(|| {
                        fields.err(format!(
                            "field `per_layer_config`: `{key}` is not a layer index"
                        ))
                    })?;
                let over = per_layer.object(key)?.ok_or_else(|| {
                    fields.err(format!("field `per_layer_config.{key}` must be an object"))
                })?;
                for field in over.keys() {
                    match field.as_str() {
                        "head_dim" => specs[i].head_dim = over.usize("head_dim")?,
                        "num_key_value_heads" => {
                            specs[i].num_key_value_heads = over.usize("num_key_value_heads")?
                        }
                        other => {
                            return Err(fields.err(format!(
                                "field `per_layer_config.{key}.{other}` is not supported"
                            )));
                        }
                    }
                }
            }
        }
        // A hub config: transformers builds `per_layer_config` from these for the full layers.
        None => {
            let head_dim = fields
                .opt_usize("global_head_dim")?
                .unwrap_or(GLOBAL_HEAD_DIM);
            let kv_heads = fields
                .opt_usize("num_global_key_value_heads")?
                .filter(|_| k_eq_v);
            for (spec, _) in specs.iter_mut().zip(sliding).filter(|(_, s)| !**s) {
                spec.head_dim = head_dim;
                spec.num_key_value_heads = kv_heads.unwrap_or(spec.num_key_value_heads);
            }
        }
    }
    for (i, s) in specs.iter().enumerate() {
        if !s.head_dim.is_multiple_of(2)
            || !c.num_attention_heads.is_multiple_of(s.num_key_value_heads)
        {
            return Err(fields.err(format!(
                "layer {i}: head_dim {} must be even and num_key_value_heads {} divide the {} heads",
                s.head_dim, s.num_key_value_heads, c.num_attention_heads
            )));
        }
    }
    Ok(specs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, json};

    fn parse(map: &Map<String, Value>) -> Result<ModelConfig> {
        crate::config::parse_with(map, configure)
    }

    fn base() -> Map<String, Value> {
        let types = ["sliding_attention", "sliding_attention", "full_attention"].repeat(2);
        let v = json!({"model_type": "gemma4_text", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 6, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 4, "sliding_window": 3, "layer_types": types,
            "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 4,
            "vocab_size_per_layer_input": 10, "use_double_wide_mlp": true,
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}});
        v.as_object().unwrap().clone()
    }

    /// KV sharing as transformers' `kv_sharing_modes`: layer 4 (sliding) reads layer 3, layer
    /// 5 (full) layer 2; the shared layers' MLPs are double-wide; `global_head_dim` and
    /// `per_layer_config` give the full layers the same width.
    #[test]
    fn kv_sources_and_per_layer_shapes_follow_transformers() {
        let mut hub = base();
        hub.insert("global_head_dim".into(), json!(8));
        let mut v5 = base();
        v5.insert(
            "per_layer_config".into(),
            json!({"2": {"head_dim": 8}, "5": {"head_dim": 8}}),
        );
        let (hub, v5) = (parse(&hub).unwrap(), parse(&v5).unwrap());
        assert_eq!(hub, v5);
        let sources: Vec<_> = v5.layer_specs.iter().map(|s| s.kv_source).collect();
        assert_eq!(sources, [None, None, None, None, Some(3), Some(2)]);
        let dims: Vec<_> = v5.layer_specs.iter().map(|s| s.head_dim).collect();
        assert_eq!(dims, [4, 4, 8, 4, 4, 8]);
        let widths: Vec<_> = v5.layer_specs.iter().map(|s| s.intermediate_size).collect();
        assert_eq!(widths, [16, 16, 16, 16, 32, 32]);
        assert_eq!(v5.for_layer(5).head_dim, 8);
        assert_eq!(v5.partial_rotary_factor, 1.0);
        assert_eq!(v5.query_pre_attn_scalar, Some(1.0));
        let scaling = RopeScaling::Proportional {
            factor: 1.0,
            partial_rotary_factor: 0.25,
        };
        assert_eq!(
            (v5.rope_scaling.clone(), v5.rope_local_theta),
            (scaling, Some(1e4))
        );
        // transformers' `_compute_proportional_rope_parameters` for a 32-wide head: 4 of 16
        // pairs turn, at `1e6^(-2i/32)`.
        let freqs = peregrine_tensor::rope::inv_freqs(32, 1e6, &v5.rope_scaling);
        let want = (0..16).map(|i| match i < 4 {
            true => 1e6f64.powf(-2.0 * i as f64 / 32.0),
            false => 0.0,
        });
        let close = freqs
            .iter()
            .zip(want)
            .all(|(f, w)| (f - w).abs() <= 1e-12 * w);
        assert!(close && freqs.len() == 16, "{freqs:?}");
    }

    #[test]
    fn hub_defaults_and_switches() {
        let mut c = base();
        c.remove("hidden_size_per_layer_input");
        c.insert("attention_k_eq_v".into(), json!(true));
        c.insert("num_global_key_value_heads".into(), json!(1));
        let config = parse(&c).unwrap();
        let ple = config.per_layer_input.unwrap();
        assert_eq!((ple.hidden, ple.vocab), (PER_LAYER_HIDDEN, 10));
        let full = &config.layer_specs[2];
        assert_eq!(
            (full.head_dim, full.num_key_value_heads),
            (GLOBAL_HEAD_DIM, 1)
        );
        assert!(full.values_from_keys && !config.layer_specs[1].values_from_keys);
        c.insert("hidden_size_per_layer_input".into(), json!(0));
        assert_eq!(parse(&c).unwrap().per_layer_input, None);
    }

    #[test]
    fn unsupported_fields_are_named() {
        for (key, value) in [
            ("use_bidirectional_attention", json!("all")),
            ("num_kv_shared_layers", json!(6)),
            ("per_layer_config", json!({"1": {"intermediate_size": 8}})),
            ("hidden_activation", json!("relu")),
        ] {
            let mut c = base();
            c.insert(key.into(), value);
            let err = parse(&c).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }
}
