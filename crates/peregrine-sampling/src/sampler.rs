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
/// Two passes that vectorise (the largest value per lane, then the first run of lanes holding
/// it): a 262,144-token vocabulary takes a fraction of the scalar scan's time.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let larger = |m: f32, l: f32| if l > m { l } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        lanes
            .iter_mut()
            .zip(c)
            .for_each(|(m, &l)| *m = larger(*m, l));
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &l| larger(m, l));
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let holds = |c: &[f32]| c.iter().fold(false, |any, &l| any | (l == max));
    let run = logits.chunks(LANES).position(holds).unwrap_or(0);
    let at = logits[run * LANES..]
        .iter()
        .position(|&l| l == max)
        .unwrap_or(0);
    (run * LANES + at) as u32
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
        let Some(total) = self.filter(logits) else {
            return argmax(logits);
        };
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

    /// Temperature, top-k, top-p and min-p: leaves the surviving candidates in `self.cand`
    /// with their weights and returns the weights' sum; `None` when the distribution is a
    /// point mass on the argmax (everything masked, or an infinite logit).
    fn filter(&mut self, logits: &[f32]) -> Option<f64> {
        let max = logits
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, |m, l| if l > m { l } else { m });
        if !max.is_finite() {
            return None;
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
        Some(total)
    }

    /// The distribution [`sample`](Self::sample) draws from at this position, into `out`:
    /// penalties applied to `logits` in place as `sample` does, then temperature and the
    /// filters (a point mass on the argmax when greedy). Speculative decoding compares the
    /// target's and the draft's.
    pub fn distribution(
        &mut self,
        logits: &mut [f32],
        prompt_tokens: &[u32],
        generated: &[u32],
        out: &mut Distribution,
    ) {
        self.apply_penalties(logits, prompt_tokens, generated);
        out.probs.clear();
        let total = match self.params.is_greedy() {
            true => None,
            false => self.filter(logits),
        };
        match total {
            Some(total) if total > 0.0 => {
                let inv = 1.0 / total;
                (out.probs).extend(self.cand.iter().map(|c| (c.0, (c.1 as f64 * inv) as f32)));
                out.probs.sort_unstable_by_key(|c| c.0);
            }
            _ => out.probs.push((argmax(logits), 1.0)),
        }
    }

    /// A token drawn from `dist`.
    pub fn draw_from(&mut self, dist: &Distribution) -> u32 {
        let u = self.rng.next_f64();
        dist.pick(u, |_, p| p as f64)
    }

    /// Speculative verification of `token`, drafted from `proposal` (`None`: proposed
    /// deterministically, as prompt lookup does), against the target's distribution at that
    /// position: kept with probability `min(1, p/q)`, otherwise replaced by a draw from the
    /// normalized `max(0, p − q)`. The emitted token is then distributed exactly as `target`
    /// (Leviathan et al., 2023). A point-mass target (greedy) keeps `token` only if it is
    /// the argmax, and draws nothing.
    pub fn verify(
        &mut self,
        target: &Distribution,
        token: u32,
        proposal: Option<&Distribution>,
    ) -> Verdict {
        if let Some(only) = target.point() {
            return match only == token {
                true => Verdict::Accept,
                false => Verdict::Replace(only),
            };
        }
        let q_of = |t: u32| match proposal {
            Some(d) => d.prob(t),
            None => f32::from(t == token),
        };
        let (p, q) = (target.prob(token), q_of(token));
        // q is 0 only for a proposal that did not come from its distribution: treat it as
        // deterministic.
        let ratio = if q > 0.0 {
            p as f64 / q as f64
        } else {
            p as f64
        };
        if self.rng.next_f64() < ratio {
            return Verdict::Accept;
        }
        let residual = |t: u32, p: f32| (p - q_of(t)).max(0.0) as f64;
        let total: f64 = target.probs.iter().map(|&(t, p)| residual(t, p)).sum();
        let u = self.rng.next_f64();
        match total > 0.0 {
            true => Verdict::Replace(target.pick(u, residual)),
            // Rounding left no residual mass (p ≤ q everywhere): p itself is the fallback.
            false => Verdict::Replace(target.pick(u, |_, p| p as f64)),
        }
    }
}

/// A next-token distribution after the sampler's processing: the tokens that can be drawn and
/// their probabilities (summing to 1), by token id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Distribution {
    probs: Vec<(u32, f32)>,
}

impl Distribution {
    /// The tokens that can be drawn and their probabilities, by token id.
    pub fn probs(&self) -> &[(u32, f32)] {
        &self.probs
    }

    /// The probability of `token` (0 outside the support).
    pub fn prob(&self, token: u32) -> f32 {
        (self.probs.binary_search_by_key(&token, |c| c.0)).map_or(0.0, |i| self.probs[i].1)
    }

    /// The only token that can be drawn, for a point mass (greedy).
    pub fn point(&self) -> Option<u32> {
        match self.probs.as_slice() {
            [(t, _)] => Some(*t),
            _ => None,
        }
    }

    /// The token where `u` (uniform in [0, 1)) falls among the weights `w(token, p)`, scaled
    /// to their sum.
    fn pick(&self, u: f64, w: impl Fn(u32, f32) -> f64) -> u32 {
        let total: f64 = self.probs.iter().map(|&(t, p)| w(t, p)).sum();
        let mut left = u * total;
        let mut last = self.probs.first().map_or(0, |c| c.0);
        for &(t, p) in &self.probs {
            let wt = w(t, p);
            if wt > 0.0 {
                last = t;
                left -= wt;
                if left < 0.0 {
                    return t;
                }
            }
        }
        // Rounding left a sliver of mass after the last candidate with weight.
        last
    }
}

/// What speculative verification made of a drafted token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The drafted token stands.
    Accept,
    /// It was rejected; this token takes its place (and drafting restarts after it).
    Replace(u32),
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
