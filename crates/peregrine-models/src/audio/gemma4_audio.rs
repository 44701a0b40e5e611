//! Gemma 4's audio tower (a USM-style Conformer) and its embedder into the text model:
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma4/modeling_gemma4.py>
//!
//! Two 3×3 convolutions of stride 2 over (time, mel), each with a LayerNorm over its channels
//! and a ReLU, flattened and projected; then Conformer layers: a half-step feed-forward,
//! chunked local self-attention (each query sees the last `attention_context_left - 1`
//! positions and `attention_context_right - 1` ahead, scores soft-capped, a learned per-channel
//! query scale and sinusoidal relative positions through Transformer-XL's shift), a light
//! convolution (GLU, causal depthwise, RMSNorm, SiLU), a second half-step feed-forward and an
//! RMSNorm; an output projection; and the embedder's unscaled RMSNorm and projection. Linear
//! layers clamp their inputs and outputs to ranges stored beside them. Frames past the clip are
//! zeroed before each convolution and hidden from attention; their rows are dropped.

use peregrine_tensor::{D, DType, Device, QLinear, Tensor};

use crate::config::Fields;
use crate::weights::Weights;
use crate::{ModelError, Result};

/// The tower's shape, from an `audio_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4AudioConfig {
    /// Width of the hidden states.
    pub hidden: usize,
    /// Conformer layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Channels of the two subsampling convolutions (the first equals the mel bins).
    pub channels: [usize; 2],
    /// Taps of the light convolution's depthwise kernel.
    pub conv_kernel: usize,
    /// Weight of the feed-forward blocks' output (`residual_weight`).
    pub residual_weight: f64,
    /// Queries per attention block.
    pub chunk: usize,
    /// `attention_context_left`: a query sees this many positions back, itself included.
    pub left: usize,
    /// `attention_context_right`: a query sees this many positions ahead, less one.
    pub right: usize,
    /// Attention scores' soft cap.
    pub logit_cap: f64,
    /// The score of a hidden position.
    pub invalid_logit: f32,
    /// The clamp on hidden states (`gradient_clipping`).
    pub clip: f64,
    /// RMSNorm and LayerNorm epsilon.
    pub eps: f64,
    /// Width of the tower's output (`output_proj_dims`).
    pub out_dims: usize,
    /// Linear layers carry clamp ranges (`use_clipped_linears`).
    pub clipped: bool,
}

