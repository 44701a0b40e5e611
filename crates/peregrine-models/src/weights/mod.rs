//! Checkpoint formats mapped onto HF tensor names: architecture code asks for
//! `model.layers.0.self_attn.q_proj` and never learns which format it came from.

mod gguf;
pub(crate) mod gguf_config;
pub mod mlx;
mod safetensors;

pub use gguf::{GgufFile, gguf_name};
pub use gguf_config::config_from_gguf;
pub(crate) use gguf_config::{GgufMeta, partial_rotary_factor};
pub use mlx::{MlxActivations, MlxQuantization};
pub use safetensors::SafetensorsFiles;

use std::path::Path;

use peregrine_tensor::{DType, Device, Embedding, GgufMatrix, MlxQuantized, QLinear, Tensor};

use crate::{ModelError, Result};

/// `(first row, rows)` of consecutive parts of `parts[i]` rows each (a fused matrix's split).
fn row_ranges(parts: &[usize]) -> Vec<(usize, usize)> {
    let mut at = 0;
    (parts.iter())
        .map(|&n| {
            at += n;
            (at - n, n)
        })
        .collect()
}

/// Where the tensors come from.
pub enum Source {
    /// One or more safetensors files (sharded checkpoints).
    Safetensors(SafetensorsFiles),
    /// A GGUF file.
    Gguf(GgufFile),
}

/// A checkpoint's tensors, looked up by HF name and placed on one device.
pub struct Weights {
    source: Source,
    device: Device,
    dtype: DType,
    /// MLX quantization settings from config.json, when the checkpoint has them.
    mlx: Option<MlxQuantization>,
    mlx_activations: MlxActivations,
}

impl Weights {
    /// Wraps a source; dense tensors are converted to `dtype` on `device`.
    pub fn new(source: Source, device: Device, dtype: DType) -> Self {
        Self {
            source,
            device,
            dtype,
            mlx: None,
            mlx_activations: MlxActivations::default(),
        }
    }

    /// Adds an MLX checkpoint's quantization settings (bits, group size, per-module overrides).
    pub fn with_mlx(mut self, mlx: Option<MlxQuantization>, activations: MlxActivations) -> Self {
        self.mlx = mlx;
        self.mlx_activations = activations;
        self
    }

    /// `{prefix}.weight` as MLX affine-quantized, when `{prefix}.scales` exists beside it:
    /// regrouped into blocks for the integer kernels (`Ok`) when they are asked for and every
    /// value survives (4 and 8 bits), else as stored (`Err`).
    fn mlx_matrix(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<Option<std::result::Result<GgufMatrix, MlxQuantized>>> {
        match &self.source {
            Source::Safetensors(s) => {
                let regroup = self.mlx_activations == MlxActivations::Q8;
                let quant = self.mlx.as_ref();
                mlx::load_quantized(s, quant, prefix, (out, inp), &self.device, regroup)
            }
            Source::Gguf(_) => Ok(None),
        }
    }

    /// The checkpoint's path, for error messages.
    pub fn path(&self) -> &Path {
        match &self.source {
            Source::Safetensors(s) => s.path(),
            Source::Gguf(g) => g.path(),
        }
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device tensors are placed on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the checkpoint holds `name` (HF naming).
    pub fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Safetensors(s) => s.contains(name),
            Source::Gguf(g) => g.contains(name),
        }
    }

    /// The stored shape of `name` (HF naming), without loading it.
    pub fn dims(&self, name: &str) -> Result<Vec<usize>> {
        match &self.source {
            Source::Safetensors(s) => Ok(s.dims(name)?.to_vec()),
            Source::Gguf(g) => g.dims(name),
        }
    }

