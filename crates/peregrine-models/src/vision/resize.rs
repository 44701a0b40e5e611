//! PIL's `Image.resize` on 8-bit RGB, bit for bit, and the HF image processors' rescale and
//! normalise into a channels-first f32 tensor.
//!
//! The convolution filters follow Pillow's `src/libImaging/Resample.c` (the 8-bit path):
//! coefficients computed in f64, normalised, turned into 22-bit fixed point, accumulated in i32,
//! each pass rounded to u8. The pass order is Pillow 13's: the vertical pass first when the
//! height shrinks by more than twice as many pixels as the width (`h < H` and `2 (W - w) < H - h`,
//! python-pillow/Pillow#9549; the rule was read off Pillow 13.0.0's output, whose source was not
//! at hand), otherwise the horizontal pass first, over only the source rows the vertical pass
//! reads. Pillow 12 and older always run the horizontal pass first, so where the order differs
//! (e.g. 40x80 -> 36x20) their output can differ from this by a level with the smooth filters and
//! by more with bicubic and Lanczos, whose intermediate rounding and clipping move.
//! `Nearest` follows `_imaging.c`'s `_resize`, an affine transform with nearest-neighbour
//! sampling (`ImagingScaleAffine` in `Geometry.c`). Pillow's `reducing_gap` (unused by the HF
//! processors), resizing from a sub-box and Pillow 13's MKS2013/MKS2021 filters are not
//! implemented.

use super::image::RgbImage;

/// A resampling filter, as PIL names them (`PIL.Image.Resampling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Filter {
    /// Nearest neighbour (PIL code 0).
    Nearest,
    /// Box: each output pixel averages the input pixels its footprint covers (code 4).
    Box,
    /// Triangle, support 1 (code 2).
    Bilinear,
    /// Hamming-windowed sinc, support 1 (code 5).
    Hamming,
    /// Keys cubic with a = -0.5, support 2 (code 3).
    Bicubic,
    /// Lanczos, 3 lobes (code 1).
    Lanczos,
}

impl Filter {
    /// The filter of PIL's integer code (`resample` in a `preprocessor_config.json`):
    /// NEAREST 0, LANCZOS 1, BILINEAR 2, BICUBIC 3, BOX 4, HAMMING 5; `None` for any other.
    pub fn from_pil(code: u32) -> Option<Filter> {
        Some(match code {
            0 => Filter::Nearest,
            1 => Filter::Lanczos,
            2 => Filter::Bilinear,
            3 => Filter::Bicubic,
            4 => Filter::Box,
            5 => Filter::Hamming,
            _ => return None,
        })
    }

