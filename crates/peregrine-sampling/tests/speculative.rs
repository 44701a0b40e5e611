//! Speculative verification (`Sampler::verify`) emits tokens distributed exactly as the
//! target's processed distribution, whatever the draft's: checked by total variation over many
//! seeded trials, for stochastic and deterministic proposals and with filters on.

use peregrine_sampling::{Distribution, Sampler, SamplingParams, Verdict};

/// Trials per check. The total variation of 200 000 draws over 6 tokens from their own
/// distribution is about 0.002 (sum of the standard deviations × √(2/π) / 2); 0.01 is five
/// times that, and a verifier that accepted every draft would be off by 0.3 or more.
const TRIALS: usize = 200_000;
const MAX_TV: f64 = 0.01;

fn logits(probs: &[f32]) -> Vec<f32> {
    probs.iter().map(|p| p.ln()).collect()
}

fn params(seed: u64, f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        seed: Some(seed),
        ..SamplingParams::default()
    };
    f(&mut p);
    p
}

/// The processed distribution of `probs` under `p`.
fn dist(p: &SamplingParams, probs: &[f32]) -> Distribution {
    let mut out = Distribution::default();
    Sampler::new(p.clone()).distribution(&mut logits(probs), &[], &[], &mut out);
    out
}

/// The frequencies of the token verification emits at the first position: a draft drawn from
/// `draft` (or `fixed`, deterministically), then kept or replaced.
fn emitted(p: SamplingParams, target: &[f32], draft: &[f32], fixed: Option<u32>) -> Vec<f64> {
    let target_dist = dist(&p, target);
    let mut draft_dist = dist(&p, draft);
    if fixed.is_some() {
        draft_dist = Distribution::default();
    }
    let mut verifier = Sampler::new(p.clone());
    let mut drafter = Sampler::new(SamplingParams {
        seed: p.seed.map(|s| s + 1000),
        ..p.clone()
    });
    let mut counts = vec![0usize; target.len()];
    for _ in 0..TRIALS {
        let (token, proposal) = match fixed {
            Some(t) => (t, None),
            None => (drafter.draw_from(&draft_dist), Some(&draft_dist)),
        };
        let out = match verifier.verify(&target_dist, token, proposal) {
            Verdict::Accept => token,
            Verdict::Replace(t) => t,
        };
        counts[out as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / TRIALS as f64).collect()
}

fn total_variation(a: &[f64], b: &Distribution) -> f64 {
    let b: Vec<f64> = (0..a.len() as u32).map(|t| b.prob(t) as f64).collect();
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f64>() / 2.0
}

const TARGET: [f32; 6] = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04];
/// A poor draft: most of its mass where the target has little.
const POOR: [f32; 6] = [0.02, 0.03, 0.05, 0.10, 0.30, 0.50];

#[test]
fn a_poor_sampled_draft_leaves_the_target_distribution() {
    for p in [
        params(1, |_| {}),
        params(2, |p| p.temperature = 0.7),
        params(3, |p| p.top_k = 4),
        params(4, |p| {
            p.top_p = 0.8;
            p.temperature = 1.3;
        }),
        params(5, |p| p.min_p = 0.2),
    ] {
        let freqs = emitted(p.clone(), &TARGET, &POOR, None);
        let tv = total_variation(&freqs, &dist(&p, &TARGET));
        assert!(
            tv < MAX_TV,
            "{p:?}: total variation {tv:.4} ≥ {MAX_TV}: {freqs:?}"
        );
    }
}

#[test]
fn a_deterministic_proposal_leaves_the_target_distribution() {
    // Prompt lookup proposes one token with certainty, likely or not.
    for fixed in [0, 3, 5] {
        let p = params(10 + fixed as u64, |_| {});
        let freqs = emitted(p.clone(), &TARGET, &POOR, Some(fixed));
        let tv = total_variation(&freqs, &dist(&p, &TARGET));
        assert!(
            tv < MAX_TV,
            "proposal {fixed}: total variation {tv:.4}: {freqs:?}"
        );
    }
}

#[test]
fn accepting_every_draft_would_fail_the_check() {
    // The check's power: the draft's own distribution is far from the target's.
    let p = params(20, |_| {});
    let tv = total_variation(
        &POOR.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        &dist(&p, &TARGET),
    );
    assert!(tv > 30.0 * MAX_TV, "{tv}");
}

#[test]
fn greedy_keeps_only_the_argmax_and_draws_nothing() {
    let p = SamplingParams::greedy();
    let target = dist(&p, &TARGET);
    assert_eq!(target.point(), Some(0));
    let mut s = Sampler::new(p);
    assert_eq!(s.verify(&target, 0, None), Verdict::Accept);
    assert_eq!(s.verify(&target, 4, None), Verdict::Replace(0));
    let mut before = s.clone();
    assert_eq!(s.verify(&target, 2, Some(&target)), Verdict::Replace(0));
    // No randomness was consumed: the generator is where it was.
    assert_eq!(s.rng_mut().next_u64(), before.rng_mut().next_u64());
}

#[test]
fn a_distribution_matches_what_sample_draws() {
    // Filters and penalties are the sampler's own: the support and mass agree with sampling.
    let p = params(30, |p| {
        p.top_k = 3;
        p.repetition_penalty = 2.0;
    });
    let mut d = Distribution::default();
    let mut logits = logits(&TARGET);
    Sampler::new(p).distribution(&mut logits, &[0], &[], &mut d);
    let support: Vec<u32> = d.probs().iter().map(|c| c.0).collect();
    assert_eq!(support, [0, 1, 2]);
    let sum: f32 = d.probs().iter().map(|c| c.1).sum();
    assert!((sum - 1.0).abs() < 1e-5);
    // Token 0's logit is penalised (ln 0.4 × 2 = −1.83): below token 1's (ln 0.25 = −1.39).
    assert!(d.prob(0) < d.prob(1), "{:?}", d.probs());
}
