//! TurboQuant KV compression (`--turbo-kv`): once a sequence passes an activation threshold,
//! positions older than a hot window are kept only as [`TurboCodec`] rows (≈5 bits per key
//! value, ≈3.125 per value value at `head_dim` 128) and attention scores them in the rotated
//! domain; the hot window stays f16. The same on full-attention and sliding-window layers
//! (though `SequenceCache` gives a window within the threshold a plain f16 ring).
//! Rows closer to their head's mean key or value (of the positions before the threshold) than
//! to zero are stored as the difference, which shrinks the codec's error (see `Means`).
//! Keys are encoded scaled per channel to the queries that read them, queries divided by the
//! same scales (see `scales`): the scores are unchanged, their error smaller.
//!
//! Which form a query reads is a function of its position alone (keys older than `hot_window`
//! positions are read compressed once the sequence holds more than `threshold`), so a prompt
//! prefilled in chunks, token by token, or trimmed and regenerated attends identically.

mod attend;
mod codebook;
mod codec;
mod scales;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use codec::{PreparedQuery, TurboCodec, TurboKeys};

use half::f16;
use peregrine_tensor::{DType, Device, Result, Tensor};

use crate::buffer::KvBuffer;
use crate::{AttnParams, LayerCache};
use scales::KeyScales;

/// TurboQuant's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurboOptions {
    /// Most recent positions always read uncompressed.
    pub hot_window: usize,
    /// Compression starts once the sequence holds more than this many positions.
    pub threshold: usize,
    /// How compressed keys are coded.
    pub keys: TurboKeys,
}

impl Default for TurboOptions {
    fn default() -> Self {
        Self {
            hot_window: 256,
            threshold: 2048,
            keys: TurboKeys::Mse,
        }
    }
}

/// Whether TurboQuant can compress rows `head_dim` wide.
pub fn supports(head_dim: usize) -> bool {
    head_dim.is_power_of_two() && (16..=1024).contains(&head_dim)
}

/// The first positions, read exact wherever they would be read compressed: attention sinks
/// (the sequence's first tokens) take the largest weights, and an error in their scores moves
/// every output.
const SINKS: usize = 4;

/// Free hot-window slots: the f16 buffer is re-laid out once per this many decode steps.
const SLACK: usize = 16;

/// The codec of `head_dim` and `keys`, one per process: a random rotation serves every layer
/// equally well, and sharing it keeps its `d × d` sketch out of every sequence's memory.
fn shared_codec(head_dim: usize, keys: TurboKeys) -> Result<Arc<TurboCodec>> {
    type Codecs = HashMap<(usize, TurboKeys), Arc<TurboCodec>>;
    static CODECS: OnceLock<Mutex<Codecs>> = OnceLock::new();
    let mut codecs = CODECS.get_or_init(Default::default).lock();
    let codecs = codecs
        .as_mut()
        .map_err(|_| bail_msg("TurboQuant codecs: poisoned lock"))?;
    if let Some(codec) = codecs.get(&(head_dim, keys)) {
        return Ok(codec.clone());
    }
    let codec = Arc::new(TurboCodec::new(head_dim, 0x7475_7262_6f6b_7600, keys)?);
    codecs.insert((head_dim, keys), codec.clone());
    Ok(codec)
}

/// One layer's TurboQuant cache: compressed rows of old positions, f16 rows of recent ones.
#[derive(Debug, Clone)]
pub struct TurboCache {
    /// Recent positions, f16, for reading and for encoding once they leave the hot window.
    raw: KvBuffer,
    keys: Compressed,
    values: Compressed,
    codec: Option<Arc<TurboCodec>>,
    options: TurboOptions,
    /// Sliding-window width; `None` for full attention.
    window: Option<usize>,
    rollback: usize,
    means: Means,
    scales: KeyScales,
    /// `[keys, values][head][SINKS][d]`: the rows of positions `0..SINKS.min(len)`, widened.
    sinks: Vec<f32>,
}

