//! Multi-head latent attention (DeepSeek-V2/V3), as transformers' `DeepseekV3Attention`.
//!
//! Queries come from `q_proj` or the bottleneck `q_a_proj` → `q_a_layernorm` → `q_b_proj`; keys
//! and values from one latent: `kv_a_proj_with_mqa` gives the compressed `kv_lora_rank` latent
//! (normed by `kv_a_layernorm`, decompressed by `kv_b_proj` into per-head `k_nope` and `v`) and
//! a `qk_rope_head_dim` RoPE key shared by every head.
//!
//! This version caches the *decompressed* per-head keys and values in the ordinary
//! [`LayerCache`]: each head is laid out `[rope | nope]` (the dot product does not care about
//! the order, and RoPE then rotates the first `qk_rope_head_dim` dimensions of each head, as a
//! partial rotary embedding), values are zero-padded to the key width (zeros add nothing to the
//! weighted sum) and cut back after attention. It does not yet cache the compressed latent nor
//! use the absorbed (`kv_b_proj` folded into q and o) form, so the KV cache costs
//! `2 · heads · (nope + rope)` per position, not `kv_lora_rank + rope`.
//!
//! `rope_interleave` (DeepSeek's checkpoints): transformers rotates adjacent pairs and writes the
//! results de-interleaved; [`RopeStyle::Interleaved`] rotates the same pairs and keeps them in
//! place, which changes the layout of q and k alike and so no score.

