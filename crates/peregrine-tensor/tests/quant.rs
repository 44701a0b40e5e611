//! GGUF CPU kernels: every kernel equals the portable one, and the portable one is within the
//! provable bound of the exact f32 product of the dequantized weights.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use peregrine_tensor::GgufMatrix;
use peregrine_tensor::mlx::MlxQuantized;
use peregrine_tensor::quant::{Kernel, QK};

/// A format under test: a GGUF dtype (candle quantizes the matrix), or MLX 8-bit with groups
/// of 32 or 64 (MLX's quantizer, regrouped into `Format::MLX8` or `Format::MLX8G64` blocks).
#[derive(Debug, Clone, Copy)]
enum Case {
    Gguf(GgmlDType),
    Mlx8 { group: usize },
}

const CASES: [Case; 10] = [
    Case::Gguf(GgmlDType::Q4_0),
    Case::Gguf(GgmlDType::Q4_1),
    Case::Gguf(GgmlDType::Q5_0),
    Case::Gguf(GgmlDType::Q5_1),
    Case::Gguf(GgmlDType::Q8_0),
    Case::Gguf(GgmlDType::Q4K),
    Case::Gguf(GgmlDType::Q5K),
    Case::Gguf(GgmlDType::Q6K),
    Case::Mlx8 { group: 32 },
    Case::Mlx8 { group: 64 },
];

impl Case {
    fn block_size(self) -> usize {
        match self {
            Case::Gguf(dtype) => dtype.block_size(),
            Case::Mlx8 { group } => group,
        }
    }
}

/// Deterministic values in about [-1, 1] with some large outliers, as real activations have.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if i % 97 == 0 { u * 8.0 } else { u }
        })
        .collect()
}

fn matrix(case: Case, n: usize, k: usize) -> (GgufMatrix, Vec<f32>) {
    let w = Tensor::from_vec(
        values(n * k, n as u64 * 31 + k as u64),
        (n, k),
        &Device::Cpu,
    )
    .unwrap();
    let (matrix, dequantized) = match case {
        Case::Gguf(dtype) => {
            let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
            let dequantized = q.dequantize(&Device::Cpu).unwrap();
            (GgufMatrix::new(q).unwrap(), dequantized)
        }
        Case::Mlx8 { group } => {
            // The bias (the group's extreme) is within each 32-value block's max |w| of the
            // group, and a 64-value group's two blocks share it: the bound below holds.
            let q = MlxQuantized::quantize(&w, 8, group).unwrap();
            let m = q.to_gguf_matrix().unwrap().expect("bf16 scales regroup");
            (m, q.dequantize_ref().unwrap())
        }
    };
    let dequantized = dequantized.flatten_all().unwrap().to_vec1().unwrap();
    (matrix, dequantized)
}

/// Per output: the exact product, `Σ|w||x|`, and the worst case of quantizing `x` to 8 bits as
/// llama.cpp does: each input off by half a step (`amax / 254`) plus the step's f16 rounding
/// (relative 2⁻¹¹, times at most 127 steps); and the f16-rounded `d·Σq` of formats with a
/// minimum, off by 2⁻¹¹ of at most `Σ|x|`, times a minimum no larger than the block's `max|w|`.
fn exact(w: &[f32], x: &[f32], k: usize) -> Vec<(f32, f32, f32)> {
    let step_error = |amax: f32| amax / 127.0 * (0.5 + 127.0 / 2048.0);
    let half_steps: Vec<f32> = x
        .chunks(QK)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            std::iter::repeat_n(step_error(amax), QK)
        })
        .collect();
    let mut out = Vec::new();
    for xr in x.chunks(k) {
        let hs = &half_steps[out.len() / (w.len() / k) * k..][..k];
        for wr in w.chunks(k) {
            let (mut y, mut mag, mut q) = (0f64, 0f32, 0f32);
            for j in 0..k {
                y += f64::from(wr[j]) * f64::from(xr[j]);
                mag += (wr[j] * xr[j]).abs();
                q += wr[j].abs() * hs[j];
            }
            for (wb, xb) in wr.chunks(QK).zip(xr.chunks(QK)) {
                let wmax = wb.iter().fold(0f32, |m, v| m.max(v.abs()));
                q += wmax * xb.iter().map(|v| v.abs()).sum::<f32>() / 2048.0;
            }
            out.push((y as f32, mag, q));
        }
    }
    out
}

