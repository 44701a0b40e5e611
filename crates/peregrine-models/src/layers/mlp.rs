//! The gated (SwiGLU) MLP: `down(silu(gate(x)) * up(x))`.

use peregrine_tensor::ops::silu_mul;
use peregrine_tensor::{QLinear, Tensor};

use crate::weights::Weights;
use crate::{ModelConfig, Result};

/// A gated MLP.
pub struct GatedMlp {
    gate_proj: QLinear,
    up_proj: QLinear,
    down_proj: QLinear,
}

impl GatedMlp {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            gate_proj: w.linear(&format!("{prefix}.gate_proj"), i, h, false)?,
            up_proj: w.linear(&format!("{prefix}.up_proj"), i, h, false)?,
            down_proj: w.linear(&format!("{prefix}.down_proj"), h, i, false)?,
        })
    }

    /// `x: [.., hidden]` → `[.., hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let act = silu_mul(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?;
        Ok(self.down_proj.forward(&act)?)
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .map(|l| l.weight_bytes())
            .sum()
    }
}
