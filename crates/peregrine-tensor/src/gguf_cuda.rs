//! GGUF matrices times a few input rows on CUDA through 8-bit inputs, the input quantized once
//! for a group of matrices of the same input width (q/k/v, gate/up): our kernel
//! (`kernels/cuda/gguf_gemv.cu`) for Q4_K and Q6_K, all of a group's in one launch, over the
//! input split into int8 codes and per-32 scales; candle's MMVQ per matrix for other formats,
//! over candle's `block_q8_1`.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
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
/// Matrices one launch of our kernel takes (q/k/v is three).
const MAX_GROUP: usize = 3;

/// Which GGUF formats our kernel takes from candle's MMVQ (`PEREGRINE_CUDA_GGUF_GEMV`, read
/// once): `1`, Q4_K and Q6_K; `q4k`, Q4_K only; unset or else, none (not yet measured on a GPU
/// against candle's: docs/cuda.md).
fn ours_formats() -> &'static [GgmlDType] {
    static FORMATS: std::sync::OnceLock<&'static [GgmlDType]> = std::sync::OnceLock::new();
    let pick = || match std::env::var("PEREGRINE_CUDA_GGUF_GEMV").as_deref() {
        Ok("1") => &[GgmlDType::Q4K, GgmlDType::Q6K][..],
        Ok("q4k") => &[GgmlDType::Q4K],
        _ => &[],
    };
    FORMATS.get_or_init(pick)
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

/// `x: [.., in]` times each of `ws` (GGUF matrices on the GPU, `in` columns each) with the input
/// quantized to 8 bits once per kernel family, where candle quantizes it again for each matrix
/// (q/k/v: three quantizations a layer become one, gate/up one): our kernel for the formats of
/// [`ours_formats`] (one launch for all of a group's), candle's MMVQ per matrix for the rest;
/// candle's kernels over the same 8-bit input give the same bits. `None` where it does not
/// apply: not 1-8 rows of bf16/f16 on the GPU, a format MMVQ lacks, or neither switch on for
/// these matrices (a group needs two of them unless one is for our kernel).
pub(crate) fn matmul_group(ws: &[&QTensor], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
    let Some(&k) = x.dims().last() else {
        return Ok(None);
    };
    let rows = x.elem_count() / k.max(1);
    let ours = |w: &QTensor| ours_formats().contains(&w.dtype()) && k % 256 == 0;
    let wanted = (group_enabled() && ws.len() > 1) || ws.iter().any(|w| ours(w));
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
    let (storage, layout) = x.storage_and_layout();
    let x_ptr = crate::cuda_op::address(&storage, layout, &stream)?;
    let input = Input {
        x: x_ptr,
        dtype: x.dtype(),
        k,
        rows,
    };
    let (mine, theirs): (Vec<usize>, Vec<usize>) = (0..ws.len()).partition(|&i| ours(ws[i]));
    let mut ys: Vec<Option<CudaStorage>> = (0..ws.len()).map(|_| None).collect();
    if !mine.is_empty() {
        let split = split_q8(&dev, input)?;
        for chunk in mine.chunks(MAX_GROUP) {
            let matrices: Vec<&QTensor> = chunk.iter().map(|&i| ws[i]).collect();
            let outs = match x.dtype() {
                DType::BF16 => ours_group::<bf16>(&dev, &matrices, &split, input)?,
                _ => ours_group::<f16>(&dev, &matrices, &split, input)?,
            };
            for (&i, y) in chunk.iter().zip(outs) {
                ys[i] = Some(y);
            }
        }
    }
    if !theirs.is_empty() {
        let scratch = quantize_q8_1(&dev, input)?;
        let (scratch_ptr, _guard) = scratch.device_ptr(&stream);
        for &i in &theirs {
            let (out, _) = ws[i].shape().dims2()?;
            let launch = launcher(ws[i].dtype(), x.dtype()).expect("checked above");
            let q = (scratch_ptr, k, rows);
            ys[i] = Some(match x.dtype() {
                DType::BF16 => mmvq::<bf16>(&dev, launch, (ws[i], out), q)?,
                _ => mmvq::<f16>(&dev, launch, (ws[i], out), q)?,
            });
        }
    }
    drop(storage);
    let mut out = Vec::with_capacity(ws.len());
    for (w, y) in ws.iter().zip(ys) {
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("checked above") = w.shape().dims2()?.0;
        out.push(crate::cuda_op::tensor(y.expect("every matrix ran"), dims));
    }
    Ok(Some(out))
}

/// A group's input: `rows` contiguous rows of `k` values of `dtype` at device address `x`.
#[derive(Clone, Copy)]
struct Input {
    x: u64,
    dtype: DType,
    k: usize,
    rows: usize,
}

