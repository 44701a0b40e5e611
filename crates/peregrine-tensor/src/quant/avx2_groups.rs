//! Where the group kernels ([`super::avx2_interleaved`]) find a group of 8 rows' blocks:
//! [`Packed`], the interleaved layout ([`super::interleaved`]); or [`RowGroup`], 8 consecutive
//! rows as GGUF lays them out (a mapped file's bytes, used where they lie), transposed into the
//! same vectors as they load. The kernels do the same arithmetic on the same vectors from
//! either, so their outputs are the same bits.

use std::arch::x86_64::*;

use super::avx2::Isa;
use super::format::Format;
use super::interleaved::{ROWS, group_block_bytes};

/// A group of 8 rows' blocks, as the kernels take them. 4/5-bit formats come in units: the
/// scales (and minimums, fifth bits) then `SHARED` blocks of codes that use them.
pub(super) trait Source: Copy {
    /// Units in the group.
    fn units<const MIN: bool, const FIFTH: bool, const SHARED: usize>(self) -> usize;

    /// Unit `u`'s 8 scales, and what multiplies each input's sum: the minimums, or the scales.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; the caller is compiled with them; `u` is a unit.
    unsafe fn heads<const MIN: bool, const FIFTH: bool, const SHARED: usize>(
        self,
        u: usize,
    ) -> (__m256, __m256);

    /// Block `s` of unit `u`: 8 code vectors, vector `k` values `4k..4k + 4` of every row.
    ///
    /// # Safety
    /// The CPU must support `I`'s features; the caller is compiled with them; `u` is a unit.
    unsafe fn codes<I: Isa, const MIN: bool, const FIFTH: bool, const SHARED: usize>(
        self,
        u: usize,
        s: usize,
    ) -> [__m256i; 8];

    /// Q8_0 blocks in the group.
    fn q8_0_blocks(self) -> usize;

    /// What a Q4_K super-block's sub-block scales and minimums come from.
    type K4: Copy;

    /// Q4_K super-blocks in the group.
    fn q4k_blocks(self) -> usize;

    /// Q4_K super-block `b`: the rows' scales and minimum scales, and what
    /// [`q4k_sub`](Self::q4k_sub) takes.
    ///
    /// # Safety
    /// As [`heads`](Self::heads); `b` is a super-block of the group.
    unsafe fn q4k(self, b: usize) -> (__m256, __m256, Self::K4);

    /// Sub-block `j`'s 6-bit scales and minimums of the 8 rows, as floats.
    ///
    /// # Safety
    /// As [`heads`](Self::heads).
    unsafe fn q4k_sub(self, k: Self::K4, j: usize) -> (__m256, __m256);

    /// Q4_K super-block `b`'s codes of sub-blocks `2p` (low nibbles) and `2p + 1` (high), as
    /// 8 vectors of packed bytes: vector `c` holds bytes `4c..4c + 4` of each row's 32.
    ///
    /// # Safety
    /// As [`heads`](Self::heads).
    unsafe fn q4k_codes(self, b: usize, p: usize) -> [__m256i; 8];

    /// What a Q6_K super-block's i8 scales come from.
    type K6: Copy;

    /// What a half (4 sub-blocks) of a Q6_K super-block's codes come from.
    type K6Half: Copy;

    /// Q6_K super-blocks in the group.
    fn q6k_blocks(self) -> usize;

    /// Q6_K super-block `b`: the rows' scales, and what [`q6k_scale`](Self::q6k_scale) takes.
    ///
    /// # Safety
    /// As [`heads`](Self::heads); `b` is a super-block of the group.
    unsafe fn q6k(self, b: usize) -> (__m256, Self::K6);

    /// The i8 scale of 16-value group `g` (0..16) of the 8 rows, one row a lane.
    ///
    /// # Safety
    /// As [`heads`](Self::heads).
    unsafe fn q6k_scale(self, k: Self::K6, g: usize) -> __m256i;

    /// What half `n` of Q6_K super-block `b` takes its codes from.
    ///
    /// # Safety
    /// As [`heads`](Self::heads); `b` is a super-block of the group, `n < 2`.
    unsafe fn q6k_half(self, b: usize, n: usize) -> Self::K6Half;

    /// What a half's low nibbles of sub-block pair `pair` (`ql`) come from.
    type K6Low: Copy;

    /// A half's `ql` of sub-block pair `pair` (`< 2`), for [`q6k_bits`](Self::q6k_bits).
    ///
    /// # Safety
    /// As [`heads`](Self::heads).
    unsafe fn q6k_low(self, h: &Self::K6Half, pair: usize) -> Self::K6Low;

