//! Several sequences in one forward pass: their new tokens' rows are stacked, so every matmul
//! reads its weights once for all of them, while attention runs per sequence over its own cache
//! ([`Segment`]). A single sequence's `forward` is the batch of one, so each layer is written
//! once. Rows do not change each other's bits (the CPU kernels are batch-invariant), so a
//! sequence's logits equal its solo run's.

use peregrine_kv::{LayerCache, SequenceCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, QLinear, Tensor, candle};
use rayon::prelude::*;

use crate::{Logits, ModelError, Result};

/// One sequence of a batched forward pass: its next tokens and its cache.
pub struct BatchSeq<'a> {
    /// The tokens to run (at least one), the positions after those `cache` holds.
    pub tokens: &'a [u32],
    /// The sequence's cache; the pass appends the tokens' keys and values.
    pub cache: &'a mut SequenceCache,
    /// Which of its positions' logits the pass returns: the last (generation) or all of them
    /// (a speculative draft's verification).
    pub logits: Logits,
    /// Rows that replace a run of these tokens' embeddings (an image's), if any.
    pub media: Option<Media<'a>>,
}

/// Rows that stand in for a run of a pass's new tokens' embeddings: an image encoder's output
/// in the text model's width. Only models that take image input accept them.
#[derive(Clone, Copy)]
pub struct Media<'a> {
    /// Where the run starts among the sequence's new tokens of the pass.
    pub offset: usize,
    /// `[n, hidden]` in the model's dtype: the run's `n` embeddings (DeepStack towers:
    /// `[n, (1 + k) · hidden]`, the rows to add after each of the first `k` layers beside them).
    pub rows: &'a Tensor,
    /// Whether the run's positions attend to each other both ways (Gemma 3's images).
    pub both_ways: bool,
    /// M-RoPE models (Qwen2-VL): the run's rows and columns (the image's merged patch grid),
    /// which give its tokens their height and width positions; the run is a whole image.
    pub grid: Option<(usize, usize)>,
}

