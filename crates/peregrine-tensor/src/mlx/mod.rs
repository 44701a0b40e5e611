//! MLX affine-quantized weights: `w = scale * q + bias` per group of `group_size` inputs, with the
//! `bits`-wide unsigned `q` packed as a little-endian bit stream over u32 words (values cross word
//! boundaries for 3, 5 and 6 bits). The CPU path never materialises the dequantized matrix:
//! decode (one input row) computes dot products group by group straight from the packed words;
//! batches dequantize a block of rows to f32 scratch, multiply it, and move on. Scales and biases
//! stay in their stored dtype (bf16, f16 or f32) and are widened one group at a time, so resident
//! memory is the checkpoint's size.

#[cfg(feature = "cuda")]
mod cuda;
mod kernels;
mod regroup;

use candle_core::{DType, Device, Layout, Result, Storage, Tensor, bail};
use half::{bf16, f16};
use rayon::prelude::*;

pub use kernels::{Kernel, avx2_available};
use kernels::{ScaleType, row_dot};

/// Bit widths MLX's affine mode supports.
pub const SUPPORTED_BITS: [usize; 6] = [2, 3, 4, 5, 6, 8];

/// f32 elements of dequantized scratch per tile (4 MiB): large enough for efficient matmuls,
/// small enough to stay in L2/L3 instead of growing with the weight.
const SCRATCH_ELEMS: usize = 1 << 20;

/// An MLX affine-quantized matrix, logical shape `[out, in]`.
#[derive(Debug, Clone)]
pub struct MlxQuantized {
    /// Packed codes, u32 `[out, in * bits / 32]`, contiguous.
    packed: Tensor,
    /// Per-group scales `[out, in / group_size]` in their stored float dtype, contiguous.
    scales: Tensor,
    /// Per-group biases, same shape and dtype as `scales`, contiguous.
    biases: Tensor,
    bits: usize,
    group_size: usize,
    in_dim: usize,
}

impl MlxQuantized {
    /// Wraps MLX's `weight` (u32), `scales` and `biases`. bf16, f16 and f32 scales are kept as
    /// stored (the kernels widen them per group); biases take the scales' dtype (MLX stores both
    /// alike); other float dtypes become f32.
    pub fn new(
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        bits: usize,
        group_size: usize,
    ) -> Result<Self> {
        if !SUPPORTED_BITS.contains(&bits) || !matches!(group_size, 32 | 64 | 128) {
            bail!("mlx: unsupported bits {bits} / group {group_size} (2-6, 8 / 32, 64, 128)");
        }
        let (out, words) = packed.dims2()?;
        let in_dim = words * 32 / bits;
        let fits = (words * 32).is_multiple_of(bits) && in_dim.is_multiple_of(group_size);
        if packed.dtype() != DType::U32 || !fits {
            let dt = packed.dtype();
            bail!("mlx: packed {dt:?} [{out}, {words}] misfits {bits} bits, group {group_size}");
        }
        let groups = [out, in_dim / group_size];
        for (name, t) in [("scales", &scales), ("biases", &biases)] {
            if t.dims() != groups {
                bail!("mlx: {name} have shape {:?}, expected {groups:?}", t.dims());
            }
        }
        let dtype = match scales.dtype() {
            d @ (DType::BF16 | DType::F16 | DType::F32) => d,
            _ => DType::F32,
        };
        Ok(Self {
            packed: packed.contiguous()?,
            scales: scales.to_dtype(dtype)?.contiguous()?,
            biases: biases.to_dtype(dtype)?.contiguous()?,
            bits,
            group_size,
            in_dim,
        })
    }