    /// Vector `c` of a half's low nibbles of one sub-block pair (`ql`) and of its high bit
    /// pairs (`qh`): bytes `4c..4c + 4` of each row's 32.
    ///
    /// # Safety
    /// As [`heads`](Self::heads); `c < 8`.
    unsafe fn q6k_bits(self, h: &Self::K6Half, low: &Self::K6Low, c: usize) -> (__m256i, __m256i);

    /// A hint, before unit (Q8_0 block, K-quant super-block) `u`, to start loading what the next
    /// group needs.
    #[inline(always)]
    fn prefetch(self, _u: usize) {}

    /// Q8_0 block `b`: the rows' scales and their 8 code vectors as they stand (signed).
    ///
    /// # Safety
    /// As [`heads`](Self::heads); `b` is a block of the group.
    unsafe fn q8_0(self, b: usize) -> (__m256, [__m256i; 8]);
}

/// Where a unit's fields sit in the interleaved layout: `(masks, codes, unit bytes)`.
const fn packed_fields(min: bool, fifth: bool, shared: usize) -> (usize, usize, usize) {
    let masks_at = if min { 32 } else { 16 };
    let head = masks_at + if fifth { 32 } else { 0 };
    (masks_at, head, head + 128 * shared)
}

/// One group of an [`Interleaved`](super::interleaved::Interleaved) matrix.
#[derive(Clone, Copy)]
pub(super) struct Packed {
    p: *const u8,
    len: usize,
}

impl Packed {
    /// The group whose bytes are `w`.
    pub(super) fn new(w: &[u8]) -> Self {
        Self {
            p: w.as_ptr(),
            len: w.len(),
        }
    }
}

impl Source for Packed {
    type K4 = *const u8;

    #[inline(always)]
    fn q4k_blocks(self) -> usize {
        self.len / group_block_bytes(Format::Q4K)
    }

