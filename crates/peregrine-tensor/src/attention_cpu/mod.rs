//! Attention on CPU without candle ops: per query row, scores against the visible keys only
//! (causal and window limits become loop bounds, not a mask), softmax, and the weighted sum of
//! values, read straight from the cache's strided f32/f16/bf16 storage (no widened copy). Query
//! rows run in parallel on rayon's pool; AVX2/FMA/F16C when the CPU has them. A soft cap, when
//! set, is one more pass over a task's scores before its softmax.

use std::ops::Range;

use candle_core::{CpuStorage, DType, Device, Layout, Result, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::attention::{CpuKv, CpuRows, MaskSpec, QuantPlane};

mod quant;
mod rows;
mod softmax;
#[cfg(target_arch = "x86_64")]
mod wide;

use quant::QuantRows;
pub use quant::{quantize_rows, row_sizes};
use rows::{Elem, KvRows, Rows, simd};

/// Multiply-adds per rayon task: below this, splitting costs more than it saves.
const TASK_WORK: usize = 1 << 15;

/// Keys per chunk of a row's attention ([`Shape::run`]); chunks start at multiples of it.
const CHUNK_KEYS: usize = 128;

/// `Some(attention)` when the inputs suit this kernel (CPU, f32 queries, f32/f16/bf16 keys and
/// values with a contiguous last dimension), `None` otherwise.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    softcap: Option<f32>,
    mask: &MaskSpec,
) -> Result<Option<Tensor>> {
    if !matches!(q.device(), Device::Cpu) || q.dtype() != DType::F32 || k.dtype() != v.dtype() {
        return Ok(None);
    }
    let (b, heads, q_len, d) = q.dims4()?;
    let (_, kv_heads, k_len, _) = k.dims4()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(qs), Storage::Cpu(ks), Storage::Cpu(vs)) = (&*qs, &*ks, &*vs) else {
        return Ok(None);
    };
    let (Some(qv), Some(kv), Some(vv)) = (View::of(ql), View::of(kl), View::of(vl)) else {
        return Ok(None);
    };
    let Some(kv_rows) = Pair::of(ks, vs) else {
        return Ok(None);
    };
    let shape = Shape {
        heads,
        groups: heads / kv_heads,
        q_len,
        k_len,
        key_room: k_len,
        d,
        scale: scale as f32,
        softcap,
    };
    let mut out = vec![0f32; b * q_len * heads * d];
    let q = qs.as_slice::<f32>()?;
    shape.run_pair(
        kv_rows,
        q,
        &qv,
        (&kv, &vv),
        mask,
        &mut out,
        &mut AttnScratch::default(),
    );
    // Written as [b, q_len, heads, d]: the caller's transpose back to that order is free.
    Ok(Some(
        Tensor::from_vec(out, (b, q_len, heads, d), &Device::Cpu)?.transpose(1, 2)?,
    ))
}

/// [`attention`](crate::attention::attention) over slots `slots` of a CPU cache, whose first
/// slot holds position `mask.k_start`: `q: [1, heads, q_len, head_dim]` (f32) →
/// `[1, heads, q_len, head_dim]`.
pub fn attention_kv(
    q: &Tensor,
    kv: &CpuKv,
    slots: Range<usize>,
    scale: f64,
    softcap: Option<f32>,
    mask: &MaskSpec,
) -> Result<Tensor> {
    let (b, heads, q_len, d) = q.dims4()?;
    if b != 1 {
        candle_core::bail!("attention: a batch of {b} over one sequence's cache")
    }
    let q = q
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .contiguous()?;
    let (qs, _) = q.storage_and_layout();
    let Storage::Cpu(qs) = &*qs else {
        candle_core::bail!("attention: queries are not on the CPU")
    };
    let q_data = &qs.as_slice::<f32>()?[q.layout().start_offset()..];
    let (shape, view) = kv_shape(kv, heads, q_len, d, &slots, (scale, softcap))?;
    let qv = View {
        offset: 0,
        strides: [heads * q_len * d, q_len * d, d],
    };
    let mut out = vec![0f32; b * q_len * heads * d];
    let pair = Pair::of_kv(kv);
    let mut run = |scratch: &mut AttnScratch| {
        shape.run_pair(pair, q_data, &qv, (&view, &view), mask, &mut out, scratch)
    };
    // The thread's scratch, reused from call to call (a batched step calls this per sequence
    // and layer); a fresh one if this thread is already inside a call (rayon may run another
    // sequence's attention here while this one waits on its parallel part).
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut scratch) => run(&mut scratch),
        Err(_) => run(&mut AttnScratch::default()),
    });
    // Written as [b, q_len, heads, d]: the caller's transpose back to that order is free.
    Tensor::from_vec(out, (b, q_len, heads, d), &Device::Cpu)?.transpose(1, 2)
}

