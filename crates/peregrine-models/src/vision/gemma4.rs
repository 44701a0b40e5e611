//! Gemma 4's image input (`Gemma4ForConditionalGeneration`'s vision tower, pooler and embedder):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma4/modeling_gemma4.py>
//!
//! The processor (`Gemma4ImageProcessor`) resizes a picture, keeping its aspect, to the largest
//! size whose sides are multiples of pooling kernel × patch and whose patches fit
//! `max_soft_tokens` × kernel²; rescales to 0..1 (no normalisation) and cuts patches with the
//! channel last. The tower embeds each patch linearly from `2x - 1` plus learned column and row
//! embeddings, then runs Gemma-style layers (RMSNorm before and after attention and MLP) whose
//! attention normalises queries, keys (with weights) and values (without), rotates the first
//! half of each head by the patch's column and the second by its row, and does not scale the
//! scores; GQA; a gated GELU-tanh MLP; linear layers clamped to stored ranges. Patches are
//! averaged kernel × kernel, scaled by `sqrt(hidden)`, optionally standardised, and the
//! embedder's unscaled RMSNorm and projection map them to the text model's width. In the prompt
//! the template's `<|image|>` becomes `<|image>` + one `<|image|>` per pooled patch +
//! `<image|>`; the text model's sliding layers see the picture's tokens both ways, its full
//! layers causally.

use std::path::Path;

use peregrine_tensor::{D, DType, Device, QLinear, Tensor};

use super::image::RgbImage;
use super::resize::{Filter, resize};
use super::{ImageEncoder, ImageInput, ImagePrompt, MediaError};
use crate::audio::gemma4_audio::{Clipped, rms};
use crate::config::{Fields, read_json_object};
use crate::weights::{Source, Weights};
use crate::{ModelError, Result};

/// The tower's shape (`vision_config`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Config {
    pub(crate) hidden: usize,
    pub(crate) intermediate: usize,
    pub(crate) layers: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) patch: usize,
    pub(crate) positions: usize,
    pub(crate) pool: usize,
    pub(crate) eps: f64,
    pub(crate) theta: f64,
    pub(crate) clipped: bool,
    pub(crate) standardize: bool,
}

/// What [`Gemma4Vision::from_parts`] builds on besides the weights: from a checkpoint folder or
/// a llama.cpp projector file.
pub(crate) struct Gemma4Parts {
    pub(crate) config: Config,
    pub(crate) text_hidden: usize,
    /// The processor's `max_soft_tokens`, resampling filter and rescale factor.
    pub(crate) processor: (usize, Filter, f64),
    /// `<|image|>`, `<|image>`, `<image|>`.
    pub(crate) tokens: [String; 3],
    /// The text model attends both ways within a picture (`use_bidirectional_attention`).
    pub(crate) both_ways: bool,
}

impl Config {
    fn from_fields(f: &Fields) -> Result<Self> {
        let act = f
            .opt_str("hidden_activation")?
            .unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(f.err(format!(
                "vision_config: `hidden_activation` `{act}` is not supported"
            )));
        }
        if f.opt_bool("attention_bias")? == Some(true) {
            return Err(f.err("vision_config: `attention_bias: true` is not supported".into()));
        }
        let theta = match f.object("rope_parameters")? {
            Some(r) => r.opt_f64("rope_theta")?,
            None => None,
        };
        let heads = f.opt_usize("num_attention_heads")?.unwrap_or(12);
        let c = Self {
            hidden: f.opt_usize("hidden_size")?.unwrap_or(768),
            intermediate: f.opt_usize("intermediate_size")?.unwrap_or(3072),
            layers: f.opt_usize("num_hidden_layers")?.unwrap_or(16),
            heads,
            kv_heads: f.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim: f.opt_usize("head_dim")?.unwrap_or(64),
            patch: f.opt_usize("patch_size")?.unwrap_or(16),
            positions: f.opt_usize("position_embedding_size")?.unwrap_or(10 * 1024),
            pool: f.opt_usize("pooling_kernel_size")?.unwrap_or(3),
            eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            theta: theta.unwrap_or(100.0),
            clipped: f.opt_bool("use_clipped_linears")?.unwrap_or(false),
            standardize: f.opt_bool("standardize")?.unwrap_or(false),
        };
        if c.kv_heads == 0 || !c.heads.is_multiple_of(c.kv_heads) || !c.head_dim.is_multiple_of(4) {
            return Err(f.err(format!("vision_config: unusable shape {c:?}")));
        }
        Ok(c)
    }
}

