//! Decoding image bytes (PNG, JPEG, WebP) into 8-bit RGB, with size limits checked on the header
//! before any pixel is decoded, and transformers' `convert_to_rgb` (PIL's alpha compositing onto
//! white) for every mode other than RGB.
//!
//! PNG and WebP decode to the same pixels PIL reads (checked against Pillow 13 on RGB, RGBA, LA,
//! L, palette and `tRNS` PNGs and on lossless and lossy WebP). JPEG goes through zune-jpeg, whose
//! IDCT and chroma upsampling differ from libjpeg-turbo's (PIL's): on photos saved with 4:2:0
//! chroma about 15% of the values differ, by up to 4-6 levels (mean 0.2); with 4:4:4 about 1%, by
//! up to 3; grayscale by 1. Synthetic images with sharp colour edges differ by more at those
//! edges. So JPEG input is close to, not equal to, what the HF processor sees. The EXIF
//! orientation is not applied (neither does an HF processor given `Image.open`'s result).

use std::fmt;
use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader};

/// An 8-bit RGB image: `data` holds `height` rows of `width` interleaved `[r, g, b]` pixels.
#[derive(Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Columns.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// `width * height * 3` bytes, row-major, RGB interleaved.
    pub data: Vec<u8>,
}

/// Its size only: a request's Debug output must not dump megabytes of pixels.
impl std::fmt::Debug for RgbImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RgbImage({}x{})", self.width, self.height)
    }
}

/// What [`decode_image`] accepts, so that a request cannot make the server allocate without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// The largest encoded input, in bytes (default 20 MiB).
    pub max_bytes: usize,
    /// The largest `width * height` the header may declare (default 40 megapixels, 120 MB of RGB).
    /// Checked before any pixel data is decoded.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits {
            max_bytes: 20 << 20,
            max_pixels: 40_000_000,
        }
    }
}

/// Why an image could not be used. The message says what was wrong; the caller adds which
/// content part it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaError(pub String);

impl fmt::Display for MediaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MediaError {}

fn err(msg: impl Into<String>) -> MediaError {
    MediaError(msg.into())
}

/// A decoder's error as text, without the trailing newline some of them carry.
fn cause(e: impl fmt::Display) -> String {
    e.to_string().trim_end().to_owned()
}

/// Bytes the decoder may allocate beyond 8 per pixel (16-bit RGBA, the widest output of the
/// enabled formats): row buffers, JPEG component planes, PNG metadata.
const ALLOC_SLACK: u64 = 64 << 20;

/// Decodes a PNG, JPEG or WebP image (the format is read from the bytes) into 8-bit RGB.
///
/// Refuses input longer than `limits.max_bytes`, and reads the dimensions from the header first:
/// an image declaring more than `limits.max_pixels` pixels is refused before its pixel data is
/// decoded (the decoder also runs with `image::Limits` set to those dimensions, a second guard).
/// Corrupt, truncated or zero-sized images are errors.
///
/// Modes are converted as transformers' `convert_to_rgb` does with PIL: RGB is kept; grayscale is
/// replicated into the three channels; palette images are expanded by the decoder; anything with
/// transparency (an alpha channel, or a PNG `tRNS` chunk, which the decoder expands into alpha) is
/// composited onto opaque white with PIL's integer `ImagingAlphaComposite` arithmetic. 16-bit
/// images are reduced to 8 bits by the `image` crate's rule (`v / 257`, rounded), where PIL keeps
/// the high byte of 16-bit RGB and clips 16-bit grayscale (`I;16`) to 255: those differ (untested).
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    if bytes.is_empty() {
        return Err(err("the image is empty (0 bytes)"));
    }
    if bytes.len() > limits.max_bytes {
        return Err(err(format!(
            "the image is {} bytes, more than the limit of {} bytes",
            bytes.len(),
            limits.max_bytes
        )));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| err(format!("cannot read the image: {}", cause(e))))?;
    let format = match reader.format() {
        Some(f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP)) => f,
        _ => return Err(err("not a PNG, JPEG or WebP image")),
    };
    let name = format_name(format);

    // The header alone: no pixel buffer is allocated here.
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| err(format!("cannot read the {name} header: {}", cause(e))))?;
    if w == 0 || h == 0 {
        return Err(err(format!("the {name} image is empty ({w}x{h} pixels)")));
    }
    let pixels = u64::from(w) * u64::from(h);
    if pixels > limits.max_pixels {
        return Err(err(format!(
            "the {name} image is {w}x{h} = {pixels} pixels, more than the limit of {} pixels",
            limits.max_pixels
        )));
    }

    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    let mut guard = image::Limits::default();
    guard.max_image_width = Some(w);
    guard.max_image_height = Some(h);
    guard.max_alloc = Some(pixels.saturating_mul(8).saturating_add(ALLOC_SLACK));
    reader.limits(guard);
    let decoded = reader
        .decode()
        .map_err(|e| err(format!("cannot decode the {name} image: {}", cause(e))))?;
    if (decoded.width(), decoded.height()) != (w, h) {
        return Err(err(format!(
            "the {name} image decoded to {}x{} pixels, its header says {w}x{h}",
            decoded.width(),
            decoded.height()
        )));
    }
    Ok(to_rgb(decoded))
}

