//! The Mamba (v1) mixer as Jamba runs it: a selective state-space layer with a state per
//! channel, over a recurrent state.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/jamba/modeling_jamba.py>
//!
//! `in_proj` gives `x` and the gate `z` (`inner` each); `x` goes through a causal depthwise
//! conv and SiLU (`u`); `x_proj(u)` gives a low-rank `dt`, `B` and `C` (`state` each), each
//! RMS-normed (Jamba's extra norms); `dt = softplus(dt_proj(dt))` per channel. Per channel `c`
//! with `A = -exp(A_log)` `[inner, state]`: `s = exp(A_c · dt_c) · s + dt_c · u_c · B`,
//! `y_c = s · C + D_c · u_c`, times `silu(z_c)`; then `out_proj`.
//!
//! The conv runs first over a pass's rows (on a copy of the window), the projections between
//! conv and scan as one matmul over them, then the scan position by position, which shifts the
//! window in the cache as it goes, so each position's kept state is whole.

use peregrine_tensor::ops::{rms_norm, silu};
use peregrine_tensor::{QLinear, Tensor};

use crate::Result;
use crate::layers::batch::Segment;
use crate::layers::causal_conv_silu;
use crate::layers::delta_net::softplus;
use crate::layers::f32_values;
use crate::weights::{Source, Weights};

/// A Mamba mixer's sizes (Jamba's `mamba_*` fields) and which layers are Mamba layers.
#[derive(Debug, Clone, PartialEq)]
pub struct MambaConfig {
    /// Channels of the inner stream (`mamba_expand · hidden_size`).
    pub inner: usize,
    /// State per channel (`mamba_d_state`).
    pub state: usize,
    /// The causal conv's width (`mamba_d_conv`).
    pub conv_kernel: usize,
    /// Rank of `dt` before `dt_proj` (`mamba_dt_rank`).
    pub dt_rank: usize,
    /// The conv carries a bias (`mamba_conv_bias`).
    pub conv_bias: bool,
    /// `in_proj` and `out_proj` carry biases (`mamba_proj_bias`).
    pub bias: bool,
    /// Which layers mix with Mamba (the others with attention).
    pub layers: Vec<bool>,
}

impl MambaConfig {
    /// f32 values of one layer's state: the conv's window, then each channel's state.
    pub fn state_len(&self) -> usize {
        self.inner * (self.conv_kernel - 1) + self.inner * self.state
    }
}

/// One Mamba mixer's weights.
pub struct MambaMixer {
    c: MambaConfig,
    x_in: QLinear,
    z_in: QLinear,
    /// `[inner, conv_kernel]`.
    conv_w: Vec<f32>,
    conv_b: Vec<f32>,
    /// `x_proj`'s parts: low-rank `dt`, `B`, `C`.
    x_proj: [QLinear; 3],
    /// RMSNorm weights of the three parts.
    norms: [Tensor; 3],
    dt_proj: QLinear,
    /// `-exp(A_log)`, `[inner, state]`.
    a: Vec<f32>,
    d: Vec<f32>,
    out_proj: QLinear,
    eps: f32,
}

/// The layers `linear_rows` gave, one per part.
fn parts<const N: usize>(v: Vec<QLinear>) -> [QLinear; N] {
    <[QLinear; N]>::try_from(v).unwrap_or_else(|_| unreachable!("one layer per part"))
}

impl MambaMixer {
    /// Loads `{prefix}.*` for a model of width `hidden`.
    pub fn load(
        c: &MambaConfig,
        w: &Weights,
        prefix: &str,
        hidden: usize,
        eps: f32,
    ) -> Result<Self> {
        let (inner, n, rank) = (c.inner, c.state, c.dt_rank);
        let name = |s: &str| format!("{prefix}.{s}");
        let [x_in, z_in] =
            parts(w.linear_rows(&name("in_proj"), &[inner, inner], hidden, c.bias)?);
        let x_proj = parts(w.linear_rows(&name("x_proj"), &[rank, n, n], inner, false)?);
        let norm = |s: &str, d: usize| w.tensor(&name(&format!("{s}.weight")), &[d]);
        let vec = |s: &str, shape: &[usize]| f32_values(&w.tensor(&name(s), shape)?);
        // llama.cpp's converter squeezes the conv and stores `-exp(A_log)`.
        let gguf = matches!(w.source(), Source::Gguf(_));
        // mlx-lm stores the conv as [C, K, 1]: the same values in the same order.
        let k = c.conv_kernel;
        let conv_shape: &[usize] = match gguf {
            true => &[inner, k],
            false if w.dims(&name("conv1d.weight"))? == [inner, k, 1] => &[inner, k, 1],
            false => &[inner, 1, k],
        };
        let a = vec("A_log", &[inner, n])?;
        Ok(Self {
            x_in,
            z_in,
            conv_w: vec("conv1d.weight", conv_shape)?,
            conv_b: match c.conv_bias {
                true => vec("conv1d.bias", &[inner])?,
                false => vec![0.0; inner],
            },
            x_proj,
            norms: [
                norm("dt_layernorm", rank)?,
                norm("b_layernorm", n)?,
                norm("c_layernorm", n)?,
            ],
            dt_proj: w.linear(&name("dt_proj"), inner, rank, true)?,
            a: match gguf {
                true => a,
                false => a.iter().map(|a| -a.exp()).collect(),
            },
            d: vec("D", &[inner])?,
            out_proj: w.linear(&name("out_proj"), hidden, inner, c.bias)?,
            eps,
            c: c.clone(),
        })
    }