impl Gemma4AudioConfig {
    /// Reads an `audio_config` (Gemma 4's defaults where a key is absent).
    pub fn from_fields(f: &Fields) -> Result<Self> {
        let act = f.opt_str("hidden_act")?.unwrap_or("silu");
        if act != "silu" {
            return Err(f.err(format!(
                "audio_config: `hidden_act` `{act}` is not supported (`silu` is)"
            )));
        }
        let channels = match f.get("subsampling_conv_channels") {
            None => vec![128, 32],
            Some(_) => f.usize_list("subsampling_conv_channels")?,
        };
        let [c0, c1] = channels[..] else {
            return Err(
                f.err("audio_config: `subsampling_conv_channels` must hold two numbers".into())
            );
        };
        let c = Self {
            hidden: f.opt_usize("hidden_size")?.unwrap_or(1024),
            layers: f.opt_usize("num_hidden_layers")?.unwrap_or(12),
            heads: f.opt_usize("num_attention_heads")?.unwrap_or(8),
            channels: [c0, c1],
            conv_kernel: f.opt_usize("conv_kernel_size")?.unwrap_or(5),
            residual_weight: f.opt_f64("residual_weight")?.unwrap_or(0.5),
            chunk: f.opt_usize("attention_chunk_size")?.unwrap_or(12),
            left: f.opt_usize("attention_context_left")?.unwrap_or(13),
            right: match f.get("attention_context_right") {
                None => 0,
                Some(v) => v.as_u64().ok_or_else(|| {
                    f.err(format!(
                        "audio_config: `attention_context_right` must be a count, got {v}"
                    ))
                })? as usize,
            },
            logit_cap: f.opt_f64("attention_logit_cap")?.unwrap_or(50.0),
            invalid_logit: f.opt_f64("attention_invalid_logits_value")?.unwrap_or(-1e9) as f32,
            clip: f
                .opt_f64("gradient_clipping")?
                .unwrap_or(1e10)
                .min(f64::from(f32::MAX)),
            eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            out_dims: f.opt_usize("output_proj_dims")?.unwrap_or(1536),
            clipped: f.opt_bool("use_clipped_linears")?.unwrap_or(true),
        };
        if c.heads == 0 || !c.hidden.is_multiple_of(c.heads) || c.chunk == 0 || c.left == 0 {
            return Err(f.err(format!("audio_config: unusable shape {c:?}")));
        }
        Ok(c)
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Keys per attention block: the block, the past it sees and the future.
    fn context(&self) -> usize {
        self.chunk + self.left - 1 + self.right
    }
}

/// Gemma 4's RMSNorm: `x · (mean(x²) + eps)^-½ · w` in f32 (no `1 + w`), `w` optional.
pub(crate) fn rms(x: &Tensor, w: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let ms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?;
    let y = x.broadcast_mul(&ms.powf(-0.5)?)?;
    Ok(match w {
        Some(w) => y.broadcast_mul(w)?,
        None => y,
    })
}

fn clamp(x: &Tensor, limit: f64) -> Result<Tensor> {
    Ok(x.clamp(-limit, limit)?)
}

/// A bias-free linear layer whose input and output are clamped to stored ranges (Gemma 4's
/// `Gemma4ClippableLinear`).
pub(crate) struct Clipped {
    w: QLinear,
    ranges: Option<[f64; 4]>,
}

impl Clipped {
    pub(crate) fn load(
        w: &Weights,
        p: &str,
        (out, inp): (usize, usize),
        clipped: bool,
    ) -> Result<Self> {
        // A scalar, or the one-value vector llama.cpp's converter makes of it.
        let scalar = |name: &str| -> Result<f64> {
            let name = format!("{p}.{name}");
            let shape = match w.dims(&name)?.as_slice() {
                [1] => vec![1],
                _ => vec![],
            };
            let t = w.tensor(&name, &shape)?.to_dtype(DType::F32)?;
            Ok(f64::from(t.flatten_all()?.get(0)?.to_scalar::<f32>()?))
        };
        let ranges = match clipped {
            true => Some([
                scalar("input_min")?,
                scalar("input_max")?,
                scalar("output_min")?,
                scalar("output_max")?,
            ]),
            false => None,
        };
        let w = w.linear(&format!("{p}.linear"), out, inp, false)?;
        Ok(Self { w, ranges })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let Some([a, b, c, d]) = self.ranges else {
            return Ok(self.w.forward(x)?);
        };
        Ok(self.w.forward(&x.clamp(a, b)?)?.clamp(c, d)?)
    }
}

struct FeedForward {
    pre: Tensor,
    up: Clipped,
    down: Clipped,
    post: Tensor,
}

impl FeedForward {
    fn load(w: &Weights, p: &str, c: &Gemma4AudioConfig) -> Result<Self> {
        let h = c.hidden;
        Ok(Self {
            pre: w.tensor(&format!("{p}.pre_layer_norm.weight"), &[h])?,
            up: Clipped::load(w, &format!("{p}.ffw_layer_1"), (4 * h, h), c.clipped)?,
            down: Clipped::load(w, &format!("{p}.ffw_layer_2"), (h, 4 * h), c.clipped)?,
            post: w.tensor(&format!("{p}.post_layer_norm.weight"), &[h])?,
        })
    }

    fn forward(&self, x: &Tensor, c: &Gemma4AudioConfig) -> Result<Tensor> {
        let y = rms(&clamp(x, c.clip)?, Some(&self.pre), c.eps)?;
        let y = self.down.forward(&self.up.forward(&y)?.silu()?)?;
        let y = rms(&clamp(&y, c.clip)?, Some(&self.post), c.eps)?;
        Ok((x + (y * c.residual_weight)?)?)
    }
}

struct LightConv {
    pre: Tensor,
    start: Clipped,
    /// The depthwise kernel `[hidden, kernel]`.
    kernel: Tensor,
    norm: Tensor,
    end: Clipped,
}

impl LightConv {
    fn load(w: &Weights, p: &str, c: &Gemma4AudioConfig) -> Result<Self> {
        let h = c.hidden;
        let kernel = w.tensor(
            &format!("{p}.depthwise_conv1d.weight"),
            &[h, 1, c.conv_kernel],
        )?;
        Ok(Self {
            pre: w.tensor(&format!("{p}.pre_layer_norm.weight"), &[h])?,
            start: Clipped::load(w, &format!("{p}.linear_start"), (2 * h, h), c.clipped)?,
            kernel: kernel.squeeze(1)?,
            norm: w.tensor(&format!("{p}.conv_norm.weight"), &[h])?,
            end: Clipped::load(w, &format!("{p}.linear_end"), (h, h), c.clipped)?,
        })
    }

