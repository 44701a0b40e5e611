//! GGUF block-quantized matrices multiplied by Peregrine's own CPU kernels: activations are
//! quantized once per call to 8-bit blocks ([`Q8Block`]; a row's dominant blocks refined by a
//! residual block, [`Q8Input`]), each output is an integer dot product per block straight from
//! the packed weights (never dequantized), and output rows are split over rayon's pool.
//! Batches (prefill) walk the weights tile by tile, so each weight row is read from memory once
//! per call and reused from cache for every input row. Other devices, and formats without a
//! kernel, use candle's `QMatMul`.

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_groups;
#[cfg(target_arch = "x86_64")]
mod avx2_interleaved;
#[cfg(target_arch = "x86_64")]
mod avx2_interleaved_k;
#[cfg(target_arch = "x86_64")]
mod avx2_panel;
#[cfg(target_arch = "x86_64")]
mod avx2_row_group;
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
pub use act::{Q8Block, Q8Input, QK, REFINED, Refinement, quantize_row};
pub use format::Format;
use interleaved::Interleaved;
use tasks::{Columns, Part, PartBytes, interleaved_task, refine_task, rows_task};
#[cfg(target_arch = "x86_64")]
use tasks::{PANEL_MIN_ROWS, panel_gemm, panels, row_groups_task};

/// Whether a row-layout matrix of `format` and `(rows, cols)` multiplies in groups of 8 rows.
fn in_groups(format: Format, (rows, cols): (usize, usize)) -> bool {
    GgufMatrix::multiplies_in_place(format, rows, cols)
}

/// Most matrices one [`GgufMatrix::matmul_group_into`] call takes (q/k/v is three).
pub const MAX_GROUP: usize = 4;

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
    /// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K with 8 rows interleaved ([`interleaved`]), for the x86
    /// kernels.
    Interleaved(Arc<Interleaved>),
    /// Row-layout blocks of a format candle cannot hold ([`Format::MLX8`], [`Format::MLX8G64`]):
    /// CPU kernels only.
    Blocks(Arc<Vec<u8>>),
    /// Row-layout blocks read where they lie, owned elsewhere (a mapped file's range): CPU
    /// kernels only, Q4_0/Q4_1/Q8_0/Q4_K/Q6_K 8 rows at a time through the interleaved kernels.
    Shared(Arc<dyn SharedBytes>),
}

/// Bytes a [`GgufMatrix`] multiplies where they lie, owned by someone else: a range of a
/// mapped file, which need not be copied or repacked first.
pub trait SharedBytes: Send + Sync + std::fmt::Debug {
    /// The blocks, in GGUF's row layout.
    fn bytes(&self) -> &[u8];
}

impl GgufMatrix {
    /// Wraps a 2-D GGUF tensor. On CPUs with the AVX2 kernels, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K
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

    /// A matrix of `dims` whose `format` blocks, in GGUF's row layout, stay where `bytes` holds
    /// them. Multiplies as fast as the interleaved layout (with the same bits) where
    /// [`multiplies_in_place`](Self::multiplies_in_place) says so, else with the row kernels.
    pub fn from_shared(
        format: Format,
        bytes: Arc<dyn SharedBytes>,
        dims: (usize, usize),
    ) -> Result<Self> {
        let (rows, cols) = dims;
        let len = bytes.bytes().len();
        if cols % format.block_len() != 0
            || len != rows * cols / format.block_len() * format.block_bytes()
        {
            bail!("gguf matrix: {len} bytes of {format:?} for {dims:?}");
        }
        Ok(Self {
            storage: Layout::Shared(bytes),
            format: Some(format),
            dims,
        })
    }

    /// Whether a CPU matrix of `format` and `(rows, cols)` left in GGUF's row layout
    /// ([`from_shared`](Self::from_shared)) multiplies as fast as an interleaved one: groups
    /// of 8 rows of Q4_0, Q4_1, Q8_0, Q4_K or Q6_K with the x86 kernels.
    pub fn multiplies_in_place(format: Format, rows: usize, cols: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        let fits = avx2_row_group::fits(format);
        #[cfg(not(target_arch = "x86_64"))]
        let fits = false;
        fits && Self::interleaves(format, rows, cols)
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
                fallback: match QMatMul::from_arc(qtensor.clone())? {
                    // Float tensors, dequantized to f32 by candle: off the CPU they take the
                    // activations' dtype once, here (a GPU multiplies bf16 by bf16).
                    QMatMul::Tensor(w) | QMatMul::TensorF16(w) if !cpu => {
                        QMatMul::Tensor(w.to_dtype(crate::device::compute_dtype(w.device()))?)
                    }
                    other => other,
                },
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

    /// Whether the blocks are multiplied where someone else holds them
    /// ([`from_shared`](Self::from_shared): a mapped file's pages).
    pub fn is_shared(&self) -> bool {
        matches!(self.storage, Layout::Shared(_))
    }

    /// candle's tensor of the blocks in the file's row layout, where they are held so (a GPU's
    /// matrices, or a CPU without the x86 kernels).
    pub fn rows_qtensor(&self) -> Option<&Arc<QTensor>> {
        match &self.storage {
            Layout::Rows { qtensor, .. } => Some(qtensor),
            _ => None,
        }
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
            Layout::Shared(b) => b.bytes().len(),
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
            self.row_into(id as usize, o)?;
        }
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        Tensor::from_vec(out, dims, &Device::Cpu)?.to_device(ids.device())
    }