    /// Half the filter's width, in source pixels at scale 1.
    fn support(self) -> f64 {
        match self {
            Filter::Nearest => 0.0,
            Filter::Box => 0.5,
            Filter::Bilinear | Filter::Hamming => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    /// The kernel, as Resample.c writes each (same operations in the same order, so the same
    /// doubles).
    fn weight(self, x: f64) -> f64 {
        use std::f64::consts::PI;
        fn sinc(x: f64) -> f64 {
            if x == 0.0 {
                return 1.0;
            }
            let x = x * PI;
            x.sin() / x
        }
        match self {
            Filter::Nearest => unreachable!("nearest does not convolve"),
            Filter::Box => {
                // Half-open on the left, as Resample.c has it.
                if x > -0.5 && x <= 0.5 { 1.0 } else { 0.0 }
            }
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 { 1.0 - x } else { 0.0 }
            }
            Filter::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    return 1.0;
                }
                if x >= 1.0 {
                    return 0.0;
                }
                let x = x * PI;
                // `0.54f + 0.46f * cos(x)`: float constants widened to double.
                x.sin() / x * (f64::from(0.54f32) + f64::from(0.46f32) * x.cos())
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

/// Fixed-point bits of the 8-bit path's coefficients: 8 for the result, 2 for overflow.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// One pass's coefficients: for output pixel `i`, the source pixels `first[i]..first[i] + len[i]`
/// weighted by `k[i * ksize..][..len[i]]`.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    k: Vec<i32>,
}

/// `precompute_coeffs` then `normalize_coeffs_8bpc` for the box `0..in_size` (whole image).
fn precompute_coeffs(in_size: usize, out_size: usize, filter: Filter) -> Coeffs {
    // `(double)(in1 - in0) / outSize` with the box's float coordinates.
    let scale = f64::from(in_size as f32) / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let ss = 1.0 / filterscale;
    let mut bounds = Vec::with_capacity(out_size);
    let mut k = vec![0i32; out_size * ksize];
    let mut w = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        // `(int)` truncates toward zero, as `as` does.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
        let (xmin, n) = (xmin as usize, xmax.max(0) as usize);
        let mut ww = 0.0;
        for (x, wx) in w[..n].iter_mut().enumerate() {
            *wx = filter.weight(((x + xmin) as f64 - center + 0.5) * ss);
            ww += *wx;
        }
        for (wx, kx) in w[..n].iter().zip(&mut k[xx * ksize..]) {
            let v = if ww != 0.0 { wx / ww } else { *wx };
            let fixed = v * f64::from(1u32 << PRECISION_BITS);
            *kx = if v < 0.0 {
                (-0.5 + fixed) as i32
            } else {
                (0.5 + fixed) as i32
            };
        }
        bounds.push((xmin, n));
    }
    Coeffs { ksize, bounds, k }
}

/// `clip8`: the accumulator's integer part, clamped to a byte.
fn clip8(ss: i32) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Rounding offset the accumulators start from.
const HALF: i32 = 1 << (PRECISION_BITS - 1);

/// `ImagingResampleHorizontal_8bpc` over source rows `rows` of an image `in_w` wide.
fn horizontal(src: &[u8], in_w: usize, rows: std::ops::Range<usize>, c: &Coeffs) -> Vec<u8> {
    let out_w = c.bounds.len();
    let mut out = Vec::with_capacity(rows.len() * out_w * 3);
    for y in rows {
        let row = &src[y * in_w * 3..(y + 1) * in_w * 3];
        for (xx, &(xmin, n)) in c.bounds.iter().enumerate() {
            let k = &c.k[xx * c.ksize..xx * c.ksize + n];
            let mut ss = [HALF; 3];
            for (px, &kx) in row[xmin * 3..(xmin + n) * 3].chunks_exact(3).zip(k) {
                for (s, &v) in ss.iter_mut().zip(px) {
                    *s = s.wrapping_add(i32::from(v).wrapping_mul(kx));
                }
            }
            out.extend(ss.map(clip8));
        }
    }
    out
}

/// `ImagingResampleVertical_8bpc`: `c`'s bounds index rows of `src` after subtracting `shift`.
fn vertical(src: &[u8], w: usize, c: &Coeffs, shift: usize) -> Vec<u8> {
    let stride = w * 3;
    let mut out = Vec::with_capacity(c.bounds.len() * stride);
    for (yy, &(ymin, n)) in c.bounds.iter().enumerate() {
        let k = &c.k[yy * c.ksize..yy * c.ksize + n];
        let ymin = ymin - shift;
        for i in 0..stride {
            let mut ss = HALF;
            for (y, &ky) in k.iter().enumerate() {
                ss = ss.wrapping_add(i32::from(src[(ymin + y) * stride + i]).wrapping_mul(ky));
            }
            out.push(clip8(ss));
        }
    }
    out
}

/// PIL's `Image.resize((width, height), resample=filter)` of an RGB image, bit for bit.
///
/// The same size returns a copy. Panics if `width` or `height` is 0 (PIL raises) or if `img.data`
/// is not `width * height * 3` bytes.
pub fn resize(img: &RgbImage, width: usize, height: usize, filter: Filter) -> RgbImage {
    assert!(width > 0 && height > 0, "resize to {width}x{height}");
    assert_eq!(img.data.len(), img.width * img.height * 3, "RgbImage size");
    if (width, height) == (img.width, img.height) {
        return img.clone();
    }
    if filter == Filter::Nearest {
        return nearest(img, width, height);
    }
    let need_horizontal = width != img.width;
    let need_vertical = height != img.height;
    let vert = precompute_coeffs(img.height, height, filter);
    // Pillow 13 (python-pillow/Pillow#9549): when the height loses more than twice as many
    // pixels as the width, the vertical pass runs first (on every source column).
    let vertical_first =
        height < img.height && 2 * (img.width as i64 - width as i64) < (img.height - height) as i64;
    let data = if vertical_first {
        let tall = vertical(&img.data, img.width, &vert, 0);
        if need_horizontal {
            let horiz = precompute_coeffs(img.width, width, filter);
            horizontal(&tall, img.width, 0..height, &horiz)
        } else {
            tall
        }
    } else {
        // The horizontal pass first, on the source rows the vertical pass reads.
        let ybox_first = vert.bounds[0].0;
        let ybox_last = vert.bounds[height - 1].0 + vert.bounds[height - 1].1;
        let wide = need_horizontal.then(|| {
            let horiz = precompute_coeffs(img.width, width, filter);
            horizontal(&img.data, img.width, ybox_first..ybox_last, &horiz)
        });
        match (wide, need_vertical) {
            (Some(wide), true) => vertical(&wide, width, &vert, ybox_first),
            (Some(wide), false) => wide,
            (None, _) => vertical(&img.data, width, &vert, 0),
        }
    };
    RgbImage {
        width,
        height,
        data,
    }
}

/// `_resize` with NEAREST: `ImagingScaleAffine` with `a = [in_w / width, 0, 0, 0, in_h / height,
/// 0]`, the source position accumulated in f64 from half a step, outside pixels black.
fn nearest(img: &RgbImage, width: usize, height: usize) -> RgbImage {
    let a0 = f64::from(img.width as f32) / width as f64;
    let a4 = f64::from(img.height as f32) / height as f64;
    // `COORD(v)`: -1 below zero, else truncated.
    let coord = |v: f64| if v < 0.0 { -1 } else { v as i64 };
    let mut xintab = vec![0usize; width];
    let (mut xmin, mut xmax) = (width, 0);
    let mut xo = a0 * 0.5;
    for (x, tab) in xintab.iter_mut().enumerate() {
        let xin = coord(xo);
        if xin >= 0 && (xin as usize) < img.width {
            xmax = x + 1;
            xmin = xmin.min(x);
            *tab = xin as usize;
        }
        xo += a0;
    }
    let mut data = vec![0u8; width * height * 3];
    let mut yo = a4 * 0.5;
    for out in data.chunks_exact_mut(width * 3) {
        let yi = coord(yo);
        if yi >= 0 && (yi as usize) < img.height {
            let row = &img.data[yi as usize * img.width * 3..][..img.width * 3];
            for x in xmin..xmax {
                out[x * 3..x * 3 + 3].copy_from_slice(&row[xintab[x] * 3..xintab[x] * 3 + 3]);
            }
        }
        yo += a4;
    }
    RgbImage {
        width,
        height,
        data,
    }
}

/// The HF processors' `rescale` then `normalize` into channels-first `[3, height, width]` f32:
/// `x = (v as f64 * rescale) as f32` (numpy rescales in f64 and casts to f32), then
/// `(x - mean[c]) / std[c]` in f32.
pub fn to_chw_normalized(img: &RgbImage, rescale: f64, mean: [f32; 3], std: [f32; 3]) -> Vec<f32> {
    let plane = img.width * img.height;
    assert_eq!(img.data.len(), plane * 3, "RgbImage size");
    let mut out = vec![0f32; plane * 3];
    for (i, px) in img.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let x = (f64::from(px[c]) * rescale) as f32;
            out[c * plane + i] = (x - mean[c]) / std[c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(data: &[u8]) -> RgbImage {
        RgbImage {
            width: data.len(),
            height: 1,
            data: data.iter().flat_map(|&v| [v; 3]).collect(),
        }
    }

    fn reds(img: &RgbImage) -> Vec<u8> {
        img.data.iter().step_by(3).copied().collect()
    }

    #[test]
    fn pil_codes() {
        assert_eq!(Filter::from_pil(0), Some(Filter::Nearest));
        assert_eq!(Filter::from_pil(1), Some(Filter::Lanczos));
        assert_eq!(Filter::from_pil(2), Some(Filter::Bilinear));
        assert_eq!(Filter::from_pil(3), Some(Filter::Bicubic));
        assert_eq!(Filter::from_pil(4), Some(Filter::Box));
        assert_eq!(Filter::from_pil(5), Some(Filter::Hamming));
        assert_eq!(Filter::from_pil(6), None);
    }

    /// 2 -> 4 bilinear: scale 0.5, support 1. Output 0: center 0.25, source 0..1, weight 1.
    /// Output 1: center 0.75, sources 0 and 1 at distances 0.25 and 0.75, weights 0.75 and 0.25:
    /// 255 * 0.25 = 63.75, plus the half, truncated: 64. Output 2 mirrors it: 191.25 -> 191.
    /// Output 3: center 1.75, sources 1..2 (clamped), weight 1.
    #[test]
    fn bilinear_upscale_by_hand() {
        let out = resize(&row(&[0, 255]), 4, 1, Filter::Bilinear);
        assert_eq!((out.width, out.height), (4, 1));
        assert_eq!(reds(&out), [0, 64, 191, 255]);
    }

    /// 4 -> 2 box: scale 2, support 1; output 0 averages sources 0 and 1 (distances -0.25 and
    /// 0.25 after dividing by the scale), output 1 sources 2 and 3.
    #[test]
    fn box_downscale_by_hand() {
        let out = resize(&row(&[10, 20, 30, 41]), 2, 1, Filter::Box);
        // Weights 2^21 each: (10 + 20) / 2 + 0.5 = 15.5 -> 15; (30 + 41) / 2 + 0.5 = 36.
        assert_eq!(reds(&out), [15, 36]);
    }

    /// Only the changed dimension is resampled: a column of 2 -> 4 bilinear, width kept.
    #[test]
    fn vertical_only() {
        let img = RgbImage {
            width: 1,
            height: 2,
            data: vec![0, 0, 0, 255, 255, 255],
        };
        let out = resize(&img, 1, 4, Filter::Bilinear);
        assert_eq!(reds(&out), [0, 64, 191, 255]);
    }

    /// Nearest samples at `(x + 0.5) * scale`, truncated.
    #[test]
    fn nearest_by_hand() {
        assert_eq!(
            reds(&resize(&row(&[10, 20, 30, 40]), 2, 1, Filter::Nearest)),
            [20, 40]
        );
        assert_eq!(
            reds(&resize(&row(&[10, 20]), 4, 1, Filter::Nearest)),
            [10, 10, 20, 20]
        );
    }

    #[test]
    fn same_size_is_a_copy() {
        let img = row(&[1, 2, 3]);
        assert_eq!(resize(&img, 3, 1, Filter::Lanczos), img);
    }

    #[test]
    fn normalize_channels_first() {
        let img = RgbImage {
            width: 2,
            height: 1,
            data: vec![0, 128, 255, 255, 0, 51],
        };
        let out = to_chw_normalized(&img, 1.0 / 255.0, [0.5; 3], [0.5; 3]);
        let expect = |v: u8| ((f64::from(v) / 255.0) as f32 - 0.5) / 0.5;
        assert_eq!(out.len(), 6);
        assert_eq!(out[0], -1.0);
        assert_eq!(out[1], 1.0);
        assert_eq!(out[2], expect(128));
        assert_eq!(out[3], expect(0));
        assert_eq!(out[4], 1.0);
        assert_eq!(out[5], expect(51));
    }
}
