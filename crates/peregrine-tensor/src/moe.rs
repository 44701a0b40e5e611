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

/// The routing of `n` tokens grouped by expert, as the `moe_*_grouped` kernels read it (i32
/// words): each expert's offset into the positions (`experts + 1`), the token at each position,
/// each choice's position (`-1`: unused) and each choice's weight (f32 bits); positions keep
/// the tokens' order within an expert.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn grouped(experts: usize, n: usize, ids: &[usize], weights: &[f32]) -> Vec<i32> {
    let (slots, k) = (ids.len(), ids.len() / n.max(1));
    let mut offsets = vec![0i32; experts + 1];
    for &e in ids.iter().filter(|&&e| e < experts) {
        offsets[e + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    let mut next = offsets[..experts].to_vec();
    let (mut tokens, mut pos) = (vec![0i32; slots], vec![-1i32; slots]);
    for (s, &e) in ids.iter().enumerate().filter(|&(_, &e)| e < experts) {
        let p = next[e];
        next[e] += 1;
        tokens[p as usize] = (s / k) as i32;
        pos[s] = p;
    }
    let bits = weights.iter().map(|w| w.to_bits() as i32);
    (offsets.into_iter().chain(tokens).chain(pos).chain(bits)).collect()
}

#[cfg(test)]
mod tests {
    use super::grouped;

    /// Three tokens, two choices each, over four experts (token 1's second choice unused):
    /// positions run expert by expert in token order, each choice finds its position.
    #[test]
    fn routing_groups_by_expert_in_token_order() {
        let ids = [2, 0, 0, usize::MAX, 2, 3];
        let weights = [0.6, 0.4, 1.0, 0.0, 0.7, 0.3];
        let words = grouped(4, 3, &ids, &weights);
        let (offsets, rest) = words.split_at(5);
        let (tokens, rest) = rest.split_at(6);
        let (pos, bits) = rest.split_at(6);
        assert_eq!(offsets, [0, 2, 2, 4, 5]);
        assert_eq!(&tokens[..5], [0, 1, 0, 2, 2]);
        assert_eq!(pos, [2, 0, 1, -1, 3, 4]);
        let back: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b as u32)).collect();
        assert_eq!(back, weights);
    }
}
