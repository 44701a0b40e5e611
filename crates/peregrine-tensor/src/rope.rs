//! Rotary position embeddings: one table type, scaling schemes as an enum (no per-model RoPE).

use std::sync::{Arc, RwLock};

use candle_core::{DType, Device, Result, Tensor};

mod rows;

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
    /// Phi-3's LongRoPE: every rotated pair's frequency divided by a per-pair factor, from
    /// `short_factor` or `long_factor`, and cos/sin multiplied by `attention_factor`.
    ///
    /// Which set a rotation uses is transformers' rule (`dynamic_rope_update`, which picks by
    /// `seq_len = max(position_ids) + 1` at every forward): a call that rotates positions
    /// `start..end` (a forward pass over the tokens ending at `end - 1`, or the decode step at
    /// `end - 1`) uses the long factors for all of them when `end >
    /// original_max_position_embeddings`, else the short ones. Keys already in a KV cache keep
    /// the factors they were rotated with (transformers' `generate` instead recomputes the whole
    /// sequence when it first grows past `original_max_position_embeddings`).
    LongRope {
        /// Per-pair divisors while the sequence fits the original context (`rotary_dim / 2`).
        short_factor: Vec<f64>,
        /// Per-pair divisors once it is longer (`rotary_dim / 2`).
        long_factor: Vec<f64>,
        /// The context length the short factors were trained at.
        original_max_position_embeddings: usize,
        /// Scale of cos and sin (both regimes).
        attention_factor: f64,
    },
    /// YaRN (DeepSeek-V3, Qwen long context), as transformers' `_compute_yarn_parameters`:
    /// each pair's frequency blends its interpolated (`/ factor`) and original value by a linear
    /// ramp over the pairs between the correction dimensions of `beta_fast` and `beta_slow`
    /// rotations in `original_max_position_embeddings`; cos/sin times `attention_factor`.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// The context length the model was trained at.
        original_max_position_embeddings: usize,
        /// Rotations marking the extrapolated (high-frequency) end of the ramp.
        beta_fast: f64,
        /// Rotations marking the interpolated (low-frequency) end of the ramp.
        beta_slow: f64,
        /// Scale of cos and sin.
        attention_factor: f64,
        /// Round the correction range outward to whole dimensions (transformers' default).
        truncate: bool,
    },
    /// Every rotated pair's frequency divided by its own factor: how llama.cpp's files carry
    /// Llama 3.1's scaling (the `rope_freqs` tensor, `rotary_dim / 2` values; the converter
    /// computes them from the `llama3` parameters, so [`inv_freqs`] gives what `Llama3` gives,
    /// up to the factors' f32 rounding).
    Factors(Vec<f64>),
    /// Gemma 4's `proportional` RoPE (its global layers): the whole head is the rotary width,
    /// but only the first `floor(partial_rotary_factor · head_dim / 2)` pairs turn, at
    /// `theta^(-2i/head_dim) / factor`; the other pairs get frequency 0 and pass through.
    /// Unlike `partial_rotary_factor` elsewhere, the frequencies span the whole head and the
    /// rotated dimensions are the first of each half (`i` and `i + head_dim/2`).
    Proportional {
        /// Divides every frequency.
        factor: f64,
        /// Fraction of each head whose pairs rotate.
        partial_rotary_factor: f64,
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
/// The first `rotary_dim` dimensions of each `head_dim`-wide head rotate (all of them unless
/// built with [`new_partial`](Self::new_partial)); the rest pass through unchanged.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    /// The frequencies and tables every rotation uses (LongRoPE: the short factors').
    main: Table,
    /// LongRoPE: the long factors' table and the length past which it is used.
    long: Option<(usize, Table)>,
    /// cos/sin multiplier (LongRoPE's attention factor; 1 otherwise).
    scale: f64,
    head_dim: usize,
    rotary_dim: usize,
    max_positions: usize,
    dtype: DType,
    device: Device,
    style: RopeStyle,
    /// Multimodal RoPE: the rotated pairs each position axis (time, height, width) turns, in
    /// order ([`with_sections`](Self::with_sections)).
    sections: Option<[usize; 3]>,
    /// Qwen3-VL's M-RoPE layout: the axes take turns pair by pair instead of in runs
    /// ([`with_interleaved_sections`](Self::with_interleaved_sections)).
    interleaved: bool,
}

/// One set of frequencies and its tables.
#[derive(Debug, Clone)]
struct Table {
    freqs: Arc<[f64]>,
    /// `(cos, sin)`, `[computed positions, rotary_dim / 2]`; shared by clones.
    tables: Arc<RwLock<(Tensor, Tensor)>>,
}

