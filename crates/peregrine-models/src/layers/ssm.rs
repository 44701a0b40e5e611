//! The Mamba 2 mixer (Mamba 2's blocks, Falcon-H1's `mamba` beside attention): a selective
//! state-space layer over a recurrent state.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/mamba2/modeling_mamba2.py>
//!
//! - `in_proj` gives the gate `z` (`inner` wide), the conv input `xBC` (the SSM input `x`,
//!   then `B` and `C`, `n_groups · state_size` each) and `dt` (one per head); Falcon-H1 scales
//!   the five parts by its `ssm_multipliers`.
//! - A causal depthwise conv over `xBC` (kernel `conv_kernel`, bias), then SiLU.
//! - Per head `h` (its group `h / (heads / n_groups)` gives `B` and `C`):
//!   `dt = softplus(dt + dt_bias)`, `S = S · exp(dt · A) + dt · x ⊗ B` with `A = -exp(A_log)`,
//!   `y = S · C + D · x`.
//! - The gated norm, RMS over groups of `inner / n_groups`: Mamba 2 gates first
//!   (`norm(y · silu(z))`), Falcon-H1 normalises first (`norm(y) · silu(z)`); without the norm,
//!   `y · silu(z)`.
//!
//! The state (the conv's last `conv_kernel - 1` inputs and every head's `S`) lives in the
//! sequence's [`RecurrentCache`](peregrine_kv::RecurrentCache). A prompt's bulk runs the chunked
//! scan ([`ssd`]), its last rollback-depth positions and decode the recurrence.

use peregrine_tensor::ops::{rms_norm_rows_in_place, silu};
use peregrine_tensor::{QLinear, Tensor};

use crate::Result;
use rayon::prelude::*;

use crate::layers::batch::Segment;
use crate::layers::delta_net::softplus;
use crate::layers::{causal_conv_silu, f32_values, ssd};
use crate::weights::{Source, Weights};

/// A Mamba 2 mixer's sizes and variants (HF `Mamba2Config`, Falcon-H1's `mamba_*` fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SsmConfig {
    /// SSM heads (`num_heads`).
    pub heads: usize,
    /// Width of one head (`head_dim`).
    pub head_dim: usize,
    /// State per head and value (`state_size`).
    pub state_size: usize,
    /// Groups sharing `B` and `C` (`n_groups`).
    pub groups: usize,
    /// The causal conv's width (`conv_kernel`).
    pub conv_kernel: usize,
    /// `in_proj` carries a bias (`use_bias`).
    pub bias: bool,
    /// `out_proj` carries a bias (Mamba 2's `use_bias`, Falcon-H1's `projectors_bias`).
    pub out_bias: bool,
    /// The conv carries a bias (`use_conv_bias`).
    pub conv_bias: bool,
    /// The output is RMS-normed (Falcon-H1's `mamba_rms_norm`; always for Mamba 2).
    pub gated_norm: bool,
    /// The norm comes before the gate (Falcon-H1's `mamba_norm_before_gate`).
    pub norm_before_gate: bool,
    /// Scales of `in_proj`'s parts `z`, `x`, `B`, `C`, `dt` (Falcon-H1's `ssm_multipliers`).
    pub multipliers: [f32; 5],
}

impl SsmConfig {
    /// Width of the inner stream (`heads · head_dim`, HF's `expand · hidden_size`).
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels of the conv: `x`, `B` and `C`.
    pub fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.state_size
    }

    /// f32 values of one layer's state: the conv's window, then each head's `S`.
    pub fn state_len(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1) + self.inner() * self.state_size
    }
}

/// One Mamba 2 mixer's weights, as f32 where the recurrence reads them.
pub struct Mamba2Mixer {
    c: SsmConfig,
    z_proj: QLinear,
    xbc_proj: QLinear,
    dt_proj: QLinear,
    /// `[conv_dim, conv_kernel]`.
    conv_w: Vec<f32>,
    conv_b: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `-exp(A_log)`.
    a: Vec<f32>,
    d: Vec<f32>,
    /// Empty without the gated norm.
    norm: Vec<f32>,
    out_proj: QLinear,
    eps: f32,
}

