//! Speculative decoding: a [`Drafter`] proposes a few tokens, the target model runs them all in
//! one pass, and verification
//! ([`Sampler::verify`](peregrine_sampling::Sampler::verify)) keeps each drafted token with
//! probability `min(1, p/q)` or replaces it, so the output is distributed exactly as without
//! drafting, at any temperature (greedy output is identical token for token). Rejected positions
//! are trimmed from the target's cache
//! ([`SequenceCache::trim`](peregrine_models::SequenceCache::trim), exact on every cache kind).
//! How many tokens to draft adapts to the measured acceptance and cost ([`DraftLength`]).
//!
//! Drafters: [`DraftModel`] (a smaller model sharing the vocabulary), [`PromptLookup`] (the
//! continuation of an earlier occurrence of the context's last tokens; no second model) and
//! [`MtpDraft`] (the target's own multi-token-prediction layer) and [`AssistantDraft`] (Gemma 4's
//! assistant, reading the target's keys and values). Other crates can plug their own through
//! [`DraftSource`].

mod adaptive;
mod draft_model;
mod mtp;
mod ngram;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use peregrine_models::{CausalLm, KvOptions, LayerKind, SequenceCache};
use peregrine_sampling::{Distribution, SamplingParams};

pub use adaptive::DraftLength;
pub use draft_model::DraftModel;
pub use mtp::{AssistantDraft, MtpDraft};
pub use ngram::PromptLookup;

use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

/// The most tokens one verification may draft.
pub const MAX_DRAFT_TOKENS: usize = 16;

/// What a drafter proposes for one verification pass.
#[derive(Debug, Clone, Default)]
pub struct Proposal {
    /// The drafted tokens, in order.
    pub tokens: Vec<u32>,
    /// The distribution each token was drawn from, for a drafter that samples; empty for a
    /// deterministic proposal (verification then treats each as certain: `q = 1`).
    pub dists: Vec<Distribution>,
}

impl Proposal {
    /// Forgets the last proposal, keeping the buffers.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.dists.clear();
    }
}

/// The sequence a [`Drafter`] proposes for.
pub struct DraftContext<'a> {
    /// The prompt.
    pub prompt: &'a [u32],
    /// The tokens generated so far; the target has not run the last one yet.
    pub generated: &'a [u32],
    /// The target's cache of the sequence (an MTP head's memory rides in it).
    pub target: &'a mut SequenceCache,
}

/// Proposes the next tokens of one sequence.
pub trait Drafter: Send {
    /// Up to `max` tokens likely to follow the context's prompt then its generated tokens,
    /// into `out` (cleared first). Proposing fewer, or none, is fine.
    fn propose(
        &mut self,
        context: DraftContext,
        max: usize,
        out: &mut Proposal,
    ) -> Result<(), EngineError>;
}

/// Makes a [`Drafter`] for each sequence that speculates.
pub trait DraftSource: Send + Sync {
    /// A short name for logs and metrics (`draft-model`, `prompt-lookup`).
    fn name(&self) -> &str;
    /// Fails when this source cannot draft for `target` (a draft model with another
    /// vocabulary); the engine calls it once, when it starts.
    fn check(&self, target: &dyn CausalLm, tokenizer: &Tokenizer) -> Result<(), EngineError> {
        let _ = (target, tokenizer);
        Ok(())
    }
    /// Whether the target must load its multi-token-prediction layers
    /// ([`LoadOptions::mtp`](peregrine_models::LoadOptions)) for this source to draft.
    fn loads_mtp(&self) -> bool {
        false
    }
    /// Readies `cache`, a new sequence's cache of `target` (perhaps from the prompt cache),
    /// for drafting with KV options `kv`: an MTP head's memory is enabled there.
    fn prepare(&self, target: &dyn CausalLm, cache: &mut SequenceCache, kv: &KvOptions) {
        let _ = (target, cache, kv);
    }
    /// A drafter for one sequence of `target`, drawing with the request's `sampling` where it
    /// samples (its seed is the request's, so seeded runs repeat) and storing any KV as `kv`
    /// says.
    fn start(
        &self,
        target: &Arc<dyn CausalLm>,
        sampling: &SamplingParams,
        kv: &KvOptions,
    ) -> Box<dyn Drafter>;
    /// The most KV cache bytes one sequence's drafter holds at `positions` positions with
    /// `kv` (a draft model's cache, an MTP head's): counted in the request's share of the KV
    /// budget.
    fn kv_bytes(&self, target: &dyn CausalLm, kv: &KvOptions, positions: usize) -> usize {
        let _ = (target, kv, positions);
        0
    }
}

