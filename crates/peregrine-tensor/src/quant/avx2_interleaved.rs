//! x86 kernels for [`Interleaved`](super::interleaved::Interleaved) Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weights:
//! a run of groups of 8 rows against `T` input rows, each group's outputs stored in place (one
//! call per run, not per group: a decode step makes ~25,000 groups' worth of calls per token on
//! SmolLM2, and their overhead was a sixth of the kernels' instructions). Per block the 8 rows' codes are unpacked once into 8
//! vectors (values `4k..4k + 4` of every row in each), and each input's 4 codes at `4k`,
//! broadcast, multiply vector `k`: 8 integer products per lane give each row's block sum
//! directly in its lane, with no horizontal sums. The rows' scales (and minimums) load as one
//! vector, so the float work is two FMAs per block for 8 outputs. Same integer sums and the
//! same per-block algebra as [`super::scalar`]; only the float summation order differs. The
//! 32-value formats add each input's refinements ([`Refinement`]) after its blocks, into the
//! same accumulators: one more block each.

use std::arch::x86_64::*;

use super::act::{Q8Block, Refinement};
use super::avx2::{Avx2, Isa, Vnni};
use super::avx2_groups::{Packed, Source};
use super::avx2_interleaved_k;
use super::avx2_row_group::{Q4K_BYTES, Q6K_BYTES, Q8_0_BYTES, RowGroup, block_bytes};
use super::format::Format;
use super::interleaved::ROWS;

/// A run of groups of one interleaved matrix against `T` inputs.
pub struct Run<'a, const T: usize> {
    /// The matrix's groups, one after another.
    pub w: &'a [u8],
    /// How the groups lie in `w`.
    pub layout: GroupLayout,
    /// The groups to multiply.
    pub groups: std::ops::Range<usize>,
    /// The inputs' blocks (the matrix's width each), tiled.
    pub x: Inputs<'a>,
    /// Each input's refinements, added where the format takes them ([`Format::refines`];
    /// others ignore them).
    pub refined: [&'a [Refinement]; T],
    /// Each input's output row: group `g`'s 8 outputs are written at `out[t] + 8g`.
    pub out: [*mut f32; T],
}

/// How a run's groups lie in its bytes.
#[derive(Clone, Copy)]
pub enum GroupLayout {
    /// Interleaved ([`Interleaved`](super::interleaved::Interleaved)), this many bytes a group.
    Interleaved(usize),
    /// GGUF's rows, this many bytes each ([`RowGroup`]; Q4_0, Q4_1, Q8_0, Q4_K and Q6_K).
    Rows(usize),
}

/// A run's inputs, tiled ([`Q8Input::tile`](super::act::Q8Input::tile)): input `t`'s block `b`
/// at `blocks[b · stride + t]`.
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    /// From the first input's first block on.
    pub blocks: &'a [Q8Block],
    /// Inputs per block.
    pub stride: usize,
}

impl Inputs<'_> {
    /// Input `t`'s block `b`.
    ///
    /// # Safety
    /// `b · stride + t` is within the blocks.
    #[inline(always)]
    pub(super) unsafe fn get(&self, t: usize, b: usize) -> &Q8Block {
        // SAFETY: per this function's contract.
        unsafe { self.blocks.get_unchecked(b * self.stride + t) }
    }
}

/// `Σ w·x` of the 8 rows of each group of `run` for each of its inputs, into their outputs.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `format` is one [`Interleaved`] takes; `run.w`
/// holds its groups, each input the groups' blocks, each refinement names one of them, and
/// each output row is writable at `8g..8g + 8` for every group `g` of the run.
///
/// [`Interleaved`]: super::interleaved::Interleaved
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn groups<const T: usize>(format: Format, shared: usize, run: &Run<T>) {
    // SAFETY: this function's features are `Avx2`'s.
    unsafe { dispatch::<Avx2, T>(format, shared, run) }
}

