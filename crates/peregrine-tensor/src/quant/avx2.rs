//! AVX2/FMA/F16C dot products of GGUF weight rows with Q8 activations. Each 32-value
//! (sub-)block's codes are unpacked once to 32 unsigned bytes ([`Sub`]) and multiplied with
//! `maddubs` (u8 × i8 → i16 pairs → i32) against up to four input rows, one float FMA per block
//! and row; offsets and minimums use the activation sums, one scalar multiply per block. Same
//! arithmetic as [`super::scalar`], up to float summation order. Formats are const-generic ids
//! so each (format, rows) pair compiles to its own straight-line loop.

use std::arch::x86_64::*;

use super::act::{Q8Block, QK};
use super::format::{Format, k_scale_min};

/// Whether this CPU can run these kernels.
pub fn available() -> bool {
    crate::cpu::Kernel::Avx2.runs_here()
}

/// `Σ w·x[r]` for one weight row and `R` input rows (each block unpacked once for all `R`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows<const R: usize>(format: Format, w: &[u8], x: [&[Q8Block]; R]) -> [f32; R] {
    // SAFETY: this function's features are `Avx2`'s.
    unsafe { with_format!(format, F => rows::<Avx2, F, R>(w, x)) }
}

/// [`dot_rows`] with VNNI's `vpdpbusd` for the products.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_rows_vnni<const R: usize>(
    format: Format,
    w: &[u8],
    x: [&[Q8Block]; R],
) -> [f32; R] {
    // SAFETY: this function's features are `Vnni`'s.
    unsafe { with_format!(format, F => rows::<Vnni, F, R>(w, x)) }
}

/// Runs `$body` with the const `$f` set to `$format`'s id, so each format compiles to its own
/// straight-line loop.
macro_rules! with_format {
    ($format:expr, $f:ident => $body:expr) => {
        with_format!(@ids $format, $f, $body, Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4K Q5K Q6K MLX8 MLX8G64)
    };
    (@ids $format:expr, $f:ident, $body:expr, $($id:ident)*) => {
        match $format {
            $(Format::$id => {
                const $f: u8 = $crate::quant::avx2::$id;
                $body
            })*
        }
    };
}
pub(super) use with_format;

