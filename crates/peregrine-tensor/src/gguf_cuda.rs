//! GGUF Q4_K matrices times a few input rows on CUDA (`kernels/cuda/gguf_gemv.cu`): a warp
//! per output row reading the bf16/f16 input as it is, where candle first quantizes it to 8 bits
//! in a launch of its own. Correct (tests/dense_cuda.rs passes on an H100) but slower than
//! candle's MMVQ: an 8-layer 8B Q4_K_M decoded at 430-437 tok/s with it against 556 without
//! (docs/cuda.md); each 4-bit weight costs it a conversion and a scalar FMA where candle's
//! kernel multiplies four 8-bit pairs an instruction. Off unless `PEREGRINE_CUDA_GGUF_GEMV=1`,
//! as the starting point for a faster one.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, bail};
use half::{bf16, f16};

use crate::cuda_op::cuda_only_op;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gguf_gemv.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_gguf_gemv";
/// Input rows the kernel takes at once (its `MAX_ROWS`).
const MAX_ROWS: usize = 8;

/// Whether the kernel runs (`PEREGRINE_CUDA_GGUF_GEMV=1`, read once; off: slower than candle's).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PEREGRINE_CUDA_GGUF_GEMV").is_ok_and(|v| v == "1"))
}

/// `x: [.., in] · w[out, in]ᵀ` by the kernel when it applies (a Q4_K `w` on the GPU, `x` bf16
/// or f16 and contiguous there, at most 8 rows, `in` a multiple of 256); else `None`.
pub(crate) fn matmul(w: &QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    let (Some(&in_dim), Ok((out, w_in))) = (x.dims().last(), w.shape().dims2()) else {
        return Ok(None);
    };
    let m = x.elem_count() / in_dim.max(1);
    let applies = enabled()
        && x.device().is_cuda()
        && w.device().same_device(x.device())
        && w.dtype() == GgmlDType::Q4K
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w_in == in_dim
        && in_dim.is_multiple_of(256)
        && (1..=MAX_ROWS).contains(&m)
        && x.is_contiguous();
    if !applies {
        return Ok(None);
    }
    let op = Q4kGemv {
        w: w.device_ptr()? as u64,
        out,
        m,
    };
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("checked above") = out;
    Ok(Some(x.apply_op1_no_bwd(&op)?.reshape(dims)?))
}

struct Q4kGemv {
    /// The weights' device address (the matrix outlives the launch: its owner calls `matmul`).
    w: u64,
    out: usize,
    m: usize,
}

impl Q4kGemv {
    fn run<T: CudaDType + DeviceRepr>(&self, x: &CudaStorage, xl: &Layout) -> Result<CudaStorage> {
        let in_dim = *xl.dims().last().expect("rows of a matrix");
        // 16-byte vector loads: every row must start on a 16-byte boundary.
        if !xl.start_offset().is_multiple_of(8) {
            bail!("q4k-gemv: rows not 16-byte aligned");
        }
        let dev = &x.device;
        let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
        let name = match x.dtype() {
            DType::BF16 => "q4k_gemv_bf16",
            _ => "q4k_gemv_f16",
        };
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        // SAFETY: every element is written by the kernel below.
        let y = unsafe { dev.alloc::<T>(self.m * self.out)? };
        let int = |n: usize| {
            i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("q4k-gemv: {n}")))
        };
        let (m, o, i) = (int(self.m)?, int(self.out)?, int(in_dim)?);
        // A warp per output row, 8 rows a block.
        let cfg = LaunchConfig {
            grid_dim: (self.out.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = func.builder();
        launch.arg(&self.w).arg(&xs).arg(&y).arg(&m).arg(&o).arg(&i);
        // SAFETY: the kernel's arguments, in its order and types (the weights' address as a
        // 64-bit word); `matmul` checked the shapes and the format.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }
}

impl CustomOp1 for Q4kGemv {
    cuda_only_op!("q4k-gemv", a);

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        let y = match x.dtype() {
            DType::BF16 => self.run::<bf16>(x, xl)?,
            DType::F16 => self.run::<f16>(x, xl)?,
            other => bail!("q4k-gemv: {other:?} is not supported"),
        };
        Ok((y, Shape::from((self.m, self.out))))
    }
}

