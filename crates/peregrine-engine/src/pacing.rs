//! Paced prefill: how many tokens of long prompts a step may carry while other sequences
//! decode, from measured step times, so that the decodes' steps take on average at most
//! `stretch` times as long as steps of decodes alone. A fixed token cap cannot do this: what
//! prompt tokens cost depends on the machine, the model, how many sequences decode and how
//! far the prompt has got (its attention grows with every chunk), and a chunk has a fixed cost
//! besides its tokens' (one more sequence in the pass). So the budget is found by feedback on
//! the average, and may be a fraction of a token per step (a token every few steps) where
//! even one token stretches a step past the target.

/// Weight of the newest step in the running averages.
const NEWEST: f64 = 0.25;
/// Budget growth while the average stays within the stretch, and shrinkage past it.
const GROW: f64 = 1.2;
const SHRINK: f64 = 0.8;
/// The least budget: a prompt always advances, a token per this many steps at worst.
const MIN_BUDGET: f64 = 1.0 / 16.0;
/// Steps with prompt tokens between decode-only steps: the decodes' own contexts grow, and
/// with them their step, which the stretch is measured against.
const REMEASURE: usize = 32;

/// The prompt budget while sequences decode, and what a step of decodes alone takes.
#[derive(Debug, Clone)]
pub(crate) struct Pacer {
    /// Largest average ratio of steps to a decode-only step (≤ 1: no pacing).
    stretch: f64,
    /// Seconds of a step of decodes alone, and how many decoded in it.
    decode: Option<(usize, f64)>,
    /// Average ratio of recent steps (with prompt tokens or not) to a decode-only step.
    load: f64,
    /// Prompt tokens per step (may be below 1).
    budget: f64,
    /// Budget not yet handed out (fractions of a token carried to the next step).
    credit: f64,
    /// Steps since the last decode-only one was measured.
    since_measured: usize,
}

impl Pacer {
    /// A pacer that keeps steps carrying prompt tokens to `stretch` × a decode-only step on
    /// average.
    pub fn new(stretch: f64) -> Self {
        Self {
            stretch,
            decode: None,
            load: 1.0,
            budget: 1.0,
            credit: 0.0,
            since_measured: 0,
        }
    }

    /// Prompt tokens the next step may carry beside `decodes` decoding sequences, at most
    /// `cap`: whole tokens of the budget's credit. None until a step of as many decodes alone
    /// is measured, and every [`REMEASURE`] steps: that step measures it.
    pub fn prompt_budget(&mut self, decodes: usize, cap: usize) -> usize {
        if decodes == 0 || self.stretch <= 1.0 {
            return cap;
        }
        match self.decode {
            Some((n, _)) if n == decodes && self.since_measured < REMEASURE => {
                self.credit = (self.credit + self.budget).min(cap as f64);
                let tokens = self.credit.floor();
                self.credit -= tokens;
                tokens as usize
            }
            _ => 0,
        }
    }

    /// Records a step of `decodes` decoding sequences and `prompt_tokens` tokens of paced
    /// prompts that took `secs`, while such prompts waited (`waiting`): a decode-only step
    /// updates its average; every step moves the load, and the budget grows while the load
    /// stays within the stretch and shrinks past it.
    pub fn record(&mut self, decodes: usize, prompt_tokens: usize, waiting: bool, secs: f64) {
        if decodes == 0 {
            return;
        }
        let same = self.decode.filter(|&(n, _)| n == decodes).map(|(_, s)| s);
        if prompt_tokens == 0 {
            let average = same.map_or(secs, |old| old + NEWEST * (secs - old));
            self.decode = Some((decodes, average));
            self.since_measured = 0;
        } else {
            self.since_measured += 1;
        }
        let (Some(decode), true) = (self.decode.map(|(_, s)| s), waiting) else {
            return;
        };
        let ratio = if prompt_tokens == 0 {
            1.0
        } else {
            secs / decode
        };
        self.load += NEWEST * (ratio - self.load);
        self.budget = match self.load > self.stretch {
            true => (self.budget * SHRINK).max(MIN_BUDGET),
            false => self.budget * GROW,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 300 steps of 4 decodes beside a waiting prompt, each taking `cost(tokens)` seconds;
    /// returns the tokens of the last 100 and their steps' mean ratio to a decode-only step.
    fn settle(p: &mut Pacer, cap: usize, cost: impl Fn(usize) -> f64) -> (usize, f64) {
        p.record(4, 0, true, cost(0));
        let mut steps = Vec::new();
        for _ in 0..300 {
            let k = p.prompt_budget(4, cap);
            p.record(4, k, true, cost(k));
            steps.push((k, cost(k) / cost(0)));
        }
        let last = &steps[200..];
        let tokens = last.iter().map(|s| s.0).sum();
        (tokens, last.iter().map(|s| s.1).sum::<f64>() / 100.0)
    }

    #[test]
    fn the_budget_keeps_the_mean_step_near_the_stretch() {
        // Nothing decodes: the whole cap. No decode-only step measured: none, so the next
        // step measures one.
        let mut p = Pacer::new(1.5);
        assert_eq!(p.prompt_budget(0, 512), 512);
        assert_eq!(p.prompt_budget(4, 512), 0);
        // 10 ms of decodes; a chunk costs 2 ms plus 0.5 ms a token: about 6 tokens a step.
        let cost = |k: usize| {
            0.010
                + if k > 0 {
                    0.002 + 0.0005 * k as f64
                } else {
                    0.0
                }
        };
        let (tokens, mean) = settle(&mut p, 512, cost);
        assert!(
            (300..=800).contains(&tokens),
            "{tokens} tokens in 100 steps"
        );
        assert!((1.3..=1.65).contains(&mean), "mean ratio {mean}");
        // Never above the cap.
        let (tokens, _) = settle(&mut Pacer::new(1.5), 3, cost);
        assert!(tokens <= 300, "{tokens}");
        // One token alone doubles a step: a token every other step or so, the mean held.
        let costly = |k: usize| 0.010 + 0.010 * k.min(1) as f64;
        let (tokens, mean) = settle(&mut Pacer::new(1.5), 512, costly);
        assert!((25..=75).contains(&tokens), "{tokens} tokens in 100 steps");
        assert!((1.25..=1.7).contains(&mean), "mean ratio {mean}");
        // However costly, the prompt advances.
        let (tokens, _) = settle(&mut Pacer::new(1.5), 512, |k| 0.010 + 1.0 * k as f64);
        assert!(tokens >= 100 / 16 - 1, "{tokens}");
        // Another number of decodes is measured afresh before prompts share its steps.
        assert_eq!(p.prompt_budget(5, 512), 0);
        p.record(5, 0, true, 0.012);
        assert!((0..=20).map(|_| p.prompt_budget(5, 512)).sum::<usize>() > 0);
    }

    #[test]
    fn a_stretch_of_one_or_less_turns_pacing_off() {
        let mut p = Pacer::new(1.0);
        p.record(4, 0, true, 0.020);
        p.record(4, 1, true, 0.5);
        assert_eq!(p.prompt_budget(4, 512), 512);
    }
}
