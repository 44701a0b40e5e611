//! [`RowGroup`]: a group of 8 consecutive rows as GGUF lays them out (a mapped file's bytes,
//! multiplied where they lie), transposed into the interleaved kernels' vectors as they load
//! ([`Source`]).

use std::arch::x86_64::*;

use super::avx2::Isa;
use super::avx2_groups::{Source, nibbles};
use super::format::Format;
use super::interleaved::ROWS;

/// 8 consecutive rows in GGUF's row layout of a format whose blocks are `BB` bytes (Q4_0:
/// 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q6_K: 210; [`fits`]), known when compiled so that the
/// addressing is immediates, not multiplications.
#[derive(Clone, Copy)]
pub(super) struct RowGroup<const BB: usize> {
    /// The first row's first block.
    p: *const u8,
    row_bytes: usize,
}

/// Whether groups of `format` rows multiply from the row layout ([`RowGroup`]).
pub(super) fn fits(format: Format) -> bool {
    matches!(
        format,
        Format::Q4_0 | Format::Q4_1 | Format::Q8_0 | Format::Q4K | Format::Q6K
    )
}

/// Bytes of a Q4_K super-block.
pub(super) const Q4K_BYTES: usize = 144;

/// Bytes of a Q6_K super-block.
pub(super) const Q6K_BYTES: usize = 210;

/// Block bytes of a format [`RowGroup`] takes.
pub(super) const fn block_bytes(min: bool) -> usize {
    if min { 20 } else { 18 }
}

/// Bytes of a Q8_0 block.
pub(super) const Q8_0_BYTES: usize = 34;

impl<const BB: usize> RowGroup<BB> {
    /// Where a block's codes start: after the scale (and Q4_1's minimum).
    const CODES_AT: usize = if BB == Q8_0_BYTES { 2 } else { BB - 16 };

    /// Group `g` (rows `8g..8g + 8`) of the rows in `w`, `row_bytes` each.
    #[inline(always)]
    pub(super) fn new(w: &[u8], g: usize, row_bytes: usize) -> Self {
        let w = &w[g * ROWS * row_bytes..][..ROWS * row_bytes];
        Self {
            p: w.as_ptr(),
            row_bytes,
        }
    }

    /// The f16 at byte `at` of each row's block `b`, as 8 floats (row `l` in lane `l`). Packed
    /// in general-purpose registers, two u64 of 4 halves each: the vector shuffle ports are
    /// the row kernels' bottleneck, the integer ones are idle.
    ///
    /// # Safety
    /// As [`Source::heads`]; each row's block holds 2 bytes at `at`.
    #[inline(always)]
    unsafe fn halves(self, b: usize, at: usize) -> __m256 {
        // SAFETY: per this function's contract.
        unsafe {
            let p = self.p.add(b * BB + at);
            let half =
                |l: usize| u64::from(p.add(l * self.row_bytes).cast::<u16>().read_unaligned());
            let four =
                |l: usize| half(l) | half(l + 1) << 16 | half(l + 2) << 32 | half(l + 3) << 48;
            let packed = _mm_set_epi64x(four(4) as i64, four(0) as i64);
            _mm256_cvtph_ps(packed)
        }
    }

    /// 16 bytes at `at` of each row's block `b`, as 4 vectors of 8 lanes: vector `c` holds
    /// bytes `4c..4c + 4` of row `l` in lane `l` (the interleaved layout's order).
    ///
    /// # Safety
    /// As [`Source::codes`]; each row's block holds the 16 bytes.
    #[inline(always)]
    unsafe fn transposed(self, b: usize, at: usize) -> [__m256i; 4] {
        // SAFETY: per this function's contract.
        unsafe {
            let p = self.p.add(b * BB + at);
            let load = |l: usize| _mm_loadu_si128(p.add(l * self.row_bytes).cast());
            // Rows l and l + 4 side by side: the 4×4 transposes below run in both halves.
            let mut v = [_mm256_setzero_si256(); 4];
            for (l, v) in v.iter_mut().enumerate() {
                *v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(load(l)), load(l + 4));
            }
            let t0 = _mm256_unpacklo_epi32(v[0], v[1]);
            let t1 = _mm256_unpacklo_epi32(v[2], v[3]);
            let t2 = _mm256_unpackhi_epi32(v[0], v[1]);
            let t3 = _mm256_unpackhi_epi32(v[2], v[3]);
            [
                _mm256_unpacklo_epi64(t0, t1),
                _mm256_unpackhi_epi64(t0, t1),
                _mm256_unpacklo_epi64(t2, t3),
                _mm256_unpackhi_epi64(t2, t3),
            ]
        }
    }
}

