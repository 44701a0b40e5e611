//! Q4_0/Q4_1 weights with 8 rows interleaved block by block, the layout the x86 kernels
//! multiply fastest: one 32-byte vector holds 4 codes of each of 8 rows, so 4 activation codes
//! broadcast to every lane advance 8 outputs at once, and the rows' scales load as one vector.
//! (llama.cpp repacks Q4_0 the same way for the same reason.) Rows keep their exact bytes, only
//! moved: [`Interleaved::row_block`] gives any row's GGUF block back.
//!
//! Per group of 8 rows and per block: 8 f16 scales, 8 f16 minimums (Q4_1 only), then 128 bytes
//! of codes. Byte `32c + 4l + t` is byte `4c + t` of row `l`'s GGUF codes: its low nibble is
//! value `4c + t`, its high nibble value `16 + 4c + t`. So the low nibbles of the 32 bytes at
//! `32c` are values `4c..4c + 4` of every row, and the high nibbles values `16 + 4c..`.

use super::format::Format;

/// Rows per group: the lanes of one 256-bit vector of i32 or f32.
pub const ROWS: usize = 8;

/// A matrix in the interleaved layout: `rows` (a multiple of [`ROWS`]) × `blocks` blocks.
#[derive(Debug)]
pub struct Interleaved {
    /// The groups one after another, each `blocks` group-blocks long.
    pub bytes: Vec<u8>,
    /// [`Format::Q4_0`] or [`Format::Q4_1`].
    pub format: Format,
    /// Blocks per row.
    pub blocks: usize,
}

impl Interleaved {
    /// Whether `format` matrices of `rows` rows can be interleaved.
    pub fn fits(format: Format, rows: usize) -> bool {
        matches!(format, Format::Q4_0 | Format::Q4_1) && rows.is_multiple_of(ROWS) && rows > 0
    }

    /// Interleaves GGUF rows (`data`: `rows` rows of `blocks` blocks of `format`).
    pub fn new(format: Format, data: &[u8], rows: usize, blocks: usize) -> Self {
        debug_assert!(Self::fits(format, rows));
        let bb = format.block_bytes();
        let (head, row_bytes) = (head_bytes(format), blocks * bb);
        let mut bytes = vec![0u8; data.len()];
        for (g, out) in bytes.chunks_exact_mut(ROWS * row_bytes).enumerate() {
            for (b, gb) in out.chunks_exact_mut(ROWS * bb).enumerate() {
                for l in 0..ROWS {
                    let src = &data[(g * ROWS + l) * row_bytes + b * bb..][..bb];
                    gb[2 * l..2 * l + 2].copy_from_slice(&src[..2]);
                    if format == Format::Q4_1 {
                        gb[16 + 2 * l..16 + 2 * l + 2].copy_from_slice(&src[2..4]);
                    }
                    for c in 0..4 {
                        let at = ROWS * head + 32 * c + 4 * l;
                        gb[at..at + 4].copy_from_slice(&src[head + 4 * c..head + 4 * c + 4]);
                    }
                }
            }
        }
        Self {
            bytes,
            format,
            blocks,
        }
    }

    /// Bytes of one group of 8 rows.
    pub fn group_bytes(&self) -> usize {
        ROWS * self.blocks * self.format.block_bytes()
    }

    /// Group `g` (rows `8g..8g + 8`).
    pub fn group(&self, g: usize) -> &[u8] {
        &self.bytes[g * self.group_bytes()..][..self.group_bytes()]
    }

    /// Block `b` of row `r` in GGUF's layout.
    pub fn row_block(&self, r: usize, b: usize, out: &mut [u8]) {
        let (bb, head) = (self.format.block_bytes(), head_bytes(self.format));
        let (g, l) = (r / ROWS, r % ROWS);
        let gb = &self.group(g)[b * ROWS * bb..][..ROWS * bb];
        out[..2].copy_from_slice(&gb[2 * l..2 * l + 2]);
        if self.format == Format::Q4_1 {
            out[2..4].copy_from_slice(&gb[16 + 2 * l..16 + 2 * l + 2]);
        }
        for c in 0..4 {
            let at = ROWS * head + 32 * c + 4 * l;
            out[head + 4 * c..head + 4 * c + 4].copy_from_slice(&gb[at..at + 4]);
        }
    }

    /// Row `r` in GGUF's layout.
    pub fn row(&self, r: usize) -> Vec<u8> {
        let bb = self.format.block_bytes();
        let mut out = vec![0u8; self.blocks * bb];
        for (b, block) in out.chunks_exact_mut(bb).enumerate() {
            self.row_block(r, b, block);
        }
        out
    }

    /// Row `r` dequantized into `out` (`blocks · 32` values), as ggml dequantizes it.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let mut block = [0u8; 20];
        let head = head_bytes(self.format);
        for (b, vals) in out.chunks_exact_mut(32).enumerate() {
            self.row_block(r, b, &mut block);
            let d = super::format::f16_at(&block, 0);
            let qs = &block[head..head + 16];
            for (j, &q) in qs.iter().enumerate() {
                let (lo, hi) = (f32::from(q & 0xF), f32::from(q >> 4));
                (vals[j], vals[j + 16]) = match self.format {
                    Format::Q4_1 => {
                        let m = super::format::f16_at(&block, 2);
                        (lo * d + m, hi * d + m)
                    }
                    _ => ((lo - 8.0) * d, (hi - 8.0) * d),
                };
            }
        }
    }
}

/// Bytes before a block's codes: the f16 scale, and the f16 minimum of Q4_1.
fn head_bytes(format: Format) -> usize {
    if format == Format::Q4_1 { 4 } else { 2 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_back_byte_for_byte() {
        for format in [Format::Q4_0, Format::Q4_1] {
            let (rows, blocks) = (16, 3);
            let data: Vec<u8> = (0..rows * blocks * format.block_bytes())
                .map(|i| (i * 7 + i / 13) as u8)
                .collect();
            let w = Interleaved::new(format, &data, rows, blocks);
            for r in 0..rows {
                let row_bytes = blocks * format.block_bytes();
                assert_eq!(
                    w.row(r),
                    &data[r * row_bytes..][..row_bytes],
                    "{format:?} row {r}"
                );
            }
            // The codes of values 4c..4c + 4 of row l sit at 32c + 4l in the low nibbles.
            let head = head_bytes(format);
            let g0 = &w.group(0)[ROWS * head..];
            assert_eq!(
                g0[32 + 4 * 3],
                data[3 * blocks * format.block_bytes() + head + 4]
            );
        }
    }
}