/// One token's attention without allocating once `scratch` has grown (the decode step): `q`
/// holds its query heads (`heads · head_dim` f32), slots `slots` of `kv` hold the keys `mask`
/// numbers from `mask.k_start` on; the result overwrites `out` (`heads · head_dim`). The same
/// arithmetic as [`attention_kv`].
#[allow(clippy::too_many_arguments)]
pub fn attention_row_into(
    q: &[f32],
    kv: &CpuKv,
    slots: Range<usize>,
    scale: f64,
    softcap: Option<f32>,
    mask: &MaskSpec,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) -> Result<()> {
    let d = kv.head_dim;
    if out.len() != q.len() || !q.len().is_multiple_of(d) {
        candle_core::bail!(
            "attention row: {} query values, {} outputs, head_dim {d}",
            q.len(),
            out.len()
        )
    }
    let heads = q.len() / d;
    let (shape, view) = kv_shape(kv, heads, 1, d, &slots, (scale, softcap))?;
    let qv = View {
        offset: 0,
        strides: [heads * d, d, d],
    };
    shape.run_pair(Pair::of_kv(kv), q, &qv, (&view, &view), mask, out, scratch);
    Ok(())
}

/// The shape of attending `heads × q_len` queries over `slots` of `kv`, and the view of its
/// keys (and values: the same layout) from the first slot on; scores scaled and capped by
/// `(scale, softcap)`.
fn kv_shape(
    kv: &CpuKv,
    heads: usize,
    q_len: usize,
    d: usize,
    slots: &Range<usize>,
    (scale, softcap): (f64, Option<f32>),
) -> Result<(Shape, View)> {
    let (kv_heads, capacity) = (kv.kv_heads, kv.capacity);
    let plane = kv_heads * capacity * d;
    if d != kv.head_dim || kv.k.len() < plane || kv.v.len() < plane {
        candle_core::bail!(
            "attention: a cache of {} values for {kv_heads} heads × {capacity} × {}",
            kv.k.len(),
            kv.head_dim
        )
    }
    if heads == 0
        || kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
        || slots.is_empty()
        || slots.end > capacity
    {
        candle_core::bail!(
            "attention: {heads} query heads over slots {slots:?} of {kv_heads} heads × {capacity}"
        )
    }
    let view = View {
        offset: slots.start * d,
        strides: [plane, capacity * d, d],
    };
    let shape = Shape {
        heads,
        groups: heads / kv_heads,
        q_len,
        k_len: slots.len(),
        key_room: capacity,
        d,
        scale: scale as f32,
        softcap,
    };
    Ok((shape, view))
}

thread_local! {
    /// [`attention_kv`]'s scratch on this thread.
    static SCRATCH: std::cell::RefCell<AttnScratch> = std::cell::RefCell::default();
}

/// Buffers that [`attention_row_into`] reuses from one decode step to the next.
#[derive(Debug, Default)]
pub struct AttnScratch {
    partial: Vec<f32>,
    stats: Vec<(f32, f32)>,
    scores: Vec<f32>,
}

/// Offset and strides of a 4-D tensor whose last dimension is contiguous.
#[derive(Clone, Copy)]
struct View {
    offset: usize,
    strides: [usize; 3],
}

impl View {
    fn of(layout: &Layout) -> Option<Self> {
        match layout.stride() {
            &[s0, s1, s2, 1] => Some(Self {
                offset: layout.start_offset(),
                strides: [s0, s1, s2],
            }),
            _ => None,
        }
    }