/// Positions computed up front; tables grow by doubling from here.
const FIRST_POSITIONS: usize = 1024;

/// Inverse frequencies `theta^(-2i/d)` after scaling, one per rotated pair of a `rotary_dim`
/// (`d`) wide rotation (LongRoPE: the short factors').
pub fn inv_freqs(rotary_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f64> {
    let base: Vec<f64> = (0..rotary_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / rotary_dim as f64))
        .collect();
    match *scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::Proportional {
            factor,
            partial_rotary_factor,
        } => {
            // transformers: `int(partial_rotary_factor * head_dim // 2)` rotated pairs.
            let rotated = (partial_rotary_factor * rotary_dim as f64 / 2.0).floor() as usize;
            (base.iter().enumerate())
                .map(|(i, f)| if i < rotated { f / factor } else { 0.0 })
                .collect()
        }
        RopeScaling::LongRope {
            ref short_factor, ..
        } => divided(&base, short_factor),
        RopeScaling::Factors(ref factors) => divided(&base, factors),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            let (d, ln_theta) = (rotary_dim as f64, theta.ln());
            let corr = |rot: f64| {
                d * (orig as f64 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * ln_theta)
            };
            let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
            if low == high {
                high += 0.001;
            }
            // transformers computes the ramp and the blend in f32.
            base.iter()
                .enumerate()
                .map(|(i, &f)| {
                    let ramp =
                        ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp as f64;
                    (f / factor) * (1.0 - extrapolation) + f * extrapolation
                })
                .collect()
        }
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

/// `base[i] / factors[i]` (LongRoPE's per-pair divisors).
fn divided(base: &[f64], factors: &[f64]) -> Vec<f64> {
    base.iter().zip(factors).map(|(f, d)| f / d).collect()
}

impl Table {
    fn new(
        freqs: Vec<f64>,
        positions: usize,
        scale: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let freqs: Arc<[f64]> = freqs.into();
        let tables = compute_tables(&freqs, positions, scale, dtype, device)?;
        Ok(Self {
            freqs,
            tables: Arc::new(RwLock::new(tables)),
        })
    }
}

