//! Qwen3: llama with per-head RMSNorm on q and k before RoPE.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3/modeling_qwen3.py>

use crate::config::Fields;
use crate::{ModelConfig, ModelError, Result};

/// Turns on q/k norm; the optional per-layer sliding window is not supported yet.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    config.qk_norm = true;
    if fields.opt_bool("use_sliding_window")?.unwrap_or(false) {
        return Err(ModelError::config(
            "config.json",
            "qwen3 with `use_sliding_window: true` is not supported yet",
        ));
    }
    Ok(())
}
