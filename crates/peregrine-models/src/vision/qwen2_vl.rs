//! Qwen2-VL's image processor (Qwen2.5-VL's too), for one image: transformers'
//! `Qwen2VLImageProcessorPil` (`image_processing_pil_qwen2_vl.py`, the class
//! `AutoProcessor.from_pretrained(dir, backend="pil")` resolves to in transformers 5.24), and the
//! text the `Qwen2_5_VLProcessor` puts in place of one `<|image_pad|>`
//! (`processing_qwen2_5_vl.py`, `replace_image_token`); and [`QwenVlVision`], the family's
//! [`ImageEncoder`] around either tower ([`Qwen25VisionTower`]).
//!
//! The steps, as `_preprocess` runs them on one picture already converted to RGB:
//! 1. `do_resize`: to the size [`smart_resize`] gives (both sides multiples of
//!    `patch_size * merge_size`, the area within `[min_pixels, max_pixels]`), with `resample`.
//! 2. Rescale and normalise ([`PixelSettings::normalise`](super::processor::PixelSettings::normalise)):
//!    `[3, H, W]` f32.
//! 3. `patchify`: `[3, H, W]` reshaped to `(C, gh/m, m, P, gw/m, m, P)` (`gh = H / P`,
//!    `gw = W / P`, `m = merge_size`, `P = patch_size`), transposed to
//!    `(gh/m, gw/m, m, m, C, P, P)`, the picture repeated `temporal_patch_size` (`T`) times after
//!    `C`, and flattened to `[gh * gw, C * T * P * P]`: rows run over each `m × m` block of
//!    patches row-major, blocks row-major; columns channel, then time, then the patch's rows and
//!    columns. The grid is `(1, gh, gw)`: one picture is one temporal patch.

use std::path::Path;

use peregrine_tensor::{DType, Device, Tensor};

use super::image::{MediaError, RgbImage};
use super::processor::PixelSettings;
use super::qwen2_5_vl::{Qwen25VisionConfig, Qwen25VisionTower};
use super::qwen3_vl::{Qwen3VisionConfig, Qwen3VisionTower};
use super::resize::resize;
use super::{ImageEncoder, ImageInput, ImagePrompt, ImageRun};
use crate::Result;
use crate::config::{Fields, read_json_object};
use crate::weights::Weights;

/// `OPENAI_CLIP_MEAN`, the class's default `image_mean`.
pub(crate) const CLIP_MEAN: [f64; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// `OPENAI_CLIP_STD`, the class's default `image_std`.
pub(crate) const CLIP_STD: [f64; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

/// What the chat template writes for an image, around the placeholder [`prompt_expansion`]
/// replaces: `<|vision_start|><|image_pad|><|vision_end|>`.
pub const IMAGE_PAD: &str = "<|image_pad|>";

/// The image processor's settings (`preprocessor_config.json`, `Qwen2VLImageProcessor`).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlProcessor {
    /// `min_pixels` (or `size.shortest_edge`; default 56 · 56): the least area after resizing.
    pub min_pixels: usize,
    /// `max_pixels` (or `size.longest_edge`; default 28 · 28 · 1280): the most area.
    pub max_pixels: usize,
    /// `patch_size` (default 14): the side of a patch.
    pub patch: usize,
    /// `temporal_patch_size` (default 2): the frames per patch (a picture is repeated).
    pub temporal: usize,
    /// `merge_size` (default 2): the side of the block of patches the model merges into a token.
    pub merge: usize,
    /// The filter (`resample`, default 3 = BICUBIC), rescale and normalisation (OpenAI
    /// CLIP's mean and standard deviation by default).
    pub pixels: PixelSettings,
}

/// One image's pixel values, as the processor emits them.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlPixels {
    /// Row-major `[rows, row_len]` f32: one row per patch, in the processor's order.
    pub patches: Vec<f32>,
    /// `grid.0 * grid.1 * grid.2`.
    pub rows: usize,
    /// `3 * temporal * patch * patch`.
    pub row_len: usize,
    /// `image_grid_thw`: (temporal patches, patch rows, patch columns).
    pub grid: (usize, usize, usize),
}

