//! How many tokens to draft: as many as maximise the expected tokens per second, from what was
//! measured: how far drafts survive verification (a survival curve by position, not a fixed
//! rate: prompt lookup's drafts are either copied spans kept whole or wrong from the start), what
//! a pass verifying `k` drafts costs (a verifying pass runs the batched forward, so even one
//! draft costs more than a plain step), and what drafting a token costs.

/// Rounds between plain (undrafted) steps that re-measure a step's base cost.
const REMEASURE_EVERY: u64 = 32;
/// While drafting is off, rounds between probes at the full length.
const PROBE_EVERY: u64 = 16;
/// Weight of the newest observation in the running means.
const NEWEST: f64 = 0.1;
/// How much older rounds count in the survival counts, per round.
const DECAY: f64 = 0.98;

/// A running mean that weights recent observations most.
#[derive(Debug, Clone, Copy, Default)]
struct Mean(Option<f64>);

impl Mean {
    fn add(&mut self, x: f64) {
        self.0 = Some(self.0.map_or(x, |m| m + NEWEST * (x - m)));
    }
}

/// One sequence's draft length: fixed at the maximum, or adapted to what is measured.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max: usize,
    adaptive: bool,
    rounds: u64,
    /// For each draft position: rounds that verified it, and of those, rejected it there.
    reached: Vec<f64>,
    rejected: Vec<f64>,
    /// Seconds of a pass verifying `k` drafts (index 0: a plain step), and per drafted token.
    pass: Vec<Mean>,
    per_draft: Mean,
    /// The length chosen last, for the log line when drafting turns off or on.
    last: Option<usize>,
}

impl DraftLength {
    /// Up to `max` tokens a round; `adaptive: false` always drafts `max`.
    pub fn new(max: usize, adaptive: bool) -> Self {
        Self {
            max,
            adaptive,
            rounds: 0,
            reached: vec![0.0; max],
            rejected: vec![0.0; max],
            pass: vec![Mean::default(); max + 1],
            per_draft: Mean::default(),
            last: None,
        }
    }

    /// The measured chance that a draft survives to position `i` (0-based) and is kept there.
    /// Each position starts from a hopeful prior (a quarter of a rejection against one keep:
    /// 0.8), since a chain of eight cautious priors would forbid long drafts before any was
    /// measured.
    fn survival(&self) -> Vec<f64> {
        let mut s = 1.0;
        (0..self.max)
            .map(|i| {
                let keep = (self.reached[i] - self.rejected[i] + 1.0) / (self.reached[i] + 1.25);
                s *= keep;
                s
            })
            .collect()
    }

    /// The share of drafted tokens kept at the first position, as measured.
    pub fn acceptance(&self) -> f64 {
        self.survival().first().copied().unwrap_or(0.0)
    }

    /// Tokens to draft this round.
    pub fn choose(&mut self) -> usize {
        self.rounds += 1;
        if !self.adaptive || self.max == 0 {
            return self.max;
        }
        if self.pass[0].0.is_none() || self.rounds.is_multiple_of(REMEASURE_EVERY) {
            return 0; // measure a plain step
        }
        if self.pass[self.max].0.is_none() {
            return self.max; // measure the longest first: shorter ones are interpolated
        }
        let best = self.best();
        if best == 0 && self.rounds.is_multiple_of(PROBE_EVERY) {
            return self.max; // keep measuring while off
        }
        if (self.last == Some(0)) != (best == 0) {
            let a = self.acceptance();
            match best {
                0 => tracing::info!(
                    "speculative decoding paused for a sequence: drafts kept at {a:.2} do not pay for drafting"
                ),
                k => tracing::info!(
                    "speculative decoding resumed for a sequence: {k} tokens a round, first kept at {a:.2}"
                ),
            }
        }
        self.last = Some(best);
        best
    }

