//! Linear layers and embeddings over every weight format Peregrine loads.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{D, DType, Device, Result, Tensor};

use crate::dense;
use crate::mlx::MlxQuantized;
use crate::quant::{GgufMatrix, Kernel, MAX_GROUP, Q8Input};

/// A linear layer `y = x Wᵀ + b`; the only place where weight formats meet matmul.
/// Adding a format adds a variant here and a mapping in the loader, nothing in model code.
#[derive(Debug, Clone)]
pub enum QLinear {
    /// A plain weight `[out, in]` in the compute dtype.
    Dense {
        /// Weight, `[out, in]`.
        w: Tensor,
        /// Optional bias, `[out]`.
        b: Option<Tensor>,
    },
    /// A GGUF block-quantized weight, multiplied by Peregrine's kernels on CPU.
    Gguf {
        /// The quantized weight, logical shape `[out, in]`.
        w: GgufMatrix,
        /// Optional bias, `[out]`.
        b: Option<Tensor>,
    },
    /// An MLX affine-quantized weight, multiplied without dequantizing the whole matrix.
    MlxAffine {
        /// The quantized weight, logical shape `[out, in]`.
        w: MlxQuantized,
        /// Optional bias, `[out]`.
        b: Option<Tensor>,
    },
}

impl QLinear {
    /// Wraps a GGUF tensor; f32/f16/bf16 GGUF tensors are dequantized once by candle.
    pub fn from_qtensor(w: Arc<QTensor>, b: Option<Tensor>) -> Result<Self> {
        Ok(Self::Gguf {
            w: GgufMatrix::new(w)?,
            b,
        })
    }

