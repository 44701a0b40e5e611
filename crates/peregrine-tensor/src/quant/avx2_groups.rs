//! Where the group kernels ([`super::avx2_interleaved`]) find a group of 8 rows' blocks
//! ([`Source`]): [`Packed`], the interleaved layout ([`super::interleaved`]); or
//! [`RowGroup`](super::avx2_row_group::RowGroup), 8 consecutive rows as GGUF lays them out (a
//! mapped file's bytes, used where they lie), transposed into the same vectors as they load.
//! The kernels do the same arithmetic on the same vectors from either, so their outputs are
//! the same bits.

use std::arch::x86_64::*;

use super::avx2::Isa;
use super::format::Format;
use super::interleaved::group_block_bytes;

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

    /// A hint, before unit `u` of a 32-value format's group, to start loading the same unit
    /// of the next group, for kernels with enough inputs per unit to cover the wait (the
    /// interleaved layout; rows prefetch in [`prefetch`](Self::prefetch) always).
    #[inline(always)]
    fn prefetch_unit<const MIN: bool, const FIFTH: bool, const SHARED: usize>(self, _u: usize) {}

    /// [`prefetch_unit`](Self::prefetch_unit) for Q8_0 block `b`.
    #[inline(always)]
    fn prefetch_q8_0(self, _b: usize) {}

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

    /// Unit `u` (`unit` bytes) of the next group: the groups of a run lie one after another,
    /// the next starting where this one ends.
    #[inline(always)]
    fn prefetch_next(self, u: usize, unit: usize) {
        let next = self.p.wrapping_add(self.len + u * unit);
        for line in 0..unit.div_ceil(64) {
            // SAFETY: a prefetch never faults, wherever it points.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line * 64).cast()) };
        }
    }
}

impl Source for Packed {
    type K4 = *const u8;

    #[inline(always)]
    fn prefetch_unit<const MIN: bool, const FIFTH: bool, const SHARED: usize>(self, u: usize) {
        self.prefetch_next(u, packed_fields(MIN, FIFTH, SHARED).2);
    }

    #[inline(always)]
    fn prefetch_q8_0(self, b: usize) {
        self.prefetch_next(b, group_block_bytes(Format::Q8_0));
    }

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
pub(super) unsafe fn nibbles(packed: [__m256i; 4]) -> [__m256i; 8] {
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
