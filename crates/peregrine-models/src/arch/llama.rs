//! Llama (1/2/3/3.1 incl. llama3 RoPE scaling; SmolLM2 is llama):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama/modeling_llama.py>
//! The reference decoder: everything is read generically by `ModelConfig::from_hf`.

use crate::config::Fields;
use crate::{ModelConfig, Result};

/// Llama needs nothing beyond the shared fields (`attention_bias` is read there).
pub fn configure(_fields: &Fields, _config: &mut ModelConfig) -> Result<()> {
    Ok(())
}
