//! A growable k/v buffer shared by the cache variants. On the CPU it owns its memory, written
//! and read in place (a decode step's append and attention allocate nothing); on other devices
//! it holds candle tensors.

use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use peregrine_tensor::attention::{
    AttnScratch, CpuKv, CpuRows, MaskSpec, QuantPlane, attention, attention_kv, attention_row_into,
    quantize_rows, row_sizes,
};
use peregrine_tensor::ops::with_f32;
use peregrine_tensor::{DType, Device, Result, Tensor};

use crate::{AttnParams, KvQuant};

/// Rounds allocations up so that decode rarely reallocates.
const GROW_STEP: usize = 256;

/// Slots `0..used` hold positions `start..start + used`.
#[derive(Debug, Clone, Default)]
pub(crate) struct KvBuffer {
    store: Option<Store>,
    /// Storage dtype; `None` keeps the activations' dtype.
    pub(crate) dtype: Option<DType>,
    /// Quantize rows as they are written (the dtype is then unused).
    pub(crate) quant: Option<KvQuant>,
    pub(crate) start: usize,
    pub(crate) used: usize,
    /// Keep CPU data in tensors too, as on other devices (tests compare the two stores).
    tensors_on_cpu: bool,
    /// Store no values: each position's value is its key (DeepSeek's latent, which a model
    /// lays out so that the wanted value is the key's leading columns).
    values_are_keys: bool,
}

/// Where the keys and values live: `[kv_heads, capacity, head_dim]` each (no values when
/// they are the keys).
#[derive(Debug, Clone)]
enum Store {
    /// On the CPU, in our own buffers.
    Cpu {
        k: Plane,
        v: Option<Plane>,
        heads: usize,
        capacity: usize,
        head_dim: usize,
    },
    /// As `[1, kv_heads, capacity, head_dim]` tensors written with `slice_set`.
    Tensors(Tensor, Option<Tensor>),
}

/// Keys or values on the CPU, in the storage dtype.
#[derive(Debug, Clone)]
enum Plane {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    /// Codes and `(scale, bias)` pairs of each slot's row, as [`QuantPlane`] lays them out.
    Quant {
        codes: Vec<u8>,
        params: Vec<f16>,
        format: KvQuant,
    },
}

impl KvBuffer {
    /// An empty buffer storing k/v in `dtype` (`None`: the activations' dtype).
    pub(crate) fn new(dtype: Option<DType>) -> Self {
        Self {
            dtype,
            ..Self::default()
        }
    }

    /// [`new`](Self::new) storing keys only, each position's value being its key.
    pub(crate) fn keys_as_values(dtype: Option<DType>) -> Self {
        Self {
            values_are_keys: true,
            ..Self::new(dtype)
        }
    }

    /// [`new`](Self::new) that keeps CPU data in candle tensors, as on other devices.
    #[cfg(test)]
    fn new_on_tensors(dtype: Option<DType>) -> Self {
        Self {
            tensors_on_cpu: true,
            ..Self::new(dtype)
        }
    }

    pub(crate) fn end(&self) -> usize {
        self.start + self.used
    }

    fn capacity(&self) -> usize {
        match &self.store {
            None => 0,
            Some(Store::Cpu { capacity, .. }) => *capacity,
            Some(Store::Tensors(k, _)) => k.dims()[2],
        }
    }

