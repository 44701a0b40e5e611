//! The gated MLP: `down(act(gate(x)) * up(x))`, SiLU (SwiGLU) or GELU-tanh (GeGLU, Gemma).

use peregrine_tensor::ops::{gelu_mul, silu_mul};
use peregrine_tensor::{QLinear, Tensor};

use crate::config::Activation;
use crate::weights::Weights;
use crate::{ModelConfig, Result};

/// A gated MLP.
pub struct GatedMlp {
    gate_proj: QLinear,
    up_proj: QLinear,
    down_proj: QLinear,
    activation: Activation,
}

impl GatedMlp {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            gate_proj: w.linear(&format!("{prefix}.gate_proj"), i, h, false)?,
            up_proj: w.linear(&format!("{prefix}.up_proj"), i, h, false)?,
            down_proj: w.linear(&format!("{prefix}.down_proj"), h, i, false)?,
            activation: c.activation,
        })
    }

    /// `x: [.., hidden]` → `[.., hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = QLinear::forward_group(&[&self.gate_proj, &self.up_proj], x)?
            .try_into()
            .expect("two layers in, two out");
        let act = match self.activation {
            Activation::Silu => silu_mul(&gate, &up)?,
            Activation::GeluTanh => gelu_mul(&gate, &up)?,
        };
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
