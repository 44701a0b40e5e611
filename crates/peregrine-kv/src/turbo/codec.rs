//! The TurboQuant codec of KV-cache rows (Zandieh et al., "TurboQuant: online vector
//! quantization with near-optimal distortion rate", 2025).
//!
//! A row `x` of `head_dim = d` values is kept as a norm and Lloyd–Max codes `c` of its randomly
//! rotated direction `u = R x / ||x||`: 3-bit for values, and for keys one of two [`TurboKeys`]
//! forms of the same size:
//! - [`TurboKeys::Mse`] (the default): 4-bit codes, the paper's TurboQuant_mse at b = 4, with an
//!   error variance of about `D₄/d·||q||²·||k||²` per score (`D₄` ≈ 0.0095, the codebook's
//!   distortion).
//! - [`TurboKeys::Qjl`] (the paper's TurboQuant_prod): 3-bit codes plus `γ = ||r||` and the
//!   1-bit QJL sketch `sign(S r)` of the residual `r`, which makes the estimate unbiased for
//!   every rotation; scores blend it with the rescaled MSE one by inverse variance
//!   ([`estimator_weights`]), 40-55 % of the paper's error variance, which is still about
//!   twice the 4-bit form's (measured on random rows, `codec_tests.rs`): the sign bit buys
//!   less than a fourth code bit.
//!
//! Values and 4-bit keys store their norm divided by `<u, c>` ([`unbiased`], EDEN's scale):
//! unbiased over the rotation, and exact along the row's own direction.
//!
//! Scores and value sums are computed in the rotated domain straight from the bytes: a query is
//! rotated (and sketched) once per step ([`TurboCodec::prepare_query`]), a value sum rotated back
//! once ([`TurboCodec::finish_values`]).
//!
//! From `d` = 128 on, a key row's `d/32` largest values (`d/16` at 256) are taken out and kept exact
//! (index and f16 value), per row (KVQuant's dense-and-sparse split, with no calibration): a few
//! channels of some models' keys are far larger than the rest, and the codec's error grows with
//! the norm of what it quantizes. Their exact `q_i k_i` joins the score estimate.
//!
//! Key row: `||k||` f16, then `d/2` bytes of 4-bit codes ([`TurboKeys::Mse`]: code `j` of each
//! 8 at bits `4j..4j+4` of their little-endian `u32`) or `γ` f16, `3d/8` bytes of 3-bit codes
//! and `d/8` bytes of signs ([`TurboKeys::Qjl`]), then its outliers, each an index (u8 up to
//! d = 256, else u16) and an f16 value (4.25 bits/dim at d = 64, which has none, 4.875 at 128,
//! 5.56 at 256; the QJL form 2 bytes more). Value row: `||v||` f16, `3d/8` bytes of codes
//! (3.125 bits/dim). A norm's sign bit marks a row stored as its difference from a caller's mean
//! ([`TurboCodec::encode_key_near`]). Every 8 3-bit codes fill 3 bytes, code `j` at bits
//! `3j..3j+3` of their little-endian 24-bit integer; sign `i` is bit `i % 8` of byte `i / 8`,
//! set for `(S r)_i >= 0`. All-zero bytes decode to a zero row.

use half::f16;
use peregrine_tensor::Result;

use super::codebook::{codebook, codebook16, estimator_weights};

/// Largest supported head dimension (the encoders' stack scratch is this long).
const MAX_DIM: usize = 1024;

/// How a [`TurboCodec`] codes key rows (both about 4 bits per value and an f16 norm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TurboKeys {
    /// 4-bit Lloyd–Max codes, scores rescaled to be unbiased over the rotation.
    #[default]
    Mse,
    /// 3-bit codes and the 1-bit QJL sketch of their residual, as the paper's keys.
    Qjl,
}