    /// Appends `k, v: [1, heads, n, head_dim]`; when `keep` is set, first drops all but the
    /// last `keep` stored positions if the buffer would otherwise grow.
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor, keep: Option<usize>) -> Result<()> {
        let (_, heads, n, head_dim) = k.dims4()?;
        let dtype = self.dtype.unwrap_or(k.dtype());
        self.make_room(n, keep, (heads, head_dim), dtype, k.device())?;
        let at = self.used;
        match self.store.as_mut().expect("allocated above") {
            Store::Cpu {
                k: pk,
                v: pv,
                capacity,
                ..
            } => {
                for (plane, x) in [(Some(pk), k), (pv.as_mut(), v)] {
                    let Some(plane) = plane else { continue };
                    let x = x.to_dtype(DType::F32)?.contiguous()?;
                    let write = |x: &[f32]| plane.write(x, n * head_dim, at, *capacity, head_dim);
                    if with_f32(&x, write)?.is_none() {
                        bail("kv append: rows are not on the CPU")?;
                    }
                }
            }
            Store::Tensors(bk, bv) => {
                bk.slice_set(&k.to_dtype(bk.dtype())?.contiguous()?, 2, at)?;
                if let Some(bv) = bv {
                    bv.slice_set(&v.to_dtype(bv.dtype())?.contiguous()?, 2, at)?;
                }
            }
        }
        self.used += n;
        Ok(())
    }

    /// [`append`](Self::append) of one position from f32 rows (`heads · head_dim` each):
    /// written in place on the CPU.
    pub(crate) fn append_row(
        &mut self,
        k: &[f32],
        v: &[f32],
        head_dim: usize,
        keep: Option<usize>,
    ) -> Result<()> {
        let heads = k.len() / head_dim;
        let device = match &self.store {
            Some(Store::Tensors(k, _)) => k.device().clone(),
            _ => Device::Cpu,
        };
        let dtype = self.dtype.unwrap_or(DType::F32);
        self.make_room(1, keep, (heads, head_dim), dtype, &device)?;
        let at = self.used;
        if let Some(Store::Cpu {
            k: pk,
            v: pv,
            capacity,
            ..
        }) = &mut self.store
        {
            pk.write(k, head_dim, at, *capacity, head_dim);
            if let Some(pv) = pv {
                pv.write(v, head_dim, at, *capacity, head_dim);
            }
            self.used += 1;
            return Ok(());
        }
        let t = |x: &[f32]| Tensor::from_slice(x, (1, heads, 1, head_dim), &device);
        self.append(&t(k)?, &t(v)?, keep)
    }

    /// Makes room for `n` more positions of `(heads, head_dim)`, dropping all but the last
    /// `keep` stored positions first when the buffer would otherwise grow.
    fn make_room(
        &mut self,
        n: usize,
        keep: Option<usize>,
        (heads, head_dim): (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        if self.used + n <= self.capacity() {
            return Ok(());
        }
        let kept = keep.map_or(self.used, |keep| keep.min(self.used));
        // Once positions start dropping, room for two windows makes moves rare; before
        // that, grow in steps (a short prompt should not zero a whole window's pages).
        let want = match keep {
            Some(keep) if kept + n > keep => (kept + n).max(2 * keep),
            _ => kept + n,
        };
        let capacity = want.div_ceil(GROW_STEP) * GROW_STEP;
        self.relayout(kept, capacity, (heads, head_dim), dtype, device)
    }

    /// [`make_room`](Self::make_room) in a buffer of exactly `keep + n + slack` slots once
    /// positions can be dropped, re-laid out when full or more than `slack` larger: for a cache
    /// that must not hold a growth step's spare slots (TurboQuant's uncompressed window).
    pub(crate) fn make_room_tight(
        &mut self,
        n: usize,
        keep: usize,
        slack: usize,
        (heads, head_dim): (usize, usize),
        device: &Device,
    ) -> Result<()> {
        let kept = keep.min(self.used);
        let (capacity, want) = (self.capacity(), kept + n + slack);
        let droppable = kept < self.used;
        if self.used + n <= capacity && (capacity <= want + slack || !droppable) {
            return Ok(());
        }
        // Nothing to drop (a sequence still below the threshold): grow in steps, not per token.
        let capacity = match droppable {
            true => want,
            false => want.div_ceil(GROW_STEP) * GROW_STEP,
        };
        let dtype = self.dtype.unwrap_or(DType::F32);
        self.relayout(kept, capacity, (heads, head_dim), dtype, device)
    }

    /// Keeps the last `kept` stored positions at the start of a buffer of `capacity` slots.
    fn relayout(
        &mut self,
        kept: usize,
        capacity: usize,
        (heads, head_dim): (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        let from = self.used - kept;
        let moved = from..self.used;
        let values = !self.values_are_keys;
        let quant = self.quant;
        let store = match self.store.take() {
            None if device.is_cpu() && !self.tensors_on_cpu => {
                let plane = || match quant {
                    Some(q) => Plane::quantized(q, heads * capacity, head_dim),
                    None => Plane::zeros(dtype, heads * capacity * head_dim),
                };
                Store::Cpu {
                    k: plane()?,
                    v: values.then(plane).transpose()?,
                    heads,
                    capacity,
                    head_dim,
                }
            }
            None if quant.is_some() => bail(&format!(
                "quantized KV (--kv-bits) is implemented on the CPU only, not on {device:?}"
            ))?,
            None => {
                let k = Tensor::zeros((1, heads, capacity, head_dim), dtype, device)?;
                let v = values.then(|| k.zeros_like()).transpose()?;
                Store::Tensors(k, v)
            }
            Some(Store::Cpu {
                k,
                v,
                capacity: old,
                ..
            }) => Store::Cpu {
                k: k.regrown(old, capacity, moved.clone(), head_dim),
                v: v.map(|v| v.regrown(old, capacity, moved, head_dim)),
                heads,
                capacity,
                head_dim,
            },
            Some(Store::Tensors(k, v)) => {
                let regrown = |x: &Tensor| -> Result<Tensor> {
                    let new = Tensor::zeros((1, heads, capacity, head_dim), x.dtype(), x.device())?;
                    new.slice_set(&x.narrow(2, from, kept)?.contiguous()?, 2, 0)?;
                    Ok(new)
                };
                Store::Tensors(regrown(&k)?, v.as_ref().map(regrown).transpose()?)
            }
        };
        self.store = Some(store);
        self.start += from;
        self.used = kept;
        Ok(())
    }

    /// The slots the last `q_len` positions' queries may see, and their mask.
    fn visible(
        &self,
        q_len: usize,
        window: Option<usize>,
        both_ways: Option<(usize, usize)>,
    ) -> (Range<usize>, MaskSpec) {
        let q_start = self.end() - q_len;
        // Keys older than the window are never visible: skip them instead of masking them.
        let first = window.map_or(self.start, |w| {
            (q_start + 1).saturating_sub(w).max(self.start)
        });
        let mask = MaskSpec {
            q_start,
            k_start: first,
            window,
            both_ways,
        };
        (first - self.start..self.used, mask)
    }

    /// Attends the queries of the last `q.dim(2)` positions over the stored keys they may see.
    pub(crate) fn attend(
        &self,
        q: &Tensor,
        params: &AttnParams,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let (slots, mask) = self.visible(q.dim(2)?, window, params.both_ways);
        match &self.store {
            None => bail("attend called on an empty cache"),
            Some(Store::Cpu { .. }) => {
                let kv = self.cpu_kv()?;
                attention_kv(q, &kv, slots, params.scale, params.softcap, &mask)
            }
            Some(Store::Tensors(k, v)) => {
                let k = k.narrow(2, slots.start, slots.len())?;
                let v = match v {
                    Some(v) => v.narrow(2, slots.start, slots.len())?,
                    None => k.clone(),
                };
                attention(q, &k, &v, params.scale, params.softcap, &mask)
            }
        }
    }

    /// The stored keys and values the last position sees (`window`: as [`attend`](Self::attend)
    /// takes it), where they are plain tensors; see `LayerCache::decode_kv`.
    pub(crate) fn decode_kv(&self, window: Option<usize>) -> Option<(Tensor, Tensor)> {
        let (slots, _) = self.visible(1, window, None);
        let Some(Store::Tensors(k, v)) = &self.store else {
            return None;
        };
        let k = k.narrow(2, slots.start, slots.len()).ok()?;
        let v = match v {
            Some(v) => v.narrow(2, slots.start, slots.len()).ok()?,
            None => k.clone(),
        };
        Some((k, v))
    }

    /// [`attend`](Self::attend) for the last position's query heads `q` into `out`; on the
    /// CPU without allocating once `scratch` has grown.
    pub(crate) fn attend_row(
        &self,
        q: &[f32],
        head_dim: usize,
        params: &AttnParams,
        window: Option<usize>,
        (out, scratch): (&mut [f32], &mut AttnScratch),
    ) -> Result<()> {
        let (slots, mask) = self.visible(1, window, None);
        match &self.store {
            None => bail("attend called on an empty cache"),
            Some(Store::Cpu { .. }) => {
                let kv = self.cpu_kv()?;
                let (scale, cap) = (params.scale, params.softcap);
                attention_row_into(q, &kv, slots, scale, cap, &mask, out, scratch)
            }
            Some(Store::Tensors(k, _)) => {
                let shape = (1, q.len() / head_dim, 1, head_dim);
                let q = Tensor::from_slice(q, shape, k.device())?;
                let y = self.attend(&q, params, window)?.flatten_all()?;
                out.copy_from_slice(&y.to_dtype(DType::F32)?.to_vec1::<f32>()?);
                Ok(())
            }
        }
    }

    /// The CPU f16 planes `(k, v, capacity)`, `[heads, capacity, head_dim]` each; `None` for
    /// other stores.
    pub(crate) fn f16_planes(&self) -> Option<(&[f16], &[f16], usize)> {
        match &self.store {
            Some(Store::Cpu {
                k: Plane::F16(k),
                v: Some(Plane::F16(v)),
                capacity,
                ..
            }) => Some((k, v, *capacity)),
            _ => None,
        }
    }

    fn cpu_kv(&self) -> Result<CpuKv<'_>> {
        match &self.store {
            Some(Store::Cpu {
                k,
                v,
                heads,
                capacity,
                head_dim,
            }) => {
                let v = v.as_ref().unwrap_or(k);
                CpuKv::new(k.rows(), v.rows(), *heads, *capacity, *head_dim)
            }
            _ => bail("kv: not a CPU buffer"),
        }
    }

    pub(crate) fn trim(&mut self, n: usize) {
        self.used -= n;
    }

    pub(crate) fn bytes(&self) -> usize {
        match &self.store {
            None => 0,
            Some(Store::Cpu { k, v, .. }) => k.bytes() + v.as_ref().map_or(0, Plane::bytes),
            Some(Store::Tensors(k, v)) => {
                let v = v.as_ref().map_or(0, Tensor::elem_count);
                (k.elem_count() + v) * k.dtype().size_in_bytes()
            }
        }
    }

    /// A deep copy: tensors are written in place, so sharing their storage would alias.
    pub(crate) fn deep_copy(&self) -> Result<Self> {
        let store = match &self.store {
            Some(Store::Tensors(k, v)) => Some(Store::Tensors(
                k.copy()?,
                v.as_ref().map(Tensor::copy).transpose()?,
            )),
            other => other.clone(),
        };
        Ok(Self {
            store,
            ..self.clone()
        })
    }
}