impl Qwen2VlProcessor {
    /// Reads `dir/preprocessor_config.json`, with the defaults of transformers' class where a
    /// field is absent. `min_pixels` and `max_pixels` override `size`'s `shortest_edge` and
    /// `longest_edge`, as the class's `__init__` does. Errors name the file and the field;
    /// `do_resize`, `do_rescale` or `do_normalize` false, zero sizes, `max_pixels` below
    /// `min_pixels` and unknown PIL filters are refused.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let map = read_json_object(&path)?;
        let f = Fields::new(&path, &map);
        if f.opt_bool("do_resize")? == Some(false) {
            return Err(f.err("field `do_resize: false` is not supported".into()));
        }
        let (mut min_pixels, mut max_pixels) = (56 * 56, 28 * 28 * 1280);
        if let Some(size) = f.object("size")? {
            let key = |k: &str| {
                size.opt_usize(k)?.ok_or_else(|| {
                    f.err(format!(
                        "field `size` must hold `shortest_edge` and `longest_edge` (no `{k}`)"
                    ))
                })
            };
            min_pixels = key("shortest_edge")?;
            max_pixels = key("longest_edge")?;
        }
        min_pixels = f.opt_usize("min_pixels")?.unwrap_or(min_pixels);
        max_pixels = f.opt_usize("max_pixels")?.unwrap_or(max_pixels);
        if min_pixels == 0 || max_pixels < min_pixels {
            return Err(f.err(format!(
                "fields `min_pixels` ({min_pixels}) and `max_pixels` ({max_pixels}): need \
                 0 < min_pixels <= max_pixels"
            )));
        }
        let positive = |key: &str, default: usize| -> Result<usize> {
            match f.opt_usize(key)?.unwrap_or(default) {
                0 => Err(f.err(format!("field `{key}` must be positive"))),
                v => Ok(v),
            }
        };
        // As numpy casts the class's float64 constants to the image's float32.
        let clip = (CLIP_MEAN.map(|x| x as f32), CLIP_STD.map(|x| x as f32));
        let pixels = PixelSettings::read(&f, 3, clip)?;
        Ok(Self {
            min_pixels,
            max_pixels,
            patch: positive("patch_size", 14)?,
            temporal: positive("temporal_patch_size", 2)?,
            merge: positive("merge_size", 2)?,
            pixels,
        })
    }

    /// The processor on one RGB picture: its patches and grid. Fails where transformers does
    /// (an aspect ratio above 200) and where it would resize to an empty picture.
    pub fn process(&self, image: &RgbImage) -> Result<Qwen2VlPixels, MediaError> {
        let (p, m, t) = (self.patch, self.merge, self.temporal);
        let (h, w) = smart_resize(
            image.height,
            image.width,
            p * m,
            self.min_pixels,
            self.max_pixels,
        )?;
        let img = resize(image, w, h, self.pixels.filter);
        let chw = self.pixels.normalise(&img);
        let (gh, gw) = (h / p, w / p);
        let (rows, row_len) = (gh * gw, 3 * t * p * p);
        let mut patches = Vec::with_capacity(rows * row_len);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            let plane = &chw[c * h * w..(c + 1) * h * w];
                            for _ in 0..t {
                                for y in y0..y0 + p {
                                    patches.extend_from_slice(&plane[y * w + x0..y * w + x0 + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
        debug_assert_eq!(patches.len(), rows * row_len);
        Ok(Qwen2VlPixels {
            patches,
            rows,
            row_len,
            grid: (1, gh, gw),
        })
    }
}

/// transformers' `smart_resize`: the `(height, width)` a `height × width` picture is resized to.
/// Each side is rounded to the nearest multiple of `factor` (Python's `round`, ties to even);
/// when the area then exceeds `max_pixels`, both sides are scaled by `beta = sqrt(h · w /
/// max_pixels)` and floored to multiples of `factor` (at least `factor`); when it is below
/// `min_pixels`, scaled up by `sqrt(min_pixels / (h · w))` and ceiled. All in f64, as Python's
/// floats. Errors where transformers raises (the longer side over 200 times the shorter) and on
/// an empty picture or an empty result.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), MediaError> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(MediaError(format!(
            "cannot resize a {width}x{height} image to multiples of {factor}"
        )));
    }
    let ratio = height.max(width) as f64 / height.min(width) as f64;
    if ratio > 200.0 {
        return Err(MediaError(format!(
            "absolute aspect ratio must be smaller than 200, got {ratio} ({width}x{height})"
        )));
    }
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    let mut h_bar = (hf / ff).round_ties_even() as usize * factor;
    let mut w_bar = (wf / ff).round_ties_even() as usize * factor;
    if h_bar * w_bar > max_pixels {
        let beta = ((height * width) as f64 / max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / ff).floor() as usize * factor);
        w_bar = factor.max((wf / beta / ff).floor() as usize * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (height * width) as f64).sqrt();
        h_bar = (hf * beta / ff).ceil() as usize * factor;
        w_bar = (wf * beta / ff).ceil() as usize * factor;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(MediaError(format!(
            "a {width}x{height} image resizes to {w_bar}x{h_bar} pixels"
        )));
    }
    Ok((h_bar, w_bar))
}

