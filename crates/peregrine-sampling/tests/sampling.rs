//! Sampler behaviour: greedy, determinism, filters (statistically), penalties, validation,
//! logprobs.

use peregrine_sampling::{Rng, Sampler, SamplingError, SamplingParams, argmax, token_logprobs};

/// Draws per statistical test. With 20 000 draws a frequency's standard deviation is at most
/// 0.0036, so the 0.02 tolerance below is over five sigma: these tests do not flake, and the
/// fixed seeds make them deterministic anyway.
const DRAWS: usize = 20_000;
const TOL: f64 = 0.02;

/// The 4-token distribution the statistical tests use, as logits.
fn four() -> Vec<f32> {
    [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect()
}

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        seed: Some(7),
        ..SamplingParams::default()
    };
    f(&mut p);
    p.validate().expect("test params are valid");
    p
}

/// Frequencies of each token over `DRAWS` draws from `logits`.
fn freqs(p: SamplingParams, logits: &[f32]) -> Vec<f64> {
    let mut s = Sampler::new(p);
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..DRAWS {
        let mut l = logits.to_vec();
        counts[s.sample(&mut l, &[], &[]) as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / DRAWS as f64).collect()
}

fn assert_freqs(got: &[f64], want: &[f64]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() < TOL,
            "token {i}: frequency {g}, expected {w}; all: {got:?}"
        );
    }
}

#[test]
fn greedy_is_first_argmax() {
    let mut s = Sampler::new(SamplingParams::greedy());
    let mut l = vec![0.1, 2.0, f32::NAN, 2.0, -1.0];
    assert_eq!(s.sample(&mut l, &[], &[]), 1);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    assert_eq!(
        Sampler::new(SamplingParams::default()).sample(&mut [], &[], &[]),
        0
    );
}

#[test]
fn argmax_matches_a_scalar_scan_over_ties_nans_and_tails() {
    // The first index of the largest non-NaN value, as a plain scan finds it.
    let scan = |l: &[f32]| {
        let mut best = (0, f32::NEG_INFINITY);
        for (i, &x) in l.iter().enumerate() {
            if x > best.1 {
                best = (i, x);
            }
        }
        best.0 as u32
    };
    let mut rng = Rng::seed_from_u64(7);
    for len in [1, 15, 16, 17, 33, 100, 1000] {
        for _ in 0..50 {
            // Few distinct values, so ties within and across runs of 16 are common.
            let mut l: Vec<f32> = (0..len)
                .map(|_| (rng.next_f64() * 8.0).floor() as f32)
                .collect();
            for _ in 0..len / 10 {
                let at = rng.next_u64() as usize % len;
                l[at] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY][at % 3];
            }
            assert_eq!(argmax(&l), scan(&l), "{l:?}");
        }
    }
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[]), 0);
}

#[test]
fn same_seed_same_sequence() {
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32) / 20.0).collect();
    let run = |seed| {
        let mut s = Sampler::new(params(|p| {
            p.seed = Some(seed);
            p.top_p = 0.9;
        }));
        (0..200)
            .map(|_| s.sample(&mut logits.clone(), &[], &[]))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

#[test]
fn top_k_one_is_greedy() {
    let mut rng = Rng::seed_from_u64(1);
    for seed in 0..50 {
        let logits: Vec<f32> = (0..500).map(|_| rng.next_f64() as f32 * 10.0).collect();
        let mut s = Sampler::new(params(|p| {
            p.seed = Some(seed);
            p.top_k = 1;
            p.temperature = 1.5;
        }));
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), argmax(&logits));
    }
}

#[test]
fn plain_sampling_follows_the_distribution() {
    assert_freqs(&freqs(params(|_| ()), &four()), &[0.5, 0.3, 0.15, 0.05]);
}

#[test]
fn temperature_sharpens() {
    // T = 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 over 0.365.
    let z = 0.365;
    let want = [0.25 / z, 0.09 / z, 0.0225 / z, 0.0025 / z];
    assert_freqs(&freqs(params(|p| p.temperature = 0.5), &four()), &want);
}

#[test]
fn top_k_keeps_the_k_best() {
    let got = freqs(params(|p| p.top_k = 2), &four());
    assert_freqs(&got, &[0.625, 0.375, 0.0, 0.0]);
    assert_eq!(got[2] + got[3], 0.0);
}

#[test]
fn top_p_keeps_the_nucleus() {
    // 0.5 < 0.7 <= 0.5 + 0.3: the crossing token stays, the rest go.
    let got = freqs(params(|p| p.top_p = 0.7), &four());
    assert_eq!(got[2] + got[3], 0.0);
    assert_freqs(&got, &[0.625, 0.375, 0.0, 0.0]);
    let got = freqs(params(|p| p.top_p = 0.9), &four());
    assert_eq!(got[3], 0.0);
    assert_freqs(&got, &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]);
    // Token order in the vocabulary must not matter.
    let mut rev = four();
    rev.reverse();
    let got = freqs(params(|p| p.top_p = 0.7), &rev);
    assert_freqs(&got, &[0.0, 0.0, 0.375, 0.625]);
}

#[test]
fn top_p_with_a_large_nucleus() {
    // 2000 equal tokens: the nucleus (about 1010) outgrows the first guesses of the selection.
    let logits = vec![0.0f32; 2000];
    let mut s = Sampler::new(params(|p| p.top_p = 0.505));
    let mut max_id = 0;
    for _ in 0..DRAWS {
        max_id = max_id.max(s.sample(&mut logits.clone(), &[], &[]));
    }
    assert!((1000..1012).contains(&max_id), "max id {max_id}");
}

