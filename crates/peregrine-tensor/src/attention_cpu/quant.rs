//! Affine-quantized cache rows (`--kv-bits`, MLX's KV quantization): each group of `group`
//! values is `scale · code + bias` with 4- or 8-bit codes and an f16 `(scale, bias)` pair, and
//! attention widens 16 values at a time straight from the codes.

use half::f16;

use super::rows::KvRows;
use crate::attention::QuantPlane;

/// Rows of a [`QuantPlane`], `count` of them from some slot on.
#[derive(Clone, Copy)]
pub(super) struct QuantRows<'a> {
    codes: &'a [u8],
    params: &'a [f16],
    count: usize,
    len: usize,
    bits: u8,
    group: usize,
}

impl<'a> QuantRows<'a> {
    /// `count` rows of `len` values from row `first` of `plane`.
    pub(super) fn of(plane: &QuantPlane<'a>, first: usize, count: usize, len: usize) -> Self {
        let (code_bytes, params) = row_sizes(len, plane.bits, plane.group);
        Self {
            codes: &plane.codes[first * code_bytes..][..count * code_bytes],
            params: &plane.params[first * params..][..count * params],
            count,
            len,
            bits: plane.bits,
            group: plane.group,
        }
    }

    fn code_bytes(&self) -> usize {
        self.len * self.bits as usize / 8
    }

    fn params_per_row(&self) -> usize {
        2 * self.len / self.group
    }

    /// `(scale, bias)` of the group holding element `c` of row `j`.
    fn affine(&self, j: usize, c: usize) -> (f32, f32) {
        let p = &self.params[j * self.params_per_row() + 2 * (c / self.group)..];
        (p[0].to_f32(), p[1].to_f32())
    }
}

/// Code bytes and f16 parameters per row of `len` values in the [`QuantPlane`] layout.
pub fn row_sizes(len: usize, bits: u8, group: usize) -> (usize, usize) {
    (len * bits as usize / 8, 2 * len / group)
}

impl KvRows for QuantRows<'_> {
    fn count(&self) -> usize {
        self.count
    }

    fn width(&self) -> usize {
        self.len
    }

    fn subset(&self, from: usize, count: usize) -> Self {
        let (cb, pb) = (self.code_bytes(), self.params_per_row());
        Self {
            codes: &self.codes[from * cb..][..count * cb],
            params: &self.params[from * pb..][..count * pb],
            count,
            ..*self
        }
    }

    fn get(&self, j: usize, c: usize) -> f32 {
        let row = &self.codes[j * self.code_bytes()..];
        let code = match self.bits {
            8 => row[c],
            _ => (row[c / 2] >> (4 * (c % 2))) & 0x0f,
        };
        let (scale, bias) = self.affine(j, c);
        scale.mul_add(code as f32, bias) // fused, as the vectorized read is
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load16(&self, j: usize, c: usize) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::*;
        let row = self.codes[j * self.code_bytes()..].as_ptr();
        let p = self.params[j * self.params_per_row() + 2 * (c / self.group)..].as_ptr();
        // SAFETY: the caller keeps `c + 16 ≤ len`, so 16 codes (8 bytes at 4 bits) and the
        // group's two parameters are in the row; AVX2/F16C per the trait's contract.
        unsafe {
            let bytes = match self.bits {
                8 => _mm_loadu_si128(row.add(c).cast()),
                _ => {
                    let packed = _mm_loadl_epi64(row.add(c / 2).cast());
                    let low = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
                    let high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
                    _mm_unpacklo_epi8(low, high) // element 2i is byte i's low nibble
                }
            };
            let affine = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
            let scale = _mm256_broadcastss_ps(affine);
            let bias = _mm256_broadcastss_ps(_mm_movehdup_ps(affine));
            let widen = |b: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
            [
                _mm256_fmadd_ps(widen(bytes), scale, bias),
                _mm256_fmadd_ps(widen(_mm_srli_si128(bytes, 8)), scale, bias),
            ]
        }
    }
}