/// One layer's codec: its seeded rotation (and QJL sketch), and the codebooks of its `head_dim`.
#[derive(Debug, Clone)]
pub struct TurboCodec {
    dim: usize,
    keys: TurboKeys,
    /// The random ±1 diagonal of the rotation, already divided by `sqrt(d)`.
    signs: Vec<f32>,
    /// `S`: `d × d` i.i.d. N(0, 1), row-major ([`TurboKeys::Qjl`] only, else empty).
    sketch: Vec<f32>,
    /// The 16 key levels of [`TurboKeys::Mse`] and their cells' edges.
    key_centroids: [f32; 16],
    key_bounds: [f32; 15],
    centroids: [f32; 8],
    /// Weights of the MSE and QJL parts of a score estimate (see [`estimator_weights`]).
    mse_weight: f32,
    qjl_weight: f32,
    /// Midpoints of neighbouring centroids: the nearest-centroid cells' edges.
    bounds: [f32; 7],
    /// Whether the AVX2+FMA kernels run (detected once, at construction).
    simd: bool,
}

/// A query rotated and sketched for one step; [`TurboCodec::prepare_query`] refills it in place.
#[derive(Debug, Clone, Default)]
pub struct PreparedQuery {
    /// `q` as given, for the keys' exact outliers.
    plain: Vec<f32>,
    rotated: Vec<f32>,
    projected: Vec<f32>,
    projected_sum: f32,
    /// `<q, mean>`, added to the score of every row stored centred (see
    /// [`PreparedQuery::set_centred_offset`]).
    centred: f32,
}

impl PreparedQuery {
    /// Sets `<q, mean>` for a caller whose key rows were stored as their difference from
    /// `mean` ([`TurboCodec::encode_key_near`]): scores of those rows add it (0 after
    /// [`TurboCodec::prepare_query`]).
    pub fn set_centred_offset(&mut self, offset: f32) {
        self.centred = offset;
    }

    /// What a key row stored centred adds to its score (before the scale).
    #[inline]
    fn offset(&self, key: &[u8]) -> f32 {
        if TurboCodec::is_centered(key) {
            self.centred
        } else {
            0.0
        }
    }

    /// `q' = R q`.
    pub fn rotated(&self) -> &[f32] {
        &self.rotated
    }

    /// `t = S q'`.
    pub fn projected(&self) -> &[f32] {
        &self.projected
    }
}

impl TurboCodec {
    /// The codec of `head_dim` (a power of two in 16..=1024) coding keys as `keys`, whose
    /// rotation and sketch are drawn from `seed`: the same seed gives the same codec.
    pub fn new(head_dim: usize, seed: u64, keys: TurboKeys) -> Result<Self> {
        if !head_dim.is_power_of_two() || !(16..=MAX_DIM).contains(&head_dim) {
            peregrine_tensor::candle::bail!(
                "TurboQuant needs a power of two head_dim in 16..={MAX_DIM}, got {head_dim}"
            )
        }
        let d = head_dim;
        let mut rng = SplitMix64(seed);
        let unit = 1.0 / (d as f32).sqrt();
        let signs = (0..d).map(|_| unit - 2.0 * unit * (rng.next_u64() >> 63) as f32);
        let signs = signs.collect();
        let mut sketch = vec![0.0; if keys == TurboKeys::Qjl { d * d } else { 0 }];
        rng.fill_normal(&mut sketch);
        let (centroids, distortion) = codebook(d);
        let (mse_weight, qjl_weight) = estimator_weights(distortion);
        let (key_centroids, _) = codebook16(d);
        Ok(Self {
            dim: d,
            keys,
            signs,
            sketch,
            key_centroids,
            key_bounds: std::array::from_fn(|i| 0.5 * (key_centroids[i] + key_centroids[i + 1])),
            centroids,
            mse_weight,
            qjl_weight,
            bounds: std::array::from_fn(|i| 0.5 * (centroids[i] + centroids[i + 1])),
            simd: simd_available(),
        })
    }

    /// The row length `d`.
    pub fn head_dim(&self) -> usize {
        self.dim
    }

    /// Bytes of one key row: its header, `d/2` bytes of codes (and signs), then its outliers'.
    pub fn key_bytes(&self) -> usize {
        self.key_header() + self.dim / 2 + self.outliers() * self.outlier_bytes()
    }

