//! Drafting from the target's own final hidden states: with its multi-token-prediction layer
//! (`--spec-mtp`: DeepSeek-V3, Qwen3-Next, Qwen3.5), whose cache every pass of the target
//! brings up to the tokens it ran, or with Gemma 4's assistant (`--draft-model` naming one),
//! which reads the target's keys and values. Either's memory rides in the sequence's cache
//! ([`SequenceCache::enable_mtp`]); a proposal chains the head from the last position's hidden
//! state, sampling with the request's parameters, and its distributions go to verification.

use std::sync::Arc;

use peregrine_models::{CausalLm, Gemma4Assistant, KvOptions, ModelError, SequenceCache};
use peregrine_sampling::{Distribution, Sampler, SamplingParams};
use peregrine_tensor::device::in_compute_pool;

use super::draft_model::DRAFT_SEED_OFFSET;
use super::{DraftContext, DraftSource, Drafter, Proposal, draft_kv};
use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

/// Drafts with the target's MTP layer, which the engine then loads.
#[derive(Debug, Clone, Copy, Default)]
pub struct MtpDraft;

impl DraftSource for MtpDraft {
    fn name(&self) -> &str {
        "mtp"
    }

    fn loads_mtp(&self) -> bool {
        true
    }

    fn check(&self, target: &dyn CausalLm, _: &Tokenizer) -> Result<(), EngineError> {
        match target.mtp_spec() {
            Some(_) => Ok(()),
            None => Err(EngineError::Unsupported {
                param: "spec_mtp",
                message: format!(
                    "--spec-mtp: this {} model has no multi-token-prediction layer \
                     (DeepSeek-V3, Qwen3-Next and Qwen3.5 checkpoints carry one; quantized \
                     conversions often drop it): draft with --draft-model or --spec-ngram",
                    target.config().model_type
                ),
            }),
        }
    }

    fn prepare(&self, target: &dyn CausalLm, cache: &mut SequenceCache, kv: &KvOptions) {
        if let Some(spec) = target.mtp_spec() {
            cache.enable_mtp(&spec, &draft_kv(kv), target.config().hidden_size);
        }
    }

    fn start(
        &self,
        target: &Arc<dyn CausalLm>,
        sampling: &SamplingParams,
        _: &KvOptions,
    ) -> Box<dyn Drafter> {
        Box::new(Chain::new(target, None, sampling))
    }

    fn kv_bytes(&self, target: &dyn CausalLm, kv: &KvOptions, positions: usize) -> usize {
        let Some(spec) = target.mtp_spec() else {
            return 0;
        };
        let hidden = peregrine_models::MTP_HIDDEN_KEPT * target.config().hidden_size * 4;
        let head = crate::kv_budget::kv_bytes(target.config(), &spec, &draft_kv(kv), positions);
        head + hidden
    }
}

/// Drafts with Gemma 4's assistant (`--draft-model` naming a `gemma4_assistant` checkpoint),
/// which reads the target's keys and values and starts from its final hidden state.
pub struct AssistantDraft(pub Arc<Gemma4Assistant>);

impl DraftSource for AssistantDraft {
    fn name(&self) -> &str {
        "gemma4-assistant"
    }

    fn check(&self, target: &dyn CausalLm, _: &Tokenizer) -> Result<(), EngineError> {
        Ok(self.0.check(target)?)
    }

    fn prepare(&self, target: &dyn CausalLm, cache: &mut SequenceCache, kv: &KvOptions) {
        cache.enable_mtp(&[], kv, target.config().hidden_size);
    }

    fn start(
        &self,
        target: &Arc<dyn CausalLm>,
        sampling: &SamplingParams,
        _: &KvOptions,
    ) -> Box<dyn Drafter> {
        Box::new(Chain::new(target, Some(self.0.clone()), sampling))
    }

    fn kv_bytes(&self, target: &dyn CausalLm, _: &KvOptions, _: usize) -> usize {
        peregrine_models::MTP_HIDDEN_KEPT * target.config().hidden_size * 4
    }
}

/// One sequence's drafting: buffers reused from round to round.
struct Chain {
    model: Arc<dyn CausalLm>,
    /// Gemma 4's assistant; `None`: the target's MTP layer.
    assistant: Option<Arc<Gemma4Assistant>>,
    sampler: Sampler,
    hidden: Vec<f32>,
    out: Vec<f32>,
    logits: Vec<f32>,
    /// The generated tokens and those drafted so far (the penalties' view).
    seen: Vec<u32>,
}

