//! Building blocks shared by the architectures.

pub mod attention;
pub mod decoder;
pub mod mlp;

use peregrine_tensor::Tensor;

use crate::weights::Weights;
use crate::{ModelConfig, Result};

/// The RMSNorm weight `name` `[dim]`, with the config's `norm_weight_offset` folded in
/// (Gemma's `1 + w` becomes a plain `w` here, so every norm runs the same `rms_norm`).
pub fn norm_weight(c: &ModelConfig, w: &Weights, name: &str, dim: usize) -> Result<Tensor> {
    let t = w.tensor(name, &[dim])?;
    if c.norm_weight_offset == 0.0 {
        return Ok(t);
    }
    Ok((t + c.norm_weight_offset)?)
}
