//! Paced prefill: how many prompt tokens a step may carry while other sequences decode, from
//! measured step times, so that the decodes' steps take at most `stretch` times as long as
//! a step of decodes alone. A fixed token cap cannot do this: what prompt tokens cost depends
//! on the machine, the model, how many sequences decode and how far the prompt has got (its
//! attention grows with every chunk), and a chunk has a fixed cost besides its tokens' (one
//! more sequence in the pass), so the budget is found by feedback, not from a per-token price.

/// Weight of the newest decode-only step in its running average.
const NEWEST: f64 = 0.5;
/// Budget growth after a step within the stretch, and shrinkage after one past it.
const GROW: f64 = 1.25;
const SHRINK: f64 = 0.8;
/// Steps with prompt tokens between decode-only steps: the decodes' own contexts grow, and
/// with them their step, which the stretch is measured against.
const REMEASURE: usize = 32;

/// The prompt budget while sequences decode, and what a step of decodes alone takes.
#[derive(Debug, Clone)]
pub(crate) struct Pacer {
    /// Largest ratio of a step with prompt tokens to a decode-only step (≤ 1: no pacing).
    stretch: f64,
    /// Seconds of a step of decodes alone, and how many decoded in it.
    decode: Option<(usize, f64)>,
    /// Prompt tokens a step may carry beside decodes (its floor; at least 1).
    budget: f64,
    /// Steps with prompt tokens since the last decode-only one.
    since_measured: usize,
}

impl Pacer {
    /// A pacer that lets steps with prompt tokens take up to `stretch` × a decode-only step.
    pub fn new(stretch: f64) -> Self {
        Self {
            stretch,
            decode: None,
            budget: 1.0,
            since_measured: 0,
        }
    }

    /// Prompt tokens the next step may carry beside `decodes` decoding sequences, at most
    /// `cap`. None until a step of as many decodes alone is measured, and every
    /// [`REMEASURE`] steps: that step measures it.
    pub fn prompt_budget(&self, decodes: usize, cap: usize) -> usize {
        if decodes == 0 || self.stretch <= 1.0 {
            return cap;
        }
        match self.decode {
            Some((n, _)) if n == decodes && self.since_measured < REMEASURE => {
                (self.budget as usize).clamp(1, cap.max(1))
            }
            _ => 0,
        }
    }

    /// Records a step of `decodes` decoding sequences and `prompt_tokens` prompt tokens that
    /// took `secs`: a decode-only step updates its average; a step that used the whole budget
    /// grows the budget if it stayed within the stretch, and shrinks it if not.
    pub fn record(&mut self, decodes: usize, prompt_tokens: usize, secs: f64) {
        if decodes == 0 {
            return;
        }
        let same = self.decode.filter(|&(n, _)| n == decodes).map(|(_, s)| s);
        if prompt_tokens == 0 {
            let average = same.map_or(secs, |old| old + NEWEST * (secs - old));
            self.decode = Some((decodes, average));
            self.since_measured = 0;
            return;
        }
        self.since_measured += 1;
        let Some(decode) = same else { return };
        if secs > self.stretch * decode {
            self.budget = (self.budget * SHRINK).max(1.0);
        } else if prompt_tokens >= self.budget as usize {
            // A step short of its budget (a prompt's last chunk) says nothing about more.
            self.budget = (self.budget * GROW).max(self.budget + 1.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps of 4 decodes and prompt tokens as `p` allows, each taking
    /// `cost(tokens)` seconds; returns the budget they settle on (the smallest of the last 10).
    fn settle(p: &mut Pacer, cap: usize, cost: impl Fn(usize) -> f64) -> usize {
        p.record(4, 0, cost(0));
        let mut seen = Vec::new();
        for _ in 0..200 {
            let k = p.prompt_budget(4, cap);
            p.record(4, k, cost(k));
            seen.push(k);
        }
        // Every REMEASURE + 1 steps, one of decodes alone.
        let alone = seen.iter().filter(|&&k| k == 0).count();
        assert_eq!(alone, 200 / (REMEASURE + 1));
        let paced = seen.iter().rev().filter(|&&k| k > 0);
        paced.take(10).copied().min().unwrap()
    }

    #[test]
    fn the_budget_settles_near_the_most_tokens_within_the_stretch() {
        // Nothing decodes: the whole cap. No decode-only step measured: none, so the next
        // step measures one.
        let mut p = Pacer::new(1.5);
        assert_eq!(p.prompt_budget(0, 512), 512);
        assert_eq!(p.prompt_budget(4, 512), 0);
        // 10 ms of decodes; a chunk costs 2 ms plus 0.5 ms a token: 6 tokens fit in 5 ms.
        let cost = |k: usize| {
            0.010
                + if k > 0 {
                    0.002 + 0.0005 * k as f64
                } else {
                    0.0
                }
        };
        let k = settle(&mut p, 512, cost);
        assert!((4..=6).contains(&k), "{k}");
        // Never above the cap.
        assert_eq!(settle(&mut Pacer::new(1.5), 3, cost), 3);
        // A chunk whose fixed cost alone is past the stretch still advances, a token a step.
        assert_eq!(
            settle(&mut Pacer::new(1.5), 512, |k| 0.010
                + 0.008 * k.min(1) as f64),
            1
        );
        // Another number of decodes is measured afresh before prompts share its steps.
        assert_eq!(p.prompt_budget(5, 512), 0);
        p.record(5, 0, 0.012);
        assert!(p.prompt_budget(5, 512) >= 1);
    }

    #[test]
    fn a_stretch_of_one_or_less_turns_pacing_off() {
        let mut p = Pacer::new(1.0);
        p.record(4, 0, 0.020);
        p.record(4, 1, 0.5);
        assert_eq!(p.prompt_budget(4, 512), 512);
    }
}