    /// Logical `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.packed.dim(0).unwrap_or(0), self.in_dim)
    }

    /// `(bits per code, inputs per scale/bias pair)`.
    pub fn params(&self) -> (usize, usize) {
        (self.bits, self.group_size)
    }

    /// `(packed u32, scales, biases)`, shaped and typed as MLX stores them.
    pub fn parts(&self) -> (&Tensor, &Tensor, &Tensor) {
        (&self.packed, &self.scales, &self.biases)
    }

    /// Quantizes `w: [out, in]` with MLX's affine algorithm (codes span each group's range, the
    /// extreme of larger magnitude exact); scales and biases are rounded to bf16 (what MLX files
    /// store) before the codes are chosen, so the codes fit the stored values.
    pub fn quantize(w: &Tensor, bits: usize, group_size: usize) -> Result<Self> {
        let (out, in_dim) = w.dims2()?;
        if !in_dim.is_multiple_of(group_size) || !SUPPORTED_BITS.contains(&bits) {
            bail!("mlx: cannot quantize [{out}, {in_dim}] with {bits} bits, group {group_size}");
        }
        let w = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let levels = ((1u32 << bits) - 1) as f32;
        let (mut scales, mut biases) = (vec![], vec![]);
        for g in w.chunks(group_size) {
            let lo = g.iter().copied().fold(f32::MAX, f32::min);
            let hi = g.iter().copied().fold(f32::MIN, f32::max);
            // As MLX: the extreme of larger magnitude is exact, so scales may be negative.
            let edge = if lo.abs() > hi.abs() { lo } else { hi };
            let step = ((hi - lo) / levels).max(1e-7).copysign(-edge);
            let q0 = (edge / step).round();
            let (s, b) = match q0 == 0.0 {
                true => (step, 0.0),
                false => (edge / q0, edge),
            };
            scales.push(s);
            biases.push(b);
        }
        let round = |v: Vec<f32>| -> Vec<f32> {
            v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
        };
        let (scales, biases) = (round(scales), round(biases));
        let words_per_row = in_dim * bits / 32;
        let mut packed = vec![0u32; out * words_per_row];
        packed
            .par_chunks_mut(words_per_row)
            .zip(w.par_chunks(in_dim))
            .enumerate()
            .for_each(|(r, (words, row))| {
                for (i, &v) in row.iter().enumerate() {
                    let g = r * (in_dim / group_size) + i / group_size;
                    let q = ((v - biases[g]) / scales[g]).round().clamp(0.0, levels) as u64;
                    // Codes are a little-endian bit stream; a u64 window covers word straddles.
                    let (bit, word, q) = (i * bits % 32, i * bits / 32, q << (i * bits % 32));
                    words[word] |= q as u32;
                    if bit + bits > 32 {
                        words[word + 1] |= (q >> 32) as u32;
                    }
                }
            });
        let groups = (out, in_dim / group_size);
        let stored = |v: Vec<f32>| Tensor::from_vec(v, groups, &Device::Cpu)?.to_dtype(DType::BF16);
        Self::new(
            Tensor::from_vec(packed, (out, words_per_row), &Device::Cpu)?,
            stored(scales)?,
            stored(biases)?,
            bits,
            group_size,
        )
    }

    /// Bytes held in memory (packed codes + scales and biases in their stored dtype).
    pub fn weight_bytes(&self) -> usize {
        let parts = [&self.packed, &self.scales, &self.biases];
        parts.map(crate::linear::tensor_bytes).iter().sum()
    }

    /// The whole f32 matrix `[out, in]`, decoded bit by bit: the slow, obviously-right reference
    /// the fused kernels are tested against.
    pub fn dequantize_ref(&self) -> Result<Tensor> {
        let (out, in_dim) = self.dims();
        let words = self.packed.to_vec2::<u32>()?;
        let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec2::<f32>();
        let (scales, biases) = (f32s(&self.scales)?, f32s(&self.biases)?);
        let mut w = Vec::with_capacity(out * in_dim);
        for r in 0..out {
            for i in 0..in_dim {
                let mut q = 0u32;
                for b in 0..self.bits {
                    let bit = i * self.bits + b;
                    q |= ((words[r][bit / 32] >> (bit % 32)) & 1) << b;
                }
                let g = i / self.group_size;
                w.push(scales[r][g] * q as f32 + biases[r][g]);
            }
        }
        Tensor::from_vec(w, (out, in_dim), self.packed.device())
    }

    /// Reference `x: [.., in]` → `[.., out]`: dequantize everything, then a candle matmul.
    pub fn forward_ref(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.dequantize_ref()?.to_dtype(x.dtype())?;
        crate::linear::dense_matmul(x, &w)
    }

    /// `x: [.., in]` → `[.., out]` in `x`'s dtype; computes in f32. CPU and CUDA use their fused
    /// kernels, other devices the reference path.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, 0, Kernel::best())
    }

    /// [`forward`](Self::forward) with `tile_rows` output rows per dequantized tile for batches
    /// (0 picks a size from the scratch budget); exposed so tests can make tiles not divide `out`.
    pub fn forward_tiled(&self, x: &Tensor, tile_rows: usize) -> Result<Tensor> {
        self.forward_with(x, tile_rows, Kernel::best())
    }

    /// [`forward_tiled`](Self::forward_tiled) with the decode kernel chosen: tests use
    /// [`Kernel::Scalar`] to check the portable path on machines that have AVX2.
    pub fn forward_with(&self, x: &Tensor, tile_rows: usize, kernel: Kernel) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return cuda::matmul(self, x);
        }
        if !matches!(x.device(), Device::Cpu) {
            return self.forward_ref(x);
        }
        let (out, in_dim) = self.dims();
        let mut dims = x.dims().to_vec();
        if dims.last() != Some(&in_dim) {
            bail!("mlx: input shape {dims:?} does not end in {in_dim}");
        }
        let m = x.elem_count() / in_dim;
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let y = match m {
            1 => Tensor::from_vec(self.matvec(&xs, kernel)?, (1, out), &Device::Cpu)?,
            _ => {
                let xt = Tensor::from_vec(xs, (m, in_dim), &Device::Cpu)?;
                let tile = match tile_rows {
                    0 => (SCRATCH_ELEMS / in_dim).clamp(16, out.max(16)),
                    t => t,
                };
                let parts = (0..out)
                    .step_by(tile)
                    .map(|r0| {
                        let w = self.dequantize_rows_with(r0, (r0 + tile).min(out), kernel)?;
                        xt.matmul(&w.t()?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 1)?
            }
        };
        *dims.last_mut().expect("checked above") = out;
        y.reshape(dims)?.to_dtype(x.dtype())
    }

    /// Rows `r0..r1` dequantized to f32 `[r1 - r0, in]` with the fused decoder (rows in parallel).
    pub fn dequantize_rows(&self, r0: usize, r1: usize) -> Result<Tensor> {
        self.dequantize_rows_with(r0, r1, Kernel::best())
    }

    /// [`dequantize_rows`](Self::dequantize_rows) with the kernel chosen (tests force
    /// [`Kernel::Scalar`]); every kernel gives the reference's values bit for bit.
    pub fn dequantize_rows_with(&self, r0: usize, r1: usize, kernel: Kernel) -> Result<Tensor> {
        let mut w = vec![0f32; (r1 - r0) * self.in_dim];
        let path = kernel.path(self.bits);
        self.with_view(|v| {
            with_scales!(v.sb, s, b => w
                .par_chunks_mut(self.in_dim)
                .enumerate()
                .for_each(|(i, row)| v.dequantize_row(path, s, b, r0 + i, row)))
        })?;
        Tensor::from_vec(w, (r1 - r0, self.in_dim), &Device::Cpu)
    }

    /// Rows selected by `ids` (embedding lookup), f32 `[ids.len(), in]`; other rows stay packed.
    pub fn gather_rows(&self, ids: &[u32]) -> Result<Tensor> {
        let out = self.dims().0;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= out) {
            bail!("mlx: row {bad} out of range for {out} rows");
        }
        #[cfg(feature = "cuda")]
        if self.packed.device().is_cuda() {
            let idx = Tensor::new(ids, self.packed.device())?;
            return cuda::dequantize(self, Some(&idx), DType::F32);
        }
        if !matches!(self.packed.device(), Device::Cpu) {
            let idx = Tensor::new(ids, self.packed.device())?;
            return self.dequantize_ref()?.index_select(&idx, 0);
        }
        let mut w = vec![0f32; ids.len() * self.in_dim];
        let path = Kernel::best().path(self.bits);
        self.with_view(|v| {
            with_scales!(v.sb, s, b => w
                .par_chunks_mut(self.in_dim)
                .zip(ids.par_iter())
                .for_each(|(row, &id)| v.dequantize_row(path, s, b, id as usize, row)))
        })?;
        Tensor::from_vec(w, (ids.len(), self.in_dim), &Device::Cpu)
    }

    /// Decode: `y[r] = Σ_g scale[r,g]·(q[r,g]·x[g]) + bias[r,g]·Σx[g]`, output rows split into
    /// chunks that rayon spreads over its threads.
    fn matvec(&self, x: &[f32], kernel: Kernel) -> Result<Vec<f32>> {
        Ok(Self::matvec_group(&[self], x, kernel)?.remove(0))
    }

    /// [`matvec`](Self::matvec) through matrices of one input width, bit width and group size,
    /// as one parallel pass: `x` is prepared once and every matrix's row chunks share the pool.
    fn matvec_group(mats: &[&Self], x: &[f32], kernel: Kernel) -> Result<Vec<Vec<f32>>> {
        let Some(first) = mats.first() else {
            return Ok(Vec::new());
        };
        let path = kernel.path(first.bits);
        // Σx per group is shared by every row: the bias term costs one multiply per group.
        let xsum: Vec<f32> = x.chunks(first.group_size).map(|c| c.iter().sum()).collect();
        let xp = path.prepare(x, first.group_size);
        let guards: Vec<_> = mats.iter().map(|w| w.guards()).collect();
        let views = (mats.iter().zip(&guards))
            .map(|(w, g)| w.view(g))
            .collect::<Result<Vec<_>>>()?;
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; w.dims().0]).collect();
        let total: usize = ys.iter().map(Vec::len).sum();
        let chunk = rows_per_task(total);
        let tasks: Vec<(usize, usize, &mut [f32])> = (ys.iter_mut().enumerate())
            .flat_map(|(m, y)| {
                (y.chunks_mut(chunk).enumerate()).map(move |(c, ys)| (m, c * chunk, ys))
            })
            .collect();
        tasks.into_par_iter().for_each(|(m, r0, ys)| {
            let v = &views[m];
            with_scales!(v.sb, s, b => for (i, y) in ys.iter_mut().enumerate() {
                *y = row_dot(path, v, s, b, r0 + i, &xp, &xsum);
            })
        });
        Ok(ys)
    }

    /// [`forward`](Self::forward) through several matrices of the same input: a single input
    /// row (decode) through matrices of one format runs as one parallel pass (q/k/v, or
    /// gate/up, cost one dispatch); anything else runs matrix by matrix.
    pub fn forward_group(mats: &[&Self], x: &Tensor) -> Result<Vec<Tensor>> {
        let Some(first) = mats.first() else {
            return Ok(Vec::new());
        };
        let alike = mats.iter().all(|w| {
            (w.bits, w.group_size, w.in_dim) == (first.bits, first.group_size, first.in_dim)
        });
        let one_row = x.dims().last() == Some(&first.in_dim) && x.elem_count() == first.in_dim;
        if !alike || !one_row || !matches!(x.device(), Device::Cpu) {
            return mats.iter().map(|w| w.forward(x)).collect();
        }
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let ys = Self::matvec_group(mats, &xs, Kernel::best())?;
        (mats.iter().zip(ys))
            .map(|(w, y)| {
                let mut dims = x.dims().to_vec();
                *dims.last_mut().expect("checked above") = w.dims().0;
                Tensor::from_vec(y, dims, &Device::Cpu)?.to_dtype(x.dtype())
            })
            .collect()
    }

    /// Runs `f` over borrowed CPU slices of the three tensors (the storage guards live here).
    fn with_view<R>(&self, f: impl FnOnce(&CpuView) -> R) -> Result<R> {
        let guards = self.guards();
        Ok(f(&self.view(&guards)?))
    }

    /// Read guards on the three tensors' storage, for [`MlxQuantized::view`].
    fn guards(&self) -> [(impl std::ops::Deref<Target = Storage> + '_, &Layout); 3] {
        [&self.packed, &self.scales, &self.biases].map(|t| t.storage_and_layout())
    }

    /// Borrowed CPU slices of the three tensors under `guards`.
    fn view<'a, G: std::ops::Deref<Target = Storage>>(
        &self,
        guards: &'a [(G, &Layout); 3],
    ) -> Result<CpuView<'a>> {
        let [p, s, b] = guards;
        let packed = cpu_slice::<u32>(&p.0, p.1)?;
        let sb = Sb::of(self.scales.dtype(), (&s.0, s.1), (&b.0, b.1))?;
        Ok(CpuView::new(
            packed,
            sb,
            self.bits,
            self.group_size,
            self.in_dim,
        ))
    }
}

