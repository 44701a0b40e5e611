//! GGUF block-quantized matrices multiplied by Peregrine's own CPU kernels: activations are
//! quantized once per call to 8-bit blocks ([`Q8Block`]), each output is an integer dot product
//! per block straight from the packed weights (never dequantized), and output rows are split
//! over rayon's pool. Batches (prefill) walk the weights tile by tile, so each weight row is read
//! from memory once per call and reused from cache for every input row. Other devices, and
//! formats without a kernel, use candle's `QMatMul`.

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_interleaved;
#[cfg(target_arch = "x86_64")]
mod avx2_panel;
mod format;
mod interleaved;
mod interleaved_k;
#[cfg(target_arch = "x86_64")]
mod panel;
pub mod scalar;
mod tasks;

use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Result, Storage, Tensor, bail};
use rayon::prelude::*;

pub use crate::cpu::Kernel;
pub use act::{Q8Block, QK, quantize_row};
pub use format::Format;
use interleaved::Interleaved;
use tasks::{Columns, Part, PartBytes, interleaved_task, rows_task};
#[cfg(target_arch = "x86_64")]
use tasks::{PANEL_MIN_ROWS, panel_gemm, panels};

/// A GGUF weight `[out, in]` with its CPU kernel (when its format has one).
#[derive(Debug, Clone)]
pub struct GgufMatrix {
    storage: Layout,
    format: Option<Format>,
    dims: (usize, usize),
}

#[derive(Debug, Clone)]
enum Layout {
    /// As the file lays it out, in candle's tensor; its `QMatMul` serves other devices and
    /// formats without a kernel (f16/f32 are dequantized once).
    Rows {
        qtensor: Arc<QTensor>,
        fallback: QMatMul,
    },
    /// Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K with 8 rows interleaved ([`interleaved`]), for the x86 kernels.
    Interleaved(Arc<Interleaved>),
    /// Row-layout blocks of a format candle cannot hold ([`Format::MLX8`], [`Format::MLX8G64`]):
    /// CPU kernels only.
    Blocks(Arc<Vec<u8>>),
}

impl GgufMatrix {
    /// Wraps a 2-D GGUF tensor. On CPUs with the AVX2 kernels, Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K
    /// matrices of a multiple of 8 rows move into the interleaved layout (the same bytes; Q4_K's
    /// 6-bit scales take a byte each, 2.8 % more), and the file's copy is dropped once no one
    /// else holds it.
    pub fn new(qtensor: Arc<QTensor>) -> Result<Self> {
        Self::with_layout(qtensor, true)
    }

