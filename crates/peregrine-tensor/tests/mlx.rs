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
use peregrine_tensor::{DType, Device, Embedding, QLinear, Tensor};

mod common;

use common::{GROUPS, Rng, random_quantized, random_quantized_as};

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
