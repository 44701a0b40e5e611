//! Gated delta-net linear attention (Qwen3-Next's and Qwen3.5's `linear_attn`): a recurrent
//! layer whose state is a `[key, value]` matrix per value head, updated by the delta rule.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_next/modeling_qwen3_next.py>
//!
//! Per token: `q`, `k`, `v` go through a causal depthwise conv (no bias) and SiLU; `q` and `k`
//! are L2-normed per head (`q` also scaled by `key_dim^-0.5`). Per value head `h` (its key head
//! `h / (v_heads / k_heads)`), with `g = -exp(A_log) · softplus(a + dt_bias)` and
//! `β = sigmoid(b)`: `S = S · exp(g)`, `S += k ⊗ β (v - Sᵀk)`, `o = Sᵀq`; the output is
//! RMS-normed per head, times its weight and `silu(z)`, then `out_proj`.
//!
//! Prompts run the recurrence token by token (transformers' chunked form is the same sums in
//! another order); the state lives in the sequence's
//! [`RecurrentCache`](peregrine_kv::RecurrentCache).

use peregrine_tensor::ops::{rms_norm_rows_in_place, silu};
use peregrine_tensor::{QLinear, Tensor};

use crate::arch::gemma3::layer_types;
use crate::config::Fields;
use rayon::prelude::*;

use crate::layers::batch::Segment;
use crate::layers::delta_rule::{self, HeadInputs};
use crate::layers::{causal_conv_silu, f32_values};
use crate::weights::{Source, Weights};
use crate::{ModelConfig, ModelError, Result};

/// The sizes of a gated delta-net layer (HF `linear_*` fields).
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetConfig {
    /// Query/key heads (`linear_num_key_heads`).
    pub k_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of `k_heads`.
    pub v_heads: usize,
    /// Width of a query/key head (`linear_key_head_dim`).
    pub k_dim: usize,
    /// Width of a value head (`linear_value_head_dim`).
    pub v_dim: usize,
    /// The causal conv's width (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    /// Which layers are delta-net layers (`layer_types[i] == "linear_attention"`).
    pub layers: Vec<bool>,
    /// Value heads in tiled order (llama.cpp's `qwen35` files: head `h` reads key head
    /// `h % k_heads`), not grouped by key head (HF: `h / (v_heads / k_heads)`).
    pub tiled: bool,
}

impl DeltaNetConfig {
    /// Reads the `linear_*` fields and `layer_types` (else every `full_attention_interval`-th
    /// layer is full attention, 4 by default, as transformers derives it).
    pub fn from_hf(fields: &Fields, num_layers: usize) -> Result<Self> {
        let every = fields
            .opt_usize("full_attention_interval")?
            .unwrap_or(4)
            .max(1);
        let layers = match layer_types(fields, num_layers, "linear_attention")? {
            Some(layers) => layers,
            None => (0..num_layers).map(|i| (i + 1) % every != 0).collect(),
        };
        let c = Self {
            k_heads: fields.usize("linear_num_key_heads")?,
            v_heads: fields.usize("linear_num_value_heads")?,
            k_dim: fields.usize("linear_key_head_dim")?,
            v_dim: fields.usize("linear_value_head_dim")?,
            conv_kernel: fields.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            layers,
            tiled: false,
        };
        c.check().map_err(|e| fields.err(e))?;
        Ok(c)
    }

    /// The relations the layer relies on, as a message naming the HF fields.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        if self.k_heads == 0 || !self.v_heads.is_multiple_of(self.k_heads) || self.conv_kernel < 2 {
            return Err(format!(
                "`linear_num_key_heads` {} must divide `linear_num_value_heads` {}, and \
                 `linear_conv_kernel_dim` {} be at least 2",
                self.k_heads, self.v_heads, self.conv_kernel
            ));
        }
        if self.v_dim == 0 || self.v_dim > delta_rule::MAX_V_DIM || self.k_dim == 0 {
            return Err(format!(
                "`linear_value_head_dim` {} must be 1 to {} and `linear_key_head_dim` {} positive",
                self.v_dim,
                delta_rule::MAX_V_DIM,
                self.k_dim
            ));
        }
        Ok(())
    }

    fn key_width(&self) -> usize {
        self.k_heads * self.k_dim
    }

    fn value_width(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// Channels of the conv: `q`, `k` and `v`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// f32 values of one layer's state: the conv's window, then each value head's `S`.
    pub fn state_len(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1) + self.v_heads * self.k_dim * self.v_dim
    }
}

