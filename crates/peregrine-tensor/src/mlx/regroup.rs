//! MLX 4-bit and 8-bit weights regrouped into blocks (GGUF's Q4_1, and our own
//! [`Format::MLX8`] / [`Format::MLX8G64`]), so the integer kernels of [`crate::quant`] (8-bit
//! activations, rows interleaved for x86 where the format has that layout) multiply them.
//!
//! Both sides mean `w = scale·q + bias`: an MLX group of 32/64/128 values is 1/2/4 Q4_1
//! blocks sharing its scale and bias (8 bits: 1 MLX8 block, or 1/2 MLX8G64 blocks). Only the
//! packing differs: MLX puts value `i` of a 4-bit group in nibble `i % 8` of word `i / 8`; Q4_1
//! puts value `j` of a block in the low nibble of byte `j` and value `j + 16` in its high nibble.
//! 8-bit codes are bytes in value order on both sides.
//! The blocks store scale and bias as f16, so a matrix regroups only when every bias, and every
//! scale of a group with a nonzero code, is exactly an f16 (bf16 values of magnitude
//! 2⁻¹⁴..65504 always are; MLX gives constant groups, such as a padded vocabulary's zero rows,
//! a 1e-7 scale and zero codes): the regrouped weights are the same numbers, bit for bit.

use candle_core::quantized::{GgmlDType, QTensor, ggml_file::qtensor_from_ggml};
use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::kernels::ScaleType;
use super::{CpuView, MlxQuantized, Sb, with_scales};
use crate::quant::{Format, GgufMatrix};

