//! The decode step on the CPU: one token through the model over buffers allocated once per
//! sequence slot and reused every token, so the hot path allocates nothing (GGUF and regrouped
//! MLX weights; KV buffers still grow in steps of 256 positions). Each architecture's `decode`
//! runs the same layers as its `forward`, which stays the reference the step is tested against.

use std::sync::Mutex;

use peregrine_kv::LayerCache;
use peregrine_tensor::attention::AttnScratch;
use peregrine_tensor::linear::LinearScratch;
use peregrine_tensor::ops::{rms_norm_into, rms_norm_rows_in_place, with_f32};
use peregrine_tensor::{QLinear, Tensor};

use crate::layers::batch::BatchSeq;
use crate::{ModelConfig, ModelError, Result};

/// The activations of one decode step, each sized for its place in the layer: one token's,
/// or a batched step's `rows` tokens' (one per sequence, row-major in each buffer).
pub struct StepBuffers {
    /// Rows each buffer holds (1 for a single sequence's step).
    pub rows: usize,
    /// The residual stream, `[hidden]`.
    pub x: Vec<f32>,
    /// A normed copy of `x` (a block's input), `[hidden]`.
    pub normed: Vec<f32>,
    /// A block's output before it joins `x`, `[hidden]`.
    pub out: Vec<f32>,
    /// Query heads, `[heads · head_dim]`.
    pub q: Vec<f32>,
    /// Key heads, `[kv_heads · head_dim]`.
    pub k: Vec<f32>,
    /// Value heads, `[kv_heads · head_dim]`.
    pub v: Vec<f32>,
    /// Attention's output heads, `[heads · head_dim]`.
    pub attn: Vec<f32>,
    /// The MLP's (or an expert's) gate, then its activation, `[intermediate]`.
    pub gate: Vec<f32>,
    /// The MLP's up projection, `[intermediate]`.
    pub up: Vec<f32>,
    /// The matmuls' quantized input.
    pub linear: LinearScratch,
    /// Attention's partial sums.
    pub attention: AttnScratch,
    /// Each row's attention partial sums in a batched step (rows attend in parallel).
    pub row_attention: Vec<AttnScratch>,
    /// An MoE block's routing and expert output (empty for dense models).
    pub moe: MoeBuffers,
    /// Multi-head latent attention's intermediates (empty without MLA).
    pub mla: MlaBuffers,
    /// A block's output held while another block runs (Gemma 4's dense MLP beside its
    /// experts), `[hidden]`.
    pub side: Vec<f32>,
    /// Per-layer input embeddings (empty without them).
    pub per_layer: PerLayerBuffers,
}

/// A decode step's per-layer input buffers (Gemma 4).
#[derive(Default)]
pub struct PerLayerBuffers {
    /// Every layer's input, `[layers · width]`.
    pub inputs: Vec<f32>,
    /// The token's row of the per-layer table, `[layers · width]`.
    pub token: Vec<f32>,
    /// One layer's gate, `[width]`.
    pub gate: Vec<f32>,
}

/// A decode step's multi-head latent attention buffers (DeepSeek-V3).
#[derive(Default)]
pub struct MlaBuffers {
    /// The query bottleneck, `[q_lora_rank]`.
    pub q_a: Vec<f32>,
    /// The compressed latent and the shared RoPE key, `[kv_lora_rank + qk_rope_head_dim]`.
    pub kv_a: Vec<f32>,
    /// Queries as projected, `[heads · (nope + rope)]`.
    pub q: Vec<f32>,
    /// The queries' RoPE parts, turned, `[heads · rope]`.
    pub q_pe: Vec<f32>,
    /// Attention's output heads at their value width, `[heads · v]`.
    pub o: Vec<f32>,
}

impl MlaBuffers {
    fn new(c: &ModelConfig) -> Self {
        let Some(m) = &c.mla else {
            return Self::default();
        };
        let heads = c.num_attention_heads;
        Self {
            q_a: vec![0.0; m.q_lora_rank.unwrap_or(0)],
            kv_a: vec![0.0; m.kv_lora_rank + m.qk_rope_head_dim],
            q: vec![0.0; heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)],
            q_pe: vec![0.0; heads * m.qk_rope_head_dim],
            o: vec![0.0; heads * m.v_head_dim],
        }
    }
}