/// For each group of `$run`, `$kernel` (with `$src` the group's [`Source`]) gives each input's
/// 8 outputs, stored at their place. A macro, not a closure: its body stays inside the
/// `target_feature` function.
macro_rules! each_group {
    ($run:expr, $block_bytes:expr, $src:ident => $kernel:expr) => {{
        let run = $run;
        for g in run.groups.clone() {
            let y = match run.layout {
                GroupLayout::Interleaved(bytes) => {
                    let $src = Packed::new(&run.w[g * bytes..][..bytes]);
                    $kernel
                }
                GroupLayout::Rows(row_bytes) => {
                    let $src = RowGroup::<{ $block_bytes }>::new(run.w, g, row_bytes);
                    $kernel
                }
            };
            for (t, y) in y.iter().enumerate() {
                _mm256_storeu_ps(run.out[t].add(ROWS * g), *y);
            }
        }
    }};
}

/// Runs `$body` with the consts `$min` and `$fifth` set for `$format` (so each format compiles
/// to its own loop).
macro_rules! with_fields {
    ($format:expr, $min:ident, $fifth:ident => $body:expr) => {
        match $format {
            Format::Q4_1 => {
                const $min: bool = true;
                const $fifth: bool = false;
                $body
            }
            Format::Q5_0 => {
                const $min: bool = false;
                const $fifth: bool = true;
                $body
            }
            Format::Q5_1 => {
                const $min: bool = true;
                const $fifth: bool = true;
                $body
            }
            _ => {
                const $min: bool = false;
                const $fifth: bool = false;
                $body
            }
        }
    };
}

/// [`groups`] with VNNI's `vpdpbusd`.
///
/// # Safety
/// As [`groups`], and the CPU must support AVX-512 F/BW/VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn groups_vnni<const T: usize>(format: Format, shared: usize, run: &Run<T>) {
    // SAFETY: this function's features are `Vnni`'s.
    unsafe { dispatch::<Vnni, T>(format, shared, run) }
}

/// The kernel of `format` over the groups of `run`, inlined into the `target_feature` entry
/// point that calls it.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them.
#[inline(always)]
unsafe fn dispatch<I: Isa, const T: usize>(format: Format, shared: usize, run: &Run<T>) {
    let (x, refined) = (run.x, run.refined);
    // SAFETY: per this function's contract.
    unsafe {
        match format {
            Format::Q4K => {
                each_group!(run, Q4K_BYTES, g => avx2_interleaved_k::rows_q4k::<I, T>(g, x))
            }
            Format::Q6K => {
                each_group!(run, Q6K_BYTES, g => avx2_interleaved_k::rows_q6k::<I, T>(g, x))
            }
            Format::Q8_0 => each_group!(run, Q8_0_BYTES, g => rows_q8_0::<I, T>(g, x, refined)),
            Format::Q4_1 if shared == 2 => {
                const BYTES: usize = block_bytes(true);
                each_group!(run, BYTES, g => rows::<I, true, false, 2, T>(g, x, refined))
            }
            // (Q5_0 and Q5_1 never come as rows: `avx2_row_group::fits`.)
            _ => with_fields!(format, MIN, FIFTH => each_group!(
                run, block_bytes(MIN), g => rows::<I, MIN, FIFTH, 1, T>(g, x, refined)
            )),
        }
    }
}