/// The input as candle's `block_q8_1` rows (padded to [`ROW_PADDING`]), for its MMVQ kernels.
fn quantize_q8_1(dev: &candle_core::CudaDevice, i: Input) -> Result<CudaSlice<u8>> {
    let stream = dev.cuda_stream();
    // SAFETY: written by the quantize kernel below before any MMVQ kernel reads it (the
    // padding columns too: it writes zeros there).
    let scratch = unsafe { dev.alloc::<u8>(i.rows * q8_row_blocks(i.k) * Q8_1_BYTES)? };
    let (scratch_ptr, guard) = scratch.device_ptr(&stream);
    let quantize = match i.dtype {
        DType::BF16 => candle_kernels::ffi::launch_mmvq_gguf_quantize_q8_1_bf16,
        _ => candle_kernels::ffi::launch_mmvq_gguf_quantize_q8_1_f16,
    };
    // SAFETY: candle's launcher with the arguments its own MMVQ path passes (fast_mmvq.rs): `x`
    // is `rows` contiguous rows of `k` values, the scratch holds `rows` padded 8-bit rows.
    unsafe {
        quantize(
            i.x as *const std::ffi::c_void,
            scratch_ptr as *mut std::ffi::c_void,
            int(i.k)?,
            int(q8_row_blocks(i.k) * 32)?,
            int(i.rows)?,
            stream.cu_stream() as *mut std::ffi::c_void,
        );
    }
    drop(guard);
    Ok(scratch)
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

/// The input split for our kernel (`q8_split_*`): `rows · k` int8 codes (a multiple of
/// 256 bytes), then a float pair (d8, d8 · Σcodes) per 32 inputs.
fn split_q8(dev: &candle_core::CudaDevice, i: Input) -> Result<CudaSlice<u8>> {
    let name = match i.dtype {
        DType::BF16 => "q8_split_bf16",
        _ => "q8_split_f16",
    };
    let stream = dev.cuda_stream();
    let codes_bytes = i.rows * i.k;
    // SAFETY: every byte is written by the kernel below before a GEMV reads it.
    let scratch = unsafe { dev.alloc::<u8>(codes_bytes + codes_bytes / 32 * 8)? };
    let (codes, guard) = scratch.device_ptr(&stream);
    let ds = codes + codes_bytes as u64;
    let blocks = int(codes_bytes / 32)?;
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    // A warp per 32 inputs, 8 a block.
    let cfg = LaunchConfig {
        grid_dim: ((codes_bytes / 32).div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = func.builder();
    launch.arg(&i.x).arg(&codes).arg(&ds).arg(&blocks);
    // SAFETY: the kernel's arguments in its order (addresses as 64-bit words): `rows · k`
    // contiguous inputs, a scratch for their codes and scales.
    unsafe { launch.launch(cfg) }.w()?;
    drop(guard);
    Ok(scratch)
}

/// Up to [`MAX_GROUP`] Q4_K / Q6_K matrices times the split input ([`split_q8`]) in one launch
/// of our kernel (`kernels/cuda/gguf_gemv.cu`: a warp per output row, 8 a block), each into a
/// new `[rows, out]` buffer of `T`.
fn ours_group<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    dev: &candle_core::CudaDevice,
    ws: &[&QTensor],
    split: &CudaSlice<u8>,
    i: Input,
) -> Result<Vec<CudaStorage>> {
    let name = match T::DTYPE {
        DType::BF16 => "gguf_gemv_group_bf16",
        _ => "gguf_gemv_group_f16",
    };
    let stream = dev.cuda_stream();
    let (codes, guard) = split.device_ptr(&stream);
    let ds = codes + (i.rows * i.k) as u64;
    let mut w = [0u64; MAX_GROUP];
    let mut outs = [0i32; MAX_GROUP];
    let mut ys = Vec::with_capacity(ws.len());
    let mut y = [0u64; MAX_GROUP];
    let mut q6k = 0i32;
    for (j, q) in ws.iter().enumerate() {
        if q.dtype() == GgmlDType::Q6K {
            q6k |= 1 << j;
        }
        let (out, _) = q.shape().dims2()?;
        w[j] = q.device_ptr()? as u64;
        outs[j] = int(out)?;
        // SAFETY: every element is written by the kernel below.
        let buf = unsafe { dev.alloc::<T>(i.rows * out)? };
        y[j] = buf.device_ptr(&stream).0;
        ys.push(buf);
    }
    let total: usize = outs.iter().map(|&o| o as usize).sum();
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (m, k) = (int(i.rows)?, int(i.k)?);
    let mut launch = func.builder();
    launch.arg(&w[0]).arg(&w[1]).arg(&w[2]).arg(&codes).arg(&ds);
    launch.arg(&y[0]).arg(&y[1]).arg(&y[2]);
    launch
        .arg(&outs[0])
        .arg(&outs[1])
        .arg(&outs[2])
        .arg(&q6k)
        .arg(&m)
        .arg(&k);
    // SAFETY: the kernel's arguments in its order and types (addresses as 64-bit words): Q4_K
    // or Q6_K (bit j of `q6k`) matrices of `outs[j]` rows of `k` columns (unused ones have no rows, so their null
    // addresses are never read), the split input of `rows` rows.
    unsafe { launch.launch(cfg) }.w()?;
    drop(guard);
    Ok((ys.into_iter())
        .map(|y| CudaStorage::wrap_cuda_slice(y, dev.clone()))
        .collect())
}
