//! Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weights with 8 rows interleaved block by block, the layout the x86
//! kernels multiply fastest: one 32-byte vector holds 4 codes of each of 8 rows, so 4 activation
//! codes broadcast to every lane advance 8 outputs at once, and the rows' scales load as one
//! vector. (llama.cpp repacks Q4_0 the same way for the same reason.) Nothing is rounded or
//! re-encoded: [`Interleaved::row_block`] gives any row's GGUF block back byte for byte.
//!
//! Per group of 8 rows and per block: 8 f16 scales; 8 f16 minimums (Q4_1, Q5_1); the fifth bits
//! as 8 masks (Q5_0, Q5_1); then 128 bytes of codes (Q8_0: 256). Codes byte `32c + 4l + t` is
//! byte `4c + t` of row `l`'s GGUF codes: its low nibble is value `4c + t`, its high nibble value
//! `16 + 4c + t`. So the low nibbles of the 32 bytes at `32c` are values `4c..4c + 4` of every
//! row ("vector `c`"), and their high nibbles values `16 + 4c..` ("vector `c + 4`"); mask `k`
//! holds vector `k`'s fifth bits, bit `4l + t` for row `l`'s value `4k + t`. Q8_0's bytes are
//! whole codes, so its 8 vectors are the 8 runs of 32 bytes as they stand.
//!
//! The K-quants (256 values per block, `interleaved_k.rs`) keep the same code vectors, per pair
//! of sub-blocks: Q4_K with its 6-bit sub-block scales and minimums unpacked to bytes (32 bytes
//! more per group than the file's packing), Q6_K with its high bit pairs in vectors of their own.

use super::format::Format;
pub use super::interleaved_k::{q4k, q6k};

/// Rows per group: the lanes of one 256-bit vector of i32 or f32.
pub const ROWS: usize = 8;

/// The formats that interleave.
pub const FORMATS: [Format; 7] = [
    Format::Q4_0,
    Format::Q4_1,
    Format::Q5_0,
    Format::Q5_1,
    Format::Q8_0,
    Format::Q4K,
    Format::Q6K,
];

/// Bytes of one block of 8 rows in the interleaved layout.
pub fn group_block_bytes(format: Format) -> usize {
    ROWS * format.block_bytes() + if format == Format::Q4K { q4k::EXTRA } else { 0 }
}

/// Where a format's fields sit, in GGUF's block and in the interleaved group block.
#[derive(Clone, Copy)]
struct Fields {
    /// A minimum follows the scale (Q4_1, Q5_1).
    min: bool,
    /// Codes have a fifth bit (Q5_0, Q5_1).
    fifth: bool,
}

impl Fields {
    fn of(format: Format) -> Self {
        Self {
            min: matches!(format, Format::Q4_1 | Format::Q5_1),
            fifth: matches!(format, Format::Q5_0 | Format::Q5_1),
        }
    }

    /// GGUF: the fifth bits' offset, then the codes'.
    fn row_offsets(self) -> (usize, usize) {
        let qh = if self.min { 4 } else { 2 };
        (qh, qh + if self.fifth { 4 } else { 0 })
    }

    /// Interleaved: the minimums', masks' and codes' offsets.
    fn group_offsets(self) -> (usize, usize, usize) {
        let masks = if self.min { 32 } else { 16 };
        (16, masks, masks + if self.fifth { 32 } else { 0 })
    }
}

/// A matrix in the interleaved layout: rows (a multiple of [`ROWS`]) × `blocks` blocks.
#[derive(Debug)]
pub struct Interleaved {
    /// The groups one after another, each `blocks` group-blocks long.
    pub bytes: Vec<u8>,
    /// One of [`FORMATS`].
    pub format: Format,
    /// Blocks per row.
    pub blocks: usize,
    /// Consecutive blocks that share one set of scales: 1, or 2 for Q4_1 regrouped from MLX
    /// groups of 64 or 128 ([`Interleaved::share_scales`]).
    pub shared: usize,
}

