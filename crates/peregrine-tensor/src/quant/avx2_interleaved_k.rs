//! x86 kernels for the K-quant [`Interleaved`](super::interleaved::Interleaved) formats (Q4_K,
//! Q6_K): one group of 8 rows against `T` inputs, called by [`super::avx2_interleaved`]'s
//! dispatch with the same integer sums ([`sum`], [`halves`]).

use std::arch::x86_64::*;

use super::avx2::Isa;
use super::avx2_groups::Source;
use super::avx2_interleaved::{Inputs, halves, sum};

/// Q4_K: per sub-block the 8 rows' scales and minimums widen to one vector each, so each input
/// pays one multiply and two FMAs per 32 values for 8 rows, as the row kernel pays per row.
/// From either layout ([`Source`]): the same integer sums and float operations.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines; `w`
/// is a Q4_K group and each input holds its blocks.
#[inline(always)]
pub(super) unsafe fn rows_q4k<I: Isa, const T: usize>(w: impl Source, x: Inputs) -> [__m256; T] {
    // SAFETY: per this function's contract; every super-block asked for is the group's.
    unsafe {
        let mask = _mm256_set1_epi8(0xF);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut mins = [_mm256_setzero_ps(); T];
        for i in 0..w.q4k_blocks() {
            w.prefetch(i);
            let (d, dmin, k) = w.q4k(i);
            for p in 0..4 {
                let packed = w.q4k_codes(i, p);
                for h in 0..2 {
                    let j = 2 * p + h;
                    // d·scale and dmin·minimum of sub-block j, for the 8 rows.
                    let (scale, min) = w.q4k_sub(k, j);
                    let (scale, min) = (_mm256_mul_ps(d, scale), _mm256_mul_ps(dmin, min));
                    let mut codes = [_mm256_setzero_si256(); 8];
                    for (code, &q) in codes.iter_mut().zip(&packed) {
                        let q = if h == 0 { q } else { _mm256_srli_epi16(q, 4) };
                        *code = _mm256_and_si256(q, mask);
                    }
                    for t in 0..T {
                        let xb = x.get(t, 8 * i + j);
                        let sum = _mm256_cvtepi32_ps(sum::<I, 4, T>(&codes, xb));
                        let scaled = _mm256_mul_ps(scale, _mm256_set1_ps(xb.d));
                        acc[t] = _mm256_fmadd_ps(scaled, sum, acc[t]);
                        mins[t] = _mm256_fmadd_ps(min, _mm256_set1_ps(xb.dsum), mins[t]);
                    }
                }
            }
        }
        let mut y = [_mm256_setzero_ps(); T];
        for (t, y) in y.iter_mut().enumerate() {
            *y = _mm256_sub_ps(acc[t], mins[t]);
        }
        y
    }
}

/// Q6_K: low nibbles and high bit pairs unpack once per sub-block for 8 rows; the i8 scale of
/// each 16 values multiplies that half's integer sum exactly (as the row kernel's `madd` does),
/// and the codes' offset of 32 goes through the inputs' half sums in its own accumulator.
/// From either layout ([`Source`]): the same integer sums and float operations.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines; `w`
/// is a Q6_K group and each input holds its blocks.
#[inline(always)]
pub(super) unsafe fn rows_q6k<I: Isa, const T: usize>(w: impl Source, x: Inputs) -> [__m256; T] {
    // SAFETY: per this function's contract; every super-block asked for is the group's.
    unsafe {
        let (low_mask, high_mask) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(0x30));
        let mut acc = [_mm256_setzero_ps(); T];
        let mut offsets = [_mm256_setzero_ps(); T];
        for i in 0..w.q6k_blocks() {
            w.prefetch(i);
            let (d, k) = w.q6k(i);
            let minus_32d = _mm256_mul_ps(_mm256_set1_ps(-32.0), d);
            for n in 0..2 {
                let half = w.q6k_half(i, n);
                for t in 0..4 {
                    let j = 4 * n + t;
                    // The i8 scales of the sub-block's halves, and −32·d·scale for the offsets.
                    let sc_lo = w.q6k_scale(k, 8 * n + 2 * t);
                    let sc_hi = w.q6k_scale(k, 8 * n + 2 * t + 1);
                    let off_lo = _mm256_mul_ps(minus_32d, _mm256_cvtepi32_ps(sc_lo));
                    let off_hi = _mm256_mul_ps(minus_32d, _mm256_cvtepi32_ps(sc_hi));
                    let low = w.q6k_low(&half, t % 2);
                    let mut codes = [_mm256_setzero_si256(); 8];
                    for (c, code) in codes.iter_mut().enumerate() {
                        let (ql, qh) = w.q6k_bits(&half, &low, c);
                        let low = if t < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
                        // Bits 2t, 2t + 1 to bits 4, 5.
                        let high = match t {
                            0 => _mm256_slli_epi16(qh, 4),
                            1 => _mm256_slli_epi16(qh, 2),
                            2 => qh,
                            _ => _mm256_srli_epi16(qh, 2),
                        };
                        let low = _mm256_and_si256(low, low_mask);
                        *code = _mm256_or_si256(low, _mm256_and_si256(high, high_mask));
                    }
                    for tt in 0..T {
                        let xb = x.get(tt, 8 * i + j);
                        let (s0, s1) = halves::<I, 6>(&codes, xb);
                        let sum = _mm256_add_epi32(
                            _mm256_mullo_epi32(s0, sc_lo),
                            _mm256_mullo_epi32(s1, sc_hi),
                        );
                        let scaled = _mm256_mul_ps(d, _mm256_set1_ps(xb.d));
                        acc[tt] = _mm256_fmadd_ps(scaled, _mm256_cvtepi32_ps(sum), acc[tt]);
                        // Both halves' offsets, then the running sum (the row kernel's order).
                        let o = _mm256_add_ps(
                            _mm256_mul_ps(off_lo, _mm256_set1_ps(xb.dsum16[0])),
                            _mm256_mul_ps(off_hi, _mm256_set1_ps(xb.dsum16[1])),
                        );
                        offsets[tt] = _mm256_add_ps(offsets[tt], o);
                    }
                }
            }
        }
        let mut y = [_mm256_setzero_ps(); T];
        for (t, y) in y.iter_mut().enumerate() {
            *y = _mm256_add_ps(acc[t], offsets[t]);
        }
        y
    }
}
