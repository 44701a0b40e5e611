//! The AVX2 kernels of [`TurboCodec`]: scores and value sums straight from the packed codes.

use super::{PreparedQuery, TurboCodec, u24};
use half::f16;
use std::arch::x86_64::*;

/// [`TurboCodec::scores_grouped`] of `G` query heads with AVX2.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `qs` holds `G` queries of the codec's `d`, `out`
/// `G` rows of one score per key row.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores<const G: usize>(
    c: &TurboCodec,
    qs: &[PreparedQuery],
    k: &[u8],
    scale: f32,
    out: &mut [f32],
) {
    let (table, shifts) = tables(c);
    // The estimator's weights: the MSE part's in the levels, the QJL part's in `qjl`.
    let table = _mm256_mul_ps(table, _mm256_set1_ps(c.mse_weight));
    let bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let n = out.len() / G;
    let rotated: [*const f32; G] = std::array::from_fn(|g| qs[g].rotated.as_ptr());
    let projected: [*const f32; G] = std::array::from_fn(|g| qs[g].projected.as_ptr());
    let qjl = c.qjl_weight * (std::f32::consts::FRAC_PI_2).sqrt() / c.dim as f32;
    for (j, key) in k.chunks_exact(c.key_bytes()).enumerate() {
        let (norm, gamma, codes, signs) = c.key_parts(key);
        // One sum per head: <q', c> + 2·qjl·γ · Σ_{s=+1} t, the estimate's varying part.
        let kappa = _mm256_set1_ps(2.0 * qjl * gamma);
        let mut acc = [_mm256_setzero_ps(); G];
        for (i, c3) in codes.chunks_exact(3).enumerate() {
            let levels = lookup(table, shifts, u24(c3));
            for g in 0..G {
                // SAFETY: 8 · i + 8 ≤ d, the length of every rotated query.
                let x = unsafe { _mm256_loadu_ps(rotated[g].add(8 * i)) };
                acc[g] = _mm256_fmadd_ps(x, levels, acc[g]);
            }
        }
        for (i, &b) in signs.iter().enumerate() {
            let b = _mm256_and_si256(_mm256_set1_epi32(i32::from(b)), bits);
            let set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bits));
            for g in 0..G {
                // SAFETY: as above, for the projected queries.
                let t = unsafe { _mm256_loadu_ps(projected[g].add(8 * i)) };
                acc[g] = _mm256_fmadd_ps(_mm256_and_ps(set, t), kappa, acc[g]);
            }
        }
        for g in 0..G {
            let varying = hsum(acc[g]);
            let fixed = qjl * gamma * qs[g].projected_sum;
            let exact = c.outlier_dot(&qs[g].plain, key);
            out[g * n + j] = scale * (norm * (varying - fixed) + exact + qs[g].offset(key));
        }
    }
}

/// [`TurboCodec::scores_grouped`] of `G` query heads over [`TurboKeys::Mse`](super::TurboKeys)
/// rows with AVX2: the 16 levels looked up as two 8-lane tables blended on bit 3.
///
/// # Safety
/// As [`scores`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores_mse<const G: usize>(
    c: &TurboCodec,
    qs: &[PreparedQuery],
    k: &[u8],
    scale: f32,
    out: &mut [f32],
) {
    // SAFETY: `key_centroids` holds 16 floats.
    let (low, high) = unsafe {
        let p = c.key_centroids.as_ptr();
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    };
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let n = out.len() / G;
    let rotated: [*const f32; G] = std::array::from_fn(|g| qs[g].rotated.as_ptr());
    // Looked up once: per key they were calls (a tenth of a turbo prefill's profile).
    let (half, outliers) = (c.dim / 2, c.outliers() > 0);
    for (j, key) in k.chunks_exact(c.key_bytes()).enumerate() {
        let norm = f16::from_le_bytes([key[0], key[1] & 0x7f]).to_f32();
        let codes = &key[2..2 + half];
        let mut acc = [_mm256_setzero_ps(); G];
        for (i, c4) in codes.chunks_exact(4).enumerate() {
            let packed = u32::from_le_bytes([c4[0], c4[1], c4[2], c4[3]]);
            let idx = _mm256_srlv_epi32(_mm256_set1_epi32(packed as i32), shifts);
            // vpermps reads each index's low 3 bits; bit 3, moved to the sign, picks the table.
            let upper = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx));
            let levels = _mm256_blendv_ps(
                _mm256_permutevar8x32_ps(low, idx),
                _mm256_permutevar8x32_ps(high, idx),
                upper,
            );
            for g in 0..G {
                // SAFETY: 8 · i + 8 ≤ d, the length of every rotated query.
                let x = unsafe { _mm256_loadu_ps(rotated[g].add(8 * i)) };
                acc[g] = _mm256_fmadd_ps(x, levels, acc[g]);
            }
        }
        for g in 0..G {
            let exact = if outliers {
                c.outlier_dot(&qs[g].plain, key)
            } else {
                0.0
            };
            out[g * n + j] = scale * (norm * hsum(acc[g]) + exact + qs[g].offset(key));
        }
    }
}

/// [`TurboCodec::accumulate_values_grouped`] of `G` heads with AVX2.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `p` holds `G` rows of one weight per value row, `accs`
/// `G` accumulators of `d`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn accumulate_values<const G: usize>(
    c: &TurboCodec,
    p: &[f32],
    values: &[u8],
    accs: &mut [f32],
) {
    let (table, shifts) = tables(c);
    let (d, n, vb) = (c.dim, p.len() / G, c.value_bytes());
    let norms: Vec<f32> = (values.chunks_exact(vb))
        .map(|row| f16::from_le_bytes([row[0], row[1] & 0x7f]).to_f32())
        .collect();
    // 16 columns per pass: 2·G accumulators stay in registers over all rows.
    for block in 0..d / 16 {
        let mut sums = [[_mm256_setzero_ps(); 2]; G];
        for (j, row) in values.chunks_exact(vb).enumerate() {
            let codes = &row[2 + 6 * block..][..6];
            let low = lookup(table, shifts, u24(&codes[..3]));
            let high = lookup(table, shifts, u24(&codes[3..]));
            for (g, [s0, s1]) in sums.iter_mut().enumerate() {
                let coef = _mm256_set1_ps(p[g * n + j] * norms[j]);
                *s0 = _mm256_fmadd_ps(coef, low, *s0);
                *s1 = _mm256_fmadd_ps(coef, high, *s1);
            }
        }
        for (g, [s0, s1]) in sums.into_iter().enumerate() {
            // SAFETY: g · d + 16 · block + 16 ≤ G · d = accs.len().
            unsafe {
                let a = accs.as_mut_ptr().add(g * d + 16 * block);
                _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), s0));
                _mm256_storeu_ps(a.add(8), _mm256_add_ps(_mm256_loadu_ps(a.add(8)), s1));
            }
        }
    }
}

/// The centroids as a vector, and the shifts that bring code `j` of 8 to lane `j`'s bottom.
#[target_feature(enable = "avx2,fma")]
fn tables(c: &TurboCodec) -> (__m256, __m256i) {
    // SAFETY: `centroids` holds 8 floats.
    let table = unsafe { _mm256_loadu_ps(c.centroids.as_ptr()) };
    (table, _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21))
}

/// The centroids of 8 packed codes; vpermps reads only each index's low 3 bits, so the
/// higher codes left above them need no mask.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn lookup(table: __m256, shifts: __m256i, packed: u32) -> __m256 {
    let idx = _mm256_srlv_epi32(_mm256_set1_epi32(packed as i32), shifts);
    _mm256_permutevar8x32_ps(table, idx)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}
