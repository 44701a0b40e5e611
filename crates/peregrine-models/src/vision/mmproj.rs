//! llama.cpp's multimodal projector files (`--mmproj`): a GGUF of `general.architecture`
//! `clip` holding a vision tower and its projector, written by `convert_hf_to_gguf.py --mmproj`
//! beside the text model's GGUF. Its `clip.vision.*` metadata stands for the HF
//! `vision_config` and image processor, its `v.*` / `mm.*` tensors for the HF ones
//! ([`gguf_name`](crate::weights::gguf_name)). Gemma 3's projector (`gemma3`), Gemma 4's vision
//! tower (`gemma4v`; the file's audio tower is not read), SmolVLM's
//! (`idefics3`), Mistral 3's (`pixtral`) and the Qwen VLs' (`qwen2vl_merger`, `qwen2.5vl_merger`, `qwen3vl_merger`: Qwen2-VL,
//! Qwen2.5-VL, Qwen3-VL, Qwen3.5) are supported.
//!
//! Preprocessing stays the HF processor's (Gemma 3: PIL's bilinear resize to the tower's
//! square; SmolVLM: Lanczos to the file's `preproc_image_size`, then tiles of the tower's size;
//! Qwen: the dynamic resolution of `Qwen2VLImageProcessor` with its default pixel
//! bounds; the file's mean and standard deviation), not llama.cpp's own resampler, so a picture
//! gives the pixel values transformers would.

use std::path::Path;
use std::sync::Arc;

use peregrine_tensor::device::compute_dtype;
use peregrine_tensor::{Device, QLinear, Tensor};

use super::ImageEncoder;
use super::gemma3::{Gemma3Parts, Gemma3Vision};
use super::gemma4::{Config as Gemma4Config, Gemma4Parts, Gemma4Vision};
use super::idefics3::Idefics3Processor;
use super::mistral3::{Mistral3Parts, Mistral3Vision, PixtralConfig};
use super::processor::{HALF, PixelSettings};
use super::qwen2_5_vl::{Qwen25VisionConfig, Qwen25VisionTower, QwenVisionKind};
use super::qwen2_vl::{CLIP_MEAN, CLIP_STD, Qwen2VlProcessor, QwenVlVision};
use super::qwen3_vl::{Qwen3VisionConfig, Qwen3VisionTower};
use super::resize::Filter;
use super::siglip::SiglipConfig;
use super::smolvlm::SmolVlmVision;
use crate::weights::gguf_config::GgufMeta;
use crate::weights::{GgufFile, Source, Weights};
use crate::{ModelError, Result};

/// OpenAI CLIP's mean and standard deviation, Qwen's defaults, as f32.
const CLIP: ([f32; 3], [f32; 3]) = (
    [
        CLIP_MEAN[0] as f32,
        CLIP_MEAN[1] as f32,
        CLIP_MEAN[2] as f32,
    ],
    [CLIP_STD[0] as f32, CLIP_STD[1] as f32, CLIP_STD[2] as f32],
);