/// The KV options of a drafter's cache: the request's precision, never quantized or
/// TurboQuant (the draft's precision does not change what verification emits).
pub(crate) fn draft_kv(kv: &KvOptions) -> KvOptions {
    KvOptions {
        quant: None,
        turbo: None,
        ..*kv
    }
}

/// Speculative decoding's settings ([`EngineConfig::speculative`](crate::EngineConfig)).
#[derive(Clone)]
pub struct SpeculativeConfig {
    /// Where drafts come from.
    pub source: Arc<dyn DraftSource>,
    /// The most tokens drafted per verification (`--num-draft-tokens`).
    pub max_draft: usize,
    /// Shorten or stop drafting when the measured acceptance and cost say it loses; off, every
    /// round drafts `max_draft`.
    pub adaptive: bool,
}

impl std::fmt::Debug for SpeculativeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpeculativeConfig")
            .field("source", &self.source.name())
            .field("max_draft", &self.max_draft)
            .field("adaptive", &self.adaptive)
            .finish()
    }
}

/// Counters of speculative decoding since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Verification passes that carried drafted tokens.
    pub rounds: u64,
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafted tokens kept.
    pub accepted: u64,
    /// Decode steps of speculating sequences that drafted nothing because the draft length
    /// adapted to 0 (drafting measured as a loss).
    pub skipped: u64,
}

impl SpeculationStats {
    /// The share of drafted tokens kept.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Tokens kept per verification pass, the bonus or replacement token not counted.
    pub fn mean_accepted(&self) -> f64 {
        self.accepted as f64 / self.rounds.max(1) as f64
    }
}

/// `spec` checked against the model it drafts for: a draft model's vocabulary, and a draft
/// length within what every cache can roll back (recurrent layers keep a few states) and, when
/// the model's experts stream from disk (`streaming`), of 1: each drafted token's experts are
/// more reads in the verifying pass.
pub(crate) fn checked(
    mut spec: SpeculativeConfig,
    model: &dyn CausalLm,
    tokenizer: &Tokenizer,
    (kv, streaming): (&KvOptions, bool),
) -> Result<SpeculativeConfig, EngineError> {
    spec.source.check(model, tokenizer)?;
    let recurrent = (model.cache_spec().iter()).any(|k| matches!(k, LayerKind::Recurrent { .. }));
    let (most, why) = match (streaming, recurrent) {
        (true, _) => (
            1,
            "the experts stream from disk, and every drafted token routes to experts of its own \
             that the verifying pass must read",
        ),
        (false, true) => (
            kv.recurrent_depth().min(MAX_DRAFT_TOKENS),
            "the recurrent layers roll back no further (--recurrent-rollback)",
        ),
        (false, false) => (MAX_DRAFT_TOKENS, "the most a pass verifies"),
    };
    if spec.max_draft > most {
        tracing::warn!(
            "drafting at most {most} tokens a pass, not {}: {why}",
            spec.max_draft
        );
        spec.max_draft = most;
    }
    Ok(spec)
}

/// Speculative decoding's counters, shared by the scheduler and the engine's handle.
#[derive(Debug, Default)]
pub(crate) struct SpeculationCounters {
    rounds: AtomicU64,
    drafted: AtomicU64,
    accepted: AtomicU64,
    skipped: AtomicU64,
}

