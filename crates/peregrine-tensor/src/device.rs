//! Device and dtype choices shared by every crate.

use candle_core::{DType, Device, Result};

/// The device named by a user-facing string: `cpu`, `cuda`, `cuda:N` or `metal`.
pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Device::new_cuda(0),
        "metal" => Device::new_metal(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => Device::new_cuda(ordinal),
            _ => {
                candle_core::bail!("unknown device `{other}` (expected cpu, cuda, cuda:N or metal)")
            }
        },
    }
}

/// The dtype activations are computed in: f32 on CPU (candle's bf16 CPU matmul is slow and
/// golden tests compare in f32), bf16 on accelerators.
pub fn compute_dtype(device: &Device) -> DType {
    if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    }
}
