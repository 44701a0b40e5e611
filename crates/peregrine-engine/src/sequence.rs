//! A request's life as the scheduler ([`crate::scheduler`]) sees it: a [`Prefilling`] prompt,
//! fed a chunk per step, that becomes one [`Decoding`] choice per `n` once its last position's
//! logits arrive; each choice then samples a token per step, with stop strings and
//! incremental detokenization, until EOS, a stop string, the token budget or cancellation.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use peregrine_models::{CausalLm, KvOptions, Logits, ModelError, SequenceCache};
use peregrine_sampling::{Distribution, Sampler, Verdict, token_logprobs};
use peregrine_tensor::Tensor;
use peregrine_tensor::device::in_compute_pool;

use crate::api::{Event, FinishReason, Request, Timings, Usage};
use crate::constraint::{ChoiceMatcher, Constraint};
use crate::detok::{IncrementalDetokenizer, PROMPT_TAIL};
use crate::engine::{Job, Shared};
use crate::error::EngineError;
use crate::kv_budget::KvGauge;
use crate::speculative::{DraftContext, Speculation};
use crate::stop::StopMatcher;
use crate::stream::ChoiceSink;

/// Runs the prompt through the model in chunks of `prefill_size`, returning the last
/// position's logits (or every position's when `want` is `All`): the parity tool's path.
pub(crate) fn prefill(
    model: &dyn CausalLm,
    ids: &[u32],
    cache: &mut SequenceCache,
    prefill_size: usize,
    want: Logits,
) -> Result<Tensor, EngineError> {
    let chunks: Vec<&[u32]> = ids.chunks(prefill_size.max(1)).collect();
    let mut parts = Vec::with_capacity(chunks.len());
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        // Intermediate chunks only fill the cache; their last-position logits are cheap.
        let want = if last || want == Logits::All {
            want
        } else {
            Logits::Last
        };
        let logits = in_compute_pool(|| model.forward(chunk, cache, want))?;
        if want == Logits::All || last {
            parts.push(logits);
        }
    }
    Ok(Tensor::cat(&parts, 0).map_err(ModelError::from)?)
}

/// A request whose prompt is being prefilled, a chunk per step.
pub(crate) struct Prefilling {
    pub job: Job,
    pub cache: SequenceCache,
    /// Prompt tokens taken from the prompt cache.
    pub cached: usize,
    /// Prompt tokens in the cache so far.
    pub fed: usize,
    started: Instant,
    queued: Duration,
    gauge: KvGauge,
    /// The request's share of the KV budget, held until its last choice ends.
    reservation: Arc<KvGauge>,
}

impl Prefilling {
    /// Starts `job`, taking what the prompt cache holds of its prompt.
    pub fn start(shared: &Shared, job: Job) -> Self {
        let queued = job.submitted.elapsed();
        let top_k = job.request.moe_top_k;
        // Keyed with image tokens named by their pictures; never reused into an image's run.
        let limit = |n| crate::media::reusable(&job.images, n);
        let key = match job.cache_key.is_empty() {
            true => &job.ids,
            false => &job.cache_key,
        };
        let found = (shared.prompt_cache).lookup_within(key, &job.kv, top_k, &limit);
        let (mut cache, cached) = found.unwrap_or_else(|| {
            let mut cache = SequenceCache::new(&shared.model.cache_spec(), &job.kv);
            cache.set_moe_top_k(top_k);
            (cache, 0)
        });
        match shared.speculation_for(&job.request) {
            Some(spec) => (spec.source).prepare(shared.model.as_ref(), &mut cache, &job.kv),
            None => cache.disable_mtp(),
        }
        let gauge = KvGauge::holding(&shared.live_kv, cache.bytes());
        let reservation = Arc::new(KvGauge::holding(&shared.kv_reserved, job.reserve));
        Self {
            job,
            reservation,
            cache,
            cached,
            fed: cached,
            started: Instant::now(),
            queued,
            gauge,
        }
    }

    /// Whether no choice listens any more.
    pub fn abandoned(&self) -> bool {
        self.job.choices.iter().all(ChoiceSink::cancelled)
    }

    /// The prompt tokens not yet in the cache.
    pub fn remaining(&self) -> usize {
        self.job.ids.len() - self.fed
    }

    /// Records `n` more prompt tokens in the cache.
    pub fn record_fed(&mut self, n: usize) {
        self.fed += n;
        self.gauge.set(self.cache.bytes());
    }

