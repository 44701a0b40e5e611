//! The prefill GEMM on x86: one weight row against `G` panels of 8 inputs. Each 32-value
//! (sub-)block of the row is unpacked once ([`sub`]), and each 4 of its codes, broadcast to all
//! lanes, multiply the same 4 codes of 8 inputs ([`PanelBlock`]), so one i32 lane per input
//! accumulates the block's integer dot product. One float FMA per block then scales 8 inputs at
//! once, and the offsets and minimums are one more, against the inputs' sums. Same integer sums
//! as [`super::scalar`]; only the float summation order differs.

use std::arch::x86_64::*;

use super::avx2::{
    Avx2, Isa, MLX8, MLX8G64, Q4_1, Q5_1, Q6K, Q8_0, Vnni, is_mlx8, shape, sub, with_format,
};
use super::format::Format;
use super::panel::{LANES, PanelBlock};

/// `Σ w·x` of one weight row for each input of `G` panels: `[panel][lane]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; each panel holds the row's blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_row<const G: usize>(
    format: Format,
    w: &[u8],
    x: [&[PanelBlock]; G],
) -> [[f32; LANES]; G] {
    // SAFETY: this function's features are `Avx2`'s.
    unsafe { with_format!(format, F => row::<Avx2, F, G>(w, x)) }
}

/// [`panel_row`] with VNNI's `vpdpbusd`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and VNNI; each panel holds the row's
/// blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn panel_row_vnni<const G: usize>(
    format: Format,
    w: &[u8],
    x: [&[PanelBlock]; G],
) -> [[f32; LANES]; G] {
    // SAFETY: this function's features are `Vnni`'s.
    unsafe { with_format!(format, F => row::<Vnni, F, G>(w, x)) }
}

/// 32 bytes, aligned for one vector store.
#[repr(C, align(32))]
struct Quads([u32; 8]);

/// # Safety
/// The CPU must support `I`'s features; the caller is compiled with them, so all inlines.
#[inline(always)]
unsafe fn row<I: Isa, const F: u8, const G: usize>(
    w: &[u8],
    x: [&[PanelBlock]; G],
) -> [[f32; LANES]; G] {
    let (bytes, subs) = shape(F);
    // Q8_0 is signed. Wide products take it plus 128, less 128·Σx through the offsets;
    // narrow ones (maddubs saturates) take |w| times x with w's signs. MLX8 is unsigned: narrow
    // products take it less 128 (signed, as Q8_0), plus 128·Σx.
    let signed = (F == Q8_0 || is_mlx8(F)) && !I::WIDE;
    // Q6_K scales each 16 values: its blocks are two halves of 4 quads.
    let halves = if F == Q6K { 2 } else { 1 };
    let (mut quads, mut signs) = (Quads([0; 8]), Quads([0; 8]));
    // SAFETY: per this function's contract; every load is within a slice or struct.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); G];
        let mut off = [_mm256_setzero_ps(); G];
        for (i, b) in w.chunks_exact(bytes).enumerate() {
            for j in 0..subs {
                let s = sub::<I, F>(b, j);
                let blk = i * subs + j;
                let flipped = _mm256_xor_si256(s.codes, _mm256_set1_epi8(-128));
                // `raw`: the codes the products see, before taking magnitudes for `signed`.
                let (raw, min) = match F {
                    Q8_0 if I::WIDE => (flipped, -128.0 * s.scale),
                    Q8_0 => (s.codes, 0.0),
                    f if is_mlx8(f) && !I::WIDE => (flipped, s.min),
                    _ => (s.codes, s.min),
                };
                // MLX8's narrow products miss 128·scale·Σx, added against `dsum`.
                let shift = if is_mlx8(F) && !I::WIDE {
                    128.0 * s.scale
                } else {
                    0.0
                };
                let codes = if signed {
                    _mm256_sign_epi8(raw, raw)
                } else {
                    raw
                };
                _mm256_store_si256(quads.0.as_mut_ptr().cast(), codes);
                if signed {
                    _mm256_store_si256(signs.0.as_mut_ptr().cast(), raw);
                }
                for h in 0..halves {
                    let mut int = [_mm256_setzero_si256(); G];
                    for q in h * 8 / halves..(h + 1) * 8 / halves {
                        let wq = _mm256_set1_epi32(quads.0[q] as i32);
                        let sq = _mm256_set1_epi32(signs.0[q] as i32);
                        for g in 0..G {
                            let xv = _mm256_load_si256(x[g][blk].codes[q].as_ptr().cast());
                            let xv = if signed { _mm256_sign_epi8(xv, sq) } else { xv };
                            int[g] = I::dot4(int[g], wq, xv);
                        }
                    }
                    let (scale, min) = match F {
                        Q6K => (s.scales16[h], s.offsets16[h]),
                        _ => (s.scale, min),
                    };
                    let (scale, min) = (_mm256_set1_ps(scale), _mm256_set1_ps(min));
                    for g in 0..G {
                        let pb = &x[g][blk];
                        let xd = _mm256_load_ps(pb.d.as_ptr());
                        let p = _mm256_cvtepi32_ps(int[g]);
                        acc[g] = _mm256_fmadd_ps(p, _mm256_mul_ps(scale, xd), acc[g]);
                        let sums = match F {
                            Q4_1 | Q5_1 | MLX8 | MLX8G64 => &pb.ds,
                            Q6K => &pb.dsum16[h],
                            _ => &pb.dsum,
                        };
                        if F != Q8_0 || I::WIDE {
                            off[g] = _mm256_fmadd_ps(min, _mm256_load_ps(sums.as_ptr()), off[g]);
                        }
                        if is_mlx8(F) && !I::WIDE {
                            let dsum = _mm256_load_ps(pb.dsum.as_ptr());
                            off[g] = _mm256_fmadd_ps(_mm256_set1_ps(shift), dsum, off[g]);
                        }
                    }
                }
            }
        }
        std::array::from_fn(|g| {
            let mut out = [0f32; LANES];
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc[g], off[g]));
            out
        })
    }
}