struct Layer {
    norms: [Tensor; 4],
    q: Clipped,
    k: Clipped,
    v: Clipped,
    o: Clipped,
    q_norm: Tensor,
    k_norm: Tensor,
    gate: Clipped,
    up: Clipped,
    down: Clipped,
}

impl Layer {
    fn load(w: &Weights, p: &str, c: &Config) -> Result<Self> {
        let (h, hd, i) = (c.hidden, c.head_dim, c.intermediate);
        let norm = |name: &str| w.tensor(&format!("{p}.{name}.weight"), &[h]);
        let lin =
            |name: &str, out, inp| Clipped::load(w, &format!("{p}.{name}"), (out, inp), c.clipped);
        Ok(Self {
            norms: [
                norm("input_layernorm")?,
                norm("post_attention_layernorm")?,
                norm("pre_feedforward_layernorm")?,
                norm("post_feedforward_layernorm")?,
            ],
            q: lin("self_attn.q_proj", c.heads * hd, h)?,
            k: lin("self_attn.k_proj", c.kv_heads * hd, h)?,
            v: lin("self_attn.v_proj", c.kv_heads * hd, h)?,
            o: lin("self_attn.o_proj", h, c.heads * hd)?,
            q_norm: w.tensor(&format!("{p}.self_attn.q_norm.weight"), &[hd])?,
            k_norm: w.tensor(&format!("{p}.self_attn.k_norm.weight"), &[hd])?,
            gate: lin("mlp.gate_proj", i, h)?,
            up: lin("mlp.up_proj", i, h)?,
            down: lin("mlp.down_proj", h, i)?,
        })
    }

    /// `x: [patches, hidden]`; `(cos, sin)`: `[patches, head_dim]`.
    fn forward(&self, x: &Tensor, (cos, sin): (&Tensor, &Tensor), c: &Config) -> Result<Tensor> {
        let (n, hd) = (x.dim(0)?, c.head_dim);
        let y = rms(x, Some(&self.norms[0]), c.eps)?;
        // Rotates each half of a head by its own axis (rotate_half within the half).
        let rotate = |t: &Tensor| -> Result<Tensor> {
            let (half, quarter) = (hd / 2, hd / 4);
            let mut parts = Vec::with_capacity(2);
            for axis in 0..2 {
                let part = t.narrow(D::Minus1, axis * half, half)?;
                let (a, b) = (
                    part.narrow(D::Minus1, 0, quarter)?,
                    part.narrow(D::Minus1, quarter, quarter)?,
                );
                let turned = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
                let (cs, sn) = (
                    cos.narrow(1, axis * half, half)?.unsqueeze(1)?,
                    sin.narrow(1, axis * half, half)?.unsqueeze(1)?,
                );
                parts.push((part.broadcast_mul(&cs)? + turned.broadcast_mul(&sn)?)?);
            }
            Ok(Tensor::cat(&parts, D::Minus1)?)
        };
        let heads = |t: Tensor, count: usize| -> Result<Tensor> { Ok(t.reshape((n, count, hd))?) };
        let q = rotate(&rms(
            &heads(self.q.forward(&y)?, c.heads)?,
            Some(&self.q_norm),
            c.eps,
        )?)?;
        let k = rotate(&rms(
            &heads(self.k.forward(&y)?, c.kv_heads)?,
            Some(&self.k_norm),
            c.eps,
        )?)?;
        let v = rms(&heads(self.v.forward(&y)?, c.kv_heads)?, None, c.eps)?;
        // [heads, n, hd], each key-value head repeated for its group of query heads.
        let group = c.heads / c.kv_heads;
        let repeat = |t: Tensor| -> Result<Tensor> {
            let t = t.transpose(0, 1)?.contiguous()?; // [kv, n, hd]
            Ok(t.unsqueeze(1)?
                .repeat((1, group, 1, 1))?
                .reshape((c.heads, n, hd))?)
        };
        let q = q.transpose(0, 1)?.contiguous()?;
        let (k, v) = (repeat(k)?, repeat(v)?);
        // Scores unscaled: the query and key norms set their size.
        let attn = super::attend_all(&q, &k, &v, 1.0)?;
        let x = (x + rms(&self.o.forward(&attn)?, Some(&self.norms[1]), c.eps)?)?;
        let y = rms(&x, Some(&self.norms[2]), c.eps)?;
        let y = self
            .down
            .forward(&(self.gate.forward(&y)?.gelu()? * self.up.forward(&y)?)?)?;
        Ok((&x + rms(&y, Some(&self.norms[3]), c.eps)?)?)
    }
}