    /// `x: [time, hidden]`.
    fn forward(&self, x: &Tensor, c: &Gemma4AudioConfig) -> Result<Tensor> {
        let (t, h) = x.dims2()?;
        let y = self.start.forward(&rms(x, Some(&self.pre), c.eps)?)?;
        let y = (y.narrow(1, 0, h)? * candle_sigmoid(&y.narrow(1, h, h)?)?)?;
        // Causal depthwise convolution: output t sums inputs t - k + 1 ..= t.
        let k = c.conv_kernel;
        let padded = y.pad_with_zeros(0, k - 1, 0)?;
        let mut conv = Tensor::zeros((t, h), y.dtype(), y.device())?;
        for i in 0..k {
            let tap = self.kernel.narrow(1, i, 1)?.squeeze(1)?;
            conv = (conv + padded.narrow(0, i, t)?.broadcast_mul(&tap)?)?;
        }
        let y = rms(&clamp(&conv, c.clip)?, Some(&self.norm), c.eps)?.silu()?;
        Ok((x + self.end.forward(&y)?)?)
    }
}

fn candle_sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(peregrine_tensor::nn::ops::sigmoid(x)?)
}

struct Attention {
    q: Clipped,
    k: Clipped,
    v: Clipped,
    post: Clipped,
    relative_k: QLinear,
    /// `softplus(per_dim_scale) · hd^-½ / ln 2`, per channel of a head.
    q_scale: Vec<f32>,
}

impl Attention {
    fn load(w: &Weights, p: &str, c: &Gemma4AudioConfig) -> Result<Self> {
        let (h, hd) = (c.hidden, c.head_dim());
        let lin = |name: &str| Clipped::load(w, &format!("{p}.{name}"), (h, h), c.clipped);
        let per_dim = w
            .tensor(&format!("{p}.per_dim_scale"), &[hd])?
            .to_dtype(DType::F32)?;
        let base = (hd as f64).powf(-0.5) / std::f64::consts::LN_2;
        let softplus = |x: f32| if x > 20.0 { x } else { x.exp().ln_1p() };
        let q_scale = (per_dim.to_vec1::<f32>()?.into_iter())
            .map(|s| (base as f32) * softplus(s))
            .collect();
        Ok(Self {
            q: lin("q_proj")?,
            k: lin("k_proj")?,
            v: lin("v_proj")?,
            post: lin("post")?,
            relative_k: w.linear(&format!("{p}.relative_k_proj"), h, h, false)?,
            q_scale,
        })
    }

