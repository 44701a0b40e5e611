//! [`crate::moe::ExpertTables`] on CUDA: the experts' device addresses uploaded once, then
//! per call one upload of the routing and two launches (`kernels/cuda/moe_gemv.cu`).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CudaDevice, CudaStorage, DType, Result, Tensor, bail};
use half::{bf16, f16};

use crate::QLinear;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/moe_gemv.ptx"));
/// The name the PTX module is loaded under (once per device).
const MODULE: &str = "peregrine_moe_gemv";
/// Warps a block (an output row each).
const WARPS: usize = 4;

fn int(n: usize) -> Result<i32> {
    crate::cuda_op::int("moe gemv", n)
}

/// A warp per output row of `rows`, for each of `y` (grid y: slots, tokens or experts).
fn warps(rows: usize, y: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(WARPS) as u32, y as u32, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' name for an activation dtype (bf16, else f16).
fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f16",
    }
}

/// The kernels' name for a weight format they take.
fn format_name(dtype: GgmlDType) -> Option<&'static str> {
    match dtype {
        GgmlDType::Q4K => Some("q4k"),
        GgmlDType::Q6K => Some("q6k"),
        _ => None,
    }
}

pub(crate) struct Tables {
    dev: CudaDevice,
    gate: CudaSlice<u64>,
    up: CudaSlice<u64>,
    down: CudaSlice<u64>,
    /// Formats of gate/up and of down, as the kernels name them.
    formats: (&'static str, &'static str),
    /// `(experts, inter, hidden)`.
    dims: (usize, usize, usize),
    /// The matrices the tables point into, kept alive with them.
    _held: Vec<Arc<QTensor>>,
}

/// The unbiased GGUF matrix behind `l`, when it is one.
fn qtensor(l: &QLinear) -> Option<&Arc<QTensor>> {
    match l {
        QLinear::Gguf { w, b: None } => w.rows_qtensor(),
        _ => None,
    }
}

impl Tables {
    pub(crate) fn new(experts: &[[&QLinear; 3]]) -> Result<Option<Self>> {
        let mut held = Vec::with_capacity(3 * experts.len());
        for expert in experts {
            for l in expert {
                match qtensor(l) {
                    Some(q) if q.device().is_cuda() => held.push(q.clone()),
                    _ => return Ok(None),
                }
            }
        }
        let Some(first) = held.first() else {
            return Ok(None);
        };
        let candle_core::Device::Cuda(dev) = first.device() else {
            return Ok(None);
        };
        let (inter, hidden) = first.shape().dims2()?;
        let same = |q: &Arc<QTensor>, dims: (usize, usize), format: GgmlDType| {
            q.device().same_device(&first.device())
                && q.shape().dims2().ok() == Some(dims)
                && q.dtype() == format
        };
        let (gate_up, down) = (first.dtype(), held[2].dtype());
        let fits = held.chunks(3).all(|e| {
            same(&e[0], (inter, hidden), gate_up)
                && same(&e[1], (inter, hidden), gate_up)
                && same(&e[2], (hidden, inter), down)
        });
        let formats = match (format_name(gate_up), format_name(down)) {
            (Some(a), Some(b)) => (a, b),
            _ => return Ok(None),
        };
        if !fits || !inter.is_multiple_of(256) || !hidden.is_multiple_of(256) {
            return Ok(None);
        }
        let table = |part: usize| -> Result<CudaSlice<u64>> {
            let ptrs = (held.chunks(3).map(|e| Ok(e[part].device_ptr()? as u64)))
                .collect::<Result<Vec<u64>>>()?;
            dev.clone_htod(&ptrs)
        };
        Ok(Some(Self {
            dev: dev.clone(),
            gate: table(0)?,
            up: table(1)?,
            down: table(2)?,
            formats,
            dims: (experts.len(), inter, hidden),
            _held: held,
        }))
    }

