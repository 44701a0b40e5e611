//! Mistral 3's image input (`Mistral3ForConditionalGeneration`: the Pixtral tower, a 2×2 patch
//! merger and a GELU projector):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/mistral3/modeling_mistral3.py>
//!
//! The processor (`PixtralImageProcessor` inside `PixtralProcessor`) shrinks a picture to fit
//! `size.longest_edge` (never enlarging), rounds each side up to a multiple of patch × merge
//! (bicubic by default), rescales and normalises with CLIP's statistics. The tower embeds
//! patches with a strided convolution (one matmul here), RMS-normalises them and runs pre-norm
//! layers whose bidirectional attention rotates queries and keys by the patch's row (first half
//! of each rotary pair's frequencies) and column (the other half); a SiLU-gated MLP. The
//! projector RMS-normalises, concatenates each 2×2 block of patches channel by channel
//! (`unfold`'s order), merges them linearly and maps them through linear-GELU-linear. In the
//! prompt the marker `[IMG]` becomes one row of `[IMG]` per merged row of patches, each closed by
//! `[IMG_BREAK]`, the last by `[IMG_END]`: one run of image tokens per row, attended causally.

use std::path::Path;

use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{D, Device, QLinear, Tensor};

use super::image::RgbImage;
use super::processor::PixelSettings;
use super::qwen2_vl::{CLIP_MEAN, CLIP_STD};
use super::resize::resize;
use super::{ImageEncoder, ImageInput, ImagePrompt, ImageRun};
use crate::config::{Fields, read_json_object};
use crate::weights::{Source, Weights};
use crate::{ModelError, Result};

/// The tower's shape (`vision_config`, `PixtralVisionConfig`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PixtralConfig {
    pub(crate) hidden: usize,
    pub(crate) intermediate: usize,
    pub(crate) layers: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) patch: usize,
    pub(crate) theta: f64,
}

/// What [`Mistral3Vision::from_parts`] builds on besides the weights: from a checkpoint folder
/// or a llama.cpp projector file.
pub(crate) struct Mistral3Parts {
    pub(crate) config: PixtralConfig,
    /// `spatial_merge_size`.
    pub(crate) merge: usize,
    /// The projector's linears carry biases.
    pub(crate) bias: bool,
    pub(crate) text_hidden: usize,
    /// The projector's RMSNorm epsilon (the text model's).
    pub(crate) norm_eps: f32,
    pub(crate) processor: PixelSettings,
    /// `size.longest_edge`.
    pub(crate) longest_edge: usize,
    /// `[IMG]`, `[IMG_BREAK]`, `[IMG_END]`.
    pub(crate) tokens: (String, String, String),
}

impl PixtralConfig {
    fn from_fields(f: &Fields) -> Result<Self> {
        let act = f.opt_str("hidden_act")?.unwrap_or("gelu");
        if act != "silu" {
            let why = format!("vision_config: `hidden_act` `{act}` is not supported (`silu` is)");
            return Err(f.err(why));
        }
        let hidden = f.opt_usize("hidden_size")?.unwrap_or(1024);
        let heads = f.opt_usize("num_attention_heads")?.unwrap_or(16);
        let rope = f.object("rope_parameters")?;
        let theta = match &rope {
            Some(r) => r.opt_f64("rope_theta")?,
            None => f.opt_f64("rope_theta")?,
        };
        let c = Self {
            hidden,
            intermediate: f.opt_usize("intermediate_size")?.unwrap_or(4096),
            layers: f.opt_usize("num_hidden_layers")?.unwrap_or(24),
            heads,
            head_dim: f.opt_usize("head_dim")?.unwrap_or(hidden / heads.max(1)),
            patch: f.opt_usize("patch_size")?.unwrap_or(16),
            theta: theta.unwrap_or(10000.0),
        };
        if c.heads * c.head_dim != c.hidden || !c.head_dim.is_multiple_of(4) {
            return Err(f.err(format!("vision_config: unusable shape {c:?}")));
        }
        Ok(c)
    }
}

struct Layer {
    attention_norm: Tensor,
    q: QLinear,
    k: QLinear,
    v: QLinear,
    o: QLinear,
    ffn_norm: Tensor,
    gate: QLinear,
    up: QLinear,
    down: QLinear,
}