/// `q`, `k`, `v` and `z` as the checkpoint projects them.
enum Qkvz {
    /// Qwen3-Next's `in_proj_qkvz`: `[q, k, v, z]` of each key head in turn (its value heads
    /// together).
    Grouped(QLinear),
    /// `[q; k; v]` and `z` apart (Qwen3.5's `in_proj_qkv` / `in_proj_z`; llama.cpp's
    /// `attn_qkv` / `attn_gate`).
    Split(QLinear, QLinear),
}

/// `b` and `a` as the checkpoint projects them.
enum Ba {
    /// `in_proj_ba`: `[b, a]` of each key head in turn (Qwen3-Next, and its GGUF `ssm_ba`).
    Grouped(QLinear),
    /// `in_proj_b` and `in_proj_a` (Qwen3.5).
    Split(QLinear, QLinear),
}

/// One gated delta-net layer.
pub struct GatedDeltaNet {
    c: DeltaNetConfig,
    qkvz: Qkvz,
    ba: Ba,
    /// `[conv_dim, conv_kernel]`.
    conv_w: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `-exp(A_log)`.
    a: Vec<f32>,
    norm: Vec<f32>,
    out_proj: QLinear,
    eps: f32,
}

/// One token's inputs in the canonical order: `qkv` `[q; k; v]`, then `z`, `b`, `a`.
struct Inputs {
    qkv: Vec<f32>,
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
}

impl GatedDeltaNet {
    /// Loads `{prefix}.*` (`model.layers.{i}.linear_attn`) in either projection layout.
    pub fn load(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let d = c.delta_net.clone().ok_or_else(|| {
            ModelError::config(
                w.path(),
                "a linear-attention layer without its `linear_*` fields",
            )
        })?;
        let h = c.hidden_size;
        let (kw, vw, conv) = (d.key_width(), d.value_width(), d.conv_dim());
        let name = |n: &str| format!("{prefix}.{n}");
        let qkvz = match w.contains(&name("in_proj_qkvz.weight")) {
            true => Qkvz::Grouped(w.linear(&name("in_proj_qkvz"), 2 * kw + 2 * vw, h, false)?),
            false => Qkvz::Split(
                w.linear(&name("in_proj_qkv"), conv, h, false)?,
                w.linear(&name("in_proj_z"), vw, h, false)?,
            ),
        };
        let ba = match w.contains(&name("in_proj_ba.weight")) {
            true => Ba::Grouped(w.linear(&name("in_proj_ba"), 2 * d.v_heads, h, false)?),
            false => Ba::Split(
                w.linear(&name("in_proj_b"), d.v_heads, h, false)?,
                w.linear(&name("in_proj_a"), d.v_heads, h, false)?,
            ),
        };
        let values = |n: &str, shape: &[usize]| f32_values(&w.tensor(&name(n), shape)?);
        // llama.cpp's converter squeezes the conv weight and stores `-exp(A_log)` itself;
        // mlx-lm stores the conv as [C, K, 1] (the same values in the same order).
        let gguf = matches!(w.source(), Source::Gguf(_));
        let k = d.conv_kernel;
        let conv_shape: &[usize] = match gguf {
            true => &[conv, k],
            false if w.dims(&name("conv1d.weight"))? == [conv, k, 1] => &[conv, k, 1],
            false => &[conv, 1, k],
        };
        let a = values("A_log", &[d.v_heads])?;
        let a = match gguf {
            true => a,
            false => a.iter().map(|a| -a.exp()).collect(),
        };
        Ok(Self {
            qkvz,
            ba,
            conv_w: values("conv1d.weight", conv_shape)?,
            dt_bias: values("dt_bias", &[d.v_heads])?,
            a,
            norm: values("norm.weight", &[d.v_dim])?,
            out_proj: w.linear(&name("out_proj"), h, vw, false)?,
            eps: c.rms_norm_eps as f32,
            c: d,
        })
    }

