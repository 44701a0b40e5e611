//! How many tokens to draft: as many as maximise the expected tokens per second, from the
//! measured acceptance rate and the measured costs of drafting and of verifying extra rows.

/// Rounds between plain (undrafted) steps that re-measure a step's base cost.
const REMEASURE_EVERY: u64 = 32;
/// While drafting is off, rounds between probes that re-measure acceptance.
const PROBE_EVERY: u64 = 16;
/// Weight of the newest observation in the running means.
const NEWEST: f64 = 0.1;

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
    /// Drafted tokens kept and rejection events (a geometric model of acceptance).
    kept: f64,
    rejected: f64,
    /// Seconds of a step without drafts, per extra verified row, per drafted token.
    base: Mean,
    per_row: Mean,
    per_draft: Mean,
    /// The length chose last, for the log line when drafting turns off or on.
    last: Option<usize>,
}

impl DraftLength {
    /// Up to `max` tokens a round; `adaptive: false` always drafts `max`.
    pub fn new(max: usize, adaptive: bool) -> Self {
        Self {
            max,
            adaptive,
            rounds: 0,
            kept: 0.0,
            rejected: 0.0,
            base: Mean::default(),
            per_row: Mean::default(),
            per_draft: Mean::default(),
            last: None,
        }
    }

    /// The share of drafted tokens verification keeps, as measured (with a prior of one of
    /// each, so it starts at 0.5).
    pub fn acceptance(&self) -> f64 {
        (self.kept + 1.0) / (self.kept + self.rejected + 2.0)
    }

    /// Tokens to draft this round.
    pub fn choose(&mut self) -> usize {
        self.rounds += 1;
        if !self.adaptive || self.max == 0 {
            return self.max;
        }
        let Some(base) = self.base.0 else {
            return 0; // measure a plain step first
        };
        if self.rounds.is_multiple_of(REMEASURE_EVERY) {
            return 0;
        }
        let best = self.best(base);
        if best == 0 && self.rounds.is_multiple_of(PROBE_EVERY) {
            return 1; // keep measuring acceptance while off
        }
        if (self.last == Some(0)) != (best == 0) {
            let a = self.acceptance();
            match best {
                0 => tracing::info!(
                    "speculative decoding paused for a sequence: acceptance {a:.2} does not pay for drafting"
                ),
                k => tracing::info!(
                    "speculative decoding resumed for a sequence: {k} tokens a round at acceptance {a:.2}"
                ),
            }
        }
        self.last = Some(best);
        best
    }

    /// The length with the most expected tokens per second.
    fn best(&self, base: f64) -> usize {
        let a = self.acceptance().min(0.999);
        let (row, draft) = (
            self.per_row.0.unwrap_or(0.0),
            self.per_draft.0.unwrap_or(0.0),
        );
        let rate = |k: usize| {
            // Kept drafts are a geometric run; the replacement or bonus token always comes.
            let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
            tokens / (base + k as f64 * (row + draft))
        };
        (0..=self.max)
            .max_by(|&x, &y| rate(x).total_cmp(&rate(y)))
            .unwrap_or(0)
    }

    /// Records a round: `drafted` tokens proposed (taking `draft_secs`; `None`: not a fair
    /// measure), `kept` of them kept, and a forward pass of `step_secs`.
    pub fn record(&mut self, drafted: usize, kept: usize, draft_secs: Option<f64>, step_secs: f64) {
        if drafted == 0 {
            self.base.add(step_secs);
            return;
        }
        self.kept += kept as f64;
        self.rejected += f64::from(kept < drafted);
        if let Some(base) = self.base.0 {
            self.per_row
                .add(((step_secs - base) / drafted as f64).max(0.0));
        }
        if let Some(secs) = draft_secs {
            self.per_draft.add(secs / drafted as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `rounds` rounds where each drafted token is kept with probability `accept` (as a
    /// deterministic fraction) at the given costs; returns the lengths chosen.
    fn simulate(accept: f64, base: f64, row: f64, draft: f64) -> Vec<usize> {
        let mut len = DraftLength::new(8, true);
        let mut chosen = Vec::new();
        for _ in 0..200 {
            let k = len.choose();
            chosen.push(k);
            let kept = (0..k)
                .take_while(|i| accept.powi(*i as i32 + 1) >= 0.5)
                .count();
            len.record(k, kept, Some(draft * k as f64), base + row * k as f64);
        }
        chosen
    }

    #[test]
    fn cheap_drafts_that_are_kept_are_drafted_long() {
        let chosen = simulate(0.9, 0.010, 0.0005, 0.001);
        assert!(
            chosen[100..].iter().filter(|&&k| k >= 4).count() > 80,
            "{chosen:?}"
        );
    }

    #[test]
    fn drafts_that_are_never_kept_are_stopped_but_still_probed() {
        let chosen = simulate(0.0, 0.010, 0.002, 0.004);
        let late = &chosen[100..];
        assert!(late.iter().filter(|&&k| k == 0).count() > 80, "{chosen:?}");
        assert!(
            late.contains(&1),
            "drafting is probed while off: {chosen:?}"
        );
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