#[test]
fn every_kernel_matches_the_exact_product_within_the_quantization_bound() {
    for case in CASES {
        let ks: &[usize] = match case.block_size() {
            256 => &[256, 768],
            64 => &[64, 192, 768],
            _ => &[32, 160, 768],
        };
        for &k in ks {
            // 8 and 40 rows: all but Q5_K and MLX8 interleave 8 rows at a time on x86.
            for n in [1, 7, 8, 37, 40] {
                let (w, wf) = matrix(case, n, k);
                assert!(w.format().is_some(), "{case:?} should have a kernel");
                for m in [1, 3, 70] {
                    let x = values(m * k, (m * 1000 + k) as u64);
                    let reference = exact(&wf, &x, k);
                    let scalar = w.matmul_with(&x, m, Kernel::Scalar).unwrap();
                    for kernel in Kernel::available() {
                        let y = w.matmul_with(&x, m, kernel).unwrap();
                        for (i, ((got, s), (want, mag, qbound))) in
                            y.iter().zip(&scalar).zip(&reference).enumerate()
                        {
                            let case = format!("{case:?} {kernel:?} n={n} k={k} m={m} out {i}");
                            // Same integer sums; only the float summation order differs.
                            assert!((got - s).abs() <= 1e-5 * mag, "{case}: {got} vs scalar {s}");
                            // Quantizing x is the only approximation: bounded by half a step.
                            let tol = qbound * 1.001 + 1e-5 * mag;
                            assert!((got - want).abs() <= tol, "{case}: {got} vs {want} ± {tol}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn forward_keeps_leading_dims_and_formats_without_kernels_fall_back() {
    let (w, wf) = matrix(Case::Gguf(GgmlDType::Q4K), 9, 256);
    let x = values(2 * 3 * 256, 5);
    let xt = Tensor::from_vec(x.clone(), (2, 3, 256), &Device::Cpu).unwrap();
    let y = w.forward(&xt).unwrap();
    assert_eq!(y.dims(), &[2, 3, 9]);
    let want = w.matmul_with(&x, 6, Kernel::best()).unwrap();
    assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);

    let dense = Tensor::from_vec(wf, (9, 256), &Device::Cpu).unwrap();
    let f16 =
        GgufMatrix::new(Arc::new(QTensor::quantize(&dense, GgmlDType::F16).unwrap())).unwrap();
    assert_eq!(f16.format(), None);
    let (y16, y32) = (f16.forward(&xt).unwrap(), y.clone());
    let diff = (y16 - y32).unwrap().abs().unwrap().max_all().unwrap();
    assert!(
        diff.to_scalar::<f32>().unwrap() < 0.5,
        "f16 fallback far from the Q4_K kernel"
    );
}

#[test]
fn interleaved_rows_equal_the_file_layout() {
    let formats = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ];
    for dtype in formats {
        let (n, k) = (24, if dtype.block_size() == 256 { 512 } else { 160 });
        let w = Tensor::from_vec(values(n * k, 3), (n, k), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        let (fast, rows) = (
            GgufMatrix::new(q.clone()).unwrap(),
            GgufMatrix::new_rows(q.clone()).unwrap(),
        );
        assert_eq!(
            fast.is_interleaved(),
            Kernel::best().has_avx2(),
            "{dtype:?}"
        );
        // The same bytes, moved; Q4_K's 6-bit scales and minimums take a byte each (+32 per 8).
        let extra = match (dtype, fast.is_interleaved()) {
            (GgmlDType::Q4K, true) => n / 8 * k / 256 * 32,
            _ => 0,
        };
        assert_eq!(
            fast.weight_bytes(),
            rows.weight_bytes() + extra,
            "{dtype:?}"
        );
        // Lookups (tied embeddings) dequantize as candle does, bit for bit.
        let ids = Tensor::new(&[[23u32, 0], [8, 15]], &Device::Cpu).unwrap();
        let (got, want) = (fast.embedding(&ids).unwrap(), q.embedding(&ids).unwrap());
        assert_eq!(got.dims(), &[2, 2, k]);
        assert_eq!(
            peregrine_tensor::ops::max_abs_diff(&got, &want).unwrap(),
            0.0
        );
        assert!(
            fast.embedding(&Tensor::new(&[24u32], &Device::Cpu).unwrap())
                .is_err()
        );
        let wf = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        let wf: Vec<f32> = wf.to_vec1().unwrap();
        // Decode, one call of 5 to 8 inputs (4 and a tail with AVX2), a tile of 8 and tails, and
        // a prefill-sized batch.
        for m in [1, 5, 6, 7, 8, 13, 15, 70] {
            let x = values(m * k, m as u64);
            // VNNI's and AVX2's interleaved kernels do the same float operations on the same
            // exact integer sums: the same bits, whichever the CPU picks.
            let (avx2, vnni) = (Kernel::Avx2, Kernel::Avx512Vnni);
            if vnni.runs_here() && fast.is_interleaved() {
                let (a, b) = (fast.matmul_with(&x, m, avx2), fast.matmul_with(&x, m, vnni));
                let (a, b) = (a.unwrap(), b.unwrap());
                let same = a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?} m={m}: VNNI's bits are not AVX2's");
            }
            for kernel in Kernel::available() {
                let (a, b) = (
                    fast.matmul_with(&x, m, kernel).unwrap(),
                    rows.matmul_with(&x, m, kernel).unwrap(),
                );
                // Batch invariance: each input's outputs are its solo product's, bit for bit,
                // whatever kernel tile it went through (continuous batching relies on it).
                for (i, input) in x.chunks_exact(k).enumerate().filter(|_| m < 70) {
                    let solo = fast.matmul_with(input, 1, kernel).unwrap();
                    let batched = &a[i * n..][..n];
                    let same = solo
                        .iter()
                        .zip(batched)
                        .all(|(s, b)| s.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dtype:?} {kernel:?} m={m} input {i}: not its solo bits"
                    );
                }
                for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                    // Summation order only: 1e-5 of Σ|w·x|, as in the test above.
                    let (input, row) = (&x[i / n * k..][..k], &wf[i % n * k..][..k]);
                    let mag: f32 = input.iter().zip(row).map(|(x, w)| (x * w).abs()).sum();
                    let tol = 1e-5 * mag;
                    assert!(
                        (a - b).abs() <= tol,
                        "{dtype:?} {kernel:?} m={m} out {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn input_of_the_wrong_width_is_an_error() {
    let (w, _) = matrix(Case::Gguf(GgmlDType::Q8_0), 4, 64);
    let err = w.matmul_with(&[0.0; 63], 1, Kernel::Scalar).unwrap_err();
    assert!(err.to_string().contains("63 inputs"), "{err}");
    let x = Tensor::zeros((1, 65), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(w.forward(&x).is_err());
}

#[test]
fn a_group_equals_its_members_one_by_one() {
    let (a, _) = matrix(Case::Gguf(GgmlDType::Q4K), 9, 256);
    let (b, _) = matrix(Case::Gguf(GgmlDType::Q6K), 5, 256);
    let (c, _) = matrix(Case::Gguf(GgmlDType::Q8_0), 3, 256);
    let x = values(7 * 256, 9);
    for kernel in Kernel::available() {
        let group = GgufMatrix::matmul_group(&[&a, &b, &c], &x, 7, kernel).unwrap();
        for (y, w) in group.iter().zip([&a, &b, &c]) {
            assert_eq!(y, &w.matmul_with(&x, 7, kernel).unwrap(), "{kernel:?}");
        }
    }
    let (wide, _) = matrix(Case::Gguf(GgmlDType::Q8_0), 3, 512);
    assert!(GgufMatrix::matmul_group(&[&a, &wide], &x, 7, Kernel::Scalar).is_err());
}

#[test]
fn linear_groups_add_each_layers_bias() {
    let layer = |dtype, n, seed| {
        let w = Tensor::from_vec(values(n * 64, seed), (n, 64), &Device::Cpu).unwrap();
        let b = Tensor::from_vec(values(n, seed + 1), n, &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        peregrine_tensor::QLinear::from_qtensor(q, Some(b)).unwrap()
    };
    let (a, b) = (layer(GgmlDType::Q4_0, 6, 1), layer(GgmlDType::Q8_0, 4, 2));
    let x = Tensor::from_vec(values(2 * 64, 3), (1, 2, 64), &Device::Cpu).unwrap();
    let group = peregrine_tensor::QLinear::forward_group(&[&a, &b], &x).unwrap();
    for (y, l) in group.iter().zip([&a, &b]) {
        let alone = l.forward(&x).unwrap();
        assert_eq!(y.dims(), alone.dims());
        assert_eq!(peregrine_tensor::ops::max_abs_diff(y, &alone).unwrap(), 0.0);
    }
}

/// A decode step's embedding lookup (`row_into`, no allocation) equals candle's dequantization
/// bit for bit, in the file's row layout and the interleaved one, for every GGUF format.
#[test]
fn row_lookups_equal_candles_dequantization() {
    let formats = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];
    for dtype in formats {
        let (n, k) = (16, if dtype.block_size() == 256 { 512 } else { 96 });
        let w = Tensor::from_vec(values(n * k, 7), (n, k), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        let want = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for m in [GgufMatrix::new(q.clone()), GgufMatrix::new_rows(q.clone())] {
            let m = m.unwrap();
            let mut row = vec![f32::NAN; k];
            for (r, want) in want.iter().enumerate() {
                m.row_into(r, &mut row).unwrap();
                assert_eq!(
                    &row,
                    want,
                    "{dtype:?} row {r} (interleaved: {})",
                    m.is_interleaved()
                );
            }
            assert!(
                m.row_into(n, &mut row).is_err(),
                "{dtype:?}: a row past the end"
            );
            assert!(
                m.row_into(0, &mut row[1..]).is_err(),
                "{dtype:?}: a short output"
            );
        }
    }
}
