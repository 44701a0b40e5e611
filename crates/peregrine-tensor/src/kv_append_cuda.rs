//! A decode step's new key and value rows written into every sequence's cache in one launch
//! (`kernels/cuda/kv_append.cu`), in place of a cast and a `slice_set` per sequence for keys
//! and again for values: the per-sequence launches that made a batched GPU step grow with its
//! sequences (docs/cuda.md).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::{CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

use crate::attention::AppendSlot;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kv_append.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_kv_append";
/// Words of a row's entry in the kernel's table.
const ENTRY: usize = 7;

/// [`append_rows_takes`](crate::attention::append_rows_takes).
pub(crate) fn takes(k: &Tensor, v: &Tensor, cache_dtype: DType) -> bool {
    let floats = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let rows_ok = |t: &Tensor| t.device().is_cuda() && t.rank() == 4 && t.stride()[3] == 1;
    k.dims() == v.dims()
        && k.dtype() == v.dtype()
        && floats(k.dtype())
        && floats(cache_dtype)
        && rows_ok(k)
        && rows_ok(v)
}

/// [`append_rows`](crate::attention::append_rows): every cache `[1, kv_heads, capacity > slot,
/// d]` of one dtype, keys and values laid out alike.
pub(crate) fn append_rows(k: &Tensor, v: &Tensor, slots: &[AppendSlot]) -> Result<()> {
    let Some(first) = slots.first() else {
        return Ok(());
    };
    let (_, kv_heads, rows, d) = k.dims4()?;
    let cache_dtype = first.k.dtype();
    if !takes(k, v, cache_dtype) {
        candle_core::bail!(
            "kv append: sources {:?} {:?} on {:?}",
            k.dims(),
            k.dtype(),
            k.device()
        )
    }
    let dev = k.device().as_cuda_device()?;
    let stream = dev.cuda_stream();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let mut held = Vec::with_capacity(2 * slots.len());
    for s in slots {
        held.push(s.k.storage_and_layout());
        held.push(s.v.storage_and_layout());
    }
    let (k_base, v_base) = (address(&ks, kl, &stream)?, address(&vs, vl, &stream)?);
    let size = |dt: DType| dt.size_in_bytes() as u64;
    let mut table = Vec::with_capacity(ENTRY * slots.len());
    for (s, pair) in slots.iter().zip(held.chunks(2)) {
        let [(ck, ckl), (cv, cvl)] = pair else {
            unreachable!("two per slot")
        };
        for (t, l) in [(&s.k, ckl), (&s.v, cvl)] {
            let fits = matches!(t.dims4(), Ok((1, h, cap, cd)) if h == kv_heads && cd == d && s.slot < cap);
            if !fits || t.dtype() != cache_dtype || l.stride()[3] != 1 || s.row >= rows {
                candle_core::bail!(
                    "kv append: cache {:?} {:?} for slot {}",
                    t.dims(),
                    t.dtype(),
                    s.slot
                )
            }
        }
        let row =
            |base: u64, l: &Layout, dt: DType| base + (l.stride()[2] * s.row) as u64 * size(dt);
        let slot = |base: u64| base + (ckl.stride()[2] * s.slot) as u64 * size(cache_dtype);
        table.extend([
            row(k_base, kl, k.dtype()),
            row(v_base, vl, v.dtype()),
            slot(address(ck, ckl, &stream)?),
            slot(address(cv, cvl, &stream)?),
            ckl.stride()[1] as u64,
            kl.stride()[1] as u64,
            vl.stride()[1] as u64,
        ]);
        if cvl.stride() != ckl.stride() {
            candle_core::bail!(
                "kv append: keys and values laid out apart ({:?}, {:?})",
                ckl.stride(),
                cvl.stride()
            )
        }
    }
    let table = dev.clone_htod(&table)?;
    let name = format!("kv_append_{}_{}", suffix(k.dtype()), suffix(cache_dtype));
    let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let d32 = i32::try_from(d).map_err(|_| candle_core::Error::Msg(format!("kv append: {d}")))?;
    let cfg = LaunchConfig {
        grid_dim: (kv_heads as u32, slots.len() as u32, 1),
        block_dim: (d.clamp(32, 256) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = func.builder();
    launch.arg(&table).arg(&d32);
    // SAFETY: the kernel's arguments, in its order and types; every address in the table is a
    // checked row of a live buffer (`held` keeps them until the launch is queued), and the
    // caches are the caller's own.
    unsafe { launch.launch(cfg) }.w()?;
    drop(held);
    Ok(())
}

/// The device address of a CUDA storage's first element under `layout`.
fn address(
    storage: &Storage,
    layout: &Layout,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<u64> {
    let Storage::Cuda(s) = storage else {
        candle_core::bail!("kv append: a tensor off the GPU")
    };
    let base = |s: &CudaStorage| -> Result<u64> {
        Ok(match s.dtype() {
            DType::BF16 => s.as_cuda_slice::<bf16>()?.device_ptr(stream).0,
            DType::F16 => s.as_cuda_slice::<f16>()?.device_ptr(stream).0,
            DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(stream).0,
            other => candle_core::bail!("kv append: {other:?}"),
        })
    };
    Ok(base(s)? + (layout.start_offset() * s.dtype().size_in_bytes()) as u64)
}

fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}
