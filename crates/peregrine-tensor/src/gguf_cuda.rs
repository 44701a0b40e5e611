//! GGUF matrices times a few input rows on CUDA through 8-bit inputs: the input quantized to
//! candle's `block_q8_1` once for a group of matrices of the same input width (q/k/v,
//! gate/up), then candle's MMVQ kernel per matrix, or ours for Q4_K (`kernels/cuda/gguf_gemv.cu`:
//! a warp per four output rows, 16-byte loads, `PEREGRINE_CUDA_GGUF_GEMV`).

use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CudaStorage, DType, Result, Tensor};
use half::{bf16, f16};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gguf_gemv.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_gguf_gemv";
/// Input rows the kernels take at once (our kernel's `MAX_ROWS`; candle's MMVQ takes 8 too).
const MAX_ROWS: usize = 8;

/// The most input rows for which our Q4_K kernel replaces candle's MMVQ for Q4_K matrices
/// (`PEREGRINE_CUDA_GGUF_GEMV`, read once): `1`, every row count up to 8; unset or else, none.
/// Off: on an H100 the 32-layer 8B Q4_K_M decoded 174.0 tok/s with it against MMVQ's 198.8 at
/// batch 1 (its kernel 17.9 against 13.3 µs a matrix), and 8 streams were 6 % slower
/// (docs/cuda.md).
fn ours_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let on = || std::env::var("PEREGRINE_CUDA_GGUF_GEMV").is_ok_and(|v| v == "1");
    *ROWS.get_or_init(|| if on() { MAX_ROWS } else { 0 })
}

/// Columns of a quantized input row are padded to this (candle's `MATRIX_ROW_PADDING`).
const ROW_PADDING: usize = 512;
/// Bytes of one 8-bit input block of 32 values (candle's `block_q8_1`: two halves, 32 bytes).
const Q8_1_BYTES: usize = 36;

/// 8-bit input blocks in a quantized row of `k` values (padded to [`ROW_PADDING`]).
fn q8_row_blocks(k: usize) -> usize {
    k.div_ceil(ROW_PADDING) * ROW_PADDING / 32
}

fn int(n: usize) -> Result<i32> {
    crate::cuda_op::int("gguf matmul", n)
}

/// Whether [`matmul_group`] runs (on unless `PEREGRINE_CUDA_MMVQ_GROUP=0`, read once): the
/// 8B Q4_K_M decoded 146.6 → 156.1 tok/s at batch 1 and 8 streams' bench 1,984 → 2,213 on 8
/// layers (an H100, docs/cuda.md).
fn group_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PEREGRINE_CUDA_MMVQ_GROUP").map_or(true, |v| v != "0"))
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
/// candle's MMVQ kernels (ours for Q4_K up to [`ours_rows`] rows) with the input quantized to 8
/// bits once for all of them, where candle quantizes it again for each (q/k/v: three
/// quantizations a layer become one, gate/up two); candle's kernels over the same 8-bit input
/// give the same bits. `None` where it does not apply: not 1-8 rows of bf16/f16 on the GPU, a
/// format MMVQ lacks, or neither switch on for these matrices (a group needs two of them
/// unless one is Q4_K for our kernel).
pub(crate) fn matmul_group(ws: &[&QTensor], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
    let Some(&k) = x.dims().last() else {
        return Ok(None);
    };
    let rows = x.elem_count() / k.max(1);
    let ours = |w: &&QTensor| rows <= ours_rows() && w.dtype() == GgmlDType::Q4K && k % 256 == 0;
    let wanted = (group_enabled() && ws.len() > 1) || ws.iter().any(ours);
    let applies = wanted
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
    let padded = q8_row_blocks(k) * 32;
    // SAFETY: written by the quantize kernel below before any MMVQ kernel reads it (the
    // padding columns too: it writes zeros there).
    let scratch = unsafe { dev.alloc::<u8>(rows * q8_row_blocks(k) * Q8_1_BYTES)? };
    let (storage, layout) = x.storage_and_layout();
    let x_ptr = crate::cuda_op::address(&storage, layout, &stream)?;
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
        let input = (scratch_ptr, k, rows);
        let y = match (x.dtype(), ours(w)) {
            (DType::BF16, true) => q4k_q8::<bf16>(&dev, (w, out), input)?,
            (_, true) => q4k_q8::<f16>(&dev, (w, out), input)?,
            (DType::BF16, false) => mmvq::<bf16>(&dev, launch, (w, out), input)?,
            _ => mmvq::<f16>(&dev, launch, (w, out), input)?,
        };
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("checked above") = out;
        ys.push(crate::cuda_op::tensor(y, dims));
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
    // SAFETY: every element is written by the kernel below.
    let y = unsafe { dev.alloc::<T>(rows * out)? };
    let (y_ptr, _guard) = y.device_ptr(&stream);
    // SAFETY: as candle's MMVQ path calls it: weights of `out` rows of `k` columns, the
    // quantized input's row stride in blocks, the output's row stride in elements.
    unsafe {
        launch(
            w.device_ptr()? as *const std::ffi::c_void,
            scratch as *const std::ffi::c_void,
            y_ptr as *mut std::ffi::c_void,
            int(k)?,
            int(out)?,
            int(q8_row_blocks(k))?,
            int(out)?,
            int(rows)?,
            stream.cu_stream() as *mut std::ffi::c_void,
        );
    }
    drop(_guard);
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// [`mmvq`] through our Q4_K kernel (`kernels/cuda/gguf_gemv.cu`): a warp per output row for
/// one input row (8 output rows a block), else per four output rows (32 a block).
fn q4k_q8<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    dev: &candle_core::CudaDevice,
    (w, out): (&QTensor, usize),
    (scratch, k, rows): (u64, usize, usize),
) -> Result<CudaStorage> {
    let name = match T::DTYPE {
        DType::BF16 => "q4k_q8_gemv_bf16",
        _ => "q4k_q8_gemv_f16",
    };
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    // SAFETY: every element is written by the kernel below.
    let y = unsafe { dev.alloc::<T>(rows * out)? };
    let (m, o, i) = (int(rows)?, int(out)?, int(k)?);
    let q8_row = int(q8_row_blocks(k))?;
    let w_ptr = w.device_ptr()? as u64;
    // Eight warps a block, a warp per output row for one input row, else per four rows.
    let rows_per_block = if rows == 1 { 8 } else { 32 };
    let cfg = LaunchConfig {
        grid_dim: (out.div_ceil(rows_per_block) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = func.builder();
    launch.arg(&w_ptr).arg(&scratch).arg(&y);
    launch.arg(&m).arg(&o).arg(&i).arg(&q8_row);
    // SAFETY: the kernel's arguments, in its order and types (addresses as 64-bit words): a
    // Q4_K matrix of `out` rows of `k` columns, `rows` quantized input rows.
    unsafe { launch.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}
