//! llama.cpp's multimodal projector files (`--mmproj`): a GGUF of `general.architecture`
//! `clip` holding a vision tower and its projector, written by `convert_hf_to_gguf.py --mmproj`
//! beside the text model's GGUF. Its `clip.vision.*` metadata stands for the HF
//! `vision_config` and image processor, its `v.*` / `mm.*` tensors for the HF ones
//! ([`gguf_name`](crate::weights::gguf_name)). Gemma 3's projector is supported.
//!
//! Preprocessing stays the HF processor's (PIL's bilinear resize to the tower's square, the
//! file's mean and standard deviation), not llama.cpp's own resampler, so a picture gives the
//! pixel values transformers would.

use std::path::Path;
use std::sync::Arc;

use peregrine_tensor::Device;
use peregrine_tensor::device::compute_dtype;

use super::ImageEncoder;
use super::gemma3::{Gemma3Parts, Gemma3Vision};
use super::processor::{HALF, PixelSettings};
use super::resize::Filter;
use super::siglip::SiglipConfig;
use crate::weights::gguf_config::GgufMeta;
use crate::weights::{GgufFile, Source, Weights};
use crate::{ModelError, Result};

/// The vision tower of the llama.cpp projector file `path`.
pub fn load_mmproj(path: &Path, device: &Device) -> Result<Arc<dyn ImageEncoder>> {
    let file = GgufFile::open(path)?;
    let meta = GgufMeta {
        file: &file,
        arch: "clip".into(),
    };
    let bad = |message: String| ModelError::config(path, message);
    let arch = match file.metadata().get("general.architecture") {
        Some(v) => v
            .to_string()
            .map_err(|_| bad("metadata `general.architecture` must be a string".into()))?
            .clone(),
        None => String::new(),
    };
    if arch != "clip" {
        return Err(bad(format!(
            "not a multimodal projector file (`general.architecture` is `{arch}`, expected `clip`)"
        )));
    }
    if meta.opt_bool("has_vision_encoder")? == Some(false) {
        return Err(bad("the projector file has no vision encoder".into()));
    }
    let projector = match meta.opt_str("projector_type")? {
        Some(p) => p,
        None => meta.opt_str("vision.projector_type")?.unwrap_or_default(),
    };
    if projector != "gemma3" {
        return Err(bad(format!(
            "metadata `clip.projector_type` `{projector}` is not supported yet (Gemma 3's \
             `gemma3` is)"
        )));
    }
    let config = SiglipConfig {
        hidden_size: meta.usize("vision.embedding_length")?,
        intermediate_size: meta.usize("vision.feed_forward_length")?,
        layers: meta.usize("vision.block_count")?,
        heads: meta.usize("vision.attention.head_count")?,
        image_size: meta.usize("vision.image_size")?,
        patch_size: meta.usize("vision.patch_size")?,
        eps: (meta.opt_f64("vision.attention.layer_norm_epsilon")?).unwrap_or(1e-6),
    };
    if config.patch_size == 0
        || config.heads == 0
        || !config.image_size.is_multiple_of(config.patch_size)
    {
        return Err(bad(
            "metadata `clip.vision.*`: patch size, heads or image size do not fit".into(),
        ));
    }
    // llama.cpp pools Gemma 3's patches by `scale_factor` per side (4 unless written).
    let scale = (meta.opt_usize("vision.projector.scale_factor")?).unwrap_or(4);
    let per_side = config.patches_per_side() / scale.max(1);
    let triple = |key: &str, default: [f32; 3]| -> Result<[f32; 3]> {
        match meta.opt_f64s(key)?.as_deref() {
            None => Ok(default),
            Some(&[a, b, c]) => Ok([a as f32, b as f32, c as f32]),
            Some(_) => Err(bad(format!("metadata `clip.{key}` must hold 3 numbers"))),
        }
    };
    let processor = PixelSettings {
        filter: Filter::Bilinear,
        rescale: 1.0 / 255.0,
        mean: triple("vision.image_mean", HALF.0)?,
        std: triple("vision.image_std", HALF.1)?,
    };
    let parts = Gemma3Parts {
        text_hidden: meta.usize("vision.projection_dim")?,
        tokens: per_side * per_side,
        soft_token: "<image_soft_token>".into(),
        config,
        processor,
        norm_has_one: true,
    };
    let weights = Weights::new(Source::Gguf(file), device.clone(), compute_dtype(device));
    Ok(Arc::new(Gemma3Vision::from_parts(parts, &weights)?))
}
