//! Multi-head attention with grouped-query heads, optional q/k/v biases and q/k RMSNorm, and
//! optionally soft-capped scores (Gemma 2).

use peregrine_kv::{AttnParams, LayerCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{QLinear, RotaryEmbedding, Tensor};

use crate::layers::norm_weight;
use crate::layers::step::{StepBuffers, norm_rows_in_place};
use crate::weights::Weights;
use crate::{ModelConfig, Result};

/// Self-attention of one decoder layer.
pub struct Attention {
    q_proj: QLinear,
    k_proj: QLinear,
    v_proj: QLinear,
    o_proj: QLinear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
    softcap: Option<f32>,
    eps: f32,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj` (and `{q,k}_norm` when the config asks for them).
    pub fn load(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let bias = c.attention_bias;
        let qkv = [
            w.linear(&format!("{prefix}.q_proj"), q_dim, h, bias)?,
            w.linear(&format!("{prefix}.k_proj"), kv_dim, h, bias)?,
            w.linear(&format!("{prefix}.v_proj"), kv_dim, h, bias)?,
        ];
        Self::from_projections(c, w, prefix, qkv)
    }

    /// [`load`](Self::load) for checkpoints that fuse q, k and v into one `{prefix}.qkv_proj`
    /// (Phi-3: rows `[q; k; v]`), split by rows at load ([`Weights::linear_rows`]).
    pub fn load_fused(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let parts = [q_dim, kv_dim, kv_dim];
        let qkv = w.linear_rows(&format!("{prefix}.qkv_proj"), &parts, h, c.attention_bias)?;
        let Ok(qkv) = <[QLinear; 3]>::try_from(qkv) else {
            unreachable!("three parts, three layers")
        };
        Self::from_projections(c, w, prefix, qkv)
    }

    /// The layer from its q, k and v projections; `{prefix}.o_proj` and the q/k norms (when
    /// the config asks for them) are loaded.
    pub fn from_projections(
        c: &ModelConfig,
        w: &Weights,
        prefix: &str,
        [q_proj, k_proj, v_proj]: [QLinear; 3],
    ) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let q_dim = c.num_attention_heads * hd;
        let norm = |name: &str| -> Result<Option<Tensor>> {
            c.qk_norm
                .then(|| norm_weight(c, w, &format!("{prefix}.{name}.weight"), hd))
                .transpose()
        };
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj: w.linear(&format!("{prefix}.o_proj"), h, q_dim, false)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: hd,
            scale: c.query_pre_attn_scalar.unwrap_or(hd as f64).powf(-0.5),
            softcap: c.attn_logit_softcapping.map(|cap| cap as f32),
            eps: c.rms_norm_eps as f32,
        })
    }

    /// `x: [1, n, hidden]` at positions `start..start + n` → `[1, n, hidden]`.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        start: usize,
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        // [b, n, heads * hd] → [b, heads, n, hd]
        let split = |t: Tensor, heads: usize, norm: &Option<Tensor>| -> Result<Tensor> {
            let t = t.reshape((b, n, heads, self.head_dim))?;
            let t = match norm {
                Some(w) => rms_norm(&t, w, self.eps)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?)
        };
        let qkv = QLinear::forward_group(&[&self.q_proj, &self.k_proj, &self.v_proj], x)?;
        let [q, k, v]: [Tensor; 3] = qkv.try_into().expect("three layers in, three out");
        let q = split(q, self.heads, &self.q_norm)?;
        let k = split(k, self.kv_heads, &self.k_norm)?;
        let v = split(v, self.kv_heads, &None)?;
        let q = rope.apply(&q, start)?;
        let k = rope.apply(&k, start)?;
        cache.append(&k, &v)?;
        let params = self.params();
        let y = cache.attend(&q, &params)?; // [b, heads, n, hd]
        let y = y
            .transpose(1, 2)?
            .reshape((b, n, self.heads * self.head_dim))?;
        Ok(self.o_proj.forward(&y)?)
    }

    /// [`forward`](Self::forward) for one token at `pos` over a decode step's buffers: reads
    /// `b.normed`, leaves the projected output in `b.out`.
    pub fn step(
        &self,
        b: &mut StepBuffers,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        pos: usize,
    ) -> Result<()> {
        let StepBuffers {
            normed,
            out,
            q,
            k,
            v,
            attn,
            linear,
            attention,
            ..
        } = b;
        let qkv = [&self.q_proj, &self.k_proj, &self.v_proj];
        QLinear::forward_group_into(&qkv, normed, &mut [q, k, v], linear)?;
        if let Some(w) = &self.q_norm {
            norm_rows_in_place(q, w, self.eps)?;
        }
        if let Some(w) = &self.k_norm {
            norm_rows_in_place(k, w, self.eps)?;
        }
        rope.apply_rows_in_place(q, pos)?;
        rope.apply_rows_in_place(k, pos)?;
        cache.append_row(k, v, self.head_dim)?;
        let params = self.params();
        cache.attend_row(q, self.head_dim, &params, attn, attention)?;
        QLinear::forward_group_into(&[&self.o_proj], attn, &mut [out], linear)?;
        Ok(())
    }

    fn params(&self) -> AttnParams {
        AttnParams {
            scale: self.scale,
            softcap: self.softcap,
        }
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .iter()
            .map(|l| l.weight_bytes())
            .sum()
    }
}