    pub(crate) fn forward(&self, x: &Tensor, ids: &[usize], weights: &[f32]) -> Result<Tensor> {
        let n = self.check(x)?;
        if ids.len() != weights.len() || !ids.len().is_multiple_of(n) {
            bail!("moe gemv: {} choices for {n} tokens", ids.len());
        }
        if n > crate::moe::ExpertTables::MAX_TOKENS {
            let routing =
                self.dev
                    .clone_htod(&crate::moe::grouped(self.dims.0, n, ids, weights))?;
            let y = match x.dtype() {
                DType::BF16 => self.run_grouped::<bf16>(x, &routing, ids.len() / n)?,
                DType::F16 => self.run_grouped::<f16>(x, &routing, ids.len() / n)?,
                other => bail!("moe gemv: {other:?} input"),
            };
            return Ok(crate::cuda_op::tensor(y, (n, self.dims.2)));
        }
        // The routing in one upload: the ids (-1: unused), then the weights' bits.
        let routing: Vec<i32> = (ids.iter().map(|&e| i32::try_from(e).unwrap_or(-1)))
            .chain(weights.iter().map(|w| w.to_bits() as i32))
            .collect();
        let routing = self.dev.clone_htod(&routing)?;
        self.launch(x, &routing, ids.len() / n)
    }