impl Interleaved {
    /// Whether `format` matrices of `rows` rows can be interleaved.
    pub fn fits(format: Format, rows: usize) -> bool {
        FORMATS.contains(&format) && rows.is_multiple_of(ROWS) && rows > 0
    }

    /// Interleaves GGUF rows (`data`: `rows` rows of `blocks` blocks of `format`).
    pub fn new(format: Format, data: &[u8], rows: usize, blocks: usize) -> Self {
        debug_assert!(
            Self::fits(format, rows) && data.len() == rows * blocks * format.block_bytes()
        );
        let group_rows = ROWS * blocks * format.block_bytes();
        let mut bytes = vec![0u8; rows / ROWS * blocks * group_block_bytes(format)];
        let groups = bytes.chunks_exact_mut(blocks * group_block_bytes(format));
        for (out, src) in groups.zip(data.chunks_exact(group_rows)) {
            interleave_group(format, src, blocks, out);
        }
        Self::from_parts(bytes, format, blocks)
    }

    /// [`new`](Self::new) from owned rows, moved in place a group at a time where the layout
    /// takes the same bytes (all but Q4_K), so a large matrix never exists twice.
    pub fn from_vec(format: Format, mut data: Vec<u8>, rows: usize, blocks: usize) -> Self {
        if format == Format::Q4K {
            return Self::new(format, &data, rows, blocks);
        }
        debug_assert!(
            Self::fits(format, rows) && data.len() == rows * blocks * format.block_bytes()
        );
        let mut scratch = vec![0u8; ROWS * blocks * format.block_bytes()];
        for group in data.chunks_exact_mut(scratch.len()) {
            scratch.copy_from_slice(group);
            interleave_group(format, &scratch, blocks, group);
        }
        Self::from_parts(data, format, blocks)
    }

    fn from_parts(bytes: Vec<u8>, format: Format, blocks: usize) -> Self {
        Self {
            bytes,
            format,
            blocks,
            shared: 1,
        }
    }

    /// Q4_1 whose blocks come in pairs with the same scales and minimums (MLX groups of 64 or
    /// 128): each pair keeps one copy, 36 bytes per 64 values per row instead of 40, the MLX
    /// file's own size. Moved in place; anything else comes back unchanged.
    pub fn share_scales(mut self) -> Self {
        let (gbb, heads) = (group_block_bytes(self.format), 32);
        let pairs = self.bytes.len() / (2 * gbb);
        let same = |p: usize| {
            let b = &self.bytes[2 * p * gbb..][..2 * gbb];
            b[..heads] == b[gbb..gbb + heads]
        };
        if self.format != Format::Q4_1 || self.shared != 1 || !self.blocks.is_multiple_of(2) {
            return self;
        }
        if !(0..pairs).all(same) {
            return self;
        }
        let unit = gbb + 128;
        for p in 0..pairs {
            // Head and first codes, then the second block's codes (its head is dropped).
            self.bytes
                .copy_within(2 * p * gbb..2 * p * gbb + gbb, p * unit);
            let second = 2 * p * gbb + gbb + heads;
            self.bytes.copy_within(second..second + 128, p * unit + gbb);
        }
        self.bytes.truncate(pairs * unit);
        self.bytes.shrink_to_fit();
        self.shared = 2;
        self
    }

    /// Bytes of `shared` blocks of 8 rows: one set of scales and `shared` blocks of codes.
    pub fn unit_bytes(&self) -> usize {
        group_block_bytes(self.format) + 128 * (self.shared - 1)
    }

    /// Bytes of one group of 8 rows.
    pub fn group_bytes(&self) -> usize {
        self.blocks / self.shared * self.unit_bytes()
    }

    /// Group `g` (rows `8g..8g + 8`).
    pub fn group(&self, g: usize) -> &[u8] {
        &self.bytes[g * self.group_bytes()..][..self.group_bytes()]
    }

