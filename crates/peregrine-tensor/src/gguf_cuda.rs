//! GGUF Q4_K matrices times a few input rows on CUDA (`kernels/cuda/gguf_gemv.cu`): a warp
//! per output row reading the bf16/f16 input as it is, where candle first quantizes it to 8 bits
//! in a launch of its own. Correct (tests/dense_cuda.rs passes on an H100) but slower than
//! candle's MMVQ: an 8-layer 8B Q4_K_M decoded at 430-437 tok/s with it against 556 without
//! (docs/cuda.md); each 4-bit weight costs it a conversion and a scalar FMA where candle's
//! kernel multiplies four 8-bit pairs an instruction. Off unless `PEREGRINE_CUDA_GGUF_GEMV=1`,
//! as the starting point for a faster one.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
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
