//! Checkpoint formats mapped onto HF tensor names: architecture code asks for
//! `model.layers.0.self_attn.q_proj` and never learns which format it came from.

mod gguf;
mod gguf_clip;
pub(crate) mod gguf_config;
mod mapped;
#[cfg(target_os = "linux")]
mod sigbus;
#[cfg(not(target_os = "linux"))]
mod sigbus {
    //! Without a SIGBUS handler (other systems) nothing is guarded: a file cut short under a
    //! read of its mapping ends the process.
    #[derive(Debug)]
    pub(crate) struct Guard;
    impl Guard {
        pub(crate) fn new(_start: *const u8, _len: usize) -> Option<Self> {
            None
        }
        pub(crate) fn damaged(&self) -> Option<std::ops::Range<usize>> {
            None
        }
        pub(crate) fn repair(&self, _file: &std::fs::File) -> std::io::Result<()> {
            Ok(())
        }
    }
}
pub mod mlx;
mod safetensors;

pub use gguf::{GgufFile, gguf_name};
pub use gguf_config::config_from_gguf;
pub(crate) use gguf_config::{GgufMeta, partial_rotary_factor};
pub use mlx::{MlxActivations, MlxQuantization};
pub use safetensors::SafetensorsFiles;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use peregrine_moe::ReadPool;
use peregrine_tensor::{DType, Device, Embedding, GgufMatrix, MlxQuantized, QLinear, Tensor};

use crate::{ModelError, Result};

/// Fills `out` from byte `at` of `file` without moving a shared cursor (any number at once).
pub(crate) fn read_exact_at(file: &std::fs::File, out: &mut [u8], at: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    return std::os::unix::fs::FileExt::read_exact_at(file, out, at);
    #[cfg(not(unix))]
    {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = file;
        file.seek(SeekFrom::Start(at))?;
        file.read_exact(out)
    }
}

/// Bytes of a checkpoint's tensors read so far, shared with whoever shows a load's progress
/// (reads of streamed experts keep adding to it after the load).
#[derive(Debug, Default)]
pub struct LoadProgress {
    read: AtomicU64,
}

impl LoadProgress {
    /// Bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    pub(crate) fn add(&self, bytes: usize) {
        self.read.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

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

/// A convolution kernel `t` stored channels-last, as MLX conversions store them (`[out, …,
/// in]`: mlx-vlm's towers), turned to the `[out, in, …]` that `shape` asks for; any other
/// tensor as it is.
fn channels_first(t: Tensor, shape: &[usize]) -> Result<Tensor> {
    let dims = t.dims();
    let rank = dims.len();
    if rank < 4 || dims == shape || shape.len() != rank {
        return Ok(t);
    }
    let moved: Vec<usize> = [shape[0]]
        .into_iter()
        .chain(shape[2..].iter().copied())
        .chain([shape[1]])
        .collect();
    if dims != moved {
        return Ok(t);
    }
    let order: Vec<usize> = [0, rank - 1].into_iter().chain(1..rank - 1).collect();
    Ok(t.permute(order)?.contiguous()?)
}

/// Where the tensors come from.
pub enum Source {
    /// One or more safetensors files (sharded checkpoints).
    Safetensors(SafetensorsFiles),
    /// A GGUF file.
    Gguf(GgufFile),
}

/// A checkpoint's tensors, looked up by HF name and placed on one device. Clones share the
/// open files (a streamed expert store keeps one to read from).
#[derive(Clone)]
pub struct Weights {
    source: Arc<Source>,
    device: Device,
    dtype: DType,
    /// MLX quantization settings from config.json, when the checkpoint has them.
    mlx: Option<MlxQuantization>,
    mlx_activations: MlxActivations,
    /// Where streamed experts are read, when MoE layers stream them.
    expert_reads: Option<Arc<ReadPool>>,
    /// Every read a positioned read, never through the mapping (a streamed store's reads: a
    /// file cut short while serving is then an error, not a crash).
    positional: bool,
    /// Names under the first prefix are read under the second ([`aliased`](Self::aliased)).
    alias: Option<Arc<(String, String)>>,
}

impl Weights {
    /// Wraps a source; dense tensors are converted to `dtype` on `device`.
    pub fn new(source: Source, device: Device, dtype: DType) -> Self {
        Self {
            source: Arc::new(source),
            device,
            dtype,
            mlx: None,
            mlx_activations: MlxActivations::default(),
            expert_reads: None,
            positional: false,
            alias: None,
        }
    }