/// Rows per rayon task for the mat-vec: about 8 tasks per thread (load balance), at least 8 rows
/// (amortises the task overhead), at most 128.
fn rows_per_task(out: usize) -> usize {
    out.div_ceil(rayon::current_num_threads() * 8).clamp(8, 128)
}

/// Scales and biases as stored: both slices have the same element type.
#[derive(Clone, Copy)]
enum Sb<'a> {
    F32(&'a [f32], &'a [f32]),
    Bf16(&'a [bf16], &'a [bf16]),
    F16(&'a [f16], &'a [f16]),
}

impl<'a> Sb<'a> {
    /// Rows `rows` of `groups` groups each.
    fn rows(self, rows: std::ops::Range<usize>, groups: usize) -> Self {
        let g = rows.start * groups..rows.end * groups;
        match self {
            Sb::F32(s, b) => Sb::F32(&s[g.clone()], &b[g]),
            Sb::Bf16(s, b) => Sb::Bf16(&s[g.clone()], &b[g]),
            Sb::F16(s, b) => Sb::F16(&s[g.clone()], &b[g]),
        }
    }

    /// The scale and bias slices of CPU storages holding `dtype` (bf16, f16, else f32).
    fn of(dtype: DType, s: (&'a Storage, &Layout), b: (&'a Storage, &Layout)) -> Result<Self> {
        Ok(match dtype {
            DType::BF16 => Sb::Bf16(cpu_slice(s.0, s.1)?, cpu_slice(b.0, b.1)?),
            DType::F16 => Sb::F16(cpu_slice(s.0, s.1)?, cpu_slice(b.0, b.1)?),
            _ => Sb::F32(cpu_slice(s.0, s.1)?, cpu_slice(b.0, b.1)?),
        })
    }
}

