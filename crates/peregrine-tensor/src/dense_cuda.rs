//! Dense bf16/f16 matrices times a few input rows on CUDA (`kernels/cuda/dense_gemv.cu`): the
//! decode step's projections, where cuBLAS runs split-K GEMMs plus a reduce kernel each; a warp
//! per output row streams the weights once instead. Larger batches keep cuBLAS.
//!
//! It takes inputs of up to `PEREGRINE_CUDA_GEMV_ROWS` rows (default 1, at most 8; 0: never):
//! one row measured 1.29× cuBLAS's decode on an 8B model (docs/cuda.md); at 8 rows each lane
//! reads 8 input vectors per weight vector and batched decode was not compared with cuBLAS yet.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};
use half::{bf16, f16};

use crate::cuda_op::cuda_only_op;

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

/// `x: [.., in] · w[out, in]ᵀ` by the GEMV kernel when it applies (both on a CUDA device in
/// bf16 or f16, at most `max_rows()` rows, contiguous, `in` a multiple of 8); else `None`.
pub(crate) fn matmul(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let (Some(&in_dim), [out, w_in]) = (x.dims().last(), w.dims()) else {
        return Ok(None);
    };
    let m = x.elem_count() / in_dim.max(1);
    let applies = x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && *w_in == in_dim
        && in_dim.is_multiple_of(8)
        && (1..=max_rows()).contains(&m)
        && x.is_contiguous()
        && w.is_contiguous();
    if !applies {
        return Ok(None);
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("checked above") = *out;
    let y = x.apply_op2_no_bwd(w, &Gemv { m })?;
    Ok(Some(y.reshape(dims)?))
}

struct Gemv {
    m: usize,
}

impl Gemv {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let (out, in_dim) = wl.shape().dims2()?;
        // 16-byte vector loads: every row must start on a 16-byte boundary.
        if xl.start_offset() % 8 != 0 || wl.start_offset() % 8 != 0 {
            bail!("dense-gemv: rows not 16-byte aligned");
        }
        let dev = &x.device;
        let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
        let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
        let name = match x.dtype() {
            DType::BF16 => "dense_gemv_bf16",
            _ => "dense_gemv_f16",
        };
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        // SAFETY: every element is written by the kernel below.
        let y = unsafe { dev.alloc::<T>(self.m * out)? };
        let int = |n| crate::cuda_op::int("dense-gemv", n);
        let (m, o, i) = (int(self.m)?, int(out)?, int(in_dim)?);
        // A warp per output row, 8 rows a block.
        let cfg = LaunchConfig {
            grid_dim: (out.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = func.builder();
        launch.arg(&xs).arg(&ws).arg(&y).arg(&m).arg(&o).arg(&i);
        // SAFETY: the kernel's arguments, in its order and types; shapes checked by `matmul`.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }
}

impl CustomOp2 for Gemv {
    cuda_only_op!("dense-gemv", a, b);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = match x.dtype() {
            DType::BF16 => self.run::<bf16>((x, xl), (w, wl))?,
            DType::F16 => self.run::<f16>((x, xl), (w, wl))?,
            other => bail!("dense-gemv: {other:?} is not supported"),
        };
        Ok((y, Shape::from((self.m, wl.shape().dims()[0]))))
    }
}
