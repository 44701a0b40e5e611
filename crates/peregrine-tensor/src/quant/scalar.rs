//! Portable dot products of one weight row (GGUF blocks) with Q8 activations: the reference the
//! SIMD kernels are tested against, and the path on CPUs without them. Layouts follow ggml's
//! `block_*` structs byte for byte.

use super::act::{Q8Block, QK};
use super::format::{Format, f16_at, k_scale_min};

/// `Σ w·x` over one row: `w` holds the row's blocks, `x` its activations.
pub fn dot_row(format: Format, w: &[u8], x: &[Q8Block]) -> f32 {
    let (bytes, per_block) = (format.block_bytes(), format.block_len() / QK);
    w.chunks_exact(bytes)
        .zip(x.chunks_exact(per_block))
        .map(|(b, xs)| match format {
            Format::Q4_0 => q4_0(b, &xs[0]),
            Format::Q4_1 => q4_1(b, &xs[0]),
            Format::Q5_0 => q5_0(b, &xs[0]),
            Format::Q5_1 => q5_1(b, &xs[0]),
            Format::Q8_0 => q8_0(b, &xs[0]),
            Format::Q4K => q4_k(b, xs),
            Format::Q5K => q5_k(b, xs),
            Format::Q6K => q6_k(b, xs),
            Format::MLX8 | Format::MLX8G64 => mlx8(b, xs),
        })
        .sum()
}

/// One row's blocks `w` as values into `out`, without allocating: ggml's own dequantization
/// (candle's) for the GGUF formats, `scale · q + bias` for [`Format::MLX8`] and
/// [`Format::MLX8G64`].
pub fn dequantize_row(format: Format, w: &[u8], out: &mut [f32]) -> candle_core::Result<()> {
    use candle_core::quantized::k_quants::*;
    let (bytes, values) = (format.block_bytes(), format.block_len());
    if !w.len().is_multiple_of(bytes) || out.len() != w.len() / bytes * values {
        candle_core::bail!(
            "dequantize_row: {} bytes of {format:?} into {} values",
            w.len(),
            out.len()
        );
    }
    match format {
        Format::Q4_0 => ggml_blocks::<BlockQ4_0>(w, out),
        Format::Q4_1 => ggml_blocks::<BlockQ4_1>(w, out),
        Format::Q5_0 => ggml_blocks::<BlockQ5_0>(w, out),
        Format::Q5_1 => ggml_blocks::<BlockQ5_1>(w, out),
        Format::Q8_0 => ggml_blocks::<BlockQ8_0>(w, out),
        Format::Q4K => ggml_blocks::<BlockQ4K>(w, out),
        Format::Q5K => ggml_blocks::<BlockQ5K>(w, out),
        Format::Q6K => ggml_blocks::<BlockQ6K>(w, out),
        Format::MLX8 | Format::MLX8G64 => {
            for (b, out) in w.chunks_exact(bytes).zip(out.chunks_exact_mut(values)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for (o, &q) in out.iter_mut().zip(&b[4..]) {
                    *o = d * f32::from(q) + m;
                }
            }
            Ok(())
        }
    }
}

/// `w`'s whole blocks of `T` dequantized by candle into `out`.
fn ggml_blocks<T: candle_core::quantized::GgmlType>(
    w: &[u8],
    out: &mut [f32],
) -> candle_core::Result<()> {
    let size = std::mem::size_of::<T>();
    if !w.len().is_multiple_of(size)
        || !(w.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        candle_core::bail!(
            "dequantize_row: {} bytes are not whole aligned {:?} blocks",
            w.len(),
            T::DTYPE
        );
    }
    // SAFETY: GGUF block types are plain data (floats, f16s and byte arrays, no padding or
    // invalid bit patterns); `w` holds whole blocks at their alignment (checked above).
    let blocks = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<T>(), w.len() / size) };
    T::to_float(blocks, out);
    Ok(())
}

/// `Σ codes[i] · x.qs[i]` for unsigned codes.
fn idot(codes: impl Iterator<Item = u8>, x: &Q8Block) -> i32 {
    codes
        .zip(x.qs)
        .map(|(c, q)| i32::from(c) * i32::from(q))
        .sum()
}

/// The 32 4-bit codes of a Q4_0/Q4_1 block: low nibbles first, then high nibbles.
fn nibbles(qs: &[u8]) -> impl Iterator<Item = u8> + '_ {
    qs.iter().map(|q| q & 0xF).chain(qs.iter().map(|q| q >> 4))
}

/// The 32 5-bit codes of a Q5_0/Q5_1 block, the fifth bits from `qh`.
fn five_bits(qh: &[u8], qs: &[u8]) -> impl Iterator<Item = u8> {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    nibbles(qs)
        .enumerate()
        .map(move |(i, c)| c | (((qh >> i) & 1) as u8) << 4)
        .collect::<Vec<_>>()
        .into_iter()
}