    /// A matrix of `dims` from its blocks of `format` in GGUF's row layout, interleaved as
    /// [`new`](Self::new) would (moved without another copy). Q4_1 block pairs that share their
    /// scales (MLX groups of 64 or 128) keep one copy of them.
    pub fn from_blocks(format: Format, bytes: Vec<u8>, dims: (usize, usize)) -> Result<Self> {
        let (rows, cols) = dims;
        let blocks = cols / format.block_len();
        if cols % format.block_len() != 0 || bytes.len() != rows * blocks * format.block_bytes() {
            bail!(
                "gguf matrix: {} bytes of {format:?} for {dims:?}",
                bytes.len()
            );
        }
        if Self::interleaves(format, rows, cols) {
            let interleaved = Interleaved::from_vec(format, bytes, rows, blocks).share_scales();
            let storage = Layout::Interleaved(Arc::new(interleaved));
            return Ok(Self {
                storage,
                format: Some(format),
                dims,
            });
        }
        let Some(dtype) = format.dtype() else {
            return Ok(Self {
                storage: Layout::Blocks(Arc::new(bytes)),
                format: Some(format),
                dims,
            });
        };
        let q = qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &Device::Cpu)?;
        Self::new(Arc::new(q))
    }

    /// Whether a CPU matrix of `format` and `(rows, cols)` moves into the interleaved layout
    /// (the x86 kernels' fastest; a multiple of 8 rows).
    pub fn interleaves(format: Format, rows: usize, cols: usize) -> bool {
        Kernel::best().has_avx2()
            && Interleaved::fits(format, rows)
            && cols.is_multiple_of(format.block_len())
    }

    /// [`new`](Self::new) that keeps the file's row layout (to compare the two layouts).
    pub fn new_rows(qtensor: Arc<QTensor>) -> Result<Self> {
        Self::with_layout(qtensor, false)
    }

    fn with_layout(qtensor: Arc<QTensor>, interleave: bool) -> Result<Self> {
        let dims = qtensor.shape().dims2()?;
        let format = Format::of(qtensor.dtype()).filter(|f| dims.1 % f.block_len() == 0);
        let cpu = matches!(qtensor.device(), Device::Cpu);
        let storage = match format {
            Some(f) if interleave && cpu && Self::interleaves(f, dims.0, dims.1) => {
                let blocks = dims.1 / f.block_len();
                Layout::Interleaved(Arc::new(Interleaved::new(
                    f,
                    &qtensor.data()?,
                    dims.0,
                    blocks,
                )))
            }
            _ => Layout::Rows {
                fallback: QMatMul::from_arc(qtensor.clone())?,
                qtensor,
            },
        };
        Ok(Self {
            storage,
            format,
            dims,
        })
    }

    /// Logical `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        self.dims
    }

    /// The block format when a Peregrine kernel multiplies this matrix.
    pub fn format(&self) -> Option<Format> {
        self.format
    }

    /// Whether the rows are interleaved 8 at a time for the x86 kernels.
    pub fn is_interleaved(&self) -> bool {
        matches!(self.storage, Layout::Interleaved(_))
    }

    /// Bytes the weight occupies in memory.
    pub fn weight_bytes(&self) -> usize {
        match &self.storage {
            Layout::Interleaved(w) => w.bytes.len(),
            Layout::Blocks(b) => b.len(),
            Layout::Rows { fallback, .. } => match fallback {
                QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => crate::linear::tensor_bytes(t),
            },
        }
    }

    /// Rows `ids` (`[..]`, u32) dequantized: `[.., in]` f32 (an embedding lookup).
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        if let Layout::Rows { qtensor, .. } = &self.storage {
            return qtensor.embedding(ids);
        }
        let (rows, hidden) = self.dims;
        let flat = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        if let Some(bad) = flat.iter().find(|&&i| i as usize >= rows) {
            bail!("embedding id {bad} is out of range for {rows} rows");
        }
        let mut out = vec![0f32; flat.len() * hidden];
        for (o, &id) in out.chunks_exact_mut(hidden).zip(&flat) {
            let id = id as usize;
            match (&self.storage, self.format) {
                (Layout::Interleaved(w), _) => w.dequantize_row(id, o),
                (Layout::Blocks(b), Some(format)) => {
                    let row_bytes = hidden / format.block_len() * format.block_bytes();
                    scalar::dequantize_row(format, &b[id * row_bytes..][..row_bytes], o)?;
                }
                _ => bail!("gguf embedding: rows of {:?} without a format", self.dims),
            }
        }
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        Tensor::from_vec(out, dims, &Device::Cpu)?.to_device(ids.device())
    }

    /// `x: [.., in]` → `[.., out]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match Self::forward_group(&[self], x)?.pop() {
            Some(y) => Ok(y),
            None => bail!("gguf matmul: empty group"),
        }
    }

    /// [`forward`](Self::forward) through several matrices of the same input width, as one
    /// parallel pass: `x` is quantized once and their rows are split over the pool together
    /// (q/k/v, or gate/up, cost one dispatch instead of three or two).
    pub fn forward_group(mats: &[&Self], x: &Tensor) -> Result<Vec<Tensor>> {
        let fused = mats.iter().all(|w| w.format.is_some());
        if !fused || !matches!(x.device(), Device::Cpu) {
            return (mats.iter())
                .map(|w| match &w.storage {
                    Layout::Rows { fallback, .. } => fallback.forward(x),
                    Layout::Interleaved(_) | Layout::Blocks(_) => {
                        bail!("gguf matmul: CPU weights, input on {:?}", x.device())
                    }
                })
                .collect();
        }
        let in_dim = mats.first().map_or(0, |w| w.dims().1);
        let dims = x.dims().to_vec();
        if dims.last() != Some(&in_dim) || mats.iter().any(|w| w.dims().1 != in_dim) {
            bail!("gguf matmul: input shape {dims:?} does not end in every input width");
        }
        let m = x.elem_count() / in_dim;
        let xf = x.to_dtype(DType::F32)?.contiguous()?;
        let (storage, layout) = xf.storage_and_layout();
        let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets())
        else {
            bail!("gguf matmul: input is not a contiguous CPU tensor");
        };
        let ys = Self::matmul_group(mats, &cpu.as_slice::<f32>()?[start..end], m, Kernel::best())?;
        mats.iter()
            .zip(ys)
            .map(|(w, y)| {
                let mut dims = dims.clone();
                *dims.last_mut().expect("checked above") = w.dims().0;
                Tensor::from_vec(y, dims, &Device::Cpu)?.to_dtype(x.dtype())
            })
            .collect()
    }

    /// `x: [m, in]` (row-major f32) → `[m, out]` with `kernel`.
    pub fn matmul_with(&self, x: &[f32], m: usize, kernel: Kernel) -> Result<Vec<f32>> {
        Ok(Self::matmul_group(&[self], x, m, kernel)?.remove(0))
    }

    /// `x: [m, in]` through each matrix (all of width `in`) → one `[m, out_i]` each.
    pub fn matmul_group(
        mats: &[&Self],
        x: &[f32],
        m: usize,
        kernel: Kernel,
    ) -> Result<Vec<Vec<f32>>> {
        if !kernel.runs_here() {
            bail!("gguf matmul: this CPU cannot run the {kernel:?} kernel");
        }
        let Some(k) = mats.first().map(|w| w.dims().1) else {
            return Ok(Vec::new());
        };
        if x.len() != m * k {
            bail!("gguf matmul: {} inputs for {m} rows of {k}", x.len());
        }
        let mut parts = Vec::with_capacity(mats.len());
        for w in mats {
            let Some(format) = w.format else {
                bail!("gguf matmul: a matrix without a kernel in {:?}", w.dims());
            };
            if w.dims().1 != k {
                bail!("gguf matmul: widths {} and {k} in one group", w.dims().1);
            }
            let bytes = match &w.storage {
                Layout::Rows { qtensor, .. } => PartBytes::Rows(format, qtensor.data()?),
                Layout::Interleaved(iw) => PartBytes::Interleaved(iw),
                Layout::Blocks(b) => PartBytes::Rows(format, b.as_slice().into()),
            };
            parts.push(Part {
                rows: w.dims().0,
                bytes,
            });
        }
        let blocks = k / QK;
        let mut xq = vec![Q8Block::default(); m * blocks];
        xq.par_chunks_mut(blocks)
            .zip(x.par_chunks(k))
            .for_each(|(q, x)| quantize_row(x, q));

        let total_rows: usize = parts.iter().map(|p| p.rows).sum();
        // Whole groups of 8 rows per task, for the interleaved layout.
        let rows_per_task = (total_rows / (rayon::current_num_threads() * 4))
            .clamp(1, 512)
            .next_multiple_of(interleaved::ROWS);
        let mut ys: Vec<Vec<f32>> = parts.iter().map(|p| vec![0f32; m * p.rows]).collect();
        let outs: Vec<Columns> = (ys.iter_mut().zip(&parts))
            .map(|(y, p)| Columns(y.as_mut_ptr(), p.rows))
            .collect();
        // Each task owns output columns r0..r1 of one matrix (rows of its weight), for all m.
        let tasks: Vec<(usize, usize, usize)> = (parts.iter().enumerate())
            .flat_map(|(p, part)| {
                (0..part.rows)
                    .step_by(rows_per_task)
                    .map(move |r0| (p, r0, (r0 + rows_per_task).min(part.rows)))
            })
            .collect();
        #[cfg(target_arch = "x86_64")]
        let use_panels = m >= PANEL_MIN_ROWS && kernel.has_avx2();
        #[cfg(target_arch = "x86_64")]
        let any_rows = parts.iter().any(|p| matches!(p.bytes, PartBytes::Rows(..)));
        let xp = match use_panels && any_rows {
            true => panels(&xq, m, blocks),
            false => Vec::new(),
        };
        tasks.into_par_iter().for_each(|(p, r0, r1)| {
            let (part, out) = (&parts[p], &outs[p]);
            // SAFETY (every call below): the task owns output columns r0..r1, for all m rows.
            let (format, data) = match &part.bytes {
                PartBytes::Interleaved(iw) => {
                    unsafe { interleaved_task(kernel, iw, &xq, m, out, r0, r1) };
                    return;
                }
                PartBytes::Rows(format, data) => (*format, data),
            };
            let row_bytes = k / format.block_len() * format.block_bytes();
            #[cfg(target_arch = "x86_64")]
            if use_panels {
                let rows = &data[r0 * row_bytes..r1 * row_bytes];
                unsafe { panel_gemm(kernel, format, rows, row_bytes, &xp, blocks, m, out, r0) };
                return;
            }
            unsafe { rows_task(kernel, format, data, row_bytes, &xq, m, out, r0, r1) };
        });
        Ok(ys)
    }
}