impl Layer {
    fn load(w: &Weights, p: &str, c: &PixtralConfig) -> Result<Self> {
        let (h, i) = (c.hidden, c.intermediate);
        let lin = |name: &str, out, inp| w.linear(&format!("{p}.{name}"), out, inp, false);
        // llama.cpp's converter orders each head's query and key rows for its own (interleaved)
        // rotation: put back in HF's halves.
        let rotated = |name: &str| -> Result<QLinear> {
            let name = format!("{p}.{name}");
            if !matches!(w.source(), Source::Gguf(_)) {
                return w.linear(&name, h, h, false);
            }
            let t = w.tensor(&format!("{name}.weight"), &[h, h])?;
            let t = t
                .reshape((c.heads, c.head_dim / 2, 2, h))?
                .transpose(1, 2)?;
            Ok(QLinear::Dense {
                w: t.contiguous()?.reshape((h, h))?,
                b: None,
            })
        };
        Ok(Self {
            attention_norm: w.tensor(&format!("{p}.attention_norm.weight"), &[h])?,
            q: rotated("attention.q_proj")?,
            k: rotated("attention.k_proj")?,
            v: lin("attention.v_proj", h, h)?,
            o: lin("attention.o_proj", h, h)?,
            ffn_norm: w.tensor(&format!("{p}.ffn_norm.weight"), &[h])?,
            gate: lin("feed_forward.gate_proj", i, h)?,
            up: lin("feed_forward.up_proj", i, h)?,
            down: lin("feed_forward.down_proj", h, i)?,
        })
    }

    /// `x: [patches, hidden]`; `(cos, sin)`: `[patches, head_dim]`.
    fn forward(
        &self,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        c: &PixtralConfig,
    ) -> Result<Tensor> {
        let y = rms_norm(x, &self.attention_norm, 1e-5)?;
        let heads = |t: Tensor| super::heads_first(&t, c.heads);
        // rotate_half: the second half of each head negated and moved in front of the first.
        let rotate = |t: Tensor| -> Result<Tensor> {
            let half = c.head_dim / 2;
            let (a, b) = (
                t.narrow(D::Minus1, 0, half)?,
                t.narrow(D::Minus1, half, half)?,
            );
            let turned = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
            Ok((t.broadcast_mul(cos)? + turned.broadcast_mul(sin)?)?)
        };
        let q = rotate(heads(self.q.forward(&y)?)?)?;
        let k = rotate(heads(self.k.forward(&y)?)?)?;
        let v = heads(self.v.forward(&y)?)?;
        let attn = super::attend_all(&q, &k, &v, (c.head_dim as f64).powf(-0.5))?;
        let x = (x + self.o.forward(&attn)?)?;
        let y = rms_norm(&x, &self.ffn_norm, 1e-5)?;
        let y = (self.gate.forward(&y)?.silu()? * self.up.forward(&y)?)?;
        Ok((x + self.down.forward(&y)?)?)
    }
}

/// Mistral 3's vision tower, projector and processor.
pub struct Mistral3Vision {
    config: PixtralConfig,
    /// The patch convolution as a matrix `[hidden, 3 · patch²]`.
    patch: QLinear,
    ln_pre: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    norm_eps: f32,
    merge: usize,
    merger: QLinear,
    linear_1: QLinear,
    linear_2: QLinear,
    processor: PixelSettings,
    longest_edge: usize,
    prompt: ImagePrompt,
    /// `[IMG_BREAK]` and `[IMG_END]`.
    breaks: (String, String),
    text_hidden: usize,
}

impl Mistral3Vision {
    /// Loads from an HF checkpoint folder whose `config.json` (`fields`) has a Pixtral
    /// `vision_config`; tensors `vision_tower.*` and `multi_modal_projector.*`.
    pub fn load(dir: &Path, fields: &Fields, w: &Weights) -> Result<Self> {
        let (vision, text) = super::sections(fields)?;
        let config = PixtralConfig::from_fields(&vision)?;
        if fields
            .opt_str("projector_hidden_act")?
            .is_some_and(|a| a != "gelu")
        {
            return Err(fields.err("field `projector_hidden_act`: only `gelu` is supported".into()));
        }
        match fields.get("vision_feature_layer").and_then(|v| v.as_i64()) {
            None | Some(-1) => {}
            Some(_) => {
                return Err(fields.err("field `vision_feature_layer`: only -1 is supported".into()));
            }
        }
        let text_hidden = text.usize("hidden_size")?;
        let (processor, longest_edge) = read_processor(dir)?;
        let parts = Mistral3Parts {
            config,
            merge: fields.opt_usize("spatial_merge_size")?.unwrap_or(2),
            bias: (fields.opt_bool("multimodal_projector_bias")?).unwrap_or(true),
            text_hidden,
            norm_eps: text.opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
            processor,
            longest_edge,
            tokens: read_tokens(dir)?,
        };
        Self::from_parts(parts, w)
    }

