//! SmolVLM's image input (`Idefics3ForConditionalGeneration`, `idefics3`; SmolVLM 2's
//! `SmolVLMForConditionalGeneration`, `smolvlm`, is the same model under other names):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/idefics3/modeling_idefics3.py>
//!
//! The processor ([`super::idefics3`]) splits a picture into tiles plus the whole picture; the
//! SigLIP tower encodes each tile, the connector folds each `scale × scale` block of patches into
//! one row (pixel shuffle) and projects it into the text model's width. Each tile's rows take the
//! place of one run of `<image>` tokens; they attend causally, like text.

use std::path::Path;

use peregrine_tensor::{Device, QLinear, Tensor};

use super::idefics3::{Idefics3Processor, Idefics3Tokens, prompt_expansion};
use super::image::RgbImage;
use super::siglip::{SiglipConfig, SiglipVision};
use super::{ImageEncoder, ImageInput, ImagePrompt};
use crate::Result;
use crate::config::Fields;
use crate::weights::Weights;

/// SmolVLM's vision tower, connector and processor.
pub struct SmolVlmVision {
    tower: SiglipVision,
    /// `modality_projection.proj`: `[text hidden, vision hidden · scale²]`, no bias.
    projection: QLinear,
    scale: usize,
    processor: Idefics3Processor,
    tokens: Idefics3Tokens,
    prompt: ImagePrompt,
    device: Device,
    width: usize,
}

impl SmolVlmVision {
    /// Loads from an HF checkpoint folder whose `config.json` (`fields`) has a `vision_config`;
    /// tensors `model.vision_model.*` and `model.connector.*`.
    pub fn load(dir: &Path, fields: &Fields, w: &Weights) -> Result<Self> {
        let vision = (fields.object("vision_config")?)
            .ok_or_else(|| fields.err("missing `vision_config`".into()))?;
        let text = (fields.object("text_config")?)
            .ok_or_else(|| fields.err("missing `text_config`".into()))?;
        let config = SiglipConfig::from_fields(&vision)?;
        let scale = fields.opt_usize("scale_factor")?.unwrap_or(2);
        let side = config.patches_per_side();
        if scale == 0 || !side.is_multiple_of(scale) {
            return Err(fields.err(format!(
                "field `scale_factor` {scale} must divide the {side} patches per side"
            )));
        }
        let run = side * side / (scale * scale);
        let processor = Idefics3Processor::read(dir)?;
        if processor.image_seq_len != run || processor.tile_size() != config.image_size {
            return Err(fields.err(format!(
                "processor_config.json's image_seq_len {} and max_image_size {} do not match the \
                 tower's {run} rows per {} px tile",
                processor.image_seq_len,
                processor.tile_size(),
                config.image_size
            )));
        }
        let th = text.usize("hidden_size")?;
        Self::from_parts(config, scale, processor, (w, "model.vision_model"), th)
    }

    /// The tower of `config` and its connector (`model.connector.modality_projection.proj`,
    /// into `text_hidden`) from `w` under `prefix`, with `processor` (a llama.cpp projector
    /// file's settings, or the checkpoint's); `scale` divides the tower's patches per side.
    pub(crate) fn from_parts(
        config: SiglipConfig,
        scale: usize,
        processor: Idefics3Processor,
        (w, prefix): (&Weights, &str),
        text_hidden: usize,
    ) -> Result<Self> {
        let side = config.patches_per_side();
        let run = side * side / (scale * scale);
        let vh = config.hidden_size;
        let proj = "model.connector.modality_projection.proj";
        let projection = w.linear(proj, text_hidden, vh * scale * scale, false)?;
        let tower = SiglipVision::load(config, w, prefix)?;
        let tokens = Idefics3Tokens::default();
        let prompt = ImagePrompt {
            marker: tokens.image.clone(),
            image_token: tokens.image.clone(),
            run,
            both_ways: false,
        };
        Ok(Self {
            tower,
            projection,
            scale,
            processor,
            tokens,
            prompt,
            device: w.device().clone(),
            width: text_hidden,
        })
    }

    /// Idefics3's pixel shuffle: `[seq, d]` patches (a square grid) → `[seq / s², d · s²]`, each
    /// row the `s × s` block of patches it covers, in transformers' order.
    fn pixel_shuffle(&self, x: &Tensor) -> Result<Tensor> {
        let (seq, d) = x.dims2()?;
        let s = self.scale;
        let h = (seq as f64).sqrt().round() as usize;
        let x = x
            .reshape((h, h / s, d * s))?
            .transpose(0, 1)?
            .contiguous()?;
        let x = x
            .reshape((h / s, h / s, d * s * s))?
            .transpose(0, 1)?
            .contiguous()?;
        Ok(x.reshape((seq / (s * s), d * s * s))?)
    }
}

impl ImageEncoder for SmolVlmVision {
    fn preprocess(&self, image: &RgbImage) -> Result<ImageInput> {
        let out = self.processor.process(image);
        let side = self.processor.tile_size();
        let n = out.tiles.len();
        let values: Vec<f32> = out.tiles.into_iter().flatten().collect();
        let tiles = Tensor::from_vec(values, (n, 3, side, side), &peregrine_tensor::Device::Cpu)?;
        Ok(ImageInput {
            tiles,
            grid: (out.rows, out.cols),
        })
    }

    fn encode(&self, input: &ImageInput) -> Result<Tensor> {
        let device = &self.device;
        let rows = (0..input.tiles.dim(0)?)
            .map(|t| {
                let pixels = input.tiles.get(t)?.to_device(device)?;
                let x = self.pixel_shuffle(&self.tower.forward(&pixels)?)?;
                self.projection.forward(&x).map_err(Into::into)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&rows, 0)?)
    }

    fn width(&self) -> usize {
        self.width
    }

    fn prompt(&self) -> &ImagePrompt {
        &self.prompt
    }

    fn expansion(&self, input: &ImageInput) -> String {
        let (rows, cols) = input.grid;
        prompt_expansion(rows, cols, self.prompt.run, &self.tokens)
    }
}
