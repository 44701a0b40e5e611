//! MLX affine matrices on CUDA (`kernels/cuda/mlx_affine.cu`): up to [`MAX_ROWS`] input rows
//! (decode, small batches) run a warp-per-row GEMV straight from the packed codes; larger
//! batches dequantize the matrix to the activations' dtype and multiply with cuBLAS; embedding
//! lookups dequantize only the rows asked for. Checked against
//! [`MlxQuantized::dequantize_ref`] by `scripts/cuda/parity.py` (the MLX fixtures of every bit
//! width and group size) and the `cuda` tests in `tests/mlx.rs`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CudaDevice, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, bail,
};
use half::{bf16, f16};

use super::MlxQuantized;
use crate::cuda_op::cuda_only_op;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/mlx_affine.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_mlx_affine";

/// Input rows the GEMV kernel takes at once (its `MAX_ROWS`).
const MAX_ROWS: usize = 8;

/// `x: [.., in]` → `[.., out]` in `x`'s dtype.
pub(super) fn matmul(w: &MlxQuantized, x: &Tensor) -> Result<Tensor> {
    let (out, in_dim) = w.dims();
    let m = x.elem_count() / in_dim;
    if m > MAX_ROWS {
        let dense = dequantize(w, None, x.dtype())?;
        return crate::linear::dense_matmul(x, &dense);
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("an input has a last dimension") = out;
    x.contiguous()?
        .apply_op1_no_bwd(&Gemv { w, m })?
        .reshape(dims)
}

/// Rows `ids` of the matrix (all of them when `None`), dequantized to `dtype`.
pub(super) fn dequantize(w: &MlxQuantized, ids: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
    w.packed.apply_op1_no_bwd(&Dequantize { w, ids, dtype })
}

struct Gemv<'a> {
    w: &'a MlxQuantized,
    m: usize,
}

struct Dequantize<'a> {
    w: &'a MlxQuantized,
    ids: Option<&'a Tensor>,
    dtype: DType,
}

fn dtype_name(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        other => bail!("mlx (cuda): {other:?} activations are not supported"),
    })
}

fn cuda_storage(s: &Storage) -> Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => bail!("mlx (cuda): weights and activations must all be on the GPU"),
    }
}

/// The name of kernel `kind` for `x` activations and `scales` of these dtypes.
fn kernel_name(kind: &str, x: DType, scales: DType) -> Result<String> {
    Ok(format!("{kind}_{}_{}", dtype_name(x)?, dtype_name(scales)?))
}

/// Sizes as the kernels' `int` arguments.
fn ints<const N: usize>(sizes: [usize; N]) -> Result<[i32; N]> {
    let mut out = [0; N];
    for (o, n) in out.iter_mut().zip(sizes) {
        *o = crate::cuda_op::int("mlx (cuda)", n)?;
    }
    Ok(out)
}

/// Runs `f` with the packed codes, scales and biases as typed device views.
macro_rules! with_weights {
    ($w:expr, |$p:ident, $s:ident, $b:ident| $body:expr) => {{
        let (ps, pl) = $w.packed.storage_and_layout();
        let (ss, sl) = $w.scales.storage_and_layout();
        let (bs, bl) = $w.biases.storage_and_layout();
        let $p = cuda_storage(&ps)?
            .as_cuda_slice::<u32>()?
            .slice(pl.start_offset()..);
        match $w.scales.dtype() {
            DType::BF16 => {
                let $s = cuda_storage(&ss)?
                    .as_cuda_slice::<bf16>()?
                    .slice(sl.start_offset()..);
                let $b = cuda_storage(&bs)?
                    .as_cuda_slice::<bf16>()?
                    .slice(bl.start_offset()..);
                $body
            }
            DType::F16 => {
                let $s = cuda_storage(&ss)?
                    .as_cuda_slice::<f16>()?
                    .slice(sl.start_offset()..);
                let $b = cuda_storage(&bs)?
                    .as_cuda_slice::<f16>()?
                    .slice(bl.start_offset()..);
                $body
            }
            _ => {
                let $s = cuda_storage(&ss)?
                    .as_cuda_slice::<f32>()?
                    .slice(sl.start_offset()..);
                let $b = cuda_storage(&bs)?
                    .as_cuda_slice::<f32>()?
                    .slice(bl.start_offset()..);
                $body
            }
        }
    }};
}

