//! A MoE layer's routed experts for a few tokens on the GPU in two launches
//! (`kernels/cuda/moe_gemv.cu`): every expert's matrices addressed from tables on the device,
//! where running each routed expert as separate products costs a dozen launches and two
//! uploads an expert. The experts' reference is their own [`QLinear`] products.

use candle_core::{Result, Tensor};

use crate::QLinear;

/// Every expert of one MoE layer (SiLU-gated MLPs), addressed from tables on a CUDA device.
pub struct ExpertTables {
    #[cfg(feature = "cuda")]
    inner: crate::moe_cuda::Tables,
}

impl ExpertTables {
    /// Most tokens [`forward`](Self::forward) takes one choice at a time (each routed
    /// expert's rows read once a choice, two launches); more are grouped by expert (each
    /// expert's rows read once for all its tokens, three launches and a larger upload).
    pub const MAX_TOKENS: usize = 8;

    /// Tables of `experts` (`[gate, up, down]` each, `gate`/`up` `[inter, hidden]`, `down`
    /// `[hidden, inter]`), when every matrix is an unbiased GGUF Q4_K or Q6_K matrix on one
    /// CUDA device (gate and up of one format, down of one), `inter` and `hidden` multiples of
    /// 256; `None` otherwise (and always without the `cuda` feature).
    pub fn new(experts: &[[&QLinear; 3]]) -> Result<Option<Self>> {
        #[cfg(feature = "cuda")]
        return Ok(crate::moe_cuda::Tables::new(experts)?.map(|inner| Self { inner }));
        #[cfg(not(feature = "cuda"))]
        {
            let _ = experts;
            Ok(None)
        }
    }

    /// `x: [n, hidden]` (bf16 or f16, on the tables' device) → `[n, hidden]` in `x`'s dtype:
    /// row `t` is `Σ_j weights[t·k + j] · down(silu(gate x_t) · up x_t)` of expert
    /// `ids[t·k + j]`, `k = ids.len() / n`; an id past the experts marks an unused choice.
    pub fn forward(&self, x: &Tensor, ids: &[usize], weights: &[f32]) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        return self.inner.forward(x, ids, weights);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (x, ids, weights);
            candle_core::bail!("expert tables: built without the cuda feature")
        }
    }

    /// [`forward`](Self::forward) routed on the device from the router's `logits` `[n,
    /// experts]`, as Mixtral and Qwen-MoE route: softmax over the experts, the `k` best (the
    /// first of equal scores), renormalised to sum to 1 when `normalize`, times `scale`; no
    /// upload and no wait for the host.
    pub fn forward_routed(
        &self,
        x: &Tensor,
        logits: &Tensor,
        k: usize,
        (normalize, scale): (bool, f32),
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        return self.inner.forward_routed(x, logits, k, (normalize, scale));
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (x, logits, k, normalize, scale);
            candle_core::bail!("expert tables: built without the cuda feature")
        }
    }
}