    /// `x: [1, rows, hidden]` (normed), the stacked rows of `segments` → `[1, rows, hidden]`.
    pub fn forward(&self, x: &Tensor, segments: &mut [Segment]) -> Result<Tensor> {
        let (inner, k, n) = (self.c.inner, self.c.conv_kernel, self.c.state);
        let xz = QLinear::forward_group(&[&self.x_in, &self.z_in], x)?;
        let (xs, z) = (f32_values(&xz[0])?, f32_values(&xz[1])?);
        let rows = xs.len() / inner;
        // The conv over every row, each sequence from its own window (copied: the scan below
        // moves the cache's window position by position).
        let mut u = vec![0f32; rows * inner];
        let mut row = 0;
        for s in segments.iter_mut() {
            let Some(cache) = s.cache.recurrent() else {
                let why = "mamba mixer: a layer's cache holds no recurrent state";
                return Err(peregrine_tensor::candle::Error::Msg(why.into()).into());
            };
            let mut window = cache.state()[..inner * (k - 1)].to_vec();
            for _ in 0..s.len {
                let (input, out) = (&xs[row * inner..][..inner], &mut u[row * inner..][..inner]);
                self.conv(&mut window, input, out);
                row += 1;
            }
        }
        let ut = Tensor::from_vec(u.clone(), (1, rows, inner), x.device())?.to_dtype(x.dtype())?;
        let parts = QLinear::forward_group(&self.x_proj.each_ref(), &ut)?;
        let normed: Vec<Tensor> = (parts.iter().zip(&self.norms))
            .map(|(p, w)| rms_norm(p, w, self.eps))
            .collect::<std::result::Result<_, _>>()?;
        let dt = f32_values(&self.dt_proj.forward(&normed[0])?)?;
        let (b, c) = (f32_values(&normed[1])?, f32_values(&normed[2])?);
        let mut y = vec![0f32; rows * inner];
        let mut row = 0;
        for s in segments.iter_mut() {
            let cache = s.cache.recurrent().expect("checked above");
            for j in 0..s.len {
                let state = cache.advance(s.len - 1 - j);
                let (window, ssm) = state.split_at_mut(inner * (k - 1));
                shift_in(window, &xs[row * inner..][..inner], k - 1);
                let (br, cr) = (&b[row * n..][..n], &c[row * n..][..n]);
                for ch in 0..inner {
                    let at = row * inner + ch;
                    let dt_c = softplus(dt[at]);
                    let (sc, ac) = (&mut ssm[ch * n..][..n], &self.a[ch * n..][..n]);
                    let mut acc = 0f32;
                    for i in 0..n {
                        sc[i] = (ac[i] * dt_c).exp() * sc[i] + dt_c * u[at] * br[i];
                        acc += sc[i] * cr[i];
                    }
                    y[at] = (acc + self.d[ch] * u[at]) * silu(z[at]);
                }
                row += 1;
            }
        }
        let y = Tensor::from_vec(y, (1, rows, inner), x.device())?.to_dtype(x.dtype())?;
        Ok(self.out_proj.forward(&y)?)
    }

    /// One position through the causal conv and SiLU, shifting `input` into `window`.
    fn conv(&self, window: &mut [f32], input: &[f32], out: &mut [f32]) {
        let k = self.c.conv_kernel;
        causal_conv_silu(window, &self.conv_w, Some(&self.conv_b), k, input, out);
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        let linears = [&self.x_in, &self.z_in, &self.dt_proj, &self.out_proj];
        (linears.into_iter().chain(&self.x_proj))
            .map(QLinear::weight_bytes)
            .sum::<usize>()
            + 4 * (self.conv_w.len() + self.a.len())
    }
}

/// Each channel's window (`width` earlier inputs) moves on by one, taking `input`.
fn shift_in(window: &mut [f32], input: &[f32], width: usize) {
    for (past, x) in window.chunks_exact_mut(width).zip(input) {
        past.rotate_left(1);
        past[width - 1] = *x;
    }
}
