//! The per-request sampler: penalties, temperature, top-k, top-p, min-p, then a seeded draw.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::params::SamplingParams;
use crate::rng::Rng;

/// Above this `top_k` a linear-time selection beats a bounded heap.
const HEAP_TOP_K_MAX: usize = 256;
/// First nucleus guess for top-p: real nuclei are usually far smaller than the vocabulary.
const NUCLEUS_FIRST_GUESS: usize = 64;
/// Growth factor of the nucleus guess when the mass falls short.
const NUCLEUS_GROWTH: usize = 8;

/// A candidate token: id and a score that orders tokens by likelihood (a temperature-scaled logit
/// relative to the maximum, later its weight `exp(score)`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cand(pub u32, pub f32);

impl Cand {
    /// Most likely first; ties by lower id, so every ordering is deterministic.
    pub(crate) fn desc(a: &Cand, b: &Cand) -> Ordering {
        b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
    }
}

/// Replaces `out` with the `k` most likely of `items` (in no particular order), in linear time
/// and without sorting; `k == 0` or `k >= len` keeps everything.
pub(crate) fn top_k_into(items: impl Iterator<Item = Cand>, k: usize, out: &mut Vec<Cand>) {
    out.clear();
    if k > 0 && k <= HEAP_TOP_K_MAX {
        // A bounded min-heap: one pass, and most tokens lose a single comparison.
        let mut heap = BinaryHeap::with_capacity(k + 1);
        for c in items {
            if heap.len() < k {
                heap.push(Reverse(c));
            } else if heap.peek().is_some_and(|Reverse(min)| c > *min) {
                heap.pop();
                heap.push(Reverse(c));
            }
        }
        out.extend(heap.into_iter().map(|Reverse(c)| c));
    } else {
        out.extend(items);
        if k > 0 && k < out.len() {
            out.select_nth_unstable_by(k - 1, Cand::desc);
            out.truncate(k);
        }
    }
}

impl PartialEq for Cand {
    fn eq(&self, other: &Self) -> bool {
        Cand::desc(self, other) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Cand {
    /// "Greater" means more likely, so `Reverse<Cand>` in a max-heap keeps the least likely on top.
    fn cmp(&self, other: &Self) -> Ordering {
        Cand::desc(other, self)
    }
}

/// Index of the largest logit; the first one on ties, NaN ignored, `0` when there is none.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_val = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_val {
            best = i;
            best_val = l;
        }
    }
    best as u32
}

/// Turns one position's logits into a token id for one request, keeping its generator and the
/// scratch buffers between steps so the hot path does not allocate.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Per-token stamp of the last call that penalised it: deduplicates without clearing.
    seen: Vec<u32>,
    epoch: u32,
    /// Per-token count of generated occurrences; zero again after every call.
    counts: Vec<u32>,
    cand: Vec<Cand>,
}

impl Sampler {
    /// A sampler for `params`, seeded from `params.seed` or from entropy. Call
    /// [`SamplingParams::validate`] first: out-of-range values are not rejected here.
    pub fn new(params: SamplingParams) -> Self {
        let rng = params
            .seed
            .map_or_else(Rng::from_entropy, Rng::seed_from_u64);
        Self {
            params,
            rng,
            seen: Vec::new(),
            epoch: 0,
            counts: Vec::new(),
            cand: Vec::new(),
        }
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The request's generator, for draws outside [`Sampler::sample`] (speculative verification).
    pub fn rng_mut(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Picks the next token from the logits of one position.
    ///
    /// `logits` is used as scratch: penalties are applied to it in place. `prompt_tokens` and
    /// `generated` feed the penalties; ids outside the vocabulary are ignored. Empty logits give 0.
    pub fn sample(&mut self, logits: &mut [f32], prompt_tokens: &[u32], generated: &[u32]) -> u32 {
        self.apply_penalties(logits, prompt_tokens, generated);
        if self.params.is_greedy() {
            return argmax(logits);
        }
        self.draw(logits)
    }

    /// Repetition (HF), then frequency and presence (OpenAI) penalties, in place.
    fn apply_penalties(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        let n = logits.len();
        let r = self.params.repetition_penalty;
        if r != 1.0 {
            if self.seen.len() < n {
                self.seen.resize(n, 0);
            }
            self.epoch = self.epoch.wrapping_add(1);
            if self.epoch == 0 {
                // The stamp wrapped: old stamps could collide with new ones.
                self.seen.fill(0);
                self.epoch = 1;
            }
            for &t in prompt.iter().chain(generated) {
                let i = t as usize;
                if i < n && self.seen[i] != self.epoch {
                    self.seen[i] = self.epoch;
                    let l = &mut logits[i];
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        let (freq, pres) = (self.params.frequency_penalty, self.params.presence_penalty);
        if freq != 0.0 || pres != 0.0 {
            if self.counts.len() < n {
                self.counts.resize(n, 0);
            }
            for &t in generated {
                if let Some(c) = self.counts.get_mut(t as usize) {
                    *c += 1;
                }
            }
            for &t in generated {
                let i = t as usize;
                // Resetting the count on first use applies each token once and leaves zeros behind.
                if i < n && self.counts[i] > 0 {
                    logits[i] -= self.counts[i] as f32 * freq + pres;
                    self.counts[i] = 0;
                }
            }
        }
    }

    /// Temperature, top-k, top-p, min-p, then a draw proportional to the remaining mass.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let max = logits
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, |m, l| if l > m { l } else { m });
        if !max.is_finite() {
            // Everything masked, or an infinite logit: the distribution is a point mass.
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature;
        let scaled = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| **l > f32::NEG_INFINITY)
            .map(|(i, &l)| Cand(i as u32, (l - max) * inv_t));
        top_k_into(scaled, self.params.top_k, &mut self.cand);
        // From here on scores are weights exp(score): one exp per candidate, the top one is 1.
        let mut total = 0.0f64;
        for c in &mut self.cand {
            c.1 = c.1.exp();
            total += c.1 as f64;
        }
        if self.params.top_p < 1.0 {
            total = nucleus(&mut self.cand, total, self.params.top_p);
        }
        if self.params.min_p > 0.0 {
            // Relative to the top token's weight of 1, so min_p itself is the threshold.
            let min_p = self.params.min_p;
            self.cand.retain(|c| c.1 >= min_p);
            total = self.cand.iter().map(|c| c.1 as f64).sum();
        }
        let mut u = self.rng.next_f64() * total;
        for c in &self.cand {
            u -= c.1 as f64;
            if u < 0.0 {
                return c.0;
            }
        }
        // Rounding left a sliver of mass after the last candidate.
        self.cand.last().map_or_else(|| argmax(logits), |c| c.0)
    }
}

/// Keeps the smallest most-likely prefix of weighted candidates whose mass reaches `top_p` of
/// `total` (HF semantics: the token that crosses the threshold stays), without sorting the whole
/// vocabulary. Returns the kept mass.
fn nucleus(cand: &mut Vec<Cand>, total: f64, top_p: f32) -> f64 {
    let len = cand.len();
    let target = top_p as f64 * total;
    let mut m = len.min(NUCLEUS_FIRST_GUESS);
    loop {
        if m < len {
            cand.select_nth_unstable_by(m - 1, Cand::desc);
        }
        cand[..m].sort_unstable_by(Cand::desc);
        let mut cum = 0.0;
        for i in 0..m {
            cum += cand[i].1 as f64;
            if cum >= target {
                cand.truncate(i + 1);
                return cum;
            }
        }
        if m == len {
            return cum;
        }
        m = len.min(m * NUCLEUS_GROWTH);
    }
}