impl Gemv<'_> {
    fn run<X: CudaDType + DeviceRepr>(&self, x: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
        let w = self.w;
        let (out, in_dim) = w.dims();
        let dev = &x.device;
        let xs = x.as_cuda_slice::<X>()?.slice(l.start_offset()..);
        let name = kernel_name("mlx_gemv", x.dtype(), w.scales.dtype())?;
        let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        // SAFETY: every element is written by the kernel below.
        let y = unsafe { dev.alloc::<X>(self.m * out)? };
        let [m, o, i, bits, group] = ints([self.m, out, in_dim, w.bits, w.group_size])?;
        let cfg = LaunchConfig {
            grid_dim: (out.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        with_weights!(w, |p, s, b| {
            let mut launch = func.builder();
            launch.arg(&xs).arg(&p).arg(&s).arg(&b).arg(&y);
            launch.arg(&m).arg(&o).arg(&i).arg(&bits).arg(&group);
            // SAFETY: the kernel's arguments, in its order and types; sizes checked at load.
            unsafe { launch.launch(cfg) }.w()?;
        });
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }
}

impl CustomOp1 for Gemv<'_> {
    cuda_only_op!("mlx-gemv", a);

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        if !l.is_contiguous() {
            bail!("mlx-gemv: the input must be contiguous");
        }
        let y = match x.dtype() {
            DType::BF16 => self.run::<bf16>(x, l)?,
            DType::F16 => self.run::<f16>(x, l)?,
            DType::F32 => self.run::<f32>(x, l)?,
            other => bail!("mlx (cuda): {other:?} activations are not supported"),
        };
        Ok((y, Shape::from((self.m, self.w.dims().0))))
    }
}

impl Dequantize<'_> {
    fn run<O: CudaDType + DeviceRepr>(&self, dev: &CudaDevice) -> Result<(CudaStorage, Shape)> {
        let w = self.w;
        let (out, in_dim) = w.dims();
        let n = self.ids.map_or(out, Tensor::elem_count);
        let name = kernel_name("mlx_dequant", self.dtype, w.scales.dtype())?;
        let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        // SAFETY: every element is written by the kernel below.
        let y = unsafe { dev.alloc::<O>(n * in_dim)? };
        let [rows, i, bits, group] = ints([n, in_dim, w.bits, w.group_size])?;
        let cfg = LaunchConfig {
            grid_dim: ((n * in_dim).div_ceil(256).min(1 << 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let ids = self.ids.map(|t| t.contiguous()).transpose()?;
        let guard = ids.as_ref().map(|t| t.storage_and_layout());
        let null = 0u64;
        with_weights!(w, |p, s, b| {
            let mut launch = func.builder();
            launch.arg(&p).arg(&s).arg(&b);
            let id_view;
            match &guard {
                Some((st, l)) => {
                    id_view = cuda_storage(st)?
                        .as_cuda_slice::<u32>()?
                        .slice(l.start_offset()..);
                    launch.arg(&id_view);
                }
                None => {
                    launch.arg(&null);
                }
            }
            launch.arg(&y).arg(&rows).arg(&i).arg(&bits).arg(&group);
            // SAFETY: the kernel's arguments, in its order and types; ids were range-checked.
            unsafe { launch.launch(cfg) }.w()?;
        });
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            Shape::from((n, in_dim)),
        ))
    }
}

impl CustomOp1 for Dequantize<'_> {
    cuda_only_op!("mlx-dequantize", a);

    fn cuda_fwd(&self, packed: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = &packed.device;
        match self.dtype {
            DType::BF16 => self.run::<bf16>(dev),
            DType::F16 => self.run::<f16>(dev),
            DType::F32 => self.run::<f32>(dev),
            other => bail!("mlx (cuda): {other:?} output is not supported"),
        }
    }
}
