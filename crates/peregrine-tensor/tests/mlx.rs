//! MLX affine kernels against their bit-by-bit reference, for every supported bit width and
//! group size, on shapes chosen to hit the edges: row counts that are not a multiple of the
//! tile or of the decode kernel's row chunk, a single output row, decode (one input row) and
//! batches; decode runs both the automatic kernel (AVX2+FMA for 4 and 8 bits where the CPU has
//! it) and the forced scalar fallback, with bf16, f16 and f32 scales.
//!
//! Tolerance: the dequantized rows must be bit-identical (same `s * q + b` in f32); products
//! may differ by summation order only (the fused decode factors `s·Σqx + b·Σx` and uses 8
//! partial sums), so we allow 1e-5 × the sum of |w·x| terms, far below any decoding mistake
//! (one wrong code shifts a product by at least |scale| × |x|).

use peregrine_tensor::mlx::{Kernel, MlxQuantized, SUPPORTED_BITS, avx2_available};
use peregrine_tensor::quant::Format;
use peregrine_tensor::{DType, Device, Embedding, GgufMatrix, QLinear, Tensor};

/// Deterministic xorshift; the tests need no statistical quality, only variety.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn random_quantized(
    rng: &mut Rng,
    out: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
) -> MlxQuantized {
    random_quantized_as(rng, out, in_dim, bits, group, DType::BF16)
}

/// Random codes, scales and biases with the scales and biases stored as `dtype`.
fn random_quantized_as(
    rng: &mut Rng,
    out: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
    dtype: DType,
) -> MlxQuantized {
    let words = in_dim * bits / 32;
    let packed: Vec<u32> = (0..out * words).map(|_| rng.next() as u32).collect();
    let groups = in_dim / group;
    // Negative scales occur in real checkpoints (MLX stores max→min ranges that way).
    let scale = 1.0 / (1u32 << bits) as f32;
    let scales: Vec<f32> = (0..out * groups).map(|_| rng.uniform() * scale).collect();
    let biases: Vec<f32> = (0..out * groups).map(|_| rng.uniform() * 0.5).collect();
    let dev = Device::Cpu;
    MlxQuantized::new(
        Tensor::from_vec(packed, (out, words), &dev).unwrap(),
        Tensor::from_vec(scales, (out, groups), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
        Tensor::from_vec(biases, (out, groups), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
        bits,
        group,
    )
    .unwrap()
}

fn random_input(rng: &mut Rng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(
        (0..n).map(|_| rng.uniform()).collect::<Vec<f32>>(),
        dims,
        &Device::Cpu,
    )
    .unwrap()
}

/// Max |a - b| and the allowed error 1e-5 × max over outputs of Σ|w||x|.
fn check_product(q: &MlxQuantized, x: &Tensor, y: &Tensor, what: &str) {
    let w = q.dequantize_ref().unwrap();
    let y_ref = q.forward_ref(x).unwrap();
    assert_eq!(y.dims(), y_ref.dims(), "{what}: shape");
    let x2 = x.flatten_to(x.rank() - 2).unwrap();
    let bound = x2
        .abs()
        .unwrap()
        .matmul(&w.abs().unwrap().t().unwrap())
        .unwrap();
    let scale = bound
        .max_keepdim(1)
        .unwrap()
        .max(0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    let tol = 1e-5 * scale.to_scalar::<f32>().unwrap();
    let diff = (y - y_ref)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    let diff = diff.to_scalar::<f32>().unwrap();
    assert!(diff <= tol, "{what}: max abs diff {diff} > {tol}");
}

const GROUPS: [usize; 3] = [32, 64, 128];

#[test]
fn dequantized_rows_equal_reference_exactly() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            for (dtype, kernel) in [
                (DType::BF16, Kernel::best()),
                (DType::F16, Kernel::best()),
                (DType::F32, Kernel::Scalar),
                (DType::BF16, Kernel::Scalar),
            ] {
                let q = random_quantized_as(&mut rng, 5, group * 3, bits, group, dtype);
                let fused = q.dequantize_rows_with(0, 5, kernel).unwrap();
                let reference = q.dequantize_ref().unwrap().to_vec2::<f32>().unwrap();
                let what = format!("bits {bits} group {group} {dtype:?} {kernel:?}");
                assert_eq!(fused.to_vec2::<f32>().unwrap(), reference, "{what}");
            }
        }
    }
}