    /// The tower and projector of `parts` from `w` (`vision_tower.*`, `multi_modal_projector.*`).
    pub(crate) fn from_parts(parts: Mistral3Parts, w: &Weights) -> Result<Self> {
        let Mistral3Parts {
            config,
            merge,
            bias,
            text_hidden,
            norm_eps,
            processor,
            longest_edge,
            tokens: names,
        } = parts;
        let (h, p) = (config.hidden, config.patch);
        let kernel = w.tensor("vision_tower.patch_conv.weight", &[h, 3, p, p])?;
        let layers = (0..config.layers)
            .map(|i| Layer::load(w, &format!("vision_tower.transformer.layers.{i}"), &config))
            .collect::<Result<_>>()?;
        let proj = "multi_modal_projector";
        Ok(Self {
            patch: QLinear::Dense {
                w: kernel.reshape((h, 3 * p * p))?,
                b: None,
            },
            ln_pre: w.tensor("vision_tower.ln_pre.weight", &[h])?,
            layers,
            norm: w.tensor(&format!("{proj}.norm.weight"), &[h])?,
            norm_eps,
            merge,
            merger: w.linear(
                &format!("{proj}.patch_merger.merging_layer"),
                h,
                h * merge * merge,
                false,
            )?,
            linear_1: w.linear(&format!("{proj}.linear_1"), text_hidden, h, bias)?,
            linear_2: w.linear(&format!("{proj}.linear_2"), text_hidden, text_hidden, bias)?,
            processor,
            longest_edge,
            prompt: ImagePrompt {
                marker: names.0.clone(),
                image_token: names.0,
                run: 0,
                both_ways: false,
            },
            breaks: (names.1, names.2),
            text_hidden,
            config,
        })
    }

    /// The size the processor resizes a `width × height` picture to: shrunk to fit the
    /// longest edge (floored), each side rounded up to a multiple of patch × merge.
    pub fn resized(&self, width: usize, height: usize) -> (usize, usize) {
        let edge = self.longest_edge as f64;
        let ratio = (height as f64 / edge).max(width as f64 / edge);
        let (mut w, mut h) = (width, height);
        if ratio > 1.0 {
            h = (height as f64 / ratio).floor() as usize;
            w = (width as f64 / ratio).floor() as usize;
        }
        let unit = self.config.patch * self.merge;
        let up = |x: usize| (x.max(1) - 1) / unit * unit + unit;
        (up(w), up(h))
    }

    /// `(cos, sin)` `[patches, head_dim]` of the 2D rotary embedding over a `rows × cols`
    /// patch grid.
    fn rope(&self, rows: usize, cols: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let d = self.config.head_dim;
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| (1.0 / self.config.theta.powf((2 * i) as f64 / d as f64)) as f32)
            .collect();
        // Rows rotate by the even frequencies, columns by the odd ones.
        let (even, odd): (Vec<f32>, Vec<f32>) = (
            inv.iter().step_by(2).copied().collect(),
            inv.iter().skip(1).step_by(2).copied().collect(),
        );
        let (mut cos, mut sin) = (
            Vec::with_capacity(rows * cols * d),
            Vec::with_capacity(rows * cols * d),
        );
        for r in 0..rows {
            for c in 0..cols {
                let angles: Vec<f32> = (even.iter().map(|f| r as f32 * f))
                    .chain(odd.iter().map(|f| c as f32 * f))
                    .collect();
                for _ in 0..2 {
                    cos.extend(angles.iter().map(|a| a.cos()));
                    sin.extend(angles.iter().map(|a| a.sin()));
                }
            }
        }
        let shape = (rows * cols, d);
        Ok((
            Tensor::from_vec(cos, shape, device)?,
            Tensor::from_vec(sin, shape, device)?,
        ))
    }
}

