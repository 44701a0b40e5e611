//! Rotary position embeddings: one table type, scaling schemes as an enum (no per-model RoPE).

use std::sync::{Arc, RwLock};

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

/// Cos/sin tables for positions `0..max_positions`, computed as positions are first used
/// (doubling), so a 32K-position context costs memory only for the positions it reaches.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    freqs: Arc<[f64]>,
    max_positions: usize,
    dtype: DType,
    device: Device,
    /// `(cos, sin)`, `[computed positions, head_dim / 2]`; shared by clones.
    tables: Arc<RwLock<(Tensor, Tensor)>>,
    style: RopeStyle,
}

/// Positions computed up front; tables grow by doubling from here.
const FIRST_POSITIONS: usize = 1024;

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
    /// Tables for up to `max_positions` positions of a `head_dim`-wide head.
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        style: RopeStyle,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let freqs: Arc<[f64]> = inv_freqs(head_dim, theta, scaling).into();
        let first = max_positions.min(FIRST_POSITIONS);
        let tables = compute_tables(&freqs, first, dtype, device)?;
        Ok(Self {
            freqs,
            max_positions,
            dtype,
            device: device.clone(),
            tables: Arc::new(RwLock::new(tables)),
            style,
        })
    }

    /// Number of positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn tables(&self, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let end = start + len;
        if end > self.max_positions {
            candle_core::bail!(
                "position {} is past the rotary table ({} positions)",
                end - 1,
                self.max_positions
            )
        }
        let narrow = |(cos, sin): &(Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((cos.narrow(0, start, len)?, sin.narrow(0, start, len)?))
        };
        {
            let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
            if tables.0.dims()[0] >= end {
                return narrow(&tables);
            }
        }
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        let have = tables.0.dims()[0];
        if have < end {
            let grown = end.max(2 * have).min(self.max_positions);
            *tables = compute_tables(&self.freqs, grown, self.dtype, &self.device)?;
        }
        narrow(&tables)
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

    /// [`apply`](Self::apply) for one token, in place: each `head_dim`-wide row of `x` (one per
    /// head) rotated for position `pos`, without allocating (the decode step's form).
    pub fn apply_rows_in_place(&self, x: &mut [f32], pos: usize) -> Result<()> {
        {
            let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
            if tables.0.dims()[0] > pos {
                return rotate_rows(&tables, x, pos, self.style);
            }
        }
        self.tables(pos, 1)?; // grows the tables (doubling), then rotates from them
        self.apply_rows_in_place(x, pos)
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

/// Rotates `x`'s rows by the angles of table row `pos`.
fn rotate_rows(
    tables: &(Tensor, Tensor),
    x: &mut [f32],
    pos: usize,
    style: RopeStyle,
) -> Result<()> {
    let half = tables.0.dims()[1];
    let mut rotate = |cos: &[f32], sin: &[f32]| {
        let (cos, sin) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
        for row in x.chunks_exact_mut(2 * half) {
            for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
                let (a, b) = match style {
                    RopeStyle::Half => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (xa, xb) = (row[a], row[b]);
                row[a] = xa * c - xb * s;
                row[b] = xa * s + xb * c;
            }
        }
    };
    let rotated = crate::ops::with_f32(&tables.0, |cos| {
        crate::ops::with_f32(&tables.1, |sin| rotate(cos, sin))
    })?;
    match rotated {
        Some(Ok(Some(()))) => Ok(()),
        Some(Err(e)) => Err(e),
        _ => candle_core::bail!("rope: in-place rotation needs f32 tables on the CPU"),
    }
}

/// `(cos, sin)` of `p · freq` for positions `0..positions`, `[positions, freqs]`.
fn compute_tables(
    freqs: &[f64],
    positions: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut angles = Vec::with_capacity(positions * freqs.len());
    for p in 0..positions {
        angles.extend(freqs.iter().map(|f| (p as f64 * f) as f32));
    }
    let angles = Tensor::from_vec(angles, (positions, freqs.len()), device)?;
    Ok((
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    ))
}
