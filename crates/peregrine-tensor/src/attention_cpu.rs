//! Attention on CPU without candle ops: per query row, scores against the visible keys only
//! (causal and window limits become loop bounds, not a mask), softmax, and the weighted sum of
//! values, read straight from the cache's strided f32/f16/bf16 storage (no widened copy). Query
//! rows run in parallel on rayon's pool; AVX2/FMA/F16C when the CPU has them.

use candle_core::{CpuStorage, DType, Device, Layout, Result, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::attention::MaskSpec;

/// Multiply-adds per rayon task: below this, splitting costs more than it saves.
const TASK_WORK: usize = 1 << 15;

/// `Some(attention)` when the inputs suit this kernel (CPU, f32 queries, f32/f16/bf16 keys and
/// values with a contiguous last dimension), `None` otherwise.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &MaskSpec,
) -> Result<Option<Tensor>> {
    if !matches!(q.device(), Device::Cpu) || q.dtype() != DType::F32 || k.dtype() != v.dtype() {
        return Ok(None);
    }
    let (b, heads, q_len, d) = q.dims4()?;
    let (_, kv_heads, k_len, _) = k.dims4()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(qs), Storage::Cpu(ks), Storage::Cpu(vs)) = (&*qs, &*ks, &*vs) else {
        return Ok(None);
    };
    let (Some(qv), Some(kv), Some(vv)) = (View::of(ql), View::of(kl), View::of(vl)) else {
        return Ok(None);
    };
    let q_data = qs.as_slice::<f32>()?;
    let shape = Shape {
        heads,
        groups: heads / kv_heads,
        q_len,
        k_len,
        d,
        scale: scale as f32,
    };
    let mut out = vec![0f32; b * q_len * heads * d];
    let (kc, vc) = (
        Cache {
            storage: ks,
            view: &kv,
        },
        Cache {
            storage: vs,
            view: &vv,
        },
    );
    match k.dtype() {
        DType::F32 => shape.run::<f32>(q_data, &qv, &kc, &vc, mask, &mut out)?,
        DType::F16 => shape.run::<f16>(q_data, &qv, &kc, &vc, mask, &mut out)?,
        DType::BF16 => shape.run::<bf16>(q_data, &qv, &kc, &vc, mask, &mut out)?,
        _ => return Ok(None),
    }
    // Written as [b, q_len, heads, d]: the caller's transpose back to that order is free.
    Ok(Some(
        Tensor::from_vec(out, (b, q_len, heads, d), &Device::Cpu)?.transpose(1, 2)?,
    ))
}

/// Offset and strides of a 4-D tensor whose last dimension is contiguous.
struct View {
    offset: usize,
    strides: [usize; 3],
}

impl View {
    fn of(layout: &Layout) -> Option<Self> {
        match layout.stride() {
            &[s0, s1, s2, 1] => Some(Self {
                offset: layout.start_offset(),
                strides: [s0, s1, s2],
            }),
            _ => None,
        }
    }

    fn row<'a, T>(&self, data: &'a [T], b: usize, h: usize, i: usize, d: usize) -> &'a [T] {
        let [s0, s1, s2] = self.strides;
        &data[self.offset + b * s0 + h * s1 + i * s2..][..d]
    }
}

/// A key or value cache: its CPU storage and where this tensor sits in it.
struct Cache<'a> {
    storage: &'a CpuStorage,
    view: &'a View,
}

struct Shape {
    heads: usize,
    groups: usize,
    q_len: usize,
    k_len: usize,
    d: usize,
    scale: f32,
}

