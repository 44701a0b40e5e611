//! Gemma 3's image input (`Gemma3ForConditionalGeneration`):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma3/modeling_gemma3.py>
//!
//! The processor resizes every picture to the tower's square size (no pan-and-scan), rescales and
//! normalises it; the SigLIP tower's patches are average-pooled to `mm_tokens_per_image` rows,
//! RMS-normalised (`1 + w`) and projected into the text model's width. In the prompt each
//! `<start_of_image>` becomes `\n\n<start_of_image>` + that many `<image_soft_token>` +
//! `<end_of_image>\n\n`; the soft tokens' embeddings are the projected rows (not scaled by
//! `sqrt(hidden)`), and they attend to each other both ways.

use std::path::Path;

use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, Tensor};

use super::image::RgbImage;
use super::processor::{HALF, PixelSettings};
use super::resize::resize;
use super::siglip::{SiglipConfig, SiglipVision};
use super::{ImageEncoder, ImageInput, ImagePrompt};
use crate::config::{Fields, read_json_object};
use crate::weights::Weights;
use crate::{ModelError, Result};

/// The image processor's settings (`preprocessor_config.json`, Gemma3ImageProcessor): a
/// resize to the tower's square (bilinear unless the config says otherwise), no pan-and-scan.
fn read_processor(dir: &Path, image_size: usize) -> Result<PixelSettings> {
    let path = dir.join("preprocessor_config.json");
    let map = read_json_object(&path)?;
    let f = Fields::new(&path, &map);
    if let Some(size) = f.object("size")? {
        for key in ["height", "width"] {
            if size.opt_usize(key)?.is_some_and(|v| v != image_size) {
                return Err(f.err(format!(
                    "field `size.{key}` differs from the vision tower's image_size {image_size}"
                )));
            }
        }
    }
    if f.opt_bool("do_pan_and_scan")? == Some(true) {
        return Err(f.err("field `do_pan_and_scan: true` is not supported yet".into()));
    }
    if f.opt_bool("do_resize")? == Some(false) {
        return Err(f.err("field `do_resize: false` is not supported".into()));
    }
    PixelSettings::read(&f, 2, HALF)
}

/// Gemma 3's vision tower, projector and processor.
pub struct Gemma3Vision {
    tower: SiglipVision,
    /// `[vision hidden, text hidden]`, applied as `x · W` (HF stores it that way round).
    projection: Tensor,
    norm: Tensor,
    eps: f32,
    /// Patches per side pooled into one row.
    pool: usize,
    processor: PixelSettings,
    prompt: ImagePrompt,
    /// What stands for a picture in the prompt.
    expansion: String,
    dtype: DType,
}

/// What a Gemma 3 tower needs besides its weights, from an HF checkpoint or an mmproj file.
pub(crate) struct Gemma3Parts {
    pub config: SiglipConfig,
    /// The projector's output width (the text model's hidden size).
    pub text_hidden: usize,
    /// Image tokens per picture (a square).
    pub tokens: usize,
    pub processor: PixelSettings,
    /// The token that stands for each image row.
    pub soft_token: String,
    /// Whether the stored projector norm already holds Gemma's `1 + w` (llama.cpp's converter
    /// adds the 1).
    pub norm_has_one: bool,
}

impl Gemma3Vision {
    /// Loads from an HF checkpoint folder whose `config.json` (`config_fields`) has a
    /// `vision_config`; tensors `vision_tower.vision_model.*` and `multi_modal_projector.*`.
    pub fn load(dir: &Path, fields: &Fields, w: &Weights) -> Result<Self> {
        let (vision, text) = super::sections(fields)?;
        let config = SiglipConfig::from_fields(&vision)?;
        let processor = read_processor(dir, config.image_size)?;
        let parts = Gemma3Parts {
            text_hidden: text.usize("hidden_size")?,
            tokens: fields.opt_usize("mm_tokens_per_image")?.unwrap_or(256),
            soft_token: fields
                .opt_str("image_token")?
                .unwrap_or("<image_soft_token>")
                .to_string(),
            config,
            processor,
            norm_has_one: false,
        };
        Self::from_parts(parts, w).map_err(|e| match e {
            ModelError::Config { message, .. } => fields.err(message),
            e => e,
        })
    }

