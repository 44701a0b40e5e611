//! What the HF image processors share in `preprocessor_config.json`: the resampling filter, the
//! rescale factor and the per-channel normalisation, read once for every family.

use super::image::RgbImage;
use super::resize::{Filter, to_chw_normalized};
use crate::Result;
use crate::config::Fields;

/// CLIP's / SigLIP's `[0.5; 3]` mean and standard deviation: the default of the processors
/// here when a config leaves them out.
pub const HALF: ([f32; 3], [f32; 3]) = ([0.5; 3], [0.5; 3]);

/// A processor's filter and pixel arithmetic.
#[derive(Debug, Clone, PartialEq)]
pub struct PixelSettings {
    /// `resample`, as a PIL filter.
    pub filter: Filter,
    /// `rescale_factor` (default 1/255).
    pub rescale: f64,
    /// `image_mean`.
    pub mean: [f32; 3],
    /// `image_std`.
    pub std: [f32; 3],
}

impl PixelSettings {
    /// Reads `resample` (a PIL code; `filter` when absent), `rescale_factor`, `image_mean` and
    /// `image_std` (`stats` when absent). `do_rescale` or `do_normalize` false are refused.
    pub fn read(f: &Fields, filter: u32, stats: ([f32; 3], [f32; 3])) -> Result<Self> {
        for key in ["do_rescale", "do_normalize"] {
            if f.opt_bool(key)? == Some(false) {
                return Err(f.err(format!("field `{key}: false` is not supported")));
            }
        }
        let code = f.opt_usize("resample")?.map_or(filter, |c| c as u32);
        let filter = Filter::from_pil(code).ok_or_else(|| {
            f.err(format!(
                "field `resample`: PIL filter {code} is not supported"
            ))
        })?;
        let triple = |key: &str, default: [f32; 3]| -> Result<[f32; 3]> {
            if f.get(key).is_none() {
                return Ok(default);
            }
            match f.f64_list(key)?.as_slice() {
                [a, b, c] => Ok([*a as f32, *b as f32, *c as f32]),
                _ => Err(f.err(format!("field `{key}` must hold 3 numbers"))),
            }
        };
        Ok(Self {
            filter,
            rescale: f.opt_f64("rescale_factor")?.unwrap_or(1.0 / 255.0),
            mean: triple("image_mean", stats.0)?,
            std: triple("image_std", stats.1)?,
        })
    }

    /// `img` rescaled and normalised as transformers does, channels first (`[3, h, w]`).
    pub fn normalise(&self, img: &RgbImage) -> Vec<f32> {
        to_chw_normalized(img, self.rescale, self.mean, self.std)
    }
}