    /// Block `b` of row `r` in GGUF's layout, into `out`.
    pub fn row_block(&self, r: usize, b: usize, out: &mut [u8]) {
        let (f, bb) = (Fields::of(self.format), self.format.block_bytes());
        let ((qh, qs), (m_at, masks_at, codes_at)) = (f.row_offsets(), f.group_offsets());
        let (g, l, unit) = (r / ROWS, r % ROWS, self.unit_bytes());
        let gb = &self.group(g)[b / self.shared * unit..][..unit];
        // Block `b`'s codes: the `b % shared`-th after the unit's scales.
        let codes_at = codes_at + 128 * (b % self.shared);
        match self.format {
            Format::Q4K => return q4k::row_block(gb, l, &mut out[..bb]),
            Format::Q6K => return q6k::row_block(gb, l, &mut out[..bb]),
            _ => {}
        }
        out[..2].copy_from_slice(&gb[2 * l..2 * l + 2]);
        if f.min {
            out[2..4].copy_from_slice(&gb[m_at + 2 * l..m_at + 2 * l + 2]);
        }
        if f.fifth {
            let mut bits = 0u32;
            for k in 0..8 {
                let at = masks_at + 4 * k;
                let mask = u32::from_le_bytes([gb[at], gb[at + 1], gb[at + 2], gb[at + 3]]);
                bits |= ((mask >> (4 * l)) & 0xF) << (4 * k);
            }
            out[qh..qh + 4].copy_from_slice(&bits.to_le_bytes());
        }
        for c in 0..(bb - qs) / 4 {
            let at = codes_at + 32 * c + 4 * l;
            out[qs + 4 * c..qs + 4 * c + 4].copy_from_slice(&gb[at..at + 4]);
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

    /// Row `r` dequantized into `out` (`blocks · block_len` values), as ggml dequantizes it.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        if matches!(self.format, Format::Q4K | Format::Q6K) {
            let mut block = [0u8; 210];
            let bb = self.format.block_bytes();
            for (b, vals) in out.chunks_exact_mut(256).enumerate() {
                self.row_block(r, b, &mut block[..bb]);
                match self.format {
                    Format::Q4K => q4k::dequantize(&block, vals),
                    _ => q6k::dequantize(&block, vals),
                }
            }
            return;
        }
        let f = Fields::of(self.format);
        let (qh, qs) = f.row_offsets();
        let mut block = [0u8; 34];
        if self.format == Format::Q8_0 {
            for (b, vals) in out.chunks_exact_mut(32).enumerate() {
                self.row_block(r, b, &mut block);
                let d = super::format::f16_at(&block, 0);
                for (v, &q) in vals.iter_mut().zip(&block[2..]) {
                    *v = f32::from(q as i8) * d;
                }
            }
            return;
        }
        for (b, vals) in out.chunks_exact_mut(32).enumerate() {
            self.row_block(r, b, &mut block[..self.format.block_bytes()]);
            let d = super::format::f16_at(&block, 0);
            let m = if f.min {
                super::format::f16_at(&block, 2)
            } else {
                0.0
            };
            let bits = match f.fifth {
                true => {
                    u32::from_le_bytes([block[qh], block[qh + 1], block[qh + 2], block[qh + 3]])
                }
                false => 0,
            };
            for (i, v) in vals.iter_mut().enumerate() {
                let nibble = block[qs + i % 16] >> (4 * (i / 16)) & 0xF;
                let q = i32::from(nibble) | (((bits >> i) & 1) << 4) as i32;
                *v = match self.format {
                    Format::Q4_1 | Format::Q5_1 => q as f32 * d + m,
                    Format::Q5_0 => (q - 16) as f32 * d,
                    _ => (q - 8) as f32 * d,
                };
            }
        }
    }
}