    /// `count` rows of `d` elements from `(batch, head, position) = at`, stepping along axis
    /// `along` (1: heads, 2: positions).
    fn rows<'a, T>(
        &self,
        data: &'a [T],
        at: [usize; 3],
        along: usize,
        count: usize,
        d: usize,
    ) -> Rows<'a, T> {
        let start = self.offset + (0..3).map(|a| at[a] * self.strides[a]).sum::<usize>();
        let stride = self.strides[along];
        Rows {
            data: &data[start..start + (count - 1) * stride + d],
            stride,
            count,
            len: d,
        }
    }
}

/// Keys and values of one element type.
#[derive(Clone, Copy)]
enum Pair<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
    BF16(&'a [bf16], &'a [bf16]),
    Quant(QuantPlane<'a>, QuantPlane<'a>),
}

/// Where a task's key or value rows come from.
trait Source: Copy + Sync {
    type Rows: KvRows;
    /// `count` rows of `d` values from `(batch, head, position) = at` of `view`, along positions.
    fn rows(&self, view: &View, at: [usize; 3], count: usize, d: usize) -> Self::Rows;
}

impl<'a, E: Elem> Source for &'a [E] {
    type Rows = Rows<'a, E>;
    fn rows(&self, view: &View, at: [usize; 3], count: usize, d: usize) -> Self::Rows {
        view.rows(self, at, 2, count, d)
    }
}

impl<'a> Source for QuantPlane<'a> {
    type Rows = QuantRows<'a>;
    fn rows(&self, view: &View, at: [usize; 3], count: usize, d: usize) -> Self::Rows {
        // A cache's view: whole rows, one after another along positions.
        debug_assert_eq!(view.strides[2], d);
        let start = view.offset + (0..3).map(|a| at[a] * view.strides[a]).sum::<usize>();
        QuantRows::of(self, start / d, count, d)
    }
}

impl<'a> Pair<'a> {
    fn of(k: &'a CpuStorage, v: &'a CpuStorage) -> Option<Self> {
        match (k, v) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => Some(Self::F32(k, v)),
            (CpuStorage::F16(k), CpuStorage::F16(v)) => Some(Self::F16(k, v)),
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => Some(Self::BF16(k, v)),
            _ => None,
        }
    }

    fn of_kv(kv: &CpuKv<'a>) -> Self {
        match (kv.k, kv.v) {
            (CpuRows::F32(k), CpuRows::F32(v)) => Self::F32(k, v),
            (CpuRows::F16(k), CpuRows::F16(v)) => Self::F16(k, v),
            (CpuRows::BF16(k), CpuRows::BF16(v)) => Self::BF16(k, v),
            (CpuRows::Quant(k), CpuRows::Quant(v)) => Self::Quant(k, v),
            _ => unreachable!("CpuKv::new keeps k and v in one element type"),
        }
    }
}

struct Shape {
    heads: usize,
    groups: usize,
    q_len: usize,
    k_len: usize,
    /// Keys the source can hold (≥ `k_len`): decode's scratch is sized for it, so that it
    /// grows with the cache's capacity, not with every new key.
    key_room: usize,
    d: usize,
    scale: f32,
    /// Scores become `cap · tanh(s / cap)` before the softmax (Gemma 2).
    softcap: Option<f32>,
}

/// One attention task: a group of query heads at one position, and the keys they see.
struct Task<'a, R> {
    queries: Rows<'a, f32>,
    keys: R,
    values: R,
}

impl<R: KvRows> Task<'_, R> {
    /// Keys `from..to` of this task's visible ones.
    fn keys(&self, from: usize, to: usize) -> Self {
        Self {
            queries: self.queries,
            keys: self.keys.subset(from, to - from),
            values: self.values.subset(from, to - from),
        }
    }

    /// Chunk `c` of this task's keys, the first of which sits at absolute position `first`:
    /// the ones inside the `c`-th span of [`CHUNK_KEYS`] from the one holding `first`.
    fn chunk(&self, first: usize, c: usize) -> Option<Self> {
        let n = self.keys.count();
        let span = (first / CHUNK_KEYS + c) * CHUNK_KEYS;
        let from = span.max(first) - first;
        let to = (span + CHUNK_KEYS).min(first + n).saturating_sub(first);
        (from < to).then(|| self.keys(from, to))
    }
}