impl RotaryEmbedding {
    /// Tables for up to `max_positions` positions of a `head_dim`-wide head, all of it rotated.
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        style: RopeStyle,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let dims = (head_dim, head_dim);
        Self::new_partial(dims, theta, scaling, style, max_positions, dtype, device)
    }

    /// [`new`](Self::new) for heads of which only the first `rotary_dim` dimensions rotate
    /// (`(head_dim, rotary_dim)`; transformers' `partial_rotary_factor`): frequencies are
    /// `theta^(-2i/rotary_dim)` and the last `head_dim - rotary_dim` dimensions pass through.
    pub fn new_partial(
        (head_dim, rotary_dim): (usize, usize),
        theta: f64,
        scaling: &RopeScaling,
        style: RopeStyle,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if rotary_dim > head_dim || rotary_dim % 2 != 0 || rotary_dim == 0 {
            candle_core::bail!(
                "rope: rotary dimension {rotary_dim} must be even, positive and at most the head's {head_dim}"
            )
        }
        let first = max_positions.min(FIRST_POSITIONS);
        let (mut scale, mut long) = (1.0, None);
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } = scaling
        {
            for (name, f) in [("short", short_factor), ("long", long_factor)] {
                if f.len() != rotary_dim / 2 {
                    candle_core::bail!(
                        "rope: {} {name} factors for a rotary dimension of {rotary_dim} (expected {})",
                        f.len(),
                        rotary_dim / 2
                    )
                }
            }
            scale = *attention_factor;
            let freqs = divided(
                &inv_freqs(rotary_dim, theta, &RopeScaling::None),
                long_factor,
            );
            let table = Table::new(freqs, first, scale, dtype, device)?;
            long = Some((*original_max_position_embeddings, table));
        }
        if let RopeScaling::Yarn {
            attention_factor, ..
        } = scaling
        {
            scale = *attention_factor;
        }
        let freqs = inv_freqs(rotary_dim, theta, scaling);
        Ok(Self {
            main: Table::new(freqs, first, scale, dtype, device)?,
            long,
            scale,
            head_dim,
            rotary_dim,
            max_positions,
            dtype,
            device: device.clone(),
            style,
            sections: None,
            interleaved: false,
        })
    }

    /// This table as Qwen2-VL's multimodal RoPE (M-RoPE): the first `sections[0]` rotated pairs
    /// turn by a token's time position, the next `sections[1]` by its height position and the
    /// last `sections[2]` by its width position ([`apply_positions`](Self::apply_positions)). A
    /// token whose three positions agree turns exactly as plain RoPE turns it.
    pub fn with_sections(mut self, sections: [usize; 3]) -> Result<Self> {
        if sections.iter().sum::<usize>() != self.rotary_dim / 2 {
            candle_core::bail!(
                "rope: M-RoPE sections {sections:?} do not add up to the {} rotated pairs",
                self.rotary_dim / 2
            )
        }
        self.sections = Some(sections);
        self.interleaved = false;
        Ok(self)
    }

    /// Qwen3-VL's interleaved M-RoPE (`mrope_interleaved`): pair `j` turns by the height
    /// position when `j % 3 == 1` and `j < 3 · sections[1]`, by the width position when
    /// `j % 3 == 2` and `j < 3 · sections[2]`, and by the time position otherwise
    /// (transformers' `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`). The sections need
    /// not add up to the rotated pairs: as there, a pair past them turns by time (llama.cpp's
    /// converter writes Qwen3.5's `[11, 11, 10]` whatever the rotated width).
    pub fn with_interleaved_sections(mut self, sections: [usize; 3]) -> Result<Self> {
        self.sections = Some(sections);
        self.interleaved = true;
        Ok(self)
    }

    /// The position axis (0 time, 1 height, 2 width) each rotated pair turns by.
    fn pair_axes(&self, sections: [usize; 3]) -> Vec<u32> {
        let half = self.rotary_dim / 2;
        (0..half)
            .map(|j| match self.interleaved {
                true if j % 3 == 1 && j < 3 * sections[1] => 1,
                true if j % 3 == 2 && j < 3 * sections[2] => 2,
                true => 0,
                false if j < sections[0] => 0,
                false if j < sections[0] + sections[1] => 1,
                false => 2,
            })
            .collect()
    }

    /// The M-RoPE sections, when this table has them.
    pub fn sections(&self) -> Option<[usize; 3]> {
        self.sections
    }

    /// Number of positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The table a rotation of positions up to `end - 1` uses (see [`RopeScaling::LongRope`]).
    fn table(&self, end: usize) -> &Table {
        match &self.long {
            Some((original, long)) if end > *original => long,
            _ => &self.main,
        }
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
        let table = self.table(end);
        let narrow = |(cos, sin): &(Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((cos.narrow(0, start, len)?, sin.narrow(0, start, len)?))
        };
        {
            let tables = table.tables.read().unwrap_or_else(|e| e.into_inner());
            if tables.0.dims()[0] >= end {
                return narrow(&tables);
            }
        }
        let mut tables = table.tables.write().unwrap_or_else(|e| e.into_inner());
        let have = tables.0.dims()[0];
        if have < end {
            let grown = end.max(2 * have).min(self.max_positions);
            *tables = compute_tables(&table.freqs, grown, self.scale, self.dtype, &self.device)?;
        }
        narrow(&tables)
    }

    /// `x: [batch, heads, seq, head_dim]` split into its rotated and passed-through dimensions
    /// (the second `None` when every dimension rotates).
    fn split(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let d = x.dim(3)?;
        if d != self.head_dim {
            candle_core::bail!("rope: heads of {d} dimensions, expected {}", self.head_dim)
        }
        if self.rotary_dim == d {
            return Ok((x.clone(), None));
        }
        let pass = x.narrow(3, self.rotary_dim, d - self.rotary_dim)?;
        Ok((x.narrow(3, 0, self.rotary_dim)?, Some(pass)))
    }

    /// The rotated part joined back with the passed-through one.
    fn join(rotated: Tensor, pass: Option<Tensor>) -> Result<Tensor> {
        match pass {
            None => Ok(rotated),
            Some(pass) => Tensor::cat(&[rotated, pass], 3),
        }
    }

    /// Rotates `x: [batch, heads, seq, head_dim]` whose first token sits at position `start`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (cos, sin) = self.tables(start, x.dim(2)?)?;
        self.rotate(x, &cos, &sin)
    }

    /// Rotates each of `xs: [batch, heads, rows, head_dim]`, whose row `j` sits at
    /// `positions[j]`, each row exactly as [`apply`](Self::apply) turns a lone token there (a
    /// batched decode step's queries and keys, one row per sequence, the tables gathered once);
    /// `None` when the rows need different tables (LongRoPE past its original context for some
    /// of them only).
    pub fn apply_at(&self, xs: &[&Tensor], positions: &[u32]) -> Result<Option<Vec<Tensor>>> {
        let (Some(&lo), Some(&hi)) = (positions.iter().min(), positions.iter().max()) else {
            return Ok(Some(xs.iter().map(|&x| x.clone()).collect()));
        };
        if !std::ptr::eq(self.table(lo as usize + 1), self.table(hi as usize + 1)) {
            return Ok(None);
        }
        let (cos, sin) = self.tables(0, hi as usize + 1)?;
        let rows = Tensor::new(positions, cos.device())?;
        let (cos, sin) = (cos.index_select(&rows, 0)?, sin.index_select(&rows, 0)?);
        let turned = xs.iter().map(|x| self.rotate(x, &cos, &sin));
        Ok(Some(turned.collect::<Result<_>>()?))
    }

    /// `x` rotated by per-row `cos` / `sin` (`[seq, rotary_dim / 2]`).
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (x, pass) = self.split(x)?;
        let x = x.contiguous()?;
        let rotated = match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(&x, cos, sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
        };
        Self::join(rotated, pass)
    }

    /// Rotates `x: [batch, heads, seq, head_dim]` by M-RoPE: row `j` is at position
    /// `positions[a][j]` on axis `a` (time, height, width), each axis turning its section of the
    /// rotated pairs ([`with_sections`](Self::with_sections)).
    pub fn apply_positions(&self, x: &Tensor, positions: &[Vec<u32>; 3]) -> Result<Tensor> {
        let Some(sections) = self.sections else {
            candle_core::bail!("rope: per-axis positions need M-RoPE sections")
        };
        let n = x.dim(2)?;
        if positions.iter().any(|p| p.len() != n) {
            candle_core::bail!("rope: per-axis positions for {n} rows have other lengths")
        }
        let end = positions
            .iter()
            .flatten()
            .max()
            .map_or(0, |&p| p as usize + 1);
        let (cos, sin) = self.tables(0, end)?;
        // Each axis's rows of the tables side by side, then each pair's column from its axis.
        let half = self.rotary_dim / 2;
        let columns: Vec<u32> = (self.pair_axes(sections).iter().enumerate())
            .map(|(j, &axis)| axis * half as u32 + j as u32)
            .collect();
        let columns = Tensor::new(columns.as_slice(), cos.device())?;
        let pick = |table: &Tensor| -> Result<Tensor> {
            let per_axis = (positions.iter())
                .map(|axis| table.index_select(&Tensor::new(axis.as_slice(), table.device())?, 0))
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&per_axis, 1)?.index_select(&columns, 1)
        };
        let (cos, sin) = (pick(&cos)?, pick(&sin)?);
        self.rotate(x, &cos, &sin)
    }

    /// [`apply`](Self::apply) for one token, in place: each `head_dim`-wide row of `x` (one per
    /// head) rotated for position `pos`, without allocating (the decode step's form).
    pub fn apply_rows_in_place(&self, x: &mut [f32], pos: usize) -> Result<()> {
        {
            let table = self.table(pos + 1);
            let tables = table.tables.read().unwrap_or_else(|e| e.into_inner());
            if tables.0.dims()[0] > pos {
                return rotate_rows(&tables, x, pos, self.head_dim, self.style);
            }
        }
        self.tables(pos, 1)?; // grows the tables (doubling), then rotates from them
        self.apply_rows_in_place(x, pos)
    }

    /// Reference rotation from plain candle ops.
    pub fn apply_ref(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (cos, sin) = self.tables(start, x.dim(2)?)?;
        let (x, pass) = self.split(x)?;
        let rotated = match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope_slow(&x, &cos, &sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i_slow(&x, &cos, &sin)?,
        };
        Self::join(rotated, pass)
    }
}

