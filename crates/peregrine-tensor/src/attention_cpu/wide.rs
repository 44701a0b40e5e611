//! AVX-512 forms of the score and weighted-sum kernels. Scores take four keys per pass, each
//! query chunk loaded once for the four and the four sums reduced together; weighted sums keep
//! 64 columns of every head in registers per pass over the values. The per-lane arithmetic and
//! the reduction tree are the AVX2 forms' (`rows::simd::x86`), so the bits are the same.

use std::arch::x86_64::*;

use super::rows::{KvRows, Rows};

/// Rows ahead of the one in use that the score kernel prefetches (as the AVX2 form does).
const AHEAD: usize = 8;

/// Keys per pass of [`scores`].
const KEYS: usize = 4;

/// `out[g · n + j] = scale · q_g · k_j` for the `G` query rows and `n` key rows; `values` are
/// the rows the weighted sum reads next (prefetched meanwhile).
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F; `q.count == G`, `q.len == k.width()`, a multiple of 16;
/// `out` holds `G · n` scores.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn scores<const G: usize, K: KvRows>(
    q: Rows<f32>,
    (k, values): (K, K),
    scale: f32,
    out: &mut [f32],
) {
    let (n, d) = (k.count(), q.len);
    let out = &mut out[..G * n];
    let mut qs = [std::ptr::null::<f32>(); G];
    for (g, q_g) in qs.iter_mut().enumerate() {
        *q_g = q.row(g).as_ptr();
    }
    let scale4 = _mm_set1_ps(scale);
    let mut j = 0;
    while j + KEYS <= n {
        for a in 0..KEYS {
            k.prefetch(j + AHEAD + a);
            values.prefetch(j + AHEAD + a);
        }
        // Lanes 0-7 hold the AVX2 form's first accumulator, lanes 8-15 its second.
        let mut acc = [[_mm512_setzero_ps(); KEYS]; G];
        for c in (0..d).step_by(16) {
            let mut keys = [_mm512_setzero_ps(); KEYS];
            for (a, key) in keys.iter_mut().enumerate() {
                // SAFETY: j + a < n; c + 16 ≤ d.
                *key = unsafe { k.load16_wide(j + a, c) };
            }
            for (q_g, acc) in qs.iter().zip(acc.iter_mut()) {
                // SAFETY: every query row holds d ≥ c + 16 values.
                let q_c = unsafe { _mm512_loadu_ps(q_g.add(c)) };
                for (acc, key) in acc.iter_mut().zip(keys) {
                    *acc = _mm512_fmadd_ps(q_c, key, *acc);
                }
            }
        }
        for (g, acc) in acc.into_iter().enumerate() {
            let sums = _mm_mul_ps(scale4, hsum4(acc));
            // SAFETY: g · n + j + 4 ≤ G · n.
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(g * n + j), sums) };
        }
        j += KEYS;
    }
    for j in j..n {
        k.prefetch(j + AHEAD);
        values.prefetch(j + AHEAD);
        let mut acc = [_mm512_setzero_ps(); G];
        for c in (0..d).step_by(16) {
            // SAFETY: as above.
            let key = unsafe { k.load16_wide(j, c) };
            for (q_g, acc) in qs.iter().zip(acc.iter_mut()) {
                // SAFETY: as above.
                *acc = _mm512_fmadd_ps(unsafe { _mm512_loadu_ps(q_g.add(c)) }, key, *acc);
            }
        }
        for (g, acc) in acc.into_iter().enumerate() {
            out[g * n + j] = scale * _mm_cvtss_f32(hsum4([acc; KEYS]));
        }
    }
}

/// `out[g] = Σ_j p[g · n + j] · v_j` for the `G` heads' probabilities and `n` value rows.
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F; `p` holds `G · v.count()` values, `out` `G` rows of
/// `v.width()`, a multiple of 16.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn weighted_sum<const G: usize, V: KvRows>(p: &[f32], v: V, out: &mut [f32]) {
    let d = v.width();
    let mut c = 0;
    while c + 64 <= d {
        // SAFETY: c + 64 ≤ d; the caller's contract.
        unsafe { weighted_columns::<G, 4, V>(p, v, out, c) };
        c += 64;
    }
    while c < d {
        // SAFETY: c + 16 ≤ d (d is a multiple of 16); the caller's contract.
        unsafe { weighted_columns::<G, 1, V>(p, v, out, c) };
        c += 16;
    }
}