    /// The prompt is in the cache and `logits` are its last position's: one choice per live
    /// sink, each decoding from its own copy of the cache (the last from the cache itself).
    pub fn into_choices(
        self,
        shared: &Shared,
        logits: Vec<f32>,
    ) -> Result<Vec<Decoding>, EngineError> {
        shared.prefills.fetch_add(1, Ordering::Relaxed);
        let Job {
            request,
            kv,
            ids,
            choices,
            positions,
            images,
            cache_key,
            ..
        } = self.job;
        // Only a prompt with images is keyed otherwise than by its ids.
        let cache_key: Option<Arc<[u32]>> = (!images.is_empty()).then(|| cache_key.into());
        let (request, ids): (Arc<Request>, Arc<[u32]>) = (Arc::new(request), ids.into());
        let timings = Timings {
            queued: self.queued,
            prefill: self.started.elapsed(),
            ..Timings::default()
        };
        let live: Vec<(usize, ChoiceSink)> = (choices.into_iter().enumerate())
            .filter(|(_, c)| !c.cancelled())
            .collect();
        let mut base = Some(self.cache);
        let mut prefill_gauge = Some(self.gauge);
        let count = live.len();
        let mut out = Vec::with_capacity(count);
        for (k, (j, sink)) in live.into_iter().enumerate() {
            let last = k + 1 == count;
            let cache = match (last, &base) {
                (true, _) => base.take(),
                (false, Some(c)) => Some(c.snapshot().map_err(ModelError::from)?),
                (false, None) => None,
            };
            let Some(cache) = cache else { break };
            let mut sampling = request.sampling.clone();
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(j as u64));
            // The context, or the positions the request's KV reservation holds.
            let room = shared.max_context.min(positions) - ids.len();
            let budget = (request.max_tokens.unwrap_or(usize::MAX)).min(room);
            // The last choice takes over the prefill's gauge: counting its cache twice, even
            // for a moment, would report more KV in use than is held.
            let gauge = match (last, prefill_gauge.take()) {
                (true, Some(mut g)) => {
                    g.set(cache.bytes());
                    g
                }
                (_, g) => {
                    prefill_gauge = g;
                    KvGauge::holding(&shared.live_kv, cache.bytes())
                }
            };
            let speculation = (shared.speculation_for(&request))
                .map(|config| Speculation::start(config, &shared.model, &sampling, &kv));
            out.push(Decoding {
                spec: speculation,
                detok: IncrementalDetokenizer::new(&ids[ids.len().saturating_sub(PROMPT_TAIL)..]),
                stop: StopMatcher::new(&request.stop),
                sampler: Sampler::new(sampling),
                matcher: request.constraint.as_ref().map(Constraint::start),
                request: request.clone(),
                ids: ids.clone(),
                cache_key: cache_key.clone(),
                sink,
                cache,
                kv,
                gauge,
                _reservation: self.reservation.clone(),
                cached: self.cached,
                budget,
                rows: vec![logits.clone()],
                generated: Vec::new(),
                feed: Vec::new(),
                timings,
                started: self.started,
                decode_started: None,
            });
        }
        Ok(out)
    }
}

/// One choice generating: it holds the logits of its last position (or of every position a
/// speculative pass ran) until the scheduler asks for the next token
/// ([`advance`](Self::advance)).
pub(crate) struct Decoding {
    request: Arc<Request>,
    ids: Arc<[u32]>,
    /// The prompt as the prompt cache keys it, where that differs from `ids` (images).
    cache_key: Option<Arc<[u32]>>,
    pub sink: ChoiceSink,
    pub cache: SequenceCache,
    kv: KvOptions,
    gauge: KvGauge,
    _reservation: Arc<KvGauge>,
    cached: usize,
    budget: usize,
    /// The logits of each position the last pass ran for it: one row, or one per token of
    /// `feed` when it carried drafts (sampling rewrites them in place).
    pub rows: Vec<Vec<f32>>,
    sampler: Sampler,
    /// Where the choice stands in its grammar, for constrained output.
    matcher: Option<ChoiceMatcher>,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    generated: Vec<u32>,
    /// The tokens the next step feeds: the last token chosen, then any drafted after it.
    pub feed: Vec<u32>,
    /// Drafting state, when this choice decodes speculatively.
    spec: Option<Speculation>,
    timings: Timings,
    started: Instant,
    decode_started: Option<Instant>,
}

