//! Activations quantized once per matmul to 8-bit blocks of 32, the format every weight kernel
//! multiplies against (integer dot products, one float multiply per block).

/// Inputs per activation block; every supported weight format's (sub-)block is a multiple of it.
pub const QK: usize = 32;

/// 32 activations as `d * qs[i]`, with the sums the weight formats' offsets and minimums need.
/// Rounded as llama.cpp's `block_q8_1` is (scale and `d·Σqs` through f16, codes from the
/// unrounded scale), so greedy decoding follows llama.cpp's through near-ties.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct Q8Block {
    /// Quantized values, `round(x / d)` in -127..=127.
    pub qs: [i8; QK],
    /// Scale: the block's largest magnitude / 127, rounded to f16.
    pub d: f32,
    /// `d · Σ qs` (unrounded `d`), rounded to f16: the minimum term of Q4_1 and Q5_1.
    pub ds: f32,
    /// `d · Σ qs` (rounded `d`): offsets of Q4_0/Q5_0 and minimums of the K-quants.
    pub dsum: f32,
    /// `d · Σ qs` over each half (16 values), for Q6_K's per-16 scales.
    pub dsum16: [f32; 2],
}

/// Quantizes `x` block by block into `out` (`x.len() / QK` blocks). Every path gives the same
/// bits, so kernels can be compared exactly.
pub fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        for (block, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
            // SAFETY: `available()` checked the CPU; chunks are QK long.
            let (qs, amax, sums) = unsafe { super::avx2::quantize_block(x) };
            *block = finish(qs, amax, sums);
        }
        return;
    }
    for (block, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
        *block = quantize_block(x);
    }
}

/// The portable quantizer; [`super::avx2::quantize_block`] must stay bit-identical to it.
pub(crate) fn quantize_block(x: &[f32]) -> Q8Block {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    // Ties to even, as llama.cpp's AVX2 quantizer rounds: adding and removing 1.5·2²³ leaves
    // the nearest integer for |v| < 2²², in plain float ops that vectorise on any x86-64.
    const MAGIC: f32 = 12_582_912.0;
    let mut qs = [0i8; QK];
    for (q, v) in qs.iter_mut().zip(x) {
        *q = ((v * id + MAGIC) - MAGIC) as i8;
    }
    let half = |h: &[i8]| h.iter().map(|&q| i32::from(q)).sum::<i32>();
    let sums = [half(&qs[..16]), half(&qs[16..])];
    finish(qs, amax, sums)
}

/// A block from its codes, the inputs' largest magnitude and the codes' sums per half.
pub(crate) fn finish(qs: [i8; QK], amax: f32, sums: [i32; 2]) -> Q8Block {
    let d = amax / 127.0;
    let rounded = f16_round(d);
    let sum = (sums[0] + sums[1]) as f32;
    Q8Block {
        qs,
        d: rounded,
        ds: f16_round(d * sum),
        dsum: rounded * sum,
        dsum16: sums.map(|s| rounded * s as f32),
    }
}

fn f16_round(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_half_to_even_and_sums_match() {
        // amax 127 makes the scale 1, so codes are the inputs rounded: ties go to even.
        let mut x = [0f32; QK];
        x[..8].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4999]);
        x[8..]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = i as f32 * 3.3 - 40.0);
        let block = quantize_block(&x);
        let mut rows = [Q8Block::default()];
        quantize_row(&x, &mut rows);
        assert_eq!(
            rows[0].qs, block.qs,
            "the fast quantizer differs from the portable one"
        );
        assert_eq!(rows[0].dsum16, block.dsum16);
        for (q, v) in block.qs.iter().zip(&x) {
            assert_eq!(f32::from(*q), v.round_ties_even(), "{v}");
        }
        let sum: i32 = block.qs.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(block.dsum, block.d * sum as f32);
        assert_eq!(block.dsum16[0] + block.dsum16[1], block.dsum);
    }

    #[test]
    fn every_quantizer_gives_the_same_bits() {
        let mut seed = 1u64;
        for case in 0..500 {
            let x: Vec<f32> = (0..QK)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let u = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    // Every 7th case has exact halves (ties) and a zero block now and then.
                    match case % 7 {
                        0 => (u * 254.0).round() / 2.0,
                        3 if case % 21 == 3 => 0.0,
                        _ => u * (case as f32 + 1.0),
                    }
                })
                .collect();
            let want = quantize_block(&x);
            let mut got = [Q8Block::default()];
            quantize_row(&x, &mut got);
            assert_eq!(got[0].qs, want.qs, "case {case}");
            assert_eq!(
                (got[0].d, got[0].ds, got[0].dsum),
                (want.d, want.ds, want.dsum)
            );
        }
    }
}
