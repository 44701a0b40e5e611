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

use crate::config::Fields;
use crate::{ModelConfig, Result};

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