    pub(crate) fn forward_routed(
        &self,
        x: &Tensor,
        logits: &Tensor,
        k: usize,
        (normalize, scale): (bool, f32),
    ) -> Result<Tensor> {
        let n = self.check(x)?;
        let experts = self.dims.0;
        if logits.dims2()? != (n, experts) || !(1..=experts).contains(&k) || experts > 32 * 16 {
            bail!(
                "moe route: logits {:?}, {k} of {experts} experts",
                logits.shape()
            );
        }
        let logits = logits.to_dtype(DType::F32)?.contiguous()?;
        // SAFETY: every element is written by the routing kernel below.
        let routing = unsafe { self.dev.alloc::<i32>(2 * n * k)? };
        let stream = self.dev.cuda_stream();
        let (storage, layout) = logits.storage_and_layout();
        let logits_ptr = crate::cuda_op::address(&storage, layout, &stream)?;
        let func = self.dev.get_or_load_custom_func("moe_route", MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (e, kk, slots, norm) = (int(experts)?, int(k)?, int(n * k)?, i32::from(normalize));
        let mut launch = func.builder();
        launch
            .arg(&logits_ptr)
            .arg(&routing)
            .arg(&e)
            .arg(&kk)
            .arg(&slots)
            .arg(&norm)
            .arg(&scale);
        // SAFETY: the kernel's arguments in its order and types: `n` rows of `experts` f32
        // logits, a routing buffer of `2 n k` words.
        unsafe { launch.launch(cfg) }.w()?;
        drop(storage);
        self.launch(x, &routing, k)
    }

    /// Rows of `x`, checked to fit the tables.
    fn check(&self, x: &Tensor) -> Result<usize> {
        let (n, hidden) = x.dims2()?;
        if n == 0
            || hidden != self.dims.2
            || !x.is_contiguous()
            || !x.device().same_device(&self.device())
        {
            bail!(
                "moe gemv: input {:?} for experts of width {}",
                x.shape(),
                self.dims.2
            );
        }
        Ok(n)
    }

    /// The two expert launches over `routing` (`n k` ids, then their weights' bits).
    fn launch(&self, x: &Tensor, routing: &CudaSlice<i32>, k: usize) -> Result<Tensor> {
        let (n, hidden) = x.dims2()?;
        let y = match x.dtype() {
            DType::BF16 => self.run::<bf16>(x, routing, k)?,
            DType::F16 => self.run::<f16>(x, routing, k)?,
            other => bail!("moe gemv: {other:?} input"),
        };
        Ok(crate::cuda_op::tensor(y, (n, hidden)))
    }

    fn device(&self) -> candle_core::Device {
        candle_core::Device::Cuda(self.dev.clone())
    }

    /// The grouped launches (`moe_*_grouped`, `moe_combine`) over `moe::grouped`'s `routing`.
    fn run_grouped<T: CudaDType + DeviceRepr + candle_core::WithDType>(
        &self,
        x: &Tensor,
        routing: &CudaSlice<i32>,
        k: usize,
    ) -> Result<CudaStorage> {
        let (experts, inter, hidden) = self.dims;
        let (n, suffix, stream) = (x.dims2()?.0, suffix(T::DTYPE), self.dev.cuda_stream());
        let slots = n * k;
        // SAFETY: the rows of every used position are written by the first kernel before the
        // second reads them, and the second's before the third; unused rows are never read.
        let h = unsafe { self.dev.alloc::<f32>(slots * inter)? };
        // SAFETY: as above.
        let ys = unsafe { self.dev.alloc::<f32>(slots * hidden)? };
        // SAFETY: every element is written by the combining kernel.
        let y = unsafe { self.dev.alloc::<T>(n * hidden)? };
        let (storage, layout) = x.storage_and_layout();
        let x_ptr = crate::cuda_op::address(&storage, layout, &stream)?;
        let (e, kk, s, i, hd) = (
            int(experts)?,
            int(k)?,
            int(slots)?,
            int(inter)?,
            int(hidden)?,
        );
        let name = format!("moe_gate_up_grouped_{}_{suffix}", self.formats.0);
        let func = self.dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut launch = func.builder();
        launch
            .arg(&self.gate)
            .arg(&self.up)
            .arg(routing)
            .arg(&x_ptr)
            .arg(&h);
        launch.arg(&e).arg(&i).arg(&hd);
        // SAFETY: the kernel's arguments in its order and types; `routing` is `moe::grouped`'s.
        unsafe { launch.launch(warps(inter, experts)) }.w()?;
        let name = format!("moe_down_grouped_{}", self.formats.1);
        let func = self.dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut launch = func.builder();
        launch
            .arg(&self.down)
            .arg(routing)
            .arg(&h)
            .arg(&ys)
            .arg(&i)
            .arg(&hd);
        // SAFETY: as above.
        unsafe { launch.launch(warps(hidden, experts)) }.w()?;
        let func =
            (self.dev).get_or_load_custom_func(&format!("moe_combine_{suffix}"), MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (hidden.div_ceil(256) as u32, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = func.builder();
        launch
            .arg(routing)
            .arg(&ys)
            .arg(&y)
            .arg(&e)
            .arg(&kk)
            .arg(&s)
            .arg(&hd);
        // SAFETY: as above.
        unsafe { launch.launch(cfg) }.w()?;
        drop(storage);
        Ok(CudaStorage::wrap_cuda_slice(y, self.dev.clone()))
    }

    fn run<T: CudaDType + DeviceRepr + candle_core::WithDType>(
        &self,
        x: &Tensor,
        routing: &CudaSlice<i32>,
        k: usize,
    ) -> Result<CudaStorage> {
        let (experts, inter, hidden) = self.dims;
        let (n, suffix, stream) = (x.dims2()?.0, suffix(T::DTYPE), self.dev.cuda_stream());
        let slots = n * k;
        let (ids_ptr, _g) = routing.device_ptr(&stream);
        let weights_ptr = ids_ptr + 4 * slots as u64;
        // SAFETY: every element is written by the gate/up kernel before the down kernel reads it.
        let h = unsafe { self.dev.alloc::<f32>(slots * inter)? };
        // SAFETY: every element is written by the down kernel.
        let y = unsafe { self.dev.alloc::<T>(n * hidden)? };
        let (storage, layout) = x.storage_and_layout();
        let x_ptr = crate::cuda_op::address(&storage, layout, &stream)?;
        let (e, kk, i, hd) = (int(experts)?, int(k)?, int(inter)?, int(hidden)?);
        let name = format!("moe_gate_up_{}_{suffix}", self.formats.0);
        let func = self.dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let cfg = warps(inter, slots);
        let mut launch = func.builder();
        launch
            .arg(&self.gate)
            .arg(&self.up)
            .arg(&ids_ptr)
            .arg(&x_ptr)
            .arg(&h);
        launch.arg(&e).arg(&kk).arg(&i).arg(&hd);
        // SAFETY: the kernel's arguments in its order and types (addresses as 64-bit words):
        // tables of `experts` matrices of the checked shapes, `slots` ids, `n` input rows.
        unsafe { launch.launch(cfg) }.w()?;
        let name = format!("moe_down_{}_{suffix}", self.formats.1);
        let func = self.dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let cfg = warps(hidden, n);
        let mut launch = func.builder();
        launch
            .arg(&self.down)
            .arg(&ids_ptr)
            .arg(&weights_ptr)
            .arg(&h)
            .arg(&y);
        launch.arg(&e).arg(&kk).arg(&i).arg(&hd);
        // SAFETY: as above; `h` holds `slots` rows of `inter` written by the first kernel.
        unsafe { launch.launch(cfg) }.w()?;
        drop(storage);
        Ok(CudaStorage::wrap_cuda_slice(y, self.dev.clone()))
    }
}