    /// `||k||`, and `γ` for [`TurboKeys::Qjl`].
    pub(super) fn key_header(&self) -> usize {
        match self.keys {
            TurboKeys::Mse => 2,
            TurboKeys::Qjl => 4,
        }
    }

    /// Values of a key row kept exact: `d / 32` from `d` = 128 on, `d / 16` at `d` = 256
    /// (Gemma 3's keys: mean KL against f32 0.021 with none, 0.013 with d/64, 0.009 with d/32,
    /// 0.008 with d/16, and top-1 agreement 0.935 with d/32, 0.950 with d/16, before the
    /// vectorised softmax moved every run's last bits; 0.940 with d/16 after). Each costs 3
    /// bytes (4 past `d` = 256); d/16 leaves a `d` = 256 row pair 3.71× smaller than f16 (4-bit keys), while
    /// at 128 (3.66×) and 512 (3.53×) the hot window and allocation slack would take the cache
    /// under 3.5×. None at smaller `d`, for the same reason.
    pub fn outliers(&self) -> usize {
        match self.dim {
            256 => 16,
            d if d >= 128 => d / 32,
            _ => 0,
        }
    }

    /// An outlier's index (one byte up to `d` = 256, else two) and f16 value.
    fn outlier_bytes(&self) -> usize {
        self.index_bytes() + 2
    }

    fn index_bytes(&self) -> usize {
        if self.dim <= 256 { 1 } else { 2 }
    }

    /// Outlier `pair`'s `(index, value)`.
    fn outlier(&self, pair: &[u8]) -> (usize, f32) {
        let (index, value) = pair.split_at(self.index_bytes());
        let index = match index {
            [i] => usize::from(*i),
            [lo, hi, ..] => usize::from(u16::from_le_bytes([*lo, *hi])),
            [] => 0,
        };
        (index, f16::from_le_bytes([value[0], value[1]]).to_f32())
    }

    /// Bytes of one value row: `2 + 3d/8`.
    pub fn value_bytes(&self) -> usize {
        2 + 3 * self.dim / 8
    }

    /// The 8 centroids of one rotated unit-vector coordinate, ascending.
    pub fn centroids(&self) -> &[f32; 8] {
        &self.centroids
    }

    /// Encodes the contiguous value rows `v` (`rows · d`) into `out` (`rows · value_bytes`).
    pub fn encode_values(&self, v: &[f32], out: &mut [u8]) {
        let (d, vb) = (self.dim, self.value_bytes());
        assert!(
            v.len().is_multiple_of(d) && out.len() == v.len() / d * vb,
            "rows vs bytes"
        );
        let mut scratch = [0f32; MAX_DIM];
        for (v, out) in v.chunks_exact(d).zip(out.chunks_exact_mut(vb)) {
            out.fill(0);
            if let Some(n) = self.direction(v, &mut scratch[..d]) {
                let aligned = self.pack3(&mut scratch[..d], &mut out[2..]);
                out[..2].copy_from_slice(&f16::from_f32(unbiased(n, aligned)).to_le_bytes());
            }
        }
    }

    /// Writes the rotated direction `R x / ||x||` into `u` and returns `||x||`; `None` for a
    /// zero row.
    pub(super) fn direction(&self, x: &[f32], u: &mut [f32]) -> Option<f32> {
        let n = dot(x, x).sqrt();
        if n == 0.0 {
            return None;
        }
        for (u, x) in u.iter_mut().zip(x) {
            *u = x / n;
        }
        self.rotate(u);
        Some(n)
    }

