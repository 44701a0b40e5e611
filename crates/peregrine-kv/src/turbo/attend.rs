//! Attention over a TurboQuant cache: scores of compressed keys estimated in the rotated
//! domain, of hot-window keys computed from their f16 rows, one softmax over both, and the
//! compressed values' sum rotated back once per query head.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use peregrine_tensor::attention::AttnScratch;
use peregrine_tensor::{Result, Tensor};
use rayon::prelude::*;

use super::codec::dot;
use super::{PreparedQuery, SINKS, TurboCache, TurboCodec};
use crate::AttnParams;

/// Compressed rows per parallel span of one query's keys (decode has few queries to split).
const CHUNK: usize = 1024;

/// One rayon worker's buffers.
#[derive(Default)]
struct Scratch {
    queries: Vec<PreparedQuery>,
    /// Per query head, the scores of every visible key, then their weights.
    scores: Vec<f32>,
    /// The compressed keys' scores, then their weights, per span of [`CHUNK`] keys per head.
    cold: Vec<f32>,
    /// The hot window's key rows, then its value rows, widened to f32.
    wide: Vec<f32>,
    /// One query row divided by the key scales.
    scaled: Vec<f32>,
}

impl TurboCache {
    /// The compressed, f16 and sink positions a query at `p` reads; a query inside the
    /// `both_ways` span also reads the span's later keys (newer than it, so f16).
    fn reads(
        &self,
        p: usize,
        both_ways: Option<(usize, usize)>,
    ) -> (Range<usize>, Range<usize>, Range<usize>) {
        let first = self.first_visible(p);
        let split = self.split(p).max(first);
        let compressed = first.max(SINKS).max(self.keys.start)..split.min(self.keys.end());
        let hot_end = match both_ways {
            Some((start, end)) if (start..end).contains(&p) => end.max(p + 1),
            _ => p + 1,
        };
        (
            compressed,
            split..hot_end,
            first..split.min(SINKS).max(first),
        )
    }

    /// Whether any of the last `n` positions' queries reads a compressed key; when none does,
    /// the f16 rows are attended by the plain cache kernels.
    fn reads_compressed(&self, n: usize) -> bool {
        let end = self.raw.end();
        (end - n..end).any(|p| {
            let (compressed, _, sinks) = self.reads(p, None);
            !compressed.is_empty() || !sinks.is_empty()
        })
    }

    pub(super) fn attend_tensor(&self, q: &Tensor, params: &AttnParams) -> Result<Tensor> {
        let (_, heads, n, d) = q.dims4()?;
        if !self.reads_compressed(n) {
            return self.raw.attend(q, params, self.window);
        }
        let (q_rows, _, _) = super::cpu_rows(q)?;
        let mut out = vec![0f32; q_rows.len()];
        self.attend_rows(&q_rows, (heads, n, d), params, &mut out)?;
        Tensor::from_vec(out, (1, heads, n, d), &peregrine_tensor::Device::Cpu)
    }

    pub(super) fn attend_one(
        &self,
        q: &[f32],
        d: usize,
        params: &AttnParams,
        (out, scratch): (&mut [f32], &mut AttnScratch),
    ) -> Result<()> {
        if !self.reads_compressed(1) {
            return (self.raw).attend_row(q, d, params, self.window, (out, scratch));
        }
        self.attend_rows(q, (q.len() / d, 1, d), params, out)
    }