impl Shape {
    /// [`run`](Self::run) for the cache's element type.
    #[allow(clippy::too_many_arguments)]
    fn run_pair(
        &self,
        kv: Pair,
        q: &[f32],
        qv: &View,
        (k_view, v_view): (&View, &View),
        mask: &MaskSpec,
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) {
        match kv {
            Pair::F32(k, v) => self.run(q, qv, (k, k_view), (v, v_view), mask, out, scratch),
            Pair::F16(k, v) => self.run(q, qv, (k, k_view), (v, v_view), mask, out, scratch),
            Pair::BF16(k, v) => self.run(q, qv, (k, k_view), (v, v_view), mask, out, scratch),
            Pair::Quant(k, v) => self.run(q, qv, (k, k_view), (v, v_view), mask, out, scratch),
        }
    }

    /// Writes every row of `out`; allocates nothing at decode once `scratch` has grown.
    ///
    /// Each row's keys are attended in chunks of [`CHUNK_KEYS`] aligned on absolute positions,
    /// and the chunks' partial softmax sums are merged in position order (as flash-decoding
    /// does). Only the parallel schedule depends on the batch and the thread count, so a row's
    /// bits depend on that row alone: a prompt prefilled in pieces, or decoded beside others,
    /// gives the same result as prefilled whole.
    #[allow(clippy::too_many_arguments)]
    fn run<S: Source>(
        &self,
        q: &[f32],
        qv: &View,
        k: (S, &View),
        v: (S, &View),
        mask: &MaskSpec,
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) {
        out.fill(0.0); // rows with no visible key stay zero
        let (groups, q_len, d) = (self.groups, self.q_len, self.d);
        let kv_heads = self.heads / groups;
        let simd = simd::available();
        // One task per (batch, position, kv head): its `groups` query heads share every key and
        // value row read, and their outputs are contiguous in `out` ([b, q_len, heads, d]).
        // Also the absolute position of its first visible key, where its chunks are aligned.
        let task = |t: usize| -> Option<(Task<S::Rows>, usize)> {
            let (kvh, i, bi) = (t % kv_heads, t / kv_heads % q_len, t / kv_heads / q_len);
            let pos = mask.q_start + i;
            // Visible keys: k_start + j ≤ pos, and pos - (k_start + j) < window (or a span's).
            let (lo, hi) = mask.keys_of(pos);
            let hi = hi.saturating_sub(mask.k_start).min(self.k_len);
            let lo = lo.saturating_sub(mask.k_start);
            (lo < hi).then(|| {
                let task = Task {
                    queries: qv.rows(q, [bi, kvh * groups, i], 1, groups, d),
                    keys: k.0.rows(k.1, [bi, kvh, lo], hi - lo, d),
                    values: v.0.rows(v.1, [bi, kvh, lo], hi - lo, d),
                };
                (task, mask.k_start + lo)
            })
        };
        let tasks = out.len() / (groups * d);
        let threads = rayon::current_num_threads();
        // The most chunks a task can touch: its keys need not start on a chunk boundary.
        let room = self.key_room.div_ceil(CHUNK_KEYS) + 1;
        let part = groups * d;
        if tasks >= 2 * threads && q_len > 1 {
            // Many tasks (prefill): one task per work item, its chunks in turn.
            let chunks = self.k_len.div_ceil(CHUNK_KEYS) + 1;
            let min_tasks = (TASK_WORK / (2 * self.k_len * d * groups).max(1)).max(1);
            out.par_chunks_mut(part)
                .with_min_len(min_tasks)
                .enumerate()
                .for_each_init(
                    || {
                        let scores = vec![0f32; groups * CHUNK_KEYS];
                        (scores, vec![0f32; chunks * part], Vec::new())
                    },
                    |(scores, partial, stats), (t, out)| {
                        let Some((task, first)) = task(t) else {
                            return;
                        };
                        stats.clear();
                        stats.resize(chunks * groups, (f32::NEG_INFINITY, 0f32));
                        for c in 0..chunks {
                            let Some(keys) = task.chunk(first, c) else {
                                break;
                            };
                            let (stats, partial) =
                                (&mut stats[c * groups..], &mut partial[c * part..]);
                            self.attend(simd, &keys, scores, stats, partial);
                        }
                        merge(groups, d, stats, partial, out);
                    },
                );
            return;
        }
        // Few tasks (decode): every (task, chunk) is a work item.
        let AttnScratch {
            partial,
            stats,
            scores,
        } = scratch;
        let items = tasks * room;
        grow(partial, items * part, 0.0);
        grow(scores, items * groups * CHUNK_KEYS, 0.0);
        stats.clear(); // a chunk without keys must read as empty
        stats.resize(items * groups, (f32::NEG_INFINITY, 0f32));
        partial[..items * part]
            .par_chunks_mut(part)
            .zip(stats.par_chunks_mut(groups))
            .zip(scores[..items * groups * CHUNK_KEYS].par_chunks_mut(groups * CHUNK_KEYS))
            .enumerate()
            .for_each(|(at, ((partial, stats), scores))| {
                if let Some((task, first)) = task(at / room)
                    && let Some(keys) = task.chunk(first, at % room)
                {
                    self.attend(simd, &keys, scores, stats, partial);
                }
            });
        for (t, out) in out.chunks_exact_mut(part).enumerate() {
            let (stats, partial) = (&stats[t * room * groups..], &partial[t * room * part..]);
            merge(groups, d, &stats[..room * groups], partial, out);
        }
    }

