//! Activations quantized once per matmul to 8-bit blocks of 32, the format every weight kernel
//! multiplies against (integer dot products, one float multiply per block), and each input row's
//! blocks of largest scale refined by a second, residual block ([`Q8Input`]).

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
    /// `Σ qs`: VNNI's Q8_0 kernel takes codes offset by 128 and subtracts `128 · Σ qs`.
    pub sum: i32,
}

/// Quantizes `x` block by block into `out` (`x.len() / QK` blocks). Every path gives the same
/// bits, so kernels can be compared exactly.
pub fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    for (block, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let (qs, amax, sums) = codes(x);
        *block = finish(qs, amax, sums);
    }
}

/// The portable quantizer as a block (tests hold [`super::avx2::quantize_block`] to its bits;
/// [`quantize_row`] runs its codes where the CPU lacks AVX2).
#[cfg(test)]
pub(crate) fn quantize_block(x: &[f32]) -> Q8Block {
    let (qs, amax, sums) = portable_codes(x);
    finish(qs, amax, sums)
}

/// The portable quantizer: codes, largest magnitude and code sums per half.
fn portable_codes(x: &[f32]) -> ([i8; QK], f32, [i32; 2]) {
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
    (qs, amax, sums)
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
        sum: sums[0] + sums[1],
    }
}

/// This many blocks of each input row are carried to about 16 bits by a residual block: those
/// of largest scale. A block's rounding error is up to half its step, `amax / 254`, on all 32
/// values, so the blocks holding a row's outliers (the same few channels token after token:
/// massive activations, norm weights) dominate the row's error: measured on SmolLM2 Q4_1, the
/// largest block alone carries 36-75 % of the summed squared steps of the q/k/v and gate/up
/// inputs. Kernels multiply a refinement as one more block; two per row halve the mean logit
/// error of SmolLM2 Q4_1 against its f32 reference (docs/benchmarks.md has the error and the cost).
pub const REFINED: usize = 2;

/// Block `at` of an input row, refined: `residual` holds `x - d·qs` of that block (its own
/// scale, unrounded), and its `ds` completes the block's `d·Σqs` to the exact `Σx`, so a
/// format's minimum term (Q4_1, Q5_1) is exact too. Multiplied by the same block kernels as the
/// row's blocks, added to their sum.
#[derive(Debug, Clone, Copy, Default)]
pub struct Refinement {
    /// The block's index in its row.
    pub at: usize,
    /// The residual, quantized.
    pub residual: Q8Block,
}

/// A matmul's input rows quantized: `m` rows of `k / 32` blocks, and up to [`REFINED`]
/// refinements per row when the weights take them ([`super::Format::refines`]). Buffers are
/// reused from call to call, so a decode step allocates nothing once they have grown.
#[derive(Debug, Clone, Default)]
pub struct Q8Input {
    /// Row-major blocks, `k / 32` per row.
    pub blocks: Vec<Q8Block>,
    /// The same blocks in tiles of [`TILE`] rows, block-major within a tile ([`tile`](Self::tile)).
    tiled: Vec<Q8Block>,
    /// [`REFINED`] slots per row (or none), the first `counts[i]` of row `i` in use.
    refined: Vec<Refinement>,
    counts: Vec<u8>,
}

impl Q8Input {
    /// Quantizes `m` rows of `x` (row-major, `x.len() / m` values each, a multiple of 32), with
    /// refinements when `refine`; rows in parallel on rayon's pool.
    pub fn quantize(&mut self, x: &[f32], m: usize, refine: bool) {
        use rayon::prelude::*;
        let k = x.len() / m.max(1);
        let blocks = k / QK;
        self.blocks.clear();
        self.blocks.resize(m * blocks, Q8Block::default());
        self.tiled.clear();
        self.refined.clear();
        self.counts.clear();
        if blocks == 0 {
            return;
        }
        let rows = self.blocks.par_chunks_mut(blocks).zip(x.par_chunks(k));
        if !refine {
            rows.for_each(|(q, x)| quantize_row(x, q));
            return;
        }
        self.refined.resize(m * REFINED, Refinement::default());
        self.counts.resize(m, 0);
        let slots = self.refined.par_chunks_mut(REFINED).zip(&mut self.counts);
        rows.zip(slots).for_each(|((q, x), (r, n))| {
            quantize_row(x, q);
            *n = refine_row(x, q, r);
        });
    }

    /// Row `i`'s refinements (none when the input was quantized without them).
    #[inline]
    pub fn refined(&self, i: usize) -> &[Refinement] {
        match self.counts.get(i) {
            Some(&n) => &self.refined[i * REFINED..][..usize::from(n)],
            None => &[],
        }
    }

    /// Whether any row has a refinement.
    pub fn any_refined(&self) -> bool {
        self.counts.iter().any(|&n| n > 0)
    }

    /// Lays the `m` rows out again in tiles of [`TILE`] rows, block-major within a tile: row
    /// `TILE·k + t`'s block `b` at `TILE·k·blocks + b·n + t`, `n` the tile's rows. The
    /// interleaved kernels then find every input's block at a fixed offset from one pointer
    /// instead of a pointer per input. One row needs no tiling.
    pub(crate) fn tile(&mut self, m: usize) {
        let blocks = self.blocks.len() / m.max(1);
        self.tiled.clear();
        if m < 2 || blocks == 0 {
            return;
        }
        self.tiled.resize(self.blocks.len(), Q8Block::default());
        for (k, tile) in self.tiled.chunks_mut(TILE * blocks).enumerate() {
            let n = tile.len() / blocks;
            for (t, row) in self.blocks[TILE * k * blocks..]
                .chunks(blocks)
                .take(n)
                .enumerate()
            {
                for (b, block) in row.iter().enumerate() {
                    tile[b * n + t] = *block;
                }
            }
        }
    }