    /// The seconds of a pass verifying `k` drafts: measured, or interpolated linearly between
    /// the nearest measured lengths.
    fn pass_secs(&self, k: usize) -> f64 {
        let measured = |k: usize| self.pass[k].0;
        if let Some(t) = measured(k) {
            return t;
        }
        let below = (0..k).rev().find(|&j| measured(j).is_some()).unwrap_or(0);
        let above = (k + 1..=self.max).find(|&j| measured(j).is_some());
        let t0 = measured(below).unwrap_or(0.0);
        match above {
            Some(hi) => {
                let t1 = measured(hi).unwrap_or(t0);
                t0 + (t1 - t0) * (k - below) as f64 / (hi - below) as f64
            }
            None => t0,
        }
    }

    /// The length with the most expected tokens per second.
    fn best(&self) -> usize {
        let survival = self.survival();
        let draft = self.per_draft.0.unwrap_or(0.0);
        let rate = |k: usize| {
            // The kept drafts, then the replacement or bonus token that always comes.
            let tokens = 1.0 + survival[..k].iter().sum::<f64>();
            tokens / (self.pass_secs(k) + k as f64 * draft)
        };
        (0..=self.max)
            .max_by(|&x, &y| rate(x).total_cmp(&rate(y)))
            .unwrap_or(0)
    }

    /// Records a round: `drafted` tokens proposed (taking `draft_secs`; `None`: not a fair
    /// measure), `kept` of them kept, and a forward pass of `step_secs`.
    pub fn record(&mut self, drafted: usize, kept: usize, draft_secs: Option<f64>, step_secs: f64) {
        let drafted = drafted.min(self.max);
        self.pass[drafted].add(step_secs);
        if drafted == 0 {
            return;
        }
        for i in 0..self.max {
            self.reached[i] *= DECAY;
            self.rejected[i] *= DECAY;
        }
        for i in 0..=kept.min(drafted - 1) {
            self.reached[i] += 1.0;
        }
        if kept < drafted {
            self.rejected[kept] += 1.0;
        }
        if let Some(secs) = draft_secs {
            self.per_draft.add(secs / drafted as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs 300 rounds where the `n`th round's drafts are kept for `run(n)` positions, at the
    /// given costs (a verifying pass: `base + fixed + row · k`); returns the lengths chosen.
    fn simulate(run: impl Fn(usize) -> usize, fixed: f64, row: f64, draft: f64) -> Vec<usize> {
        let base = 0.010;
        let mut len = DraftLength::new(8, true);
        let mut chosen = Vec::new();
        for n in 0..300 {
            let k = len.choose();
            chosen.push(k);
            let secs = base + if k > 0 { fixed + row * k as f64 } else { 0.0 };
            len.record(k, run(n).min(k), Some(draft * k as f64), secs);
        }
        chosen
    }

    fn share(chosen: &[usize], f: impl Fn(usize) -> bool) -> f64 {
        let late = &chosen[150..];
        late.iter().filter(|&&k| f(k)).count() as f64 / late.len() as f64
    }

    #[test]
    fn cheap_drafts_that_are_kept_are_drafted_long() {
        let chosen = simulate(|_| 6, 0.002, 0.0005, 0.001);
        assert!(share(&chosen, |k| k >= 5) > 0.8, "{chosen:?}");
    }

    #[test]
    fn drafts_that_are_never_kept_are_stopped_but_still_probed() {
        let chosen = simulate(|_| 0, 0.003, 0.002, 0.004);
        assert!(share(&chosen, |k| k == 0) > 0.8, "{chosen:?}");
        assert!(
            chosen[150..].contains(&8),
            "drafting is probed while off: {chosen:?}"
        );
    }

    #[test]
    fn all_or_nothing_runs_with_a_fixed_pass_cost_are_drafted_long() {
        // Prompt lookup: a third of the rounds copy a long span, the rest miss at once; a
        // verifying pass costs 30 % more than a plain step however short. A constant rate
        // of acceptance (about a half here) would draft 1-2 or nothing.
        let chosen = simulate(|n| if n % 3 == 0 { 8 } else { 0 }, 0.003, 0.0003, 0.0);
        assert!(share(&chosen, |k| k >= 6) > 0.8, "{chosen:?}");
    }

    #[test]
    fn a_fixed_length_never_changes() {
        let mut len = DraftLength::new(5, false);
        for _ in 0..50 {
            assert_eq!(len.choose(), 5);
            len.record(5, 0, Some(1.0), 1.0);
        }
    }
}