    /// `x: [time, hidden]`; `positions`: the relative position embeddings `[P, hidden]`;
    /// `valid`: which positions hold the clip.
    fn forward(
        &self,
        x: &Tensor,
        positions: &Tensor,
        valid: &[bool],
        c: &Gemma4AudioConfig,
    ) -> Result<Tensor> {
        let (t, h) = x.dims2()?;
        let (heads, hd) = (c.heads, c.head_dim());
        let rows = |y: Tensor| -> Result<Vec<f32>> {
            Ok(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
        };
        let k_scale = ((1.0 + std::f64::consts::E).ln() / std::f64::consts::LN_2) as f32;
        let mut q = rows(self.q.forward(x)?)?;
        for (i, q) in q.iter_mut().enumerate() {
            *q *= self.q_scale[i % hd];
        }
        let k: Vec<f32> = rows(self.k.forward(x)?)?
            .into_iter()
            .map(|k| k * k_scale)
            .collect();
        let v = rows(self.v.forward(x)?)?;
        let rel = rows(self.relative_k.forward(positions)?)?;
        let p = positions.dim(0)?;
        let (ctx, chunk, past) = (c.context(), c.chunk, c.left - 1);
        let cap = c.logit_cap as f32;
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
        let mut out = vec![0.0f32; t * h];
        let mut w = vec![0.0f32; ctx];
        for head in 0..heads {
            fn at(m: &[f32], row: usize, (h, head, hd): (usize, usize, usize)) -> &[f32] {
                &m[row * h + head * hd..][..hd]
            }
            let at = |m, row| at(m, row, (h, head, hd));
            for i in 0..t {
                let (block, j) = (i / chunk, i % chunk);
                for (u, w) in w.iter_mut().enumerate() {
                    let kv = (block * chunk + u) as isize - past as isize;
                    let key = usize::try_from(kv).ok().filter(|&kv| kv < t);
                    let ac = key.map_or(0.0, |kv| dot(at(&q, i), at(&k, kv)));
                    // Transformer-XL's shift of the [chunk, P] scores into [chunk, context].
                    let f = j * ctx + u;
                    let (r, col) = (f / (ctx + 1), f % (ctx + 1));
                    let row = block * chunk + r;
                    let bd = match col < p && row < t {
                        true => dot(at(&q, row), &rel[col * h + head * hd..][..hd]),
                        false => 0.0,
                    };
                    let allowed = key.is_some_and(|kv| {
                        let dist = i as isize - kv as isize;
                        valid[kv]
                            && ((0..past as isize).contains(&dist)
                                || (dist < 0 && -dist < c.right as isize))
                    });
                    *w = match allowed {
                        true => ((ac + bd) / cap).tanh() * cap,
                        false => c.invalid_logit,
                    };
                }
                let max = w.iter().copied().fold(f32::MIN, f32::max);
                let total: f32 = w
                    .iter_mut()
                    .map(|w| {
                        *w = (*w - max).exp();
                        *w
                    })
                    .sum();
                let o = &mut out[i * h + head * hd..][..hd];
                for (u, &w) in w.iter().enumerate() {
                    let kv = (block * chunk + u) as isize - past as isize;
                    if let Some(kv) = usize::try_from(kv).ok().filter(|&kv| kv < t) {
                        for (o, v) in o.iter_mut().zip(at(&v, kv)) {
                            *o += w / total * v;
                        }
                    }
                }
            }
        }
        let out = Tensor::from_vec(out, (t, h), &Device::Cpu)?
            .to_device(x.device())?
            .to_dtype(x.dtype())?;
        self.post.forward(&out)
    }
}

struct Layer {
    ff1: FeedForward,
    attn: Attention,
    norm_pre_attn: Tensor,
    norm_post_attn: Tensor,
    conv: LightConv,
    ff2: FeedForward,
    norm_out: Tensor,
}

impl Layer {
    fn load(w: &Weights, p: &str, c: &Gemma4AudioConfig) -> Result<Self> {
        let norm = |name: &str| w.tensor(&format!("{p}.{name}.weight"), &[c.hidden]);
        Ok(Self {
            ff1: FeedForward::load(w, &format!("{p}.feed_forward1"), c)?,
            attn: Attention::load(w, &format!("{p}.self_attn"), c)?,
            norm_pre_attn: norm("norm_pre_attn")?,
            norm_post_attn: norm("norm_post_attn")?,
            conv: LightConv::load(w, &format!("{p}.lconv1d"), c)?,
            ff2: FeedForward::load(w, &format!("{p}.feed_forward2"), c)?,
            norm_out: norm("norm_out")?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        positions: &Tensor,
        valid: &[bool],
        c: &Gemma4AudioConfig,
    ) -> Result<Tensor> {
        let x = self.ff1.forward(x, c)?;
        let y = rms(&clamp(&x, c.clip)?, Some(&self.norm_pre_attn), c.eps)?;
        let y = self.attn.forward(&y, positions, valid, c)?;
        let x = (&x + rms(&clamp(&y, c.clip)?, Some(&self.norm_post_attn), c.eps)?)?;
        let x = self.ff2.forward(&self.conv.forward(&x, c)?, c)?;
        rms(&clamp(&x, c.clip)?, Some(&self.norm_out), c.eps)
    }
}

/// Gemma 4's audio tower and embedder: log-mel frames in, rows of the text model's input
/// embeddings out.
pub struct Gemma4AudioTower {
    config: Gemma4AudioConfig,
    convs: [(Tensor, Tensor); 2],
    input_proj: QLinear,
    layers: Vec<Layer>,
    output_proj: QLinear,
    embed: QLinear,
    text_width: usize,
}

impl Gemma4AudioTower {
    /// Loads `model.audio_tower.*` and `model.embed_audio.*` (into `text_width` values).
    pub fn load(config: Gemma4AudioConfig, w: &Weights, text_width: usize) -> Result<Self> {
        let p = "model.audio_tower";
        let [c0, c1] = config.channels;
        let conv = |i: usize, inp: usize, out: usize| -> Result<(Tensor, Tensor)> {
            let s = format!("{p}.subsample_conv_projection.layer{i}");
            Ok((
                w.tensor(&format!("{s}.conv.weight"), &[out, inp, 3, 3])?,
                w.tensor(&format!("{s}.norm.weight"), &[out])?,
            ))
        };
        let flat = c0 / 4 * c1;
        let layers = (0..config.layers)
            .map(|i| Layer::load(w, &format!("{p}.layers.{i}"), &config))
            .collect::<Result<_>>()?;
        Ok(Self {
            convs: [conv(0, 1, c0)?, conv(1, c0, c1)?],
            input_proj: w.linear(
                &format!("{p}.subsample_conv_projection.input_proj_linear"),
                config.hidden,
                flat,
                false,
            )?,
            layers,
            output_proj: w.linear(
                &format!("{p}.output_proj"),
                config.out_dims,
                config.hidden,
                true,
            )?,
            embed: w.linear(
                "model.embed_audio.embedding_projection",
                text_width,
                config.out_dims,
                false,
            )?,
            text_width,
            config,
        })
    }

    /// Width of the rows [`encode`](Self::encode) gives.
    pub fn width(&self) -> usize {
        self.text_width
    }

    /// Which positions after the two strided convolutions hold the clip, from its frames'.
    pub fn subsampled(valid: &[bool]) -> Vec<bool> {
        let half = |v: &[bool]| v.iter().step_by(2).copied().collect::<Vec<_>>();
        half(&half(valid))
    }

    /// Sinusoidal relative position embeddings `[context / 2 + 1, hidden]`, farthest first.
    fn positions(&self, device: &Device) -> Result<Tensor> {
        let c = &self.config;
        let half = c.hidden / 2;
        let step = (10000f64).ln() / (half.max(2) - 1) as f64;
        let rows = c.context() / 2 + 1;
        let mut out = Vec::with_capacity(rows * c.hidden);
        for r in 0..rows {
            let pos = (c.context() / 2 - r) as f32;
            let scaled = (0..half).map(|i| pos * ((-(i as f64) * step).exp() as f32));
            let scaled: Vec<f32> = scaled.collect();
            out.extend(scaled.iter().map(|s| s.sin()));
            out.extend(scaled.iter().map(|s| s.cos()));
        }
        Ok(Tensor::from_vec(out, (rows, c.hidden), device)?)
    }

    /// `features: [frames][mels]` (row-major f32) with `valid` frames → the clip's rows
    /// `[valid positions, text width]`.
    pub fn encode(&self, features: &[f32], valid: &[bool], device: &Device) -> Result<Tensor> {
        let (c, frames) = (&self.config, valid.len());
        let mels = c.channels[0];
        if features.len() != frames * mels || frames == 0 {
            let why = format!(
                "{} feature values for {frames} frames of {mels} bins",
                features.len()
            );
            return Err(ModelError::Media(crate::vision::MediaError(why)));
        }
        let dtype = self.output_proj_dtype();
        let mut x = Tensor::from_vec(features.to_vec(), (1, 1, frames, mels), &Device::Cpu)?
            .to_device(device)?
            .to_dtype(dtype)?;
        let mut mask = valid.to_vec();
        for (kernel, norm) in &self.convs {
            let m: Vec<f32> = mask.iter().map(|&v| f32::from(u8::from(v))).collect();
            let m = Tensor::from_vec(m, (1, 1, mask.len(), 1), device)?.to_dtype(dtype)?;
            let y = x
                .broadcast_mul(&m)?
                .conv2d(kernel, 1, 2, 1, 1)?
                .permute((0, 2, 3, 1))?;
            // LayerNorm over the channels, without a bias.
            let mean = y.mean_keepdim(D::Minus1)?;
            let centred = y.broadcast_sub(&mean)?;
            let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
            let y = centred
                .broadcast_div(&(var + c.eps)?.sqrt()?)?
                .broadcast_mul(norm)?
                .relu()?;
            x = y.permute((0, 3, 1, 2))?;
            mask = mask.iter().step_by(2).copied().collect();
        }
        let (_, channels, t, f) = x.dims4()?;
        let x = x.permute((0, 2, 3, 1))?.reshape((t, f * channels))?;
        let mut x = self.input_proj.forward(&x)?;
        let positions = self.positions(device)?.to_dtype(dtype)?;
        for layer in &self.layers {
            x = layer.forward(&x, &positions, &mask, c)?;
        }
        let x = self.output_proj.forward(&x)?;
        let rows = self.embed.forward(&rms(&x, None, c.eps)?)?;
        let keep: Vec<u32> = (0..t as u32).filter(|&i| mask[i as usize]).collect();
        let keep = Tensor::new(keep.as_slice(), device)?;
        Ok(rows.index_select(&keep, 0)?)
    }

    fn output_proj_dtype(&self) -> DType {
        self.convs[0].0.dtype()
    }
}
