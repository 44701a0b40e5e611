//! Mamba 2 (`mamba2`): a pure state-space model, no attention.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/mamba2/modeling_mamba2.py>
//!
//! Each block is `x + out_proj(norm(ssm(conv(in_proj(rms_norm(x))))))`:
//! - `in_proj` gives the gate `z` (`expand · hidden`), the conv input `xBC` (the SSM input
//!   `x`, then `B` and `C`, `n_groups · state_size` each) and `dt` (one per head).
//! - A causal depthwise conv over `xBC` (kernel `conv_kernel`, bias), then SiLU.
//! - Per head `h` (its group `h / (heads / n_groups)` gives `B` and `C`):
//!   `dt = softplus(dt + dt_bias)`, `S = S · exp(dt · A) + dt · x ⊗ B` with `A = -exp(A_log)`,
//!   `y = S · C + D · x`.
//! - The gated norm: `y · silu(z)`, RMS-normed per group of `expand · hidden / n_groups`,
//!   times its weight.
//!
//! The state (the conv's last `conv_kernel - 1` inputs and every head's `S`) lives in the
//! sequence's [`RecurrentCache`](peregrine_kv::RecurrentCache), which keeps the states of the
//! last positions for exact rollback. Prompts run the recurrence token by token (transformers'
//! chunked scan is the same sums in another order). Tensors are under `backbone.`; the
//! embedding is tied unless `lm_head.weight` exists.

use serde_json::{Map, Value};

use peregrine_tensor::ops::{rms_norm, rms_norm_rows_in_place, silu};
use peregrine_tensor::{DType, Device, Embedding, QLinear, Tensor};

use crate::config::Fields;
use crate::layers::batch::{BatchSeq, Segment, check_batch, last_logits, run_layers, stacked_ids};
use crate::weights::Weights;
use crate::{CausalLm, LayerKind, Logits, ModelConfig, ModelError, Result, SequenceCache};

/// Mamba 2's sizes (HF `Mamba2Config`).
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
    /// Projections carry biases (`use_bias`).
    pub bias: bool,
    /// The conv carries a bias (`use_conv_bias`).
    pub conv_bias: bool,
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

/// `config.json` of a Mamba 2 checkpoint with the llama-family keys the shared parser wants:
/// its SSM heads as `num_attention_heads` (they have no attention), `expand · hidden` as
/// `intermediate_size`, `layer_norm_epsilon` as `rms_norm_eps`.
pub fn shared_keys(map: &Map<String, Value>) -> Map<String, Value> {
    let mut map = map.clone();
    let hidden = map.get("hidden_size").and_then(Value::as_u64).unwrap_or(0);
    let expand = map.get("expand").and_then(Value::as_u64).unwrap_or(2);
    let rename = [
        ("num_heads", "num_attention_heads"),
        ("layer_norm_epsilon", "rms_norm_eps"),
    ];
    for (from, to) in rename {
        if let Some(v) = map.get(from).cloned() {
            map.entry(to).or_insert(v);
        }
    }
    map.entry("intermediate_size")
        .or_insert((expand * hidden).into());
    map
}

/// Reads the SSM fields.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    if let Some(act) = fields.opt_str("hidden_act")?.filter(|a| *a != "silu") {
        return Err(fields.err(format!("mamba2 with `hidden_act` `{act}`: only `silu`")));
    }
    let ssm = SsmConfig {
        heads: fields.usize("num_heads")?,
        head_dim: fields.usize("head_dim")?,
        state_size: fields.usize("state_size")?,
        groups: fields.opt_usize("n_groups")?.unwrap_or(1),
        conv_kernel: fields.opt_usize("conv_kernel")?.unwrap_or(4),
        bias: fields.opt_bool("use_bias")?.unwrap_or(false),
        conv_bias: fields.opt_bool("use_conv_bias")?.unwrap_or(true),
    };
    if ssm.inner() != config.intermediate_size {
        return Err(fields.err(format!(
            "`num_heads` {} × `head_dim` {} must equal `expand` × `hidden_size` ({})",
            ssm.heads, ssm.head_dim, config.intermediate_size
        )));
    }
    if ssm.groups == 0 || !ssm.heads.is_multiple_of(ssm.groups) || ssm.conv_kernel < 2 {
        return Err(fields.err(format!(
            "`n_groups` {} must divide `num_heads` {}, and `conv_kernel` {} be at least 2",
            ssm.groups, ssm.heads, ssm.conv_kernel
        )));
    }
    config.ssm = Some(ssm);
    Ok(())
}