impl<'a> BatchSeq<'a> {
    /// `tokens` after what `cache` holds, returning the last position's logits.
    pub fn last(tokens: &'a [u32], cache: &'a mut SequenceCache) -> Self {
        Self {
            tokens,
            cache,
            logits: Logits::Last,
            media: None,
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
    /// Absolute positions `[start, end)` of its rows that attend to each other both ways.
    pub both_ways: Option<(usize, usize)>,
    /// The rotary positions of its rows.
    pub rope: RopeRows<'a>,
}

/// The rotary positions of a segment's rows.
#[derive(Clone, Copy, Debug)]
pub enum RopeRows<'a> {
    /// Consecutive positions from this one (the cache position, unless an earlier image
    /// shifted M-RoPE positions).
    From(usize),
    /// Each row's time, height and width positions: M-RoPE with an image among the rows.
    Axes(&'a [Vec<u32>; 3]),
}

impl<'a> Segment<'a> {
    /// `len` causal rows from position `start` over `cache`.
    pub fn causal(cache: &'a mut dyn LayerCache, start: usize, len: usize) -> Self {
        Self {
            cache,
            start,
            len,
            both_ways: None,
            rope: RopeRows::From(start),
        }
    }
}

/// A sequence's rotary positions for one pass (`start`: its cache position), and the shift
/// its image leaves on the positions after it (cache position, amount), if any.
struct RopePlan {
    /// The first row's rotary position.
    first: usize,
    /// Every row's (time, height, width) positions, when an image is among them.
    axes: Option<[Vec<u32>; 3]>,
    shift: Option<(usize, i64)>,
}

impl RopePlan {
    /// M-RoPE (transformers' `get_rope_index`): text rows count on from the cache's rotary
    /// position; an image's rows sit at (r, r + row, r + column) for its first rotary position
    /// `r`, and the rows after it continue from `r + max(rows, columns)`.
    fn new(s: &BatchSeq, start: usize) -> Result<Self> {
        let first = s.cache.rope_position(start);
        let Some((m, (gh, gw))) = s.media.as_ref().and_then(|m| Some((m, m.grid?))) else {
            return Ok(Self {
                first,
                axes: None,
                shift: None,
            });
        };
        let n = m.rows.dim(0)?;
        if gh * gw != n {
            return Err(ModelError::Tensor(candle::Error::Msg(format!(
                "image grid {gh}×{gw} for a run of {n} rows"
            ))));
        }
        let mut axes: [Vec<u32>; 3] = Default::default();
        let mut push = |t: usize, h: usize, w: usize| {
            for (axis, p) in axes.iter_mut().zip([t, h, w]) {
                axis.push(p as u32);
            }
        };
        (0..m.offset).for_each(|i| push(first + i, first + i, first + i));
        let r = first + m.offset;
        for y in 0..gh {
            (0..gw).for_each(|x| push(r, r + y, r + x));
        }
        let after = r + gh.max(gw);
        (0..s.tokens.len() - m.offset - n).for_each(|i| push(after + i, after + i, after + i));
        Ok(Self {
            first,
            axes: Some(axes),
            shift: Some((start + m.offset + n, gh.max(gw) as i64 - n as i64)),
        })
    }

    fn rows(&self) -> RopeRows<'_> {
        match &self.axes {
            Some(axes) => RopeRows::Axes(axes),
            None => RopeRows::From(self.first),
        }
    }
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
    let ropes: Vec<RopePlan> = (batch.iter().zip(&starts))
        .map(|(s, &start)| RopePlan::new(s, start))
        .collect::<Result<_>>()?;
    let deepstack = deepstack_runs(batch, x.dim(2)?)?;
    for i in 0..layers {
        let mut segments: Vec<Segment> = (batch.iter_mut().zip(&starts).zip(&ropes))
            .map(|((s, &start), rope)| {
                let both_ways = (s.media.as_ref()).filter(|m| m.both_ways).map(|m| {
                    let from = start + m.offset;
                    (from, from + m.rows.dim(0).unwrap_or(0))
                });
                Segment {
                    len: s.tokens.len(),
                    cache: s.cache.layer(slot(i)),
                    start,
                    both_ways,
                    rope: rope.rows(),
                }
            })
            .collect();
        x = add_deepstack(layer(i, &x, &mut segments)?, &deepstack, i)?;
    }
    for (s, rope) in batch.iter_mut().zip(&ropes) {
        if let Some((from, by)) = rope.shift {
            s.cache.shift_rope(from, by)?;
        }
    }
    Ok(x)
}

/// `f(rows, segment)` for each sequence, `rows` its part of the stacked rows (a range along
/// dimension 1), the outputs (`[1, len, d]` each) joined again in order: the per-sequence part
/// of a layer (attention over each one's own cache). On the CPU (`device`) sequences run in
/// parallel (each its own cache; one parallel region instead of one per sequence's attention,
/// whose few heads leave threads idle), each computing exactly what it would alone; on a GPU
/// one after another (its stream runs their kernels in order anyway, and host threads issuing
/// them at once only contend for it).
pub fn per_segment(
    segments: &mut [Segment],
    device: &candle::Device,
    f: impl Fn(std::ops::Range<usize>, &mut Segment) -> Result<Tensor> + Sync,
) -> Result<Tensor> {
    per_segment_from(segments, 0, device, f)
}

/// [`per_segment`] for segments whose rows start at row `first` of the stacked rows.
pub fn per_segment_from(
    segments: &mut [Segment],
    first: usize,
    device: &candle::Device,
    f: impl Fn(std::ops::Range<usize>, &mut Segment) -> Result<Tensor> + Sync,
) -> Result<Tensor> {
    let mut at = first;
    let ranges: Vec<std::ops::Range<usize>> = (segments.iter())
        .map(|s| {
            at += s.len;
            at - s.len..at
        })
        .collect();
    let mut parts: Vec<Tensor> = match segments.len() {
        1 => vec![f(ranges[0].clone(), &mut segments[0])?],
        _ if !device.is_cpu() => (segments.iter_mut().zip(ranges))
            .map(|(s, rows)| f(rows, s))
            .collect::<Result<_>>()?,
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

/// Fails unless every sequence of `batch` has tokens that fit its context of `max` and no
/// image rows (a model that takes them checks with [`check_media`]).
pub fn check_batch(batch: &[BatchSeq], max: usize) -> Result<()> {
    if batch.iter().any(|s| s.media.is_some()) {
        return Err(no_media());
    }
    check_media(batch, max)
}

/// [`check_batch`] for a model that takes image rows: each run must lie within its tokens.
pub fn check_media(batch: &[BatchSeq], max: usize) -> Result<()> {
    check_media_with(batch, max, false)
}

/// [`check_media`] for a model whose image runs may carry an M-RoPE grid (`mrope`).
pub fn check_media_with(batch: &[BatchSeq], max: usize, mrope: bool) -> Result<()> {
    if !mrope
        && batch
            .iter()
            .any(|s| s.media.is_some_and(|m| m.grid.is_some()))
    {
        return Err(ModelError::Tensor(candle::Error::Msg(
            "image rows with an M-RoPE grid given to a model without M-RoPE".into(),
        )));
    }
    for s in batch {
        super::check_room(s.tokens.len(), s.cache.len(), max)?;
        if let Some(m) = &s.media
            && m.offset + m.rows.dim(0)? > s.tokens.len()
        {
            return Err(ModelError::Tensor(candle::Error::Msg(format!(
                "image rows {}..{} lie past the pass's {} tokens",
                m.offset,
                m.offset + m.rows.dim(0)?,
                s.tokens.len()
            ))));
        }
    }
    Ok(())
}

/// The error for image rows given to a model that takes none.
pub fn no_media() -> ModelError {
    ModelError::Tensor(candle::Error::Msg("this model takes no image input".into()))
}

/// DeepStack (Qwen3-VL): image rows wider than the model carry, after their `hidden` input
/// values, one more block of `hidden` values per early layer, which is added to the run's
/// hidden states after that layer. Each such run as (its first row among the stacked rows,
/// those blocks `[n, k · hidden]`).
fn deepstack_runs(batch: &[BatchSeq], hidden: usize) -> Result<Vec<(usize, Tensor)>> {
    let mut runs = Vec::new();
    let mut at = 0;
    for s in batch {
        if let Some(m) = &s.media {
            let width = m.rows.dim(1)?;
            if width > hidden {
                runs.push((at + m.offset, m.rows.narrow(1, hidden, width - hidden)?));
            }
        }
        at += s.tokens.len();
    }
    Ok(runs)
}

/// `x` (`[1, rows, hidden]`, layer `layer`'s output) with each DeepStack run's block for that
/// layer added to its rows ([`deepstack_runs`]); `x` itself where there is none.
fn add_deepstack(x: Tensor, runs: &[(usize, Tensor)], layer: usize) -> Result<Tensor> {
    let (_, rows, hidden) = x.dims3()?;
    let (mut parts, mut done) = (Vec::new(), 0);
    for (at, blocks) in runs {
        if blocks.dim(1)? < (layer + 1) * hidden {
            continue;
        }
        let n = blocks.dim(0)?;
        let add = blocks
            .narrow(1, layer * hidden, hidden)?
            .to_dtype(x.dtype())?;
        parts.push(x.narrow(1, done, at - done)?);
        parts.push(x.narrow(1, *at, n)?.broadcast_add(&add.unsqueeze(0)?)?);
        done = at + n;
    }
    if parts.is_empty() {
        return Ok(x);
    }
    parts.push(x.narrow(1, done, rows - done)?);
    Ok(Tensor::cat(&parts, 1)?)
}

/// `x` (`[1, rows, hidden]`, the stacked embeddings of `batch`) with each sequence's image rows
/// (their first `hidden` values; DeepStack's rest is added after early layers) in place of its run of
/// image tokens' embeddings.
pub fn splice_media(x: Tensor, batch: &[BatchSeq]) -> Result<Tensor> {
    if batch.iter().all(|s| s.media.is_none()) {
        return Ok(x);
    }
    let mut parts = Vec::new();
    let mut at = 0;
    for s in batch {
        if let Some(m) = &s.media {
            let n = m.rows.dim(0)?;
            let row = at + m.offset;
            parts.push(x.narrow(1, at, m.offset)?);
            let rows = m.rows.narrow(1, 0, x.dim(2)?)?;
            parts.push(rows.to_dtype(x.dtype())?.unsqueeze(0)?);
            parts.push(x.narrow(1, row + n, s.tokens.len() - m.offset - n)?);
        } else {
            parts.push(x.narrow(1, at, s.tokens.len())?);
        }
        at += s.tokens.len();
    }
    Ok(Tensor::cat(&parts, 1)?)
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