/// Runs `$body` with `$s`, `$b` bound to the typed scale and bias slices of `$sb` (the body is
/// compiled once per dtype, so the per-group widening is inlined).
macro_rules! with_scales {
    ($sb:expr, $s:ident, $b:ident => $body:expr) => {
        match $sb {
            Sb::F32($s, $b) => $body,
            Sb::Bf16($s, $b) => $body,
            Sb::F16($s, $b) => $body,
        }
    };
}
use with_scales;

/// Borrowed CPU slices of the three tensors, shareable across rayon workers.
struct CpuView<'a> {
    packed: &'a [u32],
    sb: Sb<'a>,
    bits: usize,
    group_size: usize,
    groups: usize,
    words_per_row: usize,
}

impl<'a> CpuView<'a> {
    fn new(packed: &'a [u32], sb: Sb<'a>, bits: usize, group_size: usize, in_dim: usize) -> Self {
        Self {
            packed,
            sb,
            bits,
            group_size,
            groups: in_dim / group_size,
            words_per_row: in_dim * bits / 32,
        }
    }

    /// Codes of group `g` of row `r` into `q` (as f32). Every group starts on a word boundary
    /// because `group_size * bits` is a multiple of 32 for every supported pair.
    fn unpack(&self, r: usize, g: usize, q: &mut [f32]) {
        let words = self.words(r, g);
        match self.bits {
            2 => unpack_stream::<2>(words, q),
            3 => unpack_stream::<3>(words, q),
            4 => unpack_stream::<4>(words, q),
            5 => unpack_stream::<5>(words, q),
            6 => unpack_stream::<6>(words, q),
            _ => unpack_stream::<8>(words, q),
        }
    }