/// Gemma 4's vision tower, pooler, embedder and processor.
pub struct Gemma4Vision {
    config: Config,
    input_proj: QLinear,
    /// `[2, positions, hidden]`: column embeddings, then row embeddings.
    position_table: Tensor,
    layers: Vec<Layer>,
    /// `std_bias` and `std_scale` where the tower standardises its output.
    standardize: Option<(Tensor, Tensor)>,
    embed: QLinear,
    max_soft_tokens: usize,
    filter: Filter,
    rescale: f64,
    prompt: ImagePrompt,
    /// `<|image>` and `<image|>`.
    around: (String, String),
    text_hidden: usize,
}

impl Gemma4Vision {
    /// Loads from an HF checkpoint folder whose `config.json` (`fields`) has a Gemma 4
    /// `vision_config`; tensors `model.vision_tower.*` and `model.embed_vision.*`.
    pub fn load(dir: &Path, fields: &Fields, w: &Weights) -> Result<Self> {
        let (vision, text) = super::sections(fields)?;
        let both_ways = match text.opt_str("use_bidirectional_attention")? {
            None => false,
            Some("vision") => true,
            Some(other) => {
                let why = format!(
                    "text_config: `use_bidirectional_attention` `{other}` is not supported"
                );
                return Err(text.err(why));
            }
        };
        let config = Config::from_fields(&vision)?;
        let processor = read_processor(dir, &config)?;
        let keys = ["image_token", "boi_token", "eoi_token"];
        let parts = Gemma4Parts {
            config,
            text_hidden: text.usize("hidden_size")?,
            processor,
            tokens: super::token_names(dir, keys, "images")?,
            both_ways,
        };
        Self::from_parts(parts, w)
    }

    /// The tower and embedder of `parts` from `w` (`model.vision_tower.*`,
    /// `model.embed_vision.*`; a llama.cpp projector file's patch kernel, stored as a
    /// convolution's `[hidden, 3, p, p]`, is turned back into the linear's `(p, p, 3)` order).
    pub(crate) fn from_parts(parts: Gemma4Parts, w: &Weights) -> Result<Self> {
        let Gemma4Parts {
            config,
            text_hidden,
            processor: (max_soft_tokens, filter, rescale),
            tokens: [token, boi, eoi],
            both_ways,
        } = parts;
        let (h, p) = (config.hidden, config.patch);
        let t = "model.vision_tower";
        let layers = (0..config.layers)
            .map(|i| Layer::load(w, &format!("{t}.encoder.layers.{i}"), &config))
            .collect::<Result<_>>()?;
        let standardize = match config.standardize {
            true => Some((
                w.tensor(&format!("{t}.std_bias"), &[h])?,
                w.tensor(&format!("{t}.std_scale"), &[h])?,
            )),
            false => None,
        };
        let input_proj = format!("{t}.patch_embedder.input_proj");
        let input_proj = match w.source() {
            Source::Gguf(_) => {
                let kernel = w.tensor(&format!("{input_proj}.weight"), &[h, 3, p, p])?;
                let kernel = kernel.permute((0, 2, 3, 1))?.contiguous()?;
                QLinear::Dense {
                    w: kernel.reshape((h, 3 * p * p))?,
                    b: None,
                }
            }
            Source::Safetensors(_) => w.linear(&input_proj, h, 3 * p * p, false)?,
        };
        Ok(Self {
            input_proj,
            position_table: w.tensor(
                &format!("{t}.patch_embedder.position_embedding_table"),
                &[2, config.positions, h],
            )?,
            layers,
            standardize,
            embed: w.linear(
                "model.embed_vision.embedding_projection",
                text_hidden,
                h,
                false,
            )?,
            max_soft_tokens,
            filter,
            rescale,
            prompt: ImagePrompt {
                marker: token.clone(),
                image_token: token,
                run: 0,
                both_ways,
            },
            around: (boi, eoi),
            text_hidden,
            config,
        })
    }