/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines; `w`
/// is a group of the format `MIN`, `FIFTH` and `SHARED` describe, each input holds its blocks.
#[inline(always)]
unsafe fn rows<I: Isa, const MIN: bool, const FIFTH: bool, const SHARED: usize, const T: usize>(
    w: impl Source,
    x: Inputs,
    refined: [&[Refinement]; T],
) -> [__m256; T] {
    // Codes without a minimum are offset by half their range.
    let offset = if FIFTH { 16.0 } else { 8.0 };
    // SAFETY: per this function's contract; every unit asked for is the group's.
    unsafe {
        // One accumulator chain per input (and one for its minimum terms): the inputs of a
        // tile are independent chains already, and a second chain per input spilled
        // registers at 4 inputs (the C equivalent of this loop: 116 GMAC/s with two chains at
        // 4 inputs, 133 with one). From 8 inputs on, the minimum terms take a pass of their
        // own after the codes' (the same terms in the same order: the same bits): held
        // beside the sums their chains spilled registers (Q4_1 at 8 inputs 88-97 -> 109-111
        // GMAC/s), while with fewer inputs the second pass cost more than it saved.
        let split = T >= 8;
        let mut acc = [_mm256_setzero_ps(); T];
        let mut mins = [_mm256_setzero_ps(); T];
        for u in 0..w.units::<MIN, FIFTH, SHARED>() {
            w.prefetch(u);
            if split {
                w.prefetch_unit::<MIN, FIFTH, SHARED>(u);
            }
            let (dw, mw) = w.heads::<MIN, FIFTH, SHARED>(u);
            for s in 0..SHARED {
                let codes = w.codes::<I, MIN, FIFTH, SHARED>(u, s);
                for t in 0..T {
                    let xb = x.get(t, u * SHARED + s);
                    acc[t] = code_term::<I, FIFTH, T>(&codes, xb, dw, acc[t]);
                    if !split {
                        mins[t] = min_term::<MIN>(xb, mw, offset, mins[t]);
                    }
                }
            }
        }
        if split {
            for u in 0..w.units::<MIN, FIFTH, SHARED>() {
                let (_, mw) = w.heads::<MIN, FIFTH, SHARED>(u);
                for s in 0..SHARED {
                    for (t, m) in mins.iter_mut().enumerate() {
                        *m = min_term::<MIN>(x.get(t, u * SHARED + s), mw, offset, *m);
                    }
                }
            }
        }
        // Each input's refined blocks after all its blocks, in ascending order, whatever the
        // other inputs refine: its bits do not depend on its batch. (This loop picks an
        // input's accumulators by a runtime index, which would keep them in memory through
        // the blocks above too: they move to memory here, once.)
        let (mut acc, mut mins) = (std::hint::black_box(acc), std::hint::black_box(mins));
        for ((c, m), refined) in acc.iter_mut().zip(&mut mins).zip(refined) {
            for r in refined {
                let (u, s) = (r.at / SHARED, r.at % SHARED);
                let (dw, mw) = w.heads::<MIN, FIFTH, SHARED>(u);
                let codes = w.codes::<I, MIN, FIFTH, SHARED>(u, s);
                *c = code_term::<I, FIFTH, T>(&codes, &r.residual, dw, *c);
                *m = min_term::<MIN>(&r.residual, mw, offset, *m);
            }
        }
        let mut y = [_mm256_setzero_ps(); T];
        for (t, y) in y.iter_mut().enumerate() {
            *y = _mm256_add_ps(acc[t], mins[t]);
        }
        y
    }
}

/// One block's codes term for one input: the codes' sum times both scales, added to `chain`.
/// The minimum or offset term ([`min_term`]) is added up apart and joined at the end, as
/// llama.cpp and the row kernels sum them.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn code_term<I: Isa, const FIFTH: bool, const T: usize>(
    codes: &[__m256i; 8],
    xb: &Q8Block,
    dw: __m256,
    chain: __m256,
) -> __m256 {
    // SAFETY: per this function's contract.
    unsafe {
        let sum = _mm256_cvtepi32_ps(if FIFTH {
            sum::<I, 5, T>(codes, xb)
        } else {
            sum::<I, 4, T>(codes, xb)
        });
        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xb.d));
        _mm256_fmadd_ps(scale, sum, chain)
    }
}