    #[inline(always)]
    unsafe fn q4k(self, b: usize) -> (__m256, __m256, *const u8) {
        use super::interleaved::q4k::DMIN;
        // SAFETY: per the trait's contract; a group block starts with the rows' d and dmin.
        unsafe {
            let p = self.p.add(b * group_block_bytes(Format::Q4K));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(DMIN).cast()));
            (d, dmin, p)
        }
    }

    #[inline(always)]
    unsafe fn q4k_sub(self, p: *const u8, j: usize) -> (__m256, __m256) {
        use super::interleaved::q4k::{MINS, SCALES};
        // SAFETY: per the trait's contract; the group block holds 8 bytes per sub-block.
        unsafe {
            let widen =
                |p: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())));
            (widen(p.add(SCALES + 8 * j)), widen(p.add(MINS + 8 * j)))
        }
    }

    #[inline(always)]
    unsafe fn q4k_codes(self, b: usize, p: usize) -> [__m256i; 8] {
        use super::interleaved::q4k::CODES;
        // SAFETY: per the trait's contract; a group block holds 4 pairs of 256 code bytes.
        unsafe {
            let at = self
                .p
                .add(b * group_block_bytes(Format::Q4K) + CODES + 256 * p);
            let mut codes = [_mm256_setzero_si256(); 8];
            for (c, code) in codes.iter_mut().enumerate() {
                *code = _mm256_loadu_si256(at.add(32 * c).cast());
            }
            codes
        }
    }

    type K6 = *const u8;
    type K6Half = (*const u8, usize);
    type K6Low = *const u8;

    #[inline(always)]
    fn q6k_blocks(self) -> usize {
        self.len / group_block_bytes(Format::Q6K)
    }

    #[inline(always)]
    unsafe fn q6k(self, b: usize) -> (__m256, *const u8) {
        // SAFETY: per the trait's contract; a group block starts with the rows' d.
        unsafe {
            let p = self.p.add(b * group_block_bytes(Format::Q6K));
            (_mm256_cvtph_ps(_mm_loadu_si128(p.cast())), p)
        }
    }

    #[inline(always)]
    unsafe fn q6k_scale(self, p: *const u8, g: usize) -> __m256i {
        use super::interleaved::q6k::SCALES;
        // SAFETY: per the trait's contract; the group block holds 8 bytes per scale group.
        unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(SCALES + 8 * g).cast())) }
    }

    #[inline(always)]
    unsafe fn q6k_half(self, b: usize, n: usize) -> (*const u8, usize) {
        // SAFETY: per the trait's contract.
        (unsafe { self.p.add(b * group_block_bytes(Format::Q6K)) }, n)
    }

    #[inline(always)]
    unsafe fn q6k_low(self, &(p, n): &(*const u8, usize), pair: usize) -> *const u8 {
        use super::interleaved::q6k::QL;
        // SAFETY: per the trait's contract; the group block holds 4 pairs of `ql`.
        unsafe { p.add(QL + 256 * (2 * n + pair)) }
    }

    #[inline(always)]
    unsafe fn q6k_bits(
        self,
        &(p, n): &(*const u8, usize),
        &low: &*const u8,
        c: usize,
    ) -> (__m256i, __m256i) {
        use super::interleaved::q6k::QH;
        // SAFETY: per the trait's contract; `ql` and each half's `qh` are 8 vectors each.
        unsafe {
            (
                _mm256_loadu_si256(low.add(32 * c).cast()),
                _mm256_loadu_si256(p.add(QH + 256 * n + 32 * c).cast()),
            )
        }
    }

    #[inline(always)]
    fn units<const MIN: bool, const FIFTH: bool, const SHARED: usize>(self) -> usize {
        self.len / packed_fields(MIN, FIFTH, SHARED).2
    }

    #[inline(always)]
    unsafe fn heads<const MIN: bool, const FIFTH: bool, const SHARED: usize>(
        self,
        u: usize,
    ) -> (__m256, __m256) {
        let unit = packed_fields(MIN, FIFTH, SHARED).2;
        // SAFETY: per the trait's contract; a unit starts with its scales and minimums.
        unsafe {
            let p = self.p.add(u * unit);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
            let mw = match MIN {
                true => _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
                false => dw,
            };
            (dw, mw)
        }
    }

    #[inline(always)]
    unsafe fn codes<I: Isa, const MIN: bool, const FIFTH: bool, const SHARED: usize>(
        self,
        u: usize,
        s: usize,
    ) -> [__m256i; 8] {
        let (masks_at, head, unit) = packed_fields(MIN, FIFTH, SHARED);
        // SAFETY: per the trait's contract; the unit holds the codes and masks.
        unsafe {
            let p = self.p.add(u * unit);
            let mut packed = [_mm256_setzero_si256(); 4];
            for (c, v) in packed.iter_mut().enumerate() {
                *v = _mm256_loadu_si256(p.add(head + 128 * s + 32 * c).cast());
            }
            let mut codes = nibbles(packed);
            if FIFTH {
                for (k, code) in codes.iter_mut().enumerate() {
                    let bits = p.add(masks_at + 4 * k).cast::<u32>().read_unaligned();
                    *code = _mm256_or_si256(*code, I::sixteens(bits));
                }
            }
            codes
        }
    }

    #[inline(always)]
    fn q8_0_blocks(self) -> usize {
        self.len / group_block_bytes(Format::Q8_0)
    }

    #[inline(always)]
    unsafe fn q8_0(self, b: usize) -> (__m256, [__m256i; 8]) {
        // SAFETY: per the trait's contract; a block holds 16 bytes of scales, 256 of codes.
        unsafe {
            let p = self.p.add(b * group_block_bytes(Format::Q8_0));
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
            let mut codes = [_mm256_setzero_si256(); 8];
            for (k, code) in codes.iter_mut().enumerate() {
                *code = _mm256_loadu_si256(p.add(16 + 32 * k).cast());
            }
            (dw, codes)
        }
    }
}

/// The 8 vectors of 4-bit codes in 4 vectors of packed bytes: the low nibbles (values
/// `4c..4c + 4` of each row), then the high ones (`16 + 4c..`).
///
/// # Safety
/// The CPU must support AVX2; the caller is compiled with it.
#[inline(always)]
unsafe fn nibbles(packed: [__m256i; 4]) -> [__m256i; 8] {
    // SAFETY: per this function's contract.
    unsafe {
        let mask = _mm256_set1_epi8(0xF);
        // A loop, not `array::from_fn`: a closure's body may stay out of line, outside the
        // `target_feature` function.
        let mut codes = [_mm256_setzero_si256(); 8];
        for (k, code) in codes.iter_mut().enumerate() {
            let q = packed[k % 4];
            let q = if k < 4 { q } else { _mm256_srli_epi16(q, 4) };
            *code = _mm256_and_si256(q, mask);
        }
        codes
    }
}

/// 8 consecutive rows in GGUF's row layout of a format whose blocks are `BB` bytes (Q4_0:
/// 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q6_K: 210; [`fits`]), known when compiled so that the addressing is
/// immediates, not multiplications.
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
        // SAFETY: per the trait's contract: d, dmin, then 12 bytes of scales and minimums.
        unsafe {
            let words = |at: usize| {
                let p = self.p.add(b * BB + at);
                let w = |l: usize| p.add(l * self.row_bytes).cast::<i32>().read_unaligned();
                _mm256_setr_epi32(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7))
            };
            let k = [words(4), words(8), words(12)];
            (self.halves(b, 0), self.halves(b, 2), k)
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
