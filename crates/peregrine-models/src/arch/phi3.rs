//! Phi-3 / Phi-3.5 / Phi-4-mini: llama with fused projections, partial rotary and LongRoPE.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/phi3/modeling_phi3.py>
//!
//! What differs from llama, and where it is handled:
//! - `self_attn.qkv_proj` (rows `[q; k; v]`) and `mlp.gate_up_proj` (rows `[gate; up]`) are split
//!   by rows at load (`Weights::linear_rows`, for dense, MLX and GGUF files alike; GGUF calls them
//!   `attn_qkv` and `ffn_up`), so the llama-family decoder runs them unchanged.
//! - `partial_rotary_factor` (in `rope_parameters` or at the top level): RoPE rotates the first
//!   `int(head_dim · factor)` dimensions of each head; read generically by `ModelConfig::from_hf`.
//! - `longrope` scaling (`rope_scaling` / `rope_parameters`, legacy type `su`): per-pair
//!   `short_factor` / `long_factor`, cos/sin times `attention_factor`; chosen per rotation by the
//!   sequence length it reaches, as transformers chooses (see `RopeScaling::LongRope`).
//! - `sliding_window` (Phi-3-mini-4k: 2047): every layer, as Mistral.

use std::path::Path;

use peregrine_tensor::RopeScaling;

use crate::config::{Fields, longrope_attention_factor};
use crate::{ModelConfig, ModelError, Result};

/// Mistral's optional sliding window; only the SiLU activation that every Phi-3 uses.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    super::mistral::configure(fields, config)?;
    match fields.opt_str("hidden_act")? {
        None | Some("silu") => Ok(()),
        Some(other) => Err(fields.err(format!(
            "phi3 with `hidden_act` `{other}` is not supported (only `silu`)"
        ))),
    }
}

/// A `phi3` GGUF file (llama.cpp's converter): `rope_factors_short` / `rope_factors_long`
/// tensors (`factors`) with `rope.scaling.original_context_length` and
/// `rope.scaling.attn_factor` (`scaling`) make LongRoPE, picked by sequence length as for HF
/// checkpoints (llama.cpp picks once, by the context size it was started with); a
/// `sliding_window` of 0 (how the converter writes "none") is no window. A non-zero window
/// (Phi-3-mini-4k: 2047) is applied, as transformers applies it; llama.cpp currently ignores
/// Phi-3's window, so the two differ on sequences longer than it.
pub fn configure_gguf(
    config: &mut ModelConfig,
    file: &Path,
    factors: (Option<Vec<f32>>, Option<Vec<f32>>),
    (original, attention_factor): (Option<usize>, Option<f64>),
) -> Result<()> {
    if config.sliding_window == Some(0) {
        config.sliding_window = None;
    }
    let (short, long) = match factors {
        (None, None) => return Ok(()),
        (Some(short), Some(long)) => (short, long),
        _ => {
            return Err(ModelError::config(
                file,
                "LongRoPE needs both `rope_factors_short` and `rope_factors_long`",
            ));
        }
    };
    let original = original.ok_or_else(|| {
        ModelError::config(
            file,
            "metadata `phi3.rope.scaling.original_context_length` is missing (LongRoPE factors \
             are present)",
        )
    })?;
    let factor = config.max_position_embeddings as f64 / original as f64;
    let attention_factor =
        attention_factor.unwrap_or_else(|| longrope_attention_factor(factor, original));
    let widen = |v: Vec<f32>| v.into_iter().map(f64::from).collect();
    config.rope_scaling = RopeScaling::LongRope {
        short_factor: widen(short),
        long_factor: widen(long),
        original_max_position_embeddings: original,
        attention_factor,
    };
    Ok(())
}
