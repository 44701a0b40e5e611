//! The attention softmax's exponentials, written so the compiler vectorises them: libm's scalar
//! `expf` per score was a tenth of a long-context decode step. Every CPU attention path (prefill,
//! decode, batched) calls this one function, so they stay bit-identical to each other.

/// Lanes of independent work per pass (the loops below vectorise over them).
const LANES: usize = 8;

/// `e^x` for `x ≤ 0` (scores less their row's maximum), Cephes' `expf` reduction and polynomial:
/// `x = n·ln2 + r`, `|r| ≤ ln2/2`, `e^r` by a degree-6 polynomial, `2^n` built in the exponent
/// bits. Relative error under 2e-7 (f32 rounding: libm's is 1 ulp); below -87 it returns 0, as
/// `e^x` is then under f32's smallest normal number.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer without a rounding instruction.
    const ROUND: f32 = 12_582_912.0;
    // The low mantissa bits of 1.5·2^23 + n hold n + 0x400000 (|n| < 2^22).
    const ROUND_BITS: u32 = 0x4B40_0000;
    let clamped = x.max(-87.0);
    let shifted = clamped * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 5e-1;
    // 2^n from n's integer bits: a float-to-int cast would not vectorise (Rust's saturates).
    let two_n = f32::from_bits(shifted.to_bits().wrapping_sub(ROUND_BITS - 127) << 23);
    let e = (p * r * r + r + 1.0) * two_n;
    if x < -87.0 { 0.0 } else { e }
}

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
    fn exp_is_within_two_ulp_of_libm_over_the_softmax_range() {
        let mut worst = 0f32;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (exp_nonpositive(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-1000.0), 0.0);
    }

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
