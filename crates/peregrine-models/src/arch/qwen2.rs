//! Qwen2 / Qwen2.5: llama with q/k/v biases and (usually) tied embeddings.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2/modeling_qwen2.py>

use crate::config::Fields;
use crate::{ModelConfig, ModelError, Result};

/// q/k/v always carry biases; the optional per-layer sliding window is not supported yet.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    config.attention_bias = true;
    if fields.opt_bool("use_sliding_window")?.unwrap_or(false) {
        return Err(ModelError::config(
            "config.json",
            "qwen2 with `use_sliding_window: true` is not supported yet",
        ));
    }
    Ok(())
}