impl Shape {
    fn run<E: Elem + candle_core::WithDType>(
        &self,
        q: &[f32],
        qv: &View,
        k: &Cache,
        v: &Cache,
        mask: &MaskSpec,
        out: &mut [f32],
    ) -> Result<()> {
        let (kv, vv) = (k.view, v.view);
        let (k, v) = (k.storage.as_slice::<E>()?, v.storage.as_slice::<E>()?);
        let (heads, q_len, d) = (self.heads, self.q_len, self.d);
        let min_rows = (TASK_WORK / (2 * self.k_len * d).max(1)).max(1);
        let simd = simd::available();
        out.par_chunks_mut(d)
            .with_min_len(min_rows)
            .enumerate()
            .for_each_init(Vec::new, |scores: &mut Vec<f32>, (row, out)| {
                // `out` is [b, q_len, heads, d]: row = (bi * q_len + i) * heads + h.
                let (h, i, bi) = (row % heads, row / heads % q_len, row / heads / q_len);
                let (kvh, pos) = (h / self.groups, mask.q_start + i);
                // Visible keys: k_start + j ≤ pos, and pos - (k_start + j) < window.
                let hi = (pos + 1).saturating_sub(mask.k_start).min(self.k_len);
                let lo = mask.window.map_or(0, |w| {
                    (pos + 1).saturating_sub(w).saturating_sub(mask.k_start)
                });
                if lo >= hi {
                    return;
                }
                let qrow = qv.row(q, bi, h, i, d);
                scores.clear();
                scores.extend(
                    (lo..hi).map(|j| simd::dot(simd, qrow, kv.row(k, bi, kvh, j, d)) * self.scale),
                );
                let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let mut total = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    total += *s;
                }
                for (j, p) in (lo..hi).zip(scores.iter()) {
                    simd::axpy(simd, out, p / total, vv.row(v, bi, kvh, j, d));
                }
            });
        Ok(())
    }
}

/// A cache element type, widened to f32 on load.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Eight elements at `p` widened.
    ///
    /// # Safety
    /// `p` must point to eight readable elements, on a CPU with AVX2/FMA/F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

impl Elem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Elem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl Elem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
        }
    }
}

/// `dot` and `axpy` over f32 queries/outputs and cache rows, AVX2 or portable.
mod simd {
    use super::Elem;

    pub fn available() -> bool {
        crate::cpu::Kernel::best().has_avx2()
    }

    pub fn dot<E: Elem>(simd: bool, a: &[f32], b: &[E]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd && a.len().is_multiple_of(8) {
            // SAFETY: `simd` comes from `available()`; lengths are equal multiples of 8.
            return unsafe { x86::dot(a, b) };
        }
        let _ = simd;
        a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum()
    }

    pub fn axpy<E: Elem>(simd: bool, y: &mut [f32], p: f32, x: &[E]) {
        #[cfg(target_arch = "x86_64")]
        if simd && y.len().is_multiple_of(8) {
            // SAFETY: as in `dot`.
            return unsafe { x86::axpy(y, p, x) };
        }
        let _ = simd;
        for (y, x) in y.iter_mut().zip(x) {
            *y += p * x.to_f32();
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use super::super::Elem;
        use std::arch::x86_64::*;

        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn dot<E: Elem>(a: &[f32], b: &[E]) -> f32 {
            let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let n = a.len().min(b.len());
            let mut i = 0;
            while i + 16 <= n {
                // SAFETY: i + 16 ≤ both lengths.
                unsafe {
                    s0 = _mm256_fmadd_ps(
                        _mm256_loadu_ps(a.as_ptr().add(i)),
                        E::load8(b.as_ptr().add(i)),
                        s0,
                    );
                    s1 = _mm256_fmadd_ps(
                        _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                        E::load8(b.as_ptr().add(i + 8)),
                        s1,
                    );
                }
                i += 16;
            }
            if i < n {
                // SAFETY: n is a multiple of 8, so i + 8 ≤ n here.
                unsafe {
                    s0 = _mm256_fmadd_ps(
                        _mm256_loadu_ps(a.as_ptr().add(i)),
                        E::load8(b.as_ptr().add(i)),
                        s0,
                    );
                }
            }
            let s = _mm256_add_ps(s0, s1);
            let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn axpy<E: Elem>(y: &mut [f32], p: f32, x: &[E]) {
            let pv = _mm256_set1_ps(p);
            let n = y.len().min(x.len());
            for i in (0..n).step_by(8) {
                // SAFETY: n is a multiple of 8, so i + 8 ≤ both lengths.
                unsafe {
                    let yp = y.as_mut_ptr().add(i);
                    _mm256_storeu_ps(
                        yp,
                        _mm256_fmadd_ps(pv, E::load8(x.as_ptr().add(i)), _mm256_loadu_ps(yp)),
                    );
                }
            }
        }
    }
}