    /// Packs the 3-bit codes `c` of the rotated direction `u` into `codes`, leaves the
    /// quantization residual in `u` and returns `<u, c>`.
    pub(super) fn pack3(&self, u: &mut [f32], codes: &mut [u8]) -> f32 {
        let mut aligned = 0.0;
        for (u8s, c3) in u.chunks_exact_mut(8).zip(codes.chunks_exact_mut(3)) {
            let mut packed = 0u32;
            for (j, x) in u8s.iter_mut().enumerate() {
                // Cells are sorted: the nearest centroid's index is the number of edges below.
                let code = self.bounds.iter().filter(|&&b| *x > b).count();
                aligned += *x * self.centroids[code];
                *x -= self.centroids[code];
                packed |= (code as u32) << (3 * j);
            }
            c3.copy_from_slice(&packed.to_le_bytes()[..3]);
        }
        aligned
    }

    /// Encodes one value row `v` as [`encode_values`](Self::encode_values) does, or `v − mean`
    /// when that is shorter, marked as [`encode_key_near`](Self::encode_key_near) marks keys; a
    /// caller adds a marked row's weight times `mean` to the value sum.
    pub fn encode_value_near(&self, v: &[f32], mean: &[f32], out: &mut [u8]) {
        self.encode_near(v, mean, out, Self::encode_values)
    }

    /// `encode(x)` or, marked, `encode(x − mean)`: whichever row is shorter.
    fn encode_near(
        &self,
        x: &[f32],
        mean: &[f32],
        out: &mut [u8],
        encode: fn(&Self, &[f32], &mut [u8]),
    ) {
        let d = self.dim;
        assert!(x.len() == d && mean.len() == d, "one row");
        let mut centered = [0f32; MAX_DIM];
        let centered = &mut centered[..d];
        centered
            .iter_mut()
            .zip(x.iter().zip(mean))
            .for_each(|(c, (x, m))| *c = x - m);
        if dot(centered, centered) < dot(x, x) {
            encode(self, centered, out);
            out[1] |= 0x80;
        } else {
            encode(self, x, out);
        }
    }

    /// `acc += Σ_j p_j · ||v_j|| · c_j` over the `p.len()` contiguous value rows `values`, in the
    /// rotated domain: [`finish_values`](Self::finish_values) turns `acc` (`d`) into `Σ p_j v̂_j`.
    pub fn accumulate_values(&self, p: &[f32], values: &[u8], acc: &mut [f32]) {
        self.accumulate_values_grouped(p, values, acc)
    }

