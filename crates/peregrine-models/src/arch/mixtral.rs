//! Mixtral: Mistral with every MLP replaced by routed experts (`block_sparse_moe`).
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/mixtral/modeling_mixtral.py>
//!
//! Softmax top-k routing, always renormalised over the chosen experts; experts are
//! `w1` (gate), `w3` (up), `w2` (down).

use crate::config::{ExpertNaming, Fields, MoeConfig};
use crate::{ModelConfig, Result};

/// Mistral's sliding window plus the MoE block on every layer.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    super::mistral::configure(fields, config)?;
    config.moe = Some(MoeConfig::from_hf(
        fields,
        config,
        ExpertNaming::Mixtral,
        true,
    )?);
    Ok(())
}