    /// Attends queries `q` (`[heads, n, d]`, the last `n` positions') into `out` (alike).
    fn attend_rows(
        &self,
        q: &[f32],
        (heads, n, d): (usize, usize, usize),
        params: &AttnParams,
        out: &mut [f32],
    ) -> Result<()> {
        let (Some(codec), Some((kp, vp, capacity))) = (&self.codec, self.raw.f16_planes()) else {
            return Err(super::bail_msg(
                "attend called on an empty TurboQuant cache",
            ));
        };
        let kv_heads = self.keys.heads.len();
        if heads % kv_heads != 0 || q.len() != heads * n * d || d != codec.head_dim() {
            peregrine_tensor::candle::bail!(
                "TurboQuant attention: {heads} heads × {n} × {d} queries over {kv_heads} kv heads"
            )
        }
        let (groups, end, raw_start) = (heads / kv_heads, self.raw.end(), self.raw.start);
        let scale = params.scale as f32;
        // One task per (position, kv head): its query heads share every key and value row.
        let task = |s: &mut Scratch, t: usize, out: &mut [f32]| {
            let (i, kvh) = (t / kv_heads, t % kv_heads);
            let p = end - n + i;
            let query = |g: usize| &q[((kvh * groups + g) * n + i) * d..][..d];
            let (compressed, hot, sinks) = self.reads(p, params.both_ways);
            let (nc, nh) = (compressed.len(), hot.len());
            // Scores and weights are laid out [compressed | hot | sinks] per query head.
            let keys = nc + nh + sinks.len();
            let Scratch {
                queries,
                scores,
                cold,
                wide,
                scaled,
            } = s;
            scores.resize(groups * keys, 0.0);
            // Compressed keys in spans of CHUNK rows, scored in parallel: [span][group][row].
            cold.resize(groups * nc, 0.0);
            let span = |c: usize| c * CHUNK..((c + 1) * CHUNK).min(nc);
            let (mean_k, mean_v) = self.means.of(kvh, d);
            if nc > 0 {
                queries.resize_with(groups, PreparedQuery::default);
                let qs = self.scales.of(kvh, d).1;
                for (g, pq) in queries.iter_mut().enumerate() {
                    // The keys were encoded scaled by `s`: the query takes `1 / s`.
                    scaled.clear();
                    scaled.extend_from_slice(query(g));
                    scaled.iter_mut().zip(qs).for_each(|(x, s)| *x *= s);
                    codec.prepare_query(scaled, pq);
                    // Rows stored less the mean key get `<q, mean>` back in the kernel.
                    pq.set_centred_offset(dot(query(g), mean_k));
                }
                let kb = codec.key_bytes();
                let rows = self.keys.rows(kvh, compressed.clone());
                let queries = &queries[..];
                cold.par_chunks_mut(groups * CHUNK)
                    .enumerate()
                    .for_each(|(c, block)| {
                        let r = span(c);
                        codec.scores_grouped(
                            queries,
                            &rows[r.start * kb..r.end * kb],
                            scale,
                            block,
                        );
                    });
            }
            let at = |pos: usize| (kvh * capacity + pos - raw_start) * d;
            // The hot rows are consecutive slots: widened once, with F16C where the CPU has it.
            let widen = |plane: &[f16], wide: &mut Vec<f32>| {
                wide.resize(nh * d, 0.0);
                plane[at(hot.start)..][..nh * d].convert_to_f32_slice(wide);
            };
            widen(kp, wide);
            for (g, row) in scores.chunks_exact_mut(keys).enumerate() {
                for (c, block) in cold.chunks(groups * CHUNK).enumerate() {
                    let r = span(c);
                    row[r.clone()].copy_from_slice(&block[g * r.len()..][..r.len()]);
                }
                let query = query(g);
                for (score, key) in row[nc..].iter_mut().zip(wide.chunks_exact(d)) {
                    *score = scale * dot(query, key);
                }
                for (score, p) in row[nc + nh..].iter_mut().zip(sinks.clone()) {
                    *score = scale * dot(query, self.sink(0, kvh, p, d));
                }
                softmax(row, params.softcap);
                for (c, block) in cold.chunks_mut(groups * CHUNK).enumerate() {
                    let r = span(c);
                    block[g * r.len()..][..r.len()].copy_from_slice(&row[r]);
                }
            }
            out.fill(0.0);
            if nc > 0 {
                let vb = codec.value_bytes();
                let rows = self.values.rows(kvh, compressed);
                let partial = |c: usize, weights: &[f32]| {
                    let r = span(c);
                    let mut acc = vec![0f32; groups * d];
                    codec.accumulate_values_grouped(
                        weights,
                        &rows[r.start * vb..r.end * vb],
                        &mut acc,
                    );
                    acc
                };
                let partials: Vec<Vec<f32>> = (cold.par_chunks(groups * CHUNK).enumerate())
                    .map(|(c, weights)| partial(c, weights))
                    .collect();
                // Summed in span order: the result must not depend on the thread schedule.
                for partial in partials {
                    out.iter_mut().zip(partial).for_each(|(o, x)| *o += x);
                }
                for (g, acc) in out.chunks_exact_mut(d).enumerate() {
                    codec.finish_values(acc);
                    let marked = rows.chunks_exact(vb).map(TurboCodec::is_centered);
                    let weights = scores[g * keys..][..nc].iter().zip(marked);
                    let weight: f32 = weights.filter(|(_, m)| *m).map(|(w, _)| w).sum();
                    acc.iter_mut()
                        .zip(mean_v)
                        .for_each(|(a, m)| *a += weight * m);
                }
            }
            widen(vp, wide);
            for (g, acc) in out.chunks_exact_mut(d).enumerate() {
                let weights = &scores[g * keys + nc..][..nh];
                for (&w, value) in weights.iter().zip(wide.chunks_exact(d)) {
                    acc.iter_mut().zip(value).for_each(|(a, v)| *a += w * v);
                }
                let weights = &scores[g * keys + nc + nh..][..sinks.len()];
                for (&w, p) in weights.iter().zip(sinks.clone()) {
                    let value = self.sink(1, kvh, p, d);
                    acc.iter_mut().zip(value).for_each(|(a, v)| *a += w * v);
                }
            }
        };
        // Written as [n, kv_heads, groups, d]: the order of the tasks.
        let mut by_task = match n {
            1 => Vec::new(), // one position: that order is the output's
            _ => vec![0f32; out.len()],
        };
        let target = if n == 1 { &mut *out } else { &mut by_task[..] };
        target
            .par_chunks_mut(groups * d)
            .enumerate()
            .for_each_init(Scratch::default, |s, (t, out)| task(s, t, out));
        if n > 1 {
            for (t, rows) in by_task.chunks_exact(groups * d).enumerate() {
                let (i, kvh) = (t / kv_heads, t % kv_heads);
                for (g, row) in rows.chunks_exact(d).enumerate() {
                    out[((kvh * groups + g) * n + i) * d..][..d].copy_from_slice(row);
                }
            }
        }
        Ok(())
    }
}

/// Normalized softmax in place, after an optional soft cap (the reference's order).
fn softmax(scores: &mut [f32], softcap: Option<f32>) {
    if let Some(cap) = softcap {
        scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut total = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        total += *s;
    }
    scores.iter_mut().for_each(|s| *s /= total);
}