/// A decode step's MoE buffers.
#[derive(Default)]
pub struct MoeBuffers {
    /// Router logits, then scores, `[experts]`.
    pub logits: Vec<f32>,
    /// The router's choice scores, `[experts]`.
    pub scratch: Vec<f32>,
    /// Chosen experts, `[top_k]`.
    pub ids: Vec<usize>,
    /// Their weights, `[top_k]`.
    pub weights: Vec<f32>,
    /// One expert's output, `[hidden]`.
    pub out: Vec<f32>,
    /// The block's input normed for the router or the experts (Gemma 4), `[hidden]`.
    pub input: Vec<f32>,
}

impl MoeBuffers {
    fn new(c: &ModelConfig) -> Self {
        let Some(moe) = &c.moe else {
            return Self::default();
        };
        Self {
            logits: vec![0.0; moe.num_experts],
            scratch: vec![0.0; moe.num_experts],
            ids: vec![0; moe.top_k],
            weights: vec![0.0; moe.top_k],
            out: vec![0.0; c.hidden_size],
            input: vec![0.0; c.hidden_size],
        }
    }
}

impl StepBuffers {
    fn new(c: &ModelConfig, rows: usize) -> Self {
        let zeros = |n: usize| vec![0f32; n * rows];
        // Sized for the widest layer; each layer uses the front of a buffer.
        let layers = (0..c.num_hidden_layers.max(1)).map(|i| c.for_layer(i));
        let (mut q_dim, mut kv_dim, mut intermediate) = (0, 0, 0);
        for l in layers {
            q_dim = q_dim.max(l.num_attention_heads * l.head_dim);
            kv_dim = kv_dim.max(l.num_key_value_heads * l.head_dim);
            intermediate = intermediate.max(l.intermediate_size);
        }
        // Dense layers and experts share the MLP's buffers.
        let intermediate = intermediate.max(c.moe.as_ref().map_or(0, |m| {
            m.intermediate_size
                .max(m.shared_intermediate_size.unwrap_or(0))
        }));
        let per_layer = match c.per_layer_input.filter(|_| rows == 1) {
            Some(p) => PerLayerBuffers {
                inputs: zeros(c.num_hidden_layers * p.hidden),
                token: zeros(c.num_hidden_layers * p.hidden),
                gate: zeros(p.hidden),
            },
            None => PerLayerBuffers::default(),
        };
        Self {
            rows,
            x: zeros(c.hidden_size),
            normed: zeros(c.hidden_size),
            out: zeros(c.hidden_size),
            q: zeros(q_dim),
            k: zeros(kv_dim),
            v: zeros(kv_dim),
            attn: zeros(q_dim),
            gate: zeros(intermediate),
            up: zeros(intermediate),
            linear: LinearScratch::default(),
            attention: AttnScratch::default(),
            row_attention: (0..rows).map(|_| AttnScratch::default()).collect(),
            // Batched steps run dense attention and MLPs only.
            moe: if rows == 1 {
                MoeBuffers::new(c)
            } else {
                MoeBuffers::default()
            },
            mla: if rows == 1 {
                MlaBuffers::new(c)
            } else {
                MlaBuffers::default()
            },
            side: zeros(c.hidden_size),
            per_layer,
        }
    }
}

/// One sequence's part of a layer in a batched decode step: that layer's cache and the rotary
/// position of the sequence's new token.
pub struct StepRow<'a> {
    /// The layer's cache of this sequence.
    pub cache: &'a mut dyn LayerCache,
    /// The new token's rotary position.
    pub pos: usize,
}

/// Step buffers for the sequences decoding at once: a step takes a set (allocated the first
/// time only) and gives it back, so the model stays shareable across threads.
#[derive(Default)]
pub struct StepPool(Mutex<Vec<StepBuffers>>);

impl StepPool {
    /// Runs `f` with a set of buffers sized for `c`.
    pub fn run<R>(&self, c: &ModelConfig, f: impl FnOnce(&mut StepBuffers) -> R) -> R {
        self.run_rows(c, 1, f)
    }

    /// Runs `f` with a set of buffers sized for `c` and `rows` sequences (a set of that many
    /// rows is kept for the next step of as many).
    pub fn run_rows<R>(
        &self,
        c: &ModelConfig,
        rows: usize,
        f: impl FnOnce(&mut StepBuffers) -> R,
    ) -> R {
        let taken = {
            let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let at = held.iter().rposition(|b| b.rows == rows);
            at.map(|i| held.swap_remove(i))
        };
        let mut buffers = taken.unwrap_or_else(|| StepBuffers::new(c, rows));
        let result = f(&mut buffers);
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buffers);
        result
    }
}

