//! The block formats Peregrine's CPU kernels multiply directly: GGUF's, and one of our own for
//! MLX 8-bit weights.

use candle_core::quantized::GgmlDType;

/// A GGUF block format with a Peregrine kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum Format {
    /// 32 values: f16 scale, 4-bit codes offset by 8.
    Q4_0,
    /// 32 values: f16 scale and minimum, 4-bit codes.
    Q4_1,
    /// 32 values: f16 scale, 5-bit codes offset by 16.
    Q5_0,
    /// 32 values: f16 scale and minimum, 5-bit codes.
    Q5_1,
    /// 32 values: f16 scale, 8-bit signed codes.
    Q8_0,
    /// 256 values: 8 sub-blocks with 6-bit scales and minimums, 4-bit codes.
    Q4K,
    /// 256 values: as Q4_K with 5-bit codes.
    Q5K,
    /// 256 values: 16 groups with i8 scales, 6-bit codes offset by 32.
    Q6K,
    /// 32 values: f16 scale and bias, 8-bit unsigned codes (`w = scale·q + bias`): MLX affine
    /// 8-bit weights regrouped. Not a GGUF format (ggml's Q8_1 holds signed codes and a sum).
    MLX8,
    /// 64 values as [`Format::MLX8`] with one scale and bias: MLX 8-bit groups of 64 or 128,
    /// at the file's 8.5 bits a weight.
    MLX8G64,
}

impl Format {
    /// The format of a GGUF dtype, when a kernel exists for it.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q5_1 => Self::Q5_1,
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q5K => Self::Q5K,
            GgmlDType::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// The GGUF dtype, `None` for [`Format::MLX8`] and [`Format::MLX8G64`].
    pub fn dtype(self) -> Option<GgmlDType> {
        Some(match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
            Self::MLX8 | Self::MLX8G64 => return None,
        })
    }

    /// Whether kernels add the input's refinements ([`super::act::Refinement`]): the GGUF
    /// formats of 32-value blocks, where a refinement costs one block. (The K-quants would pay
    /// a whole 256-value block for one sub-block.)
    pub fn refines(self) -> bool {
        matches!(
            self,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0
        )
    }

    /// Values per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
            Self::MLX8G64 => 64,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::MLX8 => 36,
            Self::MLX8G64 => 68,
        }
    }
}

/// The little-endian f16 at byte `at`, widened.
#[inline]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Scale and minimum of sub-block `j` from the 12 packed bytes of Q4_K/Q5_K (ggml's
/// `get_scale_min_k4`).
#[inline]
pub(crate) fn k_scale_min(q: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
