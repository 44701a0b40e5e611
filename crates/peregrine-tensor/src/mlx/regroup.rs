//! MLX 4-bit weights regrouped into GGUF Q4_1 blocks, so the integer kernels of
//! [`crate::quant`] (8-bit activations, rows interleaved for x86) multiply them.
//!
//! Both formats mean `w = scale·q + bias` with 4-bit `q`: an MLX group of 32/64/128 values is
//! 1/2/4 Q4_1 blocks sharing its scale and bias. Only the packing differs: MLX puts value `i` of
//! a group in nibble `i % 8` of word `i / 8`; Q4_1 puts value `j` of a block in the low nibble of
//! byte `j` and value `j + 16` in its high nibble. Q4_1 stores scale and bias as f16, so a
//! matrix regroups only when every bias, and every scale of a group with a nonzero code, is
//! exactly an f16 (bf16 values of magnitude 2⁻¹⁴..65504 always are; MLX gives constant groups,
//! such as a padded vocabulary's zero rows, a 1e-7 scale and zero codes): the regrouped weights
//! are the same numbers, bit for bit.

use candle_core::quantized::{GgmlDType, QTensor, ggml_file::qtensor_from_ggml};
use candle_core::{Device, Result};
use half::f16;
use rayon::prelude::*;

use super::kernels::ScaleType;
use super::{MlxQuantized, Sb, with_scales};
use crate::quant::{Format, GgufMatrix};

/// Values per Q4_1 block.
const BLOCK: usize = 32;
/// Bytes per Q4_1 block: f16 scale, f16 bias, 16 bytes of codes.
const BLOCK_BYTES: usize = 20;

impl MlxQuantized {
    /// The same matrix as a GGUF Q4_1 tensor, or `None` when it is not 4-bit or a value would
    /// change (module docs).
    pub fn to_q4_1(&self) -> Result<Option<QTensor>> {
        let Some(bytes) = self.q4_1_bytes()? else {
            return Ok(None);
        };
        let (out, in_dim) = self.dims();
        qtensor_from_ggml(GgmlDType::Q4_1, &bytes, vec![out, in_dim], &Device::Cpu).map(Some)
    }

    /// [`to_q4_1`](Self::to_q4_1) as a [`GgufMatrix`] for the integer kernels, without an
    /// intermediate copy in candle's tensor (rows interleave straight from the regrouped bytes).
    pub fn to_gguf_matrix(&self) -> Result<Option<GgufMatrix>> {
        let Some(bytes) = self.q4_1_bytes()? else {
            return Ok(None);
        };
        let (out, in_dim) = self.dims();
        GgufMatrix::from_blocks(Format::Q4_1, bytes, (out, in_dim)).map(Some)
    }

    /// The Q4_1 blocks, row by row, when the matrix regroups exactly.
    fn q4_1_bytes(&self) -> Result<Option<Vec<u8>>> {
        if self.bits != 4 || !matches!(self.packed.device(), Device::Cpu) {
            return Ok(None);
        }
        let (out, in_dim) = self.dims();
        let mut bytes = vec![0u8; out * in_dim / BLOCK * BLOCK_BYTES];
        let exact = self.with_view(|v| {
            with_scales!(v.sb, s, b => {
                let row_bytes = in_dim / BLOCK * BLOCK_BYTES;
                bytes.par_chunks_mut(row_bytes).enumerate().all(|(r, row)| {
                    let groups = r * v.groups..(r + 1) * v.groups;
                    let (s, b) = (&s[groups.clone()], &b[groups]);
                    regroup_row(v.row_words(r), s, b, v.group_size, row)
                })
            })
        })?;
        Ok(exact.then_some(bytes))
    }
}

/// One row's MLX words and group scales/biases as Q4_1 blocks into `out`; false when a value
/// changes (a bias, or the scale of a group with a nonzero code, is not exactly an f16).
fn regroup_row<S: ScaleType>(
    words: &[u32],
    s: &[S],
    b: &[S],
    group_size: usize,
    out: &mut [u8],
) -> bool {
    let exact = |v: f32| f16::from_f32(v).to_f32().to_bits() == v.to_bits();
    // 4 words (32 nibbles) per block, in input order in both layouts.
    for (i, (w, block)) in
        (words.chunks_exact(4).zip(out.chunks_exact_mut(BLOCK_BYTES))).enumerate()
    {
        let g = i * BLOCK / group_size;
        let (scale, bias) = (s[g].widen(), b[g].widen());
        // All-zero codes make the scale irrelevant (MLX gives constant groups a 1e-7 scale).
        let codes_zero = words[g * group_size / 8..][..group_size / 8]
            .iter()
            .all(|&w| w == 0);
        if !exact(bias) || !(exact(scale) || codes_zero) {
            return false;
        }
        block[..2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(bias).to_le_bytes());
        let code = |i: usize| ((w[i / 8] >> (4 * (i % 8))) & 0xF) as u8;
        for (j, q) in block[4..].iter_mut().enumerate() {
            *q = code(j) | code(j + BLOCK / 2) << 4;
        }
    }
    true
}