/// The image tokens the processor writes for a picture of grid `(t, h, w)` patches:
/// `t · h · w / merge²` (each token stands for a `merge × merge` block of patches).
pub fn image_tokens(grid: (usize, usize, usize), merge: usize) -> usize {
    grid.0 * grid.1 * grid.2 / (merge * merge)
}

/// What `Qwen2_5_VLProcessor` writes in place of one `<|image_pad|>` ([`IMAGE_PAD`]): the token
/// `n_tokens` times ([`image_tokens`]). The template's `<|vision_start|>` and `<|vision_end|>`
/// around it stay as they are.
pub fn prompt_expansion(n_tokens: usize) -> String {
    IMAGE_PAD.repeat(n_tokens)
}

/// What the chat template writes for an image part.
const VISION_START: &str = "<|vision_start|>";
const VISION_END: &str = "<|vision_end|>";

/// The tower inside [`QwenVlVision`].
enum Tower {
    /// Qwen2-VL's or Qwen2.5-VL's.
    Qwen2(Qwen25VisionTower),
    /// Qwen3-VL's, whose rows carry DeepStack's beside them.
    Qwen3(Qwen3VisionTower),
}

impl Tower {
    /// The shape the Qwen towers share.
    fn config(&self) -> &Qwen25VisionConfig {
        match self {
            Tower::Qwen2(t) => t.config(),
            Tower::Qwen3(t) => &t.config().base,
        }
    }
}

/// Qwen2.5-VL's (or Qwen2-VL's, or Qwen3-VL's) image input: the processor, the tower with its
/// merger, and the prompt's form.
pub struct QwenVlVision {
    tower: Tower,
    processor: Qwen2VlProcessor,
    prompt: ImagePrompt,
    dtype: DType,
}

impl QwenVlVision {
    /// Loads from an HF checkpoint folder whose `config.json` (`fields`) has a `vision_config`;
    /// the tower's tensors under `visual.` (hub checkpoints) or `model.visual.` (transformers 5).
    pub fn load(dir: &std::path::Path, fields: &Fields, w: &Weights) -> Result<Self> {
        let vision = fields
            .object("vision_config")?
            .ok_or_else(|| fields.err("missing `vision_config`".into()))?;
        let qwen3 = match fields.opt_str("model_type")? {
            Some("qwen3_vl") => Some(Qwen3VisionConfig::from_fields(&vision, &[8, 16, 24])?),
            Some("qwen3_5" | "qwen3_5_moe") => Some(Qwen3VisionConfig::from_fields(&vision, &[])?),
            _ => None,
        };
        let config = match (fields.opt_str("model_type")?, &qwen3) {
            (_, Some(c)) => c.base.clone(),
            (Some("qwen2_vl"), _) => Qwen25VisionConfig::from_qwen2_fields(&vision)?,
            _ => Qwen25VisionConfig::from_fields(&vision)?,
        };
        let processor = Qwen2VlProcessor::read(dir)?;
        let (p, m) = (config.patch_size, config.spatial_merge_size);
        if (processor.patch, processor.merge, processor.temporal)
            != (p, m, config.temporal_patch_size)
        {
            return Err(fields.err(format!(
                "preprocessor_config.json's patch, merge and temporal sizes {:?} differ from \
                 the vision tower's {:?}",
                (processor.patch, processor.merge, processor.temporal),
                (p, m, config.temporal_patch_size)
            )));
        }
        let prefix = match w.contains("model.visual.patch_embed.proj.weight") {
            true => "model.visual",
            false => "visual",
        };
        let tower = match qwen3 {
            Some(c) => Tower::Qwen3(Qwen3VisionTower::load(&c, w, prefix)?),
            None => Tower::Qwen2(Qwen25VisionTower::load(&config, w, prefix)?),
        };
        Ok(Self::assemble(tower, processor, w.dtype()))
    }

    /// Qwen2(.5)-VL's `tower` (from a llama.cpp projector file) with `processor`, whose patch,
    /// merge and temporal sizes it was checked against.
    pub(crate) fn from_tower(tower: Qwen25VisionTower, processor: Qwen2VlProcessor) -> Self {
        let dtype = tower.dtype();
        Self::assemble(Tower::Qwen2(tower), processor, dtype)
    }