    /// Every row's inputs, reordered to the canonical layout.
    fn inputs(&self, x: &Tensor) -> Result<Vec<Inputs>> {
        let c = &self.c;
        let (kd, vd, per) = (c.k_dim, c.v_dim, c.v_heads / c.k_heads);
        let (kw, vw, conv, vh) = (c.key_width(), c.value_width(), c.conv_dim(), c.v_heads);
        let layers: Vec<&QLinear> = match (&self.qkvz, &self.ba) {
            (Qkvz::Grouped(l), Ba::Grouped(m)) => vec![l, m],
            (Qkvz::Grouped(l), Ba::Split(b, a)) => vec![l, b, a],
            (Qkvz::Split(l, z), Ba::Grouped(m)) => vec![l, z, m],
            (Qkvz::Split(l, z), Ba::Split(b, a)) => vec![l, z, b, a],
        };
        let outs = QLinear::forward_group(&layers, x)?;
        let outs: Vec<Vec<f32>> = outs.iter().map(f32_values).collect::<Result<_>>()?;
        let rows = x.dim(1)?;
        let group = 2 * kd + 2 * per * vd;
        Ok((0..rows)
            .map(|r| {
                let mut i = Inputs {
                    qkv: vec![0.0; conv],
                    z: vec![0.0; vw],
                    b: vec![0.0; vh],
                    a: vec![0.0; vh],
                };
                let mut next = 1;
                match &self.qkvz {
                    Qkvz::Grouped(_) => {
                        for g in 0..c.k_heads {
                            let src = &outs[0][(r * c.k_heads + g) * group..][..group];
                            let (q, rest) = src.split_at(kd);
                            let (k, rest) = rest.split_at(kd);
                            let (v, z) = rest.split_at(per * vd);
                            i.qkv[g * kd..][..kd].copy_from_slice(q);
                            i.qkv[kw + g * kd..][..kd].copy_from_slice(k);
                            i.qkv[2 * kw + g * per * vd..][..per * vd].copy_from_slice(v);
                            i.z[g * per * vd..][..per * vd].copy_from_slice(z);
                        }
                    }
                    Qkvz::Split(..) => {
                        i.qkv.copy_from_slice(&outs[0][r * conv..][..conv]);
                        i.z.copy_from_slice(&outs[1][r * vw..][..vw]);
                        next = 2;
                    }
                }
                match &self.ba {
                    Ba::Grouped(_) => {
                        for g in 0..c.k_heads {
                            let src = &outs[next][(r * c.k_heads + g) * 2 * per..][..2 * per];
                            i.b[g * per..][..per].copy_from_slice(&src[..per]);
                            i.a[g * per..][..per].copy_from_slice(&src[per..]);
                        }
                    }
                    Ba::Split(..) => {
                        i.b.copy_from_slice(&outs[next][r * vh..][..vh]);
                        i.a.copy_from_slice(&outs[next + 1][r * vh..][..vh]);
                    }
                }
                i
            })
            .collect())
    }

    /// `x: [1, rows, hidden]` (normed), the stacked rows of `segments` → `[1, rows, hidden]`.
    /// A sequence's positions beyond the last `depth` (those no rollback returns to) run in
    /// the chunked form; the rest one at a time, each state kept for rollback.
    pub fn forward(&self, x: &Tensor, segments: &mut [Segment]) -> Result<Tensor> {
        let inputs = self.inputs(x)?;
        let vw = self.c.value_width();
        let mut y = vec![0f32; inputs.len() * vw];
        let mut row = 0;
        for s in segments.iter_mut() {
            let Some(cache) = s.cache.recurrent() else {
                let why = "gated delta-net: a layer's cache holds no recurrent state";
                return Err(peregrine_tensor::candle::Error::Msg(why.into()).into());
            };
            let bulk = s.len.saturating_sub(cache.depth());
            if bulk > 0 {
                let rows = &inputs[row..row + bulk];
                self.span(
                    cache.advance_span(bulk),
                    rows,
                    &mut y[row * vw..][..bulk * vw],
                );
                row += bulk;
            }
            for j in bulk..s.len {
                let state = cache.advance(s.len - 1 - j);
                self.span(state, &inputs[row..=row], &mut y[row * vw..][..vw]);
                row += 1;
            }
        }
        let y = Tensor::from_vec(y, (1, row, vw), x.device())?.to_dtype(x.dtype())?;
        Ok(self.out_proj.forward(&y)?)
    }

