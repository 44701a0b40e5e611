//! One new token's attention over its cache on CUDA (`kernels/cuda/attn_decode.cu`): the keys
//! split into chunks attended in parallel, then joined (flash-decoding), in place of candle's
//! GEMM, softmax and GEMM, whose value product runs one block per kv head over the whole
//! context (8B bf16 at 8K positions on an H100: 67 → 104 tok/s, docs/cuda.md).
//! `PEREGRINE_CUDA_ATTN=0` keeps candle's path (to compare).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use crate::cuda_op::cuda_only_op;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_decode.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_attn_decode";

/// Query heads per kv head the kernel holds in registers (`MAX_GROUPS` in the kernel).
const MAX_GROUPS: usize = 8;
/// Head sizes the kernel is built for.
const HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];
/// Threads of a partial block (`WARPS · 32` in the kernel).
const THREADS: u32 = 128;
/// About how many blocks a call spreads over: one wave of four per SM on an H100 (132 SMs).
const TARGET_BLOCKS: usize = 512;
/// Fewest keys a chunk holds (below that the join costs more than the split saves).
const MIN_CHUNK: usize = 32;

/// Whether [`attention`](crate::attention::attention) takes the kernel (`PEREGRINE_CUDA_ATTN`,
/// read once; on unless `0`).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PEREGRINE_CUDA_ATTN").map_or(true, |v| v != "0"))
}

/// Whether [`attention_many`](crate::attention::attention_many) takes the batched kernel
/// and a decode step's rows go to the caches in one launch (`PEREGRINE_CUDA_BATCH_ATTN`, read
/// once; on unless `0`: on an H100, 64 streams of an 8B Q4_K_M decode 4.3× faster, docs/cuda.md).
pub(crate) fn batch_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PEREGRINE_CUDA_BATCH_ATTN").map_or(true, |v| v != "0"))
}

/// Attention of one query position `q: [1, heads, 1, d]` over every key of `k, v: [1, kv_heads,
/// n, d]` (no mask: the caller has cut the cache to the visible keys), scores scaled by `scale`
/// and capped by `softcap`; `[1, heads, 1, d]` in the cache's dtype. `None` when the kernel does
/// not take these tensors (not CUDA, another dtype or head size, more than 8 query heads per kv
/// head, a cache whose rows are not contiguous): the caller's path runs.
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    softcap: Option<f32>,
) -> Result<Option<Tensor>> {
    let (Ok((1, heads, 1, d)), Ok((1, kv_heads, _, _))) = (q.dims4(), k.dims4()) else {
        return Ok(None);
    };
    if !takes((heads, kv_heads, d), k.dtype(), (k, v)) {
        return Ok(None);
    }
    let q = q.to_dtype(DType::F32)?.contiguous()?;
    let op = DecodeAttention {
        scale: scale as f32,
        softcap: softcap.unwrap_or(0.0),
    };
    Ok(Some(q.apply_op3_no_bwd(k, v, &op)?))
}

/// Whether the kernels take a cache's keys and values `k, v: [1, kv_heads, n ≥ 1, d]` of
/// `dtype` for `heads` query heads: on CUDA, a head size and dtype they are built for, at most
/// [`MAX_GROUPS`] query heads per kv head, each row `d` contiguous values and both tensors' heads
/// equally far apart.
fn takes(
    (heads, kv_heads, d): (usize, usize, usize),
    dtype: DType,
    (k, v): (&Tensor, &Tensor),
) -> bool {
    let rows_ok = |t: &Tensor| {
        let s = t.stride();
        t.device().is_cuda() && s[3] == 1 && s[2] == d && t.dims() == k.dims()
    };
    matches!(k.dims4(), Ok((1, h, n, kd)) if h == kv_heads && n > 0 && kd == d)
        && HEAD_DIMS.contains(&d)
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && heads / kv_heads <= MAX_GROUPS
        && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && k.dtype() == dtype
        && v.dtype() == dtype
        && rows_ok(k)
        && rows_ok(v)
        && k.stride()[1] == v.stride()[1]
}

