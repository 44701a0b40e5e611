//! The generation loop of one request: chunked prefill, then decode with sampling, stop
//! strings and incremental detokenization, until EOS, a stop string, the token budget or
//! cancellation.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use peregrine_models::{CausalLm, KvOptions, Logits, SequenceCache};
use peregrine_sampling::{Sampler, SamplingParams, token_logprobs};
use peregrine_tensor::Tensor;
use peregrine_tensor::device::in_compute_pool;

use crate::api::{Event, FinishReason, Request, Timings, Usage};
use crate::detok::{IncrementalDetokenizer, PROMPT_TAIL};
use crate::error::EngineError;
use crate::prompt_cache::PromptCache;
use crate::stop::StopMatcher;
use crate::tokenizer::Tokenizer;

/// Everything a generation needs besides the request.
pub(crate) struct GenContext<'a> {
    pub model: &'a dyn CausalLm,
    pub tokenizer: &'a Tokenizer,
    pub prefill_size: usize,
    pub max_context: usize,
    pub kv: KvOptions,
    /// KV bytes held by every running sequence together (see [`KvGauge`]).
    pub live_kv: &'a AtomicUsize,
    /// Finished sequences' caches, reused by prompt prefix.
    pub prompt_cache: &'a PromptCache,
    /// Prefills run, for `/metrics` (the `n` choices of a request share one).
    pub prefills: &'a AtomicU64,
    /// Test hook: a generation whose prompt mentions this panics after its first token.
    pub panic_marker: Option<&'a str>,
}

impl GenContext<'_> {
    /// Panics where the test hook says to, standing in for a bug in a forward pass.
    fn fault_point(&self, req: &Request, generated: usize) {
        if generated == 1
            && let Some(marker) = self.panic_marker
            && req.prompt.mentions(marker)
        {
            panic!("injected fault: the prompt mentions the panic marker `{marker}`");
        }
    }
}

/// This sequence's share of the engine's live KV bytes, kept current as its cache grows and
/// given back when the sequence ends (however it ends).
struct KvGauge<'a> {
    total: &'a AtomicUsize,
    mine: usize,
}

impl KvGauge<'_> {
    fn set(&mut self, bytes: usize) {
        if bytes >= self.mine {
            self.total.fetch_add(bytes - self.mine, Ordering::Relaxed);
        } else {
            self.total.fetch_sub(self.mine - bytes, Ordering::Relaxed);
        }
        self.mine = bytes;
    }
}

impl Drop for KvGauge<'_> {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Runs the prompt through the model in chunks of `prefill_size`, returning the last
/// position's logits (or every position's when `want` is `All`).
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
    Ok(Tensor::cat(&parts, 0).map_err(peregrine_models::ModelError::from)?)
}

fn last_row(logits: &Tensor) -> Result<Vec<f32>, EngineError> {
    let rows = logits.dim(0).map_err(peregrine_models::ModelError::from)?;
    let row = logits.get(rows - 1).and_then(|r| r.to_vec1::<f32>());
    Ok(row.map_err(peregrine_models::ModelError::from)?)
}

/// One choice of a request: whether its caller still listens, and where its events go.
pub(crate) struct Choice<'a> {
    pub cancel: &'a AtomicBool,
    /// Sends an event; false once the receiver is gone.
    pub send: &'a mut dyn FnMut(Event) -> bool,
    /// Set when the choice's `Done` was sent.
    pub done: bool,
}

/// Generates every choice of `req`, whose prompt is `ids`: one prefill, then each choice decodes
/// from its own copy of the prompt's cache (the last one from the cache itself), one after
/// another. Returns when all are done.
pub(crate) fn generate(
    ctx: &GenContext,
    req: &Request,
    ids: &[u32],
    queued: Duration,
    choices: &mut [Choice],
) -> Result<(), EngineError> {
    let started = Instant::now();
    let (mut cache, cached) = (ctx.prompt_cache.lookup(ids, &ctx.kv))
        .unwrap_or_else(|| (SequenceCache::new(&ctx.model.cache_spec(), &ctx.kv), 0));
    let mut gauge = KvGauge {
        total: ctx.live_kv,
        mine: 0,
    };
    let logits = last_row(&prefill(
        ctx.model,
        &ids[cached..],
        &mut cache,
        ctx.prefill_size,
        Logits::Last,
    )?)?;
    ctx.prefills.fetch_add(1, Ordering::Relaxed);
    gauge.set(cache.bytes());
    let prompt = Prefilled {
        ids,
        cached,
        logits,
        started,
        timings: Timings {
            queued,
            prefill: started.elapsed(),
            ..Timings::default()
        },
    };
    let live: Vec<usize> = (0..choices.len())
        .filter(|&j| !choices[j].cancel.load(Ordering::Relaxed))
        .collect();
    let mut base = Some(cache);
    for (k, &j) in live.iter().enumerate() {
        let cache = match k + 1 == live.len() {
            true => base.take(),
            false => (base.as_ref().map(SequenceCache::snapshot).transpose())
                .map_err(peregrine_models::ModelError::from)?,
        };
        let Some(cache) = cache else { break };
        let kept = base.as_ref().map_or(0, SequenceCache::bytes);
        let mut sampling = req.sampling.clone();
        sampling.seed = sampling.seed.map(|s| s.wrapping_add(j as u64));
        let choice = &mut choices[j];
        decode_choice(
            ctx,
            req,
            &prompt,
            sampling,
            cache,
            (&mut gauge, kept),
            choice,
        )?;
        choice.done = true;
    }
    Ok(())
}