    /// The packed words of row `r`.
    fn row_words(&self, r: usize) -> &[u32] {
        &self.packed[r * self.words_per_row..(r + 1) * self.words_per_row]
    }

    fn words(&self, r: usize, g: usize) -> &[u32] {
        let per_group = self.group_size * self.bits / 32;
        let start = r * self.words_per_row + g * per_group;
        &self.packed[start..start + per_group]
    }

    /// `Σ q·x` over group `g` of row `r`; widths dividing 32 multiply straight from the words
    /// (twice as fast as unpacking to a buffer first, measured at 4 bits).
    fn group_dot(&self, r: usize, g: usize, q: &mut [f32], x: &[f32]) -> f32 {
        match self.bits {
            2 => dot_packed::<2>(self.words(r, g), x),
            4 => dot_packed::<4>(self.words(r, g), x),
            8 => dot_packed::<8>(self.words(r, g), x),
            _ => {
                self.unpack(r, g, q);
                dot(q, x)
            }
        }
    }

    /// Row `r` as f32: `s·q + b` (multiply, then add: no fused rounding, so every path equals
    /// [`MlxQuantized::dequantize_ref`] exactly).
    fn dequantize_row<S: ScaleType>(
        &self,
        path: kernels::Path,
        s: &[S],
        b: &[S],
        r: usize,
        row: &mut [f32],
    ) {
        let groups = r * self.groups..(r + 1) * self.groups;
        if kernels::dequantize_row(path, self.row_words(r), &s[groups.clone()], &b[groups], row) {
            return;
        }
        for (g, w) in row.chunks_mut(self.group_size).enumerate() {
            self.unpack(r, g, w);
            let i = r * self.groups + g;
            let (s, b) = (s[i].widen(), b[i].widen());
            w.iter_mut().for_each(|v| *v = s * *v + b);
        }
    }
}