fn format_name(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        _ => "WebP",
    }
}

/// transformers' `convert_to_rgb` (image_transforms.py) on what PIL would have opened.
fn to_rgb(img: DynamicImage) -> RgbImage {
    let (width, height) = (img.width() as usize, img.height() as usize);
    let data = match img {
        DynamicImage::ImageRgb8(buf) => buf.into_raw(),
        // PIL's "L" -> "RGB" replicates the value.
        DynamicImage::ImageLuma8(buf) => buf.into_raw().iter().flat_map(|&v| [v; 3]).collect(),
        // "RGBA", "LA", "P" or "L"/"RGB" with a transparent colour: RGBA over opaque white.
        img if img.color().has_alpha() => composite_on_white(img.into_rgba8().as_raw()),
        // 16-bit and float without alpha.
        img => img.into_rgb8().into_raw(),
    };
    RgbImage {
        width,
        height,
        data,
    }
}

/// `Image.alpha_composite(white, rgba).convert("RGB")`: Pillow's `ImagingAlphaComposite`
/// (src/libImaging/AlphaComposite.c) with the destination opaque white, dropping the alpha.
fn composite_on_white(rgba: &[u8]) -> Vec<u8> {
    rgba.chunks_exact(4)
        .flat_map(|p| {
            let a = p[3];
            [
                alpha_composite(p[0], a, 255, 255),
                alpha_composite(p[1], a, 255, 255),
                alpha_composite(p[2], a, 255, 255),
            ]
        })
        .collect()
}

/// One colour channel of `ImagingAlphaComposite`: source `src` with alpha `src_a` over
/// destination `dst` with alpha `dst_a`, in Pillow's unsigned 32-bit integer arithmetic.
fn alpha_composite(src: u8, src_a: u8, dst: u8, dst_a: u8) -> u8 {
    const PRECISION_BITS: u32 = 7;
    /// `SHIFTFORDIV255(a)`: `a / 255` for the ranges it is used on (ImagingUtils.h).
    fn shift_for_div255(a: u32) -> u32 {
        ((a >> 8) + a) >> 8
    }
    if src_a == 0 {
        return dst;
    }
    let (src, src_a, dst, dst_a) = (
        u32::from(src),
        u32::from(src_a),
        u32::from(dst),
        u32::from(dst_a),
    );
    let blend = dst_a * (255 - src_a);
    let outa255 = src_a * 255 + blend;
    let coef1 = src_a * 255 * 255 * (1 << PRECISION_BITS) / outa255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let tmp = src * coef1 + dst * coef2;
    (shift_for_div255(tmp + (0x80 << PRECISION_BITS)) >> PRECISION_BITS) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composite_keeps_opaque_and_drops_transparent() {
        for v in 0..=255u8 {
            assert_eq!(alpha_composite(v, 255, 255, 255), v);
            assert_eq!(alpha_composite(v, 0, 255, 255), 255);
        }
        // Black at alpha 128 over white: outa255 = 128*255 + 255*127 = 65025, coef1 =
        // 128*255*255*128 / 65025 = 16384, coef2 = 32640 - 16384 = 16256, tmp = 255*16256;
        // SHIFTFORDIV255(tmp + 16384) = 16320, >> 7 = 127.
        assert_eq!(alpha_composite(0, 128, 255, 255), 127);
    }

    #[test]
    fn limits_default() {
        let l = ImageLimits::default();
        assert_eq!(l.max_bytes, 20 * 1024 * 1024);
        assert_eq!(l.max_pixels, 40_000_000);
    }
}
