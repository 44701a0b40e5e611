//! Multi-head latent attention (DeepSeek-V2/V3), as transformers' `DeepseekV3Attention`, in the
//! absorbed form over a cache of the compressed latent.
//!
//! Queries come from `q_proj` or the bottleneck `q_a_proj` → `q_a_layernorm` → `q_b_proj`; keys
//! and values from one latent: `kv_a_proj_with_mqa` gives the compressed `kv_lora_rank` latent
//! `c` (normed by `kv_a_layernorm`) and a `qk_rope_head_dim` RoPE key shared by every head;
//! transformers decompresses `c` by `kv_b_proj` into per-head `k_nope = W_uk·c` and `v = W_uv·c`.
//!
//! Here `kv_b_proj` is never applied to the cache: `q_nope·(W_uk·c) = (W_ukᵀ·q_nope)·c`, so each
//! head's query is absorbed into latent space once, and `Σ p·(W_uv·c) = W_uv·(Σ p·c)`, so the
//! attended latent is expanded into the head's value after attention. Attention is then
//! multi-query over one `[latent | rope]`-wide key head per position, and the key is its own
//! value: the attended key's leading `kv_lora_rank` columns are the attended latent (the rest
//! is ignored). The cache stores only keys ([`LayerKind::FullKeysAsValues`]):
//! `kv_lora_rank + qk_rope_head_dim` values per position, not `2 · heads · (nope + rope)`.
//! RoPE turns the `qk_rope_head_dim` parts alone (the query's and the shared key's), before
//! they join their head.
//!
//! [`LayerKind::FullKeysAsValues`]: peregrine_kv::LayerKind::FullKeysAsValues
//!
//! `rope_interleave` (DeepSeek's checkpoints): transformers rotates adjacent pairs and writes the
//! results de-interleaved; [`RopeStyle::Interleaved`] rotates the same pairs and keeps them in
//! place, which changes the layout of q and k alike and so no score.
//!
//! [`RopeStyle::Interleaved`]: peregrine_tensor::RopeStyle::Interleaved

use peregrine_kv::{AttnParams, LayerCache, LayerKind};
use peregrine_tensor::ops::{rms_norm, with_f32};
use peregrine_tensor::{QLinear, RotaryEmbedding, Tensor};

use crate::config::MlaConfig;
use crate::layers::batch::{Segment, per_segment};
use crate::layers::decoder::SelfAttention;
use crate::layers::norm_weight;
use crate::layers::step::{MlaBuffers, StepBuffers, norm_rows_in_place};
use crate::weights::Weights;
use crate::{ModelConfig, ModelError, Result};

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
    /// `kv_b_proj`'s weight, dense, `[heads, nope + v, kv_lora_rank]`: per head the `nope` rows
    /// of `W_uk` (absorbed into the query) then the `v` rows of `W_uv` (expanding the output).
    kv_b: Tensor,
    o_proj: QLinear,
    heads: usize,
    m: MlaConfig,
    eps: f32,
}

impl Mla {
    /// `(qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank)`.
    fn widths(&self) -> (usize, usize, usize, usize) {
        let m = &self.m;
        (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
    }

    /// Width of the one cached key head: the latent then the shared RoPE key.
    pub fn cache_head_dim(m: &MlaConfig) -> usize {
        m.qk_rope_head_dim + m.kv_lora_rank
    }

    fn params(&self) -> AttnParams {
        AttnParams::scaled(self.m.softmax_scale)
    }

    /// `x: [b, n, hidden]` at positions `start..start + n` → `[b, n, hidden]`. `rope` turns
    /// `qk_rope_head_dim`-wide rows.
    fn forward_one(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        start: usize,
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let (nope, rd, vd, kvl) = self.widths();
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
        let q = q.reshape((b, n, self.heads, nope + rd))?.transpose(1, 2)?; // [b, heads, n, ·]
        let w_uk = self.kv_b.narrow(1, 0, nope)?; // [heads, nope, kvl]
        let q_nope = q.narrow(3, 0, nope)?.contiguous()?;
        let q_latent = q_nope.to_dtype(w_uk.dtype())?.broadcast_matmul(&w_uk)?;
        let q_pe = rope.apply(&q.narrow(3, nope, rd)?.contiguous()?, start)?;
        let q = Tensor::cat(&[q_latent.to_dtype(x.dtype())?, q_pe], 3)?.contiguous()?;
        let latent = kv_a.narrow(2, 0, kvl)?.contiguous()?;
        let latent = rms_norm(&latent, &self.kv_a_norm, self.eps)?.unsqueeze(1)?;
        let k_pe = rope.apply(&kv_a.narrow(2, kvl, rd)?.unsqueeze(1)?.contiguous()?, start)?;
        let k = Tensor::cat(&[&latent, &k_pe], 3)?; // [b, 1, n, kvl + rope]
        cache.append(&k, &k)?;
        let y = cache.attend(&q, &self.params())?; // [b, heads, n, kvl + rope]
        let w_uv = self.kv_b.narrow(1, nope, vd)?.transpose(1, 2)?; // [heads, kvl, v]
        let y = y.narrow(3, 0, kvl)?.to_dtype(w_uv.dtype())?.contiguous()?;
        let y = y.broadcast_matmul(&w_uv)?.to_dtype(x.dtype())?; // [b, heads, n, v]
        let y = y.transpose(1, 2)?.contiguous()?;
        Ok(self.o_proj.forward(&y.reshape((b, n, self.heads * vd))?)?)
    }
}

impl SelfAttention for Mla {
    /// Loads `model.layers.{layer}.self_attn.*` for the config's MLA shapes.
    fn load(c: &ModelConfig, w: &Weights, layer: usize) -> Result<Self> {
        let prefix = format!("model.layers.{layer}.self_attn");
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
        let (kvl, up) = (m.kv_lora_rank, m.qk_nope_head_dim + m.v_head_dim);
        let kv_b = match w.contains(&name("kv_b_proj.weight")) {
            true => w.tensor(&name("kv_b_proj.weight"), &[heads * up, kvl])?,
            // llama.cpp's converter splits it per head into `W_ukᵀ` and `W_uv`.
            false => {
                let (nope, v) = (m.qk_nope_head_dim, m.v_head_dim);
                let k_b = w.tensor(&name("k_b_proj.weight"), &[heads, kvl, nope])?;
                let v_b = w.tensor(&name("v_b_proj.weight"), &[heads, v, kvl])?;
                Tensor::cat(&[&k_b.transpose(1, 2)?, &v_b], 1)?.contiguous()?
            }
        };
        Ok(Self {
            q,
            kv_a: w.linear(
                &name("kv_a_proj_with_mqa"),
                kvl + m.qk_rope_head_dim,
                h,
                bias,
            )?,
            kv_a_norm: norm_weight(c, w, &name("kv_a_layernorm.weight"), kvl)?,
            kv_b: kv_b.reshape((heads, up, kvl))?,
            o_proj: w.linear(&name("o_proj"), h, heads * m.v_head_dim, bias)?,
            heads,
            m,
            eps: c.rms_norm_eps as f32,
        })
    }