/// The vision tower of the llama.cpp projector file `path`.
pub fn load_mmproj(path: &Path, device: &Device) -> Result<Arc<dyn ImageEncoder>> {
    let w = Weights::new(
        Source::Gguf(GgufFile::open(path)?),
        device.clone(),
        compute_dtype(device),
    );
    let Source::Gguf(file) = w.source() else {
        unreachable!("built from a GGUF file just above")
    };
    let meta = GgufMeta {
        file,
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
    let triple = |key: &str, default: [f32; 3]| -> Result<[f32; 3]> {
        match meta.opt_f64s(key)?.as_deref() {
            None => Ok(default),
            Some(&[a, b, c]) => Ok([a as f32, b as f32, c as f32]),
            Some(_) => Err(bad(format!("metadata `clip.{key}` must hold 3 numbers"))),
        }
    };
    match projector {
        "gemma3" => {}
        "gemma4v" => {
            let vision = gemma4_vision(&meta, &w).map_err(|e| bad(e.to_string()))?;
            return Ok(Arc::new(vision));
        }
        "pixtral" => {
            let config = PixtralConfig {
                hidden: meta.usize("vision.embedding_length")?,
                intermediate: meta.usize("vision.feed_forward_length")?,
                layers: meta.usize("vision.block_count")?,
                heads: meta.usize("vision.attention.head_count")?,
                head_dim: 0,
                patch: meta.usize("vision.patch_size")?,
                // llama.cpp's, which the file does not record
                theta: 10000.0,
            };
            let config = PixtralConfig {
                head_dim: config.hidden / config.heads.max(1),
                ..config
            };
            let parts = Mistral3Parts {
                merge: meta.opt_usize("vision.spatial_merge_size")?.unwrap_or(2),
                bias: w.contains("multi_modal_projector.linear_1.bias"),
                text_hidden: meta.usize("vision.projection_dim")?,
                // the text model's, which the file does not record: Mistral 3's
                norm_eps: 1e-5,
                processor: PixelSettings {
                    filter: Filter::Bicubic,
                    rescale: 1.0 / 255.0,
                    mean: triple("vision.image_mean", CLIP.0)?,
                    std: triple("vision.image_std", CLIP.1)?,
                },
                longest_edge: meta.usize("vision.image_size")?,
                tokens: ("[IMG]".into(), "[IMG_BREAK]".into(), "[IMG_END]".into()),
                config,
            };
            let vision = Mistral3Vision::from_parts(parts, &w);
            return Ok(Arc::new(vision.map_err(|e| bad(e.to_string()))?));
        }
        "idefics3" => {
            let config = siglip_config(&meta).map_err(|e| bad(e.to_string()))?;
            let scale = meta
                .opt_usize("vision.projector.scale_factor")?
                .unwrap_or(2);
            let side = config.patches_per_side();
            if scale == 0 || !side.is_multiple_of(scale) {
                return Err(bad(format!(
                    "metadata `clip.vision.projector.scale_factor` {scale} must divide the {side} \
                     patches per side"
                )));
            }
            let tile = config.image_size;
            let processor = Idefics3Processor {
                do_resize: true,
                longest_edge: meta
                    .opt_usize("vision.preproc_image_size")?
                    .unwrap_or(4 * tile),
                tile,
                split: true,
                pixels: PixelSettings {
                    filter: Filter::Lanczos,
                    rescale: 1.0 / 255.0,
                    mean: triple("vision.image_mean", HALF.0)?,
                    std: triple("vision.image_std", HALF.1)?,
                },
                image_seq_len: side * side / (scale * scale),
            };
            let text = w.dims("model.connector.modality_projection.proj.weight")?[0];
            let parts = (&w, "model.vision_model");
            let vision = SmolVlmVision::from_parts(config, scale, processor, parts, text);
            return Ok(Arc::new(vision.map_err(|e| bad(e.to_string()))?));
        }
        "qwen2vl_merger" | "qwen2.5vl_merger" | "qwen3vl_merger" => {
            let (mean, std) = (
                triple("vision.image_mean", CLIP.0)?,
                triple("vision.image_std", CLIP.1)?,
            );
            let processor = |config: &Qwen25VisionConfig| -> Result<Qwen2VlProcessor> {
                Ok(Qwen2VlProcessor {
                    min_pixels: meta
                        .opt_usize("vision.image_min_pixels")?
                        .unwrap_or(56 * 56),
                    max_pixels: meta
                        .opt_usize("vision.image_max_pixels")?
                        .unwrap_or(28 * 28 * 1280),
                    patch: config.patch_size,
                    temporal: config.temporal_patch_size,
                    merge: config.spatial_merge_size,
                    pixels: PixelSettings {
                        filter: Filter::Bicubic,
                        rescale: 1.0 / 255.0,
                        mean,
                        std,
                    },
                })
            };
            let tower_err = |e: ModelError| bad(e.to_string());
            if projector == "qwen3vl_merger" {
                let tower = qwen3_tower(&meta, &w).map_err(tower_err)?;
                let processor = processor(&tower.config().base)?;
                return Ok(Arc::new(QwenVlVision::from_qwen3_tower(tower, processor)));
            }
            let kind = match projector {
                "qwen2vl_merger" => QwenVisionKind::Qwen2,
                _ => QwenVisionKind::Qwen25,
            };
            let tower = qwen_tower(&meta, &w, kind).map_err(tower_err)?;
            let processor = processor(tower.config())?;
            return Ok(Arc::new(QwenVlVision::from_tower(tower, processor)));
        }
        _ => {
            return Err(bad(format!(
                "metadata `clip.projector_type` `{projector}` is not supported yet (Gemma 3's \
                 `gemma3`, Gemma 4's `gemma4v`, SmolVLM's `idefics3`, Mistral 3's `pixtral`, Qwen2-VL's `qwen2vl_merger`, Qwen2.5-VL's \
                 `qwen2.5vl_merger` and Qwen3-VL's and Qwen3.5's `qwen3vl_merger` are)"
            )));
        }
    }
    let config = siglip_config(&meta).map_err(|e| bad(e.to_string()))?;
    // llama.cpp pools Gemma 3's patches by `scale_factor` per side (4 unless written).
    let scale = (meta.opt_usize("vision.projector.scale_factor")?).unwrap_or(4);
    let per_side = config.patches_per_side() / scale.max(1);
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
    Ok(Arc::new(Gemma3Vision::from_parts(parts, &w)?))
}

/// Gemma 4's tower from a projector file: its shape from `clip.vision.*` and its tensors' shapes;
/// the processor's and prompt's settings, which the file does not record, are the released
/// checkpoints' (280 soft tokens, 3×3 pooling, bicubic, `<|image|>` between `<|image>` and
/// `<image|>`, seen both ways).
fn gemma4_vision(meta: &GgufMeta, w: &Weights) -> Result<Gemma4Vision> {
    let t = "model.vision_tower";
    let head_dim = w.dims(&format!("{t}.encoder.layers.0.self_attn.q_norm.weight"))?[0];
    let kv = w.dims(&format!(
        "{t}.encoder.layers.0.self_attn.k_proj.linear.weight"
    ))?[0];
    let table = w.dims(&format!("{t}.patch_embedder.position_embedding_table"))?;
    let config = Gemma4Config {
        hidden: meta.usize("vision.embedding_length")?,
        intermediate: meta.usize("vision.feed_forward_length")?,
        layers: meta.usize("vision.block_count")?,
        heads: meta.usize("vision.attention.head_count")?,
        kv_heads: kv / head_dim.max(1),
        head_dim,
        patch: meta.usize("vision.patch_size")?,
        positions: table.get(1).copied().unwrap_or(0),
        pool: 3,
        eps: (meta.opt_f64("vision.attention.layer_norm_epsilon")?).unwrap_or(1e-6),
        theta: 100.0,
        clipped: w.contains(&format!("{t}.encoder.layers.0.self_attn.q_proj.input_max")),
        standardize: w.contains(&format!("{t}.std_bias")),
    };
    let parts = Gemma4Parts {
        config,
        text_hidden: w.dims("model.embed_vision.embedding_projection.weight")?[0],
        processor: (280, Filter::Bicubic, 1.0 / 255.0),
        tokens: ["<|image|>", "<|image>", "<image|>"].map(String::from),
        both_ways: true,
    };
    Gemma4Vision::from_parts(parts, w)
}

/// A SigLIP tower's shape from `clip.vision.*` (Gemma 3's, SmolVLM's).
fn siglip_config(meta: &GgufMeta) -> Result<SiglipConfig> {
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
        return Err(meta.err(
            "vision.patch_size",
            "patch size, heads or image size do not fit",
        ));
    }
    Ok(config)
}