    /// A clone that reads names under `from` from under `to` instead: a layer the checkpoint
    /// stores apart (Qwen3-Next's MTP layer under `mtp.layers.0.`) loads with the code of the
    /// layer `from` names.
    pub fn aliased(&self, from: &str, to: &str) -> Self {
        Self {
            alias: Some(Arc::new((from.to_string(), to.to_string()))),
            ..self.clone()
        }
    }

    /// `name` as the checkpoint stores it.
    fn resolve<'a>(&self, name: &'a str) -> std::borrow::Cow<'a, str> {
        match &self.alias {
            Some(a) if name.starts_with(a.0.as_str()) => {
                format!("{}{}", a.1, &name[a.0.len()..]).into()
            }
            _ => name.into(),
        }
    }

    /// Adds an MLX checkpoint's quantization settings (bits, group size, per-module overrides).
    pub fn with_mlx(mut self, mlx: Option<MlxQuantization>, activations: MlxActivations) -> Self {
        self.mlx = mlx;
        self.mlx_activations = activations;
        self
    }

    /// Makes MoE layers read their experts from the files on `pool`'s threads on each use
    /// instead of loading them.
    pub fn with_streamed_experts(mut self, pool: Option<Arc<ReadPool>>) -> Self {
        self.expert_reads = pool;
        self
    }

    /// A clone whose every read is a positioned read of exactly the tensor's bytes.
    pub fn positional(&self) -> Self {
        Self {
            positional: true,
            ..self.clone()
        }
    }

    /// An error naming the file when a checkpoint file that experts are multiplied from in place
    /// (mapped GGUF) is shorter than when it was opened; other files read into memory.
    pub fn still_whole(&self) -> Result<()> {
        match &*self.source {
            Source::Gguf(g) => g.still_whole(),
            Source::Safetensors(_) => Ok(()),
        }
    }

    /// An error naming the file if it was cut short while its mapped bytes were read (GGUF
    /// experts multiplied in place): what was computed from them must be thrown away.
    pub fn unharmed(&self) -> Result<()> {
        match &*self.source {
            Source::Gguf(g) => g.unharmed(),
            Source::Safetensors(_) => Ok(()),
        }
    }

    /// Where MoE layers read their experts, when they stream them.
    pub fn expert_reads(&self) -> Option<&Arc<ReadPool>> {
        self.expert_reads.as_ref()
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
        match &*self.source {
            Source::Safetensors(s) => {
                let regroup = self.mlx_activations == MlxActivations::Q8;
                let (quant, device) = (self.mlx.as_ref(), &self.device);
                if !self.positional {
                    return mlx::load_quantized(s, quant, prefix, (out, inp), device, regroup);
                }
                let rows = mlx::load_quantized_rows(s, quant, prefix, &[out], inp, device, regroup);
                Ok(rows?.and_then(|mut m| m.pop()))
            }
            Source::Gguf(_) => Ok(None),
        }
    }

    /// The checkpoint's path, for error messages.
    pub fn path(&self) -> &Path {
        match &*self.source {
            Source::Safetensors(s) => s.path(),
            Source::Gguf(g) => g.path(),
        }
    }

    /// Bytes of the checkpoint's files.
    pub fn file_bytes(&self) -> u64 {
        match &*self.source {
            Source::Safetensors(s) => s.file_bytes(),
            Source::Gguf(g) => std::fs::metadata(g.path()).map_or(0, |m| m.len()),
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
        let name = &*self.resolve(name);
        match &*self.source {
            Source::Safetensors(s) => s.contains(name),
            Source::Gguf(g) => g.contains(name),
        }
    }

    /// The stored shape of `name` (HF naming), without loading it.
    pub fn dims(&self, name: &str) -> Result<Vec<usize>> {
        let name = &*self.resolve(name);
        match &*self.source {
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
        Ok(self.stored_tensor(name, shape)?.to_dtype(self.dtype)?)
    }

    /// [`tensor`](Self::tensor) in the dtype the file stores it in.
    fn stored_tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let name = &*self.resolve(name);
        let t = match &*self.source {
            Source::Safetensors(s) if self.positional => {
                let dims = s.dims(name)?.to_vec();
                let rows =
                    dims.iter().product::<usize>() / dims.last().copied().unwrap_or(1).max(1);
                s.load_rows(name, 0, rows, &self.device)?.reshape(dims)?
            }
            Source::Safetensors(s) => s.load(name, &self.device)?,
            Source::Gguf(g) => g.qtensor(name, &self.device)?.dequantize(&self.device)?,
        };
        let t = channels_first(t, shape)?;
        self.check_shape(name, t.dims(), shape)?;
        Ok(t)
    }

    /// The linear layer `{prefix}.weight` `[out, in]` (and `{prefix}.bias` `[out]` when `bias`).
    pub fn linear(
        &self,
        prefix: &str,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<QLinear> {
        let prefix = &*self.resolve(prefix);
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
        match &*self.source {
            Source::Safetensors(_) => {
                let w = self.stored_tensor(&w_name, &[out_dim, in_dim])?;
                // bf16 matrices stay bf16 on the CPU: the row kernels widen them as they load
                // (the bits of an f32 copy, in half the memory).
                let keep = w.dtype() == DType::BF16 && self.dtype == DType::F32;
                Ok(QLinear::Dense {
                    w: match keep && self.device.is_cpu() {
                        true => w,
                        false => w.to_dtype(self.dtype)?,
                    },
                    b,
                })
            }
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
        let prefix = &*self.resolve(prefix);
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
        let mats: Vec<std::result::Result<GgufMatrix, MlxQuantized>> = match &*self.source {
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

    /// One projection `[out, in]` of expert `e` of an MoE layer's `n`: the per-expert tensor
    /// `each(e)` (HF checkpoints), else that expert's slice of the stack `stacked`
    /// `[n, out, in]` (MLX `switch_mlp`, GGUF `ffn_*_exps`, or a dense stack), read alone. A
    /// resident store loads every expert through here once, a streamed one on each use.
    pub fn expert_linear(
        &self,
        stacked: &str,
        each: &dyn Fn(usize) -> String,
        (n, e): (usize, usize),
        out: usize,
        inp: usize,
    ) -> Result<QLinear> {
        let stacked = &*self.resolve(stacked);
        if self.contains(&format!("{}.weight", each(0))) {
            return self.linear(&each(e), out, inp, false);
        }
        if let Source::Safetensors(s) = &*self.source {
            let regroup = self.mlx_activations == MlxActivations::Q8;
            let (quant, device) = (self.mlx.as_ref(), &self.device);
            match mlx::load_quantized_expert(
                s,
                quant,
                stacked,
                (n, e),
                (out, inp),
                device,
                regroup,
            )? {
                Some(Ok(w)) => return Ok(QLinear::Gguf { w, b: None }),
                Some(Err(w)) => return Ok(QLinear::MlxAffine { w, b: None }),
                None => {}
            }
        }
        let name = format!("{stacked}.weight");
        let mut parts = self.expert_linear_rows(&name, (n, e), &[out], inp)?;
        Ok(parts.remove(0))
    }

    /// Expert `e` of the stacked experts `name` `[n, sum(parts), in]` (an exact tensor name:
    /// HF's fused `experts.gate_up_proj` has no `.weight`), its rows split into `parts.len()`
    /// layers of `parts[i]` rows and read alone. A GGUF stack is split by the byte ranges of
    /// its rows, so it stays quantized.
    pub fn expert_linear_rows(
        &self,
        name: &str,
        (n, e): (usize, usize),
        parts: &[usize],
        inp: usize,
    ) -> Result<Vec<QLinear>> {
        let name = &*self.resolve(name);
        let total: usize = parts.iter().sum();
        match &*self.source {
            Source::Gguf(g) => {
                self.check_shape(name, &g.dims(name)?, &[n, total, inp])?;
                let in_place = self.positional;
                let mats = g.expert_row_matrices(name, (n, e), parts, &self.device, in_place)?;
                Ok(mats
                    .into_iter()
                    .map(|w| QLinear::Gguf { w, b: None })
                    .collect())
            }
            // A dense stack: the expert's rows in the compute dtype, split by rows.
            Source::Safetensors(s) => {
                self.check_shape(name, s.dims(name)?, &[n, total, inp])?;
                let expert = s.load_rows(name, e * total, total, &self.device)?;
                let expert = expert.to_dtype(self.dtype)?;
                (row_ranges(parts).into_iter())
                    .map(|(at, rows)| {
                        let w = expert.narrow(0, at, rows)?.contiguous()?;
                        Ok(QLinear::Dense { w, b: None })
                    })
                    .collect()
            }
        }
    }

    /// The embedding table `name` `[vocab, hidden]`, kept quantized when the file is.
    pub fn embedding(&self, name: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        let name = &*self.resolve(name);
        if let Some(prefix) = name.strip_suffix(".weight")
            && let Some(q) = self.mlx_matrix(prefix, vocab, hidden)?
        {
            return Ok(match q {
                Ok(blocks) => Embedding::Gguf(blocks),
                Err(q) => Embedding::MlxAffine(q),
            });
        }
        match &*self.source {
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

    /// The shared source (e.g. to keep a GGUF file's metadata after loading).
    pub fn into_source(self) -> Arc<Source> {
        self.source
    }
}