    /// `rows` consecutive positions from `state` (conv window, then every head's `S`): the
    /// conv, then each value head (in parallel) through the delta rule — one position by
    /// recurrence, more in the chunked form — and the gated norm into `out` `[rows, v_width]`.
    fn span(&self, state: &mut [f32], rows: &[Inputs], out: &mut [f32]) {
        let c = &self.c;
        let (n, conv, k) = (rows.len(), c.conv_dim(), c.conv_kernel);
        let (kd, vd, kw, vw) = (c.k_dim, c.v_dim, c.key_width(), c.value_width());
        let (window, heads) = state.split_at_mut(conv * (k - 1));
        let mut qkv = vec![0f32; n * conv];
        for (x, o) in rows.iter().zip(qkv.chunks_exact_mut(conv)) {
            self.conv(window, &x.qkv, o);
        }
        let per = c.v_heads / c.k_heads;
        let head_out: Vec<Vec<f32>> = (heads.par_chunks_mut(kd * vd).enumerate())
            .map(|(h, s)| {
                let g = match c.tiled {
                    true => h % c.k_heads,
                    false => h / per,
                };
                let gather = |at: usize, w: usize| -> Vec<f32> {
                    (qkv.chunks_exact(conv))
                        .flat_map(|r| r[at..at + w].iter().copied())
                        .collect()
                };
                let (q, keys) = (gather(g * kd, kd), gather(kw + g * kd, kd));
                let v = gather(2 * kw + h * vd, vd);
                let decay: Vec<f32> = (rows.iter())
                    .map(|x| self.a[h] * softplus(x.a[h] + self.dt_bias[h]))
                    .collect();
                let beta: Vec<f32> = rows.iter().map(|x| sigmoid(x.b[h])).collect();
                let mut o = vec![0f32; n * vd];
                match n {
                    1 => delta_rule::step(s, &q, &keys, &v, decay[0], beta[0], &mut o),
                    _ => {
                        let x = HeadInputs {
                            q: &q,
                            k: &keys,
                            v: &v,
                            g: &decay,
                            beta: &beta,
                        };
                        delta_rule::chunked(s, &x, &mut o);
                    }
                }
                o
            })
            .collect();
        for (t, x) in rows.iter().enumerate() {
            for (h, o) in head_out.iter().enumerate() {
                let oh = &mut out[t * vw + h * vd..][..vd];
                oh.copy_from_slice(&o[t * vd..][..vd]);
                rms_norm_rows_in_place(oh, &self.norm, self.eps);
                for (o, z) in oh.iter_mut().zip(&x.z[h * vd..][..vd]) {
                    *o *= silu(*z);
                }
            }
        }
    }

    /// One position through the causal conv and SiLU (`window` shifts in its input), `q` and
    /// `k` L2-normed per head (`q` scaled by `k_dim^-0.5`): `out` is `[q; k; v]`.
    fn conv(&self, window: &mut [f32], input: &[f32], out: &mut [f32]) {
        let c = &self.c;
        causal_conv_silu(window, &self.conv_w, None, c.conv_kernel, input, out);
        let (q, rest) = out.split_at_mut(c.key_width());
        let keys = &mut rest[..c.key_width()];
        let scale = (c.k_dim as f32).powf(-0.5);
        for (qh, kh) in q
            .chunks_exact_mut(c.k_dim)
            .zip(keys.chunks_exact_mut(c.k_dim))
        {
            l2_normalize(qh, scale);
            l2_normalize(kh, 1.0);
        }
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        let projections = match (&self.qkvz, &self.ba) {
            (Qkvz::Grouped(l), Ba::Grouped(m)) => vec![l, m],
            (Qkvz::Grouped(l), Ba::Split(b, a)) => vec![l, b, a],
            (Qkvz::Split(l, z), Ba::Grouped(m)) => vec![l, z, m],
            (Qkvz::Split(l, z), Ba::Split(b, a)) => vec![l, z, b, a],
        };
        let projections: usize = projections.iter().map(|l| l.weight_bytes()).sum();
        projections + self.out_proj.weight_bytes() + 4 * (self.conv_w.len() + self.norm.len())
    }
}

/// `x · scale / sqrt(Σx² + 1e-6)` (the FLA library's L2 norm, as transformers writes it).
fn l2_normalize(x: &mut [f32], scale: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (sum + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// PyTorch's softplus (linear above 20).
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}