#[test]
fn decode_matvec_equals_reference() {
    // On x86-64 CI machines AVX2 is expected; print which paths ran so a log shows it.
    eprintln!("AVX2+FMA decode kernels available: {}", avx2_available());
    let mut rng = Rng(42);
    let dtypes = [DType::BF16, DType::F16, DType::F32];
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            // 1 row; 37 rows (not a multiple of the 8-row minimum chunk); 301 rows (several
            // chunks per thread and a short last one).
            for (i, out) in [1, 37, 301].into_iter().enumerate() {
                let dtype = dtypes[(i + bits) % 3];
                let q = random_quantized_as(&mut rng, out, group * 5, bits, group, dtype);
                let x = random_input(&mut rng, &[1, 1, group * 5]);
                for kernel in [Kernel::best(), Kernel::Scalar] {
                    let what =
                        format!("decode {kernel:?} bits {bits} group {group} out {out} {dtype:?}");
                    check_product(&q, &x, &q.forward_with(&x, 0, kernel).unwrap(), &what);
                }
            }
        }
    }
}

#[test]
fn decode_kernels_agree_on_model_sized_rows() {
    // A wide row (896 inputs, the smallest real model's hidden size) accumulates many groups.
    let mut rng = Rng(99);
    for bits in [4, 8] {
        for group in GROUPS {
            let q = random_quantized(&mut rng, 67, 896 / group * group, bits, group);
            let x = random_input(&mut rng, &[1, 896 / group * group]);
            for kernel in [Kernel::best(), Kernel::Scalar] {
                let what = format!("wide {kernel:?} bits {bits} group {group}");
                check_product(&q, &x, &q.forward_with(&x, 0, kernel).unwrap(), &what);
            }
        }
    }
}

#[test]
fn tiled_batch_equals_reference() {
    let mut rng = Rng(7);
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            // 37 rows with 8-row tiles leaves a 5-row tail; 1 row is a single short tile.
            for (out, tile) in [(37, 8), (1, 8), (37, 0)] {
                let dtype = [DType::BF16, DType::F16, DType::F32][(out + bits + tile) % 3];
                let q = random_quantized_as(&mut rng, out, group * 3, bits, group, dtype);
                let x = random_input(&mut rng, &[2, 3, group * 3]);
                for kernel in [Kernel::best(), Kernel::Scalar] {
                    let what =
                        format!("batch {kernel:?} bits {bits} group {group} out {out} tile {tile}");
                    let y = q.forward_with(&x, tile, kernel).unwrap();
                    check_product(&q, &x, &y, &what);
                }
            }
        }
    }
}

#[test]
fn bf16_input_keeps_its_dtype() {
    let mut rng = Rng(3);
    let q = random_quantized(&mut rng, 9, 64, 4, 32);
    let x = random_input(&mut rng, &[4, 64])
        .to_dtype(DType::BF16)
        .unwrap();
    assert_eq!(q.forward(&x).unwrap().dtype(), DType::BF16);
}

#[test]
fn quantized_embedding_looks_up_dequantized_rows() {
    let mut rng = Rng(11);
    for bits in SUPPORTED_BITS {
        let q = random_quantized(&mut rng, 13, 96, bits, 32);
        let emb = Embedding::MlxAffine(q.clone());
        let ids = Tensor::new(&[[12u32, 0, 5], [5, 7, 1]], &Device::Cpu).unwrap();
        let got = emb.forward(&ids, DType::F32).unwrap();
        let want = q
            .dequantize_ref()
            .unwrap()
            .index_select(&ids.flatten_all().unwrap(), 0)
            .unwrap();
        assert_eq!(got.dims(), &[2, 3, 96]);
        let got = got.flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got, want.to_vec2::<f32>().unwrap(), "bits {bits}");
        assert!(
            emb.forward(&Tensor::new(&[13u32], &Device::Cpu).unwrap(), DType::F32)
                .is_err()
        );
    }
}

