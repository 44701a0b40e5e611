//! Decode (one input row) kernels: `y[r] = Σ_g s[r,g]·Σ_i q[r,i]·x[i] + b[r,g]·Σx[g]`.
//!
//! Every width has a portable path (codes read in place for widths dividing 32, unpacked to a
//! small buffer for 3, 5 and 6 bits). 4 and 8 bits, the common cases, get dedicated kernels:
//! - 4-bit: nibble `k` of eight words at once is one shift+mask+convert; `x` is permuted once
//!   per call to "nibble-major" order inside each group (`xp[k·W + w] = x[8w + k]`, `W` words
//!   per group) so every such 8-lane step meets a contiguous slice of `x`.
//! - 8-bit: the words' bytes are the codes in element order; 8 at a time are widened.
//!
//! Both exist as portable 8-lane loops (which compilers vectorise for the baseline target) and,
//! on x86-64 with AVX2 and FMA detected at run time, as intrinsics.

use std::borrow::Cow;

use half::{bf16, f16};

use super::CpuView;

/// A stored scale/bias element, widened to f32 once per group.
pub(super) trait ScaleType: Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl ScaleType for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl ScaleType for bf16 {
    /// bf16 is the top half of an f32: the widening is a shift.
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl ScaleType for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

pub use crate::cpu::Kernel;

/// Whether this CPU runs the AVX2+FMA decode kernels (x86-64 only, detected at run time).
pub fn avx2_available() -> bool {
    Kernel::Avx2.runs_here()
}

/// The kernel a call runs, decided once per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// Any width, group by group through [`CpuView::group_dot`].
    Generic,
    Q4,
    Q8,
    #[cfg(target_arch = "x86_64")]
    Avx2Q4,
    #[cfg(target_arch = "x86_64")]
    Avx2Q8,
}

impl Kernel {
    pub(super) fn path(self, bits: usize) -> Path {
        match (self, bits) {
            #[cfg(target_arch = "x86_64")]
            (k, 4) if k.has_avx2() && avx2_available() => Path::Avx2Q4,
            #[cfg(target_arch = "x86_64")]
            (k, 8) if k.has_avx2() && avx2_available() => Path::Avx2Q8,
            (_, 4) => Path::Q4,
            (_, 8) => Path::Q8,
            _ => Path::Generic,
        }
    }
}

impl Path {
    /// `x` in the order the kernel reads it (nibble-major groups for the 4-bit AVX2 kernel).
    pub(super) fn prepare(self, x: &[f32], group_size: usize) -> Cow<'_, [f32]> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Path::Avx2Q4 => Cow::Owned(nibble_major(x, group_size)),
            Path::Q4 => Cow::Owned(nibble_major(x, group_size)),
            _ => Cow::Borrowed(x),
        }
    }
}

/// `xp[g·G + k·W + w] = x[g·G + 8w + k]`: nibble `k` of word `w` of every group.
fn nibble_major(x: &[f32], group_size: usize) -> Vec<f32> {
    let words = group_size / 8;
    let mut out = vec![0f32; x.len()];
    for (xg, og) in x.chunks(group_size).zip(out.chunks_mut(group_size)) {
        for w in 0..words {
            for k in 0..8 {
                og[k * words + w] = xg[w * 8 + k];
            }
        }
    }
    out
}

