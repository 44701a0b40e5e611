//! A decode step's element-wise chains fused on CUDA (`kernels/cuda/fused.cu`): the residual add
//! with the RMSNorm after it, and SiLU with the multiply by the up projection, one launch each
//! instead of two, for inputs of up to [`MAX_ROWS`] rows (decode; a 512-token prefill through
//! them measured slower, docs/cuda.md). `PEREGRINE_CUDA_FUSED=0` keeps candle's separate kernels
//! (to compare).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};
use half::{bf16, f16};

use crate::cuda_op::cuda_only_op;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_fused";

/// Whether the fused kernels run (`PEREGRINE_CUDA_FUSED`, read once; on unless `0`).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PEREGRINE_CUDA_FUSED").map_or(true, |v| v != "0"))
}

/// The most rows (all dimensions but the last) an input of the fused kernels has.
const MAX_ROWS: usize = 8;

/// Whether `ts` are contiguous CUDA tensors of one float type the kernels take, of at most
/// [`MAX_ROWS`] rows.
fn takes(ts: &[&Tensor]) -> bool {
    let dtype = ts[0].dtype();
    let rows = ts[0].elem_count() / ts[0].dims().last().copied().unwrap_or(1).max(1);
    enabled()
        && rows <= MAX_ROWS
        && matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
        && ts.iter().all(|t| {
            t.device().is_cuda()
                && t.dtype() == dtype
                && t.is_contiguous()
                && t.layout().start_offset() == 0
        })
}

fn int(n: usize) -> Result<i32> {
    crate::cuda_op::int("fused kernel", n)
}

/// `(x + y, rms_norm(x + y) · w)` over the last dimension in one launch, when `x` and `y` (same
/// shape) and `w` (`[cols]`) are contiguous CUDA tensors of one float type; else `None`.
pub(crate) fn add_rms_norm(
    x: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    let cols = x.dims().last().copied().unwrap_or(0);
    if !takes(&[x, y, w]) || x.shape() != y.shape() || w.dims() != [cols] || cols == 0 {
        return Ok(None);
    }
    let both = x.apply_op3_no_bwd(y, w, &AddRmsNorm { eps })?;
    let n = x.elem_count();
    let sum = both.narrow(0, 0, n)?.reshape(x.shape())?;
    let normed = both.narrow(0, n, n)?.reshape(x.shape())?;
    Ok(Some((sum, normed)))
}

/// `silu(gate) · up` in one launch, when both are contiguous CUDA tensors of one shape and
/// float type; else `None`.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    if !takes(&[gate, up]) || gate.shape() != up.shape() {
        return Ok(None);
    }
    let y = gate.apply_op2_no_bwd(up, &SiluMul)?;
    Ok(Some(y.reshape(gate.shape())?))
}

/// The kernel `{name}_{dtype}` of the module.
fn kernel_name(name: &str, dtype: DType) -> Result<&'static str> {
    Ok(match (name, dtype) {
        ("add_rmsnorm", DType::BF16) => "add_rmsnorm_bf16",
        ("add_rmsnorm", DType::F16) => "add_rmsnorm_f16",
        ("add_rmsnorm", DType::F32) => "add_rmsnorm_f32",
        ("silu_mul", DType::BF16) => "silu_mul_bf16",
        ("silu_mul", DType::F16) => "silu_mul_f16",
        ("silu_mul", DType::F32) => "silu_mul_f32",
        _ => bail!("fused kernel {name}: {dtype:?} is not supported"),
    })
}

struct AddRmsNorm {
    eps: f32,
}

impl AddRmsNorm {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        y: &CudaStorage,
        w: &CudaStorage,
    ) -> Result<CudaStorage> {
        let n = xl.shape().elem_count();
        let cols = xl.shape().dims().last().copied().unwrap_or(1);
        let rows = n / cols;
        let dev = &x.device;
        let func =
            dev.get_or_load_custom_func(kernel_name("add_rmsnorm", x.dtype())?, MODULE, PTX)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<T>(2 * n)? };
        let (xs, ys, ws) = (
            x.as_cuda_slice::<T>()?,
            y.as_cuda_slice::<T>()?,
            w.as_cuda_slice::<T>()?,
        );
        let (r, c) = (int(rows)?, int(cols)?);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (cols.next_multiple_of(32).min(1024) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = func.builder();
        launch
            .arg(xs)
            .arg(ys)
            .arg(ws)
            .arg(&out)
            .arg(&r)
            .arg(&c)
            .arg(&self.eps);
        // SAFETY: the kernel's arguments, in its order and types; shapes checked by the caller.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl CustomOp3 for AddRmsNorm {
    cuda_only_op!("add-rms-norm", a, b, c);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        y: &CudaStorage,
        _: &Layout,
        w: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = match x.dtype() {
            DType::BF16 => self.run::<bf16>((x, xl), y, w)?,
            DType::F16 => self.run::<f16>((x, xl), y, w)?,
            DType::F32 => self.run::<f32>((x, xl), y, w)?,
            other => bail!("add-rms-norm: {other:?} is not supported"),
        };
        Ok((out, Shape::from(2 * xl.shape().elem_count())))
    }
}

struct SiluMul;

impl SiluMul {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        (g, gl): (&CudaStorage, &Layout),
        u: &CudaStorage,
    ) -> Result<CudaStorage> {
        let n = gl.shape().elem_count();
        let dev = &g.device;
        let func = dev.get_or_load_custom_func(kernel_name("silu_mul", g.dtype())?, MODULE, PTX)?;
        // SAFETY: every element is written by the kernel below.
        let out = unsafe { dev.alloc::<T>(n)? };
        let (gs, us) = (g.as_cuda_slice::<T>()?, u.as_cuda_slice::<T>()?);
        let count = int(n)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = func.builder();
        launch.arg(gs).arg(us).arg(&out).arg(&count);
        // SAFETY: the kernel's arguments, in its order and types; shapes checked by the caller.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl CustomOp2 for SiluMul {
    cuda_only_op!("silu-mul", a, b);

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = match g.dtype() {
            DType::BF16 => self.run::<bf16>((g, gl), u)?,
            DType::F16 => self.run::<f16>((g, gl), u)?,
            DType::F32 => self.run::<f32>((g, gl), u)?,
            other => bail!("silu-mul: {other:?} is not supported"),
        };
        Ok((out, gl.shape().clone()))
    }
}