impl Plane {
    fn zeros(dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => Self::F32(vec![0.0; len]),
            DType::F16 => Self::F16(vec![f16::ZERO; len]),
            DType::BF16 => Self::BF16(vec![bf16::ZERO; len]),
            other => bail(&format!(
                "kv cache: {other:?} storage (f32, f16 or bf16 on the CPU)"
            ))?,
        })
    }

    /// `rows` slots of `head_dim` values quantized as `format` says.
    fn quantized(format: KvQuant, rows: usize, head_dim: usize) -> Result<Self> {
        format
            .check(head_dim)
            .map_err(|e| peregrine_tensor::candle::Error::Msg(format!("kv cache: {e}")))?;
        let (code_bytes, params) = Self::quant_row(format, head_dim);
        Ok(Self::Quant {
            codes: vec![0; rows * code_bytes],
            params: vec![f16::ZERO; rows * params],
            format,
        })
    }

    /// Code bytes and parameters per row of `head_dim` values.
    fn quant_row(format: KvQuant, head_dim: usize) -> (usize, usize) {
        row_sizes(head_dim, format.bits, format.group_size)
    }

    fn rows(&self) -> CpuRows<'_> {
        match self {
            Self::F32(x) => CpuRows::F32(x),
            Self::F16(x) => CpuRows::F16(x),
            Self::BF16(x) => CpuRows::BF16(x),
            Self::Quant {
                codes,
                params,
                format,
            } => CpuRows::Quant(QuantPlane {
                codes,
                params,
                bits: format.bits,
                group: format.group_size,
            }),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::F32(x) => x.len() * 4,
            Self::F16(x) => x.len() * 2,
            Self::BF16(x) => x.len() * 2,
            Self::Quant { codes, params, .. } => codes.len() + params.len() * 2,
        }
    }

    /// Writes `src`, one run of `run` values per head, from slot `at` of each head.
    fn write(&mut self, src: &[f32], run: usize, at: usize, capacity: usize, head_dim: usize) {
        fn put<T>(
            dst: &mut [T],
            src: &[f32],
            run: usize,
            first: impl Fn(usize) -> usize,
            f: impl Fn(f32) -> T,
        ) {
            for (h, src) in src.chunks_exact(run).enumerate() {
                let dst = &mut dst[first(h)..][..run];
                dst.iter_mut().zip(src).for_each(|(d, &x)| *d = f(x));
            }
        }
        let first = |h: usize| (h * capacity + at) * head_dim;
        match self {
            Self::F32(d) => put(d, src, run, first, |x| x),
            // Whole runs at once: half's slice conversion rounds as one by one does, with
            // F16C eight values at a time (per value it was 2.3 % of an 8-sequence step).
            Self::F16(d) => {
                for (h, src) in src.chunks_exact(run).enumerate() {
                    d[first(h)..][..run].convert_from_f32_slice(src);
                }
            }
            Self::BF16(d) => put(d, src, run, first, bf16::from_f32),
            Self::Quant {
                codes,
                params,
                format,
            } => {
                let (cb, pb) = Self::quant_row(*format, head_dim);
                let (bits, group) = (format.bits, format.group_size);
                let rows = run / head_dim;
                for (h, src) in src.chunks_exact(run).enumerate() {
                    let slot = h * capacity + at;
                    let codes = &mut codes[slot * cb..][..rows * cb];
                    let params = &mut params[slot * pb..][..rows * pb];
                    quantize_rows(src, head_dim, bits, group, codes, params);
                }
            }
        }
    }

    /// A plane of `capacity` slots per head holding slots `moved` of this one (of `old` slots
    /// per head) at its start.
    fn regrown(self, old: usize, capacity: usize, moved: Range<usize>, head_dim: usize) -> Self {
        fn regrow<T: Copy + Default>(
            x: Vec<T>,
            old: usize,
            capacity: usize,
            moved: Range<usize>,
            d: usize,
        ) -> Vec<T> {
            let heads = x.len() / (old * d);
            let mut grown = vec![T::default(); heads * capacity * d];
            for h in 0..heads {
                let src = &x[(h * old + moved.start) * d..(h * old + moved.end) * d];
                grown[h * capacity * d..][..src.len()].copy_from_slice(src);
            }
            grown
        }
        match self {
            Self::F32(x) => Self::F32(regrow(x, old, capacity, moved, head_dim)),
            Self::F16(x) => Self::F16(regrow(x, old, capacity, moved, head_dim)),
            Self::BF16(x) => Self::BF16(regrow(x, old, capacity, moved, head_dim)),
            Self::Quant {
                codes,
                params,
                format,
            } => {
                let (cb, pb) = Self::quant_row(format, head_dim);
                Self::Quant {
                    codes: regrow(codes, old, capacity, moved.clone(), cb),
                    params: regrow(params, old, capacity, moved, pb),
                    format,
                }
            }
        }
    }
}

fn bail<T>(msg: &str) -> Result<T> {
    Err(peregrine_tensor::candle::Error::Msg(msg.to_string()))
}

mod slots;
#[cfg(test)]
#[path = "buffer_tests.rs"]
mod tests;
