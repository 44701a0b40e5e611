//! The step scheduler (continuous batching): one thread advances every sequence in flight
//! together, one forward pass per step. Each step admits waiting requests while fewer than
//! `parallel` sequences run, gives every decoding choice its next token and the prompts
//! being prefilled what is left of the step's token budget (`batch_tokens`, and at most
//! `prefill_while_decoding` while any choice decodes; prompts longer than one chunk get fewer,
//! as many as keep the mean step within `decode_stretch` of a decode-only one ([`Pacer`]); in
//! arrival order, chunks of at most `prefill_size`), so a long prompt does not stall the
//! decodes, and runs them
//! all through [`CausalLm::forward_batch`](peregrine_models::CausalLm::forward_batch).
//! Cancelled and finished sequences leave before the next pass, with their KV. A request whose
//! KV reservation does not fit the budget beside the running ones' waits, at the head of the
//! queue ([`crate::kv_budget`]).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use peregrine_models::{BatchSeq, Logits, ModelError};
use peregrine_tensor::device::in_compute_pool;
use peregrine_tensor::ops::rows_into;

use crate::api::{Event, FinishReason};
use crate::engine::{Job, Shared};
use crate::error::EngineError;
use crate::pacing::Pacer;
use crate::sequence::{Decoding, Prefilling};

/// How much one step may take.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    /// Sequences running at once.
    pub parallel: usize,
    /// Tokens per forward pass.
    pub batch_tokens: usize,
    /// Prompt tokens per pass while some sequence decodes.
    pub prefill_while_decoding: usize,
    /// Longest mean step while long prompts are paced, as a multiple of a step of decodes
    /// alone.
    pub decode_stretch: f64,
}