impl MlxQuantized {
    /// The same matrix as a GGUF Q4_1 tensor, or `None` when it is not 4-bit or a value would
    /// change (module docs).
    pub fn to_q4_1(&self) -> Result<Option<QTensor>> {
        match self.blocks()? {
            Some((Format::Q4_1, bytes)) => {
                let (out, in_dim) = self.dims();
                qtensor_from_ggml(GgmlDType::Q4_1, &bytes, vec![out, in_dim], &Device::Cpu)
                    .map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The matrix as a [`GgufMatrix`] for the integer kernels (4-bit as Q4_1, 8-bit as
    /// [`Format::MLX8G64`], or [`Format::MLX8`] for groups of 32), without an intermediate copy
    /// in candle's tensor; `None` for other widths, other devices, or when a value would change
    /// (module docs).
    pub fn to_gguf_matrix(&self) -> Result<Option<GgufMatrix>> {
        Ok(self.clone().into_gguf_matrix()?.ok())
    }

    /// [`to_gguf_matrix`](Self::to_gguf_matrix) that gives this matrix up first, so its codes
    /// are freed before the blocks move into their layout (loading holds one copy fewer of
    /// the largest matrix); `Err(self)` when it does not regroup.
    pub fn into_gguf_matrix(self) -> Result<std::result::Result<GgufMatrix, Self>> {
        let Some((format, bytes)) = self.blocks()? else {
            return Ok(Err(self));
        };
        let dims = self.dims();
        drop(self);
        GgufMatrix::from_blocks(format, bytes, dims).map(Ok)
    }

    /// The regrouped blocks, row by row, when the matrix regroups exactly.
    fn blocks(&self) -> Result<Option<(Format, Vec<u8>)>> {
        let Some(format) = block_format(self.bits, self.group_size) else {
            return Ok(None);
        };
        if !matches!(self.packed.device(), Device::Cpu) {
            return Ok(None);
        }
        let (out, in_dim) = self.dims();
        let mut bytes = vec![0u8; out * in_dim / format.block_len() * format.block_bytes()];
        let exact = self.with_view(|v| regroup_rows(format, v, &mut bytes))?;
        Ok(exact.then_some((format, bytes)))
    }

    /// [`into_gguf_matrix`](Self::into_gguf_matrix) for a matrix whose codes are still in a
    /// mapped file: `packed` holds MLX's u32 words as stored (little-endian, any alignment),
    /// `scales` and `biases` are loaded. The codes are read in bands of about 8 MiB, and `done`
    /// receives each band's byte range once it is regrouped, for the caller to release those
    /// pages: loading never holds the codes and the blocks at once. `None` when the matrix does
    /// not regroup (other widths, a value that would change); the caller then loads it.
    pub fn regroup_mapped(
        packed: &[u8],
        scales: &Tensor,
        biases: &Tensor,
        (bits, group_size): (usize, usize),
        done: &mut dyn FnMut(Range<usize>),
    ) -> Result<Option<GgufMatrix>> {
        let Some(format) = block_format(bits, group_size) else {
            return Ok(None);
        };
        let (out, groups) = scales.dims2()?;
        let in_dim = groups * group_size;
        let stored = matches!(scales.dtype(), DType::BF16 | DType::F16 | DType::F32);
        let words_per_row = in_dim * bits / 32;
        if packed.len() != out * words_per_row * 4
            || biases.dims2()? != (out, groups)
            || scales.dtype() != biases.dtype()
            || !stored
            || !scales.device().is_cpu()
        {
            return Ok(None);
        }
        let (s, b) = (scales.contiguous()?, biases.contiguous()?);
        let ((sg, sl), (bg, bl)) = (s.storage_and_layout(), b.storage_and_layout());
        let sb = Sb::of(s.dtype(), (&sg, sl), (&bg, bl))?;
        let row_bytes = in_dim / format.block_len() * format.block_bytes();
        let band = (BAND_BYTES / (4 * words_per_row).max(1)).max(1);
        let mut bytes = vec![0u8; out * row_bytes];
        let mut words = Vec::with_capacity(band * words_per_row);
        for r0 in (0..out).step_by(band) {
            let rows = r0..(r0 + band).min(out);
            let codes = rows.start * words_per_row * 4..rows.end * words_per_row * 4;
            le_words(&packed[codes.clone()], &mut words);
            let view = CpuView::new(
                &words,
                sb.rows(rows.clone(), groups),
                bits,
                group_size,
                in_dim,
            );
            let blocks = &mut bytes[rows.start * row_bytes..rows.end * row_bytes];
            if !regroup_rows(format, &view, blocks) {
                return Ok(None);
            }
            done(codes);
        }
        GgufMatrix::from_blocks(format, bytes, (out, in_dim)).map(Some)
    }
}

/// `bytes` (little-endian u32 words, any alignment) as words into `words` (replaced).
fn le_words(bytes: &[u8], words: &mut Vec<u32>) {
    words.clear();
    words.resize(bytes.len() / 4, 0);
    if cfg!(target_endian = "little") {
        // SAFETY: `words` holds exactly `bytes.len() / 4` words; any bits are a valid u32.
        unsafe {
            let dst = words.as_mut_ptr() as *mut u8;
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, words.len() * 4);
        }
    } else {
        for (w, b) in words.iter_mut().zip(bytes.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

/// The block format MLX weights of `bits` and `group_size` regroup into.
fn block_format(bits: usize, group_size: usize) -> Option<Format> {
    match (bits, group_size) {
        (4, _) => Some(Format::Q4_1),
        (8, 32) => Some(Format::MLX8),
        (8, _) => Some(Format::MLX8G64),
        _ => None,
    }
}

/// Bytes of codes [`MlxQuantized::regroup_mapped`] reads per band.
const BAND_BYTES: usize = 8 << 20;

/// `v`'s rows as `format` blocks into `out` (whole rows); false as soon as a value would change.
fn regroup_rows(format: Format, v: &CpuView, out: &mut [u8]) -> bool {
    let row_bytes = v.groups * v.group_size / format.block_len() * format.block_bytes();
    with_scales!(v.sb, s, b => {
        out.par_chunks_mut(row_bytes).enumerate().all(|(r, row)| {
            let groups = r * v.groups..(r + 1) * v.groups;
            let (s, b) = (&s[groups.clone()], &b[groups]);
            regroup_row(format, v.row_words(r), s, b, v.group_size, row)
        })
    })
}

/// One row's MLX words and group scales/biases as `format` blocks into `out`; false when a
/// value changes (a bias, or the scale of a group with a nonzero code, is not exactly an f16).
fn regroup_row<S: ScaleType>(
    format: Format,
    words: &[u32],
    s: &[S],
    b: &[S],
    group_size: usize,
    out: &mut [u8],
) -> bool {
    // 32-bit words per block and per group.
    let bits = if format == Format::Q4_1 { 4 } else { 8 };
    let (values, group_words) = (format.block_len(), group_size * bits / 32);
    // Each group's scale and bias as f16, converted once for the row, and checked exact.
    let widen = |v: &[S]| v.iter().map(|v| v.widen()).collect::<Vec<f32>>();
    let (s32, b32) = (widen(s), widen(b));
    let mut s16 = vec![f16::ZERO; s32.len()];
    let mut b16 = vec![f16::ZERO; b32.len()];
    s16.convert_from_f32_slice(&s32);
    b16.convert_from_f32_slice(&b32);
    for g in 0..s32.len() {
        let exact = |h: f16, v: f32| h.to_f32().to_bits() == v.to_bits();
        // All-zero codes make the scale irrelevant (MLX gives constant groups a 1e-7 scale).
        let codes_zero = || (words[g * group_words..][..group_words].iter()).all(|&w| w == 0);
        if !exact(b16[g], b32[g]) || !(exact(s16[g], s32[g]) || codes_zero()) {
            return false;
        }
    }
    let blocks = words
        .chunks_exact(values * bits / 32)
        .zip(out.chunks_exact_mut(format.block_bytes()));
    for (i, (w, block)) in blocks.enumerate() {
        let g = i * values / group_size;
        block[..2].copy_from_slice(&s16[g].to_le_bytes());
        block[2..4].copy_from_slice(&b16[g].to_le_bytes());
        if bits == 8 {
            for (q, w) in block[4..].chunks_exact_mut(4).zip(w) {
                q.copy_from_slice(&w.to_le_bytes());
            }
            continue;
        }
        let q: &mut [u8; 16] = (&mut block[4..])
            .try_into()
            .expect("a Q4_1 block holds 16 bytes");
        pair_nibbles(w.try_into().expect("a Q4_1 block is 4 MLX words"), q);
    }
    true
}

/// 32 MLX 4-bit codes (value `i` in nibble `i % 8` of word `i / 8`) as Q4_1's 16 bytes (value
/// `j` in the low nibble of byte `j`, value `j + 16` in its high nibble). The words' bytes hold
/// the values in order, two a byte, low nibble first: spreading each half's nibbles to bytes
/// puts values `0..16` and `16..32` in order, and byte `j` joins the two.
fn pair_nibbles(w: &[u32; 4], q: &mut [u8; 16]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SAFETY: SSE2 is part of x86_64; the loads and the store cover 16 bytes each.
        unsafe {
            let v = _mm_loadu_si128(w.as_ptr() as *const __m128i);
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(v, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
            let first = _mm_unpacklo_epi8(lo, hi); // values 0..16
            let second = _mm_unpackhi_epi8(lo, hi); // values 16..32
            let out = _mm_or_si128(first, _mm_slli_epi16(second, 4));
            _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, out);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let code = |i: usize| ((w[i / 8] >> (4 * (i % 8))) & 0xF) as u8;
        for (j, q) in q.iter_mut().enumerate() {
            *q = code(j) | code(j + 16) << 4;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::pair_nibbles;

    #[test]
    fn nibbles_pair_as_q4_1_packs_them() {
        let mut w = [0u32; 4];
        for i in 0..32 {
            let code = (i * 7 + 3) % 16;
            w[i / 8] |= (code as u32) << (4 * (i % 8));
        }
        let mut q = [0u8; 16];
        pair_nibbles(&w, &mut q);
        for (j, &byte) in q.iter().enumerate() {
            let (lo, hi) = ((j * 7 + 3) % 16, ((j + 16) * 7 + 3) % 16);
            assert_eq!(byte, (lo | hi << 4) as u8, "byte {j}");
        }
    }
}