#[test]
fn linear_adds_bias_and_reports_packed_bytes() {
    let mut rng = Rng(5);
    let q = random_quantized(&mut rng, 6, 128, 4, 64);
    let b = Tensor::new(&[1f32, 2., 3., 4., 5., 6.], &Device::Cpu).unwrap();
    let lin = QLinear::MlxAffine {
        w: q.clone(),
        b: Some(b.clone()),
    };
    let x = random_input(&mut rng, &[2, 128]);
    let want = q.forward_ref(&x).unwrap().broadcast_add(&b).unwrap();
    let diff = (lin.forward(&x).unwrap() - want)
        .unwrap()
        .abs()
        .unwrap()
        .max(1)
        .unwrap()
        .max(0)
        .unwrap();
    assert!(diff.to_scalar::<f32>().unwrap() < 1e-4);
    // 6 rows × 16 words × 4 B packed + 2 × 6 × 2 groups × 2 B bf16 scales/biases + 6 × 4 B bias.
    assert_eq!(lin.weight_bytes(), 6 * 16 * 4 + 2 * 6 * 2 * 2 + 6 * 4);
}

#[test]
fn scales_and_biases_keep_their_stored_dtype() {
    let mut rng = Rng(17);
    for (dtype, size) in [(DType::BF16, 2), (DType::F16, 2), (DType::F32, 4)] {
        let q = random_quantized_as(&mut rng, 10, 256, 4, 64, dtype);
        let (_, s, b) = q.parts();
        assert_eq!((s.dtype(), b.dtype()), (dtype, dtype));
        // Resident bytes are the file's: 10 × 32 words × 4 B + 2 × 10 × 4 groups × size.
        assert_eq!(q.weight_bytes(), 10 * 32 * 4 + 2 * 10 * 4 * size);
    }
    // Mixed dtypes: biases follow the scales.
    let packed = Tensor::zeros((4, 8), DType::U32, &Device::Cpu).unwrap();
    let s = Tensor::ones((4, 2), DType::F16, &Device::Cpu).unwrap();
    let b = Tensor::ones((4, 2), DType::F32, &Device::Cpu).unwrap();
    let q = MlxQuantized::new(packed, s, b, 4, 32).unwrap();
    assert_eq!(q.parts().2.dtype(), DType::F16);
}

#[test]
fn rejects_inconsistent_shapes() {
    let dev = Device::Cpu;
    let packed = Tensor::zeros((4, 8), DType::U32, &dev).unwrap();
    let sb = Tensor::zeros((4, 2), DType::F32, &dev).unwrap();
    assert!(MlxQuantized::new(packed.clone(), sb.clone(), sb.clone(), 4, 32).is_ok());
    assert!(MlxQuantized::new(packed.clone(), sb.clone(), sb.clone(), 7, 32).is_err());
    assert!(MlxQuantized::new(packed.clone(), sb.clone(), sb.clone(), 4, 64).is_err());
    assert!(
        MlxQuantized::new(packed.to_dtype(DType::F32).unwrap(), sb.clone(), sb, 4, 32).is_err()
    );
}