/// One block's minimum term (`MIN`: the rows' minimums `mw` times the input's `d·Σqs`) or
/// offset term (the rows' scales times `-offset · d·Σqs`) for one input, added to `chain`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn min_term<const MIN: bool>(
    xb: &Q8Block,
    mw: __m256,
    offset: f32,
    chain: __m256,
) -> __m256 {
    let m = if MIN { xb.ds } else { -offset * xb.dsum };
    // SAFETY: per this function's contract.
    unsafe { _mm256_fmadd_ps(mw, _mm256_set1_ps(m), chain) }
}

/// Q8_0: the 8 vectors are the block's 256 code bytes as they stand (signed). `dot4` takes
/// unsigned bytes: with AVX2 each vector goes in as `|q|` against the input's quad carrying
/// `q`'s sign (ggml's trick; `|q| ≤ 128` keeps the pair sums from saturating); with VNNI, whose
/// sums do not saturate, as `q + 128` (its top bit flipped, once for all inputs), less
/// `128 · Σ x` per input: the same integer sum with a third of the work per input.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn rows_q8_0<I: Isa, const T: usize>(
    w: impl Source,
    x: Inputs,
    refined: [&[Refinement]; T],
) -> [__m256; T] {
    // SAFETY: per this function's contract; every block asked for is the group's.
    unsafe {
        // One chain per input, as in `rows`.
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..w.q8_0_blocks() {
            w.prefetch(b);
            if T >= 8 {
                w.prefetch_q8_0(b);
            }
            let (dw, codes) = w.q8_0(b);
            let unsigned = unsigned_q8_0::<I>(&codes);
            for (t, acc) in acc.iter_mut().enumerate() {
                *acc = term_q8_0::<I>(&codes, &unsigned, x.get(t, b), dw, *acc);
            }
        }
        // As in `rows`: each input's refined blocks after its blocks, in ascending order.
        let mut acc = std::hint::black_box(acc);
        for (acc, refined) in acc.iter_mut().zip(refined) {
            for r in refined {
                let (dw, codes) = w.q8_0(r.at);
                let unsigned = unsigned_q8_0::<I>(&codes);
                *acc = term_q8_0::<I>(&codes, &unsigned, &r.residual, dw, *acc);
            }
        }
        acc
    }
}

/// What `dot4` takes of a Q8_0 block's code vectors: their magnitudes, or with VNNI the codes
/// plus 128 (then the codes themselves are unused).
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn unsigned_q8_0<I: Isa>(codes: &[__m256i; 8]) -> [__m256i; 8] {
    // SAFETY: per this function's contract.
    unsafe {
        let mut unsigned = [_mm256_setzero_si256(); 8];
        for (u, code) in unsigned.iter_mut().zip(codes) {
            *u = match I::WIDE {
                true => _mm256_xor_si256(*code, _mm256_set1_epi8(-128)),
                false => _mm256_abs_epi8(*code),
            };
        }
        unsigned
    }
}

/// `chain` plus one Q8_0 block's sums against `xb`, times the rows' scales `dw` and `xb.d`;
/// `unsigned` as [`unsigned_q8_0`] gives it.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn term_q8_0<I: Isa>(
    codes: &[__m256i; 8],
    unsigned: &[__m256i; 8],
    xb: &Q8Block,
    dw: __m256,
    chain: __m256,
) -> __m256 {
    let xq = xb.qs.as_ptr().cast::<i32>();
    // SAFETY: `qs` holds 8 quads; per this function's contract for the intrinsics.
    unsafe {
        let quad = |k: usize| _mm256_set1_epi32(xq.add(k).read_unaligned());
        let (mut s0, mut s1) = match I::WIDE {
            // |Σ (q + 128)·x| ≤ 32·255·127: no i32 overflow.
            true => (_mm256_set1_epi32(-128 * xb.sum), _mm256_setzero_si256()),
            false => (_mm256_setzero_si256(), _mm256_setzero_si256()),
        };
        for k in 0..4 {
            let x = |k: usize| match I::WIDE {
                true => quad(k),
                false => _mm256_sign_epi8(quad(k), codes[k]),
            };
            s0 = I::dot4(s0, unsigned[k], x(k));
            s1 = I::dot4(s1, unsigned[k + 4], x(k + 4));
        }
        let sum = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(xb.d));
        _mm256_fmadd_ps(scale, sum, chain)
    }
}