    /// The tower, projector and prompt form from `parts` and the weights (HF names).
    pub(crate) fn from_parts(parts: Gemma3Parts, w: &Weights) -> Result<Self> {
        let Gemma3Parts {
            config,
            text_hidden,
            tokens,
            processor,
            soft_token: soft,
            norm_has_one,
        } = parts;
        let side = config.patches_per_side();
        let per_side = (tokens as f64).sqrt().round() as usize;
        if per_side * per_side != tokens || per_side == 0 || side % per_side != 0 {
            return Err(ModelError::config(
                w.path(),
                format!(
                    "field `mm_tokens_per_image` {tokens}: must be a square whose side divides \
                     the {side} patches per side"
                ),
            ));
        }
        let vh = config.hidden_size;
        let projector = "multi_modal_projector";
        let projection = w.tensor(
            &format!("{projector}.mm_input_projection_weight"),
            &[vh, text_hidden],
        )?;
        let norm = w.tensor(&format!("{projector}.mm_soft_emb_norm.weight"), &[vh])?;
        // Gemma's RMSNorm scales by `1 + w`.
        let norm = if norm_has_one { norm } else { (norm + 1.0)? };
        let eps = config.eps as f32;
        let tower = SiglipVision::load(config, w, "vision_tower.vision_model")?;
        let (boi, eoi) = ("<start_of_image>", "<end_of_image>");
        let prompt = ImagePrompt {
            marker: boi.to_string(),
            image_token: soft.clone(),
            run: tokens,
            both_ways: true,
        };
        let expansion = format!("\n\n{boi}{}{eoi}\n\n", soft.repeat(tokens));
        Ok(Self {
            tower,
            projection,
            norm,
            eps,
            pool: side / per_side,
            processor,
            prompt,
            expansion,
            dtype: w.dtype(),
        })
    }
}

impl ImageEncoder for Gemma3Vision {
    fn preprocess(&self, image: &RgbImage) -> Result<ImageInput> {
        let s = self.tower.config().image_size;
        let p = &self.processor;
        let resized = resize(image, s, s, p.filter);
        let values = p.normalise(&resized);
        let tiles = Tensor::from_vec(values, (1, 3, s, s), &peregrine_tensor::Device::Cpu)?;
        Ok(ImageInput {
            tiles,
            grid: (0, 0),
        })
    }

    fn encode(&self, input: &ImageInput) -> Result<Tensor> {
        let device = self.projection.device();
        let pixels = input.tiles.squeeze(0)?.to_device(device)?;
        let x = self.tower.forward(&pixels)?; // [patches, hidden]
        let (n, h) = x.dims2()?;
        let side = (n as f64).sqrt() as usize;
        let (k, t) = (self.pool, side / self.pool);
        // Average pooling k×k over the patch grid (rows `ty·k + ky`, columns `tx·k + kx`).
        let pooled = (x.to_dtype(DType::F32)?.reshape((t, k, t, k, h))?)
            .sum(3)?
            .sum(1)?
            .affine(1.0 / (k * k) as f64, 0.0)?
            .reshape((t * t, h))?;
        let normed = rms_norm(&pooled, &self.norm.to_dtype(DType::F32)?, self.eps)?;
        let rows = normed.matmul(&self.projection.to_dtype(DType::F32)?)?;
        Ok(rows.to_dtype(self.dtype)?)
    }

    fn width(&self) -> usize {
        self.projection.dims().get(1).copied().unwrap_or(0)
    }

    fn prompt(&self) -> &ImagePrompt {
        &self.prompt
    }

    fn expansion(&self, _: &ImageInput) -> String {
        self.expansion.clone()
    }
}