/// One group of 8 GGUF rows (`data`, `blocks` blocks each) into its interleaved bytes `out`.
fn interleave_group(format: Format, data: &[u8], blocks: usize, out: &mut [u8]) {
    let (f, bb) = (Fields::of(format), format.block_bytes());
    let ((qh, qs), (m_at, masks_at, codes_at)) = (f.row_offsets(), f.group_offsets());
    let row_bytes = blocks * bb;
    for (b, gb) in out.chunks_exact_mut(group_block_bytes(format)).enumerate() {
        let src = |l: usize| &data[l * row_bytes + b * bb..][..bb];
        match format {
            Format::Q4K => q4k::interleave(std::array::from_fn(src), gb),
            Format::Q6K => q6k::interleave(std::array::from_fn(src), gb),
            _ => {}
        }
        if matches!(format, Format::Q4K | Format::Q6K) {
            continue;
        }
        let mut masks = [0u32; 8];
        for l in 0..ROWS {
            let src = src(l);
            gb[2 * l..2 * l + 2].copy_from_slice(&src[..2]);
            if f.min {
                gb[m_at + 2 * l..m_at + 2 * l + 2].copy_from_slice(&src[2..4]);
            }
            if f.fifth {
                let bits = u32::from_le_bytes([src[qh], src[qh + 1], src[qh + 2], src[qh + 3]]);
                for (k, mask) in masks.iter_mut().enumerate() {
                    *mask |= ((bits >> (4 * k)) & 0xF) << (4 * l);
                }
            }
            for c in 0..(bb - qs) / 4 {
                let at = codes_at + 32 * c + 4 * l;
                gb[at..at + 4].copy_from_slice(&src[qs + 4 * c..qs + 4 * c + 4]);
            }
        }
        if f.fifth {
            for (k, mask) in masks.iter().enumerate() {
                gb[masks_at + 4 * k..masks_at + 4 * k + 4].copy_from_slice(&mask.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_scales_keep_every_row() {
        let (rows, blocks, bb) = (16, 4, Format::Q4_1.block_bytes());
        let mut data: Vec<u8> = (0..rows * blocks * bb)
            .map(|i| (i * 7 + i / 11) as u8)
            .collect();
        // Pairs of blocks with the same scale and minimum, as MLX groups of 64 regroup.
        for row in data.chunks_exact_mut(blocks * bb) {
            for pair in row.chunks_exact_mut(2 * bb) {
                let head: [u8; 4] = pair[..4].try_into().unwrap();
                pair[bb..bb + 4].copy_from_slice(&head);
            }
        }
        let w = Interleaved::new(Format::Q4_1, &data, rows, blocks).share_scales();
        assert_eq!(w.shared, 2);
        assert_eq!(
            w.bytes.len(),
            rows * blocks * 36 / 2,
            "36 bytes per 64 values"
        );
        for r in 0..rows {
            assert_eq!(w.row(r), &data[r * blocks * bb..][..blocks * bb], "row {r}");
        }
        // A pair that differs keeps its own scales.
        data[bb] ^= 1;
        let w = Interleaved::new(Format::Q4_1, &data, rows, blocks).share_scales();
        assert_eq!((w.shared, w.bytes.len()), (1, data.len()));
    }

    #[test]
    fn rows_come_back_byte_for_byte() {
        for format in FORMATS {
            let (rows, blocks, bb) = (16, 3, format.block_bytes());
            let data: Vec<u8> = (0..rows * blocks * bb)
                .map(|i| (i * 7 + i / 13 + i * i / 101) as u8)
                .collect();
            let w = Interleaved::new(format, &data, rows, blocks);
            // Moving owned rows in place gives the same bytes.
            let moved = Interleaved::from_vec(format, data.clone(), rows, blocks);
            assert!(moved.bytes == w.bytes, "{format:?}: in place differs");
            for r in 0..rows {
                assert_eq!(
                    w.row(r),
                    &data[r * blocks * bb..][..blocks * bb],
                    "{format:?} row {r}"
                );
            }
            if matches!(format, Format::Q4K | Format::Q6K) {
                continue;
            }
            // Vector 1's codes of row 3 (values 4..8) sit at 32 + 4·3 in the low nibbles.
            let f = Fields::of(format);
            let (at, qs) = (f.group_offsets().2, f.row_offsets().1);
            assert_eq!(w.group(0)[at + 32 + 4 * 3], data[3 * blocks * bb + qs + 4]);
        }
    }
}