/// Per kv head, the mean key and value rows of positions `0..threshold`. A compressed row
/// stores its difference from the mean where that is shorter (keys and values share large
/// per-channel offsets, and the codec's error scales with the norm), and attention adds the
/// mean back exactly: `q·μ_k` to such a key's score, such values' weights times `μ_v` to the
/// output. Rows far from the mean (attention sinks) stay as they are. A function of those
/// positions alone, so chunking and rollback leave it unchanged.
#[derive(Debug, Clone, Default)]
struct Means {
    /// `[keys, values][head][d]` sums of the f16 rows, each value scaled by 2^24 to an exact
    /// integer, so that trimming subtracts rows back exactly.
    sums: Vec<i128>,
    /// `[head][d]` sums of the key rows' squares, scaled by 2^48 (exact integers too).
    squares: Vec<i128>,
    /// `[keys, values][head][d]`, set when encoding starts (the sums cannot change while any
    /// row is encoded: they count positions before the threshold only).
    rows: Vec<f32>,
}

/// `2^24`: every f16 value times this is an integer.
const F16_FIXED: f32 = 16_777_216.0;

impl Means {
    /// The means of the `counted` rows summed, into `rows`.
    fn settle(&mut self, counted: usize) {
        let n = counted.max(1) as f64 * F16_FIXED as f64;
        self.rows.clear();
        self.rows
            .extend(self.sums.iter().map(|&s| (s as f64 / n) as f32));
    }

    /// `[head][d]`: each key channel's variance over the `counted` rows summed.
    fn key_variances(&self, counted: usize) -> Vec<f64> {
        let n = counted.max(1) as f64;
        let fixed = F16_FIXED as f64;
        (self.squares.iter().zip(&self.sums))
            .map(|(&sq, &s)| {
                let mean = s as f64 / (n * fixed);
                (sq as f64 / (n * fixed * fixed) - mean * mean).max(0.0)
            })
            .collect()
    }

    fn bytes(&self) -> usize {
        size_of_val(&self.sums[..]) + size_of_val(&self.squares[..]) + size_of_val(&self.rows[..])
    }

    /// Head `h`'s mean key row, then its mean value row (empty before any is settled).
    fn of(&self, h: usize, d: usize) -> (&[f32], &[f32]) {
        if self.rows.is_empty() {
            return (&[], &[]);
        }
        let heads = self.rows.len() / (2 * d);
        (&self.rows[h * d..][..d], &self.rows[(heads + h) * d..][..d])
    }
}

/// Encoded rows of positions `start..start + len`, one growing buffer per kv head.
#[derive(Debug, Clone, Default)]
struct Compressed {
    heads: Vec<Vec<u8>>,
    row_bytes: usize,
    start: usize,
    len: usize,
}

impl Compressed {
    fn end(&self) -> usize {
        self.start + self.len
    }

    /// Rows of positions `range` of head `h`.
    fn rows(&self, h: usize, range: std::ops::Range<usize>) -> &[u8] {
        let b = self.row_bytes;
        &self.heads[h][(range.start - self.start) * b..(range.end - self.start) * b]
    }

    /// Keeps positions before `end` only.
    fn truncate(&mut self, end: usize) {
        self.len = end.saturating_sub(self.start).min(self.len);
        let bytes = self.len * self.row_bytes;
        self.heads.iter_mut().for_each(|h| h.truncate(bytes));
    }

    /// Forgets positions before `first` once they are a quarter of the rows (moves stay rare).
    fn forget_before(&mut self, first: usize) {
        let dead = first.saturating_sub(self.start).min(self.len);
        if dead > 0 && (dead == self.len || 4 * dead >= self.len) {
            let bytes = dead * self.row_bytes;
            self.heads.iter_mut().for_each(|h| drop(h.drain(..bytes)));
            self.start += dead;
            self.len -= dead;
        }
    }

    /// Appends one encoded row per head for position `self.end()`, growing 128 rows at a time.
    fn push(&mut self, rows: &[u8]) {
        let b = self.row_bytes;
        for (h, row) in self.heads.iter_mut().zip(rows.chunks_exact(b)) {
            if h.len() == h.capacity() {
                h.reserve_exact(128 * b);
            }
            h.extend_from_slice(row);
        }
        self.len += 1;
    }

