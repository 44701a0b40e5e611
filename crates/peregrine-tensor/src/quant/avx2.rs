//! AVX2/FMA/F16C dot products of GGUF weight rows with Q8 activations. Each block's codes are
//! unpacked to 32 unsigned bytes and multiplied with `maddubs` (u8 × i8 → i16 pairs → i32), one
//! float FMA per block; offsets and minimums use the activation sums, so they cost one scalar
//! multiply per block. Same arithmetic as [`super::scalar`], up to float summation order.

use std::arch::x86_64::*;

use super::act::Q8Block;
use super::format::{Format, k_scale_min};

/// Whether this CPU can run these kernels.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// `Σ w·x` over one row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_row(format: Format, w: &[u8], x: &[Q8Block]) -> f32 {
    match format {
        Format::Q4_0 => q4_0(w, x),
        Format::Q4_1 => q4_1(w, x),
        Format::Q5_0 => q5_0(w, x),
        Format::Q5_1 => q5_1(w, x),
        Format::Q8_0 => q8_0(w, x),
        Format::Q4K => q4_k(w, x),
        Format::Q5K => q5_k(w, x),
        Format::Q6K => q6_k(w, x),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16(b: &[u8], at: usize) -> f32 {
    let bits = i32::from(u16::from_le_bytes([b[at], b[at + 1]]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(p: &[u8]) -> __m256i {
    let p = &p[..32];
    // SAFETY: `p` has 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xq(x: &Q8Block) -> __m256i {
    // SAFETY: `qs` is 32 bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) }
}

/// Eight i32 partial sums of `codes (u8) · x (i8)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u8_i8(codes: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1))
}

/// `acc + products · scale`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fma(acc: __m256, products: __m256i, scale: f32) -> __m256 {
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(scale), acc)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(acc: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// 16 bytes of packed nibbles → 32 codes, low nibbles first (ggml's order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(qs: &[u8]) -> __m256i {
    let qs = &qs[..16];
    // SAFETY: `qs` has 16 readable bytes; the load is unaligned.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let mask = _mm_set1_epi8(0xF);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16(q, 4), mask),
        _mm_and_si128(q, mask),
    )
}

/// Byte `i` is 16 where bit `i` of the 4 bytes at `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(qh: &[u8]) -> __m256i {
    let bits = i32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread);
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0(w: &[u8], x: &[Q8Block]) -> f32 {
    let (mut acc, mut off) = (_mm256_setzero_ps(), 0f32);
    for (b, x) in w.chunks_exact(18).zip(x) {
        let dd = f16(b, 0) * x.d;
        acc = fma(acc, dot_u8_i8(nibbles(&b[2..18]), xq(x)), dd);
        off -= 8.0 * dd * x.sum as f32;
    }
    hsum(acc) + off
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1(w: &[u8], x: &[Q8Block]) -> f32 {
    let (mut acc, mut off) = (_mm256_setzero_ps(), 0f32);
    for (b, x) in w.chunks_exact(20).zip(x) {
        acc = fma(acc, dot_u8_i8(nibbles(&b[4..20]), xq(x)), f16(b, 0) * x.d);
        off += f16(b, 2) * x.ds;
    }
    hsum(acc) + off
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0(w: &[u8], x: &[Q8Block]) -> f32 {
    let (mut acc, mut off) = (_mm256_setzero_ps(), 0f32);
    for (b, x) in w.chunks_exact(22).zip(x) {
        let codes = _mm256_or_si256(nibbles(&b[6..22]), fifth_bits(&b[2..6]));
        let dd = f16(b, 0) * x.d;
        acc = fma(acc, dot_u8_i8(codes, xq(x)), dd);
        off -= 16.0 * dd * x.sum as f32;
    }
    hsum(acc) + off
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_1(w: &[u8], x: &[Q8Block]) -> f32 {
    let (mut acc, mut off) = (_mm256_setzero_ps(), 0f32);
    for (b, x) in w.chunks_exact(24).zip(x) {
        let codes = _mm256_or_si256(nibbles(&b[8..24]), fifth_bits(&b[4..8]));
        acc = fma(acc, dot_u8_i8(codes, xq(x)), f16(b, 0) * x.d);
        off += f16(b, 2) * x.ds;
    }
    hsum(acc) + off
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0(w: &[u8], x: &[Q8Block]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, x) in w.chunks_exact(34).zip(x) {
        let (wv, xv) = (load32(&b[2..34]), xq(x));
        // |w| · (x · sign w): maddubs needs its first operand unsigned.
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        let p = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
        acc = fma(acc, p, f16(b, 0) * x.d);
    }
    hsum(acc)
}

/// Q4_K and Q5_K: 4 chunks of 32 bytes, low nibbles for sub-block 2j, high for 2j + 1; Q5_K adds
/// bit `k` of each `qh` byte as the fifth bit of sub-block `k`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k_quant(w: &[u8], x: &[Q8Block], block_bytes: usize, five: bool) -> f32 {
    let (mut acc, mut off) = (_mm256_setzero_ps(), 0f32);
    let mask = _mm256_set1_epi8(0xF);
    let qs_at = if five { 48 } else { 16 };
    for (b, xs) in w.chunks_exact(block_bytes).zip(x.chunks_exact(8)) {
        let (d, dmin) = (f16(b, 0), f16(b, 2));
        let high = if five {
            load32(&b[16..48])
        } else {
            _mm256_setzero_si256()
        };
        for j in 0..4 {
            let q = load32(&b[qs_at + 32 * j..]);
            let halves = [
                _mm256_and_si256(q, mask),
                _mm256_and_si256(_mm256_srli_epi16(q, 4), mask),
            ];
            for (h, mut codes) in halves.into_iter().enumerate() {
                let k = 2 * j + h;
                if five {
                    let bit = _mm256_srl_epi16(high, _mm_cvtsi32_si128(k as i32));
                    let bit = _mm256_and_si256(bit, _mm256_set1_epi8(1));
                    codes = _mm256_or_si256(codes, _mm256_slli_epi16(bit, 4));
                }
                let (sc, m) = k_scale_min(&b[4..16], k);
                let xb = &xs[k];
                acc = fma(acc, dot_u8_i8(codes, xq(xb)), d * f32::from(sc) * xb.d);
                off -= dmin * f32::from(m) * xb.d * xb.sum as f32;
            }
        }
    }
    hsum(acc) + off
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k(w: &[u8], x: &[Q8Block]) -> f32 {
    k_quant(w, x, 144, false)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_k(w: &[u8], x: &[Q8Block]) -> f32 {
    k_quant(w, x, 176, true)
}

/// Q6_K: per half of 128 values, sub-block `t` takes low (t < 2) or high nibbles of
/// `ql[32(t % 2)..]` and bits `2t, 2t+1` of `qh`; each 16 values have an i8 scale, applied in
/// the integer sum by `madd` against a vector of the two scales.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k(w: &[u8], x: &[Q8Block]) -> f32 {
    let (mut acc, mut off) = (_mm256_setzero_ps(), 0f32);
    let (mask4, mask2) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
    for (b, xs) in w.chunks_exact(210).zip(x.chunks_exact(8)) {
        let d = f16(b, 208);
        for n in 0..2 {
            let ql = [load32(&b[64 * n..]), load32(&b[64 * n + 32..])];
            let qh = load32(&b[128 + 32 * n..]);
            for t in 0..4 {
                let low = match t {
                    0 | 1 => _mm256_and_si256(ql[t], mask4),
                    _ => _mm256_and_si256(_mm256_srli_epi16(ql[t - 2], 4), mask4),
                };
                let hi = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t as i32));
                let hi = _mm256_slli_epi16(_mm256_and_si256(hi, mask2), 4);
                let codes = _mm256_or_si256(low, hi);
                let xb = &xs[4 * n + t];
                let sc = [
                    b[192 + 8 * n + 2 * t] as i8,
                    b[192 + 8 * n + 2 * t + 1] as i8,
                ];
                let scales = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(sc[1])),
                    _mm_set1_epi16(i16::from(sc[0])),
                );
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq(xb)), scales);
                let dd = d * xb.d;
                acc = fma(acc, p, dd);
                let offset = i32::from(sc[0]) * xb.sum16[0] + i32::from(sc[1]) * xb.sum16[1];
                off -= 32.0 * dd * offset as f32;
            }
        }
    }
    hsum(acc) + off
}
