//! f32 or bf16 matrix × a few f32 rows on the CPU (decode steps, speculative verification, small
//! batches): each weight row is read once for all input rows, and every output is one dot product
//! whose summation order depends on nothing but the input length, so a row's result has the same
//! bits whatever the number of rows beside it or of threads (batch-invariant). bf16 weights are
//! widened to f32 as they are loaded (exactly: a bf16 is an f32's upper half), so they give the
//! bits their f32 copy would, in half the memory. Larger inputs (prefill) go through candle's GEMM.

use half::bf16;
use rayon::prelude::*;

/// A weight element the row kernels read.
pub trait WeightElem: Copy + Send + Sync + 'static {
    /// Whether the element is a bf16 (widened as loaded) rather than an f32.
    const BF16: bool;
    /// The value as f32, exactly.
    fn to_f32(self) -> f32;
}

impl WeightElem for f32 {
    const BF16: bool = false;
    fn to_f32(self) -> f32 {
        self
    }
}

impl WeightElem for bf16 {
    const BF16: bool = true;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Most input rows this kernel takes; more go to the GEMM.
pub const MAX_ROWS: usize = 64;
/// Weight rows per parallel task.
const TASK_ROWS: usize = 32;
/// Input rows that share each load of a weight row.
const SHARE: usize = 4;
/// Weight rows that share each load of an input row (AVX-512).
const WIDE_ROWS: usize = 4;

/// `out[i · n + j] = x[i] · w[j]` for `x`: `[m, k]` and `w`: `[n, k]` (row-major), `out`:
/// `[m, n]`. Parallel over blocks of weight rows.
pub fn matmul_rows<W: WeightElem>(w: &[W], x: &[f32], k: usize, out: &mut [f32]) {
    let (n, m) = (w.len() / k.max(1), x.len() / k.max(1));
    assert_eq!(out.len(), m * n, "dense: output is not [rows, out]");
    let out_ptr = SendPtr(out.as_mut_ptr());
    let blocks = n.div_ceil(TASK_ROWS);
    let wide = has_avx512();
    let task = |b: usize| {
        let rows = b * TASK_ROWS..((b + 1) * TASK_ROWS).min(n);
        // Each weight row stays in L1 while every input row meets it; with AVX-512, four weight
        // rows at a time share each load of an input row.
        let mut j = rows.start;
        while j < rows.end {
            let take = if wide && rows.end - j >= WIDE_ROWS {
                WIDE_ROWS
            } else {
                1
            };
            for i0 in (0..m).step_by(SHARE) {
                let r = SHARE.min(m - i0);
                let xs: [&[f32]; SHARE] =
                    std::array::from_fn(|s| &x[(i0 + s.min(r - 1)) * k..][..k]);
                let mut sums = [[0f32; SHARE]; WIDE_ROWS];
                match take {
                    1 => sums[0] = dots(&w[j * k..][..k], &xs, r),
                    _ => sums = wide_dots(&w[j * k..][..WIDE_ROWS * k], &xs, r),
                }
                for (a, row) in sums.iter().enumerate().take(take) {
                    for (s, &v) in row.iter().enumerate().take(r) {
                        // SAFETY: tasks own disjoint column blocks `rows` of `out` (m × n).
                        unsafe { *out_ptr.at((i0 + s) * n + j + a) = v };
                    }
                }
            }
            j += take;
        }
    };
    match blocks {
        0 | 1 => (0..blocks).for_each(task),
        _ => (0..blocks).into_par_iter().for_each(task),
    }
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the tasks holding it write disjoint elements (see `matmul_rows`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn at(self, i: usize) -> *mut f32 {
        // SAFETY: callers stay within the output slice.
        unsafe { self.0.add(i) }
    }
}

/// `w · xs[s]` for the first `r` of `xs`.
fn dots<W: WeightElem>(w: &[W], xs: &[&[f32]; SHARE], r: usize) -> [f32; SHARE] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected; every slice is `w.len()` long.
        return unsafe { avx2::dots(w, xs, r) };
    }
    let mut out = [0f32; SHARE];
    for (o, x) in out.iter_mut().zip(xs).take(r) {
        *o = portable_dot(w, x);
    }
    out
}

/// Whether the AVX-512 tile runs here.
fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `w[a] · xs[s]` for the [`WIDE_ROWS`] rows of `w` and the first `r` of `xs`, where
/// [`has_avx512`]; each output summed exactly as [`dots`] sums it.
fn wide_dots<W: WeightElem>(w: &[W], xs: &[&[f32]; SHARE], r: usize) -> [[f32; SHARE]; WIDE_ROWS] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: callers check `has_avx512`; `w` holds WIDE_ROWS rows as long as each of xs.
        unsafe { avx512::dots(w, xs, r) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("the AVX-512 tile runs only on x86_64")
}