#[test]
fn quantize_round_trips_within_a_step() {
    let mut rng = Rng(13);
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            let w = random_input(&mut rng, &[7, group * 2]);
            let q = MlxQuantized::quantize(&w, bits, group).unwrap();
            let back = q.dequantize_ref().unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(
                q.parts().1.dtype(),
                DType::BF16,
                "MLX files store bf16 scales"
            );
            let scales = q.parts().1.to_dtype(DType::F32).unwrap();
            let scales = scales.to_vec2::<f32>().unwrap();
            for (r, (orig, back)) in w.to_vec2::<f32>().unwrap().iter().zip(&back).enumerate() {
                for (i, (a, b)) in orig.iter().zip(back).enumerate() {
                    // One step (the exact extreme can push the other one up to a step past
                    // the top code), plus the bf16 rounding of the bias (2^-8 of |edge| ≤ 1).
                    let step = scales[r][i / group].abs();
                    let tol = step + 1.0 / 256.0 + 1e-6;
                    assert!(
                        (a - b).abs() <= tol,
                        "bits {bits} group {group}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// Timings, not a check (speed is never asserted): `cargo test --release -p peregrine-tensor
/// --test mlx -- --ignored --nocapture timing`.
#[test]
#[ignore]
fn timing_decode_and_prefill() {
    let mut rng = Rng(1);
    for (out, in_dim) in [(4864, 896), (896, 4864), (151936, 896)] {
        for bits in [4, 8, 3] {
            let q = random_quantized(&mut rng, out, in_dim, bits, 64);
            let x = random_input(&mut rng, &[1, in_dim]);
            for kernel in [Kernel::best(), Kernel::Scalar] {
                q.forward_with(&x, 0, kernel).unwrap();
                let n = (2e9 / (out * in_dim) as f64).ceil() as usize;
                let t = std::time::Instant::now();
                for _ in 0..n {
                    q.forward_with(&x, 0, kernel).unwrap();
                }
                let dt = t.elapsed().as_secs_f64() / n as f64;
                let gbs = (out * in_dim * bits / 8) as f64 / dt / 1e9;
                eprintln!(
                    "decode [{out}, {in_dim}] {bits}-bit {kernel:?}: {:.3} ms ({gbs:.1} GB/s packed)",
                    dt * 1e3
                );
            }
            let x = random_input(&mut rng, &[40, in_dim]);
            q.forward(&x).unwrap();
            let t = std::time::Instant::now();
            q.forward(&x).unwrap();
            eprintln!(
                "prefill 40 × [{out}, {in_dim}] {bits}-bit: {:.2} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}

#[test]
fn decode_groups_equal_their_members() {
    let mut rng = Rng(7);
    // q/k/v-like (one format), then a mixed group (4 and 8 bits), which runs member by member.
    for bits in [[4, 4, 4], [4, 8, 4]] {
        let mats: Vec<MlxQuantized> = [96, 32, 40]
            .into_iter()
            .zip(bits)
            .map(|(out, b)| random_quantized(&mut rng, out, 128, b, 64))
            .collect();
        let refs: Vec<&MlxQuantized> = mats.iter().collect();
        let x = random_input(&mut rng, &[1, 1, 128]);
        let ys = MlxQuantized::forward_group(&refs, &x).unwrap();
        for (w, y) in mats.iter().zip(&ys) {
            let alone = w.forward(&x).unwrap();
            assert_eq!(y.dims(), alone.dims());
            let (y, alone) = (y.flatten_all().unwrap(), alone.flatten_all().unwrap());
            assert_eq!(
                y.to_vec1::<f32>().unwrap(),
                alone.to_vec1::<f32>().unwrap(),
                "{bits:?}"
            );
        }
    }
}

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
    let (words, groups) = (in_dim * bits / 32, in_dim / group);
    let packed: Vec<u32> = (0..out * words).map(|_| rng.next() as u32).collect();
    let mut away_from_zero = |scale: f32| {
        let u = rng.uniform();
        u.signum() * (0.01 + u.abs() * scale)
    };
    let scales: Vec<f32> = (0..out * groups).map(|_| away_from_zero(0.05)).collect();
    let biases: Vec<f32> = (0..out * groups).map(|_| away_from_zero(0.5)).collect();
    let t = |v: Vec<f32>| {
        let t = Tensor::from_vec(v, (out, groups), &Device::Cpu).unwrap();
        t.to_dtype(DType::BF16).unwrap()
    };
    let packed = Tensor::from_vec(packed, (out, words), &Device::Cpu).unwrap();
    MlxQuantized::new(packed, t(scales), t(biases), bits, group).unwrap()
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
