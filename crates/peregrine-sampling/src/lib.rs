//! Logits processors and seeded sampling for Peregrine.
//!
//! The engine copies the last row of the logits tensor to a CPU `Vec<f32>` and hands it to a
//! per-request [`Sampler`]: token choice is a few O(vocab) passes that do not pay for a device
//! round trip per processor. Processors follow HF transformers / vLLM order (penalties,
//! temperature, top-k, top-p, min-p); top-k and top-p use partial selection so a 262K vocabulary is
//! never fully sorted. Randomness comes from a small xoshiro256** generator ([`Rng`]) seeded per
//! request, so equal seeds give equal outputs without a `rand` dependency.

#![warn(missing_docs)]

mod logprobs;
mod params;
mod rng;
mod sampler;

pub use logprobs::{TokenLogprob, logsumexp, token_logprobs};
pub use params::{MAX_TEMPERATURE, PENALTY_RANGE, SamplingError, SamplingParams};
pub use rng::Rng;
pub use sampler::{Distribution, Sampler, Verdict, argmax};

// The README's examples compile and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