use peregrine_kv::{AttnParams, LayerCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{QLinear, RotaryEmbedding, Tensor};

use crate::config::MlaConfig;
use crate::layers::norm_weight;
use crate::layers::step::{MlaBuffers, StepBuffers, norm_rows_in_place};
use crate::weights::Weights;
use crate::{ModelConfig, Result};

/// Where the queries come from.
enum QueryPath {
    /// `q_proj`.
    Direct(QLinear),
    /// `q_a_proj`, `q_a_layernorm`, `q_b_proj`.
    LowRank {
        q_a: QLinear,
        norm: Tensor,
        q_b: QLinear,
    },
}

/// One layer's multi-head latent attention.
pub struct Mla {
    q: QueryPath,
    kv_a: QLinear,
    kv_a_norm: Tensor,
    kv_b: QLinear,
    o_proj: QLinear,
    heads: usize,
    m: MlaConfig,
    eps: f32,
}

impl Mla {
    /// Loads `{prefix}.*` for the config's MLA shapes.
    pub fn load(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let m = c.mla.clone().expect("an MLA config");
        let (h, heads, bias) = (c.hidden_size, c.num_attention_heads, c.attention_bias);
        let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
        let name = |n: &str| format!("{prefix}.{n}");
        let q = match m.q_lora_rank {
            None => QueryPath::Direct(w.linear(&name("q_proj"), heads * qk, h, false)?),
            Some(r) => QueryPath::LowRank {
                q_a: w.linear(&name("q_a_proj"), r, h, bias)?,
                norm: norm_weight(c, w, &name("q_a_layernorm.weight"), r)?,
                q_b: w.linear(&name("q_b_proj"), heads * qk, r, false)?,
            },
        };
        let kvl = m.kv_lora_rank;
        Ok(Self {
            q,
            kv_a: w.linear(
                &name("kv_a_proj_with_mqa"),
                kvl + m.qk_rope_head_dim,
                h,
                bias,
            )?,
            kv_a_norm: norm_weight(c, w, &name("kv_a_layernorm.weight"), kvl)?,
            kv_b: w.linear(
                &name("kv_b_proj"),
                heads * (m.qk_nope_head_dim + m.v_head_dim),
                kvl,
                false,
            )?,
            o_proj: w.linear(&name("o_proj"), h, heads * m.v_head_dim, bias)?,
            heads,
            m,
            eps: c.rms_norm_eps as f32,
        })
    }

    /// Width of a cached head: the key's `nope + rope` (values are padded to it).
    pub fn cache_head_dim(&self) -> usize {
        self.m.qk_nope_head_dim + self.m.qk_rope_head_dim
    }

    fn params(&self) -> AttnParams {
        AttnParams::scaled(self.m.softmax_scale)
    }

    /// `x: [1, n, hidden]` at positions `start..start + n` → `[1, n, hidden]`. `rope` rotates
    /// the first `qk_rope_head_dim` of each `nope + rope`-wide head.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        start: usize,
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let m = &self.m;
        let (nope, rd, vd, heads) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            self.heads,
        );
        let width = nope + rd;
        let (q, kv_a) = match &self.q {
            QueryPath::Direct(q_proj) => {
                let [q, kv_a]: [Tensor; 2] = QLinear::forward_group(&[q_proj, &self.kv_a], x)?
                    .try_into()
                    .expect("two layers in, two out");
                (q, kv_a)
            }
            QueryPath::LowRank { q_a, norm, q_b } => {
                let [q_a, kv_a]: [Tensor; 2] = QLinear::forward_group(&[q_a, &self.kv_a], x)?
                    .try_into()
                    .expect("two layers in, two out");
                (q_b.forward(&rms_norm(&q_a, norm, self.eps)?)?, kv_a)
            }
        };
        let q = q.reshape((b, n, heads, width))?;
        let q = Tensor::cat(&[q.narrow(3, nope, rd)?, q.narrow(3, 0, nope)?], 3)?;
        let q = q.transpose(1, 2)?.contiguous()?; // [b, heads, n, rope + nope]
        let latent = kv_a.narrow(2, 0, m.kv_lora_rank)?.contiguous()?;
        let latent = rms_norm(&latent, &self.kv_a_norm, self.eps)?;
        let k_pe = kv_a.narrow(2, m.kv_lora_rank, rd)?.unsqueeze(2)?; // [b, n, 1, rope]
        let kv = self
            .kv_b
            .forward(&latent)?
            .reshape((b, n, heads, nope + vd))?;
        let k_pe = k_pe.broadcast_as((b, n, heads, rd))?;
        let k = Tensor::cat(&[k_pe, kv.narrow(3, 0, nope)?], 3)?;
        let k = k.transpose(1, 2)?.contiguous()?;
        let v = kv.narrow(3, nope, vd)?;
        let v = match width > vd {
            true => {
                let pad = Tensor::zeros((b, n, heads, width - vd), v.dtype(), v.device())?;
                Tensor::cat(&[v, pad], 3)?
            }
            false => v,
        };
        let v = v.transpose(1, 2)?.contiguous()?;
        let q = rope.apply(&q, start)?;
        let k = rope.apply(&k, start)?;
        cache.append(&k, &v)?;
        let y = cache.attend(&q, &self.params())?; // [b, heads, n, width]
        let y = y.narrow(3, 0, vd)?.transpose(1, 2)?.contiguous()?;
        Ok(self.o_proj.forward(&y.reshape((b, n, heads * vd))?)?)
    }

    /// [`forward`](Self::forward) for one token at `pos` over a decode step's buffers: reads
    /// `b.normed`, leaves the projected output in `b.out`. Allocates nothing.
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
            mla,
            ..
        } = b;
        let MlaBuffers {
            q_a,
            kv_a,
            q: q_full,
            kv,
            o,
        } = mla;
        let m = &self.m;
        let (nope, rd, vd, kvl) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        let width = nope + rd;
        match &self.q {
            QueryPath::Direct(q_proj) => {
                let layers = [q_proj, &self.kv_a];
                QLinear::forward_group_into(&layers, normed, &mut [q_full, kv_a], linear)?;
            }
            QueryPath::LowRank { q_a: qa, norm, q_b } => {
                let layers = [qa, &self.kv_a];
                QLinear::forward_group_into(&layers, normed, &mut [q_a, kv_a], linear)?;
                norm_rows_in_place(q_a, norm, self.eps)?;
                QLinear::forward_group_into(&[q_b], q_a, &mut [q_full], linear)?;
            }
        }
        norm_rows_in_place(&mut kv_a[..kvl], &self.kv_a_norm, self.eps)?;
        QLinear::forward_group_into(&[&self.kv_b], &kv_a[..kvl], &mut [&mut kv[..]], linear)?;
        let heads = self.heads;
        let (q, k, v) = (
            &mut q[..heads * width],
            &mut k[..heads * width],
            &mut v[..heads * width],
        );
        for h in 0..heads {
            let (qh, src) = (&mut q[h * width..][..width], &q_full[h * width..][..width]);
            qh[..rd].copy_from_slice(&src[nope..]);
            qh[rd..].copy_from_slice(&src[..nope]);
            let kh = &mut k[h * width..][..width];
            let kvh = &kv[h * (nope + vd)..][..nope + vd];
            kh[..rd].copy_from_slice(&kv_a[kvl..kvl + rd]);
            kh[rd..].copy_from_slice(&kvh[..nope]);
            let vh = &mut v[h * width..][..width];
            vh[..vd].copy_from_slice(&kvh[nope..]);
            vh[vd..].fill(0.0);
        }
        rope.apply_rows_in_place(q, pos)?;
        rope.apply_rows_in_place(k, pos)?;
        cache.append_row(k, v, width)?;
        let attn = &mut attn[..heads * width];
        cache.attend_row(q, width, &self.params(), attn, attention)?;
        for h in 0..heads {
            o[h * vd..][..vd].copy_from_slice(&attn[h * width..][..vd]);
        }
        QLinear::forward_group_into(&[&self.o_proj], o, &mut [out], linear)?;
        Ok(())
    }

    /// Bytes of weights (norms excluded).
    pub fn weight_bytes(&self) -> usize {
        let q = match &self.q {
            QueryPath::Direct(q) => q.weight_bytes(),
            QueryPath::LowRank { q_a, q_b, .. } => q_a.weight_bytes() + q_b.weight_bytes(),
        };
        q + [&self.kv_a, &self.kv_b, &self.o_proj]
            .iter()
            .map(|l| l.weight_bytes())
            .sum::<usize>()
    }
}