/// Columns of a quantized input row are padded to this (candle's `MATRIX_ROW_PADDING`).
const ROW_PADDING: usize = 512;
/// Bytes of one 8-bit input block of 32 values (candle's `block_q8_1`: two halves, 32 bytes).
const Q8_1_BYTES: usize = 36;

/// Whether [`matmul_group`] runs (`PEREGRINE_CUDA_MMVQ_GROUP=1`, read once; off until its test
/// and its speed have been seen on a GPU: written after the session's device time ran out).
fn group_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PEREGRINE_CUDA_MMVQ_GROUP").is_ok_and(|v| v == "1"))
}

/// One MMVQ launcher of candle's kernels (the same for every format and input type).
type Launcher = unsafe extern "C" fn(
    *const std::ffi::c_void,
    *const std::ffi::c_void,
    *mut std::ffi::c_void,
    i32,
    i32,
    i32,
    i32,
    i32,
    *mut std::ffi::c_void,
);

/// candle's MMVQ kernel for weights of `format` and inputs of `dtype`.
fn launcher(format: GgmlDType, dtype: DType) -> Option<Launcher> {
    use GgmlDType as G;
    use candle_kernels::ffi as k;
    let bf16 = dtype == DType::BF16;
    Some(match (format, bf16) {
        (G::Q4_0, true) => k::launch_mmvq_gguf_q4_0_bf16_plain,
        (G::Q4_1, true) => k::launch_mmvq_gguf_q4_1_bf16_plain,
        (G::Q5_0, true) => k::launch_mmvq_gguf_q5_0_bf16_plain,
        (G::Q5_1, true) => k::launch_mmvq_gguf_q5_1_bf16_plain,
        (G::Q8_0, true) => k::launch_mmvq_gguf_q8_0_bf16_plain,
        (G::Q2K, true) => k::launch_mmvq_gguf_q2_k_bf16_plain,
        (G::Q3K, true) => k::launch_mmvq_gguf_q3_k_bf16_plain,
        (G::Q4K, true) => k::launch_mmvq_gguf_q4_k_bf16_plain,
        (G::Q5K, true) => k::launch_mmvq_gguf_q5_k_bf16_plain,
        (G::Q6K, true) => k::launch_mmvq_gguf_q6_k_bf16_plain,
        (G::Q4_0, false) => k::launch_mmvq_gguf_q4_0_f16_plain,
        (G::Q4_1, false) => k::launch_mmvq_gguf_q4_1_f16_plain,
        (G::Q5_0, false) => k::launch_mmvq_gguf_q5_0_f16_plain,
        (G::Q5_1, false) => k::launch_mmvq_gguf_q5_1_f16_plain,
        (G::Q8_0, false) => k::launch_mmvq_gguf_q8_0_f16_plain,
        (G::Q2K, false) => k::launch_mmvq_gguf_q2_k_f16_plain,
        (G::Q3K, false) => k::launch_mmvq_gguf_q3_k_f16_plain,
        (G::Q4K, false) => k::launch_mmvq_gguf_q4_k_f16_plain,
        (G::Q5K, false) => k::launch_mmvq_gguf_q5_k_f16_plain,
        (G::Q6K, false) => k::launch_mmvq_gguf_q6_k_f16_plain,
        _ => return None,
    })
}