/// One block's mixer weights, as f32 where the recurrence reads them.
struct Mixer {
    norm: Tensor,
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
    gate_norm: Vec<f32>,
    out_proj: QLinear,
}

/// The Mamba 2 language model.
pub struct Mamba2Lm {
    config: ModelConfig,
    ssm: SsmConfig,
    embed: Embedding,
    layers: Vec<Mixer>,
    norm_f: Tensor,
    lm_head: QLinear,
    untied_head: bool,
    device: Device,
    dtype: DType,
}

fn f32s(t: Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

impl Mamba2Lm {
    /// Loads `backbone.*` (and `lm_head` when untied).
    pub fn load(config: ModelConfig, w: &Weights) -> Result<Self> {
        let ssm = config.ssm.ok_or_else(|| {
            ModelError::config(w.path(), "mamba2 without its SSM fields".to_string())
        })?;
        let (h, inner, conv) = (config.hidden_size, ssm.inner(), ssm.conv_dim());
        let layers = (0..config.num_hidden_layers)
            .map(|i| -> Result<Mixer> {
                let p = format!("backbone.layers.{i}");
                let m = format!("{p}.mixer");
                let parts = [inner, conv, ssm.heads];
                let proj = w.linear_rows(&format!("{m}.in_proj"), &parts, h, ssm.bias)?;
                let Ok([z_proj, xbc_proj, dt_proj]) = <[QLinear; 3]>::try_from(proj) else {
                    unreachable!("three parts, three layers")
                };
                let vec =
                    |name: &str, shape: &[usize]| f32s(w.tensor(&format!("{m}.{name}"), shape)?);
                let conv_b = match ssm.conv_bias {
                    true => vec("conv1d.bias", &[conv])?,
                    false => vec![0.0; conv],
                };
                Ok(Mixer {
                    norm: w.tensor(&format!("{p}.norm.weight"), &[h])?,
                    z_proj,
                    xbc_proj,
                    dt_proj,
                    conv_w: vec("conv1d.weight", &[conv, 1, ssm.conv_kernel])?,
                    conv_b,
                    dt_bias: vec("dt_bias", &[ssm.heads])?,
                    a: vec("A_log", &[ssm.heads])?
                        .iter()
                        .map(|a| -a.exp())
                        .collect(),
                    d: vec("D", &[ssm.heads])?,
                    gate_norm: vec("norm.weight", &[inner])?,
                    out_proj: w.linear(&format!("{m}.out_proj"), h, inner, ssm.bias)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = w.embedding("backbone.embeddings.weight", config.vocab_size, h)?;
        let untied_head = w.contains("lm_head.weight");
        let lm_head = match untied_head {
            true => w.linear("lm_head", config.vocab_size, h, false)?,
            false => embed.as_linear()?,
        };
        Ok(Self {
            norm_f: w.tensor("backbone.norm_f.weight", &[h])?,
            ssm,
            embed,
            layers,
            lm_head,
            untied_head,
            device: w.device().clone(),
            dtype: w.dtype(),
            config,
        })
    }

    /// The last block's output `[1, rows, hidden]` for the stacked new tokens of `batch`.
    fn hidden(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        check_batch(batch, usize::MAX)?;
        let ids = Tensor::new(stacked_ids(batch), &self.device)?.unsqueeze(0)?;
        let x = self.embed.forward(&ids, self.dtype)?;
        run_layers(
            batch,
            x,
            self.layers.len(),
            |i| i,
            |i, x, segments| self.block(&self.layers[i], x, segments),
        )
    }

    fn block(&self, m: &Mixer, x: &Tensor, segments: &mut [Segment]) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let normed = rms_norm(x, &m.norm, eps)?;
        let proj = QLinear::forward_group(&[&m.z_proj, &m.xbc_proj, &m.dt_proj], &normed)?;
        let [z, xbc, dt] = [&proj[0], &proj[1], &proj[2]].map(|t| f32s(t.clone()));
        let (z, xbc, dt) = (z?, xbc?, dt?);
        let (inner, conv) = (self.ssm.inner(), self.ssm.conv_dim());
        let mut y = vec![0f32; z.len()];
        let mut conv_out = vec![0f32; conv];
        let mut row = 0;
        for s in segments.iter_mut() {
            let Some(cache) = s.cache.recurrent() else {
                let why = "mamba2: a layer's cache holds no recurrent state";
                return Err(peregrine_tensor::candle::Error::Msg(why.into()).into());
            };
            for j in 0..s.len {
                let state = cache.advance(s.len - 1 - j);
                let out = &mut y[row * inner..][..inner];
                self.step(
                    m,
                    state,
                    &xbc[row * conv..][..conv],
                    &dt[row * self.ssm.heads..][..self.ssm.heads],
                    &mut conv_out,
                    out,
                );
                gated_norm(
                    out,
                    &z[row * inner..][..inner],
                    &m.gate_norm,
                    self.ssm.groups,
                    eps,
                );
                row += 1;
            }
        }
        let y = Tensor::from_vec(y, (1, row, inner), &self.device)?.to_dtype(x.dtype())?;
        Ok((x + m.out_proj.forward(&y)?)?)
    }

    /// One position through the conv (into `xbc`, `conv_dim` wide) and the SSM: `state` is
    /// updated, `out` gets `y`.
    fn step(
        &self,
        m: &Mixer,
        state: &mut [f32],
        xbc_in: &[f32],
        dt: &[f32],
        xbc: &mut [f32],
        out: &mut [f32],
    ) {
        let c = self.ssm;
        let (conv, k) = (c.conv_dim(), c.conv_kernel);
        let (window, s) = state.split_at_mut(conv * (k - 1));
        // The conv over the window (`k - 1` earlier inputs per channel) and this input.
        for ch in 0..conv {
            let w = &m.conv_w[ch * k..][..k];
            let past = &mut window[ch * (k - 1)..][..k - 1];
            let mut acc = m.conv_b[ch] + w[k - 1] * xbc_in[ch];
            for (j, p) in past.iter().enumerate() {
                acc += w[j] * p;
            }
            past.rotate_left(1);
            past[k - 2] = xbc_in[ch];
            xbc[ch] = silu(acc);
        }
        let (x, bc) = xbc.split_at(c.inner());
        let (b, cc) = bc.split_at(c.groups * c.state_size);
        let per_group = c.heads / c.groups;
        for h in 0..c.heads {
            let g = h / per_group;
            let (bg, cg) = (
                &b[g * c.state_size..][..c.state_size],
                &cc[g * c.state_size..][..c.state_size],
            );
            let dt = softplus(dt[h] + m.dt_bias[h]);
            let decay = (dt * m.a[h]).exp();
            for p in 0..c.head_dim {
                let xv = x[h * c.head_dim + p];
                let sp = &mut s[(h * c.head_dim + p) * c.state_size..][..c.state_size];
                let mut acc = 0f32;
                for n in 0..c.state_size {
                    sp[n] = sp[n] * decay + dt * bg[n] * xv;
                    acc += sp[n] * cg[n];
                }
                out[h * c.head_dim + p] = acc + m.d[h] * xv;
            }
        }
    }
}

/// PyTorch's softplus (linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `y · silu(z)`, RMS-normed per group, times `w` (transformers' `MambaRMSNormGated`).
fn gated_norm(y: &mut [f32], z: &[f32], w: &[f32], groups: usize, eps: f32) {
    for (v, g) in y.iter_mut().zip(z) {
        *v *= silu(*g);
    }
    let size = y.len() / groups;
    for (ys, ws) in y.chunks_exact_mut(size).zip(w.chunks_exact(size)) {
        rms_norm_rows_in_place(ys, ws, eps);
    }
}

impl CausalLm for Mamba2Lm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        let state = self.ssm.state_len();
        vec![LayerKind::Recurrent { state }; self.layers.len()]
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(&mut [BatchSeq { tokens, cache }])?;
        crate::layers::output_logits(&x, want, &self.norm_f, eps, &self.lm_head)
    }

    fn forward_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(batch)?;
        last_logits(&x, batch, &self.norm_f, eps, &self.lm_head)
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let linears = self.layers.iter().map(|m| {
            [&m.z_proj, &m.xbc_proj, &m.dt_proj, &m.out_proj]
                .iter()
                .map(|l| l.weight_bytes())
                .sum::<usize>()
                + 4 * (m.conv_w.len() + m.gate_norm.len())
        });
        // A tied head is the embedding table, already counted.
        let head = match self.untied_head {
            true => self.lm_head.weight_bytes(),
            false => 0,
        };
        linears.sum::<usize>() + self.embed.weight_bytes() + head
    }
}