impl Decoding {
    /// Drafts the tokens the next pass verifies after `feed[0]`, when this choice speculates
    /// and its draft length and token budget leave room.
    pub fn draft(&mut self, shared: &Shared) {
        self.feed.truncate(1);
        let Some(spec) = &mut self.spec else { return };
        // The pass's tokens all fit the budget: kept drafts and the bonus token after them.
        let room = self.budget.saturating_sub(self.generated.len() + 1);
        let context = DraftContext {
            prompt: &self.ids,
            generated: &self.generated,
            target: &mut self.cache,
        };
        let feed = &mut self.feed;
        let drafted = catch_unwind(AssertUnwindSafe(|| spec.draft(context, room, shared, feed)));
        let drafted =
            drafted.unwrap_or_else(|_| Err(EngineError::Internal("a drafter panicked".into())));
        if let Err(e) = drafted {
            tracing::warn!("drafting failed; the sequence goes on without: {e}");
            self.feed.truncate(1);
            self.spec = None;
        }
    }

    /// Chooses the next token(s) from `self.rows` and sends them: one sampled token, or the
    /// verified drafts of a speculative pass and the token after them. `step_secs` is the
    /// pass's time. `Ok(None)`: `feed[0]` goes into the next step; `Ok(Some(finish))`: the
    /// choice is over (not yet finished: call [`finish`](Self::finish)).
    pub fn advance(
        &mut self,
        shared: &Shared,
        step_secs: f64,
    ) -> Result<Option<FinishReason>, EngineError> {
        if self.sink.cancelled() {
            return Ok(Some(FinishReason::Cancelled));
        }
        if self.feed.len() > 1 {
            return self.advance_drafted(shared, step_secs);
        }
        if let Some(spec) = self.spec.as_mut().filter(|_| !self.generated.is_empty()) {
            spec.record(0, 0, step_secs);
        }
        let mut logits = std::mem::take(&mut self.rows[0]);
        mask_padding(&mut logits, shared.tokenizer.vocab_size());
        // Logprobs are reported on the raw distribution; sampling rewrites `logits` in place.
        let raw = self.request.logprobs.map(|_| logits.clone());
        if let Some(m) = &mut self.matcher {
            m.mask(&mut logits)?;
        }
        let token = (self.sampler).sample(&mut logits, &self.ids, &self.generated);
        self.rows[0] = logits;
        self.emit(shared, token, raw.as_deref())
    }

    /// Verifies the drafted tokens of `feed` against the pass's rows, in order: each kept
    /// token is sent; the first rejected one is replaced and the cache trimmed back to it;
    /// when all are kept, a bonus token is drawn from the last row.
    fn advance_drafted(
        &mut self,
        shared: &Shared,
        step_secs: f64,
    ) -> Result<Option<FinishReason>, EngineError> {
        let drafted = self.feed.len() - 1;
        let mut spec = self
            .spec
            .take()
            .expect("drafts come from a speculating choice");
        let mut kept = 0;
        let mut dist = Distribution::default();
        let mut outcome = Ok(None);
        for i in 0..=drafted {
            let mut row = std::mem::take(&mut self.rows[i]);
            mask_padding(&mut row, shared.tokenizer.vocab_size());
            let raw = self.request.logprobs.map(|_| row.clone());
            (self.sampler).distribution(&mut row, &self.ids, &self.generated, &mut dist);
            let (token, stands) = match spec.drafts().get(i) {
                Some(&t) => match self.sampler.verify(&dist, t, spec.proposal_dist(i)) {
                    Verdict::Accept => (t, true),
                    Verdict::Replace(r) => (r, false),
                },
                None => (
                    dist.point()
                        .unwrap_or_else(|| self.sampler.draw_from(&dist)),
                    false,
                ),
            };
            if stands {
                kept += 1;
            } else if i < drafted {
                // The cache ran every draft: forget those from the rejected one on.
                if let Err(e) = self.cache.trim(drafted - i) {
                    outcome = Err(ModelError::from(e).into());
                    break;
                }
            }
            outcome = self.emit(shared, token, raw.as_deref());
            if !stands || !matches!(outcome, Ok(None)) {
                break;
            }
        }
        spec.record(drafted, kept, step_secs);
        shared.spec_counters.verified(drafted, kept);
        self.spec = Some(spec);
        outcome
    }

