//! Per-channel key scales fitted to the queries that read a layer.
//!
//! A compressed key's score error is isotropic in the rotated domain, so its variance is
//! `D/d · ||q||² · ||k||²`: every channel of the query multiplies the error of the whole key.
//! Queries and keys rarely put their energy in the same channels (Gemma 3's keys carry most of
//! theirs in the slowest RoPE pairs, its queries little there). Encoding `s ⊙ k` and scoring
//! it with `q / s` leaves `<q, k>` unchanged and the error variance `||q/s||² · ||s ⊙ k||²`,
//! which `s_c² = rms(q_c) / rms(k_c)` minimises (Cauchy–Schwarz): on Gemma 3 270M's global
//! layers it halves the score error (docs/benchmarks.md).
//!
//! The query statistics come from the first [`COUNTED`] positions (noted as their queries
//! arrive, before their keys), the key statistics from the positions before the threshold:
//! a function of those positions alone, so chunking and rollback give the same scales.

use half::f16;

/// Queries of positions `0..COUNTED` (or the threshold, if lower) make the statistics.
pub(super) const COUNTED: usize = 512;

/// The largest ratio between a channel's scale and the scales' geometric mean, either way:
/// a channel no query read before the threshold keeps a fair share of the codec's precision.
const MAX_SPREAD: f64 = 4.0;

/// The query statistics and, once settled, the scales of one layer's kv heads.
#[derive(Debug, Clone, Default)]
pub(super) struct KeyScales {
    /// `[position][kv head][d]`: each channel's RMS over the kv head's query heads, for
    /// positions `0..noted`; dropped by [`freeze`](Self::freeze).
    table: Vec<f16>,
    noted: usize,
    frozen: bool,
    /// `[kv head][d]`: `s`, which multiplies keys before encoding; empty while unsettled.
    keys: Vec<f32>,
    /// `[kv head][d]`: `1 / s`, which multiplies queries.
    queries: Vec<f32>,
}

impl KeyScales {
    /// Whether the queries of position `p` count.
    pub(super) fn wants(&self, p: usize, limit: usize) -> bool {
        !self.frozen && p < COUNTED.min(limit) && p <= self.noted
    }

    /// Notes queries `q` (`[heads][n][d]`) of positions `start..start + n`, grouped `heads /
    /// kv_heads` per kv head, up to position `limit`. Positions must follow the noted ones
    /// (a gap leaves the rest unnoted: fewer statistics, the same result everywhere).
    pub(super) fn note(&mut self, start: usize, q: &[f32], shape: [usize; 4], limit: usize) {
        let [heads, n, d, kv_heads] = shape;
        if !self.wants(start, limit) {
            return;
        }
        let (groups, end) = (heads / kv_heads, (start + n).min(COUNTED.min(limit)));
        self.table.truncate(start * kv_heads * d);
        for i in 0..end - start {
            for h in 0..kv_heads {
                for c in 0..d {
                    let sum: f32 = (0..groups)
                        .map(|g| q[((h * groups + g) * n + i) * d + c].powi(2))
                        .sum();
                    self.table.push(f16::from_f32((sum / groups as f32).sqrt()));
                }
            }
        }
        self.noted = end;
    }

    /// Forgets the queries of positions from `len` on, and the scales if they counted keys
    /// from there (`len` below `threshold`).
    pub(super) fn trim(&mut self, len: usize, threshold: usize) {
        self.noted = self.noted.min(len);
        if len < threshold {
            self.keys.clear();
            self.queries.clear();
        }
    }

    /// Whether the scales are set (they stay set until a trim below the threshold).
    pub(super) fn settled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Sets the scales from `key_ms` (`[kv head][d]`: each key channel's variance) and the
    /// noted queries; with none noted, every scale is 1.
    pub(super) fn settle(&mut self, key_ms: &[f64], d: usize) {
        let kv_heads = key_ms.len() / d;
        let mut query_ms = vec![0f64; key_ms.len()];
        for row in self.table[..self.noted * kv_heads * d].chunks_exact(key_ms.len()) {
            query_ms.iter_mut().zip(row).for_each(|(m, x)| {
                *m += f64::from(x.to_f32()).powi(2);
            });
        }
        self.keys.clear();
        for (q, k) in query_ms.chunks_exact(d).zip(key_ms.chunks_exact(d)) {
            // Channels either side never read or never written keep the geometric mean.
            let ratio = |c: usize| match q[c] > 0.0 && k[c] > 0.0 {
                true => Some((q[c] / self.noted as f64).sqrt() / k[c].sqrt()),
                false => None,
            };
            let logs: Vec<f64> = (0..d).filter_map(ratio).map(f64::ln).collect();
            let centre = logs.iter().sum::<f64>() / logs.len().max(1) as f64;
            let spread = MAX_SPREAD * MAX_SPREAD;
            self.keys.extend((0..d).map(|c| {
                let r = ratio(c).map_or(1.0, |r| (r.ln() - centre).exp());
                r.clamp(1.0 / spread, spread).sqrt() as f32
            }));
        }
        self.queries = self.keys.iter().map(|s| 1.0 / s).collect();
    }

    /// Drops the query statistics once no rollback can reach the positions they count.
    pub(super) fn freeze(&mut self) {
        self.frozen = true;
        self.table = Vec::new();
    }

    /// Head `h`'s key scales and query scales (empty while unsettled).
    pub(super) fn of(&self, h: usize, d: usize) -> (&[f32], &[f32]) {
        match self.settled() {
            true => (&self.keys[h * d..][..d], &self.queries[h * d..][..d]),
            false => (&[], &[]),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        size_of_val(&self.table[..]) + size_of_val(&self.keys[..]) + size_of_val(&self.queries[..])
    }
}
