//! The attention softmax's exponentials, written so the compiler vectorises them: libm's scalar
//! `expf` per score was a tenth of a long-context decode step. Every CPU attention path (prefill,
//! decode, batched) calls this one function, so they stay bit-identical to each other.

use crate::ops::exp_nonpositive;

/// Lanes of independent work per pass (the loops below vectorise over them).
const LANES: usize = 8;

/// Replaces each score of `row` with `e^(score - max)` and returns `(max, Σ e^(score - max))`.
pub(super) fn exp_row(row: &mut [f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::Kernel::best().has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { exp_row_avx2(row) };
    }
    exp_row_portable(row)
}

/// [`exp_row`] compiled for AVX2 (8 lanes a vector; the same arithmetic, so the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_row_avx2(row: &mut [f32]) -> (f32, f32) {
    exp_row_portable(row)
}

#[inline(always)]
fn exp_row_portable(row: &mut [f32]) -> (f32, f32) {
    let mut maxes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail_max = (chunks.remainder().iter()).fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    for c in chunks {
        maxes.iter_mut().zip(c).for_each(|(m, &s)| *m = m.max(s));
    }
    let max = maxes.iter().fold(tail_max, |m, &s| m.max(s));
    if max == f32::NEG_INFINITY {
        // Every key masked: no weight anywhere (the caller treats a zero sum as no keys).
        row.fill(0.0);
        return (max, 0.0);
    }
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        c.iter_mut().for_each(|s| *s = exp_nonpositive(*s - max));
        sums.iter_mut().zip(c.iter()).for_each(|(t, &s)| *t += s);
    }
    let mut tail = 0f32;
    for s in chunks.into_remainder() {
        *s = exp_nonpositive(*s - max);
        tail += *s;
    }
    (max, sums.iter().sum::<f32>() + tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_sum_their_exponentials_and_masked_rows_are_empty() {
        let mut row: Vec<f32> = (0..19).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let want_max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let want: Vec<f32> = row.iter().map(|s| (s - want_max).exp()).collect();
        let (max, total) = exp_row(&mut row);
        assert_eq!(max, want_max);
        for (g, w) in row.iter().zip(&want) {
            assert!((g - w).abs() <= 2.5e-7 * w, "{g} vs {w}");
        }
        assert!((total - want.iter().sum::<f32>()).abs() < 1e-5);
        let mut masked = vec![f32::NEG_INFINITY; 11];
        assert_eq!(exp_row(&mut masked), (f32::NEG_INFINITY, 0.0));
        assert!(masked.iter().all(|&s| s == 0.0));
    }
}