impl SpeculationCounters {
    /// Counts a verification pass of `drafted` tokens that kept `kept`.
    pub fn verified(&self, drafted: usize, kept: usize) {
        self.rounds.fetch_add(1, Ordering::Relaxed);
        self.drafted.fetch_add(drafted as u64, Ordering::Relaxed);
        self.accepted.fetch_add(kept as u64, Ordering::Relaxed);
    }

    /// Counts a step where a speculating sequence drafted nothing, its draft length having
    /// adapted to 0.
    pub fn skipped(&self) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn stats(&self) -> SpeculationStats {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SpeculationStats {
            rounds: read(&self.rounds),
            drafted: read(&self.drafted),
            accepted: read(&self.accepted),
            skipped: read(&self.skipped),
        }
    }
}

/// One choice's speculation: its drafter, the last proposal and the draft length.
pub(crate) struct Speculation {
    drafter: Box<dyn Drafter>,
    proposal: Proposal,
    length: DraftLength,
    /// Seconds the last proposal took; `None` for the first, which also brought the drafter
    /// up to the prompt (a draft model's prefill) and would overstate drafting's cost.
    draft_secs: Option<f64>,
    proposals: u64,
}

impl Speculation {
    /// A choice sampling with `sampling` drafts from `config`'s source. A seeded request
    /// drafts a fixed length: lengths adapted to measured times would make its output vary.
    pub fn start(
        config: &SpeculativeConfig,
        target: &Arc<dyn CausalLm>,
        sampling: &SamplingParams,
        kv: &KvOptions,
    ) -> Self {
        let kv = draft_kv(kv);
        let adaptive = config.adaptive && sampling.seed.is_none();
        Self {
            drafter: config.source.start(target, sampling, &kv),
            proposal: Proposal::default(),
            length: DraftLength::new(config.max_draft, adaptive),
            draft_secs: None,
            proposals: 0,
        }
    }

    /// Drafts up to `room` tokens after the context (as many as the draft length says),
    /// appending them to `feed`.
    pub fn draft(
        &mut self,
        context: DraftContext,
        room: usize,
        shared: &crate::engine::Shared,
        feed: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        self.proposal.clear();
        let want = self.length.choose();
        if want == 0 && room > 0 {
            shared.spec_counters.skipped();
        }
        let want = want.min(room);
        if want > 0 {
            let start = std::time::Instant::now();
            (self.drafter).propose(context, want, &mut self.proposal)?;
            self.proposal.tokens.truncate(want);
            self.proposals += 1;
            let secs = start.elapsed().as_secs_f64();
            self.draft_secs = (self.proposals > 1).then_some(secs);
        }
        feed.extend_from_slice(&self.proposal.tokens);
        Ok(())
    }

    /// The tokens of the last proposal.
    pub fn drafts(&self) -> &[u32] {
        &self.proposal.tokens
    }

    /// The distribution the `i`th drafted token was drawn from (`None`: proposed
    /// deterministically).
    pub fn proposal_dist(&self, i: usize) -> Option<&Distribution> {
        self.proposal.dists.get(i)
    }

    /// Records a pass that verified `drafted` tokens (0: a plain step) and kept `kept`.
    pub fn record(&mut self, drafted: usize, kept: usize, step_secs: f64) {
        let draft_secs = if drafted > 0 {
            self.draft_secs
        } else {
            Some(0.0)
        };
        self.length.record(drafted, kept, draft_secs, step_secs);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use peregrine_models::{CausalLm, LoadOptions, load_model};

    /// `tests/fixtures/<arch>/hf` at the repository root.
    pub fn fixture_dir(arch: &str) -> PathBuf {
        (PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
            .join(arch)
            .join("hf")
    }

    /// The tiny fixture `arch`, with its MTP layer when `mtp`.
    pub fn fixture_model(arch: &str, mtp: bool) -> Arc<dyn CausalLm> {
        let opts = LoadOptions {
            mtp,
            ..LoadOptions::default()
        };
        load_model(&fixture_dir(arch), &opts).unwrap().model
    }
}