/// A request's prompt after its prefill, shared by its choices.
struct Prefilled<'a> {
    ids: &'a [u32],
    /// Prompt tokens that came from the prompt cache.
    cached: usize,
    /// The last prompt position's logits.
    logits: Vec<f32>,
    started: Instant,
    /// Queue and prefill times.
    timings: Timings,
}

/// Decodes one choice from `cache` (holding the prompt) until EOS, a stop string, the token
/// budget or cancellation, then stores the cache in the prompt cache. `gauge` counts this
/// cache's bytes on top of `kept`, the bytes of the prompt's cache held for later choices.
fn decode_choice(
    ctx: &GenContext,
    req: &Request,
    prompt: &Prefilled,
    sampling: SamplingParams,
    mut cache: SequenceCache,
    (gauge, kept): (&mut KvGauge, usize),
    choice: &mut Choice,
) -> Result<(), EngineError> {
    let ids = prompt.ids;
    let budget = req
        .max_tokens
        .unwrap_or(usize::MAX)
        .min(ctx.max_context - ids.len());
    let mut timings = prompt.timings;
    let mut logits = prompt.logits.clone();
    let mut sampler = Sampler::new(sampling);
    let mut detok = IncrementalDetokenizer::new(&ids[ids.len().saturating_sub(PROMPT_TAIL)..]);
    let mut stop = StopMatcher::new(&req.stop);
    let decode = |t: &[u32]| ctx.tokenizer.decode(t, true);
    let mut generated: Vec<u32> = Vec::new();
    let mut decode_started = None;
    let finish = loop {
        if choice.cancel.load(Ordering::Relaxed) {
            break FinishReason::Cancelled;
        }
        // Logprobs are reported on the raw distribution; sampling rewrites `logits` in place.
        let raw = req.logprobs.map(|_| logits.clone());
        let token = sampler.sample(&mut logits, ids, &generated);
        generated.push(token);
        if generated.len() == 1 {
            timings.time_to_first_token = prompt.started.elapsed();
            decode_started = Some(Instant::now());
        }
        let logprobs: Vec<_> = raw
            .iter()
            .map(|raw| token_logprobs(raw, token, req.logprobs.unwrap_or(0)))
            .collect();
        let is_eos = !req.ignore_eos && ctx.tokenizer.is_eos(token);
        let text = if is_eos {
            String::new()
        } else {
            detok.step(token, decode)?
        };
        let step = stop.push(&text);
        if !(choice.send)(Event::Delta {
            text: step.emit,
            tokens: vec![token],
            logprobs,
        }) {
            break FinishReason::Cancelled;
        }
        if step.stopped || is_eos {
            break FinishReason::Stop;
        }
        if generated.len() >= budget {
            break FinishReason::Length;
        }
        ctx.fault_point(req, generated.len());
        in_compute_pool(|| ctx.model.decode(token, &mut cache, &mut logits))?;
        gauge.set(kept + cache.bytes());
    };
    if finish != FinishReason::Cancelled && !stop.is_stopped() {
        let tail = detok.finish(decode)?;
        let mut text = stop.push(&tail).emit;
        if !stop.is_stopped() {
            text.push_str(&stop.finish());
        }
        if !text.is_empty() {
            (choice.send)(Event::Delta {
                text,
                tokens: vec![],
                logprobs: vec![],
            });
        }
    }
    if let Some(t) = decode_started {
        timings.decode = t.elapsed();
        timings.decode_tokens = generated.len().saturating_sub(1);
    }
    timings.kv_bytes = cache.bytes();
    let usage = Usage {
        prompt_tokens: ids.len(),
        completion_tokens: generated.len(),
        cached_tokens: prompt.cached,
    };
    // The cache holds the prompt and every generated token but the last (never fed back).
    let mut held: Vec<u32> = ids.iter().chain(&generated).copied().collect();
    held.truncate(cache.len());
    gauge.set(kept);
    ctx.prompt_cache.store(held, cache, ctx.kv);
    (choice.send)(Event::Done {
        finish,
        usage,
        timings,
    });
    Ok(())
}