impl Chain {
    fn new(
        target: &Arc<dyn CausalLm>,
        assistant: Option<Arc<Gemma4Assistant>>,
        sampling: &SamplingParams,
    ) -> Self {
        let mut sampling = sampling.clone();
        sampling.seed = sampling.seed.map(|s| s ^ DRAFT_SEED_OFFSET);
        Self {
            model: target.clone(),
            assistant,
            sampler: Sampler::new(sampling),
            hidden: Vec::new(),
            out: Vec::new(),
            logits: Vec::new(),
            seen: Vec::new(),
        }
    }
}

impl Drafter for Chain {
    fn propose(
        &mut self,
        context: DraftContext,
        max: usize,
        out: &mut Proposal,
    ) -> Result<(), EngineError> {
        out.clear();
        let len = context.target.len();
        let (Some(state), Some(&last)) = (context.target.mtp(), context.generated.last()) else {
            return Ok(());
        };
        // An MTP layer holds a row per position but the last, whose hidden state it joins with
        // the token the target runs next; lost to a deep rollback, it drafts nothing.
        let ready = len > 0 && (self.assistant.is_some() || state.cache().len() + 1 == len);
        let Some(hidden) = state.hidden_at(len.wrapping_sub(1)).filter(|_| ready) else {
            return Ok(());
        };
        self.hidden.clear();
        self.hidden.extend_from_slice(hidden);
        self.seen.clear();
        self.seen.extend_from_slice(context.generated);
        let model = self.model.as_ref();
        let mut token = last;
        let mut chained = 0;
        let drafted = (|| -> Result<(), ModelError> {
            for _ in 0..max {
                let (input, output) =
                    ((&self.hidden[..], token), (&mut self.logits, &mut self.out));
                in_compute_pool(|| match &self.assistant {
                    Some(a) => a.step(model, context.target, input, output),
                    None => {
                        let head = context.target.mtp().expect("checked above").cache();
                        model.mtp_step(input, head, output)
                    }
                })?;
                chained += 1;
                let mut dist = Distribution::default();
                let (prompt, seen) = (context.prompt, &self.seen);
                (self.sampler).distribution(&mut self.logits, prompt, seen, &mut dist);
                token = match dist.point() {
                    Some(t) => t,
                    None => self.sampler.draw_from(&dist),
                };
                out.tokens.push(token);
                out.dists.push(dist);
                self.seen.push(token);
                std::mem::swap(&mut self.hidden, &mut self.out);
            }
            Ok(())
        })();
        // An MTP layer's chained rows joined its guesses, not the target's states: forget
        // them (the assistant writes nothing).
        if self.assistant.is_none() {
            let head = context.target.mtp().expect("checked above").cache();
            head.trim(chained).map_err(ModelError::from)?;
        }
        Ok(drafted?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_models::Logits;
    use peregrine_tensor::candle::safetensors::load;
    use peregrine_tensor::{DType, Device};

    /// The first draft after a prefill is the head's prediction for the row that joins the last
    /// position's hidden state with the sampled token: transformers' MTP logits for the fixture
    /// prompt's last row (scripts/fixtures/add_mtp.py) give it. The chained rows are forgotten.
    #[test]
    fn the_first_draft_is_the_heads_prediction_and_the_chain_is_forgotten() {
        for arch in ["deepseek_v3", "qwen3_next", "qwen3_5", "qwen3_5_moe"] {
            let dir = super::super::tests::fixture_dir(arch);
            let model = super::super::tests::fixture_model(arch, true);
            let r = load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
            let ids: Vec<u32> = r["input_ids"]
                .to_dtype(DType::U32)
                .unwrap()
                .to_vec1()
                .unwrap();
            let n = ids.len();
            let want: u32 = (r["mtp_logits"].get(n - 2).unwrap())
                .argmax(0)
                .unwrap()
                .to_scalar()
                .unwrap();
            let kv = KvOptions::default();
            let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
            MtpDraft.prepare(model.as_ref(), &mut cache, &kv);
            model
                .forward(&ids[..n - 1], &mut cache, Logits::Last)
                .unwrap();
            let mut drafter = MtpDraft.start(&model, &SamplingParams::greedy(), &kv);
            let mut out = Proposal::default();
            for max in [1, 3] {
                let context = DraftContext {
                    prompt: &ids[..n - 1],
                    generated: &ids[n - 1..],
                    target: &mut cache,
                };
                drafter.propose(context, max, &mut out).unwrap();
                assert_eq!(out.tokens.len(), max, "{arch}");
                assert_eq!(out.tokens[0], want, "{arch}");
                assert_eq!(cache.mtp().unwrap().cache().len(), n - 2, "{arch}");
            }
        }
    }
}