/// Columns `c..c + 16 · W` of [`weighted_sum`]: `G · W` sums in registers over all rows.
///
/// # Safety
/// As for [`weighted_sum`], with `c + 16 · W ≤ v.width()`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn weighted_columns<const G: usize, const W: usize, V: KvRows>(
    p: &[f32],
    v: V,
    out: &mut [f32],
    c: usize,
) {
    let (n, d) = (v.count(), v.width());
    let p = &p[..G * n];
    let out = &mut out[..G * d];
    let mut acc = [[_mm512_setzero_ps(); W]; G];
    for j in 0..n {
        let mut rows = [_mm512_setzero_ps(); W];
        for (w, row) in rows.iter_mut().enumerate() {
            // SAFETY: j < n; c + 16 · w + 16 ≤ d.
            *row = unsafe { v.load16_wide(j, c + 16 * w) };
        }
        for (g, acc) in acc.iter_mut().enumerate() {
            // SAFETY: g · n + j < G · n.
            let p_j = _mm512_set1_ps(unsafe { *p.get_unchecked(g * n + j) });
            for (acc, row) in acc.iter_mut().zip(rows) {
                *acc = _mm512_fmadd_ps(p_j, row, *acc);
            }
        }
    }
    for (g, acc) in acc.into_iter().enumerate() {
        for (w, acc) in acc.into_iter().enumerate() {
            // SAFETY: g · d + c + 16 · w + 16 ≤ G · d.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(g * d + c + 16 * w), acc) };
        }
    }
}

/// The sums of four keys' accumulators, lane `a` for key `a`, each by the AVX2 form's tree: its
/// two accumulators (the 256-bit halves) added, then the 128-bit halves, then lanes 0 + 2 and
/// 1 + 3, then those two.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn hsum4(acc: [__m512; KEYS]) -> __m128 {
    let [s0, s1, s2, s3] = [
        halves(acc[0]),
        halves(acc[1]),
        halves(acc[2]),
        halves(acc[3]),
    ];
    let (t01, t23) = (fold(s0, s1), fold(s2, s3));
    // Per 128-bit lane: [t0+t2, u0+u2, t1+t3, u1+u3] of its two keys' four sums t and u.
    let pairs = _mm256_add_ps(_mm256_unpacklo_ps(t01, t23), _mm256_unpackhi_ps(t01, t23));
    // Lane 0 of the low half: key 0's total, lane 1 key 2's; the high half keys 1 and 3.
    let totals = _mm256_add_ps(pairs, _mm256_permute_ps::<0b01_00_11_10>(pairs));
    _mm_unpacklo_ps(
        _mm256_castps256_ps128(totals),
        _mm256_extractf128_ps::<1>(totals),
    )
}

/// A 512-bit register's 256-bit halves added.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn halves(a: __m512) -> __m256 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    _mm256_add_ps(_mm512_castps512_ps256(a), high)
}

/// `[a's 128-bit halves added | b's]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn fold(a: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a, b),
        _mm256_permute2f128_ps::<0x31>(a, b),
    )
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::super::rows::simd::x86;
    use super::*;

    fn has_avx512() -> bool {
        crate::cpu::Kernel::best() == crate::cpu::Kernel::Avx512Vnni
    }

    /// Values with every mantissa bit in play, so a changed sum order changes bits.
    fn noise(i: usize, seed: usize) -> f32 {
        (((i * 7919 + seed * 104_729) % 10_007) as f32 / 10_007.0 - 0.5) * 1.37
    }

    #[test]
    fn the_avx512_kernels_give_the_avx2_kernels_bits() {
        if !has_avx512() {
            eprintln!("skipped: no AVX-512 here");
            return;
        }
        for d in [16, 64, 80, 128, 256] {
            for n in [1, 3, 4, 5, 8, 13, 33] {
                let q: Vec<f32> = (0..4 * d).map(|i| noise(i, 1)).collect();
                let k: Vec<f16> = (0..n * d).map(|i| f16::from_f32(noise(i, 2))).collect();
                let v: Vec<f16> = (0..n * d).map(|i| f16::from_f32(noise(i, 3))).collect();
                let p: Vec<f32> = (0..4 * n).map(|i| noise(i, 4).abs()).collect();
                let rows = |data| Rows {
                    data,
                    stride: d,
                    count: n,
                    len: d,
                };
                let (k, v) = (rows(&k[..]), rows(&v[..]));
                let q = Rows {
                    data: &q[..],
                    stride: d,
                    count: 3,
                    len: d,
                };
                let (mut want, mut got) = (vec![0f32; 3 * n], vec![0f32; 3 * n]);
                let (mut want_v, mut got_v) = (vec![0f32; 3 * d], vec![0f32; 3 * d]);
                // SAFETY: AVX-512 F (and so AVX2) checked; shapes as the kernels require.
                unsafe {
                    x86::scores::<3, _>(q, (k, v), 0.125, &mut want);
                    scores::<3, _>(q, (k, v), 0.125, &mut got);
                    x86::weighted_sum::<3, _>(&p, v, &mut want_v);
                    weighted_sum::<3, _>(&p, v, &mut got_v);
                }
                let bits = |x: &[f32]| x.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "scores, d {d}, {n} keys");
                assert_eq!(bits(&got_v), bits(&want_v), "weighted sum, d {d}, {n} rows");
            }
        }
    }
}