    /// Sends `token` (chosen from logits `raw`, when logprobs are asked for) and decides
    /// whether the choice goes on.
    fn emit(
        &mut self,
        shared: &Shared,
        token: u32,
        raw: Option<&[f32]>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let req = &self.request;
        self.generated.push(token);
        if self.generated.len() == 1 {
            self.timings.time_to_first_token = self.started.elapsed();
            self.decode_started = Some(Instant::now());
        }
        let logprobs: Vec<_> = (raw.iter())
            .map(|raw| token_logprobs(raw, token, req.logprobs.unwrap_or(0)))
            .collect();
        let is_eos = !req.ignore_eos && shared.tokenizer.is_eos(token);
        let mut complete = false;
        if let Some(m) = self.matcher.as_mut().filter(|_| !is_eos) {
            m.consume(token)?;
            complete = m.is_done();
        }
        let text = match is_eos {
            true => String::new(),
            false => {
                let skip = !req.special_tokens;
                (self.detok).step(token, |t| shared.tokenizer.decode(t, skip))?
            }
        };
        let step = self.stop.push(&text);
        let delta = Event::Delta {
            text: step.emit,
            tokens: vec![token],
            logprobs,
        };
        if self.sink.events.send(delta).is_err() {
            return Ok(Some(FinishReason::Cancelled));
        }
        if step.stopped || is_eos || complete {
            return Ok(Some(FinishReason::Stop));
        }
        if self.generated.len() >= self.budget {
            return Ok(Some(FinishReason::Length));
        }
        shared.fault_point(req, self.generated.len());
        self.feed.clear();
        self.feed.push(token);
        Ok(None)
    }

    /// Records the fed token's new cache size.
    pub fn stepped(&mut self) {
        self.gauge.set(self.cache.bytes());
    }

    /// Sends the held-back text and `Done`, and leaves the cache to the prompt cache.
    pub fn finish(mut self, shared: &Shared, finish: FinishReason) -> Result<(), EngineError> {
        let skip = !self.request.special_tokens;
        let decode = |t: &[u32]| shared.tokenizer.decode(t, skip);
        if finish != FinishReason::Cancelled && !self.stop.is_stopped() {
            let tail = self.detok.finish(decode)?;
            let mut text = self.stop.push(&tail).emit;
            if !self.stop.is_stopped() {
                text.push_str(&self.stop.finish());
            }
            if !text.is_empty() {
                let _ = self.sink.events.send(Event::Delta {
                    text,
                    tokens: vec![],
                    logprobs: vec![],
                });
            }
        }
        let mut timings = self.timings;
        if let Some(t) = self.decode_started {
            timings.decode = t.elapsed();
            timings.decode_tokens = self.generated.len().saturating_sub(1);
        }
        timings.kv_bytes = self.cache.bytes();
        let usage = Usage {
            prompt_tokens: self.ids.len(),
            completion_tokens: self.generated.len(),
            cached_tokens: self.cached,
        };
        // The cache holds the prompt and every generated token but the last (never fed back),
        // keyed as the prompt cache keys prompts.
        let prompt = self.cache_key.as_deref().unwrap_or(&self.ids);
        let mut held: Vec<u32> = prompt.iter().chain(&self.generated).copied().collect();
        held.truncate(self.cache.len());
        // A choice that ended on a kept draft has run drafts past it.
        let excess = self.cache.len() - held.len();
        let whole = excess == 0 || self.cache.trim(excess).is_ok();
        self.gauge.set(0);
        let stop_string = self.stop.matched().map(str::to_string);
        if whole {
            shared.prompt_cache.store(held, self.cache, self.kv);
        }
        let _ = self.sink.events.send(Event::Done {
            finish,
            usage,
            timings,
            stop_string,
        });
        Ok(())
    }
}

/// Rules out the ids past the tokenizer's `vocab` that a padded output head has (Gemma 3's
/// 262,208 rows for 262,144 tokens): no text stands for them, so they are never drawn (as vLLM
/// cuts its logits to the tokenizer's vocabulary).
fn mask_padding(logits: &mut [f32], vocab: usize) {
    if let Some(padding) = logits.get_mut(vocab..) {
        padding.fill(f32::NEG_INFINITY);
    }
}
