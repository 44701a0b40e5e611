//! The TurboQuant codec of KV-cache rows (Zandieh et al., "TurboQuant: online vector
//! quantization with near-optimal distortion rate", 2025).
//!
//! A row `x` of `head_dim = d` values is kept as `||x||` and the 3-bit Lloyd–Max codes of its
//! randomly rotated direction `R x / ||x||`. A key row also keeps `γ = ||r||` and the 1-bit QJL
//! sketch `sign(S r)` of the quantization residual `r`, which makes the score estimate unbiased;
//! scores blend that estimate with the rescaled MSE one by inverse variance
//! ([`estimator_weights`]), unbiased still and about half as noisy.
//! Scores and value sums are computed in the rotated domain straight from the bytes: a query is
//! rotated and sketched once per step ([`TurboCodec::prepare_query`]), a value sum rotated back
//! once ([`TurboCodec::finish_values`]).
//!
//! From `d` = 128 on, a key row's `d/32` largest values (`d/16` at 256) are taken out and kept exact
//! (index and f16 value), per row (KVQuant's dense-and-sparse split, with no calibration): a few
//! channels of some models' keys are far larger than the rest, and the codec's error grows with
//! the norm of what it quantizes. Their exact `q_i k_i` joins the score estimate.
//!
//! Key row: `||k||` f16, `γ` f16, `3d/8` bytes of codes, `d/8` bytes of signs, then its
//! outliers, each an index (u8 up to d = 256, else u16) and an f16 value (5 bits/dim at d = 128;
//! 5.625 at d = 256; 4.5 at d = 64, which has none). Value row: `||v||` f16, `3d/8` bytes of codes (3.125
//! bits/dim). A norm's sign bit marks a row stored as its difference from a caller's mean
//! ([`TurboCodec::encode_key_near`]). Every 8 codes fill 3 bytes, code `j` at bits `3j..3j+3`
//! of their little-endian 24-bit integer; sign `i` is bit `i % 8` of byte `i / 8`, set for
//! `(S r)_i >= 0`. All-zero bytes decode to a zero row.

use half::f16;
use peregrine_tensor::Result;

use super::codebook::{codebook, estimator_weights};

/// Largest supported head dimension (the encoders' stack scratch is this long).
const MAX_DIM: usize = 1024;

/// One layer's codec: its seeded rotation and QJL sketch, and the codebook of its `head_dim`.
#[derive(Debug, Clone)]
pub struct TurboCodec {
    dim: usize,
    /// The random ±1 diagonal of the rotation, already divided by `sqrt(d)`.
    signs: Vec<f32>,
    /// `S`: `d × d` i.i.d. N(0, 1), row-major.
    sketch: Vec<f32>,
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
}

