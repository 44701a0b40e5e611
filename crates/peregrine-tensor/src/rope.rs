//! Rotary position embeddings: one table type, scaling schemes as an enum (no per-model RoPE).

use candle_core::{DType, Device, Result, Tensor};

/// How the rotation frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum RopeScaling {
    /// Plain RoPE.
    #[default]
    None,
    /// Positions divided by `factor` (linear interpolation).
    Linear {
        /// Interpolation factor.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Scale applied to low frequencies.
        factor: f64,
        /// Wavelength threshold (relative) below which frequencies are scaled.
        low_freq_factor: f64,
        /// Wavelength threshold (relative) above which frequencies are kept.
        high_freq_factor: f64,
        /// The context length the model was trained at.
        original_max_position_embeddings: usize,
    },
}

/// Which dimensions are rotated together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RopeStyle {
    /// Pairs `(i, i + d/2)`: HF's `rotate_half` (GPT-NeoX style).
    #[default]
    Half,
    /// Adjacent pairs `(2i, 2i+1)`: GPT-J style, what llama.cpp's permuted llama weights expect.
    Interleaved,
}

/// Precomputed cos/sin tables for positions `0..max_positions`.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

/// Inverse frequencies `theta^(-2i/d)` after scaling, one per rotated pair.
pub fn inv_freqs(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64))
        .collect();
    match *scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: orig,
        } => {
            let low_wavelen = orig as f64 / low_freq_factor;
            let high_wavelen = orig as f64 / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (orig as f64 / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

impl RotaryEmbedding {
    /// Builds tables for `max_positions` positions of a `head_dim`-wide head.
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        style: RopeStyle,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let freqs = inv_freqs(head_dim, theta, scaling);
        let half = freqs.len();
        let mut angles = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            angles.extend(freqs.iter().map(|f| (p as f64 * f) as f32));
        }
        let angles = Tensor::from_vec(angles, (max_positions, half), device)?;
        Ok(Self {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
            style,
        })
    }

    /// Number of positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    fn tables(&self, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        if start + len > self.max_positions() {
            candle_core::bail!(
                "position {} is past the rotary table ({} positions)",
                start + len - 1,
                self.max_positions()
            )
        }
        Ok((
            self.cos.narrow(0, start, len)?,
            self.sin.narrow(0, start, len)?,
        ))
    }

    /// Rotates `x: [batch, heads, seq, head_dim]` whose first token sits at position `start`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (cos, sin) = self.tables(start, x.dim(2)?)?;
        let x = x.contiguous()?;
        match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(&x, &cos, &sin),
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, &cos, &sin),
        }
    }

    /// Reference rotation from plain candle ops.
    pub fn apply_ref(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (cos, sin) = self.tables(start, x.dim(2)?)?;
        match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope_slow(x, &cos, &sin),
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i_slow(x, &cos, &sin),
        }
    }
}