/// Output `r` of the mat-vec: `x` as [`Path::prepare`] returned it, `xsum` its per-group sums.
pub(super) fn row_dot<S: ScaleType>(
    path: Path,
    v: &CpuView,
    s: &[S],
    b: &[S],
    r: usize,
    x: &[f32],
    xsum: &[f32],
) -> f32 {
    let groups = r * v.groups..(r + 1) * v.groups;
    let (s, b) = (&s[groups.clone()], &b[groups]);
    let gs = v.group_size;
    match path {
        Path::Q4 => {
            let words = v.row_words(r);
            affine_sum(s, b, xsum, |g| {
                dot_q4(&words[g * gs / 8..][..gs / 8], &x[g * gs..][..gs])
            })
        }
        Path::Q8 => {
            let words = v.row_words(r);
            affine_sum(s, b, xsum, |g| {
                dot_q8(&words[g * gs / 4..][..gs / 4], &x[g * gs..][..gs])
            })
        }
        Path::Generic => {
            let mut q = [0f32; 128]; // the largest group size
            let q = &mut q[..gs];
            affine_sum(s, b, xsum, |g| v.group_dot(r, g, q, &x[g * gs..][..gs]))
        }
        // SAFETY: these paths are chosen only when `avx2_available()`; the slices have the
        // lengths the kernels read (checked by their debug assertions).
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Q4 => unsafe { avx2::row_q4(v.row_words(r), s, b, x, xsum, v.group_size) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Q8 => unsafe { avx2::row_q8(v.row_words(r), s, b, x, xsum, v.group_size) },
    }
}

/// `Σ_g s[g]·dot(g) + b[g]·xsum[g]`: one row's groups, each code sum scaled and offset.
fn affine_sum<S: ScaleType>(
    s: &[S],
    b: &[S],
    xsum: &[f32],
    mut dot: impl FnMut(usize) -> f32,
) -> f32 {
    (0..s.len())
        .map(|g| s[g].widen() * dot(g) + b[g].widen() * xsum[g])
        .sum()
}

/// Dequantizes one 4- or 8-bit row into `row` (natural order) with `s·q + b` per group; false
/// for paths without a dedicated dequantizer (the caller then decodes generically).
pub(super) fn dequantize_row<S: ScaleType>(
    path: Path,
    words: &[u32],
    s: &[S],
    b: &[S],
    row: &mut [f32],
) -> bool {
    let gs = row.len() / s.len();
    match path {
        Path::Q4 => {
            for (g, (wg, out)) in words.chunks(gs / 8).zip(row.chunks_mut(gs)).enumerate() {
                let (s, b) = (s[g].widen(), b[g].widen());
                for (w, o) in wg.iter().zip(out.chunks_exact_mut(8)) {
                    for (k, o) in o.iter_mut().enumerate() {
                        *o = s * ((w >> (4 * k)) & 0xF) as f32 + b;
                    }
                }
            }
        }
        Path::Q8 => {
            for (g, (wg, out)) in words.chunks(gs / 4).zip(row.chunks_mut(gs)).enumerate() {
                let (s, b) = (s[g].widen(), b[g].widen());
                for (w, o) in wg.iter().zip(out.chunks_exact_mut(4)) {
                    for (k, o) in o.iter_mut().enumerate() {
                        *o = s * ((w >> (8 * k)) & 0xFF) as f32 + b;
                    }
                }
            }
        }
        // SAFETY: chosen only when `avx2_available()`; `words` holds `row.len() · bits / 32`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Q4 => unsafe { avx2::dequantize_q4(words, s, b, row) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Q8 => unsafe { avx2::dequantize_q8(words, s, b, row) },
        Path::Generic => return false,
    }
    true
}

/// `Σ q·x` over one 4-bit group: `words` its `W` words, `xp` its inputs nibble-major.
fn dot_q4(words: &[u32], xp: &[f32]) -> f32 {
    let per_group = words.len();
    let mut acc = [0f32; 8];
    if per_group == 4 {
        // Two nibbles per 8-lane step: lanes 0-3 nibble 2k, lanes 4-7 nibble 2k+1.
        for (k, xs) in xp.chunks_exact(8).enumerate() {
            for j in 0..8 {
                let q = (words[j % 4] >> (8 * k + 4 * (j / 4))) & 0xF;
                acc[j] += q as f32 * xs[j];
            }
        }
    } else {
        for (c, w) in words.chunks_exact(8).enumerate() {
            for k in 0..8 {
                let xs = &xp[k * per_group + c * 8..][..8];
                for j in 0..8 {
                    acc[j] += ((w[j] >> (4 * k)) & 0xF) as f32 * xs[j];
                }
            }
        }
    }
    acc.iter().sum()
}

/// `Σ q·x` over one 8-bit group: byte `i` of the little-endian words is code `i`.
fn dot_q8(words: &[u32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (w, xs) in words.chunks_exact(2).zip(x.chunks_exact(8)) {
        let bytes = (w[0] as u64 | (w[1] as u64) << 32).to_le_bytes();
        for j in 0..8 {
            acc[j] += bytes[j] as f32 * xs[j];
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::ScaleType;

    /// A 4-bit row into `row`, natural order: each word broadcast, shifted per lane by 4k.
    ///
    /// # Safety
    /// AVX2 and FMA; `words.len() · 8 == row.len()`, `row.len()` a multiple of `s.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dequantize_q4<S: ScaleType>(
        words: &[u32],
        s: &[S],
        b: &[S],
        row: &mut [f32],
    ) {
        debug_assert!(words.len() * 8 == row.len() && row.len().is_multiple_of(s.len()));
        let per_group = row.len() / s.len() / 8;
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(0xF);
        for g in 0..s.len() {
            let (sv, bv) = (_mm256_set1_ps(s[g].widen()), _mm256_set1_ps(b[g].widen()));
            for (i, &word) in words.iter().enumerate().skip(g * per_group).take(per_group) {
                let word = _mm256_set1_epi32(word as i32);
                let q = _mm256_and_si256(_mm256_srlv_epi32(word, shifts), mask);
                let w = _mm256_add_ps(_mm256_mul_ps(sv, _mm256_cvtepi32_ps(q)), bv);
                // SAFETY: elements 8i..8i+8 of `row`, in bounds by the length contract.
                unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(8 * i), w) };
            }
        }
    }

    /// An 8-bit row into `row`: the bytes are the codes in element order.
    ///
    /// # Safety
    /// AVX2 and FMA; `words.len() · 4 == row.len()`, groups a multiple of 8 elements.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dequantize_q8<S: ScaleType>(
        words: &[u32],
        s: &[S],
        b: &[S],
        row: &mut [f32],
    ) {
        debug_assert!(words.len() * 4 == row.len() && row.len().is_multiple_of(s.len()));
        let gs = row.len() / s.len();
        let bytes = words.as_ptr().cast::<u8>();
        for g in 0..s.len() {
            let (sv, bv) = (_mm256_set1_ps(s[g].widen()), _mm256_set1_ps(b[g].widen()));
            for i in (g * gs..(g + 1) * gs).step_by(8) {
                // SAFETY: bytes and elements i..i+8, in bounds by the length contract.
                unsafe {
                    let q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.add(i).cast()));
                    let w = _mm256_add_ps(_mm256_mul_ps(sv, _mm256_cvtepi32_ps(q)), bv);
                    _mm256_storeu_ps(row.as_mut_ptr().add(i), w);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// One 4-bit row: `words` its packed codes, `x` nibble-major per group.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `words.len() == s.len() · G / 8`,
    /// `x.len() == s.len() · G` with `G` (`group_size`) one of 32, 64, 128.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row_q4<S: ScaleType>(
        words: &[u32],
        s: &[S],
        b: &[S],
        x: &[f32],
        xsum: &[f32],
        group_size: usize,
    ) -> f32 {
        let per_group = group_size / 8;
        debug_assert!(words.len() == s.len() * per_group && x.len() == s.len() * group_size);
        debug_assert!(matches!(group_size, 32 | 64 | 128) && xsum.len() == s.len());
        let mask = _mm256_set1_epi32(0xF);
        let mut total = _mm256_setzero_ps();
        let mut bias = 0f32;
        for g in 0..s.len() {
            // SAFETY: group `g`'s words and inputs are in bounds by the length contract.
            let (wp, xp) = unsafe {
                (
                    words.as_ptr().add(g * per_group),
                    x.as_ptr().add(g * group_size),
                )
            };
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            if per_group == 4 {
                // The 4 words in the low lane and again shifted by a nibble in the high lane:
                // step `k` yields nibbles 2k (low) and 2k+1 (high), `xp[8k..8k+8]`.
                // SAFETY: 4 words in bounds.
                let w = unsafe { _mm_loadu_si128(wp.cast()) };
                let mut wv =
                    _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(w), _mm_srli_epi32::<4>(w));
                for k in 0..4 {
                    let q = _mm256_cvtepi32_ps(_mm256_and_si256(wv, mask));
                    // SAFETY: 8 inputs of the group's 32.
                    let xv = unsafe { _mm256_loadu_ps(xp.add(k * 8)) };
                    match k % 2 {
                        0 => a0 = _mm256_fmadd_ps(q, xv, a0),
                        _ => a1 = _mm256_fmadd_ps(q, xv, a1),
                    }
                    wv = _mm256_srli_epi32::<8>(wv);
                }
            } else {
                for c in 0..per_group / 8 {
                    // SAFETY: words 8c..8c+8 of the group, inputs k·W + 8c.. +8 for k < 8.
                    unsafe {
                        let mut wv = _mm256_loadu_si256(wp.add(c * 8).cast());
                        for k in (0..8).step_by(2) {
                            let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(wv, mask));
                            let x0 = _mm256_loadu_ps(xp.add(k * per_group + c * 8));
                            a0 = _mm256_fmadd_ps(q0, x0, a0);
                            let q1 = _mm256_and_si256(_mm256_srli_epi32::<4>(wv), mask);
                            let x1 = _mm256_loadu_ps(xp.add((k + 1) * per_group + c * 8));
                            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), x1, a1);
                            wv = _mm256_srli_epi32::<8>(wv);
                        }
                    }
                }
            }
            let scale = _mm256_set1_ps(s[g].widen());
            total = _mm256_fmadd_ps(scale, _mm256_add_ps(a0, a1), total);
            bias += b[g].widen() * xsum[g];
        }
        hsum(total) + bias
    }

    /// One 8-bit row: the words' bytes are the codes in element order; `x` as given.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `words.len() == s.len() · G / 4`,
    /// `x.len() == s.len() · G` with `G` (`group_size`) a multiple of 16.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row_q8<S: ScaleType>(
        words: &[u32],
        s: &[S],
        b: &[S],
        x: &[f32],
        xsum: &[f32],
        group_size: usize,
    ) -> f32 {
        debug_assert!(words.len() * 4 == s.len() * group_size && x.len() == s.len() * group_size);
        debug_assert!(group_size.is_multiple_of(16) && xsum.len() == s.len());
        let bytes = words.as_ptr().cast::<u8>();
        let mut total = _mm256_setzero_ps();
        let mut bias = 0f32;
        for g in 0..s.len() {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for i in (g * group_size..(g + 1) * group_size).step_by(16) {
                // SAFETY: bytes and inputs i..i+16 lie inside group `g`.
                unsafe {
                    let c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.add(i).cast()));
                    let c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.add(i + 8).cast()));
                    let x0 = _mm256_loadu_ps(x.as_ptr().add(i));
                    let x1 = _mm256_loadu_ps(x.as_ptr().add(i + 8));
                    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), x0, a0);
                    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), x1, a1);
                }
            }
            let scale = _mm256_set1_ps(s[g].widen());
            total = _mm256_fmadd_ps(scale, _mm256_add_ps(a0, a1), total);
            bias += b[g].widen() * xsum[g];
        }
        hsum(total) + bias
    }
}
