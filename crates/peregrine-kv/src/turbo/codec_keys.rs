//! The key side of [`TurboCodec`]: encoding key rows in either [`TurboKeys`] form, their exact
//! outliers, and scores estimated straight from the bytes.

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{MAX_DIM, PreparedQuery, TurboCodec, TurboKeys, dot, unbiased};

impl TurboCodec {
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
            let (head, tail) = out.split_at_mut(self.key_header());
            let (codes, sparse) = tail.split_at_mut(d / 2);
            rest.copy_from_slice(k);
            self.take_outliers(rest, sparse);
            let Some(n) = self.direction(rest, r) else {
                continue;
            };
            let norm = |n: f32| f16::from_f32(n).to_le_bytes();
            match self.keys {
                TurboKeys::Mse => head.copy_from_slice(&norm(unbiased(n, self.pack4(r, codes)))),
                TurboKeys::Qjl => {
                    // The blend's weights take the MSE part's shrinkage out on average.
                    head[..2].copy_from_slice(&norm(n));
                    let (codes, signs) = codes.split_at_mut(3 * d / 8);
                    self.pack3(r, codes);
                    for (i, row) in self.sketch.chunks_exact(d).enumerate() {
                        signs[i / 8] |= u8::from(dot(row, r) >= 0.0) << (i % 8);
                    }
                    head[2..].copy_from_slice(&f16::from_f32(dot(r, r).sqrt()).to_le_bytes());
                }
            }
        }
    }

    /// Packs the 4-bit codes `c` of the rotated direction `u` into `codes` (`d/2` bytes: code
    /// `j` of each 8 at bits `4j..4j+4` of their little-endian `u32`) and returns `<u, c>`.
    fn pack4(&self, u: &[f32], codes: &mut [u8]) -> f32 {
        let mut aligned = 0.0;
        for (u8s, c4) in u.chunks_exact(8).zip(codes.chunks_exact_mut(4)) {
            let mut packed = 0u32;
            for (j, x) in u8s.iter().enumerate() {
                let code = self.key_bounds.iter().filter(|&&b| *x > b).count();
                aligned += x * self.key_centroids[code];
                packed |= (code as u32) << (4 * j);
            }
            c4.copy_from_slice(&packed.to_le_bytes());
        }
        aligned
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
    pub(super) fn outlier_dot(&self, q: &[f32], key: &[u8]) -> f32 {
        if self.outliers() == 0 {
            return 0.0; // small head dims keep none: no work per key
        }
        (key[self.key_header() + self.dim / 2..].chunks_exact(self.outlier_bytes()))
            .map(|pair| {
                let (i, value) = self.outlier(pair);
                q[i] * value
            })
            .sum()
    }

    /// Encodes one key row `k` (`d`) as [`encode_keys`](Self::encode_keys) does, or `k − mean`
    /// when that is shorter, marked so (the sign bit of its norm, read by
    /// [`is_centered`](Self::is_centered)); a caller sets `<q, mean>` on its queries
    /// ([`PreparedQuery::set_centred_offset`]) and the scores add it to marked rows.
    pub fn encode_key_near(&self, k: &[f32], mean: &[f32], out: &mut [u8]) {
        self.encode_near(k, mean, out, Self::encode_keys)
    }

    /// Whether key row `key` holds its row minus a mean ([`encode_key_near`](Self::encode_key_near)).
    pub fn is_centered(key: &[u8]) -> bool {
        key[1] & 0x80 != 0
    }

    /// Rotates, and for [`TurboKeys::Qjl`] sketches, the query row `q` (`d`) into `out`,
    /// reusing its allocations.
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
        out.centred = 0.0;
    }

    /// `out[j] = scale · <q, k_j>` estimated from the `out.len()` contiguous key rows `keys`
    /// (plus `<q, mean>` where row `j` is stored centred and the query has that offset set).
    pub fn scores(&self, q: &PreparedQuery, keys: &[u8], scale: f32, out: &mut [f32]) {
        self.scores_grouped(std::slice::from_ref(q), keys, scale, out)
    }

    /// [`scores`](Self::scores) of several query heads over the same key rows (grouped-query
    /// attention), each row unpacked once: `out` holds `qs.len()` rows of one score per key.
    pub fn scores_grouped(&self, qs: &[PreparedQuery], keys: &[u8], scale: f32, out: &mut [f32]) {
        let d = self.dim;
        let sketched = if self.keys == TurboKeys::Qjl { d } else { 0 };
        assert!(
            (qs.iter()).all(|q| q.rotated.len() == d && q.projected.len() == sketched),
            "query of another head_dim or codec"
        );
        let n = keys.len() / self.key_bytes();
        assert_eq!(keys.len(), n * self.key_bytes(), "whole key rows");
        assert_eq!(out.len(), n * qs.len(), "one score per query and key");
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            for (qs, out) in qs.chunks(4).zip(out.chunks_mut(4 * n)) {
                // SAFETY: `simd` is set only where AVX2 and FMA were detected; lengths checked.
                unsafe {
                    match (self.keys, qs.len()) {
                        (TurboKeys::Mse, 1) => x86::scores_mse::<1>(self, qs, keys, scale, out),
                        (TurboKeys::Mse, 2) => x86::scores_mse::<2>(self, qs, keys, scale, out),
                        (TurboKeys::Mse, 3) => x86::scores_mse::<3>(self, qs, keys, scale, out),
                        (TurboKeys::Mse, _) => x86::scores_mse::<4>(self, qs, keys, scale, out),
                        (TurboKeys::Qjl, 1) => x86::scores::<1>(self, qs, keys, scale, out),
                        (TurboKeys::Qjl, 2) => x86::scores::<2>(self, qs, keys, scale, out),
                        (TurboKeys::Qjl, 3) => x86::scores::<3>(self, qs, keys, scale, out),
                        (TurboKeys::Qjl, _) => x86::scores::<4>(self, qs, keys, scale, out),
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
            let exact = self.outlier_dot(&q.plain, key);
            if self.keys == TurboKeys::Mse {
                let levels = codes.chunks_exact(4).flat_map(|c4| self.key_levels(c4));
                let mse: f32 = q.rotated.iter().zip(levels).map(|(x, c)| x * c).sum();
                *o = scale * (n * mse + exact + q.offset(key));
                continue;
            }
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
            *o = scale * (self.estimate(q, n, gamma, mse, pos) + exact + q.offset(key));
        }
    }

    /// `n · (a <q', c> + b sqrt(π/2)/d · γ · <t, s±>)`, with `<t, s±> = 2 Σ_{s=+1} t − Σ t`
    /// and `(a, b)` the [`estimator_weights`](super::super::codebook::estimator_weights).
    fn estimate(&self, q: &PreparedQuery, n: f32, gamma: f32, mse: f32, pos: f32) -> f32 {
        let qjl = self.qjl_weight * (std::f32::consts::FRAC_PI_2).sqrt() / self.dim as f32;
        n * (self.mse_weight * mse + qjl * gamma * (2.0 * pos - q.projected_sum))
    }

    /// `(||k||, γ, codes, signs)` of one key row: for [`TurboKeys::Mse`] `γ` is 0, the codes
    /// are `d/2` bytes of 4-bit ones and there are no signs.
    #[inline]
    pub(super) fn key_parts<'a>(&self, key: &'a [u8]) -> (f32, f32, &'a [u8], &'a [u8]) {
        let n = f16::from_le_bytes([key[0], key[1] & 0x7f]).to_f32();
        let d = self.dim;
        match self.keys {
            TurboKeys::Mse => (n, 0.0, &key[2..2 + d / 2], &[]),
            TurboKeys::Qjl => {
                let gamma = f16::from_le_bytes([key[2], key[3]]).to_f32();
                let (codes, rest) = key[4..].split_at(3 * d / 8);
                (n, gamma, codes, &rest[..d / 8])
            }
        }
    }

    /// The (not rescaled) key centroids of the 8 codes packed in 4 bytes.
    fn key_levels(&self, c4: &[u8]) -> [f32; 8] {
        let packed = u32::from_le_bytes([c4[0], c4[1], c4[2], c4[3]]);
        std::array::from_fn(|j| self.key_centroids[(packed >> (4 * j)) as usize & 15])
    }

    /// The reconstruction of one key row, its stored norm times `R⁻¹ c` (`||k|| / <u, c>` for
    /// [`TurboKeys::Mse`], plain `||k||` for [`TurboKeys::Qjl`], whose sketch is ignored), with
    /// its exact outliers in their places.
    pub fn decode_key_mse(&self, key: &[u8], out: &mut [f32]) {
        assert_eq!(key.len(), self.key_bytes(), "key row bytes");
        assert_eq!(out.len(), self.dim, "decoded row length");
        let (n, _, codes, _) = self.key_parts(key);
        for (c, o8) in out.chunks_exact_mut(8).enumerate() {
            let levels = match self.keys {
                TurboKeys::Mse => self.key_levels(&codes[4 * c..]),
                TurboKeys::Qjl => self.levels(&codes[3 * c..]),
            };
            o8.iter_mut().zip(levels).for_each(|(o, l)| *o = n * l);
        }
        self.unrotate(out);
        for pair in key[self.key_header() + self.dim / 2..].chunks_exact(self.outlier_bytes()) {
            let (i, value) = self.outlier(pair);
            out[i] += value;
        }
    }
}