/// Codes of any width from a 64-bit window refilled one word at a time (3, 5, 6 straddle words).
fn unpack_stream<const BITS: usize>(words: &[u32], q: &mut [f32]) {
    let mask = (1u64 << BITS) - 1;
    let (mut acc, mut have, mut next) = (0u64, 0usize, 0usize);
    for o in q.iter_mut() {
        if have < BITS {
            acc |= (words[next] as u64) << have;
            next += 1;
            have += 32;
        }
        *o = (acc & mask) as f32;
        acc >>= BITS;
        have -= BITS;
    }
}

/// `Σ q·x` for widths dividing 32, codes read in place; 8 accumulators as in [`dot`].
fn dot_packed<const BITS: usize>(words: &[u32], x: &[f32]) -> f32 {
    let (per_word, mask) = (32 / BITS, (1u32 << BITS) - 1);
    let mut acc = [0f32; 8];
    for (w, xs) in words.iter().zip(x.chunks_exact(per_word)) {
        for (k, xk) in xs.iter().enumerate() {
            acc[k % 8] += ((w >> (BITS * k)) & mask) as f32 * xk;
        }
    }
    acc.iter().sum()
}

/// Dot product with 8 independent accumulators so the compiler can vectorise it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The contiguous CPU slice behind a storage guard ([`MlxQuantized::new`] made it contiguous).
fn cpu_slice<'a, T: candle_core::WithDType>(
    storage: &'a Storage,
    layout: &Layout,
) -> Result<&'a [T]> {
    let Storage::Cpu(cpu) = storage else {
        bail!("mlx: fused kernels need CPU tensors");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("mlx: tensor is not contiguous");
    };
    Ok(&T::cpu_storage_as_slice(cpu)?[start..end])
}
