//! The codec's codebooks: the 3-bit (values, QJL keys) and 4-bit (keys) Lloyd–Max quantizers of
//! one rotated unit-vector coordinate, their distortion, and the QJL score estimator's weights
//! that follow from the 3-bit one.

use std::sync::OnceLock;

/// The weights `(a, b)` of the score estimate `a·<q', c> + b·QJL` for a codebook of expected
/// distortion `D = E||u − c||²`, which keep it unbiased and minimise its variance.
///
/// Both `<q', c> / (1 − D)` (the MSE estimate, rescaled: for a random rotation
/// `E<q', c> = (1 − D)<q, u>`) and `<q', c> + QJL` (the paper's) are unbiased. Their errors are
/// nearly independent, with variances `≈ D/d·||q||² / (1 − D)²` and `≈ π/2 · D/d·||q||²`
/// (QJL's sign sketch costs a factor π/2 over the residual it estimates), so the
/// inverse-variance blend `(1 − β) A + β B`, `β = v_A / (v_A + v_B)`, is unbiased with about
/// 60 % of the paper's estimate's variance.
pub(super) fn estimator_weights(distortion: f64) -> (f32, f32) {
    let kept = 1.0 - distortion;
    let (va, vb) = (1.0 / (kept * kept), std::f64::consts::FRAC_PI_2);
    let beta = va / (va + vb);
    (((1.0 - beta) / kept + beta) as f32, beta as f32)
}

/// The Lloyd–Max codebook of `d` and its distortion, computed once per process (they depend
/// on `d` only).
pub(super) fn codebook(d: usize) -> ([f32; 8], f64) {
    static CACHE: [OnceLock<([f32; 8], f64)>; 7] = [const { OnceLock::new() }; 7];
    *CACHE[d.trailing_zeros() as usize - 4].get_or_init(|| lloyd_max::<8>(d))
}

/// The 16-level codebook of `d` and its distortion.
pub(super) fn codebook16(d: usize) -> ([f32; 16], f64) {
    static CACHE: [OnceLock<([f32; 16], f64)>; 7] = [const { OnceLock::new() }; 7];
    *CACHE[d.trailing_zeros() as usize - 4].get_or_init(|| lloyd_max::<16>(d))
}

/// The `N`-level Lloyd–Max quantizer of one coordinate of a uniform unit vector in R^d, density
/// `∝ (1 − x²)^((d−3)/2)` on [−1, 1], and its distortion `E||u − c||² = 1 − d·E[c²]` (the
/// centroid condition makes `E[x c] = E[c²]`, and `E[x²] = 1/d`).
fn lloyd_max<const N: usize>(d: usize) -> ([f32; N], f64) {
    const GRID: usize = 4096;
    let sigma = 1.0 / (d as f64).sqrt();
    // Beyond 8σ the mass is below 1e-14: the grid covers only where it matters.
    let half = (8.0 * sigma).min(1.0);
    let h = 2.0 * half / GRID as f64;
    let power = (d as f64 - 3.0) / 2.0;
    let f = |i: usize| {
        let x = -half + i as f64 * h;
        (x, (1.0 - x * x).max(0.0).powf(power))
    };
    // Cumulative mass and first moment at the nodes (trapezoid; h ≤ σ/256 makes it exact to
    // ~1e-6, Simpson would change nothing visible).
    let (mut mass, mut moment) = (vec![0.0; GRID + 1], vec![0.0; GRID + 1]);
    for i in 1..=GRID {
        let ((x0, f0), (x1, f1)) = (f(i - 1), f(i));
        mass[i] = mass[i - 1] + 0.5 * h * (f0 + f1);
        moment[i] = moment[i - 1] + 0.5 * h * (x0 * f0 + x1 * f1);
    }
    let at = |table: &[f64], x: f64| {
        let s = ((x + half) / h).clamp(0.0, GRID as f64);
        let i = (s as usize).min(GRID - 1);
        table[i] + (s - i as f64) * (table[i + 1] - table[i])
    };
    // Started evenly over ±2.4σ, near the Gaussian solution; Lloyd then converges monotonically.
    let step = 4.8 / N as f64;
    let mut c: [f64; N] =
        std::array::from_fn(|i| (i as f64 - (N as f64 - 1.0) / 2.0) * step * sigma);
    let edges = |c: &[f64; N]| {
        let mut edges = vec![-half; N + 1];
        edges[N] = half;
        for i in 1..N {
            edges[i] = 0.5 * (c[i - 1] + c[i]);
        }
        edges
    };
    for _ in 0..10_000 {
        let edges = edges(&c);
        let mut change: f64 = 0.0;
        for (i, c) in c.iter_mut().enumerate() {
            let m = at(&mass, edges[i + 1]) - at(&mass, edges[i]);
            let new = (at(&moment, edges[i + 1]) - at(&moment, edges[i])) / m;
            change = change.max((new - *c).abs());
            *c = new;
        }
        if change < 1e-10 * sigma {
            break;
        }
    }
    let e = edges(&c);
    let second: f64 = (c.iter().enumerate())
        .map(|(i, c)| c * c * (at(&mass, e[i + 1]) - at(&mass, e[i])))
        .sum();
    (c.map(|x| x as f32), 1.0 - d as f64 * second / mass[GRID])
}