    /// `x: [.., in]` → `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.forward_unbiased(x)?;
        match self.bias() {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// [`forward`](Self::forward) through several layers that read the same input (q/k/v,
    /// gate/up): GGUF layers share one quantization of `x` and one parallel pass.
    pub fn forward_group(layers: &[&Self], x: &Tensor) -> Result<Vec<Tensor>> {
        let gguf: Option<Vec<&GgufMatrix>> = (layers.iter())
            .map(|l| match l {
                Self::Gguf { w, .. } => Some(w),
                _ => None,
            })
            .collect();
        let mlx: Option<Vec<&MlxQuantized>> = (layers.iter())
            .map(|l| match l {
                Self::MlxAffine { w, .. } => Some(w),
                _ => None,
            })
            .collect();
        let ys = match (gguf, mlx) {
            (Some(mats), _) if mats.len() > 1 => GgufMatrix::forward_group(&mats, x)?,
            (_, Some(mats)) if mats.len() > 1 => MlxQuantized::forward_group(&mats, x)?,
            _ => match Self::dense_group(layers, x)? {
                Some(ys) => ys,
                None => return layers.iter().map(|l| l.forward(x)).collect(),
            },
        };
        (layers.iter().zip(ys))
            .map(|(l, y)| match l.bias() {
                Some(b) => y.broadcast_add(b),
                None => Ok(y),
            })
            .collect()
    }

    /// Dense layers of a group in one GPU launch (`dense_cuda::matmul_group`: a decode step's
    /// q/k/v or gate/up); `None` where that does not apply (always on the CPU).
    #[allow(unused_variables)]
    fn dense_group(layers: &[&Self], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
        #[cfg(feature = "cuda")]
        if layers.len() > 1 {
            let ws: Option<Vec<&Tensor>> = (layers.iter())
                .map(|l| match l {
                    Self::Dense { w, .. } => Some(w),
                    _ => None,
                })
                .collect();
            if let Some(ws) = ws {
                return crate::dense_cuda::matmul_group(x, &ws);
            }
        }
        Ok(None)
    }

    /// [`forward_group`](Self::forward_group) for one input row into the caller's buffers
    /// (the decode step): `x` is `[in]`, each `outs[i]` is `[out_i]` and is overwritten. GGUF
    /// weights (and MLX weights regrouped into blocks) allocate nothing once `scratch` has
    /// grown; f32 dense weights go through [`dense::matmul_rows`], MLX-f32 ones through candle
    /// (copying their result).
    pub fn forward_group_into(
        layers: &[&Self],
        x: &[f32],
        outs: &mut [&mut [f32]],
        scratch: &mut LinearScratch,
    ) -> Result<()> {
        Self::forward_rows_into(layers, x, 1, outs, scratch)
    }

    /// [`forward_group_into`](Self::forward_group_into) for `rows` input rows (a batched
    /// decode step's, one per sequence): `x` is `[rows, in]`, each `outs[i]` `[rows, out_i]`.
    /// Each row's outputs are the bits [`forward_group`](Self::forward_group) gives it.
    pub fn forward_rows_into(
        layers: &[&Self],
        x: &[f32],
        rows: usize,
        outs: &mut [&mut [f32]],
        scratch: &mut LinearScratch,
    ) -> Result<()> {
        if layers.len() != outs.len() {
            candle_core::bail!("linear: {} layers, {} outputs", layers.len(), outs.len());
        }
        let all_kernels = layers.iter().all(|l| l.cpu_kernel().is_some());
        match layers.first().and_then(|l| l.cpu_kernel()) {
            // One pass over the pool for the whole group, as `forward_group` does.
            Some(first) if all_kernels && layers.len() <= MAX_GROUP => {
                let mut mats = [first; MAX_GROUP];
                for (m, l) in mats.iter_mut().zip(layers) {
                    *m = l.cpu_kernel().expect("checked above");
                }
                let mats = &mats[..layers.len()];
                let xq = &mut scratch.xq;
                GgufMatrix::matmul_group_into(mats, x, rows, Kernel::best(), xq, outs)?;
            }
            _ => {
                for (l, out) in layers.iter().zip(outs.iter_mut()) {
                    if l.dense_rows_into(x, rows, out)? {
                        continue;
                    }
                    let xt = Tensor::from_slice(x, (rows, x.len() / rows.max(1)), &Device::Cpu)?;
                    let y = l
                        .forward_unbiased(&xt)?
                        .flatten_all()?
                        .to_dtype(DType::F32)?;
                    out.copy_from_slice(&y.to_vec1::<f32>()?);
                }
            }
        }
        for (l, out) in layers.iter().zip(outs.iter_mut()) {
            if let Some(b) = l.bias() {
                add_bias(b, out)?;
            }
        }
        Ok(())
    }

    /// The f32 or bf16 CPU weight `[out, in]` that [`dense::matmul_rows`] multiplies, and
    /// whether it does so for inputs of any number of rows: small GGUF f32/f16 matrices (MoE
    /// routers, which llama.cpp keeps in f32) always, so that prefill and decode route alike;
    /// larger ones up to [`dense::MAX_ROWS`] rows (decode, verification, small batches), more
    /// going through candle's GEMM.
    fn dense_cpu(&self) -> Option<(&Tensor, bool)> {
        let (w, small) = match self {
            Self::Dense { w, .. } => (w, false),
            Self::Gguf { w, .. } => (w.dense()?, w.dims().0 <= SMALL_DENSE_ROWS),
            Self::MlxAffine { .. } => return None,
        };
        let kernel_dtype = matches!(w.dtype(), DType::F32 | DType::BF16);
        (kernel_dtype && w.device().is_cpu()).then_some((w, small))
    }

    /// `out = W x` for `rows` f32 rows, when [`dense_cpu`](Self::dense_cpu) applies to that
    /// many (as [`dense_rows_forward`](Self::dense_rows_forward) decides, so both give the
    /// same bits).
    fn dense_rows_into(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<bool> {
        let Some((w, small)) = self.dense_cpu() else {
            return Ok(false);
        };
        if !small && rows > dense::MAX_ROWS {
            return Ok(false);
        }
        dense_rows(w, x, x.len() / rows.max(1), out)
    }

    /// [`forward_unbiased`](Self::forward_unbiased) by [`dense::matmul_rows`], when
    /// [`dense_cpu`](Self::dense_cpu) applies to `x`'s rows.
    fn dense_rows_forward(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some((w, small)) = self.dense_cpu() else {
            return Ok(None);
        };
        let (out_dim, in_dim) = w.dims2()?;
        let mut dims = x.dims().to_vec();
        let rows = x.elem_count() / in_dim.max(1);
        if !small && rows > dense::MAX_ROWS {
            return Ok(None);
        }
        let x = x.contiguous()?;
        let y = crate::ops::with_f32(&x, |x| -> Result<Option<Vec<f32>>> {
            let mut y = vec![0f32; rows * out_dim];
            Ok(dense_rows(w, x, in_dim, &mut y)?.then_some(y))
        })?;
        let Some(Some(y)) = y.transpose()? else {
            return Ok(None);
        };
        *dims
            .last_mut()
            .expect("a matmul input has a last dimension") = out_dim;
        Ok(Some(Tensor::from_vec(y, dims, &Device::Cpu)?))
    }

    /// The GGUF matrix, when one of Peregrine's kernels multiplies it.
    fn cpu_kernel(&self) -> Option<&GgufMatrix> {
        match self {
            Self::Gguf { w, .. } if w.format().is_some() => Some(w),
            _ => None,
        }
    }

    fn bias(&self) -> Option<&Tensor> {
        match self {
            Self::Dense { b, .. } | Self::Gguf { b, .. } | Self::MlxAffine { b, .. } => b.as_ref(),
        }
    }

    fn forward_unbiased(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.dense_rows_forward(x)? {
            return Ok(y);
        }
        match self {
            // bf16 weights kept for the row kernels are widened for the GEMM, one at a time.
            Self::Dense { w, .. } if w.dtype() != x.dtype() => {
                dense_matmul(x, &w.to_dtype(x.dtype())?)
            }
            Self::Dense { w, .. } => dense_matmul(x, w),
            Self::Gguf { w, .. } => w.forward(x),
            Self::MlxAffine { w, .. } => w.forward(x),
        }
    }

    /// Bytes the weights occupy in memory.
    pub fn weight_bytes(&self) -> usize {
        let bias = |b: &Option<Tensor>| b.as_ref().map_or(0, tensor_bytes);
        match self {
            Self::Dense { w, b } => tensor_bytes(w) + bias(b),
            Self::Gguf { w, b } => w.weight_bytes() + bias(b),
            Self::MlxAffine { w, b } => w.weight_bytes() + bias(b),
        }
    }
}

/// `out = x · w^T` for f32 rows `x` (`[m, k]`) by [`dense::matmul_rows`] over `w`'s f32 or
/// bf16 CPU elements; `false` (nothing written) for a weight it cannot read in place.
fn dense_rows(w: &Tensor, x: &[f32], k: usize, out: &mut [f32]) -> Result<bool> {
    if let Some(()) = crate::ops::with_f32(w, |w| dense::matmul_rows(w, x, k, out))? {
        return Ok(true);
    }
    Ok(crate::ops::with_bf16(w, |w| dense::matmul_rows(w, x, k, out))?.is_some())
}

/// `out += b` on each row of `out`, reading an f32 CPU bias in place (others are converted first).
fn add_bias(b: &Tensor, out: &mut [f32]) -> Result<()> {
    let n = b.elem_count().max(1);
    let add = |b: &[f32]| {
        for row in out.chunks_mut(n) {
            row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
    };
    if crate::ops::with_f32(b, add)?.is_none() {
        let b = b
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        for row in out.chunks_mut(n) {
            row.iter_mut().zip(&b).for_each(|(o, b)| *o += b);
        }
    }
    Ok(())
}

/// Rows of the largest GGUF f32/f16 matrix multiplied by [`dense_rows_into`] (a router has
/// one row per expert; DeepSeek-V3 has 256).
const SMALL_DENSE_ROWS: usize = 1024;

/// Buffers a [`QLinear::forward_group_into`] call reuses: the input's 8-bit blocks.
#[derive(Debug, Default)]
pub struct LinearScratch {
    xq: Q8Input,
}

pub(crate) fn dense_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = crate::dense_cuda::matmul(x, w)? {
        return Ok(y);
    }
    match x.dims() {
        [b1, b2, _, _] => x.matmul(&w.broadcast_left((*b1, *b2))?.t()?),
        [b, _, _] => x.matmul(&w.broadcast_left(*b)?.t()?),
        _ => x.matmul(&w.t()?),
    }
}

/// Bytes of a dense tensor's elements.
pub fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// A token embedding table. Quantized tables stay quantized: only the looked-up rows are
/// dequantized, so a 262K-row vocabulary costs its file size, not an f32 copy.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// Dense table `[vocab, hidden]`.
    Dense(Tensor),
    /// GGUF-quantized table `[vocab, hidden]` (shared with the output layer when tied).
    Gguf(GgufMatrix),
    /// MLX affine-quantized table `[vocab, hidden]`.
    MlxAffine(MlxQuantized),
}

impl Embedding {
    /// `ids: [..]` (u32) → `[.., hidden]` in `dtype`.
    pub fn forward(&self, ids: &Tensor, dtype: candle_core::DType) -> Result<Tensor> {
        match self {
            Self::Dense(w) => {
                let mut dims = ids.dims().to_vec();
                dims.push(w.dim(D::Minus1)?);
                w.index_select(&ids.flatten_all()?, 0)?
                    .reshape(dims)?
                    .to_dtype(dtype)
            }
            Self::Gguf(q) => q.embedding(ids)?.to_dtype(dtype),
            Self::MlxAffine(q) => {
                let mut dims = ids.dims().to_vec();
                dims.push(q.dims().1);
                let flat = ids.flatten_all()?.to_dtype(candle_core::DType::U32)?;
                let rows = q.gather_rows(&flat.to_vec1::<u32>()?)?;
                rows.to_device(ids.device())?.reshape(dims)?.to_dtype(dtype)
            }
        }
    }