    /// [`from_tower`](Self::from_tower) for Qwen3-VL's (or Qwen3.5's) tower.
    pub(crate) fn from_qwen3_tower(tower: Qwen3VisionTower, processor: Qwen2VlProcessor) -> Self {
        let dtype = tower.dtype();
        Self::assemble(Tower::Qwen3(tower), processor, dtype)
    }

    fn assemble(tower: Tower, processor: Qwen2VlProcessor, dtype: DType) -> Self {
        let prompt = ImagePrompt {
            marker: format!("{VISION_START}{IMAGE_PAD}{VISION_END}"),
            image_token: IMAGE_PAD.to_string(),
            run: 0,
            both_ways: false,
        };
        Self {
            tower,
            processor,
            prompt,
            dtype,
        }
    }

    /// The merged grid (rows, columns) of a picture's patch grid.
    fn merged(&self, input: &ImageInput) -> (usize, usize) {
        let m = self.processor.merge;
        (input.grid.0 / m, input.grid.1 / m)
    }
}

impl ImageEncoder for QwenVlVision {
    fn preprocess(&self, image: &RgbImage) -> Result<ImageInput> {
        let pixels = self.processor.process(image)?;
        let (t, h, w) = pixels.grid;
        if t != 1 {
            return Err(peregrine_tensor::candle::Error::Msg(format!(
                "Qwen2.5-VL: a picture of {t} temporal patches"
            ))
            .into());
        }
        let tiles = Tensor::from_vec(pixels.patches, (pixels.rows, pixels.row_len), &Device::Cpu)?;
        Ok(ImageInput {
            tiles,
            grid: (h, w),
        })
    }

    fn encode(&self, input: &ImageInput) -> Result<Tensor> {
        let grid = (1, input.grid.0, input.grid.1);
        let rows = match &self.tower {
            Tower::Qwen2(t) => t.forward(&input.tiles.to_device(t.device())?, grid)?,
            Tower::Qwen3(t) => t.forward(&input.tiles.to_device(t.device())?, grid)?,
        };
        Ok(rows.to_dtype(self.dtype)?)
    }

    fn width(&self) -> usize {
        self.tower.config().out_hidden_size
    }

    fn prompt(&self) -> &ImagePrompt {
        &self.prompt
    }

    fn expansion(&self, input: &ImageInput) -> String {
        let n = image_tokens((1, input.grid.0, input.grid.1), self.processor.merge);
        format!("{VISION_START}{}{VISION_END}", IMAGE_PAD.repeat(n))
    }