/// The instruction set a kernel is compiled for: how it multiplies unsigned by signed bytes.
pub(super) trait Isa {
    /// Whether [`Isa::dot4`] takes unsigned bytes up to 255 (else up to 128: `maddubs`
    /// saturates its i16 pair sums above that).
    const WIDE: bool;
    /// `acc + Σ a·b` over each 4 bytes (u8 × i8 → i32 lanes).
    ///
    /// # Safety
    /// The CPU must support this instruction set.
    unsafe fn dot4(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
    /// Byte `i` is 16 where bit `i` of `bits` is set, else 0 (Q5's fifth bits).
    ///
    /// # Safety
    /// As [`Isa::dot4`].
    unsafe fn sixteens(bits: u32) -> __m256i;
}

/// AVX2: `maddubs` then `madd` with ones.
pub(super) struct Avx2;
/// AVX-512 VNNI on 256-bit registers: one `vpdpbusd`.
pub(super) struct Vnni;

impl Isa for Avx2 {
    const WIDE: bool = false;
    #[inline(always)]
    unsafe fn dot4(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe {
            let pairs = _mm256_maddubs_epi16(a, b);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn sixteens(bits: u32) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { fifth_bits(bits) }
    }
}

impl Isa for Vnni {
    const WIDE: bool = true;
    #[inline(always)]
    unsafe fn dot4(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { _mm256_dpbusd_epi32(acc, a, b) }
    }
    #[inline(always)]
    unsafe fn sixteens(bits: u32) -> __m256i {
        // SAFETY: per the trait's contract (AVX-512 BW/VL: a byte mask from a register).
        unsafe { _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(16)) }
    }
}

pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q5_0: u8 = 2;
pub(super) const Q5_1: u8 = 3;
pub(super) const Q8_0: u8 = 4;
pub(super) const Q4K: u8 = 5;
pub(super) const Q5K: u8 = 6;
pub(super) const Q6K: u8 = 7;
pub(super) const MLX8: u8 = 8;
pub(super) const MLX8G64: u8 = 9;

/// MLX8 or MLX8G64: unsigned 8-bit codes with a scale and bias.
pub(super) const fn is_mlx8(f: u8) -> bool {
    f == MLX8 || f == MLX8G64
}

/// One 32-value (sub-)block of weights, unpacked.
pub(super) struct Sub {
    /// Unsigned codes (Q8_0: the signed values).
    pub codes: __m256i,
    /// Multiplies `x.d · Σ codes·x` (for Q6_K, the per-16 scales are in `lane_scales`).
    pub scale: f32,
    /// Q4_1/Q5_1/MLX8: the minimum, times `x.ds`. Q4_0/Q5_0/K-quants: times `x.dsum`.
    pub min: f32,
    /// Q6_K: i16 scale of each product pair (8 lanes per 16 values).
    pub lane_scales: __m256i,
    /// Q6_K: `scale` times each 16 values' own scale.
    pub scales16: [f32; 2],
    /// Q6_K: `-32 · scales16`, times `x.dsum16`.
    pub offsets16: [f32; 2],
}

/// Bytes and sub-blocks of format `F`.
pub(super) const fn shape(f: u8) -> (usize, usize) {
    match f {
        Q4_0 => (18, 1),
        Q4_1 => (20, 1),
        Q5_0 => (22, 1),
        Q5_1 => (24, 1),
        Q8_0 => (34, 1),
        Q4K => (144, 8),
        Q5K => (176, 8),
        MLX8 => (36, 1),
        MLX8G64 => (68, 2),
        _ => (210, 8),
    }
}

/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
pub(super) unsafe fn sub<I: Isa, const F: u8>(b: &[u8], j: usize) -> Sub {
    // SAFETY: per this function's contract.
    unsafe {
        let mut s = Sub {
            codes: _mm256_setzero_si256(),
            scale: f16(b, 0),
            min: 0.0,
            lane_scales: _mm256_set1_epi16(1),
            scales16: [0.0; 2],
            offsets16: [0.0; 2],
        };
        match F {
            Q4_0 => (s.codes, s.min) = (nibbles(&b[2..18]), -8.0 * s.scale),
            Q4_1 => (s.codes, s.min) = (nibbles(&b[4..20]), f16(b, 2)),
            Q5_0 => {
                s.codes = _mm256_or_si256(nibbles(&b[6..22]), I::sixteens(u32_at(b, 2)));
                s.min = -16.0 * s.scale;
            }
            Q5_1 => {
                s.codes = _mm256_or_si256(nibbles(&b[8..24]), I::sixteens(u32_at(b, 4)));
                s.min = f16(b, 2);
            }
            Q8_0 => s.codes = load32(&b[2..34]),
            MLX8 | MLX8G64 => (s.codes, s.min) = (load32(&b[4 + 32 * j..]), f16(b, 2)),
            Q4K | Q5K => {
                let (qs_at, mask) = (if F == Q5K { 48 } else { 16 }, _mm256_set1_epi8(0xF));
                let q = load32(&b[qs_at + 32 * (j / 2)..]);
                let q = if j.is_multiple_of(2) {
                    q
                } else {
                    _mm256_srli_epi16(q, 4)
                };
                s.codes = _mm256_and_si256(q, mask);
                if F == Q5K {
                    let bit = _mm256_srl_epi16(load32(&b[16..48]), _mm_cvtsi32_si128(j as i32));
                    let bit = _mm256_and_si256(bit, _mm256_set1_epi8(1));
                    s.codes = _mm256_or_si256(s.codes, _mm256_slli_epi16(bit, 4));
                }
                let (sc, m) = k_scale_min(&b[4..16], j);
                (s.scale, s.min) = (s.scale * f32::from(sc), -f16(b, 2) * f32::from(m));
            }
            _ => {
                // Q6_K sub-block j = 4n + t: low (t < 2) or high nibbles of ql[64n + 32(t % 2)..],
                // bits 2t, 2t + 1 of qh[32n..]; scales 8n + 2t and 8n + 2t + 1.
                let (n, t) = (j / 4, j % 4);
                let ql = load32(&b[64 * n + 32 * (t % 2)..]);
                let low = if t < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
                let low = _mm256_and_si256(low, _mm256_set1_epi8(0xF));
                let hi =
                    _mm256_srl_epi16(load32(&b[128 + 32 * n..]), _mm_cvtsi32_si128(2 * t as i32));
                let hi = _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4);
                s.codes = _mm256_or_si256(low, hi);
                let sc = [
                    b[192 + 8 * n + 2 * t] as i8,
                    b[192 + 8 * n + 2 * t + 1] as i8,
                ];
                s.scale = f16(b, 208);
                s.lane_scales = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(sc[1])),
                    _mm_set1_epi16(i16::from(sc[0])),
                );
                s.scales16 = sc.map(|c| s.scale * f32::from(c));
                s.offsets16 = s.scales16.map(|c| -32.0 * c);
            }
        }
        s
    }
}