    fn bytes(&self) -> usize {
        self.heads.iter().map(Vec::capacity).sum()
    }
}

impl TurboCache {
    /// A full-attention (`window: None`) or sliding-window cache that can roll back
    /// `rollback` positions exactly.
    pub fn new(options: TurboOptions, window: Option<usize>, rollback: usize) -> Self {
        Self {
            raw: KvBuffer::new(Some(DType::F16)),
            keys: Compressed::default(),
            values: Compressed::default(),
            codec: None,
            options: TurboOptions {
                hot_window: options.hot_window.max(1),
                ..options
            },
            window: window.map(|w| w.max(1)),
            rollback,
            means: Means::default(),
            scales: KeyScales::default(),
            sinks: Vec::new(),
        }
    }

    /// Positions before this one are read compressed by a query at position `p`.
    fn split(&self, p: usize) -> usize {
        match p + 1 > self.options.threshold {
            true => (p + 1).saturating_sub(self.options.hot_window),
            false => 0,
        }
    }

    /// The first position a query at `p` sees.
    fn first_visible(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }

    /// Positions a cache of `len` keeps compressed: all before this one, once it is active.
    fn compressed_end(&self, len: usize) -> usize {
        match len > self.options.threshold {
            true => len - self.options.hot_window.min(len),
            false => 0,
        }
    }

    /// The first position whose f16 row a cache of `len` still needs: to encode it later, or
    /// for the next query (at position `len`) to read.
    fn raw_needed_from(&self, len: usize) -> usize {
        self.compressed_end(len).max(self.first_visible(len))
    }

    /// Appends `n` positions: f16 rows first, then codes for those leaving the hot window.
    fn append_rows(&mut self, k: &[f32], v: &[f32], heads: usize, n: usize) -> Result<()> {
        let head_dim = k.len() / (heads * n);
        let codec = match &self.codec {
            Some(c) => c.clone(),
            None => {
                let codec = shared_codec(head_dim, self.options.keys)
                    .map_err(|e| bail_msg(&format!("--turbo-kv on this layer: {e}")))?;
                self.keys = Compressed {
                    heads: vec![Vec::new(); heads],
                    row_bytes: codec.key_bytes(),
                    ..Compressed::default()
                };
                self.values = Compressed {
                    row_bytes: codec.value_bytes(),
                    ..self.keys.clone()
                };
                self.codec = Some(codec.clone());
                self.means.sums = vec![0; 2 * heads * head_dim];
                self.means.squares = vec![0; heads * head_dim];
                self.sinks = vec![0.0; 2 * heads * SINKS * head_dim];
                codec
            }
        };
        let old = self.raw.end();
        // What the shortest state a rollback may return to still needs.
        let keep_from = self.raw_needed_from(old.saturating_sub(self.rollback));
        let keep = old - keep_from.max(self.raw.start);
        self.raw
            .make_room_tight(n, keep, SLACK, (heads, head_dim), &Device::Cpu)?;
        let t = |x: &[f32]| Tensor::from_slice(x, (1, heads, n, head_dim), &Device::Cpu);
        self.raw.append(&t(k)?, &t(v)?, None)?;
        self.count_means(old..old + n, 1);
        self.keep_sinks(old..(old + n).min(SINKS));
        self.encode_up_to(self.compressed_end(old + n), &codec, heads, head_dim);
        let limit = self.options.threshold.saturating_sub(1);
        if self.scales.settled() && self.raw_needed_from(limit) < self.raw.start {
            // No rollback reaches back before the threshold any more.
            self.scales.freeze();
        }
        let first = self.first_visible((old + n).saturating_sub(self.rollback));
        self.keys.forget_before(first);
        self.values.forget_before(first);
        Ok(())
    }

