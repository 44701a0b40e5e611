//! Idefics3's image processor (SmolVLM's), for one image: transformers'
//! `Idefics3ImageProcessorPil` (`image_processing_pil_idefics3.py`, the class
//! `AutoProcessor.from_pretrained(dir, backend="pil")` resolves to in transformers 5.24), and the
//! text the `Idefics3Processor` puts in place of one `<image>` (`processing_idefics3.py`,
//! `replace_image_token`).
//!
//! The steps, as `_preprocess` runs them on one picture already converted to RGB:
//! 1. `do_resize`: the longest edge to `size.longest_edge`, aspect kept (the other side truncated,
//!    then rounded up to even), larger or smaller alike; then down below 4096 if above.
//! 2. `do_image_splitting`: both sides up to multiples of `max_image_size.longest_edge` (`m`):
//!    the longer side rounded up, the other derived from the aspect ratio and rounded up (so the
//!    picture is stretched). Wider or taller than `m`: cut into `rows × cols` tiles of `m × m`
//!    (row-major) followed by the whole picture resized to `m × m`; else the one `m × m` picture,
//!    grid `0 × 0`. Without splitting: the picture resized to `m × m`, grid `0 × 0`.
//! 3. Rescale and normalise each tile ([`PixelSettings::normalise`](super::processor::PixelSettings::normalise)).
//!
//! Every resize uses the `resample` filter. For one image `do_pad` changes nothing: every tile is
//! `m × m`, so `pixel_attention_mask` is all ones (padding tiles only appear in batches of
//! images with different tile counts).

use std::path::Path;

use super::image::RgbImage;
use super::processor::{HALF, PixelSettings};
use super::resize::resize;
use crate::Result;
use crate::config::{Fields, read_json_object};

/// `MAX_IMAGE_SIZE` of transformers' Idefics3 processor: the largest side after the first resize.
const MAX_IMAGE_SIZE: usize = 4096;

/// The image processor's settings (`preprocessor_config.json`, `Idefics3ImageProcessor`) and the
/// processor's `image_seq_len` (`processor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct Idefics3Processor {
    /// `do_resize`: whether the longest edge is first resized to `longest_edge`.
    pub do_resize: bool,
    /// `size.longest_edge` (default 1456).
    pub longest_edge: usize,
    /// `max_image_size.longest_edge` (default 364): the tiles' side.
    pub tile: usize,
    /// `do_image_splitting` (default true).
    pub split: bool,
    /// The filter (`resample`, default 1 = LANCZOS), rescale and normalisation (0.5 each).
    pub pixels: PixelSettings,
    /// `image_seq_len` of `processor_config.json` (default 169, as `Idefics3Processor`'s): the
    /// `<image>` tokens per tile.
    pub image_seq_len: usize,
}

/// One image's pixel values, as the processor emits them.
#[derive(Debug, Clone, PartialEq)]
pub struct Idefics3Pixels {
    /// Tile rows of the split grid (0 when not split, as HF reports it).
    pub rows: usize,
    /// Tile columns of the split grid (0 when not split).
    pub cols: usize,
    /// `rows * cols` split tiles row-major then the global picture (or the one picture when not
    /// split), each `[3, tile, tile]` f32, channels first.
    pub tiles: Vec<Vec<f32>>,
}

