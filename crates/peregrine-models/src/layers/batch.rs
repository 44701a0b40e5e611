//! Several sequences in one forward pass: their new tokens' rows are stacked, so every matmul
//! reads its weights once for all of them, while attention runs per sequence over its own cache
//! ([`Segment`]). A single sequence's `forward` is the batch of one, so each layer is written
//! once. Rows do not change each other's bits (the CPU kernels are batch-invariant), so a
//! sequence's logits equal its solo run's.

use peregrine_kv::{LayerCache, SequenceCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, QLinear, Tensor};
use rayon::prelude::*;

use crate::{Logits, Result};

/// One sequence of a batched forward pass: its next tokens and its cache.
pub struct BatchSeq<'a> {
    /// The tokens to run (at least one), the positions after those `cache` holds.
    pub tokens: &'a [u32],
    /// The sequence's cache; the pass appends the tokens' keys and values.
    pub cache: &'a mut SequenceCache,
    /// Which of its positions' logits the pass returns: the last (generation) or all of them
    /// (a speculative draft's verification).
    pub logits: Logits,
}

impl<'a> BatchSeq<'a> {
    /// `tokens` after what `cache` holds, returning the last position's logits.
    pub fn last(tokens: &'a [u32], cache: &'a mut SequenceCache) -> Self {
        Self {
            tokens,
            cache,
            logits: Logits::Last,
        }
    }

    /// How many rows of logits the pass returns for this sequence.
    pub fn logit_rows(&self) -> usize {
        match self.logits {
            Logits::Last => 1,
            Logits::All => self.tokens.len(),
        }
    }
}

/// One sequence's rows in a layer of a batched pass: that layer's cache, the position of its
/// first row, and how many rows it has. Rows of the stacked input follow the batch's order.
pub struct Segment<'a> {
    /// The layer's cache of this sequence.
    pub cache: &'a mut dyn LayerCache,
    /// The position of the sequence's first row.
    pub start: usize,
    /// Its rows.
    pub len: usize,
}

/// Each stacked row's most experts, when a sequence of `batch` routes its tokens to fewer than
/// the model's number (`usize::MAX`: the model's); empty when none does.
pub fn moe_limits(batch: &[BatchSeq]) -> Vec<usize> {
    if batch.iter().all(|s| s.cache.moe_top_k().is_none()) {
        return Vec::new();
    }
    let limit = |s: &BatchSeq| s.cache.moe_top_k().unwrap_or(usize::MAX);
    (batch.iter())
        .flat_map(|s| std::iter::repeat_n(limit(s), s.tokens.len()))
        .collect()
}

/// Every token of `batch`, in order (the stacked rows' ids).
pub fn stacked_ids(batch: &[BatchSeq]) -> Vec<u32> {
    batch
        .iter()
        .flat_map(|s| s.tokens.iter().copied())
        .collect()
}

/// Runs `layer(i, x, segments)` for `i` in `0..layers` over the stacked rows `x`
/// (`[1, rows, hidden]`) of `batch`; `slot(i)` names the cache slot layer `i` uses. Returns
/// the last layer's output.
pub fn run_layers(
    batch: &mut [BatchSeq],
    mut x: Tensor,
    layers: usize,
    slot: impl Fn(usize) -> usize,
    mut layer: impl FnMut(usize, &Tensor, &mut [Segment]) -> Result<Tensor>,
) -> Result<Tensor> {
    let starts: Vec<usize> = batch.iter().map(|s| s.cache.len()).collect();
    for i in 0..layers {
        let mut segments: Vec<Segment> = (batch.iter_mut().zip(&starts))
            .map(|(s, &start)| Segment {
                len: s.tokens.len(),
                cache: s.cache.layer(slot(i)),
                start,
            })
            .collect();
        x = layer(i, &x, &mut segments)?;
    }
    Ok(x)
}

/// `f(rows, segment)` for each sequence, `rows` its part of the stacked rows (a range along
/// dimension 1), the outputs (`[1, len, d]` each) joined again in order: the per-sequence part
/// of a layer (attention over each one's own cache). Sequences run in parallel (each its own
/// cache; one parallel region instead of one per sequence's attention, whose few heads leave
/// threads idle), each computing exactly what it would alone.
pub fn per_segment(
    segments: &mut [Segment],
    f: impl Fn(std::ops::Range<usize>, &mut Segment) -> Result<Tensor> + Sync,
) -> Result<Tensor> {
    let mut at = 0;
    let ranges: Vec<std::ops::Range<usize>> = (segments.iter())
        .map(|s| {
            at += s.len;
            at - s.len..at
        })
        .collect();
    let mut parts: Vec<Tensor> = match segments.len() {
        1 => vec![f(ranges[0].clone(), &mut segments[0])?],
        _ => (segments.par_iter_mut().zip(ranges))
            .map(|(s, rows)| f(rows, s))
            .collect::<Result<_>>()?,
    };
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Ok(Tensor::cat(&parts, 1)?),
    }
}

/// The output head on the rows of `x` (`[1, rows, hidden]`) each sequence asks for (its last,
/// or all of them): the final RMSNorm and `lm_head`, f32 `[rows asked, vocab]` in batch order.
pub fn batch_logits(
    x: &Tensor,
    batch: &[BatchSeq],
    norm: &Tensor,
    eps: f32,
    lm_head: &QLinear,
) -> Result<Tensor> {
    let mut rows = Vec::with_capacity(batch.len());
    let mut start = 0u32;
    for s in batch {
        let end = start + s.tokens.len() as u32;
        rows.extend(end - s.logit_rows() as u32..end);
        start = end;
    }
    let x = match rows.len() as u32 == start {
        true => x.clone(),
        false => x.index_select(&Tensor::new(rows.as_slice(), x.device())?, 1)?,
    };
    let logits = lm_head.forward(&rms_norm(&x, norm, eps)?)?;
    Ok(logits.squeeze(0)?.to_dtype(DType::F32)?)
}

/// Fails unless every sequence of `batch` has tokens that fit its context of `max`.
pub fn check_batch(batch: &[BatchSeq], max: usize) -> Result<()> {
    for s in batch {
        super::check_room(s.tokens.len(), s.cache.len(), max)?;
    }
    Ok(())
}

/// Records each sequence's final hidden states (its rows of `normed`, `[1, rows, hidden]`) in
/// its cache's MTP memory, where it keeps one ([`SequenceCache::enable_mtp`]), for a drafter
/// that starts from them.
pub fn record_hidden(normed: &Tensor, batch: &mut [BatchSeq]) -> Result<()> {
    let mut at = 0;
    for s in batch.iter_mut() {
        let n = s.tokens.len();
        let start = s.cache.len() - n;
        if let Some(state) = s.cache.mtp() {
            let rows = normed
                .narrow(1, at, n)?
                .flatten_all()?
                .to_dtype(DType::F32)?;
            state.record(start, &rows.to_vec1::<f32>()?);
        }
        at += n;
    }
    Ok(())
}