    /// The f16 rows of `positions` (in the f16 buffer): `(plane, head, position, row)`, keys
    /// (plane 0) then values (1).
    fn f16_rows(
        &self,
        positions: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, usize, usize, &[f16])> {
        let planes = self.raw.f16_planes().zip(self.codec.as_ref());
        let (heads, start) = (self.keys.heads.len(), self.raw.start);
        planes
            .into_iter()
            .flat_map(move |((kp, vp, capacity), codec)| {
                let d = codec.head_dim();
                let positions = positions.clone();
                [kp, vp]
                    .into_iter()
                    .enumerate()
                    .flat_map(move |(plane, rows)| {
                        let positions = positions.clone();
                        (0..heads).flat_map(move |h| {
                            positions.clone().map(move |p| {
                                let at = (h * capacity + p - start) * d;
                                (plane, h, p, &rows[at..at + d])
                            })
                        })
                    })
            })
    }

    /// Adds (`sign` 1) or subtracts (-1) the f16 rows of `positions` before the threshold to
    /// or from the means' sums.
    fn count_means(&mut self, positions: std::ops::Range<usize>, sign: i128) {
        let counted = positions.start..positions.end.min(self.options.threshold);
        let (heads, mut sums) = (self.keys.heads.len(), std::mem::take(&mut self.means.sums));
        let mut squares = std::mem::take(&mut self.means.squares);
        for (plane, h, _, row) in self.f16_rows(counted) {
            let at = (plane * heads + h) * row.len();
            for (i, x) in row.iter().enumerate() {
                let x = (x.to_f32() * F16_FIXED) as i128;
                sums[at + i] += sign * x;
                if plane == 0 {
                    squares[at + i] += sign * x * x;
                }
            }
        }
        (self.means.sums, self.means.squares) = (sums, squares);
    }

    /// Copies the f16 rows of sink `positions` into `sinks`.
    fn keep_sinks(&mut self, positions: std::ops::Range<usize>) {
        let (heads, mut sinks) = (self.keys.heads.len(), std::mem::take(&mut self.sinks));
        for (plane, h, p, row) in self.f16_rows(positions) {
            let to = ((plane * heads + h) * SINKS + p) * row.len();
            widen(row, &mut sinks[to..to + row.len()]);
        }
        self.sinks = sinks;
    }

    /// Sink position `p`'s key row (`plane` 0) or value row (1) of head `h`.
    fn sink(&self, plane: usize, h: usize, p: usize, d: usize) -> &[f32] {
        let heads = self.keys.heads.len();
        &self.sinks[((plane * heads + h) * SINKS + p) * d..][..d]
    }

    /// Encodes the f16 rows of positions up to `end` not yet encoded.
    fn encode_up_to(&mut self, end: usize, codec: &TurboCodec, heads: usize, d: usize) {
        if self.keys.len == 0 && self.keys.end() < end {
            let counted = self.raw.end().min(self.options.threshold);
            self.means.settle(counted);
            if !self.scales.settled() {
                self.scales.settle(&self.means.key_variances(counted), d);
            }
        }
        let (kp, vp, capacity) = self.raw.f16_planes().expect("an f16 CPU buffer");
        if self.keys.end() < self.raw.start {
            // Positions before the f16 rows are outside every window: never read.
            for c in [&mut self.keys, &mut self.values] {
                c.truncate(0);
                c.start = self.raw.start;
            }
        }
        let (mut row, mut krows, mut vrows) = (vec![0f32; d], Vec::new(), Vec::new());
        krows.resize(heads * codec.key_bytes(), 0);
        vrows.resize(heads * codec.value_bytes(), 0);
        // Each head's mean key in the scaled domain the codec sees.
        let scaled_means: Vec<Vec<f32>> = (0..heads)
            .map(|h| match (self.means.of(h, d).0, self.scales.of(h, d).0) {
                (mean, []) => mean.to_vec(),
                (mean, s) => mean.iter().zip(s).map(|(m, s)| m * s).collect(),
            })
            .collect();
        for p in self.keys.end()..end {
            let slot = p - self.raw.start;
            for h in 0..heads {
                let at = (h * capacity + slot) * d;
                let (kb, vb) = (codec.key_bytes(), codec.value_bytes());
                let (mv, ks) = (self.means.of(h, d).1, self.scales.of(h, d).0);
                widen(&kp[at..at + d], &mut row);
                row.iter_mut().zip(ks).for_each(|(x, s)| *x *= s);
                let out = &mut krows[h * kb..][..kb];
                codec.encode_key_near(&row, &scaled_means[h], out);
                widen(&vp[at..at + d], &mut row);
                let out = &mut vrows[h * vb..][..vb];
                codec.encode_value_near(&row, mv, out);
            }
            self.keys.push(&krows);
            self.values.push(&vrows);
        }
    }
}