impl Idefics3Processor {
    /// Reads `dir/preprocessor_config.json` and, when present, `dir/processor_config.json`
    /// (`image_seq_len`). Errors name the file and the field; `do_rescale` or `do_normalize`
    /// false, a `size` without `longest_edge` and unknown PIL filters are refused.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let map = read_json_object(&path)?;
        let f = Fields::new(&path, &map);
        let edge = |key: &str, default: usize| -> Result<usize> {
            let Some(obj) = f.object(key)? else {
                return Ok(default);
            };
            obj.opt_usize("longest_edge")?.ok_or_else(|| {
                f.err(format!(
                    "field `{key}`: only `{{\"longest_edge\": n}}` is supported"
                ))
            })
        };
        let longest_edge = edge("size", 4 * 364)?;
        let tile = edge("max_image_size", 364)?;
        let pixels = PixelSettings::read(&f, 1, HALF)?;
        let processor_path = dir.join("processor_config.json");
        let image_seq_len = if processor_path.is_file() {
            let map = read_json_object(&processor_path)?;
            Fields::new(&processor_path, &map).opt_usize("image_seq_len")?
        } else {
            None
        };
        Ok(Self {
            do_resize: f.opt_bool("do_resize")?.unwrap_or(true),
            longest_edge,
            tile,
            split: f.opt_bool("do_image_splitting")?.unwrap_or(true),
            pixels,
            image_seq_len: image_seq_len.unwrap_or(169),
        })
    }

    /// The side of every tile (`max_image_size.longest_edge`).
    pub fn tile_size(&self) -> usize {
        self.tile
    }

    /// The processor on one RGB picture: its tiles and split grid. Where transformers would fail
    /// (a side rounded to 0 pixels by an extreme aspect ratio) the side is kept at 1 pixel.
    pub fn process(&self, image: &RgbImage) -> Idefics3Pixels {
        let m = self.tile;
        let mut img = image.clone();
        if self.do_resize {
            let (h, w) = rescale_to_max_len(img.height, img.width, self.longest_edge);
            let (h, w) = scale_below_upper_bound(h, w, MAX_IMAGE_SIZE);
            img = resize(&img, w, h, self.pixels.filter);
        }
        let (rows, cols, frames) = if self.split {
            let (h, w) = vision_encoder_size(img.height, img.width, m);
            let img = resize(&img, w, h, self.pixels.filter);
            if h > m || w > m {
                let (rows, cols) = ((h - m) / m + 1, (w - m) / m + 1);
                let mut frames = Vec::with_capacity(rows * cols + 1);
                for r in 0..rows {
                    for c in 0..cols {
                        frames.push(crop(&img, c * m, r * m, m, m));
                    }
                }
                frames.push(resize(&img, m, m, self.pixels.filter));
                (rows, cols, frames)
            } else {
                (0, 0, vec![img])
            }
        } else {
            (0, 0, vec![resize(&img, m, m, self.pixels.filter)])
        };
        let tiles = frames.iter().map(|f| self.pixels.normalise(f)).collect();
        Idefics3Pixels { rows, cols, tiles }
    }
}

/// `_resize_output_size_rescale_to_max_len` (min_len 1): the longer side to `max_len`, the
/// other `int()`-truncated from the aspect ratio in f64 and bumped to even.
fn rescale_to_max_len(height: usize, width: usize, max_len: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    let (mut h, mut w) = (height, width);
    if w >= h {
        w = max_len;
        h = (w as f64 / aspect) as usize;
        if h % 2 != 0 {
            h += 1;
        }
    } else {
        h = max_len;
        w = (h as f64 * aspect) as usize;
        if w % 2 != 0 {
            w += 1;
        }
    }
    (h.max(1), w.max(1))
}

/// `_resize_output_size_scale_below_upper_bound`: the longer side down to `max_len` when above.
fn scale_below_upper_bound(height: usize, width: usize, max_len: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    let (mut h, mut w) = (height, width);
    if w >= h && w > max_len {
        w = max_len;
        h = (w as f64 / aspect) as usize;
    } else if h > w && h > max_len {
        h = max_len;
        w = (h as f64 * aspect) as usize;
    }
    (h.max(1), w.max(1))
}

/// `resize_for_vision_encoder`'s size: the longer side rounded up to a multiple of `m`, the other
/// `int()` of it over the aspect ratio, rounded up to a multiple of `m` (at least `m`; HF fails
/// where that rounds to 0).
fn vision_encoder_size(height: usize, width: usize, m: usize) -> (usize, usize) {
    let aspect = width as f64 / height as f64;
    let up = |v: usize| ((v as f64 / m as f64).ceil() as usize * m).max(m);
    if width >= height {
        let w = up(width);
        (up((w as f64 / aspect) as usize), w)
    } else {
        let h = up(height);
        (h, up((h as f64 * aspect) as usize))
    }
}

/// The `w × h` window of `img` at column `x`, row `y` (inside the image).
fn crop(img: &RgbImage, x: usize, y: usize, w: usize, h: usize) -> RgbImage {
    let mut data = Vec::with_capacity(w * h * 3);
    for row in y..y + h {
        let start = (row * img.width + x) * 3;
        data.extend_from_slice(&img.data[start..start + w * 3]);
    }
    RgbImage {
        width: w,
        height: h,
        data,
    }
}

