//! The gated MLP: `down(act(gate(x)) * up(x))`, SiLU (SwiGLU) or GELU-tanh (GeGLU, Gemma).
//! Dense layers and every MoE expert are one.

use peregrine_tensor::linear::LinearScratch;
use peregrine_tensor::ops::{Gate, gelu_mul, silu_mul};
use peregrine_tensor::{QLinear, Tensor};

use crate::config::Activation;
use crate::layers::step::StepBuffers;
use crate::weights::Weights;
use crate::{ModelConfig, Result};

/// A gated MLP.
pub struct GatedMlp {
    gate_proj: QLinear,
    up_proj: QLinear,
    down_proj: QLinear,
    activation: Activation,
    intermediate: usize,
}

impl GatedMlp {
    /// Loads `{prefix}.{gate,up,down}_proj` of the config's `intermediate_size`.
    pub fn load(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self::new(
            w.linear(&format!("{prefix}.gate_proj"), i, h, false)?,
            w.linear(&format!("{prefix}.up_proj"), i, h, false)?,
            w.linear(&format!("{prefix}.down_proj"), h, i, false)?,
            c.activation,
        ))
    }

    /// [`load`](Self::load) for checkpoints that fuse gate and up into one
    /// `{prefix}.gate_up_proj` (Phi-3: rows `[gate; up]`), split by rows at load
    /// ([`Weights::linear_rows`]).
    pub fn load_fused(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let gate_up = w.linear_rows(&format!("{prefix}.gate_up_proj"), &[i, i], h, false)?;
        let Ok([gate, up]) = <[QLinear; 2]>::try_from(gate_up) else {
            unreachable!("two parts, two layers")
        };
        let down = w.linear(&format!("{prefix}.down_proj"), h, i, false)?;
        Ok(Self::new(gate, up, down, c.activation))
    }

    /// An MLP from its three projections (`gate`, `up`: `[i, hidden]`, `down`: `[hidden, i]`).
    pub fn new(gate: QLinear, up: QLinear, down: QLinear, activation: Activation) -> Self {
        let intermediate = match &down {
            QLinear::Dense { w, .. } => w.dims().last().copied().unwrap_or(0),
            QLinear::Gguf { w, .. } => w.dims().1,
            QLinear::MlxAffine { w, .. } => w.dims().1,
        };
        Self {
            gate_proj: gate,
            up_proj: up,
            down_proj: down,
            activation,
            intermediate,
        }
    }

    /// `[gate, up, down]` when the activation is SiLU (what GPU expert tables take).
    pub fn silu_parts(&self) -> Option<[&QLinear; 3]> {
        (self.activation == Activation::Silu).then_some([
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ])
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

    /// [`forward`](Self::forward) over a decode step's buffers: reads `b.normed` (`b.rows`
    /// rows), leaves the output in `b.out`.
    pub fn step(&self, b: &mut StepBuffers) -> Result<()> {
        let StepBuffers {
            rows,
            normed,
            out,
            gate,
            up,
            linear,
            ..
        } = b;
        self.rows_into(normed, *rows, (gate, up), out, linear)
    }

    /// One row `x` (`[hidden]`) into `out` (`[hidden]`), with `gate` and `up` (at least
    /// `intermediate` long) as scratch: allocates nothing on Peregrine's kernels.
    pub fn row_into(
        &self,
        x: &[f32],
        gate: &mut [f32],
        up: &mut [f32],
        out: &mut [f32],
        linear: &mut LinearScratch,
    ) -> Result<()> {
        self.rows_into(x, 1, (gate, up), out, linear)
    }

    /// [`row_into`](Self::row_into) for `rows` rows (`x` and `out` `[rows, hidden]`, the
    /// scratch at least `rows · intermediate` long).
    fn rows_into(
        &self,
        x: &[f32],
        rows: usize,
        (gate, up): (&mut [f32], &mut [f32]),
        out: &mut [f32],
        linear: &mut LinearScratch,
    ) -> Result<()> {
        let n = rows * self.intermediate;
        let (gate, up) = (&mut gate[..n], &mut up[..n]);
        let gate_up = [&self.gate_proj, &self.up_proj];
        QLinear::forward_rows_into(&gate_up, x, rows, &mut [&mut *gate, &mut *up], linear)?;
        let act = match self.activation {
            Activation::Silu => Gate::Silu,
            Activation::GeluTanh => Gate::GeluTanh,
        };
        act.apply_in_place(gate, up);
        QLinear::forward_rows_into(&[&self.down_proj], gate, rows, &mut [out], linear)?;
        Ok(())
    }

    /// Whether all three projections multiply a mapped file's pages where they lie (a
    /// streamed GGUF expert of a format the kernels take in place).
    pub fn is_mapped(&self) -> bool {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .all(|l| matches!(l, QLinear::Gguf { w, .. } if w.is_shared()))
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .map(|l| l.weight_bytes())
            .sum()
    }
}
