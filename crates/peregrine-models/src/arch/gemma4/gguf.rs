//! Gemma 4 from GGUF metadata, as llama.cpp's converter writes it (`Gemma4Model` in its
//! `conversion/gemma.py`): `attention.sliding_window_pattern` lists which layers slide;
//! `attention.key_length` is the full layers' head width and `key_length_swa` the sliding
//! ones'; `feed_forward_length` and `attention.head_count_kv` become per-layer arrays where
//! layers differ (double-wide MLPs, the full layers' KV heads); `attention.shared_kv_layers`
//! counts the KV-sharing layers at the end; a full layer without `attn_v` takes its values from
//! its keys (`attention_k_eq_v`). The proportional RoPE of the full layers is written as
//! `rope_freqs` factors over the whole head: 1 for the pairs that turn, 1e30 for the rest.

use crate::arch::gemma4::kv_sources;
use crate::config::{Activation, ExpertNaming, LayerSpec, PerLayerInput};
use crate::weights::{GgufMeta, partial_rotary_factor};
use crate::{ModelConfig, ModelError, Result};
use peregrine_tensor::RopeScaling;

/// Reads Gemma 4's keys and tensor layout into `config` (the common keys are read already).
pub(crate) fn configure(meta: &GgufMeta, config: &mut ModelConfig) -> Result<()> {
    let file = meta.file;
    let layers = config.num_hidden_layers;
    config.activation = Activation::GeluTanh;
    config.norm_weight_offset = 0.0;
    config.qk_norm = true;
    config.v_norm = true;
    config.query_pre_attn_scalar = Some(1.0);
    config.final_logit_softcapping = meta.opt_f64("final_logit_softcapping")?;
    config.rope_local_theta = Some(meta.opt_f64("rope.freq_base_swa")?.unwrap_or(10_000.0));
    let pattern = "attention.sliding_window_pattern";
    let sliding = (meta.opt_bools(pattern)?).ok_or_else(|| meta.err(pattern, "is missing"))?;
    if sliding.len() != layers {
        return Err(meta.err(pattern, &format!("must list {layers} layers")));
    }
    let head_full = meta.usize("attention.key_length")?;
    let head_swa = meta
        .opt_usize("attention.key_length_swa")?
        .unwrap_or(head_full);
    for (key, want) in [
        ("attention.value_length", head_full),
        ("attention.value_length_swa", head_swa),
        ("rope.dimension_count", head_full),
        ("rope.dimension_count_swa", head_swa),
    ] {
        if let Some(got) = meta.opt_usize(key)?
            && got != want
        {
            let what = format!("is {got}; only {want} (the head width) is supported");
            return Err(meta.err(key, &what));
        }
    }
    config.head_dim = head_swa;
    config.partial_rotary_factor = 1.0;
    config.rope_scaling = proportional(meta, head_full)?;
    if let Some(hidden) = meta.opt_usize("embedding_length_per_layer_input")?
        && hidden > 0
    {
        let rows = file.tensor_dims("per_layer_token_embd.weight");
        let vocab = rows.map_or(config.vocab_size, |d| d[0]);
        let pad = meta
            .opt_usize("tokenizer.ggml.padding_token_id")?
            .unwrap_or(0) as u32;
        config.per_layer_input = Some(PerLayerInput { hidden, vocab, pad });
    }
    let shared = meta.opt_usize("attention.shared_kv_layers")?.unwrap_or(0);
    if shared >= layers {
        let what = "leaves no layer that projects keys and values";
        return Err(meta.err("attention.shared_kv_layers", what));
    }
    let sources = kv_sources(&sliding, shared)
        .map_err(|e| meta.err("attention.shared_kv_layers", &format!("{shared}: {e}")))?;
    let ffn = meta.opt_per_layer("feed_forward_length", layers)?;
    let kv_heads = meta.opt_per_layer("attention.head_count_kv", layers)?;
    config.layer_specs = (0..layers)
        .map(|i| LayerSpec {
            head_dim: if sliding[i] { head_swa } else { head_full },
            num_key_value_heads: kv_heads
                .as_ref()
                .map_or(config.num_attention_heads, |v| v[i]),
            intermediate_size: ffn.as_ref().map_or(config.intermediate_size, |v| v[i]),
            kv_source: sources[i],
            values_from_keys: sources[i].is_none()
                && !file.has_tensor(&format!("blk.{i}.attn_v.weight")),
        })
        .collect();
    if let Some(moe) = &mut config.moe {
        moe.naming = ExpertNaming::Gemma4;
        moe.normalize = true;
        moe.sparse_layers = (0..layers)
            .map(|i| file.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect();
    }
    config.sliding_layers = Some(sliding);
    Ok(())
}

/// The full layers' RoPE from the `rope_freqs` factors: Gemma 4's proportional RoPE when the
/// first pairs have factor 1 and the rest a factor so large their frequency is 0; any other
/// factors are refused, naming the tensor.
fn proportional(meta: &GgufMeta, head_dim: usize) -> Result<RopeScaling> {
    let Some(factors) = meta.file.f32_values("rope_freqs.weight")? else {
        return Ok(RopeScaling::None);
    };
    let half = head_dim / 2;
    let turning = factors.iter().take_while(|&&f| f == 1.0).count();
    let rest_off = factors[turning..].iter().all(|&f| f >= 1e20);
    if factors.len() != half || !rest_off {
        return Err(ModelError::config(
            meta.file.path(),
            format!(
                "tensor `rope_freqs.weight` ({} values for {half} pairs): only Gemma 4's \
                 proportional factors (1 for the pairs that turn, 1e30 for the rest) are supported",
                factors.len()
            ),
        ));
    }
    // rope.rs turns `floor(fraction · half)` pairs: the fraction that gives exactly `turning`.
    Ok(RopeScaling::Proportional {
        factor: 1.0,
        partial_rotary_factor: partial_rotary_factor(turning, half),
    })
}