/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn rows<I: Isa, const F: u8, const R: usize>(w: &[u8], x: [&[Q8Block]; R]) -> [f32; R] {
    let (bytes, subs) = shape(F);
    // SAFETY: per this function's contract.
    unsafe {
        // Block i accumulates in chain i % 4: one chain would wait on the FMA's latency. K-quant
        // super-blocks hold 8 sub-blocks each, and one chain measured faster for them; MLX8G64's
        // two take four (Qwen2.5-0.5B-shape decode 47-49 -> 52-56 tok/s).
        let mut acc = [[_mm256_setzero_ps(); R]; CHAINS];
        let mut off = [[0f32; R]; CHAINS];
        let chains = if subs > 2 { 1 } else { CHAINS };
        let mut blocks = w.chunks_exact(bytes).enumerate();
        'blocks: loop {
            for c in 0..chains {
                let Some((i, b)) = blocks.next() else {
                    break 'blocks;
                };
                block::<I, F, R>(i, b, &x, &mut acc[c], &mut off[c]);
            }
        }
        std::array::from_fn(|r| {
            let sum = (acc.iter()).fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, a[r]));
            hsum(sum) + off.iter().map(|o| o[r]).sum::<f32>()
        })
    }
}

/// Independent accumulator chains of the row kernel.
const CHAINS: usize = 4;

/// Block `i` (bytes `b`) of one weight row against `R` input rows, into `acc` and `off`.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn block<I: Isa, const F: u8, const R: usize>(
    i: usize,
    b: &[u8],
    x: &[&[Q8Block]; R],
    acc: &mut [__m256; R],
    off: &mut [f32; R],
) {
    let (_, subs) = shape(F);
    // SAFETY: per this function's contract.
    unsafe {
        for j in 0..subs {
            let s = sub::<I, F>(b, j);
            let raw = match F {
                // `maddubs` saturates on codes past 128: MLX8 takes `q - 128`, plus 128·Σx.
                f if is_mlx8(f) && !I::WIDE => _mm256_xor_si256(s.codes, _mm256_set1_epi8(-128)),
                _ => s.codes,
            };
            // Signed codes: |w| · (x · sign w), as the products need unsigned weights.
            let signed = F == Q8_0 || (is_mlx8(F) && !I::WIDE);
            let codes = if signed {
                _mm256_sign_epi8(raw, raw)
            } else {
                raw
            };
            for r in 0..R {
                let xb = &x[r][i * subs + j];
                let xv = xq(xb);
                let xv = if signed {
                    _mm256_sign_epi8(xv, raw)
                } else {
                    xv
                };
                let p = if F == Q6K {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), s.lane_scales)
                } else {
                    I::dot4(_mm256_setzero_si256(), codes, xv)
                };
                acc[r] = fma(acc[r], p, s.scale * xb.d);
                off[r] += match F {
                    f if is_mlx8(f) && !I::WIDE => s.min * xb.ds + 128.0 * s.scale * xb.dsum,
                    Q4_1 | Q5_1 | MLX8 | MLX8G64 => s.min * xb.ds,
                    Q8_0 => 0.0,
                    Q6K => s.offsets16[0] * xb.dsum16[0] + s.offsets16[1] * xb.dsum16[1],
                    _ => s.min * xb.dsum,
                };
            }
        }
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
pub(super) fn load32(p: &[u8]) -> __m256i {
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

/// `acc + products · scale`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fma(acc: __m256, products: __m256i, scale: f32) -> __m256 {
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(scale), acc)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(acc: __m256) -> f32 {
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

/// Byte `i` is 16 where bit `i` of `bits` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(bits: u32) -> __m256i {
    let bits = bits as i32;
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

/// 32 inputs → (codes, largest magnitude, code sums per half), bit-identical to
/// [`super::act::quantize_block`]: same division, same multiply, ties-to-even rounding.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]); `x` holds at least 32 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_block(x: &[f32]) -> ([i8; QK], f32, [i32; 2]) {
    let x = &x[..QK];
    // SAFETY: 32 readable floats; unaligned loads.
    let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
    let sign = _mm256_set1_ps(-0.0);
    let m = v.iter().fold(_mm256_setzero_ps(), |m, &v| {
        _mm256_max_ps(m, _mm256_andnot_ps(sign, v))
    });
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let q = v.map(|v| _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(v, id))));
    let hsum = |a: __m256i, b: __m256i| {
        let s = _mm256_add_epi32(a, b);
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)))
    };
    let sums = [hsum(q[0], q[1]), hsum(q[2], q[3])];
    // Packing works within 128-bit lanes; the permute restores element order.
    let packed = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    let packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut qs = [0i8; QK];
    // SAFETY: `qs` is 32 bytes; unaligned store.
    unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), packed) };
    (qs, amax, sums)
}

/// The little-endian `u32` at `b[at..]`.
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