    /// Row `i`'s blocks and those of the rows after it in its tile, as the interleaved kernels
    /// read them: row `i + t`'s block `b` at `[b · stride + t]` of the slice returned with
    /// `stride`. Without [`tile`](Self::tile) (one row), row `i`'s blocks with stride 1.
    pub(crate) fn tiled(&self, i: usize, m: usize) -> (&[Q8Block], usize) {
        let blocks = self.blocks.len() / m.max(1);
        if self.tiled.is_empty() {
            return (&self.blocks[i * blocks..], 1);
        }
        let (k, t) = (i / TILE, i % TILE);
        let n = (m - TILE * k).min(TILE);
        (&self.tiled[TILE * k * blocks + t..], n)
    }
}

/// Rows per tile of [`Q8Input::tile`]: the most inputs an interleaved kernel call takes.
pub(crate) const TILE: usize = 8;

/// Refines the blocks of `q` (the row `x` quantized) of largest scale, the first of equal ones,
/// at most `out.len()` and none that is all zeros, in ascending block order; returns how many.
fn refine_row(x: &[f32], q: &[Q8Block], out: &mut [Refinement]) -> u8 {
    let mut taken = [usize::MAX; REFINED];
    let mut n = 0;
    while n < out.len().min(q.len()) {
        let mut best = usize::MAX;
        for (b, block) in q.iter().enumerate() {
            if !taken[..n].contains(&b) && (best == usize::MAX || block.d > q[best].d) {
                best = b;
            }
        }
        if q[best].d == 0.0 {
            break;
        }
        taken[n] = best;
        out[n] = Refinement {
            at: best,
            residual: residual_block(&x[best * QK..][..QK], &q[best]),
        };
        n += 1;
    }
    // In block order: kernels add a row's refinements in the order given, and that order must
    // not depend on the rows batched with it.
    out[..n].sort_unstable_by_key(|r| r.at);
    n as u8
}

/// `x - main.d·main.qs` quantized to 8 bits with its own unrounded scale; `ds` is `Σx - main.ds`
/// and `dsum` the residual's own `d·Σqs` (what the offset formats and K-quants subtract).
pub(crate) fn residual_block(x: &[f32], main: &Q8Block) -> Q8Block {
    let mut r = [0f32; QK];
    let mut sum = 0f32;
    for ((r, &x), &q) in r.iter_mut().zip(x).zip(&main.qs) {
        *r = x - main.d * f32::from(q);
        sum += x;
    }
    let (qs, amax, sums) = codes(&r);
    let d = amax / 127.0;
    Q8Block {
        qs,
        d,
        ds: sum - main.ds,
        dsum: d * (sums[0] + sums[1]) as f32,
        dsum16: sums.map(|s| d * s as f32),
        sum: sums[0] + sums[1],
    }
}

/// `QK` inputs → (codes, largest magnitude, code sums per half), with the fast quantizer where
/// the CPU has it (the same bits).
fn codes(x: &[f32]) -> ([i8; QK], f32, [i32; 2]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        // SAFETY: `available()` checked the CPU; callers pass QK inputs.
        return unsafe { super::avx2::quantize_block(x) };
    }
    portable_codes(x)
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
    fn a_refined_block_is_carried_to_sixteen_bits() {
        // One outlier makes the block's step 100/127: the small values all round to 0.
        let mut x = [0f32; 8 * QK];
        for (i, v) in x.iter_mut().enumerate() {
            *v = ((i * 37 % 29) as f32 - 14.0) * 0.01;
        }
        x[QK + 5] = 100.0;
        x[6 * QK + 2] = -300.0;
        let mut input = Q8Input::default();
        input.quantize(&x, 1, true);
        let refined = input.refined(0);
        let at: Vec<usize> = refined.iter().map(|r| r.at).collect();
        assert_eq!(at, [1, 6], "the blocks of largest scale, in block order");
        let (r, main) = (&refined[0], &input.blocks[1]);
        let block = &x[QK..2 * QK];
        for (j, &v) in block.iter().enumerate() {
            let got = main.d * f32::from(main.qs[j]) + r.residual.d * f32::from(r.residual.qs[j]);
            // Half the residual's step, plus the f32 rounding of the two terms.
            let tol = r.residual.d * 0.5 + 1e-5 * v.abs().max(1.0);
            assert!((got - v).abs() <= tol, "value {j}: {got} vs {v}");
        }
        let sum: f32 = block.iter().sum();
        assert!((main.ds + r.residual.ds - sum).abs() <= 1e-4 * 100.0);
        let codes: i32 = r.residual.qs.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(r.residual.dsum, r.residual.d * codes as f32);
        // A row of zeros has nothing to refine; a row of one block, one refinement.
        input.quantize(&[0.0; 4 * QK], 1, true);
        assert!(input.refined(0).is_empty());
        input.quantize(&x[QK..2 * QK], 1, true);
        assert_eq!(input.refined(0).len(), 1);
        // Nor when the weights take no refinements.
        input.quantize(&x, 1, false);
        assert!(input.refined(0).is_empty() && !input.any_refined());
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
