//! MLX 4- and 8-bit matrices regrouped into blocks for the integer kernels (GGUF Q4_1, our
//! MLX8/MLX8G64), from a loaded matrix and straight from a file's bytes: every weight kept bit
//! for bit, or the matrix declined.

mod common;

use common::{GROUPS, Rng, random_codes, random_quantized, random_quantized_as};
use peregrine_tensor::mlx::{MlxQuantized, avx2_available};
use peregrine_tensor::quant::Format;
use peregrine_tensor::{DType, Device, GgufMatrix, Tensor};

#[test]
fn q4_1_regrouping_keeps_every_weight() {
    let mut rng = Rng(21);
    for group in GROUPS {
        // bf16 scales of these magnitudes are f16 values, so the regrouped weights are the same
        // numbers: dequantized by candle's Q4_1 decoder they equal the MLX reference bit for bit.
        let q = random_quantized(&mut rng, 8, group * 3, 4, group);
        let q4 = q.to_q4_1().unwrap().expect("f16-exact scales regroup");
        let got = q4.dequantize(&Device::Cpu).unwrap();
        let want = q.dequantize_ref().unwrap();
        assert_eq!(got.dims(), want.dims(), "group {group}");
        // The kernels' matrix (interleaved on x86) holds the same rows.
        let m = q.to_gguf_matrix().unwrap().expect("regroups");
        assert_eq!(m.is_interleaved(), avx2_available());
        // Groups of 64 and 128 keep one scale and bias per 64 values: the MLX file's 4.5 bits.
        let per_64 = if group > 32 && m.is_interleaved() {
            36
        } else {
            40
        };
        assert_eq!(
            m.weight_bytes(),
            8 * group * 3 / 64 * per_64,
            "group {group}"
        );
        // Same arithmetic as the Q4_1 tensor through the kernels, to the bit.
        let plain = GgufMatrix::new(std::sync::Arc::new(q.to_q4_1().unwrap().unwrap())).unwrap();
        for kernel in peregrine_tensor::quant::Kernel::available() {
            for rows in [1, 5] {
                let x: Vec<f32> = (0..rows * group * 3)
                    .map(|i| (i % 17) as f32 * 0.1 - 0.8)
                    .collect();
                let (a, b) = (
                    m.matmul_with(&x, rows, kernel).unwrap(),
                    plain.matmul_with(&x, rows, kernel).unwrap(),
                );
                assert_eq!(a, b, "group {group} {kernel:?} {rows} inputs");
            }
        }
        let ids = Tensor::new(&[7u32, 0, 2], &Device::Cpu).unwrap();
        let rows = m.embedding(&ids).unwrap();
        let want_rows = want.index_select(&ids, 0).unwrap();
        assert_eq!(
            peregrine_tensor::ops::max_abs_diff(&rows, &want_rows).unwrap(),
            0.0
        );
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "group {group}"
        );
    }
    // A constant (here zero) row gets MLX's 1e-7 scale: with all codes zero it still regroups.
    let w = Tensor::from_vec(
        (0..4 * 64)
            .map(|i| {
                if i < 64 {
                    0.0
                } else {
                    (i % 13) as f32 / 13.0 - 0.5
                }
            })
            .collect::<Vec<f32>>(),
        (4, 64),
        &Device::Cpu,
    )
    .unwrap();
    let q = MlxQuantized::quantize(&w, 4, 32).unwrap();
    let zero_scale = q
        .parts()
        .1
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()[0][0];
    assert!(
        zero_scale.abs() < 1e-6,
        "{zero_scale}: not the case under test"
    );
    let q4 = q.to_q4_1().unwrap().expect("zero groups regroup");
    let got = q4.dequantize(&Device::Cpu).unwrap();
    assert_eq!(
        peregrine_tensor::ops::max_abs_diff(&got, &q.dequantize_ref().unwrap()).unwrap(),
        0.0
    );
    // f32 scales that f16 would round, and other widths, stay MLX.
    let inexact = random_quantized_as(&mut rng, 3, 64, 4, 32, DType::F32);
    assert!(inexact.to_q4_1().unwrap().is_none());
    let eight = random_quantized(&mut rng, 3, 64, 8, 32);
    assert!(eight.to_q4_1().unwrap().is_none());
}

