//! The K-quant group blocks of [`Interleaved`](super::interleaved::Interleaved): where each
//! field sits, and the moves in and out of GGUF's block (exact both ways).

/// Q4_K's group block: offsets and the moves in and out of GGUF's block.
pub mod q4k {
    use super::super::format::{f16_at, k_scale_min};
    use super::super::interleaved::ROWS;

    /// The 8 rows' f16 minimum scales.
    pub const DMIN: usize = 16;
    /// Sub-block scales, `[sub-block][row]` bytes.
    pub const SCALES: usize = 32;
    /// Sub-block minimums, `[sub-block][row]` bytes.
    pub const MINS: usize = 96;
    /// Codes: 4 pairs of sub-blocks × 8 vectors × 32 bytes.
    pub const CODES: usize = 160;
    /// Bytes over 8 GGUF blocks: the 6-bit scales and minimums take a byte each.
    pub const EXTRA: usize = CODES + 1024 - 8 * 144;

    /// 8 rows' GGUF blocks into one group block.
    pub fn interleave(src: [&[u8]; ROWS], gb: &mut [u8]) {
        for (l, b) in src.iter().enumerate() {
            gb[2 * l..2 * l + 2].copy_from_slice(&b[..2]);
            gb[DMIN + 2 * l..DMIN + 2 * l + 2].copy_from_slice(&b[2..4]);
            for j in 0..8 {
                (gb[SCALES + 8 * j + l], gb[MINS + 8 * j + l]) = k_scale_min(&b[4..16], j);
            }
            for p in 0..4 {
                for c in 0..8 {
                    let at = CODES + 256 * p + 32 * c + 4 * l;
                    gb[at..at + 4].copy_from_slice(&b[16 + 32 * p + 4 * c..][..4]);
                }
            }
        }
    }

    /// Row `l`'s GGUF block from a group block.
    pub fn row_block(gb: &[u8], l: usize, out: &mut [u8]) {
        out[..2].copy_from_slice(&gb[2 * l..2 * l + 2]);
        out[2..4].copy_from_slice(&gb[DMIN + 2 * l..DMIN + 2 * l + 2]);
        // ggml's 12-byte packing (the inverse of `get_scale_min_k4`).
        let (sc, m) = (
            |j: usize| gb[SCALES + 8 * j + l],
            |j: usize| gb[MINS + 8 * j + l],
        );
        let packed = &mut out[4..16];
        for j in 0..4 {
            packed[j] = sc(j) | (sc(j + 4) >> 4) << 6;
            packed[j + 4] = m(j) | (m(j + 4) >> 4) << 6;
            packed[j + 8] = (sc(j + 4) & 0xF) | (m(j + 4) & 0xF) << 4;
        }
        for p in 0..4 {
            for c in 0..8 {
                let at = CODES + 256 * p + 32 * c + 4 * l;
                out[16 + 32 * p + 4 * c..][..4].copy_from_slice(&gb[at..at + 4]);
            }
        }
    }

    /// One GGUF Q4_K block's 256 values, as ggml's `dequantize_row_q4_K`.
    pub fn dequantize(b: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        for (j, vals) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = k_scale_min(&b[4..16], j);
            let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
            let q = &b[16 + 32 * (j / 2)..][..32];
            for (v, c) in vals.iter_mut().zip(q) {
                let code = if j % 2 == 0 { c & 0xF } else { c >> 4 };
                *v = d1 * f32::from(code) - m1;
            }
        }
    }
}

/// Q6_K's group block. GGUF's Q6_K holds 256 values as low nibbles (`ql`, two sub-blocks per
/// byte), high 2-bit pairs (`qh`, four sub-blocks per byte), an i8 scale per 16 values and an f16
/// scale. Sub-block `j = 4n + t` (half `n`, `t` in 0..4) takes the low (t < 2) or high nibbles of
/// `ql[64n + 32(t % 2)..]`, bits `2t, 2t + 1` of `qh[32n..]` and scales `8n + 2t`, `8n + 2t + 1`.
/// The group block is exactly 8 GGUF blocks long.
pub mod q6k {
    use super::super::format::f16_at;
    use super::super::interleaved::ROWS;

    /// The rows' i8 scales, `[16-value group][row]`.
    pub const SCALES: usize = 16;
    /// `ql`, per pair of sub-blocks sharing its bytes (`2n + t % 2`): 8 vectors × 32 bytes.
    pub const QL: usize = SCALES + 128;
    /// `qh`, per half: 8 vectors × 32 bytes.
    pub const QH: usize = QL + 1024;

    /// 8 rows' GGUF blocks into one group block.
    pub fn interleave(src: [&[u8]; ROWS], gb: &mut [u8]) {
        for (l, b) in src.iter().enumerate() {
            gb[2 * l..2 * l + 2].copy_from_slice(&b[208..210]);
            for g in 0..16 {
                gb[SCALES + 8 * g + l] = b[192 + g];
            }
            for c in 0..8 {
                for pair in 0..4 {
                    let at = QL + 256 * pair + 32 * c + 4 * l;
                    gb[at..at + 4].copy_from_slice(&b[32 * pair + 4 * c..][..4]);
                }
                for n in 0..2 {
                    let at = QH + 256 * n + 32 * c + 4 * l;
                    gb[at..at + 4].copy_from_slice(&b[128 + 32 * n + 4 * c..][..4]);
                }
            }
        }
    }

    /// Row `l`'s GGUF block from a group block.
    pub fn row_block(gb: &[u8], l: usize, out: &mut [u8]) {
        out[208..210].copy_from_slice(&gb[2 * l..2 * l + 2]);
        for g in 0..16 {
            out[192 + g] = gb[SCALES + 8 * g + l];
        }
        for c in 0..8 {
            for pair in 0..4 {
                let at = QL + 256 * pair + 32 * c + 4 * l;
                out[32 * pair + 4 * c..][..4].copy_from_slice(&gb[at..at + 4]);
            }
            for n in 0..2 {
                let at = QH + 256 * n + 32 * c + 4 * l;
                out[128 + 32 * n + 4 * c..][..4].copy_from_slice(&gb[at..at + 4]);
            }
        }
    }

    /// One GGUF Q6_K block's 256 values, as ggml's `dequantize_row_q6_K`.
    pub fn dequantize(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b, 208);
        for (j, vals) in out.chunks_exact_mut(32).enumerate() {
            let (n, t) = (j / 4, j % 4);
            let (ql, qh) = (&b[64 * n + 32 * (t % 2)..][..32], &b[128 + 32 * n..][..32]);
            for (i, v) in vals.iter_mut().enumerate() {
                let low = if t < 2 { ql[i] & 0xF } else { ql[i] >> 4 };
                let q = i32::from(low | ((qh[i] >> (2 * t)) & 3) << 4) - 32;
                let sc = b[192 + 8 * n + 2 * t + i / 16] as i8;
                *v = d * f32::from(sc) * q as f32;
            }
        }
    }
}