    /// Row `r` dequantized into `out` (`in` values), without allocating for the formats with a
    /// kernel (a decode step's embedding lookup); others go through candle.
    pub fn row_into(&self, r: usize, out: &mut [f32]) -> Result<()> {
        let (rows, cols) = self.dims;
        if r >= rows || out.len() != cols {
            bail!("gguf row {r} of {:?} into {} values", self.dims, out.len());
        }
        let row_bytes = |f: Format| cols / f.block_len() * f.block_bytes();
        match (&self.storage, self.format) {
            (Layout::Interleaved(w), _) => w.dequantize_row(r, out),
            (Layout::Blocks(b), Some(f)) => {
                scalar::dequantize_row(f, &b[r * row_bytes(f)..][..row_bytes(f)], out)?
            }
            (Layout::Shared(b), Some(f)) => {
                scalar::dequantize_row(f, &b.bytes()[r * row_bytes(f)..][..row_bytes(f)], out)?
            }
            (Layout::Rows { qtensor, .. }, Some(f)) => {
                let data = qtensor.data()?;
                scalar::dequantize_row(f, &data[r * row_bytes(f)..][..row_bytes(f)], out)?
            }
            (Layout::Rows { qtensor, .. }, None) => {
                let ids = Tensor::new(&[r as u32], &Device::Cpu)?;
                let row = qtensor
                    .embedding(&ids)?
                    .flatten_all()?
                    .to_dtype(DType::F32)?;
                out.copy_from_slice(&row.to_vec1::<f32>()?);
            }
            (Layout::Blocks(_) | Layout::Shared(_), None) => {
                bail!("gguf row: blocks of {:?} without a format", self.dims)
            }
        }
        Ok(())
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
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let rows: Option<Vec<&QTensor>> = (mats.iter())
                .map(|w| match &w.storage {
                    Layout::Rows { qtensor, .. } => Some(&**qtensor),
                    _ => None,
                })
                .collect();
            if let Some(rows) = rows
                && let Some(ys) = crate::gguf_cuda::matmul_group(&rows, x)?
            {
                return Ok(ys);
            }
            // f16/bf16 GGUF tensors, dequantized at load: the dense GEMV, not candle's cuBLAS.
            let dense: Option<Vec<&Tensor>> = mats.iter().map(|w| w.dense()).collect();
            if let Some(ws) = dense
                && let Some(ys) = crate::dense_cuda::matmul_group(x, &ws)?
            {
                return Ok(ys);
            }
        }
        let fused = mats.iter().all(|w| w.format.is_some());
        if !fused || !matches!(x.device(), Device::Cpu) {
            return (mats.iter())
                .map(|w| match &w.storage {
                    Layout::Rows { fallback, .. } => fallback.forward(x),
                    Layout::Interleaved(_) | Layout::Blocks(_) | Layout::Shared(_) => {
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
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; m * w.dims().0]).collect();
        let mut xq = Q8Input::default();
        for (mats, ys) in mats.chunks(MAX_GROUP).zip(ys.chunks_mut(MAX_GROUP)) {
            let mut outs: [&mut [f32]; MAX_GROUP] = Default::default();
            for (o, y) in outs.iter_mut().zip(ys) {
                *o = y;
            }
            Self::matmul_group_into(mats, x, m, kernel, &mut xq, &mut outs[..mats.len()])?;
        }
        Ok(ys)
    }

    /// [`matmul_group`](Self::matmul_group) into the caller's buffers, allocating nothing for
    /// a single input row (the decode step): `outs[i]` is `[m, out_i]` and is overwritten,
    /// `xq` holds the quantized input between calls. At most [`MAX_GROUP`] matrices.
    pub fn matmul_group_into(
        mats: &[&Self],
        x: &[f32],
        m: usize,
        kernel: Kernel,
        xq: &mut Q8Input,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        if !kernel.runs_here() {
            bail!("gguf matmul: this CPU cannot run the {kernel:?} kernel");
        }
        let Some(k) = mats.first().map(|w| w.dims().1) else {
            return Ok(());
        };
        if x.len() != m * k {
            bail!("gguf matmul: {} inputs for {m} rows of {k}", x.len());
        }
        if mats.len() > MAX_GROUP || outs.len() != mats.len() {
            bail!(
                "gguf matmul: {} matrices, {} outputs",
                mats.len(),
                outs.len()
            );
        }
        let mut parts: [Option<Part>; MAX_GROUP] = Default::default();
        let mut columns: [Option<Columns>; MAX_GROUP] = Default::default();
        for (i, (w, out)) in mats.iter().zip(outs.iter_mut()).enumerate() {
            let Some(format) = w.format else {
                bail!("gguf matmul: a matrix without a kernel in {:?}", w.dims());
            };
            if w.dims().1 != k || out.len() != m * w.dims().0 {
                bail!(
                    "gguf matmul: a {:?} matrix in a group of width {k} with {} outputs",
                    w.dims(),
                    out.len()
                );
            }
            let bytes = match &w.storage {
                Layout::Rows { qtensor, .. } => PartBytes::Rows(format, qtensor.data()?),
                Layout::Interleaved(iw) => PartBytes::Interleaved(iw),
                Layout::Blocks(b) => PartBytes::Rows(format, b.as_slice().into()),
                Layout::Shared(b) if kernel.has_avx2() && in_groups(format, w.dims) => {
                    PartBytes::RowGroups(format, b.bytes())
                }
                Layout::Shared(b) => PartBytes::Rows(format, b.bytes().into()),
            };
            parts[i] = Some(Part {
                rows: w.dims().0,
                bytes,
            });
            columns[i] = Some(Columns(out.as_mut_ptr(), w.dims().0));
        }
        let parts = &parts[..mats.len()];
        let blocks = k / QK;
        let refine = mats.iter().any(|w| w.format.is_some_and(Format::refines));
        xq.quantize(x, m, refine);
        let grouped =
            |b: &PartBytes| matches!(b, PartBytes::Interleaved(_) | PartBytes::RowGroups(..));
        let interleaved = |p: &Option<Part>| p.as_ref().is_some_and(|p| grouped(&p.bytes));
        if parts.iter().any(interleaved) {
            xq.tile(m);
        }
        let input = &*xq;
        let xq = &input.blocks[..];

        let rows = |p: &Option<Part>| p.as_ref().map_or(0, |p| p.rows);
        let total_rows: usize = parts.iter().map(rows).sum();
        // Whole groups of 8 rows per task, for the interleaved layout.
        let rows_per_task = (total_rows / (rayon::current_num_threads() * 4))
            .clamp(1, 512)
            .next_multiple_of(interleaved::ROWS);
        let tasks_of = |p: &Option<Part>| rows(p).div_ceil(rows_per_task);
        let tasks: usize = parts.iter().map(tasks_of).sum();
        #[cfg(target_arch = "x86_64")]
        let use_panels = m >= PANEL_MIN_ROWS && kernel.has_avx2();
        #[cfg(target_arch = "x86_64")]
        let any_rows = (parts.iter().flatten()).any(|p| matches!(p.bytes, PartBytes::Rows(..)));
        let xp = match use_panels && any_rows {
            true => panels(xq, m, blocks),
            false => Vec::new(),
        };
        // Each task owns output columns r0..r1 of one matrix (rows of its weight), for all m.
        (0..tasks).into_par_iter().for_each(|mut t| {
            let mut p = 0;
            while t >= tasks_of(&parts[p]) {
                t -= tasks_of(&parts[p]);
                p += 1;
            }
            let (Some(part), Some(out)) = (&parts[p], &columns[p]) else {
                unreachable!("every matrix of the group has a part and its columns")
            };
            let (r0, r1) = (t * rows_per_task, ((t + 1) * rows_per_task).min(part.rows));
            // SAFETY (every call below): the task owns output columns r0..r1, for all m rows.
            match &part.bytes {
                PartBytes::Interleaved(iw) => unsafe {
                    interleaved_task(kernel, iw, input, m, out, r0, r1)
                },
                #[cfg(target_arch = "x86_64")]
                PartBytes::RowGroups(format, data) => {
                    let row_bytes = k / format.block_len() * format.block_bytes();
                    unsafe {
                        row_groups_task(kernel, *format, data, row_bytes, input, m, out, r0, r1)
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                PartBytes::RowGroups(..) => unreachable!("row groups are x86 only"),
                PartBytes::Rows(format, data) => {
                    let format = *format;
                    let row_bytes = k / format.block_len() * format.block_bytes();
                    #[cfg(target_arch = "x86_64")]
                    if use_panels {
                        let rows = &data[r0 * row_bytes..r1 * row_bytes];
                        unsafe {
                            panel_gemm(kernel, format, rows, row_bytes, &xp, blocks, m, out, r0)
                        };
                    } else {
                        unsafe { rows_task(kernel, format, data, row_bytes, xq, m, out, r0, r1) };
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    unsafe {
                        rows_task(kernel, format, data, row_bytes, xq, m, out, r0, r1)
                    };
                }
            }
            // The refined blocks' residuals, added to what the blocks gave.
            unsafe { refine_task(kernel, &part.bytes, k, input, m, out, r0, r1) };
        });
        Ok(())
    }
}

impl GgufMatrix {
    /// The dense weight `[out, in]` that f32/f16 GGUF tensors are dequantized into once (MoE
    /// routers, which llama.cpp keeps in f32), for callers that multiply it themselves.
    pub fn dense(&self) -> Option<&Tensor> {
        match &self.storage {
            Layout::Rows {
                fallback: QMatMul::Tensor(t),
                ..
            } => Some(t),
            _ => None,
        }
    }
}