#[test]
fn eight_bit_regrouping_keeps_every_weight() {
    let mut rng = Rng(23);
    for group in GROUPS {
        let q = random_quantized(&mut rng, 9, group * 3, 8, group);
        let m = q
            .to_gguf_matrix()
            .unwrap()
            .expect("f16-exact scales regroup");
        // An f16 scale and bias per 32 codes (groups of 32) or per 64 (larger groups: the
        // file's 8.5 bits a weight); not interleaved.
        assert!(!m.is_interleaved());
        let (values, bytes) = if group == 32 { (32, 36) } else { (64, 68) };
        assert_eq!(
            m.format(),
            Some(if group == 32 {
                Format::MLX8
            } else {
                Format::MLX8G64
            })
        );
        assert_eq!(
            m.weight_bytes(),
            9 * group * 3 / values * bytes,
            "group {group}"
        );
        // The same numbers: looked-up rows equal MLX's dequantization bit for bit (the kernels'
        // products are checked against the exact product in tests/quant.rs).
        let ids = Tensor::new(&[8u32, 0, 3, 3], &Device::Cpu).unwrap();
        let want = q.dequantize_ref().unwrap().index_select(&ids, 0).unwrap();
        let got = m.embedding(&ids).unwrap();
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "group {group}"
        );
    }
    let inexact = random_quantized_as(&mut rng, 3, 64, 8, 32, DType::F32);
    assert!(inexact.to_gguf_matrix().unwrap().is_none());
}

/// Random codes with bf16 scales and biases that are also f16 values (magnitudes 0.01-0.5: no
/// f16 subnormals), so every group regroups.
fn f16_exact_quantized(
    rng: &mut Rng,
    out: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
) -> MlxQuantized {
    let away_from_zero = |scale: f32| {
        move |r: &mut Rng| {
            let u = r.uniform();
            u.signum() * (0.01 + u.abs() * scale)
        }
    };
    let (scales, biases) = (away_from_zero(0.05), away_from_zero(0.5));
    random_codes(
        rng,
        (out, in_dim),
        (bits, group),
        DType::BF16,
        scales,
        biases,
    )
}

/// Regrouping straight from the file's bytes (`regroup_mapped`, what loading does) gives the
/// blocks regrouping the loaded matrix gives, at any alignment of the words, reports every band
/// of the bytes once, in order, and declines what it cannot do exactly (3 bits, inexact scales).
#[test]
fn regrouping_from_mapped_bytes_equals_regrouping_the_matrix() {
    let mut rng = Rng(31);
    let bytes_of = |q: &MlxQuantized| -> Vec<u8> {
        let words = q.parts().0.flatten_all().unwrap().to_vec1::<u32>().unwrap();
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    };
    for (bits, group) in [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)] {
        // Enough rows for three bands at 8 MiB of codes each.
        let (out, in_dim) = (2 * (8 << 20) / (2048 * bits / 8) + 5, 2048);
        let q = f16_exact_quantized(&mut rng, out, in_dim, bits, group);
        let (_, scales, biases) = q.parts();
        let bytes = bytes_of(&q);
        let mut bands = Vec::new();
        let mapped =
            MlxQuantized::regroup_mapped(&bytes, scales, biases, (bits, group), &mut |r| {
                bands.push(r)
            })
            .unwrap()
            .expect("regroups");
        assert!(bands.len() >= 3, "{bits} bits: {} bands", bands.len());
        assert_eq!(bands.first().unwrap().start, 0);
        assert_eq!(bands.last().unwrap().end, bytes.len());
        assert!(bands.windows(2).all(|w| w[0].end == w[1].start));
        let loaded = q.to_gguf_matrix().unwrap().expect("regroups");
        assert_eq!(mapped.format(), loaded.format());
        let ids = Tensor::new(&[0u32, 7, out as u32 - 1], &Device::Cpu).unwrap();
        let (a, b) = (
            mapped.embedding(&ids).unwrap(),
            loaded.embedding(&ids).unwrap(),
        );
        assert_eq!(
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{bits} bits, group {group}"
        );
        // Words one byte off four-byte alignment (files need not align them) read the same.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        let unaligned = (bits, group);
        let unaligned =
            MlxQuantized::regroup_mapped(&shifted[1..], scales, biases, unaligned, &mut |_| {})
                .unwrap()
                .expect("regroups");
        let c = unaligned.embedding(&ids).unwrap();
        assert_eq!(
            c.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{bits} bits, group {group}, unaligned"
        );
    }
    let three = random_quantized(&mut rng, 4, 64, 3, 32);
    let (_, s, b) = three.parts();
    let declined = MlxQuantized::regroup_mapped(&bytes_of(&three), s, b, (3, 32), &mut |_| {});
    assert!(declined.unwrap().is_none(), "3 bits do not regroup");
    let inexact = random_quantized_as(&mut rng, 3, 64, 8, 32, DType::F32);
    let (_, s, b) = inexact.parts();
    let declined = MlxQuantized::regroup_mapped(&bytes_of(&inexact), s, b, (8, 32), &mut |_| {});
    assert!(
        declined.unwrap().is_none(),
        "f32 scales that are not f16 values"
    );
}
