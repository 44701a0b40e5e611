//! Device and dtype choices shared by every crate.

use candle_core::{DType, Device, Result};

/// The device named by a user-facing string: `auto`, `cpu`, `cuda`, `cuda:N` or `metal`.
pub fn parse_device(name: &str) -> Result<Device> {
    let missing = |feature: &str| {
        candle_core::bail!(
            "this build has no `{feature}` feature: build with `--features {feature}` to run \
             on `{name}` (docs/cuda.md for CUDA)"
        )
    };
    if name.starts_with("cuda") && !cfg!(feature = "cuda") {
        return missing("cuda");
    }
    if name == "metal" && !cfg!(feature = "metal") {
        return missing("metal");
    }
    match name {
        "auto" => Ok(default_device()),
        "cpu" => Ok(Device::Cpu),
        "cuda" => cuda(0),
        "metal" => Device::new_metal(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => cuda(ordinal),
            _ => candle_core::bail!(
                "unknown device `{other}` (expected auto, cpu, cuda, cuda:N or metal)"
            ),
        },
    }
}

/// What `auto` picks: the first CUDA GPU in a build with the `cuda` feature when one answers,
/// otherwise the CPU (Metal is never picked unasked: it is untested).
pub fn default_device() -> Device {
    if cfg!(feature = "cuda")
        && let Ok(gpu) = cuda(0)
    {
        return gpu;
    }
    Device::Cpu
}

/// CUDA device `ordinal`. Everything Peregrine runs on it goes through its one stream, so
/// cudarc's cross-stream event tracking (an event recorded per tensor per launch) is turned off:
/// it only adds launch overhead here (`PEREGRINE_CUDA_EVENT_TRACKING=1` keeps it, to measure).
fn cuda(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(gpu) = &device
        && std::env::var_os("PEREGRINE_CUDA_EVENT_TRACKING").is_none()
    {
        // SAFETY: one stream per device (see above): nothing needs the events.
        unsafe { gpu.disable_event_tracking() }
    }
    Ok(device)
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

/// Runs `f` (one forward pass) on a thread of rayon's pool, so the parallel kernels inside it
/// split work with in-pool joins instead of waking the pool from outside on every matmul (a
/// mutex and condvar each time, about a third of a small model's decode step). Keep `f` to one
/// pass: while it runs it holds a pool thread that other sequences' passes may be waiting for.
pub fn in_compute_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// Physical CPU cores: the default compute thread count (a second hyper-thread per core adds
/// little to memory-bound kernels and makes the threads wait on each other). Counted from
/// Linux's `/proc/cpuinfo` (distinct physical id / core id pairs); elsewhere, or when that
/// cannot be read, the logical CPUs available to this process.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = std::collections::HashSet::new();
    let mut package = "";
    for line in info.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        match key.trim() {
            "physical id" => package = value.trim(),
            "core id" => {
                cores.insert((package.to_string(), value.trim().to_string()));
            }
            _ => {}
        }
    }
    // A cgroup or affinity limit below the core count wins.
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}