impl<const BB: usize> RowGroup<BB> {
    /// 32 bytes at `at` of each row's block `b`, as 8 vectors ([`transposed`](Self::transposed)
    /// twice).
    ///
    /// # Safety
    /// As [`transposed`](Self::transposed), for 32 bytes.
    #[inline(always)]
    unsafe fn eight(self, b: usize, at: usize) -> [__m256i; 8] {
        // SAFETY: per this function's contract.
        unsafe {
            let (lo, hi) = (self.transposed(b, at), self.transposed(b, at + 16));
            [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
        }
    }
}

impl<const BB: usize> Source for RowGroup<BB> {
    /// The rows' 12 packed bytes of 6-bit scales and minimums, as three vectors of 4 bytes a
    /// row: each sub-block's come out of them with shifts, already one row a lane.
    type K4 = [__m256i; 3];

    #[inline(always)]
    fn q4k_blocks(self) -> usize {
        self.row_bytes / BB
    }

    #[inline(always)]
    unsafe fn q4k(self, b: usize) -> (__m256, __m256, [__m256i; 3]) {
        // SAFETY: per the trait's contract: d, dmin, then 12 bytes of scales and minimums, the
        // block's first 16 bytes, transposed at once (fewer shuffles than 24 inserted words).
        unsafe {
            let [heads, k0, k1, k2] = self.transposed(b, 0);
            // Each lane's d (low half) and dmin (high half): the rows' d in bytes 0..8 of each
            // 128-bit lane, their dmin in 8..16, then d of all 8 rows low, dmin high.
            let split = _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
            );
            let halves =
                _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(heads, split));
            let d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
            let dmin = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(halves));
            (d, dmin, [k0, k1, k2])
        }
    }

    #[inline(always)]
    unsafe fn q4k_sub(self, [q0, q1, q2]: [__m256i; 3], j: usize) -> (__m256, __m256) {
        // ggml's `get_scale_min_k4`, 8 rows at a time: sub-blocks 0-3 take 6 bits of bytes
        // 0-3 (scales) and 4-7 (minimums); 4-7 take 4 bits of bytes 8-11 and their top 2 from
        // the first two rows of bytes.
        // SAFETY: per the trait's contract.
        unsafe {
            let at = |v: __m256i, bits: usize| _mm256_srl_epi32(v, _mm_cvtsi64_si128(bits as i64));
            let low = |v: __m256i, mask: i32| _mm256_and_si256(v, _mm256_set1_epi32(mask));
            let (scale, min) = if j < 4 {
                (low(at(q0, 8 * j), 63), low(at(q1, 8 * j), 63))
            } else {
                let k = 8 * (j - 4);
                let top = |v: __m256i| _mm256_slli_epi32(low(at(v, k + 6), 3), 4);
                (
                    _mm256_or_si256(low(at(q2, k), 0xF), top(q0)),
                    _mm256_or_si256(low(at(q2, k + 4), 0xF), top(q1)),
                )
            };
            (_mm256_cvtepi32_ps(scale), _mm256_cvtepi32_ps(min))
        }
    }

    #[inline(always)]
    unsafe fn q4k_codes(self, b: usize, p: usize) -> [__m256i; 8] {
        // SAFETY: per the trait's contract; a Q4_K block's codes are bytes 16..144.
        unsafe { self.eight(b, 16 + 32 * p) }
    }

    /// The rows' 16 scale bytes, transposed: vector `c` holds bytes `4c..4c + 4` of a row a lane.
    type K6 = [__m256i; 4];
    /// A half's `qh`, transposed once for its 4 sub-blocks, and where its block is.
    type K6Half = ([__m256i; 8], usize, usize);
    /// A sub-block pair's `ql`, transposed (each sub-block transposes its own: holding both
    /// pairs for a half spilled registers).
    type K6Low = [__m256i; 8];

    #[inline(always)]
    fn q6k_blocks(self) -> usize {
        self.row_bytes / BB
    }

    #[inline(always)]
    unsafe fn q6k(self, b: usize) -> (__m256, [__m256i; 4]) {
        // SAFETY: per the trait's contract: a Q6_K block's scales are bytes 192..208, d 208.
        unsafe { (self.halves(b, 208), self.transposed(b, 192)) }
    }

    #[inline(always)]
    unsafe fn q6k_scale(self, k: [__m256i; 4], g: usize) -> __m256i {
        // Byte `g % 4` of each lane, sign-extended: to the top, then back down.
        // SAFETY: per the trait's contract.
        unsafe {
            let top = _mm256_sll_epi32(k[g / 4], _mm_cvtsi64_si128(24 - 8 * (g % 4) as i64));
            _mm256_srai_epi32::<24>(top)
        }
    }

    #[inline(always)]
    unsafe fn q6k_half(self, b: usize, n: usize) -> ([__m256i; 8], usize, usize) {
        // SAFETY: per the trait's contract: `qh` is bytes 128..192.
        unsafe { (self.eight(b, 128 + 32 * n), b, n) }
    }

    #[inline(always)]
    unsafe fn q6k_low(
        self,
        &(_, b, n): &([__m256i; 8], usize, usize),
        pair: usize,
    ) -> [__m256i; 8] {
        // SAFETY: per the trait's contract: `ql` is bytes 0..128.
        unsafe { self.eight(b, 64 * n + 32 * pair) }
    }

    #[inline(always)]
    unsafe fn q6k_bits(
        self,
        (qh, _, _): &([__m256i; 8], usize, usize),
        low: &[__m256i; 8],
        c: usize,
    ) -> (__m256i, __m256i) {
        (low[c], qh[c])
    }

    /// The next group's bytes, an equal share before each unit: a row of a few hundred bytes
    /// is too short a stream for the hardware's prefetchers to pick up, and 8 run at once.
    #[inline(always)]
    fn prefetch(self, u: usize) {
        let span = ROWS * BB;
        let next = self.p.wrapping_add(ROWS * self.row_bytes + u * span);
        // A count known when compiled: unrolled.
        for line in 0..span.div_ceil(64) {
            // SAFETY: a prefetch never faults, wherever it points.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line * 64).cast()) };
        }
    }

    #[inline(always)]
    fn units<const MIN: bool, const FIFTH: bool, const SHARED: usize>(self) -> usize {
        self.row_bytes / BB
    }

    #[inline(always)]
    unsafe fn heads<const MIN: bool, const FIFTH: bool, const SHARED: usize>(
        self,
        u: usize,
    ) -> (__m256, __m256) {
        // SAFETY: per the trait's contract: a block starts with its scale (and minimum).
        unsafe {
            let dw = self.halves(u, 0);
            let mw = match MIN {
                true => self.halves(u, 2),
                false => dw,
            };
            (dw, mw)
        }
    }

    #[inline(always)]
    unsafe fn codes<I: Isa, const MIN: bool, const FIFTH: bool, const SHARED: usize>(
        self,
        u: usize,
        _s: usize,
    ) -> [__m256i; 8] {
        debug_assert!(
            !FIFTH && SHARED == 1,
            "only Q4_0 and Q4_1 come as row groups"
        );
        // SAFETY: per the trait's contract.
        unsafe { nibbles(self.transposed(u, Self::CODES_AT)) }
    }

    #[inline(always)]
    fn q8_0_blocks(self) -> usize {
        self.row_bytes / BB
    }

    #[inline(always)]
    unsafe fn q8_0(self, b: usize) -> (__m256, [__m256i; 8]) {
        // SAFETY: per the trait's contract; a Q8_0 block is a scale and 32 code bytes.
        unsafe { (self.halves(b, 0), self.eight(b, 2)) }
    }
}
