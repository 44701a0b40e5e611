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
    /// Sixteen elements at `p` widened into one 512-bit register.
    ///
    /// # Safety
    /// `p` must point to sixteen readable elements, on a CPU with AVX-512 F and F16C.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe { join(Self::load8(p), Self::load8(p.add(8))) }
    }
}

/// `[low, high]` as one 512-bit register (AVX-512 F).
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn join(low: __m256, high: __m256) -> __m512 {
    unsafe {
        let wide = _mm512_castpd256_pd512(_mm256_castps_pd(low));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(wide, _mm256_castps_pd(high)))
    }
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
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
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

/// Key or value rows as attention reads them: plain elements or quantized codes.
pub(crate) trait KvRows: Copy + Send + Sync {
    /// Number of rows.
    fn count(&self) -> usize;
    /// Values per row.
    fn width(&self) -> usize;
    /// Rows `from..from + count`.
    fn subset(&self, from: usize, count: usize) -> Self;
    /// Element `c` of row `j`, widened (the portable path).
    fn get(&self, j: usize, c: usize) -> f32;
    /// Elements `c..c + 16` of row `j`, widened.
    ///
    /// # Safety
    /// `j < count`, `c + 16 ≤ width`, on a CPU with AVX2/FMA/F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(&self, j: usize, c: usize) -> [__m256; 2];
    /// [`load16`](Self::load16) in one 512-bit register.
    ///
    /// # Safety
    /// As for `load16`, on a CPU with AVX-512 F as well.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load16_wide(&self, j: usize, c: usize) -> __m512 {
        unsafe {
            let [low, high] = self.load16(j, c);
            join(low, high)
        }
    }
    /// Asks for row `j` (if there is one) to be brought into the cache: a chunk's rows are too
    /// few for the hardware prefetcher to ramp up on (none by default).
    #[inline]
    fn prefetch(&self, _j: usize) {}
}