    /// [`accumulate_values`](Self::accumulate_values) for several query heads over the same
    /// value rows, each row unpacked once: `p` holds one row of weights per head and `accs`
    /// one accumulator of `d` per head.
    pub fn accumulate_values_grouped(&self, p: &[f32], values: &[u8], accs: &mut [f32]) {
        let (d, vb) = (self.dim, self.value_bytes());
        let n = values.len() / vb;
        assert!(accs.len().is_multiple_of(d), "accumulator length");
        let heads = accs.len() / d;
        assert_eq!(values.len(), n * vb, "whole value rows");
        assert_eq!(p.len(), n * heads, "one weight per head and row");
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            for (p, accs) in p.chunks(4 * n.max(1)).zip(accs.chunks_mut(4 * d)) {
                // SAFETY: `simd` is set only where AVX2 and FMA were detected; lengths checked.
                unsafe {
                    match accs.len() / d {
                        1 => x86::accumulate_values::<1>(self, p, values, accs),
                        2 => x86::accumulate_values::<2>(self, p, values, accs),
                        3 => x86::accumulate_values::<3>(self, p, values, accs),
                        _ => x86::accumulate_values::<4>(self, p, values, accs),
                    }
                }
            }
            return;
        }
        for (p, acc) in p.chunks_exact(n.max(1)).zip(accs.chunks_exact_mut(d)) {
            for (row, &pj) in values.chunks_exact(vb).zip(p) {
                let coef = pj * f16::from_le_bytes([row[0], row[1] & 0x7f]).to_f32();
                for (a8, c3) in acc.chunks_exact_mut(8).zip(row[2..].chunks_exact(3)) {
                    a8.iter_mut()
                        .zip(self.levels(c3))
                        .for_each(|(a, c)| *a += coef * c);
                }
            }
        }
    }

    /// Rotates an [`accumulate_values`](Self::accumulate_values) sum back: `acc ← R⁻¹ acc`.
    pub fn finish_values(&self, acc: &mut [f32]) {
        assert_eq!(acc.len(), self.dim, "accumulator length");
        self.unrotate(acc);
    }

    /// One value row, `||v|| · R⁻¹ c`.
    pub fn decode_value(&self, value: &[u8], out: &mut [f32]) {
        assert_eq!(value.len(), self.value_bytes(), "value row bytes");
        self.decode([value[0], value[1] & 0x7f], &value[2..], out);
    }

    fn decode(&self, norm: [u8; 2], codes: &[u8], out: &mut [f32]) {
        assert_eq!(out.len(), self.dim, "decoded row length");
        let n = f16::from_le_bytes(norm).to_f32();
        for (o8, c3) in out.chunks_exact_mut(8).zip(codes.chunks_exact(3)) {
            o8.iter_mut()
                .zip(self.levels(c3))
                .for_each(|(o, c)| *o = n * c);
        }
        self.unrotate(out);
    }

    /// The centroids of the 8 codes packed in 3 bytes.
    fn levels(&self, c3: &[u8]) -> [f32; 8] {
        let packed = u24(c3);
        std::array::from_fn(|j| self.centroids[(packed >> (3 * j)) as usize & 7])
    }

    /// `x ← R x = H (D x) / sqrt(d)`.
    fn rotate(&self, x: &mut [f32]) {
        for (x, s) in x.iter_mut().zip(&self.signs) {
            *x *= s;
        }
        fwht(x);
    }

    /// `y ← R⁻¹ y = D (H y) / sqrt(d)`.
    fn unrotate(&self, y: &mut [f32]) {
        fwht(y);
        for (y, s) in y.iter_mut().zip(&self.signs) {
            *y *= s;
        }
    }
}

/// The norm a row of norm `n` is stored with when its codes `c` reconstruct its direction `u`
/// with `<u, c> = aligned`: `n / <u, c>` (EDEN's scale, Vargaftik et al. 2022). Over random
/// rotations `R⁻¹ c / <u, c>` is an unbiased estimate of `u` (plain `c` shrinks it by `1 − D`
/// on average), and exact along `u` itself: a query aligned with the row, whose score weighs
/// most, reads it without the per-row error of a fixed `1 / (1 − D)`.
pub(super) fn unbiased(n: f32, aligned: f32) -> f32 {
    // `<u, c>` is near `1 − D` (0.97-0.99); the guard only keeps a degenerate row finite.
    if aligned > 0.5 { n / aligned } else { n }
}

/// The unnormalized Walsh–Hadamard transform in place (`x.len()` a power of two).
fn fwht(x: &mut [f32]) {
    let mut h = 1;
    while h < x.len() {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
}

/// `<a, b>` over 8 lanes, so that it vectorizes (`a.len()` a multiple of 8).
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for (a, b) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for ((l, x), y) in lanes.iter_mut().zip(a).zip(b) {
            *l += x * y;
        }
    }
    lanes.iter().sum()
}

/// The little-endian 24-bit integer of 3 bytes.
fn u24(b: &[u8]) -> u32 {
    u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// splitmix64: small, seedable, and good enough for random signs and Gaussians.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: never 0, so its logarithm is finite.
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Fills `out` with i.i.d. N(0, 1) (Box–Muller, two per pair of uniforms).
    fn fill_normal(&mut self, out: &mut [f32]) {
        for pair in out.chunks_mut(2) {
            let r = (-2.0 * self.uniform().ln()).sqrt();
            let (sin, cos) = (std::f64::consts::TAU * self.uniform()).sin_cos();
            pair[0] = (r * cos) as f32;
            if let Some(x) = pair.get_mut(1) {
                *x = (r * sin) as f32;
            }
        }
    }
}

#[path = "codec_keys.rs"]
mod keys;

#[cfg(target_arch = "x86_64")]
#[path = "codec_x86.rs"]
mod x86;

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