fn q4_0(b: &[u8], x: &Q8Block) -> f32 {
    f16_at(b, 0) * (x.d * idot(nibbles(&b[2..18]), x) as f32 - 8.0 * x.dsum)
}

fn q4_1(b: &[u8], x: &Q8Block) -> f32 {
    let s = idot(nibbles(&b[4..20]), x);
    f16_at(b, 0) * x.d * s as f32 + f16_at(b, 2) * x.ds
}

fn q5_0(b: &[u8], x: &Q8Block) -> f32 {
    let s = idot(five_bits(&b[2..6], &b[6..22]), x);
    f16_at(b, 0) * (x.d * s as f32 - 16.0 * x.dsum)
}

fn q5_1(b: &[u8], x: &Q8Block) -> f32 {
    let s = idot(five_bits(&b[4..8], &b[8..24]), x);
    f16_at(b, 0) * x.d * s as f32 + f16_at(b, 2) * x.ds
}

fn q8_0(b: &[u8], x: &Q8Block) -> f32 {
    let s: i32 = (b[2..34].iter().zip(x.qs))
        .map(|(&w, q)| i32::from(w as i8) * i32::from(q))
        .sum();
    f16_at(b, 0) * x.d * s as f32
}

/// MLX8 and MLX8G64: one scale and bias over the block's 32-code halves.
fn mlx8(b: &[u8], xs: &[Q8Block]) -> f32 {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    (b[4..].chunks_exact(QK).zip(xs))
        .map(|(codes, x)| d * x.d * idot(codes.iter().copied(), x) as f32 + m * x.ds)
        .sum()
}

/// Q4_K: 8 sub-blocks of 32, each `d·sc·q - dmin·m` with 6-bit `sc`, `m`.
fn q4_k(b: &[u8], xs: &[Q8Block]) -> f32 {
    let (d, dmin, qs) = (f16_at(b, 0), f16_at(b, 2), &b[16..144]);
    (0..8)
        .map(|j| {
            let (sc, m) = k_scale_min(&b[4..16], j);
            let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let codes = q.iter().map(|c| if j % 2 == 0 { c & 0xF } else { c >> 4 });
            sub_block_k(d, dmin, sc, m, idot(codes, &xs[j]), &xs[j])
        })
        .sum()
}

/// Q5_K: Q4_K with a fifth bit per value from `qh` (bit `j` of byte `l` for sub-block `j`).
fn q5_k(b: &[u8], xs: &[Q8Block]) -> f32 {
    let (d, dmin, qh, qs) = (f16_at(b, 0), f16_at(b, 2), &b[16..48], &b[48..176]);
    (0..8)
        .map(|j| {
            let (sc, m) = k_scale_min(&b[4..16], j);
            let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let codes = q.iter().zip(qh).map(|(c, h)| {
                let low = if j % 2 == 0 { c & 0xF } else { c >> 4 };
                low | ((h >> j) & 1) << 4
            });
            sub_block_k(d, dmin, sc, m, idot(codes, &xs[j]), &xs[j])
        })
        .sum()
}

fn sub_block_k(d: f32, dmin: f32, sc: u8, m: u8, s: i32, x: &Q8Block) -> f32 {
    d * f32::from(sc) * x.d * s as f32 - dmin * f32::from(m) * x.dsum
}

/// Q6_K: 16 groups of 16 with i8 scales; 6-bit codes offset by 32.
fn q6_k(b: &[u8], xs: &[Q8Block]) -> f32 {
    let (ql, qh, scales, d) = (&b[..128], &b[128..192], &b[192..208], f16_at(b, 208));
    let mut total = 0f32;
    for (j, x) in xs.iter().enumerate() {
        // Sub-block j = 4n + t: low nibbles of ql[64n + 32(t%2)..] when t < 2, high otherwise;
        // the two high bits at position 2t of qh[32n..].
        let (n, t) = (j / 4, j % 4);
        let ql = &ql[64 * n + 32 * (t % 2)..][..32];
        let qh = &qh[32 * n..][..32];
        for g in 0..2 {
            let part: i32 = (16 * g..16 * g + 16)
                .map(|l| {
                    let low = if t < 2 { ql[l] & 0xF } else { ql[l] >> 4 };
                    let code = low | ((qh[l] >> (2 * t)) & 3) << 4;
                    i32::from(code) * i32::from(x.qs[l])
                })
                .sum();
            let sc = f32::from(scales[8 * n + 2 * t + g] as i8);
            total += d * sc * (x.d * part as f32 - 32.0 * x.dsum16[g]);
        }
    }
    total
}
