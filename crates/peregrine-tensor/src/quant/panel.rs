//! Activations interleaved eight inputs at a time ("panels") for the prefill GEMM: one 32-byte
//! vector holds the same 4 codes of 8 inputs, so a weight's 4 codes broadcast to every lane
//! multiply 8 inputs at once and each lane accumulates one output. The block's scales and sums
//! sit beside the codes as 8-lane vectors.

use super::act::{Q8Block, QK};

/// Inputs per panel: the lanes of one 256-bit vector of i32 or f32.
pub const LANES: usize = 8;

/// One 32-value block of 8 inputs. Lanes past the last input are zero.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
pub struct PanelBlock {
    /// `codes[q][l]`: input `l`'s codes `4q..4q + 4`, as one little-endian word.
    pub codes: [[u32; LANES]; QK / 4],
    /// [`Q8Block::d`] of each input.
    pub d: [f32; LANES],
    /// [`Q8Block::ds`] of each input.
    pub ds: [f32; LANES],
    /// [`Q8Block::dsum`] of each input.
    pub dsum: [f32; LANES],
    /// [`Q8Block::dsum16`] of each input, half by half.
    pub dsum16: [[f32; LANES]; 2],
}

/// Interleaves up to 8 quantized input rows (`x`, `blocks` blocks each) into one panel of
/// `blocks` blocks.
pub fn interleave(x: &[Q8Block], blocks: usize, out: &mut [PanelBlock]) {
    let rows = x.len() / blocks;
    debug_assert!(rows <= LANES && out.len() == blocks);
    for (b, pb) in out.iter_mut().enumerate() {
        *pb = PanelBlock::default();
        for l in 0..rows {
            let xb = &x[l * blocks + b];
            for (q, quad) in xb.qs.chunks_exact(4).enumerate() {
                pb.codes[q][l] =
                    u32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]].map(|c| c as u8));
            }
            pb.d[l] = xb.d;
            pb.ds[l] = xb.ds;
            pb.dsum[l] = xb.dsum;
            pb.dsum16[0][l] = xb.dsum16[0];
            pb.dsum16[1][l] = xb.dsum16[1];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_hold_each_inputs_codes_and_sums_and_padding_is_zero() {
        let blocks = 2;
        let m = 3;
        let x: Vec<Q8Block> = (0..m * blocks)
            .map(|i| {
                let v: Vec<f32> = (0..QK).map(|j| (i * 31 + j) as f32 - 40.0).collect();
                super::super::act::quantize_block(&v)
            })
            .collect();
        let mut out = vec![PanelBlock::default(); blocks];
        interleave(&x, blocks, &mut out);
        for l in 0..LANES {
            for b in 0..blocks {
                let pb = &out[b];
                for q in 0..QK / 4 {
                    let bytes = pb.codes[q][l].to_le_bytes();
                    for (t, &byte) in bytes.iter().enumerate() {
                        let want = if l < m {
                            x[l * blocks + b].qs[4 * q + t]
                        } else {
                            0
                        };
                        assert_eq!(byte as i8, want, "lane {l} block {b} code {}", 4 * q + t);
                    }
                }
                let want = if l < m { x[l * blocks + b].dsum } else { 0.0 };
                assert_eq!(pb.dsum[l], want);
            }
        }
    }
}
