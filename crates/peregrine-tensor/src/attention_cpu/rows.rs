//! Strided rows of a query or cache tensor, the element types a cache may hold (widened to f32
//! on load), and the score and weighted-sum kernels over them (AVX2/FMA/F16C or portable).

use half::{bf16, f16};

/// `count` rows of `len` elements, `stride` apart, from the start of `data`.
pub(super) struct Rows<'a, T> {
    pub(super) data: &'a [T],
    pub(super) stride: usize,
    pub(super) count: usize,
    pub(super) len: usize,
}

// Copy whatever `T` is: only the reference is copied.
impl<T> Clone for Rows<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Rows<'_, T> {}

impl<'a, T> Rows<'a, T> {
    pub(super) fn row(&self, r: usize) -> &'a [T] {
        &self.data[r * self.stride..][..self.len]
    }

    /// Rows `from..from + count`.
    pub(super) fn subset(&self, from: usize, count: usize) -> Self {
        Self {
            data: &self.data[from * self.stride..],
            count,
            ..*self
        }
    }
}

/// A cache element type, widened to f32 on load.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Eight elements at `p` widened.
    ///
    /// # Safety
    /// `p` must point to eight readable elements, on a CPU with AVX2/FMA/F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

impl Elem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Elem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl Elem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
        }
    }
}

/// Scores and weighted sums for up to [`simd::HEADS`] query heads that share their key and value
/// rows (grouped-query attention), AVX2 or portable.
pub(super) mod simd {
    use super::{Elem, Rows};

    /// Query heads per kernel call: each key or value row is loaded once for all of them.
    pub const HEADS: usize = 4;

    pub fn available() -> bool {
        crate::cpu::Kernel::best().has_avx2()
    }

    /// `out[g · n + j] = scale · q_g · k_j` for the `g` query rows and `n` key rows.
    pub fn scores<E: Elem>(simd: bool, q: Rows<f32>, k: Rows<E>, scale: f32, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd && q.len.is_multiple_of(16) {
            // SAFETY: `simd` comes from `available()`; rows are `len` long, a multiple of 16,
            // and `out` holds one score per (query, key).
            return unsafe {
                match q.count {
                    1 => x86::scores::<1, E>(q, k, scale, out),
                    2 => x86::scores::<2, E>(q, k, scale, out),
                    3 => x86::scores::<3, E>(q, k, scale, out),
                    _ => x86::scores::<HEADS, E>(q, k, scale, out),
                }
            };
        }
        let _ = simd;
        for (g, out) in out.chunks_exact_mut(k.count).enumerate() {
            let q = q.row(g);
            for (j, s) in out.iter_mut().enumerate() {
                *s = scale
                    * q.iter()
                        .zip(k.row(j))
                        .map(|(x, y)| x * y.to_f32())
                        .sum::<f32>();
            }
        }
    }

    /// `out[g] = Σ_j p[g · n + j] · v_j` for the `g` heads' probabilities and `n` value rows.
    pub fn weighted_sum<E: Elem>(simd: bool, p: &[f32], v: Rows<E>, out: &mut [f32]) {
        let heads = out.len() / v.len;
        #[cfg(target_arch = "x86_64")]
        if simd && v.len.is_multiple_of(16) {
            // SAFETY: as in `scores`; `p` holds `heads · n` values and `out` `heads` rows.
            return unsafe {
                match heads {
                    1 => x86::weighted_sum::<1, E>(p, v, out),
                    2 => x86::weighted_sum::<2, E>(p, v, out),
                    3 => x86::weighted_sum::<3, E>(p, v, out),
                    _ => x86::weighted_sum::<HEADS, E>(p, v, out),
                }
            };
        }
        let _ = simd;
        for (out, p) in out.chunks_exact_mut(v.len).zip(p.chunks_exact(v.count)) {
            out.fill(0.0);
            for (j, &p) in p.iter().enumerate() {
                for (o, x) in out.iter_mut().zip(v.row(j)) {
                    *o += p * x.to_f32();
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use super::super::{Elem, Rows};
        use std::arch::x86_64::*;

        /// # Safety
        /// AVX2/FMA/F16C; `q.count == G`, `q.len == k.len`, a multiple of 16.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn scores<const G: usize, E: Elem>(
            q: Rows<f32>,
            k: Rows<E>,
            scale: f32,
            out: &mut [f32],
        ) {
            let (n, d) = (k.count, q.len);
            let qs: [&[f32]; G] = std::array::from_fn(|g| q.row(g));
            for j in 0..n {
                let key = k.row(j);
                // Two accumulators per head: FMA latency, not throughput, bounds one chain.
                let mut acc = [[_mm256_setzero_ps(); 2]; G];
                for c in (0..d).step_by(16) {
                    // SAFETY: c + 16 ≤ d, the length of every row.
                    unsafe {
                        let k0 = E::load8(key.as_ptr().add(c));
                        let k1 = E::load8(key.as_ptr().add(c + 8));
                        for g in 0..G {
                            let qp = qs[g].as_ptr().add(c);
                            acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp), k0, acc[g][0]);
                            acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8)), k1, acc[g][1]);
                        }
                    }
                }
                for g in 0..G {
                    out[g * n + j] = scale * hsum(_mm256_add_ps(acc[g][0], acc[g][1]));
                }
            }
        }

        /// # Safety
        /// AVX2/FMA/F16C; `p` holds `G · v.count` values, `out` `G` rows of `v.len`, a
        /// multiple of 16.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn weighted_sum<const G: usize, E: Elem>(
            p: &[f32],
            v: Rows<E>,
            out: &mut [f32],
        ) {
            let (n, d) = (v.count, v.len);
            let p = &p[..G * n];
            let out = &mut out[..G * d];
            // 16 columns at a time: 2·G accumulators stay in registers over all rows.
            for c in (0..d).step_by(16) {
                let mut acc = [[_mm256_setzero_ps(); 2]; G];
                for j in 0..n {
                    let row = v.row(j);
                    // SAFETY: c + 16 ≤ d; g · n + j < G · n.
                    unsafe {
                        let v0 = E::load8(row.as_ptr().add(c));
                        let v1 = E::load8(row.as_ptr().add(c + 8));
                        for (g, [a0, a1]) in acc.iter_mut().enumerate() {
                            let pj = _mm256_set1_ps(*p.get_unchecked(g * n + j));
                            *a0 = _mm256_fmadd_ps(pj, v0, *a0);
                            *a1 = _mm256_fmadd_ps(pj, v1, *a1);
                        }
                    }
                }
                for (g, [a0, a1]) in acc.into_iter().enumerate() {
                    // SAFETY: g · d + c + 16 ≤ G · d.
                    unsafe {
                        let o = out.as_mut_ptr().add(g * d + c);
                        _mm256_storeu_ps(o, a0);
                        _mm256_storeu_ps(o.add(8), a1);
                    }
                }
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn hsum(s: __m256) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
        }
    }
}