/// A dot product in 16 lanes, summed as a tree at the end: the order the AVX2 path also uses,
/// spelled out for the compiler to vectorise.
fn portable_dot<W: WeightElem>(w: &[W], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let body = w.len() / 16 * 16;
    for (wc, xc) in w[..body].chunks_exact(16).zip(x[..body].chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = wc[l].to_f32().mul_add(xc[l], acc[l]);
        }
    }
    let mut sum = reduce(&acc);
    for (a, b) in w[body..].iter().zip(&x[body..]) {
        sum += a.to_f32() * b;
    }
    sum
}

/// 16 lanes summed as a fixed tree: lane `l` with `l + 8`, then with `l + 4`, `l + 2`, `l + 1`.
fn reduce(acc: &[f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{SHARE, WeightElem};

    /// 8 weights from `p + c` as f32 (bf16 ones widened).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn load8<W: WeightElem>(p: *const W, c: usize) -> __m256 {
        // SAFETY: the caller keeps `c + 8` within the row.
        unsafe {
            match W::BF16 {
                true => {
                    let h = _mm_loadu_si128(p.add(c) as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                }
                false => _mm256_loadu_ps(p.add(c) as *const f32),
            }
        }
    }

    /// `w · xs[s]` for `s < r`: the rows' dot products, each in two 8-lane accumulators.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots<W: WeightElem>(w: &[W], xs: &[&[f32]; SHARE], r: usize) -> [f32; SHARE] {
        // SAFETY (all arms): the caller's guarantees are passed on.
        unsafe {
            match r {
                1 => dots_n::<W, 1>(w, xs),
                2 => dots_n::<W, 2>(w, xs),
                3 => dots_n::<W, 3>(w, xs),
                _ => dots_n::<W, 4>(w, xs),
            }
        }
    }

    /// The sum of the 8 lanes `v` (lane `l` holding accumulator lanes `l` and `l + 8`) by the
    /// tree [`super::reduce`] spells out, then the tail `w · x` beyond the 16-wide body, in order.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn finish<W: WeightElem>(v: __m256, w: &[W], x: &[f32]) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        let mut sum = _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
        for (a, b) in w.iter().zip(x) {
            sum += a.to_f32() * b;
        }
        sum
    }

    /// [`dots`] for `R` rows: the same operations per row whatever `R` is.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots_n<W: WeightElem, const R: usize>(w: &[W], xs: &[&[f32]; SHARE]) -> [f32; SHARE] {
        let k = w.len();
        let body = k / 16 * 16;
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let wp = w.as_ptr();
        let xp: [*const f32; R] = std::array::from_fn(|s| xs[s].as_ptr());
        let mut c = 0;
        while c < body {
            // SAFETY: c + 16 <= k, and every slice is k long.
            unsafe {
                let w0 = load8(wp, c);
                let w1 = load8(wp, c + 8);
                for s in 0..R {
                    let x0 = _mm256_loadu_ps(xp[s].add(c));
                    let x1 = _mm256_loadu_ps(xp[s].add(c + 8));
                    acc[s][0] = _mm256_fmadd_ps(w0, x0, acc[s][0]);
                    acc[s][1] = _mm256_fmadd_ps(w1, x1, acc[s][1]);
                }
            }
            c += 16;
        }
        let mut out = [0f32; SHARE];
        for s in 0..R {
            // The tree `reduce` spells out: 16 lanes to 8, 4, 2, 1.
            let v = _mm256_add_ps(acc[s][0], acc[s][1]);
            out[s] = finish(v, &w[body..], &xs[s][body..]);
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{SHARE, WIDE_ROWS, WeightElem};

    /// 16 weights from `p + c` as f32 (bf16 ones widened).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16<W: WeightElem>(p: *const W, c: usize) -> __m512 {
        // SAFETY: the caller keeps `c + 16` within the row.
        unsafe {
            match W::BF16 {
                true => {
                    let h = _mm256_loadu_si256(p.add(c) as *const __m256i);
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                }
                false => _mm512_loadu_ps(p.add(c) as *const f32),
            }
        }
    }

    /// `w[a] · xs[s]` for the WIDE_ROWS rows of `w` and `s < r`: one 16-lane accumulator per
    /// output, whose lanes are the AVX2 path's two 8-lane ones, reduced by the same tree.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dots<W: WeightElem>(
        w: &[W],
        xs: &[&[f32]; SHARE],
        r: usize,
    ) -> [[f32; SHARE]; WIDE_ROWS] {
        // SAFETY (all arms): the caller's guarantees are passed on.
        unsafe {
            match r {
                1 => tile::<W, 1>(w, xs),
                2 => tile::<W, 2>(w, xs),
                3 => tile::<W, 3>(w, xs),
                _ => tile::<W, 4>(w, xs),
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn tile<W: WeightElem, const R: usize>(
        w: &[W],
        xs: &[&[f32]; SHARE],
    ) -> [[f32; SHARE]; WIDE_ROWS] {
        let k = xs[0].len();
        let body = k / 16 * 16;
        let mut acc = [[_mm512_setzero_ps(); R]; WIDE_ROWS];
        let wp: [*const W; WIDE_ROWS] = std::array::from_fn(|a| w[a * k..].as_ptr());
        let xp: [*const f32; R] = std::array::from_fn(|s| xs[s].as_ptr());
        let mut c = 0;
        while c < body {
            // SAFETY: c + 16 <= k, and every row is k long.
            unsafe {
                let xv: [__m512; R] = std::array::from_fn(|s| _mm512_loadu_ps(xp[s].add(c)));
                for a in 0..WIDE_ROWS {
                    let wv = load16(wp[a], c);
                    for s in 0..R {
                        acc[a][s] = _mm512_fmadd_ps(wv, xv[s], acc[a][s]);
                    }
                }
            }
            c += 16;
        }
        let mut out = [[0f32; SHARE]; WIDE_ROWS];
        for a in 0..WIDE_ROWS {
            for s in 0..R {
                let z = acc[a][s];
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
                let v = _mm256_add_ps(_mm512_castps512_ps256(z), hi);
                let tail = &w[a * k + body..(a + 1) * k];
                out[a][s] = super::avx2::finish(v, tail, &xs[s][body..]);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn the_avx512_tile_sums_as_the_row_kernel_does() {
        if !has_avx512() {
            return; // nothing to compare on this machine
        }
        for k in [16, 37, 576] {
            let w = values(WIDE_ROWS * k, 5);
            let x = values(3 * k, 6);
            let xs: [&[f32]; SHARE] = std::array::from_fn(|s| &x[s.min(2) * k..][..k]);
            let wide = wide_dots(&w, &xs, 3);
            for a in 0..WIDE_ROWS {
                let narrow = dots(&w[a * k..][..k], &xs, 3);
                for s in 0..3 {
                    assert_eq!(
                        wide[a][s].to_bits(),
                        narrow[s].to_bits(),
                        "k {k}, row {a}, input {s}"
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_weights_give_the_bits_of_their_f32_copy() {
        for (n, k) in [(70, 37), (33, 576), (5, 16)] {
            let w16: Vec<bf16> = values(n * k, 7).into_iter().map(bf16::from_f32).collect();
            let w32: Vec<f32> = w16.iter().map(|w| w.to_f32()).collect();
            let x = values(6 * k, 8);
            let (mut a, mut b) = (vec![0f32; 6 * n], vec![0f32; 6 * n]);
            matmul_rows(&w16, &x, k, &mut a);
            matmul_rows(&w32, &x, k, &mut b);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "n {n}, k {k}");
            assert_eq!(
                portable_dot(&w16[..k], &x[..k]).to_bits(),
                portable_dot(&w32[..k], &x[..k]).to_bits()
            );
        }
    }

    #[test]
    fn the_portable_dot_sums_in_the_same_order() {
        for k in [16, 37, 576] {
            let (w, x) = (values(k, 3), values(k, 4));
            assert_eq!(
                dots(&w, &[&x; SHARE], 1)[0].to_bits(),
                portable_dot(&w, &x).to_bits()
            );
        }
    }

    #[test]
    fn matches_a_plain_product_and_each_row_its_solo_bits() {
        for (n, k) in [(70, 37), (33, 576), (1, 16), (96, 1536)] {
            let w = values(n * k, 1);
            let m = 9;
            let x = values(m * k, 2);
            let mut out = vec![0f32; m * n];
            matmul_rows(&w, &x, k, &mut out);
            for i in 0..m {
                let mut solo = vec![0f32; n];
                matmul_rows(&w, &x[i * k..][..k], k, &mut solo);
                assert_eq!(
                    &out[i * n..][..n],
                    &solo[..],
                    "row {i} of {m} (n {n}, k {k})"
                );
                for j in 0..n {
                    let exact: f64 = (0..k)
                        .map(|c| w[j * k + c] as f64 * x[i * k + c] as f64)
                        .sum();
                    let got = out[i * n + j] as f64;
                    assert!((got - exact).abs() < 1e-4 * k as f64, "{got} vs {exact}");
                }
            }
        }
    }
}