/// Launches `kernel` (`attn_join_*`): block (query head, sequence) of `grid` joins its
/// `chunks` parts into `out`, `d` values a head.
#[allow(clippy::too_many_arguments)]
fn join<T: DeviceRepr>(
    dev: &candle_core::CudaDevice,
    kernel: &str,
    grid: (usize, usize),
    (part_o, part_ml): (&CudaSlice<f32>, &CudaSlice<f32>),
    chunks: usize,
    d: usize,
    out: &CudaSlice<T>,
) -> Result<()> {
    let join = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
    let cfg = LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: (d as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (chunks, d) = (int(chunks)?, int(d)?);
    let mut launch = join.builder();
    launch
        .arg(part_o)
        .arg(part_ml)
        .arg(&chunks)
        .arg(&d)
        .arg(out);
    // SAFETY: the join kernels' arguments, in their order and types; the partial kernel before
    // it wrote `chunks` parts of every head (of every sequence).
    unsafe { launch.launch(cfg) }.w()?;
    Ok(())
}

struct DecodeAttention {
    scale: f32,
    /// 0 for none.
    softcap: f32,
}

fn int(n: usize) -> Result<i32> {
    crate::cuda_op::int("decode attention", n)
}

impl DecodeAttention {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        (q, ql): (&CudaStorage, &Layout),
        (k, kl): (&CudaStorage, &Layout),
        (v, vl): (&CudaStorage, &Layout),
        name: &str,
    ) -> Result<CudaStorage> {
        let [_, kv_heads, n, d] = kl.dims() else {
            candle_core::bail!("decode attention: keys of shape {:?}", kl.dims())
        };
        let (kv_heads, n, d) = (*kv_heads, *n, *d);
        let heads = ql.dims()[1];
        let groups = heads / kv_heads;
        // Chunks enough for about TARGET_BLOCKS blocks, of at least MIN_CHUNK keys.
        let chunks = TARGET_BLOCKS
            .div_ceil(kv_heads)
            .min(n.div_ceil(MIN_CHUNK))
            .max(1);
        let chunk_keys = n.div_ceil(chunks);
        let chunks = n.div_ceil(chunk_keys);
        let dev = &q.device;
        let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        let ks = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let vs = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        // SAFETY: every element of the three is written by the kernels below before it is read.
        let (part_o, part_ml, out) = unsafe {
            (
                dev.alloc::<f32>(heads * chunks * d)?,
                dev.alloc::<f32>(2 * heads * chunks)?,
                dev.alloc::<T>(heads * d)?,
            )
        };
        let head_stride = kl.stride()[1] as i64;
        let (n32, groups32, chunk32) = (int(n)?, int(groups)?, int(chunk_keys)?);
        let partial =
            dev.get_or_load_custom_func(&format!("attn_partial_{name}_d{d}"), MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (kv_heads as u32, chunks as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = partial.builder();
        launch
            .arg(&qs)
            .arg(&ks)
            .arg(&vs)
            .arg(&head_stride)
            .arg(&n32)
            .arg(&groups32)
            .arg(&chunk32)
            .arg(&self.scale)
            .arg(&self.softcap)
            .arg(&part_o)
            .arg(&part_ml);
        // SAFETY: the kernel's arguments, in its order and types; `decode_attention` checked
        // the shapes and that every key row is `d` contiguous values `head_stride` apart per head.
        unsafe { launch.launch(cfg) }.w()?;
        join(
            dev,
            &format!("attn_join_{name}"),
            (heads, 1),
            (&part_o, &part_ml),
            chunks,
            d,
            &out,
        )?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl CustomOp3 for DecodeAttention {
    cuda_only_op!("decode-attention", a, b, c);

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = match k.dtype() {
            DType::BF16 => self.run::<bf16>((q, ql), (k, kl), (v, vl), "bf16")?,
            DType::F16 => self.run::<f16>((q, ql), (k, kl), (v, vl), "f16")?,
            DType::F32 => self.run::<f32>((q, ql), (k, kl), (v, vl), "f32")?,
            other => candle_core::bail!("decode-attention: {other:?} is not supported"),
        };
        Ok((out, ql.shape().clone()))
    }
}

/// [`decode_attention`] for a decode step's sequences at once: `q: [sequences, heads, d]`, row
/// `s` attending every key of `kvs[s]` (each `[1, kv_heads, n_s, d]`, as `decode_attention`
/// takes them; the same dtype, heads and size throughout). `[sequences, heads, d]` in `dtype`
/// (f32, f16 or bf16: the join writes it, so no cast follows); `None` where the kernel does
/// not take them (the caller attends each alone).
pub fn decode_attention_many(
    q: &Tensor,
    kvs: &[(Tensor, Tensor)],
    (scale, softcap): (f64, Option<f32>),
    dtype: DType,
) -> Result<Option<Tensor>> {
    let (Ok((seqs, heads, d)), Some((k0, _))) = (q.dims3(), kvs.first()) else {
        return Ok(None);
    };
    let Ok((1, kv_heads, _, kd)) = k0.dims4() else {
        return Ok(None);
    };
    let shape = (heads, kv_heads, kd);
    let takes_all = kvs.iter().all(|(k, v)| takes(shape, k0.dtype(), (k, v)));
    let float = matches!(dtype, DType::F32 | DType::F16 | DType::BF16);
    if seqs != kvs.len() || kd != d || !takes_all || !float {
        return Ok(None);
    }
    let q = q.to_dtype(DType::F32)?.contiguous()?;
    let op = DecodeAttentionMany {
        kvs: kvs.to_vec(),
        scale: scale as f32,
        softcap: softcap.unwrap_or(0.0),
        out: dtype,
    };
    Ok(Some(q.apply_op1_no_bwd(&op)?))
}

struct DecodeAttentionMany {
    /// Each sequence's keys and values (held for their device pointers).
    kvs: Vec<(Tensor, Tensor)>,
    scale: f32,
    /// 0 for none.
    softcap: f32,
    /// The output's dtype.
    out: DType,
}

impl DecodeAttentionMany {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        (q, ql): (&CudaStorage, &Layout),
        name: &str,
    ) -> Result<CudaStorage> {
        let [seqs, heads, d] = ql.dims() else {
            candle_core::bail!("decode attention: queries of shape {:?}", ql.dims())
        };
        let (seqs, heads, d) = (*seqs, *heads, *d);
        let kv_heads = self.kvs[0].0.dims()[1];
        let groups = heads / kv_heads;
        let longest = (self.kvs.iter())
            .map(|(k, _)| k.dims()[2])
            .max()
            .unwrap_or(1);
        // Chunks enough for about TARGET_BLOCKS blocks over all sequences, of at least
        // MIN_CHUNK keys in the longest.
        let chunks = TARGET_BLOCKS
            .div_ceil(kv_heads * seqs)
            .min(longest.div_ceil(MIN_CHUNK))
            .max(1);
        let dev = &q.device;
        let stream = dev.cuda_stream();
        // Each sequence's first key and value row, head stride and key count, for the tables.
        let storages: Vec<_> = (self.kvs.iter())
            .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
            .collect();
        let mut views = Vec::with_capacity(seqs);
        let (mut strides, mut ns) = (Vec::with_capacity(seqs), Vec::with_capacity(seqs));
        for ((k, kl), (v, vl)) in &storages {
            let (candle_core::Storage::Cuda(k), candle_core::Storage::Cuda(v)) = (&**k, &**v)
            else {
                candle_core::bail!("decode attention: a cache off the GPU")
            };
            views.push((
                k.as_cuda_slice::<T>()?.slice(kl.start_offset()..),
                v.as_cuda_slice::<T>()?.slice(vl.start_offset()..),
            ));
            strides.push(kl.stride()[1] as u64);
            ns.push(int(kl.dims()[2])? as u32);
        }
        // One upload a layer: keys' and values' first rows, head strides, then the key counts
        // as 32-bit words two to a 64-bit one.
        let mut table = Vec::with_capacity(3 * seqs + seqs.div_ceil(2));
        let mut guards = Vec::with_capacity(2 * seqs);
        for (ks, _) in &views {
            let (p, g) = ks.device_ptr(&stream);
            table.push(p);
            guards.push(g);
        }
        for (_, vs) in &views {
            let (p, g) = vs.device_ptr(&stream);
            table.push(p);
            guards.push(g);
        }
        table.extend(&strides);
        table.extend(
            ns.chunks(2)
                .map(|p| p[0] as u64 | (*p.get(1).unwrap_or(&0) as u64) << 32),
        );
        let table = dev.clone_htod(&table)?;
        let (k_table, v_table) = (table.slice(..seqs), table.slice(seqs..2 * seqs));
        let (strides, ns) = (table.slice(2 * seqs..3 * seqs), table.slice(3 * seqs..));
        let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
        // SAFETY: every element of the two is written by the kernel below before it is read.
        let (part_o, part_ml) = unsafe {
            (
                dev.alloc::<f32>(seqs * heads * chunks * d)?,
                dev.alloc::<f32>(2 * seqs * heads * chunks)?,
            )
        };
        let groups32 = int(groups)?;
        let partial =
            dev.get_or_load_custom_func(&format!("attn_partial_many_{name}_d{d}"), MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (kv_heads as u32, chunks as u32, seqs as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = partial.builder();
        launch
            .arg(&qs)
            .arg(&k_table)
            .arg(&v_table)
            .arg(&strides)
            .arg(&ns)
            .arg(&groups32)
            .arg(&self.scale)
            .arg(&self.softcap)
            .arg(&part_o)
            .arg(&part_ml);
        // SAFETY: the kernel's arguments, in its order and types (the tables hold device
        // addresses of `T` rows); `decode_attention_many` checked every cache as
        // `decode_attention` checks one, and the guards keep their storage until the launch.
        unsafe { launch.launch(cfg) }.w()?;
        drop(guards);
        let parts = (&part_o, &part_ml);
        match self.out {
            DType::BF16 => join_many::<bf16>(dev, "bf16", (heads, seqs), parts, (chunks, d)),
            DType::F16 => join_many::<f16>(dev, "f16", (heads, seqs), parts, (chunks, d)),
            _ => join_many::<f32>(dev, "f32", (heads, seqs), parts, (chunks, d)),
        }
    }
}

/// [`join`] of every sequence's parts into a new `[sequences, heads, d]` buffer of `O`.
fn join_many<O: CudaDType + DeviceRepr>(
    dev: &candle_core::CudaDevice,
    name: &str,
    (heads, seqs): (usize, usize),
    parts: (&CudaSlice<f32>, &CudaSlice<f32>),
    (chunks, d): (usize, usize),
) -> Result<CudaStorage> {
    // SAFETY: every element is written by the join below.
    let out = unsafe { dev.alloc::<O>(seqs * heads * d)? };
    let kernel = format!("attn_join_many_{name}");
    join(dev, &kernel, (heads, seqs), parts, chunks, d, &out)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl CustomOp1 for DecodeAttentionMany {
    cuda_only_op!("decode-attention-many", a);

    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = match self.kvs[0].0.dtype() {
            DType::BF16 => self.run::<bf16>((q, ql), "bf16")?,
            DType::F16 => self.run::<f16>((q, ql), "f16")?,
            DType::F32 => self.run::<f32>((q, ql), "f32")?,
            other => candle_core::bail!("decode-attention-many: {other:?} is not supported"),
        };
        Ok((out, ql.shape().clone()))
    }
}