/// Rotates the first `2 · half` dimensions of each `head_dim`-wide row of `x` by the angles of
/// table row `pos`.
fn rotate_rows(
    tables: &(Tensor, Tensor),
    x: &mut [f32],
    pos: usize,
    head_dim: usize,
    style: RopeStyle,
) -> Result<()> {
    let half = tables.0.dims()[1];
    let mut rotate = |cos: &[f32], sin: &[f32]| {
        let (cos, sin) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
        for row in x.chunks_exact_mut(head_dim) {
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

/// `(scale · cos, scale · sin)` of `p · freq` for positions `0..positions`, `[positions, freqs]`.
fn compute_tables(
    freqs: &[f64],
    positions: usize,
    scale: f64,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut angles = Vec::with_capacity(positions * freqs.len());
    for p in 0..positions {
        angles.extend(freqs.iter().map(|f| (p as f64 * f) as f32));
    }
    let angles = Tensor::from_vec(angles, (positions, freqs.len()), device)?;
    let scaled = |t: Tensor| {
        if scale == 1.0 {
            Ok(t)
        } else {
            t.affine(scale, 0.0)
        }
    };
    Ok((
        scaled(angles.cos()?)?.to_dtype(dtype)?,
        scaled(angles.sin()?)?.to_dtype(dtype)?,
    ))
}