    /// The query's and the shared key's RoPE parts, turned on their own.
    fn rope_dims(c: &ModelConfig) -> (usize, usize) {
        let rope = c.mla.as_ref().map_or(0, |m| m.qk_rope_head_dim);
        (rope, rope)
    }

    /// One `[latent | rope]` key per position, which is its own value.
    fn cache_kind(_: &ModelConfig, _: usize) -> LayerKind {
        LayerKind::FullKeysAsValues
    }

    /// `x: [1, rows, hidden]`, the stacked rows of `segments`, one sequence at a time.
    fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        segments: &mut [Segment],
    ) -> Result<Tensor> {
        per_segment(segments, x.device(), |rows, s| {
            self.forward_one(
                &x.narrow(1, rows.start, rows.len())?,
                rope,
                s.cache,
                s.start,
            )
        })
    }

    /// [`forward`](Self::forward) for one token at `pos` over a decode step's buffers: reads
    /// `b.normed`, leaves the projected output in `b.out`. Allocates nothing.
    fn step(
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
            q_pe,
            o,
        } = mla;
        let m = &self.m;
        let (nope, rd, vd, kvl) = self.widths();
        let width = Self::cache_head_dim(m);
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
        let heads = self.heads;
        let (q, k, attn) = (
            &mut q[..heads * width],
            &mut k[..width],
            &mut attn[..heads * width],
        );
        k.copy_from_slice(kv_a);
        rope.apply_rows_in_place(&mut k[kvl..], pos)?;
        for (h, pe) in q_pe.chunks_exact_mut(rd).enumerate() {
            pe.copy_from_slice(&q_full[h * (nope + rd) + nope..][..rd]);
        }
        rope.apply_rows_in_place(q_pe, pos)?;
        let up = nope + vd;
        with_f32(&self.kv_b, |w| {
            for h in 0..heads {
                let (qh, src) = (&mut q[h * width..][..width], &q_full[h * (nope + rd)..]);
                qh[kvl..].copy_from_slice(&q_pe[h * rd..][..rd]);
                // The head's query in latent space: Σ_i q_nope[i] · W_uk[i, :].
                let q_latent = &mut qh[..kvl];
                q_latent.fill(0.0);
                for (i, &qi) in src[..nope].iter().enumerate() {
                    let row = &w[(h * up + i) * kvl..][..kvl];
                    q_latent.iter_mut().zip(row).for_each(|(y, w)| *y += qi * w);
                }
            }
        })?
        .ok_or_else(not_f32)?;
        cache.append_row(k, k, width)?;
        cache.attend_row(q, width, &self.params(), attn, attention)?;
        with_f32(&self.kv_b, |w| {
            for h in 0..heads {
                // The head's value: W_uv · (the attended latent).
                let attended = &attn[h * width..][..kvl];
                for (d, y) in o[h * vd..][..vd].iter_mut().enumerate() {
                    let row = &w[(h * up + nope + d) * kvl..][..kvl];
                    *y = row.iter().zip(attended).map(|(w, a)| w * a).sum();
                }
            }
        })?
        .ok_or_else(not_f32)?;
        QLinear::forward_group_into(&[&self.o_proj], o, &mut [out], linear)?;
        Ok(())
    }

    /// Bytes of weights (norms excluded).
    fn weight_bytes(&self) -> usize {
        let q = match &self.q {
            QueryPath::Direct(q) => q.weight_bytes(),
            QueryPath::LowRank { q_a, q_b, .. } => q_a.weight_bytes() + q_b.weight_bytes(),
        };
        let kv_b = self.kv_b.elem_count() * self.kv_b.dtype().size_in_bytes();
        q + kv_b
            + [&self.kv_a, &self.o_proj]
                .iter()
                .map(|l| l.weight_bytes())
                .sum::<usize>()
    }
}

fn not_f32() -> ModelError {
    ModelError::Tensor(peregrine_tensor::candle::Error::Msg(
        "decode step: MLA's kv_b_proj must be f32 on the CPU".into(),
    ))
}
