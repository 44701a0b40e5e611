//! DeepSeek-V3 (and its R1 / V3.1 checkpoints): multi-head latent attention, sigmoid
//! group-limited routed experts with shared experts, YaRN RoPE.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/deepseek_v3/modeling_deepseek_v3.py>
//!
//! What differs from llama, and where it is handled:
//! - Attention is MLA (`layers/mla.rs`): `q_lora_rank` (null: a plain `q_proj`), `kv_lora_rank`,
//!   `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; scores scaled by
//!   `(nope + rope)^-0.5 · mscale²` with `mscale = yarn_get_mscale(factor, mscale_all_dim)` when
//!   the RoPE scaling has a non-zero `mscale_all_dim` (transformers' `yarn_apply_mscale`).
//!   Attention runs in the absorbed form over a cache of the compressed latent (`layers/mla.rs`):
//!   one key head of `qk_rope_head_dim + kv_lora_rank` per position.
//! - RoPE covers `qk_rope_head_dim` only, YaRN-scaled (`RopeScaling::Yarn`); `rope_interleave`
//!   (default true) rotates adjacent pairs.
//! - Layers `< first_k_dense_replace` have a dense MLP of `intermediate_size`; the others are
//!   MoE (`mlp.gate` with `e_score_correction_bias`, `mlp.experts.N`, `mlp.shared_experts` of
//!   `moe_intermediate_size · n_shared_experts`): sigmoid scores, `n_group` / `topk_group`
//!   group-limited choice, `norm_topk_prob`, weights times `routed_scaling_factor`.
//! - Real checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the
//!   last one (`model.layers.61.*` in DeepSeek-V3: `enorm`, `hnorm`, `eh_proj`,
//!   `shared_head.norm` around a decoder layer); the model reads them only when asked
//!   (`LoadOptions::mtp`, for speculative decoding: `layers/decoder/mtp.rs`). GGUF files' are
//!   skipped (`block_count` less `nextn_predict_layers`).
//! - GGUF files (`deepseek2`) are read by `configure_gguf`.
//!
//! Everything else is the llama-family decoder: the model is `DecoderLm<Mla>`.

use peregrine_tensor::RopeScaling;

use crate::config::{ExpertNaming, Fields, MlaConfig, MoeConfig, SigmoidRouting, yarn_get_mscale};
use crate::layers::mla::Mla;
use crate::weights::GgufMeta;
use crate::{ModelConfig, Result};

/// Reads the MLA and MoE fields. `head_dim` becomes the cached head width (`rope + kv_lora_rank`)
/// and there is one key/value head (the latent every query head attends).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    match fields.opt_str("hidden_act")? {
        None | Some("silu") => {}
        Some(other) => {
            return Err(fields.err(format!(
                "deepseek_v3 with `hidden_act` `{other}` is not supported (only `silu`)"
            )));
        }
    }
    let nope = fields.usize("qk_nope_head_dim")?;
    let rope = fields.usize("qk_rope_head_dim")?;
    let v = fields.usize("v_head_dim")?;
    let mut softmax_scale = ((nope + rope) as f64).powf(-0.5);
    let params = match fields.object("rope_parameters")? {
        Some(p) => Some(p),
        None => fields.object("rope_scaling")?,
    };
    if let (Some(p), RopeScaling::Yarn { factor, .. }) = (&params, &config.rope_scaling)
        && let Some(all) = p.opt_f64("mscale_all_dim")?.filter(|m| *m != 0.0)
    {
        let mscale = yarn_get_mscale(*factor, all);
        softmax_scale *= mscale * mscale;
    }
    let mla = MlaConfig {
        q_lora_rank: fields.opt_usize("q_lora_rank")?,
        kv_lora_rank: fields.usize("kv_lora_rank")?,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: v,
        softmax_scale,
    };
    // DeepSeek's checkpoints keep the RoPE dimensions in adjacent pairs (transformers' default).
    let interleaved = fields.opt_bool("rope_interleave")?.unwrap_or(true);
    set_mla(config, mla, interleaved);
    config.mtp_layers = fields.opt_usize("num_nextn_predict_layers")?.unwrap_or(0);
    let experts = fields.usize("n_routed_experts")?;
    let top_k = fields.usize("num_experts_per_tok")?;
    if top_k > experts {
        return Err(fields.err(format!(
            "`num_experts_per_tok` {top_k} exceeds the {experts} experts"
        )));
    }
    let moe_intermediate = fields.usize("moe_intermediate_size")?;
    let dense = fields.opt_usize("first_k_dense_replace")?.unwrap_or(0);
    let groups = match (
        fields.opt_usize("n_group")?,
        fields.opt_usize("topk_group")?,
    ) {
        (Some(g), Some(k)) if g > 1 => {
            if !experts.is_multiple_of(g) || k > g {
                return Err(fields.err(format!(
                    "`n_group` {g} / `topk_group` {k} do not divide the {experts} experts"
                )));
            }
            Some((g, k))
        }
        _ => None,
    };
    config.moe = Some(MoeConfig {
        num_experts: experts,
        top_k,
        intermediate_size: moe_intermediate,
        normalize: fields.opt_bool("norm_topk_prob")?.unwrap_or(true),
        sparse_layers: (0..config.num_hidden_layers).map(|i| i >= dense).collect(),
        naming: ExpertNaming::Qwen,
        sigmoid: Some(SigmoidRouting {
            groups,
            scale: fields.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
        }),
        shared_intermediate_size: fields
            .opt_usize("n_shared_experts")?
            .map(|n| n * moe_intermediate),
        shared_gated: false,
    });
    Ok(())
}

