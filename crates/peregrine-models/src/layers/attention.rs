//! Multi-head attention with grouped-query heads, optional q/k/v biases and q/k RMSNorm, and
//! optionally soft-capped scores (Gemma 2). Gemma 4 adds unweighted value norms, values taken
//! from the keys' projection, and layers that attend to an earlier layer's keys and values
//! (KV sharing: no k/v projections; the caller hands them that layer's cache).

use peregrine_kv::{AttnParams, LayerCache};
use peregrine_tensor::attention::{AppendSlot, AttnScratch, attention_many};
use peregrine_tensor::ops::{rms_norm, sigmoid};
use peregrine_tensor::{DType, Device, QLinear, RotaryEmbedding, Tensor};
use rayon::prelude::*;

use crate::layers::batch::{RopeRows, Segment, per_segment, per_segment_from};
use crate::layers::decoder::SelfAttention;
use crate::layers::norm_weight;
use crate::layers::step::{StepBuffers, StepRow, norm_rows_in_place};
use crate::weights::Weights;
use crate::{ModelConfig, Result};

/// A range of a batched pass's stacked rows.
type Rows = std::ops::Range<usize>;
/// A decode step's turned queries, and keys and values, of every sequence at once.
type DecodeRows = (Tensor, Option<(Tensor, Tensor)>);

/// Where a layer's keys and values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvProjections {
    /// `k_proj` and `v_proj`.
    Own,
    /// `k_proj` only: values are its output before the key norm and RoPE (Gemma 4's
    /// `attention_k_eq_v`).
    ValuesFromKeys,
    /// None: the layer attends to the keys and values another layer appended to the cache it
    /// is given (KV sharing).
    Shared,
}