    fn check_shape(&self, name: &str, got: &[usize], expected: &[usize]) -> Result<()> {
        if got == expected {
            return Ok(());
        }
        Err(ModelError::Shape {
            file: self.path().to_path_buf(),
            tensor: name.to_string(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        })
    }

    /// A dense tensor of the given shape in the compute dtype.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = match &self.source {
            Source::Safetensors(s) => s.load(name, &self.device)?,
            Source::Gguf(g) => g.qtensor(name, &self.device)?.dequantize(&self.device)?,
        };
        self.check_shape(name, t.dims(), shape)?;
        Ok(t.to_dtype(self.dtype)?)
    }

    /// The linear layer `{prefix}.weight` `[out, in]` (and `{prefix}.bias` `[out]` when `bias`).
    pub fn linear(
        &self,
        prefix: &str,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<QLinear> {
        let w_name = format!("{prefix}.weight");
        let b = match bias {
            true => Some(self.tensor(&format!("{prefix}.bias"), &[out_dim])?),
            false => None,
        };
        if let Some(w) = self.mlx_matrix(prefix, out_dim, in_dim)? {
            return match w {
                Ok(w) => Ok(QLinear::Gguf { w, b }),
                Err(w) => Ok(QLinear::MlxAffine { w, b }),
            };
        }
        match &self.source {
            Source::Safetensors(_) => Ok(QLinear::Dense {
                w: self.tensor(&w_name, &[out_dim, in_dim])?,
                b,
            }),
            Source::Gguf(g) => {
                self.check_shape(&w_name, &g.dims(&w_name)?, &[out_dim, in_dim])?;
                let w = g.matrix(&w_name, &self.device)?;
                Ok(QLinear::Gguf { w, b })
            }
        }
    }

    /// The fused linear layer `{prefix}.weight` `[sum(parts), in]` (and `{prefix}.bias` when
    /// `bias`) split by output rows into consecutive layers of `parts[i]` rows: checkpoint
    /// surgery for Phi-3's `qkv_proj` (q, k, v) and `gate_up_proj` (gate, up), so that the shared
    /// layers take them as separate projections. Every format splits without dequantizing: a
    /// dense matrix by rows, MLX codes with their rows of scales and biases, a GGUF matrix by the
    /// byte ranges of its rows.
    pub fn linear_rows(
        &self,
        prefix: &str,
        parts: &[usize],
        in_dim: usize,
        bias: bool,
    ) -> Result<Vec<QLinear>> {
        let out_dim: usize = parts.iter().sum();
        let w_name = format!("{prefix}.weight");
        let b = match bias {
            true => Some(self.tensor(&format!("{prefix}.bias"), &[out_dim])?),
            false => None,
        };
        let ranges = row_ranges(parts);
        let bias_of = |(at, n): (usize, usize)| -> Result<Option<Tensor>> {
            match &b {
                Some(b) => Ok(Some(b.narrow(0, at, n)?.contiguous()?)),
                None => Ok(None),
            }
        };
        let mats: Vec<std::result::Result<GgufMatrix, MlxQuantized>> = match &self.source {
            Source::Safetensors(s) => {
                let regroup = self.mlx_activations == MlxActivations::Q8;
                let quant = self.mlx.as_ref();
                match mlx::load_quantized_rows(
                    s,
                    quant,
                    prefix,
                    parts,
                    in_dim,
                    &self.device,
                    regroup,
                )? {
                    Some(mats) => mats,
                    None => {
                        let all = self.tensor(&w_name, &[out_dim, in_dim])?;
                        return (ranges.iter())
                            .map(|&r| {
                                let w = all.narrow(0, r.0, r.1)?.contiguous()?;
                                Ok(QLinear::Dense { w, b: bias_of(r)? })
                            })
                            .collect();
                    }
                }
            }
            Source::Gguf(g) => {
                self.check_shape(&w_name, &g.dims(&w_name)?, &[out_dim, in_dim])?;
                let mats = g.row_matrices(&w_name, parts, &self.device)?;
                mats.into_iter().map(Ok).collect()
            }
        };
        (mats.into_iter().zip(ranges))
            .map(|(w, r)| {
                let b = bias_of(r)?;
                Ok(match w {
                    Ok(w) => QLinear::Gguf { w, b },
                    Err(w) => QLinear::MlxAffine { w, b },
                })
            })
            .collect()
    }

    /// One projection of an MoE layer's `n` experts, each `[out, in]`: per-expert tensors
    /// `each(e)` (HF checkpoints), else the stack `stacked` `[n, out, in]` (MLX `switch_mlp`,
    /// GGUF `ffn_*_exps`, or a dense stack), split per expert at load.
    pub fn expert_linears(
        &self,
        stacked: &str,
        each: &dyn Fn(usize) -> String,
        n: usize,
        out: usize,
        inp: usize,
    ) -> Result<Vec<QLinear>> {
        if self.contains(&format!("{}.weight", each(0))) {
            return (0..n)
                .map(|e| self.linear(&each(e), out, inp, false))
                .collect();
        }
        let name = format!("{stacked}.weight");
        match &self.source {
            Source::Safetensors(s) => {
                let regroup = self.mlx_activations == MlxActivations::Q8;
                let quant = self.mlx.as_ref();
                let dims = (out, inp);
                match mlx::load_quantized_stacked(
                    s,
                    quant,
                    stacked,
                    n,
                    dims,
                    &self.device,
                    regroup,
                )? {
                    Some(ws) => Ok(ws
                        .into_iter()
                        .map(|w| match w {
                            Ok(w) => QLinear::Gguf { w, b: None },
                            Err(w) => QLinear::MlxAffine { w, b: None },
                        })
                        .collect()),
                    None => {
                        let all = self.tensor(&name, &[n, out, inp])?;
                        (0..n)
                            .map(|e| {
                                let w = all.narrow(0, e, 1)?.squeeze(0)?.contiguous()?;
                                Ok(QLinear::Dense { w, b: None })
                            })
                            .collect()
                    }
                }
            }
            Source::Gguf(g) => {
                self.check_shape(&name, &g.dims(&name)?, &[n, out, inp])?;
                let mats = g.expert_matrices(&name, n, &self.device)?;
                Ok(mats
                    .into_iter()
                    .map(|w| QLinear::Gguf { w, b: None })
                    .collect())
            }
        }
    }

    /// The stacked experts `name` `[n, sum(parts), in]` (an exact tensor name: HF's fused
    /// `experts.gate_up_proj` has no `.weight`), each expert's rows split into `parts.len()`
    /// layers of `parts[i]` rows: `result[e][p]`. A GGUF stack is split by the byte ranges of
    /// its rows, so it stays quantized.
    pub fn expert_linear_rows(
        &self,
        name: &str,
        n: usize,
        parts: &[usize],
        inp: usize,
    ) -> Result<Vec<Vec<QLinear>>> {
        let total = parts.iter().sum();
        let layers: Vec<QLinear> = match &self.source {
            Source::Gguf(g) => {
                self.check_shape(name, &g.dims(name)?, &[n, total, inp])?;
                let mats = g.expert_row_matrices(name, n, parts, &self.device)?;
                mats.into_iter()
                    .map(|w| QLinear::Gguf { w, b: None })
                    .collect()
            }
            Source::Safetensors(_) => {
                let all = self.tensor(name, &[n, total, inp])?;
                let ranges = row_ranges(parts);
                let mut layers = Vec::with_capacity(n * parts.len());
                for e in 0..n {
                    let expert = all.narrow(0, e, 1)?.squeeze(0)?;
                    for &(at, rows) in &ranges {
                        let w = expert.narrow(0, at, rows)?.contiguous()?;
                        layers.push(QLinear::Dense { w, b: None });
                    }
                }
                layers
            }
        };
        let mut layers = layers.into_iter();
        Ok((0..n)
            .map(|_| layers.by_ref().take(parts.len()).collect())
            .collect())
    }

    /// The embedding table `name` `[vocab, hidden]`, kept quantized when the file is.
    pub fn embedding(&self, name: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        if let Some(prefix) = name.strip_suffix(".weight")
            && let Some(q) = self.mlx_matrix(prefix, vocab, hidden)?
        {
            return Ok(match q {
                Ok(blocks) => Embedding::Gguf(blocks),
                Err(q) => Embedding::MlxAffine(q),
            });
        }
        match &self.source {
            Source::Safetensors(_) => Ok(Embedding::Dense(self.tensor(name, &[vocab, hidden])?)),
            Source::Gguf(g) => {
                self.check_shape(name, &g.dims(name)?, &[vocab, hidden])?;
                Ok(Embedding::Gguf(g.matrix(name, &self.device)?))
            }
        }
    }
}

impl Weights {
    /// The checkpoint files.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Gives back the source (e.g. to keep a GGUF file's metadata after loading).
    pub fn into_source(self) -> Source {
        self.source
    }
}