impl Mamba2Mixer {
    /// Loads `{prefix}.*` (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`)
    /// for a model of width `hidden`.
    pub fn load(c: SsmConfig, w: &Weights, prefix: &str, hidden: usize, eps: f32) -> Result<Self> {
        let (inner, conv) = (c.inner(), c.conv_dim());
        let m = prefix;
        let parts = [inner, conv, c.heads];
        let proj = w.linear_rows(&format!("{m}.in_proj"), &parts, hidden, c.bias)?;
        let Ok([z_proj, xbc_proj, dt_proj]) = <[QLinear; 3]>::try_from(proj) else {
            unreachable!("three parts, three layers")
        };
        let values =
            |name: &str, shape: &[usize]| f32_values(&w.tensor(&format!("{m}.{name}"), shape)?);
        let conv_b = match c.conv_bias {
            true => values("conv1d.bias", &[conv])?,
            false => vec![0.0; conv],
        };
        // llama.cpp's converter squeezes the conv, stores `-exp(A_log)`, gives A and D a
        // trailing unit dimension and the norm one row per group.
        let gguf = matches!(w.source(), Source::Gguf(_));
        let (h, k, g) = (c.heads, c.conv_kernel, c.groups);
        // mlx-lm stores the conv as [C, K, 1]: the same values in the same order.
        let mlx_conv = !gguf && w.dims(&format!("{m}.conv1d.weight"))? == [conv, k, 1];
        let (conv_shape, head_shape, norm_shape): (&[usize], &[usize], &[usize]) = match gguf {
            true => (&[conv, k], &[h, 1], &[g, inner / g]),
            false if mlx_conv => (&[conv, k, 1], &[h], &[inner]),
            false => (&[conv, 1, k], &[h], &[inner]),
        };
        let a = values("A_log", head_shape)?;
        Ok(Self {
            z_proj,
            xbc_proj,
            dt_proj,
            conv_w: values("conv1d.weight", conv_shape)?,
            conv_b,
            dt_bias: values("dt_bias", &[c.heads])?,
            a: match gguf {
                true => a,
                false => a.iter().map(|a| -a.exp()).collect(),
            },
            d: values("D", head_shape)?,
            norm: match c.gated_norm {
                true => values("norm.weight", norm_shape)?,
                false => Vec::new(),
            },
            out_proj: w.linear(&format!("{m}.out_proj"), hidden, inner, c.out_bias)?,
            eps,
            c,
        })
    }

    /// `x: [1, rows, hidden]` (normed), the stacked rows of `segments` → `[1, rows, hidden]`.
    /// A sequence's positions beyond the last `depth` (those no rollback returns to) run in
    /// the chunked form; the rest one at a time, each state kept for rollback.
    pub fn forward(&self, x: &Tensor, segments: &mut [Segment]) -> Result<Tensor> {
        let proj = QLinear::forward_group(&[&self.z_proj, &self.xbc_proj, &self.dt_proj], x)?;
        let [z, xbc, dt] = [&proj[0], &proj[1], &proj[2]].map(f32_values);
        let (mut z, mut xbc, mut dt) = (z?, xbc?, dt?);
        self.scale_parts(&mut z, &mut xbc, &mut dt);
        let (inner, conv, heads) = (self.c.inner(), self.c.conv_dim(), self.c.heads);
        let mut y = vec![0f32; z.len()];
        let mut row = 0;
        for s in segments.iter_mut() {
            let Some(cache) = s.cache.recurrent() else {
                let why = "mamba2 mixer: a layer's cache holds no recurrent state";
                return Err(peregrine_tensor::candle::Error::Msg(why.into()).into());
            };
            let bulk = s.len.saturating_sub(cache.depth());
            let mut run = |state: &mut [f32], rows: std::ops::Range<usize>| {
                let (xbc, dt) = (
                    &xbc[rows.start * conv..rows.end * conv],
                    &dt[rows.start * heads..rows.end * heads],
                );
                let out = &mut y[rows.start * inner..rows.end * inner];
                self.span(state, xbc, dt, out);
                for (o, zr) in out
                    .chunks_exact_mut(inner)
                    .zip(z[rows.start * inner..].chunks_exact(inner))
                {
                    self.gate(o, zr);
                }
            };
            if bulk > 0 {
                run(cache.advance_span(bulk), row..row + bulk);
                row += bulk;
            }
            for j in bulk..s.len {
                run(cache.advance(s.len - 1 - j), row..row + 1);
                row += 1;
            }
        }
        let y = Tensor::from_vec(y, (1, row, inner), x.device())?.to_dtype(x.dtype())?;
        Ok(self.out_proj.forward(&y)?)
    }

    /// `in_proj`'s parts times their multipliers (all ones but for Falcon-H1).
    fn scale_parts(&self, z: &mut [f32], xbc: &mut [f32], dt: &mut [f32]) {
        let [mz, mx, mb, mc, mdt] = self.c.multipliers;
        if self.c.multipliers == [1.0; 5] {
            return;
        }
        let (inner, bc) = (self.c.inner(), self.c.groups * self.c.state_size);
        z.iter_mut().for_each(|v| *v *= mz);
        dt.iter_mut().for_each(|v| *v *= mdt);
        for row in xbc.chunks_exact_mut(self.c.conv_dim()) {
            let (x, rest) = row.split_at_mut(inner);
            let (b, cc) = rest.split_at_mut(bc);
            x.iter_mut().for_each(|v| *v *= mx);
            b.iter_mut().for_each(|v| *v *= mb);
            cc.iter_mut().for_each(|v| *v *= mc);
        }
    }