/// The strings the processor writes around an image's tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idefics3Tokens {
    /// Opens and closes each tile's run (`<fake_token_around_image>`).
    pub fake: String,
    /// The placeholder, and the token each tile's rows stand on (`<image>`).
    pub image: String,
    /// Tags the global picture (`<global-img>`).
    pub global: String,
}

impl Default for Idefics3Tokens {
    fn default() -> Self {
        Self {
            fake: "<fake_token_around_image>".into(),
            image: "<image>".into(),
            global: "<global-img>".into(),
        }
    }
}

/// What `Idefics3Processor` writes in place of one `<image>` for a picture split into
/// `rows × cols` tiles (`replace_image_token`): each tile `fake <row_r_col_c>` + `image` ×
/// `image_seq_len`, a newline after each row; then `\n fake global` + `image` ×
/// `image_seq_len` + `fake`. Grid `0 × 0`: only `fake global` + the image tokens + `fake`.
pub fn prompt_expansion(
    rows: usize,
    cols: usize,
    image_seq_len: usize,
    tokens: &Idefics3Tokens,
) -> String {
    let run = tokens.image.repeat(image_seq_len);
    let global = format!("{}{}{run}{}", tokens.fake, tokens.global, tokens.fake);
    if rows == 0 && cols == 0 {
        return global;
    }
    let mut out = String::new();
    for r in 1..=rows {
        for c in 1..=cols {
            out.push_str(&format!("{}<row_{r}_col_{c}>{run}", tokens.fake));
        }
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&global);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers 5.24's `Idefics3Processor.replace_image_token` with rows = cols = 2 and
    /// image_seq_len 4 (printed by the fixture venv's Python, `processing_idefics3.py`).
    #[test]
    fn expansion_two_by_two_is_transformers() {
        let want = "<fake_token_around_image><row_1_col_1><image><image><image><image>\
                    <fake_token_around_image><row_1_col_2><image><image><image><image>\n\
                    <fake_token_around_image><row_2_col_1><image><image><image><image>\
                    <fake_token_around_image><row_2_col_2><image><image><image><image>\n\n\
                    <fake_token_around_image><global-img><image><image><image><image>\
                    <fake_token_around_image>";
        assert_eq!(prompt_expansion(2, 2, 4, &Idefics3Tokens::default()), want);
    }

    /// Same source, rows = cols = 0.
    #[test]
    fn expansion_unsplit_is_transformers() {
        let want = "<fake_token_around_image><global-img><image><image><image><image>\
                    <fake_token_around_image>";
        assert_eq!(prompt_expansion(0, 0, 4, &Idefics3Tokens::default()), want);
    }

    /// The size rules by hand: 192x108 -> width 128, height int(128 / (192/108)) = 72 (even);
    /// 60x80 (w x h) -> height 128, width int(128 * 0.75) = 96; an odd result is bumped:
    /// 100x37 -> int(128 / (100/37)) = int(47.36) = 47 -> 48; 1000x1 -> 0 -> at least 1;
    /// above 4096: 5000x72 -> 4096 x int(4096 / (5000/72)) = int(58.98) = 58.
    #[test]
    fn longest_edge_rounding() {
        assert_eq!(rescale_to_max_len(108, 192, 128), (72, 128));
        assert_eq!(rescale_to_max_len(80, 60, 128), (128, 96));
        assert_eq!(rescale_to_max_len(37, 100, 128), (48, 128));
        assert_eq!(rescale_to_max_len(1, 1000, 128), (1, 128));
        assert_eq!(scale_below_upper_bound(72, 5000, 4096), (58, 4096));
    }

    /// 128x72 -> 128 x int(128 / (128/72)) = 72 -> 128 (stretched); 96 wide x 128 tall -> 128;
    /// 192x64 -> 192 x 64: grid 1 x 3.
    #[test]
    fn vision_encoder_rounding() {
        assert_eq!(vision_encoder_size(72, 128, 64), (128, 128));
        assert_eq!(vision_encoder_size(128, 96, 64), (128, 128));
        assert_eq!(vision_encoder_size(64, 192, 64), (64, 192));
        assert_eq!(vision_encoder_size(10, 20, 64), (64, 64));
    }

    #[test]
    fn crop_takes_the_window() {
        let img = RgbImage {
            width: 3,
            height: 2,
            data: (0..18).collect(),
        };
        let c = crop(&img, 1, 1, 2, 1);
        assert_eq!(c.data, [12, 13, 14, 15, 16, 17]);
    }
}