/// Self-attention of one decoder layer.
pub struct Attention {
    q_proj: QLinear,
    /// `None` for a KV-shared layer.
    k_proj: Option<QLinear>,
    /// `None` for a KV-shared layer, or when values are the keys' projection.
    v_proj: Option<QLinear>,
    o_proj: QLinear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// Ones `[head_dim]`: values RMS-normed without a weight (Gemma 4).
    v_norm: Option<Tensor>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
    softcap: Option<f32>,
    eps: f32,
    /// `q_proj` gives each head's query then its output gate (Qwen3-Next's gated attention).
    output_gate: bool,
    /// Queries and keys are not rotated (Jamba).
    no_rope: bool,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj` (and `{q,k}_norm` when the config asks for them).
    pub fn load(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        Self::load_kv(c, w, prefix, KvProjections::Own)
    }

    /// [`load`](Self::load) with the key/value projections `kv` says the layer has.
    pub fn load_kv(c: &ModelConfig, w: &Weights, prefix: &str, kv: KvProjections) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let bias = c.attention_bias;
        let linear = |name: &str, out: usize| w.linear(&format!("{prefix}.{name}"), out, h, bias);
        // A gated layer's q_proj also gives each head's output gate.
        let q_rows = q_dim * (1 + usize::from(c.attn_output_gate));
        let q = linear("q_proj", q_rows)?;
        let (k, v) = match kv {
            KvProjections::Own => (
                Some(linear("k_proj", kv_dim)?),
                Some(linear("v_proj", kv_dim)?),
            ),
            KvProjections::ValuesFromKeys => (Some(linear("k_proj", kv_dim)?), None),
            KvProjections::Shared => (None, None),
        };
        let mut attn = Self::from_parts(c, w, prefix, q, k.is_some())?;
        (attn.k_proj, attn.v_proj) = (k, v);
        Ok(attn)
    }

    /// [`load`](Self::load) for checkpoints that fuse q, k and v into one `{prefix}.qkv_proj`
    /// (Phi-3: rows `[q; k; v]`), split by rows at load ([`Weights::linear_rows`]).
    pub fn load_fused(c: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let parts = [q_dim, kv_dim, kv_dim];
        let qkv = w.linear_rows(&format!("{prefix}.qkv_proj"), &parts, h, c.attention_bias)?;
        let Ok(qkv) = <[QLinear; 3]>::try_from(qkv) else {
            unreachable!("three parts, three layers")
        };
        Self::from_projections(c, w, prefix, qkv)
    }

    /// The layer from its q, k and v projections; `{prefix}.o_proj` and the q/k norms (when
    /// the config asks for them) are loaded.
    pub fn from_projections(
        c: &ModelConfig,
        w: &Weights,
        prefix: &str,
        [q_proj, k_proj, v_proj]: [QLinear; 3],
    ) -> Result<Self> {
        let mut attn = Self::from_parts(c, w, prefix, q_proj, true)?;
        (attn.k_proj, attn.v_proj) = (Some(k_proj), Some(v_proj));
        Ok(attn)
    }

    /// The layer without k/v projections; `o_proj` and the norms loaded (the key and value
    /// norms only when the layer projects its own keys, `own_kv`).
    fn from_parts(
        c: &ModelConfig,
        w: &Weights,
        prefix: &str,
        q_proj: QLinear,
        own_kv: bool,
    ) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let q_dim = c.num_attention_heads * hd;
        let norm = |name: &str, on: bool| -> Result<Option<Tensor>> {
            (c.qk_norm && on)
                .then(|| norm_weight(c, w, &format!("{prefix}.{name}.weight"), hd))
                .transpose()
        };
        let ones = || Tensor::ones(hd, w.dtype(), w.device());
        Ok(Self {
            q_proj,
            k_proj: None,
            v_proj: None,
            o_proj: w.linear(&format!("{prefix}.o_proj"), h, q_dim, false)?,
            q_norm: norm("q_norm", true)?,
            k_norm: norm("k_norm", own_kv)?,
            v_norm: (c.v_norm && own_kv).then(ones).transpose()?,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: hd,
            scale: c.query_pre_attn_scalar.unwrap_or(hd as f64).powf(-0.5),
            softcap: c.attn_logit_softcapping.map(|cap| cap as f32),
            eps: c.rms_norm_eps as f32,
            output_gate: c.attn_output_gate,
            no_rope: c.no_rope,
        })
    }

    /// The projections this layer runs, q then k and v where it has them, and how many
    /// (an array: the decode step allocates nothing).
    fn projections(&self) -> ([&QLinear; 3], usize) {
        let (mut all, mut n) = ([&self.q_proj; 3], 1);
        for l in [self.k_proj.as_ref(), self.v_proj.as_ref()]
            .into_iter()
            .flatten()
        {
            all[n] = l;
            n += 1;
        }
        (all, n)
    }

    /// One sequence's part of a decode step: its projected `q`, `k`, `v` (one row each)
    /// normed and turned at its position, the key and value appended to its cache, attention
    /// over that cache into `attn`.
    fn attend_row(
        &self,
        rope: &RotaryEmbedding,
        (q, k, v): (&mut [f32], &mut [f32], &mut [f32]),
        seq: &mut StepRow,
        attn: &mut [f32],
        scratch: &mut AttnScratch,
    ) -> Result<()> {
        let (cache, pos) = (&mut *seq.cache, seq.pos);
        if let Some(w) = &self.q_norm {
            norm_rows_in_place(q, w, self.eps)?;
        }
        rope.apply_rows_in_place(q, pos)?;
        if self.k_proj.is_some() {
            if self.v_proj.is_none() {
                v.copy_from_slice(k);
            }
            if let Some(w) = &self.k_norm {
                norm_rows_in_place(k, w, self.eps)?;
            }
            if let Some(w) = &self.v_norm {
                norm_rows_in_place(v, w, self.eps)?;
            }
            rope.apply_rows_in_place(k, pos)?;
            cache.note_query_row(q, self.head_dim, self.kv_heads)?;
            cache.append_row(k, v, self.head_dim)?;
        }
        let params = self.params();
        cache.attend_row(q, self.head_dim, &params, attn, scratch)?;
        Ok(())
    }

    /// A decode step's queries, and keys and values when the layer has its own, for every
    /// sequence at once (`[1, heads, sequences, hd]`, normed and turned at each one's position):
    /// `None` unless every segment is one row at a plain position and RoPE takes them in one
    /// table; then each sequence's part is only its cache and attention (on a GPU, a batched
    /// step pays per launch and per sequence).
    fn turn_decode_rows(
        &self,
        segments: &[Segment],
        rope: &RotaryEmbedding,
        split: &impl Fn(Rows, usize, usize, &Option<Tensor>) -> Result<Tensor>,
        n_proj: usize,
    ) -> Result<Option<DecodeRows>> {
        let positions = decode_positions(segments);
        let Some(positions) = positions.filter(|p| p.len() > 1 && !self.no_rope) else {
            return Ok(None);
        };
        let all = 0..positions.len();
        let q = split(all.clone(), 0, self.heads, &self.q_norm)?;
        if n_proj == 1 {
            let q = rope.apply_at(&[&q], &positions)?;
            return Ok(q.map(|mut q| (q.remove(0), None)));
        }
        let v = split(all.clone(), n_proj - 1, self.kv_heads, &self.v_norm)?;
        let k = split(all, 1, self.kv_heads, &self.k_norm)?;
        let Some(mut qk) = rope.apply_at(&[&q, &k], &positions)? else {
            return Ok(None);
        };
        let (k, q) = (qk.remove(1), qk.remove(0));
        Ok(Some((q, Some((k, v)))))
    }

    /// A decode step on the GPU with every sequence's rows in one launch (queries and keys
    /// turned, keys and values written to the caches) and attention over every cache in one
    /// more: `[1, sequences, heads · hd]`, or `None`, having changed nothing, where it does
    /// not apply (the CPU, the batched kernels off, caches without slots, M-RoPE, no RoPE).
    /// The segments' rows start at row `first` of the step's.
    fn fused_decode_rows(
        &self,
        segments: &mut [Segment],
        rope: &RotaryEmbedding,
        split: &impl Fn(Rows, usize, usize, &Option<Tensor>) -> Result<Tensor>,
        (first, n_proj, device): (usize, usize, &Device),
    ) -> Result<Option<Tensor>> {
        let applies = !device.is_cpu()
            && peregrine_tensor::attention::many_enabled()
            && n_proj > 1
            && !self.no_rope
            && segments.iter().all(|s| s.cache.has_decode_slots(device));
        let positions = decode_positions(segments).filter(|_| applies);
        let Some(positions) = positions else {
            return Ok(None);
        };
        let all = first..first + positions.len();
        let q = split(all.clone(), 0, self.heads, &self.q_norm)?;
        let v = split(all.clone(), n_proj - 1, self.kv_heads, &self.v_norm)?;
        let k = split(all, 1, self.kv_heads, &self.k_norm)?;
        if !rope.turns_in_place(&q, (&k, &v), &positions) {
            return Ok(None);
        }
        let mut slots = Vec::with_capacity(positions.len());
        for (j, s) in segments.iter_mut().enumerate() {
            let shape = (self.kv_heads, self.head_dim);
            let Some((k, v, slot)) = s.cache.decode_slot(shape, q.dtype(), q.device())? else {
                let why = "a cache with decode slots handed out none";
                return Err(peregrine_tensor::candle::Error::Msg(why.into()).into());
            };
            slots.push(AppendSlot { row: j, k, v, slot });
        }
        let q_rows = rope.turn_and_append(&q, (&k, &v), &positions, &slots)?;
        self.attend_rows(&q_rows, segments, q.dtype()).map(Some)
    }

    /// Attention of `q_rows: [sequences, heads, hd]` (each sequence's one new position, its
    /// keys and values appended) over every cache, in one launch where the kernel takes them,
    /// else each alone: `[1, sequences, heads · hd]` in `dtype`.
    fn attend_rows(&self, q_rows: &Tensor, segments: &[Segment], dtype: DType) -> Result<Tensor> {
        let (seqs, hd) = (segments.len(), self.head_dim);
        let kvs: Option<Vec<(Tensor, Tensor)>> =
            segments.iter().map(|s| s.cache.decode_kv()).collect();
        let many = match kvs {
            Some(kvs) => attention_many(q_rows, &kvs, (self.scale, self.softcap), dtype)?,
            None => None,
        };
        let y = match many {
            Some(y) => y,
            None => {
                let rows = (segments.iter().enumerate())
                    .map(|(j, s)| {
                        let q = q_rows.narrow(0, j, 1)?.to_dtype(dtype)?;
                        let q = q.reshape((1, self.heads, 1, hd))?;
                        Ok(s.cache.attend(&q, &self.params())?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 2)?
                    .transpose(1, 2)?
                    .reshape((seqs, self.heads, hd))?
                    .to_dtype(dtype)?
            }
        };
        Ok(y.reshape((1, seqs, self.heads * hd))?)
    }

    /// A GPU step mixing decode rows with prompt chunks (a server admitting prompts while others
    /// decode): each run of consecutive one-row segments through
    /// [`fused_decode_rows`](Self::fused_decode_rows), the others each alone (`one`), so that
    /// the running sequences' rows cost a few launches a layer, not a dozen each. `None` on
    /// the CPU, or where every segment or none is one row (the callers' paths).
    fn mixed_rows(
        &self,
        segments: &mut [Segment],
        rope: &RotaryEmbedding,
        split: &impl Fn(Rows, usize, usize, &Option<Tensor>) -> Result<Tensor>,
        (n_proj, device): (usize, &Device),
        one: &(impl Fn(Rows, &mut Segment) -> Result<Tensor> + Sync),
    ) -> Result<Option<Tensor>> {
        let single = |s: &Segment| s.len == 1;
        let some = segments.iter().any(single) && !segments.iter().all(single);
        if device.is_cpu() || !some {
            return Ok(None);
        }
        let (mut parts, mut at, mut row) = (Vec::new(), 0, 0);
        while at < segments.len() {
            let decode = single(&segments[at]);
            let end = (at..segments.len())
                .find(|&j| single(&segments[j]) != decode)
                .unwrap_or(segments.len());
            let run = &mut segments[at..end];
            let rows: usize = run.iter().map(|s| s.len).sum();
            let fused = match decode {
                true => self.fused_decode_rows(run, rope, split, (row, n_proj, device))?,
                false => None,
            };
            parts.push(match fused {
                Some(y) => y,
                None => per_segment_from(run, row, device, one)?,
            });
            (at, row) = (end, row + rows);
        }
        Ok(Some(Tensor::cat(&parts, 1)?))
    }

    /// A decode step's appends and attention for every sequence, the attention in one launch
    /// (`attention_many`, where it is on and every cache hands out its keys and values):
    /// `[1, sequences, heads · hd]`, or `None`, having appended nothing, where it cannot.
    fn attend_decode_rows(
        &self,
        (q, kv): &DecodeRows,
        segments: &mut [Segment],
    ) -> Result<Option<Tensor>> {
        let off = q.device().is_cpu() || !peregrine_tensor::attention::many_enabled();
        let cached: Option<Vec<(Tensor, Tensor)>> = match off {
            true => None,
            false => segments.iter().map(|s| s.cache.decode_kv()).collect(),
        };
        let Some(dtype) = cached.and_then(|c| c.first().map(|(k, _)| k.dtype())) else {
            return Ok(None);
        };
        let (seqs, hd) = (segments.len(), self.head_dim);
        let row = |t: &Tensor, j: usize| t.narrow(2, j, 1);
        if let Some((k, v)) = kv {
            // Caches with decode slots took the fused path; these append one by one, each
            // row in the caches' dtype and sequence-major once, so each append is one copy.
            let by_sequence = |t: &Tensor| t.to_dtype(dtype)?.transpose(1, 2)?.contiguous();
            let (k, v) = (by_sequence(k)?, by_sequence(v)?);
            let one = |t: &Tensor, j: usize| t.narrow(1, j, 1)?.reshape((1, self.kv_heads, 1, hd));
            for (j, s) in segments.iter_mut().enumerate() {
                s.cache.note_queries(&row(q, j)?, self.kv_heads)?;
                s.cache.append(&one(&k, j)?, &one(&v, j)?)?;
            }
        }
        let q_rows = q.transpose(1, 2)?.reshape((seqs, self.heads, hd))?;
        self.attend_rows(&q_rows, segments, q.dtype()).map(Some)
    }

    fn params(&self) -> AttnParams {
        AttnParams {
            scale: self.scale,
            softcap: self.softcap,
            both_ways: None,
        }
    }
}

impl SelfAttention for Attention {
    /// Phi-3 fuses q/k/v: split at load, the layer stays the same.
    fn load(c: &ModelConfig, w: &Weights, layer: usize) -> Result<Self> {
        let prefix = format!("model.layers.{layer}.self_attn");
        match w.contains(&format!("{prefix}.qkv_proj.weight")) {
            true => Attention::load_fused(c, w, &prefix),
            false => Attention::load(c, w, &prefix),
        }
    }

    /// `x: [1, rows, hidden]`, the stacked rows of `segments` → `[1, rows, hidden]`: the
    /// projections on every row at once, RoPE, the cache and attention per sequence.
    fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        segments: &mut [Segment],
    ) -> Result<Tensor> {
        let (projections, n_proj) = self.projections();
        let qkv = QLinear::forward_group(&projections[..n_proj], x)?; // [1, rows, _] each
        let hd = self.head_dim;
        // A gated q_proj's rows hold each head's query then its gate.
        let q_width = hd * (1 + usize::from(self.output_gate));
        // Rows `rows` of projection `i`, [1, n, heads * hd] → [1, heads, n, hd], normed.
        let split = |rows: Rows, i: usize, heads: usize, norm: &Option<Tensor>| -> Result<Tensor> {
            let (t, n) = (qkv[i].narrow(1, rows.start, rows.len())?, rows.len());
            let t = match i {
                0 => t.reshape((1, n, heads, q_width))?.narrow(3, 0, hd)?,
                _ => t.reshape((1, n, heads, hd))?,
            };
            let t = match norm {
                Some(w) => rms_norm(&t, w, self.eps)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?)
        };
        // A decode step's rows: in one launch on the GPU, else turned in one go.
        let fused = self.fused_decode_rows(segments, rope, &split, (0, n_proj, x.device()))?;
        let turned = match fused {
            Some(_) => None,
            None => self.turn_decode_rows(segments, rope, &split, n_proj)?,
        };
        let batched = match (fused, &turned) {
            (Some(y), _) => Some(y),
            (None, Some(rows)) => self.attend_decode_rows(rows, segments)?,
            (None, None) => None,
        };
        // One sequence's part: its rows' queries (and keys and values) turned, appended to its
        // cache, attended.
        let one = |rows: Rows, s: &mut Segment| -> Result<Tensor> {
            let n = rows.len();
            let turn = |t: Tensor| match (self.no_rope, s.rope) {
                (true, _) => Ok(t.contiguous()?),
                (false, RopeRows::From(p)) => rope.apply(&t, p),
                (false, RopeRows::Axes(axes)) => rope.apply_positions(&t, axes),
            };
            let row = |t: &Tensor| t.narrow(2, rows.start, 1);
            let (q, kv) = match &turned {
                Some((q, kv)) => (row(q)?, kv.as_ref().map(|(k, v)| (row(k), row(v)))),
                None => (
                    turn(split(rows.clone(), 0, self.heads, &self.q_norm)?)?,
                    None,
                ),
            };
            if n_proj > 1 {
                // Values are the keys' projection when the layer has no v_proj.
                let (k, v) = match kv {
                    Some((k, v)) => (k?, v?),
                    None => {
                        let v = split(rows.clone(), n_proj - 1, self.kv_heads, &self.v_norm)?;
                        (
                            turn(split(rows.clone(), 1, self.kv_heads, &self.k_norm)?)?,
                            v,
                        )
                    }
                };
                s.cache.note_queries(&q, self.kv_heads)?;
                s.cache.append(&k, &v)?;
            }
            let params = AttnParams {
                both_ways: s.both_ways,
                ..self.params()
            };
            let y = s.cache.attend(&q, &params)?; // [1, heads, n, hd]
            Ok(y.transpose(1, 2)?
                .reshape((1, n, self.heads * self.head_dim))?)
        };
        let y = match batched {
            Some(y) => y,
            None => match self.mixed_rows(segments, rope, &split, (n_proj, x.device()), &one)? {
                Some(y) => y,
                None => per_segment(segments, x.device(), one)?,
            },
        };
        let y = match self.output_gate {
            true => {
                let rows = y.dim(1)?;
                let q = qkv[0].reshape((1, rows, self.heads, q_width))?;
                let gate = q.narrow(3, hd, hd)?.reshape((1, rows, self.heads * hd))?;
                (y * sigmoid(&gate)?)?
            }
            false => y,
        };
        Ok(self.o_proj.forward(&y)?)
    }

    /// [`forward`](Self::forward) for one token at `pos` over a decode step's buffers: reads
    /// `b.normed`, leaves the projected output in `b.out`.
    fn step(
        &self,
        b: &mut StepBuffers,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        pos: usize,
    ) -> Result<()> {
        self.step_rows(b, rope, &mut [StepRow { cache, pos }])
    }

    fn steps_rows(&self) -> bool {
        !self.output_gate && !self.no_rope
    }

    fn step_rows(
        &self,
        b: &mut StepBuffers,
        rope: &RotaryEmbedding,
        seqs: &mut [StepRow],
    ) -> Result<()> {
        let rows = seqs.len();
        let StepBuffers {
            normed,
            out,
            q,
            k,
            v,
            attn,
            linear,
            attention,
            row_attention,
            ..
        } = b;
        if !self.steps_rows() {
            let why = "this attention has no decode step: its model decodes through forward";
            return Err(peregrine_tensor::candle::Error::Msg(why.into()).into());
        }
        // Buffers are sized for the widest layer; this one uses their front.
        let (q_dim, kv_dim) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let (q, attn) = (&mut q[..rows * q_dim], &mut attn[..rows * q_dim]);
        let (k, v) = (&mut k[..rows * kv_dim], &mut v[..rows * kv_dim]);
        let (projections, n) = self.projections();
        let mut outs: [&mut [f32]; 3] = [q, k, v];
        QLinear::forward_rows_into(&projections[..n], normed, rows, &mut outs[..n], linear)?;
        let [q, k, v] = outs;
        match rows {
            1 => self.attend_row(rope, (q, k, v), &mut seqs[0], attn, attention)?,
            // Each sequence its own cache: in parallel, one region for all their attention.
            _ => (q.par_chunks_mut(q_dim).zip(k.par_chunks_mut(kv_dim)))
                .zip(v.par_chunks_mut(kv_dim))
                .zip(attn.par_chunks_mut(q_dim))
                .zip(seqs.par_iter_mut().zip(row_attention))
                .try_for_each(|((((q, k), v), attn), (seq, scratch))| {
                    self.attend_row(rope, (q, k, v), seq, attn, scratch)
                })?,
        }
        QLinear::forward_rows_into(&[&self.o_proj], attn, rows, &mut [out], linear)?;
        Ok(())
    }

    /// Bytes of weights.
    fn weight_bytes(&self) -> usize {
        let o = self.o_proj.weight_bytes();
        let (projections, n) = self.projections();
        projections[..n]
            .iter()
            .map(|l| l.weight_bytes())
            .sum::<usize>()
            + o
    }
}

/// Each segment's position where all of them are one row at a plain position (a decode step).
fn decode_positions(segments: &[Segment]) -> Option<Vec<u32>> {
    let position = |s: &Segment| match (s.len, s.rope, s.both_ways) {
        (1, RopeRows::From(p), None) => u32::try_from(p).ok(),
        _ => None,
    };
    segments.iter().map(position).collect()
}