/// `x: [.., in]` times each of `ws` (GGUF matrices on the GPU, `in` columns each) through
/// candle's MMVQ kernels with the input quantized to 8 bits once for all of them, where candle
/// quantizes it again for each (q/k/v: three quantizations a layer become one, gate/up two);
/// the same kernels and the same 8-bit input, so the same bits. `None` where it does not
/// apply: not 1-8 rows of bf16/f16 on the GPU, fewer than two matrices, a format MMVQ lacks.
pub(crate) fn matmul_group(ws: &[&QTensor], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
    let Some(&k) = x.dims().last() else {
        return Ok(None);
    };
    let rows = x.elem_count() / k.max(1);
    let applies = group_enabled()
        && ws.len() > 1
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && (1..=MAX_ROWS).contains(&rows)
        && x.is_contiguous()
        && ws.iter().all(|w| {
            matches!(w.shape().dims2(), Ok((_, c)) if c == k)
                && w.device().same_device(x.device())
                && launcher(w.dtype(), x.dtype()).is_some()
        });
    if !applies {
        return Ok(None);
    }
    let dev = x.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let stream_ptr = stream.cu_stream() as *mut std::ffi::c_void;
    let padded = k.div_ceil(ROW_PADDING) * ROW_PADDING;
    let int =
        |n: usize| i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("mmvq: {n}")));
    // SAFETY: written by the quantize kernel below before any MMVQ kernel reads it (the
    // padding columns too: it writes zeros there).
    let scratch = unsafe { dev.alloc::<u8>(rows * padded / 32 * Q8_1_BYTES)? };
    let (storage, layout) = x.storage_and_layout();
    let x_ptr = crate::kv_append_cuda::address(&storage, layout, &stream)?;
    let (scratch_ptr, _guard) = scratch.device_ptr(&stream);
    // SAFETY: candle's launchers with the arguments its own MMVQ path passes (fast_mmvq.rs):
    // `x` is `rows` contiguous rows of `k` values, the scratch holds `rows` padded 8-bit rows.
    unsafe {
        let quantize = match x.dtype() {
            DType::BF16 => candle_kernels::ffi::launch_mmvq_gguf_quantize_q8_1_bf16,
            _ => candle_kernels::ffi::launch_mmvq_gguf_quantize_q8_1_f16,
        };
        quantize(
            x_ptr as *const std::ffi::c_void,
            scratch_ptr as *mut std::ffi::c_void,
            int(k)?,
            int(padded)?,
            int(rows)?,
            stream_ptr,
        );
    }
    let mut ys = Vec::with_capacity(ws.len());
    for w in ws {
        let (out, _) = w.shape().dims2()?;
        let launch = launcher(w.dtype(), x.dtype()).expect("checked above");
        let y = match x.dtype() {
            DType::BF16 => mmvq::<bf16>(&dev, launch, (w, out), (scratch_ptr, k, rows))?,
            _ => mmvq::<f16>(&dev, launch, (w, out), (scratch_ptr, k, rows))?,
        };
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("checked above") = out;
        let none = candle_core::op::BackpropOp::none();
        ys.push(Tensor::from_storage(
            candle_core::Storage::Cuda(y),
            dims,
            none,
            false,
        ));
    }
    drop(storage);
    Ok(Some(ys))
}

/// One MMVQ launch: `w` (`out` rows) times the quantized input at `scratch` (`rows` rows of
/// `k` values) into a new `[rows, out]` buffer of `T`.
fn mmvq<T: CudaDType + DeviceRepr>(
    dev: &candle_core::CudaDevice,
    launch: Launcher,
    (w, out): (&QTensor, usize),
    (scratch, k, rows): (u64, usize, usize),
) -> Result<CudaStorage> {
    let stream = dev.cuda_stream();
    let int =
        |n: usize| i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("mmvq: {n}")));
    // SAFETY: every element is written by the kernel below.
    let y = unsafe { dev.alloc::<T>(rows * out)? };
    let (y_ptr, _guard) = y.device_ptr(&stream);
    let padded = k.div_ceil(ROW_PADDING) * ROW_PADDING;
    // SAFETY: as candle's MMVQ path calls it: weights of `out` rows of `k` columns, the
    // quantized input's row stride in blocks, the output's row stride in elements.
    unsafe {
        launch(
            w.device_ptr()? as *const std::ffi::c_void,
            scratch as *const std::ffi::c_void,
            y_ptr as *mut std::ffi::c_void,
            int(k)?,
            int(out)?,
            int(padded / 32)?,
            int(out)?,
            int(rows)?,
            stream.cu_stream() as *mut std::ffi::c_void,
        );
    }
    drop(_guard);
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}