/// `size.longest_edge` and the pixel arithmetic of `preprocessor_config.json`.
fn read_processor(dir: &Path) -> Result<(PixelSettings, usize)> {
    let path = dir.join("preprocessor_config.json");
    let map = read_json_object(&path)?;
    let f = Fields::new(&path, &map);
    if f.opt_bool("do_resize")? == Some(false) {
        return Err(f.err("field `do_resize: false` is not supported".into()));
    }
    let edge = match f.object("size")? {
        Some(size) => size.opt_usize("longest_edge")?,
        None => None,
    };
    let clip = (CLIP_MEAN.map(|x| x as f32), CLIP_STD.map(|x| x as f32));
    Ok((PixelSettings::read(&f, 3, clip)?, edge.unwrap_or(1024)))
}

/// `[IMG]`, `[IMG_BREAK]` and `[IMG_END]`, as `processor_config.json` names them.
fn read_tokens(dir: &Path) -> Result<(String, String, String)> {
    let path = dir.join("processor_config.json");
    let map = match path.is_file() {
        true => read_json_object(&path)?,
        false => Default::default(),
    };
    let f = Fields::new(&path, &map);
    let name = |key: &str, default: &str| -> Result<String> {
        Ok(f.opt_str(key)?.unwrap_or(default).to_string())
    };
    Ok((
        name("image_token", "[IMG]")?,
        name("image_break_token", "[IMG_BREAK]")?,
        name("image_end_token", "[IMG_END]")?,
    ))
}

impl ImageEncoder for Mistral3Vision {
    fn preprocess(&self, image: &RgbImage) -> Result<ImageInput> {
        let (w, h) = self.resized(image.width, image.height);
        let p = &self.processor;
        let values = p.normalise(&resize(image, w, h, p.filter));
        let tiles = Tensor::from_vec(values, (1, 3, h, w), &Device::Cpu)?;
        let unit = self.config.patch * self.merge;
        Ok(ImageInput {
            tiles,
            grid: (h / unit, w / unit),
        })
    }

    fn encode(&self, input: &ImageInput) -> Result<Tensor> {
        let device = self.ln_pre.device();
        let dtype = self.ln_pre.dtype();
        let (_, _, height, width) = input.tiles.dims4()?;
        let p = self.config.patch;
        let (rows, cols) = (height / p, width / p);
        if rows * p != height
            || cols * p != width
            || rows % self.merge != 0
            || cols % self.merge != 0
        {
            let why = format!("a {width}×{height} picture does not split into merged patches");
            return Err(ModelError::Media(super::MediaError(why)));
        }
        // [3, rows·p, cols·p] → [rows, cols, 3, p, p] → one row of 3·p² values per patch.
        let patches = (input.tiles.squeeze(0)?.reshape((3, rows, p, cols, p))?)
            .permute((1, 3, 0, 2, 4))?
            .reshape((rows * cols, 3 * p * p))?
            .to_device(device)?
            .to_dtype(dtype)?;
        let mut x = rms_norm(&self.patch.forward(&patches)?, &self.ln_pre, 1e-5)?;
        let (cos, sin) = self.rope(rows, cols, device)?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        for layer in &self.layers {
            x = layer.forward(&x, (&cos, &sin), &self.config)?;
        }
        let x = rms_norm(&x, &self.norm, self.norm_eps)?;
        // Each m×m block of patches, channel by channel (`unfold`'s order: channel, then row and
        // column within the block), blocks in row-major order.
        let (m, h) = (self.merge, self.config.hidden);
        let blocks = (x.reshape((rows / m, m, cols / m, m, h))?)
            .permute((0, 2, 4, 1, 3))?
            .reshape((rows / m * (cols / m), h * m * m))?;
        let y = self
            .linear_1
            .forward(&self.merger.forward(&blocks)?)?
            .gelu_erf()?;
        Ok(self.linear_2.forward(&y)?)
    }

    fn width(&self) -> usize {
        self.text_hidden
    }

    fn prompt(&self) -> &ImagePrompt {
        &self.prompt
    }

    fn expansion(&self, input: &ImageInput) -> String {
        let (rows, cols) = input.grid;
        let (token, (brk, end)) = (&self.prompt.image_token, &self.breaks);
        let row = token.repeat(cols);
        let mut out = String::new();
        for r in 0..rows {
            out.push_str(&row);
            out.push_str(if r + 1 == rows { end } else { brk });
        }
        out
    }

    fn runs(&self, input: &ImageInput) -> Vec<ImageRun> {
        let (rows, cols) = input.grid;
        vec![
            ImageRun {
                len: cols,
                grid: None
            };
            rows
        ]
    }
}