    /// transformers' `get_aspect_ratio_preserving_size`: (height, width) for a picture.
    fn target(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let (p, k) = (self.config.patch, self.config.pool);
        let max_patches = self.max_soft_tokens * k * k;
        let target_px = (max_patches * p * p) as f64;
        let factor = (target_px / (height * width) as f64).sqrt();
        let side = k * p;
        let mut th = (factor * height as f64 / side as f64).floor() as usize * side;
        let mut tw = (factor * width as f64 / side as f64).floor() as usize * side;
        let longest = max_patches / (k * k) * side;
        match (th, tw) {
            (0, 0) => {
                return Err(ModelError::Media(MediaError(
                    "the picture is too small".into(),
                )));
            }
            (0, _) => {
                th = side;
                tw = (width / height * side).min(longest);
            }
            (_, 0) => {
                tw = side;
                th = (height / width * side).min(longest);
            }
            _ => {}
        }
        if th * tw > max_patches * p * p || th == 0 || tw == 0 {
            let why = format!("a {width}×{height} picture does not fit {max_patches} patches");
            return Err(ModelError::Media(MediaError(why)));
        }
        Ok((th, tw))
    }

    /// `(cos, sin)` `[patches, head_dim]`: the first half of a head turns with the patch's
    /// column, the second with its row, each at the same `head_dim / 4` frequencies.
    fn rope(&self, rows: usize, cols: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let d = self.config.head_dim;
        let spatial = d / 2;
        let inv: Vec<f32> = (0..spatial / 2)
            .map(|i| (1.0 / self.config.theta.powf((2 * i) as f64 / spatial as f64)) as f32)
            .collect();
        let (mut cos, mut sin) = (
            Vec::with_capacity(rows * cols * d),
            Vec::with_capacity(rows * cols * d),
        );
        for y in 0..rows {
            for x in 0..cols {
                for pos in [x, x, y, y] {
                    cos.extend(inv.iter().map(|f| (pos as f32 * f).cos()));
                    sin.extend(inv.iter().map(|f| (pos as f32 * f).sin()));
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

/// `max_soft_tokens`, the resampling filter and the rescale factor of
/// `preprocessor_config.json` (which must match the tower's patch and kernel).
fn read_processor(dir: &Path, c: &Config) -> Result<(usize, Filter, f64)> {
    let path = dir.join("preprocessor_config.json");
    let map = read_json_object(&path)?;
    let f = Fields::new(&path, &map);
    for (key, want) in [("patch_size", c.patch), ("pooling_kernel_size", c.pool)] {
        if f.opt_usize(key)?.is_some_and(|v| v != want) {
            return Err(f.err(format!(
                "field `{key}` differs from the vision tower's {want}"
            )));
        }
    }
    for (key, default) in [
        ("do_resize", true),
        ("do_rescale", true),
        ("do_normalize", false),
    ] {
        if f.opt_bool(key)?.is_some_and(|v| v != default) {
            return Err(f.err(format!(
                "field `{key}` other than {default} is not supported"
            )));
        }
    }
    let tokens = f.opt_usize("max_soft_tokens")?.unwrap_or(280);
    if ![70, 140, 280, 560, 1120].contains(&tokens) {
        return Err(f.err(format!(
            "field `max_soft_tokens` {tokens}: one of 70, 140, 280, 560, 1120"
        )));
    }
    let code = f.opt_usize("resample")?.unwrap_or(3) as u32;
    let filter = Filter::from_pil(code)
        .ok_or_else(|| f.err(format!("field `resample`: PIL filter {code}")))?;
    Ok((
        tokens,
        filter,
        f.opt_f64("rescale_factor")?.unwrap_or(1.0 / 255.0),
    ))
}

impl ImageEncoder for Gemma4Vision {
    fn preprocess(&self, image: &RgbImage) -> Result<ImageInput> {
        let (th, tw) = self.target(image.height, image.width)?;
        let resized;
        let image = match (th, tw) == (image.height, image.width) {
            true => image,
            false => {
                resized = resize(image, tw, th, self.filter);
                &resized
            }
        };
        let p = self.config.patch;
        let (rows, cols) = (th / p, tw / p);
        // Patch rows in row-major order, each row, column, channel (channel last).
        let mut values = Vec::with_capacity(th * tw * 3);
        for (r, c) in (0..rows).flat_map(|r| (0..cols).map(move |c| (r, c))) {
            for y in r * p..(r + 1) * p {
                let line = &image.data[(y * tw + c * p) * 3..][..p * 3];
                values.extend(line.iter().map(|&b| (f64::from(b) * self.rescale) as f32));
            }
        }
        let tiles = Tensor::from_vec(values, (rows * cols, 3 * p * p), &Device::Cpu)?;
        Ok(ImageInput {
            tiles,
            grid: (rows, cols),
        })
    }

    fn encode(&self, input: &ImageInput) -> Result<Tensor> {
        let c = &self.config;
        let device = self.position_table.device();
        let dtype = self.position_table.dtype();
        let (rows, cols) = input.grid;
        let (k, n) = (c.pool, rows * cols);
        if rows % k != 0 || cols % k != 0 || rows.max(cols) > c.positions {
            let why = format!("a {cols}×{rows}-patch picture does not pool by {k}");
            return Err(ModelError::Media(MediaError(why)));
        }
        let pixels = input.tiles.to_device(device)?.to_dtype(dtype)?;
        let x = self.input_proj.forward(&((pixels - 0.5)? * 2.0)?)?;
        // Column embeddings repeat along rows, row embeddings along columns.
        let (table_x, table_y) = (self.position_table.get(0)?, self.position_table.get(1)?);
        let xs = table_x
            .narrow(0, 0, cols)?
            .unsqueeze(0)?
            .broadcast_as((rows, cols, c.hidden))?;
        let ys = table_y
            .narrow(0, 0, rows)?
            .unsqueeze(1)?
            .broadcast_as((rows, cols, c.hidden))?;
        let mut x = (x + (xs + ys)?.reshape((n, c.hidden))?)?;
        let (cos, sin) = self.rope(rows, cols, device)?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        for layer in &self.layers {
            x = layer.forward(&x, (&cos, &sin), c)?;
        }
        // k×k average pooling over the patch grid, row-major pooled rows, scaled by √hidden.
        let pooled = (x
            .to_dtype(DType::F32)?
            .reshape((rows / k, k, cols / k, k, c.hidden))?)
        .sum(3)?
        .sum(1)?
        .affine((c.hidden as f64).sqrt() / (k * k) as f64, 0.0)?
        .reshape((rows / k * (cols / k), c.hidden))?;
        let pooled = match &self.standardize {
            Some((bias, scale)) => pooled
                .broadcast_sub(&bias.to_dtype(DType::F32)?)?
                .broadcast_mul(&scale.to_dtype(DType::F32)?)?,
            None => pooled,
        };
        let pooled = pooled.to_dtype(dtype)?;
        Ok(self.embed.forward(&rms(&pooled, None, c.eps)?)?)
    }

    fn width(&self) -> usize {
        self.text_hidden
    }

    fn prompt(&self) -> &ImagePrompt {
        &self.prompt
    }

    fn expansion(&self, input: &ImageInput) -> String {
        let (rows, cols) = input.grid;
        let k = self.config.pool;
        let run = self.prompt.image_token.repeat(rows / k * (cols / k));
        format!("{}{run}{}", self.around.0, self.around.1)
    }

    fn runs(&self, input: &ImageInput) -> Vec<super::ImageRun> {
        let (rows, cols) = input.grid;
        let k = self.config.pool;
        let len = rows / k * (cols / k);
        vec![super::ImageRun { len, grid: None }]
    }
}