    /// Row `id` as f32 into `out` (`[hidden]`): no allocation for GGUF tables in the kernels'
    /// layouts and f32 dense tables (the decode step); others through [`forward`](Self::forward).
    pub fn row_into(&self, id: u32, out: &mut [f32]) -> Result<()> {
        let copied = match self {
            Self::Gguf(q) if q.format().is_some() => return q.row_into(id as usize, out),
            Self::Dense(w) if (id as usize) < w.dim(0)? => crate::ops::with_f32(w, |w| {
                out.copy_from_slice(&w[id as usize * out.len()..][..out.len()])
            })?,
            _ => None,
        };
        if copied.is_none() {
            let ids = Tensor::new(&[id], &Device::Cpu)?;
            let row = self.forward(&ids, DType::F32)?.flatten_all()?;
            out.copy_from_slice(&row.to_vec1::<f32>()?);
        }
        Ok(())
    }

    /// The same table as an output projection (tied embeddings).
    pub fn as_linear(&self) -> Result<QLinear> {
        match self {
            Self::Dense(w) => Ok(QLinear::Dense {
                w: w.clone(),
                b: None,
            }),
            Self::Gguf(q) => Ok(QLinear::Gguf {
                w: q.clone(),
                b: None,
            }),
            Self::MlxAffine(q) => Ok(QLinear::MlxAffine {
                w: q.clone(),
                b: None,
            }),
        }
    }

    /// Bytes the table occupies in memory.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Dense(w) => tensor_bytes(w),
            Self::Gguf(q) => q.weight_bytes(),
            Self::MlxAffine(q) => q.weight_bytes(),
        }
    }
}
