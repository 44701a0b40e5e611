//! Qwen3-MoE: Qwen3 (q/k norm) with routed experts in place of the MLP on the sparse layers.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_moe/modeling_qwen3_moe.py>
//!
//! Softmax top-k routing, renormalised when `norm_topk_prob`; layer `i` is sparse unless it is
//! in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`. No shared expert.

use crate::config::{ExpertNaming, Fields, MoeConfig};
use crate::{ModelConfig, Result};

/// Qwen3's flags plus the MoE block (transformers' default `norm_topk_prob` is false).
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    super::qwen3::configure(fields, config)?;
    config.moe = Some(MoeConfig::from_hf(
        fields,
        config,
        ExpertNaming::Qwen,
        false,
    )?);
    Ok(())
}