    /// Attention of one chunk of a task's keys: `out[g] = Σ_j p_gj · v_j` with
    /// `p_gj = exp(s_gj - max_g)`, and `stats[g] = (max_g, Σ_j p_gj)`.
    fn attend<R: KvRows>(
        &self,
        simd: simd::Simd,
        task: &Task<R>,
        scores: &mut [f32],
        stats: &mut [(f32, f32)],
        out: &mut [f32],
    ) {
        let (groups, n, d) = (self.groups, task.keys.count(), self.d);
        let scores = &mut scores[..groups * n];
        for h0 in (0..groups).step_by(simd::HEADS) {
            let g = (groups - h0).min(simd::HEADS);
            let scores = &mut scores[h0 * n..][..g * n];
            simd::scores(
                simd,
                task.queries.subset(h0, g),
                (task.keys, task.values),
                self.scale,
                scores,
            );
        }
        if let Some(cap) = self.softcap {
            scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
        }
        for (row, stat) in scores.chunks_exact_mut(n).zip(stats.iter_mut()) {
            *stat = softmax::exp_row(row);
        }
        for h0 in (0..groups).step_by(simd::HEADS) {
            let g = (groups - h0).min(simd::HEADS);
            let probs = &scores[h0 * n..][..g * n];
            simd::weighted_sum(simd, probs, task.values, &mut out[h0 * d..][..g * d]);
        }
    }
}

/// Merges a task's chunks in order into `out` (`groups` rows of `d`): `stats` holds
/// `(max, sum)` per chunk and head (`[chunk][group]`), `partial` the unnormalized sums
/// (`[chunk][group][d]`); a chunk whose sum is zero held no keys.
fn merge(groups: usize, d: usize, stats: &[(f32, f32)], partial: &[f32], out: &mut [f32]) {
    let chunks = stats.len() / groups;
    for (g, out) in out.chunks_exact_mut(d).enumerate() {
        let at = |c: usize| c * groups + g;
        let max = (0..chunks).fold(f32::NEG_INFINITY, |m, c| m.max(stats[at(c)].0));
        let mut total = 0f32;
        for c in 0..chunks {
            let (m, sum) = stats[at(c)];
            if sum > 0.0 {
                let w = (m - max).exp();
                total += w * sum;
                let part = &partial[at(c) * d..][..d];
                out.iter_mut().zip(part).for_each(|(o, p)| *o += w * p);
            }
        }
        if total > 0.0 {
            out.iter_mut().for_each(|o| *o /= total);
        }
    }
}

/// Makes `v` at least `len` long (its contents are scratch: they may be stale).
fn grow<T: Clone>(v: &mut Vec<T>, len: usize, fill: T) {
    if v.len() < len {
        v.resize(len, fill);
    }
}