impl<E: Elem> KvRows for Rows<'_, E> {
    fn count(&self) -> usize {
        self.count
    }

    fn width(&self) -> usize {
        self.len
    }

    fn subset(&self, from: usize, count: usize) -> Self {
        Rows::subset(self, from, count)
    }

    fn get(&self, j: usize, c: usize) -> f32 {
        self.row(j)[c].to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load16(&self, j: usize, c: usize) -> [__m256; 2] {
        // SAFETY: row `j` starts at `j · stride` and holds `len ≥ c + 16` elements (the
        // caller's contract); AVX2/F16C likewise.
        unsafe {
            let p = self.data.as_ptr().add(j * self.stride + c);
            [E::load8(p), E::load8(p.add(8))]
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load16_wide(&self, j: usize, c: usize) -> __m512 {
        // SAFETY: as in `load16`.
        unsafe { E::load16(self.data.as_ptr().add(j * self.stride + c)) }
    }

    #[inline]
    fn prefetch(&self, j: usize) {
        #[cfg(target_arch = "x86_64")]
        if j < self.count {
            let row = self.data[j * self.stride..].as_ptr().cast::<i8>();
            let bytes = self.len * size_of::<E>();
            for at in (0..bytes).step_by(64) {
                // SAFETY: a prefetch reads nothing; the address lies within or just past the row.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(at)) };
            }
        }
    }
}

/// Scores and weighted sums for up to [`simd::HEADS`] query heads that share their key and value
/// rows (grouped-query attention), AVX2 or portable.
pub(super) mod simd {
    use super::{KvRows, Rows};

    /// Query heads per kernel call: each key or value row is loaded once for all of them.
    pub const HEADS: usize = 4;

    /// Which form of the kernels runs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Simd {
        Portable,
        Avx2,
        /// The AVX2 forms' arithmetic in 512-bit registers (`attention_cpu::wide`).
        Avx512,
    }

    pub fn available() -> Simd {
        match crate::cpu::Kernel::best() {
            crate::cpu::Kernel::Avx512Vnni => Simd::Avx512,
            crate::cpu::Kernel::Avx2 => Simd::Avx2,
            crate::cpu::Kernel::Scalar => Simd::Portable,
        }
    }

    /// `out[g · n + j] = scale · q_g · k_j` for the `g` query rows and `n` key rows.
    /// `values` are the rows the weighted sum reads next (prefetched meanwhile).
    pub fn scores<K: KvRows>(
        simd: Simd,
        q: Rows<f32>,
        (k, values): (K, K),
        scale: f32,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if simd != Simd::Portable && q.len.is_multiple_of(16) {
            use crate::attention_cpu::wide;
            type Kernel<K> = unsafe fn(Rows<f32>, (K, K), f32, &mut [f32]);
            let kernel: Kernel<K> = match (simd, q.count) {
                (Simd::Avx512, 1) => wide::scores::<1, K>,
                (Simd::Avx512, 2) => wide::scores::<2, K>,
                (Simd::Avx512, 3) => wide::scores::<3, K>,
                (Simd::Avx512, _) => wide::scores::<HEADS, K>,
                (_, 1) => x86::scores::<1, K>,
                (_, 2) => x86::scores::<2, K>,
                (_, 3) => x86::scores::<3, K>,
                _ => x86::scores::<HEADS, K>,
            };
            // SAFETY: `simd` comes from `available()`; rows are `len` long, a multiple of 16,
            // and `out` holds one score per (query, key).
            return unsafe { kernel(q, (k, values), scale, out) };
        }
        let _ = (simd, values);
        for (g, out) in out.chunks_exact_mut(k.count()).enumerate() {
            let q = q.row(g);
            for (j, s) in out.iter_mut().enumerate() {
                *s = scale
                    * q.iter()
                        .enumerate()
                        .map(|(c, x)| x * k.get(j, c))
                        .sum::<f32>();
            }
        }
    }

    /// `out[g] = Σ_j p[g · n + j] · v_j` for the `g` heads' probabilities and `n` value rows.
    pub fn weighted_sum<V: KvRows>(simd: Simd, p: &[f32], v: V, out: &mut [f32]) {
        let (n, d) = (v.count(), v.width());
        let heads = out.len() / d;
        #[cfg(target_arch = "x86_64")]
        if simd != Simd::Portable && d.is_multiple_of(16) {
            use crate::attention_cpu::wide;
            let kernel: unsafe fn(&[f32], V, &mut [f32]) = match (simd, heads) {
                (Simd::Avx512, 1) => wide::weighted_sum::<1, V>,
                (Simd::Avx512, 2) => wide::weighted_sum::<2, V>,
                (Simd::Avx512, 3) => wide::weighted_sum::<3, V>,
                (Simd::Avx512, _) => wide::weighted_sum::<HEADS, V>,
                (_, 1) => x86::weighted_sum::<1, V>,
                (_, 2) => x86::weighted_sum::<2, V>,
                (_, 3) => x86::weighted_sum::<3, V>,
                _ => x86::weighted_sum::<HEADS, V>,
            };
            // SAFETY: as in `scores`; `p` holds `heads · n` values and `out` `heads` rows.
            return unsafe { kernel(p, v, out) };
        }
        let _ = simd;
        for (out, p) in out.chunks_exact_mut(d).zip(p.chunks_exact(n)) {
            out.fill(0.0);
            for (j, &p) in p.iter().enumerate() {
                for (c, o) in out.iter_mut().enumerate() {
                    *o += p * v.get(j, c);
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    pub(in crate::attention_cpu) mod x86 {
        use super::super::{KvRows, Rows};
        use std::arch::x86_64::*;

        /// Rows ahead of the one in use that a kernel prefetches.
        const AHEAD: usize = 8;

        /// # Safety
        /// AVX2/FMA/F16C; `q.count == G`, `q.len == k.len`, a multiple of 16.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn scores<const G: usize, K: KvRows>(
            q: Rows<f32>,
            (k, values): (K, K),
            scale: f32,
            out: &mut [f32],
        ) {
            let (n, d) = (k.count(), q.len);
            let qs: [&[f32]; G] = std::array::from_fn(|g| q.row(g));
            for j in 0..n {
                // The values too, for the weighted sum that follows.
                k.prefetch(j + AHEAD);
                values.prefetch(j + AHEAD);
                // Two accumulators per head: FMA latency, not throughput, bounds one chain.
                let mut acc = [[_mm256_setzero_ps(); 2]; G];
                for c in (0..d).step_by(16) {
                    // SAFETY: c + 16 ≤ d, the length of every row; j < n.
                    unsafe {
                        let [k0, k1] = k.load16(j, c);
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
        pub unsafe fn weighted_sum<const G: usize, V: KvRows>(p: &[f32], v: V, out: &mut [f32]) {
            let (n, d) = (v.count(), v.width());
            let p = &p[..G * n];
            let out = &mut out[..G * d];
            // 16 columns at a time: 2·G accumulators stay in registers over all rows.
            for c in (0..d).step_by(16) {
                let mut acc = [[_mm256_setzero_ps(); 2]; G];
                for j in 0..n {
                    // SAFETY: c + 16 ≤ d; j < n; g · n + j < G · n.
                    unsafe {
                        let [v0, v1] = v.load16(j, c);
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
