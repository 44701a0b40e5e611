//! What the crate's custom CUDA ops share.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::{CudaStorage, DType, Layout, Result, Storage, bail};
use half::{bf16, f16};

/// The `name` and `cpu_fwd` of a candle custom op that runs on CUDA only (`CustomOp1`, `2` or
/// `3`, one identifier per input): on the CPU it refuses, naming itself.
macro_rules! cuda_only_op {
    ($name:literal, $($input:ident),+) => {
        fn name(&self) -> &'static str {
            $name
        }

        fn cpu_fwd(
            &self,
            $($input: &candle_core::CpuStorage, _: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $(let _ = $input;)+
            candle_core::bail!(concat!($name, " runs on CUDA only"))
        }
    };
}
pub(crate) use cuda_only_op;

/// `n` as a kernel's 32-bit argument, or an error naming `op` where it does not fit.
pub(crate) fn int(op: &str, n: usize) -> candle_core::Result<i32> {
    i32::try_from(n).map_err(|_| {
        candle_core::Error::Msg(format!("{op}: {n} does not fit a 32-bit kernel argument"))
    })
}

/// A kernel's output buffer as a tensor of `shape` (no gradient: inference only).
pub(crate) fn tensor(y: CudaStorage, shape: impl Into<candle_core::Shape>) -> candle_core::Tensor {
    let none = candle_core::op::BackpropOp::none();
    candle_core::Tensor::from_storage(Storage::Cuda(y), shape, none, false)
}

/// The device address of a CUDA storage's first element under `layout`.
pub(crate) fn address(storage: &Storage, layout: &Layout, stream: &Arc<CudaStream>) -> Result<u64> {
    let Storage::Cuda(s) = storage else {
        bail!("a tensor off the GPU where a CUDA kernel reads it")
    };
    let base = |s: &CudaStorage| -> Result<u64> {
        Ok(match s.dtype() {
            DType::BF16 => s.as_cuda_slice::<bf16>()?.device_ptr(stream).0,
            DType::F16 => s.as_cuda_slice::<f16>()?.device_ptr(stream).0,
            DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(stream).0,
            other => bail!("a CUDA kernel's input of {other:?}"),
        })
    };
    Ok(base(s)? + (layout.start_offset() * s.dtype().size_in_bytes()) as u64)
}