    fn runs(&self, input: &ImageInput) -> Vec<ImageRun> {
        let (h, w) = self.merged(input);
        vec![ImageRun {
            len: h * w,
            grid: Some((h, w)),
        }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vision::resize::Filter;

    /// By hand from transformers' `smart_resize` (`image_processing_pil_qwen2_vl.py`), factor 28,
    /// min 56·56 = 3136, max 28·28·1280 = 1003520 unless stated; every case here also printed
    /// the same by that function in the fixture venv (transformers 5.24).
    #[test]
    fn rounds_to_the_nearest_multiple() {
        // 100/28 = 3.57 -> 4 -> 112; 200/28 = 7.14 -> 7 -> 196; area in range.
        assert_eq!(
            smart_resize(100, 200, 28, 3136, 1003520).unwrap(),
            (112, 196)
        );
        // Ties go to even, as Python's round: 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2, 98/28 = 3.5 -> 4.
        assert_eq!(smart_resize(42, 70, 28, 784, 1003520).unwrap(), (56, 56));
        assert_eq!(smart_resize(98, 98, 28, 784, 1003520).unwrap(), (112, 112));
    }

    #[test]
    fn scales_into_the_pixel_range() {
        // 30x40 (h x w) rounds to 28x28 = 784 < 3136: beta = sqrt(3136 / 1200) = 1.6166;
        // ceil(30·1.6166/28) = ceil(1.73) = 2 -> 56, ceil(40·1.6166/28) = ceil(2.31) = 3 -> 84.
        assert_eq!(smart_resize(30, 40, 28, 3136, 12544).unwrap(), (56, 84));
        // 108x192 rounds to 112x196 = 21952 > 12544: beta = sqrt(20736/12544) = 144/112;
        // floor(108/beta/28) = floor(3.0) = 3 -> 84, floor(192/beta/28) = floor(5.33) = 5 -> 140.
        assert_eq!(smart_resize(108, 192, 28, 3136, 12544).unwrap(), (84, 140));
        // 1000x10 rounds to 1008x0, area 0 < 3136: beta = sqrt(3136/10000) = 0.56;
        // ceil(1000·0.56/28) = 20 -> 560, ceil(10·0.56/28) = ceil(0.2) = 1 -> 28.
        assert_eq!(
            smart_resize(1000, 10, 28, 3136, 1003520).unwrap(),
            (560, 28)
        );
        // 5000x50 rounds to 5012x56 = 280672 > 200000: beta = sqrt(250000/200000) = 1.118;
        // floor(5000/1.118/28) = floor(159.7) = 159 -> 4452, floor(50/1.118/28) = floor(1.6)
        // = 1 -> 28.
        assert_eq!(
            smart_resize(5000, 50, 28, 3136, 200000).unwrap(),
            (4452, 28)
        );
    }

    #[test]
    fn refuses_extreme_aspect_ratios() {
        // 201/1 > 200 raises ValueError in transformers; exactly 200 does not.
        let e = smart_resize(1, 201, 28, 3136, 1003520).unwrap_err();
        assert!(e.0.contains("aspect ratio"), "{e}");
        assert!(smart_resize(4020, 20, 28, 3136, 1003520).is_err());
        assert!(smart_resize(1, 200, 28, 3136, 1003520).is_ok());
        assert!(smart_resize(0, 10, 28, 3136, 1003520).is_err());
    }

    /// A 4-wide, 8-tall picture of distinct levels, patch 2, merge 2 (factor 4: no resize):
    /// grid 1 x 4 x 2. Checks rows against the reshape and transpose of `patchify` read by hand.
    #[test]
    fn patch_order_is_transformers() {
        let (w, h) = (4, 8);
        let img = RgbImage {
            width: w,
            height: h,
            data: (0..w * h * 3).map(|i| (i % 251) as u8).collect(),
        };
        let p = Qwen2VlProcessor {
            min_pixels: 16,
            max_pixels: 1 << 20,
            patch: 2,
            temporal: 2,
            merge: 2,
            pixels: PixelSettings {
                filter: Filter::Bicubic,
                rescale: 1.0,
                mean: [0.0; 3],
                std: [1.0; 3],
            },
        };
        let out = p.process(&img).unwrap();
        assert_eq!((out.grid, out.rows, out.row_len), ((1, 4, 2), 8, 24));
        let px = |y: usize, x: usize, c: usize| img.data[(y * w + x) * 3 + c] as f32;
        // Row 3: block (0, 0), mh = 1, mw = 1: the patch at rows 2..4, columns 2..4.
        let row = &out.patches[3 * 24..4 * 24];
        for c in 0..3 {
            for t in 0..2 {
                for (i, (y, x)) in [(2, 2), (2, 3), (3, 2), (3, 3)].into_iter().enumerate() {
                    assert_eq!(row[c * 8 + t * 4 + i], px(y, x, c), "c{c} t{t} i{i}");
                }
            }
        }
        // Row 4: the second block down (bh = 1), mh = mw = 0: rows 4..6, columns 0..2.
        assert_eq!(out.patches[4 * 24], px(4, 0, 0));
        assert_eq!(out.patches[4 * 24 + 3], px(5, 1, 0));
    }

    /// An empty config gets the class's defaults; `min_pixels` / `max_pixels` win over `size`.
    #[test]
    fn read_defaults_and_overrides() {
        let dir = std::env::temp_dir().join(format!("qwen2_vl_read_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("preprocessor_config.json");
        std::fs::write(&path, "{}").unwrap();
        let p = Qwen2VlProcessor::read(&dir).unwrap();
        assert_eq!((p.min_pixels, p.max_pixels), (3136, 1003520));
        assert_eq!((p.patch, p.temporal, p.merge), (14, 2, 2));
        assert_eq!(
            (p.pixels.filter, p.pixels.rescale),
            (Filter::Bicubic, 1.0 / 255.0)
        );
        assert_eq!(p.pixels.mean, CLIP_MEAN.map(|x| x as f32));
        let size = r#"{"size": {"shortest_edge": 100, "longest_edge": 5000}, "max_pixels": 9000}"#;
        std::fs::write(&path, size).unwrap();
        let p = Qwen2VlProcessor::read(&dir).unwrap();
        assert_eq!((p.min_pixels, p.max_pixels), (100, 9000));
        std::fs::write(&path, r#"{"resample": 9}"#).unwrap();
        let e = Qwen2VlProcessor::read(&dir).unwrap_err().to_string();
        assert!(
            e.contains("preprocessor_config.json") && e.contains("resample"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn prompt_tokens() {
        assert_eq!(image_tokens((1, 6, 8), 2), 12);
        assert_eq!(prompt_expansion(2), "<|image_pad|><|image_pad|>");
    }
}