    /// Consecutive positions (`xbc` `[n, conv_dim]`, `dt` `[n, heads]`) from `state` (conv
    /// window, then every head's `S`): the conv, then each head (in parallel) through the
    /// scan — one position by recurrence, more in the chunked form — plus `D · x`, into `out`
    /// `[n, inner]`.
    fn span(&self, state: &mut [f32], xbc: &[f32], dt: &[f32], out: &mut [f32]) {
        let c = self.c;
        let (conv, k, n) = (c.conv_dim(), c.conv_kernel, dt.len() / c.heads);
        let (p, ns, inner) = (c.head_dim, c.state_size, c.inner());
        let (window, heads) = state.split_at_mut(conv * (k - 1));
        let mut u = vec![0f32; n * conv];
        for (input, o) in xbc.chunks_exact(conv).zip(u.chunks_exact_mut(conv)) {
            self.conv(window, input, o);
        }
        let per_group = c.heads / c.groups;
        let gather = |at: usize, w: usize| -> Vec<f32> {
            (u.chunks_exact(conv))
                .flat_map(|r| r[at..at + w].iter().copied())
                .collect()
        };
        let head_out: Vec<Vec<f32>> = (heads.par_chunks_mut(p * ns).enumerate())
            .map(|(h, s)| {
                let g = h / per_group;
                let x = gather(h * p, p);
                let (b, cc) = (
                    gather(inner + g * ns, ns),
                    gather(inner + (c.groups + g) * ns, ns),
                );
                let dt: Vec<f32> = (0..n)
                    .map(|t| softplus(dt[t * c.heads + h] + self.dt_bias[h]))
                    .collect();
                let mut o = vec![0f32; n * p];
                match n {
                    1 => ssd::step(s, &x, &b, &cc, dt[0], self.a[h], &mut o),
                    _ => {
                        let inputs = ssd::HeadInputs {
                            x: &x,
                            b: &b,
                            c: &cc,
                            dt: &dt,
                            a: self.a[h],
                        };
                        ssd::chunked(s, &inputs, &mut o);
                    }
                }
                o.iter_mut().zip(&x).for_each(|(o, x)| *o += self.d[h] * x);
                o
            })
            .collect();
        for t in 0..n {
            for (h, o) in head_out.iter().enumerate() {
                out[t * inner + h * p..][..p].copy_from_slice(&o[t * p..][..p]);
            }
        }
    }

    /// One position through the causal conv (bias) and SiLU, shifting `input` into `window`.
    fn conv(&self, window: &mut [f32], input: &[f32], out: &mut [f32]) {
        let k = self.c.conv_kernel;
        causal_conv_silu(window, &self.conv_w, Some(&self.conv_b), k, input, out);
    }

    /// The gate `silu(z)` and the grouped RMS norm, in the order the variant applies them.
    fn gate(&self, y: &mut [f32], z: &[f32]) {
        let norm = (!self.norm.is_empty()).then_some(self.norm.as_slice());
        gated_norm(y, z, norm, self.c.groups, self.c.norm_before_gate, self.eps);
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        [&self.z_proj, &self.xbc_proj, &self.dt_proj, &self.out_proj]
            .iter()
            .map(|l| l.weight_bytes())
            .sum::<usize>()
            + 4 * (self.conv_w.len() + self.norm.len())
    }
}

/// `y · silu(z)` and, with a `norm` weight, the RMS norm over `groups` equal groups of `y`:
/// after the gate, or before it when `norm_first`.
fn gated_norm(
    y: &mut [f32],
    z: &[f32],
    norm: Option<&[f32]>,
    groups: usize,
    norm_first: bool,
    eps: f32,
) {
    let gate = |y: &mut [f32]| y.iter_mut().zip(z).for_each(|(v, g)| *v *= silu(*g));
    let Some(norm) = norm else {
        return gate(y);
    };
    if !norm_first {
        gate(y);
    }
    let size = y.len() / groups;
    for (ys, ws) in y.chunks_exact_mut(size).zip(norm.chunks_exact(size)) {
        rms_norm_rows_in_place(ys, ws, eps);
    }
    if norm_first {
        gate(y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both orders against the formulas written out, over two groups: Mamba 2's
    /// `norm(y · silu(z)) · w` and Falcon-H1's optional `norm(y) · w · silu(z)` (the fixtures
    /// cover the first; transformers' default for Falcon-H1 is the second).
    #[test]
    fn the_gate_and_the_grouped_norm_in_either_order() {
        let y: Vec<f32> = (0..8).map(|i| i as f32 * 0.3 - 1.0).collect();
        let z: Vec<f32> = (0..8).map(|i| 0.5 - i as f32 * 0.2).collect();
        let w: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 * 0.1).collect();
        let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32 + 1e-6).sqrt();
        for norm_first in [false, true] {
            let mut got = y.clone();
            gated_norm(&mut got, &z, Some(&w), 2, norm_first, 1e-6);
            for g in 0..2 {
                let (ys, zs) = (&y[g * 4..][..4], &z[g * 4..][..4]);
                let gated: Vec<f32> = ys.iter().zip(zs).map(|(a, b)| a * silu(*b)).collect();
                let base = if norm_first { ys.to_vec() } else { gated };
                let r = rms(&base);
                for i in 0..4 {
                    let mut want = base[i] / r * w[g * 4 + i];
                    if norm_first {
                        want *= silu(zs[i]);
                    }
                    let got = got[g * 4 + i];
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{norm_first} {g} {i}: {got} {want}"
                    );
                }
            }
        }
    }
}