/// The 8 rows' integer sums against one activation block, per half: code vector `k` (values
/// `4k..4k + 4` of each row, as [`super::interleaved`] lays them out) times the block's quad `k`
/// broadcast, vectors 0-3 into the first sum and 4-7 into the second. Codes are below
/// `2^BITS`. With AVX2's `maddubs` (u8 × i8 pairs into i16), as many pair sums as cannot
/// overflow an i16 (`|pair| ≤ 2·(2^BITS - 1)·127`: 8 of them for 4 bits, 4 for 5, 2 for 6) add up
/// in 16 bits before one `madd` widens them, exactly, instead of a widening per vector.
///
/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
pub(super) unsafe fn halves<I: Isa, const BITS: u32>(
    codes: &[__m256i; 8],
    xb: &Q8Block,
) -> (__m256i, __m256i) {
    let xq = xb.qs.as_ptr().cast::<i32>();
    // SAFETY: `qs` holds 8 quads; per this function's contract for the intrinsics.
    unsafe {
        let quad = |k: usize| _mm256_set1_epi32(xq.add(k).read_unaligned());
        if I::WIDE {
            let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for k in 0..4 {
                s0 = I::dot4(s0, codes[k], quad(k));
                s1 = I::dot4(s1, codes[k + 4], quad(k + 4));
            }
            return (s0, s1);
        }
        // Vectors per 16-bit run: 4 for 4 and 5 bits (a half each), 2 for 6.
        let run = if BITS <= 5 { 4 } else { 2 };
        let ones = _mm256_set1_epi16(1);
        let mut halves = [_mm256_setzero_si256(); 2];
        for (h, half) in halves.iter_mut().enumerate() {
            for r in (0..4).step_by(run) {
                let mut pairs = _mm256_maddubs_epi16(codes[4 * h + r], quad(4 * h + r));
                for (k, &code) in codes.iter().enumerate().skip(4 * h + r + 1).take(run - 1) {
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(code, quad(k)));
                }
                *half = _mm256_add_epi32(*half, _mm256_madd_epi16(pairs, ones));
            }
        }
        (halves[0], halves[1])
    }
}

/// Both [`halves`] together: with AVX2 and 4-bit codes all 8 pair sums add up in 16 bits.
///
/// # Safety
/// As [`halves`].
#[inline(always)]
pub(super) unsafe fn sum<I: Isa, const BITS: u32, const T: usize>(
    codes: &[__m256i; 8],
    xb: &Q8Block,
) -> __m256i {
    // SAFETY: per this function's contract.
    unsafe {
        let xq = xb.qs.as_ptr().cast::<i32>();
        let quad = |k: usize| _mm256_set1_epi32(xq.add(k).read_unaligned());
        if I::WIDE && T >= 8 {
            // One chain: the integer sum is exact in any order, and an 8-input tile's inputs
            // are independent chains already (two halves cost a zeroing and an add per input
            // and block; with fewer inputs the halves' shorter chains measured faster).
            let mut sum = I::dot4(_mm256_setzero_si256(), codes[0], quad(0));
            for (k, &code) in codes.iter().enumerate().skip(1) {
                sum = I::dot4(sum, code, quad(k));
            }
            return sum;
        }
        if !I::WIDE && BITS <= 4 {
            let mut pairs = _mm256_maddubs_epi16(codes[0], quad(0));
            for (k, &code) in codes.iter().enumerate().skip(1) {
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(code, quad(k)));
            }
            return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        }
        let (s0, s1) = halves::<I, BITS>(codes, xb);
        _mm256_add_epi32(s0, s1)
    }
}
