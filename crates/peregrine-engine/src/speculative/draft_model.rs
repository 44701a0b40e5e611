//! A draft model: a smaller (or more quantized) model with the target's vocabulary runs ahead
//! token by token, sampling with the request's parameters; its distributions go to
//! verification.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use peregrine_models::{
    CausalLm, KvOptions, LoadOptions, Logits, ModelError, SequenceCache, open_model,
};
use peregrine_sampling::{Distribution, Sampler, SamplingParams};
use peregrine_tensor::device::in_compute_pool;

use super::{DraftContext, DraftSource, Drafter, Proposal};
use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

/// Seeds of draft samplers are the request's, moved by this so that the draft's draws and the
/// verification's are not the same numbers.
pub(super) const DRAFT_SEED_OFFSET: u64 = 0x5eed_d4af_7000_0001;

/// Drafts with a second model (`--draft-model`). Its vocabulary must be the target's: the
/// engine checks that when it starts ([`DraftSource::check`]).
pub struct DraftModel {
    model: Arc<dyn CausalLm>,
    /// Its tokenizer, when loaded from a checkpoint (the vocabulary check reads it).
    tokenizer: Option<Tokenizer>,
    path: PathBuf,
    prefill_size: usize,
}

impl DraftModel {
    /// Drafts with `model`, prefilling a context in chunks of `prefill_size`; with no
    /// tokenizer, only the vocabulary's size is checked.
    pub fn new(model: Arc<dyn CausalLm>, prefill_size: usize) -> Self {
        Self {
            model,
            tokenizer: None,
            path: PathBuf::new(),
            prefill_size: prefill_size.max(1),
        }
    }

    /// Loads the draft model at `path` (a GGUF file or checkpoint folder) with its tokenizer.
    pub fn load(path: &Path, opts: &LoadOptions, prefill_size: usize) -> Result<Self, EngineError> {
        let open = open_model(path, opts)?;
        let tokenizer = match open.gguf() {
            Some(gguf) => Tokenizer::from_gguf(gguf.metadata())?,
            None => Tokenizer::from_dir(path)?,
        };
        let model = open.load()?.model;
        Ok(Self {
            tokenizer: Some(tokenizer),
            path: path.to_path_buf(),
            ..Self::new(model, prefill_size)
        })
    }

    /// The draft model.
    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.model
    }

    /// Fails unless the draft's vocabulary is the target's: the same size (a few padding rows
    /// of the output head aside) and every token the same text.
    fn check_vocabulary(&self, target: &dyn CausalLm, tokenizer: &Tokenizer) -> Result<(), String> {
        let (t, d) = (target.config().vocab_size, self.model.config().vocab_size);
        // Output heads are often padded to a multiple of 64 or 128; llama.cpp allows 128.
        if t.abs_diff(d) > 128 {
            return Err(format!(
                "the draft model's vocabulary has {d} tokens and the target's {t}: a draft \
                 model must share the target's tokenizer"
            ));
        }
        let Some(draft) = &self.tokenizer else {
            return Ok(());
        };
        for id in 0..t.min(d) as u32 {
            let (a, b) = (tokenizer.id_to_token(id), draft.id_to_token(id));
            if a != b {
                return Err(format!(
                    "token {id} is {a:?} in the target's vocabulary and {b:?} in the draft \
                     model's: a draft model must share the target's tokenizer"
                ));
            }
        }
        Ok(())
    }
}

impl DraftSource for DraftModel {
    fn name(&self) -> &str {
        "draft-model"
    }

    fn check(&self, target: &dyn CausalLm, tokenizer: &Tokenizer) -> Result<(), EngineError> {
        (self.check_vocabulary(target, tokenizer))
            .map_err(|why| ModelError::config(&self.path, why).into())
    }

    fn kv_bytes(&self, _: &dyn CausalLm, kv: &KvOptions, positions: usize) -> usize {
        let model = self.model.as_ref();
        let kv = super::draft_kv(kv);
        crate::kv_budget::kv_bytes(model.config(), &model.cache_spec(), &kv, positions)
    }

    fn start(
        &self,
        _: &Arc<dyn CausalLm>,
        sampling: &SamplingParams,
        kv: &KvOptions,
    ) -> Box<dyn Drafter> {
        let mut sampling = sampling.clone();
        sampling.seed = sampling.seed.map(|s| s ^ DRAFT_SEED_OFFSET);
        Box::new(Running {
            cache: SequenceCache::new(&self.model.cache_spec(), kv),
            model: self.model.clone(),
            kv: *kv,
            prefill_size: self.prefill_size,
            sampler: Sampler::new(sampling),
            fed: Vec::new(),
            logits: Vec::new(),
            seen: Vec::new(),
            context: Vec::new(),
        })
    }
}

/// One sequence's draft: the draft model's cache holds `fed`.
struct Running {
    model: Arc<dyn CausalLm>,
    kv: KvOptions,
    prefill_size: usize,
    cache: SequenceCache,
    sampler: Sampler,
    fed: Vec<u32>,
    logits: Vec<f32>,
    /// `generated` and the tokens drafted so far (the penalties' view).
    seen: Vec<u32>,
    /// The prompt and `generated`, rebuilt each round in a kept buffer.
    context: Vec<u32>,
}

impl Running {
    /// Brings the cache to `context` but its last token, whose logits come from feeding it.
    fn catch_up(&mut self, context: &[u32]) -> Result<(), EngineError> {
        let common = (self.fed.iter().zip(context))
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        let extra = self.fed.len() - common;
        if extra > 0 && self.cache.trim(extra).is_err() {
            // Deeper than the cache can roll back (a recurrent draft): start over.
            self.cache = SequenceCache::new(&self.model.cache_spec(), &self.kv);
            self.fed.clear();
            return self.catch_up(context);
        }
        self.fed.truncate(common);
        let model = self.model.as_ref();
        let rest = &context[common..];
        if let [token] = rest {
            in_compute_pool(|| model.decode(*token, &mut self.cache, &mut self.logits))?;
        } else {
            for chunk in rest.chunks(self.prefill_size) {
                let row = in_compute_pool(|| model.forward(chunk, &mut self.cache, Logits::Last))?;
                self.logits = (row.flatten_all().and_then(|r| r.to_vec1::<f32>()))
                    .map_err(ModelError::from)?;
            }
        }
        self.fed.extend_from_slice(rest);
        Ok(())
    }
}

impl Drafter for Running {
    fn propose(
        &mut self,
        context: DraftContext,
        max: usize,
        out: &mut Proposal,
    ) -> Result<(), EngineError> {
        let (prompt, generated) = (context.prompt, context.generated);
        out.clear();
        if max == 0 {
            return Ok(());
        }
        let mut context = std::mem::take(&mut self.context);
        context.clear();
        context.extend(prompt.iter().chain(generated));
        let caught_up = self.catch_up(&context);
        self.context = context;
        caught_up?;
        self.seen.clear();
        self.seen.extend_from_slice(generated);
        for i in 0..max {
            let mut dist = Distribution::default();
            (self.sampler).distribution(&mut self.logits, prompt, &self.seen, &mut dist);
            let token = match dist.point() {
                Some(t) => t,
                None => self.sampler.draw_from(&dist),
            };
            out.tokens.push(token);
            out.dists.push(dist);
            self.seen.push(token);
            if i + 1 < max {
                let model = self.model.as_ref();
                in_compute_pool(|| model.decode(token, &mut self.cache, &mut self.logits))?;
                self.fed.push(token);
            }
        }
        Ok(())
    }
}