/// Quantizes `x` (rows of `len` values) into `codes` and `params` as [`QuantPlane`] lays them
/// out: per group, `scale = (max - min) / (2^bits - 1)` and `bias = min`, both rounded to f16
/// before the codes are chosen, so that decoding uses exactly the values the codes were fit to.
pub fn quantize_rows(
    x: &[f32],
    len: usize,
    bits: u8,
    group: usize,
    codes: &mut [u8],
    params: &mut [f16],
) {
    let levels = ((1u32 << bits) - 1) as f32;
    let (code_bytes, per_row) = row_sizes(len, bits, group);
    let rows = x.chunks_exact(len).zip(codes.chunks_exact_mut(code_bytes));
    for ((row, codes), params) in rows.zip(params.chunks_exact_mut(per_row)) {
        if bits != 8 {
            codes.fill(0);
        }
        for (g, values) in row.chunks_exact(group).enumerate() {
            let (lo, hi) = values
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
                    (l.min(v), h.max(v))
                });
            let scale = f16::from_f32((hi - lo) / levels);
            let bias = f16::from_f32(lo);
            params[2 * g] = scale;
            params[2 * g + 1] = bias;
            let (scale, bias) = (scale.to_f32(), bias.to_f32());
            for (i, &v) in values.iter().enumerate() {
                let code = match scale > 0.0 {
                    true => ((v - bias) / scale).round().clamp(0.0, levels) as u8,
                    false => 0,
                };
                let c = g * group + i;
                match bits {
                    8 => codes[c] = code,
                    _ => codes[c / 2] |= code << (4 * (c % 2)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plane_of(x: &[f32], len: usize, bits: u8, group: usize) -> (Vec<u8>, Vec<f16>) {
        let rows = x.len() / len;
        let (cb, pb) = row_sizes(len, bits, group);
        let (mut codes, mut params) = (vec![0u8; rows * cb], vec![f16::ZERO; rows * pb]);
        quantize_rows(x, len, bits, group, &mut codes, &mut params);
        (codes, params)
    }

    /// Every value decodes within half a step of its group's scale (plus f16 rounding of the
    /// bias), on both read paths, and the vectorized read equals the scalar one exactly.
    #[test]
    fn codes_decode_within_half_a_step() {
        let len = 64;
        let x: Vec<f32> = (0..3 * len)
            .map(|i| (i as f32 * 0.713).sin() * 3.0 + 0.5)
            .collect();
        for (bits, group) in [(8, 32), (8, 64), (4, 32), (4, 64)] {
            let (codes, params) = plane_of(&x, len, bits, group);
            let plane = QuantPlane {
                codes: &codes,
                params: &params,
                bits,
                group,
            };
            let rows = QuantRows::of(&plane, 0, 3, len);
            let step = 6.0 / ((1u32 << bits) - 1) as f32;
            for j in 0..3 {
                for c in 0..len {
                    let err = (rows.get(j, c) - x[j * len + c]).abs();
                    assert!(err <= step / 2.0 + 4e-3, "{bits}/{group} [{j},{c}]: {err}");
                }
                #[cfg(target_arch = "x86_64")]
                if super::super::rows::simd::available() != super::super::rows::simd::Simd::Portable
                {
                    for c in (0..len).step_by(16) {
                        let mut wide = [0f32; 16];
                        // SAFETY: AVX2 is available; c + 16 ≤ len.
                        unsafe {
                            let [a, b] = rows.load16(j, c);
                            std::arch::x86_64::_mm256_storeu_ps(wide.as_mut_ptr(), a);
                            std::arch::x86_64::_mm256_storeu_ps(wide.as_mut_ptr().add(8), b);
                        }
                        let scalar: Vec<f32> = (c..c + 16).map(|c| rows.get(j, c)).collect();
                        assert_eq!(wide.to_vec(), scalar, "{bits}/{group} row {j} at {c}");
                    }
                }
            }
        }
    }
}
