//! Building blocks shared by the architectures.

pub mod attention;
pub mod batch;
pub mod decoder;
pub mod delta_net;
pub mod delta_rule;
pub mod mamba;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod ssd;
pub mod ssm;
pub mod step;

use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, Embedding, QLinear, RotaryEmbedding, Tensor};

use crate::weights::Weights;
use crate::{Logits, ModelConfig, Result};

/// The RMSNorm weight `name` `[dim]`, with the config's `norm_weight_offset` folded in
/// (Gemma's `1 + w` becomes a plain `w` here, so every norm runs the same `rms_norm`).
pub fn norm_weight(c: &ModelConfig, w: &Weights, name: &str, dim: usize) -> Result<Tensor> {
    let t = w.tensor(name, &[dim])?;
    if c.norm_weight_offset == 0.0 {
        return Ok(t);
    }
    Ok((t + c.norm_weight_offset)?)
}

/// The output head of a decoder: the last position (or all of them), the final RMSNorm and
/// `lm_head`, as f32 `[m, vocab]`. `x` is `[1, n, hidden]`.
pub fn output_logits(
    x: &Tensor,
    want: Logits,
    norm: &Tensor,
    eps: f32,
    lm_head: &QLinear,
) -> Result<Tensor> {
    let x = match want {
        Logits::Last => x.narrow(1, x.dim(1)? - 1, 1)?,
        Logits::All => x.clone(),
    };
    let logits = lm_head.forward(&rms_norm(&x, norm, eps)?)?; // [1, m, vocab]
    Ok(logits.squeeze(0)?.to_dtype(DType::F32)?)
}

/// `x + rms_norm(y) · w`: a block's output joining the residual through its post-norm
/// (Gemma's "sandwich" norms).
pub fn add_normed(x: &Tensor, y: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    Ok((x + rms_norm(y, w, eps)?)?)
}

/// `logits` soft-capped at `cap` (`cap · tanh(l / cap)`, Gemma's `final_logit_softcapping`).
pub fn softcapped(logits: Tensor, cap: Option<f64>) -> Result<Tensor> {
    match cap {
        Some(cap) => Ok(peregrine_tensor::attention::softcap(&logits, cap as f32)?),
        None => Ok(logits),
    }
}

/// The output head: `lm_head`, or the embedding table when the config ties them and the
/// checkpoint has no `lm_head.weight`.
pub fn lm_head(c: &ModelConfig, w: &Weights, embed: &Embedding) -> Result<QLinear> {
    match c.tie_word_embeddings && !w.contains("lm_head.weight") {
        true => Ok(embed.as_linear()?),
        false => w.linear("lm_head", c.vocab_size, c.hidden_size, false),
    }
}

/// A tensor's values as f32 (the recurrent mixers read their small tensors and projections so).
pub(crate) fn f32_values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// One position through a causal depthwise conv (`weights` `[channels, k]`, optional `bias`)
/// and SiLU into `out`; `window` holds each channel's `k - 1` earlier inputs and takes `input`.
pub(crate) fn causal_conv_silu(
    window: &mut [f32],
    weights: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    input: &[f32],
    out: &mut [f32],
) {
    for (ch, o) in out.iter_mut().enumerate() {
        let w = &weights[ch * k..][..k];
        let past = &mut window[ch * (k - 1)..][..k - 1];
        let mut acc = w[k - 1] * input[ch];
        if let Some(b) = bias {
            acc += b[ch];
        }
        for (j, p) in past.iter().enumerate() {
            acc += w[j] * p;
        }
        past.rotate_left(1);
        past[k - 2] = input[ch];
        *o = peregrine_tensor::ops::silu(acc);
    }
}

/// The RoPE table for heads of `(width, rotated dimensions)` over `max_context` positions,
/// from the config's theta, scaling and style, in the activations' dtype (candle's GPU RoPE
/// kernel takes tables of its input's dtype; on the CPU both are f32).
pub fn rope_table(
    c: &ModelConfig,
    w: &Weights,
    dims: (usize, usize),
    max_context: usize,
) -> Result<RotaryEmbedding> {
    let rope = RotaryEmbedding::new_partial(
        dims,
        c.rope_theta,
        &c.rope_scaling,
        c.rope_style,
        max_context,
        w.dtype(),
        w.device(),
    )?;
    Ok(match c.mrope_sections {
        Some(sections) if c.mrope_interleaved => rope.with_interleaved_sections(sections)?,
        Some(sections) => rope.with_sections(sections)?,
        None => rope,
    })
}

/// Fails unless `n` tokens (at least one) fit at position `start` of a context of `max`.
pub fn check_room(n: usize, start: usize, max: usize) -> Result<()> {
    if n == 0 || start + n > max {
        return Err(crate::ModelError::Tensor(
            peregrine_tensor::candle::Error::Msg(format!(
                "cannot run {n} tokens at position {start}: the context holds {max} positions"
            )),
        ));
    }
    Ok(())
}

/// Bytes of a decoder's weights: `norms_per_layer` hidden-size norms per layer and the final
/// one (in `dtype`), `layer_bytes` of attention and MLP, the embeddings, and `lm_head` unless
/// it is the tied embedding table.
pub fn decoder_weight_bytes(
    c: &ModelConfig,
    dtype: DType,
    norms_per_layer: usize,
    layer_bytes: usize,
    embed: &Embedding,
    lm_head: &QLinear,
) -> usize {
    let norms = (norms_per_layer * c.num_hidden_layers + 1) * c.hidden_size * dtype.size_in_bytes();
    let head = if c.tie_word_embeddings {
        0
    } else {
        lm_head.weight_bytes()
    };
    norms + layer_bytes + embed.weight_bytes() + head
}
