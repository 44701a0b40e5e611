//! Log-probabilities of the chosen token and the most likely alternatives (OpenAI `logprobs`).

use crate::sampler::{Cand, top_k_into};

/// The log-probability of one sampled token and the `top_n` most likely tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The chosen token.
    pub id: u32,
    /// Its natural-log probability under the raw model distribution.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first (ties by lower id).
    pub top: Vec<(u32, f32)>,
}

/// `ln Σ exp(l)` in f64, ignoring NaN; infinite when the maximum is.
pub fn logsumexp(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, |m, l| if l > m { l } else { m }) as f64;
    if !max.is_finite() {
        return max;
    }
    let max32 = max as f32;
    // f32 exp (fast) summed in f64 (no loss over a 262K vocabulary).
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l - max32).exp() as f64)
        .sum();
    max + sum.ln()
}

/// Log-softmax of one logit given the distribution's `logsumexp`; never NaN.
fn logprob(l: f32, lse: f64) -> f32 {
    let lp = (l as f64 - lse) as f32;
    match lp {
        // +inf against +inf: that token holds the mass.
        _ if lp.is_nan() && l == f32::INFINITY => 0.0,
        _ if lp.is_nan() => f32::NEG_INFINITY,
        _ => lp,
    }
}

/// Log-probabilities from the raw logits of one position (before penalties and temperature, as
/// OpenAI and vLLM report them). A `chosen` id outside the vocabulary gets `-inf`.
pub fn token_logprobs(logits: &[f32], chosen: u32, top_n: usize) -> TokenLogprob {
    let lse = logsumexp(logits);
    let lp = logits
        .get(chosen as usize)
        .map_or(f32::NEG_INFINITY, |&l| logprob(l, lse));
    let mut top = Vec::new();
    if top_n > 0 {
        let items = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| Cand(i as u32, l));
        top_k_into(items, top_n, &mut top);
        top.sort_unstable_by(Cand::desc);
    }
    let top = top.into_iter().map(|c| (c.0, logprob(c.1, lse))).collect();
    TokenLogprob {
        id: chosen,
        logprob: lp,
        top,
    }
}