/// Qwen3-VL's (or Qwen3.5's) tower from a projector file: Qwen2-VL's fields, the DeepStack
/// blocks from `is_deepstack_layers`, the position table's size from its tensor.
fn qwen3_tower(meta: &GgufMeta, w: &Weights) -> Result<Qwen3VisionTower> {
    let depth = meta.usize("vision.block_count")?;
    let deepstack = match meta.opt_bools("vision.is_deepstack_layers")? {
        Some(flags) => (0..depth)
            .filter(|&i| flags.get(i) == Some(&true))
            .collect(),
        None => Vec::new(),
    };
    let base = Qwen25VisionConfig {
        kind: QwenVisionKind::Qwen3,
        depth,
        hidden_size: meta.usize("vision.embedding_length")?,
        num_heads: meta.usize("vision.attention.head_count")?,
        intermediate_size: w.dims("visual.blocks.0.mlp.linear_fc1.weight")?[0],
        patch_size: meta.usize("vision.patch_size")?,
        temporal_patch_size: 2,
        spatial_merge_size: meta.opt_usize("vision.spatial_merge_size")?.unwrap_or(2),
        window_size: 0,
        fullatt_block_indexes: (0..depth).collect(),
        out_hidden_size: meta.usize("vision.projection_dim")?,
        rope_theta: 10000.0,
    };
    let config = Qwen3VisionConfig {
        base,
        num_position_embeddings: w.dims("visual.pos_embed.weight")?[0],
        deepstack_visual_indexes: deepstack,
    };
    Qwen3VisionTower::load(&config, w, "visual")
}

