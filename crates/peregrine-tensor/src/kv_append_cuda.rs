//! A decode step's new key and value rows written into every sequence's cache in one launch
//! (`kernels/cuda/kv_append.cu`), in place of a cast and a `slice_set` per sequence for keys
//! and again for values: the per-sequence launches that made a batched GPU step grow with its
//! sequences (docs/cuda.md).

use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

use crate::attention::AppendSlot;
use crate::cuda_op::address;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kv_append.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_kv_append";
/// Words of a row's entry in the kernel's table (`ENTRY` in the kernel).
const ENTRY: usize = 10;

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

/// The rotation [`decode_rows`] gives queries and keys: `cos, sin: [positions, half]` in the
/// rows' dtype, row `i` of the call at `positions[i]`; the first `2 · half` dimensions of a
/// head rotate, in pairs `(i, i + half)` or, `interleaved`, `(2i, 2i + 1)`.
pub(crate) struct Turn<'a> {
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub positions: &'a [u32],
    pub half: usize,
    pub interleaved: bool,
}

/// [`append_rows`](crate::attention::append_rows): every cache `[1, kv_heads, capacity > slot,
/// d]` of one dtype, keys and values laid out alike.
pub(crate) fn append_rows(k: &Tensor, v: &Tensor, slots: &[AppendSlot]) -> Result<()> {
    decode_rows(None, (k, v), slots, None).map(|_| ())
}

/// A decode step's rows in one launch: each slot's row of `k, v: [1, kv_heads, rows, d]`
/// turned (keys; when `turn` is given) and written into its cache, converted to the caches'
/// dtype; with `q: [1, heads, rows, d]`, slot `i`'s query row turned too and returned as row
/// `i` of `[slots, heads, d]` in f32 (the attention kernel's input).
pub(crate) fn decode_rows(
    q: Option<&Tensor>,
    (k, v): (&Tensor, &Tensor),
    slots: &[AppendSlot],
    turn: Option<Turn>,
) -> Result<Option<Tensor>> {
    let Some(first) = slots.first() else {
        return Ok(None);
    };
    let (_, kv_heads, rows, d) = k.dims4()?;
    let cache_dtype = first.k.dtype();
    if !takes(k, v, cache_dtype) || q.is_some_and(|q| !takes(q, q, cache_dtype)) {
        candle_core::bail!(
            "kv append: sources {:?} {:?} on {:?}",
            k.dims(),
            k.dtype(),
            k.device()
        )
    }
    let heads = q.map_or(0, |q| q.dims()[1]);
    let dev = k.device().as_cuda_device()?;
    let stream = dev.cuda_stream();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let qsl = q.map(|q| q.storage_and_layout());
    let mut held = Vec::with_capacity(2 * slots.len());
    for s in slots {
        held.push(s.k.storage_and_layout());
        held.push(s.v.storage_and_layout());
    }
    let (k_base, v_base) = (address(&ks, kl, &stream)?, address(&vs, vl, &stream)?);
    let q_base = match &qsl {
        Some((qs, ql)) => address(qs, ql, &stream)?,
        None => 0,
    };
    let size = k.dtype().size_in_bytes() as u64;
    let mut table = Vec::with_capacity(ENTRY * slots.len());
    for (i, (s, pair)) in slots.iter().zip(held.chunks(2)).enumerate() {
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
        if cvl.stride() != ckl.stride() {
            candle_core::bail!(
                "kv append: keys and values laid out apart ({:?}, {:?})",
                ckl.stride(),
                cvl.stride()
            )
        }
        let row = |base: u64, l: &Layout| base + (l.stride()[2] * s.row) as u64 * size;
        let slot = |base: u64| {
            base + (ckl.stride()[2] * s.slot) as u64 * cache_dtype.size_in_bytes() as u64
        };
        let (q_row, q_head) = match &qsl {
            Some((_, ql)) => (row(q_base, ql), ql.stride()[1] as u64),
            None => (0, 0),
        };
        let position = turn
            .as_ref()
            .map_or(0, |t| t.positions.get(i).copied().unwrap_or(0));
        table.extend([
            row(k_base, kl),
            row(v_base, vl),
            slot(address(ck, ckl, &stream)?),
            slot(address(cv, cvl, &stream)?),
            ckl.stride()[1] as u64,
            kl.stride()[1] as u64,
            vl.stride()[1] as u64,
            q_row,
            q_head,
            u64::from(position),
        ]);
    }
    let table = dev.clone_htod(&table)?;
    let int = |n| crate::cuda_op::int("kv append", n);
    let (half, interleaved) = turn
        .as_ref()
        .map_or((0, 0), |t| (t.half, i32::from(t.interleaved)));
    let tables = match &turn {
        Some(t) => Some(rope_tables(t, k.dtype(), half)?),
        None => None,
    };
    let held_tables = tables
        .as_ref()
        .map(|(c, s)| (c.storage_and_layout(), s.storage_and_layout()));
    let (cos, sin) = match &held_tables {
        Some(((cs, cl), (ss, sl))) => (address(cs, cl, &stream)?, address(ss, sl, &stream)?),
        None => (0, 0),
    };
    // SAFETY: written by the kernel (every query row of every slot) before it is read.
    let q_out = unsafe { dev.alloc::<f32>((slots.len() * heads * d).max(1))? };
    let name = format!("decode_rows_{}_{}", suffix(k.dtype()), suffix(cache_dtype));
    let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let cfg = LaunchConfig {
        grid_dim: ((heads + kv_heads) as u32, slots.len() as u32, 1),
        block_dim: (d.div_ceil(2).clamp(32, 128) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (heads32, d32, half32) = (int(heads)?, int(d)?, int(half)?);
    let mut launch = func.builder();
    launch
        .arg(&table)
        .arg(&cos)
        .arg(&sin)
        .arg(&heads32)
        .arg(&d32)
        .arg(&half32)
        .arg(&interleaved)
        .arg(&q_out);
    // SAFETY: the kernel's arguments, in its order and types (the tables' addresses as 64-bit
    // words); every address in the table is a checked row of a live buffer (`held` and the
    // guards above keep them until the launch is queued), and the caches are the caller's own.
    unsafe { launch.launch(cfg) }.w()?;
    drop((held, held_tables, qsl));
    if heads == 0 {
        return Ok(None);
    }
    let q_out = CudaStorage::wrap_cuda_slice(q_out, dev.clone());
    Ok(Some(crate::cuda_op::tensor(q_out, (slots.len(), heads, d))))
}

/// `turn`'s tables, checked: `[positions, half]` rows of `dtype`, covering every position.
fn rope_tables(turn: &Turn, dtype: DType, half: usize) -> Result<(Tensor, Tensor)> {
    let (cos, sin) = (turn.cos.contiguous()?, turn.sin.contiguous()?);
    let n = turn.positions.iter().max().map_or(0, |&p| p as usize + 1);
    for t in [&cos, &sin] {
        if t.dtype() != dtype || !matches!(t.dims2(), Ok((p, h)) if h == half && p >= n) {
            candle_core::bail!(
                "kv append: rope table {:?} {:?} for {n} positions",
                t.dims(),
                t.dtype()
            )
        }
    }
    Ok((cos, sin))
}

fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}