/// The cached head (`rope + kv_lora_rank`, one KV head) and RoPE width for `mla`.
fn set_mla(config: &mut ModelConfig, mla: MlaConfig, interleaved: bool) {
    config.head_dim = Mla::cache_head_dim(&mla);
    config.num_key_value_heads = 1;
    config.partial_rotary_factor = mla.qk_rope_head_dim as f64 / config.head_dim as f64;
    config.mla = Some(mla);
    if interleaved {
        config.rope_style = peregrine_tensor::RopeStyle::Interleaved;
    }
}

/// DeepSeek-V2/V3 from GGUF (`deepseek2`), as llama.cpp's converter writes it: the MLA widths
/// under `attention.*_mla` and `kv_lora_rank`, RoPE over `rope.dimension_count` in adjacent
/// pairs, YaRN's `mscale_all_dim` as `rope.scaling.yarn_log_multiplier` (times 0.1) moved into
/// the score scale, the routing as `expert_gating_func` (absent: softmax, llama.cpp's rule for
/// older files), `expert_group_count` / `_used_count`, `expert_weights_scale` / `_norm`,
/// `leading_dense_block_count` and `expert_shared_count`.
pub(crate) fn configure_gguf(meta: &GgufMeta, config: &mut ModelConfig) -> Result<()> {
    let rope = meta.usize("rope.dimension_count")?;
    let qk = meta.usize("attention.key_length_mla")?;
    if qk <= rope {
        return Err(meta.err(
            "attention.key_length_mla",
            "must exceed rope.dimension_count",
        ));
    }
    let mut softmax_scale = (qk as f64).powf(-0.5);
    if let RopeScaling::Yarn {
        factor,
        attention_factor,
        ..
    } = &mut config.rope_scaling
        && let Some(log_mul) = meta.opt_f64("rope.scaling.yarn_log_multiplier")?
    {
        // In f32, as llama.cpp undoes the converter's 0.1 (the key is an f32).
        let mscale_all_dim = (log_mul as f32 / 0.1f32) as f64;
        let mscale = yarn_get_mscale(*factor, mscale_all_dim);
        softmax_scale *= mscale * mscale;
        // transformers' `mscale / mscale_all_dim` ratio, which llama.cpp takes to be 1.
        *attention_factor = 1.0;
    }
    let mla = MlaConfig {
        q_lora_rank: meta.opt_usize("attention.q_lora_rank")?,
        kv_lora_rank: meta.usize("attention.kv_lora_rank")?,
        qk_nope_head_dim: qk - rope,
        qk_rope_head_dim: rope,
        v_head_dim: meta.usize("attention.value_length_mla")?,
        softmax_scale,
    };
    set_mla(config, mla, true);
    let layers = config.num_hidden_layers;
    let Some(moe) = &mut config.moe else {
        return Ok(());
    };
    let dense = meta.opt_usize("leading_dense_block_count")?.unwrap_or(0);
    moe.sparse_layers = (0..layers).map(|i| i >= dense).collect();
    moe.normalize = meta.opt_bool("expert_weights_norm")?.unwrap_or(false);
    moe.shared_intermediate_size = match meta.opt_usize("expert_shared_count")? {
        Some(n) if n > 0 => Some(n * moe.intermediate_size),
        _ => None,
    };
    let scale = meta.opt_f64("expert_weights_scale")?.unwrap_or(1.0) as f32;
    let groups = match (
        meta.opt_usize("expert_group_count")?,
        meta.opt_usize("expert_group_used_count")?,
    ) {
        (Some(g), Some(k)) if g > 1 => Some((g, k)),
        _ => None,
    };
    match meta.opt_usize("expert_gating_func")? {
        Some(2) => moe.sigmoid = Some(SigmoidRouting { groups, scale }),
        None | Some(1) if groups.is_none() && scale == 1.0 => moe.sigmoid = None,
        other => {
            let what = format!(
                "{other:?}: only sigmoid routing (2), or softmax (1) without expert groups or \
                 a weights scale, is supported"
            );
            return Err(meta.err("expert_gating_func", &what));
        }
    }
    Ok(())
}
