//! Dense bf16/f16 matrices times a few input rows on CUDA (`kernels/cuda/dense_gemv.cu`): the
//! decode step's projections, where cuBLAS runs split-K GEMMs plus a reduce kernel each; a warp
//! per output row streams the weights once instead. Larger batches keep cuBLAS.
//!
//! It takes inputs of up to `PEREGRINE_CUDA_GEMV_ROWS` rows (default 1, at most 8; 0: never,
//! cuBLAS for all): one row decoded an 8B f16 model 1.12× faster than cuBLAS on an H100
//! (docs/cuda.md); at 8 rows each lane reads 8 input vectors per weight vector and batched
//! decode was not compared with cuBLAS yet. Matrices that read the same input (q/k/v,
//! gate/up) go in one launch ([`matmul_group`]).

use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Result, Tensor};
use half::{bf16, f16};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/dense_gemv.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_dense_gemv";

/// Input rows the kernel takes at once (its `MAX_ROWS`).
const MAX_ROWS: usize = 8;

/// The most input rows the kernel takes: `PEREGRINE_CUDA_GEMV_ROWS` (read once), default 1.
fn max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        let asked = std::env::var("PEREGRINE_CUDA_GEMV_ROWS").ok();
        asked
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
            .min(MAX_ROWS)
    })
}

/// The most matrices one [`matmul_group`] launch takes (the kernel's three).
const MAX_GROUP: usize = 3;

/// The input rows of `x` when the GEMV takes `x · wᵀ` (both on a CUDA device in bf16 or f16,
/// at most `max_rows()` rows, contiguous, `in` a multiple of 8, rows 16-byte aligned).
fn gemv_rows(x: &Tensor, w: &Tensor) -> Option<usize> {
    let (Some(&in_dim), [_, w_in]) = (x.dims().last(), w.dims()) else {
        return None;
    };
    let m = x.elem_count() / in_dim.max(1);
    let aligned = |t: &Tensor| t.layout().start_offset().is_multiple_of(8);
    let applies = x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && w.device().same_device(x.device())
        && *w_in == in_dim
        && in_dim.is_multiple_of(8)
        && (1..=max_rows()).contains(&m)
        && x.is_contiguous()
        && w.is_contiguous()
        && aligned(x)
        && aligned(w);
    applies.then_some(m)
}

/// `x: [.., in] · w[out, in]ᵀ` by the GEMV kernel when it applies ([`gemv_rows`]); else `None`.
pub(crate) fn matmul(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    Ok(matmul_group(x, &[w])?.and_then(|mut ys| ys.pop()))
}

/// `x · wᵀ` for each of `ws` (1-3 matrices of one input width) in one launch: the q/k/v or
/// gate/up projections of a decode step. `None` where the GEMV does not apply to all of them.
pub(crate) fn matmul_group(x: &Tensor, ws: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let rows = ws.first().and_then(|w| gemv_rows(x, w));
    let applies = (1..=MAX_GROUP).contains(&ws.len()) && ws.iter().all(|w| gemv_rows(x, w) == rows);
    let (Some(m), true) = (rows, applies) else {
        return Ok(None);
    };
    let dev = x.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let in_dim = *x.dims().last().expect("checked by gemv_rows");
    let (xs, xl) = x.storage_and_layout();
    let x_ptr = crate::cuda_op::address(&xs, xl, &stream)?;
    let mut w_ptr = [0u64; MAX_GROUP];
    let mut outs = [0usize; MAX_GROUP];
    for (i, w) in ws.iter().enumerate() {
        let (s, l) = w.storage_and_layout();
        w_ptr[i] = crate::cuda_op::address(&s, l, &stream)?;
        outs[i] = w.dims()[0];
    }
    let ys: Vec<CudaStorage> = match x.dtype() {
        DType::BF16 => launch_group::<bf16>(&dev, (x_ptr, m, in_dim), &w_ptr, &outs[..ws.len()])?,
        _ => launch_group::<f16>(&dev, (x_ptr, m, in_dim), &w_ptr, &outs[..ws.len()])?,
    };
    drop(xs);
    let shape = |out: usize| {
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("checked by gemv_rows") = out;
        dims
    };
    Ok(Some(
        (ys.into_iter().zip(outs))
            .map(|(y, out)| crate::cuda_op::tensor(y, shape(out)))
            .collect(),
    ))
}

/// One launch of the group kernel: `m` rows of `in_dim` at `x` times the matrices at `w`
/// (`outs[i]` rows each), into a new `[m, outs[i]]` buffer per matrix.
fn launch_group<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    dev: &candle_core::CudaDevice,
    (x, m, in_dim): (u64, usize, usize),
    w: &[u64; MAX_GROUP],
    outs: &[usize],
) -> Result<Vec<CudaStorage>> {
    let name = match T::DTYPE {
        DType::BF16 => "dense_gemv_group_bf16",
        _ => "dense_gemv_group_f16",
    };
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    // SAFETY: every element is written by the kernel below.
    let ys = (outs.iter())
        .map(|&out| unsafe { dev.alloc::<T>(m * out) })
        .collect::<Result<Vec<_>>>()?;
    let int = |n| crate::cuda_op::int("dense-gemv", n);
    let mut out = [0i32; MAX_GROUP];
    for (o, &n) in out.iter_mut().zip(outs) {
        *o = int(n)?;
    }
    let (m_arg, in_arg) = (int(m)?, int(in_dim)?);
    let stream = dev.cuda_stream();
    let mut y_ptr = [0u64; MAX_GROUP];
    for (p, y) in y_ptr.iter_mut().zip(&ys) {
        *p = y.device_ptr(&stream).0;
    }
    // A warp per output row of all the matrices, 8 rows a block.
    let cfg = LaunchConfig {
        grid_dim: (outs.iter().sum::<usize>().div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = func.builder();
    launch.arg(&x).arg(&w[0]).arg(&w[1]).arg(&w[2]);
    launch.arg(&y_ptr[0]).arg(&y_ptr[1]).arg(&y_ptr[2]);
    launch
        .arg(&out[0])
        .arg(&out[1])
        .arg(&out[2])
        .arg(&m_arg)
        .arg(&in_arg);
    // SAFETY: the kernel's arguments, in its order and types (addresses as 64-bit words); the
    // unused matrices have no rows, so their null addresses are never read.
    unsafe { launch.launch(cfg) }.w()?;
    Ok((ys.into_iter())
        .map(|y| CudaStorage::wrap_cuda_slice(y, dev.clone()))
        .collect())
}