/// Qwen2(.5)-VL's tower from a projector file: its shape from `clip.vision.*` (full attention
/// every `n_wa_pattern`-th block, windows of `window_size` pixels, 112 when unwritten, as
/// llama.cpp assumes), the MLP's width from its tensors.
fn qwen_tower(meta: &GgufMeta, w: &Weights, kind: QwenVisionKind) -> Result<Qwen25VisionTower> {
    let depth = meta.usize("vision.block_count")?;
    let up = match kind {
        QwenVisionKind::Qwen2 => "visual.blocks.0.mlp.fc1.weight",
        _ => "visual.blocks.0.mlp.up_proj.weight",
    };
    let fullatt = match (kind, meta.opt_usize("vision.n_wa_pattern")?) {
        (QwenVisionKind::Qwen25, Some(n)) if n > 0 => {
            (0..depth).filter(|i| (i + 1) % n == 0).collect()
        }
        _ => (0..depth).collect(),
    };
    let config = Qwen25VisionConfig {
        kind,
        depth,
        hidden_size: meta.usize("vision.embedding_length")?,
        num_heads: meta.usize("vision.attention.head_count")?,
        intermediate_size: w.dims(up)?[0],
        patch_size: meta.usize("vision.patch_size")?,
        temporal_patch_size: 2,
        spatial_merge_size: meta.opt_usize("vision.spatial_merge_size")?.unwrap_or(2),
        window_size: meta.opt_usize("vision.window_size")?.unwrap_or(112),
        fullatt_block_indexes: fullatt,
        out_hidden_size: meta.usize("vision.projection_dim")?,
        rope_theta: 10000.0,
    };
    Qwen25VisionTower::load(&config, w, "visual")
}

/// A Qwen2(.5)-VL block `p`'s fused `attn.qkv` `[3 · h, h]`, or the `attn.q`, `attn.k` and `attn.v` that
/// llama.cpp's projector files split it into, stacked back.
pub(super) fn fused_qkv(w: &Weights, p: &str, h: usize) -> Result<QLinear> {
    if !w.contains(&format!("{p}.attn.q.weight")) {
        return w.linear(&format!("{p}.attn.qkv"), 3 * h, h, true);
    }
    let parts = |kind: &str, shape: &[usize]| -> Result<Tensor> {
        let parts = ["q", "k", "v"].map(|n| w.tensor(&format!("{p}.attn.{n}.{kind}"), shape));
        let [q, k, v] = parts;
        Ok(Tensor::cat(&[q?, k?, v?], 0)?)
    };
    Ok(QLinear::Dense {
        w: parts("weight", &[h, h])?,
        b: Some(parts("bias", &[h])?),
    })
}

/// The patch embedding's Conv3d kernel `shape` (`[h, 3, frames, p, p]`), or the two frames'
/// Conv2d kernels that llama.cpp's projector files store (`weight`, `weight.1`), stacked back.
pub(super) fn patch_kernel(w: &Weights, prefix: &str, shape: [usize; 5]) -> Result<Tensor> {
    let name = format!("{prefix}.patch_embed.proj.weight");
    let second = format!("{name}.1");
    if !w.contains(&second) {
        return w.tensor(&name, &shape);
    }
    let [h, c, frames, p, _] = shape;
    if frames != 2 {
        return Err(peregrine_tensor::candle::Error::Msg(format!(
            "{}: `{second}` holds a second frame, but the tower takes {frames}",
            w.path().display()
        ))
        .into());
    }
    let one = [h, c, p, p];
    Ok(Tensor::stack(
        &[w.tensor(&name, &one)?, w.tensor(&second, &one)?],
        2,
    )?)
}