impl PreparedQuery {
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
    /// The codec of `head_dim` (a power of two in 16..=1024) whose rotation and sketch are drawn
    /// from `seed`: the same seed gives the same codec.
    pub fn new(head_dim: usize, seed: u64) -> Result<Self> {
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
        let mut sketch = vec![0.0; d * d];
        rng.fill_normal(&mut sketch);
        let (centroids, distortion) = codebook(d);
        let (mse_weight, qjl_weight) = estimator_weights(distortion);
        Ok(Self {
            dim: d,
            signs,
            sketch,
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

    /// Bytes of one key row: `4 + 3d/8 + d/8`, then its outliers'.
    pub fn key_bytes(&self) -> usize {
        4 + self.dim / 2 + self.outliers() * self.outlier_bytes()
    }

    /// Values of a key row kept exact: `d / 32` from `d` = 128 on, `d / 16` at `d` = 256
    /// (Gemma 3's keys: mean KL against f32 0.021 with none, 0.013 with d/64, 0.009 with d/32,
    /// 0.008 with d/16, and top-1 agreement 0.935 with d/32, 0.950 with d/16, before the
    /// vectorised softmax moved every run's last bits; 0.940 with d/16 after). Each costs 3
    /// bytes (4 past `d` = 256); d/16 leaves a `d` = 256 row pair 3.68× smaller than f16, while
    /// at 128 (3.61×) and 512 (3.52×) the hot window and allocation slack would take the cache
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

    /// Encodes the contiguous key rows `k` (`rows · d`) into `out` (`rows · key_bytes`).
    pub fn encode_keys(&self, k: &[f32], out: &mut [u8]) {
        let (d, kb) = (self.dim, self.key_bytes());
        assert!(
            k.len().is_multiple_of(d) && out.len() == k.len() / d * kb,
            "rows vs bytes"
        );
        let (mut scratch, mut rest) = ([0f32; MAX_DIM], [0f32; MAX_DIM]);
        let (r, rest) = (&mut scratch[..d], &mut rest[..d]);
        for (k, out) in k.chunks_exact(d).zip(out.chunks_exact_mut(kb)) {
            out.fill(0);
            let (head, tail) = out.split_at_mut(4);
            let (codes, tail) = tail.split_at_mut(3 * d / 8);
            let (signs, sparse) = tail.split_at_mut(d / 8);
            rest.copy_from_slice(k);
            self.take_outliers(rest, sparse);
            let Some(n) = self.quantize(rest, r, codes) else {
                continue;
            };
            for (i, row) in self.sketch.chunks_exact(d).enumerate() {
                signs[i / 8] |= u8::from(dot(row, r) >= 0.0) << (i % 8);
            }
            head[..2].copy_from_slice(&f16::from_f32(n).to_le_bytes());
            head[2..].copy_from_slice(&f16::from_f32(dot(r, r).sqrt()).to_le_bytes());
        }
    }

    /// Moves the [`outliers`](Self::outliers) largest values of `x` by magnitude (the lower
    /// index first among equals) into `sparse` as `(index, f16 value)` pairs in index order,
    /// leaving zeros in their place; a zero value leaves its pair zero bytes.
    fn take_outliers(&self, x: &mut [f32], sparse: &mut [u8]) {
        let mut taken = [0u16; MAX_DIM / 32];
        let taken = &mut taken[..self.outliers()];
        for t in 0..taken.len() {
            let free = |i: &usize| !taken[..t].contains(&(*i as u16));
            let at = (0..x.len())
                .filter(free)
                .fold(None, |best: Option<usize>, i| match best {
                    Some(b) if x[b].abs() >= x[i].abs() => Some(b),
                    _ => Some(i),
                });
            taken[t] = at.unwrap_or(0) as u16;
        }
        taken.sort_unstable();
        let ib = self.index_bytes();
        for (&i, pair) in taken.iter().zip(sparse.chunks_exact_mut(ib + 2)) {
            let value = std::mem::take(&mut x[i as usize]);
            if value != 0.0 {
                pair[..ib].copy_from_slice(&i.to_le_bytes()[..ib]);
                pair[ib..].copy_from_slice(&f16::from_f32(value).to_le_bytes());
            }
        }
    }

    /// `Σ q_i k_i` over a key row's exact outliers.
    #[inline]
    fn outlier_dot(&self, q: &[f32], key: &[u8]) -> f32 {
        if self.outliers() == 0 {
            return 0.0; // small head dims keep none: no work per key
        }
        (key[4 + self.dim / 2..].chunks_exact(self.outlier_bytes()))
            .map(|pair| {
                let (i, value) = self.outlier(pair);
                q[i] * value
            })
            .sum()
    }

    /// Encodes one key row `k` (`d`) as [`encode_keys`](Self::encode_keys) does, or `k − mean`
    /// when that is shorter, marked so (the sign bit of its norm, read by
    /// [`is_centered`](Self::is_centered)); a caller adds `<q, mean>` to a marked row's score.
    pub fn encode_key_near(&self, k: &[f32], mean: &[f32], out: &mut [u8]) {
        self.encode_near(k, mean, out, Self::encode_keys)
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

    /// Whether key row `key` holds its row minus a mean ([`encode_key_near`](Self::encode_key_near)).
    pub fn is_centered(key: &[u8]) -> bool {
        key[1] & 0x80 != 0
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
            if let Some(n) = self.quantize(v, &mut scratch[..d], &mut out[2..]) {
                out[..2].copy_from_slice(&f16::from_f32(n).to_le_bytes());
            }
        }
    }

    /// Packs the codes of `R x / ||x||` into `codes`, leaves the residual in `r` and returns
    /// `||x||`; `None` for a zero row.
    fn quantize(&self, x: &[f32], r: &mut [f32], codes: &mut [u8]) -> Option<f32> {
        let n = dot(x, x).sqrt();
        if n == 0.0 {
            return None;
        }
        for (r, x) in r.iter_mut().zip(x) {
            *r = x / n;
        }
        self.rotate(r);
        for (r8, c3) in r.chunks_exact_mut(8).zip(codes.chunks_exact_mut(3)) {
            let mut packed = 0u32;
            for (j, r) in r8.iter_mut().enumerate() {
                // Cells are sorted: the nearest centroid's index is the number of edges below.
                let code = self.bounds.iter().filter(|&&b| *r > b).count();
                *r -= self.centroids[code];
                packed |= (code as u32) << (3 * j);
            }
            c3.copy_from_slice(&packed.to_le_bytes()[..3]);
        }
        Some(n)
    }

    /// Rotates and sketches the query row `q` (`d`) into `out`, reusing its allocations.
    pub fn prepare_query(&self, q: &[f32], out: &mut PreparedQuery) {
        assert_eq!(q.len(), self.dim, "query row length");
        out.plain.clear();
        out.plain.extend_from_slice(q);
        out.rotated.clear();
        out.rotated.extend_from_slice(q);
        self.rotate(&mut out.rotated);
        out.projected.clear();
        let rows = self.sketch.chunks_exact(self.dim);
        out.projected.extend(rows.map(|row| dot(row, &out.rotated)));
        out.projected_sum = out.projected.iter().sum();
    }

    /// `out[j] = scale · <q, k_j>` estimated from the `out.len()` contiguous key rows `keys`.
    pub fn scores(&self, q: &PreparedQuery, keys: &[u8], scale: f32, out: &mut [f32]) {
        self.scores_grouped(std::slice::from_ref(q), keys, scale, out)
    }

    /// [`scores`](Self::scores) of several query heads over the same key rows (grouped-query
    /// attention), each row unpacked once: `out` holds `qs.len()` rows of one score per key.
    pub fn scores_grouped(&self, qs: &[PreparedQuery], keys: &[u8], scale: f32, out: &mut [f32]) {
        let d = self.dim;
        assert!(
            qs.iter()
                .all(|q| q.rotated.len() == d && q.projected.len() == d),
            "query of another head_dim"
        );
        let n = keys.len() / self.key_bytes();
        assert_eq!(keys.len(), n * self.key_bytes(), "whole key rows");
        assert_eq!(out.len(), n * qs.len(), "one score per query and key");
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            for (qs, out) in qs.chunks(4).zip(out.chunks_mut(4 * n)) {
                // SAFETY: `simd` is set only where AVX2 and FMA were detected; lengths checked.
                unsafe {
                    match qs.len() {
                        1 => x86::scores::<1>(self, qs, keys, scale, out),
                        2 => x86::scores::<2>(self, qs, keys, scale, out),
                        3 => x86::scores::<3>(self, qs, keys, scale, out),
                        _ => x86::scores::<4>(self, qs, keys, scale, out),
                    }
                }
            }
            return;
        }
        for (q, out) in qs.iter().zip(out.chunks_exact_mut(n.max(1))) {
            self.scores_scalar(q, keys, scale, out);
        }
    }

    /// The portable [`scores`](Self::scores).
    fn scores_scalar(&self, q: &PreparedQuery, keys: &[u8], scale: f32, out: &mut [f32]) {
        for (key, o) in keys.chunks_exact(self.key_bytes()).zip(out) {
            let (n, gamma, codes, signs) = self.key_parts(key);
            let mut mse = 0.0;
            for (q8, c3) in q.rotated.chunks_exact(8).zip(codes.chunks_exact(3)) {
                mse += q8
                    .iter()
                    .zip(self.levels(c3))
                    .map(|(x, c)| x * c)
                    .sum::<f32>();
            }
            let mut pos = 0.0;
            for (t8, &b) in q.projected.chunks_exact(8).zip(signs) {
                let set = t8.iter().enumerate().filter(|(j, _)| b >> j & 1 == 1);
                pos += set.map(|(_, t)| t).sum::<f32>();
            }
            let exact = self.outlier_dot(&q.plain, key);
            *o = scale * (self.estimate(q, n, gamma, mse, pos) + exact);
        }
    }

    /// `n · (a <q', c> + b sqrt(π/2)/d · γ · <t, s±>)`, with `<t, s±> = 2 Σ_{s=+1} t − Σ t`
    /// and `(a, b)` the [`estimator_weights`].
    fn estimate(&self, q: &PreparedQuery, n: f32, gamma: f32, mse: f32, pos: f32) -> f32 {
        let qjl = self.qjl_weight * (std::f32::consts::FRAC_PI_2).sqrt() / self.dim as f32;
        n * (self.mse_weight * mse + qjl * gamma * (2.0 * pos - q.projected_sum))
    }

    /// `(||k||, γ, codes, signs)` of one key row.
    fn key_parts<'a>(&self, key: &'a [u8]) -> (f32, f32, &'a [u8], &'a [u8]) {
        let n = f16::from_le_bytes([key[0], key[1] & 0x7f]).to_f32();
        let gamma = f16::from_le_bytes([key[2], key[3]]).to_f32();
        let (codes, rest) = key[4..].split_at(3 * self.dim / 8);
        (n, gamma, codes, &rest[..self.dim / 8])
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

    /// The MSE part of one key row, `||k|| · R⁻¹ c` (the residual's sketch is ignored), with
    /// its exact outliers in their places.
    pub fn decode_key_mse(&self, key: &[u8], out: &mut [f32]) {
        assert_eq!(key.len(), self.key_bytes(), "key row bytes");
        self.decode([key[0], key[1] & 0x7f], &key[4..4 + 3 * self.dim / 8], out);
        for pair in key[4 + self.dim / 2..].chunks_exact(self.outlier_bytes()) {
            let (i, value) = self.outlier(pair);
            out[i] += value;
        }
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

#[cfg(target_arch = "x86_64")]
#[path = "codec_x86.rs"]
mod x86;

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