fn widen(x: &[f16], out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, x)| *o = x.to_f32());
}

fn bail_msg(msg: &str) -> peregrine_tensor::candle::Error {
    peregrine_tensor::candle::Error::Msg(msg.to_string())
}

/// f32 data of a `[1, heads, n, d]` tensor on the CPU, and `(heads, n)`.
fn cpu_rows(x: &Tensor) -> Result<(Vec<f32>, usize, usize)> {
    let (_, heads, n, _) = x.dims4()?;
    if !x.device().is_cpu() {
        return Err(bail_msg("--turbo-kv is implemented on the CPU only"));
    }
    let data = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok((data, heads, n))
}

impl LayerCache for TurboCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let ((k, heads, n), (v, _, _)) = (cpu_rows(k)?, cpu_rows(v)?);
        self.append_rows(&k, &v, heads, n)
    }

    fn append_row(&mut self, k: &[f32], v: &[f32], head_dim: usize) -> Result<()> {
        self.append_rows(k, v, k.len() / head_dim, 1)
    }

    fn note_queries(&mut self, q: &Tensor, kv_heads: usize) -> Result<()> {
        if self.scales.wants(self.raw.end(), self.options.threshold) {
            let (_, heads, n, d) = q.dims4()?;
            let (q, _, _) = cpu_rows(q)?;
            let shape = [heads, n, d, kv_heads];
            (self.scales).note(self.raw.end(), &q, shape, self.options.threshold);
        }
        Ok(())
    }

    fn note_query_row(&mut self, q: &[f32], head_dim: usize, kv_heads: usize) -> Result<()> {
        let shape = [q.len() / head_dim, 1, head_dim, kv_heads];
        (self.scales).note(self.raw.end(), q, shape, self.options.threshold);
        Ok(())
    }

    fn attend(&self, q: &Tensor, params: &AttnParams) -> Result<Tensor> {
        self.attend_tensor(q, params)
    }

    fn attend_row(
        &self,
        q: &[f32],
        head_dim: usize,
        params: &AttnParams,
        out: &mut [f32],
        scratch: &mut peregrine_tensor::attention::AttnScratch,
    ) -> Result<()> {
        self.attend_one(q, head_dim, params, (out, scratch))
    }

    fn len(&self) -> usize {
        self.raw.end()
    }

    fn can_trim(&self, n: usize) -> bool {
        let Some(len) = self.raw.end().checked_sub(n).filter(|_| n <= self.raw.used) else {
            return false;
        };
        // The shorter state's next query reads compressed keys from its first visible one.
        let reads_compressed = self.first_visible(len) < self.compressed_end(len);
        self.raw_needed_from(len) >= self.raw.start
            && (!reads_compressed || self.first_visible(len) >= self.keys.start)
    }

    fn trim(&mut self, n: usize) -> Result<()> {
        if !self.can_trim(n) {
            peregrine_tensor::candle::bail!(
                "cannot trim {n} positions exactly: the TurboQuant cache holds f16 rows of \
                 positions {}..{} only (hot window {}, rollback margin {})",
                self.raw.start,
                self.raw.end(),
                self.options.hot_window,
                self.rollback
            )
        }
        let end = self.raw.end();
        self.count_means(end - n..end, -1);
        self.raw.trim(n);
        self.scales.trim(self.raw.end(), self.options.threshold);
        let end = self.compressed_end(self.raw.end());
        self.keys.truncate(end);
        self.values.truncate(end);
        Ok(())
    }

    fn bytes(&self) -> usize {
        let side = size_of_val(&self.sinks[..]) + self.means.bytes() + self.scales.bytes();
        self.raw.bytes() + self.keys.bytes() + self.values.bytes() + side
    }

    fn snapshot(&self) -> Result<Box<dyn LayerCache>> {
        Ok(Box::new(self.clone()))
    }
}