#[test]
fn top_k_over_heap_limit_and_with_top_p() {
    let logits: Vec<f32> = (0..1000).map(|i| -(i as f32) / 300.0).collect();
    for k in [5, 300] {
        let mut s = Sampler::new(params(|p| {
            p.top_k = k;
            p.top_p = 0.95;
        }));
        for _ in 0..2000 {
            assert!((s.sample(&mut logits.clone(), &[], &[]) as usize) < k);
        }
    }
}

#[test]
fn min_p_drops_unlikely_tokens() {
    // Threshold 0.2 * 0.5 = 0.1: only the 0.05 token goes.
    let got = freqs(params(|p| p.min_p = 0.2), &four());
    assert_eq!(got[3], 0.0);
    assert_freqs(&got, &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]);
    // Threshold 0.25: the 0.15 token goes too.
    let got = freqs(params(|p| p.min_p = 0.5), &four());
    assert_freqs(&got, &[0.625, 0.375, 0.0, 0.0]);
}

#[test]
fn penalties_match_hand_computed_values() {
    let mut s = Sampler::new(SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..SamplingParams::greedy()
    });
    let mut l = vec![2.0, -1.0, 0.5, 3.0, 1.0];
    // Token 0 seen in the prompt, 1 generated twice, 2 once; id 99 is out of range and ignored.
    let id = s.sample(&mut l, &[0, 99], &[1, 2, 1, 99]);
    // Repetition: 2/2, -1*2, 0.5/2. Then token 1: -2 - (2*0.5 + 0.25); token 2: 0.25 - 0.75.
    assert_eq!(l, vec![1.0, -3.25, -0.5, 3.0, 1.0]);
    assert_eq!(id, 3);
    // A second call starts from fresh logits: nothing carried over.
    let mut l = vec![2.0, -1.0, 0.5, 3.0, 1.0];
    s.sample(&mut l, &[0], &[]);
    assert_eq!(l, vec![1.0, -1.0, 0.5, 3.0, 1.0]);
}

#[test]
fn penalty_changes_the_greedy_choice() {
    let mut s = Sampler::new(SamplingParams {
        presence_penalty: 1.0,
        ..SamplingParams::greedy()
    });
    assert_eq!(s.sample(&mut [1.0, 0.5], &[], &[0]), 1);
    assert_eq!(s.sample(&mut [1.0, 0.5], &[0], &[]), 0);
}

#[test]
fn validate_names_the_field() {
    let cases: [(&str, SamplingParams); 7] = [
        ("temperature", params(|_| ()).with(|p| p.temperature = -0.1)),
        (
            "temperature",
            params(|_| ()).with(|p| p.temperature = f32::NAN),
        ),
        ("top_p", params(|_| ()).with(|p| p.top_p = 0.0)),
        ("min_p", params(|_| ()).with(|p| p.min_p = 1.5)),
        (
            "repetition_penalty",
            params(|_| ()).with(|p| p.repetition_penalty = 0.0),
        ),
        (
            "frequency_penalty",
            params(|_| ()).with(|p| p.frequency_penalty = 2.5),
        ),
        (
            "presence_penalty",
            params(|_| ()).with(|p| p.presence_penalty = -3.0),
        ),
    ];
    for (field, p) in cases {
        let err = p.validate().unwrap_err();
        let SamplingError::OutOfRange { field: got, .. } = &err;
        assert_eq!(*got, field);
        assert!(err.to_string().contains(field), "{err}");
    }
    assert!(SamplingParams::default().validate().is_ok());
    assert!(SamplingParams::greedy().validate().is_ok());
    let msg = params(|_| ())
        .with(|p| p.top_p = 1.5)
        .validate()
        .unwrap_err()
        .to_string();
    assert_eq!(
        msg,
        "invalid sampling parameter `top_p` = 1.5: must be in (0, 1]"
    );
}

trait With: Sized {
    fn with(self, f: impl FnOnce(&mut Self)) -> Self;
}
impl With for SamplingParams {
    fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}

#[test]
fn logprobs_are_log_softmax_of_raw_logits() {
    let logits = [1.0f32, 3.0, 2.0, f32::NAN];
    let lse = (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
    let lp = token_logprobs(&logits, 2, 2);
    assert_eq!(lp.id, 2);
    assert!((lp.logprob as f64 - (2.0 - lse)).abs() < 1e-6);
    assert_eq!(lp.top.len(), 2);
    assert_eq!((lp.top[0].0, lp.top[1].0), (1, 2));
    assert!((lp.top[0].1 as f64 - (3.0 - lse)).abs() < 1e-6);
    let all = token_logprobs(&logits, 9, 10);
    assert_eq!(all.logprob, f32::NEG_INFINITY);
    assert_eq!(all.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 0]);
    let total: f64 = all.top.iter().map(|t| (t.1 as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6);
    assert!(token_logprobs(&logits, 0, 0).top.is_empty());
}

#[test]
fn rng_is_uniform_enough() {
    let mut r = Rng::seed_from_u64(0);
    let mut buckets = [0usize; 10];
    for _ in 0..DRAWS {
        let x = r.next_f64();
        assert!((0.0..1.0).contains(&x));
        buckets[(x * 10.0) as usize] += 1;
    }
    for b in buckets {
        assert!((b as f64 / DRAWS as f64 - 0.1).abs() < TOL, "{buckets:?}");
    }
    assert_ne!(Rng::from_entropy(), Rng::from_entropy());
}
