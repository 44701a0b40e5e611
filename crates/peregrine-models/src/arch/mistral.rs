//! Mistral: llama with an optional sliding window on every layer.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/mistral/modeling_mistral.py>

use crate::config::Fields;
use crate::{ModelConfig, Result};

/// Reads `sliding_window` (null or absent: full attention).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    config.sliding_window = fields.opt_usize("sliding_window")?;
    Ok(())
}