/// Runs requests from `queue` until the engine is dropped and nothing is left to run.
pub(crate) fn run(shared: &Shared, queue: Receiver<Job>, budget: Budget) {
    let parallel = budget.parallel;
    let mut prefilling: VecDeque<Prefilling> = VecDeque::new();
    let mut decoding: Vec<Decoding> = Vec::new();
    let mut pacer = Pacer::new(budget.decode_stretch);
    // The next request, waiting for its KV reservation to fit the budget.
    let mut held: Option<Job> = None;
    let mut open = true;
    loop {
        while (open || held.is_some()) && prefilling.len() + decoding.len() < parallel.max(1) {
            let idle = prefilling.is_empty() && decoding.is_empty();
            let job = match (held.take(), idle) {
                (Some(job), _) => Ok(job),
                (None, true) => queue.recv().map_err(|_| TryRecvError::Disconnected),
                (None, false) => queue.try_recv(),
            };
            match job {
                // Its streams are gone: nothing to run it for.
                Ok(job) if job.choices.iter().all(|c| c.cancelled()) => {}
                // A request alone always runs (its reservation fit the budget when it came).
                Ok(job) if !idle && !fits(shared, &job) => {
                    held = Some(job);
                    break;
                }
                Ok(job) => prefilling.push_back(Prefilling::start(shared, job)),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        prefilling.retain(|p| !p.abandoned());
        for d in std::mem::take(&mut decoding) {
            match d.sink.cancelled() {
                true => end(shared, d, Ok(FinishReason::Cancelled)),
                false => decoding.push(d),
            }
        }
        publish_running(shared, &prefilling, &decoding);
        if prefilling.is_empty() && decoding.is_empty() {
            if !open && held.is_none() {
                return;
            }
            continue;
        }
        step(shared, &mut prefilling, &mut decoding, budget, &mut pacer);
        // Current before the next wait for a request, which may block while idle.
        publish_running(shared, &prefilling, &decoding);
    }
}

/// Whether `job`'s KV reservation fits beside the running requests'.
fn fits(shared: &Shared, job: &Job) -> bool {
    let reserved = shared.kv_reserved.load(Ordering::Relaxed);
    reserved.saturating_add(job.reserve) <= shared.kv_budget
}

/// Shows `/metrics` how many sequences are in flight.
fn publish_running(shared: &Shared, prefilling: &VecDeque<Prefilling>, decoding: &[Decoding]) {
    (shared.running).store(prefilling.len() + decoding.len(), Ordering::Relaxed);
}

/// One forward pass over every decoding choice and the prompt chunks the budget allows, then
/// each sequence's next move.
fn step(
    shared: &Shared,
    prefilling: &mut VecDeque<Prefilling>,
    decoding: &mut Vec<Decoding>,
    limits: Budget,
    pacer: &mut Pacer,
) {
    // Decodes first, a token each; prompts share what is left, in arrival order.
    // A prompt short enough for one chunk takes it at once (one step's bump, where pacing
    // would hold it back for many); longer ones are paced.
    let short = |p: &Prefilling| p.job.ids.len() - p.cached <= shared.prefill_size;
    let waiting = prefilling.iter().any(|p| !short(p));
    let mut room = limits.batch_tokens.saturating_sub(decoding.len());
    let mut paced = room;
    if !decoding.is_empty() {
        room = room.min(limits.prefill_while_decoding);
        if waiting {
            paced = pacer.prompt_budget(decoding.len(), room);
        }
    }
    let mut unpaced = 0;
    let chunks: Vec<usize> = (prefilling.iter())
        .map(|p| {
            let is_short = short(p);
            let k = match is_short {
                true => p.remaining().min(room),
                false => p.remaining().min(room).min(paced).min(shared.prefill_size),
            };
            // An image's run of tokens goes whole into one pass.
            let k = crate::media::fit_chunk(&p.job.images, p.fed, k);
            match is_short {
                true => unpaced += k,
                false => paced = paced.saturating_sub(k),
            }
            room = room.saturating_sub(k);
            k
        })
        .collect();
    // Speculating choices draft the tokens this pass verifies.
    decoding.iter_mut().for_each(|d| d.draft(shared));
    let start = Instant::now();
    let pass = catch_unwind(AssertUnwindSafe(|| {
        forward(shared, prefilling, decoding, &chunks)
    }));
    let secs = start.elapsed().as_secs_f64();
    // The pacer learns from steps without short prompts (their bump is not its doing).
    if unpaced == 0 {
        pacer.record(decoding.len(), chunks.iter().sum(), waiting, secs);
    }
    let rows = match pass {
        Ok(Ok(rows)) => rows,
        failed => {
            let why = match failed {
                Ok(Err(e)) => e.to_string(),
                Err(panic) => panic_text(panic),
                Ok(Ok(_)) => unreachable!("handled above"),
            };
            tracing::error!("a forward pass failed: {why}");
            let why = format!("generation failed: {why}");
            // Every sequence of the pass is lost; prompts that sat it out go on.
            for d in decoding.drain(..) {
                end(shared, d, Err(EngineError::Internal(why.clone())));
            }
            let kept = (std::mem::take(prefilling).into_iter().zip(&chunks)).filter_map(
                |(p, &k)| match k {
                    0 => Some(p),
                    _ => {
                        fail_prompt(p, &why);
                        None
                    }
                },
            );
            prefilling.extend(kept);
            return;
        }
    };
    let mut rows = rows.into_iter();
    for mut d in std::mem::take(decoding) {
        d.rows.clear();
        d.rows.extend(rows.by_ref().take(d.feed.len()));
        assert_eq!(
            d.rows.len(),
            d.feed.len(),
            "a row per fed token of a decoding choice"
        );
        d.stepped();
        advance(shared, d, decoding, secs);
    }
    for (p, k) in std::mem::take(prefilling).into_iter().zip(chunks) {
        let mut p = p;
        if k == 0 {
            prefilling.push_back(p);
            continue;
        }
        let logits = rows.next().expect("one row per prompt chunk");
        p.record_fed(k);
        if p.remaining() > 0 {
            prefilling.push_back(p);
            continue;
        }
        match p.into_choices(shared, logits) {
            Ok(choices) => choices
                .into_iter()
                .for_each(|d| advance(shared, d, decoding, secs)),
            Err(e) => tracing::error!("a prompt's choices could not start: {e}"),
        }
    }
}

/// Runs the pass: each decoding choice's next token, then each prompt's chunk (`chunks[i]`
/// tokens of prompt `i`; 0 sits this pass out). Returns the last position's logits of each,
/// in that order (every fed token's, for a choice verifying drafts).
fn forward(
    shared: &Shared,
    prefilling: &mut VecDeque<Prefilling>,
    decoding: &mut [Decoding],
    chunks: &[usize],
) -> Result<Vec<Vec<f32>>, EngineError> {
    let model = shared.model.as_ref();
    if let ([d], true) = (&mut *decoding, chunks.iter().all(|&k| k == 0))
        && d.feed.len() == 1
    {
        // One sequence decoding alone: the allocation-free step (bit-identical to forward).
        let mut logits = d.rows.pop().unwrap_or_default();
        in_compute_pool(|| model.decode(d.feed[0], &mut d.cache, &mut logits))?;
        return Ok(vec![logits]);
    }
    let mut batch: Vec<BatchSeq> = Vec::with_capacity(decoding.len() + chunks.len());
    for d in decoding.iter_mut() {
        let logits = match d.feed.len() {
            1 => Logits::Last,
            _ => Logits::All,
        };
        batch.push(BatchSeq {
            tokens: &d.feed,
            cache: &mut d.cache,
            logits,
            media: None,
        });
    }
    for (p, &k) in prefilling.iter_mut().zip(chunks) {
        if k > 0 {
            let mut seq = BatchSeq::last(&p.job.ids[p.fed..p.fed + k], &mut p.cache);
            seq.media = crate::media::media_in(&p.job.images, p.fed, k);
            batch.push(seq);
        }
    }
    shared.steps.fetch_add(1, Ordering::Relaxed);
    shared
        .step_rows
        .fetch_add(batch.len() as u64, Ordering::Relaxed);
    let logits = in_compute_pool(|| model.forward_batch(&mut batch))?;
    drop(batch);
    // Into the decoding choices' last rows: their allocations are reused.
    let mut rows: Vec<Vec<f32>> = decoding.iter_mut().flat_map(|d| d.rows.drain(..)).collect();
    rows_into(&logits, &mut rows).map_err(ModelError::from)?;
    Ok(rows)
}

/// Samples `d`'s next token (or verifies its drafts) after a pass of `secs`; keeps it in
/// `decoding` unless it is done.
fn advance(shared: &Shared, mut d: Decoding, decoding: &mut Vec<Decoding>, secs: f64) {
    match catch_unwind(AssertUnwindSafe(|| d.advance(shared, secs))) {
        Ok(Ok(None)) => decoding.push(d),
        Ok(Ok(Some(finish))) => end(shared, d, Ok(finish)),
        Ok(Err(e)) => end(shared, d, Err(e)),
        Err(panic) => {
            let why = panic_text(panic);
            tracing::error!("generation panicked: {why}");
            end(
                shared,
                d,
                Err(EngineError::Internal(format!("generation failed: {why}"))),
            );
        }
    }
}

/// Ends a choice: its last text and `Done`, or the error.
fn end(shared: &Shared, d: Decoding, how: Result<FinishReason, EngineError>) {
    let sink = d.sink.events.clone();
    let result = match how {
        Ok(finish) => d.finish(shared, finish),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        let _ = sink.send(Event::Error(e));
    }
}

/// Ends every choice of a prompt whose pass failed.
fn fail_prompt(p: Prefilling, why: &str) {
    for c in &p.job.choices {
        let _ = (c.events).send(Event::Error(EngineError::Internal(why.to_string())));
    }
}

fn panic_text(panic: Box<dyn std::any::Any + Send>) -> String {
    (panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}