/// `out = rms_norm(x) · w` for one row, `w` an f32 CPU tensor (every CPU model's norms).
pub fn norm_into(x: &[f32], w: &Tensor, eps: f32, out: &mut [f32]) -> Result<()> {
    with_f32(w, |w| rms_norm_into(x, w, eps, out))?.ok_or_else(not_f32)
}

/// [`norm_into`] on each `w.len()`-wide row of `x` (a batched step's residual rows).
pub fn norm_rows_into(x: &[f32], w: &Tensor, eps: f32, out: &mut [f32]) -> Result<()> {
    let width = w.elem_count().max(1);
    for (x, out) in x.chunks(width).zip(out.chunks_mut(width)) {
        norm_into(x, w, eps, out)?;
    }
    Ok(())
}

/// Each `w.len()`-wide row of `x` normed in place (per-head q/k norms).
pub fn norm_rows_in_place(x: &mut [f32], w: &Tensor, eps: f32) -> Result<()> {
    with_f32(w, |w| rms_norm_rows_in_place(x, w, eps))?.ok_or_else(not_f32)
}

fn not_f32() -> ModelError {
    ModelError::Tensor(peregrine_tensor::candle::Error::Msg(
        "decode step: norm weights must be f32 on the CPU".into(),
    ))
}

/// `x += y`.
pub fn add_into(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
}

/// `x += rms_norm(y) · w` on each `w.len()`-wide row, `scratch` (as long as `y`) holding the
/// normed `y`: [`add_normed`](super::add_normed) in the step.
pub fn add_normed_into(
    x: &mut [f32],
    y: &[f32],
    w: &Tensor,
    eps: f32,
    scratch: &mut [f32],
) -> Result<()> {
    norm_rows_into(y, w, eps, scratch)?;
    add_into(x, scratch);
    Ok(())
}

/// [`softcap`](peregrine_tensor::attention::softcap) on a row of f32 logits, in the same
/// operations (candle divides by multiplying with the reciprocal), so that decode and
/// `forward` agree bit for bit.
pub fn softcap_in_place(logits: &mut [f32], cap: f32) {
    let inv = (1.0 / cap as f64) as f32;
    logits.iter_mut().for_each(|l| *l = (*l * inv).tanh() * cap);
}

/// The output head for one token: final norm of `b.x`, then `lm_head` into `logits`.
pub fn output_logits_into(
    b: &mut StepBuffers,
    norm: &Tensor,
    eps: f32,
    lm_head: &QLinear,
    vocab: usize,
    logits: &mut Vec<f32>,
) -> Result<()> {
    logits.resize(vocab, 0.0);
    head_rows_into(b, norm, eps, lm_head, logits)
}

/// The output head on every row of a step's buffers: the final norm of `b.x`, then `lm_head`
/// into `logits` (`[b.rows, vocab]`).
pub fn head_rows_into(
    b: &mut StepBuffers,
    norm: &Tensor,
    eps: f32,
    lm_head: &QLinear,
    logits: &mut [f32],
) -> Result<()> {
    norm_rows_into(&b.x, norm, eps, &mut b.normed)?;
    let (head, out) = (&[lm_head], &mut [logits]);
    QLinear::forward_rows_into(head, &b.normed, b.rows, out, &mut b.linear)?;
    Ok(())
}

/// Whether every sequence of `batch` runs one new token, with no image rows or drafter state:
/// a pass the batched decode step can take.
pub fn decodes_only(batch: &mut [BatchSeq]) -> bool {
    (batch.iter_mut()).all(|s| s.tokens.len() == 1 && s.media.is_none() && s.cache.mtp().is_none())
}

/// Each sequence's position in a batched decode step (what its cache holds), checked against
/// a context of `max_positions`.
pub fn batch_positions(batch: &[BatchSeq], max_positions: usize) -> Result<Vec<usize>> {
    let positions = batch.iter().map(|s| s.cache.len());
    (positions.map(|pos| super::check_room(1, pos, max_positions).map(|()| pos))).collect()
}

/// A layer's part of a batched decode step for each sequence: its cache slot `slot` and the
/// rotary position `positions` gives it.
pub fn step_rows<'a>(
    batch: &'a mut [BatchSeq],
    positions: &[usize],
    slot: usize,
) -> Vec<StepRow<'a>> {
    (batch.iter_mut().zip(positions))
        .map(|(s, &pos)| StepRow {
            cache: s.cache.layer(slot),
            pos,
        })
        .collect()
}
